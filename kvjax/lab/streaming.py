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

Dimension alphabet (as in `kvjax.config`): B batch, T' the stream's length
(`t` in names: `tokens_Bt`), T the tokens of one call (a chunk; a recompute
window), S cache slots, V vocab, I the positions one `lax.map` call scores.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import decode
from kvjax import policies
from kvjax import probe
from kvjax import errors
from kvjax import inference
from kvjax import model
from kvjax import packed
from kvjax import params as params_lib
from kvjax.config import ModelConfig
from kvjax.train import token_nll

DENSE = "dense"
RECOMPUTE = "recompute"


def _as_Bt(tokens) -> np.ndarray:
  t = np.asarray(tokens)
  return t[None] if t.ndim == 1 else t


# ---- token-by-token decode over a chunk (the cached policies) ---------------
def _plan(params, config, tokens_BT, cache) -> decode.Plan:
  """The layout generate would read for T steps over the whole cache
  (`decode.plan` without attention buckets): an int8 cache is evaluated
  through the integer attention generate runs (`kvjax.layered`)."""
  return decode.plan(params, config, cache.policy, tokens_BT.shape[0], 0,
                     tokens_BT.shape[1], cache.capacity,
                     attend_buckets=False)


@functools.partial(jax.jit, static_argnames=("config", "want_logits",
                                             "plan"),
                   donate_argnames=("cache",))
def _decode_scan(params, config, tokens_BT, targets_BT, cache, want_logits,
                 plan=decode.Plan()):
  """T teacher-forced steps of the decode loop (`kvjax.decode.run`, laid
  out by `plan`). Returns (nll_BT, logits_BTV|None, cache)."""
  T = tokens_BT.shape[1]
  # Step t feeds tokens[t]; the loop's "next token" is the given tokens[t+1]
  # (the last one is never fed).
  next_TB = jnp.concatenate([tokens_BT.T[1:], tokens_BT.T[-1:]], axis=0)

  def emit(logits_BV, nxt_B, x, cache):
    del nxt_B, cache
    tgt_B, _ = x
    # NaN unless every logit is finite: a finite NLL certifies the step.
    ok_B = jnp.all(jnp.isfinite(logits_BV), axis=-1)
    nll_B = jnp.where(ok_B, token_nll(logits_BV, tgt_B), jnp.nan)
    return nll_B, logits_BV if want_logits else None

  _, cache, (nll_TB, logits_TBV) = decode.run(
      params, config, tokens_BT[:, 0], cache, (targets_BT.T, next_TB),
      choose=lambda logits_BV, x: x[1], emit=emit, n=T, plan=plan)
  logits_BTV = None if logits_TBV is None else jnp.swapaxes(logits_TBV, 0, 1)
  return nll_TB.T, logits_BTV, cache


def _check_stream(params, config, tokens_Bt, cache, what):
  """Host-side validation before any compute (ValueError naming the
  problem), as the public API does. Returns the params to run
  (`packed.for_decode`)."""
  params_lib.check_params(params, config)
  inference.check_tokens(tokens_Bt, config, name=what)
  inference._check_cache(cache, config, tokens_Bt.shape[0])  # pylint: disable=protected-access
  errors.raise_if_set(cache, "the cache passed in")
  return packed.for_decode(params, config)


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
  params = _check_stream(params, config, tokens_BT, cache, "tokens")
  inference._check_fits(cache, tokens_BT.shape[1], fresh=False,  # pylint: disable=protected-access
                        what="decode_tokens")
  _, logits, cache = _decode_scan(params, config, tokens_BT, tokens_BT, cache,
                                  True, _plan(params, config, tokens_BT,
                                              cache))
  errors.raise_if_set(cache, "decode_tokens")
  return logits, cache


