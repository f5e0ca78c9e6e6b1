"""kvjax.hf: Hugging Face checkpoints load into kvjax and reproduce
transformers' logits and greedy generations.

Three groups:
  ConfigTest   config.json -> ModelConfig rules (no torch).
  LoaderTest   layout and bad input on synthetic safetensors files written
               from `expected_tensors` (no torch).
  ParityTest   tiny random transformers models of every supported family
               (tests/hf_fixtures.py), saved with save_pretrained, loaded by
               kvjax, compared with transformers: prompt logits (within
               `kvjax.tolerance`), 24 greedy tokens and their logits, for a batch of
               equal-length prompts and a left-padded batch.
"""

import json
import os
import shutil
import tempfile

from absl import logging
from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import flax as st_flax
from safetensors import numpy as st_numpy

import kvjax
from kvjax import hf as hf_lib
from kvjax.tolerance import assert_close, tolerance
import hf_fixtures as hx
import cases

jax.config.update("jax_numpy_rank_promotion", "raise")
# transformers computes float32 matmuls exactly; so must we (notes: TF32 /
# bf16-rounded matmuls move logits by ~5e-3).
jax.config.update("jax_default_matmul_precision", "highest")

NEW_TOKENS = 24
BATCH, PROMPT_LEN, PADDED_LENGTHS = 3, 12, (12, 9, 5)

LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=16,
             intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, attention_bias=True)
V3 = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=16,
          intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
          kv_lora_rank=8, q_lora_rank=None, qk_nope_head_dim=4,
          qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4,
          num_experts_per_tok=2, moe_intermediate_size=8, n_shared_experts=1,
          first_k_dense_replace=1, n_group=2, topk_group=1)


