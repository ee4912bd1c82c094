"""Forward and forward+backward speed of jaxflash next to jax.nn.dot_product_attention and Pallas.

The one command, on the GPU machine from the repo root:

    PYTHONPATH=. python benchmarks/bench.py

It writes benchmarks/results/<device>/grid.json (<device> from the device kind, e.g. h200), a
grid.md with the tables and one PNG per dtype (grid_bf16.png, grid_fp16.png) beside it, and
prints the tables, any ERROR and WRONG rows, and (with --floor) an acceptance floor check. A
progress bar (done/total, elapsed, ETA, current case) goes to stderr; one line per step when
stderr is not a terminal. Other uses:

    PYTHONPATH=. python benchmarks/bench.py --smoke --out /tmp/smoke.json   # tiny CPU run (CI)
    PYTHONPATH=. python benchmarks/bench.py --dtypes bf16 --head-dims 64 --out a.json  # a part
    PYTHONPATH=. python benchmarks/bench.py --resume --out a.json  # measure only what a.json lacks
    PYTHONPATH=. python benchmarks/bench.py --merge a.json b.json --out all.json  # join runs
    PYTHONPATH=. python benchmarks/bench.py --tune   # try Triton/Mosaic tiles at 4k (or --seqs)
    python benchmarks/plot.py RESULTS.json           # redraw the plots

The JSON is rewritten after every case, so a run that is stopped keeps what it measured and
--resume carries on from it. benchmarks/memory.py measures memory against sequence length.

Grid (the FlashAttention-2 paper's): bf16 and fp16; head dims 64, 128,
256; S = 512, 1k, 2k, 4k, 8k, 16k with 16k tokens per batch (B = 16384 / S) and hidden 2048
(N = 2048 / D heads); causal and not; self-attention. Plus a GQA case: 32 query heads, 8 KV
heads, D = 128, bf16, the same S and B; and Llama-3.1-70B's attention, B = 1, 64 query and 8 KV
heads, D = 128, bf16, at 8k and 16k (`--llama-seqs`). Implementations, all in this process on
the same card: jaxflash_mosaic, jaxflash_triton and jaxflash_xla (jaxflash.flash_attention,
implementation "mosaic", "triton" and "xla"), jaxflash_mosaic_atomic (the Mosaic backend with
deterministic=False: dQ added with float32 atomics where that backward serves the call),
xla and cudnn (jax.nn.dot_product_attention), cudnn_det (cudnn compiled with XLA's
xla_gpu_exclude_nondeterministic_ops, which makes cuDNN's backward deterministic like
jaxflash's) and pallas_mha (JAX's Pallas kernel, jax.experimental.pallas.ops.gpu.attention.mha
with its defaults; not applicable to GQA, so skipped there; it does not fit at D = 256 and
those rows record the error). On a GPU the default is jaxflash_mosaic, jaxflash_triton, cudnn,
cudnn_det and xla; without one, jaxflash_triton (its kernels in interpret mode), jaxflash_xla and
xla.

Method: every (case, implementation, mode) is compiled once (jit, lower, compile). That executable
gives XLA's compiled temp bytes, is checked against a float32 reference (jax.nn xla at highest
matmul precision, computed once per case) on the first and last batch row and query head: the
output for "fwd", dQ for "fwdbwd"; a relative error over 2e-2 flags the row as wrong. Then it is
timed: two warm-up calls, then 5 repeats of 20 back-to-back calls ended by block_until_ready, the
median per call. When the last warm-up call takes over 50 ms a repeat has fewer calls (about 1 s
worth, at least 1); the row records the calls per repeat. Inputs are random normal. "fwdbwd" times
jax.grad of sum(out.astype(f32) * dO) w.r.t. q, k, v (forward included). FLOPs: forward
4*B*N*S^2*D with N the query heads, halved when causal; forward+backward 3.5x forward.

Rows: impl, mode, dtype, B, S, N (query heads), K (KV heads), D, causal, ms, tflops, temp_bytes,
relerr (fwd), relerr_dq (fwdbwd), repeatable (fwdbwd: a second call on the same inputs gave
bitwise the same dQ, dK and dV), wrong, calls, and error or skipped when it did not run. An
implementation that fails (unsupported, out of memory, compile error) gives error rows and the
sweep goes on. --floor FILE checks the rows against an acceptance floor (data, e.g.
benchmarks/dev/floors/triton_vs_pallas_mha.json). --merge joins results files as runs of one
file (report.join: every row keeps its run's name; tables and plots take a cell's latest run).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path


from jaxflash import devices

import report
import tune as tuner
from cases import (DTYPES, Case, build_cases, check_slices, compile_mode, flops, make_inputs,
                   reference, relerr, same_bits, skip_reason, take, time_calls)
from report import FLOP_CONVENTION, HIDDEN, IMPLS, TOKENS, TOLERANCE, Progress, row_key

# What runs without an NVIDIA GPU (the Triton kernels in interpret mode).
CPU_IMPLS = ("jaxflash_triton", "jaxflash_xla", "xla")
# What runs by default on a GPU (--impls for others: jaxflash_xla, pallas_mha).
GPU_IMPLS = ("jaxflash_mosaic", "jaxflash_triton", "cudnn", "cudnn_det", "xla")
MODES = ("fwd", "fwdbwd")
METHOD = ("compiled once per (case, impl, mode); output and dQ of batch rows 0 and B-1, query "
          "heads 0 and N-1 checked against float32 jax.nn xla at highest precision; "
          "{warmups} warm-up call(s), then {repeats} repeats of up to {calls} back-to-back "
          "calls ended by block_until_ready (fewer when a warm-up call takes > {slow_ms:g} "
          "ms: about {budget_ms:g} ms per repeat), median ms per call; random normal inputs; "
          "fwdbwd = jax.grad of sum(out.astype(f32) * dO) w.r.t. q, k, v")


def run_impl(impl: str, case: Case, inputs, ref, *, interpret: bool, timing: dict,
             compiler_options: dict | None = None, compiled: dict | None = None,
             modes: tuple[str, ...] = MODES) -> list[dict]:
  """One row per mode: compile once, check against ``ref``, time. Failures become rows.

  ``compiled`` may map a mode to a future of `compile_mode`'s result (compiled ahead, in
  parallel); modes it lacks are compiled here.
  """
  base = dict(impl=impl, **case.row())
  reason = skip_reason(impl, case)
  if reason:
    return [dict(base, mode=mode, skipped=reason) for mode in modes]
  q_sl, _ = check_slices(case)
  rows = []
  for mode in modes:
    row = dict(base, mode=mode, ms=None, tflops=None, temp_bytes=None, relerr=None,
               relerr_dq=None, calls=None, wrong=False)
    try:
      if compiled and mode in compiled:
        executable, args = compiled.pop(mode).result()
      else:
        executable, args = compile_mode(impl, case, inputs, mode, interpret, compiler_options)
      row["temp_bytes"] = executable.memory_analysis().temp_size_in_bytes
      result = executable(*args)
      if mode == "fwd":
        row["relerr"] = err = relerr(take(result, q_sl), ref[0])
      else:
        row["relerr_dq"] = err = relerr(take(result[0], q_sl), ref[1])
        # A second call on the same inputs: are dQ, dK and dV bitwise the same?
        row["repeatable"] = same_bits(result, executable(*args))
      row["wrong"] = not err < TOLERANCE  # NaN counts as wrong
      del result
      row["ms"], row["calls"] = time_calls(executable, args, **timing)
      row["tflops"] = flops(case.b, case.n, case.s, case.d, case.causal, mode) / (
          row["ms"] * 1e-3) / 1e12
      del executable
    except Exception as e:  # noqa: BLE001 - unsupported, out of memory, compile failure: go on
      row["error"] = repr(e)[:300]
    rows.append(row)
  return rows


def sweep(cfg: dict, previous: list[dict] = (), checkpoint: Callable | None = None) -> list[dict]:
  """Every case x implementation; the reference is computed once per case.

  (case, impl) pairs with rows in ``previous`` are not measured again (--resume); their rows are
  kept. ``checkpoint(rows)`` is called after each case, so a run that is stopped keeps its rows.
  """
  interpret = not devices.has_nvidia_gpu()
  timing = {key: cfg[key] for key in ("warmups", "calls", "repeats", "slow_ms", "budget_ms")}
  options = cfg.get("compiler_options")
  modes = tuple(cfg.get("modes") or MODES)
  have = {row_key(r) for r in previous}
  todo = [(case, [impl for impl in cfg["impls"] if any(
      row_key(dict(impl=impl, mode=mode, **case.row())) not in have for mode in modes)])
          for case in build_cases(cfg)]
  progress = Progress(sum(len(impls) for _, impls in todo))
  rows = list(previous)
  # Compiling dominates the sweep's wall time (several Triton kernels and XLA programs per case,
  # ~900 executables in all). XLA and Triton compile outside the GIL, so every executable of a
  # case is compiled in a thread pool up front; checks and timings then run one at a time, with
  # nothing else on the machine busy.
  pool = ThreadPoolExecutor(cfg["compile_workers"]) if cfg["compile_workers"] > 1 else None
  for seed, (case, impls) in enumerate(todo):  # the seed follows the case, also on --resume
    if not impls:
      continue
    inputs = make_inputs(case, seed)
    applicable = [impl for impl in impls if skip_reason(impl, case) is None]
    compiled, ref_future = {}, None
    if pool:
      ref_future = pool.submit(reference, case, *inputs, compiler_options=options)
      compiled = {impl: {mode: pool.submit(compile_mode, impl, case, inputs, mode, interpret,
                                           options) for mode in modes} for impl in applicable}
      wait([ref_future] + [f for futures in compiled.values() for f in futures.values()])
    ref, ref_error = None, None
    for impl in impls:
      progress.show(f"{case.label()} {impl}")
      if ref is None and ref_error is None and impl in applicable:
        try:
          ref = (ref_future.result() if ref_future else
                 reference(case, *inputs, compiler_options=options))
        except Exception as e:  # noqa: BLE001 - e.g. OOM: every impl of this case reports it
          ref_error = f"reference: {e!r}"[:300]
      if ref_error and impl in applicable:
        rows += [dict(impl=impl, mode=mode, **case.row(), error=ref_error) for mode in modes]
      else:
        rows += run_impl(impl, case, inputs, ref, interpret=interpret, timing=timing,
                         compiler_options=options, compiled=compiled.get(impl), modes=modes)
      progress.advance()
    del inputs, ref, compiled  # executables left unused after a reference error go here
    if checkpoint:
      checkpoint(rows)
  if pool:
    pool.shutdown()
  progress.close()
  return rows


def config(args) -> dict:
  """Resolved sweep settings: flags, else the smoke grid under --smoke, else the full grid."""
  on_gpu = devices.has_nvidia_gpu()
  smoke = args.smoke

  def pick(value, full, tiny):
    return value if value is not None else (tiny if smoke else full)

  return dict(
      dtypes=pick(args.dtypes, ["bf16", "fp16"], ["bf16"]),
      head_dims=pick(args.head_dims, [64, 128, 256], [32]),
      seqs=pick(args.seqs, [512, 1024, 2048, 4096, 8192, 16384], [64, 128]),
      tune_seqs=args.seqs,  # --tune: the sequence lengths of its cells (None: tune.SEQS)
      tune_families=args.tune_families,  # --tune: Mosaic families (None: the forward's)
      causal=args.causal,
      modes=args.modes or list(MODES),
      impls=args.impls or list(GPU_IMPLS if on_gpu else CPU_IMPLS),
      gqa=args.gqa,
      gqa_heads=[4, 2, 32] if smoke else [32, 8, 128],
      llama_seqs=(args.llama_seqs if args.llama_seqs is not None
                  else [] if smoke else [8192, 16384]),
      llama_heads=[64, 8, 128],
      llama_mha=args.llama_mha,
      tokens=pick(args.tokens, TOKENS, 256),
      hidden=pick(args.hidden, HIDDEN, 128),
      warmups=1 if smoke else 2, calls=2 if smoke else 20, repeats=2 if smoke else 5,
      slow_ms=50.0, budget_ms=1000.0, smoke=smoke,
      compile_workers=(args.compile_workers if args.compile_workers is not None
                       else 8 if on_gpu else 1),
      # Compiling dominates a CPU smoke run and its timings mean nothing: LLVM -O0 halves it.
      compiler_options=({"xla_backend_optimization_level": 0} if smoke and not on_gpu
                        else None))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", help="results JSON (default results/<device>/grid.json); the "
                      ".md and .png files go beside it")
  parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), help="default: bf16 fp16")
  parser.add_argument("--head-dims", type=int, nargs="*",
                      help="default: 64 128 256 (none: only the GQA and Llama cases)")
  parser.add_argument("--seqs", type=int, nargs="+", help="default: 512 1024 ... 16384")
  parser.add_argument("--causal", choices=("both", "y", "n"), default="both")
  parser.add_argument("--modes", nargs="+", choices=MODES, help="default: fwd fwdbwd")
  parser.add_argument("--impls", nargs="+", choices=IMPLS,
                      help="default on a GPU: " + " ".join(GPU_IMPLS) + "; without one, "
                      + " ".join(CPU_IMPLS))
  parser.add_argument("--gqa", action=argparse.BooleanOptionalAction, default=True,
                      help="add the GQA case (32 query / 8 KV heads, D=128, bf16)")
  parser.add_argument("--llama-seqs", type=int, nargs="*",
                      help="lengths of the Llama-3.1-70B case (B = 1, 64 query / 8 KV heads, "
                      "D = 128, bf16); default 8192 16384, none with --smoke; give none to skip")
  parser.add_argument("--llama-mha", action="store_true",
                      help="add the Llama case with 64 K/V heads too: the MHA rate at the same "
                      "total heads, which GQA's is compared with")
  parser.add_argument("--tokens", type=int, help="tokens per batch, B = tokens / S (16384)")
  parser.add_argument("--hidden", type=int, help="hidden size, N = hidden / D (2048)")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny grid and repeats that run on a CPU in seconds (CI)")
  parser.add_argument("--resume", action="store_true",
                      help="keep the rows already in --out (give it) and measure only what is "
                      "missing; the JSON is rewritten after every case, so a stopped run resumes")
  parser.add_argument("--merge", nargs="+", metavar="JSON",
                      help="join earlier results into --out as runs of one file, instead of "
                      "measuring")
  parser.add_argument("--tune", action="store_true",
                      help="sweep Triton and Mosaic tiles instead (at S = 4k, or --seqs)")
  parser.add_argument("--tune-families", nargs="+", choices=tuner.MOSAIC_FAMILIES,
                      help="--tune: which Mosaic candidates to time (default: the forward's; "
                      "backward times forward+backward with each backward tile set)")
  parser.add_argument("--floor", help="acceptance floor JSON to check the rows against (e.g. "
                      "benchmarks/dev/floors/triton_vs_pallas_mha.json); none by default")
  parser.add_argument("--compile-workers", type=int,
                      help="threads that compile a case's executables ahead (8 on a GPU, else 1)")
  return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict | list[dict]:
  """Runs the sweep (or --tune / --merge) and returns the result dict (the tuning rows)."""
  args = parse_args(argv)
  if args.merge:
    if not args.out:
      raise SystemExit("--merge needs --out")
    out, result = Path(args.out), report.join_files(args.merge)
  else:
    cfg = config(args)
    env = dict(report.environment(), flop_convention=FLOP_CONVENTION,
               method=METHOD.format(**cfg))
    print(json.dumps(env), file=sys.stderr)
    if args.tune:
      rows = tuner.tune(cfg)
      if args.out:
        Path(args.out).write_text(json.dumps(dict(environment=env, rows=rows), indent=1) + "\n")
      tuner.print_tune(cfg, rows)
      return rows
    out = Path(args.out) if args.out else report.default_out(env, "grid")
    result = dict(kind="speed", environment=env, config=cfg)
    previous = json.loads(out.read_text())["rows"] if args.resume and out.exists() else []

    def checkpoint(rows):
      out.parent.mkdir(parents=True, exist_ok=True)
      out.write_text(json.dumps(dict(result, rows=rows, partial=True), indent=1) + "\n")

    result["rows"] = sweep(cfg, previous, checkpoint)
  if args.floor:
    result["floor"] = report.floor_summary(report.current_rows(result),
                                           report.load_floor(args.floor))
  written = report.write_outputs(result, out)
  for line in report.problems(result["rows"]):
    print(line)
  print(report.table(report.current_rows(result)))
  if result.get("floor"):
    print()
    print(report.floor_text(result["floor"]))
  print("\nwrote " + " ".join(str(p) for p in written))
  return result


if __name__ == "__main__":
  main()
