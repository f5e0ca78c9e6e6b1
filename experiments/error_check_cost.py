r"""What the in-graph error state costs a decode step (kvjax/errors.py).

  python experiments/error_check_cost.py --config=configs/model.py:gqa-medium \
      --batches=1,8 --position=128 --workdir=workdir/error_check_cost

For each batch: a scan of greedy decode steps with the checks (overflow, id
range, non-finite logits, NaN poisoning, the sampler's INVALID_TOKEN) and
the same scan traced inside `errors.unchecked()`, timed alternately in one
process on packed params (the decode layout). Prints a line per batch as it
is measured (stdout; also appended to error_check_cost.jsonl) and writes
error_check_cost.json: per-step medians, the ratio checked / unchecked
(median of the per-round ratios) and its spread.
"""

import json
import os

from absl import flags
from absl import logging
import jax

import kvjax
from kvjax.lab import benchmarking as bm
from kvjax import cli
from kvjax import configs as cfg_lib
from configs import model as model_presets

_CONFIG = cli.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs",
                           "model.py:gqa-medium"),
    "Model preset.", presets=model_presets.PRESETS)
_WORKDIR = flags.DEFINE_string("workdir", "workdir/error_check_cost",
                               "Output directory.")
_BATCHES = cli.DEFINE_int_list("batches", [1, 8], "Batch sizes.",
                               lower_bound=1)
_POSITION = flags.DEFINE_integer("position", 128, "Tokens already cached.",
                                 lower_bound=0)
_STEPS = flags.DEFINE_integer("steps", 32, "Decode steps per timed scan.",
                              lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 9, "Alternating timed rounds.",
                                lower_bound=1)


def main(argv):
  del argv
  with cli.checking("--config.model"):
    config = cfg_lib.model_config(_CONFIG.value.model)
  params = kvjax.pack(kvjax.init_params(config, jax.random.key(0)), config)
  rows = []
  partial = cli.JsonLines(os.path.join(_WORKDIR.value,
                                       "error_check_cost.jsonl"))
  for batch in _BATCHES.value:
    row = bm.error_check_cost(params, config, batch, _POSITION.value,
                              steps=_STEPS.value, repeats=_REPEATS.value)
    row["spread"] = bm.spread(row["ratio_rounds"])
    rows.append(row)
    partial.write(row)
    print(f"{_CONFIG.value.preset} batch {batch}: checked "
          f"{1e3 * row['checked_step_s']:.3f} ms/step, unchecked "
          f"{1e3 * row['unchecked_step_s']:.3f} ms/step, ratio "
          f"{row['ratio']:.4f} (rounds {row['spread']['min']:.3f}-"
          f"{row['spread']['max']:.3f})", flush=True)
  partial.close()
  out = dict(preset=_CONFIG.value.preset, machine=bm.machine_info(),
             rows=rows)
  path = os.path.join(_WORKDIR.value, "error_check_cost.json")
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  logging.info("wrote %s", path)


if __name__ == "__main__":
  cli.run(main)
