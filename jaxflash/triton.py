"""Pallas kernels lowered through Triton: forward (O and LSE) and a recomputing backward.

Three kernels, all over the BTNH layout as given (no transposes, no padding copies):

- `_forward_kernel`, grid (query blocks, B, N): keeps a query tile on chip, walks the key blocks
  that `masking.kv_block_range` allows, runs the online softmax in float32 and writes O and the
  base-2 LSE.
- `_dq_kernel`, grid (query blocks, B, N): recomputes S and P for its query tile and accumulates
  dQ over the same key blocks.
- `_dkv_kernel`, grid (key blocks, B, K): keeps a key/value tile on chip and walks every query
  head of its group (GQA) and the query blocks that `masking.q_block_range` allows, accumulating
  dK and dV.

dQ and dK/dV are separate kernels so that every output element is written by one program:
gradients are deterministic and need no atomics. With GQA the K/V heads are indexed, never
repeated in memory.

jax 0.11.2's Triton lowering does not mask partial blocks, and needs every tile to have a
power-of-two shape. So tiles are padded to powers of two (head dim to `_pow2(H)`, blocks to at
least 16 for `tl.dot`), and every load and store of a tile that can reach past the array is masked
with an explicit ``other=`` value.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxflash import _core
from jaxflash import dropout
from jaxflash import masking
from jaxflash._core import Inputs, Params


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes and launch parameters of the three kernels.

  ``block_q``/``block_k`` tile the forward; ``block_q_bwd``/``block_k_bwd`` tile both backward
  kernels. Blocks are clipped to the (power-of-two-rounded) sequence lengths and kept >= 16.
  """

  block_q: int = 128
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 3
  block_q_bwd: int = 64
  block_k_bwd: int = 64
  num_warps_bwd: int = 4
  num_stages_bwd: int = 2


def default_block_sizes(head_dim: int, dtype, causal: bool = False,
                        seq_len: int | None = None) -> BlockSizes:
  """Tile sizes for this head dim, dtype, mask shape and query length (tuned on an H200).

  ``causal`` is true for any window that ends at or before the diagonal. Triangular grids change
  what is fastest: a 64-row forward tile wastes less of the diagonal block on short sequences,
  and a single-stage backward pipeline suits the shorter key loops at D = 64. The measurements
  behind each choice are in ``benchmarks/NOTES.md`` and ``benchmarks/results/tuning/``.
  """
  head_dim = _pow2(head_dim)
  wide = jnp.dtype(dtype).itemsize > 2  # float32 tiles take twice the shared memory
  short = seq_len is not None and seq_len <= 1024
  if head_dim <= 64:
    return BlockSizes(64, 64, 4, 3, 64, 64, 4, 1 if causal else 2)
  if head_dim <= 128:
    if wide:
      return BlockSizes(64, 64, 4, 2, 32, 64, 4, 2)
    if causal and short:
      return BlockSizes(64, 64, 4, 3, 64, 64, 4, 2)
    return BlockSizes(128, 64, 8, 3, 64, 64, 4, 2)
  if wide:
    return BlockSizes(32, 32, 4, 2, 16, 32, 4, 1)
  return BlockSizes(64, 64, 8, 2, 32, 64, 8, 1)


def _block_sizes(inputs: Inputs, params: Params) -> BlockSizes:
  causal = params.window.right is not None and params.window.right <= 0
  q = inputs.query
  return default_block_sizes(q.shape[-1], q.dtype, causal, q.shape[1])


def _pow2(n: int) -> int:
  return max(16, pl.next_power_of_2(n))


def _fit(block: int, length: int) -> int:
  return max(16, min(block, pl.next_power_of_2(length)))


def _and(a, b):
  if a is None:
    return b
  if b is None:
    return a
  return jnp.logical_and(a, b)


def _load(ref, mask, other):
  """Masked tile load; Triton refuses ``other`` without a mask, and in-bounds tiles have none."""
  if mask is None:
    return plgpu.load(ref)
  return plgpu.load(ref, mask=mask, other=other)


def _tile_ok(row_ok, col_ok):
  """2-D load/store mask from optional per-row and per-column bounds (None = all in bounds)."""
  return _and(None if row_ok is None else row_ok[:, None],
              None if col_ok is None else col_ok[None, :])


