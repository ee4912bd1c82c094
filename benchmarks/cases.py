"""The benchmark's grid and measurement primitives: cases, the implementations as functions,
random inputs, the float32 reference each executable is checked against, compiling and timing."""

from __future__ import annotations

import dataclasses
import math
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import devices
from jaxflash.attention import attention_with_config

from report import IMPLS

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


def flops(b: int, n: int, s: int, d: int, causal: bool, mode: str) -> float:
  """FLOPs of self-attention with ``n`` query heads (FlashAttention-2 paper's convention)."""
  f = 4.0 * b * n * s * s * d * (0.5 if causal else 1.0)
  return f * (3.5 if mode == "fwdbwd" else 1.0)


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


def causal_modes(cfg: dict) -> tuple[bool, ...]:
  """The bands of ``--causal``: both, non-causal only ("n") or causal only ("y")."""
  return {"both": (False, True), "n": (False,), "y": (True,)}[cfg.get("causal", "both")]


def build_cases(cfg: dict) -> list[Case]:
  """The grid: every dtype x head dim x S x causal mode, then the GQA case (bf16 only)."""
  bands = causal_modes(cfg)
  cases = []
  for dtype in cfg["dtypes"]:
    for d in cfg["head_dims"]:
      n = max(1, cfg["hidden"] // d)
      for s in cfg["seqs"]:
        for causal in bands:
          cases.append(Case(dtype, max(1, cfg["tokens"] // s), s, n, n, d, causal))
  if cfg["gqa"] and "bf16" in cfg["dtypes"]:
    n, k, d = cfg["gqa_heads"]
    for s in cfg["seqs"]:
      for causal in bands:
        cases.append(Case("bf16", max(1, cfg["tokens"] // s), s, n, k, d, causal))
  # Llama-3.1-70B's attention (NVIDIA's shape for cuDNN's H200 table): one sequence, GQA 64/8.
  if cfg.get("llama_seqs") and "bf16" in cfg["dtypes"]:
    n, k, d = cfg["llama_heads"]
    for s in cfg["llama_seqs"]:
      for causal in bands:
        cases.append(Case("bf16", 1, s, n, k, d, causal))
        if cfg.get("llama_mha"):  # the MHA rate at the same total heads, GQA's yardstick
          cases.append(Case("bf16", 1, s, n, n, d, causal))
  return cases


# Compiler options an implementation needs on top of the run's. cuDNN's backward adds dQ up with
# float32 atomics, so its gradients can differ between runs; XLA's documented switch to
# deterministic implementations (docs/determinism.md in openxla/xla) makes cuDNN take its
# deterministic backward. jaxflash's gradients are deterministic by default, so "cudnn_det" is
# the like-for-like yardstick.
IMPL_OPTIONS = {"cudnn_det": {"xla_gpu_exclude_nondeterministic_ops": True}}


def impl_options(impl: str, compiler_options: dict | None) -> dict | None:
  """The run's compiler options with those ``impl`` needs (`IMPL_OPTIONS`)."""
  extra = IMPL_OPTIONS.get(impl)
  return dict(compiler_options or {}, **extra) if extra else compiler_options


def attention_fn(impl: str, causal: bool, interpret: bool = False, config=None) -> Callable:
  """``impl`` as a function of (q, k, v) in [B, S, heads, D] layout; ``config``: a jaxflash
  backend config to run instead of the backend's default (the tuner's candidates)."""
  if impl in ("jaxflash_mosaic", "jaxflash_mosaic_atomic", "jaxflash_triton", "jaxflash_xla"):
    # (``_atomic``: gradients allowed to be nondeterministic, `flash_attention`'s
    # ``deterministic=False``)
    backend = impl.removeprefix("jaxflash_").removesuffix("_atomic")
    deterministic = not impl.endswith("_atomic")
    return lambda q, k, v: attention_with_config(q, k, v, is_causal=causal, config=config,
                                                 implementation=backend, interpret=interpret,
                                                 deterministic=deterministic)
  if impl in ("xla", "cudnn", "cudnn_det"):
    backend = impl.removesuffix("_det")
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation=backend)
  if impl == "pallas_mha":
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # the module is deprecated in favour of tokamax
      from jax.experimental.pallas.ops.gpu import attention as pallas_attention
    return lambda q, k, v: pallas_attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5,
                                                causal=causal, interpret=interpret)
  raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")


def mosaic_config(head_dim: int, causal: bool, q_len: int, *, groups: int = 1,
                  value_dim: int | None = None, interpret: bool = False, backward=()):
  """The Mosaic backend's shipped config for a bf16 call (``groups`` query heads per K/V head,
  which `GQA_BACKWARD` reads) on this GPU, or the H200's in the interpreter, with
  ``backward``'s `mosaic.Backward` fields over its backward's (None: the Triton backward)."""
  from jaxflash.backends import mosaic
  kind = "NVIDIA H200" if interpret else jax.devices()[0].device_kind
  config = mosaic.default_config(head_dim, jnp.bfloat16, causal, q_len, kind, groups=groups,
                                 value_dim=value_dim)
  fields = dict(backward) if backward is not None else None
  return dataclasses.replace(config, backward=None if fields is None else dataclasses.replace(
      config.backward, **fields))


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
  if devices.has_nvidia_gpu():
    keys = jax.random.split(jax.random.key(seed), 4)
    return tuple(jax.random.normal(key, shape, dtype) for key, shape in zip(keys, shapes))
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for shape in shapes)


def check_slices(case: Case) -> tuple[tuple, tuple]:
  """(batch rows, heads) checked: rows 0 and B-1, query heads 0 and N-1, and the KV heads they
  read (for q, out, dq; and for k, v). Apply with `take`.

  Attention output and dQ of one batch row and query head depend only on that row and head and
  its KV head, so this slice is checked against a small reference, also under GQA (query head h
  reads KV head h // (N / K): heads 0 and N-1 read KV heads 0 and K-1, which the sliced
  reference pairs the same way). The first and last rows and heads catch a kernel that indexes
  only the leading ones right.
  """
  rows = sorted({0, case.b - 1})
  heads = sorted({0, case.n - 1})
  kv_heads = sorted({h // (case.n // case.k) for h in heads})
  return (rows, heads), (rows, kv_heads)


def take(x, index: tuple) -> np.ndarray:
  """``x`` [B, S, heads, D] at the (batch rows, heads) of `check_slices`."""
  rows, heads = index
  return np.asarray(x)[rows][:, :, heads]


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
  sliced = [take(x, sl).astype(np.float32) for x, sl in ((q, q_sl), (k, kv_sl), (v, kv_sl),
                                                         (d_out, q_sl))]
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
  return jax.jit(f).lower(*args).compile(impl_options(impl, compiler_options)), args


def same_bits(first, second) -> bool:
  """Whether two results (arrays or tuples of arrays) are bitwise identical, NaNs included."""
  pairs = zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True)
  return all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
             for a, b in pairs)


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


def gpu_events(fn: Callable, args, calls: int = 5) -> dict[str, list[tuple[int, int, str]]]:
  """The GPU work of ``calls`` back-to-back calls of a compiled ``fn``, from a `jax.profiler`
  trace: ``(start_ns, end_ns, kernel name)`` per kernel or copy, sorted, keyed by the device's
  plane name (``"/device:GPU:0"`` ...). Empty without a GPU. One call runs first, untraced."""
  from jax.profiler import ProfileData
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(calls):
        out = fn(*args)
      jax.block_until_ready(out)
    (path,) = Path(trace_dir).glob("**/*.xplane.pb")
    data = ProfileData.from_file(str(path))
  planes: dict[str, list] = {}
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    events = planes.setdefault(plane.name, [])
    for line in plane.lines:
      if "stream" not in line.name.lower():  # (not the per-op and per-module summary lines)
        continue
      events += [(e.start_ns, e.end_ns, e.name) for e in line.events]
    events.sort()
  return planes


def kernel_totals(events, calls: int, width: int = 70) -> list[dict]:
  """``{"name", "us", "count"}`` per kernel name (its first ``width`` characters) of
  `gpu_events` ``events`` from ``calls`` calls: microseconds and launches per call, longest
  first."""
  totals: dict[str, list] = {}
  for start, end, name in events:
    entry = totals.setdefault(name[:width], [0, 0])
    entry[0] += end - start
    entry[1] += 1
  return sorted((dict(name=name, us=ns / 1e3 / calls, count=count / calls)
                 for name, (ns, count) in totals.items()), key=lambda k: -k["us"])
