"""One checker for every numerical test: a backend against the float32 reference.

It draws fresh random inputs, runs `jaxflash.flash_attention` and `reference_attention`, and
compares the output, the LSE and the gradients of a random projection of the output with respect
to query, key and value, and to the bias when one is given. With dropout the reference gets the
dense keep mask that `jaxflash.dropout` defines for the same key. The same function serves the
CPU tests (interpret mode) and the `gpu` tests, so both check exactly the same things.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import dropout
from jaxflash.reference import reference_attention

# Relative (norm-wise) tolerances. float32 on the GPU runs its dots in TF32 (~3e-4).
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}
GPU_F32_TOLERANCE = 2e-3


def rel_err(got, want) -> float:
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  assert not np.isnan(got).any(), "NaN in result"
  denom = np.linalg.norm(want)
  return float(np.linalg.norm(got - want) / (denom if denom > 0 else 1.0))


def random_qkv(seed, b, t, s, n, k, h, dtype=jnp.float32, scale=1.0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = (scale * jax.random.normal(keys[0], (b, t, n, h))).astype(dtype)
  kk = (scale * jax.random.normal(keys[1], (b, s, k, h))).astype(dtype)
  v = jax.random.normal(keys[2], (b, s, k, h)).astype(dtype)
  d_out = jax.random.normal(keys[3], (b, t, n, h)).astype(jnp.float32)
  return q, kk, v, d_out


def check(implementation, *, b=2, t=37, s=53, n=4, k=2, h=40, dtype=jnp.float32, seed=0,
          interpret=None, tol=None, input_scale=1.0, grads=True, **options):
  """Asserts the backend matches the reference on fresh random inputs; returns the errors."""
  if interpret is None:
    interpret = implementation == "triton" and jax.default_backend() != "gpu"
  q, kk, v, d_out = random_qkv(seed, b, t, s, n, k, h, dtype, input_scale)
  options = {key: val(b, t, s, n, seed) if callable(val) else val
             for key, val in options.items()}
  tol = tol or TOLERANCE[dtype]
  bias = options.pop("bias", None)
  ref_options = dict(options)
  if options.get("dropout_rate", 0.0) > 0:
    rate = options["dropout_rate"]
    ref_options["dropout_keep"] = dropout.dense_keep_mask(
        dropout.seed_words(ref_options.pop("dropout_rng")), (b, n, t, s), rate,
        ref_options.pop("broadcast_dropout", False))
    # Kept entries are scaled by 1 / P(keep); P(keep) is 1 - rate on a 2**-16 grid.
    ref_options["dropout_rate"] = 1.0 - dropout.keep_probability(rate)

  def ours(q, kk, v, bias):
    return jaxflash.flash_attention(q, kk, v, bias, implementation=implementation,
                                    interpret=interpret, return_residual=True, **options)

  def ref(q, kk, v, bias):
    return reference_attention(q, kk, v, bias, **ref_options)

  out, lse = jax.jit(ours)(q, kk, v, bias)
  upcast = [x.astype(jnp.float32) for x in (q, kk, v)]
  ref_out, ref_lse = ref(*upcast, bias)
  assert out.dtype == q.dtype and out.shape == q.shape
  assert lse.dtype == jnp.float32 and lse.shape == (b, t, n)
  errors = {"out": rel_err(out, ref_out)}
  empty = ~np.isfinite(np.asarray(ref_lse))
  np.testing.assert_array_equal(np.asarray(lse) == -np.inf, empty, "rows with no visible key")
  errors["lse"] = rel_err(np.where(empty, 0.0, lse), np.where(empty, 0.0, ref_lse))
  if grads:
    def loss(fn):
      return lambda *a: jnp.sum(fn(*a)[0].astype(jnp.float32) * d_out)
    names, wrt = ("dq", "dk", "dv"), (0, 1, 2)
    if bias is not None:
      names, wrt = names + ("dbias",), wrt + (3,)
    got = jax.jit(jax.grad(loss(ours), argnums=wrt))(q, kk, v, bias)
    want = jax.grad(loss(ref), argnums=wrt)(*upcast, bias)
    for name, g, w, x in zip(names, got, want, (q, kk, v, bias)):
      assert g.dtype == x.dtype and g.shape == x.shape
      errors[name] = rel_err(g, w)
  bad = {name: e for name, e in errors.items() if not e <= tol}
  assert not bad, f"errors above {tol}: {bad} (all: {errors})"
  return errors
