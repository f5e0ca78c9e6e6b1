"""KIVI per-channel int8 and int4 keys (`CachePolicy(key_quant='channel')`).

Invariant (kvjax/kivi.py): every complete key group is stored as
`quant.quantize_groups` of its full-precision rows, the newest group is read
exactly from the float32 residual (GQA keys; MLA's latent and rotary key).
Layer 0's rows depend on the tokens only (not on earlier attention), so the
float32 cache of the same tokens gives the exact full-precision rows to
check against, whichever path wrote them:
prefill, decode steps, chunked prefill with chunks that straddle groups,
left-padded ragged batches. Also: logits stay close to float32, the bytes
formula equals the real arrays, bad policies raise naming the field.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import kivi
from kvjax import model
from kvjax import quant
from kvjax import sharding
from kvjax.tolerance import assert_close, tolerance
import cases
from tiny_models import tiny, tiny_params

GROUP, S, B = 4, 32, 2
KIVI = kvjax.CachePolicy(kv_dtype="int8", key_quant="channel",
                         key_group=GROUP)
# KIVI's 4-bit setting: int4 keys per channel, int4 values per token.
KIVI4 = kvjax.CachePolicy(kv_dtype="int4", key_quant="channel",
                          key_group=GROUP)
# And its 2-bit setting: asymmetric codes with a zero per group / token.
KIVI2 = kvjax.CachePolicy(kv_dtype="int2", key_quant="channel",
                          key_group=GROUP)
POLICIES = {"int8": KIVI, "int4": KIVI4, "int2": KIVI2}


def _tokens(config, n, batch=B, seed=1):
  return jax.random.randint(jax.random.key(seed), (batch, n), 0,
                            config.vocab_size)


def prefill_then_decode(variant, policy, tokens, n_prompt, mask=None):
  """Prefill n_prompt tokens, then teacher-forced decode of the rest.
  Returns (logits [B, n_steps + 1, V], cache)."""
  config, params = tiny(variant), tiny_params(variant)
  batch = tokens.shape[0]
  cache = kvjax.init_cache(config, batch, S, policy=policy)
  mask = jnp.ones((batch, n_prompt), bool) if mask is None else mask
  # Both jitted: an eager prefill compiles each of its ops on its own.
  prefill = jax.jit(model.prefill_logits, static_argnums=(1, 5))
  step = jax.jit(model.decode_logits, static_argnums=1)
  logits, cache = prefill(params, config, tokens[:, :n_prompt], mask, cache,
                          False)
  out = [logits[:, 0]]
  for t in range(n_prompt, tokens.shape[1]):
    logits, cache = step(params, config, tokens[:, t], cache)
    out.append(logits)
  return jnp.stack(out, 1), cache


def _triples(cache):
  """(payload, scale, residual) stacks a KIVI cache quantizes per channel."""
  if isinstance(cache, kvjax.LatentCache):
    return [(cache.c_kv, cache.c_scale, cache.c_resid),
            (cache.k_rope, cache.r_scale, cache.r_resid)]
  return [(cache.k, cache.k_scale, cache.k_resid)]


def _float_rows(cache):
  """The same arrays of a float32 cache."""
  if isinstance(cache, kvjax.LatentCache):
    return [cache.c_kv, cache.k_rope]
  return [cache.k]


def _slots_first(x):
  """[B, ..., S, X] -> [B, S, ..., X]."""
  return jnp.moveaxis(x, -2, 1)


def _codes(x):
  """Integer codes of an int8, int4 (two a byte) or int2 payload."""
  if x.dtype == quant.INT4_PAIRS:
    x = quant.unpack_int4(x)
  elif x.dtype == quant.INT2_OCTETS:
    x = quant.unpack_int2(x)
  return np.asarray(x, np.int32)


def _assert_same_quantization(stored, want, ref, scale_groups, qmax=127,
                              zero_groups=None):
  """Codes equal, except where the float value lies within rounding
  distance of a quantization boundary: the two programs compute it with
  different fusions, so it may round either way (`kvjax.tolerance`).

  stored, want: int8 / int4 / int2 payloads [n, ...]; ref: the float
  values [n, ...]; scale_groups: their per-channel scales [n / GROUP, ...]
  (int2: and zero_groups, its zeros); qmax: the codes' steps per scale
  (127, 7, or int2's 3).
  """
  stored, want = _codes(stored), _codes(want)
  differ = stored != want
  if not differ.any():
    return
  per_row = lambda g: np.repeat(np.asarray(g), GROUP, axis=0)[:len(stored)]
  offset = 0 if zero_groups is None else per_row(zero_groups)
  steps = (np.asarray(ref) - offset) / per_row(scale_groups)
  # x / scale carries the relative error of x and of the scale (two
  # roundings), in units of the qmax-level step.
  slack = qmax * 2 * tolerance(depth=1).rtol
  near = np.abs(np.abs(steps - np.trunc(steps)) - 0.5) <= slack
  np.testing.assert_array_less(np.abs(stored - want), 2)
  np.testing.assert_array_equal(differ & ~near, False)


def assert_invariant(test, cache, ref_cache, lengths):
  """Layer 0 of a KIVI cache against the float32 rows of the same tokens
  (slots [0, n) filled for a sequence of n tokens)."""
  for (payload, scale, resid), ref in zip(_triples(cache),
                                          _float_rows(ref_cache)):
    ref = ref[0]
    qmax = {quant.INT4_PAIRS: quant.INT4_MAX,
            quant.INT2_OCTETS: quant.INT2_LEVELS}.get(payload.dtype, 127)
    q, sc = quant.quantize_groups(ref, GROUP, -2, payload.dtype)
    got = kivi.read(payload, scale, resid, 0, cache.positions, GROUP,
                    jnp.float32)
    stored, q, sc = (_slots_first(payload[0]), _slots_first(q),
                     _slots_first(sc))
    got, ref_s = _slots_first(got), _slots_first(ref)
    stored_scale = _slots_first(scale[0])
    zero = None
    if payload.dtype == quant.INT2_OCTETS:  # the scales, then the zeros
      C = sc.shape[-1] // 2
      sc, zero = sc[..., :C], sc[..., C:]
    zeros = lambda groups: None if zero is None else zero[b, groups]
    for b, n in enumerate(lengths):
      newest = (n - 1) // GROUP
      done = slice(0, newest * GROUP)
      # Complete groups: the int8 values and scales of a one-shot
      # quantization.
      _assert_same_quantization(stored[b, done], q[b, done], ref_s[b, done],
                                sc[b, :newest], qmax, zeros(slice(0, newest)))
      want_scale = (sc if zero is None else
                    jnp.concatenate([sc, zero], axis=-1))
      assert_close(stored_scale[b, :newest], want_scale[b, :newest], depth=1)
      # The newest group is read exactly from the residual ...
      new = slice(newest * GROUP, (newest + 1) * GROUP)
      assert_close(got[b, new], ref_s[b, new], depth=1)
      # ... and its int8 copy is already the group's quantization so far.
      _assert_same_quantization(stored[b, new], q[b, new], ref_s[b, new],
                                sc[b, newest:newest + 1], qmax,
                                zeros(slice(newest, newest + 1)))
      # Empty slots hold zeros (int2: past the newest group; inside it an
      # empty slot's zero row has the code of 0 under the group's zero
      # point, and attention reads that group from the residual).
      empty = n if zero is None else (newest + 1) * GROUP
      test.assertEqual(float(jnp.abs(stored[b, empty:]).max(initial=0)), 0)


class QuantizeGroupsTest(parameterized.TestCase):

  def test_round_trip_per_channel(self):
    # Channels of different magnitudes: per-channel scales matter.
    x = jax.random.normal(jax.random.key(0), (2, 3, 8, 5)) * jnp.arange(
        1.0, 6.0)[None, None, None]
    q, s = quant.quantize_groups(x, 4, -2)
    chex.assert_shape(s, (2, 3, 2, 5))
    self.assertEqual(q.dtype, jnp.int8)
    want = jnp.max(jnp.abs(x.reshape(2, 3, 2, 4, 5)), axis=3) / 127.0
    assert_close(s, want, depth=1)
    back = quant.dequantize_groups(q, s, 4, -2, jnp.float32)
    err = jnp.abs(back - x).reshape(2, 3, 2, 4, 5)
    # Half a step, plus the rounding of the dequantizing product.
    self.assertTrue(bool(jnp.all(
        err <= s[:, :, :, None] * (0.5 + tolerance(depth=1).rtol))))
    # Re-quantizing the dequantized values gives back the same int8.
    q2, s2 = quant.quantize_groups(back, 4, -2)
    np.testing.assert_array_equal(q2, q)
    assert_close(s2, s, depth=1)

  def test_int4_round_trip_packs_the_channels(self):
    x = jax.random.normal(jax.random.key(0), (2, 3, 8, 6)) * jnp.arange(
        1.0, 7.0)[None, None, None]
    q, s = quant.quantize_groups(x, 4, -2, quant.INT4_PAIRS)
    self.assertEqual(q.dtype, quant.INT4_PAIRS)
    chex.assert_shape(q, (2, 3, 8, 3))  # two codes a byte
    chex.assert_shape(s, (2, 3, 2, 6))
    want = jnp.max(jnp.abs(x.reshape(2, 3, 2, 4, 6)), axis=3) / 7.0
    assert_close(s, want, depth=1)
    codes = quant.unpack_int4(q)
    self.assertLessEqual(int(jnp.abs(codes).max()), quant.INT4_MAX)
    # The packing is `pack_int4` of the int8-width codes at 7 levels.
    np.testing.assert_array_equal(quant.pack_int4(codes), q)
    back = quant.dequantize_groups(q, s, 4, -2, jnp.float32)
    chex.assert_shape(back, x.shape)
    err = jnp.abs(back - x).reshape(2, 3, 2, 4, 6)
    self.assertTrue(bool(jnp.all(
        err <= s[:, :, :, None] * (0.5 + tolerance(depth=1).rtol))))
    # Each group's largest channel value is a code of +-7 exactly.
    self.assertTrue(bool(jnp.all(jnp.max(jnp.abs(codes.reshape(
        2, 3, 2, 4, 6)), axis=3) == quant.INT4_MAX)))
    q2, _ = quant.quantize_groups(back, 4, -2, quant.INT4_PAIRS)
    np.testing.assert_array_equal(q2, q)

  def test_grouped_storage_and_axis_are_checked(self):
    with self.assertRaisesRegex(ValueError, "int8, int4 or int2"):
      quant.quantize_groups(jnp.zeros((4, 2)), 2, -2, jnp.float32)
    with self.assertRaisesRegex(ValueError, "before the channel axis"):
      quant.quantize_groups(jnp.zeros((2, 4)), 2, -1)
    with self.assertRaisesRegex(ValueError, "multiple of 2"):
      quant.quantize_groups(jnp.zeros((4, 3)), 2, -2, quant.INT4_PAIRS)

  def test_zero_group_is_zero_not_nan(self):
    q, s = quant.quantize_groups(jnp.zeros((4, 3)), 2, -2)
    np.testing.assert_array_equal(s, 0)
    np.testing.assert_array_equal(quant.dequantize_groups(
        q, s, 2, -2, jnp.float32), 0)

  def test_length_not_a_multiple_raises(self):
    with self.assertRaisesRegex(ValueError, "multiple of the quantization"):
      quant.quantize_groups(jnp.zeros((6, 3)), 4, -2)


class KiviCacheTest(chex.TestCase, parameterized.TestCase):

  # Fast tier: a GQA prompt of two whole groups and one token, an MLA prompt
  # inside its first group.
  @cases.product(variant=("gqa", "mha", "mqa", "mla"), n_prompt=(3, 4, 9),
                 bits=("int8", "int4", "int2"),
                 # Fast tier: GQA at every width, MLA at int8.
                 slow=lambda variant, n_prompt, bits: (variant, n_prompt) not in
                 (("gqa", 9), ("mla", 3)) or (variant == "mla" and
                                              bits != "int8"))
  def test_decode_keeps_the_invariant(self, variant, n_prompt, bits):
    config = tiny(variant)
    n = 19
    tokens = _tokens(config, n)
    ref_logits, ref = prefill_then_decode(variant, kvjax.CachePolicy(),
                                          tokens, n_prompt)
    got_logits, cache = prefill_then_decode(variant, POLICIES[bits], tokens,
                                            n_prompt)
    assert_invariant(self, cache, ref, [n] * B)
    chex.assert_tree_all_finite(got_logits)
    if bits != "int2":  # 2 bits: the storage bound exceeds the logits
      # Keys within per-channel rounding (values per token) at the code
      # width: logits stay close to float32.
      assert_close(got_logits, ref_logits, config, cache=bits)

  def test_int4_keys_beat_int4_per_token_on_outlier_channels(self):
    # KIVI's premise: with a few large fixed channels, a per-token scale
    # spends its 7 levels on them and rounds the rest to zero; per-channel
    # groups keep every channel at its own scale.
    x = jax.random.normal(jax.random.key(3), (64, 16))
    x = x.at[:, :2].multiply(30.0)  # two outlier channels
    per_token = quant.dequantize(*quant.quantize(x, quant.INT4_PAIRS),
                                 jnp.float32)
    per_channel = quant.dequantize_groups(
        *quant.quantize_groups(x, GROUP, -2, quant.INT4_PAIRS), GROUP, -2,
        jnp.float32)
    err = lambda y: float(jnp.sqrt(jnp.mean(jnp.square(y - x)[:, 2:])))
    self.assertLess(err(per_channel), 0.5 * err(per_token))

  @cases.product(chunk=(1, 3, 5), variant=("gqa", "mla"),
                 bits=("int8", "int4", "int2"),
                 slow=lambda chunk, variant, bits: (chunk, variant, bits) != (
                     3, "gqa", "int8"))
  def test_chunked_prefill_keeps_the_invariant(self, chunk, variant, bits):
    config, params = tiny(variant), tiny_params(variant)
    n = 13  # chunks of 3 and 5 straddle the groups of 4
    tokens = _tokens(config, n)
    _, ref = kvjax.prefill(params, config, tokens,
                           kvjax.init_cache(config, B, S))
    _, cache = kvjax.prefill_chunked(
        params, config, tokens,
        kvjax.init_cache(config, B, S, policy=POLICIES[bits]), chunk)
    assert_invariant(self, cache, ref, [n] * B)

  # Slow tier: test_ragged.py checks left padding in the fast tier.
  @cases.variants(("gqa", "mla"), fast=())
  def test_ragged_left_padded_batch(self, variant):
    config = tiny(variant)
    tokens = _tokens(config, 14, batch=3)
    mask = np.ones((3, 6), bool)
    mask[0, :2] = False  # 4 real prompt tokens
    mask[1, :5] = False  # 1
    _, ref = prefill_then_decode(variant, kvjax.CachePolicy(), tokens, 6,
                                 jnp.asarray(mask))
    _, cache = prefill_then_decode(variant, KIVI, tokens, 6,
                                   jnp.asarray(mask))
    lengths = mask.sum(1) + 8
    np.testing.assert_array_equal(cache.length, lengths)
    assert_invariant(self, cache, ref, lengths)

  def test_generate_runs_and_reports_bytes(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    tokens = _tokens(config, 5)
    toks, _, cache = kvjax.generate(params, config, tokens, 11, policy=KIVI,
                                    capacity=S, return_cache=True)
    chex.assert_shape(toks, (B, 11))
    L, K, H = config.num_layers, config.num_kv_heads, config.head_dim
    chex.assert_shape(cache.k_scale, (L, B, K, S // GROUP, H))
    chex.assert_shape(cache.k_resid, (L, B, K, GROUP, H))
    got = kvjax.cache_bytes(cache)
    per_token = kvjax.kv_bytes_per_token(config, "int8", key_group=GROUP)
    real_kv = sum(x.nbytes for x in (cache.k, cache.v, cache.k_scale,
                                     cache.v_scale))
    self.assertEqual(per_token * B * S, real_kv)
    self.assertEqual(got["kv"], real_kv)
    self.assertEqual(got["residual"], cache.k_resid.nbytes)
    # Key scales per channel and group: 4·K·H / key_group bytes per token
    # (per token and head they would be 4·K).
    self.assertEqual(per_token,
                     L * (2 * K * H + 4 * K + 4 * K * H // GROUP))

  @cases.variants(("gqa", "mla"))
  def test_int4_bytes(self, variant):
    config, params = tiny(variant), tiny_params(variant)
    toks, _, cache = kvjax.generate(params, config, _tokens(config, 5), 6,
                                    policy=KIVI4, capacity=S,
                                    return_cache=True)
    chex.assert_shape(toks, (B, 6))
    L = config.num_layers
    per_token = kvjax.kv_bytes_per_token(config, "int4", key_group=GROUP)
    got = kvjax.cache_bytes(cache)
    self.assertEqual(got["kv"], per_token * B * S)
    if variant == "mla":
      C, R = config.kv_lora_rank, config.qk_rope_head_dim
      chex.assert_shape(cache.c_kv, (L, B, S, C // 2))
      # Half a byte per channel, plus the per-channel group scales.
      self.assertEqual(per_token, L * ((C + R) // 2 + 4 * (C + R) // GROUP))
      self.assertEqual(got["residual"], L * B * GROUP * (C + R) * 4)
    else:
      K, H = config.num_kv_heads, config.head_dim
      chex.assert_shape(cache.k, (L, B, K, S, H // 2))
      chex.assert_shape(cache.k_scale, (L, B, K, S // GROUP, H))
      self.assertEqual(per_token,
                       L * (K * H + 4 * K + 4 * K * H // GROUP))
      self.assertEqual(got["residual"], cache.k_resid.nbytes)

  def test_default_capacity_is_whole_groups(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    policy = kvjax.CachePolicy(kv_dtype="int8", key_quant="channel",
                               key_group=48)
    _, _, cache = kvjax.generate(params, config, _tokens(config, 5), 3,
                                 policy=policy, return_cache=True)
    self.assertEqual(cache.capacity, 48)  # the power of two 16, rounded up

  @cases.variants(("gqa", "mla"))
  def test_sharding_axes_cover_the_new_fields(self, variant):
    cache = kvjax.init_cache(tiny(variant), B, S, policy=KIVI)
    axes = sharding.cache_axes(cache)
    for (_, scale, resid), (_, scale_axes, resid_axes) in zip(
        _triples(cache), _triples(axes)):
      self.assertLen(scale_axes, scale.ndim)
      self.assertLen(resid_axes, resid.ndim)

  def test_mla_bytes(self):
    config, params = tiny("mla"), tiny_params("mla")
    _, _, cache = kvjax.generate(params, config, _tokens(config, 5), 4,
                                 policy=KIVI, capacity=S, return_cache=True)
    L, C, R = config.num_layers, config.kv_lora_rank, config.qk_rope_head_dim
    per_token = kvjax.kv_bytes_per_token(config, "int8", key_group=GROUP)
    self.assertEqual(per_token, L * ((C + R) + 4 * (C + R) // GROUP))
    got = kvjax.cache_bytes(cache)
    self.assertEqual(got["kv"], per_token * B * S)
    self.assertEqual(got["residual"], L * B * GROUP * (C + R) * 4)


class KiviBadInputTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("float_cache", dict(kv_dtype="float32", key_quant="channel"),
       r"needs kv_dtype in \('int8', 'int4', 'int2'\), got 'float32'"),
      ("eviction", dict(kv_dtype="int8", key_quant="channel",
                        eviction="window"), "needs eviction='none'"),
      ("group", dict(kv_dtype="int8", key_quant="channel", key_group=0),
       "key_group must be"),
  )
  def test_bad_policy(self, kwargs, message):
    with self.assertRaisesRegex(ValueError, message):
      kvjax.CachePolicy(**kwargs)

  def test_capacity_not_a_multiple_of_the_group(self):
    with self.assertRaisesRegex(ValueError, "multiple of key_group=4"):
      kvjax.init_cache(tiny("gqa"), B, 30, policy=KIVI)

  def test_bytes_formula_refuses_non_int8(self):
    with self.assertRaisesRegex(ValueError, "key_group"):
      kvjax.kv_bytes_per_token(tiny("gqa"), "float32", key_group=4)


if __name__ == "__main__":
  absltest.main()
