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

Outputs in --workdir: results.json (table, curves, timings, flags),
perplexity.png, table.md.
"""

import json
import os

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

import kvjax
from kvjax import configs
from kvjax import data
from kvjax import streaming
from kvjax import train

_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.",
                               required=True)
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", "checkpoints/austen-gqa",
    "Training workdir of experiments/train.py (kvjax.train.restore_params); "
    "empty: a random-weight model from --model (a smoke run, not a result).")
_MODEL = config_flags.DEFINE_config_file(
    "model", "configs/model.py:gqa-tiny",
    "Random-weight model preset, used only with --checkpoint=''.",
    lock_config=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: last).")
_DATA_DIR = flags.DEFINE_string("data_dir", None,
                                "Austen corpus (default: kvjax.data's).")
_NOVEL = flags.DEFINE_string("novel", data.VALIDATION_NOVEL,
                             "Held-out novel to stream.")
_OFFSET = flags.DEFINE_integer("offset", 0, "First token of the stream.")
_STREAM_LEN = flags.DEFINE_integer("stream_len", 8192, "Tokens (bytes).")
_CAPACITY = flags.DEFINE_integer("capacity", 256,
                                 "Cache slots S of every bounded policy.")
_POLICIES = flags.DEFINE_list(
    "policies", "dense,window,sinks1,sinks2,sinks4,sinks8,recompute,h2o",
    "Rows: dense, window, sinks<n>, h2o, recompute; ':original' / ':cache' "
    "picks the RoPE position mode.")
_H2O_RECENT = flags.DEFINE_integer("h2o_recent", 0,
                                   "H2O recent window (0: capacity // 2).")
_RECOMPUTE_STRIDE = flags.DEFINE_integer(
    "recompute_stride", 4,
    "Recompute scores every k-th token only (1: every token; its cost is "
    "W forward tokens per scored token).")
_CHUNK = flags.DEFINE_integer("chunk", 512, "Tokens per compiled chunk.")
_MICRO_BATCH = flags.DEFINE_integer("micro_batch", 8,
                                    "Recompute windows per vectorised step.")
_BIN = flags.DEFINE_integer("bin", 256, "Positions per plotted bin.")
_TIME_POLICIES = flags.DEFINE_list(
    "time_policies", "sinks4,sinks4:original,window,recompute",
    "Rows timed per token at batch 1 (empty: no timing).")
_TIME_STEPS = flags.DEFINE_integer("time_steps", 32, "Tokens per timing.")
_TIME_CAPACITIES = flags.DEFINE_list(
    "time_capacities", [], "Cache sizes to time at (default: --capacity).")
_TIME_ROUNDS = flags.DEFINE_integer("time_rounds", 7,
                                    "Interleaved timing rounds (median).")
_PROFILE_OFFSETS = flags.DEFINE_list(
    "profile_offsets", ["10000", "100000"],
    "Novel offsets of --capacity-byte windows whose attention profile (mass "
    "on the first token, locality) is recorded: is there an attention sink?")
_FLAGS = (_CHECKPOINT, _STEP, _NOVEL, _OFFSET, _STREAM_LEN, _CAPACITY,
          _POLICIES, _H2O_RECENT, _RECOMPUTE_STRIDE, _CHUNK, _MICRO_BATCH,
          _BIN, _PROFILE_OFFSETS, _TIME_POLICIES, _TIME_CAPACITIES, _TIME_STEPS,
          _TIME_ROUNDS)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  os.makedirs(_WORKDIR.value, exist_ok=True)
  step = None
  if _CHECKPOINT.value:
    config, params = train.restore_params(_CHECKPOINT.value, _STEP.value)
    step = _STEP.value or train.checkpoint_manager(
        _CHECKPOINT.value).latest_step()
    with open(os.path.join(_CHECKPOINT.value, train.CONFIG_FILE)) as f:
      train_len = int(json.load(f).get("train", {}).get("seq_len", 0))
  else:
    logging.warning("random weights (--checkpoint=''): a smoke run only")
    config = configs.model_config(_MODEL.value.model).replace(
        vocab_size=data.VOCAB_SIZE)
    params = kvjax.init_params(config, jax.random.key(0))
    train_len = 0
  stream = data.heldout_stream(_DATA_DIR.value, _NOVEL.value)
  tokens = stream[_OFFSET.value:_OFFSET.value + _STREAM_LEN.value]
  if len(tokens) < _STREAM_LEN.value:
    raise ValueError(f"stream_len={_STREAM_LEN.value} + offset exceeds the "
                     f"{len(stream)}-token novel")
  n, cap = len(tokens), _CAPACITY.value
  logging.info("model %s (%s), train context %d; stream %d tokens, S=%d",
               config.variant, _CHECKPOINT.value, train_len, n, cap)
  rows = {name: streaming.parse_policy(name, cap, n, _H2O_RECENT.value)
          for name in _POLICIES.value}

  nll, seconds = streaming.evaluate_rows(
      params, config, tokens, rows, chunk=_CHUNK.value,
      micro_batch=_MICRO_BATCH.value,
      recompute_stride=_RECOMPUTE_STRIDE.value, log_every=2048)
  table = streaming.summarize(nll, rows, cap)
  for r in table:
    r["eval_seconds"] = seconds[r["name"]]
  md = streaming.markdown_table(table)
  print(md)

  timing = streaming.timing_table(
      params, config, tokens, _TIME_POLICIES.value,
      [int(c) for c in _TIME_CAPACITIES.value] or [cap],
      h2o_recent=_H2O_RECENT.value, steps=_TIME_STEPS.value,
      rounds=_TIME_ROUNDS.value)
  for t in timing:
    print(f"S={t['slots']} {t['name']}: {t['ms_per_token']:.3f} ms/token" +
          (f" (recompute / this = {t['recompute_over_this']:.1f}x)"
           if "recompute_over_this" in t else ""))

  profiles = []
  for off in (int(o) for o in _PROFILE_OFFSETS.value):
    prof = streaming.attention_profile(params, config,
                                       stream[off:off + cap])
    profiles.append(dict(offset=off, **prof))
    print(f"attention, bytes {off}..{off + cap}, queries {cap // 2}..{cap - 1}:"
          f" first token {prof['first_token']:.5f} (uniform "
          f"{prof['first_token_if_uniform']:.5f}), distance < "
          f"{prof['near']}: {prof['within_near']:.3f}, >= {prof['far']}: "
          f"{prof['beyond_far']:.3f}")

  curves = {name: streaming.perplexity_by_position(v, _BIN.value)
            for name, v in nll.items()}
  title = (f"{config.variant} byte model "
           f"({_CHECKPOINT.value or 'random weights'}, step {step}), "
           f"{_NOVEL.value}[{_OFFSET.value}:+{n}], S={cap}")
  streaming.plot_perplexity(curves, os.path.join(_WORKDIR.value,
                                                 "perplexity.png"),
                            capacity=cap, train_len=train_len, title=title)
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
  app.run(main)
