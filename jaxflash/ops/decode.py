"""Decoding against a KV cache: a few new query tokens attend to everything cached before them.

The new tokens of batch row ``b`` sit at absolute positions ``kv_lengths[b] - T ...
kv_lengths[b] - 1`` of the cache (they are already written into it), causal among themselves.
In the terms of the training op that is a causal band whose diagonal is shifted by
``kv_lengths - T`` (`jaxflash.masking`'s query offset), keys limited to ``kv_lengths``: so a
decoding call is a training call with those positions (`decode_inputs`), and any backend serves
it, forward and backward.

Backends may have a split-KV decoding forward (`SplitKV`: Triton's, in
`jaxflash.backends.triton.decode`), which reads each K/V byte once per K/V head and spreads one
long row over the GPU; the backward stays the training backward, whose residuals are the same.

A paged cache (pages ``[num_pages, page_size, K, H]`` and a page table ``[B, pages_per_row]``,
the vLLM / FlashInfer layout) is read where it lies by a split-KV forward whose key blocks can
be the pages (`paged_attention`); the training kernels, and every backward, read the rows the
pages make (`gather_pages`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp

from jaxflash import _core
from jaxflash import fp8
from jaxflash._core import Inputs, Params
from jaxflash.backends.base import Backend
from jaxflash.ops import flash
from jaxflash.ops import partitioning


def gather_pages(pages: jax.Array, page_table: jax.Array, kv_lengths: jax.Array) -> jax.Array:
  """The rows ``[B, pages_per_row * page_size, K, H]`` of a paged cache: row ``b`` is the pages
  ``page_table[b, 0], page_table[b, 1], ...`` one after another. Entries past a row's
  ``kv_lengths`` (int32 [B]) may hold anything (servers pad tables with -1 or the pool's size):
  page 0 stands in for them (its keys lie past the length, never seen), where ``jnp.take``
  would fill an id out of range with NaN, which the masked P V would carry."""
  used = (jnp.arange(page_table.shape[1]) * pages.shape[1])[None, :] < kv_lengths[:, None]
  page_table = jnp.where(used, page_table, jnp.zeros_like(page_table))
  table_spec, pages_spec = _core.explicit_spec(page_table), _core.explicit_spec(pages)
  if table_spec is None and pages_spec is None:
    rows = jnp.take(pages, page_table, axis=0)  # [B, pages_per_row, page_size, K, H]
  else:  # Explicit mesh axes: the rows are sharded like the table's rows and the pages' heads
    table_spec, pages_spec = table_spec or (None,) * 2, pages_spec or (None,) * 4
    pool = jax.sharding.PartitionSpec(None, None, pages_spec[2], None)
    if tuple(pages_spec) != tuple(pool):  # (any row may use any page: the pool is whole)
      pages = jax.reshard(pages, pool)
    rows = pages.at[page_table].get(out_sharding=jax.sharding.PartitionSpec(
        table_spec[0], None, None, pages_spec[2], None))
  b, per_row, page_size = rows.shape[:3]
  return rows.reshape(b, per_row * page_size, *pages.shape[2:])


def decode_inputs(inputs: Inputs, kv_lengths=None) -> Inputs:
  """The training op's inputs for a decoding call whose ``inputs.lengths`` hold (T, kv_length)
  per batch row: query row ``r`` sits at absolute position ``kv_length - T + r``, keys at their
  cache positions. Rows whose position is negative (a row holding fewer tokens than T) see no
  key, and give zeros. ``kv_lengths`` (the caller's, validated) are kept as given too, int32
  (`Inputs.kv_lengths`)."""
  t = inputs.query.shape[1]
  kv_len = inputs.lengths[:, 1]
  raw = None
  if kv_lengths is not None:
    raw = jnp.reshape(jnp.asarray(kv_lengths), kv_len.shape).astype(jnp.int32)
  return inputs._replace(offsets=jnp.stack([kv_len - t, jnp.zeros_like(kv_len)], axis=1),
                         kv_lengths=raw)


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a static argument of the VJP
class SplitKV:
  """A backend's split-KV decoding forward with its training backward, as `jaxflash.ops.flash`
  runs backends (``forward`` and ``backward``). Its config is the kernel's ``DecodeConfig``,
  whose ``training`` field configures the backward."""

  training: Backend
  module: str  # the module with ``forward``, ``unsupported`` and ``default_config``

  @property
  def name(self) -> str:
    return self.training.name

  @property
  def interpreter_partitions(self) -> bool:
    # (Each kernel module says whether its interpreter runs per device: Mosaic GPU's runs only
    # on the whole call, `jaxflash.backends.base.Backend`.)
    return self.training.interpreter_partitions and self.kernel().INTERPRETER_PARTITIONS

  def kernel(self):
    return importlib.import_module(self.module)

  def forward(self, inputs: Inputs, params: Params, config, pages=None):
    """The training forward's ``(out, lse2)``: the kernel's results over the splits of the cache
    (from ``pages`` where given, see `paged_attention`), merged through the LSE."""
    return self.kernel().forward(inputs, params, config, pages)

  def backward(self, inputs: Inputs, params: Params, config, lse2, d_out, delta, want_dbias):
    return self.training.backward(inputs, params, config.training, lse2, d_out, delta,
                                  want_dbias)


TRITON_DECODE = "jaxflash.backends.triton.decode"
MOSAIC_DECODE = "jaxflash.backends.mosaic.decode"  # absorbed MLA's latent cache on sm90


@functools.cache  # one SplitKV per backend: it is hashed by identity as a static argument
def split_kv_for(backend: Backend) -> SplitKV | None:
  """The split-KV decoding path of ``backend``, where it has one (Triton today)."""
  from jaxflash.backends import triton
  if backend is triton.BACKEND:
    return SplitKV(triton.BACKEND, TRITON_DECODE)
  return None


@functools.cache  # (hashed by identity, as `split_kv_for`'s)
def _wide_split_kv(training: Backend, module: str = TRITON_DECODE) -> SplitKV:
  return SplitKV(training, module)


def mosaic_decode_runs(requested, device, params: Params) -> bool:
  """Whether the Mosaic GPU decoding kernel may take a call: Mosaic is among the ``requested``
  backends and the call is compiled for a Hopper GPU. (In interpret mode, on a CPU, wide heads
  keep Triton's kernel, as on GPUs before Hopper; the tests run the Mosaic kernel's
  interpreter on purpose.)"""
  from jaxflash.backends import mosaic
  return mosaic.BACKEND in requested and mosaic.is_hopper(device) and not params.interpret


def split_kv_path(requested, backend: Backend, inputs: Inputs, params: Params,
                  device) -> SplitKV | None:
  """The split-KV forward for a decoding call whose training backend is ``backend`` (the one
  `jaxflash.backends.select` picked among the ``requested`` backends), or None where none
  serves it:
  - the backend's own (Triton's), where its kernel serves the call;
  - for head dims wider than the training kernels take (DeepSeek's absorbed MLA decoding, H 576
    and Dv 512, which only the XLA backend trains), with ``backend``'s backward: on a latent
    cache on a Hopper GPU, the Mosaic GPU kernel (`jaxflash.backends.mosaic.decode`, where
    `mosaic_decode_runs`); else Triton's split-KV kernel, which takes them in column pieces,
    where Triton is among the ``requested`` backends and can run on ``device``;
  - for an FP8 cache (which Triton's training kernels refuse, and which has no backward),
    Triton's split-KV kernel the same way."""
  from jaxflash.backends import triton
  path = split_kv_for(backend)
  if path is None and mosaic_decode_runs(requested, device, params):
    mla = importlib.import_module(MOSAIC_DECODE)
    if mla.unsupported(inputs, params) is None:
      return _wide_split_kv(backend, MOSAIC_DECODE)
  if path is None:
    kernel = importlib.import_module(TRITON_DECODE)
    if not (triton.BACKEND in requested
            and (kernel.is_wide(inputs) or fp8.is_fp8(inputs.query.dtype))
            and triton.runs_on(device, params)):
      return None
    path = _wide_split_kv(backend)
  return path if path.kernel().unsupported(inputs, params) is None else None


def split_kv_serves(inputs: Inputs, params: Params) -> bool:
  """Whether some backend's split-KV kernel can take this call's inputs and options (whether the
  backend runs on this device is for `jaxflash.backends.select` to say)."""
  from jaxflash import backends
  for name in backends.names():
    path = split_kv_for(backends.get(name))
    if path is not None and path.kernel().unsupported(inputs, params) is None:
      return True
  return False


def preference_order() -> tuple[str, ...]:
  """Backend names for a decoding call with ``implementation=None``: those with a split-KV
  forward first, then the registry's order."""
  from jaxflash import backends
  names = backends.names()
  return tuple(sorted(names, key=lambda name: split_kv_for(backends.get(name)) is None))


def paged_attention(path: SplitKV, inputs: Inputs, pages, params: Params, config):
  """``(out [B, T, N, H], natural lse [B, N, T])`` of a decoding call on a paged cache, the
  split-KV forward reading ``pages`` (key pages, value pages, page table) where they lie.

  ``inputs.key`` and ``inputs.value`` are the rows the pages make (`gather_pages`, computed by
  the caller): the backward is the training backward on them, and their gradient reaches the
  pages through the gather, so the pages themselves get none here. Without a backward nothing
  uses the rows, and under jit they are never computed."""
  return _paged(inputs, pages, params, path, config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _paged(inputs, pages, params, path, config):
  out, lse2 = partitioning.paged_forward(path, inputs, pages, params, config)
  return out, _core.user_lse(lse2)


def _paged_fwd(inputs, pages, params, path, config):
  out, lse2 = partitioning.paged_forward(path, inputs, pages, params, config)
  return (out, _core.user_lse(lse2)), (inputs, out, lse2)


def _paged_bwd(params, path, config, residuals, cotangents):
  inputs, out, lse2 = residuals
  if fp8.is_fp8(inputs.query.dtype):
    raise ValueError(flash.FP8_GRADIENT)
  d_out, delta = flash.output_cotangents(out, cotangents)
  dq, dk, dv, _ = flash.backward(path.training, flash.without_sinks(inputs), params,
                                 config.training, lse2, d_out, delta, False)
  return (flash.cotangents_of(inputs, dq, dk, dv, None, lse2=lse2, delta=delta),
          (None, None, None))


_paged.defvjp(_paged_fwd, _paged_bwd)
