"""What new users run into (issue 11): NaN must show as NaN, huge windows mean "unbounded",
jax_enable_x64 and strict rank promotion work, empty batches and sequences, non-bool flags, Flax
batch-dim checks, second-order derivatives refused clearly, inputs jax.nn accepts, the drop-in's
jax.nn implementations, the LSE in jax.nn's dtype, and importing the Flax layer (or running the
training example) without Flax. Each runs on both backends where a backend is involved.
"""

import inspect
import os
import subprocess
import sys
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxflash
from jaxflash import backends
from jaxflash.reference import reference_attention
from checks import (BACKENDS, BACKENDS_TRITON_VARIANT, F32_TOLERANCE, attention, random_array,
                    random_qkv, rel_err)

B, T, S, N, K, H = 2, 20, 24, 2, 1, 16


def _qkv(seed=0, dtype=jnp.float32):
  q, k, v, _ = random_qkv(seed, B, T, S, N, K, H, dtype)
  return q, k, v


# ---------------------------------------------------------------------------------------------
# NaN and Inf are not masking


@pytest.mark.parametrize("implementation", BACKENDS)
def test_nan_in_query_key_or_bias_gives_nan_rows(implementation):
  """A NaN (or Inf) in a row's logits makes that row NaN, out and LSE, as in jax.nn; rows that
  cannot see the bad entry stay finite, and masking still empties rows (zeros, not NaN)."""
  q, k, v = _qkv()

  def run(q, k, v, **kw):
    out, lse = attention(implementation, q, k, v, return_residual=True, **kw)
    return np.asarray(out), np.asarray(lse)

  out, lse = run(q.at[0, 3, 1, 0].set(jnp.nan), k, v)
  assert np.isnan(out[0, 3, 1]).all() and np.isnan(lse[0, 3, 1])
  assert np.isfinite(np.delete(out[0], 3, axis=0)).all() and np.isfinite(out[1]).all()
  # One NaN key: every row that sees key 5 is NaN; causal rows before it never see it.
  out, _ = run(q, k.at[0, 5, 0, 2].set(jnp.nan), v, is_causal=True)
  assert np.isfinite(out[0, :5]).all() and np.isnan(out[0, 5:]).all()
  assert np.isfinite(out[1]).all()
  # Inf in a query: inf - inf in the softmax is NaN.
  out, _ = run(q.at[1, 7, 0, 0].set(jnp.inf), k, v)
  assert np.isnan(out[1, 7, 0]).all()
  # NaN in the bias, and a NaN key hidden by the mask or by the key lengths: only the first
  # shows.
  bias = jnp.zeros((B, N, T, S)).at[0, 0, 2, 9].set(jnp.nan)
  out, _ = run(q, k, v, bias=bias)
  assert np.isnan(out[0, 2, 0]).all() and np.isfinite(out[0, 2, 1]).all()
  mask = jnp.ones((B, 1, T, S), bool).at[:, :, :, 11].set(False)
  out, _ = run(q, k.at[:, 11].set(jnp.nan), v, mask=mask)
  assert np.isfinite(out).all()
  out, _ = run(q, k.at[:, 22].set(jnp.nan), v, key_value_seq_lengths=jnp.array([22, 20]))
  assert np.isfinite(out).all()
  # A row whose logits are all -inf through the bias is empty, not NaN: zeros and -inf.
  bias = jnp.zeros((B, N, T, S)).at[1, 1, 4].set(-jnp.inf)
  out, lse = run(q, k, v, bias=bias)
  assert (out[1, 4, 1] == 0).all() and lse[1, 4, 1] == -np.inf


_HUGE_BIAS_ROWS = """
import jax, jax.numpy as jnp, numpy as np, jaxflash
rng = np.random.default_rng(5)
for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
  q, k, v, d_out = (jnp.asarray(rng.standard_normal((1, 64, 2, 32)), jnp.float32).astype(dtype)
                    for _ in range(4))
  for value in (-1e10, -1e30):
    bias = jnp.zeros((1, 1, 64, 64)).at[:, :, :2].set(value)

    @jax.jit
    def forward_and_back(q, k, v, bias, d_out):
      out, vjp = jax.vjp(lambda *a: jaxflash.flash_attention(*a, implementation="xla"),
                         q, k, v, bias)
      return out, vjp(d_out)

    out, grads = forward_and_back(q, k, v, bias, d_out)
    want = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), bias=bias)
    err = float(jnp.linalg.norm(out.astype(jnp.float32) - want) / jnp.linalg.norm(want))
    finite = all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in (out,) + grads)
    print(jnp.dtype(dtype).name, value, finite, err)
"""


