"""Byte-level text data: tokenizer, the Jane Austen corpus, and batching.

Tokens are the 256 byte values of UTF-8 text plus three specials:

  ids 0..255   the bytes themselves
  PAD = 256    padding; the training loss ignores PAD targets
  BOS = 257    begins a document
  EOS = 258    ends a document
  VOCAB_SIZE = 259

Because one token is one byte, a loss of x nats per token is x / ln 2 bits per
byte; the two specials per document are counted as tokens too (2 in ~470 K for
the validation novel), which changes bits per byte by well under 0.01 %.

Corpus: Jane Austen's six novels, shipped as R data inside the Debian package
`r-cran-janeaustenr` (an R lazy-load database: `Rdata.rdx` is the index,
`Rdata.rdb` holds one compressed, R-serialized character vector per novel, one
element per line). Nothing is downloaded at run time; `python -m kvjax.data
--setup` is the explicit, one-off install step.

Where the corpus lives (`resolve_data_dir`), first match wins:
  1. a `data_dir` argument (the scripts' `--data_dir` flag,
     `--config.train.data_dir`);
  2. $KVJAX_DATA_DIR;
  3. the user's cache directory, `$XDG_CACHE_HOME/kvjax/janeaustenr`
     (`~/.cache/kvjax/janeaustenr` when XDG_CACHE_HOME is unset): where
     `--setup` installs, whatever the working directory;
  4. `data/janeaustenr` in the repository checkout, where `--setup` installed
     before, read when it holds the corpus and the cache directory does not.
`python -m kvjax.data` prints which one is used.

The split is by document:
`persuasion` (Austen's last complete novel, ~467 KB) is the validation and
long-context evaluation text, the other five (~3.56 MB) are training text.

Batches are numpy arrays of windows of T+1 consecutive tokens (inputs are
`[:, :-1]`, targets `[:, 1:]`). The training batch for a step is a pure
function of (seed, step), so a resumed run sees exactly the batches an
uninterrupted one would.

Dimension alphabet (`kvjax.config`): B batch, T sequence length (a window's
inputs), T' a token stream's length.
"""

from __future__ import annotations

import glob
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import tempfile
import warnings
import zlib
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

BYTE_VOCAB = 256
PAD = 256
BOS = 257
EOS = 258
VOCAB_SIZE = 259

DEBIAN_PACKAGE = "r-cran-janeaustenr"
DATA_DIR_ENV = "KVJAX_DATA_DIR"
CORPUS_NAME = "janeaustenr"
# Where `--setup` installed before the corpus moved to the cache directory:
# relative to the working directory then, read now in the repository checkout.
LEGACY_DATA_DIR = (pathlib.Path(__file__).resolve().parent.parent / "data" /
                   CORPUS_NAME)
INSTALL_COMMAND = "python -m kvjax.data --setup"
# Where `dpkg -x` puts the R data inside the extraction root.
_RDATA_SUBDIR = pathlib.Path("usr/lib/R/site-library/janeaustenr/data")

# The six novels, under the names the R package uses, in publication order.
NOVELS = (
    "sensesensibility",
    "prideprejudice",
    "mansfieldpark",
    "emma",
    "northangerabbey",
    "persuasion",
)
VALIDATION_NOVEL = "persuasion"


class CorpusNotFoundError(FileNotFoundError):
  """The Austen corpus is not installed; the message names the install command."""


# ----------------------------------------------------------------------------
# Tokenizer.


def encode(text: str, *, bos: bool = False, eos: bool = False) -> np.ndarray:
  """UTF-8 bytes of `text` as token ids.

  Args:
    text: any string.
    bos: prepend BOS.
    eos: append EOS.

  Returns:
    int32 [T'] with values in [0, 256), plus BOS/EOS where asked for.
  """
  ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
  parts = [np.array([BOS], np.int32)] if bos else []
  parts.append(ids)
  if eos:
    parts.append(np.array([EOS], np.int32))
  return np.concatenate(parts)


