"""Attention sinks (``sinks=``): one logit per query head in every softmax denominator.

Output, LSE and the gradients of query, key, value *and the sinks* against the float32 dense
reference (which appends the sink as one more logit column with a zero value row), on every
backend, on the paths that merge partial results (split keys, split-KV decoding, a paged
cache, the ring), sharded, in a user's `shard_map`, and through the Flax modules. The forward of
every option with sinks is also in the option tables (`checks.OPTIONS["sinks"]` and
``"everything"``).
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxflash
from jaxflash.ops import partial
from jaxflash.reference import reference_attention
from checks import (F32_TOLERANCE, ON_GPU, TOLERANCE, attention, config_for, interpret_for,
                    random_array, random_qkv, rel_err)

BF16 = jnp.bfloat16
# Mosaic's interpreter takes ~10 s a call on a CPU: one case there, all of them on a GPU.
BACKENDS = ("xla", "triton", "mosaic")


def _sinks(n: int, seed: int = 0, scale: float = 2.0) -> jax.Array:
  return scale * random_array(seed, (n,), "float")


def _grads(fn, q, k, v, sinks, d_out):
  """(out, lse, dq, dk, dv, d_sinks) of ``fn(q, k, v, sinks) -> (out, lse)`` for the cotangent
  ``d_out`` of the output and a random one of the LSE (so d_lse reaches the sinks too)."""
  (out, lse), vjp = jax.vjp(fn, q, k, v, sinks)
  d_lse = jnp.where(jnp.isfinite(lse), 0.5, 0.0).astype(lse.dtype)
  return (out, lse) + vjp((d_out.astype(out.dtype), d_lse))


def _compare(got, want, tol):
  out, lse = got[:2]
  empty = ~np.isfinite(np.asarray(want[1]))
  np.testing.assert_array_equal(np.asarray(lse) == -np.inf, empty, "rows with no visible key")
  np.testing.assert_array_equal(np.asarray(out, np.float32)[empty], 0.0)
  errors = {"out": rel_err(out, want[0]),
            "lse": rel_err(np.where(empty, 0.0, lse), np.where(empty, 0.0, want[1]))}
  for name, g, w in zip(("dq", "dk", "dv", "d_sinks"), got[2:], want[2:]):
    errors[name] = rel_err(g, w)
  bad = {name: e for name, e in errors.items() if not e <= tol}
  assert not bad, f"errors above {tol}: {bad} (all: {errors})"


def _reference(q, k, v, sinks, **options):
  up = lambda x: x.astype(jnp.float32)  # noqa: E731
  return reference_attention(up(q), up(k), up(v), sinks=sinks, **options)


CASES = {
    # GQA, a window under the causal band, ragged lengths (a row past q_len sees nothing).
    "causal_window_lengths": dict(is_causal=True, local_window_size=(9, 0),
                                  query_seq_lengths=jnp.array([37, 20]),
                                  key_value_seq_lengths=jnp.array([53, 11])),
    "soft_cap_bias": dict(logits_soft_cap=2.0, bias="bias"),
    "segments": dict(segment_ids=(random_array(3, (2, 37), 3), random_array(4, (2, 53), 3))),
}


# ("soft_cap_bias" and "segments" are variants: test_attention.py::test_option[xla-everything]
# and [triton-everything] hold sinks with a soft cap, a bias and segments, forward and the
# gradients of query, key, value and bias; "causal_window_lengths" here the sinks' own gradient,
# which `_core.sink_gradient` makes from the final LSE and delta whatever the options.)
@pytest.mark.parametrize("implementation", BACKENDS)
@pytest.mark.parametrize("case", [
    case if case == "causal_window_lengths" else pytest.param(case, marks=pytest.mark.variants)
    for case in CASES])
def test_matches_the_reference_with_gradients(implementation, case):
  """T != S, lengths not divisible by the block, head dim 40 (80 for Mosaic's 16-bit tiles)."""
  if implementation == "mosaic" and case != "causal_window_lengths" and not ON_GPU:
    pytest.skip("Mosaic's interpreter: one case on a CPU")
  dtype = BF16 if implementation == "mosaic" else jnp.float32
  b, t, s, n, k = 2, 37, 53, 4, 2
  h = 80 if implementation == "mosaic" else 40
  q, kk, v, d_out = random_qkv(1, b, t, s, n, k, h, dtype)
  sinks = _sinks(n)
  options = dict(CASES[case])
  if options.get("bias") == "bias":
    options["bias"] = random_array(5, (1, n, t, s), "float")

  def ours(q, kk, v, sinks):
    return attention(implementation, q, kk, v, sinks=sinks, return_residual=True, **options)

  def ref(q, kk, v, sinks):
    return _reference(q, kk, v, sinks, **options)

  run = jax.jit if not (implementation == "mosaic" and not ON_GPU) else (lambda f: f)
  got = run(lambda *a: _grads(ours, *a))(q, kk, v, sinks, d_out)
  want = _grads(ref, q.astype(jnp.float32), kk.astype(jnp.float32), v.astype(jnp.float32),
                sinks, d_out)
  chex.assert_type(got[5], jnp.float32)
  chex.assert_shape(got[5], (n,))
  _compare(got, want, TOLERANCE[dtype])


@pytest.mark.parametrize("implementation", ("xla", "triton"))
def test_limits_of_the_sink(implementation):
  """A sink of -inf is no sink at all; a sink far above every logit takes the whole row (the
  output goes to zero without NaN); a NaN sink makes its head NaN and no other."""
  b, t, n, k, h = 1, 20, 2, 2, 16
  q, kk, v, _ = random_qkv(2, b, t, t, n, k, h)
  plain = attention(implementation, q, kk, v, is_causal=True)
  none = attention(implementation, q, kk, v, is_causal=True, sinks=jnp.full((n,), -jnp.inf))
  np.testing.assert_allclose(none, plain, rtol=1e-6, atol=1e-6)
  huge, lse = attention(implementation, q, kk, v, is_causal=True,
                        sinks=jnp.array([200.0, 0.0]), return_residual=True)
  assert np.all(np.isfinite(np.asarray(huge)))
  assert float(jnp.max(jnp.abs(huge[:, :, 0]))) < 1e-30
  np.testing.assert_allclose(lse[:, :, 0], 200.0, rtol=1e-6)
  nan = attention(implementation, q, kk, v, is_causal=True, sinks=jnp.array([jnp.nan, 0.0]))
  assert np.isnan(np.asarray(nan[:, :, 0])).all()
  assert not np.isnan(np.asarray(nan[:, :, 1])).any()


def test_split_keys_merge_then_join_the_sink():
  """Partial results over key ranges get the sink once, after the merge (ops.partial)."""
  from jaxflash import _checks
  from jaxflash.backends import xla
  b, t, s, n, k, h = 2, 24, 50, 4, 2, 16
  q, kk, v, d_out = random_qkv(3, b, t, s, n, k, h)
  sinks = _sinks(n, seed=1)
  lengths = jnp.array([50, 30])

  def ours(q, kk, v, sinks):
    call = _checks.normalise(q, kk, v, is_causal=True, key_value_seq_lengths=lengths,
                             sinks=sinks)
    out, lse = partial.split_keys_attention(call.inputs, call.params, xla.BACKEND,
                                            config_for("xla", True), (16, 33))
    return out, jnp.swapaxes(lse, 1, 2)

  def ref(q, kk, v, sinks):
    return _reference(q, kk, v, sinks, is_causal=True, key_value_seq_lengths=lengths)

  _compare(jax.jit(lambda *a: _grads(ours, *a))(q, kk, v, sinks, d_out),
           _grads(ref, q, kk, v, sinks, d_out), TOLERANCE[jnp.float32])


def _decode_mask(kv_lengths, t, s):
  pos = kv_lengths[:, None, None] - t + jnp.arange(t)[None, :, None]
  key = jnp.arange(s)[None, None, :]
  return ((key <= pos) & (key < kv_lengths[:, None, None]))[:, None]


@pytest.mark.parametrize("implementation,splits,paged", [
    ("xla", None, False), ("triton", 1, False), ("triton", 3, False), ("triton", 3, True)])
def test_decode_with_sinks(implementation, splits, paged, monkeypatch):
  """The split-KV kernel's splits are merged, then joined by the sink; one split writes its
  result itself, and a paged cache is read where it lies. Gradients reach the sinks."""
  from jaxflash.backends.triton import decode
  if splits is not None:
    default = decode.default_config
    monkeypatch.setattr(decode, "default_config", lambda *a, **kw: dataclasses.replace(
        default(*a, **kw), splits=splits))
  b, t, s, n, k, h = 3, 2, 64, 4, 2, 32
  q, kk, v, d_out = random_qkv(4, b, t, s, n, k, h)
  kv_lengths = jnp.array([0, 17, 64], jnp.int32)
  sinks = _sinks(n, seed=2)
  page_table = None
  if paged:
    kk, v = (x.reshape(b * s // 16, 16, k, h) for x in (kk, v))
    page_table = jnp.arange(b * s // 16, dtype=jnp.int32).reshape(b, s // 16)

  def ours(q, kk, v, sinks):
    return jaxflash.decode_attention(q, kk, v, kv_lengths, page_table=page_table, sinks=sinks,
                                     return_residual=True, implementation=implementation,
                                     interpret=interpret_for(implementation))

  rows = lambda x: x if page_table is None else x.reshape(b, s, k, h)  # noqa: E731

  def ref(q, kk, v, sinks):
    return _reference(q, rows(kk), rows(v), sinks, mask=_decode_mask(kv_lengths, t, s))

  got = jax.jit(lambda *a: _grads(ours, *a))(q, kk, v, sinks, d_out)
  want = _grads(ref, q, kk, v, sinks, d_out)
  _compare(got, want, TOLERANCE[jnp.float32])


needs_devices = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
DEVICES = min(jax.device_count(), 4)


# (zigzag is a variant: [contiguous] holds the sink joined once after the ring's last merge and
# its gradient's share per device, which no layout changes; tests/test_ring.py's zigzag cases
# hold the layout's pairs.)
@needs_devices
@pytest.mark.parametrize("layout", ["contiguous",
                                    pytest.param("zigzag", marks=pytest.mark.variants)])
def test_ring_joins_the_sink_once(layout):
  """Ring attention over the devices: each device's sinks gradient is its share, summed over
  the ring axis by the shard_map's transpose."""
  from jaxflash.ops import ring
  b, t, n, k, h = 2, 16 * DEVICES, 4, 2, 16
  q, kk, v, d_out = random_qkv(5, b, t, t, n, k, h)
  sinks = _sinks(n, seed=3)
  mesh = jax.make_mesh((DEVICES,), ("sp",), axis_types=(AxisType.Explicit,))

  def local(q, kk, v, sinks):
    out, lse = jaxflash.ring_attention(q, kk, v, axis_name="sp", layout=layout, is_causal=True,
                                       sinks=sinks, return_residual=True, implementation="xla")
    return out, lse

  def ours(q, kk, v, sinks):
    order = lambda x: jax.reshard(ring.to_layout(x, layout, DEVICES), P(None, "sp"))  # noqa: E731
    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (P(),),
                       out_specs=P(None, "sp"))
    out, lse = fn(order(q), order(kk), order(v), sinks)
    return (ring.from_layout(out, layout, DEVICES), ring.from_layout(lse, layout, DEVICES))

  with jax.set_mesh(mesh):
    got = jax.jit(lambda *a: _grads(ours, *a))(q, kk, v, sinks, d_out)
  want = _grads(lambda *a: _reference(*a, is_causal=True), q, kk, v, sinks, d_out)
  _compare([np.asarray(x) for x in got], want, TOLERANCE[jnp.float32])


@needs_devices
@pytest.mark.parametrize("axis_type", (AxisType.Auto, AxisType.Explicit), ids=("auto", "explicit"))
def test_heads_sharded_take_their_sinks(axis_type):
  """Batch and heads sharded under jit: each device gets its heads' sinks, and the sinks'
  gradient (a sum over batch rows and queries) is completed across the batch shards. Sinks
  replicated over the devices (a Flax parameter beside head-sharded projections) take their
  gradient replicated too (under Explicit axes it came back head-sharded: a type error)."""
  b, t, n, k, h = 4, 24, 4, 2, 16
  q, kk, v, d_out = random_qkv(6, b, t, t, n, k, h)
  sinks = _sinks(n, seed=4)

  def ours(q, kk, v, sinks):
    return attention("xla", q, kk, v, is_causal=True, sinks=sinks, return_residual=True)

  fn = jax.jit(lambda *a: _grads(ours, *a))
  want = fn(q, kk, v, sinks, d_out)
  shape = (2, 2) if DEVICES >= 4 else (2, 1)
  mesh = jax.make_mesh(shape, ("b", "h"), axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh):
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    spec = P("b", None, "h")
    for sinks_spec in (P("h"), P()):
      got = fn(put(q, spec), put(kk, spec), put(v, spec), put(sinks, sinks_spec),
               put(d_out, spec))
      for g, w in zip(got, want):
        assert rel_err(g, w) < F32_TOLERANCE


@needs_devices
def test_inside_shard_map_the_sinks_gradient_is_summed():
  """A batch split by a user's shard_map with replicated sinks: the gradient is the whole
  batch's."""
  b, t, n, k, h = DEVICES, 16, 2, 1, 16
  q, kk, v, d_out = random_qkv(7, b, t, t, n, k, h)
  sinks = _sinks(n, seed=5)
  mesh = jax.make_mesh((DEVICES,), ("b",), axis_types=(AxisType.Explicit,))

  def ours(q, kk, v, sinks):
    fn = jax.shard_map(lambda q, kk, v, s: attention("xla", q, kk, v, is_causal=True, sinks=s,
                                                     return_residual=True),
                       mesh=mesh, in_specs=(P("b"),) * 3 + (P(),), out_specs=P("b"))
    return fn(*(jax.reshard(x, P("b")) for x in (q, kk, v)), sinks)

  with jax.set_mesh(mesh):
    got = jax.jit(lambda *a: _grads(ours, *a))(q, kk, v, sinks, d_out)
  want = _grads(lambda *a: _reference(*a, is_causal=True), q, kk, v, sinks, d_out)
  _compare([np.asarray(x) for x in got], want, TOLERANCE[jnp.float32])


@pytest.mark.parametrize("sinks,match", [
    (jnp.zeros((3,)), r"sinks must have shape \(N,\) = \(4,\)"),
    (jnp.zeros((1, 4)), r"sinks must have shape"),
    (jnp.zeros((4,), jnp.int32), "sinks must be a float array"),
    ("x", "sinks must be"),
])
def test_bad_sinks_are_refused(sinks, match):
  q = jnp.zeros((1, 8, 4, 16))
  with pytest.raises(ValueError, match=match):
    jaxflash.flash_attention(q, q, q, sinks=sinks)


def test_vmap_and_x64():
  """Under vmap (sinks batched with the call) and with jax_enable_x64 (float64 sinks)."""
  q, kk, v, _ = random_qkv(8, 2, 12, 12, 2, 2, 16)
  sinks = jnp.stack([_sinks(2, seed=6), _sinks(2, seed=7)])
  got = jax.vmap(lambda q, kk, v, s: jaxflash.flash_attention(
      q[None], kk[None], v[None], sinks=s, implementation="xla")[0])(q, kk, v, sinks)
  for i in range(2):
    want, _ = reference_attention(q[i:i + 1], kk[i:i + 1], v[i:i + 1], sinks=sinks[i])
    assert rel_err(got[i:i + 1], want) < F32_TOLERANCE
  with jax.enable_x64(True):
    out = jaxflash.flash_attention(q, kk, v, sinks=np.zeros(2, np.float64),
                                   implementation="xla")
  assert out.dtype == q.dtype