def _write(path, hf, *, dtype=np.float32, drop=(), extra=None, seed=0,
           file="model.safetensors"):
  """A synthetic checkpoint: config.json + random tensors of the right
  shapes. Returns {name: array} as written."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f)
  config = hf_lib.config_from_hf(hf)
  rng = np.random.default_rng(seed)
  tensors = {k: rng.normal(size=s).astype(np.float32)
             for k, s in hf_lib.expected_tensors(config).items()
             if k not in drop}
  tensors.update(extra or {})
  # `extra` tensors are written in their own dtype, the others in `dtype`.
  if dtype == jnp.bfloat16:
    # numpy casts; jnp.asarray only transfers (no per-shape compile).
    st_flax.save_file({k: jnp.asarray(v if k in (extra or {}) else
                                      v.astype(ml_dtypes.bfloat16))
                       for k, v in tensors.items()}, os.path.join(path, file))
  else:
    st_numpy.save_file({k: v if k in (extra or {}) else v.astype(dtype)
                        for k, v in tensors.items()},
                       os.path.join(path, file))
  return tensors


class ConfigTest(chex.TestCase):

  @parameterized.named_parameters(
      (hx.case_name(c), c) for c in hx.CASES)
  def test_both_config_formats_give_one_config(self, case):
    new = dict(case.kwargs, model_type=case.model_type)
    new.setdefault("rope_parameters", dict(rope_type="default"))
    legacy = hx.legacy_format(new)
    self.assertNotIn("rope_parameters", legacy)
    self.assertEqual(hf_lib.config_from_hf(new),
                     hf_lib.config_from_hf(legacy))

  def test_legacy_type_key_and_top_level_theta(self):
    cfg = hf_lib.config_from_hf(dict(
        LLAMA, rope_theta=123.0,
        rope_scaling=dict(type="linear", factor=3.0)))
    self.assertEqual(cfg.rope_theta, 123.0)
    self.assertEqual((cfg.rope_scaling.kind, cfg.rope_scaling.factor),
                     ("linear", 3.0))

  @parameterized.named_parameters(
      ("mistral_default_window", dict(model_type="mistral"), 4096),
      ("mistral_window_null", dict(model_type="mistral", sliding_window=None),
       0),
      ("qwen2_window_switched_off", dict(model_type="qwen2",
                                         sliding_window=4096), 0),
      ("qwen2_all_layers_slide", dict(model_type="qwen2", sliding_window=16,
                                      use_sliding_window=True,
                                      max_window_layers=0), 16),
      ("qwen2_no_layer_slides", dict(model_type="qwen2", sliding_window=16,
                                     use_sliding_window=True,
                                     max_window_layers=2), 0),
      ("llama_never", dict(sliding_window=16), 0),
  )
  def test_sliding_window_rules(self, overrides, window):
    self.assertEqual(
        hf_lib.config_from_hf(dict(LLAMA, **overrides)).sliding_window,
        window)

  def test_mixed_sliding_layers_refused(self):
    with self.assertRaisesRegex(ValueError, "mixes sliding-window"):
      hf_lib.config_from_hf(dict(
          LLAMA, model_type="qwen2", use_sliding_window=True,
          sliding_window=8, max_window_layers=1))

  def test_family_biases(self):
    llama = hf_lib.config_from_hf(LLAMA)
    qwen = hf_lib.config_from_hf(dict(LLAMA, model_type="qwen2"))
    mistral = hf_lib.config_from_hf(dict(LLAMA, model_type="mistral"))
    self.assertEqual((llama.qkv_bias, llama.o_bias), (True, True))
    self.assertEqual((qwen.qkv_bias, qwen.o_bias), (True, False))
    self.assertEqual((mistral.qkv_bias, mistral.o_bias), (False, False))

  def test_deepseek_routing_follows_transformers(self):
    v3 = hf_lib.config_from_hf(V3)
    self.assertEqual((v3.moe.scoring, v3.moe.topk_method, v3.moe.num_groups,
                      v3.moe.norm_topk_prob, v3.moe.routed_scaling_factor),
                     ("sigmoid", "noaux_tc", 2, True, 2.5))
    self.assertEqual(v3.rope_layout, "interleaved")
    # V2's router never normalizes, whatever norm_topk_prob says.
    v2 = hf_lib.config_from_hf(dict(V3, model_type="deepseek_v2",
                                        norm_topk_prob=True))
    self.assertEqual((v2.moe.scoring, v2.moe.topk_method,
                      v2.moe.norm_topk_prob), ("softmax", "greedy", False))

  def test_yarn_without_mscale_uses_factor_only(self):
    rs = hf_lib.config_from_hf(dict(V3, rope_parameters=dict(
        rope_type="yarn", factor=4.0,
        original_max_position_embeddings=16))).rope_scaling
    self.assertEqual((rs.mscale, rs.mscale_all_dim), (0.0, 0.0))

  @parameterized.named_parameters(
      ("model_type", dict(model_type="gpt2"),
       "'gpt2' is not supported; supported: llama, mistral, qwen2, "
       "deepseek_v2, deepseek_v3"),
      ("rope_type", dict(rope_parameters=dict(rope_type="longrope")),
       "rope type 'longrope'"),
      ("partial_rotary", dict(partial_rotary_factor=0.5),
       "partial_rotary_factor"),
      ("activation", dict(hidden_act="gelu"), "hidden_act"),
      ("mlp_bias", dict(mlp_bias=True), "mlp_bias"),
      ("missing_key", dict(hidden_size=None), "'hidden_size'"),
      ("heads", dict(num_key_value_heads=3), "num_kv_heads"),
  )
  def test_unsupported_config_names_the_problem(self, overrides, message):
    with self.assertRaisesRegex(ValueError, message):
      hf_lib.config_from_hf(dict(LLAMA, **overrides))


class LoaderTest(chex.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

  def test_gqa_layout(self):
    tensors = _write(self.dir, LLAMA)
    config, params = kvjax.load_checkpoint(self.dir)
    params = jax.tree_util.tree_map(np.asarray, params)  # cheap indexing
    N, K, H, D = 4, 2, 8, 16
    self.assertEqual((config.num_heads, config.num_kv_heads, config.head_dim),
                     (N, K, H))
    rng = np.random.default_rng(1)
    for _ in range(8):
      l, n, k, h, d = (int(rng.integers(s)) for s in (2, N, K, H, D))
      f, v = int(rng.integers(24)), int(rng.integers(64))
      a = f"model.layers.{l}.self_attn."
      layer = params["layers"]
      # HF rows are head-major: row n·H + h is head n, dim h.
      self.assertEqual(layer["attn"]["q"][l, d, n, h],
                       tensors[a + "q_proj.weight"][n * H + h, d])
      self.assertEqual(layer["attn"]["k"][l, d, k, h],
                       tensors[a + "k_proj.weight"][k * H + h, d])
      self.assertEqual(layer["attn"]["v_bias"][l, k, h],
                       tensors[a + "v_proj.bias"][k * H + h])
      self.assertEqual(layer["attn"]["o"][l, n, h, d],
                       tensors[a + "o_proj.weight"][d, n * H + h])
      self.assertEqual(layer["mlp"]["down"][l, f, d],
                       tensors[f"model.layers.{l}.mlp.down_proj.weight"][d, f])
      self.assertEqual(params["lm_head"][d, v],
                       tensors["lm_head.weight"][v, d])
    np.testing.assert_array_equal(params["embed"],
                                  tensors["model.embed_tokens.weight"])
    chex.assert_trees_all_equal_shapes(params, jax.eval_shape(
        lambda: kvjax.init_params(config, jax.random.key(0))))

  @cases.product(fused_experts=(False, True))
  def test_mla_moe_layout(self, fused_experts):
    E, F, D, P, Vh = 4, 8, 16, 4, 6
    extra, drop = {}, ()
    rng = np.random.default_rng(2)
    if fused_experts:
      # transformers' in-memory layout: gate_up [E, 2F, D], down [E, D, F].
      extra = {"model.layers.1.mlp.experts.gate_up_proj":
                   rng.normal(size=(E, 2 * F, D)).astype(np.float32),
               "model.layers.1.mlp.experts.down_proj":
                   rng.normal(size=(E, D, F)).astype(np.float32)}
      drop = tuple(f"model.layers.1.mlp.experts.{e}.{n}_proj.weight"
                   for e in range(E) for n in ("gate", "up", "down"))
    # A multi-token-prediction layer (model.layers.L) is ignored.
    extra["model.layers.2.mlp.gate.weight"] = np.ones((E, D), np.float32)
    tensors = _write(self.dir, V3, drop=drop, extra=extra)
    config, params = kvjax.load_checkpoint(self.dir)
    params = jax.tree_util.tree_map(np.asarray, params)  # cheap indexing
    self.assertEqual(sorted(params), ["embed", "final_norm", "layers",
                                      "lm_head", "moe_layers"])
    attn, mlp = params["moe_layers"]["attn"], params["moe_layers"]["mlp"]
    kv_b = tensors["model.layers.1.self_attn.kv_b_proj.weight"]
    for c, n, p, v, e, d, f in [(0, 0, 0, 0, 0, 0, 0), (7, 1, 3, 5, 3, 15, 7),
                                (3, 1, 2, 1, 2, 9, 4)]:
      # Per head the kv_b rows are [k_nope (P) | v (V)].
      self.assertEqual(attn["w_uk"][0, c, n, p], kv_b[n * (P + Vh) + p, c])
      self.assertEqual(attn["w_uv"][0, c, n, v],
                       kv_b[n * (P + Vh) + P + v, c])
      self.assertEqual(mlp["router"][0, d, e],
                       tensors["model.layers.1.mlp.gate.weight"][e, d])
      if fused_experts:
        gate_up = tensors["model.layers.1.mlp.experts.gate_up_proj"]
        self.assertEqual(mlp["expert_gate"][0, e, d, f], gate_up[e, f, d])
        self.assertEqual(mlp["expert_up"][0, e, d, f], gate_up[e, F + f, d])
        self.assertEqual(mlp["expert_down"][0, e, f, d],
                         tensors["model.layers.1.mlp.experts.down_proj"][
                             e, d, f])
      else:
        x = f"model.layers.1.mlp.experts.{e}."
        self.assertEqual(mlp["expert_gate"][0, e, d, f],
                         tensors[x + "gate_proj.weight"][f, d])
        self.assertEqual(mlp["expert_down"][0, e, f, d],
                         tensors[x + "down_proj.weight"][d, f])
    np.testing.assert_array_equal(
        mlp["score_bias"][0],
        tensors["model.layers.1.mlp.gate.e_score_correction_bias"])
    chex.assert_trees_all_equal_shapes(params, jax.eval_shape(
        lambda: kvjax.init_params(config, jax.random.key(0))))

  def test_bf16_weights_kept_and_param_dtype_override(self):
    _write(self.dir, dict(V3, dtype="bfloat16"), dtype=jnp.bfloat16)
    config, params = kvjax.load_checkpoint(self.dir)
    self.assertEqual(config.param_dtype, "bfloat16")
    self.assertEqual(config.compute_dtype, "float32")
    self.assertEqual(params["embed"].dtype, jnp.bfloat16)
    # The router decides discrete choices: kept in float32 (as transformers).
    self.assertEqual(params["moe_layers"]["mlp"]["router"].dtype, jnp.float32)
    config32, params32 = kvjax.load_checkpoint(
        self.dir, param_dtype="float32", compute_dtype="bfloat16")
    self.assertEqual(config32.dtype, jnp.bfloat16)  # a separate choice
    self.assertEqual(config32.param_dtype, "float32")
    chex.assert_trees_all_equal(
        jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params),
        jax.tree_util.tree_map(np.asarray, params32))

  def test_sharded_checkpoint(self):
    tensors = _write(self.dir, LLAMA, file="tmp.safetensors")
    os.remove(os.path.join(self.dir, "tmp.safetensors"))
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for fn, keys in shards.items():
      st_numpy.save_file({k: tensors[k] for k in keys},
                         os.path.join(self.dir, fn))
    with open(os.path.join(self.dir, hf_lib.INDEX_FILE), "w") as f:
      json.dump({"weight_map": {k: fn for fn, ks in shards.items()
                                for k in ks}}, f)
    _, params = kvjax.load_checkpoint(self.dir)
    np.testing.assert_array_equal(params["final_norm"],
                                  tensors["model.norm.weight"])
    # An index pointing at a shard that does not hold the tensor.
    with open(os.path.join(self.dir, hf_lib.INDEX_FILE), "w") as f:
      json.dump({"weight_map": {k: "a.safetensors" for k in names}}, f)
    with self.assertRaisesRegex(ValueError, "lists tensors its shards do not "
                                "hold: .*model.*"):
      kvjax.load_checkpoint(self.dir)
    os.remove(os.path.join(self.dir, "b.safetensors"))
    with open(os.path.join(self.dir, hf_lib.INDEX_FILE), "w") as f:
      json.dump({"weight_map": {k: fn for fn, ks in shards.items()
                                for k in ks}}, f)
    with self.assertRaisesRegex(ValueError, r"do not exist: \['b.safetensors"):
      kvjax.load_checkpoint(self.dir)

  def test_tied_config_with_different_lm_head_is_untied(self):
    tensors = _write(self.dir, dict(LLAMA, tie_word_embeddings=True),
                     extra={"lm_head.weight": np.ones((64, 16), np.float32)})
    config, params = kvjax.load_checkpoint(self.dir)
    self.assertFalse(config.tie_embeddings)
    np.testing.assert_array_equal(params["lm_head"],
                                  tensors["lm_head.weight"].T)

  # ---- bad input ------------------------------------------------------------
  def test_missing_directory_and_config(self):
    with self.assertRaisesRegex(ValueError, "does not exist"):
      kvjax.load_checkpoint(os.path.join(self.dir, "nope"))
    with self.assertRaisesRegex(ValueError, "has no config.json"):
      kvjax.load_checkpoint(self.dir)

  def test_unsupported_model_type(self):
    _write(self.dir, LLAMA)
    with open(os.path.join(self.dir, "config.json"), "w") as f:
      json.dump(dict(LLAMA, model_type="gpt_neox"), f)
    with self.assertRaisesRegex(
        ValueError, "config.json: model_type 'gpt_neox' is not supported; "
        "supported: llama, mistral, qwen2, deepseek_v2, deepseek_v3"):
      kvjax.load_checkpoint(self.dir)

  def test_pickle_files_refused(self):
    with open(os.path.join(self.dir, "config.json"), "w") as f:
      json.dump(LLAMA, f)
    bin_file = os.path.join(self.dir, "pytorch_model.bin")
    with open(bin_file, "wb") as f:
      f.write(b"not even a pickle")
    with self.assertRaisesRegex(ValueError, "pickle.*arbitrary code"):
      kvjax.load_checkpoint(self.dir)
    with self.assertRaisesRegex(ValueError, "pytorch_model.bin: pickle"):
      kvjax.load_checkpoint(bin_file)

  @parameterized.named_parameters(
      ("truncated", lambda data: data[:len(data) // 2]),
      ("garbage_header", lambda data: b"\xff" * 16 + data[16:]),
      ("empty", lambda data: b""),
  )
  def test_unreadable_file_named(self, corrupt):
    _write(self.dir, LLAMA)
    file = os.path.join(self.dir, "model.safetensors")
    with open(file, "rb") as f:
      data = f.read()
    with open(file, "wb") as f:
      f.write(corrupt(data))
    with self.assertRaisesRegex(ValueError,
                                "model.safetensors: not a readable"):
      kvjax.load_checkpoint(self.dir)

  def test_non_finite_values_named(self):
    bad = np.zeros((16,), np.float32)
    bad[3] = np.nan
    _write(self.dir, LLAMA, extra={"model.norm.weight": bad})
    with self.assertRaisesRegex(
        ValueError, "model.safetensors: tensor model.norm.weight holds NaN"):
      kvjax.load_checkpoint(self.dir)

  def test_shape_mismatch_names_file_tensor_and_shapes(self):
    _write(self.dir, LLAMA, extra={
        "model.layers.1.self_attn.k_proj.weight":
            np.zeros((8, 16), np.float32)})
    with self.assertRaisesRegex(
        ValueError, r"model.safetensors: tensor model.layers.1.self_attn."
        r"k_proj.weight has shape \[8, 16\], config.json implies \[16, 16\]"):
      kvjax.load_checkpoint(self.dir)

  def test_missing_and_unexpected_tensors_named(self):
    _write(self.dir, LLAMA, drop=("model.layers.0.mlp.up_proj.weight",),
           extra={"model.layers.0.mlp.extra.weight":
                      np.zeros((2,), np.float32)})
    with self.assertRaisesRegex(
        ValueError, r"(?s)missing tensors: model.layers.0.mlp.up_proj.weight"
        r".*unexpected tensors: model.layers.0.mlp.extra.weight "
        r"\(in model.safetensors\)"):
      kvjax.load_checkpoint(self.dir)

  def test_deepseek_unexpected_non_mtp_tensor_named(self):
    _write(self.dir, V3, extra={"model.layers.0.mlp.gate.weight":
                                    np.zeros((4, 16), np.float32)})
    with self.assertRaisesRegex(ValueError, "unexpected tensors: "
                                "model.layers.0.mlp.gate.weight"):
      kvjax.load_checkpoint(self.dir)

  @parameterized.named_parameters(
      ("integer", dict(), np.int32, "has dtype I32"),
      ("not_declared", dict(dtype="bfloat16"), np.float16,
       "has dtype F16, config.json declares bfloat16"),
  )
  def test_wrong_dtype_named(self, overrides, dtype, message):
    _write(self.dir, dict(LLAMA, **overrides), extra={
        "model.norm.weight": np.ones((16,), dtype)})
    with self.assertRaisesRegex(
        ValueError, "model.safetensors: tensor model.norm.weight " + message):
      kvjax.load_checkpoint(self.dir)


@pytest.mark.slow
class ParityTest(chex.TestCase):
  """kvjax vs transformers on tiny random models of every family (slow
  tier: torch, and one kvjax compile per family)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # CI installs the `test` extra (torch + transformers): this only skips
    # where they are deliberately absent.
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    cls.root = tempfile.mkdtemp()

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.root, ignore_errors=True)
    super().tearDownClass()

  @parameterized.named_parameters(
      (hx.case_name(c), c) for c in hx.CASES)
  def test_logits_and_greedy_tokens_match_transformers(self, case):
    path, ref = hx.build(case, self.root)
    with open(os.path.join(path, "config.json")) as f:
      saved = json.load(f)
    # The test name was derived before building: it must describe the files.
    files = ([hf_lib.INDEX_FILE] if case.max_shard_size else None)
    self.assertEqual(hx.features(saved, os.listdir(path)),
                     hx.features(hx.case_config_dict(case), files))
    config, params = kvjax.load_checkpoint(path)
    chex.assert_tree_all_finite(params)
    equal, padded, mask = hx.prompts(config.vocab_size, BATCH, PROMPT_LEN,
                                     PADDED_LENGTHS, case.seed)
    for kind, tokens, m in (("equal", equal, None), ("padded", padded, mask)):
      hf_mask = np.ones_like(tokens) if m is None else m
      ref_logits, ref_new, ref_steps = hx.reference_outputs(
          ref, tokens, hf_mask, NEW_TOKENS)
      top2 = np.sort(ref_steps, axis=-1)[..., -2:]
      # Greedy tokens are compared exactly: the reference's top-1 / top-2
      # gap must exceed twice the logit tolerance, or rounding alone could
      # flip a token.
      atol = tolerance(config).atol(np.abs(ref_steps).max())
      self.assertGreater(np.min(top2[..., 1] - top2[..., 0]), 2 * atol,
                         f"{kind}: fixture has near-tied logits; reseed it")

      logits = kvjax.forward(params, config, tokens, attention_mask=m)
      chex.assert_shape(logits, (BATCH, PROMPT_LEN, config.vocab_size))
      real = hf_mask.astype(bool)
      assert_close(np.asarray(logits)[real], ref_logits[real], config,
                   msg=kind)

      new, steps, _ = kvjax.generate(params, config, tokens, NEW_TOKENS,
                                     attention_mask=m, return_logits=True)
      chex.assert_shape(new, (BATCH, NEW_TOKENS))
      np.testing.assert_array_equal(np.asarray(new), ref_new, err_msg=kind)
      assert_close(np.asarray(steps), ref_steps, config, msg=kind)
      # The measured tolerances (WORKSPACE.md table): run with
      # `-o log_cli=true --log-cli-level=INFO` to see them.
      logging.info(
          "parity %s %s: max|dlogit| prompt %.1e, generated %.1e; min top-2 "
          "gap %.1e; max|logit| %.0f", self._testMethodName, kind,
          np.abs(np.asarray(logits) - ref_logits)[real].max(),
          np.abs(np.asarray(steps) - ref_steps).max(),
          np.min(top2[..., 1] - top2[..., 0]), np.abs(ref_logits[real]).max())


if __name__ == "__main__":
  absltest.main()
