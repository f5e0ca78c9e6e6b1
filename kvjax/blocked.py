"""The decode loop's blocked cache: per-layer arrays, keys transposed in
blocks of slots (GQA / MHA / MQA; `generate`'s batched decode).

  BlockedKV  k  L × [B, K, W, H, X]   keys: W = S / X blocks of X slots,
                                      each block stored head-dim-major
             v  L × [B, K, S, H]      values, as in the stacked cache

S, the blocked cache's slots, is the attended prefix of one `generate`
decode segment (`decode.attention_schedule`): the segment converts the
first S slots of the stacked `KVCache` into this form once (`from_cache`),
runs its decode scan over it and writes the slots back (`into_cache`).
Same values, same attention, same tokens; only the layout the decode step
reads changes.

Why (measured, WORKSPACE.md): at batch 8 the stacked cache costs a decode
step two slice copies per layer (XLA:CPU copies `k[l, :, :, :S]` before the
dots) and its key product `'BKSH,BKGH->BKSG'` has only G = 3 output columns.
Per-layer arrays remove the copies; keys in [H, X] blocks make the key
product a batched `[G, H] @ [H, X]` over contiguous 16 KB blocks, which
YNNPACK streams ~2.4× faster from memory. Together with RoPE tables carried
in the decode loop (`model.decode_rope`): 7–9 % faster batch-8 decode steps
for gqa-medium when it was added. Re-measured beside the layered cache
(`kvjax.layered`: per-layer arrays, keys transposed whole;
experiments/cache_layout.py, batch 8) it was 0.94-1.01x the stacked cache
for gqa-medium at 512-4096 slots and 1.24-1.54x for mha-small at 2048-8192,
where the layered one was 0.99-1.20x and 1.60-2.06x; 'auto' no longer
picks it, and `decode_layout='blocked'` still runs it.

`BlockedKV` is a decode cache kind (`attention.DecodeCache`, registered
below): the attention code reads it through that protocol, unaware of its
layout. Every function returns a new cache; none mutates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax import attention
from kvjax import cache as cache_lib
from kvjax import layered
from kvjax import quant

BLOCK = 64  # X: slots per key block (32 measured as fast, 128 slower)


@struct.dataclass
class BlockedKV:
  """A decode segment's view of a float `KVCache` (see the module docstring).

  k: L-tuple of [B, K, W, H, X] keys; v: L-tuple of [B, K, S, H] values
  (storage dtype of the policy); positions [B, S]; length [B]; errors [B]
  (`kvjax.errors`).
  """

  k: tuple
  v: tuple
  positions: jax.Array
  length: jax.Array
  errors: jax.Array | None = None
  policy: cache_lib.CachePolicy = struct.field(
      pytree_node=False, default=cache_lib.CachePolicy())
  scores = None  # no h2o: the fields the decode step reads of any cache

  @property
  def capacity(self) -> int:
    return self.v[0].shape[2]

  @property
  def block(self) -> int:
    return self.k[0].shape[-1]


def supports(cache, attend: int, block: int = BLOCK) -> str | None:
  """Why `cache` cannot run a segment attending `attend` slots blocked
  (None when it can): a float GQA cache, eviction 'none', positions
  'original', `attend` a multiple of `block`."""
  if not isinstance(cache, cache_lib.KVCache):
    return "MLA's latent cache has no per-head keys"
  policy = cache.policy
  if policy.quantized:
    return f"kv_dtype={policy.kv_dtype!r} (quantized scales are not blocked)"
  if policy.eviction != "none" or policy.positions != "original":
    return (f"eviction={policy.eviction!r}, positions={policy.positions!r} "
            "(needs 'none', 'original': the filled slots a prefix)")
  if attend < 1 or attend % block or attend > cache.capacity:
    return (f"attend={attend} is not a multiple of the block ({block}) "
            f"within capacity {cache.capacity}")
  return None


def from_cache(cache: cache_lib.KVCache, attend: int,
               block: int = BLOCK) -> BlockedKV:
  """The first `attend` slots of `cache` as a BlockedKV.

  Raises:
    ValueError: `supports` says why not.
  """
  why = supports(cache, attend, block)
  if why:
    raise ValueError(f"blocked decode cache: {why}")
  L, B, K, _, H = cache.k.shape
  W, X = attend // block, block
  k = tuple(jnp.swapaxes(cache.k[l, :, :, :attend].reshape(B, K, W, X, H),
                         -1, -2) for l in range(L))
  v = tuple(cache.v[l, :, :, :attend] for l in range(L))
  return BlockedKV(k=k, v=v, positions=cache.positions[:, :attend],
                   length=cache.length, errors=cache.errors,
                   policy=cache.policy)


def into_cache(cache: cache_lib.KVCache, blocked: BlockedKV,
               steps: int | None = None) -> cache_lib.KVCache:
  """`cache` with the slots a segment of `steps` decode steps wrote
  (`layered.written_window`; None: its first S slots, the blocked
  cache's), positions and lengths taken from `blocked` (the inverse of
  `from_cache`)."""
  B, K, W, H, X = blocked.k[0].shape
  S = W * X

  def rows(k):  # [B, K, n, H, X] blocks -> [B, K, n · X, H]
    return jnp.swapaxes(k, -1, -2).reshape(B, K, k.shape[2] * X, H)

  at_B = layered.written_window(cache, blocked, steps)
  if at_B is None:
    k, v = tuple(map(rows, blocked.k)), blocked.v
  else:
    k = tuple(layered.tile_window(x, at_B, steps, rows) for x in blocked.k)
    v = tuple(layered.slot_window(x, at_B, steps, 2) for x in blocked.v)
  return cache.replace(
      k=layered.put_window(cache.k, k, at_B, 3),
      v=layered.put_window(cache.v, v, at_B, 3),
      positions=cache.positions.at[:, :S].set(blocked.positions),
      length=blocked.length, errors=blocked.errors)


def write(blocked: BlockedKV, layer: int, slots_BT, k_BTKH, v_BTKH
          ) -> BlockedKV:
  """Stores one decode token per sequence (T = 1) of static `layer` at
  `slots` [B, 1] (slot = S: dropped)."""
  B, T = slots_BT.shape
  if T != 1:
    raise ValueError(f"BlockedKV holds decode steps only (T = 1), got T={T}")
  X = blocked.block
  dtype = blocked.v[0].dtype
  b_B = jnp.arange(B)
  s_B = slots_BT[:, 0]
  k_BKH, _ = quant.quantize(k_BTKH[:, 0], dtype)  # a cast (float caches)
  v_BTKH, _ = quant.quantize(v_BTKH, dtype)
  k, v = list(blocked.k), list(blocked.v)
  # Slot S (past the segment) has block W: out of range, dropped like slot S.
  k[layer] = k[layer].at[b_B, :, s_B // X, :, s_B % X].set(k_BKH,
                                                           mode="drop")
  v[layer] = v[layer].at[b_B[:, None], :, slots_BT].set(v_BTKH, mode="drop")
  return blocked.replace(k=tuple(k), v=tuple(v))


def read(blocked: BlockedKV, layer: int, dtype):
  """One layer's keys [B, K, W, H, X] and values [B, K, S, H] in `dtype`."""
  return (quant.dequantize(blocked.k[layer], None, dtype),
          quant.dequantize(blocked.v[layer], None, dtype))


