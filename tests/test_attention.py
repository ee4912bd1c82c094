"""Both backends against the float32 reference: every option alone and combined, odd shapes,
dtypes, empty rows, huge logits, jit/grad/vmap. The Triton kernels run in interpret mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash.reference import reference_attention
from checks import (BACKENDS, BACKENDS_TRITON_VARIANT, F32_TOLERANCE, ON_GPU, OPTIONS, attention,
                    TOLERANCE, check, random_array, random_qkv, rel_err, variant_if)

# The options that "everything" holds, on both backends (each alone runs on the GPU and with
# JAXFLASH_ALL_VARIANTS=1): Triton's interpreter costs CI 2-4 s a case, the XLA backend 1.6-3.5
# (2026-12-04). XLA's cases of them are held by test_option[xla-everything] as Triton's are by
# test_option[triton-everything] (and by test_bias.py's cases: bias, causal, soft cap, lengths,
# dropout).
HELD_BY_EVERYTHING = ("causal", "causal_window", "segments_pair", "bias_full", "dropout",
                      "soft_cap", "scale", "sinks")
# Other cases whose path another CPU case holds (the GPU runs them, and a CPU with
# JAXFLASH_ALL_VARIANTS=1). What stays on a CPU: masks per head (mask_full), broadcast dropout
# (test_dropout.py's Triton cases lean on Triton's), a negative scale, and XLA's cases of a
# window to the right, a key mask, a zero scale and lengths.
HELD_ELSEWHERE = (
    # No option: test_head_dims[triton-40] and [xla-40] (no option, T != S, partial blocks
    # both ways) and every test_odd_shapes case.
    ("triton", "none"), ("xla", "none"),
    # A zero scale takes Triton's non-folded path (tiles.folds_scale: scale > 0), which
    # test_option[triton-scale_negative] holds; test_option[xla-scale_zero] holds the value.
    ("triton", "scale_zero"),
    # A [B, 1, 1, S] mask reaches the kernels as [B, 1, T, S] (_checks._check_dense broadcasts
    # T before any backend), the shape test_option[triton-everything]'s mask has;
    # test_option[xla-mask_keys] holds the broadcast.
    ("triton", "mask_keys"),
    # A window to the right: test_score_mod.py::test_combines_with_everything[triton-
    # mask_mod_window] (window (20, 5), forward and gradients in Triton's kernels).
    ("triton", "window_pair"),
    # Lengths without a block table: test_bias.py's Triton cases (key lengths, no table).
    # Not "everything", whose segment ids give the call a table; XLA's case stays, the only
    # one here that joins the batch rows' block ranges (`schedule._union`: a mutant that
    # intersected them passed this file while it was a variant, 2026-12-05).
    ("triton", "lengths"),
)


@pytest.mark.parametrize("implementation,option", [
    variant_if(option in HELD_BY_EVERYTHING or (name, option) in HELD_ELSEWHERE, name, option,
               id=f"{name}-{option}")
    for name in BACKENDS for option in OPTIONS])
def test_option(implementation, option):
  made = OPTIONS[option](2, 37, 53, 4, 0)
  check(implementation, b=2, t=37, s=53, n=4, k=2, h=40, **made)


# (Variants: causal with T == S is held by test_half_dtypes[float16-triton] and
# test_default_configs[triton-64-True-200-200] (T == S, causal: the diagonal blocks) and by
# test_vmap_and_jit[xla] (T == S = 20, causal, float32); Triton's single segment_ids array by
# [segments_self-xla] (the array is made a pair in _checks._check_segments, before any backend)
# and test_option[triton-everything] (Triton's segment ids).)
@pytest.mark.parametrize("option,implementation", [
    ("segments_self", "xla"), pytest.param("segments_self", "triton", marks=pytest.mark.variants),
    pytest.param("causal", "xla", marks=pytest.mark.variants),
    pytest.param("causal", "triton", marks=pytest.mark.variants)])
def test_self_attention_options(implementation, option):
  """T == S: causal diagonal blocks and a single segment_ids array."""
  extra = (dict(is_causal=True) if option == "causal"
           else dict(segment_ids=random_array(3, (2, 45), 3)))
  check(implementation, b=2, t=45, s=45, n=4, k=4, h=32, **extra)


# The Triton kernels pad the head dim to a power of two (and must mask the padding); the XLA
# backend's einsums take any head dim, so two suffice there. On a CPU Triton runs the padded
# head dims (40, 80, 96) and 256 (unpadded, causal); 64 and 128 (unpadded, causal) are
# variants held by [triton-256], test_large_logits_bfloat16[triton] (float32 gradients at
# D = 64, causal) and test_default_configs[triton-64-*] and [triton-128-True-1100-160].
HEAD_DIM_CASES = ([("triton", h) if h in (40, 80, 96, 256) else
                   pytest.param("triton", h, marks=pytest.mark.variants)
                   for h in (40, 64, 80, 96, 128, 256)]
                  + [("xla", h) for h in (40, 256)])


@pytest.mark.parametrize("implementation,h", HEAD_DIM_CASES)
def test_head_dims(implementation, h):
  check(implementation, b=1, t=33, s=18, n=2, k=1, h=h, is_causal=(h % 64 == 0))


ODD_SHAPES = [(1, 1, 1, 1), (1, 70, 4, 1), (70, 1, 3, 3), (16, 16, 8, 2), (31, 65, 6, 3)]


# (Variant: Triton's 31-65-6-3, T != S past block multiples with GQA 2:1, is held by
# test_head_dims[triton-40] (T = 33, S = 18, GQA 2:1, no option) and test_option[triton-mask_full]
# (T = 37, S = 53, GQA 2:1).)
@pytest.mark.parametrize("t,s,n,k,implementation", [
    variant_if((shape, name) == ((31, 65, 6, 3), "triton"), *shape, name)
    for name in BACKENDS for shape in ODD_SHAPES])
def test_odd_shapes(implementation, t, s, n, k):
  """Lengths below, at and past block multiples; T != S; MHA, GQA and MQA."""
  check(implementation, b=2, t=t, s=s, n=n, k=k, h=24)


# (Variant: bfloat16 on both backends, held by test_default_configs[triton-64-True-200-200] and
# [xla-128-True-1100-160] (bfloat16, causal) and test_large_logits_bfloat16; float16's cases run
# the same 16-bit paths at these shapes.)
@pytest.mark.parametrize("implementation", BACKENDS)
@pytest.mark.parametrize("dtype", [pytest.param(jnp.bfloat16, marks=pytest.mark.variants),
                                   jnp.float16])
def test_half_dtypes(implementation, dtype):
  check(implementation, b=2, t=50, s=50, n=4, k=2, h=64, dtype=dtype, is_causal=True)


# Every row of the Triton tile table; the XLA backend has one default config. Interpret mode
# ignores warps and stages, so on a CPU the rows differ only in their tiles (64 x 64, or
# 128-row forward tiles): D = 128's short causal row (64 x 64 tiles) is a variant held by
# [triton-64-True-200-200] (the same tiles, causal), its non-causal row (128-row forward tiles) one
# held by [triton-128-True-1100-160] (the same tiles) and [triton-64-False-200-200] (non-causal);
# test_backends.py holds the table's choice of row.
DEFAULT_CONFIG_CASES = [("triton",) + case for case in (
    (64, True, 200, 200), (64, False, 200, 200))] + [  # D = 64: one stage backward when causal
    pytest.param("triton", 128, True, 200, 200,  # D = 128 causal, short: 64-row forward tiles
                 marks=pytest.mark.variants),
    ("triton", 128, True, 1100, 160),  # D = 128 causal, T > 1024: 128-row forward tiles
    pytest.param("triton", 128, False, 200, 200, marks=pytest.mark.variants),
    ("xla", 128, True, 1100, 160)]


@pytest.mark.parametrize("implementation,h,is_causal,t,s", DEFAULT_CONFIG_CASES)
def test_default_configs(implementation, h, is_causal, t, s):
  """The shipped tile table (one partial block each way), GQA in bfloat16."""
  check(implementation, b=1, t=t, s=s, n=4, k=2, h=h, dtype=jnp.bfloat16, is_causal=is_causal,
        small=False)


@pytest.mark.parametrize("implementation", BACKENDS)
def test_large_logits_bfloat16(implementation):
  """Logits in the hundreds: the online max must keep exp2 in range, without NaN or overflow.

  bf16: the output and dV (no cancellation) stay at bf16 accuracy. dQ/dK of a near-one-hot
  softmax cancel (dS = P * (dP - delta) with delta from the bf16-rounded O, as in every
  FlashAttention), so bf16 cannot resolve them; they are checked on the same values in float32,
  where the kernel math must hold to float32 accuracy (see README, "Precision").
  """
  q, k, v, d_out = random_qkv(7, 1, 40, 40, 2, 2, 64, jnp.bfloat16, scale=12.0)
  upcast = [x.astype(jnp.float32) for x in (q, k, v)]

  def loss(fn):
    return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * d_out)

  ours = lambda q, k, v: attention(implementation, q, k, v, is_causal=True)  # noqa: E731
  exact = lambda q, k, v: reference_attention(q, k, v, is_causal=True)[0]  # noqa: E731
  assert rel_err(ours(q, k, v), exact(*upcast)) < 2e-2
  want = jax.grad(loss(exact), (0, 1, 2))(*upcast)
  got_bf16 = jax.grad(loss(ours), (0, 1, 2))(q, k, v)
  assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in got_bf16)
  assert rel_err(got_bf16[2], want[2]) < 2e-2
  if ON_GPU:
    # float32 dots run in TF32 on a GPU (both backends, and XLA's own): logits near 1e3 then
    # carry absolute errors near 1, which a near-one-hot softmax's dQ/dK cannot absorb (seen on
    # an H200: 4x the true, tiny, gradient). The kernel math is checked in float32 on the CPU.
    return
  got_f32 = jax.grad(loss(ours), (0, 1, 2))(*upcast)
  for g, w in zip(got_f32, want):
    assert rel_err(g, w) < 1e-2  # ill-conditioned: ~3e-3 seen, from rounding O in float32


@pytest.mark.parametrize("implementation", BACKENDS)
def test_rows_that_see_nothing(implementation):
  """Empty rows give zeros, zero gradients, LSE -inf and never NaN."""
  b, t, s, n, h = 3, 20, 24, 2, 16
  q, k, v, d_out = random_qkv(1, b, t, s, n, n, h)
  q_seg = jnp.array([[1] * 10 + [2] * 10] * b)  # segment 2 has no keys
  kv_seg = jnp.ones((b, s), jnp.int32)
  kw = dict(segment_ids=(q_seg, kv_seg), query_seq_lengths=jnp.array([20, 5, 20]),
            key_value_seq_lengths=jnp.array([24, 24, 0]))

  def loss(q, k, v):
    return jnp.sum(attention(implementation, q, k, v, **kw) * d_out)

  out, lse = attention(implementation, q, k, v, return_residual=True, **kw)
  dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  for x in (out, lse, dq, dk, dv):
    assert not np.isnan(np.asarray(x)).any()
  empty = np.zeros((b, t), bool)
  empty[:, 10:] = True  # segment 2
  empty[1, 5:] = True  # query padding
  empty[2, :] = True  # no keys at all
  np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)
  np.testing.assert_array_equal(np.asarray(dq)[empty], 0.0)
  assert np.all(np.asarray(lse)[empty] == -np.inf)
  assert np.all(np.isfinite(np.asarray(lse)[~empty]))
  np.testing.assert_array_equal(np.asarray(dk)[2], 0.0)
  ref_out, _ = reference_attention(q, k, v, segment_ids=(q_seg, kv_seg),
                                   query_seq_lengths=kw["query_seq_lengths"],
                                   key_value_seq_lengths=kw["key_value_seq_lengths"])
  assert rel_err(out, ref_out) < F32_TOLERANCE


# (Triton's case runs on the GPU and with JAXFLASH_ALL_VARIANTS=1: 7 s of a CPU. The LSE's
# cotangent enters delta in jaxflash/ops/flash.py (`_core.delta`) before any backend, which [xla]
# holds; Triton's kernels read delta as data, with a nonzero LSE cotangent in
# test_sinks.py::test_matches_the_reference_with_gradients[causal_window_lengths-triton].)
@pytest.mark.parametrize("implementation", BACKENDS_TRITON_VARIANT)
def test_gradient_through_lse(implementation):
  """return_residual's LSE is differentiable (its cotangent enters as a delta shift)."""
  q, k, v, d_out = random_qkv(2, 1, 30, 35, 2, 1, 16)
  w = jax.random.normal(jax.random.key(9), (1, 30, 2))
  kw = dict(is_causal=True, key_value_seq_lengths=jnp.array([33]))

  def ours(q, k, v):
    out, lse = attention(implementation, q, k, v, return_residual=True, **kw)
    return jnp.sum(out * d_out) + jnp.sum(lse * w)

  def ref(q, k, v):
    out, lse = reference_attention(q, k, v, **kw)
    return jnp.sum(out * d_out) + jnp.sum(lse * w)

  for g, r in zip(jax.grad(ours, (0, 1, 2))(q, k, v), jax.grad(ref, (0, 1, 2))(q, k, v)):
    assert rel_err(g, r) < F32_TOLERANCE


