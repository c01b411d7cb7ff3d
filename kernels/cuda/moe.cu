// sparkd: the latent MoE's routed experts, grouped by expert (MXFP4 weights dequantised in the kernel).
//
// Invariants: an expert's gate/up outputs are rounded to bf16, SiTU'd and rounded again; its down output is rounded
// to bf16 (kernels/src/cpu/moe.rs). The kernels work per active expert over its grouped (token, slot) pairs (the
// grouping layout: "Grouped routed experts" in moe_route.cu) on the tensor cores; a token's results never depend on
// the batch, whichever form (token rows or staged inputs) runs.
// MXFP4: two E2M1 codes per byte, element 2i in the low nibble; one E8M0 scale per 32 inputs;
// 0xFF is NaN (shared/reference/k3-architecture.md §2.8). On the device the experts are tiled, and the bits of each
// 32-bit word of codes permuted (kernels/src/cuda/expert_layout.rs).
// Compiled after prelude.cuh (compile.rs prepends it: cuda_bf16.h and the shared helpers: u32, i64, ld, bf_round,
// sigmoidf_, block reductions, dependent launch, clusters, cp.async and the bf16 MMA).

typedef unsigned char u8;

__device__ __forceinline__ u32 word_of(uint4 q, int i) { return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w; }

// ---- Grouped routed experts on the tensor cores -------------------------------------------------------------
// An active expert's outputs for all its grouped pairs, with the dot products on mma.sync m16n8k16 (bf16 in,
// fp32 accumulate): the MXFP4 weights are dequantised to bf16 in registers (code * scale is exact in bf16, which
// shares fp32's exponent range) and multiplied against the expert's tokens 8 at a time, so a weight costs its
// dequantisation once per chunk of up to 24 tokens (32 in the staged kernels). (The tile mapping follows the idea of
// kernels/cuda/gemm.cu; the dequantisation into MMA fragments is our own.)
//
// Layout: a warp owns a 16-row tile of one expert's matrix; lane (g = lane / 4, t = lane % 4) holds rows g and
// g + 8. K runs in blocks of 4 MXFP4 groups (128 inputs); in a block, thread t takes group 4 b + t whole
// (16 bytes of codes and one scale per row, one 128-bit load per row). The weights are stored tiled
// (kernels/src/cuda/expert_layout.rs): a (tile, block) is one contiguous 1 KB chunk of codes, so the warp's
// loads of a block are 1 KB in address order. A word of 8 codes feeds 2 MMAs: codes
// 2i and 2i + 1 share one bf16x2 (word_codes_bf16x2), so MMA h of the word takes codes (4h, 4h + 1) as k-slots
// {2t, 2t + 1} and (4h + 2, 4h + 3) as {2t + 8, 2t + 9}, and the B fragment takes the token's inputs with the same
// indices, which are the 32-bit words of its 16-byte load as they are: each MMA is the plain dot over 16 of the
// inputs.
//
// Cost: every byte of codes becomes two bf16 once per chunk of tokens, in 9 integer instructions and 4 bf16x2
// multiplies per 8 weights (through fp16 and fp32 it took 36, and bound the kernels at batch 1-8). At batch 1 the
// kernels are bound by instruction issue (docs/perf/decisions.md#d32), so these instructions are the cost.
//
// Batch invariance: an MMA output depends only on its row of A and column of B (the skinny GEMM relies on the
// same property), a token's column sees the same MMAs in the same order (blocks ascending, then words, then h)
// whatever column or chunk it lands in, and padding columns hold zeros. So a token's result does not depend on
// which other tokens share its experts.

#define MMA_WARPS 4   // 16-row tiles per block
#define TILE_CODE_BYTES 1024  // codes of a (16-row tile, 128-input block) chunk (expert_layout.rs)
#define TILE_SCALE_BYTES 64   // scale bytes of a chunk

// The first chunk of the tile holding row0 of expert e's matrix of `rows` rows and `groups` 32-input groups: an
// expert's matrix is ceil(rows / 16) tiles of ceil(groups / 4) chunks.
__device__ __forceinline__ long tile_index(long e, int row0, int rows, int groups) {
    long quads = (groups + 3) / 4;
    return (e * ((rows + 15) / 16) + row0 / 16) * quads;
}
// Byte offsets in a chunk of thread (g, t)'s group of row g + 8 r: its 16 bytes of codes, its scale byte.
__device__ __forceinline__ int tile_code_offset(int g, int r, int t) { return (g + 8 * r) * 64 + t * 16; }
__device__ __forceinline__ int tile_scale_offset(int g, int r, int t) { return (g + 8 * r) * 4 + t; }
#define GATE_UP_KB 2  // K blocks per step of moe_gate_up: a ring step holds 2 matrices x 2 rows x 2 x 16 bytes per lane
#define DOWN_KB 2     // the same for moe_down (one matrix): 64 bytes per lane in flight
#define DOWN_BLOCKS_PER_SM 5  // moe_down's occupancy target (96 registers; moe_down_full spills none)

