"""Where a Mosaic forward+backward's compile time goes (run on a GPU machine).

    PYTHONPATH=. python3 benchmarks/dev/compile_parts.py --out DIR [--smoke]

One attention call's `jax.grad` program (the GPT example's shapes: B = 2, S = 8192, 8 heads of
128, causal, bf16), timed as trace, lower and compile:

1. cold, with Mosaic GPU's PTX dumped (``MOSAIC_GPU_DUMP_PTX``);
2. again after `jax.clear_caches()` (the spread between two compiles): Mosaic GPU's process-wide
   cache of compiled kernels does not spare this one its kernels, since a kernel lowered again
   gets a new `mosaic_gpu.dump_basename` from a per-process counter and so a new hash
   (jax 0.11.2);
3. ptxas alone on each dumped kernel, one after another and all at once (what compiling the
   kernels concurrently could save);
4. the lowering under cProfile (its Python hot spots).

Writes ``compile_parts.json`` and ``lower_profile.txt`` under ``--out``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import io
import json
import os
import pstats
import shutil
import subprocess
import tempfile
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: compile_time


def timed_compile(fn, args) -> dict:
  """`compile_time.stages`' seconds, and the size of the lowered program's text."""
  import compile_time  # (benchmarks/; imports jax, so after the dump variables are set)
  times, lowered = compile_time.stages(fn, args)
  return dict(times, hlo_chars=len(lowered.as_text()))


def ptxas_seconds(ptxas: str, files: list[Path], parallel: bool) -> float:
  def one(path: Path) -> None:
    subprocess.run([ptxas, "-arch=sm_90a", "-O3", str(path), "-o", os.devnull], check=True,
                   capture_output=True)
  start = time.perf_counter()
  if parallel:
    with concurrent.futures.ThreadPoolExecutor(len(files)) as pool:
      list(pool.map(one, files))
  else:
    for path in files:
      one(path)
  return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, xla backend (CPU)")
  args = parser.parse_args(argv)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  dumps = Path(tempfile.mkdtemp(prefix="compile_parts_"))
  dump_vars = dict(MOSAIC_GPU_DUMP_TO=str(dumps), MOSAIC_GPU_DUMP_PTX="1")
  if not args.smoke:  # (read when Mosaic GPU compiles; a smoke run in a test leaves them unset)
    os.environ.update(dump_vars)

  import jax
  import jax.numpy as jnp
  import jaxflash

  jax.config.update("jax_enable_compilation_cache", False)
  impl = "xla" if args.smoke else "mosaic"
  shape = (1, 64, 2, 32) if args.smoke else (2, 8192, 8, 128)

  def loss(q, k, v):
    out = jaxflash.flash_attention(q, k, v, is_causal=True, implementation=impl)
    return jnp.sum(out.astype(jnp.float32))

  def program():
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

  spec = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * 3
  result = dict(shape=list(shape), impl=impl, device=jax.devices()[0].device_kind)
  jax.clear_caches()
  result["cold"] = timed_compile(program(), spec)
  print("cold", result["cold"], flush=True)
  jax.clear_caches()
  result["again"] = timed_compile(program(), spec)
  print("again", result["again"], flush=True)

  ptx = sorted(dumps.rglob("*.ptx"))
  result["kernels"] = [dict(name=p.name, ptx_chars=p.stat().st_size) for p in ptx]
  cuda_root = os.environ.get("MOSAIC_GPU_CUDA_ROOT", "")
  ptxas = shutil.which("ptxas") or str(Path(cuda_root) / "bin" / "ptxas")
  if ptx and Path(ptxas).exists():
    for entry, path in zip(result["kernels"], ptx):
      entry["ptxas_s"] = ptxas_seconds(ptxas, [path], parallel=False)
    result["ptxas_serial_s"] = ptxas_seconds(ptxas, ptx, parallel=False)
    result["ptxas_parallel_s"] = ptxas_seconds(ptxas, ptx, parallel=True)
  print("kernels", result["kernels"], result.get("ptxas_serial_s"),
        result.get("ptxas_parallel_s"), flush=True)

  jax.clear_caches()
  traced = program().trace(*spec)
  profile = cProfile.Profile()
  profile.enable()
  traced.lower()
  profile.disable()
  text = io.StringIO()
  stats = pstats.Stats(profile, stream=text)
  stats.sort_stats("tottime").print_stats(30)
  stats.sort_stats("cumulative").print_stats(40)
  (out / "lower_profile.txt").write_text(text.getvalue())
  (out / "compile_parts.json").write_text(json.dumps(result, indent=1))
  shutil.rmtree(dumps, ignore_errors=True)
  if not args.smoke:
    for name in dump_vars:
      os.environ.pop(name, None)
  print(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
