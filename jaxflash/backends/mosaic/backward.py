"""The Mosaic GPU backward for Hopper (sm90): dK/dV and dQ as two deterministic kernels.

Both kernels recompute S and P from Q, K and the base-2 LSE that the forward wrote, and take
``delta`` = rowsum(dO∘O) − dLSE from `jaxflash._core.delta`. Every gradient element has one
writer, so the gradients are bitwise deterministic with no atomics. Each CTA is three
warpgroups, two consumers and a producer, as in the forward (`forward.py`):

- **dK/dV**, grid (K/V heads, key tiles, B). Each consumer keeps 64 keys of K and V in shared
  memory; the producer streams ``dkv_block_q``-row tiles of Q and dO, with their LSE and delta
  rows, through a ring of ``dkv_stages`` slots, for every query head of the K/V head's group in
  turn (GQA: dK and dV are summed over the group in registers, in a fixed order). Per tile the
  consumer computes Sᵀ = K Qᵀ and dPᵀ = V dOᵀ back to back (the transposed Q and dO tiles are
  the wgmma's B operand), turns Sᵀ into Pᵀ while dPᵀ is in flight, and accumulates
  dV += Pᵀ dO and dK += dSᵀ Q with Pᵀ and dSᵀ as register operands: they come out of the
  scores in the accumulator layout and never go through shared memory.
- **dQ**, grid (query heads, query tiles, B). Each consumer keeps 64 query rows of Q and dO,
  with their LSE and delta in registers; the producer streams ``dq_block_kv``-key tiles of K and
  V. Per tile: S = Q Kᵀ and dP = dO Vᵀ back to back, P while dP is in flight, then dQ += dS K.
- **One pass** (opt-in, ``Backward.one_pass``; experimental, see `_DqPart`): up to head dim 128
  the dK/dV kernel also forms each query block's dQ part from both consumers' dSᵀ, and stores
  or adds it in a fixed order of key tiles, so no dQ kernel runs.
- **Atomic** (``Backward.atomic``, for calls with ``params.deterministic`` False): the same
  one-pass kernel, its dQ parts reduce-added by TMA into a float32 dQ that starts at zero, in
  whatever order the key tiles reach them (FlashAttention-2/3's and cuDNN's default design).
- **Head dims above 128** (`SPLIT_HEAD_DIM`, `Backward.splits_dkv`): one consumer's dK and dV
  accumulators (64 x D float32 each) do not fit its registers together, so dK/dV runs twice, dV
  alone (no V, no delta, no dPᵀ; its own tiles, `Backward.dv_pass`) and then dK alone. At
  D = 256 the resident tiles take 128 KiB, so the streamed tiles are 32 rows, with the 64-byte
  swizzle (`_swizzle`). In the atomic form the dK pass forms dQ too, from transposed parts
  (dQᵀ = Kᵀ dSᵀ: 32 rows are below a wgmma's 64; `_DqPart`), and no dQ kernel runs.
- **A value head dim of its own** (MLA): V, dO and dV have tiles of their own width; dPᵀ
  contracts it, dV += Pᵀ dO produces it. MLA's 192/128 runs dK and dV in one pass with its two
  consumers in two roles on one 64-key tile (``Backward.shared_keys``, `_SharedKeyRoles`: one
  forms Pᵀ and dV, the other dPᵀ, dSᵀ and dK), so neither holds both accumulators (64 x 320
  float32); calls the roles cannot serve run 64-row query tiles with the scores in series.

Block ranges come from the shared `jaxflash.schedule.Schedule` (`visit_q_split` for dK/dV,
`visit_kv` for dQ); blocks that every row sees in full skip the element mask, the others apply
`jaxflash.masking.key_range`'s bounds, segment ids and dropout (`jaxflash.dropout`'s mask,
regenerated entry by entry from absolute coordinates). Keys past the key length are masked;
query rows past the query length have an LSE of +inf, so their P is exactly 0.

A partial call (``params.partial``: ring attention's pieces) returns float32 gradients, which go
out through float32 tiles of their own (dK, then dV, through one per consumer).

What this backward does not serve (`unsupported`: biases, tiles that do not fit in
shared memory, partial calls above head dim 128 or in one pass) goes to the Triton backward,
which differentiates the Mosaic forward exactly: both read the same LSE.

With ``params.interpret`` the kernels run in Mosaic GPU's interpreter (tests on a CPU), which
has no wgmma with a register operand and no ``run_state``: the three products with a register
operand are plain dots there.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu

from jaxflash import _core
from jaxflash import dense_mask
from jaxflash import dropout
from jaxflash import masking
from jaxflash._core import Inputs, Params
from jaxflash.backends.mosaic import forward as fwd
from jaxflash.backends.mosaic.config import (SMEM_BUDGET, Backward, Config,
                                             backward_smem_bytes, dq_part_tiles, dq_split,
                                             padded_head_dim, shared_key_p_slots)
from jaxflash.backends.triton import backward as triton_backward
from jaxflash.masking import Positions
from jaxflash.schedule import BlockLists, Schedule, Span, block_at, total, walk

_CONSUMERS = 2  # (the backward's kernels run two consumer warpgroups; the forward may run three)
_ROWS, _COLS = fwd._ROWS, fwd._COLS
_KEYS = 64  # keys per consumer in dK/dV, query rows per consumer in dQ (one wgmma M)
# The one-pass kernel walks each head's query blocks downwards. Key tiles add their dQ parts in
# increasing order, and every key tile's walk then starts at the same (last) block, where the
# first tile of a causal band would otherwise be the last to reach its first blocks.
_WALK_DOWN = True


def unsupported(inputs: Inputs, params: Params, config: Config) -> str | None:
  """Why the Mosaic backward cannot serve this call (None if it can): the Triton one then does."""
  if config.backward is None:
    return "config.backward is None"
  head_dim, value_dim = inputs.query.shape[-1], inputs.value.shape[-1]
  hp, hv = _padded_dims(inputs)
  if params.partial and value_dim != head_dim:  # (one float32 tile carries dK, then dV)
    return "partial results (float32 gradients) with a value head dim of its own"
  if params.partial and config.backward.runs_one_pass(hp, hv=hv):
    return "partial results (float32 gradients) in one pass"
  tiles = config.backward
  if not config.backward.splits_dkv(hp, hv):  # (the tiles that form dK and dV)
    tiles = dkv_tiles(config.backward, params, hp, hv)[0]
  if backward_smem_bytes(tiles, head_dim, params.partial, value_dim=value_dim) > SMEM_BUDGET:
    what = " with float32 gradients (a partial call)" if params.partial else ""
    dims = f"{head_dim}" if value_dim == head_dim else f"{head_dim} (value {value_dim})"
    return f"{config.backward} does not fit in shared memory at head dim {dims}{what}"
  if inputs.bias is not None:
    return "biases"
  if inputs.block_table is not None and config.backward.runs_one_pass(hp, hv=hv):
    return "a block table (mask, mask_mod, segment ids) in one pass"
  return None


def _swizzle(block: int) -> int:
  """The swizzle of a kernel's 16-bit tiles: the streamed ``block`` is the contracted side of
  dV += Pᵀ dO and dK += dSᵀ Q (or dQ += dS K), and a wgmma contracts whole swizzled rows (64
  elements at 128 bytes, 32 at 64 bytes)."""
  return 128 if block % 64 == 0 else 64


def _cols(x, shape):
  """A per-column vector broadcast over the rows of a tile."""
  return lax.broadcast_in_dim(x, shape, [1])


def _tile_major(linear, heads: int, batches: int):
  """``(batch, head, rank)`` of the CTA at launch place ``linear`` (`fwd.launch_place`) when
  CTAs run rank by rank (`Backward.tile_major`): rank 0 of every (batch row, head), then rank
  1, and so on. For any (batch row, head), rank r still launches after rank r - 1 (which the
  one-pass kernel's ordered dQ adds rely on)."""
  rank = lax.div(linear, fwd._i32(heads * batches))
  rest = lax.rem(linear, fwd._i32(heads * batches))
  return lax.rem(rest, fwd._i32(batches)), lax.div(rest, fwd._i32(batches)), rank


def _positions(lengths_ref, offsets_ref, batch) -> Positions:
  offsets = () if offsets_ref is None else (offsets_ref[batch, 0], offsets_ref[batch, 1])
  return Positions(lengths_ref[batch, 0], lengths_ref[batch, 1], *offsets)


def _probabilities(s, lse2, params: Params, visible, make_score=None):
  """``(p, chain)``: P = exp2(base-2 logits − LSE) of a raw score tile, 0 where ``visible`` (a
  boolean tile, or None) is false, and the chain factor of the soft cap and the score_mod
  (``make_score()``, this tile's, made now that S is done: `fwd.score_of`'s ``deferred``; or
  None; `_core.logits_base2`). ``lse2`` is already broadcast to the tile."""
  score = None if make_score is None else make_score()
  s2, chain = _core.logits_base2(s, params, None, score, derivative=True)
  if visible is not None:
    s2 = jnp.where(visible, s2, -jnp.inf)
  # (This backward takes no bias: a score_mod is what can make logits huge.)
  return jnp.exp2(_core.capped_exponent(s2 - lse2, score is not None)), chain


def _early_scale(params: Params, dtype) -> float:
  """The factor dS takes before its cast to the operand ``dtype``: the softmax scale for
  float16, whose |dS| can pass 65504 with a large loss scale where scale · dS K is moderate;
  1 for bfloat16 (float32's range), whose float32 sums take the scale once at the end instead
  (`_late_scale`): one multiply an output entry rather than one a score entry."""
  return params.scale if jnp.dtype(dtype) == jnp.float16 else 1.0


def _late_scale(params: Params, dtype) -> float:
  """The factor the float32 dK and dQ sums take at the end: what `_early_scale` left out."""
  return 1.0 if jnp.dtype(dtype) == jnp.float16 else params.scale


def _times(x, factor: float):
  """``x * factor``, with no multiply when the factor is 1."""
  return x if factor == 1.0 else x * factor


def _dscores(p, dp, delta, keep, chain, params: Params, dtype):
  """dS = P ∘ (dP − delta) (dP after dropout), through the soft cap's and score_mod's chain
  factor (and `_early_scale`), in ``dtype`` for the next wgmma (transposed tiles give dSᵀ the
  same way)."""
  ds = _core.dlogits_to_dqk(p * (_core.dropped(dp, keep, params) - delta), chain)
  return _times(ds, _early_scale(params, dtype)).astype(dtype)


def _visible(k_idx, first_key, last_key, q_ids, kv_ids):
  """The element mask of a tile from its key indices (broadcast to the tile), the per-query key
  bounds of `masking.key_range` (broadcast, or scalars, or None) and segment ids
  (broadcast, or None)."""
  conds = [k_idx <= last_key]  # the key length always bounds it
  if first_key is not None:
    conds.append(k_idx >= first_key)
  if q_ids is not None:
    conds.append(q_ids == kv_ids)
  return functools.reduce(jnp.logical_and, conds)


def _opaque_zero(zero_ref, wg):
  """0, read from shared memory (``zero_ref[wg]``, which this warpgroup set to 0 before its
  loop) at each step of a loop: added to the index of a tile that stays resident through the
  loop, it keeps that tile's wgmma descriptors inside the loop.

  A wgmma takes one 64-bit descriptor per 16-element step of its contraction. For a tile that
  stays put (the dK/dV kernel's K and V, the dQ kernel's Q and dO) they are loop-invariant, so
  LLVM computes all of them before the loop, and ptxas holds them in registers through it beside
  the accumulators and spills them: 708 bytes in the atomic one pass at D = 128, 216 in MLA's
  dK/dV, 296 in the dK pass at D = 256 (`benchmarks/dev/ptxas_probe.py`, 2026-11-28). Indexed
  through a value LLVM cannot see is constant, they are made at each step from one base by a
  few uniform adds, and those kernels spill nothing."""
  return zero_ref[wg]


def _wgmma_scores(a_smem, b_smem, c_smem, d_smem, shape, then, early=None):
  """A Bᵀ and C Dᵀ on the tensor cores, back to back: ``then(A Bᵀ)`` runs while C Dᵀ is in
  flight; returns ``(then(A Bᵀ), C Dᵀ)``, or ``(then(A Bᵀ), None)`` when C and D are None.
  With ``early``, ``then(A Bᵀ, early())``, where ``early()`` runs once both are issued, before
  waiting on either (loads whose latency the wgmmas hide)."""
  second = c_smem is not None

  def run(s_ref, *dp_ref):
    plgpu.wgmma(s_ref, a_smem, b_smem.T)
    if second:
      plgpu.wgmma(dp_ref[0], c_smem, d_smem.T)
    ahead = () if early is None else (early(),)
    # Each wgmma is its own commit group: the first is done once at most one is pending.
    first = then(plgpu.wgmma_accumulator_load(s_ref, wait_n=int(second)), *ahead)
    return first, plgpu.wgmma_accumulator_load(dp_ref[0], wait_n=0) if second else None

  return pl.run_scoped(run, *[plgpu.ACC(shape, jnp.float32)] * (1 + second))


def _serial_step(carry, params: Params, shape, k_tile, v_tile, q_tile, do_tile, keep,
                 probabilities, early, smem, slot, q_free, do_free) -> dict:
  """A dK/dV step with ``Backward.serial_scores``: Sᵀ alone, Pᵀ in 16 bits, then dPᵀ and
  dV += Pᵀ dO, dSᵀ from the 16-bit Pᵀ (without dropout; with it from Pᵀ itself, which dropout
  does not scale), and dK += dSᵀ Q."""
  (p, chain), _ = _wgmma_scores(k_tile, q_tile, None, None, shape, probabilities, early)
  p16 = _core.dropped(p, keep, params).astype(q_tile.dtype)
  p_for_ds = p16 if keep is None else p.astype(q_tile.dtype)
  plgpu.barrier_wait(smem["delta_ready"].at[slot])

  def dlogits(dp):
    delta = _cols(plgpu.load(smem["delta"].at[slot], layout=_COLS), shape)
    return _dscores(p_for_ds.astype(jnp.float32), dp, delta, keep, chain, params, q_tile.dtype)

  if params.interpret:  # no register operands in the interpreter: plain dots
    (dp, _), _ = _wgmma_scores(v_tile, do_tile, None, None, shape, lambda x: (x, None))
    ds16 = dlogits(dp)
    sums = [carry["dv"] + jnp.dot(p16, do_tile[...], preferred_element_type=jnp.float32),
            carry["dk"] + jnp.dot(ds16, q_tile[...], preferred_element_type=jnp.float32)]
  else:
    def accumulate(acc_refs):
      dv_ref, dk_ref = acc_refs

      def scores(dp_ref):
        plgpu.wgmma(dp_ref, v_tile, do_tile.T)
        plgpu.wgmma(dv_ref, p16, do_tile)
        # Both done: dSᵀ may then take the registers of the Pᵀ that dV read (waiting for dPᵀ
        # alone left dV's Pᵀ live beside dSᵀ: ptxas spilled 220 bytes at MLA's 64-row tiles
        # against 196; both ran level on an H200).
        return plgpu.wgmma_accumulator_load(dp_ref, wait_n=0)

      dp = pl.run_scoped(scores, plgpu.ACC(shape, jnp.float32))
      plgpu.wgmma(dk_ref, dlogits(dp), q_tile)

    sums = pl.run_state(accumulate)((plgpu.ACC.init(carry["dv"]),
                                      plgpu.ACC.init(carry["dk"])))
  plgpu.barrier_arrive(q_free.at[slot])
  plgpu.barrier_arrive(do_free.at[slot])
  return dict(dv=sums[0], dk=sums[1])


class _SharedKeyRoles:
  """The dK/dV kernel's consumers with ``Backward.shared_keys``: both work on the CTA's one tile
  of 64 keys, in two roles, so that neither holds MLA's 64 x (192 + 128) float32 sums.

  - The **scores** role (consumer 0) holds K and dV: Sᵀ = K Qᵀ, Pᵀ in 16 bits, handed to the
    other role through a shared-memory tile (two, or one on 128-row query tiles:
    `config.shared_key_p_slots`),
    and dV += Pᵀ dO.
  - The **dscores** role (consumer 1) holds V and dK: dPᵀ = V dOᵀ (issued before it waits for
    Pᵀ, so it runs under the other role's softmax), dSᵀ = Pᵀ ∘ (dPᵀ − delta) from the handed
    16-bit Pᵀ (as ``Backward.serial_scores`` forms it), and dK += dSᵀ Q.

  Each role does 64 x rows x (Dqk + Dv) multiply-adds a visit, so the tensor cores are shared
  evenly, and at 192/128 one holds 64 x 128 float32 sums, the other 64 x 192. A CTA covers half
  the keys of the two-consumer layout, so Q and dO come from L2 twice as often per FLOP. Calls
  whose dSᵀ needs more than Pᵀ and dPᵀ (a soft cap's or score_mod's chain factor, dropout) and
  partial calls take the usual layout (`_dkv`). With ``Backward.shared_keys_overlap`` the
  dscores role issues each visit's dK product with the next visit's dPᵀ
  (`overlapped_dscores`)."""

  def __init__(self, smem, params: Params, shape, slot_of, wg, tile_masks, lse_rows_of,
               overlap: bool = False):
    self.smem, self.params, self.shape, self.slot_of = smem, params, shape, slot_of
    self.wg, self.tile_masks, self.lse_rows_of = wg, tile_masks, lse_rows_of
    self.overlap = overlap

  def _inputs(self, slot):
    """Waits for the visit's streamed tiles: (Q, dO)."""
    for name in ("q_ready", "lse_ready", "do_ready", "delta_ready"):
      plgpu.barrier_wait(self.smem[name].at[slot])
    return self.smem["q"].at[slot], self.smem["do"].at[slot]

  def _done_with(self, slot):
    plgpu.barrier_arrive(self.smem["q_free"].at[slot])
    plgpu.barrier_arrive(self.smem["do_free"].at[slot])

  @property
  def _p_slots(self) -> int:
    return self.smem["p"].shape[0]

  def _handed_p(self, p_slot):
    """The scores role's 16-bit Pᵀ from its slot, which is then free for the next."""
    plgpu.barrier_wait(self.smem["p_ready"].at[p_slot])
    p16 = self.smem["p"].at[p_slot][...]
    plgpu.barrier_arrive(self.smem["p_free"].at[p_slot])
    return p16

  def _resident(self, name):
    """The role's resident tile, through an index that keeps its descriptors in the loop."""
    return self.smem[name].at[_opaque_zero(self.smem["zero"], self.wg)]

  def _accumulate(self, total, a, b):
    """``total + a b`` (``a`` in registers, ``b`` a shared-memory tile)."""
    if self.params.interpret:  # no register operands in the interpreter: a plain dot
      return total + jnp.dot(a, b[...], preferred_element_type=jnp.float32)
    return pl.run_state(lambda ref: plgpu.wgmma(ref, a, b))(plgpu.ACC.init(total))

  def scores(self, n, first_head, g, i, carry, masked):
    slots = self._p_slots
    slot, p_slot = self.slot_of(n), lax.rem(n, jnp.asarray(slots, n.dtype))
    visible, _, _, _ = self.tile_masks(first_head + g, i, masked)
    q_tile, do_tile = self._inputs(slot)
    lse2 = self.lse_rows_of(slot)
    (p, _), _ = _wgmma_scores(self._resident("k"), q_tile, None, None, self.shape,
                              lambda s: _probabilities(s, lse2, self.params, visible))
    p16 = p.astype(q_tile.dtype)
    pl.when(n >= slots)(lambda: plgpu.barrier_wait(self.smem["p_free"].at[p_slot]))
    self.smem["p"].at[p_slot][...] = p16
    plgpu.commit_smem()
    plgpu.barrier_arrive(self.smem["p_ready"].at[p_slot])
    dv = self._accumulate(carry["dv"], p16, do_tile)
    self._done_with(slot)
    return dict(dv=dv, visits=n + 1)

  def dscores(self, n, first_head, g, i, carry, masked):
    del first_head, g, i, masked  # (Pᵀ comes masked)
    slot = self.slot_of(n)
    p_slot = lax.rem(n, jnp.asarray(self._p_slots, n.dtype))
    q_tile, do_tile = self._inputs(slot)

    (dp, p16), _ = _wgmma_scores(self._resident("v"), do_tile, None, None, self.shape,
                                 lambda dp, p16: (dp, p16),
                                 early=lambda: self._handed_p(p_slot))  # (dPᵀ in flight)
    delta = _cols(plgpu.load(self.smem["delta"].at[slot], layout=_COLS), self.shape)
    ds16 = _dscores(p16.astype(jnp.float32), dp, delta, None, None, self.params, q_tile.dtype)
    dk = self._accumulate(carry["dk"], ds16, q_tile)
    self._done_with(slot)
    return dict(dk=dk)

  def overlapped_dscores(self, n, first_head, g, i, carry, masked):
    """The dscores role with ``Backward.shared_keys_overlap``: the last visit's dK += dSᵀ Q
    (``carry["ds16"]``) and this visit's dPᵀ issued back to back, so that the tensor cores hold
    both while the scores role forms its softmax; then this visit's dSᵀ, kept for the next.
    Each input tile is released once its product is done: Q one visit late, dO now."""
    del first_head, g, i, masked  # (Pᵀ comes masked)
    slot, prev = self.slot_of(n), self.slot_of(jnp.maximum(n - 1, 0))
    p_slot = lax.rem(n, jnp.asarray(self._p_slots, n.dtype))
    _, do_tile = self._inputs(slot)
    # The first visit's dK product multiplies the zero dSᵀ the walk starts with by this visit's
    # Q (slot ``prev`` then), which stays held for the next visit's product: one product a key
    # tile more, and no branch (that form, `lax.cond` on n > 0 with the dPᵀ issue in both
    # arms, ran level on an H200: dK/dV 9.23-9.29 ms against 9.22-9.28 at MLA's 8k, 2026-12-02,
    # with 3 KiB more code).
    q_prev, has_prev = self.smem["q"].at[prev], n > 0
    release_prev = lambda: plgpu.barrier_arrive(self.smem["q_free"].at[prev])  # noqa: E731
    if self.params.interpret:  # (no register operands: a plain dot, then dPᵀ)
      dk = carry["dk"] + jnp.dot(carry["ds16"], q_prev[...], preferred_element_type=jnp.float32)
      pl.when(has_prev)(release_prev)
      dp, _ = _wgmma_scores(self._resident("v"), do_tile, None, None, self.shape, lambda x: x)
    else:
      def issue(refs):
        plgpu.wgmma(refs[0], carry["ds16"], q_prev)
        plgpu.wgmma(refs[1], self._resident("v"), do_tile.T)
        plgpu.wgmma_wait(1)  # (each wgmma is its own commit group: dK's is done)
        pl.when(has_prev)(release_prev)

      zeros = plgpu.layout_cast(jnp.zeros(self.shape, jnp.float32), plgpu.Layout.WGMMA)
      dk, dp = pl.run_state(issue)((plgpu.ACC.init(carry["dk"]), plgpu.ACC.init(zeros)))
    delta = _cols(plgpu.load(self.smem["delta"].at[slot], layout=_COLS), self.shape)
    plgpu.barrier_arrive(self.smem["do_free"].at[slot])  # (dPᵀ done, delta read)
    p16 = self._handed_p(p_slot)
    ds16 = _dscores(p16.astype(jnp.float32), dp, delta, None, None, self.params, p16.dtype)
    return dict(dk=dk, ds16=ds16, visits=n + 1)

  def _last_dk(self, sums):
    """dK after an overlapped walk: its last visit's product, and Q's tile released."""
    def product():
      slot = self.slot_of(sums["visits"] - 1)
      dk = self._accumulate(sums["dk"], sums["ds16"], self.smem["q"].at[slot])
      plgpu.barrier_arrive(self.smem["q_free"].at[slot])
      return dk
    return lax.cond(sums["visits"] > 0, product, lambda: sums["dk"])

  def run(self, schedule: Schedule, cta_start, pos, first_head, heads_here, spans_of, hp, hv,
          k_tile, v_tile, place, out):
    """Both roles' walks over the CTA's visits, then dK and dV out (each through the resident
    tile of the other role, which is read no more once both walks are done)."""
    zeros = lambda width: plgpu.layout_cast(  # noqa: E731
        jnp.zeros((_KEYS, width), jnp.float32), plgpu.Layout.WGMMA)

    def walk(body, carry):
      return schedule.visit_q_split(
          cta_start, pos, lambda n, g, i, c, masked: body(n, first_head, g, i, c, masked),
          carry, repeat=heads_here, spans_of=spans_of)

    @pl.when(self.wg == 0)
    def _scores():
      sums = walk(self.scores, dict(dv=zeros(hv), visits=fwd._i32(0)))
      fwd.observe_last_releases(sums["visits"], self._p_slots, self.smem["p_free"])
      self._finish(v_tile, sums["dv"], place(out["dv"]))

    @pl.when(self.wg == 1)
    def _dscores():
      if self.overlap:
        tile16 = plgpu.layout_cast(jnp.zeros(self.shape, k_tile.dtype), plgpu.Layout.WGMMA)
        dk = self._last_dk(walk(self.overlapped_dscores,
                                dict(dk=zeros(hp), ds16=tile16, visits=fwd._i32(0))))
      else:
        dk = walk(self.dscores, dict(dk=zeros(hp)))["dk"]
      self._finish(k_tile, _times(dk, _late_scale(self.params, k_tile.dtype)),
                   place(out["dk"]))

  def _finish(self, tile, value, target):
    plgpu.barrier_arrive(self.smem["k_done"])  # both walks done: the resident tiles are free
    plgpu.barrier_wait(self.smem["k_done"])
    tile[...] = value.astype(tile.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile, target)
    plgpu.wait_smem_to_gmem(0)


# ----------------------------------------------------------------------------------------------
# dK / dV, and dQ in the same pass


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, lengths_ref, offsets_ref,
                first_ref, extras: fwd._Extras, dq_sum_ref, out: dict, smem: dict, *,
                params: Params, config: Backward, schedule: Schedule, groups: int,
                grads: tuple[str, ...], sem_shape: tuple[int, ...] | None, parts: int = 1,
                shared_keys: bool = False):
  """``grads`` names what this pass accumulates: ``("dk", "dv")``, one of them (head dims above
  128, where one accumulator of 64 x D float32 is all a warpgroup's registers hold next to the
  scores; a dV-only pass needs neither V nor delta, and skips dPᵀ), or ``("dk", "dv", "dq")``,
  the one-pass kernel. Its ordered form writes ``out["dq"]``, with ``sem_shape`` counters
  (batch, head, query block, consumer) and ``first_ref``, the first key tile to visit each
  (batch row, query block) (`_first_visitors`); its atomic form adds into ``dq_sum_ref``, a
  zeroed float32 array it updates in place (and ``first_ref`` is None). With ``parts`` above 1
  (`Backward.group_parts`) a CTA takes one of ``parts`` equal shares of its K/V head's query
  heads, and writes its dK and dV sums to ``out[name][part]`` for the caller to add up. With
  ``shared_keys`` (`Backward.shared_keys`) both consumers work on the CTA's one tile of 64 keys
  in two roles (`_SharedKeyRoles`)."""
  sems = None
  if sem_shape is not None:
    # Shared by every CTA (scratch semaphores would be each CTA's own), zero at each call.
    sems = pl.get_global(plgpu.SemaphoreType.REGULAR(sem_shape))
  block_q, stages = config.dkv_block_q, config.dkv_stages
  want_dk, want_dv, want_dq = ("dk" in grads, "dv" in grads, "dq" in grads)
  k_smem, q_smem, do_smem, lse_smem = smem["k"], smem["q"], smem["do"], smem["lse"]
  kv_ready, q_free, do_free = smem["kv_ready"], smem["q_free"], smem["do_free"]
  hp, hv = k_smem.shape[-1], do_smem.shape[-1]
  wg = lax.axis_index("wg")
  cta_head, batch = lax.axis_index("heads"), lax.axis_index("batch")  # (K/V head, part)
  k_tile_index = lax.axis_index("k_tiles")
  # (The grid's sizes from the operands: k_ref's rows are padded to a multiple of 8 only.)
  b_size, _, heads_size, _ = k_ref.shape
  keys_per_cta = _KEYS if shared_keys else _CONSUMERS * _KEYS
  k_tiles = pl.cdiv(k_ref.shape[1], keys_per_cta)
  linear = fwd.launch_place(cta_head, k_tile_index, batch, k_tiles, b_size)
  if extras.order is not None:  # a block table's key tiles, heaviest first (one part)
    batch, cta_head, k_tile_index = fwd.ordered(extras.order, linear, heads_size, k_tiles)
  elif config.tile_major and schedule.window.right is not None:
    # (A causal band's first key tiles see the most query rows: rank r is key tile r.)
    batch, cta_head, k_tile_index = _tile_major(linear, heads_size * parts, b_size)
  kv_head, part = cta_head, 0  # (one part: the kernel as without `Backward.group_parts`)
  if parts > 1:
    kv_head, part = lax.div(cta_head, fwd._i32(parts)), lax.rem(cta_head, fwd._i32(parts))
  heads_here = groups // parts  # the query heads this CTA visits, from first_head on
  first_head = kv_head * groups + part * heads_here
  cta_start = k_tile_index * keys_per_cta
  pos = _positions(lengths_ref, offsets_ref, batch)
  atomic = want_dq and dq_sum_ref is not None
  split = dq_split(block_q, hp) if want_dq else None
  # (`Backward.dq_before_dk`: the part goes out while dK's product runs.)
  dq_early = (atomic and config.dq_before_dk and split in ("cols", "rows") and want_dk
              and want_dv and not params.interpret)
  # (Unordered adds need no common start: each key tile of a causal band starts at its own
  # diagonal block, so the tiles do not add to one block at the same time.)
  reverse = want_dq and _WALK_DOWN and not atomic
  spans_of = None  # the schedule's ranges, or a block table's lists per head of the group
  if extras.lists is not None:
    lists = BlockLists(extras.lists)
    spans_of = lambda g: lists.spans(batch, first_head + g, k_tile_index)  # noqa: E731
  # (`Backward.stagger`: unordered adds, and without a band every key tile would start on query
  # block 0 at once.)
  stagger = k_tile_index if atomic and config.stagger and spans_of is None else None

  def slot_of(n):  # the ring slot of the n-th visit (over all heads of the group)
    return lax.rem(n, jnp.asarray(stages, n.dtype))

  @pl.when(wg < _CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(config.registers, action="increase")
    k_start = cta_start if shared_keys else cta_start + wg * _KEYS
    keys = pl.ds(k_start, _KEYS)
    if shared_keys:  # one K and one V tile, each read by one role: its consumer loads it
      k_tile, v_tile = k_smem.at[0], smem["v"].at[0]
      for role, (ref, tile_ref) in enumerate(((k_ref, k_tile), (v_ref, v_tile))):
        @pl.when(wg == role)
        def _load(ref=ref, tile_ref=tile_ref, role=role):
          plgpu.copy_gmem_to_smem(ref.at[batch, keys, kv_head], tile_ref, kv_ready.at[role])
          plgpu.barrier_wait(kv_ready.at[role])
    else:
      k_tile = k_smem.at[wg]
      plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_head], k_tile, kv_ready.at[wg])
      v_tile = None
      if want_dk:  # dPᵀ = V dOᵀ
        v_tile = smem["v"].at[wg]
        plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, kv_head], v_tile,
                                kv_ready.at[_CONSUMERS + wg])
    shape = (_KEYS, block_q)
    k_idx = lambda: k_start + fwd._iota(shape, 0)  # this consumer's keys, one per row
    kv_ids = None
    if extras.kv_segment_ids is not None:
      kv_ids = fwd._rows(plgpu.load(extras.kv_segment_ids.at[batch, keys], layout=_ROWS,
                                    optimized=False), shape)
    if not shared_keys:
      plgpu.barrier_wait(kv_ready.at[wg])
      if want_dk:
        plgpu.barrier_wait(kv_ready.at[_CONSUMERS + wg])
    smem["zero"][wg] = jnp.int32(0)  # (`_opaque_zero`)
    dq_part = None
    if want_dq:
      dq_part = _DqPart(dq_sum_ref if atomic else out["dq"], smem, sems, params,
                        split=split, block_q=block_q, hp=hp, wg=wg,
                        batch=batch, k_tile=k_tile_index, first_ref=first_ref)

    def tile_masks(head, i, masked: bool):
      """``(visible, keep, q_cols, rows)`` of the [keys, rows] tile of query block ``i`` of
      ``head``: its element mask (None on a full block), its dropout's kept entries (None
      without dropout), a maker of its query indices, and its rows."""
      q_start = i * block_q
      # (Index vectors are built only where they are used: Mosaic GPU's layout inference
      # fails on a vector that nothing reads.)
      q_cols = lambda: q_start + plgpu.broadcasted_iota(jnp.int32, (block_q,), 0, layout=_COLS)
      rows = pl.ds(q_start, block_q)
      visible = None
      if masked:
        first_key, last_key = masking.key_range(
            None if schedule.window.is_full else q_cols(), schedule.window,
            diagonal=pos.diagonal, kv_len=pos.kv_len)
        by_col = lambda x: x if x is None or jnp.ndim(x) == 0 else _cols(x, shape)
        q_ids = None
        if extras.q_segment_ids is not None:
          q_ids = _cols(plgpu.load(extras.q_segment_ids.at[batch, pl.ds(q_start, block_q)],
                                   layout=_COLS, optimized=False), shape)
        visible = _visible(k_idx(), by_col(first_key), by_col(last_key), q_ids, kv_ids)
        if extras.mask is not None:  # the transposed mask's [keys, rows] tile
          visible = jnp.logical_and(visible,
                                    fwd.packed_tile(extras.mask, batch, head, q_start // 32,
                                                    keys, shape))
        if params.mask_rule is not None:  # (index tiles only where read: see above)
          visible = jnp.logical_and(visible, fwd.rule_mask(
              params, extras, batch, head, shape,
              lambda: _cols(masking.shifted(q_cols(), pos.q_offset), shape),
              lambda: masking.shifted(k_idx(), pos.kv_offset),
              rows, keys, lambda x: _cols(x, shape), lambda x: fwd._rows(x, shape), _COLS,
              _ROWS))
      keep = None
      if extras.dropout_seed is not None:
        stream = _core.dropout_stream(params, extras.dropout_seed, batch, head)
        row_key = dropout.row_keys(stream, masking.shifted(q_cols(), pos.q_offset))
        keep = dropout.keep_entries(_cols(row_key, shape),
                                    masking.shifted(k_idx(), pos.kv_offset),
                                    params.dropout_rate)
      return visible, keep, q_cols, rows

    def step(n, g, i, carry, masked: bool):
      slot = slot_of(n)
      head = first_head + g
      visible, keep, q_cols, rows = tile_masks(head, i, masked)

      plgpu.barrier_wait(smem["q_ready"].at[slot])
      plgpu.barrier_wait(smem["lse_ready"].at[slot])
      plgpu.barrier_wait(smem["do_ready"].at[slot])
      q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
      # The resident K and V tiles, through an index that keeps their descriptors in the loop.
      zero = _opaque_zero(smem["zero"], wg)
      k_here = k_smem.at[wg + zero]
      v_here = None if v_tile is None else smem["v"].at[wg + zero]

      # What makes the score_mod of the transposed [keys, rows] tile (None without one).
      make_score = fwd.score_of(params, extras, batch, head, shape, lambda: _cols(q_cols(), shape),
                           k_idx, rows, keys, lambda x: _cols(x, shape),
                           lambda x: fwd._rows(x, shape), _COLS, _ROWS, transposed=True,
                           deferred=True)

      def lse_rows():
        return _cols(plgpu.load(lse_smem.at[slot], layout=_COLS), shape)

      def probabilities(s, lse2=None):  # Pᵀ (while dPᵀ is in flight)
        lse2 = lse_rows() if lse2 is None else lse2
        return _probabilities(s, lse2, params, visible, make_score)

      # The LSE rows read once the wgmmas are issued (`Backward.early_rows`): read after the
      # wait, their latency stalled the consumers on 7% of their samples (ncu, H200, atomic one
      # pass, D = 128, 16k).
      early = lse_rows if config.early_rows else None
      ds16 = None
      serial = want_dk and want_dv and not want_dq and config.serial_scores
      if serial:
        return _serial_step(carry, params, shape, k_here, v_here, q_tile, do_tile, keep,
                            probabilities, early, smem, slot, q_free, do_free)
      if want_dk:
        plgpu.barrier_wait(smem["delta_ready"].at[slot])
        (p, chain), dp = _wgmma_scores(k_here, q_tile, v_here, do_tile, shape, probabilities,
                                       early)
        if "held" in carry:
          # The last visit's last transposed part, once these wgmmas are done (sent while they
          # run, ptxas waited for them before its stores: the part's registers came from a
          # wgmma).
          dq_part.send_held(carry["held"])
        delta = _cols(plgpu.load(smem["delta"].at[slot], layout=_COLS), shape)
        ds16 = _dscores(p, dp, delta, keep, chain, params, q_tile.dtype)
      else:
        (p, _), _ = _wgmma_scores(k_here, q_tile, None, None, shape, probabilities, early)
      p16 = _core.dropped(p, keep, params).astype(q_tile.dtype) if want_dv else None

      # dV += Pᵀ dO (in flight while dSᵀ is stored) and dK += dSᵀ Q; then this consumer's part
      # of the query block's dQ from both consumers' dSᵀ.
      operands = {"dv": (p16, do_tile), "dk": (ds16, q_tile)}
      names = [name for name in ("dv", "dk") if name in grads]
      ds_slot = dq_part.ds_slot(n) if want_dq else None
      if params.interpret:  # no register operands in the interpreter: plain dots
        sums = [carry[name] + jnp.dot(operands[name][0], operands[name][1][...],
                                      preferred_element_type=jnp.float32) for name in names]
        if want_dq:
          dq_part.share_scores(ds16, ds_slot, n)
          sums.extend(dq_part.product_interpreted(ds_slot, k_smem))
      else:
        def accumulate(acc_refs):
          if dq_early:  # dV's product, dQ's, then dK's, the dQ part sent while dK's runs
            dv_ref, dk_ref = acc_refs
            plgpu.wgmma(dv_ref, p16, do_tile)
            dq_part.share_scores(ds16, ds_slot, n)

            def dq_then_dk(dq_ref):
              dq_part.product([dq_ref], ds_slot, k_smem.at[pl.ds(zero, _CONSUMERS)])
              plgpu.wgmma(dk_ref, ds16, q_tile)
              dq_part.send([plgpu.wgmma_accumulator_load(dq_ref, wait_n=1)], head, i)

            pl.run_scoped(dq_then_dk, plgpu.ACC((dq_part.rows, dq_part.cols), jnp.float32))
            return
          for acc_ref, name in zip(acc_refs, names):
            a, b = operands[name]
            plgpu.wgmma(acc_ref, a, b)
          if want_dq:
            dq_part.share_scores(ds16, ds_slot, n)
            dq_part.product(acc_refs[len(names):], ds_slot,
                            k_smem.at[pl.ds(zero, _CONSUMERS)])

        accs = [plgpu.ACC.init(carry[name]) for name in names]
        if want_dq and not dq_early:
          accs.extend(plgpu.ACC.init(z) for z in dq_part.zeros())
        sums = list(pl.run_state(accumulate)(tuple(accs)))
      plgpu.barrier_arrive(q_free.at[slot])
      plgpu.barrier_arrive(do_free.at[slot])
      new_carry = dict(zip(names, sums))
      dq_parts = sums[len(names):]
      if want_dq:
        dq_part.scores_read()
      if "held" in carry:
        # The last part waits in registers for the next visit's wgmmas: sent now, it would
        # wait for the part before it to leave the one staging tile.
        dq_part.send(dq_parts[:-1], head, i)
        new_carry["held"] = (dq_parts[-1], head, i, fwd._i32(1))
      elif "pending" in carry:  # (the ordered form's signal, one visit late)
        new_carry["pending"] = dq_part.send(dq_parts, head, i, carry["pending"])
      elif want_dq and not dq_early:  # (with ``dq_early`` the part went out already)
        dq_part.send(dq_parts, head, i)
      return new_carry

    if shared_keys:
      _SharedKeyRoles(smem, params, shape, slot_of, wg, tile_masks, lse_rows_of=lambda slot: (
          _cols(plgpu.load(lse_smem.at[slot], layout=_COLS), shape)),
                      overlap=config.shared_keys_overlap).run(
              schedule, cta_start, pos, first_head, heads_here, spans_of, hp, hv, k_tile, v_tile,
              lambda ref: ref.at[part, batch, keys, kv_head] if parts > 1
              else ref.at[batch, keys, kv_head], out)
      return

    width = {"dk": hp, "dv": hv}
    carry = {name: plgpu.layout_cast(jnp.zeros((_KEYS, width[name]), jnp.float32),
                                     plgpu.Layout.WGMMA) for name in grads if name != "dq"}
    if want_dq and not atomic:  # (unordered adds signal no one)
      carry["pending"] = _DqPart.nothing_pending()
    if want_dq and dq_part.transposed:  # (`_DqPart.send_held`)
      carry["held"] = (dq_part.zeros()[0], fwd._i32(0), fwd._i32(0), fwd._i32(0))
    sums = schedule.visit_q_split(cta_start, pos, step, carry, repeat=heads_here,
                                  reverse=reverse, spans_of=spans_of, stagger=stagger)
    if "held" in sums:  # (a part is held after any visit: the last one's goes out now)
      dq_part.observe_last_read(sums["held"][-1])
      dq_part.send_held(sums["held"])
    if want_dq:  # the other consumer's dQ products read this one's K tile until its last one
      plgpu.barrier_arrive(smem["k_done"])
      plgpu.barrier_wait(smem["k_done"])
    results = {"dk": _times(sums["dk"], _late_scale(params, k_tile.dtype))} if want_dk else {}
    # (Where this CTA's sums go: its part's slice of the outputs when the group is split.)
    place = ((lambda ref: ref.at[part, batch, keys, kv_head]) if parts > 1
             else (lambda ref: ref.at[batch, keys, kv_head]))
    if want_dv:
      results["dv"] = sums["dv"]
    if params.partial:
      # Float32 gradients (to be summed over the calls) go out one after the other through
      # this consumer's float32 tile.
      stage = smem["out32"].at[wg]
      for n, name in enumerate(results):
        if n:
          # The last one has left the tile: only the thread that issued its store waits, so
          # the warpgroup meets before anyone overwrites it.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          if not params.interpret:  # the interpreter runs a warpgroup as one thread
            fwd._emit(mgpu.utils.warpgroup_barrier)
        stage[...] = results[name]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(stage, place(out[name]))
    else:
      # K and V are read no more: dK and dV go out through their tiles (dV through K's when the
      # pass has no V, or a tile of its own where V's head dim is not K's).
      dv_tile = v_tile if want_dk else smem["dv"].at[wg] if "dv" in smem else k_tile
      out_tiles = {"dk": k_tile, "dv": dv_tile}
      for name, value in results.items():
        out_tiles[name][...] = value.astype(out_tiles[name].dtype)
      plgpu.commit_smem()
      for name in ("dk", "dv"):
        if name in results:
          plgpu.copy_smem_to_gmem(out_tiles[name], place(out[name]))
    plgpu.wait_smem_to_gmem(0)
    if "pending" in sums:
      dq_part.release(sums["pending"])

  @pl.when(wg == _CONSUMERS)
  def _producer():
    plgpu.set_max_registers(config.producer_registers, action="decrease")

    def load(n, g, i, carry, masked=None):
      del masked
      slot = slot_of(n)
      head = first_head + g
      rows = pl.ds(i * block_q, block_q)
      refill = n >= stages  # the first pass round the ring finds it free
      pl.when(refill)(lambda: plgpu.barrier_wait(q_free.at[slot]))
      plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_smem.at[slot],
                              smem["q_ready"].at[slot])
      plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, rows], lse_smem.at[slot],
                              smem["lse_ready"].at[slot])
      pl.when(refill)(lambda: plgpu.barrier_wait(do_free.at[slot]))
      plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], do_smem.at[slot],
                              smem["do_ready"].at[slot])
      if want_dk:
        plgpu.copy_gmem_to_smem(delta_ref.at[batch, head, rows], smem["delta"].at[slot],
                                smem["delta_ready"].at[slot])
      return carry

    if spans_of is not None:  # a block table's lists: the consumers' walk, visit by visit
      visits = schedule.visit_q_split(cta_start, pos, lambda n, g, i, c, masked: c + 1,
                                      fwd._i32(0), repeat=heads_here, spans_of=spans_of)
      schedule.visit_q_split(cta_start, pos, load, None, repeat=heads_here, spans_of=spans_of)
    else:
      # One flat loop over the visits (the consumers' masked and unmasked spans walk the same
      # tiles). Against the consumers' three loops, ptxas spilled 76 bytes instead of 92 at
      # head dim 128, and the kernel's time did not change beyond the noise (H200, 2026-11-22).
      lo, _, _, hi = schedule.q_block_ranges(cta_start, pos)
      count = jnp.maximum(hi - lo, 0)  # query blocks per head of the group
      visits = heads_here * count
      staggered = (None if stagger is None
                   else schedule.q_spans_from(cta_start, pos, stagger))

      @pl.loop(fwd._i32(0), visits)
      def _(n):
        g = lax.div(n, jnp.maximum(count, 1))
        place = lax.rem(n, jnp.maximum(count, 1))
        if staggered is not None:
          block = block_at(staggered, place)
        else:
          block = hi - 1 - place if reverse else lo + place
        load(n, g, block, None)

    fwd.observe_last_releases(visits, stages, q_free, do_free)


