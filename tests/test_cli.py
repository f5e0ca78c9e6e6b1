"""The experiments' command line (kvjax/cli.py) and what each script says.

In-process tests cover the pieces (override checks, list flags, the error
criterion, the log filter, partial results, the config defaults, the plots'
labels). The subprocess tests (slow: each starts Python, JAX and kvjax)
run the scripts as a user would and hold each case to one clear line:
`error: <message>` on stderr, nothing else there, exit status 2.
"""

import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import tempfile

from absl import flags
from absl.testing import absltest
import numpy as np
import pytest

from kvjax.lab import ablation
from kvjax.lab import benchmarking as bm
from kvjax import cli
from kvjax import data
from configs import model as model_presets

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"


# ---- in-process -----------------------------------------------------------------
class OverridesTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.config = model_presets.get_config("gqa-tiny")

  def test_unknown_field_names_the_valid_ones(self):
    with self.assertRaises(cli.UsageError) as ctx:
      cli.check_overrides("config", self.config,
                          ["prog", "--config.model.num_layer=2"])
    message = str(ctx.exception)
    self.assertTrue(message.startswith(
        "unknown config field --config.model.num_layer (did you mean "
        "num_layers?); config.model has: attention, "), message)
    for field in self.config.model:
      self.assertIn(field, message)

  def test_unknown_section_and_path_through_a_value(self):
    with self.assertRaisesRegex(cli.UsageError, "config has: cache, generate, "
                                "model, preset$"):
      cli.check_overrides("config", self.config, ["p", "--config.modle.x=1"])
    with self.assertRaisesRegex(cli.UsageError, "config.model.num_layers is a "
                                "value"):
      cli.check_overrides("config", self.config,
                          ["p", "--config.model.num_layers.x=1"])

  def test_valid_overrides_and_other_flags_pass(self):
    cli.check_overrides("config", self.config, [
        "p", "--config.model.num_layers=2", "--noconfig.model.tie_embeddings",
        "--config.cache.eviction", "sinks", "--configx=1", "--workdir=/t"])

  def test_config_file_and_preset_errors(self):
    with self.assertRaisesRegex(cli.UsageError, "no config file"):
      cli.load_config("config", "/nonexistent/model.py:gqa")
    path = str(ROOT / "configs" / "model.py")
    with self.assertRaisesRegex(cli.UsageError, "unknown variant 'xqa'"):
      cli.load_config("config", f"{path}:xqa-tiny")
    self.assertEqual(cli.load_config("config", f"{path}:mla-tiny").preset,
                     "mla-tiny")


class ListFlagsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.fv = flags.FlagValues()
    self.ints = cli.DEFINE_int_list("batches", [1, 8], "b", lower_bound=1,
                                    flag_values=self.fv)
    self.names = cli.DEFINE_choice_list("modes", ["a"], ("a", "b", "c"), "m",
                                        flag_values=self.fv)

  def _error(self, *argv):
    with self.assertRaises(flags.IllegalFlagValueError) as ctx:
      self.fv(["prog", *argv])
    return str(ctx.exception)

  def test_values_are_parsed_and_checked(self):
    self.fv(["prog", "--batches=2, 16", "--modes=c,a"])
    self.assertEqual(self.ints.value, [2, 16])
    self.assertEqual(self.names.value, ["c", "a"])

  def test_defaults(self):
    self.fv(["prog"])
    self.assertEqual(self.ints.value, [1, 8])
    self.assertEqual(self.names.value, ["a"])

  def test_bad_values_say_which(self):
    self.assertEqual(self._error("--batches=1,x"),
                     "flag --batches=1,x: 'x' is not an integer")
    self.assertEqual(self._error("--batches=0"),
                     "flag --batches=0: 0 is below the minimum 1")
    self.assertEqual(self._error("--batches="),
                     "flag --batches=: needs at least one value")
    self.assertEqual(self._error("--modes=a,z"),
                     "flag --modes=a,z: 'z' is not one of a, b, c")
    self.assertEqual(self._error("--modes=b,b"),
                     "flag --modes=b,b: names b more than once")


