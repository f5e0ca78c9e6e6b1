"""The main job: the shipped model loads and its cached decode is exact."""

import os

from absl.testing import absltest
import numpy as np
import pytest

import kvjax
from kvjax import data
from kvjax.lab import job
from kvjax.config import ModelConfig


class JobTest(absltest.TestCase):

  @pytest.mark.slow  # the shipped model (D 256): two compiles of its size
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

  @pytest.mark.slow  # the shipped model again, packed
  def test_params_run_as_loaded_in_their_decode_layout(self):
    # The shipped model (D 256) decodes packed without being asked; a
    # narrower model keeps the layer scan (`packed.PACK_MIN_WIDTH`).
    shipped = job.load_model(trained=job.SHIPPED_MODEL)
    tokens = job.prompt_tokens(shipped, text="It is", batch=1, prompt_len=0,
                               seed=0)
    # (Cached == no-cache on the shipped model: the first test.)
    r = job.run(shipped, tokens, max_new_tokens=2, policy=kvjax.CachePolicy(),
                repeats=1, sampler=kvjax.GREEDY)
    self.assertEqual(r["layout"], "packed")
    self.assertIn("packed params", job.format_report(r))
    narrow = job.load_model(config=ModelConfig(
        vocab_size=64, num_layers=2, embed_dim=32, num_heads=4,
        num_kv_heads=2, mlp_dim=64), seed=0)
    tokens = job.prompt_tokens(narrow, text="", batch=1, prompt_len=6, seed=0)
    r = job.run(narrow, tokens, max_new_tokens=3, policy=kvjax.CachePolicy(),
                repeats=1)
    self.assertEqual(r["layout"], "scan")

  def test_load_model_needs_a_source(self):
    with self.assertRaisesRegex(ValueError, "checkpoint"):
      job.load_model()


if __name__ == "__main__":
  absltest.main()