// The eight E2M1 codes of one stored word as four bf16x2 of code * 2^-126, exactly: register i holds code 2i (low
// half) and code 2i + 1 (high half), the pairs the token's inputs come in. A code's magnitude bits (e1 e0 m) land on
// the bf16 exponent's two low bits and the top mantissa bit, which makes the bf16 number code * 2^-126 (code 0.5
// lands on the subnormal 2^-127), and its sign on the sign bit. The codes' bits are stored permuted within each word
// (expert_layout.rs, CODE_BIT_SOURCE; kernels/bench/code_bit_order.py derives it), so that this takes 9 integer
// instructions (11 for the checkpoint's nibble order) and the inputs need no byte permutes: registers 0 and 1 are
// the word rotated by 13 and 8 bits, then masked; registers 2 and 3 come from one blend `u` of the word and the
// word shifted left by 2 (CODE_BLEND_MASK picks the word's own bits), rotated by 3 and 0 bits, then masked.
#define CODE_BLEND_MASK 0x11501150u
__device__ __forceinline__ void word_codes_bf16x2(u32 w, u32 out[4]) {
    const u32 keep = 0x81C081C0u;  // per half: sign, exponent bits 1-0, top mantissa bit
    u32 u;  // (w & CODE_BLEND_MASK) | ((w << 2) & ~CODE_BLEND_MASK) as one LOP3 (ptxas splits the C form in two)
    asm("lop3.b32 %0, %1, %2, %3, 0xD8;" : "=r"(u) : "r"(w << 2), "r"(w), "n"(CODE_BLEND_MASK));
    out[0] = __funnelshift_l(w, w, 13) & keep;
    out[1] = __funnelshift_l(w, w, 8) & keep;
    out[2] = __funnelshift_l(u, u, 3) & keep;
    out[3] = u & keep;
}

// a * b per bf16 half, exactly when the product is a bf16 (fma with -0, which keeps the sign of a zero product).
__device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}

// 2^126 in both bf16 halves: word_codes_bf16x2's output times it is the plain E2M1 value.
#define BF16X2_2P126 0x7E807E80u

// The bf16x2 factor (both halves) that turns word_codes_bf16x2's code * 2^-126 into code * 2^(b - 127) for the E8M0
// byte b. Narrow (b <= 128): 2^(b - 1), one multiply. Wide (some scale of the step is larger): the codes are first
// multiplied by 2^126 and this is 2^(b - 127) (b = 0: the subnormal 2^-127). 0xFF is NaN either way. Every
// product is exact, so both give the same bf16 weights.
__device__ __forceinline__ u32 scale_bf16x2(u32 b, bool wide) {
    if (!wide) return b * 0x00800080u + 0x3F003F00u;  // (b + 126) << 7 in both halves (b <= 128 here)
    u32 h = b == 0xFFu ? 0x7FC0u : b == 0u ? 0x0040u : b << 7;
    return h | (h << 16);
}

// The B operands of mma_step from the token rows in global memory: thread (g, t)'s column of n-tile nt is row
// x[nt] (null: a padding column, read as zeros unless FULL). FULL: the matrix's groups fill every step (groups % (4
// KB) == 0, as at K3's widths), so no input is past the row, and every pointer is valid (a padding column reads a
// real token, whose results are never stored): no masks.
template <int NT, bool FULL>
struct RowInputs {
    const __nv_bfloat16 *x[NT];
    int groups;
    // Inputs [32 grp + 8 w, + 8) of n-tile nt's column (`blk`: the K block of the step, unused here).
    __device__ __forceinline__ uint4 load(int nt, int grp, int blk, int w) const {
        return FULL || (x[nt] != nullptr && grp < groups) ? *(const uint4 *)(x[nt] + grp * 32 + w * 8)
                                                          : make_uint4(0u, 0u, 0u, 0u);
    }
};

// One step of a pass: the KB blocks of codes `cur` (scale bytes `cs`) of this step s against the NT n-tiles' inputs
// x (RowInputs, or StagedInputs below). WIDE: some scale of the warp's step exceeds 2^1 (see scale_bf16x2).
template <int NM, int NT, int KB, bool WIDE, class Inputs>
__device__ __forceinline__ void mma_step(const uint4 cur[NM][2][KB], const u32 cs[NM][2][KB], const Inputs &x, int s,
                                         int t, float acc[NM][NT][4]) {
#pragma unroll
    for (int blk = 0; blk < KB; blk++) {
        int grp = 4 * (KB * s + blk) + t;
        u32 sx[NM][2];
#pragma unroll
        for (int m = 0; m < NM; m++)
#pragma unroll
            for (int r = 0; r < 2; r++) sx[m][r] = scale_bf16x2(cs[m][r][blk], WIDE);
#pragma unroll
        for (int w = 0; w < 4; w++) {
            u32 a[NM][2][4];  // [matrix][row g / g + 8][codes (i, i + 4)]
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    word_codes_bf16x2(word_of(cur[m][r][blk], w), a[m][r]);
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        if constexpr (WIDE) a[m][r][i] = bf16x2_mul(a[m][r][i], BF16X2_2P126);
                        a[m][r][i] = bf16x2_mul(a[m][r][i], sx[m][r]);
                    }
                }
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                uint4 xv = x.load(nt, grp, blk, w);  // [8 inputs]
                // Inputs (0, 1), (2, 3), (4, 5), (6, 7), as the codes.
#pragma unroll
                for (int m = 0; m < NM; m++) {
                    mma_bf16(acc[m][nt], a[m][0][0], a[m][1][0], a[m][0][1], a[m][1][1], xv.x, xv.y);
                    mma_bf16(acc[m][nt], a[m][0][2], a[m][1][2], a[m][0][3], a[m][1][3], xv.z, xv.w);
                }
            }
        }
    }
}

