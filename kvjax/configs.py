"""The script edge: ml_collections ConfigDicts → frozen library objects."""

from __future__ import annotations

import ast

import ml_collections

from kvjax.cache import CachePolicy
from kvjax.config import ModelConfig
from kvjax.sampling import Sampler


def model_config(cfg: ml_collections.ConfigDict) -> ModelConfig:
  """ModelConfig from a ConfigDict's `model` section (unknown keys raise)."""
  return ModelConfig.from_dict(cfg.to_dict())


def cache_policy(cfg: ml_collections.ConfigDict) -> CachePolicy:
  """CachePolicy from a ConfigDict's `cache` section (`capacity` aside).

  `options` (the eviction policy's own options, `kvjax.policies`) is a
  dict or a "key=value,key=value" string (values parsed as Python
  literals when they are, else kept as strings), so that a command line
  can set it: `--config.cache.options=window=16,scope=head`.
  """
  d = cfg.to_dict()
  d.pop("capacity", None)
  d["options"] = tuple(sorted(parse_options(d.get("options") or {}).items()))
  return CachePolicy(**d)


def parse_options(options) -> dict:
  """A dict of policy options from a dict or a "k=v,k=v" string.

  Raises:
    ValueError: an item without '='.
  """
  if isinstance(options, dict):
    return dict(options)
  out = {}
  for item in filter(None, (s.strip() for s in str(options).split(","))):
    key, eq, value = item.partition("=")
    if not eq or not key.strip():
      raise ValueError(f"cache.options item {item!r} is not key=value")
    try:
      out[key.strip()] = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      out[key.strip()] = value.strip()
  return out


def sampler(cfg: ml_collections.ConfigDict) -> Sampler:
  """Sampler from a ConfigDict's `generate` section (top_k 0 = off: a
  ConfigDict field keeps one type, so 0 stands for the library's None)."""
  return Sampler(temperature=cfg.temperature, top_k=cfg.top_k or None,
                 top_p=cfg.top_p)
