"""Per-layer budgets (PyramidKV, Cai et al. 2024): lower layers attend
broadly and keep more tokens, upper layers concentrate and keep fewer.

Wraps any scored policy. Budgets fall linearly from the cache capacity S at
layer 0 to k / beta at the top layer, k = S / (2 - 1/beta) being the
average (the paper's arithmetic schedule, total L·k). The cache keeps its
fixed [.., S] shapes; a layer's slots beyond its budget stay empty, so
`cache_bytes(...)['used']` counts what the schedule really holds.
Compare against a uniform policy at capacity ≈ k (`average_budget`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.policies.base import Scored
from kvjax.policies.h2o import H2O


@dataclasses.dataclass(frozen=True)
class Pyramid(Scored):
  name = "pyramid"
  inner: Scored = dataclasses.field(default_factory=H2O)
  beta: float = 20.0
  scope: str = "layer"

  @property
  def needs(self) -> str:  # pytype: disable=signature-mismatch
    return self.inner.needs

  @property
  def accumulate(self) -> bool:  # pytype: disable=signature-mismatch
    return self.inner.accumulate

  def validate(self):
    super().validate()
    if not isinstance(self.inner, Scored):
      raise ValueError(f"pyramid: inner must be a scored policy, got "
                       f"{self.inner!r}")
    if self.scope == "global":
      raise ValueError("pyramid: per-layer budgets need scope 'layer' or "
                       "'head'")
    if not self.beta >= 1:
      raise ValueError(f"pyramid: beta must be >= 1, got {self.beta!r}")

  def observe(self, probs_BKGTS, k_BKSH, valid_BKS, mode):
    return self.inner.observe(probs_BKGTS, k_BKSH, valid_BKS, mode)

  def average_budget(self, capacity: int) -> float:
    return capacity / (2 - 1 / self.beta)

  def budgets(self, num_layers, heads, capacity):
    top = self.average_budget(capacity) / self.beta
    per_layer = np.linspace(capacity, top, num_layers) if num_layers > 1 \
        else np.array([capacity], float)
    per_layer = np.maximum(np.round(per_layer), self.recent + 1)
    per_layer = np.minimum(per_layer, capacity).astype(np.int32)
    return np.repeat(per_layer[:, None], heads, axis=1)
