"""Tests for kvjax.mixed_precision: bfloat16-operand products with float32
accumulation, forward and backward, as a function transformation, and the
training seam that uses it (`TrainConfig.matmul_dtype`)."""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import configs
from kvjax import mixed_precision as mp
from kvjax import train as train_lib

# (x shape, y shape, dimension_numbers): a plain matmul, a contraction
# over two axes in shuffled order, batch axes that are not leading, and a
# product with free axes on both sides of the contraction; and the
# training model's linear layers, token rows against weights stored
# [out, in] and [in, out], with token counts the weight gradient splits
# (`mixed_precision._split_tokens`) and one it cannot (prime).
_PRODUCTS = {
    "rows_w_out_in": ((512, 32), (48, 32), (((1,), (1,)), ((), ()))),
    "rows_w_in_out": ((512, 32), (32, 48), (((1,), (0,)), ((), ()))),
    "batch_rows_w_out_in": ((4, 16, 32), (48, 32), (((2,), (1,)), ((), ()))),
    "prime_rows": ((13, 32), (48, 32), (((1,), (1,)), ((), ()))),
    "matmul": ((6, 5), (5, 7), (((1,), (0,)), ((), ()))),
    "two_contracting": ((3, 4, 5), (5, 2, 4), (((1, 2), (2, 0)), ((), ()))),
    "batched": ((4, 3, 5), (5, 3, 6), (((2,), (0,)), ((1,), (1,)))),
    "rhs_first": ((7, 2, 3), (3, 4, 2, 5), (((2, 1), (0, 2)), ((), ()))),
}


def _round(x):
  return x.astype(jnp.bfloat16).astype(jnp.float32)


class Bf16DotTest(parameterized.TestCase):

  @parameterized.named_parameters(*[(k, *v) for k, v in _PRODUCTS.items()])
  def test_forward_and_backward_are_products_of_rounded_operands(
      self, x_shape, y_shape, dims):
    kx, ky, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, x_shape)
    y = jax.random.normal(ky, y_shape)
    out, vjp = jax.vjp(lambda a, b: mp.bf16_dot(a, b, dims), x, y)
    # Compiled whole, as in training (XLA then rewrites the products
    # together, and every one must still run on this backend).
    ct = jax.random.normal(kc, out.shape)
    jit_dx, jit_dy = jax.jit(lambda a, b, c: jax.vjp(
        lambda a, b: mp.bf16_dot(a, b, dims), a, b)[1](c))(x, y, ct)
    self.assertEqual(out.dtype, jnp.float32)
    # The forward: the float32 product of the rounded operands (the same
    # exact products; sums equal to float32 reassociation).
    f32_dot = lambda a, b: lax.dot_general(a, b, dims,
                                           precision=lax.Precision.HIGHEST)
    np.testing.assert_allclose(out, f32_dot(_round(x), _round(y)), rtol=1e-5,
                               atol=1e-5)
    # The backward: the VJP of that product at the rounded operands,
    # applied to the rounded cotangent.
    dx, dy = vjp(ct)
    _, vjp_ref = jax.vjp(f32_dot, _round(x), _round(y))
    want_dx, want_dy = vjp_ref(_round(ct))
    chex.assert_shape(dx, x.shape)
    chex.assert_shape(dy, y.shape)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(want_dx), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(dy), np.asarray(want_dy), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(jit_dx), np.asarray(want_dx),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jit_dy), np.asarray(want_dy),
                               rtol=1e-5, atol=1e-5)
    # And it is not the float32 product (the rounding is real).
    self.assertGreater(
        float(jnp.abs(out - lax.dot_general(x, y, dims)).max()), 1e-4)


