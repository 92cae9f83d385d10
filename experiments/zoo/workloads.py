"""The zoo's registry: each workload a standard model as its authors write it, its data, its budget, and one
functional face (``init``, ``loss``) over Flax NNX and Linen alike, so that every optimizer row trains it the same way.

A workload's step is the README's recipe for its framework: :func:`scsgd_jax.capture_nnx` or
:func:`scsgd_jax.capture_linen` (with ``mutable=['batch_stats']`` where the model has BatchNorm), and the recipe's
``input_axes`` (:meth:`Bound.input_axes`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import scsgd_jax as sk
from experiments.run import data as data_lib
from experiments.run import models as paper_models
from experiments.zoo import models_linen, models_nnx

STEPS = 200  # every workload's budget: long enough to rank the rows, short enough for the whole zoo on 2 cores
VOCAB = data_lib.DATASETS["tiny_shakespeare"][1]


class Workload(NamedTuple):
  """One standard model on one dataset.

  Attributes:
    framework: ``'nnx'`` or ``'linen'``.
    dataset: ``'mnist'`` or ``'tiny_shakespeare'``.
    make: ``make(rngs)`` (NNX) or ``make()`` (Linen): the model.
    head: the output layer's name (a substring of its path) for Muon and the eigenbasis' Muon; ``''`` where the
      logits come from the tied token table (which Muon's rule leaves to AdamW by its name).
    kind: ``'cnn'`` or ``'transformer'``: which of the authors' AdamW settings a row takes.
    steps: the budget (warmup + cosine over it).
    batch: sequences or images per step.
    what: a line for the table.
  """

  framework: str
  dataset: str
  make: Callable[..., Any]
  head: str
  kind: str
  steps: int
  batch: int
  what: str


WORKLOADS: dict[str, Workload] = {
    "lm1b_transformer": Workload(
        "linen", "tiny_shakespeare", lambda: models_linen.TransformerLM(VOCAB), "logitdense", "transformer", STEPS, 16,
        "Flax's lm1b TransformerLM (Linen): D=128, 2 blocks, 4 heads, untied logits"),
    "gpt2": Workload(
        "nnx", "tiny_shakespeare", lambda rngs: models_nnx.GPT2(VOCAB, rngs=rngs), "", "transformer", STEPS, 16,
        "GPT-2 (NNX, nanoGPT's layout): D=64, 2 blocks, learned positions, GELU, tied embeddings"),
    "gemma": Workload(
        "nnx", "tiny_shakespeare", lambda rngs: models_nnx.Gemma(VOCAB, rngs=rngs), "", "transformer", STEPS, 16,
        "Gemma (NNX, Flax's example's layout): D=64, 2 blocks, Einsum projections, RMSNorm, gated MLP, RoPE, "
        "its Embedder's table tied"),
    "vit": Workload(
        "nnx", "mnist", lambda rngs: models_nnx.ViT(rngs=rngs), "head", "transformer", STEPS, 32,
        "ViT (NNX): 4x4 patches, D=64, 2 blocks, class token"),
    "resnet": Workload(
        "linen", "mnist", lambda: models_linen.ResNet(), "head", "cnn", STEPS, 32,
        "ResNet (Linen, Flax's ImageNet example's blocks): BatchNorm, 2 stages of 16/32 filters"),
    "mlp_mixer": Workload(
        "linen", "mnist", lambda: models_linen.MlpMixer(), "head", "cnn", STEPS, 64,
        "MLP-Mixer (Linen): 4x4 patches, 64 channels, 2 blocks"),
    "lenet": Workload(
        "nnx", "mnist", lambda rngs: paper_models.LeNet(rngs=rngs), "dense2", "cnn", STEPS, 64,
        "LeNet (NNX, the paper's)"),
    "relu_mlp": Workload(
        "nnx", "mnist", lambda rngs: models_nnx.ReluMLP(rngs=rngs), "head", "cnn", STEPS, 64,
        "ReLU MLP (NNX): 784-256-256-10"),
    "lstm_lm": Workload(
        "nnx", "tiny_shakespeare", lambda rngs: models_nnx.LSTMLM(VOCAB, rngs=rngs), "head", "transformer", STEPS, 16,
        "Character LSTM LM (NNX, nnx.RNN(nnx.OptimizedLSTMCell)): 64-d embedding, 2 layers of 128, untied head; "
        "AdamW at the transformer (language-model) settings"),
    "moe": Workload(
        "nnx", "tiny_shakespeare", lambda rngs: models_nnx.MoELM(VOCAB, rngs=rngs), "head", "transformer", STEPS, 16,
        "Mixture of experts LM (NNX): D=64, 2 blocks of RMSNorm, causal nnx.MultiHeadAttention, RMSNorm, MoE MLP "
        "(4 experts of hidden 128 as raw stacked weights sown with scsgd_jax.sow_rows, Linear router, top-2, dense "
        "einsum dispatch), learned positions, untied head"),
}


def workload(name: str) -> Workload:
  if name not in WORKLOADS:
    raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
  return WORKLOADS[name]


# ---------------------------------------------------------------------------------------------- data


class Data(NamedTuple):
  train: data_lib.Split
  validation: data_lib.Split


@functools.lru_cache(maxsize=None)
def load(dataset: str, data_dir: str) -> Data:
  """The training split and the held-out split (MNIST's test, tiny_shakespeare's validation), decoded once."""
  held_out = "test" if dataset == "mnist" else "validation"
  return Data(data_lib.load_split(dataset, "train", data_dir, download=False),
              data_lib.load_split(dataset, held_out, data_dir, download=False, max_examples=-1))


def batch(split: data_lib.Split, size: int, step: int, seed: int):
  """The batch of ``step`` under batch-order ``seed`` (the same for every row)."""
  idx = data_lib.batch_indices(len(split.inputs), size, step, seed)
  return jnp.asarray(split.inputs[idx]), jnp.asarray(split.labels[idx])


def held_out(split: data_lib.Split, examples: int):
  return jnp.asarray(split.inputs[:examples]), jnp.asarray(split.labels[:examples])


# -------------------------------------------------------------------------------------- one face


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class Bound:
  """A workload's model, seeded, seen as pure functions of ``(params, extra)``: ``extra`` holds what is not trained
  (NNX's other state, Linen's ``batch_stats``)."""

  def __init__(self, w: Workload, example):
    self.w, self.example = w, example
    if w.framework == "linen":
      self.module = w.make()
    else:
      self.graphdef = nnx.split(w.make(nnx.Rngs(0)), nnx.Param, ...)[0]

  def start(self, seed: int):
    """``(params, extra)`` of the model initialized under ``seed``."""
    if self.w.framework == "nnx":
      _, params, rest = nnx.split(self.w.make(nnx.Rngs(seed)), nnx.Param, ...)
      return params, rest
    variables = self.module.init(jax.random.PRNGKey(seed), self.example, train=False)
    return variables["params"], {k: v for k, v in variables.items() if k != "params"}

  def _variables(self, params, extra):
    return {"params": params, **extra}

  def input_axes(self, x) -> dict:
    """The README's recipe: ``input_axes_nnx(model, x)`` or ``input_axes_linen(module, variables, x, train=True)``."""
    params, extra = self.start(0)
    if self.w.framework == "nnx":
      return sk.input_axes_nnx(nnx.merge(self.graphdef, params, extra), x)
    return sk.input_axes_linen(self.module, self._variables(params, extra), x, train=True)

  def loss(self, params, extra, x, y, key, capture: bool, train: bool = True):
    """``(loss, (layer_inputs or None, new extra))`` of one batch, as the README's step computes it."""
    if self.w.framework == "nnx":
      # copy: Variables of this trace (under jax.grad, ``extra``'s own are the caller's; nnx.RNN's carry RngStream
      # mutates its count and Flax refuses that from another trace level)
      model = nnx.merge(self.graphdef, params, extra, copy=True)
      logits, inputs = sk.capture_nnx(model, x, rng=key) if capture else (model(x), None)
      return cross_entropy(logits, y), (inputs, extra)
    variables, mutable = self._variables(params, extra), list(extra)
    if capture:
      out = sk.capture_linen(self.module, variables, x, train=train, rng=key, mutable=mutable)
      logits, inputs, updates = out if mutable else (*out, {})
    else:
      out = self.module.apply(variables, x, train=train, rngs={"dropout": key}, mutable=mutable or False)
      (logits, updates), inputs = (out if mutable else (out, {})), None
    return cross_entropy(logits, y), (inputs, {**extra, **(updates if mutable else {})})

  def evaluate(self, params, extra, x, y) -> jax.Array:
    if self.w.framework == "nnx":
      return cross_entropy(nnx.merge(self.graphdef, params, extra)(x), y)
    return cross_entropy(self.module.apply(self._variables(params, extra), x, train=False), y)


def example(w: Workload):
  """Zeros shaped as a batch of ``w``'s inputs."""
  x, _ = data_lib.example_batch(w.dataset, w.batch)
  return jnp.asarray(x)