def test_rows_masked_by_a_huge_finite_bias_stay_finite():
  """A mask written as a bias, ``(1 - mask) * -1e10``, hiding every key of some rows: under
  jit XLA CPU computed the logits twice (the row max and exp2's argument), rounded apart by
  an ulp of 1e10, and exp2 overflowed: NaN rows, NaN dK of the whole batch row. Now they are
  jax.nn's rows (at that magnitude every logit of a row rounds alike: the mean of the
  values). Run at XLA's default optimisation level: this suite's -O0 (conftest.py) rounds
  both alike."""
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if "optimization_level" not in f)
  out = subprocess.run([sys.executable, "-c", _HUGE_BIAS_ROWS], capture_output=True,
                       text=True, env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags))
  assert out.returncode == 0, out.stderr
  lines = out.stdout.split("\n")[:-1]
  assert len(lines) == 6, out.stdout
  for line in lines:
    dtype, _, finite, err = line.split()
    assert finite == "True", line
    assert float(err) < (1e-5 if dtype == "float32" else 2e-2), line


@pytest.mark.parametrize("implementation,rule",
                         [("triton", "bias"), ("triton", "score_mod"), ("mosaic", "score_mod")])
def test_rows_hidden_by_a_huge_finite_logit_in_the_kernels(implementation, rule):
  """The same rows through the Pallas kernels (interpreted here), by a bias or a score_mod that
  adds -1e10: their forward took the row max of the logits, and the logits' last multiply
  fused into exp2's argument (one FMA, as NVPTX does too) left the rounding error of a logit
  near -1.4e10 there, up to 512: exp2 overflowed, and the rows and every gradient came out
  NaN (`jaxflash._core.capped_exponent`; Mosaic's backward takes no bias, so it is checked
  through the score_mod). The forward's rows are jax.nn's, the mean of V. The gradients are
  finite, and jax.nn's where those rows' cotangent is zero (padding): an LSE of -1.4e10 has
  lost log(number of keys), so their own P in the backward is not 1/S (docs/api.md,
  Precision)."""
  dtype = jnp.bfloat16 if implementation == "mosaic" else jnp.float32
  q, k, v, d_out = random_qkv(21, 1, 64, 64, 2, 1, 64, dtype)
  hidden = jnp.arange(64) < 3
  bias = jnp.where(hidden[:, None], -1e10, 0.0)[None, None]

  def score_mod(score, b, h, q_idx, kv_idx):
    return jnp.where(q_idx < 3, score - 1e10, score)

  options = dict(bias=bias.astype(dtype)) if rule == "bias" else dict(score_mod=score_mod)

  @jax.jit
  def run(q, k, v, d_out):
    out, vjp = jax.vjp(lambda *a: attention(implementation, *a, **options), q, k, v)
    return (out,) + vjp(d_out)

  def want(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, bias=bias)

  tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-4
  for cotangent in (d_out, jnp.where(hidden[None, :, None, None], 0.0, d_out)):
    cotangent = cotangent.astype(dtype)
    got = run(q, k, v, cotangent)
    out, vjp = jax.vjp(want, *(x.astype(jnp.float32) for x in (q, k, v)))
    expected = (out,) + vjp(cotangent.astype(jnp.float32))
    for g in got:
      assert np.isfinite(np.asarray(g, np.float32)).all()
    assert rel_err(got[0], expected[0]) < tolerance
  for g, w in zip(got[1:], expected[1:]):
    assert rel_err(g, w) < tolerance


