"""DeepSeek-style mixture-of-experts MLP: a router picks `experts_per_token`
of E routed experts per token, plus always-on shared experts.

Routing (`MoEConfig.scoring`, `MoEConfig.topk_method`), as the reference
implementation (transformers' DeepseekV2/V3 routers) computes it, in float32:

  scores      softmax (V2) or sigmoid (V3) of the router logits x·W_r.
  greedy      top-k of the scores.
  group_limited_greedy (V2)
              experts are split into `num_groups` groups; a group scores the
              max of its experts; experts outside the best `topk_groups`
              groups are zeroed, then top-k.
  noaux_tc (V3)
              selection uses scores + `score_bias` (the aux-loss-free
              balancing bias, `e_score_correction_bias`); a group scores the
              sum of its two best biased scores; experts outside the best
              groups are set to -inf, then top-k. The combine weights come
              from the *unbiased* scores.
  Then optionally normalized to sum 1 (`norm_topk_prob`) and multiplied by
  `routed_scaling_factor`.

Expert compute. Two exact, jit-friendly paths (static choice by shape):
  dense   every expert runs on every token ('TD,EDF->TEF') and the outputs
          are combined with the routing weights (zero for experts not
          chosen). E/k times the FLOPs of a sparse MoE, but one batched
          einsum: the fastest option for tiny models and long prompts on CPU.
  gather  the chosen experts' weights are gathered per token
          ([T, E', D, F]) so only E' = k experts are read. Used when
          T·k < E (decode with a small batch), where reading weights
          dominates.
A sort-and-segment grouped matmul (the production choice for big E) is not
needed at the sizes kvjax measures.

Params (per layer; `init_params` adds the leading L axis):
  router [D, E], score_bias [E] (noaux_tc only),
  expert_gate, expert_up [E, D, F], expert_down [E, F, D],
  shared_gate, shared_up [D, F'], shared_down [F', D] (F' = F times the
  number of shared experts, if any). F here is `MoEConfig.expert_dim`.

Dimensions (`kvjax.config`): T tokens (the B·T rows flattened), E experts,
E' the k experts one token picks (lowercase `e` in names), D, F.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.config import ModelConfig
from kvjax.layers import swiglu


def moe_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Parameter name -> shape for one MoE layer (no leading L axis)."""
  m = config.moe
  if m is None:
    raise ValueError("moe_shapes needs a config with `moe` set")
  D, E, F = config.embed_dim, m.num_experts, m.expert_dim
  shapes = dict(router=(D, E), expert_gate=(E, D, F), expert_up=(E, D, F),
                expert_down=(E, F, D))
  if m.topk_method == "noaux_tc":
    shapes["score_bias"] = (E,)
  if m.num_shared_experts:
    Fp = F * m.num_shared_experts  # F'
    shapes.update(shared_gate=(D, Fp), shared_up=(D, Fp), shared_down=(Fp, D))
  return shapes