def _products(fn, *args):
  """(operand dtypes, has batch dims) of every dot_general fn runs, loops'
  bodies included."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        (_, _), (lb, _) = eqn.params["dimension_numbers"]
        found.append((tuple(str(v.aval.dtype) for v in eqn.invars),
                      bool(lb)))
      for sub in _subjaxprs(eqn):
        walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def _subjaxprs(eqn):
  for v in eqn.params.values():
    for item in (v if isinstance(v, (tuple, list)) else (v,)):
      if hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
        yield item.jaxpr
      elif hasattr(item, "eqns"):
        yield item


class Bf16MatmulsTest(absltest.TestCase):

  def test_rewrites_products_through_jit_and_checkpoint_not_loops(self):
    w = jax.random.normal(jax.random.key(1), (8, 8))

    @jax.jit
    def inner(x):
      return jnp.tanh(x @ w)

    def fn(x):
      h = jax.checkpoint(lambda a: inner(a) @ w)(x)
      h = h + jnp.einsum("bij,bjk->bik", h[None], w[None])[0]  # batch dims
      # A loop body keeps float32 (the transformation never enters it).
      h, _ = lax.scan(lambda c, _: (c @ w, None), h, None, length=2)
      return jnp.sum(h)

    x = jax.random.normal(jax.random.key(2), (4, 8))
    got = _products(mp.bf16_matmuls(fn), x)
    plain = [p for p in got if not p[1]]
    # inner's product and the checkpointed one: bfloat16; the scan's: f32.
    self.assertEqual(sum(p[0] == ("bfloat16", "bfloat16") for p in plain), 2)
    self.assertIn((("float32", "float32"), False), got)  # the scan body
    self.assertIn((("float32", "float32"), True), got)  # the batched einsum
    # Same value up to the rounding, and gradients flow through.
    np.testing.assert_allclose(mp.bf16_matmuls(fn)(x), fn(x), rtol=5e-2)
    g = jax.grad(mp.bf16_matmuls(fn))(x)
    chex.assert_tree_all_finite(g)
    np.testing.assert_allclose(g, jax.grad(fn)(x), rtol=0.1, atol=0.1)

  def test_pytrees_in_and_out(self):
    fn = lambda p, x: {"y": x @ p["w"], "n": jnp.sum(x)}
    p = {"w": jnp.ones((3, 2))}
    out = mp.bf16_matmuls(fn)(p, jnp.ones((4, 3)))
    self.assertEqual(set(out), {"y", "n"})
    chex.assert_shape(out["y"], (4, 2))

  def test_non_float32_products_untouched(self):
    fn = lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.int32)
    a = jnp.ones((2, 3), jnp.int8)
    got = _products(mp.bf16_matmuls(fn), a, a.T)
    self.assertEqual(got, [(("int8", "int8"), False)])


class TrainingSeamTest(absltest.TestCase):

  def _model(self):
    from configs import train as presets  # pylint: disable=g-import-not-at-top
    cfg = presets.get_config("gqa")
    cfg.model.update(num_layers=1, embed_dim=64, num_heads=2, head_dim=32,
                     num_kv_heads=1, mlp_dim=128)
    config = configs.model_config(cfg.model)
    return config, kvjax.init_params(config, jax.random.key(0))

  def test_bfloat16_logits_fn_is_close_not_equal_and_eval_is_float32(self):
    config, params = self._model()
    tokens = jax.random.randint(jax.random.key(3), (2, 17), 0, 256)
    f32 = train_lib.model_logits_fn(config)
    bf16 = train_lib.model_logits_fn(config, "bfloat16")
    a, b = jax.jit(f32)(params, tokens), jax.jit(bf16)(params, tokens)
    self.assertGreater(float(jnp.abs(a - b).max()), 0)
    np.testing.assert_allclose(a, b, atol=0.05)
    tc = train_lib.TrainConfig(seq_len=16, batch_size=2, num_steps=4,
                               warmup_steps=1, matmul_dtype="bfloat16")
    state = train_lib.create_train_state(params, bf16,
                                         train_lib.make_optimizer(tc),
                                         eval_logits_fn=f32)
    nll, count = train_lib.eval_step(state, tokens)
    want, _ = train_lib.masked_nll(a[:, :-1], tokens[:, 1:])
    np.testing.assert_allclose(nll, want, rtol=1e-5)
    self.assertEqual(float(count), 32)
    state, m = train_lib.train_step(state, tokens)
    self.assertTrue(np.isfinite(float(m["loss"])))
    self.assertEqual(int(state.step), 1)

  def test_unknown_matmul_dtype_names_the_field(self):
    with self.assertRaisesRegex(ValueError, "matmul_dtype"):
      train_lib.TrainConfig(matmul_dtype="float16")
    config, _ = self._model()
    with self.assertRaisesRegex(ValueError, "matmul_dtype"):
      train_lib.model_logits_fn(config, "int8")

  def test_auto_takes_bfloat16_only_where_it_multiplies_faster(self):
    config, params = self._model()
    tokens = jax.random.randint(jax.random.key(3), (2, 17), 0, 256)
    for speeds, want in (({"float32": 100.0, "bfloat16": 560.0}, "bfloat16"),
                         ({"float32": 68.0, "bfloat16": 48.0}, "float32"),
                         # within the margin: the float32 products stay
                         ({"float32": 100.0, "bfloat16": 120.0}, "float32")):
      with mock.patch.object(mp, "matmul_speeds",
                             return_value=speeds):
        self.assertEqual(train_lib.resolve_matmul_dtype("auto"), want)
        got = jax.jit(train_lib.model_logits_fn(config, "auto"))(params,
                                                                  tokens)
      ref = jax.jit(train_lib.model_logits_fn(config, want))(params, tokens)
      np.testing.assert_array_equal(got, ref)
    self.assertEqual(train_lib.resolve_matmul_dtype("float32"), "float32")
    self.assertEqual(train_lib.resolve_matmul_dtype("bfloat16"), "bfloat16")

  def test_matmul_speeds_measures_both_dtypes(self):
    speeds = mp.matmul_speeds(n=64, repeats=1)
    self.assertEqual(set(speeds), {"float32", "bfloat16"})
    self.assertTrue(all(v > 0 for v in speeds.values()))
    self.assertIn(mp.fastest_matmul_dtype(),
                  ("float32", "bfloat16"))
    with self.assertRaisesRegex(ValueError, "repeats"):
      mp.matmul_speeds(n=64, repeats=0)


if __name__ == "__main__":
  absltest.main()
