"""Per-head budgets (AdaKV, Feng et al. 2024): a layer's budget is shared by
its kv heads by score, so heads that concentrate keep few tokens and heads
that spread keep many.

Wraps any scored policy (scope 'head'). Each head has S physical slots; the
average per-head budget is b = round(fraction · S). At prefill each head
first keeps its best `floor` · b tokens (AdaKV's safeguard against starving
a head), then the remaining K · (b − floor·b) slots go to the best scores
of the layer across heads (at most S per head). During decode each head
keeps its allotment: what the prefill gave it, plus an equal share of any
budget the prompt left unused.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from kvjax.policies.base import Scored
from kvjax.policies.snapkv import SnapKV


@dataclasses.dataclass(frozen=True)
class AdaKV(Scored):
  name = "adakv"
  inner: Scored = dataclasses.field(default_factory=SnapKV)
  fraction: float = 0.5
  floor: float = 0.2
  scope: str = "head"
  recent: int = 32

  @property
  def needs(self) -> str:  # pytype: disable=signature-mismatch
    return self.inner.needs

  @property
  def accumulate(self) -> bool:  # pytype: disable=signature-mismatch
    return self.inner.accumulate

  def validate(self):
    super().validate()
    if not isinstance(self.inner, Scored):
      raise ValueError(f"adakv: inner must be a scored policy, got "
                       f"{self.inner!r}")
    if self.scope != "head":
      raise ValueError("adakv: per-head budgets need scope='head'")
    if not 0 < self.fraction <= 1:
      raise ValueError(f"adakv: fraction must be in (0, 1], got "
                       f"{self.fraction!r}")
    if not 0 <= self.floor <= 1:
      raise ValueError(f"adakv: floor must be in [0, 1], got {self.floor!r}")

  def observe(self, probs_BKGTS, k_BKSH, valid_BKS, mode):
    return self.inner.observe(probs_BKGTS, k_BKSH, valid_BKS, mode)

  def average_budget(self, capacity: int) -> int:
    return max(int(round(self.fraction * capacity)), self.recent + 1)

  def validate_capacity(self, capacity):
    super().validate_capacity(capacity)
    if self.average_budget(capacity) > capacity:
      raise ValueError(f"adakv: capacity={capacity} is below the average "
                       f"budget {self.average_budget(capacity)}")

  def budgets(self, num_layers, heads, capacity):
    return np.full((num_layers, heads), self.average_budget(capacity),
                   np.int32)

  def prefill_keep(self, key_scores_BKT, protected_BT, real_BT, budget_BK,
                   capacity):
    B, K, T = key_scores_BKT.shape
    b = self.average_budget(capacity)
    floor = max(int(self.floor * b), 0)
    key = self.score_key(key_scores_BKT, protected_BT, real_BT)
    rank_BKT = jnp.argsort(jnp.argsort(-key, axis=-1, stable=True),
                           axis=-1, stable=True)
    guaranteed = rank_BKT < floor
    # The rest of the layer's budget, chosen across heads (a head never
    # holds more than its S slots).
    candidate = ~guaranteed & (rank_BKT < capacity)
    pool = jnp.where(candidate, key, -jnp.inf).reshape(B, K * T)
    flat_rank = jnp.argsort(jnp.argsort(-pool, axis=-1, stable=True),
                            axis=-1, stable=True).reshape(B, K, T)
    shared = candidate & (flat_rank < K * (b - floor))
    return (guaranteed | shared) & real_BT[:, None]

  def allot(self, kept_BK, budget_BK, capacity):
    K = kept_BK.shape[1]
    b = self.average_budget(capacity)
    spare = jnp.maximum(K * b - jnp.sum(kept_BK, axis=1, keepdims=True), 0)
    return jnp.minimum(kept_BK + spare // K, capacity).astype(jnp.int32)
