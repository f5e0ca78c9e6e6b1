"""The attention probe against a float64 reference, and its statistics.

`kvjax.probe.attention_probs` must equal attention probabilities computed
independently here, in numpy float64, from the canonical params (embedding,
RMSNorm, projections, RoPE, masks, softmax, MLP: the model written out
again, none of kvjax's code), for MHA / MQA / GQA and MLA, in both params
layouts, on a left-padded batch. Its rows sum to 1 over the keys a query
may see and are exactly 0 elsewhere. `kvjax.lab.attention_stats` is
checked against closed forms (uniform causal attention, a one-key sink).
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np
import pytest

import kvjax
from kvjax import probe
from kvjax.lab import attention_stats
from kvjax.tolerance import assert_close
from configs import model as model_presets

import cases  # pylint: disable=g-bad-import-order
from tiny_models import tiny, tiny_params  # pylint: disable=g-bad-import-order

MLA_NORM_EPS = 1e-6  # DeepSeek's, as the model's


# ---- the float64 reference ---------------------------------------------------
def _f64(tree):
  if isinstance(tree, dict):
    return {k: _f64(v) for k, v in tree.items()}
  return np.asarray(tree, np.float64)


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos_BT, theta, layout):
  """x [B, T, R] or [B, T, heads, R] rotated to positions pos_BT."""
  R = x.shape[-1]
  angle = pos_BT[..., None] * theta ** (-np.arange(0, R, 2) / R)
  if x.ndim == 4:
    angle = angle[:, :, None]
  cos, sin = np.cos(angle), np.sin(angle)
  if layout == "half":
    x1, x2 = x[..., :R // 2], x[..., R // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
  x1, x2 = x[..., 0::2], x[..., 1::2]
  return np.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                  -1).reshape(x.shape)


def _softmax(logits_BNTS, ok_BTS):
  x = np.where(ok_BTS[:, None], logits_BNTS, -np.inf)
  top = x.max(-1, keepdims=True)
  e = np.exp(x - np.where(np.isfinite(top), top, 0.0))
  total = e.sum(-1, keepdims=True)
  return np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)


def _gqa(p, h, pos, ok, config):
  N, K, H = config.num_heads, config.num_kv_heads, config.head_dim
  q = np.einsum("btd,dnh->btnh", h, p["q"])
  k = np.einsum("btd,dkh->btkh", h, p["k"])
  v = np.einsum("btd,dkh->btkh", h, p["v"])
  if config.qkv_bias:
    q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
  q = _rope(q, pos, config.rope_theta, config.rope_layout)
  k = _rope(k, pos, config.rope_theta, config.rope_layout)
  k, v = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)
  probs = _softmax(np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H), ok)
  y = np.einsum("btnh,nhd->btd", np.einsum("bnts,bsnh->btnh", probs, v),
                p["o"])
  return (y + p["o_bias"] if config.o_bias else y), probs


def _mla(p, h, pos, ok, config):
  C, P = config.kv_lora_rank, config.qk_nope_head_dim
  R = config.qk_rope_head_dim
  if config.q_lora_rank:
    q = np.einsum("btq,qnj->btnj", _rms(h @ p["q_a"], p["q_a_norm"],
                                        MLA_NORM_EPS), p["q_b"])
  else:
    q = np.einsum("btd,dnj->btnj", h, p["q"])
  q_nope = q[..., :P]
  q_rope = _rope(q[..., P:], pos, config.rope_theta, config.rope_layout)
  ckv = h @ p["kv_a"]
  c = _rms(ckv[..., :C], p["kv_a_norm"], MLA_NORM_EPS)
  r = _rope(ckv[..., C:], pos, config.rope_theta, config.rope_layout)
  k_nope = np.einsum("bsc,cnp->bsnp", c, p["w_uk"])
  v = np.einsum("bsc,cnv->bsnv", c, p["w_uv"])
  logits = (np.einsum("btnp,bsnp->bnts", q_nope, k_nope) +
            np.einsum("btnr,bsr->bnts", q_rope, r)) / np.sqrt(P + R)
  probs = _softmax(logits, ok)
  y = np.einsum("btnv,nvd->btd", np.einsum("bnts,bsnv->btnv", probs, v),
                p["o"])
  return y, probs


def reference_probs(params, config, tokens_BT, mask_BT):
  """[L, B, N, T, T] float64 from canonical params (no MoE, no RoPE
  scaling: what the tests' configs use)."""
  assert config.moe is None
  assert config.rope_scaling == kvjax.RopeScaling()
  params = _f64(params)
  mask_BT = np.asarray(mask_BT, bool)
  pos = np.where(mask_BT, np.cumsum(mask_BT, axis=1) - 1, -1)
  q, k = pos[:, :, None], pos[:, None, :]
  ok = (q >= 0) & (k >= 0) & (k <= q)
  if config.sliding_window:
    ok &= k > q - config.sliding_window
  rope_pos = np.maximum(pos, 0).astype(np.float64)
  attention = _mla if config.attention == "mla" else _gqa
  eps = config.rms_norm_eps
  x = params["embed"][np.asarray(tokens_BT)]
  out = []
  for l in range(config.num_layers):
    p = {k: v[l] for k, v in params["layers"].items() if k not in
         ("attn", "mlp")}
    p_attn = {k: v[l] for k, v in params["layers"]["attn"].items()}
    p_mlp = {k: v[l] for k, v in params["layers"]["mlp"].items()}
    y, probs = attention(p_attn, _rms(x, p["attn_norm"], eps), rope_pos, ok,
                         config)
    out.append(probs)
    x = x + y
    h = _rms(x, p["mlp_norm"], eps)
    gate = h @ p_mlp["gate"]
    x = x + (gate / (1 + np.exp(-gate)) * (h @ p_mlp["up"])) @ p_mlp["down"]
  return np.stack(out)


def _batch(config, T=9, pad=3, seed=0):
  """[2, T] ids; the second row left-padded by `pad`."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, config.vocab_size, (2, T)).astype(np.int32)
  mask = np.ones((2, T), np.int32)
  mask[1, :pad] = 0
  tokens[1, :pad] = 0
  return tokens, mask


def _random_biases(params, config, seed=1):
  """init_params zeroes biases; give them values the test can see."""
  rng = np.random.default_rng(seed)
  attn = dict(params["layers"]["attn"])
  for name in ("q_bias", "k_bias", "v_bias", "o_bias"):
    if name in attn:
      attn[name] = 0.3 * rng.standard_normal(attn[name].shape).astype(
          np.float32)
  return dict(params, layers=dict(params["layers"], attn=attn))


EXTRA = {  # configs beyond the presets (slow): window, biases, query latent
    "gqa-window-bias": ("gqa", dict(sliding_window=3, qkv_bias=True,
                                     o_bias=True)),
    "mla-q_lora": ("mla", dict(q_lora_rank=8)),
}


class ProbeReferenceTest(parameterized.TestCase):
  """The probe equals the float64 reference."""

  def _check(self, config, params, layout):
    tokens, mask = _batch(config)
    run = kvjax.pack(params, config) if layout == "packed" else params
    got = np.asarray(probe.attention_probs(run, config, tokens, mask))
    want = reference_probs(params, config, tokens, mask)
    L, N = config.num_layers, config.num_heads
    self.assertEqual(got.shape, (L, 2, N, 9, 9))
    self.assertEqual(got.dtype, np.float32)
    # Far from uniform: a wrong mask or scale would show.
    self.assertGreater(np.abs(want - attention_stats.uniform_probs(
        mask)[None, :, None]).max(), 0.1)
    assert_close(got, want, config, msg=f"{config.variant} {layout}")

  @cases.product(variant=model_presets.VARIANTS,
                 layout=("canonical", "packed"),
                 slow=lambda variant, layout: (
                     variant not in cases.FAST_VARIANTS or
                     layout == "packed"))
  def test_equals_float64_reference(self, variant, layout):
    self._check(tiny(variant), tiny_params(variant), layout)

  @pytest.mark.slow
  def test_equals_float64_reference_beyond_the_presets(self):
    for name, (variant, fields) in EXTRA.items():
      with self.subTest(name):
        config = tiny(variant).replace(**fields)
        params = _random_biases(
            kvjax.init_params(config, jax.random.key(0)),
            config)
        self._check(config, params, "canonical")


class ProbeInvariantsTest(absltest.TestCase):

  def test_rows_sum_to_one_and_hidden_keys_get_exact_zeros(self):
    config = tiny("gqa")
    tokens, mask = _batch(config)
    got = np.asarray(probe.attention_probs(tiny_params("gqa"), config,
                                           tokens, mask), np.float64)
    visible = attention_stats.uniform_probs(mask) > 0  # [B, T, T]
    hidden = np.broadcast_to(~visible[None, :, None], got.shape)
    self.assertTrue((got[hidden] == 0).all())  # future, padding keys
    self.assertTrue((got[:, 1, :, :3] == 0).all())  # padding queries
    real_q = np.broadcast_to(np.asarray(mask, bool)[None, :, None],
                             got.shape[:-1])
    assert_close(got.sum(-1)[real_q], np.ones(real_q.sum()), config)

  def test_fused_attention_is_refused_before_compute(self):
    config = tiny("gqa").replace(attention_impl="jax_nn")
    tokens, _ = _batch(config)
    with self.assertRaisesRegex(ValueError, "attention_impl='einsum'"):
      probe.attention_probs(tiny_params("gqa"), config, tokens)

  def test_bad_tokens_are_refused(self):
    config = tiny("gqa")
    with self.assertRaisesRegex(ValueError, "tokens"):
      probe.attention_probs(tiny_params("gqa"), config,
                            np.full((1, 4), config.vocab_size, np.int32))

  @pytest.mark.slow  # one more compile: T = 1 takes attention's decode branch
  def test_one_token(self):
    for variant in cases.FAST_VARIANTS:
      config = tiny(variant)
      got = np.asarray(probe.attention_probs(tiny_params(variant), config,
                                             np.zeros((1, 1), np.int32)))
      np.testing.assert_allclose(got, np.ones((2, 1, 4, 1, 1)), rtol=1e-6)


class FirstTokenMassTest(absltest.TestCase):

  def test_equals_the_sink_mass_of_attention_stats(self):
    config, params = tiny("gqa"), tiny_params("gqa")
    tokens = np.random.default_rng(0).integers(0, 256, (2, 24))
    probs = probe.attention_probs(params, config, tokens)
    got = np.asarray(probe.first_token_mass(probs, 12))
    want = attention_stats.sink_mass(np.asarray(probs), k=1, min_query=12)
    self.assertEqual(got.shape, (config.num_layers, config.num_heads))
    assert_close(got, want, compute="float32")


class AttentionStatsTest(absltest.TestCase):
  """Statistics against closed forms (numpy only)."""

  T, M = 8, 3  # window, min_query

  def test_uniform_attention_is_its_own_baseline(self):
    mask = np.ones((1, self.T), bool)
    uniform = attention_stats.uniform_probs(mask)[None, :, None]
    s = attention_stats.summarize(uniform, mask, sink_k=(1, 2),
                                  min_query=self.M)
    q = np.arange(self.M, self.T)
    np.testing.assert_allclose(s["sink_mass"]["1"], [[np.mean(1 / (q + 1))]])
    np.testing.assert_allclose(s["sink_mass_uniform"]["2"],
                               np.mean(2 / (q + 1)))
    np.testing.assert_allclose(s["entropy"], [[np.mean(np.log(q + 1))]])
    np.testing.assert_allclose(s["entropy_uniform"], np.mean(np.log(q + 1)))
    want = [np.mean(1 / (q[q >= d] + 1)) for d in range(self.T)]
    np.testing.assert_allclose(s["distance_profile"][0][0], want)
    np.testing.assert_allclose(s["distance_profile_uniform"], want)
    self.assertEqual(s["queries"], self.T - self.M)

  def test_all_attention_on_the_first_token(self):
    probs = np.zeros((1, 1, 1, self.T, self.T))
    probs[..., 0] = 1
    s = attention_stats.summarize(probs, sink_k=(1,), min_query=self.M)
    self.assertEqual(s["sink_mass"]["1"], [[1.0]])
    self.assertEqual(s["entropy"], [[0.0]])
    # Distance d: only the query at position d attends that far (to key 0).
    q = np.arange(self.M, self.T)
    want = [np.mean(q[q >= d] == d) for d in range(self.T)]
    np.testing.assert_allclose(s["distance_profile"][0][0], want)

  def test_left_padding_changes_nothing(self):
    rng = np.random.default_rng(0)
    T, pad = 6, 2
    probs = rng.random((2, 1, 3, T, T)) * np.tri(T)
    probs /= probs.sum(-1, keepdims=True)
    padded = np.zeros((2, 1, 3, T + pad, T + pad))
    padded[..., pad:, pad:] = probs
    mask = np.ones((1, T + pad), bool)
    mask[:, :pad] = False
    a = attention_stats.summarize(probs, min_query=2, sink_k=(1, 2))
    b = attention_stats.summarize(padded, mask, min_query=2, sink_k=(1, 2))
    for key in ("sink_mass", "sink_mass_uniform"):
      for k in ("1", "2"):
        np.testing.assert_allclose(b[key][k], a[key][k], err_msg=key)
    for key in ("entropy", "entropy_uniform", "queries"):
      np.testing.assert_allclose(b[key], a[key], err_msg=key)
    # The padded window has `pad` more distances, none of them reached.
    np.testing.assert_allclose(
        np.asarray(b["distance_profile"], np.float64)[..., :T],
        np.asarray(a["distance_profile"], np.float64))
    self.assertTrue(np.isnan(np.asarray(b["distance_profile"],
                                        np.float64)[..., T:]).all())

  def test_min_query_past_every_token_is_refused(self):
    with self.assertRaisesRegex(ValueError, "min_query"):
      attention_stats.sink_mass(np.zeros((1, 1, 1, 4, 4)), min_query=4)


if __name__ == "__main__":
  absltest.main()
