"""The decode loop's per-layer cache read by the native CPU kernel: the
layered view (`kvjax.layered`: one array per layer, keys transposed) whose
attention is `native_attention.decode_attend` instead of XLA's dots.

  NativeKV   one array per layer, as `layered.LayeredKV` (float32,
             bfloat16 bits, int8 codes with per-token scales, int4 codes
             packed two a byte as the stacked cache stores them), in the
             kernel's layouts: keys L × [B, K, S/16, H, 16] (tiles of 16
             slots, each tile's H × 16 keys contiguous, int8 in channel
             quads and bfloat16 in channel pairs, int4 pairs in quads of
             bytes over [B, K, S/16, H/2, 16]:
             `native_attention.tile_keys`), values L × [B, K, S, H] for
             every kind ([B, K, S, H/2] bytes for int4); read as stored:
             no float32 copy of a bfloat16 or int8 cache, no unpacked copy
             of an int4 one, no [.., S] logits in memory.

Why tiles: with keys transposed whole ([H, S] per head, the layered
view's layout for XLA's `q K^T`), 16 slots' keys are H rows S apart, and
the kernel reached about half of the read probe's bandwidth on float32;
in tiles they are one contiguous run (WORKSPACE.md "Quantized caches, and
the cache-dominated regime").

It is a decode cache kind (`attention.register_decode_cache`) and a decode
view (`kvjax.decode`'s 'native' layout): the model reads it through the
protocol, unaware of its layout or its kernel. A write updates one slot
per sequence in place (`layered.put_slot`'s forms). Every function
returns a new cache; none mutates.

What it cannot do, and so `supports` refuses (the plan then picks another
layout): float16 caches (no kernel conversion), KIVI's per-channel keys,
eviction or `cache` positions (the layered view's limits), segments
whose slots are not a multiple of 16, int8 codes, int4 codes or bfloat16
bits of a head width that is not a multiple of 4, 8 or 2 (the key channel
groups),
per-head masks, and hosts where the kernel did not build
(`native_attention.available`).
Attention probabilities are not formed, so a policy that scores slots
cannot read it (none runs on a layered view: eviction is 'none').
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax import attention
from kvjax import cache as cache_lib
from kvjax import layered
from kvjax import native_attention
from kvjax import quant

NATIVE_DTYPES = ("float32", "bfloat16", "int8", "int4")


@struct.dataclass
class NativeKV(layered.LayeredKV):
  """`layered.LayeredKV`'s fields in the kernel's layouts (module
  docstring): k L × [B, K, S/16, H, 16], v L × [B, K, S, H]."""

  @property
  def transposed(self) -> bool:  # values: never transposed
    return False

  @property
  def capacity(self) -> int:
    return self.v[0].shape[2]


def supports(cache, attend: int) -> str | None:
  """Why `cache` cannot run a segment attending `attend` slots on the
  native kernel (None when it can)."""
  why = layered.supports(cache, attend)
  if why:
    return why
  if attend % native_attention.TILE:
    return (f"attend={attend} slots is not a multiple of "
            f"{native_attention.TILE} (the kernel's key tiles)")
  if cache.policy.kv_dtype not in NATIVE_DTYPES:
    return (f"kv_dtype={cache.policy.kv_dtype!r} (the native kernel reads "
            f"{NATIVE_DTYPES})")
  storage = quant.storage_dtype(cache.policy.kv_dtype)
  per = native_attention.codes_per_element(storage)
  H = cache.v.shape[-1] * per
  w = native_attention.group_width(storage) * per
  if H % w:
    return (f"kv_dtype={cache.policy.kv_dtype!r} with head width {H}, not a "
            f"multiple of {w} (the kernel's key channel groups)")
  if not native_attention.available():
    return "the native kernel is not built on this host (KVJAX_NATIVE=0?)"
  return None


def from_cache(cache: cache_lib.KVCache, attend: int) -> NativeKV:
  """The first `attend` slots of `cache` as a NativeKV.

  Raises:
    ValueError: `supports` says why not.
  """
  why = supports(cache, attend)
  if why:
    raise ValueError(f"native decode cache: {why}")
  # int4 stays packed: the kernel unpacks in registers.
  return NativeKV(
      k=tuple(map(native_attention.tile_keys,
                  layered.layer_slices(cache.k, attend, unpack=False))),
      v=layered.layer_slices(cache.v, attend, unpack=False),
      k_scale=layered.layer_slices(cache.k_scale, attend),
      v_scale=layered.layer_slices(cache.v_scale, attend),
      positions=cache.positions[:, :attend], length=cache.length,
      errors=cache.errors, policy=cache.policy)


def into_cache(cache: cache_lib.KVCache, view: NativeKV,
               steps: int | None = None) -> cache_lib.KVCache:
  """`cache` with the slots a segment of `steps` decode steps wrote
  (`layered.written_window`; None: its first S slots), positions and
  lengths from `view` (the inverse of `from_cache`)."""
  at_B = layered.written_window(cache, view, steps)
  if at_B is None:
    return layered.write_back(
        cache, view, tuple(map(native_attention.untile_keys, view.k)),
        view.v, packed=True)
  return layered.write_back(
      cache, view,
      tuple(layered.tile_window(x, at_B, steps, native_attention.untile_keys)
            for x in view.k),
      tuple(layered.slot_window(x, at_B, steps, 2) for x in view.v),
      packed=True, at_B=at_B)


def _put_key(tiles, s_B, new_BKH):
  """tiles [B, K, S/16, H, 16] with slot s_B[b] (tile s // 16, lane s % 16)
  set to new_BKH[b] for every sequence (s = S: unchanged), written through
  the tiles' channel groups (`native_attention.grouped_tiles`: [B, K, S/16,
  H/w, 16, w]); in place, as `layered.put_slot`: a scatter from batch 2,
  an update slice at batch 1."""
  B, K, n, H, L = tiles.shape
  w = native_attention.group_width(tiles.dtype)
  view = native_attention.grouped_tiles(tiles)
  new = new_BKH.reshape(B, K, H // w, w)
  if B > 1:
    return view.at[jnp.arange(B), :, s_B // L, :, s_B % L].set(
        new, mode="drop").reshape(tiles.shape)
  s = jnp.minimum(s_B[0], n * L - 1)
  start = (0, 0, s // L, 0, s % L, 0)
  upd = new[:, :, None, :, None]
  old = jax.lax.dynamic_slice(view, start, upd.shape)
  return jax.lax.dynamic_update_slice(
      view, jnp.where(s_B[0] < n * L, upd, old), start).reshape(tiles.shape)


def write(view: NativeKV, layer: int, slots_BT, k_BTKH, v_BTKH) -> NativeKV:
  """Stores one decode token per sequence (T = 1) of static `layer` at
  `slots` [B, 1] (slot = S: dropped), quantized as the stacked cache
  stores it."""
  B, T = slots_BT.shape
  if T != 1:
    raise ValueError(f"NativeKV holds decode steps only (T = 1), got T={T}")
  storage = quant.storage_dtype(view.policy.kv_dtype)
  s_B = slots_BT[:, 0]
  new = {}
  for name, x_BKH in (("k", k_BTKH[:, 0]), ("v", v_BTKH[:, 0])):
    codes_BKH, scale_BK = quant.quantize(x_BKH, storage)  # int4: packed
    arrs = list(getattr(view, name))
    arrs[layer] = (_put_key(arrs[layer], s_B, codes_BKH) if name == "k" else
                   layered.put_slot(arrs[layer], s_B, codes_BKH, 2))
    new[name] = tuple(arrs)
    if scale_BK is not None:
      scales = list(getattr(view, name + "_scale"))
      scales[layer] = layered.put_slot(scales[layer], s_B, scale_BK, 2)
      new[name + "_scale"] = tuple(scales)
  return view.replace(**new)


def read(view: NativeKV, layer: int, dtype, prefix: int = 0):
  """One layer's keys and values as stored (`layered.Int8Rows` for int8
  codes and int4 pairs; float32 or bfloat16-bit arrays otherwise)."""
  del dtype, prefix  # read as stored; the segment's copy is its prefix
  if view.k_scale is not None:
    return (layered.Int8Rows(view.k[layer], view.k_scale[layer]),
            layered.Int8Rows(view.v[layer], view.v_scale[layer]))
  return view.k[layer], view.v[layer]


def _attend(q_BTKGH, keys, values, mask_BKTS, scale: float,
            impl: str = "einsum"):
  """Decode attention (T = 1) over a NativeKV layer on the kernel; no
  probabilities (None)."""
  del impl
  B, T, K, G, H = q_BTKGH.shape
  if T != 1 or mask_BKTS.shape[1] != 1:
    raise ValueError(f"NativeKV attends decode steps (T = 1) with one mask "
                     f"for every head, got T={T}, mask {mask_BKTS.shape}")
  mask_BS = mask_BKTS[:, 0, 0]
  q_BKGH = q_BTKGH[:, 0]
  if isinstance(keys, layered.Int8Rows):
    out_BKGH = native_attention.decode_attend(
        q_BKGH, keys.codes, values.codes, mask_BS, scale, keys.scale,
        values.scale)
  else:
    out_BKGH = native_attention.decode_attend(q_BKGH, keys, values, mask_BS,
                                              scale)
  return out_BKGH[:, None].astype(q_BTKGH.dtype), None


attention.register_decode_cache(
    NativeKV, attention.DecodeCache(write=write, read=read, attend=_attend))
