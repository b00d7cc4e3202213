"""Backward time of transformers' LlamaForCausalLM with Collider from Python, every method side by side,
on the CPU or on a CUDA device.

The model has the shapes of one of models/llama.cpp's presets (--shapes; random weights, nothing
downloaded): tinyllama-mini (4 layers, D 512, FFN 1536, 8 heads, 1 KV head, vocab 8192; the
default), tinyllama-1.1b (the paper's TinyLlama-1.1B) or tinyllama-debug. attn_implementation eager
and sdpa, batch 2, 40% of each row's labelled positions filtered: the keep mask from
collider.select_tokens, T' = collider.kept_count of the labelled positions. Per point, in one
process, through the C++ measurement engine's rounds (measuring/rounds.h, by the bindings): each method's
warm-up steps in turn, then timed rounds, every round running each method once in serpentine order
(even rounds in the order below, odd rounds reversed), as the C++ sweeps run:
  regular               dense backward of the mean over every labelled position
  loss_only             RHO-1 as existing systems run it: masked loss, dense backward
  collider kept_only    collider.filter_backward(...) from Python, then the backward
  collider exact_query
  floor                 regular's backward on a batch of T' tokens (DESIGN.md section 7: what a
                        backward that never saw the dropped tokens costs here, with no gather)
--methods runs a subset ("collider kept_only" may be written collider_kept_only), or adds
"collider checked": kept_only with filter_backward's check against mask_backward on every step, what
a checked step costs. Medians with IQR;
per-round medians: the median over rounds of each round's reduction against the same round's
regular (reduction_per_round, of_ideal_per_round). bwd_ms runs from the end of the forward to the
end of loss.backward(), so Collider's includes the Python call of filter_backward. FLOP ideal = 1 -
backward GEMM FLOPs of the method / regular's, counted by the C++ FLOP model (models/flops.h, through the
bindings: eager-style full T x T attention scores). Medians and IQR by the engine's order statistics.
Python overhead = the filter_backward call's time from Python minus the C++ rewrite_ms it reports.
The CPU allocator is the C++ harness's caching one (as the C++ sweeps use); --allocator
system keeps glibc's. peak_MiB: the step's live tensors at their most (forward, filter_backward and
backward; on the CPU the caching allocator's count, as the C++ rows'; on CUDA torch.cuda's).
--checkpointing layers: transformers' gradient_checkpointing_enable() (non-reentrant) on every
decoder layer, so each backward recomputes the layers' forward at full length; the FLOP ideal then
counts that recomputation, dense, on both sides. --layout packed: every row packs documents of mixed
lengths (32 to T/2 positions, position_ids restarting per document, no label across a document
boundary), so transformers passes SDPA a block-diagonal document mask; the FLOP ideal is counted as
for one causal sequence (what regular's kernel computes with a mask).
--device cuda: the model is initialised on the device and every timing is bracketed by device
synchronisation; --bf16 (CUDA only) runs the forward and loss under bfloat16 autocast with fp32
weights, and traces the plan under the same autocast. CPU numbers are CPU scale.
--json appends one result row per method and point (result_rows: the C++ sweeps' row keys, DESIGN.md
section 6, with the point's keys and the method's figures; "label" names the method as the table
does). The GPU run (scripts/device/run_gpu_checks.sh) writes them to hf_llama.jsonl, which
scripts/device/summarize.py tabulates.
  python python/bench/bench_hf_backward.py                       # T 512,1024, eager+sdpa, 5 reps
  python python/bench/bench_hf_backward.py --seq 512 --reps 3 --json out.jsonl
  python python/bench/bench_hf_backward.py --seq 1024 --attn sdpa --checkpointing none,layers
  python python/bench/bench_hf_backward.py --seq 1024 --attn sdpa --layout packed
  python python/bench/bench_hf_backward.py --shapes tinyllama-debug --seq 64 --methods regular,collider_kept_only
  python3 python/bench/bench_hf_backward.py --device cuda --bf16 --shapes tinyllama-1.1b --seq 2048 --attn sdpa \\
      --warmup 2 --json hf_llama.jsonl
Legend: B batch, T sequence, S = T' + 1 the floor's sequence (T' labelled positions), V vocab.
Not a test: nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
BUILD_PKG = Path(os.environ.get("COLLIDER_BUILD_DIR", ROOT / "build")) / "python"
if (BUILD_PKG / "collider").exists() and os.environ.get("COLLIDER_TEST_INSTALLED") != "1":
    sys.path.insert(0, str(BUILD_PKG))  # this checkout's build, as the tests use

try:
    import collider
    import collider._measure  # the measuring kit: allocator, provenance, rounds, FLOP model
    import collider.hf as chf
except ImportError as e:
    raise SystemExit(f"error: the collider Python package is not importable ({e}); build this checkout "
                     "(./scripts/bootstrap.sh) or install it (pip install --no-build-isolation ./python)") from e

# models/llama.cpp's presets of the same names: layers, hidden D, ffn F, heads H, kv heads G, vocab V.
SHAPES = {
    "tinyllama-mini": dict(num_hidden_layers=4, hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                           num_key_value_heads=1, vocab_size=8192),
    "tinyllama-1.1b": dict(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000),
    "tinyllama-debug": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=8,
                            num_key_value_heads=1, vocab_size=256),
}
METHODS = ("regular", "loss_only", "collider kept_only", "collider exact_query", "floor")
# Only when --methods names it: kept_only with filter_backward's check against mask_backward on every
# step (check_every=1), what a checked step costs (the default checks the first step of each kind and
# every 1000th).
OPTIONAL_METHODS = ("collider checked",)
ATTENTION = {"collider kept_only": "kept_only", "collider exact_query": "exact_query",
             "collider checked": "kept_only"}  # filter_backward's


# ---- FLOPs: the C++ FLOP model (models/flops.h) through the bindings -----------------------------
def flop_shape(dims: dict) -> dict:
    """models::FlopShape of a LlamaForCausalLM with these shapes (SwiGLU MLP: 3 matrices D x F)."""
    return {"vocab_size": dims["vocab_size"], "hidden_size": dims["hidden_size"],
            "intermediate_size": dims["intermediate_size"], "num_layers": dims["num_hidden_layers"],
            "num_heads": dims["num_attention_heads"], "num_kv_heads": dims["num_key_value_heads"],
            "head_dim": dims["hidden_size"] // dims["num_attention_heads"], "mlp_matrices": 3}


def forward_flops(dims: dict, B: int, T: int) -> dict:
    """linear, attention and lm_head GEMM FLOPs of the forward (models::forward_flops)."""
    return collider._measure.forward_flops(flop_shape(dims), B, T)


def backward_flops(dims: dict, B: int, T: int, N: int, mode: str, recompute: bool = False) -> float:
    """mode: dense, kept_only or exact_query (models::backward_flops_rows on B rows of N kept).
    recompute: activation checkpointing of every decoder layer, whose forward (full length, dense:
    the recomputation is not filtered) the backward runs again."""
    full = forward_flops(dims, B, T)
    again = full["linear"] + full["attention"] if recompute else 0.0
    return sum(collider._measure.backward_flops(flop_shape(dims), T, [N] * B, mode).values()) + again


# ---- provenance ---------------------------------------------------------------------------------
def provenance(allocator: str, dev: torch.device, bf16: bool) -> dict:
    """What the numbers ran on: the C++ rows' record (collider._measure.provenance: commit, torch and CUDA
    versions, device name, threads, host; measuring/provenance.h) and what only Python knows.
    Without a .git (a copied tree), the commit comes from COLLIDER_GIT_SHA."""
    import transformers
    cuda = dev.type == "cuda"
    prov = collider._measure.provenance(str(dev), str(ROOT))
    if prov["git_sha"] == "unknown" and os.environ.get("COLLIDER_GIT_SHA"):
        prov.update(git_sha=os.environ["COLLIDER_GIT_SHA"], git_dirty=None)
    return {**prov, "transformers_version": transformers.__version__, "collider_version": collider.__version__,
            "device": dev.type, "dtype": "bf16" if bf16 else "fp32", "num_cores": os.cpu_count(),
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "cpu_allocator": allocator,
            "scale": "device scale" if cuda else "CPU scale (relative figures only)",
            "python": platform.python_version(),
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


# ---- side by side: the C++ engine's rounds (measuring/rounds.h) through the bindings -----------------
def side_by_side(run_once, methods: tuple, warmup: int, reps: int) -> dict:
    """Each method's `warmup` steps in the order given, then `reps` rounds, each calling run_once(method)
    for every method in serpentine order (collider::stats::interleave, as the C++ sweeps and
    its benchmarks run). Returns each method's samples (what run_once returned), round by round."""
    samples = {m: [] for m in methods}

    def warm_up(j):
        for _ in range(warmup):
            run_once(methods[j])

    collider._measure.interleave(len(methods), reps, warm_up, lambda j, rnd: samples[methods[j]].append(run_once(methods[j])))
    return samples