def decode(ids) -> str:
  """Text of token ids; specials are skipped, invalid UTF-8 becomes U+FFFD.

  Args:
    ids: integer array-like [T'] (any int dtype; jax arrays are accepted).

  Returns:
    The decoded string.

  Raises:
    ValueError: an id lies outside [0, VOCAB_SIZE); that is a bug upstream,
      not something to paper over.
  """
  ids = np.asarray(ids).reshape(-1)
  if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
    raise ValueError(
        f"token ids must lie in [0, {VOCAB_SIZE}); got min {ids.min()}, "
        f"max {ids.max()}")
  return ids[ids < BYTE_VOCAB].astype(np.uint8).tobytes().decode(
      "utf-8", errors="replace")


# ----------------------------------------------------------------------------
# Corpus location, setup and loading.


def default_data_dir() -> pathlib.Path:
  """Where `--setup` installs by default: `$XDG_CACHE_HOME/kvjax/janeaustenr`,
  else `~/.cache/kvjax/janeaustenr` (absolute, independent of the working
  directory)."""
  cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(
      os.path.expanduser("~"), ".cache")
  return pathlib.Path(cache).absolute() / "kvjax" / CORPUS_NAME


def _has_corpus(root: pathlib.Path) -> bool:
  return any((c / "Rdata.rdb").is_file() and (c / "Rdata.rdx").is_file()
             for c in (root / _RDATA_SUBDIR, root))


