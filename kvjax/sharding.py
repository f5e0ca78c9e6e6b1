"""Sharding over a device mesh: one table from logical axes to mesh axes.

Mesh axes:
  data    data parallel: the batch B.
  model   tensor parallel: query heads N, kv heads K, MLP hidden F, vocab V.
  seq     optional: the cache slots S.

`RULES` below is the table. Every array the library shards (parameters,
caches, token batches, logits) names its dimensions with logical axes
(`PARAM_AXES`, `cache_axes`), and a `ShardingPlan` turns those names into a
`NamedSharding` through the table, so params and caches can never disagree.

A plan is resolved once per (config, mesh):
  * `heads` and `mlp` must be divisible by their mesh axes, else ValueError
    naming the axis and the numbers (tensor parallelism over a head count
    the mesh does not divide is a configuration error, not something to
    paper over).
  * `kv_heads` cannot be sharded when the model axis does not divide K
    (MQA's K = 1, GQA with K < model size; MLA's latent has no head axis, its
    K is 1). Then, by default (`kv_fallback='seq'`), the cache slots S are
    sharded over the mesh axes K could not use: each device still holds
    1/model of the cache and attends over its slots, and GSPMD combines the
    softmax statistics with small all-reduces. `kv_fallback='replicate'`
    keeps a full copy of the kv heads / latent on every model shard instead;
    measured on 8 simulated devices it costs model-size times the cache
    memory, and for GQA with K < model GSPMD re-shards the replicated cache
    inside the layer loop and all-gathers all of it every step (see
    WORKSPACE.md).
  * `vocab` falls back to replication when V is not divisible (odd
    vocabularies such as 50257).
  * `batch` is checked per call: the data axis must divide B.

Under `jit`, GSPMD partitions the computation from these shardings; no
collective is written by hand. The jitted bodies of `kvjax.inference` pin the
cache they return to the plan (`constrain_cache`) so the next step sees the
same input sharding and never recompiles.

Multi-host: call `initialize_distributed()` before any other JAX call; every
process runs the same program on the global mesh (`make_mesh` over
`jax.devices()`, which then lists every host's devices).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvjax import cache as cache_lib
from kvjax import params as params_lib
from kvjax.config import ModelConfig

MESH_AXES = ("data", "model", "seq")

# logical axis -> mesh axis (a name, a tuple of names, or None = replicated).
# Mesh axes the mesh does not have (e.g. 'seq' on a 2-D mesh) are ignored.
RULES: tuple[tuple[str, Any], ...] = (
    ("batch", "data"),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("mlp", "model"),
    ("vocab", "model"),
    ("embed", None),
    ("head_dim", None),
    ("latent", None),
    ("q_latent", None),
    ("cache_seq", "seq"),
    ("layers", None),
)

# Parameter leaves by path inside one block (the layer stacks add a leading
# `layers` axis) or at the top level.
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("embed",),
    "attn_norm": ("embed",),
    "mlp_norm": ("embed",),
    # GQA / MHA / MQA
    "attn/q": ("embed", "heads", "head_dim"),
    "attn/k": ("embed", "kv_heads", "head_dim"),
    "attn/v": ("embed", "kv_heads", "head_dim"),
    "attn/o": ("heads", "head_dim", "embed"),
    "attn/q_bias": ("heads", "head_dim"),
    "attn/k_bias": ("kv_heads", "head_dim"),
    "attn/v_bias": ("kv_heads", "head_dim"),
    "attn/o_bias": ("embed",),
    # MLA: per-head weights shard over heads; the latent path is replicated.
    "attn/kv_a": ("embed", "latent"),
    "attn/kv_a_norm": ("latent",),
    "attn/w_uk": ("latent", "heads", "head_dim"),
    "attn/w_uv": ("latent", "heads", "head_dim"),
    "attn/q_a": ("embed", "q_latent"),
    "attn/q_a_norm": ("q_latent",),
    "attn/q_b": ("q_latent", "heads", "head_dim"),
    # dense MLP
    "mlp/gate": ("embed", "mlp"),
    "mlp/up": ("embed", "mlp"),
    "mlp/down": ("mlp", "embed"),
    # the packed layout (kvjax.projections): fused [out, in] weights. A
    # fused axis mixes heads (or gate and up), so it stays replicated; the
    # contracted axes shard as above.
    "attn/qkv_t": (None, "embed"),
    "attn/o_t": ("embed", None),
    "mlp/gate_up_t": (None, "embed"),
    "mlp/down_t": ("embed", "mlp"),
    "lm_head_t": ("vocab", "embed"),
    # packed MLA: per-head weights keep their head axis; the rest as above.
    "attn/q_t": (None, "embed"),
    "attn/q_a_t": ("q_latent", "embed"),
    "attn/q_b_t": (None, "q_latent"),
    "attn/kv_a_t": ("latent", "embed"),
    "attn/w_uk_t": ("heads", "latent", "head_dim"),
    "attn/w_uv_t": ("heads", "head_dim", "latent"),
}
LAYER_STACKS = ("layers", "moe_layers")

KV_FALLBACKS = ("replicate", "seq")

# Activations at the API boundary.
TOKENS_AXES = ("batch", None)  # [B, T]
TOKEN_AXES = ("batch",)  # [B]
LOGITS_AXES = ("batch", "vocab")  # [B, V]
SEQ_LOGITS_AXES = ("batch", None, "vocab")  # [B, T, V]


def cache_axes(cache) -> Any:
  """Logical axes of every leaf of a `KVCache` / `LatentCache` (same
  pytree structure, tuples as leaves; absent optional fields stay None)."""
  # int2 scales carry (scale, zero): a trailing pair per token, and per
  # channel group the scales then the zeros (their channel axis is not the
  # payload's, so it is not sharded with it).
  pair = cache.policy.kv_dtype == "int2"
  tok = (None,) if pair else ()
  if isinstance(cache, cache_lib.LatentCache):
    payload = ("layers", "batch", "cache_seq", "latent")  # c_kv, k_rope
    scale = ("layers", "batch", "cache_seq") + tok
    fields = dict(c_kv=payload, k_rope=payload, c_scale=scale, r_scale=scale)
    if cache.policy.channel_keys:
      # KIVI: per-channel scales per group, the float newest group.
      group = ("layers", "batch", None, "latent")
      scales = ("layers", "batch", None, None if pair else "latent")
      fields.update(c_scale=scales, r_scale=scales, c_resid=group,
                    r_resid=group)
  elif isinstance(cache, cache_lib.KVCache):
    payload = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")
    scale = ("layers", "batch", "kv_heads", "cache_seq") + tok
    fields = dict(k=payload, v=payload, k_scale=scale, v_scale=scale)
    if cache.policy.channel_keys:
      # KIVI: per-channel key scales per group, the float newest group.
      fields.update(
          k_scale=("layers", "batch", "kv_heads", None,
                   None if pair else "head_dim"),
          k_resid=("layers", "batch", "kv_heads", None, "head_dim"))
  else:
    raise ValueError(f"not a kvjax cache: {type(cache).__name__}")
  if cache.positions.ndim == 4:  # a scoped policy: [L, B, K', S]
    heads = "kv_heads" if cache.positions.shape[2] > 1 else None
    scoped = ("layers", "batch", heads, "cache_seq")
    fields.update(positions=scoped, scores=scoped,
                  budget=("layers", "batch", heads))
  else:
    fields.update(positions=("batch", "cache_seq"),
                  scores=("batch", "cache_seq"))
  fields.update(length=("batch",), errors=("batch",))
  return cache.replace(**{name: (axes if getattr(cache, name) is not None
                                 else None)
                          for name, axes in fields.items()})


def _is_axes(x) -> bool:
  return isinstance(x, tuple) and all(a is None or isinstance(a, str)
                                      for a in x)


def param_axes(params) -> Any:
  """Logical axes of every leaf of a params pytree (arrays or
  ShapeDtypeStructs): `PARAM_AXES`, with a leading `layers` axis inside the
  stacked layer stacks (none for the per-layer tuples of the decode
  layout, `kvjax.pack`). Leaves the table does not know (e.g. MoE experts)
  are replicated (all None).

  Raises:
    ValueError: a known leaf whose rank differs from its logical axes.
  """

  def one(path, leaf):
    lead = ()
    if path and getattr(path[0], "key", None) in LAYER_STACKS:
      path = path[1:]
      if path and isinstance(path[0], jax.tree_util.SequenceKey):
        path = path[1:]  # the decode layout (`kvjax.pack`): one dict per layer
      else:
        lead = ("layers",)
    keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    axes = PARAM_AXES.get("/".join(keys))
    if axes is None:
      return (None,) * len(leaf.shape)
    axes = lead + axes
    if len(axes) != len(leaf.shape):
      raise ValueError(f"param {'/'.join(keys)} has shape "
                       f"{tuple(leaf.shape)}, its logical axes are {axes}")
    return axes

  return jax.tree_util.tree_map_with_path(one, params)


def _as_tuple(mesh_axes) -> tuple[str, ...]:
  if mesh_axes is None:
    return ()
  if isinstance(mesh_axes, str):
    return (mesh_axes,)
  return tuple(mesh_axes)


def place(x, sharding: NamedSharding) -> jax.Array:
  """`x` with `sharding`: unchanged when it already has it, `device_put`
  when every target device is this process's, else assembled shard by shard
  from the host value (a mesh over several processes: each process passes
  the same global value). PRNG key arrays go through their key data."""
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key):
    data = place(jax.random.key_data(x), NamedSharding(
        sharding.mesh, PartitionSpec(*sharding.spec, None)))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  if isinstance(x, jax.Array):
    if x.sharding == sharding:
      return x
    if sharding.is_fully_addressable or not x.is_fully_addressable:
      return jax.device_put(x, sharding)
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])


def make_mesh(shape: Sequence[int],
              axis_names: Sequence[str] | None = None,
              devices: Sequence[Any] | None = None) -> Mesh:
  """A mesh over `devices` (default: all of `jax.devices()`).

  Args:
    shape: mesh axis sizes, e.g. (data, model) or (data, model, seq).
    axis_names: defaults to the first len(shape) of ('data', 'model', 'seq').
  Returns:
    a `jax.sharding.Mesh` with automatic (GSPMD) axes.
  """
  shape = tuple(int(s) for s in shape)
  if axis_names is None:
    if len(shape) > len(MESH_AXES):
      raise ValueError(f"mesh shape {shape} has more than {len(MESH_AXES)} "
                       f"axes; name them with axis_names")
    axis_names = MESH_AXES[:len(shape)]
  axis_names = tuple(axis_names)
  if len(axis_names) != len(shape):
    raise ValueError(f"mesh shape {shape} and axis_names {axis_names} differ "
                     "in length")
  if any(s < 1 for s in shape):
    raise ValueError(f"mesh axis sizes must be >= 1, got {shape}")
  devices = list(jax.devices() if devices is None else devices)
  if math.prod(shape) != len(devices):
    raise ValueError(f"mesh shape {shape} needs {math.prod(shape)} devices, "
                     f"there are {len(devices)}")
  return Mesh(np.asarray(devices, dtype=object).reshape(shape), axis_names)


def initialize_distributed() -> bool:
  """Joins a multi-process run; call before any other JAX call.

  Initializes when `JAX_COORDINATOR_ADDRESS` is set (with `JAX_NUM_PROCESSES`
  and `JAX_PROCESS_ID`), or under SLURM / Open MPI with several tasks (JAX
  detects those itself). A plain single process is left alone.
  Returns:
    True when `jax.distributed.initialize` was called.
  """
  env = os.environ
  if env.get("JAX_COORDINATOR_ADDRESS"):
    for name in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
      if name not in env:
        raise ValueError(f"JAX_COORDINATOR_ADDRESS is set but {name} is not")
    jax.distributed.initialize(
        coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(env["JAX_NUM_PROCESSES"]),
        process_id=int(env["JAX_PROCESS_ID"]))
    return True
  if (int(env.get("SLURM_NTASKS", "1")) > 1 or
      int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1):
    jax.distributed.initialize()
    return True
  return False


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
  """The table resolved for one model on one mesh (hashable: a static jit
  argument).

  Build with `plan(config, mesh)`. `axes` maps each logical axis to the mesh
  axes it is sharded over (empty tuple: replicated).
  """

  mesh: Mesh
  config: ModelConfig
  axes: tuple[tuple[str, tuple[str, ...]], ...]

  @property
  def table(self) -> dict[str, tuple[str, ...]]:
    return dict(self.axes)

  def axis_size(self, mesh_axes: tuple[str, ...]) -> int:
    return math.prod(self.mesh.shape[a] for a in mesh_axes)

  # ---- specs and shardings ------------------------------------------------
  def spec(self, logical: Sequence[str | None],
           shape: Sequence[int] | None = None,
           what: str = "array") -> PartitionSpec:
    """PartitionSpec for an array whose dimensions are named `logical`.

    With `shape`, raises ValueError when a sharded dimension is not
    divisible by its mesh axes (naming the logical and mesh axes and the
    numbers).
    """
    table = self.table
    parts = []
    for d, name in enumerate(logical):
      axes = table.get(name, ()) if name is not None else ()
      if shape is not None and axes:
        size = self.axis_size(axes)
        if shape[d] % size:
          names = axes[0] if len(axes) == 1 else axes
          raise ValueError(
              f"{what}: mesh axis {names!r} (size {size}) does not divide "
              f"the {name} dimension ({shape[d]}) of shape {tuple(shape)}")
      parts.append(None if not axes else
                   (axes[0] if len(axes) == 1 else axes))
    return PartitionSpec(*parts)

  def sharding(self, logical, shape=None, what="array") -> NamedSharding:
    return NamedSharding(self.mesh, self.spec(logical, shape, what))

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  def param_shardings(self, params) -> Any:
    """NamedSharding for every leaf of a params pytree (arrays or
    ShapeDtypeStructs), from `param_axes`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, axes, leaf: self.sharding(
            axes, leaf.shape, f"param {jax.tree_util.keystr(path)}"),
        param_axes(params), params, is_leaf=_is_axes)

  def cache_shardings(self, cache) -> Any:
    """NamedSharding for every leaf of a cache (same pytree structure)."""
    axes = cache_axes(cache)
    return jax.tree_util.tree_map(
        lambda ax, leaf: self.sharding(ax, leaf.shape, "cache"), axes, cache,
        is_leaf=_is_axes)

  # ---- checks ------------------------------------------------------------
  def check_batch(self, batch: int) -> None:
    """Raises ValueError unless the batch mesh axes divide `batch`."""
    axes = self.table.get("batch", ())
    size = self.axis_size(axes)
    if batch % size:
      names = axes[0] if len(axes) == 1 else axes
      raise ValueError(f"mesh axis {names!r} (size {size}) does not divide "
                       f"the batch size {batch}")

  def check_config(self, config: ModelConfig) -> None:
    if config != self.config:
      raise ValueError("the sharding plan was built for another ModelConfig;"
                       " build it with sharding.plan(config, mesh)")

  # ---- placement ---------------------------------------------------------
  def put(self, x, logical, what="array") -> jax.Array:
    """Places an array (host or device, PRNG keys too) with the sharding of
    `logical` (see `place`)."""
    return place(x, self.sharding(logical, np.shape(x), what))

  def put_params(self, params) -> Any:
    return jax.tree_util.tree_map(place, params, self.param_shardings(params))

  def put_cache(self, cache) -> Any:
    return jax.tree_util.tree_map(place, cache, self.cache_shardings(cache))

  def init_params(self, key: jax.Array) -> Any:
    """`kvjax.params.init_params`, created directly in its shards (no
    device ever holds the whole model)."""
    init = lambda k: params_lib.init_params(self.config, k)
    shapes = jax.eval_shape(init, key)
    return jax.jit(init, out_shardings=self.param_shardings(shapes))(key)

  def init_cache(self, batch: int, capacity: int, dtype=None,
                 policy: cache_lib.CachePolicy | None = None):
    """`cache.init_cache`, created directly in its shards."""
    self.check_batch(batch)
    make = lambda: cache_lib.init_cache(self.config, batch, capacity, dtype,
                                        policy)
    shapes = jax.eval_shape(make)
    return jax.jit(make, out_shardings=self.cache_shardings(shapes))()

  # ---- inside jit --------------------------------------------------------
  def constrain(self, x, logical):
    return jax.lax.with_sharding_constraint(x, self.sharding(logical,
                                                             x.shape))

  def constrain_cache(self, cache):
    """Pins a cache to the plan (used on the caches jitted bodies return, so
    a step's output sharding is the next step's input sharding)."""
    return jax.lax.with_sharding_constraint(cache,
                                            self.cache_shardings(cache))


