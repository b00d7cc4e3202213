#!/usr/bin/env bash
# The compatibility matrix: for each supported torch (with the transformers release docs/PYTHON.md
# claims), a fresh Python environment, the package installed the way docs/PYTHON.md says, and the
# Python gradient suites run against it; writes the table to docs/COMPATIBILITY.md (or --out).
#   ./scripts/compat_matrix.sh                       # every row of ROWS below (about an hour on 2 cores)
#   ./scripts/compat_matrix.sh --rows "2.11.0:5.23.0"   # other rows (torch:transformers)
#   ./scripts/compat_matrix.sh --out /tmp/compat.md
#   ./scripts/compat_matrix.sh --rows "2.11.0:5.25.0" --install-only   # only make the environments
# Exit status 1 when a row fails (install, build, a test, or a guard that lets a foreign build in).
# A row: `python3 -m venv --clear` at $COLLIDER_COMPAT_DIR/torch<T>-tf<F> (default
# ~/.cache/collider/compat; pip's cache makes the downloads once), the pinned packages with torch T
# and transformers F, then
#   python -m pip install 'setuptools>=70.1' && python -m pip install --no-build-isolation ./python
# from a clone of HEAD (the table names the commit; a dirty tree is refused), then pytest on SUITES
# with COLLIDER_TEST_INSTALLED=1 (the installed package, not a build tree). The guard column imports
# the package built in the previous row under this row's torch and expects the ImportError that
# names both releases. The table is rewritten after every row, so a run that dies keeps the rows it
# finished. Logs: $COLLIDER_COMPAT_DIR/logs (kept, not committed). A row's environment (about
# 6 GB) is removed after the row unless COLLIDER_COMPAT_KEEP=1.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

# torch:transformers. Every supported torch with the default transformers (the newest release), then
# the oldest pair docs/PYTHON.md claims: the oldest torch with the oldest transformers.
ROWS="2.11.0:5.25.0 2.12.1:5.25.0 2.13.0:5.25.0 2.14.1:5.25.0 2.15.0:5.25.0 2.11.0:5.23.0"
# The rest of the environment, as scripts/bootstrap.sh pins it.
PINS=(peft==0.21.2 accelerate==1.16.0 trl==1.16.0 datasets==5.2.0 pandas==3.1.1 pyarrow==26.0.1
      pytest==9.2.0 pytest-xdist==3.8.0 execnet==2.1.2 expecttest==0.3.0 numpy==2.4.6)
# The Python gradient suites: transformers families, encoder-decoders, checkpointing, masks, mixtures of
# experts, the fused head, refusals and their messages, unseen ops, TRL, Trainer, the import guard and the API. Not here
# (scripts/test.sh runs them on the default environment): the zoo (every architecture), the row
# rules' OpInfo property test, the first-use check, DDP/FSDP2, the benchmark's and example's tests.
SUITES=(test_api.py test_torch_guard.py test_hf_gradients.py test_architectures.py test_checkpointing.py
        test_masks.py test_moe.py test_messages.py test_unseen_ops.py test_trl.py test_hf_trainer.py test_head.py
        test_encoder_decoder.py)
OUT=$ROOT/docs/COMPATIBILITY.md
WORK=${COLLIDER_COMPAT_DIR:-$HOME/.cache/collider/compat}
INSTALL_ONLY=0
while (($#)); do
  case $1 in
    --rows) ROWS=$2; shift 2 ;;
    --out) OUT=$(realpath -m "$2"); shift 2 ;;
    --install-only) INSTALL_ONLY=1; shift ;;
    *) echo "usage: $0 [--rows \"T:F ...\"] [--out FILE] [--install-only]" >&2; exit 2 ;;
  esac
done
say() { echo "[compat $(date +%H:%M:%S)] $*"; }

