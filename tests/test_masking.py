"""The mask model (`jaxflash.masking`) and the block schedule (`jaxflash.schedule`) against a
brute-force visibility matrix built from the definitions.

Every backend skips blocks by the schedule and masks inside visited blocks with `visible`; a range
that misses a block holding a visible entry silently drops attention weight, so the ranges are
checked to *cover* every such block (and to be tight where they can be), also with query and key
offsets (absolute positions).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import _checks
from jaxflash import masking
from jaxflash import schedule
from jaxflash.backends import mosaic, triton
from jaxflash.masking import Positions, Window, make_window
from jaxflash.ops import flash
from jaxflash.reference import reference_attention
from jaxflash.schedule import Schedule, block_at, walk
from checks import ON_GPU, SMALL_CONFIGS, TOLERANCE, random_qkv, rel_err

BLOCKS = (1, 3, 8, 16)
NUM_CASES = 200


def brute_visible(t, s, is_causal, window_size, q_len, kv_len, q_offset=0, kv_offset=0):
  """Dense [t, s] visibility from the definitions, without `jaxflash.masking`: local row r is at
  absolute position q_offset + r, local key c at kv_offset + c."""
  ok = (np.arange(s)[None, :] < kv_len) & (np.arange(t)[:, None] < q_len)
  q = q_offset + np.arange(t)[:, None]
  k = kv_offset + np.arange(s)[None, :]
  if is_causal:
    ok = ok & (k <= q)
  if window_size is not None:
    left, right = (window_size, window_size) if isinstance(window_size, int) else window_size
    ok = ok & (q - left <= k) & (k <= q + right)
  return np.broadcast_to(ok, (t, s))


def block_visibility(vis, bq, bk):
  """[num_q_blocks, num_k_blocks]: does the tile hold any visible entry?"""
  t, s = vis.shape
  nq, nk = -(-t // bq), -(-s // bk)
  padded = np.zeros((nq * bq, nk * bk), bool)
  padded[:t, :s] = vis
  return padded.reshape(nq, bq, nk, bk).any(axis=(1, 3))


def random_window(rng):
  """(kind, is_causal, local_window_size) covering full, causal, windows and both combined."""
  kind = rng.choice(["full", "causal", "pair", "int", "causal_pair", "causal_int"])
  size = lambda: int(rng.choice([0, 0, 1, 2, 5, 17, 80]))
  window_size = {"pair": (size(), size()), "causal_pair": (size(), size()),
                 "int": size(), "causal_int": size()}.get(kind)
  return kind, kind.startswith("causal"), window_size


def random_cases(seed, n=NUM_CASES):
  rng = np.random.default_rng(seed)
  for _ in range(n):
    t, s = int(rng.integers(1, 71)), int(rng.integers(1, 71))
    kind, is_causal, window_size = random_window(rng)
    # Lengths: mostly full or nearly so, sometimes short or zero.
    q_len = int(rng.choice([t, t, int(rng.integers(0, t + 1))]))
    kv_len = int(rng.choice([s, s, int(rng.integers(0, s + 1))]))
    yield dict(t=t, s=s, kind=kind, is_causal=is_causal, window_size=window_size, q_len=q_len,
               kv_len=kv_len, bq=int(rng.choice(BLOCKS)), bk=int(rng.choice(BLOCKS)),
               seed=int(rng.integers(1 << 30)))


def _cdiv(a, b):
  return -(-a // b)


def _as_ints(pair):
  return tuple(np.asarray(x).tolist() for x in pair)


# ---------------------------------------------------------------------------------------------
# make_window


@pytest.mark.parametrize("is_causal, window_size, want", [
    (False, None, Window(None, None)),
    (True, None, Window(None, 0)),
    (False, 3, Window(3, 3)),
    (False, 0, Window(0, 0)),
    (False, (2, 7), Window(2, 7)),
    (True, 4, Window(4, 0)),
    (True, (2, 5), Window(2, 0)),
    (True, (6, 0), Window(6, 0)),
    (False, (0, 9), Window(0, 9)),
])
def test_make_window(is_causal, window_size, want):
  """Causal is the window (None, 0) and intersects with a local window: the band `visible`
  draws from the merged window is the brute-force one of the two options together."""
  got = make_window(is_causal, window_size)
  assert got == want
  vis = masking.visible(jnp.arange(30)[:, None], jnp.arange(40)[None, :], got)
  want_vis = brute_visible(30, 40, is_causal, window_size, 30, 40)
  if vis is None:
    assert want_vis.all() and got.is_full
  else:
    np.testing.assert_array_equal(np.broadcast_to(vis, (30, 40)), want_vis)
    assert not got.is_full


# ---------------------------------------------------------------------------------------------
# Block ranges


def _check_kv_ranges(case, vis, window):
  """For every query block: Python-int ranges cover the visible key blocks (tight if exact)."""
  t, s, bq, bk, q_len, kv_len = (case[x] for x in ("t", "s", "bq", "bk", "q_len", "kv_len"))
  tiles = block_visibility(vis, bq, bk)
  exact = case["kind"] in ("full", "causal")
  ranges = []
  for i in range(tiles.shape[0]):
    q0, q1 = i * bq, min((i + 1) * bq, t)
    lo, hi = schedule.kv_block_range(q0, min(q1, q_len), kv_len, window, bk)
    assert isinstance(lo, int) and isinstance(hi, int), "Python ints in, Python ints out"
    ranges.append((lo, hi))
    needed = np.flatnonzero(tiles[i])
    where = f"{case}, query block {i} = rows [{q0}, {q1}): range [{lo}, {hi}), needs {needed}"
    assert lo >= 0 and hi <= _cdiv(kv_len, bk), "range past the valid keys: " + where
    if needed.size:
      assert lo <= needed[0] and needed[-1] < hi, "range misses a visible key block: " + where
      if exact:
        assert (lo, hi) == (needed[0], needed[-1] + 1), "full/causal range not tight: " + where
  return ranges


def _check_q_ranges(case, vis, window):
  """For every key block: Python-int ranges cover the query blocks that see it (tight if exact)."""
  t, s, bq, bk, q_len, kv_len = (case[x] for x in ("t", "s", "bq", "bk", "q_len", "kv_len"))
  tiles = block_visibility(vis, bq, bk)
  exact = case["kind"] in ("full", "causal")
  ranges = []
  for j in range(tiles.shape[1]):
    k0, k1 = j * bk, min((j + 1) * bk, s)
    lo, hi = schedule.q_block_range(k0, min(k1, kv_len), q_len, window, bq)
    assert isinstance(lo, int) and isinstance(hi, int), "Python ints in, Python ints out"
    ranges.append((lo, hi))
    needed = np.flatnonzero(tiles[:, j])
    where = f"{case}, key block {j} = keys [{k0}, {k1}): range [{lo}, {hi}), needs {needed}"
    assert lo >= 0 and hi <= _cdiv(q_len, bq), "range past the valid queries: " + where
    if needed.size:
      assert lo <= needed[0] and needed[-1] < hi, "range misses a query block: " + where
      if exact:
        assert (lo, hi) == (needed[0], needed[-1] + 1), "full/causal range not tight: " + where
  return ranges


_PAD = 80  # one array length for every case, so eager ops compile once, not once per shape


def _traced_ranges(fn, starts, stops, length, window, block):
  """The same ranges computed on int32 arrays (vmapped over blocks, so the indices are traced)."""
  n = len(starts)
  pad = lambda x: jnp.asarray(np.pad(x, (0, _PAD - n), mode="edge"), jnp.int32)
  f = jax.vmap(lambda a, b, m: fn(a, b, m, window, block), in_axes=(0, 0, None))
  lo, hi = f(pad(starts), pad(stops), jnp.int32(length))
  return list(zip(np.broadcast_to(np.asarray(lo), (_PAD,))[:n].tolist(),
                  np.broadcast_to(np.asarray(hi), (_PAD,))[:n].tolist()))


def test_block_ranges_cover_visible_blocks():
  """kv_block_range / q_block_range cover every tile with a visible entry; int32 agrees."""
  seen_kinds = set()
  for case in random_cases(seed=0):
    t, s, bq, bk, q_len, kv_len = (case[x] for x in ("t", "s", "bq", "bk", "q_len", "kv_len"))
    seen_kinds.add(case["kind"])
    window = make_window(case["is_causal"], case["window_size"])
    vis = brute_visible(t, s, case["is_causal"], case["window_size"], q_len, kv_len)
    kv_ranges = _check_kv_ranges(case, vis, window)
    q_ranges = _check_q_ranges(case, vis, window)

    q0 = np.arange(0, t, bq)
    q_stop = np.minimum(np.minimum(q0 + bq, t), q_len)
    assert _traced_ranges(schedule.kv_block_range, q0, q_stop, kv_len, window, bk) == kv_ranges, \
        case
    k0 = np.arange(0, s, bk)
    k_stop = np.minimum(np.minimum(k0 + bk, s), kv_len)
    assert _traced_ranges(schedule.q_block_range, k0, k_stop, q_len, window, bq) == q_ranges, \
        case
  assert seen_kinds == {"full", "causal", "pair", "int", "causal_pair", "causal_int"}


@pytest.mark.parametrize("seed", range(4))
def test_block_ranges_int32_scalars(seed):
  """Plain jnp.int32 scalars (outside any transform) give the Python-int answers."""
  rng = np.random.default_rng(100 + seed)
  for case in random_cases(seed=100 + seed, n=15):
    t, s, bq, bk, q_len, kv_len = (case[x] for x in ("t", "s", "bq", "bk", "q_len", "kv_len"))
    window = make_window(case["is_causal"], case["window_size"])
    q0 = int(rng.integers(0, t)) // bq * bq
    q_stop = min(q0 + bq, t, q_len)
    want = schedule.kv_block_range(q0, q_stop, kv_len, window, bk)
    got = schedule.kv_block_range(jnp.int32(q0), jnp.int32(q_stop), jnp.int32(kv_len), window, bk)
    assert _as_ints(got) == want, case
    k0 = int(rng.integers(0, s)) // bk * bk
    k_stop = min(k0 + bk, s, kv_len)
    want = schedule.q_block_range(k0, k_stop, q_len, window, bq)
    got = schedule.q_block_range(jnp.int32(k0), jnp.int32(k_stop), jnp.int32(q_len), window, bq)
    assert _as_ints(got) == want, case


def test_block_ranges_under_jit():
  """Inside jit, with every index traced, the ranges match the Python-int ones."""
  window = make_window(True, (5, 3))
  f = jax.jit(lambda a, b, n: (schedule.kv_block_range(a, b, n, window, 8),
                               schedule.q_block_range(a, b, n, window, 8)))
  for a, b, n in [(0, 8, 40), (16, 24, 40), (32, 37, 37), (24, 20, 20), (8, 16, 0)]:
    kv, q = f(jnp.int32(a), jnp.int32(b), jnp.int32(n))
    assert _as_ints(kv) == schedule.kv_block_range(a, b, n, window, 8), (a, b, n)
    assert _as_ints(q) == schedule.q_block_range(a, b, n, window, 8), (a, b, n)


def test_causal_skips_upper_blocks():
  """Causal attention visits only blocks on or below the diagonal (what makes it cost half)."""
  window = make_window(True, None)
  for i in range(8):
    assert schedule.kv_block_range(16 * i, 16 * i + 16, 128, window, 16) == (0, i + 1)
    assert schedule.q_block_range(16 * i, 16 * i + 16, 128, window, 16) == (i, 8)


def test_empty_ranges():
  """No valid keys (or queries) means an empty range, never a negative or past-the-end one."""
  for window in (make_window(False, None), make_window(True, None), make_window(False, (3, 2))):
    lo, hi = schedule.kv_block_range(0, 16, 0, window, 8)
    assert hi <= lo and hi == 0
    lo, hi = schedule.q_block_range(0, 16, 0, window, 8)
    assert hi <= lo and hi == 0
  # Query rows far right of the last valid key, with a left window: nothing to visit.
  lo, hi = schedule.kv_block_range(48, 56, 10, make_window(False, (4, 4)), 8)
  assert hi <= lo


# ---------------------------------------------------------------------------------------------
# visible


def test_visible_none_when_nothing_imposed():
  """With a full window and no other argument, `visible` traces nothing and returns None."""
  q, k = jnp.arange(4)[:, None], jnp.arange(5)[None, :]
  assert masking.visible(q, k, Window()) is None
  assert masking.visible(q, k, make_window(False, None), q_len=None, kv_len=None) is None
  assert masking.visible(q, k, make_window(True, None)) is not None


def test_visible_matches_brute_force():
  """`visible` equals the dense definition for windows, lengths, segment ids and a dense mask.

  Each case looks at a fixed-size tile of rows/cols at random offsets (the shape stays the same
  so eager ops compile once); lengths, segment ids and the mask are random.
  """
  rng = np.random.default_rng(7)
  rows, cols = 24, 20
  for case in random_cases(seed=7, n=150):
    q_len, kv_len = case["q_len"], case["kv_len"]
    q_off, k_off = int(rng.integers(0, 50)), int(rng.integers(0, 50))
    window = make_window(case["is_causal"], case["window_size"])
    full = brute_visible(q_off + rows, k_off + cols, case["is_causal"], case["window_size"],
                         np.inf, np.inf)
    want = full[q_off:, k_off:]
    q_idx = q_off + np.arange(rows)[:, None]
    k_idx = k_off + np.arange(cols)[None, :]
    kwargs = {}
    if rng.random() < 0.5:
      kwargs["q_len"] = jnp.int32(q_len) if rng.random() < 0.5 else q_len
      want = want & (q_idx < q_len)
    if rng.random() < 0.5:
      kwargs["kv_len"] = jnp.int32(kv_len) if rng.random() < 0.5 else kv_len
      want = want & (k_idx < kv_len)
    if rng.random() < 0.5:
      q_seg = np.sort(rng.integers(0, 3, rows))
      kv_seg = np.sort(rng.integers(0, 3, cols))
      kwargs["q_segment"] = jnp.asarray(q_seg)[:, None]
      kwargs["kv_segment"] = jnp.asarray(kv_seg)[None, :]
      want = want & (q_seg[:, None] == kv_seg[None, :])
    if rng.random() < 0.5:
      dense = rng.random((rows, cols)) < 0.7
      kwargs["dense_mask"] = jnp.asarray(dense)
      want = want & dense
    got = masking.visible(jnp.asarray(q_idx), jnp.asarray(k_idx), window, **kwargs)
    if got is None:
      assert window.is_full and not kwargs, case
      continue
    got = np.broadcast_to(np.asarray(got), (rows, cols))
    assert got.dtype == bool
    np.testing.assert_array_equal(got, want, err_msg=f"{case} {q_off=} {k_off=} {sorted(kwargs)}")


def test_visible_batched_lengths_and_offsets():
  """Per-batch lengths broadcast to [B, rows, cols]; offset tiles give the matching sub-block."""
  t, s, q_off, k_off, bq, bk = 40, 50, 8, 16, 8, 16
  q_len, kv_len = np.array([40, 11, 0]), np.array([50, 20, 33])
  window = make_window(True, (6, 2))
  rows = jnp.asarray(q_off + np.arange(bq))[:, None]
  cols = jnp.asarray(k_off + np.arange(bk))[None, :]
  seg = np.repeat(np.arange(5), 10)
  got = masking.visible(rows, cols, window, q_len=jnp.asarray(q_len)[:, None, None],
                        kv_len=jnp.asarray(kv_len)[:, None, None],
                        q_segment=jnp.asarray(seg[q_off:q_off + bq])[:, None],
                        kv_segment=jnp.asarray(seg[k_off:k_off + bk])[None, :])
  assert got.shape == (3, bq, bk)
  for b in range(3):
    want = brute_visible(t, s, True, (6, 2), q_len[b], kv_len[b])
    want = want & (seg[:t, None] == seg[None, :s])
    np.testing.assert_array_equal(got[b], want[q_off:q_off + bq, k_off:k_off + bk],
                                  err_msg=f"batch row {b}")


def test_visible_under_jit():
  """`visible` traces with lengths as jit arguments and agrees with the eager result."""
  window = make_window(False, (3, 1))
  f = jax.jit(lambda ql, kl: masking.visible(jnp.arange(12)[:, None], jnp.arange(9)[None, :],
                                             window, q_len=ql, kv_len=kl))
  for q_len, kv_len in [(12, 9), (5, 9), (12, 4), (0, 3)]:
    np.testing.assert_array_equal(f(jnp.int32(q_len), jnp.int32(kv_len)),
                                  brute_visible(12, 9, False, (3, 1), q_len, kv_len))


def test_full_block_range_is_sound_and_tight():
  """kv_full_block_range names only tiles where every (row that matters, key) is visible, and,
  for full and causal attention, every such tile; int32 arguments give the same answer."""
  for case in random_cases(seed=7):
    t, s, bq, bk, q_len, kv_len = (case[x] for x in ("t", "s", "bq", "bk", "q_len", "kv_len"))
    window = make_window(case["is_causal"], case["window_size"])
    vis = brute_visible(t, s, case["is_causal"], case["window_size"], q_len, kv_len)
    nk = _cdiv(s, bk)
    for i in range(_cdiv(t, bq)):
      q0, q_stop = i * bq, min((i + 1) * bq, t, q_len)
      if q_stop <= q0:
        continue  # the whole tile is query padding: kernels visit nothing
      lo, hi = schedule.kv_full_block_range(q0, q_stop, kv_len, window, bk)
      traced = schedule.kv_full_block_range(jnp.int32(q0), jnp.int32(q_stop), jnp.int32(kv_len),
                                           window, bk)
      assert _as_ints(traced) == (lo, hi), case
      full = [j for j in range(nk) if (j + 1) * bk <= s and vis[q0:q_stop, j * bk:(j + 1) * bk].all()]
      named = list(range(max(lo, 0), min(hi, nk)))
      where = f"{case}, query block {i}: named {named}, full {full}"
      assert set(named) <= set(full), "a named block has a hidden entry: " + where
      if case["kind"] in ("full", "causal"):
        assert named == full, "full/causal full-block range not tight: " + where


def test_full_query_block_range_is_sound_and_tight():
  """The transpose (dK/dV's walk): `Schedule.q_block_ranges` names as full only query blocks
  whose every row before q_len sees every key of the key block (which must lie before kv_len),
  inside the visited range; for full and causal attention, every such block."""
  for case in random_cases(seed=11):
    t, s, bq, bk, q_len, kv_len = (case[x] for x in ("t", "s", "bq", "bk", "q_len", "kv_len"))
    window = make_window(case["is_causal"], case["window_size"])
    vis = brute_visible(t, s, case["is_causal"], case["window_size"], q_len, kv_len)
    sched = Schedule(window, bq, bk)
    for j in range(_cdiv(s, bk)):
      k0 = j * bk
      lo, full_lo, full_hi, hi = _as_ints(sched.q_block_ranges(k0, Positions(q_len, kv_len)))
      assert hi <= lo or lo <= full_lo <= full_hi <= hi, case
      full = [i for i in range(lo, hi) if k0 + bk <= kv_len
              and vis[i * bq:min((i + 1) * bq, q_len), k0:k0 + bk].all()]
      named = list(range(full_lo, full_hi))
      where = f"{case}, key block {j}: named {named}, full {full}"
      assert set(named) <= set(full), "a named block has a hidden entry: " + where
      if case["kind"] in ("full", "causal"):
        assert named == full, "full/causal full-block range not tight: " + where


# ---------------------------------------------------------------------------------------------
# Positions: offsets in the element mask and the schedule


def _offset_cases(seed, n):
  rng = np.random.default_rng(seed)
  for case in random_cases(seed, n):
    # Offsets either way round, so the diagonal moves both ways; sometimes equal (diagonal 0).
    q_off = int(rng.integers(0, 90))
    kv_off = q_off if rng.random() < 0.2 else int(rng.integers(0, 90))
    yield dict(case, q_off=q_off, kv_off=kv_off)


def test_visible_with_offsets_matches_brute_force():
  """The band compares absolute positions; lengths index the call's own rows and keys.

  One fixed 70 x 70 tile for every case (eager ops then compile once); each case compares its
  own [t, s] corner.
  """
  rows, cols = jnp.arange(70)[:, None], jnp.arange(70)[None, :]
  for case in _offset_cases(seed=21, n=80):
    t, s, q_len, kv_len = (case[x] for x in ("t", "s", "q_len", "kv_len"))
    window = make_window(case["is_causal"], case["window_size"])
    pos = Positions(q_len, kv_len, jnp.int32(case["q_off"]), jnp.int32(case["kv_off"]))
    got = masking.visible(rows, cols, window, diagonal=pos.diagonal, q_len=jnp.int32(q_len),
                          kv_len=jnp.int32(kv_len))
    want = brute_visible(t, s, case["is_causal"], case["window_size"], q_len, kv_len,
                         case["q_off"], case["kv_off"])
    np.testing.assert_array_equal(np.asarray(got)[:t, :s], want, err_msg=str(case))


def test_schedule_with_offsets_is_sound():
  """With offsets, every key block holding a visible entry is visited, and a block the
  schedule visits unmasked is entirely visible to every valid row; the transpose (dK/dV)
  visits every query block that sees a key block. Positions are int32 scalars, as in a kernel."""
  for case in _offset_cases(seed=22, n=60):
    t, s, bq, bk, q_len, kv_len = (case[x] for x in ("t", "s", "bq", "bk", "q_len", "kv_len"))
    window = make_window(case["is_causal"], case["window_size"])
    sched = Schedule(window, bq, bk)
    pos = Positions(*(jnp.int32(x) for x in (q_len, kv_len, case["q_off"], case["kv_off"])))
    vis = brute_visible(t, s, case["is_causal"], case["window_size"], q_len, kv_len,
                        case["q_off"], case["kv_off"])
    tiles = block_visibility(vis, bq, bk)
    nq, nk = tiles.shape
    for i in range(nq):
      lo, full_lo, full_hi, hi = _as_ints(sched.kv_blocks(jnp.int32(i * bq), pos))
      needed = np.flatnonzero(tiles[i])
      where = f"{case}, query block {i}: [{lo}, {hi}) full [{full_lo}, {full_hi})"
      if needed.size:
        assert lo <= needed[0] and needed[-1] < hi, "misses a visible block: " + where
      if hi > lo:
        assert lo <= full_lo <= full_hi <= hi, where
      else:
        assert full_hi <= full_lo, "an empty range has full blocks: " + where
      valid_rows = slice(i * bq, min((i + 1) * bq, t, q_len))
      for j in range(full_lo, full_hi):
        assert (j + 1) * bk <= s and vis[valid_rows, j * bk:(j + 1) * bk].all(), \
            "not full: " + where
    for j in range(nk):
      lo, hi = _as_ints(sched.q_blocks(jnp.int32(j * bk), pos))
      needed = np.flatnonzero(tiles[:, j])
      if needed.size:
        assert lo <= needed[0] and needed[-1] < hi, f"{case}, key block {j}: [{lo}, {hi})"


def test_schedule_offsets_equal_to_shifted_call():
  """A query block at rows [r, r + bq) of a call with q_offset = p visits exactly the key blocks
  that rows [p + r, p + r + bq) of a call without offsets visit (block-aligned p)."""
  window = make_window(True, (40, 0))
  sched = Schedule(window, 16, 16)
  for p in (0, 16, 48, 160):
    for r in (0, 16, 32):
      shifted = sched.kv_blocks(jnp.int32(r), Positions(jnp.int32(64), jnp.int32(400),
                                                         jnp.int32(p), jnp.int32(0)))
      plain = sched.kv_blocks(jnp.int32(p + r), Positions(jnp.int32(p + 64), jnp.int32(400)))
      assert _as_ints(shifted) == _as_ints(plain), (p, r)


def test_visit_kv_runs_body_over_the_schedule():
  """`Schedule.visit_kv` calls the body once per visited block, in order, unmasked exactly on
  the full blocks; `visit_q` repeats its blocks once per query head of a group."""
  sched = Schedule(make_window(True, None), 8, 8)
  pos = Positions(jnp.int32(40), jnp.int32(40))

  def body(j, seen, masked):
    return seen.at[j].set(jnp.where(masked, 1, 2))

  seen = sched.visit_kv(jnp.int32(24), pos, body, jnp.zeros(5, jnp.int32))
  np.testing.assert_array_equal(seen, [2, 2, 2, 1, 0])  # blocks 0-2 full, 3 diagonal, 4 skipped
  # Clipped walks (a peeled first block, then the rest) visit the same blocks the same way.
  first = sched.visit_kv(jnp.int32(24), pos, body, jnp.zeros(5, jnp.int32), count=1)
  np.testing.assert_array_equal(first, [2, 0, 0, 0, 0])
  rest = sched.visit_kv(jnp.int32(24), pos, body, jnp.zeros(5, jnp.int32), skip=1)
  np.testing.assert_array_equal(rest, [0, 2, 2, 1, 0])
  middle = sched.visit_kv(jnp.int32(24), pos, body, jnp.zeros(5, jnp.int32), skip=2, count=1)
  np.testing.assert_array_equal(middle, [0, 0, 2, 0, 0])
  band = Schedule(make_window(True, 8), 8, 8)  # a window: blocks 2 (masked), 3 (diagonal)
  tail = band.visit_kv(jnp.int32(24), pos, body, jnp.zeros(5, jnp.int32), skip=1)
  whole = band.visit_kv(jnp.int32(24), pos, body, jnp.zeros(5, jnp.int32))
  np.testing.assert_array_equal(tail, np.where(np.arange(5) > int(np.argmax(whole > 0)), whole, 0))
  counts = sched.visit_q(jnp.int32(16), pos, lambda g, i, c: c.at[g, i].add(1),
                         jnp.zeros((3, 5), jnp.int32), repeat=3)
  np.testing.assert_array_equal(counts, [[0, 0, 1, 1, 1]] * 3)


@pytest.mark.parametrize("reverse", [False, True])
def test_visit_q_split_walks_each_head_in_order(reverse):
  """`Schedule.visit_q_split` visits each query head's blocks in increasing order (decreasing with
  ``reverse``, the one-pass backward's walk), the masked ones exactly where `visit_q_split`'s
  ranges say, heads one after another."""
  sched = Schedule(make_window(True, None), 8, 8)  # causal: the diagonal block is masked
  pos = Positions(jnp.int32(40), jnp.int32(40))
  lo, full_lo, full_hi, hi = (int(x) for x in sched.q_block_ranges(jnp.int32(8), pos))
  assert (lo, full_lo, full_hi, hi) == (1, 2, 5, 5)

  def body(visit, g, i, log, masked):
    n, rows = log
    assert_visit = jnp.where(visit == n, 0, 10)  # the ordinal counts the visits from 0
    return n + 1, rows.at[n].set(jnp.stack([g, i, jnp.int32(masked) + assert_visit]))

  n, rows = sched.visit_q_split(jnp.int32(8), pos, body, (jnp.int32(0), jnp.zeros((12, 3),
                                                                                  jnp.int32)),
                                repeat=2, reverse=reverse)
  blocks = list(range(lo, hi))[::-1] if reverse else list(range(lo, hi))
  want = [(g, i, int(not full_lo <= i < full_hi)) for g in range(2) for i in blocks]
  assert int(n) == len(want)
  assert [tuple(int(x) for x in row) for row in rows[:len(want)]] == want


@pytest.mark.parametrize("stagger", [0, 2, 7])
def test_staggered_q_walk_and_its_producer_order(stagger):
  """`Schedule.q_spans_from` (the atomic backward's `Backward.stagger`): the full query blocks'
  run starts ``stagger`` blocks in (mod its length) and wraps round, the masked blocks keep
  their places, and `block_at` gives the producer the same block for each visit."""
  sched = Schedule(make_window(True, None), 8, 8)  # causal: the diagonal block is masked
  pos = Positions(jnp.int32(40), jnp.int32(40))  # (key block 1: blocks 1 masked, 2-4 full)
  spans = sched.q_spans_from(jnp.int32(8), pos, jnp.int32(stagger))
  log = walk(spans, lambda n, i, c, masked: c.at[n].set(jnp.stack([i, jnp.int32(masked)])),
             jnp.zeros((4, 2), jnp.int32))
  want = [(1, 1)] + [(2 + (m + stagger) % 3, 0) for m in range(3)]
  assert [tuple(int(x) for x in row) for row in log] == want
  assert [int(block_at(spans, jnp.int32(p))) for p in range(4)] == [i for i, _ in want]


@pytest.mark.parametrize("name", ["triton", "mosaic"])
def test_a_dense_mask_without_a_block_table_masks_every_block(name):
  """Kernels handed a dense mask but no block table visit every key block masked, forward and
  backward (`Schedule.of`): no attention here is causal or windowed, so every block counts as
  full and only that guard applies the mask. `_checks.normalise` always adds the table today,
  so no call through the API reaches the guard: a mutant of Triton's that dropped it passed
  every other test, and Mosaic's backward had left it out, its dQ wrong (2026-12-05)."""
  backend = {"triton": triton, "mosaic": mosaic}[name].BACKEND
  b, t, s, n, k, h = 2, 70, 133, 2, 1, 64
  q, kk, v, d_out = random_qkv(3, b, t, s, n, k, h, jnp.bfloat16)
  mask = jax.random.bernoulli(jax.random.key(1), 0.6, (b, 1, t, s))
  call = _checks.normalise(q, kk, v, mask=mask, interpret=not ON_GPU)
  inputs = call.inputs._replace(block_table=None)

  def kernel(q, kk, v):
    return flash.attention(inputs._replace(query=q, key=kk, value=v), call.params, backend,
                           SMALL_CONFIGS[name])[0]

  def reference(q, kk, v):
    return reference_attention(q, kk, v, mask=mask)[0]

  def out_and_grads(fn, *args):
    out, vjp = jax.vjp(fn, *args)
    return (out, *vjp(d_out.astype(out.dtype)))

  got = jax.jit(lambda *x: out_and_grads(kernel, *x))(q, kk, v)
  want = out_and_grads(reference, *(x.astype(jnp.float32) for x in (q, kk, v)))
  for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert rel_err(g, w) < TOLERANCE[jnp.bfloat16], what
