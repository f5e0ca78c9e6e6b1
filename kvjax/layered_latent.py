"""The decode loop's layered latent cache: MLA's `LatentCache` as one array
per layer (`kvjax.layered` is the same view of a `KVCache`), and integer
attention over int8 / int4 latents.

  LayeredLatent  c                 L × [B, S, C]   float latents
                                   L × [B, C, S]   int8, int4: codes, transposed
                 r                 L × [B, S, R]   rotary keys (int8, int4:
                                   L × [B, R, S]   codes, transposed)
                 c_scale, r_scale  L × [B, S]      int8, int4 (else None)

`from_cache` splits the first S slots of each layer once per decode segment
(int4 codes unpacked to one int8 each), `into_cache` writes them back bit
for bit, and a step reads its layer's arrays in place.

Why per-layer arrays: a decode step over the stacked cache reads
`c_kv[l, :, :S]`, a strided slice of the [L, B, S', C] array (for B > 1 not
one contiguous block). On the float cache this buys little (0.92-1.11x
the stacked step, so `decode.plan`'s 'auto' keeps float latents stacked):
the absorbed step is bound by its dots, which with N query rows per
sequence run far below XLA:CPU's GEMM rate (WORKSPACE.md "Quantized
caches", MLA's integer path).

Why integer attention: the same dots over int8 codes (int32 accumulation:
AVX-512 VNNI / AMX here, IMMA on GPUs) ran 2.5-2.8x faster than the float32
ones at the ablation's MLA shapes (batch 8, 4,096 slots, N 8, C 128), while
converting int8 latents to float32 first was as slow as a float32 cache.
As `kvjax.layered.int8_attend`, over one latent shared by all heads (K = 1,
G = N):

  keys     the absorbed query q_lat [N, C] and the rotary query [N, R] are
           quantized per (sequence, head) row, symmetric int8:
           logits = q_c_scale · c_scale · (q_c · c) + q_r_scale · r_scale ·
           (q_r · r), two integer dots.
  values   the latents themselves: `layered.int8_values`, the
           probabilities times each token's latent scale quantized per row
           to 255 levels, one integer dot with a ones row.

Codes are transposed, [C, S] per sequence: both integer dots read them as
their row-major operand contracting or keeping the minor slot axis, which
measured faster than [S, C] codes for each (8.1 against 8.3-9.3 ms for the
key dots, 8.0 against 11.1 ms for the value dots, 4 layers). Float latents
keep [S, C] rows, the faster layout for the float pair.

`LayeredLatent` is a registered decode cache (`attention.DecodeCache`:
write, read, latent_attend). Every function returns a new cache; none
mutates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax import attention
from kvjax import cache as cache_lib
from kvjax import layered
from kvjax import mla
from kvjax import quant

LAYERED_LATENT_DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")
TRANSPOSED = ("int8", "int4")  # codes stored [B, W, S], attended as integers


@struct.dataclass
class LayeredLatent:
  """A decode segment's per-layer view of a `LatentCache` (module
  docstring). positions [B, S]; length [B]; errors [B] (`kvjax.errors`)."""

  c: tuple
  r: tuple
  positions: jax.Array
  length: jax.Array
  c_scale: tuple | None = None
  r_scale: tuple | None = None
  errors: jax.Array | None = None
  policy: cache_lib.CachePolicy = struct.field(
      pytree_node=False, default=cache_lib.CachePolicy())
  scores = None  # no h2o: the fields the decode step reads of any cache

  @property
  def transposed(self) -> bool:
    return self.policy.kv_dtype in TRANSPOSED

  @property
  def capacity(self) -> int:
    return self.c[0].shape[2 if self.transposed else 1]


def supports(cache, attend: int) -> str | None:
  """Why `cache` cannot run a segment attending `attend` slots layered
  (None when it can): a `LatentCache` of a `LAYERED_LATENT_DTYPES` dtype
  with per-token scales, eviction 'none', positions 'original', 1 <=
  attend <= capacity."""
  if not isinstance(cache, cache_lib.LatentCache):
    return f"{type(cache).__name__} is not MLA's LatentCache"
  policy = cache.policy
  if policy.kv_dtype not in LAYERED_LATENT_DTYPES or policy.channel_keys:
    return (f"kv_dtype={policy.kv_dtype!r}, key_quant={policy.key_quant!r} "
            f"(layered latents: {LAYERED_LATENT_DTYPES}, per-token scales)")
  return layered.segment_limits(policy, cache.capacity, attend)


def from_cache(cache: cache_lib.LatentCache, attend: int, *,
               transpose: bool | None = None) -> LayeredLatent:
  """The first `attend` slots of `cache` as a LayeredLatent.

  `transpose`: int8 / int4 codes as [B, W, S] (None: for those dtypes, as
  this view attends them; False: rows, as the native view reads them).

  Raises:
    ValueError: `supports` says why not.
  """
  why = supports(cache, attend)
  if why:
    raise ValueError(f"layered latent cache: {why}")
  L = cache.c_kv.shape[0]
  if transpose is None:
    transpose = cache.policy.kv_dtype in TRANSPOSED

  def split(arr):
    return None if arr is None else tuple(arr[l, :, :attend]
                                          for l in range(L))

  def codes(arr):
    parts = split(arr)
    if arr.dtype == quant.INT4_PAIRS:  # int4 pairs unpacked to int8 codes
      parts = tuple(quant.unpack_int4(x) for x in parts)
    if not transpose:
      return parts
    return tuple(jnp.swapaxes(x, -1, -2) for x in parts)

  return LayeredLatent(c=codes(cache.c_kv), r=codes(cache.k_rope),
                       c_scale=split(cache.c_scale),
                       r_scale=split(cache.r_scale),
                       positions=cache.positions[:, :attend],
                       length=cache.length, errors=cache.errors,
                       policy=cache.policy)


def into_cache(cache: cache_lib.LatentCache, view: LayeredLatent,
               steps: int | None = None) -> cache_lib.LatentCache:
  """`cache` with the slots a segment of `steps` decode steps wrote
  (`layered.written_window`; None: its first S slots, the view's),
  positions and lengths taken from `view` (the inverse of `from_cache`)."""
  S = view.capacity
  at_B = layered.written_window(cache, view, steps)

  def window(parts, axis):
    if parts is None or at_B is None:
      return parts
    return tuple(layered.slot_window(x, at_B, steps, axis) for x in parts)

  def stored(parts):
    parts = window(parts, 2 if view.transposed else 1)
    if view.transposed:
      parts = tuple(jnp.swapaxes(x, -1, -2) for x in parts)
    if view.policy.kv_dtype == "int4":
      parts = tuple(quant.pack_int4(x) for x in parts)
    return parts

  return cache.replace(
      c_kv=layered.put_window(cache.c_kv, stored(view.c), at_B, 2),
      k_rope=layered.put_window(cache.k_rope, stored(view.r), at_B, 2),
      c_scale=layered.put_window(cache.c_scale, window(view.c_scale, 1),
                                 at_B, 2),
      r_scale=layered.put_window(cache.r_scale, window(view.r_scale, 1),
                                 at_B, 2),
      positions=cache.positions.at[:, :S].set(view.positions),
      length=view.length, errors=view.errors)


def write(view: LayeredLatent, layer: int, slots_BT, c_BTC, r_BTR
          ) -> LayeredLatent:
  """Stores one decode token per sequence (T = 1) of static `layer` at
  `slots` [B, 1] (slot = S: dropped), quantized as the stacked cache
  stores it (`kvjax.mla.write_latent`)."""
  B, T = slots_BT.shape
  if T != 1:
    raise ValueError(f"LayeredLatent holds decode steps only (T = 1), got "
                     f"T={T}")
  storage = quant.storage_dtype(view.policy.kv_dtype)
  slot_axis = 2 if view.transposed else 1
  new = {}
  for name, x_BW in (("c", c_BTC[:, 0]), ("r", r_BTR[:, 0])):
    stored_BW, scale_B = quant.quantize(x_BW, storage)
    if storage == quant.INT4_PAIRS:  # the view holds int4 codes unpacked
      stored_BW = quant.unpack_int4(stored_BW)
    arrs = list(getattr(view, name))
    arrs[layer] = layered.put_slot(arrs[layer], slots_BT[:, 0], stored_BW,
                                   slot_axis)
    new[name] = tuple(arrs)
    if scale_B is not None:
      scales = list(getattr(view, name + "_scale"))
      scales[layer] = layered.put_slot(scales[layer], slots_BT[:, 0],
                                       scale_B, 1)
      new[name + "_scale"] = tuple(scales)
  return view.replace(**new)


def read(view: LayeredLatent, layer: int, dtype, prefix: int = 0):
  """One layer's latents and rotary keys: [B, S, C] and [B, S, R] in
  `dtype` (float caches), or as stored (`layered.Int8Rows`, codes [B, C, S]
  and [B, R, S]) for int8 and int4 ones."""
  del prefix  # a segment's layered copy is its attended prefix already
  if view.transposed:
    return (layered.Int8Rows(view.c[layer], view.c_scale[layer]),
            layered.Int8Rows(view.r[layer], view.r_scale[layer]))
  return (quant.dequantize(view.c[layer], None, dtype),
          quant.dequantize(view.r[layer], None, dtype))


def int8_absorbed(q_lat_BTNC, q_rope_BTNR, c: layered.Int8Rows,
                  r: layered.Int8Rows, mask_B1TS, scale: float):
  """MLA's absorbed decode attention (T = 1) over int8 latents and rotary
  keys (codes [B, C, S], [B, R, S]) with integer dots (module docstring).

  Returns:
    o_lat_BTNC in q's dtype, probs_BNTS (float32, of the int8 logits).
  """
  _, T, N, _ = q_lat_BTNC.shape
  if T != 1:
    raise ValueError(f"int8_absorbed is decode attention (T = 1), got T={T}")
  logits_BNS = 0.0
  for q_BTNW, rows in ((q_lat_BTNC, c), (q_rope_BTNR, r)):
    q_codes_BNW, q_scale_BN = quant.quantize(q_BTNW[:, 0], jnp.int8)
    dots_BNS = jnp.einsum("BNW,BWS->BNS", layered.min_rows(q_codes_BNW, 1),
                          rows.codes, preferred_element_type=jnp.int32)
    logits_BNS = logits_BNS + (dots_BNS[:, :N].astype(jnp.float32) *
                               q_scale_BN[..., None] * rows.scale[:, None])
  # One latent for every head: K = 1, G = N in `kvjax.layered`'s terms.
  probs_B1NS = attention.decode_probs(logits_BNS[:, None], mask_B1TS, scale)
  out_B1NC = layered.int8_values(
      probs_B1NS, layered.Int8Rows(c.codes[:, None], c.scale[:, None]))
  return (out_B1NC.astype(q_lat_BTNC.dtype),
          jnp.swapaxes(probs_B1NS, 1, 2))


def _latent_attend(q_lat_BTNC, q_rope_BTNR, c, r, mask_B1TS, scale: float):
  if isinstance(c, layered.Int8Rows):
    return int8_absorbed(q_lat_BTNC, q_rope_BTNR, c, r, mask_B1TS, scale)
  return mla.absorbed_decode(q_lat_BTNC, q_rope_BTNR, c, r, mask_B1TS, scale)


attention.register_decode_cache(
    LayeredLatent, attention.DecodeCache(write=write, read=read, attend=None,
                                         latent_attend=_latent_attend))
