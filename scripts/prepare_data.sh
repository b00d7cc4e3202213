#!/usr/bin/env bash
# Prepares the real-text data of the utility experiment: downloads Debian packages
# (apt-get download; no root install), extracts their text, splits it into curated / mixture
# train and eval sets, trains the SentencePiece tokenizer and writes the token shards.
# Idempotent: a complete output directory (meta.json present) is left as it is.
#   ./scripts/prepare_data.sh                       # -> ${COLLIDER_DATA:-~/.cache/collider/data}
#   ./scripts/prepare_data.sh --out DIR --sample    # small sample (tests/test_prepare_data.cpp)
# What the data is: scripts/prepare_data.py (header) and experiments/METHODOLOGY.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${COLLIDER_PYTHON:-${COLLIDER_VENV:-$HOME/.cache/collider/venv}/bin/python}
OUT=${COLLIDER_DATA:-$HOME/.cache/collider/data}
args=()
while (($#)); do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
if ! "$PY" -c "import sentencepiece, numpy" 2>/dev/null; then
  echo "[prepare_data] $PY lacks sentencepiece or numpy; run ./scripts/bootstrap.sh (it installs them)" >&2
  exit 2
fi
# Debian packages are cached beside the data (DIR/debs) unless COLLIDER_DEBS names a directory.
exec "$PY" scripts/prepare_data.py --out "$OUT" --debs "${COLLIDER_DEBS:-$HOME/.cache/collider/debs}" "${args[@]}"
