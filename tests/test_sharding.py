"""Sharded calls (issue 15), on four fake CPU devices (tests/conftest.py): batch- and
head-sharded inputs under jit compute each device's share with no collective, on Auto and
Explicit meshes, with every option sharded along; results and gradients equal the unsharded
call's (dropout included: its coordinates are global); what must communicate (the gradient of
a bias broadcast over a sharded batch, dK/dV of an MQA head shared by sharded query heads) does;
a sequence-sharded call is gathered and right; calls inside `jax.shard_map` work with
``check_vma=True``. The same tests run on a machine with 2 or more GPUs, and
``benchmarks/multi_gpu.py`` times the batch-sharded step there.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxflash
from checks import ON_GPU, attention, random_array, random_qkv, rel_err

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
# Meshes are written for 4 devices; with 2 (a two-GPU machine) each shrinks to 2.
DEVICES = min(jax.device_count(), 4)

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
# Pallas's interpreter fails inside shard_map with check_vma=True (a `pad` it emits mixes
# types), so on a CPU those tests run the XLA backend; on a GPU the kernels are compiled.
SHARD_MAP_BACKENDS = ("triton", "xla") if ON_GPU else ("xla",)
TOL = 1e-5 if not ON_GPU else 2e-3


def _mesh(axis_type, shape=(2, 2), names=("b", "h")):
  if DEVICES < 4:
    shape = (2, 1) if len(shape) == 2 else (2,)
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def _collectives(compiled_text: str) -> list[str]:
  return [c for c in COLLECTIVES if c in compiled_text]


def _fwd_bwd(implementation, **options):
  """jit of (q, k, v, d_out, **arrays) -> (out, dq, dk, dv): a VJP with a sharded cotangent, so
  that any collective in the program is one of the op's own (a scalar loss would all-reduce).
  ``arrays`` are more options, passed as arguments so that they can be sharded too."""
  def fn(q, k, v, d_out, **arrays):
    out, vjp = jax.vjp(lambda q, k, v: attention(implementation, q, k, v, **options, **arrays),
                       q, k, v)
    return (out,) + vjp(d_out)
  return jax.jit(fn)


def _close(got, want):
  for g, w in zip(got, want):
    assert rel_err(g, w) < TOL


def _put(mesh, spec, *xs):
  return tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x in xs)


# One backend per mesh type on a CPU: auto-triton and explicit-xla are variants. The routes
# (`partitioning.run`: the primitive under Auto axes, a shard_map under Explicit ones) are the
# same for both backends, so [auto-xla] holds the Auto route and [explicit-triton] the
# Explicit one, and with Triton's kernels on each device's share (its dropout seeds carrying
# the share's origin); test_paged_decode_sharded[auto] holds Triton's kernels under Auto axes.
_LOCAL_CASES = [
    pytest.param("triton", AxisType.Auto, id="auto-triton", marks=pytest.mark.variants),
    pytest.param("xla", AxisType.Auto, id="auto-xla"),
    pytest.param("triton", AxisType.Explicit, id="explicit-triton"),
    pytest.param("xla", AxisType.Explicit, id="explicit-xla", marks=pytest.mark.variants)]


@pytest.mark.parametrize("implementation,axis_type", _LOCAL_CASES)
def test_batch_and_head_sharded_calls_run_locally(implementation, axis_type):
  """Batch over one mesh axis and heads (GQA 4/2) over the other: no collective in forward or
  backward, outputs and gradients sharded like their inputs, values equal to one device's, with
  causal, key lengths, segments and dropout sharded along."""
  b, t, n, k, h = 4, 40, 4, 2, 16
  q, kk, v, d_out = random_qkv(0, b, t, t, n, k, h)
  segments = jnp.cumsum(random_array(1, (b, t), "bool") & (jnp.arange(t) % 9 == 0), axis=1)
  lengths = jnp.array([40, 33, 7, 25])
  fn = _fwd_bwd(implementation, is_causal=True, dropout_rate=0.2,
                dropout_rng=jax.random.key(7))
  want = fn(q, kk, v, d_out, key_value_seq_lengths=lengths, segment_ids=segments)
  mesh = _mesh(axis_type)
  spec = P("b", None, "h")
  with jax.set_mesh(mesh):
    args = _put(mesh, spec, q, kk, v, d_out)
    rows = dict(zip(("key_value_seq_lengths", "segment_ids"), _put(mesh, P("b"), lengths,
                                                                   segments)))
    got = fn(*args, **rows)
    assert _collectives(fn.lower(*args, **rows).compile().as_text()) == []
  for x in got:
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)
  _close(got, want)


def test_kernels_are_traced_once_per_call(monkeypatch):
  """With several devices a call under jit is the partitioning primitive: its abstract
  evaluation (the result shapes) and its lowering share one trace of the backend's forward and
  backward; a sharded call adds one trace of the device's share."""
  from jaxflash.backends.xla import backward, forward
  counts = {"forward": 0, "backward": 0}
  for module, name in ((forward, "forward"), (backward, "backward")):
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args, real=real, name=name: counts.update(
        {name: counts[name] + 1}) or real(*args))
  q, k, v, d_out = random_qkv(3, 4, 24, 24, 4, 2, 16)

  def traces(*arrays):
    jax.clear_caches()  # (the counts are of traces: none may come from an earlier call)
    counts.update(forward=0, backward=0)
    _fwd_bwd("xla", is_causal=True)(*arrays)
    return dict(counts)

  assert traces(q, k, v, d_out) == {"forward": 1, "backward": 1}
  mesh = _mesh(AxisType.Auto, (DEVICES,), ("b",))
  assert traces(*_put(mesh, P("b"), q, k, v, d_out)) == {"forward": 2, "backward": 2}


