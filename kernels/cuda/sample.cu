// sparkd: sampling, log-probabilities and the speculative acceptance rules on the device, one block of
// 1024 threads per logits row [vocab]: bf16 rows (`sample_rows`, the target's logits) or f32 rows
// (`sample_rows_f32`, the DSpark drafter's Markov logits, never rounded to bf16); temperature-only f32 draws
// also as wide draws, several blocks per row (`draw_partials_f32`, `draw_pick_f32`, at the end of the file).
//
// The same function as the CPU reference (kernels/src/sampling.rs, acceptance.rs), row by row:
// - the token mask first (a disallowed id reads as -inf), then temperature -> top-k -> top-p
//   (`Distribution::from_logits`), ties to the lowest id; greedy rows (temperature 0) take the argmax;
// - tokens by the inverse CDF over ascending ids at `uniform(seed, position, stream)`, the same
//   counter RNG bit for bit (`sampling::hash3`, wrapping 64-bit integer arithmetic);
// - the accept test `u * q(x) < p(x)` (one-hot q when a row has none) and, on rejection, the residual
//   `normalise(max(p - q, 0))` (p itself when that has no mass), as `acceptance::verify_sampling`;
// - raw log-probabilities: the log-softmax of the masked logits, and the top-N alternatives.
//
// Invariants:
// - Thread t owns the contiguous ids [t * seg, (t + 1) * seg): every sum runs in id order inside a
//   segment, then over segments in a fixed tree, so a row's result depends on nothing but the row (no
//   floating-point atomics; histograms count with integer atomics). Probabilities are f64. Only the
//   argmax pass and the greedy one-hot write read ids strided (coalesced): neither sums.
// - Selection without sorting: an order key per value (16 bits for bf16, 32 for f32; larger key = larger
//   value, -0 < +0 as Rust's `total_cmp`) and one 256-bin radix histogram per key byte, high byte first,
//   find the k-th best key; ties at that key are kept lowest id first by a block prefix count. Top-p
//   does the same over mass: the bins of every byte but the lowest carry fixed-point mass (2^-62 units,
//   exact integer sums, so a chosen bin's sub-bins sum to its mass), the lowest byte's keys exact f64
//   mass (count * p, all ids of one key having the same p). The bf16 path is the two-byte case. Top-p
//   ranks -0 and +0 as one key (equal probability, the CPU's rank by probability) unless top-k ran
//   first (the CPU then keeps logit order).
// - Normalisations multiply by a reciprocal (the CPU divides): a last-bit difference, inside the tolerance.
// - The CPU sums in other orders (best-first, one sequential pass), so sums differ in the last bits;
//   a decision differs only where a threshold (u, top_p) lies within ~1e-12 of a cumulative mass.
// Selection by histograms follows FlashInfer's and vLLM's GPU top-k/top-p samplers (threshold search
// instead of a sort of the vocabulary); the code is sparkd's own.
// Compiled after prelude.cuh (compile.rs prepends it: cuda_bf16.h and the shared helpers: u32, i64, ld, bf_round,
// sigmoidf_, block reductions, dependent launch, clusters, cp.async and the bf16 MMA).

typedef unsigned long long u64;
typedef unsigned short u16;

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define ARGMAX_LOADS 8 // logits per thread in flight in the argmax pass
#define FULL_MASK 0xffffffffu
#define NO_ID 0xffffffffu
#define FIXED_ONE 4611686018427387904.0 // 2^62: fixed-point unit of the top-p high-byte mass

// Row descriptor: DESC_WORDS u64 per row (kernels/src/cuda/sample.rs writes them).
#define DESC_WORDS 12
#define D_LOGITS 0      // const bf16 * or const float * [vocab] (by kernel)
#define D_Q 1           // const float * [vocab] processed draft probabilities, 0: one-hot on the draft
#define D_PROBS_OUT 2   // float * [vocab] processed probabilities out, 0: none
#define D_SEED 3
#define D_POSITION 4
#define D_STREAM 5      // the RNG stream of the emitted token
#define D_TEMP_TOPP 6   // temperature f32 bits | top_p f32 bits << 32
#define D_TOPK_DRAFT 7  // top_k u32 | draft id << 32 (NO_ID: none)
#define D_TOP_N 8       // 0: no log-probabilities, else top_n + 1
#define D_MODE 9
#define D_TOKEN_OUT 10  // u32 *: the row's token is also written here (0: not)
#define D_ROW_MASK 11   // const u32 * [ceil(vocab / 32)]: the row's own mask (a grammar's), beside the launch's; 0: none

#define MODE_SAMPLE 0 // token from p
#define MODE_VERIFY 1 // accept test of the draft; on rejection the residual token
#define MODE_PROBS 2  // only write p

#define ACCEPT_STREAM 1ull // sampling::RngStream::Accept

#define MAX_TOP_N 64
// Status words per row (STATUS_WORDS): token, accepted, error code, error id, f32 bits of the token's and
// the draft's log-probabilities.
#define STATUS_WORDS 6
#define ERR_BAD_LOGIT 1
#define ERR_ALL_MASKED 2

// ---- the counter RNG (port of sampling::hash3 / uniform) ----

#define GOLDEN 0x9E3779B97F4A7C15ull

