"""Ring attention (issue 15) on four fake CPU devices: a sequence split over a mesh axis inside
`jax.shard_map` gives the whole sequence's output, LSE and gradients (against the float32
dense reference), contiguous, zigzag and striped, causal or not, with GQA, segments (packed documents
across chunk boundaries), a mask_mod, windows and dropout (the same mask as the unsplit call)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxflash
from jaxflash.ops import ring
from jaxflash.reference import reference_attention
from checks import F32_TOLERANCE, ON_GPU, dense_mask_of, random_array, random_qkv, rel_err

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
RING = min(jax.device_count(), 4)
# Pallas's interpreter cannot run inside shard_map with check_vma=True: on a CPU the ring runs
# the XLA backend; on GPUs the compiled kernels too (None: what the registry picks).
IMPLEMENTATIONS = ("xla", None) if ON_GPU else ("xla",)


def _layout_cases(*on_cpu: tuple[str, str]) -> list:
  """(causal, layout) cases, ids like "causal-zigzag": a plain CPU run (CI) keeps those named in
  `on_cpu` ((full or causal, layout) pairs), the rest are variants, which CI's 25 minutes
  needed (2026-12-04): a machine of several GPUs runs them, and a CPU's four fake devices with
  JAXFLASH_ALL_VARIANTS=1 (one GPU skips this file)."""
  cases = []
  for causal in (False, True):
    for layout in ring.LAYOUTS:
      kind = "causal" if causal else "full"
      marks = () if (kind, layout) in on_cpu else pytest.mark.variants
      cases.append(pytest.param(causal, layout, id=f"{kind}-{layout}", marks=marks))
  return cases


def _mesh():
  return jax.make_mesh((RING,), ("sp",), axis_types=(AxisType.Explicit,))


def _ring_call(layout, implementation="xla", **options):
  """jit(shard_map) of (q, k, v, d_out[, segments]) -> (out, lse, dq, dk, dv) over the whole
  sequence, which is reordered into the layout and back around the call."""
  mesh = _mesh()

  def local(q, k, v, d_out, *segments):
    kw = dict(options, segment_ids=segments[0]) if segments else options

    def fn(q, k, v):
      return jaxflash.ring_attention(q, k, v, axis_name="sp", layout=layout,
                                     return_residual=True, implementation=implementation,
                                     **kw)
    (out, lse), vjp = jax.vjp(fn, q, k, v)
    return (out, lse) + vjp((d_out, jnp.zeros_like(lse)))

  def run(q, k, v, d_out, *segments):
    order = lambda x: ring.to_layout(x, layout, RING)  # noqa: E731
    undo = lambda x: ring.from_layout(x, layout, RING)  # noqa: E731
    args = tuple(order(x) for x in (q, k, v, d_out) + segments)
    with jax.set_mesh(mesh):
      args = tuple(jax.device_put(x, NamedSharding(mesh, P(None, "sp"))) for x in args)
      fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(None, "sp"),
                                 out_specs=P(None, "sp")))
      return tuple(undo(np.asarray(x)) for x in fn(*args))
  return run


def _reference(q, k, v, d_out, **options):
  (out, lse), vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, **options), q, k, v)
  return (out, lse) + vjp((d_out, jnp.zeros_like(lse)))


def _compare(got, want):
  names = ("out", "lse", "dq", "dk", "dv")
  for name, g, w in zip(names, got, want):
    assert rel_err(g, w) < F32_TOLERANCE * 5, name


# (The causal cases are variants: test_ring_with_lengths[causal-contiguous], [causal-striped]
# and [causal-zigzag] hold their paths, the same GQA 4/2 ring call of each layout with lengths
# added.)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("causal,layout", _layout_cases(("full", "contiguous")))
def test_ring_matches_the_whole_sequence(layout, causal, implementation):
  """GQA 4/2, 4 chunks of 16 tokens: output, LSE and gradients as the dense reference."""
  q, k, v, d_out = random_qkv(0, 2, 64, 64, 4, 2, 16)
  got = _ring_call(layout, implementation, is_causal=causal)(q, k, v, d_out)
  _compare(got, _reference(q, k, v, d_out, is_causal=causal))


# (full-striped is a variant: [causal-striped] holds the striped chunks' valid rows, and
# test_ring_matches_the_whole_sequence[full-contiguous-xla] a ring without a band, where a
# striped chunk's offsets change nothing: only a band reads them.)
@pytest.mark.parametrize("causal,layout", _layout_cases(
    ("causal", "contiguous"), ("causal", "striped"), ("causal", "zigzag")))
def test_ring_with_lengths(layout, causal):
  """Query and key lengths of the whole sequence (cut inside a chunk, at a chunk
  boundary, one row empty): padded query rows give zeros and an LSE of -inf, padded keys
  are masked, wherever the layout puts them; NaN and Inf in padded query rows reach no
  gradient."""
  q, k, v, d_out = random_qkv(4, 3, 64, 64, 4, 2, 16)
  lengths = dict(query_seq_lengths=jnp.array([64, 37, 0]),
                 key_value_seq_lengths=jnp.array([48, 64, 9]))
  q_bad = q.at[1, 50].set(jnp.nan).at[2, 3, 0, 0].set(jnp.inf)
  got = _ring_call(layout, is_causal=causal, **lengths)(q_bad, k, v, d_out)
  want = _reference(q, k, v, d_out, is_causal=causal, **lengths)
  empty = ~np.isfinite(np.asarray(want[1]))
  assert empty[1, 37:].all() and empty[2].all() and not empty[0].any()
  np.testing.assert_array_equal(~np.isfinite(np.asarray(got[1])), empty)
  np.testing.assert_array_equal(np.asarray(got[0])[np.broadcast_to(empty[..., None],
                                                                     got[0].shape)], 0.0)
  lse = lambda x: np.where(empty, 0.0, x)  # noqa: E731
  _compare((got[0], lse(got[1])) + tuple(got[2:]), (want[0], lse(want[1])) + tuple(want[2:]))


def test_striped_ring_with_segments_and_a_soft_cap():
  """Packed documents (boundaries inside and across the stripes), causal, a soft cap, GQA."""
  q, k, v, d_out = random_qkv(3, 2, 64, 64, 4, 2, 16)
  starts = random_array(4, (2, 64), "bool") & (jnp.arange(64) % 5 == 2)
  segments = jnp.cumsum(starts, axis=1).astype(jnp.int32)
  options = dict(is_causal=True, logits_soft_cap=3.0)
  got = _ring_call("striped", **options)(q, k, v, d_out, segments)
  _compare(got, _reference(q, k, v, d_out, segment_ids=segments, **options))


def test_ring_with_segments_and_a_window():
  """Packed documents whose boundaries fall inside and across chunks, with a local window."""
  q, k, v, d_out = random_qkv(1, 2, 64, 64, 2, 1, 16)
  starts = random_array(2, (2, 64), "bool") & (jnp.arange(64) % 7 == 3)
  segments = jnp.cumsum(starts, axis=1).astype(jnp.int32)
  options = dict(is_causal=True, local_window_size=(20, 0))
  got = _ring_call("zigzag", **options)(q, k, v, d_out, segments)
  _compare(got, _reference(q, k, v, d_out, segment_ids=segments, **options))


# Documents whose blocks a chunk's own table calls empty but another chunk's keys meet: with
# 512-token chunks (two of the XLA backend's 256-row blocks), the queries 512-767 share a
# document with keys 384-511 of chunk 0, while chunk 1's own keys 768-1023 begin a document
# of their own.
_DOC_STARTS = np.array([384, 640, 768])


def _documents(length: int) -> jax.Array:
  ids = np.searchsorted(_DOC_STARTS, np.arange(length), side="right")
  # [2, length]: both rows alike (the XLA backend visits the blocks any row needs).
  return jnp.asarray(np.stack([ids, ids + 5]), jnp.int32)


@pytest.mark.parametrize("layout", [  # (zigzag has the most kinds of pair)
    pytest.param("contiguous", marks=pytest.mark.variants),
    pytest.param("striped", marks=pytest.mark.variants), "zigzag"])
def test_ring_segments_are_classified_per_pair(layout):
  """Each step's block table is its own (query chunk, key chunk) pair's: before 2026-11-25 the
  pairs kept the chunk's table against itself, which skipped the blocks above."""
  length = 512 * RING
  q, k, v, d_out = random_qkv(6, 2, length, length, 2, 1, 16)
  segments = _documents(length)
  got = _ring_call(layout, is_causal=True)(q, k, v, d_out, segments)
  _compare(got, _reference(q, k, v, d_out, is_causal=True, segment_ids=segments))


