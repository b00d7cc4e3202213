"""Figure (paper Figure 4): backward-GEMM time relative to the dense GEMM vs filter ratio, for
torch sparse GEMM (COO, CSR) on the gradient with zeroed rows and for the dimension-reduced dense
GEMM with and without its gather; one panel per model, times summed over every projection and
both backward GEMMs (dX = dY·W, dW = dYᵀ·X). Reads Google Benchmark JSON of bench/bm_backward_gemm.
  build/bench/bm_backward_gemm --benchmark_format=json --benchmark_out=bm.json
  python plots/fig_sparse_gemm.py --results bm.json --out plots/out
Writes fig_sparse_gemm.png/.pdf and fig_sparse_gemm.md/.tex (the plotted values). Tested by
tests/test_plots.cpp.
"""
from __future__ import annotations

import json
import math
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

UNIT_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}
BENCH_METHOD_KEYS = {"reduced_gather": "reduced+gather"}


def parse_name(name: str) -> dict:
    """'bwd_gemm/model:m/layer:l/op:dX/method:reduced/ratio_permille:400/real_time' -> fields."""
    fields = {}
    for part in name.split("/"):
        if ":" in part:
            k, v = part.split(":", 1)
            fields[k] = v
    return fields


def load_benchmarks(paths):
    times = defaultdict(list)  # (model, layer, op, method, ratio) -> [ms]
    contexts = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        contexts.append(doc.get("context", {}))
        for b in doc.get("benchmarks", []):
            if b.get("run_type", "iteration") != "iteration":
                continue  # aggregates (mean/median/stddev) are recomputed here
            if b.get("error_occurred"):
                common.warn(f"{path}: {b.get('name')}: {b.get('error_message')}; ignored")
                continue
            f_ = parse_name(b["name"])
            if not {"model", "layer", "op", "method", "ratio_permille"} <= f_.keys():
                common.warn(f"{path}: benchmark {b['name']!r} is not a bwd_gemm benchmark; ignored")
                continue
            ms = b["real_time"] * UNIT_MS[b.get("time_unit", "ns")]
            method = BENCH_METHOD_KEYS.get(f_["method"], f_["method"])
            times[(f_["model"], f_["layer"], f_["op"], method, int(f_["ratio_permille"]) / 1000)].append(ms)
    if not times:
        sys.exit(f"error: no bwd_gemm benchmark results in {paths}")
    return {k: common.median(v) for k, v in times.items()}, contexts


def describe(contexts) -> str:
    def vals(key):
        return ", ".join(sorted({str(c.get(key)) for c in contexts if c.get(key) is not None})) or "?"
    return (f"{vals('collider_device')} on {vals('host_name')}, {vals('collider_dtype')}, "
            f"{vals('collider_scale')} scale (T={vals('collider_seq_len')}, widths / "
            f"{vals('collider_width_divisor')}), threads: {vals('collider_num_threads')}")


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0])
    med, contexts = load_benchmarks(args.results)
    models = sorted({k[0] for k in med})
    # relative[model][method][ratio] = sum of method time / sum of dense time over the (layer, op)
    # pairs that have both, i.e. the whole backward-GEMM work of one decoder layer.
    relative = {}
    for model in models:
        dense = {(k[1], k[2]): v for k, v in med.items() if k[0] == model and k[3] == "dense"}
        per_method = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0]))
        for (m, layer, op, method, ratio), ms in med.items():
            if m != model or method == "dense" or (layer, op) not in dense:
                continue
            acc = per_method[method][ratio]
            acc[0] += ms
            acc[1] += dense[(layer, op)]
            acc[2] += 1
        if not dense:
            common.warn(f"{model}: no dense baseline; model left out")
            continue
        relative[model] = {
            method: {r: a[0] / a[1] for r, a in sorted(rs.items()) if a[2] == len(dense)}
            for method, rs in per_method.items()}
        for method, rs in per_method.items():
            partial = [r for r, a in rs.items() if a[2] != len(dense)]
            if partial:
                common.warn(f"{model} {method}: ratios {sorted(partial)} lack some projections; left out")

    fig, axes = common.panel_grid(len(relative))
    table = []
    for ax, model in zip(axes, relative):
        ratios_all = sorted({r for rs in relative[model].values() for r in rs})
        ax.axhline(1.0, color=common.color("dense"), lw=1.2, label=common.label("dense"))
        if ratios_all:
            ax.plot(ratios_all, [max(1 - r, 1e-3) for r in ratios_all], ls=":", color="#777777", lw=1,
                    label="ideal (1 - ratio)")
        for method in common.sort_methods(relative[model]):
            rs = relative[model][method]
            ax.plot(list(rs), list(rs.values()), marker="o", ms=3, color=common.color(method),
                    label=common.label(method))
            for r, v in rs.items():
                table.append((model, method, r, v))
        ax.set_yscale("log")
        ax.set_title(model)
        ax.set_xlabel("filter ratio (fraction of rows dropped)")
        ax.set_ylabel("time relative to dense GEMM")
        ax.grid(True, which="both", alpha=0.3)
    if axes:
        axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle("Backward GEMMs (dX, dW of every projection) with filtered rows\n" + describe(contexts),
                 fontsize=9)
    common.save_figure(fig, args.out, "fig_sparse_gemm")

    # The plotted values as a table: one row per model and method, one column per ratio.
    ratios = sorted({r for _, _, r, _ in table})
    rows = []
    for model in relative:
        for method in common.sort_methods(relative[model]):
            rs = relative[model][method]
            rows.append([model, common.label(method)] +
                        [f"{rs[r]:.2f}" if r in rs and not math.isnan(rs[r]) else "" for r in ratios])
    common.write_table(args.out, "fig_sparse_gemm",
                       ["Model", "Method"] + [f"{r:g}" for r in ratios], rows,
                       "Backward-GEMM time relative to dense (summed over projections, dX and dW) "
                       f"vs filter ratio. {describe(contexts)}.", align="ll" + "r" * len(ratios))


if __name__ == "__main__":
    main()
