"""kvjax.lab.benchmarking: timers, probes, bytes/FLOPs models, peak RSS.

The models are checked against independent sources: the real nbytes of
caches and params, and the matrix leaves of the params pytree.
"""

import dataclasses
import functools
import time
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import native_attention
from kvjax.lab import benchmarking as bm
from kvjax import inference
from configs import model as model_presets
import cases  # pylint: disable=g-bad-import-order

VARIANTS = model_presets.VARIANTS


@functools.lru_cache(maxsize=None)
def tiny(variant: str) -> kvjax.ModelConfig:
  return kvjax.ModelConfig.from_dict(model_presets.model_dict(variant, "tiny"))


class TimingTest(parameterized.TestCase):

  def test_warmup_is_excluded_and_repeats_recorded(self):
    calls = []

    def fn():
      calls.append(1)
      time.sleep(0.002 if len(calls) > 2 else 0.05)
      return jnp.zeros(())

    t = bm.time_fn(fn, warmup=2, repeats=3)
    self.assertLen(calls, 5)
    self.assertLen(t.seconds, 3)
    # The two slow warm-up calls are not in the record.
    self.assertLess(t.max, 0.04)
    self.assertGreaterEqual(t.min, 0.002)
    self.assertLessEqual(t.min, t.median)
    self.assertLessEqual(t.median, t.max)

  def test_alternating_interleaves_and_rotates_calls(self):
    order = []
    fns = {name: (lambda n=name: order.append(n) or jnp.zeros(()))
           for name in ("a", "b", "c")}
    out = bm.time_alternating(fns, warmup=1, repeats=4)
    # Warm-up, then every round starts one later: no name always follows
    # the same other one.
    self.assertEqual("".join(order), "abc" + "abc" + "bca" + "cab" + "abc")
    self.assertEqual(sorted(out), ["a", "b", "c"])
    self.assertTrue(all(len(t.seconds) == 4 for t in out.values()))

  @cases.named((dict(warmup=-1, repeats=1), dict(warmup=0, repeats=0)))
  def test_bad_counts_raise(self, warmup, repeats):
    with self.assertRaisesRegex(ValueError, "warmup|repeats"):
      bm.time_fn(lambda: jnp.zeros(()), warmup=warmup, repeats=repeats)
    with self.assertRaisesRegex(ValueError, "warmup|repeats"):
      bm.time_alternating({"a": lambda: jnp.zeros(())}, warmup=warmup,
                          repeats=repeats)

  def test_round_rates_subtract_the_median_prefill(self):
    g = bm.Timing((2.0, 3.0, 2.5))
    p = bm.Timing((0.5, 1.0, 0.4))  # median 0.5
    self.assertSequenceAlmostEqual(bm.round_rates(g, p, 30),
                                   (30 / 1.5, 30 / 2.5, 30 / 2.0))

  def test_round_rates_bad_input_raises(self):
    g, p = bm.Timing((2.0, 3.0)), bm.Timing((0.5, 0.5))
    with self.assertRaisesRegex(ValueError, "tokens"):
      bm.round_rates(g, p, 0)
    with self.assertRaisesRegex(ValueError, "round 0: generate"):
      bm.round_rates(g, bm.Timing((2.0, 2.5, 3.0)), 10)
    with self.assertRaisesRegex(ValueError, "timed rounds"):
      bm.round_rates(bm.Timing(()), p, 10)

  def test_paired_ratios_and_spread(self):
    r = bm.paired_ratios((10.0, 30.0, 20.0, 40.0), (5.0, 10.0, 5.0, 10.0))
    self.assertSequenceAlmostEqual(r, (2.0, 3.0, 4.0, 4.0))
    sp = bm.spread(r)
    self.assertEqual(sp["min"], 2.0)
    self.assertEqual(sp["max"], 4.0)
    self.assertAlmostEqual(sp["median"], 3.5)
    self.assertAlmostEqual(sp["q1"], 2.75)  # linear interpolation
    self.assertAlmostEqual(sp["q3"], 4.0)
    for bad in [((1.0,), (1.0, 2.0)), ((), ()), ((1.0,), (0.0,))]:
      with self.assertRaisesRegex(ValueError, "paired_ratios"):
        bm.paired_ratios(*bad)
    with self.assertRaisesRegex(ValueError, "no values"):
      bm.spread(())

  def test_cache_read_rates_recover_the_line(self):
    # Steps made exactly as fixed + cache / rate: the rates and the fixed
    # parts come back, per (variant, kind, batch) group.
    def row(variant, kind, ctx, fixed, rate, probe):
      cache = 1000.0 * ctx
      return dict(variant=variant, kv_dtype=kind, batch=8, context=ctx,
                  bytes=dict(cache=cache, weights=5e4, total=cache + 5e4),
                  step_s=fixed + cache / rate, read_probe=probe)
    rows = [row("gqa", "float32", c, 2e-3, 16e9, p)
            for c, p in ((2048, 30e9), (8192, 20e9), (16384, 10e9))]
    rows += [row("mla", "int8", c, 1e-3, 5e9, 25e9) for c in (2048, 8192)]
    rows += [row("mqa", "int8", 4096, 1e-3, 5e9, 25e9)]  # one context
    out = bm.cache_read_rates(rows)
    self.assertEqual([r["context"] for r in out], [r["context"] for r in rows])
    self.assertNotIn("cache_read", out[0])
    self.assertNotIn("cache_read", rows[1])  # the input is not changed
    got = {(r["variant"], r["context"]): r["cache_read"] for r in out
           if "cache_read" in r}
    self.assertEqual(set(got), {("gqa", 8192), ("gqa", 16384),
                                ("mla", 8192)})
    self.assertAlmostEqual(got["gqa", 8192]["bytes_per_s"] / 16e9, 1.0)
    self.assertAlmostEqual(got["gqa", 8192]["of_read_probe"], 16 / 25)
    self.assertAlmostEqual(got["gqa", 16384]["of_read_probe"], 16 / 20)
    self.assertAlmostEqual(got["gqa", 16384]["fixed_s"], 2e-3)
    self.assertAlmostEqual(got["mla", 8192]["bytes_per_s"] / 5e9, 1.0)
    self.assertEqual(got["mla", 8192]["from_context"], 2048)
    # A longer context that took no longer has no rate, and says why; the
    # other points keep theirs.
    rows[1]["step_s"] = rows[0]["step_s"]
    out = bm.cache_read_rates(rows)
    self.assertNotIn("cache_read", out[1])
    self.assertRegex(out[1]["cache_read_error"], "context 8192.*not longer")
    self.assertAlmostEqual(out[2]["cache_read"]["of_read_probe"], 16 / 20)

  def test_cache_read_rates_place_the_attention_on_its_roofline(self):
    # 1 MB and 8 MFLOP more per 0.1 ms: 10 GB/s and 80 GFLOP/s, intensity
    # 8 FLOP/byte. Against probes of 20 GB/s and 100 GFLOP/s (ridge 5) the
    # FLOPs bind: the roof allows 0.08 ms, 80 % of the time taken.
    def row(ctx, step_s, flops):
      return dict(variant="mla", kv_dtype="float32", batch=8, context=ctx,
                  bytes=dict(cache=1e6 * ctx, weights=0.0,
                             total=1e6 * ctx), step_s=step_s,
                  read_probe=20e9, flop_probe=100e9,
                  attention_flops=flops * ctx)
    out = bm.cache_read_rates([row(1, 1e-3, 8e6), row(3, 1.2e-3, 8e6)])
    c = out[1]["cache_read"]
    self.assertAlmostEqual(c["bytes_per_s"] / 10e9, 1.0)
    self.assertAlmostEqual(c["flops_per_s"] / 80e9, 1.0)
    self.assertAlmostEqual(c["of_flop_probe"], 0.8)
    self.assertAlmostEqual(c["intensity"], 8.0)
    self.assertAlmostEqual(c["ridge"], 5.0)
    self.assertEqual(c["bound"], "flops")
    self.assertAlmostEqual(c["of_roofline"], 0.8)
    # A quarter of the FLOPs: intensity 2, below the ridge; the bytes bind
    # at their probe's share (10 of 20 GB/s).
    c = bm.cache_read_rates([row(1, 1e-3, 2e6),
                             row(3, 1.2e-3, 2e6)])[1]["cache_read"]
    self.assertEqual(c["bound"], "bytes")
    self.assertAlmostEqual(c["of_roofline"], 0.5)
    self.assertAlmostEqual(c["of_roofline"], c["of_read_probe"])
    # Rows without the FLOP fields get the read rate alone.
    bare = [{k: v for k, v in row(x, t, 8e6).items()
             if k not in ("flop_probe", "attention_flops")}
            for x, t in ((1, 1e-3), (3, 1.2e-3))]
    self.assertNotIn("bound", bm.cache_read_rates(bare)[1]["cache_read"])

  def test_roofline_names_the_binding_roof(self):
    # 1 GB and 10 GFLOP in 0.2 s against 10 GB/s and 100 GFLOP/s: the bytes
    # allow 0.1 s, the FLOPs 0.1 s; intensity 10 = the ridge: bytes-bound
    # (not above it), 50 % of the roof.
    r = bm.roofline(1e9, 1e10, 0.2, 10e9, 100e9)
    self.assertEqual((r["bound"], r["intensity"], r["ridge"]),
                     ("bytes", 10.0, 10.0))
    self.assertAlmostEqual(r["of_roofline"], 0.5)
    self.assertAlmostEqual(r["of_flop_probe"], 0.5)
    r = bm.roofline(1e9, 4e10, 0.5, 10e9, 100e9)  # FLOPs allow 0.4 s
    self.assertEqual(r["bound"], "flops")
    self.assertAlmostEqual(r["of_roofline"], 0.8)
    with self.assertRaisesRegex(ValueError, "seconds=0"):
      bm.roofline(1e9, 1e9, 0, 10e9, 100e9)

  def test_decode_flops_add_the_attention_to_the_weights(self):
    config = tiny("mla")
    one = bm.prefill_flops(config, 3, 1)
    got = bm.decode_flops_per_step(config, 3, 100)
    self.assertEqual(got["weights"], one["matmul"] + one["lm_head"])
    self.assertEqual(got["attention"],
                     2 * bm.attention_macs_per_token(config) * 3 * 100)
    self.assertEqual(got["total"], got["weights"] + got["attention"])
    with self.assertRaisesRegex(ValueError, "context must be >= 1"):
      bm.decode_flops_per_step(config, 1, 0)

  @parameterized.parameters("mha", "mqa", "gqa", "mla")
  def test_attention_macs_count_every_cached_entry_product(self, variant):
    # Against the products written out: a dot per query row with each
    # cached key, a weighted value per row; MLA's latent is both (absorbed)
    # or expanded per head first (naive).
    config = kvjax.ModelConfig.from_dict(
        model_presets.model_dict(variant, "small"))
    L, N = config.num_layers, config.num_heads
    if variant == "mla":
      C, R = config.kv_lora_rank, config.qk_rope_head_dim
      P, O = config.qk_nope_head_dim, config.v_head_dim
      self.assertEqual(bm.attention_macs_per_token(config),
                       L * N * (C + R) + L * N * C)
      naive = dataclasses.replace(config, mla_decode="naive")
      self.assertEqual(bm.attention_macs_per_token(naive),
                       L * (C * N * P + C * N * O) + L * N * (P + R + O))
    else:
      H = config.head_dim
      self.assertEqual(bm.attention_macs_per_token(config), L * N * (H + H))

  def test_compile_seconds(self):
    f = jax.jit(lambda x: jnp.sin(x) @ x)
    out = bm.compile_seconds(f, jnp.ones((8, 8)))
    self.assertGreater(out["compile_s"], 0)
    self.assertAlmostEqual(out["total_s"], out["lower_s"] + out["compile_s"])


