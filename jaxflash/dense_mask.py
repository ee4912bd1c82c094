"""A dense boolean mask [B or 1, N or 1, T, S] in the forms the kernels read (`pack`):

- packed along the keys, 32 entries to an int32 word, word-major: [B or 1, N or 1, ceil(S / 32),
  T], bit k of word w of query t being entry (t, 32 w + k). A kernel whose tiles are [queries,
  keys] loads one word of its rows per 32 columns as a vector (`backends.mosaic.forward`);
- packed along the queries: [B or 1, N or 1, ceil(T / 32), S], bit k of word w of key s being
  entry (32 w + k, s), for the dK/dV kernel, whose tiles are [keys, queries];
- its block table at `jaxflash.block_mask.CLASSIFY_BLOCK` (`jaxflash.block_mask.classify_dense`).

Why kernels of our own: Mosaic GPU loads no 1-bit elements and `jax.lax` bitcasts no bool, so
the attention kernels would read either a byte per entry (an int8 copy of the mask: 42 µs for a
4 x 4k x 4k mask on an H200, and 47 µs more for the backward's transposed copy) or these words,
which XLA packs slowly (a reduction over 32 minor elements, and a transpose first along the
queries: 250 µs for both at that size). Pallas' Triton lowering loads a boolean ref as bytes,
so on a GPU two Triton kernels read the mask (27 µs each at that size): one writes the words
along the keys and the block counts, the other the words along the queries, which only a
backward reads (under jit a forward alone drops it). Elsewhere XLA computes the same
(`lax.platform_dependent` picks by the platform the call is lowered for). Measured variants:
docs/block_sparse.md.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxflash import block_mask as block_mask_lib

__all__ = ["Packed", "pack", "pack_local"]

_BLOCK = block_mask_lib.CLASSIFY_BLOCK
# A Triton program's tile of the mask: 2 x 2 blocks, 4 words of every row and of every column
# (64 x 256 tiles, 8 warps and loops over column tiles measured slower).
_TILE_ROWS, _TILE_COLS = 2 * _BLOCK, 2 * _BLOCK


class Packed(NamedTuple):
  """`pack`'s result (see the module docstring for the layouts)."""

  by_keys: jax.Array | None  # int32 [B or 1, N or 1, ceil(S / 32), T] (None: see `pack`)
  by_queries: jax.Array | None  # int32 [B or 1, N or 1, ceil(T / 32), S]
  table: jax.Array  # int8 [B or 1, N or 1, ceil(T / CLASSIFY_BLOCK), ceil(S / CLASSIFY_BLOCK)]


def pack(mask: jax.Array) -> Packed:
  """The words and block table of a dense mask [B or 1, N or 1, T, S] (boolean, or nonzero =
  visible): on a GPU, the words along the keys and the table from one read of the mask, the
  words along the queries from another (which jit drops where nothing reads them).

  Where the mask may be split over devices in a way a kernel call here cannot follow (jit with
  `Auto` axes on several devices, or `Explicit` axes that split T or S), only the table is
  made (by XLA's ops, which partition) and the words are None: the Mosaic kernels' launchers,
  which run on each device's share, pack what they read there (`pack_local`)."""
  visible = mask if mask.dtype == jnp.bool_ else mask != 0
  mesh = jax.sharding.get_abstract_mesh()
  types = () if mesh.empty else tuple(mesh.axis_types)

  def table_only():  # (made where returned: an eager call on one device classified it twice)
    return Packed(None, None, block_mask_lib.classify_dense(visible, _BLOCK))

  if types and all(t == AxisType.Manual for t in types):
    return pack_local(visible)  # (inside shard_map: this device's share)
  if AxisType.Explicit in types:
    spec = jax.typeof(visible).sharding.spec
    spec = tuple(spec) + (None,) * (4 - len(spec))
    if spec[2] is None and spec[3] is None:  # batch and heads split: each device packs its own
      axes = frozenset(a for e in spec[:2] if e is not None
                       for a in ((e,) if isinstance(e, str) else e))
      share = P(*spec)
      return jax.shard_map(pack_local, mesh=mesh, in_specs=share,
                           out_specs=Packed(share, share, share), axis_names=axes,
                           check_vma=False)(visible)
    return table_only()
  if jax.device_count() > 1:
    # Under jit with Auto axes the mask may be sharded, and XLA's partitioner cannot split a
    # Pallas call (it would gather the mask to every device).
    return table_only()
  return pack_local(visible)


