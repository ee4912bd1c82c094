"""The same reference checks on a real NVIDIA GPU, with the shipped tile sizes (no interpret mode).

Skipped without a GPU; run on the GPU machine with `python -m pytest -m gpu tests`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import devices
from jaxflash.backends import mosaic
from checks import GPU_F32_TOLERANCE, OPTIONS, check, dropped_weights, random_qkv, rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("option", list(OPTIONS))
def test_option_on_gpu(option):
  b, t, s, n = 2, 300, 517, 8
  check("triton", small=False, b=b, t=t, s=s, n=n, k=2, h=64, dtype=jnp.bfloat16,
        **OPTIONS[option](b, t, s, n, 0))


@pytest.mark.parametrize("h", [32, 40, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_head_dims_on_gpu(h, dtype):
  tol = GPU_F32_TOLERANCE if dtype == jnp.float32 else None
  check("triton", small=False, b=2, t=333, s=1000, n=4, k=1, h=h, dtype=dtype, tol=tol,
        is_causal=False)
  check("triton", small=False, b=1, t=1000, s=1000, n=4, k=2, h=h, dtype=dtype, tol=tol,
        is_causal=True)


@pytest.mark.parametrize("t,s", [(1, 1), (1, 4097), (17, 17), (4096, 4096), (2049, 1023)])
def test_lengths_on_gpu(t, s):
  check("triton", small=False, b=2, t=t, s=s, n=4, k=4, h=128, dtype=jnp.bfloat16)


def test_xla_backend_on_gpu():
  check("xla", small=False, b=2, t=300, s=517, n=8, k=2, h=64, dtype=jnp.bfloat16, is_causal=True)


@pytest.mark.parametrize("features", ["plain", "dropout_and_bias"])
def test_deterministic_gradients_on_gpu(features):
  """Two runs of the jitted forward+backward give bitwise identical results (no atomics), also
  with dropout and a differentiated bias that is shared across the batch."""
  q, k, v, d_out = random_qkv(3, 2, 1024, 1024, 8, 2, 128, jnp.bfloat16)
  bias = jax.random.normal(jax.random.key(4), (1, 8, 1024, 1024), jnp.bfloat16)
  options = dict(dropout_rate=0.1, dropout_rng=jax.random.key(5)) if features != "plain" else {}

  def loss(q, k, v, bias):
    out = jaxflash.flash_attention(q, k, v, bias if features != "plain" else None,
                                   is_causal=True, **options)
    return jnp.sum(out.astype(jnp.float32) * d_out)

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
  first, second = step(q, k, v, bias), step(q, k, v, bias)
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dropout_mask_on_gpu_matches_xla_backend_and_definition():
  """The Triton kernels' mask (uint32 hashing lowered through Triton) is bit-for-bit the one
  `jaxflash.dropout` defines, and the XLA backend's on the same GPU."""
  from jaxflash import dropout
  options = dict(b=2, t=300, s=128, n=4, k=2, h=128, dropout_rate=0.25,
                 dropout_rng=jax.random.key(6), is_causal=False)
  triton = dropped_weights("triton", small=False, **options)
  xla = dropped_weights("xla", small=False, **options)
  keep = np.asarray(dropout.dense_keep_mask(dropout.seed_words(options["dropout_rng"]),
                                            triton.shape, 0.25))
  np.testing.assert_array_equal(triton != 0, keep)
  np.testing.assert_array_equal(xla != 0, keep)


@pytest.mark.parametrize("bias_shape", [(2, 8, 700, 900), (1, 8, 700, 900), (2, 1, 700, 900),
                                        (700, 900)])
def test_bias_gradient_on_gpu(bias_shape):
  bias = jax.random.normal(jax.random.key(7), bias_shape, jnp.float32)
  check("triton", small=False, b=2, t=700, s=900, n=8, k=2, h=128, dtype=jnp.bfloat16, bias=bias,
        is_causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(8))


def test_default_implementation_on_gpu():
  """``implementation=None``: the Mosaic forward where it measured faster on this device kind
  (an H200), else Triton; float32 always Triton."""
  q, k, v, _ = random_qkv(0, 1, 64, 64, 2, 2, 128, jnp.bfloat16)
  kind = devices.current().kind
  mosaic_first = (mosaic.is_hopper(devices.current())
                  and mosaic.config.faster_than_triton(kind, 128, 64, False))
  assert jaxflash.implementation_for(q, k, v) == ("mosaic" if mosaic_first else "triton")
  text = jax.jit(lambda q, k, v: jaxflash.flash_attention(q, k, v)).lower(q, k, v).as_text()
  assert ("mosaic_gpu" if mosaic_first else "jaxflash_forward") in text
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  assert jaxflash.implementation_for(q32, k32, v32) == "triton"


