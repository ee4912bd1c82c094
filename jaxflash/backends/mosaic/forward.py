"""The Mosaic GPU forward for Hopper (sm90): O and the base-2 LSE, laid out as FlashAttention-3.

Grid (N, query tiles, B), one CTA per ``consumers * block_q`` query rows of one (batch row,
head); with a causal band the tiles that see the most keys launch first. With
``Config.persistent_ctas`` the grid is that many CTAs instead (one per SM by default at D = 64,
and at D = 128 without a causal band), each running a share of the tiles (`_items`, evenly by
causal work) with its K/V ring, turns and Q/O tiles carried from one tile to the next. A CTA is
``Config.consumers`` + 1 warpgroups (two consumers, or three as FlashAttention-3 runs D = 64):

- ``wg`` 0 .. consumers - 1 are consumers. Each owns ``block_q`` query rows (one TMA copy into
  shared memory) and, per key block, computes S = Q Kᵀ with wgmma from shared memory, runs the
  online softmax in registers (base 2, the scale folded into one FMA per entry), and accumulates
  O += P V with wgmma taking P from registers.
- ``wg`` = consumers is the producer. It streams K and V tiles by TMA into a ring of
  ``num_stages`` slots and refills a slot once every consumer has arrived on its "free"
  barrier.

With ``Config.kv_multicast`` (no causal band or window, no block table, an even number of query
tiles) the CTAs run in clusters of two, one pair of query tiles of a (batch row, head) each:
both walk the pair's first tile's key blocks, each producer copies half of every K/V tile into
both CTAs' slots (TMA multicast), and a slot's "free" barrier is a cluster barrier that both
CTAs' consumers arrive on, so L2 serves each K/V byte once per pair (`paired_ctas`).

Intra-warpgroup overlap (``Config.intra_wg_overlap``, FlashAttention-3's): step j issues Q K_jᵀ
and P_{j-1} V_{j-1} in one turn, waits for S alone, and runs block j's softmax while that P V is
in flight; O is rescaled and P_j rounded to 16 bits only after it completes (writing either
earlier would make ptxas serialise every wgmma). The first block's step only computes scores and
the last P V runs after the loop.

Ping-pong: each consumer owns a turn barrier, and the turns go round the consumers in order.
After issuing its Q Kᵀ a consumer signals the next one's turn, and before issuing P V it waits
for its own, so the tensor cores take the consumers' [P V, next Q Kᵀ] pairs in turn while the
others run their softmax. Every consumer but the first waits once before its first tile and
every one but the last signals once after its last, which starts and ends the round (with the
overlap every turn starts with a wait and ends with a signal, so the last consumer signals once
first and the first waits once last). It is one sequence over all of a CTA's tiles, so that no
turn is signalled twice before it is taken. On the GPU the turns are hardware named barriers
(``bar.arrive`` / ``bar.sync``, ids 4 and up; Mosaic GPU uses 0 to 3); in the interpreter they
are mbarriers with the same protocol.

All consumers walk the key blocks of the CTA's ``consumers * block_q`` rows, as named by the
shared `jaxflash.schedule.Schedule`: blocks every row sees in full skip the element mask, the
others apply `jaxflash.masking.visible`'s conditions per entry (the band and the key length as
one key range per row, `jaxflash.masking.key_range`). Out-of-range rows and columns of edge
tiles are zero-filled by TMA on the way in, masked by the key length, and clipped by TMA on the
way out.
Mask, bias and segment-id tiles are read by the consumers from global memory; dropout draws
`jaxflash.dropout`'s mask entry by entry from absolute coordinates.

FP8 (float8 Q, K and V, `jaxflash.fp8`): the same kernel with e4m3/e5m2 wgmma. V is stored
transposed ([B, K, Dv, keys], `_transposed_values`: an FP8 wgmma takes only K-major operands),
P is rounded to e4m3 and handed to the P V wgmma from registers (`_fp8_operand`), and the
descale factors join the scale (query and key) and the epilogue's row factor (value). See
docs/fp8.md.

With ``params.interpret`` the kernel runs in Mosaic GPU's interpreter (tests on a CPU), which
lacks ``run_state`` and wgmma operands in registers: only the P V step differs there.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith
from jaxlib.mlir.dialects import memref
from jaxlib.mlir.dialects import vector

from jaxflash import _core
from jaxflash import dense_mask
from jaxflash import dropout
from jaxflash import fp8
from jaxflash import mask_mod as mask_mod_lib
from jaxflash import masking
from jaxflash._core import Inputs, Params
from jaxflash.backends.mosaic.config import Config, o_view, padded_head_dim
from jaxflash.masking import Positions
from jaxflash.schedule import BlockLists, Schedule, Span, block_lists, total, walk

_ROWS = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a wgmma accumulator
_COLS = plgpu.Layout.WGMMA.reduce(0)  # one value per column


def _smem_tile(shape, dtype, swizzle: int = 128):
  """A shared-memory tile that TMA and wgmma both read: ``swizzle``-byte rows (128: 64 16-bit or
  32 32-bit elements) in 8-row tiles, swizzled. A wgmma contracts whole swizzled rows, so a
  32-row tile as the K side of a product needs the 64-byte swizzle, and so do the tiles it
  meets in other products (A and B in shared memory share one swizzle)."""
  row = swizzle // jnp.dtype(dtype).itemsize
  transforms = (plgpu.TilingTransform((8, row)), plgpu.SwizzleTransform(swizzle))
  return plgpu.SMEM(shape, dtype, transforms=transforms)


# Named barriers of the ping-pong: consumer w's turn is barrier _TURN_ID + w. Mosaic GPU keeps 0
# (the CTA) and 1 + warpgroup (its warpgroup barriers) for itself.
_TURN_ID = 4
_TURN_THREADS = 2 * 128  # one consumer syncs, the other arrives


def _emit(build):
  """Emits ``build()``'s Mosaic GPU instructions in place (no operands, no results)."""
  plgpu.inline_mgpu()(lambda _: build())()


def _named_barrier(instruction: str, other: bool, consumers: int):
  """``bar.sync`` / ``bar.arrive`` on the turn barrier of this consumer, or of the next one
  (the turns go round the ``consumers`` in order)."""

  def build():
    i32 = ir.IntegerType.get_signless(32)
    wg = mgpu.utils.warpgroup_idx(sync=False)
    if other:
      wg = arith.remui(arith.addi(wg, mgpu.utils.c(1, i32)), mgpu.utils.c(consumers, i32))
    barrier_id = arith.addi(wg, mgpu.utils.c(_TURN_ID, i32))
    mgpu.utils.inline_ptx(f"{instruction} $0, {_TURN_THREADS};", barrier_id,
                          has_side_effects=True)

  _emit(build)


def _rows(x, shape):
  """A per-row vector broadcast over the columns of a tile."""
  return lax.broadcast_in_dim(x, shape, [0])


class _Extras(NamedTuple):
  """Optional per-entry inputs, padded to whole tiles (None when the call has none); the
  consumers read their tiles straight from global memory in the wgmma layout."""

  q_segment_ids: jax.Array | None = None  # int32 [B, rows of all CTAs]
  kv_segment_ids: jax.Array | None = None  # int32 [B, keys of all blocks]
  # A dense mask packed 32 entries to a word (`packed_tile`), word-major: int32 [B or 1, N or 1,
  # keys / 32, rows] (for dK/dV, packed along the queries: [..., rows / 32, keys]).
  mask: jax.Array | None = None
  bias: jax.Array | None = None  # [B or 1, N or 1, rows, keys], the caller's float dtype
  dropout_seed: jax.Array | None = None  # uint32 [2], or [4] (see `_core.dropout_stream`)
  # A block table's visits (`jaxflash.schedule.BlockLists`), per CTA tile of rows: [B, N or 1,
  # tiles, width]; a kernel whose tiles differ takes its own (the dK/dV kernel's, per key tile).
  lists: jax.Array | None = None
  # A mask_mod's features, int32 [F, B or 1, N or 1, rows] and [F', ..., keys].
  q_features: jax.Array | None = None
  kv_features: jax.Array | None = None
  # With block lists: the kernel's work items (a CTA tile of one batch row and head), heaviest
  # first (`by_cost`), int32 [items], each ``(batch * heads + head) * tiles + tile``.
  order: jax.Array | None = None
  # The forward's attention sinks in base-2 units, float32 [N] (`_core.finish_rows`).
  sinks: jax.Array | None = None
  # A score_mod's features, as a mask_mod's.
  score_q_features: jax.Array | None = None
  score_kv_features: jax.Array | None = None
  score_kv_scalars: jax.Array | None = None  # (`Inputs.score_kv_scalars`)
  # A score_mod's lookups on every diagonal, padded (`pad_band`), int32 [F, B or 1, N or 1,
  # 2 * base]: a tile's values come from one window of it (`band_tiles`).
  score_band: jax.Array | None = None
  # A score_mod's row term, left out of the logits and added to the LSE (`without_row_term`),
  # in base-2 units: float32 [B or 1, N or 1, rows].
  score_row_term: jax.Array | None = None
  # An FP8 call's descale factors (`jaxflash.fp8`), float32: [B, N] or per row [B, N, rows];
  # [B, K] or per key [B, K, keys]; and [B, K].
  q_descale: jax.Array | None = None
  k_descale: jax.Array | None = None
  v_descale: jax.Array | None = None
  # `Config.mma_row_sums`: [8, keys of a block] in V's FP8 dtype, ones in row 0 and zeros
  # below: the B of the wgmma that sums each row of P.
  row_sum_ones: jax.Array | None = None


def _iota(shape, dim: int):
  """Indices along ``dim`` of a tile in the wgmma accumulator's layout."""
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def feature_tiles(ref, batch, head, index, layout, broadcast, dtypes, made=(),
                  wanted=None) -> list:
  """A mask_mod's features ([F, B or 1, N or 1, L] int32) at ``index`` (rows or keys of a
  tile), loaded in ``layout``, broadcast to the tile by ``broadcast`` and cast back to
  ``dtypes`` (`jaxflash.mask_mod.from_int32`); the f-th is ``made[f]`` instead (a vector in
  ``layout`` and its own dtype) where that is not None, and None where ``wanted[f]`` is False
  (Mosaic GPU infers no layout for a vector nothing reads)."""
  if not dtypes:
    return []
  b = batch if ref.shape[1] > 1 else 0
  h = head if ref.shape[2] > 1 else 0
  made = tuple(made) + (None,) * (len(dtypes) - len(made))
  wanted = (True,) * len(dtypes) if wanted is None else wanted
  return [None if not want else broadcast(x) if x is not None else
          mask_mod_lib.from_int32(broadcast(plgpu.load(ref.at[f, b, h, index], layout=layout,
                                                       optimized=False)), dtype)
          for f, (dtype, x, want) in enumerate(zip(dtypes, made, wanted))]


