"""Mixed-precision matmuls as a function transformation: every float32
matrix product of a function runs on bfloat16 operands with float32
accumulation and a float32 result, forward and backward; everything else
(norms, softmax, the loss, the parameters, the optimiser) stays float32.

    logits_fn = mixed_precision.bf16_matmuls(logits_fn)

This is the training seam's precision choice (`kvjax.train`,
`TrainConfig.matmul_dtype`): the model code is untouched and never asks
which precision it runs in. It is what TPUs do by default and what
mixed-precision training on GPUs does with tensor cores; on a CPU with
AMX or AVX-512 BF16 it is where the matmul throughput is: the Intel Xeon
host runs the training step's products 2.2–4.4× faster in bfloat16 with
float32 accumulation than in float32 (WORKSPACE.md "Training speed"). On a
CPU without them (the AMD EPYC host: AVX2 only) XLA converts bfloat16
operands back to float32 and the same products run slower than float32
ones; `fastest_matmul_dtype` measures which of the two this backend runs
faster, the choice a `matmul_dtype='auto'` training run takes.

How: the function is traced to a jaxpr and re-evaluated with each
`dot_general` whose operands are both float32 replaced by `bf16_dot`, a
`jax.custom_vjp` whose backward products (cotangent × operand) are also
bfloat16 × bfloat16 → float32; the weight gradient (the sum over tokens)
is written so that XLA:CPU runs it as a bfloat16 GEMM too
(`_weight_grad`). Nested `jit` calls and `checkpoint`
(remat) regions are inlined and rewritten; loops and conditionals
(`scan`, `while`, `cond`) run as traced, their products in float32 —
the transformation never reaches inside a loop, so a layer scan or a
tiled attention loop keeps full precision (the training forward has
neither: `packed.for_training`).

Numerics: each product's operands are rounded to 8 significant bits;
sums are exact to float32. The loss curve of a run changes by that
rounding (not identical to a float32 run for the same seed); the
validation bits/byte it reaches is reported beside the float32 run's in
WORKSPACE.md.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import jax
from jax import lax
import jax.numpy as jnp

from jax.extend import core as jex_core
from jax._src import source_info_util  # the public API has no user_context

_F32, _BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)

# Higher-order primitives whose body is a plain function call: inlined, so
# their products are rewritten too. ('jaxpr' holds the body.)
_INLINE = frozenset({"pjit", "jit", "closed_call", "core_call", "remat",
                     "checkpoint", "remat2"})


# bfloat16 products are taken only where they are this much faster than
# float32 ones: the hosts measured are far on either side (bfloat16 5.6x
# faster on the Intel Xeon's AMX, 0.7x on the AMD EPYC's AVX2), so probe
# noise on a shared host cannot flip the choice.
_BF16_MIN_SPEEDUP = 1.25


@functools.cache
def matmul_speeds(n: int = 1024, repeats: int = 5) -> dict[str, float]:
  """FLOP/s of an n × n × n product on the default backend, per operand
  dtype: 'float32', and 'bfloat16' with float32 accumulation (the form
  `bf16_dot` runs). Best of `repeats` after two warm-up calls; measured
  once per process (~0.3 s of one CPU core at n = 1024)."""
  if n < 1 or repeats < 1:
    raise ValueError(f"n and repeats must be >= 1, got {n}, {repeats}")
  product = jax.jit(lambda a, b: jnp.matmul(
      a, b, preferred_element_type=_F32))
  speeds = {}
  for dtype in (_F32, _BF16):
    a = jax.random.normal(jax.random.key(0), (n, n), _F32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), _F32).astype(dtype)
    times = []
    for i in range(2 + repeats):
      t0 = time.perf_counter()
      product(a, b).block_until_ready()
      if i >= 2:
        times.append(time.perf_counter() - t0)
    speeds[dtype.name] = 2.0 * n ** 3 / min(times)
  return speeds


def fastest_matmul_dtype() -> str:
  """'bfloat16' where the default backend runs bfloat16 × bfloat16 →
  float32 products at least 1.25× faster than float32 ones
  (`matmul_speeds`: TPUs, GPU tensor cores, CPUs with AMX or AVX-512
  BF16), else 'float32'. Measured, not looked up, so a new backend gets
  the right answer without a table."""
  speeds = matmul_speeds()
  if speeds["bfloat16"] >= _BF16_MIN_SPEEDUP * speeds["float32"]:
    return "bfloat16"
  return "float32"


def _dims(dimension_numbers):
  (lc, rc), (lb, rb) = dimension_numbers
  return tuple(lc), tuple(rc), tuple(lb), tuple(rb)


def _bf16_product(x, y, dimension_numbers):
  return lax.dot_general(x.astype(_BF16), y.astype(_BF16), dimension_numbers,
                         preferred_element_type=_F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def bf16_dot(x, y, dimension_numbers):
  """`lax.dot_general(x, y, dimension_numbers)` for float32 x, y with
  bfloat16 operands and float32 accumulation; float32 result. The
  backward products are bfloat16 × bfloat16 → float32 as well."""
  return _bf16_product(x, y, dimension_numbers)


def _bf16_dot_fwd(x, y, dimension_numbers):
  xb, yb = x.astype(_BF16), y.astype(_BF16)
  # Residuals in bfloat16: half the activation memory of float32 ones.
  return (lax.dot_general(xb, yb, dimension_numbers,
                          preferred_element_type=_F32), (xb, yb))


def _bf16_dot_bwd(dimension_numbers, res, ct):
  xb, yb = res
  ctb = ct.astype(_BF16)
  lc, rc, lb, rb = _dims(dimension_numbers)
  nb = len(lb)
  x_free = [i for i in range(xb.ndim) if i not in lc and i not in lb]
  y_free = [i for i in range(yb.ndim) if i not in rc and i not in rb]
  # The output's axes: batch, x's free axes, y's free axes (in order).
  ct_x = list(range(nb, nb + len(x_free)))
  ct_y = list(range(nb + len(x_free), ct.ndim))
  # dx = ct · y over y's free axes; result axes: batch, x_free, then y's
  # contracting axes in increasing order (each paired with an axis of x).
  dx = lax.dot_general(ctb, yb, ((ct_y, y_free), (list(range(nb)), list(rb))),
                       preferred_element_type=_F32)
  dx_axes = list(lb) + x_free + [lc[rc.index(r)] for r in sorted(rc)]
  dx = lax.transpose(dx, [dx_axes.index(i) for i in range(xb.ndim)])
  return dx, _weight_grad(xb, ctb, dimension_numbers, yb.ndim)


def _split_tokens(a, axes):
  """`a` with its token `axes` (contiguous) as one axis split in two,
  (n / c, c), where they are one axis with such a factor; returns the
  array and its token axes after the split."""
  if len(axes) == 1:
    (t,), n = axes, a.shape[axes[0]]
    c = next((c for c in (256, 128, 64, 32, 16, 8) if n % c == 0 and n > c),
             None)
    if c is not None:
      return a.reshape(a.shape[:t] + (n // c, c) + a.shape[t + 1:]), [t, t + 1]
  return a, list(axes)


def _weight_grad(xb, ctb, dimension_numbers, y_ndim):
  """dy = x · ct summed over x's free axes (the tokens), in y's axis order.

  Written so that XLA:CPU runs it as a bfloat16 GEMM on row-major
  operands. The plain product contracts both operands' leading (token)
  axis; XLA:CPU's bfloat16 GEMM (YNNPACK) does not take a transposed left
  operand, so it converts both to float32 and runs a float32 GEMM: 21 ms
  for the [4096, 256]ᵀ × [4096, 1408] of the training step against 6.8
  ms in bfloat16 with the operand transposed first (one core, Intel
  Xeon). So the left operand is transposed here, tokens minor, and the
  token axis is split in two first: a transpose alone is folded into the
  operand's layout (the same transposed GEMM), while the collapse of a
  transposed split axis is a real copy. The operands are ordered so the
  product's axes are y's (a transpose after the product is folded back
  into it by swapping the operands, transposed again). Values are those
  of the plain product (float32 accumulation of the same terms).
  """
  lc, rc, lb, rb = _dims(dimension_numbers)
  nb = len(lb)
  x_free = [i for i in range(xb.ndim) if i not in lc and i not in lb]
  y_c = sorted(rc)  # y's contracting axes; x's partner of each:
  x_c = [lc[rc.index(r)] for r in y_c]
  y_free = [i for i in range(y_ndim) if i not in rc and i not in rb]
  ct_x = list(range(nb, nb + len(x_free)))  # ct: batch, x_free, y_free
  ct_y = list(range(nb + len(x_free), ctb.ndim))
  batch = list(range(nb))
  xs, x_tok = _split_tokens(xb, x_free)
  cs, c_tok = _split_tokens(ctb, ct_x)
  grow = len(x_tok) - len(x_free)
  x_at = lambda i: i if i < x_free[0] else i + grow  # x's axes after split
  c_at = lambda i: i if i < ct_x[0] else i + grow
  x_kept = [x_at(i) for i in lb] + [x_at(i) for i in x_c]
  if list(rb) + y_free + y_c == list(range(y_ndim)):
    # y is [batch, free, contracting] (a weight stored [out, in]): ct is
    # the left operand, tokens minor; x [batch, tokens, contracting].
    lhs = lax.transpose(cs, batch + [c_at(i) for i in ct_y] + c_tok)
    rhs = lax.transpose(xs, [x_at(i) for i in lb] + x_tok +
                        [x_at(i) for i in x_c])
    out_axes = list(rb) + y_free + y_c
  else:
    # x is the left operand, tokens minor; ct [batch, tokens, y_free].
    lhs = lax.transpose(xs, x_kept + x_tok)
    rhs = cs
    out_axes = list(rb) + y_c + y_free
  k = len(x_tok)
  dy = lax.dot_general(lhs, rhs, ((list(range(lhs.ndim - k, lhs.ndim)),
                                   list(range(nb, nb + k))), (batch, batch)),
                       preferred_element_type=_F32)
  return lax.transpose(dy, [out_axes.index(i) for i in range(y_ndim)])


bf16_dot.defvjp(_bf16_dot_fwd, _bf16_dot_bwd)


def _rewritable(eqn) -> bool:
  if eqn.primitive.name != "dot_general":
    return False
  x, y = (v.aval for v in eqn.invars)
  out = eqn.params.get("preferred_element_type")
  (_, _), (lb, _) = eqn.params["dimension_numbers"]
  return (x.dtype == _F32 and y.dtype == _F32 and not lb
          and (out is None or jnp.dtype(out) == _F32))


def _eval(jaxpr, consts: Sequence, args: Sequence) -> list:
  env = {}

  def read(v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  for var, val in zip(jaxpr.constvars, consts):
    env[var] = val
  for var, val in zip(jaxpr.invars, args):
    env[var] = val
  for eqn in jaxpr.eqns:
    with source_info_util.user_context(eqn.source_info.traceback,
                                       name_stack=eqn.source_info.name_stack):
      outs = _eval_eqn(eqn, [read(v) for v in eqn.invars])
    for var, val in zip(eqn.outvars, outs):
      env[var] = val
  return [read(v) for v in jaxpr.outvars]


def _eval_eqn(eqn, invals: list) -> list:
  """One equation, rewritten where it is a float32 product; the source
  location travels with it (profiles and HLO metadata name the model's
  line, not this interpreter's)."""
  if _rewritable(eqn):
    return [bf16_dot(*invals, eqn.params["dimension_numbers"])]
  body = eqn.params.get("jaxpr")
  if eqn.primitive.name in _INLINE and body is not None:
    if isinstance(body, jex_core.ClosedJaxpr):
      return _eval(body.jaxpr, body.consts, invals)
    return _eval(body, (), invals)
  bind = eqn.primitive.get_bind_params(eqn.params)
  # Older JAX returns (subfuns, params), newer the params alone.
  subfuns, params = bind if isinstance(bind, tuple) else ((), bind)
  with eqn.ctx.manager:
    outs = eqn.primitive.bind(*subfuns, *invals, **params)
  return outs if eqn.primitive.multiple_results else [outs]


def bf16_matmuls(fn: Callable) -> Callable:
  """`fn` with its float32 matrix products in bfloat16 × bfloat16 → float32
  (see the module docstring). Same signature, pytrees in and out; traces
  `fn` once per call (use it inside `jit`)."""

  @functools.wraps(fn)
  def wrapped(*args):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    flat_args = jax.tree_util.tree_leaves(args)
    flat_out = _eval(closed.jaxpr, closed.consts, flat_args)
    return jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(out_shape), flat_out)

  return wrapped