class _DqPart:
  """One consumer's part of a query block's dQ in the one-pass kernel, and its way out.

  Each consumer stores its dSᵀ tile (64 keys by ``block_q`` queries) in shared memory; once both
  have, each forms its part (`dq_split`) of dS K over the CTA's 128 keys, as a wgmma with the
  transposed dSᵀ tiles as A. The part goes out through a float32 staging tile by TMA: the first
  key tile to visit the query block stores it, every later one adds to it (a TMA reduce-add).

  The adds are deterministic. The key tiles that visit a query block are consecutive
  (`_first_visitors`), and each adds only after all the ones before it have: a counter per
  (batch, head, query block, consumer) counts the parts that have landed, and the k-th visitor
  waits until it reaches k, without taking from it. A tile only waits for tiles launched before
  it (the grid puts key tiles before batch rows), so the chain cannot deadlock. The count for a
  block goes up one visit late, after the next block's products, so that the wait for the add
  to land costs nothing; a tile then runs at most about a visit behind the one before it.

  A counter that each wait decremented would let two later tiles race for one signal: 5770ed5
  did, and hung on an H200 wherever three or more key tiles visit a block. This version is
  correct and bitwise repeatable on an H200 (`benchmarks/diag_one_pass.py`, the GPU tests) but
  slower than the two kernels (docs/mosaic_backward.md, "One pass"), hence ``one_pass`` is off
  by default.

  Without ``first_ref`` (the atomic form) every visitor adds, in no particular order, into a
  dQ that starts at zero; nothing waits but for the staging tile to be free.

  With ``"transposed"`` parts (`dq_split`: 32-row query tiles, the dK pass at D = 256) each
  consumer forms dQᵀ = Kᵀ dSᵀ for its half of the head dim, in wgmmas of 64 head-dim rows (the
  K tiles transposed as A, the dSᵀ tiles as B), and adds each into a transposed float32 dQ
  [B, N, head dim, T]. There the dSᵀ tiles have one slot, not two (shared memory is full), so
  a consumer stores its next dSᵀ only once both have read the last (``ds_free``).

  In Mosaic GPU's interpreter, which has neither semaphores nor reduce-adds but runs the CTAs
  one at a time in grid order, the part is added in place.
  """

  @staticmethod
  def nothing_pending():
    """The ordered form's loop carry of `send`: (head, query block, whether its signal is
    pending)."""
    return fwd._i32(0), fwd._i32(0), fwd._i32(0)

  def __init__(self, dq_ref, smem, sems, params: Params, *, split, block_q, hp, wg, batch,
               k_tile, first_ref):
    self.dq_ref, self.smem, self.sems, self.params = dq_ref, smem, sems, params
    self.split, self.block_q, self.wg, self.batch = split, block_q, wg, batch
    self.transposed = split == "transposed"
    # Each part's shape, and how many parts a consumer forms per visit (``chunks``).
    self.slots, (self.rows, self.cols) = dq_part_tiles(block_q, hp)
    self.chunks = hp // 2 // _KEYS if self.transposed else 1
    self.k_tile, self.first_ref = k_tile, first_ref
    self.atomic = first_ref is None
    assert self.atomic or not self.transposed, "transposed dQ parts are added unordered only"

  def zeros(self) -> list:
    """A zero accumulator per part of a visit."""
    return [plgpu.layout_cast(jnp.zeros((self.rows, self.cols), jnp.float32),
                              plgpu.Layout.WGMMA) for _ in range(self.chunks)]

  def ds_slot(self, n):
    """The dSᵀ tiles' slot of the ``n``-th visit."""
    return lax.rem(n, jnp.asarray(self.slots, n.dtype))

  def share_scores(self, ds16, ds_slot, n):
    """Stores this consumer's dSᵀ of the ``n``-th visit (with one slot, once both consumers
    have read the last visit's: `scores_read`) and waits until the other consumer has stored
    its own."""
    if self.slots == 1:
      pl.when(n > 0)(lambda: plgpu.barrier_wait(self.smem["ds_free"]))
    self.smem["ds"].at[ds_slot, self.wg][...] = ds16
    plgpu.commit_smem()
    plgpu.barrier_arrive(self.smem["ds_ready"].at[ds_slot])
    plgpu.barrier_wait(self.smem["ds_ready"].at[ds_slot])

  def scores_read(self):
    """This consumer's products have read both dSᵀ tiles (with one slot, they may be
    overwritten once both consumers say so)."""
    if self.slots == 1:
      plgpu.barrier_arrive(self.smem["ds_free"])

  def send_held(self, held):
    """Adds a visit's last transposed part, held in registers until the next visit's wgmmas
    are issued (or the loop ends): ``held`` is (part, head, query block, whether there is
    one)."""
    part, head, i, is_held = held
    chunk = self.chunks - 1

    pl.when(is_held > 0)(lambda: self._add(part, self._target(head, i, chunk)))

  def _add(self, part, target):
    """Adds ``part`` into ``target`` (unordered: the atomic form) through the staging tile."""
    if self.params.interpret:
      target[...] = target[...] + part
    else:
      plgpu.copy_smem_to_gmem(self._stage(part), target, reduction_op="add")

  def observe_last_read(self, any_visit):
    """After the loop: waits for the last `scores_read` of both consumers (with one slot), so
    that no barrier phase goes unwaited (`fwd.observe_last_releases`)."""
    pl.when(any_visit > 0)(lambda: plgpu.barrier_wait(self.smem["ds_free"]))

  def _d_cols(self, chunk):
    """The head-dim columns of a transposed part: 64 of this consumer's half."""
    return pl.ds((self.wg * self.chunks + chunk) * _KEYS, _KEYS)

  def _operands(self, ds_slot, k_smem, c, chunk):
    """(A, B) of consumer ``c``'s 64 keys in this consumer's part ``chunk``: dS over them, their
    K (transposed: Kᵀ over them, their dSᵀ)."""
    ds_t, k_c = self.smem["ds"].at[ds_slot, c], k_smem.at[c]
    if self.transposed:
      return k_c.at[:, self._d_cols(chunk)].T, ds_t
    if self.split == "cols":
      return ds_t.T, k_c.at[:, pl.ds(self.wg * self.cols, self.cols)]
    return ds_t.at[:, pl.ds(self.wg * _KEYS, _KEYS)].T, k_c

  def product(self, acc_refs, ds_slot, k_smem):
    for chunk, acc_ref in enumerate(acc_refs):
      for c in range(_CONSUMERS):
        plgpu.wgmma(acc_ref, *self._operands(ds_slot, k_smem, c, chunk))

  def product_interpreted(self, ds_slot, k_smem) -> list:
    parts = []
    for chunk in range(self.chunks):
      part = jnp.zeros((self.rows, self.cols), jnp.float32)
      for c in range(_CONSUMERS):
        ds_t, k_c = self.smem["ds"].at[ds_slot, c][...], k_smem.at[c][...]
        if self.transposed:
          start = (self.wg * self.chunks + chunk) * _KEYS
          a, b = lax.dynamic_slice_in_dim(k_c, start, _KEYS, axis=1).T, ds_t
        elif self.split == "cols":
          a, b = ds_t.T, lax.dynamic_slice_in_dim(k_c, self.wg * self.cols, self.cols, axis=1)
        else:
          a, b = lax.dynamic_slice_in_dim(ds_t, self.wg * _KEYS, _KEYS, axis=1).T, k_c
        part += jnp.dot(a, b, preferred_element_type=jnp.float32)
      parts.append(part)
    return parts

  def _target(self, head, i, chunk=0):
    """Where this consumer's part ``chunk`` of query block ``i`` goes."""
    if self.transposed:
      return self.dq_ref.at[self.batch, head, self._d_cols(chunk),
                            pl.ds(i * self.block_q, self.block_q)]
    if self.split == "cols":
      return self.dq_ref.at[self.batch, pl.ds(i * self.block_q, self.rows), head,
                            pl.ds(self.wg * self.cols, self.cols)]
    return self.dq_ref.at[self.batch, pl.ds(i * self.block_q + self.wg * _KEYS, self.rows),
                          head, pl.ds(0, self.cols)]

  def _sem(self, head, i):
    return self.sems.at[self.batch, head, i, self.wg]

  def _stage(self, part):
    """``part`` in this consumer's staging tile, once the last part has left it, its stores
    fenced for TMA and the warpgroup met after them."""
    # Only the thread that issued the last store waits for it: the warpgroup meets before
    # anyone overwrites the tile.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    fwd._emit(mgpu.utils.warpgroup_barrier)
    stage = self.smem["dq"].at[self.wg]
    stage[...] = part
    plgpu.commit_smem()  # (the fence, then a warpgroup barrier)
    return stage

  def send(self, parts, head, i, pending=None):
    """Stores or adds ``parts`` for query block ``i`` of ``head``; in the ordered form returns
    what is now pending (``pending``: the last visit's, `nothing_pending` at first), in the
    atomic form nothing."""
    if self.atomic:
      for chunk, part in enumerate(parts):  # (each waits for the last to leave the staging tile)
        self._add(part, self._target(head, i, chunk))
      return None
    (part,) = parts
    target = self._target(head, i)
    earlier = self.k_tile - self.first_ref[self.batch, i]  # visitors of the block before this
    first = earlier == 0
    if self.params.interpret:
      @pl.when(first)
      def _store():
        target[...] = part

      @pl.when(~first)
      def _add():
        target[...] = target[...] + part

      return pending
    plgpu.wait_smem_to_gmem(0)  # the last part has landed (for `release`)
    self.release(pending)
    stage = self._stage(part)
    pl.when(~first)(lambda: plgpu.semaphore_wait(self._sem(head, i), earlier, decrement=False,
                                                 memory_scope="gpu"))
    plgpu.copy_smem_to_gmem(stage, target, predicate=first)
    plgpu.copy_smem_to_gmem(stage, target, predicate=~first, reduction_op="add")
    return (head, i, fwd._i32(1))

  def release(self, pending):
    """Counts the pending part as landed, for the later key tiles (after a wait for it)."""
    if self.params.interpret:
      return
    head, i, is_pending = pending
    pl.when(is_pending > 0)(
        lambda: plgpu.semaphore_signal(self._sem(head, i), memory_scope="gpu"))