def test_a_mesh_with_an_unused_axis_and_a_batch_only_sharding():
  """A 4-device mesh whose second axis shards nothing: still local, still exact."""
  q, kk, v, d_out = random_qkv(1, 4, 24, 24, 2, 2, 16)
  fn = _fwd_bwd("xla", is_causal=True)
  want = fn(q, kk, v, d_out)
  mesh = _mesh(AxisType.Auto, (2, 2), ("data", "model"))
  with jax.set_mesh(mesh):
    args = _put(mesh, P("data"), q, kk, v, d_out)
    got = fn(*args)
    assert _collectives(fn.lower(*args).compile().as_text()) == []
  _close(got, want)


@pytest.mark.parametrize("axis_type", (AxisType.Auto, AxisType.Explicit), ids=("auto", "explicit"))
def test_mqa_heads_sharded_sum_the_shared_key_gradients(axis_type):
  """One K/V head shared by query heads split over 4 devices: each device holds K/V whole,
  and dK/dV are summed over the devices (one all-reduce, in the backward only)."""
  q, kk, v, d_out = random_qkv(2, 2, 24, 30, 4, 1, 16)
  fn = _fwd_bwd("xla", is_causal=True)
  want = fn(q, kk, v, d_out)
  mesh = _mesh(axis_type, (4,), ("h",))
  with jax.set_mesh(mesh):
    q_s, d_s = _put(mesh, P(None, None, "h"), q, d_out)
    k_s, v_s = _put(mesh, P(), kk, v)
    got = fn(q_s, k_s, v_s, d_s)
    forward = jax.jit(lambda q, k, v: attention("xla", q, k, v, is_causal=True))
    assert _collectives(forward.lower(q_s, k_s, v_s).compile().as_text()) == []
    assert _collectives(fn.lower(q_s, k_s, v_s, d_s).compile().as_text()) == ["all-reduce"]
  _close(got, want)


