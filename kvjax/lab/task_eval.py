"""Task accuracy through a bounded KV cache (`kvjax.lab.tasks` examples).

Only kvjax's public API runs the model: `kvjax.generate`, `kvjax.prefill`,
`kvjax.decode_step`, `kvjax.init_cache`, `kvjax.CachePolicy` and
`kvjax.kv_bytes_per_token`. Nothing here reads a cache's fields, so the
eviction internals may change underneath.

A policy is named ('full', 'window', 'sinks<n>', or any scored policy of
`kvjax.policies`: 'h2o', 'tova', 'knorm', 'snapkv', 'pyramid', 'adakv',
'keydiff'; optionally ':original' or ':cache' for the RoPE position mode,
then '@stream'), stored in one of `KV_FORMATS` (float32, bfloat16,
float16, int8, KIVI, ...) and sized by a budget: the cache holds
ceil(budget × T) slots for a T-token prompt ('full' holds the whole prompt
and answer, whatever the budget). Three ways through the model, chosen per
call:

  one pass   `kvjax.generate(policy=..., capacity=...)` (greedy), or
             `kvjax.prefill(all_logits=True)` for teacher forcing. The
             prompt is prefilled in one parallel call; window and sinks
             with positions='original' mask each query to what the cache
             would hold at its step, so this equals streaming the prompt.
  compressed per-layer/head policies (snapkv, tova, knorm, pyramid, adakv,
             keydiff) over a prompt longer than their budget: the prefill
             attends the whole prompt once and each layer (head) keeps its
             best-scoring tokens (SnapKV's prefill-time compression); then
             decode steps evict one token per step.
  streamed   where a one-pass prefill must fit the cache (h2o, positions=
             'cache'), and for '@stream': `kvjax.prefill` of the first
             `capacity` tokens, then `kvjax.decode_step` per remaining
             prompt token, then greedy `decode_step`s. Every cache sees the
             prompt as a stream, token by token, as in StreamingLLM and
             H2O (decode-time eviction).

Dimension alphabet (`kvjax.config`): B batch, T prompt length (a teacher-
forced input: T + I - 1), I answer length (the tokens to generate), V vocab,
S cache slots.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import time
from collections.abc import Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import cache as cache_lib
from kvjax import data
from kvjax import policies
from kvjax.lab import tasks as tasks_lib

_SCORED = tuple(n for n, cls in policies.REGISTRY.items()
                if issubclass(cls, policies.Scored))
_POLICY = re.compile(r"^(full|window|sinks(\d+)|" + "|".join(_SCORED) +
                     r")(?::(original|cache))?(@stream)?$")
# KIVI: keys per channel in groups of tokens, values per token, at 8, 4 or
# 2 bits (its 4- and 2-bit settings: 'kivi4', 'kivi2').
KIVI_FORMATS = {"kivi": "int8", "kivi4": "int4", "kivi2": "int2"}
KV_FORMATS = cache_lib.KV_DTYPES + tuple(KIVI_FORMATS)


@dataclasses.dataclass(frozen=True)
class PolicySpec:
  """A named cache policy and storage format; `at(capacity)` builds the
  `kvjax.CachePolicy`.

  kind: 'full' (eviction none), 'window', 'sinks' (StreamingLLM: the first
    `num_sinks` tokens and a recent window), or a scored policy of
    `kvjax.policies` (h2o, tova, knorm, snapkv, pyramid, adakv, keydiff)
    with its defaults and `recent` = half the slots (the H2O paper's
    20 % = 10 % heavy + 10 % recent), the same for every scored policy so
    that only the scores differ.
  positions: 'original' (keys rotated at their stream position) or 'cache'
    (at their rank in the cache, StreamingLLM's choice). Defaults: full,
    window and per-layer/head policies 'original', sinks and global scored
    policies 'cache' (as `kvjax.lab.streaming`).
  kv_dtype: a `kvjax.cache.KV_DTYPES` storage dtype, or 'kivi' / 'kivi4' /
    'kivi2' (int8 / int4 / int2 keys per channel in groups of 32 tokens,
    values per token at the same width: KIVI; eviction 'none' only, so
    policy 'full').
  stream: feed the prompt token by token through decode steps even where
    the policy could compress it at prefill ('@stream' in the name): the
    decode-time eviction to compare with prefill-time compression.
  """

  name: str
  kind: str
  num_sinks: int = 0
  positions: str = "original"
  kv_dtype: str = "float32"
  stream: bool = False

  @property
  def label(self) -> str:
    """The policy name, with the storage format unless float32."""
    return (self.name if self.kv_dtype == "float32" else
            f"{self.name} [{self.kv_dtype}]")

  def _storage(self) -> dict:
    if self.kv_dtype in KIVI_FORMATS:
      return dict(kv_dtype=KIVI_FORMATS[self.kv_dtype], key_quant="channel")
    return dict(kv_dtype=self.kv_dtype)

  def at(self, capacity: int) -> kvjax.CachePolicy:
    store = self._storage()
    if self.kind == "full":
      return kvjax.CachePolicy(positions=self.positions, **store)
    if self.kind == "window":
      return kvjax.CachePolicy("window", positions=self.positions, **store)
    if self.kind == "sinks":
      return kvjax.CachePolicy("sinks", num_sinks=self.num_sinks,
                               positions=self.positions, **store)
    return kvjax.CachePolicy(scored_policy(self.kind, capacity),
                             positions=self.positions, **store)

  def compresses(self, capacity: int, prompt_len: int) -> bool:
    """Whether the prompt is compressed once at prefill (a per-layer/head
    policy whose budget the prompt exceeds: SnapKV-style) rather than
    evicted token by token."""
    return (not self.stream and prompt_len > capacity and
            self.kind not in ("full", "window", "sinks") and
            policies.REGISTRY[self.kind]().scoped)

  def capacity(self, budget: float, prompt_len: int, answer_len: int) -> int:
    """Cache slots for a prompt: the whole stream for 'full' (rounded up to
    whole KIVI groups), else ceil(budget × prompt_len).

    Raises:
      ValueError: budget outside (0, 1], or a capacity the policy cannot
        run at (e.g. sinks with no slot beyond the sinks).
    """
    check_budget(budget)
    if self.kind == "full":
      return self.at(1).round_capacity(prompt_len + answer_len - 1)
    capacity = max(1, math.ceil(budget * prompt_len))
    try:
      self.at(capacity).validate_capacity(capacity)
    except ValueError as e:
      raise ValueError(f"policy {self.name!r} cannot run at budget={budget} "
                       f"({capacity} slots of a {prompt_len}-token prompt): "
                       f"{e}") from None
    return capacity


def scored_policy(kind: str, capacity: int) -> policies.Policy:
  """A scored policy with `recent` = half the slots (its inner policy's
  too, for the budget wrappers pyramid and adakv)."""
  cls = policies.REGISTRY[kind]
  recent = max(capacity // 2, 1)
  fields = {f.name for f in dataclasses.fields(cls)}
  opts = dict(recent=recent) if "recent" in fields else {}
  if "inner" in fields:
    opts["inner"] = dataclasses.replace(cls().inner, recent=recent)
  return cls(**opts)


def check_budget(budget: float) -> float:
  if (isinstance(budget, bool) or not isinstance(budget, (int, float)) or
      not 0.0 < float(budget) <= 1.0):
    raise ValueError(f"budget must be in (0, 1], got {budget!r}")
  return float(budget)


def lengths_per_task(entries: Sequence[str], task_names: Sequence[str]
                     ) -> dict[str, list[int]]:
  """Prompt lengths per task from `policy_eval`'s --lengths entries: 'T'
  (every task without lengths of its own) or 'task:T' (that task only), so
  one run scores a model of several tasks at each one's training length,
  e.g. ['passkey:256', 'mqar1_flat:32'].

  Raises:
    ValueError: an entry that is not an integer or 'task:integer', a task
      not among `task_names`, or a task left with no length.
  """
  shared: list[int] = []
  own: dict[str, list[int]] = {}
  for entry in entries:
    name, sep, value = str(entry).strip().rpartition(":")
    try:
      n = int(value)
    except ValueError:
      raise ValueError(f"lengths: {entry!r} is not T or task:T (T an "
                       "integer)") from None
    if not sep:
      shared.append(n)
    elif name not in task_names:
      raise ValueError(f"lengths: {entry!r} names task {name!r}, not one "
                       f"of the tasks {list(task_names)}")
    else:
      own.setdefault(name, []).append(n)
  out = {t: own.get(t, shared) for t in task_names}
  missing = [t for t, ns in out.items() if not ns]
  if missing:
    raise ValueError(f"lengths: no length for task(s) {missing}; give T or "
                     f"task:T")
  return {t: list(ns) for t, ns in out.items()}


def parse_policy(name: str, kv_dtype: str = "float32") -> PolicySpec:
  """'full', 'window', 'sinks<n>' or a scored policy's name (h2o, tova,
  knorm, snapkv, ...), optionally ':original'/':cache' and '@stream'.

  Raises:
    ValueError: an unknown name (the message lists the forms), an unknown
      kv_dtype, or a KIVI format with an evicting policy.
  """
  m = _POLICY.match(name)
  if not m:
    raise ValueError(f"policy {name!r} is not one of full, window, sinks<n>, "
                     f"{', '.join(_SCORED)} (optionally ':original' or "
                     "':cache', then '@stream')")
  if kv_dtype not in KV_FORMATS:
    raise ValueError(f"kv_dtype={kv_dtype!r} is not one of {KV_FORMATS}")
  kind = "sinks" if m.group(2) else m.group(1)
  sinks = int(m.group(2)) if m.group(2) else 0
  if kind == "sinks" and sinks < 1:
    raise ValueError(f"policy {name!r}: sinks<n> needs n >= 1")
  if kv_dtype in KIVI_FORMATS and kind != "full":
    raise ValueError(f"kv_dtype={kv_dtype!r} quantizes keys in groups of tokens "
                     f"and needs policy 'full' (no eviction), got {name!r}")
  if kind in ("full", "window"):
    default = "original"
  elif kind == "sinks":
    default = "cache"
  else:
    default = "original" if policies.REGISTRY[kind]().scoped else "cache"
  stream = bool(m.group(4))
  if stream and kind in ("full", "window", "sinks"):
    raise ValueError(f"policy {name!r}: '@stream' is for scored policies "
                     "(the others already see the prompt as a stream)")
  return PolicySpec(name=name, kind=kind, num_sinks=sinks,
                    positions=m.group(3) or default, kv_dtype=kv_dtype,
                    stream=stream)


def one_pass(policy: kvjax.CachePolicy, capacity: int, prompt_len: int) -> bool:
  """Whether a `prompt_len`-token prompt may be prefilled in one call into
  `capacity` slots: it fits, the policy is a positional one (window,
  sinks) that keeps original positions (see the module docstring), or a
  per-layer/head one that compresses the prompt at prefill."""
  return prompt_len <= capacity or policy.scoped or (
      policy.eviction in ("window", "sinks") and
      policy.positions == "original")


def _check_unpadded(attention_mask):
  if not np.all(np.asarray(attention_mask) == 1):
    raise ValueError("streaming a prompt through decode_step needs prompts "
                     "of one length (no padding); batch by length")


def _stream_prompt(params, config, tokens, policy, capacity, keep: int,
                   first: int | None = None):
  """Prefill of the first `first` tokens (default: as many as fit), then
  one decode_step per remaining token. Returns (logits of the last `keep`
  positions [B, keep, V], cache)."""
  B, T = tokens.shape
  cache = kvjax.init_cache(config, B, capacity, policy=policy)
  first = min(T, capacity) if first is None else first
  logits, cache = kvjax.prefill(params, config, tokens[:, :first], cache,
                                all_logits=True)
  out = [logits[:, max(0, first - keep):]]
  for j in range(first, T):
    step_logits, cache = kvjax.decode_step(params, config, tokens[:, j],
                                           cache)
    if j >= T - keep:
      out.append(step_logits[:, None])
  return jnp.concatenate(out, axis=1)[:, -keep:], cache


def generate_answers(params, config, tokens, attention_mask, max_new: int,
                     policy: kvjax.CachePolicy, capacity: int, *,
                     stream: bool | None = None) -> np.ndarray:
  """Greedy continuation of left-padded prompts through a bounded cache.

  Args:
    tokens, attention_mask: int32 [B, T] (left padding).
    max_new: I, tokens to generate.
    policy, capacity: the cache.
    stream: force the streamed path (True) or the one-pass one (False);
      None chooses by `one_pass`.
  Returns:
    int32 [B, I] generated ids.
  """
  T = int(np.asarray(attention_mask).sum(axis=1).max())
  if stream is None:
    stream = not one_pass(policy, capacity, T)
  if not stream:
    return np.asarray(kvjax.generate(
        params, config, tokens, max_new, attention_mask=attention_mask,
        capacity=capacity, policy=policy, bucket=False))
  _check_unpadded(attention_mask)
  logits, cache = _stream_prompt(params, config, jnp.asarray(tokens), policy,
                                 capacity, keep=1)
  tok = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
  out = [tok]
  for _ in range(max_new - 1):
    step_logits, cache = kvjax.decode_step(params, config, tok, cache)
    tok = jnp.argmax(step_logits, axis=-1).astype(jnp.int32)
    out.append(tok)
  return np.asarray(jnp.stack(out, axis=1))


def teacher_forced_logits(params, config, tokens, attention_mask,
                          policy: kvjax.CachePolicy, capacity: int, *,
                          keep: int | None = None,
                          stream: bool | None = None) -> np.ndarray:
  """Logits of every position of [B, T] inputs read through the cache.

  One pass: `kvjax.prefill(all_logits=True)`. Streamed: only the last
  `keep` positions are real (the rest are zeros); `tasks.answer_loglik`
  reads only the answer positions, which are the last ones.

  Returns:
    float32 [B, T, V].
  """
  T = tokens.shape[1]
  n = int(np.asarray(attention_mask).sum(axis=1).max())
  if stream is None:
    stream = not one_pass(policy, capacity, n)
  keep = T if keep is None else keep
  first = None
  if not stream and policy.scoped and n > capacity:
    # A compressing prefill attends the whole input before it keeps a
    # subset: the answer positions would see the full prompt. Compress the
    # prompt alone (up to the first scored position), then read the rest
    # through decode steps.
    _check_unpadded(attention_mask)
    stream, first = True, T - keep + 1
  if not stream:
    cache = kvjax.init_cache(config, tokens.shape[0], capacity, policy=policy)
    logits, _ = kvjax.prefill(params, config, tokens, cache, attention_mask,
                              all_logits=True)
    return np.asarray(logits)
  _check_unpadded(attention_mask)
  logits, _ = _stream_prompt(params, config, jnp.asarray(tokens), policy,
                             capacity, keep, first)
  full = np.zeros((tokens.shape[0], T, logits.shape[-1]), np.float32)
  full[:, T - keep:] = np.asarray(logits)
  return full


def evaluate(params, config, examples: Sequence[tasks_lib.Example],
             policy: str | PolicySpec, budget: float = 1.0, *,
             batch_size: int = 8, loglik: bool = False) -> list[dict]:
  """Scores examples through one cache policy at one budget.

  Examples are grouped by prompt length (a group shares one capacity and
  one compiled program) and run in equal batches of at most `batch_size`.

  Args:
    policy: a name (`parse_policy`) or a PolicySpec.
    budget: in (0, 1], cache slots as a share of the prompt length.
    loglik: also score the teacher-forced answer log-likelihood
      (`tasks.answer_loglik`) through the same cache.
  Returns:
    One record per example: task, length, depth, needle_depth, seed,
    policy, kv_dtype, mode ('one pass', 'compressed' or 'streamed': see
    the module docstring), budget, capacity, kv_bytes (`sequence_kv_bytes`),
    exact, recall, predicted (text) and,
    with loglik, loglik / loglik_per_byte / token_accuracy / argmax_exact.
  Raises:
    ValueError: before any compute, for an unknown policy, a budget outside
      (0, 1] or a capacity the policy cannot run at.
  """
  spec = parse_policy(policy) if isinstance(policy, str) else policy
  check_budget(budget)
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  by_length = collections.defaultdict(list)
  for e in examples:
    by_length[(e.length, e.answer.shape[0])].append(e)
  plans = {key: spec.capacity(budget, *key) for key in by_length}
  records = []
  for (T, I), group in sorted(by_length.items()):
    capacity = plans[(T, I)]
    cache_policy = spec.at(capacity)
    kv_bytes = sequence_kv_bytes(config, cache_policy, capacity)
    mode = ("streamed" if spec.stream or not one_pass(cache_policy, capacity,
                                                      T) else
            "compressed" if spec.compresses(capacity, T) else "one pass")
    t0 = time.perf_counter()
    # Equal batches, the last one topped up with copies whose scores are
    # dropped: one batch shape per group, so one compiled program.
    n_batches = -(-len(group) // batch_size)
    size = -(-len(group) // n_batches)
    padded = list(group) + [group[-1]] * (n_batches * size - len(group))
    for i in range(0, len(group), size):
      real = len(group[i:i + size])
      batch = tasks_lib.batch_examples(padded[i:i + size])

      def gen(tokens, mask, max_new, cache_policy=cache_policy,
              capacity=capacity):
        return generate_answers(params, config, tokens, mask, max_new,
                                cache_policy, capacity,
                                stream=True if spec.stream else None)

      scores = tasks_lib.score_generate(gen, batch)
      if loglik:
        def logits_fn(tokens, mask, cache_policy=cache_policy,
                      capacity=capacity):
          return teacher_forced_logits(params, config, tokens, mask,
                                       cache_policy, capacity, keep=I,
                                       stream=True if spec.stream else None)
        scores.update(tasks_lib.answer_loglik(logits_fn, batch))
      for b, e in enumerate(batch.examples[:real]):
        r = dict(task=e.task, length=T, depth=e.depth,
                 needle_depth=e.needle_depth, seed=e.seed, filler=e.filler,
                 policy=spec.name, kv_dtype=spec.kv_dtype, mode=mode,
                 budget=float(budget), capacity=capacity,
                 kv_bytes=float(kv_bytes),
                 exact=float(scores["exact"][b]),
                 recall=float(scores["recall"][b]),
                 predicted=data.decode(scores["predicted"][b]))
        for k in ("loglik", "loglik_per_byte", "token_accuracy",
                  "argmax_exact"):
          if k in scores:
            r[k] = float(scores[k][b])
        records.append(r)
    logging.info("%s budget %.3g, T=%d (S=%d, %s): exact %.3f over %d "
                 "(%.1f s)", spec.label, budget, T, capacity, mode,
                 np.mean([r["exact"] for r in records[-len(group):]]),
                 len(group), time.perf_counter() - t0)
  return records


def sequence_kv_bytes(config, policy: kvjax.CachePolicy,
                      capacity: int) -> int:
  """Bytes of K/V storage one sequence's cache holds at `capacity` slots:
  payload and scales (`kvjax.cache_bytes` 'kv') plus KIVI's float32
  residual group; no bookkeeping (positions, scores)."""
  shapes = jax.eval_shape(
      lambda: kvjax.init_cache(config, 1, capacity, policy=policy))
  leaves = cache_lib._storage_leaves(shapes) + [  # pylint: disable=protected-access
      getattr(shapes, f) for f in ("k_resid", "c_resid", "r_resid")
      if getattr(shapes, f, None) is not None]
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
             for x in leaves)


def accuracy_grid(records: Sequence[dict], metric: str = "exact",
                  keys: Sequence[str] = ("length", "depth")) -> dict:
  """Mean `metric` per combination of `keys`: {(k1, k2, ...): (mean, n)}."""
  cells = collections.defaultdict(list)
  for r in records:
    cells[tuple(r[k] for k in keys)].append(r[metric])
  return {k: (float(np.mean(v)), len(v)) for k, v in sorted(cells.items())}


def wilson_interval(successes: float, n: int, z: float = 1.96):
  """95 % Wilson score interval of a binomial share (works at 0 and n)."""
  if n == 0:
    return (0.0, 1.0)
  p = successes / n
  denom = 1 + z * z / n
  centre = (p + z * z / (2 * n)) / denom
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
  # min / max with p: at p = 1 (or 0) rounding can leave the bound a hair
  # on the wrong side of p (60 of 60: 0.9999999999999999).
  return (min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half)))