@dataclasses.dataclass(frozen=True)
class _Shape:
  """Static sizes a kernel needs; derived once per call from the inputs."""

  seq_q: int  # T
  seq_k: int  # S
  head_dim: int  # H
  head_dim_p: int  # H padded to a power of two
  groups: int  # G = N // K query heads per key/value head
  has_segments: bool
  has_mask: bool
  has_bias: bool
  has_dropout: bool

  def bounds(self, start, block: int, length: int):
    """Positions of a tile and their in-bounds flags (None when the tile never crosses the end)."""
    pos = start + jnp.arange(block)
    return pos, (pos < length if length % block else None)

  @property
  def dim_ok(self):
    if self.head_dim == self.head_dim_p:
      return None
    return jnp.arange(self.head_dim_p) < self.head_dim


def _visible(rows, cols, params: Params, kv_len, q_seg, kv_seg, dense):
  return masking.visible(
      rows[:, None], cols[None, :], params.window, kv_len=kv_len,
      q_segment=None if q_seg is None else q_seg[:, None],
      kv_segment=None if kv_seg is None else kv_seg[None, :],
      dense_mask=None if dense is None else dense != 0)


def _at(ref, *index):
  """``ref.at[index]``, or None for an absent optional input."""
  return None if ref is None else ref.at[index]


def _masked_logits(q, k, rows, cols, tile_ok, kv_len, params: Params, q_seg, kv_seg, bias_ref,
                   mask_ref, masked: bool = True, raw: bool = False):
  """Base-2 logits of one (query, key) tile, invisible entries at -inf; also the soft-cap tanh.

  ``bias_ref``/``mask_ref`` are refs already positioned on this tile (or None). ``masked=False``
  is for tiles `_full_blocks` names: every entry is visible, so no element mask is computed.
  ``raw=True`` (only where `_folds_scale` holds) returns the unscaled ``q @ k.T`` instead, for a
  caller that applies ``scale * log2(e)`` itself, fused into a later multiply-add.
  """
  bias = None if bias_ref is None else _load(bias_ref, mask=tile_ok, other=0.0)
  qk = plgpu.dot(q, k, trans_b=True)
  s2, cap_t = (qk, None) if raw else _core.logits_base2(qk, params, bias)
  if not masked:
    return s2, cap_t
  dense = None if mask_ref is None else _load(mask_ref, mask=tile_ok, other=0)
  return jnp.where(_visible(rows, cols, params, kv_len, q_seg, kv_seg, dense), s2,
                   -jnp.inf), cap_t


def _folds_scale(params: Params, shape: "_Shape") -> bool:
  """Whether base-2 logits are just ``c * q @ k.T`` with ``c > 0`` (no cap, no bias), so that a
  row max of the raw product, times ``c``, is the row max of the logits."""
  return params.logits_soft_cap is None and not shape.has_bias and params.scale > 0


class _Optional(NamedTuple):
  """Refs of the optional inputs (None when absent), in the order the kernels receive them."""

  q_seg: object = None
  kv_seg: object = None
  mask: object = None
  bias: object = None
  seed: object = None  # uint32 [2] dropout seed


def _full_blocks(lo, hi, q_start, q_stop, kv_len, params: Params, shape: _Shape, block_k: int):
  """Splits the visited key blocks ``[lo, hi)`` into ``[lo, a)``, ``[a, b)``, ``[b, hi)`` where
  the middle blocks need no element mask (window and lengths leave all of them visible).

  Segments or a dense mask can hide any entry, so with them every block stays masked.
  """
  if shape.has_segments or shape.has_mask:
    return hi, hi
  full_lo, full_hi = masking.kv_full_block_range(q_start, q_stop, kv_len, params.window, block_k)
  a = jnp.clip(full_lo, lo, hi)
  return a, jnp.clip(full_hi, a, hi)


def _optional_refs(refs, shape: _Shape):
  """Splits the optional input refs off the front of ``refs``; returns (`_Optional`, rest)."""
  refs = list(refs)
  present = (shape.has_segments, shape.has_segments, shape.has_mask, shape.has_bias,
             shape.has_dropout)
  return _Optional(*(refs.pop(0) if p else None for p in present)), refs


def _dropout_stream(opt: _Optional, params: Params, batch, head):
  """Scalar dropout key of one (batch, head), or None without dropout."""
  if opt.seed is None:
    return None
  return _core.dropout_stream(params, (opt.seed[0], opt.seed[1]), batch, head)


def _keep(stream, rows, k_start, block_k: int, params: Params):
  """Dropout keep mask of the tile (rows x keys k_start ...), or None without dropout."""
  if stream is None:
    return None
  return dropout.keep(stream, rows[:, None], k_start, block_k, params.dropout_rate)


