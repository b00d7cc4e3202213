"""Table: end-to-end training-step time (forward + selection/rewrite + backward + optimizer) of
regular, loss_only, Collider and forward_drop per model and sequence length, the reduction vs regular, the FLOP
ideal (forward + backward FLOPs), reduction / ideal and the T' floor (the paper's end-to-end table).
  python plots/tab_end_to_end.py --results results/tab_end_to_end/*/results.jsonl --out plots/out
Writes tab_end_to_end.md and .tex. Tested by tests/test_plots.cpp.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _reduction_table import make_table  # noqa: E402

if __name__ == "__main__":
    make_table(__doc__.splitlines()[0], "tab_end_to_end", "step_ms", end_to_end=True)
