"""The weight products of both params layouts: the one module that knows
which layout it was given.

kvjax holds one model in two layouts (`kvjax.params`):

  canonical  what `init_params` and `load_checkpoint` return, and what
             training, checkpoints and the sharding table use: every weight
             [in, out] (x @ W), each layer stack one dict of arrays with a
             leading L axis.
  packed     `kvjax.pack(params, config)`, the decode layout: each layer
             stack a tuple of per-layer dicts, q/k/v fused into one weight
             and gate/up into another, every fused dense weight stored
             [out, in] (suffix `_t`) and applied by `layers.linear_t`.

The contract, per layer (shapes without the L axis; MLA's H = P + R):

  canonical                         packed
  attn q [D,N,H], k, v [D,K,H]      attn qkv_t [(N+2K)·H, D]
  attn o [N,H,D]                    attn o_t [D, N·H]
  mlp gate, up [D,F], down [F,D]    mlp gate_up_t [2F, D], down_t [D, F]
  lm_head [D,V] (top level)         lm_head_t [V, D]
  MLA q [D,N,H]                     attn q_t [N·H, D]
      q_a [D,Q], q_b [Q,N,H]        attn q_a_t [Q, D], q_b_t [N·H, Q]
      kv_a [D,C+R]                  attn kv_a_t [C+R, D]
      w_uk [C,N,P]                  attn w_uk_t [N, C, P] (per head [out, in])
      w_uv [C,N,O]                  attn w_uv_t [N, O, C]
      o [N,O,D]                     attn o_t [D, N·O]

Both layouts keep the same: norms (attn_norm, mlp_norm, final_norm,
q_a_norm, kv_a_norm), GQA biases (q_bias [N,H], k_bias, v_bias [K,H],
o_bias [D]), the embedding [V, D] (also the LM head when tie_embeddings)
and an MoE layer's mlp (`kvjax.moe`: a decode step reads a few experts).

Which optional weights exist is a config fact (qkv_bias, o_bias,
q_lora_rank, tie_embeddings, moe); which layout they are in is read from
the keys, here and nowhere else: attention, MLA and the model call these
functions and never look at a key. Each function is the product exactly as
the layout's fast path writes it (no copies, no transposes added); packed
products fed by an RMSNorm pass `norm_input=True` (`layers.linear_t`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.config import ModelConfig
from kvjax.layers import linear_t, linear_t_heads, merge_heads_out, swiglu

PACKED_ATTENTION = ("qkv_t", "o_t")  # o_t: MLA's too
PACKED_MLP = ("gate_up_t", "down_t")


def _layer_stacks(params) -> list[str]:
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


# ---- GQA --------------------------------------------------------------------
def qkv(p, x_BTD, config: ModelConfig):
  """Queries, keys and values of one GQA layer, biases added.

  Args:
    p: the layer's attention params (either layout).
    x_BTD: the normalized input.
  Returns:
    (q_BTNH, k_BTKH, v_BTKH), before rotation.
  """
  B, T, _ = x_BTD.shape
  N, K, H = config.num_heads, config.num_kv_heads, config.head_dim
  if "qkv_t" in p:  # one fused [out, in] product
    qkv = linear_t(x_BTD, p["qkv_t"], norm_input=True)  # [B, T, (N+2K)·H]
    q_BTNH = qkv[..., :N * H].reshape(B, T, N, H)
    k_BTKH = qkv[..., N * H:(N + K) * H].reshape(B, T, K, H)
    v_BTKH = qkv[..., (N + K) * H:].reshape(B, T, K, H)
  else:
    q_BTNH = jnp.einsum("BTD,DNH->BTNH", x_BTD, p["q"])
    k_BTKH = jnp.einsum("BTD,DKH->BTKH", x_BTD, p["k"])
    v_BTKH = jnp.einsum("BTD,DKH->BTKH", x_BTD, p["v"])
  if config.qkv_bias:
    q_BTNH += p["q_bias"][None, None]
    k_BTKH += p["k_bias"][None, None]
    v_BTKH += p["v_bias"][None, None]
  return q_BTNH, k_BTKH, v_BTKH


def attn_out(p, out_BTNH, config: ModelConfig):
  """The attention output projection, GQA's or MLA's (whose per-head value
  width O plays H): o [N,H,D] (`merge_heads_out`) or o_t [D, N·H]
  (`linear_t`), plus o_bias [D] where the config has one (GQA only, as
  `kvjax.params` builds it). Returns y_BTD."""
  B, T = out_BTNH.shape[:2]
  if "o_t" in p:
    y_BTD = linear_t(out_BTNH.reshape(B, T, -1), p["o_t"])
  else:
    y_BTD = merge_heads_out(out_BTNH, p["o"])
  if config.o_bias and config.attention == "gqa":
    y_BTD += p["o_bias"][None, None]
  return y_BTD


# ---- MLA --------------------------------------------------------------------
def mla_q(p, x_BTD, config: ModelConfig):
  """MLA queries without a query latent (q_lora_rank 0): q_BTNH
  (H = P + R)."""
  B, T, _ = x_BTD.shape
  if "q_t" in p:
    return linear_t(x_BTD, p["q_t"], norm_input=True).reshape(
        B, T, config.num_heads, -1)
  return jnp.einsum("BTD,DNH->BTNH", x_BTD, p["q"])


def mla_q_a(p, x_BTD):
  """The query latent before its norm (q_lora_rank Q > 0): q_lat_BTQ."""
  if "q_a_t" in p:
    return linear_t(x_BTD, p["q_a_t"], norm_input=True)
  return x_BTD @ p["q_a"]


def mla_q_b(p, q_lat_BTQ, config: ModelConfig):
  """Queries from the normalized query latent: q_BTNH (H = P + R)."""
  B, T, _ = q_lat_BTQ.shape
  if "q_b_t" in p:  # fed by the query latent's RMSNorm
    return linear_t(q_lat_BTQ, p["q_b_t"], norm_input=True).reshape(
        B, T, config.num_heads, -1)
  return jnp.einsum("BTQ,QNH->BTNH", q_lat_BTQ, p["q_b"])


def mla_kv_a(p, x_BTD):
  """The latent and rotary key before the latent's norm, [B, T, C + R]."""
  if "kv_a_t" in p:
    return linear_t(x_BTD, p["kv_a_t"], norm_input=True)
  return x_BTD @ p["kv_a"]


