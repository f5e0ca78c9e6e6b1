"""Attention sinks + a rolling window (StreamingLLM, Xiao et al. 2023): the
first `num_sinks` tokens pinned, the newest `capacity - num_sinks` rolling
through the other slots."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies.base import Positional


@dataclasses.dataclass(frozen=True)
class Sinks(Positional):
  name = "sinks"
  num_sinks: int = 4

  @property
  def pinned(self) -> int:
    return self.num_sinks

  def validate(self):
    if not isinstance(self.num_sinks, int) or self.num_sinks < 1:
      raise ValueError(f"sinks: num_sinks must be an int >= 1, got "
                       f"{self.num_sinks!r}")

  def validate_capacity(self, capacity):
    if capacity <= self.num_sinks:
      raise ValueError(f"capacity={capacity} must exceed num_sinks="
                       f"{self.num_sinks}")

  def slot_of(self, capacity, position):
    n = self.num_sinks
    return jnp.where(position < n, position,
                     n + (position - n) % (capacity - n))

  def kept_after(self, capacity, position, total):
    n = self.num_sinks
    return (position < n) | (position >= total - (capacity - n))

  def visible(self, capacity, q_pos, k_pos):
    n = self.num_sinks
    return (k_pos < n) | (k_pos > q_pos - (capacity - n))
