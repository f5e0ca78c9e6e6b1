"""Eviction policies as a protocol (`kvjax.policies`).

Invariants:
  * a policy whose budget holds every token changes nothing: same tokens
    and logits as eviction 'none' (scored policies at every scope);
  * a compressed prefill stores exactly the keys and values of the tokens
    it keeps: its next decode step equals a step over the full prompt's
    cache masked, per layer and head, to the kept tokens;
  * what a prefill keeps is the policy's selection rule applied to its own
    scores (an independent numpy reimplementation of the rule, scores
    taken from an uncompressed run);
  * the decode victim is the lowest-scoring unprotected slot within the
    scope's budget (numpy reference);
  * policies that need attention probabilities are refused with fused
    attention before compute; key-only policies run there;
  * byte accounting counts the slots a scoped policy fills.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import kvjax
from configs import model as model_presets
from kvjax import cache as cache_lib
from kvjax import configs as configs_lib
from kvjax import policies
from kvjax.tolerance import assert_close
from tests import cases as cases_lib
from tests.tiny_models import tiny, tiny_params

T, STEPS, CAPACITY, RECENT = 12, 4, 8, 2


def _cases():
  """(name, variant, policy object) for every scored policy and scope."""
  out = []
  for variant in ("gqa", "mla"):
    head = "head" if variant == "gqa" else "layer"
    pols = [
        policies.H2O(recent=RECENT),
        policies.H2O(recent=RECENT, scope=head),
        policies.TOVA(recent=RECENT),
        policies.Knorm(recent=RECENT, scope=head),
        policies.SnapKV(recent=RECENT, window=4, scope=head),
        policies.Pyramid(inner=policies.H2O(), recent=RECENT, beta=4.0),
        policies.KeyDiff(recent=RECENT, scope=head),

    ]
    if variant == "gqa":
      pols.append(policies.AdaKV(inner=policies.SnapKV(window=4),
                                 recent=RECENT, fraction=0.75))
    for p in pols:
      out.append((f"{variant}-{p.name}-{p.scope}", variant, p))
  return out


CASES = _cases()
SCOPED = [c for c in CASES if c[2].scoped]


def _cases_fast_in(fast_variant, cases=CASES):
  """The cases as `cases.named` ones, those of the other variant in the slow
  tier: each matrix's fast cases are one variant's, and the four matrices
  alternate the variant, so the fast tier runs every policy and scope on
  GQA and on MLA while the full suite runs every pair in every matrix."""
  return cases_lib.named(
      [dict(testcase_name=name, variant=v, policy=p) for name, v, p in cases],
      slow=lambda variant, policy: variant != fast_variant)


def _tokens(config, shape, seed=1):
  return jax.random.randint(jax.random.key(seed), shape, 0,
                            config.vocab_size)


def _roomy(p: policies.Scored) -> policies.Scored:
  """The same policy with a budget that holds every token."""
  if isinstance(p, policies.Pyramid):
    return dataclasses.replace(p, beta=1.0)
  if isinstance(p, policies.AdaKV):
    return dataclasses.replace(p, fraction=1.0)
  return p


class RegistryTest(parameterized.TestCase):

  def test_every_registered_policy_builds_and_is_static(self):
    for name, cls in policies.REGISTRY.items():
      p = policies.make(name)
      self.assertIsInstance(p, cls)
      self.assertEqual(p.name, name)
      self.assertEqual(hash(p), hash(policies.make(name)))
      self.assertIn(p.needs, policies.NEEDS)
      self.assertIn(p.scope, policies.SCOPES)

  def test_unknown_name_and_option_are_named(self):
    with self.assertRaisesRegex(ValueError, "'lru' is not one of .*h2o"):
      policies.make("lru")
    with self.assertRaisesRegex(ValueError, "no option \\['windo'\\].*"
                                "window"):
      policies.make("snapkv", windo=8)
    with self.assertRaisesRegex(ValueError, "scope='row' is not one of"):
      policies.make("h2o", scope="row")
    with self.assertRaisesRegex(ValueError, "recent must be an int >= 1"):
      policies.make("tova", recent=0)

  def test_cache_policy_keeps_policy_options(self):
    p = cache_lib.CachePolicy(policies.SnapKV(window=8, recent=8))
    self.assertEqual(p.eviction, "snapkv")
    q = dataclasses.replace(p, kv_dtype="int8")
    self.assertEqual(q.evictor, p.evictor)
    self.assertEqual(q.kv_dtype, "int8")
    by_name = cache_lib.CachePolicy("snapkv", recent=8,
                                    options=(("window", 8),))
    self.assertEqual(by_name.evictor, p.evictor)
    self.assertEqual(by_name, p)

  def test_config_dict_options(self):
    cfg = model_presets.get_config("gqa-tiny").cache
    cfg.update(dict(eviction="tova", recent=3, options="scope=head"))
    cfg.positions = "original"
    pol = configs_lib.cache_policy(cfg)
    self.assertEqual(pol.evictor, policies.TOVA(recent=3, scope="head"))
    cfg.options = "scope"
    with self.assertRaisesRegex(ValueError, "'scope' is not key=value"):
      configs_lib.cache_policy(cfg)

  def test_invalid_combinations_refused(self):
    with self.assertRaisesRegex(ValueError, "needs positions='original'"):
      cache_lib.CachePolicy(policies.H2O(scope="head"), positions="cache")
    with self.assertRaisesRegex(ValueError, "MLA's latent cache is shared"):
      kvjax.init_cache(tiny("mla"), 1, 8,
                       policy=cache_lib.CachePolicy(
                           policies.Knorm(scope="head")))
    with self.assertRaisesRegex(ValueError, "per-layer budgets need scope"):
      policies.Pyramid(scope="global")


class VictimTest(parameterized.TestCase):
  """`Scored.victims` against a numpy loop on random states."""

  def test_victims_match_numpy(self):
    rng = np.random.default_rng(0)
    pol = policies.H2O(recent=3)
    for _ in range(200):
      S = int(rng.integers(4, 10))
      n = int(rng.integers(0, 2 * S))
      budget = int(rng.integers(pol.recent + 1, S + 1))
      # A plausible cache: `min(n, budget)` distinct positions < n in random
      # slots below the budget, always including the newest ones.
      held = min(n, budget)
      keep = np.sort(rng.choice(n, held, replace=False)) if n else []
      if n:
        keep = np.unique(np.concatenate(
            [keep[:max(held - pol.recent + 1, 0)],
             np.arange(max(n - pol.recent + 1, 0), n)]))[-held:]
      pos = np.full(S, -1)
      slots = rng.permutation(budget)[:len(keep)]
      pos[slots] = keep
      scores = rng.random(S).astype(np.float32)
      got = int(pol.victims(jnp.asarray(scores), jnp.asarray(pos),
                            jnp.asarray(n), jnp.asarray(budget)))
      filled = (pos[:budget] >= 0).sum()
      if filled < budget:
        want = int(np.flatnonzero(pos[:budget] < 0)[0])
      else:
        # The incoming token is position n: protect n - recent + 1 .. n - 1.
        cand = [s for s in range(budget) if pos[s] <= n - pol.recent]
        want = min(cand, key=lambda s: (scores[s], s))
      self.assertEqual(got, want, (pos, scores, n, budget))


def _generate(variant, policy, capacity, prompt, steps=STEPS):
  config = tiny(variant)
  return kvjax.generate(tiny_params(variant), config, prompt,
                        max_new_tokens=steps, capacity=capacity,
                        policy=cache_lib.CachePolicy(policy))


class RoomyTest(parameterized.TestCase):
  """A budget that holds every token changes nothing."""

  @_cases_fast_in("gqa")
  def test_equals_no_eviction(self, variant, policy):
    config, params = tiny(variant), tiny_params(variant)
    prompt = _tokens(config, (2, 6))
    S = 6 + STEPS
    got = _generate(variant, _roomy(policy), S, prompt)
    want = _generate(variant, policies.NoEviction(), S, prompt)
    np.testing.assert_array_equal(got, want)
    # And the logits of a decode step, through prefill + decode_step.
    cache = kvjax.init_cache(config, 2, S, policy=cache_lib.CachePolicy(
        _roomy(policy)))
    ref = kvjax.init_cache(config, 2, S)
    _, cache = kvjax.prefill(params, config, prompt, cache)
    _, ref = kvjax.prefill(params, config, prompt, ref)
    self.assertEqual(want.shape, (2, STEPS))
    for tok in np.asarray(want).T:
      lg, cache = kvjax.decode_step(params, config, tok, cache)
      lr, ref = kvjax.decode_step(params, config, tok, ref)
      assert_close(lg, lr, config)


def _kept(positions_LBKS, exclude: int | None = None):
  """{(l, b, k): sorted kept positions}."""
  pos = np.asarray(positions_LBKS)
  out = {}
  for idx in np.ndindex(pos.shape[:3]):
    p = pos[idx]
    p = p[(p >= 0) & (p != (-2 if exclude is None else exclude))]
    out[idx] = sorted(p.tolist())
  return out


class CompressedPrefillTest(parameterized.TestCase):

  @_cases_fast_in("mla", SCOPED)
  def test_decode_equals_masked_full_prompt(self, variant, policy):
    """Compressed storage holds the kept tokens' exact K/V: the next step
    equals a step over the whole prompt masked to the kept tokens."""
    config, params = tiny(variant), tiny_params(variant)
    prompt = _tokens(config, (2, T), seed=3)
    x = _tokens(config, (2,), seed=4)
    pol = cache_lib.CachePolicy(policy)
    cache = kvjax.init_cache(config, 2, CAPACITY, policy=pol)
    _, cache = kvjax.prefill(params, config, prompt, cache)
    self.assertEqual(cache.positions.shape[-1], CAPACITY)
    got, cache = kvjax.decode_step(params, config, x, cache)
    kept = _kept(cache.positions, exclude=T)
    self.assertTrue(any(len(v) < T for v in kept.values()),
                    "the prompt was not compressed")

    full = kvjax.init_cache(config, 2, T + 1)
    _, full = kvjax.prefill(params, config, prompt, full)
    ref_pol = cache_lib.CachePolicy(policies.H2O(recent=1,
                                                 scope=policy.scope))
    ref = kvjax.init_cache(config, 2, T + 1, policy=ref_pol)
    pos = np.full(ref.positions.shape, -1, np.int32)
    for (l, b, k), ps in kept.items():
      pos[l, b, k, ps] = ps
    payload = {f: getattr(full, f) for f in ("k", "v", "c_kv", "k_rope")
               if hasattr(full, f)}
    ref = ref.replace(positions=jnp.asarray(pos), length=full.length,
                      **payload)
    want, _ = kvjax.decode_step(params, config, x, ref)
    assert_close(got, want, config)

  @_cases_fast_in("gqa", SCOPED)
  def test_kept_tokens_follow_the_rule(self, variant, policy):
    """Kept set = the policy's rule (numpy) on its uncompressed scores."""
    config, params = tiny(variant), tiny_params(variant)
    prompt = _tokens(config, (2, T), seed=5)
    roomy = kvjax.init_cache(config, 2, T, policy=cache_lib.CachePolicy(
        _roomy(policy)))
    _, roomy = kvjax.prefill(params, config, prompt, roomy)
    scores = np.asarray(roomy.scores)  # [L, B, K', T]: slot = position
    np.testing.assert_array_equal(np.asarray(roomy.positions)[..., :T],
                                  np.broadcast_to(np.arange(T),
                                                  scores.shape))
    cache = kvjax.init_cache(config, 2, CAPACITY,
                             policy=cache_lib.CachePolicy(policy))
    _, cache = kvjax.prefill(params, config, prompt, cache)
    got = _kept(cache.positions)
    L, B, Kp, _ = scores.shape
    budgets = policy.budgets(L, Kp, CAPACITY)
    protected = np.arange(T) >= T - policy.recent
    for l in range(L):
      for b in range(B):
        key = np.where(protected, np.inf, scores[l, b])  # [K', T]
        if isinstance(policy, policies.AdaKV):
          want = _adakv_numpy(key, policy, CAPACITY)
        else:
          want = [np.sort(np.argsort(-key[k], kind="stable")[:budgets[l, k]])
                  for k in range(Kp)]
        for k in range(Kp):
          self.assertEqual(got[l, b, k], want[k].tolist(),
                           f"layer {l} row {b} head {k}")


