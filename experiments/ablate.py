r"""Attention-variant ablation: MHA, MQA, GQA, MLA at matched parameters.

  python -m kvjax.data --setup     # once: installs the corpus
  python experiments/ablate.py --workdir=workdir/ablate --seeds=0,1

Every variant is trained with the train section of --config (identical data,
steps and seeds; models from configs/train.py, matched parameter count),
then the table (validation bits/byte per seed, KV bytes per token, decode
tokens/s) is printed to stdout as markdown and written to --workdir
(ablation.md, with ablation.json and ablation.png beside it). Re-running
resumes: finished runs are not retrained.
"""

import os
import time

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from kvjax import ablation
from kvjax import configs
from kvjax import train
from configs import train as train_presets

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.join(_HERE, "..")

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(_ROOT, "configs", "train.py:gqa"),
    "Training config; its train section is used for every variant.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "workdir/ablate", "Output dir.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1"], "Seeds (one run each).")
_VARIANTS = flags.DEFINE_list("variants", list(train_presets.VARIANTS),
                              "Variants to train.")


def main(argv):
  del argv
  cfg = _CONFIG.value
  model_configs = {
      v: configs.model_config(train_presets.get_config(v).model)
      for v in _VARIANTS.value}
  train_config = train.TrainConfig.from_dict(cfg.train.to_dict())
  t0 = time.perf_counter()
  rows = ablation.run_ablation(model_configs, train_config,
                               [int(s) for s in _SEEDS.value], _WORKDIR.value)
  minutes = (time.perf_counter() - t0) / 60
  print(ablation.markdown(rows))
  logging.info("ablation took %.1f min (this invocation); table in %s",
               minutes, os.path.join(_WORKDIR.value, "ablation.md"))


if __name__ == "__main__":
  app.run(main)
