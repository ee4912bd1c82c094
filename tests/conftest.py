"""Shared test setup: a faster CPU compiler setting and an on-disk compilation cache for the
run, the `gpu` marker's skip rule (the same device check jaxflash itself uses), and the
`cuda_plugin` fixture of the tests that lower Mosaic GPU kernels for CUDA on a CPU-only
machine."""

import importlib.util
import os
import shutil
import tempfile

# On a CPU-only machine compiling dominates the suite (interpret-mode kernels are large XLA
# programs) and run times are tiny: LLVM at -O0 compiles them in about 60% of the time. Set
# before JAX initialises its backend; left alone where a GPU driver is present.
if shutil.which("nvidia-smi") is None and "xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()

# Four CPU devices, so that sharded calls (tests/test_sharding.py) run on a CPU-only machine; a
# call on unsharded arrays still runs on the first one.
if shutil.which("nvidia-smi") is None and "device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"

# XLA sizes its CPU client's thread pool from NPROC (else the core count), and Mosaic GPU's
# interpreter holds one of those threads per warpgroup while it waits on a barrier: on two
# cores a CTA of four warpgroups (the forward's three consumers and its producer) would wait
# for ever. Eight threads leave room (tests/test_mosaic.py::test_three_consumers).
if shutil.which("nvidia-smi") is None:
  os.environ.setdefault("NPROC", "8")

# With the CUDA plugin installed for lowering (CI) but no GPU, JAX would try CUDA first and
# print its failure; the CPU is the only platform here.
if shutil.which("nvidia-smi") is None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Inline dispatch on the CPU. A kernel in Mosaic GPU's interpreter runs each warpgroup as a
# computation of its own, started from the kernel call's callback, and XLA's CPU device admits
# 32 computations in flight (its `max_inflight_computations` semaphore, taken at dispatch).
# With asynchronous dispatch the rest of a test's computations can fill those slots while the
# kernel runs, and then neither side moves: `.ci/run` hung once that way (2026-12-05,
# test_user_paths.py::test_rows_hidden_by_a_huge_finite_logit_in_the_kernels on Mosaic: three
# warpgroup threads and the test's own thread all waiting for the semaphore, the kernel's
# callback waiting for the warpgroups), after four runs of the same code had passed. Inline,
# each thread holds at most the computation it runs. (Sharded computations stay asynchronous.)
if shutil.which("nvidia-smi") is None:
  import jax  # noqa: E402

  jax.config.update("jax_cpu_enable_async_dispatch", False)

import pytest  # noqa: E402

from jaxflash import devices  # noqa: E402


def pytest_configure(config):
  # On a CPU-only machine, XLA's compilation cache on disk, one folder for the run and shared by
  # its xdist workers (they inherit the variable: the controller configures before it starts
  # them): many tests compile the same interpret-mode programs, which then compile once (the
  # suite about 7% faster on two cores). Removed when the run ends.
  if shutil.which("nvidia-smi") is not None:
    return
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxflash-xla-cache-")
    config.stash[_OWN_CACHE] = os.environ["JAX_COMPILATION_CACHE_DIR"]
  import jax
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
  if _OWN_CACHE in config.stash:
    shutil.rmtree(config.stash[_OWN_CACHE], ignore_errors=True)


_OWN_CACHE = pytest.StashKey[str]()


def pytest_collection_modifyitems(config, items):
  # The tests that lower Mosaic GPU kernels for CUDA (they take the `cuda_plugin` fixture) are
  # marked, so that CI's pinned suite can select them: `-m cuda_lowering`.
  for item in items:
    if "cuda_plugin" in getattr(item, "fixturenames", ()):
      item.add_marker(pytest.mark.cuda_lowering)
  # More tiles and schedules of the Mosaic interpreter tests (whose base cases always run),
  # cases whose paths another CPU case holds, and the slowest smoke runs of benchmark scripts:
  # the GPU runs them, and a CPU with JAXFLASH_ALL_VARIANTS=1; a plain run and CI skip them,
  # which keeps the README's test command and CI shorter (docs/testing.md).
  if os.environ.get("JAXFLASH_ALL_VARIANTS") != "1" and not devices.has_nvidia_gpu():
    skip_variant = pytest.mark.skip(
        reason="a tile variant, an extra case or a slow smoke run (the GPU runs it): set "
        "JAXFLASH_ALL_VARIANTS=1 to run")
    for item in items:
      if "variants" in item.keywords:
        item.add_marker(skip_variant)
  if devices.has_nvidia_gpu():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def _cuda_plugin_installed() -> bool:
  """Whether jax-cuda13-plugin is importable. (``find_spec`` of a submodule raises, rather than
  returning None, when its parent package ``jax_plugins`` is absent too.)"""
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
  except ModuleNotFoundError:
    return False


@pytest.fixture
def cuda_plugin():
  """Lowering Mosaic GPU kernels for CUDA needs the CUDA plugin, which a plain `pip install` of
  the package does not bring: without it the test skips, or fails where
  ``JAXFLASH_REQUIRE_CUDA_LOWERING=1`` asks for these tests to run (CI)."""
  if _cuda_plugin_installed():
    return
  message = ("lowering Mosaic GPU kernels for CUDA needs jax-cuda13-plugin and jax-cuda13-pjrt "
             "of the installed jax's version (pip install --no-deps)")
  if os.environ.get("JAXFLASH_REQUIRE_CUDA_LOWERING") == "1":
    pytest.fail(f"JAXFLASH_REQUIRE_CUDA_LOWERING=1, but {message}")
  pytest.skip(message)
