"""The paper's networks (Section 3) in Flax NNX, with Caffe's Xavier init and zero biases."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

# Caffe's "xavier" filler: U[-sqrt(3/n), sqrt(3/n)] with n = fan-in (kh*kw*cin for convs).
xavier_caffe = jax.nn.initializers.variance_scaling(1.0, "fan_in", "uniform")
zeros = jax.nn.initializers.zeros


def _conv(cin, cout, rngs):
  return nnx.Conv(cin, cout, (5, 5), padding="VALID", kernel_init=xavier_caffe, bias_init=zeros, rngs=rngs)


def _dense(nin, nout, rngs):
  return nnx.Linear(nin, nout, kernel_init=xavier_caffe, bias_init=zeros, rngs=rngs)


def _maxpool(x):
  return nnx.max_pool(x, (2, 2), strides=(2, 2))


class LeNet(nnx.Module):
  """MNIST 28x28x1: conv 5x5x20, maxpool 2x2, conv 5x5x50, maxpool 2x2, dense 500, relu, dense 10.

  As the paper (and Caffe's LeNet) has it: no padding and no nonlinearity after the convolutions.
  """

  def __init__(self, *, rngs: nnx.Rngs, num_classes: int = 10, channels: int = 1):
    self.conv1 = _conv(channels, 20, rngs)
    self.conv2 = _conv(20, 50, rngs)
    self.dense1 = _dense(4 * 4 * 50, 500, rngs)
    self.dense2 = _dense(500, num_classes, rngs)

  def __call__(self, x):
    x = _maxpool(self.conv1(x))
    x = _maxpool(self.conv2(x))
    x = x.reshape(x.shape[0], -1)
    return self.dense2(nnx.relu(self.dense1(x)))


class SVHNNet(nnx.Module):
  """SVHN 32x32x3: conv 5x5x8, relu, conv 5x5x16, maxpool, conv 5x5x16, maxpool, affine 32, relu,
  affine 32, relu, affine 10, avgpool 4x4.

  Reading of the paper: with no padding the maps go 32 -> 28 -> 24 -> 12 -> 8 -> 4, so a final
  "avgpool 4x4" only makes sense if the three affine layers act on each of the 4x4 positions
  (1x1 convolutions, i.e. Dense on the channel axis) and the 10 class scores are then averaged
  over the 4x4 map. That is what we build; the affine layers' inputs are 16-dim rows, one per
  position.
  """

  def __init__(self, *, rngs: nnx.Rngs, num_classes: int = 10, channels: int = 3):
    self.conv1 = _conv(channels, 8, rngs)
    self.conv2 = _conv(8, 16, rngs)
    self.conv3 = _conv(16, 16, rngs)
    self.dense1 = _dense(16, 32, rngs)
    self.dense2 = _dense(32, 32, rngs)
    self.dense3 = _dense(32, num_classes, rngs)

  def __call__(self, x):
    x = nnx.relu(self.conv1(x))
    x = _maxpool(self.conv2(x))
    x = _maxpool(self.conv3(x))
    x = nnx.relu(self.dense1(x))
    x = nnx.relu(self.dense2(x))
    x = self.dense3(x)  # (B, 4, 4, 10)
    return jnp.mean(x, axis=(1, 2))


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention with 2-D kernels (GPT-2's layout): one ``Linear(d, 3d)`` for q, k, v
  and one ``Linear(d, d)`` out. Every peer of the benchmark reads these kernels as (input, output):
  kfac-jax 0.0.8's dense block cannot take ``MultiHeadAttention``'s (in, heads, head_dim) outputs, and
  Muon and Shampoo would read a 3-D kernel's head axis as an input axis."""

  def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
    self.heads = heads
    self.qkv, self.out = nnx.Linear(d, 3 * d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)

  def __call__(self, x, mask, deterministic: bool = True):
    del deterministic  # no dropout
    b, t, d = x.shape
    q, k, v = (z.reshape(b, t, self.heads, d // self.heads) for z in jnp.split(self.qkv(x), 3, axis=-1))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.heads).astype(x.dtype)
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    return self.out(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, d))


class TransformerBlock(nnx.Module):
  """Pre-LayerNorm block: causal multi-head attention, then a 4x MLP (GELU), each residual.

  ``attention``: "mha" (``nnx.MultiHeadAttention``, its q/k/v/out ``LinearGeneral`` kernels) or
  "linear" (:class:`CausalSelfAttention`, 2-D kernels).
  """

  def __init__(self, d: int, heads: int, dropout: float, rngs: nnx.Rngs, attention: str = "mha"):
    self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
    if attention == "mha":
      self.attn = nnx.MultiHeadAttention(heads, d, decode=False, dropout_rate=dropout, rngs=rngs)
    elif attention == "linear" and dropout == 0:
      self.attn = CausalSelfAttention(d, heads, rngs)
    else:
      raise ValueError(f"attention={attention!r} (dropout {dropout}): 'mha', or 'linear' without dropout")
    self.fc1, self.fc2 = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x, mask, deterministic: bool):
    x = x + self.attn(self.ln1(x), mask=mask, deterministic=deterministic)
    return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


class CharTransformer(nnx.Module):
  """A character-level causal transformer LM: token ``Embed``, pre-LayerNorm blocks, a ``Linear`` head.

  Learned positions; every kernel (embedding, q/k/v/out, MLP, head) is one scsgd conditions.
  """

  def __init__(self, *, rngs: nnx.Rngs, vocab: int, d: int = 64, heads: int = 4, layers: int = 2,
               context: int = 64, dropout: float = 0.0, attention: str = "mha", scan: bool = False):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (context, d)))
    self.scan = scan
    if scan:  # the blocks as one stack, made by nnx.vmap and run by nnx.scan (Flax's scan-over-layers)
      @nnx.split_rngs(splits=layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return TransformerBlock(d, heads, dropout, rngs, attention)

      self.blocks = make(rngs)
    else:
      self.blocks = nnx.List([TransformerBlock(d, heads, dropout, rngs, attention) for _ in range(layers)])
    self.ln, self.head = nnx.LayerNorm(d, rngs=rngs), nnx.Linear(d, vocab, rngs=rngs)

  def __call__(self, ids, deterministic: bool = False):
    x = self.embed(ids) + self.pos[...][None, : ids.shape[-1]]
    mask = nnx.make_causal_mask(ids)
    if self.scan:
      body = nnx.scan(lambda x, block: block(x, mask, deterministic), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      x = body(x, self.blocks)
    else:
      for block in self.blocks:
        x = block(x, mask, deterministic)
    return self.head(self.ln(x))


class LogisticRegression(nnx.Module):
  """Multinomial logistic regression on the flattened input (the convex case), starting at W = 0."""

  def __init__(self, *, rngs: nnx.Rngs, num_inputs: int, num_classes: int):
    self.dense = nnx.Linear(num_inputs, num_classes, kernel_init=nnx.initializers.zeros, rngs=rngs)

  def __call__(self, x):
    return self.dense(x.reshape(x.shape[0], -1))


class ResidualBlock(nnx.Module):
  """Two 3x3 convs with BatchNorm and a residual connection (He et al., 2016)."""

  def __init__(self, channels: int, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(channels, channels, (3, 3), use_bias=False, rngs=rngs)
    self.bn1 = nnx.BatchNorm(channels, rngs=rngs)
    self.conv2 = nnx.Conv(channels, channels, (3, 3), use_bias=False, rngs=rngs)
    self.bn2 = nnx.BatchNorm(channels, rngs=rngs)

  def __call__(self, x):
    y = nnx.relu(self.bn1(self.conv1(x)))
    return nnx.relu(x + self.bn2(self.conv2(y)))


class SmallResNet(nnx.Module):
  """A small ResNet for 32x32 images: a 3x3 stem, ``blocks`` residual blocks with BatchNorm (batch statistics
  in training), global average pooling and a Dense head (~10k parameters at 16 channels, 2 blocks)."""

  def __init__(self, *, rngs: nnx.Rngs, num_classes: int = 10, channels: int = 3, width: int = 16, blocks: int = 2):
    self.stem = nnx.Conv(channels, width, (3, 3), use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(width, rngs=rngs)
    self.blocks = nnx.List([ResidualBlock(width, rngs) for _ in range(blocks)])
    self.head = nnx.Linear(width, num_classes, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn(self.stem(x)))
    for block in self.blocks:
      x = block(x)
    return self.head(jnp.mean(x, axis=(1, 2)))


# name -> constructor(rngs, number of classes (text: vocabulary), input shape of one example)
MODELS = {
    "lenet": lambda rngs, classes, shape: LeNet(rngs=rngs, num_classes=classes, channels=shape[-1]),
    "svhn_net": lambda rngs, classes, shape: SVHNNet(rngs=rngs, num_classes=classes, channels=shape[-1]),
    "logreg": lambda rngs, classes, shape: LogisticRegression(rngs=rngs, num_inputs=math.prod(shape),
                                                              num_classes=classes),
    # ~0.6M parameters: d = 128, 4 heads, 3 pre-LayerNorm blocks, context = the data's window; GPT-2's
    # 2-D attention kernels, so that every optimizer of the head to head reads them alike
    "char_transformer": lambda rngs, classes, shape: CharTransformer(rngs=rngs, vocab=classes, d=128, heads=4,
                                                                     layers=3, context=shape[0],
                                                                     attention="linear"),
    # the larger transformer task: ~4x the parameters (d = 256, 8 heads), the same depth and attention
    "char_transformer_large": lambda rngs, classes, shape: CharTransformer(rngs=rngs, vocab=classes, d=256,
                                                                           heads=8, layers=3, context=shape[0],
                                                                           attention="linear"),
}


def create_model(name: str, *, seed: int, num_classes: int, input_shape: tuple[int, ...]) -> nnx.Module:
  if name not in MODELS:
    raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}.")
  return MODELS[name](nnx.Rngs(seed), num_classes, tuple(input_shape))
