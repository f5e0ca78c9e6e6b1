"""The experiments' command line: what every `experiments/*.py` main shares.

`run(main)` stands in for `absl.app.run`, and the `DEFINE_*` helpers for the
absl / ml_collections ones where a check belongs to the flag itself:

  * A mistake the user can fix is one line, `error: <message>` on stderr,
    exit status 2, found before anything loads or compiles. An unknown
    `--config.<path>` names the valid fields at that level.
  * `--show_config` prints every config field as the flag that sets it
    (`--config.model.num_layers=6`), the preset syntax, and the script's
    other flags, then exits. The config flags' `--help` text says the same.
  * Logs are quiet: INFO records from outside kvjax and the script (orbax's
    checkpoint chatter, jax's backend probing) and the C++ INFO logs of XLA
    and libtpu are off; warnings always show. absl's `--verbosity` (or `-v`),
    given explicitly, brings everything back.
  * `JsonLines` writes results as they are measured, so a stopped run keeps
    what it measured; Ctrl-C ends with one line naming those files (exit
    status 130) instead of a traceback.

Which errors are one line (the criterion). Everything else keeps its
traceback: it is a bug, or a failure in the middle of a run that the
traceback helps to place.
  1. Anything raised while the command line is parsed: absl flag errors
     (types, `lower_bound`, the list flags below), config files and presets,
     `--config.*` overrides.
  2. `UsageError`, and the `ValueError` / `KeyError` raised inside a
     `checking()` block. Each script builds its library objects
     (ModelConfig, CachePolicy, Sampler, TrainConfig, stream policies) from
     its flags and config inside one, before it loads a model or compiles
     anything; the library's validation then speaks to the user directly.
  3. `kvjax.data.CorpusNotFoundError`, wherever it is raised: its message is
     the command that installs the corpus.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import json
import logging as py_logging
import os
import re
import sys
from typing import Any, Callable, Iterator, Mapping, Sequence

from absl import app
from absl import flags
from absl import logging
import ml_collections
from ml_collections import config_flags
import numpy as np

from kvjax import data

# Flags defined through this module belong to the script that called it, so
# they appear in its --help (absl's mechanism for flag-defining wrappers).
flags.disclaim_key_flags()

FLAGS = flags.FLAGS
EXIT_USAGE = 2

# C++ log thresholds set (when unset) for a quiet run: 1 = warnings and up.
QUIET_ENV = {"TF_CPP_MIN_LOG_LEVEL": "1", "TPU_STDERR_LOG_LEVEL": "1"}


class UsageError(Exception):
  """A mistake in a flag or config value; `run` prints it as one line."""


def one_line(error: BaseException | str) -> str:
  """The message of `error` on one line (a KeyError without its quotes)."""
  if isinstance(error, KeyError) and error.args:
    text = str(error.args[0])
  else:
    text = str(error)
  return " ".join(text.split()) or type(error).__name__


def fail(message: str) -> None:
  """Prints `error: <message>` (one line) on stderr and exits with status 2."""
  sys.stdout.flush()
  sys.stderr.write(f"error: {one_line(message)}\n")
  sys.stderr.flush()
  sys.exit(EXIT_USAGE)


@contextlib.contextmanager
def checking(where: str = "") -> Iterator[None]:
  """Marks the block where a script turns flags and config into library
  objects: a `ValueError` or `KeyError` raised inside is the user's to fix
  and becomes a `UsageError` (one line, prefixed with `where`, e.g.
  '--config.model'). Use it only before any model is loaded or compiled."""
  try:
    yield
  except data.CorpusNotFoundError:
    raise
  except (ValueError, KeyError) as e:
    message = one_line(e)
    raise UsageError(f"{where}: {message}" if where else message) from e


# ---- config flags -------------------------------------------------------------
# name -> dict(default=spec string, presets=..., example=...).
_CONFIG_FLAGS: dict[str, dict[str, Any]] = {}
# Errors found while flags were being defined (an unknown override of a
# default config is parsed then); reported as the parse starts.
_DEFERRED: list[str] = []


def _config_spec(argv: Sequence[str], name: str) -> str | None:
  """The value given to --name on the command line (the last one), or None."""
  spec = None
  for i, arg in enumerate(argv[1:], 1):
    m = re.match(rf"^--?{re.escape(name)}(=(.*))?$", arg)
    if m:
      if m.group(1) is not None:
        spec = m.group(2)
      elif i + 1 < len(argv):
        spec = argv[i + 1]
  return spec


def _short_path(path: str) -> str:
  """`path` relative to the working directory when it lies below it."""
  rel = os.path.relpath(os.path.abspath(path))
  return path if rel.startswith("..") else rel


def load_config(name: str, spec: str) -> ml_collections.ConfigDict:
  """What `--name=spec` loads: `get_config(arg)` of `file[:arg]`.

  Raises:
    UsageError: no such file, or get_config refused the argument (an
      unknown preset).
  """
  path, colon, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise UsageError(f"--{name}={spec}: no config file {path!r}")
  module_spec = importlib.util.spec_from_file_location(
      f"_kvjax_cli_{name}_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  try:
    return module.get_config(*([arg] if colon else []))
  except (ValueError, KeyError) as e:
    raise UsageError(f"--{name}={_short_path(path)}{colon}{arg}: "
                     f"{one_line(e)}") from e


def check_overrides(name: str, config: ml_collections.ConfigDict,
                    argv: Sequence[str]) -> None:
  """Every `--name.<path>` in argv must name a field of `config`.

  Raises:
    UsageError naming the valid fields at the first level that does not
    match (and the closest one, when there is a close one).
  """
  pattern = re.compile(rf"^--?(?:no)?{re.escape(name)}\.([^=]+)")
  for arg in argv[1:]:
    m = pattern.match(arg)
    if not m:
      continue
    path = m.group(1)
    node, walked = config, name
    for key in path.split("."):
      if not isinstance(node, ml_collections.ConfigDict):
        raise UsageError(f"--{name}.{path}: {walked} is a value "
                         f"({node!r}), not a section with fields")
      if key not in node:
        valid = sorted(node.keys())
        close = difflib.get_close_matches(key, valid, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(f"unknown config field --{name}.{path}{hint}; "
                         f"{walked} has: {', '.join(valid)}")
      node, walked = node[key], f"{walked}.{key}"


def _example_preset(spec: str, presets: Sequence[str]) -> str:
  return spec.partition(":")[2] or (presets[0] if presets else "<preset>")


def DEFINE_config_file(name: str, default: str, help_string: str, *,  # pylint: disable=invalid-name
                       presets: Sequence[str] = (),
                       example: str = "model.num_layers=2"
                       ) -> flags.FlagHolder:
  """`config_flags.DEFINE_config_file(lock_config=True)` whose help states
  the preset and override syntax, and whose mistakes are one line.

  Args:
    name: the flag, e.g. 'config'.
    default: 'path/to/file.py[:preset]'.
    help_string: what the config is for.
    presets: the names `get_config` accepts (listed in the help).
    example: one override, '<path>=<value>', shown in the help.
  """
  path, colon, preset = default.partition(":")
  default = os.path.normpath(path) + colon + preset
  file = _short_path(default.partition(":")[0])
  choices = f" (one of {', '.join(presets)})" if presets else ""
  help_string = (
      f"{help_string} Pick a preset with --{name}={file}:<preset>{choices}; "
      f"override any field with --{name}.<section>.<field>=<value>, e.g. "
      f"--{name}={file}:{_example_preset(default, presets)} "
      f"--{name}.{example}. --show_config prints every field.")
  _CONFIG_FLAGS[name] = dict(default=default, presets=tuple(presets),
                             example=example)
  kwargs = {}
  if _config_spec(sys.argv, name) is None:
    # ml_collections parses the default, and the overrides with it, right
    # now: an unknown field would raise here, at import, as 3 tracebacks.
    try:
      check_overrides(name, load_config(name, default), sys.argv)
    except UsageError as e:
      _DEFERRED.append(str(e))
      kwargs["sys_argv"] = sys.argv[:1]
  try:
    return config_flags.DEFINE_config_file(name, default, help_string,
                                           lock_config=True, **kwargs)
  except (KeyError, AttributeError, ValueError, TypeError, flags.Error) as e:
    _DEFERRED.append(f"--{name}: {one_line(e)}")
    return config_flags.DEFINE_config_file(name, default, help_string,
                                           lock_config=True,
                                           sys_argv=sys.argv[:1])


def config_given(name: str = "config") -> bool:
  """Whether --name (a file or preset) was given on the command line."""
  return FLAGS[name].present > 0


def overrides_given(prefix: str) -> list[str]:
  """The override flags given on the command line under `prefix`, e.g.
  'config.model' -> ['config.model.num_layers']."""
  return sorted(n for n in FLAGS if n.startswith(prefix + ".") and
                FLAGS[n].present)


# ---- list flags ---------------------------------------------------------------
class _ListParser(flags.ListParser):
  """Comma-separated values, each converted and checked by `item`."""

  def __init__(self, item: Callable[[Any], Any], kind: str,
               allow_empty: bool, unique: bool = False):
    super().__init__()
    self._item = item
    self._kind = kind
    self._allow_empty = allow_empty
    self._unique = unique
    self.syntactic_help = f"a comma-separated list of {kind}"

  def parse(self, argument):
    values = [self._item(v) for v in super().parse(argument)]
    if not values and not self._allow_empty:
      raise ValueError("needs at least one value")
    twice = sorted({v for v in values if values.count(v) > 1})
    if self._unique and twice:
      raise ValueError(f"names {', '.join(map(str, twice))} more than once")
    return values

  def flag_type(self):
    return f"comma-separated list of {self._kind}"


def _int_item(lower_bound: int | None):
  def item(value):
    try:
      v = value if isinstance(value, int) else int(str(value).strip())
    except ValueError:
      raise ValueError(f"{value!r} is not an integer") from None
    if lower_bound is not None and v < lower_bound:
      raise ValueError(f"{v} is below the minimum {lower_bound}")
    return v
  return item


def _choice_item(choices: Sequence[str]):
  def item(value):
    value = str(value).strip()
    if value not in choices:
      raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
    return value
  return item


def DEFINE_int_list(name: str, default: Sequence[int], help_string: str, *,  # pylint: disable=invalid-name
                    lower_bound: int | None = None,
                    allow_empty: bool = False,
                    flag_values: flags.FlagValues = FLAGS
                    ) -> flags.FlagHolder:
  """A comma-separated list of ints (`.value` is list[int]), each checked
  against `lower_bound` as the flag is parsed."""
  return flags.DEFINE(
      _ListParser(_int_item(lower_bound), "ints" + (
          f" >= {lower_bound}" if lower_bound is not None else ""),
                  allow_empty),
      name, list(default), help_string, flag_values=flag_values,
      serializer=flags.CsvListSerializer(","))


def DEFINE_choice_list(name: str, default: Sequence[str],  # pylint: disable=invalid-name
                       choices: Sequence[str], help_string: str, *,
                       allow_empty: bool = False, unique: bool = True,
                       flag_values: flags.FlagValues = FLAGS
                       ) -> flags.FlagHolder:
  """A comma-separated list of names from `choices` (`.value` is
  list[str]), checked as the flag is parsed; a name given twice is refused
  when `unique`."""
  choices = tuple(choices)
  return flags.DEFINE(
      _ListParser(_choice_item(choices), f"names of {', '.join(choices)}",
                  allow_empty, unique),
      name, list(default), help_string, flag_values=flag_values,
      serializer=flags.CsvListSerializer(","))


# ---- --show_config ------------------------------------------------------------
def _leaves(config: ml_collections.ConfigDict, prefix: str = ""
            ) -> Iterator[tuple[str, Any]]:
  for key, value in config.items():
    path = f"{prefix}{key}"
    if isinstance(value, ml_collections.ConfigDict):
      yield from _leaves(value, path + ".")
    else:
      yield path, value


def show_config() -> str:
  """Every config field as the flag that sets it, the preset and override
  syntax, then the script's other flags (`--show_config`)."""
  lines = []
  argv = sys.argv
  for name, info in _CONFIG_FLAGS.items():
    spec = _config_spec(argv, name) or info["default"]
    path, colon, arg = spec.partition(":")
    file = _short_path(path)
    presets = info["presets"]
    lines.append(f"# --{name}={file}{colon}{arg}")
    lines.append(f"# a preset: --{name}={file}:<preset>" +
                 (f" (one of {', '.join(presets)})" if presets else ""))
    lines.append(f"# a field: --{name}={file}:"
                 f"{_example_preset(spec, presets)} "
                 f"--{name}.{info['example']}")
    for field, value in _leaves(FLAGS[name].value):
      lines.append(f"--{name}.{field}={value}")
  own = [f for f in FLAGS.get_key_flags_for_module(argv[0])
         if f.name not in _CONFIG_FLAGS and "." not in f.name and
         f.name != "show_config"]
  if own:
    lines.append(f"# flags of {os.path.basename(argv[0])}")
    for f in sorted(own, key=lambda f: f.name):
      lines.append(f.serialize() or f"--{f.name}=")
  return "\n".join(lines)


