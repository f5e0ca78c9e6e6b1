r"""Long-context task accuracy against KV-cache bytes, per eviction policy
and storage format.

Generates `kvjax.lab.tasks` examples (passkey, RULER NIAH, MQAR) at several
lengths and needle depths, in --seeds independent draws, answers them
greedily through each cache policy × kv dtype at each budget
(`kvjax.lab.task_eval`), and reports exact-match accuracy. Which policy
keeps the needle at 10 % of the cache:

  python experiments/policy_eval.py --workdir=workdir/policy_eval
  python experiments/policy_eval.py --checkpoint=workdir/tasks-gqa-passkey \
      --tasks=passkey --lengths=256 --kv_dtypes=float32,int8,kivi \
      --workdir=workdir/task_eval_pk
  python experiments/policy_eval.py \
      --checkpoint=checkpoints/tasks-gqa-passkey_mqar \
      --tasks=passkey,mqar1_flat --lengths=passkey:256,mqar1_flat:32 \
      --budgets=0.25,0.5,0.75 --workdir=workdir/task_eval_both

Policies: full, window, sinks<n> and every scored policy of
`kvjax.policies` (h2o, tova, knorm, snapkv, pyramid, adakv, keydiff), each
with `recent` = half the slots. Per-layer/head policies (snapkv, tova,
knorm, ...) compress a prompt longer than their budget once at prefill
(SnapKV); with '@stream' they evict during decode instead, the prompt fed
token by token — the comparison of prefill-time compression with
decode-time eviction.

Models: --checkpoint is a training workdir
(`kvjax.orbax_checkpoint.restore_params`: the shipped passkey model
checkpoints/tasks-gqa-passkey, trained at T = 256, or one from
`python -m kvjax.lab.tasks --config=configs/tasks.py:gqa-passkey`);
with --checkpoint='' a random-weight preset from --model (a smoke run: it
scores ~0, the chance level of exact match, and ~ -A·ln 259 nats of
teacher-forced log-likelihood).

Outputs in --workdir: results.json (every record, the accuracy table with
95 % Wilson intervals and the per-draw accuracies, the best and worst
policy, flags, commit, the machine incl. the CPU model), table.md,
budget.png (accuracy against KV bytes per sequence, one curve per policy
and format, one panel per task and length), depth_budget.png (needle
depth × budget for the best and the worst policy), heatmap.png (accuracy
over length × depth per policy at --heatmap_budget).
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
    "checkpoint", "checkpoints/tasks-gqa-passkey",
    "Training workdir (kvjax.orbax_checkpoint.restore_params); empty: a "
    "random-weight model from --model.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: last).")
_MODEL = config_flags.DEFINE_config_file(
    "model", "configs/model.py:gqa-tiny",
    "Random-weight preset, used only with --checkpoint=''.", lock_config=True)
_TASKS = flags.DEFINE_list("tasks", "passkey",
                           f"Task names from {sorted(tasks.TASKS)}.")
_LENGTHS = flags.DEFINE_list(
    "lengths", "256", "Prompt lengths T: 'T' for every task, 'task:T' for "
    "one (a model of several tasks at each one's training length, e.g. "
    "passkey:256,mqar1_flat:32).")
_DEPTHS = flags.DEFINE_list("depths", "0,0.25,0.5,0.75,1",
                            "Needle depths in [0, 1].")
_SAMPLES = flags.DEFINE_integer("samples", 4,
                                "Examples per (task, length, depth).")
_SEED = flags.DEFINE_integer("seed", 0, "First example seed.")
_POLICIES = flags.DEFINE_list(
    "policies", "full,window,sinks4,h2o,tova,snapkv,snapkv@stream,knorm,"
    "pyramid,adakv,keydiff",
    "full, window, sinks<n> or a scored policy of kvjax.policies (h2o, "
    "tova, knorm, snapkv, pyramid, adakv, keydiff); ':original' / ':cache' "
    "picks the RoPE position mode, '@stream' evicts during decode instead "
    "of compressing the prompt at prefill.")
_KV_DTYPES = flags.DEFINE_list(
    "kv_dtypes", "float32,bfloat16,int8,kivi",
    f"Cache storage formats from {task_eval.KV_FORMATS} ('kivi', "
    "'kivi4' and 'kivi2', KIVI at 8, 4 and 2 bits, run with policy 'full' "
    "only).")
_SEEDS = flags.DEFINE_integer(
    "seeds", 3, "Independent draws of the task data (seeds --seed, "
    "--seed + 10000, ...): accuracy is reported pooled and per draw.")
_BUDGETS = flags.DEFINE_list("budgets", "0.1,0.25,0.5,0.75",
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


SEED_STRIDE = 10000  # seeds of one draw: seed + i for i < samples


def label(r) -> str:
  return (r["policy"] if r["kv_dtype"] == "float32" else
          f"{r['policy']} [{r['kv_dtype']}]")


def summarize(records):
  """Rows per (task, length, policy, kv dtype, budget): accuracy pooled
  over depths and draws with its 95 % Wilson interval, the accuracy of
  each draw of the data (`--seeds`) and their standard deviation, and the
  KV bytes of one sequence's cache."""
  keys = ("task", "length", "policy", "kv_dtype", "budget")
  grid = task_eval.accuracy_grid(records, keys=keys)
  kv = task_eval.accuracy_grid(records, "kv_bytes", keys=keys)
  per_draw = task_eval.accuracy_grid(records, keys=keys + ("draw",))
  rows = []
  for key, (acc, n) in grid.items():
    lo, hi = task_eval.wilson_interval(acc * n, n)
    draws = [a for k, (a, _) in per_draw.items() if k[:-1] == key]
    row = dict(zip(keys, key))
    row.update(label=label(row), kv_bytes=kv[key][0], accuracy=acc,
               ci95=[lo, hi], n=n, draws=draws,
               draw_std=float(np.std(draws, ddof=1)) if len(draws) > 1
               else 0.0)
    rows.append(row)
  return rows


