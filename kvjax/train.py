"""Training: loss, optimiser, jitted train/eval steps, checkpoints, the loop.

Dimension alphabet (as in `kvjax.config`): B batch, T sequence length,
V vocab, D model width, L layers.

Contracts:
  * A model is a `logits_fn(params, tokens [B, T] int32) -> logits [B, T, V]`;
    for kvjax models it is `model_logits_fn(model_config)`, a closure over
    `kvjax.forward`. The loop itself never looks inside params.
  * A batch is int32 [B, T+1] (`kvjax.data.train_batch`): inputs `[:, :-1]`,
    targets `[:, 1:]`; PAD targets carry no loss.
  * Losses are nats per target token. Tokens are bytes (`kvjax.data`), so
    bits per byte = loss / ln 2.
  * Deterministic: parameters come from `jax.random.key(seed)`, the batch for
    update i from `data.train_batch(..., seed, step=i)`, and nothing else is
    random, so a run resumed from a checkpoint retraces the uninterrupted one.

Workdir layout written by `fit`:
  checkpoints/<step>/params/                 orbax, params only (for inference)
  checkpoints/<step>/train/                  orbax, {'step', 'opt_state'}
  checkpoints/<step>/model_config/model_config.json   rebuilds the model
  metrics.jsonl                              one JSON object per log/eval
  loss.png                                   train/validation bits per byte
  config.json                                the full run config (`run` only)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging as pylogging
import math
import os
import pathlib
import time
from collections.abc import Callable, Mapping
from typing import Any

from absl import logging
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import kvjax
from kvjax import data

Params = Any
LogitsFn = Callable[[Params, jax.Array], jax.Array]

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"
MODEL_CONFIG_FILE = "model_config.json"

# ----------------------------------------------------------------------------
# Configuration.


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything about a run except the model. Built once from a ConfigDict."""

  seq_len: int = 256  # T
  batch_size: int = 16  # B
  num_steps: int = 1000
  lr: float = 3e-3  # peak learning rate
  warmup_steps: int = 100  # linear 0 -> lr
  min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at num_steps
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  clip: float = 1.0  # global gradient-norm clip; 0 disables
  eval_every: int = 100
  eval_batches: int = 8  # of batch_size windows each
  checkpoint_every: int = 100
  keep_checkpoints: int = 2
  log_every: int = 10
  seed: int = 0
  data_dir: str | None = None  # None: $KVJAX_DATA_DIR or ./data/janeaustenr

  def __post_init__(self):
    for name in ("seq_len", "batch_size", "num_steps", "eval_every",
                 "eval_batches", "checkpoint_every", "keep_checkpoints",
                 "log_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    for name in ("warmup_steps", "weight_decay", "clip", "seed"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
    if not self.lr > 0:
      raise ValueError(f"lr must be > 0, got {self.lr}")
    if not 0 <= self.min_lr_ratio <= 1:
      raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
    if self.warmup_steps >= self.num_steps:
      raise ValueError(f"warmup_steps={self.warmup_steps} must be < "
                       f"num_steps={self.num_steps}")

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
    """From a plain mapping (e.g. `dict(cfg.train)`); unknown keys raise."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
      raise ValueError(f"unknown TrainConfig fields: {unknown}")
    return cls(**d)

  @property
  def tokens_per_step(self) -> int:
    return self.batch_size * self.seq_len


# ----------------------------------------------------------------------------
# Model glue.


def model_logits_fn(model_config) -> LogitsFn:
  """`logits_fn` for a kvjax model: (params, tokens [B,T]) -> logits [B,T,V]."""

  def logits_fn(params, tokens_BxT):
    return kvjax.forward(params, model_config, tokens_BxT)

  return logits_fn


# ----------------------------------------------------------------------------
# Loss and optimiser.


def token_nll(logits_BxTxV: jax.Array,
              targets_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Summed next-token cross-entropy over non-PAD targets.

  Args:
    logits_BxTxV: float logits; computed on in float32.
    targets_BxT: int32 target ids; PAD positions are ignored.

  Returns:
    (sum of nats float32 [], number of counted targets float32 []).
  """
  nll_BxT = optax.softmax_cross_entropy_with_integer_labels(
      logits_BxTxV.astype(jnp.float32), targets_BxT)
  mask_BxT = (targets_BxT != data.PAD).astype(jnp.float32)
  return jnp.sum(nll_BxT * mask_BxT), jnp.sum(mask_BxT)


def batch_loss(params: Params, logits_fn: LogitsFn,
               batch_BxT1: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Mean nats per target token of one [B, T+1] batch, and the target count."""
  logits_BxTxV = logits_fn(params, batch_BxT1[:, :-1])
  nll_sum, count = token_nll(logits_BxTxV, batch_BxT1[:, 1:])
  # max(.,1): an all-PAD batch has zero loss rather than NaN.
  return nll_sum / jnp.maximum(count, 1.0), count


def learning_rate_schedule(config: TrainConfig) -> optax.Schedule:
  """Linear warmup 0 -> lr over warmup_steps, cosine to lr*min_lr_ratio at num_steps."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.lr, warmup_steps=config.warmup_steps,
      decay_steps=config.num_steps, end_value=config.lr * config.min_lr_ratio)


def weight_decay_mask(params: Params) -> Params:
  """True for weight matrices and embeddings, False for norms and biases.

  Layers are stacked, so a per-layer norm scale is 2-D [L, D]: rank alone
  cannot tell it from a matrix, hence the name test as well.
  """

  def decays(path, x):
    name = jax.tree_util.keystr(path).lower()
    return x.ndim >= 2 and not any(s in name for s in ("norm", "bias", "scale"))

  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW on `learning_rate_schedule`."""
  adamw = optax.adamw(learning_rate_schedule(config), b1=config.b1,
                      b2=config.b2, weight_decay=config.weight_decay,
                      mask=weight_decay_mask)
  if config.clip > 0:
    return optax.chain(optax.clip_by_global_norm(config.clip), adamw)
  return adamw


# ----------------------------------------------------------------------------
# State and steps.


@flax.struct.dataclass
class TrainState:
  """What a train step carries. Only step/params/opt_state are checkpointed.

  `logits_fn` and `tx` are static (part of the jit cache key), so one
  `train_step` serves every model and optimiser.
  """

  step: jax.Array  # int32 [], number of updates applied
  params: Params
  opt_state: optax.OptState
  logits_fn: LogitsFn = flax.struct.field(pytree_node=False)
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)


def create_train_state(params: Params, logits_fn: LogitsFn,
                       tx: optax.GradientTransformation) -> TrainState:
  """A fresh state at step 0."""
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=tx.init(params), logits_fn=logits_fn, tx=tx)


@functools.partial(jax.jit, donate_argnums=0)
def train_step(state: TrainState,
               batch_BxT1: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
  """One AdamW update on a [B, T+1] batch.

  The input state is donated: its buffers are reused for the new one, so the
  caller must not touch it afterwards.

  Returns:
    (new state, {'loss': nats/token before the update, 'grad_norm': global
    norm before clipping}).
  """

  def loss_fn(params):
    loss, _ = batch_loss(params, state.logits_fn, batch_BxT1)
    return loss

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  new_state = state.replace(step=state.step + 1, params=params,
                            opt_state=opt_state)
  return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}


@jax.jit
def eval_step(state: TrainState,
              batch_BxT1: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(summed nats float32 [], counted targets float32 []) on a [B, T+1] batch."""
  logits_BxTxV = state.logits_fn(state.params, batch_BxT1[:, :-1])
  return token_nll(logits_BxTxV, batch_BxT1[:, 1:])


def evaluate(state: TrainState, batches_NxBxT1: np.ndarray) -> dict[str, float]:
  """Token-weighted mean loss over an evaluation set.

  Args:
    state: the model to evaluate.
    batches_NxBxT1: int32 [num_batches, B, T+1] (`data.eval_batches`).

  Returns:
    {'loss': nats per token, 'bits_per_byte': loss / ln 2, 'tokens': count}.
  """
  sums = [eval_step(state, b) for b in batches_NxBxT1]
  # Sum on the host in float64: tiny per-batch sums stay exact.
  nll = sum(float(s) for s, _ in sums)
  count = sum(float(c) for _, c in sums)
  loss = nll / max(count, 1.0)
  return {"loss": loss, "bits_per_byte": loss / math.log(2), "tokens": count}


# ----------------------------------------------------------------------------
# Checkpoints.


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


# ----------------------------------------------------------------------------
# Metrics files.


def _read_metrics(path: pathlib.Path) -> list[dict[str, Any]]:
  if not path.exists():
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _truncate_metrics(path: pathlib.Path, last_step: int) -> None:
  """Drops records past `last_step`: an interrupted run logged steps that the
  resumed run will log again."""
  records = [r for r in _read_metrics(path) if r["step"] <= last_step]
  with open(path, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")


def plot_metrics(metrics_path: str | os.PathLike,
                 png_path: str | os.PathLike) -> None:
  """Train and validation bits per byte against step, from metrics.jsonl."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  records = _read_metrics(pathlib.Path(metrics_path))
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for split, style in (("train", "-"), ("validation", "o-")):
    rs = [r for r in records if r["split"] == split]
    if rs:
      ax.plot([r["step"] for r in rs], [r["bits_per_byte"] for r in rs], style,
              label=split, markersize=3)
  ax.axhline(8.0, color="grey", linestyle=":", label="uniform bytes (8 bpb)")
  ax.set_xlabel("step")
  ax.set_ylabel("bits per byte")
  ax.set_ylim(bottom=0)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)


# ----------------------------------------------------------------------------
# The loop.


def fit(state: TrainState, *, train_tokens: np.ndarray,
        val_batches: np.ndarray, config: TrainConfig,
        workdir: str | os.PathLike,
        model_config_dict: Mapping[str, Any]) -> tuple[TrainState, dict[str, Any]]:
  """Trains `state` to `config.num_steps`, resuming from `workdir` if it can.

  Args:
    state: a fresh state (step 0); if `workdir` holds a checkpoint, the run
      continues from its latest one instead (after verification).
    train_tokens: int32 [N] training stream.
    val_batches: int32 [num_batches, B, T+1] fixed validation set.
    config: the run settings.
    workdir: where checkpoints, metrics.jsonl and loss.png go.
    model_config_dict: JSON-able model config, saved with every checkpoint.

  Train records in metrics.jsonl average the steps since the previous log
  of this process, so the first one after a resume that is not on a
  log_every boundary averages fewer steps; validation records are exact.

  Returns:
    (final state, final validation metrics).
  """
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  metrics_path = workdir / METRICS_FILE
  manager = checkpoint_manager(workdir, keep=config.keep_checkpoints)
  latest = manager.latest_step()
  if latest is not None:
    state = restore_train_state(manager, latest, state, model_config_dict)
    logging.info("resumed from %s at step %d", manager.directory, latest)
  start = int(state.step)
  _truncate_metrics(metrics_path, start)

  def record(r):
    with open(metrics_path, "a") as f:
      f.write(json.dumps(r) + "\n")

  schedule = learning_rate_schedule(config)
  pending = []  # device metrics since the last log, fetched together
  t_last, steps_timed = None, 0
  final = None
  for i in range(start, config.num_steps):
    batch = data.train_batch(train_tokens, batch_size=config.batch_size,
                             seq_len=config.seq_len, seed=config.seed, step=i)
    state, metrics = train_step(state, batch)
    pending.append(metrics)
    step = i + 1
    if t_last is None:
      # Start the clock after the first step so compile time is not counted.
      jax.block_until_ready(metrics)
      t_last, steps_timed = time.perf_counter(), 0
    else:
      steps_timed += 1
    if step % config.log_every == 0:
      fetched = jax.device_get(pending)
      now = time.perf_counter()
      loss = float(np.mean([m["loss"] for m in fetched]))
      r = {"step": step, "split": "train", "loss": loss,
           "bits_per_byte": loss / math.log(2),
           "grad_norm": float(fetched[-1]["grad_norm"]),
           "lr": float(schedule(i))}
      eta = ""
      if steps_timed:  # none yet right after compiling or evaluating
        sec_per_step = (now - t_last) / steps_timed
        r["tokens_per_s"] = config.tokens_per_step / sec_per_step
        eta = (f"  {r['tokens_per_s']:.0f} tok/s  "
               f"ETA {sec_per_step * (config.num_steps - step):.0f} s")
      record(r)
      logging.info("step %d/%d  loss %.4f (%.3f bpb)  |g| %.2f  lr %.2e%s",
                   step, config.num_steps, loss, r["bits_per_byte"],
                   r["grad_norm"], r["lr"], eta)
      pending, t_last, steps_timed = [], now, 0
    if step % config.eval_every == 0 or step == config.num_steps:
      final = {"step": step, "split": "validation",
               **evaluate(state, val_batches)}
      record(final)
      logging.info("step %d  validation loss %.4f  %.3f bits/byte", step,
                   final["loss"], final["bits_per_byte"])
      plot_metrics(metrics_path, workdir / PLOT_FILE)
      # Evaluation time is not training time.
      t_last, steps_timed = time.perf_counter(), 0
    if step % config.checkpoint_every == 0 or step == config.num_steps:
      save_checkpoint(manager, state, model_config_dict)
      t_last, steps_timed = time.perf_counter(), 0
  if final is None:  # resumed at or past num_steps: nothing left to train
    final = {"step": int(state.step), "split": "validation",
             **evaluate(state, val_batches)}
  manager.close()
  return state, final


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


def run(model_config, config: TrainConfig,
        workdir: str | os.PathLike) -> dict[str, Any]:
  """Trains a kvjax model on the Austen corpus; returns final validation metrics.

  Raises:
    kvjax.data.CorpusNotFoundError: the corpus is not installed (the message
      names the install command).
  """
  quiet_orbax_logs()
  streams = data.austen_streams(config.data_dir)
  if model_config.vocab_size != data.VOCAB_SIZE:
    raise ValueError(f"model vocab_size={model_config.vocab_size}, but byte "
                     f"tokens need {data.VOCAB_SIZE}")
  val_batches = data.eval_batches(streams.validation,
                                  batch_size=config.batch_size,
                                  seq_len=config.seq_len,
                                  num_batches=config.eval_batches)
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  model_config_dict = model_config.to_dict()
  with open(workdir / CONFIG_FILE, "w") as f:
    json.dump({"model": model_config_dict, "train": dataclasses.asdict(config)},
              f, indent=2)
  logging.info("model %s: %d parameters; train %d tokens, validation %d "
               "tokens (%d evaluated)", model_config.variant,
               kvjax.param_count(model_config), streams.train.shape[0],
               streams.validation.shape[0], val_batches[..., 1:].size)
  # One compiled program instead of one dispatch (and compile) per tensor.
  params = jax.jit(kvjax.init_params, static_argnums=0)(
      model_config, jax.random.key(config.seed))
  state = create_train_state(params, model_logits_fn(model_config),
                             make_optimizer(config))
  start = time.perf_counter()
  _, final = fit(state, train_tokens=streams.train, val_batches=val_batches,
                 config=config, workdir=workdir,
                 model_config_dict=model_config_dict)
  final["wall_s"] = time.perf_counter() - start
  with open(workdir / "final.json", "w") as f:
    json.dump(final, f, indent=2)
  logging.info("done: validation %.4f nats/byte = %.3f bits/byte at step %d "
               "(%.0f s)", final["loss"], final["bits_per_byte"], final["step"],
               final["wall_s"])
  return final
