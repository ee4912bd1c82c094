"""Gradients of a Mosaic GPU forward: the Triton dQ and dK/dV kernels, for now.

The backward needs only the inputs and the base-2 LSE, which the Mosaic forward writes in the
convention every backend shares (`jaxflash._core`), so the Triton backward differentiates it
exactly. A Mosaic backward (warp-specialised dK/dV and dQ) is the next step; until then
``config.triton`` holds the tiles of these kernels.
"""

from __future__ import annotations

from jaxflash._core import Inputs, Params
from jaxflash.backends.mosaic.config import Config
from jaxflash.backends.triton import backward as triton_backward


def backward(inputs: Inputs, params: Params, config: Config, lse2, d_out, delta, want_dbias):
  """``(dq, dk, dv, dbias)`` (see `jaxflash._core`)."""
  return triton_backward.backward(inputs, params, config.triton, lse2, d_out, delta, want_dbias)
