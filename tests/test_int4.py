"""The int4 KV cache: two signed 4-bit codes a byte, one scale per vector.

Invariants:
  * packing is lossless on codes and on representable values (codes times a
    power-of-two scale); the round trip of any vector is within half a
    quantization step, scale / 2 = max|x| / 14, per element;
  * the payload is uint8 of half the width ([L, B, K, S, H / 2]; MLA's latent
    stays latent: [L, B, S, C / 2], [L, B, S, R / 2]) with int8's float32
    scales, and `kv_bytes_per_token` is exact: the real nbytes, the formula
    L × (K × H + 8 × K) for GQA and L × ((C + R) / 2 + 8) for MLA, and the
    eval_shape'd cache of published GQA and MLA models;
  * teacher-forced decode logits with an int4 cache stay within the derived
    tolerance of the float32 cache (`kvjax.tolerance`, u = 1/14), and their
    error is int8's scaled by about the ratio of the steps (127 / 7);
    `generate` runs on it and equals prefill + decode steps;
  * the paged cache stores the same codes and scales as the contiguous one
    and gives the same logits; shared pages are copied on write; the serving
    engine's prefix sharing changes no token;
  * the blocked decode layout declines int4 (no blocked scales) and `auto`
    falls back to the stacked cache;
  * an odd width (head_dim, kv_lora_rank) raises a ValueError naming the
    field before any compute, as do KIVI keys and bad packing input.
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
from kvjax import blocked
from kvjax import decode
from kvjax import engine as E
from kvjax import layered
from kvjax import paged as pg
from kvjax import quant
from kvjax.lab import published
from kvjax.tolerance import assert_close, max_error, tolerance, unit_roundoff

import cases  # pylint: disable=g-bad-import-order
from tiny_models import teacher_forced_decode_logits, tiny, tiny_params  # pylint: disable=g-bad-import-order,line-too-long

INT4 = kvjax.CachePolicy(kv_dtype="int4")
KINDS = cases.FAST_VARIANTS  # one KVCache (gqa), one LatentCache (mla)


class PackingTest(parameterized.TestCase):

  def test_codes_round_trip_exactly(self):
    q = jax.random.randint(jax.random.key(0), (3, 5, 16), -8, 8, jnp.int32
                           ).astype(jnp.int8)
    packed = quant.pack_int4(q)
    self.assertEqual(packed.dtype, jnp.uint8)
    chex.assert_shape(packed, (3, 5, 8))
    np.testing.assert_array_equal(quant.unpack_int4(packed), q)
    # Byte i: code i in the low nibble, code i + W/2 in the high one.
    u = np.asarray(q).astype(np.int64) & 0xF
    np.testing.assert_array_equal(packed, u[..., :8] | (u[..., 8:] << 4))
    # Zero codes are zero bytes: an empty slot reads as zeros.
    np.testing.assert_array_equal(
        quant.pack_int4(jnp.zeros((2, 4), jnp.int8)), 0)

  def test_representable_values_round_trip_exactly(self):
    # codes in [-7, 7] with a 7 in every vector, times a power-of-two scale:
    # the scale max|x| / 7 and every product are then exact.
    codes = jax.random.randint(jax.random.key(1), (4, 3, 32), -7, 8,
                               jnp.int32)
    codes = codes.at[..., 5].set(7)
    scale = 2.0 ** jnp.arange(-3, 1, dtype=jnp.float32)
    x = codes.astype(jnp.float32) * scale[:, None, None]
    stored, s = quant.quantize(x, quant.storage_dtype("int4"))
    chex.assert_shape(stored, (4, 3, 16))
    np.testing.assert_array_equal(s, jnp.broadcast_to(scale[:, None], (4, 3)))
    np.testing.assert_array_equal(quant.dequantize(stored, s, jnp.float32), x)

  def test_round_trip_is_within_half_a_step(self):
    x = jax.random.normal(jax.random.key(2), (3, 5, 16)) * jnp.arange(
        1.0, 17.0)[None, None]
    stored, s = quant.quantize(x, quant.INT4_PAIRS)
    chex.assert_shape(s, (3, 5))
    assert_close(s, jnp.max(jnp.abs(x), axis=-1) / 7.0, depth=1)
    codes = quant.unpack_int4(stored).astype(jnp.int32)
    self.assertLessEqual(int(jnp.max(jnp.abs(codes))), 7)  # never -8
    self.assertEqual(int(jnp.min(jnp.max(jnp.abs(codes), axis=-1))), 7)
    err = jnp.abs(quant.dequantize(stored, s, jnp.float32) - x)
    # |x - dq(q(x))| <= scale / 2, plus the rounding of the product.
    self.assertTrue(bool(jnp.all(
        err <= s[..., None] * (0.5 + tolerance(depth=1).rtol))))
    # The bound is tight enough to tell int4 from int8 (1/254 of the max).
    self.assertGreater(float(jnp.max(err / s[..., None])), 0.3)

  def test_zero_vectors_stay_zero_and_finite(self):
    stored, s = quant.quantize(jnp.zeros((2, 8)), quant.INT4_PAIRS)
    out = quant.dequantize(stored, s, jnp.float32)
    chex.assert_tree_all_finite(out)
    np.testing.assert_array_equal(out, 0)

  def test_unit_roundoff_is_half_a_step(self):
    self.assertEqual(unit_roundoff("int4"), 1.0 / 14.0)


class CacheBytesTest(parameterized.TestCase):

  # Shapes, scales and nbytes of the int4 cache: test_quant's storage test.
  @cases.product(variant=KINDS)
  def test_bytes_formula(self, variant):
    config = tiny(variant)
    L = config.num_layers
    if config.attention == "mla":
      C, R = config.kv_lora_rank, config.qk_rope_head_dim
      formula = L * ((C + R) // 2 + 2 * 4)
    else:
      K, H = config.num_kv_heads, config.head_dim
      formula = L * (2 * K * H // 2 + 2 * K * 4)
    per_token = kvjax.kv_bytes_per_token(config, "int4")
    self.assertIsInstance(per_token, int)
    self.assertEqual(per_token, formula)
    self.assertLess(per_token, kvjax.kv_bytes_per_token(config, "int8"))

  # int2 (tests/test_int2.py) shares the packed-codes accounting.
  @cases.product(name=("Llama-3-8B", "DeepSeek-V2"), kv_dtype=("int4", "int2"))
  def test_published_models_match_the_eval_shaped_cache(self, name, kv_dtype):
    c = published.get(name)
    per_token = kvjax.kv_bytes_per_token(c, kv_dtype)
    self.assertEqual(per_token, published.cache_nbytes(c, 1, 1, kv_dtype))
    # Codes per byte, and the bytes of a token's scale (int2: scale and
    # zero).
    codes, scale = (2, 4) if kv_dtype == "int4" else (4, 8)
    if c.attention == "mla":  # 60 layers, C 512, R 64
      self.assertEqual(per_token, c.num_layers * (
          (c.kv_lora_rank + c.qk_rope_head_dim) // codes + 2 * scale))
    else:  # 32 layers, K 8, H 128
      self.assertEqual(per_token, c.num_layers * c.num_kv_heads * 2 * (
          c.head_dim // codes + scale))
    self.assertEqual(published.table_row(name, c, tokens=(8,), batches=(1,),
                                         kv_dtype=kv_dtype)["bytes_per_token"],
                     per_token)


class DecodeTest(parameterized.TestCase):

  @cases.product(variant=KINDS)
  def test_decode_logits_are_close_to_float32(self, variant):
    ref, _ = teacher_forced_decode_logits(variant, "float32")
    got, _ = teacher_forced_decode_logits(variant, "int4")
    int8, _ = teacher_forced_decode_logits(variant, "int8")
    chex.assert_tree_all_finite(got)
    # Per-element storage error is u(int4) = 1/14 of the vector max, carried
    # through the layers (`kvjax.tolerance`).
    assert_close(got, ref, tiny(variant), cache="int4")
    # The error is int8's scaled by about the ratio of the steps
    # (u(int4) / u(int8) = 127 / 7): really 4-bit, and no worse than the
    # step says (a wrong scale, nibble order or sign breaks this).
    err4, _ = max_error(got, ref)
    err8, _ = max_error(int8, ref)
    ratio = unit_roundoff("int4") / unit_roundoff("int8")
    self.assertGreater(err4, err8)
    self.assertLess(err4, 3 * ratio * err8)

  # int2 (tests/test_int2.py) runs the same check.
  @cases.product(variant=KINDS, kv_dtype=("int4", "int2"),
                 slow=lambda variant, kv_dtype: variant != "gqa")
  def test_generate_equals_prefill_and_decode_steps(self, variant, kv_dtype):
    policy = kvjax.CachePolicy(kv_dtype=kv_dtype)
    config, params = tiny(variant), tiny_params(variant)
    prompt = jax.random.randint(jax.random.key(3), (2, 8), 0,
                                config.vocab_size)
    toks, logits, _ = kvjax.generate(params, config, prompt, 4, policy=policy,
                                     capacity=16, bucket=False,
                                     return_logits=True)
    chex.assert_tree_all_finite(logits)
    cache = kvjax.init_cache(config, 2, 16, policy=policy)
    step_logits, cache = kvjax.prefill(params, config, prompt, cache)
    want, want_logits = [], []
    for _ in range(4):
      token = jnp.argmax(step_logits, -1).astype(jnp.int32)
      want.append(token)
      want_logits.append(step_logits)
      step_logits, cache = kvjax.decode_step(params, config, token, cache)
    np.testing.assert_array_equal(toks, jnp.stack(want, axis=1))
    # The same stored values are read: compute rounding only.
    assert_close(logits, jnp.stack(want_logits, axis=1), config)


class PagedTest(parameterized.TestCase):
  """tests/test_paged.py's comparison, with the int4 cache."""

  B, T, Y, M, Z = 3, 11, 8, 8, 40  # rows, prompt, page size, pages/row, pool
  LENGTHS = (11, 7, 2)

  def scattered(self, config):
    rng = np.random.default_rng(0)
    table = rng.permutation(self.Z)[:self.B * self.M].reshape(
        self.B, self.M).astype(np.int32)
    paged = pg.init_paged(config, self.B, self.Z, self.Y, self.M, INT4)
    return paged.replace(block_table=jnp.asarray(table))

  # Compiles prefill, decode and extend twice (~25 s cold): MLA is slow.
  @cases.product(variant=KINDS, slow=lambda variant: variant != "gqa")
  def test_paged_equals_contiguous(self, variant):
    config, params = tiny(variant), tiny_params(variant)
    B, T, Y, M = self.B, self.T, self.Y, self.M
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (B, T)).astype(np.int32)
    mask = (np.arange(T)[None] >= T - np.asarray(self.LENGTHS)[:, None]
            ).astype(np.int32)
    ref = kvjax.init_cache(config, B, M * Y, policy=INT4)
    paged = self.scattered(config)
    self.assertEqual(pg.page_bytes(paged),
                     kvjax.kv_bytes_per_token(config, "int4") * Y)
    ref_logits, ref = kvjax.prefill(params, config, tokens, ref,
                                    attention_mask=mask)
    logits, paged = pg.prefill(params, config, tokens, paged,
                               attention_mask=mask)
    # Same values stored the same way: the logits differ by compute
    # rounding only (float32 tolerance, not int4's).
    assert_close(logits, ref_logits, config)
    token = jnp.argmax(ref_logits, axis=-1).astype(jnp.int32)
    for _ in range(3):
      ref_logits, ref = kvjax.decode_step(params, config, token, ref)
      logits, paged = pg.decode_step(params, config, token, paged)
      assert_close(logits, ref_logits, config)
      np.testing.assert_array_equal(jnp.argmax(logits, -1),
                                    jnp.argmax(ref_logits, -1))
      token = jnp.argmax(ref_logits, axis=-1).astype(jnp.int32)
    chunk = rng.integers(0, 256, (B, 5)).astype(np.int32)
    ref_logits, ref = kvjax.extend(params, config, chunk, ref)
    logits, paged = pg.extend(params, config, chunk, paged)
    assert_close(logits, ref_logits, config)
    # The pages, read in block-table order, hold the contiguous cache's
    # codes (an integer cache: compared exactly) and scales.
    view = pg.view(paged, M)
    np.testing.assert_array_equal(view.positions, ref.positions)
    for name in paged.pool:
      got, want = getattr(view, name), getattr(ref, name)
      self.assertEqual(got.dtype, want.dtype, name)
      if got.dtype == jnp.uint8:
        np.testing.assert_array_equal(got, want, name)
      else:
        assert_close(got, want, config, msg=name)

  @pytest.mark.slow
  def test_prefix_sharing_changes_no_token(self):
    spec = E.EngineSpec(rows=3, page_size=4, num_pages=16, capacity=64,
                        chunk=8, prefill_rows=2, decode_steps=4,
                        min_view_slots=32, policy=INT4)
    system = tuple(np.random.default_rng(7).integers(0, 256, 20).tolist())
    reqs = [E.Request(id=i, prompt=system + (i + 1, i + 2),
                      max_new_tokens=8, arrival=float(0 if i == 0 else 3 + i))
            for i in range(3)]
    runs = {}
    for sharing in (True, False):
      eng = E.Engine(tiny_params("gqa"), tiny("gqa"),
                     dataclasses.replace(spec, prefix_caching=sharing))
      runs[sharing] = eng.run(reqs)
    for r in reqs:
      self.assertEqual(runs[True].results[r.id].tokens,
                       runs[False].results[r.id].tokens, r.id)
    # 20 system tokens = 5 pages of 4, shared by the 2nd and 3rd request.
    self.assertEqual(runs[True].summary["cached_tokens"], 2 * 20)


