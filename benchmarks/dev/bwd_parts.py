"""Where the Mosaic backend's forward+backward time goes: the forward, the dK/dV kernel (or its
dV and dK passes above head dim 128), the dQ kernel and the glue between them (delta, the
LSE's padding), each timed alone on the same inputs, next to cuDNN's forward and
forward+backward.

Each kernel's rate is quoted in the matmul work it really does, in units of one T x S x D
product (2·B·N·T·S·D FLOPs, halved with a causal band): the forward 2 (S, P V), dK/dV 4 (Sᵀ,
dPᵀ, dV, dK), the dV pass 2, the dK pass 3, dQ 3 (S, dP, dQ). cuDNN's backward does 5 in all
(it adds dQ up with atomics), jaxflash's deterministic two kernels 7. The forward+backward rows
use the grid's convention instead (3.5x the forward's FLOPs, `cases.flops`), as in bench.py.

``--profile`` also traces the whole forward+backward of jaxflash and of cuDNN with
`jax.profiler` and lists the GPU time of every kernel per step (XLA's fusions included), which
shows what the parts above leave out.

``--variants`` also times each kernel with other `mosaic.Backward` tiles (`VARIANTS`), one
kernel at a time, which compiles in seconds where the tuner compiles whole training steps; a
variant's ``"module.NAME"`` keys set constants of `jaxflash.backends.mosaic.backward` while it
traces (A/B tests of code paths). The kernels are timed in interleaved rounds (``--rounds``).
Before timing, the backward's gradients of batch row 0 and head 0 are checked against a float32
reference. ``--smoke`` runs a tiny grid in Mosaic GPU's interpreter on a CPU (CI), where the
times mean nothing.

    python benchmarks/dev/bwd_parts.py --head-dims 64 128 256 --seqs 4096 16384 --out parts.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import _checks, _core, devices
from jaxflash.backends import mosaic
from jaxflash.backends.mosaic import backward as mosaic_backward
from jaxflash.backends.mosaic import forward as mosaic_forward

# The user benchmarks' helpers live one folder up (scripts, not a package).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cases  # noqa: E402
from cases import (Case, attention_fn, causal_modes, flops, grad_fn, make_inputs,  # noqa: E402
                   relerr, time_call)
from report import environment  # noqa: E402

# Work of each part in units of one T x S x D matmul (see the module docstring).
UNITS = {"fwd": 2, "dkv": 4, "dv": 2, "dk": 3, "dq": 3}
# Other backward tiles that --variants times kernel by kernel (fields of `mosaic.Backward` over
# the shipped ones of the head dim; those that do not fit in shared memory are skipped).
VARIANTS = [dict(registers=240), dict(registers=232), dict(dkv_stages=3), dict(dq_stages=3),
            dict(dq_block_kv=128), dict(dkv_block_q=128), dict(dq_block_kv=32),
            dict(dkv_block_q=32), dict(registers=240, dkv_stages=3)]


def _check(q, k, v, d_out, causal: bool, grads) -> float:
  """The largest relative error of (dq, dk, dv) over batch row 0 and K/V head 0 (with the query
  heads of its group: they all add to its dK and dV), against float32."""
  group = q.shape[2] // k.shape[2]
  one = lambda x, heads=1: x[:1, :, :heads].astype(jnp.float32)  # noqa: E731
  q_side = lambda x: one(x, group)  # noqa: E731

  def reference(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

  with jax.default_matmul_precision("highest"):
    _, vjp = jax.vjp(reference, q_side(q), one(k), one(v))
    want = vjp(q_side(d_out))
  return max(relerr(cut(g), np.asarray(w, np.float64))
             for g, w, cut in zip(grads, want, (q_side, one, one)))


def _kernels(backward: mosaic.Backward, hp: int) -> list[str]:
  """The backward's kernels at padded head dim ``hp``, as keys of `UNITS`."""
  dkv = ["dv", "dk"] if hp > mosaic.config.SPLIT_HEAD_DIM else ["dkv"]
  return dkv + ["dq"]


def _kernel_fn(name: str, inputs, params, config):
  """``(lse2, d_out, delta) -> outputs`` of one backward kernel, jitted."""
  grads = {"dkv": ("dk", "dv"), "dv": ("dv",), "dk": ("dk",)}

  def run(lse2, d_out, delta):
    args = mosaic_backward.kernel_args(inputs, params, config, lse2, d_out, delta)
    if name == "dq":
      return mosaic_backward._dq(*args)
    return mosaic_backward._dkv(*args, grads=grads[name])

  return jax.jit(run)


