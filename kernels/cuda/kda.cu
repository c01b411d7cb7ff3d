// sparkd: Kimi Delta Attention for every row of a step in one launch: the short causal conv with SiLU,
// the gates, the l2 norms of q and k, the delta-rule recurrence and the gated output RMSNorm, fused
// (follows fla's fused_recurrent KDA: one program per (head, sequence) with the state held on chip).
//
// Invariants:
// - One block per (head, row); channel j of the head (its q/k/v conv windows) belongs to thread j, and the
//   head's state S [K, V] (fp32) stays in registers for the whole window. The chunked kernel keeps column j in
//   thread j and walks key channels i in ascending order, as the CPU reference does (kernels/src/cpu/kda.rs
//   `recurrent_step`); the recurrent kernel tiles S by warps of 16 key rows and sums each column by warp, then
//   the warps in order.
// - A row's result depends only on its own table entry and inputs (batch invariance, bit for bit).
// - Conv windows hold the last kw-1 pre-conv inputs (bf16); conv outputs are rounded to bf16 as the
//   CPU rounds them with `act`.
// - With snapshots on (entry `snaps` non-null) the state after m window tokens is written for every
//   snap_from <= m < t (m = 0: the state before the window), and the conv history (old window, then the
//   window's inputs) to `hist`, so a verify window can be cut back exactly (fla's IS_SPEC_DECODING
//   per-token states). Every snapshot and history row is written, so their buffers need no clearing.
// - The chunked kernel (kda_chunk_*) takes the rows whose entry says mode 1 (long windows without
//   snapshots), the recurrent kernel (kda_step_*) the others; each skips the other's rows.
// Math: shared/reference/k3-architecture.md §2.4 (decode) and §3.2 (chunked WY form).
// Compiled after prelude.cuh (compile.rs prepends it: cuda_bf16.h and the shared helpers: u32, i64, ld, bf_round,
// sigmoidf_, block reductions, dependent launch, clusters, cp.async and the bf16 MMA).

// One row's entry of the step table (i64 fields; kernels/src/cuda/attn.rs `KDA_ENTRY` writes them).
#define E_S 0          // float S [H, K, K]
#define E_CONV 1       // 3 x bf16 window [kw-1, P] (q, k, v)
#define E_SNAPS 4      // float [t - from, H, K, K] or 0
#define E_HIST 5       // bf16 [3, kw-1+t, P] or 0
#define E_OFFSET 6     // first token of the row in the step
#define E_T 7          // tokens of the row
#define E_FROM 8       // first m whose state is snapshotted
#define E_MODE 9       // 0: recurrent, 1: chunked
#define KDA_ENTRY 10

// The inputs shared by both kernels. qkv: 3 x [n, P] pre-conv; conv_w: 3 x [P, kw] fp32 (tap kw-1 multiplies
// the current token); f: [n, P] forget-gate input; b: [n, H] beta logits; g: [n, P] output-gate logits;
// a: exp(A_log) [H]; dt_bias: [P]; o_norm: [K]; o: [n, P] gated, normalised outputs.
struct KdaArgs {
    const __nv_bfloat16 *q, *k, *v;
    const float *wq, *wk, *wv;
    const __nv_bfloat16 *f, *b, *g;
    const float *a, *dt_bias, *o_norm;
    __nv_bfloat16 *o;
    int H, kw;
    float lower_bound, l2_eps, norm_eps;
};

// Conv + SiLU of one channel for one new input: shifts `win` (kw-1 old inputs, oldest first).
__device__ __forceinline__ float conv_step(float *win, float x, const float *w, int c, int kw) {
    win[kw - 1] = x;
    float acc = 0.0f;
    for (int j = 0; j < kw; j++) acc += w[c * kw + j] * win[j];
    for (int j = 0; j < kw - 1; j++) win[j] = win[j + 1];
    return bf_round(acc * sigmoidf_(acc));
}

