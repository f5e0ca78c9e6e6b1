"""Tests for kvjax.train and kvjax.orbax_checkpoint: loss, optimiser, steps,
checkpoints, resume.

The generic machinery is tested with a tiny stand-in model defined here (a
token-and-previous-token linear model), so these tests stay fast and do not
depend on the kvjax model.
"""

import dataclasses
import json
import math
import pathlib
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kvjax
from kvjax import configs
from kvjax import data
from kvjax import orbax_checkpoint
from kvjax import train as train_lib
from kvjax.tolerance import assert_close
import cases



def _load_train_configs():
  from configs import train as module  # pylint: disable=g-import-not-at-top
  return module


@dataclasses.dataclass(frozen=True)
class _StandInConfig:
  vocab_size: int = data.VOCAB_SIZE  # V
  dim: int = 8  # D

  def to_dict(self):
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d):
    return cls(**d)


def _stand_in_init(config, key):
  k1, k2, k3 = jax.random.split(key, 3)
  v, d = config.vocab_size, config.dim
  return {
      "embed": 0.1 * jax.random.normal(k1, (v, d)),
      "prev_embed": 0.1 * jax.random.normal(k2, (v, d)),
      "final_norm": {"scale": jnp.ones((d,))},
      "unembed": 0.1 * jax.random.normal(k3, (d, v)),
  }


def _stand_in_logits(params, tokens_BxT):
  # Sees the current and the previous token: a bigram-plus model.
  prev_BxT = jnp.pad(tokens_BxT, ((0, 0), (1, 0)))[:, :-1]
  h_BxTxD = params["embed"][tokens_BxT] + params["prev_embed"][prev_BxT]
  h_BxTxD = h_BxTxD * params["final_norm"]["scale"][None, None, :]
  return h_BxTxD @ params["unembed"]


_TEXT = {
    "a": "It is a truth universally acknowledged, that a single man in "
         "possession of a good fortune, must be in want of a wife. " * 30,
    "b": "Emma Woodhouse, handsome, clever, and rich. " * 40,
}


def _config(**overrides):
  base = dict(seq_len=16, batch_size=4, num_steps=6, lr=3e-2, warmup_steps=2,
              eval_every=3, eval_batches=2, checkpoint_every=2, log_every=1,
              keep_checkpoints=10, seed=0)
  base.update(overrides)
  return train_lib.TrainConfig(**base)


