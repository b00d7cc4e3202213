#!/usr/bin/env bash
# Reproduces the paper's tables and figures: builds (scripts/bootstrap.sh), runs the scale's
# manifests (experiments/*.toml for cpu, experiments/paper/*.toml for paper) through
# `build/collider run`, runs the Figure 4 micro-benchmark (bench/bm_backward_gemm), then redraws
# every table and figure with plots/*.py into plots/out/<scale>/ (see experiments/METHODOLOGY.md).
#   ./scripts/reproduce.sh                  # cpu scale (-mini models; about 25 min on 2 quiet cores)
#   ./scripts/reproduce.sh --scale paper    # full-size models, bf16, needs a CUDA GPU
#   ./scripts/reproduce.sh --quick          # seconds-to-a-minute smoke version (tests this script)
#   ./scripts/reproduce.sh --only tab_utility --utility full   # the full utility table (cpu; ~1.5-2 h)
# Options: --build DIR (use an existing build, skip bootstrap), --only a,b (experiment stems),
#   --plots-only (redraw from the newest existing results of the scale), --no-bench,
#   --set key=value (repeatable; passed to every `collider run`, e.g. --set run.threads=4),
#   --utility quick|full (cpu scale: the utility table's training runs, experiments/tab_utility.toml,
#   3 seeds as parallel 1-thread processes, then its step times interleaved in one process,
#   experiments/tab_utility_step_time.toml; quick (default, under 10 min) is a shortened run,
#   full the manifest as written).
#   The utility data comes from scripts/prepare_data.sh (idempotent; --sample data with --quick).
# Results: results/<experiment>/<scale>-<device>-<date>/ (results.jsonl, env.json, run.log, ...);
# --quick writes everything under out/reproduce-quick/ (ignored by git) instead.
# One failing experiment does not stop the others; the exit code is non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)

SCALE=cpu
QUICK=0
BUILD_DIR=""
ONLY=""
PLOTS_ONLY=0
RUN_BENCH=1
USER_SETS=()
UTILITY=quick
usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }
while (($#)); do
  case "$1" in
    --scale) SCALE=${2:-}; shift 2 ;;
    --scale=*) SCALE=${1#--scale=}; shift ;;
    --quick) QUICK=1; shift ;;
    --build) BUILD_DIR=${2:-}; shift 2 ;;
    --build=*) BUILD_DIR=${1#--build=}; shift ;;
    --only) ONLY=${2:-}; shift 2 ;;
    --only=*) ONLY=${1#--only=}; shift ;;
    --plots-only) PLOTS_ONLY=1; shift ;;
    --no-bench) RUN_BENCH=0; shift ;;
    --utility) UTILITY=${2:-}; shift 2 ;;
    --utility=*) UTILITY=${1#--utility=}; shift ;;
    --set) USER_SETS+=(--set "${2:-}"); shift 2 ;;
    --set=*) USER_SETS+=(--set "${1#--set=}"); shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "reproduce.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
if [[ "$UTILITY" != quick && "$UTILITY" != full ]]; then
  echo "reproduce.sh: --utility must be quick or full, got '$UTILITY'" >&2; exit 2
fi
if [[ "$SCALE" != cpu && "$SCALE" != paper ]]; then
  echo "reproduce.sh: --scale must be cpu or paper, got '$SCALE'" >&2; exit 2
fi

T0=$(date +%s)
say() { printf '[reproduce %s +%ds] %s\n' "$(date +%H:%M:%S)" "$(( $(date +%s) - T0 ))" "$*"; }
FAILED=()
PLOT_SUB=""  # a sub-folder of the plot directory (the shortened utility run draws into one)

no_gpu() {
  say "error: --scale paper needs a CUDA GPU, and $1 sees none on this machine."
  say "       Run the cpu scale here (./scripts/reproduce.sh), or on a GPU machine without network"
  say "       use scripts/device/run_paper_scale.sh (see experiments/METHODOLOGY.md)."
  exit 2
}
# Before building: a paper-scale run on a machine without an NVIDIA GPU stops here.
if [[ "$SCALE" == paper ]] && ! (command -v nvidia-smi >/dev/null && grep -q GPU <<<"$(timeout 30 nvidia-smi -L 2>/dev/null)"); then
  no_gpu nvidia-smi
