"""Shared helpers for the plot and table scripts in plots/ (one script per figure or table).

Loads results (JSONL rows of DESIGN.md section 6, or Google Benchmark JSON), keeps rows with
status "ok" (warns about the others), aggregates by median, draws with one fixed colour per
method, and writes figures (PNG + PDF) and tables (Markdown + LaTeX booktabs). The group figures
(reduction, share of the FLOP ideal, ratio to the T' floor) are the engine's, read from the rows.
Every script runs as:  python plots/<stem>.py --results PATH [PATH...] --out DIR
Tested by tests/test_plots.cpp on tests/fixtures/results/.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections import defaultdict
from typing import Callable, Iterable, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# One fixed colour per method, the same in every figure (colour-blind-safe Okabe-Ito + greys).
# Keys are method keys: `method`, or "collider <attention_grad>" for collider rows.
METHOD_COLORS = {
    "regular": "#000000",
    "loss_only": "#E69F00",
    "collider kept_only": "#0072B2",
    "collider exact_query": "#009E73",
    "forward_drop": "#D55E00",
    "masked": "#999999",
    "regular A/A": "#555555",
    # RHO-1's own selection (batch_topk: top tokens of the whole batch, rows keep different counts)
    "loss_only batch_topk": "#CC79A7",
    "collider kept_only batch_topk": "#332288",
    "collider exact_query batch_topk": "#56B4E9",
    # micro-benchmarks (bench/bm_backward_gemm.cpp); dense is the regular backward GEMM
    "dense": "#000000",
    "sparse_coo": "#D55E00",
    "sparse_csr": "#CC79A7",
    "reduced": "#56B4E9",
    "reduced+gather": "#332288",
}
METHOD_ORDER = list(METHOD_COLORS)
METHOD_LABELS = {
    "regular": "regular",
    "loss_only": "loss only (RHO-1)",
    "collider kept_only": "Collider (kept_only)",
    "collider exact_query": "Collider (exact_query)",
    "forward_drop": "forward drop (random-LTD)",
    "masked": "masked (oracle)",
    "regular A/A": "regular (A/A copy)",
    "loss_only batch_topk": "loss only (RHO-1, batch top-k)",
    "collider kept_only batch_topk": "Collider (kept_only, batch top-k)",
    "collider exact_query batch_topk": "Collider (exact_query, batch top-k)",
    "dense": "dense GEMM",
    "sparse_coo": "sparse COO",
    "sparse_csr": "sparse CSR",
    "reduced": "reduced dense",
    "reduced+gather": "reduced dense + gather",
}
FILTERING_METHODS = ["loss_only", "collider kept_only", "collider exact_query", "forward_drop",
                     "loss_only batch_topk", "collider kept_only batch_topk", "collider exact_query batch_topk"]


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--results", nargs="+", required=True, help="results files (JSONL rows)")
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    if extra:
        extra(p)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    return args


AA_KEY = "regular A/A"  # the second measurement of regular in an interleaved group (run.aa_check)


def method_key(row: dict) -> str:
    """The method as figures name it: collider rows carry their attention semantics; rows of
    RHO-1's batch-level selection (selection "batch_topk"; rows written before the field was
    renamed say "policy") add " batch_topk"; the A/A copy of regular (run.aa_check) is its own key,
    so it never pools with regular."""
    m = row.get("method", "?")
    if row.get("aa_copy"):
        return AA_KEY
    key = f"collider {row.get('attention_grad') or 'kept_only'}" if m == "collider" else m
    if (row.get("selection") or row.get("policy")) == "batch_topk" and m in ("loss_only", "collider", "masked"):
        key += " batch_topk"
    return key


def color(key: str) -> str:
    if key not in METHOD_COLORS:
        warn(f"method '{key}' has no fixed colour; drawing it in grey")
    return METHOD_COLORS.get(key, "#777777")


def label(key: str) -> str:
    return METHOD_LABELS.get(key, key)


def method_rank(key: str) -> tuple:
    return (METHOD_ORDER.index(key) if key in METHOD_ORDER else 99, key)


def sort_methods(keys: Iterable[str]) -> list[str]:
    return sorted(set(keys), key=method_rank)


def load_rows(paths: Sequence[str], require: Sequence[str] = ()) -> list[dict]:
    """JSONL rows with status ok. Other statuses, unparsable lines and rows missing a required
    field are left out with one warning each (never silently)."""
    rows: list[dict] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    warn(f"{path}:{lineno}: not JSON ({e}); line ignored")
                    continue
                status = row.get("status")
                if status != "ok":
                    warn(f"{path}:{lineno}: point {row.get('point_id', '?')} has status {status!r}"
                         f" ({row.get('error') or 'no message'}); ignored")
                    continue
                missing = [k for k in require if row.get(k) is None]
                if missing:
                    warn(f"{path}:{lineno}: point {row.get('point_id', '?')} lacks {missing}; ignored")
                    continue
                # A model with Collider's fused LM head (run.head = "fused") is its own group, with
                # its own regular, floor and A/A rows: "qwen2.5-mini-v152k, fused head".
                if row.get("head") == "fused" and "model" in row:
                    row["model"] = f"{row['model']}, fused head"
                row["_key"] = method_key(row)
                row["_file"] = path
                rows.append(row)
    if not rows:
        sys.exit(f"error: no usable rows (status ok, with fields {list(require)}) in {list(paths)}")
    return rows


def median(values: Iterable[float]) -> float:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(vals) if vals else float("nan")


def quantile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, measuring/stats.h's)."""
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vals:
        return float("nan")
    pos = q * (len(vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (pos - lo) * (vals[hi] - vals[lo])


def repetition_metric(metric: str) -> str:
    """The row key of each interleaved round's median of `metric` (bwd_ms -> repetition_bwd_ms)."""
    return f"repetition_{metric}"


def paired_changes(rows: Sequence[dict], base_rows: Sequence[dict], metric: str) -> list[float]:
    """Per interleaved round k, value_k / base_k - 1, pairing a method's round with the baseline's
    round of the same group (the rounds ran back to back, so they saw the same machine state).
    Empty when the rows carry no rounds or their counts differ (rows from different runs)."""
    key = repetition_metric(metric)
    a = [r.get(key) for r in rows if r.get(key)]
    b = [r.get(key) for r in base_rows if r.get(key)]
    if len(a) != 1 or len(b) != 1 or len(a[0]) != len(b[0]):
        return []
    return [x / y - 1 for x, y in zip(a[0], b[0]) if y]


def iqr_width(values: Sequence[float]) -> float:
    return quantile(values, 0.75) - quantile(values, 0.25) if values else float("nan")


def median_interval(values: Sequence[float], level: float = 0.9) -> tuple[float, float]:
    """A distribution-free confidence interval for the median of `values`: the order statistics
    (k-th smallest, k-th largest) for the largest k whose coverage 1 - 2 P(Binomial(n, 1/2) < k)
    is still >= level (k = 1, the whole range, when none reaches it). With 5 interleaved rounds
    that is min..max, 93.75%; with 10, the 2nd and 9th, 97.9%. It assumes nothing about the shape
    of the noise, so one round that swings widens it, where an IQR of 5 values would not."""
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    n = len(vals)
    if n == 0:
        return float("nan"), float("nan")
    k = 1
    while k + 1 <= (n + 1) // 2:
        below = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n  # P(Binomial(n, 1/2) < k + 1)
        if 1 - 2 * below < level:
            break
        k += 1
    return vals[k - 1], vals[n - k]


def group(rows: Iterable[dict], keys: Sequence[str]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        out[tuple(r.get(k) for k in keys)].append(r)
    return out


def describe_device(rows: Sequence[dict]) -> str:
    """'cpu, CPU scale' / 'NVIDIA H200 (cuda), paper scale', for captions."""
    names = sorted({str(r.get("device_name") or r.get("device") or "?") for r in rows})
    devices = sorted({str(r.get("device") or "?") for r in rows})
    scales = sorted({str(r["scale"]) for r in rows if r.get("scale")})
    if not scales:
        # Rows do not name their scale: CPU runs use the -mini presets (CPU scale).
        is_cpu = all(d.startswith("cpu") for d in devices) or all(
            str(r.get("model", "")).endswith(("-mini", "-micro", "-debug")) for r in rows)
        scales = ["CPU scale" if is_cpu else "paper scale"]
    else:
        scales = [f"{s} scale" for s in scales]
    dtypes = sorted({str(r.get("dtype")) for r in rows if r.get("dtype")})
    return f"{', '.join(names)} ({', '.join(devices)}; {', '.join(dtypes) or '?'}), {', '.join(scales)}"


def pct(x: float) -> str:
    if x is None or math.isnan(x):
        return "n/a"
    return "0.0%" if abs(x) < 5e-4 else f"{100 * x:+.1f}%"


def fmt_ms(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.2f}"


def fmt_ratio(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.2f}"


def _replace_atomically(path: str, write) -> None:
    """Calls write(tmp) for a temporary name beside PATH, then renames it over PATH: a reader (or a
    plot run killed half-way) never leaves a half-written figure or table under the real name."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_figure(fig, out_dir: str, stem: str) -> list[str]:
    paths = []
    for ext in ("png", "pdf"):
        path = os.path.join(out_dir, f"{stem}.{ext}")
        _replace_atomically(path, lambda tmp: fig.savefig(tmp, format=ext, dpi=150, bbox_inches="tight"))
        paths.append(path)
    plt.close(fig)
    for p in paths:
        print(f"wrote {p}")
    return paths


def panel_grid(n: int, width: float = 4.2, height: float = 3.4, max_cols: int = 3):
    cols = max(1, min(n, max_cols))
    nrows = max(1, math.ceil(n / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(width * cols, height * nrows + 0.6), squeeze=False,
                             layout="constrained")
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _latex_escape(s: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("$", r"\$"), ("#", r"\#"),
                 ("_", r"\_"), ("{", r"\{"), ("}", r"\}"), ("~", r"\textasciitilde{}"), ("^", r"\^{}")):
        s = s.replace(a, b)
    return s


def write_table(out_dir: str, stem: str, headers: Sequence[str], rows: Sequence[Sequence[str]],
                caption: str, align: str | None = None) -> list[str]:
    """Writes DIR/stem.md (GitHub Markdown, caption above) and DIR/stem.tex (booktabs)."""
    align = align or ("l" * 1 + "r" * (len(headers) - 1))
    md = [f"**{caption}**", "", "| " + " | ".join(headers) + " |",
          "|" + "|".join(("---:" if a == "r" else ":---") for a in align) + "|"]
    md += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    tex = [r"\begin{table}[t]", r"\centering", rf"\caption{{{_latex_escape(caption)}}}",
           rf"\label{{tab:{stem}}}", rf"\begin{{tabular}}{{{align}}}", r"\toprule",
           " & ".join(_latex_escape(h) for h in headers) + r" \\", r"\midrule"]
    tex += [" & ".join(_latex_escape(str(c)) for c in r) + r" \\" for r in rows]
    tex += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    paths = []
    for ext, lines in (("md", md), ("tex", tex)):
        path = os.path.join(out_dir, f"{stem}.{ext}")
        text = "\n".join(lines) + "\n"

        def write_text(tmp, text=text):
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
        _replace_atomically(path, write_text)
        paths.append(path)
        print(f"wrote {path}")
    return paths


# ---- reductions against regular, the FLOP ideal and the T' floor (DESIGN.md sections 6 and 7) ----
# The group figures (`reduction`, `step_reduction`, `of_ideal`, `vs_floor`) are the measurement
# engine's: it writes them into every row of a group when the group ends (measuring/figures.h), and
# these scripts print them as they are, pooling several runs by their median. What the scripts
# compute themselves: the spread of the interleaved rounds (a statistic of the rounds, not a group
# figure), the end-to-end FLOP ideal, and a floor for the rows whose group measured none.

FIGURE_KEYS = ("reduction", "step_reduction", "of_ideal", "vs_floor")


def figure_key(metric: str) -> str:
    """The engine's reduction of `metric`: `reduction` of the backward (its rewrite counted),
    `step_reduction` of the whole step."""
    return "reduction" if metric == "bwd_ms" else "step_reduction"


def require_figures(rows: Iterable[dict]) -> None:
    """Exits with a short error naming the file when a row lacks the engine's group figures (rows
    written before the engine wrote them); a null figure (no reference in the group) is fine."""
    for r in rows:
        missing = [k for k in FIGURE_KEYS if k not in r]
        if missing:
            path = r.get("_file", "?")
            if "group" not in r:  # sequential rows of before the engine's groups: nothing to add
                sys.exit(f"error: {path}: point {r.get('point_id', '?')} has no group, so no group figures "
                         "(rows measured before the engine measured in groups); these scripts need them")
            sys.exit(f"error: {path}: point {r.get('point_id', '?')} lacks the engine's group figures "
                     f"({', '.join(missing)}); add them with `build/collider figures {path}`")


def cost_ms(row: dict) -> float:
    """The backward as the engine's figures count it: bwd_ms with the rewrite (rewrite_ms)."""
    bwd = row.get("bwd_ms")
    return float("nan") if bwd is None else bwd + (row.get("rewrite_ms") or 0.0)


def regular_index(rows: Sequence[dict], metric: str) -> dict[tuple, dict]:
    """(model, batch_size, seq_len) -> regular's rows and medians (its time, for the tables; its
    FLOPs, for the end-to-end ideal; its rounds and A/A copy, for the spread; its backward, as the
    floor of rows whose own group measured none). Regular ignores filter_ratio, so its rows at
    every ratio pool together; a T' floor is a regular row at seq_len T'."""
    out = {}
    copies = group([r for r in rows if r["_key"] == AA_KEY], ["model", "batch_size", "seq_len"])
    for (model, batch, seq), grp in group([r for r in rows if r["_key"] == "regular"],
                                          ["model", "batch_size", "seq_len"]).items():
        rec = {
            metric: median(r.get(metric) for r in grp),
            "bwd_ms": median(r.get("bwd_ms") for r in grp),
            "cost_ms": median(cost_ms(r) for r in grp),
            "flops_bwd": median(r.get("flops_bwd") for r in grp),
            "flops_fwd": median(r.get("flops_fwd") for r in grp),
            "rel_iqr": median(r.get(f"{metric}_rel_iqr") for r in grp),
            "rows": grp,
            "aa": float("nan"), "band": float("nan"),
        }
        # The A/A check: regular measured twice in the same interleaved rounds. Its difference (the
        # engine's reduction of the copy, sign turned: a change) is what the noise alone makes of
        # "no change"; the band also covers the spread of the per-round differences, so one lucky
        # agreement does not make every change significant.
        aa = copies.get((model, batch, seq))
        if aa:
            require_figures(aa)
            rec["aa"] = -median(r.get(figure_key(metric)) for r in aa)
            rounds = paired_changes(aa, grp, metric)
            spread = iqr_width(rounds) if rounds else float("nan")
            if not math.isnan(rec["aa"]):
                rec["band"] = max(abs(rec["aa"]), 0.0 if math.isnan(spread) else spread)
        out[(model, batch, seq)] = rec
    return out


def end_to_end_ideal(row_flops_fwd: float, row_flops_bwd: float, reg: dict) -> float:
    """1 - the method's analytic forward + backward FLOPs / regular's. Not an engine figure (the
    engine's ideal is of the backward alone), so the end-to-end tables and figures compute it."""
    try:
        return 1.0 - (row_flops_fwd + row_flops_bwd) / (reg["flops_fwd"] + reg["flops_bwd"])
    except (TypeError, ZeroDivisionError, KeyError):
        return float("nan")


def summarize_filtering(rows: Sequence[dict], metric: str) -> list[dict]:
    """One record per (model, batch, seq_len, filter_ratio, method) of the filtering methods: the
    engine's reduction, share of the FLOP ideal and ratio to the T' floor (the median over the
    rows, which pools several runs), the spread of the interleaved rounds around it, and the times.
    metric bwd_ms: the backward (its reduction counts the rewrite, as the engine's does); step_ms:
    the whole step, against the forward + backward FLOP ideal."""
    end_to_end = metric == "step_ms"
    reg = regular_index(rows, metric)
    out = []
    filt = [r for r in rows if r["_key"] not in ("regular", AA_KEY)]
    require_figures(filt)
    for (model, batch, seq, ratio, key), grp in group(
            filt, ["model", "batch_size", "seq_len", "filter_ratio", "_key"]).items():
        base = reg.get((model, batch, seq))
        value = median(r.get(metric) for r in grp)
        cost = median(cost_ms(r) for r in grp)
        rec = {"model": model, "batch_size": batch, "seq_len": seq, "filter_ratio": ratio, "method": key,
               "value": value, "regular": base[metric] if base else float("nan"), "cost_ms": cost}
        rec["reduction"] = median(r.get(figure_key(metric)) for r in grp)
        # Spread: the rows' relative IQR over every measured step, and the changes of the
        # interleaved rounds paired with regular's, with a distribution-free 90% interval for their
        # median (median_interval: min..max of 5 rounds). The rounds are of `metric` alone (the
        # rewrite is timed once per step, not per round); their interval's width is applied around
        # the engine's reduction.
        rec["rel_iqr"] = median(r.get(f"{metric}_rel_iqr") for r in grp)
        rounds = [-c for c in paired_changes(grp, base["rows"], metric)] if base else []
        lo, hi = median_interval(rounds)
        rec["band"] = base["band"] if base else float("nan")
        # The change's spread (+- in the tables, error bars in the figures): half that interval's
        # width (jitter from round to round) combined with the group's A/A difference (an offset
        # that persists through every round of a run, which the rounds cannot see but a second
        # regular measurement of the same work shows), root of the sum of squares.
        half = (hi - lo) / 2
        aa = base["aa"] if base and not math.isnan(base["aa"]) else 0.0
        rec["spread"] = math.hypot(half, aa) if not math.isnan(half) else float("nan")
        rec["significant"] = (math.isnan(rec["band"]) or abs(rec["reduction"]) > rec["band"])
        if end_to_end:
            # The forward+backward FLOP ideal is not an engine figure: computed here, and the share
            # of it is the engine's step_reduction over it.
            rec["ideal"] = (end_to_end_ideal(median(r.get("flops_fwd") for r in grp),
                                             median(r.get("flops_bwd") for r in grp), base)
                            if base else float("nan"))
            rec["of_ideal"] = (rec["reduction"] / rec["ideal"]
                               if not math.isnan(rec["ideal"]) and rec["ideal"] > 0 else float("nan"))
        else:
            rec["ideal"] = median(r.get("flop_ideal_bwd_reduction") for r in grp)
            rec["of_ideal"] = median(r.get("of_ideal") for r in grp)
        # T' floor: regular on a batch of T' = tokens_kept / batch tokens per sequence, no gather;
        # forward_drop keeps every token's loss, its T' is its middle layers' count.
        middle = [r["middle_tokens_per_seq"] for r in grp if r.get("middle_tokens_per_seq") is not None]
        kept = median(r.get("tokens_kept") for r in grp)
        t_prime = (median(middle) if middle else
                   kept / batch if batch and not math.isnan(kept) else float("nan"))
        rec["t_prime"] = t_prime
        fb = (reg.get((model, batch, int(round(t_prime))))
              if not math.isnan(t_prime) and abs(t_prime - round(t_prime)) < 1e-6 else None)
        # The engine's vs_floor where the group measured the floor in its own rounds. Where it did
        # not (null: the floor was measured in another group or run, or the method is one the
        # engine holds to no floor, loss_only), a fallback: the same ratio against regular's rows
        # at seq_len T' found among the rows given, marked as such (floor_from_group False).
        rec["vs_floor"] = median(r.get("vs_floor") for r in grp)
        rec["floor_from_group"] = not math.isnan(rec["vs_floor"])
        if not rec["floor_from_group"] and fb:
            rec["vs_floor"] = cost / fb["cost_ms"]
        floor = fb["bwd_ms"] if fb else float("nan")  # the floor's backward (ms), as measured
        over = rec["vs_floor"] - 1
        if end_to_end and not math.isnan(rec["vs_floor"]):
            # The step with its backward (and rewrite) replaced by the floor's: not an engine
            # figure, derived from the engine's vs_floor.
            floor = value - cost + cost / rec["vs_floor"]
            over = value / floor - 1
        rec["floor"], rec["over_floor"] = floor, over
        out.append(rec)
    out.sort(key=lambda r: (str(r["model"]), r["seq_len"], r["batch_size"], r["filter_ratio"],
                            method_rank(r["method"])))
    return out


def plot_reduction_vs(recs: Sequence[dict], x: str, panel_by: Sequence[str], xlabel: str, ylabel: str,
                      title: str, out_dir: str, stem: str, logx: bool = False) -> None:
    """Line plot of reduction vs regular (%) against `x`, one panel per value of `panel_by`,
    one line per method, the method's FLOP ideal dashed in the same colour."""
    panels = group(recs, panel_by)
    fig, axes = panel_grid(len(panels))
    for ax, (pkey, grp) in zip(axes, sorted(panels.items(), key=lambda kv: tuple(map(str, kv[0])))):
        for key in sort_methods(r["method"] for r in grp):
            pts = sorted((r[x], r["reduction"], r["ideal"], r.get("spread", float("nan")))
                         for r in grp if r["method"] == key)
            xs = [p[0] for p in pts]
            ax.plot(xs, [100 * p[1] for p in pts], marker="o", ms=3, color=color(key), label=label(key))
            # Error bars: the reduction's spread (summarize_filtering: per-round jitter and the A/A
            # offset); none when the rows have a single round.
            if any(not math.isnan(p[3]) for p in pts):
                err = [0.0 if math.isnan(p[3]) else 100 * p[3] for p in pts]
                ax.errorbar(xs, [100 * p[1] for p in pts], yerr=err, fmt="none", ecolor=color(key), capsize=2,
                            lw=0.8)
            if any(not math.isnan(p[2]) for p in pts):
                ax.plot(xs, [100 * p[2] for p in pts], ls="--", lw=1, color=color(key), alpha=0.8,
                        label=f"{label(key)}: FLOP ideal")
        ax.axhline(0, color=color("regular"), lw=0.8)
        ax.set_title(", ".join(f"{k}={v}" if k != "model" else str(v) for k, v in zip(panel_by, pkey)),
                     fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if logx:
            ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    if axes:
        axes[0].legend(fontsize=6, loc="upper left")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, out_dir, stem)


def reduction_figure(doc: str, x: str, panel_by: Sequence[str], xlabel: str, x_words: str, stem: str,
                     logx: bool = False) -> None:
    """The whole of a reduction-vs-x figure script (fig_context_length, fig_filter_ratio): its
    arguments (--metric bwd_ms or step_ms), the rows, the engine's reductions against regular
    (summarize_filtering) and the plot, written as `stem` (`stem`_step_ms for the end-to-end step)."""
    args = parse_args(doc.splitlines()[0], lambda p: p.add_argument(
        "--metric", default="bwd_ms", choices=["bwd_ms", "step_ms"], help="time to reduce"))
    rows = load_rows(args.results, require=["model", "method", "seq_len", "batch_size",
                                            "filter_ratio", args.metric])
    recs = [r for r in summarize_filtering(rows, args.metric) if r["filter_ratio"]]
    if not recs:
        sys.exit("error: no filtering rows with filter_ratio > 0 and a matching regular baseline")
    # The engine's figures: the backward's reduction counts the rewrite (bwd_ms + rewrite_ms).
    what = "backward + rewrite" if args.metric == "bwd_ms" else "end-to-end step"
    plot_reduction_vs(
        recs, x, panel_by, xlabel, f"{what} time reduction vs regular (%)",
        f"{what.capitalize()} time reduction vs {x_words} (dashed: FLOP ideal)\n"
        f"{describe_device(rows)}", out_dir=args.out,
        stem=stem if args.metric == "bwd_ms" else f"{stem}_step_ms", logx=logx)
