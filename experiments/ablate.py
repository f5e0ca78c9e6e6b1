r"""Attention-variant ablation: MHA, MQA, GQA, MLA at matched parameters.

  python -m kvjax.data --setup     # once: installs the corpus
  python experiments/ablate.py --workdir=workdir/ablate --seeds=0,1
  python experiments/ablate.py --config.train.num_steps=100 --seeds=0

Every variant is trained with the train section of --config (identical data,
steps and seeds; models from configs/train.py, matched parameter count),
then the table (validation bits/byte per seed, KV bytes per token, decode
tokens/s at batch 1 and where the cache dominates: --long_batch sequences
of --long_context cached tokens, against the read probe) is printed to
stdout as markdown and written to --workdir (ablation.md, with
ablation.json and ablation.png beside it). Each run is logged as it starts
and appended to runs.jsonl as it finishes; re-running resumes: finished
runs are not retrained (only the timings run again).
"""

import os
import time

from absl import flags
from absl import logging

from kvjax.lab import ablation
from kvjax import cli
from kvjax import configs
from kvjax import data
from kvjax import train
from configs import train as train_presets

_CONFIG = cli.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs",
                           "train.py:gqa"),
    "Training config; its train section is used for every variant.",
    presets=train_presets.VARIANTS, example="train.num_steps=100")
_WORKDIR = flags.DEFINE_string("workdir", "workdir/ablate", "Output dir.")
_SEEDS = cli.DEFINE_int_list("seeds", [0, 1], "Seeds (one run each).",
                             lower_bound=0)
_VARIANTS = cli.DEFINE_choice_list("variants", list(train_presets.VARIANTS),
                                   train_presets.VARIANTS,
                                   "Variants to train.")
_LONG_BATCH = flags.DEFINE_integer(
    "long_batch", 8, "Batch of the cache-dominated decode timing.",
    lower_bound=1)
_LONG_CONTEXT = flags.DEFINE_integer(
    "long_context", 4096, "Cached tokens per sequence of the cache-dominated "
    "decode timing (0: leave it out).", lower_bound=0)


def main(argv):
  del argv
  cfg = _CONFIG.value
  model_configs = {
      v: configs.model_config(train_presets.get_config(v).model)
      for v in _VARIANTS.value}
  with cli.checking("--config.train"):
    train_config = train.TrainConfig.from_dict(cfg.train.to_dict())
  data.locate_corpus(train_config.data_dir)  # one line when it is missing
  t0 = time.perf_counter()
  rows = ablation.run_ablation(model_configs, train_config, _SEEDS.value,
                               _WORKDIR.value, long_batch=_LONG_BATCH.value,
                               long_context=_LONG_CONTEXT.value)
  minutes = (time.perf_counter() - t0) / 60
  print(ablation.markdown(rows))
  logging.info("ablation took %.1f min (this invocation); table in %s",
               minutes, os.path.join(_WORKDIR.value, "ablation.md"))


if __name__ == "__main__":
  cli.run(main)
