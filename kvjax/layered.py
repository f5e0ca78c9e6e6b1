"""The decode loop's layered cache: one array per layer, and integer
attention over int8 caches (GQA / MHA / MQA; `generate`'s decode).

  LayeredKV  k                 L × [B, K, H, S]   keys transposed
             v                 L × [B, K, S, H]   float caches
                               L × [B, K, H, S]   int8, int4: transposed
             k_scale, v_scale  L × [B, K, S]      int8, int4 (else None)

An int4 cache's view holds its codes unpacked, one int8 per code (the
segment's working copy is twice the int4 payload): a step then reads
them as int8 codes and attends as an int8 cache does; `into_cache` packs
them back, bit for bit. (The native kernel's view, `kvjax.native_layered`,
keeps them packed and unpacks in registers.)

S, the layered cache's slots, is the attended prefix of one `generate`
decode segment (`decode.attention_schedule`): the segment splits the first
S slots of the stacked `KVCache` into per-layer arrays once (`from_cache`),
runs its decode scan over them and writes back the slots it wrote
(`into_cache` with the segment's steps: a window per sequence,
`written_window`). The split costs a pass over the prefix per segment; a
segment runs as many steps as it has slots to fill, so it amortises.

Why per-layer arrays: a decode step over the stacked cache reads each
layer's `k[l, :, :, :S]`, which XLA:CPU copies before the dots (a strided
slice of the [L, B, K, S', H] array); one array per layer is read in place.
Why keys transposed, [H, S] per head: the key product is then `q K^T` with
K^T the dot's row-major right operand (as `x @ W` reads weights stored
[in, out]): 1.56x faster than `K q` over [S, H] keys for float32 and 1.18x
for int8 codes, at 8192 slots (gqa-small, batch 8).

Why int8 caches attend with integer dots (`int8_attend`) instead of being
converted to float32 first: XLA:CPU converts in a separate elementwise
pass, at a few billion elements a second, slower than reading a float32
cache, so a dequantized int8 cache was no faster than a float32 one. Its
values are stored transposed, [H, S] per head, so that the value product
reads them as its row-major left operand, contracting their minor axis
(`V^T p`): 2.0x faster than `p V` over [S, H] codes at 8192 slots (for
float32 `p V` is 1.2x faster than `V^T p`, so float values stay [S, H]).

bfloat16 gets no such path: any in-place update of a bfloat16 array
becomes a float32 conversion of the whole array on XLA:CPU (23.8 ms
against 0.004 ms per one-row update of an [8, 2, 8192, 32] array), which
is why caches store its bits (uint16, `kvjax.quant`); and a bitcast of
those bits feeding a dot is materialised as a copy (0.9 ms per layer and
step at that size), as slow as the conversion it replaces. bfloat16 dots
over such copies measured no faster than the converted path, so bfloat16
(and float16) caches are read converted, as on the stacked cache.

Integer attention (int8 × int8 dots, int32 accumulation: AVX-512 VNNI /
AMX on the Intel host, IMMA on GPUs) reads the codes directly:

  keys     the query is quantized per (sequence, head) row, symmetric
           int8 (as llama.cpp quantizes its activations for q8 dots):
           logits = q_scale · k_scale · (q_codes · k_codes).
  values   the probabilities times each token's value scale (≥ 0) are
           quantized per row to 255 levels, p ≈ p_scale · (c + 127) with
           c in [-127, 127]; a row of ones appended to the codes gives
           Σ_s v_codes in the same dot, so
           out = p_scale · (Σ_s c_s v_s + 127 · Σ_s v_s), exact integers.
           Masked slots have p = 0, so their c = -127 cancels exactly.
           int32 holds the sums up to `INT8_MAX_SLOTS` slots.

This adds rounding beyond the int8 storage's (measured on the trained
model, WORKSPACE.md "Quantized caches"); the probabilities the step
returns are the float32 ones.

`LayeredKV` is a decode cache kind (`attention.DecodeCache`, registered
below): the attention code reads it through that protocol, unaware of its
layout. Every function returns a new cache; none mutates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax import attention
from kvjax import cache as cache_lib
from kvjax import quant

# |Σ_s c_s v_s + 127 Σ_s v_s| ≤ 254 · 127 · S must fit int32 (|c|, |v| ≤ 127).
INT8_MAX_SLOTS = (2**31 - 1) // (254 * 127)
_P_OFFSET = 127  # codes c = round(p / p_scale) - 127 cover p in 255 levels
LAYERED_DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")
TRANSPOSED = ("int8", "int4")  # values stored [B, K, H, S]
MIN_DOT_ROWS = 4  # rows an int8 dot is padded to (`min_rows`)
_KEY_SLOTS, _VALUE_SLOTS, _VALUE_SLOTS_T = 3, 2, 3  # slot axis of [B, K, ., .]


@struct.dataclass
class Int8Rows:
  """int8 codes [..., H, S] (transposed) and their float32 scales [..., S]
  (one per token): what a layered int8 cache reads, undequantized."""
  codes: jax.Array
  scale: jax.Array


@struct.dataclass
class LayeredKV:
  """A decode segment's per-layer view of a `KVCache` (module docstring).

  k: L-tuple of [B, K, H, S] (transposed) in the policy's storage dtype
  (int4: int8 codes, unpacked); v: L-tuple of [B, K, S, H], or [B, K, H,
  S] for `TRANSPOSED` kv dtypes; k_scale, v_scale: L-tuples of [B, K, S]
  (int8, int4) or None; positions [B, S]; length [B]; errors [B]
  (`kvjax.errors`).
  """

  k: tuple
  v: tuple
  positions: jax.Array
  length: jax.Array
  k_scale: tuple | None = None
  v_scale: tuple | None = None
  errors: jax.Array | None = None
  policy: cache_lib.CachePolicy = struct.field(
      pytree_node=False, default=cache_lib.CachePolicy())
  scores = None  # no h2o: the fields the decode step reads of any cache

  @property
  def capacity(self) -> int:
    return self.k[0].shape[3]

  @property
  def transposed(self) -> bool:
    return self.policy.kv_dtype in TRANSPOSED


@struct.dataclass
class StackedSegment:
  """A decode segment's view that reads the stacked cache itself, in place,
  over its first S slots (`native_layered.NativeKV`,
  `native_latent.InPlaceLatent`): the model updates positions [B, S],
  length and errors here; `stacked` takes the writes."""

  stacked: cache_lib.Cache
  positions: jax.Array
  length: jax.Array
  errors: jax.Array | None = None
  scores = None  # no h2o: the fields the decode step reads of any cache

  @property
  def policy(self) -> cache_lib.CachePolicy:
    return self.stacked.policy

  @property
  def capacity(self) -> int:
    return self.positions.shape[1]

  def kept_slots(self, slots_BT):
    """Decode write slots as the stacked cache takes them: slot S and past
    (beyond the segment) become the stacked cache's own dropped slot, as a
    per-layer view drops them."""
    return jnp.where(slots_BT < self.capacity, slots_BT,
                     self.stacked.capacity)

  def after(self, cache, **written):
    """The stacked cache after the segment (`into_cache`): what the steps
    wrote in place (and `written`), positions [0, S) from the segment,
    lengths and errors; `cache` the stacked cache before it."""
    return self.stacked.replace(
        positions=cache.positions.at[:, :self.capacity].set(self.positions),
        length=self.length, errors=self.errors, **written)


def supports(cache, attend: int) -> str | None:
  """Why `cache` cannot run a segment attending `attend` slots layered
  (None when it can): a `KVCache` of a `LAYERED_DTYPES` dtype with
  per-token keys, eviction 'none', positions 'original', 1 <= attend <=
  capacity (int8: at most `INT8_MAX_SLOTS`)."""
  if not isinstance(cache, cache_lib.KVCache):
    return "MLA's latent cache has no per-head keys"
  policy = cache.policy
  if policy.kv_dtype not in LAYERED_DTYPES or policy.channel_keys:
    return (f"kv_dtype={policy.kv_dtype!r}, key_quant={policy.key_quant!r} "
            f"(layered: {LAYERED_DTYPES}, per-token keys)")
  return segment_limits(policy, cache.capacity, attend)


def segment_limits(policy: cache_lib.CachePolicy, capacity: int,
                   attend: int) -> str | None:
  """Why a per-layer view (this one or `kvjax.layered_latent`'s) cannot
  hold a segment attending `attend` of `capacity` slots, or None: it
  needs eviction 'none' and positions 'original' (the filled slots a
  prefix), 1 <= attend <= capacity and, for integer attention, attend <=
  INT8_MAX_SLOTS."""
  if policy.eviction != "none" or policy.positions != "original":
    return (f"eviction={policy.eviction!r}, positions={policy.positions!r} "
            "(needs 'none', 'original': the filled slots a prefix)")
  if not 1 <= attend <= capacity:
    return f"attend={attend} is not within capacity {capacity}"
  if policy.quantized and attend > INT8_MAX_SLOTS:
    return (f"attend={attend} > {INT8_MAX_SLOTS} slots, where int8 "
            "attention's int32 sums could overflow")
  return None


def layer_slices(arr, attend: int, unpack: bool = True):
  """A stacked cache array's first `attend` slots as one array per layer
  (slot axis 3 of [L, B, K, S, ...]), int4 payloads unpacked to one int8
  code each unless `unpack` is False; None stays None. What the per-layer
  views hold, before their own layouts."""
  if arr is None:
    return None
  parts = tuple(arr[l, :, :, :attend] for l in range(arr.shape[0]))
  if unpack and arr.dtype == quant.INT4_PAIRS:
    parts = tuple(quant.unpack_int4(x) for x in parts)
  return parts


def written_window(cache, view, steps: int | None):
  """Where each sequence's decode segment of `steps` steps may have written
  in a view of S slots: the first slot of a window of `steps` slots per
  sequence, [B] int32, or None where the whole prefix goes back (`steps`
  None, or a window no shorter than S).

  Under eviction 'none' (the views' only policy) step j of sequence b
  writes slot length_b + j, length_b the stacked cache's length before the
  segment; writes at S or past are dropped. A window that would run past
  S starts at S - steps instead: it still covers every slot written, and
  the slots it adds hold what the view read, so they go back unchanged.

  Why windows: a segment writes `steps` slots per sequence and layer and
  reads the whole prefix; writing the prefix back cost a pass over it per
  segment (58 ms of float32 gqa-small at batch 8, 16,384 slots; 244 ms for
  mha-small; WORKSPACE.md "A decode segment's copies").
  """
  S = view.capacity
  if steps is None or steps >= S:
    return None
  return jnp.clip(cache.length, 0, S - steps).astype(jnp.int32)


def slot_window(x, at_B, W: int, axis: int):
  """x [B, ...]'s W slots from at_B[b] along its slot `axis`, per sequence
  (`axis` counts B)."""
  return jax.vmap(
      lambda xb, a: jax.lax.dynamic_slice_in_dim(xb, a, W, axis - 1))(x, at_B)


def tile_window(tiles, at_B, W: int, untile):
  """Slots [at_B[b], at_B[b] + W) of keys in tiles of X slots, tiles [B, K,
  n, ..., X] with untile(tiles) [B, K, n · X, H]: as [B, K, W, H], from
  the tiles that hold them only (two more than W / X at most)."""
  n, X = tiles.shape[2], tiles.shape[-1]
  nt = min(n, -(-W // X) + 1)
  t0_B = jnp.clip(at_B // X, 0, n - nt)
  rows = untile(slot_window(tiles, t0_B, nt, 2))
  return slot_window(rows, at_B - t0_B * X, W, 2)


def put_window(arr, parts, at_B, axis: int):
  """arr [L, B, ...] with each layer's window parts[l] [B, ..., W, ...]
  written at slots [at_B[b], at_B[b] + W) of its slot `axis` (counting L
  and B); the whole prefix (slots [0, W)) where at_B is None."""
  if arr is None:
    return None
  update = jnp.stack(parts)
  if at_B is None:
    index = (slice(None),) * axis + (slice(0, update.shape[axis]),)
    return arr.at[index].set(update)

  # One dynamic update per sequence, not a vmapped one: XLA:CPU runs each
  # in place, where the scatter a vmap makes of them measured slower than
  # writing the whole prefix back.
  for b in range(update.shape[1]):
    index = [0] * arr.ndim
    index[1], index[axis] = b, at_B[b]
    arr = jax.lax.dynamic_update_slice(arr, update[:, b:b + 1], index)
  return arr


def write_back(cache: cache_lib.KVCache, view, k_parts, v_parts,
               at_B=None) -> cache_lib.KVCache:
  """`cache` with a per-layer view's slots written back: keys and values per
  layer as [B, K, W, H] codes (int4 packed back into pairs) of slots
  [at_B[b], at_B[b] + W) of
  each sequence (`written_window`; at_B None: W = S, the whole prefix),
  the view's scales there, its positions, lengths and errors."""
  S = view.capacity

  def scales(parts):
    if parts is None or at_B is None:
      return parts
    return tuple(slot_window(x, at_B, v_parts[0].shape[2], 2) for x in parts)

  if view.policy.kv_dtype == "int4":
    k_parts, v_parts = (tuple(quant.pack_int4(x) for x in k_parts),
                        tuple(quant.pack_int4(x) for x in v_parts))
  return cache.replace(
      k=put_window(cache.k, k_parts, at_B, 3),
      v=put_window(cache.v, v_parts, at_B, 3),
      k_scale=put_window(cache.k_scale, scales(view.k_scale), at_B, 3),
      v_scale=put_window(cache.v_scale, scales(view.v_scale), at_B, 3),
      positions=cache.positions.at[:, :S].set(view.positions),
      length=view.length, errors=view.errors)


def _swap(parts):
  return tuple(jnp.swapaxes(x, -1, -2) for x in parts)


def from_cache(cache: cache_lib.KVCache, attend: int) -> LayeredKV:
  """The first `attend` slots of `cache` as a LayeredKV.

  Raises:
    ValueError: `supports` says why not.
  """
  why = supports(cache, attend)
  if why:
    raise ValueError(f"layered decode cache: {why}")
  v = layer_slices(cache.v, attend)
  return LayeredKV(k=_swap(layer_slices(cache.k, attend)),
                   v=_swap(v) if cache.policy.kv_dtype in TRANSPOSED else v,
                   k_scale=layer_slices(cache.k_scale, attend),
                   v_scale=layer_slices(cache.v_scale, attend),
                   positions=cache.positions[:, :attend], length=cache.length,
                   errors=cache.errors, policy=cache.policy)


def into_cache(cache: cache_lib.KVCache, layered: LayeredKV,
               steps: int | None = None) -> cache_lib.KVCache:
  """`cache` with the slots a segment of `steps` decode steps wrote
  (`written_window`; None: its first S slots, the layered cache's),
  positions and lengths taken from `layered` (the inverse of
  `from_cache`)."""
  at_B = written_window(cache, layered, steps)
  if at_B is None:
    v = _swap(layered.v) if layered.transposed else layered.v
    return write_back(cache, layered, _swap(layered.k), v)
  k = _swap(tuple(slot_window(x, at_B, steps, 3) for x in layered.k))
  v = tuple(slot_window(x, at_B, steps, 3 if layered.transposed else 2)
            for x in layered.v)
  return write_back(cache, layered, k, _swap(v) if layered.transposed else v,
                    at_B=at_B)


def write(layered: LayeredKV, layer: int, slots_BT, k_BTKH, v_BTKH
          ) -> LayeredKV:
  """Stores one decode token per sequence (T = 1) of static `layer` at
  `slots` [B, 1] (slot = S: dropped), quantized if the policy says so."""
  B, T = slots_BT.shape
  if T != 1:
    raise ValueError(f"LayeredKV holds decode steps only (T = 1), got T={T}")
  storage = quant.storage_dtype(layered.policy.kv_dtype)
  new = {}
  for name, x_BKH in (("k", k_BTKH[:, 0]), ("v", v_BTKH[:, 0])):
    codes_BKH, scale_BK = quant.quantize(x_BKH, storage)
    if storage == quant.INT4_PAIRS:  # the view holds int4 codes unpacked
      codes_BKH = quant.unpack_int4(codes_BKH)
    slot_axis = (_KEY_SLOTS if name == "k" else
                 _VALUE_SLOTS_T if layered.transposed else _VALUE_SLOTS)
    arrs = list(getattr(layered, name))
    arrs[layer] = put_slot(arrs[layer], slots_BT[:, 0], codes_BKH, slot_axis)
    new[name] = tuple(arrs)
    if scale_BK is not None:
      scales = list(getattr(layered, name + "_scale"))
      scales[layer] = put_slot(scales[layer], slots_BT[:, 0], scale_BK, 2)
      new[name + "_scale"] = tuple(scales)
  return layered.replace(**new)


def put_slot(arr, s_B, new, axis: int):
  """arr [B, ...] with index s_B[b] of its slot `axis` (>= 1) set to new
  [B, ...] (the slot axis removed) for every sequence b (s = S:
  unchanged).

  Why a dynamic_update_slice at batch 1: XLA:CPU turns a one-sequence
  scatter into a copy of the whole array; an update slice is done in
  place. It clamps its start, so slot S writes back what slot S - 1
  holds."""
  B, S = arr.shape[0], arr.shape[axis]
  new = jnp.expand_dims(new, axis)
  if B > 1:
    idx = (jnp.arange(B),) + (slice(None),) * (axis - 1) + (s_B,)
    return arr.at[idx].set(jnp.squeeze(new, axis), mode="drop")
  slot = jnp.minimum(s_B[0], S - 1)
  start = tuple(slot if a == axis else 0 for a in range(arr.ndim))
  old = jax.lax.dynamic_slice(arr, start, new.shape)
  return jax.lax.dynamic_update_slice(arr, jnp.where(s_B[0] < S, new, old),
                                      start)


def read(layered: LayeredKV, layer: int, dtype, prefix: int = 0):
  """One layer's keys [B, K, H, S] (transposed) and values [B, K, S, H],
  in `dtype` (float caches); int8 and int4 ones as stored (`Int8Rows`, both
  transposed)."""
  del prefix  # a segment's layered copy is its attended prefix already
  if layered.k_scale is not None:
    return (Int8Rows(layered.k[layer], layered.k_scale[layer]),
            Int8Rows(layered.v[layer], layered.v_scale[layer]))
  return (quant.dequantize(layered.k[layer], None, dtype),
          quant.dequantize(layered.v[layer], None, dtype))


def int8_attend(q_BTKGH, k: Int8Rows, v: Int8Rows, mask_BKTS, scale: float):
  """Decode attention (T = 1) of float queries over int8 keys and values
  (codes transposed, [B, K, H, S] each) with integer dots (module
  docstring).

  Returns:
    out_BTKGH in q's dtype, probs_BKGTS (float32, of the int8 logits).
  """
  _, T, _, G, _ = q_BTKGH.shape
  if T != 1:
    raise ValueError(f"int8_attend is decode attention (T = 1), got T={T}")
  q_codes_BKGH, q_scale_BKG = quant.quantize(q_BTKGH[:, 0], jnp.int8)
  dots_BKGS = jnp.einsum("BKGH,BKHS->BKGS", min_rows(q_codes_BKGH, 2),
                         k.codes, preferred_element_type=jnp.int32)[:, :, :G]
  logits_BKGS = (dots_BKGS.astype(jnp.float32) * q_scale_BKG[..., None] *
                 k.scale[:, :, None])
  probs_BKGS = attention.decode_probs(logits_BKGS, mask_BKTS, scale)
  out_BKGH = int8_values(probs_BKGS, v)
  return out_BKGH[:, None].astype(q_BTKGH.dtype), probs_BKGS[:, :, :, None]


def int8_values(probs_BKGS, v: Int8Rows):
  """Σ_s p_s v_s [B, K, G, H] (float32) over int8 values (codes [B, K, H,
  S], transposed) with one integer dot (module docstring: the
  probabilities times each token's value scale, quantized per row to 255
  levels, and a row of ones for Σ_s v_codes)."""
  B, K, G, _ = probs_BKGS.shape
  # Each token's value scale moves into its probability (both >= 0).
  pv_BKGS = probs_BKGS * v.scale[:, :, None]
  p_scale_BKG = jnp.max(pv_BKGS, axis=-1) / (2 * _P_OFFSET)
  safe = jnp.where(p_scale_BKG > 0, p_scale_BKG, 1.0)[..., None]
  codes_BKGS = (jnp.round(pv_BKGS / safe) - _P_OFFSET).astype(jnp.int8)
  ones_BK1S = jnp.ones((B, K, 1, codes_BKGS.shape[-1]), jnp.int8)
  # g: G' rows, the G probability rows, the ones row, zero rows up to
  # MIN_DOT_ROWS.
  sums_BKHg = jnp.einsum(
      "BKHS,BKGS->BKHG", v.codes,
      min_rows(jnp.concatenate([codes_BKGS, ones_BK1S], axis=2), 2),
      preferred_element_type=jnp.int32)[..., :G + 1]
  sums_BKGH = jnp.swapaxes(
      sums_BKHg[..., :G] + _P_OFFSET * sums_BKHg[..., G:], -1, -2)
  return sums_BKGH.astype(jnp.float32) * p_scale_BKG[..., None]


def min_rows(x_BKGW, axis: int):
  """x with zero rows appended along `axis` up to MIN_DOT_ROWS.

  Why: an int8 dot with one or two rows (MHA's G = 1) runs XLA:CPU's slow
  path: 24.2 ms for [1, 32] @ [32, 8192] codes of 64 heads, against 3.1 ms
  with four rows (gqa-small shapes, batch 8)."""
  n = x_BKGW.shape[axis]
  if n >= MIN_DOT_ROWS:
    return x_BKGW
  pad = [(0, 0)] * x_BKGW.ndim
  pad[axis] = (0, MIN_DOT_ROWS - n)
  return jnp.pad(x_BKGW, pad)


def _attend(q_BTKGH, keys, values, mask_BKTS, scale: float,
            impl: str = "einsum"):
  """Decode attention over the layered cache (`impl` does not apply: no
  fused kernel reads transposed keys)."""
  del impl
  if isinstance(keys, Int8Rows):
    return int8_attend(q_BTKGH, keys, values, mask_BKTS, scale)
  B, T, K, G, H = q_BTKGH.shape
  if T != 1:
    raise ValueError(f"LayeredKV attends decode steps only (T = 1), got "
                     f"T={T}")
  logits_BKGS = jnp.einsum("BKGH,BKHS->BKGS", q_BTKGH[:, 0], keys,
                           preferred_element_type=jnp.float32)
  return attention.decode_softmax_values(logits_BKGS, values, mask_BKTS,
                                         scale, q_BTKGH.dtype)


attention.register_decode_cache(
    LayeredKV, attention.DecodeCache(write=write, read=read, attend=_attend))