@pytest.mark.parametrize("axis_type", (AxisType.Auto, AxisType.Explicit), ids=("auto", "explicit"))
def test_bias_broadcast_over_a_sharded_batch(axis_type):
  """A [1, N, T, S] bias with a batch-sharded call: its gradient is summed over the devices;
  a per-batch-row mask shards with the batch."""
  b, t, s, n = 4, 20, 28, 2
  q, kk, v, d_out = random_qkv(3, b, t, s, n, n, 16)
  bias = random_array(3, (1, n, t, s), "float")
  mask = random_array(4, (b, 1, t, s), "bool")

  def fn(q, k, v, bias, mask, d_out):
    out, vjp = jax.vjp(lambda q, k, v, bias: attention("xla", q, k, v, bias, mask), q, k, v, bias)
    return (out,) + vjp(d_out)

  fn = jax.jit(fn)
  want = fn(q, kk, v, bias, mask, d_out)
  mesh = _mesh(axis_type, (4,), ("b",))
  with jax.set_mesh(mesh):
    q_s, k_s, v_s, d_s, mask_s = _put(mesh, P("b"), q, kk, v, d_out, mask)
    bias_s, = _put(mesh, P(), bias)
    got = fn(q_s, k_s, v_s, bias_s, mask_s, d_s)
  _close(got, want)


@pytest.mark.parametrize("axis_type", (AxisType.Auto, AxisType.Explicit), ids=("auto", "explicit"))
def test_sequence_sharded_inputs_are_gathered_and_right(axis_type):
  """Queries and keys sharded along the sequence: the call gathers what it needs, warns that
  context parallelism is ring attention's job, and the result is the unsharded one."""
  q, kk, v, d_out = random_qkv(4, 2, 32, 32, 2, 2, 16)
  fn = _fwd_bwd("xla", is_causal=True)
  want = fn(q, kk, v, d_out)
  mesh = _mesh(axis_type, (4,), ("s",))
  with jax.set_mesh(mesh), pytest.warns(UserWarning, match="ring_attention"):
    got = fn(*_put(mesh, P(None, "s"), q, kk, v, d_out))
  _close(got, want)
  if axis_type == AxisType.Explicit:  # types say where things are: the output is the query's
    assert tuple(got[0].sharding.spec[:2]) == (None, "s")


@pytest.mark.parametrize("implementation", SHARD_MAP_BACKENDS)
def test_inside_shard_map_with_check_vma(implementation):
  """Forward and gradients inside `jax.shard_map` (``check_vma=True``, the default), batch
  split over the devices: each device's result is the unsharded call's rows."""
  q, kk, v, d_out = random_qkv(5, 4, 24, 24, 2, 1, 16)
  fn = _fwd_bwd(implementation, is_causal=True, key_value_seq_lengths=jnp.array([24, 3, 0, 17]))
  want = fn(q, kk, v, d_out)

  mesh = _mesh(AxisType.Explicit, (4,), ("b",))

  def local(q, k, v, lengths, d_out):
    out, vjp = jax.vjp(lambda q, k, v: attention(implementation, q, k, v, is_causal=True,
                                                 key_value_seq_lengths=lengths), q, k, v)
    return (out,) + vjp(d_out)

  sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("b"), out_specs=P("b")))
  with jax.set_mesh(mesh):
    args = _put(mesh, P("b"), q, kk, v, jnp.array([24, 3, 0, 17]), d_out)
    got = sharded(*args)
  _close(got, want)


@pytest.mark.parametrize("case", ["documents", "mqa_heads", "bias", "score_table",
                                  "score_gather"])