@pytest.mark.parametrize("implementation", BACKENDS)
def test_nan_in_query_padding_stays_out_of_the_gradients(implementation):
  """Query rows past ``query_seq_lengths`` are padding: a NaN or Inf there (garbage in a padded
  batch) gives zeros in the forward and zero gradients, and reaches no other row's or key's
  gradient (jax.nn's dK is NaN here; ours was NaN in dQ, dK and dV of the whole batch row)."""
  q, k, v = _qkv(2)
  q_lens = jnp.array([12, 20])
  q_bad = q.at[0, 15, 1, 3].set(jnp.nan).at[0, 17, 0].set(jnp.inf)

  def loss(q, k, v):
    out = attention(implementation, q, k, v, query_seq_lengths=q_lens, is_causal=True)
    return (out * jnp.cos(jnp.arange(T))[None, :, None, None]).sum()

  got = jax.grad(loss, argnums=(0, 1, 2))(q_bad, k, v)
  want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want):
    assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  assert not np.asarray(got[0])[0, 12:].any()


# ---------------------------------------------------------------------------------------------
# Windows, x64, rank promotion, empty batches


@pytest.mark.parametrize("implementation", BACKENDS)
@pytest.mark.parametrize("window,is_causal", [((0, 2**31 - 1), False), (2**31 - 1, True)])
def test_huge_windows_mean_unbounded(implementation, window, is_causal):
  q, k, v = _qkv(1)
  got = attention(implementation, q, k, v, local_window_size=window, is_causal=is_causal)
  left, right = (window, window) if isinstance(window, int) else window
  want, _ = reference_attention(q, k, v, is_causal=is_causal,
                                local_window_size=(min(left, 10**6), min(right, 10**6)))
  assert rel_err(got, want) < F32_TOLERANCE


@pytest.mark.parametrize("implementation", BACKENDS)
def test_enable_x64(implementation):
  """With jax_enable_x64 on (int64 indices, 2**31 windows) every option still works."""
  with jax.enable_x64(True):
    q, k, v = _qkv(2)
    kw = dict(is_causal=True, local_window_size=(2**31, 3),
              mask=random_array(3, (B, 1, T, S), "bool"), key_value_seq_lengths=jnp.array([20, 24]),
              segment_ids=(jnp.zeros((B, T), jnp.int64), jnp.zeros((B, S), jnp.int64)))
    bias = random_array(4, (N, T, S), "float").astype(jnp.float32)
    loss = lambda q, bias: jnp.sum(attention(implementation, q, k, v, bias, **kw))  # noqa: E731
    got, grads = jax.value_and_grad(loss, argnums=(0, 1))(q, bias)
    ref = lambda q, bias: jnp.sum(reference_attention(q, k, v, bias, **kw)[0])  # noqa: E731
    want, want_grads = jax.value_and_grad(ref, argnums=(0, 1))(q, bias)
    assert abs(float(got) - float(want)) < 1e-4 * abs(float(want)) + 1e-4
    for g, w in zip(grads, want_grads):
      assert g.dtype == jnp.float32 and rel_err(g, w) < F32_TOLERANCE
    if implementation == "xla":  # the dropout hash is one function for both backends
      out = attention(implementation, q, k, v, dropout_rate=0.2, dropout_rng=jax.random.key(0))
      assert out.dtype == jnp.float32 and np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("implementation", BACKENDS)
def test_strict_rank_and_dtype_promotion(implementation):
  """jax_numpy_rank_promotion="raise": nothing inside broadcasts arrays of different ranks;
  jax_numpy_dtype_promotion="strict": nothing mixes dtypes implicitly (the XLA backend compared
  the boolean mask with 0, an error there, and so were Flax's modules with a mask)."""
  q, k, v = _qkv(3)
  kw = dict(is_causal=True, mask=jnp.ones((B, 1, T, S), bool), bias=jnp.zeros((T, S)),
            key_value_seq_lengths=jnp.array([20, 24]), dropout_rate=0.1,
            dropout_rng=jax.random.key(1), segment_ids=(jnp.zeros((B, T), jnp.int32),
                                                        jnp.zeros((B, S), jnp.int32)))
  with jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"):
    out = attention(implementation, q, k, v, **kw)
    grads = jax.grad(lambda q, k, v: jnp.sum(attention(implementation, q, k, v, **kw)),
                     argnums=(0, 1, 2))(q, k, v)
  assert np.isfinite(np.asarray(out)).all()
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)


