"""The paged KV cache: a pool of fixed-size pages and a block table per
sequence (vLLM's PagedAttention, Kwon et al. 2023), as one more cache layout
behind the model's cache protocol.

Dimension letters (the alphabet in `kvjax.config`; P is MLA's non-rotary
dim there, so pages are Z):

  Z  pages in the pool (all sequences draw from it)
  Y  slots per page (the page size)
  M  pages per sequence in the block table (capacity S = M · Y)
  A  pages a call reads: the view covers A · Y slots (a static bucket
     covering every row's tokens; past M the view reads zeros)
  J  pages one call writes per sequence (1 for a decode step)

Layout. Every per-token array of the contiguous cache (`kvjax.cache`) has a
pool twin with the batch axis B replaced by the pages Z and the slot axis S
by the page's Y slots, in the same order:

  GQA / MHA / MQA  k, v      [L, Z, K, Y, H]   (heads-first inside a page,
                   k_scale,  [L, Z, K, Y]       as the contiguous cache)
                   v_scale   (int8 per token)
                   k_scale   [L, Z, K, Y / X, H] (KIVI keys: X = key_group)
  MLA              c_kv      [L, Z, Y, C]
                   k_rope    [L, Z, Y, R]
                   c_scale,  [L, Z, Y] (int8 per token) or
                   r_scale   [L, Z, Y / X, C | R] (KIVI)

Per sequence: `block_table [B, M]` (the page holding slots j·Y .. j·Y + Y - 1
of row b, NO_PAGE = -1 where none is mapped), `length [B]`, `errors [B]`
(`kvjax.errors`), and KIVI's float32 newest key group (`k_resid
[L, B, K, X, H]`; MLA `c_resid`, `r_resid`), which belongs to a sequence,
not to a page.

Only eviction 'none' with positions 'original' is paged: slot = position,
so the block table alone says where every token is, and a page's content
never depends on which sequence holds it (the basis of prefix sharing).
Evicting policies are bounded rolling buffers already; paging is for caches
that grow.

How a prompt call runs (one jitted function each for prefill and extend):

  view     gather the A pages of every row into a contiguous `KVCache` /
           `LatentCache` [.., B, .., A · Y, ..]; positions from the lengths
           (slot s holds position s below the length, else empty); unmapped
           pages read as zeros (a freshly allocated page is read unmapped,
           so nothing a page held before is ever visible).
  model    `model.prefill_logits` / `extend_logits` / `decode_logits`, the
           same functions the contiguous entry points run: same values,
           same masks, same quantization, same error bits.
  scatter  write the pages the call touched (the pages of slots
           [length before, length after)) back, whole, to the pages of a
           *write table* (default: the block table). A write table that
           maps a touched page elsewhere is copy-on-write: the call reads
           the shared page and writes its private copy, in the same
           program. A touched page with no page to go to is recorded as
           OVERFLOW (the token would be lost), never dropped silently.

Decode reads the pool in place: `decode_loop` runs the one decode loop
(`kvjax.decode.run`) on a `PagedKV`, a decode cache kind
(`attention.DecodeCache`, registered below) whose write puts each new
token at (page, slot % Y) of its layer's pool and whose read gathers one
layer's A pages per row straight into the [B, K, A · Y, H] (latent:
[B, A · Y, C]) operand of the attention products. The contiguous stacked
cache pays the same per-layer copy (XLA:CPU copies `k[l, :, :, :S]` before
the dots), so no whole-cache view is built and nothing is written back:
what paging costs a decode step is measured by
`kvjax.lab.serving.decode_step_cost` (experiments/serve.py).
Copy-on-write happens once per call, before the loop: every page the call
will write whose write-table page differs from its block-table page is
copied (a freshly mapped page is zeroed), and the loop reads and writes
through the write table.
"""

from __future__ import annotations

import functools
import math
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import attention
from kvjax import cache as cache_lib
from kvjax import decode as decode_lib
from kvjax import errors
from kvjax import inference
from kvjax import kivi
from kvjax import model
from kvjax import norm_matvec
from kvjax import packed
from kvjax import params as params_lib
from kvjax import quant
from kvjax.config import ModelConfig
from kvjax.validate import check_int

NO_PAGE = -1  # a block-table entry that maps no page

# Per-token arrays of each cache kind, and the axis of their slots in the
# contiguous [L, B, ...] layout (the same axis holds Y in the pool).
PAGED_FIELDS = {
    "kv": (("k", 3), ("v", 3), ("k_scale", 3), ("v_scale", 3)),
    "latent": (("c_kv", 2), ("k_rope", 2), ("c_scale", 2), ("r_scale", 2)),
}
# Per-sequence arrays (KIVI's float32 newest group).
RESID_FIELDS = {"kv": ("k_resid",), "latent": ("c_resid", "r_resid")}


class _Pool:
  """What a page pool's shapes say (`pool`: field name -> [L, Z, ...])."""

  @property
  def kind(self) -> str:
    return "latent" if "c_kv" in self.pool else "kv"

  @property
  def page_size(self) -> int:
    """Y."""
    return self.pool["c_kv"].shape[2] if self.kind == "latent" else (
        self.pool["k"].shape[3])

  @property
  def num_pages(self) -> int:
    """Z."""
    return next(iter(self.pool.values())).shape[1]


