"""The atomic backward on the GPU: its gradients against a float32 reference and against the
deterministic backward at odd shapes, whether each backward repeats its bits, and a same-run
timing of backward variants (`BACKWARDS`) next to cuDNN's default and deterministic backwards.

    PYTHONPATH=. python benchmarks/dev/atomic_check.py --out /tmp/atomic.json

``--smoke`` checks one tiny shape in Mosaic GPU's interpreter on a CPU (CI) and times nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash.attention import attention_with_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cases import grad_fn, mosaic_config, time_call  # noqa: E402
from report import environment  # noqa: E402

# (B, T, S, N, K, H, causal): lengths off the tiles, T != S, GQA, head dims 40/64/96/128.
SHAPES = [(2, 1000, 777, 4, 2, 128, True), (2, 1000, 1000, 8, 8, 64, False),
          (1, 300, 2048, 8, 2, 128, False), (2, 1000, 777, 4, 2, 40, True),
          (2, 513, 513, 4, 4, 96, True), (1, 4096, 4096, 8, 1, 128, True)]
# Head dims above 128 (`--check-shapes wide`): the dV pass, then a dK pass that forms dQ too.
WIDE_SHAPES = [(2, 1000, 777, 4, 2, 256, True), (1, 300, 2048, 4, 4, 200, False),
               (2, 2100, 2100, 8, 8, 256, False)]
SMOKE_SHAPES = [(1, 70, 150, 1, 1, 64, False)]  # (2 key tiles: the atomic adds meet)


# The Mosaic variants timed: Backward fields over the call's default tiles (the atomic ones run
# with deterministic=False).
BACKWARDS = {"deterministic": {}, "atomic": dict(atomic=True, atomic_min_rows=0),
             "atomic_r240": dict(atomic=True, atomic_min_rows=0, atomic_registers=240),
             "ordered_one_pass": dict(one_pass=True),
             # The LSE rows read while the wgmmas run (`Backward.early_rows`).
             "early": dict(early_rows=True),
             "atomic_early": dict(atomic=True, atomic_min_rows=0, early_rows=True),
             # dV's product, then dQ's, then dK's, the dQ part sent while dK's runs
             # (`Backward.dq_before_dk`).
             "atomic_dq_first": dict(atomic=True, atomic_min_rows=0, dq_before_dk=True),
             # Each key tile's full query blocks started at its own place (`Backward.stagger`).
             "atomic_stagger": dict(atomic=True, atomic_min_rows=0, stagger=True),
             # Three stages of query and dO tiles in the one pass.
             "atomic_stages3": dict(atomic=True, atomic_min_rows=0, dkv_stages=3),
             "atomic_dk_first": dict(atomic=True, atomic_min_rows=0, dq_before_dk=False),
             "atomic_r232": dict(atomic=True, atomic_min_rows=0, atomic_registers=232),
             # The one pass on 32-row query tiles, its dQ in transposed parts
             # (`mosaic.config.dq_split`, as D = 256's atomic dK pass).
             "atomic_q32": dict(atomic=True, atomic_min_rows=0, dkv_block_q=32),
             # A causal band's tiles launched by cost across every batch row and head
             # (`Backward.tile_major`), in the two kernels and in the atomic one pass (whose
             # own fields, `atomic_tile_major` and `atomic_group_parts`, win over the shipped
             # ones).
             "tile_major": dict(tile_major=True),
             "atomic_tile_major": dict(atomic=True, atomic_min_rows=0, atomic_tile_major=True,
                                       atomic_group_parts=1),
             # A GQA group's query heads over two or four CTAs per key tile
             # (`Backward.group_parts`), launched head by head (fewer query heads' dQ sums live
             # at once) or tile-major.
             "parts2": dict(group_parts=2, tile_major=False),
             "parts2_tile_major": dict(group_parts=2, tile_major=True),
             "parts4_tile_major": dict(group_parts=4, tile_major=True),
             **{f"atomic_parts{n}{suffix}": dict(atomic=True, atomic_min_rows=0,
                                                 atomic_group_parts=n, atomic_tile_major=major)
                for n in (2, 4) for suffix, major in (("", False), ("_tile_major", True))}}


def inputs(b, t, s, n, k, h, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.float32)
  kk = jax.random.normal(keys[1], (b, s, k, h), jnp.float32)
  v = jax.random.normal(keys[2], (b, s, k, h), jnp.float32)
  do = jax.random.normal(keys[3], (b, t, n, h), jnp.float32)
  return q, kk, v, do


def grads(fn, jit=True):
  """`cases.grad_fn` of ``fn``: (q, k, v, do) -> (dq, dk, dv)."""
  grad = grad_fn(fn)
  # (Mosaic GPU's interpreter runs eagerly: jitted, it could deadlock on 2 cores; see tests.)
  return jax.jit(grad) if jit else grad


def mosaic_fn(causal, deterministic=True, config=None, interpret=False):
  return lambda q, k, v: attention_with_config(q, k, v, is_causal=causal, config=config,
                                               implementation="mosaic",
                                               deterministic=deterministic,
                                               interpret=interpret)


def variant_fn(name, h, causal, q_len, groups=1, interpret=False):
  """The Mosaic backend with `BACKWARDS`'s ``name`` over the call's default tiles for
  ``groups`` query heads per K/V head (the atomic variants with deterministic=False); the
  interpreter takes the H200's tiles."""
  config = mosaic_config(h, causal, q_len, groups=groups, interpret=interpret,
                         backward=BACKWARDS[name])
  return mosaic_fn(causal, not name.startswith("atomic"), config, interpret)


