"""Public inference API: forward, prefill, extend, decode_step, generate, and
the no-cache baseline generate_no_cache.

Every function validates its inputs on the host before any compute (shapes,
dtypes, token range, capacity), then calls a jit-compiled body. Functions that
take a cache return `(output, new_cache)`; the cache argument of the jitted
bodies is donated, so XLA updates it in place — do not reuse a cache after
passing it in.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import decode
from kvjax import errors
from kvjax import model
from kvjax import norm_matvec
from kvjax import packed
from kvjax import params as params_lib
from kvjax import quant
from kvjax.config import ModelConfig
from kvjax.sampling import GREEDY, Sampler
from kvjax.validate import check_int


# ---- validation (host side, before compute) ---------------------------------
def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def as_array(x, name: str):
  """x as an array: lists and tuples converted (`np.asarray`), arrays as
  they are; anything else a ValueError naming `name`."""
  if isinstance(x, (list, tuple)):
    try:
      return np.asarray(x)
    except ValueError as e:  # ragged nesting
      raise ValueError(f"{name} is a ragged list: {e}") from None
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise ValueError(f"{name} must be an array, got {type(x).__name__}")
  return x


def check_tokens(tokens, config: ModelConfig, ndim: int = 2,
                 name: str = "tokens"):
  """Returns `tokens` as an array (lists converted); raises ValueError unless
  it is an integer array of rank `ndim` with ids in [0, vocab_size).

  Traced ids cannot be checked here: the step records out-of-range ids in
  the cache's error state instead (`kvjax.errors`).
  """
  tokens = as_array(tokens, name)
  if tokens.ndim != ndim:
    raise ValueError(f"{name} must have rank {ndim} "
                     f"({'[B, T]' if ndim == 2 else '[B]'}), got shape "
                     f"{tuple(tokens.shape)}")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"{name} must be integer token ids, got dtype "
                     f"{tokens.dtype}")
  if 0 in tokens.shape:
    raise ValueError(f"{name} is empty: shape {tuple(tokens.shape)}")
  if _is_concrete(tokens):
    t = np.asarray(tokens)
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= config.vocab_size:
      raise ValueError(f"{name} ids must be in [0, {config.vocab_size}), got "
                       f"min {lo}, max {hi}")
  return tokens


def check_mask(attention_mask, tokens):
  """Returns a bool [B, T] mask (all ones if None); raises ValueError unless
  it matches tokens, is left-padded (0s then 1s), and every row has a token.
  Lists are converted. A traced mask is checked in the step instead
  (BAD_MASK in the cache's error state, `kvjax.errors`)."""
  if attention_mask is None:
    return jnp.ones(tokens.shape, bool)
  attention_mask = as_array(attention_mask, "attention_mask")
  if tuple(attention_mask.shape) != tuple(tokens.shape):
    raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != "
                     f"tokens shape {tuple(tokens.shape)}")
  if _is_concrete(attention_mask):
    m = np.asarray(attention_mask)
    if not np.isin(m, (0, 1)).all():
      raise ValueError("attention_mask must hold only 0 (padding) and 1")
    if (np.diff(m.astype(np.int32), axis=1) < 0).any():
      raise ValueError("attention_mask must be left-padded (0s, then 1s); "
                       "right padding is not supported")
    if (m.sum(axis=1) == 0).any():
      raise ValueError("attention_mask has a row with no real token")
  return attention_mask.astype(bool)


def _real_lengths(mask) -> np.ndarray | None:
  return np.asarray(mask).sum(axis=1) if _is_concrete(mask) else None


def _check_fits(cache, n_new_max: int, *, fresh: bool, what: str):
  """Overflow of a cache without eviction is an error, never a wrap-around."""
  policy, S = cache.policy, cache.capacity
  start = 0
  if not fresh:
    if not _is_concrete(cache.length):
      return
    length = cache.length
    if isinstance(length, jax.Array) and not length.is_fully_addressable:
      # A mesh over several processes: each holds only its own rows.
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      length = multihost_utils.process_allgather(length, tiled=True)
    start = int(np.max(np.asarray(length)))
  if policy.eviction == "none" and start + n_new_max > S:
    raise ValueError(
        f"{what}: {start} cached + {n_new_max} new tokens exceed the cache "
        f"capacity {S} and eviction='none'; raise capacity or choose an "
        "eviction policy")
  needs_room = policy.positions == "cache" or (policy.scored and
                                               not policy.scoped)
  if fresh and needs_room and n_new_max > S:
    raise ValueError(
        f"{what}: a {n_new_max}-token prompt does not fit capacity {S}; with "
        f"eviction={policy.eviction!r} and positions={policy.positions!r} "
        "longer streams must be decoded token by token")


