"""Attention as one differentiable call: the custom VJP around a backend's forward and backward.

The residuals are the inputs, the output and the base-2 LSE: S and P are recomputed by the
backward. A bias gradient is computed only when the bias is differentiated (custom_vjp symbolic
zeros tell), so an undifferentiated bias costs no extra kernel, time or memory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxflash import _core
from jaxflash import fp8
from jaxflash._core import Inputs, Params
from jaxflash.backends.xla import backward as xla_backward
from jaxflash.ops import partitioning


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def attention(inputs: Inputs, params: Params, backend, config):
  """``(out [B, T, N, H], natural lse [B, N, T])`` of one call on ``backend`` with ``config``."""
  out, lse2 = partitioning.forward(backend, inputs, params, config)
  return out, _core.user_lse(lse2)


def _forward(inputs, params, backend, config):
  # Symbolic zeros tell us whether the bias, or an array a score_mod closes over, is being
  # differentiated at all: only then does the backward pay for its gradient (a Python bool in
  # the residuals is static under jit).
  want_dbias = inputs.bias is not None and inputs.bias.perturbed
  want_dconsts = consts_perturbed(inputs)
  inputs = primal_values(inputs)
  out, lse2 = forward(backend, inputs, params, config)
  return (out, _core.user_lse(lse2)), (inputs, out, lse2, want_dbias, want_dconsts)


def _backward(params, backend, config, residuals, cotangents):
  inputs, out, lse2, want_dbias, want_dconsts = residuals
  if fp8.is_fp8(inputs.query.dtype):
    raise ValueError(FP8_GRADIENT)
  d_out, delta = output_cotangents(out, cotangents)
  grads = backward(backend, without_sinks(inputs), params, config, lse2, d_out, delta,
                   want_dbias)
  return (cotangents_of(inputs, *grads, lse2=lse2, delta=delta)._replace(
      score_consts=const_cotangents(inputs, params, lse2, d_out, delta, want_dconsts)),)


def consts_perturbed(inputs: Inputs) -> bool:
  """Whether an array a score_mod closes over is differentiated (``inputs`` as a
  ``symbolic_zeros`` forward rule receives them): only then does a backward pay for
  `const_cotangents`."""
  return inputs.score_consts is not None and any(c.perturbed for c in inputs.score_consts)


def const_cotangents(inputs: Inputs, params: Params, lse2, d_out, delta, wanted: bool):
  """The cotangents of `Inputs.score_consts` (None unless ``wanted``): one blockwise XLA pass
  over the whole call, whichever backend ran the rest of the backward. (Under Explicit mesh
  axes it runs on whole arrays: its products would otherwise mix operands sharded unlike.)"""
  if not wanted:
    return None
  args = jax.tree.map(_core.replicated, (without_sinks(inputs), lse2, d_out, delta))
  grads = score_const_gradients(args[0], params, *args[1:])
  return tuple(g if g is None else _core.summed_like(g, c)  # (None: an integer array's)
               for g, c in zip(grads, inputs.score_consts))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def score_const_gradients(inputs: Inputs, params: Params, lse2, d_out, delta) -> tuple:
  """`jaxflash.backends.xla.backward.score_const_gradients` (the gradients of the arrays a
  score_mod closes over), refusing to be differentiated like `backward`."""
  return xla_backward.score_const_gradients(inputs, params, lse2, d_out, delta)


@score_const_gradients.defjvp
def _score_const_gradients_jvp(params, primals, tangents):
  del params, primals, tangents
  raise NotImplementedError(SECOND_ORDER)


FP8_GRADIENT = ("flash_attention on float8 inputs has no gradient (an FP8 cotangent would lose "
                "it); to train with an FP8 forward call jaxflash.fp8_attention on the 16-bit "
                "inputs, which quantises them itself and differentiates in 16 bits.")


SECOND_ORDER = ("jaxflash computes first derivatives only: its backward pass (a fused kernel, or "
                "blockwise loops with data-dependent bounds) has no derivative of its own, so "
                "grad of grad, jax.hessian and jvp of a gradient are not supported. For "
                "second-order terms use jax.nn.dot_product_attention(implementation='xla').")


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 2, 3))
def forward(backend, inputs: Inputs, params: Params, config):
  """``backend.forward`` as the VJP's forward rule calls it: a second-order derivative
  differentiates this too (its residuals feed the backward), and gets `SECOND_ORDER`. Each
  device computes its share of a sharded call (`jaxflash.ops.partitioning`)."""
  return partitioning.forward(backend, inputs, params, config)


@forward.defjvp
def _forward_jvp(backend, params, config, primals, tangents):
  del backend, params, config, primals, tangents
  raise NotImplementedError(SECOND_ORDER)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 2, 3, 7))
def backward(backend, inputs: Inputs, params: Params, config, lse2, d_out, delta,
             want_dbias: bool):
  """``backend.backward``, refusing to be differentiated with a clear error (a second-order
  derivative would otherwise die inside Pallas or a while loop). Each device computes its
  share of a sharded call (`jaxflash.ops.partitioning`)."""
  return partitioning.backward(backend, inputs, params, config, lse2, d_out, delta, want_dbias)


@backward.defjvp
def _backward_jvp(backend, params, config, want_dbias, primals, tangents):
  del backend, params, config, want_dbias, primals, tangents
  raise NotImplementedError(SECOND_ORDER)


def output_cotangents(out, cotangents):
  """``(d_out, delta)`` from the cotangents of ``(out, lse)``: a symbolic-zero d_out becomes
  zeros, and delta = rowsum(dO * O) - d_lse (see `_core.delta`)."""
  d_out, d_lse = cotangents
  if isinstance(d_out, jax.custom_derivatives.SymbolicZero):
    d_out = jnp.zeros(out.shape, out.dtype)
  # XLA sees no further than this: a d_out that is a broadcast scalar (the gradient of
  # ``c * out.sum()`` under jit) let XLA CPU's YNNPACK fusion take dO V^T - delta as one op,
  # which read uninitialised memory (jax 0.11-0.12; gradients of 1e16-1e36). The kernels read
  # a materialised d_out anyway.
  d_out = jax.lax.optimization_barrier(d_out)
  return d_out, _core.delta(out, d_out, d_lse)


def primal_values(inputs: Inputs) -> Inputs:
  """Unwraps the `CustomVJPPrimal`s a ``symbolic_zeros`` forward receives."""
  return jax.tree.map(lambda p: p.value, inputs,
                      is_leaf=lambda p: isinstance(p, jax.custom_derivatives.CustomVJPPrimal))


def cotangents_of(inputs: Inputs, dq, dk, dv, dbias, lse2=None, delta=None) -> Inputs:
  """The `Inputs`-shaped cotangent: integer inputs, the mask and the dropout seed get none.
  Attention sinks, if any, get theirs from the final ``lse2`` and ``delta``
  (`jaxflash._core.sink_gradient`)."""
  # (In the primal's dtype; under `jax.shard_map` summed over the devices that shared it; and
  # with its Explicit sharding: the sinks' gradient, summed from the LSE, is split over the
  # heads where replicated sinks are not.)
  def cast(g, x):
    if g is None:
      return None
    return _core.resharded_like(_core.summed_like(g, x), x).astype(x.dtype)
  d_sinks = None
  if inputs.sinks is not None:
    d_sinks = cast(_core.sink_gradient(inputs.sinks, lse2, delta), inputs.sinks)
  return Inputs(query=cast(dq, inputs.query), key=cast(dk, inputs.key),
                value=cast(dv, inputs.value), lengths=None, bias=cast(dbias, inputs.bias),
                sinks=d_sinks)


def without_sinks(inputs: Inputs) -> Inputs:
  """The inputs a backward (or a partial forward) gets: no sinks. A backward needs only the LSE
  they went into, and a partial result's sinks are joined after the merge."""
  return inputs._replace(sinks=None)


attention.defvjp(_forward, _backward, symbolic_zeros=True)
