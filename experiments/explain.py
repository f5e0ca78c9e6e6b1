r"""The three explainer pictures, regenerated from measured runs of kvjax.

  python experiments/explain.py --workdir=workdir/explain
  python experiments/explain.py --workdir=/tmp/e --random \
      --config=configs/model.py:gqa-small --prompt_len=512

1. roofline.png: a prefill of --prompt_len tokens (compute-bound) and the
   decode step after it (memory-bound): counted FLOPs and bytes, measured
   times, on the roofline of this run's matmul-peak and read-bandwidth
   probes.
2. cache_vs_no_cache.png, no_cache_steps.gif, cache_steps.gif: the
   attention matrix of the first --attention_len tokens of --text stepped
   through without a cache (every step recomputes the whole block) and with
   one (one new row per step); counted FLOPs per step and cumulative;
   measured step times at --time_positions.
3. cache_growth.png, cache_growth.gif: a StreamingLLM sinks cache of
   --capacity slots fed --steps tokens by kvjax.decode_step: the stream
   positions it holds after every step and its bytes, linear up to the cap.

Which model: --random (a seeded random init of --config's model,
byte-level) else --checkpoint (a kvjax training workdir; default the
shipped checkpoints/austen-gqa). Writes explain.json (every plotted number,
the host, the commit) and the figures to --workdir; prints the numbers.
Logic: kvjax/lab/explain.py.
"""

import json
import os

from absl import flags
from absl import logging

from kvjax import cli
from kvjax import configs
from kvjax import data
from kvjax.lab import benchmarking as bm
from kvjax.lab import explain
from kvjax.lab import job
from configs import model as model_presets

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_DEFAULTS = explain.Settings()

_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.",
                               required=True)
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", job.SHIPPED_MODEL, "kvjax training workdir, used unless "
    "--random is given.")
_RANDOM = flags.DEFINE_bool(
    "random", False, "A seeded random init of --config's model (its vocab "
    "set to the byte-level tokenizer's).")
_CONFIG = cli.DEFINE_config_file(
    "config", os.path.join(_ROOT, "configs", "model.py:gqa-tiny"),
    "Random-weight model, used only with --random.",
    presets=model_presets.PRESETS)
_SEED = flags.DEFINE_integer("seed", 0, "Random init seed.", lower_bound=0)
_TEXT = flags.DEFINE_string(
    "text", "It is a truth universally acknowledged, that a single man in "
    "possession of a good fortune, must be in want of a wife.",
    "The prompt (bytes): its attention is drawn; the sinks cache reads it, "
    "then its own greedy continuation.")
_PROMPT_LEN = flags.DEFINE_integer(
    "prompt_len", _DEFAULTS.prompt_len, "Tokens of the roofline's prefill.",
    lower_bound=1)
_ATTENTION_LEN = flags.DEFINE_integer(
    "attention_len", _DEFAULTS.attention_len, "Tokens of --text whose "
    "attention is stepped through.", lower_bound=2)
_TIME_POSITIONS = cli.DEFINE_int_list(
    "time_positions", list(_DEFAULTS.time_positions), "Positions whose "
    "no-cache and cached steps are timed.", lower_bound=0, allow_empty=True)
_STEPS = flags.DEFINE_integer("steps", _DEFAULTS.steps, "Tokens fed to the "
                              "sinks cache.", lower_bound=1)
_CAPACITY = flags.DEFINE_integer("capacity", _DEFAULTS.capacity,
                                 "Slots S of the sinks cache.", lower_bound=2)
_NUM_SINKS = flags.DEFINE_integer("num_sinks", _DEFAULTS.num_sinks,
                                  "Pinned first positions.", lower_bound=1)
_LAYER = flags.DEFINE_integer("layer", -1, "Attention layer drawn (-1: the "
                              "mean over layers).", lower_bound=-1)
_REPEATS = flags.DEFINE_integer("repeats", _DEFAULTS.repeats,
                                "Timed calls per measurement.", lower_bound=1)
_MATMUL_N = flags.DEFINE_integer("matmul_n", _DEFAULTS.matmul_n,
                                 "n of the n x n x n matmul-peak probe.",
                                 lower_bound=1)
_READ_BYTES = flags.DEFINE_integer(
    "read_bytes", _DEFAULTS.read_bytes, "Bytes of the read-bandwidth probe.",
    lower_bound=4096)
_FPS = flags.DEFINE_integer("fps", _DEFAULTS.fps, "GIF frames per second.",
                            lower_bound=1)


def _load():
  if _RANDOM.value:
    config = configs.model_config(_CONFIG.value.model).replace(
        vocab_size=data.VOCAB_SIZE)
    return job.load_model(config=config, seed=_SEED.value)
  if not os.path.isdir(_CHECKPOINT.value):
    raise ValueError(f"--checkpoint={_CHECKPOINT.value}: no such directory")
  return job.load_model(trained=_CHECKPOINT.value)


def main(argv):
  del argv
  with cli.checking():
    if not _RANDOM.value and cli.overrides_given("config.model"):
      raise ValueError("--config.model.* sets the --random model only")
    loaded = _load()
    tokens = data.encode(_TEXT.value)
    settings = explain.Settings(
        prompt_len=_PROMPT_LEN.value, attention_len=_ATTENTION_LEN.value,
        time_positions=tuple(_TIME_POSITIONS.value), steps=_STEPS.value,
        capacity=_CAPACITY.value, num_sinks=_NUM_SINKS.value,
        layer=None if _LAYER.value < 0 else _LAYER.value,
        repeats=_REPEATS.value, matmul_n=_MATMUL_N.value,
        read_bytes=_READ_BYTES.value, fps=_FPS.value)
    settings.check(loaded.config, tokens.size)
  source = loaded.source.replace(os.getcwd() + os.sep, "")
  name = f"{loaded.config.variant} ({source})"
  logging.info("model %s, %d prompt tokens", name, tokens.size)
  result = explain.run(loaded.params, loaded.config, tokens, _WORKDIR.value,
                       settings, text=_TEXT.value, name=name)
  result.update(model=dict(source=source, variant=loaded.config.variant,
                           config=loaded.config.to_dict()),
                prompt=dict(text=_TEXT.value, ids=tokens.tolist()),
                host=bm.machine_info(), revision=bm.revision(_ROOT))
  with open(os.path.join(_WORKDIR.value, explain.FILES["json"]), "w") as f:
    json.dump(result, f, indent=1, default=str)
  print(f"{name}, {bm.cpu_model()}")
  for line in explain.summary_lines(result):
    print("  " + line)
  print(f"wrote {', '.join(explain.FILES.values())} to {_WORKDIR.value}")


if __name__ == "__main__":
  cli.run(main)
