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
from jaxflash import mask_mod as mask_mod_lib
from jaxflash import masking
from jaxflash import schedule as schedule_lib
from jaxflash._core import Inputs, Params
from jaxflash.masking import Positions
from jaxflash.schedule import Schedule


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Query and key block sizes (clipped to the sequence lengths). Larger blocks mean fewer,
  bigger XLA ops and a larger temporary tile; on a CPU 128-512 ran within 10% of 256, and 64
  or 1024 up to 2.7x slower (docs/api.md, "On a CPU")."""

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
  hv: int  # the value's head dim, which the output and dO have (it may differ from h)

  @property
  def t_pad(self):
    return -(-self.t // self.block_q) * self.block_q

  @property
  def s_pad(self):
    return -(-self.s // self.block_k) * self.block_k


def layout(inputs: Inputs, config: Config) -> Layout:
  b, t, n, h = inputs.query.shape
  s, kh = inputs.key.shape[1:3]
  return Layout(b, t, s, kh, n // kh, h, min(config.block_q, t), min(config.block_k, s),
                inputs.value.shape[-1])


def pad_axis(x, axis: int, size: int, value=0):
  if x is None or x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def rows(x, start, size, axis=1):
  return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def qk_of(q_blk, k_blk):
  """A tile's Q Kᵀ in float32, [B, K, G, bq, bk]."""
  return jnp.einsum("bqkgh,bskh->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32)


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
    self.schedule = Schedule.of(params.window, lay.block_q, lay.block_k, mask=inputs.mask,
                                q_segment_ids=inputs.q_segment_ids)
    # With a block table, the blocks that any batch row or head visits (all rows are computed
    # together), per query block and per key block.
    self.lists = self.lists_t = None
    if inputs.block_table is not None:
      lists = lambda transpose: schedule_lib.block_lists(  # noqa: E731
          inputs.block_table, params.table_block, params.window, lay.block_q, lay.block_k,
          inputs.lengths, inputs.offsets, lay.t, lay.s, transpose=transpose, union=True)
      self.lists, self.lists_t = lists(False), lists(True)
    self.features = (inputs.q_features, inputs.kv_features)
    self.mask_consts = inputs.mask_consts
    self.score_features = (inputs.score_q_features, inputs.score_kv_features)
    self.score_consts = inputs.score_consts
    self.score_tables = inputs.score_tables
    self.q_seg = pad_axis(inputs.q_segment_ids, 1, lay.t_pad)
    self.kv_seg = pad_axis(inputs.kv_segment_ids, 1, lay.s_pad)
    self.mask = self._dense(None if inputs.mask is None else inputs.mask.astype(jnp.bool_))
    self.bias = self._dense(inputs.bias)
    self.manual_axes = _core.varying_axes(inputs.query)
    self.stream = None
    if inputs.dropout_seed is not None:  # per-(batch, head) dropout keys, [B, K, G, 1, 1]
      heads = jnp.arange(lay.kh * lay.g).reshape(1, lay.kh, lay.g, 1, 1)
      batch = jnp.arange(lay.b).reshape(lay.b, 1, 1, 1, 1)
      self.stream = _core.dropout_stream(params, inputs.dropout_seed, batch, heads)

  def kv_spans(self, i):
    """The visits of query block ``i`` under a block table (None: the schedule's ranges)."""
    return None if self.lists is None else self.lists.spans(0, 0, i)

  def q_spans(self, j):
    """The visits of key block ``j`` under a block table (None: the schedule's ranges)."""
    return None if self.lists_t is None else self.lists_t.spans(0, 0, j)

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

  def logits(self, q_blk, k_blk, q_start, k_start, derivative: bool = False, qk=None):
    """Base-2 logits [B, K, G, bq, bk] of one tile, masked to -inf; also the backward's chain
    factor (`_core.logits_base2`, with the score_mod's derivative when ``derivative``).
    ``qk``: the tile's Q Kᵀ where the caller has it already (`qk_of`)."""
    bq, bk = q_blk.shape[1], k_blk.shape[1]
    if qk is None:
      qk = qk_of(q_blk, k_blk)
    bias = None if self.bias is None else self._tile(self.bias, q_start, k_start)
    q_idx = (q_start + jnp.arange(bq, dtype=jnp.int32)).reshape(1, 1, 1, bq, 1)
    k_idx = (k_start + jnp.arange(bk, dtype=jnp.int32)).reshape(1, 1, 1, 1, bk)
    score = None
    if self.params.score_rule is not None:
      score = lambda z: self._rule_tile(  # noqa: E731
          self.params.score_rule, self.score_features, self.score_consts, q_idx, k_idx,
          q_start, k_start, score=z)
    s2, chain = _core.logits_base2(qk, self.params, bias, score, derivative)
    q_seg = kv_seg = None
    if self.q_seg is not None:
      q_seg = rows(self.q_seg, q_start, bq)[:, None, None, :, None]
      kv_seg = rows(self.kv_seg, k_start, bk)[:, None, None, None, :]
    diagonal = self.pos.diagonal
    vis = masking.visible(
        q_idx, k_idx, self.params.window, diagonal=diagonal if isinstance(diagonal, int)
        else _per_row(diagonal, self.lay), kv_len=_per_row(self.pos.kv_len, self.lay),
        q_segment=q_seg, kv_segment=kv_seg,
        dense_mask=None if self.mask is None else self._tile(self.mask, q_start, k_start))
    if self.params.mask_rule is not None:
      vis = jnp.logical_and(vis, self._rule_tile(self.params.mask_rule, self.features,
                                                 self.mask_consts, q_idx, k_idx, q_start,
                                                 k_start))
    return jnp.where(vis, s2, -jnp.inf), chain

  def _rule_tile(self, rule, rule_features, consts, q_idx, k_idx, q_start, k_start,
                 score=None):
    """A mask_mod's mask of one tile (a score_mod's new ``score``), [B, K, G, bq, bk]: from its
    features and tile rule, or (a rule the kernels cannot run) from the whole function on the
    captured arrays ``consts``. The rule sees absolute positions (the call's offsets added to
    the local ``q_idx``/``k_idx``, as the band and dropout do); its features cover the call's
    own rows and keys, indexed locally."""
    lay = self.lay
    shape = (lay.b, lay.kh, lay.g, lay.block_q, lay.block_k)
    q_idx, k_idx = (jnp.broadcast_to(x, shape) for x in self.absolute(q_idx, k_idx))
    if rule.kernel_reason is not None:
      return self.whole_function(rule, consts, q_idx, k_idx, score)

    def features(x, start, size, dtypes, axis):  # [F, B|1, N|1, L] -> F tiles
      if x is None:
        return []
      x = pad_axis(x, 3, lay.t_pad if axis == 3 else lay.s_pad)
      x = rows(x, start, size, axis=3)
      heads = (1, 1) if x.shape[2] == 1 else (lay.kh, lay.g)
      x = x.reshape(x.shape[:2] + heads + (size,))
      x = x[..., :, None] if axis == 3 else x[..., None, :]
      return [mask_mod_lib.from_int32(jnp.broadcast_to(f, shape), d) for f, d in zip(x, dtypes)]

    q_features, kv_features = rule_features
    rows_of = features(q_features, q_start, lay.block_q, rule.row_dtypes, 3)
    cols_of = features(kv_features, k_start, lay.block_k, rule.col_dtypes, 4)
    if rule.lookups:  # (a score_mod's gathers from its tables)
      tables = self.score_tables
      return rule.tile_fn(shape, q_idx, k_idx, rows_of, cols_of,
                          lookup=lambda t, flat: jnp.take(tables[t], flat))(score)
    return rule.tile(shape, q_idx, k_idx, rows_of, cols_of, score=score)

  def absolute(self, q_idx, k_idx):
    """Local query and key index tiles as the positions a rule sees: padding rows and keys
    clamped into range (the function may index arrays with them), then the call's offsets
    added."""
    lay = self.lay
    q_idx, k_idx = jnp.minimum(q_idx, lay.t - 1), jnp.minimum(k_idx, lay.s - 1)
    if isinstance(self.pos.q_offset, int):
      return q_idx, k_idx
    return (q_idx + _per_row(self.pos.q_offset, lay), k_idx + _per_row(self.pos.kv_offset, lay))

  def whole_function(self, rule, consts, q_idx, k_idx, score=None):
    """``rule``'s whole function on one tile's index tiles (absolute positions, broadcasting to
    [B, K, G, bq, bk]) and the captured arrays ``consts`` (`Split.reference`)."""
    lay = self.lay
    heads = jnp.arange(lay.kh * lay.g, dtype=jnp.int32).reshape(1, lay.kh, lay.g, 1, 1)
    batch = jnp.arange(lay.b, dtype=jnp.int32).reshape(lay.b, 1, 1, 1, 1)
    return rule.reference(batch, heads, q_idx, k_idx, consts=consts, score=score)

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
