r"""Trains a byte-level kvjax model on the Austen novels.

  python -m kvjax.data --setup        # once: installs the corpus
  python experiments/train.py --config=configs/train.py:gqa \
      --workdir=workdir/train-gqa
  python experiments/train.py --workdir=/tmp/t --config.train.num_steps=250
  python experiments/train.py --show_config   # every --config.* field

Re-running with the same --workdir resumes from the latest checkpoint.
Outputs (checkpoints, metrics.jsonl written as training goes, loss.png,
final.json) go to --workdir; `kvjax.orbax_checkpoint.restore_params(workdir)`
loads the model for inference. The corpus is read from
--config.train.data_dir, else $KVJAX_DATA_DIR, else the user's cache
directory (`python -m kvjax.data` prints where).
"""

import os

from absl import flags

from kvjax import cli
from kvjax import configs
from kvjax import data
from kvjax import train
from configs import train as train_presets

_CONFIG = cli.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs",
                           "train.py:gqa"),
    "Training config (model + train sections).",
    presets=train_presets.VARIANTS, example="train.num_steps=250")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.",
                               required=True)


def main(argv):
  del argv
  cfg = _CONFIG.value
  with cli.checking("--config.model"):
    model_config = configs.model_config(cfg.model)
  with cli.checking("--config.train"):
    train_config = train.TrainConfig.from_dict(cfg.train.to_dict())
  data.locate_corpus(train_config.data_dir)  # one line when it is missing
  train.run(model_config, train_config, _WORKDIR.value)


if __name__ == "__main__":
  cli.run(main)
