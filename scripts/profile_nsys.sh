#!/usr/bin/env bash
# Profile a manifest under Nsight Systems and turn its NVTX ranges into a per-layer CSV.
#   ./scripts/profile_nsys.sh experiments/smoke.toml [--set key=value ...]
#   PROFILE_STEPS=3:5 OUT_DIR=results/profile/x ./scripts/profile_nsys.sh MANIFEST
# Captures steps [a, b) of every point (collider run --profile-steps a:b brackets them with
# cudaProfilerStart/Stop; nsys --capture-range=cudaProfilerApi records only those), then
# `nsys stats` summarises the NVTX ranges of the `collider` domain (layer.07.fwd,
# layer.07.bwd, filter, optimizer, ...) projected onto the GPU (nvtx_gpu_proj_sum; falls back
# to the CPU-side nvtx_sum on older nsys) and writes OUT_DIR/layers.csv:
#   name,phase,instances,total_ms,avg_ms,median_ms,report
# NOT RUN in this repository's CI or on the development machine: it needs a CUDA GPU and nsys on
# the PATH (the device machines used so far had no working nsys). Without a GPU use
# `collider run MANIFEST --trace FILE` (same ranges, Chrome/Perfetto JSON) instead.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ $# -lt 1 ]]; then
  echo "usage: $0 MANIFEST.toml [collider run options...]" >&2
  exit 2
fi
MANIFEST=$1
shift
BIN=${COLLIDER_BIN:-build/collider}
STEPS=${PROFILE_STEPS:-3:5}
NAME=$(basename "$MANIFEST" .toml)
OUT_DIR=${OUT_DIR:-results/profile/${NAME}-$(date +%Y%m%d-%H%M%S)}

command -v nsys >/dev/null || { echo "profile_nsys.sh: nsys is not on the PATH (install Nsight Systems)" >&2; exit 1; }
[[ -x "$BIN" ]] || { echo "profile_nsys.sh: $BIN not built (run ./scripts/bootstrap.sh)" >&2; exit 1; }
mkdir -p "$OUT_DIR"

# The run itself: rows still go to OUT_DIR/run/results.jsonl (timings include profiler overhead).
nsys profile --trace=cuda,nvtx,osrt --capture-range=cudaProfilerApi --capture-range-end=repeat \
  --force-overwrite=true -o "$OUT_DIR/profile" \
  "$BIN" run "$MANIFEST" --profile-steps "$STEPS" --out "$OUT_DIR/run" "$@"

REP="$OUT_DIR/profile.nsys-rep"
REPORT=nvtx_gpu_proj_sum
if ! nsys stats --force-export=true --report "$REPORT" --format csv --output "$OUT_DIR/nvtx" "$REP"; then
  REPORT=nvtx_sum
  nsys stats --force-export=true --report "$REPORT" --format csv --output "$OUT_DIR/nvtx" "$REP"
fi
CSV="$OUT_DIR/nvtx_${REPORT}.csv"
[[ -f "$CSV" ]] || { echo "profile_nsys.sh: nsys stats wrote no $CSV" >&2; exit 1; }

python3 - "$CSV" "$REPORT" "$OUT_DIR/layers.csv" <<'PY'
# Per-layer CSV from an nsys NVTX summary: keeps the collider ranges, one row per name.
import csv, re, sys
src, report, dst = sys.argv[1:4]
with open(src, newline="") as f:
    rows = list(csv.DictReader(f))
if not rows:
    sys.exit(f"{src}: no NVTX ranges captured (did --profile-steps cover any step?)")
def col(row, *names):
    for n in names:
        if n in row and row[n] not in ("", None):
            return row[n]
    return None
layer = re.compile(r"^(embedding|layer\.\d+|final_norm|lm_head)\.(fwd|bwd)$")
phases = {"step", "fwd", "filter", "filter.select", "filter.rewrite", "bwd", "optimizer"}
out = []
for r in rows:
    name = col(r, "Range", "Name") or ""
    name = name.split(":")[-1].lstrip(":")  # nsys may prefix the domain ("collider:layer.07.bwd")
    m = layer.match(name)
    if not m and name not in phases:
        continue
    total = float(col(r, "Total Proj Time (ns)", "Total Time (ns)") or 0)
    inst = int(float(col(r, "Range Instances", "Instances") or 0))
    med = float(col(r, "Proj Med (ns)", "Med (ns)") or 0)
    out.append({"name": m.group(1) if m else name, "phase": m.group(2) if m else "phase",
                "instances": inst, "total_ms": total / 1e6,
                "avg_ms": total / 1e6 / inst if inst else 0.0, "median_ms": med / 1e6, "report": report})
def key(r):
    m = re.match(r"layer\.(\d+)", r["name"])
    order = {"embedding": -1, "final_norm": 10**6, "lm_head": 10**6 + 1}
    return (r["phase"], int(m.group(1)) if m else order.get(r["name"], 10**7), r["name"])
out.sort(key=key)
with open(dst, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=["name", "phase", "instances", "total_ms", "avg_ms", "median_ms", "report"])
    w.writeheader()
    w.writerows(out)
print(f"profile_nsys.sh: {len(out)} ranges -> {dst}")
PY
echo "profile_nsys.sh: report $REP, rows $OUT_DIR/run/results.jsonl, per-layer $OUT_DIR/layers.csv"
