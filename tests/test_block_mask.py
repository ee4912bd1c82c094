"""Block masks and mask_mod: the block tables, the mask_mod split, the lists the kernels walk, and
every backend against a float32 reference given the same mask as a dense array.

CPU tests run the xla backend and the Triton kernels in interpret mode; the `gpu` tests run the
Mosaic and Triton kernels compiled, in bf16, with the shipped tiles.
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import block_mask as bm
from jaxflash import dense_mask
from jaxflash import mask_mod as mm
from jaxflash.backends import UnsupportedCallError
from jaxflash.masking import make_window
from jaxflash.schedule import block_lists
from checks import (F32_TOLERANCE, ON_GPU, TOLERANCE, attention, check, dense_mask_of,
                    random_qkv, rel_err, variant_if)
from jaxflash.reference import reference_attention

B, N = 2, 4
_rng = np.random.RandomState(0)
DOCS = jnp.asarray(np.sort(_rng.randint(0, 5, (B, 1200)), axis=1), jnp.int32)
PREFIX = jnp.asarray([7, 90], jnp.int32)
TABLE = jnp.asarray(_rng.rand(20, 20) < 0.5)

# Each takes (batch, head, q_idx, kv_idx) on broadcasting int32 arrays (FlexAttention's mask_mod).
MASK_MODS = {
    "causal": lambda b, h, q, k: q >= k,
    "documents": lambda b, h, q, k: (DOCS[b, q] == DOCS[b, k]) & (q >= k),
    "prefix_lm": lambda b, h, q, k: (k <= q) | (k < PREFIX[b]),
    "sliding_window": lambda b, h, q, k: (q >= k) & (q - k < 24),
    "dilated": lambda b, h, q, k: ((q - k) % 3 == 0) & (q >= k),
    "per_head": lambda b, h, q, k: q - k <= 11 * h,
    "rows_only": lambda b, h, q, k: q < PREFIX[b] + 20,
}
# Kernels cannot index a captured array with both indices: only the xla backend serves it.
GATHER_BOTH = lambda b, h, q, k: TABLE[q // 16, k // 16]  # noqa: E731


def _indices(b, n, t, s):
  return (jnp.arange(b).reshape(b, 1, 1, 1), jnp.arange(n).reshape(1, n, 1, 1),
          jnp.arange(t).reshape(1, 1, t, 1), jnp.arange(s).reshape(1, 1, 1, s))


def _blocks_of(dense, bq, bk):
  """Brute-force block states of a dense [.., T, S] mask (entries past T, S do not count)."""
  t, s = dense.shape[-2:]
  nq, nk = -(-t // bq), -(-s // bk)
  out = np.zeros(dense.shape[:-2] + (nq, nk), np.int8)
  for i in range(nq):
    for j in range(nk):
      tile = dense[..., i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
      out[..., i, j] = np.where(tile.all(axis=(-2, -1)), bm.FULL,
                                np.where(tile.any(axis=(-2, -1)), bm.PARTIAL, bm.EMPTY))
  return out


# --- mask_mod split -------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MASK_MODS))
def test_split_features_and_tile_rule_equal_the_function(name):
  """Row features, column features and the tile rule give the function's mask everywhere."""
  fn, t, s = MASK_MODS[name], 45, 60
  split = mm.split(fn)
  assert split.kernel_reason is None
  rows = split.features(split.row_vars, B, N, t, mm.Q)
  cols = split.features(split.col_vars, B, N, s, mm.KV)
  want = np.asarray(jnp.broadcast_to(fn(*_indices(B, N, t, s)), (B, N, t, s)))
  q_idx, kv_idx = jnp.meshgrid(jnp.arange(t), jnp.arange(s), indexing="ij")
  for b in range(B):
    for h in range(N):
      def tiles(x, dtypes, axis):
        if x is None:
          return []
        vec = [x[f, b % x.shape[1], h % x.shape[2]] for f in range(x.shape[0])]
        return [mm.from_int32(jnp.broadcast_to(v[:, None] if axis == 0 else v[None, :],
                                               (t, s)), d) for v, d in zip(vec, dtypes)]
      got = split.tile((t, s), q_idx, kv_idx, tiles(rows, split.row_dtypes, 0),
                       tiles(cols, split.col_dtypes, 1))
      np.testing.assert_array_equal(np.asarray(got), want[b, h], err_msg=f"{name} {b} {h}")


def test_split_names_what_kernels_cannot_run():
  split = mm.split(GATHER_BOTH)
  assert split.kernel_reason is not None and "dynamic_slice" in split.kernel_reason
  want = jnp.broadcast_to(GATHER_BOTH(*_indices(1, 1, 70, 80)), (1, 1, 70, 80))
  chex.assert_trees_all_equal(split.reference(*_indices(1, 1, 70, 80)), want)


@pytest.mark.parametrize("bad, match", [
    (lambda b, h, q: q >= 0, "four positional arguments"),
    (lambda b, h, q, k: q - k, "booleans"),
    (lambda b, h, q, k: DOCS[b] == k, "one boolean per"),
    (lambda b, h, q, k: undefined_name, "failed on int32 scalar"),  # noqa: F821
    ("not a function", "must be a function"),
])
def test_bad_mask_mod_is_a_value_error_naming_it(bad, match):
  q = jnp.zeros((1, 8, 2, 16))
  with pytest.raises(ValueError, match="mask_mod") as info:
    jaxflash.flash_attention(q, q, q, mask_mod=bad, implementation="xla")
  assert match in str(info.value)


def test_block_mask_arguments_are_checked():
  q = jnp.zeros((2, 40, 4, 16))
  made = jaxflash.create_block_mask(MASK_MODS["causal"], None, None, 40, 40)
  with pytest.raises(ValueError, match="block_mask was made for q_len = 40"):
    jaxflash.flash_attention(q[:, :30], q, q, block_mask=made)
  with pytest.raises(ValueError, match="not both"):
    jaxflash.flash_attention(q, q, q, block_mask=made, mask_mod=MASK_MODS["dilated"])
  with pytest.raises(ValueError, match="block_mask must be a jaxflash.BlockMask"):
    jaxflash.flash_attention(q, q, q, block_mask=np.ones((1, 1, 1, 1)))
  per_batch = jaxflash.create_block_mask(MASK_MODS["prefix_lm"], 3, None, 40, 40)
  with pytest.raises(ValueError, match="batch 3"):
    jaxflash.flash_attention(q, q, q, block_mask=per_batch)
  with pytest.raises(ValueError, match="q_len"):
    jaxflash.create_block_mask(MASK_MODS["causal"], None, None, 0, 40)
  with pytest.raises(ValueError, match="block_size"):
    jaxflash.create_block_mask(MASK_MODS["causal"], None, None, 40, 40, block_size=(64,))


