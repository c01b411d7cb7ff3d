"""The trainable K3 target (k3-tiny) in PyTorch: parameters, the batched forward, the incremental
branch step the drafter's rollouts use, and the export-side rounding (bf16, MXFP4).

Used by train_k3_tiny.py (target training, export, self-check) and train_dspark.py (drafter).

Invariants:
- The math is k3_reference.py's (reused for rmsnorm, l2norm, situ, attn_res_read, dequant_mxfp4 and
  Config), batched over a leading [B] axis and device-agnostic (every mask and constant is made on the
  input's device). `--selfcheck` proves `forward` equals `k3_reference.forward(mode="chunk")` on each
  sequence of a batch to <= 1e-9 relative in float64.
- Parameters are kept under their checkpoint names (no `language_model.` prefix) with two exceptions:
  the routed experts of a layer are stacked as `...block_sparse_moe.experts.w1|w3|w2` `[E, out, in]`
  (split and MXFP4-packed at export), and `A_log` keeps its stored length max(heads, head_dim) (the
  forward uses the first `heads` entries, like the reference and the Rust loader).
- Vocabulary-sized tensors (`model.embed_tokens.weight`, `lm_head.weight`) are COMPACT: `[n_kept + 1, d]`,
  row i = token `kept[i]`, the last row shared by every other token (the artifact contract). Token ids in
  this module are compact indices; `Vocab` maps full ids to them. Full-vocabulary log-probabilities are
  the compact ones with `log(V - n_kept)` added to the shared logit (`Vocab.shared_offset`), and the
  full-vocabulary argmax compares RAW logits (the shared row stands for one token, the lowest unseen id).
- `e_score_correction_bias` is a buffer (float32, no gradient), updated aux-loss-free by the trainer.
- MXFP4 quantisation (`mxfp4_quantize`) is the export's: per 32-group E8M0 byte = the smallest 2^e
  with max|w| <= 6·2^e, codes rounded to nearest E2M1 (ties to the even code, like the Rust
  `e2m1_from_f32`); `mxfp4_fake` = dequant(quant(w)) exactly as k3_reference.dequant_mxfp4 reads it,
  with a straight-through gradient.
"""

from __future__ import annotations

import math
import time
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k3_reference as ref  # noqa: E402
from k3_reference import attn_res_read, l2norm, rmsnorm, situ  # noqa: E402,F401

MLA_NORM_EPS = ref.MLA_NORM_EPS
BOS, EOS, PAD = 163584, 163586, 163839
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# ----------------------------------------------------------------------------------------------------------------
# Vocabulary (compact tying)


