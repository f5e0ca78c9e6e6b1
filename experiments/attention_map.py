r"""Attention maps: where each layer and head attends, against uniform.

  python experiments/attention_map.py --workdir=workdir/attention_map
  python experiments/attention_map.py --workdir=/tmp/a --random \
      --config=configs/model.py:mla-small --text="It is a truth ..."
  python experiments/attention_map.py --workdir=/tmp/a --hf=/path/to/hf_dir

Reads --windows windows of --length tokens (default: bytes 10000.. of the
held-out novel; or --text), runs the attention probe
(`kvjax.probe.attention_probs`: the library's own forward, every layer and
query head, MLA included) and summarises it (`kvjax.lab.attention_stats`):
the attention on the first k tokens (sink mass), the attention entropy and
the mean attention by distance, per layer and head, each with the value of
uniform causal attention. Queries: the second half of each window unless
--min_query says otherwise.

Which model: --hf (a Hugging Face checkpoint, `kvjax.load_checkpoint`; text
is tokenized with its tokenizer when transformers can load one, else
seeded random ids are read), else --random (a seeded random init of
--config's model, byte-level), else --checkpoint (a kvjax training workdir;
default the shipped checkpoints/austen-gqa).

Outputs in --workdir: attention_map.json (per layer / head statistics, the
uniform baselines, the model and the tokens read), attention_map.png (the
attention maps of the first window, layers x heads), attention_stats.png
(sink mass, entropy and distance profile against uniform). A per-layer
table is printed on stdout.

The corpus: `python -m kvjax.data --setup` (once; --text needs none).
"""

import json
import os

from absl import flags
from absl import logging
import numpy as np

from kvjax import cli
from kvjax import configs
from kvjax import data
from kvjax import probe
from kvjax.lab import attention_stats
from kvjax.lab import job
from configs import model as model_presets

_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.",
                               required=True)
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", job.SHIPPED_MODEL,
    "kvjax training workdir (experiments/train.py), used unless --hf or "
    "--random is given.")
_HF = flags.DEFINE_string("hf", "", "Hugging Face checkpoint directory.")
_RANDOM = flags.DEFINE_bool(
    "random", False, "A seeded random init of --config's model (its vocab "
    "set to the byte-level tokenizer's).")
_CONFIG = cli.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs",
                           "model.py:gqa-tiny"),
    "Random-weight model, used only with --random.",
    presets=model_presets.PRESETS)
_SEED = flags.DEFINE_integer("seed", 0, "Random init / random ids seed.",
                             lower_bound=0)
_TEXT = flags.DEFINE_string(
    "text", "", "Text to read instead of the corpus (a window of up to "
    "--length tokens).")
_DATA_DIR = flags.DEFINE_string(
    "data_dir", None, "Austen corpus (default: $KVJAX_DATA_DIR, else the "
    "user's cache directory; kvjax.data.resolve_data_dir).")
_NOVEL = flags.DEFINE_enum("novel", data.VALIDATION_NOVEL, data.NOVELS,
                           "Held-out novel to read.")
_OFFSET = flags.DEFINE_integer("offset", 10000,
                               "First token (byte) of the first window.",
                               lower_bound=0)
_LENGTH = flags.DEFINE_integer("length", 256, "Tokens per window (T).",
                               lower_bound=2)
_WINDOWS = flags.DEFINE_integer(
    "windows", 1, "Consecutive windows averaged (the batch).", lower_bound=1)
_SINK_K = cli.DEFINE_int_list("sink_k", [1, 4],
                              "k of each sink mass (first k tokens).",
                              lower_bound=1)
_MIN_QUERY = flags.DEFINE_integer(
    "min_query", None, "Queries averaged: stream positions >= this "
    "(default: the second half of the window).", lower_bound=0)
_LAYERS = cli.DEFINE_int_list(
    "layers", [], "Layers drawn in attention_map.png (empty: all, or 8 "
    "evenly spaced).", lower_bound=0, allow_empty=True)
_HEADS = cli.DEFINE_int_list(
    "heads", [], "Heads drawn in attention_map.png (empty: all, or 8 evenly "
    "spaced).", lower_bound=0, allow_empty=True)


def _tokenizer(path: str):
  """The HF checkpoint's tokenizer, or None when transformers cannot load
  one from `path`."""
  try:
    import transformers  # pylint: disable=g-import-not-at-top
    return transformers.AutoTokenizer.from_pretrained(path)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("no tokenizer in %s (%s)", path, cli.one_line(e))
    return None


def _corpus_text() -> str:
  text = data.heldout_text(_DATA_DIR.value, _NOVEL.value)
  if _OFFSET.value >= len(text):
    raise ValueError(f"--offset={_OFFSET.value} lies past the "
                     f"{len(text)}-byte novel {_NOVEL.value!r}")
  return text