fi

# ---- 1. build -----------------------------------------------------------------------------------
if [[ -z "$BUILD_DIR" ]]; then
  if ((PLOTS_ONLY)); then
    BUILD_DIR=build
  else
    say "building: ./scripts/bootstrap.sh"
    [[ "$SCALE" == paper && -z "${COLLIDER_PRESET:-}" ]] && export COLLIDER_PRESET=cuda
    ./scripts/bootstrap.sh || { say "error: scripts/bootstrap.sh failed; nothing was run"; exit 1; }
    BUILD_DIR=build
  fi
fi
BUILD_DIR=$(cd "$BUILD_DIR" 2>/dev/null && pwd) || { say "error: build directory '$BUILD_DIR' does not exist"; exit 1; }
COLLIDER="$BUILD_DIR/collider"
BENCH="$BUILD_DIR/bench/bm_backward_gemm"
if [[ -f "$BUILD_DIR/python_path" ]]; then
  PY=$(cat "$BUILD_DIR/python_path")
elif [[ -n "${COLLIDER_PYTHON:-}" ]]; then
  PY=$COLLIDER_PYTHON
elif [[ -x "$HOME/.cache/collider/venv/bin/python" ]]; then
  PY=$HOME/.cache/collider/venv/bin/python
else
  PY=python3
fi
if ((!PLOTS_ONLY)) && [[ ! -x "$COLLIDER" ]]; then
  say "error: $COLLIDER not found; build first (./scripts/bootstrap.sh) or pass --build DIR"; exit 1
fi
say "build $BUILD_DIR, python $PY"

# ---- 2. device ----------------------------------------------------------------------------------
HAVE_CUDA=$(cd /tmp && "$PY" -c "import torch;print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [[ "$SCALE" == paper ]]; then
  [[ "$HAVE_CUDA" == 1 ]] || no_gpu "torch ($PY)"
  DEVICE=cuda
  MANIFEST_DIR=experiments/paper
else
  DEVICE=cpu
  MANIFEST_DIR=experiments
fi
STAMP=$(date +%Y%m%d-%H%M%S)
if ((QUICK)); then
  RESULTS_ROOT="$ROOT/out/reproduce-quick/results"
  PLOT_DIR="$ROOT/out/reproduce-quick/plots/$SCALE"
else
  RESULTS_ROOT="$ROOT/results"
  PLOT_DIR="$ROOT/plots/out/$SCALE"
fi
RUN_NAME="$SCALE-$DEVICE-$STAMP"
say "scale $SCALE, device $DEVICE$( ((QUICK)) && echo ', QUICK (tiny -debug models; numbers mean nothing)'), run $RUN_NAME"

# The experiments this script runs. tab_end_to_end is drawn from tab_backward_time's rows (same
# grid; every row carries step_ms), so its manifest is not run here.
EXPERIMENTS=(tab_backward_time fig_filter_ratio fig_context_length fig_layer_breakdown)
# The utility table trains models on real text (cpu scale only; no paper-scale manifest).
# It holds RHO-1's batch-level selection beside the per-sequence one (axes.selection).
[[ "$SCALE" == cpu ]] && EXPERIMENTS+=(tab_utility)
is_utility() { [[ "$1" == tab_utility ]]; }
wanted() {  # wanted STEM: honours --only
  [[ -z "$ONLY" ]] && return 0
  local s; IFS=',' read -ra s <<<"$ONLY"
  for x in "${s[@]}"; do
    [[ "$x" == "$1" ]] && return 0
    [[ "$x" == tab_end_to_end && "$1" == tab_backward_time ]] && return 0
  done
  return 1
}

# --quick: every manifest shrunk to tinyllama-debug, one measured step (checks the plumbing).
quick_sets() {  # quick_sets STEM -> --set arguments
  ((QUICK)) || return 0
  local common=(--set axes.model=tinyllama-debug --set run.warmup_steps=0 --set run.measure_steps=1
                --set axes.batch_size=1)
  case "$1" in
    # forward_drop needs 3+ decoder layers and the -debug presets have 2: quick runs leave it out.
    tab_backward_time)  printf '%s\n' "${common[@]}" --set 'axes.seq_len=[32,64]' \
                          --set 'axes.method=["regular","loss_only","collider"]' ;;
    fig_filter_ratio)   printf '%s\n' "${common[@]}" --set axes.seq_len=64 --set 'axes.filter_ratio=[0.1,0.5]' ;;
    fig_context_length) printf '%s\n' "${common[@]}" --set 'axes.seq_len=[32,64]' ;;
    fig_layer_breakdown) printf '%s\n' "${common[@]}" --set axes.seq_len=64 ;;
  esac
}
# tab_utility: --quick = a few steps on the --sample data; --utility quick = a shortened run
# (T 128, 60 steps, reference 40 steps, 3 seeds: under 10 min on 2 quiet cores); full = the manifest.
utility_sets() {
  if ((QUICK)); then
    printf '%s\n' --set "data.dir=$ROOT/out/reproduce-quick/data" --set train.seq_len=64 --set train.batch_size=2 \
      --set train.steps=4 --set train.warmup_steps=1 --set train.eval_every=2 --set train.eval_tokens=256 \
      --set reference.steps=2 --set reference.batch_size=2
  elif [[ "$UTILITY" == quick ]]; then
    printf '%s\n' --set train.seq_len=128 --set train.steps=60 --set train.eval_every=20 \
      --set train.checkpoint_every=20 --set train.eval_tokens=4096 --set train.warmup_steps=10 \
      --set train.log_every=10 --set reference.steps=40
  fi
}

