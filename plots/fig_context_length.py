"""Figure: backward-time reduction vs regular as the sequence length grows, one panel per model
and filter ratio, one line per method, each with its FLOP ideal dashed (on CPU, attention's T x T
element-wise work grows with T^2; DESIGN.md section 7). The reductions are the engine's group
figures in the rows (the backward's counts the rewrite; DESIGN.md section 6).
  python plots/fig_context_length.py --results results/fig_context_length/*/results.jsonl --out plots/out
  (--metric step_ms draws the end-to-end step instead). Writes fig_context_length.png/.pdf
(fig_context_length_step_ms.* for --metric step_ms). Tested by tests/test_plots.cpp.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main() -> None:
    common.reduction_figure(__doc__, "seq_len", ["model", "filter_ratio"], "sequence length T (tokens)",
                            "sequence length", "fig_context_length", logx=True)


if __name__ == "__main__":
    main()
