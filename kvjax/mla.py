"""DeepSeek-V2/V3 multi-head latent attention (MLA) over a latent cache.

Per token the cache holds one latent c_kv [C] (RMS-normed) and one rotary
key k_rope [R] shared by all heads, instead of per-head keys and values. Per
head, keys are [k_nope | k_rope] with k_nope = c_kv · W_UK [C, N, P] and
values are c_kv · W_UV [C, N, O].

Two decode paths, equal up to float rounding:
  naive     expand the cached latents to per-head keys and values every
            step (what MaxText and transformers do);
  absorbed  fold W_UK into the query and W_UV into the output, so attention
            runs directly over the latents ('BTNC,BSC->BNTS') and per-head
            keys and values never exist.
The no-cache forward, prefill and extend use the expanded form (a prompt's
expansion is amortized over its T queries).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import flash
from kvjax import kivi
from kvjax import projections
from kvjax import quant
from kvjax.attention import (DecodeCache, ProbeRecord, Step, compress_prompt,
                             decode_cache, extends_in_place, layer_mask,
                             layer_slots, observe_scores, query_tiles,
                             register_decode_cache, tiled)
from kvjax.cache import LatentCache, read_slots, scatter_tokens
from kvjax.config import ModelConfig
from kvjax.layers import apply_rope, rms_norm

MLA_NORM_EPS = 1e-6  # DeepSeek hard-codes the q_a / kv_a norm eps.


def write_latent(cache: LatentCache, layer, slots_BT, c_BTC, r_BTR, *,
                 fresh: bool = False):
  """Stores one layer's latents and rotary keys at `slots` (`fresh`: a
  prefill, which takes the cache as empty)."""
  if cache.policy.channel_keys:  # KIVI: per channel over token groups
    new = {}
    for x, (payload, scale, resid) in ((c_BTC, ("c_kv", "c_scale", "c_resid")),
                                       (r_BTR, ("k_rope", "r_scale",
                                                "r_resid"))):
      out = kivi.write(getattr(cache, payload), getattr(cache, scale),
                       getattr(cache, resid), layer, cache.positions,
                       slots_BT, x, group=cache.policy.key_group, fresh=fresh)
      new.update({payload: out["payload"], scale: out["scale"],
                  resid: out["resid"]})
    return cache.replace(**new)
  dtype = cache.c_kv.dtype
  c_q, c_s = quant.quantize(c_BTC, dtype)
  r_q, r_s = quant.quantize(r_BTR, dtype)
  new = dict(c_kv=scatter_tokens(cache.c_kv, layer, slots_BT, c_q, 2),
             k_rope=scatter_tokens(cache.k_rope, layer, slots_BT, r_q, 2))
  if c_s is not None:
    new["c_scale"] = scatter_tokens(cache.c_scale, layer, slots_BT, c_s, 2)
    new["r_scale"] = scatter_tokens(cache.r_scale, layer, slots_BT, r_s, 2)
  return cache.replace(**new)


def read_latent(cache: LatentCache, layer, dtype, prefix: int = 0):
  """One layer's latents [B, S, C] and rotary keys [B, S, R] in `dtype`
  (only the first `prefix` slots when prefix > 0)."""
  S = prefix or cache.capacity
  if cache.policy.channel_keys:
    g = cache.policy.key_group
    return (kivi.read(cache.c_kv, cache.c_scale, cache.c_resid, layer,
                      cache.positions, g, dtype, S),
            kivi.read(cache.k_rope, cache.r_scale, cache.r_resid, layer,
                      cache.positions, g, dtype, S))
  c_s = None if cache.c_scale is None else cache.c_scale[layer, :, :S]
  r_s = None if cache.r_scale is None else cache.r_scale[layer, :, :S]
  return (quant.dequantize(cache.c_kv[layer, :, :S], c_s, dtype),
          quant.dequantize(cache.k_rope[layer, :, :S], r_s, dtype))


def _softmax(logits_BNTS, mask_B1TS):
  big_neg = jnp.finfo(jnp.float32).min
  logits_BNTS = jnp.where(mask_B1TS, logits_BNTS, big_neg)
  return jax.nn.softmax(logits_BNTS, axis=-1)


def absorbed_decode(q_lat_BTNC, q_rope_BTNR, c_BSC, r_BSR, mask_B1TS,
                    scale: float):
  """Absorbed decode attention (T = 1) over float latents c [B, S, C] and
  rotary keys r [B, S, R]: a latent decode cache's `latent_attend` unless
  its kind registers its own (`attention.DecodeCache`).

  Returns:
    o_lat_BTNC (the latent output, before W_UV), probs_BNTS.
  """
  f32 = jnp.float32
  # Latents @ queries, the cache as the dot's row-major left operand (see
  # `attention.attend`), swapped to [B, N, 1, S] after the barrier.
  logits_BSN = jax.lax.optimization_barrier(
      jnp.einsum("BSC,BNC->BSN", c_BSC, q_lat_BTNC[:, 0],
                 preferred_element_type=f32) +
      jnp.einsum("BSR,BNR->BSN", r_BSR, q_rope_BTNR[:, 0],
                 preferred_element_type=f32))
  logits_BNTS = jnp.swapaxes(logits_BSN, 1, 2)[:, :, None]
  probs_BNTS = _softmax(logits_BNTS * scale, mask_B1TS)
  o_lat_BTNC = jnp.einsum("BNTS,BSC->BTNC",
                          probs_BNTS.astype(q_lat_BTNC.dtype), c_BSC)
  return o_lat_BTNC, probs_BNTS


def latent_attend(p, q_nope_BTNP, q_rope_BTNR, c_BSC, r_BSR, mask_B1TS,
                  scale: float, path: str, decode_attend=absorbed_decode):
  """Attention of per-head queries over latents (mask [B, 1, T, S]: the
  latent is shared by every head). A decode step (T = 1) on the absorbed
  path runs `decode_attend` (the cache kind's `latent_attend`) over `c`
  and `r` as its kind's `read` returned them.

  Returns:
    out_BTNO (per-head values before the output projection), probs_BNTS.
  """
  dtype = q_nope_BTNP.dtype
  f32 = jnp.float32
  if path == "absorbed":
    q_lat_BTNC = projections.absorb_q(p, q_nope_BTNP)
    if q_lat_BTNC.shape[1] == 1:
      o_lat_BTNC, probs_BNTS = decode_attend(q_lat_BTNC, q_rope_BTNR, c_BSC,
                                             r_BSR, mask_B1TS, scale)
    else:
      logits_BNTS = (
          jnp.einsum("BTNC,BSC->BNTS", q_lat_BTNC, c_BSC,
                     preferred_element_type=f32) +
          jnp.einsum("BTNR,BSR->BNTS", q_rope_BTNR, r_BSR,
                     preferred_element_type=f32))
      probs_BNTS = _softmax(logits_BNTS * scale, mask_B1TS)
      o_lat_BTNC = jnp.einsum("BNTS,BSC->BTNC", probs_BNTS.astype(dtype),
                              c_BSC)
    out_BTNO = projections.absorb_out(p, o_lat_BTNC)
  else:
    k_nope_BSNP, v_BSNO = projections.expand_kv(p, c_BSC)
    # Causal query tiles, as `attention.attend`: the queries are the last
    # T keys, so tile [t0, t1) reads keys below S - T + t1 only.
    T, S = q_nope_BTNP.shape[1], c_BSC.shape[1]
    outs, probs = [], []
    for t0, t1 in query_tiles(T):
      hi = S - T + t1
      rope_BNCS = jnp.einsum("BTNR,BSR->BNTS", q_rope_BTNR[:, t0:t1],
                             r_BSR[:, :hi], preferred_element_type=f32)
      nope_BNCS = jnp.einsum("BTNP,BSNP->BNTS", q_nope_BTNP[:, t0:t1],
                             k_nope_BSNP[:, :hi], preferred_element_type=f32)
      probs_BNCS = _softmax((nope_BNCS + rope_BNCS) * scale,
                            mask_B1TS[:, :, t0:t1, :hi])
      outs.append(jnp.einsum("BNTS,BSNO->BTNO", probs_BNCS.astype(dtype),
                             v_BSNO[:, :hi]))
      probs.append(jnp.pad(probs_BNCS, ((0, 0),) * 3 + ((0, S - hi),)))
    out_BTNO = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    probs_BNTS = probs[0] if len(probs) == 1 else jnp.concatenate(probs,
                                                                  axis=2)
  return out_BTNO.astype(dtype), probs_BNTS


def tiled_expanded(p, q_nope_BTNP, q_rope_BTNR, c_BSC, r_BSR, step: Step,
                   scale: float, cached_read=None, cached_pos_BS=None):
  """A long prompt call's attention in tiles (`kvjax.flash`): the latents
  expanded to per-head keys [k_nope | k_rope] and values, each head its
  own kv head (K = N, G = 1).

  c_BSC, r_BSR: the keys' latents and rotary keys, or with `cached_read`
  only the call's new ones; cached_read(start, size) -> (c [B, size, C],
  r [B, size, R]) reads the cache's earlier slots (positions
  cached_pos_BS, a prefix in use) tile by tile, each tile expanded inside
  the loop, so neither the cache nor its per-head expansion ever exists
  whole (`cached_latents`).

  Returns:
    out_BTNO.
  """
  q_BTN1H = jnp.concatenate([q_nope_BTNP, q_rope_BTNR], axis=-1)[:, :, :,
                                                                 None]

  def expand(c_BXC, r_BXR):  # -> k [B, N, X, P + R], v [B, N, X, O]
    k_nope_BXNP, v_BXNO = projections.expand_kv(p, c_BXC)
    B, X, N, _ = k_nope_BXNP.shape
    k_BXNH = jnp.concatenate(
        [k_nope_BXNP, jnp.broadcast_to(r_BXR[:, :, None],
                                       (B, X, N, r_BXR.shape[-1]))], axis=-1)
    return jnp.swapaxes(k_BXNH, 1, 2), jnp.swapaxes(v_BXNO, 1, 2)

  k_BNSH, v_BNSO = expand(c_BSC, r_BSR)
  if cached_read is None:
    out_BTN1O = flash.attend(q_BTN1H, k_BNSH, v_BNSO, step.q_pos, step.k_pos,
                             step.visibility, scale)
  else:
    cached = flash.CachedKeys(lambda start, size: expand(*cached_read(start,
                                                                      size)),
                              cached_pos_BS, used=jnp.max(cached_pos_BS) + 1)
    out_BTN1O = flash.attend(q_BTN1H, k_BNSH, v_BNSO, step.q_pos, step.q_pos,
                             step.visibility, scale, cached=cached)
  return out_BTN1O[:, :, :, 0]


def cached_latents(cache, layer, dtype):
  """`tiled_expanded`'s cached_read for a stacked `LatentCache`: slots
  [start, start + size) of one layer, dequantized, read in place inside
  the tile loop (as `attention.cached_keys`); None for KIVI's grouped
  latents or another cache kind."""
  if not isinstance(cache, LatentCache) or cache.policy.channel_keys:
    return None

  def read(start, size):
    c, r, c_s, r_s = (None if x is None else
                      read_slots(x, layer, start, size, 2)
                      for x in (cache.c_kv, cache.k_rope, cache.c_scale,
                                cache.r_scale))
    return (quant.dequantize(c, c_s, dtype), quant.dequantize(r, r_s, dtype))

  return read


def mla_attention(p, x_BTD, step: Step, cache, layer, config: ModelConfig):
  """One MLA layer; same contract as `kvjax.attention.gqa_attention`.

  Params: q [D,N,H] or (q_a [D,Q], q_a_norm [Q], q_b [Q,N,H]) (H = P + R);
  kv_a [D,C+R]; kv_a_norm [C]; w_uk [C,N,P]; w_uv [C,N,O]; o [N,O,D]; or
  their packed forms (`kvjax.projections`).
  """
  C, P = config.kv_lora_rank, config.qk_nope_head_dim
  dtype = x_BTD.dtype
  B, T, _ = x_BTD.shape
  if config.q_lora_rank:
    q_lat_BTQ = rms_norm(projections.mla_q_a(p, x_BTD), p["q_a_norm"],
                         MLA_NORM_EPS)
    q_BTNH = projections.mla_q_b(p, q_lat_BTQ, config)
  else:
    q_BTNH = projections.mla_q(p, x_BTD, config)
  q_nope_BTNP, q_rope_BTNR = q_BTNH[..., :P], q_BTNH[..., P:]
  ckv = projections.mla_kv_a(p, x_BTD)  # [B, T, C + R]
  c_BTC = rms_norm(ckv[..., :C], p["kv_a_norm"], MLA_NORM_EPS)
  r_BTR = ckv[..., C:]
  cos_q, sin_q = step.cos_q, step.sin_q
  q_rope_BTNR = apply_rope(q_rope_BTNR, cos_q[:, :, None], sin_q[:, :, None],
                           config.rope_layout)
  r_rot_BTR = apply_rope(r_BTR, cos_q, sin_q, config.rope_layout)
  pre_rope = step.mode != "forward" and cache.policy.positions == "cache"
  r_store_BTR = r_BTR if pre_rope else r_rot_BTR

  path = "naive"
  decode_attend = absorbed_decode
  compress = step.mode == "prefill" and cache.policy.scoped
  if step.mode == "decode":
    path = config.mla_decode
    # The cache kind (LatentCache, a paged pool, ...) decides how latents
    # are stored, read and attended (`attention.DecodeCache`).
    kind = decode_cache(cache)
    decode_attend = kind.latent_attend or absorbed_decode
    cache = kind.write(cache, layer, layer_slots(step, layer), c_BTC,
                       r_store_BTR)
    c_BSC, r_BSR = kind.read(cache, layer, dtype, step.attend)
    if pre_rope:
      # Only the shared rotary key is position-dependent: the latent part
      # needs no re-rotation, which makes cache-position mode cheap for MLA.
      r_BSR = apply_rope(r_BSR, step.cos_k, step.sin_k, config.rope_layout)
  else:
    c_BSC, r_BSR = c_BTC, r_rot_BTR
    if step.mode == "extend":
      c_old, r_old = read_latent(cache, layer, dtype)
      c_BSC = jnp.concatenate([c_old, c_BSC], axis=1)
      r_BSR = jnp.concatenate([r_old, r_BSR], axis=1)
    if step.mode in ("prefill", "extend") and not compress:
      cache = write_latent(cache, layer, step.slots, c_BTC, r_store_BTR,
                           fresh=step.mode == "prefill")

  mask_B1TS = layer_mask(step, layer)
  need_probs = (compress or step.want_scores or
                isinstance(cache, ProbeRecord))
  # A tiled extend of an append-only cache reads the old latents in place
  # from the written cache (its positions, updated after the last layer,
  # still show only them), as `attention.gqa_attention` does.
  cached_read = None
  if extends_in_place(step, cache):
    cached_read = cached_latents(cache, layer, dtype)
  if step.mode != "decode" and tiled(step, T, c_BSC.shape[1], need_probs,
                                     "einsum"):
    if cached_read is not None:
      out_BTNO = tiled_expanded(p, q_nope_BTNP, q_rope_BTNR, c_BTC,
                                r_rot_BTR, step, config.softmax_scale,
                                cached_read, cache.positions)
    else:
      out_BTNO = tiled_expanded(p, q_nope_BTNP, q_rope_BTNR, c_BSC, r_BSR,
                                step, config.softmax_scale)
    probs_BNTS = None
  else:
    out_BTNO, probs_BNTS = latent_attend(p, q_nope_BTNP, q_rope_BTNR, c_BSC,
                                         r_BSR, mask_B1TS,
                                         config.softmax_scale, path,
                                         decode_attend)
  if isinstance(cache, ProbeRecord):
    cache = cache.record(layer, probs_BNTS)
  elif cache is not None and (compress or step.want_scores):
    # MLA's keys, as a scored policy sees them: the latent entry [c | r]
    # (one "kv head"); its probabilities per query head (G = 1).
    k_lat = jnp.concatenate([c_BSC, r_BSR], axis=-1)[:, None]  # [B,1,S,C+R]
    probs_BNGTS = probs_BNTS[:, :, None]
    if compress:
      idx_B1S, cache = compress_prompt(cache, probs_BNGTS, k_lat,
                                       mask_B1TS, step, layer)
      S = cache.capacity
      idx_BS = jnp.minimum(idx_B1S[:, 0], T - 1)
      slots_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
      pick = lambda x: jnp.take_along_axis(x, idx_BS[..., None], axis=1)
      cache = write_latent(cache, layer, slots_BS, pick(c_BTC),
                           pick(r_store_BTR), fresh=True)
    else:
      cache = observe_scores(cache, probs_BNGTS, k_lat, mask_B1TS, step,
                             layer)
  return projections.attn_out(p, out_BTNO, config), cache


# A latent decode cache's attention is `latent_attend` (it needs the layer's
# params); its absorbed decode core over float latents is `absorbed_decode`.
register_decode_cache(LatentCache, DecodeCache(write=write_latent,
                                               read=read_latent, attend=None))
