"""The continuous-batching engine serves each request as `generate` alone.

Invariants:
  * every request's tokens equal `kvjax.generate` on that request alone
    (greedy and sampled, stop tokens), whatever the arrival order and batch
    mix, with prefix sharing, and when the pool runs out (preemption by
    recomputation and by swapping to host memory);
  * nothing compiles after warm-up;
  * every request ends (finished by 'stop' or 'length'): none is dropped;
  * prefix sharing computes fewer prefill tokens and holds fewer pages; a
    prompt cached whole is copied on write; unused cached prefixes are
    evicted least recently used first, deeper blocks before their root;
  * static batching and contiguous max-length reservation serve the same
    tokens, the latter with a lower memory utilisation;
  * bad input raises ValueError before compute; errors recorded in the cache
    raise naming the request.
"""

import dataclasses
import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax import engine as E
from kvjax import prefix
from kvjax.sampling import GREEDY, Sampler

from tiny_models import tiny, tiny_params  # pylint: disable=g-bad-import-order

SAMPLED = Sampler(temperature=0.8, top_k=20)
# Y 4, M 16, Z 16: a pool of 64 slots for 3 rows, so traces preempt.
BASE = E.EngineSpec(rows=3, page_size=4, num_pages=16, capacity=64, chunk=8,
                    prefill_rows=2,
                    decode_steps=4, samplers=(GREEDY, SAMPLED),
                    min_view_slots=32)
SYSTEM = tuple(np.random.default_rng(7).integers(0, 256, 20).tolist())


