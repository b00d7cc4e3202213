# Shared body of scripts/device/run_gpu_checks.sh and scripts/device/run_paper_scale.sh (sourced,
# never run): the time budget and its steps, the CPU rehearsal switch, the offline build from the
# carried .debs/ with the system's -dev packages hidden from CMake (and a check of every header and
# library the build used), provenance, and the packing of DEST within the device tool's limits.
#   COLLIDER_DEVICE_REHEARSAL=cpu ./scripts/device/run_gpu_checks.sh DEST   # every step on the CPU
# Rehearsed in CI by scripts/device/rehearse.sh (CTest test device_rehearsal, label slow).
# The caller sets TAG, DEFAULT_BUDGET_S, DEFAULT_BUILD_TIMEOUT_S and RESERVE_S, then sources this.
# shellcheck shell=bash disable=SC2034,SC2317

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 1
T0=$(date +%s)

# ---- the rehearsal switch --------------------------------------------------------------------
REHEARSAL=${COLLIDER_DEVICE_REHEARSAL:-}
case "$REHEARSAL" in
  "" | cpu) ;;
  *) echo "$TAG: COLLIDER_DEVICE_REHEARSAL=$REHEARSAL: the only rehearsal is 'cpu' (or leave it unset on the GPU machine)" >&2
     exit 1 ;;
esac
if [[ -n "$REHEARSAL" ]]; then
  # A cold 2-core build takes ~15 minutes: the rehearsal gives the build its own larger cap and
  # keeps the GPU run's caps for every other step (their tiny CPU versions must fit in them).
  BUILD_TIMEOUT=${COLLIDER_BUILD_TIMEOUT_S:-2400}
  BUDGET=${COLLIDER_DEVICE_BUDGET_S:-$((BUILD_TIMEOUT + DEFAULT_BUDGET_S))}
  PY=${COLLIDER_PYTHON:-${COLLIDER_VENV:-$HOME/.cache/collider/venv}/bin/python}
  BUILD=${COLLIDER_DEVICE_BUILD_DIR:-$ROOT/build-rehearsal}  # beside build/: same relative paths, ccache hits
else
  BUILD_TIMEOUT=${COLLIDER_BUILD_TIMEOUT_S:-$DEFAULT_BUILD_TIMEOUT_S}
  BUDGET=${COLLIDER_DEVICE_BUDGET_S:-$DEFAULT_BUDGET_S}
  PY=${COLLIDER_PYTHON:-python3}  # the GPU machine's python3 holds torch; there is no project venv there
  BUILD=${COLLIDER_DEVICE_BUILD_DIR:-$ROOT/build}
fi
# The GPU machine has no network, and the rehearsal must not use one either.
export COLLIDER_NO_APT=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
DEPS=${COLLIDER_DEPS_DIR:-$ROOT/out/device-deps}  # the unpacked .debs (never unpacked into /)
WORK=${COLLIDER_DEVICE_WORK_DIR:-$ROOT/out/$TAG-work${REHEARSAL:+-rehearsal}}

elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
say() { printf '[%s %s +%ss] %s\n' "$TAG" "$(date +%H:%M:%S)" "$(elapsed)" "$*"; }

# ---- DEST, logging, exit -------------------------------------------------------------------------
# dev_start DEST: DEST gets run.log (everything printed), the packed files and nothing else.
dev_start() {
  DEST=$1
  mkdir -p "$DEST" "$WORK/logs" || { echo "$TAG: cannot create $DEST or $WORK" >&2; exit 1; }
  DEST=$(cd "$DEST" && pwd)
  # DEST is what comes back from the device tool: it starts empty (or holding an earlier run of
  # this script, which is removed), so that a stale file cannot pass as new.
  if [[ -n "$(ls -A "$DEST")" ]]; then
    if [[ -f "$DEST/run.log" ]] && [[ -z "$(find "$DEST" -mindepth 1 -type d)" ]]; then
      find "$DEST" -mindepth 1 -maxdepth 1 -type f -delete
    else
      echo "$TAG: $DEST is not empty and holds no earlier run of this script; give an empty or new folder" >&2
      exit 1
    fi
  fi
  rm -f "$WORK/steps.tsv"
  exec > >(tee -a "$DEST/run.log") 2>&1
  TEE_PID=$!
  trap dev_finish EXIT
  trap 'say "interrupted"; exit 130' INT TERM
  say "budget ${BUDGET} s (build at most ${BUILD_TIMEOUT} s, ${RESERVE_S} s kept for tables and packing);" \
      "results -> $DEST; work -> $WORK; build -> $BUILD"
  [[ -n "$REHEARSAL" ]] && say "REHEARSAL on the CPU (COLLIDER_DEVICE_REHEARSAL=cpu): every step of the GPU run" \
      "with -debug models and tiny shapes; no number here is a GPU number"
}