@pytest.mark.parametrize("implementation", ["triton", "xla"])
def test_key_split_on_gpu(implementation):
  """The compiled kernels at key offsets (odd ones, mid-block) with the shipped tiles: partial
  forwards merged, and backwards with the global LSE, equal the whole call (bf16, GQA, causal,
  window, lengths, dropout)."""
  from jaxflash import _checks, backends
  from jaxflash.ops import flash, partial
  b, t, s, n, k, h = 2, 300, 517, 8, 2, 128
  q, kk, v, d_out = random_qkv(9, b, t, s, n, k, h, jnp.bfloat16)
  call = _checks.normalise(q, kk, v, is_causal=True, local_window_size=(200, 0),
                           key_value_seq_lengths=jnp.array([517, 400]), dropout_rate=0.1,
                           dropout_rng=jax.random.key(10))
  backend = backends.get(implementation)
  config = backend.default_config(call.inputs, call.params, jaxflash.devices.current())

  def run(fn):
    def loss(q, kk, v):
      out, _ = fn(call.inputs._replace(query=q, key=kk, value=v))
      return jnp.sum(out.astype(jnp.float32) * d_out), out
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, kk, v)

  grads, out = run(lambda x: flash.attention(x, call.params, backend, config))
  split_grads, split_out = run(lambda x: partial.split_keys_attention(
      x, call.params, backend, config, (129, 300)))
  assert rel_err(split_out, out) < 1e-2
  for got, want in zip(split_grads, grads):
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("implementation", ["mosaic", "triton", "xla"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_rows_masked_by_a_huge_finite_bias_on_gpu(implementation, dtype):
  """Rows whose every key a bias of -1e10 or -1e30 hides (``(1 - mask) * -1e10``), forward and
  backward under jit: finite, and jax.nn's rows. On a CPU, XLA rounded such logits apart in
  two fusions and exp2 overflowed (fixed in the XLA backend, 2026-12-05); the compiled kernels
  compute a tile's logits once, but fuse their last multiply into exp2's argument (an FMA)
  and their backward recomputes them against the forward's LSE: the interpreted Triton and
  Mosaic kernels gave NaN there on a CPU, and all three now cap exp2's argument at 0 when a
  bias or score_mod is present (`_core.capped_exponent`). On an H200 (2026-12-05, bf16) all
  three pass; without the cap Mosaic's forward failed here (Triton's and XLA's passed)."""
  q, k, v, d_out = random_qkv(12, 1, 256, 256, 8, 2, 128, dtype)
  d_out = d_out.astype(dtype)
  for value in (-1e10, -1e30):
    bias = jnp.zeros((1, 1, 256, 256)).at[:, :, :5].set(value)

    @jax.jit
    def forward_and_back(q, k, v, bias, d_out):
      out, vjp = jax.vjp(lambda *a: jaxflash.flash_attention(*a, implementation=implementation),
                         q, k, v, bias)
      return out, vjp(d_out)

    out, grads = forward_and_back(q, k, v, bias, d_out)
    for x in (out,) + grads:
      assert np.isfinite(np.asarray(x, np.float32)).all()
    want = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), bias=bias,
                                        implementation="xla")
    assert rel_err(out.astype(jnp.float32), want) < 2e-2


@pytest.mark.parametrize("implementation", ["triton", "xla"])
def test_nan_rows_and_huge_windows_on_gpu(implementation):
  """The compiled kernels with the shipped tiles: a NaN query entry makes its row NaN and a NaN
  key the rows that see it (causal rows before it stay finite), and a window of 2**31 - 1 is
  full attention."""
  from checks import attention
  q, k, v, _ = random_qkv(11, 2, 300, 517, 8, 2, 128, jnp.bfloat16)
  out = np.asarray(attention(implementation, q.at[0, 7, 3, 0].set(jnp.nan), k, v, small=False),
                   np.float32)
  assert np.isnan(out[0, 7, 3]).all() and np.isfinite(out[0, 8:]).all()
  out = np.asarray(attention(implementation, q, k.at[1, 100, 0, 5].set(jnp.nan), v,
                             is_causal=True, small=False), np.float32)
  assert np.isfinite(out[1, :100]).all() and np.isnan(out[1, 100:, :4]).all()
  assert np.isfinite(out[1, 100:, 4:]).all()  # heads of the other K/V head never see it
  wide = attention(implementation, q, k, v, local_window_size=(2**31 - 1, 2**31 - 1),
                   small=False)
  full = attention(implementation, q, k, v, small=False)
  np.testing.assert_array_equal(np.asarray(wide, np.float32), np.asarray(full, np.float32))
