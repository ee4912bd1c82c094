"""The same FlashAttention algorithm in plain JAX: blockwise loops, online softmax, recomputing VJP.

Runs on any backend (it is the default on CPU and TPU). Memory is O(T + S) per head: the largest
temporary is one [B, N, block_q, block_k] tile of logits. Loops:

- forward and dQ: `lax.map` over query blocks, and inside it a `fori_loop` over the key blocks that
  `masking.kv_block_range` allows (so causal/window/length-masked blocks are skipped);
- dK/dV: `lax.map` over key blocks, and a `fori_loop` over the query blocks that
  `masking.q_block_range` allows, all query heads of a GQA group at once.

Every tile is shaped [B, K, G, rows, cols] (K key/value heads, G = N // K query heads per K/V head),
so grouped-query attention never repeats K or V.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from jaxflash import _core
from jaxflash import dropout
from jaxflash import masking
from jaxflash._core import Inputs, Params


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Query and key block sizes (clipped to the sequence lengths). Larger blocks mean fewer,
  bigger XLA ops (faster on CPU) and a larger temporary tile."""

  block_q: int = 256
  block_k: int = 256


def default_block_sizes() -> BlockSizes:
  return BlockSizes()


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Padded, blocked views of one call's arrays (pads are never visible: see `_blocks`)."""

  b: int
  t: int
  s: int
  kh: int
  g: int
  h: int
  block_q: int
  block_k: int

  @property
  def t_pad(self):
    return -(-self.t // self.block_q) * self.block_q

  @property
  def s_pad(self):
    return -(-self.s // self.block_k) * self.block_k


def _layout(inputs: Inputs) -> _Layout:
  b, t, n, h = inputs.query.shape
  s, kh = inputs.key.shape[1:3]
  bs = default_block_sizes()
  return _Layout(b, t, s, kh, n // kh, h, min(bs.block_q, t), min(bs.block_k, s))


def _pad_axis(x, axis: int, size: int):
  if x is None or x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


class _Blocks:
  """Inputs padded to whole blocks and grouped [B, len, K, G, H]; tile readers for the loops.

  Padding is never seen: padded keys lie past every ``kv_len`` (<= S) and are masked; padded
  query rows are sliced off the outputs, and their LSE pads to +inf so their P is 0.
  """

  def __init__(self, inputs: Inputs, lay: _Layout, params: Params):
    self.lay = lay
    q = inputs.query.reshape(lay.b, lay.t, lay.kh, lay.g, lay.h)
    self.q = _pad_axis(q, 1, lay.t_pad)
    self.k = _pad_axis(inputs.key, 1, lay.s_pad)
    self.v = _pad_axis(inputs.value, 1, lay.s_pad)
    self.q_len = inputs.lengths[:, 0]
    self.kv_len = inputs.lengths[:, 1]
    self.q_seg = _pad_axis(inputs.q_segment_ids, 1, lay.t_pad)
    self.kv_seg = _pad_axis(inputs.kv_segment_ids, 1, lay.s_pad)
    self.mask = self._dense(inputs.mask)
    self.bias = self._dense(inputs.bias)
    self.stream = None
    if inputs.dropout_seed is not None:  # per-(batch, head) dropout keys, [B, K, G, 1, 1]
      heads = jnp.arange(lay.kh * lay.g).reshape(1, lay.kh, lay.g, 1, 1)
      batch = jnp.arange(lay.b).reshape(lay.b, 1, 1, 1, 1)
      self.stream = _core.dropout_stream(params, inputs.dropout_seed, batch, heads)

  def _dense(self, x):
    """[B|1, N|1, T, S] -> padded [B|1, K|1, G|1, T_pad, S_pad]."""
    if x is None:
      return None
    lay = self.lay
    groups = (1, 1) if x.shape[1] == 1 else (lay.kh, lay.g)
    x = x.reshape(x.shape[:1] + groups + x.shape[2:])
    return _pad_axis(_pad_axis(x, 3, lay.t_pad), 4, lay.s_pad)

  def rows(self, x, start, size, axis=1):
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)

  def logits(self, q_blk, k_blk, q_start, k_start, params: Params):
    """Base-2 logits [B, K, G, bq, bk] of one tile, masked to -inf; also the soft-cap tanh."""
    bq, bk = q_blk.shape[1], k_blk.shape[1]
    qk = jnp.einsum("bqkgh,bskh->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32)
    bias = None
    if self.bias is not None:
      bias = lax.dynamic_slice(self.bias, (0, 0, 0, q_start, k_start),
                               self.bias.shape[:3] + (bq, bk))
    s2, cap_t = _core.logits_base2(qk, params, bias)
    rows = (q_start + jnp.arange(bq))[:, None]
    cols = (k_start + jnp.arange(bk))[None, :]
    q_seg = kv_seg = dense = None
    if self.q_seg is not None:
      q_seg = self.rows(self.q_seg, q_start, bq)[:, None, None, :, None]
      kv_seg = self.rows(self.kv_seg, k_start, bk)[:, None, None, None, :]
    if self.mask is not None:
      dense = lax.dynamic_slice(self.mask, (0, 0, 0, q_start, k_start),
                                self.mask.shape[:3] + (bq, bk))
    vis = masking.visible(rows, cols, params.window,
                          kv_len=self.kv_len[:, None, None, None, None],
                          q_segment=q_seg, kv_segment=kv_seg, dense_mask=dense)
    return jnp.where(vis, s2, -jnp.inf), cap_t

  def keep(self, q_start, k_start, bq: int, bk: int, params: Params):
    """Dropout keep mask [B, K, G, bq, bk] of one tile, or None without dropout."""
    if self.stream is None:
      return None
    return dropout.keep(self.stream, (q_start + jnp.arange(bq))[:, None], k_start, bk,
                        params.dropout_rate)

  def kv_range(self, q_start, params: Params):
    """Key blocks to visit for the query block at ``q_start`` (union over the batch)."""
    max_q_len, max_kv_len = jnp.max(self.q_len), jnp.max(self.kv_len)
    q_stop = jnp.minimum(q_start + self.lay.block_q, max_q_len)
    lo, hi = masking.kv_block_range(q_start, q_stop, max_kv_len, params.window,
                                    self.lay.block_k)
    return lo, jnp.where(q_start < max_q_len, hi, lo)

  def q_range(self, k_start, params: Params):
    """Query blocks to visit for the key block at ``k_start`` (union over the batch)."""
    max_q_len, max_kv_len = jnp.max(self.q_len), jnp.max(self.kv_len)
    k_stop = jnp.minimum(k_start + self.lay.block_k, max_kv_len)
    lo, hi = masking.q_block_range(k_start, k_stop, max_q_len, params.window, self.lay.block_q)
    return lo, jnp.where(k_start < max_kv_len, hi, lo)


def _ungroup_rows(x, lay: _Layout):
  """lax.map output [num_blocks, B, block, K, G, H] -> [B, T, N, H]."""
  x = jnp.moveaxis(x, 0, 1).reshape(lay.b, lay.t_pad, lay.kh * lay.g, lay.h)
  return x[:, :lay.t]


def _forward(inputs: Inputs, params: Params):
  lay = _layout(inputs)
  blk = _Blocks(inputs, lay, params)
  bq, bk = lay.block_q, lay.block_k

  def one_q_block(i):
    q_start = i * bq
    q_blk = blk.rows(blk.q, q_start, bq)

    def body(j, carry):
      acc, m, l = carry
      k_start = j * bk
      s2, _ = blk.logits(q_blk, blk.rows(blk.k, k_start, bk), q_start, k_start, params)
      # Online softmax; rows with nothing visible yet shift by 0 so exp2 stays NaN-free.
      m_new = jnp.maximum(m, jnp.max(s2, axis=-1))
      m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      p = jnp.exp2(s2 - m_shift[..., None])
      alpha = jnp.exp2(m - m_shift)
      v_blk = blk.rows(blk.v, k_start, bk)
      # Dropout zeroes entries of P for the product with V only: the normaliser l is the sum
      # of the undropped P. The 1 / P(keep) factor is applied once, to the output.
      keep = blk.keep(q_start, k_start, bq, bk, params)
      p_v = p if keep is None else jnp.where(keep, p, 0.0)
      pv = jnp.einsum("bkgqs,bskh->bkgqh", p_v.astype(v_blk.dtype), v_blk,
                      preferred_element_type=jnp.float32)
      return acc * alpha[..., None] + pv, m_new, l * alpha + jnp.sum(p, axis=-1)

    stats = (lay.b, lay.kh, lay.g, bq)
    init = (jnp.zeros(stats + (lay.h,), jnp.float32), jnp.full(stats, -jnp.inf, jnp.float32),
            jnp.zeros(stats, jnp.float32))
    lo, hi = blk.kv_range(q_start, params)
    acc, m, l = lax.fori_loop(lo, hi, body, init)
    rows = q_start + jnp.arange(bq)
    seen = jnp.logical_and(rows < blk.q_len[:, None, None, None], l > 0.0)
    inv_l = (params.keep_scale if blk.stream is not None else 1.0) / jnp.where(seen, l, 1.0)
    out = jnp.where(seen[..., None], acc * inv_l[..., None], 0.0)
    lse2 = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), jnp.inf)
    return jnp.moveaxis(out, 3, 1).astype(inputs.query.dtype), lse2

  out, lse2 = lax.map(one_q_block, jnp.arange(lay.t_pad // bq))
  # lse2: [nq, B, K, G, bq] -> [B, N, T]
  lse2 = jnp.moveaxis(lse2, 0, 3).reshape(lay.b, lay.kh * lay.g, lay.t_pad)[..., :lay.t]
  return _ungroup_rows(out, lay), lse2


def _backward(inputs: Inputs, params: Params, out, lse2, d_out, delta, want_dbias: bool):
  del out
  lay = _layout(inputs)
  blk = _Blocks(inputs, lay, params)
  bq, bk = lay.block_q, lay.block_k
  do = _pad_axis(d_out.astype(inputs.query.dtype).reshape(lay.b, lay.t, lay.kh, lay.g, lay.h),
                 1, lay.t_pad)
  # Per-row statistics grouped [B, K, G, T_pad]; padded rows get lse2 = +inf, hence P = 0.
  lse2 = jnp.pad(lse2.reshape(lay.b, lay.kh, lay.g, lay.t),
                 ((0, 0),) * 3 + ((0, lay.t_pad - lay.t),), constant_values=jnp.inf)
  delta = _pad_axis(delta.reshape(lay.b, lay.kh, lay.g, lay.t), 3, lay.t_pad)

  def tile_grads(q_start, k_start, q_blk, k_blk, v_blk, do_blk):
    """One tile's dropped P (for dV), dZ (w.r.t. the natural logits, i.e. dbias) and dS (w.r.t.
    q @ k.T before the final `scale`)."""
    s2, cap_t = blk.logits(q_blk, k_blk, q_start, k_start, params)
    p = jnp.exp2(s2 - blk.rows(lse2, q_start, bq, axis=3)[..., None])
    dp = jnp.einsum("bqkgh,bskh->bkgqs", do_blk, v_blk, preferred_element_type=jnp.float32)
    keep = blk.keep(q_start, k_start, bq, bk, params)
    dz = p * (_core.dropped(dp, keep, params) - blk.rows(delta, q_start, bq, axis=3)[..., None])
    return _core.dropped(p, keep, params), dz, _core.dlogits_to_dqk(dz, cap_t)

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
    q_blk, do_blk = blk.rows(blk.q, q_start, bq), blk.rows(do, q_start, bq)

    def body(j, carry):
      dq, dbias = carry
      k_start = j * bk
      k_blk = blk.rows(blk.k, k_start, bk)
      _, dz, ds = tile_grads(q_start, k_start, q_blk, k_blk, blk.rows(blk.v, k_start, bk),
                             do_blk)
      dq = dq + jnp.einsum("bkgqs,bskh->bqkgh", ds.astype(k_blk.dtype), k_blk,
                           preferred_element_type=jnp.float32)
      if want_dbias:
        dbias = lax.dynamic_update_slice_in_dim(dbias, bias_tile(dz), k_start, axis=3)
      return dq, dbias

    lo, hi = blk.kv_range(q_start, params)
    # Key blocks outside [lo, hi) see nothing: their bias gradient stays 0.
    dbias = (jnp.zeros(inputs.bias.shape[:2] + (bq, lay.s_pad), jnp.float32) if want_dbias
             else None)
    dq, dbias = lax.fori_loop(lo, hi, body, (jnp.zeros(q_blk.shape, jnp.float32), dbias))
    return (dq * params.scale).astype(inputs.query.dtype), dbias

  def dkv_block(j):
    k_start = j * bk
    k_blk, v_blk = blk.rows(blk.k, k_start, bk), blk.rows(blk.v, k_start, bk)

    def body(i, carry):
      dk, dv = carry
      q_start = i * bq
      q_blk, do_blk = blk.rows(blk.q, q_start, bq), blk.rows(do, q_start, bq)
      p_dropped, _, ds = tile_grads(q_start, k_start, q_blk, k_blk, v_blk, do_blk)
      dv = dv + jnp.einsum("bkgqs,bqkgh->bskh", p_dropped.astype(do_blk.dtype), do_blk,
                           preferred_element_type=jnp.float32)
      dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", ds.astype(q_blk.dtype), q_blk,
                           preferred_element_type=jnp.float32)
      return dk, dv

    lo, hi = blk.q_range(k_start, params)
    zeros = jnp.zeros(k_blk.shape, jnp.float32)
    dk, dv = lax.fori_loop(lo, hi, body, (zeros, zeros))
    return (dk * params.scale).astype(k_blk.dtype), dv.astype(v_blk.dtype)

  dq, dbias = lax.map(dq_block, jnp.arange(lay.t_pad // bq))
  dq = _ungroup_rows(dq, lay)
  if want_dbias:  # [nq, B|1, N|1, bq, S_pad] -> [B|1, N|1, T, S]
    dbias = jnp.moveaxis(dbias, 0, 2).reshape(inputs.bias.shape[:2] + (lay.t_pad, lay.s_pad))
    dbias = dbias[:, :, :lay.t, :lay.s].astype(inputs.bias.dtype)
  dk, dv = lax.map(dkv_block, jnp.arange(lay.s_pad // bk))

  def ungroup_keys(x):  # [nk, B, bk, K, H] -> [B, S, K, H]
    return jnp.moveaxis(x, 0, 1).reshape(lay.b, lay.s_pad, lay.kh, lay.h)[:, :lay.s]

  return dq, ungroup_keys(dk), ungroup_keys(dv), dbias


_attention = _core.build(_forward, _backward)


def attention(inputs: Inputs, params: Params):
  """Runs the blockwise pure-JAX implementation; returns ``(out [B,T,N,H], lse [B,N,T])``."""
  return _attention(inputs, params)
