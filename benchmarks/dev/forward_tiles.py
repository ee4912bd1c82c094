"""Development probe: the Mosaic forward's tile variants at one shape, each checked and timed.

For shapes the tuner's grid does not hold (a value head dim of its own, as MLA's 192/128): which
`mosaic.Config` to ship. On the GPU machine, from the repo root:

    PYTHONPATH=. python benchmarks/dev/forward_tiles.py --h 192 --dv 128 --heads 128 --seq 8192

Prints one line per config (ms, TFLOP/s on visible entries with 2·(H + Dv) FLOPs per entry,
relative error of the first and last (batch row, head) against the float32 reference) and
writes them as JSON with --out. ``--smoke`` runs a tiny shape in Mosaic GPU's interpreter
(CI keeps it working).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cases import time_calls  # noqa: E402

import jaxflash  # noqa: E402
from jaxflash.attention import attention_with_config  # noqa: E402
from jaxflash.backends import mosaic  # noqa: E402
from jaxflash.reference import reference_attention  # noqa: E402

VARIANTS = {
    "kv128": dict(block_kv=128),
    "kv64": dict(block_kv=64),
    "kv128_overlap": dict(block_kv=128, intra_wg_overlap=True),
    "kv64_overlap": dict(block_kv=64, intra_wg_overlap=True),
    "kv128_stages3": dict(block_kv=128, num_stages=3),
    "kv64_overlap_persistent": dict(block_kv=64, intra_wg_overlap=True, persistent_ctas=132),
    "kv128_persistent": dict(block_kv=128, persistent_ctas=132),
    "kv128_overlap_persistent": dict(block_kv=128, intra_wg_overlap=True, persistent_ctas=132),
    "kv128_overlap_persistent_q2": dict(block_kv=128, intra_wg_overlap=True, persistent_ctas=132,
                                        q_buffers=2),
    "kv64_overlap_persistent_q2": dict(block_kv=64, intra_wg_overlap=True, persistent_ctas=132,
                                       q_buffers=2),
    # Where V's head dim is below Q's, O leaves through the Q tiles' memory (`o_view`):
    # at 192/128 the room that frees takes 128-key tiles (above), or a deeper ring of 64-key ones.
    "kv64_overlap_stages4": dict(block_kv=64, intra_wg_overlap=True, num_stages=4),
    # Part of each block's exponentials by the polynomial on the FMA units
    # (`Config.exp2_poly_cols`): the D = 64 tiles (`TUNED`'s) and D = 128's with the overlap,
    # next to the same tiles without it.
    "kv256_persistent": dict(block_kv=256, persistent_ctas=132),
    "kv128_persistent_q2": dict(block_kv=128, persistent_ctas=132, q_buffers=2),
    "kv256_persistent_poly32": dict(block_kv=256, persistent_ctas=132, exp2_poly_cols=32),
    "kv256_persistent_poly64": dict(block_kv=256, persistent_ctas=132, exp2_poly_cols=64),
    "kv128_persistent_q2_poly16": dict(block_kv=128, persistent_ctas=132, q_buffers=2,
                                       exp2_poly_cols=16),
    "kv128_overlap_poly16": dict(block_kv=128, intra_wg_overlap=True, exp2_poly_cols=16),
    "kv128_overlap_poly32": dict(block_kv=128, intra_wg_overlap=True, exp2_poly_cols=32),
    # Persistent grids whose CTAs take a head's query tiles in pairs of equal causal work
    # (`Config.paired_tiles`), and whose O leaves through the Q tile (`Config.o_through_q`:
    # what MLA's 128-key tiles need to fit on one).
    "kv128_overlap_persistent_oq": dict(block_kv=128, intra_wg_overlap=True, persistent_ctas=132,
                                        o_through_q=True),
    "kv128_overlap_persistent_paired": dict(block_kv=128, intra_wg_overlap=True,
                                            persistent_ctas=132, paired_tiles=True,
                                            o_through_q=True),
    "kv128_overlap_persistent_paired_own_o": dict(block_kv=128, intra_wg_overlap=True,
                                                  persistent_ctas=132, paired_tiles=True),
    "kv128_persistent_paired": dict(block_kv=128, persistent_ctas=132, paired_tiles=True,
                                    o_through_q=True),
    "kv128_persistent_q2_paired": dict(block_kv=128, persistent_ctas=132, q_buffers=2,
                                       paired_tiles=True),
    # Three consumer warpgroups of 64 rows at 160 registers (`Config.consumers`):
    # FlashAttention-3's D = 64 layout.
    "c3_kv128": dict(consumers=3, registers=160, block_kv=128),
    # The same with a block's first 16 or 32 columns' exponentials by the polynomial: with three
    # consumers the exp units, not one warp's latency, may be what a D = 64 block waits on.
    "c3_kv128_poly16": dict(consumers=3, registers=160, block_kv=128, exp2_poly_cols=16),
    "c3_kv128_poly32": dict(consumers=3, registers=160, block_kv=128, exp2_poly_cols=32),
    "c3_kv64": dict(consumers=3, registers=160, block_kv=64),
    "c3_kv128_persistent": dict(consumers=3, registers=160, block_kv=128, persistent_ctas=132),
    "c3_kv128_overlap": dict(consumers=3, registers=160, block_kv=128, intra_wg_overlap=True),
    "c3_kv128_persistent_q2": dict(consumers=3, registers=160, block_kv=128, persistent_ctas=132,
                                   q_buffers=2),
    "c3_kv128_persistent_q2_paired": dict(consumers=3, registers=160, block_kv=128,
                                          persistent_ctas=132, q_buffers=2, paired_tiles=True),
    # MLA's 192/128 on three consumers: 64-key tiles (128-key ones leave no shared memory).
    "c3_kv64_stages3": dict(consumers=3, registers=160, block_kv=64, num_stages=3),
    "c3_kv64_overlap": dict(consumers=3, registers=160, block_kv=64, intra_wg_overlap=True),
    # Pairs of query tiles as clusters of two CTAs sharing each K/V tile's load by TMA multicast
    # (`Config.kv_multicast`; no band only): `TUNED`'s tiles at D = 128 (persistent), D = 256
    # and MLA's 192/128 without a band, each with it.
    "kv128_overlap_persistent_mc": dict(block_kv=128, intra_wg_overlap=True,
                                        persistent_ctas=132, kv_multicast=True),
    "kv128_overlap_mc": dict(block_kv=128, intra_wg_overlap=True, kv_multicast=True),
    "kv64_overlap_mc": dict(block_kv=64, intra_wg_overlap=True, kv_multicast=True),
    "kv128_mc": dict(block_kv=128, kv_multicast=True),
    "kv256_persistent_mc": dict(block_kv=256, persistent_ctas=132, kv_multicast=True),
    "c3_kv128_mc": dict(consumers=3, registers=160, block_kv=128, kv_multicast=True),
    # D = 128's persistent tiles with the next item's Q loading into a second buffer.
    "kv128_overlap_persistent_mc_q2": dict(block_kv=128, intra_wg_overlap=True,
                                           persistent_ctas=132, kv_multicast=True, q_buffers=2),
    # D = 64's 256-key persistent tiles without a band (`TUNED` below 2k rows), the same way.
    "kv256_persistent_q2": dict(block_kv=256, persistent_ctas=132, q_buffers=2),
}


def parse_args(doc: str, variants: dict, smoke_variant: str, smoke_dims: tuple[int, int],
               argv=None) -> argparse.Namespace:
  """The probes' arguments: one shape (head dims, heads, length, batch, band), the variants to
  run, ``--smoke`` (a tiny shape at ``smoke_dims`` and ``smoke_variant`` in the interpreter)
  and ``--out``."""
  parser = argparse.ArgumentParser(description=doc.split("\n")[0])
  parser.add_argument("--h", type=int, default=192)
  parser.add_argument("--dv", type=int, default=128)
  parser.add_argument("--heads", type=int, default=128)
  parser.add_argument("--kv-heads", type=int,
                      help="K/V heads (GQA: a divisor of --heads); default: --heads (MHA)")
  parser.add_argument("--seq", type=int, default=8192)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--no-causal", dest="causal", action="store_false")
  parser.add_argument("--block-fraction", type=float,
                      help="a random pattern of 128 x 128 blocks with this fraction visible "
                           "(benchmarks/masks.py's block cases and seed), given as a block "
                           "mask, with no causal band")
  parser.add_argument("--documents", type=int,
                      help="packed documents instead: benchmarks/masks.py's documents_N case "
                           "(its lengths and seed), given as segment ids with a causal band")
  parser.add_argument("--profile", action="store_true",
                      help="also each kernel's GPU time per call (a profile)")
  parser.add_argument("--variants", nargs="+", default=list(variants), choices=list(variants))
  parser.add_argument("--smoke", action="store_true")
  parser.add_argument("--out", type=Path)
  args = parser.parse_args(argv)
  if args.smoke:
    (args.h, args.dv), args.heads, args.seq, args.variants = smoke_dims, 2, 70, [smoke_variant]
  return args


def block_pattern(args: argparse.Namespace) -> tuple[dict, dict, float]:
  """What ``--block-fraction`` or ``--documents`` asks for: the attention call's keyword
  arguments (a block mask, segment ids and the band, or the causal band), the reference's (the
  dense mask [1, 1, S, S], or the band) and the visible (query, key) entries of one batch row
  and head."""
  s = args.seq
  if args.documents:
    import masks  # (benchmarks/masks.py: the documents cases' lengths and seed)
    seed = masks.CASES.index(f"documents_{args.documents}")
    doc = np.asarray(masks.document_ids(s, args.documents, seed))
    dense = (doc[:, None] == doc[None, :]) & np.tri(s, dtype=bool)
    ids = jnp.asarray(np.tile(doc, (args.batch, 1)), jnp.int32)
    return (dict(segment_ids=ids, is_causal=True), dict(mask=jnp.asarray(dense)[None, None]),
            float(dense.sum()))
  if args.block_fraction is None:
    band = dict(is_causal=args.causal)
    return band, band, s * (s + 1) / 2 if args.causal else s * s
  import masks  # (benchmarks/masks.py: the block cases' pattern and seed)
  blocks = -(-s // 128)
  seed = masks.CASES.index("block_10pct")
  visible = jnp.asarray(masks.block_pattern(blocks, args.block_fraction, seed))[None, None]
  dense = jnp.repeat(jnp.repeat(visible, 128, 2), 128, 3)[..., :s, :s]
  block_mask = jaxflash.BlockMask.from_blocks(visible, s, s)
  return dict(block_mask=block_mask), dict(mask=dense), float(dense.sum())


def emit(rows: list, row: dict) -> None:
  """Keeps one of a probe's rows and prints it at once (a long run shows its progress)."""
  rows.append(row)
  print(json.dumps(row), flush=True)


