"""Where an absorbed-MLA decoding call's time goes on the GPU (run on the GPU machine): the
whole `jaxflash.decode_attention` call, the Mosaic GPU kernel alone (its partial results over
the splits) and the kernel with the splits' merge, timed in interleaved rounds
next to the copy that `benchmarks/decode.py` compares with; variants of the kernel compiled
with a module setting patched (`VARIANTS`), and with ``--long-calls`` the call and the copy
timed over more back-to-back calls (less of the loop's start and end in each).

  python3 benchmarks/dev/decode_parts.py --cells 32x8192x1 8x32768x1 32x8192x2 --profile
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import _checks
from jaxflash.backends.mosaic import decode as mla
from jaxflash.backends.mosaic import decode_transposed as mla_transposed
from jaxflash.backends.triton import decode as triton_decode
from jaxflash.ops.decode import decode_inputs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cases import gpu_events, kernel_totals, relerr, time_call  # noqa: E402
from decode import reference as decode_reference  # noqa: E402

HEAD_DIM, VALUE_DIM = 576, 512


# name: (object, attribute, value) patched while the call is traced and compiled
VARIANTS = {
    "hoisted_q": (mla.bwd, "_opaque_zero", lambda ref, i: 0),  # Q's descriptors before the loop
    # The splits merged by the kernel's last CTA of each group. (A config field: the call's
    # trace is cached on its config, so a function patched under it is not traced again.)
    "kernel_merge": (mla, "default_config", lambda *a, _shipped=mla.default_config, **kw: (
        dataclasses.replace(_shipped(*a, **kw), merge_in_kernel=True, transposed=False))),
}
# That merge with one item in flight a consumer (each waited for before the next is asked for).
VARIANTS["kernel_merge_1_buffer"] = [(mla, "MERGE_BUFFERS", 1), VARIANTS["kernel_merge"]]
# The rows as the wgmma's M at 16 heads (the kernel before `decode_transposed` shipped there).
VARIANTS["rows_as_m"] = (mla, "default_config", lambda *a, _shipped=mla.default_config, **kw: (
    dataclasses.replace(_shipped(*a, **kw), transposed=False)))
# A probe of the kernel's ceiling without tensor work (wrong results): every wgmma left out, the
# rest (loads, softmax on zero scores, hand-offs, stores) as shipped. Of the 64-row kernel
# (with `rows_as_m`) it measured what a kernel with fewer products could gain at most (5-7%);
# the transposed kernel took 2-4% of it (docs/decoding.md).
VARIANTS["no_products"] = (mla.plgpu, "wgmma", lambda *a, **k: None)


# The transposed kernel's partial results (16 heads) in float32 (unscaled before 2026-12-06),
# float16 (`decode_transposed.PARTIAL_DTYPE`, shipped) and bf16, each row scaled to a common
# peak (bf16 rounds to 2^-9 a split; its 2026-12-06 timing in docs/decoding.md was unscaled).
VARIANTS["partials_f32"] = (mla_transposed, "PARTIAL_DTYPE", jnp.float32)
VARIANTS["partials_f16"] = (mla_transposed, "PARTIAL_DTYPE", jnp.float16)
VARIANTS["partials_bf16"] = (mla_transposed, "PARTIAL_DTYPE", jnp.bfloat16)


# The splits' merge another way: at T = 2 XLA runs the shipped one as two fusions on an H200, at
# T = 1 as one. (A third form, the merged LSE made first, was level too: c7e7f6e.)
VARIANTS["merge_stacked"] = (mla.merge, "MERGE_UNROLLED", 0)  # a reduction over the splits' axis
# Triton's one-launch merge of the split-KV kernel (`DecodeConfig.merge = "kernel"`).
VARIANTS["merge_triton"] = (mla.merge, "merge_splits", lambda outs, lse2: (
    triton_decode._merge_in_kernel(outs, lse2, jnp.float32, False)))


@contextlib.contextmanager
def patched(obj, attr, value):
  old = getattr(obj, attr)
  setattr(obj, attr, value)
  try:
    yield
  finally:
    setattr(obj, attr, old)


def compile_with(fn, args, patch=None):
  """``fn`` traced and compiled for ``args``, with ``patch`` (one (object, attribute, value)
  or a list of them) applied meanwhile: traced anew, every cache cleared first (jit and the
  ops under it would reuse traces made without the patch)."""
  patches = [] if patch is None else patch if isinstance(patch, list) else [patch]
  jax.clear_caches()
  with contextlib.ExitStack() as stack:
    for p in patches:
      stack.enter_context(patched(*p))
    return jax.jit(lambda *a: fn(*a)).lower(*args).compile()


def captured_call(q, cache, kv_lengths):
  """The (inputs, params, config) that ``decode_attention`` hands the Mosaic kernel, traced
  once: the inputs' arrays are replaced by the caller."""
  seen = {}
  forward = mla.forward

  def spy(inputs, params, config, pages=None):
    seen.update(inputs=inputs, params=params, config=config)
    return forward(inputs, params, config, pages)

  mla.forward = spy
  try:
    jax.jit(lambda *a: call(*a)).lower(q, cache, kv_lengths)  # (a new trace: the spy sees it)
  finally:
    mla.forward = forward
  if not seen:
    raise SystemExit("the call did not reach the Mosaic GPU kernel (not a Hopper GPU?)")
  return seen["inputs"], seen["params"], seen["config"]


