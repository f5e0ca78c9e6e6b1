"""Flash-style attention for long prompts: queries and keys in tiles, an
online softmax, and masks computed per tile from stream positions, so no
[T, S] array (scores, probabilities or mask) ever exists.

Prefill and extend (chunked prefill) of a long prompt use it when the
attention probabilities are not needed (no scored policy observing them,
no probe): `use_tiles` decides. The dense path (`attention.attend`) keeps
every other call: training (its gradient), decode, short prompts.

Per query tile [t0, t0 + C) (the queries are the last T of the S' keys)
only the key tiles a causal mask can show are read (up to key S' - T +
t0 + C), in a `lax.while_loop`, keeping per query row the running maximum
m, the running sum l of exp(logit - m) and the running weighted sum of
values:

  m' = max(m, max_j s_j)    l' = l e^(m - m') + sum_j e^(s_j - m')
  acc' = acc e^(m - m') + sum_j e^(s_j - m') v_j        out = acc / l

Masked keys contribute exactly 0; a row with no visible key (padding)
returns 0.

Dimension alphabet (`kvjax.config`): B batch, T queries, S' keys, K kv
heads, G query heads per kv head, H query/key head dim, O value head dim
(H for GQA), C query tile, E key tile.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import cache as cache_lib

QUERY_TILE = 256  # C
KEY_TILE = 512  # E
# Below this many (query, key) pairs per call the dense path's [T, S']
# scores are small and its few large products are faster (WORKSPACE.md,
# experiments/prefill_scaling.py).
MIN_PAIRS = 2048 * 2048


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
           query_tile: int = QUERY_TILE, key_tile: int = KEY_TILE):
  """Masked softmax attention of T queries over S' keys, in tiles.

  Args:
    q_BTKGH: queries grouped by the kv head that serves them.
    k_BKSH, v_BKSO: keys and values, heads-first; the T queries are the
      last T keys' positions (causal tile skipping relies on it).
    q_pos_BT, k_pos_BS: stream positions (-1: padding / empty slot).
    visibility: the mask, as a function of positions.
    scale: softmax scale.
    query_tile, key_tile: C and E.
  Returns:
    out_BTKGO in q's dtype (0 for rows with no visible key).
  """
  B, T, K, G, H = q_BTKGH.shape
  S, O = k_BKSH.shape[2], v_BKSO.shape[-1]
  C, E = min(query_tile, T), key_tile
  f32 = jnp.float32
  big_neg = jnp.finfo(f32).min
  # Pad queries to whole tiles (position -1: they see nothing) and keys to
  # whole tiles (position -1: never visible).
  q_BTKGH = _pad_to(q_BTKGH, 1, C, 0)
  q_pos_BT = _pad_to(q_pos_BT, 1, C, cache_lib.EMPTY)
  k_BKSH = _pad_to(k_BKSH, 2, E, 0)
  v_BKSO = _pad_to(v_BKSO, 2, E, 0)
  k_pos_BS = _pad_to(k_pos_BS, 1, E, cache_lib.EMPTY)
  nq = q_BTKGH.shape[1] // C
  # [nq, B, K, G·C, H]: each tile's queries as rows of one product per
  # (B, K), as `attention.attend` lays them out.
  q_tiles = jnp.transpose(q_BTKGH.reshape(B, nq, C, K, G, H),
                          (1, 0, 3, 4, 2, 5)).reshape(nq, B, K, G * C, H)
  q_pos_tiles = jnp.swapaxes(q_pos_BT.reshape(B, nq, C), 0, 1)

  def query_tile_out(i, q_BKQH, q_pos_BC):
    # Keys a causal mask can show this tile: below S - T + (i + 1) C.
    n_keys = jnp.minimum(S - T + (i + 1) * C, S)
    n_key_tiles = (n_keys + E - 1) // E

    def body(j, carry):
      m_BKGC, l_BKGC, acc_BKGCO = carry
      k_BKEH = jax.lax.dynamic_slice_in_dim(k_BKSH, j * E, E, axis=2)
      v_BKEO = jax.lax.dynamic_slice_in_dim(v_BKSO, j * E, E, axis=2)
      k_pos_BE = jax.lax.dynamic_slice_in_dim(k_pos_BS, j * E, E, axis=1)
      s_BKGCE = jnp.einsum("BKQH,BKEH->BKQE", q_BKQH, k_BKEH,
                           preferred_element_type=f32).reshape(
                               B, K, G, C, E) * scale
      ok_B11CE = visibility.mask(q_pos_BC, k_pos_BE)[:, None, None]
      s_BKGCE = jnp.where(ok_B11CE, s_BKGCE, big_neg)
      m_new = jnp.maximum(m_BKGC, jnp.max(s_BKGCE, axis=-1))
      p_BKGCE = jnp.where(ok_B11CE, jnp.exp(s_BKGCE - m_new[..., None]), 0.0)
      rescale = jnp.exp(m_BKGC - m_new)
      pv_BKQO = jnp.einsum("BKQE,BKEO->BKQO",
                           p_BKGCE.reshape(B, K, G * C, E).astype(
                               v_BKEO.dtype), v_BKEO,
                           preferred_element_type=f32)
      acc = acc_BKGCO * rescale[..., None] + pv_BKQO.reshape(B, K, G, C, O)
      return m_new, l_BKGC * rescale + jnp.sum(p_BKGCE, axis=-1), acc

    init = (jnp.full((B, K, G, C), big_neg, f32), jnp.zeros((B, K, G, C), f32),
            jnp.zeros((B, K, G, C, O), f32))
    _, l_BKGC, acc_BKGCO = jax.lax.fori_loop(0, n_key_tiles, body, init)
    out_BKGCO = acc_BKGCO / jnp.where(l_BKGC > 0, l_BKGC, 1.0)[..., None]
    return jnp.transpose(out_BKGCO, (0, 3, 1, 2, 4))  # [B, C, K, G, O]

  def scan_body(_, xs):
    return None, query_tile_out(*xs)

  _, out_nBCKGO = jax.lax.scan(
      scan_body, None, (jnp.arange(nq), q_tiles, q_pos_tiles))
  out_BTKGO = jnp.swapaxes(out_nBCKGO, 0, 1).reshape(B, nq * C, K, G, O)
  return out_BTKGO[:, :T].astype(q_BTKGH.dtype)
