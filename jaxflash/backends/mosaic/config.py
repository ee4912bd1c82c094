"""Tiles and pipeline depth of the Mosaic GPU forward, and the rule that chooses them.

A CTA runs two (or, with ``Config.consumers``, three) consumer warpgroups, each owning
``block_q`` query rows (so a CTA covers ``consumers * block_q`` rows), and one producer
warpgroup that streams ``block_kv``-row tiles of K and V through a ring of ``num_stages``
shared-memory slots. ``backward`` holds the tiles of the Mosaic backward (`Backward`); the
calls it does not serve run the Triton backward with ``triton``.
"""

from __future__ import annotations

import dataclasses
import math

from jaxflash import fp8
from jaxflash.backends.triton import config as triton_config
from jaxflash.devices import kind_is, sm_count

# Shared memory a CTA of the backward's kernels may use on sm90 (227 KiB), less what Mosaic GPU
# adds to the tiles counted in `backward_smem_bytes`: 2 KiB of reduction scratch plus barriers
# and alignment (2.6 KiB in all, measured in the lowering's own check on the forward at D = 128
# with float32 O tiles, when it kept the scratch too).
SMEM_BUDGET = 227 * 1024 - 4096
# The same for the forward kernel, which asks for no reduction scratch (its row reductions stay
# within a row's four threads): barriers and alignment only (0.6 KiB measured for D = 128).
FORWARD_SMEM_BUDGET = 227 * 1024 - 2048


# Registers per thread that a consumer warpgroup of either kernel may ask for (two consumers and a
# producer share 504 of them; at 248 the producer would have fewer than the 24 it needs).
REGISTER_COUNTS = (232, 240)
# The same with three consumers (the forward's `Config.consumers`): 160 leaves the producer 24.
THREE_CONSUMER_REGISTERS = (152, 160)


def producer_registers(consumer_registers: int, consumers: int = 2) -> int:
  """The producer warpgroup's registers per thread: what the consumers leave of 504."""
  return 504 - consumers * consumer_registers


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backward:
  """Tiles of the Mosaic GPU backward (`backward.py`).

  Both kernels run two consumer warpgroups of 64 resident rows each and a producer that streams
  the other side through a ring: the dK/dV kernel keeps 64 keys per consumer and streams
  ``dkv_block_q`` query rows (Q, dO, LSE, delta) per step; the dQ kernel keeps 64 query rows per
  consumer and streams ``dq_block_kv`` keys (K, V) per step. Above head dim 128 (`splits_dkv`;
  ``split_dkv`` overrides it) the dK/dV kernel runs twice, for dV (with ``dv_block_q`` and
  ``dv_stages`` where set) and then for dK;
  at head dim 256 the resident tiles take 128 KiB, so the streamed tiles are 32 rows.

  With ``one_pass`` (head dims up to 128, where `dq_split` has a way for the tile) there is no dQ
  kernel: the dK/dV kernel also forms each query block's dQ part and adds it to a float32 dQ in
  a fixed order of key tiles, so the gradients stay deterministic. It is correct and bitwise
  repeatable on an H200 but slower, 0.70-0.77x cuDNN at D = 128 where the two kernels run
  0.93-1.06x (2026-11-22, docs/mosaic_backward.md "One pass"), so it is off by default.

  With ``atomic`` the same one-pass kernel serves calls that allow nondeterministic gradients
  (``flash_attention(..., deterministic=False)``, `Params.deterministic`): its dQ parts are
  added in whatever order the key tiles reach them, into a float32 dQ that starts at zero.
  Where dK/dV runs as two passes (head dims above 128) the dK pass forms dQ the same way, from
  transposed parts (`dq_split`). Calls it cannot serve (partial calls) take the deterministic
  kernels, and so do calls with fewer than ``atomic_min_rows`` query rows and the cells where it
  measured slower than them (`ATOMIC_TUNED`). ``atomic_registers`` (None: ``registers``) is its
  consumers' register count.

  With a causal band the tiles of one (batch row, head) cost more the more query rows (dK/dV)
  or keys (dQ) they see, and each kernel launches a head's tiles heaviest first. The grid runs
  head by head, so the heaviest tiles of the last heads start late and the kernel ends on them
  when there are few CTAs per SM (GQA 64/8 at 8k: 512 dK/dV CTAs on 132 SMs; a model of the
  launch puts the end 1.24x after an even share, 1.01x with the heaviest tiles of every head
  first). ``tile_major`` launches the tiles by cost across every (batch row, head) instead:
  each key (or query) tile rank of all of them, heaviest first. GQA calls with a causal band
  at D = 128 take it (`GQA_BACKWARD`, measured 6% faster at 8k on an H200).

  Under GQA each dK/dV CTA visits every query head of its K/V head's group, so the CTAs at work
  add into the dQ sums of many query heads at once (tile-major: all of them), more than the L2
  holds: the atomic one pass for Llama's 64/8 at 8k reads 2 TB/s from DRAM with a 62% L2 hit
  rate, MHA's 0.28 TB/s and 95% (ncu, H200, 2026-11-28). ``group_parts`` splits a group's query
  heads over that many CTAs per key tile (it must divide the group; otherwise, and with a block
  table, one), each summing dK and dV over its share into an output of its own that XLA adds
  up in float32 in a fixed order (K and V are the group's size smaller than Q, so this is
  cheap): twice the CTAs at half the work each, so a head-by-head launch keeps fewer query
  heads' sums live while its tail stays short. ``atomic_group_parts`` and ``atomic_tile_major``
  (None: ``group_parts``, ``tile_major``) are the atomic one pass's own: GQA with a causal band
  at D = 128 takes four parts head by head there and keeps one part tile-major in the
  deterministic kernels (`GQA_BACKWARD`; measured, H200 2026-11-28: the atomic one pass's L2
  hit rate 95% against 63%, 4-6% faster; the two kernels level)."""

  dkv_block_q: int = 64
  dkv_stages: int = 2
  dq_block_kv: int = 64
  dq_stages: int = 2
  # The dV pass's tiles where dK/dV runs as two passes (head dims above 128); None: the dK/dV
  # ones. It holds no V, so it has room for wider query tiles than the dK pass.
  dv_block_q: int | None = None
  dv_stages: int | None = None
  # Registers per consumer thread; the producer warpgroup gets the rest of the CTA's 504 (40 at
  # 232, 24 at 240).
  registers: int = 232
  # Whether dK/dV runs as two passes (dV, then dK); None: where the two accumulators, 64 x
  # (padded head dim + padded value head dim) float32 per consumer, are wider than 64 x 256
  # (`splits_dkv`).
  split_dkv: bool | None = None
  one_pass: bool = False
  atomic: bool = False
  atomic_min_rows: int = 0
  atomic_registers: int | None = None
  tile_major: bool = False
  group_parts: int = 1
  atomic_tile_major: bool | None = None
  atomic_group_parts: int | None = None
  # Whether the dK/dV kernel reads a query block's LSE rows from shared memory once its two
  # wgmmas are issued, not after waiting on them. Off: on an H200 (2026-11-28, D = 128 MHA) the
  # atomic one pass ran 1-4% slower with it, the two kernels level without a causal band and
  # 2-4% faster with one (one run); ptxas spills with it at D = 64 and in GQA's atomic pass
  # (docs/mosaic_backward.md, "The atomic one pass against cuDNN's backward kernel").
  early_rows: bool = False
  # Whether the dK/dV kernel, where it forms both dK and dV and no dQ (not in a split pass nor
  # the one pass with dQ), issues dPᵀ = V dOᵀ only once Pᵀ is formed, with dV += Pᵀ dO, and
  # forms dSᵀ from the 16-bit Pᵀ: Sᵀ and dPᵀ are then never both live in float32, nor Pᵀ
  # beside its 16-bit copy, which leaves room for wide accumulators (MLA's 64 x 320 on 64-row
  # query tiles). The consumer's softmax no longer runs under its own dPᵀ: D = 128 loses.
  serial_scores: bool = False
  # Whether the atomic one pass (parts of whole query rows: `dq_split`'s "cols" and "rows")
  # issues dV += Pᵀ dO, then, once both consumers' dSᵀ are stored, dQ's product, then dK += dSᵀ
  # Q, and sends the dQ part while dK's product runs, where it otherwise waits for all three
  # before the part's stores, fence, barrier and reduce-add (10-13% of the consumers' samples,
  # ncu, H200, D = 128, 16k). (Sending each part one visit late instead, its barrier and
  # reduce-add during the next visit's S and dPᵀ, ran level with the order before: the
  # `deferred_dq` of git 9db7d85, docs/mosaic_backward.md.)
  dq_before_dk: bool = False
  # Whether each key tile of the atomic one pass starts its run of full query blocks at its own
  # place in it (block ``k_tile mod blocks``, wrapping round) instead of the first: without a
  # causal band the key tiles at work on one head would otherwise reduce-add into the same dQ
  # block at the same time (a band staggers them already: each starts at its diagonal).
  stagger: bool = False
  # Whether the dK/dV kernel (dK and dV in one pass, without dQ) runs both consumers on one tile
  # of 64 keys in two roles: one forms Pᵀ and dV += Pᵀ dO and hands Pᵀ over in shared memory,
  # the other forms dPᵀ, dSᵀ and dK += dSᵀ Q (`backward._SharedKeyRoles`). Neither then holds
  # both accumulators, which at MLA's 192/128 are 64 x 320 float32 together. Calls with a soft
  # cap, a score_mod or dropout (whose dSᵀ needs more than Pᵀ and dPᵀ) and partial calls run the
  # usual layout.
  shared_keys: bool = False
  # With `shared_keys` (a ValueError without it): whether the role that forms dK issues each
  # visit's dK += dSᵀ Q with the next visit's dPᵀ, back to back, so that the tensor cores hold
  # both while the other role forms its softmax (`backward._SharedKeyRoles.overlapped_dscores`).
  # The same for the other role (dV += Pᵀ dO with the next Sᵀ) made MLA's dK/dV kernel 3-20%
  # slower on an H200 in two orders (2026-12-02, docs/mosaic_backward.md), so it has no field.
  shared_keys_overlap: bool = False

  def __post_init__(self):
    for name in ("dkv_block_q", "dq_block_kv", "dv_block_q"):
      value = getattr(self, name)
      if value is not None and value not in (32, 64, 128, 192, 256):
        raise ValueError(f"{name} must be 32, 64, 128, 192 or 256, got {value}")
    for name in ("dkv_stages", "dq_stages", "dv_stages"):
      value = getattr(self, name)
      if value is not None and value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    for name in ("registers", "atomic_registers"):
      value = getattr(self, name)
      if value is not None and value not in REGISTER_COUNTS:
        raise ValueError(f"{name} must be 232 or 240, got {value}")
    if self.shared_keys_overlap and not self.shared_keys:  # (it is a form of the two roles)
      raise ValueError("shared_keys_overlap needs shared_keys=True")
    parts = {"group_parts": self.group_parts}
    if self.atomic_group_parts is not None:  # (None: the atomic pass takes ``group_parts``)
      parts["atomic_group_parts"] = self.atomic_group_parts
    for name, value in parts.items():
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")

  def parts_of(self, groups: int) -> int:
    """CTAs per key tile that share a K/V head's ``groups`` query heads (`group_parts` where it
    divides them, else 1)."""
    return self.group_parts if groups % self.group_parts == 0 else 1

  def atomic_pass(self) -> Backward:
    """The tiles of the atomic one pass (its own register count, launch order and parts)."""
    def own(field):
      value = getattr(self, f"atomic_{field}")
      return getattr(self, field) if value is None else value
    return dataclasses.replace(self, registers=own("registers"), tile_major=own("tile_major"),
                               group_parts=own("group_parts"))

  def usual_layout(self, hp: int, hv: int, partial: bool = False) -> Backward:
    """These tiles without `shared_keys`, for the calls its roles cannot serve: on 64-row query
    tiles where theirs do not fit the usual layout's shared memory at padded head dims ``hp``
    and ``hv``."""
    usual = dataclasses.replace(self, shared_keys=False, shared_keys_overlap=False)
    if backward_smem_bytes(usual, hp, partial, value_dim=hv) > SMEM_BUDGET:
      usual = dataclasses.replace(usual, dkv_block_q=64)
    return usual

  def dv_pass(self) -> Backward:
    """The tiles of the dV pass (as ``dkv_block_q`` and ``dkv_stages``)."""
    return dataclasses.replace(
        self, dkv_block_q=self.dv_block_q or self.dkv_block_q,
        dkv_stages=self.dv_stages or self.dkv_stages, dv_block_q=None, dv_stages=None)

  @property
  def producer_registers(self) -> int:
    return producer_registers(self.registers)

  def splits_dkv(self, hp: int, hv: int | None = None) -> bool:
    """Whether dK/dV runs as two passes at padded head dims ``hp`` (Q and K) and ``hv`` (V;
    None: ``hp``)."""
    if self.split_dkv is not None:
      return self.split_dkv
    return hp + (hp if hv is None else hv) > 2 * SPLIT_HEAD_DIM

  def runs_one_pass(self, hp: int, deterministic: bool = True, hv: int | None = None) -> bool:
    """Whether dQ comes from the dK/dV kernel at padded head dims ``hp`` and ``hv`` (None:
    ``hp``), in a fixed order of key tiles (``deterministic``) or with unordered adds (a call
    that allows them). Where dK/dV runs as two passes (`splits_dkv`), the dK pass forms dQ
    too, with unordered adds only and on 32-row query tiles (`dq_split`'s ``"transposed"``)."""
    wanted = self.one_pass if deterministic else self.atomic or self.one_pass
    split = dq_split(self.dkv_block_q, hp)
    if not wanted or split is None or (deterministic and split == "transposed"):
      return False  # (transposed parts are added in no fixed order)
    if self.splits_dkv(hp, hv):
      return not deterministic and split == "transposed"
    return hp <= SPLIT_HEAD_DIM

  def one_pass_mode(self, hp: int, deterministic: bool, q_len: int,
                    hv: int | None = None) -> str | None:
    """``"atomic"`` (unordered dQ adds), ``"ordered"`` (dQ adds in a fixed order) or None (two
    kernels) for a call of ``q_len`` query rows at padded head dims ``hp`` and ``hv`` (None:
    ``hp``) that does or does not need ``deterministic`` gradients."""
    if (not deterministic and self.atomic and q_len >= self.atomic_min_rows
        and self.runs_one_pass(hp, deterministic=False, hv=hv)):
      return "atomic"
    return "ordered" if self.runs_one_pass(hp, hv=hv) else None


