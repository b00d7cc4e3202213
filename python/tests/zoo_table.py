"""Writes docs/ZOO.md: Collider's outcome on every transformers causal-LM, masked-LM, image-text-to-text,
sequence-to-sequence and speech-sequence-to-sequence architecture.

Runs zoo.run_architecture (the code test_zoo.py runs) on every architecture, or on those named,
with one CPU thread, at the zoo's sizes and again with batch, sequence and hidden sizes equal
(zoo.run_equal; test_equal_sizes), and writes the date, the commits, torch's and transformers' versions, the
counts per outcome, the share exact among the architectures built, the largest refusal causes and
one row per architecture. --json also writes the rows as JSON; --jobs N runs N architectures at once,
each in its own process on one thread (the table's seconds are then the wall time). The collider package is the one
built in COLLIDER_BUILD_DIR (default build/), as for pytest (conftest.py).
  COLLIDER_BUILD_DIR=build python python/tests/zoo_table.py                # all, writes docs/ZOO.md
  python python/tests/zoo_table.py --out /tmp/zoo.md --json /tmp/zoo.json llama bert   # a few
  python python/tests/zoo_table.py --jobs 2                                # all, on 2 cores
  python python/tests/zoo_table.py --merge /tmp/zoo.json --json /tmp/zoo.json llava-image   # rerun a few rows
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one intra-op thread, as in the tests

import argparse  # noqa: E402
import collections  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BUILD_DIR = Path(os.environ.get("COLLIDER_BUILD_DIR", ROOT / "build")).resolve()
if os.environ.get("COLLIDER_TEST_INSTALLED") != "1":
    sys.path.insert(0, str(BUILD_DIR / "python"))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import transformers  # noqa: E402

import collider  # noqa: E402
import zoo  # noqa: E402

torch.set_num_threads(1)


def git_commit(path: Path) -> str:
    """The checkout's commit, with "+ uncommitted changes" when its tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short=12", "HEAD")
    if not commit:
        return "unknown (not a git checkout)"
    return commit + (" + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def built_at(path: str) -> str:
    return datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def row_of(result: zoo.Result, equal: "zoo.Result | None") -> dict:
    arch = result.arch
    return {"id": arch.id, "name": arch.name, "aliases": list(arch.aliases), "model_class": arch.model_class,
            "task": arch.task, "outcome": result.outcome, "cause": result.cause, "group": result.group,
            "seconds": round(result.seconds, 2),
            "impls": {attn: {"outcome": r.outcome, "cause": r.cause, "dtype": r.dtype, "max_rel_diff": r.worst,
                             "oracle": r.oracle}
                      for attn, r in result.impls.items()},
            "equal": None if equal is None else {"outcome": equal.outcome, "cause": equal.cause}}


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def attention_cell(row: dict) -> str:
    built = [(a, r) for a, r in row["impls"].items() if r["outcome"] != "not buildable"]
    if not built:
        return "-"
    dtypes = sorted({r["dtype"] for _, r in built})
    return ", ".join(a for a, _ in built) + f" ({', '.join(dtypes)})"


def outcome_cells(row: dict) -> tuple:
    """(outcome, cause): the architecture's worst outcome, with the other implementations' where they differ."""
    impls = {a: r for a, r in row["impls"].items() if r["outcome"] != "not buildable"} or row["impls"]
    outcome = row["outcome"]
    others = [f"{a}: {r['outcome']}" for a, r in impls.items() if r["outcome"] != outcome]
    worst = [(a, r) for a, r in impls.items() if r["outcome"] == outcome]
    if outcome == "not buildable":  # the reason a build failed, before "does not take attn_implementation"
        worst.sort(key=lambda ar: ar[1]["cause"].startswith("does not take"))
    cause = worst[0][1]["cause"] if worst else ""
    if others:
        outcome += " (" + "; ".join(others) + ")"
        cause = f"{worst[0][0]}: {cause}" if cause else cause
    return outcome, cause


def count_row(task: str, rows: list) -> str:
    counts = collections.Counter(r["outcome"] for r in rows)
    built = len(rows) - counts["not buildable"]
    share = f"{counts['exact'] / built:.0%} ({counts['exact']} of {built})" if built else "-"
    return (f"| {task} | {len(rows)} | {counts['exact']} | {counts['refused']} | {counts['not buildable']} | "
            f"{counts['wrong']} | {counts['crashed']} | {share} |")


def stamp(seconds: float, jobs: int) -> str:
    """When, at which commit and on what this run ran (the table's header lines; kept in --json)."""
    return "\n".join([
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- zoo commit: {git_commit(ROOT)}; collider: `{Path(collider._C.__file__).name}` built "
        f"{built_at(collider._C.__file__)} in `{BUILD_DIR}`, whose checkout is at commit {git_commit(BUILD_DIR.parent)}",
        f"- torch {torch.__version__}, transformers {transformers.__version__}, Python {sys.version.split()[0]}, "
        f"1 CPU thread per architecture; {seconds:.0f} s in all ({jobs} at once)"])


def write_markdown(rows: list, path: Path, seconds: float, names: list, jobs: int = 1,
                   merged: tuple = None) -> None:
    """merged: (the earlier run's stamp, the architectures rerun now) for a --merge run."""
    equal_rows = [{**r, **r["equal"]} for r in rows if r["equal"]]
    groups: dict = collections.defaultdict(list)
    for r in rows:
        if r["outcome"] == "refused":
            groups[r["group"]].append(r["id"])
    lines = [
        "# The zoo: Collider on every transformers causal-LM, masked-LM, image-text-to-text, sequence-to-sequence and",
        "# speech-sequence-to-sequence architecture",
        "",
        "Generated by `python/tests/zoo_table.py` (the code `python/tests/test_zoo.py` runs, marker `zoo`); do not",
        "edit by hand. Each model class of transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` and",
        "`MODEL_FOR_MASKED_LM_MAPPING_NAMES`, of `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES` run with one",
        f"image of {zoo.IMAGE_PATCHES} x {zoo.IMAGE_PATCHES} patches per row (task `image`; most of these do not "
        "build from a generic tiny config), and of `MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES` (task `seq2seq`)",
        "and `MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES` (task `speech`), each run twice: the encoder's source as long",
        f"as the target (`-same`: text padded to one length, in the traces too; audio whose encoder gives T positions)",
        f"and of another length (`-other`: {zoo.SOURCE_OTHER} positions), the loss on the decoder's positions (a class",
        "of these mappings that has no encoder runs on its text alone); built tiny from its config class (hidden "
        f"{zoo.HIDDEN}, {zoo.LAYERS} layers or one per kind of layer it mixes, {zoo.HEADS} heads, vocab {zoo.VOCAB}, "
        "dropout 0; float64 where it runs, else float32; CPU, train mode), gets a plan traced",
        "(`collider.hf.trace_plan` for causal LMs, the masked cross-entropy over the kept positions for masked LMs,",
        "the per-token loss of the text positions for images),",
        f"then for attn_implementation eager and sdpa (where the model takes them), B = {zoo.B}, T = {zoo.T}, keep",
        "masks per_sequence at filter_ratio 0.25 and 0.5 and a ragged batch_topk at 0.5, and both semantics",
        "(kept_only, exact_query), the parameter gradients of `filter_backward` are compared with `mask_backward`'s",
        "(the oracle: the same gradients on full-size zero-masked tensors) on fresh forwards of the same batch.",
        "Outcomes: **exact** (every point within 1e-4 relative in float64, 1e-3 in float32), **refused**",
        "(a `collider.Error`; a plain backward of the same loss then gives the loss_only gradient), **wrong**",
        "(accepted and the gradients differ, or refused with the graph left changed), **crashed** (another",
        "exception after Collider accepted, or an untyped error from Collider), **not buildable** (the tiny",
        "model does not run here: why). An architecture's outcome is the worst of its attention implementations'.",
        "An architecture exact under eager attention in float64 is also compared, at per_sequence 0.5 in both",
        "semantics, with plain autograd through the independent attention oracle of `python/tests/oracle.py`",
        "(registered with transformers' AttentionInterface; it shares no code with collider): a difference is",
        "**wrong** (mask_backward's gradients too, also where filter_backward refused: each is called on its own);",
        "a model whose attention does not dispatch through the interface is not compared, nor one with nodes run",
        "whole (an op that mixes positions outside attention: DESIGN.md section 3; its rule has its own oracle in",
        "`test_run_whole.py`); in an encoder-decoder it",
        "applies the keep mask to the decoder's own self-attention only (found by where the module sits).",
        f"Column *equal sizes*: the same run with B = T = hidden = {zoo.EQUAL.seq} (and the source as long as",
        "the target; the ragged batch_topk 0.5 mask alone), where nothing can be told apart by its size",
        "(`test_equal_sizes`): a result that depended on two sizes differing shows there.",
        "",
    ]
    if merged:
        earlier, rerun = merged
        lines += [f"Rows of an earlier run, except {len(rerun)} rerun later (`--merge`): {', '.join(rerun)}.", "",
                  "The earlier run:", earlier, "", "The rerun:"]
    lines += stamp(seconds, jobs).splitlines()
    if names:
        lines.append(f"- only the architectures named: {', '.join(names)}")
    lines += ["", "| task | tried | exact | refused | not buildable | wrong | crashed | exact among built |",
              "|---|---|---|---|---|---|---|---|"]
    for task in ("all", "causal", "masked", "image", "seq2seq", "speech"):
        which = [r for r in rows if task in ("all", r["task"])]
        if which:
            lines.append(count_row(task, which))
    if equal_rows:
        lines.append(count_row(f"equal sizes (B = T = hidden = {zoo.EQUAL.seq})", equal_rows))
    oracle = collections.Counter(r["impls"]["eager"]["oracle"].split(":")[0] for r in rows
                                 if r["impls"].get("eager", {}).get("oracle"))
    lines += ["", "Against the independent attention oracle (eager, float64): "
              + ", ".join(f"{n} {what}" for what, n in oracle.most_common()) + "."]
    lines += [
        "",
        "## Refusal causes (architectures per cause, largest first)",
        "",
        "| architectures | cause | which |",
        "|---|---|---|",
    ]
    for cause, which in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"| {len(which)} | {cell(cause)} | {cell(', '.join(which))} |")
    lines += ["", "## Architectures", "",
              "| architecture | model class | task | attention (dtype) | outcome | cause | equal sizes |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        name = r["id"] + (f" (also {', '.join(r['aliases'])})" if r["aliases"] else "")
        outcome, cause = outcome_cells(r)
        equal = r["equal"]["outcome"] if r["equal"] else "-"
        if r["equal"] and r["equal"]["outcome"] in ("wrong", "crashed"):
            equal += ": " + r["equal"]["cause"]
        lines.append(f"| {cell(name)} | {r['model_class']} | {r['task']} | {attention_cell(r)} | {outcome} | "
                     f"{cell(cause)} | {cell(equal)} |")
    path.write_text("\n".join(lines) + "\n")


def run_one(arch: zoo.Architecture) -> tuple:
    """(its row, its progress line): both runs of one architecture."""
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    result = zoo.run_architecture(arch)
    equal = zoo.run_equal(arch) if arch.source != "other" else None
    line = (f"{arch.id} {arch.model_class}: {result.outcome} ({result.seconds:.1f} s) {result.cause[:120]}"
            + (f"; equal sizes: {equal.outcome} ({equal.seconds:.1f} s)" if equal else ""))
    return row_of(result, equal), line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mapping keys or model classes to run (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "ZOO.md")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here as JSON")
    parser.add_argument("--jobs", type=int, default=1, help="architectures run at once, one process each")
    parser.add_argument("--merge", type=Path, default=None,
                        help="a --json of an earlier run: the architectures run now replace their rows there, and "
                             "the table is written from all its rows (its run time is the earlier run's)")
    args = parser.parse_args()
    if args.merge and not args.merge.exists():
        parser.error(f"--merge {args.merge}: no such file; give the --json of an earlier full run")
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    archs = [a for a in zoo.architectures()
             if not args.names or {a.id, a.name, a.model_class} & set(args.names)]
    start = time.perf_counter()
    rows = [None] * len(archs)
    if args.jobs > 1:
        import concurrent.futures
        import multiprocessing
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(run_one, arch): i for i, arch in enumerate(archs)}
            for done, future in enumerate(concurrent.futures.as_completed(futures)):
                rows[futures[future]], line = future.result()
                print(f"[{done + 1}/{len(archs)}] {line}", flush=True)
    else:
        for i, arch in enumerate(archs):
            rows[i], line = run_one(arch)
            print(f"[{i + 1}/{len(archs)}] {line}", flush=True)
    seconds = time.perf_counter() - start
    merged, now = None, stamp(seconds, args.jobs)
    if args.merge:
        earlier = json.loads(args.merge.read_text())
        if "stamp" not in earlier:
            parser.error(f"--merge {args.merge}: it records no stamp (date, commit) of its run; rerun all")
        ran = {r["id"]: r for r in rows}
        merged = (earlier["stamp"], earlier.get("rerun", []) + [r["id"] for r in rows if r["id"] not in
                                                                 earlier.get("rerun", [])])
        rows = [ran.pop(r["id"], r) for r in earlier["rows"]] + list(ran.values())
        args.names = []
    write_markdown(rows, args.out, seconds, args.names, args.jobs, merged)
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                         "collider": collider.__version__, "seconds": round(seconds, 1),
                                         "stamp": merged[0] if merged else now, "rerun": merged[1] if merged else [],
                                         "rows": rows}, indent=1) + "\n")
    bad = [r["id"] for r in rows if r["outcome"] in ("wrong", "crashed")]
    bad += [r["id"] + " (equal sizes)" for r in rows if r["equal"] and r["equal"]["outcome"] in ("wrong", "crashed")]
    print(f"wrote {args.out}: {len(rows)} architectures in {seconds:.0f} s; "
          f"wrong or crashed: {', '.join(bad) or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
