"""Backward time of transformers' LlamaForCausalLM with Collider from Python, every method side by side.

tinyllama-mini's shapes (models/llama.cpp: 4 layers, D 512, FFN 1536, 8 heads, 1 KV head, vocab
8192), attn_implementation eager and sdpa, batch 2, 40% of each sequence filtered. Per point, in one
process and interleaved repetition by repetition (the order rotates every repetition):
  regular               dense backward of the mean over every labelled position
  loss_only             RHO-1 as existing systems run it: masked loss, dense backward
  collider kept_only    collider.filter_backward(...) from Python, then the backward
  collider exact_query
  floor                 regular's backward on a batch of T' tokens (DESIGN.md section 7: what a
                        backward that never saw the dropped tokens costs here, with no gather)
Medians with IQR; Collider's time includes the Python call of filter_backward. FLOP ideal =
1 - backward GEMM FLOPs of the method / regular's, counted as models/flops.h does (eager-style
full T x T attention scores). Python overhead = the filter_backward call's time from Python minus
the C++ rewrite_ms it reports. The CPU allocator is the C++ harness's caching one (as
bm_collider_backward uses); --allocator system keeps glibc's. peak_MiB: the step's live tensors at
their most (forward, filter_backward and backward; the caching allocator's count, as
bm_collider_backward's). --checkpointing layers: transformers' gradient_checkpointing_enable()
(non-reentrant) on every decoder layer, so each backward recomputes the layers' forward at full
length; the FLOP ideal then counts that recomputation, dense, on both sides. --layout packed: every
row packs documents of mixed lengths (32 to T/2 positions, position_ids restarting per document, no
label across a document boundary), so transformers passes SDPA a block-diagonal document mask;
the FLOP ideal is counted as for one causal sequence (what regular's kernel computes with a mask).
CPU numbers are CPU scale.
  python python/bench/bench_hf_backward.py                       # T 512,1024, eager+sdpa, 5 reps
  python python/bench/bench_hf_backward.py --seq 512 --reps 3 --json out.jsonl
  python python/bench/bench_hf_backward.py --seq 1024 --attn sdpa --checkpointing none,layers
  python python/bench/bench_hf_backward.py --seq 1024 --attn sdpa --layout packed
Not a test: nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if (ROOT / "build" / "python" / "collider").exists() and os.environ.get("COLLIDER_TEST_INSTALLED") != "1":
    sys.path.insert(0, str(ROOT / "build" / "python"))  # this checkout's build, as the tests use

import collider  # noqa: E402
import collider.hf as chf  # noqa: E402

# tinyllama-mini (models/llama.cpp): layers, hidden D, ffn F, heads H, kv heads G, vocab V
MINI = dict(num_hidden_layers=4, hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=1,
            vocab_size=8192)
METHODS = ("regular", "loss_only", "collider kept_only", "collider exact_query", "floor")


# ---- analytic FLOPs (models/flops.h, Llama: SwiGLU MLP = 3 matrices) ----------------------------
def linear_flops_per_token(c: dict) -> float:
    D, F, H, G = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    E = D // H
    return 2.0 * c["num_hidden_layers"] * (D * H * E + 2 * D * G * E + H * E * D + 3 * D * F)


def attention_gemm_flops(c: dict, B: int, Tq: int, Tk: int) -> float:
    H = c["num_attention_heads"]
    return 2.0 * c["num_hidden_layers"] * B * H * Tq * Tk * (c["hidden_size"] // H)


def forward_flops(c: dict, B: int, T: int) -> dict:
    return {"linear": B * T * linear_flops_per_token(c), "attention": 2 * attention_gemm_flops(c, B, T, T),
            "lm_head": 2.0 * B * T * c["hidden_size"] * c["vocab_size"]}


def backward_flops(c: dict, B: int, T: int, N: int, mode: str, recompute: bool = False) -> float:
    """recompute: activation checkpointing of every decoder layer, whose forward (full length,
    dense: the recomputation is not filtered) the backward runs again."""
    full = forward_flops(c, B, T)
    again = full["linear"] + full["attention"] if recompute else 0.0
    if mode == "dense":
        return 2 * sum(full.values()) + again
    kept = forward_flops(c, B, N)
    attention = 4 * attention_gemm_flops(c, B, N, N if mode == "kept_only" else T)
    return 2 * kept["linear"] + 2 * kept["lm_head"] + attention + again


# ---- provenance ---------------------------------------------------------------------------------
def git(*args) -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def provenance(allocator: str) -> dict:
    import transformers
    return {"git_sha": git("rev-parse", "--short", "HEAD"), "git_dirty": bool(git("status", "--porcelain", "-uno")),
            "torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "device": "cpu", "device_name": cpu_name(), "num_cores": os.cpu_count(), "num_threads": torch.get_num_threads(),
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "cpu_allocator": allocator,
            "scale": "CPU scale (relative figures only)", "python": platform.python_version(),
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


# ---- one point ----------------------------------------------------------------------------------
def median_iqr(xs):
    xs = sorted(xs)
    if len(xs) < 2:
        return xs[0], 0.0
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return statistics.median(xs), q[2] - q[0]


def packed_documents(B: int, T: int, gen: torch.Generator):
    """position_ids [B, T] of rows packing documents of 32 to T/2 positions, the same number of
    documents in every row (so every row has as many labelled positions), and the document starts."""
    docs = max(2, T // 192)
    starts = []
    for _ in range(B):
        cuts = torch.sort(torch.randperm(T // 32 - 1, generator=gen)[:docs - 1] + 1).values * 32
        starts.append([0] + cuts.tolist())
    pos = torch.zeros(B, T, dtype=torch.long)
    for b, row in enumerate(starts):
        for s0, s1 in zip(row, row[1:] + [T]):
            pos[b, s0:s1] = torch.arange(s1 - s0)
    return pos, starts


def bench_point(attn: str, T: int, B: int, filter_ratio: float, reps: int, warmup: int, seed: int,
                checkpointing: str = "none", layout: str = "causal") -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(**MINI, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      attention_dropout=0.0, use_cache=False, attn_implementation=attn)
    model = LlamaForCausalLM(cfg).train()
    recompute = checkpointing == "layers"
    if recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plan = chf.trace_plan(model, loss="per_token")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MINI["vocab_size"], (B, T), generator=gen)
    labels, forward = ids, {}
    if layout == "packed":
        pos, starts = packed_documents(B, T, gen)
        forward["position_ids"] = pos
        labels = ids.clone()
        for b, row in enumerate(starts):
            labels[b, row[1:]] = -100  # a document's first token is not predicted from the one before
    valid = chf.keep_mask_from_labels(labels)  # the labelled positions, as many in every row
    keep = collider.select_tokens(torch.rand(B, T, generator=gen), filter_ratio, valid=valid)
    N = int(keep[0].sum())
    ids_floor = ids[:, :N + 1]  # regular on T' labelled positions (N + 1 tokens, the last unlabelled)
    labels_floor = labels[:, :N + 1]
    forward_floor = {k: v[:, :N + 1] for k, v in forward.items()}
    valid_floor = chf.keep_mask_from_labels(labels_floor)

    def loss_of(x, lab, kw, mask):
        return chf.masked_mean(chf.token_losses(model(input_ids=x, use_cache=False, **kw).logits, lab), mask)

    samples = {m: [] for m in METHODS}
    peak = {m: 0 for m in METHODS}
    py_call, rewrite = {m: [] for m in METHODS[2:4]}, {m: [] for m in METHODS[2:4]}
    for rep in range(warmup + reps):
        order = METHODS[rep % len(METHODS):] + METHODS[:rep % len(METHODS)]
        for method in order:
            model.zero_grad(set_to_none=True)
            collider._C._cpu_memory_reset_peak()
            if method == "floor":
                loss = loss_of(ids_floor, labels_floor, forward_floor, valid_floor)
            else:
                loss = loss_of(ids, labels, forward, valid if method == "regular" else keep)
            t0 = time.perf_counter()
            if method.startswith("collider"):
                stats = collider.filter_backward(loss, keep, plan, attention=method.split()[1])
                t_call = time.perf_counter()
            loss.backward()
            t1 = time.perf_counter()
            if rep >= warmup:
                samples[method].append((t1 - t0) * 1e3)
                peak[method] = max(peak[method], collider._C._cpu_memory_peak_bytes())
                if method.startswith("collider"):
                    py_call[method].append((t_call - t0) * 1e3)
                    rewrite[method].append(stats.rewrite_ms)
            del loss
    model.zero_grad(set_to_none=True)

    dense = backward_flops(MINI, B, T, N, "dense", recompute)
    fwd = forward_flops(MINI, 1, T)
    point = {"model": "tinyllama-mini (transformers LlamaForCausalLM)", "attn_implementation": attn, "seq_len": T,
             "batch_size": B, "filter_ratio": filter_ratio, "kept": N, "labelled": T - 1, "reps": reps,
             "warmup": warmup, "attention_linear_ratio": fwd["attention"] / fwd["linear"], "plan": plan.summary(),
             "checkpointing": checkpointing, "layout": layout, "labelled_per_row": int(valid[0].sum()),
             "methods": {}}
    reg_ms = median_iqr(samples["regular"])[0]
    for method in METHODS:
        med, iqr = median_iqr(samples[method])
        mode = {"collider kept_only": "kept_only", "collider exact_query": "exact_query"}.get(method)
        row = {"bwd_ms": med, "iqr_ms": iqr, "samples_bwd_ms": samples[method], "reduction": 1 - med / reg_ms,
               "peak_mem_bytes": peak[method]}
        if mode:
            ideal = 1 - backward_flops(MINI, B, T, N, mode, recompute) / dense
            call_med = statistics.median(py_call[method])
            rw_med = statistics.median(rewrite[method])
            over = [c - r for c, r in zip(py_call[method], rewrite[method])]
            row.update(ideal=ideal, of_ideal=row["reduction"] / ideal, filter_call_ms=call_med, rewrite_ms=rw_med,
                       python_overhead_ms=statistics.median(over),
                       python_overhead_of_bwd=statistics.median(over) / (med - call_med),
                       rewrite_of_bwd=rw_med / med)
        row["vs_floor"] = med / median_iqr(samples["floor"])[0]
        point["methods"][method] = row
    return point


def print_point(p: dict) -> None:
    print(f"\ntinyllama-mini ({p['attn_implementation']})  T={p['seq_len']}  B={p['batch_size']}  "
          f"T'={p['kept']} of {p.get('labelled_per_row', p['labelled'])} labelled  {p.get('layout', 'causal')}  "
          f"checkpointing {p['checkpointing']}  "
          f"attention/linear FLOPs {p['attention_linear_ratio']:.3f}  [{p['plan']}]")
    print(f"  {'method':22} {'bwd_ms':>9} {'IQR':>7} {'reduction':>10} {'ideal':>7} {'of ideal':>9} {'vs floor':>9} "
          f"{'call_ms':>8} {'rewrite':>8} {'py ovh':>8} {'ovh/bwd':>8} {'peak_MiB':>9}")
    for m, r in p["methods"].items():
        extra = ""
        if "ideal" in r:
            extra = (f" {r['ideal'] * 100:6.1f}% {r['of_ideal']:9.3f} {r['vs_floor']:8.2f}x {r['filter_call_ms']:8.2f} "
                     f"{r['rewrite_ms']:8.2f} {r['python_overhead_ms']:8.3f} {r['python_overhead_of_bwd'] * 100:7.2f}%")
        else:
            extra = f" {'':7} {'':9} {r['vs_floor']:8.2f}x {'':8} {'':8} {'':8} {'':8}"
        print(f"  {m:22} {r['bwd_ms']:9.2f} {r['iqr_ms']:7.2f} {r['reduction'] * 100:9.1f}%{extra} "
              f"{r['peak_mem_bytes'] / 2**20:9.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", default="512,1024")
    ap.add_argument("--attn", default="eager,sdpa")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--filter-ratio", type=float, default=0.4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--allocator", choices=("caching", "system"), default="caching")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layout", choices=("causal", "packed"), default="causal",
                    help="causal: one sequence per row; packed: documents of mixed lengths per row (SDPA gets a mask)")
    ap.add_argument("--checkpointing", default="none",
                    help="comma list of none (no activation checkpointing) and layers (every decoder layer)")
    ap.add_argument("--json", default=None, help="append one JSON row per point (with provenance) to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    allocator = collider._C._install_caching_cpu_allocator() if args.allocator == "caching" else "system"
    prov = provenance(allocator)
    print(f"# {' '.join([Path(sys.argv[0]).name] + sys.argv[1:])}")
    print("# " + ", ".join(f"{k} {v}" for k, v in prov.items()))
    modes = args.checkpointing.split(",")
    if not set(modes) <= {"none", "layers"}:
        ap.error(f"--checkpointing takes none and layers, got {args.checkpointing}")
    for attn in args.attn.split(","):
        for T in (int(t) for t in args.seq.split(",")):
            for mode in modes:
                point = bench_point(attn, T, args.batch, args.filter_ratio, args.reps, args.warmup, args.seed, mode,
                                    args.layout)
                print_point(point)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps({**point, **prov, "command": " ".join(sys.argv)}) + "\n")
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
