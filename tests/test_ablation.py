"""The ablation's bookkeeping: resume, summary, table, WORKSPACE update."""

import json
import pathlib

from absl.testing import absltest
import jax

from kvjax import ablation
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

  def test_update_workspace_replaces_only_the_section(self):
    path = pathlib.Path(self.create_tempdir().full_path) / "W.md"
    path.write_text("head\n<!-- ablation:begin -->\nold\n"
                    "<!-- ablation:end -->\ntail\n")
    ablation.update_workspace(path, "new table")
    text = path.read_text()
    self.assertIn("head\n<!-- ablation:begin -->\nnew table\n", text)
    self.assertNotIn("old", text)
    self.assertTrue(text.endswith("<!-- ablation:end -->\ntail\n"))
    path.write_text("no markers")
    with self.assertRaisesRegex(ValueError, "markers"):
      ablation.update_workspace(path, "x")


if __name__ == "__main__":
  absltest.main()