SUMMARY=()
FAILED=0
# note STEP STATUS SECONDS [DETAIL]: one line of the summary (and of WORK/steps.tsv).
note() {
  SUMMARY+=("$(printf '%-44s %-8s %5ss  %s' "$1" "$2" "$3" "${4:-}")")
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" >>"$WORK/steps.tsv"
  [[ "$2" == ok || "$2" == skipped-ok ]] || FAILED=1
}

# step NAME CAP_S MIN_S LOGFILE CMD...: runs CMD with a timeout of min(CAP_S, time left - RESERVE_S),
# its output into LOGFILE (the tail into run.log); skipped when fewer than MIN_S seconds are left.
step() {
  local name=$1 cap=$2 min_s=$3 log=$4; shift 4
  local limit=$(( $(left) - RESERVE_S ))
  ((limit > cap)) && limit=$cap
  if ((limit < min_s)); then
    say "step '$name' skipped: ${limit} s left, it needs ${min_s} s"
    note "$name" skipped 0 "time"
    return 1
  fi
  say "step '$name' (at most ${limit} s) -> ${log#"$ROOT"/}"
  local t rc dt cpu TIMEFORMAT='%U %S'
  t=$(date +%s)
  # bash's `time`: the CPU seconds of the step and its children (user + sys), beside the wall time.
  { time timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1; } 2>"$WORK/logs/.step-cpu"
  rc=$?
  dt=$(( $(date +%s) - t ))
  cpu=$(awk '{printf "%.0f", $1 + $2}' "$WORK/logs/.step-cpu" 2>/dev/null)
  tail -n 6 "$log" | sed 's/^/    /'
  if ((rc == 0)); then
    say "step '$name' ok in ${dt} s (CPU ${cpu:-?} s)"
    note "$name" ok "$dt" "CPU ${cpu:-?} s"
  elif ((rc == 124 || rc == 137)); then
    say "step '$name': stopped at its ${limit} s limit"
    note "$name" timeout "$dt"
  else
    say "step '$name': exit $rc after ${dt} s (see ${log#"$ROOT"/})"
    note "$name" failed "$dt" "exit $rc"
  fi
  return $rc
}