# The utility table's seeds: each a process of one thread (the manifest's train.threads), run side
# by side; their clocks overlap, so the table's step times come from run_utility_step_time.
UTILITY_SEEDS=(0 1 2)
# run_utility MANIFEST OUT [--set ...]: every seed into OUT/seed<S>/ (resumable there with
# `collider run MANIFEST --out OUT/seed<S> --set train.seed=<S> --resume`), a progress line per
# seed every minute, then the rows merged into OUT/results.jsonl. Returns non-zero if a seed failed.
run_utility() {
  local manifest=$1 out=$2; shift 2
  local pids=() s i rc=0
  for s in "${UTILITY_SEEDS[@]}"; do
    mkdir -p "$out/seed$s"
    "$COLLIDER" run "$manifest" --out "$out/seed$s" --set "train.seed=$s" "$@" >"$out/seed$s/run.log" 2>&1 &
    pids+=($!)
  done
  while [[ -n "$(jobs -rp)" ]]; do
    sleep "${COLLIDER_PROGRESS_S:-60}"
    for s in "${UTILITY_SEEDS[@]}"; do
      echo "    seed $s: $(grep -v '^ ' "$out/seed$s/run.log" 2>/dev/null | tail -1)"
    done
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { rc=1; say "tab_utility seed ${UTILITY_SEEDS[$i]} FAILED; the end of its log:"
                            tail -5 "$out/seed${UTILITY_SEEDS[$i]}/run.log" | sed 's/^/    /'; }
  done
  cat "$out"/seed*/results.jsonl >"$out/results.jsonl" 2>/dev/null
  return $rc
}
# run_utility_step_time OUT: the utility table's methods at its model and shapes (read from
# OUT/seed<first>/manifest.resolved.toml) interleaved in one process: per-sequence methods into
# OUT/step_time/, the batch-level selection into OUT/step_time_batch_topk/.
run_utility_step_time() {
  local out=$1 resolved="$1/seed${UTILITY_SEEDS[0]}/manifest.resolved.toml" sets=() rc=0
  train_key() { awk -v k="$1" '/^\[/{t=($0=="[train]")} t && $1==k {print $3; exit}' "$resolved" | tr -d "'"; }
  sets=(--set "axes.model=$(train_key model)" --set "axes.seq_len=$(train_key seq_len)"
        --set "axes.batch_size=$(train_key batch_size)")
  if ((QUICK)); then
    sets+=(--set run.repetitions=2 --set run.measure_steps=1 --set run.warmup_steps=1)
  elif [[ "$UTILITY" == quick ]]; then
    sets+=(--set run.repetitions=5 --set run.measure_steps=2)
  fi
  mkdir -p "$out/step_time" "$out/step_time_batch_topk"
  "$COLLIDER" run "$MANIFEST_DIR/tab_utility_step_time.toml" --out "$out/step_time" "${sets[@]}" \
      >"$out/step_time/run.log" 2>&1 || rc=1
  "$COLLIDER" run "$MANIFEST_DIR/tab_utility_step_time.toml" --out "$out/step_time_batch_topk" "${sets[@]}" \
      --set run.selection=batch_topk --set 'axes.method=["regular","loss_only","collider"]' \
      >"$out/step_time_batch_topk/run.log" 2>&1 || rc=1
  tail -1 "$out/step_time/run.log" | sed 's/^/    /'
  return $rc
}

