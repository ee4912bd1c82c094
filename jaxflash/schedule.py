"""The block schedule: which key blocks each query block visits, and which query blocks each key
block visits (its transpose, for dK/dV). Kernels never compute a loop bound themselves.

A blockwise kernel asks two questions again and again:

1. for a block of query rows, which key blocks can hold a visible key at all? Blocks outside are
   skipped, not just masked, which is what makes causal attention cost half;
2. among those, which blocks are *full*: every key visible to every valid row, so the kernel can
   skip computing an element mask (causal attention then masks only the diagonal blocks)?

`Schedule` answers both from the band (`masking.Window`), the block sizes and one row's
`masking.Positions`, and runs the kernel's loop body over the answer (`visit_kv`, `visit_q`).
Today's answers are contiguous ranges of blocks. A per-block table (block-sparse masks,
segment-aware skipping) is a different `Schedule` with the same two visit methods: kernels pass a
body and a carry and never see how the blocks were chosen.

The range helpers below take query rows already shifted into the keys' frame (``row + q_offset -
kv_offset``, see `masking.Positions.diagonal`); they accept Python ints (and then return Python
ints) or traced int32 scalars and arrays.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax.numpy as jnp
from jax import lax

from jaxflash import masking
from jaxflash.masking import Positions, Window


def _cdiv(a, b: int):
  """Ceiling division of a non-negative int (Python or traced) by a positive Python int."""
  if isinstance(a, int):
    return -(-a // b)
  return _floordiv(a + (b - 1), b)


def _floordiv(a, b: int):
  """Division of a non-negative int by a positive Python int; `lax.div` (one instruction in a
  kernel) with the divisor in the dividend's own integer type (int64 under jax_enable_x64)."""
  if isinstance(a, int):
    return a // b
  a = jnp.asarray(a)
  return lax.div(a, jnp.asarray(b, a.dtype))


def _max(a, b):
  if isinstance(a, int) and isinstance(b, int):
    return max(a, b)
  return jnp.maximum(a, b)


def _min(a, b):
  if isinstance(a, int) and isinstance(b, int):
    return min(a, b)
  return jnp.minimum(a, b)


def kv_block_range(q_start, q_stop, kv_len, window: Window, block_k: int):
  """Key blocks ``[lo, hi)`` that can hold a key visible to query rows ``[q_start, q_stop)``.

  Args:
    q_start, q_stop: the block's query rows in the keys' frame (``q_stop`` exclusive, clipped to
      the valid rows by the caller; rows past them only widen the range).
    kv_len: number of valid keys (int or traced int32).
    window: the visible band.
    block_k: key block size.

  Returns ``(lo, hi)`` in units of key blocks; ``hi <= lo`` means no block needs a visit.
  """
  k_start = 0 if window.left is None else _max(q_start - window.left, 0)
  k_stop = kv_len if window.right is None else _min(q_stop + window.right, kv_len)
  # k_start may exceed k_stop (rows entirely left of the valid keys): the empty range follows.
  return _floordiv(k_start, block_k), _cdiv(_max(k_stop, 0), block_k)


def kv_full_block_range(q_start, q_stop, kv_len, window: Window, block_k: int):
  """Key blocks ``[lo, hi)`` whose every key is visible to every row in ``[q_start, q_stop)``
  as far as the window and ``kv_len`` go (segments and dense masks are `Schedule`'s to rule out).

  ``hi <= lo`` means there are none; `Schedule` clips the range into `kv_block_range`'s.
  """
  hi = _floordiv(_max(kv_len, 0), block_k)  # blocks entirely below kv_len (and so below S)
  if window.right is not None:  # last key <= first row + right
    hi = _min(hi, _floordiv(_max(q_start + window.right + 1, 0), block_k))
  lo = 0
  if window.left is not None:  # first key >= last row - left
    lo = _cdiv(_max(q_stop - 1 - window.left, 0), block_k)
  return lo, hi


