"""FP8 attention's numbers: quantisation, descale factors and the incoherent rotation.

An FP8 call passes float8 query, key and value together with float32 *descale* factors, the
numbers that turn the stored values back into the real ones: ``real = float(x8) * descale``.
A descale may be one number for the whole tensor, one per (batch row, head), or (query and key)
one per token and head, which is what block quantisation gives (one scale per block of tokens,
repeated over the block). The kernels fold them into the logits' scale; the XLA backend
dequantises the inputs and computes in float32 (`dequantized`), the reference of every FP8
kernel.

Plain FP8 loses much of a head's precision to a few outlier features (one large channel sets
the scale of every other). FlashAttention-3's answer is the *incoherent* rotation: multiply
query and key by the same random orthogonal matrix R before quantising, which spreads an
outlier over every channel and leaves the logits exact, ``(q R)(k R)ᵀ = q kᵀ``
(`random_rotation`, `quantize_fp8`'s ``rotation``).
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

# The FP8 formats the kernels take (Hopper's tensor cores read both).
DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def is_fp8(dtype) -> bool:
  """Whether ``dtype`` is one of the FP8 formats attention takes (`DTYPES`)."""
  return any(jnp.dtype(dtype) == jnp.dtype(d) for d in DTYPES)


def largest(dtype) -> float:
  """The largest finite value of an FP8 format (448 for e4m3fn, 57344 for e5m2)."""
  return float(jnp.finfo(dtype).max)


# The rotation's matmuls (`rotated`, `rotated_back`) run at `Precision.HIGH`: TF32 tensor cores
# on an NVIDIA GPU (operands kept to ten significant bits, so each product within 2^-11 of its
# float32 value; a 16-bit input is exact in TF32), float32 on a CPU: far below the FP8
# rounding that follows (2^-4 for e4m3). At `HIGHEST` they ran in float32 on the CUDA cores:
# at the GPT example's attention (B = 2, 8k tokens, 8 heads of 128, causal; H200, 2026-12-04,
# benchmarks/dev/rotation_cost.py) a rotated `fp8_attention` forward+backward took 2.60 ms
# against 2.24 at HIGH, 2.16 unrotated and 1.94 for bf16 (docs/fp8.md).
ROTATION_PRECISION = jax.lax.Precision.HIGH


def rotated(x: jax.Array, rotation: jax.Array) -> jax.Array:
  """``x @ rotation`` over the last axis of ``x`` [..., H], in float32."""
  return jnp.einsum("...d,de->...e", x.astype(jnp.float32), rotation.astype(jnp.float32),
                    precision=ROTATION_PRECISION)


def rotated_back(grad: jax.Array, rotation: jax.Array) -> jax.Array:
  """A gradient with respect to rotated values ``x @ rotation``, as one with respect to ``x``:
  ``grad @ rotationᵀ``, in float32."""
  return rotated(grad, jnp.asarray(rotation).T)


def random_rotation(key: jax.Array, head_dim: int, dtype=jnp.float32) -> jax.Array:
  """A random orthogonal [head_dim, head_dim] matrix for FP8's incoherent processing.

  For a power-of-two ``head_dim`` it is a Hadamard matrix with random row signs, ``diag(s) H``
  (what FlashAttention-3 uses: cheap, and it spreads every channel evenly over all the
  others; the signs flip features before they are mixed, so that each key gives another
  rotation, where signs on the columns would only flip the mixed features' signs, which
  quantising leaves alone); otherwise the orthogonal factor of a Gaussian matrix. Pass the same
  matrix to `quantize_fp8` for the query and the key: the logits are unchanged,
  ``(q R)(k R)ᵀ = q kᵀ``.

  Args:
    key: a PRNG key.
    head_dim: the query/key head dim H.
    dtype: the matrix's dtype (float32 by default).
  """
  if not isinstance(head_dim, numbers.Integral) or isinstance(head_dim, bool) or head_dim <= 0:
    raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
  head_dim = int(head_dim)  # (a NumPy integer, such as a shape's entry, is one too)
  if head_dim & (head_dim - 1) == 0:
    hadamard = np.ones((1, 1), np.float32)
    while hadamard.shape[0] < head_dim:  # Sylvester's construction
      hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
    signs = jax.random.rademacher(key, (head_dim,), jnp.float32)
    rotation = signs[:, None] * jnp.asarray(hadamard) / math.sqrt(head_dim)
  else:
    gaussian = jax.random.normal(key, (head_dim, head_dim), jnp.float32)
    q, r = jnp.linalg.qr(gaussian)
    rotation = q * jnp.sign(jnp.diagonal(r))[None, :]  # the Haar-distributed factor
  return rotation.astype(dtype)


def quantize_fp8(x: jax.Array, *, block_size: int | None = None,
                 rotation: jax.Array | None = None,
                 dtype=jnp.float8_e4m3fn,
                 power_of_two: bool = False,
                 bfloat16_exact: bool = False) -> tuple[jax.Array, jax.Array]:
  """Quantises a query, key or value to FP8 with its descale factors.

  Args:
    x: [B, L, heads, D] (or unbatched [L, heads, D]), any float dtype.
    block_size: tokens that share one scale. ``None`` gives one scale per (batch row, head),
      descale [B, heads]; an int gives one per block of that many tokens and head, descale
      [B, L, heads] (each token carries its block's factor; 1 is per token). The query and key
      of `jaxflash.flash_attention` take either form, the value only the first.
    rotation: optional [D, D] orthogonal matrix (`random_rotation`) applied before quantising:
      ``x @ rotation``. Give the query and the key the same one, and never the value (it would
      rotate the output).
    dtype: ``jnp.float8_e4m3fn`` (default) or ``jnp.float8_e5m2``.
    power_of_two: round each descale up to a power of two (the block's largest magnitude then
      maps to between half the format's largest value and it, as with MX formats' scales), so
      that ``float(x8) * descale`` is exact in bfloat16: `jaxflash.fp8_attention`'s backward
      recomputes the forward's logits from such values.
    bfloat16_exact: descales with few enough significant bits that ``float(x8) * descale`` is
      exact in bfloat16 too (four for e4m3, five for e5m2: the products fit bfloat16's eight),
      each the one of its block's candidates under which the block's largest magnitude comes
      back closest (for e4m3 within 2.7% of it, 0.6% at the median, where a power of two
      leaves it up to 5.9% off, 2.2% at the median). What `jaxflash.fp8_attention` quantises
      with: with a scale per token its output on outlier features, whose largest entries carry
      the logits, comes out several times closer than with power-of-two scales, under which
      per-token scales gave per-head values (docs/fp8.md).

  Returns:
    ``(x8, descale)``: the FP8 values and float32 factors with ``x ~ float(x8) * descale``
    (after the rotation). Each scale maps its block's largest magnitude to the format's largest
    finite value (``power_of_two``, ``bfloat16_exact``: to at most it); an all-zero block gets
    the factor 1.
  """
  x = jnp.asarray(x)
  if x.ndim not in (3, 4) or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a float array [B, L, heads, D] or [L, heads, D], got "
                     f"{x.dtype} {x.shape}")
  if not is_fp8(dtype):
    raise ValueError(f"dtype must be jnp.float8_e4m3fn or jnp.float8_e5m2, got {dtype!r}")
  if block_size is not None and (isinstance(block_size, bool)
                                 or not isinstance(block_size, numbers.Integral)
                                 or block_size <= 0):
    raise ValueError(f"block_size must be None or a positive int, got {block_size!r}")
  block_size = None if block_size is None else int(block_size)  # (a NumPy integer too)
  if power_of_two and bfloat16_exact:
    raise ValueError("power_of_two and bfloat16_exact are two ways of choosing the scales; "
                     "pass one")
  unbatched = x.ndim == 3
  x = (x[None] if unbatched else x).astype(jnp.float32)
  if rotation is not None:
    rotation = jnp.asarray(rotation)
    if rotation.shape != (x.shape[-1],) * 2:
      raise ValueError(f"rotation must be [D, D] = {(x.shape[-1],) * 2} for x {x.shape}, got "
                       f"{rotation.shape}")
    x = rotated(x, rotation)
  # (A NaN or infinite entry stays NaN or infinite but sets no scale: a NaN block maximum set
  # its block's factor to 1, which clipped or flushed every other value of the block, and an
  # infinite one made it inf, every other value 0 and their dequantised values 0 * inf.)
  amax = jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0), axis=-1)  # [B, L, heads]
  if block_size is None:
    amax = jnp.max(amax, axis=1, initial=0.0)  # [B, heads] (L = 0 too)
  else:
    b, length, heads = amax.shape
    blocks = -(-length // block_size)
    padded = jnp.pad(amax, ((0, 0), (0, blocks * block_size - length), (0, 0)))
    amax = padded.reshape(b, blocks, block_size, heads).max(axis=2)
    amax = jnp.repeat(amax, block_size, axis=1)[:, :length]
  descale = jnp.where(amax > 0, amax / largest(dtype), 1.0)
  if power_of_two:
    # (ldexp, not exp2: XLA's exp2 of an integer need not be an exact power of two.)
    exponent = jnp.ceil(jnp.log2(descale)).astype(jnp.int32)
    descale = jnp.ldexp(jnp.ones_like(descale), exponent)
  if bfloat16_exact:
    descale = jnp.where(amax > 0, _bfloat16_exact_descales(amax, dtype), 1.0)
  # (Blocks of magnitudes below about 5e-36 took subnormal factors, which flush to 0 and made
  # NaN of the block; the least normal float32, a power of two, suits every kind of factor.)
  descale = jnp.maximum(descale, jnp.finfo(jnp.float32).tiny)
  # NaN stays NaN and an infinity an infinity, or NaN in e4m3fn, which has none (a NaN or inf
  # input is visible in the output); the clip keeps rounding from overflowing to NaN there.
  scaled = x / (descale[:, None] if block_size is None else descale)[..., None]
  clipped = jnp.clip(scaled, -largest(dtype), largest(dtype))
  x8 = jnp.where(jnp.isinf(scaled), scaled, clipped).astype(dtype)
  if unbatched:
    x8, descale = x8[0], descale[0]
  return x8, descale


def _bfloat16_exact_descales(amax: jax.Array, dtype) -> jax.Array:
  """`quantize_fp8`'s ``bfloat16_exact`` descales of blocks whose largest magnitudes are
  ``amax`` (> 0): of the factors ``m · 2^e`` with ``m`` on a grid of ``8 - p`` significant bits
  (``p``: the format's, 4 for e4m3) and the least ``e`` that keeps ``amax / factor`` within the
  format's range, the one under which ``amax`` rounds to FP8 and back closest (the smallest of
  equals). Elementwise with ranks spelled out, no gather: strict rank promotion and explicit
  sharding take it as they take the rest of the quantisation."""
  bits = 8 - (jnp.finfo(dtype).nmant + 1)
  steps = 2 ** (bits - 1)
  mantissas = (1.0 + jnp.arange(steps, dtype=jnp.float32) / steps).reshape(
      (1,) * amax.ndim + (steps,))  # [1, 2)
  top = largest(dtype)
  a = amax[..., None]
  # (ldexp, not exp2: XLA's exp2 of an integer need not be an exact power of two.)
  exponents = jnp.ceil(jnp.log2(a / (top * mantissas))).astype(jnp.int32)
  # (The mantissas broadcast against ``a``, so that they take its sharding.)
  factors = jnp.ldexp(mantissas + jnp.zeros_like(a), exponents)
  back = jnp.clip(a / factors, 0.0, top).astype(dtype).astype(jnp.float32) * factors
  miss = jnp.abs(back - a)
  best = miss == jnp.min(miss, axis=-1, keepdims=True)
  return jnp.min(jnp.where(best, factors, jnp.inf), axis=-1)


def per_token(descale: jax.Array | None) -> bool:
  """Whether a canonical descale (`jaxflash._core.Inputs`: [B, L or 1, heads]) holds a factor
  per token, which a call that cuts the sequence (a key range, a ring's chunk, a key block)
  must cut with it."""
  return descale is not None and descale.shape[1] > 1


def dequantize(x8: jax.Array, descale: jax.Array | None) -> jax.Array:
  """float32 values of an FP8 array [B, L, heads, D] and its canonical descale [B, L or 1,
  heads] (None: 1; see `jaxflash._core.Inputs`).

  The FP8 values pass an optimization barrier first. On GPUs XLA (with its default
  ``xla_allow_excess_precision``) folds a chain of float conversions that ends in the type it
  began with, f32 -> e4m3 -> f32 included, so a quantisation and this upcast in one program
  would cancel: `fp8_attention`'s straight-through backward then ran on the unquantised inputs
  (the mixed backward, whose gradients overflow on outliers), and the XLA backend's FP8 forward
  on the unquantised values (H200, 2026-11-28)."""
  x = lax.optimization_barrier(x8).astype(jnp.float32)
  return x if descale is None else x * descale[..., None]


def dequantized(inputs, dtype=jnp.float32):
  """The `jaxflash._core.Inputs` of an FP8 call with query, key and value scaled back to
  ``dtype`` and no descales: the same attention, computed upcast (the XLA backend's FP8 path
  in float32; `fp8_attention`'s straight-through backward in the caller's dtype)."""
  back = lambda x8, descale: dequantize(x8, descale).astype(dtype)  # noqa: E731
  return inputs._replace(query=back(inputs.query, inputs.q_descale),
                         key=back(inputs.key, inputs.k_descale),
                         value=back(inputs.value, inputs.v_descale),
                         q_descale=None, k_descale=None, v_descale=None)
