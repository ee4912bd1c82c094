"""Partial results over key ranges and their exact merge through the LSE.

Attention over keys ``K = K_1 ∪ ... ∪ K_m`` (disjoint) can be computed one range at a time: range
``i`` gives its *partial* output ``O_i`` (float32, normalised over ``K_i`` only) and its logsumexp
``L_i``. Then

    L = log(sum_i exp(L_i)),    O = sum_i exp(L_i - L) * O_i,

which is exact (no approximation beyond float32 rounding); a range a row cannot see has
``L_i = -inf`` and weight 0. Split-KV decoding merges the splits of one cache this way, and ring
attention the key chunks that travel around the ring.

The backward needs no partial outputs: with the *global* LSE and delta = rowsum(dO * O) of the
merged output, each range's backward returns exactly its share (dQ summed over ranges, dK/dV of
its own keys). `split_keys_attention` is that whole scheme on one device, as a differentiable
call; it is what the tests check against the unsplit call.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash import _core
from jaxflash._core import Inputs, Params
from jaxflash.ops import flash


def merge(outs: Sequence[jax.Array] | jax.Array,
          lses: Sequence[jax.Array] | jax.Array, axis: int = 0) -> tuple[jax.Array, jax.Array]:
  """Merges partial results of disjoint key ranges of the same queries.

  Args:
    outs: partial outputs, each float32 [..., T, N, H] and normalised over its own keys (zeros
      on rows that see none of them); a sequence, or one array with the ranges on axis ``axis``
      (a split-KV kernel's output).
    lses: their natural-log LSEs, each [..., T, N] (``-inf`` on rows that see no key), likewise.
    axis: the ranges' axis in arrays (of ``lses``; ``outs`` has one more, trailing, axis).
      A sequence holds one range per element.

  Returns:
    ``(out, lse)``: the output over all the keys (float32) and its LSE; rows that see no key in
    any range get zeros and ``-inf``; a NaN in a partial stays NaN in both. Differentiable,
    without NaN for empty partials.
  """
  count = lambda xs: xs.shape[axis] if isinstance(xs, jax.Array) else len(xs)  # noqa: E731
  if count(outs) != count(lses) or count(outs) == 0:
    raise ValueError(f"merge needs one LSE per partial output and at least one of each, got "
                     f"{count(outs)} outputs and {count(lses)} LSEs")
  if count(outs) <= MERGE_UNROLLED:  # range by range, in elementwise ops only
    lses = [lse.astype(jnp.float32) for lse in _each_range(lses, axis)]
    top = _finite(functools.reduce(jnp.maximum, lses))
    weights = [jnp.exp(lse - top) for lse in lses]  # exp(-inf) = 0 for empty ranges
    total = functools.reduce(jnp.add, weights)
    weighted = functools.reduce(jnp.add, [w[..., None] * out.astype(jnp.float32)
                                          for w, out in zip(weights, _each_range(outs, axis))])
  else:  # stacked on the ranges' axis and reduced over it
    stack = lambda xs: jnp.asarray(xs if isinstance(xs, jax.Array) else jnp.stack(xs))  # noqa: E731
    lse = stack(lses).astype(jnp.float32)
    top = _finite(jnp.max(lse, axis=axis))
    weights = jnp.exp(lse - jnp.expand_dims(top, axis))
    total = jnp.sum(weights, axis=axis)
    weighted = jnp.sum(weights[..., None] * stack(outs).astype(jnp.float32), axis=axis)
  seen = total != 0.0  # (a NaN partial makes the total NaN: it stays NaN, out and LSE)
  merged_lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
  return weighted / jnp.where(seen, total, 1.0)[..., None], merged_lse


def _each_range(xs, axis: int) -> list:
  """The ranges of a sequence, or of an array along ``axis``, as a list."""
  if not isinstance(xs, jax.Array):
    return list(xs)
  return [lax.index_in_dim(xs, i, axis, keepdims=False) for i in range(xs.shape[axis])]


def _finite(top: jax.Array) -> jax.Array:
  """The ranges' largest LSE as the exponentials' shift; where every range is empty (-inf),
  any finite shift will do."""
  return jnp.where(jnp.isfinite(top), top, 0.0)


# Up to this many ranges `merge` works range by range in elementwise ops, which XLA fuses into
# one or two kernels; reductions over a stacked ranges' axis each end a fusion. (H200,
# 2026-11-23, split-KV decoding's merge, `decode_h200_2026-11-23/waves/11_merge_unrolled.json`,
# GPU time per call: 2 to 8 splits ran as one kernel of 1.4-1.9 µs instead of two or three of
# 2.9-4.4 µs in all; 12 and 33 splits as two kernels, 3.2-5.1 µs instead of three, 4.1-5.2.)
MERGE_UNROLLED = 64


def key_range(inputs: Inputs, start: int, stop: int) -> Inputs:
  """The inputs of the same call restricted to keys ``[start, stop)`` (static ints).

  K/V, key segment ids and the key axis of mask and bias are sliced; key lengths are shifted
  into the range and the key offset moves by ``start``, so the band and the dropout mask see
  every key at the absolute position it had in the whole call.
  """
  def keys(x, axis):
    return None if x is None else lax.slice_in_dim(x, start, stop, axis=axis)

  b = inputs.query.shape[0]
  kv_len = jnp.clip(inputs.lengths[:, 1] - start, 0, stop - start)
  offsets = inputs.offsets if inputs.offsets is not None else jnp.zeros((b, 2), jnp.int32)
  return inputs._replace(
      key=keys(inputs.key, 1), value=keys(inputs.value, 1),
      kv_segment_ids=keys(inputs.kv_segment_ids, 1), mask=keys(inputs.mask, 3),
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
  for start, stop in _ranges(boundaries, inputs.key.shape[1]):
    out, lse2 = flash.forward(backend, key_range(inputs, start, stop), partial_params, config)
    outs.append(out)
    lses.append(jnp.swapaxes(_core.user_lse(lse2), 1, 2))  # [B, T, N], like the outputs
  out, lse = merge(outs, lses)
  out = out if params.partial else out.astype(inputs.query.dtype)
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
  for start, stop in _ranges(boundaries, inputs.key.shape[1]):
    share = flash.backward(backend, key_range(inputs, start, stop), partial_params, config,
                           lse2, d_out, delta, want_dbias)
    dq = dq + share[0]
    dks.append(share[1])
    dvs.append(share[2])
    dbiases.append(share[3])
  dbias = jnp.concatenate(dbiases, axis=3) if want_dbias else None
  return (flash.cotangents_of(inputs, dq, jnp.concatenate(dks, axis=1),
                              jnp.concatenate(dvs, axis=1), dbias),)


split_keys_attention.defvjp(_split_fwd, _split_bwd, symbolic_zeros=True)
