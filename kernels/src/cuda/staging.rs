//! Page-locked host buffers for the copies of a step that must not make the host wait: the step table and
//! the sampling descriptors going up, the sampled tokens coming back ([`Staging`], [`Download`]).
//!
//! A copy from pageable memory may synchronise with its stream while the driver stages it, and a copy
//! into pageable memory returns only once done; from and into page-locked memory both are asynchronous.
//!
//! Invariants:
//! - A buffer is handed out only when the last copy issued on it has completed (its event), so an upload's
//!   source is never overwritten while the device still reads it, and a download's target is read only after
//!   the copy into it is done ([`Download::wait`] waits for that copy alone, not for the stream).
//! - Buffers are kept and reused: page-locking memory costs far more than a step. The pool holds at most
//!   [`MAX_IDLE_BUFFERS`] idle buffers of at most [`MAX_IDLE_BYTES`] together; a buffer past that is freed when
//!   it comes back. Large copies stream through two [`CHUNK_BYTES`] buffers ([`Staging::download_chunked`]), so
//!   page-locked memory stays small whatever the size of a state.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, PinnedHostSlice};

use crate::cuda::device::device_err;
use crate::cuda::launch::DPtr;
use crate::error::{KernelError, Result};

/// Idle buffers kept for reuse (a step uses a few; two steps can be in flight).
const MAX_IDLE_BUFFERS: usize = 16;
/// Bytes of idle buffers kept for reuse, all together.
const MAX_IDLE_BYTES: usize = 64 << 20;
/// Bytes per chunk of a streamed download.
pub const CHUNK_BYTES: usize = 8 << 20;
/// The smallest buffer allocated, so small copies share sizes.
const MIN_BUFFER_BYTES: usize = 4096;

/// A page-locked buffer and the event recorded after the last copy issued on it.
struct Buffer {
    mem: PinnedHostSlice<u8>,
    done: CudaEvent,
}

/// The pool of page-locked buffers (see the module invariants).
pub struct Staging {
    idle: Mutex<Vec<Buffer>>,
}

impl Staging {
    pub fn new() -> Self {
        Staging { idle: Mutex::new(Vec::new()) }
    }

    /// A buffer of at least `bytes` whose last copy is done.
    fn take(&self, ctx: &Arc<CudaContext>, bytes: usize) -> Result<Buffer> {
        {
            let mut idle =
                self.idle.lock().map_err(|_| KernelError::Device("the staging pool lock is poisoned".into()))?;
            if let Some(i) = idle.iter().position(|b| b.mem.len() >= bytes && b.done.is_complete()) {
                return Ok(idle.swap_remove(i));
            }
        }
        let len = bytes.max(MIN_BUFFER_BYTES).next_power_of_two();
        // SAFETY: plain page-locked memory (not write-combined: the host reads downloads back); nothing reads
        // it before a copy fills it.
        let mem = unsafe { ctx.alloc_pinned_with_flags::<u8>(len, 0) }
            .map_err(|e| device_err("page-locking host memory", e))?;
        let done = ctx.new_event(None).map_err(|e| device_err("creating a staging event", e))?;
        Ok(Buffer { mem, done })
    }

    fn give(&self, buffer: Buffer) {
        if let Ok(mut idle) = self.idle.lock() {
            let held: usize = idle.iter().map(|b| b.mem.len()).sum();
            if idle.len() < MAX_IDLE_BUFFERS && held + buffer.mem.len() <= MAX_IDLE_BYTES {
                idle.push(buffer);
            }
        }
    }

