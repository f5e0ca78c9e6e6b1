"""How cache entries are stored: casts, bfloat16 bits, symmetric int8 / int4.

Store quantized, attend in float. Four storage forms:

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
                     (KIVI's key quantization: `quantize_groups`, int8 or
                     int4).
  int4               round(x / scale) in [-7, 7], symmetric, scale =
                     max|x| / 7 per token (one scale per vector along the
                     last axis, as int8's `quantize`), two codes per byte in
                     a uint8 array of half the width: byte i holds x[i] in
                     its low nibble and x[i + W/2] in its high one (4-bit
                     two's complement, so an all-zero byte is two zeros).
                     Why halves, not neighbours: unpacking is then one
                     concatenation of two contiguous halves, no interleave.
                     Why the whole vector as the group (a head's H, MLA's C
                     or R), not a fixed group along it: the scales, their
                     bytes and the attention code stay int8's; finer groups
                     would cost 4 bytes per group per token. The width W
                     must be even (`packed_width` says so, naming the field).
                     The packing lives here, so the cache's write and read
                     (`quantize` / `dequantize`) are unchanged: they see a
                     uint8 payload and a float32 scale, as int8's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BF16_BITS = jnp.dtype(jnp.uint16)  # storage of bfloat16 caches
INT4_PAIRS = jnp.dtype(jnp.uint8)  # storage of int4 caches: two codes a byte
INT4_MAX = 7  # symmetric: codes in [-7, 7] (-8 unused, as int8's -128)


def storage_dtype(kv_dtype: str):
  """The array dtype a cache of `kv_dtype` is stored in."""
  if kv_dtype == "int4":
    return INT4_PAIRS
  if jnp.dtype(kv_dtype) == jnp.bfloat16:
    return BF16_BITS
  return jnp.dtype(kv_dtype)


def values_per_element(kv_dtype: str) -> int:
  """Cached values one element of the storage array holds (2 for int4)."""
  return 2 if kv_dtype == "int4" else 1


def packed_width(kv_dtype: str, width: int, field: str) -> int:
  """The last-axis length storing `width` values of a `kv_dtype` cache
  (width / 2 for int4, else width).

  Raises:
    ValueError: int4 and an odd `width`, naming `field` (e.g. 'head_dim').
  """
  n = values_per_element(kv_dtype)
  if width % n:
    raise ValueError(f"kv_dtype={kv_dtype!r} packs {n} values per byte: "
                     f"{field}={width} must be a multiple of {n}")
  return width // n


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


def pack_int4(q):
  """Codes q [..., W] (integers in [-8, 7]) -> uint8 [..., W / 2]: byte i
  holds q[i] (low nibble) and q[i + W/2] (high nibble), 4-bit two's
  complement. Raises ValueError for an odd W."""
  W = packed_width("int4", q.shape[-1], "last axis") * 2
  u = jax.lax.bitcast_convert_type(q.astype(jnp.int8), jnp.uint8)
  lo, hi = u[..., :W // 2], u[..., W // 2:]
  return (lo & jnp.uint8(0x0F)) | (hi << jnp.uint8(4))


def unpack_int4(packed):
  """Inverse of `pack_int4`: uint8 [..., W / 2] -> int8 codes [..., W]."""
  s = jax.lax.bitcast_convert_type(packed, jnp.int8)
  # Arithmetic right shifts sign-extend each nibble.
  lo = jax.lax.shift_right_arithmetic(s << jnp.int8(4), jnp.int8(4))
  hi = jax.lax.shift_right_arithmetic(s, jnp.int8(4))
  return jnp.concatenate([lo, hi], axis=-1)


def quantize(x, storage):
  """Casts or quantizes x [..., W] for storage in dtype `storage`.

  Returns:
    (stored, scale): for int8 (storage int8), stored = round(x / scale)
    [..., W] with scale [...] = max|x| / 127 over the last axis (0-safe);
    for int4 (storage `INT4_PAIRS`, uint8), the codes round(x / scale) in
    [-7, 7] with scale = max|x| / 7, packed two a byte: stored [..., W / 2]
    (`pack_int4`; W must be even); otherwise the stored value (a cast, or
    bfloat16 bits for uint16) and None.
  """
  storage = jnp.dtype(storage)
  if storage not in (jnp.int8, INT4_PAIRS):
    return _to_storage(x, storage), None
  x32 = x.astype(jnp.float32)
  if storage == INT4_PAIRS:
    scale = jnp.max(jnp.abs(x32), axis=-1) / float(INT4_MAX)
    safe = jnp.where(scale > 0, scale, 1.0)[..., None]
    q = jnp.clip(jnp.round(x32 / safe), -INT4_MAX, INT4_MAX)
    return pack_int4(q.astype(jnp.int8)), scale
  scale = jnp.max(jnp.abs(x32), axis=-1) / 127.0
  return _symmetric_int8(x32, scale[..., None]), scale


def dequantize(stored, scale, dtype):
  """Inverse of `quantize`: stored [..., W] (int4: [..., W / 2] uint8),
  scale [...] or None. Returns [..., W] in `dtype`."""
  if scale is None:
    return _from_storage(stored, dtype)
  if stored.dtype == INT4_PAIRS:
    stored = unpack_int4(stored)
  return (stored.astype(jnp.float32) * scale[..., None]).astype(dtype)


def quantize_groups(x, group: int, axis: int, storage=jnp.int8):
  """Per-channel codes over groups of `group` tokens (KIVI keys).

  Args:
    x: [..., S, channels] with the token axis at `axis` (negative, before
      the channel axis); S must be a multiple of `group`.
    storage: int8 (codes in [-127, 127], scale max|x| / 127) or
      `INT4_PAIRS` (codes in [-7, 7], scale max|x| / 7, packed two a byte
      along the channel axis as `pack_int4`: stored [..., S, channels / 2]).
  Returns:
    (stored, scale [..., S / group, channels] float32): every channel of
    every group of `group` consecutive tokens has its own scale over those
    tokens.
  """
  storage = jnp.dtype(storage)
  if storage not in (jnp.int8, INT4_PAIRS):
    raise ValueError(f"grouped quantization stores int8 or int4, got "
                     f"{storage}")
  shape = x.shape
  S = shape[axis]
  if S % group:
    raise ValueError(f"token axis of length {S} is not a multiple of the "
                     f"quantization group {group}")
  axis = axis % x.ndim
  if axis == x.ndim - 1:
    raise ValueError("the token axis must come before the channel axis")
  qmax = INT4_MAX if storage == INT4_PAIRS else 127
  x32 = x.astype(jnp.float32).reshape(shape[:axis] + (S // group, group) +
                                      shape[axis + 1:])
  scale = jnp.max(jnp.abs(x32), axis=axis + 1) / float(qmax)
  safe = jnp.expand_dims(jnp.where(scale > 0, scale, 1.0), axis + 1)
  q = jnp.clip(jnp.round(x32 / safe), -qmax, qmax).astype(jnp.int8)
  q = q.reshape(shape)
  return (pack_int4(q) if storage == INT4_PAIRS else q), scale


def dequantize_groups(stored, scale, group: int, axis: int, dtype):
  """Inverse of `quantize_groups` (int4: stored [..., channels / 2])."""
  if stored.dtype == INT4_PAIRS:
    stored = unpack_int4(stored)
  shape = stored.shape
  axis = axis % stored.ndim
  S = shape[axis]
  q = stored.astype(jnp.float32).reshape(shape[:axis] + (S // group, group) +
                                         shape[axis + 1:])
  return (q * jnp.expand_dims(scale, axis + 1)).reshape(shape).astype(dtype)
