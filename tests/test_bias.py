"""Gradients with respect to a dense additive bias, and what a bias or mask costs when nothing
asks for their gradient.

The gradient itself is also compared with the reference for every bias case of `OPTIONS` in
`test_attention.py` (`checks.check` differentiates the bias whenever one is given).
"""

import math
import re

import jax
import jax.numpy as jnp
import pytest

import jaxflash
from checks import BACKENDS, attention, check, lower_for_cuda, random_qkv, variant_if


# Lower-rank biases ("NTS", "S") reach the backends as "1NTS" and "11TS" (normalised in the
# public API, the same for every backend): the kernels see five distinct layouts.
BIAS_CASES = ([(impl, shape) for impl in BACKENDS for shape in ("BNTS", "1NTS", "B1TS", "11TS",
                                                                 "1N1S")]
              + [("xla", "NTS"), ("xla", "S")])
# Variants (the GPU runs them, and a CPU with JAXFLASH_ALL_VARIANTS=1):
# - "BNTS" (no sum: each bias entry is one batch row's and head's): test_attention.py's
#   test_option[triton-everything] and [xla-everything] hold it, a [B, N, T, S] bias
#   differentiated with causal GQA, soft cap, lengths and dropout;
# - "1N1S": `_checks` broadcasts the query axis before the backends, which then sum a [1, N, T, S]
#   bias's gradient as for "1NTS" (held there; "S" holds a bias broadcast over the queries);
# - XLA's "NTS": normalised to "1NTS" (held there, and test_user_paths.py::test_enable_x64[xla]
#   differentiates an [N, T, S] bias).
BIAS_VARIANTS = {("triton", "BNTS"), ("xla", "BNTS"), ("triton", "1N1S"), ("xla", "1N1S"),
                 ("xla", "NTS")}


@pytest.mark.parametrize("implementation,bias_shape", [
    variant_if(case in BIAS_VARIANTS, *case) for case in BIAS_CASES])
def test_bias_gradient_is_summed_over_broadcast_axes(implementation, bias_shape):
  """Any shape broadcastable to [B, N, T, S], with causal GQA, soft cap, lengths and dropout."""
  b, t, s, n, k = 2, 37, 53, 4, 2
  sizes = dict(B=b, N=n, T=t, S=s, **{"1": 1})
  shape = tuple(sizes[c] for c in bias_shape)
  bias = jax.random.normal(jax.random.key(len(bias_shape)), shape)
  check(implementation, b=b, t=t, s=s, n=n, k=k, h=32, bias=bias, is_causal=True,
        logits_soft_cap=2.0, key_value_seq_lengths=jnp.array([40, 53]), dropout_rate=0.2,
        dropout_rng=jax.random.key(1))


@pytest.mark.parametrize("implementation", BACKENDS)
def test_bias_gradient_in_bfloat16(implementation):
  bias = jax.random.normal(jax.random.key(2), (1, 4, 50, 50)).astype(jnp.bfloat16)
  check(implementation, b=2, t=50, s=50, n=4, k=2, h=64, dtype=jnp.bfloat16, bias=bias,
        is_causal=True)


def _grad_fn(implementation, wrt):
  def loss(q, k, v, bias):
    return jnp.sum(attention(implementation, q, k, v, bias=bias, small=False))
  return jax.jit(jax.grad(loss, argnums=wrt))


def test_undifferentiated_bias_runs_no_dbias_kernel():
  """Triton, lowered for CUDA: the dbias kernel is in the program only when dbias is asked for."""
  q = jax.ShapeDtypeStruct((1, 64, 2, 32), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, 2, 64, 64), jnp.float32)

  def loss(q, k, v, bias):
    return jnp.sum(jaxflash.flash_attention(q, k, v, bias=bias, implementation="triton")
                   .astype(jnp.float32))

  without = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, q, q, bias)
  with_bias = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2, 3)), q, q, q, bias)
  assert "jaxflash_backward_dbias" not in without
  assert "jaxflash_backward_dbias" in with_bias


def test_undifferentiated_bias_costs_no_memory():
  """XLA backend: the dbias row slabs exist only when the bias gradient is asked for."""
  q, k, v, _ = random_qkv(0, 1, 1024, 1024, 4, 4, 32)
  bias = jnp.zeros((1, 4, 1024, 1024))

  def temp(wrt):
    compiled = _grad_fn("xla", wrt).lower(q, k, v, bias).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp((0, 1, 2)) + 2**20 < temp((0, 1, 2, 3))


def _largest_float_buffer(fn, *args) -> int:
  """Elements of the largest floating-point array in the compiled program."""
  text = jax.jit(fn).lower(*args).compile().as_text()
  sizes = [math.prod(int(d) for d in dims.split(",") if d)
           for dims in re.findall(r"\b(?:f16|bf16|f32|f64)\[([0-9,]*)\]", text)]
  return max(sizes)


@pytest.mark.parametrize("implementation", BACKENDS)
def test_boolean_mask_never_costs_a_float_buffer(implementation):
  """A [T, S] boolean mask stays boolean (or int8) through forward and backward."""
  t = s = 2048
  q, k, v, _ = random_qkv(0, 1, t, s, 1, 1, 16)
  mask = jnp.tril(jnp.ones((t, s), bool))

  def loss(q, k, v, dense):
    options = dict(mask=dense) if dense.dtype == jnp.bool_ else dict(bias=dense)
    return jnp.sum(attention(implementation, q, k, v, small=False, **options))

  fwd_bwd = jax.grad(loss, argnums=(0, 1, 2))
  assert _largest_float_buffer(fwd_bwd, q, k, v, mask) < t * s // 4
  # Control: the same program with a float bias of that shape does hold one.
  assert _largest_float_buffer(fwd_bwd, q, k, v, jnp.zeros((t, s))) >= t * s