// mma_step in the form the warp's step needs: WIDE when some of its scales exceed 2^1.
template <int NM, int NT, int KB, class Inputs>
__device__ __forceinline__ void mma_step_scaled(const uint4 cur[NM][2][KB], const u32 cs[NM][2][KB], const Inputs &x,
                                                int s, int t, float acc[NM][NT][4]) {
    bool wide = false;
#pragma unroll
    for (int m = 0; m < NM; m++)
#pragma unroll
        for (int r = 0; r < 2; r++)
#pragma unroll
            for (int blk = 0; blk < KB; blk++) wide |= cs[m][r][blk] > 128u;
    // Real checkpoints never need the wide path (weights of 4 and more); it keeps large scales exact.
    if (__any_sync(0xffffffffu, wide)) mma_step<NM, NT, KB, true>(cur, cs, x, s, t, acc);
    else mma_step<NM, NT, KB, false>(cur, cs, x, s, t, acc);
}

// This thread's B column of each n-tile: pair g of the tile, row pairs[.] / div of `in` (`width` bf16). Past the
// `count` pairs (a padding column, whose results are never stored) the last pair's row when FULL, else null.
template <int NT, bool FULL>
__device__ __forceinline__ RowInputs<NT, FULL> pair_inputs(const __nv_bfloat16 *in, const int *pairs, int count,
                                                           int div, int width, int g, int groups) {
    RowInputs<NT, FULL> x;
    x.groups = groups;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        int c = nt * 8 + g;
        if (FULL) x.x[nt] = in + (long)(pairs[min(c, count - 1)] / div) * width;
        else x.x[nt] = c < count ? in + (long)(pairs[c] / div) * width : nullptr;
    }
    return x;
}

// The register pass of a 16-row tile of NM matrices (NM = 2: gate and up) over the pairs[0..count) (count <= 8 NT)
// of one expert, KB blocks of 128 inputs per step: the next step's codes are loaded into registers during this one.
// rows[m]: this thread's 16 bytes of row g of matrix m in the tile's first chunk (row g + 8 is 512 bytes on);
// scales[m]: the tile's first chunk of scales of matrix m. Chunks past the matrix's groups read as zeros; rows past
// the matrix are the tile's zero padding (expert_layout.rs).
// The B column of this thread is pair g of each 8-pair tile: row pairs[.] / div of `in`, `width` (= 32 groups) bf16
// wide. acc[m][nt]: the MMA accumulators of n-tile nt.
template <int NM, int NT, int KB, bool FULL>
__device__ __forceinline__ void mma_rows_pass(const u8 *const rows[NM], const u8 *const scales[NM], int g, int t,
                                              int groups, const __nv_bfloat16 *in, const int *pairs, int count,
                                              int div, int width, float acc[NM][NT][4]) {
    int steps = (groups + 4 * KB - 1) / (4 * KB);
    uint4 q[NM][2][KB];
    u32 sb[NM][2][KB];
    auto load = [&](int s) {
#pragma unroll
        for (int blk = 0; blk < KB; blk++) {
            long chunk = KB * s + blk;
            bool ok = FULL || 4 * chunk + t < groups;
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    q[m][r][blk] = ok ? ld_stream16(rows[m] + chunk * TILE_CODE_BYTES + r * 512) : make_uint4(0u, 0u, 0u, 0u);
                    sb[m][r][blk] = ok ? (u32)__ldg(scales[m] + chunk * TILE_SCALE_BYTES + tile_scale_offset(g, r, t)) : 0u;
                }
        }
    };
    load(0);  // before the pairs are looked up: the codes are the long wait
    const RowInputs<NT, FULL> x = pair_inputs<NT, FULL>(in, pairs, count, div, width, g, groups);
    for (int s = 0; s < steps; s++) {
        uint4 cur[NM][2][KB];
        u32 cs[NM][2][KB];
#pragma unroll
        for (int blk = 0; blk < KB; blk++)
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    cur[m][r][blk] = q[m][r][blk];
                    cs[m][r][blk] = sb[m][r][blk];
                }
        if (s + 1 < steps) load(s + 1);
        mma_step_scaled<NM, NT, KB>(cur, cs, x, s, t, acc);
    }
}

// ---- The weight ring: cp.async copies of the next steps' weights into shared memory ----------------------------
// The ring pass streams a warp's tile through a private ring of EXPERT_STAGES steps in shared memory: a step's codes
// and scales are copied by cp.async (LDGSTS: no registers held while in flight), EXPERT_STAGES - 1 steps ahead of
// the one being multiplied. It holds no next step in registers, which lets moe_gate_up run 4 blocks per SM without
// spills (the register pass needs 168 registers there). A lane reads back exactly the 16-byte pieces of codes it
// copied itself; the scales of a step are copied as whole 4-byte words shared by the warp's lanes, so every step
// starts with a __syncwarp (which also orders the refill of the slot read in the step before). (The multistage
// cp.async pipeline follows the idea of CUTLASS's multistage mainloop; here each warp owns its ring, so no block
// barrier is needed, except for the token inputs that the staged pass below shares across the block.)
#define EXPERT_STAGES 3  // EXPERT_STAGES in moe.rs: steps per warp in the ring

