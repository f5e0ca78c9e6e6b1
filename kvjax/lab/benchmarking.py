"""Measuring what inference costs on this machine: timers, hardware probes,
bytes / FLOPs models and peak resident memory.

Everything here is a plain function so that `experiments/benchmark.py`,
`experiments/peer_benchmark.py`, tests and notebooks share one definition of
every number:

  timing     `time_fn` (warm-up, `block_until_ready`, median),
             `time_alternating` (A B A B ... in one run: ratios are not
             skewed by load that changes over time), `round_rates`,
             `paired_ratios` and `spread` (per-round decode rates and
             ratios of one run, and their quartiles), `compile_seconds`.
  probes     `read_bandwidth` (a pure streaming read), `triad_bandwidth`
             (a = b + s·c into a donated buffer), `matvec_bandwidth` (the
             batch-1 decode pattern x @ W), `matmul_peak` (FLOP/s of a large
             square matmul).
  models     `param_bytes`, `decode_bytes_per_step` (the bytes one decode
             step must read: the weights it uses + the used part of the
             cache), `prefill_flops` (the matmul FLOPs of a prefill),
             `largest_activation_bytes`.
  memory     `PeakRSS` (the process's peak resident set size over a region,
             reset through /proc/self/clear_refs), `current_rss_bytes`,
             `executables_rss_bytes` (what compiled programs hold).
  plots      `plot_positions`, `plot_variants`, `plot_sweep`: the
             benchmark modes' figures, medians with the repeats' min-max as
             error bars, units and repeat counts on the axes; each returns
             `figure_labels` (the words it shows).

Shapes use the alphabet of `kvjax.config`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import decode
from kvjax import errors
from kvjax import layered
from kvjax import packed
from kvjax import params as params_lib
from kvjax import quant
from kvjax import sampling
from kvjax.config import ModelConfig


# ---- timing -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Timing:
  """Wall-clock seconds of repeated calls (warm-up calls excluded)."""

  seconds: tuple[float, ...]

  @property
  def median(self) -> float:
    return statistics.median(self.seconds)

  @property
  def min(self) -> float:
    return min(self.seconds)

  @property
  def max(self) -> float:
    return max(self.seconds)

  def to_dict(self) -> dict[str, Any]:
    return dict(median_s=self.median, min_s=self.min, max_s=self.max,
                repeats=len(self.seconds))


def _check_counts(warmup: int, repeats: int):
  if warmup < 0:
    raise ValueError(f"warmup must be >= 0, got {warmup}")
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")


def time_fn(fn: Callable[[], Any], *, warmup: int = 1,
            repeats: int = 5) -> Timing:
  """Times `fn()` (which must return JAX arrays or a pytree of them).

  Each call is followed by `jax.block_until_ready` on its result, so the time
  is the computation, not the dispatch. The first `warmup` calls (compile,
  caches) are not recorded.
  """
  _check_counts(warmup, repeats)
  for _ in range(warmup):
    jax.block_until_ready(fn())
  out = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    out.append(time.perf_counter() - t0)
  return Timing(tuple(out))


def time_alternating(fns: Mapping[str, Callable[[], Any]], *, warmup: int = 1,
                     repeats: int = 5) -> dict[str, Timing]:
  """Times several functions interleaved, the order rotated every round:
  A B C, B C A, C A B, ... (warm-up first).

  On a machine shared with other work the load drifts; interleaving exposes
  every candidate to the same drift, so the ratio of medians is fair.
  Rotating the order stops one candidate from always running right after
  the same other one (whose caches, threads or allocator state it would
  inherit: a torch model timed before kvjax in every round made the kvjax
  contender that followed it consistently slower).
  """
  _check_counts(warmup, repeats)
  if not fns:
    raise ValueError("fns is empty")
  for _ in range(warmup):
    for fn in fns.values():
      jax.block_until_ready(fn())
  names = list(fns)
  out = {name: [] for name in names}
  for r in range(repeats):
    for name in names[r % len(names):] + names[:r % len(names)]:
      t0 = time.perf_counter()
      jax.block_until_ready(fns[name]())
      out[name].append(time.perf_counter() - t0)
  return {name: Timing(tuple(ts)) for name, ts in out.items()}


def round_rates(generate: Timing, prefill: Timing,
                tokens: int) -> tuple[float, ...]:
  """Decode tokens/s of every timed generate round:
  tokens / (t_generate[r] − median prefill).

  Why the median prefill: a generate is a prefill plus the decode, and the
  prefill's best estimate is its median. Subtracting each round's own
  prefill time would add that single timing's noise to the decode time.

  Raises:
    ValueError: tokens < 1, no rounds, or a round whose generate took no
      longer than the median prefill (no decode time to divide by).
  """
  if tokens < 1:
    raise ValueError(f"tokens must be >= 1, got {tokens}")
  if not generate.seconds or not prefill.seconds:
    raise ValueError("round_rates needs timed rounds of both calls")
  tp = prefill.median
  out = []
  for r, tg in enumerate(generate.seconds):
    if tg <= tp:
      raise ValueError(f"round {r}: generate took {tg:.4g} s, no longer than "
                       f"the median prefill ({tp:.4g} s); decode more tokens")
    out.append(tokens / (tg - tp))
  return tuple(out)


def paired_ratios(num, den) -> tuple[float, ...]:
  """num[r] / den[r] for every round r (e.g. two `round_rates` of one run).

  Why: the ratio of two medians is one number; the ratios of rounds timed
  side by side (A B A B ...) show how far a single run's ratio can be
  trusted on a shared, noisy machine.

  Raises:
    ValueError: unequal lengths, no rounds, or a non-positive denominator.
  """
  if len(num) != len(den) or not num:
    raise ValueError(f"paired_ratios needs equal, non-empty sequences, got "
                     f"{len(num)} and {len(den)} values")
  if min(den) <= 0:
    raise ValueError(f"paired_ratios: non-positive denominator {min(den)}")
  return tuple(a / b for a, b in zip(num, den))


def cache_read_rates(rows: Sequence[Mapping[str, Any]]
                     ) -> list[dict[str, Any]]:
  """The sweep's rows (`experiments/benchmark.py --modes=sweep`), each with
  the rate at which its step reads the cache itself.

  Against the row of the same (variant, kv_dtype, batch) at the sweep's
  shortest context: Δ cache bytes / Δ step time, and that over the mean of
  the two rows' read probes. Why: a step is a fixed part (the weights'
  products, the sampling; `fixed_s`, this line's intercept) plus the
  cache's read; the whole step's share of the probe charges the fixed part
  to the kernel, the difference isolates what each cached token costs.
  Rows at the shortest context, or whose group has one context, are
  returned without 'cache_read'. Where both rows carry `attention_flops`
  (the step's attention FLOPs over its cached tokens) and `flop_probe`
  (FLOP/s), 'cache_read' also holds the same difference against the FLOP
  ceiling (`roofline`): flops_per_s, of_flop_probe, intensity,
  ridge, bound ('bytes' or 'flops') and of_roofline.

  A longer context that did not take longer has no rate (it needs a
  positive Δ time): its row gets 'cache_read_error', saying which point,
  instead of 'cache_read', and the others keep theirs.
  """
  out = [dict(r) for r in rows]
  groups: dict[tuple, list[dict]] = {}
  for r in out:
    groups.setdefault((r["variant"], r["kv_dtype"], r["batch"]), []).append(r)
  for key, group in groups.items():
    base = min(group, key=lambda r: r["context"])
    for r in group:
      if r["context"] == base["context"]:
        continue
      d_bytes = r["bytes"]["cache"] - base["bytes"]["cache"]
      d_s = r["step_s"] - base["step_s"]
      if d_s <= 0:  # no rate: the noise is above the extra tokens' time
        r["cache_read_error"] = (
            f"{key} at context {r['context']} took {r['step_s']:.3g} s, not "
            f"longer than {base['step_s']:.3g} s at context "
            f"{base['context']}")
        continue
      rate = d_bytes / d_s
      probe = 0.5 * (r["read_probe"] + base["read_probe"])
      r["cache_read"] = dict(
          bytes_per_s=rate, of_read_probe=rate / probe,
          fixed_s=base["step_s"] - base["bytes"]["cache"] / rate,
          from_context=base["context"])
      if all("attention_flops" in x and "flop_probe" in x
             for x in (r, base)):
        r["cache_read"].update(roofline(
            d_bytes, r["attention_flops"] - base["attention_flops"], d_s,
            probe, 0.5 * (r["flop_probe"] + base["flop_probe"])))
  return out


def roofline(nbytes: float, flops: float, seconds: float,
             read_probe: float, flop_probe: float) -> dict[str, Any]:
  """Work of `nbytes` read and `flops` done in `seconds` against both
  ceilings: the FLOP rate and its share of the FLOP probe; the arithmetic
  intensity (FLOPs per byte) against the ridge (the probes' ratio), which
  says which roof binds; and the time that roof allows over the time taken
  (`of_roofline`: the larger of the two probes' shares)."""
  if min(nbytes, flops, seconds, read_probe, flop_probe) <= 0:
    raise ValueError(
        f"roofline: every quantity must be positive, got nbytes={nbytes}, "
        f"flops={flops}, seconds={seconds}, read_probe={read_probe}, "
        f"flop_probe={flop_probe}")
  intensity, ridge = flops / nbytes, flop_probe / read_probe
  return dict(flops_per_s=flops / seconds,
              of_flop_probe=flops / seconds / flop_probe,
              intensity=intensity, ridge=ridge,
              bound="flops" if intensity > ridge else "bytes",
              of_roofline=max(nbytes / read_probe, flops / flop_probe) /
              seconds)


def spread(values) -> dict[str, float]:
  """min, lower quartile, median, upper quartile and max of `values`
  (quartiles by linear interpolation, as numpy's default)."""
  if not len(values):  # pylint: disable=g-explicit-length-test
    raise ValueError("spread of no values")
  q = np.quantile(np.asarray(values, np.float64), [0, 0.25, 0.5, 0.75, 1])
  return dict(zip(("min", "q1", "median", "q3", "max"), map(float, q)))


def compile_seconds(jitted, *args, **kwargs) -> dict[str, float]:
  """Trace+lower and XLA-compile times of `jitted(*args, **kwargs)`.

  Uses the AOT path (`jitted.lower(...).compile()`), so nothing runs and the
  in-memory jit cache is not consulted: the figure is a fresh compilation.
  """
  t0 = time.perf_counter()
  lowered = jitted.lower(*args, **kwargs)
  t1 = time.perf_counter()
  lowered.compile()
  t2 = time.perf_counter()
  return dict(lower_s=t1 - t0, compile_s=t2 - t1, total_s=t2 - t0)


# ---- hardware probes --------------------------------------------------------
def _probe_array(nbytes: int, key: int = 0):
  if nbytes < 4096:
    raise ValueError(f"nbytes must be >= 4096, got {nbytes}")
  n = nbytes // 4
  return jax.random.normal(jax.random.key(key), (n,), jnp.float32)


def read_bandwidth(nbytes: int = 1 << 29, *, warmup: int = 2,
                   repeats: int = 10) -> dict[str, float]:
  """Streaming-read bandwidth: sum of an `nbytes` float32 array.

  Returns:
    bytes_per_s (nbytes / median time), median_s, nbytes.
  """
  run, nb = read_probe(nbytes)
  t = time_fn(run, warmup=warmup, repeats=repeats)
  return dict(bytes_per_s=nb / t.median, best_bytes_per_s=nb / t.min,
              median_s=t.median, nbytes=nb)


def read_probe(nbytes: int = 1 << 29):
  """(run, nbytes read): `run()` sums an `nbytes` float32 array (the read
  probe, to time by itself or in alternating rounds with what it
  measures)."""
  x = _probe_array(nbytes)
  f = jax.jit(jnp.sum)
  return (lambda: f(x)), x.size * 4


@functools.partial(jax.jit, donate_argnums=(0,))
def _triad(a, b, c):
  del a  # donated: the output reuses its pages (no page faults per call).
  return b + 1.5 * c


def triad_bandwidth(nbytes: int = 1 << 28, *, warmup: int = 2,
                    repeats: int = 10) -> dict[str, float]:
  """STREAM triad a = b + s·c with a donated output buffer.

  Counts 3 × nbytes per call (two reads, one write).
  """
  b = _probe_array(nbytes, 1)
  c = _probe_array(nbytes, 2)
  state = [jnp.zeros_like(b)]

  def call():
    state[0] = _triad(state[0], b, c)
    return state[0]

  t = time_fn(call, warmup=warmup, repeats=repeats)
  nb = 3 * b.size * 4
  return dict(bytes_per_s=nb / t.median, best_bytes_per_s=nb / t.min,
              median_s=t.median, nbytes=nb)


def matvec_bandwidth(in_dim: int = 4096, out_dim: int = 16384, *,
                     warmup: int = 2, repeats: int = 10) -> dict[str, float]:
  """Batch-1 decode pattern: x [1, in] @ W [in, out] (W stored [in, out]).

  Counts the bytes of W (x and the output are negligible).
  """
  w = jax.random.normal(jax.random.key(3), (in_dim, out_dim), jnp.float32)
  x = jax.random.normal(jax.random.key(4), (1, in_dim), jnp.float32)
  f = jax.jit(jnp.matmul)
  t = time_fn(lambda: f(x, w), warmup=warmup, repeats=repeats)
  nb = w.size * 4
  return dict(bytes_per_s=nb / t.median, best_bytes_per_s=nb / t.min,
              median_s=t.median, nbytes=nb)


def matmul_peak(n: int = 2048, dtype: str = "float32", *, warmup: int = 2,
                repeats: int = 5) -> dict[str, float]:
  """FLOP/s of an n × n × n matmul through XLA (2·n³ FLOPs per call).

  For bfloat16 inputs the product accumulates and is returned in float32
  (`preferred_element_type`), the form kvjax uses for low-precision matmuls.
  """
  if n < 1:
    raise ValueError(f"n must be >= 1, got {n}")
  a = jax.random.normal(jax.random.key(5), (n, n), jnp.float32).astype(dtype)
  b = jax.random.normal(jax.random.key(6), (n, n), jnp.float32).astype(dtype)
  f = jax.jit(lambda a, b: jnp.matmul(a, b,
                                      preferred_element_type=jnp.float32))
  t = time_fn(lambda: f(a, b), warmup=warmup, repeats=repeats)
  flops = 2.0 * n ** 3
  return dict(flops_per_s=flops / t.median, best_flops_per_s=flops / t.min,
              median_s=t.median, flops=flops)


# ---- bytes and FLOPs models -------------------------------------------------
def tree_bytes(tree) -> int:
  """Bytes of every array leaf of a pytree (shape-dtype structs work too)."""
  return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree_util.tree_leaves(tree))


def param_bytes(params) -> int:
  return tree_bytes(params)


def decode_weight_bytes(params, config: ModelConfig) -> int:
  """Weight bytes one decode step reads.

  Every weight except the embedding table, of which only one row per
  sequence is gathered (negligible, counted as zero); with tied embeddings
  the table is the LM head and is read whole.
  """
  total = tree_bytes(params)
  if config.tie_embeddings:
    return total
  return total - tree_bytes(params["embed"])


def decode_bytes_per_step(params, config: ModelConfig, batch: int,
                          context: int, kv_dtype: str = "float32"
                          ) -> dict[str, int]:
  """Bytes a decode step at `context` cached tokens must read.

  The minimum traffic of the step: the weights it uses once (shared by the
  batch) plus the used part of every sequence's cache (`context` tokens incl.
  the new one, scales included). Activations are negligible at decode.

  Returns:
    weights, cache, total (bytes).
  """
  if batch < 1 or context < 1:
    raise ValueError(f"batch and context must be >= 1, got {batch}, "
                     f"{context}")
  w = decode_weight_bytes(params, config)
  policy = cache_policy(kv_dtype)
  key_group = policy.key_group if policy.channel_keys else 0
  c = int(batch * context * cache_lib.kv_bytes_per_token(
      config, policy.kv_dtype, key_group=key_group))
  if key_group:  # KIVI also reads its float32 newest key group
    channels = (config.kv_lora_rank + config.qk_rope_head_dim
                if config.attention == "mla" else
                config.num_kv_heads * config.head_dim)
    c += config.num_layers * batch * key_group * channels * 4
  return dict(weights=w, cache=c, total=w + c)


def attention_macs_per_token(config: ModelConfig) -> int:
  """Multiply-adds a decode step spends on each cached token of one
  sequence, over all layers: the work per entry that the cache bytes of
  `decode_bytes_per_step` buy, so FLOPs / bytes is the attention's
  arithmetic intensity (whatever the storage: codes are multiplied as
  numbers).

  GQA family: each of the N query rows takes a dot with the token's key
  (H) and adds its weighted value (H): L · N · 2H. MLA absorbed: the
  latent is key and value at once, L · N · (2C + R). MLA naive first
  expands each cached latent into every head's key and value (C · N ·
  (P + O)), then attends over keys of P + R and values of O.
  """
  L, N = config.num_layers, config.num_heads
  if config.attention != "mla":
    return L * N * 2 * config.head_dim
  C, R = config.kv_lora_rank, config.qk_rope_head_dim
  if config.mla_decode == "absorbed":
    return L * N * (2 * C + R)
  P, O = config.qk_nope_head_dim, config.v_head_dim
  return L * (C * N * (P + O) + N * (P + R + O))


def decode_flops_per_step(config: ModelConfig, batch: int,
                          context: int) -> dict[str, float]:
  """FLOPs of one decode step over `context` cached tokens (the new one
  included), as the step runs them: every weight matrix once per sequence
  and the LM head (`prefill_flops` of one token), and the attention's
  `attention_macs_per_token` per cached token (MLA's absorbed form where
  the config decodes absorbed).

  Returns:
    weights, attention, total.
  """
  if batch < 1 or context < 1:
    raise ValueError(f"batch and context must be >= 1, got {batch}, "
                     f"{context}")
  one = prefill_flops(config, batch, 1)
  weights = one["matmul"] + one["lm_head"]
  attention = 2.0 * attention_macs_per_token(config) * batch * context
  return dict(weights=weights, attention=attention,
              total=weights + attention)


# ---- cache kinds compared by the benchmarks ---------------------------------
KIVI_GROUP = 32  # KIVI's group size for per-channel keys
CACHE_KINDS = ("float32", "bfloat16", "float16", "int8", "int4", "int2",
               "int8-kivi", "int4-kivi", "int2-kivi")


def cache_policy(kind: str) -> cache_lib.CachePolicy:
  """The CachePolicy of a benchmark cache kind: a kv dtype, or 'int8-kivi' /
  'int4-kivi' / 'int2-kivi' (values per token, keys per channel in groups
  of KIVI_GROUP, at 8, 4 or 2 bits: KIVI's settings)."""
  if kind in ("int8-kivi", "int4-kivi", "int2-kivi"):
    return cache_lib.CachePolicy(kv_dtype=kind.split("-")[0],
                                 key_quant="channel", key_group=KIVI_GROUP)
  if kind not in cache_lib.KV_DTYPES:
    raise ValueError(f"cache kind {kind!r} is not one of {CACHE_KINDS}")
  return cache_lib.CachePolicy(kv_dtype=kind)



def _matmul_params_per_layer(config: ModelConfig) -> int:
  """Weights of one dense layer that multiply every token (norms excluded)."""
  D, N, F = config.embed_dim, config.num_heads, config.mlp_dim
  if config.attention == "mla":
    C, R = config.kv_lora_rank, config.qk_rope_head_dim
    P, O, Q = config.qk_nope_head_dim, config.v_head_dim, config.q_lora_rank
    q = D * Q + Q * N * (P + R) if Q else D * N * (P + R)
    attn = q + D * (C + R) + C * N * (P + O) + N * O * D
  else:
    K, H = config.num_kv_heads, config.head_dim
    attn = D * N * H + 2 * D * K * H + N * H * D
  if config.is_moe:
    raise ValueError("prefill_flops does not model MoE layers")
  return attn + 3 * D * F


def prefill_flops(config: ModelConfig, batch: int, length: int,
                  all_logits: bool = False) -> dict[str, float]:
  """FLOPs of a prefill of `batch` prompts of `length` tokens.

  matmul: 2 × tokens × (every layer's weight matrices); attention: the
  causal half only, 2·N·(q·k width + v width) per (query, key) pair with
  key ≤ query — the useful work, not the masked square the einsum computes;
  lm_head: the last position only unless `all_logits`.

  Returns:
    matmul, attention, lm_head, total.
  """
  if batch < 1 or length < 1:
    raise ValueError(f"batch and length must be >= 1, got {batch}, {length}")
  tokens = batch * length
  L, N, D, V = (config.num_layers, config.num_heads, config.embed_dim,
                config.vocab_size)
  matmul = 2.0 * tokens * L * _matmul_params_per_layer(config)
  if config.attention == "mla":
    qk, v = config.qk_nope_head_dim + config.qk_rope_head_dim, (
        config.v_head_dim)
  else:
    qk = v = config.head_dim
  pairs = batch * length * (length + 1) / 2
  attention = 2.0 * L * N * (qk + v) * pairs
  lm_head = 2.0 * D * V * (tokens if all_logits else batch)
  return dict(matmul=matmul, attention=attention, lm_head=lm_head,
              total=matmul + attention + lm_head)


def largest_activation_bytes(config: ModelConfig, batch: int, length: int,
                             all_logits: bool = False) -> int:
  """The largest single activation of a prefill of [batch, length] (float32
  compute): the MLP hidden [B,T,F], attention logits [B,N,T,T], or logits
  [B,T or 1,V]."""
  itemsize = jnp.dtype(config.compute_dtype).itemsize
  B, T = batch, length
  candidates = [
      B * T * config.mlp_dim * itemsize,
      B * config.num_heads * T * T * 4,
      B * (T if all_logits else 1) * config.vocab_size * 4,
      B * T * config.embed_dim * itemsize,
  ]
  return max(candidates)


# ---- resident memory --------------------------------------------------------
def _status_kib(field: str) -> int | None:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1])
  except OSError:
    return None
  return None


