"""A value head dim Dv unlike the query/key one H (DeepSeek's MLA: H 192, Dv 128; absorbed
decoding: H 576, Dv 512): q [B, T, N, H], k [B, S, K, H], v [B, S, K, Dv] -> out [B, T, N, Dv],
scale 1 / sqrt(H).

Output, LSE and dQ, dK, dV against the float32 reference (which never assumes Dv == H), on the
xla backend and the Triton kernels in interpret mode: odd lengths (T != S, neither a multiple
of the 16-row test tiles), GQA, head dims that are and are not powers of two, a causal band,
lengths and a dense mask; decoding, contiguous and paged; jit and vmap; the checks; and the
Mosaic forward in its interpreter and lowered for CUDA.
"""

from __future__ import annotations

import dataclasses
import importlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import _checks, backends, devices
from jaxflash.attention import attention_with_config
from jaxflash.backends import mosaic
from jaxflash.reference import reference_attention
from checks import (BACKENDS, H100, TOLERANCE, attention, config_for, interpret_for,
                    lower_for_cuda, random_array, random_lengths, reference_options, rel_err,
                    variant_if)

F32 = jnp.float32


def _qkv(seed, b, t, s, n, k, h, hv, dtype=F32):
  """Random q [B, T, N, H], k [B, S, K, H], v [B, S, K, Dv] and a cotangent [B, T, N, Dv]."""
  keys = jax.random.split(jax.random.key(seed), 4)
  q, kk = (jax.random.normal(key, shape).astype(dtype)
           for key, shape in ((keys[0], (b, t, n, h)), (keys[1], (b, s, k, h))))
  v = jax.random.normal(keys[2], (b, s, k, hv)).astype(dtype)
  return q, kk, v, jax.random.normal(keys[3], (b, t, n, hv), F32)


def _check(implementation, *, h, hv, b=2, t=77, s=130, n=4, k=2, seed=0, dtype=F32,
           small=True, **options):
  """Output, LSE and the gradients of sum(out * d_out) against the reference (on the inputs
  upcast to float32), in one jitted program per side."""
  q, kk, v, d_out = _qkv(seed, b, t, s, n, k, h, hv, dtype)
  options = {name: make(b, t, s, n, seed) if callable(make) else make
             for name, make in options.items()}

  def run(fn, *args):
    def both(q, kk, v):
      (out, lse), vjp = jax.vjp(fn, q, kk, v)
      return out, lse, vjp((d_out.astype(out.dtype), jnp.zeros_like(lse)))
    return jax.jit(both)(*args)

  out, lse, grads = run(lambda q, kk, v: attention(implementation, q, kk, v, small=small,
                                                   return_residual=True, **options), q, kk, v)
  want_out, want_lse, want_grads = run(
      lambda q, kk, v: reference_attention(q, kk, v, **options),
      *(x.astype(F32) for x in (q, kk, v)))
  chex.assert_shape(out, (b, t, n, hv))
  for g, x in zip(grads, (q, kk, v)):
    chex.assert_equal_shape([g, x])
  seen = np.isfinite(np.asarray(want_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen, "rows with no visible key")
  errors = {"out": rel_err(out, want_out),
            "lse": rel_err(np.where(seen, lse, 0.0), np.where(seen, want_lse, 0.0))}
  errors.update({name: rel_err(g, w) for name, g, w in zip(("dq", "dk", "dv"), grads,
                                                             want_grads)})
  tol = TOLERANCE[dtype]
  assert all(e <= tol for e in errors.values()), errors


# (H, Dv): MLA's, a halved power of two, and two that pad (to 64 and to 32) independently.
DIMS = [(192, 128), (64, 32), (40, 24)]
# Variants (the GPU, JAXFLASH_ALL_VARIANTS=1): the XLA backend's einsums take any head dim, so
# on a CPU test_causal_gqa_odd_lengths[40-24-xla] holds its path; Triton's 64/32 (neither
# padded, V half of Q) is test_value_dim.py::test_jit_and_vmap[triton]'s path (32/16: causal,
# GQA, odd lengths, gradients).
_DIM_VARIANTS = {(64, 32, "triton"), (64, 32, "xla"), (192, 128, "xla")}


@pytest.mark.parametrize("h,hv,implementation", [
    variant_if((h, hv, name) in _DIM_VARIANTS, h, hv, name)
    for h, hv in DIMS for name in BACKENDS])
def test_causal_gqa_odd_lengths(implementation, h, hv):
  _check(implementation, h=h, hv=hv, is_causal=True)


# XLA's case a variant (the GPU, JAXFLASH_ALL_VARIANTS=1): on a CPU
# test_value_dim.py::test_causal_gqa_odd_lengths[40-24-xla] holds the XLA backend at this Dv != H
# and test_attention.py::test_option[xla-*] its options, none of which reads V's head dim.
XLA_VARIANT = ["triton", pytest.param("xla", marks=pytest.mark.variants)]


@pytest.mark.parametrize("implementation", XLA_VARIANT)
def test_lengths_and_dense_mask(implementation):
  _check(implementation, h=40, hv=24, t=37, s=53, seed=1,
         mask=lambda b, t, s, n, seed: random_array(seed, (b, n, t, s), "bool"),
         **random_lengths(2, 37, 53, 4, seed=1))


@pytest.mark.parametrize("implementation", BACKENDS)
def test_wider_value_than_query(implementation):
  """Dv > H works as well (nothing assumes the value's dim is the smaller)."""
  _check(implementation, h=24, hv=40, t=21, s=35, n=2, k=1, seed=3)


@pytest.mark.parametrize("implementation", XLA_VARIANT)  # (XLA's case: see XLA_VARIANT)
def test_bias_gradient_dropout_and_soft_cap(implementation):
  """The bias gradient (its own Triton kernel reads V and dO at Dv), dropout and a soft cap."""
  b, t, s, n, k, h, hv = 2, 37, 53, 4, 2, 40, 24
  q, kk, v, d_out = _qkv(5, b, t, s, n, k, h, hv)
  bias = random_array(5, (1, n, t, s), "float")
  options = dict(logits_soft_cap=2.0, dropout_rate=0.25, dropout_rng=jax.random.key(7))
  ref_options = reference_options(options, b, t, s, n)

  def grads(fn):
    return jax.jit(jax.grad(lambda *x: jnp.sum(fn(*x) * d_out), argnums=(0, 1, 2, 3)))(
        q, kk, v, bias)

  got = grads(lambda *x: attention(implementation, *x, **options))
  want = grads(lambda *x: reference_attention(*x, **ref_options)[0])
  errors = {name: rel_err(g, w) for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want)}
  assert all(e <= TOLERANCE[F32] for e in errors.values()), errors


@pytest.mark.parametrize("implementation", BACKENDS)
def test_jit_and_vmap(implementation):
  """vmap over a leading axis of q, k and v, under jit, forward and gradients."""
  b, t, s, n, k, h, hv = 2, 19, 33, 2, 1, 32, 16
  q, kk, v, d_out = (jnp.stack([x, 0.5 * x]) for x in _qkv(6, b, t, s, n, k, h, hv))

  def out_and_grads(fn):
    def run(q, kk, v):
      out, vjp = jax.vjp(lambda *x: jax.vmap(fn)(*x), q, kk, v)
      return (out,) + vjp(d_out)
    return jax.jit(run)

  got = out_and_grads(lambda q, kk, v: attention(implementation, q, kk, v, is_causal=True))(
      q, kk, v)
  want = out_and_grads(lambda q, kk, v: reference_attention(q, kk, v, is_causal=True)[0])(
      q, kk, v)
  for g, w in zip(got, want):  # (relative norms: TF32 dots on a GPU)
    assert rel_err(g, w) <= TOLERANCE[F32]


