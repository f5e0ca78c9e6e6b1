"""MLA (DeepSeek-V2/V3 multi-head latent attention), verified on tiny dims.

Invariants: the layer equals an independent float64 numpy implementation of
the paper's equations (with and without q_lora, both RoPE layouts); both
decode paths equal the no-cache forward, each other, and prefill of the
longer prompt, and trace once; the cache is latent (its leaves, shapes, bytes
and contents); the absorbed decode never builds per-head K/V (its jaxpr, with
the naive path as the positive control); presets keep DeepSeek-V2's ratios;
bad dims, mismatched params and foreign caches raise ValueError naming the
field.

The dims are pairwise distinct (N=3, R=8, V=10, P=12, Q=16, C=24, S=28,
N·V=30, N·P=36, D=48) so a shape in a jaxpr names its axes unambiguously.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import mla
from kvjax import model
from kvjax import params as params_lib
from kvjax.lab import published
from kvjax.tolerance import assert_close
from configs import model as model_presets
import cases  # pylint: disable=g-bad-import-order

BASE = dict(vocab_size=64, num_layers=2, embed_dim=48, num_heads=3,
            mlp_dim=64, attention="mla", kv_lora_rank=24, qk_nope_head_dim=12,
            qk_rope_head_dim=8, v_head_dim=10, rope_layout="interleaved",
            # Wider logit gaps than the default init (see test_core.py).
            init_scale=0.15)
Q_LORA = 16
B, S = 2, 28
T_PROMPT, T_TOTAL = 5, 9
MLA_EPS = 1e-6  # DeepSeek's hard-coded q_a / kv_a norm eps


@functools.lru_cache(maxsize=None)
def config(path="absorbed", q_lora=0, layout="interleaved"):
  return kvjax.ModelConfig(**dict(BASE, mla_decode=path, q_lora_rank=q_lora,
                                  rope_layout=layout))


@functools.lru_cache(maxsize=None)
def params_for(q_lora=0):
  """Params depend only on the shapes: shared by both decode paths. (Jitted:
  one compile instead of one per eager random op.)"""
  return jax.jit(kvjax.init_params, static_argnums=0)(
      config(q_lora=q_lora), jax.random.key(q_lora))


def name(c: kvjax.ModelConfig) -> str:
  """Test-case name read from the config, never typed beside it."""
  q = f"q_lora{c.q_lora_rank}" if c.q_lora_rank else "direct_q"
  return f"{c.mla_decode}_{q}_{c.rope_layout}"


# Test data comes from numpy: eager jax.random ops would each compile.
def tokens(length=T_TOTAL, seed=3):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(0, BASE["vocab_size"], (B, length)),
                     jnp.int32)


def normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape),
                     jnp.float32)


def copy_tree(tree):
  """A fresh copy (the public API donates caches)."""
  return jax.tree_util.tree_map(jnp.copy, tree)


# ---- an independent reference: DeepSeek-V2 §2.1 in float64 numpy ----------
def ref_rms_norm(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def ref_rope(x, pos, theta, layout):
  """Rotates x [..., T, (heads,) R] as complex pairs z · e^{i·pos·θ_j}."""
  R = x.shape[-1]
  angle = pos[:, None] * theta ** (-np.arange(0, R, 2) / R)  # [T, R/2]
  angle = angle.reshape(angle.shape[:1] + (1,) * (x.ndim - 3) +
                        angle.shape[1:])
  if layout == "interleaved":  # pairs (2j, 2j + 1)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angle)
    return np.stack([z.real, z.imag], axis=-1).reshape(x.shape)
  z = (x[..., :R // 2] + 1j * x[..., R // 2:]) * np.exp(1j * angle)
  return np.concatenate([z.real, z.imag], axis=-1)


def ref_latents(p, x, c):
  """Per token: the normed latent c_kv [.., C] and the rotated shared key."""
  C = c.kv_lora_rank
  kv = x @ p["kv_a"]
  pos = np.arange(x.shape[-2], dtype=np.float64)
  return (ref_rms_norm(kv[..., :C], p["kv_a_norm"], MLA_EPS),
          ref_rope(kv[..., C:], pos, c.rope_theta, c.rope_layout))


def ref_mla(p, x, c):
  """Causal MLA over x [B, T, D], per-head keys and values expanded."""
  p = {k: np.asarray(v, np.float64) for k, v in p.items()}
  x = np.asarray(x, np.float64)
  P = c.qk_nope_head_dim
  T = x.shape[1]
  if c.q_lora_rank:
    q = np.einsum("btq,qnj->btnj",
                  ref_rms_norm(x @ p["q_a"], p["q_a_norm"], MLA_EPS), p["q_b"])
  else:
    q = np.einsum("btd,dnj->btnj", x, p["q"])
  pos = np.arange(T, dtype=np.float64)
  q = np.concatenate(
      [q[..., :P], ref_rope(q[..., P:], pos, c.rope_theta, c.rope_layout)],
      axis=-1)
  c_kv, k_rope = ref_latents(p, x, c)
  k_nope = np.einsum("btc,cnp->btnp", c_kv, p["w_uk"])
  k = np.concatenate(
      [k_nope, np.broadcast_to(k_rope[:, :, None], k_nope.shape[:3] +
                               k_rope.shape[-1:])], axis=-1)
  v = np.einsum("btc,cnv->btnv", c_kv, p["w_uv"])
  scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
  logits = np.einsum("btnj,bsnj->bnts", q, k) * scale
  logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.einsum("bnts,bsnv->btnv", probs, v)
  return np.einsum("btnv,nvd->btd", out, p["o"])


def layer0(params):
  return jax.tree_util.tree_map(lambda w: w[0], params["layers"]["attn"])


class MLALayerTest(chex.TestCase):

  # jit only: test_core checks jit == no jit for every variant, and eager
  # op-by-op dispatch would double this test's cost.
  # Fast tier: direct q with interleaved RoPE, q_lora with half RoPE.
  @cases.named(
      (dict(testcase_name=name(config(q_lora=q, layout=lay)), q_lora=q,
            layout=lay) for q in (0, Q_LORA) for lay in ("interleaved", "half")),
      slow=lambda q_lora, layout: (q_lora == 0) != (layout == "interleaved"))
  def test_layer_equals_reference(self, q_lora, layout):
    c = config(q_lora=q_lora, layout=layout)
    p = layer0(params_for(q_lora))
    x = normal(7, (B, 6, c.embed_dim))
    step = model.forward_step(c, jnp.ones((B, 6), bool))
    y, none = jax.jit(
        lambda p, x: mla.mla_attention(p, x, step, None, 0, c))(p, x)
    self.assertIsNone(none)
    chex.assert_shape(y, (B, 6, c.embed_dim))
    assert_close(y, ref_mla(p, x, c), depth=1)

  @chex.variants(with_jit=True, without_jit=True)
  def test_absorbed_equals_naive_attention(self):
    # Several queries, a random mask with a visible key in every row.
    c = config()
    p = layer0(params_for())
    N, P, R, C = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, (
        c.kv_lora_rank)
    T = 3
    q_nope, q_rope = normal(1, (B, T, N, P)), normal(2, (B, T, N, R))
    c_kv, r = normal(3, (B, S, C)), normal(4, (B, S, R))
    mask = np.random.default_rng(5).random((B, T, S)) < 0.5
    mask[:, :, 0] = True
    mask = jnp.asarray(mask)[:, None]  # [B, 1, T, S]: shared by the heads

    def run(path):
      return self.variant(functools.partial(
          mla.latent_attend, scale=c.softmax_scale, path=path))(
              p, q_nope, q_rope, c_kv, r, mask)

    out_a, probs_a = run("absorbed")
    out_n, probs_n = run("naive")
    chex.assert_shape([out_a, out_n], (B, T, N, c.v_head_dim))
    assert_close(out_a, out_n, depth=1)
    assert_close(probs_a, probs_n, depth=1)
    self.assertTrue(bool(jnp.all(jnp.where(mask, True, probs_a == 0))))


class MLADecodeTest(parameterized.TestCase):

  # Fast tier: the default (absorbed) path with direct q (the naive path's
  # attention equals the absorbed one in test_absorbed_equals_naive_attention).
  @cases.named(
      (dict(testcase_name=name(config(path, q)), path=path, q_lora=q)
       for path in ("absorbed", "naive") for q in (0, Q_LORA)),
      slow=lambda path, q_lora: (path, q_lora) != ("absorbed", 0))
  def test_decode_equals_forward_and_longer_prefill(self, path, q_lora):
    c, params = config(path, q_lora), params_for(q_lora)
    toks = tokens()
    full = kvjax.forward(params, c, toks)
    chex.assert_shape(full, (B, T_TOTAL, c.vocab_size))
    logits, cache = kvjax.prefill(params, c, toks[:, :T_PROMPT],
                                  kvjax.init_cache(c, B, S), all_logits=True)
    assert_close(logits, full[:, :T_PROMPT], c)
    # Decode with a trace-counted step: fixed shapes compile once.
    step = jax.jit(chex.assert_max_traces(model.decode_logits, n=1),
                   static_argnames="config", donate_argnames="cache")
    for t in range(T_PROMPT, T_TOTAL):
      logits, cache = step(params, c, toks[:, t], cache)
      assert_close(logits, full[:, t], c, msg=f"decode position {t}")
    chex.clear_trace_counter()
    # prefill(T) + decode == prefill(T + k): logits and the latent cache.
    logits_ref, cache_ref = kvjax.prefill(params, c, toks,
                                          kvjax.init_cache(c, B, S))
    assert_close(logits, logits_ref, c)
    assert_close(cache, cache_ref, c)
    chex.assert_shape(cache.c_kv, (c.num_layers, B, S, c.kv_lora_rank))
    chex.assert_shape(cache.k_rope, (c.num_layers, B, S,
                                     c.qk_rope_head_dim))
    chex.assert_tree_all_finite(cache)

  @pytest.mark.slow  # two decode programs of a combined policy
  def test_paths_agree_under_eviction_cache_positions_and_int8(self):
    # Sinks wrap the 8-slot cache during decode; keys rotate by cache rank;
    # latents are stored int8. Both paths read the same stored latents.
    policy = kvjax.CachePolicy(eviction="sinks", num_sinks=2,
                               positions="cache", kv_dtype="int8")
    absorbed, naive = config("absorbed"), config("naive")
    params = params_for()
    toks = tokens(T_PROMPT + 7)
    _, cache = kvjax.prefill(params, absorbed, toks[:, :T_PROMPT],
                             kvjax.init_cache(absorbed, B, 8, policy=policy))
    caches = {absorbed: cache, naive: copy_tree(cache)}
    for t in range(T_PROMPT, toks.shape[1]):
      out = {}
      for c in caches:
        out[c], caches[c] = kvjax.decode_step(params, c, toks[:, t],
                                              caches[c])
      assert_close(out[absorbed], out[naive], absorbed, cache="int8",
                   msg=f"position {t}")
    a, n = caches[absorbed], caches[naive]
    self.assertEqual(a.c_kv.dtype, jnp.int8)
    np.testing.assert_array_equal(a.positions, n.positions)
    np.testing.assert_array_equal(a.length, n.length)
    # Layer 1's latents see layer 0's output, which differs by float
    # rounding between the paths: at most one int8 step apart.
    for x, y in ((a.c_kv, n.c_kv), (a.k_rope, n.k_rope)):
      self.assertLessEqual(int(jnp.abs(x.astype(jnp.int32) -
                                       y.astype(jnp.int32)).max()), 1)


class LatentCacheTest(parameterized.TestCase):

  def test_cache_holds_exactly_the_latents(self):
    c, params = config(), params_for()
    L, C, R = c.num_layers, c.kv_lora_rank, c.qk_rope_head_dim
    toks = tokens(T_PROMPT)
    _, cache = kvjax.prefill(params, c, toks, kvjax.init_cache(c, B, S),
                             all_logits=True)
    self.assertIsInstance(cache, kvjax.LatentCache)
    leaves = {k: v for k, v in vars(cache).items() if isinstance(v, jax.Array)}
    self.assertEqual(set(leaves),
                     {"c_kv", "k_rope", "positions", "length", "errors"})
    chex.assert_shape(cache.c_kv, (L, B, S, C))
    chex.assert_shape(cache.k_rope, (L, B, S, R))
    # Nothing else is stored: all bytes = latents + slot bookkeeping
    # (positions, lengths, error bits).
    self.assertEqual(sum(x.nbytes for x in leaves.values()),
                     L * B * S * (C + R) * 4 + B * S * 4 + 2 * B * 4)
    # Layer 0's entries are the normed latent and the rotated shared key of
    # the (normed) embeddings; empty slots hold zeros.
    p = {k: np.asarray(v, np.float64) for k, v in layer0(params).items()}
    x = np.asarray(params["embed"], np.float64)[np.asarray(toks)]
    x = ref_rms_norm(x, np.asarray(params["layers"]["attn_norm"][0]),
                     c.rms_norm_eps)
    c_ref, r_ref = ref_latents(p, x, c)
    assert_close(cache.c_kv[0, :, :T_PROMPT], c_ref, depth=1)
    assert_close(cache.k_rope[0, :, :T_PROMPT], r_ref, depth=1)
    np.testing.assert_array_equal(cache.c_kv[:, :, T_PROMPT:], 0)
    np.testing.assert_array_equal(
        cache.positions, np.where(np.arange(S) < T_PROMPT, np.arange(S), -1)[
            None].repeat(B, 0))

  @cases.product(dtype=("float32", "bfloat16", "float16", "int8"))
  def test_bytes_per_token_is_layers_times_latent(self, dtype):
    for c in (config(), config(q_lora=Q_LORA)):  # q_lora never reaches it
      cache = jax.eval_shape(lambda c=c: kvjax.init_cache(c, B, S,
                                                          dtype=dtype))
      nbytes = sum(x.size * x.dtype.itemsize for x in
                   (cache.c_kv, cache.k_rope, cache.c_scale, cache.r_scale)
                   if x is not None)
      itemsize = jnp.dtype(dtype).itemsize
      scales = 2 * 4 if dtype == "int8" else 0  # one f32 scale per vector
      want = c.num_layers * ((c.kv_lora_rank + c.qk_rope_head_dim) *
                             itemsize + scales)
      self.assertEqual(kvjax.kv_bytes_per_token(c, dtype), want)
      self.assertEqual(nbytes, want * B * S)


# ---- the absorbed decode never materialises per-head K or V -----------------
def _avals(jaxpr):
  """Every intermediate's shape in a jaxpr and all its sub-jaxprs."""
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      yield tuple(getattr(v.aval, "shape", ())), eqn.primitive.name
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _avals(sub)