def current_rss_bytes() -> int:
  """Resident set size now (VmRSS), in bytes."""
  kib = _status_kib("VmRSS")
  if kib is None:
    raise OSError("/proc/self/status has no VmRSS on this system")
  return kib * 1024


def release_free_memory() -> bool:
  """Returns the C allocator's free pages to the OS (glibc `malloc_trim`).

  Measurement hygiene for `PeakRSS`: buffers a finished computation freed
  stay resident in the allocator's free lists, so a region measured after
  (say) weight initialisation would be charged for memory nothing holds.
  A no-op returning False where glibc is not the allocator.
  """
  try:
    libc = ctypes.CDLL("libc.so.6")
    return bool(libc.malloc_trim(0))
  except (OSError, AttributeError):
    return False


def executables_rss_bytes() -> int:
  """Resident memory held by every compiled executable of this process.

  Measured, not estimated: the RSS drop when JAX's compilation caches are
  cleared (`jax.clear_caches`; the allocator's free pages are returned
  before both readings). A JIT backend keeps each program's machine code
  and runtime state resident for as long as the program can be called, so
  a peak-RSS figure of a compiled run includes them; this separates them
  from the memory the run's data (params, cache, activations) needs.
  Later calls recompile.
  """
  release_free_memory()
  before = current_rss_bytes()
  jax.clear_caches()
  gc.collect()
  release_free_memory()
  return max(0, before - current_rss_bytes())