# ---------------------------------------------------------------------------------------------
# Forward


def _forward_kernel(q_ref, k_ref, v_ref, len_ref, *refs, params: Params, shape: _Shape,
                    block_q: int, block_k: int):
  opt, (o_ref, lse_ref) = _optional_refs(refs, shape)
  q_len, kv_len = len_ref[0], len_ref[1]
  q_start = pl.program_id(0) * block_q
  rows, row_ok = shape.bounds(q_start, block_q, shape.seq_q)
  dim_ok = shape.dim_ok
  q = _load(q_ref, mask=_tile_ok(row_ok, dim_ok), other=0.0)
  q_seg = None if opt.q_seg is None else _load(opt.q_seg, mask=row_ok, other=-1)
  stream = _dropout_stream(opt, params, pl.program_id(1), pl.program_id(2))

  # With a plain positive scale the tile's max is taken on the raw q @ k.T and scaled per row;
  # the per-entry scale then rides in the exp2 argument's multiply-add, saving one float32
  # multiply per logit on the forward's critical path.
  fold = _folds_scale(params, shape)
  c = params.scale * _core.LOG2_E if fold else 1.0

  def body(j, carry, masked: bool):
    acc, m, l = carry
    k_start = j * block_k
    cols, col_ok = shape.bounds(k_start, block_k, shape.seq_k)
    if not masked:
      col_ok = None  # a full block lies below kv_len <= S
    kv_ok = _tile_ok(col_ok, dim_ok)
    keys = pl.ds(k_start, block_k)
    k = _load(k_ref.at[keys, :], mask=kv_ok, other=0.0)
    kv_seg = None if opt.kv_seg is None else _load(opt.kv_seg.at[keys], mask=col_ok, other=-2)
    s2, _ = _masked_logits(q, k, rows, cols, _tile_ok(row_ok, col_ok), kv_len, params, q_seg,
                           kv_seg, _at(opt.bias, slice(None), keys),
                           _at(opt.mask, slice(None), keys), masked, raw=fold)
    # Online softmax. A row that has seen no visible key yet keeps m = -inf; shifting by 0 instead
    # keeps exp2 finite (exp2(-inf) = 0) so such rows stay at l = 0, acc = 0 without NaN. In a
    # full (unmasked) tile every entry is finite, so m_new is too.
    m_new = jnp.maximum(m, jnp.max(s2, axis=1) * c if fold else jnp.max(s2, axis=1))
    m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
    alpha = jnp.exp2(m - m_shift)
    p = jnp.exp2((s2 * c if fold else s2) - m_shift[:, None])
    v = _load(v_ref.at[keys, :], mask=kv_ok, other=0.0)
    # Dropout removes entries of P from the product with V only; l sums the undropped P, and
    # 1 / P(keep) is applied once, to the output.
    keep = _keep(stream, rows, k_start, block_k, params)
    p_v = p if keep is None else jnp.where(keep, p, 0.0)
    acc = acc * alpha[:, None] + plgpu.dot(p_v.astype(v.dtype), v)
    return acc, m_new, l * alpha + jnp.sum(p, axis=1)

  q_stop = jnp.minimum(q_start + block_q, q_len)
  lo, hi = masking.kv_block_range(q_start, q_stop, kv_len, params.window, block_k)
  hi = jnp.where(q_start < q_len, hi, lo)  # the whole tile is query padding
  init = (jnp.zeros((block_q, shape.head_dim_p), jnp.float32),
          jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32))
  full_lo, full_hi = _full_blocks(lo, hi, q_start, q_stop, kv_len, params, shape, block_k)
  carry = lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), init)
  carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
  acc, m, l = lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), carry)

  seen = jnp.logical_and(rows < q_len, l > 0.0)
  inv_l = (1.0 if stream is None else params.keep_scale) / jnp.where(seen, l, 1.0)
  out = jnp.where(seen[:, None], acc * inv_l[:, None], 0.0)
  plgpu.store(o_ref, out.astype(o_ref.dtype), mask=_tile_ok(row_ok, dim_ok))
  plgpu.store(lse_ref, jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), jnp.inf),
              mask=row_ok)


