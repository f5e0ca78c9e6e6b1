r"""Attention sinks against training: several runs' first-token mass.

  python experiments/sink_curves.py --workdir=workdir/sink_curves \
      --runs=workdir/sinks-bos256,workdir/sinks-bos1024,workdir/sinks-bos256-l8

Reads each training workdir of `experiments/train.py` (its metrics.jsonl:
the first token's attention per layer at every validation, and its
config.json) and states every figure as a multiple of uniform causal
attention at that run's length (`kvjax.lab.sink_curves`). Prints a
markdown table (per run and validation: step, training tokens,
validation bits/byte, the mean and largest head's first-token mass over
uniform, each layer's, and how many layers reach the sink threshold) and
writes sink_curves.json and sink_curves.png (mass over uniform against
training tokens, a line per layer; bits/byte beside it) to --workdir.
"""

import json
import os

from absl import flags

from kvjax import cli
from kvjax.lab import sink_curves

_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.",
                               required=True)
_RUNS = flags.DEFINE_list("runs", None, "Training workdirs to compare.",
                          required=True)


def main(argv):
  del argv
  runs = []
  for path in _RUNS.value:
    with cli.checking("--runs"):
      runs.append(sink_curves.read_run(path))
  rows = sink_curves.table(runs)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  with open(os.path.join(_WORKDIR.value, "sink_curves.json"), "w") as f:
    json.dump(dict(rows=rows, sink_ratio=sink_curves.SINK_RATIO,
                   uniform={r.name: r.uniform for r in runs}), f, indent=2)
  sink_curves.plot(runs, os.path.join(_WORKDIR.value, "sink_curves.png"))
  print("| run | step | tokens | val bits/byte | mean / uniform | largest "
        "head / uniform | per layer / uniform | layers with a sink |")
  print("|---|--:|--:|--:|--:|--:|---|--:|")
  for r in rows:
    layers = ", ".join(f"{x:.2f}" for x in r["layers_over_uniform"])
    print(f"| {r['run']} | {r['step']} | {r['tokens'] / 1e6:.1f} M | "
          f"{r['bits_per_byte']:.3f} | {r['mean_over_uniform']:.3f} | "
          f"{r['max_head_over_uniform']:.2f} | {layers} | "
          f"{r['layers_with_sinks']} / {r['num_layers']} |")


if __name__ == "__main__":
  cli.run(main)
