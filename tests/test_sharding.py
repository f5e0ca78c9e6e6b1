"""Sharding over a device mesh.

The 8-device checks (slow tier) run in one subprocess
(`tests/sharded_check.py`: the device count is fixed when JAX starts; this
process has 1 device); the fast tier runs the same check on 2 devices
(meshes (2, 1) and (1, 2), GQA and MLA) in a subprocess of its own. For mesh
shapes (8,1), (1,8), (2,4), (4,2) and every variant: sharded generation
equals single-device generation token for token and logits within 1e-5; the
cache leaves are sharded as the table says (per-device shard shapes and
`.sharding`); the public decode step compiles once; no collective in the
decode step is as large as one layer of the cache. Extras: a 3-D
(data, model, seq) mesh, sampling + stop tokens under a mesh, and the
'replicate' kv fallback.

In this process: the table's resolution (which axes shard for which
variant), its bad-input errors (checked on abstract meshes, no devices
needed), and the helpers.
"""

import fcntl
import functools
import json
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax.sharding import AbstractMesh, PartitionSpec
import numpy as np
import pytest

import kvjax
from kvjax import params as params_lib
from kvjax import sharding
from kvjax.tolerance import tolerance
from configs import model as model_presets
import cases  # pylint: disable=g-bad-import-order

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = model_presets.VARIANTS
MESHES = ((8, 1), (1, 8), (2, 4), (4, 2))


def mesh_name(shape) -> str:
  return "x".join(str(s) for s in shape)


def _run_sharded_check(*args) -> str:
  """Runs tests/sharded_check.py (8 devices unless `args` say otherwise);
  its stdout."""
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  proc = subprocess.run(
      [sys.executable, os.path.join(HERE, "sharded_check.py"),
       "--mode=check", *args], capture_output=True, text=True, env=env,
      timeout=900, check=False)
  if proc.returncode:
    raise AssertionError(f"sharded_check.py failed ({proc.returncode}):\n"
                         f"{proc.stderr[-4000:]}")
  return proc.stdout


