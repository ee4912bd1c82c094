"""`jaxflash.decode_attention`: new tokens against a KV cache, contiguous and paged, against a
float32 reference whose mask is built here from the cache positions (not from jaxflash's band)."""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import fp8
from jaxflash.reference import reference_attention
from checks import ON_GPU, TOLERANCE, interpret_for, random_qkv, rel_err

BF16 = jnp.bfloat16
IMPLEMENTATIONS = ["xla", "triton"] + (["mosaic"] if ON_GPU else [])


def _decode_mask(kv_lengths, t: int, s: int, left: int | None):
  """[B, 1, T, S]: new token r of row b sits at kv_lengths[b] - t + r and sees cached positions
  up to its own (and no more than ``left`` before it)."""
  pos = kv_lengths[:, None, None] - t + jnp.arange(t)[None, :, None]  # [B, T, 1]
  key = jnp.arange(s)[None, None, :]
  ok = (key <= pos) & (key < kv_lengths[:, None, None])
  if left is not None:
    ok &= key >= pos - left
  return ok[:, None]


def _input_dtype(implementation: str):
  """float32 but for Mosaic, which serves 16-bit inputs only."""
  return BF16 if implementation == "mosaic" else jnp.float32


def _want(q, k, v, kv_lengths, left=None, **options):
  mask = _decode_mask(kv_lengths, q.shape[1], k.shape[1], left)
  return reference_attention(q, k, v, mask=mask, **options)


def _paged(cache, page_size: int, seed: int):
  """``cache`` [B, S, K, H] as shuffled pages [B * S / page_size + 3, page_size, K, H] (3 unused
  pages of noise) and the page table that puts it back together."""
  b, s = cache.shape[:2]
  per_row = s // page_size
  order = np.random.default_rng(seed).permutation(b * per_row + 3)
  pages = jax.random.normal(jax.random.key(seed), (b * per_row + 3, page_size) + cache.shape[2:],
                            cache.dtype)
  table = order[:b * per_row].reshape(b, per_row)
  pages = pages.at[table.reshape(-1)].set(cache.reshape(b * per_row, page_size, *cache.shape[2:]))
  return pages, jnp.asarray(table, jnp.int32)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("t,window,cap", [
    (1, None, None),
    # (A variant: on a CPU [5-7-None-*] holds T > 1 on the same ragged rows, and a soft cap in
    # decoding test_one_split_writes_the_result_itself[5-7-2.0] (Triton) and
    # test_fp8_cache_with_sinks_and_a_soft_cap[xla].)
    pytest.param(4, None, 2.0, marks=pytest.mark.variants),
    (5, 7, None)])
def test_decode_matches_the_reference(implementation, t, window, cap):
  """Ragged rows (empty, fewer tokens than T, partly full, full), GQA, T = 1 and T > 1 causal,
  a window, a soft cap; the LSE too."""
  _check_against_reference(implementation, t, window, cap)


def _force_splits(monkeypatch, splits: int, merge: str = "xla") -> list:
  """Makes the Triton split-KV kernel run ``splits`` splits, merged by ``merge``; returns the
  merges' log (the merge each trace ran)."""
  from jaxflash.backends.triton import decode
  default, merges = decode.default_config, []
  monkeypatch.setattr(decode, "default_config", lambda *a, **kw: dataclasses.replace(
      default(*a, **kw), splits=splits, merge=merge))
  for name, kind in (("_merge_splits", "xla"), ("_merge_in_kernel", "kernel")):
    monkeypatch.setattr(decode, name, lambda *a, f=getattr(decode, name), kind=kind: (
        merges.append(kind) or f(*a)))
  return merges


@pytest.mark.parametrize("b,n,k,h,stages,splits", [
    (1, 32, 8, 128, 3, 33),  # 264 programs at 3 x 32 KiB: two per SM fit
    (1, 32, 32, 128, 2, 12),  # 384 programs: three per SM would not
    (8, 32, 8, 128, 2, 6),
    (1, 32, 8, 64, 3, 33),
    (1, 32, 8, 256, 2, 33),
    (1, 32, 8, 96, 3, 33),  # (padded to 128)
    (8, 32, 32, 256, 2, 2),  # 256 (batch row, K/V head) pairs that would not fit at once
    (8, 32, 32, 128, 3, 8),  # long rows: about 8 waves of 256 programs (long_row_splits)
    (7, 28, 28, 128, 3, 10),
    (64, 32, 8, 128, 3, 4),
])
def test_stage_and_split_counts(b, n, k, h, stages, splits):
  """The shipped config on an H200 (132 SMs, 128k-key bf16 cache): 3 stages at head dims up to
  64, and up to 128 where every program fits on the GPU at once with 3, or where the rows are
  long enough for waves of two programs per SM (`long_row_splits`); else 2."""
  from jaxflash import _core
  from jaxflash.backends import triton
  from jaxflash.backends.triton import decode
  from jaxflash.devices import Device
  q = jax.ShapeDtypeStruct((b, 1, n, h), BF16)
  kv = jax.ShapeDtypeStruct((b, 131072, k, h), BF16)
  inputs = _core.Inputs(q, kv, kv, jax.ShapeDtypeStruct((b, 2), jnp.int32))
  config = decode.default_config(inputs, triton.Config(), Device("gpu", "NVIDIA H200", True))
  assert (config.num_stages, config.splits) == (stages, splits)
  if 64 < h <= 128 and config.grid_order != decode.HEADS_FIRST:  # (one wave)
    assert decode.all_resident(config.splits * b * k, 132, 3, 64, 128, 2) == (stages == 3)


@pytest.mark.parametrize("b,t,s,n,k,h,dtype,want", [
    (8, 1, 131072, 32, 32, 128, BF16, (8, 3, True)),  # 2048 programs of 256 blocks
    (64, 1, 32768, 32, 8, 128, BF16, (4, 3, True)),  # 2048 of 128 blocks
    (64, 4, 32768, 32, 8, 128, BF16, (4, 3, True)),  # T = 4: T = 1's 16-row tiles
    (64, 16, 32768, 32, 8, 128, BF16, (1, 3, False)),  # T = 16: 64-row tiles (tall_tiles_config)
    (8, 1, 131072, 32, 8, 128, BF16, (6, 2, False)),  # 8 waves would leave 62 blocks a program
    (8, 1, 131072, 32, 32, 256, BF16, (2, 2, False)),  # two programs would not fit on an SM
    (8, 1, 131072, 32, 32, 128, jnp.float32, (2, 2, False)),  # (nor in float32)
])
def test_long_rows_take_waves(b, t, s, n, k, h, dtype, want):
  """One head per program: long rows get about 8 waves of two 3-stage programs per SM, launched
  heads first (`long_row_splits`), where the query tiles are T = 1's, two programs fit on an SM
  and each still runs at least 128 key blocks; elsewhere the one-wave rules stand."""
  from jaxflash import _core
  from jaxflash.backends import triton
  from jaxflash.backends.triton import decode
  from jaxflash.devices import Device
  q = jax.ShapeDtypeStruct((b, t, n, h), dtype)
  kv = jax.ShapeDtypeStruct((b, s, k, h), dtype)
  inputs = _core.Inputs(q, kv, kv, jax.ShapeDtypeStruct((b, 2), jnp.int32))
  config = decode.default_config(inputs, triton.Config(), Device("gpu", "NVIDIA H200", True))
  splits, stages, waves = want
  assert (config.heads, config.splits, config.num_stages) == (1, splits, stages)
  assert (config.grid_order == decode.HEADS_FIRST) == waves
  if waves:  # (each wave resident: two programs per SM)
    assert decode.all_resident(2 * 132, 132, 3, 64, h, jnp.dtype(dtype).itemsize)
    assert config.splits * b * k >= 7 * 2 * 132


