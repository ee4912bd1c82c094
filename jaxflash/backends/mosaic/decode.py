"""The Mosaic GPU split-KV decoding forward for absorbed MLA (FlashMLA's design, on sm90).

DeepSeek's MLA decodes as MQA over one latent cache of 576 features a token (512 latent + 64
RoPE), whose first 512 are the values: ``decode_attention(q, latent, None, lengths,
value_head_dim=512)``. A group's G·T query rows (16 or 128 heads, T = 1 or 2) are few for the
width of its heads, so Triton's split-KV kernel (`jaxflash.backends.triton.decode`) runs them
on 16- or 32-row ``mma.sync`` tiles, which leaves it bound by its products: 0.75-0.81 of a
device copy at 16 heads and 235 TFLOP/s at 128 (H200, 2026-11-25). This kernel gives them
64-row wgmma tiles.

Grid (batch row x K/V head, split of the keys, block of 64 query rows), one CTA each, the row
blocks fastest (those reading the same keys run together). A CTA is three warpgroups:

- ``wg`` 2, the producer, streams the CTA's key blocks ([64 keys, H], one TMA copy each from
  the cache or its page) into a ring of ``num_stages`` slots.
- ``wg`` 0 holds Q ([64, H] in shared memory) and, per key block, computes S = Q Kᵀ, runs the
  online softmax (base 2, the scale folded into one multiply-add), hands P (16-bit) and the
  rows' rescale factor to ``wg`` 1 through shared memory, and accumulates the first half of
  O's columns, O[:, :Dv/2] += P V[:, :Dv/2], with P from registers.
- ``wg`` 1 accumulates the other half, O[:, Dv/2:] += P V[:, Dv/2:], with P from shared
  memory. Its product of block j runs while ``wg`` 0 computes block j + 1's scores.

The values are the first Dv columns of the key tile already in shared memory: each token's
bytes are read once for both products. No consumer holds more than a [64, Dv/2] float32
accumulator (128 registers a thread at Dv = 512). O leaves as float32 partial results (and
base-2 LSEs, -inf where a split sees no key) through the Q tile's memory, and the splits are
merged through the LSE (`jaxflash.merge.merge_splits`), as Triton's kernel's are; or, opt-in
(`MlaDecodeConfig.merge_in_kernel`, slower today: `forward`), by the last split of each group.

Query row ``r`` of a group is (token ``r // G``, head ``r % G``), as the query lies in memory:
Q's tile is loaded from the caller's [B, T, N, H] (a copy per token, at 16 heads) and the
result is [B, T, N, Dv] with no transpose on either side at MQA. Token t sits at position ``t
+ diagonal`` and sees keys below ``kv_len`` and (with a causal band, ``right`` its offset) up
to ``t + diagonal + right``. Blocks every row sees in full skip the element mask.

Groups of up to `TRANSPOSED_ROWS` query rows (16 heads at T = 1 or 2) run another kernel by
default, `decode_transposed`, whose products take the keys as M and the rows as N instead of
padding them to 64 rows; it shares this module's launch rules, masking and merge.

With ``params.interpret`` the kernel runs in Mosaic GPU's interpreter (tests on a CPU), which
has no wgmma operand in registers and no ``run_state``: there the P V products are plain dots
of the same tiles.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu

from jaxflash import _core
from jaxflash import masking
from jaxflash import merge
from jaxflash._core import Inputs, Params
from jaxflash.backends.mosaic import backward as bwd
from jaxflash.backends.mosaic import forward as fwd
from jaxflash.backends.mosaic.config import producer_registers
from jaxflash.devices import Device
from jaxflash.schedule import Span, split_range, used_splits, walk

ROWS = 64  # query rows of a CTA: the M of a wgmma tile (a group's G·T rows, padded)
BLOCK_K = 64  # keys a block: P is [64, 64], one 128-byte swizzled row of 16-bit keys each
MIN_HEAD_DIM = 257  # narrower heads run Triton's split-KV kernel, tuned for them
MAX_HEAD_DIM = 576  # Q and two stages of [64, H] key tiles fill the 227 KiB of shared memory
REGISTERS = 240  # each consumer's; the producer keeps what is left (`producer_registers`)
MERGE_PIECE = 64  # O's columns a consumer merges at a time (a [64, 64] float32 tile)
MERGE_BUFFERS = 4  # a consumer's split-and-piece tiles in flight in the merge (16 KiB each)
# Groups of up to this many query rows run with the keys as the wgmma's M (`decode_transposed`):
# its Oᵀ takes 4 registers a thread per row.
TRANSPOSED_ROWS = 32
INTERPRETER_PARTITIONS = False  # (as the Mosaic backend's: `jaxflash.backends.base.Backend`)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlaDecodeConfig:
  """The launch: ``splits`` CTAs per (batch row, K/V head, row block), ``num_stages`` key
  blocks in flight, whether the last split of each group merges the splits' results in the
  kernel (``merge_in_kernel``, opt-in: one kernel a call, but slower today, see `forward`;
  else XLA merges them after it), whether a group of few query rows runs the kernel with the
  keys as the wgmma's M (``transposed``: `decode_transposed`, for the groups
  `transposed_serves`), and the config of the training backend that runs the backward
  (``training``)."""

  splits: int
  num_stages: int = 2
  merge_in_kernel: bool = False
  transposed: bool = False
  training: Any = None

  def __post_init__(self):
    if self.splits < 1:
      raise ValueError(f"splits must be at least 1, got {self.splits}")
    if self.num_stages < 2:
      raise ValueError(f"num_stages must be at least 2, got {self.num_stages}")


def unsupported(inputs: Inputs, params: Params) -> str | None:
  """Why this kernel cannot serve a decoding call (None if it can): it takes absorbed MLA's
  latent cache (the values in the keys) at heads from `MIN_HEAD_DIM` to `MAX_HEAD_DIM`, a
  plain or causal band, an optional soft cap and sinks."""
  q = inputs.query
  h, hv = q.shape[-1], inputs.value.shape[-1]
  if not params.values_in_keys:
    return "a value cache of its own (it reads the values from a latent cache's key tiles)"
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    return f"bfloat16 and float16 only, got {q.dtype}"
  if not MIN_HEAD_DIM <= h <= MAX_HEAD_DIM or h % 64:
    return f"head dims {MIN_HEAD_DIM} to {MAX_HEAD_DIM} in multiples of 64, got {h}"
  if hv % 128 or hv > h:
    return f"value head dims in multiples of 128 up to the query's, got {hv}"
  group = q.shape[2] // inputs.key.shape[2]
  if group % 8 or (group * q.shape[1] > ROWS and group % ROWS):
    return (f"G = {group} query heads a K/V head (a multiple of 8, and of {ROWS} where G·T is "
            f"above {ROWS})")
  if inputs.key.shape[1] % 8:
    return f"a cache of {inputs.key.shape[1]} rows (TMA copies whole 8-row tiles)"
  if params.window.left is not None:
    return "a window's left side"
  if any(x is not None for x in (inputs.bias, inputs.mask, inputs.q_segment_ids,
                                 inputs.dropout_seed, inputs.block_table)):
    return "biases, masks, segments and dropout"
  if params.score_rule is not None or params.mask_rule is not None:
    return "score_mod and mask_mod"
  if params.partial:
    return "partial results (ring attention)"
  if inputs.kv_lengths is None:
    return "a call without the caller's key lengths (`Inputs.kv_lengths`: decode_attention's)"
  return None


def paged_block(page_size: int) -> bool:
  """Whether the kernel reads pages of ``page_size`` keys where they lie: each key block is
  one TMA copy from one page."""
  return page_size % BLOCK_K == 0


def default_config(inputs: Inputs, training, device: Device, page_size: int | None = None,
                   values_in_keys: bool = True) -> MlaDecodeConfig:
  """One wave of CTAs (one fits an SM: its tiles take 225 KiB of shared memory, the transposed
  kernel's 165 KiB): the splits that bring the (batch row, K/V head, row block) groups closest
  to the SM count. Groups of up to `TRANSPOSED_ROWS` query rows run transposed: 1-4% faster a
  call at 16 heads (H200, 2026-12-03, `decode_mla.json` run `mla_transposed_ab_2026-12-03`;
  docs/decoding.md)."""
  del page_size, values_in_keys
  b, s, kv_heads = inputs.key.shape[:3]
  t, n = inputs.query.shape[1:3]
  groups = b * kv_heads * pl.cdiv(t * n // kv_heads, ROWS)  # (row blocks of G·T rows each)
  blocks = pl.cdiv(s, BLOCK_K)
  splits = max(1, round(device.sm_count / groups))
  return MlaDecodeConfig(splits=used_splits(blocks, splits), training=training,
                         transposed=transposed_serves(_group_rows(inputs)))


def merge_packing(q_rows: int, half: int) -> tuple[int, int]:
  """The merge's ``(slot_rows, pack)``: a [64, 64] tile holds ``pack`` 64-column pieces of a
  consumer's ``half`` of O's columns, one in each slot of ``slot_rows`` rows (32 or 64, the
  first that holds the group's ``q_rows``; not 16: TMA writes shared memory at 128-byte
  boundaries, and the slots' LSE rows would start at 64 bytes)."""
  slot_rows = next(r for r in (32, ROWS) if q_rows <= r)
  pack = ROWS // slot_rows
  while (half // MERGE_PIECE) % pack:
    pack //= 2
  return slot_rows, pack


def _store_piece(value_dim: int) -> int:
  """O's columns per store through a consumer's staging tile: 128, or 64 where a consumer's
  half of Dv is not a multiple of 128 (Dv 128 and 384)."""
  return 128 if (value_dim // 2) % 128 == 0 else 64


def _key_stop(token, bounds, window):
  """The key past the last that query token ``token`` sees (the band's right side and the key
  length, `masking.key_range`; the left side is unbounded here), at least 0."""
  _, kv_len, diagonal = bounds
  _, last = masking.key_range(token, window, diagonal=diagonal, kv_len=kv_len)
  return jnp.maximum(last + 1, 0)


def _row_stops(rb, bounds, group: int, window):
  """Per query row of row block ``rb`` (in the wgmma layout's rows; ``group`` query heads a
  token): whether it is a row of the call (a row of the group, a token before the query
  length) and the key it sees up to (exclusive)."""
  rows = rb * ROWS + plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=fwd._ROWS)
  token = lax.div(rows, jnp.int32(group))
  return rows, token < bounds[0], jnp.broadcast_to(_key_stop(token, bounds, window), rows.shape)


def _key_range(bounds, t: int, window):
  """``(first key no row sees in full, key past the last any row sees)`` of a group: the
  stops of its first token and of its last (before the query length)."""
  last_token = jnp.minimum(bounds[0], t) - 1
  return _key_stop(jnp.int32(0), bounds, window), _key_stop(last_token, bounds, window)


def _proxy_fence():
  """Orders this thread's TMA (async proxy) writes, already complete, before its later
  generic-proxy accesses: here the release that tells another CTA they have landed."""
  mgpu.utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)


def _kernel(q_ref, k_ref, kv_lengths_ref, table_ref, out_ref, lse_ref, final_out_ref,
            final_lse_ref, q_union, k_union, p_smem, row_smem, zero_smem, q_ready, k_ready,
            k_free, p_ready, p_free, merge_go, merge_ready, *, params: Params, t: int,
            group: int, kv_heads: int, splits: int, page_size: int | None, value_dim: int,
            stages: int, merge: bool, row_blocks: int, batch_heads: int,
            packing: tuple[int, int], kv_rows: int):
  """One CTA: ``final_out_ref``, ``final_lse_ref``, ``merge_go`` and ``merge_ready`` are None
  unless ``merge`` (the group's last split merges the splits, `partial_results`).
  ``kv_lengths_ref`` holds the caller's key lengths as given (`Inputs.kv_lengths`), clipped
  here to the cache's ``kv_rows``."""
  q_tiles, o_stages, *final_stages = q_union  # (one Q tile: see `backward._opaque_zero`)
  # With the merge, the key ring's memory holds the splits' tiles and LSE rows once it is free.
  k_smem, *merge_buffers = k_union if merge else (k_union,)
  wg = lax.axis_index("wg")
  bk, split, rb = lax.axis_index("bk"), lax.axis_index("split"), lax.axis_index("rb")
  batch, kv_head = lax.div(bk, jnp.int32(kv_heads)), lax.rem(bk, jnp.int32(kv_heads))
  # (The positions `jaxflash.ops.decode.decode_inputs` gives: T query rows, the last at the
  # row's last key.)
  kv_len = jnp.clip(kv_lengths_ref[batch], 0, kv_rows)
  bounds = (jnp.int32(t), kv_len, kv_len - t)
  full_key, end_key = _key_range(bounds, t, params.window)
  block_k = jnp.int32(BLOCK_K)  # (int32 under jax_enable_x64 too)
  blocks, full_blocks = pl.cdiv(end_key, block_k), lax.div(full_key, block_k)
  lo, hi = split_range(split, splits, jnp.int32(0), blocks)
  count = hi - lo
  # Blocks [lo, mid) every row sees in full; [mid, hi) take the element mask.
  mid = jnp.clip(full_blocks, lo, hi)
  rows_used = group * t
  q_rows = min(ROWS, rows_used)  # (fewer than a tile: the rest of Q's tile is never read out)
  half = value_dim // 2
  piece = _store_piece(value_dim)

  def slot_of(n):
    return lax.rem(n, jnp.int32(stages))

  def values(slot, w):
    """Consumer ``w``'s half of the values: columns of the key tile."""
    return k_smem.at[slot].at[:, pl.ds(w * half, half)]

  if merge:
    # One counter a group (batch row, K/V head, row block): each consumer of each split adds 1
    # once its results have landed; the last split's consumer 0 waits for all 2·splits (and
    # takes them off again: the counters are back at 0 for the next call).
    counters = pl.get_global(plgpu.SemaphoreType.REGULAR((batch_heads * row_blocks,)))
    counter = counters.at[bk * row_blocks + rb]
    merging = split == splits - 1

  def landed():
    """This consumer's results (O's half and, for consumer 0, the LSE) are in global memory,
    their stores waited for: count them on the group's counter."""
    if merge:
      fwd._emit(_proxy_fence)
      plgpu.semaphore_signal(counter, 1, memory_scope="gpu")

  def merge_splits_here(w):
    """In the group's last CTA, once every split's results have landed: consumer ``w``'s half
    of O's columns merged over the splits through their LSEs, in the splits' order (the same
    bits whichever CTA ends last), stored in the query's dtype as the call's output. The
    splits' rows come in by TMA, an item a split's `merge_packing` pieces ([q_rows, 64] each)
    and their LSE rows, `MERGE_BUFFERS` items in flight. Both loops stay loops: unrolled, this
    code ran at a fraction of its speed (instruction fetch; docs/decoding.md). Returns the
    rows' ``(m, l)`` (in the first slot's rows): the largest base-2 LSE and the sum of the
    splits' weights."""
    tiles, lses = (x.at[w] for x in merge_buffers[0])
    ready = merge_ready.at[pl.ds(w * MERGE_BUFFERS, MERGE_BUFFERS)]
    rows_at = pl.ds(rb * ROWS, q_rows)
    shape = (ROWS, MERGE_PIECE)
    # A tile stacks `pack` pieces in its rows, each in a slot of `slot_rows` (the LSE rows
    # copied into each slot), so that few rows do not leave most of the warps merging padding.
    slot_rows, pack = packing
    copies = pack * (1 if group >= ROWS else t)  # the output's stores a tile
    items = half // MERGE_PIECE // pack * splits

    def fetch(n):
      """Item n's tiles and LSE rows (split n % splits, pieces (n // splits)·pack + k) into its
      buffer."""
      s, g = lax.rem(n, jnp.int32(splits)), lax.div(n, jnp.int32(splits))
      buf = lax.rem(n, jnp.int32(MERGE_BUFFERS))
      for k in range(pack):
        col = w * half + (g * pack + k) * MERGE_PIECE
        slot = pl.ds(k * slot_rows, q_rows)
        plgpu.copy_gmem_to_smem(
            out_ref.at[batch, kv_head, s, rows_at, pl.ds(col, MERGE_PIECE)],
            tiles.at[buf].at[slot], ready.at[buf])
        plgpu.copy_gmem_to_smem(lse_ref.at[batch, kv_head, s, rows_at], lses.at[buf].at[slot],
                                ready.at[buf])

    for n in range(min(MERGE_BUFFERS, items)):
      fetch(jnp.int32(n))

    def merge_piece(c, _):
      """Tile c (pieces c·pack to c·pack + pack - 1): its splits merged online, stored, and
      the rows' ``(m, l)``."""

      def add_split(s, carry):
        """The online merge's step: split s's rows, weighted by 2^(lse - m)."""
        acc, m, l = carry
        n = c * splits + s
        buf = lax.rem(n, jnp.int32(MERGE_BUFFERS))
        # (The named scopes are regions of Mosaic GPU's in-kernel profiler, which
        # benchmarks/dev/decode_trace.py turns on; without it they emit nothing.)
        with jax.named_scope("merge_wait"):
          plgpu.barrier_wait(ready.at[buf])
        with jax.named_scope("merge_read"):
          lse = plgpu.load(lses.at[buf], layout=fwd._ROWS, optimized=False)
          part = tiles.at[buf][...]
          # Every thread has read the buffer before it is filled again.
          fwd._emit(mgpu.utils.warpgroup_barrier)
        with jax.named_scope("merge_fetch"):
          pl.when(n + MERGE_BUFFERS < items)(lambda: fetch(n + MERGE_BUFFERS))
        with jax.named_scope("merge_math"):
          m_new = jnp.maximum(m, lse)  # (NaN stays NaN)
          m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows no split has seen yet
          alpha, weight = jnp.exp2(m - m_shift), jnp.exp2(lse - m_shift)
          acc = acc * fwd._rows(alpha, shape) + part * fwd._rows(weight, shape)
        return acc, m_new, l * alpha + weight

      acc, m, l = lax.fori_loop(
          jnp.int32(0), jnp.int32(splits), add_split,
          (plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA),
           plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), fwd._ROWS),
           plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), fwd._ROWS)))
      seen = l != 0.0  # (a NaN row stays NaN)
      out = acc * fwd._rows(jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0), shape)
      stage = final_stages[0].at[2 * w + lax.rem(c, jnp.int32(2))]
      with jax.named_scope("merge_stage"):
        # The stores of tile c - 2 have read this one (a no-op before tile 2).
        plgpu.wait_smem_to_gmem(copies, wait_read_only=True)
        fwd._emit(mgpu.utils.warpgroup_barrier)
        stage[...] = out.astype(stage.dtype)
        plgpu.commit_smem()
      for k in range(pack):
        col = w * half + (c * pack + k) * MERGE_PIECE
        if group >= ROWS:
          token, first_head = lax.div(rb * ROWS, jnp.int32(group)), lax.rem(
              rb * ROWS, jnp.int32(group))
          plgpu.copy_smem_to_gmem(stage, final_out_ref.at[
              batch, token, pl.ds(kv_head * group + first_head, ROWS), pl.ds(col, MERGE_PIECE)])
        else:
          for token in range(t):
            plgpu.copy_smem_to_gmem(
                stage.at[pl.ds(k * slot_rows + token * group, group)], final_out_ref.at[
                    batch, token, pl.ds(kv_head * group, group), pl.ds(col, MERGE_PIECE)])
      return m, l

    rows_init = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), fwd._ROWS)
    return lax.fori_loop(jnp.int32(0), jnp.int32(half // MERGE_PIECE // pack), merge_piece,
                         (rows_init, rows_init))

  def store_out(out, w):
    """This consumer's float32 half of O, through its staging tile over Q's memory."""
    stage = o_stages.at[w]
    target = out_ref.at[batch, kv_head, split, pl.ds(rb * ROWS, q_rows)]
    for c in range(half // piece):
      if c:  # the last piece has left the tile; the warpgroup meets before it is overwritten
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if not params.interpret:
          fwd._emit(mgpu.utils.warpgroup_barrier)
      stage[...] = out[:, c * piece:(c + 1) * piece]
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(stage.at[pl.ds(0, q_rows)],
                              target.at[:, pl.ds(w * half + c * piece, piece)])

  @pl.when(wg == 0)
  def _scores():
    plgpu.set_max_registers(REGISTERS, action="increase")
    if group >= ROWS:  # one token's heads: a run of them
      token, first_head = lax.div(rb * ROWS, jnp.int32(group)), lax.rem(rb * ROWS,
                                                                         jnp.int32(group))
      plgpu.copy_gmem_to_smem(
          q_ref.at[batch, token, pl.ds(kv_head * group + first_head, ROWS)], q_tiles.at[0],
          q_ready)
    else:  # every token's heads, a copy each, all on the one barrier
      for token in range(t):
        plgpu.copy_gmem_to_smem(q_ref.at[batch, token, pl.ds(kv_head * group, group)],
                                q_tiles.at[0].at[pl.ds(token * group, group)], q_ready)
    zero_smem[0] = jnp.int32(0)
    rows, row_ok, stop = _row_stops(rb, bounds, group, params.window)
    soft_cap = params.logits_soft_cap
    # The row max is taken of unscaled values and scaled once: x c - m is one multiply-add.
    c = (_core.LOG2_E if soft_cap is not None else params.scale * _core.LOG2_E)
    shape = (ROWS, BLOCK_K)
    with jax.named_scope("decode_q_wait"):
      plgpu.barrier_wait(q_ready)
    rescale, lse_rows = row_smem.at[0], row_smem.at[1]

    def scores(slot):
      """S = Q K_slotᵀ, waited for. (Q's resident tile is indexed through a zero read at each
      step, which keeps its 36 wgmma descriptors in the loop: hoisted out of it, ptxas spilled
      56 bytes at 240 registers, and none since.)"""
      q_smem = q_tiles.at[bwd._opaque_zero(zero_smem, 0)]

      def qk(s_ref):
        plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].T)
        return plgpu.wgmma_accumulator_load(s_ref)

      return pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))

    def softmax(j, x, m, l, masked: bool):
      """Block j's online softmax step: ``(p, m_new, l_new, alpha)``, P in float32."""
      if soft_cap is not None:
        x = soft_cap * jnp.tanh(x * (params.scale / soft_cap))
      if masked:  # keys at or past a row's stop are hidden
        x = jnp.where(fwd._iota(shape, 1) < fwd._rows(stop - j * BLOCK_K, shape), x, -jnp.inf)
      m_new = jnp.maximum(m, x.max(axis=1) * c)
      # A row that has seen no visible key keeps m = -inf and is shifted by 0, so that it stays
      # at l = 0 and acc = 0; NaN logits make the row NaN, as in jax.nn.
      m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
      alpha = jnp.exp2(m - m_shift)
      p = jnp.exp2(x * c - fwd._rows(m_shift, shape))
      return p, m_new, l * alpha + p.sum(axis=1), alpha

    def hand_off(n, p16, alpha):
      """P and the rescale to the other consumer, once it has read the last ones."""
      pl.when(n > 0)(lambda: plgpu.barrier_wait(p_free))
      p_smem[...] = p16
      rescale[...] = alpha
      plgpu.commit_smem()
      plgpu.barrier_arrive(p_ready)

    def add_pv(acc, p16, slot):
      """acc + P V over this consumer's value columns of ``slot``, waited for."""
      if params.interpret:  # (no wgmma operand in registers, nor run_state, there)
        return acc + jnp.dot(p16, values(slot, 0)[...], preferred_element_type=jnp.float32)

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, p16, values(slot, 0))

      return pl.run_state(pv)(plgpu.ACC.init(acc))  # (waits for the product at its end)

    def step(n, j, carry, masked: bool):
      """Visit n (block j) in series: S, the softmax, P V."""
      acc, m, l = carry
      slot = slot_of(n)
      plgpu.barrier_wait(k_ready.at[slot])
      p, m, l, alpha = softmax(j, scores(slot), m, l, masked)
      p16 = p.astype(q_tiles.dtype)
      hand_off(n, p16, alpha)
      acc = add_pv(acc * fwd._rows(alpha, acc.shape), p16, slot)
      plgpu.barrier_arrive(k_free.at[slot])
      return acc, m, l

    # The visits: blocks [lo, mid) every row sees in full, then [mid, hi) with the mask.
    spans = (Span(False, mid - lo, lambda i: lo + i), Span(True, hi - mid, lambda i: mid + i))
    init = (plgpu.layout_cast(jnp.zeros((ROWS, half), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), fwd._ROWS),
            plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), fwd._ROWS))
    with jax.named_scope("decode_loop"):
      acc, m, l = walk(spans, step, init)

    with jax.named_scope("decode_epilogue"):
      seen = jnp.logical_and(jnp.logical_and(rows < rows_used, row_ok), l != 0.0)
      safe_l = jnp.where(seen, l, 1.0)
      factor = jnp.where(seen, 1.0 / safe_l, 0.0)
      lse2 = jnp.where(seen, m + jnp.log2(safe_l), -jnp.inf)
      pl.when(count > 0)(lambda: plgpu.barrier_wait(p_free))
      rescale[...] = factor  # the other consumer's factor too
      lse_rows[...] = lse2
      plgpu.commit_smem()
      plgpu.barrier_arrive(p_ready)
      plgpu.copy_smem_to_gmem(lse_rows.at[pl.ds(0, q_rows)],
                              lse_ref.at[batch, kv_head, split, pl.ds(rb * ROWS, q_rows)])
      out = jnp.where(fwd._rows(seen, acc.shape), acc * fwd._rows(factor, acc.shape), 0.0)
      store_out(out, 0)
      plgpu.wait_smem_to_gmem(0)
      landed()

    if merge:
      @pl.when(merging)
      def _merge():
        with jax.named_scope("merge_counter_wait"):
          plgpu.semaphore_wait(counter, 2 * splits, memory_scope="gpu")
        plgpu.barrier_arrive(merge_go)
        with jax.named_scope("merge"):
          m, l = merge_splits_here(0)
        seen = l != 0.0
        lse_rows[...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_rows.at[pl.ds(0, q_rows)],
                                final_lse_ref.at[batch, kv_head, pl.ds(rb * ROWS, q_rows)])
        plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 1)
  def _values():
    plgpu.set_max_registers(REGISTERS, action="increase")

    def step(n, acc):
      slot = slot_of(n)
      plgpu.barrier_wait(k_ready.at[slot])  # (its bytes are visible to this warpgroup too)
      plgpu.barrier_wait(p_ready)
      alpha = plgpu.load(row_smem.at[0], layout=fwd._ROWS, optimized=False)
      acc = acc * fwd._rows(alpha, acc.shape)

      if params.interpret:  # (no run_state there)
        acc = acc + jnp.dot(p_smem[...], values(slot, 1)[...],
                            preferred_element_type=jnp.float32)
      else:
        def pv(acc_ref):
          plgpu.wgmma(acc_ref, p_smem, values(slot, 1))

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      plgpu.barrier_arrive(p_free)
      plgpu.barrier_arrive(k_free.at[slot])
      return acc

    with jax.named_scope("decode_loop"):
      acc = lax.fori_loop(0, count, step, plgpu.layout_cast(
          jnp.zeros((ROWS, half), jnp.float32), plgpu.Layout.WGMMA))
    with jax.named_scope("decode_epilogue"):
      plgpu.barrier_wait(p_ready)
      factor = plgpu.load(row_smem.at[0], layout=fwd._ROWS, optimized=False)
      store_out(acc * fwd._rows(factor, acc.shape), 1)
      plgpu.wait_smem_to_gmem(0)
      landed()

    if merge:
      @pl.when(merging)
      def _merge():
        with jax.named_scope("merge_counter_wait"):
          plgpu.barrier_wait(merge_go)  # (after consumer 0's wait, which acquired the results)
        with jax.named_scope("merge"):
          merge_splits_here(1)
        plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(producer_registers(REGISTERS), action="decrease")

    load_key_blocks(k_ref, table_ref, page_size, batch, kv_head, lo, count,
                    (k_smem, k_ready, k_free), BLOCK_K)