# install_env NAME TORCH TRANSFORMERS: the row's environment, made afresh unless a complete one with
# exactly these pins is there (its stamp, written after pip succeeded): .ci/run makes it with
# --install-only while the main build compiles, since the download needs the network, not the cores.
install_env() {
  local name=$1 env=$WORK/$1 stamp
  stamp="torch==$2 transformers==$3 ${PINS[*]}"
  if [[ "$(cat "$env/.collider_pins" 2>/dev/null)" == "$stamp" && -x "$env/bin/python" ]]; then
    say "$name: environment ready (made earlier with these pins)"
    return 0
  fi
  say "$name: environment"
  python3 -m venv --clear "$env" &&
    (cd /tmp && "$env/bin/python" -m pip install -q "torch==$2" "transformers==$3" "${PINS[@]}") >"$WORK/logs/$name.pip" 2>&1 &&
    echo "$stamp" >"$env/.collider_pins"
}
if ((INSTALL_ONLY)); then
  mkdir -p "$WORK/logs"
  for row in $ROWS; do
    install_env "torch${row%%:*}-tf${row##*:}" "${row%%:*}" "${row##*:}" ||
      { say "torch${row%%:*}-tf${row##*:}: pip failed ($WORK/logs)"; exit 1; }
  done
  exit 0
fi

if [[ -n "$(git status --porcelain --untracked-files=no)" ]]; then
  echo "compat_matrix: the work tree has uncommitted changes; commit them first (the table names a commit)" >&2
  exit 2
fi
COMMIT=$(git rev-parse --short HEAD)
mkdir -p "$WORK/logs"
SRC=$WORK/src
rm -rf "$SRC" "$WORK/pkg-prev"
git clone -q --no-hardlinks "$ROOT" "$SRC"
git -C "$SRC" checkout -q "$COMMIT"
export CCACHE_BASEDIR=$SRC
# The torch precompiled header (cmake/ColliderPch.cmake): ccache caches nothing beside it without these.
export CCACHE_SLOPPINESS="pch_defines,time_macros${CCACHE_SLOPPINESS:+,$CCACHE_SLOPPINESS}"
export COLLIDER_JOBS=${COLLIDER_JOBS:-$(env -u OMP_NUM_THREADS nproc)}
STARTED=$(date -u +"%Y-%m-%d %H:%M UTC")