// A ring step of NM matrices and KB blocks: codes [NM][2 rows][KB][32 lanes][16 B], then scales [NM][KB][64 B] (the
// chunks' scale bytes as stored, rows g + 8 r at (g + 8 r) * 4 + t).
template <int NM, int KB>
struct RingStep {
    static constexpr int CODES = NM * 2 * KB * 512;
    static constexpr int BYTES = CODES + NM * KB * TILE_SCALE_BYTES;
};
// Shared memory per warp (moe.rs derives the same from GATE_UP_KB, TILE_SCALE_BYTES and EXPERT_STAGES).
#define RING_WARP_BYTES (EXPERT_STAGES * RingStep<2, GATE_UP_KB>::BYTES)

// ---- Token inputs staged in shared memory --------------------------------------------------------------------
// In the ring pass every warp of a block loads the same token inputs itself, each step's 16-byte pieces of 8 NT rows,
// and waits for them: with many pairs per expert (k3-mini's batch 64: 16) those loads bound it, mostly missing L1 at
// 4 blocks per SM, and in a launch of few waves (few active experts) their round trips are exposed. The staged pass
// copies a step's inputs of the chunk's columns once per block into a slot of shared memory by cp.async, in the same
// commit group as the step's weights, EXPERT_STAGES - 1 steps ahead; the block's warps then read them back with one
// barrier per step. The MMAs see the same operands in the same order: the same bits. (ExpertForm::for_batch in
// moe.rs says which batches take it.)
// A slot is [STAGED_COLUMNS][KB * 128 inputs] bf16: column c's row of 16-byte units, unit q (inputs 8 q .. 8 q + 7)
// stored at unit q ^ (q / 8 % 2 * 2) ^ (c % 2), so that the 8 lanes of a quarter-warp (columns g, g + 1; groups t
// 0-3, the same word) read 8 different bank groups.
#define STAGED_COLUMNS 32  // the most pairs per chunk of the staged pass (4 n-tiles)

// Pick<c, A, B>::type: A when c, else B (std::conditional; NVRTC has no standard headers here).
template <bool C, class A, class B>
struct Pick {
    using type = A;
};
template <class A, class B>
struct Pick<false, A, B> {
    using type = B;
};

// A stage slot's bytes for KB blocks per step.
__host__ __device__ constexpr int stage_row_bytes(int kb) { return kb * 256; }
__host__ __device__ constexpr int stage_slot_bytes(int kb) { return STAGED_COLUMNS * stage_row_bytes(kb); }

// The B operands of mma_step from a stage slot: thread (g, t)'s column of n-tile nt is column 8 nt + g.
template <int KB>
struct StagedInputs {
    u32 lane_at;  // the slot's column g, group t of block 0
    int swizzle;  // word w of this lane's pieces is at unit 4 t + (w ^ swizzle)
    __device__ __forceinline__ uint4 load(int nt, int grp, int blk, int w) const {
        return ld_shared16(lane_at + nt * 8 * stage_row_bytes(KB) + blk * 256 + ((w ^ swizzle) << 4));
    }
};