__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ u64 hash3(u64 seed, u64 position, u64 stream) {
    u64 h = mix64(seed + GOLDEN);
    h = mix64(h ^ (position + GOLDEN * 2ull));
    return mix64(h ^ (stream + GOLDEN * 3ull));
}

// [0, 1): the top 53 bits times 2^-53 (exact in f64).
__device__ __forceinline__ double uniform01(u64 seed, u64 position, u64 stream) {
    return (double)(hash3(seed, position, stream) >> 11) * (1.0 / 9007199254740992.0);
}

// out[i] = hash3(seeds[i], positions[i], streams[i]); checks the port bit for bit.
extern "C" __global__ void rng_hash3(const u64 *seeds, const u64 *positions, const u64 *streams, u64 *out, int n) {
    kernel_entry();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = hash3(seeds[i], positions[i], streams[i]);
}

// ---- logits types, keys and rows ----

// A logits element type: its bit pattern (as u32), the monotone order key of a pattern (a larger value
// has a larger key; KEY_BITS wide) and back, and the value of a pattern.
struct Bf16Logits {
    typedef u16 Elem;
    static const int KEY_BITS = 16;
    static const u32 SIGN = 0x8000u;
    static const u32 ALL = 0xffffu;
    static const u32 NEG_INF = 0xff80u;
    static __device__ __forceinline__ float value(u32 bits) { return __uint_as_float(bits << 16); }
};

struct F32Logits {
    typedef u32 Elem;
    static const int KEY_BITS = 32;
    static const u32 SIGN = 0x80000000u;
    static const u32 ALL = 0xffffffffu;
    static const u32 NEG_INF = 0xff800000u;
    static __device__ __forceinline__ float value(u32 bits) { return __uint_as_float(bits); }
};

template <class L> __device__ __forceinline__ u32 order_key(u32 bits) {
    return (bits & L::SIGN) ? (~bits & L::ALL) : (bits | L::SIGN);
}
template <class L> __device__ __forceinline__ u32 bits_of_key(u32 key) {
    return (key & L::SIGN) ? (key & ~L::SIGN & L::ALL) : (~key & L::ALL);
}

template <class L> struct RowView {
    const typename L::Elem *logits; // [vocab] bit patterns
    const u32 *mask;                // [ceil(vocab / 32)] bit set = allowed; null: every id allowed
    const u32 *row_mask;            // the row's own mask, same layout, applied beside `mask`; null: none
    int vocab;
};

template <class L> __device__ __forceinline__ u32 bits_at(const RowView<L> &r, int i) {
    if (r.mask && !((r.mask[i >> 5] >> (i & 31)) & 1u)) return L::NEG_INF;
    if (r.row_mask && !((r.row_mask[i >> 5] >> (i & 31)) & 1u)) return L::NEG_INF;
    return r.logits[i];
}

struct Shared {
    u32 hist[256];
    u64 mass[256];
    double scratch[SAMPLE_WARPS];
    u32 scratch_u[SAMPLE_WARPS];
    float best_v[SAMPLE_WARPS];
    u32 best_i[SAMPLE_WARPS];
    u32 sel_a, sel_b, bad_id, hit, last_plus1, top_count;
    u64 sel_mass;
    double draft_p; // the draft's kept mass e/total1 (0 when not kept)
    double above;
    u32 top_ids[MAX_TOP_N];
    u32 top_keys[MAX_TOP_N];
};

// ---- deterministic block reductions (blockDim.x == SAMPLE_THREADS) ----

__device__ double block_sum_f64(double v, Shared &s) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) s.scratch[warp] = v;
    __syncthreads();
    double t = s.scratch[lane];
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(FULL_MASK, t, o);
    return t;
}

// Exclusive prefix of `v` in thread order.
__device__ double block_exclusive_f64(double v, Shared &s) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    double inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        double n = __shfl_up_sync(FULL_MASK, inc, o);
        if (lane >= o) inc += n;
    }
    double exc = __shfl_up_sync(FULL_MASK, inc, 1);
    if (lane == 0) exc = 0.0;
    __syncthreads();
    if (lane == 31) s.scratch[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        double w = s.scratch[lane];
        for (int o = 1; o < 32; o <<= 1) {
            double n = __shfl_up_sync(FULL_MASK, w, o);
            if (lane >= o) w += n;
        }
        s.scratch[lane] = w;
    }
    __syncthreads();
    return warp > 0 ? s.scratch[warp - 1] + exc : exc;
}

__device__ u32 block_exclusive_u32(u32 v, Shared &s) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u32 inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        u32 n = __shfl_up_sync(FULL_MASK, inc, o);
        if (lane >= o) inc += n;
    }
    __syncthreads();
    if (lane == 31) s.scratch_u[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        u32 w = s.scratch_u[lane];
        for (int o = 1; o < 32; o <<= 1) {
            u32 n = __shfl_up_sync(FULL_MASK, w, o);
            if (lane >= o) w += n;
        }
        s.scratch_u[lane] = w;
    }
    __syncthreads();
    return (warp > 0 ? s.scratch_u[warp - 1] : 0u) + inc - v;
}

