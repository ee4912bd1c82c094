"""FP8 attention: the forward's speed next to cuDNN's FP8 and to bf16, and its accuracy.

The one command, on the GPU machine from the repo root:

    PYTHONPATH=. python benchmarks/fp8.py

It writes benchmarks/results/<device>/fp8.json (--out to choose) and a .md table beside it, and
prints the table; the JSON is rewritten after every row. ``--smoke`` runs tiny shapes on a CPU
(the XLA backend, for CI); ``--parts speed accuracy`` picks the parts; ``--configs`` adds rows of
other Mosaic FP8 tiles (the tuning that `jaxflash.backends.mosaic.config.FP8_TUNED` records).

**Speed** (forward only; FP8 has no backward of its own: `jaxflash.fp8_attention` differentiates
in 16 bits). Shapes: the training grid's 16k tokens of hidden 2048 (B = 1, S = 16384, 2048 / D
heads) at D = 128 and 256, and NVIDIA's B = 1, 64-head shape at D = 128, causal and not. Rows
``{D, S, causal, impl, mode, tflops}`` and more, with impl:

- ``jaxflash_fp8``: `jaxflash.flash_attention` on e4m3 inputs with one descale per (batch row,
  K/V head), FlashAttention-3's form (the Mosaic FP8 forward).
- ``jaxflash_fp8_token``: the same with one query and key descale per token (block
  quantisation's form), which costs a multiply per score.
- ``jaxflash``: bf16 (`implementation=None`).
- ``cudnn_fp8``: cuDNN's FP8 forward through JAX's private
  ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(..., use_fp8=True)`` (e4m3 in
  and out, per-tensor descales).
- ``cudnn``: cuDNN's bf16 forward (``jax.nn.dot_product_attention``).

FLOPs: 4 B N S^2 D, half when causal (`cases.flops`). Each executable is checked first: batch row
0, the first and last heads and 512 query rows against the float32 reference of the dequantised
inputs; over 5e-2 relative error (FP8's own) marks the row ``wrong``. Timing as the other
benchmarks (`cases.time_calls`).

**Accuracy**: RMSE of the output against a float64 reference (NumPy on the host) at B = 1, S =
2048, 8 heads, D = 128, causal, on normal inputs (q, k, v ~ N(0, 1)) and on inputs with outlier
features (0.1% of the (head, channel) pairs, at least one, scaled by a factor from [10, 50] in
every token of q and k: `accuracy_inputs`). Methods:
``bf16`` (the inputs rounded to bf16), ``fp8`` (plain per-tensor e4m3), ``fp8_block`` (one scale
per token and head, no rotation) and ``fp8_rotated`` (the same after `jaxflash.random_rotation`,
FlashAttention-3's incoherent processing). Rows ``{case: "accuracy", inputs, method, rmse}``.

**Gradient accuracy** (``--parts gradients``): which backward an FP8 forward should have. The
same shape and inputs, a random cotangent; each method's dQ, dK and dV against the float64
gradients of the unquantised inputs, as relative errors ‖g − g₆₄‖ / ‖g₆₄‖. Methods: ``bf16``
(jaxflash's 16-bit forward and backward on bf16 inputs); `jaxflash.fp8_attention`'s two 16-bit
backwards after its FP8 forward, ``straight_through`` (the default) and ``mixed``, each also
``_rotated`` (per-token scales after a rotation), and ``straight_through_token`` (per-token
scales alone); and two FP8 backwards emulated exactly on the
host (float64
arithmetic on e4m3-rounded operands, which is what a tensor core's FP8 products are, up to its
accumulation): after the FP8 forward of per-head e4m3 q, k, v, each backward matmul (dP = dO Vᵀ,
dV = Pᵀ dO, dQ = dS K, dK = dSᵀ Q) takes e4m3 operands. ``fp8_backward`` quantises as a
streaming kernel can: P with the fixed scale its bound 1 allows, dO with scales per token or per
channel known before the pass, and dS per query row with a scale from a bound known before the
pass (|dS| ≤ ‖dO_t‖ max_s ‖V_s‖ + |delta_t|; for dK the row scales move onto Q's rows).
``fp8_backward_ideal`` takes each operand's exact amax along the contraction instead (not
streamable: a lower bound on an FP8 backward's error). Rows ``{case: "gradients", inputs,
method, dq, dk, dv}`` (None, and the name in ``not_finite``, where a gradient overflowed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash.attention import attention_with_config
from jaxflash.backends import mosaic

import report
from cases import flops, time_calls

E4M3 = jnp.float8_e4m3fn
FP8_TOLERANCE = 5e-2


@dataclasses.dataclass(frozen=True)
class Shape:
  b: int
  s: int
  n: int
  d: int
  causal: bool


SPEED = [Shape(1, 16384, 2048 // d, d, c) for d in (128, 256) for c in (False, True)] + [
    Shape(1, 16384, 64, 128, c) for c in (False, True)]
SMOKE = [Shape(1, 200, 2, d, c) for d in (64, 128) for c in (False, True)]
IMPLS = ("jaxflash_fp8", "jaxflash_fp8_token", "jaxflash", "cudnn_fp8", "cudnn")
# Mosaic FP8 tiles the tuner rows try (--configs), by name.
CONFIGS = {
    "kv128": dict(block_kv=128),
    "kv128_overlap": dict(block_kv=128, intra_wg_overlap=True),
    "kv64_overlap": dict(block_kv=64, intra_wg_overlap=True),
    "kv128_stages3": dict(block_kv=128, num_stages=3),
    "kv128_persistent": dict(block_kv=128, persistent_ctas=132),
    "kv128_overlap_persistent": dict(block_kv=128, intra_wg_overlap=True, persistent_ctas=132),
    "kv256": dict(block_kv=256),
    # The row sums on the tensor cores (`Config.mma_row_sums`).
    "kv256_sums": dict(block_kv=256, mma_row_sums=True),
    "kv128_overlap_r240_sums": dict(block_kv=128, intra_wg_overlap=True, registers=240,
                                    mma_row_sums=True),
    "kv256_stages3_sums": dict(block_kv=256, num_stages=3, mma_row_sums=True),
    "kv256_persistent_sums": dict(block_kv=256, persistent_ctas=132, mma_row_sums=True),
    # The shipped D = 128 tiles without a band, and D = 256's, in clusters of two CTAs sharing
    # each K/V tile's load (`Config.kv_multicast`).
    "kv256_persistent_sums_mc": dict(block_kv=256, persistent_ctas=132, mma_row_sums=True,
                                     kv_multicast=True),
    "kv128_overlap_r240_mc": dict(block_kv=128, intra_wg_overlap=True, registers=240,
                                  kv_multicast=True),
    "kv256_overlap_r240_sums": dict(block_kv=256, intra_wg_overlap=True, registers=240,
                                    mma_row_sums=True),
    "kv128_sums": dict(block_kv=128, mma_row_sums=True),
    "kv128_overlap_sums": dict(block_kv=128, intra_wg_overlap=True, mma_row_sums=True),
    "kv256_poly16_sums": dict(block_kv=256, exp2_poly_cols=16, mma_row_sums=True),
    "kv256_poly32_sums": dict(block_kv=256, exp2_poly_cols=32, mma_row_sums=True),
    "kv256_persistent_q2_sums": dict(block_kv=256, persistent_ctas=132, q_buffers=2,
                                     mma_row_sums=True),
    "kv256_persistent_paired_sums": dict(block_kv=256, persistent_ctas=132, paired_tiles=True,
                                         mma_row_sums=True),
    "kv256_persistent_paired_q2_sums": dict(block_kv=256, persistent_ctas=132, paired_tiles=True,
                                            q_buffers=2, mma_row_sums=True),
    "kv256_persistent_oq_sums": dict(block_kv=256, persistent_ctas=132, o_through_q=True,
                                     mma_row_sums=True),
    # 192-key tiles (V's rows three 64-byte swizzled rows), FlashAttention-3's FP8 tile size
    # with its overlap and 240 consumer registers.
    "kv192_sums": dict(block_kv=192, mma_row_sums=True),
    "kv192_overlap_r240": dict(block_kv=192, intra_wg_overlap=True, registers=240),
    "kv192_overlap_r240_sums": dict(block_kv=192, intra_wg_overlap=True, registers=240,
                                    mma_row_sums=True),
    # Three consumer warpgroups of 64 rows at 160 registers (`Config.consumers`).
    "c3_kv64_sums": dict(consumers=3, registers=160, block_kv=64, mma_row_sums=True),
    "c3_kv128_sums": dict(consumers=3, registers=160, block_kv=128, mma_row_sums=True),
    "c3_kv128_poly16_sums": dict(consumers=3, registers=160, block_kv=128, mma_row_sums=True,
                                 exp2_poly_cols=16),
    "c3_kv128_poly32_sums": dict(consumers=3, registers=160, block_kv=128, mma_row_sums=True,
                                 exp2_poly_cols=32),
    "c3_kv128": dict(consumers=3, registers=160, block_kv=128),
    "c3_kv128_persistent_sums": dict(consumers=3, registers=160, block_kv=128,
                                     persistent_ctas=132, mma_row_sums=True),
    "kv64": dict(block_kv=64),
    "kv256_persistent": dict(block_kv=256, persistent_ctas=132),
    "kv256_overlap": dict(block_kv=256, intra_wg_overlap=True),
    # Part of each block's exponentials on the FMA units (`Config.exp2_poly_cols`).
    "kv256_poly32": dict(block_kv=256, exp2_poly_cols=32),
    "kv256_poly64": dict(block_kv=256, exp2_poly_cols=64),
    "kv256_poly96": dict(block_kv=256, exp2_poly_cols=96),
    "kv128_poly32": dict(block_kv=128, exp2_poly_cols=32),
    # D = 256 on 128-key tiles (O leaves through the Q tiles in column pieces, `o_view`), with
    # 240 consumer registers (the overlap spills without them).
    "kv128_r240": dict(block_kv=128, registers=240),
    "kv128_overlap_r240": dict(block_kv=128, intra_wg_overlap=True, registers=240),
    "kv256_stages3": dict(block_kv=256, num_stages=3),
}


def quantized(q, k, v, block_size=None, rotation=None):
  """(q8, k8, v8) and their descales as `flash_attention` takes them."""
  (q8, qd), (k8, kd) = (jaxflash.quantize_fp8(x, block_size=block_size, rotation=rotation)
                        for x in (q, k))
  v8, vd = jaxflash.quantize_fp8(v)
  return (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd)


def per_tensor(q, k, v):
  """Plain FP8: one scale per tensor (what cuDNN's FP8 call takes)."""
  out, scales = [], []
  for x in (q, k, v):
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    scale = jnp.where(amax > 0, amax / 448.0, 1.0)
    out.append(jnp.clip(x.astype(jnp.float32) / scale, -448, 448).astype(E4M3))
    scales.append(scale)
  return out, dict(q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])


