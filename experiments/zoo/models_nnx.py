"""The zoo's Flax NNX models, written as their authors write them (small sizes for a CPU).

- :class:`GPT2`: nanoGPT's layout (learned positions, a fused ``c_attn``, GELU MLP, the token table tied to the
  logits through ``nnx.Embed.attend``).
- :class:`Gemma`: Flax's Gemma example's layout (an ``Embedder`` whose ``input_embedding`` table both embeds, scaled
  by ``sqrt(D)``, and decodes; ``nnx.Einsum`` projections; ``RMSNorm``; a gated GELU MLP; rotary positions).
- :class:`ViT`: a Vision Transformer on image patches (a patch ``Conv``, a class token, learned positions,
  ``nnx.MultiHeadAttention``).
- :class:`ReluMLP`: a plain ReLU MLP on flattened images.
- :class:`LSTMLM`: a character LSTM language model with Flax's stock recurrent layers (``nnx.RNN`` over
  ``nnx.OptimizedLSTMCell``), an untied ``head``.
- :class:`MoELM`: a small mixture-of-experts language model (``nnx.MultiHeadAttention`` blocks whose MLP is
  :class:`MoE`: raw stacked expert weights, a ``Linear`` router, top-2 routing computed densely with ``jnp.einsum``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import scsgd_jax as sk


def causal_attention(q, k, v):
  """Softmax attention of ``(B, T, H, d)`` queries over keys and values, causal."""
  logits = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
  weights = jax.nn.softmax(jnp.where(mask[None, None], logits, jnp.finfo(logits.dtype).min), axis=-1)
  return jnp.einsum("bhts,bshd->bthd", weights, v)


class GPT2Block(nnx.Module):
  def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
    self.heads = heads
    self.ln_1, self.ln_2 = nnx.LayerNorm(dim, rngs=rngs), nnx.LayerNorm(dim, rngs=rngs)
    init = nnx.initializers.normal(0.02)
    self.c_attn = nnx.Linear(dim, 3 * dim, kernel_init=init, rngs=rngs)
    self.attn_proj = nnx.Linear(dim, dim, kernel_init=init, rngs=rngs)
    self.c_fc = nnx.Linear(dim, 4 * dim, kernel_init=init, rngs=rngs)
    self.mlp_proj = nnx.Linear(4 * dim, dim, kernel_init=init, rngs=rngs)

  def __call__(self, x):
    b, t, d = x.shape
    q, k, v = jnp.split(self.c_attn(self.ln_1(x)), 3, axis=-1)
    heads = lambda a: a.reshape(b, t, self.heads, d // self.heads)
    x = x + self.attn_proj(causal_attention(heads(q), heads(k), heads(v)).reshape(b, t, d))
    return x + self.mlp_proj(nnx.gelu(self.c_fc(self.ln_2(x))))


class GPT2(nnx.Module):
  def __init__(self, vocab: int, *, dim: int = 64, heads: int = 4, layers: int = 2, context: int = 64,
               rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    self.wte = nnx.Embed(vocab, dim, embedding_init=init, rngs=rngs)
    self.wpe = nnx.Embed(context, dim, embedding_init=init, rngs=rngs)
    self.h = nnx.List([GPT2Block(dim, heads, rngs=rngs) for _ in range(layers)])
    self.ln_f = nnx.LayerNorm(dim, rngs=rngs)

  def __call__(self, ids):
    x = self.wte(ids) + self.wpe(jnp.arange(ids.shape[1]))[None]
    for block in self.h:
      x = block(x)
    return self.wte.attend(self.ln_f(x))


class Embedder(nnx.Module):
  """The Gemma example's embedder: one table, ``encode`` (scaled by ``sqrt(D)``) and ``decode`` (the logits)."""

  def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs):
    self.input_embedding = nnx.Param(nnx.initializers.normal()(rngs.params(), (vocab, dim)))

  def encode(self, ids):
    table = self.input_embedding[...]
    return table[ids] * jnp.sqrt(table.shape[1]).astype(table.dtype)

  def decode(self, x):
    return x @ self.input_embedding[...].T


