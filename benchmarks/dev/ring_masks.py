"""Development probe: what a mask costs ring attention, against the whole call on one device.

Ring attention gives each (query chunk, key chunk) pair its own block table (segment ids) and,
with a ``mask_mod``, its own table and features, evaluated over the pair's entries in the
forward and again in the backward. With the sequence split over all devices of the machine
(one on a one-GPU machine: a ring of one step, whose pair is the whole call), this times
`jaxflash.ring_attention` given packed documents as ``segment_ids`` (with ``is_causal``) and as
a ``mask_mod``, next to `jaxflash.flash_attention` on the whole sequence with the same
segment ids and with a block mask built once outside the timed call; outputs are checked
against each other. bf16, B = 1, D = 128, masks.py's documents cases (lengths and seed).

    PYTHONPATH=.:benchmarks python benchmarks/dev/ring_masks.py [--seq 16384] [--documents 8 64]

Prints one JSON line per (documents, call, mode) with ms, and the relative difference of the
output from the whole call's; ``--out`` writes them all. ``--smoke``: a tiny run on the CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import masks  # noqa: E402  (the documents cases' lengths and seed)
from cases import time_calls  # noqa: E402
from forward_tiles import emit, write_rows  # noqa: E402

import jaxflash  # noqa: E402


def calls(doc: jax.Array, mesh, interpret: bool) -> dict:
  """name -> (forward function of (q, k, v), what it is given)."""
  def document_mod(b, h, q, kv):
    return (doc[b, q] == doc[b, kv]) & (q >= kv)

  s = doc.shape[1]
  block_mask = jaxflash.create_block_mask(document_mod, doc.shape[0], None, s, s)
  implementation = "xla" if interpret else None

  def ring(**options):
    def local(q, k, v, *ids):
      extra = dict(segment_ids=ids[0]) if ids else {}
      return jaxflash.ring_attention(q, k, v, axis_name="sp", implementation=implementation,
                                     **options, **extra)
    specs = P(None, "sp")

    def fn(q, k, v):
      ids = (doc,) if "mask_mod" not in options else ()
      return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs)(q, k, v, *ids)
    return fn

  return {
      "flash_segments": (lambda q, k, v: jaxflash.flash_attention(
          q, k, v, is_causal=True, segment_ids=doc, implementation=implementation,
          interpret=interpret), "flash_attention(segment_ids, is_causal)"),
      "flash_block_mask": (lambda q, k, v: jaxflash.flash_attention(
          q, k, v, block_mask=block_mask, implementation=implementation, interpret=interpret),
          "flash_attention(block_mask built outside)"),
      "ring_segments": (ring(is_causal=True), "ring_attention(segment_ids, is_causal)"),
      "ring_mask_mod": (ring(mask_mod=document_mod), "ring_attention(mask_mod)"),
  }


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seq", type=int, default=16384)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--documents", type=int, nargs="+", default=[8, 64])
  parser.add_argument("--smoke", action="store_true")
  parser.add_argument("--out", type=Path)
  args = parser.parse_args(argv)
  if args.smoke:
    args.seq, args.heads, args.documents = 256, 2, [8]
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
  s, n, d = args.seq, args.heads, 32 if args.smoke else 128
  keys = jax.random.split(jax.random.key(0), 4)
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  q, k, v = (jax.random.normal(key, (1, s, n, d), dtype) for key in keys[:3])
  d_out = jax.random.normal(keys[3], (1, s, n, d), dtype)
  sharded = NamedSharding(mesh, P(None, "sp"))
  q, k, v, d_out = (jax.device_put(x, sharded) for x in (q, k, v, d_out))
  rows = []
  for documents in args.documents:
    seed = masks.CASES.index(f"documents_{documents}")
    doc = jnp.asarray(masks.document_ids(s, documents, seed)[None], jnp.int32)
    made = calls(doc, mesh, args.smoke)

    def build(doc):  # (what ring_mask_mod's pair makes, at create_block_mask's 128 blocks)
      return jaxflash.create_block_mask(
          lambda b, h, q, kv: (doc[b, q] == doc[b, kv]) & (q >= kv), 1, None, s, s).table
    ms = time_calls(jax.jit(build), (doc,))[0] if not args.smoke else 0.0
    emit(rows, dict(documents=documents, call="create_block_mask", mode="build",
                    ms=round(ms, 4), S=s))
    outs = {}
    for name, (fn, via) in made.items():
      forward = jax.jit(fn)

      def fwd_bwd(q, k, v, fn=fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return vjp(d_out)
      timed = {"fwd": forward, "fwdbwd": jax.jit(fwd_bwd)}
      outs[name] = np.asarray(forward(q, k, v), np.float32)
      diff = float(np.linalg.norm(outs[name] - outs["flash_segments"])
                   / np.linalg.norm(outs["flash_segments"]))
      for mode, call in timed.items():
        ms = time_calls(call, (q, k, v))[0] if not args.smoke else 0.0
        row = dict(documents=documents, call=name, via=via, mode=mode, ms=round(ms, 4),
                   devices=len(devices), S=s, N=n, D=d, reldiff=diff)
        emit(rows, row)
  return write_rows(rows, args.out)


if __name__ == "__main__":
  main()
