"""Figure: backward-time reduction vs regular as the filter ratio grows (0.1 ... 0.9), one panel per
model and sequence length, one line per method (loss_only, Collider kept_only / exact_query), each
with its FLOP ideal dashed (DESIGN.md section 7).
  python plots/fig_filter_ratio.py --results results/fig_filter_ratio/*/results.jsonl --out plots/out
  (--metric step_ms draws the end-to-end step instead). Writes fig_filter_ratio.png/.pdf
(fig_filter_ratio_step_ms.* for --metric step_ms). Tested by tests/test_plots.cpp.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], lambda p: p.add_argument(
        "--metric", default="bwd_ms", choices=["bwd_ms", "step_ms"], help="time to reduce"))
    rows = common.load_rows(args.results, require=["model", "method", "seq_len", "batch_size",
                                                   "filter_ratio", args.metric])
    recs = [r for r in common.summarize_filtering(rows, args.metric, end_to_end=args.metric == "step_ms")
            if r["filter_ratio"]]
    if not recs:
        sys.exit("error: no filtering rows with filter_ratio > 0 and a matching regular baseline")
    what = "backward" if args.metric == "bwd_ms" else "end-to-end step"
    common.plot_reduction_vs(
        recs, "filter_ratio", ["model", "seq_len"], "filter ratio (fraction of tokens dropped)",
        f"{what} time reduction vs regular (%)",
        f"{what.capitalize()} time reduction vs filter ratio (dashed: FLOP ideal)\n"
        f"{common.describe_device(rows)}", args.out,
        "fig_filter_ratio" if args.metric == "bwd_ms" else "fig_filter_ratio_step_ms")


if __name__ == "__main__":
    main()