def rope(x, positions, base: float = 10_000.0):
  """Rotary positions on ``(B, T, H, d)``, the two halves of ``d`` rotated."""
  half = x.shape[-1] // 2
  angles = positions[:, None] / (base ** (jnp.arange(half) / half))[None, :]
  sin, cos = jnp.sin(angles)[None, :, None], jnp.cos(angles)[None, :, None]
  first, second = x[..., :half], x[..., half:]
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class GemmaBlock(nnx.Module):
  def __init__(self, dim: int, heads: int, head_dim: int, hidden: int, *, rngs: nnx.Rngs):
    self.pre_attention_norm, self.pre_ffw_norm = nnx.RMSNorm(dim, rngs=rngs), nnx.RMSNorm(dim, rngs=rngs)
    self.q_einsum = nnx.Einsum("BTD,NDH->BTNH", (heads, dim, head_dim), rngs=rngs)
    self.kv_einsum = nnx.Einsum("BSD,CKDH->CBSKH", (2, heads, dim, head_dim), rngs=rngs)
    self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (heads, head_dim, dim), rngs=rngs)
    self.gate_proj = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
    self.up_proj = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
    self.down_proj = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)

  def __call__(self, x):
    positions = jnp.arange(x.shape[1])
    y = self.pre_attention_norm(x)
    q, (k, v) = self.q_einsum(y), self.kv_einsum(y)
    x = x + self.attn_vec_einsum(causal_attention(rope(q, positions), rope(k, positions), v))
    y = self.pre_ffw_norm(x)
    return x + self.down_proj(nnx.gelu(self.gate_proj(y)) * self.up_proj(y))


class Gemma(nnx.Module):
  def __init__(self, vocab: int, *, dim: int = 64, heads: int = 4, layers: int = 2, hidden: int = 128,
               rngs: nnx.Rngs):
    self.embedder = Embedder(vocab, dim, rngs=rngs)
    self.layers = nnx.List([GemmaBlock(dim, heads, dim // heads, hidden, rngs=rngs) for _ in range(layers)])
    self.final_norm = nnx.RMSNorm(dim, rngs=rngs)

  def __call__(self, ids):
    x = self.embedder.encode(ids)
    for layer in self.layers:
      x = layer(x)
    return self.embedder.decode(self.final_norm(x))


class ViTBlock(nnx.Module):
  def __init__(self, dim: int, heads: int, mlp: int, *, rngs: nnx.Rngs):
    self.norm1, self.norm2 = nnx.LayerNorm(dim, rngs=rngs), nnx.LayerNorm(dim, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
    self.fc1, self.fc2 = nnx.Linear(dim, mlp, rngs=rngs), nnx.Linear(mlp, dim, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.norm1(x))
    return x + self.fc2(nnx.gelu(self.fc1(self.norm2(x))))


class ViT(nnx.Module):
  def __init__(self, *, patch: int = 4, channels: int = 1, image: int = 28, dim: int = 64, heads: int = 4,
               layers: int = 2, mlp: int = 128, classes: int = 10, rngs: nnx.Rngs):
    tokens = (image // patch) ** 2 + 1
    self.patch_embed = nnx.Conv(channels, dim, (patch, patch), strides=patch, padding="VALID", rngs=rngs)
    self.cls_token = nnx.Param(jnp.zeros((1, 1, dim)))
    self.pos_embed = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (1, tokens, dim)))
    self.blocks = nnx.List([ViTBlock(dim, heads, mlp, rngs=rngs) for _ in range(layers)])
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, classes, kernel_init=nnx.initializers.zeros, rngs=rngs)

  def __call__(self, images):
    x = self.patch_embed(images)
    x = x.reshape(x.shape[0], -1, x.shape[-1])
    x = jnp.concatenate([jnp.broadcast_to(self.cls_token[...], (x.shape[0], 1, x.shape[-1])), x], axis=1)
    x = x + self.pos_embed[...]
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x)[:, 0])


class ReluMLP(nnx.Module):
  def __init__(self, *, inputs: int = 784, hidden: int = 256, layers: int = 2, classes: int = 10, rngs: nnx.Rngs):
    sizes = [inputs] + [hidden] * layers
    self.hidden = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes, sizes[1:])])
    self.head = nnx.Linear(hidden, classes, rngs=rngs)

  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    for layer in self.hidden:
      x = nnx.relu(layer(x))
    return self.head(x)


