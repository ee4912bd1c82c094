"""One FP8 forward call for Nsight Compute to profile (run on the GPU machine), after a warm-up
that compiles it; the quantisation runs before the profiled call.

  ncu --launch-skip 0 --launch-count 1 -k regex:mosaic --section WarpStateStats \\
      --section SchedulerStats --section ComputeWorkloadAnalysis \\
      python3 benchmarks/dev/fp8_profile.py --d 128 --causal

``--dtype bfloat16`` runs the bf16 forward instead, to compare the two kernels' stalls.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxflash


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--d", type=int, default=128)
  parser.add_argument("--s", type=int, default=16384)
  parser.add_argument("--heads", type=int, default=None, help="default: 2048 / D")
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--dtype", default="float8_e4m3fn")
  args = parser.parse_args()
  n = args.heads or 2048 // args.d
  q, k, v = (jax.random.normal(jax.random.key(i), (1, args.s, n, args.d), jnp.bfloat16)
             for i in range(3))
  fn = jax.jit(lambda q, k, v, d: jaxflash.flash_attention(q, k, v, is_causal=args.causal, **d))
  if args.dtype == "bfloat16":
    operands, descales = (q, k, v), {}
  else:
    (q8, qd), (k8, kd), (v8, vd) = (jaxflash.quantize_fp8(x, dtype=jnp.dtype(args.dtype))
                                    for x in (q, k, v))
    operands, descales = (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd)
  jax.block_until_ready((operands, descales))
  compiled = fn.lower(*operands, descales).compile()
  jax.block_until_ready(compiled(*operands, descales))  # (ncu: skip this launch, or not)
  jax.block_until_ready(compiled(*operands, descales))


if __name__ == "__main__":
  main()
