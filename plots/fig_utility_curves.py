"""Figure: training utility curves (RHO-1-style token filtering vs regular training): training loss
and every eval set's validation loss against optimizer steps, one line per method.
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
    for ax, (field, eval_set) in zip(axes, panels):
        seen_per_method = {}
        for run_key in sorted(runs, key=lambda k: (str(k[1]), common.method_rank(k[2]), str(k))):
            grp = [r for r in runs[run_key] if eval_set is None or r.get("eval_set") == eval_set]
            curve = _utility.per_step(grp, field)
            if not curve:
                continue
            # Same method, other filter ratio or seed: same colour, next line style.
            n = seen_per_method.get(run_key[2], 0)
            seen_per_method[run_key[2]] = n + 1
            ax.plot(list(curve), list(curve.values()), color=common.color(run_key[2]), ls=styles[n % len(styles)],
                    marker="o" if len(curve) < 30 else None, ms=3, label=_utility.run_label(run_key))
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
