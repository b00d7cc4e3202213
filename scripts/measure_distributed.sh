#!/usr/bin/env bash
# Measures data-parallel step time on this CPU: experiments/dist_step_time.toml as one
# process (B = 1 and B = 2, 1 thread; B = 2 with 2 threads) and as 2 Gloo ranks on loopback
# (scripts/launch.sh, B = 1 per rank, 1 thread each; bucket all-reduces overlapping the backward,
# and again with COLLIDER_DIST_OVERLAP=0: all of the all-reduce after the backward), then writes
# summary.md: step time per run, 2-rank vs 1-rank ratios, the all-reduce's share of the 2-rank
# step, and the provenance (commit, CPU, torch, load). CPU scale: relative numbers only; the
# cores may be shared.
#   ./scripts/measure_distributed.sh [OUT_DIR]     (default results/distributed/<UTC stamp>; ~5 min)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/distributed/$(date -u +%Y%m%d-%H%M%S)}
M=experiments/dist_step_time.toml
BIN=build/collider
[[ -x $BIN ]] || { echo "measure_distributed.sh: build $BIN first (./scripts/bootstrap.sh)" >&2; exit 2; }
mkdir -p "$OUT"
{
  echo "commit: $(git rev-parse HEAD)$(git diff --quiet HEAD -- . ':!results' || echo ' (dirty)')"
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
  echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} > "$OUT/provenance.txt"

run() {  # name, then the command
  local name=$1; shift
  echo "== $name: $*" | tee -a "$OUT/commands.txt"
  "$@" 2> "$OUT/$name.log" || { echo "failed: see $OUT/$name.log" >&2; exit 1; }
}
run world1 "$BIN" run "$M" --out "$OUT/world1"
run world2 ./scripts/launch.sh 2 "$M" --set axes.batch_size=1 --out "$OUT/world2"
run world2_no_overlap env COLLIDER_DIST_OVERLAP=0 ./scripts/launch.sh 2 "$M" --set axes.batch_size=1 --out "$OUT/world2_no_overlap"
run world1_threads2 "$BIN" run "$M" --set axes.batch_size=2 --set run.threads=2 --out "$OUT/world1_threads2"
{
  echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('torch:', d['torch_version'], '(libtorch of this build, from env.json)')" "$OUT/world1/env.json"
} >> "$OUT/provenance.txt"

python3 - "$OUT" > "$OUT/summary.md" <<'EOF'
import json, sys, os
out = sys.argv[1]
def rows(name):
    with open(os.path.join(out, name, "results.jsonl")) as f:
        return {(r["method"], r["batch_size"]): r for r in map(json.loads, f) if r["status"] == "ok"}
w1, w2, w1t2, w2n = rows("world1"), rows("world2"), rows("world1_threads2"), rows("world2_no_overlap")
print("# Data-parallel step time, CPU scale (tinyllama-mini, T = 512, fp32, filter_ratio 0.4)\n")
print(open(os.path.join(out, "provenance.txt")).read().replace("\n", "  \n"))
print("Medians over 6 measured steps (2 warm-up), ms. `2 ranks` = scripts/launch.sh 2, Gloo on loopback, B = 1 per rank,"
      " 1 thread per rank (global batch 2). all-reduce = GradientReducer begin + finish (time outside the backward):"
      " wait (a tiny all-reduce before backward: mostly waiting for the slower rank) + buckets (after backward: the"
      " bucket all-reduces not finished during it, copy back). With overlap, bucket all-reduces start from gradient"
      " hooks during the backward and their time hides in bwd_ms; `no overlap` (COLLIDER_DIST_OVERLAP=0) does all of"
      " it after the backward, which is the all-reduce's full cost.\n")
print("| method | 1 proc B=1, 1 thr | 1 proc B=2, 1 thr | 1 proc B=2, 2 thr | 2 ranks x B=1 | all-reduce outside bwd (share) | wait / buckets | 2 ranks, no overlap | its all-reduce (share) | 2 ranks / (1 proc B=1) | 2 ranks / (1 proc B=2, 1 thr) | 2 ranks / (1 proc B=2, 2 thr) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for m in ["loss_only", "collider"]:
    a, b, c, d, n = w1[(m, 1)], w1[(m, 2)], w1t2[(m, 2)], w2[(m, 1)], w2n[(m, 1)]
    s = lambda r: r["step_ms"]
    print(f"| {m} | {s(a):.0f} | {s(b):.0f} | {s(c):.0f} | {s(d):.0f} | {d['allreduce_ms']:.1f} ({100*d['allreduce_ms']/s(d):.1f}%) |"
          f" {d.get('allreduce_wait_ms', 0):.1f} / {d.get('allreduce_bucket_ms', 0):.1f} |"
          f" {s(n):.0f} | {n['allreduce_ms']:.1f} ({100*n['allreduce_ms']/s(n):.1f}%) |"
          f" {s(d)/s(a):.2f} | {s(d)/s(b):.2f} | {s(d)/s(c):.2f} |")
print("\nPhases (ms): fwd / bwd / optim; process CPU ms per step (all threads; wall well above CPU / threads ="
      " the process waited for a core on this shared machine)")
print("| method | 1 proc B=1 | 1 proc B=2, 1 thr | 1 proc B=2, 2 thr | 2 ranks x B=1 (rank 0) | 2 ranks, no overlap (rank 0) |")
print("|---|---|---|---|---|---|")
for m in ["loss_only", "collider"]:
    ph = lambda r: f"{r['fwd_ms']:.0f} / {r['bwd_ms']:.0f} / {r['optim_ms']:.0f}; cpu {r.get('process_cpu_ms_per_step', 0):.0f}"
    print(f"| {m} | {ph(w1[(m, 1)])} | {ph(w1[(m, 2)])} | {ph(w1t2[(m, 2)])} | {ph(w2[(m, 1)])} | {ph(w2n[(m, 1)])} |")
d = w2[("collider", 1)]
print(f"\n2-rank rows: world_size {d['world_size']}, backend {d.get('distributed_backend')}, "
      f"gradient bytes all-reduced per rank per step {d.get('allreduce_bytes')}, "
      f"buckets {d.get('allreduce_buckets')} (started during backward: {d.get('allreduce_buckets_overlapped')}), "
      f"rank_tokens_kept {d.get('rank_tokens_kept')}, global_tokens {d.get('global_tokens')}, "
      f"all-reduce samples (ms) {[round(x, 1) for x in d.get('samples_allreduce_ms', [])]}")
EOF
cat "$OUT/summary.md"
