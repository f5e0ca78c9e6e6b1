r"""Which form norm-fed one-row products should take on this host
(kvjax/norm_matvec.py), decided the way a process decides it and checked
on the decode steps it serves.

  python experiments/norm_matvec.py \
      --presets=gqa-small,mha-medium,mqa-medium,gqa-medium,mla-medium \
      --workdir=workdir/norm_matvec

First the process's own measurements (`norm_matvec.measure`, both forms,
per regime: norm-fed weights totalling twice the last-level cache, and a
chain that fits in a quarter of it) and the form each gives
(`norm_matvec.decide`, the rule a process applies to its own). Then, per
preset (its weights set its regime, `norm_matvec.regime`), batch-1 decode
steps from `--position` cached tokens in each form with the read probe,
each form in fresh subprocesses (a process compiles one form; beside the
other the fused loop ran as fast as the dots), alternating over
`--rounds` (`benchmarking.norm_matvec_forms`): ms per step, the fraction
of the subprocess's read probe each reaches, and separate / fused speed.
Prints a line per preset (also appended to norm_matvec.jsonl); writes
norm_matvec.json and norm_matvec.png (read-probe fraction per preset and
form).
"""

import json
import os

from absl import flags
from absl import logging
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

from kvjax.lab import benchmarking as bm
from kvjax import cli
from kvjax import configs as cfg_lib
from kvjax import norm_matvec
from configs import model as presets

_PRESETS = cli.DEFINE_choice_list(
    "presets", ["gqa-small", "mha-medium", "mqa-medium", "gqa-medium",
                "mla-medium"],
    presets.PRESETS, "configs/model.py presets.")
_POSITION = flags.DEFINE_integer("position", 128, "Tokens already cached.",
                                 lower_bound=0)
_STEPS = flags.DEFINE_integer("steps", 16, "Decode steps per timed loop.",
                              lower_bound=1)
_ROUNDS = flags.DEFINE_integer("rounds", 3,
                               "Alternating subprocess rounds per form.",
                               lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 5,
                                "Timed loops per subprocess.", lower_bound=1)
_WORKDIR = flags.DEFINE_string("workdir", "workdir/norm_matvec",
                               "Output directory.")


def main(argv):
  del argv
  with cli.checking("--presets"):
    configs = {name: cfg_lib.model_config(presets.get_config(name).model)
               for name in _PRESETS.value}
  os.environ.pop(norm_matvec.ENV, None)  # the decision a process makes
  probes, chosen = {}, {}
  for regime in norm_matvec.REGIMES:
    probes[regime] = p = norm_matvec.measure(regime=regime)
    chosen[regime] = norm_matvec.decide(p)
    print(f"measure {regime}: fused {1e3 * p['fused']:.3f} ms, separate "
          f"{1e3 * p['separate']:.3f} ms over {p['nbytes'] / 2**20:.0f} MiB "
          f"({p['nbytes'] / p['fused'] / 1e9:.1f} / "
          f"{p['nbytes'] / p['separate'] / 1e9:.1f} GB/s); this process "
          f"takes '{chosen[regime]}'", flush=True)
  rows = []
  partial = cli.JsonLines(os.path.join(_WORKDIR.value, "norm_matvec.jsonl"))
  for name, config in configs.items():
    r = bm.norm_matvec_forms(config, 1, _POSITION.value,
                             rounds=_ROUNDS.value, steps=_STEPS.value,
                             repeats=_REPEATS.value)
    regime = norm_matvec.regime(r["weight_bytes"])
    row = dict(preset=name, position=_POSITION.value, regime=regime,
               chosen=chosen[regime], **r)
    rows.append(row)
    partial.write(row)
    f, s = r["fused"], r["separate"]
    print(f"{name} batch 1 @ {_POSITION.value}: fused "
          f"{1e3 * f['step_s']:.2f} ms ({100 * f['read_fraction']:.0f}% of "
          f"read), separate {1e3 * s['step_s']:.2f} ms "
          f"({100 * s['read_fraction']:.0f}%), separate "
          f"{r['separate_speedup']:.2f}x fused; read probe "
          f"{s['probe_bytes_per_s'] / 1e9:.1f} GB/s; {regime} weights, "
          f"takes '{chosen[regime]}'", flush=True)
  partial.close()
  out = dict(machine=bm.machine_info(), cpu=bm.cpu_model(),
             last_level_cache=norm_matvec.last_level_cache_bytes(),
             measure=probes, chosen=chosen, rows=rows)
  with open(os.path.join(_WORKDIR.value, "norm_matvec.json"), "w") as fh:
    json.dump(out, fh, indent=1)
  fig, ax = plt.subplots(figsize=(6.4, 3.6))
  width = 0.38
  for i, form in enumerate(norm_matvec.FORMS):
    ax.bar([j + (i - 0.5) * width for j in range(len(rows))],
           [100 * row[form]["read_fraction"] for row in rows], width,
           label=form)
  ax.axhline(85, color="gray", ls="--", lw=1, label="85 % target")
  ax.set_xticks(range(len(rows)), [f"{row['preset']}\n{row['regime']}: "
                                   f"{row['chosen']}" for row in rows],
                fontsize=8)
  ax.set_ylabel("% of the in-run read probe")
  ax.set_title(f"batch-1 decode @ {_POSITION.value}: norm-fed products\n"
               f"{out['cpu']}", fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  path = os.path.join(_WORKDIR.value, "norm_matvec.png")
  fig.savefig(path, dpi=120)
  logging.info("wrote %s", path)


if __name__ == "__main__":
  cli.run(main)