@struct.dataclass
class PagedCache(_Pool):
  """A page pool shared by B sequences, and each sequence's block table.

  pool: field name -> pool array ([L, Z, ..., Y', ...], the module
    docstring; Y' = Y, or Y / X for KIVI key scales: X = key_group).
  block_table: [B, M] int32 page ids (NO_PAGE: unmapped).
  length: [B] int32 tokens held by each sequence (the next position).
  errors: [B] int32 error bits (`kvjax.errors`).
  resid: field name -> [L, B, ...] per-sequence KIVI residuals ({} for other
    caches).
  policy: the `CachePolicy` (static; eviction 'none', positions 'original').
  """

  pool: dict
  block_table: jax.Array
  length: jax.Array
  errors: jax.Array
  resid: dict
  policy: cache_lib.CachePolicy = struct.field(
      pytree_node=False, default=cache_lib.CachePolicy())

  @property
  def max_pages(self) -> int:
    """M."""
    return self.block_table.shape[1]

  @property
  def capacity(self) -> int:
    """Slots one sequence can address: M · Y."""
    return self.max_pages * self.page_size

  @property
  def batch(self) -> int:
    return self.block_table.shape[0]


Cache = Union[cache_lib.KVCache, cache_lib.LatentCache]


# ---- construction -----------------------------------------------------------
def check_policy(policy: cache_lib.CachePolicy, page_size: int) -> None:
  """Raises ValueError unless `policy` can be paged with `page_size`."""
  if policy.eviction != "none" or policy.positions != "original":
    raise ValueError(
        f"a paged cache needs eviction='none' and positions='original', got "
        f"eviction={policy.eviction!r}, positions={policy.positions!r}: "
        "slot = position is what lets a block table locate every token")
  if policy.channel_keys and page_size % policy.key_group:
    raise ValueError(
        f"page_size={page_size} must be a multiple of key_group="
        f"{policy.key_group} (key_quant='channel' quantizes whole groups, "
        "which must not straddle pages)")


def init_paged(config: ModelConfig, batch: int, num_pages: int,
               page_size: int, max_pages: int,
               policy: cache_lib.CachePolicy | None = None) -> PagedCache:
  """An empty pool of `num_pages` pages and `batch` empty block tables.

  Args:
    config: the model.
    batch: B, sequences (rows) the cache serves at once.
    num_pages: Z, pages in the pool.
    page_size: Y, slots per page.
    max_pages: M, block-table width (a sequence holds at most M · Y tokens).
    policy: storage dtype and key quantization (eviction 'none',
      positions 'original').
  Raises:
    ValueError naming the argument, before anything is allocated.
  """
  policy = policy or cache_lib.CachePolicy()
  check_int("batch", batch, 1)
  check_int("num_pages", num_pages, 1)
  check_int("page_size", page_size, 1)
  check_int("max_pages", max_pages, 1)
  check_policy(policy, page_size)
  # Shapes only: init_cache would also allocate what a pool does not need
  # (positions, lengths and KIVI residuals per page).
  pool_shapes = jax.eval_shape(
      lambda: cache_lib.init_cache(config, num_pages, page_size,
                                   policy=policy))
  seq_shapes = jax.eval_shape(
      lambda: cache_lib.init_cache(
          config, batch, policy.key_group if policy.channel_keys else 1,
          policy=policy))
  kind = "latent" if config.attention == "mla" else "kv"
  pool = {name: jnp.zeros(getattr(pool_shapes, name).shape,
                          getattr(pool_shapes, name).dtype)
          for name, _ in PAGED_FIELDS[kind]
          if getattr(pool_shapes, name) is not None}
  resid = {name: jnp.zeros(getattr(seq_shapes, name).shape, jnp.float32)
           for name in RESID_FIELDS[kind]
           if getattr(seq_shapes, name) is not None}
  return PagedCache(
      pool=pool,
      block_table=jnp.full((batch, max_pages), NO_PAGE, jnp.int32),
      length=jnp.zeros((batch,), jnp.int32),
      errors=errors.zeros(batch), resid=resid, policy=policy)


def identity_tables(batch: int, max_pages: int) -> np.ndarray:
  """[B, M] block tables giving row b the pages b·M .. b·M + M - 1 (what a
  contiguous cache of M · Y slots per row amounts to)."""
  return np.arange(batch * max_pages, dtype=np.int32).reshape(batch,
                                                              max_pages)


