#!/usr/bin/env python3
"""Trains k3-tiny (the target) and its DSpark drafter on the Python-stdlib corpus and writes the artifact
`k3-tiny-trained.safetensors.xz` that sparkd's kernels/src/trained.rs reads (contract: issue 37).

Pipeline: --selfcheck (CPU, float64) → target training → held-out evaluation (float and served) → drafter
training against the frozen served target → drafter evaluation → export (+ summary.json, train_log.jsonl,
loss_curves.png).

Invariants:
- The model math is k3_reference.py's (k3_train_model.py batches it; train_dspark.py holds the drafter,
  which is sparkd's Rust drafter, kernels/src/dspark/model.rs). `--selfcheck` proves, in float64 on the CPU:
  (a) the batched training forward equals k3_reference.forward(mode="chunk") on each row of a batch, logits
  and drafter taps; (b) the branch rollouts (chunk-boundary KDA states, conv windows, MLA prefix masks)
  equal plain forwards of the same token sequences; (c) the export path (bf16 rounding, MXFP4 packing, the
  compact vocabulary, xz) read back, expanded per the contract and loaded by k3_reference.load_weights,
  equals the trainer's "served" forward; (d) the drafter's batched forward equals a loop-by-loop
  transcription of model.rs run on the tensors read back from the artifact. Every check's relative
  difference must be <= 1e-9; a failure exits non-zero.
- Vocabulary: compact tying (contract): `kept_ids` = every id of train.u32 ∪ held.u32 ∪ {bos, eos, pad,
  the drafter's mask id}; vocabulary-sized tensors have n_kept + 1 rows, the last shared by every other id;
  the loss is the full-vocabulary softmax = compact softmax with log(V - n_kept) added to the shared logit.
- "Served" = every bf16-class tensor rounded to bf16 (nearest even), f32-class kept f32, routed experts
  quantised to MXFP4 (E2M1 codes, E8M0 scale per 32 inputs) and read back exactly as
  k3_reference.dequant_mxfp4 reads them; those are the numbers the artifact holds.
- Determinism: seed 37 drives every initialisation and every sampled window. Training length is a time
  budget unless --max-steps is given: the step count is fixed once the step time is measured
  (k3_train_model.Schedule) and the cosine schedule follows that count, so two runs on one machine differ
  only in that count (and in GPU non-determinism).
- The target's routing bias `e_score_correction_bias` is trained aux-loss-free: after every step,
  bias += 1e-3 · sign(mean load − expert load), per MoE layer, without gradient.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k3_reference as ref  # noqa: E402
import k3_train_model as tm  # noqa: E402
import train_dspark as ds  # noqa: E402

ARTIFACT = "k3-tiny-trained.safetensors.xz"
FORMAT = "sparkd-trained-v1"
DEFAULT_CONFIG = Path(__file__).with_name("k3-tiny.config.json")
TOL = 1e-9


# ----------------------------------------------------------------------------------------------------------------
# Config, corpus, vocabulary


def load_config(path: Path) -> tuple:
    root = json.loads(Path(path).read_text())
    return ref.Config.from_json(root), root


def read_u32(folder: Path, name: str) -> np.ndarray:
    """`name` (little-endian u32), or `name.xz` (the same bytes xz-compressed, as the device bench carries them)."""
    if (folder / name).is_file():
        return np.fromfile(folder / name, dtype="<u4").astype(np.int64)
    return np.frombuffer(lzma.decompress((folder / (name + ".xz")).read_bytes()), dtype="<u4").astype(np.int64)


def load_corpus(folder: Path, mask_id: int):
    meta = json.loads((folder / "corpus.json").read_text())
    train, held = read_u32(folder, "train.u32"), read_u32(folder, "held.u32")
    for name, arr in (("train_tokens", train), ("held_tokens", held)):
        if name in meta and meta[name] != arr.size:
            raise ValueError(f"corpus.json says {name} = {meta[name]}, the file holds {arr.size}")
    V = int(meta.get("vocab_size", 163840))
    kept = np.unique(np.concatenate([train, held, np.array([tm.BOS, tm.EOS, tm.PAD, mask_id])]))
    if kept.max() >= V:
        raise ValueError(f"token id {kept.max()} outside the vocabulary {V}")
    return meta, torch.from_numpy(train), torch.from_numpy(held), torch.from_numpy(kept)


def spread(rows: torch.Tensor, k: int) -> torch.Tensor:
    """k rows evenly spaced over `rows` (the periodic evaluations' sample of the held-out set)."""
    if rows.shape[0] <= k:
        return rows
    return rows[torch.linspace(0, rows.shape[0] - 1, k).round().long().to(rows.device)]


def windows(tokens: torch.Tensor, T: int) -> torch.Tensor:
    """Non-overlapping rows [N, T+1] (inputs t[:-1], targets t[1:]); the tail shorter than T+1 is dropped."""
    n = (tokens.numel() - 1) // T
    idx = torch.arange(n)[:, None] * T + torch.arange(T + 1)[None, :]
    return tokens[idx]


# ----------------------------------------------------------------------------------------------------------------
# Target training


def autocast(dev, enabled: bool):
    if dev.type == "cuda" and enabled:
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return torch.autocast(device_type=dev.type, enabled=False)


def lm_loss(vocab, raw, y, reduction="mean"):
    """raw [.., n+1] compact logits, y [..] compact targets -> full-vocabulary cross-entropy."""
    lg = vocab.with_offset(raw.float())
    return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1), reduction=reduction)