// The conv windows of channel c (kw <= 8), every load in flight at once, then the old window copied to hist.
__device__ __forceinline__ void load_windows(const i64 *e, float win[3][8], int c, int P, int kw, int t) {
#pragma unroll
    for (int x = 0; x < 3; x++) {
        const __nv_bfloat16 *w = (const __nv_bfloat16 *)e[E_CONV + x];
#pragma unroll
        for (int j = 0; j < 7; j++)
            if (j < kw - 1) win[x][j] = ld(w, (i64)j * P + c);
    }
    __nv_bfloat16 *hist = (__nv_bfloat16 *)e[E_HIST];
    if (hist)
        for (int x = 0; x < 3; x++)
            for (int j = 0; j < kw - 1; j++)
                hist[((i64)x * (kw - 1 + t) + j) * P + c] = __float2bfloat16_rn(win[x][j]);  // exact: bf16 values
}

// The recurrent kernel keeps the head's conv windows in shared memory (wins[x][jw][channel], bf16: the pre-conv
// inputs are bf16, so this is exact), and channel j's thread alone reads and shifts column j after the barrier that
// follows their copy: no window lives in a local array. The old window goes to hist first.
template <int K>
__device__ __forceinline__ void windows_to_hist(__nv_bfloat16 *hist, const __nv_bfloat16 wins[3][7][K], int c, int j,
                                                int P, int kw, int t) {
    if (hist)
        for (int x = 0; x < 3; x++)
            for (int jw = 0; jw < kw - 1; jw++) hist[((i64)x * (kw - 1 + t) + jw) * P + c] = wins[x][jw][j];
}

// conv_step on column j of a window in shared memory: the same products in the same order (taps 0..kw-2 on the
// window, oldest first, then tap kw-1 on the new input), then the window shifted by the new input.
template <int K>
__device__ __forceinline__ float conv_step_shared(__nv_bfloat16 win[7][K], int j, __nv_bfloat16 raw, const float *w,
                                                  int c, int kw) {
    float acc = 0.0f;
    for (int jw = 0; jw < kw - 1; jw++) acc += w[c * kw + jw] * __bfloat162float(win[jw][j]);
    acc += w[c * kw + kw - 1] * __bfloat162float(raw);
    for (int jw = 0; jw + 1 < kw - 1; jw++) win[jw][j] = win[jw + 1][j];
    if (kw > 1) win[kw - 2][j] = raw;
    return bf_round(acc * sigmoidf_(acc));
}

__device__ __forceinline__ void store_windows(__nv_bfloat16 *const conv[3], float win[3][8], int c, int P, int kw) {
    for (int x = 0; x < 3; x++)
        for (int j = 0; j < kw - 1; j++) conv[x][(i64)j * P + c] = __float2bfloat16_rn(win[x][j]);
}

// One token's inputs for channel c of head h: pre-conv q, k, v, the forget-gate input, beta and output-gate logits.
struct TokenIn {
    __nv_bfloat16 x[3];
    float f, b, g;
};

__device__ __forceinline__ TokenIn load_token(const KdaArgs &A, i64 tok, int c, int h, int P) {
    TokenIn in;
    in.x[0] = A.q[tok * P + c];
    in.x[1] = A.k[tok * P + c];
    in.x[2] = A.v[tok * P + c];
    in.f = ld(A.f, tok * P + c);
    in.b = ld(A.b, tok * A.H + h);
    in.g = ld(A.g, tok * P + c);
    return in;
}

// The conv outputs of window position ti for channel c from its raw inputs; the new inputs go to hist. The taps
// of channel c are row `tap_row` of ws[x] ([.., kw] each).
__device__ __forceinline__ void conv_token(const KdaArgs &A, __nv_bfloat16 *hist, float win[3][8], int c, int P, int t,
                                           int ti, const __nv_bfloat16 raw[3], const float *const ws[3], int tap_row,
                                           float out[3]) {
    for (int x = 0; x < 3; x++) {
        if (hist) hist[((i64)x * (A.kw - 1 + t) + A.kw - 1 + ti) * P + c] = raw[x];
        out[x] = conv_step(win[x], __bfloat162float(raw[x]), ws[x], tap_row, A.kw);
    }
}

