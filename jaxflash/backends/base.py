"""The contract every backend fulfils, and the error for calls a backend cannot serve."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import jax

from jaxflash._core import Inputs, Params
from jaxflash.devices import Device


class UnsupportedCallError(ValueError):
  """An explicitly requested implementation cannot serve this call (the message says why).

  A `ValueError`, like every other rejection of arguments. Internally a backend does not raise it:
  it returns the reason from `Backend.supports`, so that ``implementation=None`` (or a sequence of
  preferences) moves on to the next backend.
  """


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a static argument of the VJP
class Backend:
  """One way of computing attention: a package under `jaxflash.backends` and a registry line.

  The package holds ``forward.py`` with ``forward(inputs, params, config) -> (out, lse2)`` and
  ``backward.py`` with ``backward(inputs, params, config, lse2, d_out, delta, want_dbias) ->
  (dq, dk, dv, dbias)``, as `jaxflash._core` describes them. They are imported on first use, so
  choosing a backend costs no kernel import.

  Attributes:
    name: what ``implementation=`` calls it.
    Config: its frozen, keyword-only config dataclass (tiles, launch parameters).
    package: the module path of the package.
    supports: ``(inputs, params, device) -> None`` if the backend can serve the call on
      ``device``, else the reason, in words that complete "implementation='<name>' cannot serve
      this call: ...".
    default_config: ``(inputs, params, device) -> Config``, the heuristic config for the call
      (tuned tables per device kind where there are any).
    preferred: ``(inputs, params, device) -> bool``, whether ``implementation=None`` may pick
      this backend for a call it supports (by measurement: a backend that is not yet the
      faster one for such calls leaves them to the next). None: always.
    interpreter_partitions: whether its kernels in interpret mode (``interpret=True``, the CPU
      tests) can run inside a partitioned op (`jaxflash.ops.partitioning`). Mosaic GPU's
      interpreter works through ordered io_callbacks, which `custom_partitioning` cannot lower,
      so its interpreted calls run whole.
  """

  name: str
  Config: type
  package: str
  supports: Callable[[Inputs, Params, Device], str | None]
  default_config: Callable[[Inputs, Params, Device], Any]
  preferred: Callable[[Inputs, Params, Device], bool] | None = None
  interpreter_partitions: bool = True

  def forward(self, inputs: Inputs, params: Params, config: Any) -> tuple[jax.Array, jax.Array]:
    return importlib.import_module(f"{self.package}.forward").forward(inputs, params, config)

  def backward(self, inputs: Inputs, params: Params, config: Any, lse2: jax.Array,
               d_out: jax.Array, delta: jax.Array, want_dbias: bool):
    module = importlib.import_module(f"{self.package}.backward")
    return module.backward(inputs, params, config, lse2, d_out, delta, want_dbias)

  def __repr__(self) -> str:
    return f"<jaxflash backend {self.name!r}>"