def _check_cache(cache, config: ModelConfig, batch: int):
  kind = cache_lib.LatentCache if config.attention == "mla" else (
      cache_lib.KVCache)
  if not isinstance(cache, kind):
    raise ValueError(f"attention={config.attention!r} needs a {kind.__name__},"
                     f" got {type(cache).__name__}")
  if cache.batch != batch:
    raise ValueError(f"cache batch {cache.batch} != tokens batch {batch}")
  L = (cache.c_kv if config.attention == "mla" else cache.k).shape[0]
  if L != config.num_layers:
    raise ValueError(f"cache has {L} layers, config.num_layers is "
                     f"{config.num_layers}")
  # A cache built for another config fails deep inside the scatter otherwise.
  # int4 stores two values per element of the last axis (`kvjax.quant`).
  n = quant.values_per_element(cache.policy.kv_dtype)
  if config.attention == "mla":
    dims = dict(kv_lora_rank=(n * cache.c_kv.shape[3], config.kv_lora_rank),
                qk_rope_head_dim=(n * cache.k_rope.shape[3],
                                  config.qk_rope_head_dim))
  else:
    dims = dict(num_kv_heads=(cache.k.shape[2], config.num_kv_heads),
                head_dim=(n * cache.k.shape[4], config.head_dim))
  for field, (got, want) in dims.items():
    if got != want:
      raise ValueError(f"cache was built for {field}={got}, the config has "
                       f"{field}={want}")


# ---- jitted bodies ----------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("config",))
def _forward(params, config, tokens, mask):
  return model.forward_logits(params, config, tokens, mask)


def _pin(shardings, logits, cache):
  """Pins a jitted body's outputs to the sharding plan (None: no-op), so a
  step's output sharding is the next step's input sharding: one compile."""
  if shardings is None:
    return logits, cache
  if logits is not None:
    axes = ("batch",) + (None,) * (logits.ndim - 2) + ("vocab",)
    logits = shardings.constrain(logits, axes)
  return logits, shardings.constrain_cache(cache)


@functools.partial(jax.jit,
                   static_argnames=("config", "all_logits", "shardings",
                                    "first_chunk"),
                   donate_argnames=("cache",))
def _prefill(params, config, tokens, mask, cache, all_logits,
             shardings=None, first_chunk=False):
  return _pin(shardings, *model.prefill_logits(params, config, tokens, mask,
                                               cache, all_logits,
                                               first_chunk))


@functools.partial(jax.jit, static_argnames=("config", "all_logits"),
                   donate_argnames=("cache",))
def _extend(params, config, tokens, mask, cache, all_logits):
  return model.extend_logits(params, config, tokens, mask, cache, all_logits)


@functools.partial(jax.jit, static_argnames=("config", "shardings"),
                   donate_argnames=("cache",))
def _decode(params, config, token, cache, shardings=None):
  with norm_matvec.weights(params):
    return _pin(shardings, *model.decode_logits(params, config, token,
                                                cache))


def _place(shardings, config, params, cache, *batch_arrays):
  """Checks a sharding plan against the call (ValueError naming the mesh
  axis) and places params, cache and [B, ...] inputs by it (a no-op for
  inputs already placed)."""
  shardings.check_config(config)
  shardings.check_batch(cache.batch)
  params = shardings.put_params(params)
  cache = shardings.put_cache(cache)
  batch_arrays = [shardings.put(a, ("batch",) + (None,) * (a.ndim - 1))
                  for a in batch_arrays]
  return params, cache, batch_arrays


# ---- public API -------------------------------------------------------------
def forward(params, config: ModelConfig, tokens, attention_mask=None):
  """No-cache causal forward.

  Args:
    tokens: [B, T] int ids, left-padded when `attention_mask` is given.
    attention_mask: [B, T] (1 = token, 0 = padding) or None.
  Returns:
    logits [B, T, V] float32 (rows of padding are finite and meaningless).
  """
  params_lib.check_params(params, config)
  tokens = check_tokens(tokens, config)
  mask = check_mask(attention_mask, tokens)
  return _forward(params, config, jnp.asarray(tokens, jnp.int32), mask)


