"""Packed decode params: fused projections, weights stored [out, in].

`pack(params, config)` returns the same model laid out for memory-bound
decode: layers unrolled into a tuple (`_unstack_layers`), q/k/v fused
into one weight and gate/up into another (one product reads one contiguous
array: fewer, larger dots), and every fused dense weight stored [out, in]
and applied by `layers.linear_t`. Values are unchanged (tests: logits and
tokens equal the canonical params for every variant); only the bytes'
order and the number of dots differ.

  canonical ([in, out])             packed ([out, in])
  attn q [D,N,H], k, v [D,K,H]  ->  attn qkv_t [(N + 2K)·H, D]
  attn o [N,H,D]                ->  attn o_t [D, N·H]
  mlp gate, up [D,F]            ->  mlp gate_up_t [2F, D]
  mlp down [F,D]                ->  mlp down_t [D, F]
  lm_head [D,V]                 ->  lm_head_t [V, D]

  MLA: q [D,N,J]                ->  attn q_t [N·J, D]
       (q_a [D,Q], q_b [Q,N,J]  ->  attn q_a_t [Q, D], q_b_t [N·J, Q])
       kv_a [D,C+R]             ->  attn kv_a_t [C+R, D]
       w_uk [C,N,P]             ->  attn w_uk_t [N, C, P] (per head [out, in])
       w_uv [C,N,V]             ->  attn w_uv_t [N, V, C]
       o [N,V,D]                ->  attn o_t [D, N·V]

Biases, norms and the embedding are kept. MoE experts keep their canonical
form (a decode step reads a few of them); their dense MLPs and the LM head
are packed.

Why: on XLA's CPU backend the weight products are ~90% of a batch-1
decode step, at 24 GB/s for `x @ W` on [in, out] weights against 32 GB/s
for the packed `W @ x`; at batch 8 the skinny GEMMs are 1.3x faster with
the weight on the left. Medium decode: +15-20% tokens/s over the unrolled
layout at batch 1 and 8 in the peer benchmark (WORKSPACE.md). Canonical
MLA weights made XLA transpose W_UK and W_UV on every decode step; packed
MLA decodes 16% (batch 1) / 11% (batch 8) faster. Which layout wins is
measured per size (experiments/decode_layout.py), and the inference entry
points choose it themselves: `for_decode` packs canonical params once (the
default path is the fast path; no flag). Training and checkpoints use the
canonical layout.
"""

from __future__ import annotations

import contextlib
import weakref

import jax
import jax.numpy as jnp

from kvjax.config import ModelConfig

PACKED_ATTENTION = ("qkv_t", "o_t")  # o_t: MLA's too
PACKED_MLP = ("gate_up_t", "down_t")


def _layer_stacks(params):
  return [name for name in ("layers", "moe_layers") if name in params]


def is_packed(params) -> bool:
  """True when any weight is in the packed form (every packed model has
  `o_t` in its attention)."""
  if "lm_head_t" in params:
    return True
  for name in _layer_stacks(params):
    stack = params[name]
    if isinstance(stack, (list, tuple)) and stack and (
        any(k in stack[0]["attn"] for k in PACKED_ATTENTION) or
        any(k in stack[0]["mlp"] for k in PACKED_MLP)):
      return True
  return False


def _pack_mla(p_attn, config: ModelConfig):
  N = config.num_heads
  out = {k: v for k, v in p_attn.items()
         if k not in ("q", "q_a", "q_b", "kv_a", "w_uk", "w_uv", "o")}
  if "q" in p_attn:
    out["q_t"] = p_attn["q"].reshape(config.embed_dim, -1).T
  else:
    out["q_a_t"] = p_attn["q_a"].T
    out["q_b_t"] = p_attn["q_b"].reshape(config.q_lora_rank, -1).T
  out["kv_a_t"] = p_attn["kv_a"].T
  out["w_uk_t"] = jnp.transpose(p_attn["w_uk"], (1, 0, 2))  # [N, C, P]
  out["w_uv_t"] = jnp.transpose(p_attn["w_uv"], (1, 2, 0))  # [N, V, C]
  out["o_t"] = p_attn["o"].reshape(N * config.v_head_dim, -1).T
  return out