def from_contiguous(config: ModelConfig, cache: Cache, table: np.ndarray,
                    page_size: int) -> PagedCache:
  """A paged cache holding what a contiguous `cache` holds.

  Args:
    config: the model.
    cache: a `KVCache` / `LatentCache` of A · Y slots per row (eviction
      'none', positions 'original').
    table: [B, A] int32 distinct page ids below B · A: row b's slots
      [j · Y, (j + 1) · Y) go to pool page table[b, j].
    page_size: Y.
  Returns:
    A `PagedCache` of B · A pages whose `view(paged, A)` equals `cache`
    (same lengths, errors reset, KIVI residuals copied).
  """
  table = np.asarray(table, np.int32)
  B, A = table.shape
  paged = init_paged(config, B, B * A, page_size, A, cache.policy)
  axes = _slot_axes(paged.kind)
  in_order = jnp.asarray(np.tile(np.arange(A, dtype=np.int32), (B, 1)))
  table_dev = jnp.asarray(table)
  pool = {name: arr.at[:, table_dev].set(_view_pages(
      getattr(cache, name), in_order, axes[name], A))
          for name, arr in paged.pool.items()}
  return paged.replace(
      pool=pool, block_table=table_dev, length=cache.length,
      resid={name: getattr(cache, name) for name in paged.resid})


# ---- view and write-back (traced) -------------------------------------------
def _slot_axes(kind: str) -> dict[str, int]:
  return dict(PAGED_FIELDS[kind])


def _gather_pages(pool_arr, pages_BA, slot_axis: int):
  """[L, Z, ..., Y', ...] pool, [B, A] page ids (Z: zeros) ->
  contiguous [L, B, ..., A · Y', ...].

  One gather that lays the pages out in place (A just before Y'), so the
  reshape is free: `jnp.take` + `moveaxis` would add a transpose copy of
  the whole view."""
  nd = pool_arr.ndim
  offset = (0,) + tuple(range(2, slot_axis)) + tuple(range(slot_axis + 1,
                                                           nd + 1))
  dims = jax.lax.GatherDimensionNumbers(
      offset_dims=offset, collapsed_slice_dims=(1,), start_index_map=(1,))
  sizes = (pool_arr.shape[0], 1) + pool_arr.shape[2:]
  x = jax.lax.gather(pool_arr, pages_BA[..., None], dims, sizes,
                     mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
                     fill_value=0)  # [L, B, ..., A, Y', ...]
  s = x.shape
  return x.reshape(s[:slot_axis] + (s[slot_axis] * s[slot_axis + 1],) +
                   s[slot_axis + 2:])


