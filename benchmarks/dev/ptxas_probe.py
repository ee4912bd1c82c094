"""What ptxas makes of the Mosaic GPU kernels: per config, each kernel's registers, spills and
stack frame, its machine code's size (`code_bytes`), and ptxas's warnings and notes (a
serialised wgmma shows there as C7513).

It runs on any machine with the CUDA plugin and the CUDA toolkit's ``ptxas`` on PATH. Where no
GPU is attached (``--aot``, the default where ``nvidia-smi`` is missing) each config is compiled
ahead of time for a compile-only H100 (`aot_mesh`: XLA's deviceless compilation from a target
config), and Mosaic GPU runs the same pipeline to PTX and the same ptxas as on the GPU machine;
ptxas targets sm_90a either way, so an H200's numbers are the same. On a GPU machine each config
is compiled and run once. Each config compiles in its own process with Mosaic GPU's dump
variables pointing at ``--dumps``/<name>; ``--out`` receives ``summary.txt`` (the summary, then
each config's ptxas report), a ``<name>.ptx`` for each config named in ``--ptx`` and a
``<name>.sass`` for each named in ``--sass`` (Mosaic GPU runs ``nvdisasm`` from its CUDA root,
``MOSAIC_GPU_CUDA_ROOT``, /usr/local/cuda by default; PyPI's ``nvidia-cuda-nvdisasm`` has it):

  python3 benchmarks/dev/ptxas_probe.py --out /tmp/probe --configs mla_kv128_overlap --ptx ...
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple


class Probe(NamedTuple):
  head_dim: int
  causal: bool
  fields: dict  # mosaic.Config's (``backward``: mosaic.Backward's, as a dict)
  value_dim: int | None = None  # V's head dim, where not the query's
  deterministic: bool = True  # False: the call allows the atomic backward (`Backward.atomic`)
  kv_heads: int = 8  # K/V heads (of 8 query heads: GQA below 8)
  per_token: bool = False  # an FP8 call with one query and key descale per token


# name -> Probe. Names starting ``fp8_`` take e4m3 inputs (no descales); names starting ``bwd_``
# compile the gradient (the forward, dQ and dK/dV kernels), the others the forward alone.
CONFIGS = {
    "d128": Probe(128, False, {}),
    "d128_overlap": Probe(128, False, dict(intra_wg_overlap=True)),
    "d128_persistent": Probe(128, False, dict(persistent_ctas=132)),
    "d128_overlap_persistent": Probe(128, False, dict(intra_wg_overlap=True,
                                                      persistent_ctas=132)),
    "d256_kv64": Probe(256, False, dict(block_kv=64)),
    "d256_kv64_overlap": Probe(256, False, dict(block_kv=64, intra_wg_overlap=True)),
    "d64": Probe(64, False, {}),
    "d64_overlap": Probe(64, False, dict(intra_wg_overlap=True)),
    "d64_kv256_persistent": Probe(64, False, dict(block_kv=256, persistent_ctas=132)),
    # `TUNED`'s D = 64 tiles without a band (below 2k rows on an H200): two Q buffers.
    "d64_kv256_persistent_q2": Probe(64, False, dict(block_kv=256, persistent_ctas=132,
                                                     q_buffers=2)),
    # Part of each block's exponentials by the polynomial (`Config.exp2_poly_cols`).
    "d64_kv256_persistent_poly32": Probe(64, False, dict(block_kv=256, persistent_ctas=132,
                                                         exp2_poly_cols=32)),
    "d64_kv256_persistent_poly64": Probe(64, False, dict(block_kv=256, persistent_ctas=132,
                                                         exp2_poly_cols=64)),
    "d128_overlap_poly16": Probe(128, True, dict(intra_wg_overlap=True, exp2_poly_cols=16)),
    # MLA's 192/128 forward: 64-key tiles, and the shipped 128-key ones (they fit because O
    # leaves through the Q tiles' memory, `o_view`).
    "mla_kv64_overlap": Probe(192, True, dict(block_kv=64, intra_wg_overlap=True), 128),
    "mla_kv128": Probe(192, True, dict(block_kv=128), 128),
    "mla_kv128_overlap": Probe(192, True, dict(block_kv=128, intra_wg_overlap=True), 128),
    # The FP8 forward.
    "fp8_d128_kv128": Probe(128, False, dict(block_kv=128)),
    "fp8_d128_kv256": Probe(128, False, dict(block_kv=256)),
    "fp8_d128_kv128_overlap": Probe(128, False, dict(block_kv=128, intra_wg_overlap=True)),
    "fp8_d128_kv256_poly32": Probe(128, False, dict(block_kv=256, exp2_poly_cols=32)),
    "fp8_d128_kv256_poly64": Probe(128, False, dict(block_kv=256, exp2_poly_cols=64)),
    "fp8_d256_kv64_overlap": Probe(256, False, dict(block_kv=64, intra_wg_overlap=True)),
    # 128-key tiles at D = 256 fit since an FP8 call's O leaves through the Q tiles in two
    # column pieces (`o_view`); FlashAttention-3's FP8 tile there, with the overlap.
    "fp8_d256_kv128": Probe(256, False, dict(block_kv=128)),
    "fp8_d256_kv128_overlap": Probe(256, False, dict(block_kv=128, intra_wg_overlap=True)),
    "fp8_d256_kv128_overlap_r240": Probe(256, False, dict(block_kv=128, intra_wg_overlap=True,
                                                          registers=240)),
    "fp8_d256_kv128_r240": Probe(256, False, dict(block_kv=128, registers=240)),
    "fp8_d256_kv128_overlap_r240_causal": Probe(256, True, dict(
        block_kv=128, intra_wg_overlap=True, registers=240)),
    "fp8_d128_kv256_token": Probe(128, False, dict(block_kv=256), per_token=True),
    "fp8_d128_kv128_token": Probe(128, False, dict(block_kv=128), per_token=True),
    "fp8_d256_kv128_overlap_r240_token": Probe(256, False, dict(
        block_kv=128, intra_wg_overlap=True, registers=240), per_token=True),
    "fp8_d128_kv256_stages3": Probe(128, False, dict(block_kv=256, num_stages=3)),
    # FP8_TUNED at D = 128: the row sums on the tensor cores, persistent without a causal band.
    "fp8_d128_shipped": Probe(128, False, dict(block_kv=256, mma_row_sums=True,
                                                persistent_ctas=132)),
    "fp8_d128_shipped_causal": Probe(128, True, dict(block_kv=256, mma_row_sums=True)),
    "fp8_d128_shipped_token": Probe(128, False, dict(block_kv=256, mma_row_sums=True,
                                                      persistent_ctas=132), per_token=True),
    # Three consumer warpgroups (`Config.consumers`) at 160 registers: FP8 at D = 128 and bf16
    # at D = 64 (FlashAttention-3's D = 64 layout), 64- and 128-key tiles.
    "fp8_d128_c3_kv64": Probe(128, False, dict(consumers=3, registers=160, block_kv=64,
                                                mma_row_sums=True)),
    "fp8_d128_c3_kv128": Probe(128, False, dict(consumers=3, registers=160, block_kv=128,
                                                 mma_row_sums=True)),
    "fp8_d128_c3_kv128_causal": Probe(128, True, dict(consumers=3, registers=160, block_kv=128,
                                                       mma_row_sums=True)),
    # The same with a block's first columns' exponentials by the polynomial (FMA units).
    "fp8_d128_c3_kv128_poly16": Probe(128, False, dict(consumers=3, registers=160, block_kv=128,
                                                        mma_row_sums=True, exp2_poly_cols=16)),
    "fp8_d128_c3_kv128_poly32": Probe(128, False, dict(consumers=3, registers=160, block_kv=128,
                                                        mma_row_sums=True, exp2_poly_cols=32)),
    "d64_c3_kv128": Probe(64, False, dict(consumers=3, registers=160, block_kv=128)),
    "d64_c3_kv128_causal": Probe(64, True, dict(consumers=3, registers=160, block_kv=128)),
    # 192-key tiles (64-byte swizzled V rows) with FlashAttention-3's overlap.
    "fp8_d128_kv192_overlap_r240_sums": Probe(128, False, dict(
        block_kv=192, intra_wg_overlap=True, registers=240, mma_row_sums=True)),
    "fp8_d128_kv192_overlap_r240": Probe(128, False, dict(block_kv=192, intra_wg_overlap=True,
                                                          registers=240)),
    "fp8_d128_kv192_sums": Probe(128, False, dict(block_kv=192, mma_row_sums=True)),
    # `TUNED`'s D = 128 tiles without a band (pairs sharing K/V on a persistent grid), with two Q
    # buffers (shipped) and with one.
    "d128_overlap_persistent_mc_q2": Probe(128, False, dict(
        intra_wg_overlap=True, persistent_ctas=132, kv_multicast=True, q_buffers=2)),
    "d128_overlap_persistent_mc": Probe(128, False, dict(
        intra_wg_overlap=True, persistent_ctas=132, kv_multicast=True)),
    # The backward.
    "bwd_d64": Probe(64, True, dict(backward=dict(dkv_block_q=128, dq_block_kv=128))),
    "bwd_d128": Probe(128, True, {}),
    "bwd_d128_q128": Probe(128, True, dict(backward=dict(dkv_block_q=128))),
    "bwd_d128_kv128": Probe(128, True, dict(backward=dict(dq_block_kv=128))),
    "bwd_d128_r240": Probe(128, True, dict(backward=dict(registers=240))),
    "bwd_d128_full": Probe(128, False, {}),
    # dQ from the dK/dV kernel (`Backward.one_pass`): on a GPU these compile and then run once,
    # and the one pass can hang there (see backward._DqPart).
    "bwd_d64_one_pass": Probe(64, True, dict(backward=dict(dkv_block_q=128, dq_block_kv=128,
                                                           one_pass=True))),
    "bwd_d128_one_pass": Probe(128, True, dict(backward=dict(one_pass=True))),
    "bwd_d128_one_pass_r240": Probe(128, True, dict(backward=dict(one_pass=True,
                                                                  registers=240))),
    # Head dims above 128: dK/dV in two passes; at 256, 32-row streamed tiles, with a 64-row dV
    # pass or 240 consumer registers.
    "bwd_d192": Probe(192, True, dict(block_kv=64)),
    "bwd_d256": Probe(256, True, dict(block_kv=64, backward=dict(dkv_block_q=32,
                                                                 dq_block_kv=32))),
    "bwd_d256_dv64": Probe(256, True, dict(block_kv=64, backward=dict(
        dkv_block_q=32, dq_block_kv=32, dv_block_q=64))),
    "bwd_d256_r240": Probe(256, True, dict(block_kv=64, backward=dict(
        dkv_block_q=32, dq_block_kv=32, registers=240))),
    # D = 256's atomic backward: the dV pass, then a dK pass that forms dQ too (transposed
    # parts, `mosaic.config.dq_split`), as shipped (240 registers) and at 232.
    "bwd_d256_atomic": Probe(256, True, dict(block_kv=64, backward=dict(
        dkv_block_q=32, dq_block_kv=32, dv_block_q=64, registers=240, atomic=True)),
        deterministic=False),
    "bwd_d256_atomic_r232": Probe(256, True, dict(block_kv=64, backward=dict(
        dkv_block_q=32, dq_block_kv=32, dv_block_q=64, atomic=True)), deterministic=False),
    # D = 128's atomic one pass on 32-row query tiles (transposed dQ parts), untimed.
    "bwd_d128_atomic_q32": Probe(128, True, dict(backward=dict(
        dkv_block_q=32, atomic=True, registers=240)), deterministic=False),
    # The atomic one pass (``deterministic=False``), with the causal band or without.
    "bwd_d128_atomic": Probe(128, True, dict(backward=dict(atomic=True)), deterministic=False),
    "bwd_d128_atomic_r240": Probe(128, True, dict(backward=dict(atomic=True, registers=240)),
                                  deterministic=False),
    "bwd_d128_atomic_full": Probe(128, False, dict(backward=dict(atomic=True)),
                                  deterministic=False),
    # GQA (8 query heads a K/V head): the shipped tiles (`GQA_BACKWARD`'s 240 registers without a
    # causal band) and the atomic one pass.
    "bwd_d128_gqa": Probe(128, True, {}, kv_heads=1),
    "bwd_d128_gqa_full_r240": Probe(128, False, dict(backward=dict(registers=240)), kv_heads=1),
    "bwd_d128_gqa_atomic": Probe(128, True, dict(backward=dict(atomic=True)),
                                 deterministic=False, kv_heads=1),
    "bwd_d128_gqa_atomic_r240": Probe(128, True, dict(backward=dict(atomic=True, registers=240)),
                                      deterministic=False, kv_heads=1),
    "bwd_d64_atomic": Probe(64, True, dict(backward=dict(dkv_block_q=128, dq_block_kv=128,
                                                         atomic=True)), deterministic=False),
    # Tiles launched by cost across every (batch row, head) (`Backward.tile_major`).
    "bwd_d128_tile_major": Probe(128, True, dict(backward=dict(tile_major=True))),
    "bwd_d128_gqa_atomic_tile_major": Probe(128, True, dict(backward=dict(atomic=True,
                                                                          tile_major=True)),
                                            deterministic=False, kv_heads=1),
    "bwd_d128_gqa_tile_major": Probe(128, True, dict(backward=dict(tile_major=True)),
                                     kv_heads=1),
    # The shipped GQA causal tiles under deterministic=False: the one pass on 240 registers
    # (`ATOMIC_TUNED`), each group over four CTAs per key tile launched head by head
    # (`GQA_BACKWARD`, since 2026-11-28; tile-major with one part before). Both spill 16 bytes
    # (24 at 232 registers), where the MHA one pass spills nothing.
    "bwd_d128_gqa_atomic_shipped": Probe(128, True, dict(backward=dict(
        atomic=True, atomic_registers=240, tile_major=True, atomic_tile_major=False,
        atomic_group_parts=4)), deterministic=False, kv_heads=1),
    "bwd_d128_gqa_atomic_tile_major_r240": Probe(128, True, dict(backward=dict(
        atomic=True, atomic_registers=240, tile_major=True)), deterministic=False, kv_heads=1),
    # dV's, dQ's, then dK's product, the dQ part sent while dK's runs (`Backward.dq_before_dk`).
    "bwd_d128_atomic_dq_first": Probe(128, True, dict(backward=dict(
        atomic=True, atomic_registers=240, dq_before_dk=True)), deterministic=False),
    "bwd_d128_atomic_full_dq_first": Probe(128, False, dict(backward=dict(
        atomic=True, atomic_registers=240, dq_before_dk=True)), deterministic=False),
    # Each key tile's run of full query blocks started at its own place (`Backward.stagger`).
    "bwd_d128_atomic_full_stagger": Probe(128, False, dict(backward=dict(
        atomic=True, atomic_registers=240, dq_before_dk=True, stagger=True)),
        deterministic=False),
    "bwd_d128_gqa_atomic_full_stagger": Probe(128, False, dict(backward=dict(
        atomic=True, atomic_registers=240, dq_before_dk=True, stagger=True)),
        deterministic=False, kv_heads=1),
    "bwd_d128_atomic_full_stagger_early": Probe(128, False, dict(backward=dict(
        atomic=True, atomic_registers=240, dq_before_dk=True, stagger=True, early_rows=True)),
        deterministic=False),
    "bwd_d128_gqa_atomic_shipped_dq_first": Probe(128, True, dict(backward=dict(
        atomic=True, atomic_registers=240, tile_major=True, atomic_tile_major=False,
        atomic_group_parts=4, dq_before_dk=True)), deterministic=False, kv_heads=1),
    "bwd_d128_atomic_dq_first_r232": Probe(128, True, dict(backward=dict(
        atomic=True, dq_before_dk=True)), deterministic=False),
    "bwd_d128_atomic_dq_first_early": Probe(128, True, dict(backward=dict(
        atomic=True, atomic_registers=240, dq_before_dk=True, early_rows=True)),
        deterministic=False),
    "bwd_d64_atomic_dq_first": Probe(64, True, dict(backward=dict(
        dkv_block_q=128, dq_block_kv=128, atomic=True, dq_before_dk=True)),
        deterministic=False),
    # A group's query heads over two CTAs per key tile (`Backward.group_parts`), launched head
    # by head, in the two kernels and the shipped atomic one pass's registers.
    "bwd_d128_gqa_parts2": Probe(128, True, dict(backward=dict(group_parts=2)), kv_heads=1),
    "bwd_d128_gqa_atomic_parts2": Probe(128, True, dict(backward=dict(
        atomic=True, atomic_registers=240, group_parts=2)), deterministic=False, kv_heads=1),
    # MLA's 192/128 backward: the shipped one pass on 32-row query tiles with 240 registers.
    "bwd_mla": Probe(192, True, dict(block_kv=64, backward=dict(
        split_dkv=False, dkv_block_q=32, registers=240)), 128),
    # ... on 64-row query tiles (which spilled before `backward._opaque_zero`), and in two passes.
    "bwd_mla_q64": Probe(192, True, dict(block_kv=64, backward=dict(
        split_dkv=False, dkv_block_q=64, registers=240)), 128),
    "bwd_mla_q64_r232": Probe(192, True, dict(block_kv=64, backward=dict(
        split_dkv=False, dkv_block_q=64)), 128),
    "bwd_mla_two_passes": Probe(192, True, dict(block_kv=64, backward=dict(split_dkv=True)),
                                128),
    # ... on 64-row query tiles with dPᵀ issued after Pᵀ (`Backward.serial_scores`), and the
    # same order in D = 128's dK/dV kernel.
    "bwd_mla_q64_serial": Probe(192, True, dict(block_kv=64, backward=dict(
        split_dkv=False, dkv_block_q=64, registers=240, serial_scores=True)), 128),
    "bwd_mla_q64_serial_r232": Probe(192, True, dict(block_kv=64, backward=dict(
        split_dkv=False, dkv_block_q=64, serial_scores=True)), 128),
    "bwd_mla_q64_serial_full": Probe(192, False, dict(block_kv=64, backward=dict(
        split_dkv=False, dkv_block_q=64, registers=240, serial_scores=True)), 128),
    "bwd_d128_serial": Probe(128, True, dict(backward=dict(serial_scores=True))),
    # ... with both consumers on one 64-key tile in two roles (`Backward.shared_keys`).
    "bwd_mla_shared_keys": Probe(192, True, dict(block_kv=64, backward=dict(
        split_dkv=False, dkv_block_q=64, registers=240, serial_scores=True, shared_keys=True)),
        128),
    "bwd_mla_shared_keys_q128": Probe(192, True, dict(block_kv=64, backward=dict(
        split_dkv=False, dkv_block_q=128, registers=240, serial_scores=True, shared_keys=True)),
        128),
    "bwd_d128_shared_keys": Probe(128, True, dict(backward=dict(shared_keys=True))),
    # ... with dK's product issued with the next visit's dPᵀ (`Backward.shared_keys_overlap`,
    # shipped; no spills).
    "bwd_mla_shared_keys_overlap": Probe(192, True, dict(block_kv=64, backward=dict(
        split_dkv=False, dkv_block_q=128, registers=240, serial_scores=True, shared_keys=True,
        shared_keys_overlap=True)), 128),
}

# A compile-only H100 for deviceless compilation: XLA's GPU target config (the device's
# properties as XLA's `GpuTargetConfigProto` holds them, in its text format), and the device
# kind jaxflash then picks its backend and tiles by.
H100_KIND = "NVIDIA H100 80GB HBM3"
H100_TARGET = f"""
gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84978434048 shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }} registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 19 }}
device_description_str: "{H100_KIND}"
"""


# Absorbed MLA's decoding on the latent cache (the Mosaic GPU kernel of
# `jaxflash.backends.mosaic.decode`): name -> (query heads, new tokens, MlaDecodeConfig fields
# changed), B = 32, 8k, 576/512.
# At 16 heads the shipped kernel is the transposed one (`decode_transposed`); ``_rows_as_m``
# names the 64-row kernel there.
DECODE_CONFIGS = {"decode_mla_16": (16, 1, {}), "decode_mla_16_t2": (16, 2, {}),
                  "decode_mla_128": (128, 1, {}),
                  "decode_mla_16_rows_as_m": (16, 1, dict(transposed=False)),
                  "decode_mla_16_merge": (16, 1, dict(merge_in_kernel=True, transposed=False))}


def aot_mesh():
  """A one-device mesh of a compile-only H100 (no GPU needed: the CUDA plugin compiles for it
  from `H100_TARGET`)."""
  from jax.experimental import topologies
  topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                          target_config=H100_TARGET)
  return topologies.make_mesh(topology, (1,), ("x",))


def compile_one(name: str, aot: bool) -> None:
  import jax
  import jax.numpy as jnp
  from jaxflash.attention import attention_with_config
  from jaxflash.backends import mosaic

  if name in DECODE_CONFIGS:
    return compile_decode(name, aot)
  probe = CONFIGS[name]
  fields = dict(probe.fields)
  if "backward" in fields:
    fields["backward"] = mosaic.config.Backward(**fields["backward"])
  config = mosaic.Config(**fields)
  dtype = jnp.float8_e4m3fn if name.startswith("fp8_") else jnp.bfloat16
  sharding = None
  if aot:
    from jax.sharding import NamedSharding, PartitionSpec
    sharding = NamedSharding(aot_mesh(), PartitionSpec())
  q = jax.ShapeDtypeStruct((2, 2048, 8, probe.head_dim), dtype, sharding=sharding)
  k = jax.ShapeDtypeStruct((2, 2048, probe.kv_heads, probe.head_dim), dtype, sharding=sharding)
  v = jax.ShapeDtypeStruct((2, 2048, probe.kv_heads, probe.value_dim or probe.head_dim), dtype,
                           sharding=sharding)

  descales = {}
  if probe.per_token:
    descales = dict(q_descale=jnp.ones(q.shape[:3], jnp.float32),
                    k_descale=jnp.ones(k.shape[:3], jnp.float32))

  def attend(q, k, v):
    return attention_with_config(q, k, v, is_causal=probe.causal, config=config,
                                 implementation="mosaic", deterministic=probe.deterministic,
                                 **descales)

  fn = attend
  if name.startswith("bwd_"):
    fn = jax.grad(lambda *x: jnp.sum(attend(*x).astype(jnp.float32)), argnums=(0, 1, 2))
  if aot:
    device = jax.sharding.AbstractDevice(device_kind=H100_KIND, platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (),
                                                                  abstract_device=device)):
      lowered = jax.jit(fn).trace(q, k, v).lower(lowering_platforms=("cuda",))
    lowered.compile()
  else:
    args = [jax.random.normal(jax.random.key(i), x.shape, jnp.float32).astype(x.dtype)
            for i, x in enumerate((q, k, v))]
    jax.block_until_ready(jax.jit(fn)(*args))


def compile_decode(name: str, aot: bool) -> None:
  """A `DECODE_CONFIGS` call: ``decode_attention`` on a latent cache."""
  import jax
  import jax.numpy as jnp
  import jaxflash

  import dataclasses
  from jaxflash.backends.mosaic import decode

  heads, tokens, fields = DECODE_CONFIGS[name]
  shipped = decode.default_config
  decode.default_config = lambda *a, **kw: dataclasses.replace(shipped(*a, **kw), **fields)
  sharding = None
  if aot:
    from jax.sharding import NamedSharding, PartitionSpec
    sharding = NamedSharding(aot_mesh(), PartitionSpec())
  q = jax.ShapeDtypeStruct((32, tokens, heads, 576), jnp.bfloat16, sharding=sharding)
  latent = jax.ShapeDtypeStruct((32, 8192, 1, 576), jnp.bfloat16, sharding=sharding)
  lengths = jax.ShapeDtypeStruct((32,), jnp.int32)

  def attend(q, latent, lengths):
    return jaxflash.decode_attention(q, latent, None, lengths, value_head_dim=512)

  if aot:
    device = jax.sharding.AbstractDevice(device_kind=H100_KIND, platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (),
                                                                  abstract_device=device)):
      jax.jit(attend).trace(q, latent, lengths).lower(lowering_platforms=("cuda",)).compile()
  else:
    args = [jax.random.normal(jax.random.key(i), x.shape, jnp.float32).astype(x.dtype)
            for i, x in enumerate((q, latent))]
    jax.block_until_ready(jax.jit(attend)(*args, jnp.full((32,), 8192, jnp.int32)))


def summarise(report: str) -> str:
  """Registers, stack frames and spills per kernel, and ptxas's notes."""
  kernels = re.split(r"Compiling entry function '", report)[1:]
  lines = []
  for kernel in kernels:
    name = kernel.split("'", 1)[0].replace("_mosaic_gpu_kernel", "")
    regs = re.findall(r"Used (\d+) registers", kernel)
    stack = re.findall(r"(\d+) bytes stack frame", kernel)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", kernel)
    spill = "/".join(spills[0]) if spills else "?"
    lines.append(f"{name}: {regs[0] if regs else '?'} registers, stack "
                 f"{stack[0] if stack else '?'}, spills (stores/loads) {spill}")
  notes = sorted(set(re.findall(r"(?i)((?:warning|performance|C75\d\d)[^\n]*)", report)))
  return "\n    ".join(lines + [note[:300] for note in notes[:8]])


