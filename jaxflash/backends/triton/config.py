"""Tiles and launch parameters of the Triton kernels, and the tuned tables that choose them.

A `Config` is passed to the kernels, never patched in: tests pass small tiles, the benchmark's
tuner passes candidates, and everyone else gets `default_config`, which reads `TUNED`. Tables are
data per device kind; a new card is a new table. The measurements behind the H200 table are in
``benchmarks/NOTES.md`` and ``benchmarks/results/tuning/``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxflash.devices import kind_is


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tiles:
  """One pass's tile shape and launch parameters. Blocks are clipped to the (power-of-two
  rounded) sequence lengths and kept >= 16 by the kernels."""

  block_q: int
  block_k: int
  num_warps: int = 4
  num_stages: int = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Tiles of the forward kernel and of the backward kernels (dQ, dK/dV and dbias share them)."""

  forward: Tiles = Tiles(block_q=128, block_k=64, num_warps=4, num_stages=3)
  backward: Tiles = Tiles(block_q=64, block_k=64, num_warps=4, num_stages=2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
  """A table row: applies when every condition given holds (None: any).

  ``head_dim`` bounds the head dim padded to a power of two; ``wide`` is float32 (tiles take
  twice the shared memory); ``causal`` is a band that ends at or before the diagonal; ``max_q_len``
  bounds the query length.
  """

  config: Config
  head_dim: int | None = None
  wide: bool | None = None
  causal: bool | None = None
  max_q_len: int | None = None

  def matches(self, head_dim: int, wide: bool, causal: bool, q_len: int) -> bool:
    return ((self.head_dim is None or head_dim <= self.head_dim)
            and (self.wide is None or wide == self.wide)
            and (self.causal is None or causal == self.causal)
            and (self.max_q_len is None or q_len <= self.max_q_len))


def _tiles(block_q, block_k, num_warps, num_stages) -> Tiles:
  return Tiles(block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages)


def _config(forward, backward) -> Config:
  return Config(forward=_tiles(*forward), backward=_tiles(*backward))


# First matching rule wins. Triangular (causal) grids change what is fastest: a 64-row forward
# tile wastes less of the diagonal block on short sequences, and a single-stage backward pipeline
# suits the shorter key loops at D = 64.
_H200 = (
    Rule(head_dim=64, causal=True, config=_config((64, 64, 4, 3), (64, 64, 4, 1))),
    Rule(head_dim=64, config=_config((64, 64, 4, 3), (64, 64, 4, 2))),
    Rule(head_dim=128, wide=True, config=_config((64, 64, 4, 2), (32, 64, 4, 2))),
    Rule(head_dim=128, causal=True, max_q_len=1024,
         config=_config((64, 64, 4, 3), (64, 64, 4, 2))),
    Rule(head_dim=128, config=_config((128, 64, 8, 3), (64, 64, 4, 2))),
    Rule(wide=True, config=_config((32, 32, 4, 2), (16, 32, 4, 1))),
    Rule(config=_config((64, 64, 8, 2), (32, 64, 8, 1))),
)

# Tables by a word of the device kind; cards without their own table use DEFAULT_TABLE (only the
# H200 has been tuned so far; the H100 shares its Hopper shared-memory limits).
TUNED: dict[str, tuple[Rule, ...]] = {"H200": _H200}
DEFAULT_TABLE = "H200"


def table_for(device_kind: str) -> tuple[Rule, ...]:
  for name, table in TUNED.items():
    if kind_is(device_kind, name):
      return table
  return TUNED[DEFAULT_TABLE]


def padded_head_dim(head_dim: int) -> int:
  """The head dim the tiles use: a power of two, at least 16 (Triton's dot needs both)."""
  return max(16, 1 << (head_dim - 1).bit_length())


def default_config(head_dim: int, dtype, causal: bool = False, q_len: int | None = None,
                   device_kind: str = "") -> Config:
  """The tuned config for this head dim, dtype, band and query length on ``device_kind``."""
  wide = np.dtype(dtype).itemsize > 2
  q_len = q_len if q_len is not None else 1 << 30
  for rule in table_for(device_kind):
    if rule.matches(padded_head_dim(head_dim), wide, causal, q_len):
      return rule.config
  return Config()
