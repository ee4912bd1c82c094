"""What the Triton kernels share: the optional inputs as one pytree, static sizes, masked tile
loads, and the logits of one (query, key) tile.

jax 0.11.2's Triton lowering does not mask partial blocks and needs every tile to have a
power-of-two shape. So tiles are padded to powers of two (head dim to `config.padded_head_dim`,
blocks to at least 16 for Triton's dot), and every load and store of a tile that can reach past
the array is masked with an explicit ``other=`` value.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxflash import _core
from jaxflash import dropout
from jaxflash import mask_mod as mask_mod_lib
from jaxflash import masking
from jaxflash._core import Inputs, Params
from jaxflash.backends.triton.config import Tiles, padded_head_dim
from jaxflash.masking import Positions
from jaxflash.schedule import Schedule, block_lists, row_spans


class Optional(NamedTuple):
  """The optional inputs of a call, as arrays, BlockSpecs or kernel refs (None when absent).

  Pallas flattens pytrees: a kernel gets an `Optional` of refs shaped like the `Optional` of
  specs it was given, absent fields staying None. So no kernel counts positional refs.
  """

  offsets: object = None  # int32 [B, 2]: (q_offset, kv_offset)
  q_seg: object = None  # int32 [B, T]
  kv_seg: object = None  # int32 [B, S]
  mask: object = None  # int8 [B or 1, N or 1, T, S] (Triton has no boolean memory type)
  bias: object = None  # float [B or 1, N or 1, T, S]
  seed: object = None  # uint32 [2] dropout seed
  # A block table's packed lists (`jaxflash.schedule.BlockLists`), [B, N or 1, rows, width].
  lists: object = None
  # A mask_mod's features (`jaxflash.mask_mod`): int32 [F, B or 1, N or 1, T] and [F', .., S].
  q_feat: object = None
  kv_feat: object = None
  # A score_mod's, likewise, and the arrays its lookups gather from (a tuple, flattened and
  # padded to a power-of-two length: Triton's block shapes).
  score_q_feat: object = None
  score_kv_feat: object = None
  score_tables: object = None

  def specs(self, **makers: Callable) -> "Optional":
    """The same pytree with each present field ``name`` replaced by ``makers[name](array)``."""
    return Optional(*(None if x is None else makers[name](x)
                      for name, x in zip(self._fields, self)))


def optional_inputs(inputs: Inputs) -> Optional:
  """The optional inputs; the block lists are each kernel's own (`with_lists`)."""
  mask = None if inputs.mask is None else inputs.mask.astype(jnp.int8)
  return Optional(offsets=inputs.offsets, q_seg=inputs.q_segment_ids,
                  kv_seg=inputs.kv_segment_ids, mask=mask, bias=inputs.bias,
                  seed=inputs.dropout_seed, q_feat=_pow2_features(inputs.q_features),
                  kv_feat=_pow2_features(inputs.kv_features),
                  score_q_feat=_pow2_features(inputs.score_q_features),
                  score_kv_feat=_pow2_features(inputs.score_kv_features),
                  score_tables=_pow2_tables(inputs.score_tables))


def _pow2_tables(tables):
  if tables is None:
    return None
  return tuple(jnp.pad(t, (0, pl.next_power_of_2(t.shape[0]) - t.shape[0])) for t in tables)


def tables_spec(tables) -> tuple:
  """BlockSpecs of a score_mod's tables: each whole, whatever the grid."""
  return tuple(pl.BlockSpec(t.shape, lambda *_: (0,)) for t in tables)


def _pow2_features(x):
  """Features padded to a power-of-two count (Triton's block shapes)."""
  if x is None:
    return None
  count = pl.next_power_of_2(x.shape[0])
  return jnp.pad(x, [(0, count - x.shape[0])] + [(0, 0)] * 3)