def relerr(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(rows, shapes=SHAPES, interpret=False,
          names=("deterministic", "atomic", "ordered_one_pass")):
  for b, t, s, n, k, h, causal in shapes:
    q, kk, v, do = inputs(b, t, s, n, k, h)
    ref = grads(lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=causal,
                                                        implementation="xla"))
    want = ref(q, kk, v, do)
    bf = [x.astype(jnp.bfloat16) for x in (q, kk, v)]
    # (The one pass runs wherever dq_split has a way for the tiles: D <= 128, and D = 256's
    # atomic dK pass.)
    for name in names:
      g = grads(variant_fn(name, h, causal, t, n // k, interpret), jit=not interpret)
      # (A second call checks the bits repeat: on the GPU; the interpreter runs one order.)
      first = g(*bf, do)
      second = first if interpret else g(*bf, do)
      same = all(bool(jnp.array_equal(x, y)) for x, y in zip(first, second))
      errs = [relerr(x, w) for x, w in zip(first, want)]
      nan = any(bool(jnp.isnan(x).any()) for x in first)
      row = dict(kind="check", variant=name, shape=[b, t, s, n, k, h, causal],
                 relerr=errs, repeats_bits=same, nan=nan, ok=max(errs) < 2e-2 and not nan)
      rows.append(row)
      print(f"check {name:17s} {row['shape']} relerr dq/dk/dv "
            f"{' '.join(f'{e:.1e}' for e in errs)} repeats={same} "
            f"{'OK' if row['ok'] else 'WRONG'}", flush=True)


def timing(rows, cells, names, rounds=1):
  """Forward+backward TFLOP/s of each variant per cell. With ``rounds`` above 1 the variants are
  timed that many times in turn, each round starting one variant later (so that none always
  runs first or last as the card warms), and each gets the median of its rounds: the cells left
  to gain are within a few percent, about what separate timings of one variant vary by."""
  for d, s, causal, n, k in cells:
    b = max(1, 16384 // s) if n == k else 1
    q, kk, v, do = (x.astype(jnp.bfloat16) if i < 3 else x
                    for i, x in enumerate(inputs(b, s, s, n, k, d, seed=1)))
    flops = 3.5 * 4 * b * n * s * s * d * (0.5 if causal else 1.0)
    compiled = {}
    for name in names:
      if name.startswith("cudnn"):
        fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                          implementation="cudnn")
        options = {"xla_gpu_exclude_nondeterministic_ops": True} if name == "cudnn_det" else {}
      else:
        fn, options = variant_fn(name, d, causal, s, n // k), {}
      compiled[name] = grads(fn).lower(q, kk, v, do).compile(options)
    timed = {name: [] for name in names}
    for r in range(rounds):
      for name in names[r % len(names):] + names[:r % len(names)]:
        ms = time_call(compiled[name], (q, kk, v, do), calls=10)
        timed[name].append(flops / ms / 1e9)
    variants = {name: float(np.median(values)) for name, values in timed.items()}
    row = dict(kind="time", D=d, S=s, N=n, K=k, B=b, causal=causal, tflops=variants,
               rounds=timed)
    rows.append(row)
    print(f"time D={d} S={s} {n}/{k} causal={causal}: " + " ".join(
        f"{name} {value:.0f}" for name, value in variants.items())
        + ("" if rounds == 1 else "  (rounds: " + "; ".join(
            f"{name} {' '.join(f'{x:.0f}' for x in values)}" for name, values in timed.items())
            + ")"), flush=True)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="atomic.json")
  parser.add_argument("--no-check", action="store_true")
  parser.add_argument("--smoke", action="store_true",
                      help="one tiny shape in the interpreter (a CPU), no timing")
  parser.add_argument("--cells", default="128:4096:0,128:4096:1,64:4096:0,64:4096:1,"
                      "128:16384:1,128:16384:0:64:8")
  parser.add_argument("--check-shapes", choices=["odd", "wide", "both"], default="odd",
                      help="the odd shapes (head dims up to 128), the wide ones, or both")
  parser.add_argument("--check-variants", nargs="+", choices=list(BACKWARDS),
                      default=["deterministic", "atomic", "ordered_one_pass"],
                      help="the Mosaic variants checked at the odd shapes")
  parser.add_argument("--variants", nargs="+", default=["deterministic", "atomic", "cudnn",
                                                        "cudnn_det"],
                      choices=[*BACKWARDS, "cudnn", "cudnn_det"])
  parser.add_argument("--rounds", type=int, default=1,
                      help="time the variants this many times in turn (each gets the median)")
  args = parser.parse_args(argv)
  rows = []
  if args.smoke:
    check(rows, SMOKE_SHAPES, interpret=True)
    Path(args.out).write_text(json.dumps(dict(environment=environment(), rows=rows), indent=1))
    return rows
  if not args.no_check:
    shapes = {"odd": SHAPES, "wide": WIDE_SHAPES, "both": SHAPES + WIDE_SHAPES}
    check(rows, shapes[args.check_shapes], names=args.check_variants)
  cells = []
  for cell in args.cells.split(","):
    parts = [int(x) for x in cell.split(":")]
    d, s, causal = parts[:3]
    n, k = parts[3:5] if len(parts) > 3 else (2048 // d, 2048 // d)
    cells.append((d, s, bool(causal), n, k))
  timing(rows, cells, args.variants, args.rounds)
  Path(args.out).write_text(json.dumps(dict(environment=environment(), rows=rows), indent=1))
  return rows


if __name__ == "__main__":
  main()
