"""How a norm-fed matrix-vector product is run on this host: measured.

Batch-1 decode multiplies one row, an RMSNorm's output, by each of the
q/k/v and gate/up weights (and MLA's input products). XLA's CPU backend can
run that product two ways (`layers.linear_t(..., norm_input=True)`):

  'fused'     the plain `x @ W.T`: one loop fusion over the weight's rows,
              split across the cores, the norm's multiplies fused in;
  'separate'  the norm, then the product as its own dot thunk with the
              weight on the left (`W @ x`, fenced by an optimization
              barrier), the form every other skinny product takes.

Which is faster depends on the CPU and on where the weights live, not on
the model's arithmetic. Streaming weights from DRAM (a model larger than
the last-level cache), the fused loop read 25–27 GB/s against 23 GB/s for
the dot on the AMD EPYC Zen 4 (32 MiB L3; batch-1 decode +5.6 % GQA, +8.9 %
MLA medium), while on the Intel Xeon (AVX-512, AMX, 300 MiB L3) it reads
20 GB/s against the dot's 31 GB/s, so medium's batch-1 decode runs
1.10–1.26x faster separate there (`experiments/norm_matvec.py`,
WORKSPACE.md). With the weights in the cache the Xeon turns the other way:
the shipped 12 MB model decodes 1.15–1.4x faster fused.

So the form is measured once per process and regime (`REGIMES`):
'streaming' times both forms over a chain of norm-fed products whose
weights total twice the last-level cache, 'resident' over a chain that
fits in a quarter of it (`probe_bytes`). The decode loops say what they
stream (`weights(params)`): params no larger than half the last-level
cache are 'resident', larger or unsaid 'streaming'. `fused()` takes the
fused form only where it measured at least `FUSED_MIN_SPEEDUP` faster
(the general form otherwise; a shared host's noise cannot flip a clear
difference).

`KVJAX_NORM_MATVEC=fused|separate` skips the measurement (the test suite
sets 'fused'); `forced(value)` overrides it in a block (tests, A/B
benchmarks). Read at trace time: a program compiled under one form keeps
it. Off the CPU the fused form is kept (unmeasured there; the packed
layout that calls `linear_t` is only chosen on CPU, `kvjax.packed`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import threading
import time

import jax
import jax.numpy as jnp

ENV = "KVJAX_NORM_MATVEC"
FORMS = ("fused", "separate")
REGIMES = ("streaming", "resident")
# The fused loop is taken only where it is this much faster: the hosts
# measured are 1.1x apart one way and 1.5x the other (module docstring).
FUSED_MIN_SPEEDUP = 1.03
# Probe weights per regime: medium's gate/up product ([2F, D] = 4096 x 768,
# 12.6 MB) streaming, the shipped model's scale ([4D, D] at D 256, 1 MiB)
# resident; repeated until the chain covers `probe_bytes`.
PROBE_SHAPES = {"streaming": (4096, 768), "resident": (1024, 256)}
# Chain calls per timed sample: a resident chain takes ~0.1 ms, near the
# dispatch cost, so it is timed over several calls.
_CALLS = {"streaming": 1, "resident": 16}
_DEFAULT_LLC = 256 << 20  # where the OS does not say
_PROBE_LIMITS = {"streaming": (64 << 20, 1 << 30),
                 "resident": (4 << 20, 32 << 20)}


class _Blocks(threading.local):
  """The open `forced` and `weights` blocks of this thread (a trace in
  another thread does not see them)."""

  def __init__(self):
    super().__init__()
    self.forced: list[bool] = []
    self.weights: list[int] = []


_BLOCKS = _Blocks()


def last_level_cache_bytes() -> int | None:
  """The largest CPU cache the OS reports (Linux sysfs), or None."""
  return _sysfs_largest_cache()


@functools.cache  # asked at every norm-fed product a decode step traces
def _sysfs_largest_cache() -> int | None:
  sizes = []
  base = "/sys/devices/system/cpu/cpu0/cache"
  try:
    entries = os.listdir(base)
  except OSError:
    return None
  for entry in entries:
    try:
      with open(os.path.join(base, entry, "size")) as f:
        text = f.read().strip()
    except OSError:
      continue
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text.rstrip("KMG")
    if digits.isdigit():
      sizes.append(int(digits) * scale)
  return max(sizes) if sizes else None


def last_level_cache() -> int:
  """`last_level_cache_bytes()`, or 256 MiB where the OS does not say."""
  return last_level_cache_bytes() or _DEFAULT_LLC


def probe_bytes(regime: str = "streaming") -> int:
  """Weight bytes of a regime's probe chain: 'streaming' twice the
  last-level cache (so the weights stream from memory, as a large model's
  decode step's do) within [64 MiB, 1 GiB]; 'resident' a quarter of it
  within [4 MiB, 32 MiB]."""
  _check_regime(regime)
  llc = last_level_cache()
  lo, hi = _PROBE_LIMITS[regime]
  return min(max(2 * llc if regime == "streaming" else llc // 4, lo), hi)


def regime(weight_bytes: int | None) -> str:
  """'resident' for weights no larger than half the last-level cache (they
  stay cached from one decode step to the next), else 'streaming' (also
  where the weights are not known)."""
  if weight_bytes is not None and weight_bytes <= last_level_cache() // 2:
    return "resident"
  return "streaming"


def _check_regime(value: str):
  if value not in REGIMES:
    raise ValueError(f"regime must be one of {REGIMES}, got {value!r}")


def _chain(ws, scale, x, *, fused: bool):
  # Imported here: kvjax.layers reads this module at trace time.
  from kvjax import layers
  for w in ws:
    h = layers.rms_norm(x, scale, 1e-6)
    if fused:
      y = h @ w.T
    else:
      y = jax.lax.optimization_barrier(w @ h[0])[None]
    x = x + y[:, :x.shape[1]]
  return x


def measure(nbytes: int | None = None, *, repeats: int = 5,
            regime: str = "streaming") -> dict[str, float]:
  """Seconds per chain of norm-fed products (weights of the regime's
  `PROBE_SHAPES` totalling `nbytes`, default `probe_bytes(regime)`) in
  each form, best of `repeats` after a warm-up, the forms alternating.
  Returns {'fused': s, 'separate': s, 'nbytes': n}.
  """
  _check_regime(regime)
  shape = PROBE_SHAPES[regime]
  nbytes = probe_bytes(regime) if nbytes is None else nbytes
  per = shape[0] * shape[1] * 4
  if nbytes < per or repeats < 1:
    raise ValueError(f"nbytes must be >= {per} and repeats >= 1, got "
                     f"{nbytes}, {repeats}")
  ws = [jnp.full(shape, 1e-3 * (i + 1), jnp.float32)
        for i in range(nbytes // per)]
  scale = jnp.ones((shape[1],), jnp.float32)
  x = jnp.ones((1, shape[1]), jnp.float32)
  fns = {form: jax.jit(functools.partial(_chain, fused=form == "fused"))
         for form in FORMS}
  calls = _CALLS[regime]
  best = {form: float("inf") for form in FORMS}
  for i in range(1 + repeats):
    for form, fn in fns.items():
      t0 = time.perf_counter()
      for _ in range(calls):
        y = fn(ws, scale, x)
      y.block_until_ready()
      if i:
        best[form] = min(best[form], (time.perf_counter() - t0) / calls)
  return dict(best, nbytes=float(len(ws) * per))


@functools.cache
def _measured(regime: str) -> bool:
  if jax.default_backend() != "cpu":
    return True
  # Usually first asked while a decode step is being traced; JAX's trace
  # state is per thread, so a fresh thread runs the probe eagerly.
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    t = pool.submit(measure, regime=regime).result()
  return decide(t) == "fused"


def decide(times: dict[str, float]) -> str:
  """The form a `measure` result gives: 'fused' where it is at least
  `FUSED_MIN_SPEEDUP` faster, else 'separate'."""
  return ("fused" if times["separate"] >= FUSED_MIN_SPEEDUP * times["fused"]
          else "separate")


def form() -> str:
  """'fused' or 'separate': the form this process gives norm-fed
  matrix-vector products (`forced`, else $KVJAX_NORM_MATVEC, else
  measured once for the regime of the innermost `weights` block)."""
  if _BLOCKS.forced:
    return "fused" if _BLOCKS.forced[-1] else "separate"
  env = os.environ.get(ENV, "")
  if env:
    if env not in FORMS:
      raise ValueError(f"{ENV} must be one of {FORMS}, got {env!r}")
    return env
  streamed = _BLOCKS.weights[-1] if _BLOCKS.weights else None
  return "fused" if _measured(regime(streamed)) else "separate"


def fused() -> bool:
  """Whether norm-fed one-row products take the fused loop (`form`)."""
  return form() == "fused"


@contextlib.contextmanager
def forced(value: str):
  """Inside, `form()` is `value` ('fused' or 'separate'). Programs traced
  before keep the form they were compiled with."""
  if value not in FORMS:
    raise ValueError(f"value must be one of {FORMS}, got {value!r}")
  _BLOCKS.forced.append(value == "fused")
  try:
    yield
  finally:
    _BLOCKS.forced.pop()


def nbytes(params) -> int:
  """Total bytes of a pytree's leaves (arrays, tracers or shape structs)."""
  return int(sum(a.size * jnp.dtype(a.dtype).itemsize
                 for a in jax.tree_util.tree_leaves(params)))


@contextlib.contextmanager
def weights(params):
  """Inside, norm-fed products are formed for a step that streams
  `params` (their total bytes; arrays or tracers): what a decode loop
  says around the step it traces."""
  _BLOCKS.weights.append(nbytes(params))
  try:
    yield
  finally:
    _BLOCKS.weights.pop()
