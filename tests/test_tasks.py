"""Invariants of the synthetic tasks (kvjax.lab.tasks), their scorers, the
training mixture, the task-model configs and the cache-policy driver
(kvjax.lab.task_eval)."""

import dataclasses
import math
import os
import re

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import pytest

from configs import tasks as task_configs
import cases  # pylint: disable=g-bad-import-order
import kvjax
from kvjax import data
from kvjax.lab import task_eval
from kvjax.lab import tasks
from kvjax.inference import check_mask

TASK_NAMES = tuple(sorted(tasks.TASKS))
# Unregistered variants the generators and the solver must handle too.
CUSTOM_SPECS = (tasks.PasskeySpec(digits=9),
                tasks.NiahSpec(key_kind="number", num_keys=3),
                tasks.NiahSpec(num_keys=5, num_queries=2, filler="needles"),
                tasks.MqarSpec(key_length=3, value_digits=1, num_queries=2))
DEPTHS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


def _case(spec) -> str:
  """A case name for a task name or a custom spec (its fields)."""
  if isinstance(spec, str):
    return spec
  fields = "-".join(f"{k}{v}" for k, v in dataclasses.asdict(spec).items()
                    if v != getattr(type(spec)(), k))
  return f"{type(spec).__name__}-{fields}"


def _lengths(name):
  return (tasks.min_length(name), max(256, tasks.min_length(name)), 1000,
          4096)


def _haystack():
  """A small text stream standing in for the Austen corpus."""
  words = ("It is a truth universally acknowledged, that a single man in "
           "possession of a good fortune, must be in want of a wife.\n")
  return data.encode(words * 80)


