"""DeepSeek-V2/V3 multi-head latent attention (MLA) over a latent cache.

Per token the cache holds one latent c_kv [C] (RMS-normed) and one rotary
key k_rope [R] shared by all heads, instead of per-head keys and values. Per
head, keys are [k_nope | k_rope] with k_nope = c_kv · W_UK [C, N, P] and
values are c_kv · W_UV [C, N, V].

Two decode paths, equal up to float rounding:
  naive     expand the cached latents to per-head K and V every step (what
            MaxText and transformers do);
  absorbed  fold W_UK into the query and W_UV into the output, so attention
            runs directly over the latents ('BTNC,BSC->BNTS') and per-head
            K/V never exist.
The no-cache forward, prefill and extend use the expanded form (a prompt's
expansion is amortized over its T queries).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import kivi
from kvjax import quant
from kvjax.attention import (Step, compress_prompt, layer_mask, layer_slots,
                             observe_scores, project_out)
from kvjax.cache import LatentCache, scatter_tokens
from kvjax.config import ModelConfig
from kvjax.layers import apply_rope, linear_t, linear_t_heads, rms_norm

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
  P = prefix or cache.capacity
  if cache.policy.channel_keys:
    g = cache.policy.key_group
    return (kivi.read(cache.c_kv, cache.c_scale, cache.c_resid, layer,
                      cache.positions, g, dtype, P),
            kivi.read(cache.k_rope, cache.r_scale, cache.r_resid, layer,
                      cache.positions, g, dtype, P))
  c_s = None if cache.c_scale is None else cache.c_scale[layer, :, :P]
  r_s = None if cache.r_scale is None else cache.r_scale[layer, :, :P]
  return (quant.dequantize(cache.c_kv[layer, :, :P], c_s, dtype),
          quant.dequantize(cache.k_rope[layer, :, :P], r_s, dtype))


def _softmax(logits_BNTS, mask_B1TS):
  big_neg = jnp.finfo(jnp.float32).min
  logits_BNTS = jnp.where(mask_B1TS, logits_BNTS, big_neg)
  return jax.nn.softmax(logits_BNTS, axis=-1)


def latent_attend(p, q_nope_BTNP, q_rope_BTNR, c_BSC, r_BSR, mask_B1TS,
                  scale: float, path: str):
  """Attention of per-head queries over latents (mask [B, 1, T, S]: the
  latent is shared by every head).

  Returns:
    out_BTNV (per-head values before the output projection), probs_BNTS.
  """
  dtype = q_nope_BTNP.dtype
  f32 = jnp.float32
  packed = "w_uk_t" in p  # kvjax.packed: [N, C, P] and [N, V, C]
  if path == "absorbed":
    if packed:
      q_lat_BTNC = linear_t_heads(q_nope_BTNP, p["w_uk_t"])
    else:
      q_lat_BTNC = jnp.einsum("BTNP,CNP->BTNC", q_nope_BTNP, p["w_uk"])
    if q_lat_BTNC.shape[1] == 1:
      # Decode: latents @ queries, the cache as the dot's row-major left
      # operand (see `attention.attend`), swapped to [B, N, 1, S] after the
      # barrier.
      logits_BSN = jax.lax.optimization_barrier(
          jnp.einsum("BSC,BNC->BSN", c_BSC, q_lat_BTNC[:, 0],
                     preferred_element_type=f32) +
          jnp.einsum("BSR,BNR->BSN", r_BSR, q_rope_BTNR[:, 0],
                     preferred_element_type=f32))
      logits_BNTS = jnp.swapaxes(logits_BSN, 1, 2)[:, :, None]
    else:
      logits_BNTS = (
          jnp.einsum("BTNC,BSC->BNTS", q_lat_BTNC, c_BSC,
                     preferred_element_type=f32) +
          jnp.einsum("BTNR,BSR->BNTS", q_rope_BTNR, r_BSR,
                     preferred_element_type=f32))
    probs_BNTS = _softmax(logits_BNTS * scale, mask_B1TS)
    o_lat_BTNC = jnp.einsum("BNTS,BSC->BTNC", probs_BNTS.astype(dtype), c_BSC)
    if packed:
      out_BTNV = linear_t_heads(o_lat_BTNC, p["w_uv_t"])
    else:
      out_BTNV = jnp.einsum("BTNC,CNV->BTNV", o_lat_BTNC, p["w_uv"])
  else:
    if packed:
      k_nope_BSNP = jnp.einsum("BSC,NCP->BSNP", c_BSC, p["w_uk_t"])
      v_BSNV = jnp.einsum("BSC,NVC->BSNV", c_BSC, p["w_uv_t"])
    else:
      k_nope_BSNP = jnp.einsum("BSC,CNP->BSNP", c_BSC, p["w_uk"])
      v_BSNV = jnp.einsum("BSC,CNV->BSNV", c_BSC, p["w_uv"])
    rope_BNTS = jnp.einsum("BTNR,BSR->BNTS", q_rope_BTNR, r_BSR,
                           preferred_element_type=f32)
    nope_BNTS = jnp.einsum("BTNP,BSNP->BNTS", q_nope_BTNP, k_nope_BSNP,
                           preferred_element_type=f32)
    probs_BNTS = _softmax((nope_BNTS + rope_BNTS) * scale, mask_B1TS)
    out_BTNV = jnp.einsum("BNTS,BSNV->BTNV", probs_BNTS.astype(dtype), v_BSNV)
  return out_BTNV.astype(dtype), probs_BNTS


def mla_attention(p, x_BTD, step: Step, cache, layer, config: ModelConfig):
  """One MLA layer; same contract as `kvjax.attention.gqa_attention`.

  Params: q [D,N,P+R] or (q_a [D,Q], q_a_norm [Q], q_b [Q,N,P+R]);
  kv_a [D,C+R]; kv_a_norm [C]; w_uk [C,N,P]; w_uv [C,N,V]; o [N,V,D]; or
  their packed forms (`kvjax.packed`: q_t / q_a_t, q_b_t, kv_a_t, w_uk_t,
  w_uv_t, o_t).
  """
  C, P = config.kv_lora_rank, config.qk_nope_head_dim
  dtype = x_BTD.dtype
  B, T, _ = x_BTD.shape
  N = config.num_heads
  if "q_a_t" in p:  # kvjax.packed: dense weights [out, in]
    # Every input product here is fed by an RMSNorm (`norm_input`).
    q_lat_BTQ = rms_norm(linear_t(x_BTD, p["q_a_t"], norm_input=True),
                         p["q_a_norm"], MLA_NORM_EPS)
    q_BTNJ = linear_t(q_lat_BTQ, p["q_b_t"],
                      norm_input=True).reshape(B, T, N, -1)
  elif "q_t" in p:
    q_BTNJ = linear_t(x_BTD, p["q_t"], norm_input=True).reshape(B, T, N, -1)
  elif "q_a" in p:
    q_lat_BTQ = rms_norm(x_BTD @ p["q_a"], p["q_a_norm"], MLA_NORM_EPS)
    q_BTNJ = jnp.einsum("BTQ,QNJ->BTNJ", q_lat_BTQ, p["q_b"])
  else:
    q_BTNJ = jnp.einsum("BTD,DNJ->BTNJ", x_BTD, p["q"])
  q_nope_BTNP, q_rope_BTNR = q_BTNJ[..., :P], q_BTNJ[..., P:]
  ckv_BTJ = (linear_t(x_BTD, p["kv_a_t"], norm_input=True) if "kv_a_t" in p
             else x_BTD @ p["kv_a"])
  c_BTC = rms_norm(ckv_BTJ[..., :C], p["kv_a_norm"], MLA_NORM_EPS)
  r_BTR = ckv_BTJ[..., C:]
  cos_q, sin_q = step.cos_q, step.sin_q
  q_rope_BTNR = apply_rope(q_rope_BTNR, cos_q[:, :, None], sin_q[:, :, None],
                           config.rope_layout)
  r_rot_BTR = apply_rope(r_BTR, cos_q, sin_q, config.rope_layout)
  pre_rope = cache is not None and cache.policy.positions == "cache"
  r_store_BTR = r_BTR if pre_rope else r_rot_BTR

  path = "naive"
  compress = step.mode == "prefill" and cache.policy.scoped
  if step.mode == "decode":
    path = config.mla_decode
    cache = write_latent(cache, layer, layer_slots(step, layer), c_BTC,
                         r_store_BTR)
    c_BSC, r_BSR = read_latent(cache, layer, dtype, step.attend)
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
  out_BTNV, probs_BNTS = latent_attend(p, q_nope_BTNP, q_rope_BTNR, c_BSC,
                                       r_BSR, mask_B1TS,
                                       config.softmax_scale, path)
  if cache is not None and (compress or step.want_scores):
    # MLA's keys, as a scored policy sees them: the latent entry [c | r]
    # (one "kv head"); its probabilities per query head (G = 1).
    k_B1SJ = jnp.concatenate([c_BSC, r_BSR], axis=-1)[:, None]
    probs_BNGTS = probs_BNTS[:, :, None]
    if compress:
      idx_B1S, cache = compress_prompt(cache, probs_BNGTS, k_B1SJ,
                                       mask_B1TS, step, layer)
      S = cache.capacity
      idx_BS = jnp.minimum(idx_B1S[:, 0], T - 1)
      slots_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
      pick = lambda x: jnp.take_along_axis(x, idx_BS[..., None], axis=1)
      cache = write_latent(cache, layer, slots_BS, pick(c_BTC),
                           pick(r_store_BTR), fresh=True)
    else:
      cache = observe_scores(cache, probs_BNGTS, k_B1SJ, mask_B1TS, step,
                             layer)
  return project_out(p, out_BTNV), cache
