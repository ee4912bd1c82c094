"""jaxflash quickstart: check FlashAttention against a float32 reference, then time it.

The demo runs on whatever device JAX finds (a CPU, or an NVIDIA GPU such as an H100/H200) and:

1. builds random query/key/value tensors in the [batch, seq, heads, head_dim] (BTNH) layout;
2. checks that `jaxflash.flash_attention` (default backend: the Triton kernels on an NVIDIA GPU,
   the blockwise pure-JAX ones elsewhere) matches the dense float32 `reference_attention`, for the
   forward output and the gradients w.r.t. query, key and value, on a smaller problem (batch 1,
   at most 1024 tokens); it exits with status 1 if a relative error is over the tolerance
   (2e-2 for bf16/f16, 1e-3 for f32) or if jaxflash raises;
3. times the forward and forward+backward passes of jaxflash and of
   `jax.nn.dot_product_attention` (implementation "xla", and "cudnn" on a GPU), and reports
   TFLOP/s and the compiled programs' temporary memory (plus the device's peak memory on a GPU).

Run it from the repository root:

    PYTHONPATH=. python examples/demo.py                  # defaults for the device found
    PYTHONPATH=. python examples/demo.py --causal --seq 8192 --dtype f16

FLOP convention: forward = 4 * B * N * T * S * H (two matmuls), halved when causal;
forward+backward = 3.5 x forward.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
import traceback
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

import jaxflash
from jaxflash import devices, reference_attention

DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
# Largest relative error (||a - b|| / ||b||) accepted against the float32 reference.
TOLERANCES = {"bf16": 2e-2, "f16": 2e-2, "f32": 1e-3}
CHECK_MAX_SEQ = 1024  # the reference materialises [B, N, T, S] in float32: keep the check small
WARMUP_CALLS = 2

# (query, key, value) -> output, all [B, T, N, H].
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def on_gpu() -> bool:
  """True when calls here run on an NVIDIA GPU (jaxflash's own device check)."""
  return devices.has_nvidia_gpu()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """Command-line options; size defaults depend on the device (GPU vs CPU)."""
  gpu = on_gpu()
  parser = argparse.ArgumentParser(
      description="Check jaxflash.flash_attention against a float32 reference and time it "
                  "against jax.nn.dot_product_attention.")
  parser.add_argument("--batch", type=int, default=4 if gpu else 1,
                      help="batch size B (default: 4 on GPU, 1 on CPU)")
  parser.add_argument("--seq", type=int, default=4096 if gpu else 1024,
                      help="sequence length T = S (default: 4096 on GPU, 1024 on CPU)")
  parser.add_argument("--heads", type=int, default=16 if gpu else 8,
                      help="number of heads N (default: 16 on GPU, 8 on CPU)")
  parser.add_argument("--head-dim", type=int, default=128 if gpu else 64,
                      help="head dimension H (default: 128 on GPU, 64 on CPU)")
  parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                      help="input dtype (default: bf16)")
  parser.add_argument("--causal", action="store_true", help="use a causal mask")
  parser.add_argument("--repeats", type=int, default=10,
                      help="timed runs per measurement; the median is reported (default: 10)")
  parser.add_argument("--seed", type=int, default=0, help="PRNG seed (default: 0)")
  parser.add_argument("--skip-jaxflash-xla", action="store_true",
                      help="on a GPU, do not also time jaxflash's pure-JAX 'xla' backend")
  args = parser.parse_args(argv)
  for name in ("batch", "seq", "heads", "head_dim", "repeats"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be positive")
  return args


def make_inputs(batch: int, seq: int, heads: int, head_dim: int, dtype: DTypeLike,
                seed: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Random (query, key, value, d_out), each [B, T, N, H] in ``dtype``."""
  shape = (batch, seq, heads, head_dim)
  keys = jax.random.split(jax.random.key(seed), 4)
  return tuple(jax.random.normal(k, shape, dtype) for k in keys)


def loss_grad(attention: AttentionFn) -> Callable[..., tuple[jax.Array, jax.Array, jax.Array]]:
  """(q, k, v, d_out) -> (dq, dk, dv): the gradient of sum(attention(q, k, v) * d_out)."""
  def loss(q: jax.Array, k: jax.Array, v: jax.Array, d_out: jax.Array) -> jax.Array:
    out = attention(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2))


def relative_error(actual: jax.Array, expected: jax.Array) -> float:
  """||actual - expected|| / ||expected||, computed in float32."""
  actual = actual.astype(jnp.float32)
  expected = expected.astype(jnp.float32)
  return float(jnp.linalg.norm(actual - expected) / jnp.linalg.norm(expected))


def check_correctness(seq: int, heads: int, head_dim: int, dtype: DTypeLike, seed: int,
                      causal: bool, tolerance: float) -> bool:
  """Compares jaxflash's output and gradients with the float32 reference on a small problem:
  batch 1 and at most CHECK_MAX_SEQ tokens, with the benchmark's heads, head dim and dtype.

  It runs before the full-size inputs exist, so its arrays are freed before the timed runs.
  Prints one line per quantity; returns True when all are within ``tolerance``.
  """
  seq = min(seq, CHECK_MAX_SEQ)
  q, k, v, d_out = make_inputs(1, seq, heads, head_dim, dtype, seed)
  print(f"correctness vs float32 reference_attention (batch 1, seq {seq}, "
        f"tolerance {tolerance:.0e}):")

  flash = functools.partial(jaxflash.flash_attention, is_causal=causal)
  reference = lambda q, k, v: reference_attention(q, k, v, is_causal=causal)[0]  # noqa: E731

  got = (jax.jit(flash)(q, k, v),) + jax.jit(loss_grad(flash))(q, k, v, d_out)
  f32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
  want = (jax.jit(reference)(*f32[:3]),) + jax.jit(loss_grad(reference))(*f32)

  ok = True
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    err = relative_error(a, b)
    passed = err <= tolerance  # False for NaN too
    ok &= passed
    print(f"  {name:<4} relative error {err:.2e}  {'ok' if passed else 'FAIL'}")
  return ok


@dataclasses.dataclass
class Result:
  """One implementation's measurements (None where unmeasured); ``error`` if it could not run."""

  name: str
  fwd_ms: float | None = None
  fwd_bwd_ms: float | None = None
  temp_bytes: int | None = None
  peak_bytes: int | None = None
  peak_is_new: bool = True  # False: the process-wide peak did not rise during this run
  error: str | None = None


def median_ms(compiled: Callable[..., object], args: Sequence[jax.Array], repeats: int) -> float:
  """Median wall time of ``compiled(*args)`` in ms, after warm-up, each run synchronised."""
  for _ in range(WARMUP_CALLS):
    jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def temp_bytes(compiled: jax.stages.Compiled) -> int | None:
  """Temporary (scratch) bytes of a compiled program, or None if the backend does not say."""
  try:
    analysis = compiled.memory_analysis()
  except Exception:  # not implemented by every backend / plugin
    return None
  return getattr(analysis, "temp_size_in_bytes", None) if analysis is not None else None


def peak_bytes() -> int | None:
  """The device's process-wide peak allocation (GPU), or None where it is not reported."""
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:
    return None
  return stats.get("peak_bytes_in_use") if stats else None


def short_error(exc: BaseException) -> str:
  """First line of an exception message, shortened for the table's notes."""
  lines = str(exc).strip().splitlines()
  text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
  return text if len(text) <= 110 else text[:107] + "..."


def benchmark(name: str, attention: AttentionFn, q: jax.Array, k: jax.Array, v: jax.Array,
              d_out: jax.Array, repeats: int) -> Result:
  """Compiles and times the forward and forward+backward of one attention implementation."""
  result = Result(name)
  peak_before = peak_bytes()
  try:
    fwd = jax.jit(attention).lower(q, k, v).compile()
    fwd_bwd = jax.jit(loss_grad(attention)).lower(q, k, v, d_out).compile()
    result.temp_bytes = temp_bytes(fwd_bwd)
    result.fwd_ms = median_ms(fwd, (q, k, v), repeats)
    result.fwd_bwd_ms = median_ms(fwd_bwd, (q, k, v, d_out), repeats)
  except Exception as exc:  # e.g. cuDNN unavailable for this device/dtype/shape, out of memory
    return Result(name, error=short_error(exc))
  result.peak_bytes = peak_bytes()
  if peak_before is not None and result.peak_bytes is not None:
    result.peak_is_new = result.peak_bytes > peak_before
  return result


def tflops(flops: float, ms: float | None) -> str:
  """Achieved TFLOP/s, to three significant digits (CPU rates are far below 1)."""
  if ms is None:
    return "-"
  rate = flops / (ms * 1e-3) / 1e12
  return f"{rate:.0f}" if rate >= 100 else f"{rate:.3g}"


def megabytes(n: int | None) -> str:
  """Bytes in MB (2**20 bytes), or "n/a" when unknown."""
  return "n/a" if n is None else f"{n / 2**20:.1f}"


def print_table(results: Sequence[Result], fwd_flops: float, show_peak: bool) -> None:
  """Prints an aligned table of the results, then notes for the ones that could not run."""
  header = ["implementation", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s",
            "temp MB (fwd+bwd)"]
  if show_peak:
    header.append("peak MB")
  rows = []
  for r in results:
    if r.error is not None:
      rows.append([r.name] + ["-"] * (len(header) - 1))  # the reason is printed below
      continue
    row = [r.name, f"{r.fwd_ms:.2f}", tflops(fwd_flops, r.fwd_ms), f"{r.fwd_bwd_ms:.2f}",
           tflops(3.5 * fwd_flops, r.fwd_bwd_ms), megabytes(r.temp_bytes)]
    if show_peak:
      peak = megabytes(r.peak_bytes)
      row.append(peak if r.peak_is_new or r.peak_bytes is None else "<= " + peak)
    rows.append(row)
  widths = [max(len(str(row[i])) for row in [header] + rows) for i in range(len(header))]
  line = lambda cells: " | ".join(  # noqa: E731
      c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
  print(line(header))
  print("-+-".join("-" * w for w in widths))
  for row in rows:
    print(line(row))
  for r in results:
    if r.error is not None:
      print(f"  {r.name}: unavailable ({r.error})")
  if show_peak:
    print("  peak MB: the device's peak_bytes_in_use after the run: a process-wide high-water "
          "mark (inputs,\n  compile-time scratch and earlier runs included) that cannot be "
          "reset, so '<=' marks a run that did not raise it.")


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  gpu = on_gpu()
  dtype = DTYPES[args.dtype]
  b, t, n, h = args.batch, args.seq, args.heads, args.head_dim
  device = jax.devices()[0]
  shape = jax.ShapeDtypeStruct((b, t, n, h), dtype)
  default_backend = jaxflash.implementation_for(shape, shape, shape, is_causal=args.causal)

  print(f"device : {device.device_kind} ({device.platform}, {jax.device_count()} device(s))")
  print(f"jax    : {jax.__version__}   jaxflash {jaxflash.__version__} "
        f"(default backend here: {default_backend})")
  print(f"config : batch={b} seq={t} heads={n} head_dim={h} dtype={jnp.dtype(dtype).name} "
        f"causal={args.causal} repeats={args.repeats}")
  print()

  try:
    correct = check_correctness(t, n, h, dtype, args.seed, args.causal, TOLERANCES[args.dtype])
  except Exception:
    traceback.print_exc()
    print(f"FAILED: jaxflash.flash_attention ({default_backend} backend) raised an error on "
          f"this device/configuration (traceback above)", file=sys.stderr)
    return 1
  if not correct:
    print("FAILED: jaxflash.flash_attention disagrees with the float32 reference",
          file=sys.stderr)
    return 1
  print()

  # Run (and listed) roughly from the smallest memory footprint to the largest, so that the
  # GPU's process-wide peak-memory counter, which only grows, says as much as it can per row.
  causal = args.causal
  flash = functools.partial(jaxflash.flash_attention, is_causal=causal)
  jax_nn = functools.partial(jax.nn.dot_product_attention, is_causal=causal)
  candidates: list[tuple[str, AttentionFn]] = [(f"jaxflash ({default_backend}, default)", flash)]
  if gpu:
    candidates.append(("jax.nn (cudnn)", functools.partial(jax_nn, implementation="cudnn")))
  if gpu and default_backend != "xla" and not args.skip_jaxflash_xla:
    candidates.append(("jaxflash (xla)", functools.partial(flash, implementation="xla")))
  candidates.append(("jax.nn (xla)", functools.partial(jax_nn, implementation="xla")))

  q, k, v, d_out = make_inputs(b, t, n, h, dtype, args.seed)
  print(f"timing: median of {args.repeats} runs after {WARMUP_CALLS} warm-up calls")
  results = []
  for name, attention in candidates:
    start = time.perf_counter()
    results.append(benchmark(name, attention, q, k, v, d_out, args.repeats))
    status = "unavailable" if results[-1].error else "done"
    print(f"  {name}: {status} in {time.perf_counter() - start:.1f} s (compile + timing)")
  print()

  fwd_flops = 4.0 * b * n * t * t * h / (2 if causal else 1)
  print_table(results, fwd_flops, show_peak=gpu and any(r.peak_bytes for r in results))
  if not gpu:
    print("  (jax.nn implementation='cudnn' and jaxflash's Triton kernels need an NVIDIA GPU)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
