"""Shared loading for tab_utility.py and fig_utility_curves.py: training rows (DESIGN.md section 6:
step, train_loss, val_loss, val_ppl, eval_set) grouped into runs. Not run directly.
A run is (experiment, model, method key, filter_ratio, seed); `step` counts optimizer steps done.
"""
from __future__ import annotations

import common

RUN_KEYS = ["experiment", "model", "_key", "filter_ratio", "seed"]


def load_runs(paths):
    rows = common.load_rows(paths, require=["model", "method", "step"])
    runs = common.group(rows, RUN_KEYS)
    return rows, runs


def run_label(run_key) -> str:
    _, model, key, ratio, seed = run_key
    extra = f", filtered {ratio:.0%}" if ratio else ""
    seed_txt = f", seed {seed}" if seed is not None else ""
    return f"{common.label(key)}{extra}{seed_txt}"


def per_step(rows, field):
    """{step: median of field} over rows that have it (rows repeat per eval_set)."""
    steps = common.group([r for r in rows if r.get(field) is not None], ["step"])
    return {s[0]: common.median(r[field] for r in grp) for s, grp in sorted(steps.items())}