def pad_band(values: jax.Array, t: int) -> jax.Array:
  """A score_mod's lookups on every diagonal (`Inputs.score_bands`, [F, B or 1, N or 1, T + S],
  entry ``i`` at ``q_idx - kv_idx = i - S``) padded so that every kernel tile's diagonals lie
  inside: int32 [F, B or 1, N or 1, 2 * base], entry ``j`` at diagonal ``j - base``. ``base``
  exceeds every padded length by at least 512 (past any tile's width); diagonals past the call's
  (padding entries, never visible) take the nearest value. `band_tiles` reads a tile's window."""
  s = values.shape[-1] - t
  base = _round_up(max(t, s), 512) + 512
  diagonal = jnp.arange(2 * base, dtype=jnp.int32) - base
  return values[..., jnp.clip(diagonal + s, 0, t + s - 1)]


def band_tiles(ref, batch, head, rows, keys, transposed: bool, dtypes,
               interpret: bool) -> list:
  """A score_mod's lookups on one tile, in the wgmma layout and their own dtypes: from
  `pad_band`'s ``ref``, the tile of query rows ``rows`` and keys ``keys`` (`pl.ds`), a [key,
  query] tile where ``transposed``. A tile's values depend on ``q_idx - kv_idx`` alone, so it
  reads one window of rows + keys - 1 diagonals (`_diagonal_tile`), not a value per entry."""
  b = batch if ref.shape[1] > 1 else 0
  h = head if ref.shape[2] > 1 else 0
  first, across = (keys, rows) if transposed else (rows, keys)
  base = ref.shape[3] // 2
  # The window starts at the tile's lowest diagonal: its last column's first row, or for a
  # [key, query] tile its last row's first column.
  if transposed:
    start = across.start - first.start + base - (first.size - 1)
  else:
    start = first.start - across.start + base - (across.size - 1)
  shape = (first.size, across.size)
  return [mask_mod_lib.from_int32(_diagonal_tile(
      ref.at[f, b, h, pl.ds(start, first.size + across.size - 1)], shape, transposed,
      interpret), dtype) for f, dtype in enumerate(dtypes)]


def _read_only_ref():
  """`plgpu.RefType` of a ref the inline code only reads. From jax 0.12.1 a kernel may not write
  to an input passed as an array, and an inline ref counts as written unless it says
  ``write=False``; older jax has no such flag (nor the check)."""
  try:
    return plgpu.RefType(write=False)
  except TypeError:
    return plgpu.RefType()


_READ_ONLY_REF = _read_only_ref()  # (once, not at every tile's trace)


def _diagonal_tile(window_ref, shape, transposed: bool, interpret: bool):
  """int32 tile ``shape`` in the wgmma layout whose entry (r, c) is ``window_ref[r - c + C - 1]``
  (C columns), or ``window_ref[c - r + R - 1]`` (R rows) where ``transposed``.

  On the GPU each thread loads the entries it holds itself: its 64 entries of a 64 x 128 tile
  lie on 34 diagonals (rows r and r + 8, columns 2l, 2l + 1 of every 8), so it loads 34 values
  where a plain tile load read 64, and a warp's load touches about two 32-byte sectors of one
  window where a tile's touched eight of its rows. (A tile of every diagonal's values, one load per
  entry, cost as much memory traffic as K and V together.)"""
  rows, cols = shape
  if interpret:  # (Mosaic GPU's interpreter runs a warpgroup as one thread: a gather)
    r = lax.broadcasted_iota(jnp.int32, shape, 0)
    c = lax.broadcasted_iota(jnp.int32, shape, 1)
    return window_ref[...][c - r + rows - 1 if transposed else r - c + cols - 1]

  @plgpu.inline_mgpu(arg_types=(_READ_ONLY_REF,),
                     return_type=plgpu.ShapeDtypeStruct(shape, jnp.int32,
                                                        layout=plgpu.Layout.WGMMA))
  def load(ctx, window):
    del ctx
    layout = mgpu.WGMMA_LAYOUT
    i32 = ir.IntegerType.get_signless(32)
    const = lambda x: mgpu.utils.c(x, i32)  # noqa: E731
    # As `TiledLayout.thread_idxs`: an entry's place in the tile is a part of the thread's
    # own (warp and lane) plus a part of the register's, which never carries across a row.
    strides = layout.tiling.tile_strides((cols, 1))
    own_strides = [const(x) for x in strides[-layout.tiled_tiling_rank:]]
    own = arith.addi(mgpu.utils.dyn_dot(layout.warp_indices(), own_strides),
                     mgpu.utils.dyn_dot(layout.lane_indices(), own_strides))
    own_row, own_col = arith.divui(own, const(cols)), arith.remui(own, const(cols))
    if transposed:
      first = arith.addi(arith.subi(own_col, own_row), const(rows - 1))
    else:
      first = arith.addi(arith.subi(own_row, own_col), const(cols - 1))
    loaded = {}

    def value(offset: int):
      if offset not in loaded:
        at = arith.index_cast(ir.IndexType.get(), arith.addi(first, const(offset)))
        loaded[offset] = memref.load(window, [at])
      return loaded[offset]

    registers = np.empty(layout.registers_shape(shape), dtype=object)
    for index in np.ndindex(registers.shape):
      row, col = divmod(sum(i * s for i, s in zip(index, strides)), cols)
      offsets = [(col + e - row) if transposed else (row - col - e)
                 for e in range(layout.vector_length)]
      registers[index] = vector.from_elements(
          ir.VectorType.get((layout.vector_length,), i32), [value(o) for o in offsets])
    return mgpu.FragmentedArray(_registers=registers, _layout=layout, _is_signed=True)

  return load(window_ref)


def computed_columns(rule, scalars, batch, head, keys, layout, banded: bool = False) -> list:
  """The column features of ``rule`` that the kernel computes from its key indices
  (`jaxflash.mask_mod.Split.computed_cols`: a value per key it holds, no load from memory), as
  vectors over ``keys`` (a `pl.ds`) in ``layout``, each in the place of its feature; None for
  those to load. ``scalars`` are the batch row's and head's values they read (int32 [F, B or 1,
  N or 1, 1], or None). ``banded``: the rule takes its lookups as band tiles, and only the
  columns it then reads are wanted."""
  if not rule.computed_cols or (banded and not any(map(rule.banded_reads,
                                                       rule.computed_cols))):
    return []
  kv = keys.start + plgpu.broadcasted_iota(jnp.int32, (keys.size,), 0, layout=layout)
  values = []
  if rule.col_scalars:
    b = batch if scalars.shape[1] > 1 else 0
    h = head if scalars.shape[2] > 1 else 0
    # (Each as a vector over the keys: Mosaic GPU bit-casts vectors, not scalars.)
    values = [mask_mod_lib.from_int32(lax.broadcast_in_dim(scalars[f, b, h, 0], kv.shape, ()),
                                      dtype)
              for f, dtype in enumerate(rule.col_scalar_dtypes)]
  made = rule.column_values(kv, values)
  return [made.get(v) for v in rule.col_vars]


def rule_mask(params: Params, extras: _Extras, batch, head, shape, q_idx, kv_idx, rows, keys,
              broadcast_rows, broadcast_keys, row_layout, key_layout):
  """The mask_mod's mask of a ``shape`` tile: its tile rule on the tile's query and key
  indices (functions that build them: Mosaic GPU infers no layout for a tile nothing reads)
  and features (``rows``/``keys`` index the features; ``broadcast_*`` put a row or key vector
  on the tile). Call it only with a mask_mod."""
  return _rule_tile(params.mask_rule, extras.q_features, extras.kv_features, batch, head,
                    shape, q_idx, kv_idx, rows, keys, broadcast_rows, broadcast_keys, row_layout,
                    key_layout)


def _rule_tile(rule, q_features, kv_features, batch, head, shape, q_idx, kv_idx, rows, keys,
               broadcast_rows, broadcast_keys, row_layout, key_layout):
  """A mask_mod's mask of a ``shape`` tile from its features (`rule_mask` says what the
  arguments are)."""
  return rule.tile(shape, q_idx, kv_idx,
                   feature_tiles(q_features, batch, head, rows, row_layout, broadcast_rows,
                                 rule.row_dtypes),
                   feature_tiles(kv_features, batch, head, keys, key_layout, broadcast_keys,
                                 rule.col_dtypes))


def score_of(params: Params, extras: _Extras, batch, head, shape, q_idx, kv_idx, rows, keys,
             broadcast_rows, broadcast_keys, row_layout, key_layout, transposed: bool = False,
             deferred: bool = False):
  """The score_mod of a ``shape`` tile as a function of its scores (arguments as `rule_mask`;
  ``transposed`` for a [key, query] tile), or None without one. Its features, lookups and
  index tiles are loaded and built here, outside the function: the backward differentiates it
  (`jax.jvp`), and Mosaic GPU's loads have no derivative. ``deferred``: a function that
  returns it instead, loading the lookups when called; a backward calls it once S is done, so
  that the tile of lookups does not hold registers while the products run (on an H200, ptxas
  spilled 520 bytes in a backward kernel with the loads first, 108 with them deferred, and
  forward+backward of a relative-position table at 4k took 3.13 ms instead of 3.32; with
  `band_tiles`' window loads, first or right after the products were issued, the dK/dV and dQ
  kernels still ran 5-7% and 4% slower than deferred)."""
  inputs = score_inputs(params, extras, batch, head, q_idx, kv_idx, rows, keys, broadcast_rows,
                        broadcast_keys, row_layout, key_layout, transposed, deferred)
  if inputs is None:
    return None
  if deferred:
    return functools.partial(score_fn, params, shape, inputs)
  return score_fn(params, shape, inputs)


