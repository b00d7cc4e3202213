"""Check: do two or more runs of the same timing manifest agree? For every change vs regular
(method, model, T, batch, filter ratio) present in every run, the runs agree when each pair's
difference is at most the sum of their printed spreads (the +- of the tables,
common.summarize_filtering). The changes are the engine's group figures in the rows (`reduction`,
the backward with its rewrite; `step_reduction` for --metric step_ms); the spread is the rounds'.
Also: whether loss_only stays inside each group's A/A band (it does
regular's work, so any difference is noise). Prints one line per change and a summary; exit status
1 when a pair disagrees or loss_only leaves its band.
  python plots/compare_runs.py --results results/tab_backward_time/RUN_A/results.jsonl \
      results/tab_backward_time/RUN_B/results.jsonl [--metric bwd_ms] [--methods collider]
Tested by tests/test_plots.cpp.
"""
import argparse
import itertools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", nargs="+", required=True, help="one results.jsonl per run (two or more)")
    p.add_argument("--metric", default="bwd_ms", choices=["bwd_ms", "step_ms"],
                   help="bwd_ms (backward table) or step_ms (end to end)")
    p.add_argument("--methods", default="collider",
                   help="comma-separated method-key prefixes whose agreement is checked (default collider)")
    args = p.parse_args()
    if len(args.results) < 2:
        sys.exit("error: give two or more results files")
    runs = []
    for path in args.results:
        rows = common.load_rows([path], require=["model", "method", "seq_len", "batch_size", args.metric])
        runs.append({(r["model"], r["seq_len"], r["batch_size"], r["filter_ratio"], r["method"]): r
                     for r in common.summarize_filtering(rows, args.metric)})
    prefixes = tuple(s.strip() for s in args.methods.split(",") if s.strip())
    keys = sorted(set.intersection(*(set(r) for r in runs)), key=lambda k: tuple(map(str, k)))
    checked = disagree = 0
    for key in keys:
        if not key[4].startswith(prefixes):
            continue
        recs = [run[key] for run in runs]
        if any(math.isnan(r["spread"]) for r in recs):
            continue
        checked += 1
        worst = max(abs(a["reduction"] - b["reduction"]) - (a["spread"] + b["spread"])
                    for a, b in itertools.combinations(recs, 2))
        ok = worst <= 1e-12
        disagree += not ok
        cells = "  ".join(f"{-100 * r['reduction']:+6.1f}% +-{100 * r['spread']:.1f}" for r in recs)
        print(f"{'agree   ' if ok else 'DISAGREE'} {key[0]} T={key[1]} B={key[2]} {common.label(key[4])}: {cells}")
    outside = band_checked = 0
    for run, path in zip(runs, args.results):
        for key, r in run.items():
            if key[4] != "loss_only" or math.isnan(r["band"]):
                continue
            band_checked += 1
            if abs(r["reduction"]) > r["band"]:
                outside += 1
                print(f"OUTSIDE  {path}: {key[0]} T={key[1]} loss_only {-100 * r['reduction']:+.1f}% "
                      f"vs A/A band {100 * r['band']:.1f}%")
    print(f"{checked - disagree} of {checked} changes agree within their printed spread across "
          f"{len(runs)} runs; loss_only inside the A/A band in {band_checked - outside} of {band_checked} groups")
    if checked == 0:
        sys.exit("error: no change with a spread in every run (interleaved rows, run.repetitions > 1, needed)")
    return 1 if disagree or outside else 0


if __name__ == "__main__":
    sys.exit(main())
