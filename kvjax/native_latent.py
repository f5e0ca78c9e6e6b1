"""The decode loop's MLA latent cache read by the native CPU kernel
(`native_attention.latent_attend`), in place or as per-layer rows.

  InPlaceLatent  stacked           the segment's `LatentCache` itself:
                                   latents [L, B, S', C], rotary keys
                                   [L, B, S', R] (float32, bfloat16 bits,
                                   int8 codes with [L, B, S'] scales)
                 positions         [B, S]   the segment's S slots
                 length, errors    [B]
  NativeLatent   c                 L × [B, S, C]   int4 latents unpacked to
                 r                 L × [B, S, R]   int8 codes, per layer
                 c_scale, r_scale  L × [B, S]      (the layered latent view,
                                                   `kvjax.layered_latent`)

MLA's latents are rows, [B, S', C] per layer, as the kernel reads them,
so a segment over float32, bfloat16 or int8 latents copies nothing: the
kernel reads the stacked cache's layer in place (its first S slots) and a
step writes its token into the stacked arrays, one row per sequence
(`mla.write_latent`). The per-layer copy this replaces (`from_cache` of
the layered view) cost a pass over the prefix per segment, 0.28 s for
mla-small float32 at batch 8 and 16,384 slots (WORKSPACE.md "A decode
segment's copies"). int4 latents, packed two codes a byte, are unpacked into the
per-layer view (`NativeLatent`): the kernel reads int8 codes.

Each step reads a layer's latents once, as stored, for its keys and its
values (the kernel's blocks keep a latent row in cache between the two),
with the softmax online: no float32 copy of a bfloat16 cache and no
[B, N, S] logits in memory. The kernel reads int8 codes as codes: integer
logits of the query rounded per row as the codes are, float probabilities
(not rounded to 255 levels, unlike `layered_latent.int8_absorbed`). Where
the host has AMX the bfloat16 and int8 latents' logits are tile products
(`native_attention.latent_amx`).

Both are decode cache kinds (`attention.register_decode_cache`) and this
module is a decode view (`kvjax.decode`'s 'native' layout for MLA): the
model reads them through the protocol. Every function returns a new
cache; none mutates. No attention probabilities are formed (the views run
eviction 'none' only).
"""

from __future__ import annotations

import jax
from flax import struct

from kvjax import attention
from kvjax import cache as cache_lib
from kvjax import layered
from kvjax import layered_latent
from kvjax import mla
from kvjax import native_attention
from kvjax import quant

NATIVE_LATENT_DTYPES = ("float32", "bfloat16", "int8", "int4")


@struct.dataclass
class NativeLatent(layered_latent.LayeredLatent):
  """A `layered_latent.LayeredLatent` with rows for every dtype, attended
  by the native kernel (int4 latents, unpacked)."""

  @property
  def transposed(self) -> bool:
    return False


@struct.dataclass
class InPlaceLatent(layered.StackedSegment):
  """A segment's stacked `LatentCache`, attended in place by the native
  kernel over its first S slots (module docstring)."""


@struct.dataclass
class LayerRows:
  """One layer of a stacked array read in place: arr [L, B, S', W], its
  per-token scales [L, B, S'] (int8; else None), the layer."""
  arr: jax.Array
  scale: jax.Array | None
  layer: int = struct.field(pytree_node=False)


def supports(cache, attend: int) -> str | None:
  """Why `cache` cannot run a segment attending `attend` slots on the
  native kernel (None when it can)."""
  why = layered_latent.supports(cache, attend)
  if why:
    return why
  if cache.policy.kv_dtype not in NATIVE_LATENT_DTYPES:
    return (f"kv_dtype={cache.policy.kv_dtype!r} (the native latent kernel "
            f"reads {NATIVE_LATENT_DTYPES})")
  if not native_attention.available():
    return "the native kernel is not built on this host (KVJAX_NATIVE=0?)"
  return None


