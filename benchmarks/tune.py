"""Tile tuning for the Triton backend (`bench.py --tune`): times candidate forward and backward
tiles at S = 4k in bf16, passing each candidate as a config (nothing is patched)."""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp

from jaxflash import devices
from jaxflash.backends import triton

from cases import Case, attention_fn, flops, grad_fn, make_inputs, time_call


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
      base = triton.default_config(d, jnp.bfloat16, causal, s, devices.current().kind)
      for kind, opts in (("fwd", fwd_opts), ("bwd", bwd_opts)):
        for opt in opts:
          tiles = triton.Tiles(block_q=opt[0], block_k=opt[1], num_warps=opt[2],
                               num_stages=opt[3])
          candidate = dataclasses.replace(base, **{"forward" if kind == "fwd" else "backward":
                                                   tiles})
          try:
            fn = attention_fn("jaxflash_triton", causal, config=candidate)
            if kind == "fwd":
              f, args = jax.jit(fn), (q, k, v)
            else:
              f, args = jax.jit(grad_fn(fn)), (q, k, v, d_out)
            ms = time_call(f, args, calls=10, repeats=3)
            err = None
          except Exception as e:  # noqa: BLE001 - configs that do not fit are skipped
            ms, err = None, repr(e)[:200]
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
