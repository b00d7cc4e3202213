"""Ragged rows (batch_topk) over per-sequence rows of the same total kept count, from runs of
experiments/bench_backward_ragged.toml: per run and per (model, attention_grad), the engine's
reduction vs regular of both rows (`reduction`, DESIGN.md section 6: 1 - (bwd_ms + rewrite_ms) /
regular's bwd_ms, measured in the same group) and the ratio of their costs it gives,
(1 - ragged's) / (1 - per-sequence's) = ragged's `bwd_ms + rewrite_ms` over per-sequence's; the
median of the rounds' ratios (`repetition_bwd_ms`, backward alone), and over all runs given the
median of every round's ratio. Prints text; the 5% target of results/bench_backward_ragged/README.md
is read from it.
  python3 plots/ragged_ratio.py results/bench_backward_ragged/RUN [RUN ...]
"""
import json, sys, statistics as st
from collections import defaultdict
pooled = defaultdict(list)
for path in sys.argv[1:]:
    rows = [json.loads(l) for l in open(path + "/results.jsonl")]
    ok = [r for r in rows if r.get("status") == "ok"]
    # The engine's group figures; rows written before the engine wrote them lack the keys.
    if any("reduction" not in r for r in ok):
        sys.exit(f"error: {path}/results.jsonl: rows lack the engine's group figures; add them with "
                 f"`build/collider figures {path}/results.jsonl`")
    by = {}
    for r in ok:
        if r["method"] == "collider":
            by[(r["model"], r["attention_grad"], r.get("selection", "per_sequence"))] = r
    aa = [r["reduction"] for r in ok if r.get("aa_copy")]
    print(path.split("/")[-1], "A/A reductions", [round(x, 3) for x in aa if x is not None])
    for (model, grad, sel), r in sorted(by.items()):
        if sel != "batch_topk":
            continue
        p = by[(model, grad, "per_sequence")]
        cost = lambda x: x["bwd_ms"] + x["rewrite_ms"]
        ratio = (1 - r["reduction"]) / (1 - p["reduction"])  # both against the group's regular
        rounds = [a / b for a, b in zip(r["repetition_bwd_ms"], p["repetition_bwd_ms"])]
        pooled[(model, grad)] += rounds
        print(f"  {model:15} {grad:12} ragged {cost(r):8.1f} ({-100 * r['reduction']:+.1f}%) per-seq {cost(p):8.1f} "
              f"({-100 * p['reduction']:+.1f}%) ratio {ratio:.3f} "
              f"per-round median {st.median(rounds):.3f} rounds {[round(x,2) for x in rounds]} "
              f"rewrite {r['rewrite_ms']:.2f}/{p['rewrite_ms']:.2f} iqr {r['bwd_ms_rel_iqr']:.2f}/{p['bwd_ms_rel_iqr']:.2f}")
if len(sys.argv) > 2:
    print("pooled per-round ratios (bwd only, rewrite ~1.5 ms on both):")
    for k, v in sorted(pooled.items()):
        print(f"  {k[0]:15} {k[1]:12} median {st.median(v):.3f} of {len(v)} rounds")
