"""KIVI keys: integer codes (8, 4 or 2 bits) per channel over groups of
tokens, newest group in float.

KIVI (Liu et al. 2024) observes that key outliers live in fixed channels, so
keys are quantized per channel (one scale per channel over a group of
X = `key_group` consecutive tokens: a key block, in the alphabet of
`kvjax.config`) and values per token. A group's scales need all of its
tokens, so the newest, incomplete group is also kept in full precision (the
residual) and attention reads it from there.

Which arrays: the key-producing ones. GQA-family: `KVCache.k` (scales
`k_scale [L, B, K, S/X, H]`, residual `k_resid [L, B, K, X, H]`; values stay
per token). MLA: both latent arrays, since every key is computed from them
— `c_kv` (`c_scale [L, B, S/X, C]`, `c_resid [L, B, X, C]`) and `k_rope`
(`r_scale`, `r_resid`, R channels). MLA's values are also computed from the
latent, so for MLA the option quantizes the values' source per channel too.

Invariant, for every sequence b and layer (eviction 'none', so slot =
position): every complete group is stored as `quantize_groups` of its
full-precision rows; the group that holds the newest token is stored in the
residual exactly, and also (re-quantized) in the int8 array, so that the
int8 array is final the moment the group completes. Empty slots hold zeros.

Two write paths keep it:
  one token per sequence (decode): the residual takes the token (it is
    cleared first when the token opens a new group) and its one group is
    re-quantized and written back: O(key_group) work per step.
  several tokens (prefill, chunked extend): the layer's rows are read in
    float (residual overlaid), the new rows scattered in, every group
    re-quantized (idempotent for complete groups: max|q| = 127 returns the
    same scale and values) and the residual cut out: O(S) work, as the
    call's attention already is.

Every function works on one (payload, scale, residual) triple of stacked
arrays with the slot axis second to last in each layer: [L, B, ..., S,
H | C | R] (the channels last: H for GQA keys, C or R for MLA's latents).
The payload's dtype is the code width: int8, int4 codes two a byte
(`kvjax.quant.INT4_PAIRS`: the channel axis holds H / 2 bytes, packed as
`quant.pack_int4`) or int2 codes eight an int16 (`quant.INT2_OCTETS`,
asymmetric, the scale arrays holding the scales then the zeros): KIVI's 4-
and 2-bit settings when the cache's kv_dtype is 'int4' or 'int2', whose
values are then per token at the same width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import quant
from kvjax.cache import KVCache, scatter_tokens


def _slot_axis(stack) -> int:
  """Index of the slot axis of a stacked [L, B, ..., S, H | C | R] array."""
  return stack.ndim - 2


def read(payload, scale, resid, layer, positions_BS, group: int, dtype,
         prefix: int = 0):
  """One layer's rows [B, ..., S', H | C | R] in `dtype`: the int8 groups
  dequantized, the newest group taken from the float32 residual. prefix > 0
  (a multiple of `group` covering every filled slot): S' = prefix."""
  S = prefix or payload.shape[-2]
  if S % group:
    raise ValueError(f"prefix={S} is not a multiple of key_group={group}")
  return rows(payload[layer][..., :S, :], scale[layer][..., :S // group, :],
              resid[layer], positions_BS, group, dtype)


def rows(payload, scale, resid, positions_BS, group: int, dtype):
  """Rows [B, ..., S, H | C | R] in `dtype` of one layer's quantized groups
  `payload` [B, ..., S, ...] and `scale` [B, ..., S / X, ...], the newest
  group (per `positions_BS`) taken from its residual [B, ..., X, ...]
  (however the caller laid its slots out: a paged cache gathers them)."""
  S = payload.shape[-2]
  x = quant.dequantize_groups(payload, scale, group, -2, jnp.float32)
  last_B = jnp.max(positions_BS, axis=1)
  group_B = jnp.where(last_B >= 0, last_B // group, -1)
  tiled = jnp.tile(resid, (1,) * (resid.ndim - 2) + (S // group, 1))
  use_BS = (jnp.arange(S) // group)[None, :] == group_B[:, None]
  use = use_BS.reshape((use_BS.shape[0],) + (1,) * (resid.ndim - 3) +
                       (S, 1))
  return jnp.where(use, tiled, x).astype(dtype)


def one_token(resid, slot_B, new_row, group: int, valid_B,
              storage=jnp.int8):
  """Decode's group update for one row per sequence at `slot_B` (where
  `valid_B`; elsewhere nothing changes).

  Args:
    resid: one layer's residuals [B, ..., X, H | C | R] (float32).
    new_row: [B, ..., H | C | R].
    storage: the payload's dtype (int8, `quant.INT4_PAIRS` or
      `quant.INT2_OCTETS`).
  Returns:
    (new residual, its group quantized: q [B, ..., X, ...] in `storage`
    (int4: the channel axis halved, int2: an eighth) and scale
    [B, ..., 1, ...] (int2: scales then zeros)): the X slots of the group
    that holds the slot.
  """
  B = slot_B.shape[0]
  b_B = jnp.arange(B)
  j_B = slot_B % group
  bcast = (B,) + (1,) * (resid.ndim - 1)
  # A row that opens a group clears the residual: the old group is final.
  r = jnp.where((j_B == 0).reshape(bcast), 0.0, resid)
  r = jnp.moveaxis(jnp.moveaxis(r, -2, 1).at[b_B, j_B].set(
      new_row.astype(jnp.float32)), 1, -2)
  r = jnp.where(valid_B.reshape(bcast), r, resid)
  q, s = quant.quantize_groups(r, group, -2, storage)
  return r, q, s


def _write_one(payload, scale, resid, layer, slot_B, new_row, group: int):
  """Decode: one row per sequence at `slot_B` (S: dropped)."""
  S = payload.shape[-2]
  valid_B = slot_B < S
  group_B = slot_B // group
  r, q, s = one_token(resid[layer], slot_B, new_row, group, valid_B,
                      payload.dtype)
  slots_BX = jnp.where(valid_B[:, None],
                       group_B[:, None] * group + jnp.arange(group)[None, :],
                       S)
  group_B1 = jnp.where(valid_B, group_B, S // group)[:, None]
  return dict(
      payload=scatter_tokens(payload, layer, slots_BX,
                             jnp.moveaxis(q, -2, 1), _slot_axis(payload)),
      scale=scatter_tokens(scale, layer, group_B1, jnp.moveaxis(s, -2, 1),
                           _slot_axis(scale)),
      resid=resid.at[layer].set(r))


def _write_many(payload, scale, resid, layer, positions_BS, slots_BT,
                new_rows, group: int, fresh: bool):
  """Prefill / extend: several rows per sequence at `slots_BT`."""
  S = payload.shape[-2]
  B, T = slots_BT.shape
  if fresh:  # prefill: the cache is taken as empty, whatever it held
    # The channel width is the residual's (a packed int4 / int2 payload's
    # last axis is narrower).
    full = jnp.zeros(payload.shape[1:-1] + resid.shape[-1:], jnp.float32)
    last_B = jnp.full((B,), -1, jnp.int32)
  else:
    full = read(payload, scale, resid, layer, positions_BS, group,
                jnp.float32)
    last_B = jnp.max(positions_BS, axis=1)
  b_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  full = jnp.moveaxis(jnp.moveaxis(full, -2, 1).at[b_BT, slots_BT].set(
      new_rows.astype(jnp.float32), mode="drop"), 1, -2)
  written_B = jnp.max(jnp.where(slots_BT < S, slots_BT, -1), axis=1)
  newest_B = jnp.maximum(last_B, written_B)
  group_B = jnp.where(newest_B >= 0, newest_B // group, 0)
  q, s = quant.quantize_groups(full, group, -2, payload.dtype)
  r = jax.vmap(lambda f, start: jax.lax.dynamic_slice_in_dim(
      f, start, group, axis=f.ndim - 2))(full, group_B * group)
  return dict(payload=payload.at[layer].set(q), scale=scale.at[layer].set(s),
              resid=resid.at[layer].set(r))


def write(payload, scale, resid, layer, positions_BS, slots_BT, new_rows, *,
          group: int, fresh: bool):
  """New (payload, scale, resid) stacks, as a dict, after writing one layer's
  rows `new_rows` [B, T, ..., H | C | R] at `slots_BT` (slot S: dropped).
  `fresh`: a prefill, which takes the cache as empty."""
  if slots_BT.shape[1] == 1 and not fresh:
    return _write_one(payload, scale, resid, layer, slots_BT[:, 0],
                      new_rows[:, 0], group)
  return _write_many(payload, scale, resid, layer, positions_BS, slots_BT,
                     new_rows, group, fresh)


def read_keys(cache: KVCache, layer, dtype, prefix: int = 0):
  """One layer's keys [B, K, S, H] of a KIVI `KVCache`."""
  return read(cache.k, cache.k_scale, cache.k_resid, layer, cache.positions,
              cache.policy.key_group, dtype, prefix)


def write_keys(cache: KVCache, layer, slots_BT, k_BTKH, *,
               fresh: bool) -> dict[str, jax.Array]:
  """New k, k_scale and k_resid after writing one layer's keys."""
  out = write(cache.k, cache.k_scale, cache.k_resid, layer, cache.positions,
              slots_BT, k_BTKH, group=cache.policy.key_group, fresh=fresh)
  return dict(k=out["payload"], k_scale=out["scale"], k_resid=out["resid"])

