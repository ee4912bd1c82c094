"""Where the absorbed-MLA decoding kernel's CTAs spend their time (run on the GPU machine): the
kernel compiled with Mosaic GPU's in-kernel profiler on, which records the named scopes of
`jaxflash/backends/mosaic/decode.py` (``decode_*``: a consumer's wait for Q, its loop over the
key blocks and its epilogue; ``merge_*``: the splits' merge of `MlaDecodeConfig.merge_in_kernel`,
which ``--merge`` turns on in the 64-row kernel, the one that merges)
per warpgroup of every CTA, and the trace of one call summarised:

- per warpgroup and scope, the median time an occurrence and in all (over the CTAs that merged
  with ``--merge``, over every CTA without);
- without ``--merge``, the CTAs' spread: when they start (µs after the first) and how long each
  runs, and the span from the first start to the last end.

  python3 benchmarks/dev/decode_trace.py --cells 32x8192x1 --out /tmp/trace
  python3 benchmarks/dev/decode_trace.py --merge --splits 2 4 --out /tmp/trace

Times are thousands of cycles (kcycles): the profiler stamps events with the SM's ``%clock``
after a ``%globaltimer`` start, and writes both as if nanoseconds (`scope_times`); µs below
assume ``--clock-ghz``. The profiler keeps its events in shared memory, which the kernel nearly
fills: ``--space`` (the scopes a warpgroup keeps; later ones are dropped) must stay small, so
a merging run records two of the four per-item ``merge_*`` scopes (``--scopes``), the first
items' only.
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
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxflash.backends.mosaic import decode as mla

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_parts import call, compile_with, random_call_args  # noqa: E402

# Warpgroups a CTA: the 64-row kernel's two consumers and producer; the transposed kernel's
# (`decode_transposed`, 16 heads) one consumer and producer.
WARPGROUPS = 3
TRANSPOSED_WARPGROUPS = 2


def threads_of(trace: dict) -> dict[tuple[int, int], list[dict]]:
  """A Perfetto trace's events per (SM, thread), in time order."""
  by_thread = collections.defaultdict(list)
  for event in trace["traceEvents"]:
    by_thread[(event["pid"], event["tid"])].append(event)
  return {k: sorted(v, key=lambda e: e["ts"]) for k, v in by_thread.items()}


def scope_times(trace: dict, merging_only: bool,
                warpgroups: int = WARPGROUPS) -> dict[int, dict[str, list[float]]]:
  """``{warpgroup: {scope: [kcycles an occurrence]}}`` over a trace's begin/end pairs, each
  thread's events nested, and ``"threads"`` one entry a thread counted; with
  ``merging_only``, the threads that merged (a ``merge`` scope) only. (Mosaic GPU's profiler
  stamps events with the SM's ``%clock`` from a ``%globaltimer`` start and writes them as if
  nanoseconds: a trace's "µs" are thousands of cycles.)"""
  times = collections.defaultdict(lambda: collections.defaultdict(list))
  for (_, tid), events in threads_of(trace).items():
    if merging_only and not any(e["name"] == "merge" for e in events):
      continue
    warpgroup = (tid - 1) % warpgroups  # (tid: 1 + the trace's index)
    open_scopes = []
    for event in events:
      if event["ph"] == "B":
        open_scopes.append(event)
      elif open_scopes:
        begin = open_scopes.pop()
        times[warpgroup][begin["name"]].append(event["ts"] - begin["ts"])
    times[warpgroup]["threads"].append(1.0)
  return times