@pytest.mark.parametrize("b,t,s,h,page_size,want", [
    (8, 16, 32768, 128, None, (4, 3, True)),  # 256 programs: all resident, two per SM
    (8, 8, 131072, 128, None, (4, 3, True)),  # (T = 8: 32-row tiles)
    (64, 16, 32768, 128, None, (1, 3, False)),  # 512 programs: one split each
    (1, 16, 131072, 128, None, (33, 3, False)),  # (B = 1: the default order)
    (8, 16, 32768, 128, 64, (4, 3, True)),  # paged: the same at 64 rows
    (8, 8, 32768, 128, 64, (6, 3, False)),  # ... wave_splits' count at 32
    (8, 16, 32768, 64, None, (6, 3, False)),  # D = 64 and 256: the one-wave rules
    (8, 16, 32768, 256, None, (6, 2, False)),
    (8, 4, 32768, 128, None, (6, 2, False)),  # T = 4: T = 1's 16-row tiles
])
def test_tall_query_tiles(b, t, s, h, page_size, want):
  """GQA 32/8 with query tiles of more than 16 rows at D = 128 (`tall_tiles_config`): 3 stages,
  and on a contiguous cache (a paged one: at 64 rows) as many splits as keep two programs per
  SM resident, heads first where B > 1."""
  from jaxflash import _core
  from jaxflash.backends import triton
  from jaxflash.backends.triton import decode
  from jaxflash.devices import Device
  q = jax.ShapeDtypeStruct((b, t, 32, h), BF16)
  kv = jax.ShapeDtypeStruct((b, s, 8, h), BF16)
  inputs = _core.Inputs(q, kv, kv, jax.ShapeDtypeStruct((b, 2), jnp.int32))
  config = decode.default_config(inputs, triton.Config(), Device("gpu", "NVIDIA H200", True),
                                 page_size=page_size)
  splits, stages, heads_first = want
  assert (config.heads, config.splits, config.num_stages) == (1, splits, stages)
  assert (config.grid_order == decode.HEADS_FIRST) == heads_first
  if heads_first:
    assert decode.all_resident(splits * b * 8, 132, 3, 64, h, 2)


@pytest.mark.parametrize("b,s,k,h,page_size,dtype,want", [
    (8, 131072, 8, 64, None, BF16, (2, 8, ("split", "batch", "head"))),  # 256 programs, resident
    (8, 131072, 32, 64, None, BF16, (2, 16, ("head", "split", "batch"))),  # long rows: waves
    (64, 131072, 8, 64, None, BF16, (2, 8, ("head", "split", "batch"))),
    (8, 32768, 32, 64, None, BF16, (2, 2, ("split", "batch", "head"))),  # (too short for them)
    ((8, 16), 131072, 8, 64, None, BF16, (1, 6, ("split", "batch", "head"))),  # T = 16: 64 rows
    (8, 131072, 8, 32, None, BF16, (2, 12, ("split", "batch", "head"))),  # (48 KiB: 4 per SM)
    (64, 32768, 8, 64, None, BF16, (2, 1, ("split", "batch", "head"))),
    (64, 4096, 32, 64, None, BF16, (2, 2, ("head", "split", "batch"))),  # several waves anyway
    (8, 131072, 8, 64, 64, BF16, (2, 16, ("split", "batch", "head"))),  # paged: 4 per SM
    (1, 131072, 8, 64, None, BF16, (1, 33, ("split", "batch", "head"))),  # 32 blocks a program
    (8, 131072, 8, 64, None, jnp.float32, (1, 6, ("split", "batch", "head"))),  # 256-byte rows
    (8, 131072, 7, 64, None, BF16, (1, 7, ("split", "batch", "head"))),  # an odd K
    (8, 131072, 8, 128, None, BF16, (1, 6, ("split", "batch", "head"))),
    # An FP8 cache's 128-byte rows at D = 128: one head per program on a contiguous cache, pairs
    # on a paged one (`decode.fp8_config`).
    (8, 32768, 8, 128, None, jnp.float8_e4m3fn, (1, 6, ("split", "batch", "head"))),
    (64, 32768, 8, 128, None, jnp.float8_e4m3fn, (1, 4, ("head", "split", "batch"))),
    (64, 32768, 8, 128, 64, jnp.float8_e4m3fn, (2, 2, ("split", "batch", "head"))),
    # (fewer pairs than two an SM, long rows: one head on 128-key blocks, `fp8_config`)
    (8, 32768, 8, 128, 64, jnp.float8_e4m3fn, (1, 6, ("split", "batch", "head"))),
    (1, 131072, 8, 128, 64, jnp.float8_e4m3fn, (1, 49, ("split", "batch", "head"))),
    (8, 4096, 8, 128, 64, jnp.float8_e4m3fn, (2, 16, ("split", "batch", "head"))),
])
def test_heads_per_program(b, s, k, h, page_size, dtype, want):
  """The shipped config on an H200 (132 SMs) pairs neighbouring K/V heads in a program where a
  head's key row is at most 128 bytes, K is even and a head's query tile has 16 rows (T = 1 to
  4 at GQA 32/8; ``b`` is (B, T) for T > 1), on a paged cache always and on a contiguous one
  where each program still runs at least 64 key blocks; paired programs fill the SMs' room once
  (contiguous), or 4 per SM (paged), or where they make several waves anyway, take 2 splits and
  launch heads first. A contiguous FP8 cache is not paired, nor a paged one of long rows and few
  (batch row, K/V head) pairs."""
  from jaxflash import _core
  from jaxflash.backends import triton
  from jaxflash.backends.triton import decode
  from jaxflash.devices import Device
  b, t = b if isinstance(b, tuple) else (b, 1)
  q = jax.ShapeDtypeStruct((b, t, 4 * k, h), dtype)
  kv = jax.ShapeDtypeStruct((b, s, k, h), dtype)
  inputs = _core.Inputs(q, kv, kv, jax.ShapeDtypeStruct((b, 2), jnp.int32))
  config = decode.default_config(inputs, triton.Config(), Device("gpu", "NVIDIA H200", True),
                                 page_size=page_size)
  assert (config.heads, config.splits, config.grid_order) == want
  # (A contiguous FP8 cache of many (batch row, K/V head) pairs: programs of 2 warps.)
  fp8_warps = jnp.dtype(dtype).itemsize == 1 and page_size is None and b * k >= 264
  assert config.num_warps == (2 if fp8_warps else 4)
  if config.heads > 1 and page_size is None and config.grid_order[0] == "split":
    assert decode.all_resident(config.splits * b * k // 2, 132, 3, 64, 2 * h,
                               jnp.dtype(dtype).itemsize)


@pytest.mark.parametrize("heads,paged,t", [
    # (A variant: on a CPU [4-False-3] holds several heads a program on a contiguous cache,
    # [2-True-2] and test_fp8_key_factors_per_token_with_two_heads_a_program two heads a program.)
    pytest.param(2, False, 1, marks=pytest.mark.variants),
    (4, False, 3), (2, True, 2)])
