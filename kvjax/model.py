"""The decoder: one block, the layer scan, and the four ways of calling it
(no-cache forward, prefill, extend, decode step).

Every function here takes both params layouts (`kvjax.params`: the
canonical stacked [in, out] weights and their packed decode layout); the
weight products that differ between them are `kvjax.projections`. Layer
stacks (`params.stacks`) run by `jax.lax.scan`, so compile time does not
grow with depth, or unrolled when the layout holds a tuple of per-layer
dicts (the packed layout). DeepSeek models with dense layers below MoE
layers have two stacks ('layers', then 'moe_layers'), run one after the
other over the same cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import cache as cache_lib
from kvjax import errors
from kvjax import flash
from kvjax import moe as moe_lib
from kvjax import params as params_lib
from kvjax import projections
from kvjax.attention import Step, gqa_attention
from kvjax.config import ModelConfig
from kvjax.layers import rms_norm, rope_tables
from kvjax.mla import mla_attention


# ---- the block and the layer scan -------------------------------------------
def block(p, x_BTD, step: Step, cache, layer, config: ModelConfig, *,
          moe: bool):
  """One pre-norm decoder block; `moe`: its MLP is an MoE layer
  (`kvjax.moe`). Returns (x_BTD, new_cache)."""
  attn_fn = mla_attention if config.attention == "mla" else gqa_attention
  dtype = config.dtype
  p = jax.tree_util.tree_map(lambda w: w.astype(dtype), p)
  with jax.named_scope("attention"):
    h_BTD = rms_norm(x_BTD, p["attn_norm"], config.rms_norm_eps)
    a_BTD, cache = attn_fn(p["attn"], h_BTD, step, cache, layer, config)
    x_BTD = x_BTD + a_BTD
  with jax.named_scope("mlp"):
    h_BTD = rms_norm(x_BTD, p["mlp_norm"], config.rms_norm_eps)
    if moe:
      y_BTD = moe_lib.moe_mlp(p["mlp"], h_BTD, config)
    else:
      y_BTD = projections.mlp(p["mlp"], h_BTD)
    x_BTD = x_BTD + y_BTD
  return x_BTD, cache


def run_layers(params, x_BTD, step: Step, cache, config: ModelConfig):
  """Scans every layer stack over (x, cache); a tuple stack (the decode
  layout, `kvjax.params.pack`) is unrolled instead. Returns
  (x_BTD, new_cache)."""
  start = 0
  for name, depth, moe in params_lib.stacks(config):
    stack = params[name]
    if isinstance(stack, (list, tuple)):
      for p in stack:  # static layer index: static cache slices
        x_BTD, cache = block(p, x_BTD, step, cache, start, config, moe=moe)
        start += 1
      continue

    def body(carry, xs, moe=moe):
      x_BTD, cache = carry
      p, layer = xs
      return block(p, x_BTD, step, cache, layer, config, moe=moe), None

    layer_ids = jnp.arange(start, start + depth, dtype=jnp.int32)
    (x_BTD, cache), _ = jax.lax.scan(body, (x_BTD, cache), (stack, layer_ids))
    start += depth
  return x_BTD, cache


def embed(params, tokens_BT, config: ModelConfig):
  return params["embed"][tokens_BT].astype(config.dtype)


def unembed(params, x_BTD, config: ModelConfig, invalid_B=None):
  """Final norm and LM head; float32 logits [B, T, V] (NaN rows where
  `invalid_B` [B] is True: `kvjax.errors`)."""
  x_BTD = rms_norm(x_BTD, params["final_norm"].astype(config.dtype),
                   config.rms_norm_eps, invalid_B=invalid_B)
  return projections.lm_head(params, x_BTD, config)


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
  visibility = flash.Visibility(config.sliding_window, policy, S)
  mask = visibility.mask(q_pos, q_pos)
  keep = (q_pos >= 0) & cache_lib.kept_after(policy, S, q_pos,
                                             total_B[:, None])
  slots = jnp.where(keep, cache_lib.slot_of(policy, S, q_pos), S)
  cos, sin = _rope(config, q_pos)
  check_scores_available(config, policy)
  return Step(q_pos=q_pos, mask=mask, cos_q=cos, sin_q=sin,
              slots=slots.astype(jnp.int32), k_pos=q_pos,
              visibility=visibility, mode="prefill",
              want_scores=policy.scored)


def extend_step(config: ModelConfig, attention_mask_BT, cache) -> Step:
  """Positions continue from `cache.length`; keys = cache ++ new tokens."""
  policy, S = cache.policy, cache.capacity
  q_pos = stream_positions(attention_mask_BT, cache.length)
  total_B = cache.length + jnp.sum(attention_mask_BT, axis=1)
  k_pos = jnp.concatenate([cache.positions, q_pos], axis=1)
  visibility = flash.Visibility(config.sliding_window, policy, S)
  mask = visibility.mask(q_pos, k_pos)
  keep = (q_pos >= 0) & cache_lib.kept_after(policy, S, q_pos,
                                             total_B[:, None])
  slots = jnp.where(keep, cache_lib.slot_of(policy, S, q_pos), S)
  cos, sin = _rope(config, q_pos)
  return Step(q_pos=q_pos, mask=mask, cos_q=cos, sin_q=sin,
              slots=slots.astype(jnp.int32), k_pos=k_pos,
              visibility=visibility, mode="extend")


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
