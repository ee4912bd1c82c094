"""Dev: the dense mask's packing kernels (`jaxflash.dense_mask`), GPU time per call from a
profile, against XLA doing the same and the int8 copy they replaced.

    PYTHONPATH=. python benchmarks/dev/pack_variants.py

The 4k causal+padding mask of masks.py's dense_mask case ([4, 1, 4096, 4096] bool), thinned at
random so that partial blocks hold scattered bits."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import block_mask as bm
from jaxflash import dense_mask

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mask_parts import kernel_ms  # noqa: E402


def main():
  t = 4096
  lengths = jnp.asarray([4096, 3000, 2048, 1000], jnp.int32)
  pos = jnp.arange(t)
  valid = pos[None, :] < lengths[:, None]
  mask = (valid[:, None, :, None] & valid[:, None, None, :]
          & (pos[None, None, None, :] <= pos[None, None, :, None]))
  mask = mask & jax.random.bernoulli(jax.random.key(0), 0.9, mask.shape)
  want = dense_mask._pack_with_xla(mask)
  variants = {
      "int8 copy + classify (before)": lambda m: (m.astype(jnp.int8), bm.classify_dense(m)),
      "xla: both words + table": dense_mask._pack_with_xla,
      "triton: both words + table": dense_mask._pack_with_triton,
      "triton: keys' words + table (a forward)": lambda m: (
          lambda p: (p[0], p[2]))(dense_mask._pack_with_triton(m)),
  }
  for name, fn in variants.items():
    fn = jax.jit(fn)
    if name.startswith("triton: both"):
      for got, ref in zip(fn(mask), want):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    kernels = kernel_ms(fn, mask, calls=20)
    print(f"{name:42s} {sum(kernels.values()) * 1e3:7.1f} us  "
          + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in kernels.most_common(3)))


if __name__ == "__main__":
  main()