def cudnn_fp8(q8, k8, v8, descales, causal: bool, scale: float):
  """cuDNN's FP8 forward (private JAX API): e4m3 output, converted to float32 here."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  one = jnp.ones((1, 1, 1, 1), jnp.float32)
  params = {name: one for name in cudnn.fp8_params_keys}
  params.update(descale_q=descales["q_descale"] * one, descale_k=descales["k_descale"] * one,
                descale_v=descales["v_descale"] * one)
  mask = cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK
  out = cudnn.dot_product_attention(q8, k8, v8, fp8_params=params, scale=scale,
                                    mask_type=mask, use_fp8=True)[0]
  return out.astype(jnp.float32)


def speed_fn(impl: str, shape: Shape, implementation, config=None):
  """``(fn, args)`` of one speed row: fn(*args) is the output."""
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (shape.b, shape.s, shape.n, shape.d), jnp.bfloat16)
             for key in keys)
  causal = shape.causal
  if impl == "jaxflash":
    return (lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=causal,
                                                     implementation=implementation)), (q, k, v)
  if impl == "cudnn":
    return (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                         implementation="cudnn")), (q, k, v)
  if impl == "cudnn_fp8":
    qkv8, descales = per_tensor(q, k, v)
    return (lambda q8, k8, v8, d: cudnn_fp8(q8, k8, v8, d, causal, shape.d ** -0.5)), (
        *qkv8, descales)
  qkv8, descales = quantized(q, k, v, block_size=1 if impl == "jaxflash_fp8_token" else None)

  def fn(q8, k8, v8, d):
    return attention_with_config(q8, k8, v8, is_causal=causal, config=config,
                                 implementation=implementation, **d)
  return fn, (*qkv8, descales)


def dequantized(x8, descale):
  d = np.asarray(descale, np.float32)
  if d.ndim == 0:
    return np.asarray(x8, np.float32) * d
  d = d[:, None] if d.ndim == 2 else d
  return np.asarray(x8, np.float32) * d[..., None]


def check(shape: Shape, args, got) -> float:
  """Relative error of batch row 0, the first and last heads and up to 512 query rows against
  the float32 reference of the (dequantised) inputs."""
  if len(args) == 4:
    real = [dequantized(x, args[3][name]) for x, name in
            zip(args[:3], ("q_descale", "k_descale", "v_descale"))]
  else:
    real = [np.asarray(x, np.float32) for x in args]
  rng = np.random.default_rng(0)
  rows = np.arange(shape.s) if shape.s <= 512 else np.union1d(
      np.arange(shape.s - 128, shape.s), rng.choice(shape.s - 128, 384, replace=False))
  heads = sorted({0, shape.n - 1})
  q = jnp.asarray(real[0][:1][:, rows][:, :, heads])
  k, v = (jnp.asarray(x[:1][:, :, heads]) for x in real[1:])
  mask = jnp.ones((len(rows), shape.s), bool)
  if shape.causal:
    mask = jnp.asarray(rows)[:, None] >= jnp.arange(shape.s)[None, :]
  with jax.default_matmul_precision("highest"):
    want = np.asarray(jaxflash.reference_attention(q, k, v, mask=mask[None, None],
                                                   scale=shape.d ** -0.5)[0], np.float64)
  got = np.asarray(np.asarray(got[:1], np.float32)[:, rows][:, :, heads], np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def run_speed(shapes, impls, implementation, configs, out: Path, result: dict) -> None:
  for shape in shapes:
    variants = [(impl, None, None) for impl in impls]
    variants += [("jaxflash_fp8", name, mosaic.Config(**fields)) for name, fields in configs
                 if mosaic.config.fits(mosaic.Config(**fields), shape.d, itemsize=1)]
    for impl, name, config in variants:
      row = dict(case="speed", D=shape.d, S=shape.s, B=shape.b, N=shape.n,
                 causal=shape.causal, impl=impl, mode="fwd", config=name)
      try:
        fn, args = speed_fn(impl, shape, implementation, config)
        compiled = jax.jit(fn).lower(*args).compile()
        got = compiled(*args)
        err = check(shape, args, got)
        ms, _ = time_calls(compiled, args)
        row.update(ms=round(ms, 4), tflops=round(
            flops(shape.b, shape.n, shape.s, shape.d, shape.causal, "fwd") / ms / 1e9, 1),
            relerr=err, wrong=not err <= FP8_TOLERANCE)
        if impl.startswith("jaxflash"):
          row["backend"] = "mosaic" if config is not None else _backend(impl, args, shape,
                                                                        implementation)
      except Exception as e:  # noqa: BLE001 (a row that failed says why and the run goes on)
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      result["rows"].append(row)
      print(json.dumps(row), flush=True)
      write(result, out)


def _backend(impl, args, shape, implementation) -> str:
  extra = args[3] if len(args) == 4 else {}
  return jaxflash.implementation_for(*args[:3], is_causal=shape.causal,
                                     implementation=implementation, **extra)


def accuracy_inputs(kind: str, shape: Shape, seed: int = 1):
  """q, k, v ~ N(0, 1) in float32; with ``kind="outliers"`` 0.1% of the features (at least one
  (head, channel) pair) are outliers: that channel of every token of q and k is multiplied by a
  factor drawn from [10, 50] (the channel-wise outliers of LLM activations). The value keeps
  its normal entries: the rotation, which must cancel in q kᵀ, cannot be applied to it."""
  keys = jax.random.split(jax.random.key(seed), 5)
  xs = [jax.random.normal(key, (shape.b, shape.s, shape.n, shape.d), jnp.float32)
        for key in keys[:3]]
  if kind == "outliers":
    features = shape.n * shape.d
    count = max(1, round(1e-3 * features))
    chosen = jax.random.choice(keys[3], features, (count,), replace=False)
    factors = jax.random.uniform(keys[4], (count,), minval=10.0, maxval=50.0)
    scale = jnp.ones(features).at[chosen].set(factors).reshape(shape.n, shape.d)
    xs = [xs[0] * scale, xs[1] * scale, xs[2]]
  return xs


def _probabilities64(s: np.ndarray, causal: bool) -> np.ndarray:
  """Softmax over the last axis of float64 logits [..., T, S], the causal band's top-left
  triangle kept where ``causal``."""
  if causal:
    s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True)


def reference64(q, k, v, causal: bool) -> np.ndarray:
  """The float64 output on the host."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
  return np.einsum("bnts,bsnh->btnh", _probabilities64(s, causal), v)