def test_inside_shard_map_operands_the_devices_share(case):
  """Inside `jax.shard_map` (``check_vma=True``), operands that do not vary over an axis the
  query is split on: a mask_mod over per-device document ids (its trace records `pvary`
  casts, which failed to run again on ids that vary already), MQA's one K/V head shared by
  head-split queries, a bias broadcast over the split batch, and arrays a score_mod closes over
  (through its features, and per entry). Gradients equal the unsharded call's: each device's
  part of a shared operand's cotangent summed once (before: a type error, then for score_mod
  tables the sum taken twice)."""
  b, t, n, h = 4, 24, 2, 16
  k_heads = 1 if case == "mqa_heads" else n
  q, kk, v, _ = random_qkv(9, b, t, t, n, k_heads, h)
  i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
  extra = {"documents": jnp.array([[0] * 12 + [1] * 12, [0] * 24, [0] * 5 + [1] * 19,
                                   [0] * 8 + [1] * 8 + [2] * 8]),
           "bias": random_array(10, (1, n, t, t), "float"),
           "score_table": 0.3 * random_array(11, (n, 2 * t), "float"),
           "score_gather": 0.3 * random_array(12, (t, t), "float")}.get(case, jnp.zeros(()))

  def flash(q, k, v, x):
    options = {
        "documents": dict(mask_mod=lambda b, h, qi, ki: (x[b, qi] == x[b, ki]) & (qi >= ki)),
        "mqa_heads": dict(is_causal=True), "bias": dict(bias=x),
        "score_table": dict(score_mod=lambda s, b, h, qi, ki: s + x[h, qi - ki + t]),
        "score_gather": dict(score_mod=lambda s, b, h, qi, ki: s + x[qi, ki])}[case]
    return jaxflash.flash_attention(q, k, v, implementation="xla", **options)

  def reference(q, k, v, x):
    k, v = jnp.repeat(k, n // k_heads, axis=2), jnp.repeat(v, n // k_heads, axis=2)
    options = {  # (made for this case only: the others' expressions need other shapes)
        "documents": lambda: dict(mask=((x[:, :, None] == x[:, None, :]) & (i >= j))[:, None]),
        "mqa_heads": lambda: dict(is_causal=True), "bias": lambda: dict(bias=x),
        "score_table": lambda: dict(bias=x[:, i - j + t][None]),
        "score_gather": lambda: dict(bias=x[None, None])}[case]()
    return jax.nn.dot_product_attention(q, k, v, implementation="xla", **options)

  floating = case != "documents"
  argnums = (0, 1, 2, 3) if floating else (0, 1, 2)
  loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)))  # noqa: E731
  want = jax.grad(loss(reference), argnums)(q, kk, v, extra)
  mesh = _mesh(AxisType.Auto)  # ("b", "h")
  q_spec = P("b", None, "h") if case == "mqa_heads" else P("b")
  x_spec = P("b") if case == "documents" else P()
  sharded = jax.shard_map(flash, mesh=mesh, in_specs=(q_spec, P("b"), P("b"), x_spec),
                          out_specs=q_spec)
  assert rel_err(jax.jit(sharded)(q, kk, v, extra), reference(q, kk, v, extra)) < TOL
  got = jax.jit(jax.grad(loss(sharded), argnums))(q, kk, v, extra)
  _close(got, want)


def test_dropout_is_the_same_however_the_call_is_sharded():
  """The keep mask depends on global (batch, head) coordinates: batch-sharded, head-sharded
  and unsharded calls drop the same entries (outputs equal to rounding)."""
  q, kk, v, _ = random_qkv(6, 4, 16, 16, 4, 4, 16)
  fn = jax.jit(lambda q, k, v: attention("xla", q, k, v, dropout_rate=0.5,
                                         dropout_rng=jax.random.key(1)))
  want = fn(q, kk, v)
  for spec in (P("b"), P(None, None, "b"), P("b", None, None)):
    mesh = _mesh(AxisType.Auto, (4,), ("b",))
    with jax.set_mesh(mesh):
      got = fn(*_put(mesh, spec, q, kk, v))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_vmap_of_a_sharded_call():
  """vmap over a leading axis of batch-sharded inputs: the primitive's batching rule."""
  q, kk, v, _ = random_qkv(7, 4, 16, 16, 2, 2, 16)
  stack = lambda x: jnp.stack([x, 2 * x])  # noqa: E731
  fn = jax.jit(jax.vmap(lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=True,
                                                                 implementation="xla")))
  want = fn(stack(q), stack(kk), stack(v))
  mesh = _mesh(AxisType.Auto, (4,), ("b",))
  with jax.set_mesh(mesh):
    got = fn(*_put(mesh, P(None, "b"), stack(q), stack(kk), stack(v)))
  assert rel_err(got, want) < TOL


