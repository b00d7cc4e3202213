"""Figure: per-layer backward time (embedding, every decoder layer, LM head), regular vs the
filtering methods, as grouped bars; one panel per model, sequence length, batch and filter ratio.
Also a table of the same numbers with each method's per-layer reduction and how much of the
measured bwd_ms the per-layer times account for.
  python plots/fig_layer_breakdown.py --results results/fig_layer_breakdown/*/results.jsonl --out plots/out
Writes fig_layer_breakdown.png/.pdf and fig_layer_breakdown.md/.tex. Tested by tests/test_plots.cpp.
"""
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def layer_medians(rows):
    """{layer name: median bwd_ms}, and the layer names in model order (from the first row)."""
    order, values = [], {}
    for r in rows:
        for entry in r.get("layers") or []:
            if entry["name"] not in values:
                order.append(entry["name"])
                values[entry["name"]] = []
            values[entry["name"]].append(entry.get("bwd_ms"))
    return order, {k: common.median(v) for k, v in values.items()}


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0])
    rows = [r for r in common.load_rows(args.results, require=["model", "method", "seq_len", "batch_size",
                                                               "bwd_ms"]) if r.get("layers")]
    if not rows:
        sys.exit("error: no ok rows carry per-layer times ('layers')")
    regular = common.group([r for r in rows if r["_key"] == "regular"], ["model", "seq_len", "batch_size"])
    filtered = common.group([r for r in rows if r["_key"] != "regular" and r.get("filter_ratio")],
                            ["model", "seq_len", "batch_size", "filter_ratio"])
    panels = []  # (title, [(method, order, medians, bwd_ms)])
    for (model, seq, batch, ratio), grp in sorted(filtered.items(), key=lambda kv: tuple(map(str, kv[0]))):
        series = []
        if (model, seq, batch) in regular:
            reg = regular[(model, seq, batch)]
            series.append(("regular",) + layer_medians(reg) + (common.median(r["bwd_ms"] for r in reg),))
        for key in common.sort_methods(r["_key"] for r in grp):
            sub = [r for r in grp if r["_key"] == key]
            series.append((key,) + layer_medians(sub) + (common.median(r["bwd_ms"] for r in sub),))
        panels.append((f"{model}, T={seq}, B={batch}, filter ratio {ratio:g}", series))
    if not panels:
        sys.exit("error: no filtering rows (filter_ratio > 0) with per-layer times")

    fig, axes = common.panel_grid(len(panels), width=7.0, height=3.6, max_cols=1)
    keys = common.sort_methods(s[0] for _, series in panels for s in series)
    headers = ["Panel", "Layer"] + [f"{common.label(k)} (ms)" for k in keys]
    table_rows = []
    for ax, (title, series) in zip(axes, panels):
        order = series[0][1]
        x = np.arange(len(order))
        width = 0.8 / len(series)
        for i, (key, _, med, _) in enumerate(series):
            ax.bar(x + (i - (len(series) - 1) / 2) * width, [med.get(n, math.nan) for n in order], width,
                   color=common.color(key), label=common.label(key))
        ax.set_xticks(x)
        ax.set_xticklabels(order, rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("backward time (ms)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
        by_key = {s[0]: s for s in series}

        def cells(fn):
            return [fn(by_key[k]) if k in by_key else "" for k in keys]
        for name in order:
            table_rows.append([title, name] + cells(lambda s: common.fmt_ms(s[2].get(name, math.nan))))
        table_rows.append([title, "sum of layers"] + cells(lambda s: common.fmt_ms(sum(s[2].values()))))
        table_rows.append([title, "bwd_ms (whole backward)"] + cells(lambda s: common.fmt_ms(s[3])))
    fig.suptitle(f"Per-layer backward time\n{common.describe_device(rows)}", fontsize=9)
    common.save_figure(fig, args.out, "fig_layer_breakdown")
    common.write_table(args.out, "fig_layer_breakdown", headers, table_rows,
                       "Per-layer backward time (median, ms); the last two rows of each panel compare "
                       f"the layers' sum with the measured backward. {common.describe_device(rows)}.",
                       align="ll" + "r" * len(keys))


if __name__ == "__main__":
    main()