def with_lists(opt: Optional, inputs: Inputs, params: Params, block_q: int, block_k: int,
               transpose: bool = False) -> Optional:
  """``opt`` with the block lists of a kernel of ``block_q`` x ``block_k`` tiles (per key
  block with ``transpose``), padded to a power-of-two width; unchanged without a block table."""
  if inputs.block_table is None:
    return opt
  lists = block_lists(inputs.block_table, params.table_block, params.window, block_q, block_k,
                      inputs.lengths, inputs.offsets, inputs.query.shape[1],
                      inputs.key.shape[1], transpose=transpose).packed
  width = pl.next_power_of_2(lists.shape[-1])
  return opt._replace(lists=jnp.pad(lists, [(0, 0)] * 3 + [(0, width - lists.shape[-1])]))


def list_spans(ref, blocks: int, *row):
  """The `Span`s of one row of block lists: ``ref[*row]`` is a [width] row (`with_lists`).
  (One indexer per load: Triton's lowering takes no ``ref.at[...][...]``.)"""
  # (Literal int indices trip jax 0.11.2's load discharge in interpret mode: int32 scalars.)
  return row_spans(lambda k: ref[row + (jnp.asarray(k, jnp.int32),)], blocks)


def _feature_tiles(rule, shape, rows: list, cols: list):
  """A rule's row and column features (int32 vectors, `jaxflash.mask_mod.to_int32`) as tiles
  of their own dtypes."""
  return ([mask_mod_lib.from_int32(jnp.broadcast_to(x[:, None], shape), d)
           for x, d in zip(rows, rule.row_dtypes)],
          [mask_mod_lib.from_int32(jnp.broadcast_to(x[None, :], shape), d)
           for x, d in zip(cols, rule.col_dtypes)])


def rule_tile(rule, q_idx, kv_idx, rows: list, cols: list):
  """A mask_mod's mask of a tile from its row and column features, or None without one."""
  if rule is None:
    return None
  shape = jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx))
  return rule.tile(shape, q_idx, kv_idx, *_feature_tiles(rule, shape, rows, cols))


def score_fn(rule, q_idx, kv_idx, rows: list, cols: list, tables):
  """A score_mod on a tile as a function of its scores (`jaxflash.mask_mod.Split.tile_fn`):
  its lookups gather from ``tables`` (refs) with a tile of indices."""
  shape = jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx))
  lookup = None if tables is None else (lambda t, flat: plgpu.load(tables[t].at[flat]))
  return rule.tile_fn(shape, q_idx, kv_idx, *_feature_tiles(rule, shape, rows, cols),
                      lookup=lookup)


@dataclasses.dataclass(frozen=True)
class Static:
  """Static sizes a kernel needs; derived once per call from the inputs."""

  seq_q: int  # T
  seq_k: int  # S
  head_dim: int  # H
  head_dim_p: int  # H padded to a power of two
  groups: int  # G = N // K query heads per key/value head
  # Dv, the head dim of V, O and dO (DeepSeek's MLA: Dv 128 under H 192), padded on its own.
  value_dim: int
  value_dim_p: int

  def bounds(self, start, block: int, length: int):
    """Positions of a tile and their in-bounds flags (None when the tile never crosses the end)."""
    pos = start + jnp.arange(block)
    return pos, (pos < length if length % block else None)

  @property
  def dim_ok(self):
    """In-bounds flags of Q and K tiles' columns (None: H is a power of two)."""
    return _dim_ok(self.head_dim, self.head_dim_p)

  @property
  def value_dim_ok(self):
    """In-bounds flags of V, O and dO tiles' columns (None: Dv is a power of two)."""
    return _dim_ok(self.value_dim, self.value_dim_p)


def _dim_ok(dim: int, padded: int):
  return None if dim == padded else jnp.arange(padded) < dim


def static(inputs: Inputs) -> Static:
  q, k, dv = inputs.query, inputs.key, inputs.value.shape[3]
  return Static(seq_q=q.shape[1], seq_k=k.shape[1], head_dim=q.shape[3],
                head_dim_p=padded_head_dim(q.shape[3]), groups=q.shape[2] // k.shape[2],
                value_dim=dv, value_dim_p=padded_head_dim(dv))


def fit(block: int, length: int) -> int:
  """A block size clipped to the sequence (rounded up to a power of two), at least 16."""
  return max(16, min(block, pl.next_power_of_2(length)))


def blocks(tiles: Tiles, inputs: Inputs) -> tuple[int, int]:
  """``(block_q, block_k)`` of one pass for this call's lengths."""
  return fit(tiles.block_q, inputs.query.shape[1]), fit(tiles.block_k, inputs.key.shape[1])