def dq_split(block_q: int, hp: int) -> str | None:
  """How the two consumers of the one-pass dK/dV kernel share a query block's dQ part (dS K over
  the CTA's 128 keys, ``block_q`` rows by ``hp`` columns): ``"cols"``, each all the rows and half
  the head dim (a wgmma's B is whole 64-column swizzled rows); ``"rows"``, each 64 of the 128 rows
  and every column; ``"transposed"``, for 32-row query tiles (below a wgmma's 64 rows), each
  consumer forms dQᵀ = Kᵀ dSᵀ for half the head dim, 64 of its columns at a time, and adds it
  into a transposed float32 dQ (the D = 256 dK pass, `Backward.runs_one_pass`). None where none
  fits."""
  if block_q == 64 and hp == 128:
    return "cols"
  if block_q == 128 and hp <= 128:
    return "rows"
  if block_q == 32 and hp % 128 == 0:
    return "transposed"
  return None


def dq_part_tiles(block_q: int, hp: int) -> tuple[int, tuple[int, int]]:
  """``(slots, shape)`` of the one-pass kernel's dQ parts (`dq_split`'s way): the visits whose
  dSᵀ tiles shared memory holds (two; one with ``"transposed"`` parts, where it is full), and
  the shape of one part of one consumer (a wgmma accumulator, staged in float32)."""
  split = dq_split(block_q, hp)
  if split == "transposed":  # (64 head-dim columns of dQᵀ by the block's rows)
    return 1, (64, block_q)
  return 2, (block_q, hp // 2) if split == "cols" else (64, hp)


def shared_key_p_slots(block_q: int) -> int:
  """The Pᵀ tiles in flight between `Backward.shared_keys`'s two roles: two, or one on 128-row
  query tiles (where two do not fit in shared memory beside the ring)."""
  return 2 if block_q <= 64 else 1


def dq_part_smem_bytes(block_q: int, hp: int) -> int:
  """Shared memory of the one-pass kernel's dQ parts: both consumers' 16-bit dSᵀ tiles (of 64
  keys) for `dq_part_tiles`'s slots, and their float32 staging tiles."""
  slots, (rows, cols) = dq_part_tiles(block_q, hp)
  return slots * 2 * 64 * block_q * 2 + 2 * rows * cols * 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Tiles of the Mosaic GPU forward, the Mosaic backward's (``backward``), and the Triton
  backward's (``triton``) for the calls the Mosaic one does not serve."""

  block_q: int = 64  # rows per consumer warpgroup (a wgmma M is 64)
  block_kv: int = 128
  # Consumer warpgroups per CTA, 2 or 3 (FlashAttention-3's three at D = 64). They take the
  # tensor cores in turn, so with three, two can run their softmax while one multiplies; each
  # then has at most 160 registers (``registers``), which holds smaller key tiles.
  consumers: int = 2
  num_stages: int = 2  # K/V ring depth
  # With a causal band, the CTAs whose rows see the most keys are launched first, so that the
  # short ones fill the tail of the grid instead of one long CTA running alone at the end.
  heavy_first: bool = True
  # A persistent grid of this many CTAs (the SM count), each running a share of the query tiles
  # (evenly by causal work, with a causal band): the K/V ring, the next tile's Q load and the
  # last tile's O store run on across tiles. None: one CTA per query tile.
  persistent_ctas: int | None = None
  # Q tiles per consumer on a persistent grid: with 2 the next item's Q loads into the other
  # buffer while this item runs (with 1 it loads after this item's last block, so short items
  # wait for it).
  q_buffers: int = 1
  # With a causal band on a persistent grid: CTAs take a head's query tiles in pairs (t,
  # q_tiles - 1 - t), whose key blocks add up alike, one pair after another along a head, so
  # that the CTAs running at once share a few heads' K and V in L2. (The heaviest-first rounds
  # run one tile of every head side by side: at 128 heads each CTA reads its own K and V.)
  paired_tiles: bool = False
  # A persistent CTA's O leaves through its Q tile's memory (`o_view`), as a one-item CTA's
  # does: the next item's Q then loads once O's stores have read the tile instead of during
  # them, and O needs no tiles of its own (32 KiB at MLA's 192/128 on 128-key tiles).
  o_through_q: bool = False
  # Without a causal band or window (both tiles of a pair then walk the same key blocks) and
  # without a block table: each pair of query tiles of one (batch row, head) runs as a cluster of
  # two CTAs, and every K/V tile comes from L2 once for both, TMA writing it into both CTAs'
  # shared memory (multicast; each CTA loads half of it), so L2 serves half the bytes.
  # FlashAttention-3 pairs its non-causal 16-bit CTAs this way at head dims from 128. A slot is
  # refilled once the consumers of both CTAs have freed it. Calls it cannot serve (a band, a
  # table, an odd number of query tiles) run unpaired; an odd persistent CTA count leaves one
  # CTA out.
  kv_multicast: bool = False
  # FlashAttention-3's intra-warpgroup overlap: step j issues block j's Q Kᵀ with block j-1's
  # P V and runs block j's softmax while that P V is in flight. It holds two P tiles and S in
  # registers next to O, so it needs smaller key tiles at large head dims.
  intra_wg_overlap: bool = False
  # Key columns of each block (a multiple of 8, from the first) whose exponentials the forward
  # computes by a polynomial on the FMA units (`forward.exp2_polynomial`) instead of the SM's
  # 16-a-clock exp units, which the softmax of an FP8 or a D = 64 block keeps as busy as the
  # tensor cores (FlashAttention-4 shares its exponentials out the same way). 0: all on the
  # exp units. No tuned config sets it: on an H200 (2026-11-28, benchmarks/fp8.py, FP8, D =
  # 128, 16k, 256-key tiles) 32, 64 and 96 columns ran 827, 798 and 743 TFLOP/s against 863
  # without a causal band, and 779, 748 and 720 against 773 with one: the polynomial's ten
  # FMA-pipe instructions per entry cost more than the exp units' wait they save there.
  exp2_poly_cols: int = 0
  # An FP8 call's softmax denominators summed on the tensor cores: each block's P times a
  # ones column (an N = 8 wgmma beside P V, into a [block_q, 8] accumulator that starts at zero
  # each block: an FP8 wgmma keeps few bits of a long sum), instead of a float32 add per entry;
  # the blocks' products add up in float32 in a [block_q, 8] tile, summed across once at the end.
  # 16-bit calls ignore it (there the extra wgmma cost more than the adds: docs/fp8.md).
  # `FP8_TUNED` turns it on at D = 128: 4-7% faster on an H200 (2026-11-29), and as accurate.
  mma_row_sums: bool = False
  # Registers per thread of each consumer warpgroup (the producer gets what is left of 504:
  # 40 at 232, 24 at 240). FlashAttention-3 gives its FP8 D = 256 consumers 240.
  registers: int = 232
  # The Mosaic backward's tiles; None runs the Triton backward (with ``triton``'s tiles), as do
  # calls the Mosaic backward does not serve (`backward.unsupported`).
  backward: Backward | None = Backward()
  triton: triton_config.Config = triton_config.Config()

  def __post_init__(self):
    if self.block_q != 64:
      raise ValueError(f"block_q must be 64 (one wgmma M per warpgroup), got {self.block_q}")
    if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
      raise ValueError(f"block_kv must be 64, 128, 192 or 256, got {self.block_kv}")
    if self.num_stages < 2:
      raise ValueError(f"num_stages must be at least 2, got {self.num_stages}")
    # (`TUNED`'s True, "one CTA per SM", is `default_config`'s to resolve: here it would be 1.)
    if self.persistent_ctas is not None and (isinstance(self.persistent_ctas, bool)
                                             or self.persistent_ctas < 1):
      raise ValueError(f"persistent_ctas must be None or a positive CTA count (e.g. the SM "
                       f"count), got {self.persistent_ctas!r}")
    if self.exp2_poly_cols % 8 or not 0 <= self.exp2_poly_cols <= self.block_kv:
      raise ValueError(f"exp2_poly_cols must be a multiple of 8 from 0 to block_kv "
                       f"({self.block_kv}), got {self.exp2_poly_cols}")
    if self.consumers not in (2, 3):
      raise ValueError(f"consumers must be 2 or 3, got {self.consumers}")
    counts = REGISTER_COUNTS if self.consumers == 2 else THREE_CONSUMER_REGISTERS
    if self.registers not in counts:
      raise ValueError(f"registers must be {counts[0]} or {counts[1]} with {self.consumers} "
                       f"consumers, got {self.registers}")
    if self.q_buffers not in (1, 2) or (self.q_buffers == 2 and self.persistent_ctas is None):
      raise ValueError("q_buffers must be 1, or 2 on a persistent grid (persistent_ctas), got "
                       f"{self.q_buffers}")
    if self.o_through_q and self.q_buffers != 1:
      raise ValueError("o_through_q needs q_buffers=1 (O leaves through the one Q tile before "
                       f"the next item's Q loads there), got q_buffers={self.q_buffers}")

  @property
  def producer_registers(self) -> int:
    return producer_registers(self.registers, self.consumers)

  @property
  def rows_per_cta(self) -> int:
    """Query rows of one CTA (one work item): ``block_q`` per consumer."""
    return self.consumers * self.block_q


def padded_head_dim(head_dim: int) -> int:
  """Head dims are padded to a multiple of 64: one 128-byte swizzled row of 16-bit elements."""
  return -(-head_dim // 64) * 64


def o_view(config: Config, hp: int, hvp: int, partial: bool = False,
           itemsize: int = 2, out_itemsize: int = 2) -> tuple[int, int] | None:
  """``(rows, cols)`` of the view through which a consumer's O [block_q, hvp] leaves by the
  memory of its Q tile [block_q, hp] (padded head dims): that tile's bytes as whole 8-row tiles
  of O's dtype, so that each consumer's view starts where its Q tile does. ``(block_q, hp)``
  where O is Q's width and dtype (the tile itself). Where V's head dim is below Q's (MLA's
  192/128) O is the first ``block_q`` rows of a ``(rows, hvp)`` view: this frees 32 KiB, which
  makes room for 128-key tiles (FlashAttention-3 reuses V's memory for O the same way). An FP8
  call's Q tile holds half (a float32 O: a quarter) of a row of O: its O leaves in
  ``hvp // cols`` pieces of ``cols`` columns, one after the other through a ``(block_q, cols)``
  view; at D = 256 this frees the 64 KiB that 128-key tiles need. None where O needs tiles of
  its own: a partial result (float32), a persistent CTA (its Q tile loads the next item
  meanwhile) unless ``config.o_through_q``, a V head dim above Q's, or one whose O rows or
  columns do not tile Q's bytes."""
  persistent = config.persistent_ctas is not None and not config.o_through_q
  if partial or persistent or hvp > hp:
    return None
  if itemsize != out_itemsize:  # (an FP8 call: O in column pieces)
    cols, rest = divmod(hp * itemsize, out_itemsize)
    return (config.block_q, cols) if not rest and cols % 16 == 0 and hvp % cols == 0 else None
  if hvp == hp:
    return config.block_q, hp
  rows, rest = divmod(config.block_q * hp, hvp)
  return (rows, hvp) if not rest and rows % 8 == 0 else None


def smem_bytes(config: Config, head_dim: int, partial: bool = False,
               value_dim: int | None = None, itemsize: int = 2) -> int:
  """Shared memory of one CTA: a Q tile per consumer and buffer, the K and V rings, the LSE
  rows (float32), and, where O cannot leave through the Q tiles' memory (`o_view`), an O tile
  of its own per consumer (float32 for a partial result). ``value_dim``: V's and O's head dim
  (None: ``head_dim``); ``itemsize`` 1: an FP8 call (and its factors per key)."""
  hp = padded_head_dim(head_dim)
  if itemsize == 1 and hp > 64:  # FP8 rows are whole 128-byte swizzled rows
    hp = -(-head_dim // 128) * 128
  hvp = hp if value_dim is None else padded_head_dim(value_dim)
  tiles = itemsize * (config.q_buffers * config.rows_per_cta * hp
                      + config.num_stages * config.block_kv * (hp + hvp))
  own_o = o_view(config, hp, hvp, partial, itemsize) is None
  o_bytes = 4 if partial else 2 if own_o else 0
  ones = 8 * config.block_kv if config.mma_row_sums and itemsize == 1 else 0
  # An FP8 call's factors per key (float32, a ring beside K's), counted whether or not the
  # call has them: the tiles are chosen from the dtype alone.
  key_factors = 4 * config.num_stages * config.block_kv if itemsize == 1 else 0
  return (tiles + 4 * config.rows_per_cta + o_bytes * config.rows_per_cta * hvp + ones
          + key_factors)


# Above this padded head dim the dK and dV accumulators (64 x D float32 each, per consumer) do not
# fit one warpgroup's registers together: dK/dV runs as two passes, dV then dK. With a value
# head dim of its own, where the two are wider than 2 x 128 columns together
# (`Backward.splits_dkv`).
SPLIT_HEAD_DIM = 128


def backward_smem_bytes(backward: Backward, head_dim: int, partial: bool = False,
                        deterministic: bool = True, value_dim: int | None = None) -> int:
  """Shared memory of the largest backward CTA: 64 resident rows of two 16-bit tiles per
  consumer (K and V, or Q and dO; a dV-only pass holds K alone, and a 16-bit dV tile of its own
  where V's head dim ``value_dim`` is not Q's), and the ring of the streamed side (Q and dO
  tiles with their float32 LSE and delta rows, or K and V tiles), and in the one-pass kernel
  the dSᵀ tiles and staged dQ parts. A ``partial`` call's float32 gradients go out through a
  float32 tile of 64 rows per consumer in every kernel."""
  hp = padded_head_dim(head_dim)
  hv = hp if value_dim is None else padded_head_dim(value_dim)
  tile = lambda d: 2 * 64 * d * 2  # noqa: E731  (one 16-bit 64-row tile per consumer)
  out32 = 2 * 64 * max(hp, hv) * 4 if partial else 0  # one float32 tile per consumer
  streamed = lambda block: block * 2 * (hp + hv)  # noqa: E731  (a Q and a dO, or K and V)
  dkv = tile(hp) + tile(hv) + out32 + backward.dkv_stages * (streamed(backward.dkv_block_q)
                                                             + backward.dkv_block_q * 2 * 4)
  if backward.runs_one_pass(hp, deterministic, hv):  # both consumers' dSᵀ, staged dQ parts
    dkv += dq_part_smem_bytes(backward.dkv_block_q, hp)
  elif backward.shared_keys and not backward.splits_dkv(hp, hv):
    # One K and one V tile, and the Pᵀ tiles (`backward._SharedKeyRoles`; one at 128 rows).
    dkv += (-(tile(hp) + tile(hv)) // 2
            + shared_key_p_slots(backward.dkv_block_q) * 64 * backward.dkv_block_q * 2)
  dq = tile(hp) + tile(hv) + out32 + backward.dq_stages * streamed(backward.dq_block_kv)
  dv = 0
  if backward.splits_dkv(hp, hv):
    dv_pass = backward.dv_pass()
    dv = (tile(hp) + (tile(hv) if hv != hp else 0) + out32
          + dv_pass.dkv_stages * (streamed(dv_pass.dkv_block_q) + dv_pass.dkv_block_q * 4))
  # Each kernel's zero for its resident tiles' index (`backward._opaque_zero`): a few bytes
  # that take a 1 KiB-aligned buffer of their own.
  return max(dkv, dq, dv) + 1024


def fits(config: Config, head_dim: int, partial: bool = False,
         value_dim: int | None = None, itemsize: int = 2) -> bool:
  return smem_bytes(config, head_dim, partial, value_dim, itemsize) <= FORWARD_SMEM_BUDGET


# Config fields by (padded head dim, causal) where the tuner (`bench.py --tune`, bf16, S = 1k, 4k
# and 16k, H200, 2026-11-21, benchmarks/results/mosaic_overlap_h200_2026-11-21) found better than
# the plain 128-key tile; ``persistent_ctas=True`` stands for one CTA per SM. Against cuDNN's
# forward in the same runs:
# - D = 128: the intra-warpgroup overlap everywhere, on a persistent grid without a causal band
#   (1k: 531 vs 487 TFLOP/s, 4k: 646 vs 626, 16k: 673 vs 624); one CTA per tile with one (even
#   with the causal work shared out evenly, persistent CTAs ran 531 vs 568 at 4k and 661 vs 686
#   at 16k; 347 vs 331 at 1k).
# - D = 256: the overlap on 64-key tiles (two P tiles, S and a 128-register O fit no wider tile):
#   4k 692 vs 672 and 623 vs 534 causal.
# - D = 64: 256-key tiles on a persistent grid without a causal band (1k 401 vs 371, 4k 459 vs
#   456); with one, 128-key tiles on a persistent grid whose CTAs share out the causal work
#   evenly (heaviest tiles first, odd rounds backwards; mosaic_balanced_h200_2026-11-21): 1k 271
#   vs 280, 2k 339 vs 345, 16k 453 vs 459, where one CTA per tile ran 254, 328 and 450 (the
#   overlap lost at D = 64 by 5-25%); and two Q buffers, so that the next tile's Q loads during
#   this one (in one run: 1k 261 → 295, 2k 332 → 347, 4k 391 → 402, 16k 461 → 454).
# - D = 192 with a value head dim of 128 (MLA), causal (2026-11-24, benchmarks/dev/
#   forward_tiles.py): 128-key tiles do not fit in shared memory beside O's own tiles; 64-key
#   tiles with the overlap ran 547 against 531 TFLOP/s without it at B = 1, 8k, 128 heads (552 at
#   B = 4, 4k, 16 heads); persistent CTAs 467. Since O leaves through the Q tiles' memory
#   (`o_view`, 2026-11-28) 128-key tiles fit, as FlashAttention-3 runs them: H200,
#   2026-11-28, same shape, 621 TFLOP/s with the overlap and 618 without, against 551 for the
#   64-key tiles with it (all within 2.1e-3 of float32); without a causal band 654 on 128-key
#   tiles, 648 with the overlap, 553 on 64-key tiles with it.
# - Paired tiles (`Config.paired_tiles`, H200, 2026-11-28 seventh session, forward_tiles.py,
#   each pair of variants interleaved twice in one process): at D = 64 causal on TUNED's
#   persistent grid 1k 326/329 against 313/311 (B = 16, 32 heads), 4k 431/433 against 424/406,
#   16k 452/457 against 434/435. The heaviest-first rounds put one tile of every (batch row,
#   head) side by side, and the CTAs at work read K and V of that many heads: at MLA's 128
#   heads on a persistent grid (with `o_through_q`) 515 against 632 paired. Paired, MLA's
#   192/128 ran 628-632 against 622-625 on one CTA per tile (within noise: not taken); D = 128
#   causal 593-601 against 622-625 at 16k, 596-610 against 591 at 4k (not taken).
# - K/V tiles shared by pairs of CTAs (`Config.kv_multicast`, no band; H200, 2026-12-01,
#   benchmarks/dev/forward_tiles.py, shipped tiles without and with it alternating twice in one
#   process, bf16): D = 128 B = 1 16k 598/601 against 621/624 TFLOP/s, GQA 64/8 8k 595/597
#   against 620/615 and 16k 601/605 against 633/631, GQA 32/8 B = 4 4k 598/586 against
#   602/620, MHA B = 4 4k 590/613 against 608/607, B = 16 1k 570/577 against 572/571; MLA's
#   192/128 8k 636/636 against 650/647. Level, so not taken: D = 256 4k (625 against 626-629),
#   D = 64 (three consumers 16k 497/495 against 498/496, 256-key tiles 1k 404/403 against
#   406/405) and FP8 (D = 128 949 against 949, D = 256 1145 against 1145). Along a causal band
#   (pairs whose rings carry the union of both tiles' blocks; dd0b2a9, reverted; H200,
#   2026-12-02) it ran slower: MLA's 192/128 8k 606 against 621, D = 128 B = 4 4k 570-576
#   against 605-610, GQA 64/8 8k 577-584 against 592-608, level at D = 128 16k and D = 256
#   (docs/mosaic.md), so it stays off with a band.
# - Two Q buffers at D = 128 without a band (the next item's Q loads while this one runs; they fit
#   beside 128-key tiles and O's own tiles since the forward stopped reserving Mosaic GPU's 2 KiB
#   of reduction scratch; H200, 2026-12-02, forward_tiles.py, persistent pairs sharing K/V
#   without and with them alternating three times in one process): B = 16 1k 571/557/573
#   against 591/586/585 TFLOP/s, GQA 64/8 8k 635/634 against 641/643, B = 4 4k 655/655/650
#   against 632/659/671, B = 1 16k 641/642/638 against 639/643/642 (level where items are long).
#   The same at D = 64 without a band (the 256-key persistent tiles, which the H200 runs below
#   2k rows; H200, 2026-12-03, forward_tiles.py, one Q buffer against two alternating twice in
#   one process, B = 16, 32 heads, 1k): 399.8/404.1 against 418.2/419.4 TFLOP/s. (The H100,
#   which runs these tiles at every length, has not measured it.)
TUNED: dict[tuple[int, bool], dict] = {
    (64, False): dict(block_kv=256, persistent_ctas=True, q_buffers=2),
    (64, True): dict(persistent_ctas=True, q_buffers=2, paired_tiles=True),
    (128, False): dict(intra_wg_overlap=True, persistent_ctas=True, kv_multicast=True,
                       q_buffers=2),
    (128, True): dict(intra_wg_overlap=True),
    (256, False): dict(block_kv=64, intra_wg_overlap=True),
    (256, True): dict(block_kv=64, intra_wg_overlap=True),
    (192, True): dict(block_kv=128, intra_wg_overlap=True),
    (192, False): dict(block_kv=128, kv_multicast=True),
}


# Three consumer warpgroups of 64 rows on 128-key tiles (`Config.consumers`, FlashAttention-3's
# D = 64 layout: while one consumer multiplies, two run their softmax), from these query
# lengths on: device kind -> {(padded head dim, causal): length}. Only where measured (the
# H100 has not run them). H200, 2026-11-29 (benchmarks/dev/forward_tiles.py,
# bf16, 32 heads, B · S = 16k, against `TUNED`'s tiles in the same process): without a causal
# band 1k 369 against 400 TFLOP/s (384-402 on persistent grids), 2k 456 against 437, 4k 492
# against 456, 16k 509 against 468; with one 1k 243 against 328 (192-row tiles waste more of
# the diagonal), 4k 415 against 435 (434 persistent and paired), 8k 471 against 444, 16k 475
# against 457. Not at D = 128 (O's 64 registers, S's and P's leave no room under 160), for FP8
# at D = 128 (128-key tiles: 948 against 957, causal 896 against 966) or MLA's 192/128 (64-key
# tiles, causal 8k: 587 against 623).
# H100 80GB HBM3, 2026-12-05 (the same probe and shape, two rounds, against the tiles it ran
# then): without a band 1k 363/369 against 410/408, 2k 454/458 against 434/437, 4k 484/481
# against 457/445, 16k 513/513 against 473/473; with one (against the paired persistent grid)
# 4k 411/404 against 434/424, 8k 477/459 against 449/464, 16k 468/472 against 459/454: the
# H200's lengths.
# The lengths are read at the most keys a query row sees where a local window bounds it
# (`default_config`'s ``window_keys``): gpt-oss's shape (16k, GQA 64/8, D = 64, causal, 128 keys
# back) took three consumers on both cards once they applied from 8k causal, and its forward ran
# 0.409 ms on an H100 (2026-12-06, model_features.json, cuDNN 0.397) against 0.256 on the
# paired persistent grid the day before (cuDNN 0.386): a walk of two or three key blocks does
# not fill three consumers' pipeline.
THREE_CONSUMERS = dict(consumers=3, registers=160, block_kv=128)
THREE_CONSUMERS_FROM_LENGTH: dict[str, dict[tuple[int, bool], int]] = {
    "H200": {(64, False): 2048, (64, True): 8192},
    "H100 80GB HBM3": {(64, False): 2048, (64, True): 8192}}


# The FP8 forward's config fields by (padded head dim, causal), measured as `TUNED` was, with
# benchmarks/fp8.py --configs (H200, 2026-11-24, B = 1, S = 16k, 2048 / D heads, e4m3 with one
# descale per head; the committed table is benchmarks/results/h200/fp8.json):
# - D = 128: 256-key tiles, 851 TFLOP/s (causal 796) where 128 ran 814 (757), 64 ran 691 (651);
#   the intra-warpgroup overlap and persistent CTAs measured within 2% of 128 or slower.
# - D = 256: 128-key tiles with the overlap and 240 consumer registers (FlashAttention-3's FP8
#   tile), since O leaves through the Q tiles in two column pieces (`o_view`) instead of a
#   64 KiB tile of its own, which left no room for them: H200, 2026-11-28, 1166 TFLOP/s (causal
#   1181) where 64-key tiles with the overlap ran 957 (1058), 128-key tiles without it 1145
#   (1130), and with it at 232 registers 836 (1026; ptxas spills 112 bytes and serialises the
#   wgmmas), against cuDNN's FP8 999 (919) in the same run. (2026-11-24: 64-key tiles with the
#   overlap 884, causal 879, without it 877 and 834.)
# - D = 128 gained nothing from the room: 256-key tiles in three stages 912 (866) against two
#   903 (873), 128-key ones with 240 registers 849 (866).
# - D = 128's row sums on the tensor cores (`Config.mma_row_sums`; H200, 2026-11-29, run
#   fp8_row_sums_2026-11-29): 938 (954) against 901 (891) at 16 heads, 957 (911) against 912
#   (865) at 64, the same error against the reference (2.3e-2); 128-key tiles with the overlap,
#   240 registers and the sums 856 (867).
# - With the sums (run fp8_sums_tiles_2026-11-29): a persistent grid 964 and 975 (16 and 64
#   heads) against 936 and 949 without a band, but 912 and 833 against 952 and 907 with one;
#   three stages 930/937 (902/894); 16 or 32 polynomial exp2 columns 927/937 and 901/918
#   (911/897, 866/864); 128-key tiles 869-885, with the overlap 831-867; 256-key tiles with the
#   overlap and 240 registers 769-798.
# - 192-key tiles (V's rows three 64-byte swizzled rows; run fp8_kv192_2026-11-29): 888/904
#   (16 heads, without and with a band) and 900/868 (64) with the sums, 818-871 with the
#   overlap and 240 registers (ptxas: 16 bytes of spills), 817-880 with both, against 256-key
#   tiles' 926/968 and 937/892 in the same process.
# - The sums kept as a [64, 8] tile across the blocks (their columns added once at the end,
#   no shuffles in the turn; now the only form, run fp8_sums_tile_2026-11-29): 967/925 (16
#   heads, without and with a band) and 975/905 (64) against 960/933 and 963/907 with the
#   turn's shuffles, within noise (with a band ptxas spills 36 bytes against 28 before).
#   The next block's Q Kᵀ issued in P V's turn (tried 2026-11-29, not kept): 128-key tiles
#   806/792 against 870-885 step by step; 256-key ones spill.
FP8_TUNED: dict[tuple[int, bool], dict] = {
    (128, False): dict(block_kv=256, mma_row_sums=True, persistent_ctas=True),
    (128, True): dict(block_kv=256, mma_row_sums=True),
    (256, False): dict(block_kv=128, intra_wg_overlap=True, registers=240),
    (256, True): dict(block_kv=128, intra_wg_overlap=True, registers=240),
}


# Backward tiles by padded head dim, from the tuner's "backward" family (`bench.py --tune
# --tune-families backward`, bf16, H200, 2026-11-22, benchmarks/results/mosaic_bwd_h200_2026-11-22,
# forward+backward against cuDNN's in the same run):
# - D = 64: 128-row query tiles in dK/dV and 128-key tiles in dQ (4k: 417 vs 424 TFLOP/s, causal
#   385 vs 368; 16k: 434 vs 446, causal 405 vs 430), where 64 and 64 ran 378/353 and 389/382.
# - D = 128: the 64/64 default (4k: 522 vs 529, causal 479 vs 464; 16k: 517 vs 550, causal 499
#   vs 523). Three dQ stages measured within noise of it (+3% at 4k, -1 to -2% at 16k); 128-row
#   query tiles spill there (0.77x cuDNN).
# - D = 256 (dK/dV in two passes; mosaic_bwd256_h200_2026-11-22): K and V (or Q and dO) take
#   128 KiB, so the dK pass and dQ stream 32-row tiles (64-byte swizzle); the dV pass, which holds
#   no V, 64-row ones; 240 consumer registers (ptxas: spills of 156 and 28 bytes; 280 and 76 at
#   232). 4k: 402 vs 406 TFLOP/s, causal 405 vs 372; 16k: 414 vs 407, causal 410 vs 413.
#   32-row tiles in every pass ran 386/380/402/399; one stage of 64-row tiles 283/279/284;
#   the Triton backward 139-151.
# The atomic one pass (deterministic=False) is turned on per cell by `ATOMIC_TUNED`.
# With a value head dim of its own, `BACKWARD_TUNED_VALUE_DIM` by (padded head dim, padded value
# head dim).
BACKWARD_TUNED: dict[int, Backward] = {
    64: Backward(dkv_block_q=128, dq_block_kv=128),
    128: Backward(),
    256: Backward(dkv_block_q=32, dq_block_kv=32, dv_block_q=64, registers=240),
}


# MLA's 192/128 (benchmarks/dev/backward_tiles.py, H200, 2026-11-24, B = 1, S = 8k, 128 heads,
# causal; backward TFLOP/s at 2·(3·192 + 2·128) FLOPs per visible entry, its time fwd+bwd − fwd):
# dK and dV in one pass on 32-row query tiles, 240 registers: 406 (232 registers: 403), where two
# passes (dV, then dK) on 64-row tiles ran 363 (240 registers 359, three dQ or dK/dV stages 358
# and 347, 32-row tiles 332), one pass on 64-row tiles 352 (its two 64 x 64 score tiles beside
# 64 x 320 float32 accumulators spill), and the Triton backward 97. Since 2026-11-28 (seventh
# session) the one pass runs on 64-row tiles with dPᵀ issued after Pᵀ (`serial_scores`; ptxas
# spills 196 bytes, no longer serialising the wgmmas): 430, 433, 428, 433 and 431 in three
# processes against 416, 412 and 411 for the 32-row tiles in two of them (32-row tiles with
# `serial_scores` 401, 64-row ones with three dK/dV stages 410, with the accumulators held
# across the steps 426 and 425). D = 128's dK/dV kernel lost with it (438 against 462).
# Since 2026-12-02 (twentieth session, same probe, shipped and new alternating twice in one
# process) both consumers share one 64-key tile in two roles on 128-row query tiles
# (`shared_keys`, `dkv_block_q=128`; no spills, where the 64-row tiles above spill 196 bytes):
# 439.0 and 439.9 against 431.7 and 431.5, the dK/dV kernel 9.82 and 10.00 ms against 10.07
# and 10.10; once shipped, 452.6 and 443.8 against 434.3 and 431.8 (437 against 422 in
# model_features.json, run mla_shared_keys_2026-12-02). On 64-row tiles the roles ran level (422.4, 429.5 against 434.1, 430.7), and at
# D = 128 both lost (16k causal 406 and 436 against 464-466, non-causal 443 against 483).
# Calls the roles cannot serve (a soft cap, a score_mod, dropout) run the tiles above
# (`Backward.usual_layout`: 64-row query tiles, dPᵀ after Pᵀ).
BACKWARD_TUNED_VALUE_DIM: dict[tuple[int, int], Backward] = {
    (192, 128): Backward(split_dkv=False, dkv_block_q=128, registers=240, serial_scores=True,
                         shared_keys=True, shared_keys_overlap=True),
}


# Backward fields over `BACKWARD_TUNED`'s for calls whose dQ tiles wait on loads besides K and
# V, by padded head dim: 128-key tiles give each wait twice the work to hide behind.
# - A block table (a mask_mod, a block mask, a dense mask, segment ids): the tiles' key blocks
#   come from a list in memory, in no order, so the K and V loads hit L2 less and wait behind
#   each list read. H200,
# 2026-11-25 (benchmarks/dev/backward_tiles.py --block-fraction 0.1, B = 1, 16k, 16 heads,
# kernel times from a profile, two runs): the dQ kernel 518 against 550-583 µs with 64-key
# tiles (three or four stages of 64: 548, 567); a causal band without a table, 2157 against
# 2155 (no change, so not worth a second rule there).
# - A score_mod's lookups per diagonal (a relative-position table): each tile loads its
#   diagonals once S is done (`forward.band_tiles`). H200, 2026-11-25 (benchmarks/dev/
#   score_parts.py relative --profile, B = 4, 4k, 16 heads, causal): the dQ kernel 680 against
#   798 µs with 64-key tiles, where the plain call's ran 622 against 601; forward+backward 1.11x
#   the plain call's, against 1.17x.
# Not in partial calls (ring attention with segment ids): their float32 dQ tile leaves no room
# for them in shared memory.
LOADS_BACKWARD: dict[int, dict] = {128: dict(dq_block_kv=128)}


# Backward fields over `BACKWARD_TUNED`'s for GQA and MQA calls (query heads sharing K/V heads),
# by (padded head dim, causal). Their dK/dV kernel streams each K/V head's whole group of query
# heads past one resident key block, and at D = 128 without a causal band it ran 15% faster
# with 240 consumer registers. H200, 2026-11-25 (benchmarks/dev/backward_tiles.py --kv-heads, B
# = 1, D = 128, 64 query heads; backward TFLOP/s, its time fwd+bwd - fwd, kernel times from a
# profile): GQA 64/8 at 16k 480 against 442 (the dK/dV kernel 26.8 against 31.4 ms; three dK/dV
# stages 448, 128-key dQ tiles 444), at 8k 485 against 441; MHA 64/64 at 16k ran 479 with 232
# and 465 with 240, so only shared K/V heads take them. With a causal band GQA ran the same
# with either (457 at 16k). The atomic one pass (deterministic=False) ran slower than the two
# kernels for them while it spilled (GQA 64/8: 487 and 490 TFLOP/s forward+backward against 515
# and 516 at 8k and 16k, grid.json gqa_2026-11-25), and was off for them until it stopped
# spilling; since then it ran 556 and 557 against 515 and 519 (atomic_zero_d128_2026-11-28).
# With a causal band they launch their tiles by cost across every batch row and head
# (`Backward.tile_major`): the dK/dV kernel's few CTAs per head (512 for GQA 64/8 at 8k, 132
# SMs) otherwise leave SMs idle at the end of the heaviest-first order. H200, 2026-11-28
# (benchmarks/dev/atomic_check.py, B = 1, 64/8, forward+backward TFLOP/s, same run as cuDNN's
# default): at 8k 485 against 458 (deterministic) and 481 against 456 (atomic one pass), cuDNN
# 493; at 16k 511 against 507 (atomic), cuDNN 529. MHA, with 8x the CTAs per K/V head to
# balance with, does not take it: its atomic one pass ran 496 against 491 at 4k (B = 4, 16
# heads) and 542 against 555 at 16k (B = 1), causal.
# The atomic one pass with a causal band splits each group over four CTAs per key tile, head by
# head (`Backward.group_parts`): fewer query heads' float32 dQ sums are live at once. H200,
# 2026-11-28 (benchmarks/dev/atomic_check.py, B = 1, 64/8, forward+backward TFLOP/s, two runs,
# same process as cuDNN's default): at 8k 511 (four parts) and 501-502 (two) against 490-493
# tile-major with one, cuDNN 494-497; at 16k 550 and 540-545 against 519-520, cuDNN 526-532.
# Tile-major with parts ran 508-510 and 531-536. ncu at 8k (the one-pass kernel alone): L2
# hit rate 94.9% and 0.25 TB/s from DRAM with two parts head by head, against 62.8% and 2.1
# TB/s. Without a causal band parts changed nothing (559-565 against 562-563), and the
# deterministic kernels with parts ran level or slower (tile-major: 493-496 against 492 at 8k,
# 503-516 against 515 at 16k; two parts head by head 476 against 490), so neither takes them.
# `Backward.stagger` (ATOMIC_TUNED's at D = 128 without a band) ran level or slower for GQA
# 64/8 (H200, 2026-11-29, atomic_check.py: 547 against 548 at 8k, 557 against 560 at 16k; the
# grid's run stagger_d128_2026-11-29 563 and 563 against 570 and 566 the day before), so GQA
# keeps the common start.
GQA_BACKWARD: dict[tuple[int, bool], dict] = {
    (128, False): dict(registers=240, stagger=False),
    (128, True): dict(tile_major=True, atomic_tile_major=False, atomic_group_parts=4)}


# Where calls with deterministic=False take the atomic one pass: (padded head dim, causal) ->
# `Backward` fields over `BACKWARD_TUNED`'s. H200, 2026-11-24 (benchmarks/results/h200/grid.json,
# runs atomic_, llama_ and atomic_d128_2026-11-24; benchmarks/dev/atomic_check.py), forward+
# backward TFLOP/s of the atomic one pass against the two kernels:
# - D = 64: 1.02-1.13x at 1k, 4k and 16k, causal and not (1k: 373 vs 355, causal 267 vs 261;
#   4k: 448 vs 411, 381 vs 353; 16k: 467 vs 431, 457 vs 403), 1.04-1.14x cuDNN's default.
# - D = 128 with the default 232 registers: 0.83-1.02x (ptxas spills 804 bytes, against 60 in
#   the dK/dV kernel and 316 in the one pass at D = 64). With 240 (720 bytes): without a causal
#   band 502 vs 495 at 4k, 517 vs 503 at 8k, 549 vs 515 and 533 vs 515 at 16k, GQA 64/8 at 16k
#   491 vs 486; with one 441 vs 471 at 4k, 477 vs 483 at 8k, 519 vs 501 and 509 vs 504 at 16k,
#   GQA 475 vs 502. So non-causal calls from 8k query rows only, until:
# - Since `backward._opaque_zero` (2026-11-28; ptxas: the D = 128 one pass spills nothing at 232
#   registers, D = 64's 16 bytes), H200, 2026-11-28 (grid.json, runs atomic_zero_*): D = 128
#   1.04-1.12x the two kernels from 4k (4k 525 vs 500, causal 497 vs 444; 16k 552 vs 514, 548
#   vs 502; GQA 64/8 at 8k and 16k 556 vs 515 and 557 vs 519, causal 462 vs 460 and 503 vs
#   498), 1.01x causal and 0.97x without a band at 1k (334 vs 332, 452 vs 465); D = 64
#   1.02-1.12x at every cell (1k 379 vs 370, 273 vs 259; 4k 457 vs 415, 401 vs 361; 16k 483
#   vs 431, 454 vs 409). 240 registers for the one pass ran within noise of 232 at GQA 64/8 8k
#   causal (465 vs 457; atomic_check.py). So every cell at D = 64 and 128.
# - 240 registers for the D = 128 one pass, H200, 2026-11-28 (atomic_check.py, same run as
#   cuDNN's default): 4k 540 vs 525 (cuDNN 527), 16k 557 vs 553 (555), GQA 64/8 16k causal 515
#   vs 507 (529), and 465 vs 457 at GQA 8k causal above: never slower, so the rule.
# - D = 256, once the dK pass formed dQ too (transposed parts, `dq_split`), H200, 2026-11-28
#   (grid.json run atomic_d256_2026-11-28, B = 16384 / S, 8 heads, same process as cuDNN's
#   default): 1k 371 vs 343 (cuDNN 317), 4k 430 vs 400 (411), causal 408 vs 381 (369), 16k 453
#   vs 417 (409), causal 452 vs 415 (415). At 1k with a causal band `atomic_check.py` ran it
#   at 270 against the deterministic kernels' 276: causal calls from 2048 rows.
# - `Backward.dq_before_dk` (dQ's part sent while dK's product runs), H200, 2026-11-28
#   (atomic_check.py, two processes, each beside cuDNN's default; the six odd shapes matched
#   the reference): D = 128 at 16k 571 and 562 against 558 and 553 (cuDNN 555, 548), causal 560
#   and 553 against 558 and 548 (530, 520); 4k 538 and 531 against 539 and 529 (520, 511),
#   causal 533 and 506 against 501 and 482 (440, 453); GQA 64/8 at 8k 566 and 562 against 562
#   and 557 (540, 534), 8k causal 515 against 507 (490), 16k causal 564 and 559 against 547 and
#   542 (533, 526). D = 64 level (4k 450 and 439 against 456 and 442; 16k causal 459 and 451
#   against 460 and 450), so D = 128 only. ptxas: no spills at D = 128 MHA, GQA's 16 bytes 20.
# - `Backward.stagger` (each key tile's full query blocks started at its own place; only calls
#   without a causal band have a common start), H200, 2026-11-29 (atomic_check.py, two
#   processes, 3 and 5 rounds, same process as cuDNN's default): D = 128 without a band 1k 431
#   against 423 (cuDNN 382), 4k 530 and 527 and 530 against 520, 519 and 514 (503, 495, 499),
#   8k 548 against 540 (528), 16k 553 against 552 (537); GQA 64/8 8k 547 against 548 (521),
#   16k 557 against 560 (545). D = 64 slower (4k 435 against 442, 16k 464 against 472). So
#   D = 128 without a band. ptxas: no spills for MHA; GQA 64/8 8 bytes stored, 16 loaded.
#   At D = 256 (its dK pass forms dQ; H200, 2026-11-29, fifteenth session, atomic_check.py,
#   3 rounds, the wide shapes matched the reference) it ran slower: 4k 404 against 415, 16k
#   436 against 439 (cuDNN 400, 401), so not there either.
ATOMIC_TUNED: dict[tuple[int, bool], dict] = {
    (64, False): dict(atomic=True),
    (64, True): dict(atomic=True),
    (128, False): dict(atomic=True, atomic_registers=240, dq_before_dk=True, stagger=True),
    (128, True): dict(atomic=True, atomic_registers=240, dq_before_dk=True),
    (256, False): dict(atomic=True),
    (256, True): dict(atomic=True, atomic_min_rows=2048),
}


# Where a device kind measured `TUNED`'s forward slower at short lengths: kind -> {(padded head
# dim, causal): the shortest query length from which `TUNED` applies}; shorter calls take one
# CTA per 128-key tile. No kind has an entry now. The H100's (D = 64 causal from 8k) came from
# 2026-11-24 (`bench.py --tune --head-dims 64 --causal y`: TUNED's persistent grid then, with
# two Q buffers and no pairs, against one CTA per tile: 4k 352 vs 399 TFLOP/s, 8k 456 vs 449,
# 16k 484 vs 454). Since the grid takes query tiles in pairs (`paired_tiles`, 2026-11-28) it won
# at every length (H100, 2026-12-05, `benchmarks/dev/forward_tiles.py --h 64 --dv 64 --heads 32`,
# B · S = 16k, two rounds, `kv128_persistent_q2_paired` against `kv128`): 1k 336/335 against
# 269/264, 2k 396/387 against 353/343, 4k 434/424 against 399/404, 8k 449/464 against 431/431,
# 16k 459/454 against 446/445 (cuDNN 1k 286-295, 2k 352-357 in the grid's runs).
TUNED_FROM_LENGTH: dict[str, dict[tuple[int, bool], int]] = {}


# Causal calls of at most this many query rows on one CTA per query tile launch their tiles in
# natural order instead of heaviest first. Forward TFLOP/s at S = 512, B = 32, 16 heads, D = 128
# (`bench.py --tune --seqs 512 --causal y`, 2026-11-25), natural against heaviest first: H200
# 244 vs 221 (cuDNN 241), H100 224 vs 201 (cuDNN 239) and in another run 236 vs 206 (cuDNN
# 231); at D = 64, one CTA per tile on the H100, 168 vs 160. Persistent grids keep their order
# (natural ran 164 against 224 at D = 64 on the H200), and from 1k heaviest first was the
# tuner's pick (`TUNED`).
NATURAL_ORDER_ROWS = 512


# Device kinds that no table names and that read another kind's entries: a GH200's GPU is the
# H100's die (132 SMs at the same clocks, HBM3 or HBM3e beside a Grace CPU), so it takes the
# H100 SXM's measured choices, the more conservative of the two measured cards (Triton keeps
# causal D = 64 below 512 keys). Not measured on a GH200. Other Hopper parts (H100 PCIe and
# NVL, H800, H20: other SM counts or power limits) have no stand-in: Triton serves them.
STAND_INS: dict[str, str] = {"GH200": "H100 80GB HBM3"}


def _for_kind(table: dict[str, dict], device_kind: str) -> dict | None:
  """``table``'s entry for ``device_kind`` (names matched as whole words), else its stand-in's
  (`STAND_INS`), or None."""
  for kind, entry in table.items():
    if kind_is(device_kind, kind):
      return entry
  for name, stand_in in STAND_INS.items():
    if kind_is(device_kind, name):
      return table.get(stand_in)
  return None


def _from_length(table: dict[str, dict], device_kind: str, hp: int, causal: bool,
                 default: float) -> float:
  """A length table's (`TUNED_FROM_LENGTH`, `THREE_CONSUMERS_FROM_LENGTH`) entry for this
  device kind and cell, else ``default``."""
  return (_for_kind(table, device_kind) or {}).get((hp, causal), default)


def _backward_tiles(hp: int, causal: bool, hv: int, waits_on_loads: bool,
                    partial: bool, groups: int = 1) -> Backward:
  if hv != hp:
    return BACKWARD_TUNED_VALUE_DIM.get((hp, hv), Backward())
  tiles = dataclasses.replace(BACKWARD_TUNED.get(hp, Backward()),
                              **ATOMIC_TUNED.get((hp, causal), {}))
  if groups > 1:
    tiles = dataclasses.replace(tiles, **GQA_BACKWARD.get((hp, causal), {}))
  if waits_on_loads:  # (a block table or lookups: `LOADS_BACKWARD`)
    # (Where they fit: a partial call's float32 dQ tile of its own leaves no room for 128-key
    # tiles, and the tuned ones beat the Triton backward that a misfit would get.)
    wider = dataclasses.replace(tiles, **LOADS_BACKWARD.get(hp, {}))
    if backward_smem_bytes(wider, hp, partial) <= SMEM_BUDGET:
      tiles = wider
  return tiles


def default_config(head_dim: int, dtype, causal: bool, q_len: int, device_kind: str,
                   partial: bool = False, value_dim: int | None = None,
                   block_table: bool = False, groups: int = 1,
                   lookups: bool = False, sms: int | None = None,
                   window_keys: int | None = None) -> Config | None:
  """`TUNED`'s config (persistent on this device's SM count: ``sms``, else the kind's; with one
  Q tile per consumer where its two do not fit), else it on one CTA per tile, else the 128-key
  tile, else the 64-key one, whichever first fits in shared memory (a float32 partial result,
  or a value head dim ``value_dim`` unlike ``head_dim``, needs O tiles of its own); None if
  none fits (partial results at D = 256). Causal CTAs are launched heaviest first, but for
  short calls on one CTA per tile (`NATURAL_ORDER_ROWS`). ``block_table``: the call walks a
  block table, ``lookups``: its score_mod reads values per diagonal (both `LOADS_BACKWARD`);
  ``groups``: query heads per K/V head (`GQA_BACKWARD` above 1). ``window_keys``: the most keys
  a query row sees under a local window (None: no bound), which caps the length that
  `THREE_CONSUMERS_FROM_LENGTH` is read at."""
  # (The Triton backward's tiles for the wider of the two head dims: it serves Dv != H.)
  backward = triton_config.default_config(max(head_dim, value_dim or 0), dtype, causal, q_len,
                                          device_kind)
  hp = padded_head_dim(head_dim)
  tuned = TUNED.get((hp, causal))
  if q_len < _from_length(TUNED_FROM_LENGTH, device_kind, hp, causal, 0):
    tuned = None
  # (Three consumers pay off on long walks over the keys; a narrow window makes every walk a
  # few blocks long however long the call: `THREE_CONSUMERS_FROM_LENGTH`'s note.)
  walk = q_len if window_keys is None else min(q_len, window_keys)
  if walk >= _from_length(THREE_CONSUMERS_FROM_LENGTH, device_kind, hp, causal, math.inf):
    tuned = THREE_CONSUMERS
  candidates = [dict(block_kv=128), dict(block_kv=64)]
  if fp8.is_fp8(dtype):  # (no backward: an FP8 call has no gradient)
    tuned = FP8_TUNED.get((hp, causal))
  if tuned:
    candidates.insert(0, dict(tuned, persistent_ctas=None, q_buffers=1))
    if tuned.get("persistent_ctas"):
      persistent = dict(tuned, persistent_ctas=sm_count(device_kind, sms))
      candidates[:0] = [persistent, dict(persistent, q_buffers=1)]  # (the second Q if it fits)
  mosaic_backward = _backward_tiles(hp, causal, padded_head_dim(value_dim or head_dim),
                                    block_table or lookups, partial, groups)
  for fields in candidates:
    if causal and q_len <= NATURAL_ORDER_ROWS and not fields.get("persistent_ctas"):
      fields = dict(fields, heavy_first=False)
    config = Config(triton=backward, backward=mosaic_backward, **fields)
    if fits(config, head_dim, partial, value_dim, 1 if fp8.is_fp8(dtype) else 2):
      return config
  return None


# Where the Mosaic forward measured faster than the Triton one: device kind -> {(padded head dim,
# causal): the shortest key length from which it won every measured length}. ``implementation=
# None`` picks it only there, and `jaxflash.backends` falls through to Triton elsewhere. bf16
# forward, Mosaic, Triton and cuDNN in one run per card (`bench.py --impls jaxflash_mosaic
# jaxflash_triton cudnn --modes fwd`, S = 512 ... 16k):
# - H200, 2026-11-21 (benchmarks/results/mosaic_balanced_h200_2026-11-21): Mosaic ahead in every
#   cell, 1.0-1.3x Triton at D = 64 (198 vs 193 at 512 causal), 1.4-1.8x at D = 128, 2.2-3.4x at
#   D = 256.
# - H100 80GB HBM3, 2026-11-22 UTC (mosaic_h100_2026-11-22): ahead without a causal band at every
#   length and head dim; with one, Triton stays ahead at D = 64 up to 2k keys (1k: 230 vs 257)
#   and at D = 128 up to 1k (1k: 204 vs 272, a cell that ran at 382 on the H200 and may be an
#   outlier; GQA 32/8 at 1k ran 396 vs 300).
# - H100 80GB HBM3, 2026-11-24 (benchmarks/results/h100/grid.json, fwd_fwdbwd_2026-11-24, before
#   `TUNED_FROM_LENGTH`): the D = 128 causal forward ran 374 on Mosaic against Triton's 274 at
#   1k (cuDNN 329) and 593 against 369 at 4k, so the 2026-11-22 cell was an outlier: Mosaic
#   serves D = 128 at every length. At D = 64 causal Triton stays ahead at 1k (272 vs 252 with
#   TUNED's grid, 255 with one CTA per tile), Mosaic from 4k (365 vs 327).
# - H100 80GB HBM3, 2026-11-24, after `TUNED_FROM_LENGTH` (`bench.py --tune --head-dims 64
#   --causal y --seqs 1024 2048`): at D = 64 causal, one CTA per 128-key tile ran 334 against
#   Triton's best 301 at 2k (cuDNN 347) and 251 against 252 at 1k (cuDNN 276): Mosaic from 2k.
# - H100 80GB HBM3, 2026-12-05 (benchmarks/results/h100/grid.json, `d64_causal_fwd_2026-12-05`:
#   `bench.py --impls jaxflash_mosaic jaxflash_triton cudnn --head-dims 64 --seqs 512 ... 16384
#   --causal y --modes fwd --no-gqa`), once `TUNED_FROM_LENGTH` let the paired persistent grid
#   serve short causal calls: Mosaic 256, 336, 398 TFLOP/s at 512, 1k, 2k against Triton's 210,
#   270, 315 (cuDNN 216, 302, 362), so Mosaic from 512 keys (shorter ones were not measured).
# - H100 80GB HBM3, 2026-12-05 (benchmarks/results/h100/value_dims.json, `benchmarks/dev/
#   value_dim_choice.py --dims 192/192`): at D = 192 Mosaic ran 3.1-4.0x Triton, forward and
#   forward+backward, causal or not, B x S x N = 4 x 4k x 16 and 16 x 1k x 16 (4k causal
#   forward 595 against 171 TFLOP/s).
# - H200, 2026-12-06 (benchmarks/results/h200/value_dims.json, the same command): at D = 192
#   Mosaic ran 3.1-4.1x Triton in the same cells (4k causal forward 598 against 169), which
#   confirmed the D = 192 entries first inferred from the H100's run.
# Not measured on other Hopper parts (H100 PCIe, H20, GH200): Triton serves them, but for a
# GH200, which reads the H100's entries (`STAND_INS`).
FASTER_THAN_TRITON: dict[str, dict[tuple[int, bool], int]] = {
    "H200": {(64, False): 0, (64, True): 0, (128, False): 0, (128, True): 0,
             (192, False): 0, (192, True): 0, (256, False): 0, (256, True): 0},
    "H100 80GB HBM3": {(64, False): 0, (64, True): 512, (128, False): 0, (128, True): 0,
                       (192, False): 0, (192, True): 0, (256, False): 0, (256, True): 0}}


# The same with a value head dim of its own: device kind -> {(padded head dim, padded value head
# dim, causal): the shortest key length from which it won}. The Mosaic forward's V and O tiles
# take Dv; its backward hands such calls to the Triton backward either way.
# - H200, 2026-11-24 (benchmarks/results/h200/model_features.json, mla_192_128): MLA's 192/128,
#   causal, B = 1, 128 heads at 8k: 535 against Triton's 168 TFLOP/s forward (fwd+bwd 79 vs
#   91 ms, both on the Triton backward then); 16 heads at 4k: 0.21 against 0.63 ms.
# - H200, 2026-11-24, once the Mosaic backward served it (benchmarks/dev/backward_tiles.py,
#   128 heads): fwd+bwd 1.85 against 5.54 ms with the Triton backward at 2k causal, 46.9
#   against 147.5 ms at 8k without a causal band. The forward alone was not measured against
#   Triton's below 4k; for training the backward decides.
# - H100 80GB HBM3, 2026-12-05 (benchmarks/results/h100/value_dims.json, `benchmarks/dev/
#   value_dim_choice.py`): 192/128 ran 3.2-4.5x Triton, forward and forward+backward, causal
#   or not, at 1 x 8k x 128, 4 x 4k x 16 and 16 x 1k x 16 (B x S x N; 8k causal forward 646
#   against 170 TFLOP/s; without this entry such calls had run Triton's kernels on an H100).
#   128/64 ran 1.25-1.42x Triton everywhere; 96/64 (padded the same) 1.04-1.38x
#   forward+backward everywhere, but its forward alone trailed at 1k (causal 177 against 201,
#   non-causal 290 against 315): forward+backward decides, as above.
# - H200, 2026-12-06 (benchmarks/results/h200/value_dims.json): 128/64 ran 1.25-1.46x Triton,
#   forward and forward+backward, causal or not, at 4 x 4k x 16 and 16 x 1k x 16, which
#   confirmed the (128, 64) entries first inferred from the H100's run.
FASTER_THAN_TRITON_VALUE_DIM: dict[str, dict[tuple[int, int, bool], int]] = {
    "H200": {(192, 128, True): 0, (192, 128, False): 0, (128, 64, True): 0, (128, 64, False): 0},
    "H100 80GB HBM3": {(192, 128, True): 0, (192, 128, False): 0, (128, 64, True): 0,
                       (128, 64, False): 0}}


def faster_than_triton(device_kind: str, head_dim: int, kv_len: int, causal: bool,
                       value_dim: int | None = None) -> bool:
  """Whether the Mosaic forward measured faster than Triton's on this device kind, head dims,
  band and key length (`FASTER_THAN_TRITON`, `FASTER_THAN_TRITON_VALUE_DIM`)."""
  own_value_dim = value_dim is not None and value_dim != head_dim
  table = FASTER_THAN_TRITON_VALUE_DIM if own_value_dim else FASTER_THAN_TRITON
  key = (padded_head_dim(head_dim),) + ((padded_head_dim(value_dim),) if own_value_dim else ())
  least = (_for_kind(table, device_kind) or {}).get(key + (causal,))
  return least is not None and kv_len >= least
