"""LARS leaves batch-norm parameters and biases alone: no trust ratio, no weight decay."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from resnet import models, optim

LR, TRUST, WD = 0.5, 0.01, 1e-2


def _params():
  return {
    'conv': {'kernel': jnp.full((3, 3, 2, 4), 2.0)},
    'bn': {'scale': jnp.full((4,), 3.0), 'bias': jnp.full((4,), -1.0)},
    'dense': {'kernel': jnp.full((4, 5), 0.5), 'bias': jnp.full((5,), 4.0)},
  }


def test_kernel_mask_selects_only_kernels_of_a_resnet():
  model = models.create_model('resnet_tiny', num_classes=3, dtype=jnp.float32)
  init = functools.partial(model.init, train=False)
  params = jax.eval_shape(init, jax.random.key(0), jnp.zeros((1, 16, 16, 3)))['params']
  flat = jax.tree_util.tree_flatten_with_path(optim.kernel_mask(params))[0]
  for path, included in flat:
    assert included == (path[-1].key == 'kernel'), path
  assert any(included for _, included in flat) and not all(included for _, included in flat)


def test_lars_scales_kernels_and_leaves_bn_and_biases_to_plain_sgd():
  params = _params()
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.25), params)
  tx = optim.lars(
    optax.constant_schedule(LR), weight_decay=WD, momentum=0.9, trust_coefficient=TRUST, eps=0.0
  )
  updates, _ = tx.update(grads, tx.init(params), params)
  for name in ('bn', 'dense'):
    for leaf in ('scale', 'bias'):
      if leaf in updates[name]:
        np.testing.assert_allclose(updates[name][leaf], -LR * 0.25, rtol=1e-6)
  for name in ('conv', 'dense'):
    w = params[name]['kernel']
    g = grads[name]['kernel'] + WD * w
    expected = -LR * TRUST * jnp.linalg.norm(w) / jnp.linalg.norm(g) * g
    np.testing.assert_allclose(updates[name]['kernel'], expected, rtol=1e-5)


def test_learning_rate_warms_up_linearly_then_decays_to_the_end_rate():
  learning_rate_fn = optim.learning_rate_schedule(
    base_learning_rate=2.0,
    global_batch=512,
    warmup_steps=10,
    total_steps=30,
    end_learning_rate=0.01,
    power=2.0,
  )
  np.testing.assert_allclose(
    [learning_rate_fn(0), learning_rate_fn(5), learning_rate_fn(10)], [0.0, 2.0, 4.0]
  )
  np.testing.assert_allclose(learning_rate_fn(20), 0.01 + (4.0 - 0.01) * 0.25, rtol=1e-6)
  np.testing.assert_allclose(learning_rate_fn(30), 0.01, rtol=1e-6)