def _ring_mask_mods(length: int) -> dict:
  docs, prefix = _documents(length), jnp.asarray([100, 700])
  pattern = jnp.asarray(np.random.RandomState(3).rand(length // 64, length // 64) < 0.4)
  return {
      # Reads both indices in the tile rule and arrays at them (features of each pair).
      "documents": lambda b, h, q, k: (docs[b, q] == docs[b, k]) & (q >= k),
      "prefix_lm": lambda b, h, q, k: (k <= q) | (k < prefix[b]),
      # A gather of both indices: no kernel runs it; the XLA backend evaluates it per tile.
      "pattern": lambda b, h, q, k: pattern[q // 64, k // 64] | (q == k),
  }


# Each mask_mod once, zigzag (whose shards hold permuted positions) with one of them: the other
# pairs added 60 s of CPU time to CI (a zigzag call's programs compile 3-4 times as long) and no
# path these do not take. prefix_lm is a variant: [documents-zigzag] holds features made per
# pair at its positions (rows and columns; prefix_lm's row feature reads the batch index
# alone), and test_flax_ring_attention_fn_with_a_mask_mod a kernel-capable mask_mod on the
# contiguous layout.
@pytest.mark.parametrize("name,layout", [
    ("documents", "zigzag"), ("pattern", "contiguous"),
    pytest.param("prefix_lm", "contiguous", marks=pytest.mark.variants)])
def test_ring_with_a_mask_mod(name, layout):
  """A mask_mod of whole-sequence positions (closing over whole-sequence arrays) gives what the
  dense reference gives with the same mask: output, LSE and gradients, GQA."""
  length = 512 * RING
  fn = _ring_mask_mods(length)[name]
  q, k, v, d_out = random_qkv(7, 2, length, length, 2, 1, 16)
  got = _ring_call(layout, mask_mod=fn)(q, k, v, d_out)
  want = _reference(q, k, v, d_out, mask=dense_mask_of(fn, b=2, t=length, s=length, n=2))
  _compare(got, want)


def _fp8_ring(layout, q8, k8, v8, factors, **options):
  """jit(shard_map) of an FP8 ring call on whole sequences ``q8``, ``k8``, ``v8`` (split along
  the sequence in ``layout``) and ``factors``: name -> (array, form), form "token" for [B, S,
  X] in the sequence's order (split like the values) or "chunk" for [R, B, X] in the layout's
  order of chunks (device i takes row i); the output of the whole sequence, back in order."""
  mesh = _mesh()
  names = list(factors)
  order = lambda x: ring.to_layout(x, layout, RING)  # noqa: E731
  arrays = [order(x) for x in (q8, k8, v8)]
  specs = [P(None, "sp")] * 3
  for name in names:
    x, form = factors[name]
    arrays.append(order(x) if form == "token" else x)
    specs.append(P(None, "sp") if form == "token" else P("sp"))

  def local(q, k, v, *given):
    given = {name: x if factors[name][1] == "token" else x[0] for name, x in zip(names, given)}
    return jaxflash.ring_attention(q, k, v, axis_name="sp", layout=layout, implementation="xla",
                                   out_dtype=jnp.float32, **given, **options)

  with jax.set_mesh(mesh):
    arrays = [jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip(arrays, specs)]
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=tuple(specs),
                               out_specs=P(None, "sp")))
    return ring.from_layout(np.asarray(fn(*arrays)), layout, RING)


def _quantized_per_chunk(x, layout):
  """``x`` [B, S, heads, H] quantised chunk by chunk as the devices of ``layout`` hold it, one
  factor per (batch row, head) of each chunk: (x8 in the sequence's order, factors [R, B,
  heads], the real values x8 stands for)."""
  chunks = jnp.split(ring.to_layout(x, layout, RING), RING, axis=1)
  quantized = [jaxflash.quantize_fp8(c) for c in chunks]
  x8 = jnp.concatenate([q for q, _ in quantized], axis=1)
  real = jnp.concatenate([jaxflash.fp8.dequantize(q, d[:, None]) for q, d in quantized], axis=1)
  unorder = lambda y: ring.from_layout(y, layout, RING)  # noqa: E731
  return unorder(x8), jnp.stack([d for _, d in quantized]), unorder(real)


# Each layout once, both bands between them (CI time; the band's pairs are the same as a 16-bit
# call's, which the tests above cover in every combination).
@pytest.mark.parametrize("layout,causal", [("contiguous", False), ("zigzag", True),
                                           ("striped", True)])
def test_fp8_ring_gives_the_real_values_attention(layout, causal):
  """FP8 chunks: a query factor per token, a key factor per token (travelling with its keys),
  and values quantised chunk by chunk on their devices, a factor per (batch row, head) of each
  chunk (travelling with its values): the ring gives the float32 reference of the real values
  they stand for; GQA, a soft cap, and lengths cut inside a chunk. It has no gradient."""
  q, k, v, _ = random_qkv(9, 2, 64, 64, 4, 2, 16)
  q8, q_descale = jaxflash.quantize_fp8(q, block_size=1)
  k8, k_descale = jaxflash.quantize_fp8(k * 3.0, block_size=1)
  v8, v_descale, v_real = _quantized_per_chunk(v, layout)
  lengths = dict(query_seq_lengths=jnp.array([64, 41]), key_value_seq_lengths=jnp.array([64, 50]))
  options = dict(is_causal=causal, logits_soft_cap=4.0, **lengths)
  factors = dict(q_descale=(q_descale, "token"), k_descale=(k_descale, "token"),
                 v_descale=(v_descale, "chunk"))
  got = _fp8_ring(layout, q8, k8, v8, factors, **options)
  real = [jaxflash.fp8.dequantize(x, d) for x, d in ((q8, q_descale), (k8, k_descale))]
  want, _ = reference_attention(*real, v_real, **options)
  assert rel_err(got, want) < F32_TOLERANCE * 5
  # A factor that did not travel with its keys would give another result: a factor of 2 on
  # one device's keys moves the output.
  moved = dict(factors, k_descale=(k_descale.at[:, :16].multiply(2.0), "token"))
  assert rel_err(_fp8_ring(layout, q8, k8, v8, moved, **options), got) > 1e-3

  mesh = _mesh()
  fn = jax.shard_map(lambda q, k, v, x: jaxflash.ring_attention(
      q, k, v, axis_name="sp", implementation="xla", q_descale=x, out_dtype=jnp.float32),
      mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (P(),), out_specs=P(None, "sp"))
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="no gradient"):
    chunks = [jax.device_put(x, NamedSharding(mesh, P(None, "sp"))) for x in (q8, k8, v8)]
    jax.jit(jax.grad(lambda x: fn(*chunks, x).sum())).trace(jnp.float32(1.0))


