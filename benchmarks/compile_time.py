"""Compile time: how long one attention call takes to lower and compile, per backend, and how
that grows with identical layers in one program.

    PYTHONPATH=. python benchmarks/compile_time.py [--out FILE] [--smoke]

For each implementation (jaxflash's mosaic, triton and xla backends, and jax.nn's cudnn on a GPU)
a forward+backward program (jax.grad of the sum of the outputs) over 1 and over ``--layers``
attention calls of the same shapes (each layer's output feeds the next, as in a model) is traced,
lowered and compiled, with JAX's in-memory caches cleared before each and the persistent cache
off. Shapes: the GPT example's (B = 2, S = 8192, 8 heads of 128, causal, bf16). Writes
``benchmarks/results/<device>/compile_time.json``: rows ``{impl, layers, trace_s, lower_s,
compile_s, total_s}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402

import jaxflash  # noqa: E402


def attention_fn(impl: str):
  if impl == "cudnn":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                        implementation="cudnn")
  return lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=True, implementation=impl)


def program(impl: str, layers: int):
  attend = attention_fn(impl)

  def loss(q, k, v):
    x, total = q * 1.0, 0.0
    for _ in range(layers):
      out = attend(x, k * 1.0, v * 1.0)
      total = total + jnp.sum(out.astype(jnp.float32))
      x = out * 0.5 + q
    return total

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def stages(fn, args) -> tuple[dict, object]:
  """Seconds to trace, lower and compile the jitted ``fn`` on ``args`` (and their total), and
  the lowered program."""
  start = time.perf_counter()
  traced = fn.trace(*args)
  traced_at = time.perf_counter()
  lowered = traced.lower()
  lowered_at = time.perf_counter()
  lowered.compile()
  done = time.perf_counter()
  return dict(trace_s=traced_at - start, lower_s=lowered_at - traced_at,
              compile_s=done - lowered_at, total_s=done - start), lowered


def measure(impl: str, layers: int, shape) -> dict:
  jax.clear_caches()
  args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * 3
  times, _ = stages(program(impl, layers), args)
  return dict(impl=impl, layers=layers, shape=list(shape), **times)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", help="results JSON (default results/<device>/compile_time.json)")
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--impls", nargs="+")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, xla only (CPU)")
  args = parser.parse_args(argv)
  jax.config.update("jax_enable_compilation_cache", False)
  on_gpu = jax.devices()[0].platform == "gpu"
  impls = args.impls or (["mosaic", "triton", "xla", "cudnn"] if on_gpu else ["xla"])
  shape = (1, 64, 2, 32) if args.smoke else (2, 8192, 8, 128)
  rows = []
  for impl in impls:
    for layers in (1, args.layers):
      try:
        rows.append(measure(impl, layers, shape))
      except Exception as e:  # noqa: BLE001 (a backend that cannot serve: record why)
        rows.append(dict(impl=impl, layers=layers, error=repr(e)[:300]))
      r = rows[-1]
      print(f"{impl:8s} layers {layers:2d}: " + (
          f"trace {r['trace_s']:.2f} s, lower {r['lower_s']:.2f} s, compile "
          f"{r['compile_s']:.2f} s, total {r['total_s']:.2f} s" if "error" not in r
          else r["error"]), flush=True)
  env = report.environment()
  result = dict(environment=env, rows=rows)
  out = Path(args.out) if args.out else report.default_out(env, "compile_time")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1))
  print(f"wrote {out}")
  return result


if __name__ == "__main__":
  main()
