"""Shared body of tab_backward_time.py and tab_end_to_end.py: one row per model, sequence length,
filter ratio and method, with time, reduction vs regular, the FLOP ideal, reduction / ideal, and
the T' floor (DESIGN.md section 7). Not run directly; see those two scripts.
"""
from __future__ import annotations

import math

import common


def make_table(description: str, stem: str, metric: str, end_to_end: bool) -> None:
    args = common.parse_args(description)
    rows = common.load_rows(args.results, require=["model", "method", "seq_len", "batch_size", metric])
    recs = common.summarize_filtering(rows, metric, end_to_end=end_to_end)
    reg = common.regular_index(rows, metric)
    what = "step" if end_to_end else "backward"
    headers = ["Model", "T", "B", "Filtered", "Method", f"{what} (ms)", "vs regular", "FLOP ideal",
               "of ideal", "T'", f"T' floor (ms)", "over floor"]
    table = []
    shown_regular = set()
    for rec in recs:
        if rec["filter_ratio"] in (None, 0) and rec["method"] != "masked":
            continue
        key = (rec["model"], rec["batch_size"], rec["seq_len"])
        if key not in reg:
            common.warn(f"no regular rows for {key}; {rec['method']} at filter_ratio {rec['filter_ratio']} "
                        "is shown without reductions")
        base_key = key + (rec["filter_ratio"],)
        if key in reg and base_key not in shown_regular:
            shown_regular.add(base_key)
            table.append([rec["model"], rec["seq_len"], rec["batch_size"], f"{rec['filter_ratio']:.0%}",
                          common.label("regular"), common.fmt_ms(reg[key][metric]), "", "", "", "", "", ""])
        over = rec["value"] / rec["floor"] - 1 if rec["floor"] and not math.isnan(rec["floor"]) else float("nan")
        t_prime = "n/a" if math.isnan(rec["t_prime"]) else f"{rec['t_prime']:g}"
        table.append([rec["model"], rec["seq_len"], rec["batch_size"], f"{rec['filter_ratio']:.0%}",
                      common.label(rec["method"]), common.fmt_ms(rec["value"]), common.pct(-rec["reduction"]),
                      common.pct(-rec["ideal"]), common.fmt_ratio(rec["of_ideal"]), t_prime,
                      common.fmt_ms(rec["floor"]), common.pct(over)])
    if not table:
        raise SystemExit("error: no filtering rows (loss_only / collider / forward_drop at filter_ratio > 0) to tabulate")
    floor_note = ("T' floor: regular's backward on T' tokens per sequence" if not end_to_end else
                  "T' floor: this method's step with its backward replaced by regular's backward on T' tokens")
    caption = (f"{'End-to-end step' if end_to_end else 'Backward'} time, median over measured steps and "
               f"repetitions; vs regular = time change; FLOP ideal = change in analytic "
               f"{'forward+backward' if end_to_end else 'backward'} FLOPs; of ideal = reduction / ideal; "
               f"{floor_note}. Device: {common.describe_device(rows)}.")
    common.write_table(args.out, stem, headers, table, caption, align="lrrrlrrrrrrr")
