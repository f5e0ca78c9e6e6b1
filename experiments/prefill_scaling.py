r"""Prefill throughput against prompt length, and what a long prefill holds.

  python experiments/prefill_scaling.py --workdir=workdir/prefill_scaling
  python experiments/prefill_scaling.py --config=configs/model.py:mla-medium \
      --lengths=128,1024,4096 --memory_lengths=32768 --workdir=/tmp/p

Times the jitted prefill (`kvjax.prefill`'s body, the default params
layout) of --batch prompts of each length into a fresh cache
(`benchmarking.prefill_scaling`: medians of --repeats) and reads XLA's
memory analysis of the prefills at --memory_lengths with dense and with
tiled attention (`kvjax.flash`; compiled from shapes only) and of the last
--chunk tokens of a chunked prefill at --chunk_memory_lengths (what
`kvjax.prefill_chunked` holds at most), and times both
paths side by side at --path_lengths (what sets `flash.MIN_PAIRS`). Prints
tokens/s per length relative to the shortest; writes
prefill_scaling.json (with the CPU model) and prefill_scaling.png to
--workdir.
"""

import json
import os

from absl import flags
import jax

import kvjax
from kvjax import cli
from kvjax import configs
from kvjax.lab import benchmarking as bm
from configs import model as model_presets

_CONFIG = cli.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs",
                           "model.py:gqa-medium"),
    "Model preset (random weights).", presets=model_presets.PRESETS)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.",
                               required=True)
_BATCH = flags.DEFINE_integer("batch", 1, "Prompts per prefill.",
                              lower_bound=1)
_LENGTHS = cli.DEFINE_int_list("lengths", [128, 512, 1024, 2048, 4096],
                               "Prompt lengths timed.", lower_bound=1)
_MEMORY = cli.DEFINE_int_list("memory_lengths", [4096, 32768],
                              "Prompt lengths whose memory is analysed.",
                              lower_bound=1, allow_empty=True)
_PATHS = cli.DEFINE_int_list(
    "path_lengths", [1024, 2048, 4096, 8192],
    "Prompt lengths whose prefill runs with dense and with tiled attention "
    "side by side (alternating rounds).", lower_bound=1, allow_empty=True)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed prefills per length.",
                                lower_bound=1)
_CHUNK = flags.DEFINE_integer("chunk", 2048, "Chunk of the chunked prefills "
                              "whose memory is analysed.", lower_bound=1)
_CHUNK_MEMORY = cli.DEFINE_int_list(
    "chunk_memory_lengths", [8192, 16384, 32768],
    "Prompt lengths whose chunked prefill's last chunk is analysed "
    "(`benchmarking.chunk_memory`).", lower_bound=1, allow_empty=True)


def main(argv):
  del argv
  cfg = _CONFIG.value
  config = configs.model_config(cfg.model)
  longest = max(_LENGTHS.value + _MEMORY.value + _PATHS.value +
                _CHUNK_MEMORY.value)
  if longest > config.max_seq_len:
    config = kvjax.ModelConfig.from_dict(
        dict(config.to_dict(), max_seq_len=longest))
  params = kvjax.init_params(config, jax.random.key(0))
  out = bm.prefill_scaling(params, config, _BATCH.value, _LENGTHS.value,
                           _MEMORY.value, repeats=_REPEATS.value)
  out["paths"] = [dict(length=n, **bm.prefill_paths(
      params, config, _BATCH.value, n, repeats=_REPEATS.value))
                  for n in _PATHS.value]
  out["chunk_memory"] = [dict(length=n, chunk=_CHUNK.value, **bm.chunk_memory(
      params, config, _BATCH.value, n, _CHUNK.value))
                         for n in _CHUNK_MEMORY.value]
  out.update(preset=cfg.preset, host=bm.machine_info(),
             revision=bm.revision(os.path.dirname(os.path.abspath(__file__))))
  os.makedirs(_WORKDIR.value, exist_ok=True)
  out["figure"] = bm.plot_prefill(
      out, f"{cfg.preset} prefill, {bm.cpu_model()}",
      os.path.join(_WORKDIR.value, "prefill_scaling.png"))
  with open(os.path.join(_WORKDIR.value, "prefill_scaling.json"), "w") as f:
    json.dump(out, f, indent=1)
  print(f"{cfg.preset}, batch {_BATCH.value}, {bm.cpu_model()}")
  for r in out["rows"]:
    print(f"  {r['length']:>6} tokens: {r['tokens_per_s']:8.1f} tok/s "
          f"({r['relative']:.2f} of {out['rows'][0]['length']})")
  for p in out["paths"]:
    d, t = p["dense"], p["tiled"]
    ratio = t["tokens_per_s"] / d["tokens_per_s"]
    print(f"  {p['length']:>6} tokens: dense {d['tokens_per_s']:8.1f} tok/s, "
          f"tiled {t['tokens_per_s']:8.1f} tok/s ({ratio:.2f}x; default: "
          f"{p['chosen']})")
  for m in out["memory"]:
    print(f"  {m['length']:>6} tokens, {m['path']:>5}: temporaries "
          f"{m['temporaries'] / 2**20:.0f} MiB (XLA memory analysis)")
  for m in out["chunk_memory"]:
    print(f"  {m['length']:>6} tokens in chunks of {m['chunk']}: the last "
          f"chunk's temporaries {m['temporaries'] / 2**20:.0f} MiB, cache "
          f"{m['outputs'] / 2**20:.0f} MiB (XLA memory analysis)")


if __name__ == "__main__":
  cli.run(main)