# (Triton's case runs on the GPU and with JAXFLASH_ALL_VARIANTS=1: 11 s of a CPU; on a CPU
# test_strict_rank_and_dtype_promotion holds Triton's kernels, and the XLA case the block mask paths.)
@pytest.mark.parametrize("implementation", BACKENDS_TRITON_VARIANT)
def test_strict_rank_promotion_with_block_masks(implementation):
  """The block mask paths under jax_numpy_rank_promotion="raise": a mask_mod closing over
  document ids (its features and tile rule), and a reused `BlockMask` with lengths."""
  q, k, v = _qkv(4)
  docs = jnp.array([[0] * 7 + [1] * (S - 7), [0] * 13 + [1] * (S - 13)], jnp.int32)

  def same_document(b, h, q_idx, kv_idx):
    return jnp.logical_and(docs[b, q_idx] == docs[b, kv_idx], kv_idx <= q_idx)

  with jax.numpy_rank_promotion("raise"):
    block_mask = jaxflash.create_block_mask(same_document, B, 1, T, S, block_size=8)
    for kw in (dict(mask_mod=same_document),
               dict(block_mask=block_mask, key_value_seq_lengths=jnp.array([20, 24]))):
      loss = lambda q, k, v: jnp.sum(attention(implementation, q, k, v, **kw))  # noqa: E731
      grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
      assert all(np.isfinite(np.asarray(g)).all() for g in grads)


