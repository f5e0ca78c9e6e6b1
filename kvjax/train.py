"""Training: loss, optimiser, jitted train/eval steps, the loop.

Dimension alphabet (as in `kvjax.config`): B batch, T sequence length,
V vocab, D model width, L layers, T' a token stream's length.

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

Workdir layout written by `fit` (checkpoints: `kvjax.orbax_checkpoint`):
  checkpoints/<step>/params/                 orbax, params only (for inference)
  checkpoints/<step>/train/                  orbax, {'step', 'opt_state'}
  checkpoints/<step>/model_config/model_config.json   rebuilds the model
  metrics.jsonl                              one JSON object per log/eval
  loss.png                                   train/validation bits per byte
                                             (and first-token mass)
  config.json                                the full run config (`run` only)
"""

from __future__ import annotations

import dataclasses
import functools
import json
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

import kvjax
from kvjax import allocator
from kvjax import data
from kvjax import mixed_precision
from kvjax import orbax_checkpoint
from kvjax import packed
from kvjax import probe

Params = Any
LogitsFn = Callable[[Params, jax.Array], jax.Array]

MATMUL_DTYPES = ("auto", "float32", "bfloat16")
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
CONFIG_FILE = "config.json"

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
  bos: bool = False  # rows start with BOS (`data.train_batch`)
  # Operands of the model's matrix products: 'float32', or 'bfloat16' with
  # float32 accumulation (`kvjax.mixed_precision`; params, activations,
  # softmax, loss and optimiser stay float32), or 'auto': whichever of the
  # two this backend multiplies faster (`resolve_matmul_dtype`).
  # Evaluation is float32.
  matmul_dtype: str = "float32"
  # The step's rows in this many groups, each its own forward and backward,
  # their gradients summed: the batch's gradient up to float reassociation.
  # Independent chains let XLA:CPU run one group's single-threaded
  # elementwise fusions beside another's products (WORKSPACE.md "Training
  # speed": 4 groups measured faster on the AMD EPYC Zen 4).
  microbatches: int = 1
  data_dir: str | None = None  # None: $KVJAX_DATA_DIR or ./data/janeaustenr

  def __post_init__(self):
    for name in ("seq_len", "batch_size", "num_steps", "eval_every",
                 "eval_batches", "checkpoint_every", "keep_checkpoints",
                 "log_every", "microbatches"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    for name in ("warmup_steps", "weight_decay", "clip", "seed"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
    if not self.lr > 0:
      raise ValueError(f"lr must be > 0, got {self.lr}")
    if not 0 <= self.min_lr_ratio <= 1:
      raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
    _check_matmul_dtype(self.matmul_dtype)
    if self.batch_size % self.microbatches:
      raise ValueError(f"microbatches={self.microbatches} must divide "
                       f"batch_size={self.batch_size}")
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


def _check_matmul_dtype(matmul_dtype: str) -> None:
  if matmul_dtype not in MATMUL_DTYPES:
    raise ValueError(f"matmul_dtype must be one of {MATMUL_DTYPES}, got "
                     f"{matmul_dtype!r}")


# ----------------------------------------------------------------------------
# Model glue.


def resolve_matmul_dtype(matmul_dtype: str) -> str:
  """The product precision a run takes: 'float32' or 'bfloat16' as given;
  'auto' -> `mixed_precision.fastest_matmul_dtype()` (bfloat16 on the Intel
  Xeon host's AMX, float32 on the AMD EPYC host's AVX2, measured in the
  process)."""
  _check_matmul_dtype(matmul_dtype)
  if matmul_dtype == "auto":
    return mixed_precision.fastest_matmul_dtype()
  return matmul_dtype


def model_logits_fn(model_config, matmul_dtype: str = "float32") -> LogitsFn:
  """`logits_fn` for a kvjax model: (params, tokens [B,T]) -> logits [B,T,V];
  with matmul_dtype 'bfloat16' its products run on bfloat16 operands with
  float32 accumulation (`mixed_precision.bf16_matmuls`); 'auto' takes the
  faster of the two on this backend (`resolve_matmul_dtype`)."""
  matmul_dtype = resolve_matmul_dtype(matmul_dtype)

  def logits_fn(params, tokens_BT):
    # The training layout is chosen inside the step (`packed.for_training`):
    # the state and checkpoints stay canonical.
    return kvjax.forward(packed.for_training(params, model_config),
                         model_config, tokens_BT)

  if matmul_dtype == "bfloat16":
    return mixed_precision.bf16_matmuls(logits_fn)
  return logits_fn


# ----------------------------------------------------------------------------
# Loss and optimiser.


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """-log p(target) per token, in float32: logits [..., V], targets [...]
  int -> [...]. The one definition of the loss: training, evaluation, the
  streaming evaluation and the task models all use it."""
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return lse - picked


def masked_nll(logits_BTV: jax.Array,
               targets_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`token_nll` summed over non-PAD targets: (sum of nats float32 [],
  number of counted targets float32 [])."""
  mask_BT = (targets_BT != data.PAD).astype(jnp.float32)
  return (jnp.sum(token_nll(logits_BTV, targets_BT) * mask_BT),
          jnp.sum(mask_BT))


def batch_loss(params: Params, logits_fn: LogitsFn,
               batch: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Mean nats per target token of one [B, T+1] batch, and the target count."""
  logits_BTV = logits_fn(params, batch[:, :-1])
  nll_sum, count = masked_nll(logits_BTV, batch[:, 1:])
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
  # What evaluation runs: the model at inference precision (logits_fn may
  # round its products for speed, `TrainConfig.matmul_dtype`).
  eval_logits_fn: LogitsFn | None = flax.struct.field(pytree_node=False,
                                                      default=None)
  # Row groups per step (`TrainConfig.microbatches`).
  microbatches: int = flax.struct.field(pytree_node=False, default=1)


def create_train_state(params: Params, logits_fn: LogitsFn,
                       tx: optax.GradientTransformation,
                       eval_logits_fn: LogitsFn | None = None,
                       microbatches: int = 1) -> TrainState:
  """A fresh state at step 0; evaluation runs `eval_logits_fn` (default
  `logits_fn`); each step splits its rows into `microbatches` groups
  (`TrainConfig.microbatches`; it must divide the batch)."""
  if microbatches < 1:
    raise ValueError(f"microbatches must be >= 1, got {microbatches}")
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=tx.init(params), logits_fn=logits_fn, tx=tx,
                    eval_logits_fn=eval_logits_fn or logits_fn,
                    microbatches=microbatches)


def loss_and_grads(params: Params, logits_fn: LogitsFn, batch: jax.Array,
                   microbatches: int = 1) -> tuple[jax.Array, Params]:
  """`batch_loss` of a [B, T+1] batch and its gradient, from `microbatches`
  groups of B / microbatches rows, each its own forward and backward: every
  group's nats are divided by the whole batch's target count (which the
  params do not change), so the groups' losses and gradients sum to the
  batch's. One group is `batch_loss`'s computation exactly.
  """
  B = batch.shape[0]
  if B % microbatches:
    raise ValueError(f"microbatches={microbatches} must divide the batch's "
                     f"{B} rows")
  count = jnp.sum(batch[:, 1:] != data.PAD).astype(jnp.float32)

  def group_loss(params, rows):
    nll_sum, _ = masked_nll(logits_fn(params, rows[:, :-1]), rows[:, 1:])
    return nll_sum / jnp.maximum(count, 1.0)

  # A Python loop, not a scan or vmap: the groups stay separate chains in
  # the program, which the runtime may execute side by side.
  loss, grads = None, None
  for rows in jnp.split(batch, microbatches):
    l, g = jax.value_and_grad(group_loss)(params, rows)
    loss = l if loss is None else loss + l
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
  return loss, grads


@functools.partial(jax.jit, donate_argnums=0)
def train_step(state: TrainState,
               batch: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
  """One AdamW update on a [B, T+1] batch.

  The input state is donated: its buffers are reused for the new one, so the
  caller must not touch it afterwards.

  Returns:
    (new state, {'loss': nats/token before the update, 'grad_norm': global
    norm before clipping}).
  """

  loss, grads = loss_and_grads(state.params, state.logits_fn, batch,
                               state.microbatches)
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  new_state = state.replace(step=state.step + 1, params=params,
                            opt_state=opt_state)
  return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}


@jax.jit
def eval_step(state: TrainState,
              batch: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(summed nats float32 [], counted targets float32 []) on a [B, T+1] batch."""
  logits_fn = state.eval_logits_fn or state.logits_fn
  logits_BTV = logits_fn(state.params, batch[:, :-1])
  return masked_nll(logits_BTV, batch[:, 1:])


def evaluate(state: TrainState, batches: np.ndarray) -> dict[str, float]:
  """Token-weighted mean loss over an evaluation set.

  Args:
    state: the model to evaluate.
    batches: int32 [num_batches, B, T+1] (`data.eval_batches`).

  Returns:
    {'loss': nats per token, 'bits_per_byte': loss / ln 2, 'tokens': count}.
  """
  sums = [eval_step(state, b) for b in batches]
  # Sum on the host in float64: tiny per-batch sums stay exact.
  nll = sum(float(s) for s, _ in sums)
  count = sum(float(c) for _, c in sums)
  loss = nll / max(count, 1.0)
  return {"loss": loss, "bits_per_byte": loss / math.log(2), "tokens": count}


# ----------------------------------------------------------------------------
# Metrics files.


def read_metrics(path: pathlib.Path) -> list[dict[str, Any]]:
  """The records of a run's metrics.jsonl, in order ([] when it is absent)."""
  if not path.exists():
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _truncate_metrics(path: pathlib.Path, last_step: int) -> None:
  """Drops records past `last_step`: an interrupted run logged steps that the
  resumed run will log again."""
  records = [r for r in read_metrics(path) if r["step"] <= last_step]
  with open(path, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")


def plot_metrics(metrics_path: str | os.PathLike,
                 png_path: str | os.PathLike, seq_len: int = 0) -> list[str]:
  """Train and validation bits per byte against step, from metrics.jsonl;
  with validation records that carry `sink_mass_layers` (the first token's
  attention mass per layer, `probe.first_token_mass`), a second panel of
  that mass against step, beside uniform causal attention's for queries
  from seq_len / 2 on (`seq_len` > 0). Returns the panels' y labels."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  records = read_metrics(pathlib.Path(metrics_path))
  sinks = [r for r in records if r["split"] == "validation" and
           r.get("sink_mass_layers")]
  fig, axes = plt.subplots(1, 2 if sinks else 1,
                           figsize=(12, 4.5) if sinks else (7, 4.5),
                           squeeze=False)
  ax = axes[0][0]
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
  if sinks:
    ax = axes[0][1]
    steps = [r["step"] for r in sinks]
    for l in range(len(sinks[0]["sink_mass_layers"])):
      ax.plot(steps, [max(r["sink_mass_layers"][l], 1e-7) for r in sinks],
              "o-", ms=3, label=f"layer {l}")
    ax.plot(steps, [max(r["sink_mass_max"], 1e-7) for r in sinks], ":",
            color="black", label="largest head")
    if seq_len > 1:
      uniform = float(np.mean(1.0 / np.arange(seq_len // 2 + 1,
                                              seq_len + 1)))
      ax.axhline(uniform, color="grey", ls="--",
                 label=f"uniform attention ({uniform:.4f})")
    ax.set(yscale="log", xlabel="step", ylabel="attention on the first "
           "token (queries in the second half)",
           title="attention sinks: first-token mass per layer")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  labels = [a.get_ylabel() for a in fig.get_axes()]
  plt.close(fig)
  return labels


# ----------------------------------------------------------------------------
# The loop.


def austen_batches(train_tokens: np.ndarray, config: TrainConfig
                   ) -> Callable[[int], tuple[np.ndarray]]:
  """The batch function of a byte-stream run: update i trains on
  `data.train_batch(train_tokens, ..., seed=config.seed, step=i)`."""

  def batch_fn(i: int):
    return (data.train_batch(train_tokens, batch_size=config.batch_size,
                             seq_len=config.seq_len, seed=config.seed,
                             step=i, bos=config.bos),)

  return batch_fn


def fit(state: TrainState, *, batch_fn: Callable[[int], tuple],
        evaluate_fn: Callable[[TrainState], dict[str, float]],
        config: TrainConfig, workdir: str | os.PathLike,
        model_config_dict: Mapping[str, Any],
        step_fn: Callable[..., tuple[TrainState, dict]] | None = None
        ) -> tuple[TrainState, dict[str, Any]]:
  """Trains `state` to `config.num_steps`, resuming from `workdir` if it can.

  The one training loop (the Austen models, the ablation, the task models):
  update i runs `step_fn(state, *batch_fn(i))`, so a resumed run sees the
  same batches; every `eval_every` steps and at the end it records
  `evaluate_fn(state)`; every `checkpoint_every` steps it saves an orbax
  checkpoint with the model config beside it.

  Args:
    state: a fresh state (step 0); if `workdir` holds a checkpoint, the run
      continues from its latest one instead (after verification).
    batch_fn: update index -> the step's batch arguments (a tuple).
    evaluate_fn: state -> validation metrics ({'loss', 'bits_per_byte',
      ...}).
    config: the run settings.
    workdir: where checkpoints, metrics.jsonl and loss.png go.
    model_config_dict: JSON-able model config, saved with every checkpoint.
    step_fn: (state, *batch) -> (state, {'loss', 'grad_norm'}); default
      `train_step` (one [B, T+1] array, loss on every non-PAD target).

  Train records in metrics.jsonl average the steps since the previous log
  of this process, so the first one after a resume that is not on a
  log_every boundary averages fewer steps; validation records are exact.

  Returns:
    (final state, final validation metrics).
  """
  step_fn = train_step if step_fn is None else step_fn
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  metrics_path = workdir / METRICS_FILE
  manager = orbax_checkpoint.checkpoint_manager(
      workdir, keep=config.keep_checkpoints)
  latest = manager.latest_step()
  if latest is not None:
    state = orbax_checkpoint.restore_train_state(manager, latest, state,
                                                 model_config_dict)
    logging.info("resumed from %s at step %d", manager.directory, latest)
  start = int(state.step)
  _truncate_metrics(metrics_path, start)

  def record(r):
    with open(metrics_path, "a") as f:
      f.write(json.dumps(r) + "\n")

  schedule = learning_rate_schedule(config)
  pending = []  # device metrics since the last log, fetched together
  t_last, steps_timed = None, 0
  t0 = time.perf_counter()
  final = None
  for i in range(start, config.num_steps):
    state, metrics = step_fn(state, *batch_fn(i))
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
           "lr": float(schedule(i)), "elapsed_s": now - t0}
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
      final = {"step": step, "split": "validation", **evaluate_fn(state)}
      record(final)
      logging.info("step %d  validation %s", step, "  ".join(
          f"{k} {v:.4f}" for k, v in final.items()
          if k not in ("step", "split") and isinstance(v, float)))
      plot_metrics(metrics_path, workdir / PLOT_FILE, config.seq_len)
      # Evaluation time is not training time.
      t_last, steps_timed = time.perf_counter(), 0
    if step % config.checkpoint_every == 0 or step == config.num_steps:
      orbax_checkpoint.save_checkpoint(manager, state, model_config_dict)
      t_last, steps_timed = time.perf_counter(), 0
  if final is None:  # resumed at or past num_steps: nothing left to train
    final = {"step": int(state.step), "split": "validation",
             **evaluate_fn(state)}
  manager.close()
  return state, final


def run(model_config, config: TrainConfig,
        workdir: str | os.PathLike) -> dict[str, Any]:
  """Trains a kvjax model on the Austen corpus; returns final validation metrics.

  Raises:
    kvjax.data.CorpusNotFoundError: the corpus is not installed (the message
      names the install command).
  """
  # Before anything starts the JAX backend: XLA's buffers stay mapped
  # between steps (kvjax/allocator.py; False where the backend already runs).
  allocator.keep_host_memory()
  orbax_checkpoint.quiet_orbax_logs()
  streams = data.austen_streams(config.data_dir)
  if model_config.vocab_size != data.VOCAB_SIZE:
    raise ValueError(f"model vocab_size={model_config.vocab_size}, but byte "
                     f"tokens need {data.VOCAB_SIZE}")
  val_batches = data.eval_batches(streams.validation,
                                  batch_size=config.batch_size,
                                  seq_len=config.seq_len,
                                  num_batches=config.eval_batches,
                                  bos=config.bos)
  # 'auto' resolved once, here: config.json and the log name the precision
  # the run's products take.
  config = dataclasses.replace(
      config, matmul_dtype=resolve_matmul_dtype(config.matmul_dtype))
  logging.info("matmul products in %s", config.matmul_dtype)
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
  state = create_train_state(
      params, model_logits_fn(model_config, config.matmul_dtype),
      make_optimizer(config), eval_logits_fn=model_logits_fn(model_config),
      microbatches=config.microbatches)
  start = time.perf_counter()
  # Attention sinks as training goes: the first token's attention mass on
  # the first validation batch, every evaluation (`probe.first_token_mass`).
  sink_rows = val_batches[0][:4, :-1]

  def evaluate_fn(st):
    out = evaluate(st, val_batches)
    if model_config.attention_impl == "einsum":
      mass_LN = np.asarray(probe.first_token_mass(
          probe.attention_probs(st.params, model_config, sink_rows),
          config.seq_len // 2))
      out.update(sink_mass=float(mass_LN.mean()),
                 sink_mass_max=float(mass_LN.max()),
                 sink_mass_layers=mass_LN.mean(axis=1).tolist())
    return out

  _, final = fit(state, batch_fn=austen_batches(streams.train, config),
                 evaluate_fn=evaluate_fn,
                 config=config, workdir=workdir,
                 model_config_dict=model_config_dict)
  final["wall_s"] = time.perf_counter() - start
  with open(workdir / "final.json", "w") as f:
    json.dump(final, f, indent=2)
  logging.info("done: validation %.4f nats/byte = %.3f bits/byte at step %d "
               "(%.0f s)", final["loss"], final["bits_per_byte"], final["step"],
               final["wall_s"])
  return final
