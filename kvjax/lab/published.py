"""Published model configurations and their KV-cache footprint.

The `ModelConfig`s below are written from the public `config.json` files of
the Hugging Face checkpoints named in each entry (dtypes are the
checkpoints' `torch_dtype`). They are never run here: cache sizes come from
`jax.eval_shape(kvjax.init_cache, ...)`, so even a 128k-token batch-32 cache
of a 70B model costs no memory.

DeepSeek-V2's KV-cache arithmetic (arXiv:2405.04434, Table 1) per token and
layer, in elements: MHA 2·n_h·d_h, GQA 2·n_g·d_h, MLA d_c + d_h^R. With
d_c = 4·d_h and d_h^R = d_h / 2 MLA caches (9/2)·d_h, "equal to GQA with
2.25 groups" (n_g = kv heads; `equivalent_kv_heads` below). The paper's
"−93.3% vs DeepSeek 67B" compares the deployed V2 cache, quantized to "6 bits
on average" per element (its inference-efficiency paragraph), with 67B's
16-bit cache; 67B is GQA with 8 kv heads (its config.json; DeepSeek LLM,
arXiv:2401.02954), not MHA. `deepseek_v2_claims` reproduces both numbers.

Each configuration's `param_count` equals its checkpoint's published size
(tested), which checks the hyperparameters transcribed here.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import numpy as np

from kvjax import cache as cache_lib
from kvjax.config import MoEConfig, ModelConfig, RopeScaling

# ---- the configurations -----------------------------------------------------
# meta-llama/Meta-Llama-3-8B config.json. (Llama-3.1-8B has the same cache
# dimensions, with llama3 rope scaling and a 128k context.)
LLAMA3_8B = ModelConfig(
    vocab_size=128256, num_layers=32, embed_dim=4096, num_heads=32,
    num_kv_heads=8, mlp_dim=14336, rope_theta=500000.0, rms_norm_eps=1e-5,
    max_seq_len=8192, param_dtype="bfloat16", compute_dtype="bfloat16")

# meta-llama/Meta-Llama-3-70B config.json.
LLAMA3_70B = ModelConfig(
    vocab_size=128256, num_layers=80, embed_dim=8192, num_heads=64,
    num_kv_heads=8, mlp_dim=28672, rope_theta=500000.0, rms_norm_eps=1e-5,
    max_seq_len=8192, param_dtype="bfloat16", compute_dtype="bfloat16")

# mistralai/Mistral-7B-v0.1 config.json: a model-intrinsic 4096-token sliding
# window, so a rolling cache of 4096 slots is exact for it at any length.
MISTRAL_7B = ModelConfig(
    vocab_size=32000, num_layers=32, embed_dim=4096, num_heads=32,
    num_kv_heads=8, mlp_dim=14336, rope_theta=10000.0, rms_norm_eps=1e-5,
    sliding_window=4096, max_seq_len=32768, param_dtype="bfloat16",
    compute_dtype="bfloat16")

# deepseek-ai/deepseek-llm-67b-base config.json (GQA: 64 query heads, 8 kv
# heads; the dense baseline of DeepSeek-V2's KV-cache comparison).
DEEPSEEK_67B = ModelConfig(
    vocab_size=102400, num_layers=95, embed_dim=8192, num_heads=64,
    num_kv_heads=8, mlp_dim=22016, rope_theta=10000.0, rms_norm_eps=1e-6,
    max_seq_len=4096, param_dtype="bfloat16", compute_dtype="bfloat16")

# deepseek-ai/DeepSeek-V2 config.json (236B total, 21B active).
DEEPSEEK_V2 = ModelConfig(
    vocab_size=102400, num_layers=60, embed_dim=5120, num_heads=128,
    num_kv_heads=128, mlp_dim=12288, attention="mla", kv_lora_rank=512,
    q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, rope_theta=10000.0, rope_layout="interleaved",
    rope_scaling=RopeScaling(kind="yarn", factor=40.0,
                             original_max_position=4096, beta_fast=32.0,
                             beta_slow=1.0, mscale=0.707,
                             mscale_all_dim=0.707),
    max_seq_len=163840, rms_norm_eps=1e-6,
    moe=MoEConfig(num_experts=160, experts_per_token=6, expert_dim=1536,
                  num_shared_experts=2, first_dense_layers=1,
                  routed_scaling_factor=16.0, scoring="softmax",
                  topk_method="group_limited_greedy", num_groups=8,
                  topk_groups=3, norm_topk_prob=False),
    param_dtype="bfloat16", compute_dtype="bfloat16")

# deepseek-ai/DeepSeek-V2-Lite config.json (16B): MLA without q_lora.
DEEPSEEK_V2_LITE = ModelConfig(
    vocab_size=102400, num_layers=27, embed_dim=2048, num_heads=16,
    num_kv_heads=16, mlp_dim=10944, attention="mla", kv_lora_rank=512,
    q_lora_rank=0, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    rope_theta=10000.0, rope_layout="interleaved",
    rope_scaling=RopeScaling(kind="yarn", factor=40.0,
                             original_max_position=4096, beta_fast=32.0,
                             beta_slow=1.0, mscale=0.707,
                             mscale_all_dim=0.707),
    max_seq_len=163840, rms_norm_eps=1e-6,
    moe=MoEConfig(num_experts=64, experts_per_token=6, expert_dim=1408,
                  num_shared_experts=2, first_dense_layers=1,
                  routed_scaling_factor=1.0, scoring="softmax",
                  topk_method="greedy", norm_topk_prob=False),
    param_dtype="bfloat16", compute_dtype="bfloat16")

# deepseek-ai/DeepSeek-V3 config.json (671B; the multi-token-prediction
# layer, `num_nextn_predict_layers`, is not part of the decoder modelled here).
DEEPSEEK_V3 = ModelConfig(
    vocab_size=129280, num_layers=61, embed_dim=7168, num_heads=128,
    num_kv_heads=128, mlp_dim=18432, attention="mla", kv_lora_rank=512,
    q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, rope_theta=10000.0, rope_layout="interleaved",
    rope_scaling=RopeScaling(kind="yarn", factor=40.0,
                             original_max_position=4096, beta_fast=32.0,
                             beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    max_seq_len=163840, rms_norm_eps=1e-6,
    moe=MoEConfig(num_experts=256, experts_per_token=8, expert_dim=2048,
                  num_shared_experts=1, first_dense_layers=3,
                  routed_scaling_factor=2.5, scoring="sigmoid",
                  topk_method="noaux_tc", num_groups=8, topk_groups=4,
                  norm_topk_prob=True),
    param_dtype="bfloat16", compute_dtype="bfloat16")

PUBLISHED: dict[str, ModelConfig] = {
    "Llama-3-8B": LLAMA3_8B,
    "Llama-3-70B": LLAMA3_70B,
    "Mistral-7B-v0.1": MISTRAL_7B,
    "DeepSeek-67B": DEEPSEEK_67B,
    "DeepSeek-V2-Lite": DEEPSEEK_V2_LITE,
    "DeepSeek-V2": DEEPSEEK_V2,
    "DeepSeek-V3": DEEPSEEK_V3,
}

# DeepSeek-V2 (arXiv:2405.04434), inference efficiency: the deployed KV cache is quantized to "6 bits on
# average" per element; the 67B baseline is taken at 16 bits (bf16).
DEEPSEEK_V2_DEPLOYED_KV_BITS = 6
DEEPSEEK_67B_KV_BITS = 16


def get(name: str) -> ModelConfig:
  """The published configuration called `name` (a key of `PUBLISHED`)."""
  if name not in PUBLISHED:
    raise ValueError(f"unknown published model {name!r}; choose from "
                     f"{tuple(PUBLISHED)}")
  return PUBLISHED[name]


# ---- cache arithmetic -------------------------------------------------------
def reference_head_dim(config: ModelConfig) -> int:
  """d_h of DeepSeek-V2's Table 1: the per-head width of the keys/values an
  MHA twin would cache (`head_dim` for GQA; `qk_nope_head_dim` for MLA, the
  width W_UK expands each head's key to)."""
  return config.qk_nope_head_dim if config.attention == "mla" else (
      config.head_dim)


def mha_twin(config: ModelConfig) -> ModelConfig:
  """The same model with multi-head attention: N kv heads of width d_h."""
  d_h = reference_head_dim(config)
  return config.replace(attention="gqa", num_kv_heads=config.num_heads,
                        head_dim_override=d_h, kv_lora_rank=0, q_lora_rank=0,
                        qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0)


def equivalent_kv_heads(config: ModelConfig) -> float:
  """n_g of a GQA model (head width d_h) caching as much per token: N for
  MHA, K for GQA, 1 for MQA, (C + R) / (2·d_h) for MLA."""
  return config.kv_elements_per_token_per_layer / (
      2 * reference_head_dim(config))


def cache_shapes(config: ModelConfig, batch: int, tokens: int,
                 kv_dtype: str = "bfloat16"):
  """The cache `init_cache` would build for `tokens` slots, as
  `jax.ShapeDtypeStruct`s (`jax.eval_shape`: nothing is allocated)."""
  policy = cache_lib.CachePolicy(kv_dtype=kv_dtype)
  return jax.eval_shape(
      lambda: cache_lib.init_cache(config, batch, tokens, policy=policy))


def cache_nbytes(config: ModelConfig, batch: int, tokens: int,
                 kv_dtype: str = "bfloat16") -> int:
  """Bytes of the per-token storage (payload and per-token scales) of a cache
  of `batch` sequences × `tokens` slots, from the shapes `init_cache` builds.

  Slot bookkeeping (`positions [B, S]`, `length [B]`) is not included: it is
  the same for every attention variant.
  """
  shapes = cache_shapes(config, batch, tokens, kv_dtype)
  # pylint: disable-next=protected-access
  leaves = cache_lib._storage_leaves(shapes)
  return int(sum(np.prod(x.shape, dtype=np.int64) * x.dtype.itemsize
                 for x in leaves))


def table_row(name: str, config: ModelConfig,
              tokens: Sequence[int] = (4096, 32768, 131072),
              batches: Sequence[int] = (1, 32),
              kv_dtype: str = "bfloat16") -> dict:
  """One row of the cache table.

  Returns:
    A JSON-able dict: name, variant, layers, elements per token per layer,
    equivalent kv heads, bytes per token (from the formula and from the
    `eval_shape`d cache, which must agree), `cache_bytes[f"{T}x{B}"]` for
    every context length T and batch B, and `vs_mha`, the ratio of the
    per-token bytes to the model's MHA twin.
  """
  per_token = cache_lib.kv_bytes_per_token(config, kv_dtype)
  measured = cache_nbytes(config, 1, 1, kv_dtype)
  twin = cache_nbytes(mha_twin(config), 1, 1, kv_dtype)
  sizes = {f"{t}x{b}": cache_nbytes(config, b, t, kv_dtype)
           for b in batches for t in tokens}
  return dict(
      name=name, variant=config.variant, attention=config.attention,
      layers=config.num_layers, num_heads=config.num_heads,
      kv_heads=config.kv_heads, head_dim=reference_head_dim(config),
      kv_lora_rank=config.kv_lora_rank, rope_dim=config.qk_rope_head_dim,
      elements_per_token_per_layer=config.kv_elements_per_token_per_layer,
      equivalent_kv_heads=equivalent_kv_heads(config),
      bytes_per_token=per_token, bytes_per_token_eval_shape=measured,
      mha_bytes_per_token=twin, vs_mha=measured / twin,
      sliding_window=config.sliding_window, max_seq_len=config.max_seq_len,
      kv_dtype=kv_dtype, cache_bytes=sizes)


def deepseek_v2_claims(v2: ModelConfig = DEEPSEEK_V2,
                       dense: ModelConfig = DEEPSEEK_67B) -> dict:
  """DeepSeek-V2's two KV-cache claims, recomputed from the configs.

  Returns:
    equivalent_kv_heads: (C + R) / (2·d_h) of V2 (the paper: 2.25).
    v2_elements_per_token, dense_elements_per_token: over all layers.
    reduction_same_precision: 1 − V2 / 67B elements.
    reduction_deployed: 1 − (V2 elements × 6 bits) / (67B elements × 16
      bits) (the paper: 93.3%).
    reduction_vs_mha_67b: the same at 16 bits against an MHA 67B.
  """
  v2_el = v2.num_layers * v2.kv_elements_per_token_per_layer
  dense_el = dense.num_layers * dense.kv_elements_per_token_per_layer
  mha_el = dense.num_layers * mha_twin(dense).kv_elements_per_token_per_layer
  return dict(
      equivalent_kv_heads=equivalent_kv_heads(v2),
      v2_elements_per_token=v2_el, dense_elements_per_token=dense_el,
      dense_kv_heads=dense.num_kv_heads,
      reduction_same_precision=1 - v2_el / dense_el,
      reduction_deployed=1 - (v2_el * DEEPSEEK_V2_DEPLOYED_KV_BITS) / (
          dense_el * DEEPSEEK_67B_KV_BITS),
      reduction_vs_mha_67b=1 - v2_el / mha_el)


def table(configs: Mapping[str, ModelConfig], **kw) -> list[dict]:
  """`table_row` for every (name, config)."""
  return [table_row(name, c, **kw) for name, c in configs.items()]


# ---- presentation -----------------------------------------------------------
def format_bytes(n: float) -> str:
  """Binary units: 1536 -> '1.5 KiB'."""
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  raise AssertionError("unreachable")


def _formula(row: dict) -> str:
  """Elements cached per token and layer, written out."""
  if row["attention"] == "mla":
    return (f"{row['kv_lora_rank']}+{row['rope_dim']} = "
            f"{row['elements_per_token_per_layer']}")
  return (f"2·{row['kv_heads']}·{row['head_dim']} = "
          f"{row['elements_per_token_per_layer']}")


def markdown_table(rows: Sequence[dict]) -> str:
  """The rows of `table` as a markdown table (sizes in binary units)."""
  keys = list(rows[0]["cache_bytes"])
  head = ["model", "attention", "L", "elements / token / layer",
          "≈ GQA kv heads", "KV / token"]
  head += [f"{int(k.split('x')[0]) // 1024}k × {k.split('x')[1]}"
           for k in keys]
  head.append("vs MHA")
  lines = ["| " + " | ".join(head) + " |",
           "|" + "|".join(["---"] * 2 + ["--:"] * (len(head) - 2)) + "|"]
  for r in rows:
    cells = [r["name"], r["variant"], str(r["layers"]), _formula(r),
             f"{r['equivalent_kv_heads']:g}",
             format_bytes(r["bytes_per_token"])]
    cells += [format_bytes(r["cache_bytes"][k]) for k in keys]
    cells.append(f"{100 * r['vs_mha']:.2f}%")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def table_notes(rows: Sequence[dict]) -> list[str]:
  """Caveats the sizes need: model windows, and published models' context
  limits (presets have no trained context length)."""
  notes = []
  longest = max(int(k.split("x")[0]) for k in rows[0]["cache_bytes"])
  for r in rows:
    if r["sliding_window"]:
      notes.append(
          f"{r['name']}: its {r['sliding_window']}-token sliding window makes "
          f"a rolling cache of {r['sliding_window']} slots exact at any "
          f"length ({format_bytes(r['bytes_per_token'] * r['sliding_window'])}"
          " per sequence); the columns show the unbounded cache.")
    elif r["name"] in PUBLISHED and r["max_seq_len"] < longest:
      notes.append(f"{r['name']}: context {r['max_seq_len']} tokens; longer "
                   "columns are hypothetical.")
  return notes


VARIANT_COLORS = dict(mha="tab:red", mqa="tab:green", gqa="tab:blue",
                      mla="tab:purple")


def plot_table(rows: Sequence[dict], path: str) -> None:
  """Two panels: KV bytes per token (log scale) and the share of the MHA
  twin's cache, one bar per row, coloured by variant."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  names = [r["name"] for r in rows][::-1]
  colors = [VARIANT_COLORS[r["variant"]] for r in rows][::-1]
  y = np.arange(len(rows))
  fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 0.35 * len(rows) + 1.5),
                                 sharey=True)
  ax0.barh(y, [r["bytes_per_token"] / 1024 for r in rows][::-1],
           color=colors)
  ax0.set_xscale("log")
  ax0.set_xlabel(f"KV cache per token, KiB ({rows[0]['kv_dtype']}, all "
                 "layers)")
  ax0.set_yticks(y, names)
  ax1.barh(y, [100 * r["vs_mha"] for r in rows][::-1], color=colors)
  ax1.set_xlabel("% of the same model's MHA cache")
  for yi, r in zip(y, rows[::-1]):
    ax1.text(100 * r["vs_mha"] + 1, yi, f"{100 * r['vs_mha']:.1f}%",
             va="center", fontsize=7)
  ax1.set_xlim(0, 115)
  handles = [plt.Rectangle((0, 0), 1, 1, color=c)
             for c in VARIANT_COLORS.values()]
  ax1.legend(handles, list(VARIANT_COLORS), loc="lower right")
  fig.suptitle("KV cache per token: kvjax presets and published models")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
