"""The decode loop's layered cache and integer attention (`kvjax.layered`).

Invariants: a LayeredKV holds exactly the stacked cache's first P slots
(round trip bit for bit, scales included; keys and int8 / int4 values
transposed, int4 codes unpacked); its one-token write lands where the
stacked write does (batch 1's update slice and the batched scatter alike,
slot P dropped); for float caches a `generate` over it gives the stacked
generate's tokens, and its logits and cache up to float reassociation.
For int8 caches the integer attention equals a float64 reference over the
dequantized cache within int8's storage tolerance, and slots it masks
contribute exactly nothing whatever they hold; teacher-forced decode
through an int8 or int4 cache writes the stacked cache's codes in layer 0
and its values within the storage tolerance after it. Where the native
kernel is not built, 'auto' reads int8 and int4 caches layered at every
batch and float caches layered in long segments of batched decode; where
'layered' cannot run it raises naming the reason.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import attention
from kvjax import cache as cache_lib
from kvjax import decode
from kvjax import inference
from kvjax import layered
from kvjax import quant
from kvjax.lab import streaming
from kvjax.tolerance import assert_close
import cases
from tiny_models import teacher_forced_layouts, tiny, tiny_params


def _random_cache(config, batch, capacity, length, dtype="float32", seed=0):
  """A KVCache whose first `length` slots hold random (quantized) keys and
  values, written through the cache's own write."""
  policy = cache_lib.CachePolicy(kv_dtype=dtype)
  cache = cache_lib.init_cache(config, batch, capacity, policy=policy)
  K, H = config.num_kv_heads, config.head_dim
  kk, kv = jax.random.split(jax.random.key(seed))
  slots_BT = jnp.broadcast_to(jnp.arange(capacity), (batch, capacity))
  for layer in range(config.num_layers):
    k = jax.random.normal(jax.random.fold_in(kk, layer),
                          (batch, capacity, K, H))
    v = jax.random.normal(jax.random.fold_in(kv, layer),
                          (batch, capacity, K, H))
    cache = attention.write_kv(cache, layer, slots_BT, k, v, fresh=True)
  filled = jnp.arange(capacity) < length
  pos = jnp.where(filled, jnp.arange(capacity), cache_lib.EMPTY)
  return cache.replace(
      positions=jnp.broadcast_to(pos, cache.positions.shape),
      length=jnp.full((batch,), length, jnp.int32))


def _reference(q_BTKGH, k_BKSH, v_BKSH, mask_BKTS, scale):
  """Decode attention in float64 on the host."""
  q = np.asarray(q_BTKGH[:, 0], np.float64)
  logits = np.einsum("bkgh,bksh->bkgs", q, np.asarray(k_BKSH, np.float64))
  logits = np.where(np.asarray(mask_BKTS)[:, :, 0][:, :, None],
                    logits * scale, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bkgs,bksh->bkgh", p, np.asarray(v_BKSH, np.float64))[
      :, None]