// conv_token for the recurrent kernel, on the windows in shared memory (channel j's column).
template <int K>
__device__ __forceinline__ void conv_token_shared(const KdaArgs &A, __nv_bfloat16 *hist, __nv_bfloat16 wins[3][7][K],
                                                  int c, int j, int P, int t, int ti, const __nv_bfloat16 raw[3],
                                                  const float *const ws[3], float out[3]) {
    for (int x = 0; x < 3; x++) {
        if (hist) hist[((i64)x * (A.kw - 1 + t) + A.kw - 1 + ti) * P + c] = raw[x];
        out[x] = conv_step_shared<K>(wins[x], j, raw[x], ws[x], j, A.kw);
    }
}

// A row's table entry (16-byte aligned: the table is, and KDA_ENTRY is even), all of it in flight at once.
__device__ __forceinline__ void load_entry(const i64 *row, i64 e[KDA_ENTRY]) {
#pragma unroll
    for (int f = 0; f < KDA_ENTRY; f += 2)
        asm volatile("ld.volatile.global.v2.s64 {%0, %1}, [%2];" : "=l"(e[f]), "=l"(e[f + 1]) : "l"(row + f));
}

// C consecutive floats (16-byte aligned when C = 4) as one access.
template <int C>
__device__ __forceinline__ void ld_cols(const float *p, float v[C]) {
    if constexpr (C == 4) {
        float4 x = *(const float4 *)p;
        v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
    } else {
#pragma unroll
        for (int cc = 0; cc < C; cc++) v[cc] = p[cc];
    }
}
template <int C>
__device__ __forceinline__ void st_cols(float *p, const float v[C]) {
    if constexpr (C == 4) {
        *(float4 *)p = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
        for (int cc = 0; cc < C; cc++) p[cc] = v[cc];
    }
}

// This thread's tile of a head's state [K, K] (16 key rows from r0, C value columns from c0) at S.
template <int K, int C>
__device__ __forceinline__ void ld_tile(const float *S, int r0, int c0, float s[16][C]) {
#pragma unroll
    for (int r = 0; r < 16; r++) ld_cols<C>(S + (r0 + r) * K + c0, s[r]);
}
template <int K, int C>
__device__ __forceinline__ void st_tile(float *S, int r0, int c0, const float s[16][C]) {
#pragma unroll
    for (int r = 0; r < 16; r++) st_cols<C>(S + (r0 + r) * K + c0, s[r]);
}

