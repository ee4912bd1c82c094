"""Training with an FP8 forward: attention whose forward quantises its 16-bit inputs and runs on
FP8, and whose backward is the 16-bit one (the "mixed" backward).

The custom VJP keeps the caller's 16-bit inputs as residuals, with the FP8 forward's output and
LSE. The backward recomputes S and P from those inputs at their own precision against the FP8
forward's LSE: an FP8 cotangent would lose most of the gradient, and the LSE and delta =
rowsum(dO * O) of the FP8 forward differ from the 16-bit ones by the forward's own error only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxflash import _core
from jaxflash import fp8
from jaxflash._core import Inputs, Params
from jaxflash.ops import flash


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one FP8-forward call quantises and which backends run its two passes (static)."""

  block_size: int | None  # tokens per query/key scale (`jaxflash.quantize_fp8`); None: per head
  dtype: str  # the FP8 format's name
  forward_backend: object
  forward_config: object
  backward_backend: object
  backward_config: object


def quantized(inputs: Inputs, rotation, block_size: int | None, dtype: str) -> Inputs:
  """``inputs`` quantised to FP8 ``dtype``: query and key after ``rotation`` (None: none) with
  one scale per ``block_size`` tokens and head, the value with one per batch row and K/V head."""
  dtype = jnp.dtype(dtype)
  q8, q_descale = fp8.quantize_fp8(inputs.query, block_size=block_size, rotation=rotation,
                                   dtype=dtype)
  k8, k_descale = fp8.quantize_fp8(inputs.key, block_size=block_size, rotation=rotation,
                                   dtype=dtype)
  v8, v_descale = fp8.quantize_fp8(inputs.value, dtype=dtype)
  per_head = lambda d: d[:, None] if d.ndim == 2 else d  # noqa: E731  (canonical [B, L or 1, h])
  return inputs._replace(query=q8, key=k8, value=v8, q_descale=per_head(q_descale),
                         k_descale=per_head(k_descale), v_descale=v_descale[:, None])


def fp8_params(params: Params, inputs: Inputs) -> Params:
  """The FP8 forward's parameters: its output in the 16-bit inputs' dtype."""
  return dataclasses.replace(params, out_dtype=jnp.dtype(inputs.query.dtype).name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def attention(inputs: Inputs, rotation, params: Params, plan: Plan):
  """``(out [B, T, N, Dv], natural lse [B, N, T])``: the FP8 forward of 16-bit ``inputs``."""
  out, lse2 = _fp8_forward(inputs, rotation, params, plan)
  return out, _core.user_lse(lse2)


def _fp8_forward(inputs, rotation, params, plan):
  return flash.forward(plan.forward_backend,
                       quantized(inputs, rotation, plan.block_size, plan.dtype),
                       fp8_params(params, inputs), plan.forward_config)


def _forward(inputs, rotation, params, plan):
  want_dbias = inputs.bias is not None and inputs.bias.perturbed
  inputs = flash.primal_values(inputs)
  rotation = None if rotation is None else rotation.value
  out, lse2 = _fp8_forward(inputs, rotation, params, plan)
  return (out, _core.user_lse(lse2)), (inputs, out, lse2, want_dbias)


def _backward(params, plan, residuals, cotangents):
  inputs, out, lse2, want_dbias = residuals
  d_out, delta = flash.output_cotangents(out, cotangents)
  grads = flash.backward(plan.backward_backend, flash.without_sinks(inputs), params,
                         plan.backward_config, lse2, d_out, delta, want_dbias)
  # The rotation gets no gradient: it is a fixed random matrix, not a parameter.
  return flash.cotangents_of(inputs, *grads, lse2=lse2, delta=delta), None


attention.defvjp(_forward, _backward, symbolic_zeros=True)
