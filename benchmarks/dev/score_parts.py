"""Development probe: where a score_mod's cost goes in the Mosaic kernels. Times forward and
forward+backward at one shape (B = 4, S = 4k, 16 heads, D = 128, causal, bf16) for score_mods
that each add one piece of ALiBi's work, after checking each against the float32 reference on
head 0 of batch row 0. On the GPU machine, from the repo root:

    PYTHONPATH=.:benchmarks python benchmarks/dev/score_parts.py
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from cases import time_calls
import jaxflash
from jaxflash import mask_mod as mask_mod_lib

B, S, N, D = 4, 4096, 16, 128
SLOPES = 2.0 ** (-8.0 * jnp.arange(1, N + 1, dtype=jnp.float32) / N)
MODS = {
    "none": None,
    "plus_zero": lambda s, b, h, q, kv: s + 0.0,
    "row_only": lambda s, b, h, q, kv: s + SLOPES[h],
    "col_only": lambda s, b, h, q, kv: s + SLOPES[h] * kv,
    "alibi": lambda s, b, h, q, kv: s + SLOPES[h] * (kv - q),
    "alibi_unseparated": lambda s, b, h, q, kv: s + SLOPES[h] * (kv - q),
}


def main():
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v = (jax.random.normal(x, (B, S, N, D), jnp.bfloat16) for x in keys[:3])
  d_out = jax.random.normal(keys[3], (B, S, N, D), jnp.float32)
  names = sys.argv[1:] or list(MODS)
  separated = mask_mod_lib._separated
  for name in names:
    mod = MODS[name]
    mask_mod_lib._separated = (lambda c: c) if name.endswith("unseparated") else separated
    call = lambda q, k, v, mod=mod: jaxflash.flash_attention(  # noqa: E731
        q, k, v, is_causal=True, score_mod=mod, implementation="mosaic")
    fwd = jax.jit(call)
    fwdbwd = jax.jit(jax.grad(lambda q, k, v: jnp.sum(call(q, k, v).astype(jnp.float32) * d_out),
                              argnums=(0, 1, 2)))
    out = fwd(q, k, v)
    want, _ = jaxflash.reference_attention(q[:1, :, :1].astype(jnp.float32),
                                           k[:1, :, :1].astype(jnp.float32),
                                           v[:1, :, :1].astype(jnp.float32), is_causal=True,
                                           score_mod=mod)
    err = float(jnp.linalg.norm(out[:1, :, :1].astype(jnp.float32) - want)
                / jnp.linalg.norm(want))
    ms_f, _ = time_calls(fwd, (q, k, v))
    ms_b, _ = time_calls(fwdbwd, (q, k, v))
    print(f"{name:20s} fwd {ms_f:.3f} ms  fwd+bwd {ms_b:.3f} ms  err {err:.1e}", flush=True)


if __name__ == "__main__":
  main()