class ProbeTest(parameterized.TestCase):

  def test_probes_report_positive_rates_for_their_sizes(self):
    r = bm.read_bandwidth(1 << 20, warmup=1, repeats=2)
    self.assertEqual(r["nbytes"], 1 << 20)
    t = bm.triad_bandwidth(1 << 20, warmup=1, repeats=2)
    self.assertEqual(t["nbytes"], 3 << 20)
    m = bm.matvec_bandwidth(64, 128, warmup=1, repeats=2)
    self.assertEqual(m["nbytes"], 64 * 128 * 4)
    p = bm.matmul_peak(32, warmup=1, repeats=2)
    self.assertEqual(p["flops"], 2 * 32 ** 3)
    for d, key in ((r, "bytes_per_s"), (t, "bytes_per_s"),
                   (m, "bytes_per_s"), (p, "flops_per_s")):
      self.assertTrue(np.isfinite(d[key]) and d[key] > 0, d)
      self.assertGreaterEqual(d["best_" + key], d[key])

  def test_bad_probe_sizes_raise(self):
    with self.assertRaisesRegex(ValueError, "nbytes"):
      bm.read_bandwidth(16)
    with self.assertRaisesRegex(ValueError, "n must"):
      bm.matmul_peak(0)


class ModelsTest(parameterized.TestCase):

  @cases.product(variant=VARIANTS, kv_dtype=bm.CACHE_KINDS,
                 slow=lambda variant, kv_dtype: (
                     variant not in cases.FAST_VARIANTS))
  def test_decode_bytes_match_real_arrays(self, variant, kv_dtype):
    config = tiny(variant)
    params = jax.eval_shape(lambda: kvjax.init_params(config,
                                                      jax.random.key(0)))
    B, ctx = 3, 64
    policy = bm.cache_policy(kv_dtype)
    cache = jax.eval_shape(
        lambda: kvjax.init_cache(config, B, ctx, policy=policy))
    leaves = ([cache.c_kv, cache.k_rope, cache.c_scale, cache.r_scale,
               cache.c_resid, cache.r_resid]
              if config.attention == "mla" else
              [cache.k, cache.v, cache.k_scale, cache.v_scale, cache.k_resid])
    cache_nbytes = sum(x.size * x.dtype.itemsize for x in leaves
                       if x is not None)
    out = bm.decode_bytes_per_step(params, config, B, ctx, kv_dtype)
    self.assertEqual(out["cache"], cache_nbytes)
    embed = params["embed"].size * 4
    self.assertEqual(out["weights"], bm.param_bytes(params) - embed)
    self.assertEqual(out["total"], out["weights"] + out["cache"])

  def test_tied_embeddings_read_the_whole_table(self):
    config = tiny("gqa").replace(tie_embeddings=True)
    params = jax.eval_shape(lambda: kvjax.init_params(config,
                                                      jax.random.key(0)))
    self.assertEqual(bm.decode_weight_bytes(params, config),
                     bm.param_bytes(params))

  @cases.variants()
  def test_prefill_matmul_flops_count_every_weight_matrix(self, variant):
    config = tiny(variant)
    params = jax.eval_shape(lambda: kvjax.init_params(config,
                                                      jax.random.key(0)))
    # Independent count: the layer leaves that are matrices (not norms or
    # biases), straight from the params pytree.
    flat = jax.tree_util.tree_flatten_with_path(params["layers"])[0]
    matrix_params = sum(
        x.size for path, x in flat
        if not jax.tree_util.keystr(path).rstrip("']").endswith(("norm",
                                                                 "bias")))
    B, T = 2, 5
    f = bm.prefill_flops(config, B, T)
    self.assertEqual(f["matmul"], 2 * B * T * matrix_params)
    self.assertEqual(f["lm_head"],
                     2 * B * config.embed_dim * config.vocab_size)
    f_all = bm.prefill_flops(config, B, T, all_logits=True)
    self.assertEqual(f_all["lm_head"], T * f["lm_head"])
    # Causal attention work: T(T+1)/2 (query, key) pairs per sequence.
    f1 = bm.prefill_flops(config, B, 1)
    self.assertEqual(f["attention"], f1["attention"] * T * (T + 1) / 2)
    self.assertEqual(f["total"],
                     f["matmul"] + f["attention"] + f["lm_head"])

  def test_largest_activation(self):
    config = tiny("gqa")
    B, T = 2, 16
    expect = max(B * T * config.mlp_dim * 4,
                 B * config.num_heads * T * T * 4, B * config.vocab_size * 4)
    self.assertEqual(bm.largest_activation_bytes(config, B, T), expect)

  def test_bad_sizes_raise(self):
    config = tiny("gqa")
    with self.assertRaisesRegex(ValueError, "batch and length"):
      bm.prefill_flops(config, 0, 4)
    with self.assertRaisesRegex(ValueError, "batch and context"):
      bm.decode_bytes_per_step({"embed": jnp.zeros((2, 2))}, config, 1, 0)


