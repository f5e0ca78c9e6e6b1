"""kvjax: functional JAX LLM inference with explicit, measurable KV caches."""

from kvjax.cache import (CachePolicy, KVCache, LatentCache, cache_bytes,
                         init_cache, kv_bytes_per_token)
from kvjax.config import MoEConfig, ModelConfig, RopeScaling
from kvjax.hf import load_checkpoint
from kvjax.inference import (decode_step, extend, forward, generate,
                             generate_no_cache, prefill, prefill_chunked)
from kvjax.params import init_params, pack, param_count
from kvjax.probe import attention_probs
from kvjax.sampling import GREEDY, Sampler

__all__ = [
    "CachePolicy", "KVCache", "LatentCache", "cache_bytes", "init_cache",
    "kv_bytes_per_token", "MoEConfig", "ModelConfig", "RopeScaling",
    "decode_step", "extend", "forward", "generate", "generate_no_cache",
    "prefill", "prefill_chunked", "init_params", "param_count", "GREEDY",
    "Sampler", "load_checkpoint", "pack", "attention_probs",
]
