"""The int2 KV cache (KIVI's 2-bit setting): asymmetric codes in [0, 3],
eight an int16, a float32 scale and zero per vector.

Invariants:
  * packing is lossless on codes; the round trip of any vector is within
    half a step, (max - min) / 6, per element, and its minimum and maximum
    come back (codes 0 and 3) to float32 rounding; a constant vector comes
    back exactly;
  * the payload is int16 of an eighth of the width ([L, B, K, S, H / 8];
    MLA [L, B, S, C / 8], [L, B, S, R / 8]) with (scale, zero) pairs, and
    `kv_bytes_per_token` is exact: the real nbytes, the formula
    L × (2 × K × H / 4 + 2 × K × 8) for GQA and L × ((C + R) / 4 + 16) for
    MLA, and the eval_shaped cache of published models (that check, and
    the next, shared with tests/test_int4.py);
  * what a decode writes is the quantization of the float rows: layer 0's
    cache (its rows depend on the tokens only) read back is within half a
    step of the float32 cache's rows, after prefill and after decode steps;
    the logit error is really 2-bit: above int4's;
  * `generate` equals prefill + decode steps on it; the paged cache stores
    the same codes and pairs as the contiguous one; the layered decode view
    declines it (`auto` reads the stacked cache);
  * a width that is not a multiple of 8 raises a ValueError naming the
    field before any compute.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import decode
from kvjax import layered
from kvjax import paged as pg
from kvjax import quant
from kvjax.tolerance import assert_close, max_error, tolerance

import cases  # pylint: disable=g-bad-import-order
from tiny_models import teacher_forced_decode_logits, tiny, tiny_params  # pylint: disable=g-bad-import-order,line-too-long

INT2 = kvjax.CachePolicy(kv_dtype="int2")
KINDS = cases.FAST_VARIANTS  # one KVCache (gqa), one LatentCache (mla)


def _half_step_bound(x, axis=-1):
  """Per-element bound of the round trip of x quantized over `axis`: half
  a step, plus the float32 rounding of (code · scale + zero)."""
  lo = jnp.min(x, axis=axis, keepdims=True)
  hi = jnp.max(x, axis=axis, keepdims=True)
  span = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
  return (hi - lo) / 6 + 4 * tolerance(depth=1).rtol * span


class PackingTest(parameterized.TestCase):

  def test_codes_round_trip_exactly(self):
    q = jax.random.randint(jax.random.key(0), (3, 5, 32), 0, 4, jnp.int32
                           ).astype(jnp.int8)
    packed = quant.pack_int2(q)
    self.assertEqual(packed.dtype, quant.INT2_OCTETS)
    chex.assert_shape(packed, (3, 5, 4))
    np.testing.assert_array_equal(quant.unpack_int2(packed), q)
    # Element i holds q[i + j · W/8] in bits 2j, 2j + 1.
    u = np.asarray(packed).view(np.uint16)
    for j in range(8):
      np.testing.assert_array_equal((u >> (2 * j)) & 3,
                                    np.asarray(q)[..., j * 4:(j + 1) * 4])

  def test_round_trip_is_within_half_a_step(self):
    x = jax.random.normal(jax.random.key(1), (4, 6, 16)) * 3.0 + 1.0
    stored, pair = quant.quantize(x, quant.INT2_OCTETS)
    chex.assert_shape(stored, (4, 6, 2))
    chex.assert_shape(pair, (4, 6, 2))
    back = quant.dequantize(stored, pair, jnp.float32)
    err = jnp.abs(back - x)
    self.assertTrue(bool(jnp.all(err <= _half_step_bound(x))))
    # The zero is the minimum, the top code the maximum.
    assert_close(pair[..., 1], jnp.min(x, -1), depth=1)
    assert_close(pair[..., 0] * 3 + pair[..., 1], jnp.max(x, -1), depth=1)
    codes = quant.unpack_int2(stored)
    np.testing.assert_array_equal(jnp.min(codes, -1), 0)
    np.testing.assert_array_equal(jnp.max(codes, -1), 3)
    # Really 2-bit: the error reaches a good part of the half step.
    self.assertGreater(float(jnp.max(err / _half_step_bound(x))), 0.5)

  def test_constant_vectors_come_back_exactly(self):
    x = jnp.stack([jnp.zeros(8), jnp.full(8, -2.5)])
    back = quant.dequantize(*quant.quantize(x, quant.INT2_OCTETS),
                            jnp.float32)
    np.testing.assert_array_equal(back, x)

  def test_groups_round_trip_per_channel(self):
    x = (jax.random.normal(jax.random.key(2), (2, 8, 16)) *
         jnp.arange(1.0, 17.0)[None, None] + jnp.arange(16.0)[None, None])
    stored, pair = quant.quantize_groups(x, 4, -2, quant.INT2_OCTETS)
    chex.assert_shape(stored, (2, 8, 2))
    chex.assert_shape(pair, (2, 2, 32))  # the scales, then the zeros
    back = quant.dequantize_groups(stored, pair, 4, -2, jnp.float32)
    groups = x.reshape(2, 2, 4, 16)
    bound = _half_step_bound(groups, axis=2).reshape(2, 2, 1, 16)
    err = jnp.abs(back.reshape(2, 2, 4, 16) - groups)
    self.assertTrue(bool(jnp.all(err <= bound)))
    assert_close(pair[..., 16:], jnp.min(groups, axis=2), depth=1)


class CacheBytesTest(parameterized.TestCase):

  @cases.product(variant=KINDS)
  def test_bytes_formula_and_arrays(self, variant):
    config = tiny(variant)
    L = config.num_layers
    cache = kvjax.init_cache(config, 2, 16, policy=INT2)
    if config.attention == "mla":
      C, R = config.kv_lora_rank, config.qk_rope_head_dim
      formula = L * ((C + R) // 4 + 2 * 8)
      chex.assert_shape(cache.c_kv, (L, 2, 16, C // 8))
      chex.assert_shape(cache.c_scale, (L, 2, 16, 2))
      leaves = (cache.c_kv, cache.k_rope, cache.c_scale, cache.r_scale)
    else:
      K, H = config.num_kv_heads, config.head_dim
      formula = L * (2 * K * H // 4 + 2 * K * 8)
      chex.assert_shape(cache.k, (L, 2, K, 16, H // 8))
      chex.assert_shape(cache.v_scale, (L, 2, K, 16, 2))
      leaves = (cache.k, cache.v, cache.k_scale, cache.v_scale)
    per_token = kvjax.kv_bytes_per_token(config, "int2")
    self.assertEqual(per_token, formula)
    self.assertEqual(per_token * 2 * 16, sum(x.nbytes for x in leaves))
    # Half int4's codes; the (scale, zero) pair doubles its 4-byte scale,
    # so at these narrow heads (H 16) the two are level.
    self.assertLessEqual(per_token, kvjax.kv_bytes_per_token(config, "int4"))


class DecodeTest(parameterized.TestCase):

  @cases.product(variant=KINDS, slow=lambda variant: variant != "gqa")
  def test_the_cache_holds_the_quantized_rows(self, variant):
    config = tiny(variant)
    _, ref = teacher_forced_decode_logits(variant, "float32")
    _, got = teacher_forced_decode_logits(variant, "int2")
    n = 12  # 6 prompt tokens, then 6 decode steps
    if config.attention == "mla":
      pairs = ((got.c_kv, got.c_scale, ref.c_kv),
               (got.k_rope, got.r_scale, ref.k_rope))
    else:
      pairs = ((got.k, got.k_scale, ref.k), (got.v, got.v_scale, ref.v))
    for stored, pair, rows in pairs:
      back = quant.dequantize(stored[0], pair[0], jnp.float32)
      want = rows[0]
      filled = (slice(None),) * (want.ndim - 2) + (slice(0, n),)
      err = jnp.abs(back - want)[filled]
      self.assertTrue(bool(jnp.all(err <= _half_step_bound(want)[filled])))
      # Empty slots hold zeros.
      empty = (slice(None),) * (want.ndim - 2) + (slice(n, None),)
      np.testing.assert_array_equal(back[empty], 0)

  @cases.product(variant=KINDS)
  def test_logit_error_is_two_bit(self, variant):
    ref, _ = teacher_forced_decode_logits(variant, "float32")
    got, _ = teacher_forced_decode_logits(variant, "int2")
    int4, _ = teacher_forced_decode_logits(variant, "int4")
    chex.assert_tree_all_finite(got)
    err2, _ = max_error(got, ref)
    err4, _ = max_error(int4, ref)
    self.assertGreater(err2, err4)

  def test_layered_declines_int2(self):
    config = tiny("gqa")
    cache = kvjax.init_cache(config, 4, 4096, policy=INT2)
    self.assertIn("kv_dtype='int2'", layered.supports(cache, 2048))
    plan = decode.plan(tiny_params("gqa"), config, INT2, 4, 2048, 64, 4096)
    self.assertEqual(set(plan.layouts or (plan.layout,)), {"stacked"})


class PagedTest(parameterized.TestCase):

  def test_paged_equals_contiguous(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    B, T, Y, M, Z = 2, 9, 8, 4, 12
    tokens = np.random.default_rng(0).integers(0, 256, (B, T)).astype(
        np.int32)
    ref = kvjax.init_cache(config, B, M * Y, policy=INT2)
    paged = pg.init_paged(config, B, Z, Y, M, INT2)
    table = np.random.default_rng(1).permutation(Z)[:B * M].reshape(B, M)
    paged = paged.replace(block_table=jnp.asarray(table, jnp.int32))
    self.assertEqual(pg.page_bytes(paged),
                     kvjax.kv_bytes_per_token(config, "int2") * Y)
    ref_logits, ref = kvjax.prefill(params, config, tokens, ref)
    logits, paged = pg.prefill(params, config, tokens, paged)
    assert_close(logits, ref_logits, config)
    token = jnp.argmax(ref_logits, axis=-1).astype(jnp.int32)
    for _ in range(2):
      ref_logits, ref = kvjax.decode_step(params, config, token, ref)
      logits, paged = pg.decode_step(params, config, token, paged)
      assert_close(logits, ref_logits, config)
      token = jnp.argmax(ref_logits, axis=-1).astype(jnp.int32)
    view = pg.view(paged, M)
    for name in paged.pool:
      got, want = getattr(view, name), getattr(ref, name)
      self.assertEqual(got.dtype, want.dtype, name)
      if got.dtype == quant.INT2_OCTETS:  # codes: exactly
        np.testing.assert_array_equal(got, want, name)
      else:
        assert_close(got, want, config, msg=name)


class BadInputTest(parameterized.TestCase):

  def test_width_not_a_multiple_of_8_names_the_field(self):
    with self.assertRaisesRegex(ValueError, "head_dim=12 must be a multiple "
                                "of 8"):
      quant.packed_width("int2", 12, "head_dim")
    config = tiny("mla").replace(kv_lora_rank=36)
    with self.assertRaisesRegex(ValueError, "kv_lora_rank=36"):
      kvjax.init_cache(config, 1, 8, policy=INT2)
    with self.assertRaisesRegex(ValueError, "kv_lora_rank=36"):
      kvjax.kv_bytes_per_token(config, "int2")
    with self.assertRaisesRegex(ValueError, "multiple of 8"):
      quant.pack_int2(jnp.zeros((2, 12), jnp.int8))


if __name__ == "__main__":
  absltest.main()
