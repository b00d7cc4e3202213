"""Shared body of tab_backward_time.py and tab_end_to_end.py: one row per model, sequence length,
filter ratio and method, with time, reduction vs regular, the FLOP ideal, reduction / ideal, and
the T' floor (DESIGN.md section 7). Not run directly; see those two scripts.

The reductions, shares of the ideal and ratios to the floor are the engine's group figures
(DESIGN.md section 6), taken from the rows (common.summarize_filtering): the backward's reduction
counts the rewrite, 1 - (bwd_ms + rewrite_ms) / regular's bwd_ms. The tables compute only the
spread below, the end-to-end FLOP ideal, and a floor for rows whose group measured none.

Spread (rows from interleaved repetitions, `run.repetitions` > 1): a time is printed with its
spread over every measured step (412.30 +-1.1%, +- half the relative IQR); a change vs regular
with its spread (-30.1% +-1.2 pt): half the width of a distribution-free 90% interval for the
median of the per-round changes paired with regular's rounds (with 5 rounds: their range,
common.median_interval), combined (root of the sum of squares) with the group's A/A difference, an offset that
persists through a whole run and that the rounds alone do not show; the regular row of a group
measured twice (`run.aa_check`) shows the A/A difference, and the noise band it gives: the larger
of |A/A| and the IQR of the per-round A/A differences. A change inside the band is printed as
"n.s." (not significant) with its value in brackets.
"""
from __future__ import annotations

import math

import common


def make_table(description: str, stem: str, metric: str, end_to_end: bool) -> None:
    args = common.parse_args(description)
    rows = common.load_rows(args.results, require=["model", "method", "seq_len", "batch_size", metric])
    recs = common.summarize_filtering(rows, metric)
    reg = common.regular_index(rows, metric)
    what = "step" if end_to_end else "backward"
    headers = ["Model", "T", "B", "Filtered", "Method", f"{what} (ms)", "vs regular", "FLOP ideal",
               "of ideal", "T'", f"T' floor (ms)", "over floor", "A/A band"]
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
            base = reg[key]
            aa = "" if math.isnan(base["aa"]) else f"A/A {common.pct(base['aa'])}"
            band = "" if math.isnan(base["band"]) else f"{100 * base['band']:.1f}%"
            table.append([rec["model"], rec["seq_len"], rec["batch_size"], f"{rec['filter_ratio']:.0%}",
                          common.label("regular"), with_spread(base[metric], base["rel_iqr"]), aa, "", "", "",
                          "", "", band])
        over = common.pct(rec["over_floor"])
        if not math.isnan(rec["over_floor"]) and not rec["floor_from_group"]:
            over += "*"  # the table's own floor ratio (no floor in the row's group): see the caption
        t_prime = "n/a" if math.isnan(rec["t_prime"]) else f"{rec['t_prime']:g}"
        table.append([rec["model"], rec["seq_len"], rec["batch_size"], f"{rec['filter_ratio']:.0%}",
                      common.label(rec["method"]), with_spread(rec["value"], rec["rel_iqr"]), change(rec),
                      common.pct(-rec["ideal"]), common.fmt_ratio(rec["of_ideal"]), t_prime,
                      common.fmt_ms(rec["floor"]), over, ""])
    if not table:
        raise SystemExit("error: no filtering rows (loss_only / collider / forward_drop at filter_ratio > 0) to tabulate")
    if end_to_end:
        figures = ("vs regular = the engine's step_reduction (the step's time change); FLOP ideal = change in "
                   "analytic forward+backward FLOPs, computed by this table (not an engine figure); of ideal "
                   "= the engine's step_reduction / that ideal; T' floor: this method's step with its "
                   "backward and rewrite replaced by regular's backward on T' tokens (from the engine's "
                   "vs_floor); over floor = step / that")
    else:
        figures = ("backward (ms) = the backward alone; vs regular = the engine's reduction, which counts "
                   "the rewrite: 1 - (backward + rewrite) / regular's backward; FLOP ideal = change in "
                   "analytic backward FLOPs; of ideal = the engine's reduction / ideal; T' floor: "
                   "regular's backward on T' tokens per sequence; over floor = the engine's vs_floor - 1, "
                   "(backward + rewrite) / the floor's")
    caption = (f"{'End-to-end step' if end_to_end else 'Backward'} time, median over measured steps and "
               f"repetitions; {figures}; figures of several runs pooled by their median. "
               f"Device: {common.describe_device(rows)}.")
    if any(not math.isnan(r["over_floor"]) and not r["floor_from_group"] for r in recs):
        caption += (" *: no vs_floor from the engine (the row's group measured no floor at its T', or the "
                    "engine holds the method to none: loss only); the same ratio computed by this table "
                    "against regular's rows at T' among the results given, which may come from another "
                    "group or run.")
    if any(not math.isnan(r["band"]) for r in recs):
        caption += (" Spread: a time +- half its relative interquartile range over all measured steps; a "
                    "change +- the root of the sum of squares of half the width of a distribution-free 90% "
                    "interval for the median of its per-round changes (paired with regular's "
                    "interleaved rounds; with 5 rounds their range; rounds of the "
                    f"{'step' if end_to_end else 'backward alone'}) and the A/A difference (pt); A/A "
                    "band = max(|A/A difference|, IQR of the per-round A/A differences); n.s. = not "
                    "significant, inside the band.")
    common.write_table(args.out, stem, headers, table, caption, align="lrrrlrrrrrrrr")


def with_spread(ms: float, rel_iqr: float | None) -> str:
    """412.30 +-1.1%: +- half the relative IQR (the quartiles around the median), or the time alone
    when the rows have no spread."""
    if rel_iqr is None or math.isnan(rel_iqr) or rel_iqr == 0:
        return common.fmt_ms(ms)
    return f"{common.fmt_ms(ms)} +-{50 * rel_iqr:.1f}%"


def change(rec: dict) -> str:
    """The change vs regular +- its spread (common.summarize_filtering); n.s. inside the A/A band."""
    text = common.pct(-rec["reduction"])
    if not math.isnan(rec["spread"]):
        text += f" +-{100 * rec['spread']:.1f} pt"
    return text if rec["significant"] else f"n.s. ({text})"
