"""Named test cases and the fast / slow split, for absltest-style tests.

`product(variant=VARIANTS, kv_dtype=("float32", "int8"))` is
`parameterized.product` whose cases are named from their values
(`test_x_gqa-int8`), never by position (`test_x3`); `slow=` marks the cases
outside the fast tier (`pytest -m "not slow"`), e.g.
`slow=lambda variant, kv_dtype: variant not in FAST_VARIANTS`.

Markers: absl expands one test method into one method per case, copying the
method's attributes to each, so a per-case marker cannot ride on the method.
`product` records the names of its slow cases on the method instead, and
`tests/conftest.py` (`pytest_collection_modifyitems`) marks those items
`slow`. A whole method or class takes `@pytest.mark.slow` as usual.
"""

import itertools

from absl.testing import parameterized
import numpy as np

from configs import model as model_presets

# The fast tier's attention variants: one KVCache (GQA, which covers MHA and
# MQA as K = N and K = 1 of the same code) and one LatentCache (MLA).
FAST_VARIANTS = ("gqa", "mla")
SLOW_CASES_ATTR = "_kvjax_slow_cases"


def value_name(key, value) -> str:
  """A case's name for one parameter value: strings as they are, numbers
  with their parameter's name (`chunk3`), shapes joined by `x` (`2x4`),
  objects by their `name` or `variant`."""
  if isinstance(value, (bool, np.bool_)):
    return key if value else f"no_{key}"
  if isinstance(value, str):
    return value
  if isinstance(value, tuple):  # a shape: (2, 4) -> 2x4
    return "x".join(str(v) if isinstance(v, int) else value_name(key, v)
                    for v in value)
  if isinstance(value, (int, float, np.integer, np.floating)):
    text = f"{key}{value}"
    return text.replace("-", "minus").replace(".", "p")
  name = getattr(value, "name", None) or getattr(value, "variant", None)
  if isinstance(name, str):
    return name
  raise TypeError(f"no case name for {key}={value!r}: name the cases with "
                  "`named` instead")


def case_name(case: dict) -> str:
  return "-".join(value_name(k, v) for k, v in case.items())


def named(cases, slow=None):
  """`parameterized.named_parameters` over dicts of keyword arguments, each
  named by `case_name` (or a 'testcase_name' it carries). `slow(**case)`:
  the case belongs to the slow tier."""
  cases = [dict(c) for c in cases]
  named_cases = []
  for c in cases:
    name = c.pop("testcase_name", None) or case_name(c)
    named_cases.append(dict(c, testcase_name=name))
  names = [c["testcase_name"] for c in named_cases]
  if len(set(names)) != len(names):
    raise ValueError(f"duplicate case names: {sorted(names)}")

  def decorate(fn):
    if slow is not None:
      setattr(fn, SLOW_CASES_ATTR, frozenset(
          f"{fn.__name__}_{c['testcase_name']}" for c in named_cases
          if slow(**{k: v for k, v in c.items() if k != "testcase_name"})))
    return parameterized.named_parameters(*named_cases)(fn)

  return decorate


def product(slow=None, **axes):
  """`parameterized.product` with named cases (see `named`)."""
  keys = list(axes)
  return named([dict(zip(keys, values))
                for values in itertools.product(*axes.values())], slow=slow)


def variants(variants=model_presets.VARIANTS, fast=FAST_VARIANTS):
  """One case per attention variant; those outside `fast` are slow."""
  return product(variant=variants, slow=lambda variant: variant not in fast)


def without_native_kernel(test) -> None:
  """For the rest of `test` (a TestCase, from its setUp), the native decode
  kernel counts as not built: `decode.plan` picks among the XLA views, as
  on a host without a C++ compiler."""
  from unittest import mock  # pylint: disable=g-import-not-at-top
  from kvjax import native_attention  # pylint: disable=g-import-not-at-top
  patch = mock.patch.object(native_attention, "available", lambda: False)
  patch.start()
  test.addCleanup(patch.stop)
