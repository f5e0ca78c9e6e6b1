r"""Streaming perplexity: StreamingLLM's table on a kvjax-trained model.

Reads a held-out Austen novel far beyond the model's training context,
token by token, with every cache policy at the same capacity S: dense
(unbounded), window, attention sinks + window (StreamingLLM), sliding window
with recompute, and H2O. Prints the table, plots perplexity against position,
and times one decode step per token for sinks against recompute.

  python experiments/streaming_eval.py --workdir=workdir/streaming

The default model is the shipped checkpoints/austen-gqa (trained by
`python experiments/train.py --config=configs/train.py:gqa`); any training
workdir works with --checkpoint. The default run (8192 bytes, S=256,
recompute scored on every 4th token) took 6 min on the shared 2-core CPU;
--recompute_stride=1 scores every token (recompute costs W forward tokens
per scored token).

Outputs in --workdir: results.jsonl (one line per policy, written as each
finishes, then the timings and attention profiles: a stopped run keeps what
it measured), results.json (table, curves, timings, flags), perplexity.png,
table.md. The table is printed on stdout.

Needs the corpus: `python -m kvjax.data --setup` (once).
"""

import json
import os
import time

from absl import flags
from absl import logging
import jax
import numpy as np

import kvjax
from kvjax import cli
from kvjax import configs
from kvjax import data
from kvjax import orbax_checkpoint
from kvjax import train
from kvjax.lab import job
from kvjax.lab import streaming
from configs import model as model_presets

_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.",
                               required=True)
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", job.SHIPPED_MODEL,
    "Training workdir of experiments/train.py "
    "(kvjax.orbax_checkpoint.restore_params); empty: a random-weight model from --model (a smoke run, not a result).")
_MODEL = cli.DEFINE_config_file(
    "model", os.path.join(os.path.dirname(__file__), "..", "configs",
                          "model.py:gqa-tiny"),
    "Random-weight model preset, used only with --checkpoint=''.",
    presets=model_presets.PRESETS)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: last).",
                             lower_bound=0)
_DATA_DIR = flags.DEFINE_string(
    "data_dir", None, "Austen corpus (default: $KVJAX_DATA_DIR, else the "
    "user's cache directory; kvjax.data.resolve_data_dir).")
_NOVEL = flags.DEFINE_enum("novel", data.VALIDATION_NOVEL, data.NOVELS,
                           "Held-out novel to stream.")
_OFFSET = flags.DEFINE_integer("offset", 0, "First token of the stream.",
                               lower_bound=0)
_STREAM_LEN = flags.DEFINE_integer("stream_len", 8192, "Tokens (bytes).",
                                   lower_bound=2)
_CAPACITY = flags.DEFINE_integer("capacity", 256,
                                 "Cache slots S of every bounded policy.",
                                 lower_bound=1)
_POLICIES = flags.DEFINE_list(
    "policies", "dense,window,sinks1,sinks2,sinks4,sinks8,recompute,h2o",
    "Rows: dense, window, sinks<n>, h2o, recompute; ':original' / ':cache' "
    "picks the RoPE position mode (sinks and h2o default to 'cache', "
    "StreamingLLM's choice).")
_H2O_RECENT = flags.DEFINE_integer("h2o_recent", 0,
                                   "H2O recent window (0: capacity // 2).",
                                   lower_bound=0)
_RECOMPUTE_STRIDE = flags.DEFINE_integer(
    "recompute_stride", 4,
    "Recompute scores every k-th token only (1: every token; its cost is "
    "W forward tokens per scored token).", lower_bound=1)
_CHUNK = flags.DEFINE_integer("chunk", 512, "Tokens per compiled chunk.",
                              lower_bound=1)
_MICRO_BATCH = flags.DEFINE_integer("micro_batch", 8,
                                    "Recompute windows per vectorised step.",
                                    lower_bound=1)
_BIN = flags.DEFINE_integer("bin", 256, "Positions per plotted bin.",
                            lower_bound=1)
_TIME_POLICIES = flags.DEFINE_list(
    "time_policies", "sinks4,sinks4:original,window,recompute",
    "Rows timed per token at batch 1 (empty: no timing).")