class FilledCacheTest(parameterized.TestCase):

  @cases.product(variant=("gqa", "mla"), kv_dtype=("float32", "int8"),
                 slow=lambda variant, kv_dtype: (variant, kv_dtype) not in (
                     ("gqa", "float32"), ("mla", "int8")))
  def test_filled_cache_holds_length_tokens(self, variant, kv_dtype):
    config = tiny(variant)
    policy = kvjax.CachePolicy(kv_dtype=kv_dtype)
    cache = bm.filled_cache(config, 2, 12, 5, policy)
    ref = kvjax.init_cache(config, 2, 12, policy=policy)
    chex.assert_trees_all_equal_shapes_and_dtypes(cache, ref)
    np.testing.assert_array_equal(cache.length, [5, 5])
    np.testing.assert_array_equal(cache.positions[1],
                                  list(range(5)) + [-1] * 7)
    payload = cache.c_kv if config.attention == "mla" else cache.k
    self.assertGreater(float(jnp.max(jnp.abs(payload.astype(jnp.float32)))),
                       0)
    if kv_dtype == "int8":
      scale = cache.c_scale if config.attention == "mla" else cache.k_scale
      self.assertTrue(bool(jnp.all(scale > 0)))

  def test_filled_cache_bad_length(self):
    with self.assertRaisesRegex(ValueError, "length"):
      bm.filled_cache(tiny("gqa"), 1, 8, 9)


