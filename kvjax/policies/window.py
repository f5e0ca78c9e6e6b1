"""A rolling buffer of the newest `capacity` tokens (window attention)."""

from __future__ import annotations

import dataclasses

from kvjax.policies.base import Positional


@dataclasses.dataclass(frozen=True)
class Window(Positional):
  name = "window"

  def slot_of(self, capacity, position):
    return position % capacity

  def kept_after(self, capacity, position, total):
    return position >= total - capacity

  def visible(self, capacity, q_pos, k_pos):
    return k_pos > q_pos - capacity
