r"""Long-context task accuracy against cache budget, per eviction policy.

Generates `kvjax.lab.tasks` examples (passkey, RULER NIAH, MQAR) at several
lengths and needle depths, answers them greedily through each cache policy
at each budget (`kvjax.lab.task_eval`), and reports exact-match accuracy.

  python experiments/task_eval.py --workdir=workdir/task_eval
  python experiments/task_eval.py --checkpoint=workdir/tasks-gqa-passkey \
      --tasks=passkey --lengths=256,512,1024 --workdir=workdir/task_eval_pk

Models: --checkpoint is a training workdir
(`kvjax.orbax_checkpoint.restore_params`: the shipped checkpoints/austen-gqa,
or a task model from
`python -m kvjax.lab.tasks --config=configs/tasks.py:gqa-passkey`); with
--checkpoint='' a random-weight preset from --model (a smoke run: it
scores ~0, the chance level of exact match, and ~ -A·ln 259 nats of
teacher-forced log-likelihood).

Outputs in --workdir: results.json (every record, the accuracy tables with
95 % Wilson intervals, flags, the machine incl. the CPU model), table.md,
budget.png (accuracy against cache budget and KV bytes, one curve per
policy, one panel per task), heatmap.png (accuracy over length × depth per
task and policy at --heatmap_budget).
"""

import json
import os
import time


from absl import flags
from absl import logging
import jax
import numpy as np
from ml_collections import config_flags

import kvjax
from kvjax import cli
from kvjax import configs
from kvjax import data
from kvjax import orbax_checkpoint
from kvjax.lab import benchmarking as bm
from kvjax.lab import task_eval
from kvjax.lab import tasks

_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.",
                               required=True)
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", "checkpoints/austen-gqa",
    "Training workdir (kvjax.orbax_checkpoint.restore_params); empty: a "
    "random-weight model from --model.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: last).")
_MODEL = config_flags.DEFINE_config_file(
    "model", "configs/model.py:gqa-tiny",
    "Random-weight preset, used only with --checkpoint=''.", lock_config=True)
_TASKS = flags.DEFINE_list("tasks", "passkey,niah_single,mqar",
                           f"Task names from {sorted(tasks.TASKS)}.")
_LENGTHS = flags.DEFINE_list("lengths", "256,1024", "Prompt lengths T.")
_DEPTHS = flags.DEFINE_list("depths", "0,0.5,1", "Needle depths in [0, 1].")
_SAMPLES = flags.DEFINE_integer("samples", 2,
                                "Examples per (task, length, depth).")
_SEED = flags.DEFINE_integer("seed", 0, "First example seed.")
_POLICIES = flags.DEFINE_list(
    "policies", "full,window,sinks4,h2o",
    "full, window, sinks<n>, h2o; ':original' / ':cache' picks the RoPE "
    "position mode.")
_BUDGETS = flags.DEFINE_list("budgets", "0.1,0.5",
                             "Cache slots as a share of the prompt, (0, 1].")
_HEATMAP_BUDGET = flags.DEFINE_float(
    "heatmap_budget", None, "Budget of the heatmaps (default: the median of "
    "--budgets).")
_LOGLIK = flags.DEFINE_bool("loglik", False,
                            "Also score teacher-forced answer "
                            "log-likelihood (a second pass per cell).")
_BATCH = flags.DEFINE_integer("batch_size", 16,
                              "Most examples per generate call.")
_DATA_DIR = flags.DEFINE_string("data_dir", None,
                                "Austen corpus for text haystacks (default: "
                                "kvjax.data's; noise filler if missing).")


def load_model():
  """(config, params, description)."""
  if _CHECKPOINT.value:
    config, params = orbax_checkpoint.restore_params(_CHECKPOINT.value,
                                                     _STEP.value)
    return config, params, f"checkpoint {_CHECKPOINT.value}"
  logging.warning("random weights (--checkpoint=''): a smoke run only")
  config = configs.model_config(_MODEL.value.model).replace(
      vocab_size=data.VOCAB_SIZE)
  return config, kvjax.init_params(config, jax.random.key(0)), (
      f"random {_MODEL.value.preset}")