def _adakv_numpy(key_KT, policy, capacity):
  K, T = key_KT.shape
  b = policy.average_budget(capacity)
  floor = int(policy.floor * b)
  rank = np.argsort(np.argsort(-key_KT, axis=1, kind="stable"), axis=1,
                    kind="stable")
  guaranteed = rank < floor
  cand = ~guaranteed & (rank < capacity)
  pool = np.where(cand, key_KT, -np.inf).reshape(-1)
  order = np.argsort(-pool, kind="stable")[:K * (b - floor)]
  shared = np.zeros(K * T, bool)
  shared[order] = True
  keep = guaranteed | (shared.reshape(K, T) & cand)
  return [np.flatnonzero(keep[k]) for k in range(K)]


class DecodeEvictionTest(parameterized.TestCase):

  @_cases_fast_in("mla")
  def test_generate_streams_past_capacity(self, variant, policy):
    """generate (jit, lax.scan) runs every policy past its capacity with no
    error, the decode victims obey the rule, and kept counts stay within
    the budgets."""
    config, params = tiny(variant), tiny_params(variant)
    prompt_len = CAPACITY if not policy.scoped else T
    prompt = _tokens(config, (2, prompt_len), seed=6)
    out = _generate(variant, policy, CAPACITY, prompt, steps=6)
    self.assertEqual(out.shape, (2, 6))
    pol = cache_lib.CachePolicy(policy)
    cache = kvjax.init_cache(config, 2, CAPACITY, policy=pol)
    _, cache = kvjax.prefill(params, config, prompt, cache)
    for tok in np.asarray(out).T:
      before = jax.tree_util.tree_map(np.array, cache)  # decode donates
      _, cache = kvjax.decode_step(params, config, tok, cache)
      self._check_victims(before, cache)

  def _check_victims(self, before, after):
    ev = before.policy.evictor
    pos0, pos1 = np.asarray(before.positions), np.asarray(after.positions)
    n = int(np.asarray(before.length)[0])
    if pos0.ndim == 2:
      pos0, pos1 = pos0[None, :, None], pos1[None, :, None]
      scores = np.asarray(before.scores)[None, :, None]
      budget = np.full(pos0.shape[:3], pos0.shape[-1])
    else:
      scores = np.asarray(before.scores)
      budget = np.asarray(before.budget)
    for idx in np.ndindex(pos0.shape[:3]):
      changed = np.flatnonzero(pos0[idx] != pos1[idx])
      self.assertEqual(len(changed), 1, idx)
      slot = changed[0]
      self.assertEqual(pos1[idx][slot], n)
      self.assertLess(slot, budget[idx])
      usable = np.arange(pos0.shape[-1]) < budget[idx]
      if ((pos0[idx] >= 0) & usable).sum() < budget[idx]:
        self.assertLess(pos0[idx][slot], 0)
        continue
      cand = usable & (pos0[idx] >= 0) & (pos0[idx] <= n - ev.recent)
      self.assertTrue(cand[slot], idx)
      self.assertEqual(scores[idx][slot], scores[idx][cand].min(), idx)


