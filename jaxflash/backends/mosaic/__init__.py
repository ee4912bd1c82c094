"""Backend "mosaic": Pallas kernels lowered through Mosaic GPU, for Hopper GPUs (sm90).

- `config.py`: tiles and pipeline depth (`Config`) and the rule that picks them;
- `forward.py`: the warp-specialised forward (TMA producer, two ping-ponging wgmma consumers);
- `backward.py`: the warp-specialised dK/dV and dQ kernels (deterministic by default); calls
  they do not serve (biases, partial results above head dim 128 or with a value head dim of
  their own) run the Triton backward on the Mosaic forward's LSE;
- `decode.py`: the split-KV decoding forward of absorbed MLA's latent cache (heads of 576/512,
  FlashMLA's design), which `jaxflash.ops.decode.split_kv_path` pairs with the XLA backend's
  backward; not a backend of its own.

What the forward does not do (float32; partial results at D = 256) is declared here, so
``implementation=None`` moves on to the next backend for such calls and
``implementation="mosaic"`` says why it cannot serve them. Bias and mask tiles and segment ids
are read from global memory by the consumers, without a TMA pipeline of their own yet.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxflash import fp8
from jaxflash._core import Inputs, Params
from jaxflash.backends.base import Backend
from jaxflash.backends.mosaic.config import Backward, Config, default_config, faster_than_triton
from jaxflash.devices import Device, kind_is

MAX_HEAD_DIM = 256

# Device kinds with sm90 (wgmma and TMA), as jax names them.
HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")

__all__ = ["BACKEND", "Backward", "Config", "MAX_HEAD_DIM", "default_config", "is_hopper"]


def is_hopper(device: Device) -> bool:
  return device.is_nvidia_gpu and any(kind_is(device.kind, name) for name in HOPPER_KINDS)


def _supports(inputs: Inputs, params: Params, device: Device) -> str | None:
  if params.kernel_mask_reason is not None:
    return params.kernel_mask_reason
  rule = params.score_rule
  if rule is not None and inputs.offsets is not None:
    # (Its index tiles, computed columns and bands are made for positions from 0; a mask_mod's
    # index tiles take the offsets.)
    return "a score_mod in a call of part of the keys or queries"
  if rule is not None and rule.lookups:
    if rule.lookup_reason is not None or inputs.score_bands is None:
      return rule.lookup_reason or "a score_mod's lookups without their band of values"
  q = inputs.query
  if not (is_hopper(device) or params.interpret):
    return (f"it needs a Hopper GPU (sm90: H100, H200), and this call is for "
            f"{device.kind or device.platform!r}; pass interpret=True to run its kernel in "
            f"Mosaic GPU's interpreter")
  quantized = fp8.is_fp8(q.dtype)
  if q.dtype not in (jnp.bfloat16, jnp.float16) and not quantized:
    return f"bfloat16, float16 and float8 only, got {q.dtype}"
  if q.shape[-1] > MAX_HEAD_DIM:
    return f"head dims up to {MAX_HEAD_DIM} only, got query.shape[-1] = {q.shape[-1]}"
  if inputs.value.shape[-1] > MAX_HEAD_DIM:
    return (f"value head dims up to {MAX_HEAD_DIM} only, got value.shape[-1] = "
            f"{inputs.value.shape[-1]}")
  if _default_config(inputs, params, device) is None:
    return (f"a float32 partial result at head dim {q.shape[-1]} does not fit in shared "
            f"memory")
  return None


def _default_config(inputs: Inputs, params: Params, device: Device) -> Config | None:
  q = inputs.query
  return default_config(q.shape[-1], q.dtype, params.window.is_causal, q.shape[1], device.kind,
                        params.partial, inputs.value.shape[-1],
                        block_table=inputs.block_table is not None,
                        groups=q.shape[2] // inputs.key.shape[2],
                        lookups=inputs.score_bands is not None, sms=device.sm_count,
                        window_keys=params.window.keys_per_row)


def _preferred(inputs: Inputs, params: Params, device: Device) -> bool:
  """Whether ``implementation=None`` takes this backend: only where the benchmark measured it
  faster than the Triton one on this device kind, head dims, band and key length
  (`config.FASTER_THAN_TRITON`, and `config.FASTER_THAN_TRITON_VALUE_DIM` for a value head dim
  of its own)."""
  if fp8.is_fp8(inputs.query.dtype):  # the only FP8 kernel
    return True
  return faster_than_triton(device.kind, inputs.query.shape[-1], inputs.key.shape[1],
                            params.window.is_causal, inputs.value.shape[-1])


BACKEND = Backend(name="mosaic", Config=Config, package=__name__, supports=_supports,
                  default_config=_default_config, preferred=_preferred,
                  interpreter_partitions=False)
