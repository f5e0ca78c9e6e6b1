r"""Cache memory against tokens, read from real cache arrays.

For each attention variant (MHA / MQA / GQA / MLA presets of
configs/model.py) a random-weight model decodes a stream token by token
twice: into an unbounded cache (eviction='none') and into a bounded one
(default: 4 attention sinks + window, S slots). After every --every tokens
the bytes of the slots that hold a token are read from the cache itself
(`kvjax.cache_bytes`). The unbounded lines grow linearly with a slope of
`kv_bytes_per_token`; the bounded ones stop at S tokens: the cap.

  python experiments/memory_growth.py --workdir=workdir/memory

Prints the table on stdout. Outputs in --workdir: memory.jsonl (one line per
finished trace, written as it finishes), memory.json, memory.png.
"""

import json
import os

from absl import flags
from absl import logging
import jax
import numpy as np

import kvjax
from kvjax import cli
from kvjax import configs
from kvjax.lab import streaming
from configs import model as presets

_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.",
                               required=True)
_SIZE = flags.DEFINE_enum("size", "small", ["tiny", "small", "medium"],
                          "Preset size of configs/model.py.")
_VARIANTS = cli.DEFINE_choice_list("variants", list(presets.VARIANTS),
                                   presets.VARIANTS, "Attention variants.")
_POLICY = flags.DEFINE_string(
    "policy", "sinks4", "Bounded policy (a streaming.parse_policy name: "
    "window, sinks<n>, h2o, with ':original' / ':cache').")
_CAPACITY = flags.DEFINE_integer("capacity", 512, "Slots S of the bounded "
                                 "cache.", lower_bound=1)
_TOKENS = flags.DEFINE_integer("tokens", 2048, "Tokens fed per sequence.",
                               lower_bound=1)
_EVERY = flags.DEFINE_integer("every", 64, "Record every this many tokens.",
                              lower_bound=1)
_BATCH = flags.DEFINE_integer("batch", 1, "Sequences (B).", lower_bound=1)


def _preset(variant: str, size: str) -> kvjax.ModelConfig:
  return configs.model_config(presets.get_config(f"{variant}-{size}").model)


def main(argv):
  del argv
  n, cap, b = _TOKENS.value, _CAPACITY.value, _BATCH.value
  with cli.checking(f"--policy={_POLICY.value}"):
    bounded = streaming.parse_policy(_POLICY.value, cap, n)
    if bounded.policy is None or not bounded.policy.bounded:
      raise ValueError("must be a bounded cache policy (window, sinks<n>, "
                       "h2o)")
  rng = np.random.default_rng(0)
  traces, summary = {}, []
  partial = cli.JsonLines(os.path.join(_WORKDIR.value, "memory.jsonl"))
  total = 2 * len(_VARIANTS.value)
  for variant in _VARIANTS.value:
    config = _preset(variant, _SIZE.value)
    params = kvjax.init_params(config, jax.random.key(0))
    tokens = rng.integers(0, config.vocab_size, size=(b, n)).astype(np.int32)
    per_token = kvjax.kv_bytes_per_token(config)
    for label, policy, slots in (
        (f"{config.variant} unbounded", kvjax.CachePolicy(), n),
        (f"{config.variant} {_POLICY.value}", bounded.policy, cap)):
      cache = kvjax.init_cache(config, b, slots, policy=policy)
      trace, _ = streaming.memory_trace(params, config, tokens, cache,
                                        every=_EVERY.value)
      # The arrays must agree with the formula: bytes/token x held tokens.
      for r in trace:
        want = per_token * b * min(r["tokens"], slots)
        if r["used"] != want:
          raise AssertionError(f"{label}: {r['used']} bytes held after "
                               f"{r['tokens']} tokens, formula {want}")
      traces[label] = dict(variant=config.variant, bounded=policy.bounded,
                           trace=trace)
      summary.append(dict(label=label, variant=config.variant,
                          kv_bytes_per_token=per_token,
                          bytes_at_end=trace[-1]["used"],
                          allocated=trace[-1]["kv"], tokens=n, slots=slots))
      partial.write(dict(summary[-1], trace=trace))
      logging.info("[%d/%d] %s: %d B/token, %.2f MiB after %d tokens "
                   "(allocated %.2f MiB)", len(summary), total, label,
                   per_token, trace[-1]["used"] / 2**20, n,
                   trace[-1]["kv"] / 2**20)
  partial.close()
  print("| cache | bytes/token | MiB after %d tokens | allocated MiB |" % n)
  print("|---|---|---|---|")
  for s in summary:
    print(f"| {s['label']} | {s['kv_bytes_per_token']} | "
          f"{s['bytes_at_end'] / 2**20:.2f} | {s['allocated'] / 2**20:.2f} |")
  streaming.plot_memory(
      traces, os.path.join(_WORKDIR.value, "memory.png"), capacity=cap,
      title=f"KV cache bytes vs tokens, {_SIZE.value} presets, B={b}, "
      f"{_POLICY.value} at S={cap} (dashed) vs unbounded (solid)")
  with open(os.path.join(_WORKDIR.value, "memory.json"), "w") as f:
    json.dump(dict(size=_SIZE.value, policy=_POLICY.value, capacity=cap,
                   tokens=n, batch=b, summary=summary, traces=traces), f,
              indent=1)
  logging.info("wrote %s", _WORKDIR.value)


if __name__ == "__main__":
  cli.run(main)