def compiled_memory(program) -> dict[str, int]:
  """XLA's memory analysis of a lowered (or compiled) program (device-
  agnostic): the bytes of its arguments, outputs, temporaries, donated
  aliases and the peak its buffer assignment needs."""
  if hasattr(program, "compile"):  # lowered, not yet compiled
    program = program.compile()
  ma = program.memory_analysis()
  if ma is None:
    raise ValueError("this backend gives no memory analysis")
  return dict(arguments=ma.argument_size_in_bytes,
              outputs=ma.output_size_in_bytes,
              temporaries=ma.temp_size_in_bytes,
              aliased=ma.alias_size_in_bytes,
              peak=ma.peak_memory_in_bytes)


def reset_peak_rss() -> bool:
  """Resets the kernel's peak-RSS counter (VmHWM) to the current RSS.

  Returns False where /proc/self/clear_refs is unavailable; the peak then
  covers the whole process lifetime (`ru_maxrss`).
  """
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def peak_rss_bytes() -> int:
  """Peak resident set size since the last reset (VmHWM), in bytes."""
  kib = _status_kib("VmHWM")
  if kib is None:  # no /proc: lifetime peak (KiB on Linux).
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return kib * 1024


class PeakRSS:
  """Context manager measuring the peak resident memory of a region.

    with PeakRSS() as m:
      run()
    m.before, m.peak, m.delta  (bytes)

  `delta` = peak − RSS at entry: the memory the region itself added on top
  of what the process already held. `reset_ok` says whether the peak was
  reset at entry (else `peak` may predate the region).
  """

  def __enter__(self):
    self.before = current_rss_bytes()
    self.reset_ok = reset_peak_rss()
    return self

  def __exit__(self, *exc):
    self.peak = peak_rss_bytes()
    self.after = current_rss_bytes()
    self.delta = self.peak - self.before
    return False

  def to_dict(self) -> dict[str, Any]:
    return dict(before_bytes=self.before, peak_bytes=self.peak,
                after_bytes=self.after, delta_bytes=self.delta,
                reset_ok=self.reset_ok)


# ---- two commits side by side (experiments/compare_commits.py, train_speed.py)
@contextlib.contextmanager
def commit_checkout(repo: str, rev: str):
  """A temporary detached git worktree of `repo` at `rev` (its path),
  removed on exit."""
  with tempfile.TemporaryDirectory() as tmp:
    tree = os.path.join(tmp, "base")
    subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", tree,
                    rev], check=True, capture_output=True)
    try:
      yield tree
    finally:
      subprocess.run(["git", "-C", repo, "worktree", "remove", "--force",
                      tree], check=False, capture_output=True)


def run_probe(tree: str, script: str, *args, env=None) -> dict:
  """Runs `script` (Python source) in a fresh CPU subprocess that imports
  kvjax from `tree` (with `env`'s variables added); returns the JSON of its
  last stdout line."""
  env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu", **(env or {}))
  out = subprocess.run([sys.executable, "-c", script, *map(str, args)],
                       cwd=tree, env=env, capture_output=True, text=True,
                       check=False)
  if out.returncode:
    raise RuntimeError(f"probe failed in {tree}:\n{out.stderr[-2000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def revision(repo: str) -> dict[str, Any]:
  """{'head': short commit of `repo`, 'dirty': tracked files changed}."""
  git = lambda *a: subprocess.run(["git", "-C", repo, *a], capture_output=True,
                                  text=True, check=False).stdout.strip()
  return dict(head=git("rev-parse", "--short", "HEAD"),
              dirty=bool(git("status", "--porcelain", "--untracked-files=no")))


def machine_info() -> dict[str, Any]:
  """What the figures were measured on."""
  try:
    load = os.getloadavg()
  except OSError:
    load = None
  return dict(jax=jax.__version__, backend=jax.default_backend(),
              devices=[str(d) for d in jax.devices()], cpu=cpu_model(),
              cpu_count=os.cpu_count(), loadavg=load)


def cpu_model() -> str:
  """lscpu's "Model name" (else /proc/cpuinfo's, else platform's)."""
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True,
                         check=True).stdout
    for line in out.splitlines():
      if line.startswith("Model name:"):
        return line.split(":", 1)[1].strip()
  except (OSError, subprocess.CalledProcessError):
    pass
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


# ---- runners: the measurements the experiments report ----------------------
def filled_cache(config: ModelConfig, batch: int, capacity: int, length: int,
                 policy: cache_lib.CachePolicy | None = None, seed: int = 0):
  """A cache that holds `length` tokens (positions 0..length-1) per sequence.

  The payload is random (int8 / int4 / int2: random codes with positive
  scales; int4's uint8 bytes hold two codes each, int2's int16s eight, all
  values valid): a decode step does the same work whatever the values, so
  timing at position `length` needs no prefill of `length` tokens.
  """
  policy = policy or cache_lib.CachePolicy()
  if policy.eviction != "none":
    raise ValueError("filled_cache models eviction='none' only, got "
                     f"{policy.eviction!r}")
  if not 0 <= length <= capacity:
    raise ValueError(f"length={length} must be in [0, capacity={capacity}]")
  cache = cache_lib.init_cache(config, batch, capacity, policy=policy)
  leaves, treedef = jax.tree_util.tree_flatten(cache)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  storage = {id(x) for x in cache_lib._storage_leaves(cache)}  # pylint: disable=protected-access
  out = []
  for k, x in zip(keys, leaves):
    if id(x) not in storage:
      out.append(x)
    elif x.dtype == jnp.int8:
      out.append(jax.random.randint(k, x.shape, -127, 128, jnp.int32).astype(
          jnp.int8))
    elif x.dtype == quant.INT4_PAIRS:
      out.append(jax.random.randint(k, x.shape, 0, 256, jnp.int32).astype(
          jnp.uint8))
    elif x.dtype == quant.INT2_OCTETS:  # every int16 is eight valid codes
      out.append(jax.random.randint(k, x.shape, -32768, 32768,
                                    jnp.int32).astype(jnp.int16))
    elif x.dtype == quant.BF16_BITS:  # bfloat16 caches store the bits
      out.append(jax.lax.bitcast_convert_type(
          jax.random.normal(k, x.shape, jnp.bfloat16), jnp.uint16))
    elif any(x is getattr(cache, f, None)
             for f in ("k_scale", "v_scale", "c_scale", "r_scale")):
      out.append(jax.random.uniform(k, x.shape, jnp.float32, 0.005, 0.02))
    else:
      out.append(jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype))
  cache = jax.tree_util.tree_unflatten(treedef, out)
  pos = jnp.arange(capacity, dtype=jnp.int32)
  positions = jnp.where(pos < length, pos, cache_lib.EMPTY)
  return cache.replace(
      positions=jnp.broadcast_to(positions, (batch, capacity)),
      length=jnp.full((batch,), length, jnp.int32))