def trace(seed=0, n=6, arrivals=None):
  """Requests with a shared 20-token system prompt (even ids), one sampled,
  one with a stop token that greedy decoding emits."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    user = rng.integers(0, 256, int(rng.integers(3, 12))).tolist()
    prompt = (SYSTEM if i % 2 == 0 else ()) + tuple(user)
    out.append(E.Request(
        id=f"r{i}", prompt=prompt, max_new_tokens=(8, 28)[i % 2],
        sampler=SAMPLED if i == 3 else GREEDY, seed=i,
        arrival=float(i // 2 if arrivals is None else arrivals[i])))
  return out


@functools.lru_cache(maxsize=None)
def reference(variant, request):
  return tuple(E.reference_tokens(tiny_params(variant), tiny(variant),
                                  request))


def with_stop(variant, request, at=2):
  """`request` with the token greedy decoding emits at step `at` as its
  stop token (so the stop really happens)."""
  plain = reference(variant, request)
  return dataclasses.replace(request, stop_tokens=(plain[at],))


@functools.lru_cache(maxsize=None)
def engine(variant="gqa", **changes):
  return E.Engine(tiny_params(variant), tiny(variant),
                  dataclasses.replace(BASE, **changes))


class EqualsGenerateTest(parameterized.TestCase):

  def serve(self, variant, requests, **changes):
    report = engine(variant, **changes).run(requests)
    self.assertEqual(set(report.results), {r.id for r in requests})
    for r in requests:
      got = report.results[r.id]
      self.assertEqual(tuple(got.tokens), reference(variant, r), r.id)
      want = "stop" if got.tokens[-1] in r.stop_tokens else "length"
      self.assertEqual(got.finish_reason, want)
    self.assertEqual(report.summary["compiles_after_warmup"], 0)
    return report

  def requests(self, variant):
    reqs = trace()
    reqs[1] = with_stop(variant, reqs[1])
    return reqs

  @parameterized.named_parameters(("_recompute", "recompute"),
                                  ("_swap", "swap"))
  def test_preempted_requests_lose_nothing(self, preemption):
    report = self.serve("gqa", self.requests("gqa"), preemption=preemption)
    s = report.summary
    self.assertGreater(s["preemptions"], 0)  # the pool did run out
    self.assertGreater(s["cached_tokens"], 0)  # and prefixes were shared
    if preemption == "swap":
      self.assertEqual(s["swap_outs"], s["swap_ins"])
      self.assertGreater(s["swap_outs"], 0)

  def test_arrival_order_and_batch_mix_do_not_matter(self):
    reqs = self.requests("gqa")
    for arrivals in ((5, 0, 0, 3, 1, 1), (0, 0, 0, 0, 0, 0)):
      self.serve("gqa", [dataclasses.replace(r, arrival=float(a))
                         for r, a in zip(reqs, arrivals)])

  @parameterized.named_parameters(("_mha", "mha"), ("_mqa", "mqa"),
                                  ("_mla", "mla"))
  @pytest.mark.slow
  def test_every_variant(self, variant):
    self.serve(variant, self.requests(variant))

  @pytest.mark.slow
  def test_kivi_cache_equals_generate_with_that_policy(self):
    # Prompts within one chunk: the chunk attends its own keys in float, as
    # generate's one-pass prefill does (later chunks would attend the
    # quantized earlier ones: test_chunked's int8 case).
    policy = cache_lib.CachePolicy(kv_dtype="int8", key_quant="channel",
                                   key_group=4)
    reqs = [dataclasses.replace(r, prompt=r.prompt[-BASE.chunk:])
            for r in self.requests("gqa")]
    report = engine("gqa", policy=policy, prefix_caching=False).run(reqs)
    for r in reqs:
      want = E.reference_tokens(tiny_params("gqa"), tiny("gqa"), r,
                                policy=policy)
      self.assertEqual(report.results[r.id].tokens, want, r.id)
    self.assertEqual(report.summary["compiles_after_warmup"], 0)


class CompileTest(parameterized.TestCase):

  def test_nothing_compiles_after_warmup(self):
    eng = engine("gqa", preemption="swap")
    eng.warmup()
    with E.compile_counter() as c:
      report = eng.run(trace(seed=3, n=5))
    self.assertEqual(c["compiles"], 0)
    self.assertEqual(report.summary["compiles_after_warmup"], 0)
    self.assertLen(report.results, 5)


class PrefixSharingTest(parameterized.TestCase):

  def test_sharing_saves_prefill_and_pages_and_changes_no_token(self):
    reqs = [E.Request(id=i, prompt=SYSTEM + (i + 1, i + 2), max_new_tokens=8,
                      arrival=float(0 if i == 0 else 3 + i))
            for i in range(3)]
    runs = {}
    for sharing in (True, False):
      eng = engine("gqa", prefix_caching=sharing)
      eng.reset_prefix_cache()
      runs[sharing] = eng.run(reqs)
      for r in reqs:
        self.assertEqual(tuple(runs[sharing].results[r.id].tokens),
                         reference("gqa", r))
    on, off = runs[True].summary, runs[False].summary
    # 20 system tokens = 5 pages of 4, shared by the 2nd and 3rd request.
    self.assertEqual(on["cached_tokens"], 2 * 20)
    self.assertEqual(off["cached_tokens"], 0)
    self.assertEqual(on["prefill_tokens"], off["prefill_tokens"] - 40)
    self.assertLess(on["peak_allocated_slots"], off["peak_allocated_slots"])

  def test_prompt_cached_whole_is_copied_on_write(self):
    prompt = SYSTEM[:16]  # 4 full pages
    reqs = [E.Request(id=i, prompt=prompt, max_new_tokens=5,
                      arrival=float(10 * i)) for i in range(2)]
    eng = engine("gqa")
    eng.reset_prefix_cache()
    report = eng.run(reqs)
    for r in reqs:
      self.assertEqual(tuple(report.results[r.id].tokens),
                       reference("gqa", r))
    # The second request reads 15 cached tokens and recomputes the 16th
    # into a private copy of the last page.
    self.assertEqual(report.results[1].cached_tokens, 15)
    self.assertEqual(report.results[1].prefill_tokens, 1)
    self.assertEqual(report.summary["cow_copies"], 1)


class AllocatorTest(parameterized.TestCase):

  def test_lru_evicts_unused_prefixes_deepest_first(self):
    a = prefix.PageAllocator(num_pages=4, page_size=2)
    toks = (1, 2, 3, 4, 5, 6)
    pages = a.allocate(3)
    a.offer(prefix.Chain(), toks, pages, 6)
    self.assertEqual(a.cached, 3)
    self.assertTrue(all(a.shared(p) for p in pages))
    a.release_all(pages)
    self.assertEqual(a.available, 4)
    other = a.allocate(2)  # 1 free page, then the deepest cached block
    self.assertEqual(other[1], pages[2])
    self.assertEqual(a.match(toks, 3), pages[:2])  # the root survives
    self.assertEqual(a.refs[pages[0]], 1)
    self.assertIsNone(a.allocate(2))  # 0 free, 0 evictable: nothing taken
    self.assertEqual(a.available, 0)

  def test_blocks_match_only_after_the_same_prefix(self):
    a = prefix.PageAllocator(num_pages=6, page_size=2)
    pages = a.allocate(2)
    a.offer(prefix.Chain(), (1, 2, 3, 4), pages, 4)
    self.assertEqual(a.match((9, 9, 3, 4), 2), [])  # same block, other root
    self.assertEqual(a.match((1, 2, 3, 5), 2), pages[:1])

  def test_release_more_than_held_raises(self):
    a = prefix.PageAllocator(num_pages=2, page_size=2)
    (page,) = a.allocate(1)
    a.release(page)
    with self.assertRaisesRegex(ValueError, "released more often"):
      a.release(page)


class SchedulingTest(parameterized.TestCase):

  def test_static_batching_and_max_reservation_serve_the_same_tokens(self):
    reqs = trace()
    reports = {}
    for name, changes in (("continuous", {}),
                          ("static", dict(scheduling="static")),
                          ("max", dict(reserve="max",
                                       prefix_caching=False))):
      eng = engine("gqa", **changes)
      eng.reset_prefix_cache()
      reports[name] = eng.run(reqs)
      for r in reqs:
        self.assertEqual(tuple(reports[name].results[r.id].tokens),
                         reference("gqa", r), (name, r.id))
    util = {k: v.summary["mean_utilisation"] for k, v in reports.items()}
    self.assertLess(util["max"], util["continuous"])
    # Static batching admits only into an empty batch; continuous batching
    # did admit into a running one.
    for name in ("static", "continuous"):
      late = [x for x in reports[name].timeline
              if x["admitted"] and x["active_before"]]
      self.assertEqual(bool(late), name == "continuous", name)


class BadInputTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("_page_size_not_dividing_capacity", dict(capacity=30), "divide"),
      ("_budget_below_one_page_per_row", dict(num_pages=2),
       "below one page per row"),
      ("_kivi_with_prefix_caching",
       dict(policy=cache_lib.CachePolicy(kv_dtype="int8",
                                         key_quant="channel", key_group=4)),
       "key_quant='token'"),
      ("_max_reservation_with_prefix_caching", dict(reserve="max"),
       "prefix_caching=False"),
      ("_max_reservation_beyond_the_pool",
       dict(reserve="max", prefix_caching=False, num_pages=8),
       "max_pages=16 .* num_pages=8"),
      ("_unknown_preemption", dict(preemption="drop"), "preemption"),
      ("_evicting_policy", dict(policy=cache_lib.CachePolicy(
          eviction="window")), "eviction='none'"))
  def test_bad_spec(self, changes, message):
    with self.assertRaisesRegex(ValueError, message):
      dataclasses.replace(BASE, **changes)

  @parameterized.named_parameters(
      ("_duplicate_ids", [dict(id="a"), dict(id="a")], "duplicate"),
      ("_longer_than_capacity", [dict(max_new_tokens=63)], "capacity=64"),
      ("_longer_than_the_pool", [dict(prompt=tuple(range(50)),
                                      max_new_tokens=10)], None),
      ("_unknown_sampler", [dict(sampler=Sampler(temperature=0.5))],
       "sampler menu"),
      ("_token_out_of_range", [dict(prompt=(1, 256))], r"\[0, 256\)"),
      ("_empty_prompt", [dict(prompt=())], "non-empty"),
      ("_bad_stop_token", [dict(stop_tokens=(-1,))], "stop_tokens"))
  def test_bad_requests_raise_before_compute(self, fields, message):
    eng = engine("gqa", num_pages=12, capacity=64)
    reqs = [E.Request(**dict(dict(id=i, prompt=(1, 2, 3), max_new_tokens=4),
                             **f)) for i, f in enumerate(fields)]
    with self.assertRaisesRegex(ValueError, message or "pages of 4 slots"):
      eng.run(reqs)
    self.assertFalse(eng._warm)  # pylint: disable=protected-access

  def test_nan_weights_raise_naming_the_request(self):
    params = jax.tree_util.tree_map(lambda x: x * np.nan,
                                    tiny_params("gqa"))
    eng = E.Engine(params, tiny("gqa"), BASE)
    with self.assertRaisesRegex(ValueError, "request 'x'.*non-finite"):
      eng.run([E.Request(id="x", prompt=(1, 2, 3), max_new_tokens=3)])


if __name__ == "__main__":
  absltest.main()