def cta_spread(trace: dict, clock_ghz: float,
               warpgroups: int = WARPGROUPS) -> dict[str, float]:
  """The CTAs' starts (µs after the first, from ``%globaltimer``), their run times (kcycles,
  first event to last of any of their warpgroups) and the span from the first start to the last
  end (µs, the run times at ``clock_ghz``)."""
  by_cta = collections.defaultdict(list)
  for (sm, tid), events in threads_of(trace).items():
    by_cta[(sm, (tid - 1) // warpgroups)].extend(events)
  starts, runs = [], []
  for events in by_cta.values():
    first = min(e["ts"] for e in events)  # (the first event's ts is its start time exactly)
    starts.append(first)
    runs.append(max(e["ts"] for e in events) - first)
  starts, runs = np.asarray(starts) - min(starts), np.asarray(runs)
  ends = starts + runs / clock_ghz
  return dict(ctas=len(runs), start_p50_us=float(np.median(starts)),
              start_max_us=float(starts.max()), run_min_kcycles=float(runs.min()),
              run_p50_kcycles=float(np.median(runs)), run_max_kcycles=float(runs.max()),
              span_us=float(ends.max()), run_max_us=float(runs.max() / clock_ghz))


def scope_rows(trace: dict, merging_only: bool = False,
               warpgroups: int = WARPGROUPS) -> list[dict]:
  """`scope_times` as rows, per warpgroup and scope: occurrences a thread (``count``), the
  median and 90th percentile of one, and the total a thread (kcycles)."""
  rows = []
  for wg, times in sorted(scope_times(trace, merging_only, warpgroups).items()):
    threads = len(times.pop("threads", []))
    for name, values in sorted(times.items()):
      rows.append(dict(warpgroup=wg, scope=name, count=len(values) / threads,
                       median_kcycles=float(np.median(values)),
                       p90_kcycles=float(np.percentile(values, 90)),
                       total_kcycles=float(np.sum(values)) / threads))
  return rows


def only_scopes(names):
  """`jax.named_scope` that opens the ``merge*`` scopes in ``names`` (and every other scope) and
  skips the other ``merge*`` ones: the profiler's room holds few events."""
  named_scope = jax.named_scope

  def scope(name):
    if name.startswith("merge") and name not in names:
      return contextlib.nullcontext()
    return named_scope(name)

  return scope


def traced(b: int, s: int, t: int, heads: int, splits: int | None, merge: bool, space: int,
           scopes, out: Path, fields: dict | None = None) -> tuple[Path, int]:
  """Runs the kernel once with the profiler on (the ``merge*`` scopes in ``scopes`` recorded;
  ``splits`` None: the shipped count; ``fields``: other `MlaDecodeConfig` fields; ``merge``:
  the 64-row kernel merging its splits), checked against the shipped call; returns the trace
  file and the warpgroups a CTA of the kernel that ran."""
  args = random_call_args(b, s, t, heads)
  shipped, runs_transposed = mla.default_config, mla.runs_transposed
  ran_transposed = []

  def config(*a, **kw):
    made = shipped(*a, **kw)
    merging = dict(merge_in_kernel=True, transposed=False) if merge else {}
    return dataclasses.replace(made, splits=splits or made.splits,
                               **{**merging, **(fields or {})})

  def spy(*a):  # (which kernel ran: the trace's thread ids count its warpgroups)
    ran_transposed.append(runs_transposed(*a))
    return ran_transposed[-1]

  path = profiled_trace(call, args, [(mla, "default_config", config),
                                     (mla, "runs_transposed", spy),
                                     (jax, "named_scope", only_scopes(scopes))], space, out,
                        tolerance=1e-2)
  return path, TRANSPOSED_WARPGROUPS if any(ran_transposed) else WARPGROUPS


def profiled_trace(fn, args, patches, space: int, out: Path, tolerance: float) -> Path:
  """``fn(*args)`` compiled with ``patches`` and Mosaic GPU's in-kernel profiler on (``space``
  events a warpgroup, written under ``out``), checked against the call without either; the
  trace file it wrote."""
  out.mkdir(parents=True, exist_ok=True)
  before = set(out.glob("*-trace.json"))
  params = functools.partial(plgpu.CompilerParams, profile_space=space, profile_dir=str(out),
                             profile_bounds_check=True)
  want = np.asarray(compile_with(fn, args)(*args), np.float32)
  profiled = compile_with(fn, args, [*patches, (plgpu, "CompilerParams", params)])
  got = np.asarray(profiled(*args), np.float32)
  jax.effects_barrier()
  if not np.allclose(got, want, atol=tolerance, rtol=tolerance):
    raise SystemExit(f"the profiled kernel differs from the call: {np.abs(got - want).max()}")
  made = sorted(set(out.glob("*-trace.json")) - before)
  if not made:
    raise SystemExit("the profiler wrote no trace")
  return made[-1]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cells", nargs="+", default=["32x8192x1"], help="BxSxT")
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--merge", action="store_true",
                      help="the splits merged in the kernel, its merging CTAs summarised")
  parser.add_argument("--splits", nargs="+", type=int, default=[0],
                      help="splits a group (0: the shipped count)")
  # A warpgroup's events (4 bytes x 4 a scope, 3 warpgroups): 18 fill the kernel's last 896
  # bytes of shared memory at B = 32, 16 heads, T = 1.
  parser.add_argument("--space", type=int, default=18)
  parser.add_argument("--scopes", nargs="+", default=None,
                      help="comma-separated merge_* scopes a run records (with merge and "
                      "merge_counter_wait); default: the four, two a run")
  # (The SMs' clock under this kernel: its longest CTA, 132 kcycles at B = 32, 8k, matched the
  # kernel's 77 µs in a profile of the same day, 2026-11-29; the boost clock is 1.98 GHz.)
  parser.add_argument("--clock-ghz", type=float, default=1.72)
  parser.add_argument("--fields", type=json.loads, default={}, metavar="JSON",
                      help='other MlaDecodeConfig fields, e.g. \'{"transposed": false}\'')
  parser.add_argument("--out", type=Path, default=Path("/tmp/decode_trace"))
  args = parser.parse_args(argv)
  groups = args.scopes or (["merge_wait,merge_read", "merge_fetch,merge_math"] if args.merge
                           else [""])
  rows = []
  for cell in args.cells:
    b, s, t = (int(x) for x in cell.split("x"))
    for splits, group in itertools.product(args.splits, groups):
      scopes = {"merge", "merge_counter_wait", *group.split(",")}
      path, warpgroups = traced(
          b, s, t, args.heads, splits or None, args.merge, args.space, scopes,
          args.out / f"{cell}_{splits}_{group.replace(',', '_') or 'stages'}", args.fields)
      trace = json.loads(path.read_text())
      head = dict(cell=cell, splits=splits, scopes=group)
      if not args.merge:
        spread = cta_spread(trace, args.clock_ghz, warpgroups)
        rows.append(dict(head, **spread))
        print(f"{cell} splits {splits or 'shipped'}: " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in spread.items()),
            flush=True)
      rows += [dict(head, **r) for r in scope_rows(trace, args.merge, warpgroups)]
  print(f"{'cell':>10} {'splits':>6} {'wg':>3} {'scope':>20} {'n':>5} {'median kcyc':>11} "
        f"{'kcyc a thread':>13}")
  for r in rows:
    if "scope" in r:
      print(f"{r['cell']:>10} {r['splits']:>6} {r['warpgroup']:>3} {r['scope']:>20} "
            f"{r['count']:>5.1f} {r['median_kcycles']:>11.3f} {r['total_kcycles']:>13.3f}")
  (args.out / "scopes.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