@functools.partial(jax.jit, static_argnames=("config", "steps", "plan"),
                   donate_argnames=("cache",))
def decode_loop(params, config, token_B, cache, steps: int,
                plan: decode.Plan = decode.Plan()):
  """`steps` greedy steps of the decode loop `generate` runs
  (`kvjax.decode.run`, laid out by `plan`). Returns (last token [B],
  new_cache)."""
  tok_B, cache, _ = decode.run(params, config, token_B, cache, None, n=steps,
                               choose=sampling.GREEDY,
                               emit=lambda *_: None, plan=plan)
  return tok_B, cache


def timing_plan(params, config: ModelConfig, policy, batch: int,
                position: int, steps: int, total: int,
                capacity: int) -> decode.Plan:
  """The plan of a timed loop of `steps` steps from `position`, in a run of
  `total` steps: `generate`'s plan (`decode.plan`) for that run, as one
  segment attending what the run's last step needs, so that every timed
  loop compiles once and runs the layout generate would."""
  full = decode.plan(params, config, policy, batch, position, total,
                     capacity)
  if not full.schedule:
    return decode.Plan(schedule=((steps, 0),), layout=full.layout)
  last = len(full.schedule) - 1
  return decode.Plan(schedule=((steps, full.schedule[last][1]),),
                     layout=full.segment_layout(last))


def error_check_cost(params, config: ModelConfig, batch: int, position: int,
                     *, steps: int = 32, repeats: int = 9
                     ) -> dict[str, Any]:
  """What the in-graph error state costs a decode step (`kvjax.errors`).

  Two scans of `steps` greedy decode steps (decode_logits + the GREEDY
  sampler, as generate's loop runs them) from a cache holding `position`
  tokens: one traced normally, one inside `errors.unchecked()`. Timed
  alternately (same load drift), `repeats` rounds.

  Returns:
    checked_step_s, unchecked_step_s (medians per step), ratio (checked /
    unchecked, median of per-round ratios), and the rounds.
  """
  capacity = position + steps + 1

  def make():
    def loop(params, tok_B, cache):
      return decode.run(params, config, tok_B, cache, None, n=steps,
                        choose=sampling.GREEDY, emit=lambda *_: None)[:2]
    return jax.jit(loop)  # a fresh function: its own trace and jit cache

  checked = make()
  with errors.unchecked():
    unchecked = make()
    tok = jnp.zeros((batch,), jnp.int32)
    cache = filled_cache(config, batch, capacity, position)
    jax.block_until_ready(unchecked(params, tok, cache))  # traced here
  jax.block_until_ready(checked(params, tok, cache))
  t = time_alternating(dict(checked=lambda: checked(params, tok, cache),
                            unchecked=lambda: unchecked(params, tok, cache)),
                       warmup=1, repeats=repeats)
  ratios = paired_ratios(t["checked"].seconds, t["unchecked"].seconds)
  return dict(checked_step_s=t["checked"].median / steps,
              unchecked_step_s=t["unchecked"].median / steps,
              ratio=statistics.median(ratios), ratio_rounds=ratios,
              batch=batch, position=position, steps=steps)


# One form per process: compiled beside the other form, the fused loop ran
# as fast as the separate dots (gqa-medium 13.6 vs 13.6 ms per step) where
# by itself it took 16.6-18.6 ms against 13.1-14.4 (Intel Xeon), so a
# process's own form is timed in a process of its own.
_FORM_PROBE = r"""
import json, sys
import jax
import kvjax
from kvjax.config import ModelConfig
from kvjax.lab import benchmarking as bm
from kvjax import norm_matvec
config = ModelConfig.from_dict(json.loads(sys.argv[1]))
batch, position, steps, repeats = map(int, sys.argv[2:6])
params = kvjax.init_params(config, jax.random.key(0))
r = bm.decode_steps_alternating(params, config, batch, position, ["float32"],
                                steps=steps, repeats=repeats,
                                probe_bytes=1 << 29)
print(json.dumps(dict(form=norm_matvec.form(),
                      step_s=r["float32"]["step_s"],
                      probe_bytes_per_s=r["read_probe"]["bytes_per_s"])))
"""


def norm_matvec_forms(config: ModelConfig, batch: int, position: int, *,
                      rounds: int = 3, steps: int = 16, repeats: int = 5
                      ) -> dict[str, Any]:
  """Decode steps with norm-fed one-row products in each form of
  `kvjax.norm_matvec`, each form in fresh subprocesses
  (`KVJAX_NORM_MATVEC` set; random params of `config`, the layout generate
  runs, a cache holding `position` tokens) with the read probe timed in
  the same subprocess, forms alternating over `rounds`.

  Returns:
    per form: step_s (median over rounds), bytes (`decode_bytes_per_step`),
    read_fraction (median over rounds of bytes / step / that subprocess's
    probe), rounds (its per-round step_s); separate_speedup (median of
    per-round fused / separate step); weight_bytes (`config`'s params, what
    sets `norm_matvec.regime`).
  """
  from kvjax import norm_matvec  # pylint: disable=g-import-not-at-top
  _check_counts(1, repeats)
  if rounds < 1:
    raise ValueError(f"rounds must be >= 1, got {rounds}")
  tree = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  params = jax.eval_shape(lambda: params_lib.init_params(
      config, jax.random.key(0)))  # shapes: the bytes a step reads
  nbytes = decode_bytes_per_step(params, config, batch, position + 1)["total"]
  runs = {form: [] for form in norm_matvec.FORMS}
  for r in range(rounds):
    forms = norm_matvec.FORMS[r % 2:] + norm_matvec.FORMS[:r % 2]
    for form in forms:
      out = run_probe(tree, _FORM_PROBE, json.dumps(config.to_dict()), batch,
                      position, steps, repeats,
                      env={norm_matvec.ENV: form})
      if out["form"] != form:
        raise RuntimeError(f"the subprocess ran {out['form']!r}, not {form!r}")
      runs[form].append(out)
  result = {}
  for form, outs in runs.items():
    steps_s = [o["step_s"] for o in outs]
    result[form] = dict(
        step_s=statistics.median(steps_s), bytes=nbytes, rounds=steps_s,
        read_fraction=statistics.median(
            nbytes / o["step_s"] / o["probe_bytes_per_s"] for o in outs),
        probe_bytes_per_s=statistics.median(o["probe_bytes_per_s"]
                                            for o in outs))
  result["separate_speedup"] = statistics.median(paired_ratios(
      result["fused"]["rounds"], result["separate"]["rounds"]))
  result["weight_bytes"] = norm_matvec.nbytes(params)
  return result


def _decode_runner(params, config: ModelConfig, batch: int, position: int,
                   steps: int, kv_dtype: str, capacity: int | None,
                   calls: int, layout: str | None = None):
  """(run, state, capacity, plan): `run()` times nothing itself; it runs
  `decode_loop` for `steps` steps from a cache holding `position` tokens
  (sized for `calls` calls unless `capacity` is given), laid out as
  generate would (`timing_plan`) or as `layout` says ('stacked',
  'blocked', 'layered'); state[0] is the cache after the last call."""
  if position < 0 or steps < 1:
    raise ValueError(f"position must be >= 0 and steps >= 1, got {position},"
                     f" {steps}")
  need = position + steps * calls
  policy = cache_policy(kv_dtype)
  if not capacity:
    need = policy.round_capacity(need)
  capacity = capacity or need
  if capacity < need:
    raise ValueError(f"capacity={capacity} < {need} slots the run needs")
  state = [filled_cache(config, batch, capacity, position, policy)]
  params = packed.for_decode(params, config)  # the layout generate runs
  plan = timing_plan(params, config, policy, batch, position, steps,
                     need - position, capacity)
  if layout is not None:
    plan = decode.Plan(plan.schedule, layout)
  return (_loop_on(params, config, batch, state, steps, plan), state,
          capacity, plan)


def _loop_on(params, config: ModelConfig, batch: int, state, steps: int,
             plan: decode.Plan):
  """`run()` of a `_decode_runner`: `steps` steps of `decode_loop` from
  state[0], which it replaces with the cache after them."""
  params = packed.for_decode(params, config)
  tok = jnp.zeros((batch,), jnp.int32)

  def run():
    out, state[0] = decode_loop(params, config, tok, state[0], steps, plan)
    return out

  return run