// mma_rows_pass through the warp's ring (`ring`: EXPERT_STAGES RingStep<NM, KB>s of shared memory); the same arguments
// otherwise, and the same MMAs in the same order. The slots and the sources of the next copy are bumped once per step;
// every per-block, per-matrix and per-row offset is a constant that the instructions' addresses take.
// STAGED: the token inputs come through `stage` (EXPERT_STAGES slots of stage_slot_bytes(KB)) as described above,
// and every warp of the block runs the pass together (its barriers are the block's).
template <int NM, int NT, int KB, bool STAGED>
__device__ __forceinline__ void mma_ring_pass(u8 *ring, u8 *stage, const u8 *const rows[NM],
                                              const u8 *const scales[NM], int g, int t, int groups,
                                              const __nv_bfloat16 *in, const int *pairs, int count, int div,
                                              int width, float acc[NM][NT][4]) {
    using Step = RingStep<NM, KB>;
    constexpr int SCALE_WORDS = KB * TILE_SCALE_BYTES / 4;  // per matrix and step
    static_assert(SCALE_WORDS <= 32, "one scale word per lane and matrix");
    const int lane = g * 4 + t, steps = (groups + 4 * KB - 1) / (4 * KB), quads = (groups + 3) / 4;
    // Chunk c holds this thread's group 4 c + t while c < live_chunks; scale word `lane` of a step lies in
    // chunk KB s + lane / 16.
    const int live_chunks = (groups - t + 3) / 4, scale_chunk = lane / (TILE_SCALE_BYTES / 4);
    constexpr int LAST_SLOT = (EXPERT_STAGES - 1) * Step::BYTES;
    const u32 first_slot = (u32)__cvta_generic_to_shared(ring);
    const u8 *code_src[NM], *scale_src[NM];  // the next step to copy: its chunk KB s of each matrix
#pragma unroll
    for (int m = 0; m < NM; m++) {
        code_src[m] = rows[m];
        scale_src[m] = scales[m] + lane * 4;
    }
    // STAGED: this thread copies units unit_q of columns unit_q's column + j COLUMN_STRIDE (a padding column, or
    // inputs past the row, are zero-filled).
    constexpr int UNITS = STAGED ? NT * KB : 0, UNITS_PER_ROW = 16 * KB, COLUMN_STRIDE = 128 / UNITS_PER_ROW;
    const int unit_q = threadIdx.x % UNITS_PER_ROW, unit_column = threadIdx.x / UNITS_PER_ROW;
    const __nv_bfloat16 *unit_src[STAGED ? UNITS : 1];
    u32 unit_dst[STAGED ? UNITS : 1];
    bool unit_live[STAGED ? UNITS : 1];
    u32 stage_slot = STAGED ? (u32)__cvta_generic_to_shared(stage) : 0u;
    if constexpr (STAGED) {
        static_assert(128 % UNITS_PER_ROW == 0 && NT * 8 <= STAGED_COLUMNS, "whole rows per pass of the block");
        const int physical = unit_q ^ (unit_q / 8 % 2 * 2) ^ (unit_column % 2);  // COLUMN_STRIDE is even
#pragma unroll
        for (int j = 0; j < UNITS; j++) {
            int c = unit_column + j * COLUMN_STRIDE;
            unit_live[j] = c < count;
            unit_src[j] = (unit_live[j] ? in + (long)(pairs[c] / div) * width : in) + unit_q * 8;
            unit_dst[j] = c * stage_row_bytes(KB) + physical * 16;
        }
    }
    int next = 0;  // the step that code_src and scale_src point at
    // Copies step `next` into `slot` (past the last step: nothing), then closes its group, so that the group count
    // stays one per step.
    auto issue = [&](u32 slot) {
        if (next < steps) {
            u32 code_bytes[KB];
#pragma unroll
            for (int blk = 0; blk < KB; blk++) code_bytes[blk] = KB * next + blk < live_chunks ? 16u : 0u;
            const u32 dst = slot + lane * 16;
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int r = 0; r < 2; r++)
#pragma unroll
                    for (int blk = 0; blk < KB; blk++)
                        cp_async16_shared(dst + ((m * 2 + r) * KB + blk) * 512,
                                          code_src[m] + blk * TILE_CODE_BYTES + r * 512, code_bytes[blk]);
            if (lane < SCALE_WORDS) {
                const u32 scale_bytes = KB * next + scale_chunk < quads ? 4u : 0u;
#pragma unroll
                for (int m = 0; m < NM; m++)
                    cp_async4_shared(slot + Step::CODES + m * KB * TILE_SCALE_BYTES + lane * 4, scale_src[m],
                                     scale_bytes);
            }
            if constexpr (STAGED) {
#pragma unroll
                for (int j = 0; j < UNITS; j++)
                    cp_async16_shared(stage_slot + unit_dst[j], unit_src[j] + next * KB * 128,
                                      unit_live[j] && 4 * KB * next + unit_q / 4 < groups ? 16u : 0u);
            }
#pragma unroll
            for (int m = 0; m < NM; m++) {
                code_src[m] += KB * TILE_CODE_BYTES;
                scale_src[m] += KB * TILE_SCALE_BYTES;
            }
            next++;
        }
        cp_async_commit();
    };
    if constexpr (STAGED) {
        __syncthreads();  // every warp is done with the ring and the stage of the pass before
    } else {
        __syncwarp();  // every lane is done with the ring of the pass before
    }
#pragma unroll
    for (int s = 0; s < EXPERT_STAGES - 1; s++) {
        issue(first_slot + s * Step::BYTES);
        stage_slot += STAGED ? stage_slot_bytes(KB) : 0;
    }
    const int swizzle = t / 2 * 2 ^ g % 2;
    const u32 first_stage = STAGED ? (u32)__cvta_generic_to_shared(stage) : 0u;
    typename Pick<STAGED, StagedInputs<KB>, RowInputs<NT, false>>::type x;
    if constexpr (!STAGED) x = pair_inputs<NT, false>(in, pairs, count, div, width, g, groups);
    // Byte offsets in the ring of the slot of step s (read) and of the slot of step s - 1, which step
    // s + EXPERT_STAGES - 1 refills; `stage_read` and `stage_slot` are the stage's.
    int read = 0, refill = LAST_SLOT, stage_read = 0;
    for (int s = 0; s < steps; s++) {
        cp_async_wait<EXPERT_STAGES - 2>();  // this lane's copies of step s have landed
        if constexpr (STAGED) {
            __syncthreads();  // and every thread's; every warp has read the slots of step s - 1
            stage_slot = first_stage + (stage_read == 0 ? EXPERT_STAGES - 1 : stage_read - 1) * stage_slot_bytes(KB);
            x.lane_at = first_stage + stage_read * stage_slot_bytes(KB) + g * stage_row_bytes(KB) + t * 64;
            x.swizzle = swizzle;
            stage_read = stage_read == EXPERT_STAGES - 1 ? 0 : stage_read + 1;
        } else {
            __syncwarp();  // and every lane's: the shared scale words are in
        }
        issue(first_slot + refill);  // every lane has read the slot of step s - 1
        const u32 codes = first_slot + read + lane * 16;
        const u32 scales_at = first_slot + read + Step::CODES + tile_scale_offset(g, 0, t);
        uint4 cur[NM][2][KB];
        u32 cs[NM][2][KB];
#pragma unroll
        for (int blk = 0; blk < KB; blk++)
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    cur[m][r][blk] = ld_shared16(codes + ((m * 2 + r) * KB + blk) * 512);
                    // row g + 8 r: tile_scale_offset(g, r, t)
                    cs[m][r][blk] = ld_shared_u8(scales_at + (m * KB + blk) * TILE_SCALE_BYTES + r * 32);
                }
        refill = read;
        read = read == LAST_SLOT ? 0 : read + Step::BYTES;
        mma_step_scaled<NM, NT, KB>(cur, cs, x, s, t, acc);
    }
}

