"""The script edge: ml_collections ConfigDicts → frozen library objects."""

from __future__ import annotations

import ml_collections

from kvjax.cache import CachePolicy
from kvjax.config import ModelConfig
from kvjax.sampling import Sampler


def model_config(cfg: ml_collections.ConfigDict) -> ModelConfig:
  """ModelConfig from a ConfigDict's `model` section (unknown keys raise)."""
  return ModelConfig.from_dict(cfg.to_dict())


def cache_policy(cfg: ml_collections.ConfigDict) -> CachePolicy:
  """CachePolicy from a ConfigDict's `cache` section (`capacity` aside)."""
  d = cfg.to_dict()
  d.pop("capacity", None)
  return CachePolicy(**d)


def sampler(cfg: ml_collections.ConfigDict) -> Sampler:
  """Sampler from a ConfigDict's `generate` section (top_k 0 = off: a
  ConfigDict field keeps one type, so 0 stands for the library's None)."""
  return Sampler(temperature=cfg.temperature, top_k=cfg.top_k or None,
                 top_p=cfg.top_p)