def segment_copy_seconds(config: ModelConfig, batch: int, context: int, *,
                         steps: int = 32, kv_dtype: str = "float32",
                         layout: str = "native", warmup: int = 1,
                         repeats: int = 5) -> dict[str, Any]:
  """What a decode segment of `steps` steps over `context` cached tokens
  pays outside its steps, in `layout`'s view (`decode.segment_view`),
  timed alternating in one process: the copy in (what `from_cache` of the
  attended slots makes anew: inside one program, as in `generate`, a leaf
  the view passes through from the stacked cache is not copied), and the
  write back of the whole prefix or of the window its steps wrote
  (`into_cache` with None or `steps`) into the donated cache, as
  `generate` donates it; a view that reads the stacked cache in place is
  given the donated cache as its own, as a segment's steps leave it.

  Returns:
    {'copy_in', 'whole_back', 'window_back'}: Timing; attend; view_bytes
    (what the copy in makes anew); cache_bytes; in_place (the copy in
    makes less than 1 % of the cache anew: the view reads the stacked
    cache itself).
  Raises:
    ValueError: the layout has no view for this cache (`supports`).
  """
  view = decode.segment_view(layout, config.attention)
  policy = cache_policy(kv_dtype)
  attend = policy.round_capacity(-(-(context + steps) // decode.ATTEND_MIN)
                                 * decode.ATTEND_MIN)
  cache = filled_cache(config, batch, attend, context, policy)
  why = "no segment view" if view is None else view.supports(cache, attend)
  if why:
    raise ValueError(f"segment_copy_seconds: {layout} for {config.attention}"
                     f" {kv_dtype}: {why}")

  @jax.jit
  def copy_in(c):
    kept = {id(x) for x in jax.tree_util.tree_leaves(c)}
    return [x for x in jax.tree_util.tree_leaves(view.from_cache(c, attend))
            if id(x) not in kept]

  seg = jax.jit(view.from_cache, static_argnums=1)(cache, attend)
  holds_cache = isinstance(seg, layered.StackedSegment)

  def back_of(c, seg, n):
    if holds_cache:  # the stacked cache the segment read and wrote
      seg = seg.replace(stacked=c)
    return view.into_cache(c, seg, n)

  back = jax.jit(back_of, static_argnums=2, donate_argnums=0)
  state = [jax.tree_util.tree_map(jnp.copy, cache)]

  def write_back(n):
    def run():
      state[0] = back(state[0], seg, n)
      return state[0]
    return run

  made = tree_bytes(copy_in(cache))
  out = dict(attend=attend, cache_bytes=tree_bytes(cache), view_bytes=made,
             in_place=made < 0.01 * tree_bytes(cache))
  out.update(time_alternating(
      {"copy_in": lambda: copy_in(cache), "whole_back": write_back(None),
       "window_back": write_back(steps)}, warmup=warmup, repeats=repeats))
  return out


def decode_step_seconds(params, config: ModelConfig, batch: int,
                        position: int, *, steps: int = 8, warmup: int = 1,
                        repeats: int = 5, kv_dtype: str = "float32",
                        capacity: int | None = None) -> dict[str, Any]:
  """Per-step decode latency with `position` tokens already cached.

  Times `decode_loop` over `steps` steps (the loop `generate` runs, with
  the layout it would choose: `timing_plan`; no per-call dispatch) and
  divides by `steps`. The cache is sized to what the
  run needs unless `capacity` is given (attention reads every slot).

  Returns:
    step_s (median), Timing dict of the whole loops, capacity, tokens_per_s.
  """
  run, state, capacity, _ = _decode_runner(
      params, config, batch, position, steps, kv_dtype, capacity,
      warmup + repeats)
  t = time_fn(run, warmup=warmup, repeats=repeats)
  errors.raise_if_set(state[0], "decode_step_seconds")
  step = t.median / steps
  return dict(step_s=step, tokens_per_s=batch / step, capacity=capacity,
              loop=t.to_dict())


def decode_steps_alternating(params, config: ModelConfig, batch: int,
                             position: int, kv_dtypes, *, steps: int = 16,
                             warmup: int = 1, repeats: int = 5,
                             probe_bytes: int = 0, steady: bool = False
                             ) -> dict[str, dict[str, Any]]:
  """`decode_step_seconds` for several cache kinds, timed in alternating
  rounds (`time_alternating`), so that their ratios share the load drift.

  Why `steps` 16 by default: a timed loop is one decode segment, and a
  layered segment copies its cache in and out once (`kvjax.layered`); in
  generate a segment runs as many steps as it has slots to fill, so short
  timed loops would overstate that copy.

  With `probe_bytes`, the read probe (`read_probe`) of that size runs in
  the same rounds, so each point has its own bandwidth under the same load.

  With `steady`, each kind also runs loops of 2 · `steps` steps in the same
  rounds, and step_s is the difference, (median 2·steps loop - median
  steps loop) / steps: a step of a long segment, without the segment's
  copy of its cache in and out (which generate pays once per segment);
  segment_s is that copy (and the call), the steps loop less its steps.

  Returns:
    per kind: step_s (median), loop (Timing dict), layout (what the
    segment read), vs_first (median over rounds of the first kind's loop
    time / this kind's: its speed-up), rounds (those per-round ratios);
    with `steady` the step and the speed-up are the steady ones (vs_first:
    the first kind's step_s / this kind's; rounds: the per-round ratios of
    the longer loops), plus loop_step_s (the steps loop / steps), segment_s
    long_loop (Timing dict) and steady (False where the longer loop took
    no longer, the noise above a step's time: step_s is then loop_step_s,
    an upper bound, and segment_s NaN); with `probe_bytes` also
    "read_probe": bytes_per_s (median), nbytes.
  Raises:
    ValueError: no kinds.
  """
  kinds = list(kv_dtypes)
  if not kinds:
    raise ValueError("kv_dtypes is empty")
  # With `steady` the longer loops run on the same caches (one per kind,
  # not two: medium MHA at 8k holds 4.8 GB in float32), sized for both.
  calls = (3 if steady else 1) * (warmup + repeats)
  runners = {k: _decode_runner(params, config, batch, position, steps, k,
                               None, calls) for k in kinds}
  probe = read_probe(probe_bytes) if probe_bytes else None
  if steady:
    runners.update({_LONG + k: _longer_runner(runners[k], params, config,
                                              batch, 2 * steps)
                    for k in kinds})
  out = _time_runners(runners, steps, warmup, repeats, probe,
                      "decode_steps_alternating")
  if not steady:
    return out
  for k in kinds:
    short, long = out[k], out.pop(_LONG + k)
    step = (long["loop"]["median_s"] - short["loop"]["median_s"]) / steps
    # A longer loop that took no longer: the noise is above a step's time.
    # The point keeps the loop's time per step (an upper bound), marked.
    ok = step > 0
    short.update(loop_step_s=short["step_s"], steady=ok,
                 step_s=step if ok else short["step_s"],
                 segment_s=short["loop"]["median_s"] - steps * step
                 if ok else float("nan"), long_loop=long["loop"])
  first = out[kinds[0]]
  for k in kinds:
    out[k]["vs_first"] = first["step_s"] / out[k]["step_s"]
    out[k]["rounds"] = paired_ratios(first["long_loop"]["seconds"],
                                     out[k]["long_loop"]["seconds"])
  return out


_LONG = "2x:"  # `decode_steps_alternating`'s names of its longer loops


def _longer_runner(runner, params, config: ModelConfig, batch: int,
                   steps: int):
  """A `_decode_runner` of `steps` steps on `runner`'s cache, in its layout
  and attending its slots (the cache must have room for both runners'
  calls)."""
  _, state, capacity, plan = runner
  plan = decode.Plan(schedule=((steps, plan.schedule[0][1]),),
                     layout=plan.layout)
  return (_loop_on(params, config, batch, state, steps, plan), state,
          capacity, plan)


# Packed products an RMSNorm feeds (`projections`: norm_input=True).
_NORM_FED = ("qkv_t", "q_t", "q_a_t", "kv_a_t", "gate_up_t")


def _product_runner(weight, batch: int, reps: int, lm_head_of=None):
  """(run, multiply-adds per product): `run()` does `reps` products of
  `batch` rows by one packed weight inside one jitted scan (one dispatch
  for all of them, each on its own rows so none is folded away): [out, in]
  by `layers.linear_t`, per-head [N, out, in] by `linear_t_heads`, or the
  LM head by `projections.lm_head(*lm_head_of)`."""
  from kvjax import layers  # pylint: disable=g-import-not-at-top
  from kvjax import projections  # pylint: disable=g-import-not-at-top
  name, w = weight
  if lm_head_of is not None:
    params, config = lm_head_of
    shape = (reps, batch, 1, config.embed_dim)
    product = lambda x: projections.lm_head(params, x, config)
    macs = batch * int(np.prod(w.shape))
  elif w.ndim == 3:  # [N, out, in]
    shape = (reps, batch, w.shape[0], w.shape[2])
    product = lambda x: layers.linear_t_heads(x, w)
    macs = batch * int(np.prod(w.shape))
  else:
    shape = (reps, batch, w.shape[1])
    product = lambda x: layers.linear_t(x, w, norm_input=name in _NORM_FED)
    macs = batch * int(np.prod(w.shape))
  xs = jax.random.normal(jax.random.key(5), shape, w.dtype)
  loop = jax.jit(lambda xs: jax.lax.scan(
      lambda c, x: (c, product(x)), 0, xs)[1])
  return (lambda: loop(xs)), macs


def fixed_part(params, config: ModelConfig, batch: int, *,
               position: int = 16, steps: int = 32, reps: int = 8,
               warmup: int = 1, repeats: int = 5,
               probe_bytes: int = 1 << 29) -> dict[str, Any]:
  """What a decode step costs besides its cache: the step at a nearly
  empty cache, and each weight product in it timed alone.

  The step: `steps` greedy steps from `position` cached tokens in the
  layout generate reads (`_decode_runner`; its cache holds only what the
  loops write, a few hundred slots, so the kernel's read of it is small
  beside the weights'). The products: every packed weight of layer 0
  (every dense layer has the same shapes) and the LM head, `batch` rows
  each, as the packed layout runs them (`kvjax.projections`), `reps` of
  them per jitted call. Step, products and the read probe run in the
  same alternating rounds (`time_alternating`).

  Raises ValueError where generate does not decode this model packed
  (`packed.packs`: narrow models keep the layer scan) or has MoE layers
  (a step reads a few experts, not these shapes).

  Returns:
    batch, position, step_s; weight_bytes (what the step must read,
    `decode_weight_bytes`) and cache_bytes (the cache it reads: every
    slot of its capacity); read_probe (bytes_per_s); products: a list of
    {name, shape, count (per step), s (one product), bytes, bytes_per_s,
    of_read_probe, macs_per_s}; products_s (each product's time times its
    count, summed); rest_s (step_s - products_s: norms, rotary, attention
    over the small cache, sampling, the loop); weights_at_probe_s
    (weight_bytes at the probe's rate).
  """
  if batch < 1 or position < 0 or steps < 1 or reps < 1:
    raise ValueError(f"batch, steps and reps must be >= 1 and position >= "
                     f"0, got {batch}, {steps}, {reps}, {position}")
  if not packed.packs(params, config) and not packed.is_packed(params):
    raise ValueError(
        f"generate decodes this model in the canonical layout (embed_dim "
        f"{config.embed_dim} < packed.PACK_MIN_WIDTH "
        f"{packed.PACK_MIN_WIDTH}, or not on CPU): fixed_part times the "
        f"packed layout's products")
  if config.moe is not None:
    raise ValueError("fixed_part times dense layers; this model has MoE "
                     "layers")
  fast = packed.for_decode(params, config)
  layer = fast["layers"][0]
  weights = [(name, w) for group in ("attn", "mlp")
             for name, w in layer[group].items() if name.endswith("_t")]
  head_name = "embed" if config.tie_embeddings else "lm_head_t"
  runners = {name: _product_runner((name, w), batch, reps)
             for name, w in weights}
  runners[head_name] = _product_runner(
      (head_name, fast[head_name]), batch, reps, lm_head_of=(fast, config))
  step = _decode_runner(params, config, batch, position, steps, "float32",
                        None, warmup + repeats)
  probe = read_probe(probe_bytes)
  fns = {"step": step[0], "read_probe": probe[0],
         **{n: r[0] for n, r in runners.items()}}
  t = time_alternating(fns, warmup=warmup, repeats=repeats)
  errors.raise_if_set(step[1][0], "fixed_part")
  probe_rate = probe[1] / t["read_probe"].median
  shapes = dict(weights, **{head_name: fast[head_name]})
  products = []
  for name, (_, macs) in runners.items():
    w = shapes[name]
    one = t[name].median / reps
    nbytes = int(np.prod(w.shape)) * jnp.dtype(w.dtype).itemsize
    products.append(dict(
        name=name, shape=tuple(w.shape),
        count=1 if name == head_name else config.num_layers, s=one,
        bytes=nbytes, bytes_per_s=nbytes / one,
        of_read_probe=nbytes / one / probe_rate, macs_per_s=macs / one))
  step_s = t["step"].median / steps
  products_s = sum(p["s"] * p["count"] for p in products)
  weight_bytes = decode_weight_bytes(fast, config)
  return dict(batch=batch, position=position, step_s=step_s,
              capacity=step[2], weight_bytes=weight_bytes,
              cache_bytes=decode_bytes_per_step(
                  params, config, batch, step[2])["cache"],
              read_probe=dict(bytes_per_s=probe_rate, nbytes=probe[1]),
              products=products, products_s=products_s,
              rest_s=step_s - products_s,
              weights_at_probe_s=weight_bytes / probe_rate,
              layout=step[3].layout)


def decode_models_alternating(models, batch: int, position: int, *,
                              kv_dtype: str = "float32", steps: int = 16,
                              warmup: int = 1, repeats: int = 5,
                              probe_bytes: int = 0
                              ) -> dict[str, dict[str, Any]]:
  """Decode steps of several models at one (batch, position, kv dtype),
  timed in alternating rounds: which attention variant decodes faster where
  the cache dominates (`kvjax.lab.ablation`).

  Args:
    models: name -> (params, config); each runs in the layout generate
      reads (`timing_plan`).
  Returns:
    per name: as `decode_steps_alternating` per kind, plus bytes (what the
    step must read: `decode_bytes_per_step`) and, with `probe_bytes`,
    read_fraction (bytes / step_s / the probe's bytes per second in the
    same rounds); with `probe_bytes` also "read_probe".
  """
  if not models:
    raise ValueError("models is empty")
  runners = {n: _decode_runner(p, c, batch, position, steps, kv_dtype, None,
                               warmup + repeats)
             for n, (p, c) in models.items()}
  probe = read_probe(probe_bytes) if probe_bytes else None
  out = _time_runners(runners, steps, warmup, repeats, probe,
                      "decode_models_alternating")
  for n, (p, c) in models.items():
    nbytes = decode_bytes_per_step(p, c, batch, position + 1,
                                   kv_dtype)["total"]
    out[n]["bytes"] = nbytes
    if probe:
      out[n]["read_fraction"] = (nbytes / out[n]["step_s"] /
                                 out["read_probe"]["bytes_per_s"])
  return out


def _time_runners(runners, steps: int, warmup: int, repeats: int, probe,
                  who: str) -> dict[str, dict[str, Any]]:
  """Times `_decode_runner`s (and the read probe `(run, nbytes)`, if given)
  in alternating rounds; per runner step_s, loop (with its seconds),
  layout, capacity, vs_first and rounds (the first runner's loop time / this one's), plus
  "read_probe" with a probe. Raises if a run set an error bit."""
  fns = {n: r[0] for n, r in runners.items()}
  if probe:
    fns["read_probe"] = probe[0]
  t = time_alternating(fns, warmup=warmup, repeats=repeats)
  out = {}
  if probe:
    out["read_probe"] = dict(bytes_per_s=probe[1] / t["read_probe"].median,
                             nbytes=probe[1])
  first = next(iter(runners))
  for n, (_, state, capacity, plan) in runners.items():
    errors.raise_if_set(state[0], who)
    ratios = paired_ratios(t[first].seconds, t[n].seconds)
    out[n] = dict(step_s=t[n].median / steps,
                  loop=dict(t[n].to_dict(), seconds=t[n].seconds),
                  layout=plan.layout, capacity=capacity,
                  vs_first=statistics.median(ratios), rounds=ratios)
  return out


def decode_layouts_alternating(params, config: ModelConfig, batch: int,
                               position: int, combos, *, steps: int = 16,
                               warmup: int = 1, repeats: int = 5
                               ) -> dict[str, dict[str, Any]]:
  """Decode steps of (kv dtype, cache layout) `combos` timed in alternating
  rounds: which layout (`decode.DECODE_LAYOUTS` but 'auto') reads a cache
  fastest. A layout a cache cannot take raises before any timing
  (`decode.plan`'s reasons).

  Returns:
    per "kind:layout": as `decode_steps_alternating` per kind.
  """
  combos = [tuple(c) for c in combos]
  if not combos:
    raise ValueError("combos is empty")
  for kind, layout in combos:
    if layout not in decode.DECODE_LAYOUTS or layout == "auto":
      raise ValueError(f"layout={layout!r} is not one of "
                       f"{decode.DECODE_LAYOUTS[1:]}")
    decode.plan(packed.for_decode(params, config), config,
                cache_policy(kind), batch, position, steps,
                position + steps * (warmup + repeats), decode_layout=layout)
  runners = {f"{k}:{lay}": _decode_runner(params, config, batch, position,
                                          steps, k, None, warmup + repeats,
                                          lay) for k, lay in combos}
  return _time_runners(runners, steps, warmup, repeats, None,
                       "decode_layouts_alternating")


def no_cache_step_seconds(params, config: ModelConfig, batch: int,
                          position: int, *, warmup: int = 1,
                          repeats: int = 3) -> dict[str, Any]:
  """Latency of one no-cache step at `position`: the causal forward over the
  `position + 1` tokens seen so far (what `generate_no_cache` recomputes for
  every new token)."""
  from kvjax import inference  # pylint: disable=g-import-not-at-top
  T = position + 1
  tokens = jax.random.randint(jax.random.key(0), (batch, T), 0,
                              config.vocab_size)
  mask = jnp.ones((batch, T), bool)
  t = time_fn(lambda: inference._forward(params, config, tokens, mask),  # pylint: disable=protected-access
              warmup=warmup, repeats=repeats)
  return dict(step_s=t.median, timing=t.to_dict())


def generate_seconds(params, config: ModelConfig, tokens, new_tokens: int, *,
                     warmup: int = 1, repeats: int = 3, **kwargs) -> Timing:
  """Wall time of `kvjax.generate` (prefill + every decode step)."""
  from kvjax import inference  # pylint: disable=g-import-not-at-top
  return time_fn(lambda: inference.generate(params, config, tokens,
                                            new_tokens, **kwargs),
                 warmup=warmup, repeats=repeats)


def decode_throughput(params, config: ModelConfig, tokens, new_tokens: int,
                      *, warmup: int = 1, repeats: int = 3,
                      **kwargs) -> dict[str, Any]:
  """Decode tokens/s of `kvjax.generate`, prefill excluded.

  Times generate(new_tokens) and generate(1) (= prefill + first sample)
  alternately; decode time = the difference of the medians, for
  B·(new_tokens − 1) decoded tokens. The same definition is applied to
  transformers in `experiments/peer_benchmark.py`.
  """
  from kvjax import inference  # pylint: disable=g-import-not-at-top
  if new_tokens < 2:
    raise ValueError(f"new_tokens must be >= 2, got {new_tokens}")
  cap = inference.default_capacity(
      inference.bucket_length(tokens.shape[1]), new_tokens)
  kwargs.setdefault("capacity", cap)  # one cache size for both calls
  t = time_alternating(dict(
      generate=lambda: inference.generate(params, config, tokens, new_tokens,
                                          **kwargs),
      prefill=lambda: inference.generate(params, config, tokens, 1,
                                         **kwargs)),
                       warmup=warmup, repeats=repeats)
  decode_s = t["generate"].median - t["prefill"].median
  B = tokens.shape[0]
  n = B * (new_tokens - 1)
  return dict(tokens_per_s=n / decode_s, decode_s=decode_s,
              step_s=decode_s / (new_tokens - 1),
              generate=t["generate"].to_dict(), prefill=t["prefill"].to_dict())


def prefill_seconds(params, config: ModelConfig, batch: int, length: int, *,
                    warmup: int = 1, repeats: int = 3) -> dict[str, Any]:
  """Latency of the jitted prefill of [batch, length] into a fresh cache."""
  from kvjax import inference  # pylint: disable=g-import-not-at-top
  tokens = jax.random.randint(jax.random.key(0), (batch, length), 0,
                              config.vocab_size)
  mask = jnp.ones((batch, length), bool)
  caches = [cache_lib.init_cache(config, batch, length)
            for _ in range(warmup + repeats)]
  jax.block_until_ready(caches)

  params = packed.for_decode(params, config)  # what prefill runs

  def run():
    logits, _ = inference._prefill(params, config, tokens, mask,  # pylint: disable=protected-access
                                   caches.pop(), False)
    return logits

  t = time_fn(run, warmup=warmup, repeats=repeats)
  return dict(prefill_s=t.median, timing=t.to_dict())


def prefill_memory(params, config: ModelConfig, batch: int,
                   length: int, *, path: str | None = None) -> dict[str, int]:
  """XLA's memory analysis of the jitted prefill of [batch, length] into a
  fresh cache (lowered from shapes only: nothing is allocated or run).

  path: None (what `flash.use_tiles` chooses), 'dense' or 'tiled' (the
  attention forced to one path while the program is traced).
  """
  params = packed.for_decode(params, config)
  cache = jax.eval_shape(lambda: cache_lib.init_cache(config, batch, length))
  tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  mask = jax.ShapeDtypeStruct((batch, length), jnp.bool_)
  return compiled_memory(_lower_prefill(params, config, tokens, mask, cache,
                                        path))


def chunk_memory(params, config: ModelConfig, batch: int, length: int,
                 chunk: int, *, policy=None) -> dict[str, int]:
  """XLA's memory analysis of the last call of a chunked prefill
  (`kvjax.prefill_chunked`) of [batch, length] tokens: the extend of
  `chunk` tokens into a cache of `length` slots that holds the first
  length - chunk (lowered from shapes only). The cache is an argument and
  an output (donated); temporaries are what the call adds.
  """
  if not 0 < chunk < length:
    raise ValueError(f"chunk must be in (0, length={length}), got {chunk}")
  from kvjax import model  # pylint: disable=g-import-not-at-top
  params = packed.for_decode(params, config)
  cache = jax.eval_shape(lambda: cache_lib.init_cache(config, batch, length,
                                                      policy=policy))
  tokens = jax.ShapeDtypeStruct((batch, chunk), jnp.int32)
  mask = jax.ShapeDtypeStruct((batch, chunk), jnp.bool_)
  return compiled_memory(jax.jit(
      lambda p, t, m, c: model.extend_logits(p, config, t, m, c, False),
      donate_argnums=3).lower(params, tokens, mask, cache))


def _lower_prefill(params, config, tokens, mask, cache, path: str | None):
  """The jitted prefill body (last logits, the cache donated) lowered for
  these arguments (arrays or shapes), its attention forced to `path`."""
  from kvjax import model  # pylint: disable=g-import-not-at-top
  with _attention_path(path):
    # A fresh function: traces are cached per function object, so the
    # forced path would otherwise be ignored for a shape seen before.
    return jax.jit(lambda p, t, m, c: model.prefill_logits(
        p, config, t, m, c, False), donate_argnums=3).lower(
            params, tokens, mask, cache)


@contextlib.contextmanager
def _attention_path(path: str | None):
  """Forces prompt attention dense or tiled (`kvjax.flash`) while a
  program is traced inside the block; None leaves the default."""
  from kvjax import flash  # pylint: disable=g-import-not-at-top
  if path not in (None, "dense", "tiled"):
    raise ValueError(f"path={path!r} is not None, 'dense' or 'tiled'")
  default = flash.MIN_PAIRS
  if path is not None:
    flash.MIN_PAIRS = 0 if path == "tiled" else float("inf")
  try:
    yield
  finally:
    flash.MIN_PAIRS = default


def prefill_paths(params, config: ModelConfig, batch: int, length: int, *,
                  repeats: int = 3) -> dict[str, Any]:
  """The prefill of [batch, length] with its attention dense (every score
  of a query tile at once: `attention.attend`) and in tiles with an online
  softmax (`kvjax.flash`), timed in alternating rounds, whatever
  `flash.MIN_PAIRS` would choose; with XLA's memory analysis of each.

  Returns:
    {'dense': {...}, 'tiled': {...}}: seconds (median, timing) and memory
    (`compiled_memory`) per path, and 'chosen': the path `flash.use_tiles`
    takes at this length.
  """
  from kvjax import flash  # pylint: disable=g-import-not-at-top
  tokens = jax.random.randint(jax.random.key(0), (batch, length), 0,
                              config.vocab_size)
  mask = jnp.ones((batch, length), bool)
  params = packed.for_decode(params, config)
  cache = jax.eval_shape(lambda: cache_lib.init_cache(config, batch, length))
  compiled = {name: _lower_prefill(params, config, tokens, mask, cache,
                                   name).compile()
              for name in ("dense", "tiled")}
  memory = {name: compiled_memory(c) for name, c in compiled.items()}

  def runner(name):
    def run():
      cache = cache_lib.init_cache(config, batch, length)
      return compiled[name](params, tokens, mask, cache)[0]
    return run

  timed = time_alternating({n: runner(n) for n in compiled}, repeats=repeats)
  out = {n: dict(prefill_s=timed[n].median, tokens_per_s=batch * length /
                 timed[n].median, timing=timed[n].to_dict(),
                 memory=memory[n]) for n in compiled}
  out["chosen"] = ("tiled" if flash.use_tiles(length, length, False,
                                              config.attention_impl)
                   else "dense")
  return out


def prefill_scaling(params, config: ModelConfig, batch: int, lengths,
                    memory_lengths=(), *, repeats: int = 3) -> dict:
  """Prefill throughput against prompt length, and XLA's memory analysis
  of longer prefills.

  Returns:
    rows: per length, prefill seconds, tokens/s and tokens/s relative to
      the first length (the default path); memory: per memory length and
      attention path ('dense', 'tiled'), `prefill_memory`.
  """
  rows = []
  for n in lengths:
    t = prefill_seconds(params, config, batch, n, repeats=repeats)
    rows.append(dict(length=n, prefill_s=t["prefill_s"],
                     tokens_per_s=batch * n / t["prefill_s"],
                     timing=t["timing"]))
  for r in rows:
    r["relative"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
  memory = [dict(length=n, path=path,
                 **prefill_memory(params, config, batch, n, path=path))
            for n in memory_lengths for path in ("dense", "tiled")]
  return dict(batch=batch, rows=rows, memory=memory)


def plot_prefill(result: Mapping[str, Any], title: str, path) -> dict:
  """Prefill tokens/s against prompt length (`prefill_scaling`)."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6.4, 4.4))
  xs = [r["length"] for r in result["rows"]]
  ax.plot(xs, [r["tokens_per_s"] for r in result["rows"]], marker="o",
          label=f"batch {result['batch']}")
  ax.set_xscale("log")
  _tick_at(ax, xs)
  ax.set_ylim(bottom=0)
  ax.set_xlabel("prompt tokens")
  ax.set_ylabel("prefill tokens / s")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  return _save_figure(fig, path)


def no_cache_generate_seconds(params, config: ModelConfig, tokens,
                              new_tokens: int) -> dict[str, Any]:
  """Wall time of one `kvjax.generate_no_cache` run, compile excluded.

  The run is long (every step recomputes the whole history), so it is not
  repeated: every segment program it calls is compiled ahead (AOT, which
  fills the compilation cache) and the compile time is reported apart.
  Mirrors the segment schedule of `generate_no_cache` (bucket=True).
  """
  from kvjax import inference  # pylint: disable=g-import-not-at-top
  from kvjax.sampling import GREEDY  # pylint: disable=g-import-not-at-top
  B, T0 = tokens.shape
  T = inference.bucket_length(T0)
  total = T + new_tokens
  buf = jnp.zeros((B, total), jnp.int32)
  mask = jnp.ones((B, total), bool)
  t0 = time.perf_counter()
  done, segments = 0, []
  while done < new_tokens:
    length = T + done
    width = min(total, inference.bucket_length(length + 1))
    steps = min(new_tokens - done, width - length)
    keys = jax.random.split(jax.random.key(0), steps)
    inference._no_cache_segment.lower(  # pylint: disable=protected-access
        params, config, buf[:, :width], mask[:, :width], jnp.int32(length),
        keys, steps, GREEDY, False).compile()
    segments.append(dict(P=width, steps=steps))  # key P: the results' format
    done += steps
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  jax.block_until_ready(inference.generate_no_cache(params, config, tokens,
                                                    new_tokens))
  return dict(total_s=time.perf_counter() - t0, compile_s=compile_s,
              segments=segments)


# ---- plots of experiments/benchmark.py's modes --------------------------------
def step_ms_spread(timed: Mapping[str, Any]) -> tuple[float, float, float, int]:
  """(median, min, max) milliseconds per step and the repeat count of a
  `decode_step_seconds` (loop timings, scaled per step) or
  `no_cache_step_seconds` result."""
  loop = timed["loop"] if "loop" in timed else timed["timing"]
  per = timed["step_s"] / loop["median_s"]  # seconds per step / per loop
  med = 1e3 * timed["step_s"]
  # Clamped: min · per rounds above the median where they are equal.
  return (med, min(med, 1e3 * loop["min_s"] * per),
          max(med, 1e3 * loop["max_s"] * per), int(loop["repeats"]))


def _errorbar(ax, xs, timed, **kw):
  """One line of medians, error bars from each point's min to max."""
  m = np.array([step_ms_spread(t)[:3] for t in timed])
  ax.errorbar(xs, m[:, 0], yerr=[m[:, 0] - m[:, 1], m[:, 2] - m[:, 0]],
              capsize=2, **kw)
  return max(step_ms_spread(t)[3] for t in timed)


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def _tick_at(ax, xs) -> None:
  """Log x axis ticked at the measured points, labelled as plain numbers."""
  from matplotlib.ticker import NullFormatter  # pylint: disable=g-import-not-at-top
  xs = sorted(set(xs))
  ax.set_xticks(xs)
  ax.set_xticklabels([str(x) for x in xs])
  ax.xaxis.set_minor_formatter(NullFormatter())


def figure_labels(fig) -> dict[str, Any]:
  """The words a figure shows: its title, each panel's title and axis
  labels, and each legend's title and entries (what a test reads a plot
  by)."""
  axes = fig.get_axes()
  legends = list(fig.legends) + [ax.get_legend() for ax in axes
                                  if ax.get_legend() is not None]
  suptitle = fig.get_suptitle() if hasattr(fig, "get_suptitle") else ""
  return dict(
      suptitle=suptitle, titles=[ax.get_title() for ax in axes],
      xlabels=[ax.get_xlabel() for ax in axes],
      ylabels=[ax.get_ylabel() for ax in axes],
      legends={lg.get_title().get_text(): [t.get_text()
                                           for t in lg.get_texts()]
               for lg in legends})


def _save_figure(fig, path) -> dict[str, Any]:
  labels = figure_labels(fig)
  fig.savefig(path, dpi=120, bbox_inches="tight")
  _pyplot().close(fig)
  return labels


def plot_positions(result: Mapping[str, Any], path) -> dict[str, Any]:
  """Decode step time against position, with and without the cache
  (`positions.json`'s dict): medians, bars from min to max of the repeats."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6.4, 4.4))
  rows = result["rows"]
  xs = [r["position"] for r in rows]
  n = _errorbar(ax, xs, [r["cached"] for r in rows], marker="o",
                label="with KV cache")
  if all("no_cache" in r for r in rows):
    n_nc = _errorbar(ax, xs, [r["no_cache"] for r in rows], marker="s",
                     label="no cache (recompute the history)")
    n = f"{n} (cached) / {n_nc} (no cache)"
  ax.set(xscale="log", yscale="log", xlabel="position (tokens already cached)",
         ylabel="milliseconds per decode step",
         title=f"{result['preset']}, batch {result['batch']}: medians of {n} "
         "timed repeats,\nbars: min-max of the repeats")
  _tick_at(ax, xs)
  ax.grid(alpha=0.3, which="both")
  ax.legend()
  return _save_figure(fig, path)


def plot_variants(result: Mapping[str, Any], path) -> dict[str, Any]:
  """Decode step time against position per attention variant
  (`variants.json`'s dict): medians, bars from min to max of the repeats."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7.5, 4.4))
  n = 0
  for label, row in result["variants"].items():
    n = max(n, _errorbar(ax, result["positions"], row["steps"], marker="o",
                         label=f"{label} ({row['kv_bytes_per_token']:,} B/token)"))
  ax.set(xscale="log", xlabel="position (tokens already cached)",
         ylabel="milliseconds per decode step",
         title=f"{result['size']} presets, batch {result['batch']}: medians of "
         f"{n} timed repeats, bars: min-max")
  _tick_at(ax, result["positions"])
  ax.grid(alpha=0.3, which="both")
  ax.legend(title="variant (KV bytes per token)", fontsize=8,
            loc="upper left", bbox_to_anchor=(1.01, 1))
  return _save_figure(fig, path)


def plot_sweep(result: Mapping[str, Any], path) -> dict[str, Any]:
  """Decode step time against context, one panel per batch (`sweep.json`'s
  dict): colour = attention variant, line style and marker = cache kind;
  medians, bars from min to max of the repeats; two legends beside the
  panels instead of one entry per (variant, kind). With the run's read
  probe, a last panel plots every point's step time against the bytes it
  must read, beside the times the probe's bandwidth (and 60 % of it) would
  take: the cache-bytes law."""
  from matplotlib.lines import Line2D  # pylint: disable=g-import-not-at-top
  plt = _pyplot()
  rows = result["rows"]
  variants = list(dict.fromkeys(r["variant"] for r in rows))
  kinds = list(dict.fromkeys(r["kv_dtype"] for r in rows))
  batches = result["batches"]
  styles = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1)))
  markers = ("o", "s", "^", "D", "v", "P")
  probe = result.get("read_probe", {}).get("bytes_per_s")
  panels = len(batches) + (1 if probe else 0)
  fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.4),
                           squeeze=False, sharey=True)
  n = 0
  if probe:  # the cache-bytes law: time against the bytes a step must read
    ax = axes[0][-1]
    for vi, variant in enumerate(variants):
      for ki, kind in enumerate(kinds):
        mine = [r for r in rows if r["variant"] == variant and
                r["kv_dtype"] == kind]
        ax.plot([r["bytes"]["total"] / 1e6 for r in mine],
                [1e3 * r["step_s"] for r in mine], ls="none",
                color=f"C{vi}", marker=markers[ki % len(markers)], ms=4,
                alpha=0.8)
    mb = sorted(r["bytes"]["total"] / 1e6 for r in rows)
    for frac, ls in ((1.0, "-"), (0.6, "--")):
      ax.plot([mb[0], mb[-1]], [x * 1e9 / (frac * probe) for x in
                                (mb[0], mb[-1])], color="gray", ls=ls,
              lw=1, label=f"{frac:.0%} of the read probe "
                          f"({probe / 1e9:.1f} GB/s)")
    ax.set(xscale="log", yscale="log", xlabel="MB a step must read "
           "(weights + cache)", title="every batch and context")
    _tick_at(ax, [x for x in (25, 50, 100, 200, 400, 800, 1600, 3200,
                              6400) if mb[0] / 2 <= x <= mb[-1] * 2])
    ax.grid(alpha=0.3, which="both")
    ax.legend(title="time to read them at", fontsize=7, loc="lower right")
  for ax, B in zip(axes[0], batches):
    for vi, variant in enumerate(variants):
      for ki, kind in enumerate(kinds):
        mine = [r for r in rows if r["variant"] == variant and
                r["kv_dtype"] == kind and r["batch"] == B]
        if not mine:
          continue
        timed = [dict(step_s=r["step_s"], loop=r["loop"]) if "loop" in r
                 else dict(step_s=r["step_s"], loop=dict(
                     median_s=r["step_s"], min_s=r["step_s"],
                     max_s=r["step_s"], repeats=1)) for r in mine]
        n = max(n, _errorbar(ax, [r["context"] for r in mine], timed,
                             color=f"C{vi}", ls=styles[ki % len(styles)],
                             marker=markers[ki % len(markers)], ms=3, lw=1.2))
    ax.set(xscale="log", yscale="log", xlabel="context (tokens cached)",
           title=f"batch {B}")
    _tick_at(ax, result["contexts"])
    ax.grid(alpha=0.3, which="both")
  axes[0][0].set_ylabel("milliseconds per decode step")
  by_variant = [Line2D([], [], color=f"C{i}", lw=2, label=v)
                for i, v in enumerate(variants)]
  by_kind = [Line2D([], [], color="black", ls=styles[i % len(styles)],
                    marker=markers[i % len(markers)], ms=4, label=k)
             for i, k in enumerate(kinds)]
  fig.suptitle(f"{result['size']} presets: decode step time against context; "
               f"medians of {n} timed repeats, bars: min-max", fontsize=10)
  fig.tight_layout()
  fig.legend(handles=by_variant, title="variant (colour)", fontsize=8,
             loc="upper left", bbox_to_anchor=(1.0, 0.92))
  fig.legend(handles=by_kind, title="cache (line)", fontsize=8,
             loc="lower left", bbox_to_anchor=(1.0, 0.12))
  return _save_figure(fig, path)


