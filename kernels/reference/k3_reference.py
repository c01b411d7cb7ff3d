#!/usr/bin/env python3
"""Independent PyTorch reference of the Kimi K3 text forward, and the golden-logits generator.

Written from the formulas of shared/reference/k3-architecture.md (section numbers below), not from
sparkd's Rust forward, so that comparing the two checks the algebra as well as the code.

Invariants:
- Every activation and every weight is float64 (or float32 with --dtype float32); nothing is ever
  rounded to bf16. Weights stored as BF16 / F32 / MXFP4 are widened exactly.
- A prompt is processed token by token with the recurrent KDA (§2.4); this is the exact reference
  and the only path that produces golden numbers.
- On every run the same prompts are also processed in one window per prompt, with the chunked KDA
  of §3.2 and causal MLA over the window, and the two runs must agree (|Δ| <= 1e-10 relative in
  float64), layer by layer and on the logits; a kernel-level chunked-vs-recurrent check with a
  non-zero incoming state runs too. A disagreement raises, it never passes silently.
- MoE top-k ties go to the lowest expert index (stable sort).
- Bad input (missing tensor, wrong shape, unsupported config) raises CheckpointError naming it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

TEXT_PREFIX = "language_model."
MLA_NORM_EPS = 1e-6  # q_a / kv_a KimiRMSNorm default eps (§2.3)
L2_NORM_EPS = 1e-6  # KDA q/k l2 norm (§2.3)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # §2.8

# 16 fixed probe ids spread over K3's 163,840-entry vocabulary (specials included).
PROBE_IDS = [0, 1, 255, 1000, 4096, 12345, 32768, 65535, 99999, 100255, 120000, 150000, 163584, 163586, 163587,
             163839]
PROMPT_LENGTHS = (1, 5, 17, 40)
PROMPT_SEED = 20261129
SPECIAL_PROMPT = {0: 163584, 7: 163587, 16: 163586}  # put into the 17-token prompt at these positions


class CheckpointError(Exception):
    """A checkpoint or config this reference cannot run, with the offending name in the message."""


# ----------------------------------------------------------------------------------------------------------------
# Config


@dataclass
class Config:
    vocab: int
    d: int
    layers: list  # [(mixer 'kda'|'mla', ffn 'dense'|'moe')]
    kda_heads: int
    kda_head_dim: int
    conv_kernel: int
    gate_lb: float
    mla_heads: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v_dim: int
    experts: int
    top_k: int
    shared: int
    expert_dim: int
    latent: int
    renormalize: bool
    rsf: float
    dense_dim: int
    block_size: int
    situ_beta: float
    situ_lbeta: float
    eps: float
    group_size: int

    @staticmethod
    def from_json(root: dict) -> "Config":
        """Reads a `kimi_k3` wrapper with `text_config` (§1.1) or a bare `kimi_linear` config."""
        mt = root.get("model_type")
        if mt == "kimi_k3":
            t = root.get("text_config")
            if not isinstance(t, dict):
                raise CheckpointError("config.json: text_config missing or not an object")
        elif mt == "kimi_linear":
            t = root
        else:
            raise CheckpointError(f"config.json: model_type `{mt}` is not kimi_k3 or kimi_linear")

        def need(key, src=t, where="text_config"):
            if key not in src:
                raise CheckpointError(f"config.json: {where}.{key} missing")
            return src[key]

        lin = need("linear_attn_config")
        n = need("num_hidden_layers")
        kda_1 = set(need("kda_layers", lin, "linear_attn_config"))
        mla_1 = set(need("full_attn_layers", lin, "linear_attn_config"))
        if kda_1 & mla_1 or (kda_1 | mla_1) != set(range(1, n + 1)):
            raise CheckpointError("config.json: kda_layers and full_attn_layers do not partition 1..num_hidden_layers")
        if need("hidden_act") != "situ":
            raise CheckpointError("config.json: hidden_act must be `situ`")
        if need("moe_router_activation_func") != "sigmoid":
            raise CheckpointError("config.json: moe_router_activation_func must be `sigmoid`")
        if t.get("num_expert_group", 1) != 1:
            raise CheckpointError("config.json: num_expert_group > 1 is not supported")
        for key, where, src in (("use_full_rank_gate", "linear_attn_config", lin), ("mla_use_nope", "text_config", t),
                                ("mla_use_output_gate", "text_config", t), ("latent_moe_use_norm", "text_config", t)):
            if src.get(key) is not True:
                raise CheckpointError(f"config.json: {where}.{key} must be true (the K3 form is the only one here)")
        if "gate_lower_bound" not in lin:
            raise CheckpointError("config.json: linear_attn_config.gate_lower_bound missing "
                                  "(the softplus gate is not supported)")
        first_dense = need("first_k_dense_replace")
        layers = [("kda" if (i + 1) in kda_1 else "mla", "dense" if i < first_dense else "moe") for i in range(n)]
        group = 32
        q = t.get("quantization_config")
        if isinstance(q, dict):
            group = q.get("config_groups", {}).get("group_0", {}).get("weights", {}).get("group_size", 32)
        return Config(
            vocab=need("vocab_size"), d=need("hidden_size"), layers=layers,
            kda_heads=need("num_heads", lin, "linear_attn_config"),
            kda_head_dim=need("head_dim", lin, "linear_attn_config"),
            conv_kernel=need("short_conv_kernel_size", lin, "linear_attn_config"),
            gate_lb=float(lin["gate_lower_bound"]),
            mla_heads=need("num_attention_heads"), q_lora=need("q_lora_rank"), kv_lora=need("kv_lora_rank"),
            nope=need("qk_nope_head_dim"), rope=need("qk_rope_head_dim"), v_dim=need("v_head_dim"),
            experts=need("num_experts"), top_k=need("num_experts_per_token"), shared=need("num_shared_experts"),
            expert_dim=need("moe_intermediate_size"), latent=need("routed_expert_hidden_size"),
            renormalize=bool(need("moe_renormalize")), rsf=float(need("routed_scaling_factor")),
            dense_dim=need("intermediate_size"), block_size=need("attn_res_block_size"),
            situ_beta=float(need("activation_situ_beta")), situ_lbeta=float(need("activation_situ_linear_beta")),
            eps=float(need("rms_norm_eps")), group_size=int(group),
        )


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint reading (§7) and MXFP4 dequantisation (§2.8)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, group: int, dtype) -> torch.Tensor:
    """`packed` U8 [out, in/2] (element 2i low nibble, 2i+1 high), `scale` U8 [out, in/group] E8M0 -> [out, in]."""
    out_dim, half = packed.shape
    in_dim = 2 * half
    if scale.shape != (out_dim, in_dim // group) or in_dim % group:
        raise CheckpointError(f"MXFP4 scale shape {tuple(scale.shape)} does not match packed {tuple(packed.shape)}")
    p = packed.to(torch.int64)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(out_dim, in_dim)  # [out, in], 2i low, 2i+1 high
    table = torch.tensor(E2M1_VALUES, dtype=dtype)
    mag = table[codes & 0x7]
    vals = torch.where((codes & 0x8) != 0, -mag, mag)
    s = scale.to(torch.int64)
    factor = torch.pow(torch.tensor(2.0, dtype=dtype), (s - 127).to(dtype))
    factor = torch.where(s == 255, torch.tensor(float("nan"), dtype=dtype), factor)  # E8M0 0xFF = NaN
    return vals * factor.repeat_interleave(group, dim=1)  # [out, in]


class Checkpoint:
    """Tensors of a folder in the real K3 layout, widened to `dtype`, keyed without `language_model.`."""

    def __init__(self, folder: Path, dtype):
        self.folder = folder
        self.dtype = dtype
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{cfg_path}: missing")
        self.cfg = Config.from_json(json.loads(cfg_path.read_text()))
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no weight_map")
        else:
            weight_map = {}
            for shard in sorted(folder.glob("*.safetensors")):
                with safe_open(str(shard), framework="pt") as f:
                    weight_map.update({k: shard.name for k in f.keys()})
            if not weight_map:
                raise CheckpointError(f"{folder}: neither model.safetensors.index.json nor *.safetensors")
        self.location = {}  # short name -> (shard file, full name)
        for full, shard in weight_map.items():
            short = full[len(TEXT_PREFIX):] if full.startswith(TEXT_PREFIX) else full
            self.location[short] = (folder / shard, full)
        self.handles = {}

    def raw(self, name: str) -> torch.Tensor:
        if name not in self.location:
            raise CheckpointError(f"tensor `{name}` missing from the checkpoint")
        shard, full = self.location[name]
        if shard not in self.handles:
            if not shard.is_file():
                raise CheckpointError(f"shard {shard} named in the index is missing")
            self.handles[shard] = safe_open(str(shard), framework="pt")
        return self.handles[shard].get_tensor(full)

    def get(self, name: str, shape: tuple) -> torch.Tensor:
        t = self.raw(name)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor `{name}` has shape {tuple(t.shape)}, expected {tuple(shape)}")
        return t.to(self.dtype)

    def linear_expert(self, base: str, out_dim: int, in_dim: int) -> torch.Tensor:
        """An expert projection: MXFP4 (`.weight_packed` + `.weight_scale`) or a plain `.weight`."""
        if base + ".weight_packed" in self.location:
            g = self.cfg.group_size
            packed = self.raw(base + ".weight_packed")
            scale = self.raw(base + ".weight_scale")
            if tuple(packed.shape) != (out_dim, in_dim // 2) or packed.dtype != torch.uint8:
                raise CheckpointError(f"`{base}.weight_packed` is {packed.dtype}{tuple(packed.shape)}, "
                                      f"expected uint8{(out_dim, in_dim // 2)}")
            if tuple(scale.shape) != (out_dim, in_dim // g) or scale.dtype != torch.uint8:
                raise CheckpointError(f"`{base}.weight_scale` is {scale.dtype}{tuple(scale.shape)}, "
                                      f"expected uint8{(out_dim, in_dim // g)}")
            return dequant_mxfp4(packed, scale, g, self.dtype)
        return self.get(base + ".weight", (out_dim, in_dim))


def load_weights(ck: Checkpoint) -> dict:
    """Every tensor the forward uses, checked against the shapes of §7."""
    c, d = ck.cfg, ck.cfg.d
    w = {"embed": ck.get("model.embed_tokens.weight", (c.vocab, d)),
         "lm_head": ck.get("lm_head.weight", (c.vocab, d)),
         "norm": ck.get("model.norm.weight", (d,)),
         "out_res_norm": ck.get("model.output_attn_res_norm.weight", (d,)),
         "out_res_proj": ck.get("model.output_attn_res_proj.weight", (1, d)),
         "layers": []}
    P, H, K = c.kda_heads * c.kda_head_dim, c.kda_heads, c.kda_head_dim
    for layer, (mixer, ffn) in enumerate(c.layers):
        pre = f"model.layers.{layer}."
        g = lambda s, shape: ck.get(pre + s, shape)  # noqa: E731
        L = {name: g(name + ".weight", shape) for name, shape in [
            ("input_layernorm", (d,)), ("post_attention_layernorm", (d,)),
            ("self_attention_res_norm", (d,)), ("self_attention_res_proj", (1, d)),
            ("mlp_res_norm", (d,)), ("mlp_res_proj", (1, d))]}
        if mixer == "kda":
            for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
                L[n] = g(f"self_attn.{n}.weight", (P, d))
            L["o_proj"] = g("self_attn.o_proj.weight", (d, P))
            L["f_a_proj"] = g("self_attn.f_a_proj.weight", (K, d))
            L["f_b_proj"] = g("self_attn.f_b_proj.weight", (P, K))
            L["b_proj"] = g("self_attn.b_proj.weight", (H, d))
            for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                L[n] = g(f"self_attn.{n}.weight", (P, 1, c.conv_kernel))[:, 0, :]  # [P, W]
            a_log = ck.raw(pre + "self_attn.A_log").to(ck.dtype).reshape(-1)  # [128] real, [1,1,H,1] Kimi-Linear
            if a_log.numel() < H:
                raise CheckpointError(f"`{pre}self_attn.A_log` has {a_log.numel()} entries, fewer than {H} heads")
            L["A_log"] = a_log[:H]  # first num_heads entries (§8.1)
            L["dt_bias"] = g("self_attn.dt_bias", (P,))
            L["o_norm"] = g("self_attn.o_norm.weight", (K,))
        else:
            Hm = c.mla_heads
            L["q_a_proj"] = g("self_attn.q_a_proj.weight", (c.q_lora, d))
            L["q_a_layernorm"] = g("self_attn.q_a_layernorm.weight", (c.q_lora,))
            L["q_b_proj"] = g("self_attn.q_b_proj.weight", (Hm * (c.nope + c.rope), c.q_lora))
            L["kv_a_proj"] = g("self_attn.kv_a_proj_with_mqa.weight", (c.kv_lora + c.rope, d))
            L["kv_a_layernorm"] = g("self_attn.kv_a_layernorm.weight", (c.kv_lora,))
            L["kv_b_proj"] = g("self_attn.kv_b_proj.weight", (Hm * (c.nope + c.v_dim), c.kv_lora))
            L["g_proj"] = g("self_attn.g_proj.weight", (Hm * c.v_dim, d))
            L["o_proj"] = g("self_attn.o_proj.weight", (d, Hm * c.v_dim))
        if ffn == "dense":
            L["gate"] = g("mlp.gate_proj.weight", (c.dense_dim, d))
            L["up"] = g("mlp.up_proj.weight", (c.dense_dim, d))
            L["down"] = g("mlp.down_proj.weight", (d, c.dense_dim))
        else:
            m = pre + "block_sparse_moe."
            L["router"] = ck.get(m + "gate.weight", (c.experts, d))
            L["router_bias"] = ck.get(m + "gate.e_score_correction_bias", (c.experts,))
            L["latent_down"] = ck.get(m + "routed_expert_down_proj.weight", (c.latent, d))
            L["latent_up"] = ck.get(m + "routed_expert_up_proj.weight", (d, c.latent))
            L["routed_norm"] = ck.get(m + "routed_expert_norm.weight", (c.latent,))
            if c.shared > 0:
                s = c.shared * c.expert_dim
                L["sh_gate"] = ck.get(m + "shared_experts.gate_proj.weight", (s, d))
                L["sh_up"] = ck.get(m + "shared_experts.up_proj.weight", (s, d))
                L["sh_down"] = ck.get(m + "shared_experts.down_proj.weight", (d, s))
            L["w1"] = torch.stack([ck.linear_expert(f"{m}experts.{e}.w1", c.expert_dim, c.latent)
                                   for e in range(c.experts)])  # [E, I, latent]
            L["w3"] = torch.stack([ck.linear_expert(f"{m}experts.{e}.w3", c.expert_dim, c.latent)
                                   for e in range(c.experts)])  # [E, I, latent]
            L["w2"] = torch.stack([ck.linear_expert(f"{m}experts.{e}.w2", c.latent, c.expert_dim)
                                   for e in range(c.experts)])  # [E, latent, I]
        w["layers"].append(L)
    return w


# ----------------------------------------------------------------------------------------------------------------
# Elementary ops (§2.2, §2.3, §2.7)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps))


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2_NORM_EPS)


def situ(g: torch.Tensor, u: torch.Tensor, beta: float, lbeta: float) -> torch.Tensor:
    """SiTU(g,u) = beta·tanh(g/beta)·σ(g) · beta_l·tanh(u/beta_l) (§2.7)."""
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (lbeta * torch.tanh(u / lbeta))


def attn_res_read(sources: list, norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    """Depth-wise softmax over the sources (sealed blocks, then live), each [T, d] (§2.2)."""
    v = torch.stack(sources)  # [S, T, d]
    q = norm_w * proj_w[0]  # [d] folded pseudo-query
    r = torch.rsqrt((v * v).mean(dim=-1, keepdim=True) + eps)  # [S, T, 1]
    s = ((v * r) * q).sum(dim=-1)  # [S, T], no 1/sqrt(d)
    p = torch.softmax(s, dim=0)  # over depth
    return (p.unsqueeze(-1) * v).sum(dim=0)  # [T, d], mixes the raw sources


# ----------------------------------------------------------------------------------------------------------------
# KDA (§2.4 recurrent, §3.2 chunked)


def kda_recurrent(q, k, v, g, beta, state):
    """q,k [T,H,K] (q l2-normed and scaled, k l2-normed), v [T,H,V], g [T,H,K] log-decay, beta [T,H],
    state [H,K,V] (updated in place). Returns o [T,H,V]; reads with the updated state."""
    out = []
    for t in range(q.shape[0]):
        state.mul_(torch.exp(g[t]).unsqueeze(-1))  # decay the key rows
        u = v[t] - torch.einsum("hk,hkv->hv", k[t], state)  # delta-rule error [H, V]
        state.add_(beta[t][:, None, None] * k[t].unsqueeze(-1) * u.unsqueeze(1))  # rank-1 write
        out.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(out)


def kda_chunked(q, k, v, g, beta, state, chunk: int):
    """The WY / chunked form of §3.2 over chunks of `chunk` tokens; same arguments as kda_recurrent."""
    T, H, K = q.shape
    out = []
    for s0 in range(0, T, chunk):
        span = slice(s0, s0 + chunk)
        qc, kc, vc = q[span].transpose(0, 1), k[span].transpose(0, 1), v[span].transpose(0, 1)  # [H, n, K|V]
        gc, bc = g[span].transpose(0, 1), beta[span].transpose(0, 1)  # [H, n, K], [H, n]
        n = qc.shape[1]
        G = torch.cumsum(gc, dim=1)  # [H, n, K] in-chunk cumulative log-decay
        diff = G.unsqueeze(2) - G.unsqueeze(1)  # [H, i, j, K] = G_i - G_j
        strict = torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=-1)
        incl = torch.tril(torch.ones(n, n, dtype=torch.bool))
        decay_strict = torch.exp(diff.masked_fill(~strict[None, :, :, None], -math.inf))
        decay_incl = torch.exp(diff.masked_fill(~incl[None, :, :, None], -math.inf))
        Lm = bc.unsqueeze(-1) * torch.einsum("hic,hijc,hjc->hij", kc, decay_strict, kc)  # [H, n, n]
        eye = torch.eye(n, dtype=q.dtype).expand(H, n, n)
        Tm = torch.linalg.solve_triangular(eye + Lm, torch.diag_embed(bc), upper=False, unitriangular=True)
        W = Tm @ (torch.exp(G) * kc)  # [H, n, K]
        U = Tm @ vc  # [H, n, V]
        Vp = U - W @ state  # pseudo-values [H, n, V]
        A = torch.einsum("hic,hijc,hjc->hij", qc, decay_incl, kc)  # [H, n, n]
        o_chunk = (qc * torch.exp(G)) @ state + A @ Vp  # [H, n, V]
        Gn = G[:, -1:, :]  # [H, 1, K]
        new_state = torch.exp(Gn).transpose(1, 2) * state + (torch.exp(Gn - G) * kc).transpose(1, 2) @ Vp
        state.copy_(new_state)
        out.append(o_chunk.transpose(0, 1))
    return torch.cat(out)


@dataclass
class KdaState:
    S: torch.Tensor  # [H, K, V]
    conv: dict  # 'q'|'k'|'v' -> [W-1, P] last pre-conv inputs, oldest first


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor):
    """Depthwise causal conv of width W with SiLU: x [T,P], weight [P,W] (last tap = current token), window
    [W-1,P] = previous inputs (zeros at the start). Returns (y [T,P], new window)."""
    W = weight.shape[1]
    full = torch.cat([window, x])  # [W-1+T, P]
    T = x.shape[0]
    y = sum(weight[:, j] * full[j:j + T] for j in range(W))
    return torch.nn.functional.silu(y), full[-(W - 1):].clone()


def kda_layer(c: Config, L: dict, h: torch.Tensor, st: KdaState, mode: str, chunk: int, fla=None):
    """KDA mixer over h [T, d] (§2.4). mode 'recurrent' | 'chunk' | 'fla'."""
    T = h.shape[0]
    H, K = c.kda_heads, c.kda_head_dim
    conv_out = {}
    for name in ("q", "k", "v"):
        raw = h @ L[f"{name}_proj"].T  # [T, P]
        conv_out[name], st.conv[name] = causal_conv_silu(raw, L[f"{name}_conv1d"], st.conv[name])
    f = (h @ L["f_a_proj"].T) @ L["f_b_proj"].T  # [T, P], no activation between
    beta = torch.sigmoid(h @ L["b_proj"].T)  # [T, H]
    gz = (h @ L["g_proj"].T).reshape(T, H, K)  # output-gate logits
    q = l2norm(conv_out["q"].reshape(T, H, K)) * K ** -0.5
    k = l2norm(conv_out["k"].reshape(T, H, K))
    v = conv_out["v"].reshape(T, H, K)
    if mode == "fla" and fla.gate is not None:
        g = fla.gate(f.reshape(T, H, K), L["A_log"], L["dt_bias"], c.gate_lb).to(h.dtype)
    else:
        gate_in = torch.exp(L["A_log"])[None, :, None] * (f + L["dt_bias"]).reshape(T, H, K)
        g = c.gate_lb * torch.sigmoid(gate_in)  # [T, H, K] log-decay in [lb, 0)
    if mode == "recurrent":
        o = kda_recurrent(q, k, v, g, beta, st.S)
    elif mode == "chunk":
        o = kda_chunked(q, k, v, g, beta, st.S, chunk)
    else:
        o = fla.recurrent(q, k, v, g, beta, st.S)
    o = o * torch.rsqrt((o * o).mean(dim=-1, keepdim=True) + c.eps) * L["o_norm"] * torch.sigmoid(gz)
    return o.reshape(T, H * K) @ L["o_proj"].T  # [T, d]


# ----------------------------------------------------------------------------------------------------------------
# MLA, unabsorbed (§2.6 "Reference (unabsorbed) math")


@dataclass
class MlaCache:
    keys: torch.Tensor  # [N, Hm, nope+rope]
    values: torch.Tensor  # [N, Hm, v]


def mla_layer(c: Config, L: dict, h: torch.Tensor, cache: MlaCache) -> torch.Tensor:
    T, Hm = h.shape[0], c.mla_heads
    q = rmsnorm(h @ L["q_a_proj"].T, L["q_a_layernorm"], MLA_NORM_EPS) @ L["q_b_proj"].T
    q = q.reshape(T, Hm, c.nope + c.rope)  # [q_nope | q_rot], no RoPE
    kva = h @ L["kv_a_proj"].T  # [T, kv_lora + rope]
    latent = rmsnorm(kva[:, :c.kv_lora], L["kv_a_layernorm"], MLA_NORM_EPS)  # k_rot part is not normalised
    k_rot = kva[:, c.kv_lora:]  # [T, rope], shared by all heads
    kv = (latent @ L["kv_b_proj"].T).reshape(T, Hm, c.nope + c.v_dim)
    key = torch.cat([kv[:, :, :c.nope], k_rot.unsqueeze(1).expand(T, Hm, c.rope)], dim=-1)  # [T, Hm, nope+rope]
    n0 = cache.keys.shape[0]
    cache.keys = torch.cat([cache.keys, key])
    cache.values = torch.cat([cache.values, kv[:, :, c.nope:]])
    N = cache.keys.shape[0]
    scores = torch.einsum("thd,nhd->htn", q, cache.keys) * (c.nope + c.rope) ** -0.5  # [Hm, T, N]
    allowed = torch.arange(N)[None, :] <= (n0 + torch.arange(T))[:, None]  # causal over cache + window
    scores = scores.masked_fill(~allowed, -math.inf)
    o = torch.einsum("htn,nhv->thv", torch.softmax(scores, dim=-1), cache.values)  # [T, Hm, v]
    gate = torch.sigmoid(h @ L["g_proj"].T)  # [T, Hm*v], gate before o_proj
    return (o.reshape(T, Hm * c.v_dim) * gate) @ L["o_proj"].T


# ----------------------------------------------------------------------------------------------------------------
# FFNs (§2.7 dense, §2.8 latent MoE)


def dense_mlp(c: Config, L: dict, h: torch.Tensor) -> torch.Tensor:
    return situ(h @ L["gate"].T, h @ L["up"].T, c.situ_beta, c.situ_lbeta) @ L["down"].T


def latent_moe(c: Config, L: dict, h: torch.Tensor) -> torch.Tensor:
    T = h.shape[0]
    scores = torch.sigmoid(h @ L["router"].T)  # [T, E], full hidden
    choice = scores + L["router_bias"]  # bias for selection only
    idx = torch.sort(-choice, dim=-1, stable=True).indices[:, :c.top_k]  # ties -> lowest expert index
    wts = torch.gather(scores, 1, idx)  # unbiased scores [T, k]
    if c.renormalize:
        wts = wts / (wts.sum(dim=-1, keepdim=True) + 1e-20)
    wts = wts * c.rsf
    z = h @ L["latent_down"].T  # [T, latent]
    y = torch.zeros(T, c.latent, dtype=h.dtype)
    for t in range(T):
        for j in range(c.top_k):
            e = int(idx[t, j])
            a = L["w1"][e] @ z[t]
            u = L["w3"][e] @ z[t]
            y[t] += wts[t, j] * (L["w2"][e] @ situ(a, u, c.situ_beta, c.situ_lbeta))
    y = rmsnorm(y, L["routed_norm"], c.eps) @ L["latent_up"].T  # [T, d]
    if c.shared > 0:
        y = y + situ(h @ L["sh_gate"].T, h @ L["sh_up"].T, c.situ_beta, c.situ_lbeta) @ L["sh_down"].T
    return y


# ----------------------------------------------------------------------------------------------------------------
# The model (§2.1)


class SeqState:
    """Per-sequence state: KDA recurrent state + conv windows per KDA layer, MLA cache per MLA layer."""

    def __init__(self, c: Config, dtype):
        P = c.kda_heads * c.kda_head_dim
        self.layers = []
        for mixer, _ in c.layers:
            if mixer == "kda":
                self.layers.append(KdaState(
                    S=torch.zeros(c.kda_heads, c.kda_head_dim, c.kda_head_dim, dtype=dtype),
                    conv={n: torch.zeros(c.conv_kernel - 1, P, dtype=dtype) for n in "qkv"}))
            else:
                self.layers.append(MlaCache(keys=torch.zeros(0, c.mla_heads, c.nope + c.rope, dtype=dtype),
                                            values=torch.zeros(0, c.mla_heads, c.v_dim, dtype=dtype)))


def forward(c: Config, w: dict, tokens: list, st: SeqState, mode="recurrent", chunk=16, fla=None, trace=None):
    """Runs `tokens` (a window of T tokens) through the model with state `st`; returns logits [T, V].
    `trace`, when a list, receives per-layer dicts of [T, d] tensors (attn read, mixer out, ffn read, ffn out)."""
    x0 = w["embed"][torch.tensor(tokens, dtype=torch.long)]  # [T, d], no scaling
    bank, live = [], x0
    eps = c.eps
    for layer, (mixer, ffn) in enumerate(c.layers):
        L = w["layers"][layer]
        h_in = live if not bank else attn_res_read(bank + [live], L["self_attention_res_norm"],
                                                   L["self_attention_res_proj"], eps)
        h = rmsnorm(h_in, L["input_layernorm"], eps)
        if layer % c.block_size == 0:  # seal BEFORE the attention, restart the live sum
            bank.append(live)
            live = None
        if mixer == "kda":
            a = kda_layer(c, L, h, st.layers[layer], mode, chunk, fla)
        else:
            a = mla_layer(c, L, h, st.layers[layer])
        live = a if live is None else live + a
        f_in = attn_res_read(bank + [live], L["mlp_res_norm"], L["mlp_res_proj"], eps)
        hf = rmsnorm(f_in, L["post_attention_layernorm"], eps)
        f = dense_mlp(c, L, hf) if ffn == "dense" else latent_moe(c, L, hf)
        live = live + f
        if trace is not None:
            trace.append({"attn_read": h_in, "mixer": a, "ffn_read": f_in, "ffn": f, "live": live})
    h = attn_res_read(bank + [live], w["out_res_norm"], w["out_res_proj"], eps)
    if trace is not None:
        trace.append({"final_read": h})
    return rmsnorm(h, w["norm"], eps) @ w["lm_head"].T  # [T, V]


def run_token_by_token(c, w, tokens, dtype, trace=None, mode="recurrent", fla=None):
    st = SeqState(c, dtype)
    rows = []
    for tok in tokens:
        step = [] if trace is not None else None
        rows.append(forward(c, w, [tok], st, mode=mode, fla=fla, trace=step)[0])
        if trace is not None:
            trace.append(step)
    return torch.stack(rows)  # [T, V]


def trace_cat(per_token: list) -> list:
    """Token-by-token traces -> one trace with [T, d] tensors."""
    return [{key: torch.cat([tok[i][key] for tok in per_token]) for key in per_token[0][i]}
            for i in range(len(per_token[0]))]


# ----------------------------------------------------------------------------------------------------------------
# Self-checks


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def kda_kernel_selfcheck(dtype, chunk: int) -> tuple:
    """Chunked vs recurrent KDA on random inputs with a non-zero incoming state; returns (max |Δo|, max |ΔS|)."""
    gen = torch.Generator().manual_seed(1234)
    T, H, K, V = 41, 3, 8, 6
    q = l2norm(torch.randn(T, H, K, generator=gen, dtype=dtype)) * K ** -0.5
    k = l2norm(torch.randn(T, H, K, generator=gen, dtype=dtype))
    v = torch.randn(T, H, V, generator=gen, dtype=dtype)
    g = -5.0 * torch.sigmoid(torch.randn(T, H, K, generator=gen, dtype=dtype) * 2)
    beta = torch.sigmoid(torch.randn(T, H, generator=gen, dtype=dtype))
    s0 = torch.randn(H, K, V, generator=gen, dtype=dtype)
    s_rec, s_chk = s0.clone(), s0.clone()
    o_rec = kda_recurrent(q, k, v, g, beta, s_rec)
    o_chk = kda_chunked(q, k, v, g, beta, s_chk, chunk)
    return float((o_rec - o_chk).abs().max()), float((s_rec - s_chk).abs().max())


def tolerance(dtype) -> float:
    return 1e-10 if dtype == torch.float64 else 1e-3


def selfcheck_prompt(c, w, tokens, dtype, chunk, logits_ref, trace_ref) -> dict:
    """One window per prompt with chunked KDA + causal MLA vs the token-by-token run; raises on disagreement."""
    trace = []
    logits = forward(c, w, tokens, SeqState(c, dtype), mode="chunk", chunk=chunk, trace=trace)
    worst = {"logits": rel_diff(logits, logits_ref)}
    for layer, (a, b) in enumerate(zip(trace, trace_ref)):
        for key in a:
            worst[f"layer{layer}.{key}" if key != "final_read" else key] = rel_diff(a[key], b[key])
    name, value = max(worst.items(), key=lambda kv: kv[1])
    if value > tolerance(dtype):
        raise AssertionError(f"chunked/window forward disagrees with token-by-token at {name}: rel {value:.3e}")
    return {"logits": worst["logits"], "worst": name, "worst_rel": value}


class _TorchFloatIs64:
    """Stands in for the `torch` module inside a copy of fla's naive.py so that its `torch.float` casts mean
    float64: fla's own recurrence and chunk code, run without its float32 rounding."""

    float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@dataclass
