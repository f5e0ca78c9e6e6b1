"""Sampling strategies and stopping.

Samplers: validation, frozen and hashable (a static jit argument), explicit
keys (same key, same tokens), top-k never leaves the k best, top-p keeps the
smallest prefix reaching p and renormalizes, temperature reshapes the
distribution, and the combination applies top-k then top-p.

Stopping: `generate` with stop tokens (the `lax.while_loop` path) returns the
fixed-length `lax.scan` path's tokens and logits up to each sequence's stop,
`pad_id` after it, and really stops (the cache stops growing).
"""

import dataclasses
import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.sampling import GREEDY, Sampler, argmax
from kvjax.tolerance import assert_close
from configs import model as model_presets
import cases  # pylint: disable=g-bad-import-order

# A fixed, easily checked distribution: sorted, distinct probabilities.
PROBS = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
LOGITS = np.log(PROBS).astype(np.float32)

SAMPLERS = dict(
    temperature=Sampler(temperature=0.7),
    top_k=Sampler(temperature=1.0, top_k=3),
    top_p=Sampler(temperature=1.0, top_p=0.8),
    top_k_top_p=Sampler(temperature=1.3, top_k=5, top_p=0.7),
)


def nucleus(probs: np.ndarray, p: float) -> np.ndarray:
  """Reference: indices of the smallest most-likely prefix with mass >= p."""
  order = np.argsort(-probs)
  mass = np.cumsum(probs[order])
  n = int(np.searchsorted(mass, p)) + 1  # first prefix whose mass reaches p
  return np.sort(order[:n])


def draw(sampler, logits_V, n, key):
  """n independent draws from one row of logits."""
  rows = jnp.broadcast_to(jnp.asarray(logits_V), (n, logits_V.shape[-1]))
  return np.asarray(sampler(rows, key))


class SamplerValidationTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("negative_temperature", dict(temperature=-0.1), "temperature"),
      ("top_k_below_zero", dict(temperature=1.0, top_k=-1), "top_k"),
      ("top_k_zero", dict(temperature=1.0, top_k=0), "top_k"),
      ("top_p_zero", dict(temperature=1.0, top_p=0.0), "top_p"),
      ("top_p_negative", dict(temperature=1.0, top_p=-0.5), "top_p"),
      ("top_p_above_one", dict(temperature=1.0, top_p=1.01), "top_p"),
      ("top_p_nan", dict(temperature=1.0, top_p=float("nan")), "top_p"),
  )
  def test_bad_arguments_raise_naming_the_field(self, kwargs, field):
    with self.assertRaisesRegex(ValueError, field):
      Sampler(**kwargs)

  def test_frozen_and_hashable(self):
    s = Sampler(temperature=0.5, top_k=4, top_p=0.9)
    with self.assertRaises(dataclasses.FrozenInstanceError):
      s.temperature = 1.0  # pytype: disable=attribute-error
    # Equal strategies are one jit cache entry.
    self.assertEqual(hash(s), hash(Sampler(temperature=0.5, top_k=4,
                                           top_p=0.9)))
    self.assertTrue(GREEDY.greedy)
    self.assertFalse(s.greedy)

  def test_generate_needs_a_key_to_sample(self):
    config = kvjax.ModelConfig.from_dict(
        model_presets.model_dict("gqa", "tiny"))
    # Shapes suffice: the error comes before any compute.
    params = jax.eval_shape(lambda: kvjax.init_params(config,
                                                      jax.random.key(0)))
    with self.assertRaisesRegex(ValueError, "rng"):
      kvjax.generate(params, config, np.ones((1, 3), np.int32), 2,
                     sampler=Sampler(temperature=1.0))


