"""The params seams: which layout the inference entry points and the
training step run.

`for_decode(params, config)` returns `kvjax.params.pack(params, config)` (the
packed decode layout: fused, [out, in] weights, layers unrolled; its keys:
`kvjax.projections`) where that was measured to decode faster, else the
params as given. Every inference entry point calls it, so what
`init_params` or `load_checkpoint` hands back runs at full speed with no
flag.

`for_training(params, config)` is the same choice inside the traced
training step: the optimizer, its state and the checkpoints keep the
canonical layout, and the step's forward runs on the packed copy the
trace makes of them (its gradient flows back through the copy).
"""

from __future__ import annotations

import contextlib
import weakref

import jax

from kvjax.config import ModelConfig
from kvjax.params import pack
from kvjax.projections import is_packed

# The narrowest model measured to decode faster packed (gqa-small, D 256:
# 1.62x at batch 1, 1.33x at batch 8; gqa-medium 1.46x at batch 1; Intel
# Xeon, experiments/decode_layout.py, WORKSPACE.md "Params layout").
# Narrower models (the D 64 test presets) keep the layer scan: unmeasured,
# and their tests then exercise both layouts.
PACK_MIN_WIDTH = 256

# Canonical params packed by `for_decode`, keyed by the ids of their leaves:
# (weak references to those leaves, config, packed params). An entry dies
# with any of its canonical arrays.
_PACKED: dict[tuple[int, ...], tuple] = {}
_AS_GIVEN = [False]


@contextlib.contextmanager
def as_given():
  """Inside, `for_decode` returns params unchanged: for measuring the
  canonical layout against the packed one (experiments/decode_layout.py);
  nothing else should need it."""
  _AS_GIVEN.append(True)
  try:
    yield
  finally:
    _AS_GIVEN.pop()


def packs(params, config: ModelConfig) -> bool:
  """Whether `for_decode` packs these params: canonical stacked layers,
  concrete arrays (not tracers: packing inside a trace would transpose every
  weight on every call), on CPU, where packing was measured (elsewhere the
  layout is kept until a device run measures it), at embed_dim >=
  PACK_MIN_WIDTH."""
  if _AS_GIVEN[-1] or is_packed(params):
    return False
  leaves = jax.tree_util.tree_leaves(params)
  if any(isinstance(x, jax.core.Tracer) for x in leaves):
    return False
  leaf = leaves[0]
  platform = (next(iter(leaf.devices())).platform
              if isinstance(leaf, jax.Array) else jax.default_backend())
  return platform == "cpu" and config.embed_dim >= PACK_MIN_WIDTH


def for_decode(params, config: ModelConfig):
  """The params every inference entry point runs on (`generate`, `prefill`,
  `extend`, `decode_step`, the streaming drivers): `pack(params, config)`
  where `packs` says it decodes faster, else `params` as given. Same
  values either way (tests).

  Packed once per params: the packed copy is kept while the canonical
  arrays live (both are then in memory; call `kvjax.pack` yourself and
  drop the canonical params to hold one copy).
  """
  if not packs(params, config):
    return params
  leaves = jax.tree_util.tree_leaves(params)
  key = tuple(map(id, leaves))
  hit = _PACKED.get(key)
  if hit is not None:
    refs, cfg, out = hit
    if cfg == config and all(r() is x for r, x in zip(refs, leaves)):
      return out
  out = pack(params, config)
  drop = lambda _, key=key: _PACKED.pop(key, None)
  _PACKED[key] = (tuple(weakref.ref(x, drop) for x in leaves), config, out)
  return out


def for_training(params, config: ModelConfig):
  """The params the training forward runs on, inside the traced step:
  `pack(params, config)` on CPU at embed_dim >= PACK_MIN_WIDTH, else
  `params`.

  Why inside the trace (which `for_decode` refuses): a training step
  computes over B · T tokens, so copying the weights once per step is
  noise (gqa train config: 12 MB of weights against ~85 GFLOP), while the
  unrolled, fused layout removes the layer scan's per-layer slices and
  dynamic-update-slices of the gradients (with the causal query tiles:
  1.83x faster gqa steps, experiments/train_speed.py, WORKSPACE.md).
  """
  if (_AS_GIVEN[-1] or is_packed(params) or jax.default_backend() != "cpu"
      or config.embed_dim < PACK_MIN_WIDTH):
    return params
  return pack(params, config)