// grid = (H, rows); blockDim = 2K (K / 16 warps). Rows with mode != 0 are left to the chunked kernel.
// Warp w keeps key rows [16 w, 16 w + 16) of the head's state S [K, K] in registers, lane l the value columns
// [l C, l C + C) (C = K / 32): each warp reads and writes whole rows (512 contiguous bytes at K = 128), and a
// column's sums over the key rows are each warp's 16 rows in ascending order, then the warps' partials in warp
// order (a fixed order: batch invariant, bit for bit). Thread j < K runs channel j: conv, gates, l2 norms, the
// delta-rule error and the gated output norm.
// The loads are issued in two round trips: the row's table entry, then the state and the conv windows
// (asynchronous copies to shared memory), and the head's weights, all before the grid dependency wait; after it
// only the token's inputs, which the kernels just before write. Reading the entry, state and windows early is safe:
// the table is uploaded before the step's first kernel, and no kernel of the step but this layer's own writes the
// row's state or windows (they are written back at its end, after the wait).
template <int K>
__device__ void kda_step(const i64 *table, KdaArgs A) {
    constexpr int C = K / 32, WARPS = K / 16;
    __shared__ __align__(16) float qs[K], ks[K], decay[K], bu[K];
    __shared__ __align__(16) float red[WARPS][K];              // the warps' partial sums
    __shared__ float taps[3][K * 8];                           // the head's conv taps, [K, kw] per input
    __shared__ __align__(4) __nv_bfloat16 wins[3][7][K];       // the head's conv windows, [kw - 1, K] per input
    int h = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, H = A.H, P = H * K, kw = A.kw;
    bool channel = tid < K;
    int j = channel ? tid : 0, c = h * K + j, r0 = warp * 16, c0 = lane * C;
    const float *ws[3] = {A.wq, A.wk, A.wv};
    for (int x = 0; x < 3; x++)
        for (int i = tid; i < K * kw; i += 2 * K) taps[x][i] = ws[x][(i64)h * K * kw + i];
    const float *const taps_of[3] = {taps[0], taps[1], taps[2]};
    float a_h = A.a[h], dt_c = A.dt_bias[c], norm_j = A.o_norm[j];
    // The row's whole table entry in one round trip (volatile loads: none is moved past the mode test).
    i64 e[KDA_ENTRY];
    load_entry(table + (i64)blockIdx.y * KDA_ENTRY, e);
    if (e[E_MODE] != 0) {
        kernel_entry();
        return;
    }
    i64 offset = e[E_OFFSET];
    int t = (int)e[E_T], from = (int)e[E_FROM];
    float *S = (float *)e[E_S] + (i64)h * K * K;
    float *snaps = (float *)e[E_SNAPS];
    __nv_bfloat16 *const conv[3] = {(__nv_bfloat16 *)e[E_CONV], (__nv_bfloat16 *)e[E_CONV + 1],
                                    (__nv_bfloat16 *)e[E_CONV + 2]};
    // Only the channel threads write history.
    __nv_bfloat16 *hist = channel ? (__nv_bfloat16 *)e[E_HIST] : nullptr;
    float s[16][C];
    ld_tile<K, C>(S, r0, c0, s);
    int words = (kw - 1) * K / 2;
    for (int i = tid; i < 3 * words; i += 2 * K) {
        int x = i / words, jw = i % words / (K / 2), pair = i % (K / 2);
        cp_async4(&wins[x][jw][2 * pair], conv[x] + (i64)jw * P + h * K + 2 * pair, true);
    }
    cp_async_commit();
    kernel_entry();
    TokenIn cur = load_token(A, offset, c, h, P);
    // Snapshot m = 0 (the state before the window) when the window may be cut back to nothing.
    if (snaps && from == 0) st_tile<K, C>(snaps + (i64)h * K * K, r0, c0, s);
    float scale = 1.0f / sqrtf((float)K);
    cp_async_wait<0>();
    __syncthreads();  // the taps and windows are in
    windows_to_hist<K>(hist, wins, c, j, P, kw, t);
    for (int ti = 0; ti < t; ti++) {
        i64 tok = offset + ti;
        // The next token's inputs are loaded while this one computes.
        TokenIn next = cur;
        if (ti + 1 < t) next = load_token(A, tok + 1, c, h, P);
        float x[3] = {0.0f, 0.0f, 0.0f};
        if (channel) conv_token_shared<K>(A, hist, wins, c, j, P, t, ti, cur.x, taps_of, x);
        float qq = block_sum(x[0] * x[0]), kk = block_sum(x[1] * x[1]);
        if (channel) {
            qs[j] = x[0] * (1.0f / sqrtf(qq + A.l2_eps)) * scale;
            ks[j] = x[1] * (1.0f / sqrtf(kk + A.l2_eps));
            float z = a_h * (cur.f + dt_c);
            decay[j] = expf(A.lower_bound * sigmoidf_(z));
        }
        __syncthreads();
        // Decay the rows, then the delta-rule error u_j = v_j - sum_i k_i S[i, j].
        float part[C];
#pragma unroll
        for (int cc = 0; cc < C; cc++) part[cc] = 0.0f;
#pragma unroll
        for (int r = 0; r < 16; r++) {
            float d = decay[r0 + r], ki = ks[r0 + r];
#pragma unroll
            for (int cc = 0; cc < C; cc++) {
                s[r][cc] *= d;
                part[cc] += ki * s[r][cc];
            }
        }
        st_cols<C>(&red[warp][c0], part);
        __syncthreads();
        if (channel) {
            float pk = 0.0f;
#pragma unroll
            for (int w = 0; w < WARPS; w++) pk += red[w][j];
            bu[j] = sigmoidf_(cur.b) * (x[2] - pk);
        }
        __syncthreads();
        // Rank-1 write, then the read with the updated state.
        float b[C];
        ld_cols<C>(&bu[c0], b);
#pragma unroll
        for (int cc = 0; cc < C; cc++) part[cc] = 0.0f;
#pragma unroll
        for (int r = 0; r < 16; r++) {
            float ki = ks[r0 + r], qi = qs[r0 + r];
#pragma unroll
            for (int cc = 0; cc < C; cc++) {
                s[r][cc] += ki * b[cc];
                part[cc] += qi * s[r][cc];
            }
        }
        st_cols<C>(&red[warp][c0], part);
        __syncthreads();
        float out = 0.0f;
        if (channel)
#pragma unroll
            for (int w = 0; w < WARPS; w++) out += red[w][j];
        // Gated output RMSNorm of the head (fp32), then bf16.
        float ss = block_sum(out * out);
        float rn = 1.0f / sqrtf(ss / (float)K + A.norm_eps);
        if (channel) A.o[tok * P + c] = __float2bfloat16_rn(out * rn * norm_j * sigmoidf_(cur.g));
        int m = ti + 1;
        if (snaps && m >= from && m < t) st_tile<K, C>(snaps + ((i64)(m - from) * H + h) * K * K, r0, c0, s);
        cur = next;
        __syncthreads();
    }
    st_tile<K, C>(S, r0, c0, s);
    if (channel)
        for (int x = 0; x < 3; x++)
            for (int jw = 0; jw < kw - 1; jw++) conv[x][(i64)jw * P + c] = wins[x][jw][j];
}

