"""kvjax.norm_matvec: the form of norm-fed one-row products is measured
once per process (or set by the environment, or forced in a block), the
measurement times both forms over weights that stream from memory, and a
bad setting is refused by name."""

import threading
from unittest import mock

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import model as model_presets
import kvjax
from kvjax.lab import benchmarking as bm
from kvjax import norm_matvec
from kvjax import params as params_lib


class NormMatvecTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    norm_matvec._measured.cache_clear()
    self.addCleanup(norm_matvec._measured.cache_clear)

  def test_measure_times_both_forms(self):
    per = np.prod(norm_matvec.PROBE_SHAPES["streaming"]) * 4
    t = norm_matvec.measure(2 * per + 1, repeats=1)
    self.assertEqual(t["nbytes"], 2 * per)  # whole weights only
    for form in norm_matvec.FORMS:
      self.assertGreater(t[form], 0.0)
      self.assertLess(t[form], 10.0)

  def test_measure_times_a_resident_chain(self):
    shape = norm_matvec.PROBE_SHAPES["resident"]
    t = norm_matvec.measure(regime="resident", repeats=1)
    self.assertEqual(t["nbytes"], norm_matvec.probe_bytes("resident"))
    self.assertEqual(t["nbytes"] % (shape[0] * shape[1] * 4), 0)
    for form in norm_matvec.FORMS:
      self.assertGreater(t[form], 0.0)
    with self.assertRaisesRegex(ValueError, "regime"):
      norm_matvec.measure(regime="warm")

  def test_measure_refuses_less_than_one_weight(self):
    with self.assertRaisesRegex(ValueError, "nbytes"):
      norm_matvec.measure(1024)
    with self.assertRaisesRegex(ValueError, "repeats"):
      norm_matvec.measure(1 << 26, repeats=0)

  def test_both_forms_compute_the_same_chain(self):
    ws = [jax.random.normal(jax.random.key(i), (64, 32)) for i in range(3)]
    scale = jax.random.normal(jax.random.key(7), (32,))
    x = jax.random.normal(jax.random.key(8), (1, 32))
    fused = jax.jit(lambda *a: norm_matvec._chain(*a, fused=True))
    separate = jax.jit(lambda *a: norm_matvec._chain(*a, fused=False))
    np.testing.assert_allclose(fused(ws, scale, x), separate(ws, scale, x),
                               rtol=1e-5, atol=1e-5)

  def test_probe_covers_twice_the_last_level_cache(self):
    with mock.patch.object(norm_matvec, "last_level_cache_bytes",
                           return_value=300 << 20):
      self.assertEqual(norm_matvec.probe_bytes(), 600 << 20)
    with mock.patch.object(norm_matvec, "last_level_cache_bytes",
                           return_value=4 << 20):  # at least 64 MiB
      self.assertEqual(norm_matvec.probe_bytes(), 64 << 20)
    with mock.patch.object(norm_matvec, "last_level_cache_bytes",
                           return_value=None):  # unknown: 2 x 256 MiB
      self.assertEqual(norm_matvec.probe_bytes(), 512 << 20)

  def test_resident_probe_fits_a_quarter_of_the_cache(self):
    for llc, want in ((300 << 20, 32 << 20), (32 << 20, 8 << 20),
                      (4 << 20, 4 << 20)):
      with mock.patch.object(norm_matvec, "last_level_cache_bytes",
                             return_value=llc):
        self.assertEqual(norm_matvec.probe_bytes("resident"), want)

  def test_regime_from_the_weights_a_step_streams(self):
    with mock.patch.object(norm_matvec, "last_level_cache_bytes",
                           return_value=32 << 20):
      self.assertEqual(norm_matvec.regime(16 << 20), "resident")
      self.assertEqual(norm_matvec.regime((16 << 20) + 1), "streaming")
      self.assertEqual(norm_matvec.regime(None), "streaming")
    self.assertEqual(norm_matvec.nbytes(
        {"a": jnp.zeros((3, 4)),
         "b": jax.ShapeDtypeStruct((10,), jnp.bfloat16)}), 68)

  def test_fused_only_where_measured_clearly_faster(self):
    cases = {(1.0, 1.5): "fused", (1.0, 1.01): "separate",
             (1.5, 1.0): "separate"}
    for (fused_s, separate_s), want in cases.items():
      norm_matvec._measured.cache_clear()
      with mock.patch.dict("os.environ", {norm_matvec.ENV: ""}), \
          mock.patch.object(norm_matvec, "measure", return_value=dict(
              fused=fused_s, separate=separate_s, nbytes=1.0)) as m:
        self.assertEqual(norm_matvec.form(), want)
        self.assertEqual(norm_matvec.form(), want)
        self.assertEqual(m.call_count, 1)  # once per process and regime
        self.assertEqual(m.call_args.kwargs["regime"], "streaming")

  def test_decide_is_the_rule_applied_to_a_measurement(self):
    self.assertEqual(norm_matvec.decide({"fused": 1.0, "separate": 1.05}),
                     "fused")
    self.assertEqual(norm_matvec.decide({"fused": 1.0, "separate": 1.02}),
                     "separate")

  def test_each_regime_measured_once_and_chosen_by_weights(self):
    def measure(regime):  # this host's way round: fused wins in the cache
      fast = "fused" if regime == "resident" else "separate"
      return {fast: 1.0, ({*norm_matvec.FORMS} - {fast}).pop(): 1.5,
              "nbytes": 1.0}
    small = {"w": jnp.zeros((8, 8))}
    large = {"w": jax.ShapeDtypeStruct((1 << 20, 1 << 10), jnp.float32)}
    with mock.patch.dict("os.environ", {norm_matvec.ENV: ""}), \
        mock.patch.object(norm_matvec, "last_level_cache_bytes",
                          return_value=32 << 20), \
        mock.patch.object(norm_matvec, "measure",
                          side_effect=measure) as m:
      with norm_matvec.weights(small):
        self.assertEqual(norm_matvec.form(), "fused")
        with norm_matvec.weights(large):  # the innermost block
          self.assertEqual(norm_matvec.form(), "separate")
        self.assertEqual(norm_matvec.form(), "fused")
      self.assertEqual(norm_matvec.form(), "separate")
      self.assertEqual(m.call_count, 2)

  def test_decode_loops_say_what_their_step_streams(self):
    # generate and decode_step trace their steps inside `weights(params)`:
    # a tiny model's norm-fed products are formed for resident weights.
    config = kvjax.ModelConfig.from_dict(model_presets.model_dict("gqa",
                                                                  "tiny"))
    params = kvjax.init_params(config, jax.random.key(0))
    pk = params_lib.pack(params, config)
    tokens = jnp.ones((1, 4), jnp.int32)
    asked = []
    def measured(regime):
      asked.append(regime)
      return True
    jax.clear_caches()
    self.addCleanup(jax.clear_caches)
    with mock.patch.dict("os.environ", {norm_matvec.ENV: ""}), \
        mock.patch.object(norm_matvec, "_measured", side_effect=measured):
      kvjax.generate(pk, config, tokens, max_new_tokens=3)
      self.assertIn("resident", asked)
      asked.clear()
      _, cache = kvjax.prefill(pk, config, tokens,
                               kvjax.init_cache(config, 1, 16))
      kvjax.decode_step(pk, config, tokens[:, 0], cache)
      self.assertEqual(set(asked), {"resident"})

  def test_measured_while_a_program_is_traced(self):
    # generate first asks while tracing its decode step: the probe must
    # still run eagerly, on concrete weights.
    per = np.prod(norm_matvec.PROBE_SHAPES["streaming"]) * 4
    with mock.patch.dict("os.environ", {norm_matvec.ENV: ""}), \
        mock.patch.object(norm_matvec, "probe_bytes", return_value=2 * per):
      out = jax.jit(lambda x: x + norm_matvec.fused())(jnp.zeros(()))
    self.assertIn(float(out), (0.0, 1.0))
    self.assertEqual(norm_matvec._measured.cache_info().currsize, 1)

  def test_environment_and_forced(self):
    with mock.patch.dict("os.environ", {norm_matvec.ENV: "separate"}):
      self.assertFalse(norm_matvec.fused())
      with norm_matvec.forced("fused"):
        self.assertTrue(norm_matvec.fused())
      self.assertFalse(norm_matvec.fused())
    with mock.patch.dict("os.environ", {norm_matvec.ENV: "loop"}):
      with self.assertRaisesRegex(ValueError, "KVJAX_NORM_MATVEC"):
        norm_matvec.form()
    with self.assertRaisesRegex(ValueError, "value"):
      with norm_matvec.forced("dot"):
        pass

  def test_blocks_belong_to_their_thread(self):
    seen = []
    with mock.patch.dict("os.environ", {norm_matvec.ENV: "separate"}):
      with norm_matvec.forced("fused"):
        t = threading.Thread(target=lambda: seen.append(norm_matvec.form()))
        t.start()
        t.join()
        self.assertEqual(norm_matvec.form(), "fused")
    self.assertEqual(seen, ["separate"])

  def test_last_level_cache_is_positive_or_unknown(self):
    llc = norm_matvec.last_level_cache_bytes()
    self.assertTrue(llc is None or llc > 0)


  def test_forms_benchmark_refuses_bad_counts_before_compute(self):
    config = kvjax.ModelConfig.from_dict(model_presets.model_dict("gqa",
                                                                  "tiny"))
    with mock.patch.object(bm, "run_probe") as probe:
      with self.assertRaisesRegex(ValueError, "rounds"):
        bm.norm_matvec_forms(config, 1, 8, rounds=0)
      with self.assertRaisesRegex(ValueError, "repeats"):
        bm.norm_matvec_forms(config, 1, 8, repeats=0)
      probe.assert_not_called()

  @pytest.mark.slow
  def test_forms_benchmark_runs_each_form_in_its_own_process(self):
    config = kvjax.ModelConfig.from_dict(model_presets.model_dict("gqa",
                                                                  "tiny"))
    r = bm.norm_matvec_forms(config, 1, 8, rounds=2, steps=2, repeats=1)
    for form in norm_matvec.FORMS:
      self.assertLen(r[form]["rounds"], 2)
      self.assertGreater(r[form]["step_s"], 0.0)
      self.assertGreater(r[form]["read_fraction"], 0.0)
      self.assertGreater(r[form]["probe_bytes_per_s"], 0.0)
    self.assertEqual(r["fused"]["bytes"], r["separate"]["bytes"])
    self.assertEqual(r["weight_bytes"], norm_matvec.nbytes(
        kvjax.init_params(config, jax.random.key(0))))
    self.assertGreater(r["separate_speedup"], 0.0)


if __name__ == "__main__":
  absltest.main()