# ---- the machine and provenance -------------------------------------------------------------------
# dev_machine: prints the machine, writes WORK/provenance.json; returns 2 when torch sees no GPU
# (rehearsal: the CPU stands in, and the record says so).
dev_machine() {
  local t
  t=$(date +%s)
  if [[ -z "$REHEARSAL" ]]; then
    timeout 30 nvidia-smi >"$WORK/logs/nvidia-smi.txt" 2>&1 || say "warning: nvidia-smi failed"
    head -n 12 "$WORK/logs/nvidia-smi.txt" | sed 's/^/    /'
  else
    echo "rehearsal on the CPU: nvidia-smi not run" >"$WORK/logs/nvidia-smi.txt"
  fi
  {
    echo "nproc $(nproc); $(uname -srm); python $PY"
    if command -v nvcc >/dev/null; then nvcc --version | tail -n 1; else echo "nvcc: not on PATH"; fi
    cmake --version | head -n 1; echo "ninja $(ninja --version)"; g++ --version | head -n 1
  } 2>&1 | sed 's/^/    /'
  local commit=${COLLIDER_GIT_SHA:-} dirty=null
  if [[ -z "$commit" ]] && git -C "$ROOT" rev-parse HEAD >/dev/null 2>&1; then
    commit=$(git -C "$ROOT" rev-parse HEAD)
    [[ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]] && dirty=true || dirty=false
  fi
  if [[ -z "$commit" ]]; then
    commit=unknown
    say "WARNING: no git here and COLLIDER_GIT_SHA unset: the results' commit is unknown;" \
        "run as COLLIDER_GIT_SHA=\$(git rev-parse HEAD) $0 ..."
  fi
  (cd /tmp && COMMIT="$commit" DIRTY="$dirty" REHEARSAL="$REHEARSAL" NVCC="$(nvcc --version 2>/dev/null | tail -n 1)" \
     timeout 60 "$PY" - >"$WORK/provenance.json" 2>"$WORK/logs/provenance.err" <<'EOF'
import datetime, json, os, platform, socket, subprocess, torch
cuda = torch.cuda.is_available()
cpu = platform.processor() or platform.machine()
try:
    cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
except (OSError, StopIteration):
    pass
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
except Exception:
    smi = None
print(json.dumps({
    "commit": os.environ["COMMIT"], "git_dirty": json.loads(os.environ["DIRTY"]),
    "rehearsal": os.environ["REHEARSAL"] or None,
    "device_name": torch.cuda.get_device_name(0) if cuda else cpu, "cpu": cpu,
    "cuda_available": cuda, "torch_version": torch.__version__, "torch_cuda_version": torch.version.cuda,
    "cudnn_version": torch.backends.cudnn.version() if cuda else None,
    "nvidia_smi": smi or None, "nvcc": os.environ["NVCC"] or None,
    "python": platform.python_version(), "hostname": socket.gethostname(), "nproc": os.cpu_count(),
    "time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
}, indent=2))
EOF
  ) || { say "error: $PY cannot import torch (see logs/provenance.err)"; cat "$WORK/logs/provenance.err"; note "machine" failed 0 "no torch"; return 1; }
  sed 's/^/    /' "$WORK/provenance.json"
  if [[ -z "$REHEARSAL" ]] && ! grep -q '"cuda_available": true' "$WORK/provenance.json"; then
    say "error: $PY's torch sees no CUDA GPU here; these checks need one (nothing was built)." \
        "To rehearse on a CPU: COLLIDER_DEVICE_REHEARSAL=cpu $0"
    note "machine" failed 0 "no CUDA device visible to torch"
    return 2
  fi
  note "machine" ok $(( $(date +%s) - t ))
}

