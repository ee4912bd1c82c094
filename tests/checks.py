"""What the test files share: the backends under test, their small test tiles, one call helper,
the option table, and one checker for every numerical test (a backend against the float32
reference).

`check` draws fresh random inputs, runs jaxflash and `reference_attention`, and compares the
output, the LSE and the gradients of a random projection of the output with respect to query,
key and value, and to the bias when one is given. With dropout the reference gets the dense keep
mask that `jaxflash.dropout` defines for the same key. The same function serves the CPU tests
(interpret mode, small tiles) and the `gpu` tests (compiled kernels, shipped tiles).

Configs are passed to jaxflash through its internal entry point
(`jaxflash.attention.attention_with_config`), never patched in.
"""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import backends
from jaxflash import devices
from jaxflash import dropout
from jaxflash.attention import attention_with_config
from jaxflash.backends import mosaic, triton, xla
from jaxflash.reference import reference_attention

# The backends with every feature, which the shared numerical tests run on every option. The
# "mosaic" backend (Hopper only, a subset of the options) has its own tests in test_mosaic.py.
BACKENDS = ("triton", "xla")
assert set(BACKENDS) <= set(backends.names())
# BACKENDS with Triton's case marked `variants` (its interpreter is the slow one on a CPU: the
# GPU runs it, and a CPU with JAXFLASH_ALL_VARIANTS=1), for tests whose Triton paths another
# CPU test holds.
BACKENDS_TRITON_VARIANT = [pytest.param("triton", marks=pytest.mark.variants), "xla"]


def variant_if(held: bool, *values, **param_options):
  """One parametrized case of ``values``, marked `variants` where ``held`` (another CPU case
  holds its path: the GPU runs it, and a CPU with JAXFLASH_ALL_VARIANTS=1)."""
  return pytest.param(*values, marks=pytest.mark.variants if held else (), **param_options)
ON_GPU = devices.has_nvidia_gpu()

# Tiles of 16 so that test sequences of ~50 cover several (and partial) blocks.
_SMALL_TILES = triton.Tiles(block_q=16, block_k=16, num_warps=4, num_stages=1)
SMALL_CONFIGS = {
    "triton": triton.Config(forward=_SMALL_TILES, backward=_SMALL_TILES),
    "xla": xla.Config(block_q=16, block_k=16),
    # The smallest Mosaic tiles (64-row wgmma); its gradients run the small Triton tiles.
    "mosaic": mosaic.Config(block_kv=64, num_stages=2,
                            triton=triton.Config(forward=_SMALL_TILES, backward=_SMALL_TILES)),
}

# Relative (norm-wise) tolerances. float32 on the GPU runs its dots in TF32 (~3e-4), so a float32
# comparison that is exact to ~1e-6 on a CPU allows F32_TOLERANCE where a GPU computes it.
GPU_F32_TOLERANCE = 2e-3
F32_TOLERANCE = GPU_F32_TOLERANCE if ON_GPU else 2e-5
TOLERANCE = {jnp.float32: F32_TOLERANCE, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}


def interpret_for(implementation: str) -> bool:
  """Pallas kernels run in interpret mode unless there is a GPU to compile them for."""
  return implementation in ("triton", "mosaic") and not ON_GPU


def config_for(implementation: str, small):
  """The small test tiles (``small`` True), None for the backend's shipped default (False), or
  ``small`` itself when it is a config."""
  if not isinstance(small, bool):
    return small
  return SMALL_CONFIGS[implementation] if small else None


def attention(implementation: str, q, k, v, bias=None, mask=None, *, small: bool = True,
              **options):
  """`jaxflash.flash_attention` on one backend: small tiles by default, interpret mode on a CPU."""
  return attention_with_config(q, k, v, bias, mask, implementation=implementation,
                               config=config_for(implementation, small),
                               interpret=interpret_for(implementation), **options)


def rel_err(got, want) -> float:
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  assert not np.isnan(got).any(), "NaN in result"
  denom = np.linalg.norm(want)
  return float(np.linalg.norm(got - want) / (denom if denom > 0 else 1.0))


