r"""Which decode cache layout reads a cache fastest: stacked, blocked,
layered, native.

  python experiments/cache_layout.py --preset=mla-small --batch=8 \
      --contexts=512,2048,4096 --kv_dtypes=float32,int8 \
      --workdir=workdir/cache_layout_mla

  python experiments/cache_layout.py --preset=gqa-medium --batch=8 \
      --contexts=512,2048,4096 --kv_dtypes=float32,int8 \
      --workdir=workdir/cache_layout

For each context: decode loops of --steps steps from a cache holding that
many tokens, for every kv dtype × layout the cache can take
(`kvjax.decode.plan` refuses the others: blocked is float GQA only, native
the kinds its kernels read), timed in
alternating rounds in one process (`bm.decode_layouts_alternating`). The
ratios decide `kvjax.decode`'s 'auto' choice (native wherever it runs;
without it LAYERED_MIN_BATCH, LAYERED_MIN_SLOTS). Prints a line per combination (stdout), appends it to
cache_layout.jsonl; writes cache_layout.json at the end.
"""

import json
import os

from absl import flags
import jax

import kvjax
from kvjax import cli
from kvjax import configs as cfg_lib
from kvjax import native_latent
from kvjax import native_layered
from kvjax.lab import benchmarking as bm
from configs import model as presets

_PRESET = flags.DEFINE_enum("preset", "gqa-medium", presets.PRESETS,
                            "configs/model.py preset.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences.", lower_bound=1)
_CONTEXTS = cli.DEFINE_int_list("contexts", [512, 2048, 4096],
                                "Cached tokens per timed point.",
                                lower_bound=0)
_DTYPES = cli.DEFINE_choice_list("kv_dtypes", ["float32", "int8"],
                                 bm.CACHE_KINDS, "Cache kinds.")
_LAYOUTS = cli.DEFINE_choice_list(
    "layouts", ["stacked", "blocked", "layered", "native"],
    ("stacked", "blocked", "layered", "native"),
    "Cache layouts (the first is the baseline).")
_STEPS = flags.DEFINE_integer("steps", 32, "Decode steps per timed loop.",
                              lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Alternating timed rounds.",
                                lower_bound=1)
_WORKDIR = flags.DEFINE_string("workdir", "workdir/cache_layout",
                               "Output directory.")


def main(argv):
  del argv
  with cli.checking("--preset"):
    config = cfg_lib.model_config(presets.get_config(_PRESET.value).model)
  # blocked views hold float GQA caches only; MLA's latents are stacked,
  # layered (`kvjax.layered_latent`) or native.
  # native: the GQA family's float32 / bfloat16 / int8 / int4 caches, MLA's
  # latents in the same four.
  native_kinds = (native_latent.NATIVE_LATENT_DTYPES
                  if config.attention == "mla" else
                  native_layered.NATIVE_DTYPES)
  combos = [(k, lay) for k in _DTYPES.value for lay in _LAYOUTS.value
            if not (lay == "blocked" and (bm.cache_policy(k).quantized or
                                          config.attention == "mla"))
            and not (lay == "native" and k not in native_kinds)]
  # Packed params (`kvjax.pack`): the views need per-layer arrays, which
  # `generate` gives only from PACK_MIN_WIDTH on; every layout reads them.
  params = kvjax.pack(kvjax.init_params(config, jax.random.key(0)), config)
  partial = cli.JsonLines(os.path.join(_WORKDIR.value, "cache_layout.jsonl"))
  rows = []
  for ctx in _CONTEXTS.value:
    timed = bm.decode_layouts_alternating(params, config, _BATCH.value, ctx,
                                          combos, steps=_STEPS.value,
                                          repeats=_REPEATS.value)
    for name, t in timed.items():
      kind, layout = name.split(":")
      # t's own 'layout' is the plan's (the same name): the row keeps one.
      row = dict(t, preset=_PRESET.value, batch=_BATCH.value, context=ctx,
                 kv_dtype=kind, layout=layout)
      rows.append(row)
      partial.write(row)
      print(f"{_PRESET.value} b{_BATCH.value} ctx {ctx:5d} {kind:9s} "
            f"{layout:8s} {1e3 * t['step_s']:8.2f} ms/step  "
            f"{t['vs_first']:.2f}x {combos[0][0]}:{combos[0][1]} (rounds "
            f"{min(t['rounds']):.2f}-{max(t['rounds']):.2f})", flush=True)
  partial.close()
  with open(os.path.join(_WORKDIR.value, "cache_layout.json"), "w") as f:
    json.dump(dict(machine=bm.machine_info(), rows=rows), f, indent=1)


if __name__ == "__main__":
  cli.run(main)
