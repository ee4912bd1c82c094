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
import numpy as np
from jax import lax

from jaxflash import _core
from jaxflash import mask_mod as mask_mod_lib
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
  out_dtype = jnp.float32 if params.partial else inputs.query.dtype
  do, lse2, delta = _padded_rows(inputs, lay, lse2, d_out, delta)

  def tile_grads(q_start, k_start, q_blk, k_blk, v_blk, do_blk):
    """One tile's dropped P (for dV), dZ (w.r.t. the natural logits, i.e. dbias) and dS (w.r.t.
    q @ k.T before the final `scale`)."""
    p, keep, dz, chain = _tile_dz(blk, params, lse2, delta, q_start, k_start, q_blk, k_blk,
                                  v_blk, do_blk, derivative=True)
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
      # (dS scaled before its 16-bit cast: scale * dS K may be moderate where dS is past
      # float16's range, with a large loss scale.)
      dq = dq + jnp.einsum("bkgqs,bskh->bqkgh", (ds * params.scale).astype(k_blk.dtype), k_blk,
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
    return dq.astype(out_dtype), dbias

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
      dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", (ds * params.scale).astype(q_blk.dtype), q_blk,
                           preferred_element_type=jnp.float32)
      return dk, dv

    zeros = jnp.zeros(k_blk.shape, jnp.float32), jnp.zeros(v_blk.shape, jnp.float32)
    dk, dv = blk.schedule.visit_q(k_start, blk.pos, body, blk.carry(zeros),
                                  spans=blk.q_spans(j))
    return dk.astype(out_dtype), dv.astype(out_dtype)

  dq, dbias = lax.map(dq_block, jnp.arange(lay.t_pad // bq, dtype=jnp.int32))
  dq = ungroup_rows(dq, lay)
  if want_dbias:  # [nq, B|1, N|1, bq, S_pad] -> [B|1, N|1, T, S]
    dbias = jnp.moveaxis(dbias, 0, 2).reshape(inputs.bias.shape[:2] + (lay.t_pad, lay.s_pad))
    dbias = dbias[:, :, :lay.t, :lay.s].astype(inputs.bias.dtype)
  dk, dv = lax.map(dkv_block, jnp.arange(lay.s_pad // bk, dtype=jnp.int32))

  def ungroup_keys(x):  # [nk, B, bk, K, H or Dv] -> [B, S, K, H or Dv]
    return jnp.moveaxis(x, 0, 1).reshape(lay.b, lay.s_pad, lay.kh, x.shape[-1])[:, :lay.s]

  return dq, ungroup_keys(dk), ungroup_keys(dv), dbias


# The gradient pass's tiles hold at most this many entries over the batch and heads (float32:
# 256 MiB a tile, a few of them live at once): on an H200 a relative-position table's pass at
# 4k (B = 4, 16 heads) took 27.4, 14.7, 9.1 and 7.5 ms with blocks of 128, 256, 512 and 1024.
_GRADIENT_TILE_ENTRIES = 2 ** 26


def gradient_config(inputs: Inputs) -> Config:
  """`score_const_gradients`' blocks: square, the largest power of two up to 1024 whose tiles
  hold at most `_GRADIENT_TILE_ENTRIES` entries (128 at least)."""
  b, _, n, _ = inputs.query.shape
  size = 1024
  while size > 128 and b * n * size * size > _GRADIENT_TILE_ENTRIES:
    size //= 2
  return Config(block_q=size, block_k=size)


def _padded_rows(inputs: Inputs, lay: blocks.Layout, lse2, d_out, delta):
  """``(dO, lse2, delta)`` grouped by K/V head and padded to whole query blocks: dO [B, T_pad, K,
  G, Dv], the per-row statistics [B, K, G, T_pad]; padded rows get lse2 = +inf, hence P = 0."""
  do = blocks.pad_axis(d_out.astype(inputs.query.dtype).reshape(
      lay.b, lay.t, lay.kh, lay.g, lay.hv), 1, lay.t_pad)
  lse2 = blocks.pad_axis(lse2.reshape(lay.b, lay.kh, lay.g, lay.t), 3, lay.t_pad, jnp.inf)
  delta = blocks.pad_axis(delta.reshape(lay.b, lay.kh, lay.g, lay.t), 3, lay.t_pad)
  return do, lse2, delta


def _tile_dz(blk: blocks.Blocks, params: Params, lse2, delta, q_start, k_start, q_blk, k_blk,
             v_blk, do_blk, derivative: bool = False, qk=None):
  """``(P, keep mask, dZ, chain)`` of one tile: dZ the loss's derivative w.r.t. the natural
  logits (`_padded_rows`' statistics; ``qk`` as `Blocks.logits` takes it)."""
  bq = q_blk.shape[1]
  s2, chain = blk.logits(q_blk, k_blk, q_start, k_start, derivative=derivative, qk=qk)
  # (s2 <= lse2 exactly; the minimum keeps a recomputation that rounds s2 up at |s2| ~ 1e10,
  # a row masked by a huge finite bias, from overflowing, as in the forward.)
  p = jnp.exp2(_core.capped_exponent(s2 - blocks.rows(lse2, q_start, bq, axis=3)[..., None],
                                     True))
  dp = jnp.einsum("bqkgh,bskh->bkgqs", do_blk, v_blk, preferred_element_type=jnp.float32)
  keep = blk.keep(q_start, k_start)
  dz = p * (_core.dropped(dp, keep, params) - blocks.rows(delta, q_start, bq, axis=3)[..., None])
  return p, keep, dz, chain


def score_const_gradients(inputs: Inputs, params: Params, lse2, d_out, delta,
                          config: Config | None = None) -> tuple:
  """The gradients of the arrays a score_mod closes over (`Inputs.score_consts`, in the order
  of its split's jaxpr; None for those that are not floating point): the sum over every
  visible entry of dZ (the loss's derivative w.r.t. the entry's logit after the score_mod)
  times the derivative of the score_mod's result w.r.t. the arrays. One pass over the dQ
  loop's tiles in a fixed order (deterministic), whatever backend computed the rest of the
  gradient; it recomputes S, P and dP, in large tiles (`gradient_config`; ``config`` to
  choose).

  A rule the kernels run (`Split.kernel_reason` None) whose lookups, if any, read through
  ``q_idx - kv_idx`` alone goes through its features: each tile's dZ times the tile rule's
  derivative w.r.t. its row features, column features and lookups (`jax.vjp` of `Split.tile`)
  is summed along rows, columns and diagonals (`_diagonal_sums`), and `jax.vjp` of the
  features (`Split.features`, `Split.band_values`) takes those sums to the arrays: no
  per-entry scatter. Any other rule takes `jax.vjp` of the whole function per entry
  (`Split.reference`), whose scatter into the arrays is slow."""
  rule = params.score_rule
  lay = blocks.layout(inputs, gradient_config(inputs) if config is None else config)
  blk = blocks.Blocks(inputs, lay, params)
  bq, bk = lay.block_q, lay.block_k
  plain = dataclasses.replace(params, score_rule=None)  # (the score_mod's input logits)
  do, lse2, delta = _padded_rows(inputs, lay, lse2, d_out, delta)

  def dz_and_z(q_start, k_start, q_blk, do_blk):
    """A tile's dZ (0 where nothing is seen) and the score_mod's input logits there."""
    k_blk, v_blk = blocks.rows(blk.k, k_start, bk), blocks.rows(blk.v, k_start, bk)
    qk = blocks.qk_of(q_blk, k_blk)
    p, _, dz, _ = _tile_dz(blk, params, lse2, delta, q_start, k_start, q_blk, k_blk, v_blk,
                           do_blk, qk=qk)
    return jnp.where(p > 0, dz, 0.0), _core.logits(qk, plain, None)[0]

  def over_tiles(init, tile):
    """``carry = tile(q_start, k_start, dz, z, carry)`` over every tile the dQ loop visits
    (``carry`` a pytree of float32 arrays)."""
    typed = lambda c: jax.tree.map(  # noqa: E731 (varying like the tiles: `Blocks.carry`)
        lambda x: _core.varying_like(x, blk.manual_axes), c)

    def query_block(carry, i):
      q_start = i * bq
      q_blk, do_blk = blocks.rows(blk.q, q_start, bq), blocks.rows(do, q_start, bq)

      def body(j, c, masked):
        del masked
        return tile(q_start, j * bk, *dz_and_z(q_start, j * bk, q_blk, do_blk), c)
      return blk.schedule.visit_kv(q_start, blk.pos, body, typed(carry),
                                   spans=blk.kv_spans(i)), None

    carry, _ = lax.scan(query_block, typed(init),
                        jnp.arange(lay.t_pad // bq, dtype=jnp.int32))
    return carry

  # (The features path makes them for positions from 0: a call with offsets goes per entry.)
  if (rule.kernel_reason is None and (not rule.lookups or rule.diagonal_lookups)
      and inputs.offsets is None):
    return _through_features(rule, inputs.score_consts, lay, over_tiles)
  return _per_entry(rule, inputs.score_consts, blk, over_tiles)


def _floating(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _per_entry(rule, consts, blk: blocks.Blocks, over_tiles) -> tuple:
  """`score_const_gradients` by `jax.vjp` of the whole function on each tile."""
  bq, bk = blk.lay.block_q, blk.lay.block_k

  def tile(q_start, k_start, dz, z, grads):
    q_idx = (q_start + jnp.arange(bq, dtype=jnp.int32)).reshape(1, 1, 1, bq, 1)
    k_idx = (k_start + jnp.arange(bk, dtype=jnp.int32)).reshape(1, 1, 1, 1, bk)
    scores = lambda *arrays: blk.whole_function(  # noqa: E731
        rule, arrays, *blk.absolute(q_idx, k_idx), z)
    # (Differentiated as copies varying like the tile, inside `jax.shard_map`: each device's
    # own part of an invariant array's cotangent, summed once at the end by `summed_like`; of
    # the array itself JAX would sum over the devices on every tile, a collective a tile.)
    _, vjp = jax.vjp(scores, *_core.varying_as(consts, dz, z))
    return tuple(g if g is None else g + d.astype(jnp.float32)
                 for g, d in zip(grads, vjp(dz)))

  zeros = tuple(jnp.zeros(jnp.shape(c), jnp.float32) if _floating(c) else None
                for c in consts)
  grads = over_tiles(zeros, tile)
  return tuple(None if g is None else g.astype(jnp.result_type(c))
               for g, c in zip(grads, consts))


def _through_features(rule, consts, lay, over_tiles) -> tuple:
  """`score_const_gradients` through the rule's features and lookups (see there)."""
  b, n, t, s = lay.b, lay.kh * lay.g, lay.t, lay.s
  bq, bk = lay.block_q, lay.block_k
  shape = (b, lay.kh, lay.g, bq, bk)

  def derived(*arrays):  # (row features, column features, lookups per diagonal)
    return (rule.features(rule.row_vars, b, n, t, mask_mod_lib.Q, arrays, raw=True) or (),
            rule.features(rule.col_vars, b, n, s, mask_mod_lib.KV, arrays, raw=True) or (),
            rule.band_values(b, n, t, s, arrays, raw=True) or ())

  values, vjp_derived = jax.vjp(derived, *consts)
  lengths = (lay.t_pad, lay.s_pad, lay.t_pad + lay.s_pad)

  def grouped(x):  # [B|1, N|1, ...] -> [B|1, K|1, G|1, ...]
    heads = (lay.kh, lay.g) if x.shape[1] > 1 else (1, 1)
    return x.reshape(x.shape[:1] + heads + x.shape[2:])

  def ungrouped(x):  # the inverse
    return x.reshape(x.shape[:1] + (x.shape[1] * x.shape[2],) + x.shape[3:])

  def tile(q_start, k_start, dz, z, sums):
    q_idx = q_start + jnp.arange(bq, dtype=jnp.int32)
    k_idx = k_start + jnp.arange(bk, dtype=jnp.int32)
    rows = [grouped(blocks.rows(blocks.pad_axis(x, 2, lay.t_pad), q_start, bq, axis=2))[
        ..., :, None] for x in values[0]]
    cols = [grouped(blocks.rows(blocks.pad_axis(x, 2, lay.s_pad), k_start, bk, axis=2))[
        ..., None, :] for x in values[1]]
    diagonal = jnp.clip(q_idx[:, None] - k_idx[None, :] + s, 0, t + s - 1)
    bands = [grouped(x[..., diagonal]) for x in values[2]]

    def scores(rows, cols, bands):
      return rule.tile(shape, q_idx.reshape(1, 1, 1, bq, 1), k_idx.reshape(1, 1, 1, 1, bk),
                       list(rows), list(cols), score=z,
                       bands=list(bands) if rule.lookups else None)

    # (Varying copies, as in `_per_entry`: each device's own part, summed once below.) The
    # features enter per entry, and their terms are summed where something is seen: a rule
    # whose derivative is NaN or inf where the mask hides it (``log(q_idx - kv_idx + 1)``
    # under is_causal) then adds 0 there, not 0 * NaN (JAX's where would give NaN).
    entries = lambda xs: [jnp.broadcast_to(x, dz.shape) for x in xs]  # noqa: E731
    _, vjp = jax.vjp(scores, *(_core.varying_as(entries(x), dz, z) for x in (rows, cols, bands)))
    seen = dz != 0
    d_rows, d_cols, d_bands = ([_summed_like(_where_seen(seen, d), x) for d, x in zip(ds, xs)]
                               for ds, xs in zip(vjp(dz), (rows, cols, bands)))
    # Each sum's window: the tile's rows, its keys, and its diagonals (from q - k = q_start -
    # k_start - (bk - 1) on, at q - k + S_pad).
    starts = (q_start, k_start, q_start - k_start - (bk - 1) + lay.s_pad)
    made = ([ungrouped(d[..., 0]) for d in d_rows], [ungrouped(d[..., 0, :]) for d in d_cols],
            [_diagonal_sums(ungrouped(d)) for d in d_bands])
    return tuple(tuple(None if acc is None else _add_at(acc, part.astype(jnp.float32), start)
                       for acc, part in zip(kind, parts))
                 for kind, parts, start in zip(sums, made, starts))

  init = tuple(tuple(jnp.zeros(x.shape[:2] + (length,), jnp.float32) if _floating(x) else None
                     for x in kind) for kind, length in zip(values, lengths))
  sums = over_tiles(init, tile)
  windows = ((0, t), (0, s), (lay.s_pad - s, lay.s_pad + t))
  # (Under `jax.shard_map` a feature made from captured arrays that do not vary over a manual
  # axis gets the sum of every device's part: `summed_like`.)
  cotangents = tuple(
      tuple(np.zeros(x.shape, jax.dtypes.float0) if acc is None else
            _core.summed_like(acc[..., lo:hi], x).astype(x.dtype) for acc, x in zip(kind, xs))
      for kind, xs, (lo, hi) in zip(sums, values, windows))
  return tuple(g if _floating(c) else None for g, c in zip(vjp_derived(cotangents), consts))


def _where_seen(seen, d):
  return d if d.dtype == jax.dtypes.float0 else jnp.where(seen, d, jnp.zeros((), d.dtype))


def _summed_like(d, x):
  """``d`` summed over the axes that ``x`` broadcasts (size 1 there), keeping them (an
  integer feature's float0 cotangent shaped like ``x``)."""
  if d.dtype == jax.dtypes.float0:
    return np.zeros(x.shape, jax.dtypes.float0)
  return jnp.sum(d, axis=tuple(i for i, (a, b) in enumerate(zip(x.shape, d.shape))
                                if a == 1 and b != 1), keepdims=True)


def _add_at(acc, part, start):
  """``acc`` with ``part`` added along its last axis from ``start`` on."""
  size = part.shape[-1]
  old = lax.dynamic_slice_in_dim(acc, start, size, axis=acc.ndim - 1)
  return lax.dynamic_update_slice_in_dim(acc, old + part, start, axis=acc.ndim - 1)


def _diagonal_sums(x):
  """[..., R, C] -> [..., R + C - 1]: entry ``i`` the sum of x[r, c] over r - c = i - (C - 1).
  (The columns reversed and each row shifted one further than the last, by padding and
  reshaping, so that a diagonal becomes a column.)"""
  r, c = x.shape[-2:]
  y = jnp.pad(x[..., ::-1], [(0, 0)] * (x.ndim - 1) + [(0, r)])  # [..., R, C + R]
  y = y.reshape(x.shape[:-2] + (r * (c + r),))[..., :r * (c + r - 1)]
  return y.reshape(x.shape[:-2] + (r, c + r - 1)).sum(axis=-2)