// Adds each lane's `count` to hist[bin] (bin NO_ID: nothing), one atomic per distinct bin of the warp.
// Every lane of the warp must call it.
__device__ __forceinline__ void warp_count(u32 *hist, u32 bin) {
    u32 peers = __match_any_sync(FULL_MASK, bin);
    if (bin != NO_ID && (int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], (u32)__popc(peers));
}

__device__ void zero_hist(Shared &s) {
    __syncthreads();
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        s.hist[i] = 0;
        s.mass[i] = 0;
    }
    __syncthreads();
}

// The n-th best key of the row (1 <= n <= vocab) and how many ids have a strictly larger key: one
// histogram per key byte, high byte first, each over the ids whose higher bytes equal the chosen prefix.
template <class L>
__device__ void select_nth_key(const RowView<L> &r, int seg, u32 n, Shared &s, u32 *key, u32 *greater) {
    int begin = threadIdx.x * seg;
    u32 prefix = 0, acc_prefix = 0;
    for (int shift = L::KEY_BITS - 8; shift >= 0; shift -= 8) {
        bool top = shift + 8 == L::KEY_BITS;
        zero_hist(s);
        for (int j = 0; j < seg; j++) {
            int i = begin + j;
            u32 bin = NO_ID;
            if (i < r.vocab) {
                u32 k = order_key<L>(bits_at(r, i));
                if (top || (k >> (shift + 8)) == prefix) bin = (k >> shift) & 255u;
            }
            warp_count(s.hist, bin);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 acc = acc_prefix;
            int b = 255;
            for (; b > 0; b--) {
                if (acc + s.hist[b] >= n) break;
                acc += s.hist[b];
            }
            s.sel_a = (prefix << 8) | (u32)b;
            s.sel_b = acc;
        }
        __syncthreads();
        prefix = s.sel_a;
        acc_prefix = s.sel_b;
    }
    *key = prefix;
    *greater = acc_prefix;
    __syncthreads();
}

// Keeps the ids with key > `key`, and the first `ties` ids (lowest first) with key == `key`. `run` is
// the thread's count of tied ids before the current one (start it at the block prefix of its segment).
struct KeepRule {
    bool on;
    u32 key;
    u32 ties;
    __device__ __forceinline__ bool take(u32 k, u32 &run) const {
        if (!on || k > key) return true;
        if (k == key) return run++ < ties;
        return false;
    }
};

// The block prefix of the thread's count of ids with key `key` that `inner` keeps.
template <class L>
__device__ u32 tie_offset(const RowView<L> &r, int seg, u32 key, const KeepRule &inner, u32 inner_run, Shared &s) {
    int begin = threadIdx.x * seg, end = min(begin + seg, r.vocab);
    u32 count = 0;
    for (int i = begin; i < end; i++) {
        u32 k = order_key<L>(bits_at(r, i));
        if (inner.take(k, inner_run) && k == key) count++;
    }
    return block_exclusive_u32(count, s);
}

// Adds each lane's (1, m) to (hist, mass)[bin] (bin NO_ID: nothing): one warp-wide integer sum and one
// atomic per distinct bin of the warp, so contended bins cost few shared atomics. Every lane must call it.
__device__ void warp_add_mass(u32 *hist, u64 *mass, u32 bin, u64 m) {
    u32 pending = __ballot_sync(FULL_MASK, bin != NO_ID);
    while (pending) {
        int leader = __ffs(pending) - 1;
        u32 b = __shfl_sync(FULL_MASK, bin, leader);
        bool mine = bin == b;
        u32 group = __ballot_sync(FULL_MASK, mine);
        u64 sum = mine ? m : 0ull;
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, o);
        if ((int)(threadIdx.x & 31) == leader) {
            atomicAdd(&hist[b], (u32)__popc(group));
            atomicAdd(&mass[b], sum);
        }
        pending &= ~group;
    }
}

// The processed target distribution of a sampling row (temperature > 0).
template <class L> struct Target {
    double inv_t, smax, inv_total1;
    KeepRule topk, topp;
    // Top-p ranks by probability, where -0 and +0 tie (the CPU's `best_first` on probabilities),
    // except after top-k, whose order (by logit, -0 below +0) the CPU keeps.
    bool merge_zero;
    u32 run_k0, run_p0; // this thread's tie offsets
    __device__ __forceinline__ double weight(u32 bits) const {
        return exp((double)L::value(bits) * inv_t - smax);
    }
    __device__ __forceinline__ u32 pkey(u32 bits) const {
        return order_key<L>(merge_zero && bits == L::SIGN ? 0u : bits);
    }
    // p_i before the final normalisation (e_i / total1), 0 when top-k or top-p removed the id.
    __device__ __forceinline__ double kept_mass(u32 bits, u32 &run_k, u32 &run_p) const {
        if (!topk.take(order_key<L>(bits), run_k)) return 0.0;
        if (!topp.take(pkey(bits), run_p)) return 0.0;
        return weight(bits) * inv_total1;
    }
};

// Number of ids j in [0, cnt) of one key of mass pk each whose mass above, above + j pk, is < top_p (>= 1).
__device__ u32 top_p_ties(double above, double pk, u32 cnt, double top_p) {
    if (!(pk > 0.0)) return cnt;
    double jd = ceil((top_p - above) / pk);
    u32 j = jd >= (double)cnt ? cnt : (jd < 1.0 ? 1u : (u32)jd);
    while (j < cnt && above + (double)j * pk < top_p) j++;
    while (j > 1 && above + (double)(j - 1) * pk >= top_p) j--;
    return j;
}

