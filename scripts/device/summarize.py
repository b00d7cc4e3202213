"""The GPU run's results as one Markdown page: provenance, every step with its seconds, the `gpu` tests,
TinyLlama-1.1B's backward and end-to-end reductions at T = 2048 with MFU (on the FLOPs a regular step
would do, and on the FLOPs actually executed), the side-by-side backward benchmark, the cuBLAS and
torch GEMM floors beside the rewritten backward, and the transformers LlamaForCausalLM rows.
Reads only the folder that scripts/device/run_gpu_checks.sh (or run_paper_scale.sh) packed; stdlib only.
  python3 scripts/device/summarize.py DEST --out DEST/summary.md          # on the machine (the script does it)
  python scripts/device/summarize.py DEST --save results/gpu_check        # here: copy DEST + summary into results/
Tested by the CPU rehearsal (scripts/device/rehearse.sh), whose output says REHEARSAL on every table.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import shutil
import statistics
import sys
import tarfile
import xml.etree.ElementTree as ET
from collections import defaultdict

PAPER = {"bwd": -0.351, "e2e": -0.220}  # v1 abstract, 40% filtered, best of the three models


class Dest:
    """The packed folder: top-level files, plus the members of details.tar.gz."""

    def __init__(self, path: str):
        self.path = path
        self.members: dict[str, bytes] = {}
        tgz = os.path.join(path, "details.tar.gz")
        if os.path.exists(tgz):
            with tarfile.open(tgz) as t:
                for m in t.getmembers():
                    if m.isfile():
                        self.members[m.name.removeprefix("./")] = t.extractfile(m).read()

    def read(self, name: str) -> str | None:
        p = os.path.join(self.path, name)
        if os.path.exists(p):
            with open(p, encoding="utf-8") as f:
                return f.read()
        data = self.members.get(name)
        return data.decode("utf-8", "replace") if data is not None else None

    def jsonl(self, name: str) -> list[dict]:
        text = self.read(name)
        if not text:
            return []
        rows = []
        for line in text.splitlines():
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    print(f"warning: {name}: a line that is not JSON was skipped", file=sys.stderr)
        return rows


def pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:+.1f}%"


def ms(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else (f"{x:.1f}" if x >= 10 else f"{x:.2f}")


def frac(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.2f}" if abs(x) >= 0.01 or x == 0 else f"{x:.2g}"  # tiny rehearsal MFUs stay visible


def table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def method_key(row: dict) -> str:
    m = row.get("method", "?")
    return f"collider {row.get('attention_grad') or 'kept_only'}" if m == "collider" else m


# ---- sections --------------------------------------------------------------------------------------

def provenance(d: Dest) -> tuple[str, dict]:
    text = d.read("provenance.json")
    p = json.loads(text) if text else {}
    lines = ["## Provenance", ""]
    if p.get("rehearsal"):
        lines += ["**CPU REHEARSAL (COLLIDER_DEVICE_REHEARSAL=cpu): -debug models, tiny shapes, no GPU. "
                  "Nothing on this page is a GPU number or a result.**", ""]
    for k in ["commit", "git_dirty", "device_name", "cpu", "nvidia_smi", "torch_version", "torch_cuda_version",
              "cudnn_version", "nvcc", "python", "nproc", "hostname", "time"]:
        lines.append(f"- {k}: `{p.get(k)}`")
    if not p:
        lines.append("- provenance.json missing: the commit, device and versions of these numbers are unknown")
    return "\n".join(lines), p


def steps(d: Dest) -> str:
    text = d.read("steps.tsv")
    if not text:
        return "## Steps\n\nsteps.tsv missing from details.tar.gz."
    rows = [line.split("\t") + [""] * 4 for line in text.splitlines() if line.strip()]
    total = sum(int(r[2]) for r in rows if r[2].isdigit())
    return "\n".join(["## Steps (seconds)", "", table(["step", "status", "s", "detail"], [r[:4] for r in rows]), "",
                      f"Sum of the steps: {total} s."])


def junit(d: Dest, name: str, title: str) -> str:
    text = d.read(name)
    if not text:
        return f"## {title}\n\nnot run ({name} missing)."
    root = ET.fromstring(text)
    cases = root.iter("testcase")
    counts, skipped, failed = defaultdict(int), [], []
    for c in cases:
        status = c.get("status") or ("fail" if c.find("failure") is not None or c.find("error") is not None else
                                     "notrun" if c.find("skipped") is not None else "run")
        counts[status] += 1
        name = (c.get("name") or "?").split("  #")[0]  # drop gtest's "  # GetParam() = ..." suffix
        if status == "notrun":
            skipped.append(name)
        elif status == "fail":
            failed.append(name)
    n = sum(counts.values())
    lines = [f"## {title}", "", f"{n} tests: {counts['run']} passed, {counts['fail']} failed, {counts['notrun']} skipped."]
    if failed:
        lines.append("Failed: " + ", ".join(f"`{x}`" for x in failed))
    if skipped:
        lines.append(f"Skipped ({len(skipped)}): " + ", ".join(f"`{x}`" for x in skipped[:12]) +
                     (" ..." if len(skipped) > 12 else ""))
    return "\n".join(lines)


def change(row: dict, key: str) -> float:
    """A reduction the engine wrote into the row (measuring/figures.h), as a time change: negative = faster;
    NaN where the row has none (no regular in its group, or rows written before the engine wrote them)."""
    v = row.get(key)
    return -v if v is not None else math.nan


def over_floor(row: dict, floor: dict | None) -> float:
    """The row's backward (its rewrite counted) over the T' floor: the engine's vs_floor where the floor
    was measured in the row's group (run.floor); else against a floor measured as a point of its own
    (a manifest that lists T' among its sequence lengths), by the same definition."""
    if row.get("vs_floor") is not None:
        return row["vs_floor"]
    if not floor:
        return math.nan
    return (row["bwd_ms"] + (row.get("rewrite_ms") or 0.0)) / floor["bwd_ms"]


def reductions(rows: list[dict], peak_override: float | None, label: str) -> str:
    """Backward and step rows per (model, T, B): time, change vs regular, FLOP ideal, of ideal, T' floor,
    and MFU on the dense-equivalent (regular's) and on the executed FLOPs."""
    ok = [r for r in rows if r.get("status") == "ok"]
    bad = [r for r in rows if r.get("status") != "ok"]
    if not ok:
        return f"### {label}\n\nno ok rows." + (f" {len(bad)} rows not ok: " + "; ".join(
            f"{r.get('point_id')}: {r.get('status')} {r.get('error')}" for r in bad[:4]) if bad else "")
    peak_note = ""
    by = defaultdict(list)
    for r in ok:
        by[(r["model"], r["seq_len"], r["batch_size"])].append(r)
    out = [f"### {label}", ""]
    headers = ["model", "T", "B", "method", "bwd ms", "bwd vs regular", "FLOP ideal", "of ideal", "over T' floor",
               "rewrite ms", "step ms", "step vs regular", "e2e FLOP ideal", "bwd MFU dense-eq / executed",
               "step MFU dense-eq / executed", "peak GiB"]
    body = []
    for (model, T, B), rs in sorted(by.items()):
        reg = next((r for r in rs if r["method"] == "regular"), None)
        if reg is None or all(r["method"] == "regular" for r in rs):
            continue  # a T' floor point alone: shown under its T below
        floor = None  # the T' floor's own row, shown under its T
        kept = next((r.get("kept_per_seq") for r in rs if r["method"] == "collider"), None)
        if kept is not None:
            floor = next((f for f in ok if f["model"] == model and f["method"] == "regular" and f["seq_len"] == kept
                          and f["batch_size"] == B), None)
        for r in sorted(rs, key=lambda r: ["regular", "loss_only", "collider kept_only",
                                           "collider exact_query"].index(method_key(r))
                        if method_key(r) in ["regular", "loss_only", "collider kept_only", "collider exact_query"]
                        else 9):
            peak = peak_override or r.get("device_peak_flops")
            if peak_override:
                peak_note = (f"MFU against a nominal peak of {peak_override / 1e12:g} TFLOP/s given with --peak-flops "
                             "(rehearsal: shows the arithmetic runs, says nothing about a device).")
            elif r.get("device_peak_flops"):
                peak_note = (f"MFU against {r['device_peak_flops'] / 1e12:g} TFLOP/s (the rows' device_peak_flops: "
                             "dense bf16 datasheet peak).")
            bwd_s, step_s = r["bwd_ms"] / 1e3, r["step_ms"] / 1e3
            fwd, fb, fbd = r.get("flops_fwd", math.nan), r.get("flops_bwd", math.nan), r.get("flops_bwd_dense", math.nan)
            mfu = (lambda fl, s: fl / s / peak if peak and s > 0 else math.nan)
            # The row's figures as the engine wrote them (measuring/figures.h; changes here: negative = faster).
            bwd_red = change(r, "reduction")
            step_red = change(r, "step_reduction")
            ideal = -r.get("flop_ideal_bwd_reduction", math.nan)
            e2e_ideal = (fwd + fb) / (fwd + fbd) - 1 if fwd == fwd and fbd else math.nan
            is_filter = r["method"] != "regular"
            body.append([model, T, B, method_key(r), ms(r["bwd_ms"]), pct(bwd_red) if is_filter else "",
                         pct(ideal) if is_filter else "", frac(r.get("of_ideal")) if is_filter and ideal else "",
                         pct(over_floor(r, floor) - 1) if is_filter else "",
                         ms(r.get("filter_ms")) if r["method"] == "collider" else "",
                         ms(r["step_ms"]), pct(step_red) if is_filter else "", pct(e2e_ideal) if is_filter else "",
                         f"{frac(mfu(fbd, bwd_s))} / {frac(mfu(fb, bwd_s))}",
                         f"{frac(mfu(fwd + fbd, step_s))} / {frac(mfu(fwd + fb, step_s))}",
                         f"{r.get('peak_mem_bytes', 0) / 2**30:.1f}"])
        if floor:
            body.append([model, floor["seq_len"], B, "T' floor (regular at T')", ms(floor["bwd_ms"]), "", "", "", "", "",
                         ms(floor["step_ms"]), "", "", "", "", f"{floor.get('peak_mem_bytes', 0) / 2**30:.1f}"])
    out.append(table(headers, body))
    out += ["", "Changes are time vs regular at the same model, T and B (negative = faster), as the engine wrote them "
            "into the rows (measuring/figures.h): bwd counts `loss.backward()` and Collider's rewrite (also its own "
            "column), over T' floor the same against the floor (measured in the same rounds, or as a point of its own); FLOP ideal = change in analytic backward "
            "FLOPs (models/flops.h), e2e FLOP ideal the same for forward + backward; of ideal = measured / ideal. "
            "MFU dense-eq = the FLOPs a regular step would do (flops_bwd_dense, + flops_fwd for the step) over the "
            "time; executed = the FLOPs this method runs (flops_bwd). " + (peak_note or "No peak FLOP/s known for "
            "this device: MFU n/a."), ]
    if bad:
        out.append(f"{len(bad)} rows not ok: " + "; ".join(f"`{r.get('point_id')}` {r.get('status')}: "
                                                          f"{str(r.get('error'))[:120]}" for r in bad[:6]))
    return "\n".join(out)


def headline(rows_by_impl: dict[str, list[dict]]) -> str:
    """TinyLlama-1.1B (or its rehearsal stand-in) at T = 2048: the four numbers the paper quotes."""
    lines = ["## TinyLlama-1.1B, T = 2048, 40% filtered: the paper's claims", "",
             table(["attention", "semantics", "backward", "paper backward", "end-to-end", "paper end-to-end"],
                   [[impl, key.split()[1], pct(change(r, "reduction")), pct(PAPER["bwd"]),
                     pct(change(r, "step_reduction")), pct(PAPER["e2e"])]
                    for impl, rows in rows_by_impl.items()
                    for reg in [next((x for x in rows if x.get("status") == "ok" and x["method"] == "regular"
                                      and x["seq_len"] == 2048 and x["model"].startswith("tinyllama")), None)] if reg
                    for key in ["collider kept_only", "collider exact_query"]
                    for r in [next((x for x in rows if x.get("status") == "ok" and method_key(x) == key
                                    and x["seq_len"] == 2048 and x["model"] == reg["model"]), None)] if r])]
    return "\n".join(lines)


def side_by_side(rows: list[dict], peak: float | None) -> str:
    """experiments/bench_backward.toml's rows (the measurement engine's, `collider run`): per group, each
    method against the group's regular, its FLOP ideal (the row's flop_ideal_bwd_reduction) and the T'
    floor measured in the same rounds (the row whose floor_of is the group's T)."""
    if not rows:
        return "## Side by side (experiments/bench_backward.toml)\n\nnot run."
    out = ["## Side by side (experiments/bench_backward.toml: the measurement engine, interleaved rounds, medians)",
           ""]
    body = []
    groups = defaultdict(list)
    for r in rows:
        if r.get("status") == "ok":
            groups[r["group"]].append(r)
    for group in groups.values():
        reg = next((r for r in group if r["method"] == "regular" and not r.get("aa_copy") and r.get("floor_of") is None),
                   None)
        for r in group:
            name = method_key(r) + (" (A/A copy)" if r.get("aa_copy") else "")
            if r.get("floor_of") is not None:
                name = f"floor (regular at T' = {r['seq_len']})"
            t = r["bwd_ms"] + (r.get("filter_stats") or {}).get("rewrite_ms", 0.0)
            ideal = r.get("flop_ideal_bwd_reduction") if r["method"] == "collider" else None
            # the row's figures as the engine wrote them (measuring/figures.h)
            delta = change(r, "reduction") if reg and r is not reg else None
            pk = peak or r.get("device_peak_flops")
            s = t / 1e3
            mfu = f"{frac(r['flops_bwd_dense'] / s / pk)} / {frac(r['flops_bwd'] / s / pk)}" if pk else "n/a"
            body.append([r["model"], r.get("floor_of") or r["seq_len"], r["batch_size"], name, ms(r["bwd_ms"]),
                         ms((r.get("filter_stats") or {}).get("rewrite_ms")) if r["method"] == "collider" else "",
                         pct(delta) if delta is not None else "", pct(-ideal) if ideal else "",
                         frac(r.get("of_ideal")) if ideal else "",
                         frac(r.get("vs_floor")) if r["method"] == "collider" else "", mfu, r.get("dtype"),
                         r.get("device")])
    out.append(table(["model", "T", "B", "method", "bwd ms", "rewrite ms", "vs regular (with rewrite)", "FLOP ideal",
                      "of ideal", "x floor", "bwd MFU dense-eq / executed", "dtype", "device"], body))
    out += ["", "MFU on the row's analytic FLOPs (a regular backward's, and those executed; n/a where the peak is "
            "unknown); Collider's time includes its rewrite."]
    return "\n".join(out)


def gemm_sums(bench: dict, prefix_dense: str, prefix_reduced: str, ratio: int = 400) -> dict | None:
    """Sum over TinyLlama-1.1B's 7 projections and both backward GEMMs (dX, dW) of one decoder layer:
    dense time (ratio 0) and reduced time at `ratio` permille, in ms (median over repetitions)."""
    times = defaultdict(list)
    for b in bench.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration" or b.get("error_occurred"):
            continue
        seg = dict(s.split(":", 1) for s in b["name"].split("/") if ":" in s)
        if not seg.get("model", "").startswith("tinyllama"):
            continue
        unit = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
        times[(seg.get("layer"), seg.get("op"), seg.get("method"), int(seg.get("ratio_permille", -1)))].append(
            b["real_time"] * unit)
    med = {k: statistics.median(v) for k, v in times.items()}
    dense = {(k[0], k[1]): v for k, v in med.items() if k[2] == prefix_dense and k[3] == 0}
    red = {(k[0], k[1]): v for k, v in med.items() if k[2] == prefix_reduced and k[3] == ratio}
    pairs = sorted(set(dense) & set(red))
    if not pairs:
        return None
    return {"dense_ms": sum(dense[p] for p in pairs), "reduced_ms": sum(red[p] for p in pairs), "gemms": len(pairs)}


def floors(d: Dest, sweep_rows: list[dict]) -> str:
    out = ["## GEMM floors beside the rewritten backward (TinyLlama-1.1B projections, 40% filtered)", ""]
    body = []
    for name, file, pairs in [("cuBLAS (bench/bm_cublas_gemm)", "bm_cublas_gemm.json",
                               [("cublas_dense", "cublas_reduced"), ("cublaslt_dense", "cublaslt_reduced")]),
                              ("torch (bench/bm_backward_gemm)", "bm_backward_gemm.json",
                               [("dense", "reduced"), ("dense", "reduced_gather")])]:
        text = d.read(file)
        if not text:
            body.append([name, "not measured", "", "", "", "", ""])
            continue
        bench = json.loads(text)
        ctx = bench.get("context", {})
        where = f"{ctx.get('collider_device', '?')} {ctx.get('collider_scale', '')}".strip()
        for dn, rn in pairs:
            s = gemm_sums(bench, dn, rn)
            if s is None:
                body.append([name, f"{dn} / {rn}: no rows", where, "", "", "", ""])
                continue
            body.append([name, f"{dn} -> {rn}", where, s["gemms"], ms(s["dense_ms"]), ms(s["reduced_ms"]),
                         pct(s["reduced_ms"] / s["dense_ms"] - 1)])
    out.append(table(["library", "methods", "device / scale", "GEMMs", "one layer dense ms", "one layer reduced ms",
                      "change"], body))
    # The measured backward per decoder layer, for the same rows per sequence of T = 2048 tokens.
    lines = []
    for r in sweep_rows:
        if r.get("status") == "ok" and r["seq_len"] == 2048 and r["model"].startswith("tinyllama") and \
                method_key(r) in ("regular", "collider kept_only", "collider exact_query"):
            layers = {"tinyllama-1.1b": 22, "tinyllama-debug": 2, "tinyllama-mini": 4}.get(r["model"])
            if layers is None:
                continue
            lines.append(f"- {r['model']} {r.get('attention_impl')} {method_key(r)}: whole backward "
                         f"{ms(r['bwd_ms'])} ms for B = {r['batch_size']}, i.e. "
                         f"{ms(r['bwd_ms'] / r['batch_size'] / layers)} ms per sequence and decoder layer "
                         "(attention, norms and the LM head included)")
    out += ["", "One layer = the 7 projections x (dX, dW) of one decoder layer at the benchmark's T rows (paper "
            "scale: T = 2048; reduced: N = T - ceil(0.4 T) = 1228 rows), summed; times per GEMM are medians. "
            "What the rewritten backward takes per layer and sequence (sweep rows at T = 2048):", ""] + (lines or ["- no T = 2048 TinyLlama sweep rows"])
    return "\n".join(out)


def hf_rows(d: Dest) -> str:
    """python/bench/bench_hf_backward.py's result rows (experiment "bench_hf_backward", one per method and
    point, keyed as the sweeps' rows), one table line each. bwd ms runs from the end of the forward to
    the end of the backward, so Collider's includes its filter_backward call."""
    rows = d.jsonl("hf_llama.jsonl")
    ours = [r for r in rows if r.get("experiment") == "bench_hf_backward" and r.get("status") == "ok"]
    if not ours:
        why = (f"{len(rows)} rows, none from python/bench/bench_hf_backward.py" if rows else
               "no hf_llama.jsonl; the Python package is not in the tree")
        return f"## transformers LlamaForCausalLM\n\nnot run ({why})."
    body = []
    for r in ours:
        vs = "" if r["label"] == "regular" or r.get("reduction") is None else pct(-r["reduction"])
        body.append([r["shapes"], r["attn_implementation"], r.get("floor_of") or r["seq_len"], r["batch_size"],
                     r["label"], ms(r["fwd_ms"]), ms(r["filter_call_ms"]) if "filter_call_ms" in r else "",
                     ms(r["bwd_ms"]), vs, frac(r.get("of_ideal")) if r.get("ideal") else "", r["dtype"],
                     r["device_name"], r["transformers_version"]])
    return "\n".join(["## transformers LlamaForCausalLM (python/bench/bench_hf_backward.py)", "",
                      table(["model", "attn", "T", "B", "method", "fwd ms", "filter_backward call ms",
                             "bwd ms (call included)", "vs regular", "of FLOP ideal", "dtype", "device",
                             "transformers"], body)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dest", help="the folder a device script packed")
    ap.add_argument("--out", help="write the page here (default: stdout)")
    ap.add_argument("--peak-flops", type=float, help="peak FLOP/s for MFU instead of the rows' device_peak_flops")
    ap.add_argument("--save", help="copy DEST's files and the page into SAVE/<device>-<date>/ (a results/ folder)")
    a = ap.parse_args()
    d = Dest(a.dest)
    prov_text, prov = provenance(d)
    sweeps = {"sdpa (flash)": d.jsonl("tab_backward_time_sdpa.jsonl"), "eager": d.jsonl("tab_backward_time.jsonl")}
    all_sweep = [r for rows in sweeps.values() for r in rows]
    title = "# GPU run" + (" — CPU REHEARSAL, not a result" if prov.get("rehearsal") else
                           f" on {prov.get('device_name', '?')}")
    parts = [title, f"Made by scripts/device/summarize.py from `{os.path.basename(os.path.abspath(a.dest))}`.",
             prov_text, headline(sweeps), "## Backward and end-to-end rows (experiments/paper/tab_backward_time.toml)"]
    parts += [reductions(rows, a.peak_flops, f"attention {impl}") for impl, rows in sweeps.items() if rows]
    parts += [side_by_side(d.jsonl("bench_backward.jsonl"), a.peak_flops), floors(d, all_sweep),
              junit(d, "logs/ctest_gpu.xml", "gpu tests (ctest -L gpu)"),
              junit(d, "logs/pytest.xml", "Python package tests (pytest, COLLIDER_TEST_DEVICE)"), hf_rows(d), steps(d)]
    page = "\n\n".join(p for p in parts if p) + "\n"
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(page)
    else:
        sys.stdout.write(page)
    if a.save:
        stamp = re.sub(r"[^0-9]", "", prov.get("time", ""))[:12] or "undated"
        dev = re.sub(r"[^a-z0-9]+", "-", str(prov.get("device_name", "unknown")).lower()).strip("-")
        target = os.path.join(a.save, f"{'rehearsal-' if prov.get('rehearsal') else ''}{dev}-{stamp[:8]}-{stamp[8:]}")
        os.makedirs(target, exist_ok=True)
        for name in os.listdir(a.dest):
            shutil.copy2(os.path.join(a.dest, name), target)
        with open(os.path.join(target, "summary.md"), "w", encoding="utf-8") as f:
            f.write(page)
        print(f"saved into {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
