"""The Triton forward kernel: O and the base-2 LSE of one query block per program.

Grid (query blocks, B, N). A program keeps its query tile on chip, walks the key blocks the
schedule names (full blocks without an element mask), runs the online softmax in float32 and
writes O (normalised, or float32 for a partial result) and the LSE. K/V heads are indexed by
``head // groups`` (GQA), never repeated.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxflash import _core
from jaxflash._core import Inputs, Params
from jaxflash.backends.triton import tiles
from jaxflash.backends.triton.config import Config
from jaxflash.schedule import Schedule


def _forward_kernel(q_ref, k_ref, v_ref, lengths_ref, opt: tiles.Optional, sink_ref, term_ref,
                    o_ref, lse_ref, *,
                    params: Params, st: tiles.Static, schedule: Schedule):
  qt = tiles.query_tile(q_ref, lengths_ref, opt, params, st, schedule.block_q, schedule.block_k)
  # With a plain positive scale the tile's max is taken on the raw q @ k.T and scaled per row;
  # the per-entry scale then rides in the exp2 argument's multiply-add, saving one float32
  # multiply per logit on the forward's critical path.
  fold = tiles.folds_scale(params, opt)
  c = params.scale * _core.LOG2_E if fold else 1.0
  huge_logits = tiles.huge_logits(opt, params)

  def body(j, carry, masked: bool):
    acc, m, l = carry
    kt = tiles.key_tile(j, k_ref, opt, st, schedule.block_k, masked, params)
    s2, _ = tiles.tile_logits(qt, kt, opt, params, masked, raw=fold)
    # Online softmax. A row that has seen no visible key yet keeps m = -inf; shifting by 0 instead
    # keeps exp2 finite (exp2(-inf) = 0) so such rows stay at l = 0, acc = 0 without NaN. In a
    # full (unmasked) tile without a bias or score_mod every entry is finite, so m_new is too;
    # a bias or a score_mod may give -inf anywhere.
    m_new = jnp.maximum(m, jnp.max(s2, axis=1) * c if fold else jnp.max(s2, axis=1))
    finite = not masked and not huge_logits
    m_shift = m_new if finite else jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_shift)
    p = jnp.exp2(_core.capped_exponent((s2 * c if fold else s2) - m_shift[:, None],
                                       huge_logits, by_select=True))
    v = tiles.load(v_ref.at[kt.keys, :], mask=kt.v_ok, other=0.0)
    # Dropout removes entries of P from the product with V only; l sums the undropped P, and
    # 1 / P(keep) is applied once, to the output.
    keep = tiles.keep(qt.stream, qt.rows, kt.k_start, schedule.block_k, params, qt.pos)
    p_v = p if keep is None else jnp.where(keep, p, 0.0)
    acc = acc * alpha[:, None] + plgpu.dot(p_v.astype(v.dtype), v)
    return acc, m_new, l * alpha + jnp.sum(p, axis=1)

  block_q = schedule.block_q
  init = (jnp.zeros((block_q, st.value_dim_p), jnp.float32),
          jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32))
  acc, m, l = schedule.visit_kv(qt.q_start, qt.pos, body, init, spans=qt.spans)

  # A row is empty only when it saw no visible key (l == 0). NaN logits make l NaN, and the row
  # must come out NaN (as in jax.nn), not as an empty row: `l > 0` would hide them as zeros.
  seen = jnp.logical_and(qt.rows < qt.pos.q_len, l != 0.0)
  sink2 = None if sink_ref is None else sink_ref[0] * _core.LOG2_E
  # A score_mod's row term, left out of the logits (`_core.without_row_term`).
  term2 = None if term_ref is None else tiles.load(term_ref, mask=qt.row_ok, other=0.0)
  factor, lse2 = _core.finish_rows(m, l, seen, sink2, term2)
  if qt.stream is not None:
    factor = factor * params.keep_scale
  out = jnp.where(seen[:, None], acc * factor[:, None], 0.0)
  plgpu.store(o_ref, out.astype(o_ref.dtype), mask=tiles.tile_ok(qt.row_ok, st.value_dim_ok))
  plgpu.store(lse_ref, lse2, mask=qt.row_ok)


def forward(inputs: Inputs, params: Params, config: Config):
  """``(out [B, T, N, Dv], lse2 [B, N, T])`` (see `jaxflash._core`)."""
  inputs, params, term2 = _core.without_row_term(inputs, params)
  q, k, v = inputs.query, inputs.key, inputs.value
  b, t, n, _ = q.shape
  s = k.shape[1]
  st = tiles.static(inputs)
  block_q, block_k = tiles.blocks(config.forward, inputs)
  hp, g = st.head_dim_p, st.groups
  opt = tiles.with_lists(tiles.optional_inputs(inputs), inputs, params, block_q, block_k)
  rows = pl.BlockSpec((None, block_q, None, hp), lambda i, b, h: (b, i, h, 0))
  kv = pl.BlockSpec((None, s, None, hp), lambda i, b, h: (b, 0, h // g, 0))
  # V and O are blocked at their own padded head dim Dv.
  v_spec = pl.BlockSpec((None, s, None, st.value_dim_p), lambda i, b, h: (b, 0, h // g, 0))
  o_rows = pl.BlockSpec((None, block_q, None, st.value_dim_p), lambda i, b, h: (b, i, h, 0))
  kernel = functools.partial(_forward_kernel, params=params, st=st,
                             schedule=tiles.schedule(inputs, params, block_q, block_k))
  out_dtype = jnp.float32 if params.partial else q.dtype
  # The heads' sinks as [N, 1]: each program reads its head's one (a block of one element).
  sinks = None if inputs.sinks is None else inputs.sinks.astype(jnp.float32).reshape(n, 1)
  term_spec = None
  if term2 is not None:  # [B or 1, N or 1, T]: this block's rows
    shared_b, shared_h = term2.shape[0] == 1, term2.shape[1] == 1
    term_spec = pl.BlockSpec((None, None, block_q), lambda i, b, h: (
        0 if shared_b else b, 0 if shared_h else h, i))
  return pl.pallas_call(
      kernel,
      grid=(pl.cdiv(t, block_q), b, n),
      in_specs=[rows, kv, v_spec, pl.BlockSpec((None, 2), lambda i, b, h: (b, 0)),
                tiles.query_block_specs(opt, block_q, s),
                None if sinks is None else pl.BlockSpec((None, 1), lambda i, b, h: (h, 0)),
                term_spec],
      out_specs=[o_rows, pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))],
      out_shape=[_core.out_struct((b, t, n, v.shape[3]), out_dtype, q),
                 _core.out_struct((b, n, t), jnp.float32, q)],
      compiler_params=tiles.compiler_params(config.forward),
      interpret=params.interpret,
      name="jaxflash_forward",
  )(q, k, v, inputs.lengths, opt, sinks, term2)