def _view_pages(view_arr, index_BJ, slot_axis: int, pages: int):
  """Pages `index_BJ` [B, J] (< A) of each row of a contiguous view
  [L, B, ..., A · Y', ...] -> [L, B, J, ..., Y', ...] (one gather of the
  J pages, not a transpose of the whole view)."""
  s = view_arr.shape
  per_page = s[slot_axis] // pages
  B, J = index_BJ.shape
  b_BJ = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, J))
  starts = jnp.stack([b_BJ, index_BJ * per_page], axis=-1)  # [B, J, 2]
  nd = view_arr.ndim
  dims = jax.lax.GatherDimensionNumbers(
      offset_dims=(0,) + tuple(range(3, nd + 1)), collapsed_slice_dims=(1,),
      start_index_map=(1, slot_axis))
  sizes = (s[0], 1) + s[2:slot_axis] + (per_page,) + s[slot_axis + 1:]
  return jax.lax.gather(view_arr, starts, dims, sizes,
                        mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def _widen(table_BM, pages: int):
  """The first `pages` columns of a block table, NO_PAGE past its M."""
  M = table_BM.shape[1]
  if pages <= M:
    return table_BM[:, :pages]
  return jnp.pad(table_BM, ((0, 0), (0, pages - M)),
                 constant_values=NO_PAGE)


def view(paged: PagedCache, pages: int) -> Cache:
  """The first `pages` (A) pages of every row as a contiguous cache of
  A · Y slots: the cache the contiguous entry points would hold (A may
  exceed M: the pages past the block table read as zeros)."""
  Z, Y = paged.num_pages, paged.page_size
  table_BA = _widen(paged.block_table, pages)
  table_BA = jnp.where(table_BA < 0, Z, table_BA)
  axes = _slot_axes(paged.kind)
  fields = {name: _gather_pages(arr, table_BA, axes[name])
            for name, arr in paged.pool.items()}
  S = pages * Y
  slot_S = jnp.arange(S, dtype=jnp.int32)
  positions = jnp.where(slot_S[None, :] < paged.length[:, None], slot_S[None],
                        cache_lib.EMPTY)
  cls = cache_lib.LatentCache if paged.kind == "latent" else (
      cache_lib.KVCache)
  return cls(**fields, **paged.resid, positions=positions,
             length=paged.length, errors=paged.errors, policy=paged.policy)


def write_back(paged: PagedCache, view_cache: Cache, start_B, pages: int,
               written: int, write_table=None) -> PagedCache:
  """`paged` after a call on its `view(paged, pages)` that wrote slots
  [start_B, view_cache.length) of each row.

  The pages of those slots (at most `written` (J) per row) are copied whole
  from the view to the pages `write_table [B, M]` maps them to (default:
  the block table; another page there is copy-on-write). A touched page
  that maps to NO_PAGE cannot be stored: the row gets OVERFLOW
  (`kvjax.errors`). The returned block table is the write table.
  """
  Z, Y = paged.num_pages, paged.page_size
  table = paged.block_table if write_table is None else write_table
  end_B = view_cache.length
  first_B = start_B // Y
  index_BJ = first_B[:, None] + jnp.arange(written, dtype=jnp.int32)[None]
  touched_BJ = ((index_BJ * Y < end_B[:, None]) & (index_BJ < pages) &
                (end_B > start_B)[:, None])
  dest_BJ = jnp.take_along_axis(_widen(table, pages),
                                jnp.minimum(index_BJ, pages - 1), axis=1)
  lost_B = jnp.any(touched_BJ & (dest_BJ < 0), axis=1)
  dest_BJ = jnp.where(touched_BJ & (dest_BJ >= 0), dest_BJ, Z)  # Z: drop
  index_BJ = jnp.minimum(index_BJ, pages - 1)
  axes = _slot_axes(paged.kind)
  pool = {}
  for name, arr in paged.pool.items():
    new = _view_pages(getattr(view_cache, name), index_BJ, axes[name], pages)
    pool[name] = arr.at[:, dest_BJ].set(new, mode="drop")
  resid = {name: getattr(view_cache, name) for name in paged.resid}
  out = paged.replace(pool=pool, block_table=table.astype(jnp.int32),
                      length=end_B,
                      errors=view_cache.errors, resid=resid)
  return errors.record(out, jnp.where(lost_B, errors.OVERFLOW, 0))


def pages_written(tokens: int, page_size: int) -> int:
  """J: the most pages `tokens` consecutive slots can touch."""
  return 1 + (tokens - 1 + page_size - 1) // page_size


# ---- the decode cache kind (traced) ------------------------------------------
@struct.dataclass
class PagedKV(_Pool):
  """A decode call's paged cache: the pool read and written in place.

  pool: field name -> [L, Z, ...] pool arrays (`PagedCache.pool`).
  table: [B, A] int32 pages of each row's first A · Y slots (Z where none
    is mapped: reads give zeros, writes are lost and recorded).
  positions: [B, A · Y] slot s holds position s below the length, else
    EMPTY (what `model.decode_step_info` masks and commits).
  length, errors: [B] as in `PagedCache`.
  limit: [B] slots at or past it are scratch: a row that has emitted the
    tokens it keeps still steps with the batch (`decode_loop`), and its
    writes there are dropped, not stored.
  resid: KIVI's per-sequence residuals ({} otherwise).
  policy: the `CachePolicy` (static).
  """

  pool: dict
  table: jax.Array
  positions: jax.Array
  length: jax.Array
  errors: jax.Array
  limit: jax.Array
  resid: dict
  policy: cache_lib.CachePolicy = struct.field(
      pytree_node=False, default=cache_lib.CachePolicy())
  scores = None  # eviction 'none': nothing scored

  @property
  def capacity(self) -> int:
    return self.table.shape[1] * self.page_size


def _put(arr, layer, page_BT, off_BT, new_BT, slot_axis: int):
  """arr[layer, page, ..., off, ...] = new (page Z: dropped)."""
  new_BT = new_BT.astype(arr.dtype)
  if slot_axis == 3:  # [L, Z, K, Y, ...]
    return arr.at[layer, page_BT, :, off_BT].set(new_BT, mode="drop")
  return arr.at[layer, page_BT, off_BT].set(new_BT, mode="drop")


def _take_layer(arr, layer, table_BA, slot_axis: int):
  """Layer `layer`'s pages `table_BA` of a [L, Z, ..., Y', ...] pool as
  [B, ..., A · Y', ...] (page Z: zeros): one gather, laid out in place."""
  nd = arr.ndim
  B, A = table_BA.shape
  starts = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32),
                                       (B, A)), table_BA], axis=-1)
  dims = jax.lax.GatherDimensionNumbers(
      offset_dims=tuple(range(1, slot_axis - 1)) + tuple(range(slot_axis,
                                                               nd)),
      collapsed_slice_dims=(0, 1), start_index_map=(0, 1))
  x = jax.lax.gather(arr, starts, dims, (1, 1) + arr.shape[2:],
                     mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
                     fill_value=0)  # [B, ..., A, Y', ...]
  s = x.shape
  a = slot_axis - 1
  return x.reshape(s[:a] + (s[a] * s[a + 1],) + s[a + 2:])


def _locate(cache: PagedKV, slots_BT):
  """(page [B, T] (Z: drop), offset in page [B, T], lost [B]): where the
  new tokens go; a kept token (slot below the limit) whose page is not
  mapped is lost and recorded as OVERFLOW by the caller."""
  Y, A, Z = cache.page_size, cache.table.shape[1], cache.num_pages
  j_BT = slots_BT // Y
  page_BT = jnp.take_along_axis(cache.table, jnp.minimum(j_BT, A - 1),
                                axis=1)
  keep_BT = (slots_BT < cache.limit[:, None]) & (j_BT < A)
  lost_B = jnp.any(keep_BT & (page_BT >= Z), axis=1)
  return jnp.where(keep_BT, page_BT, Z), slots_BT % Y, lost_B


def _triples(cache: PagedKV):
  """(payload, scale, KIVI residual or None) of the two arrays a step
  writes: keys and values, or MLA's latent and rotary key."""
  names = ((("c_kv", "c_scale", "c_resid"), ("k_rope", "r_scale", "r_resid"))
           if cache.kind == "latent" else
           (("k", "k_scale", "k_resid"), ("v", "v_scale", "v_resid")))
  return tuple((p, s, r if r in cache.resid else None) for p, s, r in names)