def test_decode_attention_batch_sharded():
  """The decoding op on a batch-sharded cache: local, and equal to one device's result."""
  b, s_max, t = 4, 40, 2
  q, kk, v, _ = random_qkv(8, b, t, s_max, 4, 2, 16)
  lengths = jnp.array([40, 5, 2, 31])
  fn = jax.jit(lambda q, k, v, lengths: jaxflash.decode_attention(q, k, v, lengths,
                                                                  implementation="xla"))
  want = fn(q, kk, v, lengths)
  mesh = _mesh(AxisType.Auto, (4,), ("b",))
  with jax.set_mesh(mesh):
    args = _put(mesh, P("b"), q, kk, v, lengths)
    got = fn(*args)
    assert _collectives(fn.lower(*args).compile().as_text()) == []
  assert rel_err(got, want) < TOL


@pytest.mark.parametrize("axis_type", (AxisType.Auto, AxisType.Explicit), ids=("auto", "explicit"))
def test_inside_a_shard_map_over_some_of_the_axes(axis_type):
  """A shard_map over the batch axis of a 2 x 2 mesh (``axis_names={"b"}``, check_vma), the
  heads split over the other under set_mesh: the other axis's route (the primitive under
  Auto, a nested shard_map under Explicit) dropped the results' varying type, and gradients
  were a custom_vjp type error; forward and gradients are the unsharded call's."""
  if DEVICES < 4:
    pytest.skip("needs 4 devices (tests/conftest.py fakes them on a CPU)")
  q, kk, v, _ = random_qkv(10, 4, 16, 16, 4, 4, 16)
  call = lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=True,  # noqa: E731
                                                  implementation="xla")
  mesh = _mesh(axis_type)
  split = jax.shard_map(call, mesh=mesh, in_specs=P("b"), out_specs=P("b"), axis_names={"b"})
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
  want = (call(q, kk, v),) + jax.grad(loss(call), (0, 1, 2))(q, kk, v)
  with jax.set_mesh(mesh):
    args = _put(mesh, P("b", None, "h"), q, kk, v)
    got = (jax.jit(split)(*args),) + jax.jit(jax.grad(loss(split), (0, 1, 2)))(*args)
  _close(got, want)


def test_heads_the_mesh_cannot_divide_warn_and_run_whole():
  """Query heads split four ways with two key/value heads (GQA 4/2): no device can take a
  share of the K/V heads, so every device computes all heads (right, but not split): a
  warning says so, as one does for a sharded sequence."""
  if DEVICES < 4:
    pytest.skip("needs 4 devices (tests/conftest.py fakes them on a CPU)")
  q, kk, v, _ = random_qkv(12, 2, 16, 16, 4, 2, 16)
  mesh = _mesh(AxisType.Auto, (4,), ("h",))
  call = jax.jit(lambda q, k, v: jaxflash.flash_attention(q, k, v, implementation="xla"))
  with pytest.warns(UserWarning, match="sharded along its heads .4 query and 2 key/value"):
    got = call(*_put(mesh, P(None, None, "h"), q), kk, v)
  assert rel_err(got, call(q, kk, v)) < TOL