def key_logits(q_BTKGH, k_BKWHX):
  """Decode key logits [B, K, G, S] (float32, unscaled) of one query per
  sequence against blocked keys; `attention.decode_softmax_values` does the
  rest, as for the stacked cache."""
  B, _, K, G, H = q_BTKGH.shape
  W, X = k_BKWHX.shape[2], k_BKWHX.shape[4]
  # One [G, H] @ [H, X] product per (B, K, W) block: the query is repeated
  # per block (W·G·H numbers, small) so the product has batch dims only.
  q_BKWGH = jnp.broadcast_to(q_BTKGH[:, 0, :, None], (B, K, W, G, H))
  logits_BKWGX = jnp.einsum("BKWGH,BKWHX->BKWGX", q_BKWGH, k_BKWHX,
                            preferred_element_type=jnp.float32)
  return jnp.swapaxes(logits_BKWGX, 2, 3).reshape(B, K, G, W * X)


def _read(blocked: BlockedKV, layer: int, dtype, prefix: int = 0):
  del prefix  # a segment's blocked copy is its attended prefix already
  return read(blocked, layer, dtype)


def _attend(q_BTKGH, k_BKWHX, v_BKSH, mask_BKTS, scale: float,
            impl: str = "einsum"):
  """Decode attention over blocked keys (no probabilities are kept: the
  blocked layout runs eviction 'none' only; `impl` does not apply)."""
  del impl
  out_BTKGH, _ = attention.decode_softmax_values(
      key_logits(q_BTKGH, k_BKWHX), v_BKSH, mask_BKTS, scale, q_BTKGH.dtype)
  return out_BTKGH, None


attention.register_decode_cache(
    BlockedKV, attention.DecodeCache(write=write, read=_read, attend=_attend))