class CheckingTest(absltest.TestCase):
  """The criterion: what a `checking()` block makes one line, and what it
  leaves alone."""

  def test_value_and_key_errors_become_usage_errors(self):
    with self.assertRaises(cli.UsageError) as ctx:
      with cli.checking("--config.cache"):
        raise ValueError("eviction='fifo' is not one of ('none',\n 'sinks')")
    self.assertEqual(str(ctx.exception),
                     "--config.cache: eviction='fifo' is not one of "
                     "('none', 'sinks')")
    with self.assertRaisesRegex(cli.UsageError, "^no such key$"):
      with cli.checking():
        raise KeyError("no such key")

  def test_bugs_and_missing_data_keep_their_type(self):
    with self.assertRaises(TypeError):
      with cli.checking():
        raise TypeError("a bug")
    with self.assertRaises(data.CorpusNotFoundError):
      with cli.checking("--data_dir"):
        raise data.CorpusNotFoundError("missing")

  def test_one_line(self):
    self.assertEqual(cli.one_line(KeyError("k")), "k")
    self.assertEqual(cli.one_line(ValueError("a\n  b")), "a b")
    self.assertEqual(cli.one_line(ValueError()), "ValueError")


class QuietLogsTest(absltest.TestCase):

  def _record(self, level, pathname):
    return logging.LogRecord("absl", level, pathname, 1, "m", None, None)

  def test_other_libraries_info_is_dropped_warnings_kept(self):
    kvjax_dir = os.path.dirname(os.path.abspath(cli.__file__))
    keep = cli._OwnInfo([kvjax_dir, str(EXPERIMENTS)])  # pylint: disable=protected-access
    orbax = "/site-packages/orbax/checkpoint/checkpoint_manager.py"
    self.assertFalse(keep.filter(self._record(logging.INFO, orbax)))
    self.assertTrue(keep.filter(self._record(logging.WARNING, orbax)))
    self.assertTrue(keep.filter(self._record(
        logging.INFO, os.path.join(kvjax_dir, "train.py"))))
    self.assertTrue(keep.filter(self._record(
        logging.INFO, str(EXPERIMENTS / "benchmark.py"))))
    # A sibling directory whose name starts like a root is not under it.
    self.assertFalse(keep.filter(self._record(
        logging.INFO, kvjax_dir + "_other/x.py")))


class JsonLinesTest(absltest.TestCase):

  def test_each_record_is_on_disk_before_the_next(self):
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "sub", "m.jsonl")
      out = cli.JsonLines(path)
      out.write(dict(a=1, x=np.float32(0.5), arr=np.arange(2)))
      # Not closed: what a killed run leaves is already readable.
      self.assertEqual(cli.read_json_lines(path),
                       [dict(a=1, x=0.5, arr=[0, 1])])
      out.write(dict(a=2))
      out.close()
      with open(path, "a") as f:
        f.write('{"torn": ')
      self.assertEqual([r["a"] for r in cli.read_json_lines(path)], [1, 2])
      with cli.JsonLines(path) as again:  # a new run starts a new file
        again.write(dict(a=3))
      self.assertEqual(cli.read_json_lines(path), [dict(a=3)])


class CheckRequestTest(absltest.TestCase):
  """generate's request, refused on the host before a model loads."""

  def test_counts_capacity_and_model_limit(self):
    from kvjax.lab import job  # pylint: disable=g-import-not-at-top
    from kvjax.cache import CachePolicy  # pylint: disable=g-import-not-at-top
    ok = dict(max_new_tokens=8, batch=1, prompt_len=8)
    job.check_request(**ok)
    job.check_request(**ok, capacity=15)  # the last token is never written
    for bad, pattern in ((dict(max_new_tokens=-5), "max_new_tokens must be "
                          "an int >= 1, got -5"),
                         (dict(batch=0), "batch must be"),
                         (dict(capacity=14), "capacity=14 holds fewer than "
                          "the 8-token prompt"),
                         (dict(max_seq_len=15), "exceed the model's "
                          "max_seq_len=15")):
      with self.subTest(str(bad)):
        with self.assertRaisesRegex(ValueError, pattern):
          job.check_request(**dict(ok, **bad))
    # An evicting cache may be smaller than the stream; it still needs room
    # for its sinks; cache positions lift the model's limit.
    sinks = CachePolicy("sinks", num_sinks=4, positions="cache")
    job.check_request(**ok, policy=sinks, capacity=8, max_seq_len=12)
    with self.assertRaisesRegex(ValueError, "must exceed num_sinks=4"):
      job.check_request(**ok, policy=sinks, capacity=4)


