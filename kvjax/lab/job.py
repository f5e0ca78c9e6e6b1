"""The main job: load or build a model, generate with the KV cache, measure
prefill and decode, account for the cache's bytes, and verify the cached
tokens against the no-cache recompute.

`experiments/generate.py` is a thin absl main over `run`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import numpy as np

from kvjax import cache as cache_lib
from kvjax import inference
from kvjax import packed
from kvjax import params as params_lib
from kvjax import projections
from kvjax.config import ModelConfig
from kvjax.lab import benchmarking
from kvjax.sampling import Sampler
from kvjax.validate import check_int

# The small byte-level model trained by `experiments/train.py` and shipped
# with the repository (see WORKSPACE.md for the command that produced it).
SHIPPED_MODEL = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))), "checkpoints", "austen-gqa")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  config: ModelConfig
  params: Any
  source: str
  byte_level: bool  # prompts are text encoded with `kvjax.data`


def load_model(*, checkpoint: str = "", trained: str = "",
               config: ModelConfig | None = None, seed: int = 0
               ) -> LoadedModel:
  """A Hugging Face checkpoint dir, a kvjax training workdir, or random init.

  Args:
    checkpoint: Hugging Face directory (config.json + *.safetensors).
    trained: a kvjax training workdir (`experiments/train.py --workdir`).
    config: used for a seeded random init when neither path is given.
  """
  if checkpoint:
    from kvjax import hf  # pylint: disable=g-import-not-at-top
    cfg, params = hf.load_checkpoint(checkpoint)
    return LoadedModel(cfg, params, f"hf:{checkpoint}", False)
  if trained:
    from kvjax import orbax_checkpoint  # pylint: disable=g-import-not-at-top
    cfg, params = orbax_checkpoint.restore_params(trained)
    return LoadedModel(cfg, params, f"trained:{trained}", True)
  if config is None:
    raise ValueError("give a checkpoint, a trained workdir or a config")
  params = params_lib.init_params(config, jax.random.key(seed))
  return LoadedModel(config, params, f"random(seed={seed})", False)


def prompt_tokens(loaded: LoadedModel, *, text: str, batch: int,
                  prompt_len: int, seed: int) -> np.ndarray:
  """[B, T] prompt ids: the encoded text for byte-level models, else seeded
  random ids of length `prompt_len`."""
  if loaded.byte_level and text:
    from kvjax import data  # pylint: disable=g-import-not-at-top
    ids = data.encode(text)
    return np.tile(ids[None], (batch, 1)).astype(np.int32)
  rng = np.random.default_rng(seed)
  return rng.integers(0, loaded.config.vocab_size, (batch, prompt_len),
                      dtype=np.int32)


def check_request(*, max_new_tokens: int, batch: int, prompt_len: int,
                  policy: cache_lib.CachePolicy | None = None,
                  capacity: int = 0, verify_steps: int = 0, seed: int = 0,
                  max_seq_len: int = 0) -> None:
  """Refuses a request `run` cannot serve, on the host, before anything is
  loaded or compiled.

  Args:
    prompt_len: T, the prompt's tokens.
    capacity: cache slots (0: `run` picks the default).
    max_seq_len: the model's limit, when known (0: not checked).
  Raises:
    ValueError naming the field: a count out of range, a capacity the
    policy refuses, or a prompt plus new tokens that overflow a cache
    without eviction or the model's max_seq_len.
  """
  check_int("max_new_tokens", max_new_tokens, 1)
  check_int("batch", batch, 1)
  check_int("prompt_len", prompt_len, 1)
  check_int("capacity", capacity, 0)
  check_int("verify_steps", verify_steps, 0)
  check_int("seed", seed, 0)
  policy = policy or cache_lib.CachePolicy()
  if capacity:
    policy.validate_capacity(capacity)
    # The last token is sampled, never written: T + new - 1 slots.
    if not policy.bounded and prompt_len + max_new_tokens - 1 > capacity:
      raise ValueError(
          f"capacity={capacity} holds fewer than the {prompt_len}-token "
          f"prompt + {max_new_tokens} new tokens - 1 and eviction='none'; "
          "raise capacity (0: enough) or choose an eviction")
  if (max_seq_len and policy.positions != "cache" and
      prompt_len + max_new_tokens > max_seq_len):
    raise ValueError(f"max_new_tokens={max_new_tokens}: the {prompt_len}-"
                     f"token prompt + {max_new_tokens} new tokens exceed the "
                     f"model's max_seq_len={max_seq_len}")


def run(loaded: LoadedModel, tokens: np.ndarray, *, max_new_tokens: int,
        policy: cache_lib.CachePolicy, capacity: int = 0,
        sampler: Sampler = Sampler(), seed: int = 0, verify_steps: int = 0,
        repeats: int = 3, shardings=None) -> dict[str, Any]:
  """Generates, times and verifies. Returns a JSON-able report.

  `shardings` (a `kvjax.sharding.ShardingPlan`) runs prefill and generate
  under its mesh; params are placed by it first. The params run as loaded:
  the inference calls choose their decode layout (`packed.for_decode`), and
  the report says which (`layout`).

  Timing: prefill alone and the whole `generate` (prefill + lax.scan decode)
  are each compiled once, then timed `repeats` times (median); decode
  tokens/s = (max_new_tokens − 1) / (generate − prefill), since the first
  token comes from the prefill logits.
  """
  cfg = loaded.config
  B, T = tokens.shape
  check_request(max_new_tokens=max_new_tokens, batch=B, prompt_len=T,
                policy=policy, capacity=capacity, verify_steps=verify_steps,
                seed=seed, max_seq_len=cfg.max_seq_len)
  params = packed.for_decode(loaded.params, cfg)
  layout = "packed" if projections.is_packed(params) else "scan"
  if shardings is not None:
    params = shardings.put_params(params)
  capacity = capacity or inference.default_capacity(
      inference.bucket_length(T), max_new_tokens)
  rng = jax.random.key(seed)

  def gen():
    return inference.generate(params, cfg, tokens, max_new_tokens,
                              sampler=sampler, rng=rng, capacity=capacity,
                              policy=policy, return_cache=True,
                              shardings=shardings)

  def pre():
    if shardings is None:
      cache = cache_lib.init_cache(cfg, B, capacity, policy=policy)
    else:
      cache = shardings.init_cache(B, capacity, policy=policy)
    return inference.prefill(params, cfg, tokens, cache, shardings=shardings)

  t0 = time.perf_counter()
  jax.block_until_ready(pre())
  compile_prefill = time.perf_counter() - t0
  t0 = time.perf_counter()
  jax.block_until_ready(gen())
  compile_generate = time.perf_counter() - t0
  t_prefill = benchmarking.time_fn(pre, warmup=1, repeats=repeats).median
  t_generate = benchmarking.time_fn(gen, warmup=0, repeats=repeats).median
  ids, _, cache = gen()
  decode_time = max(t_generate - t_prefill, 1e-9)
  bytes_ = cache_lib.cache_bytes(cache)
  report = dict(
      source=loaded.source, variant=cfg.variant, batch=B, prompt_len=T,
      max_new_tokens=max_new_tokens, capacity=capacity, layout=layout,
      policy=dataclasses.asdict(policy),
      ids=np.asarray(ids).tolist(),
      first_call_prefill_s=compile_prefill,
      first_call_generate_s=compile_generate,
      prefill_s=t_prefill, generate_s=t_generate,
      decode_tokens_per_s=B * (max_new_tokens - 1) / decode_time,
      decode_ms_per_step=1e3 * decode_time / max(max_new_tokens - 1, 1),
      cache_total_bytes=bytes_["total"], cache_kv_bytes=bytes_["kv"],
      cache_used_bytes=bytes_["used"],
      kv_bytes_per_token=cache_lib.kv_bytes_per_token(
          cfg, policy.kv_dtype,
          key_group=policy.key_group if policy.channel_keys else 0),
  )
  if loaded.byte_level:
    from kvjax import data  # pylint: disable=g-import-not-at-top
    report["prompt_text"] = data.decode(np.asarray(tokens)[0])
    report["text"] = [data.decode(row) for row in np.asarray(ids)]
  if verify_steps:
    n = min(verify_steps, max_new_tokens)
    if policy.bounded:
      # Past the capacity an evicting cache legitimately differs from the
      # full recompute: verify only the steps before the first eviction.
      n = max(1, min(n, capacity - T + 1))
    ref = inference.generate_no_cache(params, cfg, tokens, n, sampler=sampler,
                                      rng=rng)
    cached = inference.generate(params, cfg, tokens, n, sampler=sampler,
                                rng=rng, capacity=capacity, policy=policy)
    report["verify_steps"] = n
    report["verify_equal"] = bool(np.array_equal(np.asarray(ref),
                                                 np.asarray(cached)))
  return report


def format_report(r: dict[str, Any]) -> str:
  mib = 2 ** 20
  lines = [
      f"model        {r['source']}  ({r['variant']}, {r['layout']} params)",
      f"batch        {r['batch']} × prompt {r['prompt_len']} → "
      f"{r['max_new_tokens']} new tokens, capacity {r['capacity']}, "
      f"eviction {r['policy']['eviction']}"
      + (f" (positions {r['policy']['positions']})"
         if r['policy']['eviction'] != "none" else "")
      + f", kv {r['policy']['kv_dtype']}"
      + (f" (keys per channel, groups of {r['policy']['key_group']})"
         if r['policy']['key_quant'] == "channel" else ""),
      f"prefill      {1e3 * r['prefill_s']:.1f} ms "
      f"(first call incl. compile {r['first_call_prefill_s']:.2f} s)",
      f"decode       {r['decode_tokens_per_s']:.1f} tokens/s "
      f"({r['decode_ms_per_step']:.2f} ms/step; first generate call "
      f"{r['first_call_generate_s']:.2f} s)",
      f"cache        {r['cache_total_bytes'] / mib:.2f} MiB total, "
      f"{r['cache_used_bytes'] / mib:.2f} MiB used, "
      f"{r['kv_bytes_per_token']} bytes/token/sequence",
  ]
  if "verify_steps" in r:
    verdict = "EQUAL" if r["verify_equal"] else "DIFFERENT"
    lines.append(f"verify       first {r['verify_steps']} cached tokens vs "
                 f"no-cache recompute: {verdict}")
  if "text" in r:
    lines.append(f"prompt       {r['prompt_text']!r}")
    for i, t in enumerate(r["text"]):
      lines.append(f"text[{i}]      {t!r}")
  else:
    for i, row in enumerate(r["ids"][:4]):
      lines.append(f"ids[{i}]       {row[:32]}{' ...' if len(row) > 32 else ''}")
  return "\n".join(lines)