class GeneratorTest(parameterized.TestCase):

  @cases.product(name=tuple(TASK_NAMES))
  def test_deterministic_in_the_seed(self, name):
    a = tasks.generate(name, 512, 0.3, 7)
    b = tasks.generate(name, 512, 0.3, 7)
    c = tasks.generate(name, 512, 0.3, 8)
    for field in ("tokens", "answer", "needles", "values", "gold",
                  "prompt_targets"):
      np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    self.assertFalse(np.array_equal(a.tokens, c.tokens))

  @cases.named(dict(testcase_name=_case(n), name=n)
               for n in TASK_NAMES + CUSTOM_SPECS)
  def test_lengths_are_exact(self, name):
    spec = tasks.get_task(name)
    for n in _lengths(name):
      for depth in (0.0, 0.5, 1.0):
        ex = tasks.generate(name, n, depth, 3)
        self.assertEqual(ex.tokens.shape, (n,))
        self.assertEqual(ex.tokens.dtype, np.int32)
        self.assertEqual(ex.answer.shape, (spec.answer_length,))
        self.assertEqual(ex.tokens[0], data.BOS)
        self.assertTrue(np.all(ex.tokens[1:] < data.BYTE_VOCAB))
        self.assertTrue(np.all(ex.answer < data.BYTE_VOCAB))

  @cases.named(dict(testcase_name=_case(n), name=n)
               for n in TASK_NAMES + CUSTOM_SPECS)
  def test_reference_solver_recovers_the_answer(self, name):
    for n in _lengths(name):
      for depth in DEPTHS:
        for seed in range(3):
          ex = tasks.generate(name, n, depth, seed, _haystack())
          np.testing.assert_array_equal(
              tasks.reference_answer(name, ex.tokens), ex.answer,
              err_msg=f"{name} length {n} depth {depth} seed {seed}")

  @cases.product(name=tuple(TASK_NAMES))
  def test_the_solver_reads_the_needle(self, name):
    # Overwriting the gold value in the prompt changes what is recoverable:
    # the answer lives where `values` says, nowhere else.
    ex = tasks.generate(name, 600, 0.4, 1)
    a, b = ex.values[ex.anchor]
    tokens = ex.tokens.copy()
    original = tokens[a:b].copy()
    tokens[a:b] = np.where(original == ord("1"), ord("2"), ord("1"))
    self.assertFalse(np.array_equal(tasks.reference_answer(name, tokens),
                                    ex.answer))

  @cases.product(name=tuple(TASK_NAMES))
  def test_needles_are_where_they_say(self, name):
    spec = tasks.get_task(name)
    for depth in DEPTHS:
      ex = tasks.generate(name, 1000, depth, 2)
      start, end = ex.context
      self.assertTrue(np.all(ex.needles[:, 0] >= start))
      self.assertTrue(np.all(ex.needles[:, 1] <= end))
      self.assertTrue(np.all(np.diff(ex.needles[:, 0]) > 0))
      self.assertTrue(np.all(ex.needles[:-1, 1] <= ex.needles[1:, 0]))
      self.assertTrue(ex.gold[ex.anchor])
      for (a, b), (va, vb) in zip(ex.needles, ex.values):
        self.assertTrue(a <= va < vb <= b)
        text = data.decode(ex.tokens[a:b])
        value = data.decode(ex.tokens[va:vb])
        if isinstance(spec, tasks.PasskeySpec):
          self.assertEqual(text, tasks.PASSKEY_NEEDLE.format(key=value))
        elif isinstance(spec, tasks.NiahSpec):
          self.assertRegex(text, rf"^ The magic number for \w+ is {value}\.$")
        else:
          self.assertRegex(text, rf"^ [a-z]+{spec.separator}{value}$")
      gold_values = [data.decode(ex.tokens[va:vb])
                     for (va, vb), g in zip(ex.values, ex.gold) if g]
      answer_parts = data.decode(ex.answer).split(tasks.ANSWER_SEPARATOR)
      self.assertCountEqual(gold_values, answer_parts)
      self.assertEqual(int(ex.gold.sum()), len(answer_parts))

  @cases.product(name=tuple(n for n in TASK_NAMES if n != "mqar"))
  def test_needles_do_not_split_sentences_or_words(self, name):
    for depth in DEPTHS:
      ex = tasks.generate(name, 1500, depth, 6, _haystack())
      for start, end in ex.needles:
        after = ex.tokens[end]
        if end < ex.context[1]:
          self.assertIn(chr(after), " \n", (name, depth, ex.text()))
        if ex.filler in ("noise", "needles"):  # whole sentences
          self.assertIn(ex.tokens[start - 1], (data.BOS, ord(".")))

  @cases.product(name=tuple(TASK_NAMES))
  def test_depth_is_realised(self, name):
    got = [tasks.generate(name, 2048, d, 5).needle_depth for d in DEPTHS]
    self.assertEqual(got[0], 0.0)
    self.assertEqual(got[-1], 1.0)
    self.assertTrue(np.all(np.diff(got) >= 0), got)
    # Snapping moves a needle by at most one sentence (noise, needle
    # haystack: < 60 bytes) or one word (text) of a ~1.8 KB haystack.
    np.testing.assert_allclose(got, DEPTHS, atol=0.04)

  def test_depth_zero_and_one_sit_at_the_ends(self):
    ex = tasks.generate("passkey", 512, 0.0, 0)
    self.assertEqual(ex.needles[0, 0], 1)  # right after BOS
    ex = tasks.generate("passkey", 512, 1.0, 0)
    self.assertEqual(ex.needles[0, 1], ex.context[1])
    self.assertEqual(data.decode(ex.tokens[ex.context[1]:]),
                     tasks.PASSKEY_QUESTION)

  def test_a_depth_sweep_moves_one_needle_through_one_haystack(self):
    a = tasks.generate("niah_single", 700, 0.2, 4)
    b = tasks.generate("niah_single", 700, 0.8, 4)
    np.testing.assert_array_equal(a.answer, b.answer)
    self.assertLess(a.needles[a.anchor, 0], b.needles[b.anchor, 0])

  def test_multikey_has_distractors_with_other_keys(self):
    ex = tasks.generate("niah_multikey", 1000, 0.5, 0, _haystack())
    self.assertEqual(ex.needles.shape[0], 4)
    self.assertEqual(int(ex.gold.sum()), 1)
    keys = [re.search(r"for (\w+) is", data.decode(ex.tokens[a:b])).group(1)
            for a, b in ex.needles]
    self.assertLen(set(keys), 4)
    self.assertEqual(ex.filler, "text")

  def test_needle_haystack_is_made_of_needles(self):
    ex = tasks.generate("niah_multikey_needles", 2048, 0.5, 0)
    context = data.decode(ex.tokens[slice(*ex.context)])
    self.assertGreater(len(re.findall(r"The magic number for", context)), 30)
    # Exactly one needle holds the asked key.
    key = re.search(r"magic number for (\w+)\?", ex.text()).group(1)
    self.assertLen(re.findall(rf"for {key} is", context), 1)

  def test_text_filler_falls_back_to_noise(self):
    ex = tasks.generate("niah_single_text", 512, 0.5, 0)
    self.assertEqual(ex.filler, "noise")
    self.assertIn("The grass is green.", ex.text())
    ex = tasks.generate("niah_single_text", 512, 0.5, 0, _haystack())
    self.assertEqual(ex.filler, "text")
    self.assertNotIn("The grass is green.", ex.text())
    self.assertIn("universally acknowledged", ex.text())

  def test_multivalue_answer_follows_the_context_order(self):
    ex = tasks.generate("niah_multivalue", 1000, 0.5, 3)
    in_context = [data.decode(ex.tokens[a:b]) for a, b in ex.values[ex.gold]]
    self.assertEqual(data.decode(ex.answer),
                     tasks.ANSWER_SEPARATOR.join(in_context))

  def test_mqar_layout(self):
    spec = tasks.get_task("mqar")
    ex = tasks.generate("mqar", 512, 0.25, 0)
    self.assertEqual(ex.needles.shape[0], spec.num_pairs(512))
    self.assertEqual(ex.anchor, round(0.25 * (spec.num_pairs(512) - 1)))
    # The answered queries are training targets, and they are values.
    supervised = data.decode(ex.tokens[ex.prompt_targets])
    self.assertLen(supervised, (spec.num_queries - 1) * spec.value_digits)
    self.assertTrue(supervised.isdigit())
    keys = re.findall(r" ([a-z]+)=", data.decode(ex.tokens[:ex.context[1]]))
    self.assertLen(set(keys), len(keys))

  def test_mqar_adjacent_puts_each_value_after_its_key(self):
    # Zoology's order: ' k1', the value the token right after its key, in
    # the context and in the queries.
    spec = tasks.get_task("mqar1_adjacent")
    self.assertEqual(spec.pair_length, 3)
    for seed in range(3):
      ex = tasks.generate("mqar1_adjacent", 64, 0.5, seed)
      text = data.decode(ex.tokens)
      self.assertNotIn("=", text)
      context, queries = text.split("\n")
      pairs = re.findall(r" ([a-z])(\d)", context)
      self.assertLen(pairs, spec.num_pairs(64))
      self.assertEqual(context.strip(), " ".join(k + v for k, v in pairs))
      lookup = dict(pairs)
      *answered, last = queries.split(" ")[1:]
      self.assertEqual([q[1] for q in answered],
                       [lookup[q[0]] for q in answered])
      self.assertEqual(data.decode(ex.answer), lookup[last])
      np.testing.assert_array_equal(
          tasks.reference_answer("mqar1_adjacent", ex.tokens), ex.answer)
      self.assertEqual(len(ex.tokens), 64)
      self.assertEqual(ex.prompt_targets.sum(), spec.num_queries - 1)
    with self.assertRaisesRegex(ValueError, "separator"):
      tasks.MqarSpec(separator=":")

  def test_mqar_flat_is_the_adjacent_prompt_without_the_newline(self):
    # Same seed, same pairs and queries; the newline's slot goes to one more
    # leading space, so the length and the answer are unchanged.
    for seed in range(3):
      flat = tasks.generate("mqar1_flat", 64, 0.5, seed)
      adjacent = tasks.generate("mqar1_adjacent", 64, 0.5, seed)
      self.assertNotIn(10, flat.tokens)
      self.assertEqual(data.decode(flat.tokens),
                       data.decode(adjacent.tokens).replace("\n", "")
                       .replace(" ", "  ", 1))
      np.testing.assert_array_equal(flat.answer, adjacent.answer)
      np.testing.assert_array_equal(
          tasks.reference_answer("mqar1_flat", flat.tokens), flat.answer)
      self.assertEqual(flat.prompt_targets.sum(),
                       adjacent.prompt_targets.sum())
    with self.assertRaisesRegex(ValueError, "query_marker"):
      tasks.MqarSpec(query_marker=";")

  def test_mqar_pairs_capped_at_the_keys(self):
    # One-letter keys: 26 pairs at most however long the prompt; the rest
    # of it is the leading spaces, and every key is still distinct.
    spec = tasks.get_task("mqar1")
    for length in (256, 4096):
      ex = tasks.generate("mqar1", length, 1.0, 3)
      self.assertEqual(ex.needles.shape[0], 26)
      self.assertEqual(spec.num_pairs(length), 26)
      text = data.decode(ex.tokens[:ex.context[1]])
      keys = re.findall(r" ([a-z])=\d", text)
      self.assertLen(set(keys), 26)
      self.assertTrue(text[1:].startswith(" " * (length - 200)))
      np.testing.assert_array_equal(
          tasks.reference_answer("mqar1", ex.tokens), ex.answer)
    # Below the cap the count is what fits.
    self.assertEqual(spec.num_pairs(60), (60 - spec._fixed) // 4)  # pylint: disable=protected-access

  @parameterized.named_parameters(
      ("unknown_task", dict(task="nope"), "unknown task"),
      ("short", dict(length=20), "length=20 is below the minimum"),
      ("depth_high", dict(depth=1.5), "depth must be in"),
      ("depth_low", dict(depth=-0.1), "depth must be in"),
      ("seed", dict(seed=-1), "seed must be"),
  )
  def test_bad_input(self, kwargs, message):
    args = dict(task="passkey", length=256, depth=0.5, seed=0)
    args.update(kwargs)
    with self.assertRaisesRegex(ValueError, message):
      tasks.generate(**args)

  def test_spec_validation(self):
    with self.assertRaisesRegex(ValueError, "num_queries"):
      tasks.NiahSpec(num_keys=1, num_queries=2)
    with self.assertRaisesRegex(ValueError, "filler"):
      tasks.PasskeySpec(filler="needles")


class BatchAndScoreTest(parameterized.TestCase):

  def _batch(self):
    exs = [tasks.generate("passkey", n, 0.5, i)
           for i, n in enumerate((300, 256, 400))]
    return exs, tasks.batch_examples(exs)

  def test_batching_pads_on_the_left(self):
    exs, batch = self._batch()
    self.assertEqual(batch.tokens.shape, (3, 400))
    for b, e in enumerate(exs):
      pad = 400 - e.length
      np.testing.assert_array_equal(batch.tokens[b, pad:], e.tokens)
      self.assertTrue(np.all(batch.tokens[b, :pad] == data.PAD))
      self.assertEqual(batch.attention_mask[b, :pad].sum(), 0)
      self.assertEqual(batch.attention_mask[b, pad:].min(), 1)
      start = batch.needle_starts[b]
      self.assertEqual(data.decode(batch.tokens[b, start:start + 17]),
                       " The pass key is ")
    # kvjax's own check accepts the mask (left padding, no empty row).
    check_mask(batch.attention_mask, batch.tokens)
    with self.assertRaisesRegex(ValueError, "pad_to"):
      tasks.batch_examples(exs, pad_to=399)

  def test_exact_match(self):
    _, batch = self._batch()
    oracle = batch.answers
    np.testing.assert_array_equal(tasks.exact_match(oracle, batch.answers),
                                  [1.0, 1.0, 1.0])
    wrong = oracle.copy()
    wrong[1, -1] = ord("x")
    np.testing.assert_array_equal(tasks.exact_match(wrong, batch.answers),
                                  [1.0, 0.0, 1.0])
    longer = np.concatenate([oracle, np.full((3, 4), ord("?"))], axis=1)
    np.testing.assert_array_equal(tasks.exact_match(longer, batch.answers),
                                  [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(
        tasks.exact_match(oracle[:, :-1], batch.answers), [0.0, 0.0, 0.0])

  def test_exact_match_ignores_answer_padding(self):
    exs = [tasks.generate("passkey", 256, 0.5, 0),
           tasks.generate("niah_single", 256, 0.5, 0)]
    batch = tasks.batch_examples(exs)
    self.assertEqual(batch.answers.shape, (2, 7))
    pred = np.where(batch.answer_mask, batch.answers, ord("z"))
    np.testing.assert_array_equal(
        tasks.exact_match(pred, batch.answers, batch.answer_mask), [1, 1])
    np.testing.assert_array_equal(tasks.exact_match(pred, batch.answers),
                                  [0, 1])

  def test_part_recall_is_rulers_string_match_all(self):
    ex = tasks.generate("niah_multivalue", 1000, 0.5, 0)
    parts = data.decode(ex.answer).split(tasks.ANSWER_SEPARATOR)
    half = data.encode(" and ".join(parts[:2]) + " and 0000000")[None]
    self.assertEqual(tasks.part_recall(half, [ex])[0], 0.5)
    self.assertEqual(tasks.part_recall(ex.answer[None], [ex])[0], 1.0)

  def test_score_generate_oracle_and_wrong(self):
    exs = [tasks.generate(name, 512, d, 0)
           for name in TASK_NAMES for d in (0.0, 1.0)]
    batch = tasks.batch_examples(exs)

    def oracle(tokens, mask, max_new):
      self.assertEqual(max_new, batch.answer_length)
      rows = []
      for t, m in zip(tokens, mask):
        ans = tasks.reference_answer(exs[len(rows)].task, t[m.astype(bool)])
        rows.append(np.pad(ans, (0, max_new - ans.shape[0]),
                           constant_values=data.EOS))
      return np.stack(rows)

    scores = tasks.score_generate(oracle, batch)
    np.testing.assert_array_equal(scores["exact"], 1.0)
    np.testing.assert_array_equal(scores["recall"], 1.0)

    def constant(tokens, mask, max_new):
      return np.full((tokens.shape[0], max_new), ord("0"), np.int32)

    scores = tasks.score_generate(constant, batch)
    np.testing.assert_array_equal(scores["exact"], 0.0)

  def test_answer_loglik(self):
    exs = [tasks.generate("niah_single", 300, 0.5, 0),
           tasks.generate("passkey", 280, 0.5, 1)]
    batch = tasks.batch_examples(exs)
    tokens, mask, index = tasks.teacher_forced_inputs(batch)
    for b, e in enumerate(exs):
      a = e.answer.shape[0]
      # Position index[b, i] holds the byte before answer i.
      np.testing.assert_array_equal(
          tokens[b, index[b, :a]],
          np.concatenate([e.tokens[-1:], e.answer[:-1]]))
    check_mask(mask, tokens)
    V = data.VOCAB_SIZE

    def uniform(tokens, mask):
      return np.zeros(tokens.shape + (V,), np.float32)

    s = tasks.answer_loglik(uniform, batch)
    np.testing.assert_allclose(s["loglik"], [-7 * math.log(V),
                                             -5 * math.log(V)], rtol=1e-12)
    np.testing.assert_allclose(s["loglik_per_byte"], -math.log(V),
                               rtol=1e-12)

    def oracle(tokens, mask):
      # Teacher forcing: the next input byte is the answer.
      logits = np.zeros(tokens.shape + (V,), np.float32)
      nxt = np.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
      np.put_along_axis(logits, nxt[..., None], 30.0, axis=-1)
      # The last answer byte is not an input: place it by hand.
      for b, e in enumerate(exs):
        logits[b, index[b, e.answer.shape[0] - 1]] = 0.0
        logits[b, index[b, e.answer.shape[0] - 1], e.answer[-1]] = 30.0
      return logits

    s = tasks.answer_loglik(oracle, batch)
    np.testing.assert_array_equal(s["argmax_exact"], 1.0)
    np.testing.assert_array_equal(s["token_accuracy"], 1.0)
    self.assertTrue(np.all(s["loglik"] > -1e-9 * 7 - 7 * V * math.exp(-30)))

    def off_by_one(tokens, mask):
      return oracle(np.roll(tokens, 1, axis=1), mask)

    s = tasks.answer_loglik(off_by_one, batch)
    self.assertTrue(np.all(s["argmax_exact"] == 0.0))
    self.assertTrue(np.all(s["loglik"] < -20.0))


class MixtureTest(parameterized.TestCase):

  def _mixture(self, **kw):
    args = dict(tasks=(("passkey", 1.0), ("mqar", 1.0),
                       ("niah_single", 1.0)), seq_len=256, batch_size=12)
    args.update(kw)
    return tasks.Mixture(**args)

  def test_pure_function_of_seed_and_step(self):
    m = self._mixture()
    a = tasks.mixture_batch(m, seed=1, step=5)
    b = tasks.mixture_batch(m, seed=1, step=5)
    c = tasks.mixture_batch(m, seed=1, step=6)
    np.testing.assert_array_equal(a.inputs, b.inputs)
    np.testing.assert_array_equal(a.targets, b.targets)
    self.assertEqual(a.kinds, b.kinds)
    self.assertFalse(np.array_equal(a.inputs, c.inputs))
    self.assertEqual(a.inputs.shape, (12, 256))
    self.assertEqual(a.targets.shape, (12, 256))

  def test_loss_mask_covers_the_answers(self):
    m = self._mixture(batch_size=24)
    batch = tasks.mixture_batch(m, seed=0, step=0)
    self.assertSetEqual(set(batch.kinds), {"passkey", "mqar", "niah_single"})
    for b, kind in enumerate(batch.kinds):
      spec = tasks.get_task(kind)
      A = spec.answer_length
      row = np.concatenate([batch.inputs[b], batch.targets[b, -1:]])
      self.assertEqual(row[-1], data.EOS)
      prompt = row[:-(A + 1)]
      answer = row[-(A + 1):-1]
      np.testing.assert_array_equal(tasks.reference_answer(kind, prompt),
                                    answer)
      supervised = batch.targets[b] != data.PAD
      np.testing.assert_array_equal(batch.loss_mask[b], supervised)
      # The answer and EOS are targets...
      self.assertTrue(np.all(supervised[-(A + 1):]))
      np.testing.assert_array_equal(batch.targets[b, -(A + 1):-1], answer)
      # ... and in the prompt only MQAR's answered queries are.
      extra = int(supervised[:-(A + 1)].sum())
      expected = ((spec.num_queries - 1) * spec.value_digits
                  if kind == "mqar" else 0)
      self.assertEqual(extra, expected)

  def test_prompt_loss_supervises_every_token(self):
    batch = tasks.mixture_batch(self._mixture(prompt_loss=True), seed=0,
                                step=0)
    np.testing.assert_array_equal(batch.targets, np.concatenate(
        [batch.inputs[:, 1:], batch.targets[:, -1:]], axis=1))
    self.assertTrue(np.all(batch.loss_mask))

  def test_varied_lengths_are_whole_rows_right_padded(self):
    m = self._mixture(batch_size=24, min_seq_len=64, prompt_loss=True)
    batch = tasks.mixture_batch(m, seed=0, step=0)
    lengths = set()
    for b, kind in enumerate(batch.kinds):
      spec = tasks.get_task(kind)
      A = spec.answer_length
      real = np.flatnonzero(batch.inputs[b] != data.PAD)
      n = int(real[-1]) + 1  # PAD only after the row
      np.testing.assert_array_equal(real, np.arange(n))
      self.assertTrue(np.all(batch.targets[b, n:] == data.PAD))
      self.assertEqual(batch.targets[b, n - 1], data.EOS)
      self.assertGreaterEqual(n, max(64, tasks.min_length(spec) + A))
      self.assertLessEqual(n, 256)
      prompt = batch.inputs[b, :n - A]
      np.testing.assert_array_equal(tasks.reference_answer(kind, prompt),
                                    batch.inputs[b, n - A:n])
      lengths.add(n)
    self.assertGreater(len(lengths), 12)  # lengths vary
    # None keeps every row full length (and the batches of old runs).
    full = tasks.mixture_batch(self._mixture(batch_size=24), seed=0, step=0)
    self.assertTrue(np.all(full.targets[:, -1] == data.EOS))

  def test_repeat_filler_is_predictable_only_by_copying(self):
    ex = tasks.generate("passkey_repeat", 512, 0.5, 3)
    self.assertEqual(ex.filler, "repeat")
    text = ex.text()
    self.assertNotIn("grass", text)
    before = text[:text.index(" The pass key")].strip()
    first = before.split(".")[0] + "."
    self.assertGreater(before.count(first), 1)  # the sentences repeat
    other = tasks.generate("passkey_repeat", 512, 0.5, 4).text()
    self.assertNotIn(first, other)  # and are drawn per example

  def test_span_filler_repeats_at_periods_up_to_its_whole_length(self):
    # Past its first period the filler equals itself one period back (so
    # copying predicts it), and the periods spread over the whole filler:
    # long distances are trained, not only a few dozen bytes.
    periods = []
    for seed in range(60):
      ex = tasks.generate("passkey_span", 512, 0.0, seed)
      self.assertEqual(ex.filler, "span")
      self.assertNotIn("grass", ex.text())
      start, end = ex.needles[0][1], ex.context[1]  # after the needle
      filler = np.asarray(ex.tokens[start:end])
      filler = filler[np.argmax(filler != ord(" ")):]  # the padding ends
      n = filler.shape[0]
      period = next((p for p in range(1, n)
                     if np.array_equal(filler[p:], filler[:n - p])), n)
      periods.append(period)
    periods = np.array(periods)
    self.assertLess(periods.min(), 64)
    self.assertGreater(periods.max(), 300)
    self.assertGreater(np.mean(periods > 128), 0.4)
    with self.assertRaisesRegex(ValueError, "filler='spam'"):
      tasks.PasskeySpec(filler="spam")

  def test_text_rows(self):
    text = _haystack()
    m = self._mixture(tasks=(), text_weight=1.0, batch_size=4)
    batch = tasks.mixture_batch(m, seed=0, step=0, text=text)
    self.assertEqual(batch.kinds, ("text",) * 4)
    np.testing.assert_array_equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    with self.assertRaisesRegex(ValueError, "text stream"):
      tasks.mixture_batch(m, seed=0, step=0)

  def test_alternating_mixtures_refused_before_compute(self):
    from kvjax import train  # pylint: disable=g-import-not-at-top
    config = kvjax.ModelConfig(vocab_size=data.VOCAB_SIZE, num_layers=1,
                               embed_dim=32, num_heads=2, num_kv_heads=1,
                               mlp_dim=64, max_seq_len=1024)
    tc = train.TrainConfig(seq_len=128, batch_size=2, num_steps=2,
                           warmup_steps=1)
    first = tasks.Mixture(tasks=(("passkey", 1.0),), seq_len=128,
                          batch_size=2)
    flat = tasks.Mixture(tasks=(("mqar1_flat", 1.0),), seq_len=32,
                         batch_size=8)
    workdir = self.create_tempdir().full_path
    for parts, kwargs, message in [
        ([first, dataclasses.replace(flat, batch_size=4)], {},
         "same tokens per batch.*'mqar1_flat'.*32\\*4 = 128"),
        ([first, tasks.Mixture(tasks=(("passkey", 1.0), ("mqar", 1.0)),
                                seq_len=256, batch_size=1)], {},
         "different first tasks"),
        ([first, flat], dict(short_steps=1, short_seq_len=64),
         "curriculum"),
        ([flat, first], {}, "differ from the mixture's"),
        ([], {}, "non-empty sequence"),
    ]:
      with self.subTest(message=message):
        with self.assertRaisesRegex(ValueError, message):
          tasks.train_task_model(config, tc, parts, workdir, **kwargs)
    # Refused before anything ran: nothing was written.
    self.assertEqual(os.listdir(workdir), [])

  def test_bad_mixtures(self):
    with self.assertRaisesRegex(ValueError, "seq_len=200"):
      tasks.Mixture(tasks=(("niah_multiquery", 1.0),), seq_len=200)
    with self.assertRaisesRegex(ValueError, "unknown task"):
      tasks.Mixture(tasks=(("nope", 1.0),))
    with self.assertRaisesRegex(ValueError, "sum to 0"):
      tasks.Mixture(tasks=(("passkey", 0.0),))
    with self.assertRaisesRegex(ValueError, "min_seq_len"):
      tasks.Mixture(tasks=(("passkey", 1.0),), min_seq_len=300)


class ConfigTest(parameterized.TestCase):

  @cases.product(preset=task_configs.PRESETS)
  def test_every_preset_builds(self, preset):
    cfg = task_configs.get_config(preset)
    config = kvjax.ModelConfig.from_dict(cfg.model.to_dict())
    self.assertEqual(config.vocab_size, data.VOCAB_SIZE)
    mixture = tasks.mixture_from_dict(dict(
        cfg.tasks.to_dict(), seq_len=cfg.train.seq_len,
        batch_size=cfg.train.batch_size))
    self.assertEqual(mixture.seq_len, cfg.train.seq_len)
    batch = tasks.mixture_batch(dataclasses.replace(mixture, batch_size=2),
                                seed=0, step=0)
    self.assertEqual(batch.inputs.shape, (2, cfg.train.seq_len))
    for section in tasks.alternate_sections(cfg):
      # Every part that alternates holds the same tokens per batch.
      other = tasks.mixture_from_dict(section.to_dict())
      self.assertEqual(other.seq_len * other.batch_size,
                       mixture.seq_len * mixture.batch_size)
      b = tasks.mixture_batch(other, seed=0, step=1)
      self.assertEqual(b.inputs.shape, (other.batch_size, other.seq_len))

  def test_alternating_parts_come_in_config_order(self):
    cfg = task_configs.get_config("gqa-passkey_mqar_niah")
    firsts = [tasks.part_name(tasks.mixture_from_dict(s.to_dict()))
              for s in tasks.alternate_sections(cfg)]
    self.assertEqual(firsts, ["mqar1_flat", "niah_single"])
    # The needle part trains on its answers only (with the filler's loss
    # as well it did not learn: configs/tasks.py).
    self.assertFalse(cfg.alternate_2.prompt_loss)
    # Its passkey part takes the filler's loss too, except MLA's (whose
    # passkey the needle's answer-only rows took over: configs/tasks.py).
    self.assertTrue(cfg.tasks.prompt_loss)
    mla = task_configs.get_config("mla-passkey_mqar_niah")
    self.assertFalse(mla.tasks.prompt_loss)
    self.assertFalse(mla.alternate_2.prompt_loss)
    self.assertTrue(task_configs.get_config("mla-passkey").tasks.prompt_loss)
    self.assertEqual(tasks.alternate_sections(
        task_configs.get_config("gqa-passkey")), [])

  def test_parameter_counts_match(self):
    counts = {v: kvjax.param_count(kvjax.ModelConfig.from_dict(
        task_configs.model_dict(v))) for v in task_configs.VARIANTS}
    ref = counts["gqa"]
    for v, n in counts.items():
      self.assertLess(abs(n - ref) / ref, 0.01, (v, counts))
    attention = {v: kvjax.ModelConfig.from_dict(task_configs.model_dict(v))
                 for v in task_configs.VARIANTS}
    self.assertEqual(attention["mha"].num_kv_heads,
                     attention["mha"].num_heads)
    self.assertEqual(attention["mqa"].num_kv_heads, 1)
    self.assertEqual(attention["mla"].attention, "mla")


class PolicyTest(parameterized.TestCase):

  @cases.named(dict(name=n, eviction=e, positions=p) for n, e, p in (
      ("full", "none", "original"), ("window", "window", "original"),
      ("sinks4", "sinks", "cache"), ("h2o", "h2o", "cache"),
      ("sinks1:original", "sinks", "original"),
      ("h2o:original", "h2o", "original"), ("tova", "tova", "original"),
      ("snapkv", "snapkv", "original"), ("knorm", "knorm", "original"),
      ("pyramid", "pyramid", "original"), ("adakv", "adakv", "original"),
      ("keydiff", "keydiff", "original"),
      ("snapkv@stream", "snapkv", "original")))
  def test_parse(self, name, eviction, positions):
    spec = task_eval.parse_policy(name)
    policy = spec.at(64)
    self.assertEqual(policy.eviction, eviction)
    self.assertEqual(policy.positions, positions)
    if policy.scored:  # half the slots are the always-kept recent window
      self.assertEqual(policy.recent, 32)
    self.assertEqual(spec.stream, name.endswith("@stream"))

  def test_compression_at_prefill_or_at_decode(self):
    # Per-layer/head policies compress a prompt longer than their budget
    # at prefill, unless '@stream'; global h2o always streams.
    for name, compresses in (("snapkv", True), ("tova", True),
                             ("snapkv@stream", False), ("h2o", False),
                             ("window", False)):
      spec = task_eval.parse_policy(name)
      self.assertEqual(spec.compresses(26, 256), compresses, name)
      self.assertFalse(spec.compresses(300, 256), name)  # fits: no need
    self.assertFalse(task_eval.one_pass(
        task_eval.parse_policy("h2o").at(26), 26, 256))
    self.assertTrue(task_eval.one_pass(
        task_eval.parse_policy("snapkv").at(26), 26, 256))

  def test_kv_bytes_are_exact(self):
    config, _ = _tiny_model()
    for kv_dtype in ("float32", "bfloat16", "float16", "int8"):
      spec = task_eval.parse_policy("window", kv_dtype)
      got = task_eval.sequence_kv_bytes(config, spec.at(26), 26)
      self.assertEqual(got, kvjax.kv_bytes_per_token(config, kv_dtype) * 26,
                       kv_dtype)

  @parameterized.parameters(("kivi", "int8"), ("kivi4", "int4"))
  def test_kivi_bytes_and_capacity(self, kv_format, codes):
    # Whole 32-token key groups, and the float32 residual group on top of
    # the per-token bytes (L 1, K 1, H 16).
    config, _ = _tiny_model()
    spec = task_eval.parse_policy("full", kv_format)
    self.assertEqual(spec.at(64).kv_dtype, codes)
    self.assertTrue(spec.at(64).channel_keys)
    cap = spec.capacity(0.5, 256, 5)
    self.assertEqual(cap, 288)
    per_token = kvjax.kv_bytes_per_token(config, codes, key_group=32)
    self.assertEqual(task_eval.sequence_kv_bytes(config, spec.at(cap), cap),
                     per_token * cap + 1 * 1 * 32 * 16 * 4)

  def test_capacity(self):
    spec = task_eval.parse_policy("window")
    self.assertEqual(spec.capacity(0.1, 1000, 5), 100)
    self.assertEqual(spec.capacity(1.0, 1000, 5), 1000)
    self.assertEqual(task_eval.parse_policy("full").capacity(0.1, 1000, 5),
                     1004)

  @parameterized.named_parameters(
      ("zero", "window", 0.0, "budget must be in"),
      ("above_one", "window", 1.5, "budget must be in"),
      ("bool", "window", True, "budget must be in"),
      ("sinks_too_small", "sinks8", 0.01, "cannot run at budget"),
  )
  def test_bad_budget(self, name, budget, message):
    with self.assertRaisesRegex(ValueError, message):
      task_eval.parse_policy(name).capacity(budget, 256, 5)

  def test_lengths_per_task(self):
    both = ("passkey", "mqar1_flat")
    self.assertEqual(task_eval.lengths_per_task(["256"], both),
                     {"passkey": [256], "mqar1_flat": [256]})
    self.assertEqual(
        task_eval.lengths_per_task(["passkey:256", "mqar1_flat:32",
                                    "mqar1_flat:64"], both),
        {"passkey": [256], "mqar1_flat": [32, 64]})
    # A plain T serves the tasks that have none of their own.
    self.assertEqual(task_eval.lengths_per_task(["512", "mqar1_flat:32"],
                                                both),
                     {"passkey": [512], "mqar1_flat": [32]})
    for entries, message in [(["passkey:x"], "not T or task:T"),
                             (["niah_single:256", "256"], "names task"),
                             (["passkey:256"], r"no length.*mqar1_flat")]:
      with self.assertRaisesRegex(ValueError, message):
        task_eval.lengths_per_task(entries, both)

  def test_unknown_policy(self):
    with self.assertRaisesRegex(ValueError, "not one of full"):
      task_eval.parse_policy("lru")
    with self.assertRaisesRegex(ValueError, "n >= 1"):
      task_eval.parse_policy("sinks0")
    with self.assertRaisesRegex(ValueError, "kv_dtype='int3'"):
      task_eval.parse_policy("window", "int3")
    with self.assertRaisesRegex(ValueError, "kv_dtype='kivi'.*'full'"):
      task_eval.parse_policy("window", "kivi")
    with self.assertRaisesRegex(ValueError, "kv_dtype='kivi4'.*'full'"):
      task_eval.parse_policy("h2o", "kivi4")
    with self.assertRaisesRegex(ValueError, "'@stream' is for scored"):
      task_eval.parse_policy("sinks4@stream")

  def test_wilson_interval(self):
    lo, hi = task_eval.wilson_interval(0, 10)
    self.assertEqual(lo, 0.0)
    self.assertGreater(hi, 0.2)
    lo, hi = task_eval.wilson_interval(10, 10)
    self.assertEqual(hi, 1.0)
    self.assertLess(lo, 0.8)
    for n in range(1, 200):  # the bounds hold p exactly, also at 0 and n
      for k in (0, n // 3, n):
        lo, hi = task_eval.wilson_interval(k, n)
        self.assertLessEqual(lo, k / n)
        self.assertGreaterEqual(hi, k / n)
    self.assertEqual(task_eval.wilson_interval(60, 60)[1], 1.0)

  def test_accuracy_grid(self):
    recs = [dict(length=256, depth=0.0, exact=1.0),
            dict(length=256, depth=0.0, exact=0.0),
            dict(length=512, depth=1.0, exact=1.0)]
    self.assertEqual(task_eval.accuracy_grid(recs),
                     {(256, 0.0): (0.5, 2), (512, 1.0): (1.0, 1)})


def _tiny_model():
  import jax  # pylint: disable=g-import-not-at-top
  config = kvjax.ModelConfig(vocab_size=data.VOCAB_SIZE, num_layers=1,
                             embed_dim=32, num_heads=2, num_kv_heads=1,
                             mlp_dim=64, max_seq_len=1024)
  return config, kvjax.init_params(config, jax.random.key(0))


@pytest.mark.slow
class DriverTest(parameterized.TestCase):

  @cases.product(name=("full", "h2o", "sinks2"))
  def test_streamed_equals_one_pass(self, name):
    # With room for the whole prompt, streaming it through decode_step and
    # prefilling it in one call are the same computation.
    config, params = _tiny_model()
    batch = tasks.batch_examples([tasks.generate("passkey", 128, d, 0)
                                  for d in (0.0, 1.0)])
    spec = task_eval.parse_policy(name)
    cap = spec.capacity(1.0, 128, 5) + (4 if spec.kind != "full" else 0)
    policy = spec.at(cap)
    one = task_eval.generate_answers(params, config, batch.tokens,
                                     batch.attention_mask, 5, policy, cap,
                                     stream=False)
    streamed = task_eval.generate_answers(params, config, batch.tokens,
                                          batch.attention_mask, 5, policy,
                                          cap, stream=True)
    np.testing.assert_array_equal(one, streamed)

  @cases.product(name=("window", "sinks2:original"))
  def test_one_pass_over_a_small_cache_equals_streaming(self, name):
    # The premise of `one_pass`: a positional policy with original
    # positions masks a one-call prefill to what a token-by-token stream
    # through the same small cache would hold.
    config, params = _tiny_model()
    batch = tasks.batch_examples([tasks.generate("passkey", 128, d, 0)
                                  for d in (0.0, 1.0)])
    spec = task_eval.parse_policy(name)
    cap = spec.capacity(0.5, 128, 5)
    policy = spec.at(cap)
    self.assertTrue(task_eval.one_pass(policy, cap, 128))
    one = task_eval.generate_answers(params, config, batch.tokens,
                                     batch.attention_mask, 5, policy, cap,
                                     stream=False)
    streamed = task_eval.generate_answers(params, config, batch.tokens,
                                          batch.attention_mask, 5, policy,
                                          cap, stream=True)
    np.testing.assert_array_equal(one, streamed)

  @cases.product(name=("full", "h2o"))
  def test_streamed_teacher_forcing_equals_one_pass(self, name):
    config, params = _tiny_model()
    batch = tasks.batch_examples([tasks.generate("passkey", 128, d, 0)
                                  for d in (0.0, 1.0)])
    tokens, mask, index = tasks.teacher_forced_inputs(batch)
    U = tokens.shape[1]
    spec = task_eval.parse_policy(name)
    cap = U + 1
    policy = spec.at(cap)
    one = task_eval.teacher_forced_logits(params, config, tokens, mask,
                                          policy, cap, stream=False)
    streamed = task_eval.teacher_forced_logits(params, config, tokens, mask,
                                               policy, cap, keep=5,
                                               stream=True)
    np.testing.assert_array_equal(index[:, 0], U - 5)
    np.testing.assert_allclose(streamed[:, -5:], one[:, -5:], atol=1e-4)

  @cases.product(name=("snapkv", "tova", "snapkv@stream"))
  def test_teacher_forcing_reads_the_cache_generation_read(self, name):
    # Teacher-forcing the model's own greedy answer through a compressed
    # (or streamed) quarter-size cache reproduces that answer: the scored
    # positions see the cache generation saw, not the whole prompt. (Large
    # initial weights: attention far from uniform, so what is cached shows.)
    config, _ = _tiny_model()
    import jax  # pylint: disable=g-import-not-at-top
    config = config.replace(init_scale=0.5)
    params = kvjax.init_params(config, jax.random.key(1))
    batch = tasks.batch_examples([tasks.generate("passkey", 128, d, 0)
                                  for d in (0.0, 1.0)])
    spec = task_eval.parse_policy(name)
    cap = spec.capacity(0.25, 128, 5)
    policy = spec.at(cap)
    stream = True if spec.stream else None
    greedy = task_eval.generate_answers(params, config, batch.tokens,
                                        batch.attention_mask, 5, policy, cap,
                                        stream=stream)
    tokens = np.concatenate([batch.tokens, greedy[:, :-1]], axis=1)
    mask = np.ones_like(tokens)
    logits = task_eval.teacher_forced_logits(params, config, tokens, mask,
                                             policy, cap, keep=5,
                                             stream=stream)
    np.testing.assert_array_equal(np.argmax(logits[:, -5:], -1), greedy)

  def test_random_model_scores_at_chance(self):
    # Chance of exact match is 1e-5 per 5-digit pass key.
    config, params = _tiny_model()
    exs = tasks.task_set("passkey", [128, 256], [0.0, 1.0], 2)
    for policy, budget in (("full", 1.0), ("window", 0.5), ("h2o", 0.5),
                           ("snapkv", 0.25)):
      recs = task_eval.evaluate(params, config, exs, policy, budget)
      self.assertLen(recs, 8)
      self.assertEqual(sum(r["exact"] for r in recs), 0.0)
      for r in recs:
        self.assertEqual(r["kv_bytes"], kvjax.kv_bytes_per_token(config) *
                         r["capacity"])

  def test_uninformative_model_loglik_is_uniform(self):
    # A zero final-norm scale makes every logit 0: log p = -ln V exactly,
    # through every cache path.
    config, params = _tiny_model()
    params = dict(params, final_norm=np.zeros_like(params["final_norm"]))
    exs = tasks.task_set("passkey", [128], [0.5], 2)
    for policy, budget in (("full", 1.0), ("window", 0.5), ("sinks2", 0.5),
                           ("h2o", 0.5)):
      recs = task_eval.evaluate(params, config, exs, policy, budget,
                                loglik=True)
      for r in recs:
        self.assertAlmostEqual(r["loglik_per_byte"], -math.log(259),
                               delta=1e-5)
        self.assertEqual(r["token_accuracy"], 0.0)  # argmax is id 0

  def test_bad_input_before_compute(self):
    config, params = _tiny_model()
    exs = tasks.task_set("passkey", [128], [0.5], 1)
    with self.assertRaisesRegex(ValueError, "budget must be in"):
      task_eval.evaluate(params, config, exs, "window", 0.0)
    with self.assertRaisesRegex(ValueError, "cannot run at budget"):
      task_eval.evaluate(params, config, exs, "sinks8", 0.05)


@pytest.mark.slow
class TrainTest(absltest.TestCase):

  def test_a_resumed_run_retraces_the_uninterrupted_one(self):
    self._check_resume(tasks.Mixture(tasks=(("passkey", 1.0), ("mqar", 1.0)),
                                     seq_len=128, batch_size=2))

  def test_a_resumed_curriculum_retraces_the_uninterrupted_one(self):
    # Short (112) batches for steps 0-2, then full length: the resume at
    # step 2 lands inside the curriculum.
    self._check_resume(tasks.Mixture(tasks=(("passkey", 1.0), ("mqar", 1.0)),
                                     seq_len=128, batch_size=2,
                                     min_seq_len=64),
                       short_steps=3, short_seq_len=112)

  def test_init_from_starts_from_the_checkpoint_and_checks_its_config(self):
    import dataclasses  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    from kvjax import orbax_checkpoint  # pylint: disable=g-import-not-at-top
    from kvjax import train  # pylint: disable=g-import-not-at-top
    config, _ = _tiny_model()
    mixture = tasks.Mixture(tasks=(("passkey", 1.0),), seq_len=128,
                            batch_size=2)
    tc = train.TrainConfig(seq_len=128, batch_size=2, num_steps=2,
                           warmup_steps=1, eval_every=2, eval_batches=1,
                           checkpoint_every=2, log_every=1)
    first = self.create_tempdir("first").full_path
    tasks.train_task_model(config, tc, mixture, first)
    _, trained = orbax_checkpoint.restore_params(first)
    # A zero learning rate keeps the start: the tuned run's params are the
    # first run's, not a fresh init's at the same seed.
    frozen = dataclasses.replace(tc, lr=1e-30)
    tuned = self.create_tempdir("tuned").full_path
    tasks.train_task_model(config, frozen, mixture, tuned, init_from=first)
    _, got = orbax_checkpoint.restore_params(tuned)
    fresh = kvjax.init_params(config, jax.random.key(tc.seed))
    for g, t, f in zip(*(jax.tree_util.tree_leaves(x)
                         for x in (got, trained, fresh))):
      np.testing.assert_allclose(np.asarray(g), np.asarray(t), rtol=1e-6,
                                 atol=1e-6)
      self.assertFalse(np.allclose(np.asarray(g), np.asarray(f)))
    other = dataclasses.replace(config, mlp_dim=config.mlp_dim * 2)
    with self.assertRaisesRegex(ValueError, r"init_from.*mlp_dim"):
      tasks.train_task_model(other, tc, mixture,
                             self.create_tempdir("other").full_path,
                             init_from=first)

  def test_alternating_mixtures_resume_and_are_scored_per_part(self):
    final = self._check_resume(
        [tasks.Mixture(tasks=(("passkey", 1.0),), seq_len=128, batch_size=2),
         tasks.Mixture(tasks=(("mqar1_flat", 1.0),), seq_len=32,
                       batch_size=8, min_seq_len=24)])
    for part in ("passkey", "mqar1_flat"):
      self.assertTrue(np.isfinite(final[f"{part}/loss"]))
      self.assertGreater(final[f"{part}/targets"], 0)
    # The pooled metrics weigh each part by its supervised targets.
    self.assertEqual(final["targets"], final["passkey/targets"] +
                     final["mqar1_flat/targets"])

  def _check_resume(self, mixture, **curriculum):
    import shutil  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    from kvjax import orbax_checkpoint  # pylint: disable=g-import-not-at-top
    from kvjax import train  # pylint: disable=g-import-not-at-top
    config, _ = _tiny_model()
    tc = train.TrainConfig(seq_len=128, batch_size=2, num_steps=4,
                           warmup_steps=1, eval_every=2, eval_batches=1,
                           checkpoint_every=2, log_every=1)
    whole = self.create_tempdir("whole").full_path
    final = tasks.train_task_model(config, tc, mixture, whole, **curriculum)
    self.assertEqual(final["step"], 4)
    self.assertTrue(np.isfinite(final["loss"]))
    # Interrupted after step 2: drop the last checkpoint and run again.
    resumed = self.create_tempdir("resumed").full_path
    shutil.copytree(whole, resumed, dirs_exist_ok=True)
    shutil.rmtree(f"{resumed}/checkpoints/4")
    tasks.train_task_model(config, tc, mixture, resumed, **curriculum)
    _, a = orbax_checkpoint.restore_params(whole)
    _, b = orbax_checkpoint.restore_params(resumed)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    return final


# The variants whose passkey_mqar_niah model is shipped.
SHIPPED_NIAH = ("gqa", "mha", "mqa", "mla")


def _shipped(variant, recipe):
  """(config, params) of checkpoints/tasks-<variant>-<recipe>."""
  import os  # pylint: disable=g-import-not-at-top
  from kvjax import orbax_checkpoint  # pylint: disable=g-import-not-at-top
  config, params = orbax_checkpoint.restore_params(os.path.join(
      os.path.dirname(__file__), "..", "checkpoints",
      f"tasks-{variant}-{recipe}"))
  assert config.variant == variant, (config.variant, variant)
  return config, params


def _retrieval_and_recall():
  """12 fresh passkey prompts at T = 256 and 12 flat MQAR ones at T = 32."""
  return (tasks.task_set("passkey", [256], [0.0, 0.5, 1.0], 4, seed=321),
          tasks.task_set("mqar1_flat", [32], [0.0, 0.5, 1.0], 4, seed=321))


def _exact(params, config, exs):
  """How many of exs the model answers exactly through the full cache."""
  got = task_eval.evaluate(params, config, exs,
                           task_eval.parse_policy("full"), 1.0)
  return sum(r["exact"] for r in got)


@pytest.mark.slow
class ShippedTaskModelTest(parameterized.TestCase):

  @parameterized.parameters("gqa", "mqa", "mha", "mla")
  def test_retrieves_the_needle_at_every_depth_through_the_full_cache(
      self, variant):
    # checkpoints/tasks-<variant>-passkey (gqa: policy_eval.py's default
    # model) finds a pass key anywhere in a 256-byte prompt (fresh seeds,
    # not the validation rows); a random model scores 0. A window of half
    # the prompt loses the early needles.
    config, params = _shipped(variant, "passkey")
    exs = tasks.task_set("passkey", [256], [0.0, 0.5, 1.0], 4, seed=123)
    self.assertGreaterEqual(_exact(params, config, exs), 11)
    window = task_eval.evaluate(params, config, exs,
                                task_eval.parse_policy("window"), 0.5)
    early = [r["exact"] for r in window if r["depth"] == 0.0]
    self.assertEqual(sum(early), 0, window)

  @parameterized.parameters("gqa", "mqa", "mha", "mla")
  def test_the_mixture_model_retrieves_and_recalls(self, variant):
    # checkpoints/tasks-<variant>-passkey_mqar: one model for passkey at
    # T = 256 and flat MQAR at T = 32 (fresh seeds), through the full
    # cache; its passkey start never saw MQAR and recalls at chance.
    config, params = _shipped(variant, "passkey_mqar")
    keys, recall = _retrieval_and_recall()
    for exs in (keys, recall):
      self.assertGreaterEqual(_exact(params, config, exs), 11)
    _, start = _shipped(variant, "passkey")
    self.assertLessEqual(_exact(start, config, recall), 2)

  @parameterized.parameters(*[(v,) for v in SHIPPED_NIAH])
  def test_the_three_task_model_also_finds_a_needle_by_its_key(self, variant):
    # checkpoints/tasks-<variant>-passkey_mqar_niah: passkey, flat MQAR and
    # RULER's single needle (fresh seeds) through the full cache. The
    # needle is asked for by its key; its passkey_mqar start never saw one
    # and answers at chance. Depth 0 (the needle right after BOS, the
    # farthest from the question) is the hardest: GQA's model answers 55 of
    # 60 there (WORKSPACE.md "One model per variant").
    config, params = _shipped(variant, "passkey_mqar_niah")
    needle = tasks.task_set("niah_single", [256], [0.0, 0.5, 1.0], 4,
                            seed=321)
    for exs in (*_retrieval_and_recall(), needle):
      self.assertGreaterEqual(_exact(params, config, exs), 11)
    _, start = _shipped(variant, "passkey_mqar")
    self.assertLessEqual(_exact(start, config, needle), 1)


@pytest.mark.slow
class ExperimentTest(absltest.TestCase):

  def test_policy_eval_script_writes_its_outputs(self):
    import json  # pylint: disable=g-import-not-at-top
    import os  # pylint: disable=g-import-not-at-top
    import subprocess  # pylint: disable=g-import-not-at-top
    import sys  # pylint: disable=g-import-not-at-top
    root = os.path.join(os.path.dirname(__file__), "..")
    workdir = self.create_tempdir().full_path
    proc = subprocess.run(
        [sys.executable, "experiments/policy_eval.py", f"--workdir={workdir}",
         "--checkpoint=", "--model=configs/model.py:gqa-tiny",
         "--tasks=passkey,mqar", "--lengths=128,mqar:144", "--depths=0,1",
         "--samples=1", "--seeds=2", "--policies=full,window,snapkv",
         "--kv_dtypes=float32,int8,kivi", "--budgets=0.5"],
        cwd=root, env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True, text=True, timeout=600)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    self.assertIn("| passkey | 128 | window |", proc.stdout)
    self.assertIn("| passkey | 128 | snapkv [int8] |", proc.stdout)
    self.assertIn("| mqar | 144 | window |", proc.stdout)  # its own length
    self.assertNotIn("| mqar | 128 |", proc.stdout)
    self.assertIn("left out ['window [kivi]', 'snapkv [kivi]']", proc.stderr)
    with open(os.path.join(workdir, "results.json")) as f:
      out = json.load(f)
    self.assertTrue(out["machine"]["cpu_model"])
    # 2 tasks x 2 depths x 2 draws x (3 full + 2 x 2 policies at one budget).
    self.assertLen(out["records"], 2 * 2 * 2 * 7)
    self.assertLen(out["table"], 2 * 7)
    for row in out["table"]:
      self.assertLen(row["draws"], 2)
      self.assertAlmostEqual(np.mean(row["draws"]), row["accuracy"])
    by_label = {r["label"]: r["kv_bytes"] for r in out["table"]
                if r["task"] == "passkey"}
    self.assertLess(by_label["window [int8]"], by_label["window"])
    self.assertLess(by_label["full [kivi]"], by_label["full"])
    self.assertEqual({r["mode"] for r in out["records"]
                      if r["policy"] == "snapkv"}, {"compressed"})
    for name in ("budget.png", "heatmap.png", "depth_budget.png",
                 "table.md"):
      self.assertGreater(os.path.getsize(os.path.join(workdir, name)), 0)

  def test_bad_flags_fail_before_compute(self):
    import os  # pylint: disable=g-import-not-at-top
    import subprocess  # pylint: disable=g-import-not-at-top
    import sys  # pylint: disable=g-import-not-at-top
    root = os.path.join(os.path.dirname(__file__), "..")
    for flag, message in (("--budgets=0", "budget must be in"),
                          ("--tasks=nope", "unknown task"),
                          ("--lengths=50", "below the minimum"),
                          ("--lengths=niah_single:256", "names task"),
                          ("--policies=lru", "not one of full"),
                          ("--kv_dtypes=int3", "kv_dtype='int3'"),
                          ("--seeds=0", "seeds must be >= 1"),
                          ("--policies=sinks32", "cannot run at budget")):
      proc = subprocess.run(
          [sys.executable, "experiments/policy_eval.py",
           f"--workdir={self.create_tempdir().full_path}", "--checkpoint=",
           flag], cwd=root, env=dict(os.environ, JAX_PLATFORMS="cpu"),
          capture_output=True, text=True, timeout=300)
      self.assertNotEqual(proc.returncode, 0)
      self.assertIn(message, proc.stderr)
      self.assertNotIn("Traceback", proc.stderr)  # one line, the user's
    # A policy the model's cache cannot hold (per kv head on MLA's shared
    # latent) is refused before any example runs, naming the policy.
    proc = subprocess.run(
        [sys.executable, "experiments/policy_eval.py",
         f"--workdir={self.create_tempdir().full_path}",
         "--checkpoint=checkpoints/tasks-mla-passkey", "--policies=full,snapkv",
         "--kv_dtypes=float32", "--budgets=0.5"], cwd=root,
        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
        text=True, timeout=300)
    self.assertNotEqual(proc.returncode, 0)
    self.assertIn("policy 'snapkv' cannot run on this model (mla)",
                  proc.stderr)
    self.assertNotIn("exact", proc.stderr)  # nothing was scored


if __name__ == "__main__":
  absltest.main()