class TrainTestCase(chex.TestCase, parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.enter_context(jax.numpy_rank_promotion("raise"))
    self.stream = data.documents_to_stream(_TEXT)
    self.model_config = _StandInConfig()
    self.tmp = pathlib.Path(self.enter_context(tempfile.TemporaryDirectory()))

  def _state(self, config, model_config=None):
    model_config = model_config or self.model_config
    params = _stand_in_init(model_config, jax.random.key(config.seed))
    return train_lib.create_train_state(params, _stand_in_logits,
                                        train_lib.make_optimizer(config))

  def _val(self, config):
    return data.eval_batches(self.stream, batch_size=config.batch_size,
                             seq_len=config.seq_len,
                             num_batches=config.eval_batches)

  def _fit(self, config, workdir, model_config=None):
    model_config = model_config or self.model_config
    val = self._val(config)
    return train_lib.fit(
        self._state(config, model_config),
        batch_fn=train_lib.austen_batches(self.stream, config),
        evaluate_fn=lambda state: train_lib.evaluate(state, val),
        config=config, workdir=workdir,
        model_config_dict=model_config.to_dict())

  def _restore(self, workdir):
    return orbax_checkpoint.restore_params(
        workdir, config_from_dict=_StandInConfig.from_dict,
        init_fn=_stand_in_init)


class LossTest(TrainTestCase):

  def test_pad_targets_are_ignored(self):
    logits = jax.random.normal(jax.random.key(1), (2, 5, data.VOCAB_SIZE))
    targets = jnp.array([[1, 2, 3, data.PAD, data.PAD], [4, 5, 6, 7, 8]])
    total, count = train_lib.masked_nll(logits, targets)
    self.assertEqual(float(count), 8.0)
    kept = jnp.array([[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, kept)
    expected = jnp.sum(nll[0, :3]) + jnp.sum(nll[1])
    assert_close(float(total), float(expected), depth=1)

  def test_uniform_model_is_eight_bits_and_change(self):
    config = _config()
    state = self._state(config)
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    result = train_lib.evaluate(state.replace(params=zeros), self._val(config))
    assert_close(result["loss"], math.log(data.VOCAB_SIZE), depth=1)
    assert_close(result["bits_per_byte"], math.log2(data.VOCAB_SIZE),
                 depth=1)
    self.assertEqual(result["tokens"], 2 * 4 * 16)

  def test_schedule(self):
    config = _config(num_steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    schedule = train_lib.learning_rate_schedule(config)
    self.assertEqual(float(schedule(0)), 0.0)
    assert_close(float(schedule(5)), 0.5, depth=1)
    assert_close(float(schedule(10)), 1.0, depth=1)
    assert_close(float(schedule(100)), 0.1, depth=1)

  def test_weight_decay_mask(self):
    params = {"embed": jnp.zeros((3, 2)),
              "layers": {"attn_norm": jnp.zeros((4, 2)),  # stacked [L, D]
                         "wq": jnp.zeros((4, 2, 2)), "bias": jnp.zeros((4, 2))},
              "final_norm": {"scale": jnp.zeros((2,))}}
    mask = train_lib.weight_decay_mask(params)
    self.assertEqual(mask, {"embed": True,
                            "layers": {"attn_norm": False, "wq": True,
                                       "bias": False},
                            "final_norm": {"scale": False}})

  def test_config_validation_names_field(self):
    with self.assertRaisesRegex(ValueError, "batch_size"):
      train_lib.TrainConfig(batch_size=0)
    with self.assertRaisesRegex(ValueError, "bogus"):
      train_lib.TrainConfig.from_dict({"bogus": 1})


class TrainStepTest(TrainTestCase):

  def test_loss_decreases(self):
    config = _config(num_steps=40, warmup_steps=4, lr=5e-2)
    state = self._state(config)
    val = self._val(config)
    before = train_lib.evaluate(state, val)["loss"]
    for i in range(config.num_steps):
      batch = data.train_batch(self.stream, batch_size=config.batch_size,
                               seq_len=config.seq_len, seed=0, step=i)
      state, metrics = train_lib.train_step(state, batch)
      chex.assert_tree_all_finite(metrics)
    after = train_lib.evaluate(state, val)["loss"]
    self.assertEqual(int(state.step), config.num_steps)
    self.assertLess(after, 0.6 * before)

  def test_step_is_deterministic(self):
    config = _config()
    batch = data.train_batch(self.stream, batch_size=4, seq_len=16, seed=0,
                             step=0)
    a, ma = train_lib.train_step(self._state(config), batch)
    b, mb = train_lib.train_step(self._state(config), batch)
    chex.assert_trees_all_equal(a.params, b.params)
    chex.assert_trees_all_equal(ma, mb)


class MicrobatchTest(TrainTestCase):
  """`TrainConfig.microbatches`: row groups whose gradients sum to the
  batch's, on the kvjax model (the stand-in has no products to overlap)."""

  def _model(self):
    model_config = configs.model_config(
        _load_train_configs().get_config("gqa").model).replace(
            num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2,
            head_dim_override=16, mlp_dim=96)
    params = jax.jit(kvjax.init_params, static_argnums=0)(model_config,
                                                          jax.random.key(0))
    return params, train_lib.model_logits_fn(model_config)

  def _batch(self):
    batch = np.asarray(data.train_batch(self.stream, batch_size=8,
                                        seq_len=16, seed=0, step=0))
    # PAD targets in one group only: the groups count different targets,
    # so a per-group mean would weight them wrongly.
    batch[1, 9:] = data.PAD
    batch[2, 3:] = data.PAD
    return jnp.asarray(batch)

  def test_groups_sum_to_the_batch_gradient(self):
    params, logits_fn = self._model()
    batch = self._batch()
    want_loss, want_grads = jax.value_and_grad(
        lambda p: train_lib.batch_loss(p, logits_fn, batch)[0])(params)
    one = jax.jit(train_lib.loss_and_grads, static_argnums=(1, 3))
    loss, grads = one(params, logits_fn, batch, 1)
    chex.assert_trees_all_close(loss, want_loss, rtol=1e-6)
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-5, atol=1e-8)
    for groups in (2, 4, 8):
      loss, grads = one(params, logits_fn, batch, groups)
      chex.assert_trees_all_close(loss, want_loss, rtol=1e-5)
      chex.assert_trees_all_close(grads, want_grads, rtol=1e-4, atol=1e-7)

  def test_train_step_with_groups_matches_one_group(self):
    params, logits_fn = self._model()
    batch = self._batch()
    tx = train_lib.make_optimizer(_config())
    states = [train_lib.create_train_state(jax.tree.map(jnp.copy, params),
                                           logits_fn, tx, microbatches=m)
              for m in (1, 4)]
    (a, ma), (b, mb) = [train_lib.train_step(s, batch) for s in states]
    self.assertEqual(b.microbatches, 4)
    chex.assert_trees_all_close(mb, ma, rtol=1e-5)
    chex.assert_trees_all_close(b.params, a.params, rtol=1e-5, atol=1e-6)

  def test_groups_must_divide_the_batch(self):
    with self.assertRaisesRegex(ValueError, "microbatches=3 must divide "
                                "batch_size=4"):
      _config(microbatches=3)
    with self.assertRaisesRegex(ValueError, "microbatches must be >= 1"):
      _config(microbatches=0)
    params, logits_fn = self._model()
    with self.assertRaisesRegex(ValueError, "microbatches=3 must divide"):
      train_lib.loss_and_grads(params, logits_fn, self._batch(), 3)
    with self.assertRaisesRegex(ValueError, "microbatches must be >= 1"):
      train_lib.create_train_state(params, logits_fn,
                                   train_lib.make_optimizer(_config()),
                                   microbatches=0)


class CheckpointTest(TrainTestCase):

  def test_save_restore_identical(self):
    config = _config(num_steps=4)
    state, _ = self._fit(config, self.tmp)
    model_config, params = self._restore(self.tmp)
    self.assertEqual(model_config, self.model_config)
    chex.assert_trees_all_equal(params, state.params)
    # An earlier checkpoint restores too, and differs from the last.
    _, params_2 = self._restore_step(self.tmp, 2)
    self.assertFalse(np.array_equal(params_2["embed"], params["embed"]))

  def _restore_step(self, workdir, step):
    return orbax_checkpoint.restore_params(
        workdir, step, config_from_dict=_StandInConfig.from_dict,
        init_fn=_stand_in_init)

  def test_outputs_written(self):
    config = _config(num_steps=3, eval_every=3)
    _, final = self._fit(config, self.tmp)
    records = [json.loads(l) for l in
               (self.tmp / train_lib.METRICS_FILE).read_text().splitlines()]
    self.assertEqual([r["step"] for r in records if r["split"] == "train"],
                     [1, 2, 3])
    self.assertEqual(records[-1], final)
    self.assertGreater((self.tmp / train_lib.PLOT_FILE).stat().st_size, 1000)

  def test_the_plot_tracks_first_token_mass_when_recorded(self):
    path = self.tmp / train_lib.METRICS_FILE
    rows = [dict(step=s, split="validation", bits_per_byte=3.0 - s / 100,
                 sink_mass=0.001, sink_mass_max=0.002,
                 sink_mass_layers=[0.001, 0.0005]) for s in (10, 20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    labels = train_lib.plot_metrics(path, self.tmp / "p.png", seq_len=64)
    self.assertEqual(labels, ["bits per byte", "attention on the first token "
                              "(queries in the second half)"])
    path.write_text(json.dumps(dict(step=1, split="train",
                                    bits_per_byte=4.0)) + "\n")
    self.assertEqual(train_lib.plot_metrics(path, self.tmp / "q.png"),
                     ["bits per byte"])

  def test_resume_continues_identical_trajectory(self):
    config = _config()
    uninterrupted = self.tmp / "a"
    state_a, final_a = self._fit(config, uninterrupted)

    resumed = self.tmp / "b"
    real_batch = data.train_batch

    def crash_at_step_5(*args, **kwargs):
      if kwargs["step"] == 5:
        raise KeyboardInterrupt("simulated interruption")
      return real_batch(*args, **kwargs)

    with mock.patch.object(train_lib.data, "train_batch",
                           side_effect=crash_at_step_5):
      with self.assertRaises(KeyboardInterrupt):
        self._fit(config, resumed)
    self.assertEqual(
        orbax_checkpoint.checkpoint_manager(resumed).latest_step(), 4)
    state_b, final_b = self._fit(config, resumed)

    self.assertEqual(final_a, final_b)
    chex.assert_trees_all_equal(state_a.params, state_b.params)
    chex.assert_trees_all_equal(state_a.opt_state, state_b.opt_state)
    # The interrupted run's step-5 record is replaced, not duplicated.
    metrics = lambda d: (d / train_lib.METRICS_FILE).read_text().splitlines()
    strip = lambda lines: [{k: v for k, v in json.loads(l).items()
                            if k not in ("tokens_per_s", "elapsed_s")}
             for l in lines]
    self.assertEqual(strip(metrics(uninterrupted)), strip(metrics(resumed)))

  def test_mismatched_config_raises(self):
    config = _config(num_steps=2, warmup_steps=1)
    self._fit(config, self.tmp)
    config_file = (self.tmp / orbax_checkpoint.CHECKPOINT_DIR / "2" /
                   "model_config" / orbax_checkpoint.MODEL_CONFIG_FILE)
    self.assertTrue(config_file.is_file())
    config_file.write_text(json.dumps(_StandInConfig(dim=16).to_dict()))
    with self.assertRaisesRegex(ValueError, "does not match the weights") as ctx:
      self._restore(self.tmp)
    message = str(ctx.exception)
    self.assertIn(str(config_file), message)
    self.assertIn("['embed']: config implies (259, 16) float32, "
                  "checkpoint holds (259, 8) float32", message)

  def test_resume_with_other_model_refuses_and_keeps_checkpoint(self):
    config = _config(num_steps=2, warmup_steps=1)
    self._fit(config, self.tmp)
    config_file = (self.tmp / orbax_checkpoint.CHECKPOINT_DIR / "2" /
                   "model_config" / orbax_checkpoint.MODEL_CONFIG_FILE)
    before = config_file.read_bytes()
    _, params_before = self._restore(self.tmp)
    with self.assertRaisesRegex(ValueError, "dim: checkpoint 8, run 16"):
      self._fit(_config(num_steps=4, warmup_steps=1), self.tmp,
                _StandInConfig(dim=16))
    self.assertEqual(config_file.read_bytes(), before)
    self.assertEqual(
        orbax_checkpoint.checkpoint_manager(self.tmp).all_steps(), [2])
    _, params_after = self._restore(self.tmp)
    chex.assert_trees_all_equal(params_before, params_after)

  def test_missing_checkpoint_raises(self):
    with self.assertRaisesRegex(FileNotFoundError, "no checkpoint"):
      self._restore(self.tmp)


class RealModelTest(TrainTestCase):
  """kvjax model configs survive the checkpoint round trip.

  Saves without training: compiling the real model's train step would cost
  most of this file's time budget; the loop itself is model-agnostic.
  """

  @cases.variants(("gqa", "mla"), fast=("gqa",))
  def test_save_and_restore_kvjax_model(self, variant):
    model_config = configs.model_config(
        _load_train_configs().get_config(variant).model).replace(
            num_layers=1, mlp_dim=32)
    params = jax.jit(kvjax.init_params, static_argnums=0)(model_config,
                                                          jax.random.key(0))
    state = train_lib.create_train_state(
        params, train_lib.model_logits_fn(model_config),
        train_lib.make_optimizer(_config()))
    manager = orbax_checkpoint.checkpoint_manager(self.tmp)
    orbax_checkpoint.save_checkpoint(manager, state, model_config.to_dict())
    restored_config, restored = orbax_checkpoint.restore_params(self.tmp)
    self.assertEqual(restored_config, model_config)
    chex.assert_trees_all_equal(restored, params)
    with self.assertRaisesRegex(ValueError, "refusing to overwrite"):
      orbax_checkpoint.save_checkpoint(manager, state, model_config.to_dict())


class TrainConfigFileTest(parameterized.TestCase):
  """Walks every preset of configs/train.py."""

  @cases.product(variant=_load_train_configs().VARIANTS)
  def test_preset(self, variant):
    cfg = _load_train_configs().get_config(variant)
    model_config = configs.model_config(cfg.model)
    train_config = train_lib.TrainConfig.from_dict(cfg.train.to_dict())
    # The name comes from the head counts, not from the preset's label.
    self.assertEqual(model_config.variant, variant)
    self.assertEqual(model_config.vocab_size, data.VOCAB_SIZE)
    self.assertLessEqual(train_config.seq_len, model_config.max_seq_len)
    reference = kvjax.param_count(
        configs.model_config(_load_train_configs().get_config("gqa").model))
    self.assertAlmostEqual(kvjax.param_count(model_config) / reference, 1.0,
                           delta=0.02)

  def test_default_is_gqa(self):
    self.assertEqual(_load_train_configs().get_config().variant, "gqa")


if __name__ == "__main__":
  absltest.main()
