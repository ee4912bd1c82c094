"""Argument checks of `jaxflash.flash_attention`.

Bad input must fail with a `ValueError` naming the offending argument, before any backend is
called, both eagerly and under `jax.jit`; good input in the accepted alternative forms
(unbatched arrays, broadcastable masks) must go through.
"""

from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxflash
from jaxflash import backends

B, T, S, N, K, H = 2, 8, 12, 4, 2, 8


def _arrays(b=B, t=T, s=S, n=N, k=K, h=H, dtype=jnp.float32, seed=0):
  """Random query/key/value ([B, ...] or unbatched with b=None), drawn with numpy (no compile)."""
  rng = np.random.default_rng(seed)
  batch = () if b is None else (b,)
  return tuple(jnp.asarray(rng.standard_normal(batch + shape), dtype)
               for shape in ((t, n, h), (s, k, h), (s, k, h)))


def _bernoulli(seed, p, shape):
  return jnp.asarray(np.random.default_rng(seed).random(shape) < p)


@pytest.fixture
def no_kernels(monkeypatch):
  """Makes every backend fail loudly, so a check that passes must have raised before them."""

  def forbidden(*args, **kwargs):
    raise AssertionError("a backend ran although the arguments are invalid")

  monkeypatch.setattr(backends.Backend, "forward", forbidden)
  monkeypatch.setattr(backends.Backend, "backward", forbidden)


def _call(q=None, k=None, v=None, **kwargs):
  dq, dk, dv = _arrays()
  q = dq if q is None else q
  k = dk if k is None else k
  v = dv if v is None else v
  return jaxflash.flash_attention(q, k, v, **kwargs)


def _xla(q, k, v, **options):
  """The XLA backend, jitted over q/k/v with the options closed over (jitting is much faster
  than the backend's eager op-by-op dispatch)."""
  return jax.jit(lambda q, k, v: jaxflash.flash_attention(q, k, v, implementation="xla",
                                                          **options))(q, k, v)


def _f32(*shape):
  return jnp.zeros(shape, jnp.float32)


# ---------------------------------------------------------------------------------------------
# query / key / value

QKV_CASES = {
    "query_rank2": (dict(q=_f32(T, N * H)), "query"),
    "query_rank5": (dict(q=_f32(B, 1, T, N, H)), "query"),
    "key_rank3": (dict(k=_f32(S, K, H), v=_f32(S, K, H)), "key"),
    "value_rank3": (dict(v=_f32(S, K, H)), "value"),
    "query_int": (dict(q=jnp.zeros((B, T, N, H), jnp.int32)), "query"),
    "key_int": (dict(k=jnp.zeros((B, S, K, H), jnp.int32)), "key"),
    "mixed_dtypes": (dict(k=jnp.zeros((B, S, K, H), jnp.bfloat16)), "key"),
    "value_dtype": (dict(v=jnp.zeros((B, S, K, H), jnp.float16)), "value"),
    "key_value_shape": (dict(v=_f32(B, S + 1, K, H)), "value"),
    "batch_mismatch": (dict(k=_f32(B + 1, S, K, H), v=_f32(B + 1, S, K, H)), "batch"),
    "head_dim_mismatch": (dict(k=_f32(B, S, K, H + 1), v=_f32(B, S, K, H + 1)), "head dim"),
    "heads_not_divisible": (dict(q=_f32(B, T, 6, H), k=_f32(B, S, 4, H), v=_f32(B, S, 4, H)),
                            "heads"),
    "query_not_array": (dict(q=object()), "query"),
    "query_ragged_list": (dict(q=[[1.0, 2.0], [3.0]]), "query"),
    "key_zero_heads": (dict(k=_f32(B, S, 0, H), v=_f32(B, S, 0, H)), "head counts"),
}


@pytest.mark.parametrize("case", sorted(QKV_CASES))
def test_bad_qkv(case, no_kernels):
  """Rank, dtype and shape mismatches of query/key/value are rejected by name."""
  arrays, name = QKV_CASES[case]
  with pytest.raises(ValueError, match=name):
    _call(**arrays)


def test_heads_not_divisible_names_both_counts(no_kernels):
  """The GQA error says which head counts disagree (6 query heads, 4 key/value heads)."""
  with pytest.raises(ValueError, match=r"query heads \(6\).*key/value heads \(4\)"):
    _call(q=_f32(B, T, 6, H), k=_f32(B, S, 4, H), v=_f32(B, S, 4, H))


# ---------------------------------------------------------------------------------------------
# The other arguments, one bad value each (query/key/value are the valid defaults above).

