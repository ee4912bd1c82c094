"""Forward and forward+backward speed of jaxflash next to jax.nn.dot_product_attention.

Run on the GPU machine from the repo root:

    PYTHONPATH=. python benchmarks/bench.py --out benchmarks/results/<device>.json
    PYTHONPATH=. python benchmarks/bench.py --tune      # try Triton tile sizes, print the best

Grid (the FlashAttention-2 paper's, as in ../shared/anchors): 16k tokens per batch (B = 16384 / S),
hidden 2048 (N = 2048 / D heads), bf16, self-attention. Every implementation's output is first
checked against a float32 reference on fresh random inputs (one batch row, two heads). Timing:
jit, two warm-up calls, then 5 repeats of 20 back-to-back calls ended by block_until_ready; the
median per call. FLOPs: forward 4*B*N*S^2*D, halved when causal; forward+backward 3.5x forward.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp

import jaxflash
from jaxflash import triton as triton_backend

TOKENS, HIDDEN = 16384, 2048


def flops(b, n, s, d, causal, mode):
  f = 4.0 * b * n * s * s * d * (0.5 if causal else 1.0)
  return f * (3.5 if mode == "fwdbwd" else 1.0)


def time_call(fn, args, calls=20, repeats=5) -> float:
  """Median milliseconds per call of a jitted ``fn`` (two warm-ups first)."""
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  per_call = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    per_call.append((time.perf_counter() - start) / calls * 1e3)
  return statistics.median(per_call)


def implementations(causal: bool) -> dict:
  def flash(q, k, v):
    return jaxflash.flash_attention(q, k, v, is_causal=causal, implementation="triton")

  def nn(impl):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation=impl)

  impls = {"jaxflash_triton": flash, "xla": nn("xla"), "cudnn": nn("cudnn")}
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    def pallas_mha(q, k, v):
      return pallas_attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal)

    impls["pallas_mha"] = pallas_mha
  except Exception:  # noqa: BLE001 - optional comparison
    pass
  return impls


def inputs(b, s, n, d, dtype, seed):
  keys = jax.random.split(jax.random.key(seed), 4)
  return [jax.random.normal(key, (b, s, n, d), dtype) for key in keys]


def relerr_vs_float32(fn, q, k, v, causal) -> float:
  """Output error on batch row 0, heads 0-1, against float32 attention at highest precision."""
  sl = (slice(0, 1), slice(None), slice(0, 2))
  out = jax.jit(fn)(q[sl], k[sl], v[sl]).astype(jnp.float32)
  with jax.default_matmul_precision("highest"):
    ref = jax.nn.dot_product_attention(*(x[sl].astype(jnp.float32) for x in (q, k, v)),
                                       is_causal=causal, implementation="xla")
  return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def run_case(name, fn, b, s, n, d, causal, dtype, seed) -> list[dict]:
  q, k, v, d_out = inputs(b, s, n, d, dtype, seed)
  rows = []
  try:
    err = relerr_vs_float32(fn, q, k, v, causal)
  except Exception as e:  # noqa: BLE001 - report and move on
    return [dict(impl=name, B=b, S=s, N=n, D=d, causal=causal, error=repr(e)[:300])]
  fwd = jax.jit(fn)
  fwdbwd = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * d_out),
                            argnums=(0, 1, 2)))
  for mode, f in (("fwd", fwd), ("fwdbwd", fwdbwd)):
    row = dict(impl=name, mode=mode, B=b, S=s, N=n, D=d, causal=causal,
               dtype=jnp.dtype(dtype).name, relerr=err if mode == "fwd" else None)
    try:
      row["temp_bytes"] = f.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
      row["ms"] = time_call(f, (q, k, v))
      row["tflops"] = flops(b, n, s, d, causal, mode) / (row["ms"] * 1e-3) / 1e12
    except Exception as e:  # noqa: BLE001 - e.g. out of memory for the dense XLA path
      row["error"] = repr(e)[:300]
    rows.append(row)
  return rows


def sweep(args) -> list[dict]:
  rows = []
  cases = [(d, s, c) for d in args.head_dims for s in args.seqs for c in (False, True)]
  for i, (d, s, causal) in enumerate(cases):
    b, n = max(1, TOKENS // s), HIDDEN // d
    for name, fn in implementations(causal).items():
      if name not in args.impls:
        continue
      print(f"[{i + 1}/{len(cases)}] D={d} S={s} causal={causal} {name}", file=sys.stderr,
            flush=True)
      rows += run_case(name, fn, b, s, n, d, causal, jnp.bfloat16, seed=i)
  return rows


def tune(args) -> list[dict]:
  """Times candidate Triton tile sizes (forward and backward separately) at S = 4k."""
  fwd_opts = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2),
              (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 3), (64, 64, 8, 2)]
  bwd_opts = [(64, 64, 4, 2), (64, 64, 8, 2), (64, 128, 8, 2), (128, 64, 8, 2), (32, 64, 4, 2),
              (64, 32, 4, 2), (128, 128, 8, 1), (32, 32, 4, 2), (64, 64, 4, 1), (32, 64, 8, 1)]
  rows = []
  for d in args.head_dims:
    s = 4096
    b, n = TOKENS // s, HIDDEN // d
    for causal in (False, True):
      q, k, v, d_out = inputs(b, s, n, d, jnp.bfloat16, 0)
      base = triton_backend.default_block_sizes(d, jnp.bfloat16)
      for kind, opts in (("fwd", fwd_opts), ("bwd", bwd_opts)):
        for opt in opts:
          if kind == "fwd":
            bs = triton_backend.BlockSizes(*opt, *list(vars(base).values())[4:])
          else:
            bs = triton_backend.BlockSizes(*list(vars(base).values())[:4], *opt)
          original = triton_backend.default_block_sizes
          triton_backend.default_block_sizes = lambda *a, bs=bs: bs
          try:
            fn = lambda q, k, v: jaxflash.flash_attention(  # noqa: E731
                q, k, v, is_causal=causal, implementation="triton")
            if kind == "fwd":
              f = jax.jit(fn)
            else:
              f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)
                                                           * d_out), argnums=(0, 1, 2)))
            ms = time_call(f, (q, k, v), calls=10, repeats=3)
            err = None
          except Exception as e:  # noqa: BLE001 - configs that do not fit are skipped
            ms, err = None, repr(e)[:200]
          finally:
            triton_backend.default_block_sizes = original
          mode = "fwd" if kind == "fwd" else "fwdbwd"
          tf = None if ms is None else flops(b, n, s, d, causal, mode) / (ms * 1e-3) / 1e12
          rows.append(dict(kind=kind, D=d, causal=causal, blocks=opt, ms=ms, tflops=tf,
                           error=err))
          print(f"tune D={d} causal={causal} {kind} {opt}: "
                f"{'fail' if tf is None else f'{tf:.0f} TFLOP/s'}", file=sys.stderr, flush=True)
  return rows


def environment() -> dict:
  dev = jax.devices()[0]
  env = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__,
             jaxlib=jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
             date=datetime.date.today().isoformat())
  try:
    import subprocess
    env["driver"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=20).stdout.strip()
  except Exception:  # noqa: BLE001
    pass
  try:
    from jax._src.lib import cuda_versions
    env["cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
  except Exception:  # noqa: BLE001
    pass
  return env


def table(rows) -> str:
  cells = {}
  impls = []
  for r in rows:
    if "mode" not in r:
      continue
    if r["impl"] not in impls:
      impls.append(r["impl"])
    cells[(r["D"], r["S"], r["causal"], r["mode"], r["impl"])] = (
        "err" if r.get("tflops") is None else f"{r['tflops']:.0f}")
  keys = sorted({k[:4] for k in cells})
  lines = ["| D | S | causal | mode | " + " | ".join(impls) + " |",
           "|---|---|---|---|" + "---|" * len(impls)]
  for key in keys:
    d, s, c, m = key
    lines.append(f"| {d} | {s} | {'y' if c else 'n'} | {m} | "
                 + " | ".join(cells.get(key + (i,), "-") for i in impls) + " |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", help="write the JSON results here")
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
  parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384])
  parser.add_argument("--impls", nargs="+",
                      default=["jaxflash_triton", "xla", "cudnn", "pallas_mha"])
  parser.add_argument("--tune", action="store_true", help="sweep Triton tile sizes instead")
  args = parser.parse_args()
  env = environment()
  print(json.dumps(env), file=sys.stderr)
  rows = tune(args) if args.tune else sweep(args)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(environment=env, flop_convention="fwd 4*B*N*S^2*D (x0.5 causal); "
                     "fwdbwd 3.5x fwd", rows=rows), f, indent=1)
  if args.tune:
    for d in args.head_dims:
      for causal in (False, True):
        for kind in ("fwd", "bwd"):
          ok = [r for r in rows if r["D"] == d and r["causal"] == causal and r["kind"] == kind
                and r["tflops"]]
          best = max(ok, key=lambda r: r["tflops"]) if ok else None
          print(f"best D={d} causal={causal} {kind}: "
                f"{best and best['blocks']} {best and round(best['tflops'])} TFLOP/s")
  else:
    errors = [r for r in rows if r.get("error")]
    for r in errors:
      print("ERROR", r["impl"], r.get("mode"), r["D"], r["S"], r["causal"], r["error"][:150])
    bad = [r for r in rows if r.get("relerr") is not None and not r["relerr"] < 2e-2]
    for r in bad:
      print("WRONG", r["impl"], r["D"], r["S"], r["causal"], r["relerr"])
    print(table(rows))


if __name__ == "__main__":
  main()
