"""Grouped-query attention (MHA / MQA / GQA in one function) and the per-call
context every attention variant reads.

MHA is GQA with K = N, MQA is GQA with K = 1: one grouped einsum
('BTKGH,BKSH->BKGTS') covers all three. The no-cache forward, the prefill, the
chunked extension and the decode step run this same code; they differ only in
where K and V come from (`Step.mode`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from kvjax import cache as cache_lib
from kvjax import flash
from kvjax import kivi
from kvjax import projections
from kvjax import quant
from kvjax.config import ModelConfig
from kvjax.layers import apply_rope
from kvjax.policies import base as policies_base

MODES = ("forward", "prefill", "extend", "decode")


@struct.dataclass
class Step:
  """What one model call needs besides params and activations (built once).

  mode (static):
    forward  no cache; keys are the new tokens themselves.
    prefill  keys are the new tokens (the cache is taken as empty); their
             K/V are then written to the cache.
    extend   keys are the cached tokens followed by the new tokens (chunked
             prefill); the new K/V are then written.
    decode   the new K/V are written first, then the queries attend over the
             whole cache.
  q_pos: [B, T] stream positions of the new tokens (-1 for padding).
  mask: [B, T, S'] which keys each query may attend (S' = T, S + T or S);
    a decode step of a scoped policy (`kvjax.policies`: layers or heads
    keep different tokens) has [L, B, K', T, S] instead (`layer_mask`).
  cos_q, sin_q: [B, T, R/2] rotation of the queries (and of the new keys in
    `original` position mode).
  cos_k, sin_k: [B, S, R/2] rotation applied to cached keys at attention time
    (`cache` position mode only), else None.
  slots: [B, T] cache slot each new token is written to (S = not written);
    a scoped decode step has [L, B, K'] (`layer_slots`); a scoped prefill
    None (each layer chooses what it keeps).
  k_pos, visibility (prefill and extend): the keys' stream positions
    [B, S'] and the static rule (`flash.Visibility`) that `mask` was
    built from, so that a long call can rebuild its mask tile by tile
    (`kvjax.flash`) instead of reading the [B, T, S'] one; None elsewhere.
  attend (static, decode only): attend over the first `attend` slots only
    (0: all S). With eviction 'none' the filled slots are a prefix, so a
    decode loop that knows an upper bound of the lengths reads (and
    attends) that prefix instead of the whole capacity; `mask` is then
    [B, 1, attend].
  """

  q_pos: jax.Array
  mask: jax.Array
  cos_q: jax.Array
  sin_q: jax.Array
  slots: jax.Array | None = None
  cos_k: jax.Array | None = None
  sin_k: jax.Array | None = None
  k_pos: jax.Array | None = None
  visibility: flash.Visibility | None = struct.field(pytree_node=False,
                                                     default=None)
  mode: str = struct.field(pytree_node=False, default="forward")
  want_scores: bool = struct.field(pytree_node=False, default=False)
  attend: int = struct.field(pytree_node=False, default=0)


@struct.dataclass
class ProbeRecord:
  """What a probe forward (`kvjax.probe`) carries through the layers in
  the cache's place: every layer's attention probabilities, float32
  [L, B, N, T, S] (layer l's written by layer l). Mode 'forward' only; a
  cache-less forward passes None and never builds one."""

  probs: jax.Array

  def record(self, layer, probs_BNTS):
    return self.replace(probs=self.probs.at[layer].set(
        probs_BNTS.astype(jnp.float32)))


def layer_mask(step: Step, layer):
  """This layer's mask as [B, K', T, S'] (K' = 1: shared by the heads)."""
  if step.mask.ndim == 5:  # [L, B, K', T, S]: a scoped decode step
    return step.mask[layer]
  return step.mask[:, None]


def tiled(step: Step, T: int, S: int, need_probs: bool, impl: str) -> bool:
  """Whether this prompt call's attention runs in tiles (`kvjax.flash`):
  a long prefill or extend whose probabilities nobody reads."""
  return (step.visibility is not None and
          flash.use_tiles(T, S, need_probs, impl))


def layer_slots(step: Step, layer):
  """This layer's write slots: [B, T], or [B, T, K'] for a scoped step."""
  if step.slots is not None and step.slots.ndim == 3:  # [L, B, K']
    return step.slots[layer][:, None]
  return step.slots


def attend(q_BTKGH, k_BKSH, v_BKSH, mask_BKTS, scale: float,
           impl: str = "einsum"):
  """Masked softmax attention for grouped queries.

  Args:
    q_BTKGH: queries grouped by the kv head that serves them.
    k_BKSH, v_BKSH: keys and values (heads-first, the cache layout).
    mask_BKTS: True where the key may be attended, [B, K', T, S] with K' 1
      (every head) or K (per kv head: scoped eviction). The T queries are
      the last T keys (causal: query t never sees a key past S - T + t),
      which lets T > 1 skip the tiles above the diagonal. Fully masked
      rows return a finite average over their tile's keys (they are
      padding and never read), never NaN.
    scale: softmax scale.
    impl: 'einsum' (portable); 'jax_nn' (jax.nn.dot_product_attention with
      its default implementation, which in jax 0.10 is XLA's on every
      backend); 'cudnn' (the same call with implementation='cudnn': cuDNN
      flash attention; GPU only, float16/bfloat16, head dim <= 256 and a
      multiple of 8, cache slots not sharded).
  Returns:
    out_BTKGH, probs_BKGTS (float32; None with impl='jax_nn' / 'cudnn').
  """
  B, T, K, G, H = q_BTKGH.shape
  if impl in ("jax_nn", "cudnn"):
    q_BTNH = q_BTKGH.reshape(B, T, K * G, H)
    k_BSKH = jnp.swapaxes(k_BKSH, 1, 2)
    v_BSKH = jnp.swapaxes(v_BKSH, 1, 2)
    mask_BNTS = (mask_BKTS if mask_BKTS.shape[1] == 1 else
                 jnp.repeat(mask_BKTS, G, axis=1))
    out = jax.nn.dot_product_attention(
        q_BTNH, k_BSKH.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype),
        mask=mask_BNTS, scale=scale,
        implementation="cudnn" if impl == "cudnn" else None)
    return out.reshape(B, T, K, G, H), None
  big_neg = jnp.finfo(jnp.float32).min
  if T == 1:
    # Decode: without the unit T axis XLA emits one batched product per
    # (B, K) and no transposes of the [.., S] logits: 1.16-1.29x faster
    # decode steps at 1-2k cached tokens. The logits are K @ q ('BKSH,BKGH->
    # BKSG': the cached keys are the dot's row-major left operand, read in
    # order, as `linear_t` reads weights), swapped to [.., G, S] afterwards;
    # the barrier stops XLA from folding the swap into the dot, which turns
    # it back into q @ K^T with a transposed key read: 2.6x slower key dots
    # and 1.2x slower batch-8 decode (WORKSPACE.md).
    logits_BKSG = jax.lax.optimization_barrier(
        jnp.einsum("BKSH,BKGH->BKSG", k_BKSH, q_BTKGH[:, 0],
                   preferred_element_type=jnp.float32))
    return decode_softmax_values(jnp.swapaxes(logits_BKSG, -1, -2), v_BKSH,
                                 mask_BKTS, scale, q_BTKGH.dtype)
  # Queries in tiles of C: tile [t0, t1) attends only the keys a causal
  # mask can show it (the new tokens are the last T keys, so query t sees
  # keys below S - T + t + 1), so the masked triangle above the tiles is
  # never computed; each tile's scores are [B, K, G·C, S'], one batched
  # product per (B, K) with no transposes of the scores.
  S = k_BKSH.shape[2]
  outs, probs = [], []
  for t0, t1 in query_tiles(T):
    C, S_hi = t1 - t0, S - T + t1
    q_BKQH = jnp.transpose(q_BTKGH[:, t0:t1], (0, 2, 3, 1, 4)).reshape(
        B, K, G * C, H)
    logits_BKGCS = jnp.einsum(
        "BKQH,BKSH->BKQS", q_BKQH, k_BKSH[:, :, :S_hi],
        preferred_element_type=jnp.float32).reshape(B, K, G, C, S_hi)
    logits_BKGCS = jnp.where(mask_BKTS[:, :, None, t0:t1, :S_hi],
                             logits_BKGCS * scale, big_neg)
    # Softmax with the normalisation after the value product (as flash
    # attention does): the division runs over [.., H] outputs, not [.., S]
    # probabilities, and the row maximum is a constant to the gradient
    # (softmax does not depend on it), so the backward pass has no
    # reduce-max select. The probabilities are formed only when read
    # (policies, probes); unread, XLA drops them.
    m_BKGC1 = jax.lax.stop_gradient(
        jnp.max(logits_BKGCS, axis=-1, keepdims=True))
    e_BKGCS = jnp.exp(logits_BKGCS - m_BKGC1)
    l_BKGC1 = jnp.sum(e_BKGCS, axis=-1, keepdims=True)
    probs_BKGCS = e_BKGCS / l_BKGC1
    out_BKQH = jnp.einsum(
        "BKQS,BKSH->BKQH",
        e_BKGCS.reshape(B, K, G * C, S_hi).astype(v_BKSH.dtype),
        v_BKSH[:, :, :S_hi], preferred_element_type=jnp.float32)
    out_BKQH = out_BKQH / l_BKGC1.reshape(B, K, G * C, 1)
    outs.append(jnp.transpose(out_BKQH.reshape(B, K, G, C, H),
                              (0, 3, 1, 2, 4)))
    probs.append(jnp.pad(probs_BKGCS,
                         ((0, 0),) * 4 + ((0, S - S_hi),)))
  out_BTKGH = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
  probs_BKGTS = probs[0] if len(probs) == 1 else jnp.concatenate(probs,
                                                                 axis=3)
  return out_BTKGH.astype(q_BTKGH.dtype), probs_BKGTS


QUERY_TILE = 64  # C: fwd+bwd of gqa-small-shaped training attention
MAX_QUERY_TILES = 8  # compile time grows with the tiles (one product each)


def query_tiles(T: int) -> tuple[tuple[int, int], ...]:
  """[t0, t1) query tiles of a T-query attention call: C = QUERY_TILE, or
  longer so that there are at most MAX_QUERY_TILES."""
  C = max(QUERY_TILE, -(-T // MAX_QUERY_TILES))
  return tuple((t0, min(t0 + C, T)) for t0 in range(0, T, C))


def decode_probs(logits_BKGS, mask_BKTS, scale: float):
  """Decode attention probabilities [B, K, G, S] (float32) from unscaled
  key logits: scale, mask (a fully masked row gives a finite average,
  never NaN), softmax."""
  logits_BKGS = jnp.where(mask_BKTS[:, :, 0][:, :, None], logits_BKGS * scale,
                          jnp.finfo(jnp.float32).min)
  return jax.nn.softmax(logits_BKGS, axis=-1)


def decode_softmax_values(logits_BKGS, v_BKSH, mask_BKTS, scale: float,
                          dtype):
  """The rest of decode attention (T = 1) once the key logits are known:
  scale, mask, softmax, value product. Shared by the stacked cache
  (`attend`) and the blocked one (`blocked.key_logits`).

  Returns:
    out_BTKGH in `dtype`, probs_BKGTS (float32); fully masked rows give a
    finite average, never NaN.
  """
  probs_BKGS = decode_probs(logits_BKGS, mask_BKTS, scale)
  out_BKGH = jnp.einsum("BKGS,BKSH->BKGH", probs_BKGS.astype(v_BKSH.dtype),
                        v_BKSH, preferred_element_type=jnp.float32)
  return out_BKGH[:, None].astype(dtype), probs_BKGS[:, :, :, None]


def write_kv(cache: cache_lib.KVCache, layer, slots_BT, k_BTKH, v_BTKH, *,
             fresh: bool = False):
  """Stores one layer's new keys and values at `slots` (quantized if asked;
  `fresh`: a prefill, which takes the cache as empty)."""
  dtype = cache.k.dtype

  def put(arr, new_BT):  # per-head arrays: slot axis 3
    return cache_lib.scatter_tokens(arr, layer, slots_BT, new_BT, 3)

  v_q, v_s = quant.quantize(v_BTKH, dtype)
  new = dict(v=put(cache.v, v_q))
  if v_s is not None:
    new["v_scale"] = put(cache.v_scale, v_s)
  if cache.policy.channel_keys:
    new.update(kivi.write_keys(cache, layer, slots_BT, k_BTKH, fresh=fresh))
    return cache.replace(**new)
  k_q, k_s = quant.quantize(k_BTKH, dtype)
  new["k"] = put(cache.k, k_q)
  if k_s is not None:
    new["k_scale"] = put(cache.k_scale, k_s)
  return cache.replace(**new)


def read_kv(cache: cache_lib.KVCache, layer, dtype, prefix: int = 0):
  """One layer's keys and values, [B, K, S, H] each, in `dtype` (only the
  first `prefix` slots when prefix > 0)."""
  S = prefix or cache.capacity
  v_scale = None if cache.v_scale is None else cache.v_scale[layer, :, :, :S]
  v_BKSH = quant.dequantize(cache.v[layer, :, :, :S], v_scale, dtype)
  if cache.policy.channel_keys:
    return kivi.read_keys(cache, layer, dtype, S), v_BKSH
  k_scale = None if cache.k_scale is None else cache.k_scale[layer, :, :, :S]
  return quant.dequantize(cache.k[layer, :, :, :S], k_scale, dtype), v_BKSH


def extends_in_place(step: Step, cache) -> bool:
  """Whether this call is an extend whose old keys can be read from the
  cache it has just written: an append-only cache (the write hides no old
  token) storing rotated keys (positions 'original')."""
  return (step.mode == "extend" and cache.policy.append_only and
          cache.policy.positions != "cache")


def cached_keys(cache, layer, dtype, pos_BS) -> flash.CachedKeys | None:
  """One layer's cached keys and values (slot positions `pos_BS`) as
  tiles read in place from the stacked arrays (`flash.CachedKeys`): a
  slice of the stacked cache taken outside the tile loop is a copy of the
  layer, and reading the cache from before this call's write keeps a copy
  of the whole cache alive (XLA's memory analysis of a 32k extend,
  WORKSPACE.md); a dynamic slice of the written cache inside the loop is
  neither. None where a tile cannot be read alone: KIVI's per-channel key
  groups (`kivi.read_keys`), or a cache that is not a stacked `KVCache`.
  """
  if not isinstance(cache, cache_lib.KVCache) or cache.policy.channel_keys:
    return None

  def read(start, size):
    k, v, k_s, v_s = (None if x is None else
                      cache_lib.read_slots(x, layer, start, size, 3)
                      for x in (cache.k, cache.v, cache.k_scale,
                                cache.v_scale))
    return (quant.dequantize(k, k_s, dtype), quant.dequantize(v, v_s, dtype))

  # Append-only: slot = position, so the used slots are a prefix.
  return flash.CachedKeys(read, pos_BS, used=jnp.max(pos_BS) + 1)


# ---- the decode cache protocol ----------------------------------------------
@dataclasses.dataclass(frozen=True)
class DecodeCache:
  """What a decode step needs of a cache kind: the only place its layout
  shows. `gqa_attention` looks the kind up by the cache's type and never
  branches on it.

  write(cache, layer, slots_BT, k_BTKH, v_BTKH) -> cache: store the new
    token's key and value (slot S: dropped).
  read(cache, layer, dtype, prefix) -> (keys, v_BKSH): one layer's keys in
    the kind's own layout and its values (the first `prefix` slots when
    prefix > 0).
  attend(q_BTKGH, keys, v_BKSH, mask_BKTS, scale, impl) -> (out_BTKGH,
    probs_BKGTS or None): masked softmax attention of the step's queries.
  latent_attend(q_lat_BTNC, q_rope_BTNR, c, r, mask_B1TS, scale) ->
    (o_lat_BTNC, probs_BNTS): MLA's absorbed decode attention over what
    `read` returned (latents, rotary keys); None: the float one,
    `kvjax.mla.absorbed_decode`.
  """
  write: Callable
  read: Callable
  attend: Callable | None
  latent_attend: Callable | None = None


_DECODE_CACHES: dict[type, DecodeCache] = {}


def register_decode_cache(kind: type, ops: DecodeCache):
  """Makes `kind` a decode cache (`kvjax.blocked` registers `BlockedKV`)."""
  _DECODE_CACHES[kind] = ops


def decode_cache(cache) -> DecodeCache:
  try:
    return _DECODE_CACHES[type(cache)]
  except KeyError:
    raise TypeError(f"{type(cache).__name__} is not a registered decode "
                    "cache (attention.register_decode_cache)") from None


register_decode_cache(cache_lib.KVCache,
                      DecodeCache(write=write_kv, read=read_kv, attend=attend))


def observe_scores(cache, probs_BKGTS, k_BKSH, mask_BKTS, step: Step,
                   layer):
  """Folds what one layer call shows a scored policy into `cache.scores`
  (`kvjax.policies`: attention received, key norms, ...).

  probs_BKGTS: the call's attention probabilities (None from fused
  attention; policies that need them are refused before compute).
  k_BKSH: the call's keys as attended (K = N, G = 1 for MLA's per-head
  keys); mask_BKTS: the call's mask (its last query row tells which keys
  hold a visible token). A global policy's scores [B, S] sum over layers
  and heads; a scoped one's [L, B, K', S] hold each layer's (and head's)
  own.
  """
  if not step.want_scores:
    return cache
  ev = cache.policy.evictor
  S = cache.capacity
  seen_BKS = ev.observe(probs_BKGTS, k_BKSH, mask_BKTS[:, :, -1],
                        step.mode)
  if cache.scores.ndim == 4:  # scoped: this layer's own
    seen_BKS = policies_base.reduce_heads(seen_BKS, cache.scores.shape[2])
    return cache.replace(scores=cache.scores.at[layer].add(seen_BKS))
  seen_BS = jnp.sum(seen_BKS, axis=1)
  if step.mode == "prefill":
    # Prefill keys are the new tokens; move their totals to their slots.
    B, T = step.slots.shape
    b_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    add = jnp.zeros((B, S), jnp.float32).at[b_BT, step.slots].add(
        seen_BS, mode="drop")
    return cache.replace(scores=cache.scores + add)
  return cache.replace(scores=cache.scores + seen_BS)


def compress_prompt(cache, probs_BKGTS, k_BKTH, mask_BKTT, step: Step,
                    layer):
  """A scoped policy's prefill for one layer: which prompt tokens this
  layer (and each head) keeps, packed into slots 0..n-1 in stream order.

  Args:
    cache: the cache being prefilled (scoped policy).
    probs_BKGTS, k_BKTH, mask_BKTT: the prompt's attention, keys and
      mask in this layer.
    step: the prefill step (q_pos [B, T]).
  Returns:
    (idx_BKS, cache): for every scope and slot, the prompt index of the
    token it keeps (T where the slot stays empty), and the cache with this
    layer's positions, scores and budget set.
  """
  ev, S = cache.policy.evictor, cache.capacity
  Kp = cache.positions.shape[2]
  q_pos_BT = step.q_pos
  B, T = q_pos_BT.shape
  real_BT = q_pos_BT >= 0
  total_B = jnp.sum(real_BT, axis=1)
  score_BKT = policies_base.reduce_heads(
      ev.observe(probs_BKGTS, k_BKTH, mask_BKTT[:, :, -1], "prefill"), Kp)
  protected_BT = ev.protected(q_pos_BT, total_B[:, None])
  budget_BK = cache.budget[layer]
  keep_BKT = ev.prefill_keep(score_BKT, protected_BT, real_BT, budget_BK, S)
  # Kept tokens first, in stream order; then the rest (their slots empty).
  t_11T = jnp.arange(T).reshape(1, 1, T)
  order_BKT = jnp.argsort(jnp.where(keep_BKT, t_11T, T + t_11T), axis=-1)
  kept_BK = jnp.sum(keep_BKT, axis=-1)
  if T >= S:
    idx_BKS = order_BKT[..., :S]
  else:
    idx_BKS = jnp.concatenate(
        [order_BKT, jnp.full((B, Kp, S - T), T, order_BKT.dtype)], axis=-1)
  valid_BKS = jnp.arange(S).reshape(1, 1, S) < kept_BK[..., None]
  idx_BKS = jnp.where(valid_BKS, idx_BKS, T)
  safe_BKS = jnp.minimum(idx_BKS, T - 1)
  pos_BKS = jnp.take_along_axis(
      jnp.broadcast_to(q_pos_BT[:, None], (B, Kp, T)), safe_BKS, axis=-1)
  kept_scores_BKS = jnp.take_along_axis(score_BKT, safe_BKS, axis=-1)
  cache = cache.replace(
      positions=cache.positions.at[layer].set(
          jnp.where(valid_BKS, pos_BKS, cache_lib.EMPTY)),
      scores=cache.scores.at[layer].set(
          jnp.where(valid_BKS, kept_scores_BKS, 0.0)),
      budget=cache.budget.at[layer].set(
          ev.allot(kept_BK, budget_BK, S).astype(jnp.int32)))
  return idx_BKS, cache


def gather_tokens(x_BTKH, idx_BKS):
  """[B, S, K, H]: for every head, the tokens `idx_BKS` (K' = 1 or K)
  picks (indices past the end give the last token: their slots are
  marked empty)."""
  B, T, K, H = x_BTKH.shape
  idx = jnp.minimum(idx_BKS, T - 1)
  idx = jnp.broadcast_to(idx, (B, K, idx.shape[-1]))
  x_BKTH = jnp.swapaxes(x_BTKH, 1, 2)
  out_BKSH = jnp.take_along_axis(x_BKTH, idx[..., None], axis=2)
  return jnp.swapaxes(out_BKSH, 1, 2)


def gqa_attention(p, x_BTD, step: Step, cache, layer, config: ModelConfig):
  """One GQA/MHA/MQA attention layer.

  Args:
    p: this layer's attention params, either layout (`kvjax.projections`).
    x_BTD: normalized input.
    step: the call context.
    cache: a registered decode cache (`DecodeCache`: KVCache, a decode
      segment's `blocked.BlockedKV`), or None (mode
      'forward'; a probe forward's `ProbeRecord`).
    layer: index of this layer in the cache's L axis (traced).
  Returns:
    (y_BTD, new_cache)
  """
  B, T, _ = x_BTD.shape
  N, K, G, H = (config.num_heads, config.num_kv_heads, config.groups,
                config.head_dim)
  dtype = x_BTD.dtype
  q_BTNH, k_BTKH, v_BTKH = projections.qkv(p, x_BTD, config)
  cos_q, sin_q = step.cos_q[:, :, None], step.sin_q[:, :, None]
  q_BTNH = apply_rope(q_BTNH, cos_q, sin_q, config.rope_layout)
  pre_rope = step.mode != "forward" and cache.policy.positions == "cache"
  k_rot_BTKH = apply_rope(k_BTKH, cos_q, sin_q, config.rope_layout)
  # `cache` position mode stores keys unrotated and rotates at read time.
  k_store_BTKH = k_BTKH if pre_rope else k_rot_BTKH

  q_BTKGH = q_BTNH.reshape(B, T, K, G, H)
  mask_BKTS = layer_mask(step, layer)
  compress = step.mode == "prefill" and cache.policy.scoped
  attend_fn = attend
  if step.mode == "decode":
    # The cache kind (stacked KVCache, a segment's BlockedKV, ...) decides
    # how keys are stored and read (`DecodeCache`).
    kind = decode_cache(cache)
    cache = kind.write(cache, layer, layer_slots(step, layer), k_store_BTKH,
                       v_BTKH)
    k_BKSH, v_BKSH = kind.read(cache, layer, dtype, step.attend)
    if pre_rope:
      k_BKSH = apply_rope(k_BKSH, step.cos_k[:, None], step.sin_k[:, None],
                          config.rope_layout)
    attend_fn = kind.attend
  else:
    k_BKSH = jnp.swapaxes(k_rot_BTKH, 1, 2)
    v_BKSH = jnp.swapaxes(v_BTKH, 1, 2)
    if step.mode == "extend":
      k_old, v_old = read_kv(cache, layer, dtype)
      k_BKSH = jnp.concatenate([k_old, k_BKSH], axis=2)
      v_BKSH = jnp.concatenate([v_old, v_BKSH], axis=2)
    if step.mode in ("prefill", "extend") and not compress:
      cache = write_kv(cache, layer, step.slots, k_store_BTKH, v_BTKH,
                       fresh=step.mode == "prefill")
  # A tiled extend of an append-only cache reads the old keys in place from
  # the cache it just wrote (`cached_keys`), so no layer is copied whole;
  # otherwise it attends the concatenation (when unused, XLA drops it).
  cached = None
  if extends_in_place(step, cache):
    # The old slots of the written cache: an append-only write leaves them
    # as they were, and the cache's positions (updated after the last
    # layer) still show only them. The new keys are attended as computed
    # (unquantized), as the concatenation would.
    cached = cached_keys(cache, layer, dtype, cache.positions)

  need_probs = (compress or step.want_scores or
                isinstance(cache, ProbeRecord))
  if step.mode != "decode" and tiled(step, T, k_BKSH.shape[2], need_probs,
                                     config.attention_impl):
    if cached is not None:
      out_BTKGH = flash.attend(q_BTKGH, jnp.swapaxes(k_rot_BTKH, 1, 2),
                               jnp.swapaxes(v_BTKH, 1, 2), step.q_pos,
                               step.q_pos, step.visibility,
                               config.softmax_scale, cached=cached)
    else:
      out_BTKGH = flash.attend(q_BTKGH, k_BKSH, v_BKSH, step.q_pos,
                               step.k_pos, step.visibility,
                               config.softmax_scale)
    probs = None
  else:
    out_BTKGH, probs = attend_fn(q_BTKGH, k_BKSH, v_BKSH, mask_BKTS,
                                 config.softmax_scale, config.attention_impl)
  if compress:
    # Every layer sees the whole prompt; it keeps what its policy chooses.
    idx_BKS, cache = compress_prompt(cache, probs, k_BKSH, mask_BKTS, step,
                                     layer)
    S = cache.capacity
    slots_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    cache = write_kv(cache, layer, slots_BS,
                     gather_tokens(k_store_BTKH, idx_BKS),
                     gather_tokens(v_BTKH, idx_BKS), fresh=True)
  elif isinstance(cache, ProbeRecord):
    cache = cache.record(layer, probs.reshape(B, N, T, -1))
  elif cache is not None:
    cache = observe_scores(cache, probs, k_BKSH, mask_BKTS, step, layer)
  return projections.attn_out(p, out_BTKGH.reshape(B, T, N, H),
                              config), cache
