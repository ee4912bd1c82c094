"""Development probe: the Mosaic backward's tile variants at one shape, each checked and timed.

For shapes the tuner's grid does not hold (a value head dim of its own, as MLA's 192/128): which
`mosaic.Backward` to ship. On the GPU machine, from the repo root:

    PYTHONPATH=. python benchmarks/dev/backward_tiles.py --h 192 --dv 128 --heads 128 --seq 8192

Prints one line per variant: forward and forward+backward ms, the backward's TFLOP/s (its time is
fwd+bwd − fwd; 2·(3·H + 2·Dv) FLOPs per visible entry, as benchmarks/model_features.py counts),
and the relative error of dQ, dK and dV in K/V head 0's group against the float32 reference
(their gradients depend on those heads alone; ``--kv-heads`` for GQA). ``--out`` writes the rows as JSON; ``--smoke`` runs a tiny
shape in Mosaic GPU's interpreter (CI keeps it working). ``--block-fraction 0.1`` runs
benchmarks/masks.py's random block pattern instead of the causal band (FLOPs on its visible
entries), and ``--profile`` adds each kernel's GPU time per call (the forward, dQ and dK/dV
kernels are named in a profile):

    PYTHONPATH=. python benchmarks/dev/backward_tiles.py --h 128 --dv 128 --heads 16 \
        --seq 16384 --block-fraction 0.1 --variants shipped dq_kv128 --profile
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import grad_fn, mosaic_config, time_calls  # noqa: E402
from forward_tiles import (block_pattern, emit, parse_args, random_qkv,  # noqa: E402
                           write_rows)
from mask_parts import kernel_ms  # noqa: E402

from jaxflash.attention import attention_with_config  # noqa: E402
from jaxflash.reference import reference_attention  # noqa: E402

# `mosaic.Backward` fields over the shipped config's; "triton" runs the Triton backward.
VARIANTS = {
    "shipped": {},
    "r240": dict(registers=240),
    "joint_r240": dict(split_dkv=False, registers=240),
    # dK and dV in one pass with 32 streamed query rows: half the score tiles in registers.
    "joint_q32": dict(split_dkv=False, dkv_block_q=32),
    "joint_q32_r240": dict(split_dkv=False, dkv_block_q=32, registers=240),
    "dq_stages3": dict(dq_stages=3),
    "dkv_stages3": dict(dkv_stages=3),
    "dkv_stages4": dict(dkv_stages=4),
    "stages3": dict(dkv_stages=3, dq_stages=3),
    "dq_kv128": dict(dq_block_kv=128),
    "dq_stages4": dict(dq_stages=4),
    "dkv_q32": dict(dkv_block_q=32, dv_block_q=64),
    "dq_kv32": dict(dq_block_kv=32),
    # MLA's 192/128 (shipped: one pass on 32-row query tiles, 240 registers): dV, then dK, on
    # 64-row tiles, which ptxas compiles without spills since `backward._opaque_zero` (the dK
    # pass spilled 16 bytes before; 363 TFLOP/s against the one pass's 406 on 2026-11-24).
    "two_passes": dict(split_dkv=True, dkv_block_q=64, registers=232),
    "two_passes_r240": dict(split_dkv=True, dkv_block_q=64, registers=240),
    # A causal band's tiles launched by cost across every batch row and head, not head by head
    # (`Backward.tile_major`): GQA 64/8 at 8k has 512 dK/dV CTAs for 132 SMs.
    "tile_major": dict(tile_major=True),
    # dPᵀ issued once Pᵀ is formed, dSᵀ from the 16-bit Pᵀ (`Backward.serial_scores`): MLA's
    # one pass on 64-row query tiles (shipped since 2026-11-28: it spills 196 bytes, against
    # 264 without, and no longer serialises its wgmmas) or on 32-row ones; D = 128's dK/dV.
    "joint_q64_serial": dict(split_dkv=False, dkv_block_q=64, registers=240, serial_scores=True),
    "joint_q32_serial": dict(split_dkv=False, dkv_block_q=32, registers=240, serial_scores=True),
    "joint_q64_serial_stages3": dict(split_dkv=False, dkv_block_q=64, registers=240,
                                     serial_scores=True, dkv_stages=3),
    "serial": dict(serial_scores=True),
    # Both consumers on one 64-key tile in two roles (`Backward.shared_keys`): one holds dV and
    # forms Pᵀ, the other holds dK and forms dPᵀ and dSᵀ from the handed Pᵀ.
    "shared_keys": dict(shared_keys=True),
    "shared_keys_stages3": dict(shared_keys=True, dkv_stages=3),
    "shared_keys_q128": dict(shared_keys=True, dkv_block_q=128),
    # ... without dK's product issued with the next visit's dPᵀ (`Backward.shared_keys_overlap`,
    # shipped for 192/128 since 2026-12-02).
    "no_overlap": dict(shared_keys=True, shared_keys_overlap=False),
    # MLA's 192/128 tiles of 2026-11-28: the usual layout, 64-row query tiles, dPᵀ after Pᵀ.
    "usual_q64": dict(shared_keys=False, shared_keys_overlap=False, dkv_block_q=64),
    "triton": None,
}


def _relerr(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def main(argv=None) -> list[dict]:
  args = parse_args(__doc__, VARIANTS, "shipped", (192, 128), argv)
  b, s, n = args.batch, args.seq, args.heads
  q, k, v, d_out = random_qkv(args)
  pattern, reference, visible = block_pattern(args)
  causal = pattern.get("is_causal", False)
  # Query heads 0 ... G - 1 and the K/V head they share (MHA: G = 1): their gradients depend
  # on those heads alone.
  group = n // (args.kv_heads or n)
  heads = lambda x: x[:1, :, :group if x.shape[2] == n else 1].astype(jnp.float32)  # noqa: E731
  want = jax.jit(grad_fn(lambda q, k, v: reference_attention(q, k, v, **reference)[0]))(
      heads(q), heads(k), heads(v), heads(d_out))
  entries = b * n * visible
  bwd_flops = 2.0 * (3 * args.h + 2 * args.dv) * entries
  rows = []
  for name in args.variants:
    row = dict(variant=name, H=args.h, Dv=args.dv, N=n, K=args.kv_heads or n, S=s, B=b,
               causal=args.causal)
    try:
      config = mosaic_config(args.h, causal, s, groups=group, value_dim=args.dv,
                             interpret=args.smoke, backward=VARIANTS[name])
      fn = lambda q, k, v, config=config: attention_with_config(  # noqa: E731
          q, k, v, config=config, implementation="mosaic", interpret=args.smoke, **pattern)
      grads = grad_fn(fn)
      grads = grads if args.smoke else jax.jit(grads)  # (the interpreter runs eagerly)
      got = grads(q, k, v, d_out)
      row["relerr"] = {g: _relerr(heads(x), w) for g, x, w in zip(("dq", "dk", "dv"), got, want)}
      if not args.smoke:
        fwd_ms = time_calls(jax.jit(fn), (q, k, v))[0]
        total_ms = time_calls(grads, (q, k, v, d_out))[0]
        row.update(fwd_ms=round(fwd_ms, 4), fwdbwd_ms=round(total_ms, 4),
                   bwd_tflops=round(bwd_flops / (total_ms - fwd_ms) / 1e9, 1))
        if args.profile:
          row["kernels_ms"] = {name: round(ms, 4) for name, ms
                               in kernel_ms(grads, q, k, v, d_out).most_common(6)}
    except Exception as e:  # noqa: BLE001 (a variant that does not fit or lower: say why)
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    emit(rows, row)
  return write_rows(rows, args.out)


if __name__ == "__main__":
  main()