// Builds the target of row `r` (temperature, top-k, top-p); `max_v` is the row's largest value.
template <class L>
__device__ void build_target(const RowView<L> &r, int seg, float temperature, u32 top_k, float top_p, float max_v,
                             Shared &s, Target<L> &t) {
    int begin = threadIdx.x * seg, end = min(begin + seg, r.vocab);
    t.inv_t = 1.0 / (double)temperature;
    t.smax = (double)max_v * t.inv_t;
    t.topk.on = top_k > 0 && top_k < (u32)r.vocab;
    t.topp.on = false;
    t.merge_zero = !t.topk.on;
    t.run_k0 = 0;
    t.run_p0 = 0;
    if (t.topk.on) {
        u32 key, greater;
        select_nth_key(r, seg, top_k, s, &key, &greater);
        t.topk.key = key;
        t.topk.ties = top_k - greater;
        KeepRule all = {false, 0, 0};
        t.run_k0 = tie_offset(r, seg, key, all, 0, s);
    }
    // total1: the softmax denominator over what top-k kept.
    double local = 0.0;
    u32 run = t.run_k0;
    for (int i = begin; i < end; i++) {
        u32 b = bits_at(r, i);
        if (t.topk.take(order_key<L>(b), run)) local += t.weight(b);
    }
    t.inv_total1 = 1.0 / block_sum_f64(local, s);
    if (!(top_p < 1.0f)) return;
    double tp = (double)top_p;
    double to_fixed = t.inv_total1 * FIXED_ONE;
    u64 tp_fixed = (u64)(tp * FIXED_ONE);
    // Every key byte but the lowest: fixed-point mass per bin, among the ids of the chosen prefix.
    u32 prefix = 0;
    u64 acc_prefix = 0;
    for (int shift = L::KEY_BITS - 8; shift >= 8; shift -= 8) {
        bool top = shift + 8 == L::KEY_BITS;
        zero_hist(s);
        run = t.run_k0;
        for (int j = 0; j < seg; j++) {
            int i = begin + j;
            u32 bin = NO_ID;
            u64 m = 0;
            if (i < r.vocab) {
                u32 b = bits_at(r, i);
                if (t.topk.take(order_key<L>(b), run)) {
                    u32 k = t.pkey(b);
                    if (top || (k >> (shift + 8)) == prefix) {
                        bin = (k >> shift) & 255u;
                        m = __double2ull_rn(t.weight(b) * to_fixed);
                    }
                }
            }
            warp_add_mass(s.hist, s.mass, bin, m);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 acc = acc_prefix;
            int chosen = -1;
            for (int h = 255; h >= 0; h--) {
                if (s.hist[h] == 0) continue;
                if (acc + s.mass[h] >= tp_fixed) {
                    chosen = h;
                    break;
                }
                acc += s.mass[h];
            }
            s.sel_a = (u32)chosen;
            s.sel_mass = acc;
        }
        __syncthreads();
        int chosen = (int)s.sel_a;
        // Rounding left the mass below top_p everywhere: nothing is cut. (Below the top byte a bin
        // always qualifies: its sub-bins' integer masses sum to the parent bin's.)
        if (chosen < 0) return;
        prefix = (prefix << 8) | (u32)chosen;
        acc_prefix = s.sel_mass;
    }
    // The lowest byte: exact f64 mass per key.
    zero_hist(s);
    run = t.run_k0;
    for (int j = 0; j < seg; j++) {
        int i = begin + j;
        u32 bin = NO_ID;
        if (i < r.vocab) {
            u32 b = bits_at(r, i);
            if (t.topk.take(order_key<L>(b), run)) {
                u32 k = t.pkey(b);
                if ((k >> 8) == prefix) bin = k & 255u;
            }
        }
        warp_count(s.hist, bin);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double above = (double)acc_prefix / FIXED_ONE;
        u32 chosen = NO_ID, ties = 0;
        for (int l = 255; l >= 0; l--) {
            u32 cnt = s.hist[l];
            if (cnt == 0) continue;
            u32 key = (prefix << 8) | (u32)l;
            double pk = t.weight(bits_of_key<L>(key)) * t.inv_total1;
            chosen = key;
            ties = cnt;
            if (above + (double)cnt * pk >= tp) {
                ties = top_p_ties(above, pk, cnt, tp);
                break;
            }
            above += (double)cnt * pk;
        }
        s.sel_a = chosen;
        s.sel_b = ties;
    }
    __syncthreads();
    t.topp.on = true;
    t.topp.key = s.sel_a;
    t.topp.ties = s.sel_b;
    // The thread's prefix of top-k-kept ids tied at the top-p key.
    u32 count = 0;
    run = t.run_k0;
    for (int i = begin; i < end; i++) {
        u32 b = bits_at(r, i);
        if (t.topk.take(order_key<L>(b), run) && t.pkey(b) == t.topp.key) count++;
    }
    t.run_p0 = block_exclusive_u32(count, s);
}

