"""Table: training utility of token filtering vs regular training over seeds: final validation loss
per eval set (the curated-domain set first if named so) as mean and 95% confidence interval over
the seeds, the relative improvement over regular paired by seed (same initial weights and batches)
with its interval and whether it is significant, tokens seen and back-propagated, and the time per
step measured interleaved in one process (the paper's utility table; its headline is +16.3%
relative vs regular).
  python plots/tab_utility.py --results results/tab_utility/RUN/results.jsonl \
      --step-time results/tab_utility/RUN/step_time*/results.jsonl --out plots/out
Writes tab_utility.md/.tex (--stem NAME: NAME.*), NAME_runs.md/.tex (every run: one line per
model, method, seed and eval set) and, when reference.json files lie beside the results
(RUN/reference.json or RUN/seed*/reference.json), NAME_reference.md/.tex: the reference model's
own losses against the regular run's. Tested by tests/test_plots.cpp.
"""
import glob
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import _utility  # noqa: E402

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (beyond: the normal's 1.96).
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042]


def mean_ci(values):
    """(mean, half-width of the 95% t-interval); the half-width is nan below 2 values."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return float("nan"), float("nan")
    m = statistics.fmean(vals)
    if len(vals) < 2:
        return m, float("nan")
    t = T975[len(vals) - 2] if len(vals) - 1 <= len(T975) else 1.96
    return m, t * statistics.stdev(vals) / math.sqrt(len(vals))


def fmt_ci(m, half, digits=4, pct=False):
    if math.isnan(m):
        return "n/a"
    if pct:
        return common.pct(m) + ("" if math.isnan(half) else f" +-{100 * half:.1f} pt")
    return f"{m:.{digits}f}" + ("" if math.isnan(half) else f" +-{half:.{digits}f}")


def significance(m, half):
    """'better' / 'worse' when the 95% interval of a relative improvement excludes 0, else 'n.s.'."""
    if math.isnan(half):
        return "n/a (1 seed)"
    if m - half > 0:
        return "better"
    if m + half < 0:
        return "worse"
    return "n.s."


def run_totals(rows):
    """(steps, wall_s, tokens_seen, tokens_backprop, estimated?) of one run. Cumulative fields
    (elapsed_s, tokens_seen, tokens_backprop) are used when the rows carry them; otherwise per-step
    medians (step_ms, tokens, tokens_kept) times the number of steps, marked as estimates."""
    steps = max(r["step"] for r in rows)
    est = False

    def cumulative(field, per_step_field, scale=1.0):
        nonlocal est
        vals = [r[field] for r in rows if r.get(field) is not None]
        if vals:
            return max(vals)
        est = True
        return common.median(r.get(per_step_field) for r in rows) * steps * scale

    wall_s = cumulative("elapsed_s", "step_ms", 1e-3)
    seen = cumulative("tokens_seen", "tokens")
    backprop = cumulative("tokens_backprop", "tokens_kept")
    return steps, wall_s, seen, backprop, est


def median_step_s(rows):
    """Median seconds per step over the intervals between consecutive rows with elapsed_s (more
    robust than wall / steps when the machine's load changes during a run); nan without them."""
    pts = sorted({(r["step"], r["elapsed_s"]) for r in rows if r.get("elapsed_s") is not None})
    rates = [(e1 - e0) / (s1 - s0) for (s0, e0), (s1, e1) in zip(pts, pts[1:]) if s1 > s0]
    return common.median(rates)


def final_eval(rows, eval_set):
    ev = [r for r in rows if r.get("eval_set") == eval_set and r.get("val_loss") is not None]
    if not ev:
        return None
    last = max(r["step"] for r in ev)
    at = [r for r in ev if r["step"] == last]
    loss = common.median(r["val_loss"] for r in at)
    ppl = common.median(r.get("val_ppl") if r.get("val_ppl") is not None else math.exp(r["val_loss"]) for r in at)
    return loss, ppl


def load_step_times(paths):
    """({(model, seq_len, batch_size, method key): (step_s, rel_half_iqr, change vs regular, lo, hi)},
    [(A/A difference, regular's s/step) of each file]) from interleaved timing rows (experiments/tab_utility_step_time.toml).
    A key's change is paired round by round with the regular point of its own file (each file is one
    interleaved process); a key in several files (regular) keeps the first. The A/A difference
    (regular's copy against regular, median per-round change) is the noise band of that file."""
    out, aa_changes = {}, []
    for path in paths:
        all_rows = common.load_rows([path], require=["step_ms"])
        rows = [r for r in all_rows if r["_key"] != common.AA_KEY]
        aa = [r for r in all_rows if r["_key"] == common.AA_KEY]
        regular = [r for r in rows if r["_key"] == "regular"]
        if aa:
            aa_changes.append((common.median(common.paired_changes(aa, regular, "step_ms")),
                               common.median(r["step_ms"] for r in regular) / 1e3))
        for (model, T, B, key), grp in common.group(rows, ["model", "seq_len", "batch_size", "_key"]).items():
            if (model, T, B, key) in out:
                continue
            base = [r for r in rows if r["_key"] == "regular" and (r["model"], r["seq_len"], r["batch_size"]) ==
                    (model, T, B)]
            changes = common.paired_changes(grp, base, "step_ms") if key != "regular" else []
            lo, hi = common.median_interval(changes)
            out[(model, T, B, key)] = (common.median(r["step_ms"] for r in grp) / 1e3,
                                       common.median(r.get("step_ms_rel_iqr") for r in grp) / 2,
                                       common.median(changes), lo, hi)
    return out, aa_changes


def reference_files(result_paths):
    """reference.json beside each results file or in its seed*/ folders."""
    found = []
    for p in result_paths:
        d = os.path.dirname(os.path.abspath(p))
        for f in [os.path.join(d, "reference.json")] + sorted(glob.glob(os.path.join(d, "seed*", "reference.json"))):
            if os.path.isfile(f) and f not in found:
                found.append(f)
    return found


def main() -> None:
    def extra(p):
        p.add_argument("--stem", default="tab_utility", help="output file name without extension (default tab_utility)")
        p.add_argument("--step-time", nargs="*", default=[],
                       help="interleaved timing rows of the same shapes (experiments/tab_utility_step_time.toml)")

    args = common.parse_args(__doc__.splitlines()[0], extra)
    rows, runs = _utility.load_runs(args.results)
    eval_sets = sorted({r["eval_set"] for r in rows if r.get("eval_set") and r.get("val_loss") is not None},
                       key=lambda e: (0 if "curated" in e or "domain" in e else 1, e))
    if not eval_sets:
        sys.exit("error: no training rows carry val_loss with an eval_set")
    step_times, aa_changes = load_step_times(args.step_time) if args.step_time else ({}, [])
    device = common.describe_device(rows)

    # Runs by (model, method key, ratio) -> {seed: rows}; the experiment name is not part of the
    # group, so that rows merged from several result files of one table pool.
    methods = {}
    for (exp, model, key, ratio, seed), run_rows in runs.items():
        methods.setdefault((model, key, ratio), {})[seed] = run_rows
    regular = {model: seeds for (model, key, ratio), seeds in methods.items() if key == "regular"}

    headers = ["Model", "Params", "Method", "Seeds", "Eval set", "Val loss (mean +-95% CI)", "vs regular (paired)",
               "Significant", "Tokens seen", "Tokens back-prop.", "s/step", "Step vs regular", "Wall (s)"]
    table = []
    any_run_clock = any_est = False
    for model, key, ratio in sorted(methods, key=lambda k: (str(k[0]), common.method_rank(k[1]), k[2] or 0)):
        seeds = methods[(model, key, ratio)]
        any_rows = next(iter(seeds.values()))
        totals = [run_totals(r) for r in seeds.values()]
        steps = max(t[0] for t in totals)
        seen = statistics.fmean(t[2] for t in totals)
        backprop = statistics.fmean(t[3] for t in totals)
        est = "*" if any(t[4] for t in totals) else ""
        any_est |= bool(est)
        T, B = any_rows[0].get("seq_len"), any_rows[0].get("batch_size")
        st = step_times.get((model, T, B, key))
        if st:
            step_s, half, change, lo, hi = st
            step_txt = f"{step_s:.3f} +-{100 * half:.1f}%"
            change_txt = "" if key == "regular" else f"{common.pct(change)} [{common.pct(lo)}, {common.pct(hi)}]"
            wall_txt = f"{steps * step_s:.0f}" if steps * step_s >= 100 else f"{steps * step_s:.1f}"
        else:
            any_run_clock = True
            step_s = common.median(median_step_s(r) for r in seeds.values())
            step_txt, change_txt = f"{step_s:.3f}*", "n/a"
            wall_txt = f"{common.median(t[1] for t in totals):.0f}*"
        params = common.median(r.get("num_params") for r in any_rows if r.get("num_params") is not None)
        label = common.label(key) + (f", filtered {ratio:.0%}" if ratio else "")
        for e in eval_sets:
            finals = {s: final_eval(r, e) for s, r in seeds.items()}
            finals = {s: f[0] for s, f in finals.items() if f}
            if not finals:
                continue
            m, half = mean_ci(finals.values())
            rel_txt, sig = "", ""
            if key != "regular" and model in regular:
                rel = []
                for s, loss in finals.items():
                    reg = final_eval(regular[model][s], e) if s in regular[model] else None
                    if reg:
                        rel.append((reg[0] - loss) / reg[0])
                rm, rh = mean_ci(rel)
                rel_txt, sig = fmt_ci(rm, rh, pct=True), significance(rm, rh) if rel else "n/a"
            table.append([model, f"{params / 1e6:.1f}M" if params == params else "n/a", label, len(finals), e,
                          fmt_ci(m, half), rel_txt, sig, f"{seen:,.0f}{est}", f"{backprop:,.0f}{est}", step_txt, change_txt,
                          wall_txt])
    caption = ("Training utility over seeds: final validation loss per eval set, mean +- half-width of the 95% "
               "t-interval over the seeds; vs regular = relative loss improvement over the regular run of the same "
               "seed (same initial weights and batches; positive = better), mean +- 95% interval of the per-seed "
               "improvements, 'better'/'worse' when that interval excludes 0. On the curated-domain set it is the "
               "paper's relative utility, measured here as loss. "
               + ("s/step: median of the interleaved timing run (experiments/tab_utility_step_time.toml, methods "
                  "taking turns in one process) +- half its relative IQR; step vs regular: median per-round change "
                  "with its 90% interval; Wall = steps x s/step. " if step_times else "")
               + (f"A/A (regular against its copy in the same rounds; the noise band): "
                  f"{', '.join(common.pct(a) for a, _ in aa_changes)}. " if aa_changes else "")
               + (f"Each timing file is its own interleaved process, paired with its own regular, which ran at "
                  f"{' / '.join(f'{t:.3f}' for _, t in aa_changes)} s/step: compare 'step vs regular' across "
                  f"files, not s/step. " if len(aa_changes) > 1 else "")
               + ("* from the training runs' own clocks (overlapping runs on a shared machine: not comparable "
                  "between methods). " if any_run_clock else "")
               + ("* tokens estimated as per-step median x steps (rows without cumulative counts). " if any_est else "")
               + f"Device: {device}.")
    common.write_table(args.out, args.stem, headers, table, caption, align="lllrlrrlrrrrr")
    write_runs_table(args, runs, eval_sets, device)
    write_reference_table(args, regular, eval_sets, device)


def write_runs_table(args, runs, eval_sets, device):
    """Every run on its own line (the per-seed numbers behind the means)."""
    headers = ["Model", "Method", "Seed", "Eval set", "Steps", "Val loss", "vs regular", "Val ppl", "Wall (s)",
               "s/step (run clock)", "Tokens seen", "Tokens back-prop."]
    table = []
    any_est = False
    for run_key in sorted(runs, key=lambda k: (str(k[1]), common.method_rank(k[2]), k[3] or 0, k[4] or 0)):
        exp, model, key, ratio, seed = run_key
        reg_key = next((k for k in runs if k[1] == model and k[2] == "regular" and k[4] == seed), None)
        steps, wall_s, seen, backprop, est = run_totals(runs[run_key])
        any_est |= est
        mark = "*" if est else ""
        for e in eval_sets:
            fe = final_eval(runs[run_key], e)
            if fe is None:
                continue
            loss, ppl = fe
            rel = float("nan")
            reg = final_eval(runs[reg_key], e) if reg_key and reg_key != run_key else None
            if reg:
                rel = (reg[0] - loss) / reg[0]
            label = common.label(key) + (f", filtered {ratio:.0%}" if ratio else "")
            table.append([model, label, seed, e, steps, f"{loss:.4f}", common.pct(rel), f"{ppl:.2f}",
                          f"{wall_s:.1f}{mark}", f"{median_step_s(runs[run_key]):.2f}", f"{seen:,.0f}{mark}",
                          f"{backprop:,.0f}{mark}"])
    caption = ("Training utility, every run: final validation loss and perplexity; vs regular = relative loss "
               "improvement over the regular run of the same seed. Wall and s/step are the run's own clock "
               "(runs that overlapped on the machine share its cores). "
               + ("* estimated as per-step median x steps. " if any_est else "") + f"Device: {device}.")
    common.write_table(args.out, f"{args.stem}_runs", headers, table, caption, align="llrlrrrrrrrr")


def write_reference_table(args, regular, eval_sets, device):
    """The reference model's own final losses (RHO-1's excess loss needs it to be better than the
    model being trained on the curated domain) against the regular run of the same seed."""
    files = reference_files(args.results)
    if not files:
        return
    headers = ["Reference model", "Trained on", "Steps", "Eval set", "Reference loss", "Regular run's loss (same seed)",
               "Reference - regular"]
    table, diffs = [], {e: [] for e in eval_sets}
    for f in files:
        with open(f, encoding="utf-8") as fh:
            ref = json.load(fh)
        if not ref.get("evals"):
            common.warn(f"{f}: no evaluations; skipped")
            continue
        last = max(ref["evals"], key=lambda x: x["step"])
        tag = ref.get("tag", "?")
        seed = int(tag.rsplit("seed", 1)[1]) if "seed" in tag and tag.rsplit("seed", 1)[1].isdigit() else None
        for e in eval_sets:
            if e not in last:
                continue
            reg = None
            for model, seeds in regular.items():
                if tag.startswith(model + "-") and seed in seeds:
                    reg = final_eval(seeds[seed], e)
            reg_txt = f"{reg[0]:.4f}" if reg else "n/a"
            diff = last[e] - reg[0] if reg else float("nan")
            if reg:
                diffs[e].append(diff)
            table.append([tag, ref.get("split", "?"), last["step"], e, f"{last[e]:.4f}", reg_txt,
                          "n/a" if math.isnan(diff) else f"{diff:+.4f}"])
    for e in eval_sets:
        if len(diffs[e]) > 1:
            m, half = mean_ci(diffs[e])
            table.append(["mean over seeds", "", "", e, "", "", f"{m:+.4f} +-{half:.4f}"])
    caption = ("Reference models (RHO-1's first step: regular training on the curated split) against the regular "
               "run of the same seed at its last evaluation; negative = the reference is better on that set, which "
               "excess-loss selection needs on the curated domain. Mean +- half-width of the 95% t-interval. "
               f"Device: {device}.")
    common.write_table(args.out, f"{args.stem}_reference", headers, table, caption, align="llrlrrr")


if __name__ == "__main__":
    main()