def score_inputs(params: Params, extras: _Extras, batch, head, q_idx, kv_idx, rows, keys,
                 broadcast_rows, broadcast_keys, row_layout, key_layout,
                 transposed: bool = False, deferred: bool = False):
  """What a score_mod's tile rule reads besides the scores: ``(q tile, kv tile, row features,
  column features, lookups)``, each index tile None where the rule does not read it, the
  lookups None without `_Extras.score_band`; None without a score_mod. Arguments as
  `score_of`; ``deferred``: the lookups are a function that loads them (`score_fn`)."""
  rule = params.score_rule
  if rule is None:
    return None
  banded = extras.score_band is not None
  wanted = lambda variables: (  # noqa: E731
      tuple(map(rule.banded_reads, variables)) if banded else None)
  rows_of = feature_tiles(extras.score_q_features, batch, head, rows, row_layout,
                          broadcast_rows, rule.row_dtypes, wanted=wanted(rule.row_vars))
  cols_of = feature_tiles(extras.score_kv_features, batch, head, keys, key_layout,
                          broadcast_keys, rule.col_dtypes,
                          computed_columns(rule, extras.score_kv_scalars, batch, head, keys,
                                           key_layout, banded),
                          wanted=wanted(rule.col_vars))
  q_tile = q_idx() if rule.reads(mask_mod_lib.Q, banded) else None
  kv_tile = kv_idx() if rule.reads(mask_mod_lib.KV, banded) else None
  bands = None
  if banded:
    bands = functools.partial(band_tiles, extras.score_band, batch, head, rows, keys,
                              transposed, rule.band_dtypes, params.interpret)
    if not deferred:
      bands = bands()
  return q_tile, kv_tile, rows_of, cols_of, bands


def score_fn(params: Params, shape, inputs):
  """The score_mod of a ``shape`` tile as a function of its scores, from `score_inputs`."""
  if inputs is None:
    return None
  q_tile, kv_tile, rows_of, cols_of, bands = inputs
  if callable(bands):  # (deferred lookups, loaded now: outside the function a jvp takes)
    bands = bands()
  return lambda z: params.score_rule.tile(shape, q_tile, kv_tile, rows_of, cols_of, score=z,
                                          bands=bands)


# 2**f on [-1/2, 1/2] to a relative 7.5e-5 (below bf16's and fp16's rounding of P): a cubic
# fitted to the relative error on Chebyshev nodes (by iteratively reweighted least squares).
_EXP2_CUBIC = (0.9999280725736999, 0.6932609896018652, 0.24261113975108045, 0.055171655376573786)
_ROUNDING = 12582912.0  # 1.5 * 2**23: adding it rounds a float32 of magnitude < 2**22 to an integer
_EXP2_FLOOR = -125.0  # below it 0 (ex2.approx.ftz gives 0 from -126): the result stays normal


def exp2_polynomial(z: jax.Array, interpret: bool = False) -> jax.Array:
  """2**z of a float32 tile on the FMA and integer units: z = j + f with j an integer and f in
  [-1/2, 1/2] (by adding and subtracting `_ROUNDING`, which leaves j in the low bits of the
  sum), 2**f by `_EXP2_CUBIC`, and 2**j added to its exponent bits. 0 below `_EXP2_FLOOR` and
  at -inf; NaN stays NaN. Meant for z <= 0 (softmax logits less their row max).

  XLA's simplifier folds (x + c) - c to x, which would make f 0: where XLA runs the kernel
  (``interpret``, Mosaic GPU's interpreter) the sum goes through an optimization barrier. The
  kernel's own lowering does not reassociate (no fast-math flags on its adds)."""
  clamped = jnp.maximum(z, _EXP2_FLOOR)
  shifted = clamped + _ROUNDING  # j in the mantissa's low bits: its ulp is 1
  if interpret:
    shifted = lax.optimization_barrier(shifted)
  f = clamped - (shifted - _ROUNDING)
  c0, c1, c2, c3 = _EXP2_CUBIC
  poly = ((c3 * f + c2) * f + c1) * f + c0  # in [0.70, 1.42]: exponent field 126 or 127
  # The sum's bits are those of 1.5 * 2**23 plus j, and (1.5 * 2**23's bits) << 23 wraps to 0,
  # so its bits shifted by 23 are j << 23: j added to the polynomial's exponent field.
  bits = (lax.bitcast_convert_type(poly, jnp.int32)
          + lax.shift_left(lax.bitcast_convert_type(shifted, jnp.int32), jnp.int32(23)))
  return jnp.where(z < _EXP2_FLOOR, 0.0, lax.bitcast_convert_type(bits, jnp.float32))


def exp2_mixed(z: jax.Array, poly_cols: int, interpret: bool = False) -> jax.Array:
  """2**z of a [rows, keys] tile: its first ``poly_cols`` key columns by `exp2_polynomial`, the
  rest on the exp units (`Config.exp2_poly_cols`). In the wgmma layout a thread holds two
  columns of every eight, so each thread computes the same share of its entries either way."""
  if not poly_cols:
    return jnp.exp2(z)
  if poly_cols == z.shape[1]:
    return exp2_polynomial(z, interpret)
  return jnp.concatenate([exp2_polynomial(z[:, :poly_cols], interpret),
                          jnp.exp2(z[:, poly_cols:])], axis=1)


def _descale_of(ref, batch, head, rows, layout):
  """An FP8 factor of one (batch row, head): a scalar from [B, heads], or the ``rows`` of
  [B, heads, rows] in ``layout``."""
  if ref.ndim == 2:
    return ref[batch, head]
  return plgpu.load(ref.at[batch, head, rows], layout=layout, optimized=False)


