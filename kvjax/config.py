"""Model configuration: one frozen dataclass, validated once, with derived values.

Dimension alphabet (used in every docstring, hot-path name and einsum string;
WORKSPACE.md has the same table). One letter, one meaning:

  A  pages one paged call reads (`kvjax.paged`)
  B  batch
  C  MLA latent rank (`kv_lora_rank`)
  D  model width
  E  experts (MoE)
  F  MLP hidden (an MoE expert's: `expert_dim`)
  G  N // K, query heads per kv head
  H  head dim (MLA's q/k head: P + R)
  I  steps of a loop: decode steps and the tokens they generate, the items
     of a `lax.map`
  J  pages one paged call writes per row
  K  kv heads
  L  layers
  M  block-table width (capacity M · Y)
  N  query heads
  O  MLA value head dim (`v_head_dim`)
  P  MLA non-rotary q/k dim (`qk_nope_head_dim`)
  Q  MLA query latent rank (`q_lora_rank`)
  R  MLA rotary key dim (`qk_rope_head_dim`)
  S  key/value length = cache slots
  T  query length (new tokens in this call); a helper that flattens B·T
     rows into one axis calls them T (tokens: `kvjax.moe`,
     `layers.linear_t_heads`)
  U  rows per engine prefill call
  V  vocab
  W  key blocks (S / X)
  X  slots per key block (`kvjax.blocked`'s 64; KIVI's `key_group`)
  Y  slots per page
  Z  pages in a paged cache's pool

Primes: a primed letter is another length of that letter's kind, with one
meaning each:
  E' experts one token picks (top-k: `experts_per_token`)
  F' the shared experts' hidden width (F · `num_shared_experts`)
  K' a scoped eviction policy's head axis (1 or K)
  S' an attention call's key axis (T, S + T, S, or an attended prefix)
  T' a token stream (a corpus; a stream evaluated in calls of T tokens)
  Y' a pool array's entries per page on its slot axis (Y, or Y / X for
     KIVI's key scales)
In names and einsum strings a prime is the lowercase letter (`ids_Te`,
'TD,TeDF->TeF'), and a local size variable `Ep`, `Kp`. K', S' and Y' are
the K, S and Y axes at another length, so names spell them K, S and Y.
Digits are literal sizes (`logits_B1V`: [B, 1, V]). The only other
lowercase letters are a generic helper's placeholders, named in its
docstring: `i`, `o` (a weight's in / out features: `kvjax.layers.linear_t`).

`ConfigDict`s live at the script edge; the library takes a `ModelConfig`
built once with `ModelConfig.from_dict`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax.numpy as jnp

from kvjax.validate import check_bool, check_choice, check_float, check_int

ATTENTION_KINDS = ("gqa", "mla")
ROPE_LAYOUTS = ("half", "interleaved")
ROPE_SCALINGS = ("none", "linear", "dynamic", "llama3", "yarn")
MLA_DECODE_PATHS = ("absorbed", "naive")
ATTENTION_IMPLS = ("einsum", "jax_nn", "cudnn")
MOE_SCORINGS = ("softmax", "sigmoid")
MOE_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
DTYPES = ("float32", "bfloat16", "float16")


def _normalize(obj, name: str, value) -> None:
  """Stores a checked value back into a frozen dataclass field, so fields
  hold plain Python values (numpy ints and JSON ints given for floats
  become int / float: hashable alike, JSON-serialisable by `to_dict`)."""
  object.__setattr__(obj, name, value)


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
    """Validates every field (see `kvjax.validate` for the error form).

    Raises:
      ValueError naming the field: `kind` not in ROPE_SCALINGS; `factor`,
      `low_freq_factor`, `high_freq_factor`, `beta_fast`, `beta_slow` not
      finite and > 0; `mscale`, `mscale_all_dim` not finite and >= 0;
      `attention_factor` neither None nor finite and > 0;
      `original_max_position` not an int >= 0 (>= 1 for llama3 and yarn,
      whose formulas divide by it or take its log); llama3 with
      `high_freq_factor <= low_freq_factor` (the smoothing divides by the
      difference).
    """
    n = "RopeScaling."
    check_choice(n + "kind", self.kind, ROPE_SCALINGS)
    # Positive: each is a divisor or the argument of a log in
    # `layers.rope_frequencies`.
    for name in ("factor", "low_freq_factor", "high_freq_factor",
                 "beta_fast", "beta_slow"):
      _normalize(self, name,
                 check_float(n + name, getattr(self, name), 0, strict=True))
    # 0 means "absent" (yarn then uses the factor-only amplitude).
    for name in ("mscale", "mscale_all_dim"):
      _normalize(self, name, check_float(n + name, getattr(self, name), 0))
    if self.attention_factor is not None:
      _normalize(self, "attention_factor",
                 check_float(n + "attention_factor", self.attention_factor,
                             0, strict=True))
    needs_length = self.kind in ("llama3", "yarn")
    _normalize(self, "original_max_position", check_int(
        n + "original_max_position" +
        (f" (kind={self.kind!r})" if needs_length else ""),
        self.original_max_position, 1 if needs_length else 0))
    if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(
          f"{n}high_freq_factor={self.high_freq_factor} must be > "
          f"low_freq_factor={self.low_freq_factor} for kind='llama3'")


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
    """Validates every field (see `kvjax.validate` for the error form).

    Raises:
      ValueError naming the field: counts not ints (num_experts, expert_dim,
      num_groups >= 1; num_shared_experts, first_dense_layers >= 0);
      experts_per_token outside [1, num_experts]; num_groups not dividing
      num_experts; topk_groups outside [1, num_groups]; a group-limited
      method whose kept groups hold fewer than experts_per_token experts
      (noaux_tc also needs >= 2 experts per group); routed_scaling_factor
      not finite and > 0; scoring / topk_method not in their sets;
      norm_topk_prob not a bool.
    """
    n = "MoEConfig."
    E = check_int(n + "num_experts", self.num_experts, 1)
    _normalize(self, "num_experts", E)
    _normalize(self, "experts_per_token", check_int(
        n + "experts_per_token", self.experts_per_token, 1, E))
    for name, minimum in (("expert_dim", 1), ("num_shared_experts", 0),
                          ("first_dense_layers", 0)):
      _normalize(self, name, check_int(n + name, getattr(self, name),
                                       minimum))
    _normalize(self, "routed_scaling_factor", check_float(
        n + "routed_scaling_factor", self.routed_scaling_factor, 0,
        strict=True))
    check_choice(n + "scoring", self.scoring, MOE_SCORINGS)
    check_choice(n + "topk_method", self.topk_method, MOE_TOPK_METHODS)
    _normalize(self, "norm_topk_prob",
               check_bool(n + "norm_topk_prob", self.norm_topk_prob))
    G = check_int(n + "num_groups", self.num_groups, 1, E)
    _normalize(self, "num_groups", G)
    if E % G:
      raise ValueError(f"{n}num_groups={G} must divide num_experts={E}")
    _normalize(self, "topk_groups", check_int(
        f"{n}topk_groups (num_groups={G})", self.topk_groups, 1, G))
    if self.topk_method == "noaux_tc" and E // G < 2:
      # A noaux_tc group is scored by the sum of its two best experts.
      raise ValueError(
          f"{n}topk_method='noaux_tc' needs >= 2 experts per group, got "
          f"num_experts={E}, num_groups={G}")
    if (self.topk_method != "greedy" and
        self.experts_per_token > self.topk_groups * (E // G)):
      # Otherwise top-k would pick masked-out experts.
      raise ValueError(
          f"{n}experts_per_token={self.experts_per_token} exceeds the "
          f"{self.topk_groups * (E // G)} experts of the topk_groups="
          f"{self.topk_groups} groups that {self.topk_method!r} keeps")


def _from_mapping(cls, m, name: str):
  """cls(**m) for a mapping m, with unknown keys a ValueError naming them."""
  if not isinstance(m, Mapping):
    raise ValueError(f"{name} must be a {cls.__name__} or a mapping, got "
                     f"{m!r}")
  fields = dataclasses.fields(cls)
  unknown = sorted(set(m) - {f.name for f in fields})
  if unknown:
    raise ValueError(f"unknown {name} fields: {unknown}")
  missing = [f.name for f in fields if f.name not in m and
             f.default is dataclasses.MISSING]
  if missing:
    raise ValueError(f"{name} is missing required fields: {missing}")
  return cls(**m)


# ModelConfig's numeric fields and their minimums. 0 is allowed where it
# means "off" or "derive it": head_dim_override (embed_dim // num_heads),
# q_lora_rank (no query latent), sliding_window (full attention), and the
# MLA dims, which a GQA config leaves at 0 (`attention='mla'` requires >= 1).
_INT_FIELDS = (("vocab_size", 1), ("num_layers", 1), ("embed_dim", 1),
               ("num_heads", 1), ("num_kv_heads", 1), ("head_dim_override", 0),
               ("mlp_dim", 1), ("kv_lora_rank", 0), ("q_lora_rank", 0),
               ("qk_nope_head_dim", 0), ("qk_rope_head_dim", 0),
               ("v_head_dim", 0), ("max_seq_len", 1), ("sliding_window", 0))
# (name, minimum, strict): rope_theta is a log base / power base,
# init_scale a standard deviation (0 would give a degenerate all-zero model);
# rms_norm_eps = 0 is plain RMS normalisation.
_FLOAT_FIELDS = (("rope_theta", 0, True), ("rms_norm_eps", 0, False),
                 ("init_scale", 0, True))


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
    """Validates every field, before any derived value divides by one.

    Raises:
      ValueError naming the field and the bad value: an int field that is
      not an int (bool and float refused, see `kvjax.validate.check_int`) or
      is below its minimum (sizes >= 1; head_dim_override, the MLA dims,
      sliding_window >= 0); rope_theta / init_scale not finite and > 0;
      rms_norm_eps not finite and >= 0; a string not in its set; a flag not
      a bool; rope_scaling not a RopeScaling, moe not None or a MoEConfig;
      and the cross-field rules (GQA: N divisible by K, D by N unless
      head_dim_override is set, H even; MLA: C, P, R, v >= 1 and R even;
      yarn: rope_theta > 1; moe.first_dense_layers <= num_layers).
    """
    n = "ModelConfig."
    for name, minimum in _INT_FIELDS:
      _normalize(self, name, check_int(n + name, getattr(self, name),
                                       minimum))
    for name, minimum, strict in _FLOAT_FIELDS:
      _normalize(self, name, check_float(n + name, getattr(self, name),
                                         minimum, strict=strict))
    for name in ("tie_embeddings", "qkv_bias", "o_bias"):
      _normalize(self, name, check_bool(n + name, getattr(self, name)))
    for name, choices in (("attention", ATTENTION_KINDS),
                          ("mla_decode", MLA_DECODE_PATHS),
                          ("rope_layout", ROPE_LAYOUTS),
                          ("attention_impl", ATTENTION_IMPLS),
                          ("param_dtype", DTYPES), ("compute_dtype", DTYPES)):
      check_choice(n + name, getattr(self, name), choices)
    if not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"{n}rope_scaling must be a RopeScaling, got "
                       f"{self.rope_scaling!r}")
    if self.moe is not None and not isinstance(self.moe, MoEConfig):
      raise ValueError(f"{n}moe must be None or a MoEConfig, got "
                       f"{self.moe!r}")
    # Cross-field rules; every count above is now an int >= its minimum.
    if self.attention == "gqa":
      if self.head_dim_override == 0 and self.embed_dim % self.num_heads:
        raise ValueError(
            f"{n}embed_dim={self.embed_dim} is not divisible by num_heads="
            f"{self.num_heads}; set head_dim_override")
      if self.num_heads % self.num_kv_heads:
        raise ValueError(
            f"{n}num_heads={self.num_heads} is not divisible by num_kv_heads="
            f"{self.num_kv_heads}")
      if self.head_dim % 2:
        raise ValueError(f"{n}head_dim={self.head_dim} must be even for RoPE")
    else:
      for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                   "v_head_dim"):
        check_int(f"{n}{name} (attention='mla')", getattr(self, name), 1)
      if self.qk_rope_head_dim % 2:
        raise ValueError(f"{n}qk_rope_head_dim={self.qk_rope_head_dim} must "
                         "be even for RoPE")
    if self.rope_scaling.kind == "yarn" and self.rope_theta <= 1:
      # yarn's correction range divides by log(rope_theta).
      raise ValueError(f"{n}rope_theta={self.rope_theta} must be > 1 with "
                       "rope_scaling.kind='yarn'")
    if self.moe is not None and self.moe.first_dense_layers > self.num_layers:
      raise ValueError(
          f"{n}moe.first_dense_layers={self.moe.first_dense_layers} exceeds "
          f"num_layers={self.num_layers}")

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

    Every value goes through the same validation as the constructor (a
    float for an int field is refused, never truncated). Unknown keys raise
    `ValueError` naming them, so a typo never passes. `rope_scaling` and
    `moe` may be nested mappings (a `moe` with num_experts 0 or absent means
    no MoE: a ConfigDict section cannot be None). `head_dim` is accepted as
    an alias of `head_dim_override` (None or 0: derived).
    """
    if not isinstance(d, Mapping):
      raise ValueError(f"ModelConfig.from_dict needs a mapping, got "
                       f"{type(d).__name__}")
    d = dict(d)
    if "head_dim" in d:
      if "head_dim_override" in d:
        raise ValueError("ModelConfig.from_dict: give head_dim or "
                         "head_dim_override, not both")
      head_dim = d.pop("head_dim")
      # Checked here so that the error names the key the caller wrote.
      d["head_dim_override"] = 0 if head_dim is None else check_int(
          "ModelConfig.head_dim (alias of head_dim_override)", head_dim, 0)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
      raise ValueError(f"unknown ModelConfig fields: {unknown}")
    rs = d.get("rope_scaling")
    if rs is None:
      d.pop("rope_scaling", None)
    elif not isinstance(rs, RopeScaling):
      d["rope_scaling"] = _from_mapping(RopeScaling, rs,
                                        "ModelConfig.rope_scaling")
    moe = d.get("moe")
    if moe is not None and not isinstance(moe, MoEConfig):
      if not isinstance(moe, Mapping):
        raise ValueError(f"ModelConfig.moe must be None, a MoEConfig or a "
                         f"mapping, got {moe!r}")
      # Only an int 0 (or no key) means off: a num_experts of 0.0, 0.5 or
      # False must reach MoEConfig's check, not silently switch MoE off.
      off = moe.get("num_experts", 0)
      off = isinstance(off, int) and not isinstance(off, bool) and off == 0
      d["moe"] = None if off else _from_mapping(MoEConfig, moe,
                                                 "ModelConfig.moe")
    return cls(**d)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)
