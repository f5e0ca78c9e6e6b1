"""Symmetric int8 quantization of cache entries (store quantized, attend in
float): one float32 scale per vector along the last axis."""

from __future__ import annotations

import jax.numpy as jnp


def quantize(x, dtype):
  """Casts or quantizes x [..., H] for storage.

  Returns:
    (stored, scale): for int8, stored = round(x / scale) with
    scale [...] = max|x| / 127 over the last axis (0-safe); for float
    dtypes the cast value and None.
  """
  dtype = jnp.dtype(dtype)
  if dtype != jnp.int8:
    return x.astype(dtype), None
  x32 = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x32), axis=-1) / 127.0
  safe = jnp.where(scale > 0, scale, 1.0)
  q = jnp.clip(jnp.round(x32 / safe[..., None]), -127, 127).astype(jnp.int8)
  return q, scale


def dequantize(stored, scale, dtype):
  """Inverse of `quantize`: stored [..., H], scale [...] or None."""
  if scale is None:
    return stored.astype(dtype)
  return (stored.astype(jnp.float32) * scale[..., None]).astype(dtype)
