"""What dropout and a bias gradient cost: jaxflash's backends with each training feature on and off.

Run on the GPU machine from the repo root:

    PYTHONPATH=. python benchmarks/features.py --impls jaxflash_triton jaxflash_mosaic

It writes benchmarks/results/<device>/features.json (<device> from the device kind, e.g. h200;
--out to choose) and a .md table beside it.

Shape: bf16, D = 128, S = 4k, B = 4, N = 16 (16k tokens, hidden 2048), causal and not. Variants:
plain; dropout p = 0.1; a [1, N, S, S] bias that is not differentiated; the same bias with its
gradient; dropout and bias gradient together. For reference, cuDNN (jax.nn) plain and with the
differentiated bias. Every variant is first checked on one batch row against the float32
reference with the same dropout mask (output and every gradient); timing follows bench.py (jit,
warm-up, median of repeats). TFLOP/s counts attention FLOPs only (forward 4*B*N*S^2*D, halved when
causal; forward+backward 3.5x), so a slower variant shows as fewer TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxflash
from jaxflash import dropout
from jaxflash.reference import reference_attention

from cases import flops, time_call
from report import default_out, environment

VARIANTS = {
    "plain": dict(),
    "dropout": dict(dropout=True),
    "bias": dict(bias=True),
    "bias_grad": dict(bias=True, bias_grad=True),
    "dropout_bias_grad": dict(dropout=True, bias=True, bias_grad=True),
}
RATE = 0.1


def attention_fn(impl, causal, use_dropout, rng, interpret=False):
  def fn(q, k, v, bias):
    if impl == "cudnn":
      return jax.nn.dot_product_attention(q, k, v, bias, is_causal=causal,
                                          implementation="cudnn")
    options = dict(dropout_rate=RATE, dropout_rng=rng) if use_dropout else {}
    return jaxflash.flash_attention(q, k, v, bias, is_causal=causal, implementation=impl,
                                    interpret=interpret, **options)
  return fn


def check(fn, q, k, v, bias, d_out, causal, use_dropout, rng, wrt) -> dict:
  """Relative errors on batch row 0 against the float32 reference (same dropout mask)."""
  q, k, v, d_out = (x[:1] for x in (q, k, v, d_out))
  keep = None
  if use_dropout:
    b, t, n, _ = q.shape
    keep = dropout.dense_keep_mask(dropout.seed_words(rng), (b, n, t, k.shape[1]), RATE)

  def ref(q, k, v, bias):
    return reference_attention(q, k, v, bias, is_causal=causal,
                               dropout_rate=1.0 - dropout.keep_probability(RATE),
                               dropout_keep=keep)[0]

  def loss(f):
    return lambda *a: jnp.sum(f(*a).astype(jnp.float32) * d_out)

  upcast = [x.astype(jnp.float32) for x in (q, k, v)]
  bias32 = None if bias is None else bias.astype(jnp.float32)
  with jax.default_matmul_precision("highest"):
    want_out = ref(*upcast, bias32)
    want = jax.grad(loss(ref), argnums=wrt)(*upcast, bias32)
  got_out = jax.jit(fn)(q, k, v, bias)
  got = jax.jit(jax.grad(loss(fn), argnums=wrt))(q, k, v, bias)

  def err(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

  names = ("dq", "dk", "dv", "dbias")
  return {"out": err(got_out, want_out),
          **{names[i]: err(g, w) for i, g, w in zip(wrt, got, want)}}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--batch", type=int, default=None, help="default: 16k tokens / seq")
  parser.add_argument("--heads", type=int, default=None, help="default: 2048 / head dim")
  parser.add_argument("--interpret", action="store_true",
                      help="CPU smoke test: Pallas interpret mode, no cuDNN")
  parser.add_argument("--impls", nargs="+", default=["jaxflash_triton"],
                      choices=("jaxflash_triton", "jaxflash_mosaic"),
                      help="jaxflash backends to time (cuDNN runs next to them on a GPU)")
  parser.add_argument("--out", help="results JSON (default results/<device>/features.json)")
  args = parser.parse_args(argv)
  s, d = args.seq, args.head_dim
  b = args.batch or max(1, 16384 // s)
  n = args.heads or 2048 // d
  keys = jax.random.split(jax.random.key(0), 5)
  q, k, v, d_out = (jax.random.normal(key, (b, s, n, d), jnp.bfloat16) for key in keys[:4])
  bias_full = jax.random.normal(keys[4], (1, n, s, s), jnp.bfloat16)
  rng = jax.random.key(42)
  rows = []
  plan = [(impl, name, spec) for impl in args.impls for name, spec in VARIANTS.items()]
  if not args.interpret:
    plan += [("cudnn", "plain", VARIANTS["plain"]),
             ("cudnn", "bias_grad", VARIANTS["bias_grad"])]
  for causal in (False, True):
    for impl, name, spec in plan:
      print(f"causal={causal} {impl} {name}", file=sys.stderr, flush=True)
      use_dropout = spec.get("dropout", False)
      bias = bias_full if spec.get("bias") else None
      wrt = (0, 1, 2, 3) if spec.get("bias_grad") else (0, 1, 2)
      fn = attention_fn(impl.removeprefix("jaxflash_"), causal, use_dropout, rng,
                        args.interpret)
      row = dict(impl=impl, variant=name, B=b, S=s, N=n, D=d, causal=causal, dtype="bfloat16")
      try:
        row["relerr"] = check(fn, q, k, v, bias, d_out, causal, use_dropout, rng, wrt)
        fwd = jax.jit(lambda q, k, v, bias, d_out: fn(q, k, v, bias))
        # (d_out is an argument, not a closed-over array that XLA would fold in as a constant.)
        fwdbwd = jax.jit(jax.grad(
            lambda q, k, v, bias, d_out: jnp.sum(fn(q, k, v, bias).astype(jnp.float32) * d_out),
            argnums=wrt))
        for mode, f in (("fwd", fwd), ("fwdbwd", fwdbwd)):
          ms = time_call(f, (q, k, v, bias, d_out))
          row[f"{mode}_ms"] = ms
          row[f"{mode}_tflops"] = flops(b, n, s, d, causal, mode) / (ms * 1e-3) / 1e12
      except Exception as e:  # noqa: BLE001 - report and continue
        row["error"] = repr(e)[:300]
      rows.append(row)

  result = dict(environment=environment(), rate=RATE, rows=rows)
  out = Path(args.out) if args.out else default_out(result["environment"], "features")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1) + "\n")
  out.with_suffix(".md").write_text(markdown(rows) + "\n")
  print(markdown(rows))


def markdown(rows) -> str:
  base = {(r["impl"], r["causal"]): r for r in rows if r["variant"] == "plain"}
  lines = ["| impl | variant | causal | fwd ms | fwd TFLOP/s | fwd vs plain | fwd+bwd ms | "
           "fwd+bwd TFLOP/s | fwd+bwd vs plain | max relerr |", "|" + "---|" * 10]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['impl']} | {r['variant']} | {r['causal']} | error: "
                   f"{r['error'][:80]} |" + " |" * 6)
      continue
    p = base.get((r["impl"], r["causal"]))
    lines.append(
        f"| {r['impl']} | {r['variant']} | {'y' if r['causal'] else 'n'} | "
        f"{r['fwd_ms']:.3f} | {r['fwd_tflops']:.0f} | {r['fwd_ms'] / p['fwd_ms']:.2f}x | "
        f"{r['fwdbwd_ms']:.3f} | {r['fwdbwd_tflops']:.0f} | "
        f"{r['fwdbwd_ms'] / p['fwdbwd_ms']:.2f}x | {max(r['relerr'].values()):.1e} |")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
