"""The one decode loop (`kvjax.decode`): generate, the decode benchmarks and
the streaming evaluation all run `decode.run`, with the layout generate
chooses; its while_loop form (stop tokens) equals its scan form."""

from __future__ import annotations

import dataclasses
from unittest import mock

import jax
import numpy as np
from absl.testing import absltest, parameterized

import kvjax
from kvjax.lab import benchmarking
from kvjax import decode
from kvjax.lab import streaming
from kvjax.tolerance import assert_close
from tests.tiny_models import tiny, tiny_params


def _fresh(variant: str, tag: float):
  """A tiny config no other test traced (its own jit cache entries)."""
  return dataclasses.replace(tiny(variant), rope_theta=10000.0 + tag)


class OneLoopTest(parameterized.TestCase):

  def test_every_multi_step_caller_runs_decode_run(self):
    config, params = _fresh("gqa", 1.0), tiny_params("gqa")
    B = decode.LAYERED_MIN_BATCH
    plans = {}
    real = decode.run

    def spy(who):
      def run(*args, **kwargs):
        plans.setdefault(who, kwargs.get("plan", decode.Plan()))
        return real(*args, **kwargs)
      return run

    prompt = jax.random.randint(jax.random.key(0), (B, 8), 0,
                                config.vocab_size)
    with mock.patch.object(decode, "run", spy("generate")):
      kvjax.generate(params, config, prompt, max_new_tokens=5)
    with mock.patch.object(decode, "run", spy("benchmark")):
      benchmarking.decode_step_seconds(params, config, B, 8, steps=2,
                                       warmup=1, repeats=1)
    with mock.patch.object(decode, "run", spy("streaming")):
      streaming.decode_tokens(params, config, prompt,
                              kvjax.init_cache(config, B, 16))
    self.assertEqual(set(plans), {"generate", "benchmark", "streaming"})
    # The benchmark reads the cache layout generate's last segment reads.
    self.assertEqual(plans["benchmark"].layout, plans["generate"].layout)

  @parameterized.named_parameters(("gqa", "gqa"), ("mla", "mla"))
  def test_while_loop_equals_scan(self, variant):
    """Stop tokens run the while_loop; until the first stop it produces the
    scan's tokens and logits, then pad_id."""
    config, params = tiny(variant), tiny_params(variant)
    prompt = jax.random.randint(jax.random.key(1), (3, 8), 0,
                                config.vocab_size)
    toks, logits, _ = kvjax.generate(params, config, prompt,
                                     max_new_tokens=8, return_logits=True)
    toks = np.asarray(toks)
    stop = int(toks[1, 3])  # row 1 stops at step 3 (or earlier)
    pad = (stop + 1) % config.vocab_size
    got, got_logits, _ = kvjax.generate(
        params, config, prompt, max_new_tokens=8, return_logits=True,
        stop_tokens=(stop,), pad_id=pad)
    got = np.asarray(got)
    for b in range(3):
      hits = np.flatnonzero(toks[b] == stop)
      end = hits[0] + 1 if hits.size else 8
      np.testing.assert_array_equal(got[b, :end], toks[b, :end])
      np.testing.assert_array_equal(got[b, end:], pad)
      assert_close(np.asarray(got_logits)[b, :end],
                   np.asarray(logits)[b, :end], config)


if __name__ == "__main__":
  absltest.main()
