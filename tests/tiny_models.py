"""The tiny test models shared by the test files (one definition)."""

import functools

import jax

import kvjax
from configs import model as model_presets

VARIANTS = model_presets.VARIANTS


@functools.lru_cache(maxsize=None)
def tiny(variant: str) -> kvjax.ModelConfig:
  """The `tiny` preset of `variant`, with a larger init scale than the
  default: wide greedy top-1/top-2 gaps, so token equality checks are not
  decided by float rounding."""
  return kvjax.ModelConfig.from_dict(
      dict(model_presets.model_dict(variant, "tiny"), init_scale=0.15))


@functools.lru_cache(maxsize=None)
def tiny_params(variant: str):
  return kvjax.init_params(tiny(variant), jax.random.key(0))
