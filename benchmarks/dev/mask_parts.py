"""Where the time of a masked call goes: the block table, the lists, and the kernels, one by one.

    PYTHONPATH=. python benchmarks/dev/mask_parts.py

Times (median of repeats, bf16, the issue's dense causal+padding case: B=4, S=4096, N=16, D=128)
each piece of a call with a dense mask as its own jitted program, next to the structured call.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import _checks
from jaxflash import block_mask as bm
from jaxflash.attention import attention_with_config
from jaxflash.backends import mosaic
from jaxflash.schedule import block_lists


def timed(fn, *args, repeats=5, calls=10):
  out = fn(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls * 1e3)
  return statistics.median(times)


def main():
  b, t, n, h = 4, 4096, 16, 128
  lengths = jnp.asarray([4096, 3000, 2048, 1000], jnp.int32)
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (b, t, n, h), jnp.bfloat16) for key in keys)
  pos = jnp.arange(t)
  valid = pos[None, :] < lengths[:, None]
  mask = (valid[:, None, :, None] & valid[:, None, None, :]
          & (pos[None, None, None, :] <= pos[None, None, :, None]))
  rows = {}
  rows["classify_dense"] = timed(jax.jit(bm.classify_dense), mask)
  rows["normalise(mask)"] = timed(jax.jit(lambda q, m: _checks.normalise(q, q, q, mask=m)
                                          .inputs.block_table), q, mask)
  table = jax.jit(bm.classify_dense)(mask)
  lengths2 = jnp.stack([lengths * 0 + t, lengths * 0 + t], axis=1)
  window = jaxflash.masking.make_window(False, None)
  rows["block_lists fwd"] = timed(jax.jit(lambda tb, ln: block_lists(
      tb, (64, 64), window, 128, 128, ln, None, t, t).packed), table, lengths2)
  rows["block_lists dkv"] = timed(jax.jit(lambda tb, ln: block_lists(
      tb, (64, 64), window, 64, 128, ln, None, t, t, transpose=True).packed), table, lengths2)
  rows["mask astype int8"] = timed(jax.jit(lambda m: m.astype(jnp.int8)), mask)
  rows["mask transpose"] = timed(jax.jit(lambda m: jnp.swapaxes(m.astype(jnp.int8), 2, 3)), mask)
  lists = np.asarray(jax.jit(lambda tb, ln: block_lists(tb, (64, 64), window, 128, 128, ln, None,
                                                        t, t).packed)(table, lengths2))
  print("fwd visits: partial", lists[..., 0].sum(), "full", lists[..., 1].sum())
  for impl in ("mosaic", "triton"):
    fwd = jax.jit(lambda q, k, v, m: jaxflash.flash_attention(q, k, v, mask=m, implementation=impl))
    rows[f"{impl} fwd mask"] = timed(fwd, q, k, v, mask)
    struct = jax.jit(lambda q, k, v: jaxflash.flash_attention(
        q, k, v, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
        implementation=impl))
    rows[f"{impl} fwd structured"] = timed(struct, q, k, v)
    grad = jax.jit(jax.grad(lambda q, k, v, m: jnp.sum(jaxflash.flash_attention(
        q, k, v, mask=m, implementation=impl).astype(jnp.float32)), argnums=(0, 1, 2)))
    rows[f"{impl} fwdbwd mask"] = timed(grad, q, k, v, mask)
  # The Mosaic forward with a dense mask but no table (every block masked: the old path).
  cfg = mosaic.default_config(h, jnp.bfloat16, False, t, jax.devices()[0].device_kind)
  print("mosaic config", cfg)
  for name, ms in rows.items():
    print(f"{name:28s} {ms:8.3f} ms")


if __name__ == "__main__":
  main()
