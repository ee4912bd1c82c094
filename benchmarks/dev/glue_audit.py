"""The XLA work around jaxflash's kernels, read from a call's optimised HLO without a GPU.

Each case is compiled for a compile-only H100 (`ptxas_probe.aot_mesh`, the CUDA plugin needed;
run with ``JAX_PLATFORMS=cpu``) and every op of the entry computation is listed: the Mosaic
kernels, and the fusions, copies and transposes XLA adds between them (padding, layouts, the
atomic backward's zeroed sum and its conversion), with the bytes each reads and writes and the
time that takes at ``--bandwidth`` (a floor: an op runs below the card's copy rate). A gather
where a transpose would do, or a copy of a whole input, shows here before it costs GPU time
(the FP8 forward's V once took 195 us of a 2.4 ms call as a gather, 2026-11-28).

  JAX_PLATFORMS=cpu python benchmarks/dev/glue_audit.py --cases gqa_atomic fp8 mla
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

import jaxflash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ptxas_probe import H100_KIND, aot_mesh  # noqa: E402

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
          "s16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_SKIPPED = ("parameter", "get-tuple-element", "tuple", "constant", "bitcast")


class Case(NamedTuple):
  shapes: tuple  # (q, k, v) shapes; dtypes below
  fn: Callable  # (q, k, v) -> output, or `_vjp`'s (q, k, v, d_out) -> gradients
  dtype: object = jnp.bfloat16
  grad: bool = False


def _vjp(attend):
  """The gradients for a cotangent of the output's dtype passed in (as a training step has
  them: a constant one would be folded, or broadcast, into the program)."""
  def grads(q, k, v, d_out):
    return jax.vjp(attend, q, k, v)[1](d_out)
  return grads


def _fp8_call(q8, k8, v8):
  one = jnp.ones((q8.shape[0], k8.shape[2]), jnp.float32)  # per (batch row, K/V head)
  return jaxflash.flash_attention(q8, k8, v8, q_descale=jnp.ones((q8.shape[0], q8.shape[2])),
                                  k_descale=one, v_descale=one)


def _dense_mask(q, k, v, d_out):
  """A Flax-style dense causal mask [B, 1, T, S] instead of ``is_causal``."""
  t, keys = q.shape[1], k.shape[1]
  mask = jnp.tril(jnp.ones((t, keys), bool))[None, None]
  return _vjp(lambda q, k, v: jaxflash.dot_product_attention(q, k, v, mask=mask))(q, k, v, d_out)


def _decode(q, k, v):
  """One new token per row against a contiguous cache whose rows hold 3/4 of its length."""
  lengths = jnp.full((q.shape[0],), k.shape[1] * 3 // 4, jnp.int32)
  return jaxflash.decode_attention(q, k, v, lengths)


def _mla_decode(q, latent):
  """Absorbed MLA decoding on a latent cache (the Mosaic GPU kernel on Hopper): rows nearly
  full."""
  lengths = jnp.full((q.shape[0],), latent.shape[1] - 5, jnp.int32)
  return jaxflash.decode_attention(q, latent, None, lengths, value_head_dim=512)


CASES = {
    "mha_fwd": Case(((1, 16384, 16, 128),) * 3,
                    lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=True)),
    "gqa": Case(((1, 8192, 64, 128), (1, 8192, 8, 128), (1, 8192, 8, 128)),
                _vjp(lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=True)),
                grad=True),
    "gqa_atomic": Case(((1, 8192, 64, 128), (1, 8192, 8, 128), (1, 8192, 8, 128)),
                       _vjp(lambda q, k, v: jaxflash.flash_attention(
                           q, k, v, is_causal=True, deterministic=False)), grad=True),
    "d96": Case(((4, 4096, 16, 96),) * 3,
                _vjp(lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=True)),
                grad=True),
    "mla": Case(((1, 8192, 128, 192), (1, 8192, 128, 192), (1, 8192, 128, 128)),
                _vjp(lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=True)),
                grad=True),
    "sinks": Case(((1, 16384, 64, 64), (1, 16384, 8, 64), (1, 16384, 8, 64)),
                  _vjp(lambda q, k, v: jaxflash.flash_attention(
                      q, k, v, is_causal=True, local_window_size=(128, 0),
                      sinks=jnp.zeros((64,), jnp.float32))), grad=True),
    "fp8": Case(((1, 16384, 16, 128),) * 3, _fp8_call, jnp.float8_e4m3fn),
    "dense_mask": Case(((2, 4096, 16, 128),) * 3, _dense_mask, grad=True),
    "mla_decode": Case(((32, 1, 16, 576), (32, 8192, 1, 576)), _mla_decode),
    "mla_decode_t2": Case(((32, 2, 16, 576), (32, 8192, 1, 576)), _mla_decode),
    "decode": Case(((32, 1, 32, 128), (32, 8192, 8, 128), (32, 8192, 8, 128)), _decode),
}


def array_bytes(text: str) -> int:
  """Bytes of every array in an HLO shape (a tuple's elements summed)."""
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    count = 1
    for d in filter(None, dims.split(",")):
      count *= int(d)
    total += count * _BYTES[dtype]
  return total


def entry_ops(hlo: str) -> list[dict]:
  """The entry computation's ops but parameters, tuples and constants: ``name``, ``kind`` (the
  opcode; a custom call's kernel name; a fusion's name), ``kernel`` (a custom call), ``shape``
  and the bytes it reads and writes."""
  entry = hlo[hlo.index("\nENTRY"):]
  entry = entry[:entry.index("\n}\n")]
  shapes, ops = {}, []
  for line in entry.splitlines()[1:]:
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)", line)
    if not m:
      continue
    name, shape, opcode, rest = m.groups()
    shapes[name] = shape
    if opcode in _SKIPPED:
      continue
    operands = re.findall(r"%([\w.\-]+)", rest.split("),")[0])
    kind, kernel = opcode, opcode == "custom-call"
    if kernel:  # (a Mosaic GPU or Triton kernel: the name jaxflash gives it)
      named = re.search(r"(jaxflash_\w+)", line)
      kind = named.group(1) if named else opcode
    elif opcode == "fusion":
      kind = name
    ops.append(dict(name=name, kind=kind, kernel=kernel, shape=shape,
                    read=sum(array_bytes(shapes.get(o, "")) for o in operands),
                    written=array_bytes(shape)))
  return ops