# ---- dependencies from .debs/ -------------------------------------------------------------------
DEP_PKGS=(tomlplusplus nlohmann_json GTest benchmark)
dev_unpack_debs() {
  local t f member
  t=$(date +%s)
  shopt -s nullglob
  local debs=("$ROOT"/.debs/*.deb)
  shopt -u nullglob
  if ((${#debs[@]} == 0)); then
    say "error: no .deb files in $ROOT/.debs: run ./scripts/device/fetch_debs.sh on a machine with apt and bring"
    say "       .debs along (the lab's device tool: carry [\".debs\"])"
    note "unpack .debs" failed 0 "no .debs/"
    return 1
  fi
  rm -rf "$DEPS" && mkdir -p "$DEPS"
  for f in "${debs[@]}"; do
    if command -v dpkg >/dev/null; then
      timeout 60 dpkg -x "$f" "$DEPS"
    else  # ar + tar where dpkg is missing
      member=$(ar t "$f" | grep '^data\.tar') &&
        ar p "$f" "$member" | case "$member" in *.xz) xz -dc ;; *.zst) zstd -dc ;; *.gz) gzip -dc ;; *) cat ;; esac |
        tar -x -C "$DEPS" -f -
    fi || { say "error: unpacking $f failed"; note "unpack .debs" failed 0 "$(basename "$f")"; return 1; }
  done
  local cfg
  for cfg in lib/x86_64-linux-gnu/cmake/tomlplusplus/tomlplusplusConfig.cmake share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake \
             lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake lib/x86_64-linux-gnu/cmake/benchmark/benchmarkConfig.cmake \
             include/gloo/rendezvous/store.h include/sentencepiece_processor.h; do
    [[ -f "$DEPS/usr/$cfg" ]] || { say "error: $DEPS/usr/$cfg missing after unpacking; re-run fetch_debs.sh"; note "unpack .debs" failed 0 "$cfg"; return 1; }
  done
  export LD_LIBRARY_PATH="$DEPS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  say "unpacked ${#debs[@]} .deb files into $DEPS"
  note "unpack .debs" ok $(( $(date +%s) - t ))
}

# ---- configure and build --------------------------------------------------------------------------
# dev_build TARGET...: configures BUILD against DEPS alone (/usr, /usr/local and / hidden from every
# find_* call, so a machine with the -dev packages installed still uses the .debs), then builds only
# the targets the run needs. The configure line is that of scripts/bootstrap.sh plus those hints.
dev_build() {
  if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH="/usr/local/cuda/bin:$PATH"
    say "nvcc not on PATH; using /usr/local/cuda/bin/nvcc"
  fi
  PRESET=cuda
  if ! command -v nvcc >/dev/null; then
    PRESET=cpu
    say "warning: no nvcc: preset cpu, so the fused gather kernel and bm_cublas_gemm are not built"
    note "cuda preset" failed 0 "no nvcc"
  fi
  TARGETS=("$@")
  [[ $PRESET == cuda ]] && TARGETS+=(test_gpu_gather bm_cublas_gemm)
  local torch_prefix launcher=()
  torch_prefix=$(cd /tmp && "$PY" -c "import torch;print(torch.utils.cmake_prefix_path)") || return 1
  if command -v ccache >/dev/null; then
    launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
    export CCACHE_BASEDIR="$ROOT" CCACHE_SLOPPINESS="pch_defines,time_macros"  # as scripts/bootstrap.sh
    say "ccache: $(command -v ccache)${CCACHE_DISABLE:+ (disabled: CCACHE_DISABLE=$CCACHE_DISABLE)}"
  fi
  mkdir -p "$BUILD"
  local configure=(cmake --preset "$PRESET" -B "$BUILD" -DCMAKE_PREFIX_PATH="$DEPS/usr;$torch_prefix"
                   -DPython3_EXECUTABLE="$PY" "${launcher[@]}" -Wno-dev)
  if ! step "configure (preset $PRESET, deps from .debs)" 120 20 "$WORK/logs/configure.log" \
         "${configure[@]}" "-DCMAKE_IGNORE_PREFIX_PATH=/usr;/usr/local;/"; then
    grep -E 'CMake Error|Could not|not found' "$WORK/logs/configure.log" | head -n 10 | sed 's/^/    /'
    # On the GPU machine a toolkit under /usr (CUDA, say) must not stop the run: configure again
    # with the system prefixes visible (the .debs still come first) and let the dependency check
    # below say what was used. The rehearsal has no such fallback: hidden prefixes must work.
    [[ -n "$REHEARSAL" ]] && return 1
    say "warning: the configure with /usr hidden failed; configuring again with it visible"
    rm -f "$BUILD/CMakeCache.txt"
    step "configure again, system prefixes visible" 120 20 "$WORK/logs/configure-visible.log" "${configure[@]}" || return 1
    cp -f "$WORK/logs/configure-visible.log" "$WORK/logs/configure.log"
  fi
  grep -E 'collider:' "$WORK/logs/configure.log" | sed 's/^-- /    /'
  # The cores: nproc honours OMP_NUM_THREADS, which scripts/test.sh sets to 1 for the tests (the
  # CPU rehearsal runs under CTest there).
  local jobs
  jobs=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
  step "build ${#TARGETS[@]} targets ($jobs jobs)" "$BUILD_TIMEOUT" 60 "$WORK/logs/build.log" \
    cmake --build "$BUILD" -j "$jobs" --target "${TARGETS[@]}"
  local rc=$?
  echo "$PY" >"$BUILD/python_path"
  if ((rc != 0)); then
    grep -E 'error|FAILED' "$WORK/logs/build.log" | head -n 20 | sed 's/^/    /'
    return 1
  fi
  [[ -x "$BUILD/collider" ]] || { say "error: no $BUILD/collider after the build"; return 1; }
}

# dev_check_deps: proves that the build used the .debs and nothing of the system's -dev packages:
# CMake's found paths, every header compiled (ninja's dependency log), every link line and what
# the dynamic loader resolves for the binaries. Fails on any toml++ / nlohmann / GTest / GMock /
# benchmark / gloo / sentencepiece path under /usr/include or /usr/lib.
dev_check_deps() {
  local t bad=0 var val n
  t=$(date +%s)
  local cache="$BUILD/CMakeCache.txt" out="$WORK/logs/deps-check.txt"
  : >"$out"
  for var in tomlplusplus_DIR nlohmann_json_DIR GTest_DIR benchmark_DIR COLLIDER_GLOO_INCLUDE_DIR \
             SENTENCEPIECE_INCLUDE_DIR SENTENCEPIECE_LIBRARY; do
    val=$(sed -n "s/^${var}:[A-Z]*=//p" "$cache")
    if [[ "$val" == "$DEPS"/* ]]; then echo "ok   $var = $val" >>"$out"
    else echo "BAD  $var = '$val' (not under $DEPS)" >>"$out"; bad=1; fi
  done
  local pkgs='toml\+\+|nlohmann|gtest|gmock|benchmark|gloo|sentencepiece'
  ninja -C "$BUILD" -t deps >"$WORK/logs/ninja-deps.txt" 2>/dev/null
  n=$(grep -cE "^ +/usr/(local/)?include/($pkgs)" "$WORK/logs/ninja-deps.txt")
  if ((n > 0)); then
    echo "BAD  $n headers compiled from the system:" >>"$out"
    grep -E "^ +/usr/(local/)?include/($pkgs)" "$WORK/logs/ninja-deps.txt" | sort -u | head -n 10 >>"$out"
    bad=1
  fi
  local p pat
  # (GMock is in the .debs for the CPU test suite; none of the GPU run's targets includes it.)
  for p in 'toml++/' 'nlohmann/' 'gtest/' 'benchmark/' 'gloo/' 'sentencepiece_processor.h'; do
    pat=$(printf '%s' "$p" | sed 's/+/\\+/g')
    n=$(grep -cE "(^ +|/)out/device-deps/usr/include/$pat|^ +${DEPS//+/\\+}/usr/include/$pat" "$WORK/logs/ninja-deps.txt")
    if ((n > 0)); then echo "ok   $n header uses of .debs' ${p}" >>"$out"
    else echo "BAD  no compiled file used the .debs' ${p}" >>"$out"; bad=1; fi
  done
  # Every library a link line or a link step's inputs name, as a whole path (DEPS holds usr/lib too).
  local libs='lib(tomlplusplus|benchmark|gtest|gmock|sentencepiece)'
  n=$(grep -oE "(^|[ =])/usr/(local/)?lib/(x86_64-linux-gnu/)?${libs}[^ ]*" "$BUILD/build.ninja" | wc -l)
  if ((n > 0)); then
    echo "BAD  build.ninja names $n system libraries:" >>"$out"
    grep -oE "(^|[ =])/usr/(local/)?lib/(x86_64-linux-gnu/)?${libs}[^ ]*" "$BUILD/build.ninja" | sort | uniq -c | head >>"$out"
    bad=1
  fi
  for p in libtomlplusplus libbenchmark libgtest libsentencepiece; do
    n=$(grep -oE "(^|[ =])${DEPS}/usr/lib/x86_64-linux-gnu/${p}[^ ]*" "$BUILD/build.ninja" | wc -l)
    if ((n > 0)); then echo "ok   build.ninja links $p from the .debs ($n times)" >>"$out"
    else echo "BAD  no link step uses the .debs' $p" >>"$out"; bad=1; fi
  done
  local bin lib
  for bin in "$BUILD/collider" "$BUILD/bench/bm_backward_gemm"; do
    [[ -x "$bin" ]] || continue
    for lib in libtomlplusplus libbenchmark libsentencepiece; do
      val=$(ldd "$bin" 2>/dev/null | awk -v l="$lib" '$1 ~ "^"l {print $3}')
      [[ -z "$val" ]] && continue
      if [[ "$val" == "$DEPS"/* ]]; then echo "ok   $(basename "$bin") loads $val" >>"$out"
      else echo "BAD  $(basename "$bin") loads $val" >>"$out"; bad=1; fi
    done
  done
  sed 's/^/    /' "$out"
  if ((bad)); then
    say "error: the build used a system -dev package instead of the .debs (see above)"
    note "dependencies only from .debs" failed $(( $(date +%s) - t ))
    return 1
  fi
  note "dependencies only from .debs" ok $(( $(date +%s) - t ))
}

# ---- the sweeps -----------------------------------------------------------------------------------
# model NAME: the model to run (rehearsal: its -debug preset, same family).
model() {
  if [[ -n "$REHEARSAL" ]]; then
    case "$1" in tinyllama-1.1b) echo tinyllama-debug ;; qwen2.5-1.5b) echo qwen2.5-debug ;; phi-1.5) echo phi-1.5-debug ;; *) echo "$1" ;; esac
  else
    echo "$1"
  fi
}
# The rehearsal's swaps, after the step's own --set lines: CPU, fp32, no warm-up, two interleaved
# rounds of one measured step (the A/A copy stays), and no forward_drop: the -debug presets that
# stand in for the paper models have 2 decoder layers, and forward_drop needs 3 (its GPU path is
# rehearsed by tests/gpu/test_gpu_collider.cpp's GpuForwardDrop, which skips cleanly here).
REHEARSAL_SETS=(--set run.device=cpu --set run.dtype=fp32 --set run.warmup_steps=0 --set run.measure_steps=1
                --set run.repetitions=2 --set 'axes.method=["regular", "loss_only", "collider"]')
MANIFEST=experiments/paper/tab_backward_time.toml
SWEEPS=0
# sweep LABEL OUTNAME CAP_S MIN_S --set ...: one slice of the manifest into WORK/OUTNAME (resumable;
# a point already done there is not run again).
sweep() {
  local label=$1 outname=$2 cap=$3 min_s=$4; shift 4
  local sets=("$@")
  [[ -n "$REHEARSAL" ]] && sets+=("${REHEARSAL_SETS[@]}")
  mkdir -p "$WORK/$outname"
  step "$label" "$cap" "$min_s" "$WORK/$outname/sweep.$(date +%H%M%S).log" \
    "$BUILD/collider" run "$MANIFEST" --out "$WORK/$outname" --resume "${sets[@]}"
  local rc=$?
  SWEEPS=$((SWEEPS + 1))
  cp -f "$WORK/$outname/manifest.resolved.toml" "$WORK/$outname/manifest.resolved.step$SWEEPS.toml" 2>/dev/null
  [[ -s "$WORK/$outname/results.jsonl" ]] && say "  $(grep -c '"status":"ok"' "$WORK/$outname/results.jsonl") ok rows in $outname/results.jsonl"
  return $rc
}

# ---- tables, packing ------------------------------------------------------------------------------
# check_dest DIR: the device tool brings back at most 8 files of at most 16 MiB each, at most 2
# folders deep, named with letters, digits, '.', '_' and '-' only. Prints what breaks a rule.
check_dest() {
  local dir=$1 bad=0 n f rel
  n=$(find "$dir" -type f | wc -l)
  ((n <= 8)) || { echo "DEST has $n files (the device tool brings back 8)"; bad=1; }
  while IFS= read -r f; do
    rel=${f#"$dir"/}
    [[ "$rel" =~ ^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+){0,2}$ ]] || { echo "DEST: '$rel': a name outside [A-Za-z0-9._-] or more than 2 folders deep"; bad=1; }
    (( $(stat -c %s "$f") <= 16 * 1024 * 1024 )) || { echo "DEST: '$rel' is over 16 MiB"; bad=1; }
    [[ -L "$f" ]] && { echo "DEST: '$rel' is a link"; bad=1; }
  done < <(find "$dir" -mindepth 1)
  (( $(du -sk "$dir" | cut -f1) <= 64 * 1024 )) || { echo "DEST is over 64 MiB"; bad=1; }
  return $bad
}

# pack_details: WORK (logs, resolved manifests, tables, JUnit XML, ...) into DEST/details.tar.gz,
# without the files DEST holds already and without the unpacked dependencies.
pack_details() {
  (cd "$WORK" && timeout 60 tar czf "$DEST/details.tar.gz" --exclude='./results.jsonl' --exclude='*/results.jsonl' \
     --exclude='./deps' . 2>/dev/null) || say "warning: packing details.tar.gz failed"
}

dev_finish() {
  local rc=$?
  trap - EXIT
  if declare -F dev_pack >/dev/null; then dev_pack; fi  # the script's own: copies its files into DEST
  pack_details
  say "summary (budget ${BUDGET} s, used $(elapsed) s):"
  printf '    %s\n' "${SUMMARY[@]}"
  local problems
  if ! problems=$(check_dest "$DEST"); then
    say "error: DEST breaks the device tool's limits:"
    printf '%s\n' "$problems" | sed 's/^/    /'
    rc=1
  fi
  ((rc == 0)) && rc=$FAILED
  say "exit $rc; files in $DEST:"
  ls -la "$DEST" | sed 's/^/    /'
  exec 1>&- 2>&-
  wait "$TEE_PID" 2>/dev/null
  exit "$rc"
}
