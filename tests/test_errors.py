"""Errors travel with the cache (kvjax/errors.py), inside jit and lax.scan too.

Invariants, for every attention variant:
  * a write past an eviction='none' cache inside `jit` or a `lax.scan`
    (decode_step, extend, a prompt too long for h2o / cache positions)
    returns NaN logits from that step on, sets OVERFLOW, and the next public
    call raises a ValueError naming it and the sequences;
  * an out-of-range id or an invalid mask under jit poisons only its own
    row (BAD_TOKEN / BAD_MASK); healthy rows keep finite logits;
  * non-finite logits never become tokens: the sampler returns
    INVALID_TOKEN, generate / generate_no_cache / the main job raise;
  * `errors.checkified` reports the failing step through checkify;
  * bad sizes are refused before anything is allocated.
"""

import dataclasses

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import errors
from kvjax.lab import job
from kvjax import model
import cases
from tiny_models import VARIANTS, tiny, tiny_params

B, S, PROMPT = 2, 8, 6


def _prompt(config, T=PROMPT, seed=0):
  return jax.random.randint(jax.random.key(seed), (B, T), 0,
                            config.vocab_size)


class OverflowTest(parameterized.TestCase):

  @cases.variants()
  def test_decode_steps_past_the_capacity_in_a_scan(self, variant):
    config, params = tiny(variant), tiny_params(variant)

    @jax.jit
    def run(params, tokens, cache):
      _, cache = kvjax.prefill(params, config, tokens, cache)

      def body(cache, tok_B):
        logits, cache = kvjax.decode_step(params, config, tok_B, cache)
        return cache, logits

      return jax.lax.scan(body, cache, jnp.ones((4, B), jnp.int32))

    cache, logits_SBV = run(params, _prompt(config),
                            kvjax.init_cache(config, B, S))
    # Steps 0 and 1 fill slots 6 and 7; step 2 has no slot left.
    nan_SB = np.isnan(np.asarray(logits_SBV)).all(-1)
    np.testing.assert_array_equal(nan_SB, [[False] * B] * 2 + [[True] * B] * 2)
    self.assertTrue(np.isfinite(np.asarray(logits_SBV[:2])).all())
    np.testing.assert_array_equal(cache.errors, [errors.OVERFLOW] * B)
    with self.assertRaisesRegex(ValueError, r"overflow.*sequences 0, 1"):
      kvjax.decode_step(params, config, jnp.ones((B,), jnp.int32), cache)

  @cases.variants()
  def test_extend_past_the_capacity_under_jit(self, variant):
    config, params = tiny(variant), tiny_params(variant)
    _, cache = kvjax.prefill(params, config, _prompt(config),
                             kvjax.init_cache(config, B, S))
    # Row 1 brings 1 token (fits), row 0 brings 3 (one too many).
    mask = jnp.array([[1, 1, 1], [0, 0, 1]], bool)
    logits, cache = jax.jit(
        lambda p, t, m, c: kvjax.extend(p, config, t, c, attention_mask=m))(
            params, _prompt(config, 3, seed=1), mask, cache)
    self.assertTrue(np.isnan(np.asarray(logits[0])).all())
    self.assertTrue(np.isfinite(np.asarray(logits[1])).all())
    np.testing.assert_array_equal(cache.errors, [errors.OVERFLOW, 0])
    with self.assertRaisesRegex(ValueError, r"overflow.*sequence 0\b"):
      kvjax.extend(params, config, _prompt(config, 1), cache)

  @parameterized.named_parameters(
      ("h2o", kvjax.CachePolicy("h2o", recent=2)),
      ("sinks_cache_positions",
       kvjax.CachePolicy("sinks", num_sinks=2, positions="cache")))
  def test_prompt_longer_than_an_h2o_or_rank_cache_under_jit(self, policy):
    config, params = tiny("gqa"), tiny_params("gqa")
    tokens = _prompt(config, S + 3)
    # The public prefill knows the prompt's length even under jit.
    with self.assertRaisesRegex(ValueError, "does not fit capacity"):
      jax.jit(lambda p, t, c: kvjax.prefill(p, config, t, c))(
          params, tokens, kvjax.init_cache(config, B, S, policy=policy))
    # The step function itself records it.
    prefill = jax.jit(model.prefill_logits,
                      static_argnames=("config", "all_logits"))
    logits, cache = prefill(params, config, tokens,
                            jnp.ones(tokens.shape, bool),
                            kvjax.init_cache(config, B, S, policy=policy),
                            all_logits=False)
    self.assertTrue(np.isnan(np.asarray(logits)).all())
    np.testing.assert_array_equal(cache.errors, [errors.OVERFLOW] * B)

  def test_evicting_caches_never_overflow(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    cache = kvjax.init_cache(config, B, S, policy=kvjax.CachePolicy("window"))
    logits, cache = kvjax.generate(params, config, _prompt(config), 20,
                                   capacity=S, policy=cache.policy,
                                   return_logits=True, return_cache=True)[1:]
    np.testing.assert_array_equal(cache.errors, [0] * B)
    self.assertTrue(np.isfinite(np.asarray(logits)).all())

  def test_errors_are_sticky(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    step = jax.jit(model.decode_logits, static_argnames="config")
    _, cache = kvjax.prefill(params, config, _prompt(config),
                             kvjax.init_cache(config, B, 16))
    bad = jnp.array([config.vocab_size, 1], jnp.int32)
    _, cache = step(params, config, bad, cache)
    logits, cache = step(params, config, jnp.ones((B,), jnp.int32), cache)
    np.testing.assert_array_equal(cache.errors, [errors.BAD_TOKEN, 0])
    self.assertTrue(np.isnan(np.asarray(logits[0])).all())
    self.assertTrue(np.isfinite(np.asarray(logits[1])).all())


class BadInputUnderJitTest(parameterized.TestCase):

  @cases.named(
      (dict(testcase_name=f"{v}-{'negative' if i < 0 else 'past_vocab'}_id",
            variant=v, bad_id=i) for v in VARIANTS for i in (-1, 1000)),
      slow=lambda variant, bad_id: variant not in cases.FAST_VARIANTS)
  def test_out_of_range_ids(self, variant, bad_id):
    config, params = tiny(variant), tiny_params(variant)
    tokens = np.asarray(_prompt(config)).copy()
    tokens[1, 3] = bad_id  # the id the gather would clamp
    logits, cache = jax.jit(lambda p, t, c: kvjax.prefill(p, config, t, c))(
        params, tokens, kvjax.init_cache(config, B, S))
    self.assertTrue(np.isfinite(np.asarray(logits[0])).all())
    self.assertTrue(np.isnan(np.asarray(logits[1])).all())
    np.testing.assert_array_equal(cache.errors, [0, errors.BAD_TOKEN])
    with self.assertRaisesRegex(ValueError,
                                r"token id out of range.*sequence 1"):
      kvjax.decode_step(params, config, jnp.ones((B,), jnp.int32), cache)

  @cases.variants(("gqa", "mla"))
  def test_invalid_masks(self, variant):
    config, params = tiny(variant), tiny_params(variant)
    mask = np.ones((3, PROMPT), bool)
    mask[0, 2] = False   # a hole
    mask[1, -1] = False  # right padding
    mask[2] = True       # fine
    tokens = np.asarray(_prompt(config, seed=2)).repeat(2, 0)[:3]
    logits, cache = jax.jit(
        lambda p, t, m, c: kvjax.prefill(p, config, t, c, attention_mask=m))(
            params, tokens, mask, kvjax.init_cache(config, 3, S))
    np.testing.assert_array_equal(cache.errors,
                                  [errors.BAD_MASK, errors.BAD_MASK, 0])
    self.assertTrue(np.isnan(np.asarray(logits[:2])).all())
    self.assertTrue(np.isfinite(np.asarray(logits[2])).all())
    empty = np.zeros((3, PROMPT), bool)
    empty[1:] = True
    _, cache = jax.jit(
        lambda p, t, m, c: kvjax.prefill(p, config, t, c, attention_mask=m))(
            params, tokens, empty, kvjax.init_cache(config, 3, S))
    np.testing.assert_array_equal(cache.errors, [errors.BAD_MASK, 0, 0])

  def test_checkify_reports_the_failing_step(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    _, cache = kvjax.prefill(params, config, _prompt(config),
                             kvjax.init_cache(config, B, S))

    def run(params, cache):
      def body(cache, tok_B):
        logits, cache = model.decode_logits(params, config, tok_B, cache)
        errors.checks(cache)
        return cache, logits
      return jax.lax.scan(body, cache, jnp.ones((4, B), jnp.int32))

    # checkify functionalizes the scan: the first failing step is named
    # (slot 8 of an 8-slot cache, i.e. position 8).
    err, _ = jax.jit(checkify.checkify(run))(params, cache)
    self.assertIn("overflow", err.get())
    self.assertIn("sequence 0 at position 8", err.get())
    checked = errors.checkified(model.decode_logits)
    err, (logits, _) = jax.jit(checked, static_argnames="config")(
        params, config, jnp.array([1, -1], jnp.int32), cache)
    self.assertIsNotNone(err.get())
    self.assertIn("token id out of range", err.get())
    self.assertIn("sequence 1", err.get())
    with self.assertRaises(Exception):
      err.throw()
    self.assertTrue(np.isnan(np.asarray(logits[1])).all())
    ok, _ = jax.jit(checked, static_argnames="config")(
        params, config, jnp.array([1, 2], jnp.int32), cache)
    self.assertIsNone(ok.get())


class NonFiniteTest(parameterized.TestCase):

  def _nan_params(self, variant):
    params = jax.tree_util.tree_map(lambda x: x, tiny_params(variant))
    return dict(params, final_norm=params["final_norm"].at[3].set(jnp.nan))

  def test_sampler_never_turns_nan_into_a_token(self):
    logits = jnp.array([[0.0, 1.0, jnp.nan], [0.0, 2.0, 1.0],
                        [jnp.inf, 0.0, 0.0]])
    for sampler in (kvjax.GREEDY, kvjax.Sampler(temperature=1.0, top_k=2)):
      ids = sampler(logits, jax.random.key(0))
      np.testing.assert_array_equal(np.asarray(ids)[[0, 2]],
                                    [errors.INVALID_TOKEN] * 2)
      self.assertIn(int(ids[1]), (0, 1, 2))
    np.testing.assert_array_equal(kvjax.GREEDY(logits, None)[1], 1)

  @cases.variants(("gqa", "mla"), fast=("gqa",))
  def test_generate_and_no_cache_raise(self, variant):
    config, params = tiny(variant), self._nan_params(variant)
    with self.assertRaisesRegex(ValueError, "non-finite logits"):
      kvjax.generate(params, config, _prompt(config), 4)
    with self.assertRaisesRegex(ValueError, "non-finite logits"):
      kvjax.generate(params, config, _prompt(config), 4, stop_tokens=(5,))
    with self.assertRaisesRegex(ValueError, "non-finite logits"):
      kvjax.generate_no_cache(params, config, _prompt(config), 4)

  def test_finite_garbage_weights_raise(self):
    config = tiny("gqa")
    params = jax.tree_util.tree_map(lambda x: x * 1e30, tiny_params("gqa"))
    with self.assertRaisesRegex(ValueError, "non-finite logits"):
      kvjax.generate(params, config, _prompt(config), 4)

  @pytest.mark.slow  # the main job's compile; generate's check is above
  def test_main_job_cannot_verify_nan_output(self):
    config = kvjax.ModelConfig(vocab_size=64, num_layers=2, embed_dim=32,
                               num_heads=4, num_kv_heads=2, mlp_dim=64)
    loaded = job.load_model(config=config, seed=0)
    embed = loaded.params["embed"]
    loaded = dataclasses.replace(loaded, params=dict(
        loaded.params, embed=embed.at[:, 0].set(jnp.nan)))
    tokens = job.prompt_tokens(loaded, text="", batch=2, prompt_len=6, seed=0)
    with self.assertRaisesRegex(ValueError, "non-finite logits"):
      job.run(loaded, tokens, max_new_tokens=4, policy=kvjax.CachePolicy(),
              verify_steps=4, repeats=1)


class HostSideLimitsTest(absltest.TestCase):

  def test_max_new_tokens_beyond_max_seq_len_is_refused_up_front(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    with self.assertRaisesRegex(ValueError, "max_seq_len"):
      kvjax.generate(params, config, _prompt(config), 10**9)
    for bad in (0, -5, 2.0, True):
      with self.assertRaisesRegex(ValueError, "max_new_tokens"):
        kvjax.generate(params, config, _prompt(config), bad)

  def test_a_cache_larger_than_the_device_is_refused_with_its_bytes(self):
    config = tiny("gqa").replace(max_seq_len=2**40)
    params = tiny_params("gqa")
    with self.assertRaisesRegex(ValueError, r"needs [\d,]+ bytes"):
      kvjax.generate(params, config, _prompt(config), 2**36)

  def test_lists_are_converted(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    tokens = np.asarray(_prompt(config))
    mask = [[1] * PROMPT, [0, 0] + [1] * (PROMPT - 2)]
    want = kvjax.generate(params, config, tokens, 3,
                          attention_mask=np.asarray(mask))
    got = kvjax.generate(params, config, tokens.tolist(), 3,
                         attention_mask=mask)
    np.testing.assert_array_equal(got, want)
    with self.assertRaisesRegex(ValueError, "ragged"):
      kvjax.forward(params, config, [[1, 2], [3]])

  def test_stop_and_pad_ids_must_be_in_the_vocabulary(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    for kw in (dict(stop_tokens=(config.vocab_size,)), dict(pad_id=-1),
               dict(stop_tokens=(1.5,))):
      with self.assertRaisesRegex(ValueError, "stop_tokens|pad_id"):
        kvjax.generate(params, config, _prompt(config), 3, **kw)

  def test_cache_sizes_are_ints(self):
    config = tiny("gqa")
    for kw in (dict(batch=2, capacity=8.0), dict(batch=True, capacity=8),
               dict(batch=2, capacity=0)):
      with self.assertRaisesRegex(ValueError, "batch|capacity"):
        kvjax.init_cache(config, **kw)


if __name__ == "__main__":
  absltest.main()