class ArgmaxTest(parameterized.TestCase):
  """`kvjax.sampling.argmax` (the decode loop's fast argmax) == jnp.argmax."""

  @cases.product(batch=(1, 8))
  def test_equals_jnp_argmax_with_ties_nan_and_inf(self, batch):
    x = np.array(jax.random.normal(jax.random.key(batch), (batch, 3000)))
    x[0, 7] = x[0, 900] = x[0].max() + 1  # tie: the first index wins
    if batch > 1:
      x[1, 11], x[1, 2000] = np.nan, np.nan  # the first NaN wins
      x[2] = -np.inf
      x[3, -1] = np.inf
    got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    self.assertEqual(got.dtype, np.int32)
    self.assertEqual(got[0], 7)

  def test_sampler_draws_equal_jax_random_categorical(self):
    sampler = Sampler(temperature=0.8, top_k=40, top_p=0.9)
    key = jax.random.key(5)
    logits = jax.random.normal(jax.random.key(6), (8, 2000)) * 3
    ref = jax.random.categorical(key, sampler.filter_logits(logits), axis=-1)
    np.testing.assert_array_equal(sampler(logits, key), ref)


class SamplerTest(chex.TestCase, parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_greedy_is_argmax_and_ignores_the_key(self):
    logits = jax.random.normal(jax.random.key(100), (16, 50))
    f = self.variant(lambda l, k: GREEDY(l, k))
    a = f(logits, jax.random.key(1))
    b = f(logits, jax.random.key(2))
    chex.assert_trees_all_equal(a, b, jnp.argmax(logits, -1).astype(
        jnp.int32))
    self.assertEqual(a.dtype, jnp.int32)

  @chex.variants(with_jit=True, without_jit=True)
  @cases.product(name=tuple(SAMPLERS),
                 slow=lambda name: name != "top_k_top_p")
  def test_same_key_same_tokens(self, name):
    sampler = SAMPLERS[name]
    logits = jax.random.normal(jax.random.key(100), (256, 40))
    f = self.variant(functools.partial(sampler.__call__))
    a = f(logits, jax.random.key(7))
    b = f(logits, jax.random.key(7))
    c = f(logits, jax.random.key(8))
    chex.assert_shape(a, (256,))
    chex.assert_trees_all_equal(a, b)
    # 256 rows of 40-way draws: another key changes some of them.
    self.assertTrue(bool(jnp.any(a != c)))

  @pytest.mark.slow  # every sampler eagerly, op by op
  def test_jit_and_eager_agree(self):
    # The shapes of test_same_key_same_tokens: its eager ops are compiled.
    logits = jax.random.normal(jax.random.key(101), (256, 40))
    key = jax.random.key(4)
    for name, sampler in SAMPLERS.items():
      with self.subTest(name):
        eager = sampler(logits, key)
        jitted = jax.jit(lambda l, k, s=sampler: s(l, k))(logits, key)
        chex.assert_trees_all_equal(eager, jitted)

  @cases.product(k=(1, 3, 10), slow=lambda k: k != 3)
  def test_top_k_never_leaves_the_k_best(self, k):
    B, V = 512, 40
    # Logits from a key stream the draws never use (a shared key correlates
    # the Gumbel noise with the logits).
    logits = jax.random.normal(jax.random.key(1000 + k), (B, V))
    sampler = Sampler(temperature=2.0, top_k=k)  # flat: tails are tempting
    kth = np.sort(np.asarray(logits), axis=-1)[:, -k]
    for seed in range(4):
      toks = np.asarray(sampler(logits, jax.random.key(seed)))
      chosen = np.asarray(logits)[np.arange(B), toks]
      self.assertTrue((chosen >= kth).all(),
                      f"top_k={k} drew a token outside the {k} best")
    if k == 1:
      np.testing.assert_array_equal(toks, np.argmax(np.asarray(logits), -1))
    else:
      # With k > 1 the draws really spread over several of the k.
      self.assertGreater(np.mean(toks != np.argmax(np.asarray(logits), -1)),
                         0.1)

  def test_top_k_at_least_vocab_is_no_filter(self):
    logits = jnp.asarray(LOGITS)[None]
    full = Sampler(temperature=1.0, top_k=len(PROBS) + 10).filter_logits(
        logits)
    assert_close(full, logits, depth=1)

  @cases.product(p=(0.3, 0.5, 0.6, 0.72, 0.9, 0.97, 1.0))
  def test_top_p_keeps_the_smallest_prefix_reaching_p(self, p):
    kept = nucleus(PROBS, p)
    self.assertGreaterEqual(PROBS[kept].sum(), p - 1e-9)
    if len(kept) > 1:  # smallest: one token fewer does not reach p
      self.assertLess(PROBS[kept[:-1]].sum(), p)
    sampler = Sampler(temperature=1.0, top_p=p)
    probs = np.asarray(jax.nn.softmax(
        sampler.filter_logits(jnp.asarray(LOGITS)[None]), axis=-1))[0]
    expected = np.zeros_like(PROBS)
    expected[kept] = PROBS[kept] / PROBS[kept].sum()  # renormalized nucleus
    assert_close(probs, expected, depth=1)

  def test_top_p_draws_match_the_nucleus_mass(self):
    p, n = 0.6, 40_000
    kept = nucleus(PROBS, p)  # {0, 1}: mass 0.65
    np.testing.assert_array_equal(kept, [0, 1])
    toks = draw(Sampler(temperature=1.0, top_p=p), LOGITS, n,
                jax.random.key(0))
    self.assertTrue(np.isin(toks, kept).all())
    freq = np.mean(toks == 0)
    expected = PROBS[0] / PROBS[kept].sum()
    sigma = np.sqrt(expected * (1 - expected) / n)
    self.assertLess(abs(freq - expected), 5 * sigma)

  @cases.product(t=(0.5, 1.0, 2.0), slow=lambda t: t != 0.5)
  def test_temperature_draws_follow_the_scaled_softmax(self, t):
    n = 40_000
    toks = draw(Sampler(temperature=t), LOGITS, n, jax.random.key(1))
    expected = np.exp(LOGITS / t) / np.exp(LOGITS / t).sum()
    freq = np.bincount(toks, minlength=len(PROBS)) / n
    sigma = np.sqrt(expected * (1 - expected) / n)
    self.assertTrue((np.abs(freq - expected) < 5 * sigma).all(),
                    f"t={t}: frequencies {freq} vs {expected}")

  def test_top_k_then_top_p_on_the_scaled_distribution(self):
    t, k, p = 1.5, 4, 0.7
    scaled = np.exp(LOGITS / t)
    scaled /= scaled.sum()
    top = np.argsort(-scaled)[:k]
    renorm = np.zeros_like(scaled)
    renorm[top] = scaled[top] / scaled[top].sum()
    kept = nucleus(renorm, p)
    self.assertLess(len(kept), k)  # the nucleus really cut the top-k set
    expected = np.zeros_like(scaled)
    expected[kept] = renorm[kept] / renorm[kept].sum()
    sampler = Sampler(temperature=t, top_k=k, top_p=p)
    probs = np.asarray(jax.nn.softmax(
        sampler.filter_logits(jnp.asarray(LOGITS)[None]), axis=-1))[0]
    assert_close(probs, expected, depth=1)
    toks = draw(sampler, LOGITS, 20_000, jax.random.key(2))
    self.assertTrue(np.isin(toks, kept).all())


# ---- stopping -----------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _tiny():
  config = kvjax.ModelConfig.from_dict(
      dict(model_presets.model_dict("gqa", "tiny"), init_scale=0.15))
  return config, kvjax.init_params(config, jax.random.key(0))


def _ragged_prompt(lengths, T, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, 256, size=(len(lengths), T)).astype(np.int32)
  mask = (np.arange(T)[None] >= T - np.asarray(lengths)[:, None])
  return tokens, mask.astype(np.int32)


def _truncate_at_stops(toks, stops, pad_id):
  """Reference: each row up to and including its first stop, then pads."""
  out = np.full_like(toks, pad_id)
  first = []
  for b, row in enumerate(toks):
    hits = np.flatnonzero(np.isin(row, stops))
    end = hits[0] + 1 if len(hits) else len(row)
    out[b, :end] = row[:end]
    first.append(end - 1 if len(hits) else None)
  return out, first


class StoppingTest(parameterized.TestCase):
  STEPS = 10
  LENGTHS = (3, 7, 5)

  def _both(self, stops, sampler=GREEDY, pad_id=0):
    config, params = _tiny()
    tokens, mask = _ragged_prompt(self.LENGTHS, 8)
    rng = jax.random.key(5)
    scan = kvjax.generate(params, config, tokens, self.STEPS,
                          attention_mask=mask, sampler=sampler, rng=rng,
                          return_logits=True, return_cache=True)
    loop = kvjax.generate(params, config, tokens, self.STEPS,
                          attention_mask=mask, sampler=sampler, rng=rng,
                          stop_tokens=stops, pad_id=pad_id,
                          return_logits=True, return_cache=True)
    return scan, loop

  # Fast tier: test_decode.py's while_loop == scan (greedy, GQA and MLA).
  @cases.named((dict(testcase_name="greedy", sampler=GREEDY),
                dict(testcase_name="sampled",
                     sampler=Sampler(temperature=1.0, top_k=20))))
  @pytest.mark.slow
  def test_while_loop_equals_scan_up_to_the_stop(self, sampler):
    # Stop tokens taken from the scan's own output, so every row stops.
    (ref, _, _), _ = self._both((), sampler)
    ref = np.asarray(ref)
    stops = (int(ref[0, 2]), int(ref[1, 4]))
    pad_id = 255
    (scan, scan_logits, _), (loop, loop_logits, cache) = self._both(
        stops, sampler, pad_id)
    expected, first = _truncate_at_stops(np.asarray(scan), stops, pad_id)
    np.testing.assert_array_equal(np.asarray(loop), expected)
    for b, end in enumerate(first):
      end = self.STEPS if end is None else end + 1
      assert_close(loop_logits[b, :end], scan_logits[b, :end], _tiny()[0])
    self.assertIsNotNone(first[0])
    self.assertIsNotNone(first[1])

  def test_loop_stops_when_every_sequence_is_done(self):
    (ref, _, scan_cache), _ = self._both(())
    ref = np.asarray(ref)
    # One stop per row, at steps 1, 3, 2 (or earlier, if the token recurs).
    stops = tuple(int(ref[b, j]) for b, j in enumerate((1, 3, 2)))
    _, (loop, _, cache) = self._both(stops)
    _, first = _truncate_at_stops(ref, stops, 0)
    self.assertTrue(all(f is not None for f in first))
    last = max(first)
    self.assertLess(last, self.STEPS - 1)
    n = np.asarray(self.LENGTHS)
    # Every executed decode step grows every row by one; the loop ran one
    # step fewer than the last stop's index (the stop is never fed back).
    np.testing.assert_array_equal(np.asarray(cache.length), n + last)
    np.testing.assert_array_equal(np.asarray(scan_cache.length),
                                  n + self.STEPS - 1)
    self.assertTrue((np.asarray(loop)[:, last + 1:] == 0).all())

  @pytest.mark.slow  # an edge of the loop-equals-scan check above
  def test_stop_on_the_first_token(self):
    (ref, _, _), _ = self._both(())
    stops = tuple(int(t) for t in np.asarray(ref)[:, 0])
    _, (loop, _, cache) = self._both(stops, pad_id=9)
    loop = np.asarray(loop)
    np.testing.assert_array_equal(loop[:, 0], np.asarray(ref)[:, 0])
    self.assertTrue((loop[:, 1:] == 9).all())
    np.testing.assert_array_equal(np.asarray(cache.length),
                                  np.asarray(self.LENGTHS))


if __name__ == "__main__":
  absltest.main()