def test_triton_lowers_for_cuda():
  """Interpret mode does not enforce power-of-two blocks: the kernels (forward, dQ, dK/dV,
  dbias) lower for an H100 with Dv padded on its own (192 -> 256 beside 128; 40 -> 64 beside
  24 -> 32), and so does the split-KV decoding kernel on a paged cache."""
  def fwd_bwd(q, kk, v, bias):
    return jax.grad(lambda *x: jnp.sum(jaxflash.flash_attention(
        *x, implementation="triton", is_causal=True).astype(F32)), argnums=(0, 1, 2, 3))(
            q, kk, v, bias)

  for h, hv in ((192, 128), (40, 24)):
    q = jax.ShapeDtypeStruct((2, 300, 8, h), jnp.bfloat16)
    kk = jax.ShapeDtypeStruct((2, 1000, 2, h), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, 1000, 2, hv), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 8, 300, 1000), jnp.bfloat16)
    text = lower_for_cuda(fwd_bwd, q, kk, v, bias)
    for name in ("jaxflash_forward", "jaxflash_backward_dq", "jaxflash_backward_dkv",
                 "jaxflash_backward_dbias"):
      assert name in text, (h, hv, name)
  q = jax.ShapeDtypeStruct((2, 1, 16, 192), jnp.bfloat16)
  k_pages = jax.ShapeDtypeStruct((9, 64, 2, 192), jnp.bfloat16)
  v_pages = jax.ShapeDtypeStruct((9, 64, 2, 128), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((2, 4), jnp.int32)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  text = lower_for_cuda(lambda q, kp, vp, table, lengths: jaxflash.decode_attention(
      q, kp, vp, lengths, page_table=table, implementation="triton"),
      q, k_pages, v_pages, table, lengths)
  assert "jaxflash_decode_split_kv" in text
  # DeepSeek's absorbed decoding: 576/512 in column pieces, 128 heads in blocks of 16 rows.
  q = jax.ShapeDtypeStruct((2, 1, 128, 576), jnp.bfloat16)
  k_pages = jax.ShapeDtypeStruct((9, 64, 1, 576), jnp.bfloat16)
  v_pages = jax.ShapeDtypeStruct((9, 64, 1, 512), jnp.bfloat16)
  text = lower_for_cuda(lambda q, kp, vp, table, lengths: jaxflash.decode_attention(
      q, kp, vp, lengths, page_table=table), q, k_pages, v_pages, table, lengths)
  assert "jaxflash_decode_split_kv" in text


# ---------------------------------------------------------------------------------------------
# Decoding: new tokens against a cache whose values have their own head dim.


def _decode_reference(q, kk, v, kv_lengths):
  """New token r of row b sits at kv_lengths[b] - T + r and sees the cache up to it."""
  t, s = q.shape[1], kk.shape[1]
  pos = kv_lengths[:, None, None] - t + jnp.arange(t)[None, :, None]
  key = jnp.arange(s)[None, None, :]
  mask = ((key <= pos) & (key < kv_lengths[:, None, None]))[:, None]
  return reference_attention(q, kk, v, mask=mask)[0]


def _pages(cache, page_size: int, seed: int):
  """``cache`` [B, S, K, D] as shuffled pages plus two unused ones, and its page table."""
  b, s = cache.shape[:2]
  per_row = s // page_size
  order = np.random.default_rng(seed).permutation(b * per_row + 2)
  table = order[:b * per_row].reshape(b, per_row)
  pages = jnp.zeros((b * per_row + 2, page_size) + cache.shape[2:], cache.dtype)
  pages = pages.at[table.reshape(-1)].set(cache.reshape(b * per_row, page_size,
                                                        *cache.shape[2:]))
  return pages, jnp.asarray(table, jnp.int32)


@pytest.mark.parametrize("implementation", BACKENDS)
# (The contiguous cache a variant, the GPU and JAXFLASH_ALL_VARIANTS=1: test_decode[True-*]
# holds its paths, XLA on the rows the pages make and on Triton the same one-split kernel writing
# O at Dv (16-key pages read where they lie), gradients too; Triton's reads of a contiguous cache
# at Dv != H: test_value_dim.py::test_decode_split_kv_merges.)
@pytest.mark.parametrize("paged", [pytest.param(False, marks=pytest.mark.variants), True])
def test_decode(implementation, paged):
  """T = 3 new tokens, GQA 4/2, ragged rows (one holding fewer tokens than T); gradients too
  (the training backward, through the gathered pages)."""
  b, t, s, n, k, h, hv = 2, 3, 64, 4, 2, 40, 24
  q, kk, v, d_out = _qkv(8, b, t, s, n, k, h, hv)
  lengths = jnp.array([2, 50], jnp.int32)
  interpret = interpret_for(implementation)
  if paged:
    (k_cache, table), (v_cache, _) = _pages(kk, 16, 1), _pages(v, 16, 1)
  else:
    k_cache, v_cache, table = kk, v, None

  def ours(q, k_cache, v_cache):
    return jaxflash.decode_attention(q, k_cache, v_cache, lengths, page_table=table,
                                     implementation=implementation, interpret=interpret)

  out, vjp = jax.vjp(jax.jit(ours), q, k_cache, v_cache)
  want, want_vjp = jax.vjp(lambda q, kk, v: _decode_reference(q, kk, v, lengths), q, kk, v)
  chex.assert_shape(out, (b, t, n, hv))
  assert rel_err(out, want) <= TOLERANCE[F32]
  dq, dk, dv = vjp(d_out)
  want_dq, want_dk, want_dv = want_vjp(d_out)
  assert rel_err(dq, want_dq) <= TOLERANCE[F32]
  if paged:  # the pages' gradient, as rows again
    dk, dv = (jnp.take(x, table, axis=0).reshape((b, s) + x.shape[2:]) for x in (dk, dv))
  assert rel_err(dk, want_dk) <= TOLERANCE[F32]
  assert rel_err(dv, want_dv) <= TOLERANCE[F32]


@pytest.mark.parametrize("merge", ["xla", "kernel"])
def test_decode_split_kv_merges(merge, monkeypatch):
  """Several splits of the Triton split-KV kernel, merged in XLA or in the merge kernel, whose
  tiles are the value's head dim."""
  from jaxflash.backends.triton import decode
  default = decode.default_config
  monkeypatch.setattr(decode, "default_config", lambda *a, **kw: decode.dataclasses.replace(
      default(*a, **kw), splits=3, merge=merge))
  b, t, s, n, k, h, hv = 2, 2, 96, 4, 1, 64, 40
  q, kk, v, _ = _qkv(9, b, t, s, n, k, h, hv)
  lengths = jnp.array([96, 41], jnp.int32)
  out = jax.jit(lambda q, kk, v: jaxflash.decode_attention(
      q, kk, v, lengths, implementation="triton", interpret=True))(q, kk, v)
  assert rel_err(out, _decode_reference(q, kk, v, lengths)) <= TOLERANCE[F32]


@pytest.mark.parametrize("b,t,s,n,k,h,hv,page_size", [
    pytest.param(1, 1, 40, 4, 1, 576, 512, None,  # one row block of 16 rows (4 padded)
                 marks=pytest.mark.variants),  # (on a CPU [1-1-50-2-1-512-40-None] and
    # [1-2-24-4-1-1024-768-None] pad one row block, [2-2-100-32-1-576-512-None] runs MLA's pieces)
    (2, 2, 100, 32, 1, 576, 512, None),  # 64 rows: 4 blocks of 16, T = 2 across them
    pytest.param(2, 1, 128, 16, 1, 576, 512, 32,  # paged, blocks of one 32-key page (the
                 marks=pytest.mark.variants),  # latent cache's paged case holds it)
    (2, 3, 70, 8, 2, 320, 288, None),  # two K/V heads; pieces 256 + 64 and 256 + 32
    (1, 1, 50, 2, 1, 512, 40, None),  # Q and K in one 512-wide piece, V padded to 64
    (1, 2, 24, 4, 1, 1024, 768, None),  # the widest: 512 + 512, and 512 + 256
])
def test_decode_absorbed_mla(b, t, s, n, k, h, hv, page_size, monkeypatch):
  """DeepSeek's absorbed decoding: H 576 (512 + 64 rope dims), Dv 512, one shared K/V head.
  Wider than the training kernels take: ``implementation=None`` runs Triton's split-KV kernel,
  which loads and multiplies such heads in column pieces (and cuts a tall group's query rows
  into blocks), with the XLA backend's backward. Ragged rows, gradients too."""
  ran = _spy_split_kv(monkeypatch)
  q, kk, v, d_out = _qkv(10, b, t, s, n, k, h, hv)
  lengths = jnp.array([s - 7 * i for i in range(b)], jnp.int32)
  (k_cache, table), (v_cache, _) = ((_pages(x, page_size, 3) for x in (kk, v)) if page_size
                                    else ((kk, None), (v, None)))

  def ours(q, k_cache, v_cache):
    return jaxflash.decode_attention(q, k_cache, v_cache, lengths, page_table=table,
                                     interpret=True)

  out, vjp = jax.vjp(jax.jit(ours), q, k_cache, v_cache)
  assert ran == [True]
  chex.assert_shape(out, (b, t, n, hv))
  want, want_vjp = jax.vjp(lambda q, kk, v: _decode_reference(q, kk, v, lengths), q, kk, v)
  assert rel_err(out, want) <= TOLERANCE[F32]
  dq, dk, dv = vjp(d_out)
  want_dq, want_dk, want_dv = want_vjp(d_out)
  if page_size:  # the pages' gradient, as rows again
    dk, dv = (jnp.take(x, table, axis=0).reshape((b, s) + x.shape[2:]) for x in (dk, dv))
  for got, wanted in ((dq, want_dq), (dk, want_dk), (dv, want_dv)):
    assert rel_err(got, wanted) <= TOLERANCE[F32]


@pytest.mark.parametrize("b,s,t,n,latent,want", [
    (32, 8192, 1, 16, False, (8, 32, 16)), (8, 32768, 1, 16, False, (32, 32, 16)),
    pytest.param(64, 8192, 1, 16, False, (4, 32, 16),  # (another B: on a CPU
                 marks=pytest.mark.variants),  # [32-8192-1-16-False-want0] holds the rule)
    (32, 8192, 1, 128, False, (1, 32, 16)),
    (32, 8192, 1, 16, True, (8, 64, 16)), (32, 8192, 2, 16, True, (8, 64, 32)),
    (32, 8192, 1, 128, True, (2, 64, 32)), (32, 8192, 3, 16, True, (3, 64, 16)),
])
def test_absorbed_mla_launch(b, s, t, n, latent, want):
  """Wide heads (as measured on an H200: `wide_config`): 2 stages, about two programs per SM,
  row blocks launched together; 16 query rows and 32 keys a program with a value cache, 64 keys
  and 32 rows (where they divide the group: not 48) with the values in the keys. Want (splits,
  keys, rows)."""
  from jaxflash import _core, devices
  from jaxflash.backends.triton import Config, decode
  q = jnp.zeros((b, t, n, 576), jnp.bfloat16)
  kv = jnp.zeros((b, s, 1, 576), jnp.bfloat16), jnp.zeros((b, s, 1, 512), jnp.bfloat16)
  inputs = _core.Inputs(q, *kv, jnp.zeros((b, 2), jnp.int32))
  config = decode.default_config(inputs, Config(), devices.Device("gpu", "NVIDIA H200", True),
                                 values_in_keys=latent)
  got = (config.splits, config.block_k, decode.program_rows(inputs, config))
  assert got == want and config.num_stages == 2 and config.grid_order == decode.HEADS_FIRST


@pytest.mark.gpu
@pytest.mark.parametrize("t,n,page_size,latent", [(1, 128, None, False), (2, 16, 64, False),
                                                  (4, 128, 64, False), (1, 16, None, True),
                                                  (2, 128, 64, True), (3, 16, 64, True),
                                                  (4, 16, None, True), (1, 128, None, True)])
def test_decode_absorbed_mla_on_gpu(t, n, page_size, latent, monkeypatch):
  """The wide-head split-KV kernels compiled for the GPU, bf16, at MLA's 576/512 with 16 and
  128 query heads, T up to 4, ragged rows of up to 3000 keys, contiguous and paged (64-key
  pages, DeepSeek's layout), with a value cache (Triton's kernel) or the values in the
  latent cache (the Mosaic GPU kernel on a Hopper GPU): against the float32 reference."""
  ran = _spy_split_kv(monkeypatch, "mosaic" if latent else "triton")
  b, s = 3, 3008
  q, kk, v, _ = _qkv(12, b, t, s, n, 1, 576, 512, dtype=jnp.bfloat16)
  if latent:
    v = kk[..., :512]
  lengths = jnp.array([s, 1500, t], jnp.int32)
  (k_cache, table), (v_cache, _) = ((_pages(x, page_size, 4) for x in (kk, v)) if page_size
                                    else ((kk, None), (v, None)))
  if latent:  # one cache: the values are its first 512 features
    out = jax.jit(lambda q, kc: jaxflash.decode_attention(
        q, kc, None, lengths, value_head_dim=512, page_table=table))(q, k_cache)
  else:
    out = jax.jit(lambda q, kc, vc: jaxflash.decode_attention(
        q, kc, vc, lengths, page_table=table))(q, k_cache, v_cache)
  assert ran == [True]
  want = _decode_reference(*(x.astype(F32) for x in (q, kk, v)), lengths)
  assert rel_err(out.astype(F32), want) <= 1e-2


# (XLA's contiguous cases variants too: its einsums take any head dim, and its paged case holds
# the latent cache's slice and gradient, on the rows the pages make.)
@pytest.mark.parametrize("b,t,s,n,h,hv,page_size,implementation", [
    pytest.param(2, 1, 100, 16, 576, 512, None, None,  # MLA: V is K's first piece, loaded once
                 marks=pytest.mark.variants),  # for both (held by the paged case below)
    pytest.param(2, 1, 100, 16, 576, 512, None, "xla", marks=pytest.mark.variants),
    (2, 2, 128, 32, 576, 512, 32, None),  # paged, two row blocks
    (2, 2, 128, 32, 576, 512, 32, "xla"),
    (1, 3, 70, 4, 64, 32, None, None),  # narrow: V a masked range of the key tile
    pytest.param(1, 3, 70, 4, 64, 32, None, "xla", marks=pytest.mark.variants),
    (2, 1, 50, 2, 40, 40, None, None),  # values are the whole keys
    pytest.param(2, 1, 50, 2, 40, 40, None, "xla", marks=pytest.mark.variants),
])
def test_decode_values_in_the_keys(implementation, b, t, s, n, h, hv, page_size, monkeypatch):
  """``value_cache=None, value_head_dim=Dv``: one latent cache whose first Dv features are the
  values (absorbed MLA's layout). Equal to passing that slice as the value cache, forward and
  gradients (the latent cache's gradient sums its key and value parts); on the split-KV
  kernel (interpreted) and the XLA backend."""
  ran = _spy_split_kv(monkeypatch)
  q, latent, _, d_out = _qkv(13, b, t, s, n, 1, h, hv)
  lengths = jnp.array([s - 9 * i for i in range(b)], jnp.int32)
  cache, table = _pages(latent, page_size, 5) if page_size else (latent, None)

  def ours(q, cache):
    return jaxflash.decode_attention(q, cache, None, lengths, value_head_dim=hv,
                                     page_table=table, implementation=implementation,
                                     interpret=True)

  out, vjp = jax.vjp(jax.jit(ours), q, cache)
  assert ran == ([True] if implementation is None else [])
  chex.assert_shape(out, (b, t, n, hv))
  want, want_vjp = jax.vjp(lambda q, x: _decode_reference(q, x, x[..., :hv], lengths), q,
                           latent)
  assert rel_err(out, want) <= TOLERANCE[F32]
  dq, d_cache = vjp(d_out)
  want_dq, want_d_latent = want_vjp(d_out)
  if page_size:
    d_cache = jnp.take(d_cache, table, axis=0).reshape(latent.shape)
  assert rel_err(dq, want_dq) <= TOLERANCE[F32]
  assert rel_err(d_cache, want_d_latent) <= TOLERANCE[F32]


def test_decode_values_in_the_keys_with_options(monkeypatch):
  """The latent cache through the split-KV kernel (interpreted) with sinks, a soft cap and a
  window, at 576/512 with two row blocks: equal to the XLA backend given the values' slice as a
  value cache, forward and gradients (the sinks' too)."""
  ran = _spy_split_kv(monkeypatch)
  b, t, s, n, h, hv = 2, 2, 90, 16, 576, 512
  q, latent, _, d_out = _qkv(14, b, t, s, n, 1, h, hv)
  sinks = jax.random.normal(jax.random.key(15), (n,))
  lengths = jnp.array([90, 41], jnp.int32)
  options = dict(logits_soft_cap=3.0, local_window_size=30)

  def ours(q, latent, sinks):
    return jaxflash.decode_attention(q, latent, None, lengths, value_head_dim=hv, sinks=sinks,
                                     interpret=True, **options)

  def xla(q, latent, sinks):
    return jaxflash.decode_attention(q, latent, latent[..., :hv], lengths, sinks=sinks,
                                     implementation="xla", **options)

  got, got_vjp = jax.vjp(jax.jit(ours), q, latent, sinks)
  assert ran == [True]
  want, want_vjp = jax.vjp(jax.jit(xla), q, latent, sinks)
  assert rel_err(got, want) <= TOLERANCE[F32]
  for g, w in zip(got_vjp(d_out), want_vjp(d_out)):
    assert rel_err(g, w) <= TOLERANCE[F32]


def test_values_in_the_keys_reuse_the_key_tiles():
  """Which value pieces are key tiles already loaded (`reused_pieces`): MLA's 512 of 576 is
  K's first piece; a narrower value's masked range is not a key tile; equal dims are."""
  from jaxflash.backends.triton import decode
  reuse = decode.reused_pieces

  assert reuse(576, 512) == [0]
  assert reuse(576, 576) == [0, 1]
  assert reuse(64, 32) == [None]
  assert reuse(40, 40) == [0]
  assert reuse(40, 36) == [None]


def _spy_split_kv(monkeypatch, kernel: str = "triton") -> list:
  """A list that gets True each time a split-KV kernel's forward is traced: Triton's, or with
  ``kernel="mosaic"`` the Mosaic GPU kernel of absorbed MLA's latent cache."""
  decode = importlib.import_module(f"jaxflash.backends.{kernel}.decode")
  jax.clear_caches()  # (the spy counts traces: none may come from an earlier test's cache)
  ran, forward = [], decode.forward
  monkeypatch.setattr(decode, "forward", lambda *a: ran.append(True) or forward(*a))
  return ran


def test_absorbed_mla_routing(monkeypatch):
  """The split-KV kernel takes wide heads only where Triton is asked for (``implementation``
  None or naming it) and can run; the backward's backend is the one picked for the call
  (``implementation_for``). The training kernels still refuse such heads."""
  q, kk, v, _ = _qkv(11, 1, 1, 40, 4, 1, 576, 512)
  lengths = jnp.array([33], jnp.int32)

  def split_kv(**options) -> bool:
    ran = _spy_split_kv(monkeypatch)
    jax.jit(lambda q, kk, v: jaxflash.decode_attention(q, kk, v, lengths, **options)).trace(
        q, kk, v)
    return bool(ran)

  assert jaxflash.implementation_for(q, kk, v, interpret=True) == "xla"
  assert split_kv(interpret=True)
  assert split_kv(implementation=("triton", "xla"), interpret=True)
  assert not split_kv(implementation="xla", interpret=True)
  assert split_kv() == devices.has_nvidia_gpu()  # (the kernel itself where a GPU is here)
  with pytest.raises(backends.UnsupportedCallError, match="value head dims up to 256"):
    jaxflash.flash_attention(q[..., :256], kk[..., :256], v, implementation="triton",
                             interpret=True)


@pytest.mark.parametrize("n,t,want", [(16, 1, None), (128, 1, None), (16, 4, None),
                                      (24, 1, "G·T = 24 rows"), (4, 3, None)])
def test_absorbed_mla_row_blocks(n, t, want):
  """Wide heads cut a group taller than `WIDE_ROWS` into blocks of that many rows, which must
  divide it; a shorter group is one padded block."""
  from jaxflash import _core, masking
  from jaxflash.backends.triton import decode
  q = jnp.zeros((1, t, n, 576), jnp.bfloat16)
  kv = jnp.zeros((1, 64, 1, 576), jnp.bfloat16), jnp.zeros((1, 64, 1, 512), jnp.bfloat16)
  inputs = _core.Inputs(q, *kv, jnp.array([[t, 64]], jnp.int32))
  reason = decode.unsupported(inputs, _core.Params(scale=1.0, window=masking.Window(None, None)))
  assert (reason is None) if want is None else (want in reason)
  if want is None:
    assert decode.program_rows(inputs) == min(decode.WIDE_ROWS, decode.rows_for(inputs))
  assert decode.piece_widths(576) == (512, 64)
  assert decode.piece_widths(512) == (512,)
  assert decode.piece_widths(200) == (256,)
  assert decode.piece_widths(1024) == (512, 512)
  assert decode.piece_widths(1008) == (512, 256, 128, 64, 32, 16)


# ---------------------------------------------------------------------------------------------
# Several devices, and the Flax hooks.


def _explicit_mesh(name: str):
  return jax.make_mesh((2,), (name,), axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
def test_ring_and_sharded_batch():
  """Ring attention (zigzag, causal) over 2 devices, and a call whose batch is sharded over
  them: outputs and gradients keep the value's head dim, and equal the reference."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jaxflash.ops import ring
  q, kk, v, d_out = _qkv(11, 2, 32, 32, 4, 2, 16, 8)
  ref = jax.vjp(lambda q, kk, v: reference_attention(q, kk, v, is_causal=True)[0], q, kk, v)
  want = (ref[0],) + ref[1](d_out)

  def ring_local(q, kk, v, d_out):
    out, vjp = jax.vjp(lambda q, kk, v: jaxflash.ring_attention(
        q, kk, v, axis_name="sp", layout="zigzag", is_causal=True, implementation="xla"),
        q, kk, v)
    return (out,) + vjp(d_out)

  mesh = _explicit_mesh("sp")
  order = lambda x: ring.to_layout(x, "zigzag", 2)  # noqa: E731
  with jax.set_mesh(mesh):
    args = tuple(jax.device_put(order(x), NamedSharding(mesh, P(None, "sp")))
                 for x in (q, kk, v, d_out))
    got = jax.jit(jax.shard_map(ring_local, mesh=mesh, in_specs=P(None, "sp"),
                                out_specs=P(None, "sp")))(*args)
  got = [ring.from_layout(np.asarray(x), "zigzag", 2) for x in got]
  for g, w in zip(got, want):
    assert rel_err(g, w) <= 5 * TOLERANCE[F32]

  mesh = _explicit_mesh("data")
  with jax.set_mesh(mesh):
    args = tuple(jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (q, kk, v, d_out))

    def batch_sharded(q, kk, v, d_out):
      out, vjp = jax.vjp(lambda q, kk, v: jaxflash.flash_attention(
          q, kk, v, is_causal=True, implementation="xla"), q, kk, v)
      return (out,) + vjp(d_out)

    got = jax.jit(batch_sharded)(*args)
    assert jax.typeof(got[0]).sharding.spec[0] == "data"
  for g, w in zip(got, want):
    chex.assert_equal_shape([g, w])
    assert rel_err(g, w) <= TOLERANCE[F32]


def test_flax_hooks():
  """The linen and nnx hooks run jaxflash (no fallback) and match Flax's attention, whose
  value may have its own depth too."""
  import flax.linen
  import jaxflash.linen
  import jaxflash.nnx
  q, kk, v, _ = _qkv(12, 2, 9, 9, 4, 4, 16, 8)
  mask = jnp.tril(jnp.ones((9, 9), bool))[None, None]
  want = flax.linen.dot_product_attention(q, kk, v, mask=mask)
  for hook in (jaxflash.linen.dot_product_attention, jaxflash.nnx.dot_product_attention):
    out = hook(q, kk, v, mask=mask, implementation="xla")  # (a fallback would refuse this)
    chex.assert_shape(out, (2, 9, 4, 8))
    assert rel_err(out, want) <= TOLERANCE[F32]


# ---------------------------------------------------------------------------------------------
# Checks, and the backends that decline.


def _f32(*shape):
  return jnp.zeros(shape, F32)


@pytest.mark.parametrize("value", [_f32(3, 12, 2, 16), _f32(2, 13, 2, 16), _f32(2, 12, 1, 16),
                                   _f32(12, 2, 16)])
def test_value_must_match_key_but_for_its_head_dim(value):
  """Batch, key length and K/V heads of value must be key's ([2, 12, 2, 8]); rank as query."""
  with pytest.raises(ValueError, match="value"):
    jaxflash.flash_attention(_f32(2, 8, 4, 8), _f32(2, 12, 2, 8), value, implementation="xla")


def test_value_head_dim_must_be_positive():
  with pytest.raises(ValueError, match="value's head dim"):
    jaxflash.flash_attention(_f32(2, 8, 4, 8), _f32(2, 12, 2, 8), _f32(2, 12, 2, 0))


@pytest.mark.parametrize("page_table", [None, jnp.zeros((2, 2), jnp.int32)])
@pytest.mark.parametrize("value_cache", [_f32(2, 16, 1, 16), _f32(2, 8, 2, 16),
                                         _f32(2, 16, 2, 4, 1)])
def test_value_cache_must_match_key_cache_but_for_its_head_dim(value_cache, page_table):
  with pytest.raises(ValueError, match="value_cache"):
    jaxflash.decode_attention(_f32(2, 1, 4, 8), _f32(2, 16, 2, 8), value_cache,
                              jnp.array([3, 5]), page_table=page_table, implementation="xla")


def test_empty_calls_have_the_value_head_dim():
  """No key (zeros) and no query row (empty): outputs [.., Dv] all the same."""
  for t, s in ((5, 0), (0, 5)):
    out = jaxflash.flash_attention(_f32(2, t, 4, 8), _f32(2, s, 2, 8), _f32(2, s, 2, 3),
                                   implementation="xla")
    chex.assert_shape(out, (2, t, 4, 3))


# ---------------------------------------------------------------------------------------------
# The Mosaic kernels: V's, dO's, O's and dV's tiles at their own padded head dim, in Mosaic GPU's
# interpreter and lowered for CUDA.


@pytest.mark.parametrize("h,hv,tiles", [(96, 40, "small"), (64, 128, "shipped"),
                                        (192, 128, "shipped")] + [  # (more tiles: variants)
    pytest.param(192, 128, tiles, marks=pytest.mark.variants) for tiles in ("two_passes", "q32")])
def test_mosaic_serves_it(h, hv, tiles):
  """Forward and backward: the small tiles with a narrower V (padded to 64 beside 128); the
  shipped ones with a wider V (128 beside 64: O needs tiles of its own, wider than Q's), and
  with MLA's dims (the forward on 128-key tiles with the overlap, O leaving through the Q
  tiles' memory; dK and dV in one pass on 64-row query tiles with dPᵀ after Pᵀ,
  `Backward.serial_scores`); MLA's dims with dK/dV in two passes (dV's tile of its own in the
  dV pass), and in one on 32-row tiles with the scores back to back."""
  from jaxflash.backends.mosaic import backward
  config = config_for("mosaic", True) if tiles == "small" else mosaic.default_config(
      h, jnp.bfloat16, True, 70, "NVIDIA H200", value_dim=hv)
  if tiles == "two_passes":
    config = dataclasses.replace(config, backward=mosaic.Backward(split_dkv=True))
  if tiles == "shipped" and h == 192:  # (the soft cap's fallback: `test_shared_key_roles`)
    assert config.backward.shared_keys and config.backward.dkv_block_q == 128
    assert config.backward.shared_keys_overlap
  if tiles == "q32":
    config = dataclasses.replace(config, backward=mosaic.Backward(
        split_dkv=False, dkv_block_q=32, registers=240))
  call = _checks.normalise(jnp.zeros((1, 70, 2, h), jnp.bfloat16),
                           jnp.zeros((1, 90, 1, h), jnp.bfloat16),
                           jnp.zeros((1, 90, 1, hv), jnp.bfloat16), is_causal=True)
  assert backward.unsupported(call.inputs, call.params, config) is None  # not Triton's
  hp, hvp = (mosaic.config.padded_head_dim(d) for d in (h, hv))
  assert config.backward.splits_dkv(hp, hvp) == (tiles == "two_passes")
  _check("mosaic", h=h, hv=hv, b=1, t=70, s=90, n=2, k=1, dtype=jnp.bfloat16, small=config,
         is_causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fields", [dict(dkv_block_q=32), dict(serial_scores=True)])
def test_mla_backward_tiles_on_gpu(fields):
  """MLA's one-pass dK/dV on 32-row tiles with the scores back to back, and on 64-row ones
  with dPᵀ after Pᵀ (`Backward.serial_scores`, shipped), compiled: GQA, odd lengths, a causal
  band, several query heads per K/V head, against the float32 reference."""
  backward = mosaic.Backward(**dict(dict(split_dkv=False, dkv_block_q=64, registers=240),
                                    **fields))
  config = dataclasses.replace(
      mosaic.default_config(192, jnp.bfloat16, True, 1000, "NVIDIA H200", value_dim=128),
      backward=backward)
  _check("mosaic", h=192, hv=128, b=2, t=1000, s=1100, n=4, k=2, dtype=jnp.bfloat16,
         small=config, is_causal=True)


# Both consumers of the dK/dV kernel on one 64-key tile in two roles (`Backward.shared_keys`).
SHARED_KEYS = mosaic.Backward(split_dkv=False, dkv_block_q=64, registers=240,
                              serial_scores=True, shared_keys=True)


def _with_backward(h, hv, is_causal, backward, t=1000):
  return dataclasses.replace(mosaic.default_config(h, jnp.bfloat16, is_causal, t,
                                                   "NVIDIA H200", value_dim=hv),
                             backward=backward)


def _count_role_runs(monkeypatch) -> list:
  """A list that gains an entry each time a dK/dV kernel is built with the shared-key roles."""
  from jaxflash.backends.mosaic import backward
  runs = []
  run = backward._SharedKeyRoles.run
  monkeypatch.setattr(backward._SharedKeyRoles, "run",
                      lambda self, *a, **kw: (runs.append(1), run(self, *a, **kw))[1])
  return runs


_DENSE_MASK = dict(mask=lambda b, t, s, n, seed: random_array(seed, (b, n, t, s), "bool"),
                   **random_lengths(2, 77, 130, 4, seed=2))


@pytest.mark.parametrize("h,hv,tiles,overlap,options", [
    pytest.param(192, 128, "shipped", False, dict(is_causal=True), marks=pytest.mark.variants),
    # (A variant: test_value_dim.py::test_mosaic_serves_it[192-128-shipped] runs the same shipped
    # config, the roles with the overlap on 128-row query tiles, with a causal band, GQA and a
    # short last key tile; [64-32-q64-True-options2] checks that the roles run.)
    pytest.param(192, 128, "shipped", True, dict(is_causal=True), marks=pytest.mark.variants),
    (64, 32, "q64", True, _DENSE_MASK),
    (192, 128, "shipped", False, dict(logits_soft_cap=2.0, is_causal=True))])
def test_shared_key_roles(h, hv, tiles, overlap, options, monkeypatch):
  """`Backward.shared_keys` in Mosaic GPU's interpreter, against the float32 reference, with
  and without `Backward.shared_keys_overlap` (dK's product one visit late, shipped): MLA's
  shipped tiles (128-row query tiles) with a causal band (odd lengths, GQA: 2 query heads a
  K/V head, 130 keys in three 64-key tiles, the last one short); 64-row tiles with a dense
  mask and lengths (some rows see one key), with the overlap; and MLA's shipped tiles with a
  soft cap, whose dSᵀ needs its chain factor: the usual layout runs instead, on 64-row tiles
  (128 do not fit it)."""
  from jaxflash.backends.mosaic import backward
  runs = _count_role_runs(monkeypatch)
  causal = options.get("is_causal", False)
  config = (mosaic.default_config(h, jnp.bfloat16, causal, 77, "NVIDIA H200", value_dim=hv)
            if tiles == "shipped" else _with_backward(h, hv, causal, SHARED_KEYS, t=77))
  config = dataclasses.replace(config, backward=dataclasses.replace(
      config.backward, shared_keys_overlap=overlap))
  call = _checks.normalise(jnp.zeros((2, 77, 4, h), jnp.bfloat16),
                           jnp.zeros((2, 130, 2, h), jnp.bfloat16),
                           jnp.zeros((2, 130, 2, hv), jnp.bfloat16),
                           **{name: x(2, 77, 130, 4, 0) if callable(x) else x
                              for name, x in options.items()})
  assert backward.unsupported(call.inputs, call.params, config) is None  # not Triton's
  hp, hvp = (mosaic.config.padded_head_dim(d) for d in (h, hv))
  tiles_run, roles = backward.dkv_tiles(config.backward, call.params, hp, hvp)
  assert roles == ("logits_soft_cap" not in options)
  assert tiles_run.dkv_block_q == (config.backward.dkv_block_q if roles else 64)
  _check("mosaic", h=h, hv=hv, dtype=jnp.bfloat16, small=config, **options)
  assert bool(runs) == roles


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("h,hv,n,k,is_causal,block_q", [
    (192, 128, 4, 2, True, 64), (192, 128, 4, 4, False, 64), (192, 128, 4, 2, True, 128),
    (192, 128, 4, 4, False, 128), (128, 128, 4, 1, True, 64), (96, 40, 4, 2, False, 64)])
def test_shared_key_roles_on_gpu(h, hv, n, k, is_causal, block_q, overlap, monkeypatch):
  """`Backward.shared_keys` compiled, with and without `Backward.shared_keys_overlap`, against
  the float32 reference: MLA's 192/128 with and without a causal band on 64- and 128-row query
  tiles (shipped), MQA at D = 128, and head dims that pad; odd lengths (1000 query rows, 1100
  keys: a short last key tile)."""
  runs = _count_role_runs(monkeypatch)
  backward = dataclasses.replace(SHARED_KEYS, split_dkv=None if hv == h else False,
                                 dkv_block_q=block_q, shared_keys_overlap=overlap)
  _check("mosaic", h=h, hv=hv, b=2, t=1000, s=1100, n=n, k=k, dtype=jnp.bfloat16,
         small=_with_backward(h, hv, is_causal, backward), is_causal=is_causal)
  assert runs


@pytest.mark.usefixtures("cuda_plugin")
def test_shared_key_roles_lower_for_cuda():
  """The shared-key dK/dV kernel lowers for an H100 at MLA's dims on 64-row query tiles
  (`Backward.shared_keys`; the shipped 128-row ones: `test_mosaic_lowers_for_cuda`)."""
  config = _with_backward(192, 128, True, SHARED_KEYS)
  q = jax.ShapeDtypeStruct((1, 300, 4, 192), jnp.bfloat16)
  kk = jax.ShapeDtypeStruct((1, 1000, 2, 192), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 1000, 2, 128), jnp.bfloat16)
  grad = jax.grad(lambda *x: jnp.sum(attention_with_config(
      *x, config=config, implementation="mosaic", is_causal=True).astype(F32)),
      argnums=(0, 1, 2))
  with jax.sharding.use_abstract_mesh(H100):
    text = jax.jit(grad).trace(q, kk, v).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == 3


@pytest.mark.usefixtures("cuda_plugin")
def test_mosaic_lowers_for_cuda():
  """Forward (the shipped configs: persistent grids, the intra-warpgroup overlap) and the
  Mosaic backward lower for an H100 with MLA's and other pairs of head dims: dK/dV in one
  pass where both accumulators fit (64 + 128 columns, 128 + 64) or the tuned tiles make them
  (MLA's 192 + 128, on 64-row query tiles with dPᵀ after Pᵀ), in two (dV, then dK) elsewhere
  (256 + 128), and no Triton kernel."""
  def fwd_bwd(is_causal):
    return lambda q, kk, v: jax.grad(lambda *x: jnp.sum(jaxflash.flash_attention(
        *x, implementation="mosaic", is_causal=is_causal).astype(F32)), argnums=(0, 1, 2))(
            q, kk, v)

  for h, hv, is_causal, kernels in ((192, 128, True, 3), (128, 64, False, 3),
                                    (64, 128, True, 3), (256, 128, False, 4)):
    q = jax.ShapeDtypeStruct((2, 300, 8, h), jnp.bfloat16)
    kk = jax.ShapeDtypeStruct((2, 1000, 2, h), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, 1000, 2, hv), jnp.bfloat16)
    with jax.sharding.use_abstract_mesh(H100):
      text = jax.jit(fwd_bwd(is_causal)).trace(q, kk, v).lower(
          lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == kernels, (h, hv)
    assert "jaxflash_backward" not in text, (h, hv)


@pytest.mark.parametrize("h,hv,rows", [(192, 128, 96), (128, 64, 128), (256, 128, 128),
                                       (256, 192, None), (128, 128, 64), (64, 128, None)])
def test_o_through_the_q_tiles(h, hv, rows):
  """A consumer's O leaves through an O-wide view of its own Q tile's bytes where V's head
  dim is at most Q's (whole 8-row tiles: none at 256 / 192, where they would not tile it), and
  never where V's is wider, for a partial result or a persistent CTA. At MLA's 192/128 that is
  what fits 128-key tiles in shared memory: O tiles of their own would take 32 KiB more."""
  config = mosaic.Config()
  hp, hvp = mosaic.config.padded_head_dim(h), mosaic.config.padded_head_dim(hv)
  assert mosaic.config.o_view(config, hp, hvp) == (None if rows is None else (rows, hvp))
  assert mosaic.config.o_view(config, hp, hvp, partial=True) is None
  persistent = dataclasses.replace(config, persistent_ctas=132)
  assert mosaic.config.o_view(persistent, hp, hvp) is None
  through_q = dataclasses.replace(persistent, o_through_q=True)
  assert mosaic.config.o_view(through_q, hp, hvp) == mosaic.config.o_view(config, hp, hvp)
  mla = mosaic.Config(block_kv=128, intra_wg_overlap=True)
  assert mosaic.config.fits(mla, 192, value_dim=128)
  own_o = dataclasses.replace(mla, persistent_ctas=132)
  assert (mosaic.config.smem_bytes(own_o, 192, value_dim=128)
          - mosaic.config.smem_bytes(mla, 192, value_dim=128)) == 2 * 64 * 128 * 2
  assert not mosaic.config.fits(own_o, 192, value_dim=128)
  assert mosaic.config.fits(dataclasses.replace(own_o, o_through_q=True), 192, value_dim=128)


@pytest.mark.gpu
@pytest.mark.parametrize("h,hv,is_causal,ctas", [(192, 128, False, None), (192, 128, True, None),
                                                 (128, 64, True, None), (192, 128, True, 7),
                                                 (192, 128, False, 7)])
def test_o_through_the_q_tiles_on_gpu(h, hv, is_causal, ctas):
  """MLA's 192/128 (and a 128/64 pair) compiled with O through the Q tiles' memory on 128-key
  tiles, with the overlap: several CTAs (both consumers' rows in each), GQA, odd lengths,
  forward and gradients against the float32 reference. Where a consumer's O view started off
  its own Q tile, its O would overwrite the other consumer's Q while that one still reads it.
  On a persistent grid of 7 CTAs (`o_through_q`, paired tiles with a band) the next item's Q
  would overwrite O before its stores read it."""
  persistent = dict(paired_tiles=True, o_through_q=True) if ctas else {}
  config = dataclasses.replace(
      mosaic.default_config(h, jnp.bfloat16, is_causal, 1000, "NVIDIA H200", value_dim=hv),
      block_kv=128, intra_wg_overlap=True, persistent_ctas=ctas, **persistent)
  _check("mosaic", h=h, hv=hv, b=2, t=1000, s=1100, n=4, k=2, dtype=jnp.bfloat16,
         small=config, is_causal=is_causal)


@pytest.mark.usefixtures("cuda_plugin")
def test_o_through_the_q_tiles_lowers():
  """MLA's forward on 128-key tiles lowers for an H100 with O through the Q tiles' memory
  (causal or not, with the overlap or not, and a 128 / 64 pair), and Mosaic GPU refuses the
  same tiles with O tiles of their own (a persistent CTA's: over its shared memory)."""
  def lower(h, hv, causal, **fields):
    config = mosaic.Config(block_kv=128, **fields)
    q = jax.ShapeDtypeStruct((2, 300, 8, h), jnp.bfloat16)
    kk = jax.ShapeDtypeStruct((2, 1000, 2, h), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, 1000, 2, hv), jnp.bfloat16)
    call = lambda q, kk, v: attention_with_config(q, kk, v, is_causal=causal, config=config,
                                                  implementation="mosaic")
    with jax.sharding.use_abstract_mesh(H100):
      return jax.jit(call).trace(q, kk, v).lower(lowering_platforms=("cuda",)).as_text()

  for h, hv, causal, overlap in ((192, 128, True, True), (192, 128, False, False),
                                 (128, 64, False, True)):
    text = lower(h, hv, causal, intra_wg_overlap=overlap)
    assert text.count("custom_call @mosaic_gpu") == 1, (h, hv)
  # A persistent grid's too, where its O leaves through the Q tiles (`Config.o_through_q`).
  text = lower(192, 128, True, intra_wg_overlap=True, persistent_ctas=132, paired_tiles=True,
               o_through_q=True)
  assert text.count("custom_call @mosaic_gpu") == 1
  with pytest.raises(ValueError, match="exceeds available shared memory"):
    lower(192, 128, True, intra_wg_overlap=True, persistent_ctas=132)


def test_mosaic_selection():
  """``implementation="mosaic"`` serves Dv != H (up to 256); ``implementation=None`` takes it
  only where it was measured faster with a value head dim of its own (MLA's 192/128 and 128/64
  on an H100 and an H200), and Triton elsewhere."""
  q = jax.ShapeDtypeStruct((2, 300, 8, 128), jnp.bfloat16)
  kk = jax.ShapeDtypeStruct((2, 4096, 2, 128), jnp.bfloat16)
  with jax.sharding.use_abstract_mesh(H100):
    assert jaxflash.implementation_for(q, kk, kk) == "mosaic"
    for hv, chosen in [(64, "mosaic"), (192, "triton")]:  # (128/192: not measured)
      v = jax.ShapeDtypeStruct((2, 4096, 2, hv), jnp.bfloat16)
      assert jaxflash.implementation_for(q, kk, v, implementation="mosaic") == "mosaic"
      assert jaxflash.implementation_for(q, kk, v) == chosen, hv
    wide = jax.ShapeDtypeStruct((2, 4096, 2, 320), jnp.bfloat16)
    with pytest.raises(backends.UnsupportedCallError, match="mosaic.*value head dims up to 256"):
      jaxflash.implementation_for(q, kk, wide, implementation="mosaic")
  h200 = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
      device_kind="NVIDIA H200", platform="gpu", num_cores=132))
  q = kk = jax.ShapeDtypeStruct((1, 8192, 16, 192), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 8192, 16, 128), jnp.bfloat16)
  with jax.sharding.use_abstract_mesh(h200):
    short = [jax.ShapeDtypeStruct((1, 1024) + x.shape[2:], x.dtype) for x in (q, kk, v)]
    for causal in (False, True):  # (its backward runs 3-4x Triton's at every length measured)
      assert jaxflash.implementation_for(q, kk, v, is_causal=causal) == "mosaic"
      assert jaxflash.implementation_for(*short, is_causal=causal) == "mosaic"
    other = jax.ShapeDtypeStruct((1, 8192, 16, 64), jnp.bfloat16)  # (192 / 64: not measured)
    assert jaxflash.implementation_for(q, kk, other, is_causal=True) == "triton"