OPTION_CASES = {
    "window_negative_int": (dict(local_window_size=-1), "local_window_size"),
    "window_negative_left": (dict(local_window_size=(-1, 2)), "local_window_size"),
    "window_negative_right": (dict(local_window_size=(2, -3)), "local_window_size"),
    "window_float": (dict(local_window_size=1.5), "local_window_size"),
    "window_triple": (dict(local_window_size=(1, 2, 3)), "local_window_size"),
    "window_float_pair": (dict(local_window_size=(1.0, 2)), "local_window_size"),
    "window_bool": (dict(local_window_size=True), "local_window_size"),
    "mask_float": (dict(mask=jnp.ones((B, N, T, S), jnp.float32)), "mask"),
    "mask_int": (dict(mask=jnp.ones((B, N, T, S), jnp.int32)), "mask"),
    "mask_bad_t": (dict(mask=jnp.ones((T + 1, S), bool)), "mask"),
    "mask_bad_heads": (dict(mask=jnp.ones((B, 3, T, S), bool)), "mask"),
    "mask_bad_batch": (dict(mask=jnp.ones((B + 1, 1, T, S), bool)), "mask"),
    "mask_rank5": (dict(mask=jnp.ones((1, B, N, T, S), bool)), "mask"),
    "bias_int": (dict(bias=jnp.zeros((B, N, T, S), jnp.int32)), "bias"),
    "bias_bool": (dict(bias=jnp.zeros((B, N, T, S), bool)), "bias"),
    "bias_bad_s": (dict(bias=_f32(B, N, T, S - 1)), "bias"),
    "bias_bad_heads": (dict(bias=_f32(1, N + 1, T, S)), "bias"),
    "q_lengths_float": (dict(query_seq_lengths=jnp.full((B,), 3.0)), "query_seq_lengths"),
    "q_lengths_shape": (dict(query_seq_lengths=jnp.full((B, 1), 3)), "query_seq_lengths"),
    "q_lengths_scalar": (dict(query_seq_lengths=jnp.int32(3)), "query_seq_lengths"),
    "kv_lengths_shape": (dict(key_value_seq_lengths=jnp.full((B + 1,), 3)),
                         "key_value_seq_lengths"),
    "kv_lengths_float": (dict(key_value_seq_lengths=jnp.full((B,), 3.0)),
                         "key_value_seq_lengths"),
    "segments_shape": (dict(segment_ids=(jnp.zeros((B, T + 1), jnp.int32),
                                         jnp.zeros((B, S), jnp.int32))), "segment_ids"),
    "segments_kv_shape": (dict(segment_ids=(jnp.zeros((B, T), jnp.int32),
                                            jnp.zeros((B, T), jnp.int32))), "segment_ids"),
    "segments_float": (dict(segment_ids=(jnp.zeros((B, T), jnp.float32),
                                         jnp.zeros((B, S), jnp.int32))), "segment_ids"),
    "segments_single_cross": (dict(segment_ids=jnp.zeros((B, T), jnp.int32)), "segment_ids"),
    "segments_triple": (dict(segment_ids=(jnp.zeros((B, T), jnp.int32),) * 3), "segment_ids"),
    "dropout_negative": (dict(dropout_rate=-0.1), "dropout_rate"),
    "dropout_one": (dict(dropout_rate=1.0), "dropout_rate"),
    "dropout_nan": (dict(dropout_rate=float("nan")), "dropout_rate"),
    "dropout_no_rng": (dict(dropout_rate=0.1), "dropout_rng"),
    "dropout_rate_array": (dict(dropout_rate=jnp.array([0.1]),
                                dropout_rng=jax.random.key(0)), "dropout_rate"),
    "dropout_rng_float": (dict(dropout_rate=0.1, dropout_rng=jnp.zeros((2,))), "dropout_rng"),
    "dropout_rng_batched": (dict(dropout_rate=0.1, dropout_rng=jax.random.split(
        jax.random.key(0), 3)), "dropout_rng"),
    "dropout_rng_int": (dict(dropout_rate=0.1, dropout_rng=3), "dropout_rng"),
    "soft_cap_zero": (dict(logits_soft_cap=0.0), "logits_soft_cap"),
    "soft_cap_negative": (dict(logits_soft_cap=-5.0), "logits_soft_cap"),
    "soft_cap_inf": (dict(logits_soft_cap=float("inf")), "logits_soft_cap"),
    "scale_nan": (dict(scale=float("nan")), "scale"),
    "scale_inf": (dict(scale=float("inf")), "scale"),
    "scale_string": (dict(scale="0.5"), "scale"),
    "scale_bool": (dict(scale=True), "scale"),
    "soft_cap_bool": (dict(logits_soft_cap=True), "logits_soft_cap"),
    "causal_window_negative": (dict(is_causal=True, local_window_size=(-2, 0)),
                               "local_window_size"),
    "implementation_cuda": (dict(implementation="cuda"), "implementation"),
    "deterministic_string": (dict(deterministic="no"), "deterministic"),
    "deterministic_none": (dict(deterministic=None), "deterministic"),
}


