"""Split-KV decoding forward (Flash-Decoding) for the Triton backend: issue 14, first kernel.

A decoding call has few query rows (T new tokens for each of the N query heads) and a long cache.
The training forward would give each (batch row, query head) one program, which fills one row of
a 16-row tile and reads every K/V byte once per query head of a GQA group. Here:
- grid over (split, B, K / F): one program per F neighbouring K/V heads (1, or 2 at D = 64:
  `DecodeConfig.heads`) and split of the cache, so a single long row still spreads over the
  GPU (`DecodeConfig.grid_order` gives the axes' launch order);
- a program's query tile for each of its K/V heads holds the T tokens of all G query heads of
  that head (G·T rows, padded to a power of two, at least 16), so each K/V byte of the split is
  read once;
- each program writes a partial output and LSE over its keys, and `forward` combines the
  splits exactly through the LSE (in XLA by default, or in one more launch: `DecodeConfig.merge`);
  with a single split the kernel writes the result itself.

Inputs are the training op's, and the band is the shared one, shifted by the offsets' diagonal
as in the training kernels. A decoding call's come from `jaxflash.ops.decode.decode_inputs`:
offsets put query row ``t`` of batch row ``b`` at position ``kv_len - T + t``, causal,
optionally with a left window. A `jaxflash.flash_attention` call with few query rows comes as it
is, with no offsets (a top-left band), and query lengths zero the rows past them. Soft caps and
dense masks too (a decoding step through a Flax hook brings its cache mask [B, 1, 1, S]: keys
past a row's last visible one are skipped like a shorter cache). A block mask or a mask_mod
(whose rows are few here) is made a dense mask of the call's T rows first
(`_block_mask_as_dense`); no biases, segments, dropout or score_mod.
The backward stays the training backward (the residuals, O and the LSE, are the same).

Head dims above 256 (DeepSeek's absorbed MLA, 576/512), which the training kernels refuse, are
loaded and multiplied in column pieces (`column_pieces`), and a tall group's query rows are cut
into blocks (`program_rows`); values that are the keys' first features
(`Params.values_in_keys`, one latent cache) are read from the key tiles (`reused_pieces`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxflash import _core
from jaxflash import block_mask as block_mask_lib
from jaxflash import fp8
from jaxflash import mask_mod as mask_mod_lib
from jaxflash import masking
from jaxflash import merge
from jaxflash._core import Inputs, Params
from jaxflash.backends.triton import tiles
from jaxflash.backends.triton import MAX_HEAD_DIM
from jaxflash.backends.triton.config import Config, padded_head_dim
from jaxflash.schedule import split_range, used_splits
from jaxflash.devices import Device

MAX_ROWS = 128  # G·T query rows per program: the accumulator is [rows, head dim] in registers
# Query rows per program where a head dim is wider than `MAX_PIECE` (DeepSeek's absorbed MLA:
# H 576, Dv 512): the accumulator [rows, Dv] in float32 takes 64 registers a thread of 4 warps
# at 16 rows and Dv 512. A taller group (MLA's 128 query heads on one latent head) is cut into
# blocks of these rows, a program each; the blocks of a group read the same keys, launched
# together (`wide_config`), so the cache comes from DRAM about once.
WIDE_ROWS = 16
MAX_WIDE_DIM = 1024  # the widest head dim taken (in pieces of at most `WIDEST_PIECE` columns)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
  """The split-KV forward's launch (``splits`` programs per (batch row, group of ``heads`` K/V
  heads), key blocks of ``block_k``), and the config of the training backend that runs the
  backward (``training``: Triton's, or another backend's for heads wider than Triton's training
  kernels take: `jaxflash.ops.decode.split_kv_path`)."""

  splits: int
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2
  # The grid's axes in launch order, fastest first: CUDA starts programs in this order, so it
  # decides which parts of the cache the programs running together read.
  grid_order: tuple[str, ...] = ("split", "batch", "head")
  # How several splits' results are merged: "xla" (`_merge_splits`, which XLA runs as one or
  # two small fusions) or "kernel" (`_merge_kernel`, one launch). On an H200 (2026-11-22,
  # `decode_h200_2026-11-22/merge/`) the kernel took 1-2 µs less GPU time per call at B = 1
  # than XLA's merge did then (three fusions), but calls timed end to end were 5-6 µs slower at
  # B = 1, 4k (its launch costs the host more than XLA's fusions do) and level elsewhere: so
  # XLA's by default.
  merge: str = "xla"
  # K/V heads per program: its loads of one key row then cover ``heads`` neighbouring heads'
  # vectors (``heads`` x H x itemsize bytes in a row of the cache), each head with its own
  # query tile, dot products and softmax state. The head axis of the grid is K / heads.
  heads: int = 1
  # Query rows per program (a power of two, at least 16): None takes a group's G·T rows (padded
  # to a power of two), or `WIDE_ROWS` of them for heads wider than `MAX_PIECE`. A group taller
  # than this is cut into blocks of these rows, which must divide its G·T rows.
  row_block: int | None = None
  training: Any = dataclasses.field(default_factory=Config)

  def __post_init__(self):
    object.__setattr__(self, "grid_order", tuple(self.grid_order))  # (lists from JSON)
    if sorted(self.grid_order) != ["batch", "head", "split"]:
      raise ValueError(f"grid_order must order 'split', 'batch' and 'head', got {self.grid_order}")
    if self.merge not in ("kernel", "xla"):
      raise ValueError(f"merge must be 'kernel' or 'xla', got {self.merge!r}")
    if self.heads < 1:
      raise ValueError(f"heads must be at least 1, got {self.heads}")
    if self.row_block is not None and (self.row_block < 16 or self.row_block
                                       != pl.next_power_of_2(self.row_block)):
      raise ValueError(f"row_block must be a power of two of at least 16, got {self.row_block}")


def rows_for(inputs: Inputs) -> int:
  """G·T padded: the query tile's rows."""
  t, n = inputs.query.shape[1:3]
  return max(16, pl.next_power_of_2(t * n // inputs.key.shape[2]))


def is_wide(inputs: Inputs) -> bool:
  """Whether a head dim (query's or value's) is wider than one tile takes (`MAX_PIECE`)."""
  return max(inputs.query.shape[-1], inputs.value.shape[-1]) > MAX_PIECE


def program_rows(inputs: Inputs, config: DecodeConfig | None = None) -> int:
  """The query rows of one program: the group's G·T padded (`rows_for`), at most the config's
  ``row_block``, or `WIDE_ROWS` for wide heads."""
  cap = config.row_block if config is not None else None
  if cap is None and is_wide(inputs):
    cap = WIDE_ROWS
  return rows_for(inputs) if cap is None else min(rows_for(inputs), cap)


def unsupported(inputs: Inputs, params: Params) -> str | None:
  """Why this kernel cannot serve a call (None if it can): a decoding call, or any call with
  few query rows."""
  group_rows = inputs.query.shape[1] * inputs.query.shape[2] // inputs.key.shape[2]
  if is_wide(inputs):
    for dim, name in ((inputs.query.shape[-1], "query"), (inputs.value.shape[-1], "value")):
      if dim > MAX_WIDE_DIM or (dim > MAX_PIECE and dim % 16):
        return (f"{name} head dim {dim} (above {MAX_PIECE}: multiples of 16 up to "
                f"{MAX_WIDE_DIM})")
    if group_rows > WIDE_ROWS and group_rows % WIDE_ROWS:
      return f"G·T = {group_rows} rows at wide heads (a multiple of {WIDE_ROWS} above it)"
  elif rows_for(inputs) > MAX_ROWS:
    return f"G·T = {group_rows} rows"
  if any(x is not None for x in (inputs.bias, inputs.q_segment_ids, inputs.dropout_seed)):
    return "biases, segments and dropout"
  if params.score_rule is not None:
    return "score_mod"
  if params.mask_rule is not None and params.mask_rule.kernel_reason is not None:
    return params.mask_rule.kernel_reason
  if inputs.block_table is not None and (entries := math.prod(_dense_shape(inputs))) > (
      MAX_DENSE_ENTRIES):
    return f"a block mask of {entries} entries made dense (at most {MAX_DENSE_ENTRIES})"
  if params.partial:
    return "partial results (ring attention)"
  return None


# The most entries (batch rows or 1 x heads or 1 x T x S) of a block mask that `forward` makes
# dense: 16M bytes of mask for the kernel, and the mask_mod's intermediates of that size. A
# decoding step of B = 8 at 32k keys, one query row and one mask for every head is 262k; per
# head with 32 heads, 8M. Larger calls run the training kernels, which walk the block lists.
MAX_DENSE_ENTRIES = 1 << 24


def _dense_shape(inputs: Inputs) -> tuple[int, int, int, int]:
  """(B or 1, N or 1, T, S): the dense mask a block mask makes here (an axis is 1 where the
  table, the mask_mod's features and a dense mask all are)."""
  b, t, n, _ = inputs.query.shape
  parts = [x for x in (inputs.block_table, inputs.mask) if x is not None]
  parts += [f[0] for f in (inputs.q_features, inputs.kv_features) if f is not None]
  return (b if any(x.shape[0] > 1 for x in parts) else 1,
          n if any(x.shape[1] > 1 for x in parts) else 1, t, inputs.key.shape[1])


def _block_mask_as_dense(inputs: Inputs, params: Params) -> tuple[Inputs, Params]:
  """A call with a block table (a block mask or a mask_mod, a dense mask's or several) as the
  kernel takes it: one dense boolean mask [B, N or 1, T, S], the entries its table leaves
  visible where the mask_mod's tile rule (if any) holds and a dense mask (if any) is nonzero.
  Evaluated on every entry: T is at most 16 here, so that is what the training kernels'
  partial blocks would have done, and the kernel's key blocks read it as they read a dense
  mask."""
  if inputs.block_table is None:
    return inputs, params
  shape = _dense_shape(inputs)
  _, _, t, s = shape
  bq, bk = params.table_block
  table = jnp.broadcast_to(inputs.block_table, shape[:2] + inputs.block_table.shape[2:])
  visible = jnp.repeat(jnp.repeat(table != block_mask_lib.EMPTY, bq, axis=2), bk,
                       axis=3)[:, :, :t, :s]
  rule = params.mask_rule
  if rule is not None:  # (elementwise: `unsupported` declines the others, as the backend does)
    def features(x, dtypes, axis):  # [F, B|1, N|1, L] -> F arrays of the mask's shape
      if x is None:
        return []
      x = jnp.expand_dims(x, axis)
      return [mask_mod_lib.from_int32(jnp.broadcast_to(f, shape), d) for f, d in zip(x, dtypes)]
    index = lambda axis: lax.broadcasted_iota(jnp.int32, shape, axis)  # noqa: E731
    visible = jnp.logical_and(visible, rule.tile(
        shape, index(2), index(3), features(inputs.q_features, rule.row_dtypes, 4),
        features(inputs.kv_features, rule.col_dtypes, 3)))
  if inputs.mask is not None:
    visible = jnp.logical_and(visible, inputs.mask != 0)
  b = inputs.query.shape[0]
  inputs = inputs._replace(
      mask=jnp.broadcast_to(visible, (b,) + visible.shape[1:]), block_table=None,
      q_features=None, kv_features=None, mask_consts=None, mask_words=None, mask_words_t=None)
  return inputs, dataclasses.replace(params, mask_rule=None, table_block=None)


def default_config(inputs: Inputs, training: Config, device: Device,
                   page_size: int | None = None, values_in_keys: bool = False) -> DecodeConfig:
  """The shipped launch for a call on ``device`` (``page_size``: the pages' keys, for a paged
  cache; ``values_in_keys``: `Params.values_in_keys`): two K/V heads per program where that is
  faster (`paired_config`), else one (`single_config`); heads wider than `MAX_PIECE` their own
  (`wide_config`)."""
  sms = device.sm_count
  if is_wide(inputs):
    return wide_config(inputs, training, sms, page_size, values_in_keys)
  hp = padded_head_dim(inputs.query.shape[-1])
  # Short key rows (at most 128 bytes a head), an even K and T = 1's query tiles: where two
  # heads a program can pay, and where an FP8 cache's rows look like a 16-bit cache's.
  pairable = (hp * inputs.key.dtype.itemsize <= 128 and inputs.key.shape[2] % 2 == 0
              and rows_for(inputs) <= PAIRED_ROWS)
  if pairable and fp8.is_fp8(inputs.key.dtype):
    return fp8_config(inputs, training, sms, page_size)
  paired = paired_config(inputs, training, sms, page_size) if pairable else None
  return paired or single_config(inputs, training, sms, page_size)


# A paged FP8 cache's rows from which `fp8_config` reads them one head at a time.
FP8_PAGED_LONG_ROWS = 16384


def fp8_config(inputs: Inputs, training: Config, sm_count: int,
               page_size: int | None) -> DecodeConfig:
  """The launch for an FP8 cache whose rows the 16-bit rules would pair (`default_config`: an
  FP8 row of D = 128 is 128 bytes, as a bf16 row of D = 64), tuned for FP8 tiles, which are
  converted in registers after their load:
  - a contiguous cache: one K/V head a program (`single_config`), in programs of 2 warps where
    the (batch row, K/V head) pairs make at least two programs an SM;
  - a paged one whose pairs are fewer than two an SM and whose rows are long
    (`FP8_PAGED_LONG_ROWS`): one head a program on 128-key blocks (two 64-key pages a step),
    `wave_splits`'s splits;
  - other paged ones: the 16-bit rules (`paired_config`).

  Why (H200, 2026-12-03, GQA 32/8, D = 128, T = 1, `decode.py --dtype float8_e4m3fn
  --candidates`):
  - contiguous, 32k keys, fraction of the copy: one head a program 0.82 against paired heads'
    0.71 at B = 8, 0.88 against 0.82 at B = 64 (128-key blocks 0.65 and 0.87, 8 warps 0.57 and
    0.61, four heads 0.47 and 0.53); then at B = 64 (512 pairs) 2 warps 1154 and 1156 µs
    against 4 warps' 1270 and 1264 in two runs, but at B = 8 (64 pairs) 166 against 160;
  - 64-key pages, µs against paired heads on 64-key blocks: B = 1 x 128k 101.8 against 114.6,
    B = 8 x 32k 178.8 against 195.3, 8 x 128k 639.7 against 698.9; but 8 x 4k 65.3 against
    56.5, and at B = 64 (512 pairs) 1523 against 1382 at 32k and 224.8 against 197.7 at 4k."""
  b, s, k = inputs.key.shape[:3]
  many = b * k >= 2 * sm_count
  if page_size is None:
    config = single_config(inputs, training, sm_count)
    return dataclasses.replace(config, num_warps=2) if many else config
  if not many and s >= FP8_PAGED_LONG_ROWS:
    block_k = tiles.fit(128, s)
    return DecodeConfig(splits=wave_splits(pl.cdiv(s, block_k), b * k, sm_count),
                        block_k=block_k, num_stages=3, training=training)
  return (paired_config(inputs, training, sm_count, page_size)
          or single_config(inputs, training, sm_count, page_size))


# Where a contiguous cache's pairs fit on the GPU at once, a program of two heads pays only if
# it runs at least this many key blocks (4096 keys).
MIN_PAIRED_BLOCKS = 64
# Two heads per program only where each head's query tile has at most this many rows: GQA 32/8
# at D = 64 with T = 16 (64 rows a head) ran 1-17% slower with two (H200, 2026-11-23,
# `decode_h200_2026-11-23/heads/6_tokens_t4_t16_d64.json`), and T = 4 (16 rows) up to 14% faster.
PAIRED_ROWS = 16


def paired_config(inputs: Inputs, training: Config, sm_count: int,
                  page_size: int | None) -> DecodeConfig | None:
  """Two neighbouring K/V heads per program (`DecodeConfig.heads`), 64-key blocks, 4 warps,
  3 stages; or None where one head per program is faster. (`default_config` asks only where
  a head's key row is at most 128 bytes, K is even and the query tiles have at most
  `PAIRED_ROWS` rows.)
  - A contiguous cache gets as many programs as fit on the GPU at once, 2 per SM at D = 64 (96
    KiB of buffers each), with one split per (batch row, head pair) where those alone nearly
    fill that: its loads are pipelined and its programs should all be resident. None where a
    program would then run fewer than `MIN_PAIRED_BLOCKS` key blocks (B = 1).
  - Where the pairs alone make more than one wave, 2 splits each, launched heads first.
  - Where they fit at once but their rows are long, `long_row_splits`'s waves (MHA 32/32 at
    B = 8, 128k; GQA 32/8 at B = 64, 128k).
  - A paged cache gets up to 4 programs per SM: the loads of its pages, whose addresses come
    from the page table, are not pipelined, and more programs hide their latency.

  Why (H200, 2026-11-23, bf16, `decode_h200_2026-11-23/heads/`): a row of one head is 128 bytes
  at D = 64 and 64 at D = 32, of a row of the cache 8x as long (GQA 32/8). Two heads per program
  read it faster wherever a program runs at least `MIN_PAIRED_BLOCKS` key blocks:
  - GQA 32/8, D = 64, contiguous: 8 x 128k 506 µs (one head 524, cuDNN 512), 64 x 4k 142
    (150), 64 x 32k 994 (1041), 64 x 128k 3886 (4073); 8 x 32k level (141, 143);
  - D = 32: 8 x 128k 308 µs (one head 420, four heads 383), 64 x 32k 638 (865, 732);
  - paged, D = 64: 8 x 128k 513 µs with 16 splits (one head 602; 12 splits 529), 64 x 32k 999
    with 2 (1082);
  - MHA 32/32, D = 64, B = 64, with 2 splits and the heads first in the grid: 4k 504 µs (one
    head, one split 541, cuDNN 510), 32k 3807 (4178, 3881);
  - but at B = 1, where a program runs 1 to 32 blocks, 8-15% slower than one head (1 x 4k:
    60 against 52 µs; 1 x 128k: 90 against 83)."""
  b, s, k = inputs.key.shape[:3]
  heads = 2
  groups = b * k // heads  # programs per split
  block_k = tiles.fit(64, s)
  blocks = pl.cdiv(s, block_k)
  hp = padded_head_dim(inputs.query.shape[-1])
  if page_size is not None:
    splits = used_splits(blocks, 4 * sm_count // groups)
    return DecodeConfig(splits=splits, block_k=block_k, num_stages=3, heads=heads,
                        training=training)
  per_sm = max(1, SMEM_PER_SM // buffer_bytes(3, block_k, hp * heads, inputs.key.dtype.itemsize))
  room = per_sm * sm_count  # programs resident at once
  if groups > room:
    # Several waves at any split count (MHA at B = 64): two splits, launched heads first, so
    # that the programs running together read whole rows of the cache.
    return DecodeConfig(splits=used_splits(blocks, 2), block_k=block_k, num_stages=3,
                        heads=heads, grid_order=HEADS_FIRST, training=training)
  many = long_row_splits(blocks, groups, room)
  if many:
    return DecodeConfig(splits=many, block_k=block_k, num_stages=3, heads=heads,
                        grid_order=HEADS_FIRST, training=training)
  splits = 1 if groups >= 0.9 * room else wave_splits(blocks, groups, sm_count, per_sm)
  if pl.cdiv(blocks, splits) < MIN_PAIRED_BLOCKS:
    return None
  return DecodeConfig(splits=splits, block_k=block_k, num_stages=3, heads=heads,
                      training=training)


# The grid's order for `long_row_splits`'s waves, and for paired programs that make several
# waves anyway: heads fastest, so that the programs running at once read whole rows of the cache.
HEADS_FIRST = ("head", "split", "batch")
WAVES = 8  # (`long_row_splits`)
MIN_WAVE_BLOCKS = 128


def long_row_splits(blocks: int, groups: int, room: int) -> int | None:
  """Splits for ``groups`` (batch row, K/V head group) programs of ``blocks`` key blocks where
  ``room`` of them fit on the GPU at once: about `WAVES` waves of programs (launched
  `HEADS_FIRST`), where that leaves each at least `MIN_WAVE_BLOCKS` blocks and 2 splits. None
  where the rows are too short for that: one wave of longer programs is faster there.

  Why (H200, 2026-11-23, bf16, T = 1, `decode_h200_2026-11-23/waves/`, 5-9 interleaved rounds;
  the kernel's GPU time, then cuDNN ÷ jaxflash end to end, median round):
  - MHA 32/32, D = 64, 8 x 128k: one wave of 256 programs (2 splits of 1024 blocks) 1868-1890
    µs, 0.991-0.995; 16 splits (2048 programs of 128 blocks) 1840-1890 µs, 1.003-1.008 over
    four calls (cuDNN's kernel 1850-1900). 4, 8, 12 and 24 splits were 2-21% slower and 32
    level: the count matters more than a rule of waves explains.
  - MHA 32/32, D = 128, 8 x 128k: one split (256 programs) 3813 µs, 1.003; 8 splits 3755,
    1.019; 16 splits 1.009; 4 splits 0.982.
  - GQA 32/8, D = 128, 64 x 32k: one split (512 programs, two partial waves) 1923 µs, 1.004;
    4 splits 1898, 1.017; 8 1.007; 16 1.000.
  - GQA 32/8, D = 64, 64 x 128k: one split 3829 µs; 8 splits 3760 (1.139 against 1.125).
  - Rows too short for it: 16 splits at MHA D = 64, 8 x 32k (32 blocks a program) were 0.5-1%
    slower than one wave of 2 splits, 64 at GQA D = 64, 8 x 128k (32 blocks) level or slower,
    and at GQA D = 128, 8 x 32k and 8 x 128k 8 and 16 splits 1-3% slower than 6."""
  splits = used_splits(blocks, WAVES * room // groups)
  return splits if splits >= 2 and pl.cdiv(blocks, splits) >= MIN_WAVE_BLOCKS else None


def single_config(inputs: Inputs, training: Config, sm_count: int,
                  page_size: int | None = None) -> DecodeConfig:
  """One K/V head per program. Splits from `wave_splits` (2 to 4 programs per SM, spread evenly
  over the SMs); 64-key blocks, 4 warps, 2 stages (3 at head dims up to 64, whose tiles are
  half as large, and up to 128 where all programs fit on the GPU at once with 3:
  `all_resident`). Where the (batch row, K/V head) pairs alone make at least 90% of two
  programs per SM and fit at once with 3 stages, one split each (`wave_splits` would give
  them 2 only between 90 and 100%). Long rows whose query tiles are T = 1's (at most
  `PAIRED_ROWS` rows) and whose 3-stage programs fit twice on an SM get `long_row_splits`'s
  waves instead, and taller tiles at D = 128 their own rule (`tall_tiles_config`).

  Tuned on an H200 (2026-11-22, bf16, T = 1; `benchmarks/decode.py --tune`, results in
  benchmarks/results/decode_h200_2026-11-22) over 64 or 128 keys, 4 or 8 warps, 2 to 4 stages
  and 1, 2 or 4 programs per SM. At GQA 32/8, D = 128 this was the fastest or within 1% of it
  at B x S = 8 x 32k, 8 x 128k, 64 x 4k and 64 x 32k (3.9-4.4 TB/s), where 128-key blocks ran
  up to 13% slower. At D = 64, 3 stages were the fastest at B = 8 (2 stages: up to 24% slower)
  and within 1% of it at B = 1. The split count was swept alone later the same day
  (`decode.py --tune-splits`, `splits_*.json` there): see `wave_splits`."""
  b, s, k = inputs.key.shape[:3]
  block_k = tiles.fit(64, s)
  hp = padded_head_dim(inputs.query.shape[-1])
  resident = functools.partial(all_resident, sm_count=sm_count, stages=3, block_k=block_k,
                               hp=hp, itemsize=inputs.key.dtype.itemsize)
  if 64 < hp <= 128 and rows_for(inputs) > PAIRED_ROWS and resident(2 * sm_count):
    return tall_tiles_config(inputs, training, sm_count, page_size)
  many = long_row_splits(pl.cdiv(s, block_k), b * k, 2 * sm_count)
  if many and rows_for(inputs) <= PAIRED_ROWS and resident(2 * sm_count):
    # Long rows: waves of two programs per SM at 3 stages (measured with T = 1's tiles in
    # bf16 at D = 64 to 128).
    return DecodeConfig(splits=many, block_k=block_k, num_stages=3, grid_order=HEADS_FIRST,
                        training=training)
  if hp <= 128 and b * k >= 0.9 * 2 * sm_count and resident(b * k):
    # The (batch row, K/V head) pairs alone nearly fill two programs per SM, and fit at once:
    # one split each, nothing to merge. (H200, MHA 32/32 at B = 8: 1.4-4% faster than 2 splits
    # at 4k to 128k keys, `decode_h200_2026-11-22/one_split/`.)
    return DecodeConfig(splits=1, block_k=block_k, num_stages=3, training=training)
  splits = wave_splits(pl.cdiv(s, block_k), b * k, sm_count)
  stages = 3 if hp <= 64 else 2
  if hp <= 128 and resident(splits * b * k):
    stages = 3  # (deeper, where every program still has a place at once)
  return DecodeConfig(splits=splits, block_k=block_k, num_stages=stages, training=training)


def tall_tiles_config(inputs: Inputs, training: Config, sm_count: int,
                      page_size: int | None) -> DecodeConfig:
  """One head per program at D = 128 with query tiles of more than `PAIRED_ROWS` rows (T = 8
  and 16 at GQA 32/8: 32 and 64 rows), where two 3-stage programs fit on an SM: 3 stages. On a
  contiguous cache, and on a paged one with tiles of 64 rows, as many splits as let every
  program be resident at once (two per SM), launched heads first (`HEADS_FIRST`) where B > 1;
  on a paged cache with shorter tiles, `wave_splits`'s.

  Why (H200, 2026-11-23, bf16, `decode_h200_2026-11-23/tokens/`; µs, contiguous and paged;
  the rule before this one took 2 stages and `wave_splits`'s 6 splits at B = 8, one at 64):
  - T = 16, contiguous: 8 x 32k 367 → 273, 8 x 128k 1358 → 1001, 64 x 32k 2354 → 1998
    (0.70-0.86 of the copy → 0.95-1.01);
  - T = 8, contiguous: 8 x 32k 280 → 270, 8 x 128k 1053 → 991, 64 x 32k 2553 → 1973;
  - 3 stages with 6 splits (384 programs, more than fit at once) were 14% slower than 2 stages
    at T = 8, 8 x 32k; 12 splits were 2-6% slower than 4 at B = 8, and 7-9% slower than one
    at B = 64;
  - paged (64-key pages): 3 stages took T = 8 from 290, 1061 and 2679 µs to 290, 1054 and
    2482; the contiguous cache's splits would take it 10% back at B = 8 (318 and 1166), so
    there pages keep `wave_splits`'s. At T = 16 those splits took B = 8 from 370 and 1384 µs
    to 300 and 1155 (3 stages alone: 355 and 1320), and B = 64 (one split) from 2354 to
    2250."""
  b, s, k = inputs.key.shape[:3]
  block_k = tiles.fit(64, s)
  blocks = pl.cdiv(s, block_k)
  if page_size is not None and rows_for(inputs) < 64:
    return DecodeConfig(splits=wave_splits(blocks, b * k, sm_count), block_k=block_k,
                        num_stages=3, training=training)
  splits = used_splits(blocks, max(1, 2 * sm_count // (b * k)))
  # (Heads first as measured, at B = 8; B = 1 and one split keep the default order.)
  order = HEADS_FIRST if b > 1 and splits > 1 else DecodeConfig.grid_order
  return DecodeConfig(splits=splits, block_k=block_k, num_stages=3, grid_order=order,
                      training=training)


SMEM_PER_SM = 227 * 1024  # what one SM of a Hopper GPU gives its resident programs


def all_resident(programs: int, sm_count: int, stages: int, block_k: int, hp: int,
                 itemsize: int) -> bool:
  """Whether ``programs`` each with ``stages`` buffers of a K and a V block fit on the GPU's SMs
  at once (one wave, in shared memory).

  Why it sets the stage count at D = 128 (H200, 2026-11-22, `decode.py --candidates` with
  interleaved rounds, `decode_h200_2026-11-22/stages/`): at B = 1 with 8 K/V heads (264
  programs, two per SM) 3 stages took the kernel from 125.9-127.5 to 120.3-120.4 µs at 128k
  (cuDNN 120.7-121.1) and from 35.6 to 33.5 µs at 32k. Where 3 stages would not leave room
  for every program (32 K/V heads at B = 1: 384 programs), they were slower or level, and at
  B = 8 with 32 K/V heads (512 programs) they took 17% longer."""
  per_sm = pl.cdiv(programs, sm_count)
  return per_sm * buffer_bytes(stages, block_k, hp, itemsize) <= SMEM_PER_SM


def buffer_bytes(stages: int, block_k: int, hp: int, itemsize: int) -> int:
  """Shared memory of one program's pipeline: ``stages`` K and V blocks of [block_k, hp]."""
  return stages * 2 * block_k * hp * itemsize


WIDE_BLOCK_K = 32  # key blocks at wide heads: 68 KiB of K and V a stage at 576/512 in bf16
WIDE_PROGRAMS_PER_SM = 2  # (`wide_config`)
INTERPRETER_PARTITIONS = True  # (its interpreter runs per device: `jaxflash.ops.decode.SplitKV`)


def wide_config(inputs: Inputs, training: Config, sm_count: int, page_size: int | None,
                values_in_keys: bool = False) -> DecodeConfig:
  """Heads wider than `MAX_PIECE` (DeepSeek's absorbed MLA, 576/512): 4 warps, 2 stages, splits
  for about `WIDE_PROGRAMS_PER_SM` programs per SM (two waves at one program per SM), the row
  blocks of a group launched together (`HEADS_FIRST`: the head axis counts them, fastest), so
  the programs reading the same keys run at once.
  - Separate K and V caches: `WIDE_ROWS` query rows and `WIDE_BLOCK_K` keys a program (139 KiB
    of K and V in two stages at 576/512).
  - Values in the keys (one latent cache, read once for both products): 64-key blocks (72 KiB a
    stage) and 32 query rows a program where the group has that many and they divide it.

  Why (H200, 2026-11-25, bf16, B = 32, 8k, T = 1 unless said, `benchmarks/decode.py
  --candidates`, copy 3.9-4.0 TB/s):
  - separate caches, 16 query heads: 8 splits (256 programs) 153 µs, 0.95 of the copy; 4
    splits (one wave, the first rule) 178 µs, 0.82; 16 splits 164 µs; 3 stages 157 µs; 16-key
    blocks with 3 or 4 stages 155 and 158 µs; 8 warps 163 µs; 32-row programs at T = 2 207 µs
    against 190 for two 16-row ones;
  - one latent cache: 16 heads at T = 2 114 µs with 64-key blocks and 32-row programs, 137
    with 64-key blocks alone, 154 with 32-row programs alone, 164 with neither; 128 heads 329
    µs against 543 (T = 2: 601 against 1066); at 16 heads, T = 1 (16 rows) 64-key blocks run
    level with 32 (102 µs), more splits slower (110-120 µs);
  - products in the other orientation (Sᵀ = K Qᵀ, Oᵀ += Vᵀ Pᵀ, so that keys and value columns
    are the long side of the tensor-core tiles) were slower in every cell: 116 against 104 µs
    at T = 1, 436 against 329 at 128 heads."""
  b, s, k = inputs.key.shape[:3]
  t, n = inputs.query.shape[1:3]
  group_rows = t * n // k
  block_k, row_block = tiles.fit(WIDE_BLOCK_K, s), None
  if values_in_keys:
    block_k = tiles.fit(2 * WIDE_BLOCK_K, s)
    if rows_for(inputs) >= 2 * WIDE_ROWS and (group_rows <= 2 * WIDE_ROWS
                                              or group_rows % (2 * WIDE_ROWS) == 0):
      row_block = 2 * WIDE_ROWS
  groups = b * k * pl.cdiv(group_rows, row_block or program_rows(inputs))
  splits = used_splits(pl.cdiv(s, block_k), max(1, round(WIDE_PROGRAMS_PER_SM * sm_count
                                                          / groups)))
  return DecodeConfig(splits=splits, block_k=block_k, num_stages=2, grid_order=HEADS_FIRST,
                      row_block=row_block, training=training)


def wave_splits(blocks: int, rows: int, sm_count: int, per_sm: int = 4) -> int:
  """Splits of each cache row for ``rows`` (batch row, K/V head group) programs of ``blocks``
  key blocks.

  Among the counts that give 2 to ``per_sm`` (at most 4) programs per SM, it takes the one whose
  programs are spread most evenly over the SMs (programs / (SMs x waves), ties to fewer
  programs), with no split left without a key block. Why: in the H200 sweep (`decode.py
  --tune-splits`, 132 SMs), 32 K/V heads at B = 1 ran 4-7% faster with 12 splits (384
  programs, 2.9 per SM) than with 9 (288, 2.2 per SM, which leaves part of a wave idle at the
  end). 8 splits (256 programs, 1.9
  per SM) were slower, as were 13 to 16. At B = 8 with 8 K/V heads, 6 splits (384 programs)
  matched or beat 5 (320). Where two programs per SM already fill whole waves (8 K/V heads at
  B = 1, 33 splits) the count is unchanged."""
  high = max(1, per_sm * sm_count // rows)
  low = min(high, max(1, pl.cdiv(2 * sm_count, rows)))
  best_fill, best = -1.0, 1
  for splits in range(low, high + 1):
    splits = used_splits(blocks, splits)
    programs = splits * rows
    fill = programs / (pl.cdiv(programs, sm_count) * sm_count)
    if fill > best_fill:
      best_fill, best = fill, splits
  return best


def _kernel(q_ref, k_ref, v_ref, bounds_ref, table_ref, mask_ref, factors_ref,
            key_factors_ref, o_ref, lse_ref, *, params: Params, t: int, rows_used: int,
            splits: int, block_k: int, page_size: int | None, split_axis: int, head_axis: int,
            row_blocks: int, whole: bool, st: tiles.Static):
  """One (split, batch row, group of F K/V heads, block of query rows); the split is grid axis
  ``split_axis``, and the head axis ``head_axis`` counts (head group, row block) pairs, row
  blocks fastest. ``q_ref`` is the block's query tiles [F, rows, hp]; ``k_ref`` and ``v_ref``
  are the row's cache [S, F, hp], or with ``table_ref`` (the row's page table) the group's
  pages [num_pages, page_size, F, hp] (see `_key_pieces`). Head dims wider than `MAX_PIECE`
  are loaded and multiplied in column pieces (`column_pieces`). ``bounds_ref`` holds the row's
  query and key lengths, the first key a mask lets it see and the diagonal of its band, its
  query offset less its key offset (a decoding call's puts the T tokens at the cache's end;
  0 without offsets): `_launch`. ``factors_ref`` [F, rows] (an FP8 call's, else None) scales
  each row's logits, and ``key_factors_ref`` [F, S] (an FP8 cache's key factor per token, else
  None) each key's (`_fp8_operands`). Writes ``o_ref`` [F, rows, hp] and ``lse_ref`` [F,
  rows]: a partial result (float32 O, base-2 LSE, -inf where the split sees no key), or with
  ``whole`` (one split) the result itself: O in the query dtype and the internal LSE (+inf on
  empty rows, `jaxflash._core`)."""
  heads, rows = q_ref.shape[:2]
  # (Array indices: Pallas refuses Python ints in loads. Of the default int type: the interpreter
  # takes the slices beside them in it, int64 under jax_enable_x64, and wants one dtype.)
  head_ids = [jnp.array(i, jax.dtypes.canonicalize_dtype(jnp.int64)) for i in range(heads)]
  # Rows are (query head, token) pairs, token fastest; this program holds rows [first_row,
  # first_row + rows) of its group (several blocks only where they divide the group's rows).
  r = jnp.arange(rows)
  first_row = (0 if row_blocks == 1
               else lax.rem(pl.program_id(head_axis), jnp.int32(row_blocks)) * rows)
  token = (first_row + r) % t
  row_ok = first_row + r < rows_used
  # The tile's padding rows and columns lie past the arrays' ends: masked, never read or written
  # (padding them in XLA cost a pass over the queries and up to 16x the partial outputs' bytes).
  row_io = None if rows_used == rows or row_blocks > 1 else row_ok
  key_cols = column_pieces(st.head_dim)
  # Values in the keys (absorbed MLA's latent cache): ``v_ref`` is the key cache, and a V piece
  # that is a K piece already loaded is that tile (`reused_pieces`).
  value_cols = column_pieces(st.value_dim)
  reuse = (reused_pieces(st.head_dim, st.value_dim) if params.values_in_keys
           else [None] * len(value_cols))
  qs = [[tiles.load(q_ref.at[i, :, cols], mask=tiles.tile_ok(row_io, ok), other=0.0)
         for cols, ok in key_cols] for i in head_ids]  # [rows, piece] each
  # An FP8 call's factor of each row's logits (its query's times its K/V head's key factor).
  row_factors = [None if factors_ref is None else
                 tiles.load(factors_ref.at[i], mask=row_io, other=1.0) for i in head_ids]
  q_len, kv_len, diagonal = bounds_ref[0], bounds_ref[1], bounds_ref[3]
  # The key blocks this batch row may see: from its mask's first visible key to its length.
  # (Sizes as int32: a Python int is int64 under jax_enable_x64, and lax wants one dtype.)
  bk = jnp.int32(block_k)
  first, last = lax.div(bounds_ref[2], bk), pl.cdiv(kv_len, bk)
  left, right = params.window.left, params.window.right
  if left is not None:  # blocks wholly before the earliest row's window hold nothing
    first = jnp.maximum(first, lax.div(jnp.maximum(diagonal - left, 0), bk))
  if right is not None:  # nor blocks wholly after the last row's (a top-left band ends early)
    last = jnp.minimum(last, lax.div(jnp.maximum(diagonal + t - 1 + right, -1), bk) + 1)
  lo, hi = split_range(pl.program_id(split_axis), splits, first, last)

  def body(j, carry):
    pieces = _key_pieces(j, table_ref, block_k, page_size, st, kv_len)
    # The shared band rule, with the token index as the row and the offsets' diagonal: the same
    # for every head of the group.
    visible = [masking.visible(token[:, None], cols[None, :], params.window, diagonal=diagonal,
                               q_len=q_len, kv_len=kv_len) & row_ok[:, None]
               for _, cols, _ in pieces]
    new = []
    for i, q, factor, (accs, m, l) in zip(head_ids, qs, row_factors, carry):
      logits, k_tiles = [], []
      for (index, cols, key_ok), seen in zip(pieces, visible):
        s = None
        k_tiles.append([])
        for q_part, (part, ok) in zip(q, key_cols):  # Q Kᵀ summed over the head dim's pieces
          k = tiles.load(k_ref.at[index(i, part)], mask=tiles.tile_ok(key_ok, ok), other=0.0)
          k = k.astype(q_part.dtype)  # (an FP8 cache's tile: to float16, in registers)
          k_tiles[-1].append(k)
          dot = plgpu.dot(q_part, k, trans_b=True)
          s = dot if s is None else s + dot
        if factor is not None:
          s = s * factor[:, None]
        if key_factors_ref is not None:  # (contiguous caches only: `_checks`)
          keys = index(i, None)[0]
          s = s * tiles.load(key_factors_ref.at[i, keys], mask=key_ok, other=0.0)[None, :]
        s2, _ = _core.logits_base2(s, params, None)
        if mask_ref is not None:  # a dense mask's rows (head g, token t) of these keys
          dense = tiles.load(mask_ref.at[head_ids[0] if mask_ref.shape[0] == 1 else i, :,
                                         index(i, None)[0]],
                             mask=tiles.tile_ok(row_ok, cols < st.seq_k), other=0)
          seen = jnp.logical_and(seen, dense != 0)
        logits.append(jnp.where(seen, s2, -jnp.inf))
      m_new = functools.reduce(jnp.maximum, [jnp.max(s2, axis=1) for s2 in logits], m)
      m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that have seen nothing yet
      alpha = jnp.exp2(m - m_shift)
      accs, l = [acc * alpha[:, None] for acc in accs], l * alpha
      for (index, _, key_ok), s2, loaded in zip(pieces, logits, k_tiles):
        p = jnp.exp2(s2 - m_shift[:, None])
        for c, (part, ok) in enumerate(value_cols):  # P V, a piece of the value's dim each
          v = loaded[reuse[c]] if reuse[c] is not None else tiles.load(
              v_ref.at[index(i, part)], mask=tiles.tile_ok(key_ok, ok),
              other=0.0).astype(q_ref.dtype)
          accs[c] = accs[c] + plgpu.dot(p.astype(v.dtype), v)
        l = l + jnp.sum(p, axis=1)
      new.append((tuple(accs), m_new, l))
    return tuple(new)

  init = tuple((tuple(jnp.zeros((rows, part.size), jnp.float32) for part, _ in value_cols),
                jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
               for _ in range(heads))
  results = lax.fori_loop(lo, jnp.maximum(hi, lo), body, init)
  for i, (accs, m, l) in zip(head_ids, results):
    # NaN logits make l NaN: such rows stay NaN (l != 0), as in the training forward.
    seen = l != 0.0
    for acc, (part, ok) in zip(accs, value_cols):
      out = jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None], 0.0)
      plgpu.store(o_ref.at[i, :, part], out.astype(o_ref.dtype), mask=tiles.tile_ok(row_io, ok))
    plgpu.store(lse_ref.at[i], jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)),
                                         jnp.inf if whole else -jnp.inf),
                mask=row_io)


# The widest head dim the kernel loads and multiplies as one tile: the training kernels' limit.
# Wider ones go in column pieces (`column_pieces`).
MAX_PIECE = MAX_HEAD_DIM
WIDEST_PIECE = 512  # (a [16, 512] float32 accumulator: 64 registers a thread of 4 warps)


def piece_widths(dim: int) -> tuple[int, ...]:
  """The column pieces' widths of a head dim: the dim padded to a power of two (at least 16)
  up to `MAX_PIECE`; a wider one (a multiple of 16) as powers of two of at most `WIDEST_PIECE`,
  widest first, that add up to it: DeepSeek's absorbed MLA takes 576 = 512 + 64 for Q and K,
  and 512 for V; 1024 is 512 + 512."""
  if dim <= MAX_PIECE:
    return (padded_head_dim(dim),)
  widths = []
  while dim:
    widths.append(min(WIDEST_PIECE, 1 << (dim.bit_length() - 1)))
    dim -= widths[-1]
  return tuple(widths)


def column_pieces(dim: int) -> list:
  """``(columns, col_ok)`` for each column piece of a head dim (`piece_widths`): its columns
  from 0 (a `pl.ds`, inside the dim's padded tile and inside any wider one: values read from
  the key tiles take their columns so) and their in-bounds flags (None: all in bounds; only a
  dim padded to a power of two has columns out of bounds)."""
  pieces, start = [], 0
  for width in piece_widths(dim):
    pieces.append((pl.ds(start, width),
                   None if start + width <= dim else jnp.arange(width) < dim - start))
    start += width
  return pieces


def reused_pieces(head_dim: int, value_dim: int) -> list:
  """For each piece of the value's dim read from the key tiles (`column_pieces`), the index of
  the key piece that is the same tile, or None: the same columns, all in bounds on both sides
  (or the same dim). At 576/512 V's one piece is K's first (512 + 64), so each key block is
  loaded once for both products."""
  keys = [(part.start, part.size) for part, _ in column_pieces(head_dim)]
  reuse = []
  for part, _ in column_pieces(value_dim):
    span = (part.start, part.size)
    same = span in keys and (head_dim == value_dim or sum(span) <= min(head_dim, value_dim))
    reuse.append(keys.index(span) if same else None)
  return reuse


def _key_pieces(j, table_ref, block_k: int, page_size: int | None, st: tiles.Static, kv_len):
  """Where key block ``j`` lies: ``(index(head, cols), keys, key_ok)`` for each piece of it,
  with ``index`` the piece's [keys, cols] tile of a K/V ref (``cols`` a column piece of the head
  dim, `column_pieces`), ``keys`` its key positions and ``key_ok`` their in-bounds flags (None:
  all in bounds):
  - a contiguous cache: one piece, the block's rows (masked past the cache's end);
  - pages of at least ``block_k`` keys: one piece, a part of page ``table_ref[j // (page_size /
    block_k)]``;
  - smaller pages: ``block_k / page_size`` pieces, one page each, taken in one step so that
    their loads are in flight together (one 16-key page a step read at half the speed of the
    contiguous cache at D = 64). A row's last block may reach past its ``kv_len`` keys into
    table entries it does not use, which may hold anything (padding such as -1): page 0
    stands in for those pieces, whose keys are never seen."""
  cols_of = lambda start, size: start + jnp.arange(size)  # noqa: E731
  whole = slice(None)
  if table_ref is None:
    keys, key_ok = st.bounds(j * block_k, block_k, st.seq_k)
    return [(lambda i, cols: (pl.ds(j * block_k, block_k), i, cols), keys, key_ok)]
  # (Whole pages: no key past a page's end.)
  if page_size >= block_k:
    per_page = page_size // block_k
    page, part = table_ref[j // per_page], pl.ds((j % per_page) * block_k, block_k)
    return [(lambda i, cols: (page, part if per_page > 1 else whole, i, cols),
             cols_of(j * block_k, block_k), None)]
  per_block = block_k // page_size

  def page_of(c):
    start = j * block_k + c * page_size
    return jnp.where(start < kv_len, table_ref[j * per_block + c], 0)

  return [(lambda i, cols, page=page_of(c): (page, whole, i, cols),
           cols_of(j * block_k + c * page_size, page_size), None)
          for c in range(per_block)]


def paged_block(page_size: int) -> bool:
  """Whether the kernel can read pages of ``page_size`` keys where they lie (whole pages, or
  parts of one, make its key blocks: `_key_pieces`)."""
  return 16 <= page_size <= 256 and page_size == pl.next_power_of_2(page_size)


def forward(inputs: Inputs, params: Params, config: DecodeConfig, pages=None):
  """The training forward's ``(out [B, T, N, Dv] in the query dtype, lse2 [B, N, T])`` of a
  decoding call. With one split the kernel writes them itself; otherwise its partial results
  are merged here through the LSE, in the kernel's own layout (a transpose to [splits, B, T, N,
  H] for `jaxflash.merge.merge` cost XLA a pass of its own).

  With ``pages`` = (key pages, value pages [num_pages, page_size, K, H], page table [B,
  pages_per_row]) the kernel reads the cache from the pages, and ``inputs.key`` and
  ``inputs.value`` only give shapes (the rows the pages make,
  `jaxflash.ops.decode.gather_pages`: under jit nothing computes them unless a backward needs
  them)."""
  inputs, params = _block_mask_as_dense(inputs, params)
  out_dtype = params.output_dtype(inputs)
  inputs, row_factors, key_factors, v_descale = _fp8_operands(inputs)
  t = inputs.query.shape[1]
  first_keys = None
  if inputs.mask is not None:
    # Keys past a row's last visible one are skipped like a shorter cache (a decoding mask,
    # Flax's [B, 1, 1, S], hides the cache's unwritten tail), and keys before its first visible
    # one too (a sliding window given as a mask, a document that starts late in the cache).
    first_keys, last = visible_keys(inputs.mask)
    lengths = inputs.lengths.at[:, 1].set(jnp.minimum(inputs.lengths[:, 1], last))
    inputs = inputs._replace(lengths=lengths)
  outs, lse2 = _launch(inputs, params, config, pages, first_keys, row_factors, key_factors)
  if outs.shape[2] == 1:  # (the kernel wrote the result itself)
    out, lse2 = outs[:, :, 0], lse2[:, :, 0]
  elif config.merge == "kernel":
    out, lse2 = _merge_in_kernel(outs, lse2, inputs.query.dtype if row_factors is None
                                 else jnp.float32, params.interpret)
  else:
    out, lse2 = _merge_splits(outs, lse2)
  out, lse2 = merge.group_rows_as_heads(out, lse2, t, inputs.sinks)
  if v_descale is not None:  # (O is linear in V: its factor applies once, to the result)
    out = out * v_descale[..., None]
  return out.astype(out_dtype), lse2


def _fp8_operands(inputs: Inputs) -> tuple[Inputs, jax.Array | None, jax.Array | None,
                                            jax.Array | None]:
  """An FP8 call as the kernel takes it: ``(inputs, row_factors, key_factors, v_descale)``,
  the query's FP8 values as float16 (exact: e4m3's and e5m2's values are float16 values) with
  no factors left, each query row's factor times its K/V head's key factor ([B, T, N]: the
  kernel multiplies its logits by it, q · k = (q8 · k8) q_descale k_descale), a key factor per
  token where the cache has one ([B, K, S], None otherwise: the kernel multiplies each key's
  logits by it), and the value's factor per query head ([B, 1, N]), which scales the merged
  output (O is linear in V). The kernel converts each FP8 K/V tile to float16 in registers
  after its load, one conversion per pair of entries: both products then take exact operands.
  ``(inputs, None, None, None)`` for other calls."""
  if not fp8.is_fp8(inputs.query.dtype):
    return inputs, None, None, None
  b, t, n, _ = inputs.query.shape
  groups = n // inputs.key.shape[2]
  per_head = lambda d: jnp.repeat(d, groups, axis=2)  # [B, 1, K] -> [B, 1, N]  # noqa: E731
  factors = jnp.ones((b, t, n), jnp.float32)
  if inputs.q_descale is not None:
    factors = factors * inputs.q_descale  # [B, T or 1, N]
  key_factors = None
  if fp8.per_token(inputs.k_descale):
    # [B, K, S]: the kernel scales each key's logits, a block's factors of a head in one run.
    # (Read as they lie, [B, S, K], a head's factors were K apart, a 32-byte sector each: 6-9%
    # slower than factors per head on an H200, 2026-12-03; a call now transposes them.)
    key_factors = jnp.swapaxes(inputs.k_descale, 1, 2)
  elif inputs.k_descale is not None:
    factors = factors * per_head(inputs.k_descale)
  v_descale = None if inputs.v_descale is None else per_head(inputs.v_descale)
  return (inputs._replace(query=inputs.query.astype(jnp.float16), q_descale=None,
                          k_descale=None, v_descale=None), factors, key_factors, v_descale)


def visible_keys(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(first, stop)``, int32 [B] each: the keys of a mask [B, N or 1, T, S] (nonzero =
  visible) that some query row of a batch row may see lie in ``[first, stop)`` (``(S, 0)``
  where none may)."""
  visible = jnp.any(mask != 0, axis=(1, 2))  # [B, S]
  key = lax.broadcasted_iota(jnp.int32, visible.shape, 1)
  return (jnp.min(jnp.where(visible, key, visible.shape[1]), axis=1),
          jnp.max(jnp.where(visible, key + 1, 0), axis=1))


# The splits' merge in XLA (a module name of its own here, so that tests can watch it run).
_merge_splits = merge.merge_splits


MERGE_CHUNK = 32  # splits merged per step of `_merge_kernel`: a [32, hp] float32 tile


def _merge_kernel(outs_ref, lse_ref, o_ref, lse_out_ref, *, splits: int, head_dim: int):
  """One query row of one (batch row, K/V head): its ``splits`` partial results (``outs_ref``
  [splits padded, hp], ``lse_ref`` base-2 [splits padded]) merged through the LSE, a chunk of
  splits at a time with a running maximum (as the attention kernels run over key blocks). A NaN
  in any split makes the weights and so the row NaN; a row no split saw gets zeros and +inf."""
  hp = outs_ref.shape[-1]
  chunk = min(MERGE_CHUNK, outs_ref.shape[0])
  dim_ok = None if head_dim == hp else jnp.arange(hp) < head_dim

  def body(c, carry):
    acc, m, l = carry
    idx = c * chunk + jnp.arange(chunk)
    ok = idx < splits
    lse = plgpu.load(lse_ref.at[pl.ds(c * chunk, chunk)], mask=ok, other=-jnp.inf)
    part = plgpu.load(outs_ref.at[pl.ds(c * chunk, chunk), :],
                      mask=tiles.tile_ok(ok, dim_ok), other=0.0)
    m_new = jnp.maximum(m, jnp.max(lse))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - shift)
    weights = jnp.exp2(lse - shift)
    acc = acc * alpha + jnp.sum(weights[:, None] * part, axis=0)
    return acc, m_new, l * alpha + jnp.sum(weights)

  init = (jnp.zeros((hp,), jnp.float32), jnp.float32(-jnp.inf), jnp.float32(0.0))
  acc, m, l = lax.fori_loop(0, pl.cdiv(splits, chunk), body, init)
  seen = l != 0.0
  out = jnp.where(seen, acc / jnp.where(seen, l, 1.0), 0.0)
  plgpu.store(o_ref, out[None].astype(o_ref.dtype), mask=None if dim_ok is None else dim_ok[None])
  lse_out_ref[...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), jnp.inf)[None]


def _merge_in_kernel(outs: jax.Array, lse2: jax.Array, dtype, interpret: bool):
  """`_merge_splits` as one Triton launch over (batch row, K/V head, query row), writing the
  output in ``dtype``."""
  b, kv_heads, splits, rows, h = outs.shape
  hp = padded_head_dim(h)
  splits_p = pl.next_power_of_2(splits)
  return pl.pallas_call(
      functools.partial(_merge_kernel, splits=splits, head_dim=h),
      grid=(b, kv_heads, rows),
      in_specs=[pl.BlockSpec((None, None, splits_p, None, hp), lambda i, j, r: (i, j, 0, r, 0)),
                pl.BlockSpec((None, None, splits_p, None), lambda i, j, r: (i, j, 0, r))],
      out_specs=[pl.BlockSpec((None, None, 1, hp), lambda i, j, r: (i, j, r, 0)),
                 pl.BlockSpec((None, None, 1), lambda i, j, r: (i, j, r))],
      out_shape=[_core.out_struct((b, kv_heads, rows, h), dtype, outs),
                 _core.out_struct((b, kv_heads, rows), jnp.float32, outs)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="jaxflash_decode_merge",
  )(outs, lse2)


def _launch(inputs: Inputs, params: Params, config: DecodeConfig, pages, first_keys=None,
            row_factors=None, key_factors=None):
  """The kernel over the grid: ``(outs [B, K, splits, G·T, Dv], lse2 [B, K, splits, G·T])``,
  rows (head g, token t) with the token fastest. With one split these are the result itself
  (`_kernel`'s ``whole``), else float32 partial results. ``first_keys`` [B] (None: 0): the
  first key of each row that any of its query rows may see; the splits share out the rest."""
  q, k, v = inputs.query, inputs.key, inputs.value
  # An FP8 cache (`_fp8_operands`) gives ``row_factors`` [B, T, N] for the logits; its O leaves
  # in float32, as the value's factor still scales it.
  quantized = row_factors is not None
  b, t, n, h = q.shape
  kv_heads = k.shape[2]
  g = n // kv_heads
  st = tiles.static(inputs)
  rows = program_rows(inputs, config)
  row_blocks = pl.cdiv(g * t, rows)
  if row_blocks > 1 and (g * t) % rows:
    raise ValueError(f"row_block: {rows} query rows a program must divide G·T = {g * t}")
  hp, hvp = st.head_dim_p, st.value_dim_p  # (V and O are blocked at their own head dim)
  # Query rows (head g, token t) of each K/V head: [B, K, G·T, H] (at T = 1 a free reshape). The
  # tile, [rows, hp], reaches past its ends.
  qg = q.reshape(b, t, kv_heads, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, h)
  block_k = config.block_k
  # K/V heads per program: the config's where they divide the K/V heads here (a shard of a call
  # sharded over its heads may hold fewer than the whole call the config was chosen for).
  fold = math.gcd(config.heads, kv_heads)
  table = table_spec = None
  order = config.grid_order
  # Index maps by axis name; the head axis counts (group of K/V heads, block of query rows)
  # pairs, row blocks fastest: a map sees the group as ``head`` and the block as ``row_block``.
  def named(f):
    def index_map(*ids):
      ids = dict(zip(order, ids))
      # (int32 blocks: a Python int is int64 under jax_enable_x64, and lax wants one dtype)
      blocks = jnp.int32(row_blocks)
      return f(split=ids["split"], batch=ids["batch"], head=lax.div(ids["head"], blocks),
               row_block=lax.rem(ids["head"], blocks))
    return index_map

  if pages is None:
    kv, v_spec = (pl.BlockSpec((None, k.shape[1], fold, dim), named(
        lambda split, batch, head, row_block: (batch, 0, head, 0))) for dim in (hp, hvp))
    if params.values_in_keys:  # (the kernel reads the values from the key tiles)
      v, v_spec = k, kv
  else:
    k, v, table = pages
    page_size = k.shape[1]
    kv, v_spec = (pl.BlockSpec((k.shape[0], page_size, fold, dim), named(
        lambda split, batch, head, row_block: (0, 0, head, 0))) for dim in (hp, hvp))
    table_spec = pl.BlockSpec((None, table.shape[1]), named(
        lambda split, batch, head, row_block: (batch, 0)))
    if params.values_in_keys:
      v, v_spec = k, kv
    if page_size < block_k:  # whole pages a block, as many as divide a row's pages
      block_k = page_size * math.gcd(table.shape[1], block_k // page_size)
  blocks = pl.cdiv(inputs.key.shape[1], block_k)
  splits = used_splits(blocks, config.splits)
  whole = splits == 1
  kernel = functools.partial(_kernel, params=params, t=t, rows_used=g * t,
                             splits=splits, block_k=block_k,
                             page_size=None if pages is None else page_size,
                             split_axis=order.index("split"), head_axis=order.index("head"),
                             row_blocks=row_blocks, whole=whole, st=st)
  # Each row's (query length, key length, first key it may see, diagonal of its band): one
  # array, which XLA computes in one small fusion (1 µs; with the offsets as a second array it
  # took two, at MLA's B = 32, 8k on an H200).
  if first_keys is None:
    first_keys = jnp.zeros((b,), jnp.int32)
  diagonal = (jnp.zeros((b,), jnp.int32) if inputs.offsets is None
              else inputs.offsets[:, 0] - inputs.offsets[:, 1])
  bounds = jnp.concatenate([inputs.lengths, first_keys[:, None], diagonal[:, None]], axis=1)
  bounds_spec = pl.BlockSpec((None, 4), named(lambda split, batch, head, row_block: (batch, 0)))
  sizes = dict(split=splits, batch=b, head=kv_heads // fold * row_blocks)
  mask = mask_spec = None
  if inputs.mask is not None:  # [B, N or 1, T, S] -> rows (head g, token t) like the queries'
    mask = inputs.mask.astype(jnp.int8)  # (bytes, nonzero = visible)
    shared = mask.shape[1] == 1  # one mask for every head: a row per (g, t) of the group
    if shared:
      mask = jnp.broadcast_to(mask[:, :, None], (b, 1, g, t, mask.shape[3]))
    mask = mask.reshape(b, 1 if shared else kv_heads, g * t, mask.shape[-1])
    mask_spec = pl.BlockSpec((None, 1 if shared else fold, rows, mask.shape[3]),
                             named(lambda split, batch, head, row_block: (
                                 batch, 0 if shared else head, row_block, 0)))
  factors = factors_spec = None
  if row_factors is not None:  # [B, T, N] -> [B, K, G·T], rows like the queries'
    factors = row_factors.reshape(b, t, kv_heads, g).transpose(0, 2, 3, 1).reshape(
        b, kv_heads, g * t)
    factors_spec = pl.BlockSpec((None, fold, rows), named(
        lambda split, batch, head, row_block: (batch, head, row_block)))
  key_factors_spec = None
  if key_factors is not None:  # [B, K, S]: a key block's [block_k] of a head, contiguous
    key_factors_spec = pl.BlockSpec((None, fold, key_factors.shape[2]), named(
        lambda split, batch, head, row_block: (batch, head, 0)))
  return pl.pallas_call(
      kernel,
      grid=tuple(sizes[axis] for axis in order),
      in_specs=[pl.BlockSpec((None, fold, rows, hp), named(
                    lambda split, batch, head, row_block: (batch, head, row_block, 0))), kv, v_spec,
                bounds_spec, table_spec,
                mask_spec, factors_spec, key_factors_spec],
      out_specs=[pl.BlockSpec((None, fold, None, rows, hvp), named(
                     lambda split, batch, head, row_block: (batch, head, split, row_block, 0))),
                 pl.BlockSpec((None, fold, None, rows), named(
                     lambda split, batch, head, row_block: (batch, head, split, row_block)))],
      out_shape=[_core.out_struct((b, kv_heads, splits, g * t, st.value_dim),
                                  q.dtype if whole and not quantized else jnp.float32, q),
                 _core.out_struct((b, kv_heads, splits, g * t), jnp.float32, q)],
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=params.interpret,
      name="jaxflash_decode_split_kv",
  )(qg, k, v, bounds, table, mask, factors, key_factors)