def dkv_tiles(config: Backward, params: Params, hp: int, hv: int) -> tuple[Backward, bool]:
  """``(tiles, shared_keys)``: the tiles of a dK/dV kernel that forms dK and dV at padded head
  dims ``hp`` and ``hv``, and whether it runs `Backward.shared_keys`'s two roles. A call whose
  dSᵀ needs more than Pᵀ and dPᵀ (a soft cap's or score_mod's chain factor, dropout), or a
  partial call, runs the usual layout (`Backward.usual_layout`) instead."""
  if not config.shared_keys:
    return config, False
  if (params.partial or params.logits_soft_cap is not None or params.score_rule is not None
      or params.dropout_rate > 0):
    return config.usual_layout(hp, hv, params.partial), False
  return config, True


def _dkv(q, k, v, d_out, lse2, delta, inputs: Inputs, params: Params, config: Backward,
         extras: fwd._Extras, hp: int, grads: tuple[str, ...] = ("dk", "dv"),
         atomic: bool = False) -> dict:
  """``{name: gradient}`` for the ``grads`` of one dK/dV pass (see `_dkv_kernel`); a dV-only
  pass runs `Backward.dv_pass`'s tiles. With ``"dq"`` (the one-pass kernel) dQ comes out too,
  over padded rows and head dims like the others, its parts added in a fixed order of key
  tiles or, ``atomic``, in any order."""
  if grads == ("dv",):
    config = config.dv_pass()
  if atomic:
    config = config.atomic_pass()
  if grads == ("dk", "dv"):
    config, shared_keys = dkv_tiles(config, params, hp, v.shape[-1])
  else:
    shared_keys = False
  b = q.shape[0]
  kv_heads = k.shape[2]
  groups = q.shape[2] // kv_heads
  block_q, stages = config.dkv_block_q, config.dkv_stages
  keys_per_cta = _KEYS if shared_keys else _CONSUMERS * _KEYS
  k_tiles = pl.cdiv(inputs.key.shape[1], keys_per_cta)
  schedule = Schedule.of(params.window, block_q, keys_per_cta, mask=extras.mask,
                         q_segment_ids=extras.q_segment_ids)
  # A block table's visits per key tile, and the dense mask packed along the queries: this
  # kernel's tiles are [keys, queries].
  extras = fwd.with_lists(extras, inputs, params, block_q, keys_per_cta, transpose=True)
  extras = fwd.with_order(extras, inputs, groups)
  parts = config.parts_of(groups) if extras.order is None else 1
  if inputs.score_bands is not None:
    extras = extras._replace(score_band=fwd.pad_band(inputs.score_bands, inputs.query.shape[1]))
  if extras.mask is not None:
    words = inputs.mask_words_t
    if words is None:
      words = dense_mask.pack_local(inputs.mask).by_queries
    keys, rows = extras.mask.shape[2] * 32, extras.mask.shape[3]  # (the forward words' padding)
    extras = extras._replace(mask=fwd._pad_to(words, words.shape[:2] + (rows // 32, keys)))
  want_dk, want_dq = "dk" in grads, "dq" in grads
  hv = v.shape[-1]  # (V's and dO's padded head dim)
  resident = 2 if want_dk else 1  # K, and V for dPᵀ
  tiles_of = 1 if shared_keys else _CONSUMERS  # (resident tiles of each kind)
  tile = functools.partial(fwd._smem_tile, swizzle=_swizzle(block_q))
  smem = dict(
      zero=plgpu.SMEM((_CONSUMERS,), jnp.int32),  # (`_opaque_zero`)
      k=tile((tiles_of, _KEYS, hp), k.dtype),  # K, then dK (or dV) on the way out
      q=tile((stages, block_q, hp), q.dtype),
      do=tile((stages, block_q, hv), q.dtype),
      lse=plgpu.SMEM((stages, block_q), jnp.float32),  # LSE rows
      kv_ready=plgpu.Barrier(num_barriers=resident * tiles_of),
      q_ready=plgpu.Barrier(num_barriers=stages),
      do_ready=plgpu.Barrier(num_barriers=stages),
      lse_ready=plgpu.Barrier(num_barriers=stages),
      q_free=plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
      do_free=plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
  )
  if want_dk:
    smem.update(
        v=tile((tiles_of, _KEYS, hv), v.dtype),  # V, then dV on the way out
        delta=plgpu.SMEM((stages, block_q), jnp.float32),  # delta rows
        delta_ready=plgpu.Barrier(num_barriers=stages),
    )
  elif hv != hp:  # dV on the way out of a dV-only pass, where K's tile has another width
    smem["dv"] = tile((_CONSUMERS, _KEYS, hv), v.dtype)
  if shared_keys:  # Pᵀ from one role to the other (`_SharedKeyRoles`)
    p_slots = shared_key_p_slots(block_q)
    smem.update(
        p=tile((p_slots, _KEYS, block_q), q.dtype),
        p_ready=plgpu.Barrier(num_barriers=p_slots),
        p_free=plgpu.Barrier(num_barriers=p_slots),
        k_done=plgpu.Barrier(num_arrivals=_CONSUMERS),
    )
  grad_dtype = jnp.float32 if params.partial else k.dtype
  part_axis = (parts,) if parts > 1 else ()  # (each part's sums, added up below)
  out_type = {"dk": _core.out_struct(part_axis + k.shape, grad_dtype, q),
              "dv": _core.out_struct(part_axis + v.shape, grad_dtype, q)}
  if params.partial:  # each consumer's float32 dK and dV on the way out (`unsupported`: hv == hp)
    smem["out32"] = plgpu.SMEM((_CONSUMERS, _KEYS, hp), jnp.float32)
  sem_shape = first = None
  transposed = False
  if want_dq:
    transposed = dq_split(block_q, hp) == "transposed"
    slots, part = dq_part_tiles(block_q, hp)
    smem.update(
        ds=tile((slots, _CONSUMERS, _KEYS, block_q), q.dtype),  # dSᵀ of both consumers
        ds_ready=plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=slots),
        # Each consumer's dQ part, staged. (A part is a wgmma accumulator: in a row-major tile
        # the 8 rows that a warp stores at once would share banks. The atomic kernel measured
        # the same with either, H200 2026-11-24.)
        dq=fwd._smem_tile((_CONSUMERS, *part), jnp.float32),
        k_done=plgpu.Barrier(num_arrivals=_CONSUMERS),
    )
    if slots == 1:
      smem["ds_free"] = plgpu.Barrier(num_arrivals=_CONSUMERS)
    # Rows padded to whole query blocks, like the LSE's: the interpreter's stores do not clip.
    # (Transposed parts add into dQᵀ, [B, N, head dim, rows].)
    t_pad = lse2.shape[-1]
    dq_shape = (b, q.shape[2], hp, t_pad) if transposed else (b, t_pad, q.shape[2], hp)
    if not atomic:
      out_type["dq"] = _core.out_struct(dq_shape, jnp.float32, q)
      if not params.interpret:  # (the interpreter has no semaphores; it needs none)
        sem_shape = (b, q.shape[2], t_pad // block_q, _CONSUMERS)
      first = _first_visitors(schedule, inputs, t_pad // block_q)
  kernel = functools.partial(_dkv_kernel, params=params, config=config, schedule=schedule,
                             groups=groups, grads=grads, sem_shape=sem_shape, parts=parts,
                             shared_keys=shared_keys)
  # Pallas walks the grid row-major, batch fastest: with a causal band the first key tiles,
  # which see the most query rows, launch first, and each key tile launches after the one
  # before it of the same batch row and head (the one-pass kernel's dQ adds rely on it).
  out_type = {name: out_type[name] for name in grads if name in out_type}
  run = plgpu.kernel(
      kernel,
      out_type=out_type,
      scratch_types=(smem,),
      grid=(kv_heads * parts, k_tiles, b),
      grid_names=("heads", "k_tiles", "batch"),
      num_threads=_CONSUMERS + 1,
      thread_name="wg",
      kernel_name=_dkv_name(grads, atomic),
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
      interpret=plgpu.InterpretGPUParams() if params.interpret else None,
  )
  operands = (q, k, v, d_out, lse2, delta, inputs.lengths, inputs.offsets, first, extras)
  if atomic:
    grads_out = _with_zeroed_sum(run, operands, dq_shape, out_type)
    dq = grads_out["dq"].transpose(0, 3, 1, 2) if transposed else grads_out["dq"]
    grads_out["dq"] = _times(dq, _late_scale(params, q.dtype)).astype(q.dtype)
    return _added_parts(grads_out, parts)
  grads_out = _added_parts(run(*operands, None), parts)
  if want_dq:
    # Scaled, and zero in the query blocks that no key tile visits: their rows see no key, and
    # the kernel never writes them.
    visited = jnp.repeat(first < k_tiles, block_q, axis=1)[:, :, None, None]
    grads_out["dq"] = _times(jnp.where(visited, grads_out["dq"], 0.0),
                              _late_scale(params, q.dtype)).astype(q.dtype)
  return grads_out


def _added_parts(grads: dict, parts: int) -> dict:
  """``grads`` with dK and dV summed over their leading axis of ``parts`` (`Backward.
  group_parts`), in float32 and in a fixed order."""
  if parts == 1:
    return grads
  return {name: x.astype(jnp.float32).sum(0).astype(x.dtype) if name in ("dk", "dv") else x
          for name, x in grads.items()}


def _dkv_name(grads, atomic: bool) -> str:
  """The dK/dV kernel's name in a profile: what it computes (the dV and dK passes, or the one
  pass that forms dQ too)."""
  name = "".join(g for g in ("dq", "dk", "dv") if g in grads)
  return f"jaxflash_mosaic_{name}{'_atomic' if atomic else ''}"


def _with_zeroed_sum(run, operands, dq_shape, out_type: dict) -> dict:
  """``run``'s outputs (``out_type``) and ``"dq"``, the float32 sum it adds into: a mutable
  array that starts at zero (blocks that no key tile visits stay zero), which lives and dies
  inside a `pl.run_state` (mutable arrays may not cross the custom VJP around the backward).

  `pl.run_state` has no batching rule, so under vmap the slices run one after another, each
  with its own array (one array shared by the slices would sum their dQ). They are unrolled,
  not a `lax.map`: inside XLA's loop on a GPU the kernels' additions never reached the array
  (every slice's dQ came out zero, 2026-11-24)."""
  def one_call(operands):
    def body(refs):
      outs = run(*operands, refs["dq"])
      for name, value in outs.items():
        refs[name][...] = value

    start = {name: jnp.zeros(t.shape, t.dtype) for name, t in out_type.items()}
    return pl.run_state(body)({**start, "dq": jnp.zeros(dq_shape, jnp.float32)})

  @jax.custom_batching.custom_vmap
  def call(operands):
    return one_call(operands)

  @call.def_vmap
  def _slice_by_slice(axis_size, in_batched, operands):
    def one_slice(i):
      return call(jax.tree.map(lambda x, b: x[i] if b else x, operands, in_batched[0]))

    slices = [one_slice(i) for i in range(axis_size)]
    outs = jax.tree.map(lambda *xs: jnp.stack(xs), *slices)
    return outs, jax.tree.map(lambda _: True, outs)

  return call(operands)


def _first_visitors(schedule: Schedule, inputs: Inputs, q_blocks: int):
  """[B, q_blocks] int32: the first key tile (of ``schedule.block_k`` keys) that visits each query
  block in dK/dV (`Schedule.q_blocks`), or the number of key tiles where none does.

  The key tiles that visit a block are consecutive: a band's rows see one run of keys each, and
  a block's rows together see one run too (`test_first_visitors_match_the_schedule`). So a
  block's count ``c`` and index sum ``s`` of visitors give the first, ``(s - c(c-1)/2) / c``,
  from two running sums over the key tiles' ranges instead of a [key tiles, blocks] table."""
  b = inputs.lengths.shape[0]
  keys = schedule.block_k
  k_tiles = pl.cdiv(inputs.key.shape[1], keys)
  offsets = () if inputs.offsets is None else (inputs.offsets[:, 0], inputs.offsets[:, 1])
  pos = Positions(inputs.lengths[:, 0], inputs.lengths[:, 1], *offsets)  # fields [B]
  tiles = jnp.arange(k_tiles, dtype=jnp.int32)
  lo, hi = jax.vmap(lambda j: schedule.q_blocks(j * keys, pos))(tiles)
  # (Either bound may not depend on the batch row: [key tiles] or [key tiles, B].)
  lo, hi = (jnp.broadcast_to(jnp.clip(x, 0, q_blocks).reshape(k_tiles, -1), (k_tiles, b))
            for x in (lo, hi))
  hi = jnp.maximum(hi, lo)
  rows = jnp.broadcast_to(jnp.arange(b)[None, :], lo.shape)
  weights = jnp.broadcast_to(tiles[:, None], lo.shape)

  def running(w):  # sum of w over the key tiles whose range holds each block
    edges = jnp.zeros((b, q_blocks + 1), jnp.int32).at[rows, lo].add(w).at[rows, hi].add(-w)
    return jnp.cumsum(edges, axis=1)[:, :q_blocks]

  count, total = running(jnp.ones_like(weights)), running(weights)
  first = (total - count * (count - 1) // 2) // jnp.maximum(count, 1)
  return jnp.where(count > 0, first, k_tiles).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# dQ


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, lengths_ref, offsets_ref,
               extras: fwd._Extras, dq_ref, q_smem, do_smem, k_smem, v_smem, q_ready, k_ready,
               v_ready, k_free, v_free, dq32_smem, zero_smem, *, params: Params,
               config: Backward, schedule: Schedule, groups: int, q_tiles: int,
               heavy_first: bool):
  block_kv, stages = config.dq_block_kv, config.dq_stages
  wg = lax.axis_index("wg")
  head, batch = lax.axis_index("heads"), lax.axis_index("batch")
  tile = lax.axis_index("q_tiles")
  linear = fwd.launch_place(head, tile, batch, q_tiles, q_ref.shape[0])
  if extras.order is not None:  # a block table's query tiles, heaviest first
    batch, head, tile = fwd.ordered(extras.order, linear, q_ref.shape[2], q_tiles)
  elif heavy_first:
    if config.tile_major:  # (then ``tile`` is the rank across every batch row and head)
      batch, head, tile = _tile_major(linear, q_ref.shape[2], q_ref.shape[0])
    tile = q_tiles - 1 - tile  # the rows that see the most keys first
  cta_start = tile * (_CONSUMERS * _KEYS)
  pos = _positions(lengths_ref, offsets_ref, batch)
  if extras.lists is not None:
    spans = BlockLists(extras.lists).spans(batch, head, tile)
  else:
    spans = schedule.kv_spans(cta_start, pos)

  def slot_of(n):  # the ring slot of the n-th visit
    return lax.rem(n, jnp.asarray(stages, n.dtype))

  @pl.when(wg < _CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(config.registers, action="increase")
    q_start = cta_start + wg * _KEYS
    rows = pl.ds(q_start, _KEYS)
    q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_tile, q_ready.at[wg])
    plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], do_tile, q_ready.at[_CONSUMERS + wg])
    shape = (_KEYS, block_kv)
    lse2 = fwd._rows(plgpu.load(lse_ref.at[batch, head, rows], layout=_ROWS, optimized=False),
                     shape)
    delta = fwd._rows(plgpu.load(delta_ref.at[batch, head, rows], layout=_ROWS,
                                 optimized=False), shape)
    q_rows = lambda: q_start + plgpu.broadcasted_iota(jnp.int32, (_KEYS,), 0, layout=_ROWS)
    first_key, last_key = masking.key_range(None if schedule.window.is_full else q_rows(),
                                            schedule.window, diagonal=pos.diagonal,
                                            kv_len=pos.kv_len)
    by_row = lambda x: x if x is None or jnp.ndim(x) == 0 else fwd._rows(x, shape)
    first_key, last_key = by_row(first_key), by_row(last_key)
    q_ids = None
    if extras.q_segment_ids is not None:
      q_ids = fwd._rows(plgpu.load(extras.q_segment_ids.at[batch, rows], layout=_ROWS,
                                   optimized=False), shape)
    row_key = None
    if extras.dropout_seed is not None:
      stream = _core.dropout_stream(params, extras.dropout_seed, batch, head)
      row_key = fwd._rows(dropout.row_keys(stream, masking.shifted(q_rows(), pos.q_offset)),
                          shape)
    plgpu.barrier_wait(q_ready.at[wg])
    plgpu.barrier_wait(q_ready.at[_CONSUMERS + wg])
    zero_smem[wg] = jnp.int32(0)  # (`_opaque_zero`)

    def step(n, j, dq, masked: bool):
      slot = slot_of(n)
      k_start = j * block_kv
      k_idx = lambda: k_start + fwd._iota(shape, 1)  # (built only where used: see `_dkv_kernel`)
      keys = pl.ds(k_start, block_kv)
      visible = None
      if masked:
        kv_ids = None
        if q_ids is not None:
          kv_ids = _cols(plgpu.load(
              extras.kv_segment_ids.at[batch, pl.ds(k_start, block_kv)], layout=_COLS,
              optimized=False), shape)
        visible = _visible(k_idx(), first_key, last_key, q_ids, kv_ids)
        if extras.mask is not None:
          visible = jnp.logical_and(visible,
                                    fwd.packed_tile(extras.mask, batch, head,
                                                    j * (block_kv // 32), rows, shape))
        if params.mask_rule is not None:  # (index tiles only where read: see `_dkv_kernel`)
          visible = jnp.logical_and(visible, fwd.rule_mask(
              params, extras, batch, head, shape,
              lambda: fwd._rows(masking.shifted(q_rows(), pos.q_offset), shape),
              lambda: masking.shifted(k_idx(), pos.kv_offset),
              rows, keys, lambda x: fwd._rows(x, shape), lambda x: _cols(x, shape), _ROWS,
              _COLS))
      keep = None
      if row_key is not None:
        keep = dropout.keep_entries(row_key, masking.shifted(k_idx(), pos.kv_offset),
                                    params.dropout_rate)
      plgpu.barrier_wait(k_ready.at[slot])
      plgpu.barrier_wait(v_ready.at[slot])
      k_tile = k_smem.at[slot]
      make_score = fwd.score_of(
          params, extras, batch, head, shape, lambda: fwd._rows(q_rows(), shape), k_idx, rows,
          keys, lambda x: fwd._rows(x, shape), lambda x: _cols(x, shape), _ROWS, _COLS,
          deferred=True)
      # The resident Q and dO tiles, through an index that keeps their descriptors in the loop.
      here = wg + _opaque_zero(zero_smem, wg)
      (p, chain), dp = _wgmma_scores(
          q_smem.at[here], k_tile, do_smem.at[here], v_smem.at[slot], shape,
          lambda s: _probabilities(s, lse2, params, visible, make_score))
      plgpu.barrier_arrive(v_free.at[slot])
      ds16 = _dscores(p, dp, delta, keep, chain, params, k_tile.dtype)
      if params.interpret:
        dq = dq + jnp.dot(ds16, k_tile[...], preferred_element_type=jnp.float32)
      else:
        def grad(dq_ref):
          plgpu.wgmma(dq_ref, ds16, k_tile)

        dq = pl.run_state(grad)(plgpu.ACC.init(dq))
      plgpu.barrier_arrive(k_free.at[slot])
      return dq

    hp = q_tile.shape[-1]
    zeros = plgpu.layout_cast(jnp.zeros((_KEYS, hp), jnp.float32), plgpu.Layout.WGMMA)
    dq = walk(spans, step, zeros)
    # Q is read no more: dQ goes out through its tile, or a float32 tile of its own in a partial
    # call (rows past T are clipped by TMA).
    out_tile = q_tile if dq32_smem is None else dq32_smem.at[wg]
    out_tile[...] = _times(dq, _late_scale(params, q_tile.dtype)).astype(out_tile.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_tile, dq_ref.at[batch, rows, head])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _CONSUMERS)
  def _producer():
    plgpu.set_max_registers(config.producer_registers, action="decrease")
    kv_head = lax.div(head, jnp.asarray(groups, head.dtype))
    producer_spans = spans
    if extras.lists is None:  # one flat loop over the consumers' runs of blocks
      lo, _, _, hi = schedule.kv_blocks(cta_start, pos)
      producer_spans = (Span(False, hi - lo, lambda m: lo + m),)

    def load(n, j, carry, masked):
      del masked
      slot = slot_of(n)
      keys = pl.ds(j * block_kv, block_kv)
      refill = n >= stages
      pl.when(refill)(lambda: plgpu.barrier_wait(k_free.at[slot]))
      plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_head], k_smem.at[slot], k_ready.at[slot])
      pl.when(refill)(lambda: plgpu.barrier_wait(v_free.at[slot]))
      plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, kv_head], v_smem.at[slot], v_ready.at[slot])
      return carry

    walk(producer_spans, load, fwd._i32(0))
    fwd.observe_last_releases(total(producer_spans), stages, k_free, v_free)


