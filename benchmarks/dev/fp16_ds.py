"""Same-process A/B of the Mosaic backward's float16 dS: scaled before its 16-bit cast (since
2026-12-05: one multiply an entry, and dQ/dK finite with a large loss scale) against scaled on
the float32 sums at the end (before; bfloat16 still does that). Both variants are compiled in
this process and timed alternately, forward+backward, on fresh random inputs; each is checked
against a float32 reference on a slice first.

    PYTHONPATH=. python benchmarks/dev/fp16_ds.py --out /tmp/fp16_ds.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cases  # noqa: E402
from jaxflash.backends.mosaic import backward  # noqa: E402

SCALED_EARLY = (backward._early_scale, backward._late_scale)
# The form before: dS cast unscaled, the scale on the float32 sums for every dtype.
SCALED_LATE = (lambda params, dtype: 1.0, lambda params, dtype: params.scale)


def compiled(case: cases.Case, inputs, variant):
  """The forward+backward executable of ``case`` with the dS scaling ``variant``."""
  backward._early_scale, backward._late_scale = variant
  try:
    jax.clear_caches()
    return cases.compile_mode("jaxflash_mosaic", case, inputs, "fwdbwd", False)
  finally:
    backward._early_scale, backward._late_scale = SCALED_EARLY


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
  parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out")
  args = parser.parse_args(argv)
  rows = []
  for d in args.head_dims:
    for s in args.seqs:
      for causal in (False, True):
        case = cases.Case("fp16", 16384 // s, s, 2048 // d, 2048 // d, d, causal)
        inputs = cases.make_inputs(case, seed=s + d)
        _, want_dq = cases.reference(case, *inputs)
        runs = {}
        for name, variant in (("late", SCALED_LATE), ("early", SCALED_EARLY)):
          fn, fn_args = compiled(case, inputs, variant)
          dq = fn(*fn_args)[0]
          q_slice, _ = cases.check_slices(case)
          runs[name] = dict(fn=fn, args=fn_args, ms=[],
                            relerr_dq=cases.relerr(cases.take(dq, q_slice), want_dq))
        for _ in range(args.rounds):  # alternate, so drift hits both alike
          for run in runs.values():
            run["ms"].append(cases.time_calls(run["fn"], run["args"])[0])
        flops = cases.flops(case.b, case.n, case.s, case.d, causal, "fwdbwd")
        row = dict(case.row(), **{
            f"{name}_tflops": flops / statistics.median(run["ms"]) / 1e9 for name, run in
            runs.items()}, **{f"{name}_relerr_dq": run["relerr_dq"] for name, run in runs.items()})
        row["early_over_late"] = row["early_tflops"] / row["late_tflops"]
        rows.append(row)
        print(f"D={d} S={s} causal={causal}: late {row['late_tflops']:.0f} early "
              f"{row['early_tflops']:.0f} TFLOP/s ({row['early_over_late']:.3f}); dq relerr "
              f"{row['late_relerr_dq']:.4f} / {row['early_relerr_dq']:.4f}", flush=True)
  if args.out:
    env = dict(device=jax.devices()[0].device_kind, jax=jax.__version__)
    Path(args.out).write_text(json.dumps(dict(environment=env, rows=rows), indent=1))
  return rows


if __name__ == "__main__":
  main()
