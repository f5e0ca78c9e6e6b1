"""Chunked prefill equals the one-pass prefill, for every attention variant.

Invariants: same last logits and the same cache (payload, positions,
lengths) for several chunk sizes incl. ragged (left-padded) batches and a
rolling-window cache; one compiled extend program per chunk size; the
compiled chunk step needs less temporary memory than the one-pass prefill;
bad chunk sizes raise ValueError naming `chunk_size`.
"""


from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import inference
from kvjax.tolerance import assert_close
from configs import model as model_presets

VARIANTS = model_presets.VARIANTS
# The first variant of each attention kind: one KVCache, one LatentCache.
KINDS = tuple({model_presets.model_dict(v, "tiny")["attention"]: v
               for v in reversed(VARIANTS)}.values())


import cases  # pylint: disable=g-bad-import-order
from tiny_models import tiny, tiny_params  # pylint: disable=g-bad-import-order


def ragged_prompt(config, B=3, T=11, seed=1):
  """[B, T] tokens and a left-padding mask with rows of T, T-3, T-6 tokens."""
  tokens = jax.random.randint(jax.random.key(seed), (B, T), 0,
                              config.vocab_size)
  real = np.array([T - 3 * b for b in range(B)])
  mask = np.arange(T)[None, :] >= (T - real)[:, None]
  return tokens, jnp.asarray(mask)


def compare(variant, chunk_size, capacity, policy=None):
  config, params = tiny(variant), tiny_params(variant)
  tokens, mask = ragged_prompt(config)
  B = tokens.shape[0]
  ref_logits, ref_cache = kvjax.prefill(
      params, config, tokens, kvjax.init_cache(config, B, capacity,
                                               policy=policy),
      attention_mask=mask)
  logits, cache = kvjax.prefill_chunked(
      params, config, tokens, kvjax.init_cache(config, B, capacity,
                                               policy=policy),
      chunk_size, attention_mask=mask)
  return logits, cache, ref_logits, ref_cache


class ChunkedEqualsOnePassTest(chex.TestCase):

  # 3 does not divide 11 (the prompt is left-padded to 12); 16 is one chunk.
  @cases.product(variant=VARIANTS, chunk_size=(3, 16),
                 slow=lambda variant, chunk_size: (
                     variant not in cases.FAST_VARIANTS or chunk_size != 3))
  def test_logits_and_cache(self, variant, chunk_size):
    logits, cache, ref_logits, ref_cache = compare(variant, chunk_size, 16)
    chex.assert_shape(logits, ref_logits.shape)
    chex.assert_tree_all_finite(logits)
    assert_close(logits, ref_logits, tiny(variant))
    np.testing.assert_array_equal(cache.positions, ref_cache.positions)
    np.testing.assert_array_equal(cache.length, [11, 8, 5])
    assert_close(cache, ref_cache, tiny(variant))

  # One per cache kind (KVCache, LatentCache): policies act on slots.
  @cases.product(variant=KINDS)
  def test_rolling_window_cache(self, variant):
    # Capacity 8 < 11 prompt tokens: chunks evict exactly what one pass
    # keeps, and queries see exactly the window.
    policy = kvjax.CachePolicy(eviction="window")
    logits, cache, ref_logits, ref_cache = compare(variant, 4, 8, policy)
    assert_close(logits, ref_logits, tiny(variant))
    np.testing.assert_array_equal(cache.positions, ref_cache.positions)
    assert_close(cache, ref_cache, tiny(variant))

  @cases.product(variant=KINDS, slow=lambda variant: variant != "mla")
  def test_int8_cache(self, variant):
    # Chunks attend over quantized earlier chunks, one pass over float
    # keys: close, not equal; the stored cache is the same quantization.
    policy = kvjax.CachePolicy(kv_dtype="int8")
    logits, cache, ref_logits, ref_cache = compare(variant, 4, 16, policy)
    assert_close(logits, ref_logits, tiny(variant), cache="int8")
    np.testing.assert_array_equal(cache.positions, ref_cache.positions)


class ChunkedStructureTest(chex.TestCase):

  def test_one_compilation_per_chunk_size(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    tokens = jax.random.randint(jax.random.key(3), (2, 24), 0,
                                config.vocab_size)
    # jit's cache size counts compiled programs of the extend body.
    before = inference._extend._cache_size()  # pylint: disable=protected-access
    for T in (24, 20, 13):  # 6, 5 and 4 chunks of 4 after left-padding
      kvjax.prefill_chunked(params, config, tokens[:, :T],
                            kvjax.init_cache(config, 2, 32), 4)
    after = inference._extend._cache_size()  # pylint: disable=protected-access
    self.assertEqual(after - before, 1)

  def test_chunk_needs_less_temporary_memory_than_one_pass(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    B, T, c = 2, 128, 16
    cache = jax.eval_shape(lambda: kvjax.init_cache(config, B, T))
    tok = jax.ShapeDtypeStruct((B, T), jnp.int32)
    mask = jax.ShapeDtypeStruct((B, T), jnp.bool_)
    tok_c = jax.ShapeDtypeStruct((B, c), jnp.int32)
    mask_c = jax.ShapeDtypeStruct((B, c), jnp.bool_)

    def temp_bytes(fn, *args):
      stats = fn.lower(params, config, *args, False).compile()
      return stats.memory_analysis().temp_size_in_bytes

    one_pass = temp_bytes(inference._prefill, tok, mask, cache)  # pylint: disable=protected-access
    chunk = temp_bytes(inference._extend, tok_c, mask_c, cache)  # pylint: disable=protected-access
    self.assertLess(chunk, one_pass / 2, (chunk, one_pass))


class BadChunkTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("zero", 0), ("negative", -4), ("float", 2.5), ("str", "4"),
      ("bool", True))
  def test_bad_chunk_size_names_the_field(self, chunk_size):
    config, params = tiny("gqa"), tiny_params("gqa")
    tokens = jnp.zeros((1, 8), jnp.int32)
    with self.assertRaisesRegex(ValueError, "chunk_size"):
      kvjax.prefill_chunked(params, config, tokens,
                            kvjax.init_cache(config, 1, 16), chunk_size)

  def test_multi_chunk_prompt_with_per_token_policies_raises(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    tokens = jnp.zeros((1, 8), jnp.int32)
    policy = kvjax.CachePolicy(eviction="h2o", recent=2)
    with self.assertRaisesRegex(ValueError, "chunk"):
      kvjax.prefill_chunked(params, config, tokens,
                            kvjax.init_cache(config, 1, 16, policy=policy), 4)

  def test_prompt_longer_than_capacity_raises(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    tokens = jnp.zeros((1, 20), jnp.int32)
    with self.assertRaisesRegex(ValueError, "capacity"):
      kvjax.prefill_chunked(params, config, tokens,
                            kvjax.init_cache(config, 1, 16), 4)


if __name__ == "__main__":
  absltest.main()