def _dq(q, k, v, d_out, lse2, delta, inputs: Inputs, params: Params, config: Backward,
        extras: fwd._Extras, hp: int):
  b, _, n, _ = q.shape
  groups = n // k.shape[2]
  block_kv, stages = config.dq_block_kv, config.dq_stages
  hv = v.shape[-1]  # (V's and dO's padded head dim)
  rows_per_cta = _CONSUMERS * _KEYS
  q_tiles = pl.cdiv(inputs.query.shape[1], rows_per_cta)
  schedule = Schedule.of(params.window, rows_per_cta, block_kv, mask=extras.mask,
                         q_segment_ids=extras.q_segment_ids)
  extras = fwd.with_order(fwd.with_lists(extras, inputs, params, rows_per_cta, block_kv),
                          inputs)
  if inputs.score_bands is not None:
    extras = extras._replace(score_band=fwd.pad_band(inputs.score_bands, inputs.query.shape[1]))
  tile = functools.partial(fwd._smem_tile, swizzle=_swizzle(block_kv))
  scratch = (
      tile((_CONSUMERS, _KEYS, hp), q.dtype),  # Q, then dQ on the way out
      tile((_CONSUMERS, _KEYS, hv), q.dtype),  # dO
      tile((stages, block_kv, hp), k.dtype),
      tile((stages, block_kv, hv), v.dtype),
      plgpu.Barrier(num_barriers=2 * _CONSUMERS),  # Q and dO of each consumer
      plgpu.Barrier(num_barriers=stages),  # k_ready
      plgpu.Barrier(num_barriers=stages),  # v_ready
      plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),  # k_free
      plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),  # v_free
      # dQ on the way out in a partial call (float32, to be summed over the calls)
      plgpu.SMEM((_CONSUMERS, _KEYS, hp), jnp.float32) if params.partial else None,
      plgpu.SMEM((_CONSUMERS,), jnp.int32),  # (`_opaque_zero`)
  )
  kernel = functools.partial(_dq_kernel, params=params, config=config, schedule=schedule,
                             groups=groups, q_tiles=q_tiles,
                             heavy_first=params.window.right is not None)
  return plgpu.kernel(
      kernel,
      out_type=_core.out_struct(q.shape, jnp.float32 if params.partial else q.dtype, q),
      scratch_types=scratch,
      grid=(n, q_tiles, b),
      grid_names=("heads", "q_tiles", "batch"),
      num_threads=_CONSUMERS + 1,
      thread_name="wg",
      kernel_name="jaxflash_mosaic_dq",
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
      interpret=plgpu.InterpretGPUParams() if params.interpret else None,
  )(q, k, v, d_out, lse2, delta, inputs.lengths, inputs.offsets, extras)