def _dense_spec(x: jax.Array | None, block: tuple[int, int], index):
  """BlockSpec of a [B or 1, N or 1, T, S] mask/bias; ``index(b, h)`` -> (t block, s block)."""
  bcast_b, bcast_n = x.shape[0] == 1, x.shape[1] == 1
  return pl.BlockSpec(
      (None, None) + block,
      lambda i, b, h: (0 if bcast_b else b, 0 if bcast_n else h) + index(i))


def _optional_args(inputs: Inputs, specs):
  """Arrays and BlockSpecs of the optional inputs, in the order `_optional_refs` expects them."""
  args, in_specs = [], []
  for name in ("q_segment_ids", "kv_segment_ids", "mask", "bias", "dropout_seed"):
    x = getattr(inputs, name)
    if x is not None:
      if name == "mask":
        x = x.astype(jnp.int8)  # Triton has no boolean memory type
      args.append(x)
      in_specs.append(specs[name](x))
  return args, in_specs


def _forward(inputs: Inputs, params: Params):
  q, k, v = inputs.query, inputs.key, inputs.value
  b, t, n, h = q.shape
  s = k.shape[1]
  bs = _block_sizes(inputs, params)
  shape = _shape(inputs)
  block_q, block_k = _fit(bs.block_q, t), _fit(bs.block_k, s)
  hp, g = shape.head_dim_p, shape.groups
  in_specs = [
      pl.BlockSpec((None, block_q, None, hp), lambda i, b, h: (b, i, h, 0)),
      pl.BlockSpec((None, s, None, hp), lambda i, b, h: (b, 0, h // g, 0)),
      pl.BlockSpec((None, s, None, hp), lambda i, b, h: (b, 0, h // g, 0)),
      pl.BlockSpec((None, 2), lambda i, b, h: (b, 0)),
  ]
  extra, extra_specs = _optional_args(inputs, {
      "q_segment_ids": lambda x: pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)),
      "kv_segment_ids": lambda x: pl.BlockSpec((None, s), lambda i, b, h: (b, 0)),
      "mask": lambda x: _dense_spec(x, (block_q, s), lambda i: (i, 0)),
      "bias": lambda x: _dense_spec(x, (block_q, s), lambda i: (i, 0)),
      "dropout_seed": lambda x: pl.BlockSpec((2,), lambda i, b, h: (0,)),
  })
  kernel = functools.partial(_forward_kernel, params=params, shape=shape, block_q=block_q,
                             block_k=block_k)
  return pl.pallas_call(
      kernel,
      grid=(pl.cdiv(t, block_q), b, n),
      in_specs=in_specs + extra_specs,
      out_specs=[
          pl.BlockSpec((None, block_q, None, hp), lambda i, b, h: (b, i, h, 0)),
          pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i)),
      ],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, n, t), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
      interpret=params.interpret,
      name="jaxflash_forward",
  )(q, k, v, inputs.lengths, *extra)


def _shape(inputs: Inputs) -> _Shape:
  q, k = inputs.query, inputs.key
  return _Shape(
      seq_q=q.shape[1], seq_k=k.shape[1], head_dim=q.shape[3], head_dim_p=_pow2(q.shape[3]),
      groups=q.shape[2] // k.shape[2], has_segments=inputs.q_segment_ids is not None,
      has_mask=inputs.mask is not None, has_bias=inputs.bias is not None,
      has_dropout=inputs.dropout_seed is not None)


# ---------------------------------------------------------------------------------------------
# Backward: dQ


