"""Which (query, key) pairs may attend: the mask model every backend and the block schedule share.

Attention options reduce to a band (`Window`: causal and local windows), per-batch-row
`Positions` (lengths and offsets) and optional per-element inputs (segment ids, a dense boolean
mask). `visible` turns them into the element mask of one tile; `jaxflash.schedule` turns the band
and the positions into the key blocks each query block visits. Everything here is plain `jnp`
arithmetic on indices, so it runs inside Pallas kernels (on program ids and loaded tiles) and in
the pure-JAX backend (on traced arrays) alike.

Conventions (those of `jax.nn.dot_product_attention`):
- causal is top-left aligned: query ``q`` sees key ``k`` iff ``k <= q``;
- a window ``(left, right)`` keeps ``q - left <= k <= q + right``; ``None`` on a side means
  unbounded; causal is the window ``(None, 0)`` and combines with a window by intersection;
- ``kv_len`` hides keys ``k >= kv_len``; ``q_len`` marks query rows ``q >= q_len`` as padding
  (they see nothing and come out as zeros).

Positions: query row ``r`` of a call sits at absolute position ``q_offset + r`` and key column
``c`` at ``kv_offset + c``. The band compares absolute positions; lengths, segment ids and the
dense mask index the call's own rows and columns. With both offsets 0 (every public call) the two
agree. A KV-cache query at position p is ``q_offset = p``; a ring shard holding keys 32k..48k is
``kv_offset = 32k``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp


# Window sides at or beyond this reach every key of any call (positions stay below it), so they
# mean "unbounded" (None); kept as numbers they would overflow int32 in `row + right`.
UNBOUNDED_WINDOW = 2**30


@dataclasses.dataclass(frozen=True)
class Window:
  """Band of visible keys around each query: ``q - left <= k <= q + right`` (absolute positions).

  ``None`` on a side means that side is unbounded. ``Window(None, None)`` is full attention.
  """

  left: int | None = None
  right: int | None = None

  @property
  def is_full(self) -> bool:
    return self.left is None and self.right is None

  @property
  def is_causal(self) -> bool:
    """Whether no query sees a key past its own position (the band ends at the diagonal)."""
    return self.right is not None and self.right <= 0

  @property
  def keys_per_row(self) -> int | None:
    """The most keys a query row sees in the band (None where a side is unbounded)."""
    if self.left is None or self.right is None:
      return None
    return self.left + self.right + 1


def make_window(is_causal: bool, local_window_size: int | tuple[int, int] | None) -> Window:
  """Merges ``is_causal`` and ``local_window_size`` into one `Window` (already validated)."""
  left = right = None
  if local_window_size is not None:
    if isinstance(local_window_size, int):
      left = right = local_window_size
    else:
      left, right = local_window_size
  left, right = (None if w is not None and w >= UNBOUNDED_WINDOW else w for w in (left, right))
  if is_causal:
    right = 0 if right is None else min(right, 0)
  return Window(left, right)


class Positions(NamedTuple):
  """Lengths and offsets of one batch row (int32 scalars in a kernel, or arrays over the batch).

  ``q_offset``/``kv_offset`` may be the Python int 0, which traces no arithmetic at all.
  """

  q_len: object
  kv_len: object
  q_offset: object = 0
  kv_offset: object = 0

  @property
  def diagonal(self):
    """``q_offset - kv_offset``: local row ``r`` is at the diagonal of local key ``r + diagonal``.

    The band only ever compares ``row + diagonal`` with a key column, so only this difference of
    the offsets matters for masking (dropout uses both, as absolute coordinates).
    """
    if _is_zero(self.q_offset) and _is_zero(self.kv_offset):
      return 0
    return self.q_offset - self.kv_offset


def _is_zero(x) -> bool:
  return isinstance(x, int) and x == 0


def shifted(rows, diagonal):
  """Query rows in the keys' frame: ``rows + diagonal`` (no op when the diagonal is a static 0)."""
  return rows if _is_zero(diagonal) else rows + diagonal


def key_range(q_idx, window: Window, *, diagonal=0, kv_len=None):
  """The band and the key length as one inclusive range of local key columns per query row:
  ``(first, last)``, key ``k`` being visible from row ``q_idx`` iff ``first <= k <= last``
  (``None`` on an unbounded side).

  A kernel computes it once per row and masks a tile with one compare per bound and entry
  instead of building the band from per-entry positions (`visible` uses it too).
  """
  first = last = None
  if not window.is_full:
    q_abs = shifted(q_idx, diagonal)  # in the keys' frame: the band compares it with key columns
    first = None if window.left is None else q_abs - window.left
    last = None if window.right is None else q_abs + window.right
  if kv_len is not None:
    last = kv_len - 1 if last is None else jnp.minimum(last, kv_len - 1)
  return first, last


def visible(q_idx, k_idx, window: Window, *, diagonal=0, q_len=None, kv_len=None, q_segment=None,
            kv_segment=None, dense_mask=None):
  """Boolean mask of visible entries for local query rows ``q_idx`` and key columns ``k_idx``.

  All arguments broadcast against each other (typically ``q_idx[:, None]`` and ``k_idx[None, :]``,
  segment ids shaped the same way). ``diagonal`` is `Positions.diagonal`. Any argument left
  ``None`` imposes nothing, so callers pass only what the request uses and no work is traced for
  the rest; the result is ``None`` when nothing is imposed at all.
  """
  conds = []
  first, last = key_range(q_idx, window, diagonal=diagonal, kv_len=kv_len)
  if first is not None:
    conds.append(k_idx >= first)
  if last is not None:
    conds.append(k_idx <= last)
  if q_len is not None:
    conds.append(q_idx < q_len)
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