def per_head_kv_shapes(jaxpr, c: kvjax.ModelConfig, capacity: int):
  """Intermediates with a cache axis S and per-head key/value axes: N and P
  (or v), in any order, or their flattened N·P / N·v."""
  N, P, Vh = c.num_heads, c.qk_nope_head_dim, c.v_head_dim
  hits = []
  for shape, prim in _avals(jaxpr):
    if capacity not in shape:
      continue
    if (N in shape and (P in shape or Vh in shape)) or (
        N * P in shape or N * Vh in shape):
      hits.append((prim, shape))
  return hits


class AbsorbedDecodeTest(parameterized.TestCase):

  @parameterized.named_parameters(
      (name(config(path)), path) for path in ("absorbed", "naive"))
  def test_per_head_kv_only_in_naive_decode(self, path):
    c, params = config(path), params_for()
    dims = [B, S, c.num_heads, c.qk_nope_head_dim, c.v_head_dim,
            c.kv_lora_rank, c.qk_rope_head_dim, c.embed_dim,
            c.num_heads * c.qk_nope_head_dim, c.num_heads * c.v_head_dim]
    self.assertLen(set(dims[1:]), len(dims) - 1)  # unambiguous axes
    cache = jax.eval_shape(lambda: kvjax.init_cache(c, B, S))
    jaxpr = jax.make_jaxpr(
        lambda p, t, k: model.decode_logits(p, c, t, k))(
            params, jax.ShapeDtypeStruct((B,), jnp.int32), cache).jaxpr
    hits = per_head_kv_shapes(jaxpr, c, S)
    if c.mla_decode == "absorbed":
      self.assertEmpty(hits)
    else:  # the positive control: the detector sees the expansion
      self.assertIn((B, S, c.num_heads, c.qk_nope_head_dim),
                    [shape for _, shape in hits])
      self.assertIn((B, S, c.num_heads, c.v_head_dim),
                    [shape for _, shape in hits])


