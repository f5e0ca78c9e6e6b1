"""Tests for kvjax.data on small generated text; the real corpus is never needed."""

import os
import pathlib
import struct
import tempfile
import zlib

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from kvjax import data
import cases  # pylint: disable=g-bad-import-order

_DOCS = {
    "alpha": "It is a truth universally acknowledged.\n\nChapter 2\n",
    "beta": "Ünïcödé — and emoji 🎩 survive the byte round trip.",
    "gamma": "short",
    "delta": "The quick brown fox jumps over the lazy dog. " * 20,
}


class TokenizerTest(parameterized.TestCase):

  def test_constants(self):
    self.assertEqual(data.BYTE_VOCAB, 256)
    self.assertEqual(len({data.PAD, data.BOS, data.EOS}), 3)
    self.assertTrue(all(data.BYTE_VOCAB <= s < data.VOCAB_SIZE
                        for s in (data.PAD, data.BOS, data.EOS)))
    self.assertEqual(data.VOCAB_SIZE, 259)

  @parameterized.named_parameters((name, text) for name, text in _DOCS.items())
  def test_round_trip(self, text):
    ids = data.encode(text)
    self.assertEqual(ids.dtype, np.int32)
    self.assertEqual(ids.shape, (len(text.encode("utf-8")),))
    self.assertEqual(data.decode(ids), text)

  def test_specials_are_skipped(self):
    ids = data.encode("abc", bos=True, eos=True)
    self.assertEqual(ids[0], data.BOS)
    self.assertEqual(ids[-1], data.EOS)
    padded = np.concatenate([ids, [data.PAD, data.PAD]])
    self.assertEqual(data.decode(padded), "abc")

  def test_invalid_utf8_is_replaced(self):
    # A lone continuation byte is what a byte model may sample mid-character.
    self.assertEqual(data.decode([ord("a"), 0x80, ord("b")]), "a\ufffdb")

  def test_out_of_range_raises(self):
    with self.assertRaisesRegex(ValueError, "259"):
      data.decode([1, data.VOCAB_SIZE])

  def test_empty(self):
    self.assertEqual(data.encode("").shape, (0,))
    self.assertEqual(data.decode(np.zeros((0,), np.int32)), "")


class SplitTest(absltest.TestCase):

  def test_disjoint_and_complete(self):
    split = data.split_documents(_DOCS, validation=("gamma",))
    self.assertEqual(set(split.validation), {"gamma"})
    self.assertEqual(set(split.train), set(_DOCS) - {"gamma"})
    self.assertEmpty(set(split.train) & set(split.validation))

  def test_deterministic_under_insertion_order(self):
    reordered = dict(reversed(list(_DOCS.items())))
    a = data.split_documents(_DOCS, validation=("beta",))
    b = data.split_documents(reordered, validation=("beta",))
    np.testing.assert_array_equal(data.documents_to_stream(a.train),
                                  data.documents_to_stream(b.train))
    np.testing.assert_array_equal(data.documents_to_stream(a.validation),
                                  data.documents_to_stream(b.validation))

  def test_stream_layout(self):
    stream = data.documents_to_stream({"b": "yy", "a": "x"})
    expected = [data.BOS, ord("x"), data.EOS, data.BOS, ord("y"), ord("y"),
                data.EOS]
    np.testing.assert_array_equal(stream, expected)
    self.assertEqual(stream.dtype, np.int32)

  def test_default_validation_is_a_novel(self):
    self.assertIn(data.VALIDATION_NOVEL, data.NOVELS)

  def test_unknown_validation_raises(self):
    with self.assertRaisesRegex(ValueError, "nope"):
      data.split_documents(_DOCS, validation=("nope",))

  def test_empty_train_raises(self):
    with self.assertRaisesRegex(ValueError, "nothing left"):
      data.split_documents({"a": "x"}, validation=("a",))


class BatchTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.stream = data.documents_to_stream(_DOCS)

  @cases.product(batch_size=(1, 4), seq_len=(1, 16))
  def test_train_batch_shape_and_values(self, batch_size, seq_len):
    batch = data.train_batch(self.stream, batch_size=batch_size,
                             seq_len=seq_len, seed=0, step=3)
    self.assertEqual(batch.shape, (batch_size, seq_len + 1))
    self.assertEqual(batch.dtype, np.int32)
    # Every row is a contiguous window of the stream.
    joined = self.stream.tobytes()
    for row in batch:
      self.assertIn(row.astype(np.int32).tobytes(), joined)

  def test_bos_rows_are_bos_and_a_window(self):
    kw = dict(batch_size=4, seq_len=16)
    batch = data.train_batch(self.stream, seed=0, step=3, bos=True, **kw)
    self.assertEqual(batch.shape, (4, 17))
    np.testing.assert_array_equal(batch[:, 0], data.BOS)
    joined = self.stream.tobytes()
    for row in batch:
      self.assertIn(row[1:].tobytes(), joined)
    evals = data.eval_batches(self.stream, num_batches=2, bos=True, **kw)
    self.assertEqual(evals.shape, (2, 4, 17))
    np.testing.assert_array_equal(evals[..., 0], data.BOS)
    plain = data.eval_batches(self.stream, num_batches=2, **kw)
    # The same starts: BOS takes the place of the window's last token.
    np.testing.assert_array_equal(evals[..., 1:], plain[..., :-1])

  def test_train_batch_depends_only_on_seed_and_step(self):
    kw = dict(batch_size=8, seq_len=16)
    first = data.train_batch(self.stream, seed=1, step=7, **kw)
    # Asking for other steps in between changes nothing: no hidden state.
    data.train_batch(self.stream, seed=1, step=0, **kw)
    data.train_batch(self.stream, seed=2, step=7, **kw)
    again = data.train_batch(self.stream, seed=1, step=7, **kw)
    np.testing.assert_array_equal(first, again)
    other_step = data.train_batch(self.stream, seed=1, step=8, **kw)
    other_seed = data.train_batch(self.stream, seed=2, step=7, **kw)
    self.assertFalse(np.array_equal(first, other_step))
    self.assertFalse(np.array_equal(first, other_seed))

  def test_eval_batches_fixed_and_spread(self):
    a = data.eval_batches(self.stream, batch_size=2, seq_len=8, num_batches=3)
    b = data.eval_batches(self.stream, batch_size=2, seq_len=8, num_batches=3)
    self.assertEqual(a.shape, (3, 2, 9))
    self.assertEqual(a.dtype, np.int32)
    np.testing.assert_array_equal(a, b)
    flat = a.reshape(-1, 9)
    # First window starts the stream, last one ends it.
    np.testing.assert_array_equal(flat[0], self.stream[:9])
    np.testing.assert_array_equal(flat[-1], self.stream[-9:])

  def test_eval_batches_do_not_overlap_when_they_fit(self):
    stream = np.arange(100, dtype=np.int32)
    windows = data.eval_batches(stream, batch_size=2, seq_len=9,
                                num_batches=5).reshape(-1, 10)
    self.assertLen(np.unique(windows), windows.size)

  def test_too_short_stream_raises(self):
    with self.assertRaisesRegex(ValueError, "shorter than one window"):
      data.train_batch(np.zeros((4,), np.int32), batch_size=1, seq_len=4,
                       seed=0, step=0)


def _fake_corpus(root: pathlib.Path) -> pathlib.Path:
  """Empty Rdata files where `locate_corpus` looks (the R data layout)."""
  directory = root / "usr/lib/R/site-library/janeaustenr/data"
  directory.mkdir(parents=True)
  for name in ("Rdata.rdb", "Rdata.rdx"):
    (directory / name).write_bytes(b"")
  return directory


