"""The SM clock and board power while a forward or a training step runs in a loop (GPU only).

A kernel near the card's power cap runs at a lower clock, so two kernels can differ in speed
without differing in cycles: this runs each named FP8 config (``benchmarks/fp8.py``'s
``CONFIGS``, or the tuned tiles for ``tuned``) for a few seconds, in turn, with
``nvidia-smi`` sampling the clock and the power meanwhile, and prints per config the time a
call, TFLOP/s, the median clock and power, why the clock is below its top (nvidia-smi's
clock event reasons, with the share of samples each was active in) and TFLOP/s per GHz (which
compares the cycles on one card: an H100 and an H200 differ by 8-10% in it with the same
kernels, unexplained; docs/benchmarks.md, forty-fourth session).

    python3 benchmarks/dev/clocks.py --configs tuned kv256_sums --rounds 2

``--impls`` runs bf16 calls of `benchmarks/cases.py`'s implementations instead (``--mode
fwdbwd``: a training step's forward and backward; ``--kv-heads`` for GQA), so that jaxflash and
cuDNN can be compared in clock and power at the same shape:

    python3 benchmarks/dev/clocks.py --impls jaxflash_mosaic_atomic cudnn --mode fwdbwd --rounds 2

``--dv`` gives V a head dim of its own: `benchmarks/model_features.py`'s causal calls and FLOPs
(``--impls`` among jaxflash, cudnn and cudnn_det, ``--causal`` only; cuDNN through JAX's
private path, `model_features.cudnn_value_dim`), e.g. MLA's 192/128 at that table's shape:

    python3 benchmarks/dev/clocks.py --impls jaxflash cudnn --d 192 --dv 128 --s 8192 \
        --heads 128 --causal --mode fwdbwd --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

import fp8  # noqa: E402  (benchmarks/fp8.py)
import model_features  # noqa: E402  (benchmarks/model_features.py)
from cases import IMPL_OPTIONS, Case, attention_fn, flops, grad_fn, make_inputs  # noqa: E402
from jaxflash.backends import mosaic  # noqa: E402


# nvidia-smi's fields a sample reads; the last is a bit mask of why the clock is below its top
# (`clocks_event_reasons.active`). Under "hw_slowdown" or "hw_power_brake" the card may also
# skip clock pulses, and the reported clock then overstate the one the kernels run at.
SMI_FIELDS = "clocks.sm,power.draw,clocks_event_reasons.active"
CLOCK_EVENTS = {0x1: "idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal",
                0x80: "hw_power_brake", 0x100: "display_clocks"}


def summary(lines: list[str]) -> dict:
  """nvidia-smi's CSV lines (``SMI_FIELDS``, no header or units) as the median clock (MHz) and
  power (W) of the samples after the first quarter (the clock settling), and each clock event
  reason with the share of those samples it was active in."""
  samples = [[f.strip() for f in line.split(",")] for line in lines if line.count(",") == 2]
  samples = samples[len(samples) // 4:]
  if not samples:
    return dict(mhz=None, watts=None, events={})
  masks = [int(mask, 16) if mask.startswith("0x") else 0 for _, _, mask in samples]
  shares = {name: sum(bool(m & bit) for m in masks) / len(masks)
            for bit, name in CLOCK_EVENTS.items()}
  events = {name: share for name, share in shares.items() if share}
  return dict(mhz=statistics.median(float(c) for c, _, _ in samples),
              watts=statistics.median(float(w) for _, w, _ in samples), events=events)


def sampled(fn, args, seconds: float) -> dict:
  """Calls ``fn(*args)`` back to back for about ``seconds`` while nvidia-smi samples every
  100 ms; returns the calls' mean time with the samples' `summary`."""
  jax.block_until_ready(fn(*args))
  smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}",
                          "--format=csv,noheader,nounits", "-lms", "100"],
                         stdout=subprocess.PIPE, text=True)
  calls, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    for _ in range(10):
      out = fn(*args)
    jax.block_until_ready(out)
    calls += 10
  elapsed = time.perf_counter() - start
  smi.terminate()
  return dict(ms=1e3 * elapsed / calls, **summary(smi.communicate()[0].splitlines()))


def _fp8_calls(args) -> tuple[dict, float]:
  """``({name: (jitted call, inputs)}, FLOPs a call)`` of the named FP8 configs."""
  shape = fp8.Shape(1, args.s, args.heads, args.d, args.causal)
  calls = {}
  for name in args.configs:
    config = None if name == "tuned" else mosaic.Config(**fp8.CONFIGS[name])
    fn, inputs = fp8.speed_fn("jaxflash_fp8", shape, "mosaic", config)
    calls[name] = (jax.jit(fn), inputs)
  return calls, flops(shape.b, shape.n, shape.s, shape.d, shape.causal, "fwd")


def _step_calls(args) -> tuple[dict, float]:
  """The same for bf16 calls of ``args.impls`` (a forward, or a training step's forward and
  backward with ``--mode fwdbwd``), on one set of random inputs."""
  case = Case("bf16", args.b, args.s, args.heads, args.kv_heads or args.heads, args.d,
              args.causal)
  inputs = make_inputs(case, 0)  # q, k, v and the output's cotangent
  calls = {}
  for name in args.impls:
    fn = attention_fn(name, args.causal)
    fn, call_args = (grad_fn(fn), inputs) if args.mode == "fwdbwd" else (fn, inputs[:3])
    # compiled with the implementation's options: cudnn_det's deterministic backward
    calls[name] = (jax.jit(fn).lower(*call_args).compile(IMPL_OPTIONS.get(name)), call_args)
  return calls, flops(case.b, case.n, case.s, case.d, case.causal, args.mode)


def _value_dim_calls(args) -> tuple[dict, float]:
  """The same for calls with V's head dim ``args.dv``: `benchmarks/model_features.py`'s jaxflash
  and cuDNN calls (``cudnn``, ``cudnn_det``), inputs and FLOPs at this shape (its shapes are
  causal)."""
  known = {"jaxflash", "cudnn", "cudnn_det"}
  if not set(args.impls) <= known or not args.causal:
    raise ValueError(f"--dv runs --impls among {sorted(known)} with --causal only, got "
                     f"{args.impls}, causal={args.causal}")
  shape = model_features.Shape(args.b, args.s, args.heads, args.kv_heads or args.heads, args.d,
                               args.dv, window=None)
  inputs = model_features.inputs(shape, 0) + (None,)  # q, k, v, d_out, sinks, bias
  calls = {}
  for name in args.impls:
    fn = model_features.attention(name, shape, None)
    calls[name] = (model_features.executable(fn, args.mode, inputs, IMPL_OPTIONS.get(name)),
                   inputs)
  return calls, model_features.flops(shape, args.mode)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--configs", nargs="+", default=["tuned"])
  parser.add_argument("--d", type=int, default=128)
  parser.add_argument("--s", type=int, default=16384)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--impls", nargs="+", help="bf16 calls of these implementations instead")
  parser.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwd")
  parser.add_argument("--b", type=int, default=1, help="batch rows (with --impls)")
  parser.add_argument("--kv-heads", type=int, help="K/V heads (GQA); default: --heads")
  parser.add_argument("--dv", type=int,
                      help="V's head dim (--impls among jaxflash, cudnn, cudnn_det); default: --d")
  parser.add_argument("--seconds", type=float, default=4.0)
  parser.add_argument("--rounds", type=int, default=1, help="configs in turn, this many times")
  parser.add_argument("--out", type=Path, default=None)
  args = parser.parse_args()
  if args.dv is not None and args.dv != args.d:
    calls, work = _value_dim_calls(args)
  else:
    calls, work = _step_calls(args) if args.impls else _fp8_calls(args)
  rows = []
  for round_ in range(args.rounds):
    for name, (fn, inputs) in calls.items():
      row = dict(config=name, round=round_, **sampled(fn, inputs, args.seconds))
      row["tflops"] = work / row["ms"] / 1e9
      row["tflops_per_ghz"] = row["tflops"] / (row["mhz"] / 1e3) if row["mhz"] else None
      rows.append(row)
      print(json.dumps(row), flush=True)
  print("\n| config | round | ms | TFLOP/s | MHz | W | TFLOP/s per GHz | clock events |\n"
        "|---|---|---|---|---|---|---|---|")
  for r in rows:
    events = ", ".join(f"{name} {share:.0%}" for name, share in r["events"].items())
    print(f"| {r['config']} | {r['round']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['mhz']} | "
          f"{r['watts']} | {r['tflops_per_ghz'] or 0:.0f} | {events} |")
  if args.out:
    args.out.write_text(json.dumps(dict(device=jax.devices()[0].device_kind, shape=vars(args),
                                         rows=rows), indent=1, default=str))


if __name__ == "__main__":
  main()