// Inverse CDF over ascending ids of the normalised weights w(i) / sum(w): the lowest id whose cumulative
// weight exceeds u, else the last id of positive weight; NO_ID when the weights sum to 0. `W` is a
// functor double(int i, u32 bits, u32 &rk, u32 &rp) giving unnormalised weights >= 0. `total`
// receives sum(w) (one scan gives both the total and each segment's prefix).
template <class L, typename W>
__device__ u32 inverse_cdf(const RowView<L> &r, int seg, const Target<L> &t, double u, const W &w, Shared &s,
                           double *total) {
    int begin = threadIdx.x * seg, end = min(begin + seg, r.vocab);
    double local = 0.0;
    u32 rk = t.run_k0, rp = t.run_p0;
    for (int i = begin; i < end; i++) {
        double f = w(i, bits_at(r, i), rk, rp);
        if (f > 0.0) local += f;
    }
    double prefix = block_exclusive_f64(local, s);
    double sum = s.scratch[SAMPLE_WARPS - 1];
    *total = sum;
    if (!(sum > 0.0)) return NO_ID;
    double inv = 1.0 / sum;
    double acc = prefix * inv;
    if (threadIdx.x == 0) {
        s.hit = NO_ID;
        s.last_plus1 = 0;
    }
    __syncthreads();
    rk = t.run_k0;
    rp = t.run_p0;
    u32 last = NO_ID;
    for (int i = begin; i < end; i++) {
        double f = w(i, bits_at(r, i), rk, rp) * inv;
        if (f > 0.0) {
            acc += f;
            last = (u32)i;
            if (acc > u) {
                atomicMin(&s.hit, (u32)i);
                break;
            }
        }
    }
    if (last != NO_ID) atomicMax(&s.last_plus1, last + 1);
    __syncthreads();
    u32 token = s.hit != NO_ID ? s.hit : s.last_plus1 - 1;
    __syncthreads();
    return token;
}

// p_i before the final normalisation by total2.
template <class L> struct KeptMass {
    const Target<L> *t;
    __device__ double operator()(int, u32 bits, u32 &rk, u32 &rp) const { return t->kept_mass(bits, rk, rp); }
};

// max(p - q, 0), p = kept mass / total2; q one-hot on `draft` when `q` is null.
template <class L> struct Residual {
    const Target<L> *t;
    const float *q;
    u32 draft;
    double inv_total2;
    __device__ double operator()(int i, u32 bits, u32 &rk, u32 &rp) const {
        double p = t->kept_mass(bits, rk, rp) * inv_total2;
        double qi = q ? (double)q[i] : ((u32)i == draft ? 1.0 : 0.0);
        return fmax(p - qi, 0.0);
    }
};

