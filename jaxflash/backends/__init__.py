"""The backend registry: which implementations exist, and which one serves a call.

Each backend lives in its own folder (forward and backward side by side, plus its config) and
is described by a `base.Backend`. `REGISTRY` lists them in order of preference: ``implementation=None``
takes the first one that supports the call on the current device (`jaxflash.devices`) and is
`preferred` for it (the faster one by measurement), a
sequence of names takes the first of those that does, and a single name must support it or the
call fails with the reason. Adding a backend is a folder and one line in `REGISTRY`.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxflash import devices
from jaxflash._core import Inputs, Params
from jaxflash.backends import mosaic, triton, xla
from jaxflash.backends.base import Backend, UnsupportedCallError

# Preference order for implementation=None (which also asks each backend's `preferred`).
REGISTRY: tuple[Backend, ...] = (mosaic.BACKEND, triton.BACKEND, xla.BACKEND)

__all__ = ["Backend", "REGISTRY", "UnsupportedCallError", "get", "names", "select"]


def names() -> tuple[str, ...]:
  """Every registered implementation name, in preference order."""
  return tuple(b.name for b in REGISTRY)


def get(name: str) -> Backend:
  for backend in REGISTRY:
    if backend.name == name:
      return backend
  raise ValueError(f"implementation must be None, one of {names()} or a sequence of them, "
                   f"got {name!r}")


def preferences(implementation) -> tuple[Backend, ...]:
  """``implementation=`` (None, a name or a sequence of names) as backends, checked."""
  if implementation is None:
    return REGISTRY
  if isinstance(implementation, str):
    return (get(implementation),)
  if isinstance(implementation, Sequence) and implementation:
    return tuple(get(name) for name in implementation)
  raise ValueError(f"implementation must be None, one of {names()} or a non-empty sequence of "
                   f"them, got {implementation!r}")


def select(implementation, inputs: Inputs, params: Params, config=None) -> Backend:
  """The backend that serves this call.

  A ``config`` decides the backend by its type (and must agree with ``implementation``).

  Raises:
    ValueError: an unknown name, or a config of another backend.
    UnsupportedCallError: no backend among the named ones can serve the call (the reasons are
      in the message).
  """
  candidates = preferences(implementation)
  if config is not None:
    owners = [b for b in candidates if isinstance(config, b.Config)]
    if not owners:
      raise ValueError(f"config {type(config).__qualname__} belongs to none of the requested "
                       f"implementations {tuple(b.name for b in candidates)}")
    candidates = owners[:1]
  device = devices.current()
  by_default = implementation is None and config is None
  reasons = []
  for backend in candidates:
    reason = backend.supports(inputs, params, device)
    if reason is None and by_default and backend.preferred is not None:
      if not backend.preferred(inputs, params, device):
        reason = "not the faster backend for such calls on this device (by measurement)"
    if reason is None:
      return backend
    reasons.append(f"implementation={backend.name!r} cannot serve this call: {reason}")
  raise UnsupportedCallError("; ".join(reasons))