def pack_local(mask: jax.Array) -> Packed:
  """`pack` of a mask wholly on this device (inside ``shard_map``, a partitioned kernel call,
  or one device): Triton kernels where lowered for a GPU, XLA's ops elsewhere."""
  visible = mask if mask.dtype == jnp.bool_ else mask != 0
  return Packed(*lax.platform_dependent(visible, cuda=_pack_with_triton,
                                        default=_pack_with_xla))


def _pack_with_xla(visible: jax.Array):
  """`pack` by XLA's ops: bits shifted and summed along the keys, and (transposed first) along
  the queries."""
  by_queries = block_mask_lib.pack_bits(jnp.swapaxes(visible, 2, 3))
  return (jnp.swapaxes(block_mask_lib.pack_bits(visible), 2, 3),
          jnp.swapaxes(by_queries, 2, 3), block_mask_lib.classify_dense(visible, _BLOCK))


def _byte_weights(entries: int) -> jax.Array:
  """int8 [entries / 8, entries]: row n holds the weights of entries 8n..8n+7, 1, 2, ..., 64
  and -128. An int8 matmul of it with bits gives each byte of bits as a value in [-128, 127],
  which ``& 255`` makes the unsigned byte (bit 7's -128 is 128 modulo 256)."""
  byte = jnp.arange(entries // 8)[:, None]
  entry = jnp.arange(entries)[None, :]
  weight = jnp.where(entry % 8 == 7, -128, 1 << (entry % 8))
  return jnp.where(entry // 8 == byte, weight, 0).astype(jnp.int8)


def _pack_with_triton(visible: jax.Array, *, interpret: bool = False):
  """`pack` as two Triton kernels (``interpret``: run by the Pallas interpreter, for tests):
  the words along the keys with the block counts, which the forward reads, and the words along
  the queries, which only the backward reads, so that a forward alone (under jit, which drops
  unused results) reads the mask once and writes one eighth of it."""
  bm, nm, t, s = visible.shape
  flat = visible.reshape(bm * nm, t, s)  # (a grid has at most three axes)
  key_words, query_words = -(-s // 32), -(-t // 32)
  row_blocks, col_blocks = -(-t // _BLOCK), -(-s // _BLOCK)
  rows, cols = _TILE_ROWS, _TILE_COLS
  grid = (bm * nm, pl.cdiv(t, rows), pl.cdiv(s, cols))
  tiles = pl.BlockSpec((None, rows, cols), lambda g, i, j: (g, i, j))
  params = plgpu.CompilerParams(num_warps=4, num_stages=1)
  by_keys, counts = pl.pallas_call(
      functools.partial(_keys_kernel, t=t, s=s),
      grid=grid,
      in_specs=[tiles],
      out_specs=[
          pl.BlockSpec((None, cols // 32, rows), lambda g, i, j: (g, j, i)),
          pl.BlockSpec((None, rows // _BLOCK, cols // _BLOCK), lambda g, i, j: (g, i, j)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((bm * nm, key_words, t), jnp.int32),
          jax.ShapeDtypeStruct((bm * nm, row_blocks, col_blocks), jnp.int32),
      ],
      compiler_params=params, interpret=interpret, name="jaxflash_pack_mask_keys",
  )(flat)
  by_queries = pl.pallas_call(
      functools.partial(_queries_kernel, t=t, s=s),
      grid=grid,
      in_specs=[tiles, pl.BlockSpec((rows // 8, rows), lambda g, i, j: (0, 0))],
      out_specs=pl.BlockSpec((None, rows // 32, cols), lambda g, i, j: (g, i, j)),
      out_shape=jax.ShapeDtypeStruct((bm * nm, query_words, s), jnp.int32),
      compiler_params=params, interpret=interpret, name="jaxflash_pack_mask_queries",
  )(flat, _byte_weights(rows))
  table = block_mask_lib.table_of_counts(counts, t, s, _BLOCK)
  return (by_keys.reshape(bm, nm, key_words, t), by_queries.reshape(bm, nm, query_words, s),
          table.reshape(bm, nm, row_blocks, col_blocks))


def _tile_bits(mask_ref, t: int, s: int):
  """The kernel's tile of the mask as int8 0/1, entries past T x S hidden, and its first row
  and column."""
  i, j = pl.program_id(1), pl.program_id(2)
  rows, cols = mask_ref.shape
  row = i * rows + lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
  col = j * cols + lax.broadcasted_iota(jnp.int32, (1, cols), 1)
  # (Triton lowering 0.11.2 masks no partial block itself: the edge tiles mask their loads and
  # stores here.)
  return plgpu.load(mask_ref, mask=(row < t) & (col < s), other=False).astype(jnp.int8), row, col


def _keys_kernel(mask_ref, keys_ref, counts_ref, *, t: int, s: int):
  """One tile's words along the keys ([words, rows], as `Packed.by_keys` lays them out) and
  its blocks' visible counts. (Shifts and sums here measured faster than `_queries_kernel`'s
  matmul: the 32 entries of a word lie along the loaded rows.)"""
  bits, row, _ = _tile_bits(mask_ref, t, s)
  rows, cols = bits.shape
  per_word = (rows, cols // 32, 32)
  bits = bits.astype(jnp.int32).reshape(per_word)
  # Bit k of a word is its k-th entry: distinct powers of two, whose sum is the word (bit 31's
  # wrap to int32's sign bit included).
  by_keys = jnp.sum(bits << lax.broadcasted_iota(jnp.int32, per_word, 2), axis=2,
                    dtype=jnp.int32)  # [rows, words]
  word = pl.program_id(2) * (cols // 32) + lax.broadcasted_iota(jnp.int32, (cols // 32, 1), 0)
  plgpu.store(keys_ref, by_keys.T, mask=(word < -(-s // 32)) & (row.T < t))

  # Each block's visible entries: its rows' words' set bits.
  set_bits = lax.population_count(by_keys).reshape(rows // _BLOCK, _BLOCK, cols // 32)
  per_block_row = jnp.sum(set_bits, axis=1, dtype=jnp.int32)
  counts = jnp.sum(per_block_row.reshape(rows // _BLOCK, cols // _BLOCK, _BLOCK // 32), axis=2,
                   dtype=jnp.int32)
  block_row = pl.program_id(1) * (rows // _BLOCK) + lax.broadcasted_iota(jnp.int32,
                                                                        counts.shape, 0)
  block_col = pl.program_id(2) * (cols // _BLOCK) + lax.broadcasted_iota(jnp.int32,
                                                                        counts.shape, 1)
  plgpu.store(counts_ref, counts, mask=(block_row < -(-t // _BLOCK))
              & (block_col < -(-s // _BLOCK)))


def _queries_kernel(mask_ref, weights_ref, queries_ref, *, t: int, s: int):
  """One tile's words along the queries ([words, keys]): the 32 entries of a word lie across
  rows, so an int8 matmul with `_byte_weights` gathers each 8 of them into a byte (measured
  faster than shifts and sums across the rows)."""
  bits, _, col = _tile_bits(mask_ref, t, s)
  rows = bits.shape[0]
  byte_values = lax.dot(weights_ref[...], bits, preferred_element_type=jnp.int32)
  word = pl.program_id(1) * (rows // 32) + lax.broadcasted_iota(jnp.int32, (rows // 32, 1), 0)
  plgpu.store(queries_ref, _words(byte_values), mask=(word < -(-t // 32)) & (col < s))


def _words(byte_values: jax.Array) -> jax.Array:
  """int32 [rows / 4, cols] words from int32 byte values in [-128, 127] (`_byte_weights`),
  four consecutive rows to a word, the first the lowest."""
  rows, cols = byte_values.shape
  grouped = byte_values.reshape(rows // 4, 4, cols)
  shift = 8 * lax.broadcasted_iota(jnp.int32, grouped.shape, 1)
  # (Distinct bits: the sum is their OR, bit 31's wrap to the sign bit included.)
  return jnp.sum((grouped & 255) << shift, axis=1, dtype=jnp.int32)