def _dq_kernel(q_ref, k_ref, v_ref, len_ref, *refs, params: Params, shape: _Shape,
               block_q: int, block_k: int):
  opt, (do_ref, lse_ref, delta_ref, dq_ref) = _optional_refs(refs, shape)
  q_len, kv_len = len_ref[0], len_ref[1]
  q_start = pl.program_id(0) * block_q
  rows, row_ok = shape.bounds(q_start, block_q, shape.seq_q)
  dim_ok = shape.dim_ok
  q_ok = _tile_ok(row_ok, dim_ok)
  q = _load(q_ref, mask=q_ok, other=0.0)
  do = _load(do_ref, mask=q_ok, other=0.0)
  # lse2 = +inf on rows that see nothing (and on rows past T), so P is exactly 0 there.
  lse2 = _load(lse_ref, mask=row_ok, other=jnp.inf)
  delta = _load(delta_ref, mask=row_ok, other=0.0)
  q_seg = None if opt.q_seg is None else _load(opt.q_seg, mask=row_ok, other=-1)
  stream = _dropout_stream(opt, params, pl.program_id(1), pl.program_id(2))

  def body(j, dq, masked: bool):
    k_start = j * block_k
    cols, col_ok = shape.bounds(k_start, block_k, shape.seq_k)
    if not masked:
      col_ok = None  # a full block lies below kv_len <= S
    kv_ok = _tile_ok(col_ok, dim_ok)
    keys = pl.ds(k_start, block_k)
    k = _load(k_ref.at[keys, :], mask=kv_ok, other=0.0)
    v = _load(v_ref.at[keys, :], mask=kv_ok, other=0.0)
    kv_seg = None if opt.kv_seg is None else _load(opt.kv_seg.at[keys], mask=col_ok, other=-2)
    s2, cap_t = _masked_logits(q, k, rows, cols, _tile_ok(row_ok, col_ok), kv_len, params, q_seg,
                               kv_seg, _at(opt.bias, slice(None), keys),
                               _at(opt.mask, slice(None), keys), masked)
    p = jnp.exp2(s2 - lse2[:, None])
    keep = _keep(stream, rows, k_start, block_k, params)
    dp = _core.dropped(plgpu.dot(do, v, trans_b=True), keep, params)
    ds = _core.dlogits_to_dqk(p * (dp - delta[:, None]), cap_t)
    return dq + plgpu.dot(ds.astype(k.dtype), k)

  q_stop = jnp.minimum(q_start + block_q, q_len)
  lo, hi = masking.kv_block_range(q_start, q_stop, kv_len, params.window, block_k)
  hi = jnp.where(q_start < q_len, hi, lo)
  full_lo, full_hi = _full_blocks(lo, hi, q_start, q_stop, kv_len, params, shape, block_k)
  dq = jnp.zeros((block_q, shape.head_dim_p), jnp.float32)
  dq = lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), dq)
  dq = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), dq)
  dq = lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), dq)
  plgpu.store(dq_ref, (dq * params.scale).astype(dq_ref.dtype), mask=q_ok)


# ---------------------------------------------------------------------------------------------
# Backward: dK and dV


def _dkv_kernel(q_ref, k_ref, v_ref, len_ref, *refs, params: Params, shape: _Shape,
                block_q: int, block_k: int):
  opt, (do_ref, lse_ref, delta_ref, dk_ref, dv_ref) = _optional_refs(refs, shape)
  q_len, kv_len = len_ref[0], len_ref[1]
  k_start = pl.program_id(0) * block_k
  cols, col_ok = shape.bounds(k_start, block_k, shape.seq_k)
  dim_ok = shape.dim_ok
  kv_ok = _tile_ok(col_ok, dim_ok)
  k = _load(k_ref, mask=kv_ok, other=0.0)
  v = _load(v_ref, mask=kv_ok, other=0.0)
  kv_seg = None if opt.kv_seg is None else _load(opt.kv_seg, mask=col_ok, other=-2)

  # Program ids are read here, outside the loops (interpret mode cannot see them inside).
  batch, first_head = pl.program_id(1), pl.program_id(2) * shape.groups
  k_stop = jnp.minimum(k_start + block_k, kv_len)
  lo, hi = masking.q_block_range(k_start, k_stop, q_len, params.window, block_q)
  num_q_blocks = jnp.maximum(jnp.where(k_start < kv_len, hi - lo, 0), 0)

  def body(step, carry):
    # One flat loop over (query head of this K/V head's group, query block).
    dk, dv = carry
    g = lax.div(step, num_q_blocks)
    q_start = (lo + lax.rem(step, num_q_blocks)) * block_q
    rows, row_ok = shape.bounds(q_start, block_q, shape.seq_q)
    q_ok = _tile_ok(row_ok, dim_ok)
    q = _load(q_ref.at[pl.ds(q_start, block_q), g, :], mask=q_ok, other=0.0)
    do = _load(do_ref.at[pl.ds(q_start, block_q), g, :], mask=q_ok, other=0.0)
    lse2 = _load(lse_ref.at[g, pl.ds(q_start, block_q)], mask=row_ok, other=jnp.inf)
    delta = _load(delta_ref.at[g, pl.ds(q_start, block_q)], mask=row_ok, other=0.0)
    q_seg = None if opt.q_seg is None else _load(
        opt.q_seg.at[pl.ds(q_start, block_q)], mask=row_ok, other=-1)

    def dense_tile(ref):
      # Mask/bias refs hold every head of the group, or one head broadcast to all of them.
      # (A literal 0 index trips jax 0.11.2's load lowering; an int32 scalar does not.)
      if ref is None:
        return None
      return ref.at[g if ref.shape[0] > 1 else jnp.int32(0), pl.ds(q_start, block_q), :]

    s2, cap_t = _masked_logits(q, k, rows, cols, _tile_ok(row_ok, col_ok), kv_len, params, q_seg,
                               kv_seg, dense_tile(opt.bias), dense_tile(opt.mask))
    p = jnp.exp2(s2 - lse2[:, None])
    keep = _keep(_dropout_stream(opt, params, batch, first_head + g), rows, k_start, block_k,
                 params)
    dv = dv + plgpu.dot(_core.dropped(p, keep, params).astype(do.dtype), do, trans_a=True)
    dp = _core.dropped(plgpu.dot(do, v, trans_b=True), keep, params)
    ds = _core.dlogits_to_dqk(p * (dp - delta[:, None]), cap_t)
    dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True)
    return dk, dv

  zeros = jnp.zeros((block_k, shape.head_dim_p), jnp.float32)
  dk, dv = lax.fori_loop(0, shape.groups * num_q_blocks, body, (zeros, zeros))
  plgpu.store(dk_ref, (dk * params.scale).astype(dk_ref.dtype), mask=kv_ok)
  plgpu.store(dv_ref, dv.astype(dv_ref.dtype), mask=kv_ok)


