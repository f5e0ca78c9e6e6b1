"""How cache entries are stored: casts, bfloat16 bits, symmetric int8 / int4,
asymmetric int2.

Store quantized, attend in float. Five storage forms:

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
                     (KIVI's key quantization: `quantize_groups`, at any
                     of the integer widths).
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
  int2               KIVI's 2-bit setting: asymmetric, x ~ code * scale +
                     zero with codes in [0, 3], zero = min x and scale =
                     (max x - min x) / 3 over the group (at 2 bits a
                     symmetric code would waste a level on the sign: KIVI
                     quantizes with a zero point). Eight codes per int16:
                     element i holds x[i + j * W/8] in bits 2j, 2j + 1
                     (eighths, for the reason int4 packs halves), so W must
                     be a multiple of 8. Why int16: its own storage dtype,
                     so every read dispatches on the payload's dtype as for
                     the other forms. The scale array carries the pair:
                     per token [..., 2] (scale, zero); per channel over a
                     token group (`quantize_groups`) [..., 2 * channels],
                     the scales then the zeros, so the grouped arrays keep
                     int8's rank and axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BF16_BITS = jnp.dtype(jnp.uint16)  # storage of bfloat16 caches
INT4_PAIRS = jnp.dtype(jnp.uint8)  # storage of int4 caches: two codes a byte
INT4_MAX = 7  # symmetric: codes in [-7, 7] (-8 unused, as int8's -128)
INT2_OCTETS = jnp.dtype(jnp.int16)  # storage of int2 caches: eight codes
INT2_LEVELS = 3  # asymmetric: codes in [0, 3]


def storage_dtype(kv_dtype: str):
  """The array dtype a cache of `kv_dtype` is stored in."""
  if kv_dtype == "int4":
    return INT4_PAIRS
  if kv_dtype == "int2":
    return INT2_OCTETS
  if jnp.dtype(kv_dtype) == jnp.bfloat16:
    return BF16_BITS
  return jnp.dtype(kv_dtype)


def values_per_element(kv_dtype: str) -> int:
  """Cached values one element of the storage array holds (2 for int4, 8
  for int2)."""
  return {"int4": 2, "int2": 8}.get(kv_dtype, 1)


def packed_width(kv_dtype: str, width: int, field: str) -> int:
  """The last-axis length storing `width` values of a `kv_dtype` cache
  (width / 2 for int4, width / 8 for int2, else width).

  Raises:
    ValueError: int4 and an odd `width` (int2: not a multiple of 8), naming
      `field` (e.g. 'head_dim').
  """
  n = values_per_element(kv_dtype)
  if width % n:
    unit = "byte" if kv_dtype == "int4" else "int16"
    raise ValueError(f"kv_dtype={kv_dtype!r} packs {n} values per {unit}: "
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


def pack_int2(q):
  """Codes q [..., W] (integers in [0, 3]) -> int16 [..., W / 8]: element i
  holds q[i + j * W/8] in bits 2j and 2j + 1. Raises ValueError unless W is
  a multiple of 8."""
  n = packed_width("int2", q.shape[-1], "last axis")
  u = q.astype(jnp.uint16)
  word = jnp.zeros(q.shape[:-1] + (n,), jnp.uint16)
  for j in range(8):
    word = word | (u[..., j * n:(j + 1) * n] << jnp.uint16(2 * j))
  return jax.lax.bitcast_convert_type(word, jnp.int16)


def unpack_int2(packed):
  """Inverse of `pack_int2`: int16 [..., W / 8] -> int8 codes [..., W]."""
  u = jax.lax.bitcast_convert_type(packed, jnp.uint16)
  return jnp.concatenate(
      [((u >> jnp.uint16(2 * j)) & jnp.uint16(3)).astype(jnp.int8)
       for j in range(8)], axis=-1)


def _asymmetric_int2(x32, axis: int):
  """(codes int8 in [0, 3], scale, zero) of x32 over `axis` (kept)."""
  lo = jnp.min(x32, axis=axis, keepdims=True)
  scale = (jnp.max(x32, axis=axis, keepdims=True) - lo) / float(INT2_LEVELS)
  safe = jnp.where(scale > 0, scale, 1.0)
  q = jnp.clip(jnp.round((x32 - lo) / safe), 0, INT2_LEVELS)
  return q.astype(jnp.int8), scale, lo


def quantize(x, storage):
  """Casts or quantizes x [..., W] for storage in dtype `storage`.

  Returns:
    (stored, scale): for int8 (storage int8), stored = round(x / scale)
    [..., W] with scale [...] = max|x| / 127 over the last axis (0-safe);
    for int4 (storage `INT4_PAIRS`, uint8), the codes round(x / scale) in
    [-7, 7] with scale = max|x| / 7, packed two a byte: stored [..., W / 2]
    (`pack_int4`; W must be even); for int2 (storage `INT2_OCTETS`) the
    codes round((x - zero) / scale) in [0, 3], zero = min x, scale =
    (max x - min x) / 3, packed eight an int16: stored [..., W / 8], and
    scale [..., 2] holding (scale, zero); otherwise the stored value (a
    cast, or bfloat16 bits for uint16) and None.
  """
  storage = jnp.dtype(storage)
  if storage not in (jnp.int8, INT4_PAIRS, INT2_OCTETS):
    return _to_storage(x, storage), None
  x32 = x.astype(jnp.float32)
  if storage == INT2_OCTETS:
    q, scale, zero = _asymmetric_int2(x32, -1)
    return pack_int2(q), jnp.concatenate([scale, zero], axis=-1)
  if storage == INT4_PAIRS:
    scale = jnp.max(jnp.abs(x32), axis=-1) / float(INT4_MAX)
    safe = jnp.where(scale > 0, scale, 1.0)[..., None]
    q = jnp.clip(jnp.round(x32 / safe), -INT4_MAX, INT4_MAX)
    return pack_int4(q.astype(jnp.int8)), scale
  scale = jnp.max(jnp.abs(x32), axis=-1) / 127.0
  return _symmetric_int8(x32, scale[..., None]), scale


def dequantize(stored, scale, dtype):
  """Inverse of `quantize`: stored [..., W] (int4: [..., W / 2] uint8; int2:
  [..., W / 8] int16), scale [...] (int2: [..., 2]) or None. Returns
  [..., W] in `dtype`."""
  if scale is None:
    return _from_storage(stored, dtype)
  if stored.dtype == INT2_OCTETS:
    q = unpack_int2(stored).astype(jnp.float32)
    return (q * scale[..., :1] + scale[..., 1:]).astype(dtype)
  if stored.dtype == INT4_PAIRS:
    stored = unpack_int4(stored)
  return (stored.astype(jnp.float32) * scale[..., None]).astype(dtype)


def quantize_groups(x, group: int, axis: int, storage=jnp.int8):
  """Per-channel codes over groups of `group` tokens (KIVI keys).

  Args:
    x: [..., S, channels] with the token axis at `axis` (negative, before
      the channel axis); S must be a multiple of `group`.
    storage: int8 (codes in [-127, 127], scale max|x| / 127),
      `INT4_PAIRS` (codes in [-7, 7], scale max|x| / 7, packed two a byte
      along the channel axis as `pack_int4`: stored [..., S, channels / 2])
      or `INT2_OCTETS` (asymmetric codes in [0, 3] as `quantize`'s int2,
      packed eight an int16: stored [..., S, channels / 8]).
  Returns:
    (stored, scale [..., S / group, channels] float32): every channel of
    every group of `group` consecutive tokens has its own scale over those
    tokens (int2: [..., S / group, 2 * channels], the scales then the
    zeros).
  """
  storage = jnp.dtype(storage)
  if storage not in (jnp.int8, INT4_PAIRS, INT2_OCTETS):
    raise ValueError(f"grouped quantization stores int8, int4 or int2, "
                     f"got {storage}")
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
  if storage == INT2_OCTETS:
    q, scale, zero = _asymmetric_int2(x32, axis + 1)
    pair = jnp.concatenate([jnp.squeeze(scale, axis + 1),
                            jnp.squeeze(zero, axis + 1)], axis=-1)
    return pack_int2(q.reshape(shape)), pair
  scale = jnp.max(jnp.abs(x32), axis=axis + 1) / float(qmax)
  safe = jnp.expand_dims(jnp.where(scale > 0, scale, 1.0), axis + 1)
  q = jnp.clip(jnp.round(x32 / safe), -qmax, qmax).astype(jnp.int8)
  q = q.reshape(shape)
  return (pack_int4(q) if storage == INT4_PAIRS else q), scale


def dequantize_groups(stored, scale, group: int, axis: int, dtype):
  """Inverse of `quantize_groups` (int4: stored [..., channels / 2]; int2:
  [..., channels / 8] with the (scales, zeros) scale array)."""
  zero = None
  if stored.dtype == INT4_PAIRS:
    stored = unpack_int4(stored)
  elif stored.dtype == INT2_OCTETS:
    stored = unpack_int2(stored)
    C = stored.shape[-1]
    scale, zero = scale[..., :C], scale[..., C:]
  shape = stored.shape
  axis = axis % stored.ndim
  S = shape[axis]
  q = stored.astype(jnp.float32).reshape(shape[:axis] + (S // group, group) +
                                         shape[axis + 1:])
  x = q * jnp.expand_dims(scale, axis + 1)
  if zero is not None:
    x = x + jnp.expand_dims(zero, axis + 1)
  return x.reshape(shape).astype(dtype)
