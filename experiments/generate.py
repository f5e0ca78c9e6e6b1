r"""The main job: generate with the KV cache, measure it, verify it.

  python experiments/generate.py                       # the shipped model
  python experiments/generate.py --prompt="It is a truth"
  python experiments/generate.py --config=configs/model.py:mla-small  # random init
  python experiments/generate.py --config=configs/model.py:gqa-small \
      --config.model.num_layers=2 --config.generate.max_new_tokens=32
  python experiments/generate.py --checkpoint=/path/to/hf_dir \
      --config.cache.eviction=sinks --config.cache.num_sinks=4 \
      --config.cache.capacity=256
  python experiments/generate.py --show_config   # every --config.* field

Which model runs: --checkpoint (a Hugging Face directory) or --trained (a
kvjax training workdir) if given; else a preset named with --config, or any
--config.model.* override, runs a seeded random init of that model; else
the shipped trained model (checkpoints/austen-gqa). The first output line
says which, and why. The cache and generation settings always come from
--config (sinks and h2o rotate kept keys by their rank in the cache,
StreamingLLM's choice, unless --config.cache.positions says otherwise).

Prints the generated text (byte-level trained model) or ids, prefill time,
decode tokens/s, cache bytes (total, used, per token) and whether the first
--verify_steps cached tokens equal the no-cache recompute. Writes
report.json into --workdir when given.
"""

import json
import os

from absl import flags

from kvjax import cli
from kvjax import configs
from kvjax import data
from kvjax.lab import job
from kvjax import sharding
from configs import model as model_presets

_CONFIG = cli.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs",
                           "model.py:gqa-small"),
    "Model / cache / generation config. Naming a preset (or overriding a "
    "--config.model field) runs a seeded random init of that model; "
    "without either the shipped trained model runs, with this config's "
    "cache and generation settings.",
    presets=model_presets.PRESETS, example="cache.eviction=sinks")
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
    "verify_steps", 16, "Check this many cached tokens against no-cache.",
    lower_bound=0)
_WORKDIR = flags.DEFINE_string("workdir", "", "Where report.json goes.")
_MESH = cli.DEFINE_int_list(
    "mesh", [], "Device mesh axis sizes (data,model[,seq]), e.g. 2,4; empty "
    "runs on one device. Multi-process: set JAX_COORDINATOR_ADDRESS, "
    "JAX_NUM_PROCESSES and JAX_PROCESS_ID (see WORKSPACE.md).",
    lower_bound=1, allow_empty=True)


def _which_model(cfg):
  """(checkpoint, trained, random init?, why): the model that runs."""
  model_overrides = cli.overrides_given("config.model")
  named = cli.config_given("config") or model_overrides
  for flag, path in (("checkpoint", _CHECKPOINT.value),
                     ("trained", _TRAINED.value)):
    if path and not os.path.isdir(path):
      raise ValueError(f"--{flag}={path}: no such directory")
    if path and model_overrides:
      raise ValueError(f"--{flag} decides the model; "
                       f"{', '.join('--' + o for o in model_overrides)} "
                       "would be ignored")
  if _CHECKPOINT.value:
    return _CHECKPOINT.value, "", False, "--checkpoint"
  if _TRAINED.value:
    return "", _TRAINED.value, False, "--trained"
  if _RANDOM.value or named:
    how = ("--random" if _RANDOM.value else "--config preset" if
           cli.config_given("config") else "--config.model overrides")
    return "", "", True, f"random init of {cfg.preset!r}: {how}"
  if os.path.isdir(job.SHIPPED_MODEL):
    return "", job.SHIPPED_MODEL, False, "shipped model: no model flag given"
  return "", "", True, (
      f"random init of {cfg.preset!r}: no shipped model at "
      f"{job.SHIPPED_MODEL}")


def main(argv):
  del argv
  cfg = _CONFIG.value
  gen = cfg.generate
  # Everything the user chose is checked before a model loads or compiles.
  with cli.checking():
    checkpoint, trained, random_init, why = _which_model(cfg)
  with cli.checking("--config.model"):
    model_config = configs.model_config(cfg.model) if random_init else None
  with cli.checking("--config.cache"):
    policy = configs.cache_policy(cfg.cache)
  with cli.checking("--config.generate"):
    sampler = configs.sampler(gen)
  with cli.checking("--config"):
    byte_level = bool(trained)
    prompt_len = (len(data.encode(_PROMPT.value)) if byte_level and
                  _PROMPT.value else gen.prompt_len)
    job.check_request(max_new_tokens=gen.max_new_tokens, batch=gen.batch,
                      prompt_len=prompt_len, policy=policy,
                      capacity=cfg.cache.capacity, seed=gen.seed,
                      max_seq_len=model_config.max_seq_len if model_config
                      else 0)
  sharding.initialize_distributed()  # a no-op for a single process
  plan = None
  if _MESH.value:
    with cli.checking("--mesh"):
      mesh = sharding.make_mesh(_MESH.value)
  loaded = job.load_model(checkpoint=checkpoint, trained=trained,
                          config=model_config, seed=gen.seed)
  print(f"model: {loaded.source} ({why})", flush=True)
  tokens = job.prompt_tokens(loaded, text=_PROMPT.value, batch=gen.batch,
                             prompt_len=gen.prompt_len, seed=gen.seed)
  with cli.checking("--config"):
    # Now that the model's limits are known (a checkpoint's config.json).
    job.check_request(max_new_tokens=gen.max_new_tokens, batch=gen.batch,
                      prompt_len=tokens.shape[1], policy=policy,
                      capacity=cfg.cache.capacity, seed=gen.seed,
                      max_seq_len=loaded.config.max_seq_len)
    if _MESH.value:
      plan = sharding.plan(loaded.config, mesh)
  report = job.run(loaded, tokens, shardings=plan,
                   max_new_tokens=gen.max_new_tokens, policy=policy,
                   capacity=cfg.cache.capacity, sampler=sampler,
                   seed=gen.seed, verify_steps=_VERIFY_STEPS.value)
  print(job.format_report(report))
  if _WORKDIR.value:
    os.makedirs(_WORKDIR.value, exist_ok=True)
    with open(os.path.join(_WORKDIR.value, "report.json"), "w") as f:
      json.dump(report, f, indent=1)
  if "verify_equal" in report and not report["verify_equal"]:
    raise SystemExit("cached generation differs from the no-cache recompute")


if __name__ == "__main__":
  cli.run(main)