# (Triton's case runs on the GPU and with JAXFLASH_ALL_VARIANTS=1: 6 s of a CPU. vmap is the
# call primitive's batching rule (ops/partitioning.py, every backend), which test_vmap_and_jit[xla]
# holds; Triton's kernels under vmap and jit, forward and gradients, are held by
# test_value_dim.py::test_jit_and_vmap[triton].)
@pytest.mark.parametrize("implementation", BACKENDS_TRITON_VARIANT)
def test_vmap_and_jit(implementation):
  """vmap over an extra leading axis, and jit(grad) of it, agree with per-slice calls."""
  q, k, v, _ = random_qkv(4, 3, 20, 20, 2, 2, 16)
  fn = lambda q, k, v: attention(  # noqa: E731
      implementation, q[None], k[None], v[None], is_causal=True)[0]
  batched = jax.jit(jax.vmap(fn))(q, k, v)
  single = jax.jit(fn)
  for i in range(3):
    assert rel_err(batched[i], single(q[i], k[i], v[i])) < F32_TOLERANCE
  per_slice = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2)))
  g = jax.jit(jax.grad(lambda q: jnp.sum(jax.vmap(fn)(q, k, v) ** 2)))(q)
  for i in range(3):  # the gradient of a sum over slices is the per-slice gradient
    assert rel_err(g[i], per_slice(q[i], k[i], v[i])) < F32_TOLERANCE


