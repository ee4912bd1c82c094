"""The XLA backend's backward, recomputing P tile by tile from Q, K, V and the LSE:

- dQ (and the bias gradient's row slab, when asked for): `lax.map` over query blocks, looping
  over the key blocks the schedule names;
- dK/dV: `lax.map` over key blocks, looping over the schedule's transpose, every query head of a
  GQA group at once.
"""

from __future__ import annotations

import dataclasses

import jax
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


def score_const_gradients(inputs: Inputs, params: Params, lse2, d_out, delta,
                          config: Config = Config()) -> tuple:
  """The gradients of the arrays a score_mod closes over (`Inputs.score_consts`, in the order
  of its split's jaxpr; None for those that are not floating point): the sum over every
  visible entry of dZ (the loss's derivative w.r.t. the entry's logit after the score_mod)
  times the derivative of the score_mod's result w.r.t. the arrays, which `jax.vjp` of the
  whole function takes on each tile. One pass of the dQ loop's tiles, in a fixed order
  (deterministic), whatever backend computed the rest of the gradient; it recomputes S, P
  and dP, so it costs about an XLA backward. (A relative-position table's gradient is the sum
  of dZ along each diagonal; a kernel could add it up as it goes.)"""
  rule = params.score_rule
  consts = inputs.score_consts
  wanted = [jnp.issubdtype(jnp.result_type(c), jnp.floating) for c in consts]
  lay = blocks.layout(inputs, config)
  blk = blocks.Blocks(inputs, lay, params)
  bq, bk = lay.block_q, lay.block_k
  plain = dataclasses.replace(params, score_rule=None)  # (the score_mod's input logits)
  do = blocks.pad_axis(d_out.astype(inputs.query.dtype).reshape(
      lay.b, lay.t, lay.kh, lay.g, lay.hv), 1, lay.t_pad)
  lse2 = blocks.pad_axis(lse2.reshape(lay.b, lay.kh, lay.g, lay.t), 3, lay.t_pad, jnp.inf)
  delta = blocks.pad_axis(delta.reshape(lay.b, lay.kh, lay.g, lay.t), 3, lay.t_pad)
  heads = jnp.arange(lay.kh * lay.g, dtype=jnp.int32).reshape(1, lay.kh, lay.g, 1, 1)
  batch = jnp.arange(lay.b, dtype=jnp.int32).reshape(lay.b, 1, 1, 1, 1)

  def tile(q_start, k_start, q_blk, do_blk, grads):
    k_blk, v_blk = blocks.rows(blk.k, k_start, bk), blocks.rows(blk.v, k_start, bk)
    s2, _ = blk.logits(q_blk, k_blk, q_start, k_start)
    p = jnp.exp2(s2 - blocks.rows(lse2, q_start, bq, axis=3)[..., None])
    dp = jnp.einsum("bqkgh,bskh->bkgqs", do_blk, v_blk, preferred_element_type=jnp.float32)
    dz = p * (_core.dropped(dp, blk.keep(q_start, k_start), params)
              - blocks.rows(delta, q_start, bq, axis=3)[..., None])
    dz = jnp.where(p > 0, dz, 0.0)  # (no NaN from entries nothing sees)
    qk = jnp.einsum("bqkgh,bskh->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32)
    z, _ = _core.logits(qk, plain, None)
    q_idx = jnp.minimum(q_start + jnp.arange(bq, dtype=jnp.int32), lay.t - 1)
    k_idx = jnp.minimum(k_start + jnp.arange(bk, dtype=jnp.int32), lay.s - 1)

    def scores(*arrays):
      return rule.reference(batch, heads, q_idx.reshape(1, 1, 1, bq, 1),
                            k_idx.reshape(1, 1, 1, 1, bk), consts=arrays, score=z)

    _, vjp = jax.vjp(scores, *consts)
    return tuple(g if g is None else g + d.astype(jnp.float32)
                 for g, d in zip(grads, vjp(dz)))

  def query_block(grads, i):
    q_start = i * bq
    q_blk, do_blk = blocks.rows(blk.q, q_start, bq), blocks.rows(do, q_start, bq)
    grads = blk.schedule.visit_kv(
        q_start, blk.pos, lambda j, g, masked: tile(q_start, j * bk, q_blk, do_blk, g),
        blk.carry(grads), spans=blk.kv_spans(i))
    return grads, None

  zeros = tuple(jnp.zeros(jnp.shape(c), jnp.float32) if want else None
                for c, want in zip(consts, wanted))
  grads, _ = lax.scan(query_block, blk.carry(zeros), jnp.arange(lay.t_pad // bq,
                                                                  dtype=jnp.int32))
  return tuple(None if g is None else g.astype(jnp.result_type(c))
               for g, c in zip(grads, consts))
