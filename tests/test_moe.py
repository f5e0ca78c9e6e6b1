"""kvjax.moe: DeepSeek routing and expert compute.

Routing is checked against a per-token numpy reference written from the
DeepSeek / transformers definitions (loops and sorts, no shared code); the
two expert-compute paths against each other; and a MoE model against the
core invariant (cached decode equals the no-cache forward). Parity with
transformers' own V2/V3 MoE layers is in tests/test_hf.py.
"""

import dataclasses

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import moe
from kvjax.tolerance import assert_close
import cases  # pylint: disable=g-bad-import-order

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")

BASE = kvjax.ModelConfig(
    vocab_size=96, num_layers=3, embed_dim=32, num_heads=4, mlp_dim=48,
    attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
    v_head_dim=8, rope_layout="interleaved", init_scale=0.2)
MOES = (
    kvjax.MoEConfig(num_experts=8, experts_per_token=2, expert_dim=16,
                    num_shared_experts=1, first_dense_layers=1,
                    routed_scaling_factor=2.0),
    kvjax.MoEConfig(num_experts=8, experts_per_token=3, expert_dim=16,
                    topk_method="group_limited_greedy", num_groups=4,
                    topk_groups=2, routed_scaling_factor=1.5),
    kvjax.MoEConfig(num_experts=8, experts_per_token=2, expert_dim=16,
                    num_shared_experts=2, scoring="sigmoid",
                    topk_method="noaux_tc", num_groups=4, topk_groups=2,
                    norm_topk_prob=True, routed_scaling_factor=2.5),
    kvjax.MoEConfig(num_experts=6, experts_per_token=2, expert_dim=16,
                    scoring="sigmoid", topk_method="noaux_tc", num_groups=1,
                    topk_groups=1, first_dense_layers=3),
)


def _name(m: kvjax.MoEConfig) -> str:
  return (f"{m.scoring}_{m.topk_method}_E{m.num_experts}k"
          f"{m.experts_per_token}_g{m.num_groups}of{m.topk_groups}"
          f"{'_norm' if m.norm_topk_prob else ''}_shared"
          f"{m.num_shared_experts}_dense{m.first_dense_layers}")


def _layer_params(config, seed=0):
  """One MoE layer's params with a random (nonzero) correction bias."""
  rng = np.random.default_rng(seed)
  # numpy draws: no per-shape compilation of eager jax.random calls.
  return {name: jnp.asarray(0.3 * rng.normal(size=shape), jnp.float32)
          for name, shape in sorted(moe.moe_shapes(config).items())}


def _inputs(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape),
                     jnp.float32)


def _reference_route(p, x_TD, m: kvjax.MoEConfig):
  """Per-token loops over the DeepSeek definitions (float64 numpy)."""
  x = np.asarray(x_TD, np.float64)
  logits = x @ np.asarray(p["router"], np.float64)
  ids, weights = [], []
  per_group = m.num_experts // m.num_groups
  for row in logits:
    if m.scoring == "softmax":
      s = np.exp(row - row.max())
      s = s / s.sum()
    else:
      s = 1 / (1 + np.exp(-row))
    choice = s + (np.asarray(p["score_bias"], np.float64)
                  if m.topk_method == "noaux_tc" else 0)
    if m.topk_method != "greedy":
      groups = [choice[g * per_group:(g + 1) * per_group]
                for g in range(m.num_groups)]
      if m.topk_method == "group_limited_greedy":
        score = [g.max() for g in groups]
      else:
        score = [np.sort(g)[-2:].sum() for g in groups]
      best = set(np.argsort(score)[::-1][:m.topk_groups])
      fill = 0.0 if m.topk_method == "group_limited_greedy" else -np.inf
      choice = np.array([c if e // per_group in best else fill
                         for e, c in enumerate(choice)])
    top = list(np.argsort(choice, kind="stable")[::-1][:m.experts_per_token])
    w = np.array([(s if m.topk_method == "noaux_tc" else choice)[e]
                  for e in top])
    if m.norm_topk_prob:
      w = w / (w.sum() + 1e-20)
    ids.append(top)
    weights.append(w * m.routed_scaling_factor)
  return np.array(ids), np.array(weights)