# --- block tables -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["documents", "prefix_lm", "per_head"])
def test_create_block_mask_classifies_every_block(name):
  fn, t, s = MASK_MODS[name], 200, 150
  made = jaxflash.create_block_mask(fn, B, N, t, s, block_size=(32, 64))
  dense = np.asarray(jnp.broadcast_to(fn(*_indices(B, N, t, s)), (B, N, t, s)))
  want = _blocks_of(dense, 32, 64)
  got = np.asarray(made.table)
  # Axes the mask does not depend on are kept at size 1.
  assert got.shape[0] in (1, B) and got.shape[1] in (1, N)
  np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)


def test_dense_and_segment_tables():
  mask = np.array(jax.random.bernoulli(jax.random.key(1), 0.9, (2, 1, 100, 130)))
  mask[:, :, 40:70, :] = False  # whole empty blocks
  np.testing.assert_array_equal(bm.classify_dense(jnp.asarray(mask), 32),
                                _blocks_of(mask, 32, 32))
  ids = np.sort(_rng.randint(0, 6, (2, 190)), axis=1)
  dense = ids[:, None, :, None] == ids[:, None, None, :]
  np.testing.assert_array_equal(bm.classify_segments(jnp.asarray(ids), jnp.asarray(ids), 32),
                                _blocks_of(dense, 32, 32))


@pytest.mark.parametrize("shape", [(2, 1, 100, 130), (1, 3, 64, 256), (1, 1, 1, 300),
                                   (1, 2, 257, 33)])
