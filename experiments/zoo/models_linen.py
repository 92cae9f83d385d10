"""The zoo's Flax Linen models, written as their authors write them (small sizes for a CPU).

- :class:`TransformerLM`: Flax's lm1b example's decoder-only model (pre-LayerNorm blocks, ``SelfAttention`` with
  3-D ``DenseGeneral`` kernels, ReLU MLP, sinusoidal positions, an untied ``logitdense``).
- :class:`ResNet`: Flax's ImageNet example's ResNet (``Conv`` without bias, ``BatchNorm``, basic blocks).
- :class:`MlpMixer`: the MLP-Mixer of Tolstikhin et al. (google-research/vision_transformer's layout: token mixing
  and channel mixing ``MlpBlock``s on a patch stem).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import linen as nn


def sinusoidal(length: int, features: int) -> jnp.ndarray:
  """The lm1b example's fixed positional table ``(1, length, features)``."""
  position = np.arange(length)[:, None]
  div = np.exp(np.arange(0, features, 2) * -(np.log(10000.0) / features))
  table = np.zeros((length, features), np.float32)
  table[:, 0::2], table[:, 1::2] = np.sin(position * div), np.cos(position * div)
  return jnp.asarray(table[None])


class MlpBlock(nn.Module):
  mlp_dim: int
  activation: str = "relu"

  @nn.compact
  def __call__(self, x):
    act = {"relu": nn.relu, "gelu": nn.gelu}[self.activation]
    y = act(nn.Dense(self.mlp_dim)(x))
    return nn.Dense(x.shape[-1])(y)


class DecoderBlock(nn.Module):
  num_heads: int
  qkv_dim: int
  mlp_dim: int

  @nn.compact
  def __call__(self, x, mask):
    y = nn.LayerNorm()(x)
    y = nn.SelfAttention(num_heads=self.num_heads, qkv_features=self.qkv_dim, use_bias=False,
                         deterministic=True)(y, mask=mask)
    x = x + y
    return x + MlpBlock(self.mlp_dim)(nn.LayerNorm()(x))


class TransformerLM(nn.Module):
  vocab_size: int
  emb_dim: int = 128
  num_heads: int = 4
  num_layers: int = 2
  mlp_dim: int = 512
  max_len: int = 64

  @nn.compact
  def __call__(self, ids, train: bool = True):
    del train
    x = nn.Embed(self.vocab_size, self.emb_dim, embedding_init=nn.initializers.normal(1.0))(ids)
    x = x + sinusoidal(self.max_len, self.emb_dim)[:, :ids.shape[1]]
    mask = nn.make_causal_mask(ids)
    for i in range(self.num_layers):
      x = DecoderBlock(self.num_heads, self.emb_dim, self.mlp_dim, name=f"encoderdecoderblock_{i}")(x, mask)
    x = nn.LayerNorm(name="encoderdecoder_norm")(x)
    return nn.Dense(self.vocab_size, name="logitdense")(x)


class ResNetBlock(nn.Module):
  filters: int
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x, train: bool):
    conv = functools.partial(nn.Conv, use_bias=False)
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
    residual = x
    y = nn.relu(norm()(conv(self.filters, (3, 3), self.strides)(x)))
    y = norm(scale_init=nn.initializers.zeros)(conv(self.filters, (3, 3))(y))
    if residual.shape != y.shape:
      residual = norm(name="norm_proj")(conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual))
    return nn.relu(residual + y)


class ResNet(nn.Module):
  stage_sizes: Sequence[int] = (1, 1)
  num_filters: int = 16
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(self.num_filters, (3, 3), use_bias=False, name="conv_init")(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn_init")(x))
    for i, blocks in enumerate(self.stage_sizes):
      for j in range(blocks):
        x = ResNetBlock(self.num_filters * 2 ** i, (2, 2) if i > 0 and j == 0 else (1, 1))(x, train)
    return nn.Dense(self.num_classes, name="head")(jnp.mean(x, axis=(1, 2)))


class MixerBlock(nn.Module):
  tokens_mlp_dim: int
  channels_mlp_dim: int

  @nn.compact
  def __call__(self, x):
    y = jnp.swapaxes(nn.LayerNorm()(x), 1, 2)
    x = x + jnp.swapaxes(MlpBlock(self.tokens_mlp_dim, "gelu", name="token_mixing")(y), 1, 2)
    return x + MlpBlock(self.channels_mlp_dim, "gelu", name="channel_mixing")(nn.LayerNorm()(x))


class MlpMixer(nn.Module):
  patch: int = 4
  hidden_dim: int = 64
  num_blocks: int = 2
  tokens_mlp_dim: int = 64
  channels_mlp_dim: int = 128
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    x = nn.Conv(self.hidden_dim, (self.patch, self.patch), strides=self.patch, name="stem")(x)
    x = x.reshape(x.shape[0], -1, x.shape[-1])
    for _ in range(self.num_blocks):
      x = MixerBlock(self.tokens_mlp_dim, self.channels_mlp_dim)(x)
    x = nn.LayerNorm(name="pre_head_layer_norm")(x)
    return nn.Dense(self.num_classes, name="head", kernel_init=nn.initializers.zeros)(jnp.mean(x, axis=1))