def q_block_range(k_start, k_stop, q_len, window: Window, block_q: int, diagonal=0):
  """Query blocks ``[lo, hi)`` that can hold a row seeing a key in ``[k_start, k_stop)``.

  The mirror of `kv_block_range`, used by the dK/dV pass that walks queries for a block of keys:
  key ``k`` is visible to rows with ``k - right <= row + diagonal <= k + left``. Keys are local
  columns; rows are the call's own, so ``q_len`` needs no shift.
  """
  k_start, k_stop = masking.shifted(k_start, -diagonal), masking.shifted(k_stop, -diagonal)
  q_lo = 0 if window.right is None else _max(k_start - window.right, 0)
  q_hi = q_len if window.left is None else _min(k_stop + window.left, q_len)
  return _floordiv(q_lo, block_q), _cdiv(_max(q_hi, 0), block_q)


def q_full_block_range(k_start, k_stop, window: Window, block_q: int, diagonal=0):
  """Query blocks ``[lo, hi)`` whose every row sees every key in ``[k_start, k_stop)`` as far as
  the window goes (the mirror of `kv_full_block_range`; the key length is the caller's to rule
  out). Rows past the query length need no mask: their LSE is +inf, so their P is 0.

  Row ``r`` sees key ``k`` iff ``k - right <= r + diagonal <= k + left``: a block is full when its
  first row reaches the last key (``k_stop - 1 - right``) and its last row stays within ``left``
  of the first key.
  """
  k_start, k_stop = masking.shifted(k_start, -diagonal), masking.shifted(k_stop, -diagonal)
  lo = 0 if window.right is None else _cdiv(_max(k_stop - 1 - window.right, 0), block_q)
  hi = None
  if window.left is not None:  # (i + 1) * block_q - 1 <= k_start + left
    hi = _floordiv(_max(k_start + window.left + 1, 0), block_q)
  return lo, hi


def _i32(x):
  """A block index as int32, whatever it was computed in (Python int; int64 under x64): loop
  bounds must share one type, and kernels index in int32."""
  return jnp.asarray(x, jnp.int32)


def _select(cond, a, b):
  """``jnp.where`` on block indices, always int32: a select between two Python ints would be
  weakly typed, which the Triton lowering turns into a boolean it then compares with int32."""
  return jnp.where(cond, _i32(a), _i32(b))


def _union(lo, hi):
  """The smallest range holding every batch row's ``[lo, hi)`` (ranges only widen: masking
  inside the visited blocks keeps each row exact)."""
  return jnp.min(lo), jnp.max(hi)