class MoETest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters((_name(m), m) for m in MOES)
  def test_routing_matches_per_token_reference(self, m):
    config = BASE.replace(moe=m)
    p = _layer_params(config)
    x_TD = _inputs((40, config.embed_dim), 1)
    ids, weights = self.variant(lambda p, x: moe.route(p, x, config))(p, x_TD)
    chex.assert_shape([ids, weights], (40, m.experts_per_token))
    ref_ids, ref_w = _reference_route(p, x_TD, m)
    # Order within a token's top-k is irrelevant: compare as id -> weight.
    for t in range(40):
      got = dict(zip(np.asarray(ids[t]).tolist(), np.asarray(weights[t])))
      want = dict(zip(ref_ids[t].tolist(), ref_w[t]))
      self.assertEqual(sorted(got), sorted(want), f"token {t}")
      assert_close([got[e] for e in sorted(got)],
                   [want[e] for e in sorted(want)], depth=1)

  @parameterized.named_parameters((_name(m), m) for m in MOES[1:3])
  def test_chosen_experts_lie_in_chosen_groups(self, m):
    config = BASE.replace(moe=m)
    p = _layer_params(config, seed=3)
    x_TD = _inputs((64, config.embed_dim), 4)
    ids, _ = moe.route(p, x_TD, config)
    groups = np.asarray(ids) // (m.num_experts // m.num_groups)
    for row in groups:
      self.assertLessEqual(len(set(row.tolist())), m.topk_groups)

  def test_correction_bias_steers_choice_not_weights(self):
    m = MOES[3]  # sigmoid, noaux_tc, no normalization, scaling 1
    config = BASE.replace(moe=m)
    p = _layer_params(config)
    p["score_bias"] = jnp.zeros((m.num_experts,)).at[4].set(10.0)
    x_TD = _inputs((16, config.embed_dim), 5)
    ids, weights = moe.route(p, x_TD, config)
    ids, weights = np.asarray(ids), np.asarray(weights)
    self.assertTrue((ids == 4).any(axis=1).all())
    unbiased = jax.nn.sigmoid(x_TD @ p["router"])
    assert_close(weights,
                 np.take_along_axis(np.asarray(unbiased), ids, axis=1),
                 depth=1)

  def test_normalized_weights_sum_to_scaling_factor(self):
    m = MOES[2]
    config = BASE.replace(moe=m)
    p = _layer_params(config)
    x_TD = _inputs((32, config.embed_dim), 6)
    _, weights = moe.route(p, x_TD, config)
    assert_close(np.sum(weights, axis=-1),
                 np.full(weights.shape[:-1], m.routed_scaling_factor),
                 depth=1)

  # Fast tier: the sigmoid, group-limited, normalized routing.
  @chex.variants(with_jit=True, without_jit=True)
  @cases.named((dict(testcase_name=_name(m), m=m) for m in MOES[:3]),
               slow=lambda m: m != MOES[2])
  def test_dense_and_gather_paths_agree(self, m):
    config = BASE.replace(moe=m)
    p = _layer_params(config)
    x_BTD = _inputs((2, 5, config.embed_dim), 7)
    dense = self.variant(
        lambda p, x: moe.moe_mlp(p, x, config, path="dense"))(p, x_BTD)
    gather = self.variant(
        lambda p, x: moe.moe_mlp(p, x, config, path="gather"))(p, x_BTD)
    chex.assert_shape(dense, x_BTD.shape)
    chex.assert_tree_all_finite(dense)
    assert_close(dense, gather, depth=1)
    # The automatic choice gathers only when tokens * k < experts.
    self.assertTrue(moe.use_gather(1, config))
    self.assertFalse(moe.use_gather(10, config))

  def test_shared_experts_add_a_dense_swiglu(self):
    m = MOES[0]
    config = BASE.replace(moe=m)
    p = _layer_params(config)
    x_BTD = _inputs((1, 4, config.embed_dim), 8)
    self.assertGreater(m.num_shared_experts, 0)
    unshared = BASE.replace(moe=dataclasses.replace(m, num_shared_experts=0))
    without = {k: v for k, v in p.items() if not k.startswith("shared")}
    x_TD = x_BTD[0]
    shared = (jax.nn.silu(x_TD @ p["shared_gate"]) *
              (x_TD @ p["shared_up"])) @ p["shared_down"]
    assert_close(moe.moe_mlp(p, x_BTD, config)[0],
                 moe.moe_mlp(without, x_BTD, unshared)[0] + shared, depth=1)

  def test_moe_shapes_need_moe(self):
    with self.assertRaisesRegex(ValueError, "moe"):
      moe.moe_shapes(BASE)
    with self.assertRaisesRegex(ValueError, "topk_groups"):
      dataclasses.replace(MOES[1], topk_groups=5)
    with self.assertRaisesRegex(ValueError, "2 experts per group"):
      dataclasses.replace(MOES[2], num_groups=8)

  def test_cached_decode_equals_forward(self):
    # A dense first layer, then MoE layers: both stacks; prefill takes the
    # dense expert path, decode (T·k < E) the gather path. transformers
    # parity of more routings is in test_hf.py.
    m = MOES[0]
    config = BASE.replace(moe=m)
    # init_params traced (its structure and shapes), values drawn in numpy:
    # compiling threefry for every leaf costs more than the whole test.
    shapes = jax.eval_shape(lambda: kvjax.init_params(config,
                                                      jax.random.key(0)))
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(
        lambda path, s: jnp.asarray(
            1.0 + 0.1 * rng.normal(size=s.shape)
            if path[-1].key.endswith("norm") else
            config.init_scale * rng.normal(size=s.shape), jnp.float32),
        shapes)
    dense_depth = min(m.first_dense_layers, config.num_layers)
    if dense_depth:
      chex.assert_shape(params["layers"]["mlp"]["gate"],
                        (dense_depth, config.embed_dim, config.mlp_dim))
    else:
      self.assertNotIn("layers", params)
    for name, shape in moe.moe_shapes(config).items():
      chex.assert_shape(params["moe_layers"]["mlp"][name],
                        (config.num_layers - dense_depth,) + shape)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0,
                                config.vocab_size)
    full = kvjax.forward(params, config, tokens)
    cache = kvjax.init_cache(config, 2, 16)
    logits, cache = kvjax.prefill(params, config, tokens[:, :6], cache,
                                  all_logits=True)
    assert_close(logits, full[:, :6], config)
    for t in range(6, 9):
      step, cache = kvjax.decode_step(params, config, tokens[:, t], cache)
      assert_close(step, full[:, t], config)


if __name__ == "__main__":
  absltest.main()
