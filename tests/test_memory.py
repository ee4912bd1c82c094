"""The xla backend's compiled program must grow linearly, not quadratically, with length."""

import jax
import jax.numpy as jnp

import jaxflash


def _temp_bytes(fn, *args) -> int:
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _fwd_bwd_temp(seq: int, implementation) -> int:
  q = jax.ShapeDtypeStruct((1, seq, 4, 64), jnp.float32)

  def loss(q, k, v):
    if implementation == "dense":
      out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    else:
      out = jaxflash.flash_attention(q, k, v, is_causal=True, implementation=implementation)
    return jnp.sum(out)

  return _temp_bytes(jax.grad(loss, argnums=(0, 1, 2)), q, q, q)


def test_xla_backend_memory_is_linear():
  small, large = _fwd_bwd_temp(4096, "xla"), _fwd_bwd_temp(8192, "xla")
  # Doubling the length may double the O(T) buffers, never quadruple anything.
  assert large <= 2.5 * small, (small, large)
  # And it is far below one float32 [N, T, T] logit matrix at 8k (1 GiB).
  assert large < 4 * 8192 * 8192 * 4 / 16, large


def test_memory_check_can_fail():
  """The same measurement flags quadratic memory in dense attention."""
  small, large = _fwd_bwd_temp(1024, "dense"), _fwd_bwd_temp(2048, "dense")
  assert large > 3.0 * small, (small, large)