class SegmentCopyTest(parameterized.TestCase):

  @cases.product(variant=("gqa", "mla"), layout=("layered", "native"))
  def test_copies_timed_and_what_the_view_makes(self, variant, layout):
    out = bm.segment_copy_seconds(tiny(variant), 2, 200, steps=4,
                                  layout=layout, repeats=2)
    self.assertEqual(out["attend"], 256)  # 200 + 4 rounded up to 128s
    for key in ("copy_in", "whole_back", "window_back"):
      self.assertLen(out[key].seconds, 2)
    # MLA's native view reads the stacked cache in place; the GQA family's
    # copies its keys into tiles (values in place); the layered views copy
    # keys and values.
    self.assertEqual(out["in_place"], variant == "mla" and layout == "native")
    share = out["view_bytes"] / out["cache_bytes"]
    if out["in_place"]:
      self.assertLess(share, 0.01)
    elif variant == "gqa" and layout == "native":
      self.assertBetween(share, 0.4, 0.6)
    else:
      self.assertGreater(share, 0.9)

  def test_a_layout_without_a_view_is_refused(self):
    with self.assertRaisesRegex(ValueError, "blocked for mla.*no segment view"):
      bm.segment_copy_seconds(tiny("mla"), 1, 100, layout="blocked")


class DecodeStepsTest(parameterized.TestCase):

  # The kernel's view as on an AVX-512 host, whatever this one is.
  @mock.patch.object(native_attention, "preferred", return_value=True)
  def test_alternating_kinds_report_their_layout_and_speed_up(self, _):
    config = tiny("gqa")
    # Packed, as generate lays out wider models itself (`packed.for_decode`).
    params = kvjax.pack(kvjax.init_params(config, jax.random.key(0)), config)
    out = bm.decode_steps_alternating(params, config, 2, 20,
                                      ("float32", "int8", "int4"), steps=2,
                                      warmup=1, repeats=2, probe_bytes=1 << 20)
    probe = out.pop("read_probe")
    self.assertEqual(probe["nbytes"], 1 << 20)
    self.assertGreater(probe["bytes_per_s"], 0)
    self.assertEqual(list(out), ["float32", "int8", "int4"])
    # The layouts generate would read: the native kernel's view for every
    # kind it reads (`decode.plan`).
    self.assertEqual([out[k]["layout"] for k in out],
                     ["native", "native", "native"])
    self.assertEqual(out["float32"]["rounds"], (1.0, 1.0))
    for k, t in out.items():
      self.assertLen(t["rounds"], 2)
      self.assertAlmostEqual(t["step_s"], t["loop"]["median_s"] / 2)
      self.assertGreater(t["vs_first"], 0)
      self.assertGreaterEqual(t["capacity"], 20 + 2 * 3)
    with self.assertRaisesRegex(ValueError, "kv_dtypes is empty"):
      bm.decode_steps_alternating(params, config, 1, 4, ())

  def test_steady_steps_are_the_difference_of_two_loop_lengths(self):
    # Loops timed as a segment copy plus their steps (float32: 50 ms + 10
    # ms a step; int8: 30 ms + 4 ms a step): the steady step, the copy and
    # the speed-up come back, not the loop / steps.
    cost = {"float32": (0.05, 0.01), "int8": (0.03, 0.004)}

    def fake(fns, warmup, repeats):
      out = {}
      for name in fns:
        long = name.startswith(bm._LONG)  # pylint: disable=protected-access
        copy, step = cost[name[len(bm._LONG):] if long else name]  # pylint: disable=protected-access
        n = 4 if long else 2
        out[name] = bm.Timing((copy + n * step,) * repeats)
      return out

    config = tiny("gqa")
    params = kvjax.init_params(config, jax.random.key(0))
    with mock.patch.object(bm, "time_alternating", side_effect=fake):
      out = bm.decode_steps_alternating(params, config, 1, 8,
                                        ("float32", "int8"), steps=2,
                                        warmup=0, repeats=2, steady=True)
    self.assertEqual(list(out), ["float32", "int8"])
    for kind, (copy, step) in cost.items():
      self.assertAlmostEqual(out[kind]["step_s"], step)
      self.assertAlmostEqual(out[kind]["segment_s"], copy)
      self.assertAlmostEqual(out[kind]["loop_step_s"], copy / 2 + step)
      self.assertEqual(out[kind]["long_loop"]["repeats"], 2)
    self.assertAlmostEqual(out["int8"]["vs_first"], 2.5)
    # One cache per kind, with room for both loops' calls (2 + 4 steps in
    # each of 2 rounds from position 8).
    self.assertGreaterEqual(out["int8"]["capacity"], 8 + 2 * (2 + 4))
    self.assertEqual(out["int8"]["rounds"], (0.09 / 0.046,) * 2)
    self.assertTrue(out["int8"]["steady"])
    # A longer loop that took no longer (the noise above a step): the loop's
    # time per step, marked, and no segment figure.
    cost["int8"] = (0.03, 0.0)
    with mock.patch.object(bm, "time_alternating", side_effect=fake):
      out = bm.decode_steps_alternating(params, config, 1, 8,
                                        ("float32", "int8"), steps=2,
                                        warmup=0, repeats=2, steady=True)
    self.assertFalse(out["int8"]["steady"])
    self.assertAlmostEqual(out["int8"]["step_s"], 0.015)
    self.assertTrue(np.isnan(out["int8"]["segment_s"]))
    self.assertTrue(out["float32"]["steady"])

  @parameterized.parameters("gqa", "mla")
  def test_fixed_part_times_every_packed_product_of_the_step(self, variant):
    config = tiny(variant)
    canonical = kvjax.init_params(config, jax.random.key(0))
    params = kvjax.pack(canonical, config)
    out = bm.fixed_part(params, config, 2, position=4, steps=2, reps=2,
                        repeats=2, probe_bytes=1 << 20)
    layer = params["layers"][0]
    expected = {n: w for g in ("attn", "mlp") for n, w in layer[g].items()
                if n.endswith("_t")}
    expected["lm_head_t"] = params["lm_head_t"]
    self.assertEqual([p["name"] for p in out["products"]], list(expected))
    for p in out["products"]:
      w = expected[p["name"]]
      self.assertEqual(p["shape"], w.shape)
      self.assertEqual(p["bytes"], w.nbytes)
      self.assertEqual(p["count"], 1 if p["name"] == "lm_head_t"
                       else config.num_layers)
      self.assertGreater(p["s"], 0)
      self.assertAlmostEqual(p["bytes_per_s"], p["bytes"] / p["s"])
      self.assertAlmostEqual(p["macs_per_s"],
                             2 * int(np.prod(w.shape)) / p["s"])
    # The products are the weights the step reads, less norms and the
    # embedding (gathered, not read whole).
    product_bytes = sum(p["bytes"] * p["count"] for p in out["products"])
    norms = bm.decode_weight_bytes(params, config) - product_bytes
    self.assertEqual(out["weight_bytes"], product_bytes + norms)
    self.assertGreaterEqual(norms, 0)
    self.assertLess(norms, 0.01 * product_bytes)
    self.assertAlmostEqual(out["products_s"], sum(
        p["s"] * p["count"] for p in out["products"]))
    self.assertAlmostEqual(out["rest_s"], out["step_s"] - out["products_s"])
    self.assertEqual(out["capacity"], 4 + 2 * 3)  # what the loops write
    self.assertEqual(out["cache_bytes"], bm.decode_bytes_per_step(
        params, config, 2, out["capacity"])["cache"])
    self.assertAlmostEqual(out["weights_at_probe_s"], out["weight_bytes"] /
                           out["read_probe"]["bytes_per_s"])

  def test_fixed_part_refuses_what_generate_does_not_decode_packed(self):
    config = tiny("gqa")  # D 64: generate keeps the canonical layout
    params = kvjax.init_params(config, jax.random.key(0))
    with self.assertRaisesRegex(ValueError, "PACK_MIN_WIDTH"):
      bm.fixed_part(params, config, 2)
    with self.assertRaisesRegex(ValueError, "batch, steps and reps"):
      bm.fixed_part(params, config, 0)

  def test_layouts_are_timed_as_asked_and_refused_where_they_cannot_run(self):
    config = tiny("gqa")
    params = kvjax.pack(kvjax.init_params(config, jax.random.key(0)), config)
    out = bm.decode_layouts_alternating(
        params, config, 2, 20, [("float32", "stacked"), ("float32", "layered"),
                                ("int8", "layered")], steps=2, repeats=2)
    self.assertEqual(list(out), ["float32:stacked", "float32:layered",
                                 "int8:layered"])
    self.assertEqual(out["float32:stacked"]["rounds"], (1.0, 1.0))
    for bad, match in ((("int8", "blocked"), "kv_dtype='int8'"),
                       (("float32", "auto"), "layout='auto'"),
                       (("int8-kivi", "layered"), "key_quant='channel'")):
      with self.assertRaisesRegex(ValueError, match):
        bm.decode_layouts_alternating(params, config, 2, 20, [bad], steps=2,
                                      repeats=1)


  def test_models_are_timed_side_by_side_with_their_bytes(self):
    models = {}
    for v in ("gqa", "mla"):
      config = tiny(v)
      models[v] = (kvjax.init_params(config, jax.random.key(0)), config)
    out = bm.decode_models_alternating(models, 2, 20, steps=2, repeats=2,
                                       probe_bytes=1 << 20)
    probe = out.pop("read_probe")
    self.assertEqual(list(out), ["gqa", "mla"])
    self.assertEqual(out["gqa"]["rounds"], (1.0, 1.0))
    for v, t in out.items():
      params, config = models[v]
      want = bm.decode_bytes_per_step(params, config, 2, 21)["total"]
      self.assertEqual(t["bytes"], want)
      self.assertAlmostEqual(t["read_fraction"],
                             want / t["step_s"] / probe["bytes_per_s"])
    # The two variants read different caches: MLA's latent, GQA's K/V.
    self.assertNotEqual(out["gqa"]["bytes"], out["mla"]["bytes"])
    with self.assertRaisesRegex(ValueError, "models is empty"):
      bm.decode_models_alternating({}, 1, 4)