def test_several_kv_heads_per_program(heads, paged, t, monkeypatch):
  """`DecodeConfig.heads`: programs of 2 or 4 neighbouring K/V heads, each head with its own
  query tile and softmax state, on a contiguous cache and on shuffled pages: the reference's
  results for ragged rows (empty, partly full, full), a window and a soft cap at a padded head
  dim, over 3 splits; a NaN key of one K/V head makes NaN only its own query heads' rows."""
  from jaxflash.backends.triton import decode
  configs = []
  default = decode.default_config
  # (Four float32 heads' buffers take 64 KiB a stage: one stage of 32-key blocks fits an SM.)
  tiles = dict(block_k=32, num_stages=1) if heads == 4 else {}
  monkeypatch.setattr(decode, "default_config", lambda *a, **kw: configs.append(
      dataclasses.replace(default(*a, **kw), heads=heads, splits=3, **tiles)) or configs[-1])
  b, s, n, k, h = 3, 192, 8, 4, 40
  q, kk, v, _ = random_qkv(5, b, t, s, n, k, h)
  kk = kk.at[1, 20, 2, 3].set(jnp.nan)  # K/V head 2 of row 1: query heads 4 and 5
  kv_lengths = jnp.array([0, 100, 192], jnp.int32)
  options = dict(local_window_size=(150, 0), logits_soft_cap=2.0, implementation="triton",
                 interpret=interpret_for("triton"))
  if paged:
    (k_pages, table), (v_pages, _) = _paged(kk, 32, 6), _paged(v, 32, 6)
    got = jaxflash.decode_attention(q, k_pages, v_pages, kv_lengths, page_table=table, **options)
  else:
    got = jaxflash.decode_attention(q, kk, v, kv_lengths, **options)
  want, _ = _want(q, kk, v, kv_lengths, 150, logits_soft_cap=2.0)
  assert configs and configs[0].heads == heads
  nan = np.isnan(np.asarray(want))
  assert nan[1, :, 4:6].all() and nan.sum() == nan[1, :, 4:6].size
  np.testing.assert_array_equal(np.isnan(np.asarray(got)), nan)
  assert rel_err(np.where(nan, 0, got), np.where(nan, 0, want)) < TOLERANCE[jnp.float32]
  np.testing.assert_array_equal(np.asarray(got)[0], 0.0)  # (the empty row)


def test_heads_per_program_that_do_not_divide_the_kv_heads(monkeypatch):
  """A config of 2 K/V heads per program on a cache of 3 (as a shard of a call sharded over
  its heads may hold fewer heads than the config was chosen for) runs one head per program;
  fewer than one is refused by name."""
  from jaxflash.backends.triton import decode
  with pytest.raises(ValueError, match="heads must be at least 1"):
    decode.DecodeConfig(splits=1, heads=0)
  default, folds = decode.default_config, []
  monkeypatch.setattr(decode, "default_config", lambda *a, **kw: dataclasses.replace(
      default(*a, **kw), heads=2))
  monkeypatch.setattr(decode, "_kernel", functools.partial(
      lambda kernel, q_ref, *a, **kw: folds.append(q_ref.shape[0]) or kernel(q_ref, *a, **kw),
      decode._kernel))
  q, kk, v, _ = random_qkv(5, 1, 1, 64, 3, 3, 32)
  lengths = jnp.array([50], jnp.int32)
  got = jaxflash.decode_attention(q, kk, v, lengths, implementation="triton",
                                  interpret=interpret_for("triton"))
  assert folds and set(folds) == {1}
  assert rel_err(got, _want(q, kk, v, lengths)[0]) < TOLERANCE[jnp.float32]


@pytest.mark.parametrize("splits,h", [(70, 40), (5, 64)])
def test_merge_kernel_matches_the_xla_merge(splits, h):
  """The Triton merge over many splits (70: three chunks, the last partial) and few, against
  the XLA merge: splits that saw nothing (-inf), a row no split saw (zeros, +inf), a NaN split
  (a NaN row); the output in bf16."""
  from jaxflash.backends.triton import decode
  keys = jax.random.split(jax.random.key(3), 3)
  b, kv_heads, rows = 2, 3, 5
  outs = jax.random.normal(keys[0], (b, kv_heads, splits, rows, h), jnp.float32)
  lse2 = 4 * jax.random.normal(keys[1], (b, kv_heads, splits, rows), jnp.float32)
  empty = jax.random.bernoulli(keys[2], 0.3, lse2.shape)
  lse2 = jnp.where(empty, -jnp.inf, lse2)
  outs = jnp.where(empty[..., None], 0.0, outs)
  lse2 = lse2.at[0, 1, :, 2].set(-jnp.inf).at[1, 2, splits // 2, 4].set(jnp.nan)
  got_out, got_lse = decode._merge_in_kernel(outs, lse2, BF16, interpret=True)
  want_out, want_lse = decode._merge_splits(outs, lse2)
  assert got_out.dtype == BF16 and got_out.shape == (b, kv_heads, rows, h)
  np.testing.assert_allclose(np.asarray(got_out, np.float32), np.asarray(want_out), atol=2e-2)
  np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), rtol=1e-6)
  assert got_lse[0, 1, 2] == jnp.inf and not np.asarray(got_out[0, 1, 2], np.float32).any()
  assert np.isnan(got_lse[1, 2, 4]) and np.isnan(np.asarray(got_out[1, 2, 4], np.float32)).all()


