"""kvjax.allocator: XLA:CPU's buffers stay mapped between calls where the
training loops ask for it, and nothing changes where they cannot."""

import json
import os
import subprocess
import sys

import pytest

from kvjax import allocator

# A program whose 64 MiB output (above glibc's mmap threshold) is allocated
# on every call: with glibc's defaults each call maps it anew and faults in
# its 16,384 pages; kept, the freed block is reused and nothing faults.
_PROBE = r"""
import json, resource
from kvjax import allocator
applied = allocator.keep_host_memory()
import jax, jax.numpy as jnp
f = jax.jit(lambda x: x * 2.0 + 1.0)
x = jnp.ones((4096, 4096), jnp.float32)
for _ in range(10):  # the heap grows to its working size
  f(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
  f(x).block_until_ready()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20
print(json.dumps(dict(applied=applied, faults=faults,
                      again=allocator.keep_host_memory())))
"""
_PAGES = 64 * 2**20 // os.sysconf("SC_PAGE_SIZE")


def _probe(mode):
  env = dict(os.environ, KVJAX_HOST_MEMORY=mode)
  out = subprocess.run([sys.executable, "-c", _PROBE], env=env, check=True,
                       capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(allocator._glibc() is None, reason="glibc only")  # pylint: disable=protected-access
def test_kept_memory_stops_the_page_faults():
  kept, system = _probe("keep"), _probe("system")
  assert kept["applied"] and kept["again"]
  assert not system["applied"] and not system["again"]
  # glibc's defaults fault in at least the output's pages on every call.
  assert system["faults"] >= _PAGES, system
  # Kept, the freed block is reused; the heap still grows now and then while
  # other allocations fragment it (0 to ~4,200 faults a call measured).
  assert kept["faults"] < 0.5 * _PAGES, kept


def test_after_the_backend_starts_nothing_changes(monkeypatch):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  jnp.ones(2).block_until_ready()  # the backend runs
  monkeypatch.setattr(allocator, "_applied", [])
  monkeypatch.setenv(allocator.ENV, "keep")
  assert allocator.keep_host_memory() is False
  assert allocator._applied == []  # pylint: disable=protected-access


def test_bad_mode_is_named(monkeypatch):
  monkeypatch.setattr(allocator, "_applied", [])
  monkeypatch.setenv(allocator.ENV, "pool")
  with pytest.raises(ValueError, match="KVJAX_HOST_MEMORY.*'pool'"):
    allocator.keep_host_memory()
