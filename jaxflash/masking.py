"""Which (query, key) pairs may attend: the one place every backend asks.

Attention options (causal, local window, sequence lengths, segment ids, a dense boolean mask) all
reduce to two questions that a blockwise kernel asks again and again:

1. *Block ranges*: for a block of query rows, which key blocks can hold a visible key at all (and
   the mirror question for a block of keys in the dK/dV pass)? Blocks outside the range are skipped,
   not just masked, which is what makes causal attention cost half.
2. *Element mask*: inside a block that is visited, which (q, k) entries are visible?

The functions here answer both with plain `jnp` arithmetic on indices, so the same code runs inside
Pallas kernels (on program ids and loaded tiles) and in the pure-JAX backend (on traced scalars).

Conventions (those of `jax.nn.dot_product_attention`):
- causal is top-left aligned: query ``q`` sees key ``k`` iff ``k <= q``;
- a window ``(left, right)`` keeps ``q - left <= k <= q + right``; ``None`` on a side means
  unbounded; causal is the window ``(None, 0)`` and combines with a window by intersection;
- ``kv_len`` hides keys ``k >= kv_len``; ``q_len`` marks query rows ``q >= q_len`` as padding
  (they see nothing and come out as zeros).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class Window:
  """Band of visible keys around each query: ``q - left <= k <= q + right``.

  ``None`` on a side means that side is unbounded. ``Window(None, None)`` is full attention.
  """

  left: int | None = None
  right: int | None = None

  @property
  def is_full(self) -> bool:
    return self.left is None and self.right is None


def make_window(is_causal: bool, local_window_size: int | tuple[int, int] | None) -> Window:
  """Merges ``is_causal`` and ``local_window_size`` into one `Window` (already validated)."""
  left = right = None
  if local_window_size is not None:
    if isinstance(local_window_size, int):
      left = right = local_window_size
    else:
      left, right = local_window_size
  if is_causal:
    right = 0 if right is None else min(right, 0)
  return Window(left, right)


def _cdiv(a, b: int):
  """Ceiling division of a non-negative int (Python or traced int32) by a positive Python int."""
  if isinstance(a, int):
    return -(-a // b)
  return lax.div(a + (b - 1), jnp.int32(b))


def _floordiv(a, b: int):
  if isinstance(a, int):
    return a // b
  return lax.div(a, jnp.int32(b))


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
    q_start, q_stop: the query rows of the block (``q_stop`` exclusive, clipped to ``q_len`` by
      the caller if it likes; rows past it only widen the range).
    kv_len: number of valid keys (int or traced int32 scalar).
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
  as far as the window and ``kv_len`` go (segments and dense masks are the caller's to rule out).

  Kernels visit these blocks without computing an element mask: causal attention then masks only
  the blocks on the diagonal, and full attention only the last, partial block. ``hi <= lo``
  means there are none; the caller clips the range into `kv_block_range`'s.
  """
  hi = _floordiv(_max(kv_len, 0), block_k)  # blocks entirely below kv_len (and so below S)
  if window.right is not None:  # last key <= first row + right
    hi = _min(hi, _floordiv(_max(q_start + window.right + 1, 0), block_k))
  lo = 0
  if window.left is not None:  # first key >= last row - left
    lo = _cdiv(_max(q_stop - 1 - window.left, 0), block_k)
  return lo, hi


def q_block_range(k_start, k_stop, q_len, window: Window, block_q: int):
  """Query blocks ``[lo, hi)`` that can hold a row seeing a key in ``[k_start, k_stop)``.

  The mirror of `kv_block_range`, used by the dK/dV pass that walks queries for a block of keys:
  key ``k`` is visible to rows ``k - right <= q <= k + left``.
  """
  q_lo = 0 if window.right is None else _max(k_start - window.right, 0)
  q_hi = q_len if window.left is None else _min(k_stop + window.left, q_len)
  return _floordiv(q_lo, block_q), _cdiv(_max(q_hi, 0), block_q)


def visible(q_idx, k_idx, window: Window, *, q_len=None, kv_len=None, q_segment=None,
            kv_segment=None, dense_mask=None):
  """Boolean mask of visible entries for query positions ``q_idx`` and key positions ``k_idx``.

  All arguments broadcast against each other (typically ``q_idx[:, None]`` and ``k_idx[None, :]``,
  segment ids shaped the same way). Any argument left ``None`` imposes nothing, so callers pass
  only what the request uses and no work is traced for the rest.
  """
  conds = []
  if window.left is not None:
    conds.append(k_idx >= q_idx - window.left)
  if window.right is not None:
    conds.append(k_idx <= q_idx + window.right)
  if q_len is not None:
    conds.append(q_idx < q_len)
  if kv_len is not None:
    conds.append(k_idx < kv_len)
  if q_segment is not None:
    conds.append(q_segment == kv_segment)
  if dense_mask is not None:
    conds.append(dense_mask)
  if not conds:
    return None
  out = conds[0]
  for c in conds[1:]:
    out = jnp.logical_and(out, c)
  return out
