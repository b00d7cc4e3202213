#!/usr/bin/env bash
# Sets up a fresh machine and builds Collider into build/ (the CLI is build/collider), including
# the Python package `collider` (build/python), which it then installs into the Python
# environment so that `$COLLIDER_VENV/bin/python -c "import collider"` works from any directory.
# Idempotent: on a machine where everything is present it only (re)builds.
#   ./scripts/bootstrap.sh            # install what is missing, configure, build
#   ./scripts/bootstrap.sh --deps-only   # only steps 1-3: Debian packages, Python env, report
#                                        # (scripts/test.sh --asan, which builds build-asan/ instead)
# Environment:
#   COLLIDER_VENV   Python environment with torch (default ~/.cache/collider/venv; kept outside
#                   the clone so a fresh clone reuses it instead of downloading several GB)
#   COLLIDER_PRESET CMake preset (default: cuda when nvcc is on PATH, so the CUDA sources are
#                   compiled even without a GPU; else cpu)
#   COLLIDER_JOBS   build parallelism (default: number of cores)
#   COLLIDER_NO_APT=1  skip apt-get (machines without network, e.g. the GPU machine)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
# The default torch: the newest release; every release from 2.11.0 on builds and passes
# (docs/COMPATIBILITY.md, scripts/compat_matrix.sh). With COLLIDER_PYTHON (an environment of your
# own, e.g. the GPU machine's python3) the torch found there is used as it is; CMake refuses one
# outside the supported range.
TORCH_PIN_VERSION=2.15.0
TORCH_PIN="torch==$TORCH_PIN_VERSION"
# Every Python package is pinned, so a fresh machine gets the environment the results came from.
NUMPY_PIN="numpy==2.4.6"
MATPLOTLIB_PIN="matplotlib==3.11.2"
SENTENCEPIECE_PIN="sentencepiece==0.2.3"
VENV=${COLLIDER_VENV:-$HOME/.cache/collider/venv}
if command -v nvcc >/dev/null; then DEFAULT_PRESET=cuda; else DEFAULT_PRESET=cpu; fi
PRESET=${COLLIDER_PRESET:-$DEFAULT_PRESET}
# nproc honours OMP_NUM_THREADS, which scripts/test.sh sets to 1 for the tests: the cores, without it.
JOBS=${COLLIDER_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
DEPS_ONLY=0
case ${1:-} in
  --deps-only) DEPS_ONLY=1 ;;
  "") ;;
  *) echo "usage: $0 [--deps-only]" >&2; exit 2 ;;
esac

say() { echo "[bootstrap] $*"; }

# 1. Debian packages the build needs.
# clang + libclang-rt-14-dev: libFuzzer and the sanitizer runtimes of scripts/fuzz.sh.
APT_PKGS=(g++ cmake ninja-build python3-venv python3-dev libtomlplusplus-dev nlohmann-json3-dev
          libgtest-dev libgmock-dev libbenchmark-dev ccache libgloo-dev
          libsentencepiece-dev clang libclang-rt-14-dev)
missing=()
for p in "${APT_PKGS[@]}"; do
  # grep -q on a here-string, not a pipe: under pipefail a grep -q that exits at the first match
  # can fail the pipeline with the writer's SIGPIPE.
  grep -q "install ok installed" <<<"$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ "${COLLIDER_NO_APT:-0}" == 1 ]] || ! command -v apt-get >/dev/null; then
    say "missing Debian packages: ${missing[*]} (apt-get not used; the configure step says what breaks)"
  else
    say "installing Debian packages: ${missing[*]}"
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
else
  say "Debian packages: all present"
fi