def random_call_args(b: int, s: int, t: int, heads: int, seed: int = 0):
  """A cell's ``(q, latent cache, kv_lengths)``: random, every row within a block of full."""
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, t, heads, HEAD_DIM), jnp.bfloat16)
  cache = jax.random.normal(keys[1], (b, s, 1, HEAD_DIM), jnp.bfloat16)
  kv_lengths = jax.random.randint(keys[2], (b,), s - 64, s + 1, jnp.int32)
  return q, cache, kv_lengths


def call(q, cache, kv_lengths):
  """The decoding call on the latent cache that the scripts here take apart."""
  return jaxflash.decode_attention(q, cache, None, kv_lengths, value_head_dim=VALUE_DIM)


def kernel_alone(inputs, params, config):
  """The Mosaic GPU kernel's own outputs, with no XLA op after it (the transposed kernel's
  scaled float16 partials are multiplied back by `partial_results`, in the merge's fusion)."""
  if mla.runs_transposed(inputs, config):
    return mla_transposed.kernel_results(inputs, params, config.splits, config.num_stages)
  return mla.partial_results(inputs, params, config)


def parts(b: int, s: int, t: int, heads: int, variants=(), seed: int = 0):
  """``{name: (compiled fn, args)}`` for one cell, the cache's bytes, and ``{name: error}``
  of the call and its variants against a float32 reference (norm-wise)."""
  q, cache, kv_lengths = random_call_args(b, s, t, heads, seed)
  inputs, params, config = captured_call(q, cache, kv_lengths)
  others = {k: v for k, v in inputs._asdict().items()
            if k not in ("query", "key", "value", "lengths", "offsets", "kv_lengths")
            and v is not None}
  if others:
    raise SystemExit(f"inputs this script does not make: {sorted(others)}")

  def made(q, cache, kv_lengths):
    """The kernel's inputs: it reads the caller's lengths as given (`Inputs.kv_lengths`); the
    training op's ``lengths`` and ``offsets`` are made too, and left unused (no XLA op)."""
    lengths = _checks._lengths(None, kv_lengths, b, t, s)  # (T, kv_length) a row, clipped
    return decode_inputs(inputs._replace(query=q, key=cache, value=cache[..., :VALUE_DIM],
                                         lengths=lengths), kv_lengths)

  fns = {
      "call": (call, (q, cache, kv_lengths)),
      "kernel": (lambda *a: kernel_alone(made(*a), params, config),
                 (q, cache, kv_lengths)),
      "kernel+merge": (lambda *a: mla.forward(made(*a), params, config),
                       (q, cache, kv_lengths)),
  }
  compiled = {name: (compile_with(fn, args), args) for name, (fn, args) in fns.items()}
  want, got = (np.asarray(fn(*args), np.float32) for fn, args in (
      compiled["call"], (lambda *a: compiled["kernel+merge"][0](*a)[0],
                         compiled["kernel+merge"][1])))
  if not np.allclose(got, want, atol=1e-2, rtol=1e-2):
    raise SystemExit("the kernel and merge differ from the call")
  exact = decode_reference(q, cache, cache[..., :VALUE_DIM], kv_lengths, None)
  errors = {"call": relerr(want, exact)}
  for variant in variants:
    for name in ("call", "kernel"):
      fn, fn_args = fns[name]
      compiled[f"{name}_{variant}"] = (compile_with(fn, fn_args, VARIANTS[variant]), fn_args)
    fn, fn_args = compiled[f"call_{variant}"]
    got = np.asarray(fn(*fn_args), np.float32)
    errors[f"call_{variant}"] = relerr(got, exact)
    if not np.allclose(got, want, atol=1e-2, rtol=1e-2):
      print(f"  (call_{variant} differs from the call: a probe's wrong results)", flush=True)
  nbytes = b * s * HEAD_DIM * 2
  x = jnp.arange(nbytes // 4, dtype=jnp.uint32)
  compiled["copy"] = (jax.jit(lambda x: x ^ 1).lower(x).compile(), (x,))
  return compiled, nbytes, errors


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cells", nargs="+", default=["32x8192x1", "8x32768x1", "32x8192x2"],
                      help="BxSxT")
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS))
  parser.add_argument("--long-calls", type=int, default=0,
                      help="also time the call and the copy over this many calls a repeat")
  parser.add_argument("--ops", action="store_true",
                      help="the ops XLA launches for each (from the compiled HLO)")
  parser.add_argument("--dispatch", action="store_true",
                      help="the host's time to enqueue a call: the call, the kernel, x + 1 on "
                           "256 floats and Triton's split-KV call")
  parser.add_argument("--profile", action="store_true",
                      help="the call's GPU kernels (a jax.profiler trace)")
  args = parser.parse_args(argv)
  for cell in args.cells:
    b, s, t = map(int, cell.split("x"))
    compiled, nbytes, errors = parts(b, s, t, args.heads, args.variants)
    timed = [(name, fn, fn_args, 20) for name, (fn, fn_args) in compiled.items()]
    if args.long_calls:
      timed += [(f"{name}@{args.long_calls}", *compiled[name], args.long_calls)
                for name in ("call", "copy")]
    rounds = {name: [] for name, *_ in timed}
    for _ in range(args.rounds):
      for name, fn, fn_args, calls in timed:
        rounds[name].append(time_call(fn, fn_args, calls=calls) * 1e3)
    us = {name: float(np.median(v)) for name, v in rounds.items()}
    lines = []
    for name, v in us.items():
      if name.startswith("copy"):
        continue
      copy = us["copy" + name[len(name.split("@")[0]):]]  # (the copy timed the same way)
      # The fraction of the copy's bandwidth (which counts its reads and writes) as decode.py's
      lines.append(f"{name} {v:6.1f} us ({copy / (2 * v):.3f})")
    print(f"B={b} S={s} T={t} N={args.heads}: copy {us['copy']:.1f} us "
          f"({2 * nbytes / us['copy'] / 1e6:.2f} TB/s)\n  " + "\n  ".join(lines), flush=True)
    print("  error against the float32 reference (norm-wise): "
          + ", ".join(f"{name} {err:.3e}" for name, err in errors.items()), flush=True)
    if args.ops:  # what XLA launches for each: its fusions, custom calls and copies
      for name, (fn, _) in compiled.items():
        entry = fn.as_text().split("ENTRY", 1)[1].split("\n}", 1)[0]
        ops = [line.split(" = ", 1)[0].strip() for line in entry.splitlines()
               if any(f" {op}(" in line for op in ("fusion", "custom-call", "copy", "memset"))]
        print(f"  {name} launches: {', '.join(ops)}", flush=True)
    if args.dispatch:  # host time to enqueue a call (calls shorter on the GPU than on the host
      # never fill its queue; the copy's do, so its time is not the host's)
      q, cache, kv_lengths = compiled["call"][1]
      x = jnp.ones((256,), jnp.float32)
      others = {  # a call that does nothing much, and Triton's split-KV kernel's call
          "x + 1": (compile_with(lambda x: x + 1, (x,)), (x,)),
          "call_triton": (compile_with(lambda q, c, ln: jaxflash.decode_attention(
              q, c, None, ln, value_head_dim=VALUE_DIM, implementation=("triton", "xla")),
              (q, cache, kv_lengths)), (q, cache, kv_lengths))}
      for name in ("call", "kernel", *(n for n in compiled if n.startswith("call_")), *others):
        fn, fn_args = compiled.get(name) or others[name]
        jax.block_until_ready(fn(*fn_args))
        start = time.perf_counter()
        outs = [fn(*fn_args) for _ in range(200)]
        enqueue_us = (time.perf_counter() - start) / 200 * 1e6
        jax.block_until_ready(outs)
        print(f"  {name} host enqueue {enqueue_us:.1f} us a call", flush=True)
    if args.profile:
      for name in [n for n in compiled if n.startswith("call")] + ["copy"]:
        fn, fn_args = compiled[name]
        events = [e for plane in gpu_events(fn, fn_args, 5).values() for e in plane]
        print(f"  {name} GPU: " + ", ".join(f"{k['name'][:40]} {k['us']:.1f} us"
                                            for k in kernel_totals(events, 5)), flush=True)


if __name__ == "__main__":
  main()
