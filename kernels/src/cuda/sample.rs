//! Sampling, log-probabilities, the token mask and the speculative acceptance rules on the device
//! (`kernels/cuda/sample.cu`), so that full logits never cross to the host.
//!
//! Invariants:
//! - Every row is decided by the same function as the CPU reference: `sampling::Distribution::from_logits`
//!   (mask as `-inf` first, then temperature → top-k → top-p, ties to the lowest id), the inverse CDF
//!   over ascending ids at `sampling::uniform(seed, position, stream)` (the counter RNG, ported bit for
//!   bit), `acceptance::verify`'s accept test and residual, and `sampling::logprobs`.
//! - A row's result depends only on the row (fixed reduction order, integer histograms), never on
//!   what else is launched with it.
//! - Sums run in f64 in another order than the CPU's, so a token can differ from the CPU's only where
//!   `u` (or `top_p`) lies within about 1e-12 of a cumulative mass; log-probabilities agree to f32
//!   rounding. Draft distributions `q` arrive as f32 probabilities (the CPU computes them in f64), so
//!   with a device `q` the accept test and residual agree to about 1e-7 relative.
//! - Only the small per-row results come back: tokens, accept flags and requested log-probabilities.
//! - Input checks (parameters, draft ids, mask size, `top_n`) happen on the host before any launch; a
//!   row whose logits hold NaN or +inf, or are all masked, is a [`KernelError::InvalidInput`].
//!
//! - The row descriptor the host writes (`RowDesc`) and the one `sample.cu` reads (`D_*` word indices) have
//!   one layout; a unit test pins every field's offset, the descriptor's size and the shared constants to the
//!   kernel source's `#define`s.
//!
//! API ([`SampleKernels`]) for callers that keep distributions on the device (the DSpark drafter):
//! [`SampleKernels::probs_from_logits`] (the processed `q`), [`SampleKernels::sample_rows`] (one token per row
//! with any RNG stream, e.g. `dspark::model::DRAFT_STREAM`), [`SampleKernels::verify_rows`] (the acceptance rule
//! over verify windows, with one-hot or device `q`), and [`DrawPlan`] (f32 logits rows sampled with their tokens
//! and `q` written to device memory, launch after launch without a host round trip: the drafter's Markov loop).
//! f32 rows are never rounded to bf16: the kernel keys their full 32-bit values. A draw whose only processing is
//! the temperature runs wide (`ceil(vocab / 8192)` blocks per row, chunk partials then the pick), so a sampled
//! draft position costs about what its argmax costs instead of one block walking the whole vocabulary
//! (decisions.md D67).

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig};

use crate::acceptance::{AcceptanceMode, Verdict};
use crate::cuda::gpu::Gpu;
use crate::cuda::launch::{grid_1d, DPtr, NULL};
use crate::cuda::staging::Download;
use crate::error::{KernelError, Result};
use crate::runner::{SamplingParams, TokenId, TokenLogprob, TokenMask};
use crate::sampling::{check_params, RngStream};

/// The most top-N alternatives a row may ask for with its log-probabilities.
pub const MAX_TOP_N: usize = 64;

/// u64 words per row descriptor (`DESC_WORDS` in sample.cu): the size of [`RowDesc`].
const DESC_WORDS: usize = std::mem::size_of::<RowDesc>() / 8;
/// u32 words of a row's result (`STATUS_WORDS` in sample.cu): token, accepted, error code, error id,
/// f32 bits of the token's and of the draft's log-probability.
const STATUS_WORDS: usize = 6;
const NO_ID: u32 = u32::MAX;
const MODE_SAMPLE: u64 = 0;
const MODE_VERIFY: u64 = 1;
const MODE_PROBS: u64 = 2;
const ERR_BAD_LOGIT: u32 = 1;

/// The element type of the logits rows the kernel reads: the target's bf16 logits (`sample_rows`), or the DSpark
/// drafter's f32 Markov logits (`sample_rows_f32`, never rounded to bf16).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsDtype {
    Bf16,
    F32,
}

/// One row's descriptor as `sample.cu` reads it: one u64 word per field, in this order (`D_LOGITS` ..
/// `D_TOKEN_OUT`, the word indices of the kernel source; a unit test pins each field's offset to them).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RowDesc {
    /// `[vocab]` logits, bf16 or f32 by kernel.
    logits: u64,
    /// f32 `[vocab]` processed draft probabilities; 0: one-hot on the draft.
    q: u64,
    /// f32 `[vocab]` processed probabilities out; 0: none.
    probs_out: u64,
    seed: u64,
    position: u64,
    /// The RNG stream of the emitted token.
    stream: u64,
    /// temperature f32 bits | top_p f32 bits << 32.
    temp_top_p: u64,
    /// top_k u32 | draft id << 32 (`NO_ID`: none).
    top_k_draft: u64,
    /// 0: no log-probabilities, else top_n + 1.
    top_n: u64,
    mode: u64,
    /// u32 the row's token is also written to; 0: not.
    token_out: u64,
    /// `[ceil(vocab / 32)]` u32: the row's own token mask (a grammar's), applied beside the launch's; 0: none.
    row_mask: u64,
}

// SAFETY: twelve u64 fields under `repr(C)`: no padding, every bit pattern valid.
unsafe impl bytemuck::Zeroable for RowDesc {}
// SAFETY: as above; `Copy` and `'static`.
unsafe impl bytemuck::Pod for RowDesc {}