    /// Copies `n` elements of `T` to device address `dst` in chunks of `chunk` elements (at most [`CHUNK_BYTES`]),
    /// through two page-locked buffers: `fill(offset, elements)` writes chunk `i + 1` while the device copies chunk
    /// `i`. Returns once every copy is issued, without waiting for the stream (the copies are stream-ordered).
    pub fn upload_chunked<T: Copy>(
        &self,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
        dst: DPtr,
        n: usize,
        chunk: usize,
        mut fill: impl FnMut(usize, &mut [T]),
    ) -> Result<()> {
        let size = std::mem::size_of::<T>();
        if chunk == 0 || chunk * size > CHUNK_BYTES {
            return Err(KernelError::InvalidInput(format!("an upload chunk of {chunk} elements of {size} bytes")));
        }
        if n == 0 {
            return Ok(());
        }
        let mut buffers = [self.take(ctx, chunk * size)?, self.take(ctx, chunk * size)?];
        let mut upload = || -> Result<()> {
            for (i, from) in (0..n).step_by(chunk).enumerate() {
                let buffer = &mut buffers[i % 2];
                let count = (n - from).min(chunk);
                // The buffer's previous copy (chunk i - 2) must be done before it is refilled.
                buffer.done.synchronize().map_err(|e| device_err("waiting for a copy", e))?;
                let staged = buffer.mem.as_mut_slice().map_err(|e| device_err("reaching a staging buffer", e))?;
                // SAFETY: page-locked buffers are page-aligned, so aligned for `T`, and hold `chunk * size` bytes;
                // `T: Copy` is plain data, and `fill` writes every element before the copy reads them.
                let elements = unsafe { std::slice::from_raw_parts_mut(staged.as_mut_ptr().cast::<T>(), count) };
                fill(from, elements);
                // SAFETY: `dst` has room for `n` elements of `T` (the caller's contract); the source is page-locked
                // and is not refilled or handed out before `done`, recorded right after the copy, completes.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(
                        dst + (from * size) as u64,
                        &staged[..count * size],
                        stream.cu_stream(),
                    )
                }
                .map_err(|e| device_err("host to device copy", e))?;
                buffer.done.record(stream).map_err(|e| device_err("recording a staging event", e))?;
            }
            Ok(())
        };
        let result = upload();
        // Back to the pool on every path: a buffer is handed out again only once its last copy is done.
        for buffer in buffers {
            self.give(buffer);
        }
        result
    }

    /// Copies `n` elements of `T` from device address `src` to the host in chunks of `chunk` elements (at most
    /// [`CHUNK_BYTES`]), through two page-locked buffers: the device copies chunk `i + 1` while `take(offset,
    /// elements)` reads chunk `i`. Returns once every chunk has been taken; waits for the stream up to the copies.
    pub fn download_chunked<T: Copy>(
        &self,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
        src: DPtr,
        n: usize,
        chunk: usize,
        mut take: impl FnMut(usize, &[T]),
    ) -> Result<()> {
        let size = std::mem::size_of::<T>();
        if chunk == 0 || chunk * size > CHUNK_BYTES {
            return Err(KernelError::InvalidInput(format!("a download chunk of {chunk} elements of {size} bytes")));
        }
        let mut buffers = [self.take(ctx, chunk * size)?, self.take(ctx, chunk * size)?];
        let issue = |buffer: &mut Buffer, from: usize| -> Result<()> {
            let bytes = (n - from).min(chunk) * size;
            let staged = buffer.mem.as_mut_slice().map_err(|e| device_err("reaching a staging buffer", e))?;
            // SAFETY: `src` holds `n` elements of `T` (the caller's contract); the target is page-locked and read
            // only after `done`, recorded right after the copy, completes.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut staged[..bytes],
                    src + (from * size) as u64,
                    stream.cu_stream(),
                )
            }
            .map_err(|e| device_err("device to host copy", e))?;
            buffer.done.record(stream).map_err(|e| device_err("recording a staging event", e))
        };
        let mut download = || -> Result<()> {
            let starts: Vec<usize> = (0..n).step_by(chunk).collect();
            if let Some(&first) = starts.first() {
                issue(&mut buffers[0], first)?;
            }
            for (i, &from) in starts.iter().enumerate() {
                // The next chunk's copy is issued before this one is read, so the two overlap.
                if let Some(&next) = starts.get(i + 1) {
                    issue(&mut buffers[(i + 1) % 2], next)?;
                }
                let buffer = &buffers[i % 2];
                buffer.done.synchronize().map_err(|e| device_err("waiting for a copy", e))?;
                let staged = buffer.mem.as_slice().map_err(|e| device_err("reaching a staging buffer", e))?;
                let count = (n - from).min(chunk);
                // SAFETY: page-locked buffers are page-aligned, so aligned for `T`; the first `count` elements were
                // copied from the device as `T` (`T: Copy`, plain data).
                take(from, unsafe { std::slice::from_raw_parts(staged.as_ptr().cast::<T>(), count) });
            }
            Ok(())
        };
        let result = download();
        // Back to the pool on every path: a buffer is handed out again only once its last copy is done.
        for buffer in buffers {
            self.give(buffer);
        }
        result
    }

    /// Copies `bytes` to device address `dst` in stream order on `stream`, without waiting for the stream: the
    /// bytes go through a page-locked buffer that is reused only once this copy is done.
    pub fn upload(&self, ctx: &Arc<CudaContext>, stream: &CudaStream, dst: DPtr, bytes: &[u8]) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        let mut buffer = self.take(ctx, bytes.len())?;
        let mut issue = || -> Result<()> {
            let staged = buffer.mem.as_mut_slice().map_err(|e| device_err("reaching a staging buffer", e))?;
            staged[..bytes.len()].copy_from_slice(bytes);
            // SAFETY: `dst` is a live device buffer with room for `bytes` (the caller's contract); the source is
            // page-locked and is not handed out again before `done`, recorded right after the copy, completes.
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, &staged[..bytes.len()], stream.cu_stream()) }
                .map_err(|e| device_err("host to device copy", e))?;
            buffer.done.record(stream).map_err(|e| device_err("recording a staging event", e))
        };
        let issued = issue();
        self.give(buffer);
        issued
    }

    /// Starts copying `n` elements of `T` from device address `src` into page-locked memory, in stream order
    /// on `stream`; [`Download::wait`] returns them.
    pub fn download<T: Copy + Default>(
        self: &Arc<Self>,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
        src: DPtr,
        n: usize,
    ) -> Result<Download<T>> {
        let bytes = n * std::mem::size_of::<T>();
        // Made first, so that a failed issue still hands the buffer back (`Download`'s drop).
        let mut download = Download {
            pool: Arc::clone(self),
            buffer: Some(self.take(ctx, bytes.max(1))?),
            n,
            _t: std::marker::PhantomData,
        };
        if let Some(buffer) = download.buffer.as_mut() {
            if bytes > 0 {
                let staged = buffer.mem.as_mut_slice().map_err(|e| device_err("reaching a staging buffer", e))?;
                // SAFETY: `src` holds `n` elements of `T` (the caller's contract); the target is page-locked and
                // read only after `done`, recorded right after the copy, completes.
                unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut staged[..bytes], src, stream.cu_stream()) }
                    .map_err(|e| device_err("device to host copy", e))?;
            }
            buffer.done.record(stream).map_err(|e| device_err("recording a staging event", e))?;
        }
        Ok(download)
    }
}

