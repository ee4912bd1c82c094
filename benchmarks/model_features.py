"""What today's models ask of attention: sinks (gpt-oss), a value head dim of its own (MLA), and
score modifications (ALiBi, relative-position tables).

The one command, on the GPU machine from the repo root:

    PYTHONPATH=. python benchmarks/model_features.py

It writes benchmarks/results/<device>/model_features.json (<device> from the device kind, e.g.
h200; --out to choose) and a .md table beside it, and prints the table. The JSON is rewritten
after every row, so a stopped run keeps what it measured. ``--smoke`` runs tiny shapes on a CPU
(the XLA backend, for CI); ``--cases`` picks cases.

Cases (bf16):

- ``gpt_oss``: gpt-oss's attention without sinks, B = 1, S = 16384, 64 query heads over 8 K/V
  heads, D = 64, causal with a window of 128 keys before each query (``local_window_size=(128,
  0)``): jaxflash, cuDNN and cuDNN deterministic (``jax.nn.dot_product_attention``).
- ``gpt_oss_sinks``: the same call with ``sinks=`` [64] (random normal), jaxflash only (jax.nn
  takes no sinks).
- ``mla_192_128``: DeepSeek's MLA training shape, B = 1, S = 8192, 128 heads, query/key head dim
  192 and value head dim 128, causal: jaxflash, cuDNN and cuDNN deterministic (jax.nn asks V
  for the query's head dim, so cuDNN is reached through JAX's private path under it,
  `cudnn_value_dim`; needs cuDNN 9.10 or newer on Hopper).
- ``plain_4k``: B = 4, S = 4096, 16 heads, D = 128, causal (16k tokens, hidden 2048): the rate
  the score_mod cases are compared with. jaxflash and cuDNN.
- ``alibi``: the same call with ALiBi as a ``score_mod`` (``score + slope[h] * (kv - q)``, the
  slopes 2^(-8 (h + 1) / N)); cuDNN gets it as a dense bias [1, N, S, S] (jax.nn takes no
  score_mod), which is how a JAX model passes ALiBi to it.
- ``relative_table``: a learned relative-position bias read from a table [N, 2S - 1] by the
  score_mod (``score + table[h, q - kv + S - 1]``); cuDNN again gets the dense bias.

Modes: ``fwd``, ``fwdbwd`` (jax.grad of sum(out * dO) with respect to q, k, v, and the sinks where
given) and, for the MLA case, ``bwd`` = fwdbwd - fwd. FLOPs count visible entries only (the
window's and the causal band's), ``2 * (Dqk + Dv)`` per entry forward and ``2 * (3 * Dqk + 2 *
Dv)`` backward (for Dqk = Dv = D: 4D and 10D, the 3.5x of the other tables). Every executable is
checked first: the output and dQ of batch row 0, the first and last query heads and 512 query
rows (the last 128 and the rest at random) against float32 `jaxflash.reference_attention`; a
relative error over 2e-2 marks the row ``wrong``. Timing: two warm-ups, then the median of 5
repeats of back-to-back calls (`cases.time_calls`).

Rows: case, impl, mode, ms, tflops, backend (jaxflash's), relerr, wrong, B, S, N, K, Dqk, Dv,
window, sinks, and error when it did not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash

import report
from cases import IMPL_OPTIONS, time_calls
from report import TOLERANCE

CASES = ("gpt_oss", "gpt_oss_sinks", "mla_192_128", "plain_4k", "alibi", "relative_table")
FLOP_CONVENTION = ("visible entries only: fwd 2*(Dqk+Dv) per entry, bwd 2*(3*Dqk+2*Dv), fwdbwd "
                   "their sum")


@dataclasses.dataclass(frozen=True)
class Shape:
  b: int
  s: int  # T = S: self-attention
  n: int
  k: int
  d_qk: int
  d_v: int
  window: int | None  # keys before each query it sees (causal); None: the whole causal band
  sinks: bool = False
  score: str | None = None  # a key of SCORE_MODS


SHAPES = {
    "gpt_oss": Shape(1, 16384, 64, 8, 64, 64, 128),
    "gpt_oss_sinks": Shape(1, 16384, 64, 8, 64, 64, 128, sinks=True),
    "mla_192_128": Shape(1, 8192, 128, 128, 192, 128, None),
    "plain_4k": Shape(4, 4096, 16, 16, 128, 128, None),
    "alibi": Shape(4, 4096, 16, 16, 128, 128, None, score="alibi"),
    "relative_table": Shape(4, 4096, 16, 16, 128, 128, None, score="relative_table"),
}
SMOKE = {name: dataclasses.replace(shape, b=min(shape.b, 2), s=96, n=4,
                                   k=2 if shape.k < shape.n else 4)
         for name, shape in SHAPES.items()}
IMPLS = {"gpt_oss": ("jaxflash", "cudnn", "cudnn_det"), "gpt_oss_sinks": ("jaxflash",),
         "mla_192_128": ("jaxflash", "cudnn", "cudnn_det"), "plain_4k": ("jaxflash", "cudnn"),
         "alibi": ("jaxflash", "cudnn"), "relative_table": ("jaxflash", "cudnn")}


def score_mod(shape: Shape):
  """The case's score_mod (None without one); its arrays are fixed (seed 0), made here."""
  if shape.score is None:
    return None
  if shape.score == "alibi":
    slopes = 2.0 ** (-8.0 * jnp.arange(1, shape.n + 1, dtype=jnp.float32) / shape.n)
    return lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx)
  table = 0.5 * jax.random.normal(jax.random.key(0), (shape.n, 2 * shape.s - 1), jnp.float32)
  return lambda score, b, h, q_idx, kv_idx: score + table[h, q_idx - kv_idx + shape.s - 1]


