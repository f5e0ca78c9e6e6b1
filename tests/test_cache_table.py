"""Published configurations and the KV-cache table (`kvjax.lab.published`,
`experiments/cache_table.py`). Shapes only: nothing here allocates a cache or
a parameter.

Invariants: each published config's parameter count is its checkpoint's
published size (which checks the transcribed hyperparameters); bytes per
token from the formula equal the `eval_shape`d cache and scale linearly with
batch and length; DeepSeek-V2's "GQA with 2.25 groups" and "−93.3% vs 67B"
follow from the configs; the experiment writes its table, JSON and PNG.
"""

import json
import os
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import kvjax
from kvjax import configs as cfg_lib
from kvjax.lab import published
from configs import model as model_presets

REPO = os.path.join(os.path.dirname(__file__), "..")
PRESETS = {p: cfg_lib.model_config(model_presets.get_config(p).model)
           for p in model_presets.PRESETS}

# Sizes as their publishers state them: exact safetensors totals on the
# Hugging Face model pages for the dense models; the papers' rounded totals
# for DeepSeek (V3's 671B excludes its multi-token-prediction module).
PUBLISHED_PARAMS = {
    "Llama-3-8B": (8_030_261_248, 0.0),
    "Llama-3-70B": (70_553_706_496, 0.0),
    "Mistral-7B-v0.1": (7_241_732_096, 0.0),
    "DeepSeek-67B": (67e9, 0.01),
    "DeepSeek-V2-Lite": (15.7e9, 0.005),
    "DeepSeek-V2": (236e9, 0.005),
    "DeepSeek-V3": (671e9, 0.005),
}


class PublishedConfigTest(parameterized.TestCase):

  def test_every_published_model_has_a_size_to_check(self):
    self.assertEqual(set(PUBLISHED_PARAMS), set(published.PUBLISHED))

  @parameterized.named_parameters((n, n) for n in published.PUBLISHED)
  def test_param_count_is_the_published_size(self, name):
    want, rel = PUBLISHED_PARAMS[name]
    got = kvjax.param_count(published.get(name))  # eval_shape: no memory
    if rel:
      self.assertAlmostEqual(got / want, 1.0, delta=rel, msg=f"{got:,}")
    else:
      self.assertEqual(got, want)

  @parameterized.named_parameters((n, n) for n in published.PUBLISHED)
  def test_bytes_per_token_match_the_eval_shaped_cache(self, name):
    c = published.get(name)
    per_token = kvjax.kv_bytes_per_token(c, "bfloat16")
    self.assertEqual(per_token, c.num_layers *
                     c.kv_elements_per_token_per_layer * 2)
    self.assertEqual(published.cache_nbytes(c, 1, 1), per_token)
    # The largest cell of the table, from shapes alone.
    self.assertEqual(published.cache_nbytes(c, 32, 131072),
                     per_token * 32 * 131072)
    shapes = published.cache_shapes(c, 32, 131072)
    if c.attention == "mla":
      self.assertEqual(shapes.c_kv.shape,
                       (c.num_layers, 32, 131072, c.kv_lora_rank))
      self.assertEqual(shapes.k_rope.shape,
                       (c.num_layers, 32, 131072, c.qk_rope_head_dim))
    else:
      self.assertEqual(shapes.k.shape, (c.num_layers, 32, c.num_kv_heads,
                                        131072, c.head_dim))

  def test_llama3_8b_caches_128_kib_per_token(self):
    # The widely quoted figure: 32 layers × 8 kv heads × 128 × (K, V) × bf16.
    self.assertEqual(kvjax.kv_bytes_per_token(published.LLAMA3_8B,
                                              "bfloat16"), 128 * 1024)

  def test_deepseek_v2_claims(self):
    claims = published.deepseek_v2_claims()
    # Table 1: d_c + d_h^R = 4·d_h + d_h/2 = 2.25 · (2·d_h).
    self.assertEqual(claims["equivalent_kv_heads"], 2.25)
    for name in ("DeepSeek-V2-Lite", "DeepSeek-V3"):
      self.assertEqual(
          published.equivalent_kv_heads(published.get(name)), 2.25)
    self.assertEqual(claims["v2_elements_per_token"], 60 * (512 + 64))
    self.assertEqual(claims["dense_elements_per_token"], 95 * 2 * 8 * 128)
    # The paper's −93.3%: V2's deployed ~6-bit cache vs 67B's 16-bit GQA.
    self.assertEqual(round(100 * claims["reduction_deployed"], 1), 93.3)
    self.assertLess(claims["reduction_same_precision"],
                    claims["reduction_deployed"])
    self.assertGreater(claims["reduction_vs_mha_67b"],
                       claims["reduction_same_precision"])

  def test_unknown_name_raises(self):
    with self.assertRaisesRegex(ValueError, "Llama-2-7B"):
      published.get("Llama-2-7B")