class SinkPositionsDefaultTest(absltest.TestCase):
  """configs/model.py: sinks and h2o rotate kept keys by their rank in the
  cache (StreamingLLM's choice, as streaming_eval) unless positions is set;
  the others keep original positions (the same model, no per-step
  rotation)."""

  def test_positions_follow_eviction_until_set(self):
    cfg = model_presets.get_config("gqa-small")
    cfg.lock()
    self.assertEqual(cfg.cache.positions, "original")
    for eviction, want in (("sinks", "cache"), ("h2o", "cache"),
                           ("window", "original"), ("none", "original")):
      cfg.cache.eviction = eviction
      self.assertEqual(cfg.cache.positions, want, eviction)
      self.assertEqual(cfg.cache.to_dict()["positions"], want, eviction)
    cfg.cache.positions = "original"
    cfg.cache.eviction = "sinks"
    self.assertEqual(cfg.cache.positions, "original")

  def test_streaming_eval_names_agree(self):
    from kvjax import policies  # pylint: disable=g-import-not-at-top
    from kvjax.lab import streaming  # pylint: disable=g-import-not-at-top
    names = ["sinks4", "window", "dense"] + [
        n for n, cls in policies.REGISTRY.items()
        if issubclass(cls, policies.Scored)]
    self.assertIn("h2o", names)
    for name in names:
      row = streaming.parse_policy(name, 64, 128)
      eviction = "none" if name == "dense" else row.policy.eviction
      self.assertEqual(row.policy.positions,
                       model_presets.default_positions(eviction), name)


class PlotLabelsTest(absltest.TestCase):
  """Each plot says what it shows: units, repeats or seeds, steps, spread."""

  def _timed(self, ms, repeats=3):
    s = ms / 1e3
    return dict(step_s=s, loop=dict(median_s=4 * s, min_s=3 * s,
                                    max_s=6 * s, repeats=repeats))

  def test_sweep_has_spread_and_two_short_legends(self):
    rows = [dict(variant=v, kv_dtype=k, batch=b, context=c,
                 bytes=dict(total=b * c * 1000), **self._timed(1.0 + c / 1000))
            for v in ("gqa", "mla-absorbed") for k in ("float32", "int8")
            for b in (1, 8) for c in (256, 512)]
    with tempfile.TemporaryDirectory() as tmp:
      labels = bm.plot_sweep(dict(size="small", contexts=[256, 512],
                                  batches=[1, 8], rows=rows,
                                  read_probe=dict(bytes_per_s=2e10)),
                             os.path.join(tmp, "s.png"))
    self.assertIn("medians of 3 timed repeats, bars: min-max",
                  labels["suptitle"])
    self.assertEqual(labels["legends"],
                     {"variant (colour)": ["gqa", "mla-absorbed"],
                      "cache (line)": ["float32", "int8"],
                      "time to read them at": [
                          "100% of the read probe (20.0 GB/s)",
                          "60% of the read probe (20.0 GB/s)"]})
    self.assertEqual(labels["ylabels"][0], "milliseconds per decode step")
    # Last panel: the cache-bytes law against the run's read probe.
    self.assertEqual(labels["titles"],
                     ["batch 1", "batch 8", "every batch and context"])

  def test_step_spread_is_per_step(self):
    self.assertEqual(bm.step_ms_spread(self._timed(2.0)), (2.0, 1.5, 3.0, 3))

  def test_positions_and_variants(self):
    with tempfile.TemporaryDirectory() as tmp:
      labels = bm.plot_positions(dict(
          preset="gqa-small", batch=1,
          rows=[dict(position=p, cached=self._timed(1.0),
                     no_cache=dict(step_s=0.01, timing=dict(
                         median_s=0.01, min_s=0.009, max_s=0.02, repeats=2)))
                for p in (128, 256)]), os.path.join(tmp, "p.png"))
      self.assertIn("medians of 3 (cached) / 2 (no cache) timed repeats",
                    labels["titles"][0])
      labels = bm.plot_variants(dict(
          size="small", batch=1, positions=[128, 256],
          variants={"gqa": dict(kv_bytes_per_token=4096,
                                steps=[self._timed(1.0)] * 2)}),
                                os.path.join(tmp, "v.png"))
      self.assertEqual(labels["legends"],
                       {"variant (KV bytes per token)":
                            ["gqa (4,096 B/token)"]})

  def test_ablation_says_seeds_and_steps(self):
    rows = [dict(variant=v, kv_bytes_per_token=b, bpb_per_seed=p,
                 bpb_mean=float(np.mean(p)), steps=[600])
            for v, b, p in (("mha", 32768, [2.0, 2.1, 2.05]),
                            ("mla", 4608, [2.1, 2.2, 2.15]))]
    with tempfile.TemporaryDirectory() as tmp:
      labels = ablation.plot(rows, os.path.join(tmp, "a.png"))
    self.assertIn("3 seeds per variant, 600 training steps each; black: "
                  "mean, bar: min-max over seeds", labels["titles"][0])
    self.assertEqual(labels["xlabels"][0],
                     "KV cache bytes per token (float32, all layers)")


