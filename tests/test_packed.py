"""Packed decode params (`kvjax.params.pack`, applied by
`kvjax.projections`): fused, [out, in] weights.

Invariants: packing changes the layout, never the function. For every
variant (and tied heads, q/k/v/o biases, MoE stacks, quantized caches) the
packed params give the canonical logits for forward, prefill and each decode
step, and the same greedy tokens. The packed weights are the canonical ones
transposed and concatenated (checked value by value); a packed decode step
runs 4 weight products per dense layer instead of 7; bad params raise naming
the problem.
"""

import dataclasses
import functools
import gc

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.lab import benchmarking as bm
from kvjax import layers
from kvjax import model
from kvjax import norm_matvec
from kvjax import packed
from kvjax import params as params_lib
from kvjax import projections
from kvjax import sharding
from kvjax.tolerance import assert_close
import cases
from tiny_models import VARIANTS, tiny, tiny_params

S = 24


def _tokens(config, shape, seed=1):
  return jax.random.randint(jax.random.key(seed), shape, 0, config.vocab_size)


def _config_and_params(variant, **overrides):
  if not overrides:
    return tiny(variant), tiny_params(variant)
  config = tiny(variant).replace(**overrides)
  return config, kvjax.init_params(config, jax.random.key(0))


def _dots(fn, *args):
  """Number of dot_general equations in fn's jaxpr, nested ones included."""
  return str(jax.make_jaxpr(fn)(*args)).count("dot_general[")


class LinearTTest(parameterized.TestCase):

  # Fast tier: one row (the plain matrix-vector form when norm-fed) and the
  # first row count past the skinny products.
  @cases.product(rows=(1, 3, 8, layers.SKINNY_ROWS, layers.SKINNY_ROWS + 1,
                       200),
                 norm_input=(False, True),
                 slow=lambda rows, norm_input: rows not in (
                     1, layers.SKINNY_ROWS + 1))
  def test_equals_matmul_with_transposed_weight(self, rows, norm_input):
    x = jax.random.normal(jax.random.key(0), (rows, 1, 24))
    w_OI = jax.random.normal(jax.random.key(1), (40, 24))
    y = jax.jit(functools.partial(layers.linear_t,
                                  norm_input=norm_input))(x, w_OI)
    chex.assert_shape(y, (rows, 1, 40))
    assert_close(y, x @ w_OI.T, depth=1)

  def test_preferred_element_type(self):
    x = jax.random.normal(jax.random.key(0), (2, 16)).astype(jnp.bfloat16)
    w_OI = jax.random.normal(jax.random.key(1), (8, 16)).astype(jnp.bfloat16)
    y = layers.linear_t(x, w_OI, preferred_element_type=jnp.float32)
    self.assertEqual(y.dtype, jnp.float32)
    ref = jnp.matmul(x, w_OI.T, preferred_element_type=jnp.float32)
    # bf16 inputs multiply exactly in float32: only the float32 sum's
    # order differs.
    assert_close(y, ref, depth=1)

  @cases.product(rows=(1, 8))
  def test_skinny_products_keep_the_weight_on_the_left(self, rows):
    # The reason for linear_t (layers.py): the weight is the dot's first
    # operand, fenced by an optimization barrier so XLA keeps it there.
    jaxpr = jax.make_jaxpr(layers.linear_t)(jnp.ones((rows, 24)),
                                            jnp.ones((40, 24))).jaxpr
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    self.assertLen(dots, 1)
    self.assertEqual(dots[0].invars[0].aval.shape, (40, 24))
    self.assertIn("optimization_barrier",
                  [e.primitive.name for e in jaxpr.eqns])

  @cases.product(rows=(1, 8), form=norm_matvec.FORMS)
  def test_norm_input_is_plain_for_one_fused_row_only(self, rows, form):
    # One norm-fed row in the fused form: the plain x @ W.T (no barrier),
    # which XLA's CPU backend runs as a loop split across the cores; the
    # separate form and more rows keep the weight-on-the-left form.
    with norm_matvec.forced(form):
      jaxpr = jax.make_jaxpr(functools.partial(layers.linear_t,
                                               norm_input=True))(
                                                   jnp.ones((rows, 24)),
                                                   jnp.ones((40, 24))).jaxpr
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    self.assertLen(dots, 1)
    plain = rows == 1 and form == "fused"
    barrier = "optimization_barrier" in [e.primitive.name
                                         for e in jaxpr.eqns]
    self.assertEqual(barrier, not plain)
    self.assertEqual(dots[0].invars[0].aval.shape,
                     (1, 24) if plain else (40, 24))


