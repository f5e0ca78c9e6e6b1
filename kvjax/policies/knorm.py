"""Key-norm eviction (Devoto et al. 2024, kvpress' KnormPress): keys with a
small L2 norm draw the most attention, so the slot whose key has the largest
norm goes first. Needs the keys only — no attention probabilities — so it
runs with every attention implementation, fused kernels included. Scores
are recomputed from the cached keys each step; per kv head by default."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.policies.base import Scored


@dataclasses.dataclass(frozen=True)
class Knorm(Scored):
  name = "knorm"
  needs: ClassVar[str] = "keys"
  accumulate: ClassVar[bool] = False
  scope: str = "head"

  def observe(self, probs_BKGTS, k_BKSH, valid_BKS, mode):
    k = k_BKSH.astype(jnp.float32)
    return -jnp.sqrt(jnp.sum(k * k, axis=-1))
