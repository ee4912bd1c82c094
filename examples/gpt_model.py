"""The GPT example's model: a pre-LayerNorm decoder in Flax nnx, and the attention functions it can
plug into ``nnx.MultiHeadAttention(attention_fn=...)`` (jaxflash, Flax's default, jax.nn xla and
cudnn)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

import jaxflash.nnx

ATTENTIONS = ("jaxflash", "jaxflash_fp8", "jaxflash_fp8_rotated", "flax", "xla", "cudnn")


# ---------------------------------------------------------------------------------------------
# Attention functions for nnx.MultiHeadAttention(attention_fn=...)
# ---------------------------------------------------------------------------------------------

def _jax_nn_attention(implementation: str) -> Callable[..., jax.Array]:
  """An ``attention_fn`` for ``nnx.MultiHeadAttention`` that calls
  ``jax.nn.dot_product_attention(..., implementation=implementation)``.

  ``nnx.MultiHeadAttention`` passes every hook keyword (dropout_rng, dropout_rate,
  broadcast_dropout, deterministic, dtype, precision, module, is_causal, ...); the ones that
  ``jax.nn.dot_product_attention`` has no counterpart for are accepted and ignored, except that
  active dropout is refused (it has none).
  """
  def attention(query: jax.Array, key: jax.Array, value: jax.Array,
                bias: jax.Array | None = None, mask: jax.Array | None = None, *,
                is_causal: bool = False, dropout_rate: float = 0.0, deterministic: bool = True,
                dtype: Any = None, **unused: Any) -> jax.Array:
    del unused  # dropout_rng, broadcast_dropout, precision, module, promote_dtype, ...
    if dropout_rate > 0.0 and not deterministic:
      raise ValueError(f"attention '{implementation}' (jax.nn.dot_product_attention) has no "
                       "attention dropout; use --attn-dropout 0")
    if dtype is None:
      dtype = jnp.result_type(query, key, value)
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    if mask is not None:
      mask = mask.astype(jnp.bool_)
    return jax.nn.dot_product_attention(query, key, value, bias, mask, is_causal=is_causal,
                                        implementation=implementation)

  attention.__name__ = f"{implementation}_attention"
  return attention


xla_attention = _jax_nn_attention("xla")
cudnn_attention = _jax_nn_attention("cudnn")


def attention_fn(name: str, deterministic: bool = True) -> Callable[..., jax.Array]:
  """The ``attention_fn`` hook for ``name`` (one of ATTENTIONS); ``deterministic=False`` lets
  jaxflash's backward add gradients with atomics (``deterministic_backward=False``)."""
  options = {} if deterministic else {"deterministic_backward": False}
  if name == "jaxflash":
    if options:
      return functools.partial(jaxflash.nnx.dot_product_attention, **options)
    return jaxflash.nnx.dot_product_attention
  if name == "jaxflash_fp8":  # the forward in FP8, the gradient in 16 bits
    return functools.partial(jaxflash.nnx.dot_product_attention, fp8=True, **options)
  if name == "jaxflash_fp8_rotated":  # the same after FlashAttention-3's random rotation
    return functools.partial(jaxflash.nnx.dot_product_attention, fp8={"rotation_seed": 0},
                             **options)
  if name == "flax":
    return nnx.dot_product_attention
  if name == "xla":
    return xla_attention
  if name == "cudnn":
    return cudnn_attention
  raise ValueError(f"unknown attention {name!r}; expected one of {ATTENTIONS}")


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int
  seq: int
  layers: int
  heads: int
  dim: int
  dtype: Any = jnp.float32   # compute dtype; parameters are always float32
  attn_dropout: float = 0.0
  mlp_ratio: int = 4


class Block(nnx.Module):
  """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

  def __init__(self, cfg: Config, attention: Callable[..., jax.Array], *, rngs: nnx.Rngs):
    dt = cfg.dtype
    self.ln_attn = nnx.LayerNorm(cfg.dim, dtype=dt, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
        cfg.heads, cfg.dim, dtype=dt, attention_fn=attention, dropout_rate=cfg.attn_dropout,
        decode=False, rngs=rngs)
    self.ln_mlp = nnx.LayerNorm(cfg.dim, dtype=dt, rngs=rngs)
    self.mlp_in = nnx.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim, dtype=dt, rngs=rngs)
    self.mlp_out = nnx.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim, dtype=dt, rngs=rngs)

  def __call__(self, x: jax.Array, *, deterministic: bool) -> jax.Array:
    x = x + self.attn(self.ln_attn(x), is_causal=True, deterministic=deterministic)
    return x + self.mlp_out(nnx.gelu(self.mlp_in(self.ln_mlp(x))))


class GPT(nnx.Module):
  """Decoder-only language model; the output head is tied to the token embedding."""

  def __init__(self, cfg: Config, attention: Callable[..., jax.Array], *, rngs: nnx.Rngs):
    self.cfg = cfg
    init = nnx.initializers.normal(0.02)
    self.tokens = nnx.Embed(cfg.vocab, cfg.dim, dtype=cfg.dtype, embedding_init=init, rngs=rngs)
    self.positions = nnx.Embed(cfg.seq, cfg.dim, dtype=cfg.dtype, embedding_init=init,
                               rngs=rngs)
    self.blocks = nnx.List([Block(cfg, attention, rngs=rngs) for _ in range(cfg.layers)])
    self.ln_final = nnx.LayerNorm(cfg.dim, dtype=cfg.dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array, *, deterministic: bool = False) -> jax.Array:
    """int [B, T] -> float32 logits [B, T, vocab]."""
    x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[-1]))
    for block in self.blocks:
      x = block(x, deterministic=deterministic)
    x = self.ln_final(x)
    table = self.tokens.embedding[...].astype(self.cfg.dtype)
    return jnp.einsum("btd,vd->btv", x, table, preferred_element_type=jnp.float32)


def count_params(model: nnx.Module) -> int:
  """Number of scalar parameters."""
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
