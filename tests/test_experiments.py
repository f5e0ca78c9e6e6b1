"""Every experiments/ script imports and parses its flags.

The scripts are thin absl mains over the library; a renamed library symbol
or a missing import would otherwise surface only when someone runs a
benchmark. Each script runs `--helpshort` in its own process (absl exits
with status 1 after printing help; a failed import prints a traceback).
"""

import glob
import os
import subprocess
import sys

from absl.testing import absltest

ROOT = os.path.join(os.path.dirname(__file__), "..")
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "experiments", "*.py")))


class ExperimentsImportTest(absltest.TestCase):

  def test_every_script_imports_and_lists_its_flags(self):
    self.assertGreaterEqual(len(SCRIPTS), 8)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = {path: subprocess.Popen(
        [sys.executable, path, "--helpshort"], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for path in SCRIPTS}
    for path, proc in procs.items():
      out, err = proc.communicate(timeout=300)
      name = os.path.basename(path)
      self.assertNotIn("Traceback", out + err, f"{name}:\n{err[-3000:]}")
      self.assertIn(name, out + err, f"{name} printed no flag help")
      self.assertIn("--", out + err, name)


if __name__ == "__main__":
  absltest.main()
