"""Model configuration: one frozen dataclass, validated once, with derived values.

Dimension alphabet (used in every docstring, hot-path name and einsum string):
  B batch, T query length, S key/value length (cache slots), N query heads,
  K kv heads, G = N // K groups, H head dim, D model width, L layers,
  V vocab, F MLP hidden, C MLA latent rank, R rope dim (MLA rotary key),
  P MLA non-rotary (nope) query/key dim, E experts, Q MLA query latent rank,
  W key blocks of a blocked decode cache (S / X), X slots per key block
  (`kvjax.blocked`).

`ConfigDict`s live at the script edge; the library takes a `ModelConfig`
built once with `ModelConfig.from_dict`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax.numpy as jnp

ATTENTION_KINDS = ("gqa", "mla")
ROPE_LAYOUTS = ("half", "interleaved")
ROPE_SCALINGS = ("none", "linear", "dynamic", "llama3", "yarn")
MLA_DECODE_PATHS = ("absorbed", "naive")
ATTENTION_IMPLS = ("einsum", "jax_nn", "cudnn")
MOE_SCORINGS = ("softmax", "sigmoid")
MOE_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Static rotary-embedding scaling, as Hugging Face configs describe it."""

  kind: str = "none"
  factor: float = 1.0
  original_max_position: int = 0
  # llama3
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  # yarn
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 1.0
  mscale_all_dim: float = 0.0
  attention_factor: float | None = None

  def __post_init__(self):
    if self.kind not in ROPE_SCALINGS:
      raise ValueError(
          f"rope_scaling.kind={self.kind!r} is not one of {ROPE_SCALINGS}")
    if self.kind != "none" and self.factor <= 0:
      raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """DeepSeek-style mixture of experts (routed + shared experts)."""

  num_experts: int  # E
  experts_per_token: int
  expert_dim: int  # F of one expert
  num_shared_experts: int = 0
  first_dense_layers: int = 0  # layers below this use the dense MLP
  routed_scaling_factor: float = 1.0
  scoring: str = "softmax"
  topk_method: str = "greedy"
  num_groups: int = 1
  topk_groups: int = 1
  norm_topk_prob: bool = False

  def __post_init__(self):
    if self.num_experts < 1:
      raise ValueError(f"moe.num_experts must be >= 1, got {self.num_experts}")
    if not 1 <= self.experts_per_token <= self.num_experts:
      raise ValueError(
          f"moe.experts_per_token={self.experts_per_token} must be in "
          f"[1, num_experts={self.num_experts}]")
    if self.scoring not in MOE_SCORINGS:
      raise ValueError(f"moe.scoring={self.scoring!r} not in {MOE_SCORINGS}")
    if self.topk_method not in MOE_TOPK_METHODS:
      raise ValueError(
          f"moe.topk_method={self.topk_method!r} not in {MOE_TOPK_METHODS}")
    if self.num_experts % self.num_groups:
      raise ValueError(
          f"moe.num_groups={self.num_groups} must divide "
          f"num_experts={self.num_experts}")
    if self.expert_dim < 1 or self.num_shared_experts < 0:
      raise ValueError(
          f"moe.expert_dim={self.expert_dim} must be >= 1 and "
          f"moe.num_shared_experts={self.num_shared_experts} >= 0")
    if not 1 <= self.topk_groups <= self.num_groups:
      raise ValueError(f"moe.topk_groups={self.topk_groups} must be in "
                       f"[1, num_groups={self.num_groups}]")
    if (self.topk_method == "noaux_tc" and
        self.num_experts // self.num_groups < 2):
      # A noaux_tc group is scored by the sum of its two best experts.
      raise ValueError(
          f"moe.topk_method='noaux_tc' needs >= 2 experts per group, got "
          f"num_experts={self.num_experts}, num_groups={self.num_groups}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama / Mistral / Qwen2 / DeepSeek-style decoder.

  `attention='gqa'` covers MHA (num_kv_heads == num_heads), MQA
  (num_kv_heads == 1) and GQA (anything dividing num_heads).
  `attention='mla'` is DeepSeek-V2/V3 multi-head latent attention.
  """

  vocab_size: int = 32000  # V
  num_layers: int = 12  # L
  embed_dim: int = 768  # D
  num_heads: int = 12  # N
  num_kv_heads: int = 4  # K
  head_dim_override: int = 0  # H; 0 means embed_dim // num_heads
  mlp_dim: int = 2048  # F
  attention: str = "gqa"
  # MLA (DeepSeek) dims.
  kv_lora_rank: int = 0  # C
  q_lora_rank: int = 0  # Q; 0 means queries are projected directly
  qk_nope_head_dim: int = 0  # P
  qk_rope_head_dim: int = 0  # R
  v_head_dim: int = 0
  mla_decode: str = "absorbed"
  # Positions.
  rope_theta: float = 10000.0
  rope_layout: str = "half"
  rope_scaling: RopeScaling = RopeScaling()
  max_seq_len: int = 8192
  # Everything else that changes the math.
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  sliding_window: int = 0  # model-intrinsic window (Mistral); 0 = full
  moe: MoEConfig | None = None
  attention_impl: str = "einsum"
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  init_scale: float = 0.02

  def __post_init__(self):
    for name in ("vocab_size", "num_layers", "embed_dim", "num_heads",
                 "mlp_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.attention not in ATTENTION_KINDS:
      raise ValueError(
          f"attention={self.attention!r} is not one of {ATTENTION_KINDS}")
    if self.rope_layout not in ROPE_LAYOUTS:
      raise ValueError(
          f"rope_layout={self.rope_layout!r} is not one of {ROPE_LAYOUTS}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"attention_impl={self.attention_impl!r} is not one "
                       f"of {ATTENTION_IMPLS}")
    for name in ("param_dtype", "compute_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{name}={getattr(self, name)!r} must be float32, "
                         "bfloat16 or float16")
    if self.sliding_window < 0:
      raise ValueError(f"sliding_window must be >= 0, got "
                       f"{self.sliding_window}")
    if self.head_dim_override < 0:
      raise ValueError("head_dim_override must be >= 0")
    if self.attention == "gqa":
      if self.head_dim_override == 0 and self.embed_dim % self.num_heads:
        raise ValueError(
            f"embed_dim={self.embed_dim} is not divisible by num_heads="
            f"{self.num_heads}; set head_dim_override")
      if self.num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be >= 1, got {self.num_kv_heads}")
      if self.num_heads % self.num_kv_heads:
        raise ValueError(
            f"num_heads={self.num_heads} is not divisible by num_kv_heads="
            f"{self.num_kv_heads}")
      if self.head_dim % 2:
        raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    else:
      for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                   "v_head_dim"):
        if getattr(self, name) < 1:
          raise ValueError(f"MLA needs {name} >= 1, got {getattr(self, name)}")
      if self.q_lora_rank < 0:
        raise ValueError(f"q_lora_rank must be >= 0, got {self.q_lora_rank}")
      if self.qk_rope_head_dim % 2:
        raise ValueError(
            f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
    if self.mla_decode not in MLA_DECODE_PATHS:
      raise ValueError(
          f"mla_decode={self.mla_decode!r} is not one of {MLA_DECODE_PATHS}")

  # ---- derived values -------------------------------------------------------
  @property
  def head_dim(self) -> int:
    """H: per-head width of q/k/v for GQA (the MLA q/k head is P + R)."""
    if self.attention == "mla":
      return self.qk_nope_head_dim + self.qk_rope_head_dim
    return self.head_dim_override or self.embed_dim // self.num_heads

  @property
  def kv_heads(self) -> int:
    """K actually cached per token (MLA caches one shared latent: 1)."""
    return 1 if self.attention == "mla" else self.num_kv_heads

  @property
  def groups(self) -> int:
    """G = N // K query heads per kv head."""
    return self.num_heads // self.kv_heads

  @property
  def rope_dim(self) -> int:
    """Width of the rotated part of q and k."""
    return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

  @property
  def kv_elements_per_token_per_layer(self) -> int:
    """Cache elements per token per layer: 2·K·H, or C + R for MLA."""
    if self.attention == "mla":
      return self.kv_lora_rank + self.qk_rope_head_dim
    return 2 * self.num_kv_heads * self.head_dim

  @property
  def softmax_scale(self) -> float:
    scale = self.head_dim ** -0.5
    rs = self.rope_scaling
    # As DeepSeek's yarn_get_mscale: no correction when factor <= 1.
    if (self.attention == "mla" and rs.kind == "yarn" and rs.mscale_all_dim
        and rs.factor > 1):
      m = 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0
      scale *= m * m
    return scale

  @property
  def is_moe(self) -> bool:
    return self.moe is not None

  @property
  def num_dense_layers(self) -> int:
    return self.moe.first_dense_layers if self.moe else self.num_layers

  @property
  def dtype(self):
    return jnp.dtype(self.compute_dtype)

  @property
  def variant(self) -> str:
    """Human name of the attention variant derived from the head counts."""
    if self.attention == "mla":
      return "mla"
    if self.num_kv_heads == self.num_heads:
      return "mha"
    if self.num_kv_heads == 1:
      return "mqa"
    return "gqa"

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  # ---- construction from ConfigDicts ---------------------------------------
  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
    """Builds a config from a plain mapping (e.g. `dict(cfg.model)`).

    Unknown keys raise `ValueError` naming them, so a typo never passes.
    `rope_scaling` and `moe` may be nested mappings. `head_dim` is accepted
    as an alias of `head_dim_override`.
    """
    d = dict(d)
    if "head_dim" in d:
      d["head_dim_override"] = d.pop("head_dim") or 0
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
      raise ValueError(f"unknown ModelConfig fields: {unknown}")
    rs = d.get("rope_scaling")
    if rs is not None and not isinstance(rs, RopeScaling):
      d["rope_scaling"] = RopeScaling(**dict(rs))
    elif rs is None:
      d.pop("rope_scaling", None)
    moe = d.get("moe")
    if moe is not None and not isinstance(moe, MoEConfig):
      moe = dict(moe)
      d["moe"] = MoEConfig(**moe) if moe.get("num_experts", 0) else None
    return cls(**d)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)
