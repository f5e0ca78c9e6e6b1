"""Checks for the numbers, flags and choices that library objects are built
from (`ModelConfig`, `Sampler`, config.json fields).

Each check returns the value as a plain Python `int` / `float` / `bool` /
`str`, or raises `ValueError` naming the field, the rule and the bad value
with its type, e.g.
`ModelConfig.vocab_size must be an int >= 1, got 256.5 (float)`.

Why one module: the same rule ("an int >= 1", "a finite float > 0") is
stated once and words its errors the same way wherever a value enters.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np


def _got(x: Any) -> str:
  return f"got {x!r} ({type(x).__name__})"


def _bounds(minimum, maximum, strict: bool = False) -> str:
  if minimum is not None and maximum is not None:
    return f" in {'(' if strict else '['}{minimum}, {maximum}]"
  if minimum is not None:
    return f" {'>' if strict else '>='} {minimum}"
  if maximum is not None:
    return f" <= {maximum}"
  return ""


def check_int(name: str, x: Any, minimum: int | None = None,
              maximum: int | None = None) -> int:
  """`x` as an int in [minimum, maximum] (None = unbounded).

  Args:
    name: how the error names the field, e.g. 'ModelConfig.vocab_size'.
    x: the value. Python and numpy integers are accepted. bool is refused
      (True is an int to Python, but a flag given for a count is a mistake),
      and so is every float, integral or not: truncating 32.9 would silently
      build another model, and a 32.0 is a value to fix where it was made.
    minimum, maximum: inclusive bounds.
  Returns:
    int(x).
  Raises:
    ValueError naming `name`, the bounds and the bad value with its type.
  """
  ok = (isinstance(x, (int, np.integer)) and
        not isinstance(x, (bool, np.bool_)))
  if ok:
    x = int(x)
    ok = ((minimum is None or x >= minimum) and
          (maximum is None or x <= maximum))
  if not ok:
    raise ValueError(f"{name} must be an int{_bounds(minimum, maximum)}, "
                     f"{_got(x)}")
  return x


def check_float(name: str, x: Any, minimum: float | None = None,
                strict: bool = False, maximum: float | None = None) -> float:
  """`x` as a finite float >= minimum (> minimum when `strict`), <= maximum.

  Args:
    name: how the error names the field, e.g. 'Sampler.temperature'.
    x: the value: a Python or numpy int or float (ints are exact numbers,
      e.g. `rope_theta: 10000` in JSON). bool is refused. NaN and +-inf are
      refused: every comparison with NaN is False, so a plain `x < 0` check
      lets it through.
    minimum: lower bound (None = unbounded below).
    strict: whether the lower bound itself is refused.
    maximum: inclusive upper bound (None = unbounded above).
  Returns:
    float(x).
  Raises:
    ValueError naming `name`, the bounds and the bad value with its type.
  """
  ok = (isinstance(x, (int, float, np.integer, np.floating)) and
        not isinstance(x, (bool, np.bool_)))
  if ok:
    v = float(x)
    ok = (math.isfinite(v) and
          (minimum is None or (v > minimum if strict else v >= minimum)) and
          (maximum is None or v <= maximum))
  if not ok:
    raise ValueError(f"{name} must be a finite float"
                     f"{_bounds(minimum, maximum, strict)}, {_got(x)}")
  return v


def check_bool(name: str, x: Any) -> bool:
  """`x` as a bool; only Python and numpy bools are accepted (not 0/1, not
  the string 'false', which Python would read as True)."""
  if not isinstance(x, (bool, np.bool_)):
    raise ValueError(f"{name} must be a bool, {_got(x)}")
  return bool(x)


def check_choice(name: str, x: Any, choices: Sequence[str]) -> str:
  """`x` if it is one of the strings `choices`, else ValueError listing
  them."""
  if not isinstance(x, str) or x not in choices:
    raise ValueError(f"{name} must be one of {tuple(choices)}, {_got(x)}")
  return x