Body = Callable  # body(block_index, carry, masked: bool) -> carry


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Contiguous block ranges from a band and per-row positions (static, hashable).

  ``elementwise`` says that segment ids or a dense mask can hide any entry, so no block may be
  visited without an element mask.
  """

  window: Window
  block_q: int
  block_k: int
  elementwise: bool = False

  def kv_blocks(self, q_start, pos: Positions):
    """``(lo, full_lo, full_hi, hi)``: the query block at ``q_start`` visits key blocks
    ``[lo, hi)``; those in ``[full_lo, full_hi)`` need no element mask. With ``pos`` fields
    shaped [B] the results are per batch row."""
    q_stop = _min(q_start + self.block_q, pos.q_len)
    first, stop = (masking.shifted(x, pos.diagonal) for x in (q_start, q_stop))
    lo, hi = (_i32(x) for x in kv_block_range(first, stop, pos.kv_len, self.window,
                                              self.block_k))
    hi = _select(q_start < pos.q_len, hi, lo)  # the whole block is query padding
    if self.elementwise:
      return lo, hi, hi, hi
    full_lo, full_hi = kv_full_block_range(first, stop, pos.kv_len, self.window, self.block_k)
    full_lo = jnp.clip(_i32(full_lo), lo, hi)
    return lo, full_lo, jnp.clip(_i32(full_hi), full_lo, hi), hi

  def q_blocks(self, k_start, pos: Positions):
    """``(lo, hi)``: query blocks that the key block at ``k_start`` must visit in dK/dV."""
    k_stop = _min(k_start + self.block_k, pos.kv_len)
    lo, hi = (_i32(x) for x in q_block_range(k_start, k_stop, pos.q_len, self.window,
                                             self.block_q, pos.diagonal))
    return lo, _select(k_start < pos.kv_len, hi, lo)

  def q_block_ranges(self, k_start, pos: Positions):
    """``(lo, full_lo, full_hi, hi)``: the key block at ``k_start`` visits query blocks
    ``[lo, hi)`` (`q_blocks`); those in ``[full_lo, full_hi)`` need no element mask. A key block
    that reaches past the key length has none (its padding keys are masked)."""
    lo, hi = self.q_blocks(k_start, pos)
    if self.elementwise:
      return lo, hi, hi, hi
    k_stop = k_start + self.block_k
    full_lo, full_hi = q_full_block_range(k_start, k_stop, self.window, self.block_q,
                                          pos.diagonal)
    full_hi = hi if full_hi is None else _i32(full_hi)
    full_hi = _select(k_stop <= pos.kv_len, full_hi, lo)
    full_lo = jnp.clip(_i32(full_lo), lo, hi)
    return lo, full_lo, jnp.clip(full_hi, full_lo, hi), hi

  def visit_q_split(self, k_start, pos: Positions, body: Body, carry, repeat: int = 1,
                    reverse: bool = False):
    """Runs ``carry = body(g, i, carry, masked)`` for ``g < repeat`` (the query heads sharing a
    K/V head) and each query block ``i`` of `q_block_ranges`, in increasing ``i`` per head
    (decreasing with ``reverse``); ``masked=False`` only on full blocks. Kernels that stream
    query tiles through a ring count the visits as ``g * (hi - lo) + i - lo``, or
    ``g * (hi - lo) + hi - 1 - i`` with ``reverse``."""
    lo, full_lo, full_hi, hi = self.q_block_ranges(k_start, pos)
    masked, unmasked = (functools.partial(body, masked=m) for m in (True, False))

    def one_head(g, carry):
      def at(fn, start, stop, carry):
        if not reverse:
          return lax.fori_loop(start, stop, lambda i, c: fn(g, i, c), carry)
        # i = stop - 1 ... start
        return lax.fori_loop(start, stop, lambda n, c: fn(g, start + stop - 1 - n, c), carry)

      spans = [(masked, lo, full_lo), (unmasked, full_lo, full_hi), (masked, full_hi, hi)]
      for fn, start, stop in (reversed(spans) if reverse else spans):
        carry = at(fn, start, stop, carry)
      return carry

    return lax.fori_loop(_i32(0), _i32(repeat), one_head, carry)

  def visit_kv(self, q_start, pos: Positions, body: Body, carry, *, skip: int = 0,
               count: int | None = None):
    """Runs ``carry = body(j, carry, masked)`` over the key blocks of the query block at
    ``q_start``, in increasing ``j``; ``masked=False`` only on full blocks. ``skip`` and ``count``
    clip the walk to blocks ``lo + skip ...`` (at most ``count`` of them), for kernels that peel
    the first block off their loop. With batched ``pos`` (the XLA backend walks every batch row at
    once) it visits the union of the rows' blocks, all masked."""
    lo, full_lo, full_hi, hi = self.kv_blocks(q_start, pos)
    if jnp.ndim(hi) > 0:
      lo, hi = _union(lo, hi)
      full_lo = full_hi = hi
    if skip or count is not None:
      start = lo + skip
      stop = hi if count is None else jnp.minimum(hi, start + count)
      lo, full_lo, full_hi, hi = (start, jnp.maximum(full_lo, start),
                                  jnp.clip(full_hi, start, stop), stop)
      full_lo = jnp.minimum(full_lo, full_hi)
    masked, unmasked = (functools.partial(body, masked=m) for m in (True, False))
    carry = lax.fori_loop(lo, full_lo, masked, carry)
    carry = lax.fori_loop(full_lo, full_hi, unmasked, carry)
    return lax.fori_loop(full_hi, hi, masked, carry)

  def visit_q(self, k_start, pos: Positions, body: Callable, carry, repeat: int = 1):
    """Runs ``carry = body(g, i, carry)`` for ``g < repeat`` (the query heads sharing a K/V head)
    and each query block ``i`` that the key block at ``k_start`` must visit, as one flat loop.

    Every block is masked: splitting off full blocks here (three loops instead of one) measured
    slower on an H200 (benchmarks/NOTES.md). With batched ``pos`` it visits the union.
    """
    lo, hi = self.q_blocks(k_start, pos)
    if jnp.ndim(hi) > 0:
      lo, hi = _union(lo, hi)
    count = jnp.maximum(hi - lo, 0)
    if repeat == 1:
      return lax.fori_loop(lo, lo + count, lambda i, c: body(jnp.int32(0), i, c), carry)

    def step(n, c):
      return body(lax.div(n, count), lo + lax.rem(n, count), c)

    return lax.fori_loop(0, repeat * count, step, carry)