# (16 a variant: `merge.MERGE_UNROLLED` is 64, so on a CPU [2] and [5] hold the same
# range-by-range merge.)
@pytest.mark.parametrize("splits", [2, 5, pytest.param(16, marks=pytest.mark.variants)])
def test_unrolled_merge_matches_partial_merge(splits, monkeypatch):
  """The split-KV merge of up to 16 splits, which `jaxflash.merge.merge` works split by
  split, against its stacked form (reductions over the split axis, as it merges more than
  `MERGE_UNROLLED`): splits that saw nothing (-inf), a row no split saw (zeros, +inf), a NaN
  split (a NaN row), and large LSEs (no overflow)."""
  from jaxflash import _core, merge
  from jaxflash.backends.triton import decode
  keys = jax.random.split(jax.random.key(4), 3)
  b, kv_heads, rows, h = 2, 3, 5, 40
  outs = jax.random.normal(keys[0], (b, kv_heads, splits, rows, h), jnp.float32)
  lse2 = 4 * jax.random.normal(keys[1], (b, kv_heads, splits, rows), jnp.float32)
  empty = jax.random.bernoulli(keys[2], 0.3, lse2.shape)
  lse2 = jnp.where(empty, -jnp.inf, lse2).at[0, 0, :, 1].add(300.0)
  outs = jnp.where(empty[..., None], 0.0, outs)
  lse2 = lse2.at[0, 1, :, 2].set(-jnp.inf).at[1, 2, splits // 2, 4].set(jnp.nan)
  got_out, got_lse = decode._merge_splits(outs, lse2)
  monkeypatch.setattr(merge, "MERGE_UNROLLED", 0)
  want_out, want_lse = merge.merge(outs, lse2 * (1.0 / _core.LOG2_E), axis=2)
  chex.assert_trees_all_close(got_out, want_out, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(got_lse, _core.base2_lse(want_lse), rtol=1e-6)
  assert np.isfinite(np.asarray(got_out[0, 0, 1])).all()
  assert got_lse[0, 1, 2] == jnp.inf and not np.asarray(got_out[0, 1, 2]).any()
  assert np.isnan(got_lse[1, 2, 4]) and np.isnan(np.asarray(got_out[1, 2, 4])).all()
  np.testing.assert_array_equal(np.isnan(np.asarray(got_out)), np.isnan(np.asarray(want_out)))


# (T = 1 a variant: on a CPU [5-7-2.0] holds the one split's own write, and
# test_decode_matches_the_reference[1-None-None-triton] T = 1 on the kernel.)
@pytest.mark.parametrize("t,window,cap", [pytest.param(1, None, None, marks=pytest.mark.variants),
                                          (5, 7, 2.0)])
def test_one_split_writes_the_result_itself(t, window, cap, monkeypatch):
  """With a single split the Triton kernel writes the output (query dtype) and the LSE itself,
  with nothing to merge: the reference test's rows, empty ones included."""
  jax.clear_caches()  # (the spy counts traces)
  merges = _force_splits(monkeypatch, 1)
  _check_against_reference("triton", t, window, cap)
  assert not merges


# (The XLA backend's 3-split cases are variants: it runs no split-KV kernel, so on a CPU
# [xla-1-kernel] holds its path.)
@pytest.mark.parametrize("implementation,splits,merge", [
    ("xla", 1, "kernel"),
    pytest.param("xla", 3, "kernel", marks=pytest.mark.variants),
    pytest.param("xla", 3, "xla", marks=pytest.mark.variants),
    ("triton", 1, "kernel"), ("triton", 3, "kernel"), ("triton", 3, "xla")])
def test_nan_in_the_cache_or_query_gives_nan_rows(implementation, splits, merge, monkeypatch):
  """A NaN in a query, or in a key that a row sees, makes that row's output and LSE NaN (on
  Triton whether the kernel writes the result itself or either merge of three splits does);
  rows that do not see the NaN key stay finite."""
  jax.clear_caches()
  merges = _force_splits(monkeypatch, splits, merge)
  b, t, s, n, k, h = 2, 2, 96, 4, 2, 32
  q, kk, v, _ = random_qkv(4, b, t, s, n, k, h)
  kv_lengths = jnp.array([96, 50], jnp.int32)
  run = functools.partial(jaxflash.decode_attention, return_residual=True,
                          implementation=implementation, interpret=interpret_for(implementation))
  out, lse = run(q.at[1, 0, 3, 5].set(jnp.nan), kk, v, kv_lengths)
  assert np.isnan(out[1, 0, 3]).all() and np.isnan(lse[1, 0, 3])  # (LSE [B, T, N])
  assert np.isfinite(out[0]).all() and np.isfinite(out[1, 1]).all()
  out, lse = run(q, kk.at[1, 10, 0, 2].set(jnp.nan), v, kv_lengths)  # K/V head 0: heads 0, 1
  assert np.isnan(out[1, :, :2]).all() and np.isnan(lse[1, :, :2]).all()
  assert np.isfinite(out[1, :, 2:]).all() and np.isfinite(out[0]).all()
  assert set(merges) == ({merge} if implementation == "triton" and splits > 1 else set())


def _check_against_reference(implementation, t, window, cap):
  b, s, n, k, h = 4, 80, 4, 2, 40
  dtype = _input_dtype(implementation)
  q, kk, v, _ = random_qkv(1, b, t, s, n, k, h, dtype)
  kv_lengths = jnp.array([0, 3, 37, s], jnp.int32)
  got, lse = jaxflash.decode_attention(
      q, kk, v, kv_lengths, local_window_size=None if window is None else (window, 0),
      logits_soft_cap=cap, return_residual=True, implementation=implementation,
      interpret=interpret_for(implementation))
  want, want_lse = _want(q, kk, v, kv_lengths, window, logits_soft_cap=cap)
  assert got.shape == q.shape and got.dtype == q.dtype
  assert rel_err(got, want) < TOLERANCE[dtype]
  empty = ~np.isfinite(np.asarray(want_lse))
  assert empty[0].all() and empty[1, :t - 3].all() and not empty[2:].any()
  np.testing.assert_array_equal(np.asarray(got, np.float32)[empty], 0.0)
  np.testing.assert_array_equal(np.asarray(lse) == -np.inf, empty)
  assert rel_err(np.where(empty, 0, lse), np.where(empty, 0, want_lse)) < TOLERANCE[dtype]


# (XLA's 16-key pages a variant: on a CPU [16-triton] holds the pages' gradients, which every
# backward takes through the same gather (`gather_pages`; unused pages get none), and
# test_value_dim.py::test_decode[True-xla] the XLA backend on the rows the pages make,
# gradients too.)
@pytest.mark.parametrize("page_size,implementation", [
    pytest.param(size, name, marks=(pytest.mark.gpu if size == 32 else
                                    pytest.mark.variants if (size, name) == (16, "xla") else ()))
    for size in (16, 32, 24) for name in IMPLEMENTATIONS])
def test_paged_cache_matches_contiguous(implementation, page_size, monkeypatch):
  """A paged cache with a shuffled page table gives the contiguous cache's result (bf16), and
  its gradients reach the pages. On Triton the split-KV kernel reads the pages where they lie
  (pages of 16 and 32 keys are its key blocks; 24 is not a power of two, so those are gathered
  into rows first); the other backends gather them."""
  if not ON_GPU and implementation == "xla" and page_size != 16:
    pytest.skip("the XLA backend gathers every page size alike: 16 on a CPU (CI time)")
  from jaxflash.backends.triton import decode
  jax.clear_caches()  # the spy counts traces: none may come from an earlier test's cache
  paged_reads = []
  kernel = decode.forward
  monkeypatch.setattr(decode, "forward", lambda *a: paged_reads.append(
      len(a) > 3 and a[3] is not None) or kernel(*a))
  b, s, n, k, h, t = 3, 96, 4, 1, 64, 2
  q, kk, v, d_out = random_qkv(2, b, t, s, n, k, h, BF16)
  kv_lengths = jnp.array([96, 50, 2], jnp.int32)
  k_pages, table = _paged(kk, page_size, 3)
  v_pages, _ = _paged(v, page_size, 3)
  options = dict(implementation=implementation, interpret=interpret_for(implementation))

  def paged(q, k_pages, v_pages):
    return jaxflash.decode_attention(q, k_pages, v_pages, kv_lengths, page_table=table,
                                     **options)

  out, vjp = jax.vjp(paged, q, k_pages, v_pages)
  # One trace of the split-KV kernel (with several devices too: the partitioning primitive's
  # shapes and lowering share it), reading the pages where they lie or gathered rows.
  assert paged_reads == ([True] if implementation == "triton" and page_size != 24 else
                         [False] if implementation == "triton" else [])
  contiguous = jaxflash.decode_attention(q, kk, v, kv_lengths, **options)
  assert rel_err(out, contiguous) < TOLERANCE[BF16]
  want, _ = _want(q, kk, v, kv_lengths)
  assert rel_err(out, want) < TOLERANCE[BF16]
  # The pages' gradients are the rows' gradients, put back where the pages lie; unused pages
  # get none.
  dq, dk_pages, dv_pages = vjp(d_out.astype(out.dtype))
  _, row_vjp = jax.vjp(lambda q, kk, v: _want(q, kk, v, kv_lengths)[0].astype(out.dtype),
                       q, kk, v)
  _, dk_rows, dv_rows = row_vjp(d_out.astype(out.dtype))
  used = np.asarray(table).reshape(-1)
  for pages_grad, rows_grad in ((dk_pages, dk_rows), (dv_pages, dv_rows)):
    pages_grad = np.asarray(pages_grad, np.float32)
    assert rel_err(pages_grad[used].reshape(rows_grad.shape), rows_grad) < 5e-2
    assert not np.delete(pages_grad, used, axis=0).any()


@pytest.mark.parametrize("page_size,block_k,heads", [(64, 16, 1), (16, 64, 2), (16, 64, 1),
                                                     (32, 32, 2)])
def test_key_blocks_made_of_pages(page_size, block_k, heads, monkeypatch):
  """The split-KV kernel's key blocks on a paged cache: parts of a page (64-key pages, 16-key
  blocks), several whole pages (16-key pages, 64-key blocks: four a block, or two where a row's
  6 pages do not divide by four) or one; over 3 splits, against the reference, with rows that
  end inside a page, T = 2 and a window."""
  from jaxflash.backends.triton import decode
  configs, blocks = [], []
  default = decode.default_config
  monkeypatch.setattr(decode, "default_config", lambda *a, **kw: configs.append(
      dataclasses.replace(default(*a, **kw), block_k=block_k, splits=3, heads=heads))
      or configs[-1])
  key_pieces = decode._key_pieces
  monkeypatch.setattr(decode, "_key_pieces", lambda j, table, block, *a: blocks.append(block)
                      or key_pieces(j, table, block, *a))
  per_row = 6 if page_size == 16 and heads == 1 else 4
  b, t, n, k, h = 3, 2, 4, 2, 32
  s = per_row * page_size
  q, kk, v, _ = random_qkv(7, b, t, s, n, k, h)
  kv_lengths = jnp.array([s, s // 2 + 5, 9], jnp.int32)
  (k_pages, table), (v_pages, _) = _paged(kk, page_size, 8), _paged(v, page_size, 8)
  got = jaxflash.decode_attention(q, k_pages, v_pages, kv_lengths, page_table=table,
                                  local_window_size=(s // 2, 0), implementation="triton",
                                  interpret=interpret_for("triton"))
  want, _ = _want(q, kk, v, kv_lengths, s // 2)
  assert configs and blocks and set(blocks) == {32 if per_row == 6 else block_k}
  assert rel_err(got, want) < TOLERANCE[jnp.float32]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_unused_page_table_entries_may_hold_anything(implementation, monkeypatch):
  """Servers pad page tables past a row's pages (-1, or the pool's size): only a row's first
  ceil(length / page_size) entries are read. Before, XLA's gather filled the rows of an id out
  of range with NaN (which the masked P V carried) and Triton's kernel, whose 64-key blocks of
  16-key pages reach past a row's last page, read them too. Results and gradients (of the
  query and the pages) equal those of a table whose unused entries are real pages."""
  from jaxflash.backends.triton import decode
  default = decode.default_config
  monkeypatch.setattr(decode, "default_config", lambda *a, **kw: dataclasses.replace(
      default(*a, **kw), block_k=64))
  b, t, n, k, h, page_size, per_row = 3, 2, 4, 2, 32, 16, 8
  dtype = _input_dtype(implementation)
  q, kk, v, d_out = random_qkv(11, b, t, per_row * page_size, n, k, h, dtype)
  kv_lengths = jnp.array([per_row * page_size, 37, 0], jnp.int32)
  (k_pages, table), (v_pages, _) = _paged(kk, page_size, 9), _paged(v, page_size, 9)
  unused = np.arange(per_row)[None, :] * page_size >= np.asarray(kv_lengths)[:, None]
  padding = np.array([[-1], [k_pages.shape[0]], [-1]])  # (row 1's 4th entry is in a used block)
  padded = jnp.asarray(np.where(unused, padding, np.asarray(table)), jnp.int32)
  options = dict(implementation=implementation, interpret=interpret_for(implementation))

  def run(table):
    return jax.vjp(lambda q, kp, vp: jaxflash.decode_attention(
        q, kp, vp, kv_lengths, page_table=table, **options), q, k_pages, v_pages)

  (out, vjp), (want_out, want_vjp) = run(padded), run(table)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert rel_err(out, want_out) < TOLERANCE[dtype]
  assert rel_err(out, _want(q, kk, v, kv_lengths)[0]) < TOLERANCE[dtype]
  for got, want in zip(vjp(d_out.astype(dtype)), want_vjp(d_out.astype(dtype))):
    assert np.isfinite(np.asarray(got, np.float32)).all() and rel_err(got, want) < TOLERANCE[dtype]


def test_page_table_as_a_list_and_lengths_left_out():
  """A page table given as nested lists is converted as jax.nn converts lists (it crashed on
  ``.astype``), and kv_lengths=None means full rows on pages as on a contiguous cache (it
  crashed gathering the pages)."""
  b, t, n, k, h, page_size, per_row = 2, 1, 4, 2, 16, 8, 4
  q, kk, v, _ = random_qkv(12, b, t, per_row * page_size, n, k, h)
  (k_pages, table), (v_pages, _) = _paged(kk, page_size, 3), _paged(v, page_size, 3)
  full = jnp.full((b,), per_row * page_size, jnp.int32)
  want = jaxflash.decode_attention(q, k_pages, v_pages, full, page_table=table)
  chex.assert_trees_all_equal(jaxflash.decode_attention(
      q, k_pages, v_pages, full.tolist(), page_table=np.asarray(table).tolist()), want)
  chex.assert_trees_all_equal(jaxflash.decode_attention(q, k_pages, v_pages, None,
                                                        page_table=table), want)
  chex.assert_trees_all_equal(jaxflash.decode_attention(q, kk, v, None),
                              jaxflash.decode_attention(q, kk, v, full))


def test_decode_is_flash_attention_with_shifted_positions():
  """A full cache (every row holds S tokens): the last T rows of causal self-attention over the
  cache; and the gradients match the reference's."""
  b, s, n, h, t = 2, 64, 2, 32, 3
  q_all, kk, v, d_out = random_qkv(4, b, s, s, n, n, h)
  q = q_all[:, -t:]
  kv_lengths = jnp.full((b,), s, jnp.int32)
  got = jaxflash.decode_attention(q, kk, v, kv_lengths, implementation="xla")
  full = jaxflash.flash_attention(q_all, kk, v, is_causal=True, implementation="xla")
  chex.assert_trees_all_close(got, full[:, -t:], rtol=1e-5, atol=1e-5)

  def loss(fn):
    return lambda q, kk, v: jnp.sum(fn(q, kk, v) * d_out[:, :t])

  grads = jax.grad(loss(lambda *x: jaxflash.decode_attention(*x, kv_lengths,
                                                             implementation="xla")),
                   argnums=(0, 1, 2))(q, kk, v)
  want = jax.grad(loss(lambda *x: _want(*x, kv_lengths)[0]), argnums=(0, 1, 2))(q, kk, v)
  for g, w in zip(grads, want):
    assert rel_err(g, w) < TOLERANCE[jnp.float32]


def test_decode_under_jit_with_traced_lengths():
  """A generation step compiled once: the lengths are traced values, not constants."""
  b, s, n, h = 2, 48, 2, 32
  q, kk, v, _ = random_qkv(5, b, 1, s, n, n, h)
  step = jax.jit(lambda q, kk, v, lengths: jaxflash.decode_attention(q, kk, v, lengths,
                                                                     implementation="xla"))
  for lengths in ([1, 48], [20, 7]):
    lengths = jnp.array(lengths, jnp.int32)
    assert rel_err(step(q, kk, v, lengths), _want(q, kk, v, lengths)[0]) < 1e-5


@pytest.mark.parametrize("args,match", [
    (dict(query=jnp.zeros((5, 2, 8))), "query must be"),
    (dict(key_cache=jnp.zeros((2, 10, 1, 8))), "one shape"),
    (dict(key_cache=jnp.zeros((3, 10, 1, 8)), value_cache=jnp.zeros((3, 10, 1, 8))),
     "batch size 2"),
    (dict(query=jnp.zeros((2, 11, 2, 8))), "more than the cache holds"),
    (dict(page_table=jnp.zeros((2, 3)), ), "page_table must be an integer"),
    (dict(page_table=jnp.zeros((3, 3), jnp.int32)), "page_table must have shape"),
    (dict(page_table=jnp.zeros((2, 3), jnp.int32), key_cache=jnp.zeros((0, 4, 1, 8)),
          value_cache=jnp.zeros((0, 4, 1, 8))), "key_cache .the pages, with page_table. must hold"),
    (dict(kv_lengths=jnp.zeros((2,))), "kv_lengths must be an integer"),
    (dict(key_cache=jnp.zeros((2, 10, 1, 8), BF16), value_cache=jnp.zeros((2, 10, 1, 8), BF16)),
     "dtype"),
    (dict(value_cache=None), "value_head_dim must be an int in"),
    (dict(value_cache=None, value_head_dim=9), "value_head_dim must be an int in"),
    (dict(value_cache=None, value_head_dim=4.0), "value_head_dim must be an int in"),
    (dict(value_cache=None, value_head_dim=4, key_cache=jnp.zeros((2, 10, 8))),
     "key_cache must be"),
    (dict(value_head_dim=4), "value_head_dim is for value_cache=None"),
    (dict(key_cache=jnp.zeros((10, 1, 8)), value_cache=jnp.zeros((10, 1, 8))),
     r"key_cache must be \[B, S_max"),
    # (A page that a row's length reaches must exist: 2 pages of 10 here, and row 1's length
    # 12 reaches its second entry; row 0's second entry is past its length, so anything.)
    (dict(page_table=jnp.array([[0, -1], [1, 2]]), kv_lengths=jnp.array([1, 12])),
     r"page_table\[1, 1\] = 2 is not a page id in \[0, 2\)"),
    (dict(page_table=jnp.array([[0, -1], [1, -2]]), kv_lengths=jnp.array([1, 12])),
     r"page_table\[1, 1\] = -2"),
    # Pages' heads, head dims and dtypes are named as given (the messages showed the rows
    # gathered from the pages, as "key").
    (dict(query=jnp.zeros((2, 1, 3, 8)), key_cache=jnp.zeros((2, 10, 2, 8)),
          page_table=jnp.zeros((2, 1), jnp.int32)),
     r"query's 3 heads must be a multiple of key_cache's K/V heads .* key_cache \(2, 10, 2, 8\)"),
    (dict(query=jnp.zeros((2, 1, 2, 16)), page_table=jnp.zeros((2, 1), jnp.int32)),
     r"key_cache must have the query's head dim 16"),
    (dict(query=jnp.zeros((2, 1, 2, 8), BF16), page_table=jnp.zeros((2, 1), jnp.int32)),
     r"query, key_cache and value_cache must share one dtype, got bfloat16, float32"),
])
def test_decode_refuses_bad_input(args, match):
  base = dict(query=jnp.zeros((2, 1, 2, 8)), key_cache=jnp.zeros((2, 10, 1, 8)),
              value_cache=jnp.zeros((2, 10, 1, 8)), kv_lengths=jnp.array([1, 2]))
  base.update(args)
  if "key_cache" in args and "value_cache" not in args:
    base["value_cache"] = jnp.zeros((2, 10, 2, 8))
  with pytest.raises(ValueError, match=match):
    jaxflash.decode_attention(base.pop("query"), base.pop("key_cache"), base.pop("value_cache"),
                              base.pop("kv_lengths"), implementation="xla", **base)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("paged", [True, False])
def test_decode_with_x64_and_strict_rank_promotion(implementation, paged):
  """int64 lengths and page tables under jax_enable_x64 (the Triton kernel's index maps and
  bounds once mixed int32 with int64 there), and no implicit rank promotion (sinks joined to
  the split-KV kernels' merged result once broadcast [N] against [B, T, N])."""
  b, s, n, h, t = 2, 32, 2, 16, 2
  dtype = _input_dtype(implementation)
  q, kk, v, _ = random_qkv(6, b, t, s, n, n, h, dtype)
  sinks = jnp.array([0.5, -1.0])
  with jax.enable_x64(True), jax.numpy_rank_promotion("raise"):
    lengths = jnp.array([5, 32], jnp.int64)
    cache = dict(key_cache=kk, value_cache=v)
    if paged:
      (k_pages, table), (v_pages, _) = _paged(kk, 8, 7), _paged(v, 8, 7)
      cache = dict(key_cache=k_pages, value_cache=v_pages, page_table=table.astype(jnp.int64))
    got = jaxflash.decode_attention(q, kv_lengths=lengths, sinks=sinks,
                                    implementation=implementation,
                                    interpret=interpret_for(implementation), **cache)
  want, _ = _want(q, kk, v, jnp.array([5, 32], jnp.int32), sinks=sinks)
  assert rel_err(got, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("t,window,cap,order,merge", [
    # (A variant: on a CPU [3-150-1.5-order1-kernel] holds the split-KV forward of Triton's
    # decoding with the training backward's gradients; the XLA merge of several splits in the
    # default order test_decode_matches_the_reference[*-triton] (2 splits) and
    # test_nan_in_the_cache_or_query_gives_nan_rows[triton-3-xla].)
    pytest.param(1, None, None, None, "xla", marks=pytest.mark.variants),
    (3, 150, 1.5, ("head", "split", "batch"), "kernel")])
def test_split_kv_kernel_serves_triton_decoding(t, window, cap, order, merge, monkeypatch):
  """On the Triton backend a decoding call runs the split-KV forward (not the training forward):
  several splits of a 600-key cache (a partial last block), merged through the LSE by either
  merge; GQA with 3 query heads per K/V head, ragged rows, a window and a soft cap, and a grid in
  another launch order. Its gradients come from the training backward and match the
  reference's."""
  from jaxflash.backends.triton import decode, forward
  monkeypatch.setattr(forward, "forward", lambda *a: pytest.fail("the training forward ran"))
  configs = []
  default = decode.default_config
  ordered = lambda c: dataclasses.replace(c, grid_order=order or c.grid_order, merge=merge)  # noqa: E731
  monkeypatch.setattr(decode, "default_config",
                      lambda *a, **kw: configs.append(ordered(default(*a, **kw))) or configs[-1])
  b, s, n, k, h = 2, 600, 6, 2, 64
  q, kk, v, d_out = random_qkv(8, b, t, s, n, k, h)
  lengths = jnp.array([600, 290], jnp.int32)
  options = dict(local_window_size=None if window is None else (window, 0),
                 logits_soft_cap=cap, implementation="triton", interpret=interpret_for("triton"))

  def ours(q, kk, v):
    return jaxflash.decode_attention(q, kk, v, lengths, **options)

  def ref(q, kk, v):
    return _want(q, kk, v, lengths, window, logits_soft_cap=cap)[0]

  out, vjp = jax.vjp(ours, q, kk, v)
  want, ref_vjp = jax.vjp(ref, q, kk, v)
  assert configs and configs[0].splits > 1
  assert configs[0].grid_order == (order or ("split", "batch", "head"))
  assert configs[0].merge == merge
  assert rel_err(out, want) < TOLERANCE[jnp.float32]
  for g, w in zip(vjp(d_out[:, :t]), ref_vjp(d_out[:, :t])):
    assert rel_err(g, w) < TOLERANCE[jnp.float32]


@pytest.mark.parametrize("options", [
    pytest.param(dict(), marks=pytest.mark.gpu),  # (the others hold it: CI time)
    # (A variant: on a CPU [window_cap] holds the routing, a top-left band with both sides, the
    # lengths, GQA, the gradients and the training forward of 17 rows.)
    pytest.param(dict(is_causal=True, local_window_size=(1, 0)), marks=pytest.mark.variants),
    dict(local_window_size=(2, 1), logits_soft_cap=1.5),
], ids=["full", "causal_window", "window_cap"])
def test_flash_attention_routes_few_queries_to_split_kv(options, monkeypatch):
  """`jaxflash.flash_attention` with at most 16 query rows runs the split-KV forward on the
  Triton backend, with its own top-left band (not a cache's), query and key lengths (a row
  with no queries, one with no keys), GQA; forward, LSE and gradients against the reference.
  A call with more query rows keeps the training forward."""
  from jaxflash import attention
  from jaxflash.backends.triton import decode, forward
  training_forward = forward.forward
  jax.clear_caches()  # the spies count traces: none may come from an earlier test's cache
  ran = {"split_kv": 0, "training": 0}
  split_kv = decode.forward
  monkeypatch.setattr(decode, "forward", lambda *a: ran.update(split_kv=ran["split_kv"] + 1)
                      or split_kv(*a))
  monkeypatch.setattr(forward, "forward", lambda *a: ran.update(training=ran["training"] + 1)
                      or training_forward(*a))
  b, t, s, n, k, h = 3, 4, 300, 6, 2, 40
  q, kk, v, d_out = random_qkv(9, b, t, s, n, k, h)
  lengths = dict(query_seq_lengths=jnp.array([4, 0, 3]), key_value_seq_lengths=jnp.array(
      [300, 170, 0]))
  call = dict(options, **lengths, implementation="triton", interpret=interpret_for("triton"))

  def ours(q, kk, v):
    return jaxflash.flash_attention(q, kk, v, return_residual=True, **call)

  (out, lse), vjp = jax.vjp(ours, q, kk, v)
  (want, want_lse), ref_vjp = jax.vjp(
      lambda *x: reference_attention(*x, **options, **lengths), q, kk, v)
  assert ran == {"split_kv": 1, "training": 0}  # (one trace, with several devices too)
  assert rel_err(out, want) < TOLERANCE[jnp.float32]
  seen = np.isfinite(np.asarray(want_lse))  # [B, T, N]: rows that see some key
  assert not seen[1].any() and not seen[2].any() and seen[0].all()
  np.testing.assert_array_equal(np.asarray(out)[~seen], 0.0)
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen)
  assert rel_err(np.where(seen, lse, 0), np.where(seen, want_lse, 0)) < TOLERANCE[jnp.float32]
  cot = (d_out, jnp.zeros_like(lse))
  for g, w in zip(vjp(cot), ref_vjp(cot)):
    assert rel_err(g, w) < TOLERANCE[jnp.float32]
  q17 = jnp.concatenate([q] * 5, axis=1)[:, :attention.SPLIT_KV_MAX_QUERIES + 1]
  split_kv = ran["split_kv"]
  jaxflash.flash_attention(q17, kk, v, implementation="triton",
                           interpret=interpret_for("triton"))
  assert ran["split_kv"] == split_kv and ran["training"] >= 1


@pytest.mark.parametrize("first,last,splits", [(0, 512, 6), (0, 51, 6), (40, 47, 6),
                                                (3, 3, 4), (9, 2, 4), (0, 5, 8), (7, 1000, 1)])
def test_splits_share_out_the_rows_own_blocks(first, last, splits):
  """`split_range` gives the splits runs that tile the row's blocks [first, last) exactly, in
  order, none longer than ceil(blocks / splits): a cache a tenth full (51 of 512 blocks) keeps
  every split busy instead of leaving the work to the first."""
  from jaxflash.schedule import split_range
  ranges = [tuple(int(x) for x in split_range(jnp.int32(i), splits, jnp.int32(first),
                                              jnp.int32(last))) for i in range(splits)]
  covered = [j for lo, hi in ranges for j in range(lo, hi)]
  assert covered == list(range(first, max(first, last)))
  blocks = max(last - first, 0)
  assert all(hi - lo <= -(-blocks // splits) for lo, hi in ranges)
  if blocks >= splits:
    assert all(hi > lo for lo, hi in ranges[:blocks // -(-blocks // splits)])


def test_visible_keys_of_a_mask():
  """The range of keys a decoding mask lets each batch row see (what the split-KV kernel's
  splits share out): from the first visible key of any query row or head to the last."""
  from jaxflash.backends.triton.decode import visible_keys
  mask = np.zeros((3, 2, 2, 50), bool)
  mask[0, 1, 0, [7, 30]] = True
  mask[0, 0, 1, 12] = True
  mask[1, :, :, 40:] = True
  first, stop = visible_keys(jnp.asarray(mask))
  assert first.tolist() == [7, 40, 50] and stop.tolist() == [31, 50, 0]


@pytest.mark.parametrize("window", [5, 130])
def test_split_kv_with_a_sliding_window_mask(window, monkeypatch):
  """A decoding step given its sliding window as a dense mask (as a Flax model with local
  layers passes it through the hook): the kernel skips the keys before the window and four
  splits share out the rest; the result is the reference's, rows of several lengths."""
  from jaxflash.backends.triton import decode
  default = decode.default_config
  configs = []
  monkeypatch.setattr(decode, "default_config", lambda *a, **kw: configs.append(
      dataclasses.replace(default(*a, **kw), splits=4)) or configs[-1])
  b, t, s, n, k, h = 3, 2, 700, 4, 2, 32
  q, kk, v, _ = random_qkv(11, b, t, s, n, k, h)
  length = np.array([700, 333, 64])
  pos = np.arange(s)
  query_pos = length[:, None] - t + np.arange(t)[None]  # [B, T]
  mask = ((pos[None, None] <= query_pos[..., None]) & (pos[None, None] > query_pos[..., None]
                                                       - window))[:, None]  # [B, 1, T, S]
  ours = jaxflash.flash_attention(q, kk, v, mask=jnp.asarray(mask), implementation="triton",
                                  interpret=interpret_for("triton"))
  want, _ = reference_attention(q, kk, v, mask=jnp.asarray(mask))
  assert configs and rel_err(ours, want) < TOLERANCE[jnp.float32]


@pytest.mark.parametrize("blocks,rows,want", [
    (2048, 32, 12),  # 32 K/V heads at B = 1, 128k keys: 384 programs, not 288 (measured)
    (512, 64, 6),  # 8 K/V heads at B = 8, 32k keys: 384 programs, not 320
    (2048, 8, 33),  # 8 K/V heads at B = 1: 264 programs, two per SM already
    (512, 256, 2),
    (64, 2048, 1),
    (3, 4, 3),  # never more splits than key blocks
])
def test_wave_splits(blocks, rows, want):
  """The split count spreads programs evenly over an H200's 132 SMs (2 to 4 per SM), leaves no
  split without a key block, and spreads them at least as evenly as two per SM rounded up."""
  from jax.experimental import pallas as pl
  from jaxflash.backends.triton.decode import wave_splits
  from jaxflash.schedule import used_splits
  splits = wave_splits(blocks, rows, 132)
  assert splits == want
  assert pl.cdiv(blocks, pl.cdiv(blocks, splits)) == splits <= blocks
  fill = lambda p: p / (pl.cdiv(p, 132) * 132)  # noqa: E731
  old = used_splits(blocks, pl.cdiv(264, rows))
  assert fill(splits * rows) >= fill(old * rows)


def _fp8_cache(seed: int, b: int, t: int, s: int, n: int, k: int, h: int, form: str = "head"):
  """A query and K/V cache in e4m3 with their factors (the query's per token, the cache's per
  (batch row, K/V head) with ``form`` "head", per tensor with "tensor", or with "token" the
  key's per token and the value's per head) and the float32 values they stand for."""
  q, kk, v, _ = random_qkv(seed, b, t, s, n, k, h, jnp.float32, scale=2.0)
  q8, qd = jaxflash.quantize_fp8(q, block_size=1)
  k8, kd = jaxflash.quantize_fp8(kk)
  v8, vd = jaxflash.quantize_fp8(3.0 * v)
  if form == "token":  # keys of every size: each token's factor matters
    k8, kd = jaxflash.quantize_fp8(kk * jnp.exp(jnp.sin(jnp.arange(s)))[:, None, None],
                                   block_size=1)
  elif form == "tensor":  # one factor a tensor
    k8, kd = kk.astype(jnp.float8_e4m3fn), jnp.float32(1.0)
    v8, vd = v.astype(jnp.float8_e4m3fn), jnp.float32(0.5)
  real_k = fp8.dequantize(k8, kd if jnp.ndim(kd) == 3 else kd[:, None] if jnp.ndim(kd) else kd)
  values = (fp8.dequantize(q8, qd), real_k,
            fp8.dequantize(v8, vd[:, None] if jnp.ndim(vd) else vd))
  return (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd), values


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("t,paged,form", [
    # (A variant: on a CPU [3-True-head-*] holds the factors per (batch row, K/V head),
    # [2-False-tensor-*] and [2-False-token-*] a contiguous cache, and on Triton
    # test_fp8_key_factors_per_token_with_two_heads_a_program T = 1.)
    pytest.param(1, False, "head", marks=pytest.mark.variants),
    (3, True, "head"), (2, False, "tensor"), (2, False, "token")])
def test_fp8_cache_matches_its_real_values(implementation, t, paged, form, monkeypatch):
  """An FP8 query and K/V cache with descale factors give attention of the values they stand
  for (a float32 reference on the dequantised values): ragged rows (one empty: zeros), GQA,
  factors per token (query; and key, on a contiguous cache), per (batch row, K/V head) and per
  tensor, a paged cache read where it lies, the output in bfloat16 by default. On Triton the
  split-KV kernel runs (its training backend is another's: Triton's training kernels refuse
  FP8)."""
  from jaxflash.backends.triton import decode
  jax.clear_caches()
  kernel_calls = []
  kernel = decode.forward
  monkeypatch.setattr(decode, "forward", lambda *a: kernel_calls.append(1) or kernel(*a))
  b, s, n, k, h = 3, 96, 4, 2, 64
  (q8, k8, v8), descales, (q, kk, v) = _fp8_cache(4, b, t, s, n, k, h, form)
  kv_lengths = jnp.array([96, 40, 0], jnp.int32)
  options = dict(implementation=("triton", "xla") if implementation == "triton" else
                 implementation, interpret=interpret_for(implementation), **descales)
  if paged:
    (k8, table), (v8, _) = _paged(k8, 16, 5), _paged(v8, 16, 5)
    options["page_table"] = table
  out = jaxflash.decode_attention(q8, k8, v8, kv_lengths, **options)
  assert out.dtype == jnp.bfloat16
  want, _ = _want(q, kk, v, kv_lengths)
  assert rel_err(out, want) < 2e-2
  np.testing.assert_array_equal(np.asarray(out[2], np.float32), 0.0)
  assert bool(kernel_calls) == (implementation == "triton")


def test_fp8_key_factors_per_token_with_two_heads_a_program(monkeypatch):
  """A key factor per token read by programs of two K/V heads over three splits (each head
  its own column of the factors [B, S, K]): the reference of the real values."""
  from jaxflash.backends.triton import decode
  configs = []
  default = decode.default_config
  monkeypatch.setattr(decode, "default_config", lambda *a, **kw: configs.append(
      dataclasses.replace(default(*a, **kw), heads=2, splits=3)) or configs[-1])
  b, t, s, n, k, h = 2, 1, 150, 8, 4, 32
  (q8, k8, v8), descales, (q, kk, v) = _fp8_cache(6, b, t, s, n, k, h, "token")
  kv_lengths = jnp.array([150, 77], jnp.int32)
  out = jaxflash.decode_attention(q8, k8, v8, kv_lengths, implementation=("triton", "xla"),
                                  interpret=interpret_for("triton"), out_dtype=jnp.float32,
                                  **descales)
  assert configs and configs[0].heads == 2
  want, _ = _want(q, kk, v, kv_lengths)
  assert rel_err(out, want) < 1e-3


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_fp8_latent_cache(implementation):
  """An FP8 latent cache (``value_cache=None``: the values are the keys' first features) takes
  ``k_descale`` for both, ``out_dtype`` float32, and the LSE equals the reference's."""
  b, t, s, n, h, dv = 2, 2, 80, 8, 64, 32
  (q8, k8, _), descales, (q, kk, _) = _fp8_cache(6, b, t, s, n, 1, h)
  kv_lengths = jnp.array([80, 33], jnp.int32)
  out, lse = jaxflash.decode_attention(
      q8, k8, None, kv_lengths, value_head_dim=dv, q_descale=descales["q_descale"],
      k_descale=descales["k_descale"], out_dtype=jnp.float32, return_residual=True,
      implementation=("triton", "xla") if implementation == "triton" else "xla",
      interpret=interpret_for(implementation))
  assert out.dtype == jnp.float32
  want, want_lse = _want(q, kk, kk[..., :dv], kv_lengths)
  assert rel_err(out, want) < 2e-2
  np.testing.assert_allclose(lse, want_lse, atol=2e-2)


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_fp8_cache_with_sinks_and_a_soft_cap(implementation):
  """Sinks join an FP8 call's softmax (after the merge, beside the value's factor on the
  output), and a soft cap takes the real logits: the factors are applied before it (the test
  fails where the kernel leaves them out)."""
  b, t, s, n, k, h = 2, 1, 64, 4, 2, 32
  (q8, k8, v8), descales, (q, kk, v) = _fp8_cache(8, b, t, s, n, k, h)
  sinks = jnp.array([0.5, -1.0, 2.0, 0.0])
  kv_lengths = jnp.array([64, 9], jnp.int32)
  out = jaxflash.decode_attention(
      q8, k8, v8, kv_lengths, sinks=sinks, logits_soft_cap=3.0, **descales,
      implementation=("triton", "xla") if implementation == "triton" else "xla",
      interpret=interpret_for(implementation))
  want, _ = _want(q, kk, v, kv_lengths, sinks=sinks, logits_soft_cap=3.0)
  assert rel_err(out, want) < 2e-2


@pytest.mark.parametrize("args,match", [
    (dict(k_descale=jnp.ones((2, 10, 1)), page_table=jnp.zeros((2, 1), jnp.int32)),
     "k_descale per token"),
    (dict(value_cache=None, value_head_dim=4, v_descale=jnp.ones(())), "v_descale is for"),
    (dict(value_cache=None, value_head_dim=4, k_descale=jnp.ones((2, 10, 1))),
     "k_descale per token"),
    (dict(k_descale=jnp.ones((3, 1))), "k_descale must have one of the shapes"),
    (dict(v_descale=jnp.ones((2,), jnp.int32)), "v_descale must be a float32 array"),
    (dict(out_dtype=jnp.int8), "out_dtype must be"),
])
def test_fp8_cache_refuses_bad_factors(args, match):
  f8 = jnp.float8_e4m3fn
  base = dict(query=jnp.zeros((2, 1, 2, 8), f8), key_cache=jnp.zeros((2, 10, 1, 8), f8),
              value_cache=jnp.zeros((2, 10, 1, 8), f8), kv_lengths=jnp.array([1, 2]))
  base.update(args)
  with pytest.raises(ValueError, match=match):
    jaxflash.decode_attention(base.pop("query"), base.pop("key_cache"), base.pop("value_cache"),
                              base.pop("kv_lengths"), implementation="xla", **base)


@pytest.mark.parametrize("paged", [False, True])
def test_fp8_cache_has_no_gradient(paged):
  """Differentiating an FP8 decoding call raises (as `flash_attention` on FP8 inputs does)."""
  (q8, k8, v8), descales, _ = _fp8_cache(7, 1, 1, 32, 2, 1, 16)
  extra = dict(page_table=jnp.zeros((1, 2), jnp.int32)) if paged else {}
  if paged:
    k8, v8 = k8.reshape(2, 16, 1, 16), v8.reshape(2, 16, 1, 16)

  def loss(q):
    q8 = q.astype(jnp.float8_e4m3fn)
    out = jaxflash.decode_attention(q8, k8, v8, jnp.array([20]), implementation=("triton", "xla"),
                                    interpret=interpret_for("triton"), **descales, **extra)
    return out.astype(jnp.float32).sum()

  with pytest.raises(ValueError, match="no gradient"):
    jax.grad(loss)(q8.astype(jnp.float32))
