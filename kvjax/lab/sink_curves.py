"""Attention sinks against training: the first-token mass of several runs.

Every training run records, at each validation, the attention the first
token receives per layer (`kvjax.train.run`: `probe.first_token_mass` of
queries in the second half of 4 validation rows, averaged over heads,
`sink_mass_layers`, and the largest head, `sink_mass_max`). Those
numbers mean little alone: uniform causal attention pays the first token
of a T-token row 1 / (t + 1) at query t, so 0.0054 for the second half of
256 bytes but 0.0014 of 1,024. This module reads several runs' metrics
and states each figure as a multiple of its own run's uniform mass, the
scale on which "a sink" is a claim: a layer *has a sink* when its mean
first-token mass is at least `SINK_RATIO` times uniform (one head in
eight parking most of its attention there gives ~15x at T = 256), and a
run *has sinks* when most of its layers do.

`read_run` loads one workdir (metrics.jsonl and config.json), `table`
the rows `experiments/sink_curves.py` prints, `plot` its figure.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

from kvjax import train

SINK_RATIO = 10.0  # a layer's first-token mass over uniform: a sink


def uniform_first_token_mass(seq_len: int) -> float:
  """Mean first-token share of uniform causal attention over queries
  t = seq_len // 2 .. seq_len - 1 (the queries the training probe reads):
  mean of 1 / (t + 1)."""
  if seq_len < 2:
    raise ValueError(f"seq_len={seq_len}: the probe needs at least 2 tokens")
  return float(np.mean(1.0 / np.arange(seq_len // 2 + 1, seq_len + 1)))


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run's sink record.

  name: the run's label (its workdir's name by default).
  seq_len, batch_size, num_layers, bos: from the run's config.json.
  steps: [E] validation steps with a sink record; tokens: [E] training
    tokens seen by then (steps x batch x seq_len).
  bits_per_byte: [E]; mass_EL: [E, L] mean first-token mass per layer;
  mass_max: [E] the largest head's.
  """

  name: str
  seq_len: int
  batch_size: int
  num_layers: int
  bos: bool
  steps: np.ndarray
  tokens: np.ndarray
  bits_per_byte: np.ndarray
  mass_EL: np.ndarray
  mass_max: np.ndarray

  @property
  def uniform(self) -> float:
    return uniform_first_token_mass(self.seq_len)

  def layers_with_sinks(self) -> np.ndarray:
    """[E] how many layers are at or above SINK_RATIO x uniform."""
    return (self.mass_EL >= SINK_RATIO * self.uniform).sum(axis=1)


def read_run(workdir: str | pathlib.Path, name: str | None = None) -> Run:
  """A run's sink record from its workdir (`experiments/train.py`).

  Raises:
    ValueError: the workdir has no config.json or no validation record
      with a sink measurement (named in the message).
  """
  workdir = pathlib.Path(workdir)
  config_path = workdir / train.CONFIG_FILE
  if not config_path.exists():
    raise ValueError(f"{workdir}: no {train.CONFIG_FILE} (not a training "
                     "workdir of experiments/train.py)")
  with open(config_path) as f:
    cfg = json.load(f)
  records = [r for r in train.read_metrics(workdir / "metrics.jsonl")
             if r.get("split") == "validation" and r.get("sink_mass_layers")]
  if not records:
    raise ValueError(f"{workdir}: metrics.jsonl has no validation record "
                     "with sink_mass_layers")
  t, m = cfg["train"], cfg["model"]
  steps = np.array([r["step"] for r in records])
  return Run(name=name or workdir.name, seq_len=t["seq_len"],
             batch_size=t["batch_size"], num_layers=m["num_layers"],
             bos=bool(t.get("bos", False)), steps=steps,
             tokens=steps * t["batch_size"] * t["seq_len"],
             bits_per_byte=np.array([r["bits_per_byte"] for r in records]),
             mass_EL=np.array([r["sink_mass_layers"] for r in records]),
             mass_max=np.array([r["sink_mass_max"] for r in records]))


def table(runs: list[Run]) -> list[dict]:
  """One row per run and validation: step, tokens, bits/byte, the mean
  and largest-head first-token mass as multiples of uniform, the layers
  with a sink."""
  rows = []
  for run in runs:
    u = run.uniform
    for e, step in enumerate(run.steps):
      rows.append(dict(
          run=run.name, step=int(step), tokens=int(run.tokens[e]),
          bits_per_byte=float(run.bits_per_byte[e]),
          mean_over_uniform=float(run.mass_EL[e].mean() / u),
          max_head_over_uniform=float(run.mass_max[e] / u),
          layers_over_uniform=[float(x / u) for x in run.mass_EL[e]],
          layers_with_sinks=int(run.layers_with_sinks()[e]),
          num_layers=run.num_layers))
  return rows


def plot(runs: list[Run], png_path: str | pathlib.Path) -> None:
  """Left: each layer's first-token mass over uniform against training
  tokens (a line per layer, a colour per run) with the largest head
  dotted and the sink threshold dashed; right: validation bits/byte."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
  for i, run in enumerate(runs):
    color = f"C{i}"
    u = run.uniform
    for l in range(run.mass_EL.shape[1]):
      ax.plot(run.tokens, np.maximum(run.mass_EL[:, l] / u, 1e-4), "-",
              color=color, alpha=0.35 + 0.65 * (l + 1) / run.num_layers,
              lw=1, label=run.name if l == run.num_layers - 1 else None)
    ax.plot(run.tokens, run.mass_max / u, ":", color=color, lw=1.5)
    bx.plot(run.tokens, run.bits_per_byte, "o-", ms=3, color=color,
            label=run.name)
  ax.axhline(1.0, color="grey", lw=1, label="uniform causal attention")
  ax.axhline(SINK_RATIO, color="black", ls="--", lw=1,
             label=f"sink threshold ({SINK_RATIO:g}x uniform)")
  ax.set(xscale="log", yscale="log", xlabel="training tokens",
         ylabel="first-token attention / uniform",
         title="per layer (solid, darker = deeper), largest head (dotted)")
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=8)
  bx.set(xscale="log", xlabel="training tokens",
         ylabel="validation bits per byte", title="quality")
  bx.grid(alpha=0.3, which="both")
  bx.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)
