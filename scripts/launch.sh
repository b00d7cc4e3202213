#!/usr/bin/env bash
# Starts N local ranks of `build/collider run MANIFEST [args]` (data parallelism on c10d, Gloo on
# CPU / NCCL on CUDA), as torchrun would: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1 and
# a free MASTER_PORT per rank; every output line is prefixed with "[rank R]". When one rank fails,
# the others are stopped and the script exits with that rank's status; 0 only when all succeed.
#   ./scripts/launch.sh 2 experiments/dist_cpu.toml --out /tmp/dist --set run.measure_steps=3
# Environment: COLLIDER_BIN (default build/collider), OMP_NUM_THREADS (default: cores / N, at
# least 1), COLLIDER_DIST_TIMEOUT_S (bound on every collective, default 300), MASTER_PORT (fixed port).
set -uo pipefail
if (($# < 2)) || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: scripts/launch.sh N MANIFEST.toml [collider run options]   (N ranks on this machine)" >&2
  exit 2
fi
N=$1
shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${COLLIDER_BIN:-$ROOT/build/collider}
[[ -x "$BIN" ]] || { echo "launch.sh: $BIN not found; build it first (./scripts/bootstrap.sh)" >&2; exit 2; }

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
PORT=${MASTER_PORT:-$(free_port)}
THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / N > 0 ? $(nproc) / N : 1 ))}
echo "launch.sh: $N ranks on 127.0.0.1:$PORT, OMP_NUM_THREADS=$THREADS: $BIN run $*" >&2

pids=()
for ((r = 0; r < N; r++)); do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=$N MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT OMP_NUM_THREADS=$THREADS \
    "$BIN" run "$@" > >(sed -u "s/^/[rank $r] /") 2> >(sed -u "s/^/[rank $r] /" >&2) &
  pids+=($!)
done

stop_all() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
}
trap 'stop_all; exit 130' INT TERM

# Poll (not `wait -n`: it loses jobs that end while others are being stopped); `wait PID` gives
# a finished rank's status.
status=0
live=("${pids[@]}")
while ((${#live[@]} > 0)); do
  rest=()
  for p in "${live[@]}"; do
    if kill -0 "$p" 2>/dev/null; then rest+=("$p"); continue; fi
    wait "$p"
    rc=$?
    if ((rc != 0 && status == 0)); then
      rank=-1
      for ((r = 0; r < N; r++)); do [[ "${pids[$r]}" == "$p" ]] && rank=$r; done
      echo "launch.sh: rank $rank exited with status $rc; stopping the other ranks" >&2
      status=$rc
      stop_all
    fi
  done
  live=("${rest[@]}")
  ((${#live[@]} > 0)) && sleep 0.2
done
wait 2>/dev/null  # let the output prefixes drain
exit $status