class LSTMLM(nnx.Module):
  """Embed, ``layers`` stacked ``nnx.RNN(nnx.OptimizedLSTMCell)`` of ``hidden`` units, an untied ``nnx.Linear``
  head: the next character's logits at every position."""

  def __init__(self, vocab: int, *, dim: int = 64, hidden: int = 128, layers: int = 2, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    sizes = [dim] + [hidden] * layers
    self.lstm = nnx.List([nnx.RNN(nnx.OptimizedLSTMCell(a, b, rngs=rngs), rngs=rngs)
                          for a, b in zip(sizes, sizes[1:])])
    self.head = nnx.Linear(hidden, vocab, rngs=rngs)

  def __call__(self, ids):
    x = self.embed(ids)
    for layer in self.lstm:
      x = layer(x)
    return self.head(x)


class MoE(nnx.Module):
  """A mixture-of-experts MLP: ``experts`` GELU MLPs held as raw stacked parameters ``w_in`` ``(E, D, hidden)`` and
  ``w_out`` ``(E, hidden, D)``, a ``Linear`` router, each token sent to its ``top_k`` experts (softmax over their
  router logits). Dispatch is dense: every expert runs on every token (``jnp.einsum``) and the router's weights,
  zero off a token's top ``k``, combine them.

  Each expert's kernels are handed to the capture with :func:`scsgd_jax.sow_rows` (a no-op outside one): the rows
  its gradient reads, i.e. the tokens routed to it (the others' rows zeroed: their gradient rows are zero too),
  stacked ``(E, tokens, features)``; ``Layout((0,), stack=1)``: axis 0 of the parameter indexes the experts, and
  each expert's ``(in, out)`` matrix takes its input on its axis 0."""

  def __init__(self, dim: int, hidden: int, experts: int, top_k: int = 2, *, rngs: nnx.Rngs):
    self.top_k = top_k
    self.router = nnx.Linear(dim, experts, use_bias=False, rngs=rngs)
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    self.w_in = nnx.Param(init(rngs.params(), (experts, dim, hidden)))
    self.w_out = nnx.Param(init(rngs.params(), (experts, hidden, dim)))

  def gates(self, tokens):
    """``(tokens, E)``: each token's softmax over its top-``k`` router logits, zero elsewhere."""
    logits = self.router(tokens)
    top, index = jax.lax.top_k(logits, self.top_k)
    return jnp.einsum("tk,tke->te", jax.nn.softmax(top, axis=-1), jax.nn.one_hot(index, logits.shape[-1]))

  def __call__(self, x):
    tokens = x.reshape(-1, x.shape[-1])
    gates = self.gates(tokens)
    routed = (gates > 0).T[..., None]  # (E, tokens, 1)
    layout = sk.Layout((0,), stack=1)
    sk.sow_rows(self, "w_in", jnp.where(routed, tokens[None], 0.0), layout)
    h = nnx.gelu(jnp.einsum("td,edh->eth", tokens, self.w_in[...]))
    sk.sow_rows(self, "w_out", jnp.where(routed, h, 0.0), layout)
    y = jnp.einsum("eth,ehd->etd", h, self.w_out[...])
    return jnp.einsum("etd,te->td", y, gates).reshape(x.shape)


class MoEBlock(nnx.Module):
  def __init__(self, dim: int, heads: int, hidden: int, experts: int, *, rngs: nnx.Rngs):
    self.attn_norm, self.mlp_norm = nnx.RMSNorm(dim, rngs=rngs), nnx.RMSNorm(dim, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(heads, dim, use_bias=False, decode=False, rngs=rngs)
    self.moe = MoE(dim, hidden, experts, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.attn_norm(x), mask=mask)
    return x + self.moe(self.mlp_norm(x))


class MoELM(nnx.Module):
  """Token and learned position embeddings, ``layers`` pre-RMSNorm blocks (:class:`MoEBlock`: causal attention, a
  :class:`MoE` MLP), a final RMSNorm and an untied ``head``."""

  def __init__(self, vocab: int, *, dim: int = 64, heads: int = 4, layers: int = 2, hidden: int = 128,
               experts: int = 4, context: int = 64, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.pos_embed = nnx.Embed(context, dim, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.blocks = nnx.List([MoEBlock(dim, heads, hidden, experts, rngs=rngs) for _ in range(layers)])
    self.final_norm = nnx.RMSNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, vocab, rngs=rngs)

  def __call__(self, ids):
    x = self.embed(ids) + self.pos_embed(jnp.arange(ids.shape[1]))[None]
    mask = nnx.make_causal_mask(ids)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.final_norm(x))