class FlaKda:
    """fla-core's naive KDA functions, adapted to this file's [T,H,K] tensors; `gate` is None when our own
    gate is used."""

    naive: object
    gate: object

    def recurrent(self, q, k, v, g, beta, state):
        o, s = self.naive.naive_recurrent_kda(q[None], k[None], v[None], g[None], beta[None], scale=1.0,
                                              initial_state=state[None].clone(), output_final_state=True)
        state.copy_(s[0])
        return o[0].to(q.dtype)

    def chunk(self, q, k, v, g, beta, state, chunk):
        o, s = self.naive.naive_chunk_kda(q[None], k[None], v[None], g[None], beta[None], scale=1.0,
                                          initial_state=state[None].clone(), output_final_state=True,
                                          chunk_size=chunk)
        state.copy_(s[0])
        return o[0].to(q.dtype)


def load_fla(promote_to_float64: bool) -> FlaKda:
    """fla-core's `fla/ops/kda/naive.py` (naive_recurrent_kda, naive_chunk_kda) and, in its native float32 form,
    `naive_kda_lowerbound_gate` from `fla/ops/kda/gate.py`. Imports on a CPU (fla falls back from triton)."""
    import importlib.util
    try:
        from fla.ops.kda import naive
        from fla.ops.kda.gate import naive_kda_lowerbound_gate
    except ImportError as e:
        raise CheckpointError(f"fla-core cannot be imported ({e}); pip install fla-core einops") from e
    if not promote_to_float64:
        gate = lambda f, a_log, dt_bias, lb: naive_kda_lowerbound_gate(f, a_log, dt_bias, lb)  # noqa: E731
        return FlaKda(naive=naive, gate=gate)
    spec = importlib.util.spec_from_file_location("fla_kda_naive_f64", naive.__file__)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    copy.torch = _TorchFloatIs64()
    return FlaKda(naive=copy, gate=None)