def _setup(case: Case, interpret: bool):
  """``(q, k, v, d_out, inputs, params, config, fwd)`` of a cell: random inputs, the call as
  the backends see it, the default Mosaic config, and its forward (jitted, on ``inputs``)."""
  q, k, v, d_out = make_inputs(case, 0)
  call = _checks.normalise(q, k, v, is_causal=case.causal, interpret=interpret)
  inputs, params = call.inputs, call.params
  config = mosaic.default_config(case.d, q.dtype, case.causal, case.s, devices.current().kind)
  fwd = jax.jit(lambda inputs: mosaic_forward.forward(inputs, params, config))
  return q, k, v, d_out, inputs, params, config, fwd


def _residuals(fwd, inputs, d_out):
  """``(out, lse2, delta)``: the forward's output and what the backward kernels read."""
  out, lse2 = fwd(inputs)
  return out, lse2, jax.jit(_core.delta)(out, d_out, jnp.zeros_like(lse2))


def launch_once(case: Case) -> None:
  """The forward and each backward kernel of ``case``, launched once each and untimed: the
  program ``--ncu`` runs under NVIDIA Nsight Compute (``ncu -k regex:mosaic --launch-skip 1``
  then profiles the backward's kernels alone)."""
  _, _, _, d_out, inputs, params, config, fwd = _setup(case, interpret=False)
  _, lse2, delta = _residuals(fwd, inputs, d_out)
  for name in _kernels(config.backward, mosaic.config.padded_head_dim(case.d)):
    jax.block_until_ready(_kernel_fn(name, inputs, params, config)(lse2, d_out, delta))


def measure_cell(case: Case, cfg: dict) -> list[dict]:
  """The rows of one (D, S, causal) cell: the check, then every part and cuDNN, timed."""
  interpret = cfg["interpret"]
  q, k, v, d_out, inputs, params, config, fwd = _setup(case, interpret)
  hp = mosaic.config.padded_head_dim(case.d)
  unit = 2.0 * case.b * case.n * case.s * case.s * case.d * (0.5 if case.causal else 1.0)
  timing = dict(calls=cfg["calls"], repeats=cfg["repeats"])
  rows = []

  def add(part, ms, tflops, variant=None):
    rows.append(dict(case.row(), part=part, variant=variant, ms=ms, tflops=tflops))
    label = f"{part}{'' if variant is None else ' ' + json.dumps(variant)}"
    print(f"{case.label()} {label}: {ms:.3f} ms" + ("" if tflops is None else
                                                     f", {tflops:.0f} TFLOP/s"),
          file=sys.stderr, flush=True)

  mosaic_fn = attention_fn("jaxflash_mosaic", case.causal, interpret=interpret, config=config)
  fwdbwd = jax.jit(grad_fn(mosaic_fn))
  err = _check(q, k, v, d_out, case.causal, fwdbwd(q, k, v, d_out))
  rows.append(dict(case.row(), part="check", rel_err=err))
  print(f"{case.label()} gradients vs float32, batch row 0, head 0: {err:.2e}", file=sys.stderr)
  if err > 2e-2:
    raise AssertionError(f"{case.label()}: gradient error {err:.2e}")

  out, lse2, delta = _residuals(fwd, inputs, d_out)
  ms = time_call(fwd, (inputs,), **timing)
  add("fwd", ms, UNITS["fwd"] * unit / (ms * 1e-3) / 1e12)

  def glue(out, lse2, d_out, dlse):  # (the LSE and delta rows: padded Q, K, V and dO, when
    # they need padding, are not counted, as returning them unpadded would time their copies)
    args = mosaic_backward.kernel_args(inputs, params, config, lse2, d_out,
                                       _core.delta(out, d_out, dlse))
    return args[4], args[5]

  add("glue", time_call(jax.jit(glue), (out, lse2, d_out, jnp.zeros_like(lse2)), **timing),
      None)
  # Every kernel of the shipped tiles and of each variant is compiled first, then timed in
  # interleaved rounds (the median of each over the rounds), so that a drift of the card's
  # clocks during the run does not favour whichever ran first.
  compiled = []
  variants = [None] + (cfg["variants"] or []) if cfg["parts"] else []
  for variant in variants:
    backward, patches = config.backward, {}
    if variant is not None:
      patches = {name.removeprefix("module."): value for name, value in variant.items()
                 if name.startswith("module.")}
      fields = {name: value for name, value in variant.items()
                if not name.startswith("module.") and getattr(backward, name) != value}
      if not fields and not patches:
        continue  # (the shipped tiles already)
      backward = dataclasses.replace(backward, **fields)
      if mosaic.config.backward_smem_bytes(backward, case.d) > mosaic.config.SMEM_BUDGET:
        continue
    run_config = dataclasses.replace(config, backward=backward)
    for name in _kernels(backward, hp):
      if variant is not None and not _touches(name, variant):
        continue
      try:
        fn = _compile(_kernel_fn(name, inputs, params, run_config), (lse2, d_out, delta),
                      patches)
      except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result
        print(f"{case.label()} {name} {variant}: failed {repr(e)[:200]}", file=sys.stderr)
        continue
      compiled.append((name, variant, fn))
  times = {index: [] for index in range(len(compiled))}
  for _ in range(cfg["rounds"]):
    for index, (_, _, fn) in enumerate(compiled):
      times[index].append(time_call(fn, (lse2, d_out, delta), calls=cfg["calls"], repeats=1))
  for index, (name, variant, _) in enumerate(compiled):
    ms = statistics.median(times[index])
    add(name, ms, UNITS[name] * unit / (ms * 1e-3) / 1e12, variant)

  ms = time_call(fwdbwd, (q, k, v, d_out), **timing)
  add("fwdbwd", ms, flops(case.b, case.n, case.s, case.d, case.causal, "fwdbwd") / (ms * 1e-3)
      / 1e12)
  cudnn = attention_fn("cudnn", case.causal)
  if cfg["profile"]:
    impls = [("jaxflash", fwdbwd)] + ([("cudnn", jax.jit(grad_fn(cudnn)))] if cfg["cudnn"]
                                      else [])
    for impl, fn in impls:
      kernels, idle = profile_kernels(fn, (q, k, v, d_out))
      rows.append(dict(case.row(), part=f"profile_{impl}", kernels=kernels, idle=idle))
      print(f"{case.label()} {impl} forward+backward kernels, us per step "
            f"({sum(k['us'] for k in kernels):.0f} in all; the GPU's span "
            f"{idle['span_us']:.0f}, idle {idle['idle_us']:.0f}):", file=sys.stderr)
      for kernel in kernels[:12]:
        print(f"  {kernel['us']:9.1f} x{kernel['count']:g} {kernel['name'][:100]}",
              file=sys.stderr)
      for where, us in sorted(idle["gaps"].items(), key=lambda g: -g[1])[:6]:
        print(f"  idle {us:7.1f} us per step: {where}", file=sys.stderr)
  if cfg["cudnn"]:
    ms = time_call(jax.jit(cudnn), (q, k, v), **timing)
    add("cudnn_fwd", ms, flops(case.b, case.n, case.s, case.d, case.causal, "fwd")
        / (ms * 1e-3) / 1e12)
    ms = time_call(jax.jit(grad_fn(cudnn)), (q, k, v, d_out), **timing)
    add("cudnn_fwdbwd", ms, flops(case.b, case.n, case.s, case.d, case.causal, "fwdbwd")
        / (ms * 1e-3) / 1e12)
  return rows