def test_fp8_ring_with_keys_quantised_per_chunk():
  """Keys and values quantised chunk by chunk (a factor per batch row and head of each
  device's chunk, both travelling), the query without a factor: the reference of the real values;
  zigzag and causal, so the pairs' halves share their chunk's factors; with sinks."""
  q, k, v, _ = random_qkv(10, 2, 64, 64, 4, 2, 16)
  q8, _ = jaxflash.quantize_fp8(q)
  k8, k_descale, k_real = _quantized_per_chunk(k * 5.0, "zigzag")
  v8, v_descale, v_real = _quantized_per_chunk(v, "zigzag")
  factors = dict(k_descale=(k_descale, "chunk"), v_descale=(v_descale, "chunk"))
  options = dict(is_causal=True, scale=0.2, sinks=jnp.array([0.5, -1.0, 2.0, 0.0]))
  got = _fp8_ring("zigzag", q8, k8, v8, factors, **options)
  want, _ = reference_attention(q8.astype(jnp.float32), k_real, v_real, **options)
  assert rel_err(got, want) < F32_TOLERANCE * 5


def test_ring_checks_its_mask_mod():
  mesh = _mesh()
  x = jnp.zeros((1, 8 * RING, 2, 16))
  fn = jax.shard_map(lambda q: jaxflash.ring_attention(
      q, q, q, axis_name="sp", mask_mod=lambda b, h, q: q > 0, implementation="xla"),
      mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
  with jax.set_mesh(mesh):
    chunks = jax.device_put(x, NamedSharding(mesh, P(None, "sp")))
    with pytest.raises(ValueError, match="mask_mod"):
      jax.jit(fn).trace(chunks)


# (contiguous is a variant: [zigzag] holds the dropout mask at global positions through the
# pairs' offsets, with the halves a device picks at run time.)
@pytest.mark.parametrize("layout", [pytest.param("contiguous", marks=pytest.mark.variants),
                                    "zigzag"])
def test_ring_dropout_is_the_unsplit_calls(layout):
  """Dropout coordinates are global positions: the ring drops what `flash_attention` on the
  whole sequence drops (same key), so the outputs agree (zigzag: with the pair each device
  picks at run time)."""
  q, k, v, d_out = random_qkv(2, 1, 64, 64, 2, 2, 16)
  options = dict(is_causal=True, dropout_rate=0.3, dropout_rng=jax.random.key(5))
  got = _ring_call(layout, **options)(q, k, v, d_out)
  (out, lse), vjp = jax.vjp(lambda q, k, v: jaxflash.flash_attention(
      q, k, v, return_residual=True, implementation="xla", **options), q, k, v)
  want = (out, lse) + vjp((d_out, jnp.zeros_like(lse)))
  _compare(got, want)


# (full is a variant: [causal] holds the merge count's rule (a half's first partial taken as it
# is), and test_ring_with_a_mask_mod[documents-zigzag] a zigzag ring without a band, whose
# output and gradients need all four pairs at every step, each merged once.)
@pytest.mark.parametrize("causal", [pytest.param(False, id="full", marks=pytest.mark.variants),
                                    pytest.param(True, id="causal")])
def test_zigzag_skips_the_pairs_a_causal_band_hides(causal, monkeypatch):
  """Under a causal band each device computes 3 (query half, key half) pairs at the first step
  and 2 at each later one, forward and backward; without one, all 4 at every step. Each pair's
  partial is merged once into its query half (the first of each half is taken as it is), also
  the pair whose half depends on the device."""
  from jaxflash.ops import flash, partial
  counts = {"forward": 0, "backward": 0, "merge": 0}

  def counting(module, name):
    original = getattr(module, name)

    def wrapped(*args, **kwargs):
      counts[name] += 1
      return original(*args, **kwargs)
    monkeypatch.setattr(module, name, wrapped)

  counting(flash, "forward")
  counting(flash, "backward")
  counting(partial, "merge")
  q, k, v, d_out = random_qkv(0, 1, 64, 64, 2, 2, 16)
  _ring_call("zigzag", is_causal=causal)(q, k, v, d_out)
  pairs = 4 * RING if not causal else 3 + 2 * (RING - 1)
  assert counts == {"forward": pairs, "backward": pairs, "merge": pairs - 2}


def test_orders_round_trip():
  x = jnp.arange(2 * 24).reshape(2, 24)
  z = ring.to_zigzag(x, 3)
  assert z[0, :4].tolist() == [0, 1, 2, 3] and z[0, 4:8].tolist() == [20, 21, 22, 23]
  assert (ring.from_zigzag(z, 3) == x).all()
  z = ring.to_striped(x, 3)
  assert z[0, :8].tolist() == [0, 3, 6, 9, 12, 15, 18, 21] and z[0, 8:10].tolist() == [1, 4]
  assert (ring.from_striped(z, 3) == x).all()
  for layout in ring.LAYOUTS:
    assert (ring.from_layout(ring.to_layout(x, layout, 3), layout, 3) == x).all()


def test_reorders_of_a_sequence_sharded_on_an_explicit_mesh():
  """A sequence axis that an Explicit mesh shards is reordered as an unsharded one is, and comes
  back sharded as it was."""
  mesh = _mesh()
  x = jnp.arange(2 * 8 * RING * 3, dtype=jnp.float32).reshape(2, 8 * RING, 3)
  with jax.set_mesh(mesh):
    sharded = jax.device_put(x, NamedSharding(mesh, P(None, "sp")))
    for layout in ring.LAYOUTS:
      got = ring.to_layout(sharded, layout, RING)
      assert got.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "sp")), 3)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(ring.to_layout(x, layout, RING)))