def load_key_blocks(k_ref, table_ref, page_size: int | None, batch, kv_head, lo, count, ring,
                    block_k: int):
  """A decoding kernel's producer: key blocks ``lo ... lo + count - 1`` of one (batch row,
  K/V head) of a contiguous or paged cache (``table_ref``: the page table), block ``lo + n``
  into slot ``n % stages`` of ``ring = (slots, ready, free)`` once the consumers have freed
  it; then it waits for the last releases, so that the epilogue may reuse the ring."""
  slots, ready, free = ring
  stages = slots.shape[0]

  @pl.loop(0, count)
  def _(n):
    slot, first = lax.rem(n, jnp.int32(stages)), (lo + n) * block_k
    pl.when(n >= stages)(lambda: plgpu.barrier_wait(free.at[slot]))
    if table_ref is None:
      tile = k_ref.at[batch, pl.ds(first, block_k), kv_head]
    else:
      page = table_ref[batch, lax.div(first, jnp.int32(page_size))]
      tile = k_ref.at[page, pl.ds(lax.rem(first, jnp.int32(page_size)), block_k), kv_head]
    plgpu.copy_gmem_to_smem(tile, slots.at[slot], ready.at[slot])

  fwd.observe_last_releases(count, stages, free)


def transposed_serves(rows: int) -> bool:
  """Whether `decode_transposed`'s kernel serves a group of ``rows`` query rows (G·T): whole
  8-column pieces of its N, up to `TRANSPOSED_ROWS`."""
  return rows % 8 == 0 and rows <= TRANSPOSED_ROWS