def _pack_attention(p_attn, config: ModelConfig):
  if config.attention == "mla":
    return _pack_mla(p_attn, config)
  D = config.embed_dim
  qkv_DX = jnp.concatenate([p_attn["q"].reshape(D, -1),
                            p_attn["k"].reshape(D, -1),
                            p_attn["v"].reshape(D, -1)], axis=1)
  out = {k: v for k, v in p_attn.items() if k not in ("q", "k", "v", "o")}
  out["qkv_t"] = qkv_DX.T
  out["o_t"] = p_attn["o"].reshape(-1, D).T
  return out


def _pack_mlp(p_mlp):
  if "router" in p_mlp:  # MoE experts: kept canonical
    return p_mlp
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
  for name in _layer_stacks(params):
    stack = params[name]
    depth = jax.tree_util.tree_leaves(stack)[0].shape[0]
    out[name] = tuple(jax.tree_util.tree_map(lambda w, i=i: w[i], stack)
                      for i in range(depth))
  return out


def pack(params, config: ModelConfig):
  """The packed decode layout of canonical `params` (see the module
  docstring). Copies every packed weight once (eagerly, outside jit: drop
  the canonical params afterwards to free their memory).

  Raises:
    ValueError: params already packed, or not matching `config`.
  """
  from kvjax import model  # pylint: disable=g-import-not-at-top
  if is_packed(params):
    raise ValueError("params are already packed (kvjax.packed.pack)")
  model.check_params(params, config)
  out = _unstack_layers(params)
  for name in _layer_stacks(out):
    out[name] = tuple(
        dict(p, attn=_pack_attention(p["attn"], config),
             mlp=_pack_mlp(p["mlp"]))
        for p in out[name])
  if "lm_head" in out:
    out["lm_head_t"] = out.pop("lm_head").T
  # Eager transposes are new row-major arrays: decode reads them in place.
  return out


# ---- the decode seam ---------------------------------------------------------
# The narrowest model measured to decode faster packed (gqa-small, D 256:
# 1.62x at batch 1, 1.33x at batch 8; gqa-medium 1.46x at batch 1; Intel
# Xeon, experiments/decode_layout.py, WORKSPACE.md "Params layout").
# Narrower models (the D 64 test presets) keep the layer scan: unmeasured,
# and their tests then exercise both layouts.
PACK_MIN_WIDTH = 256

# Canonical params packed by `for_decode`, keyed by the ids of their leaves:
# (weak references to those leaves, config, packed params). An entry dies
# with any of its canonical arrays.
_PACKED: dict[tuple[int, ...], tuple] = {}
_AS_GIVEN = [False]


@contextlib.contextmanager
def as_given():
  """Inside, `for_decode` returns params unchanged: for measuring the
  canonical layout against the packed one (experiments/decode_layout.py);
  nothing else should need it."""
  _AS_GIVEN.append(True)
  try:
    yield
  finally:
    _AS_GIVEN.pop()


def packs(params, config: ModelConfig) -> bool:
  """Whether `for_decode` packs these params: canonical stacked layers,
  concrete arrays (not tracers: packing inside a trace would transpose every
  weight on every call), on CPU, where packing was measured (elsewhere the
  layout is kept until a device run measures it), at embed_dim >=
  PACK_MIN_WIDTH."""
  if _AS_GIVEN[-1] or is_packed(params):
    return False
  leaves = jax.tree_util.tree_leaves(params)
  if any(isinstance(x, jax.core.Tracer) for x in leaves):
    return False
  leaf = leaves[0]
  platform = (next(iter(leaf.devices())).platform
              if isinstance(leaf, jax.Array) else jax.default_backend())
  return platform == "cpu" and config.embed_dim >= PACK_MIN_WIDTH


def for_decode(params, config: ModelConfig):
  """The params every inference entry point runs on (`generate`, `prefill`,
  `extend`, `decode_step`, the streaming drivers): `pack(params, config)`
  where `packs` says it decodes faster, else `params` as given. Same
  values either way (tests).

  Packed once per params: the packed copy is kept while the canonical
  arrays live (both are then in memory; call `kvjax.pack` yourself and
  drop the canonical params to hold one copy).
  """
  if not packs(params, config):
    return params
  leaves = jax.tree_util.tree_leaves(params)
  key = tuple(map(id, leaves))
  hit = _PACKED.get(key)
  if hit is not None:
    refs, cfg, out = hit
    if cfg == config and all(r() is x for r, x in zip(refs, leaves)):
      return out
  out = pack(params, config)
  drop = lambda _, key=key: _PACKED.pop(key, None)
  _PACKED[key] = (tuple(weakref.ref(x, drop) for x in leaves), config, out)
  return out