def run_accuracy(shape: Shape, implementation, out: Path, result: dict) -> None:
  rotation = jaxflash.random_rotation(jax.random.key(7), shape.d)
  for kind in ("normal", "outliers"):
    q, k, v = accuracy_inputs(kind, shape)
    want = reference64(q, k, v, shape.causal)
    calls = {
        "bf16": lambda: jaxflash.flash_attention(
            *(x.astype(jnp.bfloat16) for x in (q, k, v)), is_causal=shape.causal,
            implementation=implementation),
        "fp8": lambda: _fp8(per_tensor(q, k, v), shape, implementation),
        "fp8_block": lambda: _fp8(quantized(q, k, v, block_size=1), shape, implementation),
        "fp8_rotated": lambda: _fp8(quantized(q, k, v, block_size=1, rotation=rotation), shape,
                                    implementation),
    }
    for method, call in calls.items():
      row = dict(case="accuracy", inputs=kind, method=method, B=shape.b, S=shape.s, N=shape.n,
                 D=shape.d, causal=shape.causal)
      try:
        got = np.asarray(call(), np.float64)
        row["rmse"] = float(np.sqrt(np.mean((got - want) ** 2)))
        row["backend"] = _accuracy_backend(method, q, k, v, shape, implementation)
      except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      result["rows"].append(row)
      print(json.dumps(row), flush=True)
      write(result, out)


