"""Bounded caches and eviction (issue 6).

Invariants:
  * slot arithmetic (`slot_of`, `kept_after`, `visible`, `cache_ranks`)
    equals a step-by-step simulation of "evict the oldest unpinned token";
  * while a stream fits the cache, every policy equals the unbounded cache;
  * window == attention restricted to the last S tokens (a sliding-window
    mask over the whole stream, every layer); sinks (original positions) ==
    the sinks mask; for one-layer models, cache-position window / sinks ==
    the no-cache forward of the cached tokens re-indexed from 0 (recompute);
  * sink slots hold the first tokens, bit for bit, forever;
  * h2o keeps the tokens that attention actually picks (planted weights);
  * 100k-token streams keep the cache's bytes constant and logits finite;
  * no recompilation as the stream grows; bad input raises ValueError.
Every policy runs for every attention variant of `configs/model.py`; test
names come from `ModelConfig.variant` and the policy itself.
"""

import functools
import os

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import cache as cache_lib
from kvjax import configs as configs_lib
from kvjax import model as kvmodel
from kvjax.lab import streaming
from kvjax.tolerance import assert_close

from configs import model as presets  # pylint: disable=g-import-not-at-top,wrong-import-position
import references  # pylint: disable=g-import-not-at-top,wrong-import-position

jax.config.update("jax_numpy_rank_promotion", "raise")

S, SINKS, RECENT, T = 16, 2, 4, 8  # capacity, sinks, h2o recent, chunk
B, N = 2, 48  # batch, stream length of the policy matrix (3 capacities)


def _config(variant, **overrides):
  d = presets.model_dict(variant, "tiny")
  # Large weights make attention peaky, so evicting a token visibly changes
  # the logits (checked: the tests below can fail).
  d.update(dict(init_scale=0.3), **overrides)
  return kvjax.ModelConfig.from_dict(d)


CONFIGS = [_config(v) for v in presets.VARIANTS]


def _policies():
  out = []
  for mode in cache_lib.POSITION_MODES:
    out += [cache_lib.CachePolicy("window", positions=mode),
            cache_lib.CachePolicy("sinks", num_sinks=SINKS, positions=mode),
            cache_lib.CachePolicy("h2o", recent=RECENT, positions=mode)]
  return out


def _name(policy):
  return f"{policy.eviction}_{policy.positions}"


