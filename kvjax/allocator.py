"""Host memory for XLA:CPU's buffers: keep it mapped between calls.

XLA:CPU allocates each execution's temporary buffer (465 MB for the
training step of `configs/train.py:gqa`) with `malloc` and frees it when
the call returns. glibc serves a block that large with `mmap` and gives it
back with `munmap` on free, so every call faults every page of it in
again: 114,000 minor page faults per training step, the first write to
each page paying the kernel's fault and zeroing. GPU and TPU runtimes
keep a pool of device memory for exactly this reason.

`keep_host_memory()` asks glibc to do the same with three `mallopt`
settings: one arena (`M_ARENA_MAX` 1: the runtime's worker threads
allocate from the main heap, the only one that can hold a block above
64 MB without `mmap`), no `mmap` for large blocks (`M_MMAP_MAX` 0), and no
trimming of the heap's top (`M_TRIM_THRESHOLD` at its maximum). Freed
buffers then stay mapped and are reused by the next call: 0 faults per
step, and the training step 1.20x faster on the AMD EPYC Zen 4 host
(same-run measurement, WORKSPACE.md "Training speed"). The process keeps its peak heap mapped.

Where it is applied: the training loops (`kvjax.train.run`,
`kvjax.lab.tasks.train_task_model`), where one program runs thousands of
times. Not at import: the single arena makes XLA's compilation ~20 %
slower (its threads contend for the one heap), which a short job pays in
full (the main job, `experiments/generate.py`, 17 s against 12 s).

glibc gives a thread its arena at the thread's first allocation, so the
settings only reach the runtime's threads if they are in place before the
JAX backend starts; later, `keep_host_memory` changes nothing and says so
(False). `KVJAX_HOST_MEMORY=system` leaves the allocator alone; not glibc
(macOS, musl): nothing to do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from absl import logging
from jax._src import xla_bridge  # backends_are_initialized: no public API

ENV = "KVJAX_HOST_MEMORY"

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_SETTINGS = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0),
             (_M_TRIM_THRESHOLD, 2**31 - 1))

_applied: list[bool] = []


def _glibc():
  """The C library if it is glibc (it has `mallopt` and
  `gnu_get_libc_version`), else None."""
  name = ctypes.util.find_library("c")
  if name is None:
    return None
  try:
    libc = ctypes.CDLL(name)
  except OSError:
    return None
  if not (hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version")):
    return None
  return libc


def keep_host_memory() -> bool:
  """Applies the settings above once per process, before the JAX backend
  starts; returns whether they are in effect (False: the backend already
  runs, not glibc, or `KVJAX_HOST_MEMORY=system`). Raises
  ValueError for any other value of `KVJAX_HOST_MEMORY` than 'keep' (the
  default) or 'system'."""
  if _applied:
    return _applied[0]
  mode = os.environ.get(ENV, "keep")
  if mode not in ("keep", "system"):
    raise ValueError(f"{ENV} must be 'keep' or 'system', got {mode!r}")
  if xla_bridge.backends_are_initialized():
    # Too late for the runtime's threads (module docstring); not recorded,
    # so nothing about this process's allocator changes.
    logging.info("host memory: JAX backend already running; glibc defaults "
                 "kept")
    return False
  libc = _glibc() if mode == "keep" else None
  ok = libc is not None and all(libc.mallopt(p, v) == 1 for p, v in _SETTINGS)
  _applied.append(ok)
  return ok
