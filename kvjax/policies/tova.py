"""Token Omission Via Attention (TOVA, Oren et al. 2024): evict the token
the newest query attends to least. A slot's score is the attention it gets
from the latest query only (replaced every step, not accumulated), summed
over the scope's heads; the paper decides per layer (`scope='layer'`,
the default here)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from kvjax.policies.base import Scored, attention_received


@dataclasses.dataclass(frozen=True)
class TOVA(Scored):
  name = "tova"
  accumulate: ClassVar[bool] = False
  scope: str = "layer"

  def observe(self, probs_BKGTS, k_BKSH, valid_BKS, mode):
    return attention_received(probs_BKGTS, queries=1)