def test_ring_rejects_bad_arguments():
  q = jnp.zeros((1, 8, 2, 16))
  with pytest.raises(ValueError, match="axis_name"):
    jaxflash.ring_attention(q, q, q, axis_name="nope")
  with pytest.raises(ValueError, match="layout"):
    jaxflash.ring_attention(q, q, q, axis_name="sp", layout="diagonal")
  mesh = _mesh()
  x = jnp.zeros((1, 8 * RING, 2, 16))
  for options, match in ((dict(is_causal=True, local_window_size=(4, 0)), "local_window_size"),
                         (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "dropout_rate"),
                         (dict(mask_mod=lambda b, h, q, k: q >= k), "mask_mod"),
                         (dict(), None)):
    fn = jax.shard_map(lambda q: jaxflash.ring_attention(
        q, q, q, axis_name="sp", layout="striped", implementation="xla", **options),
        mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    with jax.set_mesh(mesh):
      chunks = jax.device_put(x, NamedSharding(mesh, P(None, "sp")))
      if match is None:
        jax.jit(fn).trace(chunks)  # (a striped call without a band is fine)
      else:
        with pytest.raises(ValueError, match=f"striped.*{match}"):
          jax.jit(fn).trace(chunks)


def test_ring_of_empty_chunks():
  """Chunks of no token give empty results and gradients, as `flash_attention` does for T = 0
  (no kernel and no ring step runs)."""
  mesh = _mesh()

  def local(q):
    return jaxflash.ring_attention(q, q, q, axis_name="sp", layout="zigzag", is_causal=True,
                                   return_residual=True, implementation="xla")

  fn = jax.shard_map(local, mesh=mesh, in_specs=P(None, "sp"),
                     out_specs=(P(None, "sp"), P(None, "sp")))
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.zeros((1, 0, 2, 16)), NamedSharding(mesh, P(None, "sp")))
    out, lse = jax.jit(fn)(x)
    grad = jax.jit(jax.grad(lambda q: jnp.sum(fn(q)[0])))(x)
  chex.assert_shape([out, grad], x.shape)
  chex.assert_shape(lse, (1, 0, 2))