# ---- the scripts, as a user runs them --------------------------------------------
def _run(script, *args, env=None, timeout=600, cwd=ROOT):
  full_env = dict(os.environ, JAX_PLATFORMS="cpu")
  full_env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
  full_env.update(env or {})
  return subprocess.run([sys.executable, str(EXPERIMENTS / script), *args],
                        cwd=cwd, env=full_env, capture_output=True, text=True,
                        timeout=timeout)


@pytest.mark.slow
class OneLineErrorsTest(absltest.TestCase):
  """Every refused flag or config value: one line on stderr, exit 2,
  nothing loaded (stdout stays empty: generate prints `model:` first)."""

  def _one_line(self, script, *args, env=None):
    proc = _run(script, *args, env=env)
    self.assertEqual(proc.returncode, 2, proc.stderr[-3000:])
    self.assertEqual(proc.stdout, "")
    lines = proc.stderr.splitlines()
    self.assertLen(lines, 1, proc.stderr[-3000:])
    self.assertTrue(lines[0].startswith("error: "), lines[0])
    return lines[0]

  def test_generate(self):
    cases = {
        ("--config.model.foo=3",):
            "error: unknown config field --config.model.foo; config.model "
            "has: attention,",
        ("--config=configs/model.py:gqa-tiny", "--config.model.num_layer=2"):
            "error: unknown config field --config.model.num_layer (did you "
            "mean num_layers?)",
        ("--config=configs/model.py:xqa-tiny",):
            "error: --config=configs/model.py:xqa-tiny: unknown variant 'xqa'",
        ("--config.generate.max_new_tokens=-5",):
            "error: --config: max_new_tokens must be an int >= 1, got -5",
        ("--config.model.num_layers=0",):
            "error: --config.model: ModelConfig.num_layers must be an int >= "
            "1, got 0",
        ("--config.model.num_layers=two",):
            "error: flag --config.model.num_layers=two: invalid literal",
        ("--config.cache.eviction=fifo",):
            "error: --config.cache: eviction='fifo' is not one of",
        ("--config.cache.capacity=8",):
            "error: --config: capacity=8 holds fewer than the 44-token prompt",
        ("--verify_steps=-1",): "error: flag --verify_steps=-1:",
        ("--mesh=2,x",): "error: flag --mesh=2,x: 'x' is not an integer",
        ("--checkpoint=/nonexistent",):
            "error: --checkpoint=/nonexistent: no such directory",
        ("--trained=checkpoints/austen-gqa", "--config.model.num_layers=2"):
            "error: --trained decides the model; --config.model.num_layers "
            "would be ignored",
        ("stray",): "error: unexpected arguments 'stray'",
        ("--no_such_flag",): "error: Unknown command line flag 'no_such_flag'",
    }
    for args, start in cases.items():
      with self.subTest(" ".join(args)):
        self.assertStartsWith(self._one_line("generate.py", *args), start)

  def test_other_scripts(self):
    cases = {
        ("benchmark.py", "--modes=quant,bogus"):
            "error: flag --modes=quant,bogus: 'bogus' is not one of memory,",
        ("benchmark.py", "--modes=ppl"): "error: --modes=ppl needs --trained",
        ("peer_benchmark.py", "--config=configs/model.py:mla-tiny"):
            "error: --config: the peer model is a Llama; attention='mla'",
        ("memory_growth.py", "--workdir=/tmp/x", "--policy=dense"):
            "error: --policy=dense: must be a bounded cache policy",
        ("train.py",): "error: --workdir is required (see --help)",
        ("train.py", "--workdir=/tmp/x", "--config.train.num_steps=0"):
            "error: --config.train: num_steps must be >= 1, got 0",
        ("ablate.py", "--seeds=0,-1"):
            "error: flag --seeds=0,-1: -1 is below the minimum 0",
        ("streaming_eval.py", "--workdir=/tmp/x", "--policies=sinks0"):
            "error: --policies: eviction='sinks' needs num_sinks >= 1",
        ("decode_layout.py", "--presets=gqa-huge"):
            "error: flag --presets=gqa-huge: 'gqa-huge' is not one of",
        ("error_check_cost.py", "--config.model.embed_dim=-1"):
            "error: --config.model: ModelConfig.embed_dim must be",
        ("cache_table.py", "--workdir=/tmp/x", "--tokens=0"):
            "error: flag --tokens=0: 0 is below the minimum 1",
    }
    for (script, *args), start in cases.items():
      with self.subTest(" ".join([script, *args])):
        self.assertStartsWith(self._one_line(script, *args), start)

  def test_missing_corpus_says_the_command(self):
    with tempfile.TemporaryDirectory() as tmp:
      env = {data.DATA_DIR_ENV: "", "XDG_CACHE_HOME": tmp}
      want = (f"error: the Jane Austen corpus is not installed in {tmp}/"
              "kvjax/janeaustenr; install it with: python -m kvjax.data "
              "--setup (")
      for script, *args in (
          ("streaming_eval.py", f"--workdir={tmp}/s"),
          ("train.py", f"--workdir={tmp}/t"),
          ("ablate.py", f"--workdir={tmp}/a"),
          ("benchmark.py", "--modes=ppl", "--trained=checkpoints/austen-gqa",
           f"--workdir={tmp}/b")):
        with self.subTest(script):
          self.assertStartsWith(self._one_line(script, *args, env=env), want)
      # A directory of the user's own: the command names it.
      line = self._one_line("streaming_eval.py", f"--workdir={tmp}/s",
                            f"--data_dir={tmp}/mine", env=env)
      self.assertIn(f"python -m kvjax.data --setup --data_dir={tmp}/mine (",
                    line)