def code_bytes(ptx: Path) -> dict[str, int]:
  """Each kernel's machine code in bytes (its cubin's ``.text.<kernel>`` section), from
  ``ptx`` compiled again by ptxas for sm_90a; empty where no ptxas is on PATH. Large code runs
  slowly where it runs once: the MLA decoding kernel's unrolled merge (150 KB, against 47 KB
  without the merge) ran its arithmetic 6-8x slower than the same code rolled (72 KB), which
  docs/decoding.md puts down to instruction fetch."""
  if shutil.which("ptxas") is None:
    return {}
  cubin = ptx.with_suffix(".cubin")
  subprocess.run(["ptxas", "-arch=sm_90a", str(ptx), "-o", str(cubin)], check=True,
                 capture_output=True)
  elf = cubin.read_bytes()
  # ELF64: the section header table's offset, entry size and count, and the names' section.
  shoff, = struct.unpack_from("<Q", elf, 0x28)
  shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
  headers = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
  names_at = headers[shstrndx][4]

  def name(header):
    start = names_at + header[0]
    return elf[start:elf.index(b"\0", start)].decode()

  return {name(h)[len(".text."):]: h[5] for h in headers if name(h).startswith(".text.")}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--one", help=argparse.SUPPRESS)  # the child: compile this config
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS),
                      choices=list(CONFIGS) + list(DECODE_CONFIGS))
  parser.add_argument("--dumps", default="/tmp/ptxas_probe_dumps")
  parser.add_argument("--ptx", nargs="*", default=[], help="configs whose PTX to keep")
  parser.add_argument("--sass", nargs="*", default=[],
                      help="configs whose SASS to keep (needs nvdisasm: see above)")
  parser.add_argument("--aot", action=argparse.BooleanOptionalAction,
                      default=shutil.which("nvidia-smi") is None,
                      help="compile for a compile-only H100 (default where no GPU is attached)")
  args = parser.parse_args()
  if args.one:
    compile_one(args.one, args.aot)
    return
  lines, reports = [], []
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  for name in args.configs:
    folder = Path(args.dumps) / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    env = dict(os.environ, MOSAIC_GPU_DUMP_TO=str(folder), MOSAIC_GPU_DUMP_PTXAS="1",
               MOSAIC_GPU_DUMP_PTX="1")
    if name in args.sass:
      env["MOSAIC_GPU_DUMP_SASS"] = "1"
    if args.aot:
      env["JAX_PLATFORMS"] = "cpu"  # (the CUDA plugin still compiles for the target)
    run = subprocess.run([sys.executable, __file__, "--out", args.out, "--one", name,
                          "--aot" if args.aot else "--no-aot"], env=env,
                         capture_output=True, text=True, timeout=600)
    log = run.stdout + run.stderr
    errors = [line for line in log.splitlines() if "Error" in line]
    report = "".join(p.read_text(errors="replace") for p in sorted(folder.glob("*.ptxas")))
    for log_file in folder.glob("*.mlir-passes.log"):  # (Mosaic GPU's pass log: 40-120 MB)
      log_file.unlink()
    status = "ok" if run.returncode == 0 else f"FAILED ({errors[-1:]})"
    sizes = {kernel: size for ptx in sorted(folder.glob("*.ptx"))
             for kernel, size in code_bytes(ptx).items()}
    code = ", ".join(f"{kernel.removesuffix('_mosaic_gpu_kernel')} {size / 1024:.1f} KiB"
                     for kernel, size in sizes.items())
    lines.append(f"{name}: {status}\n    {summarise(report)}"
                 + (f"\n    code: {code}" if code else ""))
    print(lines[-1], flush=True)
    reports.append(f"==== {name}\n{report}")
    for kind, wanted in (("ptx", args.ptx), ("sass", args.sass)):
      if name in wanted:
        # (Mosaic GPU writes SASS with its control codes as *.sass_ctrl.)
        text = "".join(p.read_text(errors="replace")
                       for p in sorted(folder.glob(f"*.{kind}*")))
        (out / f"{name}.{kind}").write_text(text)
  summary = "\n".join(["== ptxas summary =="] + lines)
  (out / "summary.txt").write_text(summary + "\n\n" + "\n".join(reports))
  print("\n" + summary)


if __name__ == "__main__":
  main()
