"""kvjax params -> a GGUF file (llama.cpp's format), float32, 'llama' arch.

`write_gguf(path, params, config)` writes a GQA-family model (MHA, MQA, GQA:
`attention='gqa'`) so that llama.cpp computes the same logits as kvjax on
the same weights (tests/test_gguf.py checks it; the `gguf` package, from
the optional extra `pip install -e .[llamacpp]`, does the file format).
`check_exportable(config)` refuses, with a ValueError naming the field,
what llama.cpp's 'llama' graph cannot compute: MLA, MoE, a sliding window,
yarn RoPE, partial rotary dims, biases whose shape llama.cpp fixes to
[D] when N·H != D.

Tensors (numpy shapes; GGUF lists the dims reversed, `ne`):
  token_embd.weight [V, D]           output_norm.weight [D]
  output.weight [V, D] (absent when tie_embeddings: llama.cpp reuses
                        token_embd)
  blk.{l}.attn_norm.weight [D]       blk.{l}.ffn_norm.weight [D]
  blk.{l}.attn_q.weight [N·H, D]     blk.{l}.attn_k/attn_v.weight [K·H, D]
  blk.{l}.attn_output.weight [D, N·H]
  blk.{l}.attn_{q,k,v}.bias [N·H] / [K·H], attn_output.bias [D] (if any)
  blk.{l}.ffn_gate/ffn_up.weight [F, D], ffn_down.weight [D, F]
  rope_freqs.weight [H/2] (llama3 RoPE only)
i.e. Hugging Face's `[out, in]` orientation; kvjax stores `[in, out]`
(`kvjax.params`).

RoPE: llama.cpp's 'llama' graph rotates interleaved pairs (2i, 2i + 1)
(`LLAMA_ROPE_TYPE_NORM`). A kvjax model with `rope_layout='half'` (pairs
(i, i + H/2), the Hugging Face layout) gets its q and k output features
permuted within each head, new 2i + s <- old s·H/2 + i (s in {0, 1}): the
permutation transformers' convert_hf_to_gguf.py applies to Llama. q·k is
unchanged (both sides move alike) and the rotation on the new pairs is the
old rotation. An 'interleaved' model is written as is.

Vocabulary: byte-level, as `kvjax.data` tokenizes: id b < 256 is the byte
b, written as GPT-2's byte-to-unicode character (tokenizer model 'gpt2',
pre-tokenizer 'default'); ids 256, 257, 258 are the CONTROL tokens
'<pad>', '<s>', '</s>' (`data.PAD`, `data.BOS`, `data.EOS`); a vocab
larger than 259 (the random presets' 32000) is filled with UNUSED
'<unused_{i}>' tokens, a smaller one (tiny: 256) keeps its first V bytes
and no specials. llama.cpp's BPE loader requires a merges list and the
gguf writer refuses an empty array, so one inert merge is written whose
halves are multi-character strings: BPE starts from single characters and
only grows symbols through merges, so it never fires and every byte stays
one token (tests/test_gguf.py checks llama.cpp's tokenizer against
`kvjax.data.encode`). No BOS/EOS is added by llama.cpp's tokenizer
(`add_bos_token` false), as `data.encode` adds none unless asked.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from kvjax import data
from kvjax import layers
from kvjax.config import ModelConfig, RopeScaling
from kvjax.projections import is_packed

ARCH = "llama"
TOKENIZER_MODEL = "gpt2"
TOKENIZER_PRE = "default"
SPECIAL_TOKENS = {data.PAD: "<pad>", data.BOS: "<s>", data.EOS: "</s>"}
# Never fires (module docstring): both halves are longer than one character.
INERT_MERGE = "<pad> <pad>"
# gguf.TokenType values (kept here so the vocabulary needs no gguf import).
NORMAL, CONTROL, UNUSED = 1, 3, 5


def byte_to_unicode() -> dict[int, str]:
  """GPT-2's reversible map of the 256 bytes to printable characters
  (printable Latin-1 bytes map to themselves, the rest to U+0100...)."""
  keep = (list(range(ord("!"), ord("~") + 1)) +
          list(range(ord("¡"), ord("¬") + 1)) +
          list(range(ord("®"), ord("ÿ") + 1)))
  out, n = {}, 0
  for b in range(256):
    if b in keep:
      out[b] = chr(b)
    else:
      out[b] = chr(256 + n)
      n += 1
  return out


def vocabulary(vocab_size: int) -> tuple[list[str], list[int]]:
  """Token texts and gguf token types for ids 0 .. V-1 (module docstring).

  Raises:
    ValueError: vocab_size < 1.
  """
  if vocab_size < 1:
    raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
  chars = byte_to_unicode()
  texts, types = [], []
  for i in range(vocab_size):
    if i < data.BYTE_VOCAB:
      texts.append(chars[i])
      types.append(NORMAL)
    elif i in SPECIAL_TOKENS:
      texts.append(SPECIAL_TOKENS[i])
      types.append(CONTROL)
    else:
      texts.append(f"<unused_{i}>")
      types.append(UNUSED)
  return texts, types


def check_exportable(config: ModelConfig) -> None:
  """Raises ValueError naming the config field llama.cpp's 'llama' graph
  cannot represent; returns None for a model it computes exactly."""
  if config.attention != "gqa":
    raise ValueError(f"attention={config.attention!r} cannot be exported to "
                     "GGUF 'llama' (MLA is llama.cpp's deepseek2 arch; only "
                     "'gqa' (MHA/MQA/GQA) is written here)")
  if config.is_moe:
    raise ValueError("moe is set: MoE models are not exported to GGUF here "
                     "(llama.cpp's 'llama' graph has no DeepSeek router)")
  if config.sliding_window:
    raise ValueError(f"sliding_window={config.sliding_window}: llama.cpp's "
                     "'llama' graph attends to the whole context")
  if config.rope_dim != config.head_dim:
    raise ValueError(f"rope_dim={config.rope_dim} != head_dim="
                     f"{config.head_dim}: partial rotary dims are not "
                     "exported")
  if config.rope_scaling.kind == "yarn":
    raise ValueError("rope_scaling.kind='yarn' is not exported (llama.cpp's "
                     "yarn differs from transformers'; not checked)")
  D, N, H = config.embed_dim, config.num_heads, config.head_dim
  if (config.qkv_bias or config.o_bias) and N * H != D:
    # llama.cpp sizes the q/o biases [D] and k/v biases [D·K/N].
    raise ValueError(
        f"qkv_bias={config.qkv_bias}, o_bias={config.o_bias} with "
        f"num_heads·head_dim={N * H} != embed_dim={D}: llama.cpp's 'llama' "
        "graph sizes attention biases by embed_dim")


def _rope_to_interleaved(w_xNH, layout: str):
  """Permutes the last (H) axis from `layout` pairs to interleaved pairs:
  new 2i + s <- old s·H/2 + i."""
  if layout == "interleaved":
    return w_xNH
  H = w_xNH.shape[-1]
  lead = w_xNH.shape[:-1]
  return w_xNH.reshape(*lead, 2, H // 2).swapaxes(-1, -2).reshape(
      *lead, H)


def gguf_tensors(params, config: ModelConfig) -> dict[str, np.ndarray]:
  """GGUF tensor name -> float32 C-contiguous numpy array (module
  docstring's names and shapes), from canonical kvjax `params`.

  Raises:
    ValueError: the config is not exportable (`check_exportable`), or the
      params are packed (`kvjax.pack`) or do not match the config.
  """
  from kvjax import params as params_lib  # pylint: disable=g-import-not-at-top
  check_exportable(config)
  if is_packed(params):
    raise ValueError("params are packed (kvjax.pack): pass the canonical "
                     "params (init_params, load_checkpoint, restore_params)")
  params_lib.check_params(params, config)
  f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
  D, N, K, H = (config.embed_dim, config.num_heads, config.num_kv_heads,
                config.head_dim)
  lay = config.rope_layout
  out = {"token_embd.weight": f32(params["embed"]),
         "output_norm.weight": f32(params["final_norm"])}
  if not config.tie_embeddings:
    out["output.weight"] = f32(np.asarray(params["lm_head"]).T)
  stack = params["layers"]
  for l in range(config.num_layers):
    p = f"blk.{l}."
    at = lambda w, l=l: np.asarray(w[l], np.float32)
    attn, mlp = stack["attn"], stack["mlp"]
    q_DNH = _rope_to_interleaved(at(attn["q"]), lay)
    k_DKH = _rope_to_interleaved(at(attn["k"]), lay)
    out[p + "attn_norm.weight"] = f32(at(stack["attn_norm"]))
    out[p + "attn_q.weight"] = f32(q_DNH.reshape(D, N * H).T)
    out[p + "attn_k.weight"] = f32(k_DKH.reshape(D, K * H).T)
    out[p + "attn_v.weight"] = f32(at(attn["v"]).reshape(D, K * H).T)
    out[p + "attn_output.weight"] = f32(at(attn["o"]).reshape(N * H, D).T)
    if config.qkv_bias:
      out[p + "attn_q.bias"] = f32(
          _rope_to_interleaved(at(attn["q_bias"]), lay).reshape(N * H))
      out[p + "attn_k.bias"] = f32(
          _rope_to_interleaved(at(attn["k_bias"]), lay).reshape(K * H))
      out[p + "attn_v.bias"] = f32(at(attn["v_bias"]).reshape(K * H))
    if config.o_bias:
      out[p + "attn_output.bias"] = f32(at(attn["o_bias"]))
    out[p + "ffn_norm.weight"] = f32(at(stack["mlp_norm"]))
    out[p + "ffn_gate.weight"] = f32(at(mlp["gate"]).T)
    out[p + "ffn_up.weight"] = f32(at(mlp["up"]).T)
    out[p + "ffn_down.weight"] = f32(at(mlp["down"]).T)
  if config.rope_scaling.kind == "llama3":
    # llama.cpp divides each base frequency by its factor.
    base, _ = layers.rope_frequencies(config.rope_dim, config.rope_theta,
                                      RopeScaling())
    scaled, _ = layers.rope_frequencies(config.rope_dim, config.rope_theta,
                                        config.rope_scaling)
    out["rope_freqs.weight"] = f32(base / scaled)
  return out


def gguf_metadata(config: ModelConfig, name: str = "kvjax"
                  ) -> dict[str, Any]:
  """The GGUF key/value metadata `write_gguf` writes (besides
  general.architecture), as {key: value}; token lists included."""
  check_exportable(config)
  a = ARCH
  texts, types = vocabulary(config.vocab_size)
  meta = {
      "general.name": name,
      "general.file_type": 0,  # LlamaFileType.ALL_F32
      f"{a}.vocab_size": config.vocab_size,
      f"{a}.context_length": config.max_seq_len,
      f"{a}.embedding_length": config.embed_dim,
      f"{a}.block_count": config.num_layers,
      f"{a}.feed_forward_length": config.mlp_dim,
      f"{a}.attention.head_count": config.num_heads,
      f"{a}.attention.head_count_kv": config.num_kv_heads,
      f"{a}.attention.key_length": config.head_dim,
      f"{a}.attention.value_length": config.head_dim,
      f"{a}.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
      f"{a}.rope.freq_base": config.rope_theta,
      f"{a}.rope.dimension_count": config.rope_dim,
      "tokenizer.ggml.model": TOKENIZER_MODEL,
      "tokenizer.ggml.pre": TOKENIZER_PRE,
      "tokenizer.ggml.tokens": texts,
      "tokenizer.ggml.token_type": types,
      "tokenizer.ggml.merges": [INERT_MERGE],
      "tokenizer.ggml.add_bos_token": False,
      "tokenizer.ggml.add_eos_token": False,
  }
  for key, tid in (("padding", data.PAD), ("bos", data.BOS),
                   ("eos", data.EOS)):
    if tid < config.vocab_size:
      meta[f"tokenizer.ggml.{key}_token_id"] = tid
  if config.rope_scaling.kind == "linear":
    meta[f"{a}.rope.scaling.type"] = "linear"
    meta[f"{a}.rope.scaling.factor"] = config.rope_scaling.factor
  return meta


def write_gguf(path: str | os.PathLike, params, config: ModelConfig, *,
               name: str = "kvjax") -> str:
  """Writes `params` (canonical kvjax layout) as a float32 GGUF file that
  llama.cpp loads as arch 'llama'.

  Args:
    path: the file to write (overwritten).
    params: canonical params of `config` (any float dtype; written f32).
    config: an exportable `ModelConfig` (`check_exportable`).
    name: general.name.
  Returns:
    The path written, as a str.
  Raises:
    ImportError: the `gguf` package is absent (`pip install -e
      .[llamacpp]`).
    ValueError: as `gguf_tensors`.
  """
  import gguf  # pylint: disable=g-import-not-at-top
  tensors = gguf_tensors(params, config)
  meta = gguf_metadata(config, name)
  path = os.fspath(path)
  writer = gguf.GGUFWriter(path, ARCH)
  try:
    _add_metadata(writer, meta)
    for tname, arr in tensors.items():
      writer.add_tensor(tname, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
  finally:
    writer.close()
  return path


def _add_metadata(writer, meta: Mapping[str, Any]) -> None:
  """Adds every key with the GGUF value type llama.cpp reads it as
  (ints u32, floats f32, token types an INT32 array)."""
  for key, value in meta.items():
    if key == "tokenizer.ggml.token_type":
      writer.add_array(key, [int(t) for t in value])  # INT32 array
    elif isinstance(value, list):
      writer.add_array(key, value)
    elif isinstance(value, bool):
      writer.add_bool(key, value)
    elif isinstance(value, str):
      writer.add_string(key, value)
    elif isinstance(value, float):
      writer.add_float32(key, value)
    elif isinstance(value, int):
      writer.add_uint32(key, value)
    else:  # pragma: no cover - every key above has a branch
      raise TypeError(f"GGUF metadata {key}: unsupported {type(value)}")
