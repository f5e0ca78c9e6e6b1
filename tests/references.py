"""Reference computations the cached paths are checked against: the
no-cache forward over a whole sequence with an explicit attention mask (the
mask a cache policy implies), one definition for every test file."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import model as kvmodel
from kvjax.attention import Step
from kvjax.layers import rope_tables


def causal(n: int):
  """Query and key position grids [n, 1], [1, n] and the causal mask."""
  q, k = np.arange(n)[:, None], np.arange(n)[None, :]
  return q, k, k <= q


def window_mask(n: int, capacity: int) -> np.ndarray:
  """[n, n]: each query sees its `capacity` newest keys (itself included)."""
  q, k, mask = causal(n)
  return mask & (k > q - capacity)


def sinks_mask(n: int, capacity: int, sinks: int) -> np.ndarray:
  """[n, n]: the first `sinks` keys and the `capacity - sinks` newest."""
  q, k, mask = causal(n)
  return mask & ((k < sinks) | (k > q - (capacity - sinks)))


@functools.partial(jax.jit, static_argnames="config")
def masked_forward(params, config, tokens_BN, mask_NN):
  """No-cache logits [B, N, V] at positions 0..N-1 under an explicit
  [N, N] mask (True = attend), RoPE at the original positions."""
  b, n = tokens_BN.shape
  pos_BN = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
  cos, sin = rope_tables(config, pos_BN)
  step = Step(q_pos=pos_BN, mask=jnp.broadcast_to(mask_NN, (b, n, n)),
              cos_q=cos, sin_q=sin, mode="forward")
  x_BND, _ = kvmodel.run_layers(
      params, kvmodel.embed(params, tokens_BN, config), step, None, config)
  return kvmodel.unembed(params, x_BND, config)