/// The token mask on the device: `[ceil(vocab / 32)]` u32 words, bit `id % 32` of word `id / 32` set
/// when `id` may be emitted.
pub struct DeviceTokenMask {
    words: CudaSlice<u32>,
    vocab: usize,
}

impl DeviceTokenMask {
    /// Uploads `mask`; it must allow at least one id.
    pub fn upload(gpu: &Gpu, mask: &TokenMask) -> Result<Self> {
        if mask.num_allowed() == 0 {
            return Err(KernelError::InvalidInput("a token mask must allow at least one id".into()));
        }
        Ok(DeviceTokenMask { words: gpu.upload(&mask_words(mask))?, vocab: mask.vocab() })
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The device address of the words.
    pub fn ptr(&self, gpu: &Gpu) -> DPtr {
        gpu.ptr(&self.words)
    }
}

/// The bit words of `mask` (bit set: allowed).
pub fn mask_words(mask: &TokenMask) -> Vec<u32> {
    let mut words = vec![0u32; mask.vocab().div_ceil(32)];
    for id in 0..mask.vocab() as TokenId {
        if mask.is_allowed(id) {
            words[id as usize / 32] |= 1 << (id % 32);
        }
    }
    words
}

/// One logits row's job for the kernel.
#[derive(Clone, Debug)]
struct RowJob<'a> {
    /// bf16 `[vocab]`.
    logits: DPtr,
    /// f32 `[vocab]` processed draft probabilities; [`NULL`]: one-hot on `draft`.
    q: DPtr,
    /// f32 `[vocab]` processed probabilities out; [`NULL`]: none.
    probs_out: DPtr,
    params: &'a SamplingParams,
    position: u64,
    stream: u64,
    draft: Option<TokenId>,
    mode: u64,
    /// u32 the token is also written to; [`NULL`]: none.
    token_out: DPtr,
    /// `[ceil(vocab / 32)]` u32: the row's own mask, beside the launch's; [`NULL`]: none.
    row_mask: DPtr,
}

impl RowJob<'_> {
    fn encode(&self, out: &mut Vec<u64>) {
        let p = self.params;
        let desc = RowDesc {
            logits: self.logits,
            q: self.q,
            probs_out: self.probs_out,
            seed: p.seed,
            position: self.position,
            stream: self.stream,
            temp_top_p: p.temperature.to_bits() as u64 | (p.top_p.to_bits() as u64) << 32,
            top_k_draft: p.top_k.min(u32::MAX as usize) as u64 | (self.draft.unwrap_or(NO_ID) as u64) << 32,
            top_n: p.logprobs.map_or(0, |n| n as u64 + 1),
            mode: self.mode,
            token_out: self.token_out,
            row_mask: self.row_mask,
        };
        out.extend_from_slice(&bytemuck::cast::<RowDesc, [u64; DESC_WORDS]>(desc));
    }
}

/// What the kernel decided for one row.
#[derive(Clone, Debug, PartialEq)]
struct RowResult {
    /// The sampled (or residual, or accepted draft) token; the argmax for greedy rows.
    token: TokenId,
    /// The draft passed the accept test (greedy: it equals the argmax).
    accepted: bool,
    logprob_token: f32,
    logprob_draft: f32,
    /// Best first, as many as asked.
    top: Vec<(TokenId, f32)>,
}

/// The row kernel's results on their way back (`SampleKernels::launch_jobs`). The device buffers the launch
/// reads and writes are kept until the results are read.
struct PendingJobs {
    /// Per job: how many top log-probabilities it asked for.
    top_n: Vec<usize>,
    /// `None` for no jobs.
    results: Option<JobCopies>,
}

/// The copies of a launch's results on their way back, and the device buffers the launch reads and writes.
struct JobCopies {
    status: Download<u32>,
    top: Option<Download<u32>>,
    _buffers: (CudaSlice<u64>, CudaSlice<u32>, CudaSlice<u32>),
}

impl PendingJobs {
    /// Waits for the results (this launch's copies only) and decodes each row's.
    fn wait(self) -> Result<Vec<RowResult>> {
        let Some(JobCopies { status, top, .. }) = self.results else { return Ok(Vec::new()) };
        let status = status.wait()?;
        let top = match top {
            Some(top) => top.wait()?,
            None => Vec::new(),
        };
        self.top_n
            .iter()
            .enumerate()
            .map(|(r, &n)| {
                let st = &status[r * STATUS_WORDS..(r + 1) * STATUS_WORDS];
                check_status(r, st)?;
                let at = |i: usize| r * MAX_TOP_N * 2 + 2 * i;
                let top = (0..n).map(|i| (top[at(i)], f32::from_bits(top[at(i) + 1]))).collect();
                Ok(RowResult {
                    token: st[0],
                    accepted: st[1] != 0,
                    logprob_token: f32::from_bits(st[4]),
                    logprob_draft: f32::from_bits(st[5]),
                    top,
                })
            })
            .collect()
    }
}

fn check_job(job: &RowJob<'_>, vocab: usize) -> Result<()> {
    check_params(job.params)?;
    if let Some(n) = job.params.logprobs {
        if n > MAX_TOP_N {
            return Err(KernelError::InvalidInput(format!(
                "{n} top log-probabilities asked for; the CUDA sampler returns at most {MAX_TOP_N}"
            )));
        }
    }
    if let Some(d) = job.draft {
        if d as usize >= vocab {
            return Err(KernelError::InvalidInput(format!("draft token {d} is outside a vocabulary of {vocab}")));
        }
    }
    Ok(())
}

