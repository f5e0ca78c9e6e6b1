"""The decode loop's cache read by the native CPU kernel: keys copied per
layer into the kernel's tiles, values and scales read and written in the
stacked cache itself; attention is `native_attention.decode_attend`
instead of XLA's dots.

  NativeKV   k        L × [B, K, S/16, H, 16]  keys in tiles of 16 slots,
                      each tile's H × 16 keys contiguous (int8 in channel
                      quads and bfloat16 in channel pairs, int4 pairs in
                      quads of bytes over [B, K, S/16, H/2, 16]:
                      `native_attention.tile_keys`): the segment's copy
             stacked  the segment's `KVCache`: values [L, B, K, S', H]
                      ([.., H/2] bytes for int4) and the int8 / int4 scales
                      [L, B, K, S'] of keys and values, read in place (the
                      layer's first S slots) and written there
             positions [B, S], length, errors: the segment's
  Read as stored: no float32 copy of a bfloat16 or int8 cache, no
  unpacked copy of an int4 one, no [.., S] logits in memory.

Why values in place: they are rows, [S, H] per (sequence, head), in the
stacked cache as the kernel reads them (its stride per head is the
cache's S' slots), so a segment copies only its keys into tiles, half of
a float cache's prefix (WORKSPACE.md "A decode segment's copies").

Why tiles: with keys transposed whole ([H, S] per head, the layered
view's layout for XLA's `q K^T`), 16 slots' keys are H rows S apart, and
the kernel reached about half of the read probe's bandwidth on float32;
in tiles they are one contiguous run (WORKSPACE.md "Quantized caches, and
the cache-dominated regime"). Read in place as rows, as MLA's latents
are, they would need no copy, but per layer the kernel then took
1.09-1.79x the tiles' time (batch 8, 16k; gqa-medium float32 0.94x), more
than the copy saves over a segment of 20-70 steps or longer (WORKSPACE.md
"A decode segment's copies").

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
class NativeKV(layered.StackedSegment):
  """A segment's keys in the kernel's tiles (k: L × [B, K, S/16, H, 16])
  and its stacked `KVCache`, whose values and scales the kernel reads in
  place (module docstring)."""

  k: tuple = ()


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
  """The first `attend` slots of `cache` as a NativeKV: its keys copied into
  tiles, the rest read in place.

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
      stacked=cache, positions=cache.positions[:, :attend],
      length=cache.length, errors=cache.errors)


def into_cache(cache: cache_lib.KVCache, view: NativeKV,
               steps: int | None = None) -> cache_lib.KVCache:
  """The segment's stacked cache (values and scales written in place) with
  the keys its `steps` decode steps wrote (`layered.written_window`; None:
  its first S slots) back from the tiles, positions and lengths from
  `view` (the inverse of `from_cache`)."""
  at_B = layered.written_window(cache, view, steps)
  if at_B is None:
    keys = tuple(map(native_attention.untile_keys, view.k))
  else:
    keys = tuple(layered.tile_window(x, at_B, steps,
                                     native_attention.untile_keys)
                 for x in view.k)
  return view.after(cache, k=layered.put_window(view.stacked.k, keys, at_B,
                                                3))


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
  `slots` [B, 1] (slot = S, past the segment: dropped), quantized as the
  stacked cache stores it: the key into its tile, the value and the scales
  into the stacked cache."""
  B, T = slots_BT.shape
  if T != 1:
    raise ValueError(f"NativeKV holds decode steps only (T = 1), got T={T}")
  st = view.stacked
  k_q, k_s = quant.quantize(k_BTKH, st.k.dtype)  # int4: packed
  v_q, v_s = quant.quantize(v_BTKH, st.v.dtype)
  slots_BT = view.kept_slots(slots_BT)  # the tiles drop slot S too

  def put(arr, new_BT):
    return cache_lib.scatter_tokens(arr, layer, slots_BT, new_BT, 3)

  new = dict(v=put(st.v, v_q))
  if k_s is not None:
    new.update(k_scale=put(st.k_scale, k_s), v_scale=put(st.v_scale, v_s))
  keys = list(view.k)
  keys[layer] = _put_key(keys[layer], jnp.minimum(slots_BT[:, 0],
                                                  view.capacity), k_q[:, 0])
  return view.replace(k=tuple(keys), stacked=st.replace(**new))


def read(view: NativeKV, layer: int, dtype, prefix: int = 0):
  """One layer's keys (tiles) and the stacked values as the kernel reads
  them (`LayerValues`)."""
  del dtype, prefix  # read as stored; the mask gives the segment's slots
  st = view.stacked
  return view.k[layer], LayerValues(st.v, st.k_scale, st.v_scale, layer)


@struct.dataclass
class LayerValues:
  """A layer of the stacked values read in place: v [L, B, K, S', H], the
  int8 / int4 scales [L, B, K, S'] (else None), the layer."""
  v: jax.Array
  k_scale: jax.Array | None
  v_scale: jax.Array | None
  layer: int = struct.field(pytree_node=False)


def _attend(q_BTKGH, keys, values, mask_BKTS, scale: float,
            impl: str = "einsum"):
  """Decode attention (T = 1) over a NativeKV layer on the kernel; no
  probabilities (None)."""
  del impl
  B, T, K, G, H = q_BTKGH.shape
  if T != 1 or mask_BKTS.shape[1] != 1:
    raise ValueError(f"NativeKV attends decode steps (T = 1) with one mask "
                     f"for every head, got T={T}, mask {mask_BKTS.shape}")
  out_BKGH = native_attention.decode_attend(
      q_BTKGH[:, 0], keys, values.v, mask_BKTS[:, 0, 0], scale,
      values.k_scale, values.v_scale, layer=values.layer)
  return out_BKGH[:, None].astype(q_BTKGH.dtype), None


attention.register_decode_cache(
    NativeKV, attention.DecodeCache(write=write, read=read, attend=_attend))
