#!/usr/bin/env bash
# Downloads (apt-get download; nothing is installed) the Debian packages that the build needs and
# that the GPU machine lacks, into .debs/ at the repository root, so that they can travel with the
# working tree to a machine without network and be unpacked there by scripts/device/lib.sh (for
# run_gpu_checks.sh and run_paper_scale.sh: dpkg -x into out/device-deps/, never into /).
#   ./scripts/device/fetch_debs.sh            # run on a Debian/Ubuntu machine with apt and network
# Packages: toml++ (headers + shared library), nlohmann-json, GoogleTest/GoogleMock (static),
# Google Benchmark (+ its shared library), gloo headers, SentencePiece (headers + library): ~1.8 MB
# in all; the device tool carries at most 64 MB. Run by the CPU rehearsal (scripts/device/rehearse.sh)
# on a clean clone.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
DEST="$ROOT/.debs"
PKGS=(libtomlplusplus-dev libtomlplusplus3 nlohmann-json3-dev libgtest-dev libgmock-dev
      libbenchmark-dev libbenchmark1debian libgloo-dev libsentencepiece-dev libsentencepiece0)
# libgloo-dev: headers only (libtorch's ProcessGroupGloo.hpp includes them; libtorch has its own gloo code).
# libsentencepiece-dev + libsentencepiece0: the tokenizer (harness/components/token_data.h); without them the
# build still works but harness::Tokenizer throws.
# libgtest-dev depends on `googletest` (sources only, /usr/src); the build does not need it.

say() { echo "[fetch_debs] $*"; }

command -v apt-get >/dev/null || { say "error: apt-get not found; run this on a Debian/Ubuntu machine"; exit 1; }
mkdir -p "$DEST"
# apt-get download writes into the current directory and must be able to read the package lists.
if ! apt-cache show "${PKGS[0]}" >/dev/null 2>&1; then
  say "package lists lack ${PKGS[0]}; running apt-get update"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  $SUDO apt-get update -qq
fi
rm -f "$DEST"/*.deb
(cd "$DEST" && apt-get download -q "${PKGS[@]}")
# The device machine is x86-64: warn when these are not amd64 packages.
for f in "$DEST"/*.deb; do
  arch=$(dpkg-deb -f "$f" Architecture)
  [[ "$arch" == amd64 || "$arch" == all ]] || say "warning: $(basename "$f") is $arch, the GPU machine needs amd64"
done
count=$(find "$DEST" -maxdepth 1 -name "*.deb" | wc -l)
[[ "$count" -eq ${#PKGS[@]} ]] || { say "error: expected ${#PKGS[@]} .deb files in $DEST, found $count"; exit 1; }
size_kb=$(du -sk "$DEST" | cut -f1)
say "$count packages, ${size_kb} KB in $DEST:"
ls -1 "$DEST"
if ((size_kb > 20480)); then say "error: $DEST is over 20 MB"; exit 1; fi
