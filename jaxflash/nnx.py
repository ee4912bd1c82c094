"""jaxflash for `flax.nnx`: an ``attention_fn`` hook and the attention module that uses it.

One-line swaps::

    nnx.MultiHeadAttention(..., attention_fn=jaxflash.nnx.dot_product_attention, rngs=rngs)
    jaxflash.nnx.MultiHeadAttention(..., rngs=rngs)   # same parameters, jaxflash by default

``nnx.MultiHeadAttention`` passes every keyword to its ``attention_fn`` (``module``,
``is_causal`` since flax 0.12.8, ...), so the hook takes them all; call the module with
``is_causal=True`` for causal attention without a dense T x T mask. Grouped-query attention
(``num_kv_heads``) runs natively: the kernels index K/V heads, never repeat them. The hook's
``implementation`` keyword (and the module's constructor argument of that name, bound into its
``attention_fn``) picks jaxflash's backend as in `jaxflash.flash_attention`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp

try:
  from flax import nnx
  from flax.nnx.nn.dtypes import promote_dtype as _flax_promote_dtype
except ModuleNotFoundError as e:  # Flax is an optional extra
  raise ModuleNotFoundError(
      "jaxflash.nnx needs Flax (jaxflash's \"flax\" extra): pip install flax, or from the "
      "jaxflash repository pip install -e \".[flax]\"") from e

from jaxflash import _flax
from jaxflash._flax import ring_attention_fn  # noqa: F401 (re-exported: the ring as an attention_fn)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any | None = None,
    precision: Any = None,
    module: nnx.Module | None = None,
    promote_dtype: Callable[..., Any] = _flax_promote_dtype,
    is_causal: bool = False,
    implementation: str | Sequence[str] | None = None,
    sinks: jax.Array | None = None,
    fp8: bool | Mapping[str, Any] = False,
    deterministic_backward: bool = True,
    **kwargs: Any,
) -> jax.Array:
  """`flax.nnx.dot_product_attention` computed by jaxflash (same signature, plus
  ``implementation``, ``sinks``, ``fp8``, ``deterministic_backward`` and ``**kwargs``).

  Arrays are ``[batch..., length, heads, depth]`` (key/value may have fewer heads: GQA; value
  may have its own depth, which the output takes); ``query`` arrives unscaled and is scaled by
  ``1 / sqrt(depth)``. ``mask`` (bool or float, nonzero = attend) and ``bias`` broadcast to
  ``[batch..., heads, q_length, kv_length]``.
  Dropout (``dropout_rate``, ``dropout_rng``, ``deterministic``, ``broadcast_dropout``) runs
  inside the kernels. ``is_causal`` applies a causal mask without materialising it.
  ``implementation`` picks jaxflash's backend as in `jaxflash.flash_attention` (``"mosaic"``,
  ``"triton"``, ``"xla"``: jaxflash's blockwise one, or a sequence of them); None lets jaxflash
  choose. ``sinks`` (float [heads]) are attention sinks as in `jaxflash.flash_attention`; a
  module made with ``sinks=True`` passes its own. ``fp8=True`` runs the forward in FP8 through
  `jaxflash.fp8_attention` (the gradient stays 16-bit; bind it with ``functools.partial`` to
  make an ``attention_fn``), with its defaults; a mapping sets its options ``block_size``,
  ``backward`` and ``fp8_dtype``, and ``rotation_seed`` (an int) its ``rotation``:
  ``random_rotation(jax.random.key(seed), depth)``. ``fp8={"rotation_seed": 0}`` is the
  accurate form on inputs with outlier features (docs/fp8.md). ``deterministic_backward=False`` is
  `jaxflash.flash_attention`'s ``deterministic=False`` (gradients that may differ in their last
  bits between runs, where a faster backward adds them with atomics); Flax's own ``deterministic``
  turns dropout off.

  Falls back to Flax's own implementation for what the kernels cannot serve: ``module``
  (sowing the T x S weights), ``precision``, a key depth different from the query depth, or
  non-float inputs (with an ``implementation``, such a call raises a ValueError). Other
  keywords that nnx may pass (e.g. ``input_positions``) are accepted when None and refused with
  a TypeError otherwise, since Flax's default function has no use for them either.

  Query rows that can see no key give zeros (Flax gives the mean of the values there).
  """
  unknown = sorted(name for name, val in kwargs.items() if val is not None)
  if unknown:
    raise TypeError(f"jaxflash.nnx.dot_product_attention got unsupported keywords {unknown}")
  query, key, value = promote_dtype((query, key, value), dtype=dtype)
  sinks = _flax.sinks_for_call(sinks)
  if module is not None or precision is not None or not _flax.kernel_can_serve(query, key,
                                                                                 value):
    why = "weights sown, a precision, or shapes/dtypes the kernels do not take"
    _flax.refuse_fallback(why, implementation=implementation, sinks=sinks, fp8=fp8)
    return nnx.dot_product_attention(
        query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
        deterministic, dtype, precision, module, promote_dtype=promote_dtype,
        is_causal=is_causal)
  return _flax.attend(query, key, value, bias, mask, broadcast_dropout=broadcast_dropout,
                      dropout_rng=dropout_rng, dropout_rate=dropout_rate,
                      deterministic=deterministic, is_causal=is_causal,
                      implementation=implementation, sinks=sinks, fp8=fp8,
                      deterministic_backward=deterministic_backward)


class MultiHeadAttention(nnx.MultiHeadAttention):
  """`flax.nnx.MultiHeadAttention` with jaxflash attention by default.

  Same constructor, call signature and parameter tree as Flax's class; the default of
  ``attention_fn`` differs, and ``implementation`` (default None: jaxflash chooses) is bound
  into the ``attention_fn``, which must take it. In decode mode, a step that passes no
  ``mask`` runs `jaxflash.decode_attention` on the cache (its occupancy gives the lengths): on
  a GPU, the split-KV decoding kernel, reading each K/V head once for its whole query group.
  With ``sinks=True`` it holds learnable attention sinks, ``self.sinks``: an `nnx.Param`
  [num_heads] (float32 zeros at first) that joins every softmax denominator
  (`jaxflash.flash_attention`'s ``sinks``); otherwise ``self.sinks`` is None. With
  ``fp8=True`` the attention forward runs in FP8 (`jaxflash.fp8_attention`; the gradient stays
  16-bit; a mapping of its options, as the hook takes it, e.g. ``{"rotation_seed": 0}``); it is
  bound into the ``attention_fn`` like ``implementation``, and so is
  ``deterministic_backward=False`` (`jaxflash.flash_attention`'s ``deterministic=False``: a
  faster backward whose gradients may differ in their last bits between runs).
  """

  def __init__(self, *args: Any, attention_fn: Callable[..., jax.Array] = dot_product_attention,
               implementation: str | Sequence[str] | None = None, sinks: bool = False,
               fp8: bool | Mapping[str, Any] = False, deterministic_backward: bool = True,
               **kwargs: Any):
    if sinks:
      _flax.check_takes_module_sinks(attention_fn, dot_product_attention, "nnx")
    attention_fn = _flax.bind_options(
        attention_fn, implementation=implementation, fp8=_flax.fp8_field(fp8),
        deterministic_backward=None if deterministic_backward else False)
    super().__init__(*args, attention_fn=attention_fn, **kwargs)
    self.implementation = implementation
    self.fp8 = _flax.frozen_fp8(fp8)
    self.deterministic_backward = deterministic_backward
    self.sinks = nnx.Param(jnp.zeros((self.num_heads,), jnp.float32)) if sinks else None

  def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
    if self.sinks is None:
      return self._call(*args, **kwargs)
    with _flax.module_sinks(lambda: self.sinks[...]):
      return self._call(*args, **kwargs)

  def _call(self, *args: Any, **kwargs: Any) -> jax.Array:
    decode = kwargs.get("decode")
    decode = self.decode if decode is None else decode
    if decode and kwargs.get("is_causal"):
      # The cache's occupancy mask is already causal, and a causal band for one query row
      # against the cache would keep key 0 alone. Flax 0.12.12 drops ``is_causal`` in decode
      # mode itself; older versions passed it on (seen on the GPU machine's Flax, 2026-11-23).
      kwargs = dict(kwargs, is_causal=False)
    if (decode and kwargs.get("mask") is None
        and _flax.hook_of(self.attention_fn) is dot_product_attention):
      with _flax.cache_step():
        return super().__call__(*args, **kwargs)
    return super().__call__(*args, **kwargs)
