r"""kvjax on a mesh of 8 simulated CPU devices: checks and measurements.

The device count is fixed when JAX starts, so this runs in its own process
(tests/test_sharding.py launches it). It forces the CPU platform with 8 host
devices, so it checks the same thing on a GPU machine.

  python tests/sharded_check.py --mode=check      # JSON lines on stdout
  python tests/sharded_check.py --mode=measure --capacity=2048 \
      --out=/tmp/sharding_measure.json            # kv_fallback comparison
  for i in 0 1; do                                # 2 processes x 4 devices
    JAX_COORDINATOR_ADDRESS=localhost:12355 JAX_NUM_PROCESSES=2 \
    JAX_PROCESS_ID=$i python tests/sharded_check.py --mode=multihost & done

  python tests/sharded_check.py --mode=check --devices=2 --meshes=2x1,1x2 \
      --variants=gqa,mla --noextras              # the fast tier's 2 devices

check: for every mesh shape in --meshes and every variant (tiny preset with
the head counts doubled, so the model axis 8 divides N): sharded `generate`
equals single-device `generate` token for token and logits within
`kvjax.tolerance` (the test derives the bound from `logit_scale`);
every cache leaf's per-device shard has the shape the table implies; the
public decode step compiles once over several steps; no collective in the
decode step moves as much as one layer of the cache.

multihost: the same mesh spread over several processes
(`sharding.initialize_distributed`, gloo CPU collectives): sharded generate
and decode_step equal single-device runs.

measure: for the cases where the model axis does not divide K, each
kv_fallback's per-device cache bytes, the collectives GSPMD inserted into the
decode step, and the median decode-step time.
"""

import os
import sys



def _devices_from_argv(default=8):
  """--devices, read before JAX starts (it fixes the device count)."""
  for arg in sys.argv[1:]:
    if arg.startswith("--devices="):
      return int(arg.partition("=")[2])
  return default


# --devices in all (8 by default): split over the processes of a
# multi-process run.
DEVICES = _devices_from_argv()
_PROCESSES = int(os.environ.get("JAX_NUM_PROCESSES", "1"))
_FLAGS = [f"--xla_force_host_platform_device_count={DEVICES // _PROCESSES}"]
if "--mode=measure" not in sys.argv:
  # The checks compare programs with each other, not speed: skip LLVM's
  # optimizations (halves compile time; measured).
  _FLAGS.append("--xla_backend_optimization_level=0")
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", "")] +
    [f for f in _FLAGS if f not in os.environ.get("XLA_FLAGS", "")]).strip()
os.environ["JAX_PLATFORMS"] = "cpu"

# pylint: disable=g-import-not-at-top,wrong-import-position
import json
import tempfile
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import inference
from kvjax import sharding
from configs import model as model_presets

_MODE = flags.DEFINE_enum("mode", "check", ["check", "measure", "multihost"],
                          "what to run")
_MESHES = flags.DEFINE_list("meshes", ["8x1", "1x8", "2x4", "4x2"],
                            "mesh shapes (data x model [x seq])")
_VARIANTS = flags.DEFINE_list("variants", list(model_presets.VARIANTS),
                              "attention variants")
_EXTRAS = flags.DEFINE_bool("extras", True,
                            "check mode: also a 3-D (data, model, seq) mesh, "
                            "sampling with stop tokens, kv_fallback=replicate")
_NEW = flags.DEFINE_integer("new_tokens", 8, "tokens generated per check")
_CAPACITY = flags.DEFINE_integer("capacity", 2048, "measure: cache slots")
_STEPS = flags.DEFINE_integer("steps", 30, "measure: timed decode steps")
_OUT = flags.DEFINE_string("out", "", "measure: write the JSON here too")
_COMPILE_CACHE = flags.DEFINE_bool(
    "compile_cache", True, "a persistent compilation cache: the one "
    "JAX_COMPILATION_CACHE_DIR names (tests/conftest.py sets it), else a "
    "temporary one")
flags.DEFINE_integer("devices", 8, "simulated CPU devices (read from argv "
                     "before JAX starts; a divisor of 8)")

