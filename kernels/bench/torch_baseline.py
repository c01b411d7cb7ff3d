"""Plain-PyTorch baseline of one K3 decode step, layer type by layer type, at the shapes of `sparkd bench`.

What it times (bf16 weights, cuBLAS GEMMs through torch, fp32 KDA state), per batch size, eager and
CUDA-graphed, with CUDA events (median of --iters after warm-up):
  - kda:   q/k/v/g/f_a/f_b/b projections, short conv (kernel 4, with the carried window), SiLU, the
           KDA recurrence for one token (fla-core's fused_recurrent_kda when it imports and runs, else
           a plain torch recurrence), per-head RMSNorm, sigmoid gate, o_proj;
  - mla:   absorbed MLA decode over a latent cache of --prompt-len entries (q_a, norm, q_b, kv_a,
           norm, scores against the latents, softmax, value up-projection, sigmoid gate, o_proj);
  - dense: the SiTU-shaped MLP (gate, up, down) at the dense width;
  - moe:   router (sigmoid + bias, top-k), the latent down projection, routed experts in bf16 (the
           baseline has no MXFP4 GEMM, so it reads 4x the expert bytes sparkd reads) through
           torch._grouped_mm over expert-sorted tokens, combine, norm, latent up projection, shared
           experts;
  - head:  final RMSNorm and lm_head.
A whole-step estimate sums each type's time times its layer count in the config. The numbers are a
baseline for speed, not a numerical reference (the math follows k3-architecture.md closely enough
that every byte and FLOP of the real layer is spent, no more).

Usage: python3 torch_baseline.py --config k3-mini --batch 1,2,4,8,16,32,64 --out baseline.json
"""

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

K3 = dict(vocab=163840, d=7168, kda_heads=96, dk=128, conv=4, mla_heads=96, q_lora=1536, kv_lora=512,
          nope=128, rope=64, v_head=128, experts=896, top_k=16, shared=2, expert_dim=3072, latent=3584,
          dense=33792)
# (config, experts, layer schedule as (mixer, ffn) per layer), as kernels/src/config.rs presets.
CONFIGS = {
    "k3-mini": (64, [("mla" if l in (0, 4) else "kda", "dense" if l == 0 else "moe") for l in range(8)]),
    "k3-mini-wide": (896, [("mla" if l == 3 else "kda", "dense" if l == 0 else "moe") for l in range(4)]),
}


def w(*shape, dev="cuda"):
    return (torch.randn(*shape, device=dev, dtype=torch.float32) / math.sqrt(shape[-1])).to(torch.bfloat16)


def rms(x, weight, eps=1e-5):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(torch.bfloat16)


def situ(g, u, beta=4.0):
    return (F.silu(g.float()) * u.float()).to(torch.bfloat16)


