"""The layered latent cache (`kvjax.layered_latent`): MLA's decode view of
one array per layer equals the stacked latent cache bit for bit, and the
decode loop reads it only where it can."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import cache as cache_lib
from kvjax import decode
from kvjax import inference
from kvjax import layered
from kvjax import layered_latent
from kvjax import mla
from kvjax import quant
from kvjax.tolerance import assert_close
import cases
from tiny_models import teacher_forced_layouts, tiny, tiny_params

DTYPES = layered_latent.LAYERED_LATENT_DTYPES
FIELDS = ("c_kv", "k_rope", "c_scale", "r_scale", "positions", "length",
          "errors")


def _random_cache(config, batch, capacity, length, dtype, seed=0):
  """A LatentCache whose first `length` slots hold random latents written
  through the cache's own write (quantized as it stores them)."""
  cache = cache_lib.init_cache(config, batch, capacity,
                               policy=cache_lib.CachePolicy(kv_dtype=dtype))
  C, R = config.kv_lora_rank, config.qk_rope_head_dim
  key = jax.random.key(seed)
  slots_BT = jnp.broadcast_to(jnp.arange(capacity), (batch, capacity))
  for layer in range(config.num_layers):
    kc, kr = jax.random.split(jax.random.fold_in(key, layer))
    cache = mla.write_latent(
        cache, layer, slots_BT, jax.random.normal(kc, (batch, capacity, C)),
        jax.random.normal(kr, (batch, capacity, R)), fresh=True)
  pos = jnp.where(jnp.arange(capacity) < length, jnp.arange(capacity),
                  cache_lib.EMPTY)
  return cache.replace(
      positions=jnp.broadcast_to(pos, cache.positions.shape),
      length=jnp.full((batch,), length, jnp.int32))


def _assert_same(a, b, msg=""):
  for name in FIELDS:
    x, y = getattr(a, name), getattr(b, name)
    if x is None or y is None:
      assert x is None and y is None, (name, msg)
      continue
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                  err_msg=f"{name} {msg}")


class ViewTest(parameterized.TestCase):

  @cases.product(dtype=DTYPES, slow=lambda dtype: dtype in ("float16",
                                                            "int4"))
  def test_into_cache_inverts_from_cache_bit_for_bit(self, dtype):
    config = tiny("mla")
    cache = _random_cache(config, 2, 48, 30, dtype)
    view = layered_latent.from_cache(cache, 32)
    self.assertLen(view.c, config.num_layers)
    self.assertEqual(view.capacity, 32)
    # The view's prefix differs from the stacked cache's first 32 slots in
    # nothing; the slots past it are untouched by the round trip.
    _assert_same(layered_latent.into_cache(cache, view), cache, dtype)

  @cases.product(dtype=("float32", "int8", "int4"), batch=(1, 3),
                 slow=lambda dtype, batch: dtype == "int4")
  def test_write_and_read_equal_the_stacked_cache(self, dtype, batch):
    # One decode token per sequence, at a different slot per sequence;
    # slot S is dropped by both (batch 1 writes slot 5, then slot S).
    config = tiny("mla")
    C, R = config.kv_lora_rank, config.qk_rope_head_dim
    S = 32
    cache = _random_cache(config, batch, S, 20, dtype, seed=1)
    writes = ([[[5], [31], [S]]] if batch == 3 else [[[5]], [[S]]])
    view, want = layered_latent.from_cache(cache, S), cache
    write = jax.jit(layered_latent.write, static_argnums=1)
    for i, slots in enumerate(writes):
      slots = jnp.array(slots, jnp.int32)
      c = jax.random.normal(jax.random.key(7 + i), (batch, 1, C))
      r = jax.random.normal(jax.random.key(17 + i), (batch, 1, R))
      view = write(view, 1, slots, c, r)
      want = mla.write_latent(want, 1, slots, c, r)
    self.assertFalse(np.array_equal(np.asarray(want.c_kv),
                                    np.asarray(cache.c_kv)))
    _assert_same(layered_latent.into_cache(cache, view), want, dtype)
    for layer in range(config.num_layers):
      got = layered_latent.read(view, layer, jnp.float32)
      ref = mla.read_latent(want, layer, jnp.float32, S)
      for g, w in zip(got, ref):
        if view.transposed:  # int8 codes [B, W, S] and their scales
          self.assertIsInstance(g, layered.Int8Rows)
          g = jnp.swapaxes(g.codes, 1, 2) * g.scale[..., None]
        np.testing.assert_array_equal(g, w)

  @parameterized.named_parameters(
      ("gqa_cache", "gqa", {}, 32, "not MLA's LatentCache"),
      ("kivi", "mla", dict(kv_dtype="int8", key_quant="channel"), 32,
       "key_quant='channel'"),
      ("int2", "mla", dict(kv_dtype="int2"), 32, "kv_dtype='int2'"),
      ("window", "mla", dict(eviction="window"), 32, "eviction='window'"),
      ("attend_zero", "mla", {}, 0, "attend=0"),
      ("attend_past_capacity", "mla", {}, 65, "attend=65"),
  )
  def test_supports_names_why_not(self, kind, policy, attend, match):
    cache = cache_lib.init_cache(tiny(kind), 1, 64,
                                 policy=cache_lib.CachePolicy(**policy))
    self.assertIn(match, layered_latent.supports(cache, attend))
    with self.assertRaisesRegex(ValueError, match):
      layered_latent.from_cache(cache, attend)


