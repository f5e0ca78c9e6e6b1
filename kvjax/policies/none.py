"""No eviction: slot = position; writing past the capacity is an error."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies.base import Positional


@dataclasses.dataclass(frozen=True)
class NoEviction(Positional):
  name = "none"

  @property
  def bounded(self) -> bool:
    return False

  def slot_of(self, capacity, position):
    return position

  def kept_after(self, capacity, position, total):
    return position < capacity

  def visible(self, capacity, q_pos, k_pos):
    return jnp.ones(jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(k_pos)),
                    bool)