# ---------------------------------------------------------------------------------------------
# Absorbed MLA's latent cache on the Mosaic GPU kernel (`jaxflash.backends.mosaic.decode`).


def _mosaic_mla(monkeypatch) -> list:
  """Routes latent-cache calls to the Mosaic GPU decoding kernel in interpret mode too (on a
  GPU it takes them compiled, `jaxflash.ops.decode.mosaic_decode_runs`); returns its spy."""
  from jaxflash.ops import decode as ops_decode
  monkeypatch.setattr(ops_decode, "mosaic_decode_runs", lambda *a: True)
  return _spy_split_kv(monkeypatch, "mosaic")


def _transposed(monkeypatch, on: bool, **fields) -> list:
  """Sets the Mosaic GPU decoding kernel's ``transposed`` (the keys as the wgmma's M) and other
  ``fields`` of its config for the calls that follow; returns a list that records, per call,
  whether the transposed kernel ran."""
  from jaxflash.backends.mosaic import decode
  shipped, runs = decode.default_config, decode.runs_transposed
  monkeypatch.setattr(decode, "default_config", lambda *a, **kw: dataclasses.replace(
      shipped(*a, **kw), transposed=on, **fields))
  seen = []
  monkeypatch.setattr(decode, "runs_transposed", lambda *a: seen.append(runs(*a)) or seen[-1])
  return seen


