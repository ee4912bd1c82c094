"""The Triton backward: dQ and dK/dV kernels that recompute S and P from Q, K, V and the LSE.

- `_dq_kernel`, grid (query blocks, B, N): recomputes its query tile's P over the key blocks the
  schedule names (the forward's) and accumulates dQ.
- `_dkv_kernel`, grid (key blocks, B, K): keeps a key/value tile on chip and walks every query
  head of its group (GQA) and the query blocks of the schedule's transpose, accumulating dK, dV.

They are separate kernels so that every gradient element has one writer: gradients are
deterministic and need no atomics. With GQA the K/V heads are indexed, never repeated. The bias
gradient, when asked for, is a third kernel (`dbias.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxflash import _core
from jaxflash._core import Inputs, Params
from jaxflash.backends.triton import dbias as dbias_kernel
from jaxflash.backends.triton import tiles
from jaxflash.backends.triton.config import Config
from jaxflash.schedule import Schedule


def _dq_kernel(q_ref, k_ref, v_ref, lengths_ref, opt: tiles.Optional, do_ref, lse_ref, delta_ref,
               dq_ref, *, params: Params, st: tiles.Static, schedule: Schedule):
  qt = tiles.query_tile(q_ref, lengths_ref, opt, params, st, schedule.block_q, schedule.block_k)
  do = tiles.load(do_ref, mask=tiles.tile_ok(qt.row_ok, st.value_dim_ok), other=0.0)
  # lse2 = +inf on rows that see nothing (and on rows past T), so P is exactly 0 there.
  lse2 = tiles.load(lse_ref, mask=qt.row_ok, other=jnp.inf)
  delta = tiles.load(delta_ref, mask=qt.row_ok, other=0.0)

  def body(j, dq, masked: bool):
    kt = tiles.key_tile(j, k_ref, opt, st, schedule.block_k, masked, params)
    v = tiles.load(v_ref.at[kt.keys, :], mask=kt.v_ok, other=0.0)
    s2, chain = tiles.tile_logits(qt, kt, opt, params, masked, derivative=True)
    p = jnp.exp2(_core.capped_exponent(s2 - lse2[:, None], tiles.huge_logits(opt, params),
                                       by_select=True))
    keep = tiles.keep(qt.stream, qt.rows, kt.k_start, schedule.block_k, params, qt.pos)
    dp = _core.dropped(plgpu.dot(do, v, trans_b=True), keep, params)
    ds = _core.dlogits_to_dqk(p * (dp - delta[:, None]), chain)
    # (dS scaled before its 16-bit cast: scale * dS K may be moderate where dS is past
    # float16's range, with a large loss scale.)
    return dq + plgpu.dot((ds * params.scale).astype(kt.k.dtype), kt.k)

  dq = jnp.zeros((schedule.block_q, st.head_dim_p), jnp.float32)
  dq = schedule.visit_kv(qt.q_start, qt.pos, body, dq, spans=qt.spans)
  plgpu.store(dq_ref, dq.astype(dq_ref.dtype),
              mask=tiles.tile_ok(qt.row_ok, st.dim_ok))


def _dkv_kernel(q_ref, k_ref, v_ref, lengths_ref, opt: tiles.Optional, do_ref, lse_ref,
                delta_ref, dk_ref, dv_ref, *, params: Params, st: tiles.Static,
                schedule: Schedule):
  block_q, block_k = schedule.block_q, schedule.block_k
  pos = tiles.positions(lengths_ref, opt.offsets)
  k_start = pl.program_id(0) * block_k
  cols, col_ok = st.bounds(k_start, block_k, st.seq_k)
  kv_ok, v_ok = tiles.tile_ok(col_ok, st.dim_ok), tiles.tile_ok(col_ok, st.value_dim_ok)
  k = tiles.load(k_ref, mask=kv_ok, other=0.0)
  v = tiles.load(v_ref, mask=v_ok, other=0.0)
  kv_seg = None if opt.kv_seg is None else tiles.load(opt.kv_seg, mask=col_ok, other=-2)
  # Program ids are read here, outside the loops (interpret mode cannot see them inside).
  batch, first_head = pl.program_id(1), pl.program_id(2) * st.groups
  counts = {side: (tiles.feature_count(params.mask_rule, side),
                   tiles.feature_count(params.score_rule, side)) for side in ("row", "col")}

  def head_of(ref, g):  # index into the group axis of a [.., G or 1, ..] ref
    return g if ref.shape[0] > 1 else jnp.int32(0)

  def features_of(ref, g, *index, ok, count):
    """A mask_mod's row or column features for head ``g`` of the group ([] without any)."""
    if ref is None:
      return []
    return tiles.feature_rows(ref, (head_of(ref.at[jnp.int32(0)], g),) + index, ok, count)

  def body(g, i, carry):
    # Query head g of this K/V head's group, query block i.
    dk, dv = carry
    q_start = i * block_q
    rows, row_ok = st.bounds(q_start, block_q, st.seq_q)
    q_ok = tiles.tile_ok(row_ok, st.dim_ok)
    q = tiles.load(q_ref.at[pl.ds(q_start, block_q), g, :], mask=q_ok, other=0.0)
    do = tiles.load(do_ref.at[pl.ds(q_start, block_q), g, :],
                    mask=tiles.tile_ok(row_ok, st.value_dim_ok), other=0.0)
    lse2 = tiles.load(lse_ref.at[g, pl.ds(q_start, block_q)], mask=row_ok, other=jnp.inf)
    delta = tiles.load(delta_ref.at[g, pl.ds(q_start, block_q)], mask=row_ok, other=0.0)
    q_seg = None if opt.q_seg is None else tiles.load(
        opt.q_seg.at[pl.ds(q_start, block_q)], mask=row_ok, other=-1)

    def dense_tile(ref):
      # Mask/bias refs hold every head of the group, or one head broadcast to all of them.
      # (A literal 0 index trips jax 0.11.2's load lowering; an int32 scalar does not.)
      if ref is None:
        return None
      return ref.at[g if ref.shape[0] > 1 else jnp.int32(0), pl.ds(q_start, block_q), :]

    q_rows = pl.ds(q_start, block_q)
    features = (features_of(opt.q_feat, g, q_rows, ok=row_ok, count=counts["row"][0]),
                features_of(opt.kv_feat, g, ok=col_ok, count=counts["col"][0]))
    score_features = (
        features_of(opt.score_q_feat, g, q_rows, ok=row_ok, count=counts["row"][1]),
        features_of(opt.score_kv_feat, g, ok=col_ok, count=counts["col"][1]))
    s2, chain = tiles.masked_logits(q, k, rows, cols, tiles.tile_ok(row_ok, col_ok), pos, params,
                                    q_seg, kv_seg, dense_tile(opt.bias), dense_tile(opt.mask),
                                    features=features, score_features=score_features,
                                    derivative=True, tables=opt.score_tables)
    p = jnp.exp2(_core.capped_exponent(s2 - lse2[:, None], tiles.huge_logits(opt, params),
                                       by_select=True))
    keep = tiles.keep(tiles.dropout_stream(opt, params, batch, first_head + g), rows, k_start,
                      block_k, params, pos)
    dv = dv + plgpu.dot(_core.dropped(p, keep, params).astype(do.dtype), do, trans_a=True)
    dp = _core.dropped(plgpu.dot(do, v, trans_b=True), keep, params)
    ds = _core.dlogits_to_dqk(p * (dp - delta[:, None]), chain)
    dk = dk + plgpu.dot((ds * params.scale).astype(q.dtype), q, trans_a=True)
    return dk, dv

  zeros = (jnp.zeros((block_k, st.head_dim_p), jnp.float32),
           jnp.zeros((block_k, st.value_dim_p), jnp.float32))
  spans_of = None
  if opt.lists is not None:  # a block table's query blocks, per head of the group
    blocks = pl.cdiv(st.seq_q, block_q)
    spans_of = lambda g: tiles.list_spans(opt.lists, blocks, head_of(opt.lists, g))  # noqa: E731
  dk, dv = schedule.visit_q(k_start, pos, body, zeros, repeat=st.groups,
                            spans_of=spans_of)
  plgpu.store(dk_ref, dk.astype(dk_ref.dtype), mask=kv_ok)
  plgpu.store(dv_ref, dv.astype(dv_ref.dtype), mask=v_ok)


