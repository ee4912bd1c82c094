"""Positions and partial results through the backends: a call split into key ranges (each a
partial result at a key offset, merged through the LSE; backward with the global LSE and delta)
equals the whole call, and a call over a range of queries (at a query offset) equals those rows
of the whole call: forward, LSE and gradients, with causal, window, lengths and dropout, on both
backends. Plus the merge helper on its own, empty partials included."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import _checks
from jaxflash import backends
from jaxflash import dropout
from jaxflash.ops import flash, partial
from jaxflash.reference import reference_attention
from checks import (BACKENDS, BACKENDS_TRITON_VARIANT, F32_TOLERANCE, ON_GPU, SMALL_CONFIGS,
                    interpret_for, random_array, random_lengths, random_qkv, rel_err)

B, T, S, N, K, H = 2, 37, 53, 2, 1, 16

# Options for the split tests (keyword arguments of flash_attention).
# Window and lengths are in "everything" (with causal, dropout, soft cap, mask, bias and
# segments), split three ways; "causal" and "dropout" isolate the band and the dropout mask.
SPLIT_OPTIONS = {
    "causal": dict(is_causal=True),
    "dropout": dict(dropout_rate=0.3, dropout_rng=jax.random.key(4), is_causal=True),
    "everything": dict(
        is_causal=True, local_window_size=(20, 3), logits_soft_cap=2.0,
        mask=random_array(5, (B, 1, T, S), "bool"), bias=random_array(6, (1, N, T, S), "float"),
        segment_ids=(random_array(7, (B, T), 2), random_array(8, (B, S), 2)),
        dropout_rate=0.2, dropout_rng=jax.random.key(9), **random_lengths(B, T, S, N, 10)),
}


def _call(implementation, q, k, v, options):
  """(inputs, params, backend, config) of one call, as the public API would run it."""
  options = dict(options)
  bias, mask = options.pop("bias", None), options.pop("mask", None)
  call = _checks.normalise(q, k, v, bias, mask, interpret=interpret_for(implementation),
                           **options)
  backend = backends.get(implementation)
  return call.inputs, call.params, backend, SMALL_CONFIGS[implementation]


def _grads_and_values(fn, inputs, d_out, d_lse):
  """Output, LSE and the gradients of <out, d_out> + <lse, d_lse> w.r.t. q, k, v and bias."""
  def loss(diff):
    out, lse = fn(inputs._replace(**diff))
    return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(jnp.where(
        jnp.isfinite(lse), lse, 0.0) * d_lse), (out, lse)

  diff = {name: getattr(inputs, name) for name in ("query", "key", "value", "bias")
          if getattr(inputs, name) is not None}
  grads, (out, lse) = jax.jit(jax.grad(loss, has_aux=True))(diff)
  return out, lse, grads


# ("causal" and "dropout" are variants on every backend: [xla-everything] and
# [triton-everything] hold the band and the dropout mask at the split's key offset, with every
# other option; Triton's were skipped on a CPU already.)
@pytest.mark.parametrize("option", [
    option if option == "everything" else pytest.param(option, marks=pytest.mark.variants)
    for option in SPLIT_OPTIONS])
@pytest.mark.parametrize("implementation", BACKENDS)
def test_key_split_equals_whole_call(implementation, option):
  """Keys split at an odd offset that starts mid-block (21), and merged (more than two
  partials: test_merge_is_exact_with_empty_partials)."""
  if implementation == "triton" and option != "everything" and not ON_GPU:
    pytest.skip("the interpreter is slow: 'everything' holds these options (CI time)")
  _check_key_split(implementation, SPLIT_OPTIONS[option])


def _check_key_split(implementation, options, boundaries=(21,)):
  """The call with ``options`` split into key ranges at ``boundaries`` and merged equals the
  whole call: output, LSE and gradients."""
  q, k, v, d_out = random_qkv(0, B, T, S, N, K, H)
  d_lse = jax.random.normal(jax.random.key(1), (B, N, T))
  inputs, params, backend, config = _call(implementation, q, k, v, options)
  whole = _grads_and_values(lambda x: flash.attention(x, params, backend, config), inputs,
                            d_out, d_lse)
  split = _grads_and_values(
      lambda x: partial.split_keys_attention(x, params, backend, config, boundaries), inputs,
      d_out, d_lse)
  _assert_same_results(split, whole)


def _assert_same_results(got, want):
  """Two calls' (output, LSE, gradients) of `_grads_and_values` agree: the non-finite LSE rows
  (rows that see no key) at the same places, the rest within the float32 tolerance."""
  for name, got_value, want_value in zip(("out", "lse"), got[:2], want[:2]):
    finite = np.isfinite(want_value)
    np.testing.assert_array_equal(np.isfinite(got_value), finite)
    assert rel_err(np.where(finite, got_value, 0), np.where(finite, want_value, 0)) \
        < F32_TOLERANCE, name
  assert set(got[2]) == set(want[2])
  for name in want[2]:
    assert rel_err(got[2][name], want[2][name]) < F32_TOLERANCE, name


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_key_split_bias_gradient_in_a_window(implementation):
  """A bias's gradient over key ranges at an offset, with a narrow window and no mask or
  segments (which give the call a block table): the Triton dbias kernel's band of key blocks
  must come from the range's absolute key positions. (A mutation pass that dropped the offsets
  there passed every other CPU test: "everything" has a table, and the range-free band of a
  wide window covered the missed blocks.)"""
  _check_key_split(implementation, dict(local_window_size=(5, 5),
                                        bias=random_array(6, (1, N, T, S), "float")))


_DOCS = jnp.asarray(np.random.RandomState(11).randint(0, 2, (B, 150)))
# Rules that read the indices themselves (the kernels add the call's offsets to them) and
# arrays at them (features sliced with the keys); a block table of 128-key blocks that key
# ranges starting mid-block must remake.
RULES = dict(
    mask_mod=lambda b, h, q, k: ((q - k) % 3 != 1) & (_DOCS[b, q] == _DOCS[b, k]),
    score_mod=lambda score, b, h, q, k: score + 0.05 * (k - q).astype(jnp.float32)
    + 0.3 * ((k - q) % 4).astype(jnp.float32) + 0.1 * _DOCS[b, k].astype(jnp.float32))


# (Triton's interpreter takes 20 s of a CPU here: it runs on the GPU and with
# JAXFLASH_ALL_VARIANTS=1; on a CPU Mosaic's partial calls take a mask_mod at an offset, in
# tests/test_mosaic.py, and Triton's take every other option above.)
@pytest.mark.parametrize("implementation", BACKENDS_TRITON_VARIANT)
def test_key_split_with_mask_and_score_mods_equals_whole_call(implementation):
  """Keys split at 22 and 100 (mid-block for the tiles and for the block table; neither a
  multiple of 3 or 4): a mask_mod and a score_mod see the absolute key positions, and each range
  gets its own table and features."""
  q, k, v, d_out = random_qkv(3, B, 70, 150, N, K, H)
  d_lse = jax.random.normal(jax.random.key(2), (B, N, 70))
  inputs, params, backend, config = _call(implementation, q, k, v, RULES)
  assert inputs.block_table.shape[-1] == 2  # (the table's blocks straddle both boundaries)
  whole = _grads_and_values(lambda x: flash.attention(x, params, backend, config), inputs,
                            d_out, d_lse)
  split = _grads_and_values(
      lambda x: partial.split_keys_attention(x, params, backend, config, (22, 100)), inputs,
      d_out, d_lse)
  _assert_same_results(split, whole)


def test_block_table_key_range():
  """`block_mask.key_range` against the table of the range's keys made from the dense mask."""
  from jaxflash import block_mask
  dense = random_array(12, (2, 1, 40, 300), "bool") | (jnp.arange(300) < 70)
  table = block_mask.classify_dense(dense, 64)
  for start, stop in ((0, 300), (64, 300), (21, 150), (100, 130), (250, 300)):
    got = block_mask.key_range(table, 64, start, stop)
    want = block_mask.classify_dense(dense[..., start:stop], 64)
    # Exact where the range starts at a block; else never wrong: empty only where the keys'
    # blocks are, full only where they are.
    if start % 64 == 0:
      np.testing.assert_array_equal(got, want)
    else:
      assert not np.any((np.asarray(got) == block_mask.EMPTY) & (np.asarray(want) != 0))
      assert not np.any((np.asarray(got) == block_mask.FULL) & (np.asarray(want) != 2))


