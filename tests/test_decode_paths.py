"""Every decode path equals the no-cache forward.

One matrix over the axes a decode can vary: attention variant × eviction
policy × cache storage × decode cache layout × params layout. Each case
generates greedily, then runs the no-cache forward over the prompt and the
generated tokens under the mask the policy implies (causal; a sliding
window; sinks + window) and compares the logits each token was sampled
from, within the tolerance of the cache's storage dtype.

Scored policies run with room for every token (none is evicted: their
bookkeeping must change nothing); positional ones evict (the masks are
theirs). Cases are every valid combination's pairs (all-pairs covering:
each pair of axis values that can run together appears in some case),
named by their values; the fast tier keeps a covering of GQA and MLA.
"""

from __future__ import annotations

import functools
import itertools
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import cache as cache_lib
from kvjax import decode
from kvjax.tolerance import assert_close
import cases  # pylint: disable=g-bad-import-order
import references  # pylint: disable=g-bad-import-order
from tiny_models import tiny, tiny_params  # pylint: disable=g-bad-import-order

B, PROMPT, NEW = 2, 6, 12
WINDOW, SINKS = 8, 4  # positional policies evict: 18 tokens in 8 slots

VARIANTS = ("mha", "mqa", "gqa", "mla")
POLICIES = ("none", "window", "sinks", "h2o", "snapkv", "pyramid")
KV = ("float32", "bfloat16", "int8", "int8-kivi", "int4-kivi")
CACHE_LAYOUTS = ("stacked", "blocked", "layered", "native")
PARAMS = ("canonical", "packed")
AXES = dict(variant=VARIANTS, policy=POLICIES, kv=KV, layout=CACHE_LAYOUTS,
            params=PARAMS)


def valid(variant, policy, kv, layout, params) -> bool:
  """What the library runs (each refusal is tested where it is raised)."""
  if layout == "blocked" and not (
      variant != "mla" and policy == "none" and params == "packed" and
      kv in ("float32", "bfloat16")):
    return False  # decode.plan: GQA family, float, segments, per-layer
  if layout == "layered" and not (
      policy == "none" and params == "packed" and kv in ("float32",
                                                         "bfloat16", "int8")):
    return False  # decode.plan: per-token storage, segments, per-layer
  if layout == "native" and not (
      policy == "none" and params == "packed" and
      kv in ("float32", "bfloat16", "int8")):
    return False  # the kernel: per-token storage, segments, per-layer
  if kv.endswith("-kivi") and policy != "none":
    return False  # KIVI: eviction 'none' only
  if policy == "snapkv" and variant == "mla":
    return False  # MLA's latent is shared by its heads: no head scope
  return True


def covering(axes: dict, ok, start=()) -> list[dict]:
  """`start` and then a few more valid cases, together containing every
  pair of axis values that some valid case contains (greedy all-pairs,
  deterministic)."""
  keys = list(axes)
  every = [dict(zip(keys, vals)) for vals in itertools.product(*axes.values())
           if ok(*vals)]

  def pairs(c):
    return {((a, c[a]), (b, c[b])) for a, b in itertools.combinations(keys, 2)}

  todo = set().union(*map(pairs, every))
  chosen = list(start)
  for c in chosen:
    todo -= pairs(c)
  while todo:
    best = max(every, key=lambda c: len(pairs(c) & todo))
    chosen.append(best)
    todo -= pairs(best)
  return chosen


# The fast tier: a covering of GQA and MLA alone; the slow tier extends it
# to every variant. Both start from MLA's int8 latents in the integer
# attention (`kvjax.layered_latent`) and in the kernel
# (`kvjax.native_latent`), which a covering of pairs alone skips.
FAST_CASES = covering(dict(AXES, variant=cases.FAST_VARIANTS), valid,
                      start=[dict(variant="mla", policy="none", kv="int8",
                                  layout=layout, params="packed")
                             for layout in ("layered", "native")])
FAST = {cases.case_name(c) for c in FAST_CASES}
CASES = covering(AXES, valid, start=FAST_CASES)


