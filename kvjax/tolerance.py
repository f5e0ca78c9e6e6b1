"""How closely two computations of one quantity must agree, from their dtypes.

Two kvjax programs that compute the same function (packed vs canonical
params, a blocked vs a stacked cache, cached decode vs the no-cache forward,
a sharded vs a single-device run, kvjax vs transformers) differ only by
rounding; a lossy cache (bfloat16, float16, int8, int4, int2) differs from
float32 by its storage error. Neither difference is a property of the host:
which way a reassociated sum rounds depends on how XLA fuses it, and that
differs between CPUs (AVX-512 vs AVX2 kernels). So a comparison's tolerance is
derived from the numbers compared, never tuned on one machine:

  u(d)   unit roundoff of dtype d: finfo(d).eps / 2 for floats (float32
         2^-24, float16 2^-11, bfloat16 2^-8); int8 (symmetric, 127 levels
         per scale): half a step, 1/254 of the scaled vector's maximum;
         int4 (7 levels): 1/14 of it; int2 (asymmetric, 3 steps over
         max - min <= 2 max|x|): 1/3 of it.

  rtol = depth · (REASSOC · u(compute) + STORE · u(cache))
  atol = rtol · scale

  * REASSOC = 64 = sqrt(4096): a sum of n terms evaluated in another order
    differs by about sqrt(n)·u relative to the magnitude of its terms
    (random-sign rounding errors), and no reduction here is longer than
    4096 terms (embedding width, MLP width, attended slots).
  * STORE = 8 = 2 · 2 · 2: each stored number is off by at most one ulp
    (2u: two programs may round one value to neighbouring representable
    numbers, and a lossy cache is off by u from float32 with a scale that is
    itself rounded); keys and values are both stored; the error enters once
    through the softmax and once through the residual stream.
    For a float32 cache the term vanishes against REASSOC (u(cache) =
    u(compute)), so it is only counted when the cache is narrower than the
    compute dtype.
  * depth: the layers the error passes through (errors of successive layers
    add): num_layers + 1 for logits (the unembedding is one more product).
  * scale: the magnitude of the compared values, max |expected|: rounding
    errors are relative to the terms summed, so entries near zero are held
    to the same absolute bound as the largest one instead of to a relative
    bound they cannot meet (an all-zero reference must be matched exactly).

Exact comparisons stay exact: token ids from well-separated logits, integer
caches, positions, lengths and byte counts are compared with equality.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

REASSOC = 64
STORE = 8


def unit_roundoff(dtype) -> float:
  """u(dtype): half the spacing of representable numbers near 1 (for int8,
  half a quantization step relative to the scaled maximum)."""
  name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
  if name == "int8":
    return 1.0 / 254.0
  if name == "int4":
    return 1.0 / 14.0
  if name == "int2":  # asymmetric: half of (max - min) / 3 <= max|x| / 3
    return 1.0 / 3.0
  return float(np.finfo(np.dtype(name) if name != "bfloat16"
                        else jax.numpy.bfloat16).eps) / 2.0


@dataclasses.dataclass(frozen=True)
class Tolerance:
  """A relative bound, and the absolute one it implies at unit scale."""

  rtol: float

  def atol(self, scale: float) -> float:
    return self.rtol * float(scale)


def tolerance(config=None, *, compute=None, cache="float32",
              depth: int | None = None) -> Tolerance:
  """The tolerance of the module docstring.

  Args:
    config: a `ModelConfig` (optional): its compute dtype and depth
      (num_layers + 1) are the defaults.
    compute: the compute dtype (default config.compute_dtype, else float32).
    cache: the cache's storage dtype name ('float32', 'bfloat16', 'float16',
      'int8', 'int4', 'int2'; KIVI's as well).
    depth: layers the error passes through (default num_layers + 1, else 1).
  """
  if compute is None:
    compute = config.compute_dtype if config is not None else "float32"
  if depth is None:
    depth = config.num_layers + 1 if config is not None else 1
  u_c = unit_roundoff(compute)
  u_s = unit_roundoff(cache)
  store = STORE * u_s if u_s > u_c else 0.0
  return Tolerance(rtol=depth * (REASSOC * u_c + store))


def max_error(actual, expected) -> tuple[float, float]:
  """(max |actual - expected|, max |expected|) over two arrays or pytrees
  of the same structure (float64 on the host)."""
  a_leaves = jax.tree_util.tree_leaves(actual)
  e_leaves = jax.tree_util.tree_leaves(expected)
  if len(a_leaves) != len(e_leaves):
    raise ValueError(f"{len(a_leaves)} leaves vs {len(e_leaves)}")
  err, scale = 0.0, 0.0
  for a, e in zip(a_leaves, e_leaves):
    a = np.asarray(a, np.float64)
    e = np.asarray(e, np.float64)
    if a.shape != e.shape:
      raise ValueError(f"shapes differ: {a.shape} vs {e.shape}")
    if a.size:
      err = max(err, float(np.max(np.abs(a - e))))
      scale = max(scale, float(np.max(np.abs(e))))
  return err, scale


def assert_close(actual, expected, config=None, *, compute=None,
                 cache="float32", depth: int | None = None, msg: str = ""):
  """Asserts max |actual - expected| <= tolerance(...).atol(max |expected|)
  (arrays or pytrees; NaN anywhere fails)."""
  tol = tolerance(config, compute=compute, cache=cache, depth=depth)
  err, scale = max_error(actual, expected)
  bound = tol.atol(scale)
  if not err <= bound:  # NaN fails too
    raise AssertionError(
        f"{msg + ': ' if msg else ''}max |difference| {err:.3e} exceeds "
        f"{bound:.3e} = rtol {tol.rtol:.3e} x scale {scale:.3g} "
        f"(compute={compute or (config.compute_dtype if config else 'float32')},"
        f" cache={cache}, depth={depth or (config.num_layers + 1 if config else 1)})")