@functools.cache
def _params(config):
  """Random params like `init_params` (normal(init_scale), norms = 1), drawn
  with numpy: compiling JAX's RNG for each config would dominate the tests'
  time budget."""
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(lambda: kvjax.init_params(config,
                                                    jax.random.key(0)))

  def draw(path, leaf):
    if str(path[-1].key).endswith("norm"):
      return jnp.ones(leaf.shape, leaf.dtype)
    w = config.init_scale * rng.standard_normal(leaf.shape)
    return jnp.asarray(w, leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def _tokens(config, shape, seed=1):
  rng = np.random.default_rng(seed)
  return rng.integers(0, config.vocab_size, size=shape).astype(np.int32)


# ---- references written independently of kvjax.cache ---------------------
_causal = references.causal
_window_mask = references.window_mask
_sinks_mask = references.sinks_mask
_masked_forward = references.masked_forward


def _simulate(policy, capacity, total):
  """Writes positions 0..total-1 into `capacity` slots: fill in order, then
  overwrite the oldest token that is not a sink. Returns the slot of every
  position and the slot contents after every write."""
  slots, written, states = [-1] * capacity, [], []
  for p in range(total):
    if -1 in slots:
      s = slots.index(-1)
    else:
      free = [i for i in range(capacity) if slots[i] >= policy.num_sinks]
      s = min(free, key=lambda i: slots[i])
    slots[s] = p
    written.append(s)
    states.append(list(slots))
  return np.array(written), states


def _storage(cache):
  """The per-token arrays and the axis that indexes slots."""
  if isinstance(cache, cache_lib.LatentCache):
    return {"c_kv": (cache.c_kv, 2), "k_rope": (cache.k_rope, 2)}
  return {"k": (cache.k, 3), "v": (cache.v, 3)}


class SlotArithmeticTest(chex.TestCase):
  """The closed forms in kvjax.cache against the simulation."""

  POLICIES = [cache_lib.CachePolicy("window"),
              cache_lib.CachePolicy("sinks", num_sinks=1),
              cache_lib.CachePolicy("sinks", num_sinks=3)]
  CASES = [(f"{p.eviction}{p.num_sinks or ''}_S{s}", p, s)
           for p in POLICIES for s in (4, 7)]

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(CASES)
  def test_slot_of_kept_after_visible(self, policy, capacity):
    total = 5 * capacity + 3
    written, states = _simulate(policy, capacity, total)
    pos = jnp.arange(total, dtype=jnp.int32)
    slot_of = self.variant(cache_lib.slot_of, static_argnums=(0, 1))
    np.testing.assert_array_equal(slot_of(policy, capacity, pos), written)
    kept = self.variant(cache_lib.kept_after, static_argnums=(0, 1))
    vis = self.variant(cache_lib.visible, static_argnums=(0, 1))
    for seen in range(1, total + 1):
      held = np.isin(np.arange(seen), states[seen - 1])
      np.testing.assert_array_equal(
          np.asarray(kept(policy, capacity, pos, seen))[:seen], held,
          err_msg=f"kept_after, {seen} tokens written")
    q, k = pos[:, None], pos[None, :]
    expect = np.array([[kk in states[qq] for kk in range(total)]
                       for qq in range(total)])
    causal = np.asarray(k <= q)
    np.testing.assert_array_equal(
        np.asarray(vis(policy, capacity, q, k)) & causal, expect & causal)

  @parameterized.named_parameters(
      CASES + [(f"h2o_S{s}", cache_lib.CachePolicy("h2o", recent=2), s)
               for s in (4, 7)])
  def test_cache_ranks(self, policy, capacity):
    """Rank of a slot = number of cached tokens older than it."""
    rng = np.random.default_rng(capacity)
    total = 3 * capacity + 1
    if policy.eviction == "h2o":  # any set of held positions, any order
      held = rng.choice(total, size=capacity, replace=False)
      held[rng.integers(capacity)] = cache_lib.EMPTY
    else:
      held = np.array(_simulate(policy, capacity, total)[1][-1])
    cache = cache_lib.KVCache(
        k=jnp.zeros((1, 1, 1, capacity, 2)), v=jnp.zeros((1, 1, 1, capacity,
                                                         2)),
        positions=jnp.asarray(held[None], jnp.int32),
        length=jnp.array([total], jnp.int32), policy=policy)
    ranks = np.asarray(cache_lib.cache_ranks(cache, cache.length))[0]
    valid = held >= 0
    expect = np.array([(held[valid] < h).sum() if h >= 0 else 0
                       for h in held])
    np.testing.assert_array_equal(ranks, expect)
    self.assertEqual(sorted(ranks[valid]), list(range(valid.sum())))

  def test_h2o_slot_constructed(self):
    """Fill in order; then evict the lowest score outside the recent set."""
    policy = cache_lib.CachePolicy("h2o", recent=3)
    positions = jnp.array([[6, 1, 2, 7, 4, 5], [0, 1, 2, -1, -1, -1]])
    scores = jnp.array([[0.0, 0.9, 0.2, 0.0, 0.1, 0.3],
                        [0.5, 0.1, 0.9, 0.0, 0.0, 0.0]])
    cache = cache_lib.KVCache(
        k=jnp.zeros((1, 2, 1, 6, 2)), v=jnp.zeros((1, 2, 1, 6, 2)),
        positions=positions, length=jnp.array([8, 3]), scores=scores,
        policy=policy)
    # Row 0: positions 6 and 7 are the newest recent-1 = 2 (kept whatever
    # their score); of the rest, position 4 (slot 4) has the lowest score.
    # Row 1 is not full: the next free slot.
    np.testing.assert_array_equal(kvmodel.decode_slots(cache), [4, 3])


class PolicyMatrixTest(parameterized.TestCase):
  """Every policy × every variant, streams 3x the capacity, two layers."""

  @parameterized.named_parameters(
      (f"{c.variant}_{_name(p)}", c, p) for c in CONFIGS for p in _policies())
  def test_stream(self, config, policy):
    params = _params(config)
    tokens = _tokens(config, (B, N + 1))
    cache = cache_lib.init_cache(config, B, S, policy=policy)
    fresh = cache_lib.cache_bytes(cache)
    logits = []
    for start in range(0, N, T):
      lg, cache = streaming.decode_tokens(params, config,
                                          tokens[:, start:start + T], cache)
      logits.append(np.asarray(lg))
      if start == 0:
        first = {k: np.array(a) for k, (a, _) in _storage(cache).items()}
    logits = np.concatenate(logits, axis=1)
    chex.assert_shape(logits, (B, N, config.vocab_size))
    chex.assert_tree_all_finite(logits)

    dense = np.asarray(_masked_forward(params, config, tokens[:, :N],
                                       _causal(N)[2]))
    # While the stream fits, every policy is the unbounded cache.
    assert_close(logits[:, :S], dense[:, :S], config)
    # After that, eviction changes the logits (so the checks can fail).
    self.assertGreater(np.abs(logits[:, S:] - dense[:, S:]).max(), 1e-2)

    # The cache's memory never changed; every slot holds a token.
    self.assertEqual(cache_lib.cache_bytes(cache),
                     dict(fresh, used=fresh["kv"]))
    np.testing.assert_array_equal(cache.length, [N] * B)
    held = np.sort(np.asarray(cache.positions), axis=1)
    newest = np.arange(N - RECENT, N)
    self.assertTrue(all(np.isin(newest, row).all() for row in held))
    self.assertTrue(all(len(set(row)) == S for row in held))

    if policy.eviction == "window":
      # Every layer attends the last S tokens: a sliding-window mask. RoPE
      # is relative, so cache positions (ranks shifted every step) and
      # original positions agree.
      ref = _masked_forward(params, config, tokens[:, :N], _window_mask(N, S))
      assert_close(logits, np.asarray(ref), config)
      np.testing.assert_array_equal(held, [np.arange(N - S, N)] * B)
    if policy.eviction == "sinks":
      np.testing.assert_array_equal(
          held, [np.r_[np.arange(SINKS), np.arange(N - S + SINKS, N)]] * B)
      # Sink slots hold the first tokens, bit for bit, forever.
      np.testing.assert_array_equal(np.asarray(cache.positions)[:, :SINKS],
                                    [np.arange(SINKS)] * B)
      for k, (arr, axis) in _storage(cache).items():
        idx = [slice(None)] * arr.ndim
        idx[axis] = slice(0, SINKS)
        np.testing.assert_array_equal(np.asarray(arr)[tuple(idx)],
                                      first[k][tuple(idx)], err_msg=k)
      if policy.positions == "original":
        ref = _masked_forward(params, config, tokens[:, :N],
                              _sinks_mask(N, S, SINKS))
        assert_close(logits, np.asarray(ref), config)


class FastPathTest(parameterized.TestCase):
  """`extend_nll` (the parallel path of the streaming experiment) equals
  the masked references for dense, window and sinks (original positions)."""

  @parameterized.named_parameters(
      (f"{c.variant}_{_name(p)}", c, p) for c in (CONFIGS[2], CONFIGS[3])
      for p in (cache_lib.CachePolicy(), cache_lib.CachePolicy("window"),
                cache_lib.CachePolicy("sinks", num_sinks=SINKS)))
  def test_extend_nll(self, config, policy):
    params = _params(config)
    tokens = _tokens(config, (B, N + 1))
    capacity = N if policy.eviction == "none" else S
    mask = {"none": _causal(N)[2], "window": _window_mask(N, S),
            "sinks": _sinks_mask(N, S, SINKS)}[policy.eviction]
    cache = cache_lib.init_cache(config, B, capacity, policy=policy)
    nll, _ = streaming.extend_nll(params, config, tokens, cache, chunk=T)
    ref = _masked_forward(params, config, tokens[:, :N], mask)
    want = streaming.token_nll(ref, tokens[:, 1:])
    assert_close(nll, np.asarray(want), config)


class CachePositionsTest(parameterized.TestCase):
  """One-layer models, where a cache-position window or sinks cache must
  equal a fresh forward over the cached tokens re-indexed from 0 (two-layer
  keys carry older context; see `streaming.recompute_nll`)."""

  CASES = [(_config("gqa", num_layers=1),
            cache_lib.CachePolicy("window", positions="cache")),
           (_config("gqa", num_layers=1),
            cache_lib.CachePolicy("sinks", num_sinks=SINKS,
                                  positions="cache")),
           (_config("mla", num_layers=1),
            cache_lib.CachePolicy("sinks", num_sinks=SINKS,
                                  positions="cache"))]

  @parameterized.named_parameters(
      (f"{c.variant}_{_name(p)}", c, p) for c, p in CASES)
  def test_equals_reindexed_forward(self, config, policy):
    params = _params(config)
    n = 40
    tokens = _tokens(config, (1, n + 1), seed=2)
    cache = cache_lib.init_cache(config, 1, S, policy=policy)
    logits, _ = streaming.decode_tokens(params, config, tokens[:, :n], cache)
    logits = np.asarray(logits)[0]
    if policy.eviction == "window":
      # The recompute baseline: a fresh forward over the last S tokens.
      recompute = streaming.recompute_nll(params, config, tokens, S,
                                          block=16, micro_batch=4)
      want = streaming.token_nll(logits, tokens[0, 1:])
      assert_close(recompute[0], np.asarray(want), config)
      # A strided recompute scores the same values at every 3rd position.
      strided = streaming.recompute_nll(params, config, tokens, S, stride=3,
                                        block=16, micro_batch=4)[0]
      scored = np.arange(n) % 3 == 2
      assert_close(strided[scored], recompute[0][scored], config)
      self.assertTrue(np.isnan(strided[~scored]).all())
    else:
      ts = np.arange(S, n)
      ctx = np.stack([np.r_[tokens[0, :SINKS],
                            tokens[0, t - (S - SINKS) + 1:t + 1]] for t in ts])
      ref = kvjax.forward(params, config, ctx)[:, -1]
      assert_close(logits[S:], np.asarray(ref), config)
      # Original positions put the sinks far away: a different model.
      orig = _masked_forward(params, config, tokens[:, :n],
                             _sinks_mask(n, S, SINKS))
      self.assertGreater(np.abs(np.asarray(orig)[0, S:] - logits[S:]).max(),
                         1e-2)


def _plant_heavy_hitter(config, params, heavy):
  """Weights under which every query attends almost only to token `heavy`.

  Every embedding gets a constant feature 0, `heavy` also feature 1; the
  query reads feature 0 and the key feature 1 into the same coordinate.
  For GQA that coordinate is the slowest rotary pair (rope_theta 1e12 makes
  it position-independent); for MLA it is a non-rotary (nope) coordinate.
  """
  p = jax.tree_util.tree_map(np.array, params)
  p["embed"][:, 0] += 1.0
  p["embed"][heavy, 1] += 4.0
  a = p["layers"]["attn"]
  if config.attention == "mla":
    # Latents are RMS-normalised: every token gets a large latent feature
    # 1 (so the others stay small), only `heavy` a large feature 0.
    a["kv_a"][0, 0, 1] = 1.0
    a["kv_a"][0, 1, 0] = 3.0
    a["w_uk"][0, 0, :, 0] = 2.0
    a["q"][0, 0, :, 0] = 2.0
  else:
    j = config.head_dim // 2 - 1  # the slowest rotary pair (j, j + H/2)
    a["q"][0, 0, :, j] = 1.5
    a["k"][0, 1, :, j] = 1.5
  return jax.tree_util.tree_map(jnp.asarray, p)


class HeavyHitterTest(parameterized.TestCase):

  @parameterized.named_parameters(
      (c.variant, c) for c in (_config("gqa", num_layers=1, rope_theta=1e12,
                                       init_scale=0.02),
                               _config("mla", num_layers=1, rope_theta=1e12,
                                       init_scale=0.02)))
  def test_h2o_keeps_the_attended_tokens(self, config):
    heavy, n = 7, 64
    params = _plant_heavy_hitter(config, _params(config), heavy)
    rng = np.random.default_rng(0)
    tokens = rng.integers(8, config.vocab_size, size=(1, n)).astype(np.int32)
    planted = np.array([3, 10, 21, 33])  # 4 <= S - RECENT slots to spare
    tokens[0, planted] = heavy
    cache = cache_lib.init_cache(
        config, 1, S, policy=cache_lib.CachePolicy("h2o", recent=RECENT))
    _, cache = streaming.decode_tokens(params, config, tokens, cache)
    kept = np.asarray(cache.positions)[0]
    scores = np.asarray(cache.scores)[0]
    heavy_slot = np.isin(kept, planted)
    # Attention really went to the planted tokens (the top scores) ...
    self.assertGreater(scores[heavy_slot].min(), 2 * scores[~heavy_slot].max())
    # ... and h2o kept every one, though all are older than the last S
    # tokens (so a window or any recency rule would have dropped them).
    self.assertLess(planted.max(), n - S)
    self.assertTrue(np.isin(planted, kept).all(), kept)
    self.assertTrue(np.isin(np.arange(n - RECENT, n), kept).all())


class LongStreamTest(parameterized.TestCase):
  """100k tokens token by token: constant bytes, finite logits."""

  CASES = [(_config("mla", num_layers=1),
            cache_lib.CachePolicy("window")),
           (_config("gqa", num_layers=1),
            cache_lib.CachePolicy("sinks", num_sinks=4, positions="cache")),
           (_config("mqa", num_layers=1),
            cache_lib.CachePolicy("h2o", recent=16, positions="cache"))]

  @parameterized.named_parameters(
      (f"{c.variant}_{_name(p)}", c, p) for c, p in CASES)
  def test_100k_tokens(self, config, policy):
    n, capacity = 100_000, 64
    params = _params(config)
    tokens = _tokens(config, (1, n + 1), seed=3)
    cache = cache_lib.init_cache(config, 1, capacity, policy=policy)
    fresh = cache_lib.cache_bytes(cache)
    shapes = jax.tree_util.tree_map(jnp.shape, cache)
    nll, cache = streaming.stream_nll(params, config, tokens, cache,
                                      chunk=n // 4)
    chex.assert_shape(nll, (1, n))
    chex.assert_tree_all_finite(nll)  # NaN would flag a non-finite logit
    self.assertEqual(jax.tree_util.tree_map(jnp.shape, cache), shapes)
    self.assertEqual(cache_lib.cache_bytes(cache),
                     dict(fresh, used=fresh["kv"]))
    np.testing.assert_array_equal(cache.length, [n])
    held = np.sort(np.asarray(cache.positions)[0])
    if policy.eviction == "window":
      np.testing.assert_array_equal(held, np.arange(n - capacity, n))
    elif policy.eviction == "sinks":
      np.testing.assert_array_equal(
          held, np.r_[np.arange(4), np.arange(n - capacity + 4, n)])
    else:
      self.assertTrue(np.isin(np.arange(n - 16, n), held).all())
      self.assertEqual(len(set(held)), capacity)


class RaggedBatchTest(absltest.TestCase):

  def test_rows_evict_independently(self):
    """A left-padded batch (prompts of 3 and 6 tokens, prefilled in one
    pass) then decoded past the capacity equals each row run alone: each
    row's sinks are its own first tokens, its ranks its own."""
    config = CONFIGS[2]
    params = _params(config)
    policy = cache_lib.CachePolicy("sinks", num_sinks=SINKS,
                                   positions="cache")
    rng = np.random.default_rng(5)
    rows = [rng.integers(0, config.vocab_size, size=n) for n in (3, 6)]
    tokens = np.zeros((2, 6), np.int32)
    mask = np.zeros((2, 6), np.int32)
    for b, r in enumerate(rows):
      tokens[b, 6 - len(r):], mask[b, 6 - len(r):] = r, 1
    more = _tokens(config, (2, 2 * S), seed=6)
    cache = cache_lib.init_cache(config, 2, S, policy=policy)
    first, cache = kvjax.prefill(params, config, tokens, cache,
                                 attention_mask=mask)
    logits, cache = streaming.decode_tokens(params, config, more, cache)
    for b, r in enumerate(rows):
      alone = cache_lib.init_cache(config, 1, S, policy=policy)
      first_b, alone = kvjax.prefill(params, config, r[None], alone)
      logits_b, alone = streaming.decode_tokens(params, config,
                                                more[b:b + 1], alone)
      assert_close(first[b], first_b[0], config)
      assert_close(logits[b], logits_b[0], config)
      np.testing.assert_array_equal(np.sort(cache.positions[b]),
                                    np.sort(alone.positions[0]))


class NoRecompilationTest(absltest.TestCase):

  def test_decode_traces_once(self):
    config = CONFIGS[-1]
    params = _params(config)
    policy = cache_lib.CachePolicy("h2o", recent=RECENT, positions="cache")

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(tok_B, cache):
      return kvmodel.decode_logits(params, config, tok_B, cache)

    cache = cache_lib.init_cache(config, 1, S, policy=policy)
    tokens = _tokens(config, (3 * S,))
    for t in tokens:  # fills the cache, then evicts for 2S more steps
      _, cache = step(jnp.asarray([t]), cache)
    np.testing.assert_array_equal(cache.length, [3 * S])

  def test_stream_compiles_once_per_chunk_shape(self):
    config = CONFIGS[0]
    params = _params(config)
    policy = cache_lib.CachePolicy("sinks", num_sinks=SINKS)
    tokens = _tokens(config, (1, 6 * T + 1))
    cache = cache_lib.init_cache(config, 1, S, policy=policy)
    _, cache = streaming.stream_nll(params, config, tokens[:, :T + 1], cache,
                                    chunk=T)
    before = streaming._decode_scan._cache_size()  # pylint: disable=protected-access
    cache = cache_lib.init_cache(config, 1, S, policy=policy)
    streaming.stream_nll(params, config, tokens, cache, chunk=T)
    self.assertEqual(streaming._decode_scan._cache_size(), before)  # pylint: disable=protected-access


class TimingAndPlotsTest(absltest.TestCase):

  def test_timing_table(self):
    config = CONFIGS[0]
    tokens = _tokens(config, (4 * S,))
    table = streaming.timing_table(_params(config), config, tokens,
                                   ["sinks2:original", "recompute"], [S],
                                   steps=4, rounds=2)
    self.assertEqual([(t["name"], t["slots"]) for t in table],
                     [("sinks2:original", S), ("recompute", S)])
    for t in table:
      self.assertGreater(t["ms_per_token"], 0)
    self.assertEqual(table[1]["recompute_over_this"], 1.0)
    with self.assertRaisesRegex(ValueError, "tokens"):
      streaming.timing_table(_params(config), config, tokens[:S],
                             ["sinks2:original"], [S], steps=4, rounds=2)

  def test_plots_write_png(self):
    out = self.create_tempdir().full_path
    nll = np.log(np.linspace(2.0, 4.0, 64))[None]
    curves = {"window": streaming.perplexity_by_position(nll, 16)}
    streaming.plot_perplexity(curves, os.path.join(out, "p.png"),
                              capacity=16, train_len=32, title="t")
    trace = [dict(tokens=t, used=10 * min(t, 4), kv=40) for t in range(9)]
    streaming.plot_memory({"gqa sinks": dict(variant="gqa", bounded=True,
                                             trace=trace)},
                          os.path.join(out, "m.png"), capacity=4)
    for name in ("p.png", "m.png"):
      with open(os.path.join(out, name), "rb") as f:
        self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


class AttentionProfileTest(parameterized.TestCase):

  @parameterized.named_parameters((c.variant, c) for c in CONFIGS[2:])
  def test_attention_matrix_is_causal_and_normalised(self, config):
    a = streaming.attention_matrix(_params(config), config,
                                   _tokens(config, (2, S)))
    chex.assert_shape(a, (S, S))
    assert_close(a.sum(axis=1), np.ones(S), depth=1)
    np.testing.assert_array_equal(np.triu(a, 1), 0)
    self.assertEqual(a[0, 0], 1.0)
    prof = streaming.attention_profile(_params(config), config,
                                       _tokens(config, (S,)), near=4, far=8)
    self.assertAlmostEqual(prof["first_token_if_uniform"],
                           np.mean(1 / np.arange(S // 2 + 1, S + 1)))


class MemoryTraceTest(absltest.TestCase):

  def test_bytes_grow_then_cap(self):
    config = CONFIGS[2]
    params = _params(config)
    every, n = 4, 24
    for policy, cap in ((cache_lib.CachePolicy("sinks", num_sinks=1), 8),
                        (cache_lib.CachePolicy(), n)):
      cache = cache_lib.init_cache(config, B, cap, policy=policy)
      trace, _ = streaming.memory_trace(params, config,
                                        _tokens(config, (B, n)), cache,
                                        every=every)
      per_token = kvjax.kv_bytes_per_token(config)
      self.assertEqual([r["tokens"] for r in trace], list(range(0, n + 1,
                                                                every)))
      for r in trace:
        self.assertEqual(r["kv"], per_token * B * cap)
        self.assertEqual(r["used"], per_token * B * min(r["tokens"], cap))


class BadInputTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("unknown_eviction", dict(eviction="lru"), "eviction"),
      ("unknown_positions", dict(positions="absolute"), "positions"),
      ("sinks_without_sinks", dict(eviction="sinks"), "num_sinks"),
      ("h2o_empty_window", dict(eviction="h2o", recent=0), "recent"),
      ("sinks_on_window", dict(eviction="window", num_sinks=2), "num_sinks"),
      ("negative_sinks", dict(eviction="sinks", num_sinks=-1), "num_sinks"))
  def test_policy(self, kwargs, field):
    with self.assertRaisesRegex(ValueError, field):
      cache_lib.CachePolicy(**kwargs)

  def test_policy_from_configdict(self):
    cfg = presets.get_config("gqa-tiny")
    cfg.cache.eviction = "fifo"
    with self.assertRaisesRegex(ValueError, "eviction"):
      configs_lib.cache_policy(cfg.cache)

  @parameterized.named_parameters(
      ("capacity_at_sinks", cache_lib.CachePolicy("sinks", num_sinks=4), 4,
       "num_sinks"),
      ("window_of_0", cache_lib.CachePolicy("window"), 0, "capacity"),
      ("h2o_no_room", cache_lib.CachePolicy("h2o", recent=8), 8, "recent"))
  def test_capacity(self, policy, capacity, field):
    with self.assertRaisesRegex(ValueError, field):
      cache_lib.init_cache(CONFIGS[0], 1, capacity, policy=policy)

  def test_overflow_without_eviction(self):
    config = CONFIGS[0]
    params = _params(config)
    tokens = _tokens(config, (1, 9))
    cache = cache_lib.init_cache(config, 1, 8)
    with self.assertRaisesRegex(ValueError, "capacity 8.*eviction='none'"):
      kvjax.prefill(params, config, tokens, cache)
    # Raised before compute: the cache was not donated and is still usable.
    _, cache = kvjax.prefill(params, config, tokens[:, :8], cache)
    with self.assertRaisesRegex(ValueError, "eviction='none'"):
      kvjax.decode_step(params, config, tokens[:, 0], cache)
    with self.assertRaisesRegex(ValueError, "eviction='none'"):
      streaming.stream_nll(params, config, tokens,
                           cache_lib.init_cache(config, 1, 4))
    with self.assertRaisesRegex(ValueError, "capacity"):
      kvjax.generate(params, config, tokens, 4, capacity=8, bucket=False)

  @parameterized.named_parameters(
      ("h2o", cache_lib.CachePolicy("h2o", recent=2)),
      ("cache_positions", cache_lib.CachePolicy("window",
                                                positions="cache")))
  def test_prompt_longer_than_capacity_needs_token_by_token(self, policy):
    config = CONFIGS[0]
    cache = cache_lib.init_cache(config, 1, 4, policy=policy)
    with self.assertRaisesRegex(ValueError, "token by token"):
      kvjax.prefill(_params(config), config, _tokens(config, (1, 5)), cache)

  def test_stream_policy_names(self):
    row = streaming.parse_policy("sinks4", 64, 1000)
    self.assertEqual((row.policy.num_sinks, row.policy.positions,
                      row.capacity), (4, "cache", 64))
    self.assertEqual(streaming.parse_policy("dense", 64, 1000).capacity, 1000)
    self.assertTrue(streaming.parse_policy("window", 64, 1000).fast_path)
    self.assertEqual(streaming.parse_policy("h2o", 64, 1000).policy.recent, 32)
    for bad in ("lru", "sinks", "recompute:cache", "window:absolute"):
      with self.assertRaisesRegex(ValueError, "policy"):
        streaming.parse_policy(bad, 64, 1000)
    with self.assertRaisesRegex(ValueError, "num_sinks"):
      streaming.parse_policy("sinks64", 64, 1000)

  def test_summary_table(self):
    n, cap = 12, 4
    rows = {name: streaming.parse_policy(name, cap, n + 1)
            for name in ("dense", "sinks1", "recompute")}
    nll = {"dense": np.log(np.full((1, n), 2.0)),
           "sinks1": np.log(np.r_[np.full(cap - 1, 2.0),
                                  np.full(n - cap + 1, 8.0)])[None],
           "recompute": np.where(np.arange(n) % 2, np.log(4.0), np.nan)[None]}
    table = {r["name"]: r for r in streaming.summarize(nll, rows, cap)}
    self.assertEqual(table["recompute"]["scored"], n // 2)
    self.assertAlmostEqual(table["recompute"]["ppl"], 4.0, places=5)
    self.assertAlmostEqual(table["sinks1"]["ppl_evicting"], 8.0, places=5)
    self.assertAlmostEqual(table["dense"]["ppl_common"], 2.0, places=5)
    self.assertEqual(table["dense"]["slots"], n + 1)
    md = streaming.markdown_table(list(table.values()))
    self.assertEqual(len(md.splitlines()), 2 + len(rows))

  def test_perplexity_by_position(self):
    nll = np.log(np.r_[np.full(4, 2.0), np.full(4, 8.0), [100.0]])[None]
    centres, ppl = streaming.perplexity_by_position(nll, 4)
    np.testing.assert_allclose(ppl, [2.0, 8.0])
    np.testing.assert_allclose(centres, [2.5, 6.5])
    self.assertAlmostEqual(streaming.perplexity(np.log([2.0, 8.0])), 4.0,
                           places=6)


if __name__ == "__main__":
  absltest.main()
