"""Tests for kvjax.lab.sink_curves: first-token mass against uniform, read
from training workdirs, and experiments/sink_curves.py on them."""

import json
import os
import subprocess
import sys

from absl.testing import absltest
import numpy as np

from kvjax.lab import attention_stats
from kvjax.lab import sink_curves

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _workdir(root, name, *, seq_len, layers_per_eval, mass_max, batch=16,
             bos=True):
  """A training workdir as experiments/train.py leaves it: config.json and
  metrics.jsonl with train records and validation records (100, 200, ...)
  carrying sink masses."""
  d = os.path.join(root, name)
  os.makedirs(d)
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump({"model": {"num_layers": len(layers_per_eval[0])},
               "train": {"seq_len": seq_len, "batch_size": batch,
                         "bos": bos}}, f)
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    for e, (layers, mx) in enumerate(zip(layers_per_eval, mass_max)):
      step = 100 * (e + 1)
      f.write(json.dumps(dict(split="train", step=step - 50, loss=2.0,
                              bits_per_byte=3.0)) + "\n")
      f.write(json.dumps(dict(split="validation", step=step, loss=1.5,
                              bits_per_byte=3.0 - 0.1 * e,
                              sink_mass=float(np.mean(layers)),
                              sink_mass_max=mx,
                              sink_mass_layers=layers)) + "\n")
  return d


class UniformTest(absltest.TestCase):

  def test_equals_the_uniform_baseline_of_the_attention_statistics(self):
    # The same number as attention_stats' sink mass of uniform causal
    # attention over the second half of a row (an independent path:
    # [T, T] probabilities, not a closed form).
    for T in (2, 7, 256, 1024):
      probs = attention_stats.uniform_probs(np.ones((1, T), bool))
      want = attention_stats.sink_mass(probs[None, :, None], k=1,
                                       min_query=T // 2)[0, 0]
      self.assertAlmostEqual(sink_curves.uniform_first_token_mass(T), want,
                             places=12)
    self.assertAlmostEqual(sink_curves.uniform_first_token_mass(256), 0.00540,
                           places=5)

  def test_too_short_a_row_is_refused(self):
    with self.assertRaisesRegex(ValueError, "seq_len=1"):
      sink_curves.uniform_first_token_mass(1)


class ReadRunTest(absltest.TestCase):

  def test_ratios_tokens_and_sink_layers(self):
    root = self.create_tempdir().full_path
    u = sink_curves.uniform_first_token_mass(256)
    # Eval 1: every layer below uniform; eval 2: layers 1 and 2 at 10x and
    # 30x (sinks), layer 0 at 9.9x (not), layer 3 at 0.5x.
    d = _workdir(root, "run-a", seq_len=256, mass_max=[2 * u, 100 * u],
                 layers_per_eval=[[0.1 * u] * 4,
                                  [9.9 * u, 10 * u, 30 * u, 0.5 * u]])
    run = sink_curves.read_run(d)
    self.assertEqual(run.name, "run-a")
    np.testing.assert_array_equal(run.steps, [100, 200])
    np.testing.assert_array_equal(run.tokens, [100 * 16 * 256,
                                               200 * 16 * 256])
    np.testing.assert_array_equal(run.layers_with_sinks(), [0, 2])
    rows = sink_curves.table([run])
    self.assertLen(rows, 2)
    self.assertAlmostEqual(rows[1]["mean_over_uniform"],
                           (9.9 + 10 + 30 + 0.5) / 4)
    self.assertAlmostEqual(rows[1]["max_head_over_uniform"], 100)
    np.testing.assert_allclose(rows[1]["layers_over_uniform"],
                               [9.9, 10, 30, 0.5])
    self.assertEqual(rows[0]["bits_per_byte"], 3.0)

  def test_runs_of_different_lengths_use_their_own_uniform(self):
    root = self.create_tempdir().full_path
    m = 0.004  # above uniform at 1,024 (0.0014), below it at 256 (0.0054)
    short = sink_curves.read_run(_workdir(
        root, "t256", seq_len=256, layers_per_eval=[[m]], mass_max=[m]))
    long = sink_curves.read_run(_workdir(
        root, "t1024", seq_len=1024, layers_per_eval=[[m]], mass_max=[m]))
    rows = {r["run"]: r for r in sink_curves.table([short, long])}
    self.assertLess(rows["t256"]["mean_over_uniform"], 1)
    self.assertGreater(rows["t1024"]["mean_over_uniform"], 2)

  def test_not_a_training_workdir(self):
    root = self.create_tempdir().full_path
    with self.assertRaisesRegex(ValueError, "no config.json"):
      sink_curves.read_run(root)
    d = os.path.join(root, "nosinks")
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
      json.dump({"model": {"num_layers": 1}, "train": {"seq_len": 8,
                                                        "batch_size": 1}}, f)
    with self.assertRaisesRegex(ValueError, "no validation record"):
      sink_curves.read_run(d)


class ScriptTest(absltest.TestCase):

  def test_prints_the_table_and_writes_json_and_png(self):
    root = self.create_tempdir().full_path
    u = sink_curves.uniform_first_token_mass(128)
    a = _workdir(root, "a", seq_len=128, mass_max=[u, 50 * u],
                 layers_per_eval=[[u, u], [20 * u, 12 * u]])
    b = _workdir(root, "b", seq_len=128, mass_max=[u],
                 layers_per_eval=[[0.2 * u, 0.1 * u]])
    out = os.path.join(root, "out")
    proc = subprocess.run(
        [sys.executable, "experiments/sink_curves.py", f"--workdir={out}",
         f"--runs={a},{b}"], cwd=ROOT, capture_output=True, text=True,
        timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
    self.assertIn("| a | 200 | 0.4 M | 2.900 | 16.000 | 50.00 | 20.00, "
                  "12.00 | 2 / 2 |", proc.stdout)
    self.assertIn("| b | 100 |", proc.stdout)
    with open(os.path.join(out, "sink_curves.json")) as f:
      saved = json.load(f)
    self.assertLen(saved["rows"], 3)
    self.assertGreater(os.path.getsize(os.path.join(out, "sink_curves.png")),
                       10_000)
    bad = subprocess.run(
        [sys.executable, "experiments/sink_curves.py", f"--workdir={out}",
         f"--runs={root}"], cwd=ROOT, capture_output=True, text=True,
        timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    self.assertEqual(bad.returncode, 2)
    self.assertRegex(bad.stderr, r"^error: --runs: .*no config.json")


if __name__ == "__main__":
  absltest.main()
