# Sourced (not run) by scripts/fuzz.sh and by scripts/test.sh --asan, the two clang builds
# (build-fuzz/, build-asan/): the Python env's interpreter, libtorch's CMake prefix from it, and
# ccache as the compiler launcher when it is installed. Sets PY, TORCH_PREFIX and LAUNCHER (an
# array of CMake arguments); expects ROOT, the checkout's root.
PY=${COLLIDER_PYTHON:-${COLLIDER_VENV:-$HOME/.cache/collider/venv}/bin/python}
TORCH_PREFIX=$(cd /tmp && "$PY" -c "import torch;print(torch.utils.cmake_prefix_path)")
LAUNCHER=()
if command -v ccache >/dev/null; then
  LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
  export CCACHE_BASEDIR="$ROOT"
  # As in bootstrap.sh: every target compiles with the torch precompiled header, and without this
  # sloppiness ccache refuses each such call and caches nothing.
  export CCACHE_SLOPPINESS="pch_defines,time_macros${CCACHE_SLOPPINESS:+,$CCACHE_SLOPPINESS}"
fi
