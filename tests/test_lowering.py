"""Lower the Triton kernels for CUDA on a CPU-only machine.

Interpret mode does not enforce the Triton lowering's rules (power-of-two tiles, supported ops),
so these tests lower forward + backward for an H100 target with the shipped tile sizes, and run
MLIR's verifier on every Triton module produced (the GPU runs it too, when it parses the module):
a kernel that would fail to lower on a user's GPU fails here, in CI.
"""

import jax
import jax.numpy as jnp
import pytest

import jaxflash
from checks import lower_for_cuda

KERNELS = ("jaxflash_forward", "jaxflash_backward_dq", "jaxflash_backward_dkv")


def _fwd_bwd(**options):
  def fn(q, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(
        jaxflash.flash_attention(q, k, v, implementation="triton", **options)
        .astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
  return fn


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("h", [32, 40, 64, 80, 96, 128, 256])
def test_head_dims_and_dtypes_lower(h, dtype):
  q = jax.ShapeDtypeStruct((2, 300, 8, h), dtype)
  kv = jax.ShapeDtypeStruct((2, 1000, 2, h), dtype)
  text = lower_for_cuda(_fwd_bwd(is_causal=True), q, kv, kv)
  for name in KERNELS:
    assert name in text


@pytest.mark.parametrize("t,s", [(1, 1), (5, 77), (4096, 4096)])
def test_every_option_lowers(t, s):
  b, n, k, h = 2, 6, 3, 80
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, s, k, h), jnp.bfloat16)
  options = dict(
      is_causal=True, local_window_size=(64, 0), logits_soft_cap=30.0,
      mask=jnp.ones((b, 1, t, s), bool), bias=jnp.zeros((1, n, t, s), jnp.bfloat16),
      segment_ids=(jnp.zeros((b, t), jnp.int32), jnp.zeros((b, s), jnp.int32)),
      query_seq_lengths=jnp.full((b,), t), key_value_seq_lengths=jnp.full((b,), s),
      dropout_rate=0.1, dropout_rng=jax.random.key(0))
  text = lower_for_cuda(_fwd_bwd(**options), q, kv, kv)
  for name in KERNELS:
    assert name in text
  # The optional inputs reach the kernels: the forward's custom call takes q, k, v, the
  # lengths, both segment id arrays, the mask, the bias and the dropout seed.
  forward_call = next(line for line in text.splitlines() if "jaxflash_forward" in line
                      and "custom_call" in line)
  assert forward_call.count("%") - forward_call.split("(")[0].count("%") >= 9, forward_call


@pytest.mark.parametrize("h", [40, 128, 256])
@pytest.mark.parametrize("bias_shape", [(2, 6, 300, 1000), (1, 6, 300, 1000), (2, 1, 300, 1000),
                                        (1, 1, 300, 1000)])
def test_bias_gradient_lowers(bias_shape, h):
  """The dbias kernel, for every way a bias can broadcast, with dropout, mask and segments."""
  b, t, s = 2, 300, 1000
  q = jax.ShapeDtypeStruct((b, t, 6, h), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, s, 2, h), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct(bias_shape, jnp.float32)

  def fn(q, k, v, bias):
    def loss(q, k, v, bias):
      return jnp.sum(jaxflash.flash_attention(
          q, k, v, bias=bias, mask=jnp.ones((b, 1, t, s), bool), is_causal=True,
          segment_ids=(jnp.zeros((b, t), jnp.int32), jnp.zeros((b, s), jnp.int32)),
          dropout_rate=0.1, dropout_rng=jax.random.key(0), implementation="triton")
          .astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)

  assert "jaxflash_backward_dbias" in lower_for_cuda(fn, q, kv, kv, bias)


def test_lowering_check_can_fail(monkeypatch):
  """The check is real: a non-power-of-two tile must be rejected by the CUDA lowering."""
  from jaxflash.backends.triton import tiles
  monkeypatch.setattr(tiles, "fit", lambda block, length: 24)
  q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(Exception, match="power of 2"):
    lower_for_cuda(_fwd_bwd(), q, q, q)


def test_verifier_catches_what_the_gpu_would_refuse(monkeypatch):
  """A loop bound from ``jnp.where`` on Python ints lowers, but the module fails MLIR
  verification (as it did on the GPU, for an early dbias kernel); the verifier must catch it."""
  from jax.experimental import pallas as pl

  def kernel(x_ref, o_ref):
    trips = jnp.where(pl.program_id(0) >= 0, 3, 0)
    o_ref[...] = jax.lax.fori_loop(0, trips, lambda i, acc: acc + 1.0, x_ref[...])

  def fn(x):
    return pl.pallas_call(kernel, grid=(1,), out_shape=jax.ShapeDtypeStruct((16,), x.dtype))(x)

  with pytest.raises(Exception, match="verif"):
    lower_for_cuda(fn, jax.ShapeDtypeStruct((16,), jnp.float32))


@pytest.mark.parametrize("t,n,k,h,dtype,heads", [
    (1, 32, 8, 128, jnp.bfloat16, 1), (16, 32, 8, 64, jnp.float16, 2),
    (4, 8, 8, 256, jnp.bfloat16, 1), (2, 6, 2, 80, jnp.float32, 2)])
