"""Which accelerator a call is for: the one place jaxflash (and its tests, examples and benchmarks)
asks.

A call is lowered for the device of the abstract mesh when one is set (that is how a CPU-only
machine lowers kernels for a GPU it does not have, see ``tests/test_lowering.py``), and otherwise
for JAX's first device. Backends read `Device` to say whether they can serve a call.
"""

from __future__ import annotations

import dataclasses
import re

import jax


@dataclasses.dataclass(frozen=True)
class Device:
  """What a backend needs to know about the device a call runs on."""

  platform: str  # "gpu", "cpu", "tpu", ...
  kind: str  # jax's device_kind, e.g. "NVIDIA H200"; "cpu" on a CPU
  nvidia: bool  # an NVIDIA GPU (ROCm GPUs also report platform "gpu")
  # Streaming multiprocessors as JAX reports them (a GPU's ``core_count``, an abstract device's
  # ``num_cores``); None where it reports none (a CPU, an abstract device made without them).
  cores: int | None = None

  @property
  def is_nvidia_gpu(self) -> bool:
    return self.platform == "gpu" and self.nvidia

  @property
  def sm_count(self) -> int:
    """The SMs a persistent grid or a wave of split-KV programs fills: JAX's count, else
    `sm_count`'s table of device kinds."""
    return sm_count(self.kind, self.cores)


def current() -> Device:
  """The device that a call traced now will be lowered for."""
  abstract = _abstract_device()
  if abstract is not None:
    kind = abstract.device_kind or ""
    return Device(platform=abstract.platform, kind=kind, nvidia="nvidia" in kind.lower(),
                  cores=_positive(getattr(abstract, "num_cores", None)))
  try:
    device = jax.devices()[0]
  except RuntimeError:  # no backend could be initialised
    return Device(platform="none", kind="", nvidia=False)
  version = str(getattr(device.client, "platform_version", "")).lower()
  nvidia = "nvidia" in device.device_kind.lower() or "cuda" in version
  return Device(platform=device.platform, kind=device.device_kind, nvidia=nvidia,
                cores=_positive(getattr(device, "core_count", None)) if nvidia else None)


def _positive(count) -> int | None:
  return count if isinstance(count, int) and count > 0 else None


# SMs of the NVIDIA parts jaxflash has tables for whose count is not the Hopper SXM's (H100 and
# H200 SXM, GH200: 132), read only where JAX gives no count of its own (`Device.cores`).
_SM_COUNTS = (("H100 PCIe", 114), ("H20", 78), ("A100", 108))


def sm_count(device_kind: str, cores: int | None = None) -> int:
  """SMs of a device: ``cores`` where JAX reported them, else the table's entry for the kind,
  else 132 (a Hopper SXM part)."""
  if cores:
    return cores
  # Whole words: a substring test took "NVIDIA H200" for an H20 (78 SMs), which left 54 of
  # its 132 SMs idle under a persistent grid.
  for name, count in _SM_COUNTS:
    if kind_is(device_kind, name):
      return count
  return 132


def kind_is(device_kind: str, name: str) -> bool:
  """Whether ``name`` (a model such as "H200" or "H100 PCIe") is a whole word of the device
  kind: "NVIDIA H200" is an H200 but neither an H20 nor a GH200."""
  pattern = r"(?<![A-Za-z0-9])" + re.escape(name) + r"(?![A-Za-z0-9])"
  return re.search(pattern, device_kind, flags=re.IGNORECASE) is not None


def has_nvidia_gpu() -> bool:
  """Whether calls here run on an NVIDIA GPU (the rule the tests' ``gpu`` marker uses too)."""
  return current().is_nvidia_gpu


def _abstract_device():
  try:
    mesh = jax.sharding.get_abstract_mesh()
  except AttributeError:  # an older jax without abstract meshes
    return None
  return getattr(mesh, "abstract_device", None)
