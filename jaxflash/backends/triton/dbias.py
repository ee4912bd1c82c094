"""The Triton bias-gradient kernel, run only when the bias is differentiated.

dbias = dZ, the gradient with respect to the natural logits (after scale and soft cap), summed
over the (batch row, head) pairs that share a bias entry. The sum runs on chip in a fixed order,
so dbias is deterministic and no [B, N, T, S] buffer is written.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxflash import _core
from jaxflash._core import Inputs, Params
from jaxflash.backends.triton import tiles
from jaxflash.backends.triton.config import Config
from jaxflash.masking import Positions
from jaxflash.schedule import Schedule


def _dbias_kernel(q_ref, k_ref, v_ref, lengths_ref, opt: tiles.Optional, do_ref, lse_ref,
                  delta_ref, dbias_ref, *, params: Params, st: tiles.Static, schedule: Schedule,
                  shared_batch: int, shared_heads: int):
  """One [block_q, S] row slab of dbias for the bias entry (program_id(1), program_id(2)).

  The pairs summed are ``shared_batch`` batch rows when the bias broadcasts over the batch (else
  1) times ``shared_heads`` heads when it broadcasts over heads (else 1). Refs of per-row inputs
  cover every batch row and head; the bias ref and the output are this program's slab.
  """
  block_q, block_k = schedule.block_q, schedule.block_k
  # Program ids are read here, outside the loops (interpret mode cannot see them inside).
  bias_batch, bias_head = pl.program_id(1), pl.program_id(2)
  q_start = pl.program_id(0) * block_q
  rows, row_ok = st.bounds(q_start, block_q, st.seq_q)
  q_ok, do_ok = tiles.tile_ok(row_ok, st.dim_ok), tiles.tile_ok(row_ok, st.value_dim_ok)
  # Key blocks the band allows for any batch row: lengths and offsets differ per row, so they
  # are left to the element mask (with offsets, every block is visited).
  if opt.offsets is None:
    lo, _, _, hi = schedule.kv_blocks(q_start, Positions(st.seq_q, st.seq_k))
  else:
    lo, hi = 0, pl.cdiv(st.seq_k, block_k)

  def index(ref, b, n):
    """Batch/head indices into a mask of shape [B or 1, N or 1, ...]."""
    return (b if ref.shape[0] > 1 else jnp.int32(0), n if ref.shape[1] > 1 else jnp.int32(0))

  def key_block(j, carry):
    k_start = j * block_k
    cols, col_ok = st.bounds(k_start, block_k, st.seq_k)
    kv_ok, v_ok = tiles.tile_ok(col_ok, st.dim_ok), tiles.tile_ok(col_ok, st.value_dim_ok)
    keys = pl.ds(k_start, block_k)
    ok = tiles.tile_ok(row_ok, col_ok)

    def one_pair(r, dz_sum):
      # Pair r = (batch row, head) in row-major order over the shared ones.
      b = bias_batch if shared_batch == 1 else r // shared_heads
      n = bias_head if shared_heads == 1 else lax.rem(r, jnp.int32(shared_heads))
      q = tiles.load(q_ref.at[b, :, n, :], mask=q_ok, other=0.0)
      do = tiles.load(do_ref.at[b, :, n, :], mask=do_ok, other=0.0)
      lse2 = tiles.load(lse_ref.at[b, n, :], mask=row_ok, other=jnp.inf)
      delta = tiles.load(delta_ref.at[b, n, :], mask=row_ok, other=0.0)
      k = tiles.load(k_ref.at[b, keys, n // st.groups, :], mask=kv_ok, other=0.0)
      v = tiles.load(v_ref.at[b, keys, n // st.groups, :], mask=v_ok, other=0.0)
      q_seg = kv_seg = None
      if opt.q_seg is not None:
        q_seg = tiles.load(opt.q_seg.at[b, :], mask=row_ok, other=-1)
        kv_seg = tiles.load(opt.kv_seg.at[b, keys], mask=col_ok, other=-2)
      mask = None if opt.mask is None else opt.mask.at[index(opt.mask, b, n) + (slice(None),
                                                                               keys)]
      # The mask_mod's and score_mod's features of these rows and keys (refs [F, B or 1, N or
      # 1, rows or S]).
      def features_of(q_ref, kv_ref, rule):
        rows_of = [] if q_ref is None else tiles.feature_rows(
            q_ref, index(q_ref.at[0], b, n) + (slice(None),), row_ok,
            tiles.feature_count(rule, "row"))
        cols_of = [] if kv_ref is None else tiles.feature_rows(
            kv_ref, index(kv_ref.at[0], b, n) + (keys,), col_ok, tiles.feature_count(rule, "col"))
        return rows_of, cols_of
      offsets = () if opt.offsets is None else (opt.offsets[b, 0], opt.offsets[b, 1])
      pos = Positions(lengths_ref[b, 0], lengths_ref[b, 1], *offsets)
      s2, _ = tiles.masked_logits(
          q, k, rows, cols, ok, pos, params, q_seg, kv_seg,
          tiles.at(opt.bias, slice(None), keys), mask,
          features=features_of(opt.q_feat, opt.kv_feat, params.mask_rule),
          score_features=features_of(opt.score_q_feat, opt.score_kv_feat, params.score_rule),
          tables=opt.score_tables)
      p = jnp.exp2(_core.capped_exponent(s2 - lse2[:, None], tiles.huge_logits(opt, params),
                                       by_select=True))
      keep = tiles.keep(tiles.dropout_stream(opt, params, b, n), rows, k_start, block_k, params,
                        pos)
      dp = _core.dropped(plgpu.dot(do, v, trans_b=True), keep, params)
      return dz_sum + p * (dp - delta[:, None])

    # Blocks outside the band's range get zeros (the output buffer starts undefined).
    visited = jnp.logical_and(j >= lo, j < hi)
    pairs = jnp.where(visited, jnp.int32(shared_batch * shared_heads), jnp.int32(0))
    dz = lax.fori_loop(jnp.int32(0), pairs, one_pair, jnp.zeros((block_q, block_k), jnp.float32))
    plgpu.store(dbias_ref.at[:, keys], dz.astype(dbias_ref.dtype), mask=ok)
    return carry

  lax.fori_loop(0, pl.cdiv(st.seq_k, block_k), key_block, jnp.int32(0))


def dbias(inputs: Inputs, params: Params, config: Config, opt: tiles.Optional, lse2, d_out,
          delta):
  """The bias gradient, shaped like ``inputs.bias`` (any of its broadcast shapes)."""
  q, k, bias = inputs.query, inputs.key, inputs.bias
  b, t, n, _ = q.shape
  s, kh = k.shape[1], k.shape[2]
  st = tiles.static(inputs)
  hp, hvp = st.head_dim_p, st.value_dim_p  # (V and dO have the value's head dim)
  block_q, block_k = tiles.blocks(config.backward, inputs)
  whole = lambda *block: pl.BlockSpec(block, lambda i, bb, nb: (0,) * len(block))  # noqa: E731
  row_block = lambda *block: pl.BlockSpec(  # noqa: E731
      block, lambda i, bb, nb: (0,) * (len(block) - 1) + (i,))
  specs = opt.specs(
      offsets=lambda x: whole(b, 2),
      q_seg=lambda x: row_block(b, block_q),
      kv_seg=lambda x: whole(b, s),
      mask=lambda x: pl.BlockSpec(x.shape[:2] + (block_q, s), lambda i, bb, nb: (0, 0, i, 0)),
      bias=lambda x: pl.BlockSpec((None, None, block_q, s), lambda i, bb, nb: (bb, nb, i, 0)),
      seed=lambda x: whole(*x.shape),
      q_feat=lambda x: row_block(*x.shape[:3], block_q),
      kv_feat=lambda x: whole(*x.shape),
      score_q_feat=lambda x: row_block(*x.shape[:3], block_q),
      score_kv_feat=lambda x: whole(*x.shape),
      score_tables=tiles.tables_spec)
  q_rows = pl.BlockSpec((b, block_q, n, hp), lambda i, bb, nb: (0, i, 0, 0))
  do_rows = pl.BlockSpec((b, block_q, n, hvp), lambda i, bb, nb: (0, i, 0, 0))
  kernel = functools.partial(
      _dbias_kernel, params=params, st=st,
      schedule=tiles.schedule(inputs, params, block_q, block_k),
      shared_batch=b if bias.shape[0] == 1 else 1, shared_heads=n if bias.shape[1] == 1 else 1)
  return pl.pallas_call(
      kernel,
      grid=(pl.cdiv(t, block_q), bias.shape[0], bias.shape[1]),
      in_specs=[q_rows, whole(b, s, kh, hp), whole(b, s, kh, hvp), whole(b, 2), specs, do_rows,
                row_block(b, n, block_q), row_block(b, n, block_q)],
      out_specs=pl.BlockSpec((None, None, block_q, s), lambda i, bb, nb: (bb, nb, i, 0)),
      out_shape=_core.out_struct(bias.shape, bias.dtype, bias),
      compiler_params=tiles.compiler_params(config.backward),
      interpret=params.interpret,
      name="jaxflash_backward_dbias",
  )(q, k, inputs.value, inputs.lengths, opt, d_out, lse2, delta)

