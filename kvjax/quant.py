"""How cache entries are stored: casts, bfloat16 bits, symmetric int8.

Store quantized, attend in float. Three storage forms:

  float32 / float16  the value, cast.
  bfloat16           the bfloat16 *bits* in a uint16 array. Why: XLA on CPU
                     rewrites a bfloat16 scatter (the per-token cache write)
                     as float32 work on a converted copy of the whole cache,
                     so every decode step copied every layer's cache (a
                     6 x 16 x 2 x 4096 x 32 cache: 443 ms per write as
                     bfloat16, 0.18 ms as the same bits in uint16;
                     WORKSPACE.md). Bitcasts are free inside the fusions
                     that read and write the cache; the stored bits are
                     exactly the bfloat16 values.
  int8               round(x / scale), symmetric, scale = max|x| / 127:
                     per token (one scale per vector along the last axis:
                     `quantize`), or per channel over a group of tokens
                     (KIVI's key quantization: `quantize_groups`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BF16_BITS = jnp.dtype(jnp.uint16)  # storage of bfloat16 caches


def storage_dtype(kv_dtype: str):
  """The array dtype a cache of `kv_dtype` is stored in."""
  if jnp.dtype(kv_dtype) == jnp.bfloat16:
    return BF16_BITS
  return jnp.dtype(kv_dtype)


def _to_storage(x, storage):
  if storage == BF16_BITS:
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
  return x.astype(storage)


def _from_storage(stored, dtype):
  if stored.dtype == BF16_BITS:
    stored = jax.lax.bitcast_convert_type(stored, jnp.bfloat16)
  return stored.astype(dtype)


def _symmetric_int8(x32, scale):
  safe = jnp.where(scale > 0, scale, 1.0)
  return jnp.clip(jnp.round(x32 / safe), -127, 127).astype(jnp.int8)


def quantize(x, storage):
  """Casts or quantizes x [..., H] for storage in dtype `storage`.

  Returns:
    (stored, scale): for int8, stored = round(x / scale) with
    scale [...] = max|x| / 127 over the last axis (0-safe); otherwise the
    stored value (a cast, or bfloat16 bits for uint16) and None.
  """
  storage = jnp.dtype(storage)
  if storage != jnp.int8:
    return _to_storage(x, storage), None
  x32 = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x32), axis=-1) / 127.0
  return _symmetric_int8(x32, scale[..., None]), scale


def dequantize(stored, scale, dtype):
  """Inverse of `quantize`: stored [..., H], scale [...] or None."""
  if scale is None:
    return _from_storage(stored, dtype)
  return (stored.astype(jnp.float32) * scale[..., None]).astype(dtype)


def quantize_groups(x, group: int, axis: int):
  """Per-channel int8 over groups of `group` tokens (KIVI keys).

  Args:
    x: [..., S, channels] with the token axis at `axis` (negative, before
      the channel axis); S must be a multiple of `group`.
  Returns:
    (stored int8 like x, scale [..., S / group, channels] float32): every
    channel of every group of `group` consecutive tokens has its own scale
    max|x| / 127 over those tokens.
  """
  shape = x.shape
  S = shape[axis]
  if S % group:
    raise ValueError(f"token axis of length {S} is not a multiple of the "
                     f"quantization group {group}")
  axis = axis % x.ndim
  x32 = x.astype(jnp.float32).reshape(shape[:axis] + (S // group, group) +
                                      shape[axis + 1:])
  scale = jnp.max(jnp.abs(x32), axis=axis + 1) / 127.0
  q = _symmetric_int8(x32, jnp.expand_dims(scale, axis + 1))
  return q.reshape(shape), scale


def dequantize_groups(stored, scale, group: int, axis: int, dtype):
  """Inverse of `quantize_groups`."""
  shape = stored.shape
  axis = axis % stored.ndim
  S = shape[axis]
  q = stored.astype(jnp.float32).reshape(shape[:axis] + (S // group, group) +
                                         shape[axis + 1:])
  return (q * jnp.expand_dims(scale, axis + 1)).reshape(shape).astype(dtype)