def _tokens(byte_level: bool, vocab_size: int):
  """([W, T] int32 windows, a description of what they are)."""
  n = _LENGTH.value * _WINDOWS.value
  where = (f"{_NOVEL.value}[{_OFFSET.value}:+{n}]" if not _TEXT.value
           else "--text")
  if byte_level:
    if _TEXT.value:
      ids = data.encode(_TEXT.value)
    else:
      stream = data.heldout_stream(_DATA_DIR.value, _NOVEL.value)
      ids = stream[_OFFSET.value:_OFFSET.value + n]
  else:  # a Hugging Face checkpoint
    tok = _tokenizer(_HF.value)
    if tok is None:
      if _TEXT.value:
        raise ValueError(f"--text: no tokenizer could be loaded from "
                         f"--hf={_HF.value}")
      logging.warning("reading seeded random token ids")
      rng = np.random.default_rng(_SEED.value)
      return (rng.integers(0, vocab_size, (_WINDOWS.value, _LENGTH.value),
                           dtype=np.int32), f"random ids (seed {_SEED.value})")
    text = _TEXT.value or _corpus_text()[_OFFSET.value:][:16 * n]
    ids = np.asarray(tok(text)["input_ids"], np.int32)
    where += f", tokenized by {type(tok).__name__}"
  length = min(_LENGTH.value, len(ids) // _WINDOWS.value)
  if length < 2:
    raise ValueError(f"{where}: {len(ids)} tokens, too few for "
                     f"{_WINDOWS.value} windows of at least 2")
  if length < _LENGTH.value:
    if not _TEXT.value:
      raise ValueError(f"{where}: only {len(ids)} tokens from --offset="
                       f"{_OFFSET.value}, fewer than --windows x --length")
    logging.info("--text holds %d tokens: windows of %d", len(ids), length)
  ids = np.asarray(ids[:length * _WINDOWS.value], np.int32)
  return ids.reshape(_WINDOWS.value, length), where


def _load():
  if _HF.value and _RANDOM.value:
    raise ValueError("give --hf or --random, not both")
  for flag, path in (("hf", _HF.value), ("checkpoint", _CHECKPOINT.value)):
    if path and not os.path.isdir(path):
      raise ValueError(f"--{flag}={path}: no such directory")
  if _HF.value:
    return job.load_model(checkpoint=_HF.value)
  if _RANDOM.value:
    config = configs.model_config(_CONFIG.value.model).replace(
        vocab_size=data.VOCAB_SIZE)
    return job.load_model(config=config, seed=_SEED.value)
  if not _CHECKPOINT.value:
    raise ValueError("--checkpoint='' : give a training workdir, --hf or "
                     "--random")
  return job.load_model(trained=_CHECKPOINT.value)


def main(argv):
  del argv
  with cli.checking():
    if not _RANDOM.value and cli.overrides_given("config.model"):
      raise ValueError("--config.model.* sets the --random model only")
    byte_level = not _HF.value  # the shipped model, --random
    if byte_level:  # the corpus is read before a model loads
      tokens, where = _tokens(True, data.VOCAB_SIZE)
    loaded = _load()
    config = loaded.config
    if config.attention_impl != "einsum":
      logging.info("attention_impl %r forms no probabilities: probing the "
                   "same model with 'einsum'", config.attention_impl)
      config = config.replace(attention_impl="einsum")
    if not byte_level:
      tokens, where = _tokens(False, config.vocab_size)
    W, T = tokens.shape
    probe.check_probe(config, W, T)
    min_query = T // 2 if _MIN_QUERY.value is None else _MIN_QUERY.value
    if min_query >= T:
      raise ValueError(f"--min_query={min_query}: windows hold {T} tokens")
    layers = attention_stats.pick(config.num_layers, _LAYERS.value)
    heads = attention_stats.pick(config.num_heads, _HEADS.value)
  source = loaded.source.replace(os.getcwd() + os.sep, "")
  logging.info("model %s (%s), %d x %d tokens from %s", config.variant,
               source, W, T, where)
  probs, summary = attention_stats.analyse(
      loaded.params, config, tokens, sink_k=tuple(_SINK_K.value),
      min_query=min_query)

  k1 = str(min(_SINK_K.value))
  print(f"queries at positions >= {min_query} of {W} window(s) of {T} "
        f"tokens; uniform causal attention: first-{k1} mass "
        f"{summary['sink_mass_uniform'][k1]:.5f}, entropy "
        f"{summary['entropy_uniform']:.3f} nats")
  print(f"| layer | first-{k1} mass (head mean) | max head | entropy |")
  print("|---|---|---|---|")
  for row in summary["per_layer"]:
    print(f"| {row['layer']} | {row[f'sink_mass_{k1}']:.5f} | "
          f"{row[f'sink_mass_{k1}_max_head']:.5f} | {row['entropy']:.3f} |")

  os.makedirs(_WORKDIR.value, exist_ok=True)
  title = f"{config.variant} ({source}), {where}, {W} x {T} tokens"
  attention_stats.plot_heatmaps(
      probs[:, 0], os.path.join(_WORKDIR.value, "attention_map.png"),
      layers=layers, heads=heads, title=title + " (window 0)")
  attention_stats.plot_summary(
      summary, os.path.join(_WORKDIR.value, "attention_stats.png"),
      title=f"{title}; queries at positions >= {min_query}")
  result = dict(
      model=dict(source=source, variant=config.variant,
                 config=config.to_dict()),
      tokens=dict(source=where, windows=W, length=T,
                  ids=tokens[0].tolist()),
      sink_k=_SINK_K.value, layers_drawn=layers, heads_drawn=heads,
      **summary)
  with open(os.path.join(_WORKDIR.value, "attention_map.json"), "w") as f:
    json.dump(result, f, indent=1, default=str)
  logging.info("wrote %s", _WORKDIR.value)


if __name__ == "__main__":
  cli.run(main)
