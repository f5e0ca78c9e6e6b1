"""SnapKV (Li et al. 2024): compress the prompt with what its last queries
attend to. At prefill a key's score is the attention it receives from the
last `window` prompt queries (the observation window), summed over the
group's heads and smoothed along the keys by pooling (`pool` wide, max or
average: a token next to an important one is kept too, which keeps spans
whole); the observation window itself is always kept (`recent` defaults to
it). During decode each new query adds its attention (as H2O), so the
observation window keeps moving. Per kv head by default, as the paper."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.policies.base import Scored, attention_received

POOLS = ("max", "avg")


@dataclasses.dataclass(frozen=True)
class SnapKV(Scored):
  name = "snapkv"
  scope: str = "head"
  window: int = 32
  pool: str = "max"
  pool_size: int = 7
  recent: int = 32

  def validate(self):
    super().validate()
    if not isinstance(self.window, int) or self.window < 1:
      raise ValueError(f"snapkv: window must be an int >= 1, got "
                       f"{self.window!r}")
    if self.pool not in POOLS:
      raise ValueError(f"snapkv: pool={self.pool!r} is not one of {POOLS}")
    if (not isinstance(self.pool_size, int) or self.pool_size < 1 or
        self.pool_size % 2 == 0):
      raise ValueError(f"snapkv: pool_size must be an odd int >= 1, got "
                       f"{self.pool_size!r}")

  def observe(self, probs_BKGTS, k_BKSH, valid_BKS, mode):
    if mode != "prefill":
      return attention_received(probs_BKGTS)
    votes_BKS = attention_received(probs_BKGTS, queries=self.window)
    if self.pool_size == 1:
      return votes_BKS
    pad = self.pool_size // 2
    if self.pool == "max":
      return jax.lax.reduce_window(
          votes_BKS, -jnp.inf, jax.lax.max, (1, 1, self.pool_size),
          (1, 1, 1), ((0, 0), (0, 0), (pad, pad)))
    total = jax.lax.reduce_window(
        votes_BKS, 0.0, jax.lax.add, (1, 1, self.pool_size), (1, 1, 1),
        ((0, 0), (0, 0), (pad, pad)))
    return total / self.pool_size
