"""The block schedule: which key blocks each query block visits, and which query blocks each key
block visits (its transpose, for dK/dV). Kernels never compute a loop bound themselves.

A blockwise kernel asks two questions again and again:

1. for a block of query rows, which key blocks can hold a visible key at all? Blocks outside are
   skipped, not just masked, which is what makes causal attention cost half;
2. among those, which blocks are *full*: every key visible to every valid row, so the kernel can
   skip computing an element mask (causal attention then masks only the diagonal blocks)?

`Schedule` answers both from the band (`masking.Window`), the block sizes and one row's
`masking.Positions`, and runs the kernel's loop body over the answer (`visit_kv`, `visit_q`).
Without a block table the answers are contiguous ranges of blocks. With one (block-sparse masks,
dense masks, segment ids: `jaxflash.block_mask`), `block_lists` intersects it with the band and
the lengths at the kernel's block sizes and lists, per query block, the partial and the full key
blocks to visit (or, transposed, per key block its query blocks); the same visit methods then
walk the lists. Either way a walk is a few `Span`s, each a run of visits that are all masked or
all unmasked: kernels pass a body and a carry and never see how the blocks were chosen, and
kernels that stream tiles through a ring count visits with `walk`'s ordinal. Split-KV decoding
shares a row's key blocks out over several programs (`used_splits`, `split_range`).

The range helpers below take query rows already shifted into the keys' frame (``row + q_offset -
kv_offset``, see `masking.Positions.diagonal`); they accept Python ints (and then return Python
ints) or traced int32 scalars and arrays.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Sequence

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


class Span(NamedTuple):
  """A run of ``count`` visits, all masked or all not (``masked`` is static): visit ``m`` of
  the run is to block ``block(m)``."""

  masked: bool
  count: object  # int32 scalar, >= 0
  block: Callable


def walk(spans: Sequence[Span], body: Callable, carry, *, skip=0, count=None):
  """Runs ``carry = body(n, j, carry, masked)`` over the visits of ``spans`` in order: ``n``
  counts the visits from 0 over all the spans (a ring slot), ``j`` is the block visited.
  ``skip`` and ``count`` clip the walk to visits ``skip ... skip + count - 1`` (kernels that
  peel the first visit off their loop)."""
  offset = _i32(0)
  for span in spans:
    start = offset
    stop = offset + jnp.maximum(span.count, 0)
    lo = start if isinstance(skip, int) and skip == 0 else jnp.maximum(start, skip)
    hi = stop if count is None else jnp.minimum(stop, skip + count)
    def step(n, c, span=span, start=start):
      return body(n, span.block(n - start), c, span.masked)
    carry = lax.fori_loop(_i32(lo), _i32(hi), step, carry)
    offset = stop
  return carry


def total(spans: Sequence[Span]):
  """How many visits ``spans`` make."""
  return functools.reduce(lambda a, b: a + b, [jnp.maximum(s.count, 0) for s in spans],
                          _i32(0))


def rotated(span: Span, by) -> Span:
  """``span`` started ``by`` visits in, wrapping round: visit ``m`` is to block
  ``block((m + by) mod count)`` (``by`` >= 0)."""
  count = jnp.maximum(span.count, 1)
  shift = lax.rem(_i32(by), count)
  return Span(span.masked, span.count, lambda m: span.block(lax.rem(m + shift, count)))


def block_at(spans: Sequence[Span], place):
  """The block of visit ``place`` of a walk over ``spans`` (`walk`'s ``j`` at ``n = place``),
  for loops that go over the visits without the spans (a producer's)."""
  block, offset = None, _i32(0)
  for span in spans:
    count = jnp.maximum(span.count, 0)
    here = span.block(jnp.clip(place - offset, 0, jnp.maximum(count - 1, 0)))
    block = here if block is None else _select(place >= offset, here, block)
    offset = offset + count
  return block


class BlockLists(NamedTuple):
  """The blocks each row of blocks visits: for every (batch row, head, row of blocks), the
  partial blocks (element mask) and the full ones, each ascending, packed in one int32 row
  ``[partial count, full count, partial blocks..., full blocks...]`` (entries past a count
  are unused). An array or a kernel's ref [B or 1, N or 1, rows, 2 + 2 * blocks]; a batch or
  head axis of size 1 is shared by all.

  "Rows" are query blocks and the listed blocks key blocks for the forward and dQ; transposed
  (`block_lists(..., transpose=True)`) they are key blocks and query blocks, for dK/dV.
  """

  packed: object

  @property
  def blocks(self) -> int:
    return (self.packed.shape[-1] - 2) // 2

  def spans(self, batch, head, row) -> tuple[Span, Span]:
    """The visits of one row: its partial blocks (masked), then its full ones."""
    b = batch if self.packed.shape[0] > 1 else 0
    h = head if self.packed.shape[1] > 1 else 0
    return row_spans(lambda k: self.packed[b, h, row, k], self.blocks)


def row_spans(read: Callable, blocks: int) -> tuple[Span, Span]:
  """The `Span`s of one packed row of `BlockLists`, given ``read(k)``, its ``k``-th entry."""
  return (Span(True, read(0), lambda m: read(2 + m)),
          Span(False, read(1), lambda m: read(2 + blocks + m)))


def block_lists(table, table_block: tuple[int, int], window: Window, block_q: int,
                block_k: int, lengths, offsets, q_len: int, kv_len: int, *,
                transpose: bool = False, union: bool = False) -> BlockLists:
  """The visits of a kernel with ``block_q`` x ``block_k`` tiles under a block table.

  ``table`` (int8 [B or 1, N or 1, ...] of ``table_block`` blocks, `jaxflash.block_mask`) is
  resampled to the kernel's tiles and intersected with what the band, the lengths and the
  offsets (int32 [B, 2] each, offsets None) leave visible, as `Schedule` decides it for
  contiguous ranges: a block is visited if both call it non-empty, and full (no element mask)
  if both call it full. ``transpose`` lists, per key block, its query blocks (dK/dV).
  ``union`` lists for all batch rows and heads at once (batch and head axes of size 1) every
  block that any of them visits, all as partial: for code that computes them together.
  """
  from jaxflash import block_mask as bm  # (below schedule in the layers; imported late)
  table = bm.resample(table, table_block, (block_q, block_k), (q_len, kv_len))
  nq, nk = table.shape[2:]
  table = bm.intersect(table, _band_table(window, block_q, block_k, lengths, offsets, nq, nk))
  if transpose:
    table = jnp.swapaxes(table, 2, 3)
  if union:
    table = jnp.where(jnp.any(table != bm.EMPTY, axis=(0, 1), keepdims=True), bm.PARTIAL,
                      bm.EMPTY).astype(jnp.int8)
  return BlockLists(_packed_lists(table, bm.PARTIAL, bm.FULL))


def _band_table(window: Window, block_q: int, block_k: int, lengths, offsets, nq: int, nk: int):
  """int8 [B, 1, nq, nk]: the blocks the band and the lengths make visible (`PARTIAL`) and
  full (`FULL`), per batch row, as `Schedule.kv_blocks` decides them."""
  from jaxflash import block_mask as bm
  b = lengths.shape[0]
  column = lambda x: x.reshape(b, 1)  # noqa: E731
  extra = () if offsets is None else (column(offsets[:, 0]), column(offsets[:, 1]))
  pos = Positions(column(lengths[:, 0]), column(lengths[:, 1]), *extra)
  starts = (jnp.arange(nq, dtype=jnp.int32) * block_q).reshape(1, nq)
  lo, full_lo, full_hi, hi = Schedule(window, block_q, block_k).kv_blocks(starts, pos)
  j = jnp.arange(nk, dtype=jnp.int32).reshape(1, 1, nk)
  def within(a, z):  # bounds may come back as scalars or rows: [B, nq] before comparing
    a, z = (jnp.broadcast_to(x, (b, nq))[..., None] for x in (a, z))
    return jnp.logical_and(j >= a, j < z)
  table = jnp.where(within(full_lo, full_hi), bm.FULL,
                    jnp.where(within(lo, hi), bm.PARTIAL, bm.EMPTY)).astype(jnp.int8)
  return jnp.broadcast_to(table, (b, nq, nk))[:, None]


def _packed_lists(table, partial, full):
  """`BlockLists`' packed rows of ``table`` [..., rows, blocks]: each row's ``partial`` blocks,
  then its ``full`` ones, each ascending (entries past a count are 0, a block that exists).

  One sort per row orders both lists at once, keyed by block index, plus ``blocks`` for a full
  block and ``2 * blocks`` for an empty one; the full list is then a shifted read. XLA fused
  the running counts of two scatters (what this was) into a kernel that took an H200 48 µs
  for a 16k call's two backward tables, the sort 22 µs for those and the forward's."""
  blocks = table.shape[-1]
  column = lax.broadcasted_iota(jnp.int32, table.shape, table.ndim - 1)
  key = jnp.sort(jnp.where(table == partial, column,
                           jnp.where(table == full, blocks + column, 2 * blocks)), axis=-1)
  partial_count = jnp.sum(table == partial, axis=-1, dtype=jnp.int32)[..., None]
  full_count = jnp.sum(table == full, axis=-1, dtype=jnp.int32)[..., None]
  at = jnp.minimum(column + partial_count, blocks - 1)
  full_blocks = jnp.take_along_axis(key, at, axis=-1) - blocks
  return jnp.concatenate([partial_count, full_count,
                          jnp.where(column < partial_count, key, 0),
                          jnp.where(column < full_count, full_blocks, 0)], axis=-1)


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

  @classmethod
  def of(cls, window: Window, block_q: int, block_k: int, *, mask=None,
         q_segment_ids=None) -> Schedule:
    """The schedule of a kernel's call: `elementwise` wherever a dense mask or segment ids
    are present (every kernel asks here, so that a forward and its backward agree on which
    blocks need the element mask; one that forgot the mask skipped it on full blocks)."""
    return cls(window, block_q, block_k, mask is not None or q_segment_ids is not None)

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

  def q_spans(self, k_start, pos: Positions) -> tuple[Span, ...]:
    """The visits of the key block at ``k_start`` in dK/dV, as `Span`s of query blocks
    (`q_block_ranges`): masked, full, masked."""
    lo, full_lo, full_hi, hi = self.q_block_ranges(k_start, pos)
    if self.elementwise:
      return (Span(True, hi - lo, lambda m: lo + m),)
    return (Span(True, full_lo - lo, lambda m: lo + m),
            Span(False, full_hi - full_lo, lambda m: full_lo + m),
            Span(True, hi - full_hi, lambda m: full_hi + m))

  def q_spans_from(self, k_start, pos: Positions, stagger=None) -> tuple[Span, ...]:
    """`q_spans`, the full blocks' run started ``stagger`` blocks in (None: at its first) and
    wrapping round: key blocks that add into the same query blocks in no fixed order (the
    atomic dQ) then do not all start on one of them."""
    spans = self.q_spans(k_start, pos)
    if stagger is None:
      return spans
    return tuple(rotated(s, stagger) if not s.masked else s for s in spans)

  def visit_q_split(self, k_start, pos: Positions, body: Body, carry, repeat: int = 1,
                    reverse: bool = False, spans_of: Callable | None = None, stagger=None):
    """Runs ``carry = body(n, g, i, carry, masked)`` for ``g < repeat`` (the query heads sharing
    a K/V head) and each query block ``i`` that the key block at ``k_start`` visits
    (`q_spans`, or ``spans_of(g)`` from a block table's lists), head after head; ``n`` counts
    the visits from 0 over all heads (a ring slot). Blocks go in increasing ``i`` per head, or in
    decreasing ``i`` with ``reverse`` (contiguous ranges only), or with the full blocks started
    ``stagger`` blocks in (`q_spans_from`); ``masked=False`` only on full blocks."""
    if spans_of is None:
      spans = self.q_spans_from(k_start, pos, stagger)
      assert not (reverse and stagger is not None), "a staggered walk goes forwards"
      if reverse:  # i = hi - 1 ... lo: the runs in reverse order, each walked backwards
        spans = tuple(Span(s.masked, s.count,
                           lambda m, s=s: s.block(jnp.maximum(s.count, 0) - 1 - m))
                      for s in reversed(spans))
      spans_of = lambda g: spans  # noqa: E731
    else:
      assert not reverse, "a block table's lists are walked forwards"

    def one_head(g, state):
      carry, n0 = state
      head_spans = spans_of(g)
      carry = walk(head_spans, lambda n, i, c, masked: body(n0 + n, g, i, c, masked), carry)
      return carry, n0 + total(head_spans)

    return lax.fori_loop(_i32(0), _i32(repeat), one_head, (carry, _i32(0)))[0]

  def kv_spans(self, q_start, pos: Positions) -> tuple[Span, ...]:
    """The visits of the query block at ``q_start`` as `Span`s of key blocks (`kv_blocks`):
    masked, full, masked, leaving out the runs that are empty whatever the positions (a band
    without a left side starts at key 0, where its full blocks start too; with segments or a
    dense mask every block is masked). With batched ``pos`` (the XLA backend walks every batch
    row at once) it is the union of the rows' blocks, all masked."""
    lo, full_lo, full_hi, hi = self.kv_blocks(q_start, pos)
    if jnp.ndim(hi) > 0:
      lo, hi = _union(lo, hi)
      return (Span(True, hi - lo, lambda m: lo + m),)
    if self.elementwise:
      return (Span(True, hi - lo, lambda m: lo + m),)
    spans = (Span(False, full_hi - full_lo, lambda m: full_lo + m),
             Span(True, hi - full_hi, lambda m: full_hi + m))
    if self.window.left is not None:
      spans = (Span(True, full_lo - lo, lambda m: lo + m),) + spans
    return spans

  def visit_kv(self, q_start, pos: Positions, body: Body, carry, *, skip: int = 0,
               count: int | None = None, spans: Sequence[Span] | None = None):
    """Runs ``carry = body(j, carry, masked)`` over the key blocks of the query block at
    ``q_start`` (`kv_spans`, or ``spans`` from a block table's lists), ``masked=False`` only on
    full blocks. ``skip`` and ``count`` clip the walk to visits ``skip ...`` (at most ``count``
    of them), for kernels that peel the first visit off their loop."""
    spans = self.kv_spans(q_start, pos) if spans is None else spans
    return walk(spans, lambda n, j, c, masked: body(j, c, masked), carry, skip=skip,
                count=count)

  def visit_q(self, k_start, pos: Positions, body: Callable, carry, repeat: int = 1,
              spans: Sequence[Span] | None = None, spans_of: Callable | None = None):
    """Runs ``carry = body(g, i, carry)`` for ``g < repeat`` (the query heads sharing a K/V head)
    and each query block ``i`` that the key block at ``k_start`` must visit, as one flat loop
    (or, from a block table's lists, over ``spans`` or each head's ``spans_of(g)``).

    Every block is masked: splitting off full blocks here (three loops instead of one) measured
    slower on an H200 (docs/performance_notes.md). With batched ``pos`` it visits the union.
    """
    if spans is not None or spans_of is not None:
      def one_head(g, c):
        head_spans = spans if spans_of is None else spans_of(g)
        return walk(head_spans, lambda n, i, c2, masked: body(g, i, c2), c)
      return lax.fori_loop(_i32(0), _i32(repeat), one_head, carry)
    lo, hi = self.q_blocks(k_start, pos)
    if jnp.ndim(hi) > 0:
      lo, hi = _union(lo, hi)
    count = jnp.maximum(hi - lo, 0)
    if repeat == 1:
      return lax.fori_loop(lo, lo + count, lambda i, c: body(jnp.int32(0), i, c), carry)

    def step(n, c):
      return body(lax.div(n, count), lo + lax.rem(n, count), c)

    return lax.fori_loop(0, repeat * count, step, carry)


# Split-KV decoding (`jaxflash.backends.triton.decode`, `jaxflash.backends.mosaic.decode`): a
# row's key blocks shared out over ``splits`` programs.


def used_splits(blocks: int, splits: int) -> int:
  """The splits a grid of ``blocks`` key blocks really has when asked for ``splits``: each takes
  ceil(blocks / splits) blocks, so none is left without one."""
  per = -(-blocks // max(1, min(splits, blocks)))
  return -(-blocks // per)


def split_range(split, splits: int, first, last):
  """Key blocks ``[lo, hi)`` of split ``split`` of ``splits``: the row's blocks ``[first,
  last)`` (those its lengths and window leave), shared out in runs of equal length (the last
  run shorter, runs past the end empty). Sharing out the row's own blocks, not the cache's,
  keeps every split busy when the cache is partly filled or a window sees a part of it: cut
  by the cache's length, a cache a tenth full left one split of ten all the work."""
  span = jnp.maximum(last - first, 0)
  count = jnp.asarray(splits, span.dtype)  # (the row's int32 under jax_enable_x64 too)
  per = lax.div(span + (count - 1), count)
  lo = first + split * per
  return lo, jnp.maximum(jnp.minimum(lo + per, last), lo)
