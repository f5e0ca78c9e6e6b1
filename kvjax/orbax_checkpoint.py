"""Orbax checkpoints of a training run: save, verify, resume, restore.

Layout under a training workdir (written by `kvjax.train.fit`):
  checkpoints/<step>/params/                 params only (for inference)
  checkpoints/<step>/train/                  {'step', 'opt_state'}
  checkpoints/<step>/model_config/model_config.json   rebuilds the model

`restore_params(workdir)` is the inference entry point: it rebuilds the
model config from the JSON saved beside the weights and checks it against
them before anything is loaded. `save_checkpoint` / `restore_train_state`
carry a `kvjax.train.TrainState` (step, params, opt_state) across runs.
"""

from __future__ import annotations

import json
import logging as pylogging
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from absl import logging
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

import kvjax

if TYPE_CHECKING:
  from kvjax.train import TrainState  # pylint: disable=g-bad-import-order

Params = Any

CHECKPOINT_DIR = "checkpoints"
MODEL_CONFIG_FILE = "model_config.json"


def checkpoint_manager(workdir: str | os.PathLike,
                       keep: int = 2) -> ocp.CheckpointManager:
  """Orbax manager over `<workdir>/checkpoints` with params/train/config items.

  Saves are synchronous: checkpoints are small here, and a finished `save`
  then means the files are on disk. Orbax writes each step to a temporary
  directory and renames it when complete, so an interrupted save is never
  mistaken for a checkpoint.
  """
  directory = pathlib.Path(workdir).absolute() / CHECKPOINT_DIR
  return ocp.CheckpointManager(
      directory,
      item_handlers={
          "params": ocp.StandardCheckpointHandler(),
          "train": ocp.StandardCheckpointHandler(),
          "model_config": ocp.JsonCheckpointHandler(filename=MODEL_CONFIG_FILE),
      },
      options=ocp.CheckpointManagerOptions(
          max_to_keep=keep, enable_async_checkpointing=False))


def model_config_path(manager: ocp.CheckpointManager, step: int) -> pathlib.Path:
  """The JSON file holding the model config saved with checkpoint `step`."""
  return (pathlib.Path(manager.directory) / str(step) / "model_config" /
          MODEL_CONFIG_FILE)


def save_checkpoint(manager: ocp.CheckpointManager, state: TrainState,
                    model_config_dict: Mapping[str, Any]) -> int:
  """Saves params, {step, opt_state} and the model config JSON; returns the step.

  Raises:
    ValueError: a checkpoint for this step already exists; it is left as is.
  """
  step = int(state.step)
  if step in manager.all_steps():
    raise ValueError(f"checkpoint {step} already exists in {manager.directory}; "
                     "refusing to overwrite it")
  manager.save(step, args=ocp.args.Composite(
      params=ocp.args.StandardSave(state.params),
      train=ocp.args.StandardSave({"step": state.step,
                                   "opt_state": state.opt_state}),
      model_config=ocp.args.JsonSave(dict(model_config_dict))))
  manager.wait_until_finished()
  return step


def _read_model_config(path: pathlib.Path) -> dict[str, Any]:
  if not path.is_file():
    raise FileNotFoundError(f"{path} is missing: the checkpoint cannot be "
                            "matched to a model config")
  with open(path) as f:
    return json.load(f)


def _shape_mismatches(expected: Params, saved_metadata) -> list[str]:
  """Differences between expected leaf shapes/dtypes and a saved params tree."""
  want = {jax.tree_util.keystr(p): x for p, x in
          jax.tree_util.tree_flatten_with_path(expected)[0]}
  have = {jax.tree_util.keystr(p): x for p, x in
          jax.tree_util.tree_flatten_with_path(saved_metadata)[0]}
  problems = [f"{k}: missing from checkpoint" for k in sorted(set(want) - set(have))]
  problems += [f"{k}: in checkpoint but not in model" for k in sorted(set(have) - set(want))]
  for k in sorted(set(want) & set(have)):
    w, h = want[k], have[k]
    if tuple(w.shape) != tuple(h.shape) or jnp.dtype(w.dtype) != jnp.dtype(h.dtype):
      problems.append(f"{k}: config implies {tuple(w.shape)} {jnp.dtype(w.dtype)}, "
                      f"checkpoint holds {tuple(h.shape)} {jnp.dtype(h.dtype)}")
  return problems


