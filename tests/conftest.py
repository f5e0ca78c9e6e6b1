"""Test-wide JAX settings (strict broadcasting, exact float32 matmuls) and the
cleanup of the files xdist workers share."""

import glob
import os
import tempfile
import uuid

import jax

# Implicit rank promotion hides shape bugs (nanodo's habit).
jax.config.update("jax_numpy_rank_promotion", "raise")
# Parity checks compare float32 logits: no TF32/bf16-rounded matmuls.
jax.config.update("jax_default_matmul_precision", "highest")

# absltest helpers (create_tempdir, ...) read absl flags; pytest never
# parses them.
from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position

if not flags.FLAGS.is_parsed():
  flags.FLAGS.mark_as_parsed()


# ---- the shared 8-device check's files (tests/test_sharding.py) ------------
# xdist workers share the sharded check's output through
# `<tmp>/kvjax_sharded_check_<run id>.out` (+ .lock). The controller fixes the
# run id up front so that it can delete those files when the run ends.
def pytest_configure(config):
  if hasattr(config, "workerinput"):  # an xdist worker
    return
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