class FusedAttentionTest(parameterized.TestCase):

  def test_attention_scores_refused_with_fused_attention(self):
    config = dataclasses.replace(tiny("gqa"), attention_impl="jax_nn")
    params = tiny_params("gqa")
    prompt = _tokens(config, (1, 6))
    for p in (policies.H2O(recent=2), policies.TOVA(recent=2),
              policies.SnapKV(recent=2, window=2)):
      with self.assertRaisesRegex(ValueError, "attention_impl='jax_nn'"):
        kvjax.generate(params, config, prompt, max_new_tokens=2,
                       capacity=8, policy=cache_lib.CachePolicy(p))

  def test_key_policies_run_with_fused_attention(self):
    config = tiny("gqa")
    fused = dataclasses.replace(config, attention_impl="jax_nn")
    params = tiny_params("gqa")
    prompt = _tokens(config, (2, T), seed=7)
    for p in (policies.Knorm(recent=RECENT), policies.KeyDiff(recent=RECENT)):
      pol = cache_lib.CachePolicy(p)
      a = kvjax.generate(params, config, prompt, max_new_tokens=4,
                         capacity=CAPACITY, policy=pol)
      b = kvjax.generate(params, fused, prompt, max_new_tokens=4,
                         capacity=CAPACITY, policy=pol)
      np.testing.assert_array_equal(a, b, err_msg=p.name)