def test_arrays_committed_to_different_devices_are_named():
  """As jax.jit refuses them, but naming the arguments (JAX's error showed 1.7 kB of an
  internal primitive's parameters and called the key args[0]); an uncommitted array joins
  any device."""
  d0, d1 = jax.devices()[:2]
  q, k, v, _ = random_qkv(3, 2, 16, 16, 4, 2, 16)
  with pytest.raises(ValueError, match="query is committed to .* and value to"):
    jaxflash.flash_attention(jax.device_put(q, d1), k, jax.device_put(v, d0))
  with pytest.raises(ValueError, match="query is committed to .* and sinks to"):
    jaxflash.decode_attention(jax.device_put(q[:, :1], d1), k, v, jnp.array([16, 9]),
                              sinks=jax.device_put(jnp.zeros(4), d0))
  out = jaxflash.flash_attention(jax.device_put(q, d1), k, jax.device_put(v, d1))
  assert out.sharding.device_set == {d1}


def test_sharded_lengths_under_jit_without_a_mesh_set():
  """A data loader's pattern: arrays put on the devices with a NamedSharding, then plain
  jax.jit (no set_mesh). Given one of the two length arrays (decode_attention always gives
  only the keys'), the other was made like it and resharded to it, which without a mesh set
  is an error."""
  b, t = 4, 24
  q, kk, v, _ = random_qkv(9, b, t, t, 2, 2, 16)
  lengths = jnp.array([24, 5, 17, 12])
  mesh = _mesh(AxisType.Auto, (4,), ("b",))
  calls = (lambda q, k, v, l: jaxflash.flash_attention(q, k, v, key_value_seq_lengths=l,
                                                       implementation="xla"),
           lambda q, k, v, l: jaxflash.flash_attention(q, k, v, query_seq_lengths=l,
                                                       implementation="xla"),
           lambda q, k, v, l: jaxflash.decode_attention(q[:, :1], k, v, l,
                                                        implementation="xla"))
  for call in calls:
    want = call(q, kk, v, lengths)
    for spec in (P("b"), P()):
      got = jax.jit(call)(*_put(mesh, P("b"), q, kk, v), *_put(mesh, spec, lengths))
      assert rel_err(got, want) < TOL


@pytest.mark.parametrize("axis_type", (AxisType.Auto, AxisType.Explicit), ids=("auto", "explicit"))
def test_paged_decode_sharded(axis_type):
  """Decoding on a paged cache (the split-KV kernel reading the pages where they lie) with the
  batch, the page table and the lengths over one mesh axis and the heads and the pages' K/V
  heads over the other: no collective, equal to one device's result, gradients included."""
  from test_decode import _paged
  b, s, t, n, k, h, page = 4, 64, 2, 4, 2, 32, 16
  q, kk, v, d_out = random_qkv(9, b, t, s, n, k, h)
  lengths = jnp.array([64, 5, 2, 33], jnp.int32)
  k_pages, table = _paged(kk, page, 1)
  v_pages, _ = _paged(v, page, 1)
  on_gpu = dict(interpret=False) if ON_GPU else dict(interpret=True)

  def fn(q, k_pages, v_pages, table, lengths, d_out):
    out, vjp = jax.vjp(lambda q, kp, vp: jaxflash.decode_attention(
        q, kp, vp, lengths, page_table=table, implementation="triton", **on_gpu),
        q, k_pages, v_pages)
    return (out,) + vjp(d_out)

  fn = jax.jit(fn)
  want = fn(q, k_pages, v_pages, table, lengths, d_out)
  mesh = _mesh(axis_type)
  with jax.set_mesh(mesh):
    args = (*_put(mesh, P("b", None, "h"), q), *_put(mesh, P(None, None, "h"), k_pages,
                                                        v_pages),
            *_put(mesh, P("b"), table, lengths), *_put(mesh, P("b", None, "h"), d_out))
    got = fn(*args)
    forward_only = jax.jit(lambda *a: jaxflash.decode_attention(
        a[0], a[1], a[2], a[4], page_table=a[3], implementation="triton", **on_gpu))
    assert _collectives(forward_only.lower(*args[:5]).compile().as_text()) == []
  assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, P("b", None, "h")), 4)
  _close(got, want)