def one_key_error(name, got, qkv, d_out, scale=None) -> float:
  """dQ or dK of a call with one key, against the size it would have without cancellation.

  A softmax over one key is the constant 1, so the exact dQ and dK are zero: dS = dP - delta
  cancels to rounding noise (TF32-sized on a GPU), and a relative error of one noise against
  another means nothing. So the gradient must instead be small next to scale * dP * K (for dQ)
  or scale * dP * Q summed over the group's rows (for dK), what it would be if delta were not
  subtracted.
  """
  q, kk, v = (np.asarray(x, np.float64) for x in qkv)
  group = q.shape[2] // kk.shape[2]
  k_rows, v_rows = (np.repeat(x, group, axis=2) for x in (kk, v))  # [B, 1, N, H]
  scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
  d_p = np.einsum("btnh,bsnh->btn", np.asarray(d_out, np.float64), v_rows)
  if name == "dq":
    uncancelled = scale * d_p[..., None] * k_rows
  else:
    per_head = scale * np.einsum("btn,btnh->bnh", d_p, q)
    uncancelled = per_head.reshape(q.shape[0], 1, kk.shape[2], group, -1).sum(axis=3)
  return float(np.linalg.norm(np.asarray(got, np.float64)) / np.linalg.norm(uncancelled))