def _chunks(n: int, chunk: int):
  """(start, stop) of consecutive chunks covering [0, n)."""
  return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def _stream_inputs(params, config, tokens, cache, chunk: int, what: str):
  """Validates a scored stream before any compute; returns (the params to
  run, int32 tokens [B, T'], n = T' - 1 scored positions)."""
  tokens_Bt = _as_Bt(tokens).astype(np.int32)
  if tokens_Bt.shape[1] < 2:
    raise ValueError(f"tokens: a stream needs at least 2 tokens, got "
                     f"{tokens_Bt.shape[1]}")
  if chunk < 1:
    raise ValueError(f"chunk must be >= 1, got {chunk}")
  params = _check_stream(params, config, tokens_Bt, cache, "tokens")
  n = tokens_Bt.shape[1] - 1
  inference._check_fits(cache, n, fresh=False, what=what)  # pylint: disable=protected-access
  return params, tokens_Bt, n


def stream_nll(params, config: ModelConfig, tokens, cache, *,
               chunk: int = 512, log_every: int = 0):
  """Per-token NLL of a stream read token by token through `cache`.

  Args:
    tokens: [T'] or [B, T'] int ids (T' >= 2).
    cache: a cache (donated; fresh, or holding a prefix to continue) of any
      policy and capacity S; T' may be far larger than S when it evicts.
    chunk: tokens per compiled scan (a last, shorter chunk compiles once
      more).
    log_every: log progress every this many tokens (0: never).
  Returns:
    (nll [B, T'-1] float32 numpy: nll[:, t] = -log p(tokens[:, t+1] |
     tokens[:, :t+1]), NaN where any logit of that step is not finite; the
     cache after the first T'-1 tokens)
  """
  params, tokens_Bt, n = _stream_inputs(params, config, tokens, cache,
                                        chunk, "stream_nll")
  out, logged = [], 0
  for start, stop in _chunks(n, chunk):
    chunk_BT = tokens_Bt[:, start:stop]
    nll, _, cache = _decode_scan(params, config, chunk_BT,
                                 tokens_Bt[:, start + 1:stop + 1], cache,
                                 False, _plan(params, config, chunk_BT, cache))
    out.append(np.asarray(nll))
    errors.raise_if_set(cache, f"stream_nll, tokens {start}-{stop}")
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
  policy = cache.policy
  if policy.eviction == "h2o" or policy.positions == "cache":
    raise ValueError(
        f"extend_nll needs eviction in none/window/sinks and positions="
        f"'original', got eviction={policy.eviction!r}, positions="
        f"{policy.positions!r}; use stream_nll")
  params, tokens_Bt, n = _stream_inputs(params, config, tokens, cache,
                                        chunk, "extend_nll")
  out, logged = [], 0
  for start, stop in _chunks(n, chunk):
    nll, cache = _extend_nll(params, config, tokens_Bt[:, start:stop],
                             tokens_Bt[:, start + 1:stop + 1], cache)
    out.append(np.asarray(nll))
    errors.raise_if_set(cache, f"extend_nll, tokens {start}-{stop}")
    if log_every and stop - logged >= log_every:
      logged = stop
      logging.info("extend_nll %s: %d/%d tokens", policy.eviction, stop, n)
  return np.concatenate(out, axis=1), cache


# ---- sliding window with recompute -------------------------------------------
@functools.partial(jax.jit,
                   static_argnames=("config", "window", "micro_batch"))
def _recompute_nll(params, config, tokens_Bt, t_I, window, micro_batch):
  """NLL [I, B] of token t+1, for each t of t_I, from a fresh forward over
  the T = `window` tokens (t - window, t] of the stream."""
  offsets_T = jnp.arange(window, dtype=jnp.int32) - (window - 1)

  def one(t):
    idx_T = t + offsets_T
    ctx_BT = jnp.take(tokens_Bt, jnp.maximum(idx_T, 0), axis=1)
    # Windows that start before the stream are left-padded; positions are
    # re-indexed from 0 at the window's first real token.
    mask_BT = jnp.broadcast_to(idx_T >= 0, ctx_BT.shape)
    step = model.forward_step(config, mask_BT)
    x_BTD, _ = model.run_layers(params, model.embed(params, ctx_BT, config),
                                step, None, config)
    logits_BV = model.unembed(params, x_BTD[:, -1:], config)[:, 0]
    target_B = jax.lax.dynamic_index_in_dim(tokens_Bt, t + 1, axis=1,
                                            keepdims=False)
    return token_nll(logits_BV, target_B)

  return jax.lax.map(one, t_I, batch_size=micro_batch)


