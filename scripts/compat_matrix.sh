#!/usr/bin/env bash
# The compatibility matrix: for each supported torch (and the transformers releases the README
# claims), a fresh Python environment, the package installed the way the README says, and the
# Python gradient suites run against it; writes the table to docs/COMPATIBILITY.md (or --out).
#   ./scripts/compat_matrix.sh                       # every row of ROWS below (about 75 minutes on 2 cores)
#   ./scripts/compat_matrix.sh --rows "2.11.0:5.25.0"   # some rows only (torch:transformers)
#   ./scripts/compat_matrix.sh --out /tmp/compat.md
# Exit status 1 when a row fails (install, build, a test, or a guard that lets a foreign build in).
# A row: `python3 -m venv --clear` at ~/.cache/collider/compat/torch<T>-tf<F> (pip's cache makes
# the downloads once), the pinned packages with torch T and transformers F, then
#   python -m pip install 'setuptools>=70.1' && python -m pip install --no-build-isolation ./python
# from a clone of HEAD (the table names the commit; a dirty tree is refused), then pytest on SUITES
# with COLLIDER_TEST_INSTALLED=1 (the installed package, not a build tree). The guard column imports
# the package built in the previous row's environment under this row's torch and expects the
# ImportError that names both releases. Logs: $COLLIDER_COMPAT_DIR/logs (kept, not committed).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

# torch:transformers. Every supported torch with the default transformers, and the oldest
# transformers the README claims (5.23.0, the default until torch 2.15) on the newest torch.
ROWS="2.11.0:5.25.0 2.12.1:5.25.0 2.13.0:5.25.0 2.14.1:5.25.0 2.15.0:5.25.0 2.15.0:5.23.0"
# The rest of the environment, as scripts/bootstrap.sh pins it.
PINS=(peft==0.21.2 accelerate==1.16.0 trl==1.16.0 datasets==5.2.0 pandas==3.1.1 pyarrow==26.0.1
      pytest==9.2.0 expecttest==0.3.0 numpy==2.4.6)
# The Python gradient suites: transformers families, checkpointing, masks, mixtures of experts,
# refusals and their messages, TRL, Trainer, the first-use check, unseen ops, the row rules, the
# import guard and the API. Not here: the zoo (every architecture; scripts/test.sh runs it on the
# default environment), DDP/FSDP2 and the benchmark's and example's tests.
SUITES=(test_api.py test_torch_guard.py test_hf_gradients.py test_architectures.py test_checkpointing.py
        test_trainers_checkpointing.py test_masks.py test_moe.py test_messages.py test_normalisation.py
        test_trl.py test_hf_trainer.py test_check.py test_unseen_ops.py test_row_rules.py)
OUT=$ROOT/docs/COMPATIBILITY.md
WORK=${COLLIDER_COMPAT_DIR:-$HOME/.cache/collider/compat}
while (($#)); do
  case $1 in
    --rows) ROWS=$2; shift 2 ;;
    --out) OUT=$(realpath -m "$2"); shift 2 ;;
    *) echo "usage: $0 [--rows \"T:F ...\"] [--out FILE]" >&2; exit 2 ;;
  esac
done
say() { echo "[compat $(date +%H:%M:%S)] $*"; }

if [[ -n "$(git status --porcelain --untracked-files=no)" ]]; then
  echo "compat_matrix: the work tree has uncommitted changes; commit them first (the table names a commit)" >&2
  exit 2
fi
COMMIT=$(git rev-parse --short HEAD)
mkdir -p "$WORK/logs"
SRC=$WORK/src
rm -rf "$SRC"
git clone -q --no-hardlinks "$ROOT" "$SRC"
git -C "$SRC" checkout -q "$COMMIT"
export CCACHE_BASEDIR=$SRC
export COLLIDER_JOBS=${COLLIDER_JOBS:-$(env -u OMP_NUM_THREADS nproc)}
STARTED=$(date -u +"%Y-%m-%d %H:%M UTC")

rows_md=()
skips_md=()
prev_env=""
prev_torch=""
failed=0
for row in $ROWS; do
  torch_v=${row%%:*}
  tf_v=${row##*:}
  name=torch$torch_v-tf$tf_v
  env=$WORK/$name
  log=$WORK/logs/$name
  say "$name: environment"
  t0=$(date +%s)
  python3 -m venv --clear "$env"
  PY=$env/bin/python
  status_install=ok
  (cd /tmp && "$PY" -m pip install -q "torch==$torch_v" "transformers==$tf_v" "${PINS[@]}") >"$log.pip" 2>&1 ||
    status_install="pip failed (logs/$name.pip)"
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
  if [[ $build == ok && -n $prev_env ]]; then
    # The previous row's package (built for its torch) imported under this row's torch.
    copy=$(mktemp -d)
    cp -rL "$("$prev_env/bin/python" -c 'import collider, os; print(os.path.dirname(collider.__file__))' 2>/dev/null)" "$copy/" 2>/dev/null || true
    msg=$(cd /tmp && PYTHONPATH=$copy "$PY" -c "import collider" 2>&1 | tail -1 || true)
    rm -rf "$copy"
    if [[ ${prev_torch} == "$torch_v" ]]; then
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
    (cd "$SRC" && OMP_NUM_THREADS=1 COLLIDER_TEST_INSTALLED=1 "$PY" -m pytest -q -p no:cacheprovider -rs \
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
  prev_env=$env
  prev_torch=$torch_v
done

{
  echo "# Compatibility: the torch and transformers releases Collider is tested with"
  echo
  echo "Generated by \`./scripts/compat_matrix.sh\` (do not edit by hand): started $STARTED, commit $COMMIT,"
  echo "$(uname -m), $(nproc) cores, $(python3 --version), CPU only. Each row is a fresh environment"
  echo "(\`python3 -m venv\`) with torch and transformers as given, the other packages as"
  echo "\`scripts/bootstrap.sh\` pins them, the package installed as the README says"
  echo "(\`pip install 'setuptools>=70.1'\`, then \`pip install --no-build-isolation ./python\`), and"
  echo "the Python gradient suites run on the installed package:"
  echo "$(printf '`%s` ' "${SUITES[@]}")."
  echo "Guard: the package built in the row above, imported under this row's torch (the ImportError"
  echo "that names both releases is expected)."
  echo
  echo "Supported: torch 2.11.0 to 2.15.x (\`python/pyproject.toml\`, \`cmake/ColliderTorchRange.cmake\`);"
  echo "what differs between them is in \`collider_core/include/collider/torch_compat.h\`."
  echo
  echo "| torch | transformers | peft / trl / accelerate | build | build s | tests | tests s | guard |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
  printf '%s\n' "${rows_md[@]}"
  echo
  echo "Skipped tests, with pytest's reason:"
  echo
  if ((${#skips_md[@]})); then printf '%s\n' "${skips_md[@]}"; else echo "- none"; fi
} >"$OUT"
say "wrote $OUT"
if ((failed)); then say "FAILED: $failed of the rows (logs in $WORK/logs)"; exit 1; fi