def profile_kernels(fn, args, calls: int = 5) -> tuple[list[dict], dict]:
  """GPU kernels of one call of a compiled ``fn`` from a `jax.profiler` trace of ``calls``
  back-to-back calls: ``{"name", "us", "count"}`` per kernel name (microseconds and launches per
  call), longest first, and the idle time: ``{"span_us", "idle_us", "gaps"}`` per call, the
  GPU's time from the first kernel's start to the last one's end, the part of it no kernel ran,
  and where (``"previous -> next"`` kernel: microseconds per call). Empty without a GPU."""
  events = [e for plane in cases.gpu_events(fn, args, calls).values() for e in plane]
  kernels = cases.kernel_totals(events, calls, width=1000)
  events = [(start, end, name[:40]) for start, end, name in events]
  idle = dict(span_us=0.0, idle_us=0.0, gaps={})
  if events:
    events.sort()
    idle["span_us"] = (max(e[1] for e in events) - events[0][0]) / 1e3 / calls
    busy_until, previous = events[0][1], events[0][2]
    for start, end, name in events[1:]:
      if start > busy_until:
        gap = (start - busy_until) / 1e3 / calls
        idle["idle_us"] += gap
        where = f"{previous} -> {name}"
        idle["gaps"][where] = idle["gaps"].get(where, 0.0) + gap
      if end > busy_until:
        busy_until, previous = end, name
  return kernels, idle


def _touches(kernel: str, variant: dict) -> bool:
  """Whether ``variant``'s fields change ``kernel`` (registers and module patches change all of
  them)."""
  prefix = {"dkv": ("dkv_",), "dk": ("dkv_",), "dv": ("dkv_", "dv_"), "dq": ("dq_",)}[kernel]
  return any(name == "registers" or name.startswith(prefix + ("module.",)) for name in variant)