def packed_tile(words, batch, head, first_word, rows, shape):
  """The boolean ``shape`` tile of a dense mask packed 32 entries to a word (`_Extras.mask`):
  its rows are ``rows`` (a `pl.ds` of the words' last axis) and its columns the bits of words
  ``first_word``, ``first_word + 1``, ... One word of every row per 32 columns is loaded as a
  row vector, a sixteenth of the int8 tile's loads; each entry then picks its word and bit (in
  the wgmma layout a register's word is fixed: columns 8i + 2(lane % 4) + {0, 1} are in word
  i // 4)."""
  if shape[1] % 32:
    raise ValueError(f"a packed mask's tiles are whole words wide, got {shape}")
  b = batch if words.shape[0] > 1 else 0
  h = head if words.shape[1] > 1 else 0
  cols = _iota(shape, 1)
  tile = None
  for w in range(shape[1] // 32):
    word = _rows(plgpu.load(words.at[b, h, first_word + w, rows], layout=_ROWS,
                            optimized=False), shape)
    tile = word if tile is None else jnp.where(cols >= 32 * w, word, tile)
  return (lax.shift_right_logical(tile, cols & 31) & 1) != 0


def _entry_tile(ref, batch, head, rows, keys):
  """The [rows, keys] tile of a [B or 1, N or 1, T, S] mask or bias, in the wgmma layout."""
  b = batch if ref.shape[0] > 1 else 0
  h = head if ref.shape[1] > 1 else 0
  # Not "optimized": straight from global memory, whose rows need not suit vectorised loads.
  return plgpu.load(ref.at[b, h, rows, keys], layout=plgpu.Layout.WGMMA, optimized=False)


class _Grid(NamedTuple):
  """How CTAs map to work items, each item being the ``consumers * block_q`` query rows of one
  (batch row, head): one CTA per item (``ctas`` None), or ``ctas`` persistent CTAs, CTA ``c``
  taking one item of each consecutive run of ``ctas`` (see `_items`)."""

  batch: int
  heads: int
  q_tiles: int
  ctas: int | None
  # `Config.kv_multicast`: CTAs run in clusters of two, one pair of query tiles of a (batch row,
  # head) each (an even ``q_tiles``; ``ctas`` even, two a cluster).
  paired_ctas: bool = False


def by_cost(lists: jax.Array, batch: int, heads: int, groups: int = 1) -> jax.Array:
  """Work items in decreasing order of their visits (a block table's `BlockLists` [B, N or 1,
  tiles, W], one row per item; ``groups`` rows of heads make one item of a kernel that walks a
  group's heads): int32 [batch * heads * tiles], item ``(b * heads + h) * tiles + tile``. A
  table's rows need not cost alike at all (a causal-like mask under a call without a band),
  so kernels launch, or persistent CTAs take, the heavy ones first (longest first)."""
  visits = lists[..., 0] + lists[..., 1]  # [B, N or 1, tiles]
  if visits.shape[1] > 1 and groups > 1:
    visits = visits.reshape(visits.shape[0], -1, groups, visits.shape[2]).sum(axis=2)
  elif groups > 1:
    visits = visits * groups
  visits = jnp.broadcast_to(visits, (batch, heads, visits.shape[2])).reshape(-1)
  if visits.shape[0] > _RANKED_ITEMS:
    return jnp.argsort(-visits, stable=True).astype(jnp.int32)
  return _by_rank(visits)


# Up to this many items `by_cost` ranks them by comparing every pair (n² compares in one fused
# pass) rather than sorting: XLA's sort of a 4k call's 2048 items took an H200 14 µs, three
# times per forward+backward, as long as the pairs of 4096 items.
_RANKED_ITEMS = 4096


def _by_rank(visits: jax.Array) -> jax.Array:
  """`by_cost`'s order of items with ``visits`` [n], from each item's rank: the items that
  come before it (more visits, or as many and an earlier index), scattered to their places."""
  index = jnp.arange(visits.shape[0], dtype=jnp.int32)
  before = jnp.logical_or(visits[None, :] > visits[:, None],
                          jnp.logical_and(visits[None, :] == visits[:, None],
                                          index[None, :] < index[:, None]))
  rank = jnp.sum(before, axis=1, dtype=jnp.int32)
  return jnp.zeros_like(index).at[rank].set(index, unique_indices=True)


def launch_place(head, tile, batch, tiles: int, batches: int):
  """A CTA's place in launch order: Pallas walks a (heads, tiles, batch) grid row-major, batch
  fastest."""
  return (head * tiles + tile) * batches + batch


def ordered(order_ref, linear, heads: int, tiles: int):
  """The item at place ``linear`` of ``order_ref`` (`by_cost`) as (batch, head, tile)."""
  code = order_ref[linear]
  tile = lax.rem(code, _i32(tiles))
  rest = lax.div(code, _i32(tiles))
  return lax.div(rest, _i32(heads)), lax.rem(rest, _i32(heads)), tile


def _items(grid: _Grid, heavy_first: bool, order_ref=None, paired: bool = False):
  """``(count, item)``: how many items this CTA runs and ``item(i) -> (batch, head, tile)``.

  Persistent CTAs share out the items in rounds of ``ctas`` consecutive ones, CTA ``c`` taking
  the ``c``-th of each round. Without a causal band every item costs the same, and the query
  tiles of one head are consecutive so that CTAs running at once share K and V in L2. With one,
  items go by cost, heaviest tiles of every (batch row, head) first, and odd rounds run
  backwards (``c`` takes the round's ``ctas - 1 - c``-th item): a CTA that took a heavier item
  in one round takes a lighter one in the next, so every CTA ends within about one item of the
  others. (Tile-fastest order there gave CTA ``c`` tile ``c mod q_tiles`` every round when
  ``q_tiles`` divides ``ctas``: a 4.3x spread of work between CTAs at 4 tiles a head.)

  With a block table (``order_ref``, `by_cost`) items go by their number of visits instead:
  the grid's CTAs in launch order (batch fastest), or persistent CTAs in rounds as above.
  ``paired`` (a band, no table, persistent CTAs): `_paired_items`. In clusters of two CTAs
  (`_Grid.paired_ctas`) a cluster takes a pair of tiles, one a CTA (`_cluster_items`).
  """
  if grid.paired_ctas:  # (no band, no table: every tile of a head costs the same)
    rank = lax.axis_index("cluster")
    if grid.ctas is None:
      coords = (lax.axis_index("batch"), lax.axis_index("heads"),
                2 * lax.axis_index("q_tiles") + rank)
      return 1, lambda i: coords
    return _cluster_items(grid, lax.axis_index("ctas"), rank)
  if grid.ctas is None:
    if order_ref is not None:
      linear = launch_place(lax.axis_index("heads"), lax.axis_index("q_tiles"),
                            lax.axis_index("batch"), grid.q_tiles, grid.batch)
      coords = ordered(order_ref, linear, grid.heads, grid.q_tiles)
      return 1, lambda i: coords
    tile = lax.axis_index("q_tiles")
    if heavy_first:
      tile = grid.q_tiles - 1 - tile  # the rows that see the most keys first
    coords = lax.axis_index("batch"), lax.axis_index("heads"), tile
    return 1, lambda i: coords
  return _persistent_items(grid, heavy_first, lax.axis_index("ctas"), order_ref, paired)


def _persistent_items(grid: _Grid, heavy_first: bool, cta, order_ref=None,
                      paired: bool = False):
  """`_items` for persistent CTA ``cta`` (a pure function of it, for tests)."""
  if paired and heavy_first and order_ref is None:
    return _paired_items(grid, cta)
  ctas = _i32(grid.ctas)
  total = grid.batch * grid.heads * grid.q_tiles
  if order_ref is not None:  # rounds over the items by cost, alternate rounds backwards
    def place(i):
      return jnp.where(lax.rem(i, _i32(2)) == 0, cta, ctas - 1 - cta)

    rounds = total // grid.ctas
    tail = (place(_i32(rounds)) < total % grid.ctas).astype(jnp.int32)
    return _i32(rounds) + tail, lambda i: ordered(order_ref, i * ctas + place(i), grid.heads,
                                                  grid.q_tiles)
  if not heavy_first:
    def item(i):
      w = cta + i * ctas
      tile = lax.rem(w, _i32(grid.q_tiles))
      head = lax.rem(lax.div(w, _i32(grid.q_tiles)), _i32(grid.heads))
      return lax.div(w, _i32(grid.q_tiles * grid.heads)), head, tile

    return lax.div(total - cta + (ctas - 1), ctas), item

  def place(i):  # this CTA's place in round i
    return jnp.where(lax.rem(i, _i32(2)) == 0, cta, ctas - 1 - cta)

  def item(i):
    w = i * ctas + place(i)
    rows = grid.batch * grid.heads
    tile = grid.q_tiles - 1 - lax.div(w, _i32(rows))
    row = lax.rem(w, _i32(rows))  # heads fastest: a GQA group's heads share K and V
    return lax.div(row, _i32(grid.heads)), lax.rem(row, _i32(grid.heads)), tile

  rounds = total // grid.ctas  # full rounds; the last one holds total % ctas items
  tail = (place(_i32(rounds)) < total % grid.ctas).astype(jnp.int32)
  return _i32(rounds) + tail, item


def _cluster_items(grid: _Grid, cluster, rank):
  """`_items` for CTA ``rank`` (0 or 1) of persistent cluster ``cluster`` (`_Grid.paired_ctas`,
  a pure function of both, for tests): unit ``u`` is tiles ``2p`` and ``2p + 1`` of (batch row,
  head) ``u // pairs`` with ``p = u % pairs``, the cluster's two CTAs taking one each, and
  cluster ``c`` takes units ``c, c + clusters, ...``: consecutive clusters take a head's pairs
  in order, so that the clusters running at once share K and V in L2 too."""
  clusters, pairs = _i32(grid.ctas // 2), grid.q_tiles // 2
  units = grid.batch * grid.heads * pairs

  def item(i):
    u = cluster + i * clusters
    row = lax.div(u, _i32(pairs))
    tile = 2 * lax.rem(u, _i32(pairs)) + rank
    return lax.div(row, _i32(grid.heads)), lax.rem(row, _i32(grid.heads)), tile

  return lax.div(units - cluster + (clusters - 1), clusters), item


def _paired_items(grid: _Grid, cta):
  """`_persistent_items` in pairs of query tiles (``Config.paired_tiles``): unit ``u`` is
  tiles ``q_tiles - 1 - p`` and ``p`` of (batch row, head) ``u // pairs`` with ``p = u % pairs``,
  and CTA ``c`` takes units ``c, c + ctas, ...``. Along a causal band a tile's key blocks grow
  by one a tile, so every pair costs the same and the rounds need no alternating order to end
  together; consecutive units are one head's, so the CTAs running at once share K and V. With
  an odd tile count each (batch row, head) has its middle tile left, a unit of one tile: those
  come after all the pairs, continuing the rounds (the CTAs one pair short take them first)."""
  ctas, pairs = grid.ctas, grid.q_tiles // 2
  rows = grid.batch * grid.heads
  units = rows * pairs
  singles = rows * (grid.q_tiles % 2)
  my_pairs = lax.div(_i32(units + ctas - 1) - cta, _i32(ctas))
  first_single = lax.rem(cta + _i32(ctas - units % ctas), _i32(ctas))  # (cta - units) mod ctas
  my_singles = lax.div(_i32(singles + ctas - 1) - first_single, _i32(ctas))  # (first < ctas)

  def item(i):
    in_pair = i < 2 * my_pairs
    unit = cta + lax.div(i, _i32(2)) * ctas
    pair_row, p = lax.div(unit, _i32(max(pairs, 1))), lax.rem(unit, _i32(max(pairs, 1)))
    pair_tile = jnp.where(lax.rem(i, _i32(2)) == 0, grid.q_tiles - 1 - p, p)
    single_row = first_single + (i - 2 * my_pairs) * ctas
    row = jnp.where(in_pair, pair_row, single_row)
    tile = jnp.where(in_pair, pair_tile, _i32(pairs))
    return lax.div(row, _i32(grid.heads)), lax.rem(row, _i32(grid.heads)), tile

  return 2 * my_pairs + my_singles, item


def _i32(x: int):
  return jnp.asarray(x, jnp.int32)


def _for_items(count, run_item):
  """Runs ``first_block = run_item(i, first_block)`` over the CTA's items; returns the number of
  key blocks visited."""
  if isinstance(count, int):  # one item: no loop
    return run_item(_i32(0), _i32(0))
  return lax.fori_loop(_i32(0), count, run_item, _i32(0))


def _kernel(q_ref, k_ref, v_ref, lengths_ref, offsets_ref, extras: _Extras, out_ref, lse_ref,
            q_smems, k_smem, v_smem, lse_smem, o_smems, q_ready, k_ready, v_ready, k_free, v_free,
            turns, ones_smem, ones_ready, kf_smem, kf_ready, *, params: Params, config: Config,
            schedule: Schedule, groups: int, grid: _Grid, o_union: bool):
  block_q, block_kv, stages = config.block_q, config.block_kv, config.num_stages
  consumers = config.consumers
  if o_union:  # one memory, two views: the Q tiles, and O's tiles over the same bytes
    q_smems, o_smems = q_smems
  # An FP8 call's V tiles are stored transposed, [Dv, keys] (`_transposed_values`), and its P
  # is rounded to e4m3 (`_fp8_operand`).
  quantized = fp8.is_fp8(q_smems.dtype)
  value_dim = v_smem.shape[-2 if quantized else -1]  # (O's head dim: V's, maybe not Q's)
  row_sums = ones_smem is not None  # (`Config.mma_row_sums`)
  key_factors = kf_smem is not None  # an FP8 call's factor per key, in a ring beside K's
  wg = lax.axis_index("wg")
  heavy_first = config.heavy_first and schedule.window.right is not None
  count, item = _items(grid, heavy_first, extras.order, config.paired_tiles)
  rows_per_cta = config.rows_per_cta

  def where(i):
    """Item ``i``'s batch row, head, first row, positions, its key blocks as `Span`s (every
    consumer walks exactly these, and the producer loads them in the same order), and the
    first row that they are the blocks of: in a cluster (`_Grid.paired_ctas`) the pair's
    first tile's, so that both CTAs walk the same blocks even where the second tile lies past
    the query length (its rows then come out as zeros)."""
    batch, head, tile = item(i)
    cta_start = tile * rows_per_cta
    offsets = () if offsets_ref is None else (offsets_ref[batch, 0], offsets_ref[batch, 1])
    pos = Positions(lengths_ref[batch, 0], lengths_ref[batch, 1], *offsets)
    blocks_of = cta_start
    if grid.paired_ctas:
      blocks_of = (tile - lax.axis_index("cluster")) * rows_per_cta
    if extras.lists is not None:
      spans = BlockLists(extras.lists).spans(batch, head, tile)
    else:
      spans = schedule.kv_spans(blocks_of, pos)
    return batch, head, cta_start, pos, spans, blocks_of

  # The K/V ring runs on across items: the n-th block the CTA visits (n counts from 0 over all
  # its items) sits in slot n % stages. Items carry the count of blocks before them.
  def slot_of(n):
    return lax.rem(n, jnp.asarray(stages, n.dtype))

  def pass_turn():  # to the next consumer: its matmuls may go after the ones just issued
    if params.interpret:
      plgpu.barrier_arrive(turns.at[lax.rem(wg + 1, jnp.asarray(consumers, wg.dtype))])
    else:
      _named_barrier("bar.arrive", other=True, consumers=consumers)

  def await_turn():  # until the consumer before has issued its matmuls
    if params.interpret:
      plgpu.barrier_wait(turns.at[wg])
    else:
      _named_barrier("bar.sync", other=False, consumers=consumers)

  @pl.when(wg < consumers)
  def _consumer():
    plgpu.set_max_registers(config.registers, action="increase")
    q_buffers = config.q_buffers

    def q_buffer(i):
      """Item i's Q tile and its barrier: items alternate between buffers, if two. (The index
      stays traced, never a literal 0, which run_state could not close over.)"""
      index = wg if q_buffers == 1 else lax.rem(i, jnp.asarray(2, i.dtype)) * consumers + wg
      return q_smems.at[index], q_ready.at[index]

    # A 16-bit O of a one-item CTA goes out through its Q tile's memory (`o_view`): the tile
    # itself where V's head dim is Q's, the first rows of an O-wide view of it where V's is
    # narrower, an FP8 call's O a piece of columns at a time; otherwise through a tile of its own.
    if o_union:
      o_smem = o_smems.at[wg].at[pl.ds(0, block_q)]
    else:
      o_smem = q_smems.at[wg] if o_smems is None else o_smems.at[wg]
    o_in_q = o_union or o_smems is None
    o_cols = o_smem.shape[-1]  # (O's columns per piece: all of them but in an FP8 call)

    def load_q(i):
      i = _i32(i)  # (a literal 0 is int64 under jax_enable_x64)
      batch, head, tile = item(i)
      q_start = tile * rows_per_cta + wg * block_q
      q_smem, ready = q_buffer(i)
      plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_start, block_q), head], q_smem, ready)

    load_q(0)
    if row_sums:  # the ones tile, loaded once by the producer
      plgpu.barrier_wait(ones_ready.at[0])
      ones = ones_smem.T  # [keys, 8]: P's row sums in column 0
      sums_zero = plgpu.layout_cast(jnp.zeros((block_q, 8), jnp.float32), plgpu.Layout.WGMMA)
    # The turns go round the consumers over the blocks of all the CTA's items as one sequence,
    # consumer 0 first. A turn starts where a consumer awaits it and ends where it passes it on:
    # without the overlap a turn runs from before a P V to after the next Q Kᵀ, so every
    # consumer but 0 waits once before its first and every one but the last passes once after
    # its last; with it, every turn is awaited and passed within a step, so the last consumer
    # hands consumer 0 the first one and consumer 0 takes the last consumer's last.
    if config.intra_wg_overlap:
      pl.when(wg == consumers - 1)(pass_turn)
    else:
      pl.when(wg >= 1)(await_turn)

    def run_item(i, first_block):
      batch, head, cta_start, pos, spans, _ = where(i)
      visits = total(spans)
      q_start = cta_start + wg * block_q

      def slot_at(n):  # the ring slot of this item's n-th visit
        return slot_of(first_block + n)

      q_smem, q_loaded = q_buffer(i)
      plgpu.barrier_wait(q_loaded)
      if q_buffers == 2:  # the next item's Q goes to the other buffer, free since the last item
        pl.when(i + 1 < count)(lambda: load_q(i + 1))

      if not config.intra_wg_overlap:  # (with the overlap each step waits for its own K)
        pl.when(visits > 0)(lambda: plgpu.barrier_wait(k_ready.at[slot_at(_i32(0))]))

      # This consumer's rows (the dropout keys, the key range and the epilogue use them).
      q_rows = q_start + plgpu.broadcasted_iota(jnp.int32, (block_q,), 0, layout=_ROWS)

      # Dropout: the keep mask of absolute coordinates (`jaxflash.dropout`), one hash per entry.
      row_key = None
      if extras.dropout_seed is not None:
        stream = _core.dropout_stream(params, extras.dropout_seed, batch, head)
        row_key = dropout.row_keys(stream, masking.shifted(q_rows, pos.q_offset))

      # The band and the key length as one key range per row, computed once per item: a masked
      # block then costs one compare per bound and entry (`masking.key_range`).
      first_key, last_key = masking.key_range(q_rows, schedule.window, diagonal=pos.diagonal,
                                              kv_len=pos.kv_len)

      # An FP8 call's factors: the query's (per row or per head) times the key's (per head)
      # scale the scores; a per-key factor multiplies each block's columns.
      qk_descale, v_descale, kv_head = None, None, None
      if quantized:
        kv_head = lax.div(head, jnp.asarray(groups, head.dtype))
        qk_descale = _descale_of(extras.q_descale, batch, head, pl.ds(q_start, block_q), _ROWS)
        if extras.k_descale.ndim == 2:
          qk_descale = qk_descale * extras.k_descale[batch, kv_head]
        v_descale = extras.v_descale[batch, kv_head]

      def visible(j, rows, keys, shape):
        """The element mask of key block ``j``: band, key length, segments, dense mask (the
        conditions of `masking.visible`, the first two by row from ``first_key``/``last_key``)."""
        cols = _iota(shape, 1)
        start = j * block_kv
        # (Without a band side, a bound is the same for every row: a scalar.)
        by_row = lambda x: x if jnp.ndim(x) == 0 else _rows(x, shape)
        conds = [cols <= by_row(last_key - start)]  # the key length always bounds it
        if first_key is not None:
          conds.append(cols >= by_row(first_key - start))
        if extras.q_segment_ids is not None:
          q_ids = plgpu.load(extras.q_segment_ids.at[batch, rows], layout=_ROWS,
                             optimized=False)
          kv_ids = plgpu.load(extras.kv_segment_ids.at[batch, keys], layout=_COLS,
                              optimized=False)
          conds.append(_rows(q_ids, shape) == lax.broadcast_in_dim(kv_ids, shape, [1]))
        if extras.mask is not None:
          conds.append(packed_tile(extras.mask, batch, head, j * (block_kv // 32), rows, shape))
        if params.mask_rule is not None:  # (Mosaic GPU infers no layout for an unread tile)
          # (Its index tiles are absolute positions, as dropout's: offsets added.)
          conds.append(rule_mask(params, extras, batch, head, shape,
                                 lambda: _rows(masking.shifted(q_rows, pos.q_offset), shape),
                                 lambda: masking.shifted(start + cols, pos.kv_offset),
                                 rows, keys, lambda x: _rows(x, shape),
                                 lambda x: lax.broadcast_in_dim(x, shape, [1]), _ROWS, _COLS))
        return functools.reduce(jnp.logical_and, conds)

      def scores(j, slot, masked: bool, also=None):
        """S = Q K_jᵀ and what block j's softmax reads from memory (`block_inputs`): issues
        the wgmma, then ``also()`` (more matmuls to issue in the same turn), passes the turn,
        loads the block's inputs while the matmuls run, and waits for S alone."""

        def qk(s_ref):
          plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].T)
          if also is not None:
            also()
          pass_turn()
          inputs = block_inputs(j, masked)
          # Each wgmma is its own commit group: S is done once at most ``also``'s are pending.
          return plgpu.wgmma_accumulator_load(s_ref, wait_n=0 if also is None else 1), inputs

        s, inputs = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
        return s, inputs

      def block_inputs(j, masked: bool):
        """What block j's softmax reads besides S: ``(bias tile, score_mod inputs, element
        mask)``, None where the call has none. Loaded (and the element mask evaluated) while
        Q K_jᵀ is on the tensor cores, so that global memory's latency hides behind the matmul
        instead of following it. (Not an FP8 call's per-key factors: `softmax` loads them.)"""
        rows, keys = pl.ds(q_start, block_q), pl.ds(j * block_kv, block_kv)
        shape = (block_q, block_kv)
        bias = None
        if extras.bias is not None:
          bias = _entry_tile(extras.bias, batch, head, rows, keys)
        score = score_inputs(params, extras, batch, head, lambda: _rows(q_rows, shape),
                             lambda: j * block_kv + _iota(shape, 1), rows, keys,
                             lambda x: _rows(x, shape),
                             lambda x: lax.broadcast_in_dim(x, shape, [1]), _ROWS, _COLS)
        mask = visible(j, rows, keys, shape) if masked else None
        return bias, score, mask

      def softmax(j, slot, s, m, l, masked: bool, inputs):
        """One block of the online softmax: ``(p, m_new, l_new, alpha)``, P in float32
        (dropped entries zeroed) and alpha the rescale of everything before; ``inputs`` are
        the block's `block_inputs`, ``slot`` its ring slot."""
        bias, score, mask = inputs
        shape = (block_q, block_kv)
        if key_factors:  # an FP8 call's factor per key
          # Read once S is done, not with the block's other inputs while its matmul runs: a
          # 256-key tile's factors take 64 registers of each thread, which made ptxas spill 628
          # bytes across the wait at D = 128, and the per-token FP8 forward ran 407 TFLOP/s
          # instead of 633 (H200, 2026-11-28). They come from shared memory, where the
          # producer copied them with the block's K: read from global memory at this point,
          # each block's softmax waited for them.
          plgpu.barrier_wait(kf_ready.at[slot])
          factors = plgpu.load(kf_smem.at[slot], layout=_COLS, optimized=False)
          s = s * lax.broadcast_in_dim(factors, shape, [1])
        score = score_fn(params, shape, score)
        # The row max is taken of unscaled values and scaled once (max(c x) = c max(x) for
        # c > 0), so that c x - m is one fused multiply-add per entry, a multiply per entry
        # less than scaling the tile first: x is the raw scores with a plain positive scale
        # (c = scale log2(e)), else the natural logits (c = log2(e), `_core.logits`).
        folded = (params.logits_soft_cap is None and bias is None and score is None
                  and params.scale > 0)
        if qk_descale is not None and not folded:
          s = s * (_rows(qk_descale, shape) if jnp.ndim(qk_descale) else qk_descale)
        x = s if folded else _core.logits(s, params, bias, score)[0]
        if masked:
          x = jnp.where(mask, x, -jnp.inf)
        c = params.scale * _core.LOG2_E if folded else _core.LOG2_E
        if folded and qk_descale is not None:  # (descale factors are positive)
          c = c * qk_descale
        # A row that has seen no visible key keeps m = -inf and is shifted by 0 instead, so that
        # exp2 stays finite and the row stays at l = 0, acc = 0. NaN logits make m, l and acc
        # NaN: the row comes out NaN, as in jax.nn. (A bias or a score_mod may give -inf
        # anywhere.)
        m_new = jnp.maximum(m, x.max(axis=1) * c)
        huge_logits = bias is not None or score is not None  # (`_core.capped_exponent`)
        finite = not masked and not huge_logits
        m_shift = m_new if finite else jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_shift)
        scaled = x * (_rows(c, x.shape) if jnp.ndim(c) else c)
        z = _core.capped_exponent(scaled - _rows(m_shift, x.shape), huge_logits)
        p = exp2_mixed(z, config.exp2_poly_cols, params.interpret)
        # The undropped sum: dropout leaves the LSE alone. (With `mma_row_sums` the tensor
        # cores add P's sum where P V runs: `pv_turn`, `overlapped`.)
        l = l * _rows(alpha, l.shape) if row_sums else l * alpha + p.sum(axis=1)
        if row_key is not None:  # dropped entries leave P V only; 1 / P(keep) is applied once
          cols = masking.shifted(j * block_kv + _iota(p.shape, 1), pos.kv_offset)
          p = jnp.where(dropout.keep_entries(_rows(row_key, p.shape), cols,
                                             params.dropout_rate), p, 0.0)
        return p, m_new, l, alpha

      def v_operand(slot):
        """V of ``slot`` as the P V matmul's B ([keys, Dv])."""
        return v_smem.at[slot].T if quantized else v_smem.at[slot]

      def plain_pv(p16, slot):
        """P V as a plain dot (Mosaic GPU's interpreter, on a CPU)."""
        v = v_smem[slot].T if quantized else v_smem[slot]
        return jnp.dot(p16, v, preferred_element_type=jnp.float32)

      # `mma_row_sums`: l is a [block_q, 8] tile in the wgmma layout, P's products with the
      # ones tile (column 0; the others stay zero) added entry by entry, scaled by each block's
      # rescale like O, and its columns added up once, after the last block (`run_item`),
      # instead of by two shuffles and adds per row in every turn. Each block's product starts
      # at zero and joins l in float32: an FP8 wgmma keeps few bits of a long sum, and a whole
      # row's, carried across blocks in one accumulator, came out 13-31% short at 16k.
      def plain_sums(p16):
        """P's product with the ones tile by a plain dot (the interpreter)."""
        return jnp.dot(p16, ones_smem[...].T, preferred_element_type=jnp.float32)

      def rounded(p):
        """P as the next P V takes it from registers: 16-bit, or an FP8 call's e4m3."""
        if not quantized:
          return p.astype(q_smem.dtype)
        p8 = p.astype(jnp.float8_e4m3fn)
        return p8 if params.interpret else _fp8_operand(p8)

      def pv_turn(acc, l, p16, slot, meanwhile):
        """In this consumer's next turn: O += P V (V from ``slot``), and with `mma_row_sums`
        l += P's row sums, running ``meanwhile()`` while the matmuls are in flight; then frees
        the V slot. Returns ``(acc, l)``."""
        with jax.named_scope("fwd_turn"):  # (named for benchmarks/dev/forward_trace.py)
          plgpu.barrier_wait(v_ready.at[slot])
          await_turn()  # the tensor cores are ours again
        if params.interpret:
          # Mosaic GPU's interpreter (tests on a CPU) has neither run_state nor a wgmma operand
          # in registers: there P V is a plain dot of the same tiles.
          acc = acc + plain_pv(p16, slot)
          if row_sums:
            l = l + plain_sums(p16)
          meanwhile()
        elif row_sums:
          def pv_and_sums(refs):
            acc_ref, sums_ref = refs
            plgpu.wgmma(acc_ref, p16, v_operand(slot))
            plgpu.wgmma(sums_ref, p16, ones)
            meanwhile()

          with jax.named_scope("fwd_pv"):  # (the scope ends once the matmuls are done)
            acc, sums = pl.run_state(pv_and_sums)((plgpu.ACC.init(acc),
                                                   plgpu.ACC.init(sums_zero)))
          l = l + sums
        else:
          def pv(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_operand(slot))
            meanwhile()

          with jax.named_scope("fwd_pv"):
            acc = pl.run_state(pv)(plgpu.ACC.init(acc))  # accumulates in place
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, l

      def step(n, j, carry, masked: bool):
        """Visit n (block j), one step at a time: S, softmax, then P V (the ping-pong turn
        spans this block's P V and the next block's Q Kᵀ)."""
        acc, m, l = carry
        slot = slot_at(n)
        with jax.named_scope("fwd_scores"):
          s, inputs = scores(j, slot, masked)
        with jax.named_scope("fwd_softmax"):
          p, m_new, l, alpha = softmax(j, slot, s, m, l, masked, inputs)
          p16 = rounded(p)
          acc = acc * _rows(alpha, acc.shape)
          acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))

        # Computed outside `pv_turn`'s run_state, which must not close over constants.
        next_slot, has_next = slot_at(n + 1), n + 1 < visits

        def wait_next_k():  # while the P V matmul runs
          pl.when(has_next)(lambda: plgpu.barrier_wait(k_ready.at[next_slot]))

        acc, l = pv_turn(acc, l, p16, slot, wait_next_k)
        return acc, m_new, l

      # Intra-warpgroup overlap (`Config.intra_wg_overlap`): step j issues Q K_jᵀ and then
      # P_{j-1} V_{j-1} in one turn, and runs block j's softmax while the P V matmul is still
      # in flight; O is rescaled once that matmul is done. The first block only computes
      # scores (`first`) and the last P V runs after the loop (`last`).
      def first(n, j, carry, masked: bool):
        acc, m, l, _ = carry
        slot = slot_at(n)
        plgpu.barrier_wait(k_ready.at[slot])
        await_turn()
        s, inputs = scores(j, slot, masked)
        p, m, l, _ = softmax(j, slot, s, m, l, masked, inputs)
        return acc, m, l, rounded(p)

      def overlapped(n, j, carry, masked: bool):
        acc, m, l, p_prev = carry
        slot, prev = slot_at(n), slot_at(n - 1)
        with jax.named_scope("fwd_turn"):
          plgpu.barrier_wait(k_ready.at[slot])
          plgpu.barrier_wait(v_ready.at[prev])
          await_turn()
        sums = None  # (`mma_row_sums`: P_{j-1}'s row sums, at block j-1's scale)
        if params.interpret:  # the interpreter's P V is a plain dot (see `pv_turn`)
          acc = acc + plain_pv(p_prev, prev)
          if row_sums:
            sums = plain_sums(p_prev)
          s, inputs = scores(j, slot, masked)
          p, m, l, alpha = softmax(j, slot, s, m, l, masked, inputs)
        else:
          def block(refs):
            acc_ref, p_ref, m_ref, l_ref, alpha_ref, *sums_ref = refs

            def also():  # P_{j-1} V_{j-1}, and P_{j-1}'s row sums (`mma_row_sums`)
              plgpu.wgmma(acc_ref, p_prev, v_operand(prev))
              if row_sums:
                plgpu.wgmma(sums_ref[0], p_prev, ones)

            with jax.named_scope("fwd_scores"):
              s, inputs = scores(j, slot, masked, also=also)
            with jax.named_scope("fwd_softmax"):
              p_ref[...], m_ref[...], l_ref[...], alpha_ref[...] = softmax(
                  j, slot, s, m, l, masked, inputs)

          # run_state waits for every wgmma when it ends: P_{j-1} V_{j-1} is then in acc. O and
          # P_{j-1} are the in-flight matmul's operands, so nothing may write their registers
          # before then: O is rescaled, and P_j rounded to 16 bits, only afterwards (else ptxas
          # serialises every wgmma, warning C7513).
          # (`fwd_block` holds the step's `fwd_scores` and `fwd_softmax`; the rest of it is the
          # wait for P_{j-1} V_{j-1} after the softmax.)
          with jax.named_scope("fwd_block"):
            acc, p, m, l, alpha, *sums = pl.run_state(block)(
                (plgpu.ACC.init(acc), p_scratch(p_prev), m, l, m)
                + ((plgpu.ACC.init(sums_zero),) if row_sums else ()))
          sums = sums[0] if row_sums else None
        if sums is not None:  # (the softmax scaled l by alpha already; P_{j-1}'s sums join)
          l = l + sums * _rows(alpha, sums.shape)
        plgpu.barrier_arrive(v_free.at[prev])
        with jax.named_scope("fwd_rescale"):
          return acc * _rows(alpha, acc.shape), m, l, rounded(p)

      def p_scratch(p_prev):
        """A float32 tile in the accumulator's layout for the next P (an FP8 P operand has the
        8-bit layout, so its zeros are made afresh)."""
        if not quantized:
          return jnp.zeros_like(p_prev, jnp.float32)
        return plgpu.layout_cast(jnp.zeros((block_q, block_kv), jnp.float32), plgpu.Layout.WGMMA)

      def last(n, carry):
        acc, m, l, p16 = carry
        acc, l = pv_turn(acc, l, p16, slot_at(n), pass_turn)
        return acc, m, l, p16

      init = (plgpu.layout_cast(jnp.zeros((block_q, value_dim), jnp.float32),
                                plgpu.Layout.WGMMA),
              plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), _ROWS),
              sums_zero if row_sums else plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32),
                                                           _ROWS))
      if config.intra_wg_overlap:
        p_init = plgpu.layout_cast(
            jnp.zeros((block_q, block_kv), jnp.float8_e4m3fn if quantized else q_smem.dtype),
            plgpu.Layout.WGMMA_8BIT if quantized else plgpu.Layout.WGMMA)
        carry = walk(spans, first, init + (p_init,), count=1)
        carry = walk(spans, overlapped, carry, skip=1)
        acc, m, l, _ = lax.fori_loop(jnp.maximum(visits - 1, 0), visits, last, carry)
      else:
        acc, m, l = walk(spans, step, init)
      if row_sums:  # l is a [block_q, 8] tile (the comment above `plain_sums`)
        l = l.sum(axis=1)
      if grid.ctas is not None and q_buffers == 1 and not o_in_q:
        # Q is no longer read: the next item's loads while O goes out.
        pl.when(i + 1 < count)(lambda: load_q(i + 1))

      # A row is empty when it saw no visible key (l == 0) or lies past q_len (full blocks skip
      # the element mask, so padding rows accumulate there); it gives zeros and an LSE of +inf.
      # NaN != 0, so a NaN row stays NaN.
      seen = jnp.logical_and(q_rows < pos.q_len, l != 0.0)
      sink2 = None if extras.sinks is None else extras.sinks[head]
      term2 = None
      if extras.score_row_term is not None:
        terms = extras.score_row_term
        term2 = plgpu.load(terms.at[batch if terms.shape[0] > 1 else 0,
                                    head if terms.shape[1] > 1 else 0,
                                    pl.ds(q_start, block_q)], layout=_ROWS, optimized=False)
      factor, lse2 = _core.finish_rows(m, l, seen, sink2, term2)
      if row_key is not None:
        factor = factor * params.keep_scale
      if v_descale is not None:
        factor = factor * v_descale
      out = jnp.where(_rows(seen, acc.shape), acc * _rows(factor, acc.shape), 0.0)
      if grid.ctas is not None:
        # The previous item's O and LSE tiles must have left shared memory. Only the thread
        # that issued their stores waits, so the warpgroup meets before anyone overwrites them.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if not params.interpret:  # the interpreter runs a warpgroup as one thread
          _emit(mgpu.utils.warpgroup_barrier)  # bar.sync of this warpgroup's 128 threads
      lse_smem.at[wg][...] = lse2
      o_rows = out_ref.at[batch, pl.ds(q_start, block_q), head]
      whole = o_cols == value_dim
      for piece in range(value_dim // o_cols):
        if piece:  # the last piece has left the tile (see above)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          if not params.interpret:
            _emit(mgpu.utils.warpgroup_barrier)
        first = piece * o_cols
        o_smem[...] = (out if whole else out[:, first:first + o_cols]).astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_rows if whole else o_rows.at[:, pl.ds(first, o_cols)])
        if not piece:
          plgpu.copy_smem_to_gmem(lse_smem.at[wg],
                                  lse_ref.at[batch, head, pl.ds(q_start, block_q)])
      if grid.ctas is not None and o_in_q:
        # O left through the Q tile: the next item's Q loads there once the stores read it.
        @pl.when(i + 1 < count)
        def _():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          if not params.interpret:
            _emit(mgpu.utils.warpgroup_barrier)
          load_q(i + 1)
      return first_block + visits

    _for_items(count, run_item)
    if config.intra_wg_overlap:
      pl.when(wg == 0)(await_turn)
    else:
      pl.when(wg < consumers - 1)(pass_turn)
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == consumers)
  def _producer():
    plgpu.set_max_registers(config.producer_registers, action="decrease")
    if row_sums:  # the ones tile, once (`Config.mma_row_sums`)
      plgpu.copy_gmem_to_smem(extras.row_sum_ones, ones_smem, ones_ready.at[0])

    # In a cluster each CTA copies half of every K/V tile into both CTAs' slots (multicast).
    multicast = "cluster" if grid.paired_ctas else None

    def run_item(i, first_block):
      batch, head, _, pos, spans, blocks_of = where(i)
      kv_head = lax.div(head, jnp.asarray(groups, head.dtype))
      if extras.lists is None:  # one flat loop over the consumers' runs of blocks
        lo, _, _, hi = schedule.kv_blocks(blocks_of, pos)
        spans = (Span(False, hi - lo, lambda m: lo + m),)

      def load(ref, smem, ready, j, slot):
        keys = pl.ds(j * block_kv, block_kv)
        plgpu.copy_gmem_to_smem(ref.at[batch, keys, kv_head], smem.at[slot], ready.at[slot],
                                collective_axes=multicast)

      def load_v(j, slot):  # an FP8 call's V is [B, K, Dv, keys]
        if not quantized:
          return load(v_ref, v_smem, v_ready, j, slot)
        tile = v_ref.at[batch, kv_head, pl.ds(0, value_dim), pl.ds(j * block_kv, block_kv)]
        plgpu.copy_gmem_to_smem(tile, v_smem.at[slot], v_ready.at[slot],
                                collective_axes=multicast)

      def visit(n, j, carry, masked):
        del masked
        n = first_block + n
        slot = slot_of(n)
        refill = n >= stages  # the first pass round the ring finds every slot free
        pl.when(refill)(lambda: plgpu.barrier_wait(k_free.at[slot]))
        load(k_ref, k_smem, k_ready, j, slot)  # K goes first: the consumers need it first
        pl.when(refill)(lambda: plgpu.barrier_wait(v_free.at[slot]))
        if key_factors:
          # (A slot's factors are read in its block's softmax, which ends before that block's
          # P V frees its V: so they are refilled after V's release, not K's.)
          plgpu.copy_gmem_to_smem(
              extras.k_descale.at[batch, kv_head, pl.ds(j * block_kv, block_kv)],
              kf_smem.at[slot], kf_ready.at[slot])
        load_v(j, slot)
        return carry

      walk(spans, visit, _i32(0))
      return first_block + total(spans)

    blocks = _for_items(count, run_item)

    observe_last_releases(blocks, stages, k_free, v_free)