#define CHUNK 16

// The chunked (WY / UT) form over chunks of CHUNK tokens, for rows of mode 1 (no snapshots). grid = (H, rows);
// blockDim = K. Per chunk of n tokens with in-chunk cumulative log-decay G [n, K] (kernels/src/cpu/kda.rs
// `chunked_head`, after fla's naive_chunk_kda):
//   L[i, j] = beta_i sum_c k_i e^{G_i - G_j} k_j (j < i),  A[i, j] = sum_c q_i e^{G_i - G_j} k_j (j <= i),
//   (I + L) [W | U] = diag(beta) [e^G * K | V]  (forward substitution),  V' = U - W S,
//   O = (Q * e^G) S + A V',  S <- diag(e^{G_n}) S + (e^{G_n - G} * K)^T V'.
// Thread j keeps column j of S in registers and owns column j of the per-token rows (U / V', O) in shared
// memory; rows read across channels (q, k, G, W) are shared too.
template <int K>
__device__ void kda_chunk(const i64 *table, KdaArgs A) {
    __shared__ float qs[CHUNK][K];  // q, then q * e^G
    __shared__ float ks[CHUNK][K];  // k, then e^{G_n - G} * k
    __shared__ float gs[CHUNK][K];  // G, then W
    __shared__ float us[CHUNK][K];  // v, then U, then V'
    __shared__ float os[CHUNK][K];  // raw outputs
    __shared__ __nv_bfloat16 gate[CHUNK][K];  // output-gate logits
    __shared__ float lm[CHUNK][CHUNK], am[CHUNK][CHUNK];
    __shared__ float beta[CHUNK], qn[CHUNK], kn[CHUNK], decay_n[K];
    const i64 *e = table + (i64)blockIdx.y * KDA_ENTRY;
    if (e[E_MODE] != 1) return;
    int h = blockIdx.x, j = threadIdx.x, H = A.H, P = H * K, kw = A.kw;
    int c = h * K + j;
    int warp = j >> 5, lane = j & 31, warps = K >> 5;
    i64 offset = e[E_OFFSET];
    int t = (int)e[E_T];
    float *S = (float *)e[E_S] + (i64)h * K * K;
    float win[3][8];
    load_windows(e, win, c, P, kw, t);
    float s[K];
#pragma unroll
    for (int i = 0; i < K; i++) s[i] = S[i * K + j];
    float scale = 1.0f / sqrtf((float)K);
    for (int start = 0; start < t; start += CHUNK) {
        int n = min(CHUNK, t - start);
        // The chunk's inputs of channel c, all loads in flight at once (raw q, k, v staged in qs, ks, us).
#pragma unroll
        for (int i = 0; i < CHUNK; i++) {
            if (i >= n) break;
            TokenIn in = load_token(A, offset + start + i, c, h, P);
            qs[i][j] = __bfloat162float(in.x[0]);
            ks[i][j] = __bfloat162float(in.x[1]);
            us[i][j] = __bfloat162float(in.x[2]);
            gs[i][j] = in.f;
            gate[i][j] = __float2bfloat16_rn(in.g);
            if (j == 0) beta[i] = sigmoidf_(in.b);
        }
        // Conv, gates and the cumulative log-decay of channel c (own column only: no barrier needed).
        float gcum = 0.0f;
        for (int i = 0; i < n; i++) {
            __nv_bfloat16 raw[3] = {__float2bfloat16_rn(qs[i][j]), __float2bfloat16_rn(ks[i][j]),
                                    __float2bfloat16_rn(us[i][j])};
            float x[3];
            const float *ws[3] = {A.wq, A.wk, A.wv};
            conv_token(A, (__nv_bfloat16 *)e[E_HIST], win, c, P, t, start + i, raw, ws, c, x);
            qs[i][j] = x[0];
            ks[i][j] = x[1];
            us[i][j] = x[2];
            float z = A.a[h] * (gs[i][j] + A.dt_bias[c]);
            gcum += A.lower_bound * sigmoidf_(z);
            gs[i][j] = gcum;
        }
        __syncthreads();
        // l2 norms, one warp per token.
        for (int i = warp; i < n; i += warps) {
            float a2 = 0.0f, b2 = 0.0f;
            for (int cc = lane; cc < K; cc += 32) {
                a2 += qs[i][cc] * qs[i][cc];
                b2 += ks[i][cc] * ks[i][cc];
            }
            for (int o = 16; o > 0; o >>= 1) {
                a2 += __shfl_xor_sync(0xffffffffu, a2, o);
                b2 += __shfl_xor_sync(0xffffffffu, b2, o);
            }
            if (lane == 0) {
                qn[i] = (1.0f / sqrtf(a2 + A.l2_eps)) * scale;
                kn[i] = 1.0f / sqrtf(b2 + A.l2_eps);
            }
        }
        __syncthreads();
        for (int i = 0; i < n; i++) {
            qs[i][j] *= qn[i];
            ks[i][j] *= kn[i];
        }
        __syncthreads();
        // L and A, one warp per (i, j) pair.
        for (int pair = warp; pair < n * n; pair += warps) {
            int i = pair / n, jj = pair % n;
            if (jj > i) continue;
            float kl = 0.0f, qa = 0.0f;
            for (int cc = lane; cc < K; cc += 32) {
                float d = expf(gs[i][cc] - gs[jj][cc]) * ks[jj][cc];
                kl += ks[i][cc] * d;
                qa += qs[i][cc] * d;
            }
            for (int o = 16; o > 0; o >>= 1) {
                kl += __shfl_xor_sync(0xffffffffu, kl, o);
                qa += __shfl_xor_sync(0xffffffffu, qa, o);
            }
            if (lane == 0) {
                lm[i][jj] = jj < i ? beta[i] * kl : 0.0f;
                am[i][jj] = qa;
            }
        }
        __syncthreads();
        // Column j of W (into gs) and U (into us) by forward substitution; q * e^G and e^{G_n - G} * k in place.
        float gn = gs[n - 1][j];
        for (int i = 0; i < n; i++) {
            float g = gs[i][j];
            float w = beta[i] * expf(g) * ks[i][j];
            float u = beta[i] * us[i][j];
            for (int jj = 0; jj < i; jj++) {
                w -= lm[i][jj] * gs[jj][j];
                u -= lm[i][jj] * us[jj][j];
            }
            gs[i][j] = w;
            us[i][j] = u;
            qs[i][j] *= expf(g);
            ks[i][j] *= expf(gn - g);
        }
        decay_n[j] = expf(gn);
        __syncthreads();
        // V' = U - W S and O = (Q e^G) S + A V' (column j).
        // (Four partial sums per product, added in a fixed order, keep the FMA chains short.)
        for (int i = 0; i < n; i++) {
            float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int cc = 0; cc < K; cc++) p[cc & 3] += gs[i][cc] * s[cc];
            us[i][j] -= (p[0] + p[1]) + (p[2] + p[3]);
        }
        for (int i = 0; i < n; i++) {
            float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int cc = 0; cc < K; cc++) p[cc & 3] += qs[i][cc] * s[cc];
            float acc = (p[0] + p[1]) + (p[2] + p[3]);
            for (int jj = 0; jj <= i; jj++) acc += am[i][jj] * us[jj][j];
            os[i][j] = acc;
        }
        // S <- diag(e^{G_n}) S + (e^{G_n - G} K)^T V'.