def summarize(records):
  """Rows (task, policy, budget, kv_bytes, accuracy, CI, n)."""
  rows = []
  grid = task_eval.accuracy_grid(records, keys=("task", "policy", "budget"))
  kv = task_eval.accuracy_grid(records, "kv_bytes",
                               keys=("task", "policy", "budget"))
  for (task, policy, budget), (acc, n) in grid.items():
    lo, hi = task_eval.wilson_interval(acc * n, n)
    rows.append(dict(task=task, policy=policy, budget=budget,
                     kv_bytes_mean=kv[(task, policy, budget)][0],
                     accuracy=acc, ci95=[lo, hi], n=n))
  return rows


def markdown(rows, task_names, policies, budgets) -> str:
  """Accuracy per task and policy (rows) and budget (columns); the full
  cache is budget-free and shows under 1."""
  budgets = sorted(set(budgets) | {1.0})
  head = "| task | policy | " + " | ".join(f"{b:g}" for b in budgets) + " |"
  lines = [head, "|" + "---|" * (2 + len(budgets))]
  cell = {(r["task"], r["policy"], r["budget"]): r for r in rows}
  for task in task_names:
    for p in policies:
      vals = []
      for b in budgets:
        r = cell.get((task, p, b))
        vals.append("" if r is None else f"{r['accuracy']:.2f} (n={r['n']})")
      lines.append(f"| {task} | {p} | " + " | ".join(vals) + " |")
  return "\n".join(lines)