class PackedTest(parameterized.TestCase):

  # q/k/v/o biases exist for the GQA family only (MLA's config rejects them).
  @cases.named(
      [dict(variant=v, extra=e) for v in VARIANTS for e in ("plain", "tied")]
      + [dict(variant=v, extra="biases") for v in VARIANTS if v != "mla"],
      slow=lambda variant, extra: (variant, extra) not in (
          ("gqa", "plain"), ("mla", "plain")))
  def test_same_logits_and_tokens(self, variant, extra):
    overrides = dict(plain={}, tied=dict(tie_embeddings=True),
                     biases=dict(qkv_bias=True, o_bias=True))[extra]
    config, params = _config_and_params(variant, **overrides)
    pk = params_lib.pack(params, config)
    self.assertTrue(projections.is_packed(pk))
    tokens = _tokens(config, (2, 10))
    full = kvjax.forward(params, config, tokens)
    assert_close(kvjax.forward(pk, config, tokens), full, config)
    cache = kvjax.init_cache(config, 2, S)
    logits, cache = kvjax.prefill(pk, config, tokens[:, :6], cache,
                                  all_logits=True)
    assert_close(logits, full[:, :6], config)
    for t in range(6, 10):
      step, cache = kvjax.decode_step(pk, config, tokens[:, t], cache)
      assert_close(step, full[:, t], config)
    if extra == "plain":
      # generate runs the prefill and decode step checked above; tied
      # heads and biases change only the weights those steps read.
      np.testing.assert_array_equal(
          kvjax.generate(pk, config, tokens[:, :5], 8),
          kvjax.generate(params, config, tokens[:, :5], 8))

  @cases.product(variant=VARIANTS, form=norm_matvec.FORMS,
                 slow=lambda variant, form: variant != "gqa")
  def test_batch_one_decode(self, variant, form):
    # One sequence: each decode step is a single row, so the norm-fed
    # products take the form kvjax.norm_matvec gives them; both forms
    # compute the canonical logits. Programs keep the form they were traced
    # with, so the caches are cleared to trace this one.
    config, params = _config_and_params(variant)
    pk = params_lib.pack(params, config)
    tokens = _tokens(config, (1, 9))
    full = kvjax.forward(params, config, tokens)
    jax.clear_caches()
    with norm_matvec.forced(form):
      _, cache = kvjax.prefill(pk, config, tokens[:, :5],
                               kvjax.init_cache(config, 1, S))
      for t in range(5, 9):
        step, cache = kvjax.decode_step(pk, config, tokens[:, t], cache)
        assert_close(step, full[:, t], config)
    jax.clear_caches()

  @pytest.mark.slow  # an MoE model's compile; test_moe checks its decode
  def test_moe_stacks(self):
    config = tiny("gqa").replace(moe=kvjax.MoEConfig(
        num_experts=4, experts_per_token=2, expert_dim=32,
        first_dense_layers=1))
    params = kvjax.init_params(config, jax.random.key(0))
    pk = params_lib.pack(params, config)
    self.assertIn("gate_up_t", pk["layers"][0]["mlp"])
    self.assertIn("router", pk["moe_layers"][0]["mlp"])  # experts kept
    self.assertIn("qkv_t", pk["moe_layers"][0]["attn"])
    tokens = _tokens(config, (2, 9))
    assert_close(kvjax.forward(pk, config, tokens),
                 kvjax.forward(params, config, tokens), config)

  @cases.variants()
  def test_packed_weights_are_the_canonical_ones(self, variant):
    config, params = tiny(variant), tiny_params(variant)
    pk = params_lib.pack(params, config)
    D, F, L = config.embed_dim, config.mlp_dim, config.num_layers
    self.assertLen(pk["layers"], L)
    for i, p in enumerate(pk["layers"]):
      mlp = params["layers"]["mlp"]
      np.testing.assert_array_equal(
          p["mlp"]["gate_up_t"],
          np.concatenate([mlp["gate"][i], mlp["up"][i]], 1).T)
      np.testing.assert_array_equal(p["mlp"]["down_t"], mlp["down"][i].T)
      attn = params["layers"]["attn"]
      if variant == "mla":
        self._check_mla(config, p["attn"],
                        jax.tree_util.tree_map(lambda w, i=i: w[i], attn))
        continue
      N, K, H = config.num_heads, config.num_kv_heads, config.head_dim
      chex.assert_shape(p["attn"]["qkv_t"], ((N + 2 * K) * H, D))
      np.testing.assert_array_equal(
          p["attn"]["qkv_t"],
          np.concatenate([attn[n][i].reshape(D, -1) for n in "qkv"], 1).T)
      np.testing.assert_array_equal(p["attn"]["o_t"],
                                    attn["o"][i].reshape(N * H, D).T)
    chex.assert_shape(pk["layers"][0]["mlp"]["down_t"], (D, F))
    np.testing.assert_array_equal(pk["lm_head_t"], params["lm_head"].T)
    np.testing.assert_array_equal(pk["embed"], params["embed"])
    self.assertEqual(bm.param_bytes(pk), bm.param_bytes(params))

  def _check_mla(self, config, p, c):
    """Packed MLA weights `p` are the canonical `c` reordered: dense ones
    [out, in], W_UK and W_UV per head [out, in]."""
    N, C, P, V = (config.num_heads, config.kv_lora_rank,
                  config.qk_nope_head_dim, config.v_head_dim)
    self.assertNotIn("qkv_t", p)
    expect = dict(kv_a_t=c["kv_a"].T, kv_a_norm=c["kv_a_norm"],
                  w_uk_t=np.transpose(c["w_uk"], (1, 0, 2)),
                  w_uv_t=np.transpose(c["w_uv"], (1, 2, 0)),
                  o_t=c["o"].reshape(N * V, -1).T)
    if "q_a" in c:
      expect.update(q_a_t=c["q_a"].T, q_a_norm=c["q_a_norm"],
                    q_b_t=c["q_b"].reshape(c["q_b"].shape[0], -1).T)
    else:
      expect.update(q_t=c["q"].reshape(config.embed_dim, -1).T)
    self.assertEqual(set(p), set(expect))
    for name, want in expect.items():
      np.testing.assert_array_equal(p[name], want, err_msg=name)
    chex.assert_shape(p["w_uk_t"], (N, C, P))
    chex.assert_shape(p["w_uv_t"], (N, V, C))

  @pytest.mark.slow  # both MLA decode paths' generate, twice each
  def test_packed_mla_with_q_lora(self):
    config = dataclasses.replace(tiny("mla"), q_lora_rank=24)
    params = kvjax.init_params(config, jax.random.key(3))
    pk = params_lib.pack(params, config)
    self._check_mla(config, pk["layers"][0]["attn"], jax.tree_util.tree_map(
        lambda w: w[0], params["layers"]["attn"]))
    tokens = _tokens(config, (2, 9))
    assert_close(kvjax.forward(pk, config, tokens),
                 kvjax.forward(params, config, tokens), config)
    for path in ("absorbed", "naive"):
      cfg = dataclasses.replace(config, mla_decode=path)
      np.testing.assert_array_equal(kvjax.generate(pk, cfg, tokens, 6),
                                    kvjax.generate(params, cfg, tokens, 6))

  def test_decode_step_runs_fewer_weight_products(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    pk = params_lib.pack(params, config)
    L = config.num_layers
    cache = kvjax.init_cache(config, 1, S)
    token = jnp.zeros((1,), jnp.int32)
    canonical = _dots(lambda p, c: model.decode_logits(p, config, token, c),
                      params_lib._unstack_layers(params), cache)  # pylint: disable=protected-access
    fused = _dots(lambda p, c: model.decode_logits(p, config, token, c),
                  pk, cache)
    # Per layer: q, k, v, o, gate, up, down -> qkv, o, gate_up, down; the
    # two attention products and the head are common.
    self.assertEqual(canonical - fused, 3 * L)
    self.assertEqual(fused, L * (4 + 2) + 1)

  def test_sharding_axes_cover_packed_weights(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    axes = sharding.param_axes(params_lib.pack(params, config))
    self.assertEqual(axes["layers"][0]["attn"]["qkv_t"], (None, "embed"))
    self.assertEqual(axes["layers"][0]["mlp"]["down_t"], ("embed", "mlp"))
    self.assertEqual(axes["lm_head_t"], ("vocab", "embed"))

  def test_two_layouts(self):
    """Canonical (stacked) and packed; nothing in between."""
    config, params = tiny("gqa"), tiny_params("gqa")
    pk = params_lib.pack(params, config)
    self.assertTrue(projections.is_packed(pk))
    self.assertIsInstance(pk["layers"], tuple)
    self.assertFalse(projections.is_packed(params))
    self.assertFalse(hasattr(packed, "layout"))

  def test_bad_params_raise(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    pk = params_lib.pack(params, config)
    with self.assertRaisesRegex(ValueError, "already packed"):
      params_lib.pack(pk, config)
    with self.assertRaisesRegex(ValueError, r"\['k'\] has shape"):
      params_lib.pack(params, tiny("mha"))
    # A packed model checked against another config names the leaf.
    with self.assertRaisesRegex(ValueError, r"qkv_t'\] has shape"):
      params_lib.check_params(pk, tiny("mha"))
    bad = dict(pk, layers=(pk["layers"][0],))
    with self.assertRaisesRegex(ValueError, "missing"):
      params_lib.check_params(bad, config)
    with self.assertRaisesRegex(ValueError, "do not match the config"):
      kvjax.generate(bad, config, _tokens(config, (1, 4)), 2)



class ForDecodeTest(parameterized.TestCase):
  """The default path is the fast path: inference entry points pack
  canonical params themselves (`packed.for_decode`), once per params."""

  def _wide(self, variant="gqa"):
    base = dict(vocab_size=64, num_layers=2, embed_dim=packed.PACK_MIN_WIDTH,
                num_heads=4, mlp_dim=64, init_scale=0.15)
    if variant == "mla":
      base.update(attention="mla", num_kv_heads=1, kv_lora_rank=32,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    else:
      base.update(num_kv_heads=2)
    config = kvjax.ModelConfig(**base)
    return config, kvjax.init_params(config, jax.random.key(0))

  @cases.variants(("gqa", "mla"), fast=("gqa",))
  def test_generate_on_canonical_params_runs_packed(self, variant):
    config, params = self._wide(variant)
    self.assertTrue(packed.packs(params, config))
    first = packed.for_decode(params, config)
    self.assertTrue(projections.is_packed(first))
    self.assertIs(packed.for_decode(params, config), first)  # packed once
    self.assertIs(packed.for_decode(dict(params), config), first)
    tokens = _tokens(config, (2, 7))
    got = kvjax.generate(params, config, tokens, 6, return_logits=True)
    want = kvjax.generate(first, config, tokens, 6, return_logits=True)
    np.testing.assert_array_equal(got[0], want[0])
    assert_close(got[1], want[1], config)
    with packed.as_given():
      self.assertIs(packed.for_decode(params, config), params)
      canonical = kvjax.generate(params, config, tokens, 6,
                                 return_logits=True)
    np.testing.assert_array_equal(canonical[0], want[0])
    assert_close(canonical[1], want[1], config)

  def test_changed_params_are_packed_anew(self):
    config, params = self._wide()
    first = packed.for_decode(params, config)
    changed = dict(params, final_norm=params["final_norm"] * 2)
    second = packed.for_decode(changed, config)
    self.assertIsNot(second, first)
    np.testing.assert_array_equal(second["final_norm"],
                                  params["final_norm"] * 2)

  def test_entry_dies_with_the_canonical_arrays(self):
    config, params = self._wide()
    packed.for_decode(params, config)
    key = tuple(map(id, jax.tree_util.tree_leaves(params)))
    self.assertIn(key, packed._PACKED)  # pylint: disable=protected-access
    del params
    gc.collect()
    self.assertNotIn(key, packed._PACKED)  # pylint: disable=protected-access

  def test_what_is_not_packed(self):
    config, params = self._wide()
    tiny_config = tiny("gqa")
    self.assertLess(tiny_config.embed_dim, packed.PACK_MIN_WIDTH)
    self.assertFalse(packed.packs(tiny_params("gqa"), tiny_config))
    self.assertFalse(packed.packs(params_lib.pack(params, config), config))
    jax.jit(lambda p: self.assertFalse(packed.packs(p, config)) or 0)(params)


if __name__ == "__main__":
  absltest.main()
