"""Absorbed MLA's split-KV decoding with the keys as the wgmma's M (few query rows: 16 heads).

`jaxflash.backends.mosaic.decode` gives a group's G·T query rows 64-row wgmma tiles, the M of
every Hopper wgmma. At 16 heads (T = 1 or 2) that is 16 or 32 rows of 64: three quarters or
half of its tensor work multiplies padding, and a CTA's products then take about as long as
its key block takes to arrive (H200, 2026-12-03: the kernel without any product ran 5-7%
faster, `benchmarks/dev/decode_parts.py --variants no_products`). This kernel turns both
products round, with the R = G·T query rows as the wgmma's N:

  Sᵀ = K Qᵀ      ([64 keys, R], M = the block's 64 keys, K = the head's H features)
  Oᵀ += Vᵀ Pᵀ    ([Dv, R], M = Dv, K = the block's 64 keys)

so the products do R columns of work instead of 64 rows, and Oᵀ ([Dv, R] float32, 4R
registers a thread) fits one warpgroup. The softmax runs down each column of Sᵀ: a column's
max is a reduction across the warpgroup's four warps (Mosaic GPU's cross-warp reduction,
through shared memory), and its sum stays a [64, R] tile of per-thread partial sums until the
end. Pᵀ goes to shared memory as P ([R, 64], 16-bit), the second product's B.

A CTA is two warpgroups (the producer streaming [64, H] key blocks, one TMA copy each, through
a ring of ``num_stages`` slots; one consumer), one per (batch row, K/V head, split). O leaves
as partial results [B, K, splits, R, Dv] in `PARTIAL_DTYPE` through the free key ring
(transposed back on its way into shared memory): float16 (half the bytes of float32 that the
kernel writes and the merge reads), each row scaled to a common peak, with the rows' factors
and the LSEs [B, K, splits, R] beside them. XLA merges the splits after the kernel
(`decode.forward`), as it merges `decode`'s.

Rows, positions and masking are `decode`'s: query row ``r`` is (token ``r // G``, head ``r %
G``), token t sits at ``t + kv_len - T`` and sees keys below ``kv_len`` and (with a causal band)
up to its position plus the band's right side.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu

from jaxflash import _core
from jaxflash._core import Inputs, Params
from jaxflash.backends.mosaic import backward as bwd
from jaxflash.backends.mosaic import decode
from jaxflash.backends.mosaic import forward as fwd
from jaxflash.schedule import Span, split_range, used_splits, walk

BLOCK_K = 64  # keys a block: the M of the products
# Mosaic GPU's cross-warp reductions (a column's max) go through this much shared memory.
REDUCTION_SCRATCH = 1024
# The partial results' dtype in global memory. In float32 they were 8.4 MB written and read
# again at issue 34's cell (B = 8, 32k, T = 2) against a 302 MB cache. In float16 each row of a
# split's O goes out scaled so that its largest magnitude is `PARTIAL_PEAK`, with the inverse
# factor beside its LSE: float16's 11 bits for every value down to 2^-24 of the row's largest
# (then subnormal), and no overflow whatever the cache holds. H100,
# 2026-12-06 (`decode_parts.py --variants partials_f32 partials_bf16`, one process): a call at
# 256k tokens 1.1-2.1% faster than float32 at T = 2 and level at T = 1, its error against a
# float32 reference within 0.3% of float32's (1.694-1.769e-3); bf16, unscaled, was 0.3-0.6%
# faster still and 5-15% less accurate (docs/decoding.md). (Other dtypes, probes only, are
# scaled the same way: harmless, as float32 and bf16 have float32's exponent range.)
PARTIAL_DTYPE = jnp.float16
PARTIAL_PEAK = 2.0**15  # (float16's largest finite value is 65504)


def _column_stops(bounds, group: int, rows: int, window):
  """Per query row (a column of Sᵀ, in the wgmma layout's columns): the key it sees up to
  (exclusive)."""
  cols = plgpu.broadcasted_iota(jnp.int32, (rows,), 0, layout=fwd._COLS)
  return decode._key_stop(lax.div(cols, jnp.int32(group)), bounds, window)


def _cols(x, shape):
  """A per-column vector broadcast down the rows of a [rows, columns] tile."""
  return lax.broadcast_in_dim(x, shape, [1])


def _kernel(q_ref, k_ref, kv_lengths_ref, table_ref, out_ref, factor_ref, lse_ref, q_tiles,
            k_union, p_smem, lse_smem, factor_smem, zero_smem, q_ready, k_ready, k_free, *,
            params: Params, t: int, group: int, kv_heads: int, splits: int,
            page_size: int | None, value_dim: int, stages: int, kv_rows: int):
  """One CTA (batch row x K/V head ``bk``, ``split``): the consumer (``wg`` 0) and the
  producer (``wg`` 1)."""
  k_smem, o_stage = k_union
  rows = group * t
  wg = lax.axis_index("wg")
  bk, split = lax.axis_index("bk"), lax.axis_index("split")
  batch, kv_head = lax.div(bk, jnp.int32(kv_heads)), lax.rem(bk, jnp.int32(kv_heads))
  kv_len = jnp.clip(kv_lengths_ref[batch], 0, kv_rows)
  bounds = (jnp.int32(t), kv_len, kv_len - t)
  full_key, end_key = decode._key_range(bounds, t, params.window)
  block_k = jnp.int32(BLOCK_K)  # (int32 under jax_enable_x64 too)
  blocks, full_blocks = pl.cdiv(end_key, block_k), lax.div(full_key, block_k)
  lo, hi = split_range(split, splits, jnp.int32(0), blocks)
  count = hi - lo
  mid = jnp.clip(full_blocks, lo, hi)  # blocks [lo, mid) every row sees in full

  def slot_of(n):
    return lax.rem(n, jnp.int32(stages))

  @pl.when(wg == 0)
  def _consumer():
    for token in range(t):  # every token's heads, a copy each, all on the one barrier
      plgpu.copy_gmem_to_smem(q_ref.at[batch, token, pl.ds(kv_head * group, group)],
                              q_tiles.at[0].at[pl.ds(token * group, group)], q_ready)
    zero_smem[0] = jnp.int32(0)
    stop = _column_stops(bounds, group, rows, params.window)
    soft_cap = params.logits_soft_cap
    # The column max is taken of unscaled values and scaled once: x c - m is one multiply-add.
    c = _core.LOG2_E if soft_cap is not None else params.scale * _core.LOG2_E
    shape = (BLOCK_K, rows)
    with jax.named_scope("decode_q_wait"):
      plgpu.barrier_wait(q_ready)

    def scores(slot):
      """Sᵀ = K_slot Qᵀ, waited for. (Q's resident tile is indexed through a zero read at each
      step, which keeps its wgmma descriptors in the loop: `backward._opaque_zero`.)"""
      q_smem = q_tiles.at[bwd._opaque_zero(zero_smem, 0)]

      def kq(s_ref):
        plgpu.wgmma(s_ref, k_smem.at[slot], q_smem.T)
        return plgpu.wgmma_accumulator_load(s_ref)

      return pl.run_scoped(kq, plgpu.ACC(shape, jnp.float32))

    def softmax(j, x, m, l, masked: bool):
      """Block j's online softmax step down the columns: ``(p, m_new, l_new, alpha)``, with
      ``l`` the [64, R] tile of partial sums."""
      if soft_cap is not None:
        x = soft_cap * jnp.tanh(x * (params.scale / soft_cap))
      if masked:  # keys at or past a row's stop are hidden
        x = jnp.where(fwd._iota(shape, 0) < _cols(stop - j * BLOCK_K, shape), x, -jnp.inf)
      m_new = jnp.maximum(m, x.max(axis=0) * c)
      # A row that has seen no visible key keeps m = -inf and is shifted by 0, so that it stays
      # at l = 0 and acc = 0; NaN logits make the row NaN, as in jax.nn.
      m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
      alpha = jnp.exp2(m - m_shift)
      p = jnp.exp2(x * c - _cols(m_shift, shape))
      return p, m_new, l * _cols(alpha, shape) + p, alpha

    def values(slot):
      """Vᵀ of ``slot``: the key tile's first Dv columns, transposed ([Dv, 64])."""
      return k_smem.at[slot].at[:, pl.ds(0, value_dim)].T

    def step(n, j, carry, masked: bool):
      """Visit n (block j): Sᵀ, the softmax, Pᵀ to shared memory, Oᵀ += Vᵀ Pᵀ."""
      acc, m, l = carry
      slot = slot_of(n)
      # (The named scopes are regions of Mosaic GPU's in-kernel profiler, which
      # benchmarks/dev/decode_trace.py turns on; without it they emit nothing.)
      with jax.named_scope("decode_k_wait"):
        plgpu.barrier_wait(k_ready.at[slot])
      with jax.named_scope("decode_scores"):
        s = scores(slot)
      with jax.named_scope("decode_softmax"):
        p, m, l, alpha = softmax(j, s, m, l, masked)
        # P ([R, 64]) as the second product's B: the last product that read it has been
        # waited for (below), and every thread's part is written before the product is issued.
        p_smem.T[...] = plgpu.layout_cast(p.astype(q_tiles.dtype),
                                          plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.commit_smem()
        if not params.interpret:
          fwd._emit(mgpu.utils.warpgroup_barrier)
      with jax.named_scope("decode_pv"):
        acc = acc * _cols(alpha, acc.shape)
        if params.interpret:  # (no run_state there)
          acc = acc + jnp.dot(values(slot)[...], p_smem[...].T,
                              preferred_element_type=jnp.float32)
        else:
          def pv(acc_ref):
            plgpu.wgmma(acc_ref, values(slot), p_smem.T)

          acc = pl.run_state(pv)(plgpu.ACC.init(acc))  # (waits for the product at its end)
      plgpu.barrier_arrive(k_free.at[slot])
      return acc, m, l

    spans = (Span(False, mid - lo, lambda i: lo + i), Span(True, hi - mid, lambda i: mid + i))
    init = (plgpu.layout_cast(jnp.zeros((value_dim, rows), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), fwd._COLS),
            plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA))
    with jax.named_scope("decode_loop"):
      acc, m, l = walk(spans, step, init)

    with jax.named_scope("decode_epilogue"):
      l = l.sum(axis=0)
      seen = l != 0.0
      safe_l = jnp.where(seen, l, 1.0)
      lse_smem[...] = jnp.where(seen, m + jnp.log2(safe_l), -jnp.inf)
      # The ring is free (every product that read it has been waited for, and the producer
      # loads no more): O leaves through it, transposed back on its way into shared memory, so
      # that the partial results lie as the merge reads them (XLA's transpose of Oᵀ in the
      # merge's fusion took 2.4-4.6 µs against 2.6-2.8 for the merge alone; H200, 2026-12-03).
      out = jnp.where(_cols(seen, acc.shape),
                      acc * _cols(jnp.where(seen, 1.0 / safe_l, 0.0), acc.shape), 0.0)
      # Each row's largest magnitude to PARTIAL_PEAK (a column of Oᵀ: across warps). Empty
      # rows (0) and NaN rows keep a factor of 1; the cap keeps a row of tiny values from an
      # infinite factor.
      top = jnp.abs(out).max(axis=0)
      grow = jnp.where(top > 0.0, jnp.minimum(PARTIAL_PEAK / top, 2.0**100), 1.0)
      out = out * _cols(grow, out.shape)
      factor_smem[...] = 1.0 / grow
      o_stage.T[...] = plgpu.layout_cast(out.astype(o_stage.dtype),
                                         plgpu.Layout.WGMMA_TRANSPOSED)
      plgpu.commit_smem()
      if not params.interpret:
        fwd._emit(mgpu.utils.warpgroup_barrier)
      plgpu.copy_smem_to_gmem(o_stage, out_ref.at[batch, kv_head, split])
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, kv_head, split])
      plgpu.copy_smem_to_gmem(factor_smem, factor_ref.at[batch, kv_head, split])
      plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 1)
  def _producer():
    # (The last loads' slots are released before the CTA ends: the epilogue reuses the ring.)
    decode.load_key_blocks(k_ref, table_ref, page_size, batch, kv_head, lo, count,
                           (k_smem, k_ready, k_free), BLOCK_K)