class CorpusTest(absltest.TestCase):
  """Where the corpus lives, and what a missing corpus says."""

  def setUp(self):
    super().setUp()
    # tempfile, not create_tempdir: the latter needs parsed absl flags,
    # which pytest does not provide.
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    self.tmp = pathlib.Path(tmp.name)
    env = absltest.mock.patch.dict("os.environ", {
        data.DATA_DIR_ENV: "", "XDG_CACHE_HOME": str(self.tmp / "cache")})
    env.start()
    self.addCleanup(env.stop)
    # No corpus in the checkout unless a test puts one there.
    legacy = absltest.mock.patch.object(data, "LEGACY_DATA_DIR",
                                        self.tmp / "checkout/data/janeaustenr")
    legacy.start()
    self.addCleanup(legacy.stop)

  def test_missing_corpus_is_one_line_with_the_exact_command(self):
    empty = self.tmp / "empty"
    with self.assertRaises(data.CorpusNotFoundError) as ctx:
      data.load_austen(empty)
    message = str(ctx.exception)
    self.assertNotIn("\n", message)
    self.assertIn(f"install it with: python -m kvjax.data --setup "
                  f"--data_dir={empty} (", message)
    self.assertIn("apt-get download r-cran-janeaustenr", message)
    self.assertIsInstance(ctx.exception, FileNotFoundError)
    # Where the plain command installs, the message gives the plain command.
    with self.assertRaises(data.CorpusNotFoundError) as ctx:
      data.load_austen()
    self.assertIn(f"not installed in {data.default_data_dir()}; install it "
                  "with: python -m kvjax.data --setup (", str(ctx.exception))

  def test_default_is_the_user_cache_directory_whatever_the_cwd(self):
    expected = self.tmp / "cache" / "kvjax" / "janeaustenr"
    self.assertEqual(data.default_data_dir(), expected)
    cwd = os.getcwd()
    try:
      os.chdir(self.tmp)
      self.assertEqual(data.resolve_data_dir(), expected)
      self.assertTrue(data.resolve_data_dir().is_absolute())
    finally:
      os.chdir(cwd)
    self.assertEqual(data.install_dir(), expected)
    with absltest.mock.patch.dict("os.environ", {"XDG_CACHE_HOME": ""}):
      self.assertEqual(data.default_data_dir(), pathlib.Path(
          os.path.expanduser("~")) / ".cache" / "kvjax" / "janeaustenr")

  def test_argument_then_env_var_override_the_default(self):
    with absltest.mock.patch.dict("os.environ", {data.DATA_DIR_ENV: "/x/y"}):
      self.assertEqual(data.resolve_data_dir(), pathlib.Path("/x/y"))
      self.assertEqual(data.install_dir(), pathlib.Path("/x/y"))
      self.assertEqual(data.resolve_data_dir("/z"), pathlib.Path("/z"))
      # The env var is what the plain command resolves to as well.
      self.assertEqual(data.install_command(), data.INSTALL_COMMAND)
    self.assertEqual(data.install_command("/z"),
                     f"{data.INSTALL_COMMAND} --data_dir=/z")

  def test_the_checkout_data_dir_is_still_read(self):
    legacy = _fake_corpus(data.LEGACY_DATA_DIR)
    self.assertEqual(data.resolve_data_dir(), data.LEGACY_DATA_DIR)
    self.assertEqual(data.locate_corpus(), legacy)
    # --setup still installs into the cache directory ...
    self.assertEqual(data.install_dir(), data.default_data_dir())
    # ... which, once it holds the corpus, is read first.
    cached = _fake_corpus(data.default_data_dir())
    self.assertEqual(data.locate_corpus(), cached)
    # An explicit directory or the env var is never second-guessed.
    self.assertEqual(data.resolve_data_dir(self.tmp / "elsewhere"),
                     self.tmp / "elsewhere")

  def test_missing_rdata_reader_names_the_fix(self):
    _fake_corpus(data.default_data_dir())
    with absltest.mock.patch.dict("sys.modules", {"rdata": None}):
      with self.assertRaises(data.CorpusNotFoundError) as ctx:
        data.load_austen()
    self.assertIn("pip install rdata", str(ctx.exception))
    self.assertNotIn("\n", str(ctx.exception))

  def test_rdb_entry_decompression(self):
    payload = b"X\n" + bytes(range(200))
    blob = struct.pack(">I", len(payload)) + zlib.compress(payload)
    self.assertEqual(data._decompress_rdb_entry(blob, 1), payload)
    with self.assertRaisesRegex(ValueError, "corrupt"):
      data._decompress_rdb_entry(struct.pack(">I", 3) + zlib.compress(payload),
                                 1)


if __name__ == "__main__":
  absltest.main()
