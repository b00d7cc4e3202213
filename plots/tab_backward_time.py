"""Table: backward time of regular, loss_only, Collider (kept_only, exact_query) and forward_drop per model and
sequence length, the reduction vs regular, the FLOP ideal, reduction / ideal and the T' floor
(the paper's backward-time table; DESIGN.md section 7; forward_drop's T' is its middle layers' count).
  python plots/tab_backward_time.py --results results/tab_backward_time/*/results.jsonl --out plots/out
Writes tab_backward_time.md and .tex. Tested by tests/test_plots.cpp.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _reduction_table import make_table  # noqa: E402

if __name__ == "__main__":
    make_table(__doc__.splitlines()[0], "tab_backward_time", "bwd_ms", end_to_end=False)
