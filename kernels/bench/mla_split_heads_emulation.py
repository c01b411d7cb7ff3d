# The fragment-level emulation of mla_split_heads (kernels/cuda/mla.cu), run here without a GPU: every lane's
# ldmatrix rows and MMA fragments as the kernel addresses them (PTX layouts of ldmatrix.m8n8.x4(.trans) and
# mma.m16n8k16.row.col: A a0 (g, 2t..), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..); B b0 (k 2t.., n g),
# b1 (k 2t+8.., n g); C c0,c1 (g, 2t, 2t+1), c2,c3 (g+8, 2t, 2t+1)), against a float64 split of the same cache.
# python3 this_file.py
import numpy as np
rng = np.random.default_rng(0)

def bf16(x):
    x = np.asarray(x, dtype=np.float32)
    b = x.view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.astype(np.uint32).view(np.float32)

HEADS_TILE, KV_TILE, WARPS, MAX_NT, PAD = 16, 64, 4, 16, 8

def mma(c, A, B):  # c: [32][4]; A: 16x16, B: 16x8 assembled from fragments
    D = A.astype(np.float64) @ B.astype(np.float64)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c[lane][0] += D[g, 2*t]; c[lane][1] += D[g, 2*t+1]; c[lane][2] += D[g+8, 2*t]; c[lane][3] += D[g+8, 2*t+1]

def ldmatrix_x4(smem, row_of, trans=False):
    # ldmatrix.m8n8.x4(.trans): lane 8i + j gives (row, col) = row_of(lane), the start of row j of matrix i (8
    # bf16); returns regs[lane][i] = the pair lane receives of matrix i: (M_i[l/4][2(l%4)], M_i[l/4][2(l%4)+1]),
    # or with trans (M_i[2(l%4)][l/4], M_i[2(l%4)+1][l/4]).
    mats = []
    for i in range(4):
        M = np.zeros((8, 8), np.float32)
        for j in range(8):
            r, c = row_of(8*i + j)
            assert c % 8 == 0 and c + 8 <= smem.shape[1], "a 16-byte aligned row inside the array"
            M[j] = smem[r, c:c+8]
        mats.append(M)
    regs = []
    for lane in range(32):
        q, p = lane >> 2, 2 * (lane & 3)
        regs.append([(M[p, q], M[p+1, q]) if trans else (M[q, p], M[q, p+1]) for M in mats])
    return regs

