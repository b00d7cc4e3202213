#!/usr/bin/env bash
# Sets up a fresh machine and builds Collider into build/ (the CLI is build/collider).
# Idempotent: on a machine where everything is present it only (re)builds.
#   ./scripts/bootstrap.sh            # install what is missing, configure, build
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
TORCH_PIN="torch==2.11.0"
VENV=${COLLIDER_VENV:-$HOME/.cache/collider/venv}
if command -v nvcc >/dev/null; then DEFAULT_PRESET=cuda; else DEFAULT_PRESET=cpu; fi
PRESET=${COLLIDER_PRESET:-$DEFAULT_PRESET}
JOBS=${COLLIDER_JOBS:-$(nproc)}

say() { echo "[bootstrap] $*"; }

# 1. Debian packages the build needs.
# clang + libclang-rt-14-dev: libFuzzer and the sanitizer runtimes of scripts/fuzz.sh.
APT_PKGS=(g++ cmake ninja-build python3-venv libtomlplusplus-dev nlohmann-json3-dev
          libgtest-dev libgmock-dev libbenchmark-dev ccache libgloo-dev
          libsentencepiece-dev clang libclang-rt-14-dev)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
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
if ! "$PY" -c "import torch, matplotlib, numpy" 2>/dev/null; then
  say "installing $TORCH_PIN, numpy, matplotlib into $("$PY" -c 'import sys;print(sys.prefix)')"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "$TORCH_PIN" numpy matplotlib
fi
# sentencepiece trains the tokenizer of the utility data (scripts/prepare_data.sh); optional for
# everything else, so a machine without network (the GPU machine) goes on without it.
if ! "$PY" -c "import sentencepiece" 2>/dev/null; then
  say "installing sentencepiece (tokenizer training for scripts/prepare_data.sh)"
  "$PY" -m pip install -q sentencepiece || say "warning: pip install sentencepiece failed; scripts/prepare_data.sh will not run"
fi
TORCH_VERSION=$(cd /tmp && "$PY" -c "import torch;print(torch.__version__)")
TORCH_PREFIX=$(cd /tmp && "$PY" -c "import torch;print(torch.utils.cmake_prefix_path)")
say "torch $TORCH_VERSION ($TORCH_PREFIX)"
[[ "$TORCH_VERSION" == 2.11.0* ]] || say "warning: expected torch 2.11.0, found $TORCH_VERSION"

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
else
  say "optional ccache: not found"
fi

# 4. Configure and build.
start=$(date +%s)
cmake --preset "$PRESET" -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DPython3_EXECUTABLE="$PY" \
  "${LAUNCHER[@]}" -Wno-dev >build.configure.log 2>&1 || { cat build.configure.log; exit 1; }
grep "collider:" build.configure.log | sed 's/^-- /[bootstrap] /' || true
rm -f build.configure.log
cmake --build build -j "$JOBS"
say "built in $(( $(date +%s) - start )) s: $ROOT/build/collider"
echo "$PY" > build/python_path