class EmptyInputs(chex.TestCase):
  """B = 0, T = 0 or S = 0 give what jax.nn gives, eagerly and under jit: empty arrays where
  there is no batch row or no query row, zeros and an LSE of -inf where there is no key (every
  row sees none); gradients are zeros shaped like the inputs. No kernel runs."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*[
      (f"{implementation}_{name}", implementation, shape) for implementation in BACKENDS
      for name, shape in (("no_batch", (0, T, S)), ("no_queries", (B, 0, S)),
                          ("no_keys", (B, T, 0)), ("neither", (B, 0, 0)))])
  def test_like_jax_nn(self, implementation, shape):
    b, t, s = shape
    q, k, v, _ = random_qkv(4, b, t, s, N, K, H)
    bias = jnp.ones((b, N, t, s))

    def run(attend):
      def loss(q, k, v, bias):
        out, lse = attend(q, k, v, bias)
        return jnp.sum(out), (out, lse)
      grad = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
      return self.variant(lambda *args: grad(*args)[::-1])(q, k, v, bias)

    got = run(lambda *args: attention(implementation, *args, is_causal=True,
                                      return_residual=True))
    want = run(lambda *args: jax.nn.dot_product_attention(*args, is_causal=True,
                                                          return_residual=True))
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    chex.assert_trees_all_close(got, want)  # (zeros, and -inf LSEs where S = 0)


@pytest.mark.parametrize("shape", [(0, T, S), (B, 0, S), (B, T, 0)], ids=str)
def test_empty_calls_with_segments_or_a_mask_mod(shape):
  """B = 0 (or T or S) with segment ids or a mask_mod: B = 0 crashed classifying the segments'
  blocks (a reshape by -1 of nothing) and gave a mask_mod a "batch must be positive" error."""
  b, t, s = shape
  q, k, v, _ = random_qkv(6, b, t, s, N, K, H)
  options = [dict(segment_ids=(jnp.zeros((b, t), jnp.int32), jnp.zeros((b, s), jnp.int32))),
             dict(mask_mod=lambda b_, h, q_idx, kv_idx: q_idx >= kv_idx)]
  for kw in options:
    out, grads = jax.value_and_grad(
        lambda q, k, v: jaxflash.flash_attention(q, k, v, **kw).sum(), argnums=(0, 1, 2))(q, k, v)
    assert out == 0
    chex.assert_trees_all_equal_shapes_and_dtypes(grads, (q, k, v))


# ---------------------------------------------------------------------------------------------
# Arguments


@pytest.mark.parametrize("name", ["is_causal", "broadcast_dropout", "return_residual",
                                  "interpret"])
@pytest.mark.parametrize("value", ["no", 1, None, [True]])
def test_non_bool_flags_are_refused(name, value):
  q, k, v = _qkv(5)
  with pytest.raises(ValueError, match=name):
    jaxflash.flash_attention(q, k, v, **{name: value})


def test_a_traced_flag_says_to_make_it_static():
  """``jax.jit(jaxflash.flash_attention)(q, k, v, is_causal=True)`` traces the flag."""
  q, k, v = _qkv(5)
  with pytest.raises(ValueError, match='is_causal.*static_argnames="is_causal"'):
    jax.jit(jaxflash.flash_attention)(q, k, v, is_causal=True)


def test_numpy_bool_flags_are_accepted():
  q, k, v = _qkv(5)
  got = jaxflash.flash_attention(q, k, v, is_causal=np.bool_(True), implementation="xla")
  want = jaxflash.flash_attention(q, k, v, is_causal=True, implementation="xla")
  np.testing.assert_array_equal(got, want)


class DropIn(chex.TestCase):
  """`jaxflash.dot_product_attention` takes jax.nn's arguments with jax.nn's meanings, eagerly
  and under jit: "xla" and "cudnn" are jax.nn's own implementations, passed to it unchanged."""

  def test_signature_is_jax_nns(self):
    ours = inspect.signature(jaxflash.dot_product_attention).parameters
    theirs = inspect.signature(jax.nn.dot_product_attention).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()]

  @chex.variants(with_jit=True, without_jit=True)
  def test_xla_is_jax_nns_xla(self):
    """implementation="xla" runs jax.nn's XLA attention (no jaxflash backend runs), with every
    argument passed on."""
    q, k, v = _qkv(11)
    mask = random_array(12, (B, 1, T, S), "bool")
    options = dict(scale=0.3, is_causal=True, key_value_seq_lengths=jnp.array([S, 9]),
                   local_window_size=(5, 2), return_residual=True, implementation="xla")
    with mock.patch.object(jaxflash.backends.Backend, "forward", side_effect=AssertionError(
        "a jaxflash backend ran")):
      got = self.variant(lambda *args: jaxflash.dot_product_attention(*args, **options))(
          q, k, v, None, mask)
    want = self.variant(lambda *args: jax.nn.dot_product_attention(*args, **options))(
        q, k, v, None, mask)
    chex.assert_trees_all_equal(got, want)

  @chex.variants(with_jit=True, without_jit=True)
  def test_cudnn_goes_to_jax_nn(self):
    """implementation="cudnn" reaches jax.nn.dot_product_attention with the same arguments
    (a spy stands in for cuDNN, which this machine may not have)."""
    q, k, v = _qkv(13, jnp.bfloat16)
    calls = []

    def spy(*args, **kwargs):
      calls.append(kwargs)
      return jnp.zeros_like(args[0])

    with mock.patch.object(jax.nn, "dot_product_attention", spy):
      out = self.variant(lambda q, k, v: jaxflash.dot_product_attention(
          q, k, v, is_causal=True, implementation="cudnn"))(q, k, v)
    chex.assert_shape(out, q.shape)
    chex.assert_type(out, jnp.bfloat16)
    assert len(calls) == 1 and calls[0]["implementation"] == "cudnn" and calls[0]["is_causal"]

  @chex.variants(with_jit=True, without_jit=True)
  def test_other_implementations_are_jaxflashs(self):
    """None and jaxflash's backend names run `flash_attention`; a sequence may not name jax.nn's
    implementations (it would be ambiguous)."""
    q, k, v = _qkv(14)
    options = dict(is_causal=True, query_seq_lengths=jnp.array([T, 3]))
    got = self.variant(lambda *args: jaxflash.dot_product_attention(*args, **options))(q, k, v)
    want = self.variant(lambda *args: jaxflash.flash_attention(*args, **options))(q, k, v)
    chex.assert_trees_all_equal(got, want)
    def triton(*args):
      return jaxflash.dot_product_attention(*args, implementation="triton")
    if jaxflash.devices.has_nvidia_gpu():  # the Triton backend runs
      chex.assert_shape(self.variant(triton)(q, k, v), q.shape)
    else:  # it needs a GPU (or interpret=True), and says so
      with pytest.raises(backends.UnsupportedCallError, match="triton"):
        self.variant(triton)(q, k, v)
    with pytest.raises(ValueError, match="implementation"):
      self.variant(lambda *args: jaxflash.dot_product_attention(
          *args, implementation=("triton", "xla")))(q, k, v)
    # An unknown name: the message lists what the drop-in takes, jax.nn's 'cudnn' included.
    with pytest.raises(ValueError, match=r"implementation must be None, one of \('cudnn'"):
      self.variant(lambda *args: jaxflash.dot_product_attention(
          *args, implementation="cuDNN"))(q, k, v)