def policy_of(policy: str, kv: str) -> cache_lib.CachePolicy:
  storage = dict(kv_dtype=kv.split("-")[0], key_quant="channel",
                 key_group=4) if kv.endswith("-kivi") else dict(kv_dtype=kv)
  by_name = dict(
      none=dict(), window=dict(eviction="window"),
      sinks=dict(eviction="sinks", num_sinks=SINKS),
      h2o=dict(eviction="h2o", recent=2),
      snapkv=dict(eviction="snapkv", recent=2),
      # beta 1: every layer's budget is the capacity (the per-layer scope's
      # bookkeeping without eviction).
      pyramid=dict(eviction="pyramid", recent=2,
                   options=(("beta", 1.0),)))[policy]
  return cache_lib.CachePolicy(**by_name, **storage)


def capacity_of(policy: str) -> int:
  if policy in ("window", "sinks"):
    return WINDOW
  # 'none': a capacity of 128 puts the attended prefix on the blocked
  # cache's 64-slot grid; scored policies: room for every token.
  return 128 if policy == "none" else 32


def mask_of(policy: str, n: int) -> np.ndarray:
  if policy == "window":
    return references.window_mask(n, WINDOW)
  if policy == "sinks":
    return references.sinks_mask(n, WINDOW, SINKS)
  return references.causal(n)[2]


@functools.lru_cache(maxsize=None)
def params_of(variant: str, layout: str):
  params = tiny_params(variant)
  return kvjax.pack(params, tiny(variant)) if layout == "packed" else params


class DecodePathTest(parameterized.TestCase):

  def test_the_covering_holds_every_valid_pair(self):
    keys = list(AXES)
    wanted = {p for vals in itertools.product(*AXES.values())
              if valid(*vals)
              for p in itertools.combinations(zip(keys, vals), 2)}
    got = {p for c in CASES
           for p in itertools.combinations(c.items(), 2)}
    self.assertEqual(wanted - got, set())
    self.assertTrue(all(valid(**c) for c in CASES))
    # Far fewer than the valid product (172 cases): each case compiles a
    # generate.
    n_valid = sum(1 for vals in itertools.product(*AXES.values())
                  if valid(*vals))
    self.assertLess(len(CASES), n_valid / 3)

  @cases.named(CASES, slow=lambda **c: cases.case_name(c) not in FAST)
  def test_generate_equals_the_masked_forward(self, variant, policy, kv,
                                              layout, params):
    config = tiny(variant)
    p = params_of(variant, params)
    prompt = jax.random.randint(jax.random.key(7), (B, PROMPT), 0,
                                config.vocab_size)
    plans = []
    real_plan = decode.plan

    def spy(*args, **kwargs):
      plans.append(real_plan(*args, **kwargs))
      return plans[-1]

    with mock.patch.object(decode, "plan", spy):
      ids, logits, cache = kvjax.generate(
          p, config, prompt, NEW, capacity=capacity_of(policy),
          policy=policy_of(policy, kv), return_logits=True,
          return_cache=True, decode_layout=layout)
    # The path under test is the one that ran.
    self.assertLen(plans, 1)
    self.assertEqual(plans[0].blocked, layout == "blocked")
    self.assertEqual(cache.capacity, capacity_of(policy))

    tokens = jnp.concatenate([prompt, ids], axis=1)[:, :-1]
    n = tokens.shape[1]
    ref = references.masked_forward(tiny_params(variant), config, tokens,
                                    mask_of(policy, n))
    assert_close(logits, ref[:, PROMPT - 1:], config,
                 cache=kv.split("-")[0])
    if policy in ("window", "sinks"):
      # The positional policies did evict: the unbounded forward differs.
      full = references.masked_forward(tiny_params(variant), config, tokens,
                                       references.causal(n)[2])
      self.assertGreater(float(jnp.abs(full - ref).max()), 1e-3)


if __name__ == "__main__":
  absltest.main()
