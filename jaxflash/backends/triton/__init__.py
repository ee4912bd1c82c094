"""Backend "triton": Pallas kernels lowered through Triton, for NVIDIA GPUs.

- `config.py`: tiles and launch parameters (`Config`) and the tuned tables per device kind;
- `tiles.py`: what the kernels share (optional inputs as a pytree, masked loads, tile logits);
- `forward.py`: the forward kernel (O and LSE);
- `backward.py`: the dQ and dK/dV kernels; `dbias.py`: the bias gradient.

The kernel modules import Pallas' Triton lowering, so they are imported on first use: choosing a
backend (`supports`, `default_config`) costs no Pallas import.
"""

from __future__ import annotations

from jaxflash import fp8
from jaxflash._core import Inputs, Params
from jaxflash.backends.base import Backend
from jaxflash.backends.triton.config import Config, Tiles, default_config
from jaxflash.devices import Device

# Largest head dim the kernels take: a 256-wide tile of Q plus K/V tiles must fit in shared
# memory; wider heads would need a split over the head dimension.
MAX_HEAD_DIM = 256

__all__ = ["BACKEND", "Config", "MAX_HEAD_DIM", "Tiles", "default_config", "runs_on"]


def _supports(inputs: Inputs, params: Params, device: Device) -> str | None:
  if params.kernel_mask_reason is not None:
    return params.kernel_mask_reason
  if fp8.is_fp8(inputs.query.dtype):
    return "float8 inputs (the Mosaic forward and the XLA backend take them)"
  head_dim = inputs.query.shape[-1]
  if head_dim > MAX_HEAD_DIM:
    return f"head dims up to {MAX_HEAD_DIM} only, got query.shape[-1] = {head_dim}"
  if inputs.value.shape[-1] > MAX_HEAD_DIM:
    return (f"value head dims up to {MAX_HEAD_DIM} only, got value.shape[-1] = "
            f"{inputs.value.shape[-1]}")
  if not runs_on(device, params):
    return (f"it needs an NVIDIA GPU (this call is for {device.kind or device.platform!r}); "
            f"pass interpret=True to run its kernels in interpret mode")
  return None


def runs_on(device: Device, params: Params) -> bool:
  """Whether the Triton kernels can run for a call on ``device``: an NVIDIA GPU, or any device
  in interpret mode."""
  return device.is_nvidia_gpu or params.interpret


def _default_config(inputs: Inputs, params: Params, device: Device) -> Config:
  q = inputs.query
  # Tiles sized for the wider of the two head dims (Q/K, V/O) fit in shared memory.
  head_dim = max(q.shape[-1], inputs.value.shape[-1])
  return default_config(head_dim, q.dtype, params.window.is_causal, q.shape[1], device.kind)


BACKEND = Backend(name="triton", Config=Config, package=__name__, supports=_supports,
                  default_config=_default_config)
