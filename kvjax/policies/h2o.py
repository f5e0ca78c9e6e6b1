"""Heavy hitters (H2O, Zhang et al. 2023): a slot's score is the attention
its token has received so far, summed over queries; the newest `recent`
tokens are always kept.

The paper evicts per layer and head (`scope='head'`); `scope='global'` (the
default, and kvjax's original H2O) sums the scores over layers and heads so
that every layer keeps the same tokens and positions stay one [B, S] array.
"""

from __future__ import annotations

import dataclasses

from kvjax.policies.base import Scored, attention_received


@dataclasses.dataclass(frozen=True)
class H2O(Scored):
  name = "h2o"

  def observe(self, probs_BKGTS, k_BKSH, valid_BKS, mode):
    return attention_received(probs_BKGTS)