# ---- configuration: presets and bad input -----------------------------------
class MLAConfigTest(parameterized.TestCase):

  @parameterized.named_parameters((size, size) for size in model_presets.SIZES)
  def test_mla_preset_keeps_deepseek_ratios(self, size):
    cfgs = {v: kvjax.ModelConfig.from_dict(model_presets.model_dict(v, size))
            for v in model_presets.VARIANTS}
    mla_cfg = [c for c in cfgs.values() if c.attention == "mla"]
    self.assertLen(mla_cfg, 1)
    mla_cfg = mla_cfg[0]
    self.assertEqual(sorted(c.variant for c in cfgs.values()),
                     sorted(model_presets.VARIANTS))
    shared = ("vocab_size", "num_layers", "embed_dim", "num_heads", "mlp_dim")
    for c in cfgs.values():  # same width and depth: a fair comparison
      self.assertEqual([getattr(c, f) for f in shared],
                       [getattr(mla_cfg, f) for f in shared], c.variant)
    H = mla_cfg.embed_dim // mla_cfg.num_heads  # the GQA presets' head dim
    self.assertEqual((mla_cfg.kv_lora_rank, mla_cfg.qk_rope_head_dim,
                      mla_cfg.qk_nope_head_dim, mla_cfg.v_head_dim),
                     (4 * H, H // 2, H, H))
    self.assertEqual(mla_cfg.rope_layout, "interleaved")
    self.assertEqual(published.equivalent_kv_heads(mla_cfg), 2.25)

  def test_softmax_scale(self):
    c = config()
    self.assertAlmostEqual(c.softmax_scale, (12 + 8) ** -0.5)
    yarn = kvjax.RopeScaling(kind="yarn", factor=40.0,
                             original_max_position=64, mscale=0.707,
                             mscale_all_dim=0.707)
    m = 0.1 * 0.707 * np.log(40.0) + 1.0
    self.assertAlmostEqual(c.replace(rope_scaling=yarn).softmax_scale,
                           (12 + 8) ** -0.5 * m * m)

  @parameterized.named_parameters(
      (f"{field}_{value}", field, value) for field, value in (
          ("kv_lora_rank", 0), ("qk_nope_head_dim", 0),
          ("qk_rope_head_dim", 0), ("qk_rope_head_dim", 7),
          ("v_head_dim", 0), ("q_lora_rank", -1), ("mla_decode", "fast"),
          ("rope_layout", "rotated")))
  def test_bad_dims_name_the_field(self, field, value):
    with self.assertRaisesRegex(ValueError, field):
      kvjax.ModelConfig(**dict(BASE, **{field: value}))

  @parameterized.named_parameters(
      # q keeps its width P + R = 20: only kv_a and w_uk disagree.
      ("nope_rope_split", dict(qk_nope_head_dim=16, qk_rope_head_dim=4),
       ("kv_a", "w_uk")),
      ("v_head_dim", dict(v_head_dim=12), ("w_uv", "o")),
      ("kv_lora_rank", dict(kv_lora_rank=20),
       ("kv_a", "kv_a_norm", "w_uk", "w_uv")),
  )
  def test_mismatched_params_name_param_and_shapes(self, change, names):
    params = params_for()
    bad = config().replace(**change)
    want = jax.eval_shape(lambda: kvjax.init_params(bad, jax.random.key(0)))
    with self.assertRaises(ValueError) as ctx:
      params_lib.check_params(params, bad)
    msg = str(ctx.exception)
    attn, want_attn = params["layers"]["attn"], want["layers"]["attn"]
    for n in attn:  # exactly the disagreeing params are named
      self.assertEqual(f"['{n}'] has shape" in msg, n in names, n)
    for n in names:
      self.assertIn(str(attn[n].shape), msg)
      self.assertIn(str(want_attn[n].shape), msg)
    for field in change:
      self.assertIn(field, msg)

  def test_q_lora_mismatch_names_the_missing_params(self):
    with self.assertRaisesRegex(ValueError, r"missing .*q_a.*unexpected .*'q'"):
      params_lib.check_params(params_for(), config(q_lora=Q_LORA))
    with self.assertRaisesRegex(ValueError, r"missing .*'q'.*unexpected .*q_a"):
      params_lib.check_params(params_for(Q_LORA), config())
    # No raise:
    params_lib.check_params(params_for(Q_LORA), config(q_lora=Q_LORA))

  def test_public_api_rejects_mismatched_params_before_compute(self):
    bad = config().replace(v_head_dim=12)  # would run silently otherwise
    params, toks = params_for(), tokens(4)
    calls = dict(
        forward=lambda: kvjax.forward(params, bad, toks),
        prefill=lambda: kvjax.prefill(params, bad, toks,
                                      kvjax.init_cache(bad, B, S)),
        decode_step=lambda: kvjax.decode_step(params, bad, toks[:, 0],
                                              kvjax.init_cache(bad, B, S)),
        generate=lambda: kvjax.generate(params, bad, toks, 2),
        generate_no_cache=lambda: kvjax.generate_no_cache(params, bad, toks,
                                                          2))
    for call_name, call in calls.items():
      with self.assertRaisesRegex(ValueError, "w_uv", msg=call_name):
        call()

  def test_foreign_latent_cache_names_the_field(self):
    c, params = config(), params_for()
    for change, field in ((dict(kv_lora_rank=20), "kv_lora_rank"),
                          (dict(qk_rope_head_dim=4, qk_nope_head_dim=16),
                           "qk_rope_head_dim")):
      foreign = kvjax.init_cache(c.replace(**change), B, S)
      with self.assertRaisesRegex(ValueError, field):
        kvjax.prefill(params, c, tokens(4), foreign)


if __name__ == "__main__":
  absltest.main()
