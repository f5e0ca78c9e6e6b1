"""The decode loop's blocked cache (`kvjax.blocked`) and RoPE carried in the
decode loop (`model.decode_rope`).

Invariants: the blocked layout changes where the decode step reads, never
what it computes. A BlockedKV holds exactly the stacked cache's first P
slots (round trip bit for bit); its one-token write lands where the stacked
write does; its key logits, through the shared softmax, give
`attention.attend`'s output; a `generate` over it gives the stacked
generate's tokens, logits and final cache for MHA / MQA / GQA on the
decode params layout, float32 / bfloat16 / float16 caches and ragged
prompts.
'auto' picks it for GQA decode of 4+ sequences only; where it cannot run,
'blocked' raises naming the reason before any compute.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import attention
from kvjax import blocked
from kvjax import cache as cache_lib
from kvjax import inference
from kvjax import model
from kvjax import quant
from kvjax.tolerance import assert_close
import cases
from tiny_models import tiny, tiny_params

GQA_KINDS = ("mha", "mqa", "gqa")


def _random_cache(config, batch, capacity, length, dtype="float32", seed=0):
  """A KVCache whose first `length` slots hold random keys and values."""
  policy = cache_lib.CachePolicy(kv_dtype=dtype)
  cache = cache_lib.init_cache(config, batch, capacity, policy=policy)
  kk, kv = jax.random.split(jax.random.key(seed))
  k = jax.random.normal(kk, cache.k.shape).astype(cache.k.dtype)
  v = jax.random.normal(kv, cache.v.shape).astype(cache.v.dtype)
  filled = jnp.arange(capacity) < length
  pos = jnp.where(filled, jnp.arange(capacity), cache_lib.EMPTY)
  return cache.replace(
      k=k, v=v, positions=jnp.broadcast_to(pos, cache.positions.shape),
      length=jnp.full((batch,), length, jnp.int32))


class LayoutTest(parameterized.TestCase):

  @cases.product(kind=GQA_KINDS, attend=(64, 128, 192),
                 slow=lambda kind, attend: (kind, attend) != ("gqa", 192))
  def test_round_trip_is_exact(self, kind, attend):
    config = tiny(kind)
    cache = _random_cache(config, 3, 256, 100)
    seg = blocked.from_cache(cache, attend)
    L, B, K, _, H = cache.k.shape
    self.assertLen(seg.k, L)
    chex.assert_shape(seg.k[0], (B, K, attend // blocked.BLOCK, H,
                                 blocked.BLOCK))
    chex.assert_shape(seg.v[0], (B, K, attend, H))
    self.assertEqual(seg.capacity, attend)
    # Slot s of layer l sits in block s // X, column s % X, head-dim-major.
    s = attend - 7
    np.testing.assert_array_equal(
        seg.k[1][:, :, s // blocked.BLOCK, :, s % blocked.BLOCK],
        cache.k[1, :, :, s])
    back = blocked.into_cache(cache, seg)
    chex.assert_trees_all_equal(back, cache)

  def test_into_cache_takes_the_segment_slots_only(self):
    config = tiny("gqa")
    cache = _random_cache(config, 2, 256, 100)
    seg = blocked.from_cache(cache, 128)
    seg = seg.replace(k=tuple(k + 1 for k in seg.k),
                      v=tuple(v - 1 for v in seg.v),
                      length=seg.length + 5)
    back = blocked.into_cache(cache, seg)
    np.testing.assert_array_equal(back.k[:, :, :, :128],
                                  cache.k[:, :, :, :128] + 1)
    np.testing.assert_array_equal(back.v[:, :, :, :128],
                                  cache.v[:, :, :, :128] - 1)
    np.testing.assert_array_equal(back.k[:, :, :, 128:],
                                  cache.k[:, :, :, 128:])
    np.testing.assert_array_equal(back.length, cache.length + 5)

  @cases.product(dtype=("float32", "bfloat16", "float16"),
                 slow=lambda dtype: dtype != "bfloat16")
  def test_write_lands_where_the_stacked_write_does(self, dtype):
    config = tiny("gqa")
    cache = _random_cache(config, 3, 256, 100, dtype)
    B, K, H = 3, config.num_kv_heads, config.head_dim
    slots_BT = jnp.array([[100], [5], [127]], jnp.int32)
    k_BTKH = jax.random.normal(jax.random.key(7), (B, 1, K, H))
    v_BTKH = jax.random.normal(jax.random.key(8), (B, 1, K, H))
    want = attention.write_kv(cache, 1, slots_BT, k_BTKH, v_BTKH)
    got = blocked.write(blocked.from_cache(cache, 128), 1, slots_BT, k_BTKH,
                        v_BTKH)
    chex.assert_trees_all_equal(blocked.into_cache(cache, got), want)

  def test_write_past_the_segment_is_dropped(self):
    config = tiny("gqa")
    cache = _random_cache(config, 2, 256, 100)
    seg = blocked.from_cache(cache, 128)
    slots_BT = jnp.array([[128], [200]], jnp.int32)
    kv = jnp.ones((2, 1, config.num_kv_heads, config.head_dim))
    got = blocked.write(seg, 0, slots_BT, kv, kv)
    chex.assert_trees_all_equal(got, seg)

  def test_write_rejects_more_than_one_token(self):
    config = tiny("gqa")
    seg = blocked.from_cache(_random_cache(config, 2, 128, 10), 128)
    kv = jnp.ones((2, 2, config.num_kv_heads, config.head_dim))
    with self.assertRaisesRegex(ValueError, "T = 1"):
      blocked.write(seg, 0, jnp.zeros((2, 2), jnp.int32), kv, kv)

  @cases.product(kind=GQA_KINDS, dtype=("float32", "bfloat16"),
                 slow=lambda kind, dtype: (kind, dtype) != ("gqa", "float32"))
  def test_attend_equals_stacked_attend(self, kind, dtype):
    config = tiny(kind)
    B, P = 3, 192
    cache = _random_cache(config, B, 256, 150, dtype)
    K, G, H = config.num_kv_heads, config.groups, config.head_dim
    q_BTKGH = jax.random.normal(jax.random.key(3), (B, 1, K, G, H))
    # Ragged: each sequence attends a different prefix; one row is empty.
    lengths = jnp.array([150, 70, 0])
    mask_BTS = (jnp.arange(P)[None, None] < lengths[:, None, None])

    @jax.jit
    def both(cache, q_BTKGH, mask_BTS):
      k_BKSH, v_BKSH = attention.read_kv(cache, 1, jnp.float32, P)
      k_BKWHX, v_blocked = blocked.read(blocked.from_cache(cache, P), 1,
                                        jnp.float32)
      mask_BKTS = mask_BTS[:, None]  # one mask for every kv head
      return (attention.attend(q_BTKGH, k_BKSH, v_BKSH, mask_BKTS, 0.3),
              attention.decode_softmax_values(
                  blocked.key_logits(q_BTKGH, k_BKWHX), v_blocked, mask_BKTS,
                  0.3, jnp.float32))
    (want, want_p), (got, got_p) = both(cache, q_BTKGH, mask_BTS)
    chex.assert_tree_all_finite((got, got_p))
    assert_close(got, want, depth=1)
    assert_close(got_p, want_p, depth=1)

  def test_attention_reads_it_through_the_decode_cache_protocol(self):
    # attention.py never names the blocked layout: the kind registers its
    # write / read / attend, and an unregistered kind is refused by name.
    self.assertNotIn("blocked", vars(attention))
    ops = attention.decode_cache(blocked.from_cache(
        kvjax.init_cache(tiny("gqa"), 2, 128), 128))
    self.assertIs(ops.write, blocked.write)
    self.assertIs(attention.decode_cache(kvjax.init_cache(tiny("gqa"), 2, 8)
                                         ).read, attention.read_kv)
    with self.assertRaisesRegex(TypeError, "register_decode_cache"):
      attention.decode_cache(object())

  def test_supports_names_what_it_cannot_block(self):
    config = tiny("gqa")
    cache = cache_lib.init_cache(config, 2, 256)
    self.assertIsNone(blocked.supports(cache, 128))
    self.assertIn("multiple of the block", blocked.supports(cache, 100))
    self.assertIn("within capacity", blocked.supports(cache, 320))
    int8 = cache_lib.init_cache(config, 2, 256, dtype="int8")
    self.assertIn("int8", blocked.supports(int8, 128))
    window = cache_lib.init_cache(
        config, 2, 256, policy=cache_lib.CachePolicy(eviction="window"))
    self.assertIn("eviction='window'", blocked.supports(window, 128))
    latent = cache_lib.init_cache(tiny("mla"), 2, 256)
    self.assertIn("latent", blocked.supports(latent, 128))
    with self.assertRaisesRegex(ValueError, "multiple of the block"):
      blocked.from_cache(cache, 100)


class GenerateTest(parameterized.TestCase):

  def _both(self, config, params, tokens, n, **kw):
    out = {}
    for layout in ("stacked", "blocked"):
      out[layout] = inference.generate(params, config, tokens, n,
                                       return_logits=True, return_cache=True,
                                       decode_layout=layout, **kw)
    return out["stacked"], out["blocked"]

  def _check_same(self, a, b, config, kv_dtype="float32"):
    """Same tokens; logits and cached K/V equal up to float reassociation
    (a half-precision cache can round a reassociated key the other way, one
    unit in its last place: `kvjax.tolerance`)."""
    np.testing.assert_array_equal(a[0], b[0])
    assert_close(a[1], b[1], config, cache=kv_dtype)
    for name in ("k", "v"):
      assert_close(quant.dequantize(getattr(a[2], name), None, jnp.float32),
                   quant.dequantize(getattr(b[2], name), None, jnp.float32),
                   config, cache=kv_dtype, msg=name)
    np.testing.assert_array_equal(a[2].positions, b[2].positions)
    np.testing.assert_array_equal(a[2].length, b[2].length)

  @cases.named((dict(kind="mha", layout="packed"),
                dict(kind="mqa", layout="packed"),
                dict(kind="gqa", layout="packed")),
               slow=lambda kind, layout: (kind, layout) != ("gqa", "packed"))
  def test_same_tokens_logits_and_cache(self, kind, layout):
    config = tiny(kind)
    params = _layout(kind, layout)
    tokens = jax.random.randint(jax.random.key(1), (3, 20), 0,
                                config.vocab_size)
    # Prompt bucket 32 + 109 steps: segments (96 steps, 128 slots), then
    # (13, all 256): both blocked.
    self.assertEqual(inference.attention_schedule(32, 109, 256),
                     ((96, 128), (13, 0)))
    self._check_same(*self._both(config, params, tokens, 110), config)

  @cases.product(dtype=("bfloat16", "float16"),
                 slow=lambda dtype: dtype != "bfloat16")
  def test_same_with_a_half_precision_cache(self, dtype):
    config = tiny("gqa")
    params = kvjax.pack(tiny_params("gqa"), config)
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 0,
                                config.vocab_size)
    policy = cache_lib.CachePolicy(kv_dtype=dtype)
    self._check_same(*self._both(config, params, tokens, 90, policy=policy),
                     config, dtype)

  def test_same_with_ragged_prompts(self):
    config = tiny("gqa")
    params = kvjax.pack(tiny_params("gqa"), config)
    tokens = jax.random.randint(jax.random.key(3), (3, 16), 0,
                                config.vocab_size)
    mask = jnp.array([[1] * 16, [0] * 9 + [1] * 7, [0] * 15 + [1]])
    self._check_same(*self._both(config, params, tokens, 70,
                                 attention_mask=mask), config)

  @pytest.mark.slow  # an edge of the schedule; blocked == stacked is above
  def test_a_segment_off_the_block_grid_reads_the_stacked_cache(self):
    # Capacity 136: the last segment attends all 136 slots, not a multiple
    # of 64, so only the first (128 slots) runs blocked. Same results.
    config = tiny("gqa")
    params = kvjax.pack(tiny_params("gqa"), config)
    tokens = jax.random.randint(jax.random.key(4), (2, 30), 0,
                                config.vocab_size)
    self.assertEqual(inference.attention_schedule(32, 103, 136),
                     ((96, 128), (7, 0)))
    self._check_same(*self._both(config, params, tokens, 104, capacity=136),
                     config)

  def test_auto_never_blocks(self):
    # 'blocked' runs when asked for; 'auto' reads the stacked or the layered
    # cache (`kvjax.layered`, tests/test_layered.py).
    def chosen(kind, batch, layout="packed", **kw):
      config = tiny(kind)
      params = _layout(kind, layout)
      tokens = jnp.zeros((batch, 8), jnp.int32)
      return inference._generate_args(  # pylint: disable=protected-access
          params, config, tokens, 20, None, kvjax.GREEDY, None, None,
          kw.get("policy"), kw.get("stop_tokens", ()), 0, False, True, None,
          True, "auto")[-1].blocked
    big = inference.LAYERED_MIN_BATCH
    for kind, batch in (("gqa", big), ("mha", big + 1), ("gqa", 1)):
      self.assertFalse(chosen(kind, batch))

  @parameterized.named_parameters(
      ("unknown", dict(decode_layout="tiled"), "decode_layout='tiled'"),
      ("mla", dict(kind="mla"), "attention='mla'"),
      ("scan", dict(layout="scan"), "per-layer arrays"),
      ("int8", dict(policy=cache_lib.CachePolicy(kv_dtype="int8")),
       "kv_dtype='int8'"),
      ("stop_tokens", dict(stop_tokens=(1,)), "decode segments"),
  )
  def test_blocked_where_it_cannot_run_raises(self, kw, match):
    kw = dict(kw)
    kind, layout = kw.pop("kind", "gqa"), kw.pop("layout", "packed")
    config = tiny(kind)
    params = _layout(kind, layout)
    kw.setdefault("decode_layout", "blocked")
    with self.assertRaisesRegex(ValueError, match):
      inference.generate(params, config, jnp.zeros((2, 8), jnp.int32), 20,
                         **kw)


def _layout(kind: str, layout: str):
  """The tiny params of `kind` canonical ('scan') or packed ('packed')."""
  params = tiny_params(kind)
  return kvjax.pack(params, tiny(kind)) if layout == "packed" else params


class DecodeRopeTest(parameterized.TestCase):

  def test_decode_rope_rotates_the_next_query(self):
    config = tiny("gqa")
    cache = _random_cache(config, 3, 64, 10).replace(
        length=jnp.array([10, 0, 63], jnp.int32))
    cos, sin = model.decode_rope(config, cache)
    want_cos, want_sin = kvjax.layers.rope_tables(config,
                                                  cache.length[:, None])
    chex.assert_shape(cos, (3, 1, config.rope_dim // 2))
    assert_close((cos, sin), (want_cos, want_sin), depth=1)

  def test_none_in_cache_position_mode(self):
    config = tiny("gqa")
    policy = cache_lib.CachePolicy(eviction="window", positions="cache")
    cache = cache_lib.init_cache(config, 2, 16, policy=policy)
    self.assertIsNone(model.decode_rope(config, cache))

  @cases.product(kind=("gqa", "mla"))
  def test_carried_rope_gives_the_same_step(self, kind):
    config = tiny(kind)
    params = tiny_params(kind)
    cache = kvjax.init_cache(config, 2, 32)
    tokens = jax.random.randint(jax.random.key(5), (2, 6), 0,
                                config.vocab_size)
    _, cache = jax.jit(model.prefill_logits,
                       static_argnames=("config", "all_logits"))(
                           params, config, tokens, jnp.ones((2, 6), bool),
                           cache, all_logits=False)
    tok = jnp.array([3, 4], jnp.int32)
    step = jax.jit(model.decode_logits, static_argnames=("config",))
    want = step(params, config, tok, cache)
    got = step(params, config, tok, cache,
               rope=model.decode_rope(config, cache))
    # Two programs (tables computed inside vs passed in): XLA may fuse the
    # rotation differently, so equal up to float rounding.
    assert_close(got, want, config)


if __name__ == "__main__":
  absltest.main()
