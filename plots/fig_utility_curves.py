"""Figure: training utility curves (RHO-1-style token filtering vs regular training): training loss
and every eval set's validation loss against optimizer steps, one line per method and filter ratio:
the mean over its seeds, with the band between the lowest and the highest seed.
  python plots/fig_utility_curves.py --results results/tab_utility/*/results.jsonl --out plots/out
Writes fig_utility_curves.png/.pdf. Tested by tests/test_plots.cpp.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import _utility  # noqa: E402


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0])
    rows, runs = _utility.load_runs(args.results)
    eval_sets = sorted({r["eval_set"] for r in rows if r.get("eval_set") and r.get("val_loss") is not None})
    panels = [("train_loss", None)] + [("val_loss", e) for e in eval_sets]
    fig, axes = common.panel_grid(len(panels))
    styles = ["-", "--", ":", "-."]
    methods = {}
    for (exp, model, key, ratio, seed), run_rows in runs.items():
        methods.setdefault((model, key, ratio), []).append(run_rows)
    for ax, (field, eval_set) in zip(axes, panels):
        seen_per_method = {}
        for (model, key, ratio) in sorted(methods, key=lambda k: (str(k[0]), common.method_rank(k[1]), k[2] or 0)):
            curves = [_utility.per_step([r for r in run_rows if eval_set is None or r.get("eval_set") == eval_set],
                                        field) for run_rows in methods[(model, key, ratio)]]
            curves = [c for c in curves if c]
            if not curves:
                continue
            steps = sorted(set().union(*curves))
            at = [[c[s] for c in curves if s in c] for s in steps]
            mean = [sum(v) / len(v) for v in at]
            # Same method, other filter ratio: same colour, next line style.
            n = seen_per_method.get(key, 0)
            seen_per_method[key] = n + 1
            label = common.label(key) + (f", filtered {ratio:.0%}" if ratio else "")
            label += f" ({len(curves)} seeds)" if len(curves) > 1 else ""
            ax.plot(steps, mean, color=common.color(key), ls=styles[n % len(styles)],
                    marker="o" if len(steps) < 30 else None, ms=3, label=label)
            if len(curves) > 1:
                ax.fill_between(steps, [min(v) for v in at], [max(v) for v in at], color=common.color(key),
                                alpha=0.12, lw=0)
        ax.set_title("training loss" if eval_set is None else f"validation loss: {eval_set}", fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (nats / token)")
        ax.grid(True, alpha=0.3)
    if axes:
        axes[0].legend(fontsize=7)
    models = ", ".join(sorted({str(r["model"]) for r in rows}))
    fig.suptitle(f"Training utility ({models})\n{common.describe_device(rows)}", fontsize=9)
    common.save_figure(fig, args.out, "fig_utility_curves")


if __name__ == "__main__":
    main()