def _grouped_dense_spec(x: jax.Array, t: int, block_k: int, groups: int):
  """dK/dV BlockSpec of a mask/bias: all T rows of one key block, for every head in the group."""
  bcast_b, bcast_n = x.shape[0] == 1, x.shape[1] == 1
  g = 1 if bcast_n else groups
  return x.reshape(x.shape[0], x.shape[1] // g, g, t, x.shape[3]), pl.BlockSpec(
      (None, None, g, t, block_k),
      lambda j, b, h: (0 if bcast_b else b, 0 if bcast_n else h, 0, 0, j))


# ---------------------------------------------------------------------------------------------
# Backward: dbias (run only when the bias is differentiated)


def _dbias_kernel(q_ref, k_ref, v_ref, len_ref, *refs, params: Params, shape: _Shape,
                  block_q: int, block_k: int, shared_batch: int, shared_heads: int):
  """One [block_q, S] row slab of dbias for the bias entry (program_id(1), program_id(2)).

  dbias = dZ, the gradient with respect to the natural logits (after scale and soft cap), summed
  over the (batch row, head) pairs that share this bias entry: ``shared_batch`` rows when the
  bias broadcasts over the batch (else 1) times ``shared_heads`` heads when it broadcasts over
  heads (else 1). The sum runs on chip in a fixed order, so dbias is deterministic and no
  [B, N, T, S] buffer is written. Refs of per-row inputs cover every batch row and head; the
  bias ref and the output are this program's slab.
  """
  opt, (do_ref, lse_ref, delta_ref, dbias_ref) = _optional_refs(refs, shape)
  # Program ids are read here, outside the loops (interpret mode cannot see them inside).
  bias_batch, bias_head = pl.program_id(1), pl.program_id(2)
  q_start = pl.program_id(0) * block_q
  rows, row_ok = shape.bounds(q_start, block_q, shape.seq_q)
  dim_ok = shape.dim_ok
  q_ok = _tile_ok(row_ok, dim_ok)
  # Key blocks the window allows; lengths differ per batch row and are left to the element mask.
  q_stop = jnp.minimum(q_start + block_q, shape.seq_q)
  lo, hi = masking.kv_block_range(q_start, q_stop, shape.seq_k, params.window, block_k)

  def index(ref, b, n):
    """Batch/head indices into a mask of shape [B or 1, N or 1, ...]."""
    return (b if ref.shape[0] > 1 else jnp.int32(0), n if ref.shape[1] > 1 else jnp.int32(0))

  def key_block(j, carry):
    k_start = j * block_k
    cols, col_ok = shape.bounds(k_start, block_k, shape.seq_k)
    kv_ok = _tile_ok(col_ok, dim_ok)
    keys = pl.ds(k_start, block_k)
    tile_ok = _tile_ok(row_ok, col_ok)

    def one_pair(r, dz_sum):
      # Pair r = (batch row, head) in row-major order over the shared ones.
      b = bias_batch if shared_batch == 1 else r // shared_heads
      n = bias_head if shared_heads == 1 else lax.rem(r, jnp.int32(shared_heads))
      q = _load(q_ref.at[b, :, n, :], mask=q_ok, other=0.0)
      do = _load(do_ref.at[b, :, n, :], mask=q_ok, other=0.0)
      lse2 = _load(lse_ref.at[b, n, :], mask=row_ok, other=jnp.inf)
      delta = _load(delta_ref.at[b, n, :], mask=row_ok, other=0.0)
      k = _load(k_ref.at[b, keys, n // shape.groups, :], mask=kv_ok, other=0.0)
      v = _load(v_ref.at[b, keys, n // shape.groups, :], mask=kv_ok, other=0.0)
      q_seg = kv_seg = None
      if opt.q_seg is not None:
        q_seg = _load(opt.q_seg.at[b, :], mask=row_ok, other=-1)
        kv_seg = _load(opt.kv_seg.at[b, keys], mask=col_ok, other=-2)
      mask = None if opt.mask is None else opt.mask.at[index(opt.mask, b, n) + (slice(None),
                                                                               keys)]
      s2, _ = _masked_logits(q, k, rows, cols, tile_ok, len_ref[b, 1], params, q_seg, kv_seg,
                             _at(opt.bias, slice(None), keys), mask)
      p = jnp.exp2(s2 - lse2[:, None])
      keep = _keep(_dropout_stream(opt, params, b, n), rows, k_start, block_k, params)
      dp = _core.dropped(plgpu.dot(do, v, trans_b=True), keep, params)
      return dz_sum + p * (dp - delta[:, None])

    # Blocks outside the window's range get zeros (the output buffer starts undefined).
    visited = jnp.logical_and(j >= lo, j < hi)
    pairs = jnp.where(visited, jnp.int32(shared_batch * shared_heads), jnp.int32(0))
    dz = lax.fori_loop(jnp.int32(0), pairs, one_pair, jnp.zeros((block_q, block_k), jnp.float32))
    plgpu.store(dbias_ref.at[:, keys], dz.astype(dbias_ref.dtype), mask=tile_ok)
    return carry

  lax.fori_loop(0, pl.cdiv(shape.seq_k, block_k), key_block, jnp.int32(0))


def _dbias(inputs: Inputs, params: Params, lse2, d_out, delta, block_q: int, block_k: int,
           compiler_params):
  q, k, v, bias = inputs.query, inputs.key, inputs.value, inputs.bias
  b, t, n, _ = q.shape
  s, kh = k.shape[1], k.shape[2]
  shape = _shape(inputs)
  hp = shape.head_dim_p
  whole = lambda *block: pl.BlockSpec(block, lambda i, bb, nb: (0,) * len(block))
  row_block = lambda *block: pl.BlockSpec(block,
                                          lambda i, bb, nb: (0,) * (len(block) - 1) + (i,))
  extra, extra_specs = _optional_args(inputs, {
      "q_segment_ids": lambda x: row_block(b, block_q),
      "kv_segment_ids": lambda x: whole(b, s),
      "mask": lambda x: pl.BlockSpec(x.shape[:2] + (block_q, s),
                                     lambda i, bb, nb: (0, 0, i, 0)),
      "bias": lambda x: pl.BlockSpec((None, None, block_q, s),
                                     lambda i, bb, nb: (bb, nb, i, 0)),
      "dropout_seed": lambda x: whole(2),
  })
  q_rows = pl.BlockSpec((b, block_q, n, hp), lambda i, bb, nb: (0, i, 0, 0))
  return pl.pallas_call(
      functools.partial(_dbias_kernel, params=params, shape=shape, block_q=block_q,
                        block_k=block_k, shared_batch=b if bias.shape[0] == 1 else 1,
                        shared_heads=n if bias.shape[1] == 1 else 1),
      grid=(pl.cdiv(t, block_q), bias.shape[0], bias.shape[1]),
      in_specs=[q_rows, whole(b, s, kh, hp), whole(b, s, kh, hp), whole(b, 2)]
      + extra_specs + [q_rows, row_block(b, n, block_q), row_block(b, n, block_q)],
      out_specs=pl.BlockSpec((None, None, block_q, s), lambda i, bb, nb: (bb, nb, i, 0)),
      out_shape=jax.ShapeDtypeStruct(bias.shape, bias.dtype),
      compiler_params=compiler_params,
      interpret=params.interpret,
      name="jaxflash_backward_dbias",
  )(q, k, v, inputs.lengths, *extra, d_out, lse2, delta)


def _backward(inputs: Inputs, params: Params, out, lse2, d_out, delta, want_dbias: bool):
  del out  # delta already holds rowsum(dO * O)
  q, k, v = inputs.query, inputs.key, inputs.value
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  bs = _block_sizes(inputs, params)
  shape = _shape(inputs)
  hp, g = shape.head_dim_p, shape.groups
  d_out = d_out.astype(q.dtype)
  compiler_params = plgpu.CompilerParams(num_warps=bs.num_warps_bwd,
                                         num_stages=bs.num_stages_bwd)

  # dQ: grid over query blocks, like the forward.
  block_q, block_k = _fit(bs.block_q_bwd, t), _fit(bs.block_k_bwd, s)
  q_spec = pl.BlockSpec((None, block_q, None, hp), lambda i, b, h: (b, i, h, 0))
  kv_spec = pl.BlockSpec((None, s, None, hp), lambda i, b, h: (b, 0, h // g, 0))
  row_spec = pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))
  extra, extra_specs = _optional_args(inputs, {
      "q_segment_ids": lambda x: pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)),
      "kv_segment_ids": lambda x: pl.BlockSpec((None, s), lambda i, b, h: (b, 0)),
      "mask": lambda x: _dense_spec(x, (block_q, s), lambda i: (i, 0)),
      "bias": lambda x: _dense_spec(x, (block_q, s), lambda i: (i, 0)),
      "dropout_seed": lambda x: pl.BlockSpec((2,), lambda i, b, h: (0,)),
  })
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, params=params, shape=shape, block_q=block_q,
                        block_k=block_k),
      grid=(pl.cdiv(t, block_q), b, n),
      in_specs=[q_spec, kv_spec, kv_spec, pl.BlockSpec((None, 2), lambda i, b, h: (b, 0))]
      + extra_specs + [q_spec, row_spec, row_spec],
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=compiler_params,
      interpret=params.interpret,
      name="jaxflash_backward_dq",
  )(q, k, v, inputs.lengths, *extra, d_out, lse2, delta)

  # dK, dV: grid over key blocks of each K/V head; the group's query heads are walked inside.
  grouped_q = pl.BlockSpec((None, t, None, g, hp), lambda j, b, h: (b, 0, h, 0, 0))
  grouped_rows = pl.BlockSpec((None, None, g, t), lambda j, b, h: (b, h, 0, 0))
  kv_block = pl.BlockSpec((None, block_k, None, hp), lambda j, b, h: (b, j, h, 0))
  extra, extra_specs = [], []
  if inputs.q_segment_ids is not None:
    extra += [inputs.q_segment_ids, inputs.kv_segment_ids]
    extra_specs += [pl.BlockSpec((None, t), lambda j, b, h: (b, 0)),
                    pl.BlockSpec((None, block_k), lambda j, b, h: (b, j))]
  for x in (None if inputs.mask is None else inputs.mask.astype(jnp.int8), inputs.bias):
    if x is not None:
      x, spec = _grouped_dense_spec(x, t, block_k, g)
      extra.append(x)
      extra_specs.append(spec)
  if inputs.dropout_seed is not None:
    extra.append(inputs.dropout_seed)
    extra_specs.append(pl.BlockSpec((2,), lambda j, b, h: (0,)))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, params=params, shape=shape, block_q=block_q,
                        block_k=block_k),
      grid=(pl.cdiv(s, block_k), b, kh),
      in_specs=[grouped_q, kv_block, kv_block, pl.BlockSpec((None, 2), lambda j, b, h: (b, 0))]
      + extra_specs + [grouped_q, grouped_rows, grouped_rows],
      out_specs=[kv_block, kv_block],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=compiler_params,
      interpret=params.interpret,
      name="jaxflash_backward_dkv",
  )(q.reshape(b, t, kh, g, h), k, v, inputs.lengths, *extra,
    d_out.reshape(b, t, kh, g, h), lse2.reshape(b, kh, g, t), delta.reshape(b, kh, g, t))

  dbias = None
  if want_dbias:
    dbias = _dbias(inputs, params, lse2, d_out, delta, block_q, block_k, compiler_params)
  return dq, dk, dv, dbias


_attention = _core.build(_forward, _backward)


def attention(inputs: Inputs, params: Params):
  """Runs the Triton kernels; returns ``(out [B, T, N, H], natural lse [B, N, T])``."""
  return _attention(inputs, params)