# ----------------------------------------------------------------------------------------------


def kernel_args(inputs: Inputs, params: Params, config: Config, lse2, d_out, delta) -> tuple:
  """The arguments of `_dkv` and `_dq` for a call (padded operands, LSE and delta rows, the
  optional inputs padded to whole tiles), as `backward` passes them; ``benchmarks/bwd_parts.py``
  times the kernels on them one by one."""
  q, k, v = inputs.query, inputs.key, inputs.value
  t, s = q.shape[1], k.shape[1]
  hp, hv = _padded_dims(inputs)
  rows = _CONSUMERS * _KEYS
  # Every tile either kernel reads of the LSE, delta and segment ids lies inside the padding.
  t_pad = fwd._round_up(t, math.lcm(rows, config.backward.dkv_block_q,
                                     config.backward.dv_pass().dkv_block_q))
  # TMA copies 8-row swizzled tiles: sequences are padded to multiples of 8 in memory (the
  # kernels' edge tiles past them are zero-filled on the way in and clipped on the way out).
  q_p = fwd._pad(q, fwd._round_up(t, 8), hp)
  do_p = fwd._pad(d_out.astype(q.dtype), fwd._round_up(t, 8), hv)
  k_p, v_p = (fwd._pad(x, fwd._round_up(s, 8), d) for x, d in ((k, hp), (v, hv)))
  # LSE and delta rows are read a whole tile at a time: padding rows get an LSE of +inf (P = 0).
  lse_p = jnp.pad(lse2, [(0, 0), (0, 0), (0, t_pad - t)], constant_values=jnp.inf)
  delta_p = jnp.pad(delta, [(0, 0), (0, 0), (0, t_pad - t)])
  extras = fwd._extras(inputs, t_pad, fwd._round_up(s, math.lcm(config.backward.dq_block_kv,
                                                                 rows)))
  return (q_p, k_p, v_p, do_p, lse_p, delta_p, inputs, params, config.backward, extras, hp)