@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_bad_option(case, no_kernels):
  """Each bad option value raises a ValueError naming the option."""
  kwargs, name = OPTION_CASES[case]
  with pytest.raises(ValueError, match=name):
    _call(**kwargs)


@pytest.mark.parametrize("case", ["query_rank5", "mixed_dtypes", "heads_not_divisible",
                                  "key_value_shape"])
def test_bad_qkv_under_jit(case, no_kernels):
  """Shape/dtype errors also fire while tracing under jit (the check only needs avals)."""
  arrays, name = QKV_CASES[case]
  dq, dk, dv = _arrays()
  q, k, v = arrays.get("q", dq), arrays.get("k", dk), arrays.get("v", dv)
  with pytest.raises(ValueError, match=name):
    jax.jit(lambda q, k, v: jaxflash.flash_attention(q, k, v))(q, k, v)


@pytest.mark.parametrize("case", ["mask_bad_t", "mask_float", "bias_int", "q_lengths_float",
                                  "kv_lengths_shape", "segments_single_cross", "window_triple",
                                  "soft_cap_zero", "scale_nan", "dropout_one"])
def test_bad_option_under_jit(case, no_kernels):
  """Option errors fire under jit too, with the arrays traced and the bad value closed over."""
  kwargs, name = OPTION_CASES[case]
  traced = ("mask", "bias", "query_seq_lengths", "key_value_seq_lengths", "segment_ids")
  arrays = {k: v for k, v in kwargs.items() if k in traced}
  static = {k: v for k, v in kwargs.items() if k not in traced}

  @jax.jit
  def f(q, k, v, arrays):
    return jaxflash.flash_attention(q, k, v, **arrays, **static)

  with pytest.raises(ValueError, match=name):
    f(*_arrays(), arrays)


def test_dropout_accepts_typed_and_raw_keys():
  q, k, v = _arrays()
  typed = _xla(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(3))
  raw = _xla(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.PRNGKey(3))
  np.testing.assert_array_equal(typed, raw)
  # Under the rbg generators (TPU users' setting) a raw key is uint32[4]; it was refused.
  with jax.default_prng_impl("rbg"):
    raw = jax.random.PRNGKey(3)
    assert raw.shape == (4,)
    np.testing.assert_array_equal(
        _xla(q, k, v, dropout_rate=0.5, dropout_rng=raw),
        _xla(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.wrap_key_data(raw)))
  with pytest.raises(ValueError, match="dropout_rng"):
    _xla(q, k, v, dropout_rate=0.5, dropout_rng=jnp.zeros(3, jnp.uint32))


def test_dropout_rate_may_be_a_concrete_scalar_array():
  """As ``scale`` may (jax.nn's and Flax's code computes such numbers with jnp)."""
  q, k, v = _arrays()
  key = jax.random.key(3)
  np.testing.assert_array_equal(_xla(q, k, v, dropout_rate=jnp.float32(0.25), dropout_rng=key),
                                _xla(q, k, v, dropout_rate=0.25, dropout_rng=key))
  with pytest.raises(ValueError, match="dropout_rate.*Python float"):
    jax.jit(lambda rate: _xla(q, k, v, dropout_rate=rate, dropout_rng=key))(0.25)


def test_zero_dropout_with_rng_is_fine():
  """dropout_rate=0 with an rng is a no-op request and is accepted."""
  q, k, v = _arrays()
  got = _xla(q, k, v, dropout_rate=0.0, dropout_rng=jax.random.key(0))
  want = _xla(q, k, v)
  np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# Unbatched (rank-3) inputs

UNBATCHED_CASES = {
    "key_rank4": (dict(k=_f32(1, S, K, H)), "key"),
    "value_shape": (dict(v=_f32(S + 1, K, H)), "value"),
    "heads_not_divisible": (dict(q=_f32(T, 3, H)), "heads"),
    "head_dim": (dict(q=_f32(T, N, H + 2)), "head dim"),
    # (A [1, ...] rank-4 mask fits unbatched inputs, as in jax.nn: test_user_paths.py.)
    "mask_rank4": (dict(mask=jnp.ones((2, 1, T, S), bool)), "mask"),
    "mask_bad_heads": (dict(mask=jnp.ones((3, T, S), bool)), "mask"),
    "bias_bad_t": (dict(bias=_f32(N, 2, S)), "bias"),
    "q_lengths_shape": (dict(query_seq_lengths=jnp.full((2,), 3)), "query_seq_lengths"),
    "kv_lengths_float": (dict(key_value_seq_lengths=jnp.float32(3)), "key_value_seq_lengths"),
    "segments_batched": (dict(segment_ids=(jnp.zeros((1, T), jnp.int32),
                                           jnp.zeros((1, S), jnp.int32))), "segment_ids"),
    "segments_single_cross": (dict(segment_ids=jnp.zeros((T,), jnp.int32)), "segment_ids"),
}