# ---- logs ---------------------------------------------------------------------
class _OwnInfo(py_logging.Filter):
  """Keeps warnings and errors from everywhere, and INFO and below only from
  files under `roots` (kvjax and the running script's directory)."""

  def __init__(self, roots: Sequence[str]):
    super().__init__()
    self._roots = tuple(os.path.join(os.path.realpath(r), "") for r in roots)

  @functools.lru_cache(maxsize=512)
  def _own(self, pathname: str) -> bool:
    return os.path.realpath(pathname).startswith(self._roots)

  def filter(self, record: py_logging.LogRecord) -> bool:
    return record.levelno >= py_logging.WARNING or self._own(record.pathname)


def quiet_logs(script: str | None = None) -> py_logging.Filter:
  """Turns other libraries' INFO logs off (see the module docstring).

  Sets QUIET_ENV's C++ thresholds where they are unset (before the JAX
  backend starts) and filters absl's handler. Returns the filter.
  """
  for var, value in QUIET_ENV.items():
    os.environ.setdefault(var, value)
  roots = [os.path.dirname(os.path.abspath(__file__))]
  if script:
    roots.append(os.path.dirname(os.path.abspath(script)))
  keep = _OwnInfo(roots)
  logging.get_absl_handler().addFilter(keep)
  return keep


