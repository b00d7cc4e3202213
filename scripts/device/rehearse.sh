#!/usr/bin/env bash
# The CPU rehearsal of the GPU run, as CI runs it (CTest test `device_rehearsal`, label slow): fills
# .debs/ when it is empty (scripts/device/fetch_debs.sh: apt-get download, network), runs
# scripts/device/run_gpu_checks.sh and run_paper_scale.sh with COLLIDER_DEVICE_REHEARSAL=cpu, checks
# what each packed (the device tool's limits, every step in run.log with its seconds, the summary
# page) and drills the budget (a budget too small for any step: all skipped, still packed, exit 1).
#   ./scripts/device/rehearse.sh [WORKDIR]      # default build/device_rehearsal; ~3-5 min with a warm ccache
# Exit 0: passed; 77: skipped (no .debs/ and no apt-get to fetch them: not a Debian machine); 1: failed.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$(pwd)
W=${1:-$ROOT/build/device_rehearsal}
mkdir -p "$W" && W=$(cd "$W" && pwd)
# One work folder for both scripts: run_paper_scale.sh resumes the T = 2048 slices that
# run_gpu_checks.sh ran (as a rerun on a warm GPU machine would), which rehearses --resume too.
export COLLIDER_DEVICE_WORK_DIR="$W/work"
# Every rehearsal starts from an empty work folder and no earlier outputs: run_paper_scale.sh's
# --resume would otherwise find the rows of the previous rehearsal in "$W/work" and append to them,
# and the row counts checked below would be off on the second run in the same build folder. Only
# what this script itself writes is removed (WORKDIR may be any folder); build-rehearsal/ stays.
rm -rf "$W/work" "$W/gpu-check" "$W/paper-run" "$W/budget-drill" "$W/saved" "$W/deps-check-negative" \
       "$W/gpu-check.console.log" "$W/paper-run.console.log" "$W/budget-drill.console.log" \
       "$W/deps-check-negative.log"