def fla_kernel_check(fla: FlaKda, dtype, chunk: int) -> dict:
    """fla's naive recurrent and chunk KDA vs this file's recurrence on random inputs with an initial state."""
    gen = torch.Generator().manual_seed(99)
    T, H, K, V = 3 * chunk, 3, 8, 6
    q = l2norm(torch.randn(T, H, K, generator=gen, dtype=dtype)) * K ** -0.5
    k = l2norm(torch.randn(T, H, K, generator=gen, dtype=dtype))
    v = torch.randn(T, H, V, generator=gen, dtype=dtype)
    g = -5.0 * torch.sigmoid(torch.randn(T, H, K, generator=gen, dtype=dtype) * 2)
    beta = torch.sigmoid(torch.randn(T, H, generator=gen, dtype=dtype))
    s0 = torch.randn(H, K, V, generator=gen, dtype=dtype)
    s_ref = s0.clone()
    o_ref = kda_recurrent(q, k, v, g, beta, s_ref)
    res = {}
    for name, fn in (("naive_recurrent_kda", fla.recurrent), ("naive_chunk_kda", fla.chunk)):
        s = s0.clone()
        o = fn(q, k, v, g, beta, s, chunk) if name == "naive_chunk_kda" else fn(q, k, v, g, beta, s)
        res[name] = (float((o - o_ref).abs().max()), float((s.to(dtype) - s_ref).abs().max()))
    return res


