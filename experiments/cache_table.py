r"""KV-cache size table: every kvjax preset and published models.

  python experiments/cache_table.py --workdir=workdir/cache_table

For each configuration: elements cached per token and layer, the GQA kv-head
count that would cache as much (DeepSeek-V2's "2.25 groups"), KV bytes per
token, the cache at each context length × batch, and the ratio to the same
model with MHA. Sizes come from `jax.eval_shape(kvjax.init_cache, ...)`:
nothing is allocated. Also recomputes DeepSeek-V2's −93.3% claim.

Prints the table (markdown) on stdout and writes cache_table.json,
cache_table.md and cache_table.png to --workdir.
"""

import importlib.util
import json
import os

from absl import flags

from kvjax import cache as cache_lib
from kvjax import cli
from kvjax import configs
from kvjax.lab import published

_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.",
                               required=True)
_PRESETS_FILE = flags.DEFINE_string(
    "presets_file", os.path.normpath(os.path.join(
        os.path.dirname(__file__), "..", "configs", "model.py")),
    "Config file whose PRESETS / get_config(preset) give the presets.")
_KV_DTYPE = flags.DEFINE_enum(
    "kv_dtype", "bfloat16", list(cache_lib.KV_DTYPES),
    "Cache storage dtype for every row (the published models serve bf16).")
_TOKENS = cli.DEFINE_int_list("tokens", [4096, 32768, 131072],
                              "Context lengths (cache slots per sequence).",
                              lower_bound=1)
_BATCHES = cli.DEFINE_int_list("batches", [1, 32], "Batch sizes.",
                               lower_bound=1)


def _presets(path: str):
  spec = importlib.util.spec_from_file_location("model_presets", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return {p: configs.model_config(module.get_config(p).model)
          for p in module.PRESETS}


def main(argv):
  del argv
  workdir = _WORKDIR.value
  kw = dict(tokens=_TOKENS.value, batches=_BATCHES.value,
            kv_dtype=_KV_DTYPE.value)
  with cli.checking(f"--presets_file={_PRESETS_FILE.value}"):
    if not os.path.isfile(_PRESETS_FILE.value):
      raise ValueError("no such file")
    presets = _presets(_PRESETS_FILE.value)
  os.makedirs(workdir, exist_ok=True)
  rows = published.table(dict(presets, **published.PUBLISHED), **kw)
  for r in rows:
    if r["bytes_per_token"] != r["bytes_per_token_eval_shape"]:
      raise AssertionError(f"{r['name']}: kv_bytes_per_token "
                           f"{r['bytes_per_token']} != eval_shape cache "
                           f"{r['bytes_per_token_eval_shape']}")
  claims = published.deepseek_v2_claims()
  md = published.markdown_table(rows) + "\n\n" + "\n".join(
      f"- {n}" for n in published.table_notes(rows))
  md += (
      "\n\nDeepSeek-V2 vs DeepSeek-67B (elements per token, all layers): "
      f"V2 {claims['v2_elements_per_token']}, 67B "
      f"{claims['dense_elements_per_token']} (GQA, "
      f"{claims['dense_kv_heads']} kv heads). MLA ≈ GQA with "
      f"{claims['equivalent_kv_heads']:g} kv heads; at equal precision V2 "
      f"caches {100 * claims['reduction_same_precision']:.1f}% less; with "
      f"V2's deployed {published.DEEPSEEK_V2_DEPLOYED_KV_BITS}-bit cache vs "
      f"67B at {published.DEEPSEEK_67B_KV_BITS} bits: "
      f"−{100 * claims['reduction_deployed']:.1f}% (the paper: −93.3%); "
      "against an MHA 67B at equal precision: "
      f"−{100 * claims['reduction_vs_mha_67b']:.1f}%.\n")
  with open(os.path.join(workdir, "cache_table.md"), "w") as f:
    f.write(md)
  with open(os.path.join(workdir, "cache_table.json"), "w") as f:
    json.dump(dict(flags=kw, rows=rows, deepseek_v2=claims), f, indent=1)
  published.plot_table(rows, os.path.join(workdir, "cache_table.png"))
  print(f"KV cache sizes, {kw['kv_dtype']} cache:\n")
  print(md)


if __name__ == "__main__":
  cli.run(main)
