// sparkd: elementwise and per-row kernels of the K3 forward (embedding gather, RMSNorm, AttnRes read,
// residual add, the three fused, SiTU and row gathers).
//
// Invariants: activations between ops are bf16 (the values the CPU reference rounds with `Real::act`);
// every reduction runs in fp32; each kernel rounds its output once, where the CPU reference does.
// Math: shared/reference/k3-architecture.md §2.2 (AttnRes), §2.3 (RMSNorm), §2.7 (SiTU).
// Compiled after prelude.cuh (compile.rs prepends it: cuda_bf16.h, INF_F, u32, i64, ld, bf_round, sigmoidf_,
// block_sum, block_max).

// out[i, :] = table[tokens[i], :]; grid = n tokens.
extern "C" __global__ void embed_gather(const __nv_bfloat16 *table, const u32 *tokens, __nv_bfloat16 *out, int d) {
    long row = (long)tokens[blockIdx.x] * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) out[(long)blockIdx.x * d + c] = table[row + c];
}

// KimiRMSNorm: y = bf(w * bf(x * rsqrt(mean(x^2) + eps))); grid = rows; rows are strided so that a
// prefix of a wider row (the MLA latent) can be normalised in place.
extern "C" __global__ void rms_norm(const __nv_bfloat16 *x, long x_stride, const __nv_bfloat16 *w,
                                    __nv_bfloat16 *y, long y_stride, int dim, float eps) {
    const __nv_bfloat16 *xr = x + blockIdx.x * x_stride;
    __nv_bfloat16 *yr = y + blockIdx.x * y_stride;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) { float v = ld(xr, c); ss += v * v; }
    ss = block_sum(ss);
    float r = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int c = threadIdx.x; c < dim; c += blockDim.x)
        yr[c] = __float2bfloat16_rn(ld(w, c) * bf_round(ld(xr, c) * r));
}

// The AttnRes softmax weights of token t over its nsrc sources (fp32 island; every thread gets all of them):
// p[i] = softmax_i(dot(v_i, q) * rsqrt(mean(v_i^2) + eps)). `score` is the caller's shared [64].
__device__ __forceinline__ void attn_res_weights(const __nv_bfloat16 *sources, long slot, int nsrc, const float *q,
                                                 long t, int d, float eps, float *score, float p[64]) {
    for (int i = 0; i < nsrc; i++) {
        const __nv_bfloat16 *v = sources + i * slot + t * d;
        float dq = 0.0f, ss = 0.0f;
        for (int c = threadIdx.x; c < d; c += blockDim.x) { float x = ld(v, c); dq += x * q[c]; ss += x * x; }
        dq = block_sum(dq);
        ss = block_sum(ss);
        if (threadIdx.x == 0) score[i] = dq * (1.0f / sqrtf(ss / (float)d + eps));
    }
    __syncthreads();
    float m = score[0];
    for (int i = 1; i < nsrc; i++) m = fmaxf(m, score[i]);
    float total = 0.0f;
    for (int i = 0; i < nsrc; i++) { p[i] = expf(score[i] - m); total += p[i]; }
    for (int i = 0; i < nsrc; i++) p[i] = p[i] / total;
}

// AttnRes depth-wise softmax read (fp32 island). `sources` holds `nsrc` slots of [n, d] at stride
// `slot`, sealed blocks first and the live sum last; q is the folded pseudo-query [d].
// out[t] = bf(sum_i softmax_i(dot(v_i, q) * rsqrt(mean(v_i^2) + eps)) * v_i); grid = n tokens.
extern "C" __global__ void attn_res_read(const __nv_bfloat16 *sources, long slot, int nsrc, const float *q,
                                         __nv_bfloat16 *out, int d, float eps) {
    __shared__ float score[64];
    long t = blockIdx.x;
    float p[64];
    attn_res_weights(sources, slot, nsrc, q, t, d, eps, score, p);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.0f;
        for (int i = 0; i < nsrc; i++) acc += p[i] * ld(sources + i * slot + t * d, c);
        out[t * d + c] = __float2bfloat16_rn(acc);
    }
}

// The residual add, AttnRes read and RMSNorm of one token in one kernel: when `addend` is given, the
// live source (the last slot) first becomes bf(live + addend) (written back); then the read as
// attn_res_read (kept in shared memory, bf16-rounded, and written to `read_out` [n, d] when given: the
// DSpark taps), then rms_norm of it with weight `norm_w` into `out` [n, d].
// Bit-identical to add_in_place, attn_res_read and rms_norm in sequence at 256 threads: the same
// per-thread column order and block reductions. grid = n tokens, 256 threads, d floats of shared memory.
extern "C" __global__ void attn_res_norm(__nv_bfloat16 *sources, long slot, int nsrc, const float *q,
                                         const __nv_bfloat16 *addend, const __nv_bfloat16 *norm_w, float norm_eps,
                                         __nv_bfloat16 *out, __nv_bfloat16 *read_out, int d, float eps) {
    extern __shared__ float read[]; // [d]
    __shared__ float score[64];
    long t = blockIdx.x;
    if (addend != nullptr) {
        __nv_bfloat16 *live = sources + (nsrc - 1) * slot + t * d;
        for (int c = threadIdx.x; c < d; c += blockDim.x)
            live[c] = __float2bfloat16_rn(ld(live, c) + ld(addend, t * d + c));
    }
    float p[64];
    attn_res_weights(sources, slot, nsrc, q, t, d, eps, score, p);
    float ss = 0.0f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.0f;
        for (int i = 0; i < nsrc; i++) acc += p[i] * ld(sources + i * slot + t * d, c);
        float v = bf_round(acc);
        read[c] = v;
        if (read_out != nullptr) read_out[t * d + c] = __float2bfloat16_rn(acc);
        ss += v * v;
    }
    ss = block_sum(ss);
    float r = 1.0f / sqrtf(ss / (float)d + norm_eps);
    for (int c = threadIdx.x; c < d; c += blockDim.x)
        out[t * d + c] = __float2bfloat16_rn(ld(norm_w, c) * bf_round(read[c] * r));
}

// a = bf(a + b) (the bf16 residual add).
extern "C" __global__ void add_in_place(__nv_bfloat16 *a, const __nv_bfloat16 *b, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        a[i] = __float2bfloat16_rn(ld(a, i) + ld(b, i));
}

// SiTU (fp32 island): out = bf([beta tanh(g/beta) sigmoid(g)] * [lbeta tanh(u/lbeta)]).
extern "C" __global__ void situ(const __nv_bfloat16 *g, const __nv_bfloat16 *u, __nv_bfloat16 *out, long n,
                                float beta, float lbeta) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float gv = ld(g, i), uv = ld(u, i);
        out[i] = __float2bfloat16_rn((beta * tanhf(gv / beta) * sigmoidf_(gv)) * (lbeta * tanhf(uv / lbeta)));
    }
}

// out[s, j, :] = src[s, rows[j], :] for every slot s; grid = (rows, slots).
extern "C" __global__ void gather_rows(const __nv_bfloat16 *src, long src_slot, const u32 *rows, __nv_bfloat16 *out,
                                       long out_slot, int d) {
    const __nv_bfloat16 *s = src + blockIdx.y * src_slot + (long)rows[blockIdx.x] * d;
    __nv_bfloat16 *o = out + blockIdx.y * out_slot + (long)blockIdx.x * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) o[c] = s[c];
}