def prefill(params, config: ModelConfig, tokens, cache, attention_mask=None,
            *, all_logits: bool = False, shardings=None):
  """Runs the whole prompt in one parallel pass into a fresh cache.

  The cache's previous contents are discarded (positions restart at 0).

  Args:
    tokens: [B, T] left-padded prompt ids.
    cache: from `init_cache` (donated).
    attention_mask: [B, T] or None.
    all_logits: return logits for every position instead of the last.
    shardings: a `kvjax.sharding.ShardingPlan`: params, cache and tokens are
      placed by it and the returned cache keeps its shardings.
  Returns:
    (logits [B, V] at the last position, or [B, T, V]; new_cache)
  """
  params_lib.check_params(params, config)
  params = packed.for_decode(params, config)
  tokens = check_tokens(tokens, config)
  _check_cache(cache, config, tokens.shape[0])
  errors.raise_if_set(cache, "prefill: the cache passed in")
  mask = check_mask(attention_mask, tokens)
  lengths = _real_lengths(mask)
  n_max = int(lengths.max()) if lengths is not None else tokens.shape[1]
  _check_fits(cache, n_max, fresh=True, what="prefill")
  tokens = jnp.asarray(tokens, jnp.int32)
  if shardings is not None:
    params, cache, (tokens, mask) = _place(shardings, config, params, cache,
                                           tokens, mask)
  logits, cache = _prefill(params, config, tokens, mask, cache, all_logits,
                           shardings)
  errors.raise_if_set(cache, "prefill")
  return (logits if all_logits else logits[:, 0]), cache


def extend(params, config: ModelConfig, tokens, cache, attention_mask=None,
           *, all_logits: bool = False):
  """Appends a chunk of tokens to a cache that already holds a prefix.

  Keys are the cached tokens followed by the chunk (one compilation per chunk
  length). Not available with scored eviction (h2o, tova, ...: their slot
  choice is per token) or cache-position mode (its rotation rule is per
  token): use `decode_step`.
  Returns:
    (logits [B, V] or [B, T, V], new_cache)
  """
  params_lib.check_params(params, config)
  params = packed.for_decode(params, config)
  tokens = check_tokens(tokens, config)
  _check_cache(cache, config, tokens.shape[0])
  errors.raise_if_set(cache, "extend: the cache passed in")
  policy = cache.policy
  if policy.scored or policy.positions == "cache":
    raise ValueError(f"extend does not support eviction={policy.eviction!r} /"
                     f" positions={policy.positions!r}; use decode_step")
  mask = check_mask(attention_mask, tokens)
  _check_fits(cache, tokens.shape[1], fresh=False, what="extend")
  logits, cache = _extend(params, config, jnp.asarray(tokens, jnp.int32),
                          mask, cache, all_logits)
  errors.raise_if_set(cache, "extend")
  return (logits if all_logits else logits[:, 0]), cache


def prefill_chunked(params, config: ModelConfig, tokens, cache,
                    chunk_size: int, attention_mask=None):
  """Prefill in fixed-size chunks: bounded activation memory, one compiled
  program per chunk size. Equal to `prefill` (tested).

  The prompt is left-padded to a multiple of `chunk_size`.
  Returns:
    (logits [B, V] at the last position, new_cache)
  """
  if (not isinstance(chunk_size, (int, np.integer)) or
      isinstance(chunk_size, bool) or chunk_size < 1):
    raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
  params_lib.check_params(params, config)
  params = packed.for_decode(params, config)
  tokens = check_tokens(tokens, config)
  mask = check_mask(attention_mask, tokens)
  B, T = tokens.shape
  pad = (-T) % chunk_size
  tokens = jnp.pad(jnp.asarray(tokens, jnp.int32), ((0, 0), (pad, 0)))
  mask = jnp.pad(mask, ((0, 0), (pad, 0)))
  n_max = int(np.asarray(mask).sum(axis=1).max())
  _check_fits(cache, n_max, fresh=True, what="prefill_chunked")
  if cache.policy.scored or cache.policy.positions == "cache":
    if T + pad > chunk_size:
      raise ValueError(f"prefill_chunked with eviction="
                       f"{cache.policy.eviction!r} (scored) or positions="
                       "'cache' needs the prompt to fit one chunk")
  _check_cache(cache, config, B)
  errors.raise_if_set(cache, "prefill_chunked: the cache passed in")
  logits, cache = _prefill(params, config, tokens[:, :chunk_size],
                           mask[:, :chunk_size], cache, False,
                           first_chunk=True)
  for start in range(chunk_size, T + pad, chunk_size):
    sl = slice(start, start + chunk_size)
    logits, cache = _extend(params, config, tokens[:, sl], mask[:, sl], cache,
                            False)
  errors.raise_if_set(cache, "prefill_chunked")
  return logits[:, 0], cache


