"""Where the Mosaic GPU forward's consumers spend a key block (run on the GPU machine): the
forward compiled with Mosaic GPU's in-kernel profiler on, which records the named scopes of a
consumer's step in `jaxflash/backends/mosaic/forward.py` (``fwd_scores``: issue Q Kᵀ, pass the
turn, wait for S; ``fwd_softmax``: the online softmax, P rounded, O rescaled; ``fwd_turn``: wait
for V and for this consumer's turn; ``fwd_pv``: P V, with the FP8 row sums, until done) per
warpgroup of every CTA, and the trace of one call summarised per scope: the median an
occurrence and the total a consumer, in thousands of cycles (see `decode_trace.py` on the
profiler's clock). With `Config.intra_wg_overlap` a step is ``fwd_turn`` (its K and V and the
turn), ``fwd_block`` (Q Kᵀ issued beside the last block's P V: ``fwd_scores``, then
``fwd_softmax``, then the wait for that P V) and ``fwd_rescale`` (O rescaled, P rounded).

  python3 benchmarks/dev/forward_trace.py --d 128 --s 4096 --heads 16 --fp8
  python3 benchmarks/dev/forward_trace.py --d 128 --s 4096 --heads 16 --causal
  python3 benchmarks/dev/forward_trace.py --d 64 --b 4 --heads 32 --fields '{"block_kv": 256}'

The profiler keeps its events in the shared memory the kernel leaves: ``--space`` bounds the
events a warpgroup records (later ones are dropped), so a run sees each CTA's first blocks.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxflash
from jaxflash.attention import attention_with_config
from jaxflash.backends import mosaic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_trace import profiled_trace, scope_rows  # noqa: E402


def call_args(b: int, s: int, heads: int, d: int, fp8: bool, fields: dict | None = None,
              seed: int = 0, interpret: bool = False):
  """``(args, fn)``: random inputs and the Mosaic GPU call on them (FP8: quantised per head),
  on the tuned tiles or, with ``fields``, on ``mosaic.Config(**fields)``."""
  keys = jax.random.split(jax.random.key(seed), 3)
  q, k, v = (jax.random.normal(key, (b, s, heads, d), jnp.bfloat16) for key in keys)
  config = None if fields is None else mosaic.Config(**fields)

  def attend(q, k, v, causal, **descales):
    return attention_with_config(q, k, v, is_causal=causal, implementation="mosaic",
                                 config=config, interpret=interpret, **descales)
  if not fp8:
    return (q, k, v), attend
  (q8, qd), (k8, kd), (v8, vd) = (jaxflash.quantize_fp8(x) for x in (q, k, v))

  def fn(q8, k8, v8, qd, kd, vd, causal):
    return attend(q8, k8, v8, causal, q_descale=qd, k_descale=kd, v_descale=vd)
  return (q8, k8, v8, qd, kd, vd), fn


def traced(args, fn, causal: bool, space: int, out: Path) -> Path:
  """Runs the call once with the profiler on, checked against the same call without it;
  returns the trace file."""
  return profiled_trace(functools.partial(fn, causal=causal), args, [], space, out,
                        tolerance=2e-2)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--b", type=int, default=1)
  parser.add_argument("--s", type=int, default=4096)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--d", type=int, default=128)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--fp8", action="store_true")
  parser.add_argument("--fields", type=json.loads, default=None,
                      help='mosaic.Config fields as JSON, e.g. \'{"block_kv": 128}\' '
                      "(default: the tuned tiles)")
  parser.add_argument("--space", type=int, default=256)
  parser.add_argument("--out", type=Path, default=Path("/tmp/forward_trace"))
  args = parser.parse_args(argv)
  call, fn = call_args(args.b, args.s, args.heads, args.d, args.fp8, args.fields)
  path = traced(call, fn, args.causal, args.space, args.out)
  rows = scope_rows(json.loads(path.read_text()))
  cell = f"B {args.b}, S {args.s}, {args.heads} heads, D {args.d}" + (
      ", causal" if args.causal else "") + (", FP8" if args.fp8 else ", bf16") + (
      f", {args.fields}" if args.fields else ", tuned tiles")
  print(cell)
  print(f"{'wg':>3} {'scope':>12} {'n':>6} {'median kcyc':>11} {'p90':>7} {'kcyc a thread':>13}")
  for r in rows:
    print(f"{r['warpgroup']:>3} {r['scope']:>12} {r['count']:>6.1f} {r['median_kcycles']:>11.3f} "
          f"{r['p90_kcycles']:>7.3f} {r['total_kcycles']:>13.3f}")
  (args.out / "scopes.json").write_text(json.dumps(dict(cell=cell, rows=rows), indent=1))


if __name__ == "__main__":
  main()
