"""Flash-style attention for long prompts: queries and keys in tiles, an
online softmax, and masks computed per tile from stream positions, so no
[T, S] array (scores, probabilities or mask) ever exists.

Prefill and extend (chunked prefill) of a long prompt use it when the
attention probabilities are not needed (no scored policy observing them,
no probe): `use_tiles` decides. The dense path (`attention.attend`) keeps
every other call: training (its gradient), decode, short prompts.

Per query tile [t0, t0 + T') (the queries are the last T of the S' keys)
only the key tiles a causal mask can show are read (up to key S' - T +
t0 + T'), in a `lax.while_loop`, keeping per query row the running maximum
m, the running sum l of exp(logit - m) and the running weighted sum of
values:

  m' = max(m, max_j s_j)    l' = l e^(m - m') + sum_j e^(s_j - m')
  acc' = acc e^(m - m') + sum_j e^(s_j - m') v_j        out = acc / l

Masked keys contribute exactly 0; a row with no visible key (padding)
returns 0.

Dimension alphabet (`kvjax.config`): B batch, T queries, S' keys, K kv
heads, G query heads per kv head, H query/key head dim, O value head dim
(H for GQA), X slots per key tile (a key block), T' queries per query tile
(written t in names; q = G·T', a tile's query rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kvjax import cache as cache_lib

QUERY_TILE = 256  # T'
KEY_TILE = 512  # X
# Below this many (query, key) pairs per call the dense path's [T, S']
# scores are small and its few large products are as fast or faster:
# gqa-medium prefill, tiled / dense tokens/s 0.95 at 1,024 tokens, 0.91 at
# 2,048, 1.22 at 4,096, 1.23 at 8,192 (experiments/prefill_scaling.py,
# WORKSPACE.md "Prefill against prompt length").
MIN_PAIRS = 3072 * 3072


@dataclasses.dataclass(frozen=True)
class Visibility:
  """Which keys a query may attend, from stream positions alone (static):
  the key exists, is not in the future, is inside the model's sliding
  window (0: none) and, under a cache policy, is what a cache of
  `capacity` slots would still show the query (`cache.visible`)."""

  sliding_window: int = 0
  policy: cache_lib.CachePolicy | None = None
  capacity: int = 0

  def mask(self, q_pos_BT, k_pos_BS):
    """[B, T, S] bool (positions -1: no token)."""
    q, k = q_pos_BT[:, :, None], k_pos_BS[:, None, :]
    ok = (k >= 0) & (q >= 0) & (k <= q)
    if self.sliding_window:
      ok &= k > q - self.sliding_window
    if self.policy is not None:
      ok &= cache_lib.visible(self.policy, self.capacity, q, k)
    return ok


@dataclasses.dataclass(frozen=True)
class CachedKeys:
  """Keys and values a cache already holds, read one key tile at a time
  inside the tile loop, so a long cache is never copied whole: an extend
  (chunked prefill) over S0 cached slots keeps temporaries bounded by its
  tiles, not by S0 (WORKSPACE.md "Prefill against prompt length").

  read(start, size) -> (k_BKXH, v_BKXO): slots [start, start + size) in
    the compute dtype (start traced, start + size <= S0).
  pos_BS: [B, S0] the slots' stream positions (-1: empty).
  used: int32 [] or None: slots from `used` on are empty in every row, so
    the loop stops there (None: all S0).
  """

  read: Callable
  pos_BS: jax.Array
  used: jax.Array | None = None

  @property
  def length(self) -> int:  # S0
    return self.pos_BS.shape[1]


def use_tiles(T: int, S: int, need_probs: bool, impl: str) -> bool:
  """Whether a T-query call over S' = S keys runs in tiles: a long call
  whose probabilities nobody reads, with the portable implementation."""
  return not need_probs and impl == "einsum" and T * S >= MIN_PAIRS


def _pad_to(x, axis: int, multiple: int, value):
  n = x.shape[axis]
  pad = -n % multiple
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def attend(q_BTKGH, k_BKSH, v_BKSO, q_pos_BT, k_pos_BS,
           visibility: Visibility, scale: float, *,
           cached: CachedKeys | None = None,
           query_tile: int = QUERY_TILE, key_tile: int = KEY_TILE):
  """Masked softmax attention of T queries over S' keys, in tiles.

  Args:
    q_BTKGH: queries grouped by the kv head that serves them.
    k_BKSH, v_BKSO: keys and values, heads-first; the T queries are the
      last T keys' positions (causal tile skipping relies on it). None
      (with k_pos_BS None): every key is in `cached`.
    q_pos_BT, k_pos_BS: stream positions (-1: padding / empty slot).
    visibility: the mask, as a function of positions.
    scale: softmax scale.
    cached: keys before k_BKSH that a cache holds (an extend): every query
      tile reads them first, tile by tile (`CachedKeys`); the result is
      that of attending the concatenation [cached ++ k_BKSH].
    query_tile, key_tile: T' and X.
  Returns:
    out_BTKGO in q's dtype (0 for rows with no visible key).
  """
  B, T, K, G, H = q_BTKGH.shape
  if k_BKSH is None:
    if cached is None:
      raise ValueError("flash.attend: no keys (k_BKSH None and no cached)")
    k_BKSH, v_BKSO = (x[:, :, :0] for x in cached.read(0, 0))
    k_pos_BS = cached.pos_BS[:, :0]
  S, O = k_BKSH.shape[2], v_BKSO.shape[-1]
  t, X = min(query_tile, T), key_tile
  f32 = jnp.float32
  big_neg = jnp.finfo(f32).min
  # Pad queries to whole tiles (position -1: they see nothing) and keys to
  # whole tiles (position -1: never visible).
  q_BTKGH = _pad_to(q_BTKGH, 1, t, 0)
  q_pos_BT = _pad_to(q_pos_BT, 1, t, cache_lib.EMPTY)
  if S:
    k_BKSH = _pad_to(k_BKSH, 2, X, 0)
    v_BKSO = _pad_to(v_BKSO, 2, X, 0)
    k_pos_BS = _pad_to(k_pos_BS, 1, X, cache_lib.EMPTY)
  if cached is not None:
    S0 = cached.length
    X0 = min(X, S0)  # the cached keys' tile
  nq = q_BTKGH.shape[1] // t
  # [nq, B, K, G·T', H]: each tile's queries as rows of one product per
  # (B, K), as `attention.attend` lays them out.
  q_tiles = jnp.transpose(q_BTKGH.reshape(B, nq, t, K, G, H),
                          (1, 0, 3, 4, 2, 5)).reshape(nq, B, K, G * t, H)
  q_pos_tiles = jnp.swapaxes(q_pos_BT.reshape(B, nq, t), 0, 1)

  def query_tile_out(i, q_BKqH, q_pos_Bt):
    # Keys a causal mask can show this tile: below S - T + (i + 1) T'.
    n_keys = jnp.clip(S - T + (i + 1) * t, 0, S)
    n_key_tiles = (n_keys + X - 1) // X

    def update(carry, k_BKXH, v_BKXO, k_pos_BX, fresh_X=None):
      # One key tile into the running (max, sum, weighted values).
      m_BKGt, l_BKGt, acc_BKGtO = carry
      Xk = k_BKXH.shape[2]
      s_BKGtX = jnp.einsum("BKqH,BKXH->BKqX", q_BKqH, k_BKXH,
                           preferred_element_type=f32).reshape(
                               B, K, G, t, Xk) * scale
      ok_BtX = visibility.mask(q_pos_Bt, k_pos_BX)
      if fresh_X is not None:
        ok_BtX &= fresh_X[None, None, :]
      ok_B11tX = ok_BtX[:, None, None]
      s_BKGtX = jnp.where(ok_B11tX, s_BKGtX, big_neg)
      m_new = jnp.maximum(m_BKGt, jnp.max(s_BKGtX, axis=-1))
      p_BKGtX = jnp.where(ok_B11tX, jnp.exp(s_BKGtX - m_new[..., None]), 0.0)
      rescale = jnp.exp(m_BKGt - m_new)
      pv_BKqO = jnp.einsum("BKqX,BKXO->BKqO",
                           p_BKGtX.reshape(B, K, G * t, Xk).astype(
                               v_BKXO.dtype), v_BKXO,
                           preferred_element_type=f32)
      acc = acc_BKGtO * rescale[..., None] + pv_BKqO.reshape(B, K, G, t, O)
      return m_new, l_BKGt * rescale + jnp.sum(p_BKGtX, axis=-1), acc

    def body(j, carry):
      return update(carry,
                    jax.lax.dynamic_slice_in_dim(k_BKSH, j * X, X, axis=2),
                    jax.lax.dynamic_slice_in_dim(v_BKSO, j * X, X, axis=2),
                    jax.lax.dynamic_slice_in_dim(k_pos_BS, j * X, X, axis=1))

    def cached_body(j, carry):
      # The last tile starts early enough to end at S0; slots an earlier
      # tile already counted are masked (fresh), so none counts twice.
      start = jnp.minimum(j * X0, S0 - X0)
      k_BKXH, v_BKXO = cached.read(start, X0)
      fresh_X = start + jnp.arange(X0) >= j * X0
      return update(carry, k_BKXH, v_BKXO,
                    jax.lax.dynamic_slice_in_dim(cached.pos_BS, start, X0,
                                                 axis=1), fresh_X)

    init = (jnp.full((B, K, G, t), big_neg, f32), jnp.zeros((B, K, G, t), f32),
            jnp.zeros((B, K, G, t, O), f32))
    if cached is not None:
      n_cached = -(-S0 // X0)
      if cached.used is not None:
        n_cached = jnp.clip(-(-cached.used // X0), 0, n_cached)
      init = jax.lax.fori_loop(0, n_cached, cached_body, init)
    _, l_BKGt, acc_BKGtO = (jax.lax.fori_loop(0, n_key_tiles, body, init)
                            if S else init)
    out_BKGtO = acc_BKGtO / jnp.where(l_BKGt > 0, l_BKGt, 1.0)[..., None]
    return jnp.transpose(out_BKGtO, (0, 3, 1, 2, 4))  # [B, T', K, G, O]

  def scan_body(_, xs):
    return None, query_tile_out(*xs)

  _, out_nBtKGO = jax.lax.scan(
      scan_body, None, (jnp.arange(nq), q_tiles, q_pos_tiles))
  out_BTKGO = jnp.swapaxes(out_nBtKGO, 0, 1).reshape(B, nq * t, K, G, O)
  return out_BTKGO[:, :T].astype(q_BTKGH.dtype)
