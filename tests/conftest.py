"""Shared test setup: small tile sizes (so short test sequences still span many blocks) and the
`gpu` marker's skip rule."""

import jax
import pytest

from jaxflash import triton as triton_backend
from jaxflash import xla as xla_backend

SMALL_TRITON_BLOCKS = triton_backend.BlockSizes(16, 16, 4, 1, 16, 16, 4, 1)
SMALL_XLA_BLOCKS = xla_backend.BlockSizes(16, 16)


def has_nvidia_gpu() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


@pytest.fixture
def small_blocks(monkeypatch):
  """Shrinks both backends' tiles to 16 so T, S ~ 50 cover several (and partial) blocks."""
  monkeypatch.setattr(triton_backend, "default_block_sizes", lambda *a: SMALL_TRITON_BLOCKS)
  monkeypatch.setattr(xla_backend, "default_block_sizes", lambda *a: SMALL_XLA_BLOCKS)


def pytest_collection_modifyitems(config, items):
  if has_nvidia_gpu():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