def markdown(rows, budgets) -> str:
  """Accuracy per task, length and policy (rows) and budget (columns),
  with the draws' standard deviation; the full cache is budget-free and
  shows under 1."""
  budgets = sorted(set(budgets) | {1.0})
  head = ("| task | T | policy | " + " | ".join(f"{b:g}" for b in budgets) +
          " |")
  lines = [head, "|" + "---|" * (3 + len(budgets))]
  cell = {(r["task"], r["length"], r["label"], r["budget"]): r for r in rows}
  for task, length, lab in dict.fromkeys(
      (r["task"], r["length"], r["label"]) for r in rows):
    vals = []
    for b in budgets:
      r = cell.get((task, length, lab, b))
      vals.append("" if r is None else
                  f"{r['accuracy']:.2f} ± {r['draw_std']:.2f}")
    lines.append(f"| {task} | {length} | {lab} | " + " | ".join(vals) + " |")
  return "\n".join(lines)


def plot_budget(rows, path, title):
  """Accuracy against the KV bytes one sequence's cache holds, one panel
  per (task, length), one curve per policy and format (95 % Wilson
  intervals): a colour per policy, a marker per kv dtype, the legend
  beside the panels; the full cache is a point at its bytes and a dashed
  line."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  panels = list(dict.fromkeys((r["task"], r["length"]) for r in rows))
  policies = list(dict.fromkeys(r["policy"] for r in rows))
  dtypes = list(dict.fromkeys(r["kv_dtype"] for r in rows))
  cmap = plt.get_cmap("tab20" if len(policies) > 10 else "tab10")
  color = {p: cmap(i % cmap.N) for i, p in enumerate(policies)}
  marker = {d: "osD^vP<>X*"[i % 10] for i, d in enumerate(dtypes)}
  fig, axes = plt.subplots(1, len(panels), squeeze=False,
                           figsize=(6 * len(panels) + 4.5, 4.8))
  for ax, (task, length) in zip(axes[0], panels):
    for lab in dict.fromkeys(r["label"] for r in rows):
      rs = sorted((r for r in rows if (r["task"], r["length"], r["label"]) ==
                   (task, length, lab)), key=lambda r: r["kv_bytes"])
      if not rs:
        continue
      x = [r["kv_bytes"] / 1024 for r in rs]
      y = [r["accuracy"] for r in rs]
      err = np.maximum(0.0, np.array(
          [[r["accuracy"] - r["ci95"][0] for r in rs],
           [r["ci95"][1] - r["accuracy"] for r in rs]]))
      style = dict(color=color[rs[0]["policy"]],
                   marker=marker[rs[0]["kv_dtype"]], capsize=2,
                   markersize=5, label=lab, alpha=0.85)
      if rs[0]["policy"] == "full":
        ax.errorbar(x, y, yerr=err, linestyle="none", **style)
        ax.axhline(y[0], color=style["color"], linestyle="--", alpha=0.3)
        continue
      ax.errorbar(x, y, yerr=err,
                  linestyle="--" if "@stream" in lab else "-", **style)
    ax.set_xscale("log")
    ax.set_xlabel("KV cache bytes per sequence (KiB, log)")
    ax.set_ylabel("exact-match accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"{task}, T = {length}")
    ax.grid(alpha=0.3, which="both")
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(0.64, 0.92),
             fontsize=6, ncol=1 if len(labels) <= 24 else 2, frameon=False)
  fig.suptitle(title, fontsize=8)
  fig.tight_layout(rect=(0, 0, 0.63, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def best_and_worst(rows, task: str) -> tuple[str, str]:
  """The evicting policies (labels) with the highest and the lowest mean
  accuracy over the budgets, for `task`."""
  means = {}
  for r in rows:
    if r["task"] == task and r["policy"] != "full":
      means.setdefault(r["label"], []).append(r["accuracy"])
  ranked = sorted(means, key=lambda k: np.mean(means[k]))
  return ranked[-1], ranked[0]


def accuracy_image(ax, records, keys) -> None:
  """Mean exact match over (rows, columns) = `keys`, drawn and labelled
  in every filled cell."""
  grid = task_eval.accuracy_grid(records, keys=keys)
  ys = sorted({k[0] for k in grid})
  xs = sorted({k[1] for k in grid})
  img = np.full((len(ys), len(xs)), np.nan)
  for (y, x), (acc, _) in grid.items():
    img[ys.index(y), xs.index(x)] = acc
  ax.imshow(img, vmin=0, vmax=1, cmap="viridis", aspect="auto",
            origin="lower")
  for a, b in zip(*np.nonzero(~np.isnan(img))):
    ax.text(b, a, f"{img[a, b]:.2f}", ha="center", va="center",
            color="white" if img[a, b] < 0.5 else "black", fontsize=8)
  ax.set_xticks(range(len(xs)), [f"{x:g}" for x in xs])
  ax.set_yticks(range(len(ys)), [f"{y:g}" for y in ys])


def plot_depth_budget(records, rows, path, task_names, title):
  """Needle depth × budget accuracy for the best and the worst policy of
  each task."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(len(task_names), 2, squeeze=False,
                           figsize=(8, 3.2 * len(task_names)))
  chosen = {}
  for i, task in enumerate(task_names):
    best, worst = best_and_worst(rows, task)
    chosen[task] = dict(best=best, worst=worst)
    for j, (which, lab) in enumerate((("best", best), ("worst", worst))):
      ax = axes[i, j]
      rs = [r for r in records if r["task"] == task and label(r) == lab]
      accuracy_image(ax, rs, ("depth", "budget"))
      ax.set_xlabel("cache budget (slots / prompt)")
      ax.set_ylabel("needle depth")
      ax.set_title(f"{task}: {which} policy, {lab}", fontsize=9)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return chosen


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
            label(r) == policy and
            (r["policy"] == "full" or r["budget"] == budget)]
      accuracy_image(ax, rs, ("length", "depth"))
      ax.set_xlabel("needle depth")
      ax.set_ylabel("prompt length")
      ax.set_title(f"{task}\n{policy}" +
                   ("" if policy.startswith("full") else f" @ {budget:g}"),
                   fontsize=9)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plan(policy_names, kv_dtypes):
  """The PolicySpecs of the grid policies × formats; KIVI pairs only with
  'full' (it cannot evict), the other pairs it would make are left out."""
  specs, skipped = [], []
  for kv in kv_dtypes:
    for p in policy_names:
      if (kv in task_eval.KIVI_FORMATS and
          task_eval.parse_policy(p).kind != "full"):
        skipped.append(f"{p} [{kv}]")
        continue
      specs.append(task_eval.parse_policy(p, kv))
  if skipped:
    logging.warning("kivi evicts nothing: left out %s", skipped)
  return specs