B = 8  # divisible by every data-axis size of an 8- (or 2-) device mesh


def config_for(variant: str) -> kvjax.ModelConfig:
  """The tiny preset with N and K doubled (8 query heads: tensor-parallel
  over 8 devices). K stays 1 for MQA; MLA's dims are unchanged."""
  d = model_presets.model_dict(variant, "tiny")
  d["num_heads"] *= 2
  if d["attention"] == "gqa" and d["num_kv_heads"] > 1:
    d["num_kv_heads"] *= 2
  config = kvjax.ModelConfig.from_dict(d)
  assert config.variant == variant, (config.variant, variant)
  return config


def init_params(config, seed=0):
  """Random parameters drawn on the host (compiling the random init for 8
  devices costs more than the whole check); norms are ones."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda: kvjax.init_params(config,
                                                    jax.random.key(0)))
  return jax.tree_util.tree_map_with_path(
      lambda path, s: (np.ones(s.shape, s.dtype)
                       if str(path[-1].key).endswith("norm") else
                       (config.init_scale * rng.standard_normal(s.shape)
                        ).astype(s.dtype)), shapes)


def ragged_prompt(seed=0, T=16):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, T + 1, size=B)
  tokens = rng.integers(1, 256, size=(B, T)).astype(np.int32)
  mask = (np.arange(T)[None] >= T - lengths[:, None]).astype(np.int32)
  return tokens * mask, mask


def parse_mesh(s: str) -> tuple[int, ...]:
  return tuple(int(x) for x in s.split("x"))


def expected_shard_shape(config, mesh, kv_fallback, name, shape):
  """Per-device shard shape of a cache leaf, from the table as documented
  (independent of `ShardingPlan.spec`): batch over data; kv heads over model
  when it divides K, else the cache slots over model (kv_fallback 'seq') or
  nothing ('replicate'); slots also over seq."""
  sizes = dict(mesh.shape)
  data, model, seq = (sizes.get(a, 1) for a in ("data", "model", "seq"))
  kv_sharded = config.kv_heads % model == 0
  slot_div = seq * (model if (not kv_sharded and kv_fallback == "seq")
                    else 1)
  if name in ("positions", "scores"):
    dims = dict(B=0, S=1)
  elif name == "length":
    dims = dict(B=0)
  elif config.attention == "mla":  # c_kv, k_rope [L,B,S,C]
    dims = dict(B=1, S=2)
  else:  # k, v [L,B,K,S,H]
    dims = dict(B=1, K=2, S=3)
  out = list(shape)
  out[dims["B"]] //= data
  if "S" in dims:
    out[dims["S"]] //= slot_div
  if "K" in dims and kv_sharded:
    out[dims["K"]] //= model
  return tuple(out)


KIVI = kvjax.CachePolicy(kv_dtype="int8", key_quant="channel", key_group=8)
CACHES = dict(float32=kvjax.CachePolicy(), kivi=KIVI)


def check_case(config, params, mesh_shape, ref, prompt, kv_fallback="seq",
               sampler=kvjax.GREEDY, stop_tokens=(), layout="stacked",
               cache_kind="float32"):
  """One (mesh, variant) case; returns a JSON-able dict."""
  tokens, mask = prompt
  mesh = sharding.make_mesh(mesh_shape)
  p = sharding.plan(config, mesh, kv_fallback=kv_fallback)
  if layout == "packed":
    params = kvjax.pack(params, config)
  sp = p.put_params(params)
  t0 = time.perf_counter()
  toks, logits, cache = kvjax.generate(
      sp, config, tokens, _NEW.value, attention_mask=mask, sampler=sampler,
      rng=jax.random.key(3), stop_tokens=stop_tokens, pad_id=0,
      return_logits=True, return_cache=True, shardings=p,
      policy=CACHES[cache_kind])
  ref_toks, ref_logits = ref
  out = dict(mesh=list(mesh_shape), variant=config.variant,
             kv_fallback=kv_fallback, layout=layout, cache=cache_kind,
             table=sharding.describe(p),
             sampler=str(sampler), stop_tokens=list(stop_tokens))
  out["tokens_equal"] = bool((np.asarray(toks) == np.asarray(ref_toks)).all())
  out["max_logit_err"] = float(jnp.max(jnp.abs(logits - ref_logits)))
  out["logit_scale"] = float(jnp.max(jnp.abs(ref_logits)))
  finite = jnp.isfinite(np.asarray(ref_logits))
  out["logits_finite"] = bool(finite.all())

  # Every cache leaf, from generate and after decode steps, is sharded as
  # the table says: the per-device shard shapes, and the sharding itself.
  def leaf_report(c):
    bad = []
    for name in ("k", "v", "c_kv", "k_rope", "positions", "length",
                 "scores"):
      leaf = getattr(c, name, None)
      if leaf is None:
        continue
      want = expected_shard_shape(config, mesh, kv_fallback, name,
                                  leaf.shape)
      # What each device really holds: the slice of the global array it
      # was given (no data is read).
      got = {tuple(len(range(*sl.indices(n))) for sl, n in
                   zip(sh.index, leaf.shape))
             for sh in leaf.addressable_shards}
      if got != {want}:
        bad.append(f"{name}: shards {sorted(got)} != {want}")
      if not leaf.sharding.is_equivalent_to(
          getattr(p.cache_shardings(c), name), leaf.ndim):
        bad.append(f"{name}: sharding {leaf.sharding} differs from the plan")
    # Scales and KIVI's residual groups: as the plan says.
    for name in ("k_scale", "v_scale", "c_scale", "r_scale", "k_resid",
                 "c_resid", "r_resid"):
      leaf = getattr(c, name, None)
      if leaf is not None and not leaf.sharding.is_equivalent_to(
          getattr(p.cache_shardings(c), name), leaf.ndim):
        bad.append(f"{name}: sharding {leaf.sharding} differs from the plan")
    return bad

  bad = leaf_report(cache)
  # Decode steps through the public API: the output cache's sharding is the
  # next input's, so the step compiles exactly once.
  before = inference._decode._cache_size()  # pylint: disable=protected-access
  tok = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
  step_cache = cache
  for _ in range(3):
    step_logits, step_cache = kvjax.decode_step(sp, config, tok, step_cache,
                                                shardings=p)
    tok = jnp.argmax(step_logits, -1).astype(jnp.int32)
  out["decode_compiles"] = (
      inference._decode._cache_size() - before)  # pylint: disable=protected-access
  bad += leaf_report(step_cache)
  out["cache_sharding_errors"] = bad
  # No collective in the decode step moves as much as one layer of the
  # cache (a gathered cache would).
  tok = p.put(tok, sharding.TOKEN_AXES)
  hlo = inference._decode.lower(  # pylint: disable=protected-access
      sp, config, tok, step_cache, shardings=p).compile().as_text()
  stats = sharding.collective_stats(hlo)
  payload = step_cache.c_kv if config.attention == "mla" else step_cache.k
  out["collectives"] = stats
  out["largest_collective_bytes"] = max(
      [v["max_bytes"] for v in stats.values()] + [0])
  out["cache_layer_bytes"] = int(payload[0].size * payload.dtype.itemsize)
  out["cache_bytes"] = sharding.shard_bytes(step_cache)
  out["seconds"] = round(time.perf_counter() - t0, 2)
  return out


def check_init_params(config, mesh_shape):
  """`ShardingPlan.init_params` (created in its shards) equals the
  single-device init, and every leaf is sharded as the table says."""
  p = sharding.plan(config, sharding.make_mesh(mesh_shape))
  key = jax.random.key(0)
  sharded = p.init_params(key)
  single = jax.jit(kvjax.init_params, static_argnums=0)(config, key)
  want = p.param_shardings(sharded)
  bad = [jax.tree_util.keystr(path) for path, leaf, w in zip(
      *zip(*jax.tree_util.tree_flatten_with_path(sharded)[0]),
      jax.tree_util.tree_leaves(want)) if not leaf.sharding.is_equivalent_to(
          w, leaf.ndim)]
  err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree_util.tree_leaves(sharded), jax.tree_util.tree_leaves(single)))
  heads_split = {tuple(len(range(*sl.indices(n))) for sl, n in
                       zip(sh.index, sharded["layers"]["attn"]["q"].shape))
                 for sh in sharded["layers"]["attn"]["q"].addressable_shards}
  return dict(check="init_params", variant=config.variant,
              mesh=list(mesh_shape), max_abs_diff=err,
              sharding_errors=bad, q_shard_shapes=sorted(heads_split))


def run_check():
  prompt = ragged_prompt()
  meshes = [parse_mesh(m) for m in _MESHES.value]
  for variant in _VARIANTS.value:
    config = config_for(variant)
    params = init_params(config)
    toks, logits, _ = kvjax.generate(params, config, prompt[0], _NEW.value,
                                     attention_mask=prompt[1],
                                     return_logits=True)
    for shape in meshes:
      print(json.dumps(check_case(config, params, shape, (toks, logits),
                                  prompt)), flush=True)
    if not _EXTRAS.value:
      continue
    if variant in ("gqa", "mla"):
      # A 3-D mesh: the cache slots over 'seq' as well.
      print(json.dumps(check_case(config, params, (2, 2, 2), (toks, logits),
                                  prompt)), flush=True)
      # KIVI keys (per-channel scales, float residual groups) in shards.
      ref = kvjax.generate(params, config, prompt[0], _NEW.value,
                           attention_mask=prompt[1], policy=KIVI,
                           return_logits=True)[:2]
      print(json.dumps(check_case(config, params, (2, 4), ref, prompt,
                                  cache_kind="kivi")), flush=True)
      # Packed decode params (kvjax.pack) shard by the same table.
      print(json.dumps(check_case(config, params, (2, 4), (toks, logits),
                                  prompt, layout="packed")), flush=True)
    if variant == "mqa":
      # The other fallback: the single kv head copied to every model shard.
      print(json.dumps(check_case(config, params, (1, 8), (toks, logits),
                                  prompt, kv_fallback="replicate")),
            flush=True)
    if variant == "mha":
      print(json.dumps(check_init_params(config, (2, 4))), flush=True)
    if variant == "gqa":
      # Sampling (threefry is partitionable: same key, same draws on any
      # mesh) and the stop-token while_loop, against the same on one device.
      sampler = kvjax.Sampler(temperature=1.0, top_k=40)
      stops = (int(np.asarray(toks)[0, 2]),)
      ref = kvjax.generate(params, config, prompt[0], _NEW.value,
                           attention_mask=prompt[1], sampler=sampler,
                           rng=jax.random.key(3), stop_tokens=stops,
                           return_logits=True)[:2]
      print(json.dumps(check_case(config, params, (2, 4), ref, prompt,
                                  sampler=sampler, stop_tokens=stops)),
            flush=True)


def run_measure():
  results = []
  for variant in _VARIANTS.value:
    config = config_for(variant)
    params = init_params(config)
    tokens, mask = ragged_prompt()
    for shape in (parse_mesh(m) for m in _MESHES.value):
      mesh = sharding.make_mesh(shape)
      model = dict(mesh.shape).get("model", 1)
      if config.kv_heads % model == 0:
        continue  # kv heads shard: no fallback to compare
      for fallback in sharding.KV_FALLBACKS:
        p = sharding.plan(config, mesh, kv_fallback=fallback)
        sp = p.put_params(params)
        cache = p.init_cache(B, _CAPACITY.value)
        logits, cache = kvjax.prefill(sp, config, tokens, cache,
                                      attention_mask=mask, shardings=p)
        tok = p.put(jnp.argmax(logits, -1).astype(jnp.int32),
                    sharding.TOKEN_AXES)
        hlo = inference._decode.lower(  # pylint: disable=protected-access
            sp, config, tok, cache, shardings=p).compile().as_text()
        for _ in range(3):  # warm up (compiles once)
          logits, cache = kvjax.decode_step(sp, config, tok, cache,
                                            shardings=p)
        jax.block_until_ready(logits)
        times = []
        for _ in range(_STEPS.value):
          t0 = time.perf_counter()
          logits, cache = kvjax.decode_step(sp, config, tok, cache,
                                            shardings=p)
          jax.block_until_ready(logits)
          times.append(time.perf_counter() - t0)
        row = dict(variant=config.variant, mesh=list(shape),
                   kv_fallback=fallback, capacity=_CAPACITY.value, batch=B,
                   cache_bytes=sharding.shard_bytes(cache),
                   collectives=sharding.collective_stats(hlo),
                   decode_ms_median=round(1e3 * float(np.median(times)), 3),
                   decode_ms_p10_p90=[round(1e3 * float(q), 3) for q in
                                      np.percentile(times, [10, 90])],
                   table=sharding.describe(p))
        print(json.dumps(row), flush=True)
        results.append(row)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(dict(device=str(jax.devices()[0].platform),
                     n_devices=jax.device_count(), results=results), f,
                indent=1)


def run_multihost():
  """Sharded generate and decode_step on a (2, 4) mesh whose devices belong
  to several processes, against single-device runs on a local device."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  gather = lambda x: np.asarray(multihost_utils.process_allgather(
      x, tiled=True))
  tokens, mask = ragged_prompt()
  local = jax.local_devices()[0]
  for variant in _VARIANTS.value:
    config = config_for(variant)
    params = init_params(config)
    p = sharding.plan(config, sharding.make_mesh((2, 4)))
    sp = p.put_params(params)
    toks, logits, _ = kvjax.generate(sp, config, tokens, _NEW.value,
                                     attention_mask=mask, return_logits=True,
                                     shardings=p)
    cache = p.init_cache(B, 32)
    _, cache = kvjax.prefill(sp, config, tokens, cache, attention_mask=mask,
                             shardings=p)
    step, cache = kvjax.decode_step(sp, config, np.ones((B,), np.int32),
                                    cache, shardings=p)
    with jax.default_device(local):
      lp = jax.device_put(params, local)
      ref_toks, ref_logits, _ = kvjax.generate(
          lp, config, tokens, _NEW.value, attention_mask=mask,
          return_logits=True)
      rc = kvjax.init_cache(config, B, 32)
      _, rc = kvjax.prefill(lp, config, tokens, rc, attention_mask=mask)
      ref_step, _ = kvjax.decode_step(lp, config, np.ones((B,), np.int32), rc)
    print(json.dumps(dict(
        process=jax.process_index(), processes=jax.process_count(),
        devices=jax.device_count(), variant=config.variant,
        tokens_equal=bool((gather(toks) == np.asarray(ref_toks)).all()),
        max_logit_err=float(np.abs(gather(logits) -
                                   np.asarray(ref_logits)).max()),
        decode_step_err=float(np.abs(gather(step) -
                                     np.asarray(ref_step)).max()),
        local_cache_shards=len(
            (cache.c_kv if config.attention == "mla" else
             cache.k).addressable_shards))), flush=True)


def main(argv):
  del argv
  if _MODE.value == "multihost":
    # CPU collectives across processes.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if not sharding.initialize_distributed():
      raise SystemExit("--mode=multihost needs JAX_COORDINATOR_ADDRESS, "
                       "JAX_NUM_PROCESSES and JAX_PROCESS_ID")
    run_multihost()
    return
  jax.config.update("jax_numpy_rank_promotion", "raise")
  if _COMPILE_CACHE.value:
    # Inspecting the decode step's HLO recompiles it (`.lower().compile()`);
    # a persistent cache turns that into a lookup (and, when the tests name
    # their cache, the whole check into lookups on the next run).
    if not jax.config.jax_compilation_cache_dir:
      jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp())
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  if jax.device_count() != DEVICES or 8 % DEVICES:
    raise SystemExit(f"expected {DEVICES} devices (a divisor of 8), got "
                     f"{jax.device_count()}")
  if _MODE.value == "check":
    run_check()
  else:
    run_measure()


if __name__ == "__main__":
  app.run(main)