def plot_budget(rows, path, task_names, budgets, title):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, len(task_names), squeeze=False,
                           figsize=(5 * len(task_names), 4))
  for ax, task in zip(axes[0], task_names):
    for policy in dict.fromkeys(r["policy"] for r in rows):
      rs = sorted((r for r in rows if r["task"] == task and
                   r["policy"] == policy), key=lambda r: r["budget"])
      x = [r["budget"] for r in rs]
      y = [r["accuracy"] for r in rs]
      err = np.array([[r["accuracy"] - r["ci95"][0] for r in rs],
                      [r["ci95"][1] - r["accuracy"] for r in rs]])
      if policy == "full":
        ax.axhspan(rs[0]["ci95"][0], rs[0]["ci95"][1], color="grey",
                   alpha=0.2)
        ax.axhline(y[0], color="grey", linestyle="--",
                   label=f"full cache ({y[0]:.2f})")
        continue
      ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=policy)
    ax.set_xlim(0, 1.05)
    ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
    ax.set_xlabel("cache budget (slots / prompt length; all lengths pooled)")
    ax.set_ylabel("exact-match accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(task)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_heatmaps(records, path, task_names, budget, policies, title):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(len(task_names), len(policies), squeeze=False,
                           figsize=(3.2 * len(policies),
                                    2.6 * len(task_names)))
  for i, task in enumerate(task_names):
    for j, policy in enumerate(policies):
      ax = axes[i, j]
      rs = [r for r in records if r["task"] == task and
            r["policy"] == policy and
            (policy == "full" or r["budget"] == budget)]
      grid = task_eval.accuracy_grid(rs, keys=("length", "depth"))
      lengths = sorted({k[0] for k in grid})
      depths = sorted({k[1] for k in grid})
      img = np.full((len(lengths), len(depths)), np.nan)
      for (n, d), (acc, _) in grid.items():
        img[lengths.index(n), depths.index(d)] = acc
      ax.imshow(img, vmin=0, vmax=1, cmap="viridis", aspect="auto",
                origin="lower")
      for a in range(len(lengths)):
        for b in range(len(depths)):
          if not np.isnan(img[a, b]):
            ax.text(b, a, f"{img[a, b]:.2f}", ha="center", va="center",
                    color="white" if img[a, b] < 0.5 else "black",
                    fontsize=8)
      ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
      ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
      ax.set_xlabel("needle depth")
      ax.set_ylabel("prompt length")
      ax.set_title(f"{task}\n{policy}" +
                   ("" if policy == "full" else f" @ {budget:g}"),
                   fontsize=9)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  if len(argv) > 1:
    raise cli.UsageError(f"unexpected arguments: {argv[1:]}")
  lengths = [int(n) for n in _LENGTHS.value]
  depths = [float(d) for d in _DEPTHS.value]
  budgets = sorted(task_eval.check_budget(float(b)) for b in _BUDGETS.value)
  specs = [task_eval.parse_policy(p) for p in _POLICIES.value]
  for name in _TASKS.value:
    spec = tasks.get_task(name)
    for n in lengths:
      if n < tasks.min_length(spec):
        raise ValueError(f"length={n} is below the minimum "
                         f"{tasks.min_length(spec)} of task {name!r}")
  # Every (policy, budget, length) must be runnable before anything runs.
  for s in specs:
    for b in budgets:
      for n in lengths:
        s.capacity(b, n, 1)
  heat_budget = (_HEATMAP_BUDGET.value if _HEATMAP_BUDGET.value is not None
                 else budgets[len(budgets) // 2])
  task_eval.check_budget(heat_budget)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  orbax_checkpoint.quiet_orbax_logs()
  config, params, what = load_model()
  too_long = [n for n in lengths if n + 64 > config.max_seq_len]
  if too_long:
    raise ValueError(f"lengths {too_long} exceed the model's max_seq_len="
                     f"{config.max_seq_len}")
  haystack = tasks.load_haystack("validation", _DATA_DIR.value)
  examples = {name: tasks.task_set(name, lengths, depths, _SAMPLES.value,
                                   _SEED.value, haystack)
              for name in _TASKS.value}
  logging.info("model: %s (%s, %d params); %d examples per task",
               what, config.variant, kvjax.param_count(config),
               len(next(iter(examples.values()))))
  records, seconds = [], {}
  t_all = time.perf_counter()
  for name, exs in examples.items():
    for s in specs:
      for b in ([1.0] if s.kind == "full" else budgets):
        t0 = time.perf_counter()
        records += task_eval.evaluate(params, config, exs, s, b,
                                      batch_size=_BATCH.value,
                                      loglik=_LOGLIK.value)
        seconds[f"{name}/{s.name}/{b:g}"] = time.perf_counter() - t0
  rows = summarize(records)
  md = markdown(rows, _TASKS.value, [s.name for s in specs], budgets)
  print(f"model: {what}; exact-match accuracy, all lengths {lengths} and "
        f"depths {depths} pooled ('full' is budget-free: shown under 1)")
  print(md)
  heat = {}
  for name in _TASKS.value:
    for s in specs:
      rs = [r for r in records if r["task"] == name and r["policy"] == s.name
            and (s.kind == "full" or r["budget"] == heat_budget)]
      heat[f"{name}/{s.name}"] = {
          f"{n}/{d:g}": acc for (n, d), (acc, _) in
          task_eval.accuracy_grid(rs, keys=("length", "depth")).items()}
  fillers = sorted({r["filler"] for r in records})
  title = (f"{what} ({config.variant}); {_SAMPLES.value} samples per "
           f"length x depth; lengths {lengths}; filler {fillers}")
  plot_budget(rows, os.path.join(_WORKDIR.value, "budget.png"),
              _TASKS.value, budgets, title)
  plot_heatmaps(records, os.path.join(_WORKDIR.value, "heatmap.png"),
                _TASKS.value, heat_budget, [s.name for s in specs], title)
  machine = dict(cpu_model=bm.cpu_model(), cpu_count=os.cpu_count(),
                 jax=jax.__version__, backend=jax.default_backend(),
                 loadavg=os.getloadavg())
  out = dict(model=what, variant=config.variant,
             params=kvjax.param_count(config), machine=machine,
             flags={f.name: f.value for f in (
                 _CHECKPOINT, _STEP, _TASKS, _LENGTHS, _DEPTHS, _SAMPLES,
                 _SEED, _POLICIES, _BUDGETS, _LOGLIK, _BATCH)},
             heatmap_budget=heat_budget, fillers=fillers, table=rows,
             heatmaps=heat, seconds=seconds,
             wall_s=time.perf_counter() - t_all, records=records)
  with open(os.path.join(_WORKDIR.value, "results.json"), "w") as f:
    json.dump(out, f, indent=1)
  with open(os.path.join(_WORKDIR.value, "table.md"), "w") as f:
    f.write(md + "\n")
  logging.info("wrote %s (%.0f s, %s)", _WORKDIR.value, out["wall_s"],
               machine["cpu_model"])


if __name__ == "__main__":
  cli.run(main)