def recompute_nll(params, config: ModelConfig, tokens, window: int, *,
                  stride: int = 1, block: int = 1024, micro_batch: int = 64,
                  log_every: int = 0):
  """The 'sliding window with recompute' baseline.

  For every scored t the last `window` tokens (t - window, t] are run
  through a fresh, cache-free forward with positions 0..window-1, and token
  t+1 is scored: O(window) model tokens (and O(window^2) attention) per
  scored token. A cached window of that capacity attends to the same
  tokens, but their keys were computed from older contexts; the two agree
  exactly only for one-layer models.

  Args:
    tokens: [T'] or [B, T'] int ids.
    window: >= 1, tokens of context per prediction (the current included).
    stride: score every `stride`-th t (t = stride-1, 2·stride-1, ...), for
      streams too long to recompute everywhere; 1 scores every token.
    block: positions per compiled call (the last block is padded).
    micro_batch: windows computed together inside a call (`lax.map`
      batch size); 1 gives the sequential per-token cost.
  Returns:
    nll [B, T'-1] float32 numpy, aligned with `stream_nll`; NaN at the
    positions not scored (stride > 1).
  """
  tokens_Bt = _as_Bt(tokens).astype(np.int32)
  for name, v in dict(window=window, stride=stride, block=block,
                      micro_batch=micro_batch).items():
    if v < 1:
      raise ValueError(f"{name} must be >= 1, got {v}")
  if tokens_Bt.shape[1] < 2:
    raise ValueError(f"tokens: a stream needs at least 2 tokens, got "
                     f"{tokens_Bt.shape[1]}")
  params_lib.check_params(params, config)
  inference.check_tokens(tokens_Bt, config)
  n = tokens_Bt.shape[1] - 1
  scored = np.arange(stride - 1, n, stride, dtype=np.int32)
  if scored.size == 0:
    raise ValueError(f"stride={stride} scores no position of a {n}-token "
                     "stream")
  block = min(block, scored.size)
  micro_batch = min(micro_batch, block)
  stream = jnp.asarray(tokens_Bt)
  out, logged = [], 0
  for start, stop in _chunks(scored.size, block):
    # A fixed block shape: the last block repeats its final position.
    t_I = scored[np.minimum(np.arange(start, start + block), stop - 1)]
    nll_IB = _recompute_nll(params, config, stream, t_I, window, micro_batch)
    out.append(np.asarray(nll_IB)[:stop - start].T)
    if log_every and stop - logged >= log_every // stride:
      logged = stop
      logging.info("recompute_nll window=%d: %d/%d positions", window, stop,
                   scored.size)
  nll = np.full(tokens_Bt.shape[:1] + (n,), np.nan, np.float32)
  nll[:, scored] = np.concatenate(out, axis=1)
  return nll


# ---- policies by name -----------------------------------------------------------
_SCORED = tuple(n for n, cls in policies.REGISTRY.items()
                if issubclass(cls, policies.Scored))
_NAME = re.compile(r"^(dense|window|sinks(\d+)|recompute|"
                   + "|".join(_SCORED) + r")(?::(original|cache))?$")