class KeyDiffTest(parameterized.TestCase):

  def test_scores_are_minus_cosine_to_the_mean_key(self):
    rng = np.random.default_rng(0)
    k = rng.normal(size=(2, 3, 5, 4)).astype(np.float32)
    valid = rng.random((2, 3, 5)) < 0.7
    valid[..., 0] = True
    got = np.asarray(policies.KeyDiff().observe(None, jnp.asarray(k),
                                                jnp.asarray(valid), "decode"))
    unit = k / np.linalg.norm(k, axis=-1, keepdims=True)
    for b, h in np.ndindex(2, 3):
      anchor = unit[b, h][valid[b, h]].mean(axis=0)
      anchor /= np.linalg.norm(anchor)
      want = -unit[b, h] @ anchor
      np.testing.assert_allclose(got[b, h][valid[b, h]],
                                 want[valid[b, h]], rtol=1e-5, atol=1e-6)


class BytesTest(parameterized.TestCase):

  def test_pyramid_used_bytes_follow_the_budgets(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    pol = policies.Pyramid(inner=policies.H2O(), recent=RECENT, beta=4.0)
    cache = kvjax.init_cache(config, 2, CAPACITY,
                             policy=cache_lib.CachePolicy(pol))
    _, cache = kvjax.prefill(params, config, _tokens(config, (2, T)), cache)
    L = config.num_layers
    budgets = pol.budgets(L, 1, CAPACITY)[:, 0]
    self.assertLess(budgets.sum(), L * CAPACITY)
    b = kvjax.cache_bytes(cache)
    self.assertEqual(b["used"], b["kv"] * int(budgets.sum()) //
                     (L * CAPACITY))


if __name__ == "__main__":
  absltest.main()