def schedule(inputs: Inputs, params: Params, block_q: int, block_k: int) -> Schedule:
  return Schedule.of(params.window, block_q, block_k, mask=inputs.mask,
                     q_segment_ids=inputs.q_segment_ids)


def feature_rows(ref, index, length_ok, count: int) -> list:
  """``count`` features of a tile's rows or columns: ``ref.at[f, *index]`` for each, masked
  with ``length_ok`` (None: in bounds)."""
  if ref is None:
    return []
  return [load(ref.at[(jnp.int32(f),) + index], mask=length_ok, other=0) for f in range(count)]


def compiler_params(tiles: Tiles):
  return plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _and(a, b):
  if a is None:
    return b
  if b is None:
    return a
  return jnp.logical_and(a, b)


def load(ref, mask, other):
  """Masked tile load; Triton refuses ``other`` without a mask, and in-bounds tiles have none."""
  if mask is None:
    return plgpu.load(ref)
  return plgpu.load(ref, mask=mask, other=other)


def tile_ok(row_ok, col_ok):
  """2-D load/store mask from optional per-row and per-column bounds (None = all in bounds)."""
  return _and(None if row_ok is None else row_ok[:, None],
              None if col_ok is None else col_ok[None, :])


def at(ref, *index):
  """``ref.at[index]``, or None for an absent optional input."""
  return None if ref is None else ref.at[index]


def positions(lengths, offsets) -> Positions:
  """One batch row's `Positions` from its lengths ref/array [2] and offsets [2] (or None)."""
  if offsets is None:
    return Positions(lengths[0], lengths[1])
  return Positions(lengths[0], lengths[1], offsets[0], offsets[1])


def dense_spec(x: jax.Array, block: tuple[int, int], index: Callable):
  """BlockSpec of a [B or 1, N or 1, T, S] mask/bias; ``index(i)`` -> (t block, s block)."""
  bcast_b, bcast_n = x.shape[0] == 1, x.shape[1] == 1
  return pl.BlockSpec(
      (None, None) + block,
      lambda i, b, h: (0 if bcast_b else b, 0 if bcast_n else h) + index(i))


def query_block_specs(opt: Optional, block_q: int, seq_k: int) -> Optional:
  """Specs of the optional inputs for a grid (query block, batch row, head): the forward and dQ."""
  def per_row(shape, b, h):  # batch and head indices into an array [B or 1, N or 1, ...]
    return (b if shape[0] > 1 else 0), (h if shape[1] > 1 else 0)

  return opt.specs(
      offsets=lambda x: pl.BlockSpec((None, 2), lambda i, b, h: (b, 0)),
      q_seg=lambda x: pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)),
      kv_seg=lambda x: pl.BlockSpec((None, seq_k), lambda i, b, h: (b, 0)),
      mask=lambda x: dense_spec(x, (block_q, seq_k), lambda i: (i, 0)),
      bias=lambda x: dense_spec(x, (block_q, seq_k), lambda i: (i, 0)),
      seed=lambda x: pl.BlockSpec(x.shape, lambda i, b, h: (0,)),
      lists=lambda x: pl.BlockSpec((None, None, None, x.shape[-1]),
                                   lambda i, b, h: per_row(x.shape, b, h) + (i, 0)),
      q_feat=lambda x: feature_rows_spec(x, block_q, lambda i: i),
      kv_feat=lambda x: feature_rows_spec(x, seq_k, lambda i: 0),
      score_q_feat=lambda x: feature_rows_spec(x, block_q, lambda i: i),
      score_kv_feat=lambda x: feature_rows_spec(x, seq_k, lambda i: 0),
      score_tables=tables_spec)


def feature_rows_spec(x: jax.Array, length: int, block_of: Callable) -> pl.BlockSpec:
  """BlockSpec of features [F, B or 1, N or 1, L] for a grid (block, batch row, head): every
  feature of one batch row and head, ``length`` positions from block ``block_of(i)``."""
  def index(i, b, h):
    return (0, b if x.shape[1] > 1 else 0, h if x.shape[2] > 1 else 0, block_of(i))
  return pl.BlockSpec((x.shape[0], None, None, length), index)