// The grouping entries of the block's active-expert slot (blockIdx.x) in one round trip with the active count:
// expert e and its pairs [p, end). False when the slot is idle (its entries are then unused).
__device__ __forceinline__ bool expert_slot(const int *group, int E, int &e, int &p, int &end) {
    int slot = blockIdx.x;
    int active = group[0];
    e = group[1 + slot], p = group[1 + E + slot], end = group[2 + E + slot];
    return slot < active;
}

// The MMA accumulators of NM tiles and NT n-tiles, zeroed.
template <int NM, int NT>
__device__ __forceinline__ void zero_acc(float acc[NM][NT][4]) {
#pragma unroll
    for (int m = 0; m < NM; m++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[m][nt][e] = 0.0f;
}

// Gate/up + SiTU of one 16-row tile for pairs[0..count), count <= 8 NT (see moe_gate_up).
template <int NT, int KB, bool STAGED>
__device__ __forceinline__ void gate_up_mma_chunk(u8 *ring, u8 *stage, const u8 *const rows[2], const u8 *const scales[2],
                                                  int g, int t, int groups, const __nv_bfloat16 *z, const int *pairs,
                                                  int count, int k, int D, __nv_bfloat16 *a, int I, int row0,
                                                  float beta, float lbeta) {
    float acc[2][NT][4];
    zero_acc<2, NT>(acc);
    mma_ring_pass<2, NT, KB, STAGED>(ring, stage, rows, scales, g, t, groups, z, pairs, count, k, D, acc);
    // c0, c1: row g, pairs 2t, 2t + 1 of the tile; c2, c3: row g + 8, the same pairs.
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int row = row0 + g + (e >> 1) * 8, c = nt * 8 + 2 * t + (e & 1);
            if (row < I && c < count) {
                float gate = bf_round(acc[0][nt][e]), up = bf_round(acc[1][nt][e]);
                a[(long)pairs[c] * I + row] =
                    __float2bfloat16_rn((beta * tanhf(gate / beta) * sigmoidf_(gate)) * (lbeta * tanhf(up / lbeta)));
            }
        }
}

// The expert's pairs in chunks of up to 24: one pass of 3 n-tiles (1 K block per step, so that its accumulators fit
// without spills) for more than 16, else one of 2 or 1 n-tiles (KB blocks per step). Every chunk reads the tile's
// weights (from HBM once, then from the caches; a second pass comes only past 24 tokens on one expert). A token's
// column sees the same MMAs in the same order whatever the chunk's n-tiles or K blocks per step.
#define MMA_CHUNKS(CALL, KB, FULL)                       \
    for (int left = end - p; left > 0; left = end - p) { \
        int count = min(left, 24);                       \
        if (count > 16) CALL(3, 1, FULL);                \
        else if (count > 8) CALL(2, KB, FULL);           \
        else CALL(1, KB, FULL);                          \
        p += count;                                      \
    }

// The staged kernels' chunks: up to STAGED_COLUMNS pairs, STAGED_KB blocks per step (block-uniform: every warp of
// the block takes the same chunks, as the staged pass's barriers need).
#define STAGED_KB 1
#define STAGED_CHUNKS(CALL)                                   \
    for (int left = end - p; left > 0; left = end - p) {      \
        int count = min(left, STAGED_COLUMNS);                \
        if (count > 24) CALL(4, STAGED_KB, false);            \
        else if (count > 16) CALL(3, STAGED_KB, false);       \
        else if (count > 8) CALL(2, STAGED_KB, false);        \
        else CALL(1, STAGED_KB, false);                       \
        p += count;                                           \
    }
// Shared memory per warp of a staged kernel's rings, and the block's stage after them (moe.rs derives the same).
#define STAGED_RING_WARP_BYTES (EXPERT_STAGES * RingStep<2, STAGED_KB>::BYTES)
#define STAGED_SHARED_BYTES (MMA_WARPS * STAGED_RING_WARP_BYTES + EXPERT_STAGES * stage_slot_bytes(STAGED_KB))