def observe_last_releases(visits, stages: int, *free_barriers):
  """A producer's epilogue: waits for the last release of every ring slot after ``visits``
  fills, so that no barrier phase goes unwaited before the CTA ends (Mosaic GPU's interpreter
  checks this; on the GPU it costs nothing)."""

  @pl.loop(jnp.maximum(visits - stages, 0), visits)
  def _(n):
    slot = lax.rem(n, jnp.asarray(stages, n.dtype))
    for free in free_barriers:
      plgpu.barrier_wait(free.at[slot])


def _transposed_values(v, hvp: int, permuted: bool = True):
  """An FP8 call's V as the kernel reads it, [B, K, hvp, keys] (keys padded to whole 128-byte
  swizzled rows, as TMA asks): FP8 wgmma takes only K-major operands, and in P V the keys are
  the contracted axis. With ``permuted`` the keys of every 16 are in `_FP8_KEY_ORDER`, the order
  in which `_fp8_operand` hands P's columns to the tensor cores (the interpreter's plain dot
  takes them in order)."""
  v = _pad(v, _round_up(v.shape[1], 128), hvp)
  if not permuted:
    return jnp.transpose(v, (0, 2, 3, 1))
  # Key 8h + 2l + b of each 16 goes to place 4l + 2h + b: with the 16 keys as axes (h, l, b) of
  # sizes (2, 4, 2), a swap of h and l. As a transpose (folded into the one that moves the keys
  # last) XLA copies V once; indexed by `_FP8_KEY_ORDER` it gathered, 195 us of a 2.4 ms call
  # at 16k, 16 heads (H200, 2026-11-28).
  b, keys, heads, dims = v.shape
  v = v.reshape(b, keys // 16, 2, 4, 2, heads, dims)
  return jnp.transpose(v, (0, 5, 6, 1, 3, 2, 4)).reshape(b, heads, dims, keys)


# Which key of each 16 sits at each place of an FP8 P operand (`_fp8_operand`): the wgmma
# accumulator gives a thread columns 2l, 2l + 1, 8 + 2l, 9 + 2l of each 16 (l: its lane in the
# quad), and an 8-bit A operand takes the four bytes a thread holds as columns 4l ... 4l + 3.
_FP8_KEY_ORDER = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)