// The row of block blockIdx.x, logits of type L. desc [rows, DESC_WORDS]; status [rows, STATUS_WORDS];
// top [rows, MAX_TOP_N, 2] (id, f32 bits of its log-probability), best first.
template <class L> __device__ void sample_row(const u64 *desc, const u32 *mask, int vocab, u32 *status, u32 *top) {
    __shared__ Shared s;
    const u64 *d = desc + (long)blockIdx.x * DESC_WORDS;
    RowView<L> r = {(const typename L::Elem *)d[D_LOGITS], mask, (const u32 *)d[D_ROW_MASK], vocab};
    u32 *token_out = (u32 *)d[D_TOKEN_OUT];
    const float *q = (const float *)d[D_Q];
    float *probs_out = (float *)d[D_PROBS_OUT];
    u64 seed = d[D_SEED], position = d[D_POSITION], stream = d[D_STREAM];
    float temperature = __uint_as_float((u32)d[D_TEMP_TOPP]);
    float top_p = __uint_as_float((u32)(d[D_TEMP_TOPP] >> 32));
    u32 top_k = (u32)d[D_TOPK_DRAFT], draft = (u32)(d[D_TOPK_DRAFT] >> 32);
    u32 top_n_plus1 = (u32)d[D_TOP_N], mode = (u32)d[D_MODE];
    int seg = (vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    int begin = threadIdx.x * seg, end = min(begin + seg, vocab);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u32 *st = status + (long)blockIdx.x * STATUS_WORDS;

    // Pass 1: argmax (float compare, lowest id on ties, as sampling::argmax) and the lowest bad id. Unlike the
    // passes below it reads the ids strided (id threadIdx.x + j SAMPLE_THREADS: coalesced, ARGMAX_LOADS loads in
    // flight; a thread walking its own segment made each warp load touch 32 sectors and took 50 us per row): a
    // maximum with ties to the lowest id, and a minimum over bad ids, do not depend on the order.
    if (threadIdx.x == 0) s.bad_id = NO_ID;
    __syncthreads();
    float bv = -__int_as_float(0x7f800000);
    u32 bi = NO_ID;
    for (int i0 = threadIdx.x; i0 < vocab; i0 += ARGMAX_LOADS * SAMPLE_THREADS) {
        u32 bits[ARGMAX_LOADS];
#pragma unroll
        for (int u = 0; u < ARGMAX_LOADS; u++) {
            int i = i0 + u * SAMPLE_THREADS;
            bits[u] = i < vocab ? bits_at(r, i) : L::NEG_INF;
        }
        bool bad = false;
#pragma unroll
        for (int u = 0; u < ARGMAX_LOADS; u++) {
            int i = i0 + u * SAMPLE_THREADS;
            float v = L::value(bits[u]);
            if (isnan(v) || v == __int_as_float(0x7f800000)) {
                atomicMin(&s.bad_id, (u32)i);
                bad = true;
                break;
            }
            if (v > bv) {
                bv = v;
                bi = (u32)i;
            }
        }
        if (bad) break;
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(FULL_MASK, bv, o);
        u32 oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
        }
    }
    if (lane == 0) {
        s.best_v[warp] = bv;
        s.best_i[warp] = bi;
    }
    __syncthreads();
    bv = s.best_v[lane];
    bi = s.best_i[lane];
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(FULL_MASK, bv, o);
        u32 oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
        }
    }
    u32 bad = s.bad_id;
    if (bad != NO_ID || bi == NO_ID) {
        if (threadIdx.x == 0) {
            st[0] = NO_ID;
            st[1] = 0;
            st[2] = bad != NO_ID ? ERR_BAD_LOGIT : ERR_ALL_MASKED;
            st[3] = bad;
        }
        return;
    }
    const float max_v = bv;
    const u32 argmax = bi;

    u32 token = argmax, accepted = 0;
    if (!(temperature > 0.0f)) {
        // Greedy: the one-hot distribution on the argmax.
        accepted = draft == argmax;
        if (probs_out)
            for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) probs_out[i] = (u32)i == argmax ? 1.0f : 0.0f;
    } else {
        Target<L> t;
        build_target(r, seg, temperature, top_k, top_p, max_v, s, t);
        KeptMass<L> kept = {&t};
        double u = uniform01(seed, position, stream);
        double total2;
        if (mode == MODE_VERIFY && draft != NO_ID) {
            double local = 0.0;
            u32 rk = t.run_k0, rp = t.run_p0;
            for (int i = begin; i < end; i++) local += t.kept_mass(bits_at(r, i), rk, rp);
            total2 = block_sum_f64(local, s);
            // The draft's probability: its owner replays its segment's tie counters up to it.
            if (threadIdx.x == 0) s.draft_p = 0.0;
            __syncthreads();
            if ((int)draft >= begin && (int)draft < end) {
                rk = t.run_k0;
                rp = t.run_p0;
                double m = 0.0;
                for (int i = begin; i <= (int)draft; i++) m = t.kept_mass(bits_at(r, i), rk, rp);
                s.draft_p = m / total2;
            }
            __syncthreads();
            double px = s.draft_p;
            double qx = q ? (double)q[draft] : 1.0;
            if (px > 0.0 && uniform01(seed, position, ACCEPT_STREAM) * qx < px) {
                accepted = 1;
                token = draft;
            } else {
                Residual<L> res = {&t, q, draft, 1.0 / total2};
                double w_total;
                token = inverse_cdf(r, seg, t, u, res, s, &w_total);
                // Rounding can leave no residual mass although the draft was rejected: then p itself.
                if (token == NO_ID) token = inverse_cdf(r, seg, t, u, kept, s, &total2);
            }
        } else if (mode != MODE_PROBS) {
            token = inverse_cdf(r, seg, t, u, kept, s, &total2);
        } else {
            double local = 0.0;
            u32 rk = t.run_k0, rp = t.run_p0;
            for (int i = begin; i < end; i++) local += t.kept_mass(bits_at(r, i), rk, rp);
            total2 = block_sum_f64(local, s);
        }
        if (probs_out) {
            double inv_total2 = 1.0 / total2;
            u32 rk = t.run_k0, rp = t.run_p0;
            for (int i = begin; i < end; i++) probs_out[i] = (float)(t.kept_mass(bits_at(r, i), rk, rp) * inv_total2);
        }
    }
    if (mode == MODE_PROBS) token = NO_ID;

    // Raw log-probabilities of the masked logits (sampling::logprobs).
    float lp_token = 0.0f, lp_draft = 0.0f;
    if (top_n_plus1 > 0) {
        double maxd = (double)max_v;
        double local = 0.0;
        for (int i = begin; i < end; i++) local += exp((double)L::value(bits_at(r, i)) - maxd);
        double log_total = maxd + log(block_sum_f64(local, s));
        if (token != NO_ID) lp_token = (float)((double)L::value(bits_at(r, (int)token)) - log_total);
        if (draft != NO_ID && (int)draft < vocab)
            lp_draft = (float)((double)L::value(bits_at(r, (int)draft)) - log_total);
        u32 top_n = min(top_n_plus1 - 1, (u32)vocab);
        if (top_n > 0) {
            u32 key, greater;
            select_nth_key(r, seg, top_n, s, &key, &greater);
            KeepRule all = {false, 0, 0};
            KeepRule best = {true, key, top_n - greater};
            u32 run = tie_offset(r, seg, key, all, 0, s);
            if (threadIdx.x == 0) s.top_count = 0;
            __syncthreads();
            for (int i = begin; i < end; i++) {
                u32 k = order_key<L>(bits_at(r, i));
                if (k >= key && best.take(k, run)) {
                    u32 slot = atomicAdd(&s.top_count, 1u);
                    if (slot < MAX_TOP_N) {
                        s.top_ids[slot] = (u32)i;
                        s.top_keys[slot] = k;
                    }
                }
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                u32 n = min(s.top_count, (u32)MAX_TOP_N);
                // Insertion sort, best first: larger key, then lower id.
                for (u32 a = 1; a < n; a++) {
                    u32 id = s.top_ids[a], k = s.top_keys[a];
                    u32 b = a;
                    while (b > 0 && (s.top_keys[b - 1] < k || (s.top_keys[b - 1] == k && s.top_ids[b - 1] > id))) {
                        s.top_ids[b] = s.top_ids[b - 1];
                        s.top_keys[b] = s.top_keys[b - 1];
                        b--;
                    }
                    s.top_ids[b] = id;
                    s.top_keys[b] = k;
                }
                u32 *out = top + (long)blockIdx.x * MAX_TOP_N * 2;
                for (u32 a = 0; a < n; a++) {
                    out[2 * a] = s.top_ids[a];
                    out[2 * a + 1] =
                        __float_as_uint((float)((double)L::value(bits_of_key<L>(s.top_keys[a])) - log_total));
                }
            }
        }
    }
    if (threadIdx.x == 0) {
        st[0] = token;
        st[1] = accepted;
        st[2] = 0;
        st[3] = 0;
        st[4] = __float_as_uint(lp_token);
        st[5] = __float_as_uint(lp_draft);
        if (token_out && token != NO_ID) *token_out = token;
    }
}

