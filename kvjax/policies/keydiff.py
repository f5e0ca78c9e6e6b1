"""KeyDiff (Park et al. 2025; kvpress' KeyDiffPress): keep the keys least
like the others. A slot's score is minus the cosine similarity of its key to
the mean direction of the cached keys (the anchor); tokens whose keys point
where everyone's do add little, so they go first. Needs the keys only, so it
runs with fused attention kernels too. Recomputed every step, per kv head by
default."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.policies.base import Scored


@dataclasses.dataclass(frozen=True)
class KeyDiff(Scored):
  name = "keydiff"
  needs: ClassVar[str] = "keys"
  accumulate: ClassVar[bool] = False
  scope: str = "head"

  def observe(self, probs_BKGTS, k_BKSH, valid_BKS, mode):
    k = k_BKSH.astype(jnp.float32)
    unit = k / jnp.maximum(jnp.linalg.norm(k, axis=-1, keepdims=True), 1e-6)
    w = valid_BKS[..., None].astype(jnp.float32)
    anchor = jnp.sum(unit * w, axis=2, keepdims=True) / jnp.maximum(
        jnp.sum(w, axis=2, keepdims=True), 1.0)
    anchor = anchor / jnp.maximum(
        jnp.linalg.norm(anchor, axis=-1, keepdims=True), 1e-6)
    return -jnp.sum(unit * anchor, axis=-1)