_TIME_STEPS = flags.DEFINE_integer("time_steps", 32, "Tokens per timing.",
                                   lower_bound=1)
_TIME_CAPACITIES = cli.DEFINE_int_list(
    "time_capacities", [], "Cache sizes to time at (default: --capacity).",
    lower_bound=1, allow_empty=True)
_TIME_ROUNDS = flags.DEFINE_integer("time_rounds", 7,
                                    "Interleaved timing rounds (median).",
                                    lower_bound=1)
_PROFILE_OFFSETS = cli.DEFINE_int_list(
    "profile_offsets", [10000, 100000],
    "Novel offsets of --capacity-byte windows whose attention profile (mass "
    "on the first token, locality) is recorded: is there an attention sink?",
    lower_bound=0, allow_empty=True)
_FLAGS = (_CHECKPOINT, _STEP, _NOVEL, _OFFSET, _STREAM_LEN, _CAPACITY,
          _POLICIES, _H2O_RECENT, _RECOMPUTE_STRIDE, _CHUNK, _MICRO_BATCH,
          _BIN, _PROFILE_OFFSETS, _TIME_POLICIES, _TIME_CAPACITIES, _TIME_STEPS,
          _TIME_ROUNDS)


def perplexity_curve(nll, bin_size: int):
  """`streaming.perplexity_by_position` with the last, partial bin kept
  (plotted at the centre of the positions it holds): the curve reaches the
  end of the stream."""
  nll = np.asarray(nll, np.float64)
  nll = nll.reshape(-1, nll.shape[-1])
  n = nll.shape[1]
  full = n // bin_size * bin_size
  if not full:
    return streaming.perplexity_by_position(nll, n)
  x, y = streaming.perplexity_by_position(nll[:, :full], bin_size)
  if full < n:
    xt, yt = streaming.perplexity_by_position(nll[:, full:], n - full)
    x, y = np.concatenate([x, xt + full]), np.concatenate([y, yt])
  return x, y