def main(argv):
  if len(argv) > 1:
    raise cli.UsageError(f"unexpected arguments: {argv[1:]}")
  # The flags' values, checked before anything loads (one-line errors).
  with cli.checking():
    lengths = task_eval.lengths_per_task(_LENGTHS.value, _TASKS.value)
    every_length = sorted({n for ns in lengths.values() for n in ns})
    depths = [float(d) for d in _DEPTHS.value]
    budgets = sorted(task_eval.check_budget(float(b)) for b in _BUDGETS.value)
    if _SEEDS.value < 1:
      raise ValueError(f"seeds must be >= 1, got {_SEEDS.value}")
    if _SAMPLES.value >= SEED_STRIDE:
      raise ValueError(f"samples must be < {SEED_STRIDE}, got "
                       f"{_SAMPLES.value}")
    specs = plan(_POLICIES.value, _KV_DTYPES.value)
    for name in _TASKS.value:
      spec = tasks.get_task(name)
      for n in lengths[name]:
        if n < tasks.min_length(spec):
          raise ValueError(f"length={n} is below the minimum "
                           f"{tasks.min_length(spec)} of task {name!r}")
    # Every (policy, budget, length) must be runnable before anything runs.
    for s in specs:
      for b in budgets:
        for n in every_length:
          s.capacity(b, n, 1)
    heat_budget = (_HEATMAP_BUDGET.value if _HEATMAP_BUDGET.value
                   is not None else budgets[len(budgets) // 2])
    task_eval.check_budget(heat_budget)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  orbax_checkpoint.quiet_orbax_logs()
  config, params, what = load_model()
  too_long = [n for n in every_length if n + 64 > config.max_seq_len]
  if too_long:
    raise ValueError(f"lengths {too_long} exceed the model's max_seq_len="
                     f"{config.max_seq_len}")
  # Every policy must fit this model's cache before anything runs (e.g. a
  # per-kv-head policy on MLA's shared latent is refused by init_cache).
  for s in specs:
    for b in budgets:
      for n in every_length:
        cap = s.capacity(b, n, 1)
        try:
          task_eval.sequence_kv_bytes(config, s.at(cap), cap)
        except ValueError as e:
          raise ValueError(f"policy {s.name!r} cannot run on this model "
                           f"({config.variant}): {e}; leave it out of "
                           "--policies") from None
  haystack = tasks.load_haystack("validation", _DATA_DIR.value)
  draws = {name: [tasks.task_set(name, lengths[name], depths, _SAMPLES.value,
                                 _SEED.value + SEED_STRIDE * i, haystack)
                  for i in range(_SEEDS.value)]
           for name in _TASKS.value}
  logging.info("model: %s (%s, %d params); %d draws of %d examples per task",
               what, config.variant, kvjax.param_count(config), _SEEDS.value,
               len(draws[_TASKS.value[0]][0]))
  records, seconds = [], {}
  t_all = time.perf_counter()
  for name, sets in draws.items():
    for s in specs:
      for b in ([1.0] if s.kind == "full" else budgets):
        t0 = time.perf_counter()
        for i, exs in enumerate(sets):
          for r in task_eval.evaluate(params, config, exs, s, b,
                                      batch_size=_BATCH.value,
                                      loglik=_LOGLIK.value):
            records.append(dict(r, draw=i))
        seconds[f"{name}/{s.label}/{b:g}"] = time.perf_counter() - t0
  rows = summarize(records)
  md = markdown(rows, budgets)
  print(f"model: {what}; exact-match accuracy (± the standard deviation "
        f"over {_SEEDS.value} draws of the data), depths {depths} pooled "
        "('full' is budget-free: shown under 1)")
  print(md)
  labels = list(dict.fromkeys(s.label for s in specs))
  heat = {}
  for name in _TASKS.value:
    for lab in labels:
      rs = [r for r in records if r["task"] == name and label(r) == lab
            and (r["policy"] == "full" or r["budget"] == heat_budget)]
      heat[f"{name}/{lab}"] = {
          f"{n}/{d:g}": acc for (n, d), (acc, _) in
          task_eval.accuracy_grid(rs, keys=("length", "depth")).items()}
  fillers = sorted({r["filler"] for r in records})
  title = (f"{what} ({config.variant}); {_SEEDS.value} draws x "
           f"{_SAMPLES.value} samples per length x depth; filler {fillers}")
  plot_budget(rows, os.path.join(_WORKDIR.value, "budget.png"), title)
  plot_heatmaps(records, os.path.join(_WORKDIR.value, "heatmap.png"),
                _TASKS.value, heat_budget, labels, title)
  chosen = None
  if any(s.kind != "full" for s in specs):
    chosen = plot_depth_budget(
        records, rows, os.path.join(_WORKDIR.value, "depth_budget.png"),
        _TASKS.value, title)
  machine = dict(cpu_model=bm.cpu_model(), cpu_count=os.cpu_count(),
                 jax=jax.__version__, backend=jax.default_backend(),
                 loadavg=os.getloadavg())
  out = dict(model=what, variant=config.variant,
             params=kvjax.param_count(config), machine=machine,
             revision=bm.revision(os.path.dirname(os.path.abspath(__file__))),
             flags={f.name: f.value for f in (
                 _CHECKPOINT, _STEP, _TASKS, _LENGTHS, _DEPTHS, _SAMPLES,
                 _SEED, _SEEDS, _POLICIES, _KV_DTYPES, _BUDGETS, _LOGLIK,
                 _BATCH)},
             heatmap_budget=heat_budget, fillers=fillers, table=rows,
             best_and_worst=chosen, heatmaps=heat, seconds=seconds,
             wall_s=time.perf_counter() - t_all, records=records)
  with open(os.path.join(_WORKDIR.value, "results.json"), "w") as f:
    json.dump(out, f, indent=1)
  with open(os.path.join(_WORKDIR.value, "table.md"), "w") as f:
    f.write(md + "\n")
  logging.info("wrote %s (%.0f s, %s)", _WORKDIR.value, out["wall_s"],
               machine["cpu_model"])


if __name__ == "__main__":
  cli.run(main)