def from_cache(cache: cache_lib.LatentCache, attend: int
               ) -> InPlaceLatent | NativeLatent:
  """A segment over the first `attend` slots of `cache`: the cache itself
  (`InPlaceLatent`), or for int4 latents their per-layer unpacked view.

  Raises:
    ValueError: `supports` says why not.
  """
  why = supports(cache, attend)
  if why:
    raise ValueError(f"native latent cache: {why}")
  if cache.c_kv.dtype != quant.INT4_PAIRS:
    return InPlaceLatent(stacked=cache, positions=cache.positions[:, :attend],
                         length=cache.length, errors=cache.errors)
  view = layered_latent.from_cache(cache, attend, transpose=False)
  return NativeLatent(c=view.c, r=view.r, c_scale=view.c_scale,
                      r_scale=view.r_scale, positions=view.positions,
                      length=view.length, errors=view.errors,
                      policy=view.policy)


def into_cache(cache: cache_lib.LatentCache,
               view: InPlaceLatent | NativeLatent,
               steps: int | None = None) -> cache_lib.LatentCache:
  """`cache` after the segment: the stacked cache the in-place one wrote,
  or the slots a per-layer view's `steps` decode steps wrote
  (`layered_latent.into_cache`); positions and lengths from `view`."""
  if isinstance(view, NativeLatent):
    return layered_latent.into_cache(cache, view, steps)
  return view.after(cache)


def write_in_place(view: InPlaceLatent, layer: int, slots_BT, c_BTC, r_BTR
                   ) -> InPlaceLatent:
  """Stores one decode token per sequence (T = 1) of static `layer` into the
  stacked cache at `slots` [B, 1] (slot S, past the segment: dropped, as
  the per-layer views drop it), quantized as the stacked cache stores it."""
  return view.replace(stacked=mla.write_latent(
      view.stacked, layer, view.kept_slots(slots_BT), c_BTC, r_BTR))


def read_in_place(view: InPlaceLatent, layer: int, dtype, prefix: int = 0):
  """One layer's latents and rotary keys as the kernel reads them in place
  (`LayerRows` of the stacked arrays)."""
  del dtype, prefix  # read as stored; the mask gives the segment's slots
  st = view.stacked
  return (LayerRows(st.c_kv, st.c_scale, layer),
          LayerRows(st.k_rope, st.r_scale, layer))


def read(view: NativeLatent, layer: int, dtype, prefix: int = 0):
  """One layer's latents [B, S, C] and rotary keys [B, S, R] as stored
  (int8 / int4: `layered.Int8Rows` of codes and per-token scales)."""
  del dtype, prefix  # read as stored; the segment's copy is its prefix
  if view.c_scale is not None:
    return (layered.Int8Rows(view.c[layer], view.c_scale[layer]),
            layered.Int8Rows(view.r[layer], view.r_scale[layer]))
  return view.c[layer], view.r[layer]


def _latent_attend(q_lat_BTNC, q_rope_BTNR, c_BSC, r_BSR, mask_B1TS,
                   scale: float):
  """Absorbed decode attention (T = 1) on the kernel; no probabilities."""
  T = q_lat_BTNC.shape[1]
  if T != 1:
    raise ValueError(f"NativeLatent attends decode steps (T = 1), got T={T}")
  if isinstance(c_BSC, LayerRows):
    o_lat_BNC = native_attention.latent_attend(
        q_lat_BTNC[:, 0], q_rope_BTNR[:, 0], c_BSC.arr, r_BSR.arr,
        mask_B1TS[:, 0, 0], scale, c_BSC.scale, r_BSR.scale,
        layer=c_BSC.layer)
  elif isinstance(c_BSC, layered.Int8Rows):
    o_lat_BNC = native_attention.latent_attend(
        q_lat_BTNC[:, 0], q_rope_BTNR[:, 0], c_BSC.codes, r_BSR.codes,
        mask_B1TS[:, 0, 0], scale, c_BSC.scale, r_BSR.scale)
  else:
    o_lat_BNC = native_attention.latent_attend(
        q_lat_BTNC[:, 0], q_rope_BTNR[:, 0], c_BSC, r_BSR,
        mask_B1TS[:, 0, 0], scale)
  return o_lat_BNC[:, None].astype(q_lat_BTNC.dtype), None


attention.register_decode_cache(
    NativeLatent, attention.DecodeCache(
        write=layered_latent.write, read=read, attend=None,
        latent_attend=_latent_attend))
attention.register_decode_cache(
    InPlaceLatent, attention.DecodeCache(
        write=write_in_place, read=read_in_place, attend=None,
        latent_attend=_latent_attend))