/// The error a row's status words report, if any.
fn check_status(row: usize, st: &[u32]) -> Result<()> {
    match st[2] {
        0 => Ok(()),
        ERR_BAD_LOGIT => {
            Err(KernelError::InvalidInput(format!("logits row {row}: the logit of token {} is NaN or +inf", st[3])))
        }
        _ => Err(KernelError::InvalidInput(format!("logits row {row}: every logit is -inf (all masked)"))),
    }
}

fn check_rows_params(rows: usize, params: &[SamplingParams]) -> Result<()> {
    if params.len() != rows {
        return Err(KernelError::InvalidInput(format!("{} sampling parameters for {rows} logits rows", params.len())));
    }
    Ok(())
}

/// One request's verify window on the device.
#[derive(Clone, Copy, Debug)]
pub struct VerifyRow<'a> {
    /// bf16 `[drafts.len() + 1, vocab]`: row i gives the token at `first_position + i`.
    pub logits: DPtr,
    pub drafts: &'a [TokenId],
    pub params: &'a SamplingParams,
    /// Absolute position of the first draft token (the number of tokens before it).
    pub first_position: u64,
    /// f32 `[drafts.len(), vocab]` processed probabilities the drafts were sampled from (as
    /// [`SampleKernels::probs_from_logits`] writes them); `None` for model-free drafts (one-hot `q`).
    pub q: Option<DPtr>,
    /// u32 the emitted token is also written to on the device (a window without drafts only: it emits one
    /// token, which a fed step reads; `crate::launches`).
    pub token_out: Option<DPtr>,
    /// u32 `[drafts.len() + 1, ceil(vocab / 32)]`: a constrained row's own masks, one per position that samples
    /// (`runner::SampleRequest::masks`), applied beside the launch's mask; `None`: unconstrained.
    pub masks: Option<DPtr>,
}

/// A verify launched on the device whose verdicts the host has not read yet ([`SampleKernels::launch_verify_rows`]).
pub struct PendingVerify {
    windows: Vec<PendingWindow>,
    jobs: PendingJobs,
}

/// What assembling one window's verdict needs: its drafts, whether it asked for log-probabilities, its first
/// job and, under forced acceptance, the jobs launched and the accepted count.
struct PendingWindow {
    drafts: Vec<TokenId>,
    want_logprobs: bool,
    first: usize,
    synthetic: Option<(usize, usize)>,
}

impl PendingVerify {
    /// Waits for this verify's results (not for later work on the stream) and returns one verdict per window.
    pub fn wait(self) -> Result<Vec<Verdict>> {
        let results = self.jobs.wait()?;
        Ok(self
            .windows
            .iter()
            .map(|w| assemble(&w.drafts, w.want_logprobs, &results[w.first..], w.synthetic))
            .collect())
    }
}

/// One launch of the row kernel: `rows` descriptors at `desc` (`[rows, DESC_WORDS]` u64), the token mask words
/// (`NULL`: none) over `vocab` ids, `status` `[rows, STATUS_WORDS]` u32 and `top` `[rows, MAX_TOP_N, 2]` u32 out
/// (`NULL` when no row asks for log-probabilities).
struct RowsLaunch {
    desc: DPtr,
    mask: DPtr,
    vocab: usize,
    rows: usize,
    status: DPtr,
    top: DPtr,
}

/// One launch of wide draws (`SampleKernels::launch_wide`).
struct WideLaunch {
    desc: DPtr,
    vocab: usize,
    rows: usize,
    /// `[rows, ceil(vocab / WIDE_CHUNK)]` chunk partials.
    partials: DPtr,
    status: DPtr,
}

/// A batch of logits rows `[rows, vocab]` (bf16) and each row's sampling parameters.
#[derive(Clone, Copy, Debug)]
pub struct LogitsRows<'a> {
    pub logits: DPtr,
    pub rows: usize,
    pub vocab: usize,
    pub params: &'a [SamplingParams],
}

/// The kernels of `sample.cu`.
pub struct SampleKernels {
    sample_rows: CudaFunction,
    sample_rows_f32: CudaFunction,
    draw_partials_f32: CudaFunction,
    draw_pick_f32: CudaFunction,
    rng_hash3: CudaFunction,
}

impl SampleKernels {
    /// Looks the kernels up in `gpu`'s module store.
    pub fn load(gpu: &Gpu) -> Result<Self> {
        Ok(SampleKernels {
            sample_rows: gpu.function("sample_rows")?,
            sample_rows_f32: gpu.function("sample_rows_f32")?,
            draw_partials_f32: gpu.function("draw_partials_f32")?,
            draw_pick_f32: gpu.function("draw_pick_f32")?,
            rng_hash3: gpu.function("rng_hash3")?,
        })
    }

