"""Block masks: for each (batch row, head, query block), which key blocks hold a visible entry,
and which of those are *full* (every entry visible, so no element mask is evaluated or read).

A block table is int8 [B or 1, N or 1, query blocks, key blocks] of `EMPTY`, `PARTIAL` and
`FULL` (batch and head axes of size 1 broadcast). It is built on the device by jitted code,
whatever says which entries are visible:

- a `mask_mod` (`create_block_mask`): evaluated over every entry once, rows of blocks at a time,
  and reduced per block; its element mask is then what `jaxflash.mask_mod.Split` makes of it;
- a dense boolean ``mask=`` (`classify_dense`, or `jaxflash.dense_mask.pack` with the mask's
  packed words): one pass over the mask;
- segment ids (`classify_segments`): from each block's smallest and largest id, without
  looking at entries;
- a table of visible blocks (`BlockMask.from_blocks`): block-aligned patterns, all full.

The band (causal, windows), the lengths and the offsets are not in the table: every kernel
knows them as ranges. `jaxflash.schedule` intersects a table with them at the kernel's own block
sizes (`resample`), and turns the result into the lists of blocks each query block visits and,
transposed, each key block visits.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import _core
from jaxflash import mask_mod as mask_mod_lib

EMPTY, PARTIAL, FULL = 0, 1, 2

# The most entries of a mask_mod `classify_mask_mod` evaluates at once (booleans, plus the
# function's own temporaries of that shape).
CLASSIFY_ENTRIES = 1 << 24

# The finest block size of tables that jaxflash builds itself (dense masks, segment ids): every
# kernel tile is a multiple of it, so resampling to a kernel's tiles loses nothing.
CLASSIFY_BLOCK = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)  # (no field-wise ==/hash: its leaves are arrays)
class BlockMask:
  """Which blocks of the (query, key) plane hold visible entries, reusable across calls.

  Made by `jaxflash.create_block_mask` (from a ``mask_mod``) or `BlockMask.from_blocks` (from a
  table of visible blocks), and passed as ``flash_attention(..., block_mask=...)``. A pytree:
  it goes through `jax.jit`, shardings and `jax.vmap` like any argument, and is built on the
  device. Layers that share a mask share one BlockMask.

  Attributes:
    table: int8 [B or 1, N or 1, ceil(q_len / block_q), ceil(kv_len / block_k)]: `EMPTY`,
      `PARTIAL` or `FULL` per block.
    q_features, kv_features: the mask_mod's row and column features (int32 [F, B or 1, N or 1,
      q_len] and [F', ..., kv_len], see `jaxflash.mask_mod`), or None.
    split: the traced mask_mod (static; two masks of one function body are one static value,
      so a mask made again per batch reuses what jit compiled), or None for a table without
      one (every visible block is full).
    block_q, block_k, q_len, kv_len: the block sizes and the lengths it was made for (static).
    mask_consts: the arrays the mask_mod closes over where the kernels cannot run its rule
      (the XLA backend then evaluates it on them: a gather from a captured array at both
      indices), else empty.
  """

  table: jax.Array
  q_features: jax.Array | None
  kv_features: jax.Array | None
  split: mask_mod_lib.Split | None = dataclasses.field(metadata=dict(static=True))
  block_q: int = dataclasses.field(metadata=dict(static=True))
  block_k: int = dataclasses.field(metadata=dict(static=True))
  q_len: int = dataclasses.field(metadata=dict(static=True))
  kv_len: int = dataclasses.field(metadata=dict(static=True))
  mask_consts: tuple = ()

  @property
  def mask_mod(self) -> Callable | None:
    """The mask_mod it was made from (for `from_blocks`, the rule that reads its table's bits,
    named ``from_blocks``), or None for a table made without one."""
    return None if self.split is None else self.split.mask_mod

  @property
  def shape(self) -> tuple[int, int, int, int]:
    """(batch or 1, heads or 1, q_len, kv_len): the attention it masks."""
    return self.table.shape[:2] + (self.q_len, self.kv_len)

  def sparsity(self) -> jax.Array:
    """The fraction of blocks that are empty (skipped), over the table's batch rows and heads."""
    return jnp.mean(self.table == EMPTY)

  def to_dense(self) -> jax.Array:
    """Which blocks hold any visible entry: bool [B or 1, N or 1, query blocks, key blocks]
    (FlexAttention's ``BlockMask.to_dense``)."""
    return self.table != EMPTY

  def partition_spec(self, batch: str | tuple[str, ...] | None = None,
                     heads: str | tuple[str, ...] | None = None) -> "BlockMask":
    """This mask's leaves' `jax.sharding.PartitionSpec`s with its batch split over mesh axis
    ``batch`` and its heads over ``heads``: a BlockMask of specs, the mask's entry of
    `jax.shard_map`'s ``in_specs`` beside a query split the same way (each device then gets
    its rows' and heads' table and features), or its shardings through
    ``jax.tree.map(lambda p: NamedSharding(mesh, p), spec)``. The leaves do not share one
    batch axis (the table's is axis 0, the features' axis 1); an axis the mask broadcasts
    (size 1) is never split.

    Raises:
      ValueError: if the mask's rule reads the arrays it closes over at the batch row or head
        it is given (``mask_consts``: a gather only the XLA backend runs) and an axis it varies
        along is split: inside `jax.shard_map` those indices are the device's own, the arrays
        the whole call's.
    """
    P = jax.sharding.PartitionSpec
    b_axis = batch if self.table.shape[0] > 1 else None
    n_axis = heads if self.table.shape[1] > 1 else None
    if self.mask_consts and (b_axis is not None or n_axis is not None):
      raise ValueError(
          "this BlockMask's mask_mod runs on its captured arrays (mask_consts: a gather at both "
          "indices, which only the XLA backend evaluates) at the batch row and head it is "
          "given, so its batch or heads cannot be split: inside shard_map those would be the "
          "device's own indices. Make the mask inside the shard_map from the device's own "
          "arrays, or pass it (whole) to a call under jax.jit with sharded inputs")

    def features(x):
      return None if x is None else P(None, b_axis if x.shape[1] > 1 else None,
                                      n_axis if x.shape[2] > 1 else None, None)
    return dataclasses.replace(
        self, table=P(b_axis, n_axis, None, None), q_features=features(self.q_features),
        kv_features=features(self.kv_features), mask_consts=tuple(P() for _ in self.mask_consts))

  def __repr__(self) -> str:
    made = None if self.split is None else getattr(self.mask_mod, "__name__", "mask_mod")
    if not hasattr(self.table, "shape"):  # a tree of other leaves (`partition_spec`'s, in_axes)
      return (f"BlockMask(table={self.table!r}, q_features={self.q_features!r}, kv_features="
              f"{self.kv_features!r}, mask_consts={self.mask_consts!r}, mask_mod={made})")
    return (f"BlockMask(shape={self.shape}, block_size=({self.block_q}, {self.block_k}), "
            f"blocks={tuple(self.table.shape[2:])}, mask_mod={made})")

  @classmethod
  def from_blocks(cls, visible: jax.Array, q_len: int, kv_len: int,
                  block_size: int | tuple[int, int] = 128) -> "BlockMask":
    """A block mask from a table of visible blocks: bool [B or 1, N or 1, ceil(q_len /
    block_q), ceil(kv_len / block_k)] (or without the leading axes), every visible block full.
    For block-aligned patterns (block-sparse attention): kernels whose tiles divide the blocks
    evaluate no element mask at all.

    Kernels with coarser tiles see partial tiles, and evaluate the pattern per entry from each
    query block's row of the table packed into 32-bit words (`_block_rule`): the same mask at
    any tile size, and no T x S array."""
    for name, value in (("q_len", q_len), ("kv_len", kv_len)):
      if not _is_positive_int(value):
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    q_len, kv_len = int(q_len), int(kv_len)  # (a NumPy integer too: static fields print plain)
    block_q, block_k = _block_sizes(block_size)
    visible = jnp.asarray(visible)
    want = (-(-q_len // block_q), -(-kv_len // block_k))
    if visible.dtype != jnp.bool_ or visible.ndim not in (2, 3, 4) or visible.shape[-2:] != want:
      raise ValueError(f"visible must be a boolean block table ending in (query blocks, key "
                       f"blocks) = {want}, got {visible.dtype}{list(visible.shape)}")
    visible = visible.reshape((1,) * (4 - visible.ndim) + visible.shape)
    table = jnp.where(visible, FULL, EMPTY).astype(jnp.int8)
    split = mask_mod_lib.split(_block_rule(pack_bits(visible), block_q, block_k))
    b, n = visible.shape[:2]
    q_features = split.features(split.row_vars, b, n, q_len, mask_mod_lib.Q)
    kv_features = split.features(split.col_vars, b, n, kv_len, mask_mod_lib.KV)
    # (No mask_consts: the packed-bits rule is elementwise, so every backend runs it from the
    # features.)
    return cls(table, q_features, kv_features, split, block_q, block_k, q_len, kv_len)


def pack_bits(visible: jax.Array) -> jax.Array:
  """bool [B, N, rows, cols] -> int32 [B, N, rows, ceil(cols / 32)]: bit c % 32 of word c // 32
  is column c."""
  cols = visible.shape[-1]
  words = -(-cols // 32)
  bits = jnp.pad(visible, [(0, 0)] * 3 + [(0, words * 32 - cols)]).astype(jnp.uint32)
  bits = bits.reshape(visible.shape[:3] + (words, 32))
  # (The shifts at the bits' rank: strict rank promotion refuses to broadcast a vector.)
  shifts = jnp.arange(32, dtype=jnp.uint32).reshape((1,) * (bits.ndim - 1) + (32,))
  packed = jnp.sum(bits << shifts, axis=-1, dtype=jnp.uint32)
  return jax.lax.bitcast_convert_type(packed, jnp.int32)


def _block_rule(packed: jax.Array, block_q: int, block_k: int):
  """The mask_mod of a packed block table: the words of a query's row of blocks are row
  features, and picking the key's word and bit is elementwise (a select and a shift)."""
  words = packed.shape[-1]

  def rule(batch, head, q_idx, kv_idx):
    b = batch if packed.shape[0] > 1 else 0
    h = head if packed.shape[1] > 1 else 0
    row = packed[b, h, q_idx // block_q]
    column = kv_idx // block_k
    word = jnp.minimum(column // 32, words - 1)
    # A chain of two-way selects (Mosaic GPU lowers no select_n of more cases).
    chosen = row[..., words - 1]
    for w in range(words - 2, -1, -1):
      chosen = jnp.where(word == w, row[..., w], chosen)
    return jax.lax.shift_right_logical(chosen, column % 32) & 1 == 1

  rule.__name__ = "from_blocks"
  return rule


def and_masks(*mask_mods: Callable) -> Callable:
  """A mask_mod that lets an entry through where every one of ``mask_mods`` does
  (FlexAttention's ``and_masks``); with none, every entry is visible."""
  _check_mask_mods(mask_mods, "and_masks")

  def combined(batch, head, q_idx, kv_idx):
    visible = jnp.ones((), bool)
    for fn in mask_mods:
      visible = visible & fn(batch, head, q_idx, kv_idx)
    return visible
  combined.__name__ = _combined_name("and_masks", mask_mods)
  return combined


def or_masks(*mask_mods: Callable) -> Callable:
  """A mask_mod that lets an entry through where any of ``mask_mods`` does (FlexAttention's
  ``or_masks``); with none, no entry is visible."""
  _check_mask_mods(mask_mods, "or_masks")

  def combined(batch, head, q_idx, kv_idx):
    visible = jnp.zeros((), bool)
    for fn in mask_mods:
      visible = visible | fn(batch, head, q_idx, kv_idx)
    return visible
  combined.__name__ = _combined_name("or_masks", mask_mods)
  return combined


def _combined_name(name: str, mask_mods) -> str:
  return f"{name}({', '.join(getattr(fn, '__name__', 'mask_mod') for fn in mask_mods)})"


def _check_mask_mods(mask_mods, name: str) -> None:
  for i, fn in enumerate(mask_mods):
    if not callable(fn):
      raise ValueError(f"{name} takes mask_mod functions; argument {i} is {fn!r}")


def create_block_mask(mask_mod: Callable, batch: int | None, heads: int | None, q_len: int,
                      kv_len: int, *, block_size: int | tuple[int, int] = 128) -> BlockMask:
  """The block mask of ``mask_mod`` for attention of ``q_len`` queries to ``kv_len`` keys.

  ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` says whether query ``q_idx`` of batch row
  ``batch`` and query head ``head`` may attend to key ``kv_idx`` (FlexAttention's signature):
  jnp code on broadcasting int32 index arrays, which may close over arrays (document ids, a
  prefix length per row). It is evaluated on every entry once here, rows of blocks at a time, and
  never stored as a T x S array; the block mask keeps per block whether it is empty, partial or
  full, plus the per-row and per-key values the kernels need to evaluate the partial blocks
  (`jaxflash.mask_mod`).

  Args:
    mask_mod: the mask function.
    batch: the batch size, or None if the mask is the same for every batch row (it is then
      evaluated at batch index 0 only, as FlexAttention's ``B=None``: a mask_mod that reads
      the batch index needs the size).
    heads: the number of query heads, or None if the mask is the same for every head (then
      evaluated at head 0 only, likewise).
    q_len, kv_len: the query and key lengths of the calls it is for.
    block_size: the block size (or (query block, key block)); a multiple of 64 suits every
      kernel's tiles (finer tiles refine it exactly; coarser ones see partial blocks).

  Returns:
    A `BlockMask` for ``flash_attention(..., block_mask=...)``.

  Raises:
    ValueError: a bad size, or a ``mask_mod`` that is not a boolean function of four indices.
  """
  for name, value in (("q_len", q_len), ("kv_len", kv_len)):
    if not _is_positive_int(value):
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  for name, value in (("batch", batch), ("heads", heads)):
    if value is not None and not _is_positive_int(value):
      raise ValueError(f"{name} must be a positive int or None (the same mask for all), "
                       f"got {value!r}")
  q_len, kv_len = int(q_len), int(kv_len)  # (a NumPy integer too: static fields print plain)
  block_q, block_k = _block_sizes(block_size)
  split = mask_mod_lib.split(mask_mod)
  # (The captured arrays whole on every device under Explicit mesh axes: the function indexes
  # them with index grids of its own, which a batch-sharded array refused.)
  consts = tuple(_core.replicated(c) for c in split.closed.consts)
  made = _mask_mod_blocks_jitted(split, consts, batch, heads, q_len, kv_len, block_q, block_k)
  return BlockMask(*made, split, block_q, block_k, q_len, kv_len,
                   consts if split.kernel_reason is not None else ())


@functools.partial(jax.jit, static_argnums=(0, 2, 3, 4, 5, 6, 7))
def _mask_mod_blocks_jitted(split, consts, batch, heads, q_len, kv_len, block_q, block_k):
  """`mask_mod_blocks` compiled once per split structure and sizes, the captured arrays its
  arguments: a mask made again, eagerly (a call with ``mask_mod=``, which makes one each time),
  ran its classification op by op (0.2 s a call on a CPU, 2026-12-04)."""
  return mask_mod_blocks(split, batch, heads, q_len, kv_len, block_q, block_k, consts=consts)


def mask_mod_blocks(split, batch: int | None, heads: int | None, q_len: int, kv_len: int,
                    block_q: int, block_k: int, q_start=0, kv_start=0, consts=None):
  """``(table, q_features, kv_features)`` of a split mask_mod for ``q_len`` queries and
  ``kv_len`` keys from positions ``q_start`` and ``kv_start`` (ints or traced int32 scalars: a
  pair of ring attention's chunks): the table (`classify_mask_mod`) and, where the kernels can
  run its rule, its row and column features. Batch and head axes are 1 where the mask does
  not depend on them (or ``batch``/``heads`` is None). ``consts``: the arrays the function
  closes over (its own by default)."""
  b = batch if batch is not None and split.depends_on(mask_mod_lib.BATCH) else 1
  n = heads if heads is not None and split.depends_on(mask_mod_lib.HEAD) else 1
  table = classify_mask_mod(split, b, n, q_len, kv_len, block_q, block_k, q_start, kv_start,
                            consts)
  if split.kernel_reason is not None:
    return table, None, None
  return (table,
          split.features(split.row_vars, b, n, q_len, mask_mod_lib.Q, consts, start=q_start),
          split.features(split.col_vars, b, n, kv_len, mask_mod_lib.KV, consts, start=kv_start))


def classify_mask_mod(split, b: int, n: int, q_len: int, kv_len: int, block_q: int,
                      block_k: int, q_start=0, kv_start=0, consts=None) -> jax.Array:
  """The block table of a mask_mod: evaluated a few query blocks at a time (up to
  `CLASSIFY_ENTRIES` booleans at once), reduced to its blocks. ``q_start``/``kv_start`` (ints or
  traced int32 scalars): the positions of query 0 and key 0, for a table of part of a
  sequence (a pair of ring attention's chunks). ``consts`` as `mask_mod_blocks`."""
  nq, nk = -(-q_len // block_q), -(-kv_len // block_k)
  batch = jnp.arange(b, dtype=jnp.int32).reshape(b, 1, 1, 1)
  head = jnp.arange(n, dtype=jnp.int32).reshape(1, n, 1, 1)
  keys = jnp.arange(nk * block_k, dtype=jnp.int32).reshape(1, 1, 1, -1)
  q_start, kv_start = (jnp.asarray(x, jnp.int32) for x in (q_start, kv_start))

  def one_row_of_blocks(i):
    rows = (i * block_q + jnp.arange(block_q, dtype=jnp.int32)).reshape(1, 1, -1, 1)
    # Entries past the lengths are neither visible nor hidden: they never decide a block.
    real = jnp.logical_and(rows < q_len, keys < kv_len)
    # (Indices past the lengths are clamped into range for the function: it may index arrays.)
    visible = split.reference(batch, head, jnp.minimum(rows, q_len - 1) + q_start,
                              jnp.minimum(keys, kv_len - 1) + kv_start, consts=consts)
    visible = jnp.broadcast_to(visible, (b, n, block_q, nk * block_k))
    return _reduce_blocks(visible, real, block_q, block_k)[:, :, 0]

  # Several rows of blocks per step, up to `CLASSIFY_ENTRIES` booleans at once: one row of
  # 64 x 16k entries per step was a loop of 256 short steps (2.1 ms per 16k x 16k table on an
  # H200, 2026-11-25).
  per_step = max(1, min(nq, CLASSIFY_ENTRIES // (b * n * block_q * nk * block_k)))
  table = jax.lax.map(one_row_of_blocks, jnp.arange(nq, dtype=jnp.int32), batch_size=per_step)
  return jnp.moveaxis(table, 0, 2)


def _reduce_blocks(visible, real, block_q: int, block_k: int) -> jax.Array:
  """[..., rows, keys] booleans (and which entries are real) -> int8 [..., row blocks, key
  blocks]: `EMPTY` if no real entry is visible, `FULL` if every real one is, else `PARTIAL`."""
  real = jnp.broadcast_to(real, visible.shape)
  return _states(_count_blocks(jnp.logical_and(visible, real), block_q, block_k),
                 _count_blocks(real, block_q, block_k))


def _count_blocks(x, block_q: int, block_k: int) -> jax.Array:
  """How many entries of each block are set, int32 [..., row blocks, key blocks]: summed over
  each row's contiguous keys first, then over the rows (reducing both block axes at once of a
  [.., T, S] array reads it in strided order, several times slower on a GPU)."""
  rows, keys = x.shape[-2:]
  per_row = jnp.sum(x.reshape(x.shape[:-1] + (keys // block_k, block_k)), axis=-1,
                    dtype=jnp.int32)
  per_row = per_row.reshape(x.shape[:-2] + (rows // block_q, block_q, keys // block_k))
  return jnp.sum(per_row, axis=-2, dtype=jnp.int32)


def _states(visible_count, real_count) -> jax.Array:
  return jnp.where(visible_count == real_count, FULL,
                   jnp.where(visible_count > 0, PARTIAL, EMPTY)).astype(jnp.int8)


def classify_dense(mask: jax.Array, block: int = CLASSIFY_BLOCK) -> jax.Array:
  """The block table of a dense mask [B or 1, N or 1, T, S] (boolean, or int8 with nonzero =
  visible) at ``block`` x ``block``, in one pass over it (entries past T and S do not count)."""
  t, s = mask.shape[-2:]
  tp, sp = _round_up(t, block), _round_up(s, block)
  visible = mask != 0 if mask.dtype != jnp.bool_ else mask
  visible = jnp.pad(visible, [(0, 0), (0, 0), (0, tp - t), (0, sp - s)])
  return table_of_counts(_count_blocks(visible, block, block), t, s, block)


def table_of_counts(counts: jax.Array, t: int, s: int, block: int) -> jax.Array:
  """The block table of a T x S dense mask from each ``block`` x ``block`` block's visible
  entries, int32 [..., ceil(T / block), ceil(S / block)]: a block is full where every entry
  inside T x S (known from its position alone) is visible."""
  rows = jnp.minimum(t - jnp.arange(0, counts.shape[-2] * block, block), block)[:, None]
  keys = jnp.minimum(s - jnp.arange(0, counts.shape[-1] * block, block), block)[None, :]
  return _states(counts, jnp.broadcast_to(rows * keys, counts.shape))


def classify_segments(q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
                      block: int = CLASSIFY_BLOCK) -> jax.Array:
  """The block table [B, 1, T blocks, S blocks] of segment ids (a query sees keys of its own
  segment) from each block's smallest and largest id: a block whose query and key id ranges do
  not meet is empty, one where both hold a single, equal id is full. Exact for packed documents
  (sorted ids); for others it may call an empty block partial, never the reverse."""
  q_lo, q_hi = (x[:, :, None] for x in _block_range(q_segment_ids, block))  # [B, rows, 1]
  k_lo, k_hi = (x[:, None, :] for x in _block_range(kv_segment_ids, block))  # [B, 1, cols]
  meet = jnp.logical_and(q_lo <= k_hi, k_lo <= q_hi)
  full = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
  table = jnp.where(full, FULL, jnp.where(meet, PARTIAL, EMPTY)).astype(jnp.int8)
  return table[:, None]


def _block_range(ids, block: int):
  """Per block of ``block`` positions of int [B, L]: the smallest and largest id."""
  b, length = ids.shape
  lp = _round_up(length, block)
  big = jnp.iinfo(jnp.int32).max
  blocks = (b, lp // block, block)  # (not -1: B may be 0)
  lo = jnp.pad(ids, [(0, 0), (0, lp - length)], constant_values=big).reshape(blocks)
  hi = jnp.pad(ids, [(0, 0), (0, lp - length)], constant_values=-big).reshape(blocks)
  return lo.min(axis=-1), hi.max(axis=-1)


def intersect(a: jax.Array, b: jax.Array) -> jax.Array:
  """Two tables of one block size (broadcasting) as one: a block is empty where either is,
  full where both are, else partial."""
  return jnp.where(jnp.logical_or(a == EMPTY, b == EMPTY), EMPTY,
                   jnp.where(jnp.logical_and(a == FULL, b == FULL), FULL, PARTIAL)
                   ).astype(jnp.int8)


def resample(table: jax.Array, block: tuple[int, int], to: tuple[int, int],
             lengths: tuple[int, int]) -> jax.Array:
  """A table of ``block`` = (query, key) block sizes as one of ``to`` block sizes for
  ``lengths`` = (T, S): each new block is empty if every old block it overlaps is, full if every
  one is full, else partial. Exact when the sizes divide each other."""
  for axis, (old, new, length) in enumerate(zip(block, to, lengths)):
    table = _resample_axis(table, 2 + axis, old, new, length)
  return table


def _resample_axis(table, axis: int, old: int, new: int, length: int):
  if old == new:
    return table
  fine = math.gcd(old, new)
  count = -(-length // fine)  # fine blocks that cover the length
  table = jnp.repeat(table, old // fine, axis=axis)
  table = jax.lax.slice_in_dim(table, 0, min(count, table.shape[axis]), axis=axis)
  if table.shape[axis] < count:  # (a table made for a shorter length: the rest is empty)
    pad = [(0, 0)] * table.ndim
    pad[axis] = (0, count - table.shape[axis])
    table = jnp.pad(table, pad, constant_values=EMPTY)
  group = new // fine
  groups = -(-count // group)
  pad = [(0, 0)] * table.ndim
  # Fine blocks past the length only widen the last group: they count as neither.
  pad[axis] = (0, groups * group - count)
  lo = jnp.pad(table, pad, constant_values=FULL)
  hi = jnp.pad(table, pad, constant_values=EMPTY)
  shape = table.shape[:axis] + (groups, group) + table.shape[axis + 1:]
  all_full = jnp.all(lo.reshape(shape) == FULL, axis=axis + 1)
  any_visible = jnp.any(hi.reshape(shape) != EMPTY, axis=axis + 1)
  return jnp.where(all_full, FULL, jnp.where(any_visible, PARTIAL, EMPTY)).astype(jnp.int8)


def key_range(table: jax.Array, block_k: int, start: int, stop: int) -> jax.Array:
  """A table of ``block_k``-key blocks restricted to keys ``[start, stop)`` (static ints),
  with blocks of ``block_k`` keys from ``start``: a new block that straddles two old ones is
  empty if both are, full if both are, else partial (keys past ``stop`` may make it partial,
  never wrong)."""
  first, shift = divmod(start, block_k)
  count = -(-(stop - start) // block_k)
  pad = [(0, 0)] * (table.ndim - 1) + [(0, count + 1)]
  table = jnp.pad(table, pad, constant_values=EMPTY)  # (blocks past the old table: none)
  left = jax.lax.slice_in_dim(table, first, first + count, axis=-1)
  if not shift:
    return left
  right = jax.lax.slice_in_dim(table, first + 1, first + 1 + count, axis=-1)
  return jnp.where((left == FULL) & (right == FULL), FULL,
                   jnp.where((left == EMPTY) & (right == EMPTY), EMPTY, PARTIAL)).astype(jnp.int8)


def _block_sizes(block_size) -> tuple[int, int]:
  if _is_positive_int(block_size):
    return int(block_size), int(block_size)
  if (isinstance(block_size, (tuple, list)) and len(block_size) == 2
      and all(_is_positive_int(x) for x in block_size)):
    return int(block_size[0]), int(block_size[1])
  raise ValueError(f"block_size must be a positive int or a pair of them, got {block_size!r}")


def _is_positive_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x > 0


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple
