"""Tiled (flash-style) prompt attention equals dense attention.

Invariants: `flash.attend` equals a float64 masked-softmax reference for
every tiling (query and key tiles that do and do not divide the call),
padded queries, keys before the queries (extend), GQA groups, value widths
other than the key width, the model's sliding window and every positional
cache policy's visibility; rows with no visible key give 0. Through the
model, prefill, extend and chunked prefill in tiles give the dense path's
logits and cache for every attention variant (MLA too). XLA's memory
analysis of the tiled prefill grows linearly with the prompt, the dense
one quadratically.
"""


from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import attention
from kvjax import flash
from kvjax import model
from kvjax.lab import benchmarking
from kvjax.tolerance import assert_close
from configs import model as model_presets

import cases  # pylint: disable=g-bad-import-order
from tiny_models import tiny, tiny_params  # pylint: disable=g-bad-import-order

# The first variant of each attention kind: one KVCache, one LatentCache.
KINDS = tuple({model_presets.model_dict(v, "tiny")["attention"]: v
               for v in reversed(model_presets.VARIANTS)}.values())


def reference(q_BTKGH, k_BKSH, v_BKSO, mask_BTS, scale):
  """float64 masked softmax attention; rows with no visible key give 0."""
  q, k, v = (np.asarray(x, np.float64) for x in (q_BTKGH, k_BKSH, v_BKSO))
  s = np.einsum("btkgh,bksh->bkgts", q, k) * scale
  m = np.asarray(mask_BTS)[:, None, None]
  s = np.where(m, s, -np.inf)
  top = np.max(s, axis=-1, keepdims=True)
  p = np.where(m, np.exp(s - np.where(np.isfinite(top), top, 0)), 0)
  denom = p.sum(-1, keepdims=True)
  p = p / np.where(denom > 0, denom, 1)
  return np.einsum("bkgts,bkso->btkgo", p, v)


def inputs(B=2, T=37, S_old=0, K=2, G=3, H=8, O=8, seed=0, pad=(0, 5)):
  """Random queries, keys, values (large: peaked softmax) and positions:
  row b left-padded by pad[b]; S_old cached keys before the T new ones."""
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  S = S_old + T
  q = 2 * jax.random.normal(kq, (B, T, K, G, H))
  k = 2 * jax.random.normal(kk, (B, K, S, H))
  v = jax.random.normal(kv, (B, K, S, O))
  mask_BT = np.arange(T)[None] >= np.asarray(pad)[:, None]
  q_pos = np.where(mask_BT, np.cumsum(mask_BT, 1) - 1 + S_old, -1)
  k_pos = np.concatenate(
      [np.broadcast_to(np.arange(S_old), (B, S_old)), q_pos], axis=1)
  return q, k, v, jnp.asarray(q_pos), jnp.asarray(k_pos)


POLICIES = dict(none=kvjax.CachePolicy(),
                window=kvjax.CachePolicy("window"),
                sinks=kvjax.CachePolicy("sinks", num_sinks=3),
                # Append-only caches whose tiles are read and dequantized
                # in place by a tiled extend (`attention.cached_keys`).
                int8=kvjax.CachePolicy(kv_dtype="int8"),
                int4=kvjax.CachePolicy(kv_dtype="int4"))


class TiledAttentionTest(parameterized.TestCase):

  @cases.product(tiles=((8, 16), (5, 7)),
                 policy=("none", "window", "sinks"),
                 sliding_window=(0, 9), S_old=(0, 20))
  def test_equals_float64_reference(self, tiles, policy, sliding_window,
                                    S_old):
    q, k, v, q_pos, k_pos = inputs(S_old=S_old, O=5)
    capacity = 16 if policy != "none" else 0
    vis = flash.Visibility(sliding_window, POLICIES[policy]
                           if policy != "none" else None, capacity)
    out = flash.attend(q, k, v, q_pos, k_pos, vis, 0.3,
                       query_tile=tiles[0], key_tile=tiles[1])
    mask = vis.mask(q_pos, k_pos)
    want = reference(q, k, v, mask, 0.3)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)
    # Padded queries see nothing: exactly 0.
    np.testing.assert_array_equal(np.asarray(out)[1, :5], 0.0)

  @cases.product(key_tile=(7, 16, 64), split=("cached_and_new", "all_cached"),
                 empty=(0, 9),
                 slow=lambda key_tile, split, empty: key_tile != 7)
  def test_cached_keys_read_in_tiles_equal_the_concatenation(
      self, key_tile, split, empty):
    # S0 = 30 cached slots (not a multiple of the tile: the last tile is
    # read early and its overlap masked), the last `empty` of them unused
    # (position -1, beyond `used`), then the T new keys.
    S_old, T = 30, 37
    q, k, v, q_pos, k_pos = inputs(T=T, S_old=S_old, O=5)
    k_pos = np.asarray(k_pos).copy()
    if empty:
      k_pos[:, S_old - empty:S_old] = -1
    k_pos = jnp.asarray(k_pos)
    vis = flash.Visibility()
    want = reference(q, k, v, vis.mask(q_pos, k_pos), 0.3)
    S0 = S_old if split == "cached_and_new" else S_old + T
    reads = []

    def read(start, size):
      reads.append(size)
      return (jax.lax.dynamic_slice_in_dim(k, start, size, axis=2),
              jax.lax.dynamic_slice_in_dim(v, start, size, axis=2))

    used = None if not empty else jnp.max(k_pos[:, :S0]) + 1
    cached = flash.CachedKeys(read, k_pos[:, :S0], used=used)
    if split == "cached_and_new":
      out = flash.attend(q, k[:, :, S0:], v[:, :, S0:], q_pos, k_pos[:, S0:],
                         vis, 0.3, cached=cached, query_tile=8,
                         key_tile=key_tile)
    else:
      out = flash.attend(q, None, None, q_pos, None, vis, 0.3, cached=cached,
                         query_tile=8, key_tile=key_tile)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)
    self.assertLessEqual(max(reads), key_tile)  # never the whole cache

  def test_equals_dense_attend(self):
    q, k, v, q_pos, k_pos = inputs(T=50, S_old=30)
    vis = flash.Visibility()
    mask_BKTS = vis.mask(q_pos, k_pos)[:, None]
    dense, _ = attention.attend(q, k, v, mask_BKTS, 0.3)
    tiled = flash.attend(q, k, v, q_pos, k_pos, vis, 0.3, query_tile=16,
                         key_tile=16)
    real = np.asarray(q_pos >= 0)
    np.testing.assert_allclose(np.asarray(tiled)[real],
                               np.asarray(dense)[real], atol=2e-5,
                               rtol=2e-5)

  def test_use_tiles(self):
    big = int(np.sqrt(flash.MIN_PAIRS)) + 1
    self.assertTrue(flash.use_tiles(big, big, False, "einsum"))
    self.assertFalse(flash.use_tiles(big, big, True, "einsum"))  # probs read
    self.assertFalse(flash.use_tiles(big, big, False, "cudnn"))
    self.assertFalse(flash.use_tiles(8, 8, False, "einsum"))


def _jitted(fn, pairs):
  """`fn` jitted with flash.MIN_PAIRS = pairs while it is traced. A fresh
  function object: JAX caches traces by function identity, so jitting
  `fn` itself twice would reuse the first setting's trace."""
  compiled = jax.jit(lambda *args: fn(*args))

  def run(*args):
    old = flash.MIN_PAIRS
    flash.MIN_PAIRS = pairs
    try:
      return compiled(*args)
    finally:
      flash.MIN_PAIRS = old
  return run


class ModelPathsTest(parameterized.TestCase):

  # Fast tier: each attention kind once (GQA with a window, MLA dense).
  @cases.product(variant=KINDS, policy=("none", "window", "sinks", "int8",
                                         "int4"),
                 slow=lambda variant, policy: (
                     policy not in (("none", "int8") if variant == "mla" else
                                    ("window", "int8"))))
  def test_prefill_and_extend_in_tiles_equal_dense(self, variant, policy):
    config, params = tiny(variant), tiny_params(variant)
    B, T, T2 = 2, 40, 12
    tokens = jax.random.randint(jax.random.key(3), (B, T + T2), 0,
                                config.vocab_size)
    mask = jnp.asarray(np.arange(T)[None] >= np.array([0, 6])[:, None])
    capacity = T + T2 if POLICIES[policy].append_only else 24
    pol = POLICIES[policy]

    def both(params, tokens, mask):
      cache = kvjax.init_cache(config, B, capacity, policy=pol)
      a, cache = model.prefill_logits(params, config, tokens[:, :T], mask,
                                      cache, True)
      b, cache = model.extend_logits(params, config, tokens[:, T:],
                                     jnp.ones((B, T2), bool), cache, True)
      return a, b, cache

    dense = _jitted(both, float("inf"))(params, tokens, mask)
    tiled = _jitted(both, 0)(params, tokens, mask)
    real = np.asarray(mask)
    assert_close(np.asarray(tiled[0])[real], np.asarray(dense[0])[real],
                 config, msg="prefill logits")
    assert_close(tiled[1], dense[1], config, msg="extend logits")
    assert_close(tiled[2], dense[2], config, msg="cache")

  def test_the_tiled_path_is_taken(self):
    # The key-tile loop is one more while loop than the dense path has.
    config, params = tiny("gqa"), tiny_params("gqa")
    tokens, mask = jnp.zeros((1, 64), jnp.int32), jnp.ones((1, 64), bool)

    def fn(params, tokens, mask):
      return model.prefill_logits(params, config, tokens, mask,
                                  kvjax.init_cache(config, 1, 64), False)

    loops = {}
    for pairs in (0, float("inf")):
      old = flash.MIN_PAIRS
      flash.MIN_PAIRS = pairs
      try:
        fresh = lambda *args: fn(*args)  # traces are cached per function
        loops[pairs] = str(jax.make_jaxpr(fresh)(params, tokens,
                                                 mask)).count("while[")
      finally:
        flash.MIN_PAIRS = old
    self.assertEqual(loops[0], loops[float("inf")] + 1, loops)

  @pytest.mark.slow  # compiles four prefills
  def test_memory_grows_linearly_in_tiles(self):
    # XLA's memory analysis (compile only): doubling the prompt doubles
    # the tiled prefill's temporaries and quadruples the dense scores.
    config, params = tiny("gqa"), tiny_params("gqa")

    def temporaries(T, path):
      return benchmarking.prefill_memory(params, config, 1, T,
                                         path=path)["temporaries"]

    tiled = [temporaries(T, "tiled") for T in (2048, 4096)]
    dense = [temporaries(T, "dense") for T in (2048, 4096)]
    self.assertLess(tiled[1] / tiled[0], 2.5, tiled)
    self.assertGreater(dense[1] / dense[0], 3.0, dense)
    self.assertLess(tiled[1], dense[1] / 4, (tiled, dense))


  @cases.product(variant=KINDS, slow=lambda variant: variant != "gqa")
  def test_a_chunk_holds_the_same_memory_however_long_the_cache(self,
                                                                 variant):
    # XLA's memory analysis (compile only) of a chunked prefill's last
    # chunk: the cached keys are read tile by tile in place, so the
    # temporaries do not grow with the cache (4x the slots here), while
    # the cache itself (the donated argument) does.
    config, params = tiny(variant), tiny_params(variant)
    mem = {S: benchmarking.chunk_memory(params, config, 1, S, 3072)
           for S in (4096, 16384)}
    # What grows is per-slot bookkeeping (positions: bytes per slot, not
    # keys and values), under 1 % of the cache's own growth.
    grew = mem[16384]["temporaries"] - mem[4096]["temporaries"]
    cache_grew = mem[16384]["outputs"] - mem[4096]["outputs"]
    self.assertLess(grew, cache_grew / 100, mem)
    self.assertGreater(mem[16384]["outputs"], 3 * mem[4096]["outputs"], mem)
    # A cache read whole (KIVI's grouped keys) still grows, so the check
    # can tell the two apart.
    kivi = kvjax.CachePolicy(kv_dtype="int8", key_quant="channel")
    grown = [benchmarking.chunk_memory(params, config, 1, S, 3072,
                                       policy=kivi)["temporaries"]
             for S in (4096, 16384)]
    self.assertGreater(grown[1] - grown[0], cache_grew / 4, grown)

if __name__ == "__main__":
  absltest.main()
