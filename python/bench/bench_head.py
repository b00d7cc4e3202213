"""The LM head alone, forward + backward, every method side by side in one process: time and peak
memory of the head that token filtering needs (every token scored, only the kept ones trained).

Per point (vocabulary V, width D, N = B * T rows, 40% of the rows dropped by a random keep mask):
  unfused               logits = hidden W^T [N, V] and transformers' cross-entropy over the kept rows
                        (dropped rows' targets -100), plain autograd: every row's logits built, saved
                        and backpropagated
  unfused collider      the same forward, collider.filter_backward on it: the backward's GEMMs on the
                        kept rows, the [N, V] logits still built and saved
  fused                 collider.fused_head_loss, plain autograd: every row scored block by block
                        (no [N, V] logits), the kept rows' gradient made in the forward
  fused collider        the same under collider.filter_backward: the hidden states' gradient leaves
                        the head cut to the kept rows
  fused wide            fused collider with blocks of WIDE_ROWS (256) whole-vocabulary rows
                        (chunk_vocab raised to WIDE_ROWS * V / chunk_rows): fewer, larger GEMMs into
                        the weight's gradient for one [256, V] block of memory (at V = 151936,
                        149 MiB in float32; the default blocks hold 8M logits, 55 rows there, and
                        recompute below 128 rows)
  fused recompute       collider.score_head then ScoredHead.loss (RHO-1's order: the keep mask
                        from the scores) under filter_backward: the kept rows' logits recomputed in
                        the backward
  compact first         a stand-in for the field's compacting fused losses (Cut Cross-Entropy,
                        torchtune's and TRL's chunked losses), in plain torch: the kept rows gathered
                        before the head, then a cross-entropy over blocks of 1024 rows, each block
                        recomputed in the backward (torch.utils.checkpoint). The dropped rows get NO
                        score, which RHO-1's selection needs: not a drop-in, shown for its cost.
Cut Cross-Entropy itself is not run: its kernels are Triton (CUDA), and its torch fallback is not
in this project's pinned environment.
Timing: the C++ engine's interleaved rounds (bench_hf_backward.side_by_side), medians with IQR.
Memory: peak live tensor bytes of the step above what was live before it (the inputs and the
weight), from the C++ caching CPU allocator's count (CUDA: torch.cuda's peak); the weight's
gradient (V x D float32) is part of every method's peak.
FLOP ideal: forward 2 N D V; backward 4 N D V dense, 4 K D V over the K kept rows (+ 2 K D V for
the recompute). Reported: time against the unfused head and the FLOP floor, each
method's MFU-free "ms per GFLOP" of its own work.
  python python/bench/bench_head.py                                   # the CPU-scale grid
  python python/bench/bench_head.py --vocab 32000 --dim 512 --rows 1024 --reps 3 --json out.jsonl
CPU numbers are CPU scale. Not a test: nothing here asserts a speed.
Legend: N rows, D width, V vocabulary, K kept rows.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hf_backward import collider, median_iqr, provenance, side_by_side  # noqa: E402

METHODS = ("unfused", "unfused collider", "fused", "fused collider", "fused wide", "fused recompute",
           "compact first")
WIDE_ROWS = 256
CHUNK_ROWS = 1024
FILTER_RATIO = 0.4
COMPACT_BLOCK = 1024


def unfused_loss(x_BTD, w_VD, target_BT, keep_BT, count):
    logits = torch.matmul(x_BTD, w_VD.t())
    target = target_BT.masked_fill(~keep_BT, -100)
    return F.cross_entropy(logits.reshape(-1, w_VD.shape[0]), target.reshape(-1), reduction="sum") / count


def fused_loss(x_BTD, w_VD, target_BT, keep_BT, count):
    return collider.fused_head_loss(x_BTD, w_VD, target_BT, keep_BT, divisor=count).loss


def wide_loss(x_BTD, w_VD, target_BT, keep_BT, count):
    chunk_vocab = -(-WIDE_ROWS * w_VD.shape[0] // CHUNK_ROWS)
    return collider.fused_head_loss(x_BTD, w_VD, target_BT, keep_BT, divisor=count, chunk_rows=CHUNK_ROWS,
                                    chunk_vocab=chunk_vocab).loss


def recompute_loss(x_BTD, w_VD, target_BT, keep_BT, count):
    return collider.score_head(x_BTD, w_VD, target_BT).loss(keep_BT, count)


def compact_first_loss(x_BTD, w_VD, target_BT, keep_BT, count):
    x_KD, t_K = x_BTD[keep_BT], target_BT[keep_BT]
    total = x_KD.new_zeros(())
    for r0 in range(0, x_KD.shape[0], COMPACT_BLOCK):
        def block(xb, tb):
            return F.cross_entropy(xb @ w_VD.t(), tb, reduction="sum")
        total = total + torch.utils.checkpoint.checkpoint(block, x_KD[r0:r0 + COMPACT_BLOCK],
                                                          t_K[r0:r0 + COMPACT_BLOCK], use_reentrant=False)
    return total / count


def bench_point(V, D, N, reps, warmup, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = 2
    T = N // B
    w = (torch.randn(V, D, generator=g) * 0.02).to(dev).requires_grad_()
    base = torch.randn(B, T, D, generator=g).to(dev)
    target = torch.randint(0, V, (B, T), generator=g).to(dev)
    keep = collider.select_tokens(torch.rand(B, T, generator=g), FILTER_RATIO, align=1).to(dev)
    K = int(keep.sum())
    count = float(K)

    def trace(loss_fn):
        def on_batch(b, t):
            x = torch.randn(b, t, D, device=dev, requires_grad=True)
            return loss_fn(x, w, torch.randint(0, V, (b, t), device=dev),
                           torch.ones(b, t, dtype=torch.bool, device=dev), 1.0)
        return collider.trace_plan(on_batch)

    plans = {"unfused collider": trace(unfused_loss), "fused collider": trace(fused_loss),
             "fused wide": trace(wide_loss), "fused recompute": trace(recompute_loss)}
    loss_of = {"unfused": unfused_loss, "unfused collider": unfused_loss, "fused": fused_loss,
               "fused collider": fused_loss, "fused wide": wide_loss, "fused recompute": recompute_loss,
               "compact first": compact_first_loss}
    cuda = dev.type == "cuda"

    def run_once(method):
        x = base.clone().requires_grad_()
        w.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            live = torch.cuda.memory_allocated()
        else:
            collider._measure.cpu_memory_reset_peak()
            live = collider._measure.cpu_memory_peak_bytes()
        t0 = time.perf_counter()
        loss = loss_of[method](x, w, target, keep, count)
        if method in plans:
            collider.filter_backward(loss, keep, plans[method], attention="kept_only", check_every=0)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        peak = (torch.cuda.max_memory_allocated() if cuda else collider._measure.cpu_memory_peak_bytes()) - live
        return {"ms": ms, "peak_bytes": peak, "loss": float(loss.detach())}

    samples = side_by_side(run_once, METHODS, warmup, reps)
    flops_fwd = 2.0 * N * D * V
    # The default blocks (1024 x 8192 logits) make the gradient in the forward or recompute it in the
    # backward by the library's own rule (collider::fused_head_recomputes).
    recomputes = collider.fused_head_recomputes(N, V, chunk_rows=CHUNK_ROWS, chunk_vocab=8192)
    fused_flops = flops_fwd + (6.0 if recomputes else 4.0) * K * D * V
    flops = {"unfused": flops_fwd + 4.0 * N * D * V, "unfused collider": flops_fwd + 4.0 * K * D * V,
             "fused": fused_flops, "fused collider": fused_flops,
             "fused wide": flops_fwd + 4.0 * K * D * V, "fused recompute": flops_fwd + 6.0 * K * D * V,
             "compact first": 6.0 * K * D * V}
    losses = {m: samples[m][0]["loss"] for m in METHODS}
    ref = losses["unfused"]
    point = {"vocab": V, "dim": D, "rows": N, "kept": K, "filter_ratio": FILTER_RATIO, "methods": {}}
    base_ms, _ = median_iqr([s["ms"] for s in samples["unfused"]])
    coll_ms, _ = median_iqr([s["ms"] for s in samples["unfused collider"]])
    base_peak = max(s["peak_bytes"] for s in samples["unfused"])
    for m in METHODS:
        ms, iqr = median_iqr([s["ms"] for s in samples[m]])
        peak = max(s["peak_bytes"] for s in samples[m])
        point["methods"][m] = {
            "ms_median": ms, "ms_iqr": iqr, "ms_samples": [s["ms"] for s in samples[m]], "peak_bytes": peak,
            "gflop": flops[m] / 1e9, "vs_unfused": ms / base_ms, "vs_unfused_collider": ms / coll_ms,
            "peak_vs_unfused": peak / base_peak, "loss_rel_diff": abs(losses[m] - ref) / abs(ref)}
    # The FLOP floor of a head that scores every row and backpropagates the kept ones (no recompute).
    point["flop_ideal_vs_unfused"] = (flops_fwd + 4.0 * K * D * V) / flops["unfused"]
    point["weight_grad_bytes"] = V * D * 4
    return point


def print_point(p):
    print(f"V {p['vocab']}  D {p['dim']}  N {p['rows']}  kept {p['kept']}  "
          f"(FLOP ideal of scoring all, training the kept: {p['flop_ideal_vs_unfused']:.3f} of unfused; "
          f"dW alone {p['weight_grad_bytes'] / 2**20:.0f} MiB)")
    print(f"  {'method':18s} {'ms':>9s} {'IQR':>7s} {'/unfused':>9s} {'/unf.coll':>9s} {'peak MiB':>9s} "
          f"{'/unfused':>9s} {'GFLOP':>7s} {'loss diff':>9s}")
    for m, r in p["methods"].items():
        print(f"  {m:18s} {r['ms_median']:9.1f} {r['ms_iqr']:7.1f} {r['vs_unfused']:9.3f} "
              f"{r['vs_unfused_collider']:9.3f} {r['peak_bytes'] / 2**20:9.1f} {r['peak_vs_unfused']:9.3f} "
              f"{r['gflop']:7.1f} {r['loss_rel_diff']:9.1e}")
    sys.stdout.flush()


def ints(text):
    return [int(v) for v in text.split(",") if v]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=ints, default=[32000, 128256, 151936])
    ap.add_argument("--dim", type=ints, default=[512])
    ap.add_argument("--rows", type=ints, default=[1024, 2048])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="append one row per point here")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cpu":
        collider._measure.install_caching_cpu_allocator()
    prov = provenance("caching" if dev.type == "cpu" else "cuda", dev, False)
    print(f"head benchmark: commit {prov['git_sha'][:10]}, torch {torch.__version__}, {prov.get('device_name', dev)}, "
          f"{prov['scale']}")
    for V in args.vocab:
        for D in args.dim:
            for N in args.rows:
                p = bench_point(V, D, N, args.reps, args.warmup, dev)
                print_point(p)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps({**p, "provenance": prov}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
