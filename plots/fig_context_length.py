"""Figure: backward-time reduction vs regular as the sequence length grows, one panel per model
and filter ratio, one line per method, each with its FLOP ideal dashed (on CPU, attention's T x T
element-wise work grows with T^2; DESIGN.md section 7).
  python plots/fig_context_length.py --results results/fig_context_length/*/results.jsonl --out plots/out
  (--metric step_ms draws the end-to-end step instead). Writes fig_context_length.png/.pdf
(fig_context_length_step_ms.* for --metric step_ms). Tested by tests/test_plots.cpp.
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
        recs, "seq_len", ["model", "filter_ratio"], "sequence length T (tokens)",
        f"{what} time reduction vs regular (%)",
        f"{what.capitalize()} time reduction vs sequence length (dashed: FLOP ideal)\n"
        f"{common.describe_device(rows)}", args.out,
        "fig_context_length" if args.metric == "bwd_ms" else "fig_context_length_step_ms", logx=True)


if __name__ == "__main__":
    main()
