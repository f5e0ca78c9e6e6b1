#!/usr/bin/env bash
# The whole accelerator check for kvjax, in under 5 minutes. Run it from any
# directory whenever a GPU or TPU is available:
#
#   bash experiments/device_check.sh [WORKDIR]      # default /tmp/kvjax_device_check
#
# Steps (each logged with its wall time; the first failure stops the script
# with a non-zero exit code):
#   devices    what JAX sees; fails without an accelerator unless ALLOW_CPU=1.
#   tests      on the accelerator: cached decode == no-cache forward, prefill
#              == forward, ragged batches == single sequences, jax_nn / cudnn
#              attention == einsum (the cudnn test compares on a GPU), samplers
#              and stop tokens, both MLA decode paths.
#   sharding   the 8-device mesh checks (tests/test_sharding.py; its
#              subprocess simulates 8 CPU devices, so it runs on the host CPU
#              next to the GPU tests).
#   benchmark  experiments/benchmark.py unchanged, on the accelerator: decode
#              step time against position with and without the cache, and the
#              roofline (read bandwidth, matmul peak, per-variant fractions).
#              It logs the device it ran on (kvjax.lab.benchmarking.machine_info)
#              and writes JSON + PNG to WORKDIR/benchmark.
#
# Environment:
#   STEPS      which steps, default "devices tests sharding benchmark"
#   PRESET     benchmark preset, default gqa-small (configs/model.py)
#   JOBS       pytest workers for the accelerator tests, default 4
#   BENCH_ARGS benchmark.py flags, default "--modes=positions,roofline
#              --positions=128,1024,4096 --new_tokens=256 --repeats=3"
#   ALLOW_CPU  1: dry run on a machine without an accelerator
#
# Needs the repo's Python deps (jax with the accelerator plugin, flax, chex,
# absl-py, ml_collections, matplotlib, pytest, pytest-xdist); kvjax is taken
# from this checkout (PYTHONPATH), no install needed.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORKDIR="${1:-/tmp/kvjax_device_check}"
STEPS="${STEPS:-devices tests sharding benchmark}"
PRESET="${PRESET:-gqa-small}"
JOBS="${JOBS:-4}"
BENCH_ARGS="${BENCH_ARGS:---modes=positions,roofline --positions=128,1024,4096 --new_tokens=256 --repeats=3}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$WORKDIR"
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Several test processes share one accelerator: allocate on demand.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

START=$SECONDS
log() { echo "[device_check +$((SECONDS - START))s] $*"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }
# run NAME SECONDS CMD...: CMD under a time limit, output to WORKDIR/NAME.log;
# stops the script with CMD's exit code if it fails.
run() {
  local name=$1 limit=$2 rc=0
  shift 2
  timeout "$limit" "$@" > "$WORKDIR/$name.log" 2>&1 || rc=$?
  if [[ $rc -ne 0 ]]; then
    tail -30 "$WORKDIR/$name.log"
    log "$name FAILED (exit $rc; 124 = over ${limit}s): $WORKDIR/$name.log"
    exit "$rc"
  fi
}

if want devices; then
  log "devices"
  "$PYTHON" - <<'EOF' | tee "$WORKDIR/devices.txt"
import os
import jax
import jax.numpy as jnp
backend = jax.default_backend()
print("jax", jax.__version__, "backend", backend)
for d in jax.devices():
  print(" ", d.platform, d.device_kind, d)
if backend == "cpu" and os.environ.get("ALLOW_CPU") != "1":
  raise SystemExit("no accelerator visible to JAX (set ALLOW_CPU=1 for a "
                   "dry run)")
if backend == "gpu":
  # Is cuDNN flash attention usable here (what attention_impl='cudnn' asks)?
  q = jnp.ones((2, 16, 4, 64), jnp.bfloat16)
  try:
    out = jax.nn.dot_product_attention(q, q, q, implementation="cudnn")
    print("cudnn flash attention: ok", out.shape)
  except Exception as e:  # report, the tests decide
    print("cudnn flash attention: FAILED", type(e).__name__, e)
EOF
fi

SHARD_PID=""
if want sharding; then
  # CPU-only (simulated devices): runs beside the accelerator tests.
  log "sharding (background, host CPU)"
  ( env -u XLA_PYTHON_CLIENT_PREALLOCATE JAX_PLATFORMS=cpu \
      timeout 280 "$PYTHON" -m pytest -q -x tests/test_sharding.py \
      > "$WORKDIR/sharding.log" 2>&1 ) &
  SHARD_PID=$!
fi

if want tests; then
  log "tests on $(grep -m1 backend "$WORKDIR/devices.txt" 2>/dev/null || echo '?')"
  XDIST=()
  if [[ "$JOBS" -gt 1 ]]; then XDIST=(-n "$JOBS"); fi
  run tests 200 "$PYTHON" -m pytest -q -x "${XDIST[@]}" \
      tests/test_core.py tests/test_ragged.py tests/test_sampling.py \
      tests/test_mla.py
  log "tests ok: $(tail -1 "$WORKDIR/tests.log")"
fi

if [[ -n "$SHARD_PID" ]]; then
  if wait "$SHARD_PID"; then
    log "sharding ok: $(tail -1 "$WORKDIR/sharding.log")"
  else
    rc=$?
    tail -20 "$WORKDIR/sharding.log"
    log "sharding FAILED ($rc): $WORKDIR/sharding.log"
    exit "$rc"
  fi
fi

if want benchmark; then
  log "benchmark $PRESET"
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
  run benchmark 200 "$PYTHON" experiments/benchmark.py \
      --config="configs/model.py:$PRESET" $BENCH_ARGS \
      --workdir="$WORKDIR/benchmark"
  grep -E "machine|position|generate|wrote" "$WORKDIR/benchmark.log" \
      | sed 's/^.*\] //' || true
fi

log "done: $WORKDIR"