# 2. Python environment with torch (libtorch comes from the wheel) and matplotlib.
PY=${COLLIDER_PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating Python environment at $VENV"
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV"
  fi
  PY="$VENV/bin/python"
fi
torch_release() { (cd /tmp && "$PY" -c "import torch;print(torch.__version__.split('+')[0])" 2>/dev/null) || true; }
if ! (cd /tmp && "$PY" -c "import torch, matplotlib, numpy" 2>/dev/null) ||
   [[ -z "${COLLIDER_PYTHON:-}" && "$(torch_release)" != "$TORCH_PIN_VERSION" ]]; then
  say "installing $TORCH_PIN, $NUMPY_PIN, $MATPLOTLIB_PIN into $("$PY" -c 'import sys;print(sys.prefix)')"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "$TORCH_PIN" "$NUMPY_PIN" "$MATPLOTLIB_PIN"
fi
# sentencepiece trains the tokenizer of the utility data (scripts/prepare_data.sh); optional for
# everything else, so a machine without network (the GPU machine) goes on without it.
if ! "$PY" -c "import sentencepiece" 2>/dev/null; then
  say "installing $SENTENCEPIECE_PIN (tokenizer training for scripts/prepare_data.sh)"
  "$PY" -m pip install -q "$SENTENCEPIECE_PIN" || say "warning: pip install sentencepiece failed; scripts/prepare_data.sh will not run"
fi
# The Python package's dependencies and test tools, exact versions (transformers' Trainer needs
# accelerate; setuptools >= 70.1 builds wheels without the separate `wheel` package, which
# `pip install --no-build-isolation ./python` below needs; trl and its datasets, pandas and pyarrow
# for the tests of TRL's SFTTrainer; expecttest, which torch's own OpInfo sample inputs import, for the
# row-rule property test; pytest-xdist and its execnet, which run the Python tests on every core).
# torch is repeated so pip never moves it.
PY_PINS=(transformers==5.25.0 peft==0.21.2 accelerate==1.16.0 trl==1.16.0 datasets==5.2.0 pandas==3.1.1
         pyarrow==26.0.1 pytest==9.2.0 pytest-xdist==3.8.0 execnet==2.1.2 setuptools==80.9.0 expecttest==0.3.0
         "$NUMPY_PIN" "$MATPLOTLIB_PIN")
if ! (cd /tmp && "$PY" - "${PY_PINS[@]}" <<'PYEOF'
import sys
from importlib.metadata import version, PackageNotFoundError
try:
    sys.exit(0 if all(version(n) == v for n, v in (p.split("==") for p in sys.argv[1:])) else 1)
except PackageNotFoundError:
    sys.exit(1)
PYEOF
); then
  say "installing ${PY_PINS[*]}"
  "$PY" -m pip install -q "${PY_PINS[@]}" "$TORCH_PIN" ||
    say "warning: pip install ${PY_PINS[*]} failed; the Python tests (python/tests) will not run"
fi
TORCH_VERSION=$(cd /tmp && "$PY" -c "import torch;print(torch.__version__)")
TORCH_PREFIX=$(cd /tmp && "$PY" -c "import torch;print(torch.utils.cmake_prefix_path)")
say "torch $TORCH_VERSION ($TORCH_PREFIX)"
[[ "$TORCH_VERSION" == "$TORCH_PIN_VERSION"* ]] ||
  say "torch $TORCH_VERSION is not the default $TORCH_PIN_VERSION (supported: 2.11.0 to 2.15.x, docs/COMPATIBILITY.md)"

# 3. Optional components, one line each.
if command -v nvcc >/dev/null; then
  say "optional CUDA toolkit: $(nvcc --version | tail -1); preset $PRESET ($([[ $PRESET == cuda ]] && echo "CUDA sources compiled" || echo "CUDA sources not compiled"))"
else
  say "optional CUDA toolkit: not found; preset $PRESET (CUDA sources not compiled)"
fi
if [[ -f /usr/local/cuda/include/nvtx3/nvToolsExt.h ]]; then say "optional NVTX3 headers: found"; else say "optional NVTX3 headers: not found"; fi
LAUNCHER=()
if command -v ccache >/dev/null; then
  say "optional ccache: $(command -v ccache)"
  LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  export CCACHE_BASEDIR="$ROOT"  # relative paths in the cache key: a fresh clone reuses the cache
  # Every target compiles with the torch precompiled header (cmake/ColliderDeps.cmake); without
  # this sloppiness ccache refuses each such call ("could not use precompiled header") and caches
  # nothing. It still hashes the .gch itself, so a changed header is a miss, not a stale object.
  export CCACHE_SLOPPINESS="pch_defines,time_macros${CCACHE_SLOPPINESS:+,$CCACHE_SLOPPINESS}"
else
  say "optional ccache: not found"
fi

if ((DEPS_ONLY)); then
  say "--deps-only: not configuring or building build/"
  exit 0
fi

# 4. Configure and build. A build tree configured for another torch is configured afresh: CMake's
# cache would keep what it found for that one.
start=$(date +%s)
if [[ -f build/CMakeCache.txt && "$(cat build/torch_version 2>/dev/null)" != "$TORCH_VERSION" ]]; then
  say "build/ was configured for torch $(cat build/torch_version 2>/dev/null || echo '(unknown)'); configuring it for $TORCH_VERSION"
  rm -rf build/CMakeCache.txt build/CMakeFiles
fi
cmake --preset "$PRESET" -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DPython3_EXECUTABLE="$PY" \
  "${LAUNCHER[@]}" -Wno-dev >build.configure.log 2>&1 || { cat build.configure.log; exit 1; }
grep "collider:" build.configure.log | sed 's/^-- /[bootstrap] /' || true
rm -f build.configure.log
cmake --build build -j "$JOBS"
say "built in $(( $(date +%s) - start )) s: $ROOT/build/collider"
echo "$PY" > build/python_path
echo "$TORCH_VERSION" > build/torch_version

# 5. Install the Python package into the environment: the _C and _measure modules this build made
# are copied (COLLIDER_PREBUILT_EXT), so collider_core is not compiled a second time. Skipped when nothing
# changed since the last install from this checkout (stamp: hash of the module and the .py files).
EXT=$(ls build/python/collider/_C*.so 2>/dev/null | head -1)
if [[ -n "$EXT" ]]; then
  STAMP=$( (echo "$PY"; sha256sum "$EXT" build/python/collider/_measure*.so build/python/collider/_torch_build.py python/collider/*.py python/collider/py.typed python/setup.py python/pyproject.toml) | sha256sum | cut -c1-16)
  SITE=$(cd /tmp && "$PY" -c "import sysconfig;print(sysconfig.get_paths()['purelib'])")
  if [[ "$(cat "$SITE/collider/.bootstrap_stamp" 2>/dev/null)" != "$STAMP" ]]; then
    COLLIDER_PREBUILT_EXT="$ROOT/$EXT" "$PY" -m pip install -q --no-build-isolation --no-deps --force-reinstall ./python \
      >build/python_install.log 2>&1 || { cat build/python_install.log; say "pip install ./python failed"; exit 1; }
    rm -rf python/build python/collider.egg-info
    echo "$STAMP" > "$SITE/collider/.bootstrap_stamp"
    say "installed the collider Python package into $SITE"
  else
    say "collider Python package: installed and up to date ($SITE)"
  fi
else
  say "optional Python package: not built (no Python headers: apt-get install python3-dev)"
fi
