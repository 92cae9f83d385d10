"""The experiments' models: shapes, the paper's LeNet dimensions, Xavier (Caffe) initialisation."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import models


@pytest.mark.parametrize("name,shape", [("lenet", (3, 28, 28, 1)), ("svhn_net", (3, 32, 32, 3))])
def test_forward_shapes_and_xavier_init(name, shape):
  model = models.create_model(name, seed=0, num_classes=10, channels=shape[-1])
  assert model(jnp.zeros(shape)).shape == (3, 10)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for layer, p in params.items():
    kernel = np.asarray(p["kernel"])
    fan_in = int(np.prod(kernel.shape[:-1]))
    bound = np.sqrt(3.0 / fan_in)
    assert np.abs(kernel).max() <= bound, layer
    if kernel.size >= 500:  # uniform on the whole interval, not a narrower one
      assert np.abs(kernel).max() > 0.95 * bound, layer
      np.testing.assert_allclose(kernel.std(), bound / np.sqrt(3), rtol=0.15)
    np.testing.assert_array_equal(p["bias"], 0.0)


def test_lenet_layer_dims_match_the_paper():
  model = models.LeNet(rngs=nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert params["conv1"]["kernel"].shape == (5, 5, 1, 20)
  assert params["conv2"]["kernel"].shape == (5, 5, 20, 50)
  assert params["dense1"]["kernel"].shape == (800, 500)
  assert params["dense2"]["kernel"].shape == (500, 10)