// Gate/up + SiTU per active expert: a[p, r] = bf(SiTU(bf(w1_e[r] z_t), bf(w3_e[r] z_t))) for every pair p = t k + j
// of expert e. The weights stream through each warp's ring (mma_ring_pass), which leaves it 128 registers without
// spills: 4 blocks per SM instead of the register pass's 3.
// grid = (min(n k, E), ceil(I / (16 MMA_WARPS))), blockDim 32 MMA_WARPS; dynamic shared memory MMA_WARPS
// RING_WARP_BYTES.
// z: [n, D]; w1/w3 tiled [E, I, D] codes and scales (expert_layout.rs); a: [n k, I]. D must be a multiple of 32.
// (Unlike moe_down, a form without masks for full widths was slower here: 1-3% at K3's routing,
// docs/perf/decisions.md#d36.)
extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, 4)
    moe_gate_up(const __nv_bfloat16 *z, const u8 *w1p, const u8 *w1s, const u8 *w3p, const u8 *w3s,
                    const int *group, const int *pairs, __nv_bfloat16 *a, int k, int E, int D, int I, float beta,
                    float lbeta) {
    kernel_entry();
    int e, p, end;
    if (!expert_slot(group, E, e, p, end)) return;
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int row0 = (blockIdx.y * MMA_WARPS + (threadIdx.x >> 5)) * 16;
    if (row0 >= I) return;
    int groups = D / 32;
    extern __shared__ __align__(16) u8 rings[];
    u8 *ring = rings + (threadIdx.x >> 5) * RING_WARP_BYTES;
    long tile = tile_index(e, row0, I, groups), code = tile * TILE_CODE_BYTES + tile_code_offset(g, 0, t);
    const u8 *rows[2] = {w1p + code, w3p + code}, *scales[2] = {w1s + tile * TILE_SCALE_BYTES, w3s + tile * TILE_SCALE_BYTES};
#define GATE_UP_MMA(NT, KB, FULL)                                                                             \
    gate_up_mma_chunk<NT, KB, false>(ring, nullptr, rows, scales, g, t, groups, z, pairs + p, count, k, D, a, I, row0, \
                                     beta, lbeta)
    MMA_CHUNKS(GATE_UP_MMA, GATE_UP_KB, false)
#undef GATE_UP_MMA
}

// moe_gate_up with the token inputs staged per block (see "Token inputs staged in shared memory"), one K block per step
// and chunks of up to STAGED_COLUMNS pairs; the same bits. A warp past the matrix's rows still copies and waits with
// its block: it runs the last tile and stores nothing. Dynamic shared memory STAGED_SHARED_BYTES.
extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, 4)
    moe_gate_up_staged(const __nv_bfloat16 *z, const u8 *w1p, const u8 *w1s, const u8 *w3p, const u8 *w3s,
                       const int *group, const int *pairs, __nv_bfloat16 *a, int k, int E, int D, int I, float beta,
                       float lbeta) {
    kernel_entry();
    int e, p, end;
    if (!expert_slot(group, E, e, p, end)) return;
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int row0 = (blockIdx.y * MMA_WARPS + (threadIdx.x >> 5)) * 16, groups = D / 32;
    extern __shared__ __align__(16) u8 rings[];
    u8 *ring = rings + (threadIdx.x >> 5) * STAGED_RING_WARP_BYTES, *stage = rings + MMA_WARPS * STAGED_RING_WARP_BYTES;
    long tile = tile_index(e, min(row0, (I - 1) / 16 * 16), I, groups);
    long code = tile * TILE_CODE_BYTES + tile_code_offset(g, 0, t);
    const u8 *rows[2] = {w1p + code, w3p + code}, *scales[2] = {w1s + tile * TILE_SCALE_BYTES, w3s + tile * TILE_SCALE_BYTES};
#define GATE_UP_MMA(NT, KB, FULL)                                                                                 \
    gate_up_mma_chunk<NT, KB, true>(ring, stage, rows, scales, g, t, groups, z, pairs + p, count, k, D, a, I, row0, \
                                    beta, lbeta)
    STAGED_CHUNKS(GATE_UP_MMA)
#undef GATE_UP_MMA
}

// The down projection's outputs of NM consecutive 16-row tiles from row0 (output channels below D) for the chunk's
// pairs[0..count): c0, c1 are row g of pairs 2t, 2t + 1 of an n-tile, c2, c3 row g + 8. Rounded to bf16 into y, or,
// when yf is not null, the fp32 sums unrounded into yf (an expert split by width: a rank's partial output, which the
// sharded forward all-reduces before it rounds; cuda::tp).
template <int NM, int NT>
__device__ __forceinline__ void store_down(const float acc[NM][NT][4], const int *pairs, int count,
                                           __nv_bfloat16 *y, float *yf, int D, int row0, int g, int t) {
#pragma unroll
    for (int m = 0; m < NM; m++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int row = row0 + 16 * m + g + (e >> 1) * 8, c = nt * 8 + 2 * t + (e & 1);
                if (row < D && c < count) {
                    const long at = (long)pairs[c] * D + row;
                    if (yf != nullptr)
                        yf[at] = acc[m][nt][e];
                    else
                        y[at] = __float2bfloat16_rn(acc[m][nt][e]);
                }
            }
}

// Down projection of one 16-row tile (output channels) for pairs[0..count) (see moe_down).
template <int NT, int KB, bool FULL>
__device__ __forceinline__ void down_mma_chunk(const u8 *const rows[1], const u8 *const scales[1], int g, int t,
                                               int groups, const __nv_bfloat16 *act, const int *pairs, int count,
                                               int I, __nv_bfloat16 *y, float *yf, int D, int row0) {
    float acc[1][NT][4];
    zero_acc<1, NT>(acc);
    mma_rows_pass<1, NT, KB, FULL>(rows, scales, g, t, groups, act, pairs, count, 1, I, acc);
    store_down<1, NT>(acc, pairs, count, y, yf, D, row0, g, t);
}

