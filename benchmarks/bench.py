"""Forward and forward+backward speed of jaxflash next to jax.nn.dot_product_attention and Pallas.

The one command, on the GPU machine from the repo root:

    PYTHONPATH=. python benchmarks/bench.py

It writes benchmarks/results/<device>_<date>.json (<device> from the device kind, e.g. h200), a
.md with the tables and one PNG per dtype beside it, and prints the tables, any ERROR and WRONG
rows, and the floor summary. A progress bar (done/total, elapsed, ETA, current case) goes to
stderr; one line per step when stderr is not a terminal. Other uses:

    PYTHONPATH=. python benchmarks/bench.py --smoke --out /tmp/smoke.json   # tiny CPU run (CI)
    PYTHONPATH=. python benchmarks/bench.py --dtypes bf16 --head-dims 64 --out a.json  # a part
    PYTHONPATH=. python benchmarks/bench.py --resume --out a.json  # measure only what a.json lacks
    PYTHONPATH=. python benchmarks/bench.py --merge a.json b.json --out all.json  # join parts
    PYTHONPATH=. python benchmarks/bench.py --tune   # try Triton tile sizes, print the best
    python benchmarks/plot.py RESULTS.json           # redraw the plots

The JSON is rewritten after every case, so a run that is stopped keeps what it measured and
--resume carries on from it. benchmarks/memory.py measures memory against sequence length.

Grid (the FlashAttention-2 paper's, as in ../shared/anchors): bf16 and fp16; head dims 64, 128,
256; S = 512, 1k, 2k, 4k, 8k, 16k with 16k tokens per batch (B = 16384 / S) and hidden 2048
(N = 2048 / D heads); causal and not; self-attention. Plus a GQA case: 32 query heads, 8 KV
heads, D = 128, bf16, the same S and B. Implementations, all in this process on the same card:
jaxflash_triton and jaxflash_xla (jaxflash.flash_attention, implementation "triton" and "xla"),
xla and cudnn (jax.nn.dot_product_attention) and pallas_mha (JAX's Pallas kernel,
jax.experimental.pallas.ops.gpu.attention.mha with its defaults; not applicable to GQA, so
skipped there; it does not fit at D = 256 and those rows record the error). Without a GPU the
default is the first three, with the Triton kernels in interpret mode.

Method: every (case, implementation, mode) is compiled once (jit, lower, compile). That
executable gives XLA's compiled temp bytes, is checked against a float32 reference (jax.nn xla at
highest matmul precision, computed once per case) on batch row 0 and query heads 0-1: the output
for "fwd", dQ for "fwdbwd"; a relative error over 2e-2 flags the row as wrong. Then it is timed:
two warm-up calls, then 5 repeats of 20 back-to-back calls ended by block_until_ready, the median
per call. When the last warm-up call takes over 50 ms a repeat has fewer calls (about 1 s worth, at
least 1); the row records the calls per repeat. Inputs are random normal. "fwdbwd" times
jax.grad of sum(out.astype(f32) * dO) w.r.t. q, k, v (forward included). FLOPs: forward
4*B*N*S^2*D with N the query heads, halved when causal; forward+backward 3.5x forward.

Rows: impl, mode, dtype, B, S, N (query heads), K (KV heads), D, causal, ms, tflops, temp_bytes,
relerr (fwd), relerr_dq (fwdbwd), wrong, calls, and error or skipped when it did not run. An
implementation that fails (unsupported, out of memory, compile error) gives error rows and the
sweep goes on. The floor summary checks jaxflash_triton in bf16 against the issue's floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import triton as triton_backend

TOKENS, HIDDEN = 16384, 2048
IMPLS = ("jaxflash_triton", "jaxflash_xla", "xla", "cudnn", "pallas_mha")
# What runs without an NVIDIA GPU (the Triton kernels in interpret mode).
CPU_IMPLS = ("jaxflash_triton", "jaxflash_xla", "xla")
MODES = ("fwd", "fwdbwd")
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
TOLERANCE = 2e-2
RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent
FLOP_CONVENTION = "fwd 4*B*N*S^2*D (x0.5 causal); fwdbwd 3.5x fwd; N = query heads"
METHOD = ("compiled once per (case, impl, mode); output and dQ of batch row 0, query heads 0-1 "
          "checked against float32 jax.nn xla at highest precision; {warmups} warm-up call(s), "
          "then {repeats} repeats of up to {calls} back-to-back calls ended by "
          "block_until_ready (fewer when a warm-up call takes > {slow_ms:g} ms: about "
          "{budget_ms:g} ms per repeat), median ms per call; random normal inputs; fwdbwd = "
          "jax.grad of sum(out.astype(f32) * dO) w.r.t. q, k, v")
# The issue's floor for jaxflash_triton in bf16: speed-ups over Pallas mha, and absolute TFLOP/s.
FLOOR_RATIOS = {"fwd": 1.05, "fwdbwd": 2.0}
FLOOR_TFLOPS = 320.0


def flops(b: int, n: int, s: int, d: int, causal: bool, mode: str) -> float:
  """FLOPs of self-attention with ``n`` query heads (FlashAttention-2 paper's convention)."""
  f = 4.0 * b * n * s * s * d * (0.5 if causal else 1.0)
  return f * (3.5 if mode == "fwdbwd" else 1.0)


def time_calls(fn: Callable, args, *, warmups: int = 2, calls: int = 20, repeats: int = 5,
               slow_ms: float = 50.0, budget_ms: float = 1000.0) -> tuple[float, int]:
  """Median milliseconds per call of a compiled ``fn``, and the calls per repeat used.

  When the last warm-up call took over ``slow_ms``, a repeat has only about ``budget_ms`` worth
  of calls (at least one): slow cells such as dense XLA at 16k would otherwise take minutes and
  back-to-back calls hide no launch overhead there anyway.
  """
  last_ms = 0.0
  for _ in range(warmups):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    last_ms = (time.perf_counter() - start) * 1e3
  if last_ms > slow_ms:
    calls = max(1, min(calls, int(budget_ms / last_ms)))
  per_call = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    per_call.append((time.perf_counter() - start) / calls * 1e3)
  return statistics.median(per_call), calls


def time_call(fn: Callable, args, calls: int = 20, repeats: int = 5) -> float:
  """Median milliseconds per call of a jitted ``fn`` (two warm-ups first, fixed call count)."""
  return time_calls(fn, args, calls=calls, repeats=repeats, slow_ms=math.inf)[0]


# ---------------------------------------------------------------------------------------------
# Cases and implementations.


@dataclasses.dataclass(frozen=True)
class Case:
  """One shape of the grid: q is [b, s, n, d], k and v are [b, s, k, d]."""

  dtype: str  # a key of DTYPES
  b: int
  s: int
  n: int
  k: int
  d: int
  causal: bool

  @property
  def heads(self) -> str:
    return str(self.n) if self.n == self.k else f"{self.n}/{self.k}"

  def label(self) -> str:
    return (f"{self.dtype} heads={self.heads} D={self.d} S={self.s} "
            f"{'causal' if self.causal else 'full'}")

  def row(self) -> dict:
    return dict(dtype=jnp.dtype(DTYPES[self.dtype]).name, B=self.b, S=self.s, N=self.n,
                K=self.k, D=self.d, causal=self.causal)


def build_cases(cfg: dict) -> list[Case]:
  """The grid: every dtype x head dim x S x causal mode, then the GQA case (bf16 only)."""
  causal_modes = {"both": (False, True), "n": (False,), "y": (True,)}[cfg["causal"]]
  cases = []
  for dtype in cfg["dtypes"]:
    for d in cfg["head_dims"]:
      n = max(1, cfg["hidden"] // d)
      for s in cfg["seqs"]:
        for causal in causal_modes:
          cases.append(Case(dtype, max(1, cfg["tokens"] // s), s, n, n, d, causal))
  if cfg["gqa"] and "bf16" in cfg["dtypes"]:
    n, k, d = cfg["gqa_heads"]
    for s in cfg["seqs"]:
      for causal in causal_modes:
        cases.append(Case("bf16", max(1, cfg["tokens"] // s), s, n, k, d, causal))
  return cases


def attention_fn(impl: str, causal: bool, interpret: bool = False) -> Callable:
  """``impl`` as a function of (q, k, v) in [B, S, heads, D] layout."""
  if impl in ("jaxflash_triton", "jaxflash_xla"):
    backend = impl.removeprefix("jaxflash_")
    return lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=causal,
                                                    implementation=backend, interpret=interpret)
  if impl in ("xla", "cudnn"):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation=impl)
  if impl == "pallas_mha":
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # the module is deprecated in favour of tokamax
      from jax.experimental.pallas.ops.gpu import attention as pallas_attention
    return lambda q, k, v: pallas_attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5,
                                                causal=causal, interpret=interpret)
  raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")


def skip_reason(impl: str, case: Case) -> str | None:
  """Why ``impl`` does not apply to ``case`` (nothing is compiled then), or None."""
  if impl == "pallas_mha" and case.k != case.n:
    return "not applicable: Pallas mha has no GQA (K != N)"
  return None


def grad_fn(fn: Callable) -> Callable:
  """(q, k, v, d_out) -> (dq, dk, dv) of sum(fn(q, k, v) * d_out); d_out is an argument so that
  it is not baked into the executable as a constant."""
  def loss(q, k, v, d_out):
    return jnp.sum(fn(q, k, v).astype(jnp.float32) * d_out)
  return jax.grad(loss, argnums=(0, 1, 2))


def make_inputs(case: Case, seed: int) -> tuple[jax.Array, ...]:
  """Random normal q, k, v and output cotangent in the case's dtype.

  Drawn on the GPU when there is one (fast at 16k tokens); on a CPU with NumPy, which compiles
  nothing (compiling a random-number program per shape would dominate a smoke run).
  """
  dtype = DTYPES[case.dtype]
  shapes = [(case.b, case.s, heads, case.d) for heads in (case.n, case.k, case.k, case.n)]
  if jax.devices()[0].platform == "gpu":
    keys = jax.random.split(jax.random.key(seed), 4)
    return tuple(jax.random.normal(key, shape, dtype) for key, shape in zip(keys, shapes))
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for shape in shapes)


def check_slices(case: Case) -> tuple[tuple, tuple]:
  """Index of batch row 0 and query heads 0-1 (of q, out, dq) and of the KV heads they read.

  Attention output and dQ of one batch row and query head depend only on that row and head and
  its KV head, so this slice is checked against a small reference, also under GQA (query head h
  reads KV head h // (N / K); heads 0-1 read KV heads 0-1 without GQA, KV head 0 with it).
  """
  nq = min(2, case.n)
  nk = -(-nq // (case.n // case.k))
  return ((slice(0, 1), slice(None), slice(0, nq)), (slice(0, 1), slice(None), slice(0, nk)))


def reference(case: Case, q, k, v, d_out, compiler_options: dict | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
  """Float32 output and dQ on the checked slice (jax.nn xla at highest matmul precision)."""
  q_sl, kv_sl = check_slices(case)

  def attn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=case.causal, implementation="xla")

  def out_and_dq(q, k, v, d_out):
    out, vjp = jax.vjp(attn, q, k, v)
    return out, vjp(d_out)[0]

  # Sliced on the host: eager device slicing would compile a program per shape.
  sliced = [np.asarray(x)[sl].astype(np.float32) for x, sl in ((q, q_sl), (k, kv_sl),
                                                               (v, kv_sl), (d_out, q_sl))]
  with jax.default_matmul_precision("highest"):
    out, dq = jax.jit(out_and_dq).lower(*sliced).compile(compiler_options)(*sliced)
  return np.asarray(out), np.asarray(dq)


def relerr(got, want: np.ndarray) -> float:
  got = np.asarray(got, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def compile_mode(impl: str, case: Case, inputs, mode: str, interpret: bool,
                 compiler_options: dict | None = None):
  """(executable, args) of ``impl`` in ``mode`` for this case: jit, lower, compile, once."""
  q, k, v, d_out = inputs
  fn = attention_fn(impl, case.causal, interpret)
  f, args = (fn, (q, k, v)) if mode == "fwd" else (grad_fn(fn), (q, k, v, d_out))
  return jax.jit(f).lower(*args).compile(compiler_options), args


def run_impl(impl: str, case: Case, inputs, ref, *, interpret: bool, timing: dict,
             compiler_options: dict | None = None, compiled: dict | None = None) -> list[dict]:
  """One row per mode: compile once, check against ``ref``, time. Failures become rows.

  ``compiled`` may map a mode to a future of `compile_mode`'s result (compiled ahead, in
  parallel); modes it lacks are compiled here.
  """
  base = dict(impl=impl, **case.row())
  reason = skip_reason(impl, case)
  if reason:
    return [dict(base, mode=mode, skipped=reason) for mode in MODES]
  q_sl, _ = check_slices(case)
  rows = []
  for mode in MODES:
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
        row["relerr"] = err = relerr(np.asarray(result)[q_sl], ref[0])
      else:
        row["relerr_dq"] = err = relerr(np.asarray(result[0])[q_sl], ref[1])
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


class Progress:
  """A dependency-free progress bar on stderr: redrawn in place on a terminal, one line per step
  otherwise (the GPU runner captures output, where carriage returns would pile up)."""

  def __init__(self, total: int, stream=sys.stderr):
    self.total, self.done, self.stream = total, 0, stream
    self.start = time.perf_counter()
    self.tty = hasattr(stream, "isatty") and stream.isatty()

  @staticmethod
  def _clock(seconds: float | None) -> str:
    if seconds is None:
      return "--:--"
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m:02d}:{s:02d}"

  def show(self, label: str) -> None:
    elapsed = time.perf_counter() - self.start
    eta = elapsed / self.done * (self.total - self.done) if self.done else None
    frac = self.done / max(1, self.total)
    status = f"{self.done}/{self.total} {self._clock(elapsed)} eta {self._clock(eta)} {label}"
    if self.tty:
      bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
      width = shutil.get_terminal_size().columns - 1
      self.stream.write(("\r[" + bar + "] " + status)[:width].ljust(width))
    else:
      self.stream.write("[" + status + "]\n")
    self.stream.flush()

  def advance(self) -> None:
    self.done += 1

  def close(self) -> None:
    self.show("done")
    if self.tty:
      self.stream.write("\n")
      self.stream.flush()


def row_key(row: dict) -> tuple:
  """What a row measured: implementation, mode and case."""
  return tuple(row.get(f) for f in ("impl", "mode", "dtype", "B", "S", "N", "K", "D", "causal"))


def sweep(cfg: dict, previous: list[dict] = (), checkpoint: Callable | None = None) -> list[dict]:
  """Every case x implementation; the reference is computed once per case.

  (case, impl) pairs with rows in ``previous`` are not measured again (--resume); their rows are
  kept. ``checkpoint(rows)`` is called after each case, so a run that is stopped keeps its rows.
  """
  interpret = jax.devices()[0].platform != "gpu"
  timing = {key: cfg[key] for key in ("warmups", "calls", "repeats", "slow_ms", "budget_ms")}
  options = cfg.get("compiler_options")
  have = {row_key(r) for r in previous}
  todo = [(case, [impl for impl in cfg["impls"] if any(
      row_key(dict(impl=impl, mode=mode, **case.row())) not in have for mode in MODES)])
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
                                           options) for mode in MODES} for impl in applicable}
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
        rows += [dict(impl=impl, mode=mode, **case.row(), error=ref_error) for mode in MODES]
      else:
        rows += run_impl(impl, case, inputs, ref, interpret=interpret, timing=timing,
                         compiler_options=options, compiled=compiled.get(impl))
      progress.advance()
    del inputs, ref, compiled  # executables left unused after a reference error go here
    if checkpoint:
      checkpoint(rows)
  if pool:
    pool.shutdown()
  progress.close()
  return rows


# ---------------------------------------------------------------------------------------------
# Tile tuning (unchanged method: S = 4k, bf16, forward and backward tiles separately).


def tune(cfg: dict) -> list[dict]:
  """Times candidate Triton tile sizes (forward and backward separately) at S = 4k."""
  fwd_opts = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2),
              (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 3), (64, 64, 8, 2)]
  bwd_opts = [(64, 64, 4, 2), (64, 64, 8, 2), (64, 128, 8, 2), (128, 64, 8, 2), (32, 64, 4, 2),
              (64, 32, 4, 2), (128, 128, 8, 1), (32, 32, 4, 2), (64, 64, 4, 1), (32, 64, 8, 1)]
  rows = []
  for d in cfg["head_dims"]:
    s = 4096
    b, n = max(1, cfg["tokens"] // s), cfg["hidden"] // d
    for causal in (False, True):
      case = Case("bf16", b, s, n, n, d, causal)
      q, k, v, d_out = make_inputs(case, 0)
      base = triton_backend.default_block_sizes(d, jnp.bfloat16, causal, s)
      for kind, opts in (("fwd", fwd_opts), ("bwd", bwd_opts)):
        for opt in opts:
          if kind == "fwd":
            bs = triton_backend.BlockSizes(*opt, *list(vars(base).values())[4:])
          else:
            bs = triton_backend.BlockSizes(*list(vars(base).values())[:4], *opt)
          original = triton_backend.default_block_sizes
          triton_backend.default_block_sizes = lambda *a, bs=bs, **kw: bs
          try:
            fn = attention_fn("jaxflash_triton", causal)
            if kind == "fwd":
              f, args = jax.jit(fn), (q, k, v)
            else:
              f, args = jax.jit(grad_fn(fn)), (q, k, v, d_out)
            ms = time_call(f, args, calls=10, repeats=3)
            err = None
          except Exception as e:  # noqa: BLE001 - configs that do not fit are skipped
            ms, err = None, repr(e)[:200]
          finally:
            triton_backend.default_block_sizes = original
          mode = "fwd" if kind == "fwd" else "fwdbwd"
          tf = None if ms is None else flops(b, n, s, d, causal, mode) / (ms * 1e-3) / 1e12
          rows.append(dict(kind=kind, D=d, causal=causal, blocks=opt, ms=ms, tflops=tf,
                           error=err))
          print(f"tune D={d} causal={causal} {kind} {opt}: "
                f"{'fail' if tf is None else f'{tf:.0f} TFLOP/s'}", file=sys.stderr, flush=True)
  return rows


def print_tune(cfg: dict, rows: list[dict]) -> None:
  for d in cfg["head_dims"]:
    for causal in (False, True):
      for kind in ("fwd", "bwd"):
        ok = [r for r in rows if r["D"] == d and r["causal"] == causal and r["kind"] == kind
              and r["tflops"]]
        best = max(ok, key=lambda r: r["tflops"]) if ok else None
        print(f"best D={d} causal={causal} {kind}: "
              f"{best and best['blocks']} {best and round(best['tflops'])} TFLOP/s")


# ---------------------------------------------------------------------------------------------
# Environment, summaries and output files.


def _command(cmd: list[str]) -> str | None:
  try:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
  except (OSError, subprocess.SubprocessError):
    return None
  return (out.stdout.strip() or None) if out.returncode == 0 else None


def environment() -> dict:
  """Device, driver and library versions, git commit and date of this run."""
  dev = jax.devices()[0]
  try:
    import jaxlib
    jaxlib_version = jaxlib.__version__
  except (ImportError, AttributeError):
    jaxlib_version = None
  env = dict(device=dev.device_kind, platform=dev.platform, device_count=jax.device_count(),
             jax=jax.__version__, jaxlib=jaxlib_version, python=platform.python_version(),
             date=datetime.date.today().isoformat(),
             timestamp=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
             driver=None, cudnn=None)
  if shutil.which("nvidia-smi"):
    driver = _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    env["driver"] = driver.splitlines()[0] if driver else None
  try:
    from jax._src.lib import cuda_versions
    env["cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
  except Exception:  # noqa: BLE001 - private module; absent on CPU-only installs
    env["cudnn"] = None
  env["git_commit"] = _command(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"])
  if env["git_commit"]:
    dirty = _command(["git", "-C", str(REPO_ROOT), "status", "--porcelain",
                      "--untracked-files=no"])
    env["git_dirty"] = bool(dirty)
  return env


def device_slug(kind: str) -> str:
  """A short file-name tag for a device kind: "NVIDIA H100 80GB HBM3" -> "h100", "cpu" -> "cpu"."""
  words = [w for w in re.split(r"[^a-z0-9]+", kind.lower()) if w]
  words = [w for w in words if w not in ("nvidia", "amd", "tesla", "geforce")] or words
  if words and re.fullmatch(r"[a-z]+\d+[a-z]*", words[0]):
    return words[0]  # a model name such as h100, a100, gh200, l40s
  return "-".join(words)[:40] or "device"


def default_out(env: dict, suffix: str = "") -> Path:
  return RESULTS_DIR / f"{device_slug(env['device'])}{suffix}_{env['date']}.json"


def _short_dtype(name: str) -> str:
  return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(name, name)


def _find(rows: list[dict], **want) -> dict | None:
  for r in rows:
    if all(r.get(key) == value for key, value in want.items()):
      return r
  return None


def _rate(row: dict | None) -> float | None:
  """TFLOP/s of a row that ran and was right; None otherwise."""
  if row is None or row.get("wrong") or not row.get("tflops"):
    return None
  return row["tflops"]


def floor_summary(rows: list[dict]) -> list[dict]:
  """The issue's floor for jaxflash_triton in bf16, one entry per check (pass, miss, missing)."""
  mha = [r for r in rows if r.get("dtype") == "bfloat16" and r.get("K", r["N"]) == r["N"]]
  checks = []
  for d in (64, 128):
    for s in (1024, 4096, 16384):
      for causal in (False, True):
        for mode, need in FLOOR_RATIOS.items():
          key = dict(D=d, S=s, causal=causal, mode=mode)
          ours = _rate(_find(mha, impl="jaxflash_triton", **key))
          theirs = _rate(_find(mha, impl="pallas_mha", **key))
          value = ours / theirs if ours and theirs else None
          checks.append(dict(check=f"{mode} vs pallas_mha", **key, value=value, need=need))
  for causal in (False, True):
    key = dict(D=128, S=16384, causal=causal, mode="fwdbwd")
    checks.append(dict(check="fwdbwd TFLOP/s", **key, need=FLOOR_TFLOPS,
                       value=_rate(_find(mha, impl="jaxflash_triton", **key))))
  for c in checks:
    c["status"] = "missing" if c["value"] is None else (
        "pass" if c["value"] >= c["need"] else "miss")
  return checks


def floor_text(floor: list[dict]) -> str:
  counts = {s: sum(c["status"] == s for c in floor) for s in ("pass", "miss", "missing")}
  lines = [(f"Floor (jaxflash_triton, bf16): {counts['pass']} pass, {counts['miss']} miss, "
            f"{counts['missing']} missing"), "",
           "| check | D | S | causal | value | need | status |", "|---|---|---|---|---|---|---|"]
  for c in floor:
    ratio = c["check"].endswith("pallas_mha")
    value = "-" if c["value"] is None else (
        f"{c['value']:.2f}x" if ratio else f"{c['value']:.0f}")
    need = f">= {c['need']:.2f}x" if ratio else f">= {c['need']:.0f}"
    lines.append(f"| {c['check']} | {c['D']} | {c['S']} | {'y' if c['causal'] else 'n'} | "
                 f"{value} | {need} | {c['status']} |")
  return "\n".join(lines)


def _cell(row: dict | None) -> str:
  if row is None:
    return "-"
  if row.get("skipped"):
    return "n/a"
  if row.get("error") or row.get("tflops") is None:
    return "err"
  rate = row["tflops"]
  text = f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"  # CPU smoke runs are far below 1
  return text + (" WRONG" if row.get("wrong") else "")


def table(rows: list[dict]) -> str:
  """Markdown TFLOP/s tables, one per dtype: rows heads/D/S/causal/mode, one column per impl."""
  rows = [r for r in rows if "mode" in r]
  impls = sorted(dict.fromkeys(r["impl"] for r in rows),
                 key=lambda i: IMPLS.index(i) if i in IMPLS else len(IMPLS))
  out = []
  for dtype in dict.fromkeys(r["dtype"] for r in rows):
    sub = [r for r in rows if r["dtype"] == dtype]
    cells = {}
    for r in sub:
      k = r.get("K", r["N"])
      heads = str(r["N"]) if k == r["N"] else f"{r['N']}/{k}"
      cells[(k != r["N"], heads, r["D"], r["S"], r["causal"], r["mode"], r["impl"])] = r
    keys = sorted({key[:6] for key in cells}, key=lambda key: (key[0], key[2], key[3], key[4],
                                                               key[5], key[1]))
    out += [f"TFLOP/s, {_short_dtype(dtype)} (heads: query heads, or query/KV heads for GQA)", "",
            "| heads | D | S | causal | mode | " + " | ".join(impls) + " |",
            "|---|---|---|---|---|" + "---|" * len(impls)]
    for key in keys:
      _, heads, d, s, causal, mode = key
      out.append(f"| {heads} | {d} | {s} | {'y' if causal else 'n'} | {mode} | "
                 + " | ".join(_cell(cells.get(key + (i,))) for i in impls) + " |")
    out.append("")
  return "\n".join(out).rstrip()


def _case_text(r: dict) -> str:
  k = r.get("K", r["N"])
  heads = str(r["N"]) if k == r["N"] else f"{r['N']}/{k}"
  return (f"{r['impl']} {r.get('mode')} {_short_dtype(r.get('dtype', '?'))} heads={heads} "
          f"D={r['D']} S={r['S']} causal={'y' if r['causal'] else 'n'}")


def problems(rows: list[dict]) -> list[str]:
  lines = [f"ERROR {_case_text(r)}: {r['error'][:150]}" for r in rows if r.get("error")]
  for r in rows:
    if r.get("wrong"):
      lines.append(f"WRONG {_case_text(r)}: relerr={r.get('relerr')} "
                   f"relerr_dq={r.get('relerr_dq')} (tolerance {TOLERANCE})")
  return lines


def markdown(result: dict) -> str:
  env, cfg = result["environment"], result.get("config", {})
  head = (f"# Attention speed: {env['device']}, jax {env['jax']}, {env['date']}\n\n"
          f"{cfg.get('tokens', TOKENS)} tokens per batch, hidden {cfg.get('hidden', HIDDEN)}. "
          f"FLOPs: {FLOP_CONVENTION}. `err`: failed (see the JSON), `n/a`: not applicable, "
          f"WRONG: relative error over {TOLERANCE}.\n")
  parts = [head, table(result["rows"]), "", floor_text(result["floor"])]
  issues = problems(result["rows"])
  if issues:
    parts += ["", "Problems:", ""] + [f"- {line}" for line in issues]
  return "\n".join(parts) + "\n"


def write_outputs(result: dict, out: Path) -> list[Path]:
  """The JSON, a .md beside it and the PNG plots (skipped with a note without matplotlib)."""
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1) + "\n")
  md = out.with_suffix(".md")
  md.write_text(markdown(result))
  written = [out, md]
  try:
    import plot
  except ImportError as e:
    print(f"no plots: {e}", file=sys.stderr)
  else:
    written += plot.plot_speed(result, out.with_suffix(""))
  return written


def merge(paths: list[str]) -> dict:
  """Joins results of several runs (e.g. one per dtype): a later file's row replaces an earlier
  one of the same case, implementation and mode. Keeps the first file's environment."""
  results = [json.loads(Path(p).read_text()) for p in paths]
  devices = {r["environment"]["device"] for r in results}
  if len(devices) > 1:
    print(f"warning: merging results of different devices {sorted(devices)}", file=sys.stderr)
  rows = {}
  for res in results:
    for r in res["rows"]:
      rows[row_key(r)] = r
  cfg = dict(results[0].get("config", {}), merged_from=[str(p) for p in paths])
  for key in ("dtypes", "head_dims", "seqs", "impls"):
    values = [v for res in results for v in res.get("config", {}).get(key, [])]
    cfg[key] = list(dict.fromkeys(values))
  return dict(kind="speed", environment=results[0]["environment"], config=cfg,
              rows=list(rows.values()))


def config(args) -> dict:
  """Resolved sweep settings: flags, else the smoke grid under --smoke, else the full grid."""
  on_gpu = jax.devices()[0].platform == "gpu"
  smoke = args.smoke

  def pick(value, full, tiny):
    return value if value is not None else (tiny if smoke else full)

  return dict(
      dtypes=pick(args.dtypes, ["bf16", "fp16"], ["bf16"]),
      head_dims=pick(args.head_dims, [64, 128, 256], [32]),
      seqs=pick(args.seqs, [512, 1024, 2048, 4096, 8192, 16384], [64, 128]),
      causal=args.causal,
      impls=args.impls or list(IMPLS if on_gpu else CPU_IMPLS),
      gqa=args.gqa,
      gqa_heads=[4, 2, 32] if smoke else [32, 8, 128],
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
  parser.add_argument("--out", help="results JSON (default results/<device>_<date>.json); the "
                      ".md and .png files go beside it")
  parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), help="default: bf16 fp16")
  parser.add_argument("--head-dims", type=int, nargs="+", help="default: 64 128 256")
  parser.add_argument("--seqs", type=int, nargs="+", help="default: 512 1024 ... 16384")
  parser.add_argument("--causal", choices=("both", "y", "n"), default="both")
  parser.add_argument("--impls", nargs="+", choices=IMPLS,
                      help="default: all on a GPU; without one, " + " ".join(CPU_IMPLS))
  parser.add_argument("--gqa", action=argparse.BooleanOptionalAction, default=True,
                      help="add the GQA case (32 query / 8 KV heads, D=128, bf16)")
  parser.add_argument("--tokens", type=int, help="tokens per batch, B = tokens / S (16384)")
  parser.add_argument("--hidden", type=int, help="hidden size, N = hidden / D (2048)")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny grid and repeats that run on a CPU in seconds (CI)")
  parser.add_argument("--resume", action="store_true",
                      help="keep the rows already in --out (give it) and measure only what is "
                      "missing; the JSON is rewritten after every case, so a stopped run resumes")
  parser.add_argument("--merge", nargs="+", metavar="JSON",
                      help="join earlier results into --out instead of measuring")
  parser.add_argument("--tune", action="store_true", help="sweep Triton tile sizes instead")
  parser.add_argument("--compile-workers", type=int,
                      help="threads that compile a case's executables ahead (8 on a GPU, else 1)")
  return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict | list[dict]:
  """Runs the sweep (or --tune / --merge) and returns the result dict (the tuning rows)."""
  args = parse_args(argv)
  if args.merge:
    if not args.out:
      raise SystemExit("--merge needs --out")
    out, result = Path(args.out), merge(args.merge)
  else:
    cfg = config(args)
    env = dict(environment(), flop_convention=FLOP_CONVENTION, method=METHOD.format(**cfg))
    print(json.dumps(env), file=sys.stderr)
    if args.tune:
      rows = tune(cfg)
      if args.out:
        Path(args.out).write_text(json.dumps(dict(environment=env, rows=rows), indent=1) + "\n")
      print_tune(cfg, rows)
      return rows
    out = Path(args.out) if args.out else default_out(env)
    result = dict(kind="speed", environment=env, config=cfg)
    previous = json.loads(out.read_text())["rows"] if args.resume and out.exists() else []

    def checkpoint(rows):
      out.parent.mkdir(parents=True, exist_ok=True)
      out.write_text(json.dumps(dict(result, rows=rows, partial=True), indent=1) + "\n")

    result["rows"] = sweep(cfg, previous, checkpoint)
  result["floor"] = floor_summary(result["rows"])
  written = write_outputs(result, out)
  for line in problems(result["rows"]):
    print(line)
  print(table(result["rows"]))
  print()
  print(floor_text(result["floor"]))
  print("\nwrote " + " ".join(str(p) for p in written))
  return result


if __name__ == "__main__":
  main()