# The first variant of each attention kind: one KVCache, one LatentCache.
KINDS = tuple({model_presets.model_dict(v, "tiny")["attention"]: v
               for v in reversed(VARIANTS)}.values())


class LayerLayoutTest(chex.TestCase):
  """One canonical layout (stacked layers) and one decode layout (`pack`):
  per-layer tuples of canonical weights are refused, by name."""

  def test_hand_unrolled_params_are_refused(self):
    config = tiny("gqa")
    params = kvjax.init_params(config, jax.random.key(0))
    unrolled = dict(params, layers=tuple(
        jax.tree_util.tree_map(lambda w, i=i: w[i], params["layers"])
        for i in range(config.num_layers)))
    with self.assertRaisesRegex(ValueError, "kvjax.pack"):
      kvjax.forward(unrolled, config, jnp.zeros((1, 4), jnp.int32))


class PeakRSSTest(absltest.TestCase):

  def test_region_peak_sees_a_temporary_allocation(self):
    n = 64 << 20
    with bm.PeakRSS() as m:
      x = np.ones(n // 8)  # touched pages: resident
      del x
    self.assertTrue(m.reset_ok)
    self.assertGreaterEqual(m.delta, 0.9 * n)
    self.assertGreaterEqual(m.peak, m.before)
    self.assertLess(m.after, m.peak)

  def test_executables_rss_drops_every_compiled_program(self):
    f = jax.jit(lambda x: jnp.sin(x) * 2 + 1)
    jax.block_until_ready(f(jnp.ones(16)))
    self.assertEqual(f._cache_size(), 1)
    held = bm.executables_rss_bytes()
    self.assertIsInstance(held, int)
    self.assertGreaterEqual(held, 0)
    self.assertEqual(f._cache_size(), 0)  # measured by dropping them



class CompiledMemoryTest(absltest.TestCase):

  def test_generate_program_holds_params_and_cache(self):
    config = tiny("gqa")
    params = kvjax.init_params(config, jax.random.key(0))
    tokens = jnp.zeros((2, 8), jnp.int32)
    got = bm.compiled_memory(inference.lower_generate(
        params, config, tokens, 5, capacity=32))
    p_bytes = bm.param_bytes(params)
    cache = kvjax.init_cache(config, 2, 32)
    kv_bytes = cache.k.nbytes + cache.v.nbytes
    # Arguments: params and cache (prompt, mask, key: bytes; the fresh
    # cache's positions are overwritten, so XLA may drop them); the donated
    # K/V payload and the error bits are written in place (aliased to the
    # returned cache).
    self.assertGreaterEqual(got["arguments"], p_bytes + kv_bytes)
    self.assertLess(got["arguments"],
                    p_bytes + bm.tree_bytes(cache) + 4096)
    self.assertEqual(got["aliased"], kv_bytes + cache.errors.nbytes)
    self.assertGreaterEqual(got["peak"], got["arguments"])

  def test_lower_generate_refuses_unknown_arguments(self):
    config = tiny("gqa")
    params = kvjax.init_params(config, jax.random.key(0))
    with self.assertRaisesRegex(ValueError, "unknown arguments"):
      inference.lower_generate(params, config,
                                     jnp.zeros((1, 4), jnp.int32), 2,
                                     capcity=16)


if __name__ == "__main__":
  absltest.main()
