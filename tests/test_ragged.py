"""Ragged batches: prompts of different lengths in one left-padded batch.

Hugging Face convention: mask 0 = padding, positions = cumsum(mask) - 1.
Invariants, for every attention variant:
  * each sequence of a batch gets exactly the tokens (and logits) it gets
    alone;
  * what sits in the padding never matters (padded slots are never
    attended);
  * the cache holds each sequence's own length and positions, and nothing
    in the slots past them;
  * prompt lengths are bucketed: new lengths inside a bucket do not
    recompile `generate` (traces counted);
  * the `jax.nn.dot_product_attention` implementation equals the einsum one.
"""

import dataclasses

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import inference
from kvjax.tolerance import assert_close
from configs import model as model_presets
import cases  # pylint: disable=g-bad-import-order
from tiny_models import tiny, tiny_params  # pylint: disable=g-bad-import-order

VARIANTS = model_presets.VARIANTS
GQA_FAMILY = tuple(v for v in VARIANTS
                   if model_presets.model_dict(v, "tiny")["attention"] ==
                   "gqa")
LENGTHS = (3, 9, 1, 12)  # one batch: short, long, a single token, full
T = 12
NEW = 6


def ragged(lengths=LENGTHS, T=T, seed=0, pad_fill=None):
  """Left-padded [B, T] tokens and mask; padding holds `pad_fill` (random
  ids by default: they must not matter)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, 256, size=(len(lengths), T)).astype(np.int32)
  mask = (np.arange(T)[None] >= T - np.asarray(lengths)[:, None])
  if pad_fill is not None:
    tokens = np.where(mask, tokens, pad_fill).astype(np.int32)
  return tokens, mask.astype(np.int32)


class RaggedTest(chex.TestCase, parameterized.TestCase):

  @cases.variants()
  def test_each_sequence_gets_what_it_gets_alone(self, variant):
    config, params = tiny(variant), tiny_params(variant)
    tokens, mask = ragged()
    toks, logits, _ = kvjax.generate(params, config, tokens, NEW,
                                     attention_mask=mask, return_logits=True)
    chex.assert_shape(toks, (len(LENGTHS), NEW))
    chex.assert_shape(logits, (len(LENGTHS), NEW, config.vocab_size))
    chex.assert_tree_all_finite(logits)
    for b, n in enumerate(LENGTHS):
      alone = tokens[b:b + 1, T - n:]  # no padding, no mask
      a_toks, a_logits, _ = kvjax.generate(params, config, alone, NEW,
                                           return_logits=True)
      np.testing.assert_array_equal(np.asarray(toks[b]),
                                    np.asarray(a_toks[0]),
                                    err_msg=f"{variant} sequence {b}")
      assert_close(logits[b], a_logits[0], config)

  @cases.variants()
  def test_padding_content_is_never_attended(self, variant):
    config, params = tiny(variant), tiny_params(variant)
    a_tok, mask = ragged(pad_fill=0)
    b_tok, _ = ragged(pad_fill=255)
    c_tok = np.where(mask, a_tok, np.random.default_rng(5).integers(
        0, 256, size=a_tok.shape)).astype(np.int32)
    real = mask.astype(bool)
    outs = []
    for tok in (a_tok, b_tok, c_tok):
      cache = kvjax.init_cache(config, len(LENGTHS), 32)
      logits, cache = kvjax.prefill(params, config, tok, cache,
                                    attention_mask=mask, all_logits=True)
      step, cache = kvjax.decode_step(params, config,
                                      jnp.ones((len(LENGTHS),), jnp.int32),
                                      cache)
      outs.append((np.asarray(logits)[real], step))
    assert_close(outs[0], outs[1], config)
    assert_close(outs[0], outs[2], config)

  @cases.variants()
  def test_cache_holds_each_sequence_own_length(self, variant):
    config, params = tiny(variant), tiny_params(variant)
    tokens, mask = ragged()
    cache = kvjax.init_cache(config, len(LENGTHS), 32)
    # all_logits as in the padding test: one compiled prefill for both.
    _, cache = kvjax.prefill(params, config, tokens, cache,
                             attention_mask=mask, all_logits=True)
    n = np.asarray(LENGTHS)
    np.testing.assert_array_equal(np.asarray(cache.length), n)
    pos = np.asarray(cache.positions)
    for b, nb in enumerate(n):
      np.testing.assert_array_equal(pos[b, :nb], np.arange(nb))
      self.assertTrue((pos[b, nb:] == -1).all())
    payload = [cache.c_kv, cache.k_rope] if config.attention == "mla" else [
        cache.k, cache.v]
    for x in payload:
      x = np.asarray(x)
      for b, nb in enumerate(n):
        slots = x[:, b, nb:] if config.attention == "mla" else x[:, b, :,
                                                                  nb:]
        self.assertTrue((slots == 0).all(), "padding was written to the cache")
        filled = x[:, b, :nb] if config.attention == "mla" else x[:, b, :,
                                                                   :nb]
        self.assertTrue((np.abs(filled).sum(axis=-1) > 0).all())

  @cases.variants()
  def test_ragged_decode_equals_the_ragged_forward(self, variant):
    # Decode steps after a ragged prefill equal the no-cache forward of the
    # same left-padded batch extended by the same tokens (the forward's own
    # raggedness is checked against single sequences above).
    config, params = tiny(variant), tiny_params(variant)
    tokens, mask = ragged()
    extra = np.random.default_rng(3).integers(1, 256, size=(len(LENGTHS), 3))
    cache = kvjax.init_cache(config, len(LENGTHS), 32)
    _, cache = kvjax.prefill(params, config, tokens, cache,
                             attention_mask=mask, all_logits=True)
    steps = []
    for j in range(extra.shape[1]):
      lg, cache = kvjax.decode_step(params, config, jnp.asarray(extra[:, j]),
                                    cache)
      steps.append(lg)
    full = kvjax.forward(
        params, config, np.concatenate([tokens, extra], axis=1).astype(
            np.int32),
        attention_mask=np.concatenate([mask, np.ones_like(extra)], axis=1))
    assert_close(jnp.stack(steps, axis=1), full[:, T:], config)
    np.testing.assert_array_equal(np.asarray(cache.length),
                                  np.asarray(LENGTHS) + extra.shape[1])


class BucketTest(parameterized.TestCase):

  def test_bucket_length(self):
    self.assertEqual([inference.bucket_length(n) for n in
                      (1, 15, 16, 17, 32, 33, 100)],
                     [16, 16, 16, 32, 32, 64, 128])

  def test_new_prompt_lengths_in_a_bucket_do_not_recompile(self):
    # A config no other test uses (init_scale does not enter the forward),
    # so the first call is this test's own trace.
    config = dataclasses.replace(tiny("gqa"), init_scale=0.1501)
    params = kvjax.init_params(config, jax.random.key(0))
    count = inference._generate._cache_size  # pylint: disable=protected-access
    start = count()

    def run(lengths, bucket=True):
      tokens, mask = ragged(lengths, T=max(lengths), seed=sum(lengths))
      kvjax.generate(params, config, tokens, 3, attention_mask=mask,
                     bucket=bucket)

    for lengths in ((1, 5), (9, 9), (16, 2), (3, 11)):  # all in bucket 16
      run(lengths)
    self.assertEqual(count() - start, 1, "one trace for prompts up to 16")
    run((17, 4))  # bucket 32: a second program
    self.assertEqual(count() - start, 2)
    run((20, 30))  # still bucket 32
    self.assertEqual(count() - start, 2)
    # Without bucketing every prompt length is a new program.
    run((5, 2), bucket=False)
    run((6, 2), bucket=False)
    self.assertEqual(count() - start, 4)


class AttentionImplTest(parameterized.TestCase):
  """`jax_nn` (jax.nn.dot_product_attention, XLA's implementation) and
  `cudnn` (cuDNN flash attention, GPU) against the portable einsum, on
  ragged batches."""

  @cases.variants(GQA_FAMILY, fast=("gqa",))
  def test_jax_nn_equals_einsum(self, variant):
    einsum_cfg = tiny(variant)
    self.assertEqual(einsum_cfg.attention_impl, "einsum")
    nn_cfg = dataclasses.replace(einsum_cfg, attention_impl="jax_nn")
    params = tiny_params(variant)
    tokens, mask = ragged()
    real = mask.astype(bool)
    a = kvjax.forward(params, einsum_cfg, tokens, attention_mask=mask)
    b = kvjax.forward(params, nn_cfg, tokens, attention_mask=mask)
    chex.assert_tree_all_finite(b)  # padding rows too
    assert_close(np.asarray(a)[real], np.asarray(b)[real], einsum_cfg)

  # Decode through jax_nn for the grouped variants (G > 1: MHA's decode is
  # the same call with G = 1, and its forward is checked above).
  @cases.variants(tuple(v for v in GQA_FAMILY if tiny(v).groups > 1))
  @pytest.mark.slow  # two generates per variant; the forward is above
  def test_jax_nn_generation_equals_einsum(self, variant):
    einsum_cfg = tiny(variant)
    nn_cfg = dataclasses.replace(einsum_cfg, attention_impl="jax_nn")
    params = tiny_params(variant)
    tokens, mask = ragged()
    ga = kvjax.generate(params, einsum_cfg, tokens, NEW, attention_mask=mask,
                        return_logits=True)
    gb = kvjax.generate(params, nn_cfg, tokens, NEW, attention_mask=mask,
                        return_logits=True)
    np.testing.assert_array_equal(np.asarray(ga[0]), np.asarray(gb[0]))
    assert_close(ga[1], gb[1], einsum_cfg)

  def test_cudnn_impl_on_gpu_and_a_clear_error_elsewhere(self):
    # 'cudnn' asks jax.nn.dot_product_attention for cuDNN flash attention
    # (half precision only). On a GPU it must agree with the einsum in the
    # same dtype; elsewhere it must fail loudly at trace time, not fall back.
    base = dataclasses.replace(tiny("gqa"), compute_dtype="bfloat16")
    cudnn = dataclasses.replace(base, attention_impl="cudnn")
    params = tiny_params("gqa")
    tokens, mask = ragged()
    if jax.default_backend() != "gpu":
      with self.assertRaisesRegex(RuntimeError, "cuDNN"):
        kvjax.forward(params, cudnn, tokens, attention_mask=mask)
      return
    real = mask.astype(bool)
    a = np.asarray(kvjax.forward(params, base, tokens, attention_mask=mask))
    b = np.asarray(kvjax.forward(params, cudnn, tokens,
                                 attention_mask=mask))
    self.assertTrue(np.isfinite(b).all())
    err = np.linalg.norm(a[real] - b[real]) / np.linalg.norm(a[real])
    self.assertLess(err, 2e-2)  # bfloat16 rounding, not a different result


if __name__ == "__main__":
  absltest.main()