# (XLA's case is a variant: tests/test_ring.py::test_ring_with_segments_and_a_window and
# test_ring_dropout_is_the_unsplit_calls[zigzag] hold the XLA backend's calls at query offsets
# under a causal band, a window and dropout, gradients included; [triton] stays.)
@pytest.mark.parametrize("implementation", ["triton",
                                            pytest.param("xla", marks=pytest.mark.variants)])
def test_query_range_at_an_offset_equals_rows_of_whole_call(implementation):
  """Rows [20, 37) run alone with q_offset = 20 are those rows of the whole call (causal band,
  window and dropout all use absolute positions), gradients included."""
  q, k, v, d_out = random_qkv(2, B, T, S, N, K, H)
  options = dict(is_causal=True, local_window_size=(15, 0), dropout_rate=0.25,
                 dropout_rng=jax.random.key(3))
  inputs, params, backend, config = _call(implementation, q, k, v, options)
  lo = 20

  def rows_of(x):
    return x._replace(query=x.query[:, lo:], q_segment_ids=None,
                      lengths=x.lengths.at[:, 0].set(T - lo),
                      offsets=jnp.zeros((B, 2), jnp.int32).at[:, 0].set(lo))

  def whole(x):
    out, lse = flash.attention(x, params, backend, config)
    return out[:, lo:], lse[:, :, lo:]

  out, lse, grads = _grads_and_values(whole, inputs, d_out[:, lo:], 0.0)
  got_out, got_lse, got_grads = _grads_and_values(
      lambda x: flash.attention(rows_of(x), params, backend, config), inputs, d_out[:, lo:],
      0.0)
  assert rel_err(got_out, out) < F32_TOLERANCE
  assert rel_err(got_lse, lse) < F32_TOLERANCE
  for name in ("query", "key", "value"):
    assert rel_err(got_grads[name], grads[name]) < F32_TOLERANCE, name


