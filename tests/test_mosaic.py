"""The "mosaic" backend: the Mosaic GPU forward and backward for Hopper (with the Triton backward
for the calls the Mosaic one does not serve).

- On any machine: which calls it serves (and why not the others), that ``implementation=None``
  takes it only where it measured faster, and that every kernel variant lowers for CUDA (Mosaic
  GPU lowers on a CPU-only machine with the CUDA plugin installed, as CI does; without the
  plugin these tests skip, unless ``JAXFLASH_REQUIRE_CUDA_LOWERING=1`` makes that a failure).
- Numerics, compiled on a Hopper GPU and in Mosaic GPU's interpreter on a CPU: forward, LSE and
  gradients (through the Triton backward) against the float32 reference over options, odd
  shapes and head dims; NaN rows; determinism.
"""

import dataclasses
import contextlib
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import _checks, _core, backends, devices
from jaxflash.ops import flash, partial
from jaxflash.attention import attention_with_config
from jaxflash.backends import mosaic
from jaxflash.reference import reference_attention
from checks import (H100, ON_GPU, OPTIONS, SMALL_CONFIGS, check, dense_mask_of, random_lengths,
                    random_qkv, rel_err, variant_if)

BF16 = jnp.bfloat16
Q = jax.ShapeDtypeStruct((2, 300, 8, 128), BF16)
KV = jax.ShapeDtypeStruct((2, 1000, 2, 128), BF16)

# The options of tests/checks.py that the Mosaic forward runs in its kernel (all of them but
# "everything", which test_every_supported_option_at_once runs).
SUPPORTED = ("none", "causal", "window_pair", "causal_window", "lengths", "segments_pair",
             "mask_full", "mask_keys", "bias_full", "dropout", "dropout_broadcast", "soft_cap",
             "scale", "scale_negative", "scale_zero", "sinks")


def _in(mesh, fn):
  with jax.sharding.use_abstract_mesh(mesh):
    return fn()


def _on_h100(fn):
  return _in(H100, fn)


# --------------------------------------------------------------------------------------------
# Selection (any machine).

@pytest.mark.skipif(ON_GPU, reason="checks what a CPU-only machine picks")
def test_declines_without_a_hopper_gpu():
  with pytest.raises(backends.UnsupportedCallError, match="mosaic.*needs a Hopper GPU"):
    jaxflash.implementation_for(Q, KV, KV, implementation="mosaic")
  a100 = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
      device_kind="NVIDIA A100-SXM4-80GB", platform="gpu", num_cores=108))
  with jax.sharding.use_abstract_mesh(a100):
    with pytest.raises(backends.UnsupportedCallError, match="Hopper.*A100"):
      jaxflash.implementation_for(Q, KV, KV, implementation="mosaic")
    assert jaxflash.implementation_for(Q, KV, KV) == "triton"
  # Mosaic GPU's interpreter runs it anywhere (tests), but None does not pick it for that.
  assert jaxflash.implementation_for(Q, KV, KV, implementation="mosaic", interpret=True) == "mosaic"
  assert jaxflash.implementation_for(Q, KV, KV, interpret=True) == "triton"


@pytest.mark.parametrize("h,fits", [(128, True), (256, False)])
def test_partial_results_where_they_fit(h, fits):
  """A float32 partial result needs its own O tiles in shared memory: at D = 256 they do not
  fit beside the K/V ring, and such calls go to the next backend."""
  q = jnp.zeros((2, 64, 4, h), BF16)
  call = _checks.normalise(q, q, q)
  params = dataclasses.replace(call.params, partial=True)
  reason = _on_h100(lambda: mosaic.BACKEND.supports(call.inputs, params, devices.current()))
  assert (reason is None) == fits, reason
  assert fits or "partial result at head dim 256 does not fit" in reason


def test_float32_and_wide_heads_are_declined():
  f32 = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.float32)
  with pytest.raises(backends.UnsupportedCallError, match="bfloat16, float16 and float8 only"):
    _on_h100(lambda: jaxflash.implementation_for(f32, f32, f32, implementation="mosaic"))
  wide = jax.ShapeDtypeStruct((1, 64, 2, 320), BF16)
  with pytest.raises(backends.UnsupportedCallError, match="head dims up to 256"):
    _on_h100(lambda: jaxflash.implementation_for(wide, wide, wide, implementation="mosaic"))


H200 = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
    device_kind="NVIDIA H200", platform="gpu", num_cores=132))


H100_PCIE = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100 PCIe", platform="gpu", num_cores=114))


def _pick(mesh, h, s=4096, dtype=BF16, causal=False, hv=None):
  q = jax.ShapeDtypeStruct((2, 300, 8, h), dtype)
  k = jax.ShapeDtypeStruct((2, s, 8, h), dtype)
  v = jax.ShapeDtypeStruct((2, s, 8, hv or h), dtype)
  return _in(mesh, lambda: jaxflash.implementation_for(q, k, v, is_causal=causal))


def test_none_takes_it_where_it_measured_faster():
  """``implementation=None`` follows the measured table per device kind, head dim, band and
  key length: on an H200 every measured cell (D = 40 is padded to 64); on an H100 causal D = 64
  from 512 keys and causal D = 128 at every length; for float32 and on an H100 PCIe (not
  measured) Triton serves."""
  pick = functools.partial(_pick, H200)
  assert [pick(h) for h in (40, 64, 128, 192, 256)] == ["mosaic"] * 5
  assert [pick(h, s=512) for h in (64, 128, 256)] == ["mosaic", "mosaic", "mosaic"]
  assert [pick(64, s=s) for s in (1024, 2048)] == ["mosaic", "mosaic"]
  assert [pick(h, s=512, causal=True) for h in (64, 128, 256)] == ["mosaic"] * 3
  assert pick(128, dtype=jnp.float32) == "triton"
  pick = functools.partial(_pick, H100)
  assert [pick(h, s=512) for h in (64, 128, 256)] == ["mosaic", "mosaic", "mosaic"]
  assert [pick(64, s=s, causal=True) for s in (256, 512, 1024)] == ["triton"] + ["mosaic"] * 2
  assert [pick(128, s=s, causal=True) for s in (512, 1024, 2048)] == ["mosaic"] * 3
  assert pick(256, s=512, causal=True) == "mosaic"
  assert pick(192, s=1024, causal=True) == "mosaic"
  assert _pick(H100_PCIE, 128) == "triton"


@pytest.mark.parametrize("mesh", [H200, H100], ids=["h200", "h100"])
def test_none_takes_it_for_the_measured_value_head_dims(mesh):
  """A value head dim of its own reads its own table (padded Dqk, padded Dv, band): MLA's
  192/128 and 128/64 (96/64 padded the same) were measured faster on Mosaic at every length, an
  unmeasured pair (64/128) keeps Triton, and an H100 PCIe (not measured) Triton for all."""
  pick = functools.partial(_pick, mesh)
  for h, hv in [(192, 128), (128, 64), (96, 64)]:
    assert [pick(h, hv=hv, s=s, causal=c) for s in (512, 8192) for c in (False, True)] == \
        ["mosaic"] * 4, (h, hv)
  assert pick(64, hv=128) == pick(64, hv=128, causal=True) == "triton"
  assert _pick(H100_PCIE, 192, hv=128) == "triton"


def test_device_kinds_match_whole_words():
  """An H200 is neither an H20 (78 SMs: a persistent grid of 78 CTAs on an H200 left 54 SMs
  idle) nor a GH200 (not measured: it reads the H100's entries, `STAND_INS`)."""
  from jaxflash.devices import kind_is
  assert mosaic.config.sm_count("NVIDIA H200") == 132
  assert mosaic.config.sm_count("NVIDIA H20") == 78
  assert mosaic.config.sm_count("NVIDIA H100 PCIe") == 114
  assert mosaic.config.sm_count("NVIDIA H100 80GB HBM3") == 132
  assert kind_is("NVIDIA H200", "H200") and not kind_is("NVIDIA H200", "H20")
  assert not kind_is("NVIDIA GH200 480GB", "H200") and kind_is("NVIDIA GH200 480GB", "GH200")
  assert mosaic.config.faster_than_triton("NVIDIA H200", 128, 4096, False)
  assert mosaic.config.faster_than_triton("NVIDIA GH200 480GB", 128, 4096, False)
  assert mosaic.config.sm_count("NVIDIA GH200 480GB") == 132