# ---- results as they are measured ---------------------------------------------
def _jsonable(x):
  if isinstance(x, (np.generic, np.ndarray)):
    return x.tolist()
  if hasattr(x, "tolist"):  # jax arrays
    return x.tolist()
  return str(x)


class JsonLines:
  """Results written as they are measured: one JSON object per line,
  flushed at once, so an interrupted run keeps every finished measurement.

  Opening truncates the file: one file holds one run.
  """

  opened: list[str] = []  # every path opened in this process (run reports)

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    self._file = open(self.path, "w", encoding="utf-8")  # pylint: disable=consider-using-with
    JsonLines.opened.append(self.path)

  def write(self, record: Mapping[str, Any]) -> None:
    self._file.write(json.dumps(dict(record), default=_jsonable) + "\n")
    self._file.flush()

  def close(self) -> None:
    self._file.close()

  def __enter__(self) -> "JsonLines":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def read_json_lines(path: str | os.PathLike) -> list[dict[str, Any]]:
  """The records of a `JsonLines` file (a torn last line is skipped)."""
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        break
  return out


# ---- run ----------------------------------------------------------------------
def _parse_flags(argv: list[str]) -> list[str]:
  try:
    if _DEFERRED:
      raise UsageError(_DEFERRED[0])
    for name in _CONFIG_FLAGS:
      spec = _config_spec(argv, name)
      if spec is not None:
        check_overrides(name, load_config(name, spec), argv)
    rest = FLAGS(argv)
  except UsageError as e:
    fail(str(e))
  except flags.Error as e:
    required = re.search(r"Flag --(\S+) must have a value other than None",
                         str(e))
    fail(f"--{required.group(1)} is required (see --help)" if required
         else one_line(e))
  except (KeyError, AttributeError, ValueError, TypeError) as e:
    # Raised by ml_collections while it applies a --config.* override.
    fail(one_line(e))
  if len(rest) > 1:
    fail(f"unexpected arguments {' '.join(rest[1:])!r}: flags are written "
         "--name=value (see --help)")
  return rest


