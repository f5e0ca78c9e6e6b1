"""Quantized and low-precision KV caches, for every attention variant.

Invariants: stored dtype and scale shapes are what the policy asks for (the
MLA latent is quantized as a latent); bytes per token = real nbytes incl.
scales; int8 round trip is within half a quantization step; decode logits
with a quantized cache stay within a bound of the float32 cache; bfloat16
compute runs and stays close to float32; bad kv dtypes raise.
"""


from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import quant
from kvjax.tolerance import assert_close, tolerance
from configs import model as model_presets

VARIANTS = model_presets.VARIANTS
# The first variant of each attention kind: one KVCache, one LatentCache.
KINDS = tuple({model_presets.model_dict(v, "tiny")["attention"]: v
               for v in reversed(VARIANTS)}.values())
KV_DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")


import cases  # pylint: disable=g-bad-import-order
from tiny_models import teacher_forced_decode_logits, tiny, tiny_params  # pylint: disable=g-bad-import-order,line-too-long


def _storage(cache):
  """(payload arrays, scale arrays) of a cache of either kind."""
  if isinstance(cache, kvjax.LatentCache):
    return (cache.c_kv, cache.k_rope), (cache.c_scale, cache.r_scale)
  return (cache.k, cache.v), (cache.k_scale, cache.v_scale)


class QuantizeTest(parameterized.TestCase):

  def test_int8_round_trip_is_within_half_a_step(self):
    x = jax.random.normal(jax.random.key(0), (3, 5, 16)) * jnp.arange(
        1.0, 17.0)[None, None]
    q, s = quant.quantize(x, jnp.int8)
    chex.assert_shape(s, (3, 5))
    self.assertEqual(q.dtype, jnp.int8)
    assert_close(s, jnp.max(jnp.abs(x), axis=-1) / 127.0, depth=1)
    err = jnp.abs(quant.dequantize(q, s, jnp.float32) - x)
    # Half a step, plus the rounding of the dequantizing product.
    self.assertTrue(bool(jnp.all(
        err <= s[..., None] * (0.5 + tolerance(depth=1).rtol))))
    # The largest entry of every vector is represented exactly (±127).
    self.assertEqual(int(jnp.max(jnp.abs(q.astype(jnp.int32)))), 127)

  def test_zero_vectors_stay_zero_and_finite(self):
    q, s = quant.quantize(jnp.zeros((2, 8)), jnp.int8)
    out = quant.dequantize(q, s, jnp.float32)
    chex.assert_tree_all_finite(out)
    np.testing.assert_array_equal(out, 0)

  @cases.product(dtype=("float32", "bfloat16", "float16"))
  def test_float_storage_is_a_cast(self, dtype):
    x = jax.random.normal(jax.random.key(1), (4, 8))
    q, s = quant.quantize(x, quant.storage_dtype(dtype))
    self.assertIsNone(s)
    # bfloat16 is stored as its bits (uint16: a fast scatter on CPU).
    self.assertEqual(q.dtype, jnp.uint16 if dtype == "bfloat16" else dtype)
    np.testing.assert_array_equal(quant.dequantize(q, None, jnp.float32),
                                  x.astype(dtype).astype(jnp.float32))


