"""jaxflash for `flax.linen`: an ``attention_fn`` hook and the attention modules that use it.

One-line swaps::

    nn.MultiHeadDotProductAttention(..., attention_fn=jaxflash.linen.dot_product_attention)
    jaxflash.linen.MultiHeadDotProductAttention(...)   # same parameters, jaxflash by default

The modules subclass Flax's, so they take the same constructor and call arguments and build the
same parameter tree (a checkpoint of the Flax module loads unchanged); they add ``is_causal`` so
that a causal model needs no dense T x T mask, and ``implementation`` (jaxflash's backend), which
they pass to their ``attention_fn`` as Flax passes its fields.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp

try:
  from flax import linen as nn
  from flax.linen.dtypes import promote_dtype
except ModuleNotFoundError as e:  # Flax is an optional extra
  raise ModuleNotFoundError(
      "jaxflash.linen needs Flax (jaxflash's \"flax\" extra): pip install flax, or from the "
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
    module: nn.Module | None = None,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general: Callable[..., jax.Array] | None = None,
    qk_attn_weights_einsum: Callable[..., jax.Array] | None = None,
    attn_weights_value_einsum: Callable[..., jax.Array] | None = None,
    *,
    is_causal: bool = False,
    implementation: str | Sequence[str] | None = None,
    sinks: jax.Array | None = None,
    fp8: bool | Mapping[str, Any] = False,
    deterministic_backward: bool = True,
) -> jax.Array:
  """`flax.linen.dot_product_attention` computed by jaxflash (same signature, plus ``is_causal``,
  ``implementation``, ``sinks``, ``fp8`` and ``deterministic_backward``).

  Arrays are ``[batch..., length, heads, depth]`` (value may have its own depth, which the
  output takes); ``query`` arrives unscaled and is scaled by ``1 / sqrt(depth)``. ``mask``
  (bool or float, nonzero = attend) and ``bias`` broadcast to
  ``[batch..., heads, q_length, kv_length]``. Dropout (``dropout_rate``, ``dropout_rng``,
  ``deterministic``, ``broadcast_dropout``) runs inside the kernels, with the mask regenerated in
  the backward pass. The softmax is always computed in float32, so ``force_fp32_for_softmax`` is
  honoured by construction. ``is_causal`` adds a causal mask without materialising it.

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

  Requests the kernels cannot serve fall back to Flax's own implementation rather than being
  ignored: ``module`` (sowing the T x S weights), ``precision``, custom einsums or dot_generals,
  a key depth different from the query depth, or non-float inputs. Such a call with an
  ``implementation`` or sinks raises a ValueError instead.

  Query rows that can see no key give zeros (Flax gives the mean of the values there).
  """
  query, key, value = promote_dtype(query, key, value, dtype=dtype)
  sinks = _flax.sinks_for_call(sinks)
  if (module is not None or precision is not None or einsum_dot_general is not None
      or qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None
      or not _flax.kernel_can_serve(query, key, value)):
    why = "weights sown, a precision, custom einsums, or shapes/dtypes the kernels do not take"
    _flax.refuse_fallback(why, implementation=implementation, sinks=sinks, fp8=fp8)
    if is_causal:
      mask = _flax.with_causal_mask(mask, query, key)
    return nn.dot_product_attention(
        query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
        deterministic, dtype, precision, module, force_fp32_for_softmax,
        einsum_dot_general=einsum_dot_general, qk_attn_weights_einsum=qk_attn_weights_einsum,
        attn_weights_value_einsum=attn_weights_value_einsum)
  return _flax.attend(query, key, value, bias, mask, broadcast_dropout=broadcast_dropout,
                      dropout_rng=dropout_rng, dropout_rate=dropout_rate,
                      deterministic=deterministic, is_causal=is_causal,
                      implementation=implementation, sinks=sinks, fp8=fp8,
                      deterministic_backward=deterministic_backward)


class _Jaxflash:
  """What the modules below add to Flax's classes (listed first among their bases, so that these
  methods wrap Flax's):

  - ``__post_init__`` binds the fields ``is_causal`` (not in decode mode, where the cache's
    occupancy mask already is the causal mask for the one query token), ``implementation``,
    ``fp8`` and ``deterministic_backward`` (where not their defaults) into ``attention_fn``,
    which must take them;
  - ``__call__`` runs a decode step (``decode=True``, the cache already made) that passes no
    ``mask`` inside `_flax.cache_step`, where the hook runs `jaxflash.decode_attention` on the
    cache; every other call runs as Flax's. With ``sinks=True`` the hook gets the module's
    ``sinks`` parameter ([num_heads], float32 zeros at init, made by the hook's call inside
    Flax's compact ``__call__``).
  """

  def __post_init__(self):
    if self.sinks:
      _flax.check_takes_module_sinks(self.attention_fn, dot_product_attention, "linen")
    object.__setattr__(self, "attention_fn", _flax.bind_options(
        self.attention_fn, is_causal=True if self.is_causal and not self.decode else None,
        implementation=self.implementation, fp8=_flax.fp8_field(self.fp8),
        deterministic_backward=None if self.deterministic_backward else False))
    super().__post_init__()

  def __call__(self, *args, **kwargs):
    # Flax's classes take the mask as a keyword, or (SelfAttention) second positionally.
    call = inspect.signature(super().__call__).bind_partial(*args, **kwargs)
    with contextlib.ExitStack() as stack:
      if (self.decode and call.arguments.get("mask") is None
          and _flax.hook_of(self.attention_fn) is dot_product_attention
          and self.has_variable("cache", "cached_key")):
        stack.enter_context(_flax.cache_step())
      if self.sinks:
        stack.enter_context(_flax.module_sinks(lambda: self.param(
            "sinks", nn.initializers.zeros_init(), (self.num_heads,), jnp.float32)))
      return super().__call__(*args, **kwargs)


class MultiHeadDotProductAttention(_Jaxflash, nn.MultiHeadDotProductAttention):
  """`flax.linen.MultiHeadDotProductAttention` with jaxflash attention by default.

  Attributes: those of Flax's class, plus
    is_causal: (default False) apply a causal mask inside the kernel, so the model need not
      pass a dense T x T one (a mask that is passed still applies too).
    implementation: (default None) jaxflash's backend, passed to the ``attention_fn`` as in
      `jaxflash.flash_attention`; None lets jaxflash choose.
    sinks: (default False) learnable attention sinks: a ``sinks`` parameter [num_heads]
      (float32, zeros at init) that joins every softmax denominator
      (`jaxflash.flash_attention`'s ``sinks``).
    fp8: (default False) run the attention forward in FP8 (`jaxflash.fp8_attention`; the
      gradient stays 16-bit), passed to the ``attention_fn``, which must take it: True, or a
      mapping of `jaxflash.fp8_attention`'s options as the hook takes it
      (``{"rotation_seed": 0}``).
    deterministic_backward: (default True) False allows a faster backward whose gradients may
      differ in their last bits between runs (`jaxflash.flash_attention`'s ``deterministic``;
      Flax's ``deterministic`` is the dropout switch), passed to the ``attention_fn``.

  With ``decode=True``, a step that passes no ``mask`` runs `jaxflash.decode_attention` on the
  cache (its occupancy gives the lengths): on a GPU, the split-KV decoding kernel.
  """

  attention_fn: Callable[..., jax.Array] = dot_product_attention
  is_causal: bool = False
  implementation: str | Sequence[str] | None = None
  sinks: bool = False
  fp8: bool | Mapping[str, Any] = False
  deterministic_backward: bool = True


class MultiHeadAttention(_Jaxflash, nn.MultiHeadAttention):
  """`flax.linen.MultiHeadAttention` (Flax's alias, named ``MultiHeadAttention_N``) with
  jaxflash attention by default and the options of `MultiHeadDotProductAttention`."""

  attention_fn: Callable[..., jax.Array] = dot_product_attention
  is_causal: bool = False
  implementation: str | Sequence[str] | None = None
  sinks: bool = False
  fp8: bool | Mapping[str, Any] = False
  deterministic_backward: bool = True


class SelfAttention(_Jaxflash, nn.SelfAttention):
  """`flax.linen.SelfAttention` with jaxflash attention by default and the options of
  `MultiHeadDotProductAttention`."""

  attention_fn: Callable[..., jax.Array] = dot_product_attention
  is_causal: bool = False
  implementation: str | Sequence[str] | None = None
  sinks: bool = False
  fp8: bool | Mapping[str, Any] = False
  deterministic_backward: bool = True
