"""kvjax.lab.explain and experiments/explain.py: the explainer pictures.

The counted FLOPs are checked in exact numbers against independent
arithmetic (a no-cache step is a cached step plus a prefill of the
history; its cost has a constant second difference, the cached step a
constant first difference); the sinks cache's positions against the
StreamingLLM rule written out here; the attention matrix against
causality. The experiment runs end to end on a tiny random model.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import pytest

import kvjax
from kvjax import data
from kvjax.lab import benchmarking as bm
from kvjax.lab import explain
import tiny_models  # pylint: disable=g-bad-import-order

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _kept(t: int, capacity: int, num_sinks: int) -> list[int]:
  """The stream positions a StreamingLLM cache holds after feeding
  positions 0..t: the first num_sinks, and the newest capacity − num_sinks."""
  return [p for p in range(t + 1)
          if p < num_sinks or p > t - (capacity - num_sinks)]


class StepFlopsTest(parameterized.TestCase):

  @parameterized.parameters(*tiny_models.VARIANTS)
  def test_no_cache_is_quadratic_and_cached_linear_in_exact_numbers(
      self, variant):
    config = tiny_models.tiny(variant)
    f = explain.step_flops(config, 40)
    nc, c = np.asarray(f["no_cache"]), np.asarray(f["cached"])
    pair = f["attention_per_pair"]
    # One query-key pair: q·k and p·v over every layer and query head.
    if config.attention == "mla":
      qk = config.qk_nope_head_dim + config.qk_rope_head_dim
      v = config.v_head_dim
    else:
      qk = v = config.head_dim
    self.assertEqual(pair, 2 * config.num_layers * config.num_heads *
                     (qk + v))
    # Step 0 is one token either way.
    self.assertEqual(nc[0], c[0])
    # Cached: every step one more key, nothing else grows.
    np.testing.assert_array_equal(np.diff(c), np.full(39, pair))
    # No cache: the second difference is the one pair of attention the
    # growing triangle adds per row: quadratic, exactly.
    np.testing.assert_array_equal(np.diff(nc, 2), np.full(38, pair))
    self.assertGreater(np.diff(nc)[0], 100 * pair)  # the linear part: weights
    # Cumulative: the no-cache sum has a constant third difference, the
    # cached one a constant second (and its first difference is the step).
    np.testing.assert_array_equal(np.diff(f["no_cache_cumulative"], 3),
                                  np.full(37, pair))
    np.testing.assert_array_equal(np.diff(f["cached_cumulative"], 2),
                                  np.full(38, pair))
    np.testing.assert_array_equal(np.cumsum(c), f["cached_cumulative"])

  @parameterized.parameters(*tiny_models.VARIANTS)
  def test_the_no_cache_step_adds_exactly_a_prefill_of_the_history(
      self, variant):
    config = tiny_models.tiny(variant)
    for t in (1, 2, 7, 33):
      extra = (explain.no_cache_step_flops(config, 1, t)["total"] -
               explain.decode_step_flops(config, 1, t + 1)["total"])
      self.assertEqual(extra, bm.prefill_flops(config, 1, t,
                                               all_logits=True)["total"])

  def test_decode_step_counts_weights_once_and_every_key(self):
    config = tiny_models.tiny("gqa")
    L, N, D, H, V = (config.num_layers, config.num_heads, config.embed_dim,
                     config.head_dim, config.vocab_size)
    K, F = config.num_kv_heads, config.mlp_dim
    per_layer = D * N * H + 2 * D * K * H + N * H * D + 3 * D * F
    for context in (1, 5, 64):
      f = explain.decode_step_flops(config, 2, context)
      self.assertEqual(f["matmul"], 2 * 2 * L * per_layer)
      self.assertEqual(f["attention"], 2 * 2 * L * N * 2 * H * context)
      self.assertEqual(f["lm_head"], 2 * 2 * D * V)
      self.assertEqual(f["total"], f["matmul"] + f["attention"] +
                       f["lm_head"])
    with self.assertRaisesRegex(ValueError, "context"):
      explain.decode_step_flops(config, 1, 0)
    with self.assertRaisesRegex(ValueError, "position"):
      explain.no_cache_step_flops(config, 1, -1)

  def test_prefill_bytes_are_the_weights_and_the_written_cache(self):
    config = tiny_models.tiny("gqa")
    params = tiny_models.tiny_params("gqa")
    b = explain.prefill_bytes(params, config, 1, 24)
    self.assertEqual(b["weights"], bm.tree_bytes(params) -
                     bm.tree_bytes(params["embed"]))
    self.assertEqual(b["cache"], 24 * kvjax.kv_bytes_per_token(config))
    self.assertEqual(b["total"], b["weights"] + b["cache"])


class SinksTraceTest(parameterized.TestCase):

  @parameterized.parameters(*tiny_models.VARIANTS)
  def test_eviction_keeps_the_sinks_and_the_newest_window(self, variant):
    config = tiny_models.tiny(variant)
    params = tiny_models.tiny_params(variant)
    S, n, steps = 7, 3, 15
    tokens = np.arange(5, 15, dtype=np.int32)  # 10 given, 5 greedy
    tr = explain.sinks_trace(params, config, tokens, steps=steps,
                             capacity=S, num_sinks=n)
    self.assertEqual(tr["fed"][:10], tokens.tolist())
    self.assertLen(tr["fed"], steps)
    per_token = kvjax.kv_bytes_per_token(config)
    for t, held in enumerate(tr["held"]):
      self.assertLen(held, S)
      self.assertEqual(sorted(p for p in held if p >= 0), _kept(t, S, n),
                       f"after step {t}")
      self.assertEqual(held.count(-1), max(S - (t + 1), 0))
      self.assertEqual(held[:n], [p if p <= t else -1 for p in range(n)])
      self.assertEqual(tr["used_bytes"][t], per_token * min(t + 1, S))
      self.assertEqual(tr["unbounded_bytes"][t], per_token * (t + 1))
    self.assertEqual(tr["allocated_bytes"], per_token * S)
    self.assertEqual(tr["policy"]["eviction"], "sinks")
    occ = explain.occupancy(tr)
    last = occ[-1]
    self.assertEqual(last[:n].tolist(), [explain.SINK] * n)
    self.assertEqual(last[n:steps - (S - n)].tolist(),
                     [explain.EVICTED] * (steps - S))
    self.assertEqual(last[steps - (S - n):].tolist(),
                     [explain.WINDOW] * (S - n))
    self.assertTrue((np.triu(occ, 1) == explain.FUTURE).all())

  def test_bad_settings_fail_before_compute(self):
    config = tiny_models.tiny("gqa")
    params = tiny_models.tiny_params("gqa")
    with self.assertRaisesRegex(ValueError, "capacity"):
      explain.sinks_trace(params, config, [1, 2], steps=3, capacity=4,
                          num_sinks=4)
    with self.assertRaisesRegex(ValueError, "steps"):
      explain.sinks_trace(params, config, [1, 2], steps=0, capacity=4)


class AttentionStepsTest(absltest.TestCase):

  def test_matrix_is_causal_and_the_recompute_repeats_the_last_step(self):
    config = tiny_models.tiny("gqa")
    params = tiny_models.tiny_params("gqa")
    tokens = data.encode("It is a truth")
    T = tokens.size
    out = explain.attention_steps(params, config, tokens)
    A = np.asarray(out["matrix"])
    self.assertEqual(A.shape, (T, T))
    np.testing.assert_allclose(A.sum(axis=1), np.ones(T), rtol=1e-5)
    self.assertTrue((A[np.triu_indices(T, 1)] == 0).all())
    self.assertEqual(A[0, 0], 1.0)
    self.assertLess(out["recompute_max_abs_diff"], 1e-5)
    one = np.asarray(explain.attention_steps(params, config, tokens,
                                             layer=1)["matrix"])
    probs = np.asarray(kvjax.attention_probs(params, config, tokens[None]))
    np.testing.assert_allclose(one, probs[1, 0].mean(axis=0), rtol=1e-6)
    with self.assertRaisesRegex(ValueError, "layer"):
      explain.attention_steps(params, config, tokens, layer=9)
    with self.assertRaisesRegex(ValueError, "T >= 2"):
      explain.attention_steps(params, config, tokens[:1])


class SettingsTest(absltest.TestCase):

  def test_each_bad_field_is_named(self):
    config = tiny_models.tiny("gqa")
    for kw, field in ((dict(prompt_len=0), "prompt_len"),
                      (dict(attention_len=1), "attention_len"),
                      (dict(attention_len=50), "attention_len"),
                      (dict(time_positions=(-1,)), "time_positions"),
                      (dict(prompt_len=10**6), "max_seq_len"),
                      (dict(layer=7), "layer"),
                      (dict(capacity=4, num_sinks=4), "capacity")):
      with self.assertRaisesRegex(ValueError, field):
        explain.Settings(**kw).check(config, 40)
    explain.Settings().check(config, 40)


class DrawingTest(absltest.TestCase):
  """The figures from hand-made results: one GIF frame per step."""

  def test_gifs_have_a_frame_per_step_and_pngs_their_labels(self):
    from PIL import Image  # pylint: disable=g-import-not-at-top
    config = tiny_models.tiny("gqa")
    T, S, n = 5, 4, 2
    A = np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]
    attn = dict(matrix=A.tolist(), layer=None, recompute_max_abs_diff=0.0,
                length=T)
    flops = explain.step_flops(config, 9)
    held = [[p if p <= t else -1 for p in range(n)] +
            [q for q in range(n, t + 1) if q > t - (S - n)][::-1] +
            [-1] * max(S - n - (t + 1 - n), 0) for t in range(6)]
    held = [h + [-1] * (S - len(h)) for h in held]
    trace = dict(held=held, num_sinks=n, capacity=S,
                 used_bytes=[100 * min(t + 1, S) for t in range(6)],
                 formula_bytes=[100 * min(t + 1, S) for t in range(6)],
                 unbounded_bytes=[100 * (t + 1) for t in range(6)],
                 allocated_bytes=100 * S, kv_bytes_per_token=100)
    times = [dict(position=p, no_cache_s=1e-3 * (p + 1), cached_s=1e-3,
                  time_ratio=p + 1.0, flops_ratio=p + 2.0) for p in (2, 8)]
    with tempfile.TemporaryDirectory() as tmp:
      for mode in ("no_cache", "cache"):
        path = os.path.join(tmp, f"{mode}.gif")
        self.assertEqual(explain.animate_attention(
            attn, flops, mode, path, title=mode, labels=list("abcde")), T)
        with Image.open(path) as im:
          self.assertEqual(im.n_frames, T)
      path = os.path.join(tmp, "cache.gif")
      self.assertEqual(explain.animate_cache(trace, path, title="c"), 6)
      with Image.open(path) as im:
        self.assertEqual(im.n_frames, 6)
      labels = explain.plot_cache_vs_no_cache(
          attn, flops, times, os.path.join(tmp, "a.png"), title="t")
      self.assertIn("measured step time", labels["titles"])
      labels = explain.plot_cache_growth(trace, os.path.join(tmp, "g.png"),
                                         title="g")
      self.assertIn("KiB of K/V held", labels["ylabels"])
    with self.assertRaisesRegex(ValueError, "mode"):
      explain.animate_attention(attn, flops, "paged", "x.gif", title="")


@pytest.mark.slow  # a subprocess that compiles prefill, decode and probes
class ExplainExperimentTest(absltest.TestCase):

  def test_tiny_run_writes_pngs_gifs_and_json(self):
    from PIL import Image  # pylint: disable=g-import-not-at-top
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(
                   [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    text = "It is a truth universally acknowledged"
    with tempfile.TemporaryDirectory() as tmp:
      proc = subprocess.run(
          [sys.executable, os.path.join(ROOT, "experiments", "explain.py"),
           "--random", "--config=configs/model.py:gqa-tiny",
           f"--text={text}", "--prompt_len=16", "--attention_len=6",
           "--time_positions=3", "--steps=9", "--capacity=5",
           "--num_sinks=2", "--repeats=1", "--matmul_n=64",
           "--read_bytes=65536", "--fps=8", f"--workdir={tmp}"],
          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
      self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
      for name in explain.FILES.values():
        self.assertGreater(os.path.getsize(os.path.join(tmp, name)), 0, name)
      frames = {}
      for key in ("no_cache_gif", "cache_gif", "growth_gif"):
        with Image.open(os.path.join(tmp, explain.FILES[key])) as im:
          frames[key] = im.n_frames
      with open(os.path.join(tmp, explain.FILES["json"])) as f:
        out = json.load(f)
    self.assertEqual(frames, dict(no_cache_gif=6, cache_gif=6, growth_gif=9))
    roof = out["roofline"]
    self.assertEqual(roof["prompt_len"], 16)
    for point in (roof["prefill"], roof["decode"]):
      self.assertEqual(point["intensity"], point["flops"] / point["bytes"])
      self.assertEqual(point["flops_per_s"], point["flops"] /
                       point["seconds"])
    self.assertGreater(roof["prefill"]["intensity"],
                       10 * roof["decode"]["intensity"])
    self.assertEqual(np.asarray(out["attention"]["matrix"]).shape, (6, 6))
    self.assertEqual([r["position"] for r in out["times"]], [3])
    self.assertEqual(out["cache"]["fed"][:9], data.encode(text)[:9].tolist())
    self.assertEqual(sorted(p for p in out["cache"]["held"][-1] if p >= 0),
                     _kept(8, 5, 2))
    self.assertEqual(out["model"]["variant"], "gqa")
    self.assertIn("cpu", out["host"])
    self.assertIn("head", out["revision"])
    self.assertIn("probes", proc.stdout)
    self.assertIn("sinks cache S=5", proc.stdout)


if __name__ == "__main__":
  absltest.main()