class QuantizedCacheTest(chex.TestCase):

  # Fast tier: the float32 and int8 caches of GQA and MLA (the programs the
  # logit-error test below compiles anyway).
  @cases.product(variant=VARIANTS, kv_dtype=KV_DTYPES,
                 slow=lambda variant, kv_dtype: (
                     variant not in cases.FAST_VARIANTS or
                     kv_dtype not in ("float32", "int8")))
  def test_storage_dtypes_shapes_and_bytes(self, variant, kv_dtype):
    config = tiny(variant)
    B, S = 2, 16
    _, cache = teacher_forced_decode_logits(variant, kv_dtype)
    payload, scales = _storage(cache)
    L = config.num_layers
    n = quant.values_per_element(kv_dtype)  # int4: two codes a byte
    if config.attention == "mla":
      # The latent stays latent when quantized: [L, B, S, C] and [L, B, S, R].
      chex.assert_shape(payload, [(L, B, S, config.kv_lora_rank // n),
                                  (L, B, S, config.qk_rope_head_dim // n)])
      scale_shape = (L, B, S)
    else:
      K, H = config.num_kv_heads, config.head_dim
      chex.assert_shape(payload, [(L, B, K, S, H // n)] * 2)
      scale_shape = (L, B, K, S)
    for x in payload:
      self.assertEqual(x.dtype, quant.storage_dtype(kv_dtype))
    if kv_dtype in ("int8", "int4"):
      chex.assert_shape(scales, [scale_shape] * 2)
      for s in scales:
        self.assertEqual(s.dtype, jnp.float32)
      # Filled slots carry positive scales; empty ones zero.
      filled = np.asarray(cache.positions >= 0)
      s0 = np.asarray(scales[0][0])
      s0 = s0 if s0.ndim == 2 else s0.max(axis=1)
      self.assertTrue((s0[filled] > 0).all())
      self.assertTrue((s0[~filled] == 0).all())
    else:
      self.assertEqual(scales, (None, None))
    nbytes = sum(x.size * x.dtype.itemsize for x in payload + scales
                 if x is not None)
    self.assertEqual(kvjax.kv_bytes_per_token(config, kv_dtype) * B * S,
                     nbytes)
    self.assertEqual(kvjax.cache_bytes(cache)["kv"], nbytes)

  @cases.product(variant=VARIANTS, kv_dtype=("bfloat16", "float16", "int8"),
                 slow=lambda variant, kv_dtype: (
                     variant not in cases.FAST_VARIANTS or kv_dtype != "int8"))
  def test_decode_logit_error_is_bounded(self, variant, kv_dtype):
    ref, _ = teacher_forced_decode_logits(variant, "float32")
    got, _ = teacher_forced_decode_logits(variant, kv_dtype)
    chex.assert_tree_all_finite(got)
    # Per-element storage error is u(kv_dtype) (2^-8 bf16, 2^-11 f16, 1/254
    # of the vector max int8), carried through the layers
    # (`kvjax.tolerance`). A wrong scale or layout breaks this.
    assert_close(got, ref, tiny(variant), cache=kv_dtype)
    # The cache really was stored lossy.
    self.assertGreater(float(jnp.max(jnp.abs(got - ref))), 0.0)

  @cases.product(variant=KINDS)
  def test_bfloat16_compute_runs_close_to_float32(self, variant):
    config, params = tiny(variant), tiny_params(variant)
    tokens = jax.random.randint(jax.random.key(2), (2, 8), 0,
                                config.vocab_size)
    ref = kvjax.forward(params, config, tokens)
    bf = config.replace(compute_dtype="bfloat16")
    got = kvjax.forward(params, bf, tokens)
    self.assertEqual(got.dtype, jnp.float32)
    chex.assert_tree_all_finite(got)
    err = float(jnp.max(jnp.abs(got - ref)))
    self.assertLess(err, 0.05 * float(jnp.max(jnp.abs(ref))))
    self.assertGreater(err, 0.0)  # the compute really ran in bfloat16


class BadInputTest(parameterized.TestCase):

  @cases.product(kv_dtype=("int3", "float64", "fp8"))
  def test_unsupported_kv_dtype_names_the_field(self, kv_dtype):
    with self.assertRaisesRegex(ValueError, "kv_dtype"):
      kvjax.CachePolicy(kv_dtype=kv_dtype)

  def test_unsupported_dtype_in_bytes_formula(self):
    with self.assertRaisesRegex(ValueError, "kv dtype"):
      kvjax.kv_bytes_per_token(tiny("gqa"), "int3")

  def test_unsupported_key_quant_names_the_field(self):
    with self.assertRaisesRegex(ValueError, "key_quant"):
      kvjax.CachePolicy(kv_dtype="int8", key_quant="block")


if __name__ == "__main__":
  absltest.main()