# (contiguous is a variant: [paged] holds absorbed MLA's decoding and gradients batch-sharded,
# test_fp8_decode_sharded[contiguous] the split-KV kernel on a batch-sharded contiguous cache,
# and test_batch_and_head_sharded_calls_run_locally the gradient of batch-sharded keys.)
@pytest.mark.parametrize("paged", [pytest.param(False, id="contiguous",
                                                marks=pytest.mark.variants),
                                   pytest.param(True, id="paged")])
def test_absorbed_mla_decode_batch_sharded(paged):
  """Absorbed MLA's decoding (heads wider than 256: the split-KV kernel in column pieces, the XLA
  backend's backward) on one latent cache whose first features are the values, batch-sharded
  under jit (a paged pool whole on every device): no collective in the forward, results and
  the gradients of the query and the latent cache equal to one device's."""
  from test_decode import _paged
  b, s, t, n, h, hv = 4, 64, 1, 16, 576, 512
  q, latent, _, _ = random_qkv(10, b, t, s, n, 1, h)
  d_out = random_array(11, (b, t, n, hv), "float")
  lengths = jnp.array([64, 5, 1, 33], jnp.int32)
  cache, table = _paged(latent, 16, 2) if paged else (latent, None)
  options = dict(value_head_dim=hv, interpret=not ON_GPU)

  def fn(q, cache, table, lengths, d_out):
    out, vjp = jax.vjp(lambda q, c: jaxflash.decode_attention(
        q, c, None, lengths, page_table=table, **options), q, cache)
    return (out,) + vjp(d_out)

  fn = jax.jit(fn)
  want = fn(q, cache, table, lengths, d_out)
  mesh = _mesh(AxisType.Auto, (DEVICES,), ("b",))
  with jax.set_mesh(mesh):
    cache_spec = P() if paged else P("b")
    args = (*_put(mesh, P("b"), q), *_put(mesh, cache_spec, cache),
            *(_put(mesh, P("b"), table) if paged else (None,)), *_put(mesh, P("b"), lengths),
            *_put(mesh, P("b"), d_out))
    got = fn(*args)
    forward_only = jax.jit(lambda q, c, table, lengths: jaxflash.decode_attention(
        q, c, None, lengths, page_table=table, **options))
    assert _collectives(forward_only.lower(*args[:4]).compile().as_text()) == []
  _close(got, want)