def _write(cache: PagedKV, layer, slots_BT, a_BT, b_BT):
  """Stores one layer's new (k, v) or MLA (c_kv, k_rope) at `slots`
  (KIVI arrays: the group of the slot, from the updated residual)."""
  page_BT, off_BT, lost_B = _locate(cache, slots_BT)
  Z, Y = cache.num_pages, cache.page_size
  axes = _slot_axes(cache.kind)
  pool, resid = dict(cache.pool), dict(cache.resid)
  for (payload, scale, r_name), x in zip(_triples(cache), (a_BT, b_BT)):
    ax = axes[payload]
    if r_name is None:
      q, s = quant.quantize(x, pool[payload].dtype)
      pool[payload] = _put(pool[payload], layer, page_BT, off_BT, q, ax)
      if s is not None:
        pool[scale] = _put(pool[scale], layer, page_BT, off_BT, s, ax)
      continue
    # KIVI (T = 1): the group lies inside one page (Y % X == 0).
    X = cache.policy.key_group
    page_B, slot_B = page_BT[:, 0], slots_BT[:, 0]
    r, q, s = kivi.one_token(resid[r_name][layer], slot_B, x[:, 0], X,
                             page_B < Z, pool[payload].dtype)
    first_B = (slot_B % Y) // X * X
    pool[payload] = _put(
        pool[payload], layer, jnp.repeat(page_B[:, None], X, axis=1),
        first_B[:, None] + jnp.arange(X, dtype=jnp.int32)[None],
        jnp.moveaxis(q, -2, 1), ax)
    pool[scale] = _put(pool[scale], layer, page_B[:, None],
                       (first_B // X)[:, None], jnp.moveaxis(s, -2, 1), ax)
    resid[r_name] = resid[r_name].at[layer].set(r)
  return errors.record(cache.replace(pool=pool, resid=resid),
                       jnp.where(lost_B, errors.OVERFLOW, 0))


def _read(cache: PagedKV, layer, dtype, prefix: int = 0):
  """One layer's (keys [B, K, S, H], values [B, K, S, H]) or MLA's
  (latents [B, S, C], rotary keys [B, S, R]) over the first `prefix`
  slots (a multiple of the page size; 0: all A · Y)."""
  Y = cache.page_size
  S = prefix or cache.capacity
  if S % Y:
    raise ValueError(f"a paged read of {S} slots is not whole pages of {Y}")
  table_BA = cache.table[:, :S // Y]
  axes = _slot_axes(cache.kind)

  def take(name):
    arr = cache.pool.get(name)
    return None if arr is None else _take_layer(arr, layer, table_BA,
                                                axes[name])

  out = []
  for payload, scale, r_name in _triples(cache):
    if r_name is None:
      out.append(quant.dequantize(take(payload), take(scale), dtype))
    else:
      out.append(kivi.rows(take(payload), take(scale),
                           cache.resid[r_name][layer],
                           cache.positions[:, :S], cache.policy.key_group,
                           dtype))
  return tuple(out)


attention.register_decode_cache(
    PagedKV, attention.DecodeCache(write=_write, read=_read,
                                   attend=attention.attend))


def open_pages(paged: PagedCache, write_table, pages: int, steps: int,
               new_B) -> PagedKV:
  """The `PagedKV` of a decode call that adds `new_B` [B] (at most `steps`)
  tokens per row over A = `pages` pages, copy-on-write done: each page the
  call writes whose write-table page differs from its block-table page is
  copied there first (zeroed when the block table maps none), so the call
  reads and writes the write table alone. Rows keep their lengths."""
  Z, Y, M = paged.num_pages, paged.page_size, paged.max_pages
  start_B = paged.length
  end_B = start_B + new_B
  J = min(M, pages_written(steps, Y))
  index_BJ = (start_B // Y)[:, None] + jnp.arange(J, dtype=jnp.int32)[None]
  touched_BJ = (index_BJ * Y < end_B[:, None]) & (index_BJ < M)
  index_BJ = jnp.minimum(index_BJ, M - 1)
  src_BJ = jnp.take_along_axis(paged.block_table, index_BJ, axis=1)
  dst_BJ = jnp.take_along_axis(write_table, index_BJ, axis=1)
  copy_BJ = touched_BJ & (dst_BJ >= 0) & (dst_BJ != src_BJ)
  src_BJ = jnp.where(src_BJ >= 0, src_BJ, Z)  # Z: zeros
  dst_BJ = jnp.where(copy_BJ, dst_BJ, Z)  # Z: no copy
  pool = {name: arr.at[:, dst_BJ].set(
      jnp.take(arr, src_BJ, axis=1, mode="fill", fill_value=0), mode="drop")
          for name, arr in paged.pool.items()}
  table_BA = _widen(write_table, pages)
  S = pages * Y
  slot_S = jnp.arange(S, dtype=jnp.int32)
  return PagedKV(
      pool=pool, table=jnp.where(table_BA < 0, Z, table_BA),
      positions=jnp.where(slot_S[None, :] < start_B[:, None], slot_S[None],
                          cache_lib.EMPTY),
      length=start_B, errors=paged.errors, limit=end_B, resid=paged.resid,
      policy=paged.policy)


def close_pages(paged: PagedCache, kv: PagedKV, write_table) -> PagedCache:
  """`paged` after a decode call on `open_pages(paged, write_table, ...)`:
  the pool, lengths and errors of `kv`; the write table becomes the block
  table."""
  return paged.replace(pool=kv.pool, block_table=write_table.astype(jnp.int32),
                       length=kv.length, errors=kv.errors, resid=kv.resid)


# ---- jitted bodies ----------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("config", "pages"),
                   donate_argnames=("paged",))
def _prefill(params, config, tokens, mask, paged, write_table, pages):
  vc = view(paged, pages)
  logits, vc = model.prefill_logits(params, config, tokens, mask, vc, False)
  start = jnp.zeros_like(paged.length)
  J = min(pages, pages_written(tokens.shape[1], paged.page_size))
  return logits[:, 0], write_back(paged, vc, start, pages, J, write_table)


@functools.partial(jax.jit, static_argnames=("config", "pages"),
                   donate_argnames=("paged",))
def _extend(params, config, tokens, mask, paged, write_table, pages):
  vc = view(paged, pages)
  logits, vc = model.extend_logits(params, config, tokens, mask, vc, False)
  J = min(pages, pages_written(tokens.shape[1], paged.page_size))
  return logits[:, 0], write_back(paged, vc, paged.length, pages, J,
                                  write_table)


@functools.partial(jax.jit, static_argnames=("config", "pages"),
                   donate_argnames=("paged",))
def _decode(params, config, token, paged, write_table, pages):
  kv = open_pages(paged, write_table, pages, 1, jnp.ones_like(paged.length))
  with norm_matvec.weights(params):
    logits, kv = model.decode_logits(params, config, token, kv)
  return logits, close_pages(paged, kv, write_table)


def sample_rows(logits_BV, keys_B, sampler_B, samplers: tuple):
  """Next token of every row, row b by `samplers[sampler_B[b]]` with its own
  key `keys_B[b]` (as that sampler on the row alone: what `generate` at
  batch 1 samples with the same key). Every sampler of the menu runs on
  every row (the menu is static: no recompilation when the mix changes).

  Args:
    logits_BV: [B, V] float logits.
    keys_B: [B] typed PRNG keys (ignored by greedy samplers).
    sampler_B: [B] int32 index into `samplers`.
    samplers: tuple of `Sampler`s (static).
  Returns:
    [B] int32 token ids (`errors.INVALID_TOKEN` for non-finite rows).
  """
  out = None
  for i, sampler in enumerate(samplers):
    if sampler.greedy:
      tok_B = sampler(logits_BV, None)
    else:
      tok_B = jax.vmap(lambda l_V, k, s=sampler: s(l_V[None], k)[0])(
          logits_BV, keys_B)
    out = tok_B if out is None else jnp.where(sampler_B == i, tok_B, out)
  return out


@functools.partial(
    jax.jit, static_argnames=("config", "pages", "steps", "samplers", "plan"),
    donate_argnames=("paged",))
def decode_loop(params, config, token_B, paged, write_table, keys_BI,
                sampler_B, valid_B, *, pages: int, steps: int,
                samplers: tuple, plan: decode_lib.Plan = decode_lib.Plan()):
  """`steps` decode steps of every row over its first `pages` pages, by the
  one decode loop (`kvjax.decode.run`, laid out by `plan`) on a `PagedKV`:
  every step reads each layer's pages in place and writes the new token
  into its page; copy-on-write is done once, before the loop
  (`open_pages`).

  Row b keeps `valid_B[b]` tokens (0: an idle row). A row past them stays
  where it stopped: its length is held (the loop's per-step `pin`) and the
  steps it still computes are scratch (their writes are dropped: the
  `PagedKV` limit). `pages` must cover length + steps of every row that
  keeps tokens (it may exceed the block table's M: those pages read as
  zeros).

  Args:
    token_B: [B] the token each row feeds first.
    paged: the cache (donated).
    write_table: [B, M] (see `write_back`).
    keys_BI: [B, I, ...] uint32 key data (`jax.random.key_data`) of the
      key each row samples each of the I = `steps` steps with.
    sampler_B: [B] int32 index into `samplers` (`sample_rows`).
    valid_B: [B] int32 tokens each row keeps (<= steps).
    plan: `loop_plan(..., pages, ..., steps)`.
  Returns:
    (tokens [B, I] sampled (past valid_B: discard), new cache).
  """
  kv = open_pages(paged, write_table, pages, steps, valid_B)
  end_B = kv.limit

  def pin(logits_BV, cache):
    return logits_BV, cache.replace(length=jnp.minimum(cache.length, end_B))

  keys_IB = jnp.swapaxes(jax.random.wrap_key_data(keys_BI), 0, 1)
  _, kv, toks_IB = decode_lib.run(
      params, config, token_B, kv, keys_IB,
      choose=lambda logits_BV, key_B: sample_rows(logits_BV, key_B,
                                                  sampler_B, samplers),
      emit=lambda logits_BV, nxt_B, key_B, cache: nxt_B, plan=plan, pin=pin)
  return toks_IB.T, close_pages(paged, kv, write_table)


def loop_plan(params, config: ModelConfig, policy: cache_lib.CachePolicy,
              batch: int, pages: int, page_size: int,
              steps: int) -> decode_lib.Plan:
  """The plan of a `decode_loop` of `steps` steps over `pages` pages whose
  rows hold up to A · Y - steps tokens: generate's attention segments
  (`decode.attention_schedule`), their prefixes whole pages, read in
  place (the blocked layout is a copy of a contiguous cache: not for
  pages)."""
  del params, batch
  S = pages * page_size
  if policy.channel_keys:
    page_size = math.lcm(page_size, policy.key_group)
  return decode_lib.Plan(decode_lib.attention_schedule(
      max(S - steps, 1), steps, S, page_size))


# ---- host side: validation, buckets, entry points ---------------------------
MIN_VIEW_SLOTS = 128  # smallest view (as generate's smallest attend prefix)


def view_pages(slots: int, page_size: int, max_pages: int,
               minimum_slots: int = MIN_VIEW_SLOTS) -> int:
  """A: the pages a call reads when its rows hold at most `slots` tokens
  afterwards: the smallest power of two of pages covering them (and
  `minimum_slots`), capped at M. Few buckets, so few compiled programs."""
  need = max(-(-slots // page_size), -(-minimum_slots // page_size), 1)
  return min(max_pages, 1 << (need - 1).bit_length())


def all_view_pages(page_size: int, max_pages: int,
                   minimum_slots: int = MIN_VIEW_SLOTS) -> tuple[int, ...]:
  """Every A `view_pages` can return (what an engine compiles at warm-up)."""
  return tuple(sorted({view_pages(n * page_size, page_size, max_pages,
                                  minimum_slots)
                       for n in range(1, max_pages + 1)}))


def check_paged(paged: PagedCache, config: ModelConfig, batch: int) -> None:
  """Raises ValueError unless `paged` fits `config` and `batch` rows."""
  if not isinstance(paged, PagedCache):
    raise ValueError(f"expected a PagedCache, got {type(paged).__name__}")
  kind = "latent" if config.attention == "mla" else "kv"
  if paged.kind != kind:
    raise ValueError(f"attention={config.attention!r} needs a "
                     f"{'latent' if kind == 'latent' else 'per-head'} page "
                     "pool")
  if paged.batch != batch:
    raise ValueError(f"paged cache batch {paged.batch} != tokens batch "
                     f"{batch}")
  ref = jax.eval_shape(lambda: cache_lib.init_cache(
      config, paged.num_pages, paged.page_size, policy=paged.policy))
  for name, arr in paged.pool.items():
    want = getattr(ref, name).shape
    if tuple(arr.shape) != tuple(want):
      raise ValueError(f"page pool {name} has shape {tuple(arr.shape)}, "
                       f"the config implies {tuple(want)}")


def _check_tables(paged: PagedCache, write_table, new_B: np.ndarray,
                  what: str) -> np.ndarray:
  """Host checks of one call that adds new_B [B] tokens per row: capacity,
  a page mapped for every touched slot, no page written by two rows.
  Returns the write table as int32 numpy."""
  Y, M, Z = paged.page_size, paged.max_pages, paged.num_pages
  length = np.asarray(paged.length)
  read = np.asarray(paged.block_table)
  table = read if write_table is None else np.asarray(write_table)
  if table.shape != read.shape or not np.issubdtype(table.dtype, np.integer):
    raise ValueError(f"{what}: write_table must be an int array of shape "
                     f"{read.shape}, got {table.dtype} {table.shape}")
  for t, name in ((read, "block_table"), (table, "write_table")):
    if ((t < NO_PAGE) | (t >= Z)).any():
      raise ValueError(f"{what}: {name} holds page ids outside [-1, {Z})")
  end = length + new_B
  if (end > paged.capacity).any():
    b = int(np.argmax(end > paged.capacity))
    raise ValueError(f"{what}: sequence {b} would hold {end[b]} tokens, more "
                     f"than the {paged.capacity} slots its block table "
                     f"addresses (max_pages={M} x page_size={Y})")
  owner = {}
  for b in range(paged.batch):
    if new_B[b] == 0:
      continue
    for j in range(length[b] // Y, (end[b] - 1) // Y + 1):
      page = int(table[b, j])
      if page < 0:
        raise ValueError(f"{what}: sequence {b} writes slots of block {j}, "
                         "which maps no page; map one in the write table")
      if owner.setdefault(page, b) != b:
        raise ValueError(f"{what}: sequences {owner[page]} and {b} both "
                         f"write page {page}; give each its own copy")
  return table.astype(np.int32)


def _checked_call(params, config: ModelConfig, tokens, paged, attention_mask,
                  what: str):
  """The host checks of a prompt call, before compute: (decode-layout
  params, tokens, mask, real tokens per row n_B)."""
  params_lib.check_params(params, config)
  params = packed.for_decode(params, config)
  tokens = inference.check_tokens(tokens, config)
  check_paged(paged, config, tokens.shape[0])
  errors.raise_if_set(paged, f"{what}: the cache passed in")
  mask = inference.check_mask(attention_mask, tokens)
  return params, tokens, mask, np.asarray(mask).sum(axis=1)


def prefill(params, config: ModelConfig, tokens, paged: PagedCache,
            attention_mask=None, *, write_table=None):
  """`kvjax.prefill` through the block table: the prompt in one pass into
  rows taken as empty (their lengths restart at 0).

  Args:
    tokens: [B, T] left-padded prompt ids.
    paged: the paged cache (donated); its block table maps the pages of
      every prompt slot (or `write_table` does).
    attention_mask: [B, T] or None.
    write_table: [B, M] pages to write (default the block table).
  Returns:
    (logits [B, V] at the last position, new PagedCache).
  """
  params, tokens, mask, n_B = _checked_call(params, config, tokens, paged,
                                             attention_mask, "paged.prefill")
  paged = paged.replace(length=jnp.zeros_like(paged.length))
  table = _check_tables(paged, write_table, n_B, "paged.prefill")
  A = view_pages(int(n_B.max()), paged.page_size, paged.max_pages)
  logits, paged = _prefill(params, config, jnp.asarray(tokens, jnp.int32),
                           mask, paged, jnp.asarray(table), A)
  errors.raise_if_set(paged, "paged.prefill")
  return logits, paged


def extend(params, config: ModelConfig, tokens, paged: PagedCache,
           attention_mask=None, *, write_table=None):
  """`kvjax.extend` through the block table: appends a chunk to each row.

  Returns:
    (logits [B, V] at the last position, new PagedCache).
  """
  params, tokens, mask, n_B = _checked_call(params, config, tokens, paged,
                                             attention_mask, "paged.extend")
  table = _check_tables(paged, write_table, n_B, "paged.extend")
  A = view_pages(int((np.asarray(paged.length) + tokens.shape[1]).max()),
                 paged.page_size, paged.max_pages)
  logits, paged = _extend(params, config, jnp.asarray(tokens, jnp.int32),
                          mask, paged, jnp.asarray(table), A)
  errors.raise_if_set(paged, "paged.extend")
  return logits, paged


def decode_step(params, config: ModelConfig, token, paged: PagedCache, *,
                write_table=None):
  """`kvjax.decode_step` through the block table: one token per row.

  Returns:
    (logits [B, V], new PagedCache).
  """
  params_lib.check_params(params, config)
  params = packed.for_decode(params, config)
  token = inference.check_tokens(token, config, ndim=1, name="token")
  check_paged(paged, config, token.shape[0])
  errors.raise_if_set(paged, "paged.decode_step: the cache passed in")
  table = _check_tables(paged, write_table, np.ones(paged.batch, np.int64),
                        "paged.decode_step")
  A = view_pages(int(np.asarray(paged.length).max()) + 1, paged.page_size,
                 paged.max_pages)
  logits, paged = _decode(params, config, jnp.asarray(token, jnp.int32),
                          paged, jnp.asarray(table), A)
  errors.raise_if_set(paged, "paged.decode_step")
  return logits, paged


# ---- byte accounting --------------------------------------------------------
def page_bytes(paged: PagedCache) -> int:
  """Bytes of one page over all layers (payload and scales)."""
  return sum(int(np.prod(a.shape)) // a.shape[1] * a.dtype.itemsize
             for a in paged.pool.values())


def filled_slots(block_table: np.ndarray, length: np.ndarray,
                 page_size: int) -> dict[int, int]:
  """page id -> slots of it holding tokens, over every row mapping it (a
  page shared by several rows counts once, at its fullest)."""
  out: dict[int, int] = {}
  for b in range(block_table.shape[0]):
    for j in range(-(-int(length[b]) // page_size)):
      page = int(block_table[b, j])
      if page >= 0:
        n = min(page_size, int(length[b]) - j * page_size)
        out[page] = max(out.get(page, 0), n)
  return out


def cache_bytes(paged: PagedCache) -> dict[str, int]:
  """Bytes of a paged cache, exactly.

  Returns:
    total: every array (pool, block tables, lengths, errors, residuals).
    pool: the page pool (= num_pages x per_page).
    per_page: one page over all layers (= kv_bytes_per_token x page_size).
    allocated: the distinct pages the block tables map, x per_page.
    used: the slots of those pages that hold tokens, x per-token bytes.
  """
  per_page = page_bytes(paged)
  total = sum(int(np.prod(x.shape)) * x.dtype.itemsize
              for x in jax.tree_util.tree_leaves(paged))
  table = np.asarray(paged.block_table)
  filled = filled_slots(table, np.asarray(paged.length), paged.page_size)
  mapped = {int(p) for p in table.ravel() if p >= 0}
  return dict(total=total, pool=per_page * paged.num_pages,
              per_page=per_page, allocated=per_page * len(mapped),
              used=per_page * sum(filled.values()) // paged.page_size)