def absorb_q(p, q_nope_BTNP):
  """W_UK folded into the queries: q_lat_BTNC (absorbed decode)."""
  if "w_uk_t" in p:  # [N, C, P]
    return linear_t_heads(q_nope_BTNP, p["w_uk_t"])
  return jnp.einsum("BTNP,CNP->BTNC", q_nope_BTNP, p["w_uk"])


def absorb_out(p, o_lat_BTNC):
  """W_UV applied to latent outputs: out_BTNO (absorbed decode)."""
  if "w_uv_t" in p:  # [N, O, C]
    return linear_t_heads(o_lat_BTNC, p["w_uv_t"])
  return jnp.einsum("BTNC,CNO->BTNO", o_lat_BTNC, p["w_uv"])


def expand_kv(p, c_BSC):
  """Latents expanded to per-head keys and values (the naive path):
  (k_nope_BSNP, v_BSNO)."""
  if "w_uk_t" in p:
    return (jnp.einsum("BSC,NCP->BSNP", c_BSC, p["w_uk_t"]),
            jnp.einsum("BSC,NOC->BSNO", c_BSC, p["w_uv_t"]))
  return (jnp.einsum("BSC,CNP->BSNP", c_BSC, p["w_uk"]),
          jnp.einsum("BSC,CNO->BSNO", c_BSC, p["w_uv"]))


# ---- MLP and LM head --------------------------------------------------------
def mlp(p, x_BTD):
  """A dense SwiGLU MLP (not an MoE layer: `kvjax.moe`). Returns y_BTD."""
  if "gate_up_t" in p:
    gate_up = linear_t(x_BTD, p["gate_up_t"], norm_input=True)  # [B, T, 2F]
    F = gate_up.shape[-1] // 2
    h_BTF = jax.nn.silu(gate_up[..., :F]) * gate_up[..., F:]
    return linear_t(h_BTF, p["down_t"])
  return swiglu(x_BTD, p["gate"], p["up"], p["down"])


def lm_head(params, x_BTD, config: ModelConfig):
  """Logits [B, T, V] (float32) of the final-normed x_BTD: lm_head [D, V],
  lm_head_t [V, D] or, with tie_embeddings, the embedding [V, D]."""
  if is_packed(params):  # [V, D]: the tied embed or lm_head_t
    w_VD = params["embed" if config.tie_embeddings else "lm_head_t"]
    return linear_t(x_BTD, w_VD.astype(config.dtype),
                    preferred_element_type=jnp.float32)
  if config.tie_embeddings:
    return jnp.einsum("BTD,VD->BTV", x_BTD,
                      params["embed"].astype(config.dtype),
                      preferred_element_type=jnp.float32)
  return jnp.einsum("BTD,DV->BTV", x_BTD,
                    params["lm_head"].astype(config.dtype),
                    preferred_element_type=jnp.float32)