class LayoutTest(parameterized.TestCase):

  @cases.product(dtype=("float32", "bfloat16", "int8", "int4"),
                 slow=lambda dtype: dtype == "bfloat16")
  def test_round_trip_is_exact(self, dtype):
    config = tiny("gqa")
    cache = _random_cache(config, 3, 256, 100, dtype)
    seg = layered.from_cache(cache, 192)
    L, B, K, _, H = cache.k.shape
    self.assertLen(seg.k, L)
    H *= quant.values_per_element(dtype)  # int4: codes unpacked in the view
    chex.assert_shape(seg.k[0], (B, K, H, 192))  # keys transposed
    chex.assert_shape(seg.v[0], (B, K, H, 192) if dtype in ("int8", "int4")
                      else (B, K, 192, H))
    self.assertEqual(seg.capacity, 192)
    self.assertEqual(seg.k_scale is None, dtype not in ("int8", "int4"))
    k = cache.k[1, :, :, :192]
    if dtype == "int4":
      k = quant.unpack_int4(k)
    np.testing.assert_array_equal(seg.k[1], jnp.swapaxes(k, -1, -2))
    chex.assert_trees_all_equal(layered.into_cache(cache, seg), cache)

  def test_into_cache_takes_the_segment_slots_only(self):
    cache = _random_cache(tiny("gqa"), 2, 256, 100, "int8")
    seg = layered.from_cache(cache, 128)
    seg = seg.replace(k_scale=tuple(s * 2 for s in seg.k_scale),
                      length=seg.length + 5)
    back = layered.into_cache(cache, seg)
    np.testing.assert_array_equal(back.k_scale[:, :, :, :128],
                                  cache.k_scale[:, :, :, :128] * 2)
    np.testing.assert_array_equal(back.k_scale[:, :, :, 128:],
                                  cache.k_scale[:, :, :, 128:])
    np.testing.assert_array_equal(back.length, cache.length + 5)

  @cases.product(dtype=("float32", "bfloat16", "int8", "int4"), batch=(1, 3),
                 slow=lambda dtype, batch: dtype in ("bfloat16", "int4") and
                 batch == 1)
  def test_write_lands_where_the_stacked_write_does(self, dtype, batch):
    config = tiny("gqa")
    cache = _random_cache(config, batch, 256, 100, dtype)
    K, H = config.num_kv_heads, config.head_dim
    slots_BT = jnp.array([[100], [5], [127]], jnp.int32)[:batch]
    k_BTKH = jax.random.normal(jax.random.key(7), (batch, 1, K, H))
    v_BTKH = jax.random.normal(jax.random.key(8), (batch, 1, K, H))
    want = attention.write_kv(cache, 1, slots_BT, k_BTKH, v_BTKH)
    write = jax.jit(layered.write, static_argnums=1)
    got = write(layered.from_cache(cache, 128), 1, slots_BT, k_BTKH, v_BTKH)
    chex.assert_trees_all_equal(layered.into_cache(cache, got), want)

  @cases.product(batch=(1, 2))
  def test_write_past_the_segment_is_dropped(self, batch):
    config = tiny("gqa")
    seg = layered.from_cache(_random_cache(config, batch, 256, 100, "int8"),
                             128)
    slots_BT = jnp.array([[128], [200]], jnp.int32)[:batch]
    kv = jnp.ones((batch, 1, config.num_kv_heads, config.head_dim))
    got = jax.jit(layered.write, static_argnums=1)(seg, 0, slots_BT, kv, kv)
    chex.assert_trees_all_equal(got, seg)

  def test_write_rejects_more_than_one_token(self):
    config = tiny("gqa")
    seg = layered.from_cache(_random_cache(config, 2, 128, 10), 128)
    kv = jnp.ones((2, 2, config.num_kv_heads, config.head_dim))
    with self.assertRaisesRegex(ValueError, "T = 1"):
      layered.write(seg, 0, jnp.zeros((2, 2), jnp.int32), kv, kv)

  def test_supports_names_what_it_cannot_lay_out(self):
    config = tiny("gqa")
    cache = cache_lib.init_cache(config, 2, 256)
    self.assertIsNone(layered.supports(cache, 100))
    self.assertIn("within capacity", layered.supports(cache, 320))
    kivi = cache_lib.init_cache(config, 2, 256, policy=cache_lib.CachePolicy(
        kv_dtype="int8", key_quant="channel"))
    self.assertIn("channel", layered.supports(kivi, 128))
    window = cache_lib.init_cache(
        config, 2, 256, policy=cache_lib.CachePolicy(eviction="window"))
    self.assertIn("eviction='window'", layered.supports(window, 128))
    self.assertIn("latent", layered.supports(
        cache_lib.init_cache(tiny("mla"), 2, 256), 128))
    with self.assertRaisesRegex(ValueError, "within capacity"):
      layered.from_cache(cache, 300)


