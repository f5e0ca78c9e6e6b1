"""The decoder: parameters, one block, the layer scan, and the four ways of
calling it (no-cache forward, prefill, extend, decode step).

Parameters are a plain pytree; weights are stored `[in, out]` (x @ W), the
layout training, checkpoints and the sharding table use. `kvjax.packed`
re-lays them out for decode (fused, `[out, in]`); every function here takes
both.
Layers are stacked along a leading L axis and run by `jax.lax.scan`, so
compile time does not grow with depth. DeepSeek models with dense layers
below MoE layers have two stacks ('layers', then 'moe_layers'), scanned one
after the other over the same cache.

  params = {
    'embed': [V, D],
    'layers': {'attn_norm': [L, D], 'attn': {...}, 'mlp_norm': [L, D],
               'mlp': {'gate': [L, D, F], 'up': [L, D, F], 'down': [L, F, D]}},
    'moe_layers': {... 'mlp': kvjax.moe params} (MoE models only),
    'final_norm': [D],
    'lm_head': [D, V] (absent when tie_embeddings),
  }
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import errors
from kvjax import packed as packed_lib
from kvjax.attention import Step, gqa_attention
from kvjax.config import ModelConfig
from kvjax.layers import linear_t, rms_norm, rope_tables, swiglu
from kvjax.mla import mla_attention


# ---- parameters -------------------------------------------------------------
def _attention_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  D, N = config.embed_dim, config.num_heads
  if config.attention == "mla":
    C, R = config.kv_lora_rank, config.qk_rope_head_dim
    P, Vh, Q = config.qk_nope_head_dim, config.v_head_dim, config.q_lora_rank
    shapes = dict(kv_a=(D, C + R), kv_a_norm=(C,), w_uk=(C, N, P),
                  w_uv=(C, N, Vh), o=(N, Vh, D))
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
    from kvjax import moe as moe_lib  # pylint: disable=g-import-not-at-top
    mlp = moe_lib.moe_shapes(config)
  else:
    mlp = dict(gate=(D, F), up=(D, F), down=(F, D))
  return shapes, _attention_shapes(config), mlp


def init_params(config: ModelConfig, key: jax.Array):
  """Random parameters (normal with std `config.init_scale`; norms = 1).

  Returns:
    The params pytree described in the module docstring.
  """
  dtype = jnp.dtype(config.param_dtype)
  V, D, s = config.vocab_size, config.embed_dim, config.init_scale
  k_embed, k_head, k_layers, k_moe = jax.random.split(key, 4)
  params = dict(
      embed=(s * jax.random.normal(k_embed, (V, D))).astype(dtype),
      final_norm=jnp.ones((D,), dtype))
  if not config.tie_embeddings:
    params["lm_head"] = (s * jax.random.normal(k_head, (D, V))).astype(dtype)
  stacks = [("layers", config.num_dense_layers, False, k_layers)]
  if config.is_moe:
    stacks.append(("moe_layers", config.num_layers - config.num_dense_layers,
                   True, k_moe))
  for name, depth, moe, k in stacks:
    if depth == 0:
      continue
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


@functools.lru_cache(maxsize=64)
def _expected_param_shapes(config: ModelConfig,
                           packed: bool = False) -> dict[str, tuple[int, ...]]:
  init = lambda: init_params(config, jax.random.key(0))
  if packed:
    tree = jax.eval_shape(lambda: packed_lib.pack(init(), config))
  else:
    tree = jax.eval_shape(init)
  return {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in
          jax.tree_util.tree_flatten_with_path(tree)[0]}


def _shape_fields(config: ModelConfig) -> str:
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
  (`kvjax.packed.pack`) are checked against the packed shapes.

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
  packed = packed_lib.is_packed(params)
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
        f"params do not match the config ({_shape_fields(config)}): missing "
        f"{missing}, unexpected {unexpected}")
  wrong = [f"param {name} has shape {got[name]}, the config implies "
           f"{shape}" for name, shape in expected.items()
           if got[name] != shape]
  if wrong:
    raise ValueError("; ".join(wrong) +
                     f" (config: {_shape_fields(config)})")


# ---- the block and the layer scan -------------------------------------------
def _mlp(p, x_BTD, config: ModelConfig):
  if "router" in p:
    from kvjax import moe as moe_lib  # pylint: disable=g-import-not-at-top
    return moe_lib.moe_mlp(p, x_BTD, config)
  if "gate_up_t" in p:  # kvjax.packed
    gate_up_BTF = linear_t(x_BTD, p["gate_up_t"], norm_input=True)
    F = gate_up_BTF.shape[-1] // 2
    h_BTF = jax.nn.silu(gate_up_BTF[..., :F]) * gate_up_BTF[..., F:]
    return linear_t(h_BTF, p["down_t"])
  return swiglu(x_BTD, p["gate"], p["up"], p["down"])


def block(p, x_BTD, step: Step, cache, layer, config: ModelConfig):
  """One pre-norm decoder block. Returns (x_BTD, new_cache)."""
  attn_fn = mla_attention if config.attention == "mla" else gqa_attention
  dtype = config.dtype
  p = jax.tree_util.tree_map(lambda w: w.astype(dtype), p)
  with jax.named_scope("attention"):
    h_BTD = rms_norm(x_BTD, p["attn_norm"], config.rms_norm_eps)
    a_BTD, cache = attn_fn(p["attn"], h_BTD, step, cache, layer, config)
    x_BTD = x_BTD + a_BTD
  with jax.named_scope("mlp"):
    h_BTD = rms_norm(x_BTD, p["mlp_norm"], config.rms_norm_eps)
    x_BTD = x_BTD + _mlp(p["mlp"], h_BTD, config)
  return x_BTD, cache


def run_layers(params, x_BTD, step: Step, cache, config: ModelConfig):
  """Scans every layer stack over (x, cache); a tuple stack (the decode
  layout, `kvjax.packed`) is unrolled instead. Returns (x_BTD, new_cache)."""

  def body(carry, xs):
    x_BTD, cache = carry
    p, layer = xs
    return block(p, x_BTD, step, cache, layer, config), None

  start = 0
  for name in ("layers", "moe_layers"):
    if name not in params:
      continue
    if isinstance(params[name], (list, tuple)):
      for p in params[name]:  # static layer index: static cache slices
        x_BTD, cache = block(p, x_BTD, step, cache, start, config)
        start += 1
      continue
    depth = jax.tree_util.tree_leaves(params[name])[0].shape[0]
    layer_ids = jnp.arange(start, start + depth, dtype=jnp.int32)
    (x_BTD, cache), _ = jax.lax.scan(body, (x_BTD, cache),
                                     (params[name], layer_ids))
    start += depth
  return x_BTD, cache


def embed(params, tokens_BT, config: ModelConfig):
  return params["embed"][tokens_BT].astype(config.dtype)


def unembed(params, x_BTD, config: ModelConfig, invalid_B=None):
  """Final norm and LM head; float32 logits [B, T, V] (NaN rows where
  `invalid_B` [B] is True: `kvjax.errors`)."""
  x_BTD = rms_norm(x_BTD, params["final_norm"].astype(config.dtype),
                   config.rms_norm_eps, invalid_B=invalid_B)
  if packed_lib.is_packed(params):  # [V, D]: the tied embed or lm_head_t
    w_VD = params.get("lm_head_t", params["embed"]).astype(config.dtype)
    return linear_t(x_BTD, w_VD, preferred_element_type=jnp.float32)
  if "lm_head" in params:
    w_DV = params["lm_head"].astype(config.dtype)
    return jnp.einsum("BTD,DV->BTV", x_BTD, w_DV,
                      preferred_element_type=jnp.float32)
  w_VD = params["embed"].astype(config.dtype)
  return jnp.einsum("BTD,VD->BTV", x_BTD, w_VD,
                    preferred_element_type=jnp.float32)


# ---- masks and positions (built once per call) ------------------------------
def stream_positions(attention_mask_BT, offset_B=None):
  """Positions of the real tokens (cumsum(mask) - 1 + offset), -1 for pads."""
  pos_BT = jnp.cumsum(attention_mask_BT.astype(jnp.int32), axis=1) - 1
  if offset_B is not None:
    pos_BT = pos_BT + offset_B[:, None]
  return jnp.where(attention_mask_BT, pos_BT, cache_lib.EMPTY)


def _causal(q_pos_BT, k_pos_BS, config: ModelConfig):
  """[B, T, S]: key exists, is not in the future, and is inside the model's
  own sliding window (if any). With a scoped decode step's q_pos [B, 1, 1]
  and positions [L, B, K', S]: [L, B, K', 1, S]."""
  if k_pos_BS.ndim == 4:
    q, k = q_pos_BT[None, :, :, :, None], k_pos_BS[:, :, :, None, :]
  else:
    q, k = q_pos_BT[:, :, None], k_pos_BS[:, None, :]
  ok = (k >= 0) & (q >= 0) & (k <= q)
  if config.sliding_window:
    ok &= k > q - config.sliding_window
  return ok


def _rope(config: ModelConfig, pos):
  return rope_tables(config, jnp.maximum(pos, 0))


def forward_step(config: ModelConfig, attention_mask_BT) -> Step:
  q_pos = stream_positions(attention_mask_BT)
  cos, sin = _rope(config, q_pos)
  return Step(q_pos=q_pos, mask=_causal(q_pos, q_pos, config), cos_q=cos,
              sin_q=sin, mode="forward")


def prefill_step(config: ModelConfig, attention_mask_BT, cache) -> Step:
  """Positions start at 0; the cache is taken as empty."""
  policy, S = cache.policy, cache.capacity
  q_pos = stream_positions(attention_mask_BT)
  total_B = jnp.sum(attention_mask_BT, axis=1)
  mask = _causal(q_pos, q_pos, config)
  mask &= cache_lib.visible(policy, S, q_pos[:, :, None], q_pos[:, None, :])
  keep = (q_pos >= 0) & cache_lib.kept_after(policy, S, q_pos,
                                             total_B[:, None])
  slots = jnp.where(keep, cache_lib.slot_of(policy, S, q_pos), S)
  cos, sin = _rope(config, q_pos)
  check_scores_available(config, policy)
  return Step(q_pos=q_pos, mask=mask, cos_q=cos, sin_q=sin,
              slots=slots.astype(jnp.int32), mode="prefill",
              want_scores=policy.scored)


def extend_step(config: ModelConfig, attention_mask_BT, cache) -> Step:
  """Positions continue from `cache.length`; keys = cache ++ new tokens."""
  policy, S = cache.policy, cache.capacity
  q_pos = stream_positions(attention_mask_BT, cache.length)
  total_B = cache.length + jnp.sum(attention_mask_BT, axis=1)
  k_pos = jnp.concatenate([cache.positions, q_pos], axis=1)
  mask = _causal(q_pos, k_pos, config)
  mask &= cache_lib.visible(policy, S, q_pos[:, :, None], k_pos[:, None, :])
  keep = (q_pos >= 0) & cache_lib.kept_after(policy, S, q_pos,
                                             total_B[:, None])
  slots = jnp.where(keep, cache_lib.slot_of(policy, S, q_pos), S)
  cos, sin = _rope(config, q_pos)
  return Step(q_pos=q_pos, mask=mask, cos_q=cos, sin_q=sin,
              slots=slots.astype(jnp.int32), mode="extend")


def check_scores_available(config: ModelConfig, policy) -> None:
  """Raises ValueError when a policy needs attention probabilities that the
  configured attention implementation does not return (fused kernels):
  its scores would silently be zeros."""
  if policy.evictor.needs == "attention" and config.attention_impl in (
      "jax_nn", "cudnn"):
    raise ValueError(
        f"eviction {policy.eviction!r} scores slots by attention "
        f"probabilities, which attention_impl={config.attention_impl!r} "
        "does not return; use attention_impl='einsum' or a policy that "
        "needs no probabilities (knorm, window, sinks)")


def decode_slots(cache):
  """Slot the next token of each sequence is written to: [B], or
  [L, B, K'] for a scoped policy (every layer / head its own)."""
  policy, S = cache.policy, cache.capacity
  ev = policy.evictor
  if ev.closed_form:
    return cache_lib.slot_of(policy, S, cache.length)
  if cache.positions.ndim == 4:  # [L, B, K', S]
    return ev.victims(cache.scores, cache.positions,
                      cache.length[None, :, None], cache.budget)
  return ev.victims(cache.scores, cache.positions, cache.length,
                    jnp.full_like(cache.length, S))


def commit_positions(cache, q_pos_BT, slots_BT, new_length_B,
                     reset_scores: bool = True):
  """Records which position each written slot now holds, and the lengths.

  slots_BT may be a scoped decode step's [L, B, K'] (T = 1)."""
  if slots_BT.ndim == 3:  # scoped decode: every layer / head its own slot
    L, B, Kp = slots_BT.shape
    l_, b_, k_ = jnp.meshgrid(jnp.arange(L), jnp.arange(B), jnp.arange(Kp),
                              indexing="ij")
    q_LBK = jnp.broadcast_to(q_pos_BT[:, 0][None, :, None], (L, B, Kp))
    new = dict(positions=cache.positions.at[l_, b_, k_, slots_BT].set(q_LBK),
               length=new_length_B.astype(jnp.int32))
    if reset_scores:
      new["scores"] = cache.scores.at[l_, b_, k_, slots_BT].set(0.0)
    return cache.replace(**new)
  B, T = slots_BT.shape
  b_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  positions = cache.positions.at[b_BT, slots_BT].set(q_pos_BT, mode="drop")
  new = dict(positions=positions, length=new_length_B.astype(jnp.int32))
  if cache.scores is not None and reset_scores:
    # A slot that changes hands starts accumulating from zero.
    new["scores"] = cache.scores.at[b_BT, slots_BT].set(0.0, mode="drop")
  return cache.replace(**new)


def decode_rope(config: ModelConfig, cache):
  """cos, sin [B, 1, R/2] rotating the next decode query (position
  `cache.length`); None in `cache` position mode (rotations by rank).

  Why a decode loop carries these instead of letting each step compute
  them: XLA fuses the cos/sin of a step into every consumer, so each
  layer's q and k rotations re-evaluate them per element (24 fusions per
  step for medium), and a blocked decode cache repeats the query per key
  block (`kvjax.blocked`). Carried, they are loop inputs, computed once.
  """
  if cache.policy.positions == "cache":
    return None
  return _rope(config, cache.length[:, None])


def decode_step_info(config: ModelConfig, cache, attend: int = 0,
                     rope=None):
  """The decode Step and the cache with the new token's slot committed.

  attend > 0: attend over the first `attend` slots only; the caller
  guarantees that every filled slot (the new token's included) lies there,
  which needs eviction 'none' (filled slots are a prefix) and
  positions 'original' (see `Step.attend`).
  rope: `decode_rope(config, cache)` computed by the caller (a decode loop
  carries it), or None to compute it here.
  """
  S = cache.capacity
  if attend:
    policy = cache.policy
    if policy.eviction != "none" or policy.positions != "original":
      raise ValueError(
          f"attend={attend} needs eviction='none' and positions='original' "
          f"(got {policy.eviction!r}, {policy.positions!r}): only then are "
          "the filled slots a prefix")
    if not 0 < attend <= S:
      raise ValueError(f"attend={attend} must be in (0, capacity={S}]")
  check_scores_available(config, cache.policy)
  q_pos_B = cache.length
  slots = decode_slots(cache).astype(jnp.int32)
  scoped = slots.ndim == 3
  cache = commit_positions(cache, q_pos_B[:, None],
                           slots if scoped else slots[:, None],
                           cache.length + 1)
  if cache.scores is not None and not cache.policy.evictor.accumulate:
    # Scores are this step's observation only (TOVA, Knorm).
    cache = cache.replace(scores=jnp.zeros_like(cache.scores))
  if scoped:  # [L, B, K', 1, S]: every layer / head its own cached tokens
    mask = _causal(q_pos_B[:, None, None], cache.positions, config)
    slots_B = slots
  else:
    mask = _causal(q_pos_B[:, None], cache.positions[:, :attend or S],
                   config)
    slots_B = slots
  if cache.policy.positions == "cache":
    ranks_BS = cache_lib.cache_ranks(cache, cache.length)
    cos_k, sin_k = _rope(config, ranks_BS)
    q_rank_B = jnp.take_along_axis(ranks_BS, slots_B[:, None], axis=1)
    cos_q, sin_q = _rope(config, q_rank_B)
  else:
    cos_k = sin_k = None
    cos_q, sin_q = rope if rope is not None else _rope(config,
                                                       q_pos_B[:, None])
  return Step(q_pos=q_pos_B[:, None], mask=mask, cos_q=cos_q, sin_q=sin_q,
              slots=slots_B if scoped else slots_B[:, None], cos_k=cos_k,
              sin_k=sin_k, mode="decode", want_scores=cache.policy.scored,
              attend=attend), cache


# ---- the four calls ---------------------------------------------------------
def _checked_logits(params, x_BTD, cache, config):
  """Logits of the rows of a step whose cache carries no error, NaN for the
  others; non-finite logits recorded (`kvjax.errors`)."""
  logits = unembed(params, x_BTD, config,
                   invalid_B=errors.poisoned_rows(cache))
  return logits, errors.flag_nonfinite(logits, cache)


def _input_errors(config, tokens_BT, attention_mask_BT, cache, total_B,
                  prompt: bool, allow_empty: bool):
  """[B] error bits of a prefill / extend chunk (`kvjax.errors`): ids out of
  range, a mask that is not left padding (or, unless `allow_empty`, has no
  token), more tokens than the cache holds (eviction 'none'; for a prompt
  also global scored policies and cache-position mode, whose prefill needs
  the whole prompt in the cache; scoped policies compress it)."""
  bits = (errors.token_errors(tokens_BT, config.vocab_size,
                              attention_mask_BT) |
          errors.mask_errors(attention_mask_BT, allow_empty) |
          errors.overflow_errors(cache.policy, cache.capacity, total_B))
  policy = cache.policy
  if prompt and (policy.positions == "cache" or
                 (policy.scored and not policy.scoped)):
    bits |= jnp.where(total_B > cache.capacity, errors.OVERFLOW, 0)
  return bits


def forward_logits(params, config: ModelConfig, tokens_BT, attention_mask_BT):
  """No-cache causal forward. Returns logits [B, T, V] (float32)."""
  step = forward_step(config, attention_mask_BT)
  x_BTD, _ = run_layers(params, embed(params, tokens_BT, config), step, None,
                        config)
  return unembed(params, x_BTD, config)


def prefill_logits(params, config, tokens_BT, attention_mask_BT, cache,
                   all_logits: bool, first_chunk: bool = False):
  """Prefill into a fresh cache. Returns (logits, new_cache).

  first_chunk: the tokens are the first chunk of a longer left-padded
  prompt (`prefill_chunked`), so a row may hold padding only.
  """
  step = prefill_step(config, attention_mask_BT, cache)
  if cache.scores is not None:
    cache = cache.replace(scores=jnp.zeros_like(cache.scores))
  if cache.budget is not None:  # the policy's budgets, before any allotment
    L, B, Kp, S = cache.positions.shape
    budget = cache.policy.evictor.budgets(L, Kp, S)
    cache = cache.replace(budget=jnp.broadcast_to(
        jnp.asarray(budget, jnp.int32)[:, None], (L, B, Kp)))
  if cache.policy.scoped:  # each layer writes what it keeps
    cache = cache.replace(
        positions=jnp.full_like(cache.positions, cache_lib.EMPTY))
  x_BTD, cache = run_layers(params, embed(params, tokens_BT, config), step,
                            cache, config)
  total_B = jnp.sum(attention_mask_BT, axis=1)
  if cache.policy.scoped:
    cache = cache.replace(length=total_B.astype(jnp.int32))
  else:
    empty = jnp.full_like(cache.positions, cache_lib.EMPTY)
    cache = cache.replace(positions=empty)
    # Prefill scores were accumulated by the layers: keep them.
    cache = commit_positions(cache, step.q_pos, step.slots, total_B,
                             reset_scores=False)
  cache = errors.record(cache, _input_errors(
      config, tokens_BT, attention_mask_BT, cache, total_B, prompt=True,
      allow_empty=first_chunk))
  if not all_logits:
    x_BTD = x_BTD[:, -1:]
  return _checked_logits(params, x_BTD, cache, config)


def extend_logits(params, config, tokens_BT, attention_mask_BT, cache,
                  all_logits: bool):
  """Appends a chunk to a non-empty cache. Returns (logits, new_cache)."""
  step = extend_step(config, attention_mask_BT, cache)
  x_BTD, cache = run_layers(params, embed(params, tokens_BT, config), step,
                            cache, config)
  total_B = cache.length + jnp.sum(attention_mask_BT, axis=1)
  cache = commit_positions(cache, step.q_pos, step.slots, total_B)
  cache = errors.record(cache, _input_errors(
      config, tokens_BT, attention_mask_BT, cache, total_B, prompt=False,
      allow_empty=True))
  if not all_logits:
    x_BTD = x_BTD[:, -1:]
  return _checked_logits(params, x_BTD, cache, config)


def decode_logits(params, config, token_B, cache, attend: int = 0,
                  rope=None):
  """One token per sequence. Returns (logits [B, V], new_cache).
  attend, rope: see `decode_step_info`."""
  bits_B = (errors.token_errors(token_B, config.vocab_size) |
            errors.overflow_errors(cache.policy, cache.capacity,
                                   cache.length + 1))
  step, cache = decode_step_info(config, cache, attend, rope)
  x_BTD, cache = run_layers(params, embed(params, token_B[:, None], config),
                            step, cache, config)
  logits_B1V, cache = _checked_logits(params, x_BTD,
                                      errors.record(cache, bits_B), config)
  return logits_B1V[:, 0], cache
