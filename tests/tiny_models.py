"""The tiny test models shared by the test files (one definition)."""

import functools

import jax
import jax.numpy as jnp

import kvjax
from kvjax import decode
from kvjax import inference
from kvjax import model
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


@functools.partial(jax.jit, static_argnames=("config", "n_prompt"))
def _prefill_then_decode(params, config, tokens, cache, n_prompt):
  mask = jnp.ones((tokens.shape[0], n_prompt), bool)
  _, cache = model.prefill_logits(params, config, tokens[:, :n_prompt], mask,
                                  cache, False)

  def body(cache, tok_B):
    logits_BV, cache = model.decode_logits(params, config, tok_B, cache)
    return cache, logits_BV

  cache, logits_TBV = jax.lax.scan(body, cache, tokens[:, n_prompt:].T)
  return jnp.swapaxes(logits_TBV, 0, 1), cache


@functools.lru_cache(maxsize=None)
def teacher_forced_decode_logits(variant, kv_dtype, n_prompt=6, n_steps=6):
  """Decode logits [B, n_steps, V] over one fixed token sequence (one
  compiled program: prefill, then a scan of decode steps), and the cache."""
  config, params = tiny(variant), tiny_params(variant)
  tokens = jax.random.randint(jax.random.key(7), (2, n_prompt + n_steps), 0,
                              config.vocab_size)
  cache = kvjax.init_cache(config, 2, 16, dtype=kv_dtype)
  return _prefill_then_decode(params, config, tokens, cache, n_prompt)


def teacher_forced_layouts(variant, kv_dtype, batch, layouts=("stacked",
                                                             "layered"),
                           n_prompt=12, n_steps=40, capacity=64):
  """{layout: (cache, logits [n_steps, B, V])}: the same prompt prefilled,
  then `n_steps` given tokens fed through the one decode loop reading the
  cache in each layout (packed params; greedy tokens of a random model
  would flip on any rounding, so the tokens are given)."""
  config = tiny(variant)
  params = kvjax.pack(tiny_params(variant), config)
  prompt = jax.random.randint(jax.random.key(2), (batch, n_prompt), 0,
                              config.vocab_size)
  given = jax.random.randint(jax.random.key(3), (n_steps, batch), 0,
                             config.vocab_size)
  cache = kvjax.init_cache(config, batch, capacity,
                           policy=kvjax.CachePolicy(kv_dtype=kv_dtype))
  _, cache = inference.prefill(params, config, prompt, cache)
  out = {}
  for layout in layouts:
    plan = decode.Plan(((n_steps, capacity),), layout)
    _, c, logits = jax.jit(lambda c, plan=plan: decode.run(
        params, config, prompt[:, -1], c, given, plan=plan,
        choose=lambda logits, x: x,
        emit=lambda logits, *_: logits))(cache)
    out[layout] = (c, logits)
  return out
