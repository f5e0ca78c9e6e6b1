"""Tiny random Hugging Face models for the checkpoint parity tests.

Each `Case` is a config.json-level description of one tiny model (hidden
32-48, 2-3 layers, vocab 160-256). `build(case, root)` creates it with
transformers' own config and model classes, gives every tensor a random
value (norm weights, biases and the DeepSeek-V3 router bias too: an
all-ones norm or all-zero bias would let a loader that ignores them pass),
saves it with `save_pretrained` (optionally as bfloat16, sharded, or with
the config rewritten to the older Hub format) and reloads it with
`from_pretrained` in float32 so the reference reads the same files kvjax
does.

Test names and the coverage table come from `features(config.json)`, i.e.
from the saved config itself, never from hand-typed labels.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any

import numpy as np

# Weight stds: the embedding and LM head are large so that top-1 / top-2
# logit gaps sit far above float32 noise (notes/hf-checkpoints.md: at the
# default init, gaps of ~1e-3 make greedy parity a coin toss).
WEIGHT_STD = 0.15
EMBED_STD = 1.0


@dataclasses.dataclass(frozen=True)
class Case:
  """One tiny model: its HF config kwargs and how it is written to disk."""

  model_type: str
  kwargs: dict[str, Any]
  legacy_config: bool = False  # top-level rope_theta / rope_scaling format
  bf16: bool = False
  max_shard_size: str | None = None  # e.g. "40KB": sharded + index.json
  seed: int = 0


def _common(**kw):
  base = dict(vocab_size=192, hidden_size=32, intermediate_size=48,
              num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, rms_norm_eps=1e-5,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
  base.update(kw)
  return base


_MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=12, moe_intermediate_size=16, n_routed_experts=8,
            num_experts_per_tok=2)

CASES = (
    # GQA, head_dim != hidden / heads, q/k/v/o bias, tied embeddings,
    # llama3 RoPE, legacy config format.
    Case("llama", _common(
        num_key_value_heads=2, head_dim=16, attention_bias=True,
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_parameters=dict(rope_type="llama3", factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=16)),
         legacy_config=True),
    # MQA, linear RoPE, bfloat16 weights, sharded files.
    Case("llama", _common(
        num_key_value_heads=1, vocab_size=160,
        rope_parameters=dict(rope_type="linear", factor=2.0,
                             rope_theta=10000.0)),
         bf16=True, max_shard_size="24KB"),
    # MHA, sliding window, dynamic RoPE (static inside max_position), legacy.
    Case("mistral", _common(
        num_key_value_heads=4, sliding_window=6,
        rope_parameters=dict(rope_type="dynamic", factor=2.0,
                             rope_theta=10000.0)),
         legacy_config=True),
    # GQA, q/k/v bias, sliding window on every layer, yarn, tied.
    Case("qwen2", _common(
        num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
        max_window_layers=0, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="yarn", factor=4.0,
                             original_max_position_embeddings=16,
                             rope_theta=10000.0))),
    # MLA with q_lora, group-limited greedy softmax routing, shared experts,
    # a dense first layer, yarn with mscale in the softmax scale, sharded,
    # legacy format.
    Case("deepseek_v2", _common(
        **_MLA, num_hidden_layers=3, q_lora_rank=12, n_shared_experts=2,
        first_k_dense_replace=1, topk_method="group_limited_greedy",
        # One group of 4 out of 2 for k=2: unlike plain greedy (with
        # topk_group >= k, max-scored groups always hold the global top-k).
        n_group=2, topk_group=1, routed_scaling_factor=2.0,
        rope_parameters=dict(rope_type="yarn", factor=4.0,
                             original_max_position_embeddings=16,
                             mscale=0.707, mscale_all_dim=0.707,
                             beta_fast=32, beta_slow=1, rope_theta=10000.0)),
         legacy_config=True, max_shard_size="40KB"),
    # MLA without q_lora, greedy routing, no shared expert, every layer
    # MoE, default RoPE.
    Case("deepseek_v2", _common(
        **_MLA, q_lora_rank=None, n_shared_experts=0,
        first_k_dense_replace=0, topk_method="greedy",
        routed_scaling_factor=1.0)),
    # V3 router: sigmoid + correction bias + group top-k, normalized,
    # x routed_scaling_factor; interleaved RoPE; yarn with mscale != 1.
    Case("deepseek_v3", _common(
        **_MLA, num_key_value_heads=4, q_lora_rank=None, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", factor=4.0,
                             original_max_position_embeddings=16,
                             mscale=0.8, mscale_all_dim=1.0,
                             rope_theta=10000.0)), seed=1),
    # V3 with q_lora, half-layout RoPE, unnormalized weights, no groups,
    # bfloat16 weights (router kept in float32 by transformers), legacy.
    Case("deepseek_v3", _common(
        **_MLA, num_key_value_heads=4, q_lora_rank=12, n_shared_experts=1,
        first_k_dense_replace=0, n_group=1, topk_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.5,
        rope_interleave=False), legacy_config=True, bf16=True),
)


# ---- names derived from the saved config -----------------------------------
def features(hf: dict[str, Any], files: list[str] | None = None) -> list[str]:
  """Short feature labels of a config.json (and its files)."""
  mt = hf["model_type"]
  out = [mt]
  N, D = hf["num_attention_heads"], hf["hidden_size"]
  if mt.startswith("deepseek"):
    out.append("mla-qlora" if hf.get("q_lora_rank") else "mla")
  else:
    K = hf.get("num_key_value_heads") or N
    out.append("mha" if K == N else "mqa" if K == 1 else f"gqa{N // K}")
    if hf.get("head_dim") and hf["head_dim"] != D // N:
      out.append(f"hd{hf['head_dim']}")
  if hf.get("attention_bias"):
    out.append("qkvo-bias")
  if mt == "qwen2":
    out.append("qkv-bias")
  if hf.get("tie_word_embeddings"):
    out.append("tied")
  rp = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  kind = rp.get("rope_type", rp.get("type", "default"))
  out.append(f"rope-{kind}")
  if rp.get("mscale_all_dim"):
    out.append("mscale")
  if mt == "deepseek_v3":
    out.append("interleaved" if hf.get("rope_interleave", True) else "half")
  window = hf.get("sliding_window")
  if window and (mt == "mistral" or hf.get("use_sliding_window")):
    out.append(f"window{window}")
  if mt.startswith("deepseek"):
    if mt == "deepseek_v2":
      out.append(hf.get("topk_method") or "greedy")
    else:
      out.append(f"sigmoid-groups{hf.get('n_group')}")
      if hf.get("norm_topk_prob"):
        out.append("norm")
    out.append(f"shared{hf.get('n_shared_experts')}")
    out.append(f"dense{hf.get('first_k_dense_replace')}")
  out.append("legacy-cfg" if "rope_parameters" not in hf else "new-cfg")
  dtype = hf.get("dtype", hf.get("torch_dtype"))
  if dtype and dtype != "float32":
    out.append(str(dtype).replace("torch.", ""))
  if files and any(f.endswith(".index.json") for f in files):
    out.append("sharded")
  return out


def case_config_dict(case: Case) -> dict[str, Any]:
  """The config.json a case will be saved with (no model built)."""
  hf = dict(case.kwargs, model_type=case.model_type)
  # transformers 5 always writes rope_parameters (the default RoPE too).
  hf.setdefault("rope_parameters", dict(rope_type="default",
                                        rope_theta=10000.0))
  if case.bf16:
    hf["dtype"] = "bfloat16"
  if case.legacy_config:
    hf = legacy_format(hf)
  return hf


def case_name(case: Case) -> str:
  files = ["model.safetensors.index.json"] if case.max_shard_size else None
  return "_".join(features(case_config_dict(case), files)).replace("-", "_")


# ---- building ----------------------------------------------------------------
def legacy_format(hf: dict[str, Any]) -> dict[str, Any]:
  """Rewrites a transformers-5 config dict in the older Hub format."""
  hf = dict(hf)
  rp = dict(hf.pop("rope_parameters", None) or {})
  hf["rope_theta"] = rp.pop("rope_theta", hf.get("rope_theta", 10000.0))
  kind = rp.pop("rope_type", "default")
  hf["rope_scaling"] = None if kind == "default" else dict(rp, type=kind)
  if "dtype" in hf:
    hf["torch_dtype"] = hf.pop("dtype")
  return hf


def _config_class(model_type: str):
  import transformers  # pylint: disable=g-import-not-at-top
  return {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
          "mistral": (transformers.MistralConfig,
                      transformers.MistralForCausalLM),
          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
          "deepseek_v2": (transformers.DeepseekV2Config,
                          transformers.DeepseekV2ForCausalLM),
          "deepseek_v3": (transformers.DeepseekV3Config,
                          transformers.DeepseekV3ForCausalLM)}[model_type]


def randomize(model, seed: int):
  """Gives every parameter and persistent buffer a random value."""
  import torch  # pylint: disable=g-import-not-at-top
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, t in sorted(model.state_dict().items()):
      if not t.is_floating_point():
        continue
      noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
      if "norm" in name:
        value = 1.0 + 0.2 * noise
      elif name.endswith("bias"):
        value = 0.2 * noise  # includes e_score_correction_bias
      elif "embed_tokens" in name or "lm_head" in name:
        value = EMBED_STD * noise
      else:
        value = WEIGHT_STD * noise
      t.copy_(value.to(t.dtype))


def build(case: Case, root: str):
  """Creates, randomizes and saves one case; returns (dir, reference model).

  The reference is reloaded from the saved directory in float32 with eager
  attention.
  """
  import torch  # pylint: disable=g-import-not-at-top
  # Tiny models gain nothing from intra-op threads; on a shared 2-core
  # machine their spin-waiting costs ~20x the CPU time of the work itself.
  torch.set_num_threads(1)
  config_cls, model_cls = _config_class(case.model_type)
  torch.manual_seed(case.seed)
  with warnings.catch_warnings():
    # n_shared_experts=0 builds a zero-width MLP; torch warns about its init.
    warnings.filterwarnings("ignore", "Initializing zero-element tensors")
    model = model_cls(config_cls(**case.kwargs)).eval()
  randomize(model, case.seed)
  path = os.path.join(root, case_name(case))
  if case.bf16:
    # As transformers' own bf16 checkpoints: the modules it keeps in float32
    # (the MoE router and its bias) keep their full float32 values.
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or ()
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    kept = {n: t.detach().clone() for n, t in tensors.items()
            if any(k in n for k in keep)}
    model = model.to(torch.bfloat16)
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    for name, value in kept.items():
      tensors[name].data = value
  save_kw = {}
  if case.max_shard_size:
    save_kw["max_shard_size"] = case.max_shard_size
  model.save_pretrained(path, **save_kw)
  if case.legacy_config:
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file) as f:
      hf = json.load(f)
    with open(cfg_file, "w") as f:
      json.dump(legacy_format(hf), f, indent=2)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "Initializing zero-element tensors")
    ref = model_cls.from_pretrained(path, dtype=torch.float32,
                                    attn_implementation="eager").eval()
  ref.generation_config.eos_token_id = None
  ref.generation_config.bos_token_id = None
  ref.generation_config.pad_token_id = None
  return path, ref


def prompts(vocab: int, batch: int, length: int, lengths, seed: int):
  """Equal-length ids [B, T], and left-padded ids + mask [B, T] whose rows
  hold `lengths` real tokens."""
  rng = np.random.default_rng(seed)
  equal = rng.integers(0, vocab, (batch, length)).astype(np.int32)
  padded = rng.integers(0, vocab, (batch, length)).astype(np.int32)
  mask = np.zeros((batch, length), np.int32)
  for b, n in enumerate(lengths):
    mask[b, length - n:] = 1
  padded = np.where(mask == 1, padded, 0).astype(np.int32)
  return equal, padded, mask


def reference_outputs(ref, tokens, mask, new_tokens: int):
  """Prompt logits [B, T, V], greedy ids [B, new] and per-step logits
  [B, new, V] from transformers (float32 numpy)."""
  import torch  # pylint: disable=g-import-not-at-top
  ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
  m = torch.as_tensor(np.asarray(mask), dtype=torch.long)
  # generate() derives positions from the mask; a plain forward must be told.
  pos = (m.cumsum(-1) - 1).masked_fill(m == 0, 0)
  with torch.no_grad():
    logits = ref(input_ids=ids, attention_mask=m, position_ids=pos).logits
    out = ref.generate(input_ids=ids, attention_mask=m, do_sample=False,
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       return_dict_in_generate=True, output_logits=True)
  new = out.sequences[:, ids.shape[1]:].numpy()
  step_logits = torch.stack(out.logits, dim=1).float().numpy()
  return logits.float().numpy(), new, step_logits