@torch.no_grad()
def evaluate_target(c, W, vocab, rows, batch, chunk, dev, use_autocast=False, quant=False) -> dict:
    tot, n = 0.0, 0
    for s in range(0, rows.shape[0], batch):
        r = rows[s:s + batch].to(dev)
        with autocast(dev, use_autocast):
            raw = tm.forward(c, W, r[:, :-1], chunk=chunk, quant=quant)
        tot += float(lm_loss(vocab, raw, r[:, 1:], reduction="sum"))
        n += r[:, 1:].numel()
    loss = tot / max(n, 1)
    return {"loss": loss, "ppl": math.exp(loss), "tokens": n}


def train_target(c, specs, W, vocab, train_c, held_rows, args, log) -> dict:
    """AdamW on every parameter, cosine LR with warmup (Schedule), bf16 autocast on CUDA, grad clipping,
    aux-loss-free routing-bias updates, MXFP4 fake-quant of the experts over the last qat_frac of the steps."""
    dev = train_c.device
    T, B = args.seq_len, args.batch
    params = [W[s.name] for s in specs if not s.buffer]
    decay = [W[s.name] for s in specs if s.decay and not s.buffer]
    rest = [W[s.name] for s in specs if not s.decay and not s.buffer]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    moe_layers = [i for i, (_, f) in enumerate(c.layers) if f == "moe"]
    gen = torch.Generator().manual_seed(args.seed)
    n = train_c.numel()
    eval_rows = spread(held_rows, args.eval_rows)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sched = tm.Schedule(args.target_seconds, args.max_steps, args.lr, args.warmup, sync)
    t_ev = time.time()
    held0 = evaluate_target(c, W, vocab, eval_rows, args.batch, args.chunk, dev, not args.no_autocast)["loss"]
    eval_cost = time.time() - t_ev
    log({"phase": "target", "step": 0, "seconds": 0.0, "lr": 0.0, "train_loss": None, "held_loss": held0})
    sched.t0 = time.time()
    step, last = 0, {}
    while not sched.done(step):
        lr = sched.lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        quant = sched.planned is not None and sched.frac(step) >= 1.0 - args.qat_frac
        off = torch.randint(0, n - T - 1, (B,), generator=gen)
        rows = train_c[off[:, None].to(dev) + torch.arange(T + 1, device=dev)[None, :]]  # [B, T+1]
        routing = {}
        with autocast(dev, not args.no_autocast):
            raw = tm.forward(c, W, rows[:, :-1], chunk=args.chunk, quant=quant, routing=routing)  # [B,T,n+1]
        loss = lm_loss(vocab, raw, rows[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        with torch.no_grad():  # aux-loss-free balancing of the routing bias
            for layer in moe_layers:
                load = torch.bincount(routing[layer].reshape(-1), minlength=c.experts).float()
                bias = W[f"model.layers.{layer}.block_sparse_moe.gate.e_score_correction_bias"]
                bias += 1e-3 * torch.sign(load.mean() - load).to(bias.dtype)
        step += 1
        per = sched.after_step(step, eval_cost / (args.log_every * args.eval_every))
        if per is not None:
            print(f"target: {per * 1e3:.1f} ms/step, planning {sched.planned} steps in {args.target_seconds:.0f} s "
                  f"(one periodic evaluation {eval_cost:.2f} s)", flush=True)
        if step % args.log_every == 0 or step == sched.planned:
            rec = {"phase": "target", "step": step, "seconds": round(sched.elapsed(), 2), "lr": lr,
                   "train_loss": float(loss.detach()), "grad_norm": float(gnorm), "qat": quant}
            if step % (args.log_every * args.eval_every) == 0 or step == sched.planned:
                rec["held_loss"] = evaluate_target(c, W, vocab, eval_rows, args.batch, args.chunk, dev,
                                                   not args.no_autocast)["loss"]
            log(rec)
            last = rec
    return {"steps": step, "seconds": round(sched.elapsed(), 1), "ms_per_step": round(1e3 * (sched.per_step or 0), 1),
            "tokens_seen": step * B * T, "epochs": round(step * B * T / n, 3),
            "final_train_loss": last.get("train_loss"), "qat_from_step": int(round(step * (1 - args.qat_frac)))}


# ----------------------------------------------------------------------------------------------------------------
# Export


def artifact_tensors(c, specs, W, vocab, dspecs, D) -> dict:
    """The artifact's tensors (contract names, dtypes, shapes), from the trainer's float tensors."""
    out = {"kept_ids": vocab.kept.to(torch.int32)}
    for sp in specs:
        w = W[sp.name].detach().cpu()
        if sp.store == "mxfp4":
            prefix, proj = sp.name.rsplit(".", 1)  # "...block_sparse_moe.experts", "w1"
            for e in range(w.shape[0]):
                packed, scale = tm.mxfp4_quantize(w[e], c.group_size)
                out[f"{prefix}.{e}.{proj}.weight_packed"] = packed
                out[f"{prefix}.{e}.{proj}.weight_scale"] = scale
        else:
            out[sp.name] = w.to(torch.bfloat16 if sp.store == "bf16" else torch.float32).contiguous()
    for sp in dspecs:
        w = D[sp.name].detach().cpu()
        out["drafter." + sp.name] = w.to(torch.bfloat16 if sp.store == "bf16" else torch.float32).contiguous()
    return out


def write_artifact(path: Path, tensors: dict, dc: dict, summary: dict, preset: str) -> dict:
    from safetensors.torch import save
    meta = {"format": FORMAT, "target_preset": preset, "drafter_config": json.dumps(ds.public_config(dc)),
            "summary": json.dumps(summary)}
    data = save(tensors, metadata=meta)
    t0 = time.time()
    packed = lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9 | lzma.PRESET_EXTREME)
    path.write_bytes(packed)
    return {"safetensors_bytes": len(data), "xz_bytes": len(packed), "xz_seconds": round(time.time() - t0, 1)}


def read_artifact(path: Path):
    """Decompresses and parses an artifact: (metadata dict, tensors dict)."""
    from safetensors.torch import load
    data = lzma.decompress(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    return header.get("__metadata__", {}), load(data)


def expand_artifact(tensors: dict):
    """The contract's expansion: (full-vocabulary target tensors by checkpoint name, drafter tensors by schema
    name, Vocab)."""
    kept = tensors["kept_ids"].to(torch.int64)
    V = 163840
    vocab = tm.Vocab(kept, V)
    target, drafter = {}, {}
    for name, t in tensors.items():
        if name == "kept_ids":
            continue
        if name in ("model.embed_tokens.weight", "lm_head.weight", "drafter.markov_head.w1.weight",
                    "drafter.markov_head.w2.weight"):
            if t.shape[0] != vocab.n + 1:
                raise ValueError(f"{name}: {t.shape[0]} rows, expected n_kept + 1 = {vocab.n + 1}")
            t = vocab.expand(t)
        if name.startswith("drafter."):
            drafter[name[len("drafter."):]] = t
        else:
            target[name] = t
    return target, drafter, vocab


# ----------------------------------------------------------------------------------------------------------------
# Self-check (CPU, float64)


def perturbed(specs, params, gen, bias_std=0.05):
    """Random weights in the trainer's form with every zero-initialised tensor made non-trivial."""
    with torch.no_grad():
        for sp in specs:
            w = params[sp.name]
            if sp.init[0] == "zeros":
                w.add_((bias_std if sp.buffer else 0.3) * torch.randn(sp.shape, generator=gen, dtype=w.dtype))
            elif sp.init == ("normal", 1.0, 0.0):
                w.add_(0.1 * torch.randn(sp.shape, generator=gen, dtype=w.dtype))
    return params


def selfcheck(config_path: Path, seed: int = 37) -> int:
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    dt = torch.float64
    c, root = load_config(config_path)
    gen = torch.Generator().manual_seed(seed)
    results, failed = [], []

    def report(name, value):
        ok = value <= TOL
        results.append((name, value))
        print(f"selfcheck {name}: rel {value:.3e} {'ok' if ok else 'FAIL'}", flush=True)
        if not ok:
            failed.append(name)

    kept = torch.unique(torch.cat([torch.randint(0, c.vocab, (400,), generator=gen),
                                   torch.tensor([tm.BOS, tm.EOS, tm.PAD, c.vocab - 2])]))
    vocab = tm.Vocab(kept, c.vocab)
    specs = tm.target_specs(c, vocab.n + 1)
    W = perturbed(specs, tm.init_params(specs, seed, dt), gen)
    B, T = 3, 37
    full = kept[torch.randint(0, vocab.n, (B, T), generator=gen)]
    unseen = [i for i in (12345, 54321, 99999) if i not in set(kept.tolist())]
    full[0, 5], full[1, 20], full[2, 36] = unseen[0], unseen[1], unseen[0]  # inputs through the shared row
    tokens = vocab.to_compact(full)
    dc = ds.prepare(ds.drafter_config("large", c), vocab, [])
    taps_ids = dc["target_layer_ids"]

    # (a0) the batched chunked KDA (partial last chunk, initial state) vs the reference recurrence
    Bk, Tk, Hk, Kk, Vk = 2, 41, 3, 8, 6
    q = ref.l2norm(torch.randn(Bk, Tk, Hk, Kk, generator=gen, dtype=dt)) * Kk ** -0.5
    k = ref.l2norm(torch.randn(Bk, Tk, Hk, Kk, generator=gen, dtype=dt))
    v = torch.randn(Bk, Tk, Hk, Vk, generator=gen, dtype=dt)
    g = c.gate_lb * torch.sigmoid(torch.randn(Bk, Tk, Hk, Kk, generator=gen, dtype=dt) * 2)
    beta = torch.sigmoid(torch.randn(Bk, Tk, Hk, generator=gen, dtype=dt))
    s0 = torch.randn(Bk, Hk, Kk, Vk, generator=gen, dtype=dt)
    o, s_fin, _ = tm.kda_chunked_b(q, k, v, g, beta, s0, 16)
    worst = 0.0
    for b in range(Bk):
        s_ref = s0[b].clone()
        o_ref = ref.kda_recurrent(q[b], k[b], v[b], g[b], beta[b], s_ref)
        worst = max(worst, ref.rel_diff(o[b], o_ref), ref.rel_diff(s_fin[b], s_ref))
    report("(a0) batched chunked KDA (T=41, chunk 16, initial state) vs k3_reference recurrence", worst)

    # (a) batched float forward vs k3_reference.forward(mode="chunk"), per row
    t0 = time.time()
    with torch.no_grad():
        cap = tm.Capture()
        raw = tm.forward(c, W, tokens, chunk=16, capture=cap, tap_layers=taps_ids)
    w_ref = tm.to_reference_weights(c, {k: v.detach() for k, v in W.items()}, vocab)
    worst_lg, worst_lp, worst_tap = 0.0, 0.0, 0.0
    for b in range(B):
        trace = []
        lg = ref.forward(c, w_ref, full[b].tolist(), ref.SeqState(c, dt), mode="chunk", chunk=16, trace=trace)
        mine = vocab.expand(raw[b].T).T  # [T, V]
        worst_lg = max(worst_lg, ref.rel_diff(mine, lg))
        lp_ref = torch.log_softmax(lg, -1)
        lp = vocab.log_probs(raw[b])
        worst_lp = max(worst_lp, ref.rel_diff(lp[:, :-1], lp_ref[:, kept]))
        for l in taps_ids:
            worst_tap = max(worst_tap, ref.rel_diff(cap.taps[l][b], trace[l + 1]["attn_read"]))
    print(f"  (batched forward B={B} T={T}, n_kept={vocab.n}, {time.time() - t0:.1f} s)")
    report("(a) batched training forward vs k3_reference chunk forward, logits", worst_lg)
    report("(a) compact log-probs (shared row + log(V-n)) vs full-vocabulary log-softmax", worst_lp)
    report("(a) drafter taps vs k3_reference AttnRes reads", worst_tap)

    # (b) branch rollouts vs plain forwards of the same sequences
    pos, steps = [16, 32], 3
    with torch.no_grad():
        cap = tm.Capture()
        raw = tm.forward(c, W, tokens, chunk=16, capture=cap, tap_layers=taps_ids)
        br = tm.Branches(c, W, cap, pos, 16)
        feed = torch.randint(0, vocab.n + 1, (B * len(pos), steps), generator=gen)
        outs = [br.step(feed[:, s]) for s in range(steps)]
        worst = 0.0
        for bi in range(B):
            for ai, p in enumerate(pos):
                r = bi * len(pos) + ai
                seq = torch.cat([tokens[bi, :p], feed[r]])[None]
                direct = tm.forward(c, W, seq, chunk=16)[0, p:]
                worst = max(worst, ref.rel_diff(torch.stack([o[r] for o in outs]), direct))
    report("(b) branch rollouts (chunk-boundary states) vs plain forwards", worst)

    # (c) export path: served weights vs the artifact read back through k3_reference
    Ws = tm.served_params(specs, W, c.group_size)
    dspecs = ds.drafter_specs(dc, vocab.n + 1)
    dc = ds.prepare(dc, vocab, dspecs)
    D = perturbed(dspecs, tm.init_params(dspecs, seed + 1, dt), gen)
    with torch.no_grad():  # a non-zero Markov W2 and confidence head
        D["markov_head.w2.weight"].normal_(0, 0.5, generator=gen)
        D["confidence_head.weight"].normal_(0, 0.3, generator=gen)
    Ds = tm.served_params(dspecs, D, c.group_size)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        art = tmp / ARTIFACT
        info = write_artifact(art, artifact_tensors(c, specs, W, vocab, dspecs, D), dc, {"selfcheck": True},
                              "k3-tiny")
        meta, tensors = read_artifact(art)
        tgt, drf, vocab2 = expand_artifact(tensors)
        if not torch.equal(vocab2.kept, vocab.kept) or meta.get("format") != FORMAT:
            failed.append("(c) artifact kept_ids / format")
        mx = 0.0
        for layer, (_, ffn) in enumerate(c.layers):
            if ffn != "moe":
                continue
            for proj in ("w1", "w3", "w2"):
                base = f"model.layers.{layer}.block_sparse_moe.experts"
                back = torch.stack([tm.mxfp4_dequant(tgt[f"{base}.{e}.{proj}.weight_packed"],
                                                     tgt[f"{base}.{e}.{proj}.weight_scale"], c.group_size, dt)
                                    for e in range(c.experts)])
                mx = max(mx, float((back - Ws[f"{base}.{proj}"]).abs().max()))
        report("(c) MXFP4 bytes read back vs the trainer's fake-quant values (abs)", mx)
        from safetensors.torch import save_file
        ck = tmp / "ck"
        ck.mkdir()
        (ck / "config.json").write_text(json.dumps(root))
        save_file({k: v.contiguous() for k, v in tgt.items()}, str(ck / "model.safetensors"))
        w_art = ref.load_weights(ref.Checkpoint(ck, dt))
        with torch.no_grad():
            raw_s = tm.forward(c, Ws, tokens, chunk=16)
        worst = 0.0
        for b in range(B):
            lg = ref.forward(c, w_art, full[b].tolist(), ref.SeqState(c, dt), mode="chunk", chunk=16)
            worst = max(worst, ref.rel_diff(vocab.expand(raw_s[b].T).T, lg))
        print(f"  (artifact: {info['safetensors_bytes']} bytes, xz {info['xz_bytes']} bytes)")
        report("(c) served forward vs the artifact expanded and run by k3_reference", worst)

        # (d) drafter: batched training forward vs model.rs transcribed, on the artifact's tensors
        dc_art = json.loads(meta["drafter_config"])
        ds.check_against(dc_art, c)
        Df = {k: v.to(dt) for k, v in drf.items()}
        TWf = {"embed": w_art["embed"], "lm_head": w_art["lm_head"]}
        gamma = dc["block_size"]
        worst_l, worst_c, same = 0.0, 0.0, True
        with torch.no_grad():
            cap = tm.Capture()
            raw_s = tm.forward(c, Ws, tokens, chunk=16, capture=cap, tap_layers=taps_ids)
            for bi, P in ((0, 16), (1, 30), (2, 37)):
                trace = []
                ref.forward(c, w_art, full[bi, :P].tolist(), ref.SeqState(c, dt), mode="chunk", chunk=16, trace=trace)
                taps_rows = [trace[l + 1]["attn_read"] for l in taps_ids]
                x0 = int(raw_s[bi, P - 1].argmax())
                toks, confs, lgs = ds.rust_literal_draft(dc_art, Df, TWf, taps_rows, P, int(vocab.to_full(
                    torch.tensor(x0))), gamma)
                prev = vocab.to_compact(torch.tensor([int(vocab.to_full(torch.tensor(x0)))] + toks[:-1]))
                taps_b = [cap.taps[l][bi:bi + 1] for l in taps_ids]
                lg, z = ds.drafter_forward(dc, Ds, Ws, taps_b, torch.tensor([P]), torch.tensor([[x0]]), prev[None, None])
                mine = vocab.expand(lg[0, 0].T).T  # [γ, V]
                worst_l = max(worst_l, ref.rel_diff(mine, lgs))
                worst_c = max(worst_c, ref.rel_diff(torch.sigmoid(z[0, 0]), torch.tensor(confs, dtype=dt)))
                same &= vocab.to_full(lg[0, 0].argmax(-1)).tolist() == toks
        report("(d) drafter logits: batched training forward vs model.rs transcription", worst_l)
        report("(d) drafter confidences", worst_c)
        if not same:
            failed.append("(d) drafted tokens differ")
            print("selfcheck (d) drafted tokens differ: FAIL")
        else:
            print("selfcheck (d) greedy drafted tokens identical: ok")
    print("selfcheck: " + ("PASSED" if not failed else f"FAILED: {failed}"), flush=True)
    return 0 if not failed else 1


# ----------------------------------------------------------------------------------------------------------------
# Logs, plots, CLI


class Logger:
    def __init__(self, path: Path):
        self.path = path
        self.records = []
        path.write_text("")

    def __call__(self, rec: dict):
        self.records.append(rec)
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        keys = ("train_loss", "held_loss", "held_expected_accepted", "train_agree1", "lr")
        print(f"[{rec['phase']}] step {rec['step']} {rec['seconds']}s " +
              " ".join(f"{k} {rec[k]:.4g}" for k in keys if isinstance(rec.get(k), float)), flush=True)


def plot(records: list, path: Path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: loss_curves.png skipped")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, phase in zip(axes, ("target", "drafter")):
        rs = [r for r in records if r["phase"] == phase]
        tr = [(r["step"], r["train_loss"]) for r in rs if r.get("train_loss") is not None]
        he = [(r["step"], r["held_loss"]) for r in rs if r.get("held_loss") is not None and not r.get("final")]
        fin = [(r["step"], r["held_loss"]) for r in rs if r.get("held_loss") is not None and r.get("final")]
        if tr:
            ax.plot(*zip(*tr), label="train", lw=1)
        if he:
            ax.plot(*zip(*he), "o-", label="held-out (eval rows)", ms=3)
        if fin:
            ax.plot(*zip(*fin), "*", label="held-out (all rows, final)", ms=10)
        ax.set_title(f"{phase} loss" + (" (nats/token)" if phase == "target" else " (0.1 CE + 0.9 L1 + BCE)"))
        ax.set_xlabel("step")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--selfcheck", action="store_true", help="run the float64 CPU self-check and exit")
    ap.add_argument("--corpus", type=Path, help="folder of `sparkd corpus` (train.u32, held.u32, corpus.json)")
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="k3-tiny config.json (sparkd synth's)")
    ap.add_argument("--out", type=Path, help="output folder")
    ap.add_argument("--target-preset", default="k3-tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=37)
    ap.add_argument("--target-seconds", type=float, default=150.0)
    ap.add_argument("--drafter-seconds", type=float, default=90.0)
    ap.add_argument("--max-steps", type=int, help="fixed step count per phase (overrides the time budgets)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64, help="target rows per step")
    ap.add_argument("--drafter-batch", type=int, default=32,
                    help="drafter rows per step (each with seq_len/chunk anchors)")
    ap.add_argument("--drafter-config", default="large", help="'preset', 'large' or a JSON file (serde form)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--drafter-lr", type=float, default=2e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--qat-frac", type=float, default=0.2, help="final share of target steps with MXFP4 fake-quant")
    ap.add_argument("--chunk", type=int, default=16, help="KDA chunk (drafter anchors sit on its multiples)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=4, help="held-out evaluation every N logs")
    ap.add_argument("--eval-rows", type=int, default=32, help="held-out rows of the periodic evaluations")
    ap.add_argument("--max-held-rows", type=int, default=100000, help="cap on held-out rows of the final evaluations")
    ap.add_argument("--drafter-eval-rows", type=int, default=256, help="held-out rows of the final drafter evaluation")
    ap.add_argument("--no-autocast", action="store_true", help="train in float32 on CUDA too")
    args = ap.parse_args(argv)
    if args.selfcheck:
        return selfcheck(args.config, args.seed)
    if not (args.corpus and args.out):
        ap.error("--corpus and --out are required (or --selfcheck)")
    t_start = time.time()
    dev = torch.device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(min(4, os.cpu_count() or 1))
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    log = Logger(args.out / "train_log.jsonl")
    c, root = load_config(args.config)
    dc = ds.drafter_config(args.drafter_config, c)
    meta, train, held, kept = load_corpus(args.corpus, dc["mask_token_id"])
    vocab = tm.Vocab(kept, c.vocab)
    train_c = vocab.to_compact(train).to(dev)
    held_c = vocab.to_compact(held)
    held_rows = windows(held_c, args.seq_len)[:args.max_held_rows]
    print(f"corpus: {train.numel()} train / {held.numel()} held tokens, n_kept {vocab.n}, {held_rows.shape[0]} "
          f"held rows of {args.seq_len}; device {dev}", flush=True)

    specs = tm.target_specs(c, vocab.n + 1)
    W = tm.init_params(specs, args.seed, torch.float32, dev)
    n_params = sum(W[s.name].numel() for s in specs)
    tsum = train_target(c, specs, W, vocab, train_c, held_rows, args, log)
    ev_f = evaluate_target(c, W, vocab, held_rows, args.batch, args.chunk, dev)
    Ws = tm.served_params(specs, W, c.group_size)
    ev_s = evaluate_target(c, Ws, vocab, held_rows, args.batch, args.chunk, dev)
    print(f"target held-out: float ppl {ev_f['ppl']:.3f} (loss {ev_f['loss']:.4f}), served ppl {ev_s['ppl']:.3f} "
          f"(loss {ev_s['loss']:.4f}) over {ev_f['tokens']} tokens", flush=True)
    log({"phase": "target", "step": tsum["steps"], "seconds": tsum["seconds"], "lr": 0.0,
         "train_loss": tsum["final_train_loss"], "held_loss": ev_f["loss"], "held_loss_served": ev_s["loss"],
         "final": True})

    dspecs = ds.drafter_specs(dc, vocab.n + 1)
    dc = ds.prepare(dc, vocab, dspecs)
    D = tm.init_params(dspecs, args.seed + 1, torch.float32, dev)
    held_d = held_c[:held_rows.shape[0] * args.seq_len]
    held_drows = windows(held_d, args.seq_len)[:, :-1][:args.drafter_eval_rows].to(dev)
    dsum = ds.train_drafter(c, dc, D, {k: v.to(dev) for k, v in Ws.items()}, vocab, train_c, held_drows, args, log)
    h = dsum["held"]
    print("drafter held-out: conditional agreement per position " +
          " ".join(f"{a:.3f}" for a in h["agreement_conditional"]) +
          f"; expected accepted drafts {h['expected_accepted_drafts']:.3f}", flush=True)
    print("  mean confidence " + " ".join(f"{a:.3f}" for a in h["mean_confidence"]) +
          " vs mean 1-TV " + " ".join(f"{a:.3f}" for a in h["mean_one_minus_tv"]), flush=True)

    summary = {
        "format": FORMAT, "target_preset": args.target_preset, "seed": args.seed, "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "corpus": {k: meta.get(k) for k in ("source", "seed", "files", "held_files", "train_tokens", "held_tokens")},
        "n_kept": vocab.n, "seq_len": args.seq_len,
        "target": dict(tsum, params=n_params, batch=args.batch, lr=args.lr, qat_frac=args.qat_frac,
                       held_tokens=ev_f["tokens"], held_loss_float=ev_f["loss"], held_ppl_float=ev_f["ppl"],
                       held_loss_served=ev_s["loss"], held_ppl_served=ev_s["ppl"]),
        "drafter": dict({k: v for k, v in dsum.items() if k != "held"}, config=ds.public_config(dc),
                        params=sum(D[s.name].numel() for s in dspecs), batch_rows=args.drafter_batch,
                        lr=args.drafter_lr, held=h,
                        loss="0.1 CE(greedy target token) + 0.9 ||q-p||_1 + 1.0 BCE(c, 1-TV), w_k = exp(-(k-1)/4)"),
    }
    tensors = artifact_tensors(c, specs, W, vocab, dspecs, D)
    info = write_artifact(args.out / ARTIFACT, tensors, dc, summary, args.target_preset)
    summary["artifact"] = dict(info, file=ARTIFACT, tensors=len(tensors))
    summary["wall_seconds"] = round(time.time() - t_start, 1)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(log.records, args.out / "loss_curves.png")
    print(f"wrote {args.out / ARTIFACT} ({info['xz_bytes']} bytes; {info['safetensors_bytes']} uncompressed, "
          f"xz {info['xz_seconds']} s) and summary.json; total {summary['wall_seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
