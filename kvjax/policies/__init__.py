"""Eviction policies, registered by name (see `kvjax.policies.base` for the
protocol). A new policy is one file here plus one line in `REGISTRY`.

  none     no eviction (overflow is an error)
  window   the newest `capacity` tokens
  sinks    the first `num_sinks` tokens + a window (StreamingLLM)
  h2o      accumulated attention + a recent window (H2O)
  tova     the latest query's attention (TOVA)
  knorm    key L2 norms, no attention needed (Knorm)
  snapkv   prompt compression by an observation window (SnapKV)
  pyramid  per-layer budgets around a scored policy (PyramidKV)
  adakv    per-head budgets around a scored policy (AdaKV)
  keydiff  keys least like the mean key, no attention needed (KeyDiff)
"""

from __future__ import annotations

from kvjax.policies.adakv import AdaKV
from kvjax.policies.base import (NEEDS, SCOPES, Policy, Positional, Scored)
from kvjax.policies.h2o import H2O
from kvjax.policies.keydiff import KeyDiff
from kvjax.policies.knorm import Knorm
from kvjax.policies.none import NoEviction
from kvjax.policies.pyramid import Pyramid
from kvjax.policies.sinks import Sinks
from kvjax.policies.snapkv import SnapKV
from kvjax.policies.tova import TOVA
from kvjax.policies.window import Window

REGISTRY: dict[str, type[Policy]] = {
    "none": NoEviction,
    "window": Window,
    "sinks": Sinks,
    "h2o": H2O,
    "tova": TOVA,
    "knorm": Knorm,
    "snapkv": SnapKV,
    "pyramid": Pyramid,
    "adakv": AdaKV,
    "keydiff": KeyDiff,
}


def make(name: str, **options) -> Policy:
  """The policy registered as `name`, built with `options`.

  Raises:
    ValueError: an unknown name (the message lists the registered ones) or
      an unknown or invalid option.
  """
  if isinstance(name, Policy):
    if options:
      raise ValueError(f"options {sorted(options)} given with a policy "
                       f"object {name!r}")
    return name
  cls = REGISTRY.get(name)
  if cls is None:
    raise ValueError(f"eviction={name!r} is not one of {tuple(REGISTRY)}")
  import dataclasses  # pylint: disable=g-import-not-at-top
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(options) - fields)
  if unknown:
    raise ValueError(f"eviction {name!r} has no option {unknown}; its "
                     f"options are {sorted(fields)}")
  return cls(**options)


__all__ = ["REGISTRY", "make", "Policy", "Positional", "Scored", "SCOPES",
           "NEEDS", "NoEviction", "Window", "Sinks", "H2O", "TOVA", "Knorm",
           "SnapKV", "Pyramid", "AdaKV", "KeyDiff"]