def median(xs) -> float:
    """The median as the C++ tables take it (measuring/stats.h)."""
    return collider._measure.median(list(xs))


def median_iqr(xs):
    """Median and interquartile range (q75 - q25) as every C++ table computes them (measuring/rounds.h: Series)."""
    series = collider._measure.Series()
    for x in xs:
        series.add(x)
    med = series.median()
    return med, series.rel_iqr() * med


class Clock:
    """Time and peak memory on the device the steps run on: synchronises before reading a CUDA clock."""

    def __init__(self, dev: torch.device):
        self.cuda = dev.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            collider._measure.cpu_memory_reset_peak()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() if self.cuda else collider._measure.cpu_memory_peak_bytes()


# ---- one point ----------------------------------------------------------------------------------
@dataclass
class Batch:
    """The point's inputs on the device: the full batch and the floor's (its first S = T' + 1 tokens)."""
    ids_BT: torch.Tensor
    labels_BT: torch.Tensor
    valid_BT: torch.Tensor  # the labelled positions
    keep_BT: torch.Tensor  # collider.select_tokens' keep mask
    ids_BS: torch.Tensor
    labels_BS: torch.Tensor
    valid_BS: torch.Tensor
    kept: int  # T' per row
    labelled: int  # labelled positions per row
    forward_BT: dict = field(default_factory=dict)  # extra forward arguments (position_ids of packed rows)
    forward_BS: dict = field(default_factory=dict)