def dense_bias(shape: Shape):
  """The score_mod's additive term as a dense bf16 bias [1, N, S, S] (what cuDNN is given)."""
  fn = score_mod(shape)
  idx = jnp.arange(shape.s, dtype=jnp.int32)
  make = lambda: fn(jnp.zeros((), jnp.float32), 0, jnp.arange(shape.n)[:, None, None],  # noqa: E731
                    idx[None, :, None], idx[None, None, :])
  return jax.jit(make)().astype(jnp.bfloat16)[None]


def visible_entries(shape: Shape) -> int:
  """Visible (query, key) entries over the batch and heads: the causal band, cut to the window."""
  rows = np.arange(shape.s)
  per_row = rows + 1 if shape.window is None else np.minimum(rows + 1, shape.window + 1)
  return int(per_row.sum()) * shape.b * shape.n


def flops(shape: Shape, mode: str) -> float:
  fwd = 2.0 * (shape.d_qk + shape.d_v)
  bwd = 2.0 * (3 * shape.d_qk + 2 * shape.d_v)
  per_entry = {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[mode]
  return per_entry * visible_entries(shape)


def options(shape: Shape) -> dict:
  window = None if shape.window is None else (shape.window, 0)
  return dict(is_causal=True, local_window_size=window)


def cudnn_value_dim(q, k, v, shape: Shape):
  """cuDNN's causal attention with V's head dim of its own (MLA), through JAX's private cuDNN
  path: jax.nn.dot_product_attention asks V for the query's head dim, but the function under it
  takes ``Dv != Dqk`` on Hopper with cuDNN 9.10 or newer (JAX 0.11.2's check), so the MLA rows
  can have cuDNN beside jaxflash in the same process. The scale is jax.nn's, 1/sqrt(Dqk)."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  if shape.window is not None or shape.score is not None or shape.sinks:
    raise ValueError(f"cuDNN's value-dim path takes a plain causal shape, got {shape}")
  return cudnn.dot_product_attention(q, k, v, scale=shape.d_qk ** -0.5,
                                     mask_type=cudnn.MaskType.CAUSAL)


def attention(impl: str, shape: Shape, implementation):
  """attention(q, k, v, sinks, bias) for ``impl``: jaxflash (with the case's score_mod), or
  jax.nn's cuDNN (no sinks; the score_mod as the dense ``bias``; with ``Dv != Dqk``, the
  private path under it, `cudnn_value_dim`)."""
  mod = score_mod(shape)

  def fn(q, k, v, sinks, bias):
    if impl == "jaxflash":
      return jaxflash.flash_attention(q, k, v, sinks=sinks, score_mod=mod,
                                      implementation=implementation, **options(shape))
    if shape.d_v != shape.d_qk:
      return cudnn_value_dim(q, k, v, shape)
    return jax.nn.dot_product_attention(q, k, v, bias, implementation="cudnn", **options(shape))
  return fn


def inputs(shape: Shape, seed: int):
  keys = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(keys[0], (shape.b, shape.s, shape.n, shape.d_qk), jnp.bfloat16)
  k = jax.random.normal(keys[1], (shape.b, shape.s, shape.k, shape.d_qk), jnp.bfloat16)
  v = jax.random.normal(keys[2], (shape.b, shape.s, shape.k, shape.d_v), jnp.bfloat16)
  d_out = jax.random.normal(keys[3], (shape.b, shape.s, shape.n, shape.d_v), jnp.float32)
  sinks = jax.random.normal(keys[4], (shape.n,), jnp.float32) if shape.sinks else None
  return q, k, v, d_out, sinks


def bias_for(impl: str, shape: Shape):
  """The dense bias cuDNN gets for a score_mod case; None otherwise."""
  return dense_bias(shape) if impl != "jaxflash" and shape.score is not None else None


def executable(fn, mode: str, args, compiler_options):
  """The compiled ``fn`` of ``mode`` on (q, k, v, d_out, sinks, bias): the output, or the
  gradients of q, k, v (and the sinks where given; dq first)."""
  sinks = args[4]
  if mode == "fwd":
    run = lambda q, k, v, d_out, sinks, bias: fn(q, k, v, sinks, bias)  # noqa: E731
  else:
    argnums = (0, 1, 2) + ((3,) if sinks is not None else ())

    def run(q, k, v, d_out, sinks, bias):
      def loss(q, k, v, sinks):
        return jnp.sum(fn(q, k, v, sinks, bias).astype(jnp.float32) * d_out)
      return jax.grad(loss, argnums=argnums)(q, k, v, sinks)
  return jax.jit(run).lower(*args).compile(compiler_options)


def check(shape: Shape, args, result, mode: str, seed: int) -> float:
  """Relative error of the output (fwd) or dQ (fwdbwd) on batch row 0, the first and last query
  heads and up to 512 query rows, against the float32 reference."""
  q, k, v, d_out, sinks = args[:5]
  rng = np.random.default_rng(seed)
  rows = np.arange(shape.s) if shape.s <= 512 else np.union1d(
      np.arange(shape.s - 128, shape.s), rng.choice(shape.s - 128, 384, replace=False))
  heads = sorted({0, shape.n - 1})
  groups = shape.n // shape.k
  kv_heads = [h // groups for h in heads]
  sub = lambda x, r, h: jnp.asarray(np.asarray(x[:1], np.float32)[:, r][:, :, h])  # noqa: E731
  all_rows = np.arange(shape.s)
  q_, d_ = sub(q, rows, heads), sub(d_out, rows, heads)
  k_, v_ = sub(k, all_rows, kv_heads), sub(v, all_rows, kv_heads)
  mask = jnp.asarray(rows)[:, None] >= jnp.arange(shape.s)[None, :]
  if shape.window is not None:
    mask &= jnp.asarray(rows)[:, None] - jnp.arange(shape.s)[None, :] <= shape.window
  s_ = None if sinks is None else jnp.asarray(np.asarray(sinks)[heads])
  mod = score_mod(shape)
  sub_mod = None
  if mod is not None:  # the checked rows and heads at their places in the whole call
    row_at, head_at = jnp.asarray(rows, jnp.int32), jnp.asarray(heads, jnp.int32)
    sub_mod = lambda score, b, h, i, j: mod(score, b, head_at[h], row_at[i], j)  # noqa: E731

  def out_and_dq(q_):
    return jaxflash.reference_attention(q_, k_, v_, mask=mask[None, None],
                                        scale=shape.d_qk ** -0.5, sinks=s_,
                                        score_mod=sub_mod)[0]
  with jax.default_matmul_precision("highest"):
    out, vjp = jax.vjp(out_and_dq, q_)
    want = out if mode == "fwd" else vjp(d_)[0]
  got = result if mode == "fwd" else result[0]
  got = np.asarray(np.asarray(got[:1], np.float32)[:, rows][:, :, heads], np.float64)
  want = np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def run_case(name: str, shape: Shape, impls, implementation, seed: int, out: Path,
             result: dict) -> None:
  base_args = inputs(shape, seed)
  times = {}
  for impl in impls:
    args = base_args + (bias_for(impl, shape),)
    fn = attention(impl, shape, implementation)
    base = dict(case=name, impl=impl, B=shape.b, S=shape.s, N=shape.n, K=shape.k,
                Dqk=shape.d_qk, Dv=shape.d_v, window=shape.window, sinks=shape.sinks)
    if impl == "jaxflash":
      base["backend"] = jaxflash.implementation_for(
          *args[:3], sinks=args[4], score_mod=score_mod(shape), implementation=implementation,
          **options(shape))
    for mode in ("fwd", "fwdbwd"):
      row = dict(base, mode=mode)
      try:
        compiled = executable(fn, mode, args, IMPL_OPTIONS.get(impl))
        err = check(shape, args, compiled(*args), mode, seed)
        ms, _ = time_calls(compiled, args)
        times[(impl, mode)] = ms
        row.update(ms=round(ms, 4), tflops=round(flops(shape, mode) / ms / 1e9, 1),
                   relerr=err, wrong=not err <= TOLERANCE)
      except Exception as e:  # noqa: BLE001 (a row that failed says why and the run goes on)
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      result["rows"].append(row)
      print(json.dumps(row), flush=True)
    if name.startswith("mla") and (impl, "fwd") in times and (impl, "fwdbwd") in times:
      ms = times[(impl, "fwdbwd")] - times[(impl, "fwd")]
      result["rows"].append(dict(base, mode="bwd", ms=round(ms, 4),
                                 tflops=round(flops(shape, "bwd") / ms / 1e9, 1)))
    write(result, out)


def markdown(result: dict) -> str:
  lines = [f"# Model features: {report.describe(result)}", "",
           f"bf16. FLOPs: {FLOP_CONVENTION}.", "",
           "| case | impl | backend | mode | ms | TFLOP/s | relerr |",
           "|---|---|---|---|---|---|---|"]
  cell = lambda r: (r["case"], r["impl"], r.get("backend"), r["mode"])  # noqa: E731
  rows = report.current_rows(result, key=cell)  # (a cell two runs measured: the later)
  # Each case's rows together, whichever run added them: by case, implementation and mode (a
  # stable sort, so a cell's backends keep the order the runs gave them).
  place = lambda order, value: order.index(value) if value in order else len(order)  # noqa: E731
  rows.sort(key=lambda r: (place(CASES, r["case"]),
                           place(("jaxflash", "cudnn", "cudnn_det"), r["impl"]),
                           place(("fwd", "fwdbwd", "bwd"), r["mode"])))
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['case']} | {r['impl']} | {r.get('backend', '')} | {r['mode']} | "
                   f"error: {r['error'][:80]} | | |")
      continue
    err = "" if "relerr" not in r else f"{r['relerr']:.1e}" + (" WRONG" if r["wrong"] else "")
    lines.append(f"| {r['case']} | {r['impl']} | {r.get('backend', '')} | {r['mode']} | "
                 f"{r['ms']:.3f} | {r['tflops']:.0f} | {err} |")
  return "\n".join(lines) + "\n"


def write(result: dict, out: Path) -> None:
  report.write_table(result, out, markdown)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
  parser.add_argument("--implementation", default=None, help="one jaxflash backend")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, XLA backend)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", type=Path, default=None)
  args = parser.parse_args(argv)
  env = report.environment()
  out = args.out or report.default_out(env, "model_features")
  shapes = SMOKE if args.smoke else SHAPES
  implementation = args.implementation or ("xla" if args.smoke else None)
  result = dict(environment=env, flops=FLOP_CONVENTION, rows=[])
  for name in args.cases:
    impls = IMPLS[name] if not args.smoke else ("jaxflash",)
    run_case(name, shapes[name], impls, implementation, args.seed, out, result)
  print(markdown(result))
  if any(r.get("wrong") or "error" in r for r in result["rows"] if r["impl"] == "jaxflash"):
    sys.exit(1)


if __name__ == "__main__":
  main()