def test_inputs_jax_nn_accepts():
  """NumPy float64 arrays and nested lists are converted as jax.nn converts them (to float32
  with x64 off); what cannot be converted is refused by name."""
  q, k, v = (np.asarray(x, np.float64) for x in _qkv(6))
  got = jaxflash.flash_attention(q, k, v, implementation="xla")
  want = jax.nn.dot_product_attention(q, k, v, implementation="xla")
  assert got.dtype == want.dtype == jnp.float32 and rel_err(got, want) < F32_TOLERANCE
  listed = jaxflash.flash_attention(q.tolist(), k.tolist(), v.tolist(), implementation="xla")
  chex.assert_trees_all_equal(listed, got)
  with pytest.raises(ValueError, match="key"):
    jaxflash.flash_attention(q, "not an array", v)


# (Triton's case is a variant: [xla] holds the LSE's cast (`attention._results`) and its
# cotangent's way into delta (`_core.delta`), the same for every backend, and
# tests/test_bias.py::test_bias_gradient_in_bfloat16[triton] Triton's bfloat16 backward.)
@pytest.mark.parametrize("implementation", BACKENDS_TRITON_VARIANT)
def test_lse_in_the_query_dtype_like_jax_nn(implementation):
  """return_residual's LSE has jax.nn's dtype, so jax.nn-shaped cotangents fit in jax.vjp."""
  q, k, v = _qkv(7, jnp.bfloat16)
  (out, lse), vjp = jax.vjp(lambda q: attention(implementation, q, k, v, return_residual=True),
                            q)
  _, want_lse = jax.nn.dot_product_attention(q, k, v, return_residual=True,
                                             implementation="xla")
  chex.assert_trees_all_equal_shapes_and_dtypes(lse, want_lse)
  chex.assert_type(lse, jnp.bfloat16)
  (dq,) = vjp((jnp.ones_like(out), jnp.ones_like(lse)))
  assert dq.dtype == jnp.bfloat16 and np.isfinite(np.asarray(dq, np.float32)).all()


# (Triton's case is a variant: [xla] holds the refusal, made by `ops.flash`'s custom_jvp rules
# around every backend's forward and backward.)
@pytest.mark.parametrize("implementation", BACKENDS_TRITON_VARIANT)
def test_second_order_is_refused_clearly(implementation):
  q, k, v = _qkv(8)
  f = lambda q: jnp.sum(attention(implementation, q, k, v, is_causal=True))  # noqa: E731
  assert jax.grad(f)(q).shape == q.shape
  with pytest.raises(NotImplementedError, match="first derivatives only"):
    jax.grad(lambda q: jnp.sum(jax.grad(f)(q) ** 2))(q)
  with pytest.raises(NotImplementedError, match="first derivatives only"):
    jax.jvp(jax.grad(f), (q,), (q,))


# ---------------------------------------------------------------------------------------------
# The Flax layer


@pytest.mark.parametrize("hook", ["linen", "nnx"])
@pytest.mark.parametrize("q_batch,kv_batch", [((2, 3), (3, 2)), ((2,), (3,))])
def test_flax_hooks_refuse_mismatched_batch_dims(hook, q_batch, kv_batch):
  import jaxflash.linen
  import jaxflash.nnx
  fn = {"linen": jaxflash.linen, "nnx": jaxflash.nnx}[hook].dot_product_attention
  q = jnp.ones(q_batch + (T, N, H))
  kv = jnp.ones(kv_batch + (S, N, H))
  with pytest.raises(ValueError, match="same batch dims"):
    fn(q, kv, kv)


