"""Long-stream evaluation: a model reads a stream far longer than its cache.

StreamingLLM (Xiao et al. 2023) compares, at equal cache capacity S:

  dense      an unbounded cache (every past token kept)
  window     a rolling cache of the last S tokens
  sinks      the first `num_sinks` tokens pinned + a rolling window
  recompute  for every token, a fresh forward over the last S tokens
  h2o        heavy hitters + a recent window (Zhang et al. 2023)

Every cached policy here runs the library's own decode step (the one
`kvjax.decode_step` jits) token by token inside a `lax.scan` over a chunk of
tokens: one compilation per (config, policy, capacity, chunk), however long
the stream. The per-token negative log-likelihood (NLL, nats) of token t+1
given tokens <= t is returned for every t, so perplexity can be read against
position. Two faster, mathematically equal paths exist for the policies that
allow them (tested equal to the token-by-token path):

  extend_nll     chunks of T tokens through `extend` (dense, and window /
                 sinks in `original` position mode)
  recompute_nll  the recompute baseline, many windows per call (`lax.map`)

Dimension alphabet (as in `kvjax.config`): B batch, N stream length, T chunk
length, S cache slots, V vocab, W recompute window, M positions per call.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from typing import Callable

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import inference
from kvjax import model
from kvjax.config import ModelConfig

DENSE = "dense"
RECOMPUTE = "recompute"


# ---- the per-token loss ------------------------------------------------------
def token_nll(logits_BV, targets_B):
  """-log p(target) in float32 (logits [..., V], targets [...] int)."""
  logits = logits_BV.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets_B[..., None], axis=-1)[..., 0]
  return lse - picked


def _as_BN(tokens) -> np.ndarray:
  t = np.asarray(tokens)
  return t[None] if t.ndim == 1 else t


# ---- token-by-token decode over a chunk (the cached policies) ---------------
@functools.partial(jax.jit, static_argnames=("config", "want_logits"),
                   donate_argnames=("cache",))
def _decode_scan(params, config, tokens_BT, targets_BT, cache, want_logits):
  """T decode steps in one `lax.scan`. Returns (nll_BT, logits_BTV|None,
  cache)."""

  def body(cache, xs):
    tok_B, tgt_B = xs
    logits_BV, cache = model.decode_logits(params, config, tok_B, cache)
    # NaN unless every logit is finite: a finite NLL certifies the step.
    ok_B = jnp.all(jnp.isfinite(logits_BV), axis=-1)
    nll_B = jnp.where(ok_B, token_nll(logits_BV, tgt_B), jnp.nan)
    return cache, (nll_B, logits_BV if want_logits else None)

  cache, (nll_TB, logits_TBV) = jax.lax.scan(
      body, cache, (tokens_BT.T, targets_BT.T))
  logits_BTV = None if logits_TBV is None else jnp.swapaxes(logits_TBV, 0, 1)
  return nll_TB.T, logits_BTV, cache


def _check_stream(params, config, tokens_BN, cache, what):
  del params
  inference.check_tokens(tokens_BN, config, name=what)
  inference._check_cache(cache, config, tokens_BN.shape[0])  # pylint: disable=protected-access


def decode_tokens(params, config: ModelConfig, tokens_BT, cache):
  """Feeds T tokens per sequence one at a time (teacher forcing).

  Equal to T calls of `kvjax.decode_step`, compiled once as a `lax.scan`.

  Args:
    tokens_BT: [B, T] int ids.
    cache: any cache (donated); its policy decides what is evicted.
  Returns:
    (logits [B, T, V]: after token t, the prediction of token t+1; new cache)
  """
  tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
  _check_stream(params, config, tokens_BT, cache, "tokens")
  inference._check_fits(cache, tokens_BT.shape[1], fresh=False,  # pylint: disable=protected-access
                        what="decode_tokens")
  _, logits, cache = _decode_scan(params, config, tokens_BT, tokens_BT, cache,
                                  True)
  return logits, cache


def _chunks(n: int, chunk: int):
  """(start, stop) of consecutive chunks covering [0, n)."""
  return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def stream_nll(params, config: ModelConfig, tokens, cache, *,
               chunk: int = 512, log_every: int = 0):
  """Per-token NLL of a stream read token by token through `cache`.

  Args:
    tokens: [N] or [B, N] int ids (N >= 2).
    cache: a fresh cache (donated) of any policy and capacity S; N may be
      far larger than S when the policy evicts.
    chunk: tokens per compiled scan (a last, shorter chunk compiles once
      more).
    log_every: log progress every this many tokens (0: never).
  Returns:
    (nll [B, N-1] float32 numpy: nll[:, t] = -log p(tokens[:, t+1] |
     tokens[:, :t+1]), NaN where any logit of that step is not finite; the
     cache after the first N-1 tokens)
  """
  tokens_BN = _as_BN(tokens).astype(np.int32)
  if tokens_BN.shape[1] < 2:
    raise ValueError(f"tokens: a stream needs N >= 2 tokens, got "
                     f"{tokens_BN.shape[1]}")
  if chunk < 1:
    raise ValueError(f"chunk must be >= 1, got {chunk}")
  _check_stream(params, config, tokens_BN, cache, "tokens")
  n = tokens_BN.shape[1] - 1
  inference._check_fits(cache, n, fresh=False, what="stream_nll")  # pylint: disable=protected-access
  out, logged = [], 0
  for start, stop in _chunks(n, chunk):
    nll, _, cache = _decode_scan(params, config, tokens_BN[:, start:stop],
                                 tokens_BN[:, start + 1:stop + 1], cache,
                                 False)
    out.append(np.asarray(nll))
    if log_every and stop - logged >= log_every:
      logged = stop
      logging.info("stream_nll %s: %d/%d tokens, mean nll %.4f",
                    cache.policy.eviction, stop, n,
                    float(np.mean(np.concatenate(out, axis=1))))
  return np.concatenate(out, axis=1), cache


# ---- the parallel path (chunks through `extend`) ------------------------------
@functools.partial(jax.jit, static_argnames=("config",),
                   donate_argnames=("cache",))
def _extend_nll(params, config, tokens_BT, targets_BT, cache):
  mask_BT = jnp.ones(tokens_BT.shape, bool)
  logits_BTV, cache = model.extend_logits(params, config, tokens_BT, mask_BT,
                                          cache, True)
  return token_nll(logits_BTV, targets_BT), cache


def extend_nll(params, config: ModelConfig, tokens, cache, *,
               chunk: int = 256, log_every: int = 0):
  """`stream_nll` computed T tokens at a time through `extend`.

  Each chunk attends to the cached tokens and to itself in one parallel pass
  (the `visible` mask reproduces what token-by-token eviction would show),
  so this is much faster than `stream_nll` and equal to it (tested). Only
  for eviction none / window / sinks with positions='original': h2o's
  victims and cache-position ranks change with every token.

  Args / Returns: as `stream_nll`.
  """
  tokens_BN = _as_BN(tokens).astype(np.int32)
  policy = cache.policy
  if policy.eviction == "h2o" or policy.positions == "cache":
    raise ValueError(
        f"extend_nll needs eviction in none/window/sinks and positions="
        f"'original', got eviction={policy.eviction!r}, positions="
        f"{policy.positions!r}; use stream_nll")
  if tokens_BN.shape[1] < 2:
    raise ValueError(f"tokens: a stream needs N >= 2 tokens, got "
                     f"{tokens_BN.shape[1]}")
  if chunk < 1:
    raise ValueError(f"chunk must be >= 1, got {chunk}")
  _check_stream(params, config, tokens_BN, cache, "tokens")
  n = tokens_BN.shape[1] - 1
  inference._check_fits(cache, n, fresh=False, what="extend_nll")  # pylint: disable=protected-access
  out, logged = [], 0
  for start, stop in _chunks(n, chunk):
    nll, cache = _extend_nll(params, config, tokens_BN[:, start:stop],
                             tokens_BN[:, start + 1:stop + 1], cache)
    out.append(np.asarray(nll))
    if log_every and stop - logged >= log_every:
      logged = stop
      logging.info("extend_nll %s: %d/%d tokens", policy.eviction, stop, n)
  return np.concatenate(out, axis=1), cache


# ---- sliding window with recompute -------------------------------------------
@functools.partial(jax.jit,
                   static_argnames=("config", "window", "micro_batch"))
def _recompute_nll(params, config, tokens_BN, t_M, window, micro_batch):
  """NLL of token t+1 from a fresh forward over tokens (t-W, t], [M, B]."""
  offsets_W = jnp.arange(window, dtype=jnp.int32) - (window - 1)

  def one(t):
    idx_W = t + offsets_W
    ctx_BW = jnp.take(tokens_BN, jnp.maximum(idx_W, 0), axis=1)
    # Windows that start before the stream are left-padded; positions are
    # re-indexed from 0 at the window's first real token.
    mask_BW = jnp.broadcast_to(idx_W >= 0, ctx_BW.shape)
    step = model.forward_step(config, mask_BW)
    x_BWD, _ = model.run_layers(params, model.embed(params, ctx_BW, config),
                                step, None, config)
    logits_BV = model.unembed(params, x_BWD[:, -1:], config)[:, 0]
    target_B = jax.lax.dynamic_index_in_dim(tokens_BN, t + 1, axis=1,
                                            keepdims=False)
    return token_nll(logits_BV, target_B)

  return jax.lax.map(one, t_M, batch_size=micro_batch)


def recompute_nll(params, config: ModelConfig, tokens, window: int, *,
                  block: int = 1024, micro_batch: int = 64,
                  log_every: int = 0):
  """The 'sliding window with recompute' baseline.

  For every t the last `window` tokens (t-W, t] are run through a fresh,
  cache-free forward with positions 0..W-1, and token t+1 is scored: O(W)
  model tokens (and O(W^2) attention) per scored token. A cached window of
  capacity W attends to the same W tokens, but their keys were computed
  from older contexts; the two agree exactly only for one-layer models.

  Args:
    tokens: [N] or [B, N] int ids.
    window: W >= 1, tokens of context per prediction (the current included).
    block: positions per compiled call (the last block is padded).
    micro_batch: windows computed together inside a call (`lax.map`
      batch size); 1 gives the sequential per-token cost.
  Returns:
    nll [B, N-1] float32 numpy, aligned with `stream_nll`.
  """
  tokens_BN = _as_BN(tokens).astype(np.int32)
  if window < 1:
    raise ValueError(f"window must be >= 1, got {window}")
  if block < 1 or micro_batch < 1:
    raise ValueError(f"block and micro_batch must be >= 1, got {block}, "
                     f"{micro_batch}")
  if tokens_BN.shape[1] < 2:
    raise ValueError(f"tokens: a stream needs N >= 2 tokens, got "
                     f"{tokens_BN.shape[1]}")
  inference.check_tokens(tokens_BN, config)
  n = tokens_BN.shape[1] - 1
  block = min(block, n)
  micro_batch = min(micro_batch, block)
  stream = jnp.asarray(tokens_BN)
  out, logged = [], 0
  for start, stop in _chunks(n, block):
    # A fixed block shape: the last block repeats its final position.
    t_M = np.minimum(np.arange(start, start + block), n - 1).astype(np.int32)
    nll_MB = _recompute_nll(params, config, stream, t_M, window, micro_batch)
    out.append(np.asarray(nll_MB)[:stop - start].T)
    if log_every and stop - logged >= log_every:
      logged = stop
      logging.info("recompute_nll W=%d: %d/%d tokens", window, stop, n)
  return np.concatenate(out, axis=1)


# ---- policies by name -----------------------------------------------------------
_NAME = re.compile(r"^(dense|window|sinks(\d+)|h2o|recompute)"
                   r"(?::(original|cache))?$")


@dataclasses.dataclass(frozen=True)
class StreamPolicy:
  """One row of the streaming table.

  name: e.g. 'dense', 'window', 'sinks4', 'sinks4:original', 'h2o',
    'h2o:original', 'recompute'. Sinks and h2o default to cache positions
    (StreamingLLM's choice), window and dense to original positions.
  policy: the CachePolicy (None for recompute).
  capacity: cache slots (the stream length for dense; the recompute window).
  """

  name: str
  policy: cache_lib.CachePolicy | None
  capacity: int

  @property
  def fast_path(self) -> bool:
    """Whether `extend_nll` (parallel chunks) computes this row exactly."""
    p = self.policy
    return (p is not None and p.eviction != "h2o" and
            p.positions == "original")


def parse_policy(name: str, capacity: int, stream_len: int,
                 h2o_recent: int = 0) -> StreamPolicy:
  """A table row from its name (see `StreamPolicy`).

  Args:
    capacity: S, equal for every bounded row (and the recompute window).
    stream_len: N; the dense cache gets N slots.
    h2o_recent: h2o's always-kept recent tokens (0: capacity // 2).
  """
  m = _NAME.match(name)
  if not m:
    raise ValueError(
        f"policy name {name!r} is not one of dense, window, sinks<n>, h2o, "
        "recompute (optionally ':original' or ':cache')")
  kind, sinks, positions = m.group(1), m.group(2), m.group(3)
  if kind == RECOMPUTE:
    if positions:
      raise ValueError(f"policy {name!r}: recompute has no position mode "
                       "(its windows always start at position 0)")
    if capacity < 1:
      raise ValueError(f"capacity must be >= 1, got {capacity}")
    return StreamPolicy(name, None, capacity)
  if kind == DENSE:
    pol = cache_lib.CachePolicy(positions=positions or "original")
    return StreamPolicy(name, pol, stream_len)
  if kind == "window":
    pol = cache_lib.CachePolicy("window", positions=positions or "original")
  elif kind == "h2o":
    pol = cache_lib.CachePolicy(
        "h2o", recent=h2o_recent or max(capacity // 2, 1),
        positions=positions or "cache")
  else:
    pol = cache_lib.CachePolicy("sinks", num_sinks=int(sinks),
                                positions=positions or "cache")
  pol.validate_capacity(capacity)
  return StreamPolicy(name, pol, capacity)


def evaluate(params, config: ModelConfig, tokens, row: StreamPolicy, *,
             chunk: int = 512, micro_batch: int = 64, log_every: int = 0):
  """Per-token NLL [B, N-1] of one table row, by its fastest exact path."""
  if row.policy is None:
    return recompute_nll(params, config, tokens, row.capacity,
                         micro_batch=micro_batch, log_every=log_every)
  tokens_BN = _as_BN(tokens)
  cache = cache_lib.init_cache(config, tokens_BN.shape[0], row.capacity,
                               policy=row.policy)
  fn = extend_nll if row.fast_path else stream_nll
  nll, _ = fn(params, config, tokens_BN, cache, chunk=chunk,
              log_every=log_every)
  return nll


# ---- summaries ------------------------------------------------------------------
def perplexity(nll) -> float:
  """exp(mean NLL) over every scored token."""
  return float(np.exp(np.mean(np.asarray(nll, np.float64))))


def perplexity_by_position(nll, bin_size: int):
  """Perplexity in consecutive bins of positions (averaged over the batch).

  Args:
    nll: [B, N-1] or [N-1].
    bin_size: positions per bin (a last partial bin is dropped).
  Returns:
    (centres [nb] (position of the predicted token), ppl [nb]) numpy.
  """
  nll = np.asarray(nll, np.float64)
  nll = nll.reshape(-1, nll.shape[-1]).mean(axis=0)
  nb = len(nll) // bin_size
  if nb < 1:
    raise ValueError(f"bin_size={bin_size} exceeds the {len(nll)} positions")
  bins = nll[:nb * bin_size].reshape(nb, bin_size)
  # nll[t] scores the token at position t + 1.
  centres = np.arange(nb) * bin_size + (bin_size + 1) / 2
  return centres, np.exp(bins.mean(axis=1))


# ---- per-token latency ---------------------------------------------------------
def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def time_decode_per_token(params, config: ModelConfig, policy, capacity: int,
                          tokens, *, steps: int = 64, repeats: int = 5):
  """Seconds per token of the cached decode at batch 1, cache full.

  The cache is first filled with `capacity` tokens (so every timed step
  evicts), then a compiled scan of `steps` decode steps is timed (median of
  `repeats`, after a warm-up call) and divided by `steps`.

  Args:
    tokens: [N] ids with N >= capacity + steps * (repeats + 1).
  """
  tokens = np.asarray(tokens, np.int32).reshape(-1)
  need = capacity + steps * (repeats + 1)
  if tokens.shape[0] < need:
    raise ValueError(f"tokens: timing needs {need} tokens, got "
                     f"{tokens.shape[0]}")
  cache = cache_lib.init_cache(config, 1, capacity, policy=policy)
  _, cache = stream_nll(params, config, tokens[None, :capacity + 1], cache,
                        chunk=capacity)
  state = dict(cache=cache, at=capacity)

  def run():
    a = state["at"]
    seg = jnp.asarray(tokens[None, a:a + steps + 1])
    nll, _, state["cache"] = _decode_scan(params, config, seg[:, :-1],
                                          seg[:, 1:], state["cache"], False)
    state["at"] = a + steps
    return nll

  jax.block_until_ready(run())  # compile + warm up
  return _median_seconds(run, repeats) / steps


def time_recompute_per_token(params, config: ModelConfig, window: int,
                             tokens, *, steps: int = 16, repeats: int = 5):
  """Seconds per token of the recompute baseline at batch 1 (one window at a
  time: `micro_batch=1`), at positions >= window (full windows)."""
  tokens = np.asarray(tokens, np.int32).reshape(-1)
  if tokens.shape[0] < window + steps + 1:
    raise ValueError(f"tokens: timing needs {window + steps + 1} tokens, got "
                     f"{tokens.shape[0]}")
  stream = jnp.asarray(tokens[None])
  t_M = jnp.arange(window, window + steps, dtype=jnp.int32)

  def run():
    return _recompute_nll(params, config, stream, t_M, window, 1)

  jax.block_until_ready(run())
  return _median_seconds(run, repeats) / steps


# ---- memory against tokens --------------------------------------------------------
def memory_trace(params, config: ModelConfig, tokens, cache, *,
                 every: int):
  """Cache bytes read from the real arrays while a stream is decoded.

  Args:
    tokens: [N] or [B, N] ids, fed token by token (`decode_tokens` chunks of
      `every`).
    cache: a fresh cache (donated).
    every: record after every this many tokens.
  Returns:
    (list of dicts {tokens, used, kv, total, filled_slots} starting with the
     empty cache, final cache). `used` counts the slots holding a token,
     `kv` what is allocated (see `kvjax.cache_bytes`).
  """
  tokens_BN = _as_BN(tokens).astype(np.int32)
  if every < 1:
    raise ValueError(f"every must be >= 1, got {every}")

  def record(seen, cache):
    b = cache_lib.cache_bytes(cache)
    return dict(tokens=seen, filled_slots=int(jnp.sum(cache.positions >= 0)),
                **b)

  trace = [record(0, cache)]
  n = tokens_BN.shape[1]
  _check_stream(params, config, tokens_BN, cache, "tokens")
  inference._check_fits(cache, n, fresh=False, what="memory_trace")  # pylint: disable=protected-access
  for start, stop in _chunks(n, every):
    seg = tokens_BN[:, start:stop]
    _, _, cache = _decode_scan(params, config, seg, seg, cache, False)
    trace.append(record(stop, cache))
  return trace, cache