@pytest.mark.parametrize("implementation", BACKENDS_TRITON_VARIANT)
@pytest.mark.parametrize("option", ["none", "lengths"])
def test_jit_of_the_gradient_of_a_scaled_sum(implementation, option):
  """jit(grad) of ``c * out.sum()`` with K and V closed over: the output's cotangent is a
  broadcast scalar, which XLA CPU's YNNPACK fusion took into the XLA backend's dO V^T - delta
  and computed from uninitialised memory (errors of 2 to 7e30 with jax 0.11-0.12, where the
  eager gradient was right); `flash.output_cotangents` hides it from XLA."""
  q, k, v, _ = random_qkv(11, 4, 40, 40, 2, 2, 16)
  kw = dict(key_value_seq_lengths=jnp.array([40, 30, 20, 10])) if option == "lengths" else {}
  loss = lambda q, c: jnp.sum(c * attention(implementation, q, k, v, small=False, **kw))  # noqa: E731
  got = jax.jit(jax.grad(loss))(q, 1.0)
  want = jax.grad(lambda q: jnp.sum(reference_attention(q, k, v, **kw)[0]))(q)
  assert rel_err(got, want) < F32_TOLERANCE


def test_backends_agree_with_jax_nn():
  """Our reference (and hence both backends) means what jax.nn.dot_product_attention means."""
  b, t, s, n, k, h = 2, 24, 40, 4, 2, 16
  q, kk, v, _ = random_qkv(5, b, t, s, n, k, h)
  cases = [dict(is_causal=True), dict(local_window_size=(3, 5)),
           dict(key_value_seq_lengths=jnp.array([17, 40])),
           dict(mask=random_array(5, (b, 1, t, s), "bool")),
           dict(bias=random_array(6, (1, n, t, s), "float"), scale=0.5)]
  # A padding bias of -1e9 on whole rows (the reference once normalised by its LSE, which at
  # that magnitude loses log S in float32: such a row's probabilities summed to S).
  padded_rows = jnp.zeros((t, s)).at[3:6].set(-1e9)
  cases.append(dict(bias=padded_rows, is_causal=True))
  for kw in cases:
    want = jax.nn.dot_product_attention(q, kk, v, implementation="xla", **kw)
    got = jaxflash.flash_attention(q, kk, v, implementation="xla", **kw)
    ref, _ = reference_attention(q, kk, v, **kw)
    assert rel_err(ref, want) < F32_TOLERANCE, kw
    assert rel_err(got, want) < F32_TOLERANCE, kw
    # Strict rank promotion and windows of 2**31 - 1 (unbounded) in the reference too.
    with jax.numpy_rank_promotion("raise"):
      again, _ = reference_attention(q, kk, v, **kw)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(ref))
  unbounded, _ = reference_attention(q, kk, v, local_window_size=2**31 - 1, is_causal=True)
  assert rel_err(unbounded, reference_attention(q, kk, v, is_causal=True)[0]) < F32_TOLERANCE
  # Padded query rows: jax.nn leaves them undefined-but-finite; we return zeros. Compare the rest.
  kw = dict(query_seq_lengths=jnp.array([10, 24]))
  want = jax.nn.dot_product_attention(q, kk, v, implementation="xla", **kw)
  got = jaxflash.flash_attention(q, kk, v, implementation="xla", **kw)
  assert rel_err(got[0, :10], want[0, :10]) < F32_TOLERANCE
  assert rel_err(got[1], want[1]) < F32_TOLERANCE
  np.testing.assert_array_equal(np.asarray(got[0, 10:]), 0.0)


@pytest.mark.parametrize("implementation", ["xla", "triton", "mosaic"])
def test_float16_gradients_where_ds_passes_its_range(implementation):
  """A large loss scale in float16: dS = P (dP - delta) reaches 9e4, past float16's 65504,
  while scale * dS K stays near 400. dS is scaled before its 16-bit cast, so dQ and dK are
  finite and right (they were all inf)."""
  rng = np.random.default_rng(2)
  shapes = dict(q=(1, 16, 1, 64), k=(1, 4, 1, 64), v=(1, 4, 1, 64), do=(1, 16, 1, 64))
  factors = dict(q=0.01, k=0.01, v=60.0, do=300.0)
  q, k, v, do = (jnp.asarray(rng.standard_normal(shapes[n]) * factors[n], jnp.float16)
                 for n in ("q", "k", "v", "do"))
  _, vjp = jax.vjp(lambda q, k, v: attention(implementation, q, k, v), q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  _, want_vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v)[0], *f32)
  for got, want in zip(vjp(do), want_vjp(do.astype(jnp.float32))):
    assert np.isfinite(np.asarray(got, np.float32)).all()
    assert rel_err(got, want) < TOLERANCE[jnp.float16]