#pragma unroll
        for (int cc = 0; cc < K; cc++) s[cc] *= decay_n[cc];
        for (int i = 0; i < n; i++) {
            float u = us[i][j];
#pragma unroll
            for (int cc = 0; cc < K; cc++) s[cc] += ks[i][cc] * u;
        }
        __syncthreads();
        // Gated output RMSNorm per token: squares summed one warp per token.
        for (int i = warp; i < n; i += warps) {
            float a2 = 0.0f;
            for (int cc = lane; cc < K; cc += 32) a2 += os[i][cc] * os[i][cc];
            for (int o = 16; o > 0; o >>= 1) a2 += __shfl_xor_sync(0xffffffffu, a2, o);
            if (lane == 0) qn[i] = 1.0f / sqrtf(a2 / (float)K + A.norm_eps);
        }
        __syncthreads();
        for (int i = 0; i < n; i++) {
            i64 tok = offset + start + i;
            A.o[tok * P + c] =
                __float2bfloat16_rn(os[i][j] * qn[i] * A.o_norm[j] * sigmoidf_(__bfloat162float(gate[i][j])));
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < K; i++) S[i * K + j] = s[i];
    __nv_bfloat16 *const conv[3] = {(__nv_bfloat16 *)e[E_CONV], (__nv_bfloat16 *)e[E_CONV + 1],
                                    (__nv_bfloat16 *)e[E_CONV + 2]};
    store_windows(conv, win, c, P, kw);
}

#define KDA_KERNELS(K)                                                                                        \
    extern "C" __global__ void __launch_bounds__(2 * K) kda_step_##K(const i64 *table, KdaArgs args) {       \
        kda_step<K>(table, args); /* calls kernel_entry() after its weight loads */                            \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(K) kda_chunk_##K(const i64 *table, KdaArgs args) {          \
        kernel_entry();                                                                                      \
        kda_chunk<K>(table, args);                                                                             \
    }

KDA_KERNELS(32)
KDA_KERNELS(128)
