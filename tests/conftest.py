"""Test-wide JAX settings: strict broadcasting and exact float32 matmuls."""

import os
import sys

import jax

# Implicit rank promotion hides shape bugs (nanodo's habit).
jax.config.update("jax_numpy_rank_promotion", "raise")
# Parity checks compare float32 logits: no TF32/bf16-rounded matmuls.
jax.config.update("jax_default_matmul_precision", "highest")

# `configs/` holds config files, not a package: make them importable.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))

# absltest helpers (create_tempdir, ...) read absl flags; pytest never
# parses them.
from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position

if not flags.FLAGS.is_parsed():
  flags.FLAGS.mark_as_parsed()