def plan(config: ModelConfig, mesh: Mesh, rules=RULES,
         kv_fallback: str = "seq") -> ShardingPlan:
  """Resolves the logical-axis table for `config` on `mesh`.

  Args:
    config: the model.
    mesh: a `jax.sharding.Mesh` (see `make_mesh`) of any shape.
    rules: (logical axis, mesh axes) pairs; defaults to `RULES`.
    kv_fallback: when the kv-head mesh axes do not divide K (MQA, MLA's
      single latent, GQA with K < model size): 'seq' shards the cache slots
      over them instead (default), 'replicate' copies the kv heads / latent
      to every model shard.
  Returns:
    a ShardingPlan.
  Raises:
    ValueError: a rule names an unknown mesh axis, a mesh axis is used twice
      by one logical axis, or the mesh does not divide the query heads or the
      MLP hidden size.
  """
  if kv_fallback not in KV_FALLBACKS:
    raise ValueError(f"kv_fallback={kv_fallback!r} is not one of "
                     f"{KV_FALLBACKS}")
  table = {}
  for logical, mesh_axes in rules:
    axes = _as_tuple(mesh_axes)
    unknown = [a for a in axes if a not in MESH_AXES and
               a not in mesh.axis_names]
    if unknown:
      raise ValueError(f"rule {logical!r} -> {mesh_axes!r} names mesh axes "
                       f"{unknown} that are neither {MESH_AXES} nor in the "
                       f"mesh {mesh.axis_names}")
    if len(set(axes)) != len(axes):
      raise ValueError(f"rule {logical!r} uses a mesh axis twice: {axes}")
    # Axes the mesh lacks, and axes of size 1, shard nothing.
    table[logical] = tuple(a for a in axes if a in mesh.axis_names and
                           mesh.shape[a] > 1)

  size = lambda axes: math.prod(mesh.shape[a] for a in axes)
  strict = [("heads", config.num_heads, "num_heads"),
            ("mlp", config.mlp_dim, "mlp_dim")]
  for logical, dim, field in strict:
    axes = table.get(logical, ())
    if dim % size(axes):
      names = axes[0] if len(axes) == 1 else axes
      raise ValueError(
          f"mesh axis {names!r} (size {size(axes)}) does not divide "
          f"{field}={dim} (logical axis {logical!r}); choose a mesh whose "
          f"{names!r} size divides {dim}")
  kv = table.get("kv_heads", ())
  if config.kv_heads % size(kv):
    table["kv_heads"] = ()
    if kv_fallback == "seq":
      seq = table.get("cache_seq", ())
      table["cache_seq"] = seq + tuple(a for a in kv if a not in seq)
  if config.vocab_size % size(table.get("vocab", ())):
    table["vocab"] = ()
  return ShardingPlan(mesh=mesh, config=config, axes=tuple(table.items()))