def _padded_dims(inputs: Inputs) -> tuple[int, int]:
  """The head dims the kernels pad Q and K, and V and dO, to (`padded_head_dim`)."""
  return padded_head_dim(inputs.query.shape[-1]), padded_head_dim(inputs.value.shape[-1])


def _one_pass_mode(inputs: Inputs, params: Params, config: Backward) -> str | None:
  """How dQ comes out: ``"atomic"`` or ``"ordered"`` from the dK/dV kernel, or None (the dQ
  kernel). A call that allows nondeterministic gradients but that the atomic kernel cannot
  serve (a partial call, or one whose tiles do not fit) takes the deterministic kernels."""
  q_len, (hp, hv) = inputs.query.shape[1], _padded_dims(inputs)
  mode = config.one_pass_mode(hp, params.deterministic, q_len, hv)
  if mode == "atomic" and (params.partial or backward_smem_bytes(
      config, inputs.query.shape[-1], deterministic=False,
      value_dim=inputs.value.shape[-1]) > SMEM_BUDGET):
    return config.one_pass_mode(hp, True, q_len, hv)
  return mode


def backward(inputs: Inputs, params: Params, config: Config, lse2, d_out, delta, want_dbias):
  """``(dq, dk, dv, dbias)`` (see `jaxflash._core`); calls `unsupported` names go to the Triton
  backward."""
  if unsupported(inputs, params, config) is not None or want_dbias:
    return triton_backward.backward(inputs, params, config.triton, lse2, d_out, delta,
                                    want_dbias)
  inputs, params, term2 = _core.without_row_term(inputs, params)
  lse2 = _core.lse_without_row_term(lse2, term2)
  t, h = inputs.query.shape[1], inputs.query.shape[3]
  s, h_v = inputs.key.shape[1], inputs.value.shape[3]
  args = kernel_args(inputs, params, config, lse2, d_out, delta)
  mode = _one_pass_mode(inputs, params, config.backward)
  if config.backward.splits_dkv(*_padded_dims(inputs)):  # dV, then dK: one accumulator each
    grads = _dkv(*args, grads=("dv",))
    if mode == "atomic":  # (the dK pass forms dQ too: `Backward.runs_one_pass`)
      grads.update(_dkv(*args, grads=("dk", "dq"), atomic=True))
      dq = grads["dq"][:, :t, :, :h]
    else:
      grads.update(_dkv(*args, grads=("dk",)))
      dq = _dq(*args)[:, :t, :, :h]
  elif mode is not None:
    grads = _dkv(*args, grads=("dk", "dv", "dq"), atomic=mode == "atomic")
    dq = grads["dq"][:, :t, :, :h]
  else:
    grads = _dkv(*args)
    dq = _dq(*args)[:, :t, :, :h]
  dk, dv = grads["dk"], grads["dv"]
  return dq, dk[:, :s, :, :h], dv[:, :s, :, :h_v], None
