"""Development probe: where a score_mod's cost goes in the Mosaic kernels. Times forward and
forward+backward at one shape (B = 4, S = 4k, 16 heads, D = 128, causal, bf16) for score_mods
that each add one piece of ALiBi's work, after checking each against the float32 reference on
head 0 of batch row 0. On the GPU machine, from the repo root:

    PYTHONPATH=.:benchmarks python benchmarks/dev/score_parts.py [NAME ...]

``--smoke`` runs every score_mod on a tiny shape on the XLA backend (a CPU; the times mean
nothing) and returns the rows.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from cases import grad_fn, time_calls
import jaxflash
from jaxflash import mask_mod as mask_mod_lib

B, S, N, D = 4, 4096, 16, 128
SMOKE_SHAPE = (1, 64, 2, 32)
SLOPES = 2.0 ** (-8.0 * jnp.arange(1, N + 1, dtype=jnp.float32) / N)  # (N covers the smoke's)
TABLE = 0.5 * jax.random.normal(jax.random.key(1), (N, 2 * S - 1), jnp.float32)
TABLE_BF16 = TABLE.astype(jnp.bfloat16)
MODS = {
    "none": None,
    "plus_zero": lambda s, b, h, q, kv: s + 0.0,
    "row_only": lambda s, b, h, q, kv: s + SLOPES[h],
    "col_only": lambda s, b, h, q, kv: s + SLOPES[h] * kv,
    "alibi": lambda s, b, h, q, kv: s + SLOPES[h] * (kv - q),
    "alibi_unseparated": lambda s, b, h, q, kv: s + SLOPES[h] * (kv - q),
    # A relative-position table read through q - kv (the Mosaic kernels load its band).
    "relative": lambda s, b, h, q, kv: s + TABLE[h, q - kv + S - 1],
    "relative_bf16": lambda s, b, h, q, kv: s + TABLE_BF16[h, q - kv + S - 1],
}


def main(argv: list[str] | None = None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("names", nargs="*", help=f"score_mods to time (default all: {list(MODS)})")
  parser.add_argument("--smoke", action="store_true", help="tiny shape, XLA backend (a CPU)")
  parser.add_argument("--profile", action="store_true",
                      help="also each kernel's GPU time in forward+backward (a profile)")
  parser.add_argument("--table-gradient", action="store_true",
                      help="relative*: also forward+backward with the table differentiated")
  args = parser.parse_args(argv)
  if unknown := set(args.names) - set(MODS):
    parser.error(f"unknown score_mods {sorted(unknown)}; choose from {list(MODS)}")
  b, s, n, d = SMOKE_SHAPE if args.smoke else (B, S, N, D)
  implementation = "xla" if args.smoke else "mosaic"
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v = (jax.random.normal(x, (b, s, n, d), jnp.bfloat16) for x in keys[:3])
  d_out = jax.random.normal(keys[3], (b, s, n, d), jnp.float32)
  separated, rows = mask_mod_lib._separated, []
  for name in args.names or list(MODS):
    mod = MODS[name]
    mask_mod_lib._separated = (lambda c: c) if name.endswith("unseparated") else separated
    try:
      call = lambda q, k, v, mod=mod: jaxflash.flash_attention(  # noqa: E731
          q, k, v, is_causal=True, score_mod=mod, implementation=implementation)
      fwd = jax.jit(call)
      fwdbwd = jax.jit(grad_fn(call))
      out = fwd(q, k, v)
      want, _ = jaxflash.reference_attention(q[:1, :, :1].astype(jnp.float32),
                                             k[:1, :, :1].astype(jnp.float32),
                                             v[:1, :, :1].astype(jnp.float32), is_causal=True,
                                             score_mod=mod)
      err = float(jnp.linalg.norm(out[:1, :, :1].astype(jnp.float32) - want)
                  / jnp.linalg.norm(want))
      timing = dict(warmups=1, calls=1, repeats=1) if args.smoke else {}
      ms_f, _ = time_calls(fwd, (q, k, v), **timing)
      ms_b, _ = time_calls(fwdbwd, (q, k, v, d_out), **timing)
      ms_t = None
      if args.table_gradient and name.startswith("relative"):  # the table differentiated too
        def learned(q, k, v, table, d_out):
          mod = lambda s_, b_, h, q_, kv: s_ + table[h, q_ - kv + S - 1]  # noqa: E731
          out = jaxflash.flash_attention(q, k, v, is_causal=True, score_mod=mod,
                                         implementation=implementation)
          return jnp.sum(out.astype(jnp.float32) * d_out)
        with_table = jax.jit(jax.grad(learned, argnums=(0, 1, 2, 3)))
        ms_t, _ = time_calls(with_table, (q, k, v, TABLE, d_out), **timing)
    finally:
      mask_mod_lib._separated = separated
    rows.append(dict(name=name, fwd_ms=ms_f, fwdbwd_ms=ms_b, rel_err=err,
                     with_table_gradient_ms=ms_t))
    print(f"{name:20s} fwd {ms_f:.3f} ms  fwd+bwd {ms_b:.3f} ms  err {err:.1e}"
          + ("" if ms_t is None else f"  fwd+bwd with d table {ms_t:.3f} ms"), flush=True)
    if args.profile:
      from mask_parts import kernel_ms  # (this folder is the script's first path)
      for kernel, ms in kernel_ms(fwdbwd, q, k, v, d_out).most_common(6):
        print(f"    {ms:7.3f} ms  {kernel}", flush=True)
  return rows


if __name__ == "__main__":
  main()
