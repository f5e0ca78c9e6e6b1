r"""Trains a byte-level kvjax model on the Austen novels.

  python -m kvjax.data --setup        # once: installs the corpus
  python experiments/train.py --config=configs/train.py:gqa \
      --workdir=workdir/train-gqa

Re-running with the same --workdir resumes from the latest checkpoint.
Outputs (checkpoints, metrics.jsonl, loss.png, final.json) go to --workdir;
`kvjax.train.restore_params(workdir)` loads the model for inference.
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from kvjax import configs
from kvjax import train

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/train.py", "Training config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.",
                               required=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cfg = _CONFIG.value
  train.run(configs.model_config(cfg.model),
            train.TrainConfig.from_dict(cfg.train.to_dict()), _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