def _group_rows(inputs: Inputs) -> int:
  """A K/V head's query rows, G·T."""
  return inputs.query.shape[2] // inputs.key.shape[2] * inputs.query.shape[1]


def runs_transposed(inputs: Inputs, config: MlaDecodeConfig) -> bool:
  """Whether a call runs `decode_transposed`'s kernel: as configured, for the group sizes it
  serves."""
  return config.transposed and transposed_serves(_group_rows(inputs))


def merges_in_kernel(inputs: Inputs, params: Params, config: MlaDecodeConfig) -> bool:
  """Whether the kernel merges the splits itself (`forward`): as configured, where no sinks
  join the merge, not in the interpreter, which has no semaphores, and not in the transposed
  kernel."""
  return (config.merge_in_kernel and inputs.sinks is None and not params.interpret
          and not runs_transposed(inputs, config))


def forward(inputs: Inputs, params: Params, config: MlaDecodeConfig, pages=None):
  """The training forward's ``(out [B, T, N, Dv] in the query dtype, lse2 [B, N, T])`` of a
  decoding call on a latent cache: the kernel's partial results over the splits, merged
  through the LSE by XLA after the kernel, or (`merges_in_kernel`) by the kernel's last CTA of
  each group. With ``pages`` = (key pages, value pages, page table) the kernel reads the key
  pages where they lie (`jaxflash.ops.decode.paged_attention`; the value pages are the same
  latent pages).

  The merge in the kernel is opt-in because a call is slower (H200, 2026-11-29, 16 heads: the
  kernel 80.5 µs against 78.2 plus XLA's merge of 2.6 µs at B = 32, 8k tokens, but the call
  97.4 against 94.7; 91.1 against 77.2 + 2.7 at B = 8, 32k, 16 splits). The merging CTA waits
  1 µs for its counter and takes 0.3 µs an item (a split's `merge_packing` pieces); unrolled,
  its loops had taken about 1 µs an item (instruction fetch). The counters also cost a launch
  of their own (XLA zeroes `pl.get_global` memory at each call, 0.7 µs). docs/decoding.md
  has the measurements."""
  t = inputs.query.shape[1]
  if merges_in_kernel(inputs, params, config):
    out, lse2 = _launch(inputs, params, config, pages, merge=True)[2:]
    b, kv_heads, rows = lse2.shape  # (token-major rows, as in `merge.group_rows_as_heads`)
    lse2 = lse2.reshape(b, kv_heads, t, rows // t).transpose(0, 1, 3, 2).reshape(b, -1, t)
    return out, lse2
  outs, lse2 = partial_results(inputs, params, config, pages)
  out, lse2 = merge.group_rows_as_heads(*merge.merge_splits(outs, lse2), t, inputs.sinks,
                                        token_major=True)
  return out.astype(inputs.query.dtype), lse2


def partial_results(inputs: Inputs, params: Params, config: MlaDecodeConfig, pages=None):
  """The kernel's results before the merge: float32 ``(out [B, K, splits, G·T, Dv], lse2 [B,
  K, splits, G·T])`` per split of the keys, query rows token-major (`forward`)."""
  if runs_transposed(inputs, config):
    from jaxflash.backends.mosaic import decode_transposed  # (it builds on this module)
    return decode_transposed.partial_results(inputs, params, config.splits, config.num_stages,
                                             pages)
  return _launch(inputs, params, config, pages, merge=False)


def _launch(inputs: Inputs, params: Params, config: MlaDecodeConfig, pages, merge: bool):
  """The kernel: `partial_results`'s two arrays, and with ``merge`` also the merged ``out`` [B,
  T, N, Dv] in the query dtype and base-2 ``lse2`` [B, K, G·T] (+inf on rows no key is seen
  by)."""
  q = inputs.query
  b, t, n, h = q.shape
  kv_heads, hv = inputs.key.shape[2], inputs.value.shape[-1]
  g = n // kv_heads
  rows_used = g * t
  if pages is None:
    cache, table, page_size = inputs.key, None, None
  else:
    cache, _, table = pages
    page_size = cache.shape[1]
  splits = used_splits(pl.cdiv(inputs.key.shape[1], BLOCK_K), config.splits)
  stages = config.num_stages
  row_blocks = pl.cdiv(rows_used, ROWS)
  packing = merge_packing(min(ROWS, rows_used), hv // 2)  # (the merge's `(slot_rows, pack)`)
  q_tile = fwd._smem_tile((1, ROWS, h), q.dtype)
  # O leaves through Q's memory, a [ROWS, piece] float32 staging tile per consumer.
  piece = _store_piece(hv)
  o_stages = fwd._smem_tile((2, ROWS, piece), jnp.float32, min(128, piece * 4))
  # With the merge, the output leaves through two [ROWS, MERGE_PIECE] tiles a consumer, in
  # memory that no partial result is in any longer once the merge starts.
  final_stages = (fwd._smem_tile((4, ROWS, MERGE_PIECE), q.dtype),) if merge else ()
  k_ring = fwd._smem_tile((stages, BLOCK_K, h), cache.dtype)
  if merge:  # the splits' tiles and LSE rows, a consumer's, over the free key ring
    k_ring = plgpu.RefUnion(k_ring, (
        fwd._smem_tile((2, MERGE_BUFFERS, ROWS, MERGE_PIECE), jnp.float32),
        plgpu.SMEM((2, MERGE_BUFFERS, ROWS), jnp.float32)))
  scratch = (
      plgpu.RefUnion(q_tile, o_stages, *final_stages),
      k_ring,
      fwd._smem_tile((ROWS, BLOCK_K), q.dtype),  # P
      plgpu.SMEM((2, ROWS), jnp.float32),  # the rows' rescale (then factor), and their LSE
      plgpu.SMEM((1,), jnp.int32),  # 0 (`backward._opaque_zero`)
      # q_ready: each of Q's copies (one per token below 64 rows) arrives on it
      plgpu.Barrier(num_arrivals=1 if g >= ROWS else t, num_barriers=1),
      plgpu.Barrier(num_barriers=stages),  # k_ready
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # k_free: both consumers read a slot
      plgpu.Barrier(num_barriers=1),  # p_ready
      plgpu.Barrier(num_barriers=1),  # p_free
      *((plgpu.Barrier(num_barriers=1),  # merge_go: the results are in
         # merge_ready: a buffer's tile and LSE rows have come, two copies a piece
         plgpu.Barrier(num_arrivals=2 * packing[1], num_barriers=2 * MERGE_BUFFERS))
        if merge else ()),
  )
  kernel = functools.partial(_kernel, params=params, t=t, group=g,
                             kv_heads=kv_heads, splits=splits, page_size=page_size,
                             value_dim=hv, stages=stages, merge=merge, row_blocks=row_blocks,
                             batch_heads=b * kv_heads, packing=packing,
                             kv_rows=inputs.key.shape[1])
  if merge:
    body = kernel
    finals = (_core.out_struct((b, t, n, hv), q.dtype, q),
              _core.out_struct((b, kv_heads, rows_used), jnp.float32, q))
  else:
    def body(*refs):  # (four inputs and two outputs, then the scratch)
      return kernel(*refs[:6], None, None, *refs[6:], None, None)

    finals = ()
  results = plgpu.kernel(
      body,
      out_type=(_core.out_struct((b, kv_heads, splits, rows_used, hv), jnp.float32, q),
                _core.out_struct((b, kv_heads, splits, rows_used), jnp.float32, q), *finals),
      scratch_types=scratch,
      # Row blocks fastest, then splits: the CTAs running together read neighbouring keys.
      grid=(b * kv_heads, splits, row_blocks),
      grid_names=("bk", "split", "rb"),
      num_threads=3,
      thread_name="wg",
      kernel_name="jaxflash_mosaic_decode_mla",
      # The row reductions stay within a warp's quads (the wgmma layout), so no scratch is set
      # aside for cross-warp ones: the tiles above leave less than its default 2 KiB.
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True,
                                           reduction_scratch_bytes=0),
      interpret=plgpu.InterpretGPUParams() if params.interpret else None,
  )(q, cache, inputs.kv_lengths, table)
  return results