def test_flax_module_with_the_ring_as_its_attention_fn():
  """A linen module whose attention_fn is `jaxflash.linen.ring_attention_fn`, applied inside
  shard_map to sequence-split activations, gives the causal module's output on the whole
  sequence (same parameters); a mask is refused."""
  flax_linen = pytest.importorskip("flax.linen")
  import jaxflash.linen

  x = jax.random.normal(jax.random.key(3), (2, 64, 32))
  whole = jaxflash.linen.MultiHeadDotProductAttention(num_heads=4, is_causal=True)
  params = whole.init(jax.random.key(0), x)
  want = whole.apply(params, x)
  ringed = flax_linen.MultiHeadDotProductAttention(
      num_heads=4, attention_fn=jaxflash.linen.ring_attention_fn("sp", layout="zigzag",
                                                                 is_causal=True))
  mesh = _mesh()
  fn = jax.jit(jax.shard_map(lambda x: ringed.apply(params, x), mesh=mesh,
                             in_specs=P(None, "sp"), out_specs=P(None, "sp")))
  with jax.set_mesh(mesh):
    got = fn(jax.device_put(ring.to_zigzag(x, RING), NamedSharding(mesh, P(None, "sp"))))
  assert rel_err(ring.from_zigzag(np.asarray(got), RING), want) < F32_TOLERANCE * 5
  with pytest.raises(ValueError, match="no mask"):
    ringed.apply(params, x, mask=jnp.ones((2, 1, 64, 64), bool))