def write_rows(rows: list, out: Path | None) -> list:
  """A probe's rows, written as JSON to ``out`` where given."""
  if out:
    out.write_text(json.dumps(rows, indent=1) + "\n")
  return rows


def random_qkv(args: argparse.Namespace):
  """bf16 q, k, v of the shape ``args`` names, and a float32 cotangent of the output's."""
  b, s, n = args.batch, args.seq, args.heads
  kv_heads = args.kv_heads or n
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, s, n, args.h), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, s, kv_heads, args.h), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, s, kv_heads, args.dv), jnp.bfloat16)
  return q, k, v, jax.random.normal(keys[3], (b, s, n, args.dv), jnp.float32)


def main(argv=None) -> list[dict]:
  args = parse_args(__doc__, VARIANTS, "kv64", (64, 32), argv)
  b, s, n = args.batch, args.seq, args.heads
  q, k, v, _ = random_qkv(args)
  pattern, reference, visible = block_pattern(args)
  # The first and the last (batch row, head): a CTA that ran the wrong tiles shows in either.
  # (Query head 0 reads K/V head 0 under GQA too, the last query head the last K/V head.)
  ends = lambda x: jnp.concatenate([x[:1, :, :1], x[-1:, :, -1:]], axis=2)
  want, _ = reference_attention(ends(q), ends(k), ends(v), **reference)
  entries = b * n * visible
  flops = 2.0 * (args.h + args.dv) * entries
  rows = []
  for name in args.variants:
    row = dict(variant=name, H=args.h, Dv=args.dv, N=n, K=args.kv_heads or n, S=s, B=b,
               causal=args.causal)
    try:
      config = dataclasses.replace(mosaic.Config(), **VARIANTS[name])
      fn = jax.jit(lambda q, k, v, config=config: attention_with_config(
          q, k, v, config=config, implementation="mosaic", interpret=args.smoke, **pattern))
      got = np.asarray(ends(fn(q, k, v)), np.float64)
      err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
      ms = time_calls(fn, (q, k, v))[0] if not args.smoke else 0.0
      row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1) if ms else None,
                 relerr=err)
    except Exception as e:  # noqa: BLE001 (a config that does not fit or lower: say why)
      row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    emit(rows, row)
  return write_rows(rows, args.out)


if __name__ == "__main__":
  main()