@pytest.mark.slow
class CommandLineTest(absltest.TestCase):

  def test_show_config_prints_every_field_as_its_flag(self):
    proc = _run("generate.py", "--show_config", "--config.cache.eviction=sinks")
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    lines = proc.stdout.splitlines()
    self.assertEqual(lines[:3], [
        "# --config=configs/model.py:gqa-small",
        "# a preset: --config=configs/model.py:<preset> (one of "
        + ", ".join(model_presets.PRESETS) + ")",
        "# a field: --config=configs/model.py:gqa-small "
        "--config.cache.eviction=sinks"])
    config = model_presets.get_config("gqa-small")
    for field, value in config.model.items():
      self.assertIn(f"--config.model.{field}={value}", lines)
    self.assertIn("--config.cache.eviction=sinks", lines)
    self.assertIn("--config.cache.positions=cache", lines)
    self.assertIn("--verify_steps=16", lines)

  def test_help_shows_the_override_syntax(self):
    for script in ("generate.py", "benchmark.py", "train.py"):
      with self.subTest(script):
        proc = _run(script, "--helpshort")
        text = " ".join(proc.stdout.split())
        self.assertIn("override any field with --config.<section>.<field>="
                      "<value>, e.g. --config=configs/", text)
        self.assertIn("--[no]show_config", text)

  def test_logs_are_quiet_unless_asked_for(self):
    # A trained model loads through orbax (INFO chatter), then the request
    # is refused against its max_seq_len: the cheapest run that logs.
    args = ("--trained=checkpoints/austen-gqa",
            "--config.generate.max_new_tokens=9000")
    quiet = _run("generate.py", *args)
    self.assertEqual(quiet.returncode, 2, quiet.stderr[-3000:])
    self.assertEqual(quiet.stdout.splitlines()[0],
                     "model: trained:checkpoints/austen-gqa "
                     "(--trained)")
    self.assertEqual(quiet.stderr.splitlines(), [
        "error: --config: max_new_tokens=9000: the 44-token prompt + 9000 "
        "new tokens exceed the model's max_seq_len=8192"])
    loud = _run("generate.py", *args, "--verbosity=0")
    self.assertEqual(loud.returncode, 2)
    self.assertIn("checkpoint_manager.py", loud.stderr)
    self.assertEqual(loud.stderr.splitlines()[-1],
                     quiet.stderr.splitlines()[-1])

  def test_tables_go_to_stdout(self):
    with tempfile.TemporaryDirectory() as tmp:
      proc = _run("cache_table.py", f"--workdir={tmp}", "--tokens=16",
                  "--batches=1")
      self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
      with open(os.path.join(tmp, "cache_table.md")) as f:
        md = f.read()
    self.assertIn(md.strip(), proc.stdout)
    self.assertIn("| mla-tiny | mla |", proc.stdout)

  def test_partial_results_survive_a_stopped_run(self):
    with tempfile.TemporaryDirectory() as tmp:
      env = dict(os.environ, JAX_PLATFORMS="cpu",
                 PYTHONPATH=os.pathsep.join([str(ROOT)] + [
                     p for p in [os.environ.get("PYTHONPATH")] if p]))
      proc = subprocess.Popen(
          [sys.executable, str(EXPERIMENTS / "benchmark.py"),
           "--config=configs/model.py:gqa-tiny", "--modes=positions",
           "--positions=" + ",".join(str(8 * k) for k in range(1, 101)),
           "--no_cache=false", "--repeats=1", "--steps=1",
           f"--workdir={tmp}"],
          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          text=True,
          # A suite started in the background by a script (`cmd &`) inherits
          # SIGINT ignored, and Python keeps an ignored SIGINT ignored: the
          # run would finish instead of stopping. Ctrl-C's default here.
          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
      try:
        seen = [proc.stdout.readline() for _ in range(3)]
      finally:
        # Under load an interrupt has been seen to go unnoticed (the run
        # then finished with status 0): interrupt again, every 5 s, until
        # the run stops.
        for _ in range(24):
          proc.send_signal(signal.SIGINT)
          try:
            _, err = proc.communicate(timeout=5)
            break
          except subprocess.TimeoutExpired:
            continue
        else:
          proc.kill()
          _, err = proc.communicate()
      self.assertEqual(proc.returncode, 130, err[-3000:])
      self.assertEqual(err.splitlines()[-1], "interrupted; measured so far: "
                       f"{tmp}/positions.jsonl")
      self.assertStartsWith(seen[0], "preset gqa-tiny")
      self.assertStartsWith(seen[2], "[2/101] position    16: cached ")
      records = cli.read_json_lines(os.path.join(tmp, "positions.jsonl"))
      self.assertGreaterEqual(len(records), 2)
      self.assertEqual([r["position"] for r in records[:2]], [8, 16])
      self.assertGreater(records[0]["cached"]["step_s"], 0)
      self.assertFalse(os.path.exists(os.path.join(tmp, "positions.json")))

  def test_perplexity_curve_keeps_the_last_partial_bin(self):
    # experiments/ is not a package: the script is imported from PYTHONPATH.
    code = (
        "import sys, json, numpy as np; sys.argv = ['x']\n"
        "import streaming_eval as s\n"
        "nll = np.log(np.r_[np.full(4, 2.0), np.full(4, 8.0), [4.0, 4.0]])\n"
        "x, y = s.perplexity_curve(nll[None], 4)\n"
        "print(json.dumps([x.tolist(), y.tolist()]))\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(EXPERIMENTS)] + [
                   p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    x, y = json.loads(proc.stdout.splitlines()[-1])
    np.testing.assert_allclose(x, [2.5, 6.5, 9.5])  # the last bin: 9, 10
    np.testing.assert_allclose(y, [2.0, 8.0, 4.0])


if __name__ == "__main__":
  absltest.main()