def folds_scale(params: Params, opt: Optional) -> bool:
  """Whether base-2 logits are just ``c * q @ k.T`` with ``c > 0`` (no cap, bias or
  score_mod), so that a row max of the raw product, times ``c``, is the row max of the
  logits."""
  return (params.logits_soft_cap is None and opt.bias is None and params.score_rule is None
          and params.scale > 0)


def huge_logits(opt: Optional, params: Params) -> bool:
  """Whether logits may be huge and finite (a bias or a score_mod), so that exp2's argument is
  capped (`jaxflash._core.capped_exponent`)."""
  return opt.bias is not None or params.score_rule is not None


def masked_logits(q, k, rows, cols, ok, pos: Positions, params: Params, q_seg, kv_seg, bias_ref,
                  mask_ref, masked: bool = True, raw: bool = False, features=((), ()),
                  score_features=((), ()), derivative: bool = False, tables=None):
  """Base-2 logits of one (query, key) tile, invisible entries at -inf; also the backward's
  chain factor (`_core.logits_base2`; the score_mod's derivative only when ``derivative``).

  ``rows``/``cols`` are the tile's local indices and ``ok`` its in-bounds mask; ``bias_ref`` and
  ``mask_ref`` are refs already positioned on this tile (or None). ``masked=False`` is for tiles
  the schedule names full: every entry is visible, so no element mask is computed. ``raw=True``
  (only where `folds_scale` holds) returns the unscaled ``q @ k.T``, for a caller that applies
  ``scale * log2(e)`` itself, fused into a later multiply-add. ``features`` and
  ``score_features`` are the mask_mod's and the score_mod's (rows, columns) features, and
  ``tables`` the refs its lookups read.
  """
  bias = None if bias_ref is None else load(bias_ref, mask=ok, other=0.0)
  qk = plgpu.dot(q, k, trans_b=True)
  # A mask_mod and a score_mod see absolute positions, as the band and dropout do (their
  # features are the call's own rows' and keys', indexed locally).
  q_abs = masking.shifted(rows, pos.q_offset)[:, None]
  kv_abs = masking.shifted(cols, pos.kv_offset)[None, :]
  score = None
  if params.score_rule is not None:
    score = score_fn(params.score_rule, q_abs, kv_abs, *score_features, tables)
  s2, chain = (qk, None) if raw else _core.logits_base2(qk, params, bias, score, derivative)
  if not masked:
    return s2, chain
  dense = None if mask_ref is None else load(mask_ref, mask=ok, other=0)
  vis = masking.visible(
      rows[:, None], cols[None, :], params.window, diagonal=pos.diagonal, kv_len=pos.kv_len,
      q_segment=None if q_seg is None else q_seg[:, None],
      kv_segment=None if kv_seg is None else kv_seg[None, :],
      dense_mask=None if dense is None else dense != 0)
  by_rule = rule_tile(params.mask_rule, q_abs, kv_abs, *features)
  if by_rule is not None:
    vis = jnp.logical_and(vis, by_rule)
  return jnp.where(vis, s2, -jnp.inf), chain


def dropout_stream(opt: Optional, params: Params, batch, head):
  """Scalar dropout key of one (batch, head), or None without dropout."""
  if opt.seed is None:
    return None
  return _core.dropout_stream(params, opt.seed, batch, head)


def keep(stream, rows, k_start, block_k: int, params: Params, pos: Positions):
  """Dropout keep mask of the tile (local rows x keys k_start ...), or None without dropout.

  The mask is a function of absolute coordinates, so calls over parts of the keys or queries
  (offsets) drop exactly the entries the whole call drops.
  """
  if stream is None:
    return None
  even_start = isinstance(pos.kv_offset, int)  # no offsets: k_start is a multiple of block_k
  return dropout.keep(stream, masking.shifted(rows, pos.q_offset)[:, None],
                      masking.shifted(k_start, pos.kv_offset), block_k, params.dropout_rate,
                      even_start=even_start)