def test_the_sm_count_is_jaxs_where_it_gives_one():
  """Persistent grids and split-KV waves fill the SMs JAX reports (a GPU's ``core_count``, an
  abstract device's ``num_cores``), whatever the device kind; the table of kinds serves only
  where JAX gives no count."""
  fewer = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
      device_kind="NVIDIA H200", platform="gpu", num_cores=120))  # (a part of the GPU, say)
  with jax.sharding.use_abstract_mesh(fewer):
    device = devices.current()
  assert (device.cores, device.sm_count) == (120, 120)
  unknown = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
      device_kind="NVIDIA H200", platform="gpu", num_cores=None))
  with jax.sharding.use_abstract_mesh(unknown):
    assert (devices.current().cores, devices.current().sm_count) == (None, 132)
  assert devices.sm_count("NVIDIA A100-SXM4-80GB") == 108
  assert devices.sm_count("NVIDIA H200", cores=120) == 120
  # The forward's persistent grid (D = 128 without a band, `TUNED`) takes the count given.
  config = lambda sms: mosaic.config.default_config(  # noqa: E731
      128, jnp.bfloat16, False, 16384, "NVIDIA H200", sms=sms)
  assert config(None).persistent_ctas == 132 and config(120).persistent_ctas == 120
  # So does MLA decoding's split count: one wave of (row group, split) CTAs.
  from jaxflash.backends.mosaic import decode
  q = jax.ShapeDtypeStruct((4, 1, 16, 576), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((4, 65536, 1, 576), jnp.bfloat16)
  inputs = _core.Inputs(q, cache, cache, jax.ShapeDtypeStruct((4, 2), jnp.int32))
  splits = lambda cores: decode.default_config(  # noqa: E731
      inputs, None, devices.Device("gpu", "NVIDIA H200", True, cores=cores)).splits
  assert (splits(None), splits(132), splits(64)) == (32, 32, 16)


def test_a_gh200_reads_the_h100s_entries():
  """A GH200 (the H100's die; no table names it) takes the H100 SXM's measured choices: Mosaic
  where the H100 measured it faster, Triton for causal D = 64 below 512 keys (an H200's entry
  would give Mosaic there), Mosaic for MLA's 192/128; and the H100's three-consumer lengths.
  A kind with neither an entry nor a stand-in (an H100 PCIe) keeps Triton."""
  gh200 = "NVIDIA GH200 480GB"
  faster = mosaic.config.faster_than_triton
  assert faster(gh200, 64, 512, True) and not faster(gh200, 64, 256, True)
  assert faster("NVIDIA H200", 64, 256, True)
  assert faster(gh200, 192, 1024, True, value_dim=128)
  assert not faster("NVIDIA H100 PCIe", 128, 4096, False)
  assert mosaic.config.default_config(64, BF16, False, 4096, gh200).consumers == 3


@pytest.mark.parametrize("batch,heads,q_tiles,ctas",
                         [(16, 32, 4, 132), (2, 2, 2, 3), (1, 5, 1, 3), (4, 16, 16, 132),
                          (1, 1, 3, 3), (1, 128, 64, 132), (2, 3, 7, 5), (1, 2, 9, 132)])
@pytest.mark.parametrize("heavy_first,paired", [(False, False), (True, False), (True, True)])
def test_persistent_ctas_share_out_every_tile_once(batch, heads, q_tiles, ctas, heavy_first,
                                                   paired):
  """Every (batch row, head, tile) runs on exactly one persistent CTA; heaviest first with a
  causal band, the CTAs' causal work (tile t sees t + 1 key blocks) ends within one item's
  worth of each other (paired: one pair's, q_tiles + 1). The tile-fastest order at (16, 32,
  4, 132) spread it 4.3x (15 to 64). Paired, the CTAs of a round read few heads: at 128 heads
  of 64 tiles, the first round's 132 CTAs five, where the heaviest-first rounds read all 128."""
  from jaxflash.backends.mosaic import forward
  grid = forward._Grid(batch, heads, q_tiles, ctas)

  # Every CTA's count and its items 0 .. (the most any CTA could run) in one jitted program, as
  # the kernel traces them (CTA and item traced); only the first `count` of each are its own.
  def items_of(cta, i):
    count, item = forward._persistent_items(grid, heavy_first, cta, paired=paired)
    return count, jnp.stack(item(i))

  most = batch * heads * q_tiles
  counts, items = jax.jit(jax.vmap(jax.vmap(items_of, (None, 0)), (0, None)))(
      jnp.arange(ctas, dtype=jnp.int32), jnp.arange(most, dtype=jnp.int32))
  counts, items = np.asarray(counts), np.asarray(items)  # [ctas, most], [ctas, most, 3]
  runs, work, first_round = [], [], set()
  for cta in range(ctas):
    count = int(counts[cta, 0])
    assert (counts[cta] == count).all() and 0 <= count <= most, (cta, counts[cta])
    mine = [tuple(x) for x in items[cta, :count].tolist()]
    runs += mine
    work.append(sum(tile + 1 for _, _, tile in mine))
    first_round |= {mine[0][:2]} if mine else set()
  everything = [(b, h, t) for b in range(batch) for h in range(heads) for t in range(q_tiles)]
  assert sorted(runs) == everything
  if heavy_first:
    assert max(work) - min(work) <= q_tiles + paired, work
  if (batch, heads, q_tiles) == (1, 128, 64) and heavy_first:
    assert len(first_round) == (5 if paired else 128), first_round


@pytest.mark.parametrize("batch,heads,q_tiles,ctas", [(1, 1, 2, 2), (2, 3, 4, 6), (1, 16, 128, 132),
                                                    (2, 2, 6, 132)])
def test_clusters_share_out_every_tile_once(batch, heads, q_tiles, ctas):
  """Persistent clusters (`Config.kv_multicast`): every (batch row, head, tile) runs on exactly
  one CTA, the two CTAs of a cluster run as many items, each item's pair of tiles of one
  (batch row, head) (tiles 2p on CTA 0, 2p + 1 on CTA 1), and the clusters' counts differ by
  at most one."""
  from jaxflash.backends.mosaic import forward
  grid = forward._Grid(batch, heads, q_tiles, ctas, paired_ctas=True)

  def items_of(cluster, rank, i):
    count, item = forward._cluster_items(grid, cluster, rank)
    return count, jnp.stack(item(i))

  most = batch * heads * q_tiles
  run = jax.jit(jax.vmap(jax.vmap(jax.vmap(items_of, (None, None, 0)), (None, 0, None)),
                         (0, None, None)))
  counts, items = (np.asarray(x) for x in run(jnp.arange(ctas // 2, dtype=jnp.int32),
                                               jnp.arange(2, dtype=jnp.int32),
                                               jnp.arange(most, dtype=jnp.int32)))
  runs = []
  for c in range(ctas // 2):
    count = int(counts[c, 0, 0])
    assert (counts[c] == count).all(), counts[c]
    first, second = items[c, 0, :count].tolist(), items[c, 1, :count].tolist()
    for (b0, h0, t0), (b1, h1, t1) in zip(first, second):
      assert (b0, h0, t0 % 2, t1) == (b1, h1, 0, t0 + 1)
    runs += [tuple(x) for x in first + second]
  assert max(counts[:, 0, 0]) - min(counts[:, 0, 0]) <= 1
  everything = [(b, h, t) for b in range(batch) for h in range(heads) for t in range(q_tiles)]
  assert sorted(runs) == everything


def test_none_takes_it_only_where_it_measured_faster(monkeypatch):
  """Registered first, but `preferred` consults the measured table: without an entry for the
  device kind (an H100 PCIe today), Triton serves; an entry changes that without code."""
  assert backends.names()[0] == "mosaic"
  on_pcie = lambda fn: _in(H100_PCIE, fn)
  assert on_pcie(lambda: jaxflash.implementation_for(Q, KV, KV)) == "triton"
  assert on_pcie(lambda: jaxflash.implementation_for(Q, KV, KV, implementation="mosaic")) \
      == "mosaic"
  monkeypatch.setitem(mosaic.config.FASTER_THAN_TRITON, "H100 PCIe", {(128, False): 0})
  assert on_pcie(lambda: jaxflash.implementation_for(Q, KV, KV)) == "mosaic"
  small = jax.ShapeDtypeStruct((2, 300, 8, 64), BF16)
  assert on_pcie(lambda: jaxflash.implementation_for(small, small, small)) == "triton"


def test_configs_are_checked():
  for make, field in [
      (lambda: mosaic.Config(block_kv=96), "block_kv"),
      (lambda: mosaic.Config(num_stages=1), "num_stages"),
      (lambda: mosaic.Config(persistent_ctas=0), "persistent_ctas"),
      (lambda: mosaic.Config(persistent_ctas=True), "persistent_ctas"),  # (one CTA, silently)
      (lambda: mosaic.Config(q_buffers=2), "q_buffers"),  # only a persistent grid has a next item
      (lambda: mosaic.Config(persistent_ctas=132, q_buffers=2, o_through_q=True), "o_through_q"),
      (lambda: mosaic.Config(exp2_poly_cols=12), "exp2_poly_cols"),  # whole 8-column groups
      (lambda: mosaic.Config(block_kv=64, exp2_poly_cols=128), "exp2_poly_cols"),
      (lambda: mosaic.Config(consumers=4), "consumers"),
      (lambda: mosaic.Config(consumers=3), "registers"),  # 232 leaves the producer nothing
      (lambda: mosaic.Config(registers=160), "registers"),
      (lambda: mosaic.Config(registers=248), "registers"),  # (the producer needs its 24)
      (lambda: mosaic.Backward(dkv_block_q=96), "dkv_block_q"),
      (lambda: mosaic.Backward(dv_stages=0), "dv_stages"),
      (lambda: mosaic.Backward(registers=236), "registers"),
      (lambda: mosaic.Backward(shared_keys_overlap=True), "shared_keys_overlap")]:
    with pytest.raises(ValueError, match=field):
      make()
  budget = mosaic.config.SMEM_BUDGET
  for h in (40, 64, 96, 128, 192, 256):
    config = mosaic.default_config(h, BF16, False, 4096, "NVIDIA H200")
    assert mosaic.config.fits(config, h), (h, config)
    assert mosaic.config.backward_smem_bytes(config.backward, h) <= budget, (h, config)
  # The dV pass's own tiles count where dK/dV runs as two passes, and only there.
  wide_dv = mosaic.Backward(dkv_block_q=32, dq_block_kv=32, dv_block_q=128)
  assert mosaic.config.backward_smem_bytes(wide_dv, 256) > budget
  assert mosaic.config.backward_smem_bytes(wide_dv, 128) == mosaic.config.backward_smem_bytes(
      mosaic.Backward(dkv_block_q=32, dq_block_kv=32), 128)


# --------------------------------------------------------------------------------------------
# Lowering for CUDA on any machine.

# Skipped without the CUDA plugin, failed instead with JAXFLASH_REQUIRE_CUDA_LOWERING=1 (conftest).
needs_cuda_plugin = pytest.mark.usefixtures("cuda_plugin")


def _lower(fn, *args) -> str:
  with jax.sharding.use_abstract_mesh(H100):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _forward(config=None, **options):
  def fn(q, k, v):
    return attention_with_config(q, k, v, implementation="mosaic", config=config, **options)
  return fn


# (80, 96 and float16 at 40 in the variants: 80 and 96 pad to 128 outside the kernel (`_pad`),
# so their kernel and shipped tiles (`TUNED`) are test_mosaic.py::
# test_head_dims_and_dtypes_lower[128-bfloat16]'s, and [40-bfloat16] holds a padded head dim;
# float16 at 40 is [40-bfloat16]'s padded D = 64 path in the other 16-bit type, whose wgmma
# [256-float16] lowers.)
@needs_cuda_plugin
@pytest.mark.parametrize("h,dtype", [
    (40, BF16), (64, BF16), pytest.param(80, BF16, marks=pytest.mark.variants),
    pytest.param(96, BF16, marks=pytest.mark.variants), (128, BF16), (192, BF16), (256, BF16),
    pytest.param(40, jnp.float16, marks=pytest.mark.variants), (256, jnp.float16)])
def test_head_dims_and_dtypes_lower(h, dtype):
  q = jax.ShapeDtypeStruct((2, 300, 8, h), dtype)
  kv = jax.ShapeDtypeStruct((2, 1000, 2, h), dtype)
  assert "mosaic_gpu" in _lower(_forward(is_causal=True), q, kv, kv)


# Each option lowers at one of two lengths, alternately (the kernels' code does not depend on
# the length, only their grids and padding do), and the first two options at both.
_OPTION_LENGTHS = [(option, (5, 77) if i % 2 else (4096, 4096)) for i, option in
                   enumerate(SUPPORTED)] + [(option, (5, 77) if i % 2 == 0 else (4096, 4096))
                                            for i, option in enumerate(SUPPORTED[:2])]
# In the variants, each with a case that CI lowers on its path (the README part lowers none of
# them; "here": test_mosaic.py::test_every_supported_option_lowers):
# - lengths, dropout, soft_cap: test_mosaic.py::
#   test_lowers_with_x64_and_strict_rank_promotion[None-False] lowers each (OPTIONS
#   ["everything"] less the mask and bias) through the same Mosaic forward and backward;
# - mask_keys: [None-True] there lowers the same [B, 1, T, S] mask (`_checks` broadcasts a key
#   mask to it) with every other option, gradients by Triton's backward as here;
# - window_pair: [causal_window-lengths3] here holds the band's two bounds (one `masking.Window`
#   code, its right bound 0 there), and [None-False] above a window with every option;
# - scale: [none-lengths0] and [none-lengths16] hold its path, the folded scale of a positive
#   one (`params.scale > 0` in the forward's softmax, the only test of its value);
# - scale_zero: [scale_negative-lengths13] holds the unfolded path of a non-positive scale;
# - causal at 4096: [causal-lengths1] holds its code (the length changes grids and padding) and
#   [causal_window-lengths3] the shipped causal tiles at 4096 rows, heaviest tiles first.
_OPTION_VARIANTS = {("window_pair", (4096, 4096)), ("lengths", (4096, 4096)),
                    ("mask_keys", (5, 77)), ("dropout", (5, 77)), ("soft_cap", (5, 77)),
                    ("scale", (4096, 4096)), ("scale_zero", (4096, 4096)),
                    ("causal", (4096, 4096))}


@needs_cuda_plugin
@pytest.mark.parametrize("option,lengths", [
    variant_if(case in _OPTION_VARIANTS, *case) for case in _OPTION_LENGTHS])
def test_every_supported_option_lowers(option, lengths):
  t, s = lengths
  b, n, k, h = 2, 6, 3, 128
  q = jax.ShapeDtypeStruct((b, t, n, h), BF16)
  kv = jax.ShapeDtypeStruct((b, s, k, h), BF16)
  # A T x S mask or bias is passed as an abstract argument (made small to learn its broadcast
  # shape): a concrete one would be baked into the program as a constant of up to 200 MB.
  small = OPTIONS[option](b, 8, 8, n, 0)
  dense = [name for name in ("mask", "bias") if name in small]
  options = OPTIONS[option](b, t, s, n, 0) if not dense else {}
  assert not dense or set(small) == set(dense), "an option with a dense array and more"
  abstract = [jax.ShapeDtypeStruct(small[name].shape[:2] + (t, s), small[name].dtype)
              for name in dense]

  def fn(q, k, v, *arrays):
    # The forward and the gradients (the Mosaic backward, or Triton's for a mask or bias).
    attend = lambda q, k, v: _forward(**options, **dict(zip(dense, arrays)))(q, k, v)
    return jax.value_and_grad(lambda *x: jnp.sum(attend(*x).astype(jnp.float32)),
                              argnums=(0, 1, 2))(q, k, v)

  assert "mosaic_gpu" in _lower(fn, q, kv, kv, *abstract)


# In the variants, with and without a band: the same forward kernel on other tiles than cases
# that CI lowers (the README part lowers none of these):
# - 64-key tiles, one CTA a tile: test_mosaic.py::test_two_q_buffers_lower[64-True-64] (64-key
#   tiles at D = 64) and test_mosaic.py::test_tile_variants_lower[False-64-3-True-132-True] and
#   [True-64-3-True-132-True];
# - 128-key tiles on three stages: those two here (a ring of three) and
#   test_mosaic.py::test_head_dims_and_dtypes_lower[64-bfloat16] (128-key tiles, one CTA a tile);
# - 256-key tiles: test_mosaic.py::test_two_q_buffers_lower[64-False-256] (the shipped D = 64
#   tiles) and test_mosaic.py::test_fp8_forward_lowers[128-True-True-None-None] (a causal band
#   on [64, 256] tiles: FP8's shipped ones, the same float32 S);
# - persistent grids without the overlap, heaviest first or in order: those two here (a
#   persistent grid with one Q buffer; without a band `_items` takes the natural order) and
#   test_mosaic.py::test_persistent_partial_results_lower (one Q buffer, no overlap);
# - the overlap at D = 64 one CTA a tile: those two here and
#   test_mosaic.py::test_head_dims_and_dtypes_lower[128-bfloat16] (the shipped overlap).
@needs_cuda_plugin
@pytest.mark.parametrize("block_kv,stages,heavy_first,ctas,overlap", [
    pytest.param(64, 2, True, None, False, marks=pytest.mark.variants),
    pytest.param(128, 3, True, None, False, marks=pytest.mark.variants),
    pytest.param(256, 2, True, None, False, marks=pytest.mark.variants),
    (128, 2, False, None, False),
    pytest.param(128, 2, True, 132, False, marks=pytest.mark.variants),
    pytest.param(64, 2, False, 132, False, marks=pytest.mark.variants),
    pytest.param(128, 2, True, None, True, marks=pytest.mark.variants), (64, 3, True, 132, True)])
@pytest.mark.parametrize("causal", [False, True])
def test_tile_variants_lower(block_kv, stages, heavy_first, ctas, overlap, causal):
  q = jax.ShapeDtypeStruct((2, 1000, 4, 64), BF16)
  config = mosaic.Config(block_kv=block_kv, num_stages=stages, heavy_first=heavy_first,
                         persistent_ctas=ctas, intra_wg_overlap=overlap)
  assert "mosaic_gpu" in _lower(_forward(config, is_causal=causal), q, q, q)


@needs_cuda_plugin
@pytest.mark.parametrize("h,dtype,fields", [
    (64, BF16, dict(block_kv=128, exp2_poly_cols=32)),
    (64, BF16, dict(block_kv=64, exp2_poly_cols=64)),
    (128, BF16, dict(block_kv=128, intra_wg_overlap=True, exp2_poly_cols=16)),
    (128, jnp.float8_e4m3fn, dict(block_kv=256, exp2_poly_cols=64))])
def test_exp2_polynomial_lowers(h, dtype, fields):
  """The forward with part (or all) of each block's exponentials by the polynomial lowers for
  CUDA: column slices and a concatenation of the wgmma layout, bitcasts and shifts."""
  q = jax.ShapeDtypeStruct((2, 300, 8, h), dtype)
  text = _lower(_forward(mosaic.Config(**fields), is_causal=True), q, q, q)
  assert text.count("custom_call @mosaic_gpu") == 1


# (The persistent bf16 case in the variants: its clusters on the persistent grid with the
# overlap are the shipped D = 128 forward without a band, which
# test_mosaic.py::test_configs_within_the_forward_budget_lower[128-128-False-False] (with two Q
# buffers) and test_mosaic.py::test_every_supported_option_lowers[none-lengths0] lower; its
# unpaired causal call is [bfloat16-fields1]'s here on a persistent grid, which
# test_mosaic.py::test_tile_variants_lower[True-64-3-True-132-True] holds with the overlap.)
@needs_cuda_plugin
@pytest.mark.parametrize("dtype,fields", [
    pytest.param(BF16, dict(intra_wg_overlap=True, persistent_ctas=132),
                 marks=pytest.mark.variants),
    (BF16, dict(intra_wg_overlap=True)),
    (jnp.float8_e4m3fn, dict(block_kv=256, mma_row_sums=True, persistent_ctas=132))])
def test_kv_multicast_lowers(dtype, fields):
  """`Config.kv_multicast` lowers for CUDA in clusters of two CTAs (the kernel reads its place
  in the cluster) without a causal band, and unpaired with one."""
  q = jax.ShapeDtypeStruct((2, 4096, 4, 128), dtype)
  config = mosaic.Config(kv_multicast=True, **fields)
  assert "cluster_block_id" in _lower(_forward(config), q, q, q)
  assert "cluster_block_id" not in _lower(_forward(config, is_causal=True), q, q, q)


# (Three in the variants, the same kernel on other tiles: [64-False-64] is test_mosaic.py::
# test_two_q_buffers_lower[64-False-256]'s (the shipped D = 64 tiles without a band) on 64-key
# tiles; [128-False-64] is D = 128's second Q buffer without a band, which test_mosaic.py::
# test_configs_within_the_forward_budget_lower[128-128-False-False] lowers on the shipped
# tiles; [128-True-64] is [64-True-64]'s second Q buffer with a band, at D = 128.)
@needs_cuda_plugin
@pytest.mark.parametrize("h,causal,block_kv", [
    pytest.param(64, False, 64, marks=pytest.mark.variants), (64, True, 64),
    pytest.param(128, False, 64, marks=pytest.mark.variants),
    pytest.param(128, True, 64, marks=pytest.mark.variants),
    (64, False, 256)])  # (`TUNED`'s D = 64 tiles without a band)
def test_two_q_buffers_lower(h, causal, block_kv):
  """A persistent grid whose next item's Q loads into a second buffer during this item."""
  q = jax.ShapeDtypeStruct((2, 1000, 4, h), BF16)
  config = mosaic.Config(block_kv=block_kv, persistent_ctas=132, q_buffers=2)
  assert "mosaic_gpu" in _lower(_forward(config, is_causal=causal), q, q, q)


@needs_cuda_plugin
@pytest.mark.parametrize("ctas,with_dense", [(None, True), (132, True), (None, False)])
def test_lowers_with_x64_and_strict_rank_promotion(ctas, with_dense):
  """jax_enable_x64 (int64 Python ints, lengths and segment ids) and rank promotion "raise",
  with every option at once: nothing in the kernels mixes int32 and int64 or broadcasts ranks.
  Without the mask and bias the gradients are the Mosaic backward's."""
  b, t, s, n, k, h = 2, 300, 333, 4, 2, 128
  with jax.enable_x64(True), jax.numpy_rank_promotion("raise"):
    options = OPTIONS["everything"](b, t, s, n, 0)
    dense = {name: options.pop(name) for name in ("mask", "bias") if name in options}
    if not with_dense:
      dense = {}
    q = jax.ShapeDtypeStruct((b, t, n, h), BF16)
    kv = jax.ShapeDtypeStruct((b, s, k, h), BF16)

    def fn(q, k, v, *arrays):
      config = mosaic.Config(persistent_ctas=ctas)
      return jax.grad(lambda q, k, v: jnp.sum(_forward(
          config, **options, **dict(zip(dense, arrays)))(q, k, v).astype(jnp.float32)),
          argnums=(0, 1, 2))(q, k, v)

    # (x64 makes the test's float bias float64, which jaxflash takes as float32: lower the
    # kernels with the bfloat16 bias the test means.)
    abstract = [jax.ShapeDtypeStruct(x.shape, BF16 if x.dtype == jnp.float64 else x.dtype)
                for x in dense.values()]
    text = _lower(fn, q, kv, kv, *abstract)
    assert "mosaic_gpu" in text and ("jaxflash_backward_dq" in text) == with_dense


# (Four in the variants. Each masking lowers in CI at D = 64 (test_mosaic.py::
# test_block_masks_lower[dense-64] and the like; the README part lowers [mask_mod-64] and
# [segments-64] with the newest jax too) and at D = 256 (its
# narrowest tiles: 32-row dK and 32-key dQ tiles, 64-row ones in its dV pass, e.g. [dense-256]),
# and [mask_mod-128] holds D = 128's shipped tiles with a block table (`LOADS_BACKWARD`'s
# 128-key dQ tiles; the forward's persistent grid with the overlap, no clusters). [dense-128],
# [segments-128] and [blocks-128] are each masking's [*-64] and [*-256] cases on tiles that
# those lower (128-key forward and dQ tiles at D = 64, 64-row dK/dV tiles in D = 256's dV
# pass); [blocks-256] is [blocks-64]'s rule, which reads features only, on D = 256's tiles,
# where [mask_mod-256] lowers a rule's features (`rule_mask`).)
_BLOCK_MASK_VARIANTS = {("dense", 128), ("segments", 128), ("blocks", 128), ("blocks", 256)}


@needs_cuda_plugin
@pytest.mark.parametrize("masking,h", [
    variant_if((masking, h) in _BLOCK_MASK_VARIANTS, masking, h) for h in (64, 128, 256)
    for masking in ("dense", "mask_mod", "segments", "blocks")])
def test_block_masks_lower(h, masking):
  """A dense mask, a mask_mod (with features and an elementwise rule), segment ids and a block
  pattern (whose rule reads features only): the forward and the Mosaic backward walk block
  lists (no Triton attention kernel; a dense mask is packed by one), at every head dim."""
  b, t, s, n, k = 2, 777, 1300, 8, 2
  rng = np.random.RandomState(0)
  ids = jnp.asarray(np.sort(rng.randint(0, 5, (b, s)), axis=1))
  options = {
      "dense": {},
      "mask_mod": dict(mask_mod=lambda bb, hh, q, kv: (ids[bb, q] == ids[bb, kv])
                       & ((q - kv) % 3 != 1) & (q >= kv)),
      "segments": dict(is_causal=True, segment_ids=(ids[:, :t], ids)),
      # 82 key blocks: the pattern's rule picks one of three 32-bit words per key.
      "blocks": dict(block_mask=jaxflash.BlockMask.from_blocks(
          jnp.asarray(rng.rand(1, n, 49, 82) < 0.3) | jnp.eye(49, 82, dtype=bool), t, s, 16)),
  }[masking]

  def fn(q, kk, v, mask):
    extra = dict(mask=mask) if masking == "dense" else {}
    return jax.grad(lambda q, kk, v: jnp.sum(_forward(**options, **extra)(q, kk, v).astype(
        jnp.float32)), argnums=(0, 1, 2))(q, kk, v)

  q = jax.ShapeDtypeStruct((b, t, n, h), BF16)
  kv = jax.ShapeDtypeStruct((b, s, k, h), BF16)
  text = _lower(fn, q, kv, kv, jax.ShapeDtypeStruct((b, 1, t, s), jnp.bool_))
  assert _mosaic_kernels(text) >= 3 and "jaxflash_backward_dq" not in text


@contextlib.contextmanager
def x64_everywhere():
  """jax_enable_x64 for every thread, as a user's ``jax.config.update`` sets it: Mosaic GPU's
  interpreter lowers its warpgroups' programs on threads of its own, which do not see the
  thread-local ``jax.enable_x64(True)`` (under which the traced and lowered types disagreed:
  i32 loop carries against i64 block arguments)."""
  before = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", before)


def test_x64_numerics():
  """Under jax_enable_x64 the kernels (forward and the Mosaic backward) still match the
  reference. (In Mosaic GPU's interpreter a consumer's turn once mixed an int64 count with
  int32 ids: a TypeError on every interpreted call.)"""
  b, t, s, n, k, h = OPTION_SHAPE
  with x64_everywhere():
    check("mosaic", b=b, t=t, s=s, n=n, k=k, h=h, dtype=BF16, is_causal=True,
          **random_lengths(b, t, s, n, 0))


@needs_cuda_plugin
def test_persistent_partial_results_lower():
  def fn(q, k, v):
    call = _checks.normalise(q, k, v, is_causal=True)
    params = dataclasses.replace(call.params, partial=True)
    return flash.forward(mosaic.BACKEND, call.inputs, params,
                         mosaic.Config(block_kv=64, persistent_ctas=132))
  q = jax.ShapeDtypeStruct((2, 300, 4, 128), BF16)
  assert "mosaic_gpu" in _lower(fn, q, q, q)


# (64 in the variants: on a CPU it runs the support check and the XLA call only, which
# test_mosaic.py::test_fp8_partial_results[128] runs at another head dim, with the interpreter's
# key split, and [256] at the edge of the fit.)
@pytest.mark.parametrize("h", [pytest.param(64, marks=pytest.mark.variants), 128, 256])
def test_fp8_partial_results(h):
  """An FP8 call's partial results (ring attention's pieces): float32 O tiles of their own fit
  beside the FP8 K/V ring up to D = 256 (on 64-key tiles there; a 16-bit call's do not); the
  interpreter's key split at a mid-block offset, merged through the LSE, gives
  the whole FP8 call (per-token key factors sliced with their keys) within e4m3's rounding of
  P."""
  f8 = jnp.float8_e4m3fn
  q = jnp.zeros((2, 64, 4, h), f8)
  call = _checks.normalise(q, q, q)
  params = dataclasses.replace(call.params, partial=True)
  reason = _on_h100(lambda: mosaic.BACKEND.supports(call.inputs, params, devices.current()))
  assert reason is None, reason
  b, t, s, n, k = 2, 130, 200, 2, 1
  qf, kf, vf, _ = random_qkv(0, b, t, s, n, k, h)
  q8, q_descale = jaxflash.quantize_fp8(qf, block_size=1)
  k8, k_descale = jaxflash.quantize_fp8(kf, block_size=1)
  v8, v_descale = jaxflash.quantize_fp8(vf)
  options = dict(is_causal=True, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                 out_dtype=jnp.float32)
  whole = jaxflash.flash_attention(q8, k8, v8, implementation="xla", **options)
  if ON_GPU or h == 128:  # (one head dim in the interpreter: CI time)
    call = _checks.normalise(q8, k8, v8, interpret=not ON_GPU, **options)
    params = dataclasses.replace(call.params, partial=True)
    parts = [flash.forward(mosaic.BACKEND, partial.key_range(call.inputs, a, c), params,
                           mosaic.Config(block_kv=64)) for a, c in ((0, 70), (70, 200))]
    assert all(o.dtype == jnp.float32 for o, _ in parts)
    out, _ = partial.merge([o for o, _ in parts],
                           [jnp.swapaxes(_core.user_lse(l), 1, 2) for _, l in parts])
    assert rel_err(out, whole) < 3e-2


@needs_cuda_plugin
@pytest.mark.parametrize("h,causal", [(64, True), (128, True), (128, False), (256, True)])
def test_fp8_partial_results_lower(h, causal):
  """An FP8 partial result on the shipped config for it (its O tiles beside the K/V ring, and
  the ring of per-token key factors: at D = 256 they fill the forward's shared-memory budget
  exactly) lowers for CUDA."""
  f8 = jnp.float8_e4m3fn

  def fn(q8, k8, v8, q_descale, k_descale):
    call = _checks.normalise(q8, k8, v8, is_causal=causal, out_dtype=jnp.float32,
                             q_descale=q_descale, k_descale=k_descale)
    params = dataclasses.replace(call.params, partial=True)
    config = mosaic.default_config(h, f8, causal, 300, "NVIDIA H200", partial=True)
    return flash.forward(mosaic.BACKEND, call.inputs, params, config)
  spec = jax.ShapeDtypeStruct((2, 300, 4, h), f8)
  factors = jax.ShapeDtypeStruct((2, 300, 4), jnp.float32)
  assert "mosaic_gpu" in _lower(fn, spec, spec, spec, factors, factors)


def test_d128_calls_without_a_band_take_two_q_buffers():
  """`TUNED`: the D = 128 forward without a band loads the next item's Q into a second buffer
  on its persistent grid, which fits since the forward keeps no reduction scratch; a partial
  result's float32 O tiles leave room for one Q buffer only, so it keeps the grid with one."""
  config = mosaic.config.default_config
  for kind in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
    chosen = config(128, BF16, False, 16384, kind)
    assert (chosen.q_buffers, chosen.persistent_ctas, chosen.kv_multicast) == (2, 132, True)
    # (It fits only within the forward's budget: the backward's keeps the reduction scratch.)
    assert mosaic.config.smem_bytes(chosen, 128) > mosaic.config.SMEM_BUDGET
    assert mosaic.config.fits(chosen, 128)
    split = config(128, BF16, False, 16384, kind, partial=True)
    assert (split.q_buffers, split.persistent_ctas) == (1, 132)
    assert not mosaic.config.fits(dataclasses.replace(split, q_buffers=2), 128, partial=True)
  assert config(128, BF16, True, 16384, "NVIDIA H200").q_buffers == 1  # (one CTA a tile)


def test_short_d64_calls_without_a_band_take_two_q_buffers():
  """`TUNED`: the D = 64 forward without a band runs 256-key tiles on a persistent grid with
  two Q buffers (on an H200 below the rows from which three consumers take over), partial
  results too; from those rows on, three consumers on one CTA a tile."""
  config = mosaic.config.default_config
  for partial in (False, True):
    chosen = config(64, BF16, False, 1024, "NVIDIA H200", partial=partial)
    assert (chosen.block_kv, chosen.persistent_ctas, chosen.q_buffers) == (256, 132, 2)
  long = config(64, BF16, False, 4096, "NVIDIA H200")
  assert (long.consumers, long.persistent_ctas, long.q_buffers) == (3, None, 1)


@needs_cuda_plugin
@pytest.mark.parametrize("h,hv,causal,partial_result", [
    (128, 128, False, False),  # `TUNED`'s two Q buffers on the persistent grid
    (128, 128, False, True),  # one, beside a partial result's float32 O tiles
    (128, 128, True, True),  # 128-key tiles beside them (64-key ones before)
    (192, 256, True, False)])  # a wider V's own O tiles (Triton's forward before)
def test_configs_within_the_forward_budget_lower(h, hv, causal, partial_result):
  """Default configs that fit only within `FORWARD_SMEM_BUDGET` (the forward reserves no
  reduction scratch) pass Mosaic GPU's own shared-memory check, which counts what
  `smem_bytes` leaves out (barriers, alignment, any reduction scratch)."""
  config = mosaic.default_config(h, BF16, causal, 4096, "NVIDIA H200", partial=partial_result,
                                 value_dim=hv)
  size = mosaic.config.smem_bytes(config, h, partial_result, value_dim=hv)
  assert mosaic.config.SMEM_BUDGET < size <= mosaic.config.FORWARD_SMEM_BUDGET

  def fn(q, k, v):
    call = _checks.normalise(q, k, v, is_causal=causal)
    params = dataclasses.replace(call.params, partial=partial_result)
    return flash.forward(mosaic.BACKEND, call.inputs, params, config)
  q = jax.ShapeDtypeStruct((1, 4096, 4, h), BF16)
  v = jax.ShapeDtypeStruct((1, 4096, 4, hv), BF16)
  assert "mosaic_gpu" in _lower(fn, q, q, v)


@needs_cuda_plugin
@pytest.mark.parametrize("h", [64, 128])
def test_partial_results_lower(h):
  """The float32 O tiles of a partial result, at a key offset (a key split's second range)."""
  def fn(q, k, v):
    call = _checks.normalise(q, k, v, is_causal=True)
    params = dataclasses.replace(call.params, partial=True)
    inputs = partial.key_range(call.inputs, 21, k.shape[1])
    return flash.forward(mosaic.BACKEND, inputs, params, mosaic.default_config(
        h, BF16, True, q.shape[1], "NVIDIA H100", partial=True))
  q = jax.ShapeDtypeStruct((2, 300, 4, h), BF16)
  kv = jax.ShapeDtypeStruct((2, 1000, 2, h), BF16)
  assert "mosaic_gpu" in _lower(fn, q, kv, kv)


def _gradients(config=None, **options):
  def fn(q, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(_forward(config, **options)(q, k, v).astype(
        jnp.float32)), argnums=(0, 1, 2))(q, k, v)
  return fn


def _mosaic_kernels(text: str) -> int:
  return text.count("custom_call @mosaic_gpu")


@needs_cuda_plugin
@pytest.mark.parametrize("backward,kernels", [
    (mosaic.Backward(), 3), (mosaic.Backward(one_pass=True), 2), (None, 1)])
def test_gradients_lower_with_either_backward(backward, kernels):
  """Three Mosaic GPU kernels (forward, dQ, dK/dV), two with ``one_pass`` (the forward, and
  dK/dV with dQ in one pass), or the Mosaic forward with the Triton backward when
  ``Config.backward`` is None."""
  text = _lower(_gradients(mosaic.Config(backward=backward), is_causal=True), Q, KV, KV)
  assert _mosaic_kernels(text) == kernels
  assert ("jaxflash_backward_dq" in text) == (backward is None)
  assert "jaxflash_forward" not in text


@needs_cuda_plugin
def test_one_pass_semaphores_are_shared():
  """The one-pass kernel's ordering semaphores, one per (batch row, head, 64-row query block,
  consumer), are one zero-initialised set that every CTA sees: scratch semaphores would be a
  set per CTA, on which a key tile would wait forever for the one before it."""
  q = jax.ShapeDtypeStruct((2, 1000, 4, 128), BF16)
  kv = jax.ShapeDtypeStruct((2, 777, 2, 128), BF16)
  one_pass = mosaic.Config(backward=mosaic.Backward(one_pass=True))
  text = _lower(_gradients(one_pass, is_causal=True), q, kv, kv)
  shared = 2 * 4 * (1024 // 64) * 2
  per_cta = shared * 2 * 7 * 2  # (K/V heads, key tiles, batch rows)
  assert f"tensor<{shared}xi32>" in text and f"tensor<{per_cta}xi32>" not in text


# (Five in the variants, each the same kernels on other tiles than a case that CI lowers, e.g.
# test_mosaic.py::test_backward_tiles_lower[64-64-1-40-True-True]:
# - [64-128-2-128-True-False]: `LOADS_BACKWARD`'s D = 128 tiles (128-key dQ tiles), which
#   test_score_mod.py::test_mosaic_kernels_lower_for_cuda[relative_table] lowers with a causal
#   band (its lookups take them) and test_mosaic.py::test_block_masks_lower[mask_mod-128];
# - [64-64-3-64-False-True]: [64-64-1-40-True-True]'s dK/dV and dQ kernels at D = 64 on a ring
#   of three, without a band (test_mosaic.py::test_block_masks_lower[dense-64] lowers D = 64's
#   without one);
# - [128-128-2-40-False-True]: [128-64-2-64-False-True]'s one pass (40 pads to 64 outside the
#   kernels, and the one pass runs no dQ kernel to take dq_block_kv);
# - [64-64-2-128-False-True] and [64-64-1-128-True-True]: the one pass at D = 128
#   (test_mosaic.py::test_gradients_lower_with_either_backward[backward1-2], 64-row tiles on a
#   ring of two, with a band), without a band ([128-64-2-64-False-True]) and on a ring of one
#   ([64-64-1-40-True-True]).)
@needs_cuda_plugin
@pytest.mark.parametrize("dkv_block_q,dq_block_kv,stages,h,causal,one_pass", [
    (64, 64, 1, 40, True, True), (128, 64, 2, 64, False, True),
    pytest.param(64, 128, 2, 128, True, False, marks=pytest.mark.variants),
    pytest.param(64, 64, 3, 64, False, True, marks=pytest.mark.variants),
    pytest.param(128, 128, 2, 40, False, True, marks=pytest.mark.variants),
    pytest.param(64, 64, 2, 128, False, True, marks=pytest.mark.variants),
    pytest.param(64, 64, 1, 128, True, True, marks=pytest.mark.variants)])
def test_backward_tiles_lower(dkv_block_q, dq_block_kv, stages, h, causal, one_pass):
  """Backward tiles that fit, each lowered as the Mosaic backward (two kernels where dQ comes
  from the dK/dV kernel, three where it cannot or ``one_pass`` is off)."""
  q = jax.ShapeDtypeStruct((2, 1000, 4, h), BF16)
  kv = jax.ShapeDtypeStruct((2, 777, 2, h), BF16)
  backward = mosaic.Backward(dkv_block_q=dkv_block_q, dq_block_kv=dq_block_kv,
                             dkv_stages=stages, dq_stages=stages, one_pass=one_pass)
  assert mosaic.config.backward_smem_bytes(backward, h) <= mosaic.config.SMEM_BUDGET
  config = mosaic.Config(backward=backward)
  kernels = 2 if backward.runs_one_pass(mosaic.config.padded_head_dim(h)) else 3
  text = _lower(_gradients(config, is_causal=causal), q, kv, kv)
  assert _mosaic_kernels(text) == kernels


# (128 in the variants: its backward, D = 128's shipped partial tiles (64-row and 64-key tiles
# with float32 ones out) per key range, lowers in
# test_mosaic.py::test_partial_calls_with_a_mask_mod_lower, its causal forward's partial tiles
# in test_mosaic.py::test_configs_within_the_forward_budget_lower[128-128-True-True], and [64]
# holds a causal band across the key ranges, forward and backward.)
@needs_cuda_plugin
@pytest.mark.parametrize("h", [64, pytest.param(128, marks=pytest.mark.variants)])
def test_partial_backward_lowers(h):
  """Partial calls' gradients (keys split in two ranges) on the Mosaic backward with its float32
  tiles: a forward, dQ and dK/dV per range, all Mosaic, no Triton."""
  def fn(q, k, v):
    def loss(q, k, v):
      call = _checks.normalise(q, k, v, is_causal=True)
      config = mosaic.default_config(h, BF16, True, q.shape[1], "NVIDIA H200", partial=True)
      out, _ = partial.split_keys_attention(call.inputs, call.params, mosaic.BACKEND, config,
                                            (300,))
      return out.astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  q = jax.ShapeDtypeStruct((2, 300, 4, h), BF16)
  kv = jax.ShapeDtypeStruct((2, 1000, 2, h), BF16)
  text = _lower(fn, q, kv, kv)
  assert _mosaic_kernels(text) == 6
  assert "jaxflash_backward_dq" not in text


@needs_cuda_plugin
@pytest.mark.parametrize("h,causal", [(192, True), (256, False)])
def test_wide_head_backward_lowers(h, causal):
  """Head dims above 128 with the shipped tiles: the forward, dQ and the two dK/dV passes (at
  D = 256 with 32-row tiles, which wgmma contracts only at the 64-byte swizzle), no Triton."""
  q = jax.ShapeDtypeStruct((2, 1000, 4, h), BF16)
  kv = jax.ShapeDtypeStruct((2, 777, 2, h), BF16)
  config = mosaic.default_config(h, BF16, causal, 1000, "NVIDIA H200")
  text = _lower(_gradients(config, is_causal=causal), q, kv, kv)
  assert "mosaic_gpu" in text and "jaxflash_backward_dq" not in text


# (16 tokens in the variants: test_mosaic.py::test_decode_lowers[1] lowers the same kernels on
# the same tiles (the shipped causal D = 128 ones for a few rows, padded to one query tile); the
# token count changes only the shifted band's diagonal and the grids.)
@needs_cuda_plugin
@pytest.mark.parametrize("t", [1, pytest.param(16, marks=pytest.mark.variants)])
def test_decode_lowers(t):
  """`jaxflash.decode_attention` on the Mosaic backend (its forward with a shifted band, its
  backward under jax.grad), GQA 32/8, a paged cache."""
  q = jax.ShapeDtypeStruct((2, t, 32, 128), BF16)
  pages = jax.ShapeDtypeStruct((40, 64, 8, 128), BF16)
  table = jax.ShapeDtypeStruct((2, 16), jnp.int32)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)

  def fn(q, pages, table, lengths):
    def loss(q):
      out = jaxflash.decode_attention(q, pages, pages, lengths, page_table=table,
                                      implementation="mosaic")
      return jnp.sum(out.astype(jnp.float32))
    return jax.value_and_grad(loss)(q)

  assert _mosaic_kernels(_lower(fn, q, pages, table, lengths)) >= 2


@needs_cuda_plugin
def test_lowering_check_can_fail(monkeypatch):
  """The check is real: tiles that break the TMA's 8-row rule must be refused by the lowering."""
  from jaxflash.backends.mosaic import forward
  monkeypatch.setattr(forward, "_round_up", lambda x, multiple: x)
  q = jax.ShapeDtypeStruct((1, 300, 2, 64), BF16)
  with pytest.raises(Exception, match="multiple of its tiling"):
    _lower(_forward(), q, q, q)


# --------------------------------------------------------------------------------------------
# Numerics: compiled on a Hopper GPU, and in Mosaic GPU's interpreter on a CPU (which runs the
# same kernel, barriers and TMA copies included, but P V as a plain dot: it has no wgmma with an
# operand in registers). The interpreter takes ~10 s a call, so the CPU runs smaller shapes.

gpu = pytest.mark.gpu
# (b, t, s, n, k, h) of the option tests: a partial query tile, padded keys and a masked last
# key block, GQA; 2 CTAs of query rows on the GPU.
OPTION_SHAPE = (2, 200, 333, 4, 2, 128) if ON_GPU else (2, 70, 133, 2, 1, 64)


def _run(q, k, v, config=None, **options):
  return attention_with_config(q, k, v, implementation="mosaic", config=config,
                               interpret=not ON_GPU, **options)


def _bad_cells(got, want, tol=2e-2):
  """(batch, head, 64-row block) cells of [B, T, N, H] outputs whose relative error exceeds tol."""
  b, t, n, _ = want.shape
  bad = []
  for i in range(b):
    for h in range(n):
      for r in range(0, t, 64):
        g, w = got[i, r:r + 64, h], want[i, r:r + 64, h]
        err = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-6)
        if not err <= tol:
          bad.append((i, h, r, round(float(err), 4)))
  return bad


@gpu
@pytest.mark.parametrize("t,s,n,k,causal", [
    (4096, 4096, 4, 4, False),  # the benchmark's aligned shape (a few heads)
    (4096, 4096, 4, 2, True),  # GQA
    (200, 333, 4, 2, False),  # partial query tile, padded keys, masked last key block
    (200, 333, 4, 4, True),
    (1, 1, 1, 1, False)])
def test_forward_cells_on_gpu(t, s, n, k, causal):
  """Forward only, every batch row, head and 64-row block against the float32 reference, with
  the shipped and the smallest tiles, the natural launch order and persistent grids of one CTA
  per SM and of 7 CTAs, of 7 CTAs with two Q buffers, of 8 in pairs sharing K/V with two Q
  buffers (`TUNED`'s D = 128 tiles without a band, several items a CTA), and of 7 taking paired
  tiles with O through the Q tiles (the message lists the wrong cells)."""
  q, kk, v, _ = random_qkv(3, 3, t, s, n, k, 128, BF16)
  for config in (None, SMALL_CONFIGS["mosaic"], mosaic.Config(heavy_first=False),
                 mosaic.Config(persistent_ctas=132), mosaic.Config(persistent_ctas=7),
                 mosaic.Config(block_kv=64, persistent_ctas=7, q_buffers=2),
                 mosaic.Config(intra_wg_overlap=True, persistent_ctas=8, kv_multicast=True,
                               q_buffers=2),
                 mosaic.Config(persistent_ctas=7, paired_tiles=True, o_through_q=True,
                               intra_wg_overlap=True)):
    got = _run(q, kk, v, config, is_causal=causal)
    want, _ = reference_attention(q, kk, v, is_causal=causal)
    bad = _bad_cells(np.asarray(got, np.float32), np.asarray(want))
    assert not bad, f"config {config}: {len(bad)} wrong cells, first {bad[:12]}"


# On a CPU only the options that test_every_supported_option_at_once does not hold (test_sinks
# runs sinks on the Mosaic kernels).
NUMERIC_OPTIONS = SUPPORTED if ON_GPU else ("none", "scale_negative")


# Variants of an interpreter test whose base case (every option at once, the shipped tiles) runs
# too: the GPU runs them all, and a CPU with JAXFLASH_ALL_VARIANTS=1 (tests/conftest.py); CI and
# the README's command skip them.
variant = pytest.mark.variants


@pytest.mark.parametrize("option", [pytest.param(option, marks=variant)
                                    for option in NUMERIC_OPTIONS])
def test_option(option):
  """Forward, LSE and gradients (the Mosaic backward; the Triton one for a mask or bias)."""
  b, t, s, n, k, h = OPTION_SHAPE
  check("mosaic", b=b, t=t, s=s, n=n, k=k, h=h, dtype=BF16, **OPTIONS[option](b, t, s, n, 0))


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h", [64, 128])
def test_partial_results_on_the_persistent_grid_on_gpu(h, causal):
  """The default partial forward (float32 O tiles) over two key ranges, merged, equals the
  float32 reference: at D = 128 without a band on the persistent grid, pairs sharing K/V, with
  one on 128-key tiles; at D = 64 on the persistent grids with two Q buffers (256-key tiles
  without a band, paired tiles with one)."""
  q, kk, v, _ = random_qkv(8, 2, 1000, 1500, 4, 2, h, BF16)
  call = _checks.normalise(q, kk, v, is_causal=causal)
  params = dataclasses.replace(call.params, partial=True)
  config = mosaic.default_config(h, BF16, causal, 1000, jax.devices()[0].device_kind,
                                 partial=True)
  parts = [flash.forward(mosaic.BACKEND, partial.key_range(call.inputs, a, b), params, config)
           for a, b in ((0, 700), (700, 1500))]
  out, _ = partial.merge([o for o, _ in parts],
                         [jnp.swapaxes(_core.user_lse(l), 1, 2) for _, l in parts])
  want, _ = reference_attention(q, kk, v, is_causal=causal)
  bad = _bad_cells(np.asarray(out, np.float32), np.asarray(want))
  assert not bad, f"config {config}: {len(bad)} wrong cells, first {bad[:12]}"


@gpu  # (on a CPU, test_partial_backward's split forward covers it)
def test_key_split_equals_whole_call():
  """Float32 partial forwards over keys split mid-block (21) and at a word of the dense mask's
  packing (96), at a key offset, with causal masking, a dense mask and dropout at absolute
  positions, merged through the LSE, equal the whole call."""
  b, t, s, n, k, h = OPTION_SHAPE
  q, kk, v, _ = random_qkv(5, b, t, s, n, k, h, BF16)
  mask = jax.random.bernoulli(jax.random.key(4), 0.7, (b, 1, t, s))
  call = _checks.normalise(q, kk, v, mask=mask, is_causal=True, dropout_rate=0.2,
                           dropout_rng=jax.random.key(3), interpret=not ON_GPU)
  config = SMALL_CONFIGS["mosaic"]
  out, lse = flash.attention(call.inputs, call.params, mosaic.BACKEND, config)
  got_out, got_lse = partial.split_keys_attention(call.inputs, call.params, mosaic.BACKEND,
                                                  config, (21, 96))
  assert rel_err(got_out, out) < 1e-2  # the whole call rounds O to bfloat16 once more
  finite = np.isfinite(np.asarray(lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(got_lse)), finite)
  assert rel_err(np.where(finite, got_lse, 0), np.where(finite, lse, 0)) < 1e-5


@pytest.mark.parametrize("h", [64, pytest.param(128, marks=gpu)])  # (CI time)
def test_partial_backward(h, monkeypatch):
  """Partial calls' gradients from the Mosaic backward itself (float32, out through float32
  tiles): keys split mid-block (21), each range's backward run with the global LSE and delta
  and summed, equal the float32 reference's gradients, with causal masking, dropout, GQA and
  lengths; no Triton backward runs."""
  from jaxflash.backends.triton import backward as triton_backward

  def no_triton(*args, **kwargs):
    raise AssertionError("the Triton backward ran")

  monkeypatch.setattr(triton_backward, "backward", no_triton)
  b, t, s, n, k, _ = OPTION_SHAPE
  q, kk, v, d_out = random_qkv(6, b, t, s, n, k, h, BF16)
  # Lengths that leave keys past the split visible in both rows (random ones once hid all of
  # the second range, and a dQ that dropped its entries at the wrong key offset passed).
  lengths = dict(query_seq_lengths=jnp.array([t, 3 * t // 4], jnp.int32),
                 key_value_seq_lengths=jnp.array([s - 10, s // 2], jnp.int32))
  options = dict(is_causal=True, dropout_rate=0.2, dropout_rng=jax.random.key(3), **lengths)
  config = SMALL_CONFIGS["mosaic"]

  def split(q, kk, v):
    call = _checks.normalise(q, kk, v, interpret=not ON_GPU, **options)
    return partial.split_keys_attention(call.inputs, call.params, mosaic.BACKEND, config,
                                        (21,))[0]

  def whole(q, kk, v):  # the same call, unsplit, in float32 on the XLA backend (same dropout)
    return attention_with_config(q, kk, v, implementation="xla", **options)

  def grads(fn, *args):
    out, vjp = jax.vjp(fn, *args)
    return vjp(d_out.astype(out.dtype))

  got = jax.jit(lambda *x: grads(split, *x))(q, kk, v)
  want = grads(whole, *(x.astype(jnp.float32) for x in (q, kk, v)))
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    assert g.dtype == BF16, name  # (the float32 shares are summed, then cast once)
    assert rel_err(g, w) < 2e-2, name


def _partial_mask_mod(s: int):
  ids = jnp.asarray(np.random.RandomState(8).randint(0, 2, (2, s)))
  # Reads both indices in the tile rule (the kernels add the offsets) and an array at them.
  return lambda b, h, q, kv: (ids[b, q] == ids[b, kv]) & ((q - kv) % 3 != 1) & (q + 40 >= kv)


def test_partial_calls_with_a_mask_mod():
  """Keys split mid-block at 22 (not a multiple of 3): each range's forward and backward see
  the mask_mod at absolute key positions, with its own features and block table; output and
  gradients equal the float32 reference given the mask densely."""
  b, t, s, n, k, h = OPTION_SHAPE
  q, kk, v, d_out = random_qkv(9, b, t, s, n, k, h, BF16)
  fn = _partial_mask_mod(s)
  config = SMALL_CONFIGS["mosaic"]

  def split(q, kk, v):
    call = _checks.normalise(q, kk, v, mask_mod=fn, interpret=not ON_GPU)
    return partial.split_keys_attention(call.inputs, call.params, mosaic.BACKEND, config,
                                        (22,))[0]

  def out_and_grads(attend, *args):
    out, vjp = jax.vjp(attend, *args)
    return (out, *vjp(d_out.astype(out.dtype)))

  got = jax.jit(lambda *x: out_and_grads(split, *x))(q, kk, v)
  dense = dense_mask_of(fn, b=b, t=t, s=s, n=n)
  want = out_and_grads(lambda *x: reference_attention(*x, mask=dense)[0],
                       *(x.astype(jnp.float32) for x in (q, kk, v)))
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert rel_err(g, w) < 2e-2, name


@needs_cuda_plugin
def test_partial_calls_with_a_mask_mod_lower():
  """The same partial calls at the shipped tiles: forward, dQ and dK/dV per range on Mosaic."""
  def fn(q, k, v):
    def loss(q, k, v):
      call = _checks.normalise(q, k, v, mask_mod=_partial_mask_mod(1000))
      config = mosaic.default_config(128, BF16, False, q.shape[1], "NVIDIA H200", partial=True,
                                     block_table=True)
      out, _ = partial.split_keys_attention(call.inputs, call.params, mosaic.BACKEND, config,
                                            (300,))
      return out.astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  q = jax.ShapeDtypeStruct((2, 300, 4, 128), BF16)
  kv = jax.ShapeDtypeStruct((2, 1000, 2, 128), BF16)
  text = _lower(fn, q, kv, kv)
  assert _mosaic_kernels(text) == 6 and "jaxflash_backward_dq" not in text


def test_every_supported_option_at_once():
  """Causal, window, soft cap, scale, mask, bias (and its gradient), segments, lengths and
  dropout (the mask the other backends draw, from absolute coordinates)."""
  b, t, s, n, k, h = OPTION_SHAPE
  options = OPTIONS["everything"](b, t, s, n, 0)
  check("mosaic", b=b, t=t, s=s, n=n, k=k, h=h, dtype=BF16, **options)


def _everything_but_dense(b, t, s, n, seed):
  options = OPTIONS["everything"](b, t, s, n, seed)
  return {name: x for name, x in options.items() if name not in ("mask", "bias")}


# The Mosaic backward's tiles: the shipped D = 64 ones (128-row query tiles in dK/dV, 128-key
# tiles in dQ) and a one-slot ring.
WIDE_BACKWARD = dataclasses.replace(SMALL_CONFIGS["mosaic"], backward=mosaic.Backward(
    dkv_block_q=128, dq_block_kv=128))
ONE_SLOT_BACKWARD = dataclasses.replace(SMALL_CONFIGS["mosaic"], backward=mosaic.Backward(
    dkv_stages=1, dq_stages=1))
SERIAL_BACKWARD = dataclasses.replace(SMALL_CONFIGS["mosaic"], backward=mosaic.Backward(
    serial_scores=True))


@pytest.mark.parametrize("option,config", [
    ("everything_but_dense", SMALL_CONFIGS["mosaic"]),
    ("everything_but_dense", SERIAL_BACKWARD),
    pytest.param("causal", WIDE_BACKWARD, marks=variant),
    pytest.param("everything_but_dense", WIDE_BACKWARD, marks=variant),
    pytest.param("lengths", ONE_SLOT_BACKWARD, marks=variant),
    pytest.param("causal", SERIAL_BACKWARD, marks=variant)])
def test_mosaic_backward(option, config):
  """The Mosaic backward with every option it serves at once (causal window, soft cap, scale,
  segments, lengths, dropout; GQA), and with other tiles: gradients against the reference.
  (`Backward.serial_scores` forms dSᵀ from the 16-bit Pᵀ, and from the undropped one under
  dropout.)"""
  b, t, s, n, k, h = OPTION_SHAPE
  make = _everything_but_dense if option == "everything_but_dense" else OPTIONS[option]
  check("mosaic", b=b, t=t, s=s, n=n, k=k, h=h, dtype=BF16, small=config,
        **make(b, t, s, n, 0))


@pytest.mark.parametrize("h,block_q,band", [
    (128, 64, False), pytest.param(64, 128, False, marks=gpu),
    pytest.param(128, 64, True, marks=variant)])
def test_one_pass_backward(h, block_q, band, monkeypatch):
  """dQ from the dK/dV kernel, with no dQ kernel: each consumer's part of a query block's dQ
  (half the head dim at D = 128, half the rows of a 128-row block at D = 64) from both
  consumers' dSᵀ tiles, stored by the first key tile to visit the block and added by the later
  ones (without the causal band, batch row 0 sees both of its key tiles everywhere); zero where
  no key tile visits (batch row 1 has 40 queries and no keys). GQA, and every option the
  backward serves."""
  _check_one_pass(monkeypatch, h, block_q, band, dict(one_pass=True))


def _check_one_pass(monkeypatch, h, block_q, band, fields, drop=(), **call):
  """`check` of the one-pass backward (``fields`` over ``block_q``-row tiles, the dQ kernel
  replaced by an error) on OPTION_SHAPE with every option the backward serves and short rows,
  without the causal window unless ``band`` and without the options named in ``drop``."""
  from jaxflash.backends.mosaic import backward

  def no_dq_kernel(*args, **kwargs):
    raise AssertionError("the dQ kernel ran")

  monkeypatch.setattr(backward, "_dq", no_dq_kernel)
  b, t, s, n, k, _ = OPTION_SHAPE
  config = dataclasses.replace(SMALL_CONFIGS["mosaic"], backward=mosaic.Backward(
      dkv_block_q=block_q, dq_block_kv=block_q, **fields))
  options = {**_everything_but_dense(b, t, s, n, 0), **_short_rows(b, t, s, n, 0)}
  drop = tuple(drop) + (() if band else ("local_window_size", "is_causal"))
  options = {name: x for name, x in options.items() if name not in drop}
  check("mosaic", b=b, t=t, s=s, n=n, k=k, h=h, dtype=BF16, small=config, **options, **call)


@pytest.mark.parametrize("h,block_q,band,segments", [
    (128, 64, False, False), (256, 32, True, True),
    pytest.param(64, 128, True, True, marks=variant),
    pytest.param(128, 64, True, True, marks=variant)])
def test_atomic_backward(h, block_q, band, segments, monkeypatch):
  """deterministic=False with ``Backward.atomic``: dQ from the dK/dV kernel (at D = 256 from
  the dK pass after the dV pass, in transposed parts), its parts added in any order into a
  float32 array that starts at zero (no dQ kernel, no ordering semaphores; a block table from
  segment ids too), against the reference with the options the backward serves. Batch row 1
  has no keys: no key tile visits its query blocks, whose dQ stays zero. D = 128 issues dQ's
  product before dK's, as shipped (`Backward.dq_before_dk`; on a GPU: the interpreter has no
  product order)."""
  from jaxflash.backends.mosaic import backward
  modes = []
  dkv = backward._dkv

  def spy(*args, **kwargs):
    modes.append(kwargs.get("atomic", False))
    return dkv(*args, **kwargs)

  monkeypatch.setattr(backward, "_dkv", spy)
  _check_one_pass(monkeypatch, h, block_q, band, dict(atomic=True, dq_before_dk=h == 128),
                 drop=() if segments else ("segment_ids",), deterministic=False)
  assert modes == ([False, True] if h > 128 else [True])  # (the dV pass, then dK with dQ)


def test_tile_major_launch_order():
  """`Backward.tile_major`'s recast of the grid: every (batch row, head, tile rank) once, ranks
  in launch order (Pallas walks the grid row-major, batch fastest), so for each (batch row,
  head) rank r launches after rank r - 1, and every rank-0 tile before any rank-1 one."""
  from jaxflash.backends.mosaic import backward, forward
  heads, tiles, batches = 3, 4, 2
  launched = [tuple(int(x) for x in backward._tile_major(
      forward.launch_place(h, t, b, tiles, batches), heads, batches))
      for h in range(heads) for t in range(tiles) for b in range(batches)]
  assert sorted(launched) == [(b, h, r) for b in range(batches) for h in range(heads)
                              for r in range(tiles)]
  assert [r for _, _, r in launched] == sorted(r for _, _, r in launched)


def _atomic_or_two_kernels(deterministic: bool, h: int = 64, **fields) -> mosaic.Backward:
  """Backward tiles with ``fields`` that run the two kernels (``deterministic``) or the atomic
  one pass; the latter at D = 64 on 128-row query tiles, as shipped (`dq_split` has no way for
  64-row ones there, which would quietly run the two kernels), and above D = 128 on the shipped
  D = 256 tiles (the dV pass, then a dK pass that forms dQ too)."""
  if deterministic:
    return mosaic.Backward(**fields)
  if h > 128:
    backward = dataclasses.replace(mosaic.config.BACKWARD_TUNED[256], atomic=True, **fields)
  else:
    backward = mosaic.Backward(atomic=True, **(dict(dkv_block_q=128) if h == 64 else {}),
                               **fields)
  assert backward.one_pass_mode(h, deterministic=False, q_len=300) == "atomic"
  return backward


@pytest.mark.parametrize("deterministic", [True, pytest.param(False, marks=variant)])
def test_tile_major_backward(deterministic):
  """The backward with `Backward.tile_major` (a causal band's tiles launched by cost across
  every batch row and head): several key and query tiles per head, GQA and two batch rows with
  lengths of their own, against the reference; the two kernels, or the atomic one pass. (On a
  CPU two tiles of GQA 2/1, both with work in both rows: 187 and 139 queries, 142 and 164
  keys.)"""
  config = dataclasses.replace(SMALL_CONFIGS["mosaic"], backward=_atomic_or_two_kernels(
      deterministic, tile_major=True))
  b, t, s, n, k, seed = (2, 300, 300, 4, 2, 1) if ON_GPU else (2, 200, 200, 2, 1, 15)
  check("mosaic", b=b, t=t, s=s, n=n, k=k, h=64, dtype=BF16, small=config, is_causal=True,
        deterministic=deterministic, **random_lengths(b, t, s, n, seed))


@pytest.mark.parametrize("deterministic,tile_major,parts", [
    (True, False, 2), (False, False, 4), pytest.param(False, False, 2, marks=variant),
    pytest.param(False, True, 2, marks=variant)])
def test_backward_with_group_parts(deterministic, tile_major, parts):
  """`Backward.group_parts`: a K/V head's query heads split over two or four CTAs per key tile
  (four: one query head each, as the shipped atomic one pass for GQA with a causal band), whose
  dK and dV sums are added after the kernel; the two kernels or the atomic one pass, launched
  head by head or tile-major, GQA 4/1 and two batch rows with lengths of their own, a causal
  band, against the reference. (On a CPU two query and two key tiles with work in row 0: 176
  and 33 queries, 172 and 115 keys.)"""
  config = dataclasses.replace(SMALL_CONFIGS["mosaic"], backward=_atomic_or_two_kernels(
      deterministic, group_parts=parts, tile_major=tile_major))
  t, seed = (300, 3) if ON_GPU else (200, 32)
  check("mosaic", b=2, t=t, s=t, n=4, k=1, h=64, dtype=BF16, small=config, is_causal=True,
        deterministic=deterministic, **random_lengths(2, t, t, 4, seed))


def test_staggered_atomic_backward():
  """`Backward.stagger`: each key tile of the atomic one pass starts its full query blocks at
  its own place and wraps round (its producer loads them in that order too); no causal band,
  GQA, lengths of their own, against the reference. (On a CPU GQA 2/1, 3 key tiles and 3 query
  blocks of 128 rows: tile 1 walks blocks 1, 2, 0; tile 2 reaches past the key length, so all
  its blocks are masked and keep their order.)"""
  config = dataclasses.replace(SMALL_CONFIGS["mosaic"], backward=_atomic_or_two_kernels(
      False, stagger=True))
  b, t, s, n, k = (2, 700, 600, 4, 2) if ON_GPU else (1, 300, 300, 2, 1)
  lengths = dict(query_seq_lengths=jnp.array([t - 37, t][:b]),
                 key_value_seq_lengths=jnp.array([s - 5, s][:b]))
  check("mosaic", b=b, t=t, s=s, n=n, k=k, h=64, dtype=BF16, small=config,
        deterministic=False, **lengths)


@pytest.mark.parametrize("deterministic", [False, pytest.param(True, marks=variant)])
def test_backward_reading_lse_rows_early(deterministic):
  """`Backward.early_rows`: the dK/dV kernel reads a query block's LSE rows before waiting on
  its wgmmas; the atomic one pass or the two kernels, GQA, a causal band and lengths of their
  own, against the reference. (On a CPU GQA 2/1, 5 keys in batch row 0 and 162 queries and
  keys in row 1: two query blocks and two key tiles, a group's visits wrapping the ring.)"""
  config = dataclasses.replace(SMALL_CONFIGS["mosaic"], backward=_atomic_or_two_kernels(
      deterministic, early_rows=True))
  b, t, s, n, k, seed = (2, 300, 300, 4, 2, 5) if ON_GPU else (2, 200, 200, 2, 1, 5)
  check("mosaic", b=b, t=t, s=s, n=n, k=k, h=64, dtype=BF16, small=config, is_causal=True,
        deterministic=deterministic, **random_lengths(b, t, s, n, seed))


@pytest.mark.parametrize("h,causal", [(256, True), pytest.param(200, False, marks=variant)])
def test_atomic_dk_pass_forms_dq_above_head_dim_128(h, causal):
  """Above head dim 128 the atomic backward runs the dV pass, then a dK pass that forms dQ too:
  each consumer's transposed parts (dQᵀ = Kᵀ dSᵀ, 64 head-dim columns at a time, the last one
  sent during the next visit) added into a transposed dQ (`mosaic.config.dq_split`'s
  ``"transposed"``). Several key tiles and query blocks, T != S, GQA, two batch rows with
  lengths of their own, against the reference. (A part lost, sent twice or to the wrong columns
  fails: a broken last part gave dQ a relative error of 0.6. On a CPU GQA 2/1, 146 and 189
  queries, 133 and 77 keys: with a causal band both key tiles add into query block 4 of row 0,
  and parts stored instead of added gave 0.15.)"""
  backward = _atomic_or_two_kernels(False, 256)
  assert mosaic.config.dq_split(backward.dkv_block_q, 256) == "transposed"
  # (Transposed parts are added in no fixed order: never the ordered one pass.)
  ordered = dataclasses.replace(backward, one_pass=True)
  assert ordered.one_pass_mode(256, deterministic=True, q_len=300) is None
  assert dataclasses.replace(ordered, dkv_block_q=32).one_pass_mode(128, True, 300) is None
  config = dataclasses.replace(SMALL_CONFIGS["mosaic"], backward=backward)
  b, t, s, n, k, seed = (2, 300, 200, 4, 2, 9) if ON_GPU else (2, 200, 150, 2, 1, 4)
  check("mosaic", b=b, t=t, s=s, n=n, k=k, h=h, dtype=BF16, small=config,
        is_causal=causal, deterministic=False, **random_lengths(b, t, s, n, seed))


def test_group_parts_divide_the_group():
  """`Backward.parts_of`: ``group_parts`` where it divides the group, else one CTA per key tile;
  and it must be a positive int."""
  parts = mosaic.Backward(group_parts=2)
  assert (parts.parts_of(8), parts.parts_of(2), parts.parts_of(3), parts.parts_of(1)) == (
      2, 2, 1, 1)
  for bad in (0, -1, True, None, 2.0):
    with pytest.raises(ValueError, match="group_parts"):
      mosaic.Backward(group_parts=bad)
  for bad in (0, True):
    with pytest.raises(ValueError, match="atomic_group_parts"):
      mosaic.Backward(atomic_group_parts=bad)


def test_atomic_pass_takes_its_own_fields():
  """`Backward.atomic_pass`: the atomic one pass's own register count, launch order and parts
  where set, the shared ones where None."""
  shared = mosaic.Backward(registers=232, tile_major=True, group_parts=2)
  assert shared.atomic_pass() == shared
  own = dataclasses.replace(shared, atomic_registers=240, atomic_tile_major=False,
                            atomic_group_parts=4).atomic_pass()
  assert (own.registers, own.tile_major, own.group_parts) == (240, False, 4)


@gpu  # (the interpreter runs each slice's call alike; compiled kernels once lost dQ in a loop)
@pytest.mark.parametrize("h", [64, 256])
def test_atomic_backward_under_vmap(h):
  """The atomic backward's zeroed float32 array is made inside the backward: under vmap every
  slice gets its own (one shared array would sum the slices' dQ), and the kernels' additions
  reach it (inside a `lax.map` on a GPU they did not); at D = 256 a transposed one."""
  backward = _atomic_or_two_kernels(False, h, **(dict(dq_block_kv=128) if h == 64 else {}))
  config = dataclasses.replace(SMALL_CONFIGS["mosaic"], backward=backward)
  q, kk, v, _ = random_qkv(4, 2, 70, 150, 2, 1, h, BF16)
  fn = lambda q, k, v: _run(q[None], k[None], v[None], config=config,  # noqa: E731
                            deterministic=False)[0]
  loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2)  # noqa: E731
  batched = jax.grad(lambda q: jnp.sum(jax.vmap(loss)(q, kk, v)))(q)
  for i in range(2):
    single = jax.grad(loss)(q[i], kk[i], v[i])
    np.testing.assert_allclose(np.asarray(batched[i], np.float32),
                               np.asarray(single, np.float32), rtol=2e-2, atol=2e-2)


def test_h100_causal_d64_takes_the_paired_grid_at_every_length():
  """`TUNED_FROM_LENGTH` is empty since the paired persistent grid measured faster than one CTA
  per tile on an H100 from 1k rows (2026-12-05; before, it took one CTA per tile below 8k):
  the causal D = 64 forward below three consumers' 8k runs `TUNED`'s grid on both cards."""
  config = mosaic.config.default_config
  for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
    for rows in (1024, 4096):
      chosen = config(64, BF16, True, rows, kind)
      assert (chosen.persistent_ctas, chosen.q_buffers, chosen.paired_tiles) == (132, 2, True)
  assert config(64, BF16, False, 1024, "NVIDIA H100 80GB HBM3").persistent_ctas == 132


@pytest.mark.parametrize("kind", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_long_d64_calls_take_three_consumers(kind):
  """`THREE_CONSUMERS_FROM_LENGTH`: on an H200 and an H100 the bf16 D = 64 forward runs three
  consumer warpgroups from 2k query rows without a causal band and from 8k with one (where they
  measured faster); shorter calls, other head dims, FP8 and an unmeasured card keep two."""
  config = mosaic.config.default_config
  three = lambda *args: config(*args).consumers == 3  # noqa: E731
  assert three(64, BF16, False, 2048, kind) and three(64, BF16, True, 8192, kind)
  assert three(40, BF16, False, 8192, kind)  # (padded to 64)
  assert not three(64, BF16, False, 1024, kind) and not three(64, BF16, True, 4096, kind)
  assert not three(128, BF16, False, 16384, kind)
  assert not three(64, jnp.float8_e4m3fn, False, 16384, kind)
  assert not three(64, BF16, False, 16384, "NVIDIA H100 PCIe")
  chosen = config(64, BF16, False, 4096, kind)
  assert (chosen.registers, chosen.producer_registers, chosen.rows_per_cta) == (160, 24, 192)
  assert mosaic.config.fits(chosen, 64)


@pytest.mark.parametrize("kind", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_narrow_windows_keep_two_consumers(kind):
  """A local window bounds every key walk, so `THREE_CONSUMERS_FROM_LENGTH` is read at the keys a
  row sees: gpt-oss's call (16k, GQA 64/8, D = 64, causal, 128 keys back) keeps `TUNED`'s paired
  persistent grid, which ran its forward 1.6x faster on an H100; a window as wide as the length
  rule still takes three consumers. The backend hands the window's width to the choice."""
  from jaxflash import masking
  config = mosaic.config.default_config
  gpt_oss = config(64, BF16, True, 16384, kind, groups=8, window_keys=129)
  assert gpt_oss.consumers == 2 and gpt_oss.paired_tiles and gpt_oss.persistent_ctas == 132
  assert config(64, BF16, True, 16384, kind, groups=8, window_keys=8192).consumers == 3
  assert config(64, BF16, True, 16384, kind, groups=8).consumers == 3
  window = lambda *args: masking.make_window(*args).keys_per_row  # noqa: E731
  assert window(True, (128, 0)) == 129
  assert window(False, (3, 5)) == 9
  assert window(True, None) is None
  assert window(False, (128, None)) is None
  q = jax.ShapeDtypeStruct((1, 16384, 8, 64), BF16)
  kv = jax.ShapeDtypeStruct((1, 16384, 1, 64), BF16)
  device = devices.Device("gpu", kind, True, cores=132)
  for size, want in (((128, 0), 2), (None, 3)):
    call = _checks.normalise(q, kv, kv, is_causal=True, local_window_size=size)
    assert mosaic.BACKEND.default_config(call.inputs, call.params, device).consumers == want


@pytest.mark.parametrize("kind", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_short_causal_calls_launch_in_natural_order(kind):
  """Causal calls of at most `NATURAL_ORDER_ROWS` query rows on one CTA per tile launch their
  tiles in natural order (measured faster at 512); longer ones, persistent grids and calls
  without a causal band keep heaviest first."""
  config = mosaic.config.default_config
  rows = mosaic.config.NATURAL_ORDER_ROWS
  assert not config(128, BF16, True, rows, kind).heavy_first
  assert config(128, BF16, True, rows + 1, kind).heavy_first
  assert config(128, BF16, False, rows, kind).heavy_first
  d64 = config(64, BF16, True, rows, kind)  # (a persistent grid: 512 at `TUNED`'s tiles)
  assert d64.heavy_first and d64.persistent_ctas == 132


@pytest.mark.parametrize("h,t,causal,deterministic,partial_call,want", [
    (64, 256, True, False, False, "atomic"), (64, 256, False, True, False, None),
    (40, 256, False, False, False, "atomic"), (64, 256, False, False, True, None),
    (128, 1024, False, False, False, "atomic"), (128, 8192, True, False, False, "atomic"),
    (128, 8192, False, True, False, None), (128, 256, True, False, True, None),
    (256, 16384, False, False, False, "atomic"), (256, 1024, False, False, False, "atomic"),
    (256, 2048, True, False, False, "atomic"), (256, 1024, True, False, False, None),
    (256, 4096, False, True, False, None)])
def test_atomic_backward_where_it_measured_faster(h, t, causal, deterministic, partial_call,
                                                  want):
  """The shipped tiles (`ATOMIC_TUNED`) take the atomic one pass for calls that allow it where
  it measured faster than the deterministic kernels: head dims up to 128, causal or not, and
  at D = 256 (the dK pass forming dQ too) but for causal calls below 2048 rows; in partial
  calls (float32 gradients) and by default, the deterministic kernels run."""
  from jaxflash.backends.mosaic import backward
  q = jnp.zeros((1, t, 2, h), BF16)
  call = _checks.normalise(q, q, q, deterministic=deterministic, is_causal=causal)
  params = dataclasses.replace(call.params, partial=partial_call)
  config = mosaic.default_config(h, BF16, causal, t, "NVIDIA H200")
  assert backward._one_pass_mode(call.inputs, params, config.backward) == want
  if want == "atomic":  # (D = 128: 240 registers measured faster than 232, `ATOMIC_TUNED`,
    # and dQ's part sent while dK's product runs)
    assert config.backward.atomic_pass().registers == (240 if h == 128 else
                                                       config.backward.registers)
    assert config.backward.dq_before_dk == (h == 128)
    # (and without a causal band each key tile starts its query blocks at its own place)
    assert config.backward.stagger == (h == 128 and not causal)


@pytest.mark.parametrize("h,want", [(64, 128), (128, 128), (256, 32)])
def test_block_table_calls_take_wider_dq_tiles(h, want):
  """Calls that walk a block table take `LOADS_BACKWARD`'s dQ tiles (128 keys at D = 128,
  where they measured faster) where they fit; the same call without one keeps
  `BACKWARD_TUNED`'s."""
  from jaxflash.backends.mosaic import config as mosaic_config
  q = jnp.zeros((1, 256, 2, h), BF16)
  device = devices.Device("gpu", "NVIDIA H200", True)
  plain = _checks.normalise(q, q, q)
  blocks = _checks.normalise(q, q, q, mask_mod=lambda b, h, i, j: i >= j)
  tiles = mosaic.BACKEND.default_config(blocks.inputs, blocks.params, device).backward
  plain_tiles = mosaic.BACKEND.default_config(plain.inputs, plain.params, device).backward
  assert tiles == dataclasses.replace(plain_tiles, dq_block_kv=want)
  assert plain_tiles.dq_block_kv == mosaic_config.BACKWARD_TUNED[h].dq_block_kv
  # A partial call's (ring attention with segment ids) float32 dQ tile leaves no room for
  # them: it keeps the tiles that fit, not a fallback to the Triton backward.
  # (At D = 256 no partial call fits the Mosaic kernels at all.)
  ring = mosaic.default_config(h, BF16, True, 256, "NVIDIA H200", partial=True, block_table=True)
  assert ring is None if h == 256 else (
      mosaic_config.backward_smem_bytes(ring.backward, h, True) <= mosaic_config.SMEM_BUDGET)


def test_lookup_calls_take_wider_dq_tiles():
  """A score_mod whose lookups run per diagonal (a relative-position table) waits on their
  loads in the dQ kernel, and takes `LOADS_BACKWARD`'s 128-key dQ tiles too; ALiBi (computed
  in the kernel) keeps `BACKWARD_TUNED`'s."""
  from jaxflash.backends.mosaic import config as mosaic_config
  q = jnp.zeros((1, 256, 2, 128), BF16)
  device = devices.Device("gpu", "NVIDIA H200", True)
  table = jnp.zeros((2, 511), jnp.float32)
  relative = _checks.normalise(q, q, q, score_mod=lambda s, b, h, i, j: s + table[h, i - j + 255])
  alibi = _checks.normalise(q, q, q, score_mod=lambda s, b, h, i, j: s + 0.5 * (j - i))
  assert relative.inputs.score_bands is not None and alibi.inputs.score_bands is None
  tiles = lambda call: mosaic.BACKEND.default_config(  # noqa: E731
      call.inputs, call.params, device).backward.dq_block_kv
  assert tiles(relative) == mosaic_config.LOADS_BACKWARD[128]["dq_block_kv"] == 128
  assert tiles(alibi) == mosaic_config.BACKWARD_TUNED[128].dq_block_kv == 64


def _shipped_backward(n: int, k: int, causal: bool, h: int = 128) -> mosaic.Backward:
  """The backward tiles an H200 call with ``n`` query and ``k`` K/V heads gets."""
  device = devices.Device("gpu", "NVIDIA H200", True)
  q, kv = jnp.zeros((1, 256, n, h), BF16), jnp.zeros((1, 256, k, h), BF16)
  call = _checks.normalise(q, kv, kv, is_causal=causal)
  return mosaic.BACKEND.default_config(call.inputs, call.params, device).backward


def test_gqa_calls_take_their_backward_registers():
  """GQA and MQA calls at D = 128 without a causal band take `GQA_BACKWARD`'s 240 registers;
  MHA, and GQA with a causal band, keep `BACKWARD_TUNED`'s."""
  from jaxflash.backends.mosaic import config as mosaic_config

  def registers(n, k, causal, h=128):
    return _shipped_backward(n, k, causal, h).registers

  default = mosaic_config.BACKWARD_TUNED[128].registers
  assert registers(8, 1, False) == registers(8, 2, False) == 240 != default
  assert registers(8, 8, False) == registers(8, 2, True) == default
  assert registers(8, 2, False, h=64) == mosaic_config.BACKWARD_TUNED[64].registers
  # (`Backward.stagger` measured faster for MHA only: GQA keeps the common start)
  assert _shipped_backward(8, 8, False, 128).stagger
  assert not _shipped_backward(8, 2, False, 128).stagger


def test_gqa_causal_calls_launch_tile_major():
  """GQA with a causal band at D = 128 launches its deterministic backward tiles by cost across
  every batch row and head, and its atomic one pass head by head with each group over four
  CTAs per key tile (`GQA_BACKWARD`, both measured faster); MHA and calls without a band keep
  the head-by-head order on one CTA per key tile."""
  def launch(n, k, causal):
    tiles = _shipped_backward(n, k, causal)
    atomic = tiles.atomic_pass()
    return (tiles.tile_major, tiles.parts_of(n // k), atomic.tile_major,
            atomic.parts_of(n // k))

  assert launch(8, 2, True) == launch(8, 1, True) == (True, 1, False, 4)
  assert launch(64, 8, True) == (True, 1, False, 4)
  assert launch(8, 4, True) == (True, 1, False, 1)  # (four parts do not divide a group of 2)
  assert launch(8, 8, True) == launch(8, 2, False) == (False, 1, False, 1)


def test_gqa_calls_take_the_atomic_pass():
  """With deterministic=False, GQA at D = 128 takes the atomic one pass like MHA (it measured
  faster than the two kernels once it stopped spilling), on 240 registers (`ATOMIC_TUNED`)."""
  from jaxflash.backends.mosaic import backward
  device = devices.Device("gpu", "NVIDIA H200", True)

  def mode(n, k):
    q, kv = jnp.zeros((1, 8192, n, 128), BF16), jnp.zeros((1, 8192, k, 128), BF16)
    call = _checks.normalise(q, kv, kv, deterministic=False)
    config = mosaic.BACKEND.default_config(call.inputs, call.params, device)
    return (backward._one_pass_mode(call.inputs, call.params, config.backward),
            config.backward.atomic_pass().registers)

  assert mode(8, 8) == mode(8, 2) == ("atomic", 240)


@needs_cuda_plugin
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_backward_lowers(causal):
  """The GQA backward's tiles (`GQA_BACKWARD`): without a causal band at 240 registers, with
  one launched tile-major; forward, dQ and dK/dV on Mosaic (ptxas's register budget holds: a
  kernel that cannot lower never lands)."""
  q = jax.ShapeDtypeStruct((2, 1000, 8, 128), BF16)
  kv = jax.ShapeDtypeStruct((2, 1000, 2, 128), BF16)
  config = mosaic.default_config(128, BF16, causal, 1000, "NVIDIA H200", groups=4)
  assert (config.backward.registers == 240) != causal
  assert config.backward.tile_major == causal
  text = _lower(_gradients(config, is_causal=causal), q, kv, kv)
  assert _mosaic_kernels(text) == 3


# (The deterministic kernels in the variants: `_dkv` and `_dkv_kernel` split a group into parts
# alike with or without dQ, which test_mosaic.py::test_group_parts_lower[False] lowers (the
# shipped atomic one pass, four parts), and test_mosaic.py::test_gqa_backward_lowers[True]
# these kernels' tile-major launch on the same shipped tiles, with one part.)
@needs_cuda_plugin
@pytest.mark.parametrize("deterministic", [pytest.param(True, marks=variant), False])
def test_group_parts_lower(deterministic):
  """GQA's dK/dV split over several CTAs per key tile (`Backward.group_parts`) lowers for CUDA
  on the shipped D = 128 causal tiles: two parts in the two kernels, and the shipped atomic
  one pass (its own four parts, `atomic_group_parts`, win over the two)."""
  q = jax.ShapeDtypeStruct((2, 1000, 8, 128), BF16)
  kv = jax.ShapeDtypeStruct((2, 1000, 2, 128), BF16)
  config = mosaic.default_config(128, BF16, True, 1000, "NVIDIA H200", groups=4)
  config = dataclasses.replace(config, backward=dataclasses.replace(config.backward,
                                                                    group_parts=2))
  text = _lower(_gradients(config, is_causal=True, deterministic=deterministic), q, kv, kv)
  assert _mosaic_kernels(text) == (3 if deterministic else 2)


@needs_cuda_plugin
@pytest.mark.parametrize("h,t,kernels,aliased", [(64, 1000, 2, True), (128, 1000, 2, True),
                                                 (256, 2100, 3, True), (256, 1000, 4, False)])
def test_atomic_backward_lowers(h, t, kernels, aliased):
  """deterministic=False lowers as two Mosaic kernels at D = 64 and 128 (the forward, and
  dK/dV with dQ's unordered adds into a zeroed array, aliased in place) and as three at D =
  256 (the forward, dV, and dK with dQ's adds); a causal call at D = 256 below 2048 rows runs
  the deterministic ones (the forward, dV, dK and dQ); no ordering semaphores either way."""
  q = jax.ShapeDtypeStruct((2, t, 4, h), BF16)
  kv = jax.ShapeDtypeStruct((2, 777, 2, h), BF16)
  text = _lower(_gradients(None, is_causal=True, deterministic=False), q, kv, kv)
  assert _mosaic_kernels(text) == kernels
  assert ("output_operand_alias" in text) == aliased


@pytest.mark.parametrize("band,offsets", [
    ({}, None), (dict(is_causal=True), None), (dict(is_causal=True, local_window_size=(70, 0)),
                                               None),
    (dict(local_window_size=(90, 30)), None), (dict(is_causal=True), (37, 300)),
    (dict(is_causal=True, local_window_size=(20, 0)), (0, -150))])
def test_first_visitors_match_the_schedule(band, offsets):
  """The one-pass backward orders its dQ adds by `backward._first_visitors`: against a walk of
  `Schedule.q_blocks` over every key tile and batch row (random lengths), the key tiles that
  visit each query block are consecutive, and the first is the one it names (or the key tile
  count where none visits)."""
  from jaxflash.backends.mosaic import backward
  from jaxflash.masking import Positions
  from jaxflash.schedule import Schedule
  b, t, s = 3, 700, 900
  q, kv = jnp.zeros((b, t, 2, 64), BF16), jnp.zeros((b, s, 1, 64), BF16)
  call = _checks.normalise(q, kv, kv, **band, **random_lengths(b, t, s, 2, 5))
  inputs = call.inputs
  if offsets is not None:
    inputs = inputs._replace(offsets=jnp.tile(jnp.array([offsets], jnp.int32), (b, 1)))
  schedule = Schedule(call.params.window, 64, 128)
  q_blocks, k_tiles = 12, 8
  first = np.asarray(backward._first_visitors(schedule, inputs, q_blocks))
  for row in range(b):
    extra = () if offsets is None else tuple(jnp.int32(x) for x in offsets)
    pos = Positions(inputs.lengths[row, 0], inputs.lengths[row, 1], *extra)
    visitors = [[] for _ in range(q_blocks)]
    for j in range(k_tiles):
      lo, hi = (int(x) for x in schedule.q_blocks(jnp.int32(128 * j), pos))
      for i in range(max(lo, 0), min(hi, q_blocks)):
        visitors[i].append(j)
    for i, tiles in enumerate(visitors):
      assert tiles == list(range(tiles[0], tiles[0] + len(tiles))) if tiles else True, (row, i)
      assert first[row, i] == (tiles[0] if tiles else k_tiles), (row, i, tiles)
  assert (first < k_tiles).any() and (first[:, -1] == k_tiles).all()  # (block 11: past T)


# (192 on the GPU only: a CPU runs the two passes at 256 here, and the 192-wide backward MLA
# ships in test_value_dim.py::test_mosaic_serves_it[192-128-shipped].)
@pytest.mark.parametrize("h", [pytest.param(192, marks=gpu), 256])
def test_mosaic_backward_wide_heads(h):
  """Head dims above 128: dK/dV in two passes (dV, then dK), and at D = 256 the 32-row streamed
  tiles with the 64-byte swizzle; every option the backward serves, against the reference."""
  from jaxflash.backends.mosaic import backward, config as mosaic_config
  b, t, s, n, k = (2, 200, 333, 4, 2) if ON_GPU else (1, 70, 133, 2, 1)
  config = dataclasses.replace(SMALL_CONFIGS["mosaic"],
                               backward=mosaic_config.BACKWARD_TUNED.get(h, mosaic.Backward()))
  options = _everything_but_dense(b, t, s, n, 0)
  q, kv = jnp.zeros((b, t, n, h), BF16), jnp.zeros((b, s, k, h), BF16)
  call = _checks.normalise(q, kv, kv, **options)
  assert backward.unsupported(call.inputs, call.params, config) is None  # not the Triton one
  check("mosaic", b=b, t=t, s=s, n=n, k=k, h=h, dtype=BF16, small=config, **options)


def test_backward_serves_what_it_can():
  """Biases, partial calls above head dim 128, in one pass or with a value head dim of its own,
  and tiles that do not fit go to the Triton backward (`backward.unsupported` says why); everything else is the
  Mosaic backward's."""
  from jaxflash.backends.mosaic import backward
  q = jnp.zeros((1, 64, 2, 128), BF16)
  config = mosaic.Config()
  ids = jnp.zeros((1, 64), jnp.int32)
  call = _checks.normalise(q, q, q, is_causal=True, segment_ids=(ids, ids))
  assert backward.unsupported(call.inputs, call.params, config) is None
  masked = _checks.normalise(q, q, q, mask=jnp.ones((1, 1, 64, 64), bool))
  assert backward.unsupported(masked.inputs, masked.params, config) is None
  biased = _checks.normalise(q, q, q, bias=jnp.ones((1, 1, 64, 64), BF16))
  assert "biases" in backward.unsupported(biased.inputs, biased.params, config)
  assert "None" in backward.unsupported(call.inputs, call.params,
                                        mosaic.Config(backward=None))
  wide = jnp.zeros((1, 64, 2, 256), BF16)
  call = _checks.normalise(wide, wide, wide)
  assert "shared memory" in backward.unsupported(call.inputs, call.params, config)
  assert backward.unsupported(call.inputs, call.params, mosaic.default_config(
      256, BF16, False, 64, "NVIDIA H200")) is None
  big = mosaic.Config(backward=mosaic.Backward(dq_block_kv=128, dq_stages=3))
  call = _checks.normalise(q, q, q)
  assert "shared memory" in backward.unsupported(call.inputs, call.params, big)
  # Partial calls (float32 gradients) are served up to head dim 128, in two kernels.
  partial_params = dataclasses.replace(call.params, partial=True)
  assert backward.unsupported(call.inputs, partial_params, config) is None
  one_pass = mosaic.Config(backward=mosaic.Backward(one_pass=True))
  assert "one pass" in backward.unsupported(call.inputs, partial_params, one_pass)
  narrow_v = jnp.zeros((1, 64, 2, 64), BF16)  # (a value head dim of its own: dK/dV differ)
  call = _checks.normalise(q, q, narrow_v)
  assert backward.unsupported(call.inputs, call.params, config) is None
  assert "value head dim" in backward.unsupported(
      call.inputs, dataclasses.replace(call.params, partial=True), config)
  call = _checks.normalise(wide, wide, wide)
  assert "float32 gradients" in backward.unsupported(
      call.inputs, dataclasses.replace(call.params, partial=True),
      mosaic.default_config(256, BF16, False, 64, "NVIDIA H200"))


@gpu  # (the interpreter runs one order: same bits by construction)
@pytest.mark.parametrize("h,one_pass", [(128, False), (256, False), (128, True), (64, True)])
def test_gradients_are_bitwise_deterministic(h, one_pass):
  """Two runs give the same bits for dQ, dK and dV, with dropout and GQA (no atomics: every
  gradient element has one writer, and GQA heads are summed in a fixed order); on the GPU also
  at D = 256, where dK/dV runs as two passes. The one-pass backward adds each query block's dQ
  parts in a fixed order of key tiles: on the GPU its shape has 16 key tiles visiting each
  query block, so that many CTAs wait on one block at once."""
  b, t, s, n, k = (2, 1000, 2048, 8, 2) if one_pass else (2, 300, 517, 8, 2)
  q, kk, v, d_out = random_qkv(5, b, t, s, n, k, h, BF16)
  options = dict(is_causal=not one_pass, dropout_rate=0.1, dropout_rng=jax.random.key(3))
  block_q = 64 if h > 64 else 128
  config = mosaic.Config(backward=mosaic.Backward(dkv_block_q=block_q, dq_block_kv=block_q,
                                                  one_pass=True)) if one_pass else None

  def grads(q, kk, v):
    out, vjp = jax.vjp(lambda *x: _run(*x, config=config, **options), q, kk, v)
    return vjp(d_out.astype(out.dtype))

  run = grads if not ON_GPU else jax.jit(grads)
  first, second = run(q, kk, v), run(q, kk, v)
  for a, b_ in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b_, np.float32))


# A persistent grid of 3 CTAs: each runs several query tiles of different batch rows and heads,
# with the K/V ring, the turns and the Q and O tiles running on from one tile to the next.
PERSISTENT = dataclasses.replace(SMALL_CONFIGS["mosaic"], persistent_ctas=3)


def _short_rows(b, t, s, n, seed):
  """Batch row 0 whole; row 1 with 40 queries (its second query tile is all padding) and no
  keys (no tile of it visits a key block); more rows random."""
  lengths = random_lengths(b, t, s, n, seed)
  return dict(query_seq_lengths=lengths["query_seq_lengths"].at[:2].set(jnp.array([t, 40])),
              key_value_seq_lengths=lengths["key_value_seq_lengths"].at[:2].set(
                  jnp.array([s, 0])))


PAIRED = dict(paired_tiles=True, o_through_q=True)


@pytest.mark.parametrize("option,fields", [
    ("everything", {}), ("short_rows", dict(q_buffers=2)), ("causal_short_rows", PAIRED)]
    + [pytest.param(*case, marks=variant) for case in [
        ("causal", {}), ("causal", dict(q_buffers=2)), ("causal", PAIRED),
        ("causal", dict(PAIRED, intra_wg_overlap=True)), ("everything", PAIRED)]]
    + [pytest.param(*case, marks=(variant, gpu)) for case in [("none", {}), ("short_rows", {})]])
def test_persistent_grid(option, fields):
  """Forward, LSE and gradients through a persistent grid, with tiles that visit no key
  block between tiles that do; with two Q buffers, the next item's Q loads during this one;
  paired (`Config.paired_tiles`), a head's tiles two by two with O leaving through the Q tile,
  the next item's Q loading after it (`Config.o_through_q`)."""
  b, t, s, n, k, h = (3, 300, 333, 4, 2, 128) if ON_GPU else (2, 200, 133, 2, 1, 64)
  if option == "causal_short_rows":
    make = lambda *shape: dict(_short_rows(*shape), is_causal=True)
  else:
    make = _short_rows if option == "short_rows" else OPTIONS[option]
  check("mosaic", b=b, t=t, s=s, n=n, k=k, h=h, dtype=BF16,
        small=dataclasses.replace(PERSISTENT, **fields), **make(b, t, s, n, 0))


@gpu
@pytest.mark.parametrize("h", [64, 128])
def test_shipped_persistent_tiles_without_a_band_on_gpu(h):
  """The shipped tiles without a band (`TUNED`: persistent grids with two Q buffers, 256-key
  tiles at D = 64, pairs sharing K/V at D = 128) with more items than CTAs, so that every CTA
  loads its next item's Q during this one; GQA, T != S, neither a multiple of the tiles."""
  check("mosaic", b=4, t=1000, s=777, n=8, k=2, h=h, dtype=BF16, small=False)


# The intra-warpgroup overlap: the first block peeled off, P V one block behind the scores, the
# last P V after the loop; alone and on a persistent grid of 3 CTAs.
OVERLAP = dataclasses.replace(SMALL_CONFIGS["mosaic"], intra_wg_overlap=True)


@pytest.mark.parametrize("option,config", [
    ("everything", OVERLAP),
    ("short_rows", dataclasses.replace(PERSISTENT, intra_wg_overlap=True))] + [
        pytest.param(option, OVERLAP, marks=(variant, gpu) if option == "none" else variant)
        for option in ("none", "causal_window", "short_rows")])
def test_intra_warpgroup_overlap(option, config):
  """Forward, LSE and gradients with the overlap, including rows and tiles that see no key."""
  b, t, s, n, k, h = (3, 300, 333, 4, 2, 128) if ON_GPU else (2, 200, 133, 2, 1, 64)
  make = _short_rows if option == "short_rows" else OPTIONS[option]
  check("mosaic", b=b, t=t, s=s, n=n, k=k, h=h, dtype=BF16, small=config,
        **make(b, t, s, n, 0))


def test_exp2_polynomial():
  """2**z to a relative 7.5e-5 from -125 to 0 (and past 0, where rounding leaves a logit less
  its row max), 0 below -125 and at -inf, NaN as NaN; eagerly and jitted as the interpreter
  runs it (XLA folds (x + c) - c unless the sum goes through a barrier); and a tile whose first
  columns take it while the rest take exp2."""
  from jaxflash.backends.mosaic import forward
  z = jnp.concatenate([jnp.linspace(-125.0, 1e-3, 100_001, dtype=jnp.float32),
                       jnp.array([-0.5, 0.5, -124.5, -3.5, -2.5], jnp.float32)])
  want = np.exp2(np.asarray(z, np.float64))
  jitted = jax.jit(functools.partial(forward.exp2_polynomial, interpret=True))
  for got in (forward.exp2_polynomial(z), jitted(z)):
    assert np.max(np.abs(np.asarray(got, np.float64) / want - 1.0)) <= 7.6e-5
  edges = jnp.array([-125.5, -126.0, -1e4, -jnp.inf, jnp.nan], jnp.float32)
  got = np.asarray(forward.exp2_polynomial(edges))
  np.testing.assert_array_equal(got[:4], 0.0)
  assert np.isnan(got[4])
  tile = jax.random.uniform(jax.random.key(3), (64, 128), jnp.float32, -30.0, 0.0)
  mixed = np.asarray(forward.exp2_mixed(tile, 32))
  np.testing.assert_array_equal(mixed[:, 32:], np.asarray(jnp.exp2(tile[:, 32:])))
  np.testing.assert_allclose(mixed[:, :32], np.exp2(np.asarray(tile[:, :32], np.float64)),
                             rtol=7.6e-5)


@pytest.mark.parametrize("option,poly_cols", [
    ("causal_window", 32), pytest.param("short_rows", 64, marks=variant)])
def test_exp2_polynomial_forward(option, poly_cols):
  """Forward, LSE and gradients with half, or all, of each block's exponentials on the FMA
  units (`Config.exp2_poly_cols`), with masked entries, rows that see no key and tiles of
  padding rows (which must stay exactly 0 there)."""
  config = dataclasses.replace(SMALL_CONFIGS["mosaic"], exp2_poly_cols=poly_cols)
  b, t, s, n, k, h = (3, 300, 333, 4, 2, 64) if ON_GPU else (2, 200, 133, 2, 1, 64)
  make = _short_rows if option == "short_rows" else OPTIONS[option]
  check("mosaic", b=b, t=t, s=s, n=n, k=k, h=h, dtype=BF16, small=config,
        **make(b, t, s, n, 0))


# (70, 1) in the variants: test_mosaic.py::test_odd_shapes[1-1-1-1] holds a single key (one
# valid key in its block, the one-key error measure), and the OPTION_SHAPE tests' 70 rows (e.g.
# test_mosaic.py::test_every_supported_option_at_once) a partial query tile.
@pytest.mark.parametrize("t,s,n,k", [(1, 1, 1, 1), (1, 70, 4, 1),
                                     pytest.param(70, 1, 3, 3, marks=variant), (129, 129, 8, 2),
                                     (31, 200, 6, 3), (200, 31, 2, 1)])
def test_odd_shapes(t, s, n, k):
  if not ON_GPU and (t, s) in ((1, 70), (200, 31), (31, 200)):
    pytest.skip("the interpreter is slow: the GPU runs the rest")
  if not ON_GPU and n > 2:  # two heads in the interpreter, grouped where the shape is
    n, k = 2, 1 if k < n else 2
  check("mosaic", b=2, t=t, s=s, n=n, k=k, h=64, dtype=BF16, is_causal=(t == s))


@pytest.mark.parametrize("dtype", [BF16, jnp.float16])
@pytest.mark.parametrize("h", [40, 64, 80, 96, 128, 192, 256])
def test_head_dims(h, dtype):
  """Every head dim (padded to a multiple of 64 where needed) with the shipped tiles; on a CPU
  only the padded and the widest ones in bfloat16."""
  if not ON_GPU and (dtype != BF16 or h != 40):  # (256: test_mosaic_backward_wide_heads)
    pytest.skip("the interpreter is slow: the GPU runs the rest")
  t, s = (300, 517) if ON_GPU else (70, 90)
  check("mosaic", b=1, t=t, s=s, n=4, k=2, h=h, dtype=dtype, is_causal=True, small=False)


def test_nan_rows_and_determinism():
  """A NaN query entry makes its row NaN and nothing else; a NaN key the rows that see it (rows
  before it, causal, and the heads of the other KV head stay finite). Bitwise deterministic."""
  t, s, n = (300, 517, 8) if ON_GPU else (70, 70, 4)
  q, k, v, _ = random_qkv(11, 2, t, s, n, 2, 64, BF16)
  group = n // 2
  out = np.asarray(_run(q.at[0, 7, 3, 0].set(jnp.nan), k, v), np.float32)
  assert np.isnan(out[0, 7, 3]).all()
  assert np.isfinite(np.delete(out[0], 7, axis=0)).all() and np.isfinite(out[0, 7, 4:]).all()
  out = np.asarray(_run(q, k.at[1, 40, 0, 5].set(jnp.nan), v, is_causal=True), np.float32)
  assert np.isfinite(out[1, :40]).all() and np.isnan(out[1, 40:, :group]).all()
  assert np.isfinite(out[1, 40:, group:]).all() and np.isfinite(out[0]).all()
  if not ON_GPU:
    return  # (the interpreter runs one order: same bits by construction)
  first, second = _run(q, k, v), _run(q, k, v)
  np.testing.assert_array_equal(np.asarray(first, np.float32), np.asarray(second, np.float32))


@needs_cuda_plugin
@pytest.mark.parametrize("h,causal,per_token,config,out_dtype", [
    (64, False, False, None, None), (128, True, True, None, None),
    (128, False, True, None, None),
    (256, True, False, None, None), (128, False, False, None, jnp.float32),
    (256, False, True, mosaic.Config(block_kv=128, intra_wg_overlap=True, registers=240),
     None)])
def test_fp8_forward_lowers(h, causal, per_token, config, out_dtype):
  """The FP8 forward at its shipped tiles (FP8_TUNED) and at 128-key tiles at D = 256 (O in
  column pieces through the Q tiles), with per-head or per-token descales and a 16-bit or
  float32 output."""
  f8 = jnp.float8_e4m3fn
  q = jax.ShapeDtypeStruct((2, 300, 8, h), f8)
  kv = jax.ShapeDtypeStruct((2, 1000, 2, h), f8)
  q_d = jax.ShapeDtypeStruct((2, 300, 8) if per_token else (2, 2), jnp.float32)
  k_d = jax.ShapeDtypeStruct((2, 1000, 2) if per_token else (2, 2), jnp.float32)

  def fn(q, k, v, q_descale, k_descale):
    return attention_with_config(q, k, v, implementation="mosaic", is_causal=causal,
                                 q_descale=q_descale, k_descale=k_descale, config=config,
                                 out_dtype=out_dtype)
  assert "mosaic_gpu" in _lower(fn, q, kv, kv, q_d, k_d)


# (128-key tiles one step at a time in the variants: the same row sums by wgmma, 128-key tiles
# without the overlap, causal, a row with no key, run in
# test_mosaic.py::test_kv_multicast[float8_e4m3fn-128-fields2] and
# test_mosaic.py::test_three_consumers[float8_e4m3fn-128-fields3]; the plain FP8 forward in
# [fields3-False] here.)
@pytest.mark.parametrize("fields,long", [pytest.param(dict(block_kv=128), False, marks=variant),
                                         pytest.param(dict(block_kv=64, intra_wg_overlap=True),
                                                      False, marks=variant),
                                         (dict(block_kv=256, persistent_ctas=132), True),
                                         (dict(block_kv=192, intra_wg_overlap=True,
                                               registers=240), False),
                                         (dict(block_kv=256), True)])
def test_fp8_row_sums_on_the_tensor_cores(fields, long):
  """`Config.mma_row_sums`: an FP8 forward that sums each row of P by a wgmma against a ones
  column matches the same forward summing in float32 within e4m3's rounding of P (and both
  the reference), one step at a time and with the overlap (whose sums join a block late, at
  the next block's rescale), on 192-key tiles too (V's rows three 64-byte swizzled rows),
  causal, with a row that sees no key. On the GPU also 16k keys
  (the sums carried across blocks in one wgmma accumulator came out 13-31% short there)."""
  if long and not ON_GPU:
    pytest.skip("the interpreter is slow: the GPU runs the long rows")
  b, t, s, n, k, h = ((1, 16384, 16384, 2, 1, 128) if long else
                      (2, 300, 333, 4, 2, 128) if ON_GPU else (1, 130, 200, 2, 1, 128))
  keys = jax.random.split(jax.random.key(3), 3)
  q, kk, v = (jax.random.normal(key, (b, x, heads, h), jnp.float32)
              for key, x, heads in zip(keys, (t, s, s), (n, k, k)))
  lengths = dict(query_seq_lengths=jnp.array([t, 7][:b]),
                 key_value_seq_lengths=jnp.array([s, 0][:b] if b > 1 else [s - 50]))
  q8, k8, v8 = (x.astype(jnp.float8_e4m3fn) for x in (q, kk, v))

  def run(sums):
    config = mosaic.Config(mma_row_sums=sums, **fields)
    return np.asarray(attention_with_config(q8, k8, v8, implementation="mosaic", is_causal=True,
                                            config=config, interpret=not ON_GPU, **lengths),
                      np.float32)

  summed, plain = run(True), run(False)
  assert np.isfinite(summed).all()
  assert np.linalg.norm(summed - plain) / np.linalg.norm(plain) < 1.5e-2
  if not long:
    want = np.asarray(attention_with_config(q8, k8, v8, implementation="xla", is_causal=True,
                                            **lengths), np.float32)
    assert np.linalg.norm(summed - want) / np.linalg.norm(want) < 4e-2
  if b > 1:  # the row with no key gives zeros
    np.testing.assert_array_equal(summed[1], 0.0)


# Mosaic GPU's interpreter runs each warpgroup's waits inside XLA's CPU callbacks, on a thread
# pool of NPROC threads (else one per core): with fewer than four, a CTA of four warpgroups
# (three consumers and the producer) waits for ever. tests/conftest.py sets NPROC=8 on a
# CPU-only machine; where a run sets it lower, these tests skip.
needs_four_threads = pytest.mark.skipif(
    not (ON_GPU or int(os.environ.get("NPROC") or os.cpu_count() or 1) >= 4),
    reason="the interpreter deadlocks four warpgroups on fewer than 4 threads")


# (bf16 on 128-key tiles in the variants: three bf16 consumers run in
# test_mosaic.py::test_three_consumers_with_every_option[everything] (D = 64, 64-key tiles,
# a causal band, lengths, GQA), and on 128-key tiles without a band and with one, with a row
# with no key, in test_mosaic.py::test_three_consumers[float8_e4m3fn-128-fields3]: a tile
# variant.)
@needs_four_threads
@pytest.mark.parametrize("dtype,h,fields", [
    pytest.param(BF16, 64, dict(block_kv=128), marks=variant),
    pytest.param(BF16, 64, dict(block_kv=64, intra_wg_overlap=True), marks=variant),
    pytest.param(BF16, 96, dict(block_kv=64, persistent_ctas=5), marks=variant),
    (jnp.float8_e4m3fn, 128, dict(block_kv=128, mma_row_sums=True)),
    pytest.param(jnp.float8_e4m3fn, 128, dict(block_kv=64), marks=gpu)])
def test_three_consumers(dtype, h, fields):
  """`Config.consumers=3`: a CTA of three consumer warpgroups (192 rows) taking the tensor
  cores in turn gives the reference's result: one step at a time and with the overlap, on a
  persistent grid, FP8 with the row sums on the tensor cores (and, on the GPU, without them
  on 64-key tiles); causal and not,
  GQA, lengths that are no multiple of 192 or of the key tile, a row that sees no key."""
  b, t, s, n, k = (2, 500, 333, 4, 2) if ON_GPU else (2, 200, 150, 2, 1)
  keys = jax.random.split(jax.random.key(5), 3)
  q, kk, v = (jax.random.normal(key, (b, x, heads, h), jnp.float32)
              for key, x, heads in zip(keys, (t, s, s), (n, k, k)))
  lengths = dict(query_seq_lengths=jnp.array([t - 3, 7]),
                 key_value_seq_lengths=jnp.array([s, 0]))
  q, kk, v = (x.astype(dtype) for x in (q, kk, v))
  config = mosaic.Config(consumers=3, registers=160, **fields)
  for causal in (False, True):
    got = np.asarray(attention_with_config(q, kk, v, implementation="mosaic", is_causal=causal,
                                           config=config, interpret=not ON_GPU, **lengths),
                     np.float32)
    want = np.asarray(attention_with_config(q, kk, v, implementation="xla", is_causal=causal,
                                            **lengths), np.float32)
    tolerance = 4e-2 if dtype == jnp.float8_e4m3fn else 1e-2
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tolerance, causal
    np.testing.assert_array_equal(got[1], 0.0)  # the row with no key


@pytest.mark.parametrize("dtype,h,fields", [
    (BF16, 64, dict(block_kv=64)),
    pytest.param(BF16, 96, dict(block_kv=64, intra_wg_overlap=True, persistent_ctas=3),
                 marks=variant),
    (jnp.float8_e4m3fn, 128, dict(block_kv=128, mma_row_sums=True, persistent_ctas=5))])
def test_kv_multicast(dtype, h, fields):
  """`Config.kv_multicast`: pairs of query tiles as clusters of two CTAs sharing each K/V
  tile's load give the reference's result, one CTA a tile and on persistent grids (an odd CTA
  count leaves one out), bf16 and FP8, GQA, a second tile past the query length (it walks its
  pair's blocks and comes out zero), a row with no key; and calls it cannot serve (a band, an
  odd number of query tiles) run unpaired and right. (A pair that walked different blocks
  hangs the interpreter: the first tile's consumers wait for the second's releases.)"""
  from jaxflash.backends.mosaic import forward
  b, t, s, n, k = (2, 1000, 333, 4, 2) if ON_GPU else (2, 500, 150, 2, 1)
  keys = jax.random.split(jax.random.key(6), 3)
  q, kk, v = (jax.random.normal(key, (b, x, heads, h), jnp.float32).astype(dtype)
              for key, x, heads in zip(keys, (t, s, s), (n, k, k)))
  config = mosaic.Config(kv_multicast=True, **fields)
  # Row 0's last pair has its second tile past the query length; row 1 sees no key.
  lengths = dict(query_seq_lengths=jnp.array([t - 150, 100]),
                 key_value_seq_lengths=jnp.array([s - 3, 0]))
  for causal, length, paired in ((False, t, True), (True, t, False), (False, t - 130, False)):
    x = q[:, :length]
    lens = dict(lengths, query_seq_lengths=jnp.minimum(lengths["query_seq_lengths"], length))
    tiles = -(-length // config.rows_per_cta)
    assert forward.paired_ctas(config, _checks.normalise(
        x, kk, v, is_causal=causal).params, forward._Extras(), tiles) == paired
    got = np.asarray(attention_with_config(x, kk, v, implementation="mosaic", is_causal=causal,
                                           config=config, interpret=not ON_GPU, **lens),
                     np.float32)
    want = np.asarray(attention_with_config(x, kk, v, implementation="xla", is_causal=causal,
                                            **lens), np.float32)
    tolerance = 4e-2 if dtype == jnp.float8_e4m3fn else 1e-2
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tolerance, (causal, length)
    np.testing.assert_array_equal(got[1], 0.0)  # the row with no key


# (everything_but_dense in the variants: its forward is [everything]'s less the mask and bias
# reads (segment ids give both a block table), and its gradients come from the same Mosaic
# backward (`Config.backward` only: Backward()) that
# test_mosaic.py::test_mosaic_backward[everything_but_dense-config0] runs on the same shape and
# options.)
@needs_four_threads
@pytest.mark.parametrize("option", ["everything", pytest.param("everything_but_dense",
                                                             marks=variant)])
def test_three_consumers_with_every_option(option):
  """Three consumers with every option the forward serves at once (causal window, soft cap,
  scale, mask, bias, segments, lengths, dropout; GQA), forward and gradients (the backward
  runs its own two-consumer kernels) against the reference."""
  b, t, s, n, k, h = OPTION_SHAPE
  make = _everything_but_dense if option == "everything_but_dense" else OPTIONS[option]
  config = mosaic.Config(consumers=3, registers=160, block_kv=64)
  check("mosaic", b=b, t=t, s=s, n=n, k=k, h=h, dtype=BF16, small=config,
        **make(b, t, s, n, 0))


# (In the variants: a consumer's float32 O tile of its own is indexed by its warpgroup alike
# for two or three, as test_mosaic.py::test_partial_backward[64]'s split forward runs it on two;
# three consumers run in test_mosaic.py::test_three_consumers_with_every_option[everything].)
@variant
@needs_four_threads
def test_three_consumers_partial_results():
  """Partial calls on three consumers (float32 O through tiles of their own, as ring attention
  and split keys run them): keys split mid-block, each range's O and LSE merged, equal the
  reference, causal, GQA, lengths."""
  b, t, s, n, k, h = OPTION_SHAPE
  q, kk, v, _ = random_qkv(7, b, t, s, n, k, h, BF16)
  options = dict(is_causal=True, **random_lengths(b, t, s, n, 3))
  config = mosaic.Config(consumers=3, registers=160, block_kv=64)

  def split(q, kk, v):
    call = _checks.normalise(q, kk, v, interpret=not ON_GPU, **options)
    return partial.split_keys_attention(call.inputs, call.params, mosaic.BACKEND, config,
                                        (21,))[0]

  got = jax.jit(split)(q, kk, v)
  want = attention_with_config(*(x.astype(jnp.float32) for x in (q, kk, v)),
                               implementation="xla", **options)
  assert rel_err(got, want) < 1e-2


@needs_cuda_plugin
@pytest.mark.parametrize("dtype,h,fields", [
    (BF16, 64, dict(block_kv=128, persistent_ctas=132)),
    (BF16, 128, dict(block_kv=64, intra_wg_overlap=True)),
    (jnp.float8_e4m3fn, 128, dict(block_kv=128, mma_row_sums=True))])
def test_three_consumers_lower(dtype, h, fields):
  """`Config.consumers=3` lowers for CUDA: four warpgroups, the turns going round three named
  barriers, 160 registers a consumer."""
  q = jax.ShapeDtypeStruct((2, 300, 4, h), dtype)
  kv = jax.ShapeDtypeStruct((2, 1000, 2, h), dtype)
  config = mosaic.Config(consumers=3, registers=160, **fields)
  assert "mosaic_gpu" in _lower(_forward(config, is_causal=True), q, kv, kv)


# (Two in the variants: [fields0] is FP8_TUNED's causal D = 128 tiles, which
# test_mosaic.py::test_fp8_forward_lowers[128-True-True-None-None] lowers (the README part
# too); [fields1] is test_mosaic.py::test_fp8_row_sums_on_the_tensor_cores_lower[fields2]'s
# kernel at 232 registers a consumer instead of 240 (a count `plgpu.set_max_registers` takes),
# on the same tiles at D = 128 and 256.)
@needs_cuda_plugin
@pytest.mark.parametrize("fields", [
    pytest.param(dict(block_kv=256), marks=variant),
    pytest.param(dict(block_kv=128, intra_wg_overlap=True), marks=variant),
    dict(block_kv=128, intra_wg_overlap=True, registers=240)])
def test_fp8_row_sums_on_the_tensor_cores_lower(fields):
  """`Config.mma_row_sums` lowers for CUDA: the ones tile loaded once and the N = 8 wgmma
  beside P V, at D = 128 and 256 (the shipped FP8 tiles' shapes)."""
  f8 = jnp.float8_e4m3fn
  for h in (128, 256) if fields["block_kv"] == 128 else (128,):
    q = jax.ShapeDtypeStruct((2, 300, 4, h), f8)
    kv = jax.ShapeDtypeStruct((2, 1000, 2, h), f8)
    config = mosaic.Config(mma_row_sums=True, **fields)
    assert "mosaic_gpu" in _lower(_forward(config, is_causal=True), q, kv, kv)
