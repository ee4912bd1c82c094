"""The exact merge of partial attention results over disjoint key ranges, through their LSEs.

Attention over keys ``K = K_1 ∪ ... ∪ K_m`` (disjoint) can be computed one range at a time:
range ``i`` gives its *partial* output ``O_i`` (float32, normalised over ``K_i`` only) and its
logsumexp ``L_i``. Then

    L = log(sum_i exp(L_i)),    O = sum_i exp(L_i - L) * O_i,

which is exact (no approximation beyond float32 rounding); a range a row cannot see has
``L_i = -inf`` and weight 0.

Plain `jnp` on arrays, below both the ops and the backends, which share it:
`jaxflash.ops.partial` (split keys, and ring attention through it) and the Triton backend's
split-KV decoding kernel (`jaxflash.backends.triton.decode`), which merges its splits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash import _core


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


def with_sinks(out: jax.Array, lse: jax.Array,
               sinks: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """A merged result with each head's attention sink joined to its softmax denominator.

  ``out`` [..., T, N, H] and its natural-log ``lse`` [..., T, N] (``-inf`` on rows that see no
  key) are normalised over the keys; ``sinks`` float [N] is one more logit per head whose value
  row is zero. Each row is scaled by ``exp(lse - lse')`` with ``lse' = logaddexp(lse, sink)``.
  Rows that see no key stay zeros with an LSE of ``-inf``, as in every kernel
  (`jaxflash._core.finish_rows`). ``sinks`` None returns the result unchanged.
  """
  if sinks is None:
    return out, lse
  sink = jnp.broadcast_to(sinks.astype(jnp.float32), lse.shape)  # (strict rank promotion)
  seen = lse != -jnp.inf
  joined = jnp.logaddexp(lse.astype(jnp.float32), sink)
  weight = jnp.where(seen, jnp.exp(jnp.where(seen, lse - joined, 0.0)), 0.0)
  scaled = out.astype(jnp.float32) * weight[..., None]
  return scaled.astype(out.dtype), jnp.where(seen, joined, -jnp.inf)


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


def merge_splits(outs: jax.Array, lse2: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A split-KV kernel's partial results ``[B, K, splits, rows, H]`` (float32) and base-2
  LSEs ``[B, K, splits, rows]`` (-inf where a split sees nothing) merged over the splits by
  `merge` (range by range up to `MERGE_UNROLLED` splits, so XLA fuses it into one or two
  kernels), in their own layout: ``(out [B, K, rows, H] float32, lse2 [B, K, rows], +inf on
  rows no split saw)`` (`jaxflash._core`'s base-2 convention)."""
  out, lse = merge(outs, lse2 * (1.0 / _core.LOG2_E), axis=2)
  return out, _core.base2_lse(lse)


def group_rows_as_heads(out: jax.Array, lse2: jax.Array, t: int, sinks: jax.Array | None,
                        token_major: bool = False) -> tuple[jax.Array, jax.Array]:
  """A split-KV result over each K/V head's query rows (head ``g``, token ``t``, the token
  fastest, or with ``token_major`` the head fastest; ``out`` [B, K, G·T, Dv], base-2 ``lse2``
  [B, K, G·T]) as the training forward gives it: ``(out [B, T, N, Dv], lse2 [B, N, T])``, each
  head's sink (if any) joined to its denominator after the merge (`with_sinks`)."""
  b, kv_heads, rows, hv = out.shape
  g = rows // t
  if token_major:
    out = out.reshape(b, kv_heads, t, g, hv).transpose(0, 2, 1, 3, 4).reshape(
        b, t, kv_heads * g, hv)
    lse2 = lse2.reshape(b, kv_heads, t, g).transpose(0, 1, 3, 2).reshape(b, kv_heads * g, t)
  else:
    out = out.reshape(b, kv_heads, g, t, hv).transpose(0, 3, 1, 2, 4).reshape(
        b, t, kv_heads * g, hv)
    lse2 = lse2.reshape(b, kv_heads * g, t)
  if sinks is not None:
    out, lse = with_sinks(out, jnp.swapaxes(_core.user_lse(lse2), 1, 2), sinks)
    lse2 = _core.base2_lse(jnp.swapaxes(lse, 1, 2))
  return out, lse2