impl Default for Staging {
    fn default() -> Self {
        Staging::new()
    }
}

/// A device-to-host copy in flight (see [`Staging::download`]).
pub struct Download<T> {
    pool: Arc<Staging>,
    buffer: Option<Buffer>,
    n: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: Copy + Default> Download<T> {
    /// Waits for this copy (not for the rest of the stream) and returns its elements.
    pub fn wait(mut self) -> Result<Vec<T>> {
        let buffer = self.buffer.take().ok_or_else(|| KernelError::Device("a download was waited for twice".into()))?;
        let waited = buffer.done.synchronize().map_err(|e| device_err("waiting for a device to host copy", e));
        let out = waited.and_then(|_| {
            let staged = buffer.mem.as_slice().map_err(|e| device_err("reaching a staging buffer", e))?;
            let mut out = vec![T::default(); self.n];
            let bytes = self.n * std::mem::size_of::<T>();
            // SAFETY: the staged bytes are `n` elements of `T` copied from the device; `out` has room for them
            // and does not overlap the page-locked buffer. `T: Copy` has no drop glue.
            unsafe { std::ptr::copy_nonoverlapping(staged.as_ptr(), out.as_mut_ptr().cast::<u8>(), bytes) };
            Ok(out)
        });
        self.pool.give(buffer);
        out
    }
}

impl<T> Drop for Download<T> {
    fn drop(&mut self) {
        // A download dropped unread: its buffer goes back, reused only once its copy is done.
        if let Some(buffer) = self.buffer.take() {
            self.pool.give(buffer);
        }
    }
}
