"""What FP8's incoherent rotation costs a training step's attention, by the precision of its
matmuls (`jaxflash.fp8.ROTATION_PRECISION`), and what each precision does to the result.

At the GPT example's attention shape (B = 2, 8k tokens, 8 heads of 128, causal, bf16): the
forward and backward of `jaxflash.flash_attention` (bf16), of `jaxflash.fp8_attention`
without a rotation, and with `random_rotation`'s matrix at each precision, in turn, each
round in the same process; medians of ``--rounds`` rounds of 20 calls. Then each rotated
variant's output and gradients against the float32 reference on inputs with outlier features
(relative RMSE), and against the HIGHEST variant's.

    python3 benchmarks/dev/rotation_cost.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/cases.py

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxflash  # noqa: E402
from cases import time_call  # noqa: E402
from jaxflash import fp8, reference  # noqa: E402

PRECISIONS = {"highest": jax.lax.Precision.HIGHEST, "high": jax.lax.Precision.HIGH,
              "default": jax.lax.Precision.DEFAULT}


def inputs(b, t, n, d, seed=0, outliers=True):
  keys = jax.random.split(jax.random.key(seed), 4)
  q, k, v, do = (jax.random.normal(key, (b, t, n, d), jnp.float32) for key in keys)
  if outliers:  # a few features 10x larger in q and k (what the rotation is for)
    boost = jnp.ones((d,)).at[jnp.array([3, 17, 90])].set(10.0)
    q, k = q * boost, k * boost
  return tuple(x.astype(jnp.bfloat16) for x in (q, k, v, do))


def step_fn(variant: str, rotation):
  """A jitted forward+backward of ``variant``, traced now (the precision is read at trace)."""
  def attend(q, k, v):
    if variant == "bf16":
      return jaxflash.flash_attention(q, k, v, is_causal=True)
    if variant == "fp8":
      return jaxflash.fp8_attention(q, k, v, is_causal=True)
    return jaxflash.fp8_attention(q, k, v, is_causal=True, rotation=rotation)

  def loss(q, k, v, do):
    return jnp.sum(attend(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

  grad = jax.jit(lambda q, k, v, do: (attend(q, k, v), jax.grad(loss, (0, 1, 2))(q, k, v, do)))
  return grad


def rel_rmse(x, ref):
  x, ref = (jnp.asarray(a, jnp.float32) for a in (x, ref))
  return float(jnp.sqrt(jnp.mean((x - ref) ** 2)) / jnp.sqrt(jnp.mean(ref ** 2)))


def main(argv=None) -> dict:
  """Prints the table; returns {"ms": {variant: median ms}, "errors": {variant: [out, dq, dk,
  dv] relative RMSE against float32}}. `fp8.ROTATION_PRECISION` is the caller's again after."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--shape", type=int, nargs=4, default=(2, 8192, 8, 128))
  args = parser.parse_args(argv)
  shipped = fp8.ROTATION_PRECISION
  try:
    return _measure(args)
  finally:
    fp8.ROTATION_PRECISION = shipped


def _measure(args) -> dict:
  b, t, n, d = args.shape
  rotation = fp8.random_rotation(jax.random.key(0), d)
  data = inputs(b, t, n, d)
  fns = {}
  for variant in ("bf16", "fp8", "rotated_highest", "rotated_high", "rotated_default"):
    if variant.startswith("rotated_"):
      fp8.ROTATION_PRECISION = PRECISIONS[variant.split("_")[1]]
    fns[variant] = step_fn(variant, rotation)
    jax.block_until_ready(fns[variant](*data))  # traced and compiled under that precision
  times = {v: [] for v in fns}
  for _ in range(args.rounds):
    for variant, fn in fns.items():
      times[variant].append(time_call(fn, data, calls=20, repeats=1))
  print(f"forward+backward, B={b} T={t} N={n} D={d}, causal, ms (median of {args.rounds}):")
  base = statistics.median(times["bf16"])
  result = {"ms": {v: statistics.median(ts) for v, ts in times.items()}, "errors": {}}
  for variant, ts in times.items():
    print(f"  {variant:18s} {statistics.median(ts):7.3f}  x{statistics.median(ts) / base:.3f}"
          f"  ({', '.join(f'{x:.3f}' for x in ts)})")
  # Accuracy at a smaller shape (the float32 reference holds [T, S] logits).
  small = inputs(1, min(t, 2048), min(n, 4), d, seed=1)
  q, k, v, do = small
  ref_out, ref_vjp = jax.vjp(
      lambda q, k, v: reference.reference_attention(q, k, v, is_causal=True)[0],
      *(x.astype(jnp.float32) for x in (q, k, v)))
  ref_grads = ref_vjp(do.astype(jnp.float32))
  results = {}
  for variant in ("rotated_highest", "rotated_high", "rotated_default"):
    fp8.ROTATION_PRECISION = PRECISIONS[variant.split("_")[1]]
    out, grads = step_fn(variant, rotation)(*small)
    results[variant] = (out, grads)
    errs = [rel_rmse(out, ref_out)] + [rel_rmse(g, r) for g, r in zip(grads, ref_grads)]
    result["errors"][variant] = errs
    print(f"  {variant:18s} rel. RMSE vs float32: out {errs[0]:.4e}  dq {errs[1]:.4e}  "
          f"dk {errs[2]:.4e}  dv {errs[3]:.4e}")
  top = results["rotated_highest"]
  for variant in ("rotated_high", "rotated_default"):
    out, grads = results[variant]
    print(f"  {variant:18s} vs highest: out {rel_rmse(out, top[0]):.3e}  "
          + "  ".join(f"{name} {rel_rmse(g, r):.3e}" for name, g, r in zip("qkv", grads, top[1])))
  return result


if __name__ == "__main__":
  main()
