"""What a config builds: the model (as a graph definition and its parameters), the optimizer and the
model's forward function, in one place for every entry point."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import ml_collections
from flax import nnx

import scsgd_jax

from experiments.run import data as data_lib
from experiments.run import models
from experiments.optim import optimizers


class Built(NamedTuple):
  graphdef: Any  # nnx.GraphDef of the model
  params: Any  # its parameters as a pure tree (arrays, or ShapeDtypeStructs when built abstract)
  optimizer: optimizers.Optimizer
  forward: optimizers.Forward


def model(config: ml_collections.ConfigDict) -> nnx.Module:
  """``config.model`` for ``config.dataset``'s inputs and classes, initialised from ``config.seed``."""
  input_shape, num_classes = data_lib.DATASETS[config.dataset]
  return models.create_model(config.model, seed=config.seed, num_classes=num_classes, input_shape=input_shape)


def build(config: ml_collections.ConfigDict, *, abstract: bool = False) -> Built:
  """The model, optimizer and forward of ``config``; ``abstract``: parameters as shapes (nothing computed)."""
  module = nnx.eval_shape(lambda: model(config)) if abstract else model(config)
  graphdef, params = nnx.split(module, nnx.Param)
  params = nnx.as_pure(params)
  if abstract:
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  forward = optimizers.Forward(lambda p, inputs: nnx.merge(graphdef, p)(inputs),
                               data_lib.example_batch(config.dataset, config.batch_size))
  # the layouts, and the kernels that read one array (an attention's query, key, value) sharing its statistics
  input_axes = scsgd_jax.input_axes_nnx(module, forward.example_batch[0])
  return Built(graphdef, params, optimizers.create(config, forward, input_axes), forward)


def abstract_state(built: Built) -> dict:
  """``{"params", "opt_state"}`` as shapes and dtypes: what a checkpoint of ``built`` holds."""
  state = jax.eval_shape(lambda p: {"params": p, "opt_state": built.optimizer.tx.init(p)}, built.params)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
