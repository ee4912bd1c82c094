"""Backend "xla": the FlashAttention algorithm in plain JAX (blockwise loops, online softmax,
recomputing backward). Runs on any device; the default where no kernel backend applies.

Memory is O(T + S) per head: the largest temporary is one [B, N, block_q, block_k] tile.
- `blocks.py`: `Config`, padding and the tile readers both passes share;
- `forward.py`, `backward.py`: the two passes.
"""

from __future__ import annotations

from jaxflash.backends.base import Backend
from jaxflash.backends.xla.blocks import Config

__all__ = ["BACKEND", "Config"]

BACKEND = Backend(
    name="xla", Config=Config, package=__name__,
    supports=lambda inputs, params, device: None,  # every option, every shape, every device
    default_config=lambda inputs, params, device: Config())