def _fp8_operand(p8):
  """An e4m3 P tile in the wgmma accumulator's layout as an 8-bit A operand in registers,
  without moving a byte: each thread's two pairs of every 16 columns become one group of four.
  This permutes the columns of every 16 (`_FP8_KEY_ORDER`); V's keys are stored in the same
  order, so P V is unchanged (FlashAttention-3 does the same)."""

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                     return_type=plgpu.ShapeDtypeStruct(p8.shape, p8.dtype,
                                                        layout=plgpu.Layout.WGMMA_8BIT))
  def regroup(ctx, pairs):
    del ctx
    registers = np.empty(mgpu.WGMMA_LAYOUT_8BIT.registers_shape(pairs.shape), dtype=object)
    for index in np.ndindex(registers.shape):  # (.., block of 16 columns, .., row half, ..)
      lo = list(index)
      lo[1] = 2 * index[1]
      hi = list(lo)
      hi[1] += 1
      registers[index] = mgpu.utils.vector_concat([pairs.registers[tuple(lo)],
                                                   pairs.registers[tuple(hi)]])
    return mgpu.FragmentedArray(_registers=registers, _layout=mgpu.WGMMA_LAYOUT_8BIT,
                                _is_signed=None)

  return regroup(p8)


def _descales(inputs: Inputs, rows: int, keys: int) -> dict:
  """An FP8 call's factors for the kernel (`_Extras`): 1 where the call has none; per row or
  per key ones transposed to [B, heads, L] and padded to ``rows`` / ``keys``."""
  b, _, n, _ = inputs.query.shape
  kh = inputs.key.shape[2]
  out = {}
  for name, heads, length in (("q_descale", n, rows), ("k_descale", kh, keys),
                              ("v_descale", kh, None)):
    d = getattr(inputs, name)
    if d is None:
      d = jnp.ones((b, heads), jnp.float32)
    elif d.shape[1] == 1:
      d = d[:, 0]
    else:
      d = _pad_to(jnp.transpose(d, (0, 2, 1)), (b, heads, length))
    out[name] = d.astype(jnp.float32)
  return out


