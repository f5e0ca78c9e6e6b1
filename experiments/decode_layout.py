r"""Which params layout decodes faster: canonical (layer scan) or packed.

  python experiments/decode_layout.py --presets=gqa-small,gqa-medium \
      --batches=1,8 --workdir=workdir/decode_layout

For each preset and batch: `kvjax.generate` (prompt 128, 256 new tokens,
the stacked decode cache) on the canonical params (inside
`packed.as_given()`, so generate does not pack them) and on
`kvjax.pack(params)`, and the default path (the canonical params passed to
`generate`, which packs them itself), timed alternately in one process. The ratio decides `kvjax.packed.PACK_MIN_WIDTH`, the width
from which `kvjax.packed.for_decode` (what every inference entry point
calls) packs. Prints a line per row as it is measured (stdout) and appends
it to decode_layout.jsonl; writes decode_layout.json at the end.
"""

import json
import os
import statistics

from absl import flags
import jax
import numpy as np

import kvjax
from kvjax.lab import benchmarking as bm
from kvjax import cli
from kvjax import configs as cfg_lib
from kvjax import inference
from kvjax import packed
from configs import model as presets

_PRESETS = cli.DEFINE_choice_list("presets", ["gqa-small", "gqa-medium"],
                                  presets.PRESETS,
                                  "configs/model.py presets.")
_BATCHES = cli.DEFINE_int_list("batches", [1, 8], "Batch sizes.",
                               lower_bound=1)
_PROMPT = flags.DEFINE_integer("prompt_len", 128, "Prompt tokens.",
                               lower_bound=1)
_NEW = flags.DEFINE_integer("new_tokens", 256, "Generated tokens.",
                            lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Alternating timed rounds.",
                                lower_bound=1)
_WORKDIR = flags.DEFINE_string("workdir", "workdir/decode_layout",
                               "Output directory.")


def main(argv):
  del argv
  with cli.checking("--presets"):
    model_configs = {name: cfg_lib.model_config(presets.get_config(name).model)
                     for name in _PRESETS.value}
  rows = []
  partial = cli.JsonLines(os.path.join(_WORKDIR.value, "decode_layout.jsonl"))
  for name, config in model_configs.items():
    canonical = kvjax.init_params(config, jax.random.key(0))
    fused = kvjax.pack(canonical, config)
    for batch in _BATCHES.value:
      tokens = np.asarray(jax.random.randint(
          jax.random.key(1), (batch, _PROMPT.value), 0, config.vocab_size))

      def gen(p, tokens=tokens, config=config):
        return inference.generate(p, config, tokens, _NEW.value,
                                  decode_layout="stacked")

      def gen_canonical():
        with packed.as_given():  # no packing inside generate
          return gen(canonical)

      t = bm.time_alternating(dict(canonical=gen_canonical,
                                   packed=lambda: gen(fused),
                                   default=lambda: gen(canonical)),
                              warmup=1, repeats=_REPEATS.value)
      ratios = bm.paired_ratios(t["canonical"].seconds, t["packed"].seconds)
      default = bm.paired_ratios(t["packed"].seconds, t["default"].seconds)
      row = dict(preset=name, batch=batch, embed_dim=config.embed_dim,
                 canonical_s=t["canonical"].median,
                 packed_s=t["packed"].median,
                 default_s=t["default"].median,
                 packed_speedup=statistics.median(ratios),
                 speedup_rounds=ratios,
                 default_vs_packed=statistics.median(default),
                 default_vs_packed_rounds=default)
      rows.append(row)
      partial.write(row)
      print(f"{name} batch {batch} (D {config.embed_dim}): canonical "
            f"{row['canonical_s']:.3f} s, packed {row['packed_s']:.3f} s, "
            f"packed {row['packed_speedup']:.3f}x (rounds "
            f"{min(ratios):.3f}-{max(ratios):.3f}); default path "
            f"{row['default_s']:.3f} s, {row['default_vs_packed']:.3f}x the "
            f"packed speed (rounds {min(default):.3f}-{max(default):.3f})",
            flush=True)
  partial.close()
  with open(os.path.join(_WORKDIR.value, "decode_layout.json"), "w") as f:
    json.dump(dict(machine=bm.machine_info(), rows=rows), f, indent=1)


if __name__ == "__main__":
  cli.run(main)