def decode_step(params, config: ModelConfig, token, cache, *,
                shardings=None):
  """Feeds one token per sequence.

  Args:
    token: [B] int ids.
    cache: the cache after prefill / earlier steps (donated).
    shardings: a `kvjax.sharding.ShardingPlan` (see `prefill`).
  Returns:
    (logits [B, V] for the next token, new_cache)
  """
  params_lib.check_params(params, config)
  params = packed.for_decode(params, config)
  token = check_tokens(token, config, ndim=1, name="token")
  _check_cache(cache, config, token.shape[0])
  errors.raise_if_set(cache, "decode_step: the cache passed in")
  _check_fits(cache, 1, fresh=False, what="decode_step")
  token = jnp.asarray(token, jnp.int32)
  if shardings is not None:
    params, cache, (token,) = _place(shardings, config, params, cache, token)
  logits, cache = _decode(params, config, token, cache, shardings)
  errors.raise_if_set(cache, "decode_step")
  return logits, cache


def default_capacity(prompt_len: int, max_new_tokens: int) -> int:
  """Power-of-two capacity covering prompt and generation (few shapes)."""
  return max(16, 1 << math.ceil(math.log2(prompt_len + max_new_tokens)))


# The decode loop's knobs, where generate's users look for them.
attention_schedule = decode.attention_schedule
bucket_length = decode.bucket_length
LAYERED_MIN_BATCH = decode.LAYERED_MIN_BATCH


def _generation_inputs(params, config, tokens, max_new_tokens, attention_mask,
                       bucket, policy=None):
  """Shared validation of `generate` / `generate_no_cache`; returns the
  (optionally bucket-padded) int32 tokens and bool mask, [B, T].

  The stream may not outgrow `config.max_seq_len` unless the cache rotates
  keys by their rank in the cache (positions='cache', which stays below
  the capacity)."""
  params_lib.check_params(params, config)
  tokens = check_tokens(tokens, config)
  max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
  mask = check_mask(attention_mask, tokens)
  n_max = int(np.asarray(mask).sum(axis=1).max())
  rank_positions = policy is not None and policy.positions == "cache"
  if not rank_positions and n_max + max_new_tokens > config.max_seq_len:
    raise ValueError(
        f"max_new_tokens={max_new_tokens}: a {n_max}-token prompt plus "
        f"{max_new_tokens} new tokens exceeds config.max_seq_len="
        f"{config.max_seq_len}")
  tokens = jnp.asarray(tokens, jnp.int32)
  if bucket:
    pad = bucket_length(tokens.shape[1]) - tokens.shape[1]
    tokens = jnp.pad(tokens, ((0, 0), (pad, 0)))
    mask = jnp.pad(mask, ((0, 0), (pad, 0)))
  return tokens, mask


@functools.partial(
    jax.jit,
    static_argnames=("config", "steps", "sampler", "return_logits",
                     "stop_tokens", "pad_id", "shardings", "plan"),
    donate_argnames=("cache",))