def test_flax_ring_attention_fn_with_a_mask_mod():
  """`ring_attention_fn(..., mask_mod=)`: a sliding window of whole-sequence positions gives
  the module's output with the same mask as a dense array on the whole sequence."""
  flax_linen = pytest.importorskip("flax.linen")
  import jaxflash.linen

  window = lambda b, h, q, k: (q >= k) & (q - k < 20)  # noqa: E731
  x = jax.random.normal(jax.random.key(4), (2, 64, 32))
  whole = jaxflash.linen.MultiHeadDotProductAttention(num_heads=4)
  params = whole.init(jax.random.key(0), x)
  want = whole.apply(params, x, mask=dense_mask_of(window, b=1, t=64, s=64, n=1))
  ringed = flax_linen.MultiHeadDotProductAttention(
      num_heads=4, attention_fn=jaxflash.linen.ring_attention_fn("sp", mask_mod=window))
  mesh = _mesh()
  fn = jax.jit(jax.shard_map(lambda x: ringed.apply(params, x), mesh=mesh,
                             in_specs=P(None, "sp"), out_specs=P(None, "sp")))
  with jax.set_mesh(mesh):
    got = fn(jax.device_put(x, NamedSharding(mesh, P(None, "sp"))))
  assert rel_err(got, want) < F32_TOLERANCE * 5


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
def test_ring_attention_fn_takes_the_modules_options(flavour):
  """jaxflash's modules pass their options to the ring's attention_fn: is_causal (linen's field,
  nnx's call argument) makes the ring causal, implementation reaches it, fp8 is refused. (It
  took any keyword and dropped it: a causal module's ring ran unmasked, 2.6 off.)"""
  pytest.importorskip("flax")
  x = jax.random.normal(jax.random.key(5), (1, 64, 32))
  mesh = _mesh()
  if flavour == "linen":
    import jaxflash.linen
    ring_fn = jaxflash.linen.ring_attention_fn("sp")
    make = lambda **kw: jaxflash.linen.MultiHeadDotProductAttention(  # noqa: E731
        num_heads=4, is_causal=True, **kw)
    params = make().init(jax.random.key(0), x)
    whole = lambda: make().apply(params, x)  # noqa: E731
    ringed = lambda: make(attention_fn=ring_fn, implementation="xla").apply  # noqa: E731
    call = lambda module, xs: module(params, xs)  # noqa: E731
    fp8 = lambda: make(attention_fn=ring_fn, fp8=True).apply(params, x)  # noqa: E731
  else:
    from flax import nnx
    import jaxflash.nnx
    ring_fn = jaxflash.nnx.ring_attention_fn("sp")
    make = lambda **kw: jaxflash.nnx.MultiHeadAttention(  # noqa: E731
        4, 32, decode=False, rngs=nnx.Rngs(0), **kw)
    whole = lambda: make()(x, is_causal=True)  # noqa: E731
    ringed = lambda: make(attention_fn=ring_fn, implementation="xla")  # noqa: E731
    call = lambda module, xs: module(xs, is_causal=True)  # noqa: E731
    fp8 = lambda: make(attention_fn=ring_fn, fp8=True)(x, is_causal=True)  # noqa: E731
  module = ringed()
  fn = jax.jit(jax.shard_map(lambda xs: call(module, xs), mesh=mesh, in_specs=P(None, "sp"),
                             out_specs=P(None, "sp")))
  with jax.set_mesh(mesh):
    got = fn(jax.device_put(x, NamedSharding(mesh, P(None, "sp"))))
  assert rel_err(got, whole()) < F32_TOLERANCE * 5
  with pytest.raises(ValueError, match="fp8"):
    fp8()