def test_dense_mask_packed_both_ways(shape):
  """`dense_mask.pack_local`: its words' bits are the entries, along the keys and along the
  queries, and its table is the mask's; the GPU's Triton kernels (interpreted here) give the
  same as XLA's ops, edge tiles and bit 31 included."""
  mask = np.array(jax.random.bernoulli(jax.random.key(3), 0.6, shape))
  mask[..., : shape[2] // 3, :] = True  # full blocks
  mask[..., shape[2] // 2:, : shape[3] // 2] = False  # empty ones
  packed = dense_mask.pack_local(jnp.asarray(mask))
  q, k = np.arange(shape[2])[:, None], np.arange(shape[3])[None, :]
  words = np.asarray(packed.by_keys).view(np.uint32)
  np.testing.assert_array_equal((words[:, :, k // 32, q] >> (k % 32)) & 1, mask)
  words = np.asarray(packed.by_queries).view(np.uint32)
  np.testing.assert_array_equal((words[:, :, q // 32, k] >> (q % 32)) & 1, mask)
  np.testing.assert_array_equal(packed.table, _blocks_of(mask, bm.CLASSIFY_BLOCK,
                                                         bm.CLASSIFY_BLOCK))
  on_gpu = dense_mask._pack_with_triton(jnp.asarray(mask), interpret=True)
  for got, want in zip(on_gpu, packed):
    chex.assert_trees_all_equal(got, want)


@pytest.mark.parametrize("to", [(16, 16), (64, 128), (96, 32), (256, 256)])
def test_resample_keeps_the_states_of_the_entries(to):
  """A table resampled to other blocks says of each new block what the entries say."""
  mask = np.array(jax.random.bernoulli(jax.random.key(2), 0.02, (1, 2, 300, 260)))
  mask |= np.tril(np.ones((300, 260), bool))
  table = bm.classify_dense(jnp.asarray(mask), 32)
  got = bm.resample(table, (32, 32), to, (300, 260))
  want = _blocks_of(mask, *to)
  # Exact where the new blocks are made of whole old ones; finer blocks inherit a partial
  # block's state, which may be conservative, but never call a block empty or full wrongly.
  if all(a % 32 == 0 for a in to):
    np.testing.assert_array_equal(got, want)
  else:
    got = np.asarray(got)
    assert ((want == bm.EMPTY) | (got != bm.EMPTY)).all()
    assert ((want == bm.FULL) | (got != bm.FULL)).all()


@pytest.mark.parametrize("transpose", [False, True])
def test_block_lists_visit_exactly_the_visible_blocks(transpose):
  """The lists intersect the table with the band and the lengths: visited = any entry visible,
  full = every entry visible, ascending."""
  t, s, bq, bk = 150, 170, 32, 16
  fn = MASK_MODS["documents"]
  made = jaxflash.create_block_mask(fn, B, None, t, s, block_size=64)
  lengths = jnp.asarray([[150, 120], [100, 170]], jnp.int32)
  window = make_window(True, (60, 0))
  lists = np.asarray(block_lists(made.table, (64, 64), window, bq, bk, lengths, None, t, s,
                                 transpose=transpose).packed)
  q, k = np.arange(t)[:, None], np.arange(s)[None, :]
  for b in range(B):
    dense = np.asarray(fn(b, 0, q, k)) & (k <= q) & (k >= q - 60) & (k < int(lengths[b, 1]))
    dense &= q < int(lengths[b, 0])
    states = _blocks_of(dense, bq, bk)
    if transpose:
      states = states.T
    for row in range(states.shape[0]):
      packed = lists[b, 0, row]
      width = (packed.shape[0] - 2) // 2
      partial = list(packed[2:2 + packed[0]])
      full = list(packed[2 + width:2 + width + packed[1]])
      assert partial == sorted(partial) and full == sorted(full)
      # (Entries past a count are block 0, one that exists, whatever a kernel reads there.)
      assert not packed[2 + packed[0]:2 + width].any()
      assert not packed[2 + width + packed[1]:].any()
      visible = np.flatnonzero(states[row] != bm.EMPTY)
      assert sorted(partial + full) == list(visible)
      # A block the lists call full has every entry visible (valid query rows; padding rows
      # past the query length are zeroed at the end and may count as visible).
      assert set(full) <= set(np.flatnonzero(states[row] == bm.FULL)) | set(
          np.flatnonzero(_full_but_padding(dense, b, lengths, row, bq, bk, transpose)))


@pytest.mark.parametrize("items", [1, 5, 2048, 4097])
def test_items_go_heaviest_first(items):
  """The Mosaic kernels' order of work items under a block table: by visits, most first, ties
  in index order (a stable sort), whether ranked pair by pair (up to 4096 items) or sorted."""
  from jaxflash.backends.mosaic.forward import by_cost
  visits = np.random.default_rng(items).integers(0, 9, (1, 1, items))
  lists = jnp.asarray(np.stack([visits, np.zeros_like(visits)], axis=-1), jnp.int32)
  got = np.asarray(by_cost(lists, 1, 1))
  np.testing.assert_array_equal(got, np.argsort(-visits.reshape(-1), kind="stable"))


def _full_but_padding(dense, b, lengths, row, bq, bk, transpose):
  """Blocks of one row of blocks that are full once padding query rows are left out."""
  q_len = int(lengths[b, 0])
  valid = np.arange(dense.shape[0]) < q_len
  fuller = dense | ~valid[:, None]
  states = _blocks_of(fuller, bq, bk)
  return (states.T if transpose else states)[row] == bm.FULL


def test_from_blocks_under_strict_rank_promotion():
  """jax_numpy_rank_promotion="raise": packing a block pattern broadcasts nothing implicitly."""
  pattern = jax.random.bernoulli(jax.random.key(0), 0.3, (1, 2, 2, 4))
  q, kv = jnp.ones((1, 60, 2, 16)), jnp.ones((1, 100, 2, 16))
  with jax.numpy_rank_promotion("raise"):
    made = jaxflash.BlockMask.from_blocks(pattern, 60, 100, 32)
    out = jaxflash.flash_attention(q, kv, kv, block_mask=made, implementation="xla")
  chex.assert_shape(out, q.shape)


def test_from_blocks_is_exact_at_every_tile_size():
  visible = jnp.asarray(_rng.rand(2, 1, 5, 4) < 0.4) | jnp.eye(5, 4, dtype=bool)
  made = jaxflash.BlockMask.from_blocks(visible, 300, 250, 64)
  assert made.split.kernel_reason is None  # its pattern runs in kernels with coarser tiles
  dense = jnp.repeat(jnp.repeat(visible, 64, 2), 64, 3)[:, :, :300, :250]
  chex.assert_trees_all_equal(dense_mask_of(block_mask=made, b=2, t=300, s=250, n=1), dense)
  with pytest.raises(ValueError, match="visible must be a boolean block table"):
    jaxflash.BlockMask.from_blocks(visible[..., :3], 300, 250, 64)


def test_from_blocks_rule_reads_every_word_of_a_long_row():
  """More than 32 key blocks: a row of the table is packed into several words (here 3), and the
  rule picks each key's word. Against the pattern itself, not the mask's own rule (which
  `check`'s reference evaluates, so a wrong rule agrees with itself there); and the XLA
  backend's call against the reference given that pattern densely."""
  visible = jnp.asarray(_rng.rand(1, 2, 3, 70) < 0.5) | jnp.eye(3, 70, dtype=bool)
  t, s = 40, 139  # (the last block of each axis partial)
  made = jaxflash.BlockMask.from_blocks(visible, t, s, (16, 2))
  dense = jnp.repeat(jnp.repeat(visible, 16, 2), 2, 3)[:, :, :t, :s]
  chex.assert_trees_all_equal(dense_mask_of(block_mask=made, b=1, t=t, s=s, n=2), dense)
  q, kk, v, _ = random_qkv(9, 1, t, s, 2, 1, 16)
  got = jaxflash.flash_attention(q, kk, v, block_mask=made, implementation="xla")
  want, _ = reference_attention(q, kk, v, mask=dense)
  assert rel_err(got, want) < F32_TOLERANCE


# --- attention with block masks (CPU) --------------------------------------------------------


def _maker(fn):
  return lambda *a: fn  # `check` calls option makers with (b, t, s, n, seed)


# Variants (the GPU, and a CPU with JAXFLASH_ALL_VARIANTS=1), whose mask_mods other CPU cases
# hold on the same backend: documents in test_mask_mod_with_a_differentiated_bias[xla] and
# [triton] (the same mask_mod, forward and every gradient); prefix_lm's `(k <= q) | (k <
# PREFIX[b])` in test_and_masks_and_or_masks[xla] and [triton] (the same or of a causal band and a
# per-row prefix); dilated's per-entry arithmetic without features in
# test_score_mod.py::test_kernels_with_every_other_option[triton] (its mask_mod `(i + 2 j) % 7 !=
# 0`) and, as a tile rule, test_split_features_and_tile_rule_equal_the_function[dilated] (the XLA
# backend evaluates `Split.tile` as the kernels do, which [per_head-xla] holds). per_head (a mask
# per head) stays on both.
MASK_MOD_VARIANTS = {("documents", "xla"), ("documents", "triton"), ("prefix_lm", "xla"),
                     ("prefix_lm", "triton"), ("dilated", "xla"), ("dilated", "triton")}


@pytest.mark.parametrize("name,implementation", [
    variant_if((name, implementation) in MASK_MOD_VARIANTS, name, implementation)
    for implementation in ["xla", "triton"]
    for name in ["documents", "prefix_lm", "dilated", "per_head"]])
def test_mask_mod_matches_the_dense_reference(implementation, name):
  check(implementation, b=B, t=57, s=57, n=N, k=2, h=32, mask_mod=_maker(MASK_MODS[name]))


# (XLA's case is a variant: the table of a dense mask and a mask_mod's are intersected in
# `_checks._block_table`, before any backend, and the XLA backend ands a tile's visibility with
# the tile rule's (`blocks.Blocks`): test_option[xla-everything] in test_attention.py holds a
# dense mask with a causal band and lengths there, test_and_masks_and_or_masks[xla] a mask_mod
# at T != S with GQA; [triton] stays.)
@pytest.mark.parametrize("implementation", [pytest.param("xla", marks=pytest.mark.variants),
                                            "triton"])
def test_mask_mod_combines_with_other_options(implementation):
  """A mask_mod with a causal band, lengths, a dense mask and T != S (GQA, odd sizes)."""
  b, t, s, n = B, 45, 70, N
  check(implementation, b=b, t=t, s=s, n=n, k=1, h=40, is_causal=True,
        mask_mod=_maker(MASK_MODS["sliding_window"]),
        mask=lambda *a: jax.random.bernoulli(jax.random.key(3), 0.8, (b, 1, t, s)),
        key_value_seq_lengths=lambda *a: jnp.asarray([60, 33]),
        query_seq_lengths=lambda *a: jnp.asarray([45, 20]))


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_mask_mod_with_a_differentiated_bias(implementation):
  """The bias gradient (Triton's own kernel) evaluates the mask_mod too."""
  check(implementation, b=B, t=50, s=50, n=N, k=2, h=32, mask_mod=_maker(MASK_MODS["documents"]),
        bias=lambda b, t, s, n, seed: jax.random.normal(jax.random.key(seed), (1, n, t, s)))


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_mask_mod_reading_the_query_index_with_more_queries_than_keys(implementation):
  """T > S with a tile rule that reads the query index itself (a band of 24 keys, no row
  feature): rows past S see the keys their own index picks. (A mutation pass clamped the XLA
  backend's rows at S - 1 instead of T - 1 before the rule saw them; every other CPU test
  passed, since a causal rule or a row feature hides it.)"""
  check(implementation, b=B, t=70, s=45, n=N, k=2, h=32,
        mask_mod=_maker(MASK_MODS["sliding_window"]))


# (A variant: test_block_mask_on_few_query_rows_on_a_sharded_batch holds a per-row mask_mod's
# `BlockMask` arrays split with the batch over four CPU devices (the roles of
# `ops/partitioning.py`, the same for every backend), its result the unsharded call's and the
# reference's.)
@pytest.mark.variants
def test_mask_mod_on_a_sharded_batch():
  """A mask_mod whose features depend on the batch row, under jit on a batch sharded over four
  (CPU) devices: every device evaluates its own rows' features (`BlockMask` arrays carry the
  batch axis), and the result is the unsharded call's."""
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices (tests/conftest.py fakes them on a CPU)")
  mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  docs = jnp.asarray(np.sort(_rng.randint(0, 4, (4, 48)), axis=1))
  fn = lambda b, h, q, k: (docs[b, q] == docs[b, k]) & (q >= k)  # noqa: E731
  q = jax.random.normal(jax.random.key(5), (4, 48, 2, 16))
  call = jax.jit(lambda x: jaxflash.flash_attention(x, x, x, mask_mod=fn, implementation="xla"))
  want = call(q)
  got = call(jax.device_put(q, sharding))
  chex.assert_trees_all_close(got, want, atol=1e-6, rtol=1e-6)
  dense = dense_mask_of(fn, b=4, t=48, s=48, n=2)
  chex.assert_trees_all_close(want, jax.nn.dot_product_attention(q, q, q, mask=dense),
                              atol=2e-5, rtol=2e-5)


def _banded(b, h, q_idx, kv_idx):  # (module level: pickle finds it by name)
  return (q_idx >= kv_idx) & (q_idx - kv_idx < 40)


def test_a_block_mask_deep_copies_and_pickles():
  """copy.deepcopy (of a config or a Flax module holding a mask) and pickle round trips give
  a mask that masks the same; both failed on the traced mask_mod's tracebacks."""
  import copy
  import pickle
  q, k, v, _ = random_qkv(8, 1, 96, 96, 2, 2, 16)
  mask = jaxflash.create_block_mask(_banded, None, None, 96, 96, block_size=32)
  blocks = jaxflash.BlockMask.from_blocks(jnp.eye(3, dtype=bool), 96, 96, block_size=32)
  want = jaxflash.flash_attention(q, k, v, block_mask=mask)
  for again in (copy.deepcopy({"mask": mask})["mask"], pickle.loads(pickle.dumps(mask))):
    assert again.split == mask.split
    chex.assert_trees_all_equal(jaxflash.flash_attention(q, k, v, block_mask=again), want)
  chex.assert_trees_all_equal(
      jaxflash.flash_attention(q, k, v, block_mask=copy.deepcopy(blocks)),
      jaxflash.flash_attention(q, k, v, block_mask=blocks))


def test_partition_spec_splits_a_mask_with_its_batch_inside_shard_map():
  """`BlockMask.partition_spec`: a mask whose features depend on the batch row, split with the
  query over four (CPU) devices inside shard_map (the table along axis 0, the features along
  axis 1), gives the unsharded call's result and gradient; as shardings it places the mask. A
  mask whose rule reads its captured arrays at the indices it is given cannot be split."""
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices (tests/conftest.py fakes them on a CPU)")
  P = jax.sharding.PartitionSpec
  mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  docs = jnp.asarray(np.sort(_rng.randint(0, 3, (4, 48)), axis=1))
  mask = jaxflash.create_block_mask(lambda b, h, q, k: (docs[b, q] == docs[b, k]) & (q >= k),
                                    4, None, 48, 48, block_size=16)
  spec = mask.partition_spec("data")
  assert spec.table == P("data", None, None, None) and spec.q_features[1] == "data"
  assert mask.partition_spec(heads="heads").table == P(None, None, None, None)  # (broadcast)
  q = jax.random.normal(jax.random.key(8), (4, 48, 2, 16))
  call = lambda x, m: jaxflash.flash_attention(x, x, x, block_mask=m,  # noqa: E731
                                               implementation="xla")
  split = jax.shard_map(call, mesh=mesh, in_specs=(P("data"), spec), out_specs=P("data"))
  chex.assert_trees_all_close(jax.jit(split)(q, mask), call(q, mask), atol=1e-6, rtol=1e-6)
  chex.assert_trees_all_close(jax.jit(jax.grad(lambda x: jnp.sum(split(x, mask))))(q),
                              jax.grad(lambda x: jnp.sum(call(x, mask)))(q), atol=1e-5, rtol=1e-5)
  placed = jax.device_put(mask, jax.tree.map(lambda p: jax.sharding.NamedSharding(mesh, p), spec))
  assert placed.q_features.sharding.spec == P(None, "data", None, None)
  chex.assert_trees_all_close(jax.jit(call)(q, placed), call(q, mask), atol=1e-6, rtol=1e-6)
  allowed = jnp.asarray(_rng.rand(4, 3, 3) < 0.6)
  gather = jaxflash.create_block_mask(lambda b, h, q, k: allowed[b, docs[b, q], docs[b, k]],
                                      4, None, 48, 48)
  assert gather.mask_consts and gather.partition_spec().mask_consts == (P(),) * 2
  with pytest.raises(ValueError, match="cannot be split"):
    gather.partition_spec("data")


def _dense_reference(q, mask):
  return reference_attention(q, q, q, mask=jnp.broadcast_to(mask, (1, 1) + mask.shape[-2:]))[0]


def test_block_mask_of_a_gather_made_inside_jit_and_vmap():
  """A mask_mod that only the XLA backend runs (a gather from a captured array at both
  indices) made into a BlockMask inside jax.jit, or stacked by jax.vmap: its captured arrays
  travel as the mask's leaves. (Its static split held them before, and a mask made inside a
  jit leaked that trace's tracers into every call.)"""
  t = 96
  q = jax.random.normal(jax.random.key(0), (1, t, 2, 16))
  patterns = jnp.asarray(_rng.rand(3, 3, 3) < 0.5) | jnp.eye(3, dtype=bool)

  def make(pattern):
    return jaxflash.create_block_mask(lambda b, h, i, j: pattern[i // 32, j // 32], None, None,
                                      t, t, block_size=32)

  def dense(pattern):
    return jnp.repeat(jnp.repeat(pattern, 32, axis=0), 32, axis=1)

  made = jax.jit(make)(patterns[0])
  want = _dense_reference(q, dense(patterns[0]))
  for got in (jaxflash.flash_attention(q, q, q, block_mask=made),
              jax.jit(lambda q, m: jaxflash.flash_attention(q, q, q, block_mask=m))(q, made)):
    assert rel_err(got, want) < F32_TOLERANCE
  stacked = jax.vmap(make)(patterns)
  got = jax.vmap(lambda m: jaxflash.flash_attention(q, q, q, block_mask=m))(stacked)
  for i in range(3):
    assert rel_err(got[i], _dense_reference(q, dense(patterns[i]))) < F32_TOLERANCE


@pytest.mark.parametrize("kind", ["same_function", "same_body", "from_blocks", "gather"])
def test_a_block_mask_made_again_reuses_the_compiled_call(kind):
  """A training loop that makes its block mask per batch (outside its jitted step) traces the
  step once, and each call still sees its own mask's values: two masks whose functions have
  one body (their captured arrays' shapes included) are one static value. A function with
  another body traces again. (Each BlockMask traced and compiled anew before.)"""
  t = 96
  q = jax.random.normal(jax.random.key(1), (1, t, 2, 16))
  traces = []

  @jax.jit
  def step(q, mask):
    traces.append(None)
    return jaxflash.flash_attention(q, q, q, block_mask=mask)

  causal = lambda b, h, i, j: i >= j  # noqa: E731
  masks = []
  for seed in range(3):
    docs = jnp.asarray(np.sort(np.random.RandomState(seed).randint(0, 3, t)), jnp.int32)
    blocks = jnp.asarray(np.random.RandomState(seed).rand(3, 3) < 0.5) | jnp.eye(3, dtype=bool)
    if kind == "same_function":
      made = jaxflash.create_block_mask(causal, None, None, t, t, block_size=32)
      dense = causal(*_indices(1, 1, t, t))
    elif kind == "same_body":  # a new closure over new document ids each batch
      made = jaxflash.create_block_mask(lambda b, h, i, j: docs[i] == docs[j], None, None, t, t,
                                        block_size=32)
      dense = docs[:, None] == docs[None, :]
    elif kind == "from_blocks":
      made = jaxflash.BlockMask.from_blocks(blocks, t, t, 32)
      dense = jnp.repeat(jnp.repeat(blocks, 32, axis=0), 32, axis=1)
    else:  # the XLA backend's whole function, on the captured arrays the mask carries
      made = jaxflash.create_block_mask(lambda b, h, i, j: blocks[i // 32, j // 32], None,
                                        None, t, t, block_size=32)
      dense = jnp.repeat(jnp.repeat(blocks, 32, axis=0), 32, axis=1)
    masks.append(made)
    assert rel_err(step(q, made), _dense_reference(q, dense)) < F32_TOLERANCE, seed
  assert len(traces) == 1
  assert masks[0].split == masks[1].split and hash(masks[0].split) == hash(masks[1].split)
  other = jaxflash.create_block_mask(lambda b, h, i, j: i > j, None, None, t, t, block_size=32)
  assert other.split != masks[0].split
  step(q, other)
  assert len(traces) == 2


def test_eager_calls_with_a_mask_mod_classify_once(monkeypatch):
  """An eager call with ``mask_mod=`` makes its block mask each time: compiled once per
  structure and sizes (`block_mask._mask_mod_blocks_jitted`), with each closure's own arrays
  (it ran op by op, 0.2 s a call on a CPU)."""
  traced = []
  blocks = bm.mask_mod_blocks
  monkeypatch.setattr(bm, "mask_mod_blocks", lambda *a, **kw: traced.append(1) or blocks(*a, **kw))
  jax.clear_caches()
  t = 64
  q = jax.random.normal(jax.random.key(2), (1, t, 2, 16))
  for seed in range(3):
    docs = jnp.asarray(np.sort(np.random.RandomState(seed).randint(0, 3, t)), jnp.int32)
    got = jaxflash.flash_attention(q, q, q, mask_mod=lambda b, h, i, j: docs[i] == docs[j],
                                   implementation="xla")
    assert rel_err(got, _dense_reference(q, docs[:, None] == docs[None, :])) < F32_TOLERANCE
  assert len(traced) == 1


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_reused_block_mask_and_from_blocks(implementation):
  made = jaxflash.create_block_mask(MASK_MODS["documents"], B, None, 64, 64, block_size=32)
  check(implementation, b=B, t=64, s=64, n=N, k=2, h=32, block_mask=_maker(made))
  pattern = jaxflash.BlockMask.from_blocks(
      jnp.asarray(_rng.rand(B, N, 3, 2) < 0.5) | jnp.eye(3, 2, dtype=bool), 70, 64, 32)
  check(implementation, b=B, t=70, s=64, n=N, k=2, h=32, block_mask=_maker(pattern))
  # Blocks of 1 x 2 entries: 16 x 16 tiles evaluate the pattern per entry, from 2 words a row
  # (a kernel's rule; the XLA backend's tile loop is slow at it on a CPU: CI time).
  if implementation == "xla" and not ON_GPU:
    return
  fine = jaxflash.BlockMask.from_blocks(
      jnp.asarray(_rng.rand(1, 1, 30, 40) < 0.5) | jnp.eye(30, 40, dtype=bool), 30, 80, (1, 2))
  check(implementation, b=1, t=30, s=80, n=2, k=1, h=16, block_mask=_maker(fine))


def test_from_blocks_checks_its_lengths_and_masks_compare_by_identity():
  """`BlockMask.from_blocks` checks q_len and kv_len as create_block_mask does (0 blamed the
  mask_mod, -5 the table, 37.0 was taken, a string was a TypeError); NumPy integers are taken
  and kept as ints. A BlockMask compares and hashes by identity: its generated field-wise ==
  raised on masks with features, and hash() always failed."""
  visible = jnp.ones((1, 1, 1, 1), bool)
  for name, lengths in (("q_len", (0, 53)), ("q_len", (-5, 53)), ("q_len", (37.0, 53)),
                        ("kv_len", (37, "53"))):
    with pytest.raises(ValueError, match=name):
      jaxflash.BlockMask.from_blocks(visible, *lengths)
  made = jaxflash.BlockMask.from_blocks(visible, np.int32(37), 53)
  assert type(made.q_len) is int and "np.int" not in repr(made)
  a = jaxflash.create_block_mask(lambda b, h, i, j: j <= i + 16, None, None, 64, 64)
  b = jaxflash.create_block_mask(lambda b, h, i, j: j <= i + 16, None, None, 64, 64)
  assert a == a and a != b and len({a, b}) == 2


def test_leaves_out_of_step_are_a_value_error():
  """A BlockMask's batch is axis 0 of its table and axis 1 of its features: sliced along axis 0
  leaf by leaf (``jax.tree.map(lambda x: x[1:], mask)``), or rebuilt with another row's table,
  its leaves disagree. That was a KeyError or a broadcasting error deep inside, or a silently
  different mask; it is a ValueError naming the leaf. Sliced along each leaf's own axis, it is
  that row's mask."""
  b, t = 2, 64
  docs = jnp.stack([jnp.repeat(jnp.arange(2), 32), jnp.repeat(jnp.arange(4), 16)])
  made = jaxflash.create_block_mask(lambda b, h, q, k: docs[b, q] == docs[b, k], b, None, t, t)
  q, kk, v, _ = random_qkv(3, 1, t, t, 2, 2, 16)
  call = lambda mask: jaxflash.flash_attention(  # noqa: E731
      q, kk, v, block_mask=mask, implementation="xla")
  with pytest.raises(ValueError, match="block_mask.q_features"):
    call(jax.tree.map(lambda x: x[1:], made))
  with pytest.raises(ValueError, match="block_mask.q_features"):
    call(dataclasses.replace(made, table=made.table[1:]))
  row = dataclasses.replace(made, table=made.table[1:], q_features=made.q_features[:, 1:],
                            kv_features=made.kv_features[:, 1:])
  want = reference_attention(q, kk, v, mask=(docs[1][:, None] == docs[1][None, :]))[0]
  assert rel_err(call(row), want) < F32_TOLERANCE


def test_gather_on_both_indices_falls_back_to_xla():
  q = jax.random.normal(jax.random.key(0), (1, 70, 2, 16))
  with pytest.raises(UnsupportedCallError, match="dynamic_slice"):
    attention("triton", q, q, q, mask_mod=GATHER_BOTH)
  assert jaxflash.implementation_for(q, q, q, mask_mod=GATHER_BOTH) == "xla"
  check("xla", b=1, t=70, s=70, n=2, k=2, h=16, mask_mod=_maker(GATHER_BOTH))
  # A BlockMask rebuilt by hand without the captured arrays it must carry is refused (it read
  # them from the static mask_mod, which jit shares between masks of one structure).
  made = jaxflash.create_block_mask(GATHER_BOTH, 1, 2, 70, 70)
  by_hand = dataclasses.replace(made, mask_consts=())
  with pytest.raises(ValueError, match="block_mask.*mask_consts"):
    jaxflash.flash_attention(q, q, q, block_mask=by_hand, implementation="xla")


def _few_rows_case(kind: str, t: int, s: int):
  """``(flash_attention keyword arguments, the dense mask [B or 1, N or 1, T, S] they mean)``
  for a decoding-shaped call (few query rows against many keys)."""
  blocks = np.array([True, False, True, True])[:-(-s // 128)]
  pattern = np.repeat(blocks, 128)[:s][None, None, None, :]
  if kind == "table_only":  # a BlockMask made by hand, with no mask_mod: visible blocks full
    table = jnp.asarray(np.where(blocks, bm.FULL, bm.EMPTY)[None, None, None], jnp.int8)
    made = jaxflash.BlockMask(table, None, None, None, 128, 128, t, s)
    return dict(block_mask=made), np.broadcast_to(pattern, (1, 1, t, s))
  if kind == "from_blocks":
    made = jaxflash.BlockMask.from_blocks(jnp.asarray(blocks)[None], t, s)
    return dict(block_mask=made), np.broadcast_to(pattern, (1, 1, t, s))
  fn = {"documents": lambda b, h, q, k: (DOCS[b, q + s - t] == DOCS[b, k]) | (k < 3),
        "per_head": MASK_MODS["per_head"], "gather_both": GATHER_BOTH}[kind]
  return dict(mask_mod=fn), np.asarray(fn(*_indices(B, N, t, s)))


# (from_blocks and documents are variants: the split-KV kernel gets every block mask as one dense
# mask (`decode._block_mask_as_dense`: the table's visible blocks, and the tile rule where there
# is one), which [table_only] holds for a table and [per_head] for a mask_mod's rule, with
# gradients (the training backward); test_block_mask_on_few_query_rows_on_a_sharded_batch holds a
# per-row documents mask_mod there against the reference, and
# test_reused_block_mask_and_from_blocks[triton] the from_blocks pattern's rule.)
@pytest.mark.parametrize("kind", ["table_only", pytest.param("from_blocks",
                                                             marks=pytest.mark.variants),
                                  pytest.param("documents", marks=pytest.mark.variants),
                                  "per_head", "gather_both"])
def test_block_masks_on_few_query_rows_take_the_split_kv_kernel(kind, monkeypatch):
  """A block mask or a mask_mod on a call of a few query rows (a decoding step) runs the
  split-KV decoding kernel, its T rows of the mask made dense, GQA and odd lengths; forward,
  LSE and gradients against the reference. A hand-made BlockMask with no mask_mod (every
  visible block full) once ran there with its table ignored. A mask_mod no Pallas kernel can
  run (a gather on both indices) goes to the XLA backend, as it does with more rows."""
  from jaxflash.backends.triton import decode
  jax.clear_caches()  # (the spy counts traces)
  ran = []
  split_kv = decode.forward
  monkeypatch.setattr(decode, "forward", lambda *a: ran.append(a) or split_kv(*a))
  t, s, k = 3, 300, 2
  q, kk, v, d_out = random_qkv(4, B, t, s, N, k, 40)
  options, dense = _few_rows_case(kind, t, s)
  ours = lambda q, kk, v: jaxflash.flash_attention(  # noqa: E731
      q, kk, v, return_residual=True, interpret=not ON_GPU, **options)
  (out, lse), vjp = jax.vjp(ours, q, kk, v)
  (want, want_lse), ref_vjp = jax.vjp(
      lambda *x: reference_attention(*x, mask=jnp.asarray(dense)), q, kk, v)
  assert len(ran) == (kind != "gather_both")
  assert rel_err(out, want) < F32_TOLERANCE
  seen = np.isfinite(np.asarray(want_lse))
  assert rel_err(np.where(seen, lse, 0), np.where(seen, want_lse, 0)) < F32_TOLERANCE
  for got, ref in zip(vjp((d_out, jnp.zeros_like(lse))), ref_vjp((d_out, jnp.zeros_like(lse)))):
    assert rel_err(got, ref) < F32_TOLERANCE


def test_block_mask_on_few_query_rows_on_a_sharded_batch():
  """A decoding-shaped call with a per-row mask_mod under jit, its batch sharded over four (CPU)
  devices: each device makes its own rows' dense mask for the split-KV kernel, and the result is
  the unsharded call's."""
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices (tests/conftest.py fakes them on a CPU)")
  mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  docs = jnp.asarray(np.sort(_rng.randint(0, 4, (4, 200)), axis=1))
  fn = lambda b, h, q, k: (docs[b, q + 198] == docs[b, k]) & (k <= q + 198)  # noqa: E731
  q = jax.random.normal(jax.random.key(6), (4, 2, 2, 16))
  kv = jax.random.normal(jax.random.key(7), (4, 200, 2, 16))
  call = jax.jit(lambda q, kv: jaxflash.flash_attention(q, kv, kv, mask_mod=fn,
                                                        implementation="triton", interpret=True))
  want = call(q, kv)
  got = call(jax.device_put(q, sharding), jax.device_put(kv, sharding))
  chex.assert_trees_all_close(got, want, atol=1e-6, rtol=1e-6)
  ref, _ = reference_attention(q, kv, kv, mask=dense_mask_of(fn, b=4, t=2, s=200, n=2))
  assert rel_err(want, ref) < F32_TOLERANCE


def test_block_masks_too_large_to_make_dense_run_the_training_kernels(monkeypatch):
  """Above `MAX_DENSE_ENTRIES` (a long cache with a mask per head and 16 query rows) the
  split-KV kernel declines a block mask, and the training kernels walk its lists."""
  from jaxflash.backends.triton import decode
  monkeypatch.setattr(decode, "MAX_DENSE_ENTRIES", 1000)
  jax.clear_caches()
  ran = []
  split_kv = decode.forward
  monkeypatch.setattr(decode, "forward", lambda *a: ran.append(a) or split_kv(*a))
  t, s = 2, 300
  q, kk, v, _ = random_qkv(5, B, t, s, N, 2, 32)
  options, dense = _few_rows_case("per_head", t, s)
  out = jaxflash.flash_attention(q, kk, v, interpret=not ON_GPU, **options)
  want, _ = reference_attention(q, kk, v, mask=jnp.asarray(dense))
  assert not ran and rel_err(out, want) < F32_TOLERANCE


# (A variant, with and without jit: test_mask_mod_under_vmap_with_gradients holds a mask_mod
# call vmapped and jitted on the XLA backend (the call primitive's batching rule), forward and
# gradients against the reference given the same mask densely.)
@pytest.mark.variants
class MaskModTransformsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_mask_mod_under_jit_and_vmap(self):
    fn = MASK_MODS["prefix_lm"]
    q = jax.random.normal(jax.random.key(1), (3, B, 33, N, 16))
    run = self.variant(jax.vmap(lambda x: jaxflash.flash_attention(x, x, x, mask_mod=fn,
                                                                    implementation="xla")))
    dense = dense_mask_of(fn, b=B, t=33, s=33, n=N)
    want = jax.vmap(lambda x: jax.nn.dot_product_attention(x, x, x, mask=dense))(q)
    assert rel_err(run(q), want) < F32_TOLERANCE  # (TF32 dots where a GPU computes it)


# --- the GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
@pytest.mark.parametrize("name", ["documents", "prefix_lm", "dilated", "per_head"])
def test_mask_mod_on_gpu(implementation, name):
  check(implementation, small=False, b=B, t=1000, s=1000, n=N, k=2, h=128, dtype=jnp.bfloat16,
        mask_mod=_maker(MASK_MODS[name]))


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
def test_mask_mod_in_float16_under_vmap_on_gpu(implementation):
  """float16, the call and its gradients vmapped over a leading axis and jitted, GQA and a
  length no block divides, against the float32 reference given the same mask densely."""
  mask_vmapped_case(implementation, jnp.float16, t=555, h=64)


def mask_vmapped_case(implementation, dtype, t: int, h: int):
  fn = MASK_MODS["documents"]
  keys = jax.random.split(jax.random.key(7), 4)
  q = jax.random.normal(keys[0], (3, B, t, N, h), dtype)
  k, v = (jax.random.normal(key, (3, B, t, 2, h), dtype) for key in keys[1:3])
  d_out = jax.random.normal(keys[3], q.shape, dtype)
  dense = dense_mask_of(fn, b=B, t=t, s=t, n=N)

  def out_and_grads(attend, q, k, v, d_out):
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(d_out.astype(out.dtype)))

  ours = jax.jit(jax.vmap(functools.partial(out_and_grads, lambda q, k, v: (
      jaxflash.flash_attention(q, k, v, mask_mod=fn, implementation=implementation,
                               interpret=not ON_GPU)))))
  ref = jax.vmap(functools.partial(out_and_grads, lambda q, k, v: (
      reference_attention(q, k, v, mask=dense)[0])))
  got = ours(q, k, v, d_out)
  want = ref(*(x.astype(jnp.float32) for x in (q, k, v, d_out)))
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert g.dtype == dtype, name
    assert rel_err(g, w) < TOLERANCE[dtype], name


def test_mask_mod_under_vmap_with_gradients():
  """The GPU test's case, small and in float32 on the CPU (XLA backend)."""
  mask_vmapped_case("xla", jnp.float32, t=45, h=16)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
@pytest.mark.parametrize("h", [64, 96, 256])
def test_masks_on_gpu(implementation, h):
  """A dense mask (causal and padding, as Flax makes it), segment ids and a block pattern, at
  odd lengths, T != S and GQA."""
  b, t, s = 2, 777, 1300
  q_len, kv_len = np.array([777, 500]), np.array([1300, 900])
  dense = ((np.arange(s)[None, :] <= np.arange(t)[:, None] + (s - t))[None, None]
           & (np.arange(t)[None, None, :, None] < q_len[:, None, None, None])
           & (np.arange(s)[None, None, None, :] < kv_len[:, None, None, None]))
  check(implementation, small=False, b=b, t=t, s=s, n=8, k=2, h=h, dtype=jnp.bfloat16,
        mask=lambda *a: jnp.asarray(dense))
  # A random mask per head (every entry's bit matters; some rows see no key).
  scattered = _rng.rand(b, 8, t, s) < 0.3
  scattered[:, :, 100:110] = False
  check(implementation, small=False, b=b, t=t, s=s, n=8, k=2, h=h, dtype=jnp.bfloat16,
        mask=lambda *a: jnp.asarray(scattered))
  ids = lambda length: jnp.asarray(np.sort(_rng.randint(0, 7, (b, length)), axis=1))  # noqa: E731
  check(implementation, small=False, b=b, t=t, s=s, n=8, k=2, h=h, dtype=jnp.bfloat16,
        is_causal=True, segment_ids=lambda *a: (ids(t), ids(s)))
  pattern = jaxflash.BlockMask.from_blocks(
      jnp.asarray(_rng.rand(1, 8, 7, 11) < 0.3) | jnp.eye(7, 11, dtype=bool), t, s, 128)
  check(implementation, small=False, b=b, t=t, s=s, n=8, k=2, h=h, dtype=jnp.bfloat16,
        block_mask=_maker(pattern))


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_and_masks_and_or_masks(implementation):
  """FlexAttention's combinators: documents and causal, or a prefix of keys every row sees,
  against the dense reference of the same combination (T != S, GQA)."""
  def causal(b, h, q, k):
    return q >= k

  def same_document(b, h, q, k):
    return DOCS[b, q] == DOCS[b, k]

  def prefix(b, h, q, k):
    return k < PREFIX[b]

  combined = jaxflash.or_masks(jaxflash.and_masks(causal, same_document), prefix)
  assert combined.__name__ == "or_masks(and_masks(causal, same_document), prefix)"
  check(implementation, b=B, t=45, s=60, n=N, k=2, h=32, mask_mod=_maker(combined))
  every = dense_mask_of(jaxflash.and_masks(), b=1, t=5, s=7, n=1)
  none = dense_mask_of(jaxflash.or_masks(), b=1, t=5, s=7, n=1)
  assert bool(jnp.all(every)) and not bool(jnp.any(none))
  # As mask_mods: a constant result is a literal of the traced function, which the split's
  # dependencies and the tile rule once hashed (TypeError: unhashable type: 'Literal').
  q = jax.random.normal(jax.random.key(3), (1, 40, 2, 16))
  plain = attention(implementation, q, q, q)
  for constant, want in ((jaxflash.and_masks(), plain), (jaxflash.or_masks(), 0 * plain),
                         (lambda b, h, i, j: True, plain)):
    got = attention(implementation, q, q, q, mask_mod=constant)
    assert rel_err(got, want) < F32_TOLERANCE
  with pytest.raises(ValueError, match="and_masks"):
    jaxflash.and_masks(causal, "causal")


def test_block_mask_to_dense_and_repr():
  mask = jaxflash.create_block_mask(MASK_MODS["sliding_window"], None, None, 100, 130,
                                    block_size=32)
  blocks = np.asarray(mask.to_dense())
  want = _blocks_of(np.asarray(dense_mask_of(MASK_MODS["sliding_window"], b=1, t=100, s=130,
                                             n=1)), 32, 32) != bm.EMPTY
  np.testing.assert_array_equal(blocks, want)
  assert repr(mask) == ("BlockMask(shape=(1, 1, 100, 130), block_size=(32, 32), "
                        "blocks=(4, 5), mask_mod=<lambda>)")
  blocks = jaxflash.BlockMask.from_blocks(jnp.eye(4, 5, dtype=bool), 100, 130, 32)
  assert blocks.mask_mod.__name__ == "from_blocks"
  assert repr(blocks).endswith("mask_mod=from_blocks)")
  by_hand = jaxflash.BlockMask(blocks.table, None, None, None, 32, 32, 100, 130)
  assert by_hand.mask_mod is None and repr(by_hand).endswith("mask_mod=None)")