// Down projection per active expert: y[p, c] = bf(w2_e[c] a[p]) for every pair p of expert e. Two K blocks per step
// and at most 96 registers (5 blocks per SM; no spills in moe_down_full): more warps in flight with fewer bytes
// each beat 4 blocks of 4 K blocks per step (H200, routed_expert_bandwidth: 111.2 -> 105.2 us at batch 8; at K3's
// routing 212 -> 202 at 8 and 1,185 -> 1,141 at 64; equal at batch 1; docs/perf/decisions.md#d35).
// grid = (min(n k, E), ceil(D / (16 MMA_WARPS))), blockDim 32 MMA_WARPS.
// a: [n k, I]; w2 tiled [E, D, I] codes and scales (expert_layout.rs); y: [n k, D]. I must be a multiple of 32;
// moe_down_full takes the I that are multiples of 128 DOWN_KB (every step full, no masks).
template <bool FULL>
__device__ __forceinline__ void down_kernel(const __nv_bfloat16 *a, const u8 *w2p, const u8 *w2s, const int *group,
                                            const int *pairs, __nv_bfloat16 *y, float *yf, int E, int D, int I) {
    kernel_entry();
    int e, p, end;
    if (!expert_slot(group, E, e, p, end)) return;
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int row0 = (blockIdx.y * MMA_WARPS + (threadIdx.x >> 5)) * 16;
    if (row0 >= D) return;
    int groups = I / 32;
    long tile = tile_index(e, row0, D, groups);
    const u8 *rows[1] = {w2p + tile * TILE_CODE_BYTES + tile_code_offset(g, 0, t)};
    const u8 *scales[1] = {w2s + tile * TILE_SCALE_BYTES};
#define DOWN_MMA(NT, KB, FULL) \
    down_mma_chunk<NT, KB, FULL>(rows, scales, g, t, groups, a, pairs + p, count, I, y, yf, D, row0)
    MMA_CHUNKS(DOWN_MMA, DOWN_KB, FULL)
#undef DOWN_MMA
}
#define DOWN_ARGS                                                                                                  \
    const __nv_bfloat16 *a, const u8 *w2p, const u8 *w2s, const int *group, const int *pairs, __nv_bfloat16 *y,    \
        float *yf, int E, int D, int I
extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, DOWN_BLOCKS_PER_SM) moe_down(DOWN_ARGS) {
    down_kernel<false>(a, w2p, w2s, group, pairs, y, yf, E, D, I);
}
extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, DOWN_BLOCKS_PER_SM) moe_down_full(DOWN_ARGS) {
    down_kernel<true>(a, w2p, w2s, group, pairs, y, yf, E, D, I);
}
// Down projection of two 16-row tiles (rows row0 .. row0 + 31) for pairs[0..count) through the warp's ring, the
// inputs staged per block (see moe_down_staged).
template <int NT, int KB>
__device__ __forceinline__ void down_pair_mma_chunk(u8 *ring, u8 *stage, const u8 *const rows[2], const u8 *const scales[2], int g,
                                                    int t, int groups, const __nv_bfloat16 *act, const int *pairs,
                                                    int count, int I, __nv_bfloat16 *y, float *yf, int D, int row0) {
    float acc[2][NT][4];
    zero_acc<2, NT>(acc);
    mma_ring_pass<2, NT, KB, true>(ring, stage, rows, scales, g, t, groups, act, pairs, count, 1, I, acc);
    store_down<2, NT>(acc, pairs, count, y, yf, D, row0, g, t);
}

// Down projection as moe_down, with two 16-row tiles per warp streamed through its ring as moe_gate_up streams the
// gate and up tiles, and the token inputs staged per block (see "Token inputs staged in shared memory"): the two
// tiles, and the block's four warps, share every load of them. With many pairs per expert those loads, not the
// weights, bound moe_down (ncu at k3-mini's batch 64, 16 pairs per expert: L1 85% busy, DRAM 31%;
// docs/perf/decisions.md#d37). Each tile sees the MMAs of moe_down in the same order, so the results are the
// same bits. A warp past the matrix's rows runs the last tile pair and stores nothing.
// grid = (min(n k, E), D / (32 MMA_WARPS) rounded up), blockDim 32 MMA_WARPS; dynamic shared memory
// STAGED_SHARED_BYTES. D must be a multiple of 32 (the host takes moe_down otherwise).
extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, 4) moe_down_staged(DOWN_ARGS) {
    kernel_entry();
    int e, p, end;
    if (!expert_slot(group, E, e, p, end)) return;
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int row0 = (blockIdx.y * MMA_WARPS + (threadIdx.x >> 5)) * 32, groups = I / 32;
    extern __shared__ __align__(16) u8 rings[];
    u8 *ring = rings + (threadIdx.x >> 5) * STAGED_RING_WARP_BYTES, *stage = rings + MMA_WARPS * STAGED_RING_WARP_BYTES;
    // the second tile follows the first
    long tile = tile_index(e, min(row0, D - 32), D, groups), quads = (groups + 3) / 4;
    long code = tile * TILE_CODE_BYTES + tile_code_offset(g, 0, t);
    const u8 *rows[2] = {w2p + code, w2p + code + quads * TILE_CODE_BYTES};
    const u8 *scales[2] = {w2s + tile * TILE_SCALE_BYTES, w2s + (tile + quads) * TILE_SCALE_BYTES};
#define DOWN_PAIR_MMA(NT, KB, FULL) \
    down_pair_mma_chunk<NT, KB>(ring, stage, rows, scales, g, t, groups, a, pairs + p, count, I, y, yf, D, row0)
    STAGED_CHUNKS(DOWN_PAIR_MMA)
#undef DOWN_PAIR_MMA
}
#undef DOWN_ARGS