@dataclasses.dataclass(frozen=True)
class StreamPolicy:
  """One row of the streaming table.

  name: e.g. 'dense', 'window', 'sinks4', 'sinks4:original', 'h2o',
    'h2o:original', 'tova', 'snapkv', 'recompute': any scored policy of
    `kvjax.policies` by name, with its defaults and `recent` = S / 2. Sinks
    and global scored policies default to cache positions (StreamingLLM's
    choice), window, dense and per-layer/head policies to original
    positions.
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
    return (p is not None and not p.scored and
            p.positions == "original")


def parse_policy(name: str, capacity: int, stream_len: int,
                 h2o_recent: int = 0) -> StreamPolicy:
  """A table row from its name (see `StreamPolicy`).

  Args:
    capacity: S, equal for every bounded row (and the recompute window).
    stream_len: T'; the dense cache gets T' slots.
    h2o_recent: a scored policy's always-kept recent tokens (0:
      capacity // 2).
  """
  m = _NAME.match(name)
  if not m:
    raise ValueError(
        f"policy name {name!r} is not one of dense, window, sinks<n>, "
        f"recompute, {', '.join(_SCORED)} (optionally ':original' or "
        "':cache')")
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
  elif kind in _SCORED:
    ev = policies.make(kind, recent=h2o_recent or max(capacity // 2, 1))
    pol = cache_lib.CachePolicy(
        ev, positions=positions or ("original" if ev.scoped else "cache"))
  else:
    pol = cache_lib.CachePolicy("sinks", num_sinks=int(sinks),
                                positions=positions or "cache")
  pol.validate_capacity(capacity)
  return StreamPolicy(name, pol, capacity)


def evaluate(params, config: ModelConfig, tokens, row: StreamPolicy, *,
             chunk: int = 512, micro_batch: int = 64, recompute_stride: int = 1,
             log_every: int = 0):
  """Per-token NLL [B, T'-1] of one table row, by its fastest exact path
  (NaN where recompute with `recompute_stride` > 1 did not score)."""
  if row.policy is None:
    return recompute_nll(params, config, tokens, row.capacity,
                         stride=recompute_stride, micro_batch=micro_batch,
                         log_every=log_every)
  tokens_Bt = _as_Bt(tokens)
  cache = cache_lib.init_cache(config, tokens_Bt.shape[0], row.capacity,
                               policy=row.policy)
  fn = extend_nll if row.fast_path else stream_nll
  nll, _ = fn(params, config, tokens_Bt, cache, chunk=chunk,
              log_every=log_every)
  return nll


# ---- summaries ------------------------------------------------------------------
def perplexity(nll, where=None) -> float:
  """exp(mean NLL) over the scored tokens (`where`: bool mask, default all).

  A NaN inside `where` (a non-finite logit) makes the result NaN.
  """
  nll = np.asarray(nll, np.float64)
  if where is not None:
    nll = nll[np.broadcast_to(where, nll.shape)]
  if nll.size == 0:
    raise ValueError("perplexity of no tokens")
  return float(np.exp(np.mean(nll)))


def perplexity_by_position(nll, bin_size: int):
  """Perplexity in consecutive bins of positions (averaged over the batch;
  NaN entries — positions a strided recompute did not score — are skipped).

  Args:
    nll: [B, T'-1] or [T'-1].
    bin_size: positions per bin (a last partial bin is dropped).
  Returns:
    (centres [nb] (position of the predicted token), ppl [nb]) numpy.
  """
  nll = np.asarray(nll, np.float64)
  nll = nll.reshape(-1, nll.shape[-1])
  nb = nll.shape[1] // bin_size
  if nb < 1:
    raise ValueError(f"bin_size={bin_size} exceeds the {nll.shape[1]} "
                     "positions")
  bins = nll[:, :nb * bin_size].reshape(nll.shape[0], nb, bin_size)
  bins = np.moveaxis(bins, 1, 0).reshape(nb, -1)
  # nll[t] scores the token at position t + 1.
  centres = np.arange(nb) * bin_size + (bin_size + 1) / 2
  with np.errstate(invalid="ignore"):
    return centres, np.exp(np.nanmean(bins, axis=1))


def summarize(nll_by_name: dict, rows: dict, capacity: int) -> list[dict]:
  """One table line per row.

  Args:
    nll_by_name: name -> nll [B, T'-1] (NaN = not scored).
    rows: name -> StreamPolicy.
    capacity: the bounded rows' S; `ppl_evicting` counts the tokens at
      positions >= S, where the policies differ.
  Returns:
    dicts with name, eviction, positions, slots, scored, ppl (every scored
    token), ppl_evicting, ppl_common (positions every row scored: the
    recompute sample when it was strided).
  """
  common = None
  for nll in nll_by_name.values():
    # Not-scored positions are NaN in the same places in every batch row.
    s = ~np.isnan(np.asarray(nll))
    common = s if common is None else common & s
  table = []
  for name, nll in nll_by_name.items():
    row = rows[name]
    nll = np.asarray(nll)
    scored = ~np.isnan(nll)
    evicting = scored & (np.arange(nll.shape[-1]) + 1 >= capacity)
    table.append(dict(
        name=name,
        eviction="recompute" if row.policy is None else row.policy.eviction,
        positions="0..W-1" if row.policy is None else row.policy.positions,
        slots=row.capacity, scored=int(scored.sum()),
        ppl=perplexity(nll, scored),
        ppl_evicting=perplexity(nll, evicting) if evicting.any() else None,
        ppl_common=perplexity(nll, common) if common.any() else None))
  return table


def markdown_table(table: list[dict]) -> str:
  """The summary as a Markdown table."""
  fmt = lambda v: "—" if v is None else f"{v:.3f}"  # pylint: disable=g-long-lambda
  lines = ["| policy | positions | cache slots | scored | PPL | PPL at "
           "positions >= S | PPL on common positions |",
           "|---|---|---|---|---|---|---|"]
  for r in table:
    lines.append(f"| {r['name']} | {r['positions']} | {r['slots']} | "
                 f"{r['scored']} | {fmt(r['ppl'])} | "
                 f"{fmt(r['ppl_evicting'])} | {fmt(r['ppl_common'])} |")
  return "\n".join(lines)


def plot_perplexity(curves: dict, path, *, capacity: int, train_len: int = 0,
                    title: str = "", bin_size: int = 0):
  """Perplexity against position, one line per policy (PNG, log y axis).

  Args:
    curves: name -> (centres, ppl) from `perplexity_by_position`.
    capacity: S, marked as a vertical line (eviction starts there).
    train_len: the model's training context, marked when > 0.
    bin_size: positions per bin, stated on the x axis when > 0.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(8, 4.5))
  for name, (x, y) in curves.items():
    ax.plot(x, y, label=name, lw=1.3, marker="o", ms=2.5)
  ax.set_yscale("log")
  from matplotlib.ticker import ScalarFormatter  # pylint: disable=g-import-not-at-top
  for axis_ticks in (ax.yaxis.set_major_formatter,
                     ax.yaxis.set_minor_formatter):
    axis_ticks(ScalarFormatter())
  marks = {capacity: f"S={capacity}"}
  if train_len:
    marks[train_len] = (f"S = train context = {train_len}"
                        if train_len == capacity else
                        f"train context {train_len}")
  for x, text in marks.items():
    ax.axvline(x, color="grey", ls=":", lw=1)
    # x in data units, y in axes fraction (robust to the log scale).
    ax.text(x, 0.98, f" {text}", transform=ax.get_xaxis_transform(),
            va="top", fontsize=8, color="grey")
  ax.set_xlabel("position in the stream (tokens)" + (
      f"; one point per bin of {bin_size} positions (the last may hold "
      "fewer)" if bin_size else ""))
  ax.set_ylabel("perplexity per token, exp(mean NLL) in the bin")
  ax.set_title(title, fontsize=9, wrap=True)
  ax.legend(fontsize=8, ncol=2, title="cache policy", title_fontsize=8)
  ax.grid(alpha=0.3, which="both")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# ---- per-token latency ---------------------------------------------------------
def _decode_runner(params, config: ModelConfig, policy, capacity: int,
                   tokens, steps: int, calls: int):
  """A warmed-up callable decoding the next `steps` tokens at batch 1 into a
  full cache (every step evicts); valid for `calls` calls."""
  need = capacity + 1 + steps * (calls + 1)
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
  return run


def _recompute_runner(params, config: ModelConfig, window: int, tokens,
                      steps: int):
  """A warmed-up callable scoring `steps` positions by recompute, one full
  window at a time (`micro_batch=1`: the sequential per-token cost)."""
  if tokens.shape[0] < window + steps + 1:
    raise ValueError(f"tokens: timing needs {window + steps + 1} tokens, got "
                     f"{tokens.shape[0]}")
  stream = jnp.asarray(tokens[None])
  t_I = jnp.arange(window, window + steps, dtype=jnp.int32)

  def run():
    return _recompute_nll(params, config, stream, t_I, window, 1)

  jax.block_until_ready(run())
  return run


def time_rows(params, config: ModelConfig, rows, tokens, *, steps: int = 32,
              rounds: int = 7) -> dict[str, float]:
  """Median seconds per token at batch 1 of each row, in steady state.

  Cached rows decode into a cache already full (so every step evicts);
  recompute runs one full window per token. The rows are timed in
  interleaved rounds (row 1, row 2, ..., then again) so that a noisy,
  shared machine slows them alike; each timing covers `steps` tokens in one
  compiled call (warmed up first) and is divided by `steps`.

  Args:
    rows: StreamPolicy per name.
    tokens: [T'] ids (T' >= capacity + 1 + steps * (rounds + 1)).
  Returns:
    name -> median seconds per token.
  """
  tokens = np.asarray(tokens, np.int32).reshape(-1)
  runners = {}
  for name, row in rows.items():
    if row.policy is None:
      runners[name] = _recompute_runner(params, config, row.capacity, tokens,
                                        steps)
    else:
      runners[name] = _decode_runner(params, config, row.policy,
                                     row.capacity, tokens, steps, rounds)
  times = {name: [] for name in rows}
  for _ in range(rounds):
    for name, run in runners.items():
      t0 = time.perf_counter()
      jax.block_until_ready(run())
      times[name].append(time.perf_counter() - t0)
  return {name: float(np.median(t)) / steps for name, t in times.items()}


# ---- memory against tokens --------------------------------------------------------
def memory_trace(params, config: ModelConfig, tokens, cache, *,
                 every: int):
  """Cache bytes read from the real arrays while a stream is decoded.

  Args:
    tokens: [T'] or [B, T'] ids, fed token by token (`decode_tokens` chunks of
      `every`).
    cache: a fresh cache (donated).
    every: record after every this many tokens.
  Returns:
    (list of dicts {tokens, used, kv, total, filled_slots} starting with the
     empty cache, final cache). `used` counts the slots holding a token,
     `kv` what is allocated (see `kvjax.cache_bytes`).
  """
  tokens_Bt = _as_Bt(tokens).astype(np.int32)
  if every < 1:
    raise ValueError(f"every must be >= 1, got {every}")

  def record(seen, cache):
    b = cache_lib.cache_bytes(cache)
    return dict(tokens=seen, filled_slots=int(jnp.sum(cache.positions >= 0)),
                **b)

  trace = [record(0, cache)]
  n = tokens_Bt.shape[1]
  params = _check_stream(params, config, tokens_Bt, cache, "tokens")
  inference._check_fits(cache, n, fresh=False, what="memory_trace")  # pylint: disable=protected-access
  for start, stop in _chunks(n, every):
    seg = tokens_Bt[:, start:stop]
    _, _, cache = _decode_scan(params, config, seg, seg, cache, False)
    errors.raise_if_set(cache, f"memory_trace, tokens {start}-{stop}")
    trace.append(record(stop, cache))
  return trace, cache


# ---- where attention goes (is there an attention sink?) ----------------------
def attention_matrix(params, config: ModelConfig, tokens):
  """A[q, k]: attention query q pays key k, averaged over layers, heads and
  the batch, [T, T] numpy (rows sum to 1 over k <= q).

  The mean of the attention probe (`kvjax.probe.attention_probs`: the
  library's own forward, per layer and head).

  Args:
    tokens: [T] or [B, T] ids.
  """
  tokens_BT = _as_Bt(tokens).astype(np.int32)
  probs = probe.attention_probs(params, config, tokens_BT)
  return np.asarray(probs.mean(axis=(0, 1, 2)))


def attention_profile(params, config: ModelConfig, tokens, *,
                      near: int = 16, far: int = 128) -> dict:
  """Where the second half of a window's queries put their attention.

  Returns:
    first_token: mean attention on key 0 for queries q >= T/2;
    first_token_if_uniform: the same for uniform causal attention;
    within_near / beyond_far: mean attention at distance q - k < near /
      >= far.
  """
  a = attention_matrix(params, config, tokens)
  t = a.shape[0]
  q = np.arange(t // 2, t)
  dist = q[:, None] - np.arange(t)[None, :]
  rows = a[q]
  return dict(first_token=float(rows[:, 0].mean()),
              first_token_if_uniform=float(np.mean(1.0 / (q + 1))),
              within_near=float((rows * (dist < near)).sum(1).mean()),
              beyond_far=float((rows * (dist >= far)).sum(1).mean()),
              near=near, far=far, window=t)


def evaluate_rows(params, config: ModelConfig, tokens, rows: dict, *,
                  chunk: int = 512, micro_batch: int = 8,
                  recompute_stride: int = 1, log_every: int = 0):
  """`evaluate` for every row. Returns (name -> nll [B, T'-1], name ->
  seconds it took)."""
  nll, seconds = {}, {}
  for name, row in rows.items():
    t0 = time.perf_counter()
    nll[name] = evaluate(params, config, tokens, row, chunk=chunk,
                         micro_batch=micro_batch,
                         recompute_stride=recompute_stride,
                         log_every=log_every)
    seconds[name] = time.perf_counter() - t0
    logging.info("%s: ppl %.3f (%.0f s)", name,
                 perplexity(nll[name], ~np.isnan(nll[name])), seconds[name])
  return nll, seconds


def timing_table(params, config: ModelConfig, tokens, names, capacities, *,
                 h2o_recent: int = 0, steps: int = 32,
                 rounds: int = 7) -> list[dict]:
  """Per-token decode time at batch 1 of named rows at several capacities.

  Returns:
    dicts name, slots, ms_per_token, and recompute_over_this (the speed-up
    over recompute at the same capacity) when 'recompute' is among names.
  """
  table = []
  for slots in capacities:
    rows = {name: parse_policy(name, slots, len(tokens), h2o_recent)
            for name in names}
    per_token = time_rows(params, config, rows, tokens, steps=steps,
                          rounds=rounds)
    for name, sec in per_token.items():
      t = dict(name=name, slots=slots, ms_per_token=1e3 * sec)
      if RECOMPUTE in per_token:
        t["recompute_over_this"] = per_token[RECOMPUTE] / sec
      table.append(t)
  return table


def plot_memory(traces: dict, path, *, capacity: int, title: str = ""):
  """Cache bytes against tokens seen (PNG).

  Args:
    traces: label -> dict(variant=..., bounded=bool, trace=[memory_trace
      records]); one colour per variant, solid = unbounded, dashed =
      bounded.
    capacity: S, where eviction starts (vertical line).
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(8, 4.5))
  colours = {}
  for label, t in traces.items():
    c = colours.setdefault(t["variant"], f"C{len(colours)}")
    x = [r["tokens"] for r in t["trace"]]
    y = [r["used"] / 2**20 for r in t["trace"]]
    ax.plot(x, y, color=c, ls="--" if t["bounded"] else "-", lw=1.6,
            label=label)
    if t["bounded"]:
      ax.axhline(t["trace"][-1]["kv"] / 2**20, color=c, ls=":", lw=0.8)
  ax.axvline(capacity, color="grey", ls=":", lw=1)
  ax.text(capacity, 0.98, f" eviction starts (S={capacity})",
          transform=ax.get_xaxis_transform(), va="top", fontsize=8,
          color="grey")
  ax.set_xlabel("tokens seen (per sequence)")
  ax.set_ylabel("cache bytes holding tokens (MiB)")
  ax.set_title(title, fontsize=10)
  ax.legend(fontsize=8, ncol=2)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
