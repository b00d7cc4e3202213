"""Figure: backward-time reduction vs regular as the filter ratio grows (0.1 ... 0.9), one panel per
model and sequence length, one line per method (loss_only, Collider kept_only / exact_query), each
with its FLOP ideal dashed (DESIGN.md section 7). The reductions are the engine's group figures in
the rows (the backward's counts the rewrite; DESIGN.md section 6).
  python plots/fig_filter_ratio.py --results results/fig_filter_ratio/*/results.jsonl --out plots/out
  (--metric step_ms draws the end-to-end step instead). Writes fig_filter_ratio.png/.pdf
(fig_filter_ratio_step_ms.* for --metric step_ms). Tested by tests/test_plots.cpp.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main() -> None:
    common.reduction_figure(__doc__, "filter_ratio", ["model", "seq_len"],
                            "filter ratio (fraction of tokens dropped)", "filter ratio", "fig_filter_ratio")


if __name__ == "__main__":
    main()