newest_run_dir() {  # newest_run_dir STEM FILE -> newest results/STEM/<scale>-*/ holding FILE
  ls -1d "$RESULTS_ROOT/$1/$SCALE"-*/ 2>/dev/null | sort | while read -r x; do
    [[ -s "$x/$2" ]] && echo "${x%/}"; done | tail -1
}

# ---- 3. experiments -----------------------------------------------------------------------------
declare -A RESULT_FILE
if ((!PLOTS_ONLY)); then
  i=0; n=0
  for e in "${EXPERIMENTS[@]}"; do wanted "$e" && n=$((n + 1)); done
  for e in "${EXPERIMENTS[@]}"; do
    wanted "$e" || continue
    i=$((i + 1))
    manifest="$MANIFEST_DIR/$e.toml"
    out="$RESULTS_ROOT/$e/$RUN_NAME"
    # The shortened utility run keeps apart from the full table's results and plots.
    is_utility "$e" && [[ "$UTILITY" == quick ]] && ((!QUICK)) && out="$RESULTS_ROOT/${e}_quick/$RUN_NAME"
    mkdir -p "$out"
    mapfile -t sets < <(quick_sets "$e")
    if is_utility "$e"; then
      mapfile -t sets < <(utility_sets)
      if ((QUICK)); then
        ./scripts/prepare_data.sh --out "$ROOT/out/reproduce-quick/data" --sample 2>&1 | tail -2 | sed "s/^/    /"
      else
        ./scripts/prepare_data.sh 2>&1 | tail -2 | sed "s/^/    /"
      fi
      [[ ${PIPESTATUS[0]} == 0 ]] || { say "$e: FAILED: scripts/prepare_data.sh"; FAILED+=("$e"); continue; }
    fi
    sets+=("${USER_SETS[@]}")
    npts=$("$COLLIDER" run "$manifest" --dry-run "${sets[@]}" 2>/dev/null | head -1 | sed -n 's/^[^:]*: \([0-9]*\) points.*/\1/p;s/^[^:]*: training manifest, \([0-9]*\) runs.*/\1/p')
    say "($i/$n) $e: ${npts:-?} points from $manifest -> ${out#"$ROOT"/}"
    t_e=$(date +%s)
    if is_utility "$e"; then
      say "    ${#UTILITY_SEEDS[@]} seeds side by side (logs in ${out#"$ROOT"/}/seed*/run.log), then the step times"
      run_utility "$manifest" "$out" "${sets[@]}" && run_utility_step_time "$out"
      rc=$?
    else
      "$COLLIDER" run "$manifest" --out "$out" "${sets[@]}" 2>&1 | tee "$out/run.log" | sed -u "s/^/    /"
      rc=${PIPESTATUS[0]}
    fi
    if ((rc != 0)); then
      say "($i/$n) $e: FAILED (exit $rc; see ${out#"$ROOT"/}/run.log); going on"
      FAILED+=("$e")
    else
      say "($i/$n) $e: done in $(( $(date +%s) - t_e )) s"
    fi
    [[ -s "$out/results.jsonl" ]] && RESULT_FILE[$e]="$out/results.jsonl"
  done

  # ---- 4. micro-benchmark (the paper's Figure 4) ------------------------------------------------
  if ((RUN_BENCH)) && wanted fig_sparse_gemm; then
    out="$RESULTS_ROOT/fig_sparse_gemm/$RUN_NAME"
    mkdir -p "$out"
    if ((QUICK)); then
      bench_args=(--benchmark_filter='model:tinyllama-1.1b/layer:k_proj/op:dX/.*ratio_permille:(0|500)/'
                  --benchmark_min_time=0.01)
    elif [[ "$SCALE" == cpu ]]; then
      # TinyLlama's projections at cpu scale (T and widths / 4), 7 of the 11 ratios: ~3 min.
      bench_args=(--benchmark_filter='model:tinyllama-1.1b/.*ratio_permille:(0|100|300|500|700|900|950|990)/'
                  --benchmark_min_time=0.05 --benchmark_min_warmup_time=0.05)
    else
      bench_args=(--benchmark_filter='ratio_permille:(0|100|200|300|400|500|600|700|800|900|950|990)/'
                  --benchmark_min_time=0.1 --benchmark_repetitions=3)
    fi
    if [[ ! -x "$BENCH" ]]; then
      say "fig_sparse_gemm: FAILED: $BENCH not built (COLLIDER_BUILD_BENCH=OFF?)"
      FAILED+=(fig_sparse_gemm)
    else
      say "fig_sparse_gemm: $BENCH at scale $SCALE -> ${out#"$ROOT"/}"
      t_e=$(date +%s)
      bench_env=(COLLIDER_BENCH_SCALE="$SCALE")
      [[ "$SCALE" == cpu ]] && bench_env+=(OMP_NUM_THREADS=2)
      env "${bench_env[@]}" "$BENCH" "${bench_args[@]}" --benchmark_format=console \
          --benchmark_out_format=json --benchmark_out="$out/bm_backward_gemm.json" >"$out/run.log" 2>&1
      rc=$?
      tail -3 "$out/run.log" | sed "s/^/    /"
      if ((rc != 0)) || [[ ! -s "$out/bm_backward_gemm.json" ]]; then
        say "fig_sparse_gemm: FAILED (exit $rc; see ${out#"$ROOT"/}/run.log)"
        FAILED+=(fig_sparse_gemm)
      else
        say "fig_sparse_gemm: $(grep -c '"run_name"' "$out/bm_backward_gemm.json") benchmarks in $(( $(date +%s) - t_e )) s"
        RESULT_FILE[fig_sparse_gemm]="$out/bm_backward_gemm.json"
      fi
    fi
  fi
