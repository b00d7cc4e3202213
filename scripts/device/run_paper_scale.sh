#!/usr/bin/env bash
# The paper-scale backward / end-to-end sweeps on one GPU machine without network, for a longer
# lease or your own GPU: builds the CLI and the Figure 4 micro-benchmark offline from the carried
# .debs/ (as scripts/device/run_gpu_checks.sh, whose shared steps are in scripts/device/lib.sh), then
# runs experiments/paper/tab_backward_time.toml slice by slice in order of priority within the
# budget, and packs ONE folder of at most 8 files (what the device tool brings back).
#   ./scripts/device/fetch_debs.sh                                   # first, on a machine with apt
#   COLLIDER_GIT_SHA=$(git rev-parse HEAD) ./scripts/device/run_paper_scale.sh "$OUT"   # on the GPU
#   COLLIDER_DEVICE_REHEARSAL=cpu ./scripts/device/run_paper_scale.sh /tmp/rehearsal-paper   # on the CPU
# Env: COLLIDER_DEVICE_BUDGET_S (default 500 s, build included; give the command ~60 s more),
# COLLIDER_BUILD_TIMEOUT_S (330), COLLIDER_PYTHON, COLLIDER_GIT_SHA. A rerun in the same tree continues
# the sweeps (--resume; work folder out/paper-run-work/). Slices, in order (each skipped when short of time):
#   1 TinyLlama-1.1B T=2048 (+T' floor 1224) sdpa    2 the same, eager
#   3 Qwen2.5-1.5B, Phi-1.5 T=2048 sdpa               4 the same, eager
#   5 all three T=1024 (+floor 608) sdpa, then eager  6 Figure 4 micro-benchmark, TinyLlama (>= 150 s left)
# DEST: run.log, summary.md, provenance.json, tab_backward_time_sdpa.jsonl, tab_backward_time.jsonl
# (eager), bm_backward_gemm.json, tables.md (plots/tab_backward_time.py + tab_end_to_end.py),
# details.tar.gz (logs, resolved manifests, env.json, LaTeX tables, steps.tsv).
# shellcheck disable=SC2317  # dev_pack runs from the EXIT trap (scripts/device/lib.sh dev_finish)
set -uo pipefail
TAG=paper-run
DEFAULT_BUDGET_S=500
DEFAULT_BUILD_TIMEOUT_S=330
RESERVE_S=40
# shellcheck source=scripts/device/lib.sh
source "$(dirname "$0")/lib.sh"

dev_pack() {
  local name script md="$DEST/tables.md"
  : >"$md"
  [[ -n "$REHEARSAL" ]] && printf '# CPU REHEARSAL: -debug models, not a result\n\n' >>"$md"
  for name in tab_backward_time_sdpa tab_backward_time; do
    [[ -s "$WORK/$name/results.jsonl" ]] || continue
    cp -f "$WORK/$name/results.jsonl" "$DEST/$name.jsonl"
    mkdir -p "$WORK/tables/$name"
    for script in tab_backward_time tab_end_to_end; do
      if timeout 60 "$PY" "plots/$script.py" --results "$WORK/$name/results.jsonl" --out "$WORK/tables/$name" \
           >>"$WORK/logs/tables.log" 2>&1; then
        { echo "## $script from $name.jsonl"; echo; cat "$WORK/tables/$name/$script.md"; echo; } >>"$md"
      else
        echo "## $script from $name.jsonl: plots/$script.py failed (details.tar.gz: logs/tables.log)" >>"$md"
        FAILED=1
      fi
    done
  done
  cp -f "$WORK/provenance.json" "$DEST/" 2>/dev/null
  [[ -s "$WORK/bm_backward_gemm.json" ]] && cp -f "$WORK/bm_backward_gemm.json" "$DEST/"
  pack_details
  local peak=()
  [[ -n "$REHEARSAL" ]] && peak=(--peak-flops 1e12)  # nominal: the MFU arithmetic runs; the page says so
  timeout 60 "$PY" scripts/device/summarize.py "$DEST" --out "$DEST/summary.md" "${peak[@]}" \
    >>"$WORK/logs/summarize.log" 2>&1 || { say "error: scripts/device/summarize.py failed (logs/summarize.log)"; FAILED=1; }
}

dev_start "${1:-${OUT:-$ROOT/results/paper-run}}"
dev_machine
rc=$?
((rc == 0)) || exit "$rc"
dev_unpack_debs || exit 1
dev_build collider_cli bm_backward_gemm || exit 1
dev_check_deps
"$BUILD/collider" models >"$WORK/logs/models.txt" 2>&1 || say "warning: collider models failed"

export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
T2048=(--set 'axes.seq_len=[1224, 2048]')
T1024=(--set 'axes.seq_len=[608, 1024]')
SDPA=(--set run.attention_impl=sdpa)
TINY=(--set "axes.model=$(model tinyllama-1.1b)")
OTHERS=(--set "axes.model=[\"$(model qwen2.5-1.5b)\", \"$(model phi-1.5)\"]")
ALL=(--set "axes.model=[\"$(model tinyllama-1.1b)\", \"$(model qwen2.5-1.5b)\", \"$(model phi-1.5)\"]")
sweep "TinyLlama-1.1B T=2048 sdpa (flash)" tab_backward_time_sdpa 240 40 "${TINY[@]}" "${T2048[@]}" "${SDPA[@]}"
sweep "TinyLlama-1.1B T=2048 eager" tab_backward_time 240 40 "${TINY[@]}" "${T2048[@]}"
sweep "Qwen2.5-1.5B, Phi-1.5 T=2048 sdpa" tab_backward_time_sdpa 300 60 "${OTHERS[@]}" "${T2048[@]}" "${SDPA[@]}"
sweep "Qwen2.5-1.5B, Phi-1.5 T=2048 eager" tab_backward_time 300 60 "${OTHERS[@]}" "${T2048[@]}"
sweep "all three T=1024 sdpa" tab_backward_time_sdpa 300 60 "${ALL[@]}" "${T1024[@]}" "${SDPA[@]}"
sweep "all three T=1024 eager" tab_backward_time 300 60 "${ALL[@]}" "${T1024[@]}"

# The Figure 4 micro-benchmark, TinyLlama's projections, if time is left.
if [[ -n "$REHEARSAL" ]]; then gemm=(env COLLIDER_BENCH_SCALE=cpu); gemm_time=(--benchmark_min_time=0.001 --benchmark_min_warmup_time=0)
else gemm=(env COLLIDER_BENCH_SCALE=paper); gemm_time=(--benchmark_min_time=0.05); fi
step "Figure 4 micro-benchmark, TinyLlama" 400 150 "$WORK/logs/bm_backward_gemm.log" "${gemm[@]}" "$BUILD/bench/bm_backward_gemm" \
  --benchmark_filter='model:tinyllama-1.1b/.*ratio_permille:(0|100|300|400|500|700|900|950|990)/' \
  "${gemm_time[@]}" --benchmark_out_format=json --benchmark_out="$WORK/bm_backward_gemm.json"
exit 0
