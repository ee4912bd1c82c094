"""The contract every backend fulfils, and the error for calls a backend cannot serve."""

from __future__ import annotations

from typing import Any, Protocol

import jax

from jaxflash._core import Inputs, Params
from jaxflash.devices import Device


class UnsupportedCallError(ValueError):
  """An explicitly requested implementation cannot serve this call (the message says why).

  A `ValueError`, like every other rejection of arguments. Internally a backend does not raise it:
  it returns the reason from `Backend.supports`, so that ``implementation=None`` (or a sequence of
  preferences) moves on to the next backend.
  """


class Backend(Protocol):
  """One way of computing attention: a folder under `jaxflash.backends` and a registry line.

  Attributes:
    name: what ``implementation=`` calls it.
    Config: its frozen, keyword-only config dataclass (tiles, launch parameters).
  """

  name: str
  Config: type

  def supports(self, inputs: Inputs, params: Params, device: Device) -> str | None:
    """None if this backend can serve the call on ``device``; otherwise why not, in words that
    complete "implementation='<name>' cannot serve this call: ..."."""

  def default_config(self, inputs: Inputs, params: Params, device: Device) -> Any:
    """The heuristic config for this call (tuned tables per device kind where there are any)."""

  def forward(self, inputs: Inputs, params: Params, config: Any) -> tuple[jax.Array, jax.Array]:
    """``(out, lse2)`` as described in `jaxflash._core`."""

  def backward(self, inputs: Inputs, params: Params, config: Any, lse2: jax.Array,
               d_out: jax.Array, delta: jax.Array, want_dbias: bool):
    """``(dq, dk, dv, dbias)`` as described in `jaxflash._core`."""