class Vocab:
    """kept ids (ascending) + one shared row for every other id of the V-token vocabulary."""

    def __init__(self, kept: torch.Tensor, vocab_size: int):
        kept = torch.as_tensor(kept, dtype=torch.int64).cpu()
        if kept.numel() == 0 or bool((kept[1:] <= kept[:-1]).any()) or int(kept[-1]) >= vocab_size or int(kept[0]) < 0:
            raise ValueError("kept ids must be ascending, unique and inside the vocabulary")
        self.kept = kept  # [n]
        self.V = vocab_size
        self.n = kept.numel()
        self.lookup = torch.full((vocab_size,), self.n, dtype=torch.int64)  # [V] full id -> compact row
        self.lookup[kept] = torch.arange(self.n)
        unseen = vocab_size - self.n
        self.shared_offset = math.log(unseen) if unseen > 0 else -math.inf
        # full id the shared row's argmax stands for: the lowest id not kept (ties -> lowest id)
        mask = torch.ones(vocab_size, dtype=torch.bool)
        mask[kept] = False
        self.lowest_unseen = int(mask.nonzero()[0]) if unseen > 0 else -1

    def to_compact(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup.to(ids.device)[ids.long()]

    def to_full(self, compact: torch.Tensor) -> torch.Tensor:
        """Compact argmax rows -> full ids (the shared row -> the lowest unseen id)."""
        table = torch.cat([self.kept, torch.tensor([self.lowest_unseen])]).to(compact.device)
        return table[compact.long()]

    def log_probs(self, raw: torch.Tensor) -> torch.Tensor:
        """Compact log-probabilities [.., n+1] of the full-vocabulary softmax, from raw compact logits."""
        return torch.log_softmax(self.with_offset(raw), dim=-1)

    def with_offset(self, raw: torch.Tensor) -> torch.Tensor:
        off = torch.zeros(raw.shape[-1], dtype=raw.dtype, device=raw.device)
        off[-1] = self.shared_offset
        return raw + off

    def expand(self, compact_rows: torch.Tensor) -> torch.Tensor:
        """[n+1, w] -> [V, w] (the contract's expansion)."""
        return compact_rows[self.lookup.to(compact_rows.device)]


# ----------------------------------------------------------------------------------------------------------------
# Parameters


@dataclass
class Spec:
    name: str
    shape: tuple
    store: str  # 'bf16' | 'f32' | 'mxfp4' (export dtype class)
    init: tuple  # ('normal', mean, std) | ('uniform', lo, hi) | ('alog',) | ('dtbias',) | ('zeros',)
    decay: bool = False
    buffer: bool = False  # no gradient (e_score_correction_bias)


def target_specs(c: ref.Config, n_rows: int) -> list:
    """Every target tensor in the trainer's form (see the module doc); `n_rows` = n_kept + 1."""
    d, s = c.d, []
    P, H, K = c.kda_heads * c.kda_head_dim, c.kda_heads, c.kda_head_dim

    def lin(name, o, i, gain=1.0, store="bf16"):
        s.append(Spec(name, (o, i), store, ("normal", 0.0, gain / math.sqrt(i)), decay=True))

    def norm(name, n, store="bf16"):
        s.append(Spec(name, (n,), store, ("normal", 1.0, 0.0)))

    s.append(Spec("model.embed_tokens.weight", (n_rows, d), "bf16", ("normal", 0.0, 1.0)))
    out_gain = 0.5
    for layer, (mixer, ffn) in enumerate(c.layers):
        p = f"model.layers.{layer}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            norm(p + n + ".weight", d)
        for n in ("self_attention_res_proj", "mlp_res_proj"):
            s.append(Spec(p + n + ".weight", (1, d), "bf16", ("zeros",)))
        a = p + "self_attn."
        if mixer == "kda":
            for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
                lin(a + n + ".weight", P, d)
            lin(a + "o_proj.weight", d, P, out_gain)
            lin(a + "f_a_proj.weight", K, d)
            lin(a + "f_b_proj.weight", P, K)
            lin(a + "b_proj.weight", H, d)
            for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                bound = 1.0 / math.sqrt(c.conv_kernel)
                s.append(Spec(a + n + ".weight", (P, 1, c.conv_kernel), "f32", ("uniform", -bound, bound)))
            s.append(Spec(a + "A_log", (max(H, K),), "f32", ("alog",)))
            s.append(Spec(a + "dt_bias", (P,), "f32", ("dtbias",)))
            norm(a + "o_norm.weight", K, store="f32")
        else:
            Hm = c.mla_heads
            lin(a + "q_a_proj.weight", c.q_lora, d)
            norm(a + "q_a_layernorm.weight", c.q_lora)
            lin(a + "q_b_proj.weight", Hm * (c.nope + c.rope), c.q_lora)
            lin(a + "kv_a_proj_with_mqa.weight", c.kv_lora + c.rope, d)
            norm(a + "kv_a_layernorm.weight", c.kv_lora)
            lin(a + "kv_b_proj.weight", Hm * (c.nope + c.v_dim), c.kv_lora)
            lin(a + "g_proj.weight", Hm * c.v_dim, d)
            lin(a + "o_proj.weight", d, Hm * c.v_dim, out_gain)
        if ffn == "dense":
            lin(p + "mlp.gate_proj.weight", c.dense_dim, d)
            lin(p + "mlp.up_proj.weight", c.dense_dim, d)
            lin(p + "mlp.down_proj.weight", d, c.dense_dim, out_gain)
        else:
            m = p + "block_sparse_moe."
            lin(m + "gate.weight", c.experts, d)
            s.append(Spec(m + "gate.e_score_correction_bias", (c.experts,), "f32", ("zeros",), buffer=True))
            lin(m + "routed_expert_down_proj.weight", c.latent, d)
            lin(m + "routed_expert_up_proj.weight", d, c.latent, out_gain)
            norm(m + "routed_expert_norm.weight", c.latent)
            if c.shared > 0:
                sh = c.shared * c.expert_dim
                lin(m + "shared_experts.gate_proj.weight", sh, d)
                lin(m + "shared_experts.up_proj.weight", sh, d)
                lin(m + "shared_experts.down_proj.weight", d, sh, out_gain)
            for proj, (o, i, gain) in (("w1", (c.expert_dim, c.latent, 1.0)), ("w3", (c.expert_dim, c.latent, 1.0)),
                                       ("w2", (c.latent, c.expert_dim, out_gain))):
                s.append(Spec(m + f"experts.{proj}", (c.experts, o, i), "mxfp4",
                              ("normal", 0.0, gain / math.sqrt(i)), decay=True))
    norm("model.output_attn_res_norm.weight", d)
    s.append(Spec("model.output_attn_res_proj.weight", (1, d), "bf16", ("zeros",)))
    norm("model.norm.weight", d)
    lin("lm_head.weight", n_rows, d)
    return s


def init_tensor(spec: Spec, gen: torch.Generator, dtype) -> torch.Tensor:
    kind = spec.init[0]
    if kind == "normal":
        return spec.init[1] + spec.init[2] * torch.randn(spec.shape, generator=gen, dtype=torch.float64).to(dtype)
    if kind == "uniform":
        lo, hi = spec.init[1], spec.init[2]
        return (lo + (hi - lo) * torch.rand(spec.shape, generator=gen, dtype=torch.float64)).to(dtype)
    if kind == "alog":  # A = U(1, 16), like sparkd's synth
        return torch.log(1 + 15 * torch.rand(spec.shape, generator=gen, dtype=torch.float64)).to(dtype)
    if kind == "dtbias":  # dt log-uniform in [1e-3, 0.1], dt_bias = softplus^-1(dt)
        u = torch.rand(spec.shape, generator=gen, dtype=torch.float64)
        dt = torch.exp(math.log(1e-3) + u * (math.log(0.1) - math.log(1e-3)))
        return torch.log(torch.expm1(dt)).to(dtype)
    if kind == "zeros":
        return torch.zeros(spec.shape, dtype=dtype)
    raise ValueError(kind)


def init_params(specs: list, seed: int, dtype=torch.float32, device="cpu") -> dict:
    """name -> tensor (leaf, requires_grad unless a buffer), drawn from one seeded generator in spec order."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for sp in specs:
        t = init_tensor(sp, gen, dtype).to(device)
        out[sp.name] = t.requires_grad_(not sp.buffer)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Export-side rounding: bf16, MXFP4


def _mxfp4_codes(w: torch.Tensor, group: int):
    """w [..., in] -> (codes int64 [..., in/group, group] with bit 3 = sign, e int64 [..., in/group, 1]).

    e is the smallest integer with max|w| <= 6·2^e over the group (0 for an all-zero group), clamped to the
    E8M0 range; code = the nearest E2M1 magnitude of |w|/2^e, a tie going to the even code (Rust's
    e2m1_from_f32). Computed in float64, where |w|/2^e is exact."""
    x = w.detach().to(torch.float64).reshape(*w.shape[:-1], w.shape[-1] // group, group)
    amax = x.abs().amax(dim=-1, keepdim=True)
    m, ex = torch.frexp(amax / 6.0)  # amax/6 = m·2^ex, m in [0.5, 1)
    e = ex.to(torch.int64) - (m == 0.5).to(torch.int64)
    e = torch.where(amax > 0, e, torch.zeros_like(e)).clamp(-127, 127)
    scaled = x / torch.pow(2.0, e.to(torch.float64))
    a = scaled.abs()
    mids = torch.tensor(E2M1_MIDPOINTS, dtype=torch.float64, device=w.device)
    code = (a.unsqueeze(-1) > mids).sum(-1)  # midpoints strictly below
    odd_tie = (a.unsqueeze(-1) == mids) & (torch.arange(7, device=w.device) % 2 == 1)
    code = (code + odd_tie.sum(-1)).clamp(max=7)  # a tie at odd midpoint i goes up to the even code i+1
    return code | (torch.signbit(scaled).to(torch.int64) << 3), e


def mxfp4_quantize(w: torch.Tensor, group: int = 32):
    """w [out, in] -> (weight_packed uint8 [out, in/2], weight_scale uint8 [out, in/group]); element 2i in the
    low nibble, 2i+1 in the high nibble; scale byte = 127 + e (see _mxfp4_codes)."""
    o, i = w.shape
    code, e = _mxfp4_codes(w, group)
    code = code.reshape(o, i).to(torch.uint8)
    packed = (code[:, 0::2] & 0xF) | ((code[:, 1::2] & 0xF) << 4)
    return packed.contiguous(), (e[..., 0] + 127).to(torch.uint8).contiguous()


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor, group: int, dtype) -> torch.Tensor:
    """k3_reference.dequant_mxfp4 (CPU), moved back to the packed tensor's device."""
    return ref.dequant_mxfp4(packed.cpu(), scale.cpu(), group, dtype).to(packed.device)


def mxfp4_roundtrip(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """dequant(quant(w)) on w's device without packing, in w's dtype (the values k3_reference.dequant_mxfp4
    reads back from mxfp4_quantize's bytes; the self-check compares the two)."""
    code, e = _mxfp4_codes(w, group)
    vals = torch.tensor(ref.E2M1_VALUES, dtype=torch.float64, device=w.device)
    q = vals[code & 0x7] * torch.pow(2.0, e.to(torch.float64))
    q = torch.where((code & 0x8) != 0, -q, q)
    return q.reshape(w.shape).to(w.dtype)


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, group):
        return mxfp4_roundtrip(w, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


def mxfp4_fake(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Quantise-dequantise in the forward, identity gradient (quantisation-aware training)."""
    return _FakeQuant.apply(w, group)


def served_params(specs: list, params: dict, group: int) -> dict:
    """The weights Rust serves: bf16-class tensors rounded to bf16 (nearest even), f32-class to f32, experts
    through MXFP4; values kept in each tensor's own dtype, detached."""
    out = {}
    for sp in specs:
        w = params[sp.name].detach()
        if sp.store == "bf16":
            out[sp.name] = w.to(torch.bfloat16).to(w.dtype)
        elif sp.store == "f32":
            out[sp.name] = w.to(torch.float32).to(w.dtype)
        else:
            out[sp.name] = mxfp4_roundtrip(w, group)
    return out


# ----------------------------------------------------------------------------------------------------------------
# KDA, batched


def causal_conv_silu_b(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor = None):
    """x [B,T,P], weight [P,W] (last tap = current token), window [B,W-1,P] previous inputs (zeros when None).
    Returns (y [B,T,P], new window [B,W-1,P])."""
    B, T, P = x.shape
    W = weight.shape[1]
    if window is None:
        window = torch.zeros(B, W - 1, P, dtype=x.dtype, device=x.device)
    full = torch.cat([window.to(x.dtype), x], dim=1)  # [B, W-1+T, P]
    y = sum(weight[:, j].to(x.dtype) * full[:, j:j + T] for j in range(W))
    return F.silu(y), full[:, -(W - 1):]


def kda_chunked_b(q, k, v, g, beta, S0=None, chunk: int = 16, keep_bounds: bool = False):
    """The WY form of k3_reference.kda_chunked, batched over [B, H] and over chunks.

    q, k, g [B,T,H,K] (q l2-normed·K^-0.5, k l2-normed, g log-decay in [lb, 0)), v [B,T,H,V], beta [B,T,H],
    S0 [B,H,K,V] or None (zeros). Returns (o [B,T,H,V], S_final [B,H,K,V], bounds [B,N,H,K,V] = the state
    after each whole chunk (N = ceil(T/chunk)) when keep_bounds else None).
    Computed in float32 (float64 for float64 inputs) with autocast off. Two rearrangements of the reference,
    same values: the in-chunk decays exp(G_i - G_j) are factored through the chunk's middle position
    (|exponent| <= |lb|·chunk/2, no overflow in float32 for chunk <= 32) instead of an [n, n, K] tensor; and
    the state update S' = exp(Gn)ᵀ⊙S + kdᵀ(U - W S) is folded into S' = M S + Cn, computed for every chunk
    at once, so the only sequential work is one batched matmul-add per chunk; the outputs then follow for
    every chunk at once from the states before each chunk."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    with torch.autocast(device_type=dev.type, enabled=False):
        q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
        B, T, H, K = q.shape
        Vd = v.shape[-1]
        C = chunk
        N = (T + C - 1) // C
        pad = N * C - T
        if pad:  # zero k, v, q, beta and zero log-decay: the padded tail neither reads nor writes nor decays
            q, k, v, g = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v, g))
            beta = F.pad(beta, (0, 0, 0, pad))

        def chunks(t):  # [B, N*C, H, X] -> [B, H, N, C, X]
            return t.reshape(B, N, C, H, -1).permute(0, 3, 1, 2, 4)

        qc, kc, vc, gc = chunks(q), chunks(k), chunks(v), chunks(g)
        bc = beta.reshape(B, N, C, H).permute(0, 3, 1, 2)  # [B, H, N, C]
        G = torch.cumsum(gc, dim=3)  # [B,H,N,C,K] in-chunk cumulative log-decay
        R = G[:, :, :, C // 2:C // 2 + 1, :]  # reference point
        kl, kr, ql = kc * torch.exp(G - R), kc * torch.exp(R - G), qc * torch.exp(G - R)
        ar = torch.arange(C, device=dev)
        strict = ar[:, None] > ar[None, :]
        incl = ar[:, None] >= ar[None, :]
        zero = torch.zeros((), dtype=dt, device=dev)
        Lm = torch.where(strict, bc.unsqueeze(-1) * (kl @ kr.transpose(-1, -2)), zero)  # [B,H,N,C,C]
        A = torch.where(incl, ql @ kr.transpose(-1, -2), zero)  # [B,H,N,C,C]
        eye = torch.eye(C, dtype=dt, device=dev)
        Tm = torch.linalg.solve_triangular(eye + Lm, torch.diag_embed(bc), upper=False, unitriangular=True)
        eG = torch.exp(G)
        Wm = Tm @ (eG * kc)  # [B,H,N,C,K]
        U = Tm @ vc  # [B,H,N,C,V]
        Gn = G[:, :, :, -1:, :]  # [B,H,N,1,K]
        kd = (torch.exp(Gn - G) * kc).transpose(-1, -2)  # [B,H,N,K,C]
        # chunk transition S' = M S + Cn with M = diag(exp(Gn)) - kd W, Cn = kd U (the reference's
        # S' = exp(Gn)ᵀ⊙S + kdᵀ(U - W S)), so the sequential part is one batched matmul-add per chunk
        M = torch.diag_embed(torch.exp(Gn[:, :, :, 0, :])) - kd @ Wm  # [B,H,N,K,K]
        Cn = kd @ U  # [B,H,N,K,V]
        Mp = M.permute(2, 0, 1, 3, 4).reshape(N, B * H, K, K)
        Cp = Cn.permute(2, 0, 1, 3, 4).reshape(N, B * H, K, Vd)
        S = torch.zeros(B * H, K, Vd, dtype=dt, device=dev) if S0 is None else S0.to(dt).reshape(B * H, K, Vd)
        states = [S]
        for Mn, Cn_ in zip(Mp.unbind(0), Cp.unbind(0)):  # unbind: one backward op, not N selects
            S = torch.baddbmm(Cn_, Mn, S)
            states.append(S)
        S_before = torch.stack(states[:-1], dim=0).reshape(N, B, H, K, Vd).permute(1, 2, 0, 3, 4)  # [B,H,N,K,V]
        Vp = U - Wm @ S_before  # pseudo-values [B,H,N,C,V]
        o = (qc * eG) @ S_before + A @ Vp  # [B,H,N,C,V]
        o = o.reshape(B, H, N * C, Vd)[:, :, :T].transpose(1, 2)  # [B,T,H,V]
        bounds = None
        if keep_bounds:
            bounds = torch.stack(states[1:], dim=0).reshape(N, B, H, K, Vd).transpose(0, 1)  # [B,N,H,K,V]
        return o, S.reshape(B, H, K, Vd), bounds


def kda_step(q, k, v, g, beta, S):
    """One token of the recurrence (k3_reference.kda_recurrent) for R rows: q,k,g [R,H,K], v [R,H,V],
    beta [R,H], S [R,H,K,V]. Returns (o [R,H,V], new S)."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.autocast(device_type=q.device.type, enabled=False):
        q, k, v, g, beta, S = (t.to(dt) for t in (q, k, v, g, beta, S))
        S = S * torch.exp(g).unsqueeze(-1)
        u = v - torch.einsum("rhk,rhkv->rhv", k, S)
        S = S + beta[:, :, None, None] * k.unsqueeze(-1) * u.unsqueeze(2)
        return torch.einsum("rhk,rhkv->rhv", q, S), S


# ----------------------------------------------------------------------------------------------------------------
# The forward


@dataclass
class Capture:
    """What a forward records besides logits (all detached views of the forward's own tensors)."""
    taps: dict = field(default_factory=dict)  # target layer l -> [B,T,d] (the AttnRes read feeding l+1)
    kda: dict = field(default_factory=dict)  # layer -> {'bounds': [B,N,H,K,V], 'raw': {'q','k','v': [B,T,P]}}
    mla: dict = field(default_factory=dict)  # layer -> {'keys': [B,T,Hm,nope+rope], 'values': [B,T,Hm,v]}
    routing: dict = field(default_factory=dict)  # moe layer -> top-k expert indices [B,T,k]


def _expert(W, name, quant: bool, group: int):
    w = W[name]
    return mxfp4_fake(w, group) if quant else w


def kda_mixer(c, W, pre, h, chunk, cap_layer=None):
    B, T, _ = h.shape
    H, K = c.kda_heads, c.kda_head_dim
    a = pre + "self_attn."
    raw = {n: h @ W[a + f"{n}_proj.weight"].T for n in "qkv"}  # [B,T,P] each
    conv = {n: causal_conv_silu_b(raw[n], W[a + f"{n}_conv1d.weight"][:, 0, :])[0] for n in "qkv"}
    f = (h @ W[a + "f_a_proj.weight"].T) @ W[a + "f_b_proj.weight"].T  # [B,T,P]
    beta = torch.sigmoid(h @ W[a + "b_proj.weight"].T)  # [B,T,H]
    gz = (h @ W[a + "g_proj.weight"].T).reshape(B, T, H, K)
    q = l2norm(conv["q"].reshape(B, T, H, K)) * K ** -0.5
    k = l2norm(conv["k"].reshape(B, T, H, K))
    v = conv["v"].reshape(B, T, H, K)
    g = kda_gate(c, W, a, f, B, T)
    o, _, bounds = kda_chunked_b(q, k, v, g, beta, None, chunk, keep_bounds=cap_layer is not None)
    if cap_layer is not None:
        cap_layer.update(bounds=bounds.detach(), raw={n: raw[n].detach() for n in "qkv"})
    o = o * torch.rsqrt((o * o).mean(dim=-1, keepdim=True) + c.eps) * W[a + "o_norm.weight"] * torch.sigmoid(gz)
    return o.reshape(B, T, H * K) @ W[a + "o_proj.weight"].T  # [B,T,d]


def kda_gate(c, W, a, f, B, T):
    H, K = c.kda_heads, c.kda_head_dim
    a_log = W[a + "A_log"][:H]
    gate_in = torch.exp(a_log)[None, None, :, None] * (f + W[a + "dt_bias"]).reshape(B, T, H, K)
    return c.gate_lb * torch.sigmoid(gate_in)  # [B,T,H,K]


def mla_qkv(c, W, a, h):
    """h [..., d] -> q [..., Hm, nope+rope], key [..., Hm, nope+rope], value [..., Hm, v] (unabsorbed, no RoPE)."""
    Hm, lead = c.mla_heads, h.shape[:-1]
    q = rmsnorm(h @ W[a + "q_a_proj.weight"].T, W[a + "q_a_layernorm.weight"], MLA_NORM_EPS)
    q = (q @ W[a + "q_b_proj.weight"].T).reshape(*lead, Hm, c.nope + c.rope)
    kva = h @ W[a + "kv_a_proj_with_mqa.weight"].T  # [..., kv_lora + rope]
    latent = rmsnorm(kva[..., :c.kv_lora], W[a + "kv_a_layernorm.weight"], MLA_NORM_EPS)
    k_rot = kva[..., c.kv_lora:]  # shared by every head, not normalised
    kv = (latent @ W[a + "kv_b_proj.weight"].T).reshape(*lead, Hm, c.nope + c.v_dim)
    key = torch.cat([kv[..., :c.nope], k_rot.unsqueeze(-2).expand(*lead, Hm, c.rope)], dim=-1)
    return q, key, kv[..., c.nope:]


def mla_mixer(c, W, pre, h, cap_layer=None):
    B, T, _ = h.shape
    a = pre + "self_attn."
    q, key, val = mla_qkv(c, W, a, h)
    if cap_layer is not None:
        cap_layer.update(keys=key.detach(), values=val.detach())
    o = F.scaled_dot_product_attention(q.transpose(1, 2), key.transpose(1, 2), val.transpose(1, 2), is_causal=True,
                                       scale=(c.nope + c.rope) ** -0.5)  # [B,Hm,T,v]
    o = o.transpose(1, 2).reshape(B, T, c.mla_heads * c.v_dim)
    gate = torch.sigmoid(h @ W[a + "g_proj.weight"].T)  # gate before o_proj
    return (o * gate) @ W[a + "o_proj.weight"].T


def dense_mlp(c, W, pre, h):
    m = pre + "mlp."
    return situ(h @ W[m + "gate_proj.weight"].T, h @ W[m + "up_proj.weight"].T, c.situ_beta, c.situ_lbeta) \
        @ W[m + "down_proj.weight"].T


def latent_moe(c, W, pre, h, quant=False, routing=None):
    """Sigmoid router, bias for selection only, top-k (stable: ties -> lowest index), renormalised unbiased
    scores × rsf; all experts computed densely and combined with the (sparse) top-k weights."""
    m = pre + "block_sparse_moe."
    E, I, L = c.experts, c.expert_dim, c.latent
    with torch.autocast(device_type=h.device.type, enabled=False):  # router in float32 (or float64)
        hr = h if h.dtype == torch.float64 else h.float()
        scores = torch.sigmoid(hr @ W[m + "gate.weight"].to(hr.dtype).T)  # [..., E]
    choice = scores.detach() + W[m + "gate.e_score_correction_bias"].to(scores.dtype)
    idx = torch.sort(-choice, dim=-1, stable=True).indices[..., :c.top_k]  # [..., k]
    wts = torch.gather(scores, -1, idx)
    if c.renormalize:
        wts = wts / (wts.sum(dim=-1, keepdim=True) + 1e-20)
    wts = wts * c.rsf
    dense_w = torch.zeros_like(scores).scatter(-1, idx, wts)  # [..., E]
    if routing is not None:
        routing.append(idx.detach())
    z = h @ W[m + "routed_expert_down_proj.weight"].T  # [..., L]
    g = c.group_size
    w1 = _expert(W, m + "experts.w1", quant, g).reshape(E * I, L)
    w3 = _expert(W, m + "experts.w3", quant, g).reshape(E * I, L)
    w2 = _expert(W, m + "experts.w2", quant, g).permute(0, 2, 1).reshape(E * I, L)  # [E,L,I] -> [E*I, L]
    s = situ(z @ w1.T, z @ w3.T, c.situ_beta, c.situ_lbeta)  # [..., E*I]
    s = (s.unflatten(-1, (E, I)) * dense_w.unsqueeze(-1).to(s.dtype)).flatten(-2)
    y = s @ w2  # [..., L]
    y = rmsnorm(y, W[m + "routed_expert_norm.weight"], c.eps) @ W[m + "routed_expert_up_proj.weight"].T
    if c.shared > 0:
        y = y + situ(h @ W[m + "shared_experts.gate_proj.weight"].T, h @ W[m + "shared_experts.up_proj.weight"].T,
                     c.situ_beta, c.situ_lbeta) @ W[m + "shared_experts.down_proj.weight"].T
    return y


def forward(c, W, tokens: torch.Tensor, *, chunk=16, quant=False, capture: Capture = None, tap_layers=(),
            want_hidden=False, routing: dict = None):
    """tokens [B,T] compact ids -> raw compact logits [B,T,n+1] (no shared offset), as k3_reference.forward
    on each row (fresh state). `quant`: experts through MXFP4 fake-quant. `capture`: records the taps of
    `tap_layers`, the KDA chunk-boundary states and raw projections, the MLA keys/values, the routing.
    `routing` (a dict) receives each MoE layer's top-k indices [B,T,k] alone. With want_hidden, returns the final normed hidden [B,T,d] instead of logits."""
    x0 = W["model.embed_tokens.weight"][tokens]  # [B,T,d], no scaling
    bank, live, eps = [], x0, c.eps
    taps = set(tap_layers)
    last = len(c.layers) - 1
    for layer, (mixer, ffn) in enumerate(c.layers):
        p = f"model.layers.{layer}."
        h_in = live if not bank else attn_res_read(bank + [live], W[p + "self_attention_res_norm.weight"],
                                                   W[p + "self_attention_res_proj.weight"], eps)
        if capture is not None and (layer - 1) in taps:
            capture.taps[layer - 1] = h_in.detach()
        h = rmsnorm(h_in, W[p + "input_layernorm.weight"], eps)
        if layer % c.block_size == 0:  # seal BEFORE the attention, restart the live sum
            bank.append(live)
            live = None
        if mixer == "kda":
            cl = capture.kda.setdefault(layer, {}) if capture is not None else None
            a = kda_mixer(c, W, p, h, chunk, cl)
        else:
            cl = capture.mla.setdefault(layer, {}) if capture is not None else None
            a = mla_mixer(c, W, p, h, cl)
        live = a if live is None else live + a
        f_in = attn_res_read(bank + [live], W[p + "mlp_res_norm.weight"], W[p + "mlp_res_proj.weight"], eps)
        hf = rmsnorm(f_in, W[p + "post_attention_layernorm.weight"], eps)
        if ffn == "dense":
            f = dense_mlp(c, W, p, hf)
        else:
            rt = [] if (capture is not None or routing is not None) else None
            f = latent_moe(c, W, p, hf, quant, rt)
            if capture is not None:
                capture.routing[layer] = rt[0]
            if routing is not None:
                routing[layer] = rt[0]
        live = live + f
    h = attn_res_read(bank + [live], W["model.output_attn_res_norm.weight"], W["model.output_attn_res_proj.weight"], eps)
    if capture is not None and last in taps:
        capture.taps[last] = h.detach()
    h = rmsnorm(h, W["model.norm.weight"], eps)
    return h if want_hidden else h @ W["lm_head.weight"].T


# ----------------------------------------------------------------------------------------------------------------
# Branch rollouts: many continuations of one forward's rows, one token at a time


class Branches:
    """Continuations of the rows of a captured forward from anchor positions `pos` (a common set for every row,
    each a multiple of the KDA chunk): branch (b, a) continues row b after its first pos[a] tokens.
    R = B·A branch rows, row-major (b outer). `step(tokens [R])` feeds one token per branch at position
    pos[a] + steps_so_far and returns raw compact logits [R, n+1]."""

    def __init__(self, c, W, cap: Capture, pos: list, chunk: int, quant=False):
        self.c, self.W, self.quant = c, W, quant
        self.pos = torch.tensor(pos, dtype=torch.long)
        T = next(iter(cap.mla.values()))["keys"].shape[1]
        if any(p % chunk or p <= 0 or p > T for p in pos):
            raise ValueError("branch anchors must be positive multiples of the KDA chunk, at most T")
        self.A = len(pos)
        self.kda, self.mla = {}, {}
        for layer, d in cap.kda.items():
            B = d["bounds"].shape[0]
            S = d["bounds"][:, [p // chunk - 1 for p in pos]]  # [B,A,H,K,V]
            win = {}
            for n, raw in d["raw"].items():  # window = the W-1 raw inputs before the anchor
                Wn = c.conv_kernel - 1
                idx = self.pos[:, None] - Wn + torch.arange(Wn)[None, :]  # [A, W-1]
                win[n] = raw[:, idx.to(raw.device)].flatten(0, 1)  # [B*A, W-1, P]
            self.kda[layer] = {"S": S.flatten(0, 1), "win": win}
        for layer, d in cap.mla.items():
            B, T = d["keys"].shape[:2]
            visible = torch.arange(T)[None, :] < self.pos[:, None]  # [A, T] cache positions before the anchor
            self.mla[layer] = {"keys": d["keys"], "values": d["values"], "visible": visible.to(d["keys"].device),
                               "new_k": [], "new_v": []}
        self.B = B

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        c, W = self.c, self.W
        x0 = W["model.embed_tokens.weight"][tokens]  # [R,d]
        bank, live, eps = [], x0, c.eps
        for layer, (mixer, ffn) in enumerate(c.layers):
            p = f"model.layers.{layer}."
            h_in = live if not bank else attn_res_read(bank + [live], W[p + "self_attention_res_norm.weight"],
                                                       W[p + "self_attention_res_proj.weight"], eps)
            h = rmsnorm(h_in, W[p + "input_layernorm.weight"], eps)
            if layer % c.block_size == 0:
                bank.append(live)
                live = None
            a = self._kda(layer, p, h) if mixer == "kda" else self._mla(layer, p, h)
            live = a if live is None else live + a
            f_in = attn_res_read(bank + [live], W[p + "mlp_res_norm.weight"], W[p + "mlp_res_proj.weight"], eps)
            hf = rmsnorm(f_in, W[p + "post_attention_layernorm.weight"], eps)
            f = dense_mlp(c, W, p, hf) if ffn == "dense" else latent_moe(c, W, p, hf, self.quant)
            live = live + f
        h = attn_res_read(bank + [live], W["model.output_attn_res_norm.weight"],
                          W["model.output_attn_res_proj.weight"], eps)
        return rmsnorm(h, W["model.norm.weight"], eps) @ W["lm_head.weight"].T  # [R, n+1]

    def _kda(self, layer, p, h):
        c, W, st = self.c, self.W, self.kda[layer]
        R, H, K = h.shape[0], c.kda_heads, c.kda_head_dim
        a = p + "self_attn."
        conv = {}
        for n in "qkv":
            raw = h @ W[a + f"{n}_proj.weight"].T  # [R,P]
            y, st["win"][n] = causal_conv_silu_b(raw.unsqueeze(1), W[a + f"{n}_conv1d.weight"][:, 0, :], st["win"][n])
            conv[n] = y[:, 0]
        f = (h @ W[a + "f_a_proj.weight"].T) @ W[a + "f_b_proj.weight"].T
        beta = torch.sigmoid(h @ W[a + "b_proj.weight"].T)  # [R,H]
        gz = (h @ W[a + "g_proj.weight"].T).reshape(R, H, K)
        q = l2norm(conv["q"].reshape(R, H, K)) * K ** -0.5
        k = l2norm(conv["k"].reshape(R, H, K))
        v = conv["v"].reshape(R, H, K)
        g = kda_gate(c, W, a, f, R, 1)[:, 0]
        o, st["S"] = kda_step(q, k, v, g, beta, st["S"])
        o = o * torch.rsqrt((o * o).mean(dim=-1, keepdim=True) + c.eps) * W[a + "o_norm.weight"] * torch.sigmoid(gz)
        return o.reshape(R, H * K) @ W[a + "o_proj.weight"].T

    def _mla(self, layer, p, h):
        c, W, st = self.c, self.W, self.mla[layer]
        B, A, Hm = self.B, self.A, c.mla_heads
        a = p + "self_attn."
        q, key, val = mla_qkv(c, W, a, h)  # [R,Hm,*]
        st["new_k"].append(key.reshape(B, A, Hm, -1))
        st["new_v"].append(val.reshape(B, A, Hm, -1))
        qb = q.reshape(B, A, Hm, -1)
        scale = (c.nope + c.rope) ** -0.5
        s_cache = torch.einsum("bahd,bthd->bhat", qb, st["keys"].to(qb.dtype)) * scale  # [B,Hm,A,T]
        s_cache = s_cache.masked_fill(~st["visible"][None, None], -math.inf)
        nk = torch.stack(st["new_k"], dim=2)  # [B,A,s,Hm,dk]
        nv = torch.stack(st["new_v"], dim=2)
        s_new = torch.einsum("bahd,bashd->bhas", qb, nk) * scale  # [B,Hm,A,s]
        pr = torch.softmax(torch.cat([s_cache, s_new], dim=-1), dim=-1)
        T = s_cache.shape[-1]
        o = torch.einsum("bhat,bthv->bahv", pr[..., :T], st["values"].to(qb.dtype)) \
            + torch.einsum("bhas,bashv->bahv", pr[..., T:], nv)  # [B,A,Hm,v]
        o = o.reshape(B * A, Hm * c.v_dim)
        gate = torch.sigmoid(h @ W[a + "g_proj.weight"].T)
        return (o * gate) @ W[a + "o_proj.weight"].T


# ----------------------------------------------------------------------------------------------------------------
# Conversion to k3_reference's weight dict (full vocabulary), for the self-check


def to_reference_weights(c, W: dict, vocab: Vocab) -> dict:
    """The trainer's tensors -> k3_reference.load_weights' dict, the vocabulary expanded per the contract."""
    w = {"embed": vocab.expand(W["model.embed_tokens.weight"]), "lm_head": vocab.expand(W["lm_head.weight"]),
         "norm": W["model.norm.weight"], "out_res_norm": W["model.output_attn_res_norm.weight"],
         "out_res_proj": W["model.output_attn_res_proj.weight"], "layers": []}
    for layer, (mixer, ffn) in enumerate(c.layers):
        p = f"model.layers.{layer}."
        L = {n: W[p + n + ".weight"] for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm",
                                               "self_attention_res_proj", "mlp_res_norm", "mlp_res_proj")}
        a = p + "self_attn."
        if mixer == "kda":
            for n in ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "f_a_proj", "f_b_proj", "b_proj"):
                L[n] = W[a + n + ".weight"]
            for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                L[n] = W[a + n + ".weight"][:, 0, :]
            L["A_log"] = W[a + "A_log"][:c.kda_heads]
            L["dt_bias"] = W[a + "dt_bias"]
            L["o_norm"] = W[a + "o_norm.weight"]
        else:
            for n, k in (("q_a_proj", "q_a_proj"), ("q_a_layernorm", "q_a_layernorm"), ("q_b_proj", "q_b_proj"),
                         ("kv_a_proj", "kv_a_proj_with_mqa"), ("kv_a_layernorm", "kv_a_layernorm"),
                         ("kv_b_proj", "kv_b_proj"), ("g_proj", "g_proj"), ("o_proj", "o_proj")):
                L[n] = W[a + k + ".weight"]
        if ffn == "dense":
            for n in ("gate", "up", "down"):
                L[n] = W[p + f"mlp.{n}_proj.weight"]
        else:
            m = p + "block_sparse_moe."
            L["router"] = W[m + "gate.weight"]
            L["router_bias"] = W[m + "gate.e_score_correction_bias"]
            L["latent_down"] = W[m + "routed_expert_down_proj.weight"]
            L["latent_up"] = W[m + "routed_expert_up_proj.weight"]
            L["routed_norm"] = W[m + "routed_expert_norm.weight"]
            if c.shared > 0:
                for n, k in (("sh_gate", "gate_proj"), ("sh_up", "up_proj"), ("sh_down", "down_proj")):
                    L[n] = W[m + f"shared_experts.{k}.weight"]
            for proj in ("w1", "w3", "w2"):
                L[proj] = W[m + f"experts.{proj}"]
        w["layers"].append(L)
    return w


# ----------------------------------------------------------------------------------------------------------------
# Training schedule shared by the target and drafter phases


class Schedule:
    """The step count and learning rate of one phase: `max_steps` fixed, or planned from the time `budget`
    once the step time is known (measured from the end of step 1, over at least 2 steps; planned at step 13,
    or earlier when the steps are slow enough that waiting would eat a tenth of the budget). `overhead`
    (seconds per step) accounts for the periodic evaluations. LR: linear warmup over min(warmup, planned/10)
    steps, then cosine from `lr` down to 0.1·lr at the planned end."""

    def __init__(self, budget: float, max_steps, lr: float, warmup: int, sync=lambda: None):
        self.budget, self.planned, self.fixed = budget, max_steps, max_steps is not None
        self.lr, self.warmup, self.sync = lr, warmup, sync
        self.t0, self.t1, self.per_step = time.time(), None, None

    def elapsed(self) -> float:
        return time.time() - self.t0

    def done(self, step: int) -> bool:
        if self.planned is not None and step >= self.planned:
            return True
        return not self.fixed and self.elapsed() > self.budget * 1.05

    def frac(self, step: int) -> float:
        return min(step / self.planned, 1.0) if self.planned else 0.0

    def lr_at(self, step: int) -> float:
        warm = self.warmup if self.planned is None else min(self.warmup, max(1, self.planned // 10))
        return self.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.45 * (1 + math.cos(math.pi * self.frac(step))))

    def after_step(self, step: int, overhead: float = 0.0):
        """Call after finishing step `step` (1-based); returns the measured seconds per step when it plans."""
        if step == 1:
            self.sync()
            self.t1 = time.time()
        elif self.planned is None and step >= 3:
            self.sync()
            per = (time.time() - self.t1) / (step - 1)
            if step >= 13 or per * step > 0.1 * self.budget:
                left = self.budget - self.elapsed()
                self.planned = max(step + 1, step + int(left / (per + overhead)))
                self.per_step = per
                return per
        return None
