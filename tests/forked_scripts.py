"""Runs experiments/ scripts as `__main__`, each in a process forked from one
that has already imported the heavy modules.

Usage: python tests/forked_scripts.py  <  [[path, [arg, ...]], ...] (JSON)
prints [{"returncode", "stdout", "stderr"}, ...] (JSON), one per run.

A script's own interpreter spends ~1.5 s importing jax, flax and matplotlib
before it parses a flag; forty such runs were a fifth of the fast tier.
Here the import is paid once and each script runs in a fork of that
process: its own absl flag registry, exit status and output streams, as
from the command line. The parent never initialises a jax backend, so no
XLA thread exists when it forks.
"""

import json
import os
import runpy
import sys
import tempfile
import traceback

# What every script imports; the fork inherits them already loaded.
import jax  # pylint: disable=unused-import
import flax.linen  # pylint: disable=unused-import
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot  # pylint: disable=unused-import
import kvjax  # pylint: disable=unused-import
import kvjax.cli  # pylint: disable=unused-import


def _run_one(path: str, args: list[str]) -> dict:
  with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: the script, as `python path args...` runs it
      os.dup2(out.fileno(), 1)
      os.dup2(err.fileno(), 2)
      sys.argv = [path, *args]
      sys.path[0] = os.path.dirname(os.path.abspath(path))
      code = 0
      try:
        runpy.run_path(path, run_name="__main__")
      except SystemExit as e:  # as the interpreter exits on it
        if e.code is None or isinstance(e.code, int):
          code = e.code or 0
        else:
          print(e.code, file=sys.stderr)
          code = 1
      except BaseException:  # pylint: disable=broad-except
        traceback.print_exc()
        code = 1
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)  # pylint: disable=protected-access
    _, status = os.waitpid(pid, 0)
    out.seek(0)
    err.seek(0)
    return {"returncode": os.waitstatus_to_exitcode(status),
            "stdout": out.read(), "stderr": err.read()}


def main():
  runs = json.load(sys.stdin)
  json.dump([_run_one(path, args) for path, args in runs], sys.stdout)


if __name__ == "__main__":
  main()
