"""What the linen and nnx hooks share: turning a Flax attention call into a jaxflash call.

Flax's attention functions take ``[batch..., length, heads, depth]`` arrays with any number of
batch axes (or none), an *unscaled* query, masks that are float or bool (nonzero = attend) and
broadcast to ``[batch..., heads, q_length, kv_length]``, and dropout as ``dropout_rate``,
``dropout_rng``, ``deterministic`` and ``broadcast_dropout``. `attend` maps all of that onto
`jaxflash.flash_attention` (BTNH, one batch axis); the hooks in `jaxflash.linen` and
`jaxflash.nnx` decide first whether the call is one the kernels can serve at all.

One documented difference: a query row whose mask hides every key gets zeros here (and zero
gradients), where Flax's softmax over all-``finfo.min`` logits gives the mean of the values.

Decode mode: within `cache_step` (which jaxflash's modules enter for a decoding step that has no
mask of the caller's), the only mask is Flax's cache-occupancy mask, positions ``0 ...
cache_index`` of each row; `attend` turns it into ``kv_lengths`` and runs
`jaxflash.decode_attention`, the split-KV decoding kernel where there is one.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash._checks import check_flag
from jaxflash.attention import decode_attention, flash_attention, fp8_attention
from jaxflash.fp8 import random_rotation

_CACHE_STEP = contextvars.ContextVar("jaxflash_flax_cache_step", default=False)
# A module with ``sinks=True`` sets this, around its call, to a function that returns its sinks
# parameter; the hook calls it there. Linen then creates the parameter inside the module's own
# compact ``__call__`` (the one place Flax allows it), and nnx reads its `nnx.Param`.
_MODULE_SINKS = contextvars.ContextVar("jaxflash_flax_module_sinks", default=None)


@contextlib.contextmanager
def cache_step() -> Iterator[None]:
  """Marks the attention calls inside as a Flax decode step whose mask is the cache's occupancy
  mask and nothing else (the modules check that before entering)."""
  token = _CACHE_STEP.set(True)
  try:
    yield
  finally:
    _CACHE_STEP.reset(token)


@contextlib.contextmanager
def module_sinks(get_sinks) -> Iterator[None]:
  """Makes ``get_sinks()`` (the calling module's sinks parameter, [num_heads]) the sinks of the
  hook calls inside (`sinks_for_call`)."""
  token = _MODULE_SINKS.set(get_sinks)
  try:
    yield
  finally:
    _MODULE_SINKS.reset(token)


def sinks_for_call(sinks: jax.Array | None) -> jax.Array | None:
  """The sinks a hook call uses: its own ``sinks`` argument, else its module's, else None."""
  if sinks is not None:
    return sinks
  get_sinks = _MODULE_SINKS.get()
  return None if get_sinks is None else get_sinks()


def check_takes_module_sinks(attention_fn, hook, flavour: str) -> None:
  """A module with ``sinks=True`` passes its sinks only to jaxflash's hooks (``hook``, or a
  `ring_attention_fn`): any other ``attention_fn`` would silently train without them."""
  fn = hook_of(attention_fn)
  if fn is not hook and not getattr(fn, "takes_module_sinks", False):
    raise ValueError(f"sinks=True needs jaxflash's attention_fn (jaxflash.{flavour}."
                     f"dot_product_attention or ring_attention_fn), got {attention_fn!r}")


def _occupancy_lengths(mask: jax.Array, batch_shape: tuple[int, ...], s: int) -> jax.Array | None:
  """[B] int32 ``kv_lengths`` from Flax's decode mask ``[batch..., 1, 1, S]`` (ones on a prefix
  of each row), or None where the mask has another shape."""
  mask = jnp.asarray(mask)
  if mask.ndim != len(batch_shape) + 3 or mask.shape[-3:] != (1, 1, s):
    return None
  rows = jnp.broadcast_to(mask, batch_shape + (1, 1, s)).reshape(math.prod(batch_shape), s)
  return jnp.sum(rows != 0, axis=-1, dtype=jnp.int32)


def _to_bnts(x: jax.Array | None, batch_shape: tuple[int, ...], as_bool: bool):
  """A Flax mask/bias broadcastable to [batch..., N, T, S] -> [B or 1, N or 1, T or 1, S or 1]."""
  if x is None:
    return None
  x = jnp.asarray(x)
  if as_bool and x.dtype != jnp.bool_:
    x = x != 0  # Flax masks are float32 by default: nonzero means "attend"
  full_rank = len(batch_shape) + 3
  if x.ndim > full_rank:
    raise ValueError(f"{'mask' if as_bool else 'bias'} has rank {x.ndim}, more than the "
                     f"{full_rank} of [batch..., heads, q_length, kv_length]")
  x = x.reshape((1,) * (full_rank - x.ndim) + x.shape)
  lead = x.shape[:len(batch_shape)]
  if all(d == 1 for d in lead):
    return x.reshape((1,) + x.shape[len(batch_shape):])
  x = jnp.broadcast_to(x, batch_shape + x.shape[len(batch_shape):])
  return x.reshape((math.prod(batch_shape),) + x.shape[len(batch_shape):])


def attend(query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
           mask: jax.Array | None, *, broadcast_dropout: bool, dropout_rng: jax.Array | None,
           dropout_rate: float, deterministic: bool, is_causal: bool,
           implementation=None, sinks: jax.Array | None = None,
           fp8: bool | Mapping[str, Any] = False,
           deterministic_backward: bool = True) -> jax.Array:
  """Flax-convention attention through `jaxflash.flash_attention` (arrays already promoted);
  ``implementation`` and ``sinks`` as there, ``deterministic_backward`` its ``deterministic``
  (Flax's ``deterministic`` turns dropout off); with ``fp8`` through `jaxflash.fp8_attention`
  (an FP8 forward, a 16-bit gradient; a decoding step stays 16-bit), given `fp8_options`."""
  fp8_call = fp8_options(fp8)
  batch_shape = query.shape[:-3]
  if key.shape[:-3] != batch_shape or value.shape[:-3] != batch_shape:
    # Flattening mismatched batch dims would pair queries with the wrong rows (or fail to
    # reshape); Flax refuses them too.
    raise ValueError(f"query, key and value must have the same batch dims "
                     f"[batch..., length, heads, depth], got query {query.shape}, key "
                     f"{key.shape} and value {value.shape}")
  b = math.prod(batch_shape)
  q = query.reshape((b,) + query.shape[-3:])
  k = key.reshape((b,) + key.shape[-3:])
  v = value.reshape((b,) + value.shape[-3:])
  rate = 0.0 if deterministic else float(dropout_rate)
  if rate > 0.0 and dropout_rng is None:
    raise ValueError("dropout_rng is required when dropout_rate > 0 and deterministic=False")
  if (_CACHE_STEP.get() and mask is not None and bias is None and rate == 0.0 and not is_causal
      and q.shape[1] == 1):
    lengths = _occupancy_lengths(mask, batch_shape, k.shape[1])
    if lengths is not None:
      out = decode_attention(q, k, v, lengths, sinks=sinks, implementation=implementation)
      return out.reshape(query.shape[:-1] + value.shape[-1:])
  attention = flash_attention
  if fp8_call is not None:
    seed = fp8_call.pop("rotation_seed", None)
    if seed is not None:  # (a constant of the trace: XLA folds it)
      fp8_call["rotation"] = random_rotation(jax.random.key(seed), q.shape[-1])
    attention = functools.partial(fp8_attention, **fp8_call)
  out = attention(
      q, k, v, bias=_to_bnts(bias, batch_shape, as_bool=False),
      mask=_to_bnts(mask, batch_shape, as_bool=True), is_causal=is_causal,
      dropout_rate=rate, dropout_rng=dropout_rng if rate > 0.0 else None,
      broadcast_dropout=broadcast_dropout, sinks=sinks, implementation=implementation,
      deterministic=check_flag(deterministic_backward, "deterministic_backward"))
  return out.reshape(query.shape[:-1] + value.shape[-1:])


# What a Flax hook's ``fp8`` may set of `jaxflash.fp8_attention`'s options: static values,
# which a module's field holds as Flax's other options. No arrays: the rotation comes as the
# seed of `jaxflash.random_rotation`'s key, the matrix made for the call's head dim.
FP8_OPTIONS = ("block_size", "backward", "fp8_dtype", "rotation_seed")


def fp8_options(fp8) -> dict | None:
  """A hook's ``fp8``: False gives None (a 16-bit forward), True the FP8 forward with
  `jaxflash.fp8_attention`'s defaults ({}), and a mapping those of its options it names
  (`FP8_OPTIONS`; ``{"rotation_seed": 0}``: FlashAttention-3's incoherent processing with
  ``random_rotation(jax.random.key(0), head_dim)``, the accurate form on outlier features)."""
  if isinstance(fp8, Mapping):
    unknown = sorted(set(fp8) - set(FP8_OPTIONS))
    if unknown:
      raise ValueError(f"fp8 takes the options {FP8_OPTIONS} of jaxflash.fp8_attention, got "
                       f"{unknown}")
    seed = fp8.get("rotation_seed")
    if seed is not None and (isinstance(seed, (bool, np.bool_))
                             or not isinstance(seed, (int, np.integer))):
      raise ValueError(f"fp8's rotation_seed must be an int (a PRNG key's seed), got {seed!r}")
    return dict(fp8)
  if not isinstance(fp8, (bool, np.bool_)):
    raise ValueError(f"fp8 must be a bool or a mapping of jaxflash.fp8_attention's options "
                     f"{FP8_OPTIONS}, got {fp8!r}")
  return {} if fp8 else None


class FrozenOptions(Mapping):
  """A module's ``fp8`` mapping as it keeps it: read-only and hashable, as Flax's static
  fields must be (an nnx module's are its GraphDef, which ``jax.jit(static_argnums=...)``
  hashes; a dict made that a TypeError)."""

  def __init__(self, options: Mapping[str, Any]):
    self._options = dict(options)

  def __getitem__(self, name: str) -> Any:
    return self._options[name]

  def __iter__(self):
    return iter(self._options)

  def __len__(self) -> int:
    return len(self._options)

  def __hash__(self) -> int:
    return hash(tuple(sorted(self._options.items())))

  def __repr__(self) -> str:
    return repr(self._options)


def frozen_fp8(fp8):
  """A module's ``fp8`` field as it keeps it: a mapping frozen (`FrozenOptions`), else as is."""
  return FrozenOptions(fp8) if isinstance(fp8, Mapping) else fp8


def fp8_field(fp8):
  """What a module binds into its ``attention_fn`` for its ``fp8`` field: None where off (the
  hook's default), else the field as given (checked)."""
  return None if fp8_options(fp8) is None else fp8


def refuse_fallback(why: str, *, implementation=None, sinks=None,
                    fp8: bool | Mapping[str, Any] = False) -> None:
  """A hook that falls back to Flax's own attention (``why``) cannot honour what only jaxflash
  does: a requested backend, sinks or the FP8 forward raise a ValueError naming the option,
  rather than being dropped silently."""
  if implementation is not None:
    raise ValueError(f"implementation={implementation!r} asks for a jaxflash backend, but this "
                     f"call falls back to Flax's own attention ({why}); drop implementation= "
                     "(or the option that needs the fallback)")
  if sinks is not None:
    raise ValueError(f"sinks need jaxflash's kernels, but this call falls back to Flax's own "
                     f"attention ({why})")
  if fp8_options(fp8) is not None:
    raise ValueError(f"fp8={fp8!r} asks for jaxflash's FP8 forward, but this call falls back "
                     f"to Flax's own attention ({why})")


def hook_of(attention_fn) -> object:
  """The function inside an ``attention_fn`` that the modules wrapped in `functools.partial`
  (binding ``is_causal`` or ``implementation``): compared against the jaxflash hook."""
  while isinstance(attention_fn, functools.partial):
    attention_fn = attention_fn.func
  return attention_fn


def bind_options(attention_fn, **options):
  """``attention_fn`` with the options that are not None bound as keywords (a module field
  passed to its hook, as Flax passes its fields), after checking that it takes them."""
  options = {name: value for name, value in options.items() if value is not None}
  if not options:
    return attention_fn
  parameters = inspect.signature(attention_fn).parameters
  takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())
  for name in options:
    if name not in parameters and not takes_any:
      raise ValueError(f"{name}={options[name]!r} needs an attention_fn that takes `{name}`, "
                       f"got {attention_fn!r}")
  return functools.partial(attention_fn, **options)