def verify_checkpoint(manager: ocp.CheckpointManager, step: int,
                      abstract_params: Params) -> None:
  """Checks that the weights of checkpoint `step` have the expected shapes.

  Raises:
    ValueError: naming the model config file and every mismatching leaf.
  """
  saved = manager.item_metadata(step)["params"]
  saved_tree = saved.tree if hasattr(saved, "tree") else saved
  problems = _shape_mismatches(abstract_params, saved_tree)
  if problems:
    raise ValueError(
        f"{model_config_path(manager, step)} does not match the weights in "
        f"{pathlib.Path(manager.directory) / str(step) / 'params'}:\n  " +
        "\n  ".join(problems))


def restore_params(
    workdir: str | os.PathLike,
    step: int | None = None,
    *,
    config_from_dict: Callable[[Mapping[str, Any]], Any] | None = None,
    init_fn: Callable[[Any, jax.Array], Params] | None = None,
) -> tuple[Any, Params]:
  """Model config and params of a checkpoint, for inference.

  The config is rebuilt from the JSON saved beside the weights and checked
  against them before anything is loaded.

  Args:
    workdir: the training workdir (holding `checkpoints/`).
    step: which checkpoint; default the latest.
    config_from_dict: builds the config from the JSON dict; default
      `kvjax.ModelConfig.from_dict`.
    init_fn: `(config, key) -> params`, traced with `jax.eval_shape` only, to
      get the expected shapes; default `kvjax.init_params`.

  Returns:
    (model config, params pytree).

  Raises:
    FileNotFoundError: no checkpoint in `workdir`.
    ValueError: the saved config cannot be built, or implies other shapes
      than the saved weights hold (the message names the config file and the
      mismatching leaves).
  """
  config_from_dict = config_from_dict or kvjax.ModelConfig.from_dict
  init_fn = init_fn or kvjax.init_params
  manager = checkpoint_manager(workdir)
  step = manager.latest_step() if step is None else step
  if step is None or step not in manager.all_steps():
    raise FileNotFoundError(
        f"no checkpoint{'' if step is None else f' {step}'} in "
        f"{manager.directory} (have {list(manager.all_steps())})")
  path = model_config_path(manager, step)
  try:
    model_config = config_from_dict(_read_model_config(path))
  except (TypeError, ValueError) as e:
    raise ValueError(f"{path}: cannot build a model config: {e}") from e
  abstract = jax.eval_shape(lambda: init_fn(model_config, jax.random.key(0)))
  verify_checkpoint(manager, step, abstract)
  restored = manager.restore(step, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(abstract)))
  return model_config, restored["params"]


def _json_normalise(d: Mapping[str, Any]) -> dict[str, Any]:
  # What the dict reads back as from JSON (tuples become lists, ...).
  return json.loads(json.dumps(dict(d)))


def restore_train_state(manager: ocp.CheckpointManager, step: int,
                        state: TrainState,
                        model_config_dict: Mapping[str, Any]) -> TrainState:
  """Resumes `state`'s run from checkpoint `step` after verifying it.

  Raises:
    ValueError: the checkpoint belongs to another model (its config differs
      from `model_config_dict`, or its weights from the current shapes). The
      checkpoint is left untouched; use another workdir or delete it.
  """
  path = model_config_path(manager, step)
  saved = _read_model_config(path)
  current = _json_normalise(model_config_dict)
  diffs = [f"{k}: checkpoint {saved.get(k, '<absent>')!r}, "
           f"run {current.get(k, '<absent>')!r}"
           for k in sorted(set(saved) | set(current))
           if saved.get(k) != current.get(k)]
  if diffs:
    raise ValueError(
        f"{path}: the checkpoint in {manager.directory} was trained with "
        f"another model config; refusing to resume or overwrite it. "
        f"Use a new --workdir. Differences:\n  " + "\n  ".join(diffs))
  abstract = jax.eval_shape(lambda: state)
  verify_checkpoint(manager, step, abstract.params)
  restored = manager.restore(step, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(abstract.params),
      train=ocp.args.StandardRestore(
          {"step": abstract.step, "opt_state": abstract.opt_state})))
  return state.replace(step=restored["train"]["step"],
                       params=restored["params"],
                       opt_state=restored["train"]["opt_state"])


class _DropOrbaxInfo(pylogging.Filter):
  """Orbax logs ~25 INFO lines per save; keep its warnings and errors only."""

  def filter(self, record):
    return (record.levelno >= pylogging.WARNING or
            f"{os.sep}orbax{os.sep}" not in record.pathname)


def quiet_orbax_logs() -> None:
  """Drops orbax's INFO chatter from absl logging (idempotent)."""
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _DropOrbaxInfo) for f in handler.filters):
    handler.addFilter(_DropOrbaxInfo())
