"""One attention call for Nsight Compute to profile (run on the GPU machine): the forward in
FP8 or bf16, or the forward+backward (``--grad``), with random inputs made (and quantised)
before it, compiled ahead, and launched twice, so ``--launch-skip 1`` skips a cold first call.

  ncu --launch-skip 0 --launch-count 1 -k regex:mosaic --section WarpStateStats \\
      --section SchedulerStats --section ComputeWorkloadAnalysis \\
      python3 benchmarks/dev/profile_call.py --d 128 --causal

  ncu -k regex:dqdkdv_atomic --launch-count 1 --section WarpStateStats \\
      python3 benchmarks/dev/profile_call.py --dtype bfloat16 --grad --no-deterministic \\
      --b 1 --s 8192 --heads 64 --kv-heads 8 --causal

The kernels are named in profiles (`jaxflash_mosaic_*`: the forward, `dkdv`, `dq`, and the one
pass `dqdkdv` or `dqdkdv_atomic`).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxflash
from jaxflash.attention import attention_with_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cases import mosaic_config  # noqa: E402


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--d", type=int, default=128)
  parser.add_argument("--dv", type=int, default=None,
                      help="the value head dim (default: --d), e.g. MLA's --d 192 --dv 128")
  parser.add_argument("--s", type=int, default=16384)
  parser.add_argument("--b", type=int, default=1)
  parser.add_argument("--heads", type=int, default=None, help="query heads (default: 2048 / D)")
  parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--dtype", default="float8_e4m3fn",
                      help="float8_e4m3fn (quantised with per-head factors) or bfloat16")
  parser.add_argument("--grad", action="store_true",
                      help="forward+backward (bf16 only: an FP8 call has no gradient)")
  parser.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True)
  parser.add_argument("--impl", choices=("jaxflash", "cudnn"), default="jaxflash",
                      help="cudnn: jax.nn.dot_product_attention's cuDNN call (bf16), to profile "
                           "next to ours")
  parser.add_argument("--backward", nargs="+", default=(), metavar="FIELD=VALUE",
                      help="`mosaic.Backward` fields over the call's default tiles (runs the "
                           "Mosaic backend), e.g. tile_major=False registers=240")
  args = parser.parse_args(argv)
  if args.impl == "cudnn" and (args.dtype != "bfloat16" or args.backward):
    raise SystemExit("--impl cudnn needs --dtype bfloat16 and no --backward")
  n = args.heads or 2048 // args.d
  kv = args.kv_heads or n
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (args.b, args.s, n, args.d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (args.b, args.s, kv, args.d), jnp.bfloat16)
  v = jax.random.normal(keys[2], (args.b, args.s, kv, args.dv or args.d), jnp.bfloat16)
  if args.dtype == "bfloat16":
    operands, options = (q, k, v), {}
  elif args.grad:
    raise SystemExit("--grad needs --dtype bfloat16")
  else:
    (q8, qd), (k8, kd), (v8, vd) = (jaxflash.quantize_fp8(x, dtype=jnp.dtype(args.dtype))
                                    for x in (q, k, v))
    operands, options = (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd)

  config = None
  # (Without a GPU, the H200's tiles in Mosaic GPU's interpreter: the CPU smoke test.)
  interpret = jax.default_backend() != "gpu"
  if args.backward:
    fields = {key: ast.literal_eval(value)
              for key, value in (field.split("=", 1) for field in args.backward)}
    config = mosaic_config(args.d, args.causal, args.s, groups=n // kv, value_dim=args.dv,
                           interpret=interpret, backward=fields)

  def call(q, k, v, options):
    if args.impl == "cudnn":  # (its default backward; deterministic only through XLA's flag)
      return jax.nn.dot_product_attention(q, k, v, is_causal=args.causal, implementation="cudnn")
    if config is not None:
      return attention_with_config(q, k, v, is_causal=args.causal, config=config,
                                   implementation="mosaic", deterministic=args.deterministic,
                                   interpret=interpret)
    return jaxflash.flash_attention(q, k, v, is_causal=args.causal,
                                    deterministic=args.deterministic, **options)

  if args.grad:
    d_out = jax.random.normal(keys[3], q.shape[:-1] + v.shape[-1:], jnp.float32)
    fn = jax.jit(lambda q, k, v, options, d_out: jax.grad(
        lambda q, k, v: jnp.sum(call(q, k, v, options).astype(jnp.float32) * d_out),
        argnums=(0, 1, 2))(q, k, v))
    arguments = (*operands, options, d_out)
  else:
    fn, arguments = jax.jit(call), (*operands, options)
  jax.block_until_ready(arguments)
  compiled = fn.lower(*arguments).compile()
  for _ in range(2):
    jax.block_until_ready(compiled(*arguments))


if __name__ == "__main__":
  main()
