"""Core invariants of the cached decoder for every attention variant.

Cached decode equals the no-cache forward; prefill equals the full forward;
prefill(T) + decode equals prefill(T + 1); causality; one trace for many
decode steps; cache shapes, bytes and finiteness; jit == no jit.
"""


from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import configs as cfg_lib
from kvjax import inference
from kvjax import model
from kvjax.tolerance import assert_close
from configs import model as model_presets

VARIANTS = model_presets.VARIANTS


import cases  # pylint: disable=g-bad-import-order
from tiny_models import tiny, tiny_params  # pylint: disable=g-bad-import-order


def prompt(batch=2, length=7, seed=1, vocab=256):
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, vocab)


class ConfigTest(parameterized.TestCase):

  def test_variant_is_derived_from_head_counts(self):
    # Names come from the config, never typed by hand next to it.
    self.assertEqual([tiny(v).variant for v in VARIANTS], list(VARIANTS))
    self.assertEqual(tiny("mha").num_kv_heads, tiny("mha").num_heads)
    self.assertEqual(tiny("mqa").num_kv_heads, 1)
    self.assertEqual(tiny("gqa").groups, 2)

  @cases.product(preset=model_presets.PRESETS)
  def test_every_preset_builds_without_compute(self, preset):
    c = model_presets.get_config(preset)
    config = cfg_lib.model_config(c.model)
    params = jax.eval_shape(lambda: kvjax.init_params(config,
                                                      jax.random.key(0)))
    self.assertEqual(params["embed"].shape,
                     (config.vocab_size, config.embed_dim))
    cache = jax.eval_shape(lambda: kvjax.init_cache(config, 2, 64))
    kv = cache.c_kv if config.attention == "mla" else cache.k
    self.assertEqual(kv.shape[:3 if config.attention == "mla" else 2],
                     (config.num_layers, 2) + (
                         (64,) if config.attention == "mla" else ()))
    cfg_lib.cache_policy(c.cache)
    cfg_lib.sampler(c.generate)

  @cases.product(preset=model_presets.PRESETS,
                 dtype=("float32", "bfloat16", "int8"))
  def test_bytes_per_token_formula_equals_real_nbytes(self, preset, dtype):
    config = cfg_lib.model_config(model_presets.get_config(preset).model)
    B, S = 3, 40
    cache = jax.eval_shape(lambda: kvjax.init_cache(config, B, S, dtype=dtype))
    leaves = ([cache.c_kv, cache.k_rope, cache.c_scale, cache.r_scale]
              if config.attention == "mla" else
              [cache.k, cache.v, cache.k_scale, cache.v_scale])
    nbytes = sum(x.size * x.dtype.itemsize for x in leaves if x is not None)
    self.assertEqual(kvjax.kv_bytes_per_token(config, dtype), nbytes // (B * S))
    self.assertEqual(nbytes % (B * S), 0)
    itemsize = jnp.dtype(dtype).itemsize
    if config.attention == "mla":
      payload = (config.num_layers *
                 (config.kv_lora_rank + config.qk_rope_head_dim) * itemsize)
    else:
      payload = (config.num_layers * config.num_kv_heads * 2 *
                 config.head_dim * itemsize)
    scales = nbytes // (B * S) - payload
    self.assertEqual(scales > 0, dtype == "int8")

  def test_cache_bytes_reports_total_and_used(self):
    config = tiny("gqa")
    cache = kvjax.init_cache(config, 2, 32)
    _, cache = kvjax.prefill(tiny_params("gqa"), config, prompt(2, 8), cache)
    b = kvjax.cache_bytes(cache)
    per_token = kvjax.kv_bytes_per_token(config)
    self.assertEqual(b["kv"], per_token * 2 * 32)
    self.assertEqual(b["used"], per_token * 2 * 8)
    self.assertGreater(b["total"], b["kv"])

  @parameterized.named_parameters(
      ("heads_not_divisible", dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
      ("odd_head_dim", dict(embed_dim=12, num_heads=4), "head_dim"),
      ("zero_layers", dict(num_layers=0), "num_layers"),
      ("unknown_attention", dict(attention="linear"), "attention"),
      ("mla_zero_rank", dict(attention="mla", kv_lora_rank=0,
                             qk_nope_head_dim=8, qk_rope_head_dim=4,
                             v_head_dim=8), "kv_lora_rank"),
      ("mla_odd_rope", dict(attention="mla", kv_lora_rank=16,
                            qk_nope_head_dim=8, qk_rope_head_dim=3,
                            v_head_dim=8), "qk_rope_head_dim"),
  )
  def test_bad_config_names_the_field(self, overrides, field):
    base = dict(vocab_size=32, num_layers=1, embed_dim=16, num_heads=4,
                num_kv_heads=2, mlp_dim=32)
    with self.assertRaisesRegex(ValueError, field):
      kvjax.ModelConfig(**dict(base, **overrides))

  def test_unknown_config_key_raises(self):
    with self.assertRaisesRegex(ValueError, "num_kv_head"):
      kvjax.ModelConfig.from_dict(dict(num_kv_head=2))


class CachedEqualsUncachedTest(chex.TestCase):

  @cases.variants()
  def test_generate_equals_no_cache_generate_and_the_forward(self, variant):
    config, params = tiny(variant), tiny_params(variant)
    tokens = prompt(2, 9)
    ids, logits, _ = kvjax.generate(params, config, tokens, 12,
                                    return_logits=True)
    ref_ids, ref_logits, _ = kvjax.generate_no_cache(params, config, tokens,
                                                     12, return_logits=True)
    chex.assert_shape(ids, (2, 12))
    np.testing.assert_array_equal(ids, ref_ids)
    assert_close(logits, ref_logits, config)
    chex.assert_tree_all_finite(logits)
    # Teacher forcing: the logits each token was sampled from are the full
    # forward's logits over prompt + generated tokens (positions 8..19).
    full = kvjax.forward(params, config, jnp.concatenate([tokens, ids], 1))
    assert_close(logits, full[:, 8:20], config)

  @cases.variants()
  def test_prefill_equals_forward(self, variant):
    config, params = tiny(variant), tiny_params(variant)
    tokens = prompt(3, 11)
    cache = kvjax.init_cache(config, 3, 16)
    logits, cache = kvjax.prefill(params, config, tokens, cache,
                                  all_logits=True)
    assert_close(logits, kvjax.forward(params, config, tokens), config)
    np.testing.assert_array_equal(cache.length, [11, 11, 11])
    np.testing.assert_array_equal(cache.positions[:, :11],
                                  np.tile(np.arange(11), (3, 1)))
    self.assertTrue((np.asarray(cache.positions[:, 11:]) == -1).all())

  @cases.variants()
  def test_prefill_then_decode_equals_longer_prefill(self, variant):
    config, params = tiny(variant), tiny_params(variant)
    tokens = prompt(2, 8)
    last, cache = kvjax.prefill(params, config, tokens[:, :7],
                                kvjax.init_cache(config, 2, 16))
    stepped, cache = kvjax.decode_step(params, config, tokens[:, 7], cache)
    longer, longer_cache = kvjax.prefill(params, config, tokens,
                                         kvjax.init_cache(config, 2, 16))
    assert_close(stepped, longer, config)
    # The caches agree too: decode wrote exactly what prefill writes.
    assert_close(cache, longer_cache, config)
    del last

  @chex.variants(with_jit=True, without_jit=True)
  @cases.variants()
  def test_jit_and_no_jit_agree(self, variant):
    config, params = tiny(variant), tiny_params(variant)
    tokens = prompt(2, 6)
    mask = jnp.ones(tokens.shape, bool)

    @self.variant
    def run(params, tokens, mask):
      cache = kvjax.init_cache(config, 2, 8)
      logits, cache = model.prefill_logits(params, config, tokens, mask,
                                           cache, False)
      step, cache = model.decode_logits(params, config, tokens[:, 0], cache)
      return logits, step, cache

    ref = kvjax.forward(params, config, jnp.concatenate(
        [tokens, tokens[:, :1]], axis=1))
    logits, step, cache = run(params, tokens, mask)
    assert_close(logits[:, 0], ref[:, 5], config)
    assert_close(step, ref[:, 6], config)
    chex.assert_tree_all_finite(cache)


class AttendBucketsTest(chex.TestCase, parameterized.TestCase):
  """generate's decode loop attends over power-of-two prefixes of the cache
  (`inference.attention_schedule`): same tokens and logits as attending
  the whole capacity."""

  @cases.named(
      dict(testcase_name=f"prompt{p}-steps{n}-capacity{c}-mult{m}", prompt=p,
           steps=n, capacity=c, mult=m, expected=e) for p, n, c, m, e in (
               # Powers of two, then the last segment stops at what the
               # generation fills (383 slots -> 384), not at the next power
               # of two (512).
               (128, 255, 512, 1, ((128, 256), (127, 384))),
               (16, 300, 1024, 1, ((112, 128), (128, 256), (60, 384))),
               # The last segment reaches the capacity: attend the whole
               # cache.
               (16, 149, 256, 1, ((112, 128), (37, 0))),
               (100, 50, 4096, 32, ((28, 128), (22, 256))),
               (1000, 2000, 4096, 1, ((24, 1024), (1024, 2048), (952, 3072))),
               (5, 3, 16, 1, ((3, 0),))))
  def test_schedule_covers_every_step(self, prompt, steps, capacity, mult,
                                      expected):
    sched = inference.attention_schedule(prompt, steps, capacity, mult)
    self.assertEqual(sched, expected)
    self.assertEqual(sum(n for n, _ in sched), steps)
    j = 0
    for n, attend in sched:
      if attend:
        self.assertEqual(attend % mult, 0)
        self.assertLess(attend, capacity)
        # The last step of the segment fills slots [0, prompt + j + n - 1].
        self.assertLessEqual(prompt + j + n, attend)
      j += n

  @pytest.mark.slow  # 150 steps, twice; the schedule itself is checked above
  def test_last_segment_short_of_the_capacity_changes_nothing(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    tokens = jax.random.randint(jax.random.key(3), (2, 16), 0,
                                config.vocab_size)
    self.assertEqual(inference.attention_schedule(16, 149, 512),
                     ((112, 128), (37, 256)))
    outs = [kvjax.generate(params, config, tokens, 150, capacity=512,
                           return_logits=True, attend_buckets=b)
            for b in (True, False)]
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    assert_close(outs[0][1], outs[1][1], config)

  # Fast tier: GQA over a float cache (150 steps of every case: MLA over
  # KIVI costs 5x as much).
  @cases.product(variant=VARIANTS, kind=("float32", "int8-kivi"),
                 slow=lambda variant, kind: (variant, kind) != ("gqa",
                                                                "float32"))
  def test_buckets_change_nothing(self, variant, kind):
    from kvjax.lab import benchmarking as bm  # pylint: disable=g-import-not-at-top
    config, params = tiny(variant), tiny_params(variant)
    B, T, new = 2, 16, 150
    tokens = jax.random.randint(jax.random.key(3), (B, T), 0,
                                config.vocab_size)
    mask = np.ones((B, T), bool)
    mask[1, :9] = False  # ragged: 7 real tokens
    sched = inference.attention_schedule(T, new - 1, 256)
    self.assertEqual([a for _, a in sched], [128, 0])
    outs = [kvjax.generate(params, config, tokens, new, attention_mask=mask,
                           capacity=256, policy=bm.cache_policy(kind),
                           return_logits=True, attend_buckets=b)
            for b in (True, False)]
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    assert_close(outs[0][1], outs[1][1], config,
                 cache=bm.cache_policy(kind).kv_dtype)

  def test_attend_needs_a_prefix_cache(self):
    cache = kvjax.init_cache(tiny("gqa"), 1, 32,
                             policy=kvjax.CachePolicy("window"))
    with self.assertRaisesRegex(ValueError, "attend=16 needs eviction"):
      model.decode_step_info(tiny("gqa"), cache, 16)


class StructureTest(chex.TestCase):

  @cases.variants()
  def test_causality(self, variant):
    config, params = tiny(variant), tiny_params(variant)
    tokens = prompt(1, 10)
    changed = tokens.at[0, 6].set((tokens[0, 6] + 1) % config.vocab_size)
    a = kvjax.forward(params, config, tokens)
    b = kvjax.forward(params, config, changed)
    np.testing.assert_array_equal(a[:, :6], b[:, :6])
    self.assertGreater(float(jnp.abs(a[:, 6:] - b[:, 6:]).max()), 1e-4)

  @cases.variants()
  def test_causality_by_gradient(self, variant):
    # d logit_t / d embedding_s is zero for every s > t (nanodo's check).
    config, params = tiny(variant), tiny_params(variant)
    T = 6
    x_BTD = jax.random.normal(jax.random.key(2), (1, T, config.embed_dim))
    step = model.forward_step(config, jnp.ones((1, T), bool))

    def per_position(x_BTD):
      y_BTD, _ = model.run_layers(params, x_BTD, step, None, config)
      return jnp.sum(y_BTD[0], axis=-1)  # [T]

    jac_TBTD = jax.jit(jax.jacrev(per_position))(x_BTD)
    norms_TS = np.asarray(jnp.abs(jac_TBTD[:, 0]).sum(-1))
    upper = np.triu(np.ones((T, T), bool), k=1)
    self.assertTrue((norms_TS[upper] == 0).all(), norms_TS)
    self.assertTrue((norms_TS[~upper] > 0).all(), norms_TS)

  @cases.variants()
  def test_decode_traces_once(self, variant):
    config, params = tiny(variant), tiny_params(variant)
    traced = chex.assert_max_traces(model.decode_logits, n=1)
    step_fn = jax.jit(traced, static_argnames="config",
                      donate_argnames="cache")
    _, cache = kvjax.prefill(params, config, prompt(2, 4),
                             kvjax.init_cache(config, 2, 32))
    tok = jnp.zeros((2,), jnp.int32)
    for _ in range(10):
      logits, cache = step_fn(params, config, tok, cache)
      tok = jnp.argmax(logits, -1).astype(jnp.int32)
    np.testing.assert_array_equal(cache.length, [14, 14])
    chex.clear_trace_counter()

  def test_public_decode_step_compiles_once(self):
    config = tiny("gqa").replace(vocab_size=255)  # a fresh jit cache entry
    params = kvjax.init_params(config, jax.random.key(0))
    _, cache = kvjax.prefill(params, config, prompt(2, 4, vocab=255),
                             kvjax.init_cache(config, 2, 32))
    before = inference._decode._cache_size()
    tok = jnp.zeros((2,), jnp.int32)
    for _ in range(6):
      _, cache = kvjax.decode_step(params, config, tok, cache)
    self.assertEqual(inference._decode._cache_size(), before + 1)

  @cases.variants()
  def test_cache_shapes_and_finiteness(self, variant):
    config, params = tiny(variant), tiny_params(variant)
    B, S = 2, 24
    _, cache = kvjax.prefill(params, config, prompt(B, 5),
                             kvjax.init_cache(config, B, S))
    L = config.num_layers
    if config.attention == "mla":
      self.assertIsInstance(cache, kvjax.LatentCache)
      chex.assert_shape(cache.c_kv, (L, B, S, config.kv_lora_rank))
      chex.assert_shape(cache.k_rope, (L, B, S, config.qk_rope_head_dim))
    else:
      self.assertIsInstance(cache, kvjax.KVCache)
      chex.assert_shape([cache.k, cache.v],
                        (L, B, config.num_kv_heads, S, config.head_dim))
    chex.assert_shape(cache.positions, (B, S))
    chex.assert_shape(cache.length, (B,))
    chex.assert_tree_all_finite(cache)

  def test_sampling_is_reproducible_from_the_key(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    sampler = kvjax.Sampler(temperature=1.0)
    a = kvjax.generate(params, config, prompt(), 8, sampler=sampler,
                       rng=jax.random.key(5))
    b = kvjax.generate(params, config, prompt(), 8, sampler=sampler,
                       rng=jax.random.key(5))
    c = kvjax.generate_no_cache(params, config, prompt(), 8, sampler=sampler,
                                rng=jax.random.key(5))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)


class BadInputTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.config, self.params = tiny("gqa"), tiny_params("gqa")

  def test_prompt_longer_than_capacity(self):
    with self.assertRaisesRegex(ValueError, "capacity 8"):
      kvjax.prefill(self.params, self.config, prompt(1, 9),
                    kvjax.init_cache(self.config, 1, 8))

  def test_generation_overflowing_the_cache(self):
    with self.assertRaisesRegex(ValueError, "capacity 16.*eviction='none'"):
      kvjax.generate(self.params, self.config, prompt(1, 10), 8, capacity=16)

  def test_decode_past_capacity(self):
    _, cache = kvjax.prefill(self.params, self.config, prompt(1, 4),
                             kvjax.init_cache(self.config, 1, 4))
    with self.assertRaisesRegex(ValueError, "exceed the cache capacity 4"):
      kvjax.decode_step(self.params, self.config, jnp.zeros((1,), jnp.int32),
                        cache)

  @parameterized.named_parameters(
      ("too_large", np.array([[1, 2, 256]]), r"\[0, 256\)"),
      ("negative", np.array([[-1, 2]]), r"\[0, 256\)"),
      ("float", np.array([[1.0, 2.0]]), "integer"),
      ("rank1", np.array([1, 2, 3]), "rank 2"),
      ("empty", np.zeros((1, 0), np.int32), "empty"),
  )
  def test_bad_tokens(self, tokens, message):
    for fn in (lambda: kvjax.forward(self.params, self.config, tokens),
               lambda: kvjax.generate(self.params, self.config, tokens, 2),
               lambda: kvjax.generate_no_cache(self.params, self.config,
                                               tokens, 2)):
      with self.assertRaisesRegex(ValueError, message):
        fn()

  def test_bad_masks(self):
    tokens = prompt(2, 4)
    with self.assertRaisesRegex(ValueError, "left-padded"):
      kvjax.forward(self.params, self.config, tokens,
                    np.array([[1, 1, 1, 0], [1, 1, 1, 1]]))
    with self.assertRaisesRegex(ValueError, "no real token"):
      kvjax.forward(self.params, self.config, tokens,
                    np.array([[0, 0, 0, 0], [1, 1, 1, 1]]))
    with self.assertRaisesRegex(ValueError, "shape"):
      kvjax.forward(self.params, self.config, tokens, np.ones((2, 3)))

  def test_bad_generation_arguments(self):
    with self.assertRaisesRegex(ValueError, "max_new_tokens"):
      kvjax.generate(self.params, self.config, prompt(), 0)
    with self.assertRaisesRegex(ValueError, "rng"):
      kvjax.generate(self.params, self.config, prompt(), 2,
                     sampler=kvjax.Sampler(temperature=0.7))

  def test_wrong_cache_kind(self):
    cache = kvjax.init_cache(tiny("mla"), 2, 16)
    with self.assertRaisesRegex(ValueError, "KVCache"):
      kvjax.prefill(self.params, self.config, prompt(), cache)

  def test_padding_rows_stay_finite(self):
    tokens = prompt(2, 6)
    mask = np.array([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    logits = kvjax.forward(self.params, self.config, tokens, mask)
    chex.assert_tree_all_finite(logits)


if __name__ == "__main__":
  absltest.main()