def route(p, x_TD, config: ModelConfig):
  """Chooses experts for each token.

  Args:
    p: one MoE layer's params (`router`, optional `score_bias`).
    x_TD: normalized tokens.
  Returns:
    (expert ids [T, E'] int32, combine weights [T, E'] float32)
  """
  m = config.moe
  T = x_TD.shape[0]
  E, groups = m.num_experts, m.num_groups
  f32 = jnp.float32
  # Routing is discontinuous in the logits: compute them at full float32
  # precision (a TF32/bf16 matmul can flip an expert choice).
  logits_TE = jnp.einsum("TD,DE->TE", x_TD.astype(f32), p["router"].astype(f32),
                         precision=jax.lax.Precision.HIGHEST)
  if m.scoring == "softmax":
    scores_TE = jax.nn.softmax(logits_TE, axis=-1)
  else:
    scores_TE = jax.nn.sigmoid(logits_TE)
  choice_TE = scores_TE
  if m.topk_method == "noaux_tc":
    choice_TE = scores_TE + p["score_bias"].astype(f32)[None, :]
  if m.topk_method in ("group_limited_greedy", "noaux_tc"):
    # [T, groups, E / groups] -> each group's score [T, groups] -> the
    # best `topk_groups` groups [T, topk_groups] -> [T, groups] kept.
    grouped = choice_TE.reshape(T, groups, E // groups)
    if m.topk_method == "group_limited_greedy":
      group_score = jnp.max(grouped, axis=-1)
      fill = 0.0
    else:
      group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
      fill = -jnp.inf
    _, best = jax.lax.top_k(group_score, m.topk_groups)
    keep_group = jnp.sum(jax.nn.one_hot(best, groups, dtype=f32), axis=1) > 0
    keep_TE = jnp.repeat(keep_group, E // groups, axis=1)
    choice_TE = jnp.where(keep_TE, choice_TE, fill)
  chosen_Te, ids_Te = jax.lax.top_k(choice_TE, m.experts_per_token)
  if m.topk_method == "noaux_tc":
    # The bias only steers selection; the weights use the unbiased scores.
    weights_Te = jnp.take_along_axis(scores_TE, ids_Te, axis=1)
  else:
    weights_Te = chosen_Te
  if m.norm_topk_prob:
    weights_Te = weights_Te / (jnp.sum(weights_Te, axis=-1, keepdims=True)
                               + 1e-20)
  weights_Te = weights_Te * m.routed_scaling_factor
  return ids_Te.astype(jnp.int32), weights_Te


def use_gather(num_tokens: int, config: ModelConfig) -> bool:
  """Static path choice: gather the chosen experts when T·k < E."""
  return num_tokens * config.moe.experts_per_token < config.moe.num_experts


def routed_experts(p, x_TD, ids_Te, weights_Te, config: ModelConfig,
                   path: str | None = None):
  """Weighted sum of the chosen experts' SwiGLU outputs, [T, D].

  `path` is 'dense', 'gather' or None (choose by `use_gather`).
  """
  T = x_TD.shape[0]
  E = config.moe.num_experts
  if path is None:
    path = "gather" if use_gather(T, config) else "dense"
  w_Te = weights_Te.astype(x_TD.dtype)
  if path == "gather":
    gate_TeDF = p["expert_gate"][ids_Te]
    up_TeDF = p["expert_up"][ids_Te]
    down_TeFD = p["expert_down"][ids_Te]
    h_TeF = (jax.nn.silu(jnp.einsum("TD,TeDF->TeF", x_TD, gate_TeDF)) *
             jnp.einsum("TD,TeDF->TeF", x_TD, up_TeDF))
    return jnp.einsum("TeF,TeFD->TD", h_TeF * w_Te[..., None], down_TeFD)
  if path != "dense":
    raise ValueError(f"path={path!r} must be 'dense', 'gather' or None")
  # Weights of unchosen experts are exactly zero, so they add nothing.
  combine_TE = jnp.sum(
      jax.nn.one_hot(ids_Te, E, dtype=x_TD.dtype) * w_Te[..., None], axis=1)
  h_TEF = (jax.nn.silu(jnp.einsum("TD,EDF->TEF", x_TD, p["expert_gate"])) *
           jnp.einsum("TD,EDF->TEF", x_TD, p["expert_up"]))
  return jnp.einsum("TEF,EFD->TD", h_TEF * combine_TE[..., None],
                    p["expert_down"])


def moe_mlp(p, x_BTD, config: ModelConfig, path: str | None = None):
  """The MoE MLP of one layer.

  Args:
    p: params listed in the module docstring (no L axis).
    x_BTD: normalized input.
    path: expert compute path ('dense' / 'gather'); None picks by shape.
  Returns:
    y_BTD (routed experts + shared experts).
  """
  B, T, D = x_BTD.shape
  x_TD = x_BTD.reshape(B * T, D)
  with jax.named_scope("router"):
    ids_Te, weights_Te = route(p, x_TD, config)
  with jax.named_scope("experts"):
    y_TD = routed_experts(p, x_TD, ids_Te, weights_Te, config, path)
  if config.moe.num_shared_experts:
    y_TD = y_TD + swiglu(x_TD, p["shared_gate"], p["shared_up"],
                         p["shared_down"])
  return y_TD.reshape(B, T, D)