@pytest.mark.parametrize("module", ["jaxflash.linen", "jaxflash.nnx"])
def test_flax_layer_without_flax_says_what_to_install(module):
  code = (f"import sys; sys.modules['flax'] = None\n"
          f"try:\n  import {module}\nexcept ModuleNotFoundError as e:\n  print(e)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  # An install command that works where jaxflash is installed from (a clone of its repository).
  assert 'pip install -e ".[flax]"' in out.stdout, out.stdout + out.stderr
  # The core package itself needs no Flax.
  core = subprocess.run([sys.executable, "-c", "import sys; sys.modules['flax'] = None; "
                         "import jaxflash; print('ok')"], capture_output=True, text=True,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert core.stdout.strip() == "ok", core.stderr


def test_gpt_example_without_the_flax_extra_says_what_to_install():
  """The training example needs Flax and optax: without them (optax here) it stops with the
  extra to install, not a bare ModuleNotFoundError."""
  missing = "optax"
  example = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "gpt.py")
  code = (f"import runpy, sys; sys.modules[{missing!r}] = None; sys.argv = ['gpt.py']\n"
          f"sys.path.insert(0, {os.path.dirname(example)!r})\n"
          f"runpy.run_path({example!r}, run_name='__main__')\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 1, out.stdout + out.stderr
  assert f"missing: {missing}" in out.stderr and 'pip install -e ".[flax]"' in out.stderr, (
      out.stderr)
  assert "Traceback" not in out.stderr


# ---------------------------------------------------------------------------------------------
# Inputs jax.nn takes that a probe of user paths (2026-12-04) found refused or misread


def test_int64_lengths_past_int32_under_x64():
  """Lengths are clipped to [0, S] before anything narrows them: under jax_enable_x64 a length
  of 2**32 + 2 once wrapped to 2 in the cast to int32."""
  with jax.enable_x64(True):
    q, k, v = _qkv(4)
    got = jaxflash.flash_attention(q, k, v, key_value_seq_lengths=jnp.array([2**32 + 2, 7]),
                                   implementation="xla")
    want, _ = reference_attention(q, k, v, key_value_seq_lengths=jnp.array([S, 7]))
  assert rel_err(got, want) < F32_TOLERANCE
  # uint32 lengths from 2**31 on wrapped as well, without x64; a negative int64 stays below 0.
  got = jaxflash.flash_attention(q, k, v, implementation="xla",
                                 query_seq_lengths=jnp.array([2**31, 2**32 - 1], jnp.uint32),
                                 key_value_seq_lengths=jnp.array([3_000_000_000, 7], jnp.uint32))
  assert rel_err(got, want) < F32_TOLERANCE
  with jax.enable_x64(True):
    got = jaxflash.flash_attention(q, k, v, key_value_seq_lengths=jnp.array([S, -2**32 + 5]),
                                   implementation="xla")
  np.testing.assert_array_equal(np.asarray(got[1]), 0.0)  # (a length below 0 sees nothing)


def test_scale_as_a_concrete_array():
  """``scale=1 / jnp.sqrt(d)`` (a concrete 0-d array, which jax.nn takes) is its number; a traced
  one is a ValueError naming scale (the kernels compile the scale in)."""
  q, k, v = _qkv(5)
  got = jaxflash.flash_attention(q, k, v, scale=1 / jnp.sqrt(4.0), implementation="xla")
  want = jax.nn.dot_product_attention(q, k, v, scale=0.5, implementation="xla")
  assert rel_err(got, want) < F32_TOLERANCE
  for integer in (jnp.array(2), np.array(2)):  # (jax.nn takes integer ones too)
    got = jaxflash.flash_attention(q, k, v, scale=integer, implementation="xla")
    want = jax.nn.dot_product_attention(q, k, v, scale=2.0, implementation="xla")
    assert rel_err(got, want) < F32_TOLERANCE
  with pytest.raises(ValueError, match="scale must be a number known.*multiply query by it"):
    jax.jit(lambda s: jaxflash.flash_attention(q, k, v, scale=s, implementation="xla"))(0.5)
  # The same for the soft cap: a concrete array is its number, a traced one says what to do.
  got = jaxflash.flash_attention(q, k, v, logits_soft_cap=jnp.float32(3.0), implementation="xla")
  want = jaxflash.flash_attention(q, k, v, logits_soft_cap=3.0, implementation="xla")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ValueError, match="logits_soft_cap must be a number known.*score_mod"):
    jax.grad(lambda c: jnp.sum(jaxflash.flash_attention(q, k, v, logits_soft_cap=c,
                                                        implementation="xla")))(3.0)


def test_a_float64_bias_under_x64():
  """Under jax_enable_x64 a bias made from Python floats (``jnp.where(mask, 0.0, -1e9)``) is
  float64: jax.nn takes it, and so does jaxflash (as float32; it was refused); its gradient
  is float64 like the bias."""
  q, k, v = _qkv(6)
  with jax.enable_x64(True):
    bias = jnp.where(jnp.arange(T)[:, None] >= jnp.arange(S), 0.0, -1e9)
    assert bias.dtype == jnp.float64
    got = jaxflash.flash_attention(q, k, v, bias=bias, implementation="xla")
    want = jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="xla")
    assert got.dtype == jnp.float32 and rel_err(got, want) < F32_TOLERANCE
    grad = jax.grad(lambda b: jnp.sum(jaxflash.flash_attention(q, k, v, bias=b,
                                                               implementation="xla")))(bias)
    assert grad.dtype == jnp.float64 and np.isfinite(np.asarray(grad)).all()