E4M3_MAX = 448.0


def _e4m3(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
  """``x`` rounded to e4m3 after division by ``scale`` (broadcast), and scaled back."""
  import ml_dtypes
  scale = np.where(scale > 0, scale, 1.0)
  return (np.clip(x / scale, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
          .astype(np.float64) * scale)


def _amax_scale(x: np.ndarray, axis: int) -> np.ndarray:
  """Scales that map the largest magnitude along ``axis`` (the contraction) to e4m3's largest."""
  return np.max(np.abs(x), axis=axis, keepdims=True) / E4M3_MAX


def gradients64(q, k, v, d_out, causal: bool, backward: str | None = None) -> list[np.ndarray]:
  """[dq, dk, dv] of dense attention in float64 on the host, one head at a time. ``backward``
  None: exact. ``"fp8_backward"`` or ``"fp8_backward_ideal"``: the FP8 forward's per-head e4m3
  q, k, v, and e4m3 operands in the backward's matmuls (module docstring)."""
  q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
  if backward is not None:  # (the FP8 forward's inputs: one scale per batch row and head)
    q, k, v = (_e4m3(x, np.max(np.abs(x), axis=(1, 3), keepdims=True) / E4M3_MAX)
               for x in (q, k, v))
  c = 1.0 / np.sqrt(q.shape[-1])
  grads = [np.zeros_like(x) for x in (q, k, v)]
  for b in range(q.shape[0]):
    for n in range(q.shape[2]):
      qh, kh, vh, doh = q[b, :, n], k[b, :, n], v[b, :, n], d_out[b, :, n]
      p = _probabilities64(qh @ kh.T * c, causal)
      delta = np.sum(doh * (p @ vh), axis=-1, keepdims=True)
      if backward is None:
        dp = doh @ vh.T
        ds = p * (dp - delta)
        dq, dk, dv = ds @ kh * c, ds.T @ qh * c, p.T @ doh
      elif backward == "fp8_backward_ideal":
        dp = _e4m3(doh, _amax_scale(doh, 1)) @ vh.T
        dv = _e4m3(p, _amax_scale(p, 0)).T @ _e4m3(doh, _amax_scale(doh, 0))
        ds = p * (dp - delta)
        dq = _e4m3(ds, _amax_scale(ds, 1)) @ kh * c
        dk = _e4m3(ds, _amax_scale(ds, 0)).T @ qh * c
      elif backward == "fp8_backward":
        dp = _e4m3(doh, _amax_scale(doh, 1)) @ vh.T
        dv = _e4m3(p, np.array(1.0 / E4M3_MAX)).T @ _e4m3(doh, _amax_scale(doh, 0))
        ds = p * (dp - delta)
        # |dS_ts| <= P_ts (|dP_ts| + |delta_t|) <= |dO_t| max_s |V_s| + |delta_t|, known before
        # the pass; dK = Σ_t dS_ts Q_t = Σ_t (dS_ts / b_t) (b_t Q_t) takes the same e4m3 dS.
        bound = (np.linalg.norm(doh, axis=1, keepdims=True)
                 * np.linalg.norm(vh, axis=1).max() + np.abs(delta)) / E4M3_MAX
        ds8 = _e4m3(ds, bound) / np.where(bound > 0, bound, 1.0)
        dq = ds8 @ kh * bound * c
        q_rows = qh * bound
        dk = ds8.T @ _e4m3(q_rows, _amax_scale(q_rows, 0)) * c
      else:
        raise ValueError(f"backward must be None, 'fp8_backward' or 'fp8_backward_ideal', got "
                         f"{backward!r}")
      grads[0][b, :, n], grads[1][b, :, n], grads[2][b, :, n] = dq, dk, dv
  return grads


def run_gradients(shape: Shape, implementation, out: Path, result: dict) -> None:
  rotation = jaxflash.random_rotation(jax.random.key(7), shape.d)
  for kind in ("normal", "outliers"):
    q, k, v = accuracy_inputs(kind, shape)
    d_out = jax.random.normal(jax.random.key(11), q.shape, jnp.float32)
    want = gradients64(q, k, v, d_out, shape.causal)

    def jaxflash_grads(fn):
      def loss(q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * d_out)
      bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
      return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*bf16)

    def fp8_attention_grads(backward, **form):
      return jaxflash_grads(lambda q, k, v: jaxflash.fp8_attention(
          q, k, v, is_causal=shape.causal, implementation=implementation, backward=backward,
          **form))

    rotated = dict(rotation=rotation, block_size=1)
    calls = {
        "bf16": lambda: jaxflash_grads(lambda q, k, v: jaxflash.flash_attention(
            q, k, v, is_causal=shape.causal, implementation=implementation)),
        "straight_through": lambda: fp8_attention_grads("straight_through"),
        "straight_through_token": lambda: fp8_attention_grads("straight_through", block_size=1),
        "straight_through_rotated": lambda: fp8_attention_grads("straight_through", **rotated),
        "mixed": lambda: fp8_attention_grads("mixed"),
        "mixed_rotated": lambda: fp8_attention_grads("mixed", **rotated),
        "fp8_backward": lambda: gradients64(q, k, v, d_out, shape.causal, "fp8_backward"),
        "fp8_backward_ideal": lambda: gradients64(q, k, v, d_out, shape.causal,
                                                  "fp8_backward_ideal"),
    }
    for method, call in calls.items():
      row = dict(case="gradients", inputs=kind, method=method, B=shape.b, S=shape.s, N=shape.n,
                 D=shape.d, causal=shape.causal)
      try:
        for name, got, ref in zip(("dq", "dk", "dv"), call(), want):
          got = np.asarray(got, np.float64)
          error = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
          # (JSON has no infinity: a gradient with an inf or NaN is listed instead.)
          row[name] = error if np.isfinite(error) else None
          if not np.isfinite(error):
            row.setdefault("not_finite", []).append(name)
        row["backend"] = ("host (float64 emulation)" if method.startswith("fp8")
                          else _accuracy_backend("bf16", q, k, v, shape, implementation))
      except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      result["rows"].append(row)
      print(json.dumps(row), flush=True)
      write(result, out)


def _fp8(quant, shape: Shape, implementation):
  (q8, k8, v8), descales = quant
  return jaxflash.flash_attention(q8, k8, v8, is_causal=shape.causal, out_dtype=jnp.float32,
                                  implementation=implementation, **descales)


def _accuracy_backend(method, q, k, v, shape, implementation) -> str:
  if method == "bf16":
    return jaxflash.implementation_for(*(x.astype(jnp.bfloat16) for x in (q, k, v)),
                                       is_causal=shape.causal, implementation=implementation)
  (q8, k8, v8), _ = per_tensor(q, k, v)
  return jaxflash.implementation_for(q8, k8, v8, is_causal=shape.causal,
                                     implementation=implementation)


def markdown(result: dict) -> str:
  lines = [f"# FP8 attention: {report.describe(result)}", "",
           "Forward TFLOP/s (4 B N S^2 D, half when causal); jaxflash_fp8: e4m3 with one descale "
           "per (batch row, K/V head); _token: one per token."]
  names = list(report.runs(result))
  if len(names) > 1:
    lines += ["", f"Rows from several runs ({', '.join(names)}: the JSON's `runs`); where two "
              "measured a cell, the later."]
  lines += ["",
            "| D | heads | causal | impl | config | ms | TFLOP/s | relerr |",
            "|---|---|---|---|---|---|---|---|"]
  # (In a file of several runs, each cell's latest: `report.current_rows`.)
  cell = lambda r: (r["case"], r.get("D"), r.get("N"), r.get("causal"), r.get("impl"),  # noqa: E731
                    r.get("config"), r.get("inputs"), r.get("method"))
  rows = report.current_rows(result, key=cell)
  for r in rows:
    if r["case"] != "speed":
      continue
    head = f"| {r['D']} | {r['N']} | {r['causal']} | {r['impl']} | {r.get('config') or ''} |"
    if "error" in r:
      lines.append(f"{head} error: {r['error'][:80]} | | |")
    else:
      wrong = " WRONG" if r["wrong"] else ""
      lines.append(f"{head} {r['ms']:.3f} | {r['tflops']:.0f} | {r['relerr']:.1e}{wrong} |")
  lines += ["", "Accuracy: RMSE of the output against a float64 reference.", "",
            "| inputs | method | RMSE |", "|---|---|---|"]
  for r in rows:
    if r["case"] == "accuracy":
      lines.append(f"| {r['inputs']} | {r['method']} | "
                   f"{r['rmse']:.2e} |" if "rmse" in r else
                   f"| {r['inputs']} | {r['method']} | error: {r['error'][:80]} |")
  gradients = [r for r in rows if r["case"] == "gradients"]
  if gradients:
    lines += ["", "Gradients: relative error against float64 (‖g − g64‖ / ‖g64‖).", "",
              "| inputs | method | dQ | dK | dV |", "|---|---|---|---|---|"]
    for r in gradients:
      cell = lambda g: "not finite" if r[g] is None else f"{r[g]:.2e}"  # noqa: E731
      lines.append(f"| {r['inputs']} | {r['method']} | "
                   + (" | ".join(cell(g) for g in ("dq", "dk", "dv")) if "dq" in r else
                      f"error: {r['error'][:80]} | | ") + " |")
  return "\n".join(lines) + "\n"


def write(result: dict, out: Path) -> None:
  report.write_table(result, out, markdown)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--parts", nargs="+", default=["speed", "accuracy", "gradients"],
                      choices=["speed", "accuracy", "gradients"])
  parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
  parser.add_argument("--configs", nargs="*", default=[], choices=list(CONFIGS))
  parser.add_argument("--shapes", type=int, nargs="*", default=None,
                      help="indices into the speed shapes")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, XLA backend)")
  parser.add_argument("--out", type=Path, default=None)
  args = parser.parse_args(argv)
  env = report.environment()
  out = args.out or report.default_out(env, "fp8")
  implementation = "xla" if args.smoke else None
  shapes = SMOKE if args.smoke else SPEED
  if args.shapes is not None:
    shapes = [shapes[i] for i in args.shapes]
  impls = [i for i in args.impls if not (args.smoke and i.startswith("cudnn"))]
  result = dict(environment=env, rows=[])
  if "speed" in args.parts:
    run_speed(shapes, impls, implementation, [(c, CONFIGS[c]) for c in args.configs], out,
              result)
  if "accuracy" in args.parts:
    shape = Shape(1, 96, 2, 64, True) if args.smoke else Shape(1, 2048, 8, 128, True)
    run_accuracy(shape, implementation, out, result)
  if "gradients" in args.parts:
    shape = Shape(1, 96, 2, 64, True) if args.smoke else Shape(1, 2048, 8, 128, True)
    run_gradients(shape, implementation, out, result)
  print(markdown(result))
  if any(r.get("wrong") or "error" in r for r in result["rows"]
         if r.get("impl", "jaxflash").startswith("jaxflash")):
    sys.exit(1)


if __name__ == "__main__":
  main()