def _grouped_dense(x: jax.Array, t: int, block_k: int, groups: int):
  """A mask/bias as the dK/dV grid reads it: [B|1, K|1, G|1, T, S], and its BlockSpec (all T
  rows of one key block, for every head of the group)."""
  bcast_b, bcast_n = x.shape[0] == 1, x.shape[1] == 1
  g = 1 if bcast_n else groups
  spec = pl.BlockSpec((None, None, g, t, block_k),
                      lambda j, b, h: (0 if bcast_b else b, 0 if bcast_n else h, 0, 0, j))
  return x.reshape(x.shape[0], x.shape[1] // g, g, t, x.shape[3]), spec


def _split_heads(x: jax.Array, axis: int, kv_heads: int, groups: int):
  """``x`` with its head axis (N or 1) split into (K or 1, G or 1)."""
  heads = (1, 1) if x.shape[axis] == 1 else (kv_heads, groups)
  return x.reshape(x.shape[:axis] + heads + x.shape[axis + 1:])


def _grouped_lists(x: jax.Array, kv_heads: int, groups: int):
  """Block lists [B, N or 1, key blocks, W] as the dK/dV grid (key block, batch row, K/V
  head) reads them, and their BlockSpec: one key block's row for every head of the group."""
  x = _split_heads(x, 1, kv_heads, groups)
  spec = pl.BlockSpec((None, None, x.shape[2], None, x.shape[-1]),
                      lambda j, b, h: (b, h if x.shape[1] > 1 else 0, 0, j, 0))
  return x, spec


def _grouped_features(x: jax.Array, kv_heads: int, groups: int, block_k: int | None):
  """Features [F, B or 1, N or 1, L] as the dK/dV grid reads them, and their BlockSpec: every
  row of the group's heads (query features, ``block_k`` None) or one key block's columns."""
  x = _split_heads(x, 2, kv_heads, groups)
  b_of = lambda b: b if x.shape[1] > 1 else 0  # noqa: E731
  h_of = lambda h: h if x.shape[2] > 1 else 0  # noqa: E731
  length = x.shape[-1] if block_k is None else block_k
  spec = pl.BlockSpec((x.shape[0], None, None, x.shape[3], length),
                      lambda j, b, h: (0, b_of(b), h_of(h), 0, 0 if block_k is None else j))
  return x, spec


def _dq(inputs, params, config, opt, d_out, lse2, delta, out_dtype):
  q, k, v = inputs.query, inputs.key, inputs.value
  b, t, n, _ = q.shape
  s = k.shape[1]
  st = tiles.static(inputs)
  block_q, block_k = tiles.blocks(config.backward, inputs)
  opt = tiles.with_lists(opt, inputs, params, block_q, block_k)
  rows = pl.BlockSpec((None, block_q, None, st.head_dim_p), lambda i, b, h: (b, i, h, 0))
  kv = pl.BlockSpec((None, s, None, st.head_dim_p), lambda i, b, h: (b, 0, h // st.groups, 0))
  # V and dO are blocked at their own padded head dim Dv.
  v_spec = pl.BlockSpec((None, s, None, st.value_dim_p),
                        lambda i, b, h: (b, 0, h // st.groups, 0))
  do_rows = pl.BlockSpec((None, block_q, None, st.value_dim_p), lambda i, b, h: (b, i, h, 0))
  stats = pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))
  return pl.pallas_call(
      functools.partial(_dq_kernel, params=params, st=st,
                        schedule=tiles.schedule(inputs, params, block_q, block_k)),
      grid=(pl.cdiv(t, block_q), b, n),
      in_specs=[rows, kv, v_spec, pl.BlockSpec((None, 2), lambda i, b, h: (b, 0)),
                tiles.query_block_specs(opt, block_q, s), do_rows, stats, stats],
      out_specs=rows,
      out_shape=_core.out_struct(q.shape, out_dtype, q),
      compiler_params=tiles.compiler_params(config.backward),
      interpret=params.interpret,
      name="jaxflash_backward_dq",
  )(q, k, v, inputs.lengths, opt, d_out, lse2, delta)


def _dkv(inputs, params, config, opt, d_out, lse2, delta, out_dtype):
  q, k, v = inputs.query, inputs.key, inputs.value
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  st = tiles.static(inputs)
  g, hp = st.groups, st.head_dim_p
  block_q, block_k = tiles.blocks(config.backward, inputs)
  grouped_rows = pl.BlockSpec((None, t, None, g, hp), lambda j, b, h: (b, 0, h, 0, 0))
  grouped_stats = pl.BlockSpec((None, None, g, t), lambda j, b, h: (b, h, 0, 0))
  kv = pl.BlockSpec((None, block_k, None, hp), lambda j, b, h: (b, j, h, 0))
  # V, dV and dO are blocked at their own padded head dim Dv.
  hv, hvp = v.shape[3], st.value_dim_p
  v_spec = pl.BlockSpec((None, block_k, None, hvp), lambda j, b, h: (b, j, h, 0))
  grouped_do = pl.BlockSpec((None, t, None, g, hvp), lambda j, b, h: (b, 0, h, 0, 0))
  dense = {name: None if x is None else _grouped_dense(x, t, block_k, g)
           for name, x in (("mask", opt.mask), ("bias", opt.bias))}
  opt = opt._replace(**{name: None if d is None else d[0] for name, d in dense.items()})
  opt = tiles.with_lists(opt, inputs, params, block_q, block_k, transpose=True)
  grouped = {"lists": None if opt.lists is None else _grouped_lists(opt.lists, kh, g)}
  for name, width in (("q_feat", None), ("kv_feat", block_k), ("score_q_feat", None),
                      ("score_kv_feat", block_k)):
    x = getattr(opt, name)
    grouped[name] = None if x is None else _grouped_features(x, kh, g, width)
  opt = opt._replace(**{name: None if d is None else d[0] for name, d in grouped.items()})
  specs = opt.specs(
      offsets=lambda x: pl.BlockSpec((None, 2), lambda j, b, h: (b, 0)),
      q_seg=lambda x: pl.BlockSpec((None, t), lambda j, b, h: (b, 0)),
      kv_seg=lambda x: pl.BlockSpec((None, block_k), lambda j, b, h: (b, j)),
      mask=lambda x: dense["mask"][1],
      bias=lambda x: dense["bias"][1],
      seed=lambda x: pl.BlockSpec(x.shape, lambda j, b, h: (0,)),
      lists=lambda x: grouped["lists"][1],
      q_feat=lambda x: grouped["q_feat"][1],
      kv_feat=lambda x: grouped["kv_feat"][1],
      score_q_feat=lambda x: grouped["score_q_feat"][1],
      score_kv_feat=lambda x: grouped["score_kv_feat"][1],
      score_tables=tiles.tables_spec)
  return pl.pallas_call(
      functools.partial(_dkv_kernel, params=params, st=st,
                        schedule=tiles.schedule(inputs, params, block_q, block_k)),
      grid=(pl.cdiv(s, block_k), b, kh),
      in_specs=[grouped_rows, kv, v_spec, pl.BlockSpec((None, 2), lambda j, b, h: (b, 0)),
                specs, grouped_do, grouped_stats, grouped_stats],
      out_specs=[kv, v_spec],
      out_shape=[_core.out_struct(k.shape, out_dtype, q),
                 _core.out_struct(v.shape, out_dtype, q)],
      compiler_params=tiles.compiler_params(config.backward),
      interpret=params.interpret,
      name="jaxflash_backward_dkv",
  )(q.reshape(b, t, kh, g, h), k, v, inputs.lengths, opt, d_out.reshape(b, t, kh, g, hv),
    lse2.reshape(b, kh, g, t), delta.reshape(b, kh, g, t))


def backward(inputs: Inputs, params: Params, config: Config, lse2, d_out, delta,
             want_dbias: bool):
  """``(dq, dk, dv, dbias)`` (see `jaxflash._core`); float32 for a partial call."""
  # (The kernels recompute the logits without a score_mod's row term, and P from their LSE.)
  inputs, params, term2 = _core.without_row_term(inputs, params)
  lse2 = _core.lse_without_row_term(lse2, term2)
  d_out = d_out.astype(inputs.query.dtype)
  out_dtype = jnp.float32 if params.partial else inputs.query.dtype
  opt = tiles.optional_inputs(inputs)
  dq = _dq(inputs, params, config, opt, d_out, lse2, delta, out_dtype)
  dk, dv = _dkv(inputs, params, config, opt, d_out, lse2, delta, out_dtype)
  dbias = None
  if want_dbias:
    dbias = dbias_kernel.dbias(inputs, params, config, opt, lse2, d_out, delta)
  return dq, dk, dv, dbias