def partial_results(inputs: Inputs, params: Params, splits: int, stages: int, pages=None):
  """The kernel's results before the merge, as `decode.partial_results` gives them: ``(out [B,
  K, splits, G·T, Dv] float32, lse2 [B, K, splits, G·T])``, query rows token-major. (The rows'
  factors are multiplied back here: XLA fuses that into the merge, which then reads the 16-bit
  values.)"""
  out, factors, lse2 = kernel_results(inputs, params, splits, stages, pages)
  return out.astype(jnp.float32) * factors[..., None], lse2


def kernel_results(inputs: Inputs, params: Params, splits: int, stages: int, pages=None):
  """The kernel's own outputs ``(out [B, K, splits, G·T, Dv] in `PARTIAL_DTYPE`, factors [B,
  K, splits, G·T], lse2)``, a row's values being ``out * factors[..., None]``."""
  q = inputs.query
  b, t, n, h = q.shape
  kv_heads, hv = inputs.key.shape[2], inputs.value.shape[-1]
  g = n // kv_heads
  rows = g * t
  if pages is None:
    cache, table, page_size = inputs.key, None, None
  else:
    cache, _, table = pages
    page_size = cache.shape[1]
  splits = used_splits(pl.cdiv(inputs.key.shape[1], BLOCK_K), splits)
  row_struct = _core.out_struct((b, kv_heads, splits, rows), jnp.float32, q)
  scratch = (
      fwd._smem_tile((1, rows, h), q.dtype),  # Q
      plgpu.RefUnion(fwd._smem_tile((stages, BLOCK_K, h), cache.dtype),  # the key ring, then
                     fwd._smem_tile((rows, hv), PARTIAL_DTYPE)),  # then O's way out
      fwd._smem_tile((rows, BLOCK_K), q.dtype),  # P
      plgpu.SMEM((rows,), jnp.float32),  # the LSEs
      plgpu.SMEM((rows,), jnp.float32),  # the rows' factors
      plgpu.SMEM((1,), jnp.int32),  # 0 (`backward._opaque_zero`)
      plgpu.Barrier(num_arrivals=t, num_barriers=1),  # q_ready: one copy per token
      plgpu.Barrier(num_barriers=stages),  # k_ready
      plgpu.Barrier(num_barriers=stages),  # k_free
  )
  kernel = functools.partial(_kernel, params=params, t=t, group=g, kv_heads=kv_heads,
                             splits=splits, page_size=page_size, value_dim=hv, stages=stages,
                             kv_rows=inputs.key.shape[1])
  return plgpu.kernel(
      kernel,
      out_type=(_core.out_struct((b, kv_heads, splits, rows, hv), PARTIAL_DTYPE, q),
                row_struct, row_struct),
      scratch_types=scratch,
      grid=(b * kv_heads, splits),  # splits fastest: the CTAs running together share a row
      grid_names=("bk", "split"),
      num_threads=2,
      thread_name="wg",
      kernel_name="jaxflash_mosaic_decode_mla_transposed",
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True,
                                           reduction_scratch_bytes=REDUCTION_SCRATCH),
      interpret=plgpu.InterpretGPUParams() if params.interpret else None,
  )(q, cache, inputs.kv_lengths, table)