T0=$(date +%s)
say() { printf '[rehearse +%ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
FAIL=0
fail() { say "FAIL: $*"; FAIL=1; }

# ---- .debs/: what the GPU run carries ---------------------------------------------------------------
shopt -s nullglob
debs=("$ROOT"/.debs/*.deb)
shopt -u nullglob
if ((${#debs[@]} == 0)); then
  if ! command -v apt-get >/dev/null; then
    say "SKIPPED: no .debs/ and no apt-get on this machine to fetch them (scripts/device/fetch_debs.sh needs"
    say "         Debian/Ubuntu with network). The GPU run's offline build was NOT rehearsed here."
    exit 77
  fi
  # A Debian machine that cannot download the packages cannot prepare the GPU run either: a failure.
  say "no .debs/: fetching them (scripts/device/fetch_debs.sh)"
  ./scripts/device/fetch_debs.sh || { say "FAIL: scripts/device/fetch_debs.sh failed (network, or a package renamed?)"; exit 1; }
fi

# check_packed DIR: the device tool's limits, checked independently of scripts/device/lib.sh.
check_packed() {
  local dir=$1 n f rel
  n=$(find "$dir" -type f | wc -l)
  ((n >= 1 && n <= 8)) || fail "$dir holds $n files; the device tool brings back at most 8"
  while IFS= read -r f; do
    rel=${f#"$dir"/}
    [[ "$rel" =~ ^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+){0,2}$ ]] || fail "$dir: '$rel' has a name the device tool refuses"
    [[ -L "$f" ]] && fail "$dir: '$rel' is a link"
    [[ -f "$f" ]] && (( $(stat -c %s "$f") > 16 * 1024 * 1024 )) && fail "$dir: '$rel' is over 16 MiB"
  done < <(find "$dir" -mindepth 1)
}

# run_one SCRIPT DEST EXPECTED_RC: one rehearsed script; its run.log must list each step with seconds.
run_one() {
  local script=$1 dest=$2 want=$3 rc
  say "running COLLIDER_DEVICE_REHEARSAL=cpu $script $dest"
  COLLIDER_DEVICE_REHEARSAL=cpu "$ROOT/scripts/device/$script" "$dest" >"$dest.console.log" 2>&1
  rc=$?
  ((rc == want)) || { fail "$script exited $rc, expected $want (its log: $dest/run.log)"; tail -n 40 "$dest.console.log"; }
  check_packed "$dest"
  grep -q 'summary (budget' "$dest/run.log" || fail "$dest/run.log has no summary"
  sed -n '/summary (budget/,/^\[.*exit/p' "$dest/run.log"
}

mkdir -p "$W/gpu-check" "$W/paper-run" "$W/budget-drill"

run_one run_gpu_checks.sh "$W/gpu-check" 0
# Every step of the GPU run, in order, each with its status and seconds (steps.tsv in details.tar.gz).
steps=$(tar xzf "$W/gpu-check/details.tar.gz" -O ./steps.tsv 2>/dev/null)
for want in "machine" "unpack .debs" "configure (preset" "build " "dependencies only from .debs" "ctest -L gpu" \
            "gpu tests listed, skip cleanly" "TinyLlama-1.1B T=2048 sdpa (flash)" "TinyLlama-1.1B T=2048 eager" \
            "bm_cublas_gemm" "side by side TinyLlama B=2" "python tests" "HF LlamaForCausalLM" \
            "Qwen2.5-1.5B, Phi-1.5 T=2048 sdpa" "bm_backward_gemm TinyLlama (brief)"; do
  line=$(printf '%s\n' "$steps" | grep -F -m1 "$want")
  if [[ -z "$line" ]]; then fail "gpu-check: no step '$want' in steps.tsv"
  elif ! [[ "$(cut -f2 <<<"$line")" =~ ^(ok|skipped-ok)$ && "$(cut -f3 <<<"$line")" =~ ^[0-9]+$ ]]; then
    fail "gpu-check: step '$want': $line"
  fi
done
for f in run.log summary.md provenance.json tab_backward_time_sdpa.jsonl tab_backward_time.jsonl \
         bench_backward.jsonl details.tar.gz; do
  [[ -s "$W/gpu-check/$f" ]] || fail "gpu-check: $f missing or empty"
done
grep -q 'CPU REHEARSAL' "$W/gpu-check/summary.md" || fail "gpu-check: summary.md does not say it is a rehearsal"
for sec in "TinyLlama-1.1B, T = 2048" "attention sdpa (flash)" "attention eager" "Side by side" "GEMM floors" \
           "gpu tests (ctest -L gpu)" "Steps (seconds)"; do
  grep -qF "$sec" "$W/gpu-check/summary.md" || fail "gpu-check: summary.md lacks the section '$sec'"
done
# The rows must be the T = 1224 / 2048 points of the manifest for TinyLlama, per attention
# implementation: regular at the T' floor 1224 and its A/A copy, and at 2048 regular, loss_only,
# both Collider semantics and regular's A/A copy (the rehearsal leaves forward_drop out: lib.sh).
for f in tab_backward_time_sdpa tab_backward_time; do
  n=$(grep -c '"model":"tinyllama-debug".*"status":"ok"\|"status":"ok".*"model":"tinyllama-debug"' "$W/gpu-check/$f.jsonl")
  ((n == 7)) || fail "gpu-check: $f.jsonl has $n ok tinyllama-debug rows, the TinyLlama slice has 7 points"
done

run_one run_paper_scale.sh "$W/paper-run" 0
for f in run.log summary.md provenance.json tab_backward_time_sdpa.jsonl tab_backward_time.jsonl tables.md \
         bm_backward_gemm.json details.tar.gz; do
  [[ -s "$W/paper-run/$f" ]] || fail "paper-run: $f missing or empty"
done

# The budget drill: too little time for any step; the script must skip, pack and exit 1.
say "budget drill: COLLIDER_DEVICE_BUDGET_S=45 (less than the reserve + the configure step's minimum)"
COLLIDER_DEVICE_BUDGET_S=45 COLLIDER_DEVICE_REHEARSAL=cpu "$ROOT/scripts/device/run_gpu_checks.sh" "$W/budget-drill" \
  >"$W/budget-drill.console.log" 2>&1
rc=$?
((rc == 1)) || fail "budget drill exited $rc, expected 1"
grep -q "skipped: .* s left, it needs" "$W/budget-drill/run.log" || fail "budget drill: no step was skipped for time"
check_packed "$W/budget-drill"

# The dependency check must be able to fail: the regular build/ of ./scripts/bootstrap.sh uses the
# system's -dev packages, so the same check run on it has to report them (skipped without build/).
if grep -qE '^tomlplusplus_DIR:PATH=/usr/' "$ROOT/build/CMakeCache.txt" 2>/dev/null; then
  # shellcheck disable=SC2030,SC2031  # lib.sh's variables live in this subshell only
  if (TAG=deps-check DEFAULT_BUDGET_S=60 DEFAULT_BUILD_TIMEOUT_S=60 RESERVE_S=0
      # shellcheck source=scripts/device/lib.sh
      source "$ROOT/scripts/device/lib.sh"
      WORK="$W/deps-check-negative" BUILD="$ROOT/build"
      mkdir -p "$WORK/logs"
      dev_check_deps) >"$W/deps-check-negative.log" 2>&1; then
    fail "the dependency check passed on build/, which uses the system's -dev packages"
  else say "dependency check on build/ (system -dev packages) fails as it must: $(grep -c '^ *BAD' "$W/deps-check-negative.log") BAD lines"; fi
fi

# The results/ step the GPU session will run on its packed folder, here on the rehearsal's.
rm -rf "$W/saved"
"${COLLIDER_PYTHON:-${COLLIDER_VENV:-$HOME/.cache/collider/venv}/bin/python}" scripts/device/summarize.py \
  "$W/gpu-check" --save "$W/saved" --peak-flops 1e12 >/dev/null || fail "summarize.py --save failed"
ls "$W"/saved/rehearsal-*/summary.md >/dev/null 2>&1 || fail "summarize.py --save wrote no rehearsal-*/summary.md"

# shellcheck disable=SC2031  # T0 is this script's; the subshell above had its own
say "rehearsal took $(( $(date +%s) - T0 )) s in all"
if ((FAIL == 0)); then say "PASSED"; else say "FAILED"; fi
exit "$FAIL"