    /// Sampling, log-probabilities and acceptance of the rows `l` describes, whose logits are `dtype`
    /// (`sample_rows` or `sample_rows_f32`): one block of 1024 threads per row.
    fn launch_rows(&self, gpu: &Gpu, dtype: LogitsDtype, l: &RowsLaunch) -> Result<()> {
        let cfg = LaunchConfig { grid_dim: (l.rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        let v = l.vocab as i32;
        let (func, name) = match dtype {
            LogitsDtype::Bf16 => (&self.sample_rows, "sample_rows"),
            LogitsDtype::F32 => (&self.sample_rows_f32, "sample_rows_f32"),
        };
        let mut b = gpu.launcher(func);
        b.arg(&l.desc).arg(&l.mask).arg(&v).arg(&l.status).arg(&l.top);
        // SAFETY: the arguments match sample_rows(_f32); the descriptors name live rows (checked jobs).
        unsafe { b.launch(cfg, name) }
    }

    /// The wide draws of `w`: per row `ceil(vocab / WIDE_CHUNK)` blocks of chunk partials, then as many that
    /// write `q` and the token (see sample.cu).
    fn launch_wide(&self, gpu: &Gpu, w: &WideLaunch) -> Result<()> {
        let chunks = w.vocab.div_ceil(WIDE_CHUNK) as u32;
        let cfg = LaunchConfig { grid_dim: (chunks, w.rows as u32, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        let v = w.vocab as i32;
        let mut b = gpu.launcher(&self.draw_partials_f32);
        b.arg(&w.desc).arg(&v).arg(&w.partials);
        // SAFETY: the arguments match draw_partials_f32; partials hold [rows, chunks] entries (DrawPlan::new).
        unsafe { b.launch(cfg, "draw_partials_f32") }?;
        let mut b = gpu.launcher(&self.draw_pick_f32);
        b.arg(&w.desc).arg(&v).arg(&w.partials).arg(&w.status);
        // SAFETY: the arguments match draw_pick_f32; as above, and status holds [rows, STATUS_WORDS].
        unsafe { b.launch(cfg, "draw_pick_f32") }
    }

    /// Runs the kernel over `jobs` (one launch) and brings back each row's result.
    fn run_jobs(
        &self,
        gpu: &Gpu,
        vocab: usize,
        jobs: &[RowJob<'_>],
        mask: Option<&DeviceTokenMask>,
    ) -> Result<Vec<RowResult>> {
        self.launch_jobs(gpu, vocab, jobs, mask)?.wait()
    }

    /// Launches the kernel over `jobs` (one launch) and starts bringing back each row's result, without
    /// waiting: the descriptors go up and the results come back through page-locked memory (`cuda::staging`).
    fn launch_jobs(
        &self,
        gpu: &Gpu,
        vocab: usize,
        jobs: &[RowJob<'_>],
        mask: Option<&DeviceTokenMask>,
    ) -> Result<PendingJobs> {
        if vocab == 0 || vocab > i32::MAX as usize {
            return Err(KernelError::InvalidInput(format!("a vocabulary of {vocab} ids cannot be sampled")));
        }
        if let Some(m) = mask {
            if m.vocab != vocab {
                return Err(KernelError::InvalidInput(format!(
                    "a token mask over {} ids does not fit a vocabulary of {vocab}",
                    m.vocab
                )));
            }
        }
        for job in jobs {
            check_job(job, vocab)?;
        }
        let top_n: Vec<usize> = jobs.iter().map(|j| j.params.logprobs.unwrap_or(0).min(vocab)).collect();
        if jobs.is_empty() {
            return Ok(PendingJobs { top_n, results: None });
        }
        let rows = jobs.len();
        let mut words = Vec::with_capacity(rows * DESC_WORDS);
        for job in jobs {
            job.encode(&mut words);
        }
        let desc = gpu.uninit::<u64>(words.len())?; // [rows, DESC_WORDS], written in full by the copy
        gpu.upload_async_at(gpu.ptr(&desc), bytemuck::cast_slice(&words))?;
        let status = gpu.zeros::<u32>(rows * STATUS_WORDS)?; // [rows, STATUS_WORDS]
        let want_top = jobs.iter().any(|j| j.params.logprobs.is_some_and(|n| n > 0));
        let top_len = if want_top { rows * MAX_TOP_N * 2 } else { 1 };
        let top = gpu.zeros::<u32>(top_len)?; // [rows, MAX_TOP_N, 2]: id, f32 bits of its log-probability
        let mask_ptr = mask.map_or(NULL, |m| m.ptr(gpu));
        let launch = RowsLaunch {
            desc: gpu.ptr(&desc),
            mask: mask_ptr,
            vocab,
            rows,
            status: gpu.ptr(&status),
            top: gpu.ptr(&top),
        };
        self.launch_rows(gpu, LogitsDtype::Bf16, &launch)?;
        let status_back = gpu.download_async::<u32>(gpu.ptr(&status), rows * STATUS_WORDS)?;
        let top_back = if want_top { Some(gpu.download_async::<u32>(gpu.ptr(&top), top_len)?) } else { None };
        let copies = JobCopies { status: status_back, top: top_back, _buffers: (desc, status, top) };
        Ok(PendingJobs { top_n, results: Some(copies) })
    }

    /// Writes the processed distribution (`Distribution::from_logits` with `params[r]`, after `mask`) of
    /// each of the bf16 logits rows of `l` `[rows, vocab]` into `out`, f32 `[rows, vocab]`.
    /// Greedy parameters give the one-hot distribution on the argmax.
    pub fn probs_from_logits(
        &self,
        gpu: &Gpu,
        l: &LogitsRows<'_>,
        mask: Option<&DeviceTokenMask>,
        out: DPtr,
    ) -> Result<()> {
        let LogitsRows { logits, rows, vocab, params } = *l;
        check_rows_params(rows, params)?;
        let jobs: Vec<RowJob<'_>> = params
            .iter()
            .enumerate()
            .map(|(r, p)| RowJob {
                logits: logits + (r * vocab * 2) as u64,
                q: NULL,
                probs_out: out + (r * vocab * 4) as u64,
                params: p,
                position: 0,
                stream: 0,
                draft: None,
                mode: MODE_PROBS,
                token_out: NULL,
                row_mask: NULL,
            })
            .collect();
        self.run_jobs(gpu, vocab, &jobs, mask).map(|_| ())
    }

    /// One token per bf16 logits row of `l` (`[rows, vocab]`): the argmax for greedy `params[r]`, else
    /// the inverse CDF of the processed distribution at `hash3(seed, positions[r], stream) >> 11` · 2^-53
    /// (`RngStream::Token as u64` gives `sampling::sample`; `dspark::model::DRAFT_STREAM` gives the CPU
    /// drafter's `draft_uniform`). `probs_out`, when given, receives the processed distributions, f32
    /// `[rows, vocab]`, as [`SampleKernels::probs_from_logits`] writes them.
    pub fn sample_rows(
        &self,
        gpu: &Gpu,
        l: &LogitsRows<'_>,
        positions: &[u64],
        stream: u64,
        mask: Option<&DeviceTokenMask>,
        probs_out: Option<DPtr>,
    ) -> Result<Vec<TokenId>> {
        let LogitsRows { logits, rows, vocab, params } = *l;
        check_rows_params(rows, params)?;
        if positions.len() != rows {
            return Err(KernelError::InvalidInput(format!("{} positions for {rows} logits rows", positions.len())));
        }
        let jobs: Vec<RowJob<'_>> = params
            .iter()
            .zip(positions)
            .enumerate()
            .map(|(r, (p, &position))| RowJob {
                logits: logits + (r * vocab * 2) as u64,
                q: NULL,
                probs_out: probs_out.map_or(NULL, |o| o + (r * vocab * 4) as u64),
                params: p,
                position,
                stream,
                draft: None,
                mode: MODE_SAMPLE,
                token_out: NULL,
                row_mask: NULL,
            })
            .collect();
        Ok(self.run_jobs(gpu, vocab, &jobs, mask)?.into_iter().map(|r| r.token).collect())
    }

    /// `acceptance::verify` on the device for every window, in one launch: returns one verdict per row
    /// (accepted drafts, then the correction or bonus token; log-probabilities when asked).
    pub fn verify_rows(
        &self,
        gpu: &Gpu,
        vocab: usize,
        rows: &[VerifyRow<'_>],
        mask: Option<&DeviceTokenMask>,
        mode: &AcceptanceMode,
    ) -> Result<Vec<Verdict>> {
        self.launch_verify_rows(gpu, vocab, rows, mask, mode)?.wait()
    }

    /// [`Self::verify_rows`] launched without waiting: [`PendingVerify::wait`] returns the verdicts.
    pub fn launch_verify_rows(
        &self,
        gpu: &Gpu,
        vocab: usize,
        rows: &[VerifyRow<'_>],
        mask: Option<&DeviceTokenMask>,
        mode: &AcceptanceMode,
    ) -> Result<PendingVerify> {
        let token = RngStream::Token as u64;
        let mut jobs = Vec::new();
        // Per window: (first job, accepted count decided on the host for forced acceptance).
        let mut spans = Vec::with_capacity(rows.len());
        for row in rows {
            let l = row.drafts.len();
            let logits_row = |i: usize| row.logits + (i * vocab * 2) as u64;
            let row_mask = |i: usize| row.masks.map_or(NULL, |m| m + (i * vocab.div_ceil(32) * 4) as u64);
            let first = jobs.len();
            match mode {
                AcceptanceMode::Standard => {
                    for i in 0..=l {
                        jobs.push(RowJob {
                            logits: logits_row(i),
                            q: row.q.filter(|_| i < l).map_or(NULL, |q| q + (i * vocab * 4) as u64),
                            probs_out: NULL,
                            params: row.params,
                            position: row.first_position + i as u64,
                            stream: token,
                            draft: row.drafts.get(i).copied(),
                            mode: if i < l { MODE_VERIFY } else { MODE_SAMPLE },
                            token_out: row.token_out.filter(|_| l == 0).unwrap_or(NULL),
                            row_mask: row_mask(i),
                        });
                    }
                    spans.push((first, None));
                }
                AcceptanceMode::Synthetic(schedule) => {
                    // The accepted drafts are emitted as they are; only their log-probabilities need rows.
                    let accepted = schedule.accepted_count(row.params.seed, row.first_position, l);
                    let from = if row.params.logprobs.is_some() { 0 } else { accepted };
                    for i in from..=accepted {
                        jobs.push(RowJob {
                            logits: logits_row(i),
                            q: NULL,
                            probs_out: NULL,
                            params: row.params,
                            position: row.first_position + i as u64,
                            stream: token,
                            draft: row.drafts.get(i).copied(),
                            mode: MODE_SAMPLE,
                            token_out: row.token_out.filter(|_| l == 0).unwrap_or(NULL),
                            row_mask: row_mask(i),
                        });
                    }
                    spans.push((first, Some((from, accepted))));
                }
            }
        }
        let jobs = self.launch_jobs(gpu, vocab, &jobs, mask)?;
        let windows = rows
            .iter()
            .zip(spans)
            .map(|(row, (first, synthetic))| PendingWindow {
                drafts: row.drafts.to_vec(),
                want_logprobs: row.params.logprobs.is_some(),
                first,
                synthetic,
            })
            .collect();
        Ok(PendingVerify { windows, jobs })
    }

    /// `sampling::hash3` computed on the device for each `(seed, position, stream)`, to check the port.
    pub fn hash3_on_device(&self, gpu: &Gpu, inputs: &[(u64, u64, u64)]) -> Result<Vec<u64>> {
        let seeds: Vec<u64> = inputs.iter().map(|x| x.0).collect();
        let positions: Vec<u64> = inputs.iter().map(|x| x.1).collect();
        let streams: Vec<u64> = inputs.iter().map(|x| x.2).collect();
        let (s, p, st) = (gpu.upload(&seeds)?, gpu.upload(&positions)?, gpu.upload(&streams)?);
        let out = gpu.zeros::<u64>(inputs.len())?;
        if !inputs.is_empty() {
            let (s, p, st, o, n) = (gpu.ptr(&s), gpu.ptr(&p), gpu.ptr(&st), gpu.ptr(&out), inputs.len() as i32);
            let mut b = gpu.launcher(&self.rng_hash3);
            b.arg(&s).arg(&p).arg(&st).arg(&o).arg(&n);
            // SAFETY: the arguments match rng_hash3; every buffer holds `inputs.len()` u64.
            unsafe { b.launch(grid_1d(inputs.len(), 256), "rng_hash3") }?;
        }
        gpu.download(&out, inputs.len())
    }
}

/// One window's verdict from its rows' results (`results[0]` is its first launched row). Standard
/// (`synthetic` None): row i's token is the accepted draft, the correction or the bonus; the first row
/// whose draft was not accepted ends the window. Forced (`Some((from, accepted))`, rows `from..=accepted`
/// launched): the accepted drafts, then row `accepted`'s sample.
fn assemble(
    drafts: &[TokenId],
    want_logprobs: bool,
    results: &[RowResult],
    synthetic: Option<(usize, usize)>,
) -> Verdict {
    let lp = |r: &RowResult, token: TokenId, logprob: f32| TokenLogprob { token, logprob, top: r.top.clone() };
    let mut tokens = Vec::with_capacity(drafts.len() + 1);
    let mut logprobs = Vec::new();
    match synthetic {
        None => {
            for (i, r) in results[..drafts.len() + 1].iter().enumerate() {
                tokens.push(r.token);
                if want_logprobs {
                    logprobs.push(lp(r, r.token, r.logprob_token));
                }
                if i < drafts.len() && !r.accepted {
                    break;
                }
            }
        }
        Some((from, accepted)) => {
            tokens.extend_from_slice(&drafts[..accepted]);
            let window = &results[..accepted - from + 1];
            if want_logprobs {
                for (r, &d) in window.iter().zip(&drafts[..accepted]) {
                    logprobs.push(lp(r, d, r.logprob_draft));
                }
            }
            let last = &window[accepted - from];
            tokens.push(last.token);
            if want_logprobs {
                logprobs.push(lp(last, last.token, last.logprob_token));
            }
        }
    }
    Verdict { num_accepted: tokens.len() - 1, tokens, logprobs, synthetic: synthetic.is_some() }
}

/// One f32 logits row to sample on the device, its token and processed distribution written to device
/// memory: a sampled DSpark draft position (the Markov step's fp32 logits, masked ids already `-inf`).
#[derive(Clone, Copy, Debug)]
pub struct DeviceDraw<'a> {
    /// f32 `[vocab]`.
    pub logits: DPtr,
    /// f32 `[vocab]`: the processed distribution (`Distribution::from_logits` of the f32 row, as f32).
    pub probs_out: DPtr,
    /// u32: the token, the inverse CDF at `hash3(seed, position, stream) >> 11` · 2^-53.
    pub token_out: DPtr,
    /// Log-probabilities are not computed (a draft has none).
    pub params: &'a SamplingParams,
    pub position: u64,
}

/// Ids per block of a wide draw (`WIDE_CHUNK` in sample.cu).
pub const WIDE_CHUNK: usize = 8192;
/// Bytes of one chunk's partial (`WidePartial` in sample.cu: f32 max, u32 bad id, f64 sum).
pub const WIDE_PARTIAL_BYTES: usize = 16;

/// Whether a draw's only processing is the temperature (top-k off, top-p 1): then it runs as a wide draw,
/// `ceil(vocab / WIDE_CHUNK)` blocks per row (`draw_partials_f32`, `draw_pick_f32`) instead of one.
fn is_wide(params: &SamplingParams, vocab: usize) -> bool {
    !params.is_greedy() && (params.top_k == 0 || params.top_k >= vocab) && params.top_p >= 1.0
}

/// One kind of launch of a [`DrawPlan`]: rows' descriptors and status words, and each group's span of rows.
struct DrawRows {
    desc: CudaSlice<u64>,        // [rows, DESC_WORDS]
    status: CudaSlice<u32>,      // [rows, STATUS_WORDS]
    groups: Vec<(usize, usize)>, // (first row, rows) per group
    rows: usize,
}

impl DrawRows {
    /// The rows of `groups` that `take` selects, checked and uploaded.
    fn new(
        gpu: &Gpu,
        vocab: usize,
        groups: &[Vec<DeviceDraw<'_>>],
        stream: u64,
        take: impl Fn(&DeviceDraw<'_>) -> bool,
    ) -> Result<Self> {
        let mut words = Vec::new();
        let mut spans = Vec::with_capacity(groups.len());
        let mut rows = 0;
        for group in groups {
            let first = rows;
            for draw in group.iter().filter(|d| take(d)) {
                let params = SamplingParams { logprobs: None, ..draw.params.clone() };
                let job = RowJob {
                    logits: draw.logits,
                    q: NULL,
                    probs_out: draw.probs_out,
                    params: &params,
                    position: draw.position,
                    stream,
                    draft: None,
                    mode: MODE_SAMPLE,
                    token_out: draw.token_out,
                    row_mask: NULL,
                };
                check_job(&job, vocab)?;
                job.encode(&mut words);
                rows += 1;
            }
            spans.push((first, rows - first));
        }
        let desc = gpu.upload(&words)?;
        let status = gpu.zeros::<u32>(rows * STATUS_WORDS)?;
        Ok(DrawRows { desc, status, groups: spans, rows })
    }

    /// Group `group`'s (descriptors, status, rows), `None` for an empty one.
    fn group(&self, gpu: &Gpu, group: usize) -> Option<(DPtr, DPtr, usize)> {
        let &(first, rows) = self.groups.get(group)?;
        (rows > 0).then(|| {
            let desc = gpu.ptr(&self.desc) + (first * DESC_WORDS * 8) as u64;
            let status = gpu.ptr(&self.status) + (first * STATUS_WORDS * 4) as u64;
            (desc, status, rows)
        })
    }

    /// The first error any row reported.
    fn finish(&self, gpu: &Gpu) -> Result<()> {
        if self.rows == 0 {
            return Ok(());
        }
        let status = gpu.download(&self.status, self.rows * STATUS_WORDS)?;
        status.chunks(STATUS_WORDS).enumerate().try_for_each(|(r, st)| check_status(r, st))
    }
}

/// Groups of [`DeviceDraw`]s checked and uploaded at once, then launched group by group with no host
/// round trip (a group may read tokens an earlier group wrote); the rows' errors (NaN or +inf logits,
/// every id `-inf`) are read once, by [`DrawPlan::finish`]. Temperature-only rows run as wide draws
/// (several blocks per row, see sample.cu), the others one block per row; both follow
/// `Distribution::from_logits` and the inverse CDF at the same uniform.
pub struct DrawPlan {
    general: DrawRows,
    wide: DrawRows,
    /// `[largest wide group, chunks]` partials, reused group after group (one stream orders them).
    partials: CudaSlice<u8>,
    vocab: usize,
}

impl DrawPlan {
    /// Checks and uploads `groups` of draws over rows of `vocab` f32 logits, sampled with RNG `stream`.
    pub fn new(gpu: &Gpu, vocab: usize, groups: &[Vec<DeviceDraw<'_>>], stream: u64) -> Result<Self> {
        if vocab == 0 || vocab > i32::MAX as usize {
            return Err(KernelError::InvalidInput(format!("a vocabulary of {vocab} ids cannot be sampled")));
        }
        let general = DrawRows::new(gpu, vocab, groups, stream, |d| !is_wide(d.params, vocab))?;
        let wide = DrawRows::new(gpu, vocab, groups, stream, |d| is_wide(d.params, vocab))?;
        let widest = wide.groups.iter().map(|g| g.1).max().unwrap_or(0);
        let partials = gpu.zeros::<u8>(widest * vocab.div_ceil(WIDE_CHUNK) * WIDE_PARTIAL_BYTES)?;
        Ok(DrawPlan { general, wide, partials, vocab })
    }

    /// Launches group `group` (nothing for an empty one) with `kernels`.
    pub fn launch(&self, gpu: &Gpu, kernels: &SampleKernels, group: usize) -> Result<()> {
        if group >= self.general.groups.len() {
            return Err(KernelError::InvalidInput(format!("draw group {group} of {}", self.general.groups.len())));
        }
        if let Some((desc, status, rows)) = self.general.group(gpu, group) {
            let launch = RowsLaunch { desc, mask: NULL, vocab: self.vocab, rows, status, top: NULL };
            kernels.launch_rows(gpu, LogitsDtype::F32, &launch)?;
        }
        if let Some((desc, status, rows)) = self.wide.group(gpu, group) {
            kernels.launch_wide(
                gpu,
                &WideLaunch { desc, vocab: self.vocab, rows, partials: gpu.ptr(&self.partials), status },
            )?;
        }
        Ok(())
    }

    /// The first error any launched row reported.
    pub fn finish(&self, gpu: &Gpu) -> Result<()> {
        self.general.finish(gpu)?;
        self.wide.finish(gpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_words_set_exactly_the_allowed_bits() {
        let mask = TokenMask::from_fn(70, |id| id % 3 != 0 && id != 65);
        let words = mask_words(&mask);
        assert_eq!(words.len(), 3);
        for id in 0..96u32 {
            let bit = words[id as usize / 32] >> (id % 32) & 1 == 1;
            assert_eq!(bit, id < 70 && mask.is_allowed(id), "id {id}");
        }
    }

    fn result(token: TokenId, accepted: bool) -> RowResult {
        RowResult { token, accepted, logprob_token: -(token as f32), logprob_draft: -0.5, top: vec![(token, -1.0)] }
    }

    #[test]
    fn a_standard_window_stops_at_the_first_rejection() {
        let drafts = [4, 5, 6];
        let rows = [result(4, true), result(9, false), result(6, true), result(1, false)];
        let v = assemble(&drafts, true, &rows, None);
        assert_eq!((v.tokens.clone(), v.num_accepted, v.synthetic), (vec![4, 9], 1, false));
        assert_eq!(v.logprobs.iter().map(|l| (l.token, l.logprob)).collect::<Vec<_>>(), vec![(4, -4.0), (9, -9.0)]);
        let all = [result(4, true), result(5, true), result(6, true), result(2, false)];
        let v = assemble(&drafts, false, &all, None);
        assert_eq!((v.tokens, v.num_accepted, v.logprobs.len()), (vec![4, 5, 6, 2], 3, 0));
        let v = assemble(&[], false, &[result(7, false)], None);
        assert_eq!(v.tokens, vec![7]);
    }

    #[test]
    fn a_forced_window_emits_the_accepted_drafts_then_its_sample() {
        let drafts = [4, 5, 6];
        // Without log-probabilities only row `accepted` is launched.
        let v = assemble(&drafts, false, &[result(8, false)], Some((2, 2)));
        assert_eq!((v.tokens, v.num_accepted, v.synthetic), (vec![4, 5, 8], 2, true));
        // With them, rows 0..=accepted: the drafts carry their rows' draft log-probabilities.
        let rows = [result(1, false), result(2, false), result(8, false)];
        let v = assemble(&drafts, true, &rows, Some((0, 2)));
        assert_eq!(v.tokens, vec![4, 5, 8]);
        assert_eq!(
            v.logprobs.iter().map(|l| (l.token, l.logprob)).collect::<Vec<_>>(),
            vec![(4, -0.5), (5, -0.5), (8, -8.0)]
        );
    }

    #[test]
    fn a_descriptor_packs_every_field() {
        let params = SamplingParams { temperature: 0.7, top_p: 0.9, top_k: 40, seed: 99, logprobs: Some(5) };
        let job = RowJob {
            logits: 0x1000,
            q: 0x2000,
            probs_out: NULL,
            params: &params,
            position: 17,
            stream: 2,
            draft: Some(123),
            mode: MODE_VERIFY,
            token_out: 0x3000,
            row_mask: 0x4000,
        };
        let mut words = Vec::new();
        job.encode(&mut words);
        assert_eq!(words.len(), DESC_WORDS);
        assert_eq!(&words[..6], &[0x1000, 0x2000, 0, 99, 17, 2]);
        assert_eq!(f32::from_bits(words[6] as u32), 0.7);
        assert_eq!(f32::from_bits((words[6] >> 32) as u32), 0.9);
        assert_eq!((words[7] as u32, (words[7] >> 32) as u32), (40, 123));
        assert_eq!((words[8], words[9], words[10], words[11]), (6, MODE_VERIFY, 0x3000, 0x4000));
        let none = RowJob { draft: None, params: &SamplingParams::greedy(), ..job };
        let mut words = Vec::new();
        none.encode(&mut words);
        assert_eq!(((words[7] >> 32) as u32, words[8]), (NO_ID, 0));
    }

    #[test]
    fn the_row_descriptor_and_the_shared_constants_match_sample_cu() {
        use crate::cuda::compile::source_define;
        // A field the host writes at another word than the kernel reads would sample with the wrong parameters.
        let word = |offset: usize| (offset / 8) as u32;
        let fields = [
            ("D_LOGITS", std::mem::offset_of!(RowDesc, logits)),
            ("D_Q", std::mem::offset_of!(RowDesc, q)),
            ("D_PROBS_OUT", std::mem::offset_of!(RowDesc, probs_out)),
            ("D_SEED", std::mem::offset_of!(RowDesc, seed)),
            ("D_POSITION", std::mem::offset_of!(RowDesc, position)),
            ("D_STREAM", std::mem::offset_of!(RowDesc, stream)),
            ("D_TEMP_TOPP", std::mem::offset_of!(RowDesc, temp_top_p)),
            ("D_TOPK_DRAFT", std::mem::offset_of!(RowDesc, top_k_draft)),
            ("D_TOP_N", std::mem::offset_of!(RowDesc, top_n)),
            ("D_MODE", std::mem::offset_of!(RowDesc, mode)),
            ("D_TOKEN_OUT", std::mem::offset_of!(RowDesc, token_out)),
            ("D_ROW_MASK", std::mem::offset_of!(RowDesc, row_mask)),
        ];
        for (name, offset) in fields {
            assert_eq!(offset % 8, 0, "{name} is not a whole word");
            assert_eq!(word(offset), source_define("sample.cu", name), "{name}");
        }
        assert_eq!(std::mem::size_of::<RowDesc>(), fields.len() * 8, "RowDesc has padding or fields sample.cu lacks");
        assert_eq!(DESC_WORDS as u32, source_define("sample.cu", "DESC_WORDS"));
        assert_eq!(STATUS_WORDS as u32, source_define("sample.cu", "STATUS_WORDS"));
        assert_eq!(NO_ID, source_define("sample.cu", "NO_ID"));
        assert_eq!(MAX_TOP_N as u32, source_define("sample.cu", "MAX_TOP_N"));
        assert_eq!(ERR_BAD_LOGIT, source_define("sample.cu", "ERR_BAD_LOGIT"));
        for (mode, name) in [(MODE_SAMPLE, "MODE_SAMPLE"), (MODE_VERIFY, "MODE_VERIFY"), (MODE_PROBS, "MODE_PROBS")] {
            assert_eq!(mode, u64::from(source_define("sample.cu", name)), "{name}");
        }
    }
}