@pytest.mark.parametrize("which", ["mask", "bias"])
def test_unbatched_inputs_take_a_rank_4_mask_or_bias_of_one_batch_row(which):
  """jax.nn gives unbatched [T, N, H] inputs a batch axis, so a [1, N or 1, T, S] mask or bias
  fits them there; it does here too."""
  q, k, v = (x[0] for x in _qkv(6))
  extra = (dict(mask=random_array(7, (1, 1, T, S), "bool")) if which == "mask" else
           dict(bias=random_array(8, (1, N, T, S), "float")))
  got = jaxflash.flash_attention(q, k, v, implementation="xla", **extra)
  want = jax.nn.dot_product_attention(q, k, v, implementation="xla", **extra)
  assert got.shape == (T, N, H) and rel_err(got, want) < F32_TOLERANCE


def test_export_with_a_symbolic_batch_and_a_mask_mod():
  """jax.export of a call with a mask_mod at a symbolic batch size: a mask the same for every
  row exports (its table's batch axis is 1) and runs at any batch; one that reads the batch
  index is a ValueError naming mask_mod. (Both were "batch must be a positive int".) A symbolic
  sequence length is a ValueError saying so (it was an inconclusive comparison deep inside)."""
  from jax import export
  b, = export.symbolic_shape("b")
  spec = jax.ShapeDtypeStruct((b, T, N, H), jnp.float32)
  causal = lambda b_, h, i, j: i >= j  # noqa: E731
  exported = export.export(jax.jit(lambda q: jaxflash.flash_attention(
      q, q, q, mask_mod=causal, implementation="xla")))(spec)
  q = jax.random.normal(jax.random.key(9), (3, T, N, H))
  want, _ = reference_attention(q, q, q, is_causal=True)
  assert rel_err(exported.call(q), want) < F32_TOLERANCE
  with pytest.raises(ValueError, match="mask_mod reads the batch index"):
    export.export(jax.jit(lambda q: jaxflash.flash_attention(
        q, q, q, mask_mod=lambda b_, h, i, j: i >= j + b_, implementation="xla")))(spec)
  t, = export.symbolic_shape("t")
  with pytest.raises(ValueError, match="query's sequence length must be known"):
    export.export(jax.jit(lambda q: jaxflash.dot_product_attention(q, q, q, is_causal=True)))(
        jax.ShapeDtypeStruct((2, t, N, H), jnp.float32))