def main(argv):
  del argv
  n, cap = _STREAM_LEN.value, _CAPACITY.value
  # Every choice is checked, and the corpus read, before a model loads.
  with cli.checking("--policies"):
    rows = {name: streaming.parse_policy(name, cap, n, _H2O_RECENT.value)
            for name in _POLICIES.value}
  with cli.checking("--time_policies"):
    for c in _TIME_CAPACITIES.value or [cap]:
      for name in _TIME_POLICIES.value:
        streaming.parse_policy(name, c, n, _H2O_RECENT.value)
  with cli.checking():
    if _CHECKPOINT.value and not os.path.isdir(_CHECKPOINT.value):
      raise ValueError(f"--checkpoint={_CHECKPOINT.value}: no such directory")
    stream = data.heldout_stream(_DATA_DIR.value, _NOVEL.value)
    if _OFFSET.value + n > len(stream):
      raise ValueError(f"--offset={_OFFSET.value} + --stream_len={n} exceed "
                       f"the {len(stream)}-token novel {_NOVEL.value!r}")
    late = [o for o in _PROFILE_OFFSETS.value if o + cap > len(stream)]
    if late:
      raise ValueError(f"--profile_offsets {late}: a {cap}-token window "
                       f"from there overruns the {len(stream)}-token novel")
  with cli.checking("--model.model"):
    random_config = None if _CHECKPOINT.value else configs.model_config(
        _MODEL.value.model).replace(vocab_size=data.VOCAB_SIZE)
  tokens = stream[_OFFSET.value:_OFFSET.value + n]
  step = None
  if _CHECKPOINT.value:
    config, params = orbax_checkpoint.restore_params(_CHECKPOINT.value,
                                                     _STEP.value)
    step = _STEP.value or orbax_checkpoint.checkpoint_manager(
        _CHECKPOINT.value).latest_step()
    with open(os.path.join(_CHECKPOINT.value, train.CONFIG_FILE)) as f:
      train_len = int(json.load(f).get("train", {}).get("seq_len", 0))
  else:
    logging.warning("random weights (--checkpoint=''): a smoke run only")
    config = random_config
    params = kvjax.init_params(config, jax.random.key(0))
    train_len = 0
  logging.info("model %s (%s), train context %d; stream %d tokens, S=%d",
               config.variant, _CHECKPOINT.value, train_len, n, cap)

  partial = cli.JsonLines(os.path.join(_WORKDIR.value, "results.jsonl"))
  nll, table = {}, []
  for i, (name, row) in enumerate(rows.items(), 1):
    t0 = time.perf_counter()
    nll[name] = np.asarray(streaming.evaluate(
        params, config, tokens, row, chunk=_CHUNK.value,
        micro_batch=_MICRO_BATCH.value,
        recompute_stride=_RECOMPUTE_STRIDE.value, log_every=2048))
    seconds = time.perf_counter() - t0
    line = streaming.summarize({name: nll[name]}, {name: row}, cap)[0]
    line["eval_seconds"] = seconds
    table.append(line)
    partial.write(dict(kind="policy", **line))
    logging.info("[%d/%d] %s: perplexity %.3f (%.0f s)", i, len(rows), name,
                 line["ppl"], seconds)
  md = streaming.markdown_table(table)
  print(md, flush=True)

  timing = streaming.timing_table(
      params, config, tokens, _TIME_POLICIES.value,
      _TIME_CAPACITIES.value or [cap], h2o_recent=_H2O_RECENT.value,
      steps=_TIME_STEPS.value, rounds=_TIME_ROUNDS.value)
  for t in timing:
    partial.write(dict(kind="timing", **t))
    print(f"S={t['slots']} {t['name']}: {t['ms_per_token']:.3f} ms/token" +
          (f" (recompute / this = {t['recompute_over_this']:.1f}x)"
           if "recompute_over_this" in t else ""), flush=True)

  profiles = []
  for off in _PROFILE_OFFSETS.value:
    prof = streaming.attention_profile(params, config,
                                       stream[off:off + cap])
    profiles.append(dict(offset=off, **prof))
    partial.write(dict(kind="attention_profile", **profiles[-1]))
    print(f"attention, bytes {off}..{off + cap}, queries {cap // 2}..{cap - 1}:"
          f" first token {prof['first_token']:.5f} (uniform "
          f"{prof['first_token_if_uniform']:.5f}), distance < "
          f"{prof['near']}: {prof['within_near']:.3f}, >= {prof['far']}: "
          f"{prof['beyond_far']:.3f}", flush=True)
  partial.close()

  curves = {name: perplexity_curve(v, _BIN.value) for name, v in nll.items()}
  stride = _RECOMPUTE_STRIDE.value
  title = (f"{config.variant} byte model "
           f"({_CHECKPOINT.value or 'random weights'}, step {step}), "
           f"{_NOVEL.value}[{_OFFSET.value}:+{n}], S={cap}; one stream, "
           "deterministic (no seeds)" +
           (f"; recompute scores every {stride}th token"
            if "recompute" in rows and stride > 1 else ""))
  streaming.plot_perplexity(curves, os.path.join(_WORKDIR.value,
                                                 "perplexity.png"),
                            capacity=cap, train_len=train_len, title=title,
                            bin_size=_BIN.value)
  with open(os.path.join(_WORKDIR.value, "table.md"), "w") as f:
    f.write(md + "\n")
  results = dict(
      flags={h.name: h.value for h in _FLAGS},
      model=dict(variant=config.variant, checkpoint=_CHECKPOINT.value,
                 step=step, train_seq_len=train_len,
                 config=config.to_dict()),
      stream=dict(novel=_NOVEL.value, offset=_OFFSET.value, tokens=n),
      table=table, timing=timing, attention_profile=profiles,
      curves={k: dict(position=c.tolist(), ppl=p.tolist())
              for k, (c, p) in curves.items()})
  with open(os.path.join(_WORKDIR.value, "results.json"), "w") as f:
    json.dump(results, f, indent=1, default=str)
  logging.info("wrote %s", _WORKDIR.value)


if __name__ == "__main__":
  cli.run(main)
