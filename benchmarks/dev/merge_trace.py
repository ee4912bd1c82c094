"""Where the splits' merge inside the absorbed-MLA decoding kernel spends its time (run on the
GPU machine): the kernel with `MlaDecodeConfig.merge_in_kernel` compiled with Mosaic GPU's
in-kernel profiler on, which records the named scopes of `jaxflash/backends/mosaic/decode.py`
(``merge_*``) per warpgroup of every CTA, and the trace of one call summarised: per consumer and
scope, the median time per occurrence and per consumer (thousands of cycles: `scope_times`),
over the CTAs that merged.

  python3 benchmarks/dev/merge_trace.py --cells 32x8192x1 --splits 2 4 --out /tmp/trace

The profiler keeps its events in shared memory, which the kernel nearly fills: ``--space`` (the
scopes a warpgroup keeps; later ones are dropped) must stay small, so each run records two of
the per-item scopes (``--scopes``), the first items' only.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

import jaxflash
from jaxflash.backends.mosaic import decode as mla

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_parts import HEAD_DIM, VALUE_DIM, compile_with  # noqa: E402


def scope_times(trace: dict) -> dict[int, dict[str, list[float]]]:
  """``{warpgroup: {scope: [thousands of cycles per occurrence]}}`` over a trace's begin/end
  pairs, each thread's events nested; the threads that merged (a ``merge`` scope) only, and
  ``"consumers"`` one entry per such thread. (Mosaic GPU's profiler stamps events with the SM's
  ``%clock`` from a ``%globaltimer`` start and writes them as if nanoseconds: a trace's "µs"
  are thousands of cycles, half a µs at the H200's 1.98 GHz.)"""
  by_thread = collections.defaultdict(list)
  for event in trace["traceEvents"]:
    by_thread[(event["pid"], event["tid"])].append(event)
  times = collections.defaultdict(lambda: collections.defaultdict(list))
  for (_, tid), events in by_thread.items():
    if not any(e["name"] == "merge" for e in events):
      continue
    warpgroup = (tid - 1) % 3  # (tid 1 + the trace's index; three warpgroups a CTA)
    open_scopes = []
    for event in sorted(events, key=lambda e: e["ts"]):
      if event["ph"] == "B":
        open_scopes.append(event)
      elif open_scopes:
        begin = open_scopes.pop()
        times[warpgroup][begin["name"]].append(event["ts"] - begin["ts"])
    times[warpgroup]["consumers"].append(1.0)
  return times


def only_scopes(names):
  """`jax.named_scope` that opens the ``merge*`` scopes in ``names`` (and every other scope) and
  skips the other ``merge*`` ones: the profiler's room holds few events."""
  named_scope = jax.named_scope

  def scope(name):
    if name.startswith("merge") and name not in names:
      return contextlib.nullcontext()
    return named_scope(name)

  return scope


def traced(b: int, s: int, t: int, heads: int, splits: int, space: int, scopes, out: Path
           ) -> Path:
  """Runs the merging kernel once with the profiler on (the ``scopes`` recorded), checked
  against the shipped call (XLA merging); returns the trace file."""
  out.mkdir(parents=True, exist_ok=True)
  before = set(out.glob("*-trace.json"))
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (b, t, heads, HEAD_DIM), jnp.bfloat16)
  cache = jax.random.normal(keys[1], (b, s, 1, HEAD_DIM), jnp.bfloat16)
  kv_lengths = jax.random.randint(keys[2], (b,), s - 64, s + 1, jnp.int32)
  args = (q, cache, kv_lengths)

  def call(q, c, ln):
    return jaxflash.decode_attention(q, c, None, ln, value_head_dim=VALUE_DIM)

  shipped = mla.default_config

  def config(*a, **kw):
    return dataclasses.replace(shipped(*a, **kw), merge_in_kernel=True, splits=splits)

  params = functools.partial(plgpu.CompilerParams, profile_space=space, profile_dir=str(out),
                             profile_bounds_check=True)
  want = np.asarray(compile_with(call, args)(*args), np.float32)
  profiled = compile_with(call, args, [(mla, "default_config", config),
                                       (mla.plgpu, "CompilerParams", params),
                                       (jax, "named_scope", only_scopes(scopes))])
  got = np.asarray(profiled(*args), np.float32)
  jax.effects_barrier()
  if not np.allclose(got, want, atol=1e-2, rtol=1e-2):
    raise SystemExit(f"the profiled merge differs from the call: {np.abs(got - want).max()}")
  made = sorted(set(out.glob("*-trace.json")) - before)
  if not made:
    raise SystemExit("the profiler wrote no trace")
  return made[-1]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cells", nargs="+", default=["32x8192x1"], help="BxSxT, 16 heads")
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--splits", nargs="+", type=int, default=[2, 4])
  # A warpgroup's events (4 bytes x 4 a scope, 3 warpgroups): 18 fill the kernel's last 896
  # bytes of shared memory at B = 32, 16 heads, T = 1.
  parser.add_argument("--space", type=int, default=18)
  parser.add_argument("--scopes", nargs="+", default=["merge_wait,merge_read",
                                                      "merge_fetch,merge_math"],
                      help="comma-separated merge_* scopes a run records (with merge and "
                      "merge_counter_wait)")
  parser.add_argument("--out", type=Path, default=Path("/tmp/merge_trace"))
  args = parser.parse_args(argv)
  rows = []
  for cell in args.cells:
    b, s, t = (int(x) for x in cell.split("x"))
    for splits, group in itertools.product(args.splits, args.scopes):
      scopes = {"merge", "merge_counter_wait", *group.split(",")}
      path = traced(b, s, t, args.heads, splits, args.space, scopes,
                    args.out / f"{cell}_{splits}_{group.replace(',', '_')}")
      for wg, times in scope_times(json.loads(path.read_text())).items():
        consumers = len(times.pop("consumers", []))
        for name, values in sorted(times.items()):
          rows.append(dict(cell=cell, splits=splits, consumer=wg, scope=name,
                           count=len(values) / consumers,
                           median_kcycles=float(np.median(values)),
                           per_consumer_kcycles=float(np.sum(values)) / consumers))
  print(f"{'cell':>10} {'splits':>6} {'consumer':>8} {'scope':>20} "
        f"{'n':>5} {'median kcyc':>11} {'kcyc total':>10}")
  for r in rows:
    print(f"{r['cell']:>10} {r['splits']:>6} {r['consumer']:>8} "
          f"{r['scope']:>20} {r['count']:>5.1f} {r['median_kcycles']:>11.3f} "
          f"{r['per_consumer_kcycles']:>10.3f}")
  (args.out / "scopes.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