def _compile(fn, args, patches: dict):
  """``fn`` (jitted) compiled for ``args`` with the `backward` module's attributes set to
  ``patches`` while it traces (experiments with module constants such as ``_WALK_DOWN``)."""
  saved = {name: getattr(mosaic_backward, name) for name in patches}
  try:
    for name, value in patches.items():
      setattr(mosaic_backward, name, value)
    return fn.lower(*args).compile()
  finally:
    for name, value in saved.items():
      setattr(mosaic_backward, name, value)


def table(rows: list[dict]) -> str:
  """Markdown: one line per cell, ms and TFLOP/s of each part with the shipped tiles."""
  parts = ["fwd", "dkv", "dv", "dk", "dq", "glue", "fwdbwd", "cudnn_fwd", "cudnn_fwdbwd"]
  cells = sorted({(r["D"], r["S"], r["causal"]) for r in rows})
  present = [p for p in parts if any(r["part"] == p for r in rows)]
  lines = ["| D | S | causal | " + " | ".join(present) + " | fwdbwd vs cuDNN |",
           "|" + "---|" * (len(present) + 4)]
  for d, s, causal in cells:
    got = {r["part"]: r for r in rows if (r["D"], r["S"], r["causal"]) == (d, s, causal)
           and r.get("variant") is None and "ms" in r}
    cols = []
    for p in present:
      r = got.get(p)
      cols.append("" if r is None else f"{r['ms']:.3f} ms" if r["tflops"] is None
                  else f"{r['ms']:.3f} ms, {r['tflops']:.0f}")
    ratio = ""
    if "fwdbwd" in got and "cudnn_fwdbwd" in got:
      ratio = f"{got['cudnn_fwdbwd']['ms'] / got['fwdbwd']['ms']:.3f}"
    lines.append(f"| {d} | {s} | {'y' if causal else 'n'} | " + " | ".join(cols) + f" | {ratio} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
  parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
  parser.add_argument("--causal", choices=("both", "y", "n"), default="both")
  parser.add_argument("--tokens", type=int, default=16384, help="B = tokens / S")
  parser.add_argument("--hidden", type=int, default=2048, help="N = hidden / D")
  parser.add_argument("--kv-heads", type=int, help="K/V heads (GQA); default: N (MHA)")
  parser.add_argument("--variants", nargs="*", metavar="FIELD",
                      help="also time `VARIANTS` (those setting these Backward fields, if named)")
  parser.add_argument("--profile", action="store_true",
                      help="also list the GPU kernels of a whole step (`profile_kernels`)")
  parser.add_argument("--rounds", type=int, default=5,
                      help="interleaved timing rounds of the kernels (the median is kept)")
  parser.add_argument("--launch-once", action="store_true",
                      help="launch each kernel of each cell once, untimed (for ncu)")
  parser.add_argument("--no-parts", dest="parts", action="store_false",
                      help="skip the kernels' own timings (the check and the steps remain)")
  parser.add_argument("--smoke", action="store_true",
                      help="a tiny grid in the interpreter on a CPU (the times mean nothing)")
  parser.add_argument("--out", help="results JSON; the .md table goes beside it")
  args = parser.parse_args(argv)
  variants = None
  if args.variants is not None:
    variants = [v for v in VARIANTS if not args.variants or set(v) & set(args.variants)]
  cfg = dict(interpret=args.smoke, variants=variants,
             profile=args.profile, parts=args.parts, rounds=1 if args.smoke else args.rounds,
             cudnn=not args.smoke, calls=2 if args.smoke else 10, repeats=1 if args.smoke else 5)
  if args.smoke:
    args.head_dims, args.seqs, args.tokens, args.hidden = [64], [128], 128, 128
    cfg["variants"] = [dict(dq_stages=1), {"module._WALK_DOWN": False}] if variants else None
  rows = []
  for s in args.seqs:
    for d in args.head_dims:
      for causal in causal_modes(dict(causal=args.causal)):
        b, n = max(1, args.tokens // s), max(1, args.hidden // d)
        case = Case("bf16", b, s, n, args.kv_heads or n, d, causal)
        if args.launch_once:
          launch_once(case)
          continue
        rows += measure_cell(case, cfg)
  result = dict(environment=environment(), config=dict(vars(args), units=UNITS), rows=rows)
  md = table(rows)
  if args.out:
    Path(args.out).write_text(json.dumps(result, indent=1))
    Path(args.out).with_suffix(".md").write_text(md + "\n")
  print(md)
  return result


if __name__ == "__main__":
  main()
