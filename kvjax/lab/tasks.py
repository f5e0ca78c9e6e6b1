r"""Synthetic long-context tasks, generated in code, and their scorers.

Three families, each a byte-level prompt that ends in a question and an
answer the model must produce next:

  passkey   Mohtashami & Jaggi (2023), as in StreamingLLM's passkey test: a
            number hidden in repeated filler, asked for at the end.
  niah_*    RULER's needle-in-a-haystack families (Hsieh et al. 2024):
            single key, multi-key (distractor needles), multi-value,
            multi-query; the haystack is repeated noise sentences, held-out
            text (the Austen corpus, when installed) or other needles.
  mqar      multi-query associative recall (Zoology, Arora et al. 2023):
            key=value pairs fill the context, then queries for some keys.

Formats (one token per byte, `kvjax.data`; <BOS> is the BOS token):

  passkey     <BOS>{filler} The pass key is 48213. Remember it. 48213 is the
              pass key.{filler} What is the pass key? The pass key is
              -> "48213"
  niah_single <BOS>{filler} The magic number for bako is 4950265.{filler}
              What is the magic number for bako? The magic number for bako
              is  -> "4950265"
  niah_multivalue  ... What are all the magic numbers for bako? The magic
              numbers for bako are  -> "4950265, 1831108, 7203645, 3316727"
              (values in the order their needles appear)
  niah_multiquery  ... What are the magic numbers for bako, temi, lusa and
              rope? The magic numbers for bako, temi, lusa and rope are
              -> "..., ..., ..., ..." (in the order asked)
  mqar        <BOS>{spaces} kqz=184 abt=902 ... wer=377\n abt=902 wer=377 kqz=
              -> "184"
  mqar1       <BOS>{spaces} k=1 a=9 ... w=3\n a=9 w=3 k=  -> "1" (Zoology's
              one-token keys and values; 26 pairs at most)
  mqar1_adjacent  <BOS>{spaces} k1 a9 ... w3\n a9 w3 k  -> "1" (and
              Zoology's order: each value right after its key)
  mqar1_flat  <BOS>{spaces} k1 a9 ... w3 a9 w3 k  -> "1" (and no newline
              before the queries, as in Zoology's prompts)

The noise filler is Mohtashami & Jaggi's (" The grass is green. The sky is
blue. The sun is yellow. Here we go. There and back again."), which RULER's
"noise" haystack also uses. Keys are pronounceable pseudo-words of two
consonant-vowel syllables ("bako"); RULER draws English words, pseudo-words
keep every key distinct without shipping a word list.

Every example is a pure function of (task, length, depth, seed) and the
haystack stream passed in: the key, the values and the filler come from
`np.random.default_rng([seed, length])`, so a depth sweep moves the same
needle through the same haystack. Prompts are exactly `length` tokens; the
answer length is fixed by the task. `depth` in [0, 1] is the fraction of the
haystack (filler bytes) that precedes the first gold needle; needles are
snapped to the nearest sentence boundary (noise, needles) or whitespace
(text), so `Example.needle_depth` is the depth actually realised.

Generators never read the disk: text haystacks come in as a token stream
(`load_haystack` reads the Austen corpus if it is installed and returns
None otherwise, never downloading); a text task without one falls back to
the noise filler and says so in `Example.filler`.

Sections: task specs and the registry (`TASKS`); generators (`generate`,
`task_set`, `load_haystack`); the reference solver; batches and scorers
(`batch_examples`, `exact_match`, `part_recall`, `score_generate`,
`answer_loglik`); training data (`Mixture`, `mixture_batch`); and a task-
model training loop (`train_task_model`, `python -m kvjax.lab.tasks`) until
`kvjax.train.fit` takes a batch function.

Dimension alphabet (`kvjax.config`): B batch, T prompt length (training:
row length - 1; a teacher-forced input, prompt ++ answer[:-1], is T + I - 1
tokens), I answer length (the tokens to generate), V vocab, T' a token
stream's length.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence

from absl import logging
import numpy as np

from kvjax import data

NOISE = (" The grass is green. The sky is blue. The sun is yellow. Here we go."
         " There and back again.")
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = " What is the pass key? The pass key is "
NIAH_NEEDLE = " The magic number for {key} is {value}."
NIAH_QUESTION = (" What is the magic number for {key}? The magic number for "
                 "{key} is ")
NIAH_QUESTION_VALUES = (" What are all the magic numbers for {key}? The magic "
                        "numbers for {key} are ")
NIAH_QUESTION_KEYS = (" What are the magic numbers for {keys}? The magic "
                      "numbers for {keys} are ")
ANSWER_SEPARATOR = ", "
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"

FILLERS = ("noise", "text", "needles", "repeat", "span")
KEY_KINDS = ("word", "number")


# ----------------------------------------------------------------------------
# Task specifications.


@dataclasses.dataclass(frozen=True)
class PasskeySpec:
  """Passkey retrieval: a `digits`-digit number (leading digit non-zero).

  filler: 'noise' (the paper's repeated sentences), 'text', 'repeat'
    (random sentences of pseudo-words, repeated: a training haystack that
    only copying from earlier context predicts) or 'span' (the same with
    a period drawn up to the filler's length: copying at every distance).
  """

  digits: int = 5
  filler: str = "noise"

  def __post_init__(self):
    if not 1 <= self.digits <= 18:
      raise ValueError(f"digits must be in [1, 18], got {self.digits}")
    if self.filler not in ("noise", "text", "repeat", "span"):
      raise ValueError(f"filler={self.filler!r} is not 'noise', 'text', "
                       "'repeat' or 'span'")

  @property
  def answer_length(self) -> int:
    return self.digits


@dataclasses.dataclass(frozen=True)
class NiahSpec:
  """RULER needle in a haystack.

  num_keys: keys with needles (RULER num_needle_k); all but the queried
    ones are distractors.
  num_values: needles (values) per key (RULER num_needle_v).
  num_queries: keys asked for (RULER num_needle_q), <= num_keys.
  key_kind: 'word' (4-letter pseudo-word) or 'number' (`key_digits`).
  value_digits: digits of each value (RULER: 7).
  filler: 'noise', 'text' (held-out text; noise when none is given) or
    'needles' (a haystack of distractor needles, RULER's multikey_2).
  """

  num_keys: int = 1
  num_values: int = 1
  num_queries: int = 1
  key_kind: str = "word"
  key_digits: int = 6
  value_digits: int = 7
  filler: str = "noise"

  def __post_init__(self):
    for name in ("num_keys", "num_values", "num_queries", "key_digits",
                 "value_digits"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.num_queries > self.num_keys:
      raise ValueError(f"num_queries={self.num_queries} exceeds "
                       f"num_keys={self.num_keys}")
    if self.num_values > 1 and self.num_queries > 1:
      raise ValueError("num_values > 1 with num_queries > 1 has no RULER "
                       "family; choose one")
    if self.key_kind not in KEY_KINDS:
      raise ValueError(f"key_kind={self.key_kind!r} is not one of {KEY_KINDS}")
    if self.filler not in FILLERS:
      raise ValueError(f"filler={self.filler!r} is not one of {FILLERS}")
    if self.value_digits > 18:
      raise ValueError(f"value_digits must be <= 18, got {self.value_digits}")

  @property
  def answer_parts(self) -> int:
    return self.num_values * self.num_queries

  @property
  def answer_length(self) -> int:
    n = self.answer_parts
    return n * self.value_digits + (n - 1) * len(ANSWER_SEPARATOR)

  @property
  def key_length(self) -> int:
    return 4 if self.key_kind == "word" else self.key_digits


@dataclasses.dataclass(frozen=True)
class MqarSpec:
  """Multi-query associative recall over byte keys and values.

  Pairs ' {key}={value}' (key: `key_length` lowercase letters, distinct;
  value: `value_digits` digits, repeats allowed) fill the context, as many
  as fit and at most one per key (spaces before them pad the prompt to its
  length); a newline
  starts the queries: `num_queries - 1` answered ones (' {key}={value}',
  the Zoology setting, a training signal at every answer) and a last one
  (' {key}=') whose value is the answer. Queried keys are distinct.
  `separator` is the '=' between key and value; '' puts the value right
  after its key (' {key}{value}', Zoology's adjacent key and value tokens:
  one induction step finds it, where '=' puts it two tokens after the key).
  `query_marker` is the newline before the queries; '' leaves it out
  (Zoology's prompts have no such token, and models trained with it park
  their second layer's attention on it: WORKSPACE.md "Long-context tasks").
  """

  key_length: int = 3
  value_digits: int = 3
  num_queries: int = 4
  separator: str = "="
  query_marker: str = "\n"

  def __post_init__(self):
    if not 1 <= self.key_length <= 6:
      raise ValueError(f"key_length must be in [1, 6], got {self.key_length}")
    if not 1 <= self.value_digits <= 18:
      raise ValueError(f"value_digits must be in [1, 18], got "
                       f"{self.value_digits}")
    if self.num_queries < 1:
      raise ValueError(f"num_queries must be >= 1, got {self.num_queries}")
    if self.separator not in ("=", ""):
      raise ValueError(f"separator must be '=' or '', got "
                       f"{self.separator!r}")
    if self.query_marker not in ("\n", ""):
      raise ValueError(f"query_marker must be '\\n' or '', got "
                       f"{self.query_marker!r}")

  @property
  def answer_length(self) -> int:
    return self.value_digits

  @property
  def query_length(self) -> int:
    """Bytes of ' {key}{separator}', a pair without its value."""
    return 1 + self.key_length + len(self.separator)

  @property
  def pair_length(self) -> int:
    return self.query_length + self.value_digits

  @property
  def num_keys(self) -> int:
    """Distinct keys of `key_length` lowercase letters."""
    return 26 ** self.key_length

  def num_pairs(self, length: int) -> int:
    """Pairs in a prompt of `length` tokens: as many as fit, at most one per
    distinct key (the rest of the prompt is the leading spaces)."""
    return min((length - self._fixed) // self.pair_length, self.num_keys)

  @property
  def _fixed(self) -> int:
    # BOS, query_marker (the newline), the answered queries, the last query.
    return (1 + len(self.query_marker) +
            (self.num_queries - 1) * self.pair_length + self.query_length)


TaskSpec = PasskeySpec | NiahSpec | MqarSpec

# RULER's families (synthetic.yaml), with the haystack named by kind: 'noise'
# is RULER's noise, 'text' its essay haystack (Austen here), 'needles' its
# needle haystack. Word keys, number values throughout (RULER's uuid variants
# are left out: 36-byte values dwarf a 256-byte context).
TASKS: dict[str, TaskSpec] = {
    "passkey": PasskeySpec(),
    "passkey_repeat": PasskeySpec(filler="repeat"),  # a training haystack
    "passkey_span": PasskeySpec(filler="span"),  # copying at long range
    "niah_single": NiahSpec(),  # niah_single_1
    "niah_single_span": NiahSpec(filler="span"),  # a training haystack
    "niah_single_text": NiahSpec(filler="text"),  # niah_single_2
    "niah_multikey": NiahSpec(num_keys=4, filler="text"),  # niah_multikey_1
    "niah_multikey_needles": NiahSpec(filler="needles"),  # niah_multikey_2
    "niah_multivalue": NiahSpec(num_values=4, filler="text"),
    "niah_multiquery": NiahSpec(num_keys=4, num_queries=4, filler="text"),
    "mqar": MqarSpec(),
    # A training variant: Zoology's dense objective, most keys queried and
    # every answered query supervised (12 per row against mqar's 4).
    "mqar_dense": MqarSpec(num_queries=12),
    # Zoology's exact setting: one-token keys (a letter) and values (a
    # digit), so recall is one induction step rather than matching a
    # three-byte key; at most 26 pairs a prompt, spaces before them.
    "mqar1": MqarSpec(key_length=1, value_digits=1),
    "mqar1_dense": MqarSpec(key_length=1, value_digits=1, num_queries=12),
    # Zoology's token order too: the value right after its key (' k1').
    "mqar1_adjacent": MqarSpec(key_length=1, value_digits=1, separator=""),
    "mqar1_adjacent_dense": MqarSpec(key_length=1, value_digits=1,
                                     num_queries=12, separator=""),
    # And no newline before the queries: nothing fixed to park attention on.
    "mqar1_flat": MqarSpec(key_length=1, value_digits=1, separator="",
                           query_marker=""),
}


def get_task(task: str | TaskSpec) -> TaskSpec:
  """The spec of a registered task name (a spec passes through).

  Raises:
    ValueError: an unknown name (the message lists the known ones).
  """
  if isinstance(task, (PasskeySpec, NiahSpec, MqarSpec)):
    return task
  if task not in TASKS:
    raise ValueError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
  return TASKS[task]


def task_name(task: str | TaskSpec) -> str:
  """The registered name of a task (its repr for an unregistered spec)."""
  if isinstance(task, str):
    get_task(task)
    return task
  for name, spec in TASKS.items():
    if spec == task:
      return name
  return repr(task)


# ----------------------------------------------------------------------------
# Examples.


@dataclasses.dataclass(frozen=True, eq=False)
class Example:
  """One prompt and its answer.

  tokens: int32 [T] BOS, context, question; exactly the requested length.
  answer: int32 [I] the answer bytes the model must produce next (no EOS).
  needles: int32 [needles, 2] [start, end) of each needle in `tokens` (passkey:
    the pass-key sentences; NIAH: every needle, distractors included; MQAR:
    every key=value pair of the context).
  values: int32 [needles, 2] [start, end) of each needle's value bytes.
  gold: bool [needles] the needles whose values make up the answer.
  prompt_targets: bool [T] prompt positions that are answers too (MQAR's
    answered queries): training targets, never scored.
  depth: the requested depth of the first gold needle.
  anchor: row of `needles` placed at `depth` (a gold needle).
  context: [start, end) of the haystack + needles in `tokens`.
  filler: the haystack actually used ('noise', 'text', 'needles', 'repeat',
    'span', 'pairs').
  """

  task: str
  tokens: np.ndarray
  answer: np.ndarray
  needles: np.ndarray
  values: np.ndarray
  gold: np.ndarray
  prompt_targets: np.ndarray
  depth: float
  anchor: int
  context: tuple[int, int]
  filler: str
  seed: int

  @property
  def length(self) -> int:
    return int(self.tokens.shape[0])

  @property
  def needle_depth(self) -> float:
    """Realised depth: the share of the haystack (context without needles)
    before the anchor needle (0 at the start, 1 at the end); MQAR, whose
    context is all pairs: anchor / (pairs - 1)."""
    if self.filler == "pairs":
      return self.anchor / max(self.needles.shape[0] - 1, 1)
    start, end = self.context
    g = self.anchor
    first = self.needles[g, 0]
    before = self.needles[:, 1] <= first
    before[g] = False
    needle_bytes = int(np.sum(self.needles[:, 1] - self.needles[:, 0]))
    haystack = (end - start) - needle_bytes
    preceding = (first - start) - int(
        np.sum(self.needles[before, 1] - self.needles[before, 0]))
    return preceding / haystack if haystack > 0 else 0.0

  def text(self) -> str:
    return data.decode(self.tokens)


def _make_example(task, tokens, answer, needles, values, gold, anchor,
                  prompt_targets, depth, context, filler, seed) -> Example:
  return Example(task=task, tokens=np.asarray(tokens, np.int32),
                 answer=np.asarray(answer, np.int32),
                 needles=np.asarray(needles, np.int32).reshape(-1, 2),
                 values=np.asarray(values, np.int32).reshape(-1, 2),
                 gold=np.asarray(gold, bool),
                 prompt_targets=np.asarray(prompt_targets, bool),
                 depth=float(depth), anchor=int(anchor),
                 context=tuple(int(c) for c in context), filler=filler,
                 seed=int(seed))


def _number(rng, digits: int) -> str:
  return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def _distinct_numbers(rng, n: int, digits: int) -> list[str]:
  lo, hi = 10 ** (digits - 1), 10 ** digits
  if hi - lo < n:
    raise ValueError(f"cannot draw {n} distinct {digits}-digit numbers")
  out: set[int] = set()
  picked = []
  while len(picked) < n:
    x = int(rng.integers(lo, hi))
    if x not in out:
      out.add(x)
      picked.append(str(x))
  return picked


def _pseudo_words(rng, n: int, exclude: Sequence[str] = ()) -> list[str]:
  syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
  space = len(syllables) ** 2
  if n > space - len(exclude):
    raise ValueError(f"cannot draw {n} distinct pseudo-words")
  ex = set(exclude)
  words: list[str] = []
  seen = set(ex)
  while len(words) < n:
    i, j = rng.integers(0, len(syllables), size=2)
    w = syllables[i] + syllables[j]
    if w not in seen:
      seen.add(w)
      words.append(w)
  return words


def _keys(rng, spec: NiahSpec, n: int, exclude: Sequence[str] = ()):
  if spec.key_kind == "word":
    return _pseudo_words(rng, n, exclude)
  ex = set(exclude)
  keys: list[str] = []
  while len(keys) < n:
    k = _number(rng, spec.key_digits)
    if k not in ex:
      ex.add(k)
      keys.append(k)
  return keys


def _bytes(s: str) -> np.ndarray:
  return np.frombuffer(s.encode("utf-8"), np.uint8).astype(np.int32)


def _boundaries(filler: np.ndarray, kind: str) -> np.ndarray:
  """Positions in the filler where a needle (which starts with a space and
  ends with '.') may go: sentence starts (noise, needles) or before
  whitespace (text); always 0 and n. Fillers start with whitespace and end
  at a sentence's or word's end (`_padded`), so 0 and n are clean too."""
  n = filler.shape[0]
  if kind in ("noise", "needles", "repeat", "span"):
    # Before ' The' that follows '.', and at 0.
    inner = np.flatnonzero((filler[1:] == ord(" ")) &
                           (filler[:-1] == ord("."))) + 1
  else:
    inner = np.flatnonzero((filler == ord(" ")) | (filler == ord("\n")))
  return np.unique(np.concatenate([[0, n], inner]))


def _snap(boundaries: np.ndarray, target: float) -> int:
  return int(boundaries[np.argmin(np.abs(boundaries - target))])


def _padded(parts: list[np.ndarray], n: int) -> np.ndarray:
  """Whole pieces that fit in n bytes, after as many spaces as are left:
  no sentence or word is cut, and the filler is exactly n bytes."""
  kept, size = [], 0
  for p in parts:
    if size + p.shape[0] > n:
      break
    kept.append(p)
    size += p.shape[0]
  return np.concatenate([np.full((n - size,), ord(" "), np.int32)] + kept)


def _noise_filler(rng, n: int) -> np.ndarray:
  """Mohtashami & Jaggi's sentences in order, from a random one."""
  sentences = [_bytes(" " + x.strip() + ".") for x in NOISE.split(".")
               if x.strip()]
  first = int(rng.integers(len(sentences)))
  count = n // min(len(x) for x in sentences) + 1
  return _padded([sentences[(first + i) % len(sentences)]
                  for i in range(count)], n)


def _repeat_filler(rng, n: int, exclude: Sequence[str] = ()) -> np.ndarray:
  """2-4 random sentences of 2-4 pseudo-words, repeated in order as the noise
  filler's: past the first round every byte is predictable by copying from
  earlier context (induction), and by nothing else."""
  words = _pseudo_words(rng, 16, exclude)
  sentences = [_bytes(" " + " ".join(
      words[int(i)] for i in rng.integers(0, 16, size=int(rng.integers(2, 5))))
      + ".") for _ in range(int(rng.integers(2, 5)))]
  count = n // min(len(x) for x in sentences) + 1
  return _padded([sentences[i % len(sentences)] for i in range(count)], n)


def _span_filler(rng, n: int, exclude: Sequence[str] = ()) -> np.ndarray:
  """Random sentences of pseudo-words filling a period p drawn uniformly in
  [min(16, n), n] bytes, repeated in order to n bytes. Past the first
  period every byte is predictable by copying from about p bytes back, and
  by nothing else: where `_repeat_filler`'s short rounds train copying over
  a few dozen bytes, p spans the whole filler, so copying is trained at
  every distance the context holds (what retrieving a far needle needs)."""
  if n <= 0:
    return np.zeros((0,), np.int32)
  words = _pseudo_words(rng, 32, exclude)
  period = int(rng.integers(min(16, n), n + 1))
  sentences, size = [], 0
  while size < period:
    count = int(rng.integers(2, 5))
    sentences.append(_bytes(" " + " ".join(
        words[int(i)] for i in rng.integers(0, 32, size=count)) + "."))
    size += sentences[-1].shape[0]
  count = n // min(len(x) for x in sentences) + 1
  return _padded([sentences[i % len(sentences)] for i in range(count)], n)


def _text_filler(rng, n: int, haystack: np.ndarray) -> np.ndarray:
  """A window of the stream that starts at whitespace and ends at a word's
  end (the last whitespace and what follows it dropped)."""
  if n == 0:
    return np.zeros((0,), np.int32)
  if haystack.shape[0] < 2 * n:
    raise ValueError(f"the haystack stream holds {haystack.shape[0]} bytes; "
                     f"this length needs at least {2 * n}")
  start = int(rng.integers(0, haystack.shape[0] - 2 * n + 1))
  window = np.asarray(haystack[start:start + 2 * n], np.int32)
  if window.min() < 0 or window.max() >= data.BYTE_VOCAB:
    raise ValueError("the haystack holds non-byte tokens (BOS/EOS/PAD); "
                     "drop them first, as `load_haystack` does")
  space = np.flatnonzero((window == ord(" ")) | (window == ord("\n")))
  if space.size < 2 or space[0] >= n:
    return window[:n]  # no whitespace to align to: a raw window
  window = window[space[0]:space[0] + n]
  ends = np.flatnonzero((window == ord(" ")) | (window == ord("\n")))
  cut = int(ends[-1]) if ends[-1] > 0 else n
  return _padded([window[:cut]], n)


def _needle_filler(rng, n: int, spec: NiahSpec, exclude: Sequence[str]):
  """A haystack of whole distractor needles with fresh keys."""
  out, size, used = [], 0, list(exclude)
  while size < n:
    key = _keys(rng, spec, 1, used)[0]
    used.append(key)
    s = _bytes(NIAH_NEEDLE.format(key=key,
                                  value=_number(rng, spec.value_digits)))
    out.append(s)
    size += s.shape[0]
  return _padded(out, n)


def _filler(rng, n: int, kind: str, haystack, spec, exclude=()):
  """(filler bytes int32 [n], the kind actually used)."""
  if kind == "text" and haystack is None:
    kind = "noise"
  if kind == "noise":
    return _noise_filler(rng, n), kind
  if kind == "repeat":
    return _repeat_filler(rng, n, exclude), kind
  if kind == "span":
    return _span_filler(rng, n, exclude), kind
  if kind == "text":
    return _text_filler(rng, n, haystack), kind
  return _needle_filler(rng, n, spec, exclude), kind


def _check_length(task: str, length: int, minimum: int):
  if not isinstance(length, (int, np.integer)) or isinstance(length, bool):
    raise ValueError(f"length must be an int, got {length!r}")
  if length < minimum:
    raise ValueError(f"length={length} is below the minimum {minimum} of "
                     f"task {task!r}")


def _check_depth(depth: float):
  if not (isinstance(depth, (int, float, np.floating, np.integer)) and
          0.0 <= float(depth) <= 1.0):
    raise ValueError(f"depth must be in [0, 1], got {depth!r}")


def _check_seed(seed: int):
  if not isinstance(seed, (int, np.integer)) or seed < 0:
    raise ValueError(f"seed must be an int >= 0, got {seed!r}")


def _splice(name, filler, needles_text, gold_flags, depths, kind, question,
            answer, depth, seed, value_offsets):
  """Inserts the needles at their depths into the filler, after BOS and
  before the question. `value_offsets[i]` is (start, end) of needle i's value
  inside its text. Needle 0 is the gold one placed at `depth`."""
  bounds = _boundaries(filler, kind)
  n = filler.shape[0]
  points = [_snap(bounds, d * n) for d in depths]
  order = sorted(range(len(needles_text)), key=lambda i: (points[i], i))
  parts = [np.array([data.BOS], np.int32)]
  spans, vspans = [None] * len(order), [None] * len(order)
  pos, prev = 1, 0
  for i in order:
    chunk = filler[prev:points[i]]
    parts.append(chunk)
    pos += chunk.shape[0]
    prev = points[i]
    t = needles_text[i]
    spans[i] = (pos, pos + t.shape[0])
    vspans[i] = (pos + value_offsets[i][0], pos + value_offsets[i][1])
    parts.append(t)
    pos += t.shape[0]
  parts.append(filler[prev:])
  context_end = pos + (n - prev)
  parts.append(question)
  tokens = np.concatenate(parts)
  # Rows of needles/values follow the order of the needles in the prompt.
  needles = np.array([spans[i] for i in order], np.int32)
  values = np.array([vspans[i] for i in order], np.int32)
  gold = np.array([gold_flags[i] for i in order], bool)
  return _make_example(name, tokens, answer, needles, values, gold,
                       order.index(0), np.zeros(tokens.shape, bool), depth,
                       (1, context_end), kind, seed)


def min_length(task: str | TaskSpec) -> int:
  """The shortest prompt a task can be generated at (the longest keys and
  needles it may draw, no filler)."""
  spec = get_task(task)
  if isinstance(spec, PasskeySpec):
    key = "9" * spec.digits
    return (1 + len(PASSKEY_NEEDLE.format(key=key)) + len(PASSKEY_QUESTION))
  if isinstance(spec, MqarSpec):
    return spec._fixed + spec.num_queries * spec.pair_length  # pylint: disable=protected-access
  key = "k" * spec.key_length
  needle = len(NIAH_NEEDLE.format(key=key, value="9" * spec.value_digits))
  return (1 + spec.num_keys * spec.num_values * needle +
          len(_niah_question(spec, [key] * spec.num_queries)))


def _niah_question(spec: NiahSpec, keys: Sequence[str]) -> str:
  if spec.num_values > 1:
    return NIAH_QUESTION_VALUES.format(key=keys[0])
  if spec.num_queries > 1:
    joined = ", ".join(keys[:-1]) + " and " + keys[-1]
    return NIAH_QUESTION_KEYS.format(keys=joined)
  return NIAH_QUESTION.format(key=keys[0])


def generate(task: str | TaskSpec, length: int, depth: float, seed: int,
             haystack: np.ndarray | None = None) -> Example:
  """One example of `task`, exactly `length` tokens long.

  Args:
    task: a name in `TASKS` or a spec.
    length: T, prompt tokens (BOS through the question's last byte).
    depth: in [0, 1], where the first gold needle goes (fraction of the
      haystack before it); MQAR: which pair is queried last (pair
      round(depth * (num_pairs - 1))).
    seed: >= 0; with `length` it fixes keys, values and filler.
    haystack: int token stream of bytes (< 256, e.g. `load_haystack`) for
      'text' fillers; None falls back to the noise filler (recorded in
      `Example.filler`).

  Raises:
    ValueError: unknown task, length below `min_length`, depth outside
      [0, 1], a negative seed; each names the field.
  """
  spec = get_task(task)
  name = task_name(task)
  _check_length(name, length, min_length(spec))
  _check_depth(depth)
  _check_seed(seed)
  rng = np.random.default_rng([int(seed), int(length)])
  if isinstance(spec, PasskeySpec):
    return _passkey(name, spec, length, depth, seed, rng, haystack)
  if isinstance(spec, NiahSpec):
    return _niah(name, spec, length, depth, seed, rng, haystack)
  return _mqar(name, spec, length, depth, seed, rng)


def _passkey(name, spec, length, depth, seed, rng, haystack):
  key = _number(rng, spec.digits)
  needle_s = PASSKEY_NEEDLE.format(key=key)
  needle = _bytes(needle_s)
  question = _bytes(PASSKEY_QUESTION)
  n = length - 1 - needle.shape[0] - question.shape[0]
  filler, kind = _filler(rng, n, spec.filler, haystack, spec)
  v0 = needle_s.index(key)
  return _splice(name, filler, [needle], [True], [depth], kind, question,
                 _bytes(key), depth, seed, [(v0, v0 + len(key))])


def _niah(name, spec, length, depth, seed, rng, haystack):
  keys = _keys(rng, spec, spec.num_keys)
  values = [_distinct_numbers(rng, spec.num_values, spec.value_digits)
            for _ in keys]
  queried = keys[:spec.num_queries]
  texts, golds, offsets, key_of = [], [], [], []
  for k, key in enumerate(keys):
    for value in values[k]:
      s = NIAH_NEEDLE.format(key=key, value=value)
      texts.append(_bytes(s))
      golds.append(k < spec.num_queries)
      v0 = s.rindex(value)
      offsets.append((v0, v0 + len(value)))
      key_of.append(k)
  # The first gold needle at `depth`, every other needle at a random one.
  depths = [depth] + list(rng.uniform(0.0, 1.0, size=len(texts) - 1))
  question = _bytes(_niah_question(spec, queried))
  n = length - 1 - sum(t.shape[0] for t in texts) - question.shape[0]
  filler, kind = _filler(rng, n, spec.filler, haystack, spec, exclude=keys)
  ex = _splice(name, filler, texts, golds, depths, kind, question,
               np.zeros((0,), np.int32), depth, seed, offsets)
  # The answer: multi-value in the order the needles appear, otherwise in
  # the order the keys are asked.
  if spec.num_values > 1:
    parts = [ex.tokens[a:b] for (a, b), g in zip(ex.values, ex.gold) if g]
  else:
    parts = [_bytes(values[k][0]) for k in range(spec.num_queries)]
  sep = _bytes(ANSWER_SEPARATOR)
  answer = np.concatenate(
      [p for i, part in enumerate(parts)
       for p in ((sep, part) if i else (part,))])
  return dataclasses.replace(ex, answer=answer.astype(np.int32))


def _mqar(name, spec, length, depth, seed, rng):
  d = spec.num_pairs(length)
  pad = length - spec._fixed - d * spec.pair_length  # pylint: disable=protected-access
  letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
  codes = rng.choice(spec.num_keys, size=d, replace=False)
  keys = [bytes(letters[(c // 26 ** np.arange(spec.key_length)) % 26])
          .decode() for c in codes]
  # Zero-padded values keep every value `value_digits` long.
  values = [str(int(rng.integers(0, 10 ** spec.value_digits))).zfill(
      spec.value_digits) for _ in range(d)]
  target = int(round(float(depth) * (d - 1)))
  others = [i for i in range(d) if i != target]
  asked = list(rng.choice(others, size=spec.num_queries - 1, replace=False))
  parts = [np.array([data.BOS], np.int32), _bytes(" " * pad)]
  needles, vals = [], []
  pos = 1 + pad
  for k, v in zip(keys, values):
    s = f" {k}{spec.separator}{v}"
    needles.append((pos, pos + len(s)))
    vals.append((pos + len(s) - len(v), pos + len(s)))
    parts.append(_bytes(s))
    pos += len(s)
  context_end = pos
  parts.append(_bytes(spec.query_marker))
  pos += len(spec.query_marker)
  supervised = []
  for i in asked:
    s = f" {keys[i]}{spec.separator}{values[i]}"
    supervised.append((pos + len(s) - spec.value_digits, pos + len(s)))
    parts.append(_bytes(s))
    pos += len(s)
  parts.append(_bytes(f" {keys[target]}{spec.separator}"))
  tokens = np.concatenate(parts)
  prompt_targets = np.zeros(tokens.shape, bool)
  for a, b in supervised:
    prompt_targets[a:b] = True
  gold = np.zeros((d,), bool)
  gold[target] = True
  return _make_example(name, tokens, _bytes(values[target]), needles, vals,
                       gold, target, prompt_targets, depth,
                       (1, context_end), "pairs", seed)


def task_set(task: str | TaskSpec, lengths: Sequence[int],
             depths: Sequence[float], samples: int, seed: int = 0,
             haystack: np.ndarray | None = None) -> list[Example]:
  """The grid lengths × depths × samples; sample i has seed `seed + i`, so
  every (length, depth) cell holds the same keys at a different depth."""
  if samples < 1:
    raise ValueError(f"samples must be >= 1, got {samples}")
  if not lengths or not depths:
    raise ValueError("lengths and depths must be non-empty")
  return [generate(task, int(n), float(d), seed + i, haystack)
          for n in lengths for d in depths for i in range(samples)]


def load_haystack(split: str = "validation",
                  data_dir: str | None = None) -> np.ndarray | None:
  """The Austen corpus's bytes for text haystacks, or None when the corpus
  (or `rdata`) is not installed: nothing is downloaded here.

  Args:
    split: 'validation' (the held-out novel: evaluation) or 'train'.
  Returns:
    int32 [T'] byte tokens (BOS/EOS dropped), or None.
  """
  if split not in ("train", "validation"):
    raise ValueError(f"split={split!r} is not 'train' or 'validation'")
  try:
    streams = data.austen_streams(data_dir)
  except (data.CorpusNotFoundError, ImportError) as e:
    logging.warning("no Austen corpus (%s); text haystacks fall back to the "
                    "noise filler", str(e).splitlines()[0])
    return None
  stream = getattr(streams, split)
  return stream[stream < data.BYTE_VOCAB].astype(np.int32)


# ----------------------------------------------------------------------------
# The reference solver: the answer from the prompt alone, by string matching.


def reference_answer(task: str | TaskSpec, tokens) -> np.ndarray:
  """What a perfect reader answers, parsed from the prompt's bytes only.

  It knows the formats (module docstring), not the generator's state: it
  finds the key(s) asked in the question and reads the matching needle(s)
  in the context. Tests use it to check that every answer is recoverable
  from the tokens.

  Returns:
    int32 [I] answer bytes.
  Raises:
    ValueError: the prompt does not hold a parseable question or needle.
  """
  spec = get_task(task)
  text = data.decode(tokens)
  if isinstance(spec, PasskeySpec):
    m = re.search(r"The pass key is (\d+)\. Remember it\.", text)
    if not m:
      raise ValueError("no pass key sentence in the prompt")
    return _bytes(m.group(1))
  if isinstance(spec, MqarSpec):
    # The final query's key is asked nowhere else: its one pair is in the
    # context, with or without the newline before the questions.
    m = re.search(rf" ([a-z]+){spec.separator}$", text)
    if not m:
      raise ValueError("no final query in the prompt")
    found = re.findall(rf" {m.group(1)}{spec.separator}(\d+)",
                       text[:m.start()])
    if len(found) != 1:
      raise ValueError(f"key {m.group(1)!r} appears {len(found)} times")
    return _bytes(found[0])
  m = re.search(r"What (?:is|are(?: all)?) the magic numbers? for (.+?)\? "
                r"The magic", text)
  if not m:
    raise ValueError("no question in the prompt")
  context = text[:m.start()]
  asked = re.split(r", | and ", m.group(1))
  parts = []
  for key in asked:
    found = re.findall(rf"The magic number for {re.escape(key)} is (\d+)\.",
                       context)
    if not found:
      raise ValueError(f"no needle for key {key!r}")
    parts.extend(found)
  return _bytes(ANSWER_SEPARATOR.join(parts))


# ----------------------------------------------------------------------------
# Batches for inference and the scorers.


@dataclasses.dataclass(frozen=True, eq=False)
class TaskBatch:
  """Examples stacked for `kvjax.generate` (left padding).

  tokens: int32 [B, T] prompts, left-padded with PAD to the longest.
  attention_mask: int32 [B, T] 1 on prompt tokens, 0 on padding.
  answers: int32 [B, I] answers, right-padded with PAD to the longest.
  answer_mask: bool [B, I] True on answer bytes.
  needle_starts: int32 [B] where the first gold needle starts in `tokens`
    (padding included).
  lengths, depths, needle_depths: [B] per example.
  """

  tokens: np.ndarray
  attention_mask: np.ndarray
  answers: np.ndarray
  answer_mask: np.ndarray
  needle_starts: np.ndarray
  lengths: np.ndarray
  depths: np.ndarray
  needle_depths: np.ndarray
  examples: tuple[Example, ...]

  @property
  def answer_length(self) -> int:
    return int(self.answers.shape[1])


def batch_examples(examples: Sequence[Example],
                   pad_to: int | None = None) -> TaskBatch:
  """Stacks examples: prompts left-padded (PAD, mask 0) to the longest (or
  `pad_to`), answers right-padded (PAD, answer_mask False)."""
  if not examples:
    raise ValueError("no examples to batch")
  T = max(e.length for e in examples)
  if pad_to is not None:
    if pad_to < T:
      raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt "
                       f"({T})")
    T = pad_to
  I = max(e.answer.shape[0] for e in examples)
  B = len(examples)
  tokens = np.full((B, T), data.PAD, np.int32)
  mask = np.zeros((B, T), np.int32)
  answers = np.full((B, I), data.PAD, np.int32)
  amask = np.zeros((B, I), bool)
  starts = np.zeros((B,), np.int32)
  for b, e in enumerate(examples):
    pad = T - e.length
    tokens[b, pad:] = e.tokens
    mask[b, pad:] = 1
    answers[b, :e.answer.shape[0]] = e.answer
    amask[b, :e.answer.shape[0]] = True
    starts[b] = pad + e.needles[e.anchor, 0]
  return TaskBatch(
      tokens=tokens, attention_mask=mask, answers=answers, answer_mask=amask,
      needle_starts=starts,
      lengths=np.array([e.length for e in examples], np.int32),
      depths=np.array([e.depth for e in examples], np.float64),
      needle_depths=np.array([e.needle_depth for e in examples], np.float64),
      examples=tuple(examples))


def exact_match(predicted, answers, answer_mask=None) -> np.ndarray:
  """1.0 where a prediction starts with the whole answer, else 0.0.

  Args:
    predicted: int [B, >= I] generated ids (at least the answers; what comes
      after the answer is ignored, so a model may go on talking).
    answers: int [B, I] answers (right-padded).
    answer_mask: bool [B, I], True on answer bytes (default: all True).
  Returns:
    float64 [B]: row b is 1.0 iff predicted[b, i] == answers[b, i] for every
    i with answer_mask[b, i]; a prediction shorter than its answer scores 0.
  """
  predicted, answers = np.asarray(predicted), np.asarray(answers)
  if predicted.ndim != 2 or answers.ndim != 2:
    raise ValueError(f"predicted and answers must be [B, *], got "
                     f"{predicted.shape} and {answers.shape}")
  if predicted.shape[0] != answers.shape[0]:
    raise ValueError(f"batch mismatch: predicted {predicted.shape[0]} rows, "
                     f"answers {answers.shape[0]}")
  mask = (np.ones(answers.shape, bool) if answer_mask is None
          else np.asarray(answer_mask, bool))
  I = answers.shape[1]
  if predicted.shape[1] < I:
    short = np.full((predicted.shape[0], I - predicted.shape[1]), -1)
    predicted = np.concatenate([predicted, short], axis=1)
  same = (predicted[:, :I] == answers) | ~mask
  return same.all(axis=1).astype(np.float64)


def part_recall(predicted, examples: Sequence[Example]) -> np.ndarray:
  """RULER's string_match_all: the share of the answer's parts (the values
  joined by ', ') that occur anywhere in the decoded prediction.

  Returns:
    float64 [B] in [0, 1]; 1.0 for every exact match.
  """
  predicted = np.asarray(predicted)
  out = np.zeros((len(examples),), np.float64)
  for b, e in enumerate(examples):
    text = data.decode(predicted[b])
    parts = data.decode(e.answer).split(ANSWER_SEPARATOR)
    out[b] = np.mean([p in text for p in parts])
  return out


GenerateFn = Callable[[np.ndarray, np.ndarray, int], np.ndarray]
LogitsFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


def score_generate(generate_fn: GenerateFn, batch: TaskBatch) -> dict:
  """Greedy exact match of a model's answers.

  Args:
    generate_fn: (tokens int32 [B, T], attention_mask int32 [B, T],
      max_new_tokens I) -> generated ids [B, >= I]; e.g. a closure over
      `kvjax.generate` with a cache policy (`kvjax.lab.task_eval`).
    batch: from `batch_examples`.
  Returns:
    {'predicted': int32 [B, I], 'exact': float [B] (`exact_match`),
     'recall': float [B] (`part_recall`)}.
  """
  out = np.asarray(generate_fn(batch.tokens, batch.attention_mask,
                               batch.answer_length))
  if out.ndim != 2 or out.shape[0] != batch.tokens.shape[0]:
    raise ValueError(f"generate_fn returned shape {out.shape}, expected "
                     f"[{batch.tokens.shape[0]}, >= {batch.answer_length}]")
  return {"predicted": out[:, :batch.answer_length].astype(np.int32),
          "exact": exact_match(out, batch.answers, batch.answer_mask),
          "recall": part_recall(out, batch.examples)}


def teacher_forced_inputs(batch: TaskBatch):
  """Prompt ++ answer[:-1] per row, left-padded, and where each answer
  byte is predicted.

  Returns:
    (tokens int32 [B, T], attention_mask int32 [B, T], index int32 [B, I]):
    logits[b, index[b, i]] predict answers[b, i] (index is 0 where
    answer_mask is False).
  """
  rows = [np.concatenate([e.tokens, e.answer[:-1]]) for e in batch.examples]
  T = max(r.shape[0] for r in rows)
  B, I = batch.answers.shape
  tokens = np.full((B, T), data.PAD, np.int32)
  mask = np.zeros((B, T), np.int32)
  index = np.zeros((B, I), np.int32)
  for b, (r, e) in enumerate(zip(rows, batch.examples)):
    pad = T - r.shape[0]
    tokens[b, pad:] = r
    mask[b, pad:] = 1
    a = e.answer.shape[0]
    index[b, :a] = pad + e.length - 1 + np.arange(a)
  return tokens, mask, index


def answer_loglik(logits_fn: LogitsFn, batch: TaskBatch) -> dict:
  """Teacher-forced answer log-likelihood: cheap, and graded where exact
  match is all-or-nothing (a random model scores ~ -I·ln V, not just 0).

  The model reads the prompt followed by the true answer's bytes; at each
  answer byte i it is scored on log p(answer_i | prompt, answer_<i).

  Args:
    logits_fn: (tokens int32 [B, T], attention_mask int32 [B, T]) -> logits
      [B, T, V] (left padding), e.g. `kvjax.forward` or a cache-policy
      prefill with all_logits (`kvjax.lab.task_eval`).
    batch: from `batch_examples`.
  Returns:
    {'loglik': float [B] summed nats over the answer bytes,
     'loglik_per_byte': float [B] (loglik / row b's answer length),
     'token_accuracy': float [B] share of answer bytes that are the argmax,
     'argmax_exact': float [B] 1.0 iff every answer byte is the argmax (the
       teacher-forced counterpart of `exact_match`; it equals greedy exact
       match whenever the greedy answer is right)}.
  """
  tokens, mask, index = teacher_forced_inputs(batch)
  logits = np.asarray(logits_fn(tokens, mask), np.float64)
  B = tokens.shape[0]
  if logits.shape[:2] != tokens.shape:
    raise ValueError(f"logits_fn returned shape {logits.shape}, expected "
                     f"[{B}, {tokens.shape[1]}, V]")
  picked = logits[np.arange(B)[:, None], index]  # [B, I, V]
  top = picked.max(axis=-1, keepdims=True)
  logz = np.log(np.exp(picked - top).sum(axis=-1)) + top[..., 0]
  answers = np.where(batch.answer_mask, batch.answers, 0)
  logp = np.take_along_axis(picked, answers[..., None], axis=-1)[..., 0] - logz
  m = batch.answer_mask
  hit = (picked.argmax(axis=-1) == batch.answers) & m
  count = m.sum(axis=1)
  loglik = np.where(m, logp, 0.0).sum(axis=1)
  return {"loglik": loglik, "loglik_per_byte": loglik / count,
          "token_accuracy": hit.sum(axis=1) / count,
          "argmax_exact": (hit | ~m).all(axis=1).astype(np.float64)}


# ----------------------------------------------------------------------------
# Training data: a mixture of tasks (and optionally plain text).


@dataclasses.dataclass(frozen=True)
class Mixture:
  """What a training batch is made of.

  tasks: (task name, weight) pairs; weights need not sum to 1.
  text_weight: weight of plain language-model rows (windows of the `text`
    stream given to `mixture_batch`; loss on every token).
  seq_len: T; each row is T + 1 tokens, as `kvjax.data.train_batch`'s.
  batch_size: B.
  prompt_loss: also take the loss on every prompt token of a task row
    (plain next-byte prediction over the filler and needles), not only on
    the answers. The repeated filler then rewards copying from earlier
    context (induction), the skill retrieval needs; answer-only loss gives
    I + 1 supervised tokens per row.
  min_seq_len: None: every task row is T + 1 tokens. Else a task row is
    prompt ++ answer ++ EOS of n + 1 tokens, n uniform in [max(min_seq_len,
    the task's shortest), T], right-padded with PAD (no loss) to T + 1. A model
    trained at one prompt length learns where the needle can sit at that
    length and fails at any other (measured: exact match 1.0 at the
    trained length, 0.4 one byte longer); varied lengths force retrieval
    by content, and short rows are where it is learnt first.
  """

  tasks: tuple[tuple[str, float], ...]
  seq_len: int = 256
  batch_size: int = 16
  text_weight: float = 0.0
  prompt_loss: bool = False
  min_seq_len: int | None = None

  def __post_init__(self):
    if not self.tasks and not self.text_weight:
      raise ValueError("a mixture needs tasks or text_weight > 0")
    for name, weight in self.tasks:
      spec = get_task(name)
      if weight < 0:
        raise ValueError(f"weight of task {name!r} must be >= 0, got {weight}")
      prompt = self.seq_len - spec.answer_length
      if prompt < min_length(spec):
        raise ValueError(
            f"seq_len={self.seq_len} leaves {prompt} prompt tokens, below "
            f"the minimum {min_length(spec)} of task {name!r}")
    if self.min_seq_len is not None and not (
        1 <= self.min_seq_len <= self.seq_len):
      raise ValueError(f"min_seq_len={self.min_seq_len} must be in [1, "
                       f"seq_len={self.seq_len}]")
    if self.text_weight < 0:
      raise ValueError(f"text_weight must be >= 0, got {self.text_weight}")
    if self.batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
    if sum(w for _, w in self.tasks) + self.text_weight <= 0:
      raise ValueError("mixture weights sum to 0")


@dataclasses.dataclass(frozen=True, eq=False)
class TrainBatch:
  """inputs int32 [B, T]; targets int32 [B, T], PAD where no loss is taken
  (so `kvjax.train.masked_nll` applies the loss mask); kinds [B] the row's
  task name ('text' for plain rows)."""

  inputs: np.ndarray
  targets: np.ndarray
  kinds: tuple[str, ...]

  @property
  def loss_mask(self) -> np.ndarray:
    return self.targets != data.PAD


def training_row(example: Example, prompt_loss: bool = False
                 ) -> tuple[np.ndarray, np.ndarray]:
  """(inputs [T], targets [T]) of one example: the row is prompt ++ answer
  ++ EOS; the loss is on the answer bytes, the EOS after them and the
  example's `prompt_targets` (MQAR's answered queries), or with
  `prompt_loss` on every token after BOS."""
  row = np.concatenate([example.tokens, example.answer,
                        np.array([data.EOS], np.int32)])
  prompt = (np.ones(example.tokens.shape, bool) if prompt_loss
            else example.prompt_targets)
  supervised = np.concatenate([prompt,
                               np.ones(example.answer.shape[0] + 1, bool)])
  targets = np.where(supervised[1:], row[1:], data.PAD)
  return row[:-1].astype(np.int32), targets.astype(np.int32)


def mixture_batch(mixture: Mixture, *, seed: int, step: int,
                  haystack: np.ndarray | None = None,
                  text: np.ndarray | None = None) -> TrainBatch:
  """The training batch of one step: a pure function of (mixture, seed,
  step, haystack, text), as `kvjax.data.train_batch`, so a resumed run sees
  the batches an uninterrupted one would.

  Each row draws its kind by weight, then a uniform depth in [0, 1] and an
  example seed; a task row's prompt is T - I tokens (I its answer length),
  so prompt, answer and EOS make exactly T + 1 (with `min_seq_len`, a
  length is drawn first and the row is right-padded with PAD).

  Args:
    haystack: byte stream for 'text' fillers (None: noise).
    text: token stream for plain rows (needed iff text_weight > 0).
  Returns:
    TrainBatch with inputs/targets [B, T].
  """
  if seed < 0 or step < 0:
    raise ValueError(f"seed and step must be non-negative, got {seed}, {step}")
  names = [n for n, _ in mixture.tasks] + (["text"] if mixture.text_weight
                                           else [])
  weights = np.array([w for _, w in mixture.tasks] +
                     ([mixture.text_weight] if mixture.text_weight else []),
                     np.float64)
  if mixture.text_weight and text is None:
    raise ValueError("text_weight > 0 needs a text stream")
  rng = np.random.default_rng([int(seed), int(step)])
  T, B = mixture.seq_len, mixture.batch_size
  inputs = np.zeros((B, T), np.int32)
  targets = np.zeros((B, T), np.int32)
  kinds = []
  for b in range(B):
    kind = names[int(rng.choice(len(names), p=weights / weights.sum()))]
    kinds.append(kind)
    if kind == "text":
      start = int(rng.integers(0, text.shape[0] - T))
      window = np.asarray(text[start:start + T + 1], np.int32)
      inputs[b], targets[b] = window[:-1], window[1:]
      continue
    spec = get_task(kind)
    n = T  # the row's length (prompt ++ answer ++ EOS) - 1
    if mixture.min_seq_len is not None:
      shortest = min_length(spec) + spec.answer_length
      n = int(rng.integers(max(mixture.min_seq_len, shortest) - 1, T)) + 1
    ex = generate(kind, n - spec.answer_length, float(rng.uniform()),
                  int(rng.integers(0, 2 ** 31)), haystack)
    inputs[b], targets[b] = data.PAD, data.PAD
    inputs[b, :n], targets[b, :n] = training_row(ex, mixture.prompt_loss)
  return TrainBatch(inputs=inputs, targets=targets, kinds=tuple(kinds))


def mixture_from_dict(d: Mapping) -> Mixture:
  """A Mixture from a config's `tasks` section: {'names': [...], 'weights':
  [...], 'seq_len', 'batch_size', 'text_weight', 'prompt_loss',
  'min_seq_len'}."""
  names, weights = list(d["names"]), list(d["weights"])
  if len(names) != len(weights):
    raise ValueError(f"tasks.names has {len(names)} entries, tasks.weights "
                     f"{len(weights)}")
  min_seq_len = d.get("min_seq_len")
  return Mixture(tasks=tuple(zip(names, (float(w) for w in weights))),
                 seq_len=int(d["seq_len"]), batch_size=int(d["batch_size"]),
                 text_weight=float(d.get("text_weight", 0.0)),
                 prompt_loss=bool(d.get("prompt_loss", False)),
                 min_seq_len=None if min_seq_len is None else int(min_seq_len))


# ----------------------------------------------------------------------------
# Training a task model on a mixture.
#
# `kvjax.train.fit` runs the loop (batches by update index, resume,
# checkpoints, metrics); a task model brings its batch function, a step that
# takes (inputs, targets) with the loss mask in the targets, and its
# evaluation. `kvjax.orbax_checkpoint.restore_params(workdir)` loads a task
# model like any other.

EVAL_SEED_OFFSET = 1_000_003  # evaluation rows come from another seed


def _train_lib():
  # Imported here: training pulls in optax and orbax, which generating and
  # scoring examples never need.
  from kvjax import train  # pylint: disable=g-import-not-at-top
  return train


def _masked_step_fns():
  import functools  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  train = _train_lib()

  @functools.partial(jax.jit, donate_argnums=0)
  def step_fn(state, inputs_BT, targets_BT):
    def loss_fn(params):
      nll, count = train.masked_nll(state.logits_fn(params, inputs_BT),
                                   targets_BT)
      return nll / jnp.maximum(count, 1.0)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    new = state.replace(step=state.step + 1,
                        params=optax.apply_updates(state.params, updates),
                        opt_state=opt_state)
    return new, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

  @jax.jit
  def eval_fn(state, inputs_BT, targets_BT):
    logits_fn = state.eval_logits_fn or state.logits_fn
    logits_BTV = logits_fn(state.params, inputs_BT)
    nll, count = train.masked_nll(logits_BTV, targets_BT)
    mask_BT = targets_BT != data.PAD
    hit_BT = (jnp.argmax(logits_BTV, axis=-1) == targets_BT) & mask_BT
    row_exact_B = jnp.all(hit_BT | ~mask_BT, axis=-1)
    return nll, count, jnp.sum(hit_BT), jnp.sum(row_exact_B)

  return step_fn, eval_fn


def _eval_sums(state, eval_fn, batches: Sequence[TrainBatch]) -> np.ndarray:
  """[nll, supervised targets, argmax hits, exact rows, rows] over fixed
  batches: sums, so that parts scored apart pool by adding them."""
  sums = np.zeros(5)
  for b in batches:
    sums[:4] += [float(x) for x in eval_fn(state, b.inputs, b.targets)]
    sums[4] += b.inputs.shape[0]
  return sums


def _eval_metrics(sums: np.ndarray) -> dict:
  nll, count, hits, rows, total = (float(x) for x in sums)
  loss = nll / max(count, 1.0)
  return {"loss": loss, "bits_per_byte": loss / math.log(2),
          "token_accuracy": hits / max(count, 1.0),
          "row_exact": rows / total, "targets": count}


def evaluate_mixture(state, eval_fn, batches: Sequence[TrainBatch]) -> dict:
  """Teacher-forced metrics on fixed batches: loss (nats per supervised
  target), token_accuracy (argmax == target), row_exact (every supervised
  target of a row is the argmax: answer bytes, EOS, MQAR's answered
  queries)."""
  return _eval_metrics(_eval_sums(state, eval_fn, batches))


def _params_to_fine_tune(init_from, model_config):
  """The latest params of the checkpoint at `init_from`, whose model config
  must equal the run's (else ValueError naming the fields that differ)."""
  from kvjax import orbax_checkpoint  # pylint: disable=g-import-not-at-top
  saved, params = orbax_checkpoint.restore_params(init_from)
  if saved != model_config:
    differ = sorted(f.name for f in dataclasses.fields(model_config)
                    if getattr(saved, f.name) != getattr(model_config, f.name))
    raise ValueError(f"init_from={str(init_from)!r}: its model config "
                     f"differs from the run's in {differ}")
  return params


def part_name(mixture: Mixture) -> str:
  """How validation names an alternating part: its first task ('text' for
  plain rows only)."""
  return mixture.tasks[0][0] if mixture.tasks else "text"


def _check_parts(parts: Sequence[Mixture], train_config,
                 short_steps: int):
  """ValueError, before any compute, unless the parts can alternate under
  `train_config`: the first part's (T, B) is the config's, every part's
  batch holds its B · T tokens, the parts' names differ, and no length
  curriculum (it is defined on one mixture)."""
  if not parts or not all(isinstance(m, Mixture) for m in parts):
    raise ValueError(f"mixture must be a Mixture or a non-empty sequence of "
                     f"them, got {parts!r}")
  first = parts[0]
  if (train_config.seq_len, train_config.batch_size) != (
      first.seq_len, first.batch_size):
    raise ValueError(
        f"train seq_len/batch_size ({train_config.seq_len}, "
        f"{train_config.batch_size}) differ from the mixture's "
        f"({first.seq_len}, {first.batch_size})")
  if len(parts) == 1:
    return
  tokens = first.seq_len * first.batch_size
  for m in parts[1:]:
    if m.seq_len * m.batch_size != tokens:
      raise ValueError(
          f"alternating mixtures must hold the same tokens per batch: "
          f"{part_name(m)!r} has seq_len*batch_size = {m.seq_len}*"
          f"{m.batch_size} = {m.seq_len * m.batch_size}, the first "
          f"{first.seq_len}*{first.batch_size} = {tokens}")
  names = [part_name(m) for m in parts]
  if len(set(names)) != len(names):
    raise ValueError(f"alternating mixtures need different first tasks "
                     f"(validation names each part by it), got {names}")
  if short_steps > 0:
    raise ValueError("a length curriculum (short_steps > 0) applies to one "
                     "mixture, not to alternating ones")


def train_task_model(model_config, train_config,
                     mixture: Mixture | Sequence[Mixture],
                     workdir, *, haystack: np.ndarray | None = None,
                     text: np.ndarray | None = None,
                     short_steps: int = 0, short_seq_len: int = 0,
                     init_from=None) -> dict:
  """Trains a kvjax model on `mixture`, resuming from `workdir` when it
  holds a checkpoint; a fresh run starts from `init_from`'s weights (a
  task model's workdir, e.g. `checkpoints/tasks-gqa-passkey`: fine-tuning
  onto a new mixture) when given, else from `init_params` at the seed.

  A length curriculum: the first `short_steps` updates draw their batches
  from the mixture at one fixed length, seq_len `short_seq_len` and no
  min_seq_len (cheap steps; the needle is a large share of the context and
  sits at few places, so retrieval is learnt sooner: on passkey, 1500
  updates at 128 gave exact match 1.0 at that length, 1500 at varied
  lengths 104-128 left it at 0 on lengths 104-256); the rest, and
  validation, use the mixture as given (varied lengths then undo the
  fixed length's positional shortcut).

  Several mixtures (parts) alternate by update: update i draws its batch
  from part i mod P, so one model learns tasks whose rows want different
  shapes (passkey's 256-byte rows, 16 a batch, beside MQAR's 32-byte rows,
  128 a batch) without padding the short rows to the long ones. Every
  part's batch holds the same B · T tokens, so an update is the same size
  whichever part it draws from; validation scores every part (its metrics
  pooled over the parts' targets, and per part under '<part>/<metric>',
  <part> the part's first task).

  Args:
    model_config: `kvjax.ModelConfig` (vocab_size must be 259).
    train_config: `kvjax.train.TrainConfig`; its seq_len and batch_size
      must equal the (first) mixture's.
    mixture: what the batches hold (`mixture_batch(seed=train_config.seed,
      step=i)` for update i), or a sequence of parts that alternate.
    workdir: checkpoints (kvjax.orbax_checkpoint's layout), metrics.jsonl,
      config.json, final.json.
  Returns:
    The final validation record (`evaluate_mixture` on `eval_batches`
    batches drawn with seed + EVAL_SEED_OFFSET), plus wall_s.
  """
  import json  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import kvjax  # pylint: disable=g-import-not-at-top
  from kvjax import orbax_checkpoint  # pylint: disable=g-import-not-at-top
  from kvjax import allocator  # pylint: disable=g-import-not-at-top
  train = _train_lib()
  if model_config.vocab_size != data.VOCAB_SIZE:
    raise ValueError(f"model vocab_size={model_config.vocab_size}, byte "
                     f"tasks need {data.VOCAB_SIZE}")
  parts = (mixture,) if isinstance(mixture, Mixture) else tuple(mixture)
  _check_parts(parts, train_config, short_steps)
  mixture = parts[0]
  # Before anything starts the JAX backend (kvjax/allocator.py).
  allocator.keep_host_memory()
  orbax_checkpoint.quiet_orbax_logs()
  # 'auto' resolved once, here: config.json names the precision taken.
  train_config = dataclasses.replace(
      train_config,
      matmul_dtype=train.resolve_matmul_dtype(train_config.matmul_dtype))
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  model_dict = model_config.to_dict()
  with open(workdir / train.CONFIG_FILE, "w") as f:
    json.dump({"model": model_dict,
               "train": dataclasses.asdict(train_config),
               "tasks": dataclasses.asdict(mixture),
               **({"alternate": [dataclasses.asdict(m) for m in parts[1:]]}
                  if len(parts) > 1 else {})}, f, indent=2)
  step_fn, eval_fn = _masked_step_fns()
  if init_from is None:
    params = jax.jit(kvjax.init_params, static_argnums=0)(
        model_config, jax.random.key(train_config.seed))
  else:
    params = _params_to_fine_tune(init_from, model_config)
  state = train.create_train_state(
      params, train.model_logits_fn(model_config, train_config.matmul_dtype),
      train.make_optimizer(train_config),
      eval_logits_fn=train.model_logits_fn(model_config))
  # Validation scores the answers only, whatever the training loss covers.
  eval_sets = [[mixture_batch(dataclasses.replace(m, prompt_loss=False),
                              seed=train_config.seed + EVAL_SEED_OFFSET,
                              step=k, haystack=haystack, text=text)
                for k in range(train_config.eval_batches)] for m in parts]
  logging.info("task model %s: %d parameters; mixture %s",
               model_config.variant, kvjax.param_count(model_config),
               [m.tasks for m in parts])

  short = mixture
  if short_steps > 0:
    if not 0 < short_seq_len <= mixture.seq_len:
      raise ValueError(f"short_seq_len={short_seq_len} must be in [1, "
                       f"seq_len={mixture.seq_len}]")
    short = dataclasses.replace(mixture, seq_len=short_seq_len,
                                min_seq_len=None)

  def batch_fn(i):
    b = mixture_batch(short if i < short_steps else parts[i % len(parts)],
                      seed=train_config.seed, step=i, haystack=haystack,
                      text=text)
    return b.inputs, b.targets

  def evaluate_fn(st):
    # Each part scored once; the pooled metrics add the parts' sums.
    sums = [_eval_sums(st, eval_fn, bs) for bs in eval_sets]
    metrics = _eval_metrics(sum(sums))
    if len(parts) > 1:
      for m, part in zip(parts, sums):
        metrics.update({f"{part_name(m)}/{k}": v
                        for k, v in _eval_metrics(part).items()})
    return metrics

  start = time.perf_counter()
  _, final = train.fit(
      state, batch_fn=batch_fn, evaluate_fn=evaluate_fn,
      config=train_config, workdir=workdir, model_config_dict=model_dict,
      step_fn=step_fn)
  final["wall_s"] = time.perf_counter() - start
  with open(workdir / "final.json", "w") as f:
    json.dump(final, f, indent=2)
  return final


# A task config's sections of the parts after the first (configs/tasks.py),
# in the order they alternate.
ALTERNATE_KEYS = ("alternate",) + tuple(f"alternate_{k}" for k in range(2, 10))


def alternate_sections(cfg) -> list:
  """A task config's parts after the first, in the order they alternate:
  sections `ALTERNATE_KEYS` up to the first one missing."""
  out = []
  for key in ALTERNATE_KEYS:
    if cfg.get(key) is None:
      break
    out.append(cfg[key])
  return out


def _main(argv):
  """python -m kvjax.lab.tasks --config=configs/tasks.py:gqa-passkey
  --workdir=DIR: trains a task model (`train_task_model`)."""
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  from kvjax import configs  # pylint: disable=g-import-not-at-top
  cfg = flags.FLAGS.config
  train = _train_lib()
  train_config = train.TrainConfig.from_dict(cfg.train.to_dict())
  mixture = mixture_from_dict(dict(cfg.tasks.to_dict(),
                                   seq_len=train_config.seq_len,
                                   batch_size=train_config.batch_size))
  sections = [cfg.tasks] + alternate_sections(cfg)
  needs_text = cfg.tasks.text_weight > 0 or any(
      getattr(get_task(n), "filler", None) == "text"
      for sec in sections for n in sec.names)
  haystack = (load_haystack("train", train_config.data_dir)
              if needs_text else None)
  text = None
  if cfg.tasks.text_weight > 0:
    if haystack is None:
      raise data.CorpusNotFoundError(
          f"text_weight={cfg.tasks.text_weight} needs the Austen corpus: "
          f"{data.INSTALL_COMMAND}")
    text = data.austen_streams(train_config.data_dir).train
  parts = [mixture] + [mixture_from_dict(sec.to_dict())
                       for sec in alternate_sections(cfg)]
  curriculum = cfg.get("curriculum") or {}
  final = train_task_model(configs.model_config(cfg.model), train_config,
                           parts, flags.FLAGS.workdir, haystack=haystack,
                           text=text,
                           short_steps=int(curriculum.get("steps", 0)),
                           short_seq_len=int(curriculum.get("seq_len", 0)),
                           init_from=cfg.get("init_from"))
  logging.info("done: %s", final)


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  config_flags.DEFINE_config_file("config", "configs/tasks.py",
                                  "Task-model training config.",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "Output directory.", required=True)
  app.run(_main)
