"""The XLA backend's forward: `lax.map` over query blocks, and inside it the schedule's loop
over key blocks with the online softmax in float32."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxflash import _core
from jaxflash import fp8
from jaxflash._core import Inputs, Params
from jaxflash.backends.xla import blocks
from jaxflash.backends.xla.blocks import Config


def ungroup_rows(x, lay: blocks.Layout):
  """lax.map output [num_blocks, B, block, K, G, H] -> [B, T, N, H] (H: dQ's or the output's)."""
  x = jnp.moveaxis(x, 0, 1).reshape(lay.b, lay.t_pad, lay.kh * lay.g, x.shape[-1])
  return x[:, :lay.t]


def forward(inputs: Inputs, params: Params, config: Config):
  """``(out [B, T, N, Dv], lse2 [B, N, T])`` (see `jaxflash._core`). An FP8 call runs on its
  dequantised inputs, in float32 (`jaxflash.fp8.dequantized`)."""
  if fp8.is_fp8(inputs.query.dtype):
    out, lse2 = forward(fp8.dequantized(inputs), params, config)
    return (out if params.partial else out.astype(params.output_dtype(inputs))), lse2
  lay = blocks.layout(inputs, config)
  blk = blocks.Blocks(inputs, lay, params)
  bq, bk = lay.block_q, lay.block_k
  out_dtype = jnp.float32 if params.partial else inputs.query.dtype
  sink2 = None  # [1, K, G, 1], base 2, broadcast over the batch and a block's rows
  if inputs.sinks is not None:
    sink2 = (inputs.sinks.astype(jnp.float32) * _core.LOG2_E).reshape(1, lay.kh, lay.g, 1)

  def one_q_block(i):
    q_start = i * bq
    q_blk = blocks.rows(blk.q, q_start, bq)

    def body(j, carry, masked):
      del masked  # every tile gets its element mask here
      acc, m, l = carry
      k_start = j * bk
      s2, _ = blk.logits(q_blk, blocks.rows(blk.k, k_start, bk), q_start, k_start)
      # Online softmax; rows with nothing visible yet shift by 0 so exp2 stays NaN-free.
      m_new = jnp.maximum(m, jnp.max(s2, axis=-1))
      m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      # (s2 <= m exactly, but XLA may compute s2 in two fusions that round it differently:
      # at |s2| ~ 1e10, a row masked by a bias of -1e10, exp2 of the difference overflowed.
      # Capped on every call here: XLA's fusions, not the call's options, decide it.)
      p = jnp.exp2(_core.capped_exponent(s2 - m_shift[..., None], True))
      alpha = jnp.exp2(m - m_shift)
      v_blk = blocks.rows(blk.v, k_start, bk)
      # Dropout zeroes entries of P for the product with V only: the normaliser l is the sum
      # of the undropped P. The 1 / P(keep) factor is applied once, to the output.
      keep = blk.keep(q_start, k_start)
      p_v = p if keep is None else jnp.where(keep, p, 0.0)
      pv = jnp.einsum("bkgqs,bskh->bkgqh", p_v.astype(v_blk.dtype), v_blk,
                      preferred_element_type=jnp.float32)
      return acc * alpha[..., None] + pv, m_new, l * alpha + jnp.sum(p, axis=-1)

    stats = (lay.b, lay.kh, lay.g, bq)
    init = (jnp.zeros(stats + (lay.hv,), jnp.float32), jnp.full(stats, -jnp.inf, jnp.float32),
            jnp.zeros(stats, jnp.float32))
    acc, m, l = blk.schedule.visit_kv(q_start, blk.pos, body, blk.carry(init),
                                      spans=blk.kv_spans(i))
    # Empty means l == 0 exactly: NaN logits give l = NaN and must make the row NaN.
    seen = jnp.logical_and(blk.q_is_valid(q_start), l != 0.0)
    factor, lse2 = _core.finish_rows(m, l, seen, sink2)
    if blk.stream is not None:
      factor = factor * params.keep_scale
    out = jnp.where(seen[..., None], acc * factor[..., None], 0.0)
    return jnp.moveaxis(out, 3, 1).astype(out_dtype), lse2

  out, lse2 = lax.map(one_q_block, jnp.arange(lay.t_pad // bq, dtype=jnp.int32))
  # lse2: [nq, B, K, G, bq] -> [B, N, T]
  lse2 = jnp.moveaxis(lse2, 0, 3).reshape(lay.b, lay.kh * lay.g, lay.t_pad)[..., :lay.t]
  return ungroup_rows(out, lay), lse2