class Kda:
    def __init__(self, c, batch, use_fla):
        d, h, dk = c["d"], c["kda_heads"], c["dk"]
        p = h * dk
        self.h, self.dk, self.p = h, dk, p
        self.wq, self.wk, self.wv, self.wg, self.wo = w(p, d), w(p, d), w(p, d), w(p, d), w(d, p)
        self.wfa, self.wfb, self.wb = w(dk, d), w(p, dk), w(h, d)
        self.conv = [torch.randn(p, c["conv"], device="cuda") * 0.5 for _ in range(3)]
        self.win = [torch.zeros(batch, c["conv"] - 1, p, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        self.a = torch.rand(h, device="cuda") * 15 + 1
        self.dt_bias = torch.randn(p, device="cuda") * 0.1
        self.o_norm = torch.ones(dk, device="cuda")
        self.state = torch.zeros(batch, h, dk, dk, device="cuda", dtype=torch.float32)
        self.fla = None
        if use_fla:
            try:
                from fla.ops.kda import fused_recurrent_kda
                self.fla = fused_recurrent_kda
            except Exception as e:  # noqa: BLE001 - reported, then the torch recurrence is used
                print(f"fla-core unavailable ({type(e).__name__}: {e}); plain torch recurrence", file=sys.stderr)

    def conv_step(self, x, i):
        # x [B, P]; window [B, K-1, P]; depthwise conv over the last K inputs, then SiLU.
        full = torch.cat([self.win[i], x[:, None, :]], dim=1)  # [B, K, P]
        self.win[i].copy_(full[:, 1:, :])
        return F.silu((full.float() * self.conv[i].t()[None]).sum(1)).to(torch.bfloat16)

    def __call__(self, x):
        b = x.shape[0]
        q, k, v = (self.conv_step(x @ wt.t(), i) for i, wt in enumerate((self.wq, self.wk, self.wv)))
        f = (x @ self.wfa.t()) @ self.wfb.t()
        beta = torch.sigmoid((x @ self.wb.t()).float())  # [B, H]
        gate = x @ self.wg.t()
        q = F.normalize(q.float().view(b, self.h, self.dk), dim=-1)
        k = F.normalize(k.float().view(b, self.h, self.dk), dim=-1)
        v = v.float().view(b, self.h, self.dk)
        g = (-self.a[:, None] * F.softplus(f.float().view(b, self.h, self.dk) + self.dt_bias.view(self.h, self.dk)))
        g = g.clamp(min=-5.0)
        if self.fla is not None:
            o, _ = self.fla(q[:, None].contiguous(), k[:, None].contiguous(), v[:, None].contiguous(),
                            g[:, None].contiguous(), beta[:, None].contiguous(), scale=1.0 / math.sqrt(self.dk),
                            initial_state=self.state, output_final_state=True, inplace_final_state=True)
            o = o[:, 0].float()
        else:
            s = self.state * g.exp()[..., None]  # [B, H, dk, dk]
            kv = torch.einsum("bhk,bhkv->bhv", k, s)
            s = s + torch.einsum("bhk,bhv->bhkv", k, beta[..., None] * (v - kv))
            self.state.copy_(s)
            o = torch.einsum("bhk,bhkv->bhv", q / math.sqrt(self.dk), s)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * self.o_norm
        o = (o.reshape(b, self.p) * torch.sigmoid(gate.float())).to(torch.bfloat16)
        return o @ self.wo.t()


class Mla:
    def __init__(self, c, batch, cache_len):
        d, h = c["d"], c["mla_heads"]
        self.h, self.r, self.rope, self.nope, self.vh = h, c["kv_lora"], c["rope"], c["nope"], c["v_head"]
        self.qd = self.nope + self.rope
        self.wqa, self.wqb = w(c["q_lora"], d), w(h * self.qd, c["q_lora"])
        self.wkva = w(self.r + self.rope, d)
        self.wkvb = w(h * (self.nope + self.vh), self.r)
        self.wg, self.wo = w(h * self.vh, d), w(d, h * self.vh)
        self.n_q, self.n_kv = torch.ones(c["q_lora"], device="cuda"), torch.ones(self.r, device="cuda")
        self.cache = torch.randn(batch, cache_len + 1, self.r + self.rope, device="cuda").to(torch.bfloat16)
        kvb = self.wkvb.view(h, self.nope + self.vh, self.r)
        self.w_uk, self.w_uv = kvb[:, : self.nope], kvb[:, self.nope:]  # [H, nope, r], [H, v, r]

    def __call__(self, x):
        b = x.shape[0]
        q = (rms(x @ self.wqa.t(), self.n_q) @ self.wqb.t()).view(b, self.h, self.qd)
        kva = x @ self.wkva.t()
        c_new = torch.cat([rms(kva[:, : self.r], self.n_kv), kva[:, self.r:]], -1)
        self.cache[:, -1].copy_(c_new)
        q_lat = torch.einsum("bhn,hnr->bhr", q[..., : self.nope].float(), self.w_uk.float())  # absorbed
        lat = self.cache.float()  # [B, L, r + rope]
        scores = torch.einsum("bhr,blr->bhl", q_lat, lat[..., : self.r])
        scores = scores + torch.einsum("bhe,ble->bhl", q[..., self.nope:].float(), lat[..., self.r:])
        p = torch.softmax(scores / math.sqrt(self.qd), -1)
        o_lat = torch.einsum("bhl,blr->bhr", p, lat[..., : self.r])
        o = torch.einsum("bhr,hvr->bhv", o_lat, self.w_uv.float()).reshape(b, -1)
        o = (o * torch.sigmoid((x @ self.wg.t()).float())).to(torch.bfloat16)
        return o @ self.wo.t()


class Dense:
    def __init__(self, c, width):
        d = c["d"]
        self.wg, self.wu, self.wd = w(width, d), w(width, d), w(d, width)

    def __call__(self, x):
        return situ(x @ self.wg.t(), x @ self.wu.t()) @ self.wd.t()


class Moe:
    def __init__(self, c, experts):
        d, lat, ed = c["d"], c["latent"], c["expert_dim"]
        self.e, self.k = experts, c["top_k"]
        self.router, self.bias = w(experts, d), torch.randn(experts, device="cuda") * 0.01
        self.down, self.up, self.norm = w(lat, d), w(d, lat), torch.ones(lat, device="cuda")
        # Experts as [E, in, out] for grouped GEMMs: w13 gate|up fused, w2 down.
        self.w13 = w(experts, 2 * ed, lat).transpose(1, 2)  # [E, latent, 2*ed] view of [E, out, in]
        self.w2 = w(experts, lat, ed).transpose(1, 2)  # [E, ed, latent]
        self.shared = Dense(c, c["shared"] * ed)
        self.ed = ed

    def __call__(self, x):
        b = x.shape[0]
        logits = (x @ self.router.t()).float()
        scores = torch.sigmoid(logits)
        _, idx = torch.topk(scores + self.bias, self.k, dim=-1)  # [B, k]
        wts = scores.gather(-1, idx)
        wts = wts / wts.sum(-1, keepdim=True)
        z = x @ self.down.t()  # [B, latent]
        flat = idx.reshape(-1)
        order = torch.argsort(flat)
        tok = (order // self.k)
        # scatter_add, not bincount: bincount reads its max back to the host, which graph capture forbids.
        counts = torch.zeros(self.e, device="cuda", dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        zs = z[tok]  # [B*k, latent], expert-sorted
        h = torch._grouped_mm(zs, self.w13, offs=offs)  # [B*k, 2*ed]
        a = situ(h[:, : self.ed], h[:, self.ed:])
        y = torch._grouped_mm(a, self.w2, offs=offs).float()  # [B*k, latent]
        y = y * wts.reshape(-1)[order][:, None]
        out = torch.zeros(b, z.shape[1], device="cuda", dtype=torch.float32).index_add_(0, tok, y)
        routed = rms(out.to(torch.bfloat16), self.norm) @ self.up.t()
        return routed + self.shared(x)


class Head:
    def __init__(self, c):
        self.norm, self.w = torch.ones(c["d"], device="cuda"), w(c["vocab"], c["d"])

    def __call__(self, x):
        return rms(x, self.norm) @ self.w.t()


def time_fn(fn, x, iters, graphed):
    """Median ms of fn(x) with CUDA events; graphed: capture once, time replays."""
    if graphed:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(x)
        run = g.replay
    else:
        for _ in range(3):
            fn(x)
        run = lambda: fn(x)  # noqa: E731
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth():
    n = 2 << 30
    a, b = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    b.copy_(a)
    ms = time_fn(lambda _: b.copy_(a), None, 10, False)
    del a, b
    return 2 * n / (ms * 1e-3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="k3-mini", choices=sorted(CONFIGS))
    ap.add_argument("--batch", default="1,2,4,8,16,32,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    c = dict(K3)
    experts, layers = CONFIGS[args.config]
    counts = {t: sum(1 for m, f in layers for x in (m, f) if x == t) for t in ("kda", "mla", "dense", "moe")}
    counts["head"] = 1
    report = dict(config=args.config, device=torch.cuda.get_device_name(), torch=torch.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M:%S"), copy_bytes_per_second=copy_bandwidth(),
                  layer_counts=counts, batches=[])
    moe = Moe(c, experts)
    dense, head = Dense(c, c["dense"]), Head(c)
    for batch in [int(b) for b in args.batch.split(",")]:
        kda, mla = Kda(c, batch, not args.no_fla), Mla(c, batch, args.prompt_len)
        x = (torch.randn(batch, c["d"], device="cuda")).to(torch.bfloat16)
        row = dict(batch=batch, kda_backend="fla-core fused_recurrent_kda" if kda.fla else "torch", types={})
        for name, fn in (("kda", kda), ("mla", mla), ("dense", dense), ("moe", moe), ("head", head)):
            entry = {}
            for mode in ("eager", "graph"):
                try:
                    entry[mode] = time_fn(fn, x, args.iters, mode == "graph")
                except Exception as e:  # noqa: BLE001 - a failed mode is recorded, not fatal
                    entry[mode] = None
                    entry[f"{mode}_error"] = f"{type(e).__name__}: {e}"[:300]
            row["types"][name] = entry
        for mode in ("eager", "graph"):
            ts = [row["types"][t].get(mode) for t in counts]
            row[f"step_ms_{mode}"] = (sum(row["types"][t][mode] * n for t, n in counts.items())
                                      if all(v is not None for v in ts) else None)
        report["batches"].append(row)
        del kda, mla
        torch.cuda.empty_cache()
        print(f"batch {batch:>3}: " + ", ".join(
            f"{t} {e.get('eager') or float('nan'):.3f}/{e.get('graph') or float('nan'):.3f}"
            for t, e in row["types"].items()) + f"  step eager {row['step_ms_eager']} graph {row['step_ms_graph']}",
            flush=True)
    text = json.dumps(report, indent=1)
    if args.out:
        open(args.out, "w").write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