def compiled_hlo(case: Case) -> str:
  from jax.sharding import NamedSharding, PartitionSpec
  sharding = NamedSharding(aot_mesh(), PartitionSpec())
  args = [jax.ShapeDtypeStruct(s, case.dtype, sharding=sharding) for s in case.shapes]
  if case.grad:  # (d_out: the query's shape with the value's head dim)
    args.append(jax.ShapeDtypeStruct(case.shapes[0][:3] + case.shapes[2][3:], case.dtype,
                                     sharding=sharding))
  device = jax.sharding.AbstractDevice(device_kind=H100_KIND, platform="gpu", num_cores=132)
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
    lowered = jax.jit(case.fn).trace(*args).lower(lowering_platforms=("cuda",))
  return lowered.compile().as_text()


def main(argv: list[str] | None = None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
  parser.add_argument("--bandwidth", type=float, default=3.0, help="TB/s for the time column")
  args = parser.parse_args(argv)
  rows = []
  for name in args.cases:
    ops = entry_ops(compiled_hlo(CASES[name]))
    print(f"== {name}")
    for op in ops:
      moved = (op["read"] + op["written"]) / 1e6
      kernel = op["kernel"]
      print(f"  {'kernel' if kernel else 'xla   '} {op['kind'][:44]:44s} {op['shape'][:60]:60s} "
            f"{moved:9.1f} MB  {'' if kernel else f'~{moved / args.bandwidth:6.1f} us'}")
      rows.append(dict(case=name, **op))
  return rows


if __name__ == "__main__":
  main()
