"""The main job: the shipped model loads and its cached decode is exact."""

import os

from absl.testing import absltest
import numpy as np

import kvjax
from kvjax import data
from kvjax import job
from kvjax.config import ModelConfig


class JobTest(absltest.TestCase):

  def test_shipped_model_loads_and_cached_equals_no_cache(self):
    self.assertTrue(os.path.isdir(job.SHIPPED_MODEL), job.SHIPPED_MODEL)
    loaded = job.load_model(trained=job.SHIPPED_MODEL)
    self.assertEqual(loaded.config.vocab_size, data.VOCAB_SIZE)
    self.assertTrue(loaded.byte_level)
    tokens = job.prompt_tokens(loaded, text="It is a truth", batch=1,
                               prompt_len=0, seed=0)
    np.testing.assert_array_equal(tokens[0], data.encode("It is a truth"))
    cached = kvjax.generate(loaded.params, loaded.config, tokens, 8)
    ref = kvjax.generate_no_cache(loaded.params, loaded.config, tokens, 8)
    np.testing.assert_array_equal(cached, ref)

  def test_run_reports_timings_bytes_and_verification(self):
    config = ModelConfig(vocab_size=64, num_layers=2, embed_dim=32,
                         num_heads=4, num_kv_heads=2, mlp_dim=64)
    loaded = job.load_model(config=config, seed=0)
    tokens = job.prompt_tokens(loaded, text="", batch=2, prompt_len=6,
                               seed=0)
    r = job.run(loaded, tokens, max_new_tokens=5,
                policy=kvjax.CachePolicy(), verify_steps=5, repeats=1)
    self.assertTrue(r["verify_equal"])
    self.assertEqual(np.asarray(r["ids"]).shape, (2, 5))
    self.assertEqual(r["kv_bytes_per_token"], kvjax.kv_bytes_per_token(config))
    self.assertEqual(r["cache_kv_bytes"],
                     r["kv_bytes_per_token"] * 2 * r["capacity"])
    self.assertGreater(r["decode_tokens_per_s"], 0)
    self.assertIn("EQUAL", job.format_report(r))

  def test_layouts_generate_the_same_tokens(self):
    config = ModelConfig(vocab_size=64, num_layers=2, embed_dim=32,
                         num_heads=4, num_kv_heads=2, mlp_dim=64,
                         init_scale=0.15)
    loaded = job.load_model(config=config, seed=0)
    tokens = job.prompt_tokens(loaded, text="", batch=2, prompt_len=6,
                               seed=0)
    reports = {layout: job.run(loaded, tokens, max_new_tokens=6,
                               policy=kvjax.CachePolicy(), repeats=1,
                               sampler=kvjax.GREEDY, layout=layout)
               for layout in ("scan", "packed")}
    self.assertEqual(reports["packed"]["ids"], reports["scan"]["ids"])
    self.assertIn("packed params", job.format_report(reports["packed"]))
    with self.assertRaisesRegex(ValueError, "layout='stacked'"):
      job.run(loaded, tokens, max_new_tokens=2, policy=kvjax.CachePolicy(),
              layout="stacked")

  def test_load_model_needs_a_source(self):
    with self.assertRaisesRegex(ValueError, "checkpoint"):
      job.load_model()


if __name__ == "__main__":
  absltest.main()
