"""Memory of one attention training step as the sequence grows, and the longest S that trains.

On the GPU machine from the repo root:

    PYTHONPATH=. python benchmarks/memory.py                   # causal, S = 1k ... 128k
    PYTHONPATH=. python benchmarks/memory.py --smoke --out /tmp/m.json   # tiny CPU run (CI)

The step is forward+backward: jax.grad of sum(out * dO) w.r.t. q, k, v, with B = 1, 16 heads,
D = 128, bf16, causal unless --causal n. For each implementation (as in bench.py) and each S it
records:

- temp_bytes: XLA's compiled temp bytes (memory_analysis). Compiling does not allocate the step's
  buffers, so this is known even for an S whose run then fails; a failed compile is recorded.
- peak_bytes: the device allocator's peak_bytes_in_use after running the step (None where the
  platform reports no memory stats, e.g. a CPU). It includes the inputs, outputs and gradients.
- ms and TFLOP/s of one step: timed after one warm-up call up to 32k; past that one call is timed
  straight after compiling (a step takes seconds there).

How the peak is attributed: JAX's peak counter only grows and cannot be reset, so each
implementation runs in its own worker process (this script with --worker), which visits S in
increasing order. A step's memory grows with S, so the peak read after step S is the peak of step
S. (At the shortest S the peak may instead come from compiling, e.g. autotuning scratch, or from
drawing the random inputs; from a few k on the step dominates.) The worker stops at the first
failure, typically out of memory at run time; the longest trainable S of an implementation is the
largest S that ran. A worker that runs past --timeout or dies counts as a failure at the first S
it did not report. Workers run with XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (unless set already): the
default allocator, with the memory a user would give a training job. Workers run one at a time,
never two on the card at once.

Writes benchmarks/results/<device>/memory.json (environment, rows, longest_s; <device> from the
device kind, e.g. h200) and a .md and .png beside it, and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import bench
import cases
import jax
import report
from jaxflash import devices

DEFAULT_SEQS = [1024 * 2**i for i in range(8)]  # 1k ... 128k
# Every implementation but the deterministic cuDNN; the first (jaxflash_triton) runs everywhere,
# and the platform is learnt from the first worker.
DEFAULT_IMPLS = tuple(impl for impl in report.IMPLS if impl != "cudnn_det")
MEM_FRACTION = "0.95"
# Beyond this S one step takes seconds, so no warm-up call before the timed one.
WARMUP_MAX_S = 32768


# ---------------------------------------------------------------------------------------------
# The worker: one implementation, S increasing, one JSON line per S on stdout.


def _emit(tag: str, obj: dict) -> None:
  print(f"{tag} {json.dumps(obj)}", flush=True)


def worker(cfg: dict, impl: str) -> None:
  """Measures ``impl`` at each S in turn; prints "ENV {...}" once, then "ROW {...}" per S."""
  env = report.environment()
  _emit("ENV", env)
  on_gpu = devices.has_nvidia_gpu()
  options = cases.impl_options(
      impl, {"xla_backend_optimization_level": 0} if cfg["smoke"] and not on_gpu else None)
  step = cases.grad_fn(cases.attention_fn(impl, cfg["causal"], interpret=not on_gpu))
  dtype = cases.DTYPES[cfg["dtype"]]
  for s in sorted(cfg["seqs"]):
    case = cases.Case(cfg["dtype"], cfg["batch"], s, cfg["heads"], cfg["heads"], cfg["head_dim"],
                      cfg["causal"])
    row = dict(impl=impl, **case.row(), temp_bytes=None, peak_bytes=None, ms=None, tflops=None)
    q_shape = (case.b, s, case.n, case.d)
    try:
      # Shapes are enough to compile, so a length whose inputs would not fit still compiles.
      spec = jax.ShapeDtypeStruct(q_shape, dtype)
      compiled = jax.jit(step).lower(spec, spec, spec, spec).compile(options)
      row["temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
    except Exception as e:  # noqa: BLE001 - recorded; longer S would fail the same way
      _emit("ROW", dict(row, error=repr(e)[:300], failed="compile"))
      return
    try:
      args = cases.make_inputs(case, seed=s)
      if s <= WARMUP_MAX_S:
        jax.block_until_ready(compiled(*args))
      start = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      row["ms"] = (time.perf_counter() - start) * 1e3
      row["tflops"] = cases.flops(case.b, case.n, s, case.d, case.causal, "fwdbwd") / (
          row["ms"] * 1e-3) / 1e12
      stats = jax.devices()[0].memory_stats()
      row["peak_bytes"] = stats.get("peak_bytes_in_use") if stats else None
    except Exception as e:  # noqa: BLE001 - typically out of memory: the end of this impl
      _emit("ROW", dict(row, error=repr(e)[:300], failed="run"))
      return
    _emit("ROW", row)
    del args, compiled


# ---------------------------------------------------------------------------------------------
# The parent: one worker process per implementation, in turn (never two on the card at once).


def _worker_argv(cfg: dict, impl: str) -> list[str]:
  argv = [sys.executable, str(Path(__file__).resolve()), "--worker", impl,
          "--seqs", *map(str, cfg["seqs"]), "--causal", "y" if cfg["causal"] else "n",
          "--heads", str(cfg["heads"]), "--head-dim", str(cfg["head_dim"]),
          "--batch", str(cfg["batch"]), "--dtype", cfg["dtype"]]
  return argv + (["--smoke"] if cfg["smoke"] else [])


def run_worker(cfg: dict, impl: str) -> tuple[dict | None, list[dict]]:
  """Runs one worker process; returns its environment and rows (a failure row appended when it
  timed out or died before reporting every S)."""
  env = dict(os.environ)
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(report.REPO_ROOT),
                                                  env.get("PYTHONPATH")) if p)
  worker_env, rows = None, []
  expired = threading.Event()
  with tempfile.TemporaryFile("w+") as errors:
    proc = subprocess.Popen(_worker_argv(cfg, impl), stdout=subprocess.PIPE, stderr=errors,
                            text=True, env=env)

    def expire():
      expired.set()
      proc.kill()

    timer = threading.Timer(cfg["timeout"], expire)
    timer.start()
    try:
      for line in proc.stdout:  # read as they come, so a killed worker keeps what it reported
        tag, _, payload = line.partition(" ")
        if tag == "ENV":
          worker_env = json.loads(payload)
        elif tag == "ROW":
          rows.append(json.loads(payload))
          r = rows[-1]
          print(f"  {impl} S={r['S']}: " + (f"failed ({r['failed']})" if r.get("error") else
                f"peak {_gb(r['peak_bytes'])} GB, temp {_gb(r['temp_bytes'])} GB, "
                f"{r['ms']:.1f} ms"), file=sys.stderr, flush=True)
      code = proc.wait()
    finally:
      timer.cancel()
    errors.seek(0)
    tail = errors.read()[-300:]
  pending = [s for s in sorted(cfg["seqs"]) if s not in {r["S"] for r in rows}]
  if pending and not (rows and rows[-1].get("error")):
    if expired.is_set():
      error, failed = f"timeout: worker killed after {cfg['timeout']} s", "timeout"
    else:
      error, failed = f"worker exited with code {code}: {tail}", "crash"
    case = cases.Case(cfg["dtype"], cfg["batch"], pending[0], cfg["heads"], cfg["heads"],
                      cfg["head_dim"], cfg["causal"])
    rows.append(dict(impl=impl, **case.row(), temp_bytes=None, peak_bytes=None, ms=None,
                     tflops=None, error=error, failed=failed))
  return worker_env, rows


def longest_trainable(rows: list[dict], impls) -> dict[str, int | None]:
  """Largest S that ran, per implementation (None when none did)."""
  return {impl: max((r["S"] for r in rows if r["impl"] == impl and not r.get("error")),
                    default=None) for impl in impls}


def _gb(n) -> str:
  return "-" if n is None else f"{n / 1e9:.3g}"


def table(result: dict) -> str:
  """Markdown: S rows x implementation columns, "peak GB / temp GB" or the failure."""
  rows, impls = result["rows"], result["config"]["impls"]
  cells = {(r["impl"], r["S"]): r for r in rows}
  lines = ["| S | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
  for s in sorted({r["S"] for r in rows}):
    out = []
    for impl in impls:
      r = cells.get((impl, s))
      if r is None:
        out.append("")
      elif r.get("error"):
        temp = f" (temp {_gb(r['temp_bytes'])})" if r.get("temp_bytes") else ""
        out.append(f"fails: {r.get('failed', 'error')}{temp}")
      else:
        out.append(f"{_gb(r['peak_bytes'])} / {_gb(r['temp_bytes'])}")
    lines.append(f"| {s} | " + " | ".join(out) + " |")
  longest = [result["longest_s"].get(i) for i in impls]
  lines += ["", "| longest trainable S | " + " | ".join(
      "none" if s is None else str(s) for s in longest) + " |"]
  return "\n".join(lines)


def markdown(result: dict) -> str:
  env, cfg = result["environment"], result["config"]
  return (f"# Attention training-step memory: {env['device']}, jax {env['jax']}, {env['date']}\n\n"
          f"Forward+backward, B={cfg['batch']}, {cfg['heads']} heads, D={cfg['head_dim']}, "
          f"{cfg['dtype']}, {'causal' if cfg['causal'] else 'full'}. Cells: peak device memory "
          f"of one step / XLA compiled temp bytes, GB (1e9 bytes); peak is `-` where the "
          f"platform reports none. XLA_PYTHON_CLIENT_MEM_FRACTION="
          f"{env.get('mem_fraction')}.\n\n" + table(result) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", help="results JSON (default results/<device>/memory.json)")
  parser.add_argument("--seqs", type=int, nargs="+", help="default: 1024 2048 ... 131072")
  parser.add_argument("--impls", nargs="+", choices=report.IMPLS,
                      help="default: all but cudnn_det (cudnn and pallas_mha only where there "
                      "is a GPU)")
  parser.add_argument("--causal", choices=("y", "n"), default="y")
  parser.add_argument("--heads", type=int, help="default 16")
  parser.add_argument("--head-dim", type=int, help="default 128")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--dtype", choices=sorted(cases.DTYPES), default="bf16")
  parser.add_argument("--timeout", type=float, default=600.0,
                      help="seconds per worker (one implementation, every S); past it the "
                      "worker is killed and fails at the S it was on")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny run on a CPU: S 64 128, 2 heads, D 32")
  parser.add_argument("--worker", choices=report.IMPLS, help=argparse.SUPPRESS)
  return parser.parse_args(argv)


def config(args) -> dict:
  def pick(value, full, tiny):
    return value if value is not None else (tiny if args.smoke else full)

  return dict(seqs=sorted(pick(args.seqs, DEFAULT_SEQS, [64, 128])), impls=args.impls,
              causal=args.causal == "y", heads=pick(args.heads, 16, 2),
              head_dim=pick(args.head_dim, 128, 32), batch=args.batch, dtype=args.dtype,
              timeout=args.timeout, smoke=args.smoke)


def main(argv: list[str] | None = None) -> dict | None:
  """Runs one worker per implementation and writes the results; returns them."""
  args = parse_args(argv)
  cfg = config(args)
  if args.worker:
    worker(cfg, args.worker)
    return None
  # This process never touches the device (it would hold memory the workers need); the
  # environment comes from the first worker.
  env, rows, done = None, [], []
  todo = list(cfg["impls"] or DEFAULT_IMPLS)
  while len(done) < len(todo):
    impl = todo[len(done)]
    print(f"[{len(done) + 1}/{len(todo)}] {impl}: S = {' '.join(map(str, cfg['seqs']))}",
          file=sys.stderr, flush=True)
    worker_env, worker_rows = run_worker(cfg, impl)
    env = env or worker_env
    rows += worker_rows
    done.append(impl)
    if cfg["impls"] is None and env and env["platform"] != "gpu":
      # The default list, less the GPU-only ones not yet run.
      todo = done + [i for i in todo[len(done):] if i in bench.CPU_IMPLS]
  env = env or dict(device="unknown", platform=None, jax=jax.__version__,
                    date=datetime.date.today().isoformat())
  env = dict(env, mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION),
             peak_method="peak_bytes_in_use after the step, one process per implementation, "
             "S increasing", flop_convention=report.FLOP_CONVENTION)
  cfg["impls"] = done
  result = dict(kind="memory", environment=env, config=cfg, rows=rows,
                longest_s=longest_trainable(rows, done))
  out = Path(args.out) if args.out else report.default_out(env, "memory")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1) + "\n")
  out.with_suffix(".md").write_text(markdown(result))
  written = [out, out.with_suffix(".md")]
  try:
    import plot
  except ImportError as e:
    print(f"no plot: {e}", file=sys.stderr)
  else:
    written.append(plot.plot_memory(result, out.with_suffix("")))
  print(table(result))
  print("\nlongest trainable S: " + ", ".join(f"{i} {s}" for i, s in result["longest_s"].items()))
  print("wrote " + " ".join(str(p) for p in written))
  return result


if __name__ == "__main__":
  main()
