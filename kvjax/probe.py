"""The attention probe: every layer's attention probabilities, per query head.

`attention_probs` runs the library's own no-cache forward (the same
projections, RoPE, masks and softmax as `kvjax.forward`, either params
layout, every attention variant: MHA / MQA / GQA and MLA) with a
`attention.ProbeRecord` carried through the layers in the cache's place;
each attention layer writes its probabilities into it. The normal path
passes None there and never builds one, so `forward`, `prefill` and
`generate` compile to the same programs as without the probe (checked by a
jaxpr / compiled-HLO comparison, WORKSPACE.md).

Fused attention (`attention_impl` 'jax_nn' / 'cudnn') never forms the
probabilities: the probe refuses it before compute; run the same params
with `config.replace(attention_impl='einsum')` (the same model).

Shapes: L layers, B batch, N query heads, T query positions, S key
positions (S = T: the forward's keys are its own tokens).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax import inference
from kvjax import model
from kvjax import params as params_lib
from kvjax.attention import ProbeRecord
from kvjax.config import ModelConfig


@functools.partial(jax.jit, static_argnames=("config",))
def _attention_probs(params, config, tokens_BT, mask_BT):
  B, T = tokens_BT.shape
  step = model.forward_step(config, mask_BT)
  record = ProbeRecord(jnp.zeros((config.num_layers, B, config.num_heads, T,
                                  T), jnp.float32))
  _, record = model.run_layers(params, model.embed(params, tokens_BT, config),
                               step, record, config)
  # A padding query's row is a finite average over nothing: zero it.
  return jnp.where(mask_BT[None, :, None, :, None], record.probs, 0.0)


def check_probe(config: ModelConfig, batch: int, length: int) -> None:
  """Raises ValueError, before compute, when `attention_probs` cannot serve
  the request: fused attention (no probabilities), or an output
  ([L, B, N, T, T] float32) larger than the device holds."""
  if config.attention_impl != "einsum":
    raise ValueError(
        f"attention_impl={config.attention_impl!r} is fused attention and "
        "forms no probabilities; probe with "
        "config.replace(attention_impl='einsum') (the same model)")
  need = 4 * config.num_layers * batch * config.num_heads * length * length
  have = inference.memory_limit()
  if need > have:
    raise ValueError(
        f"the attention probabilities of {batch} x {length} tokens "
        f"({config.num_layers} layers x {config.num_heads} heads) need "
        f"{need:,} bytes; the device holds {have:,}: probe fewer or "
        "shorter sequences")


def attention_probs(params, config: ModelConfig, tokens, attention_mask=None):
  """Every layer's attention probabilities, per query head.

  Args:
    params: either layout (`kvjax.params`: canonical or packed).
    config: the model; attention_impl must be 'einsum' (`check_probe`).
    tokens: [B, T] int ids, left-padded when `attention_mask` is given.
    attention_mask: [B, T] (1 = token, 0 = padding) or None.
  Returns:
    probs [L, B, N, T, T] float32 (jax array): probs[l, b, n, q, k] is the
    attention query q pays key k in layer l, head n. Rows of real queries
    sum to 1 over the keys they may attend (causal, inside the model's
    sliding window, not padding); every other entry is 0, and so are the
    rows of padding queries. MLA's heads are its N query heads.
  Raises:
    ValueError: bad params, tokens or mask (as `kvjax.forward`), or a
      request `check_probe` refuses.
  """
  params_lib.check_params(params, config)
  tokens = inference.check_tokens(tokens, config)
  mask = inference.check_mask(attention_mask, tokens)
  check_probe(config, *tokens.shape)
  return _attention_probs(params, config, jnp.asarray(tokens, jnp.int32),
                          jnp.asarray(mask))


def first_token_mass(probs_LBNTT, min_query: int = 0) -> jax.Array:
  """[L, N]: the mean attention queries at positions >= `min_query` pay
  the row's first token (a sink, when far above the uniform 1 / (t + 1)),
  from `attention_probs` of unpadded rows."""
  return jnp.mean(probs_LBNTT[:, :, :, min_query:, 0], axis=(1, 3))
