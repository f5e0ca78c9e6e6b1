"""Parameters: build, check and convert the model's params pytree.

One canonical layout and one decode layout (their key names:
`kvjax.projections`, the one module that applies both).

Canonical: what `init_params` and `load_checkpoint` return and what training,
checkpoints and the sharding table use. Weights are stored `[in, out]`
(x @ W); layers are stacked along a leading L axis (`model.run_layers`
scans them, so compile time does not grow with depth). DeepSeek models with
dense layers below MoE layers have two stacks ('layers', then
'moe_layers': `stacks`).

  params = {
    'embed': [V, D],
    'layers': {'attn_norm': [L, D], 'attn': {...}, 'mlp_norm': [L, D],
               'mlp': {'gate': [L, D, F], 'up': [L, D, F], 'down': [L, F, D]}},
    'moe_layers': {... 'mlp': kvjax.moe params} (MoE models only),
    'final_norm': [D],
    'lm_head': [D, V] (absent when tie_embeddings),
  }

Packed (`pack(params, config)`, the one conversion): the same model laid out
for memory-bound decode. Layers unrolled into a tuple of per-layer dicts,
q/k/v fused into one weight and gate/up into another (one product reads one
contiguous array: fewer, larger dots), every fused dense weight stored
[out, in]. Values are unchanged (tests: logits and tokens equal the
canonical params for every variant); only the bytes' order and the number
of dots differ. MoE experts keep their canonical form (a decode step reads
a few of them); their dense MLPs and the LM head are packed.

Why: on XLA's CPU backend the weight products are ~90% of a batch-1
decode step, at 24 GB/s for `x @ W` on [in, out] weights against 32 GB/s
for the packed `W @ x`; at batch 8 the skinny GEMMs are 1.3x faster with
the weight on the left. Medium decode: +15-20% tokens/s over the unrolled
layout at batch 1 and 8 in the peer benchmark (WORKSPACE.md). Canonical
MLA weights made XLA transpose W_UK and W_UV on every decode step; packed
MLA decodes 16% (batch 1) / 11% (batch 8) faster. Which layout wins is
measured per size (experiments/decode_layout.py), and the inference entry
points choose it themselves (`kvjax.packed.for_decode`: the default path is
the fast path; no flag).
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import moe as moe_lib
from kvjax.config import ModelConfig
from kvjax.projections import is_packed


def stacks(config: ModelConfig) -> tuple[tuple[str, int, bool], ...]:
  """The layer stacks of `config`'s params, bottom first: (name, depth,
  moe) for 'layers' (dense MLPs) and 'moe_layers' (MoE MLPs); a stack of
  depth 0 is absent from the params."""
  out = [("layers", config.num_dense_layers, False)]
  if config.is_moe:
    out.append(("moe_layers", config.num_layers - config.num_dense_layers,
                True))
  return tuple(s for s in out if s[1])


# ---- init -------------------------------------------------------------------
def _attention_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  D, N = config.embed_dim, config.num_heads
  if config.attention == "mla":
    C, R = config.kv_lora_rank, config.qk_rope_head_dim
    P, O, Q = config.qk_nope_head_dim, config.v_head_dim, config.q_lora_rank
    shapes = dict(kv_a=(D, C + R), kv_a_norm=(C,), w_uk=(C, N, P),
                  w_uv=(C, N, O), o=(N, O, D))
    if Q:
      shapes.update(q_a=(D, Q), q_a_norm=(Q,), q_b=(Q, N, P + R))
    else:
      shapes.update(q=(D, N, P + R))
    return shapes
  K, H = config.num_kv_heads, config.head_dim
  shapes = dict(q=(D, N, H), k=(D, K, H), v=(D, K, H), o=(N, H, D))
  if config.qkv_bias:
    shapes.update(q_bias=(N, H), k_bias=(K, H), v_bias=(K, H))
  if config.o_bias:
    shapes.update(o_bias=(D,))
  return shapes


def _is_norm(name: str) -> bool:
  return name.endswith("norm")


def _init_tree(shapes, key, scale, dtype, lead=()):
  """Normal(scale) weights, ones for norms, zeros for biases."""
  out = {}
  keys = jax.random.split(key, len(shapes))
  for k, (name, shape) in zip(keys, sorted(shapes.items())):
    full = lead + shape
    if _is_norm(name):
      out[name] = jnp.ones(full, dtype)
    elif name.endswith("bias"):
      out[name] = jnp.zeros(full, dtype)
    else:
      out[name] = (scale * jax.random.normal(k, full, jnp.float32)).astype(
          dtype)
  return out


def _block_shapes(config: ModelConfig, moe: bool):
  D, F = config.embed_dim, config.mlp_dim
  shapes = dict(attn_norm=(D,), mlp_norm=(D,))
  if moe:
    mlp = moe_lib.moe_shapes(config)
  else:
    mlp = dict(gate=(D, F), up=(D, F), down=(F, D))
  return shapes, _attention_shapes(config), mlp


def init_params(config: ModelConfig, key: jax.Array):
  """Random parameters (normal with std `config.init_scale`; norms = 1).

  Returns:
    The canonical params pytree described in the module docstring.
  """
  dtype = jnp.dtype(config.param_dtype)
  V, D, s = config.vocab_size, config.embed_dim, config.init_scale
  k_embed, k_head, k_layers, k_moe = jax.random.split(key, 4)
  params = dict(
      embed=(s * jax.random.normal(k_embed, (V, D))).astype(dtype),
      final_norm=jnp.ones((D,), dtype))
  if not config.tie_embeddings:
    params["lm_head"] = (s * jax.random.normal(k_head, (D, V))).astype(dtype)
  for name, depth, moe in stacks(config):
    k = k_moe if moe else k_layers
    norms, attn, mlp = _block_shapes(config, moe)
    k_attn, k_mlp = jax.random.split(k)
    block = _init_tree(norms, k, s, dtype, (depth,))
    block["attn"] = _init_tree(attn, k_attn, s, dtype, (depth,))
    block["mlp"] = _init_tree(mlp, k_mlp, s, dtype, (depth,))
    params[name] = block
  return params


def param_count(config: ModelConfig) -> int:
  """Number of parameters, computed with `jax.eval_shape` (no allocation)."""
  shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))


# ---- check ------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _expected_param_shapes(config: ModelConfig,
                           packed: bool = False) -> dict[str, tuple[int, ...]]:
  init = lambda: init_params(config, jax.random.key(0))
  if packed:
    tree = jax.eval_shape(lambda: pack(init(), config))
  else:
    tree = jax.eval_shape(init)
  return {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in
          jax.tree_util.tree_flatten_with_path(tree)[0]}


def shape_fields(config: ModelConfig) -> str:
  """The config fields that decide the parameter shapes, for error messages."""
  names = ["vocab_size", "num_layers", "embed_dim", "num_heads", "mlp_dim"]
  if config.attention == "mla":
    names += ["kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
              "v_head_dim", "q_lora_rank"]
  else:
    names += ["num_kv_heads", "head_dim_override", "qkv_bias", "o_bias"]
  names.append("tie_embeddings")
  s = ", ".join(f"{n}={getattr(config, n)}" for n in names)
  if config.moe is not None:
    m = config.moe
    s += (f", experts={m.num_experts}, expert_dim={m.expert_dim}, "
          f"shared={m.num_shared_experts}, dense_layers="
          f"{m.first_dense_layers}")
  return s


def check_params(params, config: ModelConfig) -> None:
  """Raises ValueError unless `params` has exactly the leaves and shapes that
  `init_params(config, ...)` would build, every leaf floating point (any
  float dtype: the block casts to the compute dtype).

  Catches params built for another config, e.g. an MLA nope/rope/v split or a
  q_lora_rank that does not match the projections, before any compute. Shapes
  only, so it also accepts tracers and `jax.ShapeDtypeStruct`s. Packed params
  (`pack`) are checked against the packed shapes.

  Raises:
    ValueError: params is not a mapping (e.g. None); a leaf is not floating
      point (integer weights are never a model kvjax can run: the embedding
      lookup and LM head would compute in integers); a leaf is missing,
      unexpected or misshapen. Each names the leaf path.
  """
  if not isinstance(params, Mapping):
    raise ValueError(f"params must be a dict of arrays, got "
                     f"{type(params).__name__}")
  not_float = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.floating):
      not_float.append(f"{jax.tree_util.keystr(path)} ({dtype})")
  if not_float:
    raise ValueError("params must be floating point; these leaves are not: "
                     + ", ".join(not_float))
  packed = is_packed(params)
  if not packed and any(isinstance(params.get(n), (list, tuple))
                        for n in ("layers", "moe_layers")):
    raise ValueError(
        "params hold a tuple of per-layer dicts of canonical weights, which "
        "is not a layout kvjax runs: pass the stacked params (init_params, "
        "load_checkpoint) or their decode layout (kvjax.pack)")
  expected = _expected_param_shapes(config, packed)
  leaves, _ = jax.tree_util.tree_flatten_with_path(params)
  got = {jax.tree_util.keystr(path): tuple(np.shape(leaf))
         for path, leaf in leaves}
  missing = sorted(set(expected) - set(got))
  unexpected = sorted(set(got) - set(expected))
  if missing or unexpected:
    raise ValueError(
        f"params do not match the config ({shape_fields(config)}): missing "
        f"{missing}, unexpected {unexpected}")
  wrong = [f"param {name} has shape {got[name]}, the config implies "
           f"{shape}" for name, shape in expected.items()
           if got[name] != shape]
  if wrong:
    raise ValueError("; ".join(wrong) +
                     f" (config: {shape_fields(config)})")


# ---- pack: the decode layout ------------------------------------------------
def _pack_mla(p_attn, config: ModelConfig):
  N = config.num_heads
  out = {k: v for k, v in p_attn.items()
         if k not in ("q", "q_a", "q_b", "kv_a", "w_uk", "w_uv", "o")}
  if config.q_lora_rank:
    out["q_a_t"] = p_attn["q_a"].T
    out["q_b_t"] = p_attn["q_b"].reshape(config.q_lora_rank, -1).T
  else:
    out["q_t"] = p_attn["q"].reshape(config.embed_dim, -1).T
  out["kv_a_t"] = p_attn["kv_a"].T
  out["w_uk_t"] = jnp.transpose(p_attn["w_uk"], (1, 0, 2))  # [N, C, P]
  out["w_uv_t"] = jnp.transpose(p_attn["w_uv"], (1, 2, 0))  # [N, O, C]
  out["o_t"] = p_attn["o"].reshape(N * config.v_head_dim, -1).T
  return out


def _pack_attention(p_attn, config: ModelConfig):
  if config.attention == "mla":
    return _pack_mla(p_attn, config)
  D = config.embed_dim
  qkv = jnp.concatenate([p_attn["q"].reshape(D, -1),  # [D, (N+2K)·H]
                         p_attn["k"].reshape(D, -1),
                         p_attn["v"].reshape(D, -1)], axis=1)
  out = {k: v for k, v in p_attn.items() if k not in ("q", "k", "v", "o")}
  out["qkv_t"] = qkv.T
  out["o_t"] = p_attn["o"].reshape(-1, D).T
  return out


def _pack_mlp(p_mlp):
  out = {k: v for k, v in p_mlp.items() if k not in ("gate", "up", "down")}
  out["gate_up_t"] = jnp.concatenate([p_mlp["gate"], p_mlp["up"]], axis=1).T
  out["down_t"] = p_mlp["down"].T
  return out


def _unstack_layers(params):
  """The params with every layer stack split into a tuple of per-layer
  dicts (copies the weights once).

  Why: inside the layer scan, XLA on CPU materialises each layer's slice of
  a stacked [L, ...] weight (a dynamic slice feeding a dot is a copy), so a
  decode step reads most weights three times (read, write, read). Per-layer
  arrays are read in place; `model.run_layers` unrolls a tuple stack
  (compile time then grows with depth; WORKSPACE.md).
  """
  out = dict(params)
  for name in ("layers", "moe_layers"):
    if name not in params:
      continue
    stack = params[name]
    depth = jax.tree_util.tree_leaves(stack)[0].shape[0]
    out[name] = tuple(jax.tree_util.tree_map(lambda w, i=i: w[i], stack)
                      for i in range(depth))
  return out


def pack(params, config: ModelConfig):
  """The packed decode layout of canonical `params` (module docstring;
  key names: `kvjax.projections`). Copies every packed weight once
  (eagerly, outside jit: drop the canonical params afterwards to free
  their memory).

  Raises:
    ValueError: params already packed, or not matching `config`.
  """
  if is_packed(params):
    raise ValueError("params are already packed (kvjax.pack)")
  check_params(params, config)
  out = _unstack_layers(params)
  for name, _, moe in stacks(config):
    out[name] = tuple(
        dict(p, attn=_pack_attention(p["attn"], config),
             mlp=p["mlp"] if moe else _pack_mlp(p["mlp"]))
        for p in out[name])
  if not config.tie_embeddings:
    out["lm_head_t"] = out.pop("lm_head").T
  # Eager transposes are new row-major arrays: decode reads them in place.
  return out
