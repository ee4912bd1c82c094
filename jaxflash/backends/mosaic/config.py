"""Tiles and pipeline depth of the Mosaic GPU forward, and the rule that chooses them.

A CTA runs two consumer warpgroups, each owning ``block_q`` query rows (so a CTA covers
``2 * block_q`` rows), and one producer warpgroup that streams ``block_kv``-row tiles of K and V
through a ring of ``num_stages`` shared-memory slots. Until the Mosaic backward exists, the
gradients come from the Triton kernels, with the Triton config in ``triton``.
"""

from __future__ import annotations

import dataclasses

from jaxflash.backends.triton import config as triton_config
from jaxflash.devices import kind_is

# Shared memory a CTA may use on sm90 (227 KiB), less what Mosaic GPU adds to the tiles counted
# in `smem_bytes`: 2 KiB of reduction scratch plus barriers and alignment (2.6 KiB measured, in
# the lowering's own check, for D = 128 with float32 O tiles).
SMEM_BUDGET = 227 * 1024 - 4096


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Forward tiles of the Mosaic GPU kernel; ``triton`` serves the backward for now."""

  block_q: int = 64  # rows per consumer warpgroup (a wgmma M is 64)
  block_kv: int = 128
  num_stages: int = 2  # K/V ring depth
  # With a causal band, the CTAs whose rows see the most keys are launched first, so that the
  # short ones fill the tail of the grid instead of one long CTA running alone at the end.
  heavy_first: bool = True
  # A persistent grid of this many CTAs (the SM count), each running every ``persistent_ctas``-th
  # query tile: the K/V ring, the next tile's Q load and the last tile's O store run on across
  # tiles. None: one CTA per query tile.
  persistent_ctas: int | None = None
  # FlashAttention-3's intra-warpgroup overlap: each step issues the next block's Q Kᵀ with this
  # block's P V and runs the softmax while P V is in flight. It holds two P tiles and S in
  # registers next to O, so it needs smaller key tiles at large head dims.
  intra_wg_overlap: bool = False
  triton: triton_config.Config = triton_config.Config()

  def __post_init__(self):
    if self.block_q != 64:
      raise ValueError(f"block_q must be 64 (one wgmma M per warpgroup), got {self.block_q}")
    if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
      raise ValueError(f"block_kv must be 64, 128, 192 or 256, got {self.block_kv}")
    if self.num_stages < 2:
      raise ValueError(f"num_stages must be at least 2, got {self.num_stages}")
    if self.persistent_ctas is not None and self.persistent_ctas < 1:
      raise ValueError(f"persistent_ctas must be None or positive, got {self.persistent_ctas}")


def padded_head_dim(head_dim: int) -> int:
  """Head dims are padded to a multiple of 64: one 128-byte swizzled row of 16-bit elements."""
  return -(-head_dim // 64) * 64


def smem_bytes(config: Config, head_dim: int, partial: bool = False) -> int:
  """Shared memory of one CTA: two Q tiles, the K and V rings, the LSE rows, and two O tiles
  of their own for a partial result (float32) or a persistent CTA (16-bit); otherwise a
  16-bit O goes out through the Q tiles."""
  hp = padded_head_dim(head_dim)
  tiles = 2 * (2 * config.block_q * hp + 2 * config.num_stages * config.block_kv * hp)
  o_bytes = 4 if partial else 2 if config.persistent_ctas is not None else 0
  return tiles + 8 * 64 + o_bytes * 2 * config.block_q * hp


# Streaming multiprocessors of the Hopper parts (SXM and GH200: 132), for persistent grids.
_SM_COUNTS = (("H100 PCIe", 114), ("H20", 78))


def sm_count(device_kind: str) -> int:
  # Whole words: a substring test took "NVIDIA H200" for an H20 (78 SMs), which left 54 of
  # its 132 SMs idle under a persistent grid.
  for name, count in _SM_COUNTS:
    if kind_is(device_kind, name):
      return count
  return 132


def fits(config: Config, head_dim: int, partial: bool = False) -> bool:
  return smem_bytes(config, head_dim, partial) <= SMEM_BUDGET


# (block_kv, num_stages) by (padded head dim, causal) where the tuner (`bench.py --tune`, bf16,
# S = 1k and 4k, H200, 2026-11-21) found better than the rule below: D = 64 without a causal band
# gains from a 256-key tile (325 vs 320 TFLOP/s at 1k, 426 vs 401 at 4k). Everywhere else the
# rule's tiles won; a persistent grid lost everywhere (0.63-0.69x, benchmarks/NOTES.md).
TUNED = {(64, False): (256, 2)}


def default_config(head_dim: int, dtype, causal: bool, q_len: int, device_kind: str,
                   partial: bool = False) -> Config | None:
  """`TUNED`'s tiles, else the 128-key tile if its two-slot ring fits in shared memory, else
  the 64-key one; None if none fits (partial results at D = 256). One CTA per query tile,
  causal CTAs launched heaviest first."""
  backward = triton_config.default_config(head_dim, dtype, causal, q_len, device_kind)
  tuned = TUNED.get((padded_head_dim(head_dim), causal))
  for block_kv, stages in ((tuned,) if tuned else ()) + ((128, 2), (64, 2)):
    config = Config(block_kv=block_kv, num_stages=stages, triton=backward)
    if fits(config, head_dim, partial):
      return config
  return None


# Where the Mosaic forward measured faster than the Triton one: device kind -> {padded head dim:
# the shortest key length it wins from}. ``implementation=None`` picks it only there, and
# `jaxflash.backends` falls through to Triton elsewhere. H200, bf16, 2026-11-21
# (benchmarks/results/mosaic_h200_2026-11-21): forward 1.1-1.6x Triton's at D = 128 and 2.3-3.0x
# at D = 256 from S = 512; at D = 64 0.88-1.06x up to S = 1k (below Triton in three of those four
# cells) and 1.08-1.24x from 2k. Forward+backward (the backward is Triton's in both) is
# 0.97-1.13x. Not yet measured on an H100, and not at D = 192.
FASTER_THAN_TRITON: dict[str, dict[int, int]] = {"H200": {64: 2048, 128: 0, 256: 0}}


def faster_than_triton(device_kind: str, head_dim: int, kv_len: int) -> bool:
  for kind, min_kv_len in FASTER_THAN_TRITON.items():
    if kind_is(device_kind, kind):
      least = min_kv_len.get(padded_head_dim(head_dim))
      return least is not None and kv_len >= least
  return False