def frag_a(regs):  # a0..a3 of every lane (PTX mma.m16n8k16 layout) -> the 16x16 A they form
    A = np.zeros((16, 16), np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for x, (r, c) in enumerate([(g, 2*t), (g+8, 2*t), (g, 2*t+8), (g+8, 2*t+8)]):
            A[r, c], A[r, c+1] = regs[lane][x]
    return A

def frag_b(regs, i0):  # b0, b1 = regs[lane][i0], regs[lane][i0 + 1] -> the 16x8 B they form
    B = np.zeros((16, 8), np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        B[2*t, g], B[2*t+1, g] = regs[lane][i0]
        B[2*t+8, g], B[2*t+9, g] = regs[lane][i0 + 1]
    return B

def kernel(q_lat, q_rope, cache, lo, hi, h0, H, r, rope, scale):
    ld = r + rope; stride = ld + PAD; pstride = KV_TILE + PAD
    heads = min(HEADS_TILE, H - h0)
    qs = np.zeros((HEADS_TILE, stride), np.float32)
    for hh in range(heads):
        qs[hh, :r] = bf16(q_lat[h0+hh]); qs[hh, r:ld] = q_rope[h0+hh]
    nts = r // (8 * WARPS)
    m_run = np.full((WARPS, 32, 2), -np.inf); l_run = np.zeros((WARPS, 32, 2))
    acc = np.zeros((WARPS, MAX_NT, 32, 4))
    for base in range(lo, hi, KV_TILE):
        ln = min(KV_TILE, hi - base)
        kv = np.zeros((KV_TILE, stride), np.float32)
        kv[:ln, :ld] = cache[base:base+ln]
        sc = np.zeros((WARPS, 2, 32, 4))
        for w in range(WARPS):
            for k0 in range(0, ld, 16):
                A = frag_a(ldmatrix_x4(qs, lambda l: (l & 15, k0 + (l >> 4) * 8)))
                kb = ldmatrix_x4(kv, lambda l: (w*16 + (l >> 4) * 8 + (l & 7), k0 + ((l >> 3) & 1) * 8))
                mma(sc[w, 0], A, frag_b(kb, 0)); mma(sc[w, 1], A, frag_b(kb, 2))
        red_m = np.zeros((WARPS, 16)); red_l = np.zeros((WARPS, 16))
        tmax = np.full((WARPS, 32, 2), -np.inf)
        for w in range(WARPS):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for nt in range(2):
                    for x in range(4):
                        p = w*16 + nt*8 + 2*t + (x & 1)
                        sc[w, nt, lane, x] = scale * sc[w, nt, lane, x] if p < ln else -np.inf
                        tmax[w, lane, x >> 1] = max(tmax[w, lane, x >> 1], sc[w, nt, lane, x])
            for lane in range(32):  # xor 1, 2 over t: every lane of group g ends with the group's max
                g = lane >> 2
                for rr in range(2):
                    red_m[w, g + 8*rr] = max(tmax[w, (g << 2) + tt, rr] for tt in range(4))
        ps = np.zeros((HEADS_TILE, pstride), np.float32); ps_lo = np.zeros((HEADS_TILE, pstride), np.float32)
        m_new = np.zeros((WARPS, 32, 2)); factor = np.zeros((WARPS, 32, 2)); tsum = np.zeros((WARPS, 32, 2))
        for w in range(WARPS):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for rr in range(2):
                    mx = max(red_m[ww, g + 8*rr] for ww in range(WARPS))
                    m_new[w, lane, rr] = max(m_run[w, lane, rr], mx)
                    factor[w, lane, rr] = np.exp(m_run[w, lane, rr] - m_new[w, lane, rr])
                for nt in range(2):
                    for x in range(4):
                        sc[w, nt, lane, x] = np.exp(sc[w, nt, lane, x] - m_new[w, lane, x >> 1])
                        tsum[w, lane, x >> 1] += sc[w, nt, lane, x]
                    p = w*16 + nt*8 + 2*t
                    for x, (row, col) in enumerate([(g, p), (g, p+1), (g+8, p), (g+8, p+1)]):
                        v = np.float32(sc[w, nt, lane, x])
                        ps[row, col] = bf16(v); ps_lo[row, col] = bf16(v - ps[row, col])
            for lane in range(32):
                g = lane >> 2
                for rr in range(2):
                    red_l[w, g + 8*rr] = sum(tsum[w, (g << 2) + tt, rr] for tt in range(4))
        for w in range(WARPS):
            for lane in range(32):
                g = lane >> 2
                for rr in range(2):
                    total = sum(red_l[ww, g + 8*rr] for ww in range(WARPS))
                    l_run[w, lane, rr] = l_run[w, lane, rr] * factor[w, lane, rr] + total
                    m_run[w, lane, rr] = m_new[w, lane, rr]
            for nt in range(MAX_NT):
                for lane in range(32):
                    for x in range(4):
                        acc[w, nt, lane, x] *= factor[w, lane, x >> 1]
            c0 = w * nts * 8
            for k0 in range(0, KV_TILE, 16):
                A = frag_a(ldmatrix_x4(ps, lambda l: (l & 15, k0 + (l >> 4) * 8)))
                A_lo = frag_a(ldmatrix_x4(ps_lo, lambda l: (l & 15, k0 + (l >> 4) * 8)))
                for nt in range(0, nts, 2):
                    vb = ldmatrix_x4(kv, lambda l: (k0 + (l & 15), c0 + min(nt + (l >> 4), nts - 1) * 8), trans=True)
                    mma(acc[w, nt], A, frag_b(vb, 0)); mma(acc[w, nt], A_lo, frag_b(vb, 0))
                    if nt + 1 < nts:
                        mma(acc[w, nt+1], A, frag_b(vb, 2)); mma(acc[w, nt+1], A_lo, frag_b(vb, 2))
    out_o = {}; out_m = {}; out_l = {}
    for w in range(WARPS):
        c0 = w * nts * 8
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for rr in range(2):
                hh = g + 8*rr
                if hh >= heads: continue
                for nt in range(nts):
                    out_o[(hh, c0 + nt*8 + 2*t)] = acc[w, nt, lane, 2*rr]
                    out_o[(hh, c0 + nt*8 + 2*t + 1)] = acc[w, nt, lane, 2*rr + 1]
                if w == 0 and t == 0:
                    out_m[hh] = m_run[w, lane, rr]; out_l[hh] = l_run[w, lane, rr]
    return heads, out_o, out_m, out_l

def check(H, r, rope, visible, span, h0):
    ld = r + rope
    q_lat = bf16(rng.standard_normal((H, r)).astype(np.float32))
    q_rope = bf16(rng.standard_normal((H, rope)).astype(np.float32))
    cache = bf16(rng.standard_normal((visible, ld)).astype(np.float32))
    scale = 1.0 / np.sqrt(ld)
    worst = 0.0
    for s in range((visible + span - 1) // span + 1):  # the last one is empty
        lo, hi = s * span, min(visible, s * span + span)
        heads, o, m, l = kernel(q_lat, q_rope, cache, lo, hi, h0, H, r, rope, scale)
        for hh in range(heads):
            q = np.concatenate([q_lat[h0+hh], q_rope[h0+hh]]).astype(np.float64)
            if hi <= lo:
                assert m[hh] == -np.inf and l[hh] == 0 and all(o[(hh, c)] == 0 for c in range(r)), "empty split"
                continue
            sc = scale * (cache[lo:hi].astype(np.float64) @ q)
            mx = sc.max(); p = np.exp(sc - mx)
            ref_o = p @ cache[lo:hi, :r].astype(np.float64)
            got = np.array([o[(hh, c)] for c in range(r)])
            assert abs(m[hh] - mx) < 1e-9 * max(1, abs(mx)), (m[hh], mx)
            assert abs(l[hh] - p.sum()) < 1e-9 * p.sum(), (l[hh], p.sum())
            err = np.linalg.norm(got - ref_o) / np.linalg.norm(ref_o)
            worst = max(worst, err)
    print(f"H {H} r {r} rope {rope} visible {visible} span {span} group at {h0}: rel L2 of part_o {worst:.2e} (P as bf16 hi + lo)")
    assert worst < 1e-4

check(4, 32, 16, 150, 128, 0)       # k3-tiny: 4 heads of a 16-head group, a partial tile, an empty split; 1 n-tile
check(4, 96, 32, 80, 64, 0)         # 3 value n-tiles per warp: the odd last one
check(20, 64, 16, 100, 64, 16)      # the second group, 4 heads; one tile per split
check(16, 512, 64, 70, 64, 0)       # K3's widths: 16 value n-tiles per warp
print("mla_split_heads emulation matches")
