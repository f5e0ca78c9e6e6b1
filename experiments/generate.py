r"""The main job: generate with the KV cache, measure it, verify it.

  python experiments/generate.py                       # shipped Austen model
  python experiments/generate.py --prompt="It is a truth"
  python experiments/generate.py --config=configs/model.py:mla-small  # random init
  python experiments/generate.py --checkpoint=/path/to/hf_dir \
      --config.cache.eviction=sinks --config.cache.num_sinks=4 \
      --config.cache.capacity=256

Prints the generated text (byte-level trained model) or ids, prefill time,
decode tokens/s, cache bytes (total, used, per token) and whether the first
--verify_steps cached tokens equal the no-cache recompute. Writes
report.json into --workdir when given.
"""

import json
import os

from absl import app
from absl import flags
from ml_collections import config_flags

from kvjax import configs
from kvjax import job
from kvjax import sharding

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs",
                           "model.py:gqa-small"),
    "Model / cache / generation config. Naming it (--config=...:preset) runs "
    "a seeded random init of that preset; without --config the shipped "
    "model runs, with this default's cache and generation settings.",
    lock_config=True)
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", "", "Hugging Face checkpoint directory.")
_TRAINED = flags.DEFINE_string(
    "trained", "", "kvjax training workdir (default: the shipped model).")
_RANDOM = flags.DEFINE_bool(
    "random", False, "Use a seeded random init of --config's model.")
_PROMPT = flags.DEFINE_string(
    "prompt", "It is a truth universally acknowledged, that",
    "Prompt text (byte-level trained models).")
_VERIFY_STEPS = flags.DEFINE_integer(
    "verify_steps", 16, "Check this many cached tokens against no-cache.")
_WORKDIR = flags.DEFINE_string("workdir", "", "Where report.json goes.")
_MESH = flags.DEFINE_list(
    "mesh", [], "Device mesh axis sizes (data,model[,seq]), e.g. 2,4; empty "
    "runs on one device. Multi-process: set JAX_COORDINATOR_ADDRESS, "
    "JAX_NUM_PROCESSES and JAX_PROCESS_ID (see WORKSPACE.md).")


def main(argv):
  del argv
  sharding.initialize_distributed()  # a no-op for a single process
  cfg = _CONFIG.value
  trained = _TRAINED.value
  # Which model runs, and why: a checkpoint or workdir named on the command
  # line, else a preset named with --config (or --random: a seeded random
  # init of it), else the shipped model.
  preset_given = flags.FLAGS["config"].present
  if _CHECKPOINT.value:
    why = "--checkpoint"
  elif trained:
    why = "--trained"
  elif _RANDOM.value or preset_given:
    why = (f"random init of the --config preset {cfg.preset!r}"
           if preset_given else f"--random, preset {cfg.preset!r}")
  elif os.path.isdir(job.SHIPPED_MODEL):
    trained, why = job.SHIPPED_MODEL, "shipped model: no model flag given"
  else:
    why = f"random init: no shipped model at {job.SHIPPED_MODEL}"
  loaded = job.load_model(checkpoint=_CHECKPOINT.value, trained=trained,
                          config=configs.model_config(cfg.model),
                          seed=cfg.generate.seed)
  print(f"model: {loaded.source} ({why})", flush=True)
  tokens = job.prompt_tokens(loaded, text=_PROMPT.value,
                             batch=cfg.generate.batch,
                             prompt_len=cfg.generate.prompt_len,
                             seed=cfg.generate.seed)
  plan = None
  if _MESH.value:
    mesh = sharding.make_mesh([int(n) for n in _MESH.value])
    plan = sharding.plan(loaded.config, mesh)
  report = job.run(loaded, tokens, shardings=plan,
                   max_new_tokens=cfg.generate.max_new_tokens,
                   policy=configs.cache_policy(cfg.cache),
                   capacity=cfg.cache.capacity,
                   sampler=configs.sampler(cfg.generate),
                   seed=cfg.generate.seed, verify_steps=_VERIFY_STEPS.value)
  print(job.format_report(report))
  if _WORKDIR.value:
    os.makedirs(_WORKDIR.value, exist_ok=True)
    with open(os.path.join(_WORKDIR.value, "report.json"), "w") as f:
      json.dump(report, f, indent=1)
  if "verify_equal" in report and not report["verify_equal"]:
    raise SystemExit("cached generation differs from the no-cache recompute")


if __name__ == "__main__":
  app.run(main)
