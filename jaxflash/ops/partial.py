"""Partial results over key ranges and their exact merge through the LSE.

Attention over disjoint key ranges can be computed one range at a time, as *partial* results
(float32 outputs normalised over the range's keys, and their LSEs), and merged exactly through
the LSEs by `merge` (defined in `jaxflash.merge`, below the ops and the backends, and exported
here). Split-KV decoding merges the splits of one cache this way, and ring attention the key
chunks that travel around the ring.

The backward needs no partial outputs: with the *global* LSE and delta = rowsum(dO * O) of the
merged output, each range's backward returns exactly its share (dQ summed over ranges, dK/dV of
its own keys). `split_keys_attention` is that whole scheme on one device, as a differentiable
call; it is what the tests check against the unsplit call.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash import _core
from jaxflash import block_mask
from jaxflash import fp8
from jaxflash._core import Inputs, Params
from jaxflash.merge import merge
from jaxflash.merge import with_sinks
from jaxflash.ops import flash

__all__ = ["merge", "with_sinks", "key_range", "split_keys_attention"]


def key_range(inputs: Inputs, start: int, stop: int,
              table_block: tuple[int, int] | None = None) -> Inputs:
  """The inputs of the same call restricted to keys ``[start, stop)`` (static ints).

  K/V, key segment ids, the key axis of mask and bias, a mask_mod's and a score_mod's key
  features, and an FP8 call's per-key descale factors are sliced, and the block table is
  made for the range's keys (`jaxflash.block_mask.key_range`; ``table_block``: its block
  sizes); key lengths are shifted into the range and the key offset moves by ``start``, so
  the band, the dropout mask and the rules see every key at the absolute position it had in
  the whole call.
  """
  def keys(x, axis):
    return None if x is None else lax.slice_in_dim(x, start, stop, axis=axis)

  b = inputs.query.shape[0]
  kv_len = jnp.clip(inputs.lengths[:, 1] - start, 0, stop - start)
  offsets = inputs.offsets if inputs.offsets is not None else jnp.zeros((b, 2), jnp.int32)
  k_descale = inputs.k_descale
  if fp8.per_token(k_descale):  # [B, S, K]
    k_descale = keys(k_descale, 1)
  # A dense mask's words along the keys are sliced where the range starts at a word; else
  # (None) the backend packs the range's keys again. Bits of the last word past ``stop`` lie
  # past the range's key length: no kernel reads them as visible.
  mask_words = inputs.mask_words
  if mask_words is not None:
    mask_words = (lax.slice_in_dim(mask_words, start // 32, -(-stop // 32), axis=2)
                  if start % 32 == 0 else None)
  table = inputs.block_table
  if table is not None:
    table = block_mask.key_range(table, table_block[1], start, stop)
  return inputs._replace(
      block_table=table, kv_features=keys(inputs.kv_features, 3),
      score_kv_features=keys(inputs.score_kv_features, 3),
      key=keys(inputs.key, 1), value=keys(inputs.value, 1), k_descale=k_descale,
      kv_segment_ids=keys(inputs.kv_segment_ids, 1), mask=keys(inputs.mask, 3),
      mask_words=mask_words, mask_words_t=keys(inputs.mask_words_t, 3),
      bias=keys(inputs.bias, 3), lengths=inputs.lengths.at[:, 1].set(kv_len),
      offsets=offsets.at[:, 1].add(start))


def _ranges(boundaries: tuple[int, ...], s: int) -> list[tuple[int, int]]:
  edges = (0,) + tuple(boundaries) + (s,)
  return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def split_keys_attention(inputs: Inputs, params: Params, backend, config,
                         boundaries: tuple[int, ...]):
  """Attention with the keys split at ``boundaries`` (static, increasing, inside (0, S)): one
  partial forward per range, merged; one backward per range with the global LSE and delta.

  Returns ``(out, natural lse [B, N, T])`` like `flash.attention`, equal to it up to rounding.
  """
  out, lse2 = _split_forward(inputs, params, backend, config, boundaries)
  return out, _core.user_lse(lse2)


def _split_forward(inputs, params, backend, config, boundaries):
  partial_params = dataclasses.replace(params, partial=True)
  outs, lses = [], []
  ranged = flash.without_sinks(inputs)
  for start, stop in _ranges(boundaries, inputs.key.shape[1]):
    out, lse2 = flash.forward(backend, key_range(ranged, start, stop, params.table_block),
                              partial_params, config)
    outs.append(out)
    lses.append(jnp.swapaxes(_core.user_lse(lse2), 1, 2))  # [B, T, N], like the outputs
  out, lse = with_sinks(*merge(outs, lses), inputs.sinks)
  out = out if params.partial else out.astype(params.output_dtype(inputs))
  return out, _core.base2_lse(jnp.swapaxes(lse, 1, 2))


def _split_fwd(inputs, params, backend, config, boundaries):
  want_dbias = inputs.bias is not None and inputs.bias.perturbed
  inputs = flash.primal_values(inputs)
  out, lse2 = _split_forward(inputs, params, backend, config, boundaries)
  return (out, _core.user_lse(lse2)), (inputs, out, lse2, want_dbias)


def _split_bwd(params, backend, config, boundaries, residuals, cotangents):
  inputs, out, lse2, want_dbias = residuals
  # delta of the merged output: the same for every range.
  d_out, delta = flash.output_cotangents(out, cotangents)
  partial_params = dataclasses.replace(params, partial=True)  # float32 shares, summed below
  dq, dks, dvs, dbiases = 0.0, [], [], []
  ranged = flash.without_sinks(inputs)
  for start, stop in _ranges(boundaries, inputs.key.shape[1]):
    share = flash.backward(backend, key_range(ranged, start, stop, params.table_block),
                           partial_params, config, lse2, d_out, delta, want_dbias)
    dq = dq + share[0]
    dks.append(share[1])
    dvs.append(share[2])
    dbiases.append(share[3])
  dbias = jnp.concatenate(dbiases, axis=3) if want_dbias else None
  return (flash.cotangents_of(inputs, dq, jnp.concatenate(dks, axis=1),
                              jnp.concatenate(dvs, axis=1), dbias, lse2=lse2, delta=delta),)


split_keys_attention.defvjp(_split_fwd, _split_bwd, symbolic_zeros=True)