# ----------------------------------------------------------------------------------------------------------------
# Prompts, golden file, stats


def standard_prompts() -> list:
    import random
    rng = random.Random(PROMPT_SEED)
    prompts = [[rng.randrange(0, 100000) for _ in range(n)] for n in PROMPT_LENGTHS]
    for pos, tok in SPECIAL_PROMPT.items():
        prompts[2][pos] = tok
    return prompts


def position_record(row: torch.Tensor, probe_ids: list) -> dict:
    order = torch.sort(-row, stable=True).indices[:8]  # descending, ties -> lowest id
    return {"top": [[int(i), float(row[i])] for i in order],
            "logsumexp": float(torch.logsumexp(row, dim=0)),
            "probe": [float(row[i]) for i in probe_ids]}


def entropy(row: torch.Tensor) -> float:
    logp = torch.log_softmax(row.to(torch.float64), dim=0)
    return float(-(logp.exp() * logp).sum())


def rms(x: torch.Tensor) -> float:
    return float(torch.sqrt((x.to(torch.float64) ** 2).mean()))


def print_stats(c: Config, prompts: list, logits: list, traces: list):
    print(f"entropy (nats) of the next-token distribution at the last position (uniform = {math.log(c.vocab):.3f}):")
    for toks, lg in zip(prompts, logits):
        print(f"  prompt len {len(toks):3d}: {entropy(lg[-1]):.4f}")
    print("RMS over all positions of all prompts (attn_read = pre-attention AttnRes read, mixer = KDA/MLA out, "
          "ffn_read = pre-FFN read, ffn = FFN out, live = block residual after the layer):")
    keys = ["attn_read", "mixer", "ffn_read", "ffn", "live"]
    print("  layer kind      " + "".join(f"{k:>11}" for k in keys))
    for layer, (mixer, ffn) in enumerate(c.layers):
        vals = [rms(torch.cat([tr[layer][k] for tr in traces])) for k in keys]
        print(f"  {layer:5d} {mixer}+{ffn:5s} " + "".join(f"{v:11.4f}" for v in vals))
    print(f"  final read RMS {rms(torch.cat([tr[-1]['final_read'] for tr in traces])):.4f}; "
          f"embedding rows RMS {rms(torch.cat([tr[0]['attn_read'] for tr in traces])):.4f}")