@pytest.mark.parametrize("implementation", BACKENDS)
def test_partial_results_are_float32_and_merge(implementation):
  """A partial forward (params.partial) returns float32 normalised over its keys (not rounded to
  bf16, so merging loses nothing more); merged, the partials of a bf16 call give the whole call."""
  q, k, v, _ = random_qkv(4, B, T, S, N, K, H, jnp.bfloat16)
  inputs, params, backend, config = _call(implementation, q, k, v, dict(is_causal=True))
  partial_params = dataclasses.replace(params, partial=True)
  parts = [flash.attention(partial.key_range(inputs, a, b), partial_params, backend, config)
           for a, b in ((0, 20), (20, 53))]
  chex.assert_type([out for out, _ in parts], jnp.float32)
  out, lse = partial.merge([o for o, _ in parts], [jnp.swapaxes(l, 1, 2) for _, l in parts])
  want, want_lse = reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                       is_causal=True)
  assert rel_err(out, want) < 2e-2
  assert rel_err(lse, want_lse) < F32_TOLERANCE  # the LSE is float32 math on bf16 inputs
  rounded = np.asarray(out.astype(jnp.bfloat16).astype(jnp.float32))
  assert (np.asarray(out) != rounded).mean() > 0.5  # float32, not bf16 values in float32


def test_merge_takes_stacked_partials_and_keeps_nan():
  """The partials stacked on axis 0 (a split-KV kernel's output) merge as the list does, and a
  NaN in one partial's row shows as NaN in that row's output and LSE, never as an empty row."""
  q, k, v, _ = random_qkv(6, 1, 5, 12, 2, 2, 8)
  keys = jnp.arange(12)
  parts = [reference_attention(q, k, v, mask=((keys >= a) & (keys < a + 4))[None, None, None])
           for a in (0, 4, 8)]
  outs, lses = [p[0] for p in parts], [p[1] for p in parts]
  listed = partial.merge(outs, lses)
  stacked = partial.merge(jnp.stack(outs), jnp.stack(lses))
  chex.assert_trees_all_equal(listed, stacked)
  outs[1] = outs[1].at[0, 2].set(jnp.nan)
  lses[1] = lses[1].at[0, 2].set(jnp.nan)
  out, lse = partial.merge(outs, lses)
  assert np.isnan(np.asarray(out[0, 2])).all() and np.isnan(np.asarray(lse[0, 2])).all()
  assert np.isfinite(np.asarray(out[0, 3])).all()


def test_merge_is_exact_with_empty_partials():
  """Partials over disjoint key sets (one of them empty for some rows, one empty for all)
  merge to the whole attention; all-empty rows give zeros and -inf, and gradients stay finite."""
  q, k, v, _ = random_qkv(5, 1, 6, 12, 2, 2, 8)
  keys = jnp.arange(12)
  sets = [keys < 4, (keys >= 4) & (keys < 12), jnp.zeros(12, bool)]
  row_mask = jnp.arange(6)[:, None] >= 2  # rows 0-1 see nothing in the first two sets
  parts = [reference_attention(q, k, v, mask=s[None, None, None, :] & (row_mask if i == 0
                                                                       else True))
           for i, s in enumerate(sets)]
  want, want_lse = reference_attention(
      q, k, v, mask=(sets[0][None, :] & row_mask) | sets[1][None, :])
  out, lse = partial.merge([p[0] for p in parts], [p[1] for p in parts])
  assert rel_err(out, want) < 1e-6
  chex.assert_trees_all_close(lse, want_lse, rtol=1e-6)
  empty_out, empty_lse = partial.merge([parts[2][0]], [parts[2][1]])
  np.testing.assert_array_equal(empty_out, 0.0)
  assert np.all(np.asarray(empty_lse) == -np.inf)
  grads = jax.grad(lambda outs, lses: jnp.sum(partial.merge(outs, lses)[0]), argnums=(0, 1))(
      [p[0] for p in parts], [p[1] for p in parts])
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
  with pytest.raises(ValueError, match="one LSE per partial"):
    partial.merge([out], [])


def test_dropout_mask_at_any_key_offset():
  """The per-column path (a key range starting at an odd, traced offset) gives the same keep
  decisions as the pair path over the whole row."""
  seed = dropout.seed_words(jax.random.key(6))
  stream = dropout.stream_key(seed[0], seed[1], 1, 2)
  rows = jnp.arange(5)[:, None]
  whole = np.asarray(dropout.keep(stream, rows, 0, 64, 0.4))
  for start in (1, 7, 16, 33):
    got = dropout.keep(stream, rows, jnp.int32(start), 20, 0.4, even_start=False)
    np.testing.assert_array_equal(got, whole[:, start:start + 20], err_msg=str(start))