class IntegerAttentionTest(parameterized.TestCase):

  @cases.product(kind=("mha", "mqa", "gqa"), sharpness=(1.0, 4.0),
                 slow=lambda kind, sharpness: kind != "gqa")
  def test_equals_a_float64_reference_within_int8_tolerance(self, kind,
                                                            sharpness):
    config = tiny(kind)
    B, S = 3, 512
    cache = _random_cache(config, B, S, S, "int8", seed=1)
    K, G, H = config.num_kv_heads, config.groups, config.head_dim
    q_BTKGH = sharpness * jax.random.normal(jax.random.key(3),
                                            (B, 1, K, G, H))
    lengths = jnp.array([S, 70, 1])  # ragged; one row sees a single key
    mask_BKTS = (jnp.arange(S)[None] < lengths[:, None])[:, None, None]
    seg = layered.from_cache(cache, S)
    k, v = layered.read(seg, 1, jnp.float32)
    self.assertIsInstance(k, layered.Int8Rows)
    got, probs = jax.jit(layered.int8_attend, static_argnums=4)(
        q_BTKGH, k, v, mask_BKTS, 0.3)
    k_BKSH, v_BKSH = attention.read_kv(cache, 1, jnp.float32)
    want = _reference(q_BTKGH, k_BKSH, v_BKSH, mask_BKTS, 0.3)
    assert_close(got, want, cache="int8", depth=1)
    chex.assert_tree_all_finite(probs)
    np.testing.assert_allclose(np.sum(probs, -1), 1.0, rtol=1e-5)

  def test_masked_slots_contribute_exactly_nothing(self):
    # Whatever masked slots hold (their probability is 0, their code -127
    # cancels against the ones row exactly), the output is bit for bit
    # that of the same cache with those slots zeroed.
    config = tiny("gqa")
    B, S, n = 2, 256, 100
    cache = _random_cache(config, B, S, S, "int8", seed=2)
    K, G, H = config.num_kv_heads, config.groups, config.head_dim
    q_BTKGH = jax.random.normal(jax.random.key(4), (B, 1, K, G, H))
    mask_BKTS = jnp.broadcast_to(jnp.arange(S) < n, (B, 1, 1, S))
    k, v = layered.read(layered.from_cache(cache, S), 0, jnp.float32)
    keep = (jnp.arange(S) < n)[None, None, :]
    # Values are stored transposed: codes [B, K, H, S].
    zeroed_v = layered.Int8Rows(jnp.where(keep[:, :, None], v.codes, 0),
                                jnp.where(keep, v.scale, 0.0))
    attend = jax.jit(layered.int8_attend, static_argnums=4)
    got, _ = attend(q_BTKGH, k, v, mask_BKTS, 0.3)
    want, _ = attend(q_BTKGH, k, zeroed_v, mask_BKTS, 0.3)
    np.testing.assert_array_equal(got, want)
    self.assertGreater(float(jnp.max(jnp.abs(v.codes[..., n:]))), 100)

  def test_int32_sums_are_refused_where_they_could_overflow(self):
    self.assertGreaterEqual(layered.INT8_MAX_SLOTS, 65_536)  # 64k contexts
    self.assertLessEqual(254 * 127 * layered.INT8_MAX_SLOTS, 2**31 - 1)
    cache = jax.eval_shape(lambda: cache_lib.init_cache(
        tiny("gqa"), 1, layered.INT8_MAX_SLOTS + 64, dtype="int8"))
    cache = cache_lib.KVCache(**{f: getattr(cache, f) for f in (
        "k", "v", "positions", "length", "k_scale", "v_scale", "errors")},
                              policy=cache.policy)
    self.assertIn("overflow", layered.supports(
        cache, layered.INT8_MAX_SLOTS + 1))
    self.assertIsNone(layered.supports(cache, layered.INT8_MAX_SLOTS))


class GenerateTest(parameterized.TestCase):

  def _both(self, config, params, tokens, n, **kw):
    return [inference.generate(params, config, tokens, n, return_logits=True,
                               return_cache=True, decode_layout=layout, **kw)
            for layout in ("stacked", "layered")]

  @cases.product(kind=("mha", "mqa", "gqa"), dtype=("float32", "bfloat16", "float16"),
                 batch=(1, 3),
                 slow=lambda kind, dtype, batch: (kind, dtype) != ("gqa",
                                                                  "float32"))
  def test_float_caches_give_the_stacked_results(self, kind, dtype,
                                                         batch):
    config = tiny(kind)
    params = kvjax.pack(tiny_params(kind), config)
    tokens = jax.random.randint(jax.random.key(1), (batch, 20), 0,
                                config.vocab_size)
    (ids_a, lg_a, c_a), (ids_b, lg_b, c_b) = self._both(
        config, params, tokens, 110,
        policy=cache_lib.CachePolicy(kv_dtype=dtype))
    # Same tokens; logits and cache up to float reassociation (the key
    # product runs as q K^T over transposed keys), as `kvjax.tolerance`.
    np.testing.assert_array_equal(ids_a, ids_b)
    assert_close(lg_b, lg_a, config, cache=dtype)
    for name in ("k", "v"):
      assert_close(quant.dequantize(getattr(c_b, name), None, jnp.float32),
                   quant.dequantize(getattr(c_a, name), None, jnp.float32),
                   config, cache=dtype, msg=name)
    for name in ("positions", "length", "errors"):
      np.testing.assert_array_equal(getattr(c_a, name), getattr(c_b, name))

  @cases.product(batch=(1, 3), dtype=("int8", "int4"),
                 slow=lambda batch, dtype: (batch, dtype) == (1, "int4"))
  def test_quantized_writes_the_stacked_cache_and_keeps_the_logits(
      self, batch, dtype):
    # Teacher-forced through the one decode loop: the same tokens go in, so
    # every step writes the same codes; the logits differ by the integer
    # attention's rounding only.
    config = tiny("gqa")
    out = teacher_forced_layouts("gqa", dtype, batch)
    a, b = out["stacked"][0], out["layered"][0]
    # Layer 0's keys and values come from the embeddings alone: the same
    # codes; deeper layers' see the integer attention's rounding.
    for name in ("k", "v", "k_scale", "v_scale"):
      np.testing.assert_array_equal(getattr(a, name)[0], getattr(b, name)[0])
    for name in ("k", "v"):
      assert_close(
          quant.dequantize(getattr(b, name), getattr(b, name + "_scale"),
                           jnp.float32),
          quant.dequantize(getattr(a, name), getattr(a, name + "_scale"),
                           jnp.float32), config, cache=dtype, msg=name)
    for name in ("positions", "length", "errors"):
      np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert_close(out["layered"][1], out["stacked"][1], config, cache=dtype)



