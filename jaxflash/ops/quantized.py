"""Training with an FP8 forward: attention whose forward quantises its 16-bit inputs and runs on
FP8, and whose backward is a 16-bit one.

The backward runs the 16-bit kernels against the FP8 forward's LSE (a residual, with its
output), on one of two sets of inputs (`Plan.backward`):

- ``"straight_through"`` (the default): the inputs' FP8 round trip, the forward's FP8 values
  (kept as residuals: half the bytes of 16-bit ones, and no second quantisation or rotation)
  scaled back, so S and P are the forward's own and every row of P sums to one; the gradient is
  exact attention's at the dequantised point, passed straight through.
- ``"mixed"``: the caller's inputs themselves (kept as residuals), so S is the 16-bit one. Where the logits are
  small this is the closer gradient (2.2% against 5.3% from float64's on normal inputs), but P
  = exp(S − LSE) then mixes two different S: where the FP8 forward's LSE is off by a few units
  (logits in the hundreds, as outlier features make) P grows without bound, and the gradients
  with it (they overflow to inf on `benchmarks/fp8.py`'s outlier inputs; docs/fp8.md).
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
  backward: str  # "straight_through" or "mixed" (the module docstring)
  forward_backend: object
  forward_config: object
  backward_backend: object
  backward_config: object


def quantized(inputs: Inputs, rotation, block_size: int | None, dtype: str) -> Inputs:
  """``inputs`` quantised to FP8 ``dtype``: query and key after ``rotation`` (None: none) with
  one scale per ``block_size`` tokens and head, the value with one per batch row and K/V head."""
  dtype = jnp.dtype(dtype)
  # (Scales whose values scaled back are exact in 16 bits, so that a 16-bit backward on them
  # recomputes the forward's own logits, up to the order of float32 sums; of those, the ones
  # that bring each block's largest entry back closest: `quantize_fp8`'s bfloat16_exact.)
  quantize = functools.partial(fp8.quantize_fp8, dtype=dtype, bfloat16_exact=True)
  q8, q_descale = quantize(inputs.query, block_size=block_size, rotation=rotation)
  k8, k_descale = quantize(inputs.key, block_size=block_size, rotation=rotation)
  v8, v_descale = quantize(inputs.value)
  per_head = lambda d: d[:, None] if d.ndim == 2 else d  # noqa: E731  (canonical [B, L or 1, h])
  return inputs._replace(query=q8, key=k8, value=v8, q_descale=per_head(q_descale),
                         k_descale=per_head(k_descale), v_descale=v_descale[:, None])


def _rotated_back(grad, rotation):
  """A gradient with respect to rotated values (x R), as one with respect to x: grad Rᵀ."""
  if rotation is None or grad is None:
    return grad
  return fp8.rotated_back(grad, rotation)


def fp8_params(params: Params, inputs: Inputs) -> Params:
  """The FP8 forward's parameters: its output in the 16-bit inputs' dtype."""
  return dataclasses.replace(params, out_dtype=jnp.dtype(inputs.query.dtype).name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def attention(inputs: Inputs, rotation, params: Params, plan: Plan):
  """``(out [B, T, N, Dv], natural lse [B, N, T])``: the FP8 forward of 16-bit ``inputs``."""
  out, lse2, _ = _fp8_forward(inputs, rotation, params, plan)
  return out, _core.user_lse(lse2)


def _fp8_forward(inputs, rotation, params, plan):
  """``(out, lse2, x8s)``: the FP8 forward and the quantised inputs it ran on."""
  x8s = quantized(inputs, rotation, plan.block_size, plan.dtype)
  out, lse2 = flash.forward(plan.forward_backend, x8s, fp8_params(params, inputs),
                            plan.forward_config)
  return out, lse2, x8s


def _forward(inputs, rotation, params, plan):
  want_dbias = inputs.bias is not None and inputs.bias.perturbed
  want_dconsts = flash.consts_perturbed(inputs)
  inputs = flash.primal_values(inputs)
  rotation = None if rotation is None else rotation.value
  out, lse2, x8s = _fp8_forward(inputs, rotation, params, plan)
  # The straight-through backward keeps the FP8 inputs (half the bytes of 16-bit ones) and scales
  # them back, rather than quantising (and rotating) the 16-bit ones again; the mixed one keeps
  # the caller's. (``out`` has the inputs' dtype: `fp8_params`.)
  kept = x8s if plan.backward == "straight_through" else inputs
  return (out, _core.user_lse(lse2)), (kept, rotation, out, lse2, want_dbias, want_dconsts)


def _backward(params, plan, residuals, cotangents):
  kept, rotation, out, lse2, want_dbias, want_dconsts = residuals
  d_out, delta = flash.output_cotangents(out, cotangents)
  if plan.backward == "straight_through":
    operands = fp8.dequantized(kept, out.dtype)  # (query and key left rotated)
    dq, dk, dv, dbias = flash.backward(plan.backward_backend, flash.without_sinks(operands),
                                       params, plan.backward_config, lse2, d_out, delta,
                                       want_dbias)
    grads = (_rotated_back(dq, rotation), _rotated_back(dk, rotation), dv, dbias)
  else:
    operands = kept
    grads = flash.backward(plan.backward_backend, flash.without_sinks(operands), params,
                           plan.backward_config, lse2, d_out, delta, want_dbias)
  # The rotation gets no gradient: it is a fixed random matrix, not a parameter. The arrays a
  # score_mod closes over get theirs as the 16-bit call's do (rotated q and k give the same
  # logits); they came back as zeros before 2026-12-05.
  consts = flash.const_cotangents(operands, params, lse2, d_out, delta, want_dconsts)
  return (flash.cotangents_of(operands, *grads, lse2=lse2, delta=delta)._replace(
      score_consts=consts), None)


attention.defvjp(_forward, _backward, symbolic_zeros=True)