def describe(p: ShardingPlan) -> dict[str, str]:
  """The resolved table as strings, for logs and JSON."""
  return {k: ("x".join(v) if v else "replicated") for k, v in p.axes}


def shard_bytes(tree) -> dict[str, int]:
  """Bytes of a pytree of arrays: `total` (global) and `per_device` (the
  largest sum over one device's shards)."""
  total = 0
  per_device: dict[Any, int] = {}
  for leaf in jax.tree_util.tree_leaves(tree):
    total += leaf.size * leaf.dtype.itemsize
    shard = math.prod(leaf.sharding.shard_shape(leaf.shape))
    for s in leaf.addressable_shards:
      per_device[s.device] = per_device.get(s.device, 0) + (
          shard * leaf.dtype.itemsize)
  return dict(total=int(total), per_device=int(max(per_device.values())))


_HLO_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
                    "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
                    "s64": 8, "u64": 8, "f64": 8}
_COLLECTIVES = ("all-reduce", "all-gather", "all-to-all",
                "collective-permute", "reduce-scatter")


def collective_stats(compiled_text: str) -> dict[str, dict[str, int]]:
  """The collectives GSPMD inserted, from compiled HLO text (`.as_text()` of
  a compiled function): per op kind, how many appear in the program, the
  bytes of their results and the largest single result (an op inside a loop
  body is counted once).

  Returns:
    {op: {"count": n, "bytes": b, "max_bytes": m}} for every op kind that
    occurs.
  """
  stats: dict[str, dict[str, int]] = {}
  for line in compiled_text.splitlines():
    if "=" not in line:
      continue
    lhs, rhs = line.split("=", 1)
    for op in _COLLECTIVES:
      if re.search(rf"\b{op}(-start)?\(", rhs):
        result_type = rhs.split(f" {op}", 1)[0]
        nbytes = 0
        for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]",
                                      result_type):
          n = math.prod(int(d) for d in dims.split(",") if d)
          nbytes += n * _HLO_DTYPE_BYTES.get(dtype, 4)
        entry = stats.setdefault(op, dict(count=0, bytes=0, max_bytes=0))
        entry["count"] += 1
        entry["bytes"] += nbytes
        entry["max_bytes"] = max(entry["max_bytes"], nbytes)
        break
    del lhs
  return stats


__all__ = ["MESH_AXES", "RULES", "PARAM_AXES", "ShardingPlan", "plan",
           "param_axes", "place", "make_mesh", "initialize_distributed", "cache_axes", "describe",
           "shard_bytes", "collective_stats"]