def _pad(x, length: int, hp: int):
  """``x`` [B, L, heads, H] zero-padded to ``length`` rows and ``hp`` columns (no copy when it
  already has them). Padding keys are masked by the key length; padding rows are sliced off."""
  _, rows, _, h = x.shape
  if (rows, h) == (length, hp):
    return x
  return jnp.pad(x, [(0, 0), (0, length - rows), (0, 0), (0, hp - h)])


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def _pad_to(x, shape):
  """Zero-pads the trailing dims of ``x`` up to ``shape`` (no copy when they match)."""
  if x.shape == tuple(shape):
    return x
  return jnp.pad(x, [(0, n - m) for m, n in zip(x.shape, shape)])


def _extras(inputs: Inputs, rows: int, keys: int) -> _Extras:
  """The optional per-entry inputs padded to ``rows`` x ``keys`` (every tile the kernel reads
  lies inside; padding entries are never visible: keys past the length are masked, rows past
  T are not written). The block lists are each kernel's own (`with_lists`)."""
  q_ids, kv_ids, mask, bias = (inputs.q_segment_ids, inputs.kv_segment_ids, inputs.mask,
                               inputs.bias)
  if q_ids is not None:
    q_ids = _pad_to(q_ids.astype(jnp.int32), (q_ids.shape[0], rows))
    kv_ids = _pad_to(kv_ids.astype(jnp.int32), (kv_ids.shape[0], keys))
  if mask is not None:
    words = inputs.mask_words
    if words is None:
      words = dense_mask.pack_local(mask).by_keys
    mask = _pad_to(words, words.shape[:2] + (keys // 32, rows))
  if bias is not None:
    bias = _pad_to(bias, bias.shape[:2] + (rows, keys))
  q_features = _padded_features(inputs.q_features, rows)
  kv_features = _padded_features(inputs.kv_features, keys)
  return _Extras(q_ids, kv_ids, mask, bias, inputs.dropout_seed, None, q_features, kv_features,
                 score_q_features=_padded_features(inputs.score_q_features, rows),
                 score_kv_features=_padded_features(inputs.score_kv_features, keys),
                 score_kv_scalars=inputs.score_kv_scalars)


def _padded_features(features, length: int):
  """Features [F, B or 1, N or 1, L] padded to ``length`` positions (None stays None)."""
  return None if features is None else _pad_to(features, features.shape[:3] + (length,))


def with_lists(extras: _Extras, inputs: Inputs, params: Params, block_q: int, block_k: int,
               transpose: bool = False) -> _Extras:
  """``extras`` with the block lists of a kernel of ``block_q`` x ``block_k`` tiles (per key
  tile with ``transpose``); unchanged without a block table."""
  if inputs.block_table is None:
    return extras
  lists = block_lists(inputs.block_table, params.table_block, params.window, block_q, block_k,
                      inputs.lengths, inputs.offsets, inputs.query.shape[1],
                      inputs.key.shape[1], transpose=transpose)
  return extras._replace(lists=lists.packed)


def with_order(extras: _Extras, inputs: Inputs, groups: int = 1) -> _Extras:
  """``extras`` with its items by cost (`by_cost`) where it has block lists."""
  if extras.lists is None:
    return extras
  b, heads = inputs.query.shape[0], inputs.query.shape[2] // groups
  return extras._replace(order=by_cost(extras.lists, b, heads, groups))


def paired_ctas(config: Config, params: Params, extras: _Extras, q_tiles: int) -> bool:
  """Whether the forward runs in clusters of two CTAs that share K/V loads
  (`Config.kv_multicast`): only where both tiles of a pair walk the same key blocks (no band
  side, no block table), with an even number of query tiles and, on a persistent grid, room
  for a pair (an odd CTA count leaves one CTA out)."""
  if not config.kv_multicast or extras.lists is not None:
    return False
  if params.window.left is not None or params.window.right is not None:
    return False
  return q_tiles % 2 == 0 and (config.persistent_ctas is None or config.persistent_ctas >= 2)


def forward(inputs: Inputs, params: Params, config: Config):
  """``(out [B, T, N, Dv], lse2 [B, N, T])`` (see `jaxflash._core`)."""
  inputs, params, term2 = _core.without_row_term(inputs, params)
  q, k, v = inputs.query, inputs.key, inputs.value
  b, t, n, h = q.shape
  hv = v.shape[3]
  groups = n // k.shape[2]
  hp, hvp = padded_head_dim(h), padded_head_dim(hv)  # (V and O padded on their own)
  quantized = fp8.is_fp8(q.dtype)
  if quantized and hp > 64:  # whole 128-byte rows of FP8 (a swizzle's tiling)
    hp = _round_up(h, 128)
  # TMA copies swizzled 8x64 tiles, so sequence lengths must be multiples of 8 in memory.
  q = _pad(q, _round_up(t, 8), hp)
  k = _pad(k, _round_up(k.shape[1], 8), hp)
  if quantized:
    v = _transposed_values(v, hvp, permuted=not params.interpret)
  else:
    v = _pad(v, _round_up(v.shape[1], 8), hvp)
  consumers, rows_per_cta = config.consumers, config.rows_per_cta
  q_tiles = pl.cdiv(t, rows_per_cta)
  extras = _extras(inputs, q_tiles * rows_per_cta, _round_up(k.shape[1], config.block_kv))
  extras = with_order(with_lists(extras, inputs, params, rows_per_cta, config.block_kv), inputs)
  if inputs.score_bands is not None:
    extras = extras._replace(score_band=pad_band(inputs.score_bands, t))
  if inputs.sinks is not None:
    extras = extras._replace(sinks=inputs.sinks.astype(jnp.float32) * _core.LOG2_E)
  if term2 is not None:
    extras = extras._replace(score_row_term=_pad_to(term2, term2.shape[:2] + (
        q_tiles * rows_per_cta,)))
  if quantized:
    extras = extras._replace(**_descales(inputs, q_tiles * rows_per_cta,
                                         _round_up(k.shape[1], config.block_kv)))
  schedule = Schedule.of(params.window, rows_per_cta, config.block_kv, mask=extras.mask,
                         q_segment_ids=extras.q_segment_ids)
  stages = config.num_stages
  # An FP8 call's row sums on the tensor cores (`Config.mma_row_sums`), but where P V reads
  # the dropped P.
  row_sums = config.mma_row_sums and quantized and inputs.dropout_seed is None
  if row_sums:
    extras = extras._replace(row_sum_ones=jnp.zeros((8, config.block_kv), v.dtype).at[0].set(1))
  key_factors = quantized and extras.k_descale.ndim == 3
  out_dtype = jnp.float32 if params.partial else params.output_dtype(inputs)
  out_bytes = jnp.dtype(out_dtype).itemsize
  view = o_view(config, hp, hvp, params.partial, q.dtype.itemsize, out_bytes)
  # One swizzle per product: Q and K rows of hp elements, P and V rows of block_kv FP8 ones.
  qk_swizzle = min(128, hp * q.dtype.itemsize)
  # (An FP8 V row of 64 or 192 keys is one or three 64-byte swizzled rows.)
  pv_swizzle = 64 if config.block_kv % 128 else 128
  v_tile = ((stages, hvp, config.block_kv), pv_swizzle) if quantized else (
      (stages, config.block_kv, hvp), 128)
  # Q (in one of ``q_buffers`` buffers per item), then O on the way out where it fits there.
  q_smem = _smem_tile((config.q_buffers * consumers, config.block_q, hp), q.dtype, qk_swizzle)
  union = view is not None and (view, jnp.dtype(out_dtype)) != ((config.block_q, hp), q.dtype)
  if union:
    # O's tiles over the Q tiles' bytes: each group of a union starts at its base, and a
    # consumer's view [rows, cols] spans exactly its Q tile [block_q, hp], so consumer 1's O
    # never lands on consumer 0's Q, which may still be in use. (The last Q Kᵀ has completed
    # before O is written: its S was waited for.)
    rows, cols = view
    assert rows * cols * out_bytes == config.block_q * hp * q.dtype.itemsize, (view, hp)
    assert config.q_buffers == 1, config
    q_smem = plgpu.RefUnion(q_smem, _smem_tile((consumers, rows, cols), out_dtype,
                                               min(128, cols * out_bytes)))
  paired = paired_ctas(config, params, extras, q_tiles)

  def free_barrier():  # a ring slot's release: in a cluster, by the consumers of both CTAs
    if paired:
      return plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=consumers,
                                  num_barriers=stages)
    return plgpu.Barrier(num_arrivals=consumers, num_barriers=stages)

  scratch = (
      q_smem,
      _smem_tile((stages, config.block_kv, hp), k.dtype, qk_swizzle),
      _smem_tile(v_tile[0], v.dtype, v_tile[1]),
      plgpu.SMEM((consumers, config.block_q), jnp.float32),  # LSE rows on the way out
      # O on the way out where it cannot leave through the Q tiles' memory (`o_view`): a
      # partial result's (float32), or a persistent CTA's (Q's tile is then loading the next
      # item).
      _smem_tile((consumers, config.block_q, hvp), out_dtype) if view is None else None,
      plgpu.Barrier(num_barriers=config.q_buffers * consumers),  # q_ready
      plgpu.Barrier(num_barriers=stages),  # k_ready
      plgpu.Barrier(num_barriers=stages),  # v_ready
      free_barrier(),  # k_free
      free_barrier(),  # v_free
      # The consumers' turns in the interpreter (named barriers on the GPU need no memory).
      plgpu.Barrier(num_barriers=consumers) if params.interpret else None,
      # `mma_row_sums`: the ones tile (keys along its rows, like V's FP8 tiles) and its load.
      _smem_tile((8, config.block_kv), v.dtype, pv_swizzle) if row_sums else None,
      plgpu.Barrier(num_barriers=1) if row_sums else None,
      # An FP8 call's factors per key, [keys of a block] a slot, and their loads.
      plgpu.SMEM((stages, config.block_kv), jnp.float32) if key_factors else None,
      plgpu.Barrier(num_barriers=stages) if key_factors else None,
  )
  items = _Grid(b, n, q_tiles, None, paired)
  # Pallas walks its grid row-major (batch fastest here): the CTAs running at once share a
  # head, and those of one batch row read the same K and V tiles (L2 reuse). A cluster's two
  # CTAs are one grid point's (`Config.kv_multicast`).
  grid, names = (n, q_tiles // 2 if paired else q_tiles, b), ("heads", "q_tiles", "batch")
  if config.persistent_ctas is not None:
    ctas = min(config.persistent_ctas, b * n * q_tiles)
    items = _Grid(b, n, q_tiles, ctas - ctas % 2 if paired else ctas, paired)
    grid, names = (items.ctas // 2 if paired else items.ctas,), ("ctas",)
  cluster = dict(cluster=(2,), cluster_names=("cluster",)) if paired else {}
  kernel = functools.partial(_kernel, params=params, config=config, schedule=schedule,
                             groups=groups, grid=items, o_union=union)
  # The LSE rows are written a whole tile at a time, so its buffer is padded to whole tiles.
  out, lse2 = plgpu.kernel(
      kernel,
      out_type=(_core.out_struct(q.shape[:3] + (hvp,), out_dtype, q),
                _core.out_struct((b, n, q_tiles * rows_per_cta), jnp.float32, q)),
      scratch_types=scratch,
      grid=grid,
      grid_names=names,
      **cluster,
      num_threads=consumers + 1,
      thread_name="wg",
      kernel_name="jaxflash_mosaic_forward",
      # No automatic warpgroup barriers around loads, stores and branches: no thread reads and
      # writes the same shared memory, and commit_smem orders the O and LSE tiles before TMA.
      # No cross-warp reductions either (a row's max and sum stay within its four threads), so
      # none of Mosaic GPU's 2 KiB of reduction scratch.
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True,
                                           reduction_scratch_bytes=0),
      interpret=plgpu.InterpretGPUParams() if params.interpret else None,
  )(q, k, v, inputs.lengths, inputs.offsets, extras)
  return out[:, :t, :, :hv], lse2[..., :t]