def _generate(params, config, tokens, mask, cache, rng, steps, sampler,
              return_logits, stop_tokens, pad_id, shardings=None,
              plan=decode.Plan()):
  """Prefill, then `steps - 1` steps of the decode loop (`kvjax.decode`);
  the last sampled token is never fed back."""
  pin = functools.partial(_pin, shardings)
  logits_B1V, cache = pin(*model.prefill_logits(params, config, tokens, mask,
                                                cache, False))
  logits_BV = logits_B1V[:, 0]
  keys = jax.random.split(rng, steps)
  tok0_B = sampler(logits_BV, keys[0])
  emit = lambda logits_BV, nxt_B, key, cache: (
      nxt_B, logits_BV if return_logits else None)
  _, cache, (toks_IB, logits_IBV) = decode.run(
      params, config, tok0_B, cache, keys[1:], choose=sampler, emit=emit,
      plan=plan, stop_tokens=stop_tokens, pad_id=pad_id, pin=pin)
  # The loop's result carries whatever sharding propagation chose for it;
  # pin it to the plan like every step's (no-op without shardings).
  cache = pin(None, cache)[1]
  toks_BI = jnp.concatenate([tok0_B[:, None], toks_IB.T], axis=1)
  if stop_tokens:
    # After its first stop token a sequence emits pad_id (the loop stops
    # once every sequence is done; the steps it skipped are filled here).
    stop_BI = jnp.isin(toks_BI, jnp.asarray(stop_tokens, jnp.int32))
    after_BI = (jnp.cumsum(stop_BI, axis=1) - stop_BI) > 0
    toks_BI = jnp.where(after_BI, pad_id, toks_BI)
  if not return_logits:
    return toks_BI, None, cache
  logits_BIV = jnp.concatenate(
      [logits_BV[:, None], jnp.swapaxes(logits_IBV, 0, 1)], axis=1)
  return toks_BI, logits_BIV, cache