class GenerateTest(parameterized.TestCase):

  @cases.product(dtype=("float32", "bfloat16", "float16"), batch=(1, 3),
                 slow=lambda dtype, batch: (dtype, batch) != ("float32", 3))
  def test_float_latents_give_the_stacked_results(self, dtype, batch):
    config = tiny("mla")
    params = kvjax.pack(tiny_params("mla"), config)
    tokens = jax.random.randint(jax.random.key(1), (batch, 20), 0,
                                config.vocab_size)
    policy = cache_lib.CachePolicy(kv_dtype=dtype)
    (ids_a, lg_a, c_a), (ids_b, lg_b, c_b) = [
        inference.generate(params, config, tokens, 110, return_logits=True,
                           return_cache=True, policy=policy,
                           decode_layout=layout)
        for layout in ("stacked", "layered")]
    # The same arithmetic on the same latents, read in place instead of
    # from a copied slice: same tokens, same cache contents.
    np.testing.assert_array_equal(ids_a, ids_b)
    assert_close(lg_b, lg_a, config, cache=dtype)
    _assert_same(c_a, c_b, dtype)

  @cases.product(dtype=("int8", "int4"), batch=(1, 3),
                 slow=lambda dtype, batch: (dtype, batch) != ("int8", 3))
  def test_integer_attention_writes_the_stacked_cache_and_keeps_the_logits(
      self, dtype, batch):
    # Teacher-forced through the one decode loop (greedy tokens of a random
    # model flip on any rounding): every step writes the same tokens, and
    # the logits differ by the integer attention's rounding only.
    config = tiny("mla")
    out = teacher_forced_layouts("mla", dtype, batch)
    a, b = out["stacked"][0], out["layered"][0]
    # Layer 0's latents come from the embeddings alone: the same codes;
    # deeper layers' see the integer attention's rounding.
    for name in ("c_kv", "k_rope", "c_scale", "r_scale"):
      np.testing.assert_array_equal(getattr(a, name)[0], getattr(b, name)[0])
    for name, scale in (("c_kv", "c_scale"), ("k_rope", "r_scale")):
      assert_close(
          quant.dequantize(getattr(b, name), getattr(b, scale), jnp.float32),
          quant.dequantize(getattr(a, name), getattr(a, scale), jnp.float32),
          config, cache=dtype, msg=name)
    for name in ("positions", "length", "errors"):
      np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert_close(out["layered"][1], out["stacked"][1], config, cache=dtype)
    self.assertFalse(np.array_equal(out["layered"][1], out["stacked"][1]))

  def test_int8_absorbed_matches_a_float64_reference(self):
    # The integer kernel against the absorbed attention in float64 over the
    # same (dequantized) latents: only the query's and the probabilities'
    # int8 rounding separate them.
    B, S, N, C, R, n = 2, 40, 4, 16, 8, 30
    keys = jax.random.split(jax.random.key(0), 4)
    c = jax.random.normal(keys[0], (B, S, C))
    r = jax.random.normal(keys[1], (B, S, R))
    q_lat = jax.random.normal(keys[2], (B, 1, N, C))
    q_rope = jax.random.normal(keys[3], (B, 1, N, R))
    mask = jnp.broadcast_to(jnp.arange(S) < n, (B, 1, 1, S))
    (cq, cs), (rq, rs) = quant.quantize(c, jnp.int8), quant.quantize(
        r, jnp.int8)
    out, probs = jax.jit(layered_latent.int8_absorbed, static_argnums=5)(
        q_lat, q_rope, layered.Int8Rows(jnp.swapaxes(cq, 1, 2), cs),
        layered.Int8Rows(jnp.swapaxes(rq, 1, 2), rs), mask, 0.3)
    f64 = lambda x: np.asarray(x, np.float64)
    cd, rd = f64(cq) * f64(cs)[..., None], f64(rq) * f64(rs)[..., None]
    logits = 0.3 * (np.einsum("bnc,bsc->bns", f64(q_lat[:, 0]), cd) +
                    np.einsum("bnr,bsr->bns", f64(q_rope[:, 0]), rd))
    logits = np.where(np.arange(S) < n, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("bns,bsc->bnc", p, cd)
    self.assertEqual(out.shape, (B, 1, N, C))
    self.assertEqual(probs.shape, (B, N, 1, S))
    np.testing.assert_allclose(f64(probs[:, :, 0]), p, atol=0.02)
    np.testing.assert_array_equal(f64(probs[..., n:]), 0.0)
    np.testing.assert_allclose(f64(out[:, 0]), want, atol=0.03)


class PlanTest(parameterized.TestCase):
  """'auto' where the native kernel is not built (`decode.plan` prefers it
  wherever it runs: tests/test_native_attention.py): the XLA views."""

  def setUp(self):
    super().setUp()
    cases.without_native_kernel(self)

  def _plan(self, decode_layout="auto", batch=8, dtype="float32",
            prompt=1000, steps=2500, capacity=8192, pack=True):
    config = tiny("mla")
    params = tiny_params("mla")
    if pack:
      params = kvjax.pack(params, config)
    return decode.plan(params, config,
                       cache_lib.CachePolicy(kv_dtype=dtype), batch, prompt,
                       steps, capacity, decode_layout=decode_layout)

  def test_layered_runs_every_segment_over_per_layer_latents(self):
    plan = self._plan("layered")
    self.assertEqual(plan.layout, "layered")
    self.assertTrue(plan.schedule)

  def test_auto_reads_quantized_latents_layered_and_float_ones_stacked(self):
    for batch in (1, 8):
      for dtype in ("int8", "int4"):
        plan = self._plan(batch=batch, dtype=dtype)
        self.assertEqual(
            {plan.segment_layout(i) for i in range(len(plan.schedule))},
            {"layered"}, (batch, dtype))
      for dtype in ("float32", "bfloat16"):
        plan = self._plan(batch=batch, dtype=dtype)
        self.assertEqual(
            {plan.segment_layout(i) for i in range(len(plan.schedule))},
            {"stacked"}, (batch, dtype))

  def test_generate_runs_int8_latents_on_integer_attention(self):
    # The default path (no layout flag) is the layered one: its logits are
    # the integer attention's, not the stacked dequantizing path's.
    config = tiny("mla")
    params = kvjax.pack(tiny_params("mla"), config)
    prompt = jax.random.randint(jax.random.key(5), (2, 8), 0,
                                config.vocab_size)
    policy = cache_lib.CachePolicy(kv_dtype="int8")
    logits = {layout: inference.generate(params, config, prompt, 3,
                                         return_logits=True, policy=policy,
                                         decode_layout=layout)[1]
              for layout in ("auto", "layered", "stacked")}
    np.testing.assert_array_equal(logits["auto"], logits["layered"])
    self.assertFalse(np.array_equal(logits["auto"], logits["stacked"]))

  def test_blocked_has_no_latent_view(self):
    with self.assertRaisesRegex(ValueError, "attention='mla'"):
      self._plan("blocked")

  def test_naive_mla_decode_cannot_run_layered(self):
    config = tiny("mla").replace(mla_decode="naive")
    with self.assertRaisesRegex(ValueError, "mla_decode='naive'"):
      decode.plan(kvjax.pack(tiny_params("mla"), config), config,
                  cache_lib.CachePolicy(), 8, 1000, 2500, 8192,
                  decode_layout="layered")

  def test_stacked_layer_params_cannot_run_layered(self):
    with self.assertRaisesRegex(ValueError, "per-layer arrays"):
      self._plan("layered", pack=False)


if __name__ == "__main__":
  absltest.main()
