"""Checks, on a GPU, the experimental one-pass Mosaic backward (`mosaic.Backward(one_pass=True)`,
`jaxflash/backends/mosaic/backward.py`'s `_DqPart`), and variants of its ordering protocol.

Each (case, variant) runs in its own process, all at once, under one deadline; each prints its
compile and run seconds, whether two runs give the same bits, and the largest relative
difference of dQ, dK and dV from the two-kernel backward. A process still running at the
deadline is reported as TIMED OUT (a hang: these shapes run in milliseconds).

History (H200, jax 0.11.2, 2026-11-22). In the version that hung (5770ed5) each wait took one
from the counter (`semaphore_wait(sem)`, the "consume" variant here). It hung in cases A, E
and F, and was correct and bitwise repeatable in B and G. Read afterwards on the CPU: when
three or more key tiles visit a block, two later tiles wait on one counter at once, and the
signal meant for the first can be taken by the second. The shipped version waits until the
counter reaches the tile's place among the block's visitors, without taking from it. On an H200
(2026-11-22) "default" was correct with the same bits twice in every case, and "consume" hung
in E and F (in A it gave different bits twice). Timed (`--cases T128 T128c T64`), the one-pass
backward ran 0.76-0.86x of the two kernels, and 0.82-0.94x with "no_wait"
(raw results in git history: a126e32:benchmarks/results/mosaic_one_pass_h200_2026-11-22).

  PYTHONPATH=. python3 benchmarks/dev/diag_one_pass.py [--cases A E] [--variants default consume]
  PYTHONPATH=. python3 benchmarks/dev/diag_one_pass.py --cases T128 T64 --variants default no_wait
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

CASES = {  # name: head dim, query block of dK/dV, causal, window, key length (queries: 512)
    "A": dict(h=128, block_q=64, causal=False, window=None, s=512),
    "B": dict(h=128, block_q=64, causal=True, window=(20, 0), s=512),
    "E": dict(h=64, block_q=128, causal=False, window=None, s=512),
    "F": dict(h=128, block_q=64, causal=True, window=None, s=512),
    "G": dict(h=128, block_q=64, causal=False, window=None, s=128),
}
# Timing cases (`--time`): the tuner's 4k cells, B = 4, 16 heads, no GQA; each variant's forward
# +backward is timed next to the two-kernel backward's in the same process.
TIME_CASES = {
    "T128": dict(h=128, block_q=64, causal=False, window=None, s=4096),
    "T128c": dict(h=128, block_q=64, causal=True, window=None, s=4096),
    "T64": dict(h=64, block_q=128, causal=False, window=None, s=4096),
}

# How each variant changes `_DqPart.send` (or the walk order):
VARIANTS = {
    "default": "as shipped: wait for the count of earlier visitors, store or add, count later",
    "consume": "as in 5770ed5: each wait takes one from the counter (expected to hang)",
    "eager": "count this part as soon as it has landed (nothing pending)",
    "no_copy": "wait and count, but copy nothing: is the TMA store or add involved?",
    "walk_up": "walk the query blocks upwards",
    "no_wait": "count, but never wait (adds in any order: for timing the ordering's cost)",
}


def _patch(variant: str) -> None:
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jaxflash.backends.mosaic import backward, forward

  if variant == "walk_up":
    backward._WALK_DOWN = False
    return
  if variant == "default":
    return

  def send(self, part, head, i, pending):
    earlier = self.k_tile - self.first_ref[self.batch, i]
    first = earlier == 0
    target = self._target(head, i)
    plgpu.wait_smem_to_gmem(0)
    self.release(pending)
    stage = self.smem["dq"].at[self.wg]
    stage[...] = part
    plgpu.commit_smem()
    if variant == "no_wait":
      pass
    elif variant == "consume":
      pl.when(~first)(lambda: plgpu.semaphore_wait(self._sem(head, i), memory_scope="gpu"))
    else:
      pl.when(~first)(lambda: plgpu.semaphore_wait(self._sem(head, i), earlier, decrement=False,
                                                   memory_scope="gpu"))
    if variant != "no_copy":
      plgpu.copy_smem_to_gmem(stage, target, predicate=first)
      plgpu.copy_smem_to_gmem(stage, target, predicate=~first, reduction_op="add")
    if variant == "eager":
      plgpu.wait_smem_to_gmem(0)
      plgpu.semaphore_signal(self._sem(head, i), memory_scope="gpu")
      return pending
    return (head, i, forward._i32(1))

  backward._DqPart.send = send


def run_one(case: str, variant: str) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jaxflash.attention import attention_with_config
  from jaxflash.backends import mosaic

  _patch(variant)
  timed = case in TIME_CASES
  c = TIME_CASES[case] if timed else CASES[case]
  b, t, n, kv_heads = (4, 4096, 16, 16) if timed else (1, 512, 2, 1)  # (else GQA: 2 query heads)
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (b, t, n, c["h"]), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, c["s"], kv_heads, c["h"]), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, c["s"], kv_heads, c["h"]), jnp.bfloat16)

  def grads(backward):
    config = mosaic.Config(backward=backward)

    def loss(q, k, v):
      out = attention_with_config(q, k, v, is_causal=c["causal"], local_window_size=c["window"],
                                  config=config, implementation="mosaic")
      return jnp.sum(out.astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

  name = f"{case}/{variant}"
  one_pass = grads(mosaic.Backward(dkv_block_q=c["block_q"], dq_block_kv=c["block_q"],
                                   one_pass=True))
  start = time.time()
  compiled = one_pass.lower(q, k, v).compile()
  print(f"{name}: compiled in {time.time() - start:.1f} s", flush=True)
  start = time.time()
  first = jax.block_until_ready(compiled(q, k, v))
  print(f"{name}: ran in {time.time() - start:.2f} s", flush=True)
  second = jax.block_until_ready(compiled(q, k, v))
  two_kernels = grads(mosaic.Backward(dkv_block_q=c["block_q"], dq_block_kv=c["block_q"]))
  want = two_kernels(q, k, v)
  same = all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
             for a, b in zip(first, second))
  errors = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                  / (float(jnp.max(jnp.abs(b.astype(jnp.float32)))) + 1e-9))
            for a, b in zip(first, want)]
  print(f"{name}: same bits twice={same}, relative max error dq/dk/dv vs two kernels="
        f"{[round(e, 4) for e in errors]}", flush=True)
  if timed:
    from cases import time_call
    mine = time_call(compiled, (q, k, v))
    theirs = time_call(two_kernels, (q, k, v))
    print(f"{name}: forward+backward {mine:.3f} ms, two kernels {theirs:.3f} ms "
          f"({theirs / mine:.3f}x)", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--cases", nargs="+", default=list(CASES),
                      choices=list(CASES) + list(TIME_CASES))
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
  parser.add_argument("--deadline", type=float, default=120.0, help="seconds for all of them")
  parser.add_argument("--one", nargs=2, metavar=("CASE", "VARIANT"), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.one:
    run_one(*args.one)
    return
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
             XLA_PYTHON_CLIENT_MEM_FRACTION=".04")

  def start(c, v):
    return subprocess.Popen([sys.executable, __file__, "--one", c, v], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

  def report(c, v, proc, deadline):
    try:
      out, _ = proc.communicate(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
      proc.kill()
      out = proc.communicate()[0] + f"\n{c}/{v}: TIMED OUT"
    lines = [line for line in out.splitlines() if line.startswith(f"{c}/{v}")
             or "Error" in line]
    print("\n".join(lines[-5:]), flush=True)

  # The checks run all at once; the timed cases one at a time (each with the whole deadline),
  # so that no two share the GPU while they are timed.
  pairs = [(c, v) for c in args.cases for v in args.variants]
  procs = {(c, v): start(c, v) for c, v in pairs if c not in TIME_CASES}
  deadline = time.time() + args.deadline
  for (c, v), proc in procs.items():
    report(c, v, proc, deadline)
  for c, v in pairs:
    if c in TIME_CASES:
      report(c, v, start(c, v), time.time() + args.deadline)


if __name__ == "__main__":
  main()