def plot_segment_copies(rows: Sequence[Mapping[str, Any]], path
                        ) -> dict[str, Any]:
  """A decode segment's copies per point (`experiments/segment_copy.py`'s
  rows, `segment_copy_seconds` each): bars of the copy in, the whole
  prefix written back and the window written back, medians in ms."""
  plt = _pyplot()
  parts = (("copy_in", "copy in (from_cache)"),
           ("whole_back", "whole prefix back"),
           ("window_back", "window back (the steps' slots)"))
  fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows)), 4.2))
  width = 0.8 / len(parts)
  for i, (key, label) in enumerate(parts):
    ms = [1e3 * statistics.median(r[key].seconds) for r in rows]
    ax.bar([j + (i - 1) * width for j in range(len(rows))], ms, width,
           label=label)
  ax.set_xticks(range(len(rows)))
  ax.set_xticklabels([f"{r['preset']} {r['kv_dtype']}\n{r['layout']}, "
                      f"{r['context'] // 1024}k"
                      + (", in place" if r["in_place"] else "")
                      for r in rows], fontsize=7)
  ax.set(ylabel="milliseconds per segment",
         title=f"a decode segment's copies, batch {rows[0]['batch']}, "
         f"{rows[0]['steps']} steps (medians)")
  ax.grid(alpha=0.3, axis="y")
  ax.legend(fontsize=8)
  return _save_figure(fig, path)