def random_qkv(seed, b, t, s, n, k, h, dtype=jnp.float32, scale=1.0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = (scale * jax.random.normal(keys[0], (b, t, n, h))).astype(dtype)
  kk = (scale * jax.random.normal(keys[1], (b, s, k, h))).astype(dtype)
  v = jax.random.normal(keys[2], (b, s, k, h)).astype(dtype)
  d_out = jax.random.normal(keys[3], (b, t, n, h)).astype(jnp.float32)
  return q, kk, v, d_out


def random_array(seed, shape, kind):
  """bool (p = 0.7), float (normal) or ints in [0, kind)."""
  key = jax.random.key(seed + 1000)
  if kind == "bool":
    return jax.random.bernoulli(key, 0.7, shape)
  if kind == "float":
    return jax.random.normal(key, shape)
  return jax.random.randint(key, shape, 0, kind)


def random_lengths(b, t, s, n, seed):
  rng = np.random.default_rng(seed)
  return dict(query_seq_lengths=jnp.asarray(rng.integers(1, t + 1, b), jnp.int32),
              key_value_seq_lengths=jnp.asarray(rng.integers(1, s + 1, b), jnp.int32))


# Each option maker takes (b, t, s, n, seed) and returns keyword arguments.
OPTIONS = {
    "none": lambda *a: {},
    "causal": lambda *a: dict(is_causal=True),
    "window_pair": lambda *a: dict(local_window_size=(7, 3)),
    "causal_window": lambda *a: dict(is_causal=True, local_window_size=(9, 4)),
    "lengths": random_lengths,
    "segments_pair": lambda b, t, s, n, seed: dict(
        segment_ids=(random_array(seed, (b, t), 3), random_array(seed + 1, (b, s), 3))),
    "mask_full": lambda b, t, s, n, seed: dict(mask=random_array(seed, (b, n, t, s), "bool")),
    "mask_keys": lambda b, t, s, n, seed: dict(mask=random_array(seed, (b, 1, 1, s), "bool")),
    # Every broadcast shape of a bias, with its gradient, is in test_bias.py.
    "bias_full": lambda b, t, s, n, seed: dict(bias=random_array(seed, (b, n, t, s), "float")),
    "dropout": lambda b, t, s, n, seed: dict(dropout_rate=0.3,
                                             dropout_rng=jax.random.key(seed + 5)),
    "dropout_broadcast": lambda b, t, s, n, seed: dict(
        dropout_rate=0.5, dropout_rng=jax.random.key(seed + 6), broadcast_dropout=True),
    "soft_cap": lambda *a: dict(logits_soft_cap=1.5),
    "scale": lambda *a: dict(scale=0.37),
    # A non-positive scale turns the row max of q @ k.T into a row min of the logits: the
    # forward must not take its folded-scale path then.
    "scale_negative": lambda *a: dict(scale=-0.37),
    "scale_zero": lambda *a: dict(scale=0.0),
    # Attention sinks: their own gradient is checked in test_sinks.py.
    "sinks": lambda b, t, s, n, seed: dict(sinks=2.0 * random_array(seed, (n,), "float")),
    "everything": lambda b, t, s, n, seed: dict(
        is_causal=True, local_window_size=(20, 0), logits_soft_cap=3.0, scale=0.2,
        mask=random_array(seed, (b, 1, t, s), "bool"),
        bias=random_array(seed, (b, n, t, s), "float"),
        segment_ids=(random_array(seed, (b, t), 2), random_array(seed + 1, (b, s), 2)),
        dropout_rate=0.2, dropout_rng=jax.random.key(seed), **random_lengths(b, t, s, n, seed),
        sinks=random_array(seed, (n,), "float")),
}


def dense_mask_of(mask_mod=None, block_mask=None, *, b: int, t: int, s: int, n: int):
  """The [B, N, T, S] boolean mask a ``mask_mod`` (or a `jaxflash.BlockMask`) stands for,
  evaluated on broadcast index arrays (what the reference takes)."""
  if block_mask is not None:
    mask_mod = block_mask.split.reference
  idx = [jnp.arange(x, dtype=jnp.int32).reshape(shape) for x, shape in
         ((b, (b, 1, 1, 1)), (n, (1, n, 1, 1)), (t, (1, 1, t, 1)), (s, (1, 1, 1, s)))]
  return jnp.broadcast_to(mask_mod(*idx), (b, n, t, s))


def reference_options(options: dict, b: int, t: int, s: int, n: int) -> dict:
  """jaxflash options as `reference_attention` takes them (dropout as the dense keep mask, a
  mask_mod or block mask as a dense mask)."""
  ref_options = dict(options)
  ref_options.pop("deterministic", None)  # (how gradients are summed: the same values)
  if "mask_mod" in options or "block_mask" in options:
    dense = dense_mask_of(ref_options.pop("mask_mod", None), ref_options.pop("block_mask", None),
                          b=b, t=t, s=s, n=n)
    if ref_options.get("mask") is not None:
      dense = jnp.logical_and(dense, ref_options["mask"])
    ref_options["mask"] = dense
  if options.get("dropout_rate", 0.0) > 0:
    rate = options["dropout_rate"]
    ref_options["dropout_keep"] = dropout.dense_keep_mask(
        dropout.seed_words(ref_options.pop("dropout_rng")), (b, n, t, s), rate,
        ref_options.pop("broadcast_dropout", False))
    # Kept entries are scaled by 1 / P(keep); P(keep) is 1 - rate on a 2**-16 grid.
    ref_options["dropout_rate"] = 1.0 - dropout.keep_probability(rate)
  return ref_options


def check(implementation, *, b=2, t=37, s=53, n=4, k=2, h=40, dtype=jnp.float32, seed=0,
          small=True, tol=None, input_scale=1.0, grads=True, **options):
  """Asserts the backend matches the reference on fresh random inputs; returns the errors."""
  q, kk, v, d_out = random_qkv(seed, b, t, s, n, k, h, dtype, input_scale)
  options = {key: val(b, t, s, n, seed) if callable(val) else val
             for key, val in options.items()}
  tol = tol or TOLERANCE[dtype]
  bias = options.pop("bias", None)
  ref_options = reference_options(options, b, t, s, n)

  def ours(q, kk, v, bias):
    return attention(implementation, q, kk, v, bias, small=small, return_residual=True,
                     **options)

  def ref(q, kk, v, bias):
    return reference_attention(q, kk, v, bias, **ref_options)

  def with_grads(fn):
    """Output, LSE and the gradients of sum(out * d_out), in one program (forward traced once)."""
    def run(q, kk, v, bias):
      (out, lse), vjp = jax.vjp(fn, q, kk, v, bias)
      grads = vjp((d_out.astype(out.dtype), jnp.zeros_like(lse))) if grads_wanted else None
      return out, lse, grads
    return run

  grads_wanted = grads
  # (Jitted in Mosaic GPU's interpreter too, whose warpgroups wait for each other on threads of
  # XLA's CPU pool: with too few of them a jitted forward+backward deadlocked, and it ran op by
  # op, compiling 100-300 small programs a call, until tests/conftest.py sized the pool.)
  out, lse, got = jax.jit(with_grads(ours))(q, kk, v, bias)
  upcast = [x.astype(jnp.float32) for x in (q, kk, v)]
  # (jitted: op by op, the reference and its gradients compiled 100-500 small programs a call)
  ref_out, ref_lse, want = jax.jit(with_grads(ref))(*upcast, bias)
  chex.assert_shape(out, q.shape)
  chex.assert_shape(lse, (b, t, n))
  chex.assert_type([out, lse], q.dtype)  # jax.nn's dtype for the LSE
  errors = {"out": rel_err(out, ref_out)}
  empty = ~np.isfinite(np.asarray(ref_lse))
  np.testing.assert_array_equal(np.asarray(lse) == -np.inf, empty, "rows with no visible key")
  errors["lse"] = rel_err(np.where(empty, 0.0, lse), np.where(empty, 0.0, ref_lse))
  if grads:
    for name, g, w, x in zip(("dq", "dk", "dv", "dbias"), got, want, (q, kk, v, bias)):
      if x is None:
        continue
      chex.assert_equal_shape([g, x])
      chex.assert_type(g, x.dtype)
      if s == 1 and name in ("dq", "dk"):
        errors[name] = one_key_error(name, g, upcast, d_out, options.get("scale"))
      else:
        errors[name] = rel_err(g, w)
  bad = {name: e for name, e in errors.items() if not e <= tol}
  assert not bad, f"errors above {tol}: {bad} (all: {errors})"
  return errors


def dropped_weights(implementation, *, b=2, t=37, s=40, n=4, k=2, h=64, seed=0, small=True,
                    **options):
  """The dropped attention weights [B, N, T, S], read off the output with V = identity (S <= H)."""
  q, kk, _, _ = random_qkv(seed, b, t, s, n, k, h)
  v = jnp.broadcast_to(jnp.eye(s, h)[None, :, None, :], (b, s, k, h))
  out = jax.jit(lambda q, kk, v: attention(implementation, q, kk, v, small=small, **options))(
      q, kk, v)
  return np.asarray(jnp.transpose(out[..., :s], (0, 2, 1, 3)))


# ---------------------------------------------------------------------------------------------
# Lowering for CUDA on a CPU-only machine (see tests/test_lowering.py).

H100 = jax.sharding.AbstractMesh(
    (), (), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132))


@contextlib.contextmanager
def _verify_triton_modules():
  """Runs the MLIR verifier on each Triton module as it is built (e.g. scf.for bound types)."""
  from jax._src.pallas.triton import lowering as triton_lowering
  build = triton_lowering.lower_jaxpr_to_triton_module

  def build_and_verify(*args, **kwargs):
    result = build(*args, **kwargs)
    result.module.operation.verify()
    return result

  triton_lowering.lower_jaxpr_to_triton_module = build_and_verify
  try:
    yield
  finally:
    triton_lowering.lower_jaxpr_to_triton_module = build


def lower_for_cuda(fn, *args) -> str:
  """``fn`` lowered for an H100 (the abstract mesh makes jaxflash pick its GPU backend), with
  every Triton module verified; returns the StableHLO text."""
  with jax.sharding.use_abstract_mesh(H100), _verify_triton_modules():
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()



def load_example(name: str):
  """``examples/<name>.py`` as a module (the examples are scripts, not a package)."""
  path = pathlib.Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"jaxflash_example_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