rows_md=()
skips_md=()
write_table() {
  {
    echo "# Compatibility: the torch and transformers releases Collider is tested with"
    echo
    echo "Generated by \`./scripts/compat_matrix.sh\` (do not edit by hand): started $STARTED, commit $COMMIT,"
    echo "$(uname -m), $(nproc) cores, $(python3 --version), CPU only. Each row is a fresh environment"
    echo "(\`python3 -m venv\`) with torch and transformers as given, the other packages as"
    echo "\`scripts/bootstrap.sh\` pins them, the package installed as docs/PYTHON.md says"
    echo "(\`pip install 'setuptools>=70.1'\`, then \`pip install --no-build-isolation ./python\`), and"
    echo "the Python gradient suites run on the installed package:"
    echo "$(printf '`%s` ' "${SUITES[@]}")."
    echo "Guard: the package built in the row above, imported under this row's torch (the ImportError"
    echo "that names both releases is expected). Times in seconds, on a machine shared with other work."
    echo
    echo "Supported: torch 2.11.0 to 2.15.x (\`python/pyproject.toml\`, \`cmake/ColliderTorch.cmake\`);"
    echo "what differs between them is in \`collider_core/include/collider/torch_compat.h\`."
    echo
    echo "| torch | transformers | peft / trl / accelerate | build | build s | tests | tests s | guard |"
    echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
    printf '%s\n' "${rows_md[@]}"
    echo
    if ((${#rows_md[@]} < $(wc -w <<<"$ROWS"))); then
      echo "Rows not reached yet (the run was stopped, or is still going): $(echo "$ROWS" | cut -d' ' -f$((${#rows_md[@]} + 1))-)."
      echo
    fi
    echo "Skipped tests, with pytest's reason:"
    echo
    if ((${#skips_md[@]})); then printf '%s\n' "${skips_md[@]}"; else echo "- none"; fi
  } >"$OUT"
}

prev_torch=""
failed=0
for row in $ROWS; do
  torch_v=${row%%:*}
  tf_v=${row##*:}
  name=torch$torch_v-tf$tf_v
  env=$WORK/$name
  log=$WORK/logs/$name
  PY=$env/bin/python
  status_install=ok
  install_env "$name" "$torch_v" "$tf_v" || status_install="pip failed (logs/$name.pip)"
  t1=$(date +%s)
  build=failed
  if [[ $status_install == ok ]]; then
    say "$name: pip install --no-build-isolation ./python"
    if (cd "$SRC" && "$PY" -m pip install -q 'setuptools>=70.1' &&
        "$PY" -m pip install --no-build-isolation ./python) >"$log.build" 2>&1; then
      build=ok
    fi
  fi
  t2=$(date +%s)
  guard="-"
  if [[ $build == ok && -n $prev_torch ]]; then
    # The previous row's package (built for its torch) imported under this row's torch.
    msg=$(cd /tmp && PYTHONPATH=$WORK/pkg-prev "$PY" -c "import collider" 2>&1 | tail -1 || true)
    if [[ $prev_torch == "$torch_v" ]]; then
      guard="same torch"
    elif [[ $msg == "ImportError: collider was built against torch $prev_torch"* ]]; then
      guard="refuses $prev_torch"
    else
      guard="NOT REFUSED: $msg"
    fi
  fi
  tests="not run"
  if [[ $build == ok ]]; then
    say "$name: pytest (${#SUITES[@]} modules)"
    rc=0
    (cd "$SRC" && OMP_NUM_THREADS=1 COLLIDER_TEST_INSTALLED=1 "$PY" -m pytest -q -p no:cacheprovider -rs -n "$COLLIDER_JOBS" \
       --junitxml="$log.xml" "${SUITES[@]/#/python/tests/}") >"$log.pytest" 2>&1 || rc=$?
    tests=$("$PY" - "$log.xml" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
s = ET.parse(sys.argv[1]).getroot()
s = s if s.tag == "testsuite" else s.find("testsuite")
n, f, e, k = (int(s.get(a, 0)) for a in ("tests", "failures", "errors", "skipped"))
print(f"{n - f - e - k} passed, {f + e} failed, {k} skipped")
PYEOF
) || tests="pytest exit $rc, no report (logs/$name.pytest)"
    # Each skipped test with its reason (pytest -rs), for the table's notes.
    while IFS= read -r line; do skips_md+=("- $name: ${line#SKIPPED }"); done < <(grep '^SKIPPED' "$log.pytest" || true)
  fi
  t3=$(date +%s)
  versions=$(cd /tmp && "$PY" -c "from importlib.metadata import version as v; print(' / '.join(v(p) for p in ('peft','trl','accelerate')))" 2>/dev/null || echo "?")
  rows_md+=("| $torch_v | $tf_v | $versions | ${status_install/ok/$build} | $((t2 - t1)) | $tests | $((t3 - t2)) | $guard |")
  [[ $build == ok && $tests == *" 0 failed"* && $guard != NOT* ]] || failed=$((failed + 1))
  say "$name: install ${status_install}, build $build ($((t2 - t1)) s), tests: $tests ($((t3 - t2)) s), guard: $guard"
  # The package this row built, for the next row's guard check; then the environment goes.
  rm -rf "$WORK/pkg-prev"
  mkdir -p "$WORK/pkg-prev"
  prev_torch=""
  pkg=$(cd /tmp && "$PY" -c 'import collider, os; print(os.path.dirname(collider.__file__))' 2>/dev/null || true)
  if [[ -n $pkg ]]; then cp -rL "$pkg" "$WORK/pkg-prev/" && prev_torch=$torch_v; fi
  [[ ${COLLIDER_COMPAT_KEEP:-0} == 1 ]] || rm -rf "$env"
  write_table
done
say "wrote $OUT"
if ((failed)); then say "FAILED: $failed of the rows (logs in $WORK/logs)"; exit 1; fi
