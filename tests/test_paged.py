"""The paged cache equals the contiguous cache.

Invariants:
  * prefill, decode and extend through a block table (pages in a random
    order) give the logits and tokens of the contiguous cache, and the
    pages hold what the contiguous cache holds, for MHA, MQA, GQA and MLA,
    every kv dtype (float32, bfloat16, float16, int8, KIVI int8 / int4 /
    int2) and a ragged batch;
  * `decode_loop` (k steps reading and writing the pool in place) equals
    k contiguous steps, for every variant and dtype; rows past their
    valid steps keep their state;
  * a write table that maps a page elsewhere copies on write: the shared
    page is unchanged, the copy holds the new token;
  * a write to an unmapped page is recorded (OVERFLOW), never dropped;
  * `from_contiguous` puts a contiguous cache's pages in the pool: its view
    is that cache;
  * bytes: a page is kv_bytes_per_token x Y; allocated / used are exact;
  * bad input raises ValueError naming the problem before any compute.
The fast tests exercise each invariant on GQA float32; the rest are
`slow`.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import cache as cache_lib
from kvjax import errors
from kvjax import paged as pg
from kvjax import quant
from kvjax.sampling import GREEDY
from kvjax.tolerance import assert_close
from configs import model as model_presets

from tiny_models import tiny, tiny_params  # pylint: disable=g-bad-import-order

VARIANTS = model_presets.VARIANTS
B, T, Y, M, Z = 3, 11, 8, 8, 40  # rows, prompt, page size, pages/row, pool
LENGTHS = (11, 7, 2)


def policy_name(policy: cache_lib.CachePolicy) -> str:
  return policy.kv_dtype + ("_kivi" if policy.channel_keys else "")


POLICIES = tuple(cache_lib.CachePolicy(kv_dtype=d) for d in
                 ("float32", "bfloat16", "float16", "int8")) + (
                     cache_lib.CachePolicy(kv_dtype="int8",
                                           key_quant="channel",
                                           key_group=8),
                     cache_lib.CachePolicy(kv_dtype="int4",
                                           key_quant="channel",
                                           key_group=8),
                     cache_lib.CachePolicy(kv_dtype="int2",
                                           key_quant="channel",
                                           key_group=8))
CASES = [(f"_{v}_{policy_name(p)}", v, p) for v in VARIANTS
         for p in POLICIES]
FAST = ("_gqa_float32", "_mla_float32")  # one KVCache, one LatentCache


def ragged_prompt(seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 256, (B, T)).astype(np.int32)
  mask = np.arange(T)[None] >= T - np.asarray(LENGTHS)[:, None]
  return tokens, mask.astype(np.int32)


def scattered(config, policy, seed=0):
  """A paged cache whose block tables map pages in a random order."""
  rng = np.random.default_rng(seed)
  table = rng.permutation(Z)[:B * M].reshape(B, M).astype(np.int32)
  paged = pg.init_paged(config, B, Z, Y, M, policy)
  return paged.replace(block_table=jnp.asarray(table))


def assert_pages_hold(paged, ref, config, policy):
  """The pages, read in block-table order, hold the contiguous cache."""
  S = ref.capacity
  view = pg.view(paged, S // Y)
  np.testing.assert_array_equal(view.positions, ref.positions)
  np.testing.assert_array_equal(view.length, ref.length)
  for name in paged.pool:
    assert_close(getattr(view, name).astype(jnp.float32),
                 getattr(ref, name).astype(jnp.float32), config,
                 cache=policy.kv_dtype, msg=name)


def cases(fast: bool):
  out = []
  for name, v, p in CASES:
    if (name in FAST) == fast:
      out.append((name, v, p))
  return out


class PagedEqualsContiguousTest(parameterized.TestCase):

  def check(self, variant, policy):
    config, params = tiny(variant), tiny_params(variant)
    tokens, mask = ragged_prompt()
    ref = kvjax.init_cache(config, B, M * Y, policy=policy)
    paged = scattered(config, policy)
    ref_logits, ref = kvjax.prefill(params, config, tokens, ref,
                                    attention_mask=mask)
    logits, paged = pg.prefill(params, config, tokens, paged,
                               attention_mask=mask)
    chex.assert_shape(logits, (B, config.vocab_size))
    chex.assert_tree_all_finite(logits)
    assert_close(logits, ref_logits, config, cache=policy.kv_dtype)
    token = jnp.argmax(ref_logits, axis=-1).astype(jnp.int32)
    for _ in range(3):
      ref_logits, ref = kvjax.decode_step(params, config, token, ref)
      logits, paged = pg.decode_step(params, config, token, paged)
      assert_close(logits, ref_logits, config, cache=policy.kv_dtype)
      np.testing.assert_array_equal(jnp.argmax(logits, -1),
                                    jnp.argmax(ref_logits, -1))
      token = jnp.argmax(ref_logits, axis=-1).astype(jnp.int32)
    chunk = np.random.default_rng(1).integers(0, 256, (B, 5)).astype(
        np.int32)
    ref_logits, ref = kvjax.extend(params, config, chunk, ref)
    logits, paged = pg.extend(params, config, chunk, paged)
    assert_close(logits, ref_logits, config, cache=policy.kv_dtype)
    np.testing.assert_array_equal(np.asarray(paged.length),
                                  np.asarray(LENGTHS) + 3 + 5)
    assert_pages_hold(paged, ref, config, policy)

  @parameterized.named_parameters(*cases(fast=True))
  def test_prefill_decode_extend(self, variant, policy):
    self.check(variant, policy)

  @parameterized.named_parameters(*cases(fast=False))
  @pytest.mark.slow
  def test_prefill_decode_extend_all(self, variant, policy):
    self.check(variant, policy)


class FromContiguousTest(parameterized.TestCase):

  @parameterized.named_parameters(
      *[c for c in CASES if c[0] in FAST + ("_gqa_int8_kivi",)])
  def test_the_view_is_the_contiguous_cache(self, variant, policy):
    config, params = tiny(variant), tiny_params(variant)
    tokens, mask = ragged_prompt()
    _, ref = kvjax.prefill(params, config, tokens,
                           kvjax.init_cache(config, B, M * Y, policy=policy),
                           attention_mask=mask)
    table = np.random.default_rng(0).permutation(B * M).reshape(B, M).astype(
        np.int32)
    paged = pg.from_contiguous(config, ref, table, Y)
    self.assertEqual((paged.num_pages, paged.page_size), (B * M, Y))
    np.testing.assert_array_equal(paged.block_table, table)
    np.testing.assert_array_equal(paged.errors, errors.zeros(B))
    assert_pages_hold(paged, ref, config, policy)
    for name, resid in paged.resid.items():
      np.testing.assert_array_equal(resid, getattr(ref, name), err_msg=name)


class DecodeLoopTest(parameterized.TestCase):

  def check_loop(self, variant, policy):
    # The loop reads and writes the pool in place (`PagedKV`): k steps of
    # rows that keep 4, 2 and 0 tokens equal the contiguous cache's steps.
    config, params = tiny(variant), tiny_params(variant)
    tokens, mask = ragged_prompt()
    _, paged = pg.prefill(params, config, tokens, scattered(config, policy),
                          attention_mask=mask)
    _, ref = kvjax.prefill(params, config, tokens,
                           kvjax.init_cache(config, B, M * Y, policy=policy),
                           attention_mask=mask)
    before = jax.tree_util.tree_map(np.asarray, pg.view(paged, M))
    resid_before = {k: np.asarray(r) for k, r in paged.resid.items()}
    steps, valid = 4, np.array([4, 2, 0], np.int32)
    first = jnp.asarray([3, 4, 5], jnp.int32)
    keys = np.zeros((B, steps) + jax.random.key_data(
        jax.random.key(0)).shape, np.uint32)
    plan = pg.loop_plan(params, config, policy, B, M, Y, steps)
    self.assertFalse(plan.blocked)
    toks, looped = pg.decode_loop(
        params, config, first, paged, np.asarray(paged.block_table), keys,
        np.zeros(B, np.int32), valid, pages=M, steps=steps,
        samplers=(GREEDY,), plan=plan)
    chex.assert_shape(toks, (B, steps))
    np.testing.assert_array_equal(looped.length,
                                  np.asarray(LENGTHS) + valid)
    self.assertEqual(int(np.max(looped.errors)), 0)
    token = first
    for i in range(steps):
      logits, ref = kvjax.decode_step(params, config, token, ref)
      token = jnp.argmax(logits, -1).astype(jnp.int32)
      for b in range(B):
        if i < valid[b]:
          self.assertEqual(int(toks[b, i]), int(token[b]), f"row {b} step {i}")
    got = pg.view(looped, M)
    for name in looped.pool:  # row 0 kept every step: its slots are ref's
      n = LENGTHS[0] + steps
      ax = dict(pg.PAGED_FIELDS[looped.kind])[name]
      sl = (slice(None), 0) + (slice(None),) * (ax - 2) + (slice(0, n),)
      assert_close(getattr(got, name)[sl].astype(jnp.float32),
                   getattr(ref, name)[sl].astype(jnp.float32), config,
                   cache=policy.kv_dtype, msg=name)
      # The idle row holds what it held (its scratch steps were dropped).
      np.testing.assert_array_equal(getattr(got, name)[:, 2],
                                    getattr(before, name)[:, 2], name)
    for name, r in looped.resid.items():
      np.testing.assert_array_equal(np.asarray(r)[:, 2],
                                    resid_before[name][:, 2], name)

  @parameterized.named_parameters(*cases(fast=True))
  def test_loop_equals_contiguous_steps(self, variant, policy):
    self.check_loop(variant, policy)

  @parameterized.named_parameters(*cases(fast=False))
  @pytest.mark.slow
  def test_loop_equals_contiguous_steps_all(self, variant, policy):
    self.check_loop(variant, policy)

  def test_loop_with_packed_params(self):
    # Packed params and 4 rows (where generate would block a contiguous
    # cache): the loop still reads the pages in place.
    config = tiny("gqa")
    params = kvjax.pack(tiny_params("gqa"), config)
    rows, pages, steps = 4, 64 // Y, 3
    plan = pg.loop_plan(params, config, cache_lib.CachePolicy(), rows,
                        pages, Y, steps)
    self.assertFalse(plan.blocked)
    prompt = np.random.default_rng(3).integers(0, 256, (rows, 9)).astype(
        np.int32)
    table = np.arange(rows * pages, dtype=np.int32).reshape(rows, pages)
    paged = pg.init_paged(config, rows, rows * pages, Y, pages).replace(
        block_table=jnp.asarray(table))
    logits, paged = pg.prefill(params, config, prompt, paged)
    one = jax.tree_util.tree_map(jnp.copy, paged)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    valid = np.array([3, 1, 0, 3], np.int32)
    keys = np.zeros((rows, steps) + jax.random.key_data(
        jax.random.key(0)).shape, np.uint32)
    toks, looped = pg.decode_loop(
        params, config, first, paged, table, keys,
        np.zeros(rows, np.int32), valid, pages=pages, steps=steps,
        samplers=(GREEDY,), plan=plan)
    np.testing.assert_array_equal(looped.length, 9 + valid)
    token = first
    for i in range(steps):
      logits, one = pg.decode_step(params, config, token, one)
      token = jnp.argmax(logits, -1).astype(jnp.int32)
      for b in range(rows):
        if i < valid[b]:
          self.assertEqual(int(toks[b, i]), int(token[b]))
    got, ref = pg.view(looped, pages), pg.view(one, pages)
    for b in range(rows):
      n = 9 + valid[b]
      assert_close(got.k[:, b, :, :n], ref.k[:, b, :, :n], config)


class CopyOnWriteTest(parameterized.TestCase):

  # int4 too: its pages hold packed codes and scales, copied alike.
  @parameterized.named_parameters(("float32", "float32"), ("int4", "int4"))
  def test_shared_page_is_read_and_the_copy_written(self, kv_dtype):
    config, params = tiny("gqa"), tiny_params("gqa")
    policy = kvjax.CachePolicy(kv_dtype=kv_dtype)
    prompt = np.random.default_rng(2).integers(0, 256, (1, 5)).astype(
        np.int32)
    tokens = np.repeat(prompt, B, axis=0)
    ref_logits, ref = kvjax.prefill(params, config, tokens,
                                    kvjax.init_cache(config, B, M * Y,
                                                     policy=policy))
    table = np.full((B, M), pg.NO_PAGE, np.int32)
    table[:, 0] = 7
    paged = pg.init_paged(config, B, Z, Y, M, policy)
    one = table[:1].copy()
    _, first = pg.prefill(params, config, prompt, pg.init_paged(
        config, 1, Z, Y, M, policy).replace(block_table=jnp.asarray(one)))
    # Every row maps page 7, which holds the prompt once.
    paged = paged.replace(pool=first.pool, block_table=jnp.asarray(table),
                          length=jnp.full((B,), 5, jnp.int32))
    before = jax.tree_util.tree_map(np.asarray, paged.pool)
    write = table.copy()
    write[:, 0] = [11, 12, 13]  # each row diverges inside page 7
    token = jnp.asarray([9, 10, 9], jnp.int32)
    logits, paged = pg.decode_step(params, config, token, paged,
                                   write_table=write)
    ref_step, _ = kvjax.decode_step(params, config, token, ref)
    assert_close(logits, ref_step, config)
    after = jax.tree_util.tree_map(np.asarray, paged.pool)
    for name in after:  # the shared page is untouched; the copies hold it
      np.testing.assert_array_equal(after[name][:, 7], before[name][:, 7])
      for page in (11, 12, 13):
        np.testing.assert_array_equal(after[name][:, page, :, :5],
                                      before[name][:, 7, :, :5])
    np.testing.assert_array_equal(paged.block_table[:, 0], [11, 12, 13])
    # Rows 0 and 2 fed the same token: equal copies; row 1 differs at 5.
    np.testing.assert_array_equal(after["k"][:, 11], after["k"][:, 13])
    self.assertFalse(np.array_equal(after["k"][:, 11, :, 5],
                                    after["k"][:, 12, :, 5]))


class LostWriteTest(parameterized.TestCase):

  def test_write_to_an_unmapped_page_is_recorded_under_jit(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    tokens, mask = ragged_prompt()
    _, paged = pg.prefill(params, config, tokens, scattered(
        config, cache_lib.CachePolicy()), attention_mask=mask)
    write = np.asarray(paged.block_table).copy()
    write[1, LENGTHS[1] // Y] = pg.NO_PAGE  # row 1's next slot: no page
    params = kvjax.packed.for_decode(params, config)
    logits, paged = pg._decode(  # pylint: disable=protected-access
        params, config, jnp.zeros((B,), jnp.int32), paged,
        jnp.asarray(write), M)
    np.testing.assert_array_equal(np.asarray(paged.errors) != 0,
                                  [False, True, False])
    self.assertEqual(int(paged.errors[1]) & errors.OVERFLOW,
                     errors.OVERFLOW)
    with self.assertRaisesRegex(ValueError, "overflow.*sequence 1"):
      errors.raise_if_set(paged, "decode")
    # As a contiguous overflow: the step poisons the row it lost a token of.
    np.testing.assert_array_equal(np.isfinite(np.asarray(logits)).all(-1),
                                  [True, False, True])


class BytesTest(parameterized.TestCase):

  @parameterized.named_parameters(*CASES)
  def test_page_is_bytes_per_token_times_page_size(self, variant, policy):
    config = tiny(variant)
    paged = pg.init_paged(config, 2, 6, Y, 4, policy)
    per_token = cache_lib.kv_bytes_per_token(
        config, policy.kv_dtype,
        key_group=policy.key_group if policy.channel_keys else 0)
    self.assertEqual(pg.page_bytes(paged), per_token * Y)
    got = pg.cache_bytes(paged)
    self.assertEqual(got["pool"], 6 * pg.page_bytes(paged))
    leaves = sum(x.nbytes for x in jax.tree_util.tree_leaves(paged))
    self.assertEqual(got["total"], leaves)
    if config.attention == "mla":
      chex.assert_shape(paged.pool["c_kv"], (
          config.num_layers, 6, Y,
          quant.packed_width(policy.kv_dtype, config.kv_lora_rank, "C")))
      self.assertNotIn("k", paged.pool)  # latent pages: no per-head K/V
    else:
      chex.assert_shape(paged.pool["k"], (
          config.num_layers, 6, config.num_kv_heads, Y,
          quant.packed_width(policy.kv_dtype, config.head_dim, "H")))

  def test_allocated_and_used_count_shared_pages_once(self):
    config = tiny("gqa")
    paged = pg.init_paged(config, 2, 6, Y, 4)
    table = np.array([[0, 1, -1, -1], [0, 2, 3, -1]], np.int32)
    paged = paged.replace(block_table=jnp.asarray(table),
                          length=jnp.asarray([12, 17], jnp.int32))
    per_page = pg.page_bytes(paged)
    got = pg.cache_bytes(paged)
    self.assertEqual(got["allocated"], 4 * per_page)  # pages 0, 1, 2, 3
    # page 0: 8 slots (shared, once), page 1: 4, page 2: 8, page 3: 1
    self.assertEqual(got["used"], per_page * (8 + 4 + 8 + 1) // Y)


class ViewBucketTest(parameterized.TestCase):

  def test_buckets_cover_and_are_few(self):
    for slots in range(1, 16 * 64 + 1, 7):
      A = pg.view_pages(slots, 16, 64)
      self.assertGreaterEqual(A * 16, slots)
      self.assertIn(A, pg.all_view_pages(16, 64))
    self.assertEqual(pg.all_view_pages(16, 64), (8, 16, 32, 64))
    self.assertEqual(pg.view_pages(1, 16, 5), 5)  # capped at M


class BadInputTest(parameterized.TestCase):

  def test_evicting_policy_raises(self):
    with self.assertRaisesRegex(ValueError, "eviction='none'"):
      pg.init_paged(tiny("gqa"), 2, 8, Y, 4,
                    cache_lib.CachePolicy(eviction="window"))

  def test_page_size_not_a_multiple_of_key_group_raises(self):
    policy = cache_lib.CachePolicy(kv_dtype="int8", key_quant="channel",
                                   key_group=8)
    with self.assertRaisesRegex(ValueError, "page_size=4.*key_group=8"):
      pg.init_paged(tiny("gqa"), 2, 8, 4, 4, policy)

  @parameterized.named_parameters(("_batch", "batch", 0),
                                  ("_num_pages", "num_pages", -1),
                                  ("_page_size", "page_size", 2.0),
                                  ("_max_pages", "max_pages", True))
  def test_bad_sizes_name_the_argument(self, name, value):
    args = dict(batch=2, num_pages=8, page_size=Y, max_pages=4)
    args[name] = value
    with self.assertRaisesRegex(ValueError, name):
      pg.init_paged(tiny("gqa"), **args)

  def test_unmapped_slot_raises_before_compute(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    paged = pg.init_paged(config, 1, 4, Y, 4)
    with self.assertRaisesRegex(ValueError, "block 0, which maps no page"):
      pg.prefill(params, config, np.zeros((1, 3), np.int32), paged)

  def test_two_rows_writing_one_page_raise(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    paged = pg.init_paged(config, 2, 4, Y, 4)
    paged = paged.replace(block_table=jnp.zeros((2, 4), jnp.int32))
    with self.assertRaisesRegex(ValueError, "both write page 0"):
      pg.prefill(params, config, np.zeros((2, 3), np.int32), paged)

  def test_past_the_block_table_raises(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    paged = pg.init_paged(config, 1, 4, Y, 1)
    paged = paged.replace(block_table=jnp.zeros((1, 1), jnp.int32),
                          length=jnp.asarray([Y], jnp.int32))
    with self.assertRaisesRegex(ValueError, "more than the 8 slots"):
      pg.decode_step(params, config, np.zeros((1,), np.int32), paged)

  def test_page_ids_outside_the_pool_raise(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    paged = pg.init_paged(config, 1, 4, Y, 2)
    paged = paged.replace(block_table=jnp.asarray([[4, -1]], jnp.int32))
    with self.assertRaisesRegex(ValueError, r"outside \[-1, 4\)"):
      pg.prefill(params, config, np.zeros((1, 3), np.int32), paged)

  def test_cache_for_another_config_raises(self):
    paged = pg.init_paged(tiny("mla"), 1, 4, Y, 2)
    with self.assertRaisesRegex(ValueError, "per-head page pool"):
      pg.prefill(tiny_params("gqa"), tiny("gqa"), np.zeros((1, 3),
                                                           np.int32), paged)


if __name__ == "__main__":
  absltest.main()
