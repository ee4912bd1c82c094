"""Backend "xla": the FlashAttention algorithm in plain JAX (blockwise loops, online softmax,
recomputing backward). Runs on any device; the default where no kernel backend applies.

Memory is O(T + S) per head: the largest temporary is one [B, N, block_q, block_k] tile.
- `blocks.py`: `Config`, padding and the tile readers both passes share;
- `forward.py`, `backward.py`: the two passes.
"""

from __future__ import annotations

from jaxflash._core import Inputs, Params
from jaxflash.backends.xla import backward, forward
from jaxflash.backends.xla.blocks import Config
from jaxflash.devices import Device

__all__ = ["BACKEND", "Config"]


class _XLA:
  name = "xla"
  Config = Config

  def supports(self, inputs: Inputs, params: Params, device: Device) -> str | None:
    del inputs, params, device
    return None  # every option, every shape, every device

  def default_config(self, inputs: Inputs, params: Params, device: Device) -> Config:
    del inputs, params, device
    return Config()

  def forward(self, inputs: Inputs, params: Params, config: Config):
    return forward.forward(inputs, params, config)

  def backward(self, inputs: Inputs, params: Params, config: Config, lse2, d_out, delta,
               want_dbias: bool):
    return backward.backward(inputs, params, config, lse2, d_out, delta, want_dbias)

  def __repr__(self) -> str:
    return "<jaxflash backend 'xla'>"


BACKEND = _XLA()
