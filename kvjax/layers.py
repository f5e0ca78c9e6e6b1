"""Stateless building blocks: RMSNorm, rotary embeddings, SwiGLU.

All functions are pure; shapes use the alphabet of `kvjax.config`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import norm_matvec
from kvjax.config import ModelConfig, RopeScaling


def rms_norm(x, scale, eps: float, invalid_B=None):
  """RMSNorm in float32, cast back to x's dtype. x [B, ..., D], scale [D].

  invalid_B: [B] bool or None; True rows come out NaN (`kvjax.errors`).
  """
  x32 = x.astype(jnp.float32)
  var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  # A mean square that overflows float32 (|x| past ~1e19) would make rsqrt
  # 0 and the row finite zeros: garbage that looks valid. NaN instead, so
  # the step records non-finite logits (kvjax.errors). One select per row.
  ok = var < jnp.inf
  if invalid_B is not None:
    ok &= ~invalid_B.reshape((-1,) + (1,) * (x.ndim - 1))
  inv = jnp.where(ok, jax.lax.rsqrt(var + eps), jnp.nan)
  y = x32 * inv
  scale = scale.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
  return (y * scale).astype(x.dtype)


def merge_heads_out(out_BTNH, w_NHD):
  """The attention output projection 'BTNH,NHD->BTD' as one 2-D matmul.

  Why not the einsum: XLA on CPU runs a dot with two contracting dims (N, H)
  ~9x slower than the same bytes as a [B·T, N·H] x [N·H, D] matmul (2.4 vs
  21 GB/s for medium's 12 x 64 x 768 weight; WORKSPACE.md). The reshapes of
  contiguous trailing dims are free, so the math and layout are unchanged.
  """
  B, T, N, H = out_BTNH.shape
  w_ND = w_NHD.reshape(N * H, w_NHD.shape[-1])
  return out_BTNH.reshape(B, T, N * H) @ w_ND


# Row counts up to this use the weight-on-the-left product in `linear_t`.
SKINNY_ROWS = 64


def linear_t(x, w_oi, preferred_element_type=None, *,
             norm_input: bool = False):
  """x @ w_oi.T for a weight stored [out, in] (o, i: placeholders for its
  two dims), as in the packed decode layout (`kvjax.params.pack`).
  x [..., i] -> [..., o].

  Why this form: for decode's few rows (batch 1 or a few sequences), XLA's
  CPU dot reads an [out, in] weight fastest as the left operand (`W @ x`:
  each output is a contiguous row dot product). Medium's decode weights
  read at 32 GB/s that way against 24 GB/s for `x @ W` on [in, out], and
  the 8-row products are 1.3x faster (WORKSPACE.md). Left alone, XLA's
  simplifier rewrites `(W @ x.T).T` as `x @ W.T` and then transposes W
  inside the dot fusion, a strided read of every weight on every step; the
  optimization barrier keeps the product as written. It changes no values,
  and on other backends it only fixes the operand order. Above
  `SKINNY_ROWS` rows (prefill) the product is a real GEMM and the plain
  `x @ W.T` is as fast (8x128 medium prefill: 917 vs 900 ms canonical)
  while the barrier form's transposes cost 24%.

  `preferred_element_type`: the product's dtype (as in `jnp.matmul`).
  `norm_input`: x is a cheap elementwise function of one stored vector (an
  RMSNorm's output). For a single row the product may then be written
  plainly, `x @ W.T`: XLA's CPU backend turns that matrix-vector product
  into one loop over the weight's rows, split across the cores, with the
  norm's multiplies fused in. Faster on some CPUs, slower on others
  (medium's batch-1 decode: +5.6 % GQA on the AMD EPYC Zen 4; 1.10–1.26x
  slower on the Intel Xeon), so the form is measured per process
  (`kvjax.norm_matvec`). Not for inputs that cost work to make (the down
  product's SiLU, the attention's value product): the loop would redo that
  work once per weight row.
  """
  lead, n_out = x.shape[:-1], w_oi.shape[0]
  rows = x.reshape(-1, x.shape[-1])
  dot = lambda a, b: jnp.matmul(a, b,
                                preferred_element_type=preferred_element_type)
  if rows.shape[0] == 1 and norm_input and norm_matvec.fused():
    return dot(rows, w_oi.T).reshape(*lead, n_out)
  if rows.shape[0] == 1:  # a matrix-vector product
    return jax.lax.optimization_barrier(dot(w_oi, rows[0])).reshape(*lead,
                                                                  n_out)
  if rows.shape[0] > SKINNY_ROWS:
    return dot(rows, w_oi.T).reshape(*lead, n_out)
  return jax.lax.optimization_barrier(dot(w_oi, rows.T)).T.reshape(*lead,
                                                                   n_out)


def linear_t_heads(x, w_Noi, preferred_element_type=None):
  """Per-head `linear_t`: x [..., N, i] times head n's [out, in] weight
  w_Noi[n] -> [..., N, o] (MLA's absorbed W_UK and W_UV in the packed
  layout). Same operand order and barrier as `linear_t` for up to
  `SKINNY_ROWS` rows; canonical [in, N, out] weights made XLA transpose
  both MLA weights on every decode step (19% of medium's batch-1 step).
  """
  lead, (N, n_out, n_in) = x.shape[:-2], w_Noi.shape
  x_TNi = x.reshape(-1, N, n_in)  # T: every leading row (B·T tokens)
  if x_TNi.shape[0] > SKINNY_ROWS:
    return jnp.einsum("TNi,Noi->TNo", x_TNi, w_Noi,
                      preferred_element_type=preferred_element_type
                      ).reshape(*lead, N, n_out)
  y_NoT = jax.lax.optimization_barrier(
      jnp.einsum("Noi,TNi->NoT", w_Noi, x_TNi,
                 preferred_element_type=preferred_element_type))
  return jnp.moveaxis(y_NoT, -1, 0).reshape(*lead, N, n_out)


def swiglu(x, w_gate, w_up, w_down):
  """SwiGLU MLP. x [..., D]; w_gate, w_up [D, F]; w_down [F, D]."""
  h = jax.nn.silu(x @ w_gate) * (x @ w_up)
  return h @ w_down


# ---- rotary position embedding ---------------------------------------------
def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(dim: int, theta: float,
                     scaling: RopeScaling) -> tuple[np.ndarray, float]:
  """Inverse frequencies [dim // 2] and the cos/sin amplitude factor.

  Computed in numpy at trace time: the config is static, so the tables are
  constants of the compiled program. Follows the Hugging Face definitions of
  `linear`, `llama3` and `yarn`; `dynamic` equals the default inside the
  original context (kvjax uses static shapes, so it never rescales).
  """
  inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
  amplitude = 1.0
  kind = scaling.kind
  if kind == "linear":
    inv_freq = inv_freq / scaling.factor
  elif kind == "llama3":
    old_len = scaling.original_max_position
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor,
                      inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv_freq = np.where(medium, smoothed, scaled)
  elif kind == "yarn":
    factor = scaling.factor
    if scaling.attention_factor is not None:
      amplitude = scaling.attention_factor
    elif scaling.mscale and scaling.mscale_all_dim:
      amplitude = (_yarn_mscale(factor, scaling.mscale) /
                   _yarn_mscale(factor, scaling.mscale_all_dim))
    else:
      amplitude = _yarn_mscale(factor)

    def correction_dim(rotations):
      return (dim * math.log(scaling.original_max_position /
                             (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), dim - 1)
    if low == high:
      high += 0.001
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + (
        inv_freq * extrapolation)
  return inv_freq.astype(np.float32), float(amplitude)


def rope_tables(config: ModelConfig, positions):
  """cos, sin [..., R/2] for integer positions [...] (float32)."""
  inv_freq, amplitude = rope_frequencies(config.rope_dim, config.rope_theta,
                                         config.rope_scaling)
  inv_freq = jnp.asarray(inv_freq).reshape((1,) * positions.ndim + (-1,))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  return jnp.cos(angles) * amplitude, jnp.sin(angles) * amplitude


def apply_rope(x, cos, sin, layout: str):
  """Rotates x [..., R] by cos/sin broadcastable to [..., R/2].

  `half`: pairs (i, i + R/2) (Llama, Mistral, Qwen2: "rotate half").
  `interleaved`: pairs (2i, 2i + 1) (DeepSeek, the original RoFormer).
  """
  dtype = x.dtype
  x = x.astype(jnp.float32)
  if layout == "half":
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  else:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    out = out.reshape(x.shape)
  return out.astype(dtype)
