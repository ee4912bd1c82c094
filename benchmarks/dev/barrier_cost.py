"""What `flash.output_cotangents`' optimization barrier on d_out costs a training step on the GPU:
the jitted forward+backward of one layer's attention (a cotangent from a projection, as in a
model, so that XLA could fuse d_out's producer), with the barrier and with it swapped out, in one
process, interleaved, medians of fresh runs on random inputs (never zeros).

    python benchmarks/dev/barrier_cost.py [--out barrier.json]

Prints one line per case: milliseconds with and without the barrier and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

import jaxflash
from jaxflash import _core
from jaxflash.ops import flash

CASES = [  # (B, T, N, K, D, causal)
    (4, 4096, 16, 16, 128, False), (4, 4096, 16, 16, 128, True),
    (8, 2048, 32, 8, 64, True), (1, 16384, 16, 16, 128, True)]


def _without_barrier(out, cotangents):
  """`flash.output_cotangents` as it was before 2026-12-05 (no barrier)."""
  d_out, d_lse = cotangents
  if isinstance(d_out, jax.custom_derivatives.SymbolicZero):
    d_out = jnp.zeros(out.shape, out.dtype)
  return d_out, _core.delta(out, d_out, d_lse)


def _step(b, t, n, k, d, causal):
  keys = jax.random.split(jax.random.key(t + n + d), 5)
  q = jax.random.normal(keys[0], (b, t, n, d), jnp.bfloat16)
  kk = jax.random.normal(keys[1], (b, t, k, d), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, t, k, d), jnp.bfloat16)
  w = jax.random.normal(keys[3], (n * d, 256), jnp.bfloat16) * 0.05

  def loss(q, kk, v):
    out = jaxflash.flash_attention(q, kk, v, is_causal=causal)
    return jnp.sum((out.reshape(b, t, n * d) @ w).astype(jnp.float32) ** 2)

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, kk, v)


def _time(fn, args, reps: int = 9) -> float:
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None)
  parser.add_argument("--small", action="store_true", help="one tiny case (a CPU smoke run)")
  args = parser.parse_args()
  cases = [(1, 128, 2, 2, 32, True)] if args.small else CASES
  barrier = flash.output_cotangents
  rows = []
  for case in cases:
    timed = {}
    for name, fn in (("barrier", barrier), ("none", _without_barrier)):
      flash.output_cotangents = fn  # read at trace time by every custom_vjp
      step, inputs = _step(*case)
      jax.block_until_ready(step(*inputs))  # compile and warm up
      timed[name] = (step, inputs)
    flash.output_cotangents = barrier
    ms = {"barrier": [], "none": []}
    for _ in range(3):  # interleaved rounds
      for name, (step, inputs) in timed.items():
        ms[name].append(_time(step, inputs))
    row = dict(zip(("B", "T", "N", "K", "D", "causal"), case),
               barrier_ms=statistics.median(ms["barrier"]), none_ms=statistics.median(ms["none"]))
    row["ratio"] = row["barrier_ms"] / row["none_ms"]
    rows.append(row)
    print(f"{case}: barrier {row['barrier_ms']:.3f} ms, none {row['none_ms']:.3f} ms, "
          f"ratio {row['ratio']:.3f}", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f,
                indent=1)


if __name__ == "__main__":
  main()
