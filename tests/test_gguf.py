"""kvjax.gguf_export and the llama.cpp peer (kvjax.lab.llamacpp).

Three tiers, by what is installed (`pip install -e .[llamacpp]`):
  * always: the vocabulary, the RoPE permutation (half -> interleaved
    pairs commutes with the rotation) and the refusals, named by field;
  * with `gguf`: a written file read back with gguf.GGUFReader holds
    exactly the tensors and metadata the exporter meant;
  * with `llama_cpp`: llama.cpp's float32 logits on the same weights match
    kvjax's within `kvjax.tolerance` (the shipped Austen model, and tiny
    random models of every exportable kind), its tokenizer gives kvjax's
    byte ids, and greedy batched generation gives the same tokens.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import data
from kvjax import gguf_export
from kvjax import layers
from kvjax import orbax_checkpoint
from kvjax.tolerance import assert_close, max_error, tolerance
from configs import model as model_presets
import cases  # pylint: disable=g-bad-import-order

ROOT = os.path.join(os.path.dirname(__file__), "..")
AUSTEN = os.path.join(ROOT, "checkpoints", "austen-gqa")
TEXT = ("It is a truth universally acknowledged, that a single man in "
        "possession of a good fortune, must be in want of a wife.\n")


def _tiny(variant="gqa", **overrides) -> kvjax.ModelConfig:
  # init_scale 0.15 as tests/tiny_models.py: clear greedy margins.
  d = dict(model_presets.model_dict(variant, "tiny"), init_scale=0.15)
  d.update(overrides)
  return kvjax.ModelConfig.from_dict(d)


def _random_params(config, seed=0):
  """init_params with random (not zero / one) norms and biases, so a
  misplaced norm or bias shows in the logits."""
  params = kvjax.init_params(config, jax.random.key(seed))
  rng = np.random.default_rng(seed)

  def jitter(path, x):
    name = path[-1].key
    if name.endswith("norm"):
      return x * (1 + 0.2 * rng.standard_normal(x.shape)).astype(x.dtype)
    if name.endswith("bias"):
      return (0.1 * rng.standard_normal(x.shape)).astype(x.dtype)
    return x

  return jax.tree_util.tree_map_with_path(jitter, params)


# Exportable kinds: name -> config overrides of the tiny preset.
KINDS = {
    "gqa": dict(),
    "mha": dict(num_kv_heads=4),
    "mqa": dict(num_kv_heads=1),
    "interleaved": dict(rope_layout="interleaved"),
    "bias": dict(qkv_bias=True, o_bias=True),
    "tied": dict(tie_embeddings=True),
    "head_dim": dict(head_dim=24),
    "linear_rope": dict(rope_scaling=dict(kind="linear", factor=4.0)),
    "llama3_rope": dict(rope_theta=500000.0, rope_scaling=dict(
        kind="llama3", factor=8.0, original_max_position=64,
        low_freq_factor=1.0, high_freq_factor=4.0)),
    "vocab_259": dict(vocab_size=259),
}


class VocabularyAndLayoutTest(parameterized.TestCase):
  """No optional package needed."""

  def test_byte_level_vocabulary(self):
    texts, types = gguf_export.vocabulary(data.VOCAB_SIZE)
    self.assertLen(set(texts), data.VOCAB_SIZE)
    chars = gguf_export.byte_to_unicode()
    self.assertEqual(sorted(chars), list(range(256)))
    self.assertLen(set(chars.values()), 256)
    self.assertEqual(texts[:256], [chars[b] for b in range(256)])
    self.assertEqual(texts[ord("A")], "A")
    self.assertEqual(texts[data.PAD:], ["<pad>", "<s>", "</s>"])
    self.assertEqual(types, [gguf_export.NORMAL] * 256 +
                     [gguf_export.CONTROL] * 3)
    texts, types = gguf_export.vocabulary(300)
    self.assertEqual(texts[-1], "<unused_299>")
    self.assertEqual(types[259:], [gguf_export.UNUSED] * 41)
    texts, _ = gguf_export.vocabulary(256)
    self.assertNotIn("<s>", texts)

  @parameterized.named_parameters(("half", "half"),
                                  ("interleaved", "interleaved"))
  def test_rope_permutation_commutes_with_the_rotation(self, layout):
    # llama.cpp rotates interleaved pairs of the permuted features; that
    # must be kvjax's rotation of `layout` pairs, permuted.
    H, T = 16, 5
    x_TNH = np.random.default_rng(0).standard_normal((T, 3, H)).astype(
        np.float32)
    config = _tiny(rope_layout=layout, head_dim=H)
    cos, sin = layers.rope_tables(config, jnp.arange(T)[:, None])
    perm = lambda x: gguf_export._rope_to_interleaved(np.asarray(x), layout)  # pylint: disable=protected-access
    want = perm(layers.apply_rope(jnp.asarray(x_TNH), cos, sin, layout))
    got = layers.apply_rope(jnp.asarray(perm(x_TNH)), cos, sin, "interleaved")
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)

  @parameterized.named_parameters(
      ("mla", dict(variant="mla"), "attention='mla'"),
      ("sliding_window", dict(sliding_window=8), "sliding_window=8"),
      ("yarn", dict(rope_scaling=dict(kind="yarn", factor=2.0,
                                      original_max_position=64)),
       "rope_scaling.kind='yarn'"),
      ("bias_head_dim", dict(qkv_bias=True, head_dim=24), "qkv_bias=True"),
  )
  def test_refuses_what_llama_cpp_cannot_compute(self, overrides, field):
    config = _tiny(**overrides)
    with self.assertRaisesRegex(ValueError, field.replace("(", r"\(")):
      gguf_export.check_exportable(config)

  def test_refuses_moe(self):
    config = kvjax.ModelConfig(
        vocab_size=96, num_layers=2, embed_dim=32, num_heads=4,
        num_kv_heads=2, mlp_dim=48, moe=kvjax.MoEConfig(
            num_experts=4, experts_per_token=2, expert_dim=16))
    with self.assertRaisesRegex(ValueError, "moe"):
      gguf_export.check_exportable(config)

  def test_refuses_packed_and_mismatched_params(self):
    config = _tiny()
    params = kvjax.init_params(config, jax.random.key(0))
    with self.assertRaisesRegex(ValueError, "packed"):
      gguf_export.gguf_tensors(kvjax.pack(params, config), config)
    with self.assertRaisesRegex(ValueError, "the config implies"):
      gguf_export.gguf_tensors(params, _tiny(num_layers=3))

  @parameterized.named_parameters(*[(k, k) for k in KINDS])
  def test_tensor_shapes_are_huggingface_out_in(self, kind):
    config = _tiny(**KINDS[kind])
    t = gguf_export.gguf_tensors(_random_params(config), config)
    D, N, K, H, F, V = (config.embed_dim, config.num_heads,
                        config.num_kv_heads, config.head_dim, config.mlp_dim,
                        config.vocab_size)
    self.assertEqual(t["token_embd.weight"].shape, (V, D))
    self.assertEqual("output.weight" in t, not config.tie_embeddings)
    self.assertEqual(t["blk.1.attn_q.weight"].shape, (N * H, D))
    self.assertEqual(t["blk.1.attn_k.weight"].shape, (K * H, D))
    self.assertEqual(t["blk.1.attn_output.weight"].shape, (D, N * H))
    self.assertEqual(t["blk.1.ffn_down.weight"].shape, (D, F))
    self.assertEqual("blk.0.attn_q.bias" in t, config.qkv_bias)
    self.assertEqual("rope_freqs.weight" in t,
                     config.rope_scaling.kind == "llama3")
    for name, arr in t.items():
      self.assertEqual(arr.dtype, np.float32, name)
      self.assertTrue(arr.flags.c_contiguous, name)


class GGUFRoundTripTest(parameterized.TestCase):
  """Needs the `gguf` package only."""

  @parameterized.named_parameters(("gqa", "gqa"), ("bias", "bias"),
                                  ("llama3_rope", "llama3_rope"),
                                  ("vocab_259", "vocab_259"))
  def test_file_holds_the_tensors_and_metadata(self, kind):
    gguf = pytest.importorskip("gguf")
    config = _tiny(**KINDS[kind])
    params = _random_params(config)
    want = gguf_export.gguf_tensors(params, config)
    meta = gguf_export.gguf_metadata(config, "tiny")
    with tempfile.TemporaryDirectory() as tmp:
      path = gguf_export.write_gguf(os.path.join(tmp, "m.gguf"), params,
                                    config, name="tiny")
      reader = gguf.GGUFReader(path)
      got = {t.name: t for t in reader.tensors}
      self.assertEqual(sorted(got), sorted(want))
      for name, arr in want.items():
        t = got[name]
        self.assertEqual(t.tensor_type, gguf.GGMLQuantizationType.F32, name)
        self.assertEqual(tuple(int(n) for n in t.shape), arr.shape[::-1],
                         name)  # GGUF lists ne, innermost first
        np.testing.assert_array_equal(
            np.asarray(t.data).reshape(arr.shape), arr, err_msg=name)
      fields = reader.fields
      self.assertEqual(fields["general.architecture"].contents(), "llama")
      for key, value in meta.items():
        self.assertIn(key, fields)
        read = fields[key].contents()
        if isinstance(value, float):
          self.assertAlmostEqual(read, value, places=5, msg=key)
        else:
          self.assertEqual(read, value, key)
      V = config.vocab_size
      self.assertLen(fields["tokenizer.ggml.tokens"].contents(), V)


# ---- llama.cpp ---------------------------------------------------------------
def _llama(path, **kw):
  from kvjax.lab import llamacpp  # pylint: disable=g-import-not-at-top
  return llamacpp.LlamaCpp(path, **kw)


class LlamaCppParityTest(parameterized.TestCase):
  """llama.cpp (f32 weights, f32 KV cache) against kvjax on the same
  weights. Tolerance: `kvjax.tolerance` (float32, depth L + 1: rtol =
  (L + 1)·64·2^-24, times the largest |logit|)."""

  def setUp(self):
    super().setUp()
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")

  def _write(self, tmp, params, config):
    return gguf_export.write_gguf(os.path.join(tmp, "m.gguf"), params,
                                  config)

  def test_austen_logits_match_kvjax(self):
    config, params = orbax_checkpoint.restore_params(AUSTEN)
    ids_T = data.encode(TEXT, bos=True)
    want_TV = np.asarray(kvjax.forward(params, config, ids_T[None])[0])
    with tempfile.TemporaryDirectory() as tmp:
      with _llama(self._write(tmp, params, config),
                  capacity=256) as llm:
        got_TV = llm.logits(ids_T)
    err, scale = max_error(got_TV, want_TV)
    print(f"austen-gqa: max |dlogit| {err:.3e} over {ids_T.size} positions "
          f"(max |logit| {scale:.3g}; bound "
          f"{tolerance(config).atol(scale):.3e})")
    assert_close(got_TV, want_TV, config, msg="austen-gqa logits")
    np.testing.assert_array_equal(got_TV.argmax(-1), want_TV.argmax(-1))

  def test_tokenizer_is_kvjax_bytes(self):
    config, params = orbax_checkpoint.restore_params(AUSTEN)
    text = TEXT + "\tcafé — naïve 日本語 12345 'quoted' <s> \x00\x7f end"
    with tempfile.TemporaryDirectory() as tmp:
      with _llama(self._write(tmp, params, config), capacity=16) as llm:
        np.testing.assert_array_equal(llm.tokenize(text), data.encode(text))
        for b in (0, 10, 32, 65, 0xC3, 0xFF):
          self.assertEqual(llm.piece(b), bytes([b]))
        self.assertEqual(llm.piece(data.BOS), b"<s>")

  @pytest.mark.slow  # one kvjax compile per token count: ~10 s
  def test_austen_greedy_batch_matches_kvjax(self):
    config, params = orbax_checkpoint.restore_params(AUSTEN)
    rows = [data.encode(t, bos=True)[:40] for t in (
        TEXT, "Emma Woodhouse, handsome, clever, and rich, with a comfort")]
    ids_BT = np.stack(rows)
    want = np.asarray(kvjax.generate(params, config, ids_BT, 24))
    with tempfile.TemporaryDirectory() as tmp:
      with _llama(self._write(tmp, params, config), capacity=64,
                  batch=2) as llm:
        got = llm.generate(ids_BT, 24)
        np.testing.assert_array_equal(got, want)
        # Sequences are independent: one alone gives the same tokens.
        np.testing.assert_array_equal(llm.generate(ids_BT[1:], 24), want[1:])

  @cases.named([dict(kind=k) for k in KINDS], slow=lambda kind: kind != "gqa")
  def test_tiny_logits_match_kvjax(self, kind):
    config = _tiny(**KINDS[kind])
    params = _random_params(config)
    ids_T = np.random.default_rng(1).integers(0, config.vocab_size, 48)
    want_TV = np.asarray(kvjax.forward(params, config, ids_T[None])[0])
    with tempfile.TemporaryDirectory() as tmp:
      with _llama(self._write(tmp, params, config), capacity=64) as llm:
        got_TV = llm.logits(ids_T)
    assert_close(got_TV, want_TV, config, msg=f"tiny {kind} logits")


@pytest.mark.slow  # subprocesses that import JAX
class LlamaCppPeerExperimentTest(absltest.TestCase):
  """experiments/llamacpp_peer.py end to end, and its skip."""

  def _run(self, *flags, block_llama_cpp=False):
    script = os.path.join(ROOT, "experiments", "llamacpp_peer.py")
    code = ("import runpy, sys\n"
            + ("sys.modules['llama_cpp'] = None\n" if block_llama_cpp
               else "")
            + f"sys.argv = [{script!r}] + sys.argv[1:]\n"
            f"runpy.run_path({script!r}, run_name='__main__')\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", code, *flags], cwd=ROOT,
                          env=env, capture_output=True, text=True,
                          timeout=600)

  def test_skips_with_a_json_reason_without_llama_cpp(self):
    with tempfile.TemporaryDirectory() as tmp:
      proc = self._run(f"--workdir={tmp}", block_llama_cpp=True)
      self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
      out = json.loads(proc.stdout.strip().splitlines()[-1])
      self.assertTrue(out["skipped"])
      self.assertIn("llama-cpp-python", out["reason"])
      with open(os.path.join(tmp, "llamacpp_peer.json")) as f:
        self.assertEqual(json.load(f), out)

  def test_long_new_tokens_are_needed_for_the_compared_models_only(self):
    with tempfile.TemporaryDirectory() as tmp:
      proc = self._run("--models=shipped,preset",
                       "--long_new_tokens=preset:64", f"--workdir={tmp}",
                       block_llama_cpp=True)
      self.assertNotEqual(proc.returncode, 0)
      self.assertIn("--long_new_tokens has no entry for ['shipped']",
                    proc.stderr)
      # One model compared: its entry is enough (here the run then skips).
      proc = self._run("--models=preset", "--long_new_tokens=preset:64",
                       f"--workdir={tmp}", block_llama_cpp=True)
      self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
      self.assertTrue(json.loads(proc.stdout.strip().splitlines()[-1])[
          "skipped"])

  def test_tiny_run_writes_rows_parity_and_figure(self):
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    with tempfile.TemporaryDirectory() as tmp:
      proc = self._run(
          "--config=configs/model.py:gqa-tiny", "--models=preset",
          "--batches=2", "--new_tokens=256", "--contexts=512",
          "--long_new_tokens=shipped:512,preset:256", "--repeats=1",
          "--long_repeats=1", f"--workdir={tmp}")
      self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
      with open(os.path.join(tmp, "llamacpp_peer.json")) as f:
        res = json.load(f)
      self.assertTrue(os.path.exists(os.path.join(tmp, "llamacpp_peer.png")))
      p = res["parity"]["preset"]
      self.assertLessEqual(p["max_logit_diff"], p["logit_bound"])
      self.assertEqual(p["greedy_agree"], p["greedy_checked"])
      for key in ("cpu", "revision", "threads", "omp_wait_policy", "argv"):
        self.assertIn(key, res)
      labels = {r["label"] for r in res["rows"]} | set(res.get("failed", {}))
      self.assertEqual(labels, {"preset/b2", "preset/ctx512"})
      for r in res["rows"]:
        self.assertGreater(r["llamacpp_decode_tokens_per_s"], 0)
        self.assertGreater(r["kvjax_prefill_tokens_per_s"], 0)


if __name__ == "__main__":
  absltest.main()
