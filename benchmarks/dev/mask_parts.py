"""Where the time of a masked call goes: every GPU kernel of the call, from a profile.

    PYTHONPATH=. python benchmarks/dev/mask_parts.py [--out DIR]

The issue's dense causal+padding case (bf16, B=4, S=4096, N=16, D=128, lengths
4096/3000/2048/1000) as a dense mask and as is_causal + lengths, forward and forward+backward:
wall time per call (median), and per call the GPU time of each kernel (a jax.profiler trace,
summed by kernel name), largest first.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxflash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cases import time_calls  # noqa: E402


def kernel_ms(fn, *args, calls=5):
  """GPU time per call of each kernel name (a profile of ``calls`` calls)."""
  jax.block_until_ready(fn(*args))
  folder = tempfile.mkdtemp()
  jax.profiler.start_trace(folder, create_perfetto_trace=True)
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  jax.profiler.stop_trace()
  path = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)[0]
  events = json.load(gzip.open(path))
  events = events["traceEvents"] if isinstance(events, dict) else events
  names = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
           for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
  totals = collections.Counter()
  for e in events:
    thread = names.get((e.get("pid"), e.get("tid")), "")
    if e.get("ph") == "X" and "stream" in thread.lower():
      totals[e["name"][:60]] += e.get("dur", 0) / 1e3 / calls
  return totals


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out")
  args = parser.parse_args()
  b, t, n, h = 4, 4096, 16, 128
  lengths = jnp.asarray([4096, 3000, 2048, 1000], jnp.int32)
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (b, t, n, h), jnp.bfloat16) for key in keys)
  pos = jnp.arange(t)
  valid = pos[None, :] < lengths[:, None]
  mask = (valid[:, None, :, None] & valid[:, None, None, :]
          & (pos[None, None, None, :] <= pos[None, None, :, None]))
  # (The mask is an argument, as a model passes it: closed over, it would be a constant that
  # XLA may fold the call's conversions of.)
  calls = {
      "mask": lambda q, k, v, mask: jaxflash.flash_attention(q, k, v, mask=mask),
      "structured": lambda q, k, v, mask: jaxflash.flash_attention(
          q, k, v, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths),
  }
  report = {}
  for name, call in calls.items():
    fwd = jax.jit(call)
    fwdbwd = jax.jit(jax.grad(lambda q, k, v, mask, call=call: jnp.sum(
        call(q, k, v, mask).astype(jnp.float32)), argnums=(0, 1, 2)))
    for mode, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
      kernels = kernel_ms(fn, q, k, v, mask)
      report[f"{name} {mode}"] = dict(wall_ms=time_calls(fn, (q, k, v, mask), calls=10)[0],
                                      gpu_ms=sum(kernels.values()),
                                      kernels=dict(kernels.most_common()))
  for key, row in report.items():
    print(f"== {key}: wall {row['wall_ms']:.3f} ms, GPU {row['gpu_ms']:.3f} ms")
    for kernel, ms in row["kernels"].items():
      print(f"   {ms:8.4f} ms  {kernel}")
  if args.out:
    json.dump(report, open(args.out, "w"), indent=1)


if __name__ == "__main__":
  main()
