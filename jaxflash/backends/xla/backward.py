"""The XLA backend's backward, recomputing P tile by tile from Q, K, V and the LSE:

- dQ (and the bias gradient's row slab, when asked for): `lax.map` over query blocks, looping
  over the key blocks the schedule names;
- dK/dV: `lax.map` over key blocks, looping over the schedule's transpose, every query head of a
  GQA group at once.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxflash import _core
from jaxflash._core import Inputs, Params
from jaxflash.backends.xla import blocks
from jaxflash.backends.xla.blocks import Config
from jaxflash.backends.xla.forward import ungroup_rows


def backward(inputs: Inputs, params: Params, config: Config, lse2, d_out, delta,
             want_dbias: bool):
  """``(dq, dk, dv, dbias)`` (see `jaxflash._core`); float32 for a partial call."""
  lay = blocks.layout(inputs, config)
  blk = blocks.Blocks(inputs, lay, params)
  bq, bk = lay.block_q, lay.block_k
  q_dtype = inputs.query.dtype
  out_dtype = jnp.float32 if params.partial else q_dtype
  do = blocks.pad_axis(d_out.astype(q_dtype).reshape(lay.b, lay.t, lay.kh, lay.g, lay.hv), 1,
                       lay.t_pad)
  # Per-row statistics grouped [B, K, G, T_pad]; padded rows get lse2 = +inf, hence P = 0.
  lse2 = blocks.pad_axis(lse2.reshape(lay.b, lay.kh, lay.g, lay.t), 3, lay.t_pad, jnp.inf)
  delta = blocks.pad_axis(delta.reshape(lay.b, lay.kh, lay.g, lay.t), 3, lay.t_pad)

  def tile_grads(q_start, k_start, q_blk, k_blk, v_blk, do_blk):
    """One tile's dropped P (for dV), dZ (w.r.t. the natural logits, i.e. dbias) and dS (w.r.t.
    q @ k.T before the final `scale`)."""
    s2, chain = blk.logits(q_blk, k_blk, q_start, k_start, derivative=True)
    p = jnp.exp2(s2 - blocks.rows(lse2, q_start, bq, axis=3)[..., None])
    dp = jnp.einsum("bqkgh,bskh->bkgqs", do_blk, v_blk, preferred_element_type=jnp.float32)
    keep = blk.keep(q_start, k_start)
    dz = p * (_core.dropped(dp, keep, params)
              - blocks.rows(delta, q_start, bq, axis=3)[..., None])
    return _core.dropped(p, keep, params), dz, _core.dlogits_to_dqk(dz, chain)

  def bias_tile(dz):
    """[B, K, G, bq, bk] -> the bias's [B or 1, N or 1, bq, bk], summed over broadcast axes."""
    if inputs.bias.shape[0] == 1:
      dz = jnp.sum(dz, axis=0, keepdims=True)
    dz = dz.reshape(dz.shape[0], lay.kh * lay.g, bq, bk)
    if inputs.bias.shape[1] == 1:
      dz = jnp.sum(dz, axis=1, keepdims=True)
    return dz

  def dq_block(i):
    """dQ of one query block, and with `want_dbias` the bias gradient's [.., bq, S] row slab."""
    q_start = i * bq
    q_blk, do_blk = blocks.rows(blk.q, q_start, bq), blocks.rows(do, q_start, bq)

    def body(j, carry, masked):
      del masked
      dq, dbias = carry
      k_start = j * bk
      k_blk = blocks.rows(blk.k, k_start, bk)
      _, dz, ds = tile_grads(q_start, k_start, q_blk, k_blk, blocks.rows(blk.v, k_start, bk),
                             do_blk)
      dq = dq + jnp.einsum("bkgqs,bskh->bqkgh", ds.astype(k_blk.dtype), k_blk,
                           preferred_element_type=jnp.float32)
      if want_dbias:
        dbias = lax.dynamic_update_slice_in_dim(dbias, bias_tile(dz), k_start, axis=3)
      return dq, dbias

    # Key blocks the schedule skips see nothing: their bias gradient stays 0.
    dbias = (jnp.zeros(inputs.bias.shape[:2] + (bq, lay.s_pad), jnp.float32) if want_dbias
             else None)
    dq, dbias = blk.schedule.visit_kv(q_start, blk.pos, body,
                                      blk.carry((jnp.zeros(q_blk.shape, jnp.float32), dbias)),
                                      spans=blk.kv_spans(i))
    return (dq * params.scale).astype(out_dtype), dbias

  def dkv_block(j):
    k_start = j * bk
    k_blk, v_blk = blocks.rows(blk.k, k_start, bk), blocks.rows(blk.v, k_start, bk)

    def body(g, i, carry):
      del g  # every query head of the group at once
      dk, dv = carry
      q_start = i * bq
      q_blk, do_blk = blocks.rows(blk.q, q_start, bq), blocks.rows(do, q_start, bq)
      p_dropped, _, ds = tile_grads(q_start, k_start, q_blk, k_blk, v_blk, do_blk)
      dv = dv + jnp.einsum("bkgqs,bqkgh->bskh", p_dropped.astype(do_blk.dtype), do_blk,
                           preferred_element_type=jnp.float32)
      dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", ds.astype(q_blk.dtype), q_blk,
                           preferred_element_type=jnp.float32)
      return dk, dv

    zeros = jnp.zeros(k_blk.shape, jnp.float32), jnp.zeros(v_blk.shape, jnp.float32)
    dk, dv = blk.schedule.visit_q(k_start, blk.pos, body, blk.carry(zeros),
                                  spans=blk.q_spans(j))
    return (dk * params.scale).astype(out_dtype), dv.astype(out_dtype)

  dq, dbias = lax.map(dq_block, jnp.arange(lay.t_pad // bq, dtype=jnp.int32))
  dq = ungroup_rows(dq, lay)
  if want_dbias:  # [nq, B|1, N|1, bq, S_pad] -> [B|1, N|1, T, S]
    dbias = jnp.moveaxis(dbias, 0, 2).reshape(inputs.bias.shape[:2] + (lay.t_pad, lay.s_pad))
    dbias = dbias[:, :, :lay.t, :lay.s].astype(inputs.bias.dtype)
  dk, dv = lax.map(dkv_block, jnp.arange(lay.s_pad // bk, dtype=jnp.int32))

  def ungroup_keys(x):  # [nk, B, bk, K, H or Dv] -> [B, S, K, H or Dv]
    return jnp.moveaxis(x, 0, 1).reshape(lay.b, lay.s_pad, lay.kh, x.shape[-1])[:, :lay.s]

  return dq, ungroup_keys(dk), ungroup_keys(dv), dbias
