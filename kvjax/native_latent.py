"""The decode loop's per-layer MLA latent cache read by the native CPU
kernel: the layered latent view (`kvjax.layered_latent`: one array per
layer) whose absorbed attention is `native_attention.latent_attend`.

  NativeLatent  c                 L × [B, S, C]   latents: float32,
                                                  bfloat16 bits or int8
                                                  codes (int4 unpacked)
                r                 L × [B, S, R]   rotary keys, the same
                c_scale, r_scale  L × [B, S]      int8, int4 (else None)

Each step reads a layer's latents once, as stored, for its keys and its
values (the kernel's blocks keep a latent row in cache between the two),
with the softmax online: no float32 copy of a bfloat16 cache and no
[B, N, S] logits in memory. int8 and int4 codes are rows here (the
layered view transposes them for its integer dots) and the kernel reads
them as codes: integer logits of the query rounded per row as the codes
are, float probabilities (not rounded to 255 levels, unlike
`layered_latent.int8_absorbed`). Where the host has AMX the bfloat16 and
int8 latents' logits are tile products (`native_attention.latent_amx`).

A decode cache kind (`attention.register_decode_cache`) and a decode view
(`kvjax.decode`'s 'native' layout for MLA): the model reads it through the
protocol. Writes are the layered view's. Every function returns a new
cache; none mutates. No attention probabilities are formed (the views run
eviction 'none' only).
"""

from __future__ import annotations

from flax import struct

from kvjax import attention
from kvjax import cache as cache_lib
from kvjax import layered
from kvjax import layered_latent
from kvjax import native_attention

NATIVE_LATENT_DTYPES = ("float32", "bfloat16", "int8", "int4")


@struct.dataclass
class NativeLatent(layered_latent.LayeredLatent):
  """A `layered_latent.LayeredLatent` with rows for every dtype, attended
  by the native kernel."""

  @property
  def transposed(self) -> bool:
    return False


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


def from_cache(cache: cache_lib.LatentCache, attend: int) -> NativeLatent:
  """The first `attend` slots of `cache` as a NativeLatent.

  Raises:
    ValueError: `supports` says why not.
  """
  why = supports(cache, attend)
  if why:
    raise ValueError(f"native latent cache: {why}")
  view = layered_latent.from_cache(cache, attend, transpose=False)
  return NativeLatent(c=view.c, r=view.r, c_scale=view.c_scale,
                      r_scale=view.r_scale, positions=view.positions,
                      length=view.length, errors=view.errors,
                      policy=view.policy)


def into_cache(cache: cache_lib.LatentCache, view: NativeLatent,
               steps: int | None = None) -> cache_lib.LatentCache:
  """`cache` with the slots a segment of `steps` decode steps wrote (None:
  its first S slots), positions and lengths from `view`
  (`layered_latent.into_cache`)."""
  return layered_latent.into_cache(cache, view, steps)


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
  if isinstance(c_BSC, layered.Int8Rows):
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
