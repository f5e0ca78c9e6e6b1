"""Test-wide JAX settings (strict broadcasting, exact float32 matmuls, a
persistent compilation cache), the `slow` marks of named cases
(tests/cases.py), and the cleanup of the files xdist workers share."""

import glob
import os
import tempfile
import uuid

import jax
import pytest

# Implicit rank promotion hides shape bugs (nanodo's habit).
jax.config.update("jax_numpy_rank_promotion", "raise")
# Parity checks compare float32 logits: no TF32/bf16-rounded matmuls.
jax.config.update("jax_default_matmul_precision", "highest")
# glibc's default allocator for the suite and the subprocesses it launches:
# the training loops' one-arena setting (kvjax/allocator.py) makes XLA's
# compilation ~20 % slower, and the suite is compile-bound.
# tests/test_allocator.py sets it per subprocess.
os.environ.setdefault("KVJAX_HOST_MEMORY", "system")
# One form for norm-fed one-row products (kvjax/norm_matvec.py) instead of
# a ~2 s, 2 x last-level-cache measurement in every worker and subprocess;
# tests/test_packed.py runs both forms, tests/test_norm_matvec.py the
# measurement.
os.environ.setdefault("KVJAX_NORM_MATVEC", "fused")


# ---- the persistent compilation cache --------------------------------------
# Most of the suite's time is XLA compiling the same small programs run after
# run; a warm cache turns those compiles into file reads. Where:
# $KVJAX_COMPILE_CACHE (empty or "off": no cache), else
# ${XDG_CACHE_HOME:-~/.cache}/kvjax/jax_compile. Set through the
# environment as well, so the subprocesses tests launch (experiments, the
# sharded checks) read and write the same cache.
#
# xdist workers (and those subprocesses) share the directory. JAX writes an
# entry in place, unlocked: a process that reads an entry while another is
# still writing it gets a truncated stream, which JAX reports as a warning
# ("Error reading persistent compilation cache entry") and compiles instead
# (checked by truncating an entry). JAX's own size limit would lock every
# read and write and rescan the directory on every write (0.4 s a write at
# 2000 entries, measured), so the size is bounded here instead, once a run:
# `_prune_compile_cache`.
CACHE_LIMIT_BYTES = 1 << 30


def _compile_cache_dir():
  path = os.environ.get("KVJAX_COMPILE_CACHE")
  if path is None:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "kvjax", "jax_compile")
  return None if path.strip().lower() in ("", "off", "0") else path


_CACHE_DIR = _compile_cache_dir()
if _CACHE_DIR:
  _CACHE_SETTINGS = dict(
      jax_compilation_cache_dir=_CACHE_DIR,
      # Every program is stored, the ones that compile in milliseconds too:
      # the suite compiles thousands of them, and reading them back beats
      # compiling (test_policies + test_layered warm, one core: 45 s when
      # only programs over 0.1 s were stored, 30 s with every one).
      jax_persistent_cache_min_compile_time_secs=0.0,
      jax_persistent_cache_min_entry_size_bytes=-1)
  for _name, _value in _CACHE_SETTINGS.items():
    jax.config.update(_name, _value)
    os.environ[_name.upper()] = str(_value)


def _prune_compile_cache(limit=CACHE_LIMIT_BYTES):
  """Past `limit` bytes, deletes the oldest-written entries down to half of
  it (a deleted entry a test still needs is compiled and written again)."""
  if not _CACHE_DIR or not os.path.isdir(_CACHE_DIR):
    return
  entries = []
  for entry in os.scandir(_CACHE_DIR):
    if entry.is_file():
      stat = entry.stat()
      entries.append((stat.st_mtime, stat.st_size, entry.path))
  total = sum(size for _, size, _ in entries)
  if total <= limit:
    return
  for _, size, path in sorted(entries):
    try:
      os.remove(path)
    except FileNotFoundError:  # another run pruned it
      pass
    total -= size
    if total <= limit // 2:
      break


# absltest helpers (create_tempdir, ...) read absl flags; pytest never
# parses them.
from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position

if not flags.FLAGS.is_parsed():
  flags.FLAGS.mark_as_parsed()

import cases  # pylint: disable=g-import-not-at-top,wrong-import-position


def pytest_collection_modifyitems(items):
  """Marks the slow cases `cases.named` recorded on their test method
  (`name`, or `name__with_jit` etc. where chex.variants expanded it)."""
  for item in items:
    slow = getattr(getattr(item, "obj", None), cases.SLOW_CASES_ATTR, ())
    if item.name in slow or item.name.split("__")[0] in slow:
      item.add_marker(pytest.mark.slow)


# ---- compiled programs are released after every test module -----------------
# Every compiled XLA:CPU program holds ~8 memory maps for as long as JAX's
# caches keep it; a worker that runs a few thousand compilations reaches the
# kernel's vm.max_map_count (65530 by default) and dies mid-test (seen as
# crashed xdist workers once the suite outgrew it). Clearing the caches
# after each module unmaps them (measured: 6,896 maps after 800 compiles,
# 562 after `jax.clear_caches()`); the persistent compilation cache above
# makes a program a later module needs again a file read.
@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  yield
  jax.clear_caches()


# ---- the shared 8-device check's files (tests/test_sharding.py) ------------
# xdist workers share the sharded check's output through
# `<tmp>/kvjax_sharded_check_<run id>.out` (+ .lock). The controller fixes the
# run id up front so that it can delete those files when the run ends.
def pytest_configure(config):
  if hasattr(config, "workerinput"):  # an xdist worker
    return
  _prune_compile_cache()
  if config.pluginmanager.hasplugin("xdist") and (
      getattr(config.option, "testrunuid", "") is None):
    config.option.testrunuid = uuid.uuid4().hex


def pytest_unconfigure(config):
  run_id = getattr(config.option, "testrunuid", None)
  if hasattr(config, "workerinput") or not run_id:
    return
  pattern = os.path.join(tempfile.gettempdir(),
                         f"kvjax_sharded_check_{run_id}.out*")
  for path in glob.glob(pattern):
    os.remove(path)