class QueryTile(NamedTuple):
  """A query block held on chip by the forward and dQ kernels (grid: query block, batch, head)."""

  q_start: object
  rows: object  # local row indices
  row_ok: object  # in-bounds flags, or None
  q: object  # [block_q, head_dim_p]
  q_seg: object
  stream: object  # dropout stream key, or None
  pos: Positions
  features: list  # a mask_mod's row features, [block_q] each
  spans: object  # the key blocks to visit from a block table, or None (the schedule's)
  score_features: list  # a score_mod's row features, [block_q] each


def query_tile(q_ref, lengths_ref, opt: Optional, params: Params, st: Static,
               block_q: int, block_k: int) -> QueryTile:
  q_start = pl.program_id(0) * block_q
  rows, row_ok = st.bounds(q_start, block_q, st.seq_q)
  q = load(q_ref, mask=tile_ok(row_ok, st.dim_ok), other=0.0)
  q_seg = None if opt.q_seg is None else load(opt.q_seg, mask=row_ok, other=-1)
  stream = dropout_stream(opt, params, pl.program_id(1), pl.program_id(2))
  features = feature_rows(opt.q_feat, (), row_ok, feature_count(params.mask_rule, "row"))
  spans = None if opt.lists is None else list_spans(opt.lists, pl.cdiv(st.seq_k, block_k))
  score_features = feature_rows(opt.score_q_feat, (), row_ok,
                                feature_count(params.score_rule, "row"))
  return QueryTile(q_start, rows, row_ok, q, q_seg, stream, positions(lengths_ref, opt.offsets),
                   features, spans, score_features)


def feature_count(rule, side: str) -> int:
  """How many row (or column) features a mask_mod's or score_mod's ``rule`` has."""
  if rule is None or rule.kernel_reason is not None:
    return 0
  return len(rule.row_vars if side == "row" else rule.col_vars)


class KeyTile(NamedTuple):
  """Key block ``j`` as the forward and dQ loops see it: indices, bounds, K and key segments."""

  k_start: object
  cols: object
  col_ok: object
  keys: object  # pl.ds over the block's keys
  kv_ok: object  # load mask of K tiles
  v_ok: object  # load mask of V tiles (their head dim is Dv)
  k: object
  kv_seg: object
  features: list  # a mask_mod's column features, [block_k] each (masked blocks only)
  score_features: list  # a score_mod's column features, [block_k] each (every block)


def key_tile(j, k_ref, opt: Optional, st: Static, block_k: int, masked: bool,
             params: Params) -> KeyTile:
  k_start = j * block_k
  cols, col_ok = st.bounds(k_start, block_k, st.seq_k)
  if not masked:
    col_ok = None  # a full block lies below kv_len <= S
  kv_ok, v_ok = tile_ok(col_ok, st.dim_ok), tile_ok(col_ok, st.value_dim_ok)
  keys = pl.ds(k_start, block_k)
  k = load(k_ref.at[keys, :], mask=kv_ok, other=0.0)
  kv_seg = None if opt.kv_seg is None else load(opt.kv_seg.at[keys], mask=col_ok, other=-2)
  features = []
  if masked:  # (full blocks evaluate no mask)
    features = feature_rows(opt.kv_feat, (keys,), col_ok, feature_count(params.mask_rule, "col"))
  score_features = feature_rows(opt.score_kv_feat, (keys,), col_ok,
                                feature_count(params.score_rule, "col"))
  return KeyTile(k_start, cols, col_ok, keys, kv_ok, v_ok, k, kv_seg, features, score_features)


def tile_logits(qt: QueryTile, kt: KeyTile, opt: Optional, params: Params, masked: bool,
                raw: bool = False, derivative: bool = False):
  """`masked_logits` of a (query tile, key tile) pair of the forward or dQ loop."""
  return masked_logits(qt.q, kt.k, qt.rows, kt.cols, tile_ok(qt.row_ok, kt.col_ok), qt.pos,
                       params, qt.q_seg, kt.kv_seg, at(opt.bias, slice(None), kt.keys),
                       at(opt.mask, slice(None), kt.keys), masked, raw,
                       features=(qt.features, kt.features),
                       score_features=(qt.score_features, kt.score_features),
                       derivative=derivative, tables=opt.score_tables)
