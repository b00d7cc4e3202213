"""Table: training utility of token filtering vs regular training: final validation loss and
perplexity per eval set (the curated-domain set first if named so) with the relative improvement
over the regular run of the same model and seed, plus wall time, tokens seen and tokens
back-propagated (the paper's utility table; its headline is +16.3% relative vs regular).
  python plots/tab_utility.py --results results/tab_utility/*/results.jsonl --out plots/out
Writes tab_utility.md and .tex (--stem NAME: NAME.md and .tex; tab_utility_selection for RHO-1's
batch-level selection against the per-sequence one). Tested by tests/test_plots.cpp.
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import _utility  # noqa: E402


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


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], lambda p: p.add_argument(
        "--stem", default="tab_utility", help="output file name without extension (default tab_utility)"))
    rows, runs = _utility.load_runs(args.results)
    eval_sets = sorted({r["eval_set"] for r in rows if r.get("eval_set") and r.get("val_loss") is not None},
                       key=lambda e: (0 if "curated" in e or "domain" in e else 1, e))
    if not eval_sets:
        sys.exit("error: no training rows carry val_loss with an eval_set")
    headers = ["Model", "Params", "Method", "Eval set", "Steps", "Val loss", "vs regular", "Val ppl", "vs regular",
               "Wall (s)", "s/step (median)", "Tokens seen", "Tokens back-prop."]
    table = []
    any_est = False
    ordered = sorted(runs, key=lambda k: (str(k[1]), common.method_rank(k[2]), str(k)))
    for run_key in ordered:
        exp, model, key, ratio, seed = run_key
        reg_key = next((k for k in runs if k[0] == exp and k[1] == model and k[2] == "regular" and k[4] == seed),
                       None)
        steps, wall_s, seen, backprop, est = run_totals(runs[run_key])
        any_est |= est
        for e in eval_sets:
            fe = final_eval(runs[run_key], e)
            if fe is None:
                continue
            loss, ppl = fe
            rel_loss = rel_ppl = float("nan")
            if reg_key and reg_key != run_key and final_eval(runs[reg_key], e):
                reg_loss, reg_ppl = final_eval(runs[reg_key], e)
                rel_loss, rel_ppl = (reg_loss - loss) / reg_loss, (reg_ppl - ppl) / reg_ppl
            mark = "*" if est else ""
            params = common.median(r.get("num_params") for r in runs[run_key] if r.get("num_params") is not None)
            table.append([model, f"{params / 1e6:.1f}M" if params == params else "n/a", _utility.run_label(run_key), e, steps, f"{loss:.4f}", common.pct(rel_loss),
                          f"{ppl:.2f}", common.pct(rel_ppl), f"{wall_s:.1f}{mark}", f"{median_step_s(runs[run_key]):.2f}", f"{seen:,.0f}{mark}",
                          f"{backprop:,.0f}{mark}"])
    caption = ("Training utility: final validation loss and perplexity per eval set; vs regular = relative "
               "improvement over the regular run of the same model and seed (positive = better; on the curated-domain "
               "set this is the paper's relative utility, measured here as loss / perplexity). Wall = training time "
               "of the run without evaluation; s/step = median over the logging intervals. "
               + ("* estimated as per-step median x steps. " if any_est else "")
               + f"Device: {common.describe_device(rows)}.")
    common.write_table(args.out, args.stem, headers, table, caption, align="llllrrrrrrrrr")


if __name__ == "__main__":
    main()