class CacheTableTest(parameterized.TestCase):

  @parameterized.named_parameters((p, p) for p in model_presets.PRESETS)
  def test_preset_rows(self, preset):
    c = PRESETS[preset]
    row = published.table_row(preset, c, tokens=(64, 128), batches=(1, 3),
                              kv_dtype="float32")
    self.assertEqual(row["bytes_per_token"],
                     row["bytes_per_token_eval_shape"])
    self.assertEqual(row["cache_bytes"]["128x3"],
                     row["bytes_per_token"] * 128 * 3)
    twin = published.mha_twin(c)
    self.assertEqual(twin.variant, "mha")
    self.assertEqual((twin.num_layers, twin.num_heads, twin.head_dim),
                     (c.num_layers, c.num_heads,
                      published.reference_head_dim(c)))
    # The MHA ratio from two eval_shaped caches equals the config arithmetic.
    expected_heads = {"mha": c.num_heads, "gqa": c.num_kv_heads, "mqa": 1,
                      "mla": 2.25}[c.variant]
    self.assertEqual(row["equivalent_kv_heads"], expected_heads)
    self.assertAlmostEqual(row["vs_mha"], expected_heads / c.num_heads)

  def test_markdown_and_bytes_format(self):
    self.assertEqual(published.format_bytes(512), "512 B")
    self.assertEqual(published.format_bytes(1536), "1.5 KiB")
    self.assertEqual(published.format_bytes(1.5 * 2**40), "1.5 TiB")
    rows = published.table(dict(published.PUBLISHED), tokens=(4096,),
                           batches=(1,))
    lines = published.markdown_table(rows).splitlines()
    self.assertLen(lines, len(rows) + 2)
    for line, r in zip(lines[2:], rows):
      self.assertTrue(line.startswith(f"| {r['name']} | {r['variant']} |"))
    notes = published.table_notes(rows)
    self.assertTrue(any(n.startswith("Mistral-7B-v0.1: its 4096-token")
                        for n in notes))

  @pytest.mark.slow  # a subprocess experiment
  def test_experiment_writes_table_json_and_png(self):
    workdir = self.create_tempdir().full_path
    subprocess.run(
        [sys.executable, "experiments/cache_table.py", f"--workdir={workdir}",
         "--tokens=16,32", "--batches=1,2", "--kv_dtype=float32"],
        cwd=REPO, check=True, capture_output=True, timeout=300)
    with open(os.path.join(workdir, "cache_table.json")) as f:
      out = json.load(f)
    names = [r["name"] for r in out["rows"]]
    self.assertEqual(names, list(PRESETS) + list(published.PUBLISHED))
    self.assertEqual(set(out["rows"][0]["cache_bytes"]),
                     {"16x1", "32x1", "16x2", "32x2"})
    with open(os.path.join(workdir, "cache_table.md")) as f:
      md = f.read()
    for n in names:
      self.assertIn(f"| {n} |", md)
    self.assertIn("−93.3%", md)
    with open(os.path.join(workdir, "cache_table.png"), "rb") as f:
      self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


if __name__ == "__main__":
  absltest.main()