@pytest.mark.parametrize("paged", (False, True), ids=("contiguous", "paged"))
def test_fp8_decode_sharded(paged):
  """Decoding on an FP8 cache (Triton's split-KV kernel) with the batch, its factors, the page
  table and the lengths over one mesh axis and the heads over the other: no collective, equal
  to one device's result."""
  from test_decode import _fp8_cache, _paged
  b, s, t, n, k, h = 4, 64, 2, 4, 2, 32
  (q8, k8, v8), descales, _ = _fp8_cache(12, b, t, s, n, k, h, True)
  lengths = jnp.array([64, 5, 0, 33], jnp.int32)
  table = None
  if paged:
    (k8, table), (v8, _) = _paged(k8, 16, 3), _paged(v8, 16, 3)

  def fn(q8, k8, v8, table, lengths, qd, kd, vd):
    return jaxflash.decode_attention(q8, k8, v8, lengths, page_table=table, q_descale=qd,
                                     k_descale=kd, v_descale=vd,
                                     implementation=("triton", "xla"), interpret=not ON_GPU)

  fn = jax.jit(fn)
  factors = (descales["q_descale"], descales["k_descale"], descales["v_descale"])
  want = fn(q8, k8, v8, table, lengths, *factors)
  mesh = _mesh(AxisType.Auto)
  with jax.set_mesh(mesh):
    cache_spec = P(None, None, "h") if paged else P("b", None, "h")
    args = (*_put(mesh, P("b", None, "h"), q8), *_put(mesh, cache_spec, k8, v8),
            *(_put(mesh, P("b"), table) if paged else (None,)), *_put(mesh, P("b"), lengths),
            *_put(mesh, P("b", None, "h"), factors[0]), *_put(mesh, P("b", "h"), *factors[1:]))
    got = fn(*args)
    assert _collectives(fn.lower(*args).compile().as_text()) == []
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("axis_type", (AxisType.Auto, AxisType.Explicit), ids=("auto", "explicit"))
def test_mods_reading_a_batch_sharded_array(axis_type):
  """A mask_mod over per-row document ids and a score_mod over a per-row key bonus, both arrays
  sharded with the batch: equal to the unsharded call, gradients of the bonus too. (Under
  Explicit axes the functions' gathers from a sharded array failed: ShardingTypeError.)"""
  b, t, n = 4, 48, 2
  q, kk, v, d_out = random_qkv(5, b, t, t, n, n, 16)
  docs = jnp.asarray(np.sort(np.random.RandomState(1).randint(0, 3, (b, t)), axis=1), jnp.int32)
  bonus = random_array(6, (b, t), "float")

  def fn(q, k, v, docs, bonus, d_out):
    def call(q, k, v, bonus):
      return attention("xla", q, k, v, mask_mod=lambda b_, h, i, j: docs[b_, i] == docs[b_, j],
                       score_mod=lambda s, b_, h, i, j: s + bonus[b_, j])
    out, vjp = jax.vjp(call, q, k, v, bonus)
    return (out,) + vjp(d_out)

  fn = jax.jit(fn)
  want = fn(q, kk, v, docs, bonus, d_out)
  mesh = _mesh(axis_type, (4,), ("b",))
  with jax.set_mesh(mesh):
    got = fn(*_put(mesh, P("b"), q, kk, v, docs, bonus, d_out))
  _close(got, want)


@pytest.mark.parametrize("axis_type,bias_shape", [
    (AxisType.Auto, "B1TS"), (AxisType.Explicit, "B1TS"), (AxisType.Auto, "1NTS")],
    ids=("auto-B1TS", "explicit-B1TS", "auto-1NTS"))
def test_biases_and_sinks_with_sharded_heads(axis_type, bias_shape):
  """Batch and heads (GQA 4/2) sharded over a 2 x 2 mesh, with sinks (split with the heads:
  each device's share takes its own heads' sinks) and a bias broadcast over the sharded heads
  ([B, 1, T, S]: its gradient is summed over the devices of the heads axis) or over the sharded
  batch with a bias per head ([1, N, T, S]: split with the heads, summed over the batch axis).
  Outputs and gradients (the bias's and the sinks' included) are the unsharded call's."""
  if DEVICES < 4:
    pytest.skip("needs 4 devices (tests/conftest.py fakes them on a CPU)")
  b, t, s, n, k = 2, 20, 28, 4, 2
  q, kk, v, d_out = random_qkv(13, b, t, s, n, k, 16)
  sizes = dict(B=b, N=n, T=t, S=s)
  bias = random_array(13, tuple(sizes.get(c, 1) for c in bias_shape), "float")
  sinks = jnp.array([2.0, -1.0, 0.5, 3.0])

  def fn(q, k, v, bias, sinks, d_out):
    out, vjp = jax.vjp(lambda q, k, v, bias, sinks: attention(
        "xla", q, k, v, bias, is_causal=True, sinks=sinks), q, k, v, bias, sinks)
    return (out,) + vjp(d_out)

  fn = jax.jit(fn)
  want = fn(q, kk, v, bias, sinks, d_out)
  mesh = _mesh(axis_type)
  with jax.set_mesh(mesh):
    q_s, k_s, v_s, d_s = _put(mesh, P("b", None, "h"), q, kk, v, d_out)
    bias_s, = _put(mesh, P("b") if bias_shape == "B1TS" else P(None, "h"), bias)
    sinks_s, = _put(mesh, P("h"), sinks)
    got = fn(q_s, k_s, v_s, bias_s, sinks_s, d_s)
  _close(got, want)