else
  for e in "${EXPERIMENTS[@]}" fig_sparse_gemm; do
    wanted "$e" || continue
    file=results.jsonl; [[ "$e" == fig_sparse_gemm ]] && file=bm_backward_gemm.json
    stem_dir=$e; is_utility "$e" && [[ "$UTILITY" == quick ]] && ((!QUICK)) && stem_dir=${e}_quick
    d=$(newest_run_dir "$stem_dir" "$file")
    if [[ -z "$d" ]]; then say "$e: no results under ${RESULTS_ROOT#"$ROOT"/}/$e/$SCALE-*/"; continue; fi
    RESULT_FILE[$e]="$d/$file"
    say "$e: newest results ${RESULT_FILE[$e]#"$ROOT"/}"
  done
fi

# ---- 5. tables and figures ----------------------------------------------------------------------
mkdir -p "$PLOT_DIR"
SOURCES="$PLOT_DIR/SOURCES.md"
# One line per table/figure; a redraw replaces its line, the others (e.g. after --only) stay.
OLD_SOURCES=$(grep '^- `plots/' "$SOURCES" 2>/dev/null || true)
NEW_SOURCES=""
plot() {  # plot STEM SCRIPT [ARGS...]: one plot script on the results of experiment STEM
  local stem=$1 script=$2; shift 2
  local f=${RESULT_FILE[$stem]:-}
  if [[ -z "$f" ]]; then
    wanted "$stem" || return 0   # not asked for (--only)
    say "plot $script: skipped (no results for $stem)"
    FAILED+=("plot:$script")
    return
  fi
  # Arguments that are files (the utility table's --step-time rows) go beside the results file.
  local shown="" extra_files="" a
  for a in "$@"; do if [[ -f "$a" ]]; then extra_files+=" + \`${a#"$ROOT"/}\`"; else shown+=" $a"; fi; done
  if (cd /tmp && "$PY" "$ROOT/plots/$script" --results "$f" --out "$PLOT_DIR" "$@") >"$PLOT_DIR/.plot.log" 2>&1; then
    say "plot $script$shown: $(grep -c '^wrote' "$PLOT_DIR/.plot.log") files"
    grep -i '^warning' "$PLOT_DIR/.plot.log" | head -5 | sed 's/^/    /'
    local key="- \`plots/$script$shown\`${PLOT_SUB:+ (in $PLOT_SUB/)}"
    OLD_SOURCES=$(grep -vF -e "$key <-" <<<"$OLD_SOURCES" || true)
    NEW_SOURCES+="$key <- \`${f#"$ROOT"/}\`$extra_files ($(date -u +%Y-%m-%dT%H:%MZ), git $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"$'\n'
  else
    say "plot $script: FAILED:"; sed 's/^/    /' "$PLOT_DIR/.plot.log" | tail -8
    FAILED+=("plot:$script")
  fi
  rm -f "$PLOT_DIR/.plot.log"
}
say "tables and figures -> ${PLOT_DIR#"$ROOT"/}/"
plot tab_backward_time tab_backward_time.py
plot tab_backward_time tab_end_to_end.py
plot fig_filter_ratio fig_filter_ratio.py
plot fig_filter_ratio fig_filter_ratio.py --metric step_ms
plot fig_context_length fig_context_length.py
plot fig_context_length fig_context_length.py --metric step_ms
plot fig_layer_breakdown fig_layer_breakdown.py
((RUN_BENCH)) && plot fig_sparse_gemm fig_sparse_gemm.py
if [[ "$SCALE" == cpu ]]; then
  # --utility quick draws into a sub-folder so that the full table's files stay.
  MAIN_PLOT_DIR=$PLOT_DIR
  [[ "$UTILITY" == quick ]] && ((!QUICK)) && PLOT_SUB=utility-quick && PLOT_DIR="$PLOT_DIR/$PLOT_SUB" && mkdir -p "$PLOT_DIR"
  utility_dir=$(dirname "${RESULT_FILE[tab_utility]:-.}")
  plot tab_utility tab_utility.py --step-time $(ls "$utility_dir"/step_time*/results.jsonl 2>/dev/null)
  plot tab_utility fig_utility_curves.py
  PLOT_DIR=$MAIN_PLOT_DIR; PLOT_SUB=""
fi

{
  echo "# Sources of the tables and figures in this folder"
  echo
  echo "Drawn by scripts/reproduce.sh --scale $SCALE; each line: plot script <- results file (when, commit)."
  echo
  [[ -n "$OLD_SOURCES" ]] && echo "$OLD_SOURCES"
  printf '%s' "$NEW_SOURCES"
} >"$SOURCES"

# ---- 6. summary ---------------------------------------------------------------------------------
if ((${#FAILED[@]})); then
  say "done with FAILURES: ${FAILED[*]} (total $(( $(date +%s) - T0 )) s)"
  exit 1
fi
say "done: every experiment and plot succeeded (total $(( $(date +%s) - T0 )) s); tables and figures in ${PLOT_DIR#"$ROOT"/}/"