def with_causal_mask(mask: jax.Array | None, query: jax.Array, key: jax.Array) -> jax.Array:
  """``mask`` AND a top-left causal [T, S] mask, for the fallback paths (which need it dense)."""
  t, s = query.shape[-3], key.shape[-3]
  causal = jnp.tril(jnp.ones((t, s), bool)).reshape((1,) * (query.ndim - 2) + (t, s))
  return causal if mask is None else jnp.logical_and(mask, causal)


def kernel_can_serve(query: jax.Array, key: jax.Array, value: jax.Array) -> bool:
  """Shapes and dtypes the kernels take: float16/bfloat16/float32, equal q/k depth (the value's
  may differ), key and value alike but for their depth, whole GQA groups."""
  if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
    return False
  if query.dtype not in (jnp.float16, jnp.bfloat16, jnp.float32):
    return False
  if not all(isinstance(d, int) for d in query.shape[-3:] + key.shape[-3:]):
    return False  # a symbolic length or head count (jax.export): kernels are tiled by them
  if query.shape[-1] != key.shape[-1] or key.shape[:-1] != value.shape[:-1]:
    return False
  return query.shape[-2] % key.shape[-2] == 0


def ring_attention_fn(axis_name: str, *, layout: str = "contiguous", is_causal: bool = False,
                      mask_mod=None):
  """A Flax ``attention_fn`` (linen or nnx) that runs `jaxflash.ring_attention` over the mesh axis
  ``axis_name``: pass it to a module whose call runs inside `jax.shard_map` with the sequence
  split along that axis, and each device attends its chunk of queries to the whole sequence.

  ``layout`` and ``mask_mod`` (`jaxflash.ring_attention`'s: positions in the whole sequence;
  its batch index runs over the module's batch dims flattened) are fixed here; the attention
  is causal where ``is_causal`` here or the module's (a field, or nnx's call argument) says so.
  A module's ``implementation`` and sinks (``sinks=True``) are passed on; its
  ``deterministic_backward=False`` changes nothing (the ring's backward is deterministic), and
  ``fp8`` is refused (the ring takes FP8 chunks only from `jaxflash.ring_attention`'s own
  descales). A ``mask`` or ``bias`` is refused (a dense [T, S] array is what the ring exists
  to avoid; use ``is_causal``, a ``mask_mod``, or `jaxflash.ring_attention`'s ``segment_ids``
  and ``local_window_size`` directly). Dropout is Flax's: ``dropout_rate``, ``dropout_rng``,
  ``deterministic`` and ``broadcast_dropout``. Other keywords are a TypeError (until
  2026-12-04 they were dropped, a module's ``is_causal`` among them: its ring ran unmasked).
  """
  from jaxflash.attention import ring_attention
  ring_causal = is_causal

  def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                   dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                   precision=None, module=None, promote_dtype=None, is_causal=False,
                   implementation=None, fp8=False, deterministic_backward=True):
    # (The kernels' own precision and dtypes; no weights to sow; a deterministic backward.)
    del precision, module, promote_dtype, deterministic_backward
    if bias is not None or mask is not None:
      raise ValueError("ring_attention_fn takes no mask or bias: build it with is_causal=True "
                       "for a causal mask, or call jaxflash.ring_attention directly")
    if fp8:
      raise ValueError("ring_attention_fn runs no FP8 forward of a module's (fp8=...): pass "
                       "FP8 chunks and their descales to jaxflash.ring_attention directly")
    if dtype is not None:
      query, key, value = (x.astype(dtype) for x in (query, key, value))
    batch_shape = query.shape[:-3]
    b = math.prod(batch_shape)
    q, k, v = (x.reshape((b,) + x.shape[-3:]) for x in (query, key, value))
    rate = 0.0 if deterministic else float(dropout_rate)
    out = ring_attention(q, k, v, axis_name=axis_name, layout=layout,
                         is_causal=bool(ring_causal or is_causal), mask_mod=mask_mod,
                         dropout_rate=rate, dropout_rng=dropout_rng if rate > 0.0 else None,
                         broadcast_dropout=broadcast_dropout, sinks=sinks_for_call(None),
                         implementation=implementation)
    return out.reshape(query.shape[:-1] + value.shape[-1:])

  attention_fn.takes_module_sinks = True
  return attention_fn