// One block per bf16 logits row: grid = rows, block = SAMPLE_THREADS.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows(const u64 *desc, const u32 *mask, int vocab, u32 *status, u32 *top) {
    kernel_entry();
    sample_row<Bf16Logits>(desc, mask, vocab, status, top);
}

// One block per f32 logits row: grid = rows, block = SAMPLE_THREADS.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows_f32(const u64 *desc, const u32 *mask, int vocab, u32 *status, u32 *top) {
    kernel_entry();
    sample_row<F32Logits>(desc, mask, vocab, status, top);
}

// ---- wide draws: a temperature-only f32 row split over blocks (the drafter's sampled Markov rows) ----
// A row whose only processing is the temperature (top-k off, top-p 1; the drafter's masked ids are already
// -inf) has p = softmax(l / T), and its inverse CDF over ascending ids needs only the mass of each chunk of
// WIDE_CHUNK ids before it. So one row takes ceil(vocab / WIDE_CHUNK) blocks instead of one:
// - draw_partials_f32: per chunk, the largest logit, sum exp((l - chunk max) / T) in f64 (fixed tree) and the
//   lowest bad id (NaN or +inf), read coalesced;
// - draw_pick_f32: thread 0 of every block recombines its row's partials in chunk order (the same arithmetic in
//   every block, so all agree on the total and on the chunk holding the crossing of u), every block writes p for
//   its ids (the draft's q), and the chosen chunk scans its ids in order (each thread a contiguous run,
//   exclusive prefix over threads) for the lowest id whose cumulative mass exceeds u, then writes the token and
//   the row's status. When rounding leaves u above the total, the last id with mass is taken (as the CPU does).
// Sums run in another order than the one-block kernel's (chunk partials, then chunk order), a last-bit
// difference inside the sampling tolerance; the RNG, the stream and the decision rule are the same.
#define WIDE_PER_THREAD 8
#define WIDE_CHUNK (SAMPLE_THREADS * WIDE_PER_THREAD)

struct WidePartial {
    float max_logit; // -inf: every id of the chunk is -inf
    u32 bad;         // the lowest id whose logit is NaN or +inf, NO_ID: none
    double sum;      // sum exp((l - max_logit) / T) over the chunk
};

__device__ u32 block_min_u32(u32 v, Shared &s) {
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(FULL_MASK, v, o));
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) s.scratch_u[warp] = v;
    __syncthreads();
    u32 t = s.scratch_u[lane];
    for (int o = 16; o > 0; o >>= 1) t = min(t, __shfl_xor_sync(FULL_MASK, t, o));
    return t;
}

// grid = (chunks, rows), block = SAMPLE_THREADS; partials [rows, chunks].
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    draw_partials_f32(const u64 *desc, int vocab, WidePartial *partials) {
    kernel_entry();
    __shared__ Shared s;
    const u64 *d = desc + (long)blockIdx.y * DESC_WORDS;
    const float *l = (const float *)d[D_LOGITS];
    double inv_t = 1.0 / (double)__uint_as_float((u32)d[D_TEMP_TOPP]);
    const float neg_inf = -__int_as_float(0x7f800000);
    int base = blockIdx.x * WIDE_CHUNK;
    float v[WIDE_PER_THREAD];
    float m = neg_inf;
    u32 bad = NO_ID;
#pragma unroll
    for (int j = 0; j < WIDE_PER_THREAD; j++) {
        int i = base + threadIdx.x + j * SAMPLE_THREADS;
        v[j] = i < vocab ? l[i] : neg_inf;
        if (isnan(v[j]) || v[j] == -neg_inf) {
            bad = min(bad, (u32)i);
            v[j] = neg_inf;
        }
        m = fmaxf(m, v[j]);
    }
    m = block_max(m); // prelude.cuh
    bad = block_min_u32(bad, s);
    double local = 0.0;
    if (m > neg_inf) {
#pragma unroll
        for (int j = 0; j < WIDE_PER_THREAD; j++)
            if (v[j] > neg_inf) local += exp(((double)v[j] - (double)m) * inv_t);
    }
    double sum = block_sum_f64(local, s);
    if (threadIdx.x == 0) {
        WidePartial p = {m, bad, sum};
        partials[(long)blockIdx.y * gridDim.x + blockIdx.x] = p;
    }
}