class BadUnbatched(chex.TestCase):
  """Unbatched [T, N, H] calls get the same checks, against [N, T, S]-style targets, eagerly
  and under jit (query, key and value traced there), before any backend runs."""

  def setUp(self):
    super().setUp()
    for name in ("forward", "backward"):
      self.enter_context(mock.patch.object(backends.Backend, name, side_effect=AssertionError(
          "a backend ran although the arguments are invalid")))

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*((case, case) for case in sorted(UNBATCHED_CASES)))
  def test_bad_unbatched(self, case):
    kwargs, name = UNBATCHED_CASES[case]
    kwargs = dict(kwargs)  # popped below; the table is shared by the variants
    q, k, v = _arrays(b=None)
    q, k, v = kwargs.pop("q", q), kwargs.pop("k", k), kwargs.pop("v", v)
    with pytest.raises(ValueError, match=name):
      self.variant(lambda q, k, v: jaxflash.flash_attention(q, k, v, **kwargs))(q, k, v)


# ---------------------------------------------------------------------------------------------
# Accepted forms


@pytest.mark.parametrize("options", [
    {},
    dict(is_causal=True),
    dict(local_window_size=(2, 1), key_value_seq_lengths=jnp.int32(9)),
    dict(segment_ids=(jnp.array([0] * 5 + [1] * 3, jnp.int32),
                      jnp.array([0] * 4 + [1] * 8, jnp.int32))),
    dict(mask=_bernoulli(3, 0.7, (N, T, S)),
         bias=jnp.asarray(np.random.default_rng(4).standard_normal((1, T, S)), jnp.float32)),
], ids=["plain", "causal", "window_lengths", "segments", "mask_bias"])
def test_unbatched_matches_batched(options):
  """An unbatched call equals the batched call on the same data with the batch axis squeezed."""
  q, k, v = _arrays(b=None, seed=1)
  batched = {}
  for name, val in options.items():
    if name in ("query_seq_lengths", "key_value_seq_lengths"):
      val = jnp.reshape(val, (1,))
    elif name == "segment_ids":
      val = tuple(x[None] for x in val)
    elif name in ("mask", "bias"):
      val = val[None]
    batched[name] = val
  out, lse = _xla(q, k, v, return_residual=True, **options)
  want_out, want_lse = _xla(q[None], k[None], v[None], return_residual=True, **batched)
  chex.assert_trees_all_equal_shapes_and_dtypes(out, q)
  chex.assert_shape(lse, (T, N))
  chex.assert_trees_all_close((out, lse), (want_out[0], want_lse[0]), rtol=1e-6, atol=1e-6)


@jax.jit
def _dense_reference(q, k, v, mask):
  out, _ = jaxflash.reference_attention(q, k, v, mask=jnp.broadcast_to(mask, (B, N, T, S)))
  return out


@pytest.mark.parametrize("shape", [(T, S), (1, 1, T, S), (B, 1, 1, S), (N, T, S), (B, N, T, S),
                                   (1, S), ()])
def test_broadcastable_mask_accepted(shape):
  """Masks that broadcast to [B, N, T, S] are accepted and mean the broadcast mask."""
  q, k, v = _arrays(seed=2)
  mask = _bernoulli(5, 0.6, shape)
  got = _xla(q, k, v, mask=mask)
  assert got.shape == q.shape
  np.testing.assert_allclose(got, _dense_reference(q, k, v, mask), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("shape", [(T, S), (1, 1, T, S), (B, 1, 1, S)])
def test_broadcastable_mask_accepted_under_jit(shape):
  """The same mask shapes go through when the mask is a traced argument."""
  q, k, v = _arrays(seed=2)
  mask = _bernoulli(6, 0.6, shape)
  f = jax.jit(lambda q, k, v, m: jaxflash.flash_attention(q, k, v, mask=m, implementation="xla"))
  np.testing.assert_allclose(f(q, k, v, mask), _dense_reference(q, k, v, mask), rtol=2e-5,
                             atol=2e-5)
