"""Backward of transformers' own LlamaForCausalLM at TinyLlama-1.1B's shapes (random weights, nothing
downloaded): regular, loss_only, Collider kept_only / exact_query through the Python package
(collider.trace_plan / filter_backward, DESIGN.md section 4b) and the T' floor, interleaved repetition
by repetition in one process, medians of the backward (Collider's counts its graph rewrite). One JSON
row per method; the FLOP ideal comes from the C++ sweep rows of the same shapes (summarize.py joins them).
  python3 scripts/device/hf_llama_backward.py --device cuda --bf16 --shapes tinyllama-1.1b --seq 2048 --batch 2
  python scripts/device/hf_llama_backward.py --device cpu --shapes tinyllama-debug --seq 128 --methods regular,loss_only
Run by scripts/device/run_gpu_checks.sh (rehearsed on the CPU; without the package only regular/loss_only run).
Legend: B batch, T sequence, V vocab, N kept tokens per sequence.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

# The paper models' shapes (models/llama.cpp presets of the same names).
SHAPES = {
    "tinyllama-1.1b": dict(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000),
    "tinyllama-debug": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=8,
                            num_key_value_heads=1, vocab_size=256),
}
ALL_METHODS = ["regular", "loss_only", "collider_kept_only", "collider_exact_query", "floor"]


def kept_count(T: int, filter_ratio: float, align: int = 8) -> int:
    """Kept positions per sequence under per_sequence selection: the drop count ceil(ratio * T),
    rounded up to a multiple of `align` (DESIGN.md section 2; 2048 -> 1224 at 0.4)."""
    drop = math.ceil(filter_ratio * T - 1e-9)
    drop = min(T, -(-drop // align) * align)
    return T - drop


def keep_mask(B: int, T: int, filter_ratio: float, device: torch.device, collider) -> torch.Tensor:
    scores_BT = torch.rand(B, T)
    if collider is not None:
        return collider.select_tokens(scores_BT, filter_ratio).to(device)
    N = kept_count(T, filter_ratio)
    keep_BT = torch.zeros(B, T, dtype=torch.bool)
    keep_BT.scatter_(1, scores_BT.topk(N, dim=1).indices, True)
    return keep_BT.to(device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (CUDA only), fp32 weights")
    ap.add_argument("--shapes", default="tinyllama-1.1b", choices=sorted(SHAPES))
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="transformers attn_implementation")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--filter-ratio", type=float, default=0.4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--methods", default=",".join(ALL_METHODS))
    ap.add_argument("--json", required=True, help="output JSONL, one row per method")
    a = ap.parse_args()
    methods = a.methods.split(",")
    unknown = sorted(set(methods) - set(ALL_METHODS))
    if unknown:
        raise SystemExit(f"error: unknown --methods {unknown}; choose from {ALL_METHODS}")
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device")
    if a.bf16 and dev.type != "cuda":
        raise SystemExit("error: --bf16 needs --device cuda (CPU runs are fp32)")
    try:
        import collider  # the project's Python package (python/); absent until it is installed
    except ImportError as e:
        if any(m.startswith("collider") for m in methods):
            raise SystemExit(f"error: the collider Python package is not importable ({e}); install it "
                             "(pip install --no-build-isolation ./python) or pass --methods regular,loss_only")
        collider = None
    import transformers

    cfg = transformers.LlamaConfig(**SHAPES[a.shapes], max_position_embeddings=max(2048, a.seq), rms_norm_eps=1e-5,
                                   rope_theta=10000.0, tie_word_embeddings=False, use_cache=False,
                                   attn_implementation=a.attn)
    torch.manual_seed(0)
    with torch.device(dev):  # initialise on the device: 1.1B parameters on the host take minutes
        model = transformers.LlamaForCausalLM(cfg)
    model.train()
    num_params = sum(p.numel() for p in model.parameters())
    V, B, T = cfg.vocab_size, a.batch, a.seq
    N = kept_count(T, a.filter_ratio)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def token_losses(ids_BT, labels_BT):
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=a.bf16):
            logits_BTV = model(input_ids=ids_BT, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits_BTV.float().flatten(0, 1), labels_BT.flatten(),
                                                 reduction="none").view_as(labels_BT)

    def masked_mean(loss_BT, keep_BT):
        w = keep_BT.to(loss_BT.dtype)
        return (loss_BT * w).sum() / w.sum()

    plan = None
    if collider is not None and any(m.startswith("collider") for m in methods):
        def loss_on_random_batch(b, t):
            ids = torch.randint(V, (b, t), device=dev)
            return masked_mean(token_losses(ids, torch.randint(V, (b, t), device=dev)),
                               torch.ones(b, t, dtype=torch.bool, device=dev))
        t0 = time.perf_counter()
        plan = collider.trace_plan(loss_on_random_batch)
        print(f"plan traced in {time.perf_counter() - t0:.1f} s")

    ids_BT = torch.randint(V, (B, T), device=dev)
    labels_BT = torch.randint(V, (B, T), device=dev)
    keep_BT = keep_mask(B, T, a.filter_ratio, dev, collider)
    ids_BN, labels_BN = ids_BT[:, :N].contiguous(), labels_BT[:, :N].contiguous()
    all_BT, all_BN = torch.ones_like(keep_BT), torch.ones(B, N, dtype=torch.bool, device=dev)

    def run_once(method):
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        if method == "floor":
            loss = masked_mean(token_losses(ids_BN, labels_BN), all_BN)
        else:
            loss = masked_mean(token_losses(ids_BT, labels_BT), all_BT if method == "regular" else keep_BT)
        sync()
        fwd_ms = (time.perf_counter() - t0) * 1e3
        rewrite_ms = 0.0
        if method.startswith("collider"):
            t0 = time.perf_counter()
            collider.filter_backward(loss, keep_BT, plan, attention=method[len("collider_"):])
            sync()
            rewrite_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        loss.backward()
        sync()
        return fwd_ms, rewrite_ms, (time.perf_counter() - t0) * 1e3

    samples = {m: [] for m in methods}
    for r in range(a.warmup + a.reps):
        for m in methods:
            s = run_once(m)
            if r >= a.warmup:
                samples[m].append(s)
    med = {m: tuple(statistics.median(s[i] for s in samples[m]) for i in range(3)) for m in methods}
    reg = med["regular"][2] if "regular" in med else float("nan")
    floor_ms = med["floor"][2] if "floor" in med else None
    base = {"source": "hf_llama_backward", "model": f"transformers LlamaForCausalLM ({a.shapes} shapes)",
            "shapes": a.shapes, "attn_implementation": a.attn, "seq_len": T, "batch_size": B,
            "filter_ratio": a.filter_ratio, "kept": N, "num_params": num_params, "device": dev.type,
            "device_name": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
            "dtype": "bf16" if a.bf16 else "fp32", "torch_version": torch.__version__,
            "cuda_version": torch.version.cuda, "transformers_version": transformers.__version__,
            "collider_package": getattr(collider, "__version__", "present") if collider else None,
            "reps": a.reps, "warmup": a.warmup}
    with open(a.json, "w") as f:
        print(f"{'method':24s} {'fwd_ms':>9s} {'rewrite_ms':>10s} {'bwd_ms':>9s} {'vs regular':>10s}")
        for m in methods:
            fwd, rw, bwd = med[m]
            red = 1 - (bwd + rw) / reg if m != "regular" else 0.0
            print(f"{m:24s} {fwd:9.2f} {rw:10.2f} {bwd:9.2f} {100 * -red:9.1f}%")
            method, grad = (("collider", m[len("collider_"):]) if m.startswith("collider") else (m, None))
            row = dict(base, method=method, attention_grad=grad, fwd_ms=fwd, rewrite_ms=rw, bwd_ms=bwd,
                       reduction=red, floor_ms=floor_ms, samples_bwd_ms=[s[2] for s in samples[m]])
            f.write(json.dumps(row) + "\n")
    print(f"rows: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