def packed_documents(B: int, T: int, gen: torch.Generator):
    """position_ids [B, T] of rows packing documents of 32 to T/2 positions, the same number of
    documents in every row (so every row has as many labelled positions), and the document starts."""
    docs = max(2, T // 192)
    starts = []
    for _ in range(B):
        cuts = torch.sort(torch.randperm(T // 32 - 1, generator=gen)[:docs - 1] + 1).values * 32
        starts.append([0] + cuts.tolist())
    pos_BT = torch.zeros(B, T, dtype=torch.long)
    for b, row in enumerate(starts):
        for s0, s1 in zip(row, row[1:] + [T]):
            pos_BT[b, s0:s1] = torch.arange(s1 - s0)
    return pos_BT, starts


def make_batch(V: int, B: int, T: int, filter_ratio: float, layout: str, seed: int, dev: torch.device) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    ids_BT = torch.randint(0, V, (B, T), generator=gen)
    labels_BT, forward_BT = ids_BT, {}
    if layout == "packed":
        forward_BT["position_ids"], starts = packed_documents(B, T, gen)
        labels_BT = ids_BT.clone()
        for b, row in enumerate(starts):
            labels_BT[b, row[1:]] = -100  # a document's first token is not predicted from the one before
    valid_BT = chf.keep_mask_from_labels(labels_BT)  # the labelled positions, as many in every row
    labelled = int(valid_BT[0].sum())
    kept = collider.kept_count(labelled, filter_ratio)
    keep_BT = collider.select_tokens(torch.rand(B, T, generator=gen), filter_ratio, valid=valid_BT)
    if keep_BT.sum(1).ne(kept).any():
        raise RuntimeError(f"select_tokens kept {keep_BT.sum(1).tolist()} per row where kept_count says {kept}: "
                           "the collider package is out of date; rebuild it (./scripts/bootstrap.sh)")
    S = kept + 1  # regular on T' labelled positions (T' + 1 tokens, the last unlabelled)
    labels_BS = labels_BT[:, :S]
    forward_BS = {k: v[:, :S].to(dev) for k, v in forward_BT.items()}
    return Batch(ids_BT.to(dev), labels_BT.to(dev), valid_BT.to(dev), keep_BT.to(dev), ids_BT[:, :S].to(dev),
                 labels_BS.to(dev), chf.keep_mask_from_labels(labels_BS).to(dev), kept, labelled,
                 {k: v.to(dev) for k, v in forward_BT.items()}, forward_BS)


def build_model(shapes: str, attn: str, T: int, checkpointing: str, dev: torch.device, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(**SHAPES[shapes], max_position_embeddings=max(2048, T), rms_norm_eps=1e-5,
                      tie_word_embeddings=False, attention_dropout=0.0, use_cache=False, attn_implementation=attn)
    with torch.device(dev):  # initialised on the device: 1.1B parameters on the host take minutes
        model = LlamaForCausalLM(cfg).train()
    if checkpointing == "layers":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def autocast(dev: torch.device, bf16: bool):
    return torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=bf16)


def method_loss(model, batch: Batch, method: str, bf16: bool) -> torch.Tensor:
    if method == "floor":
        ids, labels, forward, mask = batch.ids_BS, batch.labels_BS, batch.forward_BS, batch.valid_BS
    else:
        mask = batch.valid_BT if method == "regular" else batch.keep_BT
        ids, labels, forward = batch.ids_BT, batch.labels_BT, batch.forward_BT
    with autocast(ids.device, bf16):
        logits_BTV = model(input_ids=ids, use_cache=False, **forward).logits
        return chf.masked_mean(chf.token_losses(logits_BTV, labels), mask)


def run_once(model, plan, batch: Batch, method: str, clock: Clock, bf16: bool) -> dict:
    """One step of `method`: times in ms (bwd_ms from the end of the forward, filter_backward included)."""
    model.zero_grad(set_to_none=True)
    clock.reset_peak()
    t0 = clock.now()
    loss = method_loss(model, batch, method, bf16)
    t1 = clock.now()
    sample = {}
    if method in ATTENTION:
        # Timed alone (the tests check the gradients), but for the method that measures the check.
        stats = collider.filter_backward(loss, batch.keep_BT, plan, attention=ATTENTION[method],
                                         check_every=1 if method == "collider checked" else 0)
        sample["rewrite_ms"] = stats.rewrite_ms
        sample["call_ms"] = (clock.now() - t1) * 1e3
    loss.backward()
    t2 = clock.now()
    sample.update(fwd_ms=(t1 - t0) * 1e3, bwd_ms=(t2 - t1) * 1e3, peak=clock.peak())
    return sample


def per_round_median(xs: list, refs: list) -> float:
    """Median over rounds of each round's reduction against the same round's reference."""
    return median(1 - x / r for x, r in zip(xs, refs))


def collider_figures(samples: list, row: dict, ideal: float, bwd: list, reg: list | None) -> dict:
    call = [s["call_ms"] for s in samples]
    rewrite = [s["rewrite_ms"] for s in samples]
    over = [c - r for c, r in zip(call, rewrite)]
    call_med, rw_med = median(call), median(rewrite)
    return {"ideal": ideal,
           "of_ideal_per_round": None if reg is None else per_round_median(bwd, reg) / ideal,
           "filter_call_ms": call_med, "rewrite_ms": rw_med, "python_overhead_ms": median(over),
           "python_overhead_of_bwd": median(over) / (row["bwd_ms"] - call_med),
           "rewrite_of_bwd": rw_med / row["bwd_ms"]}


def method_figures(samples: dict, method: str, ideal: float | None) -> dict:
    """A method's row from its samples (its reduction, share of the ideal and ratio to the floor come
    from group_figures, once every method's row is made)."""
    bwd = [s["bwd_ms"] for s in samples[method]]
    reg = [s["bwd_ms"] for s in samples["regular"]] if "regular" in samples else None
    med, iqr = median_iqr(bwd)
    row = {"bwd_ms": med, "iqr_ms": iqr, "samples_bwd_ms": bwd,
           "fwd_ms": median(s["fwd_ms"] for s in samples[method]),
           "reduction_per_round": None if reg is None else per_round_median(bwd, reg),
           "peak_mem_bytes": max(s["peak"] for s in samples[method])}
    if method in ATTENTION:
        row.update(collider_figures(samples[method], row, ideal, bwd, reg))
    return row


def group_figures(methods: dict) -> None:
    """Each method's reduction against regular, share of the FLOP ideal and ratio to the floor, by the
    function the C++ engine writes its rows with (collider._measure.group_figures, measuring/figures.h);
    None where regular or the floor did not run. bwd_ms includes the filter_backward call, so it is the
    whole cost; every method but the floor is held to the floor at the point's T'."""
    roles = {"regular": "baseline", "floor": "floor"}
    rows = [{"role": roles.get(label, "method"), "cost_ms": fig["bwd_ms"], "flop_ideal": fig.get("ideal"), "t_prime": 0}
            for label, fig in methods.items()]
    for fig, figures in zip(methods.values(), collider._measure.group_figures(rows)):
        fig.update(reduction=figures["reduction"], of_ideal=figures["of_ideal"], vs_floor=figures["vs_floor"])


@dataclass
class Point:
    """One point of the sweep: the preset's shapes, attn_implementation, T and checkpointing."""
    shapes: str
    attn: str
    T: int
    checkpointing: str


def bench_point(p: Point, args, dev: torch.device, methods: tuple) -> dict:
    dims, B, recompute = SHAPES[p.shapes], args.batch, p.checkpointing == "layers"
    model = build_model(p.shapes, p.attn, p.T, p.checkpointing, dev, args.seed)
    plan, trace_s = None, None
    if any(m in ATTENTION for m in methods):
        t0 = time.perf_counter()
        with autocast(dev, args.bf16):  # the steps' graph: traced under the steps' autocast
            plan = chf.trace_plan(model, loss="per_token")
        trace_s = time.perf_counter() - t0
    batch = make_batch(dims["vocab_size"], B, p.T, args.filter_ratio, args.layout, args.seed, dev)
    clock = Clock(dev)
    samples = side_by_side(lambda m: run_once(model, plan, batch, m, clock, args.bf16), methods, args.warmup, args.reps)
    model.zero_grad(set_to_none=True)
    N, dense = batch.kept, backward_flops(dims, B, p.T, batch.kept, "dense", recompute)
    fwd = forward_flops(dims, 1, p.T)
    point = {"source": "bench_hf_backward", "model": f"{p.shapes} (transformers LlamaForCausalLM)",
             "shapes": p.shapes, "num_params": sum(q.numel() for q in model.parameters()),
             "attn_implementation": p.attn, "seq_len": p.T, "batch_size": B, "filter_ratio": args.filter_ratio,
             "kept": N, "labelled": p.T - 1, "reps": args.reps, "warmup": args.warmup, "order": "serpentine",
             "attention_linear_ratio": fwd["attention"] / fwd["linear"],
             "plan": plan.summary() if plan else "not traced (no Collider method)", "plan_trace_s": trace_s,
             "checkpointing": p.checkpointing, "layout": args.layout, "labelled_per_row": batch.labelled,
             "methods": {}}
    for method in methods:
        ideal = None
        if method in ATTENTION:
            ideal = 1 - backward_flops(dims, B, p.T, N, ATTENTION[method], recompute) / dense
        point["methods"][method] = method_figures(samples, method, ideal)
    group_figures(point["methods"])
    return point


# ---- rows ---------------------------------------------------------------------------------------
def row_method(label: str) -> tuple:
    """A method's (method, attention_grad) in the result rows of DESIGN.md section 6; the floor is
    regular at S = T' + 1 tokens with floor_of = T, as the C++ sweeps' floor points."""
    if label in ATTENTION:
        return "collider", ATTENTION[label]
    return ("regular" if label == "floor" else label), "none"


def result_rows(point: dict) -> list:
    """One result row per method, keyed as the C++ sweeps' rows (DESIGN.md section 6: experiment,
    point_id, status, model, seq_len, batch_size, filter_ratio, method, attention_grad, dtype, device,
    provenance; bwd_ms, bwd_ms_rel_iqr, fwd_ms, flop_ideal_bwd_reduction, peak_mem_bytes, floor_of),
    with the point's other keys and the method's figures beside them (label: the table's method name)."""
    rows = []
    for label, fig in point["methods"].items():
        method, grad = row_method(label)
        floor = label == "floor"
        seq_len = point["kept"] + 1 if floor else point["seq_len"]
        ratio = 0.0 if floor else point["filter_ratio"]
        point_id = (f"{point['shapes']}/{point['attn_implementation']}/T{seq_len}/B{point['batch_size']}/f{ratio}/"
                    f"{method}/{grad}/{point['checkpointing']}/{point['layout']}" + ("/floor" if floor else ""))
        row = {k: v for k, v in point.items() if k != "methods"}
        row.update(fig)
        row.update(experiment="bench_hf_backward", point_id=point_id, status="ok", error=None, seq_len=seq_len,
                   filter_ratio=ratio, method=method, attention_grad=grad, label=label,
                   floor_of=point["seq_len"] if floor else None,
                   bwd_ms_rel_iqr=fig["iqr_ms"] / fig["bwd_ms"] if fig["bwd_ms"] else 0.0,
                   flop_ideal_bwd_reduction=fig.get("ideal"))
        rows.append(row)
    return rows


# ---- output -------------------------------------------------------------------------------------
def cell(x, spec: str, width: int, scale: float = 1.0, suffix: str = "") -> str:
    return f"{'-':>{width}}" if x is None else f"{format(x * scale, spec)}{suffix}".rjust(width)


def print_point(p: dict) -> None:
    print(f"\n{p['shapes']} ({p['attn_implementation']}, {p['device']} {p['dtype']})  T={p['seq_len']}  "
          f"B={p['batch_size']}  T'={p['kept']} of {p['labelled_per_row']} labelled  {p['layout']}  "
          f"checkpointing {p['checkpointing']}  attention/linear FLOPs {p['attention_linear_ratio']:.3f}  "
          f"[{p['plan']}]")
    print(f"  {'method':22} {'fwd_ms':>9} {'bwd_ms':>9} {'IQR':>7} {'reduction':>10} {'ideal':>7} {'of ideal':>9} "
          f"{'vs floor':>9} {'call_ms':>8} {'rewrite':>8} {'py ovh':>8} {'ovh/bwd':>8} {'peak_MiB':>9}")
    for m, r in p["methods"].items():
        g = r.get
        print(f"  {m:22} {r['fwd_ms']:9.2f} {r['bwd_ms']:9.2f} {r['iqr_ms']:7.2f} "
              f"{cell(g('reduction'), '.1f', 10, 100, '%')} {cell(g('ideal'), '.1f', 7, 100, '%')} "
              f"{cell(g('of_ideal'), '.3f', 9)} {cell(g('vs_floor'), '.2f', 9, 1, 'x')} "
              f"{cell(g('filter_call_ms'), '.2f', 8)} {cell(g('rewrite_ms'), '.2f', 8)} "
              f"{cell(g('python_overhead_ms'), '.3f', 8)} {cell(g('python_overhead_of_bwd'), '.2f', 8, 100, '%')} "
              f"{r['peak_mem_bytes'] / 2**20:9.1f}")


def parse_methods(text: str) -> tuple:
    """--methods' comma list, in METHODS' order (then OPTIONAL_METHODS'); collider_kept_only is collider
    kept_only."""
    known = METHODS + OPTIONAL_METHODS
    asked = {m.strip().replace("collider_", "collider ", 1) for m in text.split(",") if m.strip()}
    unknown = sorted(asked - set(known))
    if unknown or not asked:
        raise SystemExit(f"error: --methods {text!r}: unknown {unknown}; give a comma list of "
                         f"{', '.join(m.replace(' ', '_') for m in known)}")
    return tuple(m for m in known if m in asked)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast, fp32 weights (CUDA only)")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="tinyllama-mini", help="the preset's shapes")
    ap.add_argument("--methods", default=",".join(m.replace(" ", "_") for m in METHODS),
                    help="comma list of the methods to run (default: all)")
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
    ap.add_argument("--json", default=None, help="append the result rows (one per method and point) to this file")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda, but torch sees no CUDA device: run on a GPU machine or pass --device cpu")
    if args.bf16 and args.device != "cuda":
        ap.error("--bf16 needs --device cuda (CPU runs are fp32): drop --bf16 or pass --device cuda")
    if args.reps < 1 or args.warmup < 0:
        ap.error(f"--reps {args.reps} --warmup {args.warmup}: give at least one timed round and no negative warm-up")
    if not set(args.checkpointing.split(",")) <= {"none", "layers"}:
        ap.error(f"--checkpointing takes none and layers, got {args.checkpointing}")
    return args


def main() -> int:
    args = parse_args()
    methods, dev = parse_methods(args.methods), torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    allocator = collider._measure.install_caching_cpu_allocator() if args.allocator == "caching" else "system"
    prov = provenance(allocator, dev, args.bf16)
    print(f"# {' '.join([Path(sys.argv[0]).name] + sys.argv[1:])}")
    print("# " + ", ".join(f"{k} {v}" for k, v in prov.items()))
    for attn in args.attn.split(","):
        for T in (int(t) for t in args.seq.split(",")):
            for mode in args.checkpointing.split(","):
                point = {**bench_point(Point(args.shapes, attn, T, mode), args, dev, methods), **prov}
                print_point(point)
                if args.json:
                    with open(args.json, "a") as f:
                        for row in result_rows(point):
                            f.write(json.dumps({**row, "command": " ".join(sys.argv)}) + "\n")
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