def _shared_sharded_check() -> str:
  """`_run_sharded_check`'s stdout, run once per test session.

  Why: the subprocess is the suite's largest cost (~1-2 minutes). With
  `--dist loadgroup` one xdist worker runs every test that reads it; under
  any other distribution each worker would run it itself. Workers of one
  run share PYTEST_XDIST_TESTRUNUID: the first to take the lock runs the
  check and leaves its output for the others. A failed run leaves
  nothing, so each worker reports the failure itself. The xdist
  controller deletes the files when the run ends (tests/conftest.py).
  """
  run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
  if not run_id:
    return _run_sharded_check()
  path = os.path.join(tempfile.gettempdir(),
                      f"kvjax_sharded_check_{run_id}.out")
  with open(path + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if os.path.exists(path):
      with open(path) as f:
        return f.read()
    out = _run_sharded_check()
    with open(path + ".tmp", "w") as f:
      f.write(out)
    os.replace(path + ".tmp", path)
    return out


def _parse_rows(stdout: str) -> dict:
  """{(variant, mesh, fallback, stops, layout, cache): row} of a check's
  JSON lines (and ("init_params", variant, mesh) rows)."""
  rows = {}
  for line in stdout.splitlines():
    if line.startswith("{"):
      row = json.loads(line)
      if row.get("check") == "init_params":
        rows[("init_params", row["variant"], mesh_name(row["mesh"]))] = row
        continue
      key = (row["variant"], mesh_name(row["mesh"]), row["kv_fallback"],
             bool(row["stop_tokens"]), row["layout"], row["cache"])
      rows[key] = row
  return rows


@functools.lru_cache(maxsize=None)
def subprocess_results():
  """Runs the 8-device check once per test session; its rows."""
  return _parse_rows(_shared_sharded_check())


TWO_DEVICE_MESHES = ("2x1", "1x2")


@functools.lru_cache(maxsize=None)
def two_device_results():
  """The same check on 2 devices, GQA and MLA, no extras; its rows."""
  return _parse_rows(_run_sharded_check(
      "--devices=2", f"--meshes={','.join(TWO_DEVICE_MESHES)}",
      f"--variants={','.join(cases.FAST_VARIANTS)}", "--noextras"))


def tp_config(variant: str) -> kvjax.ModelConfig:
  """Same as sharded_check.config_for: tiny with N and K doubled."""
  d = model_presets.model_dict(variant, "tiny")
  d["num_heads"] *= 2
  if d["attention"] == "gqa" and d["num_kv_heads"] > 1:
    d["num_kv_heads"] *= 2
  return kvjax.ModelConfig.from_dict(d)


def abstract(shape, names=None):
  return AbstractMesh(tuple(shape), tuple(names or
                                          sharding.MESH_AXES[:len(shape)]))


class _CheckRows(parameterized.TestCase):
  """Reads a sharded check's rows (`_results`); `_check` states what every
  row must hold."""

  DEVICES = 8

  def _results(self):
    return subprocess_results()

  def _row(self, variant, mesh, fallback="seq", stops=False,
           layout="stacked", cache="float32"):
    rows = self._results()
    key = (variant, mesh, fallback, stops, layout, cache)
    self.assertIn(key, rows, f"no result for {key}; got {sorted(rows)}")
    row = rows[key]
    # The name is the config's own (`ModelConfig.variant`), not a label.
    self.assertEqual(row["variant"], variant)
    return row

  def _check(self, row, compiles=(1,)):
    self.assertTrue(row["tokens_equal"], row)
    # Sharded reductions sum in another order (and a KIVI cache can round a
    # key to the neighbouring int8 step): the dtype-derived bound.
    kv_dtype = "int8" if row["cache"] == "kivi" else "float32"
    bound = tolerance(tp_config(row["variant"]), cache=kv_dtype).atol(
        row["logit_scale"])
    self.assertLessEqual(row["max_logit_err"], bound, row)
    self.assertTrue(row["logits_finite"])
    self.assertIn(row["decode_compiles"], compiles, row)
    self.assertEqual(row["cache_sharding_errors"], [])
    # Nothing gathers the cache: every collective is smaller than one
    # layer of it.
    self.assertLess(row["largest_collective_bytes"],
                    row["cache_layer_bytes"], row["collectives"])

  def _check_split(self, row):
    """Each device holds 1/DEVICES of the cache (plus the small replicated
    lengths / positions)."""
    total, per_device = (row["cache_bytes"]["total"],
                         row["cache_bytes"]["per_device"])
    self.assertLessEqual(per_device, 1.05 * total / self.DEVICES,
                         row["table"])


@pytest.mark.xdist_group("two_devices")
class TwoDeviceTest(_CheckRows):
  """The fast tier's sharding check: GQA and MLA over a (2, 1) and a (1, 2)
  mesh of 2 devices (`two_device_results`)."""

  DEVICES = 2

  def _results(self):
    return two_device_results()

  @cases.product(variant=cases.FAST_VARIANTS, mesh=TWO_DEVICE_MESHES)
  def test_sharded_equals_single_device(self, variant, mesh):
    row = self._row(variant, mesh)
    self._check(row)
    self._check_split(row)


# One xdist worker runs every test that reads the subprocess (`--dist
# loadgroup`): it waits for the check while the other worker goes on.
@pytest.mark.slow
@pytest.mark.xdist_group("eight_devices")
class EightDeviceTest(_CheckRows):
  """Reads the subprocess's results; one test per (variant, mesh)."""

  @cases.product(variant=VARIANTS, mesh=tuple(mesh_name(m) for m in MESHES))
  def test_sharded_equals_single_device(self, variant, mesh):
    row = self._row(variant, mesh)
    self._check(row)
    self._check_split(row)

  @cases.product(variant=("gqa", "mla"))
  def test_three_axis_mesh_shards_cache_slots_over_seq(self, variant):
    row = self._row(variant, "2x2x2")
    self._check(row)
    self.assertIn("seq", row["table"]["cache_seq"])

  def test_replicated_kv_head_fallback(self):
    row = self._row("mqa", "1x8", fallback="replicate")
    self._check(row)
    self.assertEqual(row["table"]["kv_heads"], "replicated")
    self.assertEqual(row["table"]["cache_seq"], "replicated")
    # The cost of this fallback: every device holds the whole cache.
    self.assertEqual(row["cache_bytes"]["per_device"],
                     row["cache_bytes"]["total"])

  @cases.product(variant=("gqa", "mla"))
  def test_packed_params_shard_the_same(self, variant):
    # kvjax.pack: fused [out, in] weights under the table's packed names.
    row = self._row(variant, "2x4", layout="packed")
    self._check(row)

  def test_init_params_in_shards_equals_single_device(self):
    rows = subprocess_results()
    row = rows[("init_params", "mha", "2x4")]
    self.assertEqual(row["sharding_errors"], [])
    self.assertEqual(row["max_abs_diff"], 0.0)
    # q [L, D, N, H]: N = 8 heads over model = 4, replicated over data.
    config = tp_config("mha")
    self.assertEqual(row["q_shard_shapes"],
                     [[config.num_layers, config.embed_dim,
                       config.num_heads // 4, config.head_dim]])

  @cases.product(variant=("gqa", "mla"))
  def test_kivi_cache_under_a_mesh(self, variant):
    row = self._row(variant, "2x4", cache="kivi")
    self._check(row)

  def test_sampling_and_stop_tokens_under_a_mesh(self):
    row = self._row("gqa", "2x4", stops=True)
    self.assertIn("temperature=1.0", row["sampler"])
    # The plan equals the (2, 4) case's: its decode step is reused.
    self._check(row, compiles=(0, 1))


class TableTest(parameterized.TestCase):

  @cases.product(variant=VARIANTS, mesh=MESHES)
  def test_resolution_follows_the_head_counts(self, variant, mesh):
    config = tp_config(variant)
    self.assertEqual(config.variant, variant)
    p = sharding.plan(config, abstract(mesh))
    table = p.table
    data, model = mesh
    self.assertEqual(table["batch"], ("data",) if data > 1 else ())
    self.assertEqual(table["heads"], ("model",) if model > 1 else ())
    self.assertEqual(table["mlp"], ("model",) if model > 1 else ())
    kv_divides = config.kv_heads % model == 0
    self.assertEqual(table["kv_heads"],
                     ("model",) if model > 1 and kv_divides else ())
    # When K cannot take the model axis the cache slots do.
    self.assertEqual(table["cache_seq"],
                     ("model",) if not kv_divides else ())
    self.assertEqual(table["latent"], ())
    kv = p.spec(("layers", "batch", "kv_heads", "cache_seq", "head_dim"))
    self.assertLen(kv, 5)
    self.assertEqual(sum(a is not None for a in kv),
                     (data > 1) + (model > 1))

  def test_replicate_fallback_leaves_the_slots_alone(self):
    p = sharding.plan(tp_config("mqa"), abstract((1, 8)),
                      kv_fallback="replicate")
    self.assertEqual(p.table["kv_heads"], ())
    self.assertEqual(p.table["cache_seq"], ())

  def test_seq_axis_and_fallback_combine(self):
    p = sharding.plan(tp_config("mla"), abstract((1, 2, 4)))
    self.assertEqual(p.table["cache_seq"], ("seq", "model"))
    self.assertEqual(p.spec(("layers", "batch", "cache_seq", "latent")),
                     PartitionSpec(None, None, ("seq", "model"), None))

  def test_indivisible_vocab_is_replicated(self):
    config = tp_config("gqa").replace(vocab_size=250)
    self.assertEqual(sharding.plan(config, abstract((1, 8))).table["vocab"],
                     ())
    self.assertEqual(sharding.plan(tp_config("gqa"),
                                   abstract((1, 8))).table["vocab"],
                     ("model",))

  def test_every_preset_param_has_logical_axes(self):
    for preset in model_presets.PRESETS:
      v, _, size = preset.partition("-")
      config = kvjax.ModelConfig.from_dict(model_presets.model_dict(v, size))
      shapes = jax.eval_shape(lambda c=config: kvjax.init_params(
          c, jax.random.key(0)))
      axes = sharding.param_axes(shapes)
      flat = jax.tree_util.tree_leaves_with_path(
          axes, is_leaf=lambda x: isinstance(x, tuple))
      for path, ax in flat:
        name = jax.tree_util.keystr(path)
        # Known to the table: no leaf is silently replicated.
        self.assertTrue(any(a is not None for a in ax), f"{preset} {name}")
      names = {jax.tree_util.keystr(p): ax for p, ax in flat}
      if config.attention == "mla":
        self.assertFalse(any("kv_heads" in ax for ax in names.values()))
        self.assertEqual(names["['layers']['attn']['w_uk']"],
                         ("layers", "latent", "heads", "head_dim"))
      else:
        self.assertEqual(names["['layers']['attn']['k']"],
                         ("layers", "embed", "kv_heads", "head_dim"))

  def test_unstacked_layers_have_the_same_axes_without_the_layer_axis(self):
    config = tp_config("mla")
    shapes = jax.eval_shape(lambda: kvjax.init_params(config,
                                                      jax.random.key(0)))
    stacked = sharding.param_axes(shapes)
    unstacked = sharding.param_axes(jax.eval_shape(
        params_lib._unstack_layers, shapes))  # pylint: disable=protected-access
    self.assertLen(unstacked["layers"], config.num_layers)
    for layer in unstacked["layers"]:
      jax.tree_util.tree_map(
          lambda s, u: self.assertEqual(s[1:], u), stacked["layers"], layer,
          is_leaf=lambda x: isinstance(x, tuple))
    self.assertEqual(unstacked["embed"], ("vocab", "embed"))

  @cases.named((dict(variant="gqa", dtype="float32", eviction="none"),
                dict(variant="gqa", dtype="int8", eviction="h2o"),
                dict(variant="mla", dtype="int8", eviction="none")))
  def test_cache_axes_match_every_leaf(self, variant, dtype, eviction):
    config = tp_config(variant)
    policy = kvjax.CachePolicy(eviction=eviction,
                               recent=2 if eviction == "h2o" else 0,
                               kv_dtype=dtype)
    cache = jax.eval_shape(lambda: kvjax.init_cache(config, 2, 16,
                                                    policy=policy))
    axes = sharding.cache_axes(cache)
    pairs = jax.tree_util.tree_leaves(
        jax.tree_util.tree_map(lambda a, x: (a, x.shape), axes, cache,
                               is_leaf=lambda x: isinstance(x, tuple)),
        is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and
        isinstance(x[1], tuple))
    self.assertLen(pairs, len(jax.tree_util.tree_leaves(cache)))
    for ax, shape in pairs:
      self.assertLen(ax, len(shape))
      self.assertIn("batch", ax)


class BadInputTest(parameterized.TestCase):

  def test_model_axis_not_dividing_the_heads(self):
    config = kvjax.ModelConfig.from_dict(model_presets.model_dict("gqa",
                                                                  "tiny"))
    with self.assertRaisesRegex(ValueError,
                                r"'model' \(size 8\).*num_heads=4"):
      sharding.plan(config, abstract((1, 8)))

  def test_model_axis_not_dividing_the_mlp(self):
    config = tp_config("gqa").replace(mlp_dim=100)
    with self.assertRaisesRegex(ValueError, r"'model' \(size 8\).*mlp_dim"):
      sharding.plan(config, abstract((1, 8)))

  def test_data_axis_not_dividing_the_batch(self):
    config = tp_config("gqa")
    p = sharding.plan(config, abstract((4, 2)))
    params = jax.eval_shape(lambda: kvjax.init_params(config,
                                                      jax.random.key(0)))
    tokens = np.ones((6, 5), np.int32)
    msg = r"'data' \(size 4\) does not divide the batch size 6"
    with self.assertRaisesRegex(ValueError, msg):
      p.check_batch(6)
    # The public API raises it before any compute (the mesh is abstract:
    # nothing could run on it).
    with self.assertRaisesRegex(ValueError, msg):
      kvjax.generate(params, config, tokens, 3, shardings=p)
    cache = jax.eval_shape(lambda: kvjax.init_cache(config, 6, 16))
    with self.assertRaisesRegex(ValueError, msg):
      kvjax.prefill(params, config, tokens, cache, shardings=p)

  def test_plan_for_another_config(self):
    p = sharding.plan(tp_config("gqa"), abstract((2, 4)))
    config = tp_config("mha")
    params = jax.eval_shape(lambda: kvjax.init_params(config,
                                                      jax.random.key(0)))
    with self.assertRaisesRegex(ValueError, "another ModelConfig"):
      kvjax.generate(params, config, np.ones((2, 3), np.int32), 2,
                     shardings=p)

  def test_bad_rules_and_fallback(self):
    config = tp_config("gqa")
    with self.assertRaisesRegex(ValueError, "kv_fallback"):
      sharding.plan(config, abstract((2, 4)), kv_fallback="shard")
    with self.assertRaisesRegex(ValueError, "'tensor'"):
      sharding.plan(config, abstract((2, 4)),
                    rules=(("heads", "tensor"),))
    with self.assertRaisesRegex(ValueError, "twice"):
      sharding.plan(config, abstract((2, 4)),
                    rules=(("heads", ("model", "model")),))

  def test_cache_capacity_not_dividing_the_slot_axes(self):
    p = sharding.plan(tp_config("mqa"), abstract((1, 8)))
    with self.assertRaisesRegex(ValueError,
                                r"'model' \(size 8\).*cache_seq.*\(12\)"):
      p.spec(("batch", "cache_seq"), (1, 12), "cache")

  def test_make_mesh_checks_the_device_count(self):
    with self.assertRaisesRegex(ValueError, "needs 8 devices"):
      sharding.make_mesh((2, 4))
    mesh = sharding.make_mesh((1, 1))
    self.assertEqual(mesh.axis_names, ("data", "model"))


class HelperTest(parameterized.TestCase):

  def test_collective_stats_reads_hlo(self):
    hlo = "\n".join([
        "  %all-gather.1 = f32[2,8,4]{2,1,0} all-gather(%x), dimensions={2}",
        "  %ar = (f32[8]{0}, s32[4]{0}) all-reduce(%a, %b), to_apply=%add",
        "  %ar.2 = bf16[16]{0} all-reduce-start(%c), to_apply=%add",
        "  %fusion = f32[8]{0} fusion(%all-gather.1), kind=kLoop",
    ])
    stats = sharding.collective_stats(hlo)
    self.assertEqual(stats["all-gather"],
                     dict(count=1, bytes=2 * 8 * 4 * 4, max_bytes=256))
    self.assertEqual(stats["all-reduce"],
                     dict(count=2, bytes=8 * 4 + 4 * 4 + 16 * 2,
                          max_bytes=48))
    self.assertNotIn("all-to-all", stats)

  def test_initialize_distributed_only_when_launched_so(self):
    keys = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
            "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
    saved = {k: os.environ.pop(k) for k in keys if k in os.environ}
    try:
      self.assertFalse(sharding.initialize_distributed())
      os.environ["JAX_COORDINATOR_ADDRESS"] = "localhost:1234"
      with self.assertRaisesRegex(ValueError, "JAX_NUM_PROCESSES"):
        sharding.initialize_distributed()
    finally:
      for k in keys:
        os.environ.pop(k, None)
      os.environ.update(saved)

  @pytest.mark.slow  # the 2-device check runs a plan on a real mesh
  def test_one_device_plan_changes_nothing(self):
    config = tp_config("gqa")
    params = kvjax.init_params(config, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(1, 256, (2, 5)).astype(
        np.int32)
    p = sharding.plan(config, sharding.make_mesh((1, 1)))
    a = kvjax.generate(params, config, tokens, 3)
    b = kvjax.generate(p.put_params(params), config, tokens, 3, shardings=p)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


if __name__ == "__main__":
  absltest.main()