// grid = (chunks, rows), block = SAMPLE_THREADS; partials [rows, chunks] from draw_partials_f32; status
// [rows, STATUS_WORDS].
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    draw_pick_f32(const u64 *desc, int vocab, const WidePartial *partials, u32 *status) {
    kernel_entry();
    __shared__ Shared s;
    const u64 *d = desc + (long)blockIdx.y * DESC_WORDS;
    const float *l = (const float *)d[D_LOGITS];
    float *q = (float *)d[D_PROBS_OUT];
    u32 *token_out = (u32 *)d[D_TOKEN_OUT];
    double inv_t = 1.0 / (double)__uint_as_float((u32)d[D_TEMP_TOPP]);
    const float neg_inf = -__int_as_float(0x7f800000);
    int chunks = gridDim.x, c = blockIdx.x;
    const WidePartial *p = partials + (long)blockIdx.y * chunks;
    u32 *st = status + (long)blockIdx.y * STATUS_WORDS;
    double u = uniform01(d[D_SEED], d[D_POSITION], d[D_STREAM]);
    if (threadIdx.x == 0) {
        float mx = neg_inf;
        u32 bad = NO_ID;
        for (int k = 0; k < chunks; k++) {
            mx = fmaxf(mx, p[k].max_logit);
            bad = min(bad, p[k].bad);
        }
        double total = 0.0;
        if (mx > neg_inf)
            for (int k = 0; k < chunks; k++)
                if (p[k].sum > 0.0) total += p[k].sum * exp(((double)p[k].max_logit - (double)mx) * inv_t);
        double inv = total > 0.0 ? 1.0 / total : 0.0;
        int chosen = -1, last = -1;
        double acc = 0.0, before = 0.0, before_last = 0.0;
        for (int k = 0; k < chunks; k++) {
            if (!(p[k].sum > 0.0)) continue;
            double mass = p[k].sum * exp(((double)p[k].max_logit - (double)mx) * inv_t) * inv;
            last = k;
            before_last = acc;
            if (chosen < 0 && acc + mass > u) {
                chosen = k;
                before = acc;
            }
            acc += mass;
        }
        s.sel_b = chosen < 0 ? 1u : 0u; // the fallback: u is above the total, take the last id with mass
        s.sel_a = (u32)(chosen < 0 ? last : chosen);
        s.above = chosen < 0 ? before_last : before;
        s.draft_p = inv;
        s.best_v[0] = mx;
        s.bad_id = bad;
        s.hit = NO_ID;
        s.last_plus1 = 0;
    }
    __syncthreads();
    float mx = s.best_v[0];
    u32 bad = s.bad_id, fallback = s.sel_b;
    int chosen = (int)s.sel_a;
    double inv = s.draft_p, before = s.above;
    if (bad != NO_ID || !(mx > neg_inf) || !(inv > 0.0)) {
        if (c == 0 && threadIdx.x == 0) {
            st[0] = NO_ID;
            st[1] = 0;
            st[2] = bad != NO_ID ? ERR_BAD_LOGIT : ERR_ALL_MASKED;
            st[3] = bad;
        }
        return;
    }
    int base = c * WIDE_CHUNK;
    if (q) {
#pragma unroll
        for (int j = 0; j < WIDE_PER_THREAD; j++) {
            int i = base + threadIdx.x + j * SAMPLE_THREADS;
            if (i < vocab) {
                float x = l[i];
                q[i] = x > neg_inf ? (float)(exp(((double)x - (double)mx) * inv_t) * inv) : 0.0f;
            }
        }
    }
    if (c != chosen) return;
    int begin = base + threadIdx.x * WIDE_PER_THREAD, end = min(begin + WIDE_PER_THREAD, vocab);
    double f[WIDE_PER_THREAD];
    double local = 0.0;
#pragma unroll
    for (int j = 0; j < WIDE_PER_THREAD; j++) {
        int i = begin + j;
        float x = i < end ? l[i] : neg_inf;
        f[j] = x > neg_inf ? exp(((double)x - (double)mx) * inv_t) * inv : 0.0;
        local += f[j];
    }
    double acc = before + block_exclusive_f64(local, s);
    u32 last = NO_ID;
    for (int j = 0; j < WIDE_PER_THREAD; j++) {
        if (f[j] > 0.0) {
            acc += f[j];
            last = (u32)(begin + j);
            if (!fallback && acc > u) {
                atomicMin(&s.hit, (u32)(begin + j));
                break;
            }
        }
    }
    if (last != NO_ID) atomicMax(&s.last_plus1, last + 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 token = s.hit != NO_ID ? s.hit : s.last_plus1 - 1;
        st[0] = token;
        st[1] = 0;
        st[2] = 0;
        st[3] = 0;
        st[4] = 0;
        st[5] = 0;
        if (token_out) *token_out = token;
    }
}
