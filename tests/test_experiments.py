"""Every experiments/ script imports and parses its flags.

The scripts are thin absl mains over the library; a renamed library symbol
or a missing import would otherwise surface only when someone runs a
benchmark. Each script runs `--helpshort` in its own process, forked from
one that imported jax once (absl exits with status 1 after printing help; a
failed import prints a traceback), and
every script runs through `kvjax.cli.run` (one-line errors, --show_config,
quiet logs: tests/test_cli.py). The peer benchmark also runs end to end on
the tiny preset.
"""

import glob
import json
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest
import numpy as np
import pytest

import kvjax
from kvjax.tolerance import assert_close, tolerance
from configs import model as model_presets

ROOT = os.path.join(os.path.dirname(__file__), "..")
ENV = dict(os.environ, JAX_PLATFORMS="cpu")  # every script's process
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "experiments", "*.py")))
# The scripts that run through kvjax.cli.run (a new script joins by calling
# it: then it gives one-line errors, --show_config and quiet logs too).
CLI_SCRIPTS = sorted(
    os.path.join(ROOT, "experiments", f"{name}.py") for name in (
        "ablate", "attention_map", "benchmark", "cache_layout", "cache_table",
        "decode_layout", "error_check_cost", "explain", "generate",
        "llamacpp_peer", "memory_growth",
        "peer_benchmark", "prefill_scaling", "serve", "streaming_eval",
        "policy_eval", "segment_copy", "sink_curves", "train",
        "train_speed"))


def _run_scripts(runs):
  """[(script, args)] -> [{returncode, stdout, stderr}]: each script run as
  `python script args` would, forked from one process that imported jax
  once (tests/forked_scripts.py)."""
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "tests", "forked_scripts.py")],
      input=json.dumps(runs), cwd=ROOT, env=ENV, capture_output=True,
      text=True, timeout=600, check=True)
  return json.loads(proc.stdout)


def _run_experiment(name: str, *flags):
  """experiments/<name>.py run with `flags` in a fresh interpreter."""
  return subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", f"{name}.py"),
       *flags], cwd=ROOT, env=ENV, capture_output=True, text=True,
      timeout=600)


def _run_for_json(test, name: str, json_name: str, *flags, pngs=()):
  """experiments/<name>.py run with `flags` and a temporary --workdir:
  asserts that it exits 0 and writes each of `pngs` non-empty, and returns
  the process and the JSON it wrote to `json_name`."""
  with tempfile.TemporaryDirectory() as tmp:
    proc = _run_experiment(name, *flags, f"--workdir={tmp}")
    test.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    with open(os.path.join(tmp, json_name)) as f:
      out = json.load(f)
    for png in pngs:
      test.assertGreater(os.path.getsize(os.path.join(tmp, png)), 0, png)
  return proc, out


