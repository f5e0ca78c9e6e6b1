"""Score-based eviction (H2O). Slot arithmetic for the positional policies
(none / window / sinks) is closed-form and lives in `kvjax.cache`."""

from __future__ import annotations

import jax.numpy as jnp


def h2o_slot(cache):
  """[B] slot for the next token under H2O (Zhang et al. 2023).

  Until the cache is full, slots fill in order. Then the new token replaces
  the cached token with the smallest accumulated attention among those
  outside the `recent` window (the newest `recent - 1` cached tokens plus the
  incoming one are always kept). Scores are summed over layers and heads, so
  every layer evicts the same token and `positions` stays one [B, S] array:
  one mask, one rank table and one byte count serve every layer, and the
  slot is chosen once per step, before the layer scan. (MLA's latent is
  shared by all heads, so per-head eviction does not exist there.) The
  paper's H2O evicts per layer and head, which would need positions
  [L, B, K, S] and per-layer masks.
  """
  S, recent = cache.capacity, cache.policy.recent
  length_B = cache.length
  pos_BS = cache.positions
  protected_BS = (pos_BS < 0) | (pos_BS > length_B[:, None] - recent)
  masked_BS = jnp.where(protected_BS, jnp.inf, cache.scores)
  victim_B = jnp.argmin(masked_BS, axis=-1)
  return jnp.where(length_B < S, length_B, victim_B).astype(jnp.int32)
