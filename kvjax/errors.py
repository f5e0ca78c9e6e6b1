"""Errors that travel with the cache.

A check inside `jit` or `lax.scan` cannot raise: the values it would test
are traced. So every step that can detect bad input or a bad result records
it in the cache it returns, and the host-side entry points raise on it:

  cache.errors  [B] int32, a bit set per sequence (0 = healthy), sticky: a
                step ORs its findings into what it received, and nothing but
                a fresh `init_cache` clears it.

  OVERFLOW    a write past the capacity of an eviction='none' cache (the
              token is not stored, so the cache has lost it).
  BAD_TOKEN   a token id outside [0, vocab_size) among the real tokens.
  BAD_MASK    an attention mask that is not left padding (a hole, right
              padding) or a row with no real token.
  NONFINITE   non-finite logits (a NaN or infinite weight, an overflowing
              activation): a token sampled from them would be meaningless.

A step returns NaN logits for every row whose bits were set before its LM
head (`poisoned_rows`), and flags rows whose logits come out non-finite
(`flag_nonfinite`): never finite numbers computed from lost or garbage
data, and a sampler cannot turn non-finite logits into a plausible token
(`Sampler` returns `INVALID_TOKEN` for such rows). `prefill`, `extend`,
`decode_step`, `generate` and the streaming and benchmark drivers call `raise_if_set` on
the cache they receive and the one they produce: a `ValueError` naming each
error and the sequences it hit. `generate` checks once after its loop (no
per-step host sync).

For the exception at the failing step instead, wrap a step function with
`checkified`, or call `checks(cache)` inside a loop body and transform the
loop with `jax.experimental.checkify.checkify`: the first failing
iteration is the one reported, with its sequence and position.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify as checkify_lib

OVERFLOW = 1
BAD_TOKEN = 2
BAD_MASK = 4
NONFINITE = 8

NAMES = {  # in the order of cause and effect, for the message
    OVERFLOW: "cache overflow (a token was written past the capacity of an "
              "eviction='none' cache and lost)",
    BAD_MASK: "invalid attention_mask (not left-padded, or a row with no "
              "real token)",
    NONFINITE: "non-finite logits (NaN or inf in the weights or "
               "activations)",
    BAD_TOKEN: "token id out of range [0, vocab_size) (-1: a token sampled "
               "from non-finite logits)",
}

INVALID_TOKEN = -1  # what a sampler returns for a row it cannot sample

_TRACED_CHECKS = [True]  # read at trace time; see `unchecked`


def enabled() -> bool:
  """Whether steps traced now carry the in-graph checks (always, except
  inside `unchecked`)."""
  return _TRACED_CHECKS[-1]


@contextlib.contextmanager
def unchecked():
  """Traces steps without the in-graph checks, to measure what they cost
  (`kvjax.lab.benchmarking.error_check_cost`); nothing else should use it.
  Programs traced inside never set the error state. Only functions first
  traced inside the context are affected (jit caches what it traced)."""
  _TRACED_CHECKS.append(False)
  try:
    yield
  finally:
    _TRACED_CHECKS.pop()


def zeros(batch: int) -> jax.Array:
  return jnp.zeros((batch,), jnp.int32)


def _flag(bad_B, bit: int):
  return jnp.where(bad_B, jnp.int32(bit), jnp.int32(0))


def token_errors(tokens_BT, vocab_size: int, mask_BT=None):
  """[B] BAD_TOKEN bits: a real token's id outside [0, vocab_size)."""
  bad_BT = (tokens_BT < 0) | (tokens_BT >= vocab_size)
  if mask_BT is not None:
    bad_BT &= mask_BT
  return _flag(jnp.any(bad_BT, axis=-1) if bad_BT.ndim == 2 else bad_BT,
               BAD_TOKEN)


def mask_errors(mask_BT, allow_empty: bool = False):
  """[B] BAD_MASK bits: a 1 followed by a 0 (not left padding), or, unless
  `allow_empty` (a chunk of a longer prompt), no 1 at all."""
  m = mask_BT.astype(jnp.int32)
  bad = jnp.any(m[:, 1:] < m[:, :-1], axis=1)
  if not allow_empty:
    bad |= ~jnp.any(mask_BT, axis=1)
  return _flag(bad, BAD_MASK)