class PlanTest(parameterized.TestCase):
  """'auto' where the native kernel is not built (`decode.plan` prefers it
  wherever it runs: tests/test_native_attention.py): the XLA views."""

  def setUp(self):
    super().setUp()
    cases.without_native_kernel(self)

  def _plan(self, kind="gqa", batch=8, dtype="float32", layout="packed",
            decode_layout="auto", prompt=32, steps=200, capacity=8192,
            **kw):
    config = tiny(kind)
    params = tiny_params(kind)
    if layout == "packed":
      params = kvjax.pack(params, config)
    policy = cache_lib.CachePolicy(kv_dtype=dtype, **kw)
    return decode.plan(params, config, policy, batch, prompt, steps,
                       capacity, decode_layout=decode_layout)

  @cases.product(dtype=("int8", "int4"))
  def test_auto_reads_quantized_caches_layered_at_every_batch(self, dtype):
    for batch in (1, 2, 8):
      plan = self._plan(batch=batch, dtype=dtype)
      self.assertEqual(plan.layout, "layered")
      self.assertEqual(
          {plan.segment_layout(i) for i in range(len(plan.schedule))},
          {"layered"})

  def test_auto_reads_float_caches_layered_in_long_segments_only(self):
    plan = self._plan(batch=8, prompt=1000, steps=2500)
    attends = [a for _, a in plan.schedule]
    self.assertEqual(
        [plan.segment_layout(i) for i in range(len(attends))],
        ["layered" if a >= decode.LAYERED_MIN_SLOTS else "stacked"
         for a in attends])
    self.assertIn("layered", plan.layouts)
    self.assertIn("stacked", plan.layouts)
    self.assertEqual(self._plan(batch=1).layout, "stacked")

  @parameterized.named_parameters(
      ("kivi", dict(dtype="int8", key_quant="channel"), "stacked"),
      ("scan_params", dict(layout="scan", dtype="int8"), "stacked"),
  )
  def test_auto_stays_stacked_where_layered_cannot_run(self, kw, want):
    self.assertEqual(self._plan(**kw).layout, want)

  @parameterized.named_parameters(
      ("kivi", dict(dtype="int8", key_quant="channel"),
       "key_quant='channel'"),
      ("scan", dict(layout="scan"), "per-layer arrays"),
      ("window", dict(eviction="window"), "decode segments"),
  )
  def test_layered_where_it_cannot_run_raises(self, kw, match):
    with self.assertRaisesRegex(ValueError, match):
      self._plan(decode_layout="layered", **kw)

  def test_the_streaming_evaluation_reads_what_generate_reads(self):
    # Perplexity through an int8 cache measures the integer attention
    # generate runs, over the whole cache in one segment.
    config = tiny("gqa")
    params = kvjax.pack(tiny_params("gqa"), config)
    tokens = jnp.zeros((2, 10), jnp.int32)
    for dtype, eviction, want in (("int8", "none", "layered"),
                                  ("int8", "window", "stacked"),
                                  ("float32", "none", "stacked")):
      cache = kvjax.init_cache(config, 2, 64, policy=cache_lib.CachePolicy(
          kv_dtype=dtype, eviction=eviction))
      plan = streaming._plan(params, config, tokens, cache)  # pylint: disable=protected-access
      self.assertEqual(plan.layout, want, (dtype, eviction))
    self.assertEqual(plan.schedule, ((10, 0),))

  def test_attention_reads_it_through_the_decode_cache_protocol(self):
    self.assertNotIn("layered", vars(attention))
    ops = attention.decode_cache(layered.from_cache(
        kvjax.init_cache(tiny("gqa"), 2, 128), 128))
    self.assertIs(ops.write, layered.write)
    self.assertIs(ops.read, layered.read)


if __name__ == "__main__":
  absltest.main()
