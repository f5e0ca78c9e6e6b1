"""KIVI keys: int8 per channel over groups of tokens, newest group in float.

KIVI (Liu et al. 2024) observes that key outliers live in fixed channels, so
keys are quantized per channel (one scale per channel over a group of
`key_group` consecutive tokens) and values per token. A group's scales need
all of its tokens, so the newest, incomplete group is also kept in full
precision (the residual, `KVCache.k_resid [L, B, K, key_group, H]`) and
attention reads it from there.

Invariant, for every sequence b and layer (eviction 'none', so slot =
position): every complete group is stored as `quantize_groups` of its
full-precision keys; the group that holds the newest token is stored in the
residual exactly, and also (re-quantized) in the int8 array, so that the
int8 array is final the moment the group completes. Empty slots hold zeros.

Two write paths keep it:
  one token per sequence (decode): the residual takes the token (it is
    cleared first when the token opens a new group) and its one group is
    re-quantized and written back: O(key_group) work per step.
  several tokens (prefill, chunked extend): the layer's keys are read in
    float (residual overlaid), the new keys scattered in, every group
    re-quantized (idempotent for complete groups: max|q| = 127 returns the
    same scale and values) and the residual cut out: O(S) work, as the
    call's attention already is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import quant
from kvjax.cache import KVCache

_SLOT_AXIS = -2  # [B, K, S, H]


def _newest_group(last_B, group: int):
  """[B] group holding the newest token (0 for an empty sequence)."""
  return jnp.where(last_B >= 0, last_B // group, 0)


def read_keys(cache: KVCache, layer, dtype, prefix: int = 0):
  """One layer's keys [B, K, S, H] in `dtype`: the int8 groups dequantized,
  the newest group taken from the float32 residual. prefix > 0 (a multiple
  of key_group that covers every filled slot): the first `prefix` slots."""
  g = cache.policy.key_group
  S = prefix or cache.capacity
  if S % g:
    raise ValueError(f"prefix={S} is not a multiple of key_group={g}")
  k_BKSH = quant.dequantize_groups(cache.k[layer, :, :, :S],
                                   cache.k_scale[layer, :, :, :S // g], g,
                                   _SLOT_AXIS, jnp.float32)
  last_B = jnp.max(cache.positions, axis=1)
  group_B = jnp.where(last_B >= 0, last_B // g, -1)
  resid_BKSH = jnp.tile(cache.k_resid[layer], (1, 1, S // g, 1))
  use_BS = (jnp.arange(S) // g)[None, :] == group_B[:, None]
  return jnp.where(use_BS[:, None, :, None], resid_BKSH, k_BKSH).astype(dtype)


def _write_one(cache: KVCache, layer, slot_B, k_BKH):
  g, S = cache.policy.key_group, cache.capacity
  B = slot_B.shape[0]
  b_B = jnp.arange(B)
  valid_B = slot_B < S
  j_B, group_B = slot_B % g, slot_B // g
  old_BKGH = cache.k_resid[layer]
  # A token that opens a group clears the residual: the old group is final.
  resid_BKGH = jnp.where((j_B == 0)[:, None, None, None], 0.0, old_BKGH)
  resid_BKGH = resid_BKGH.at[b_B, :, j_B].set(k_BKH.astype(jnp.float32))
  resid_BKGH = jnp.where(valid_B[:, None, None, None], resid_BKGH, old_BKGH)
  q_BKGH, scale_BK1H = quant.quantize_groups(resid_BKGH, g, _SLOT_AXIS)
  slots_BG = jnp.where(valid_B[:, None],
                       group_B[:, None] * g + jnp.arange(g)[None, :], S)
  b_BG = jnp.broadcast_to(b_B[:, None], slots_BG.shape)
  k = cache.k.at[layer, b_BG, :, slots_BG].set(jnp.swapaxes(q_BKGH, 1, 2),
                                               mode="drop")
  group_B = jnp.where(valid_B, group_B, S // g)
  k_scale = cache.k_scale.at[layer, b_B, :, group_B].set(
      scale_BK1H[:, :, 0], mode="drop")
  k_resid = cache.k_resid.at[layer].set(resid_BKGH)
  return dict(k=k, k_scale=k_scale, k_resid=k_resid)


def _write_many(cache: KVCache, layer, slots_BT, k_BTKH, fresh: bool):
  g, S = cache.policy.key_group, cache.capacity
  B, T = slots_BT.shape
  if fresh:  # prefill: the cache is taken as empty, whatever it held
    full_BKSH = jnp.zeros(cache.k.shape[1:], jnp.float32)
    last_B = jnp.full((B,), -1, jnp.int32)
  else:
    full_BKSH = read_keys(cache, layer, jnp.float32)
    last_B = jnp.max(cache.positions, axis=1)
  b_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  full_BKSH = full_BKSH.at[b_BT, :, slots_BT].set(
      k_BTKH.astype(jnp.float32), mode="drop")
  written_B = jnp.max(jnp.where(slots_BT < S, slots_BT, -1), axis=1)
  group_B = _newest_group(jnp.maximum(last_B, written_B), g)
  q_BKSH, scale = quant.quantize_groups(full_BKSH, g, _SLOT_AXIS)
  resid_BKGH = jax.vmap(
      lambda f, start: jax.lax.dynamic_slice_in_dim(f, start, g, axis=1))(
          full_BKSH, group_B * g)
  return dict(k=cache.k.at[layer].set(q_BKSH),
              k_scale=cache.k_scale.at[layer].set(scale),
              k_resid=cache.k_resid.at[layer].set(resid_BKGH))


def write_keys(cache: KVCache, layer, slots_BT, k_BTKH, *,
               fresh: bool) -> dict[str, jax.Array]:
  """New k, k_scale and k_resid (whole stacked arrays) after writing one
  layer's keys at `slots` (slot S: dropped). `fresh`: prefill, the cache's
  old contents are ignored."""
  if slots_BT.shape[1] == 1 and not fresh:
    return _write_one(cache, layer, slots_BT[:, 0], k_BTKH[:, 0])
  return _write_many(cache, layer, slots_BT, k_BTKH, fresh)