def test_decode_split_kv_lowers(t, n, k, h, dtype, heads, monkeypatch):
  """The split-KV decoding kernel (GQA 32/8 and MHA, T up to 16, padded head dims, one or two
  K/V heads per program) with the kernel that merges its splits (``merge="kernel"``, not the
  default) and, under jax.grad, the training backward behind it; no training forward."""
  import dataclasses

  from jaxflash.backends.triton import decode
  default = decode.default_config
  monkeypatch.setattr(decode, "default_config", lambda *a, **kw: dataclasses.replace(
      default(*a, **kw), merge="kernel", heads=heads))
  q = jax.ShapeDtypeStruct((2, t, n, h), dtype)
  cache = jax.ShapeDtypeStruct((2, 5000, k, h), dtype)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)

  def fn(q, kc, vc, lengths):
    # (Gradients of all three: newer jax drops a backward kernel whose outputs nothing uses.)
    return jax.grad(lambda q, kc, vc: jnp.sum(jaxflash.decode_attention(
        q, kc, vc, lengths, local_window_size=(1000, 0), implementation="triton")
        .astype(jnp.float32)), argnums=(0, 1, 2))(q, kc, vc)

  text = lower_for_cuda(fn, q, cache, cache, lengths)
  assert "jaxflash_decode_split_kv" in text and "jaxflash_forward" not in text
  assert "jaxflash_decode_merge" in text
  assert "jaxflash_backward_dq" in text and "jaxflash_backward_dkv" in text


@pytest.mark.parametrize("page_size,h", [(16, 128), (256, 128), (64, 64)])
def test_decode_split_kv_on_pages_lowers(page_size, h):
  """The split-KV kernel reading a paged cache where it lies: 64-key blocks of four 16-key
  pages, of part of a 256-key page, or of one 64-key page (at D = 64, with two K/V heads per
  program)."""
  q = jax.ShapeDtypeStruct((3, 1, 32, h), jnp.bfloat16)
  pages = jax.ShapeDtypeStruct((3 * 4096 // page_size + 5, page_size, 8, h), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((3, 4096 // page_size), jnp.int32)
  lengths = jax.ShapeDtypeStruct((3,), jnp.int32)

  def fn(q, pages, table, lengths):
    return jaxflash.decode_attention(q, pages, pages, lengths, page_table=table,
                                     implementation="triton")

  text = lower_for_cuda(fn, q, pages, table, lengths)
  assert "jaxflash_decode_split_kv" in text and "jaxflash_forward" not in text
  # (The rows the pages make are still gathered in this program, for a backward; nothing uses
  # them here, so XLA's dead-code elimination drops them when it compiles.)
  kernel_call = next(line for line in text.splitlines()
                     if "jaxflash_decode_split_kv" in line and "custom_call" in line)
  assert f"x{page_size}x8x{h}xbf16" in kernel_call  # the pages, not rows, go into the kernel


def test_decode_split_kv_lowers_with_x64_and_strict_rank_promotion():
  """jax_enable_x64 (Python ints become int64: the kernel's index maps and key bounds once
  mixed them with int32 ids, which lax refuses) and rank promotion "raise" (sinks joined to the
  merged splits), on a paged cache with int64 lengths and page table."""
  q = jax.ShapeDtypeStruct((3, 2, 32, 128), jnp.bfloat16)
  pages = jax.ShapeDtypeStruct((3 * 4096 // 64 + 5, 64, 8, 128), jnp.bfloat16)

  def fn(q, pages, table, lengths, sinks):
    return jaxflash.decode_attention(q, pages, pages, lengths, page_table=table, sinks=sinks,
                                     local_window_size=(1000, 0), implementation="triton")

  with jax.enable_x64(True), jax.numpy_rank_promotion("raise"):
    text = lower_for_cuda(fn, q, pages, jax.ShapeDtypeStruct((3, 4096 // 64), jnp.int64),
                          jax.ShapeDtypeStruct((3,), jnp.int64),
                          jax.ShapeDtypeStruct((32,), jnp.float32))
  assert "jaxflash_decode_split_kv" in text and "jaxflash_forward" not in text


@pytest.mark.parametrize("paged,dtype,implementation,per_token", [
    (False, jnp.float8_e4m3fn, ("triton", "xla"), False), (True, jnp.float8_e4m3fn, None, False),
    (False, jnp.float8_e5m2, None, False), (False, jnp.float8_e4m3fn, None, True)])
def test_decode_split_kv_on_an_fp8_cache_lowers(paged, dtype, implementation, per_token):
  """The split-KV kernel on an FP8 cache (contiguous or paged; e4m3 and e5m2; a key factor per
  token on a contiguous one), also where no implementation is named (the training backend is
  then Mosaic's): its K/V tiles converted to float16 in registers, no training forward."""
  q = jax.ShapeDtypeStruct((3, 2, 32, 128), dtype)
  if paged:
    cache = jax.ShapeDtypeStruct((3 * 4096 // 64 + 5, 64, 8, 128), dtype)
    extra = dict(page_table=jax.ShapeDtypeStruct((3, 4096 // 64), jnp.int32))
  else:
    cache = jax.ShapeDtypeStruct((3, 4096, 8, 128), dtype)
    extra = {}
  factors = jax.ShapeDtypeStruct((3, 8), jnp.float32)
  key_factors = jax.ShapeDtypeStruct((3, 4096, 8), jnp.float32) if per_token else factors

  def fn(q, kc, vc, lengths, kd, vd, extra):
    return jaxflash.decode_attention(q, kc, vc, lengths, k_descale=kd, v_descale=vd,
                                     implementation=implementation, **extra)

  lengths = jax.ShapeDtypeStruct((3,), jnp.int32)
  text = lower_for_cuda(fn, q, cache, cache, lengths, key_factors, factors, extra)
  assert "jaxflash_decode_split_kv" in text
  assert "jaxflash_forward" not in text and "mosaic_gpu" not in text