# ----------------------------------------------------------------------------------------------------------------
# A small random checkpoint in the real layout (for development without sparkd's writer)


def make_random(folder: Path, seed: int, vocab: int):
    from safetensors.torch import save_file
    gen = torch.Generator().manual_seed(seed)
    text = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": vocab,
        "hidden_size": 128, "num_hidden_layers": 9, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {"num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                               "use_full_rank_gate": True, "kda_layers": [1, 2, 3, 5, 6, 7],
                               "full_attn_layers": [4, 8, 9]},
        "attn_res_block_size": 4, "intermediate_size": 512, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_experts": 16, "num_experts_per_token": 4, "num_shared_experts": 2, "moe_intermediate_size": 64,
        "routed_expert_hidden_size": 64, "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                                "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float",
                                                                          "group_size": 32}}}},
    }
    c = Config.from_json({"model_type": "kimi_k3", "text_config": text})
    d, bf = c.d, torch.bfloat16
    t = {}

    def lin(name, out_dim, in_dim, gain=1.0):
        t[name] = (torch.randn(out_dim, in_dim, generator=gen) * gain / math.sqrt(in_dim)).to(bf)

    def vec(name, n, mean=1.0, std=0.1, dtype=bf):
        t[name] = (mean + std * torch.randn(n, generator=gen)).to(dtype)

    t["model.embed_tokens.weight"] = torch.randn(vocab, d, generator=gen).to(bf)
    P, H, K = c.kda_heads * c.kda_head_dim, c.kda_heads, c.kda_head_dim
    for layer, (mixer, ffn) in enumerate(c.layers):
        p = f"model.layers.{layer}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            vec(p + n + ".weight", d)
        for n in ("self_attention_res_proj", "mlp_res_proj"):
            t[p + n + ".weight"] = (torch.randn(1, d, generator=gen) * 0.1).to(bf)
        if mixer == "kda":
            for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
                lin(p + f"self_attn.{n}.weight", P, d)
            lin(p + "self_attn.o_proj.weight", d, P)
            lin(p + "self_attn.f_a_proj.weight", K, d)
            lin(p + "self_attn.f_b_proj.weight", P, K)
            lin(p + "self_attn.b_proj.weight", H, d)
            for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                t[p + f"self_attn.{n}.weight"] = torch.randn(P, 1, c.conv_kernel, generator=gen) * 0.5
            t[p + "self_attn.A_log"] = torch.log(torch.rand(K, generator=gen) * 15 + 1)  # longer than H on purpose
            t[p + "self_attn.dt_bias"] = torch.randn(P, generator=gen) * 0.5
            vec(p + "self_attn.o_norm.weight", K, dtype=torch.float32)
        else:
            Hm = c.mla_heads
            lin(p + "self_attn.q_a_proj.weight", c.q_lora, d)
            vec(p + "self_attn.q_a_layernorm.weight", c.q_lora)
            lin(p + "self_attn.q_b_proj.weight", Hm * (c.nope + c.rope), c.q_lora)
            lin(p + "self_attn.kv_a_proj_with_mqa.weight", c.kv_lora + c.rope, d)
            vec(p + "self_attn.kv_a_layernorm.weight", c.kv_lora)
            lin(p + "self_attn.kv_b_proj.weight", Hm * (c.nope + c.v_dim), c.kv_lora)
            lin(p + "self_attn.g_proj.weight", Hm * c.v_dim, d)
            lin(p + "self_attn.o_proj.weight", d, Hm * c.v_dim)
        if ffn == "dense":
            lin(p + "mlp.gate_proj.weight", c.dense_dim, d, 2.0)
            lin(p + "mlp.up_proj.weight", c.dense_dim, d, 2.0)
            lin(p + "mlp.down_proj.weight", d, c.dense_dim)
        else:
            m = p + "block_sparse_moe."
            lin(m + "gate.weight", c.experts, d)
            t[m + "gate.e_score_correction_bias"] = torch.randn(c.experts, generator=gen) * 0.01
            lin(m + "routed_expert_down_proj.weight", c.latent, d)
            lin(m + "routed_expert_up_proj.weight", d, c.latent)
            vec(m + "routed_expert_norm.weight", c.latent)
            s = c.shared * c.expert_dim
            lin(m + "shared_experts.gate_proj.weight", s, d, 2.0)
            lin(m + "shared_experts.up_proj.weight", s, d, 2.0)
            lin(m + "shared_experts.down_proj.weight", d, s)
            for e in range(c.experts):
                for proj, (o, i) in (("w1", (c.expert_dim, c.latent)), ("w3", (c.expert_dim, c.latent)),
                                     ("w2", (c.latent, c.expert_dim))):
                    base = f"{m}experts.{e}.{proj}"
                    t[base + ".weight_packed"] = torch.randint(0, 256, (o, i // 2), generator=gen, dtype=torch.uint8)
                    t[base + ".weight_scale"] = torch.randint(120, 128, (o, i // 32), generator=gen, dtype=torch.uint8)
    t["model.output_attn_res_norm.weight"] = torch.ones(d, dtype=bf)
    t["model.output_attn_res_proj.weight"] = (torch.randn(1, d, generator=gen) * 0.1).to(bf)
    vec("model.norm.weight", d)
    lin("lm_head.weight", vocab, d)
    folder.mkdir(parents=True, exist_ok=True)
    names = list(t)
    half = len(names) // 2
    weight_map = {}
    for k, part in enumerate((names[:half], names[half:])):
        shard = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({TEXT_PREFIX + n: t[n].contiguous() for n in part}, str(folder / shard))
        weight_map.update({TEXT_PREFIX + n: shard for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": text}, indent=1))


# ----------------------------------------------------------------------------------------------------------------
# CLI


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", type=Path, help="checkpoint folder in the real K3 layout")
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--chunk", type=int, default=16, help="chunk size of the chunked-KDA self-check")
    ap.add_argument("--tokens", help="comma-separated token ids to run instead of the standard prompts")
    ap.add_argument("--golden", type=Path, help="write the golden-logits JSON here")
    ap.add_argument("--golden-config", default="k3-tiny", help="config name recorded in the golden file")
    ap.add_argument("--golden-seed", type=int, default=7, help="synthetic seed recorded in the golden file")
    ap.add_argument("--stats", action="store_true", help="print last-position entropies and per-layer RMS")
    ap.add_argument("--check-fla", action="store_true",
                    help="cross-check the KDA with fla-core's naive reference (native float32 and promoted to float64)")
    ap.add_argument("--make-random", action="store_true", help="write a random k3-tiny-shaped checkpoint and exit")
    ap.add_argument("--seed", type=int, default=0, help="seed for --make-random")
    ap.add_argument("--vocab", type=int, default=163840, help="vocabulary size for --make-random")
    args = ap.parse_args(argv)
    if args.make_random:
        make_random(args.checkpoint, args.seed, args.vocab)
        print(f"wrote a random checkpoint to {args.checkpoint}")
        return 0
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    try:
        ck = Checkpoint(args.checkpoint, dtype)
        c = ck.cfg
        w = load_weights(ck)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = [[int(x) for x in args.tokens.split(",")]] if args.tokens else standard_prompts()
    for p in prompts:
        bad = [x for x in p if not 0 <= x < c.vocab]
        if bad:
            print(f"error: token ids {bad} are outside the vocabulary [0, {c.vocab})", file=sys.stderr)
            return 2

    o_err, s_err = kda_kernel_selfcheck(dtype, args.chunk)
    print(f"self-check KDA kernel (T=41, chunk {args.chunk}, non-zero initial state): "
          f"max|Δo| {o_err:.3e}, max|ΔS| {s_err:.3e}")
    if max(o_err, s_err) > tolerance(dtype):
        raise AssertionError("chunked KDA disagrees with the recurrence")

    logits, traces = [], []
    for p in prompts:
        per_token = []
        lg = run_token_by_token(c, w, p, dtype, trace=per_token)
        tr = trace_cat(per_token)
        res = selfcheck_prompt(c, w, p, dtype, args.chunk, lg, tr)
        print(f"self-check prompt len {len(p):3d}: window/chunked vs token-by-token recurrent: logits rel "
              f"{res['logits']:.3e}; worst {res['worst']} rel {res['worst_rel']:.3e}")
        logits.append(lg)
        traces.append(tr)

    if args.check_fla:
        try:
            variants = [("fla native (its float32 gate + recurrence)", load_fla(False)),
                        ("fla promoted to float64 (our gate, its recurrence)", load_fla(True))]
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for label, fla in variants:
            for name, (do, ds) in fla_kernel_check(fla, dtype, args.chunk).items():
                print(f"{label}: kernel {name} vs ours (T={3 * args.chunk}, chunk {args.chunk}, initial state): "
                      f"max|Δo| {do:.3e}, max|ΔS| {ds:.3e}")
            for p, lg in zip(prompts, logits):
                lf = run_token_by_token(c, w, p, dtype, mode="fla", fla=fla)
                print(f"{label}: whole model, prompt len {len(p):3d}: logits max|Δ| "
                      f"{float((lf - lg).abs().max()):.3e} (rel {rel_diff(lf, lg):.3e})")

    if args.stats:
        print_stats(c, prompts, logits, traces)

    if args.golden:
        probes = [i for i in PROBE_IDS if i < c.vocab]
        golden = {"config": args.golden_config, "seed": args.golden_seed, "dtype": args.dtype,
                  "generator": "kernels/reference/k3_reference.py", "probe_ids": probes,
                  "prompts": [{"tokens": p, "positions": [position_record(row, probes) for row in lg]}
                              for p, lg in zip(prompts, logits)]}
        args.golden.parent.mkdir(parents=True, exist_ok=True)
        args.golden.write_text(json.dumps(golden, indent=None, separators=(",", ":")) + "\n")
        print(f"wrote {args.golden} ({args.golden.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
