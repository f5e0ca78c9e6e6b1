"""The ablation's bookkeeping: resume, summary, table, outputs in the workdir."""

import json
import pathlib

from absl.testing import absltest

from kvjax.lab import ablation
from kvjax import cache as cache_lib
from kvjax import train
from kvjax.config import ModelConfig
from configs import train as train_presets


def _configs():
  return {v: ModelConfig.from_dict(train_presets.model_dict(v))
          for v in ("gqa", "mla")}


class AblationTest(absltest.TestCase):

  def test_train_all_resumes_and_summarizes(self):
    workdir = pathlib.Path(self.create_tempdir().full_path)
    calls = []

    def fake_run(mc, tc, wd):
      calls.append((mc.variant, tc.seed))
      final = dict(bits_per_byte=2.0 + tc.seed + (mc.variant == "mla"),
                   loss=1.0, wall_s=1.0)
      pathlib.Path(wd).mkdir(parents=True)
      (pathlib.Path(wd) / "final.json").write_text(json.dumps(final))
      return final

    tc = train.TrainConfig(num_steps=10, warmup_steps=1)
    runs = ablation.train_all(_configs(), tc, [0, 1], workdir, fake_run)
    self.assertEqual(calls, [("gqa", 0), ("mla", 0), ("gqa", 1), ("mla", 1)])
    # A second call finds every final.json and trains nothing.
    again = ablation.train_all(_configs(), tc, [0, 1], workdir, fake_run)
    self.assertLen(calls, 4)
    self.assertEqual(runs, again)
    rows = ablation.summarize(runs, _configs(), {"gqa": 10.0, "mla": 5.0})
    by = {r["variant"]: r for r in rows}
    self.assertEqual(by["gqa"]["bpb_per_seed"], [2.0, 3.0])
    self.assertAlmostEqual(by["mla"]["bpb_mean"], 3.5)
    self.assertAlmostEqual(by["mla"]["bpb_spread"], 1.0)
    self.assertEqual(by["mla"]["kv_bytes_per_token"],
                     cache_lib.kv_bytes_per_token(_configs()["mla"]))
    table = ablation.markdown(rows)
    self.assertIn("| mla |", table)
    self.assertIn("2.0000, 3.0000", table)
    ablation.plot(rows, workdir / "a.png")
    self.assertGreater((workdir / "a.png").stat().st_size, 1000)

  def test_validation_curves_are_read_and_drawn(self):
    workdir = pathlib.Path(self.create_tempdir().full_path)
    runs = []
    for v in ("gqa", "mla"):
      for seed in (0, 1):
        wd = workdir / f"{v}-s{seed}"
        wd.mkdir()
        recs = [dict(step=10, split="train", bits_per_byte=9.0)] + [
            dict(step=t, split="validation",
                 bits_per_byte=4.0 - t / 100 + seed / 10) for t in (100, 200)]
        (wd / "metrics.jsonl").write_text(
            "\n".join(json.dumps(r) for r in recs) + "\n")
        runs.append(ablation.Run(v, seed, str(wd), 2.0 + seed, 1.0, 1.0))
    rows = ablation.summarize(runs, _configs(), {"gqa": 10.0, "mla": 5.0})
    # Validation records only, per run in seed order.
    self.assertEqual(rows[0]["curves"], [[[100, 3.0], [200, 2.0]],
                                         [[100, 3.1], [200, 2.1]]])
    self.assertEqual(ablation.validation_curve(workdir / "none"), [])
    labels = ablation.plot(rows, workdir / "c.png")
    self.assertIn("training step", labels["xlabels"])
    self.assertIn("gqa (2 seeds)", labels["legends"][""])

  def test_long_context_decode_joins_the_rows_and_the_table(self):
    runs = [ablation.Run(v, 0, f"/x/{v}", 2.0, 1.0, 1.0)
            for v in ("gqa", "mla")]
    long = dict(batch=8, context=4096, read_probe=2e10, variants=dict(
        gqa=dict(step_s=0.010, read_fraction=0.5),
        mla=dict(step_s=0.020, read_fraction=0.25)))
    rows = ablation.summarize(runs, _configs(), {"gqa": 10.0, "mla": 5.0},
                              long)
    by = {r["variant"]: r for r in rows}
    self.assertAlmostEqual(by["gqa"]["long_step_ms"], 10.0)
    self.assertAlmostEqual(by["mla"]["long_tokens_per_s"], 400.0)
    table = ablation.markdown(rows)
    self.assertIn("decode ms/step (batch 8, 4,096 cached)", table)
    self.assertIn("| 10.0 | 800 | 50 % |", table)
    self.assertIn("| 20.0 | 400 | 25 % |", table)
    # Without the long timing the table keeps its seven columns.
    plain = ablation.markdown(ablation.summarize(
        runs, _configs(), {"gqa": 10.0, "mla": 5.0}))
    self.assertNotIn("cached", plain)

  def test_outputs_go_to_the_workdir_only(self):
    workdir = pathlib.Path(self.create_tempdir().full_path) / "ablate"
    runs = [ablation.Run(v, s, str(workdir / f"{v}-s{s}"), 2.0 + s, 1.0, 1.0)
            for v in ("gqa", "mla") for s in (0, 1)]
    rows = ablation.summarize(runs, _configs(), {"gqa": 10.0, "mla": 5.0})
    path = ablation.write_outputs(rows, runs, workdir, wall_s=3.0)
    self.assertEqual(path, workdir / "ablation.md")
    self.assertEqual(path.read_text(), ablation.markdown(rows) + "\n")
    self.assertEqual(
        sorted(p.name for p in workdir.iterdir()),
        ["ablation.json", "ablation.md", "ablation.png"])
    saved = json.loads((workdir / "ablation.json").read_text())
    self.assertEqual([r["variant"] for r in saved["rows"]], ["gqa", "mla"])
    self.assertLen(saved["runs"], 4)
    self.assertFalse(hasattr(ablation, "update_workspace"))


if __name__ == "__main__":
  absltest.main()
