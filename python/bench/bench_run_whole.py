"""Backward time of models with nodes that run whole (DESIGN.md section 3: a node that cannot be cut row
by row runs at full size, its dropped rows detached at its inputs), every method side by side in one
process, on transformers models at CPU scale:

  hybrid   Qwen3.5 text (Qwen3_5ForCausalLM): 3 gated delta rule layers (a short convolution and a
           chunked scan along the tokens, transformers' reference torch path: run whole) and 1 full
           attention layer; D 512, FFN 1536, vocabulary 8192.
  vlm      LLaVA (LlavaForConditionalGeneration) with one image per row: a CLIP vision tower (image 112,
           patch 14: 64 image tokens at the start of each row, D 256, 4 layers), its projector, and a
           Llama text model (D 512, FFN 1536, 4 layers, vocabulary 8192). The image features are
           scattered into the token rows (masked_scatter: run whole); the loss is on the text only.

Methods, as bench_hf_backward.py runs them (the C++ engine's interleaved serpentine rounds, medians
with IQR): regular (dense backward of the mean over the labelled positions), collider kept_only and
collider exact_query (filter_backward, the check off, then the backward), floor (regular's backward on
the first S positions of each row: the image and T' text positions, what a backward that never saw
the dropped tokens costs).

FLOPs are counted, not modelled: every op of one untimed backward per method goes through torch's FLOP
formulas (torch.utils.flop_counter: matmuls, convolutions, attention kernels; element-wise work is not
counted), attributed to the autograd node that ran it (torch._C._current_autograd_node). So
  ideal        = 1 - Collider's backward FLOPs / regular's: the FLOP ideal counted with the nodes run
                 whole at full size (they run at full size), and with every other node at its kept rows;
  full size    = the share of Collider's backward FLOPs spent in nodes that did regular's work: the
                 nodes run whole and those between them (a chunked scan's matmuls over its chunks),
                 and nodes without token rows (a vision tower: it gets the image rows' gradient, zero
                 under kept_only, where they are dropped). A node's place in the graph (breadth first
                 from the loss) matches it to regular's;
  of ideal     = the measured backward reduction over that ideal.
peak_MiB: the step's live tensors at their most (the caching CPU allocator's count).
The hybrid runs at T = 500 by default: the reference scan skips its padding at a multiple of its chunk
(64), where no second length gives the same graph to trace a plan on (collider.hf.trace_plan(model,
seq_len=T) traces at T and T - 1).
  python python/bench/bench_run_whole.py                                  # both models, 5 rounds
  python python/bench/bench_run_whole.py --models hybrid --seq 500 --reps 3 --json out.jsonl
CPU numbers are CPU scale. Not a test: nothing here asserts a speed.
Legend: B batch, T sequence, T' kept text positions per row, S the floor's sequence.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hf_backward import (Clock, chf, collider, group_figures, method_figures, provenance,  # noqa: E402
                               side_by_side)

METHODS = ("regular", "collider kept_only", "collider exact_query", "floor")
ATTENTION = {"collider kept_only": "kept_only", "collider exact_query": "exact_query"}
VOCAB, IMAGE_TOKENS = 8192, 64


# ---- the models ---------------------------------------------------------------------------------
def hybrid_model():
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=8,
        linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        layer_types=["linear_attention"] * 3 + ["full_attention"], attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(config)


def mamba_model():
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(
        "bamba", vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, attn_layer_indices=[3], mamba_n_heads=16, mamba_d_head=64,
        mamba_n_groups=1, mamba_d_state=64, mamba_chunk_size=256, attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(config)


def vlm_model():
    from transformers import CLIPVisionConfig, LlamaConfig, VideoLlavaConfig, VideoLlavaForConditionalGeneration
    vision = CLIPVisionConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                              image_size=112, patch_size=14)
    text = LlamaConfig(vocab_size=VOCAB + 1, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=1)
    config = VideoLlavaConfig(vision_config=vision, text_config=text, image_token_index=VOCAB,
                              video_token_index=VOCAB + 1, vision_feature_layer=-2,
                              vision_feature_select_strategy="default")
    config.text_config.vocab_size = VOCAB + 2
    config._attn_implementation = "sdpa"
    return VideoLlavaForConditionalGeneration(config)


MODELS = {"hybrid": ("Qwen3.5 text, 3 gated delta rule + 1 attention layers (transformers Qwen3_5ForCausalLM)",
                     hybrid_model, 0),
          "mamba": ("Bamba, 3 Mamba2 + 1 attention layers (transformers BambaForCausalLM)", mamba_model, 0),
          "vlm": ("Video-LLaVA, CLIP vision tower + Llama text, one image per row (transformers "
                  "VideoLlavaForConditionalGeneration)", vlm_model, IMAGE_TOKENS)}


# ---- one point ----------------------------------------------------------------------------------
@dataclass
class Batch:
    """The rows [B, T] (the image's tokens first, where there is one) and the floor's first S positions."""
    forward: dict  # input_ids (and pixel_values)
    labels_BT: torch.Tensor
    valid_BT: torch.Tensor  # the labelled positions (text)
    keep_BT: torch.Tensor
    floor: dict
    floor_labels: torch.Tensor
    floor_valid: torch.Tensor
    kept: int  # T' per row


def make_batch(image_tokens: int, B: int, T: int, ratio: float, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T), generator=gen)
    forward = {}
    if image_tokens:
        ids[:, :image_tokens] = VOCAB  # the image token id
        forward["pixel_values_images"] = torch.randn(B, 3, 112, 112, generator=gen)
    labels = ids.clone()
    labels[:, :image_tokens] = -100  # no loss on the image
    valid = chf.keep_mask_from_labels(labels)
    keep = collider.select_tokens(torch.rand(B, T, generator=gen), ratio, valid=valid)
    kept = int(keep.sum(1)[0])
    S = image_tokens + kept + 1
    floor = {**forward, "input_ids": ids[:, :S]}
    return Batch({"input_ids": ids, **forward}, labels, valid, keep, floor, labels[:, :S],
                 chf.keep_mask_from_labels(labels[:, :S]), kept)


def method_loss(model, batch: Batch, method: str) -> torch.Tensor:
    if method == "floor":
        logits = model(**batch.floor, use_cache=False).logits
        return chf.masked_mean(chf.token_losses(logits, batch.floor_labels), batch.floor_valid)
    logits = model(**batch.forward, use_cache=False).logits
    mask = batch.valid_BT if method == "regular" else batch.keep_BT
    return chf.masked_mean(chf.token_losses(logits, batch.labels_BT), mask)


def run_once(model, plan, batch: Batch, method: str, clock: Clock) -> dict:
    """One step: times in ms (bwd_ms from the end of the forward, filter_backward included)."""
    model.zero_grad(set_to_none=True)
    clock.reset_peak()
    t0 = clock.now()
    loss = method_loss(model, batch, method)
    t1 = clock.now()
    sample = {}
    if method in ATTENTION:
        stats = collider.filter_backward(loss, batch.keep_BT, plan, attention=ATTENTION[method], check_every=0)
        sample.update(rewrite_ms=stats.rewrite_ms, call_ms=(clock.now() - t1) * 1e3)
    loss.backward()
    t2 = clock.now()
    return {**sample, "fwd_ms": (t1 - t0) * 1e3, "bwd_ms": (t2 - t1) * 1e3, "peak": clock.peak()}


class NodeFlops(TorchDispatchMode):
    """FLOPs of every op with a torch FLOP formula, summed per autograd node that ran it."""

    def __init__(self):
        super().__init__()
        self.by_node: dict = {}  # id(node) -> FLOPs
        self.nodes: list = []  # keeps the node objects alive, so their ids stay theirs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            node = torch._C._current_autograd_node()
            self.nodes.append(node)
            key = id(node) if node is not None else None
            self.by_node[key] = self.by_node.get(key, 0) + formula(*args, **(kwargs or {}), out_val=out)
        return out


def node_order(loss) -> dict:
    """id(node) -> its place in the graph, breadth first from the loss: the same places in every step
    of one model and batch (the graphs are alike), read before filter_backward edits the graph (its
    cut nodes keep their identity; the nodes it inserts have none here)."""
    order, queue, nodes = {}, [loss.grad_fn], []
    while queue:
        node = queue.pop(0)
        if node is None or id(node) in order:
            continue
        order[id(node)] = len(nodes)
        nodes.append(node)
        queue.extend(n for n, _ in node.next_functions)
    order[None] = nodes  # keeps them alive, so their ids stay theirs
    return order


def counted_flops(model, plan, batch: Batch, method: str) -> dict:
    """One untimed step: its backward's FLOPs, by node place (-1: nodes Collider inserted, or none)."""
    model.zero_grad(set_to_none=True)
    loss = method_loss(model, batch, method)
    order = node_order(loss)
    if method in ATTENTION:
        collider.filter_backward(loss, batch.keep_BT, plan, attention=ATTENTION[method], check_every=0)
    counter = NodeFlops()
    with counter:
        loss.backward()
    model.zero_grad(set_to_none=True)
    by_place: dict = {}
    for key, f in counter.by_node.items():
        place = order.get(key, -1) if key is not None else -1
        by_place[place] = by_place.get(place, 0) + f
    return by_place


def full_size_flops(mine: dict, regular: dict) -> float:
    """The FLOPs of the nodes that did regular's work: run whole, or without token rows (a vision tower)."""
    return sum(f for place, f in mine.items() if place >= 0 and f > 0 and f == regular.get(place))


def method_row(samples: dict, method: str, flops: dict) -> dict:
    """bench_hf_backward's row of a method (times, IQR, per-round reduction, peak, the filter call's cost),
    with the FLOP ideal and the full-size share from the counted FLOPs."""
    total = sum(flops[method].values())
    ideal = 1 - total / sum(flops["regular"].values()) if method in ATTENTION else None
    row = method_figures(samples, method, ideal)
    row["bwd_flops"] = total
    if method in ATTENTION:
        row["full_size_share"] = full_size_flops(flops[method], flops["regular"]) / total
    return row


def bench_point(name: str, T: int, args) -> dict:
    what, build, image_tokens = MODELS[name]
    torch.manual_seed(args.seed)
    model = build().train()
    plan = chf.trace_plan(model, loss="per_token", seq_len=T) if not image_tokens else None
    batch = make_batch(image_tokens, args.batch, T, args.filter_ratio, args.seed)
    if plan is None:  # the image's rows: traced on batches with an image per row (collider.trace_plan)
        def loss_on_random_batch(b: int, t: int) -> torch.Tensor:
            traced = make_batch(image_tokens, b, t, 0.5, b * t)
            return method_loss(model, traced, "collider kept_only")
        plan = collider.trace_plan(loss_on_random_batch, (3, image_tokens + 53, 5, image_tokens + 61))
    # The gradients: Collider's check against mask_backward once on each semantics, before any timing.
    for attention in ATTENTION.values():
        loss = method_loss(model, batch, "collider kept_only")
        stats = collider.filter_backward(loss, batch.keep_BT, plan, attention=attention, validate=True)
        loss.backward()
    clock = Clock(torch.device("cpu"))
    flops = {m: counted_flops(model, plan, batch, m) for m in METHODS}
    samples = side_by_side(lambda m: run_once(model, plan, batch, m, clock), METHODS, args.warmup, args.reps)
    point = {"source": "bench_run_whole", "model": what, "name": name, "seq_len": T, "batch_size": args.batch,
             "image_tokens": image_tokens, "filter_ratio": args.filter_ratio, "kept": batch.kept,
             "floor_seq_len": image_tokens + batch.kept + 1, "labelled": T - image_tokens - 1,
             "nodes_run_whole": stats.nodes_run_whole, "reps": args.reps, "warmup": args.warmup,
             "order": "serpentine", "plan": plan.summary(),
             "num_params": sum(q.numel() for q in model.parameters()), "methods": {}}
    for method in METHODS:
        point["methods"][method] = method_row(samples, method, flops)
    group_figures(point["methods"])  # reduction, of_ideal, vs_floor against regular and the floor
    return point


# ---- output -------------------------------------------------------------------------------------
def print_point(p: dict) -> None:
    print(f"\n{p['model']}  T={p['seq_len']}  B={p['batch_size']}  T'={p['kept']} of {p['labelled']} labelled"
          f"  image tokens {p['image_tokens']}  floor S={p['floor_seq_len']}  nodes run whole "
          f"{p['nodes_run_whole']}  [{p['plan']}]")
    print(f"  {'method':22} {'fwd_ms':>9} {'bwd_ms':>9} {'IQR':>7} {'reduction':>10} {'ideal':>7} {'of ideal':>9} "
          f"{'vs floor':>9} {'GFLOP':>8} {'full size':>9} {'peak_MiB':>9}")
    pct = lambda x: "-".rjust(7) if x is None else f"{100 * x:6.1f}%"
    for m, r in p["methods"].items():
        print(f"  {m:22} {r['fwd_ms']:9.1f} {r['bwd_ms']:9.1f} {r['iqr_ms']:7.1f} {pct(r.get('reduction')):>10} "
              f"{pct(r.get('ideal'))} {'-' if r.get('of_ideal') is None else format(r['of_ideal'], '.3f'):>9} "
              f"{'-' if r.get('vs_floor') is None else format(r['vs_floor'], '.2f') + 'x':>9} "
              f"{r['bwd_flops'] / 1e9:8.2f} {pct(r.get('full_size_share')):>9} {r['peak_mem_bytes'] / 2**20:9.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="hybrid,mamba,vlm", help="comma list of " + ", ".join(MODELS))
    ap.add_argument("--seq", type=int, default=500)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--filter-ratio", type=float, default=0.4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="append one row per model and method to this file")
    args = ap.parse_args()
    names = [n for n in args.models.split(",") if n]
    if not names or set(names) - set(MODELS):
        ap.error(f"--models {args.models!r}: give a comma list of {', '.join(MODELS)}")
    if args.seq <= IMAGE_TOKENS + 8 or args.reps < 1 or args.warmup < 0:
        ap.error(f"--seq {args.seq} --reps {args.reps} --warmup {args.warmup}: give a sequence longer than "
                 f"{IMAGE_TOKENS + 8}, at least one round and no negative warm-up")
    allocator = collider._measure.install_caching_cpu_allocator()
    prov = provenance(allocator, torch.device("cpu"), False)
    print(f"# {' '.join([Path(sys.argv[0]).name] + sys.argv[1:])}")
    print("# " + ", ".join(f"{k} {v}" for k, v in prov.items()))
    for name in names:
        point = {**bench_point(name, args.seq, args), **prov}
        print_point(point)
        if args.json:
            with open(args.json, "a") as f:
                for label, fig in point["methods"].items():
                    row = {k: v for k, v in point.items() if k != "methods"}
                    f.write(json.dumps({**row, **fig, "label": label, "command": " ".join(sys.argv)}) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
