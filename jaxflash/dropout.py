"""Attention dropout without a stored mask: keep/drop is a hash of the element's coordinates.

FlashAttention never materialises P, so it cannot store a T x S dropout mask either. Instead the
decision for entry (batch ``b``, query head ``n``, query row ``t``, key column ``s``) is a pure
function of those four integers and a 64-bit seed drawn from the user's ``dropout_rng``. The
forward kernel, both backward kernels and the pure-JAX backend all call `keep` below on whatever
coordinates they hold, so they agree on every element without passing anything of size T x S.

The generator is counter-based, built from one 32-bit mixing function `_mix` (xor-shift-multiply,
a bijection on uint32 with strong avalanche). The seed words, the batch index and the head index
are absorbed one at a time into a per-(b, n) stream key; each query row hashes its index into
that key (``bq`` values per tile, cheap); each pair of key columns (2c, 2c + 1) is spread by a
multiplication with an odd constant; and one more mix of the row and pair words gives 32 bits per
pair, whose low 16 bits decide the even column and high 16 bits the odd one. A pair therefore
costs one xor, two multiplies, three xor-shifts and two compares, all on uint32: this integer
work is what dropout costs on the GPU, and sharing a hash between two entries halves it. An
entry is kept when its 16 bits are >= ``round(rate * 2**16)``, so the drop probability is
``rate`` to within 2**-17; kept entries are scaled by the exact ``1 / P(keep)`` (within 1e-5 of
Flax's ``1 / (1 - rate)``), which keeps the output unbiased. Because the row and pair words are
bijective in the index, two pairs of one row never share a hash.

With ``broadcast_dropout`` the batch and head coordinates are taken as 0 for every element: one
[T, S] mask shared by all batch rows and heads, which is what ``flax.linen``'s
``broadcast_dropout=True`` means.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Multipliers of a 32-bit xor-shift-multiply finaliser from the published hash-prospector search
# (C. Wellons), and the 32-bit golden-ratio constant for spreading column indices.
_M1, _M2 = 0x21F0AAAD, 0x735A2D97
_GOLDEN = 0x9E3779B9
_SALT = 0x6A09E667  # separates the seed absorption from an all-zero seed


def as_u32(x):
  """``x`` as uint32 (the integer type every hash here works in)."""
  return jnp.asarray(x).astype(jnp.uint32)



def _mix(x):
  """Bijective uint32 -> uint32 mixer (every output bit depends on every input bit)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(_M1)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(_M2)
  return x ^ (x >> 15)


def _lift(x, rank: int):
  """``x`` with leading axes of size 1 up to ``rank`` (Python ints and scalars stay as they are)."""
  if isinstance(x, int) or jnp.ndim(x) in (0, rank):
    return x
  return jnp.reshape(x, (1,) * (rank - jnp.ndim(x)) + jnp.shape(x))


def seed_words(rng: jax.Array) -> jax.Array:
  """Two uint32 words drawn from a PRNG key (typed or raw); the generator's whole state."""
  return jax.random.bits(rng, (2,), jnp.uint32)


def threshold(rate: float) -> int:
  """16-bit hash halves below this are dropped: ``P(drop) = threshold / 2**16``."""
  return min(round(rate * 2.0**16), 2**16 - 1)


def keep_probability(rate: float) -> float:
  """The exact probability that an entry is kept (``1 - rate`` to within 2**-17; at least
  2**-16, where a rate above 1 - 2**-17 would round to keeping none)."""
  return 1.0 - threshold(rate) / 2.0**16


def stream_key(seed0, seed1, batch, head):
  """Per-(batch, head) key; scalars inside a kernel, broadcastable arrays outside."""
  h = _mix(as_u32(seed0) ^ jnp.uint32(_SALT))
  h = _mix(h ^ as_u32(seed1))
  h = _mix(h ^ as_u32(batch))
  return _mix(h ^ as_u32(head))


def keep(stream, rows, first_col, num_cols: int, rate: float, even_start: bool = True):
  """Boolean keep mask [..., R, num_cols] for query ``rows`` [..., R, 1] and the key columns
  ``first_col ... first_col + num_cols - 1`` of one stream.

  Positions are absolute, so any tiling (and any split of the keys across calls) gives the same
  mask. Columns come in pairs ``(2c, 2c + 1)``: one 32-bit hash per pair, its low 16 bits decide
  the even column and its high 16 bits the odd one, which halves the integer work per element
  when ``first_col`` is known to be even (``even_start``). Otherwise (a call whose keys start at
  a traced offset) each column computes its pair's hash itself: the same mask, twice the work.
  """
  cut = jnp.uint32(threshold(rate))
  # Explicit ranks (stream, rows and column words broadcast against each other), so that
  # jax_numpy_rank_promotion="raise" has nothing to object to.
  rank = max(jnp.ndim(stream), jnp.ndim(rows), jnp.ndim(first_col), 1)
  stream, rows, first_col = (_lift(x, rank) for x in (stream, rows, first_col))
  row_key = row_keys(stream, rows)
  if not even_start:
    return keep_entries(row_key, first_col + _lift(jnp.arange(num_cols), rank), rate)
  if num_cols % 2:
    return keep(stream, rows, first_col, num_cols + 1, rate)[..., :num_cols]
  pairs = as_u32(first_col // 2 + _lift(jnp.arange(num_cols // 2), rank))
  bits = _mix(row_key ^ (pairs * jnp.uint32(_GOLDEN)))
  even = (bits & jnp.uint32(0xFFFF)) >= cut
  odd = (bits >> 16) >= cut
  shape = even.shape[:-1] + (num_cols,)
  return jnp.stack([even, odd], axis=-1).reshape(shape)


def row_keys(stream, rows):
  """The hash key of each absolute query row of a stream (`keep_entries` takes it)."""
  return _mix(stream ^ as_u32(rows))


def keep_entries(row_key, cols, rate: float):
  """`keep`'s mask entry by entry: ``row_key`` (from `row_keys`) and absolute key columns
  ``cols`` broadcast against each other, in any layout (a kernel's register tiles, say). Each
  entry computes its column pair's hash itself: the same mask as `keep`, twice the work."""
  cols = as_u32(cols)
  bits = _mix(row_key ^ ((cols >> 1) * jnp.uint32(_GOLDEN)))
  return jnp.where((cols & 1) == 1, bits >> 16, bits & jnp.uint32(0xFFFF)) >= jnp.uint32(
      threshold(rate))


def dense_keep_mask(seed: jax.Array, shape: tuple[int, int, int, int], rate: float,
                    broadcast: bool = False) -> jax.Array:
  """The whole [B, N, T, S] keep mask that the kernels use for ``seed`` (for tests/references).

  This materialises T x S booleans; the kernels never do.
  """
  b, n, t, s = shape
  batch = jnp.zeros((b, 1, 1, 1), jnp.int32) if broadcast else jnp.arange(b)[:, None, None, None]
  head = jnp.zeros((1, n, 1, 1), jnp.int32) if broadcast else jnp.arange(n)[None, :, None, None]
  stream = stream_key(seed[0], seed[1], batch, head)
  return keep(stream, jnp.arange(t)[:, None], 0, s, rate)
