"""What the XLA backend's forward and backward share: one call's arrays padded to whole blocks,
grouped by K/V head, and the logits, element mask and dropout mask of one tile.

Every tile is shaped [B, K, G, rows, cols] (K key/value heads, G = N // K query heads per K/V
head), so grouped-query attention never repeats K or V, and all batch rows are computed at once:
the block schedule visits the union of the rows' blocks, and the element mask does the rest.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from jaxflash import _core
from jaxflash import dropout
from jaxflash import masking
from jaxflash._core import Inputs, Params
from jaxflash.masking import Positions
from jaxflash.schedule import Schedule


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Query and key block sizes (clipped to the sequence lengths). Larger blocks mean fewer,
  bigger XLA ops (faster on a CPU) and a larger temporary tile."""

  block_q: int = 256
  block_k: int = 256


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static sizes of one call and its blocks (pads are never visible: see `Blocks`)."""

  b: int
  t: int
  s: int
  kh: int
  g: int
  h: int
  block_q: int
  block_k: int

  @property
  def t_pad(self):
    return -(-self.t // self.block_q) * self.block_q

  @property
  def s_pad(self):
    return -(-self.s // self.block_k) * self.block_k


def layout(inputs: Inputs, config: Config) -> Layout:
  b, t, n, h = inputs.query.shape
  s, kh = inputs.key.shape[1:3]
  return Layout(b, t, s, kh, n // kh, h, min(config.block_q, t), min(config.block_k, s))


def pad_axis(x, axis: int, size: int, value=0):
  if x is None or x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def rows(x, start, size, axis=1):
  return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _per_row(x, lay: Layout):
  """[B] -> [B, 1, 1, 1, 1], to broadcast against [B, K, G, rows, cols] tiles."""
  return x.reshape(lay.b, 1, 1, 1, 1)


class Blocks:
  """Inputs padded to whole blocks and grouped [B, len, K, G, H]; tile readers for the loops.

  Padding is never seen: padded keys lie past every ``kv_len`` (<= S) and are masked; padded
  query rows are sliced off the outputs, and their LSE pads to +inf so their P is 0.
  """

  def __init__(self, inputs: Inputs, lay: Layout, params: Params):
    self.lay = lay
    self.params = params
    q = inputs.query.reshape(lay.b, lay.t, lay.kh, lay.g, lay.h)
    self.q = pad_axis(q, 1, lay.t_pad)
    self.k = pad_axis(inputs.key, 1, lay.s_pad)
    self.v = pad_axis(inputs.value, 1, lay.s_pad)
    offsets = (0, 0) if inputs.offsets is None else (inputs.offsets[:, 0], inputs.offsets[:, 1])
    self.pos = Positions(inputs.lengths[:, 0], inputs.lengths[:, 1], *offsets)
    self.schedule = Schedule(params.window, lay.block_q, lay.block_k)
    self.q_seg = pad_axis(inputs.q_segment_ids, 1, lay.t_pad)
    self.kv_seg = pad_axis(inputs.kv_segment_ids, 1, lay.s_pad)
    self.mask = self._dense(inputs.mask)
    self.bias = self._dense(inputs.bias)
    self.manual_axes = _core.varying_axes(inputs.query)
    self.stream = None
    if inputs.dropout_seed is not None:  # per-(batch, head) dropout keys, [B, K, G, 1, 1]
      heads = jnp.arange(lay.kh * lay.g).reshape(1, lay.kh, lay.g, 1, 1)
      batch = jnp.arange(lay.b).reshape(lay.b, 1, 1, 1, 1)
      self.stream = _core.dropout_stream(params, inputs.dropout_seed, batch, heads)

  def carry(self, init):
    """A loop's initial carry, typed like what its body returns (inside `jax.shard_map`, where
    the tiles vary over the manual axes and constants do not)."""
    return tuple(None if x is None else _core.varying_like(x, self.manual_axes) for x in init)

  def _dense(self, x):
    """[B|1, N|1, T, S] -> padded [B|1, K|1, G|1, T_pad, S_pad]."""
    if x is None:
      return None
    lay = self.lay
    groups = (1, 1) if x.shape[1] == 1 else (lay.kh, lay.g)
    x = x.reshape(x.shape[:1] + groups + x.shape[2:])
    return pad_axis(pad_axis(x, 3, lay.t_pad), 4, lay.s_pad)

  def _tile(self, x, q_start, k_start):
    # Two one-axis slices: no literal 0 indices, whose type would differ under x64.
    return rows(rows(x, q_start, self.lay.block_q, axis=3), k_start, self.lay.block_k, axis=4)

  def logits(self, q_blk, k_blk, q_start, k_start):
    """Base-2 logits [B, K, G, bq, bk] of one tile, masked to -inf; also the soft-cap tanh."""
    bq, bk = q_blk.shape[1], k_blk.shape[1]
    qk = jnp.einsum("bqkgh,bskh->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32)
    bias = None if self.bias is None else self._tile(self.bias, q_start, k_start)
    s2, cap_t = _core.logits_base2(qk, self.params, bias)
    q_seg = kv_seg = None
    if self.q_seg is not None:
      q_seg = rows(self.q_seg, q_start, bq)[:, None, None, :, None]
      kv_seg = rows(self.kv_seg, k_start, bk)[:, None, None, None, :]
    diagonal = self.pos.diagonal
    vis = masking.visible(
        (q_start + jnp.arange(bq)).reshape(1, 1, 1, bq, 1),
        (k_start + jnp.arange(bk)).reshape(1, 1, 1, 1, bk),
        self.params.window, diagonal=diagonal if isinstance(diagonal, int)
        else _per_row(diagonal, self.lay), kv_len=_per_row(self.pos.kv_len, self.lay),
        q_segment=q_seg, kv_segment=kv_seg,
        dense_mask=None if self.mask is None else self._tile(self.mask, q_start, k_start))
    return jnp.where(vis, s2, -jnp.inf), cap_t

  def keep(self, q_start, k_start):
    """Dropout keep mask [B, K, G, bq, bk] of one tile (absolute coordinates), or None."""
    if self.stream is None:
      return None
    lay, pos = self.lay, self.pos
    row_ids = (q_start + jnp.arange(lay.block_q)).reshape(1, 1, 1, lay.block_q, 1)
    if isinstance(pos.q_offset, int):
      return dropout.keep(self.stream, row_ids, k_start, lay.block_k, self.params.dropout_rate)
    return dropout.keep(self.stream, row_ids + _per_row(pos.q_offset, lay),
                        k_start + _per_row(pos.kv_offset, lay), lay.block_k,
                        self.params.dropout_rate, even_start=False)

  def q_is_valid(self, q_start):
    """[B, 1, 1, bq]: rows of the block that are not query padding."""
    row_ids = (q_start + jnp.arange(self.lay.block_q)).reshape(1, 1, 1, self.lay.block_q)
    return row_ids < self.pos.q_len.reshape(self.lay.b, 1, 1, 1)