def memory_limit() -> int:
  """Bytes the default device can hold: its allocator's limit where it
  reports one (GPU, TPU), else the host's physical memory (CPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_memory(config, policy, batch: int, capacity: int,
                  devices: int = 1) -> None:
  """Refuses, before allocating, a cache larger than the devices hold."""
  need = cache_lib.kv_bytes_per_token(
      config, policy.kv_dtype,
      key_group=policy.key_group if policy.channel_keys else 0
  ) * batch * capacity
  have = memory_limit() * devices
  if need > have:
    raise ValueError(
        f"a cache of {batch} x {capacity} slots needs {need:,.0f} bytes; "
        f"the device holds {have:,} bytes: lower max_new_tokens, capacity "
        "or the batch, or choose an evicting policy")


def _generate_args(params, config, tokens, max_new_tokens, attention_mask,
                   sampler, rng, capacity, policy, stop_tokens, pad_id,
                   return_logits, bucket, shardings, attend_buckets,
                   decode_layout="auto"):
  """Validates a `generate` call; returns the arguments of `_generate`."""
  policy = policy or cache_lib.CachePolicy()
  tokens, mask = _generation_inputs(params, config, tokens, max_new_tokens,
                                    attention_mask, bucket, policy)
  params = packed.for_decode(params, config)
  B, T = tokens.shape
  n_max = int(np.asarray(mask).sum(axis=1).max())
  for t in stop_tokens:
    check_int("stop_tokens (token ids)", t, 0, config.vocab_size - 1)
  check_int("pad_id (a token id)", pad_id, 0, config.vocab_size - 1)
  if capacity is None:
    capacity = policy.round_capacity(
        default_capacity(tokens.shape[1], max_new_tokens))
  _check_memory(config, policy, B, capacity,
                devices=1 if shardings is None else jax.device_count())
  plan = decode.plan(params, config, policy, B, T, int(max_new_tokens) - 1,
                     capacity, attend_buckets=attend_buckets,
                     stops=bool(stop_tokens), sharded=shardings is not None,
                     decode_layout=decode_layout)
  if shardings is not None:
    shardings.check_config(config)
    cache = shardings.init_cache(B, capacity, policy=policy)
  else:
    cache = cache_lib.init_cache(config, B, capacity, policy=policy)
  _check_fits(cache, n_max, fresh=True, what="generate prompt")
  if policy.eviction == "none":
    # The last token is sampled, never written: n + max_new - 1 slots.
    _check_fits(cache, n_max + max_new_tokens - 1, fresh=True,
                what="generate")
  if not sampler.greedy and rng is None:
    raise ValueError("a sampling Sampler needs an explicit rng key")
  rng = jax.random.key(0) if rng is None else rng
  if shardings is not None:
    params, cache, (tokens, mask) = _place(shardings, config, params, cache,
                                           tokens, mask)
    rng = shardings.put(rng, ())
  return (params, config, tokens, mask, cache, rng, int(max_new_tokens),
          sampler, return_logits, tuple(int(t) for t in stop_tokens), pad_id,
          shardings, plan)


def generate(params, config: ModelConfig, tokens, max_new_tokens: int, *,
             attention_mask=None, sampler: Sampler = GREEDY, rng=None,
             capacity: int | None = None,
             policy: cache_lib.CachePolicy | None = None,
             stop_tokens=(), pad_id: int = 0, return_logits: bool = False,
             return_cache: bool = False, bucket: bool = True,
             shardings=None, attend_buckets: bool = True,
             decode_layout: str = "auto"):
  """Prefill + decode with the KV cache.

  Args:
    tokens: [B, T] prompt ids, left-padded when `attention_mask` is given.
    max_new_tokens: number of tokens to produce.
    attention_mask: [B, T] (1 = token, 0 = padding) or None.
    sampler: `Sampler` (default greedy); `rng` is its PRNG key.
    capacity: cache slots per sequence (default: a power of two covering
      prompt + generation).
    policy: `CachePolicy` (eviction, position mode, kv dtype).
    stop_tokens: ids that end a sequence; then a `lax.while_loop` stops when
      every sequence is done and finished sequences emit `pad_id`. Without
      stop tokens a fixed-length `lax.scan` runs.
    return_logits: also return the logits each token was sampled from.
    return_cache: also return the final cache.
    bucket: left-pad the prompt to a power-of-two length (no recompilation
      for a new prompt length).
    shardings: a `kvjax.sharding.ShardingPlan`: the cache is created in its
      shards, params and prompt are placed by it, and every step keeps the
      cache's shardings.
    attend_buckets: decode steps attend over a prefix of the cache that
      covers the filled slots (a power of two, or in the last segment what
      the generation fills; `attention_schedule`) instead of the whole
      capacity. Same results; used with eviction 'none',
      positions 'original', no stop tokens and no shardings (otherwise the
      whole cache is attended).
    decode_layout: the cache layout the decode steps of those segments
      read. 'stacked': the `KVCache` itself. 'blocked': each segment copies
      its attended prefix into per-layer arrays with keys transposed in
      blocks of 64 slots (`kvjax.blocked`) and back after it. 'layered':
      each segment copies its prefix into per-layer arrays, and int8 / int4
      caches attend with integer dots (`kvjax.layered`). Float caches give
      the same tokens in every layout and logits equal up to float
      reassociation; quantized ones differ by the integer attention's
      rounding (WORKSPACE.md "Quantized caches").
      The views need the segments, attention 'gqa' and the decode params
      layout (`kvjax.pack`, which `generate` applies itself on CPU from
      embed_dim 256 on); 'blocked' a float kv_dtype (a segment whose
      prefix is not a multiple of 64 slots reads the stacked cache),
      'layered' float32 / bfloat16 / float16 / int8 / int4 with per-token
      keys. 'native': the layered arrays attended by the CPU kernel
      (`kvjax.native_attention`, built on first use): float32 / bfloat16 /
      int8 / int4 caches of the GQA family, MLA's float32 / bfloat16
      latents.
      While a segment runs its copy is held beside the cache (up to one
      cache of temporaries). 'auto' (default), with params on CPU (where
      it was measured): 'native' on AVX-512 and AVX2 hosts
      (`native_attention.preferred`); else 'layered' for int8 /
      int4 caches (MLA's latents too); for the GQA family's float caches at
      batch >= `LAYERED_MIN_BATCH` (4), 'layered' in segments attending
      `decode.LAYERED_MIN_SLOTS` (2048) slots or more; else 'stacked' (a
      float per-layer array measured 0.5x the stacked step at batch 1).
  Returns:
    new ids [B, max_new_tokens]; with return_logits / return_cache a tuple
    (ids, logits [B, max_new_tokens, V] or None, cache or None).
  """
  args = _generate_args(params, config, tokens, max_new_tokens,
                        attention_mask, sampler, rng, capacity, policy,
                        stop_tokens, pad_id, return_logits, bucket, shardings,
                        attend_buckets, decode_layout)
  toks, logits, cache = _generate(*args)
  # One host sync for the whole loop: any step's error is sticky.
  errors.raise_if_set(cache, "generate")
  if return_logits or return_cache:
    return toks, logits, (cache if return_cache else None)
  return toks


def lower_generate(params, config: ModelConfig, tokens, max_new_tokens: int,
                   **kwargs) -> jax.stages.Lowered:
  """The lowered program a `generate` call with these arguments runs (same
  keyword arguments), for AOT compilation, compile times and XLA's
  memory analysis (`.compile().memory_analysis()`: arguments, outputs,
  temporaries and the peak, device-agnostic)."""
  kw = dict(attention_mask=None, sampler=GREEDY, rng=None, capacity=None,
            policy=None, stop_tokens=(), pad_id=0, return_logits=False,
            bucket=True, shardings=None, attend_buckets=True,
            decode_layout="auto")
  unknown = set(kwargs) - set(kw)
  if unknown:
    raise ValueError(f"lower_generate: unknown arguments {sorted(unknown)}")
  kw.update(kwargs)
  return _generate.lower(*_generate_args(params, config, tokens,
                                         max_new_tokens, **kw))


# ---- the no-cache baseline --------------------------------------------------
@functools.partial(jax.jit,
                   static_argnames=("config", "steps", "sampler",
                                    "return_logits"))
def _no_cache_segment(params, config, buf_BT, mask_BT, start, keys, steps,
                      sampler, return_logits):
  """`steps` tokens, each by a full forward over the whole T-token buffer."""

  def body(carry, xs):
    buf_BT, mask_BT = carry
    i, key = xs
    idx = start + i
    logits_BTV = model.forward_logits(params, config, buf_BT, mask_BT)
    logits_BV = jax.lax.dynamic_index_in_dim(logits_BTV, idx - 1, axis=1,
                                             keepdims=False)
    tok_B = sampler(logits_BV, key)
    buf_BT = jax.lax.dynamic_update_index_in_dim(buf_BT, tok_B, idx, axis=1)
    mask_BT = jax.lax.dynamic_update_index_in_dim(
        mask_BT, jnp.ones_like(tok_B, bool), idx, axis=1)
    return (buf_BT, mask_BT), (tok_B, logits_BV if return_logits else None)

  (buf_BT, mask_BT), (toks_IB, logits_IBV) = jax.lax.scan(
      body, (buf_BT, mask_BT), (jnp.arange(steps), keys))
  return buf_BT, mask_BT, toks_IB.T, (None if logits_IBV is None else
                                      jnp.swapaxes(logits_IBV, 0, 1))


def generate_no_cache(params, config: ModelConfig, tokens,
                      max_new_tokens: int, *, attention_mask=None,
                      sampler: Sampler = GREEDY, rng=None,
                      return_logits: bool = False, bucket: bool = True):
  """The baseline a KV cache replaces: every new token recomputes the causal
  forward over the whole history.

  The history buffer is processed in power-of-two length buckets (one
  compilation each, masked beyond the current length), so the cost of a step
  grows with its position as in a real recompute. Same signature and result
  as `generate` with the default (unbounded) cache.
  """
  tokens, mask = _generation_inputs(params, config, tokens, max_new_tokens,
                                    attention_mask, bucket)
  if not sampler.greedy and rng is None:
    raise ValueError("a sampling Sampler needs an explicit rng key")
  rng = jax.random.key(0) if rng is None else rng
  keys = jax.random.split(rng, max_new_tokens)
  B, T = tokens.shape
  total = T + max_new_tokens
  buf = jnp.pad(tokens, ((0, 0), (0, max_new_tokens)))
  mask = jnp.pad(mask, ((0, 0), (0, max_new_tokens)))
  toks, logits = [], []
  done = 0
  while done < max_new_tokens:
    length = T + done  # tokens present before this segment's first step
    width = min(total, bucket_length(length + 1))
    steps = min(max_new_tokens - done, width - length)
    sub_buf, sub_mask, t, lg = _no_cache_segment(
        params, config, buf[:, :width], mask[:, :width], jnp.int32(length),
        keys[done:done + steps], steps, sampler, return_logits)
    buf = buf.at[:, :width].set(sub_buf)
    mask = mask.at[:, :width].set(sub_mask)
    toks.append(t)
    logits.append(lg)
    done += steps
  toks = jnp.concatenate(toks, axis=1)
  # No cache to carry the error: a row sampled from non-finite logits is
  # marked by the sampler's INVALID_TOKEN.
  bad = np.flatnonzero(np.any(np.asarray(toks) == errors.INVALID_TOKEN,
                              axis=1))
  if bad.size:
    raise ValueError(f"generate_no_cache: {errors.NAMES[errors.NONFINITE]} "
                     f"in sequences {bad.tolist()}")
  if return_logits:
    return toks, jnp.concatenate(logits, axis=1), None
  return toks
