"""The eviction-policy protocol: what a bounded cache keeps when it is full.

A policy is a small frozen dataclass (hashable: it is static under `jit`,
part of the compiled program's key, never traced). The cache and the decode
loop never name a policy; they ask it. Two families:

Positional policies (`Positional`: none, window, sinks) have closed forms:
the slot a stream position is written to, whether it is still cached after
`total` tokens, whether a key is visible to a query. A prompt longer than
the cache is then prefilled in one pass (the `visible` mask reproduces what
token-by-token eviction would show) and chunks extend a filled cache.

Scored policies (`Scored`: h2o, tova, knorm, snapkv, and the budget wrappers
pyramid, adakv) keep a score per cached slot (higher = keep) and evict the
lowest-scoring unprotected slot when a new token needs room. A scored policy
says
  needs    what its scores are computed from: 'attention' (the attention
           probabilities a layer computes; fused attention kernels that
           return none are refused before compute) or 'keys' (the cached
           keys only: works with every attention implementation);
  observe  the score each attended key earns from one layer call,
           [B, K, S'] per kv head (S' = the call's key axis);
  accumulate  whether scores add up over steps (H2O) or are replaced by
           each step's observation (TOVA, Knorm);
  scope    where victims are chosen: 'global' (one victim per sequence for
           all layers and heads; positions stay one [B, S] array, scores
           are summed over layers and heads), 'layer' (per layer: positions
           [L, B, 1, S]) or 'head' (per layer and kv head: [L, B, K, S]);
  budgets  the slots each scope may fill (per layer: PyramidKV; per head:
           AdaKV), the cache capacity S being the largest.
Scoped policies compress a prompt longer than their budget at prefill
(SnapKV-style: each layer keeps its best-scoring tokens once the prompt's
attention is known) and evict one slot per scope per decode step, all with
fixed shapes.

Dimension alphabet: B batch, T query length, S cache slots, S' an
attention call's key axis, K kv heads (K' = 1 or K: the scope's head axis),
G query heads per kv head, H head dim, L layers.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

SCOPES = ("global", "layer", "head")
NEEDS = ("nothing", "attention", "keys")


@dataclasses.dataclass(frozen=True)
class Policy:
  """Base of every eviction policy (see the module docstring).

  Subclasses are frozen dataclasses; their fields are the policy's options.
  `name` is the registry name (`kvjax.policies.REGISTRY`).
  """

  name: ClassVar[str] = ""
  needs: ClassVar[str] = "nothing"
  closed_form: ClassVar[bool] = True
  scope: ClassVar[str] = "global"

  @property
  def bounded(self) -> bool:
    """True when old tokens are evicted instead of overflowing."""
    return True

  @property
  def scored(self) -> bool:
    return not self.closed_form

  @property
  def scoped(self) -> bool:
    """True when layers (or heads) keep different tokens."""
    return self.scope != "global"

  @property
  def pinned(self) -> int:
    """Leading stream positions that are never evicted (attention sinks)."""
    return 0

  def validate(self) -> None:
    """Raises ValueError naming a bad option (called on construction)."""

  def validate_capacity(self, capacity: int) -> None:
    """Raises ValueError if `capacity` slots cannot hold this policy."""

  def __post_init__(self):
    self.validate()


@dataclasses.dataclass(frozen=True)
class Positional(Policy):
  """A policy whose slot arithmetic is closed-form (no state)."""

  def slot_of(self, capacity: int, position):
    """Slot that stream `position` (int array) is written to."""
    raise NotImplementedError

  def kept_after(self, capacity: int, position, total):
    """Whether `position` still holds its slot after `total` tokens."""
    raise NotImplementedError

  def visible(self, capacity: int, q_pos, k_pos):
    """Whether key position k_pos is cached when query q_pos attends
    (causality and emptiness are the caller's)."""
    raise NotImplementedError

  def ranks(self, positions_BS, length_B, capacity: int):
    """[B, S] rank of each slot's token among the cached ones (its RoPE
    position in `cache` position mode), for filled slots."""
    n = self.pinned
    shift = jnp.maximum(length_B - capacity, 0)[:, None]
    return jnp.where(positions_BS < n, positions_BS, positions_BS - shift)


@dataclasses.dataclass(frozen=True)
class Scored(Policy):
  """A policy that evicts the lowest-scoring unprotected slot.

  recent: the newest `recent` tokens (the incoming one included) are never
    evicted (>= 1: the incoming token must be written).
  scope: 'global', 'layer' or 'head' (module docstring).
  """

  closed_form: ClassVar[bool] = False
  needs: ClassVar[str] = "attention"
  accumulate: ClassVar[bool] = True

  recent: int = 1
  scope: str = "global"

  def validate(self) -> None:
    if not isinstance(self.recent, int) or self.recent < 1:
      raise ValueError(f"{self.name}: recent must be an int >= 1 (the "
                       f"incoming token is always kept), got {self.recent!r}")
    if self.scope not in SCOPES:
      raise ValueError(f"{self.name}: scope={self.scope!r} is not one of "
                       f"{SCOPES}")

  def validate_capacity(self, capacity: int) -> None:
    if capacity <= self.recent:
      raise ValueError(f"capacity={capacity} must exceed recent="
                       f"{self.recent} for {self.name}")

  # ---- scores -------------------------------------------------------------
  def observe(self, probs_BKGTS, k_BKSH, valid_BKS, mode: str):
    """[B, K, S'] score each key of one layer call earns (float32).

    probs_BKGTS: the call's attention probabilities (None when the
      attention implementation returns none; `needs='attention'` policies
      are refused before that can happen). k_BKSH: the call's keys as
      attended. valid_BKS: which of them hold a token the newest query may
      attend (K may be 1: shared by the heads); scores of the others are
      never read. mode: 'prefill' (keys = the prompt) or 'decode' (keys =
      the cache slots).
    """
    raise NotImplementedError

  def budgets(self, num_layers: int, heads: int, capacity: int) -> np.ndarray:
    """[L, K'] slots each scope may fill (int; <= capacity)."""
    return np.full((num_layers, heads), capacity, np.int32)

  def allot(self, kept_BK, budget_BK, capacity: int):
    """[B, K'] slots each scope may fill during decode, after a prefill
    kept `kept_BK` tokens per scope under `budget_BK` (AdaKV
    redistributes; the default keeps the budgets)."""
    del kept_BK, capacity
    return budget_BK

  def prefill_keep(self, key_scores_BKT, protected_BT, real_BT, budget_BK,
                   capacity: int):
    """Which prompt tokens each scope keeps: [B, K', T] bool.

    Protected tokens (the newest `recent`) first, then the best scores,
    `budget_BK[b, k]` tokens at most per scope (all real tokens when they
    fit; never more than `capacity`). Ties go to the older token."""
    del capacity  # budgets never exceed it
    key = self.score_key(key_scores_BKT, protected_BT, real_BT)
    order = jnp.argsort(-key, axis=-1, stable=True)  # best first
    rank = jnp.argsort(order, axis=-1, stable=True)  # rank of each token
    return (rank < budget_BK[:, :, None]) & real_BT[:, None]

  def score_key(self, key_scores_BKT, protected_BT, real_BT):
    """Prompt scores with protected tokens first (+inf) and padding last."""
    return jnp.where(protected_BT[:, None], jnp.inf,
                     jnp.where(real_BT[:, None], key_scores_BKT, -jnp.inf))

  def protected(self, positions, length):
    """Slots whose token may not be evicted: the newest `recent` tokens
    (the incoming one, at position length - 1, included). `length`
    broadcasts against `positions`."""
    return (positions >= 0) & (positions > length - 1 - self.recent)

  def victims(self, scores, positions, length, budget):
    """Slot each scope writes its next token to.

    scores, positions: [..., S]; length (the incoming token's position,
    i.e. tokens seen before it) and budget: [...]. Fills the first empty
    slot below the budget while the scope holds fewer tokens than its
    budget; then replaces the lowest-scoring slot outside the protected
    window (the incoming token counts as protected: `length` + 1 tokens
    once it is written).
    """
    S = positions.shape[-1]
    idx = jnp.arange(S).reshape((1,) * budget.ndim + (S,))
    usable = idx < budget[..., None]
    filled = jnp.sum((positions >= 0) & usable, axis=-1)
    empty = (positions < 0) & usable
    first_empty = jnp.argmax(empty, axis=-1)
    shield = self.protected(positions, (length + 1)[..., None])
    masked = jnp.where(shield | ~usable | (positions < 0), jnp.inf, scores)
    victim = jnp.argmin(masked, axis=-1)
    return jnp.where(filled < budget, first_empty, victim).astype(jnp.int32)


def reduce_heads(scores_BKS, heads: int):
  """[B, K, S] per-kv-head scores to the scope's head axis K' (sum)."""
  if heads == scores_BKS.shape[1]:
    return scores_BKS
  return jnp.sum(scores_BKS, axis=1, keepdims=True)


def attention_received(probs_BKGTS, queries=None):
  """[B, K, S'] attention each key received, summed over the group's query
  heads and over the last `queries` query rows (all when None)."""
  if queries is not None:
    probs_BKGTS = probs_BKGTS[:, :, :, -queries:]
  return jnp.sum(probs_BKGTS, axis=(2, 3))