def install_dir(data_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """Where `setup_corpus(data_dir)` installs: `data_dir`, else
  $KVJAX_DATA_DIR, else `default_data_dir()`."""
  if data_dir is not None:
    return pathlib.Path(data_dir)
  return pathlib.Path(os.environ.get(DATA_DIR_ENV) or default_data_dir())


def resolve_data_dir(data_dir: str | os.PathLike | None = None
                     ) -> pathlib.Path:
  """The corpus root read: `data_dir` if given, else $KVJAX_DATA_DIR, else
  the cache directory (`default_data_dir()`), else the checkout's old
  `data/janeaustenr` when only it holds the corpus (module docstring)."""
  root = install_dir(data_dir)
  if (data_dir is None and not os.environ.get(DATA_DIR_ENV) and
      not _has_corpus(root) and _has_corpus(LEGACY_DATA_DIR)):
    return LEGACY_DATA_DIR
  return root


def install_command(data_dir: str | os.PathLike | None = None) -> str:
  """The exact command that installs the corpus where `load_austen(data_dir)`
  looks for it."""
  root = resolve_data_dir(data_dir)
  if root.absolute() == resolve_data_dir(None).absolute():
    return INSTALL_COMMAND
  return f"{INSTALL_COMMAND} --data_dir={root}"


def locate_corpus(data_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """The directory holding `Rdata.rdb` and `Rdata.rdx`.

  Accepts either the `dpkg -x` extraction root or the R `data/` directory
  itself.

  Raises:
    CorpusNotFoundError: neither layout is present; the one-line message
      names the command that installs it there.
  """
  root = resolve_data_dir(data_dir)
  for candidate in (root / _RDATA_SUBDIR, root):
    if (candidate / "Rdata.rdb").is_file() and (candidate / "Rdata.rdx").is_file():
      return candidate
  raise CorpusNotFoundError(
      f"the Jane Austen corpus is not installed in {root}; install it with: "
      f"{install_command(data_dir)} (one-off: pip install rdata, apt-get "
      f"download {DEBIAN_PACKAGE}, dpkg -x), or point ${DATA_DIR_ENV} at an "
      f"existing extraction")


def _import_rdata():
  try:
    import rdata  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise CorpusNotFoundError(
        "reading the Austen corpus needs the `rdata` package: pip install "
        f"rdata (or pip install -e '.[corpus]', or {INSTALL_COMMAND})"
    ) from e
  return rdata


def _unserialize(rdata, blob: bytes):
  # The blobs are bare R serializations ("X\n" XDR format) without the RDS
  # file header rdata sniffs for; it assumes RDS and warns, which is correct.
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Unknown file type")
    return rdata.conversion.convert(rdata.parser.parse_data(blob))


def _decompress_rdb_entry(blob: bytes, compressed: int) -> bytes:
  """One lazy-load DB entry: 4-byte big-endian uncompressed length, then data.

  R writes zlib when compress=TRUE/1; for 2 (bzip2) and 3 (xz) a one-byte type
  tag ('2', 'Z', or '0' for stored) follows the length.
  """
  (length,) = struct.unpack(">I", blob[:4])
  if compressed == 1:
    out = zlib.decompress(blob[4:])
  elif compressed in (2, 3):
    tag, payload = blob[4:5], blob[5:]
    if tag == b"0":
      out = payload
    elif tag == b"2":
      import bz2  # pylint: disable=g-import-not-at-top
      out = bz2.decompress(payload)
    elif tag == b"Z":
      import lzma  # pylint: disable=g-import-not-at-top
      out = lzma.decompress(payload)
    elif tag == b"1":
      out = zlib.decompress(payload)
    else:
      raise ValueError(f"unknown R lazy-load compression tag {tag!r}")
  else:
    raise ValueError(f"unsupported R lazy-load compression {compressed!r}")
  if len(out) != length:
    raise ValueError(
        f"corrupt R lazy-load entry: header says {length} bytes, got {len(out)}")
  return out


def load_austen(data_dir: str | os.PathLike | None = None) -> dict[str, str]:
  """The six novels as text, keyed by the names in `NOVELS` (that order).

  Each novel's lines are joined with '\\n' (the R vectors hold one line per
  element, blank lines included), so paragraphs and chapter breaks survive.

  Raises:
    CorpusNotFoundError: the corpus is not installed, or `rdata` (which reads
      it) is missing; the one-line message names the command that fixes it.
  """
  directory = locate_corpus(data_dir)
  rdata = _import_rdata()
  index = _unserialize(rdata, (directory / "Rdata.rdx").read_bytes())
  compressed = int(np.asarray(index["compressed"]).reshape(-1)[0])
  variables = {str(k): v for k, v in index["variables"].items()}
  missing = [n for n in NOVELS if n not in variables]
  if missing:
    raise ValueError(f"{directory / 'Rdata.rdx'} lacks novels {missing}; "
                     f"found {sorted(variables)}")
  rdb = (directory / "Rdata.rdb").read_bytes()
  novels = {}
  for name in NOVELS:
    offset, size = (int(x) for x in variables[name])
    lines = _unserialize(
        rdata, _decompress_rdb_entry(rdb[offset:offset + size], compressed))
    novels[name] = "\n".join(str(line) for line in lines)
  return novels


def setup_corpus(data_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """Installs the corpus: pip install rdata, apt-get download, dpkg -x.

  This is the one explicit step that touches a registry; nothing else in
  kvjax downloads. Needs `apt-get` and `dpkg` (Debian) and the registries.

  Args:
    data_dir: where to install (default: `install_dir()`, i.e.
      $KVJAX_DATA_DIR or the user's cache directory).

  Returns:
    The directory holding Rdata.rdb/.rdx.
  """
  root = install_dir(data_dir).absolute()
  try:
    import rdata  # pylint: disable=g-import-not-at-top
    del rdata  # only whether it imports
  except ImportError:
    subprocess.run([sys.executable, "-m", "pip", "install", "rdata"], check=True)
  for tool in ("apt-get", "dpkg"):
    if shutil.which(tool) is None:
      raise RuntimeError(f"`{tool}` not found: the corpus ships as the Debian "
                         f"package {DEBIAN_PACKAGE}, so setup needs Debian tools.")
  root.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory() as tmp:
    # World-readable so apt's unprivileged `_apt` user may write into it.
    os.chmod(tmp, 0o777)
    subprocess.run(["apt-get", "download", DEBIAN_PACKAGE], cwd=tmp, check=True)
    debs = glob.glob(os.path.join(tmp, f"{DEBIAN_PACKAGE}_*.deb"))
    if len(debs) != 1:
      raise RuntimeError(f"expected one {DEBIAN_PACKAGE} .deb, found {debs}")
    subprocess.run(["dpkg", "-x", debs[0], str(root)], check=True)
  return locate_corpus(root)


# ----------------------------------------------------------------------------
# Split and token streams.


class DocumentSplit(NamedTuple):
  """Disjoint train/validation documents (name -> text)."""
  train: dict[str, str]
  validation: dict[str, str]


def split_documents(
    documents: Mapping[str, str],
    validation: Sequence[str] = (VALIDATION_NOVEL,),
) -> DocumentSplit:
  """Splits by whole document: names in `validation` vs. all the others.

  Disjoint by construction: each name goes to exactly one side.

  Raises:
    ValueError: a validation name is not among the documents, or nothing would
      be left to train on.
  """
  missing = [n for n in validation if n not in documents]
  if missing:
    raise ValueError(f"validation documents {missing} not among "
                     f"{sorted(documents)}")
  held = set(validation)
  train = {n: t for n, t in documents.items() if n not in held}
  if not train:
    raise ValueError("validation takes every document; nothing left to train on")
  return DocumentSplit(train=train,
                       validation={n: documents[n] for n in documents if n in held})


def documents_to_stream(documents: Mapping[str, str]) -> np.ndarray:
  """One token stream: BOS text EOS for each document, in sorted-name order.

  Sorting makes the stream independent of dict insertion order.

  Returns:
    int32 [T'].
  """
  if not documents:
    raise ValueError("no documents")
  return np.concatenate(
      [encode(documents[n], bos=True, eos=True) for n in sorted(documents)])


class Streams(NamedTuple):
  """Token streams of the train and validation documents, int32 [T'] each."""
  train: np.ndarray
  validation: np.ndarray


def austen_streams(data_dir: str | os.PathLike | None = None,
                   validation: Sequence[str] = (VALIDATION_NOVEL,)) -> Streams:
  """Train/validation token streams of the Austen corpus (split by novel)."""
  split = split_documents(load_austen(data_dir), validation)
  return Streams(train=documents_to_stream(split.train),
                 validation=documents_to_stream(split.validation))


def heldout_text(data_dir: str | os.PathLike | None = None,
                 name: str = VALIDATION_NOVEL) -> str:
  """The full text of one held-out novel, for long-context evaluation."""
  novels = load_austen(data_dir)
  if name not in novels:
    raise ValueError(f"unknown novel {name!r}; choose from {NOVELS}")
  return novels[name]


def heldout_stream(data_dir: str | os.PathLike | None = None,
                   name: str = VALIDATION_NOVEL) -> np.ndarray:
  """One held-out novel as one continuous stream, BOS text EOS.

  For the default novel this equals `austen_streams(data_dir).validation`, so
  streaming perplexity and validation loss read the same tokens.

  Returns:
    int32 [T'] (T' ~ 467 K for persuasion).
  """
  return documents_to_stream({name: heldout_text(data_dir, name)})


# ----------------------------------------------------------------------------
# Batching.


def _check_window(stream: np.ndarray, seq_len: int) -> None:
  if stream.ndim != 1:
    raise ValueError(f"stream must be 1-D, got shape {stream.shape}")
  if seq_len < 1:
    raise ValueError(f"seq_len must be >= 1, got {seq_len}")
  if stream.shape[0] < seq_len + 1:
    raise ValueError(f"stream of {stream.shape[0]} tokens is shorter than one "
                     f"window of seq_len + 1 = {seq_len + 1}")


def train_batch(stream: np.ndarray, *, batch_size: int, seq_len: int,
                seed: int, step: int, bos: bool = False) -> np.ndarray:
  """Random windows of the training stream for one step.

  A pure function of (stream, batch_size, seq_len, seed, step): the generator
  is seeded with the pair (seed, step), so step i's batch does not depend on
  which steps ran before, and a resumed run replays the same data.

  Args:
    stream: int32 [T'] token stream.
    batch_size: B.
    seq_len: T; each row holds T+1 tokens (inputs [:, :-1], targets [:, 1:]).
    seed: data seed (non-negative).
    step: training step (non-negative).
    bos: every row is BOS followed by a window of T tokens (a first token
      every row shares, where attention sinks can form), instead of a
      window of T + 1.

  Returns:
    int32 [B, T+1].
  """
  _check_window(stream, seq_len)
  if seed < 0 or step < 0:
    raise ValueError(f"seed and step must be non-negative, got {seed}, {step}")
  rng = np.random.default_rng([seed, step])
  starts_B = rng.integers(0, stream.shape[0] - seq_len, size=batch_size)
  return _windows(stream, starts_B, seq_len, bos)


def _windows(stream: np.ndarray, starts, seq_len: int, bos: bool):
  """[len(starts), T+1]: the windows of T + 1 tokens at `starts`, or BOS and
  the windows of T tokens."""
  n = seq_len if bos else seq_len + 1
  rows = np.asarray(stream[np.asarray(starts, np.int64)[:, None] +
                           np.arange(n)[None, :]], np.int32)
  if bos:
    rows = np.concatenate([np.full((rows.shape[0], 1), BOS, np.int32), rows],
                          axis=1)
  return rows


def eval_batches(stream: np.ndarray, *, batch_size: int, seq_len: int,
                 num_batches: int, bos: bool = False) -> np.ndarray:
  """A fixed evaluation set: evenly spaced windows across the whole stream.

  No randomness: the windows start at `linspace(0, T' - T - 1, num_batches*B)`,
  so they sample the whole held-out text, and they do not overlap whenever the
  stream holds that many windows. `bos`: as `train_batch`.

  Returns:
    int32 [num_batches, B, T+1].
  """
  _check_window(stream, seq_len)
  count = num_batches * batch_size
  if count < 1:
    raise ValueError(f"need at least one window, got {num_batches}x{batch_size}")
  starts = np.linspace(0, stream.shape[0] - seq_len - 1, count).round()
  return _windows(stream, starts, seq_len, bos).reshape(
      num_batches, batch_size, seq_len + 1)


# ----------------------------------------------------------------------------
# `python -m kvjax.data --setup`


def _main(argv):
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  data_dir = flags.FLAGS.data_dir
  if flags.FLAGS.setup:
    try:
      where = locate_corpus(data_dir)
      print(f"corpus already installed at {where}")
    except CorpusNotFoundError:
      setup_corpus(data_dir)
  novels = load_austen(data_dir)
  for name, text in novels.items():
    print(f"{name:<17} {len(text.encode('utf-8')):9d} bytes")
  streams = austen_streams(data_dir)
  print(f"corpus at {locate_corpus(data_dir)}: train {streams.train.shape[0]} "
        f"tokens, validation ({VALIDATION_NOVEL}) "
        f"{streams.validation.shape[0]} tokens")


if __name__ == "__main__":
  from absl import flags  # pylint: disable=g-import-not-at-top
  from kvjax import cli  # pylint: disable=g-import-not-at-top
  # Run the imported module's _main (not this __main__ copy's), so that its
  # CorpusNotFoundError is the class cli.run reports in one line.
  from kvjax import data as _data  # pylint: disable=g-import-not-at-top
  flags.DEFINE_bool("setup", False,
                    "Install the corpus (pip install rdata, apt-get download, "
                    "dpkg -x) unless it is already there, then read it.")
  flags.DEFINE_string(
      "data_dir", None,
      f"Corpus root (default: ${DATA_DIR_ENV}, else {default_data_dir()}; "
      f"an old {LEGACY_DATA_DIR} is still read).")
  cli.run(_data._main)  # pylint: disable=protected-access
