"""Triton against Mosaic GPU for head dims the dense grid does not cover (MLA's 192/128, and any
other ``--dims``), forward and forward+backward, on this GPU: the measurement behind
`mosaic.config.FASTER_THAN_TRITON_VALUE_DIM` (and `FASTER_THAN_TRITON` at D = 192), which decide
the backend `implementation=None` takes for such calls on each device kind.

Each case and backend is first checked against a float32 reference (batch row 0, the first and
last query heads, up to 256 query rows: the output, and dQ for forward+backward), then timed
(`cases.time_calls`). Prints one JSON line per cell and a table; ``--out`` writes the rows in
the results files' format (environment, config, rows).

  python benchmarks/dev/value_dim_choice.py --out $OUT/value_dim.json
  python benchmarks/dev/value_dim_choice.py --dims 192/192 128/64 --shapes 4x4096x16
  python benchmarks/dev/value_dim_choice.py --smoke   # CPU: tiny shapes, xla against triton
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import report  # noqa: E402
from cases import time_calls  # noqa: E402

import jaxflash  # noqa: E402

# (B, S, query heads) with K/V heads = query heads: the MLA shape and two shorter ones.
SHAPES = ((1, 8192, 128), (4, 4096, 16), (16, 1024, 16))
SMOKE_SHAPES = ((1, 160, 2),)


def flops(b: int, s: int, n: int, d_qk: int, d_v: int, causal: bool, mode: str) -> float:
  """Visible entries only (model_features.py's convention): 2 (Dqk + Dv) an entry forward,
  2 (3 Dqk + 2 Dv) backward."""
  entries = b * n * (s * (s + 1) // 2 if causal else s * s)
  per_entry = 2.0 * (d_qk + d_v) + (2.0 * (3 * d_qk + 2 * d_v) if mode == "fwdbwd" else 0.0)
  return per_entry * entries


def make_inputs(b: int, s: int, n: int, d_qk: int, d_v: int, seed: int):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, s, n, d_qk), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, s, n, d_qk), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, s, n, d_v), jnp.bfloat16)
  d_out = jax.random.normal(keys[3], (b, s, n, d_v), jnp.float32)
  return q, k, v, d_out


def executable(implementation: str, causal: bool, mode: str, args, interpret: bool):
  def attend(q, k, v):
    return jaxflash.flash_attention(q, k, v, is_causal=causal, implementation=implementation,
                                    interpret=interpret)

  if mode == "fwd":
    run = lambda q, k, v, d_out: attend(q, k, v)  # noqa: E731
  else:
    def run(q, k, v, d_out):
      loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * d_out)  # noqa: E731
      return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  return jax.jit(run).lower(*args).compile()


def relerr(args, result, causal: bool, mode: str, seed: int) -> float:
  """The output (fwd) or dQ (fwdbwd) on batch row 0, heads 0 and N-1 and up to 256 query rows
  (the last 64 and random others) against the float32 reference of those rows."""
  q, k, v, d_out = args
  s, n = q.shape[1], q.shape[2]
  rng = np.random.default_rng(seed)
  rows = np.arange(s) if s <= 256 else np.union1d(
      np.arange(s - 64, s), rng.choice(s - 64, 192, replace=False))
  heads = sorted({0, n - 1})
  sub = lambda x, r: jnp.asarray(np.asarray(x[:1], np.float32)[:, r][:, :, heads])  # noqa: E731
  q_, d_ = sub(q, rows), sub(d_out, rows)
  k_, v_ = sub(k, np.arange(s)), sub(v, np.arange(s))
  mask = (jnp.asarray(rows)[:, None] >= jnp.arange(s)[None, :]) if causal else None

  def out_of(q_):
    return jaxflash.reference_attention(q_, k_, v_, mask=None if mask is None else mask[None, None],
                                        scale=q.shape[-1] ** -0.5)[0]
  with jax.default_matmul_precision("highest"):
    out, vjp = jax.vjp(out_of, q_)
    want = out if mode == "fwd" else vjp(d_)[0]
  got = result if mode == "fwd" else result[0]
  got = np.asarray(np.asarray(got[:1], np.float32)[:, rows][:, :, heads], np.float64)
  want = np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def measure(inputs, impl: str, causal: bool, mode: str, smoke: bool, seed: int, row: dict
            ) -> dict:
  """``row`` with the cell's time, TFLOP/s and error against the reference (or why it failed)."""
  try:
    fn = executable(impl, causal, mode, inputs, interpret=smoke)
    err = relerr(inputs, fn(*inputs), causal, mode, seed)
    ms = time_calls(fn, inputs, calls=2 if smoke else 20, repeats=1 if smoke else 5)[0]
    rate = flops(row["B"], row["S"], row["N"], row["Dqk"], row["Dv"], causal, mode) / ms / 1e9
    return dict(row, ms=round(ms, 4), tflops=round(rate, 1), relerr=err,
                wrong=not err <= report.TOLERANCE)
  except Exception as e:  # noqa: BLE001 (a failed cell says why; the others go on)
    return dict(row, error=f"{type(e).__name__}: {str(e)[:300]}")


def cell_text(row: dict) -> str:
  if "error" in row:
    return "error"
  return f"{row['ms']:.3f} ({row['tflops']:.0f}){' WRONG' if row['wrong'] else ''}"


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, xla and triton")
  parser.add_argument("--impls", nargs="+", default=None)
  parser.add_argument("--dims", nargs="+", default=["192/128"], help="Dqk/Dv pairs")
  parser.add_argument("--shapes", nargs="+", default=None, help="BxSxN, e.g. 4x4096x16")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", type=Path, default=None)
  args = parser.parse_args(argv)
  shapes = (SMOKE_SHAPES if args.smoke else SHAPES) if args.shapes is None else tuple(
      tuple(int(x) for x in text.split("x")) for text in args.shapes)
  dims = [tuple(int(x) for x in text.split("/")) for text in args.dims]
  impls = args.impls or (["xla", "triton"] if args.smoke else ["triton", "mosaic"])
  device = jax.devices()[0].device_kind
  rows = []
  for d_qk, d_v in dims:
    for b, s, n in shapes:
      inputs = make_inputs(b, s, n, d_qk, d_v, args.seed)
      for causal in (True, False):
        for impl in impls:
          for mode in ("fwd", "fwdbwd"):
            rows.append(measure(inputs, impl, causal, mode, args.smoke, args.seed,
                                dict(device=device, B=b, S=s, N=n, Dqk=d_qk, Dv=d_v,
                                     causal=causal, impl=impl, mode=mode)))
            print(json.dumps(rows[-1]), flush=True)
  if args.out:  # (the results files' format: `report.join` joins runs of it)
    config = dict(dims=args.dims, shapes=[list(shape) for shape in shapes], impls=impls)
    result = dict(environment=report.environment(), config=config, rows=rows)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
  print(f"\n{device}: ms (TFLOP/s)")
  print("| Dqk/Dv | B x S x N | causal | mode | " + " | ".join(impls) + " |")
  print("|---|---|---|---|" + "---|" * len(impls))
  cell = {(r["Dqk"], r["Dv"], r["B"], r["S"], r["N"], r["causal"], r["mode"], r["impl"]): r
          for r in rows}
  for d_qk, d_v in dims:
    for b, s, n in shapes:
      for causal in (True, False):
        for mode in ("fwd", "fwdbwd"):
          texts = [cell_text(cell[(d_qk, d_v, b, s, n, causal, mode, impl)]) for impl in impls]
          print(f"| {d_qk}/{d_v} | {b} x {s} x {n} | {causal} | {mode} | " + " | ".join(texts)
                + " |")
  if any(r.get("wrong") or "error" in r for r in rows):
    sys.exit(1)


if __name__ == "__main__":
  main()