@pytest.mark.parametrize("b,t,s,n,h,hv,page_size,options", [
    pytest.param(2, 1, 200, 16, 576, 512, None, {},  # 16 of 64 rows, 4 splits, a partial last
                 marks=pytest.mark.variants),  # block (a variant: 16 heads run transposed as
    # shipped; on a CPU [2-2-128-128-576-512-64-options5] and [3-3-512-16-320-256-128-options6]
    # hold the rows as M, padded rows and splits, test_mosaic_decode_mla_nan_and_empty_rows a
    # partial last block through both kernels' `load_key_blocks`)
    # The keys as the wgmma's M (`decode_transposed`): 16 and 32 columns, pages, a soft cap,
    # sinks, lengths past the cache and below 0
    (2, 1, 200, 16, 576, 512, None, dict(transposed=True)),
    (3, 2, 512, 16, 576, 512, 128, dict(transposed=True, logits_soft_cap=3.0, sinks=True)),
    pytest.param(2, 2, 448, 16, 576, 512, None, dict(transposed=True, splits=1),  # 7 blocks a
                 marks=pytest.mark.variants),  # split (the GPU, JAXFLASH_ALL_VARIANTS=1)
    (2, 1, 128, 8, 448, 384, None, dict(transposed=True, out_of_range=True)),
    (2, 2, 128, 128, 576, 512, 64, {}),  # two row blocks of 64, 64-key pages
    (3, 3, 512, 16, 320, 256, 128, {}),  # 48 rows, two blocks a page, a row shorter than T
    # O's halves in three pieces of 64 columns; lengths past the cache and below 0 (the
    # kernel clips the caller's lengths itself)
    pytest.param(2, 1, 128, 8, 448, 384, None, dict(out_of_range=True),
                 marks=pytest.mark.variants),  # (on a CPU: the transposed kernel's case
    # clips, and 320/256's case holds the 64-column pieces of O)
    pytest.param(2, 2, 96, 16, 576, 512, None, dict(logits_soft_cap=3.0, sinks=True),
                 marks=pytest.mark.variants),  # (the transposed kernel's case holds both)
])
def test_mosaic_decode_mla(b, t, s, n, h, hv, page_size, options, monkeypatch):
  """The Mosaic GPU kernel of absorbed MLA's latent cache (interpreted), bf16, against the
  float32 reference: ragged rows (one holding fewer tokens than T), lengths past the cache or
  below zero, pages, a soft cap and sinks; gradients through the XLA backend's backward, the
  sinks' too. A test of the kernel's masking: rows past a length or a token's own position
  must see nothing there."""
  ran = _mosaic_mla(monkeypatch)
  options = dict(options)  # (the parameter's own dict stays as it is)
  transposed = options.pop("transposed", False)
  fields = {"splits": options.pop("splits")} if "splits" in options else {}
  ran_transposed = _transposed(monkeypatch, transposed, **fields)
  q, latent, _, d_out = _qkv(16, b, t, s, n, 1, h, hv, dtype=jnp.bfloat16)
  lengths = jnp.array([s, s // 2 + 3, t - 1][:b], jnp.int32)
  if options.pop("out_of_range", False):
    lengths = jnp.array([s + 9, -4], jnp.int32)
  cache, table = _pages(latent, page_size, 6) if page_size else (latent, None)
  sinks = jax.random.normal(jax.random.key(17), (n,)) if options.pop("sinks", False) else None

  def ours(q, cache, sinks):
    return jaxflash.decode_attention(q, cache, None, lengths, value_head_dim=hv, sinks=sinks,
                                     page_table=table, interpret=True, **options)

  def xla(q, latent, sinks):
    return jaxflash.decode_attention(q, latent, latent[..., :hv], lengths, sinks=sinks,
                                     implementation="xla", **options)

  f32 = [x.astype(F32) for x in (q, latent)]
  out, vjp = jax.vjp(jax.jit(ours), q, cache, sinks)
  assert ran  # (traced once or more: the interpreter runs the whole call unjitted)
  assert ran_transposed and set(ran_transposed) == {transposed}
  chex.assert_shape(out, (b, t, n, hv))
  want, want_vjp = jax.vjp(jax.jit(xla), *f32, sinks)
  assert rel_err(out.astype(F32), want) <= 1e-2
  if b > 2:  # the row with T - 1 tokens: its first query row sees no key and gives zeros
    assert not np.asarray(out[2, 0], np.float32).any()
  got_grads, want_grads = vjp(d_out.astype(out.dtype)), want_vjp(d_out)
  dq, d_cache = got_grads[:2]
  if page_size:
    d_cache = jnp.take(d_cache, table, axis=0).reshape(latent.shape)
  assert rel_err(dq.astype(F32), want_grads[0]) <= 2e-2
  assert rel_err(d_cache.astype(F32), want_grads[1]) <= 2e-2
  if sinks is not None:
    assert rel_err(got_grads[2], want_grads[2]) <= 2e-2


def test_mosaic_decode_mla_nan_and_empty_rows(monkeypatch):
  """NaN in one query head's vector gives NaN in that head's rows only; a batch row with an
  empty cache gives zeros."""
  ran = _mosaic_mla(monkeypatch)
  q, latent, _, _ = _qkv(18, 2, 1, 136, 16, 1, 576, 512, dtype=jnp.bfloat16)
  q = q.at[0, 0, 5, 7].set(jnp.nan)
  out = jaxflash.decode_attention(q, latent, None, jnp.array([130, 0], jnp.int32),
                                  value_head_dim=512, interpret=True)
  assert ran  # (traced once or more: the interpreter runs the whole call unjitted)
  nan = np.isnan(np.asarray(out, np.float32)).any(axis=-1)
  assert nan[0, 0, 5] and nan.sum() == 1
  assert not np.asarray(out[1], np.float32).any()


@pytest.mark.parametrize("magnitude", [3e5, 1e-6])
def test_mosaic_decode_mla_transposed_partials_any_magnitude(magnitude, monkeypatch):
  """The transposed kernel's float16 partial results hold values past float16's range (a
  cache of magnitude 3e5, whose outputs would overflow to inf unscaled) and far below it (1e-6,
  whose outputs would be float16 subnormals or zero): each row leaves scaled to a common peak.
  The query is divided by as much, so the logits stay as they were."""
  from jaxflash.backends.mosaic import decode_transposed
  monkeypatch.setattr(decode_transposed, "PARTIAL_DTYPE", jnp.float16)
  ran = _mosaic_mla(monkeypatch)
  ran_transposed = _transposed(monkeypatch, True)
  q, latent, _, _ = _qkv(23, 2, 2, 200, 16, 1, 576, 512)
  q, latent = (q / magnitude).astype(jnp.bfloat16), (latent * magnitude).astype(jnp.bfloat16)
  lengths = jnp.array([200, 77], jnp.int32)
  out = jaxflash.decode_attention(q, latent, None, lengths, value_head_dim=512, interpret=True)
  assert ran and ran_transposed and set(ran_transposed) == {True}
  f32 = [x.astype(F32) for x in (q, latent)]
  want = jaxflash.decode_attention(f32[0], f32[1], f32[1][..., :512], lengths,
                                   implementation="xla")
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert rel_err(out.astype(F32), want) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("b,t,s,page_size,options", [
    (2, 1, 3000, None, {}),  # 16 columns, 47 splits, a partial last block
    (3, 2, 1536, 64, dict(logits_soft_cap=30.0)),  # 32 columns, pages, a row shorter than T
    (2, 2, 776, None, dict(sinks=True)),
])
def test_mosaic_decode_mla_transposed_on_gpu(b, t, s, page_size, options, monkeypatch):
  """The keys as the wgmma's M (`decode_transposed`, 16 heads) against the rows as M and the
  float32 reference, compiled: output and query gradient. NaN in one head's query stays in
  that head's rows; a batch row with an empty cache gives zeros."""
  if not mosaic.is_hopper(devices.current()):
    pytest.skip("needs a Hopper GPU")
  ran = _spy_split_kv(monkeypatch, "mosaic")
  options = dict(options)
  q, latent, _, d_out = _qkv(21, b, t, s, 16, 1, 576, 512, dtype=jnp.bfloat16)
  lengths = jnp.array([s, s // 3, 0][:b], jnp.int32)
  cache, table = _pages(latent, page_size, 5) if page_size else (latent, None)
  sinks = jax.random.normal(jax.random.key(22), (16,)) if options.pop("sinks", False) else None

  def call(q):
    return jaxflash.decode_attention(q, cache, None, lengths, value_head_dim=512,
                                     page_table=table, sinks=sinks, **options)

  def out_and_dq():  # (a new function each time: jit would reuse its trace of the last one)
    out, vjp = jax.vjp(jax.jit(lambda q: call(q)), q)
    return out, vjp(d_out.astype(out.dtype))[0]

  results = {}
  for on in (False, True):
    seen = _transposed(monkeypatch, on)
    jax.clear_caches()
    results[on] = out_and_dq()
    assert seen and set(seen) == {on}
  assert ran
  for got, want in zip(results[True], results[False]):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2)
  if sinks is None and not options:  # (the others are checked in the interpreter's test)
    want = _decode_reference(*(x.astype(F32) for x in (q, latent, latent[..., :512])), lengths)
    assert rel_err(results[True][0].astype(F32), want) <= 1e-2
  if b > 2:
    assert not np.asarray(results[True][0][2], np.float32).any()
  q = q.at[0, 0, 5, 7].set(jnp.nan)
  nan = np.isnan(np.asarray(jax.jit(lambda q: call(q))(q), np.float32)).any(axis=-1)
  assert nan[0, 0, 5] and nan.sum() == 1


@pytest.mark.parametrize("n,t,latent,dtype,want", [
    (16, 1, True, jnp.bfloat16, None), (128, 2, True, jnp.float16, None),
    (16, 3, True, jnp.bfloat16, None), (16, 1, False, jnp.bfloat16, "a value cache"),
    (4, 1, True, jnp.bfloat16, "G = 4 query heads"), (96, 1, True, jnp.bfloat16, "G = 96"),
    (16, 1, True, jnp.float32, "bfloat16 and float16 only"),
])
def test_mosaic_decode_mla_declines(n, t, latent, dtype, want):
  """What the Mosaic GPU kernel declines (the call then runs Triton's kernel): a value cache of
  its own, groups of heads that are not whole 8-row tiles of Q or, where a group's rows take
  several blocks, whole 64-row blocks, float32."""
  from jaxflash import _core, masking
  from jaxflash.backends.mosaic import decode
  q = jnp.zeros((1, t, n, 576), dtype)
  latent_cache = jnp.zeros((1, 64, 1, 576), dtype)
  inputs = _core.Inputs(q, latent_cache, latent_cache[..., :512], jnp.array([[t, 64]], jnp.int32),
                        kv_lengths=jnp.array([64], jnp.int32))
  params = _core.Params(scale=1.0, window=masking.Window(None, 0), values_in_keys=latent)
  reason = decode.unsupported(inputs, params)
  assert (reason is None) if want is None else (want in reason)
  if want is None:  # (it reads the caller's lengths as given: decode_attention's inputs)
    assert "key lengths" in decode.unsupported(inputs._replace(kv_lengths=None), params)
  assert decode.paged_block(64) and decode.paged_block(128) and not decode.paged_block(32)


@pytest.mark.parametrize("b,s,n,want", [
    (32, 8192, 16, 4), (8, 32768, 16, 16),
    pytest.param(64, 8192, 16, 2,  # (64 groups: on a CPU [32-8192-128-2]'s 64 groups hold the
                 marks=pytest.mark.variants),  # rule, and [32-8192-16-4] 16 heads transposed)
    (32, 8192, 128, 2), (1, 256, 16, 4)])
def test_mosaic_decode_mla_launch(b, s, n, want):
  """One wave: splits that bring (batch row, K/V head, row block) CTAs closest to an H200's
  132 SMs, none without a key block; groups of up to 32 query rows with the keys as M."""
  from jaxflash import _core
  from jaxflash.backends.mosaic import decode
  q = jnp.zeros((b, 1, n, 576), jnp.bfloat16)
  latent_cache = jnp.zeros((b, s, 1, 576), jnp.bfloat16)
  inputs = _core.Inputs(q, latent_cache, latent_cache[..., :512], jnp.zeros((b, 2), jnp.int32))
  config = decode.default_config(inputs, None, devices.Device("gpu", "NVIDIA H200", True))
  assert config.splits == want and config.num_stages == 2
  assert config.transposed == (n == 16) == decode.runs_transposed(inputs, config)
  two_tokens = inputs._replace(query=jnp.zeros((b, 2, n, 576), jnp.bfloat16))
  assert decode.default_config(two_tokens, None, devices.Device(
      "gpu", "NVIDIA H200", True)).transposed == (n == 16)
  assert not decode.transposed_serves(48) and not decode.transposed_serves(12)


def test_mosaic_decode_mla_lowers_for_cuda(cuda_plugin):
  """On a Hopper GPU latent-cache calls take the Mosaic GPU kernel, which lowers for CUDA
  (contiguous and on 64-key pages, 16 and 128 heads); a value cache of its own, or
  ``implementation`` without Mosaic, keeps Triton's kernel."""
  del cuda_plugin
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  table = jax.ShapeDtypeStruct((2, 4), jnp.int32)
  for n, t, paged in ((16, 1, False), (128, 2, True), (16, 2, True)):
    q = jax.ShapeDtypeStruct((2, t, n, 576), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((9, 64, 1, 576) if paged else (2, 4096, 1, 576), jnp.bfloat16)
    text = lower_for_cuda(lambda q, c, tb, ln: jaxflash.decode_attention(
        q, c, None, ln, value_head_dim=512, page_table=tb if paged else None),
        q, cache, table, lengths)
    assert "jaxflash_mosaic_decode_mla" in text and "jaxflash_decode_split_kv" not in text
    # (16 heads: the keys as the wgmma's M, `decode_transposed`)
    assert ("jaxflash_mosaic_decode_mla_transposed" in text) == (n == 16)
  q = jax.ShapeDtypeStruct((2, 1, 16, 576), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((2, 4096, 1, 576), jnp.bfloat16)
  text = lower_for_cuda(lambda q, c, ln: jaxflash.decode_attention(
      q, c, None, ln, value_head_dim=512, implementation=("triton", "xla")), q, cache, lengths)
  assert "jaxflash_decode_split_kv" in text and "jaxflash_mosaic_decode_mla" not in text
  values = jax.ShapeDtypeStruct((2, 4096, 1, 512), jnp.bfloat16)
  text = lower_for_cuda(lambda q, c, v, ln: jaxflash.decode_attention(q, c, v, ln),
                        q, cache, values, lengths)
  assert "jaxflash_decode_split_kv" in text and "jaxflash_mosaic_decode_mla" not in text


def test_mosaic_decode_mla_kernel_merge_lowers_for_cuda(cuda_plugin, monkeypatch):
  """With ``merge_in_kernel`` (opt-in) the kernel's last CTA of each group merges the splits:
  it lowers for CUDA, here with 64 splits and two tokens' stores a piece."""
  del cuda_plugin
  from jaxflash.backends.mosaic import decode
  shipped = decode.default_config
  monkeypatch.setattr(decode, "default_config", lambda *a, **kw: dataclasses.replace(
      shipped(*a, **kw), merge_in_kernel=True, transposed=False))
  q = jax.ShapeDtypeStruct((1, 2, 16, 576), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((1, 4096, 1, 576), jnp.bfloat16)
  text = lower_for_cuda(lambda q, c, ln: jaxflash.decode_attention(
      q, c, None, ln, value_head_dim=512), q, cache, jax.ShapeDtypeStruct((1,), jnp.int32))
  assert "jaxflash_mosaic_decode_mla" in text


def test_mosaic_decode_mla_lowers_with_x64_and_strict_rank_promotion(cuda_plugin):
  """int64 lengths and a page table under jax_enable_x64, no implicit rank promotion: the
  Mosaic GPU kernel of the latent cache mixes no int32 and int64 and broadcasts no ranks (it
  lowers for CUDA; Mosaic GPU's interpreter cannot run under x64, `test_x64_numerics`)."""
  del cuda_plugin
  with jax.enable_x64(True), jax.numpy_rank_promotion("raise"):
    q = jax.ShapeDtypeStruct((2, 2, 16, 576), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((9, 64, 1, 576), jnp.bfloat16)
    text = lower_for_cuda(lambda q, p, tb, ln: jaxflash.decode_attention(
        q, p, None, ln, value_head_dim=512, page_table=tb, logits_soft_cap=30.0), q, pages,
        jax.ShapeDtypeStruct((2, 4), jnp.int64), jax.ShapeDtypeStruct((2,), jnp.int64))
  assert "jaxflash_mosaic_decode_mla" in text


@pytest.mark.gpu
def test_mosaic_decode_mla_x64_on_gpu(monkeypatch):
  """The same compiled on a Hopper GPU under jax_enable_x64: as without it."""
  if not mosaic.is_hopper(devices.current()):
    pytest.skip("needs a Hopper GPU")
  ran = _spy_split_kv(monkeypatch, "mosaic")
  q, latent, _, _ = _qkv(19, 2, 2, 128, 16, 1, 576, 512, dtype=jnp.bfloat16)
  cache, table = _pages(latent, 64, 8)
  want = _decode_reference(*(x.astype(F32) for x in (q, latent, latent[..., :512])),
                           jnp.array([128, 70], jnp.int32))
  with jax.enable_x64(True), jax.numpy_rank_promotion("raise"):
    got = jaxflash.decode_attention(q, cache, None, jnp.array([128, 70], jnp.int64),
                                    value_head_dim=512, page_table=table.astype(jnp.int64))
  assert ran
  assert rel_err(got.astype(F32), want) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("b,t,n,s,page_size", [
    (1, 1, 16, 3000, None),  # 47 splits; 16 rows: two 64-column pieces an item (32-row slots)
    (2, 2, 16, 1504, None),  # 32 rows, two tokens: two pieces an item, four stores a tile
    (3, 2, 128, 1024, 64),  # two row blocks a token (G ≥ 64), 11 splits, paged
    (2, 3, 16, 704, None),  # 48 rows of 64, three tokens' stores a piece
])
def test_mosaic_decode_mla_merge_on_gpu(b, t, n, s, page_size, monkeypatch):
  """The splits merged by the kernel's last CTA of each group (``merge_in_kernel=True``)
  against the same kernel's partial results merged by XLA (the shipped launch): output and
  query gradient (which reads the merged LSE) equal within float32 rounding, and both near
  the float32 reference. NaN in one head's query stays in that head's rows; a batch row with
  an empty cache gives zeros."""
  if not mosaic.is_hopper(devices.current()):
    pytest.skip("needs a Hopper GPU")
  from jaxflash.backends.mosaic import decode
  ran, merges, merges_in_kernel = _spy_split_kv(monkeypatch, "mosaic"), [], decode.merges_in_kernel
  monkeypatch.setattr(decode, "merges_in_kernel",
                      lambda *a: merges.append(merges_in_kernel(*a)) or merges[-1])
  q, latent, _, d_out = _qkv(20, b, t, s, n, 1, 576, 512, dtype=jnp.bfloat16)
  lengths = jnp.array([s, s // 3, 0][:b], jnp.int32)
  cache, table = _pages(latent, page_size, 5) if page_size else (latent, None)

  def call(q):
    return jaxflash.decode_attention(q, cache, None, lengths, value_head_dim=512,
                                     page_table=table)

  def out_and_dq():  # (a new function each time: jit would reuse its trace of the last one)
    out, vjp = jax.vjp(jax.jit(lambda q: call(q)), q)
    return out, vjp(d_out.astype(out.dtype))[0]

  by_xla = out_and_dq()
  shipped = decode.default_config
  monkeypatch.setattr(decode, "default_config", lambda *a, **kw: dataclasses.replace(
      shipped(*a, **kw), merge_in_kernel=True, transposed=False))
  merged = out_and_dq()
  assert ran and merges[0] is False and merges[-1] is True
  for got, want in zip(merged, by_xla):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-2, atol=1e-2)
  want = _decode_reference(*(x.astype(F32) for x in (q, latent, latent[..., :512])), lengths)
  assert rel_err(merged[0].astype(F32), want) <= 1e-2
  if b > 2:
    assert not np.asarray(merged[0][2], np.float32).any()

  q = q.at[0, 0, 5, 7].set(jnp.nan)
  nan = np.isnan(np.asarray(jax.jit(lambda q: call(q))(q), np.float32)).any(axis=-1)
  assert nan[0, 0, 5] and nan.sum() == 1 and merges[-1] is True


def test_mosaic_decode_mla_merges_in_kernel():
  """Where the Mosaic GPU kernel merges its splits itself (one kernel a call): where its config
  asks (not by default: it is slower today), but not with sinks (XLA joins them to the merged
  denominator) nor in the interpreter (it has no semaphores)."""
  from jaxflash import _core, masking
  from jaxflash.backends.mosaic import decode
  q = jnp.zeros((2, 1, 16, 576), jnp.bfloat16)
  cache = jnp.zeros((2, 256, 1, 576), jnp.bfloat16)
  inputs = _core.Inputs(q, cache, cache[..., :512], jnp.zeros((2, 2), jnp.int32))
  params = _core.Params(scale=1.0, window=masking.Window(None, 0), values_in_keys=True)
  shipped = decode.default_config(inputs, None, devices.Device("gpu", "NVIDIA H200", True))
  assert not decode.merges_in_kernel(inputs, params, shipped)
  config = dataclasses.replace(shipped, merge_in_kernel=True, transposed=False)
  assert decode.merges_in_kernel(inputs, params, config)
  # (the transposed kernel, shipped at 16 heads, has no merge of its own)
  assert not decode.merges_in_kernel(inputs, params, dataclasses.replace(config, transposed=True))
  assert not decode.merges_in_kernel(inputs._replace(sinks=jnp.zeros((16,))), params, config)
  assert not decode.merges_in_kernel(inputs, dataclasses.replace(params, interpret=True), config)