def run(main: Callable[[list[str]], Any]) -> None:
  """`absl.app.run(main)` with this module's command line (see the module
  docstring): one-line errors, --show_config, quiet logs."""
  if "show_config" not in FLAGS:
    flags.DEFINE_bool(
        "show_config", False,
        "Print the resolved config (every field as the --config.<path>="
        "<value> flag that sets it, with the preset syntax) and this "
        "script's flags, then exit.")

  def wrapped(argv):
    if FLAGS.show_config:
      print(show_config())
      return 0
    if not FLAGS["verbosity"].present:
      quiet_logs(argv[0])
    try:
      return main(argv)
    except (UsageError, app.UsageError, data.CorpusNotFoundError) as e:
      fail(one_line(e))
    except KeyboardInterrupt:
      kept = ", ".join(JsonLines.opened)
      sys.stderr.write("interrupted" + (f"; measured so far: {kept}" if kept
                                        else "") + "\n")
      sys.stdout.flush()
      sys.stderr.flush()
      # Straight out, without the interpreter's teardown: XLA's threads
      # may still be running the interrupted step, and tearing the runtime
      # down beneath them has ended such a run in a segmentation fault
      # (status -11, seen under load) after this line. Every JsonLines
      # record is already flushed.
      os._exit(130)  # pylint: disable=protected-access

  app.run(wrapped, flags_parser=_parse_flags)
