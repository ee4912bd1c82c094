"""The dense bf16 matmul rate of this card (the ceiling the Mosaic kernels are measured against):
``jnp.dot`` of random square bf16 matrices with float32 accumulation, median of timed repeats
after warm-up, for a few sizes.
Prints TFLOP/s (2 n³ FLOPs per product) and writes ``--out`` as JSON.

  python3 benchmarks/dev/matmul_ceiling.py --out /tmp/matmul.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cases import time_call  # noqa: E402
import report  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out")
  parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
  args = parser.parse_args()
  rows = []
  for n in args.sizes:
    ka, kb = jax.random.split(jax.random.key(n))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(
        jnp.bfloat16))
    ms = time_call(dot, (a, b), calls=10, repeats=5)
    rows.append(dict(n=n, ms=ms, tflops=2 * n**3 / (ms * 1e-3) / 1e12))
    print(f"bf16 matmul {n}^3: {rows[-1]['tflops']:.0f} TFLOP/s ({ms:.3f} ms)", flush=True)
  result = dict(environment=report.environment(), rows=rows,
                ceiling_tflops=max(r["tflops"] for r in rows))
  print(f"ceiling: {result['ceiling_tflops']:.0f} TFLOP/s")
  if args.out:
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
  main()