class ExperimentsImportTest(absltest.TestCase):

  def test_every_script_imports_and_lists_its_flags(self):
    self.assertGreaterEqual(len(SCRIPTS), 8)
    for path, proc in zip(SCRIPTS, _run_scripts(
        [(path, ["--helpshort"]) for path in SCRIPTS])):
      out, err = proc["stdout"], proc["stderr"]
      name = os.path.basename(path)
      self.assertNotIn("Traceback", out + err, f"{name}:\n{err[-3000:]}")
      self.assertIn(name, out + err, f"{name} printed no flag help")
      if path in CLI_SCRIPTS:
        self.assertIn("--[no]show_config", out, name)

  def test_every_script_refuses_a_stray_argument_in_one_line(self):
    for path, proc in zip(CLI_SCRIPTS, _run_scripts(
        [(path, ["stray"]) for path in CLI_SCRIPTS])):
      out, err = proc["stdout"], proc["stderr"]
      name = os.path.basename(path)
      self.assertEqual(proc["returncode"], 2, f"{name}:\n{err[-3000:]}")
      self.assertEqual(out, "", name)
      self.assertLen(err.splitlines(), 1, f"{name}:\n{err[-3000:]}")
      # A required flag may be named first; either way, one line.
      self.assertRegex(err, r"^error: (unexpected arguments 'stray'|"
                       r"--\w+ is required)", name)

  def test_the_forked_runner_reports_what_a_fresh_interpreter_does(self):
    # The runner's exit status, streams and tracebacks are those of
    # `python script args`: checked on one script against a real process.
    path = os.path.join(ROOT, "experiments", "generate.py")
    argss = (["stray"], ["--helpshort"], ["--config=configs/nope.py"])
    fresh = [subprocess.Popen([sys.executable, path, *args], cwd=ROOT, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for args in argss]
    forked = _run_scripts([(path, args) for args in argss])
    for args, proc, run in zip(argss, fresh, forked):
      out, err = proc.communicate(timeout=300)
      self.assertEqual(run["returncode"], proc.returncode, args)
      self.assertEqual(run["stdout"], out, args)
      self.assertEqual(run["stderr"].splitlines()[:1], err.splitlines()[:1],
                       args)


@pytest.mark.slow  # subprocesses that import torch and transformers
class PeerBenchmarkTest(absltest.TestCase):
  """The peer benchmark end to end on the tiny preset (torch and
  transformers come with the test extra)."""

  def test_tiny_run_writes_ratios_and_their_spread(self):
    _, out = _run_for_json(
        self, "peer_benchmark", "peer.json",
        "--config=configs/model.py:gqa-tiny", "--batches=1,2",
        # 512 tokens: decode time (~15 ms here) dwarfs the noise of a
        # loaded machine's 1-token prefill timing (64 gave ~1.6 ms of
        # decode; a CI run saw a 6 ms median prefill and failed).
        "--prompt_len=8", "--new_tokens=512", "--repeats=3",
        "--check_tokens=4", pngs=("peer.png",))
    tiny = kvjax.ModelConfig.from_dict(model_presets.model_dict("gqa",
                                                                "tiny"))
    self.assertLessEqual(out["max_logit_diff"],
                         tolerance(tiny).atol(out["logit_scale"]))
    self.assertEqual(out["greedy_agree"], {"loaded": 4})
    self.assertEqual(sorted(out["batches"]), ["1", "2"])
    for row in out["batches"].values():
      rounds = row["decode_ratio_loaded_rounds"]
      self.assertLen(rounds, 3)
      kv, hf = (row["kvjax_loaded_decode_tokens_per_s_rounds"],
                row["hf_decode_tokens_per_s_rounds"])
      # Ratios of the float64 rates that were stored: exact but for the
      # division's rounding.
      assert_close(np.asarray(rounds), np.divide(kv, hf), compute="float64",
                   depth=1)
      sp = row["decode_ratio_loaded_spread"]
      self.assertEqual(sp["min"], min(rounds))
      self.assertEqual(sp["max"], max(rounds))
      self.assertAlmostEqual(sp["median"], sorted(rounds)[1])
      self.assertGreater(row["decode_ratio_loaded"], 0)

  def test_bad_batches_fail_before_building_a_model(self):
    proc = _run_experiment("peer_benchmark", "--batches=1,0")
    self.assertNotEqual(proc.returncode, 0)
    self.assertIn("--batches=1,0", proc.stderr)
    self.assertNotIn("params; torch", proc.stderr)


@pytest.mark.slow  # a subprocess that compiles three prefills
class PrefillScalingTest(absltest.TestCase):

  def test_tiny_run_writes_rates_and_memory(self):
    proc, out = _run_for_json(
        self, "prefill_scaling", "prefill_scaling.json",
        "--config=configs/model.py:gqa-tiny", "--lengths=16,64",
        "--memory_lengths=64,4096", "--path_lengths=64", "--repeats=1",
        "--chunk=1024", "--chunk_memory_lengths=4096,8192",
        pngs=("prefill_scaling.png",))
    self.assertEqual([r["length"] for r in out["rows"]], [16, 64])
    self.assertEqual(out["rows"][0]["relative"], 1.0)
    for r in out["rows"]:
      assert_close(r["tokens_per_s"], r["length"] / r["prefill_s"],
                   compute="float64")
    memory = {(m["length"], m["path"]): m for m in out["memory"]}
    self.assertEqual(sorted(memory), [(64, "dense"), (64, "tiled"),
                                      (4096, "dense"), (4096, "tiled")])
    # The 4096-token cache alone is 64x the 64-token one: memory grows.
    self.assertGreater(memory[4096, "dense"]["arguments"],
                       memory[64, "dense"]["arguments"])
    # Tiles never hold a 4096 x 4096 score block: less temporary memory.
    self.assertLess(memory[4096, "tiled"]["temporaries"],
                    memory[4096, "dense"]["temporaries"])
    (paths,) = out["paths"]
    self.assertEqual(paths["length"], 64)
    for name in ("dense", "tiled"):
      assert_close(paths[name]["tokens_per_s"], 64 / paths[name]["prefill_s"],
                   compute="float64")
    self.assertIn("cpu", out["host"])
    self.assertIn("64 tokens:", proc.stdout)
    # The last chunk holds what it held at half the length.
    chunks = {m["length"]: m for m in out["chunk_memory"]}
    self.assertEqual(sorted(chunks), [4096, 8192])
    self.assertGreater(chunks[8192]["outputs"], chunks[4096]["outputs"])
    self.assertLess(chunks[8192]["temporaries"] - chunks[4096]["temporaries"],
                    (chunks[8192]["outputs"] - chunks[4096]["outputs"]) / 100)
    self.assertIn("in chunks of 1024", proc.stdout)


@pytest.mark.slow  # a subprocess that compiles four decode loops
class CacheLayoutTest(absltest.TestCase):

  def test_tiny_mla_run_times_both_latent_layouts(self):
    proc, out = _run_for_json(
        self, "cache_layout", "cache_layout.json", "--preset=mla-tiny",
        "--batch=2", "--contexts=64", "--kv_dtypes=float32,int8", "--steps=2",
        "--repeats=1")
    # blocked views hold GQA caches only; the native latent kernel reads
    # float and int8 latents: MLA times stacked, layered and native.
    self.assertEqual(sorted((r["kv_dtype"], r["layout"]) for r in out["rows"]),
                     [("float32", "layered"), ("float32", "native"),
                      ("float32", "stacked"), ("int8", "layered"),
                      ("int8", "native"), ("int8", "stacked")])
    first = out["rows"][0]
    self.assertEqual((first["kv_dtype"], first["layout"]),
                     ("float32", "stacked"))
    self.assertEqual(first["vs_first"], 1.0)
    for r in out["rows"]:
      self.assertGreater(r["step_s"], 0)
      self.assertEqual(r["context"], 64)
    self.assertIn("layered", proc.stdout)


@pytest.mark.slow  # a subprocess that compiles a few copies
class SegmentCopyTest(absltest.TestCase):

  def test_tiny_run_times_each_view_and_skips_what_has_none(self):
    proc, out = _run_for_json(
        self, "segment_copy", "segment_copy.json", "--presets=mla-tiny",
        "--batch=2", "--contexts=100", "--kv_dtypes=float32,int4",
        "--layouts=native,blocked", "--steps=4", "--repeats=1",
        pngs=("segment_copy.png",))
    # MLA's float latents are read in place, its int4 ones copied per
    # layer; no blocked view holds latents.
    rows = {r["kv_dtype"]: r for r in out["rows"]}
    self.assertEqual(sorted(rows), ["float32", "int4"])
    self.assertTrue(rows["float32"]["in_place"])
    self.assertFalse(rows["int4"]["in_place"])
    for r in rows.values():
      self.assertLen(r["window_back"], 1)
    self.assertIn("blocked: skipped", proc.stdout)


@pytest.mark.slow  # a subprocess that compiles the probe
class AttentionMapTest(absltest.TestCase):
  """The attention map end to end on a tiny random MLA model (MLA: the
  probe's per-query-head probabilities of the latent attention)."""

  def test_tiny_random_run_writes_json_and_pngs(self):
    _, out = _run_for_json(
        self, "attention_map", "attention_map.json", "--random",
        "--config=configs/model.py:mla-tiny",
        "--text=It is a truth universally acknowledged, that a single man "
        "in possession of a good fortune", "--length=32", "--windows=2",
        "--sink_k=1,3", pngs=("attention_map.png", "attention_stats.png"))
    L, N, T = 2, 4, 32  # mla-tiny; 2 windows of 32 bytes
    self.assertEqual((out["tokens"]["windows"], out["tokens"]["length"]),
                     (2, T))
    self.assertEqual(out["min_query"], T // 2)
    self.assertEqual(sorted(out["sink_mass"]), ["1", "3"])
    sink = np.asarray(out["sink_mass"]["1"])
    self.assertEqual(sink.shape, (L, N))
    self.assertTrue(((sink > 0) & (sink < 1)).all())
    q = np.arange(T // 2, T)
    assert_close(out["sink_mass_uniform"]["1"], np.mean(1 / (q + 1)),
                 compute="float64")
    self.assertEqual(np.asarray(out["entropy"]).shape, (L, N))
    self.assertEqual(np.asarray(out["distance_profile"]).shape, (L, N, T))
    self.assertLen(out["per_layer"], L)


@pytest.mark.slow  # two subprocesses that compile generate and a decode loop
class CompareCommitsProbeTest(absltest.TestCase):
  """compare_commits.py's per-checkout probe, run in this tree: the
  generate timing and the cache-bound decode step (--decode_context)."""

  def test_probe_times_generate_and_decode_steps(self):
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    try:
      import compare_commits  # pylint: disable=g-import-not-at-top
    finally:
      sys.path.pop(0)
    from kvjax.lab import benchmarking as bm  # pylint: disable=g-import-not-at-top
    # preset, batch, prompt, new tokens, repeats, chunk, context, kv dtype
    gen = bm.run_probe(ROOT, compare_commits._PROBE, "gqa-tiny", 2, 8, 4, 2,
                       0, 0, "float32")
    step = bm.run_probe(ROOT, compare_commits._PROBE, "gqa-tiny", 2, 8, 4,
                        2, 0, 96, "int8")
    for out in (gen, step):
      self.assertGreater(out["median_s"], 0)
      self.assertTrue(np.isfinite(out["median_s"]))
    self.assertLen(gen["times"], 2)
    # one decode step from 96 cached tokens, not a whole generate call
    self.assertLess(step["median_s"], gen["median_s"])
    self.assertEqual(step["loop"]["repeats"], 2)


if __name__ == "__main__":
  absltest.main()
