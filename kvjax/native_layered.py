"""The decode loop's per-layer cache read by the native CPU kernel: the
layered view (`kvjax.layered`: one array per layer, keys transposed) whose
attention is `native_attention.decode_attend` instead of XLA's dots.

  NativeKV   `layered.LayeredKV`'s arrays (float32, bfloat16 bits, int8
             codes with per-token scales, int4 codes unpacked to int8):
             keys L × [B, K, H, S] (transposed), values L × [B, K, S, H]
             for every kind (the layered view transposes int8 values for
             XLA's integer dot; the kernel reads a value row per slot),
             read as stored: no float32 copy of a bfloat16 or int8 cache,
             no [.., S] logits in memory.

It is a decode cache kind (`attention.register_decode_cache`) and a decode
view (`kvjax.decode`'s 'native' layout): the model reads it through the
protocol, unaware of its layout or its kernel. Writes are the layered
view's (`layered.write`: an in-place slot update per layer). Every function
returns a new cache; none mutates.

What it cannot do, and so `supports` refuses (the plan then picks another
layout): float16 caches (no kernel conversion), KIVI's per-channel keys,
eviction or `cache` positions (the layered view's limits), per-head masks,
and hosts where the kernel did not build (`native_attention.available`).
Attention probabilities are not formed, so a policy that scores slots
cannot read it (none runs on a layered view: eviction is 'none').
"""

from __future__ import annotations

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
  """A `layered.LayeredKV` attended by the native kernel, values [B, K, S,
  H] for every kind (module docstring)."""

  @property
  def transposed(self) -> bool:  # values: never transposed
    return False


def supports(cache, attend: int) -> str | None:
  """Why `cache` cannot run a segment attending `attend` slots on the
  native kernel (None when it can)."""
  why = layered.supports(cache, attend)
  if why:
    return why
  if cache.policy.kv_dtype not in NATIVE_DTYPES:
    return (f"kv_dtype={cache.policy.kv_dtype!r} (the native kernel reads "
            f"{NATIVE_DTYPES})")
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
  L = cache.k.shape[0]
  int4 = cache.policy.kv_dtype == "int4"

  def split(arr, transpose=False):
    if arr is None:
      return None
    parts = tuple(arr[l, :, :, :attend] for l in range(L))
    if int4 and arr.ndim == 5:  # payloads: int4 pairs unpacked to int8 codes
      parts = tuple(quant.unpack_int4(x) for x in parts)
    return tuple(jnp.swapaxes(x, -1, -2) for x in parts) if transpose else (
        parts)

  return NativeKV(k=split(cache.k, True), v=split(cache.v),
                  k_scale=split(cache.k_scale), v_scale=split(cache.v_scale),
                  positions=cache.positions[:, :attend], length=cache.length,
                  errors=cache.errors, policy=cache.policy)


def into_cache(cache: cache_lib.KVCache, view: NativeKV) -> cache_lib.KVCache:
  """`cache` with its first S slots, positions and lengths from `view`."""
  return layered.into_cache(cache, view)


def read(view: NativeKV, layer: int, dtype, prefix: int = 0):
  """One layer's keys and values as stored (`layered.Int8Rows` for int8 /
  int4 codes; float32 or bfloat16-bit arrays otherwise)."""
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
    NativeKV, attention.DecodeCache(write=layered.write, read=read,
                                    attend=_attend))
