"""Hugging Face checkpoints -> kvjax (`ModelConfig`, params).

`load_checkpoint(path)` reads a checkpoint directory (`config.json` and
`*.safetensors`, one file or shards listed in `model.safetensors.index.json`)
of the families in `SUPPORTED_MODEL_TYPES` and returns the kvjax config and
params pytree (layout in `kvjax.model`). The reference for every rule below
is transformers' own modelling code; the parity tests compare against it.

Safety: tensors are read with the `safetensors` library only. Pickle-based
files (`*.bin`, `*.pt`, ...) are refused: unpickling runs arbitrary code.

Validation happens before any tensor data is read: missing and unexpected
tensors are reported by name, and each tensor's shape and dtype is checked
against what config.json implies. Nothing half-loaded is ever returned: any
problem raises `ValueError` naming the file and the tensor.

Layout conversion (once, at load): HF linear weights are `[out, in]`; kvjax
stores `[in, out]` with heads split out (q `[D, N, H]`, o `[N, H, D]`, ...).
DeepSeek's `kv_b_proj [N·(P+O), C]` is split into `w_uk [C, N, P]` and
`w_uv [C, N, O]`; routed experts are stacked on an E axis.

config.json: both the transformers-5 format (`rope_parameters`, `dtype`) and
the older Hub format (top-level `rope_theta`, `rope_scaling` with `type` or
`rope_type`, `torch_dtype`) are read. Defaults for absent keys are those of
the transformers config classes.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
from typing import Any, Callable, Mapping

from absl import logging
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors

from kvjax import params as params_lib
from kvjax.config import ModelConfig, MoEConfig, RopeScaling
from kvjax.validate import check_bool, check_float, check_int

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "deepseek_v2",
                         "deepseek_v3")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype tag -> kvjax dtype name.
FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16,
              "float16": np.float16}
_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16",
                 "float16": "float16", "torch.float32": "float32",
                 "torch.bfloat16": "bfloat16", "torch.float16": "float16"}

# transformers' config-class defaults for keys a config.json may omit.
_DEFAULT_KV_HEADS = {"mistral": 8, "qwen2": 32, "deepseek_v3": 128}
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32,
                          "qwen2": 32768, "deepseek_v2": 2048,
                          "deepseek_v3": 4096}
_DEEPSEEK_DEFAULTS = {
    "deepseek_v2": dict(first_k_dense_replace=0, kv_lora_rank=512,
                        q_lora_rank=1536, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128,
                        n_routed_experts=64, n_shared_experts=2,
                        moe_intermediate_size=1407, num_experts_per_tok=None,
                        routed_scaling_factor=1.0, n_group=None,
                        topk_group=None, topk_method="greedy"),
    "deepseek_v3": dict(first_k_dense_replace=3, kv_lora_rank=512,
                        q_lora_rank=1536, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128,
                        n_routed_experts=256, n_shared_experts=1,
                        moe_intermediate_size=2048, num_experts_per_tok=8,
                        routed_scaling_factor=2.5, n_group=8, topk_group=4,
                        norm_topk_prob=True, rope_interleave=True),
}
# Tensors that carry no weights kvjax needs (recomputed rotary tables).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


# ---- config.json -> ModelConfig --------------------------------------------
_REQUIRED = object()  # the default of a key config.json must hold


def _require(hf: Mapping[str, Any], key: str, where: str = "config.json"):
  if hf.get(key) is None:
    needs = (f" (model_type {hf['model_type']!r} needs it)"
             if "model_type" in hf else "")
    raise ValueError(f"{where} has no {key!r}{needs}")
  return hf[key]


def _name(where: str, key: str) -> str:
  """How errors name a key: 'config.json vocab_size' at the top level,
  'config.json rope_parameters.factor' inside a section."""
  return f"config.json {key}" if where == "config.json" else f"{where}.{key}"


def _int(m: Mapping[str, Any], key: str, default=_REQUIRED, *,
         minimum: int = 1, where: str = "config.json") -> int:
  """m[key] as an int >= minimum; `default` when absent or null (as
  transformers' config classes read them). Never `int(x)`: that would
  truncate a hidden_size of 32.9 and read true as 1."""
  if m.get(key) is None and default is not _REQUIRED:
    return default
  return check_int(_name(where, key), _require(m, key, where), minimum)


def _float(m: Mapping[str, Any], key: str, default=_REQUIRED, *,
           minimum: float = 0.0, strict: bool = True,
           where: str = "config.json") -> float:
  """m[key] as a finite float > minimum (>= unless `strict`); `default` when
  absent or null. JSON's NaN and Infinity, which Python's json module
  reads, are refused by name."""
  if m.get(key) is None and default is not _REQUIRED:
    return default
  return check_float(_name(where, key), _require(m, key, where), minimum,
                     strict=strict)


def _bool(m: Mapping[str, Any], key: str, default: bool, *,
          where: str = "config.json") -> bool:
  """m[key] as a bool (not its truthiness: the string "false" is truthy);
  `default` when absent or null."""
  if m.get(key) is None:
    return default
  return check_bool(_name(where, key), m[key])


def _rope_from_hf(hf: Mapping[str, Any],
                  max_pos: int) -> tuple[float, RopeScaling]:
  """rope_theta and RopeScaling from either config.json format.

  As transformers: a legacy `rope_scaling` wins over `rope_parameters`;
  `rope_theta` inside the dict wins over the top-level key. `max_pos` is
  the (validated) max_position_embeddings.
  """
  section = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  rp = hf.get(section) or {}
  if not isinstance(rp, Mapping):
    raise ValueError(f"config.json rope_scaling/rope_parameters must be a "
                     f"mapping, got {rp!r}")
  if any(isinstance(v, Mapping) for v in rp.values()):
    raise ValueError("config.json has per-layer-type rope_parameters "
                     f"({sorted(rp)}); kvjax supports one RoPE for all layers")
  w = f"config.json {section}"
  theta = _float(rp, "rope_theta", None, where=w)
  if theta is None:
    theta = _float(hf, "rope_theta", 10000.0)
  kind = rp.get("rope_type", rp.get("type", "default"))
  partial = _float(rp, "partial_rotary_factor", None, where=w)
  if partial is None:
    partial = _float(hf, "partial_rotary_factor", 1.0)
  if partial != 1.0:
    raise ValueError(f"config.json partial_rotary_factor={partial} is not "
                     "supported (kvjax rotates the whole rope dim)")
  key = "original_max_position_embeddings"
  if hf.get(key) is not None:
    original = _int(hf, key)
  else:
    original = _int(rp, key, max_pos, where=w)
  if kind == "default":
    return theta, RopeScaling()
  if kind in ("linear", "dynamic"):
    # `dynamic` (NTK) recomputes frequencies only for positions beyond
    # max_position_embeddings; inside that range it is the default RoPE,
    # which is what kvjax's static tables compute.
    return theta, RopeScaling(kind=kind, factor=_float(rp, "factor", where=w))
  if kind == "llama3":
    return theta, RopeScaling(
        kind="llama3", factor=_float(rp, "factor", where=w),
        original_max_position=original,
        low_freq_factor=_float(rp, "low_freq_factor", where=w),
        high_freq_factor=_float(rp, "high_freq_factor", where=w))
  if kind == "yarn":
    if rp.get("truncate", True) is not True:
      raise ValueError("config.json yarn truncate=false is not supported")
    # `original` >= 1 here: the division cannot fail.
    factor = _float(rp, "factor", max_pos / original, where=w)
    # As transformers, 0 reads as absent (`x or default`) for these four.
    nonneg = dict(minimum=0.0, strict=False, where=w)
    return theta, RopeScaling(
        kind="yarn", factor=factor, original_max_position=original,
        beta_fast=_float(rp, "beta_fast", 0.0, **nonneg) or 32.0,
        beta_slow=_float(rp, "beta_slow", 0.0, **nonneg) or 1.0,
        # A missing mscale must stay falsy: transformers then uses
        # get_mscale(factor), not the mscale / mscale_all_dim ratio.
        mscale=_float(rp, "mscale", 0.0, **nonneg),
        mscale_all_dim=_float(rp, "mscale_all_dim", 0.0, **nonneg),
        attention_factor=_float(rp, "attention_factor", None, where=w))
  raise ValueError(f"config.json rope type {kind!r} is not supported; "
                   "supported: default, linear, dynamic, llama3, yarn")


def _window(hf: Mapping[str, Any]) -> int:
  # The config classes' default is 4096 when the key is absent; null = off.
  if "sliding_window" not in hf:
    return 4096
  return _int(hf, "sliding_window", 0, minimum=0)


def _sliding_window(hf: Mapping[str, Any], num_layers: int) -> int:
  """The model's own attention window (0 = full), family rules as in
  transformers."""
  mt = hf["model_type"]
  if mt == "mistral":
    return _window(hf)
  if mt != "qwen2" or not _bool(hf, "use_sliding_window", False):
    return 0
  window = _window(hf)
  if not window:
    return 0
  layer_types = hf.get("layer_types")
  if layer_types is None:
    first = _int(hf, "max_window_layers", 28, minimum=0)
    layer_types = ["sliding_attention" if i >= first else "full_attention"
                   for i in range(num_layers)]
  if not isinstance(layer_types, list):
    raise ValueError(f"config.json layer_types must be a list, got "
                     f"{layer_types!r}")
  sliding = {t == "sliding_attention" for t in layer_types[:num_layers]}
  if sliding == {True}:
    return window
  if sliding == {False}:
    return 0
  raise ValueError(
      "config.json mixes sliding-window and full-attention layers "
      f"(use_sliding_window with max_window_layers="
      f"{hf.get('max_window_layers')}, layer_types={layer_types}); kvjax "
      "applies one window to every layer")


def _check_unsupported(hf: Mapping[str, Any]):
  mt = hf["model_type"]
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json hidden_act={hf['hidden_act']!r} is not "
                     "supported (kvjax MLPs are SwiGLU / silu)")
  if hf.get("mlp_bias"):
    raise ValueError("config.json mlp_bias=true is not supported")
  if mt.startswith("deepseek") and hf.get("attention_bias"):
    raise ValueError("config.json attention_bias=true is not supported for "
                     f"{mt} (MLA projections carry no bias in kvjax)")
  if hf.get("quantization_config"):
    raise ValueError("quantized checkpoints (config.json "
                     "quantization_config) are not supported")


def config_from_hf(hf: Mapping[str, Any], *, param_dtype: str | None = None,
                   compute_dtype: str = "float32") -> ModelConfig:
  """Builds the kvjax config a Hugging Face config.json describes.

  Every number is checked (`kvjax.validate`) as it is read, before any
  arithmetic on it (head_dim = hidden_size // num_attention_heads, yarn's
  max_position / original), and the result goes through ModelConfig's own
  validation.

  Args:
    hf: the parsed config.json.
    param_dtype: dtype the params will be stored in; None = the checkpoint's
      own (`dtype` / `torch_dtype`, else float32).
    compute_dtype: activation dtype (a separate choice from the weights).
  Returns:
    A validated ModelConfig.
  Raises:
    ValueError naming the unsupported model type, key or feature, or the
    config.json key (or ModelConfig field) holding an invalid value: a
    float or bool for an int (never truncated), a count below 1, NaN,
    infinity or an out-of-range float.
  """
  if not isinstance(hf, Mapping):
    raise ValueError(f"config.json must hold a JSON object, got "
                     f"{type(hf).__name__}")
  mt = hf.get("model_type")
  if mt not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f"model_type {mt!r} is not supported; supported: "
                     f"{', '.join(SUPPORTED_MODEL_TYPES)}")
  _check_unsupported(hf)
  D = _int(hf, "hidden_size")
  N = _int(hf, "num_attention_heads")
  L = _int(hf, "num_hidden_layers")
  max_pos = _int(hf, "max_position_embeddings", _DEFAULT_MAX_POSITIONS[mt])
  theta, rope_scaling = _rope_from_hf(hf, max_pos)
  fields = dict(
      vocab_size=_int(hf, "vocab_size"), num_layers=L, embed_dim=D,
      num_heads=N, mlp_dim=_int(hf, "intermediate_size"),
      rope_theta=theta, rope_scaling=rope_scaling, max_seq_len=max_pos,
      rms_norm_eps=_float(hf, "rms_norm_eps", 1e-6, strict=False),
      tie_embeddings=_bool(hf, "tie_word_embeddings", False),
      param_dtype=param_dtype or checkpoint_dtype(hf) or "float32",
      compute_dtype=compute_dtype)
  if mt.startswith("deepseek"):
    fields.update(_deepseek_fields(hf, L, rope_scaling))
  else:
    # Absent: the config class's default; null: one kv head per query head.
    kv_heads = _DEFAULT_KV_HEADS.get(mt, N)
    if "num_key_value_heads" in hf:
      kv_heads = _int(hf, "num_key_value_heads", N)
    bias = _bool(hf, "attention_bias", False) if mt == "llama" else False
    fields.update(
        attention="gqa", num_kv_heads=kv_heads,
        # N >= 1 was checked above.
        head_dim_override=_int(hf, "head_dim", D // N), rope_layout="half",
        qkv_bias=bias or mt == "qwen2", o_bias=bias,
        sliding_window=_sliding_window(hf, L))
  return ModelConfig(**fields)


def _deepseek_fields(hf: Mapping[str, Any], L: int, rope_scaling: RopeScaling):
  mt = hf["model_type"]
  d = dict(_DEEPSEEK_DEFAULTS[mt])
  d.update({k: hf[k] for k in d if k in hf})
  # transformers' attribute aliases of n_routed_experts.
  for alias in ("num_experts", "num_local_experts"):
    if hf.get(alias) is not None and "n_routed_experts" not in hf:
      d["n_routed_experts"] = hf[alias]
  rp = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  if rope_scaling.kind != "yarn" and rp.get("mscale_all_dim"):
    raise ValueError("config.json mscale_all_dim with rope type "
                     f"{rope_scaling.kind!r} is not supported (only yarn)")
  if mt == "deepseek_v2":
    layout = "interleaved"
  else:
    layout = "interleaved" if _bool(d, "rope_interleave", True) else "half"
  first_dense = _int(d, "first_k_dense_replace", 0, minimum=0)
  moe = None
  if first_dense < L:
    for key in ("n_routed_experts", "num_experts_per_tok",
                "moe_intermediate_size"):
      if d.get(key) is None:
        raise ValueError(f"config.json has no {key!r} ({mt} MoE layers need "
                         "it)")
    if mt == "deepseek_v2":
      # transformers' V2 router: softmax scores, greedy or group-limited
      # greedy, never normalized (its norm_topk_prob is ignored).
      method = d.get("topk_method") or "greedy"
      if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"config.json topk_method={method!r} is not "
                         "supported for deepseek_v2 (greedy, "
                         "group_limited_greedy)")
      scoring, norm = "softmax", False
      if method == "greedy":
        groups = topk_groups = 1
      else:
        groups = _int(d, "n_group")
        topk_groups = _int(d, "topk_group")
    else:
      # transformers' V3 router: sigmoid scores, bias-corrected group top-k
      # (n_group / topk_group, whatever topk_method says).
      method, scoring = "noaux_tc", "sigmoid"
      norm = _bool(d, "norm_topk_prob", False)
      groups = _int(d, "n_group", 1)
      topk_groups = _int(d, "topk_group", 1)
    moe = MoEConfig(
        num_experts=_int(d, "n_routed_experts"),
        experts_per_token=_int(d, "num_experts_per_tok"),
        expert_dim=_int(d, "moe_intermediate_size"),
        num_shared_experts=_int(d, "n_shared_experts", 0, minimum=0),
        first_dense_layers=first_dense,
        routed_scaling_factor=_float(d, "routed_scaling_factor", 1.0),
        scoring=scoring, topk_method=method, num_groups=groups,
        topk_groups=topk_groups, norm_topk_prob=norm)
  return dict(
      attention="mla", num_kv_heads=1, kv_lora_rank=_int(d, "kv_lora_rank"),
      q_lora_rank=_int(d, "q_lora_rank", 0, minimum=0),
      qk_nope_head_dim=_int(d, "qk_nope_head_dim"),
      qk_rope_head_dim=_int(d, "qk_rope_head_dim"),
      v_head_dim=_int(d, "v_head_dim"), rope_layout=layout, moe=moe)


def checkpoint_dtype(hf: Mapping[str, Any]) -> str | None:
  """The weight dtype config.json declares (`dtype` or `torch_dtype`)."""
  raw = hf.get("dtype", hf.get("torch_dtype"))
  if raw is None:
    return None
  if str(raw) not in _TORCH_DTYPES:
    raise ValueError(f"config.json dtype {raw!r} is not supported; "
                     "supported: float32, bfloat16, float16")
  return _TORCH_DTYPES[str(raw)]


# ---- what tensors the config implies ---------------------------------------
@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One expected HF tensor: its shape and where its data goes in kvjax.

  put(array) -> {kvjax leaf path: value} where a path is
  (stack or None, layer index or None, expert index or None, *keys).
  """

  shape: tuple[int, ...]
  put: Callable[[np.ndarray], dict[tuple, np.ndarray]]


def _linear(where: tuple, shape: tuple[int, ...]) -> Callable:
  """HF [out, in] -> kvjax [in, ...] (transpose, then split the out axis)."""
  return lambda w: {where: w.T.reshape(shape)}


def _vector(where: tuple, shape: tuple[int, ...]) -> Callable:
  return lambda w: {where: w.reshape(shape)}


def _leaf_path(stack: str, layer: int) -> Callable[..., tuple]:
  """at(*keys, e=None) -> the kvjax leaf path of one layer (and expert)."""
  def at(*keys: str, e: int | None = None) -> tuple:
    return (stack, layer, e) + keys
  return at


def _tensor_plan(config: ModelConfig,
                 fused_experts: frozenset[int] = frozenset()
                 ) -> dict[str, _Tensor]:
  """HF tensor name -> `_Tensor`, for every tensor config.json implies.

  `fused_experts` lists the layers whose experts are stored as transformers'
  in-memory 3-D tensors (`experts.gate_up_proj [E, 2F, D]`,
  `experts.down_proj [E, D, F]`) instead of one tensor per expert.
  """
  D, V, N = config.embed_dim, config.vocab_size, config.num_heads
  plan = {
      "model.embed_tokens.weight": _Tensor(
          (V, D), _vector((None, None, None, "embed"), (V, D))),
      "model.norm.weight": _Tensor(
          (D,), _vector((None, None, None, "final_norm"), (D,))),
  }
  # With tied embeddings an lm_head may still be present (see load).
  plan["lm_head.weight"] = _Tensor(
      (V, D), _linear((None, None, None, "lm_head"), (D, V)))
  for i in range(config.num_layers):
    if i < config.num_dense_layers:
      stack, j = "layers", i
    else:
      stack, j = "moe_layers", i - config.num_dense_layers
    at = _leaf_path(stack, j)
    pre = f"model.layers.{i}."
    plan[pre + "input_layernorm.weight"] = _Tensor(
        (D,), _vector(at("attn_norm"), (D,)))
    plan[pre + "post_attention_layernorm.weight"] = _Tensor(
        (D,), _vector(at("mlp_norm"), (D,)))
    a = pre + "self_attn."
    if config.attention == "gqa":
      K, H = config.num_kv_heads, config.head_dim
      for name, heads in (("q", N), ("k", K), ("v", K)):
        plan[a + f"{name}_proj.weight"] = _Tensor(
            (heads * H, D), _linear(at("attn", name), (D, heads, H)))
        if config.qkv_bias:
          plan[a + f"{name}_proj.bias"] = _Tensor(
              (heads * H,), _vector(at("attn", f"{name}_bias"), (heads, H)))
      plan[a + "o_proj.weight"] = _Tensor((D, N * H),
                                          _linear(at("attn", "o"), (N, H, D)))
      if config.o_bias:
        plan[a + "o_proj.bias"] = _Tensor((D,),
                                          _vector(at("attn", "o_bias"), (D,)))
    else:
      C, R = config.kv_lora_rank, config.qk_rope_head_dim
      P, O, Q = (config.qk_nope_head_dim, config.v_head_dim,
                 config.q_lora_rank)
      if Q:
        plan[a + "q_a_proj.weight"] = _Tensor(
            (Q, D), _linear(at("attn", "q_a"), (D, Q)))
        plan[a + "q_a_layernorm.weight"] = _Tensor(
            (Q,), _vector(at("attn", "q_a_norm"), (Q,)))
        plan[a + "q_b_proj.weight"] = _Tensor(
            (N * (P + R), Q), _linear(at("attn", "q_b"), (Q, N, P + R)))
      else:
        plan[a + "q_proj.weight"] = _Tensor(
            (N * (P + R), D), _linear(at("attn", "q"), (D, N, P + R)))
      plan[a + "kv_a_proj_with_mqa.weight"] = _Tensor(
          (C + R, D), _linear(at("attn", "kv_a"), (D, C + R)))
      plan[a + "kv_a_layernorm.weight"] = _Tensor(
          (C,), _vector(at("attn", "kv_a_norm"), (C,)))

      def put_kv_b(w, at=at, C=C, P=P, O=O):
        # Per head the rows are [k_nope (P) | v (O)].
        kv_b = w.T.reshape(C, N, P + O)
        return {at("attn", "w_uk"): kv_b[..., :P],
                at("attn", "w_uv"): kv_b[..., P:]}

      plan[a + "kv_b_proj.weight"] = _Tensor((N * (P + O), C), put_kv_b)
      plan[a + "o_proj.weight"] = _Tensor(
          (D, N * O), _linear(at("attn", "o"), (N, O, D)))
    m = pre + "mlp."
    if stack == "layers":
      F = config.mlp_dim
      plan[m + "gate_proj.weight"] = _Tensor(
          (F, D), _linear(at("mlp", "gate"), (D, F)))
      plan[m + "up_proj.weight"] = _Tensor(
          (F, D), _linear(at("mlp", "up"), (D, F)))
      plan[m + "down_proj.weight"] = _Tensor(
          (D, F), _linear(at("mlp", "down"), (F, D)))
      continue
    moe = config.moe
    E, F = moe.num_experts, moe.expert_dim
    plan[m + "gate.weight"] = _Tensor(
        (E, D), _linear(at("mlp", "router"), (D, E)))
    if moe.topk_method == "noaux_tc":
      plan[m + "gate.e_score_correction_bias"] = _Tensor(
          (E,), _vector(at("mlp", "score_bias"), (E,)))
    if i in fused_experts:

      def put_gate_up(w, at=at, F=F):
        gate_up = np.swapaxes(w, 1, 2)  # [E, D, 2F]: gate then up
        return {at("mlp", "expert_gate"): gate_up[..., :F],
                at("mlp", "expert_up"): gate_up[..., F:]}

      plan[m + "experts.gate_up_proj"] = _Tensor((E, 2 * F, D), put_gate_up)
      plan[m + "experts.down_proj"] = _Tensor(
          (E, D, F),
          lambda w, at=at: {at("mlp", "expert_down"): np.swapaxes(w, 1, 2)})
    else:
      for e in range(E):
        x = m + f"experts.{e}."
        plan[x + "gate_proj.weight"] = _Tensor(
            (F, D), _linear(at("mlp", "expert_gate", e=e), (D, F)))
        plan[x + "up_proj.weight"] = _Tensor(
            (F, D), _linear(at("mlp", "expert_up", e=e), (D, F)))
        plan[x + "down_proj.weight"] = _Tensor(
            (D, F), _linear(at("mlp", "expert_down", e=e), (F, D)))
    if moe.num_shared_experts:
      Fp = F * moe.num_shared_experts  # F'
      for name, shape, dst in (("gate", (Fp, D), (D, Fp)),
                               ("up", (Fp, D), (D, Fp)),
                               ("down", (D, Fp), (Fp, D))):
        plan[m + f"shared_experts.{name}_proj.weight"] = _Tensor(
            shape, _linear(at("mlp", f"shared_{name}"), dst))
  return plan


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """HF tensor name -> shape for every tensor a checkpoint of `config` holds
  (per-expert MoE layout; `lm_head.weight` only when not tied)."""
  plan = _tensor_plan(config)
  if config.tie_embeddings:
    del plan["lm_head.weight"]
  return {k: t.shape for k, t in plan.items()}


# ---- files and headers -----------------------------------------------------
def _pickle_error(what: str) -> ValueError:
  return ValueError(
      f"{what}: pickle-based checkpoints ({', '.join(PICKLE_SUFFIXES)}) are "
      "refused because unpickling runs arbitrary code; convert the checkpoint "
      "to safetensors (e.g. transformers' save_pretrained with "
      "safe_serialization=True)")


def _tensor_files(path: str) -> tuple[list[str], dict[str, str] | None]:
  """The safetensors files to read, and the shard index's weight map."""
  index = os.path.join(path, INDEX_FILE)
  if os.path.exists(index):
    try:
      with open(index, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError,
            TypeError) as e:
      raise ValueError(f"{index}: not a valid shard index ({e!r})") from e
    files = sorted(set(weight_map.values()))
    absent = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if absent:
      raise ValueError(f"{index} lists shard files that do not exist: "
                       f"{absent}")
    return files, dict(weight_map)
  names = sorted(os.listdir(path))
  files = [f for f in names if f.endswith(".safetensors")]
  if files:
    return files, None
  pickles = [f for f in names if f.endswith(PICKLE_SUFFIXES)]
  if pickles:
    raise _pickle_error(f"{path} holds only {pickles}")
  raise ValueError(f"{path} holds no *.safetensors files")


def _open(file: str, framework: str = "numpy"):
  try:
    return safetensors.safe_open(file, framework=framework)
  except (safetensors.SafetensorError, OSError) as e:
    raise ValueError(f"{file}: not a readable safetensors file (truncated or "
                     f"corrupted?): {e}") from e


def _scan(path: str, files: list[str], weight_map: dict[str, str] | None
          ) -> dict[str, tuple[str, tuple[int, ...], str]]:
  """Reads only the headers: tensor name -> (file, shape, dtype tag)."""
  where = {}
  for fn in files:
    with _open(os.path.join(path, fn)) as f:
      for key in f.keys():
        sl = f.get_slice(key)
        if key in where:
          raise ValueError(f"tensor {key} is stored twice: in {where[key][0]}"
                           f" and {fn}")
        where[key] = (fn, tuple(sl.get_shape()), sl.get_dtype())
  if weight_map is not None:
    wrong = [f"{k} (index says {fn})" for k, fn in sorted(weight_map.items())
             if k not in where or where[k][0] != fn]
    if wrong:
      raise ValueError(f"{os.path.join(path, INDEX_FILE)} lists tensors its "
                       f"shards do not hold: {_names(wrong)}")
  return where


def _names(items: list[str], limit: int = 64) -> str:
  shown = ", ".join(items[:limit])
  more = len(items) - limit
  return shown + (f", ... and {more} more" if more > 0 else "")


def _ignored(key: str, shape: tuple[int, ...], config: ModelConfig,
             hf: Mapping[str, Any]) -> bool:
  if _IGNORED.match(key):
    return True
  if (".mlp.shared_experts." in key and 0 in shape and config.moe is not None
      and not config.moe.num_shared_experts):
    # transformers builds a zero-width shared MLP when n_shared_experts = 0.
    return True
  if hf["model_type"] == "deepseek_v3":
    # Multi-token-prediction layers (model.layers.{L}...) are a training
    # head, not part of next-token logits; transformers drops them too.
    m = re.match(r"model\.layers\.(\d+)\.", key)
    return bool(m) and int(m.group(1)) >= config.num_layers
  return False


def _validate(config: ModelConfig, hf: Mapping[str, Any], where, path: str,
              plan: Mapping[str, _Tensor]):
  """Raises one ValueError listing every missing, unexpected, misshapen or
  wrongly typed tensor (before any data is read)."""
  optional = {"lm_head.weight"} if config.tie_embeddings else set()
  missing = sorted(k for k in plan if k not in where and k not in optional)
  unexpected = sorted(f"{k} (in {where[k][0]})" for k in where
                      if k not in plan and
                      not _ignored(k, where[k][1], config, hf))
  errors = []
  if missing:
    errors.append(f"missing tensors: {_names(missing)}")
  if unexpected:
    errors.append(f"unexpected tensors: {_names(unexpected)}")
  declared = checkpoint_dtype(hf)
  for key, t in plan.items():
    if key not in where:
      continue
    fn, shape, tag = where[key]
    if shape != t.shape:
      errors.append(f"{fn}: tensor {key} has shape {list(shape)}, config.json"
                    f" implies {list(t.shape)}")
    if tag not in FLOAT_DTYPES:
      errors.append(f"{fn}: tensor {key} has dtype {tag}; supported: "
                    f"{', '.join(FLOAT_DTYPES)}")
    elif declared and FLOAT_DTYPES[tag] not in (declared, "float32"):
      # float32 is allowed beside a declared bf16/f16: transformers keeps
      # e.g. the MoE router and its bias in float32.
      errors.append(f"{fn}: tensor {key} has dtype {tag}, config.json "
                    f"declares {declared}")
  if errors:
    raise ValueError(
        f"checkpoint {path} does not match its config.json "
        f"(model_type={hf['model_type']}: "
        f"{params_lib.shape_fields(config)}):\n  " +
        "\n  ".join(errors))


# ---- reading ----------------------------------------------------------------
def _read_tensor(handles: dict, file: str, key: str, tag: str) -> np.ndarray:
  try:
    if "numpy" not in handles:
      handles["numpy"] = _open(file).__enter__()
    return handles["numpy"].get_tensor(key)
  except TypeError:
    if tag != "BF16":
      raise
  # Older safetensors' numpy backend cannot hold bfloat16: read via flax.
  if "flax" not in handles:
    handles["flax"] = _open(file, "flax").__enter__()
  return np.asarray(handles["flax"].get_tensor(key))


def _leaf_dtype(config: ModelConfig, name: str):
  # The MoE router decides discrete expert choices: like transformers
  # (`_keep_in_fp32_modules_strict`), keep it and its bias in float32.
  if name in ("router", "score_bias"):
    return np.float32
  return _NP_DTYPES[config.param_dtype]


def _read(path: str, where, plan: Mapping[str, _Tensor],
          config: ModelConfig):
  """Reads every planned tensor into numpy leaves of the kvjax layout.

  Returns:
    (tree of numpy leaves, {name: array} of planned tensors with no kvjax
    leaf: only a tied model's lm_head).
  """
  shapes = jax.eval_shape(
      lambda: params_lib.init_params(config, jax.random.key(0)))
  tree = jax.tree_util.tree_map_with_path(
      lambda p, s: np.zeros(s.shape, _leaf_dtype(config, p[-1].key)), shapes)
  written = collections.Counter()
  extra = {}
  by_file = collections.defaultdict(list)
  for key in plan:
    if key in where:
      by_file[where[key][0]].append(key)
  for fn in sorted(by_file):
    file = os.path.join(path, fn)
    handles = {}
    try:
      for key in by_file[fn]:
        w = _read_tensor(handles, file, key, where[key][2])
        if not np.isfinite(w.astype(np.float32)).all():
          raise ValueError(f"{file}: tensor {key} holds NaN or inf values "
                           "(corrupted file?)")
        for (stack, j, e, *names), value in plan[key].put(w).items():
          node = tree if stack is None else tree[stack]
          for name in names[:-1]:
            node = node[name]
          if names[-1] not in node:
            extra[key] = value.astype(_leaf_dtype(config, names[-1]))
            continue
          idx = tuple(i for i in (j, e) if i is not None)
          node[names[-1]][idx] = value.astype(node[names[-1]].dtype)
          written[(stack, *names)] += value.size
    finally:
      for h in handles.values():
        h.__exit__(None, None, None)
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  for p, leaf in flat:
    keys = tuple(k.key for k in p)
    stack_keys = keys if keys[0] in ("layers", "moe_layers") else (None,) + keys
    if written[stack_keys] != leaf.size:
      raise ValueError(f"internal error: kvjax param {keys} was written "
                       f"{written[stack_keys]} of {leaf.size} elements")
  return tree, extra


def _read_config_json(cfg_file: str) -> dict[str, Any]:
  """The JSON object in `cfg_file`; ValueError naming the file when it is
  not UTF-8 text, not JSON, or not an object."""
  try:
    with open(cfg_file, "rb") as f:
      text = f.read().decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{cfg_file} is not UTF-8 text: {e}") from e
  try:
    hf = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{cfg_file} is not valid JSON: {e}") from e
  if not isinstance(hf, dict):
    raise ValueError(f"{cfg_file} must hold a JSON object, got "
                     f"{type(hf).__name__}")
  return hf


def load_checkpoint(path, *, param_dtype: str | None = None,
                    compute_dtype: str = "float32"):
  """Loads a Hugging Face checkpoint directory into kvjax.

  Args:
    path: a directory with `config.json` and `*.safetensors` (one file, or
      shards with `model.safetensors.index.json`). model_type must be one of
      `SUPPORTED_MODEL_TYPES`.
    param_dtype: 'float32' | 'bfloat16' | 'float16' to store the weights in;
      None keeps the checkpoint's dtype.
    compute_dtype: activation dtype of the returned config.
  Returns:
    (ModelConfig, params) ready for `kvjax.forward` / `kvjax.generate`.
  Raises:
    ValueError (before anything is returned) for: a missing directory or
    config.json, a config.json that is not UTF-8 JSON or holds an invalid
    value (checked before any tensor file is opened), an unsupported
    model_type or feature, pickle-based files, an unreadable / truncated
    safetensors file, and missing, unexpected, misshapen or wrongly typed
    tensors (named with their file).
  """
  path = os.fspath(path)
  if not os.path.exists(path):
    raise ValueError(f"checkpoint path {path} does not exist")
  if os.path.isfile(path):
    if path.endswith(PICKLE_SUFFIXES):
      raise _pickle_error(path)
    raise ValueError(f"{path} is a file; pass the checkpoint directory "
                     "(config.json + *.safetensors)")
  cfg_file = os.path.join(path, "config.json")
  if not os.path.isfile(cfg_file):
    raise ValueError(f"{path} has no config.json (not a Hugging Face "
                     "checkpoint directory)")
  hf = _read_config_json(cfg_file)
  if hf.get("model_type") not in SUPPORTED_MODEL_TYPES:
    raise ValueError(
        f"{cfg_file}: model_type {hf.get('model_type')!r} is not supported; "
        f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
  # Every config.json value is validated before a tensor file is opened.
  try:
    config = config_from_hf(hf, param_dtype=param_dtype,
                            compute_dtype=compute_dtype)
  except ValueError as e:
    raise ValueError(f"{cfg_file}: {e}") from e
  files, weight_map = _tensor_files(path)
  where = _scan(path, files, weight_map)
  if param_dtype is None and checkpoint_dtype(hf) is None:
    # config.json declares no dtype: store the weights as the files do.
    tags = collections.Counter(t for _, _, t in where.values()
                               if t in FLOAT_DTYPES)
    if tags:
      config = config.replace(
          param_dtype=FLOAT_DTYPES[tags.most_common(1)[0][0]])
  fused = frozenset(
      i for i in range(config.num_layers)
      if f"model.layers.{i}.mlp.experts.gate_up_proj" in where)
  plan = _tensor_plan(config, fused)
  _validate(config, hf, where, path, plan)
  ignored = sorted(k for k in where if k not in plan)
  if ignored:
    logging.info("load_checkpoint(%s): ignoring %d tensors: %s", path,
                 len(ignored), _names(ignored, 8))
  tree, extra = _read(path, where, plan, config)
  if "lm_head.weight" in extra:
    lm_head_DV = extra["lm_head.weight"]
    if not np.array_equal(lm_head_DV, tree["embed"].T):
      # As transformers: a config that says "tied" but a checkpoint with a
      # different lm_head means the weights are not tied.
      logging.warning("%s: tie_word_embeddings is set but lm_head.weight "
                      "differs from the embedding; using it untied", path)
      config = config.replace(tie_embeddings=False)
      tree["lm_head"] = lm_head_DV
  params = jax.tree_util.tree_map(jnp.asarray, tree)
  return config, params