def overflow_errors(policy, capacity: int, new_length_B):
  """[B] OVERFLOW bits: an eviction='none' cache asked to hold more tokens
  than it has slots (the scatter drops the excess)."""
  if policy.eviction != "none":
    return jnp.zeros(new_length_B.shape, jnp.int32)
  return _flag(new_length_B > capacity, OVERFLOW)


def record(cache, bits_B):
  """`cache` with `bits_B` ORed into its error state."""
  if not enabled():
    return cache
  errors = cache.errors if cache.errors is not None else zeros(
      bits_B.shape[0])
  return cache.replace(errors=errors | bits_B.astype(jnp.int32))


def poisoned_rows(cache):
  """[B] bool: the rows whose logits a step must return as NaN (error bits
  set), or None when checks are off (`unchecked`).

  The model applies it inside the LM head's RMSNorm, to the per-row
  1/rms factor (`layers.rms_norm(invalid_B=...)`): a select on [B, T, 1]
  in the norm's reduction. A select on the hidden state or the logits is
  not free on CPU: XLA fuses the norm into the head's matrix-vector loop
  and redoes its inputs per weight row (the first version of these checks,
  with that select, cost 1.066x on gqa-small batch 1:
  experiments/error_check_cost.py)."""
  if not enabled():
    return None
  return cache.errors != 0


def flag_nonfinite(logits, cache):
  """`cache` with NONFINITE set for healthy rows with a non-finite logit
  (logits [B, V] or [B, T, V])."""
  if not enabled():
    return cache
  # max |x| is NaN or inf exactly when a logit is: a float max-reduction
  # vectorises on CPU; an and-reduction of isfinite does not.
  axes = tuple(range(1, logits.ndim))
  largest = jnp.max(jnp.abs(logits), axis=axes)
  # Rows poisoned for an earlier error are NaN by design, not a new cause.
  return record(cache, _flag(~(largest < jnp.inf) & (cache.errors == 0),
                             NONFINITE))


def describe(errors_B) -> str:
  """Human text of a concrete [B] error array ('' when healthy)."""
  errors_B = np.asarray(errors_B)
  parts = []
  for bit, name in NAMES.items():
    rows = np.flatnonzero(errors_B & bit)
    if rows.size:
      shown = ", ".join(map(str, rows[:16])) + (", ..." if rows.size > 16
                                                 else "")
      parts.append(f"{name} in sequence{'s' if rows.size > 1 else ''} "
                   f"{shown}")
  return "; ".join(parts)


def _concrete(x) -> bool:
  """An array with values (not None, a tracer or a ShapeDtypeStruct)."""
  return (isinstance(x, (jax.Array, np.ndarray)) and
          not isinstance(x, jax.core.Tracer))


def raise_if_set(cache, where: str) -> None:
  """Raises ValueError if a concrete cache carries an error (no-op when
  traced, or for a cache without error state)."""
  errors = getattr(cache, "errors", None)
  if not _concrete(errors):
    return
  if isinstance(errors, jax.Array) and not errors.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    errors = multihost_utils.process_allgather(errors, tiled=True)
  errors = np.asarray(errors)
  if errors.any():
    raise ValueError(f"{where}: {describe(errors)}. The cache is poisoned "
                     "(its logits are NaN); start from a fresh init_cache")


def checks(cache) -> None:
  """One `checkify.check` per error kind on `cache`: the message names the
  first sequence hit and its position (the step). Only inside a function
  transformed by `jax.experimental.checkify.checkify` (a scan body too)."""
  for bit, name in NAMES.items():
    hit_B = (cache.errors & bit) != 0
    row = jnp.argmax(hit_B)
    checkify_lib.check(~jnp.any(hit_B),
                       f"{name} in sequence {{row}} at position {{pos}}",
                       row=row, pos=cache.length[row] - 1)


def checkified(step_fn):
  """`step_fn` (returning (logits, cache)) under `jax.experimental.checkify`:
  returns (checkify.Error, (logits, cache)); `err.throw()` raises if the
  step's cache carries an error. For a loop, call `checks(cache)` in its
  body and checkify the whole function: the first failing step is the one
  reported."""

  @functools.wraps(step_fn)  # jit's static_argnames read the signature
  def checked(*args, **kwargs):
    logits, cache = step_fn(*args, **kwargs)
    checks(cache)
    return logits, cache

  return functools.wraps(step_fn)(checkify_lib.checkify(checked))