class BlockedTest(parameterized.TestCase):

  def test_blocked_declines_int4_and_layered_takes_it(self):
    config = tiny("gqa")
    params = kvjax.pack(tiny_params("gqa"), config)
    cache = kvjax.init_cache(config, 8, 4096, policy=INT4)
    self.assertIn("kv_dtype='int4'", blocked.supports(cache, 128))
    self.assertIsNone(layered.supports(cache, 128))
    # A per-layer view at every batch: the native kernel's where it is
    # built, else the layered integer attention.
    self.assertIn(decode.plan(params, config, INT4, 1, 64, 3000,
                              4096).layout, ("native", "layered"))
    with self.assertRaisesRegex(ValueError, "kv_dtype='int4'"):
      kvjax.generate(params, config, jnp.zeros((2, 8), jnp.int32), 20,
                     policy=INT4, decode_layout="blocked")


class BadInputTest(parameterized.TestCase):

  def test_odd_latent_width_names_the_field(self):
    config = tiny("mla").replace(kv_lora_rank=63)
    with self.assertRaisesRegex(ValueError, "kv_lora_rank=63"):
      kvjax.init_cache(config, 1, 8, policy=INT4)
    with self.assertRaisesRegex(ValueError, "kv_lora_rank=63"):
      kvjax.kv_bytes_per_token(config, "int4")
    with self.assertRaisesRegex(ValueError, "kv_lora_rank=63"):
      pg.init_paged(config, 1, 4, 8, 2, INT4)
    kvjax.init_cache(config, 1, 8, dtype="int8")  # int8 has no such limit

  def test_odd_head_dim_names_the_field(self):
    # ModelConfig keeps H even (RoPE rotates pairs); the int4 check names
    # the field for any width it is given.
    with self.assertRaisesRegex(ValueError, "head_dim=15 must be a multiple"):
      quant.packed_width("int4", 15, "head_dim")
    self.assertEqual(quant.packed_width("int8", 15, "head_dim"), 15)
    with self.assertRaisesRegex(ValueError, "last axis=7"):
      quant.pack_int4(jnp.zeros((2, 7), jnp.int8))

  def test_kivi_keys_need_integer_codes(self):
    # KIVI keys are int8 or int4 codes (tests/test_kivi.py); a float cache
    # has no codes to group.
    kvjax.CachePolicy(kv_dtype="int4", key_quant="channel")
    with self.assertRaisesRegex(ValueError, "got 'float16'"):
      kvjax.CachePolicy(kv_dtype="float16", key_quant="channel")
    with self.assertRaisesRegex(ValueError, "key_group.*got 'bfloat16'"):
      kvjax.kv_bytes_per_token(tiny("gqa"), "bfloat16", key_group=4)

  def test_cache_of_another_width_names_the_field(self):
    # The packed width is read as the head_dim it stores (2 x H / 2).
    config = tiny("gqa")
    H = config.head_dim
    cache = kvjax.init_cache(config.replace(head_dim_override=2 * H), 1, 16,
                             policy=INT4)
    with self.assertRaisesRegex(
        ValueError, f"built for head_dim={2 * H}, the config has "
        f"head_dim={H}"):
      kvjax.prefill(tiny_params("gqa"), config, jnp.zeros((1, 4), jnp.int32),
                    cache)


if __name__ == "__main__":
  absltest.main()
