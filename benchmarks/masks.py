"""Masks and block sparsity: what attention costs when a mask says which entries are visible.

The one command, on the GPU machine from the repo root:

    PYTHONPATH=. python benchmarks/masks.py

It writes benchmarks/results/<device>/masks.json (<device> from the device kind, e.g. h200), a
masks.md table and a masks.png plot beside it (--out to choose), and prints the table. The JSON
is rewritten after every case, so a stopped run keeps what it measured. Other uses:

    PYTHONPATH=. python benchmarks/masks.py --smoke --out /tmp/masks.json  # tiny CPU run (CI)
    PYTHONPATH=. python benchmarks/masks.py --cases documents_8 block_10pct   # some cases
    PYTHONPATH=. python benchmarks/masks.py --implementation mosaic  # one jaxflash backend

Cases (bf16, D = 128, 16 heads; each the same attention however an implementation is given it):

- ``dense_mask``: B = 4, S = 4096, causal plus padding with lengths 4096/3000/2048/1000 (queries
  and keys), as one dense boolean mask [B, 1, T, S] built as Flax's ``make_causal_mask`` &
  ``make_attention_mask`` build it; jaxflash and cuDNN get ``mask=``.
- ``structured``: the same attention as ``is_causal=True`` + ``query_seq_lengths`` +
  ``key_value_seq_lengths``, jaxflash and cuDNN.
- ``dense_causal_16k``: B = 1, S = 16384, ``is_causal=True``: the rate the sparse cases are
  compared with.
- ``dense_16k``: the same without the causal band: every entry visible (the call a block
  pattern's time is compared with).
- ``documents_8``, ``documents_64``: B = 1, 16384 tokens packed from 8 and 64 documents of random
  lengths (fixed seed), causal within each document. ``jaxflash_segments``: ``segment_ids`` +
  ``is_causal``; ``jaxflash_mask_mod``: ``block_mask=create_block_mask(mask_mod)`` built once
  (FlexAttention's way: ``doc[b, q] == doc[b, kv] & q >= kv``); cuDNN: jax.nn has no segment ids
  (jax 0.11.2), so ``is_causal=True`` + the dense same-document mask [1, 1, S, S].
- ``block_10pct``, ``block_30pct``: B = 1, S = 16384, a random pattern of 128 x 128 blocks with
  10% and 30% of them visible (the diagonal always, so no row is empty; fixed seed).
  jaxflash: ``block_mask=BlockMask.from_blocks(visible)``; cuDNN: the equivalent dense mask.
- ``prefix_lm``: B = 2, S = 8192, bidirectional over a random prefix per row (fixed seed), causal
  after it. ``jaxflash_mask_mod``: ``block_mask=create_block_mask(mask_mod)`` with the prefix
  lengths captured; cuDNN: the dense mask [B, 1, S, S].

Implementations (``impl``): ``jaxflash`` (``jaxflash.flash_attention``, ``implementation=None``
unless --implementation names a backend; every row records the ``backend`` that served it),
``jaxflash_segments`` and ``jaxflash_mask_mod`` (the two ways of giving jaxflash packed
documents, and prefix-LM's), ``cudnn`` and ``xla`` (``jax.nn.dot_product_attention`` with that
implementation and the masks above; ``xla`` only on request, or without a GPU where it stands in
for cuDNN). Each row's ``via`` says what the call was given. ``build`` rows time
``create_block_mask`` under jit (the on-device cost of making the block mask a ``*_mask_mod``
row reuses, as a training step that builds it from its batch pays it).

Method (bench.py's): every (case, impl, mode) is compiled once (the executables of a case in a
thread pool), checked, then timed: two warm-up calls and the median of 5 repeats of 20
back-to-back calls ended by block_until_ready (fewer calls when one takes over 50 ms). Inputs are
random normal; masks, lengths, segment ids and block masks are arguments of the executable (not
constants). ``fwdbwd`` is jax.grad of sum(out.astype(f32) * dO) w.r.t. q, k, v. The check: output
(fwd) or dQ (fwdbwd) on batch rows 0 and B-1, heads 0 and N-1 and 512 query rows (the last 128
and 384 drawn at random) against float32 `jaxflash.reference_attention` given the dense mask of
those rows; query rows that see no key are left out (jax.nn and jaxflash differ there by
design); a relative error over 2e-2 flags the row ``wrong``.

FLOPs count visible entries only: forward 4 * D * (visible (query, key) entries summed over
batch rows and heads), counted exactly on the device, a block of query rows at a time;
forward+backward 3.5x that. ``visible_tflops`` = those FLOPs / the median time, so a case whose
cost follows its visible work runs at the dense causal case's rate. Rows also give
``visible_fraction`` (of B*N*T*S entries) and ``block_fraction`` (of 128 x 128 blocks with any
visible entry, the least work a block-sparse kernel can do).

Rows: case, impl, mode (fwd, fwdbwd, build), ms, visible_tflops, via, backend, dtype, B, T, S,
N, D, visible_fraction, block_fraction, relerr (fwd: output, fwdbwd: dQ), wrong, repeatable
(fwdbwd: a second call gave bitwise the same dQ, dK, dV), calls, temp_bytes, and error when it
did not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash import devices

import report
from cases import Case, make_inputs, same_bits, time_calls
from report import TOLERANCE

# (A case's random pattern is seeded with its index here: new cases go last.)
CASES = ("dense_mask", "structured", "dense_causal_16k", "documents_8", "documents_64",
         "block_10pct", "block_30pct", "prefix_lm", "dense_16k")
# The cases whose visible work is compared with dense causal's rate.
SPARSE_CASES = CASES[3:8]
MODES = ("fwd", "fwdbwd")
JAXFLASH_IMPLS = ("jaxflash", "jaxflash_segments", "jaxflash_mask_mod")
BASELINES = ("cudnn", "xla")
FLOP_CONVENTION = ("visible entries only: fwd 4*D*(visible (query, key) entries over every batch "
                   "row and head); fwdbwd 3.5x fwd")
# The lengths of dense_mask and structured at S = 4096 (scaled with S under --smoke).
PADDED_LENGTHS = (4096, 3000, 2048, 1000)


@dataclasses.dataclass(frozen=True)
class Shape:
  b: int
  s: int  # T = S: self-attention
  n: int
  d: int


@dataclasses.dataclass
class Setup:
  """One case, ready to run: its shape, the mask as a mask_mod (the truth that visible entries
  are counted from and the reference is masked with) and one call per implementation.

  ``calls`` maps an impl to ``(attention(q, k, v, *extra) -> out, extra, via)``: ``extra`` holds
  the masks, lengths, segment ids or block mask, passed to the executable as arguments.
  ``builds`` maps an impl to ``(build(*args) -> arrays, args, via)``, timed as a ``build`` row.
  """

  name: str
  shape: Shape
  mask_mod: Callable
  calls: dict
  builds: dict = dataclasses.field(default_factory=dict)
  meta: dict = dataclasses.field(default_factory=dict)


def _call(library: str, implementation, fixed: dict, *names: str) -> Callable:
  """attention(q, k, v, *extra) with ``extra`` bound to the keyword arguments ``names``;
  ``library`` is "jaxflash" or a jax.nn implementation ("cudnn", "xla")."""
  def attention(q, k, v, *extra, served_by: Callable | None = None):
    kwargs = dict(fixed, **dict(zip(names, extra, strict=True)))
    if library == "jaxflash":
      if served_by:  # (eval_shape only: which backend would serve it)
        served_by(jaxflash.implementation_for(q, k, v, implementation=implementation,
                                              **kwargs))
      return jaxflash.flash_attention(q, k, v, implementation=implementation, **kwargs)
    return jax.nn.dot_product_attention(q, k, v, implementation=library, **kwargs)
  return attention


def causal_padding_mod(lengths):
  """Causal plus padding of queries and keys past each row's length."""
  def mask_mod(b, h, q_idx, kv_idx):
    n = lengths[b]
    return (q_idx >= kv_idx) & (q_idx < n) & (kv_idx < n)
  return mask_mod


def causal_mod(b, h, q_idx, kv_idx):
  return q_idx >= kv_idx


def full_mod(b, h, q_idx, kv_idx):
  return (q_idx >= 0) & (kv_idx >= 0)


def document_mod(doc):
  """Causal within each packed document: ``doc`` int32 [B, S], the document of every token."""
  def mask_mod(b, h, q_idx, kv_idx):
    return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)
  return mask_mod


def prefix_lm_mod(prefix):
  """Every query sees its row's prefix (``prefix`` int32 [B]) and, after it, the keys before it."""
  def mask_mod(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < prefix[b])
  return mask_mod


def block_pattern_mod(visible, block: int):
  """The entries of the visible blocks of ``visible`` bool [1, 1, S/block, S/block] (a gather on
  both indices: the reference and the counts only; jaxflash gets the table itself)."""
  def mask_mod(b, h, q_idx, kv_idx):
    return visible[0, 0, q_idx // block, kv_idx // block]
  return mask_mod


def flax_mask(lengths, s: int) -> jax.Array:
  """bool [B, 1, S, S]: ``make_causal_mask(tokens) & make_attention_mask(valid, valid)`` as
  flax.linen computes them (written out here, so that the benchmark needs no Flax)."""
  valid = jnp.arange(s)[None, :] < lengths[:, None]  # [B, S]: tokens before each row's length
  padding = jnp.logical_and(valid[:, None, :, None], valid[:, None, None, :])
  idx = jnp.arange(s)
  causal = jnp.greater_equal(idx[:, None], idx[None, :])[None, None]
  return jnp.logical_and(causal, padding)


def dense_from_mod(mask_mod, b: int, s: int) -> jax.Array:
  """bool [b, 1, S, S] of a head-independent mask_mod (for jax.nn, which takes dense masks)."""
  idx = jnp.arange(s, dtype=jnp.int32)
  rows = jnp.arange(b, dtype=jnp.int32)[:, None, None, None]
  dense = mask_mod(rows, jnp.zeros((1, 1, 1, 1), jnp.int32), idx[None, None, :, None],
                   idx[None, None, None, :])
  return jnp.broadcast_to(dense, (b, 1, s, s))


def document_ids(s: int, documents: int, seed: int) -> np.ndarray:
  """int32 [S]: ``documents`` documents of random lengths (random cut points) packed in S."""
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.choice(np.arange(1, s), documents - 1, replace=False))
  return np.searchsorted(cuts, np.arange(s), side="right").astype(np.int32)


def block_pattern(blocks: int, fraction: float, seed: int) -> np.ndarray:
  """bool [blocks, blocks]: the diagonal and random off-diagonal blocks, ``fraction`` of all
  blocks visible in all (at least the diagonal)."""
  rng = np.random.default_rng(seed)
  visible = np.eye(blocks, dtype=bool)
  off = np.flatnonzero(~visible.ravel())
  extra = max(0, min(len(off), round(fraction * blocks * blocks) - blocks))
  visible.ravel()[rng.choice(off, extra, replace=False)] = True
  return visible


def _baselines(impls, mask_fixed: dict, dense, via: str) -> dict:
  """The jax.nn calls of a case given a dense mask."""
  return {impl: (_call(impl, None, mask_fixed, "mask"), (dense,), via) for impl in impls}


def _block_mask_build(mod_factory, arrays, b, n, s) -> tuple[Callable, tuple]:
  """create_block_mask of ``mod_factory(*arrays)`` under jit: its arrays (a BlockMask's static
  parts cannot leave a jit; the attention rows use one built outside)."""
  def build(*arrays):
    bm = jaxflash.create_block_mask(mod_factory(*arrays), b, n, s, s)
    return bm.table, bm.q_features, bm.kv_features
  return build, tuple(arrays)


def setup(name: str, shape: Shape, block: int, impls: tuple[str, ...], implementation,
          seed: int) -> Setup:
  """The case ``name`` at ``shape`` with the implementations of ``impls`` it has."""
  b, s, n = shape.b, shape.s, shape.n
  base = [i for i in impls if i in BASELINES]
  jf = lambda fixed, *names: _call("jaxflash", implementation, fixed, *names)  # noqa: E731
  calls, builds, meta = {}, {}, {}
  if name in ("dense_mask", "structured"):
    lengths = jnp.asarray([round(x * s / 4096) for x in PADDED_LENGTHS][:b]
                          + [s] * max(0, b - len(PADDED_LENGTHS)), jnp.int32)
    meta["lengths"] = [int(x) for x in lengths]
    mask_mod = causal_padding_mod(lengths)
    if name == "dense_mask":
      dense = jax.jit(flax_mask, static_argnums=1)(lengths, s)
      calls["jaxflash"] = (jf({}, "mask"), (dense,), "mask=[B,1,T,S] (Flax's causal & padding)")
      calls.update(_baselines(base, {}, dense, "mask=[B,1,T,S] (Flax's causal & padding)"))
    else:
      via = "is_causal + query_seq_lengths + key_value_seq_lengths"
      names = ("query_seq_lengths", "key_value_seq_lengths")
      calls["jaxflash"] = (jf({"is_causal": True}, *names), (lengths, lengths), via)
      for impl in base:
        calls[impl] = (_call(impl, None, {"is_causal": True}, *names), (lengths, lengths), via)
  elif name.startswith("dense_"):
    causal = name.startswith("dense_causal")
    mask_mod, fixed = (causal_mod, {"is_causal": True}) if causal else (full_mod, {})
    via = "is_causal" if causal else "no mask"
    calls["jaxflash"] = (jf(fixed), (), via)
    for impl in base:
      calls[impl] = (_call(impl, None, fixed), (), via)
  elif name.startswith("documents_"):
    documents = int(name.split("_")[1])
    doc = jnp.asarray(np.tile(document_ids(s, documents, seed), (b, 1)))
    meta["document_lengths"] = np.bincount(np.asarray(doc[0])).tolist()
    mask_mod = document_mod(doc)
    calls["jaxflash_segments"] = (jf({"is_causal": True}, "segment_ids"), (doc,),
                                  "segment_ids + is_causal")
    if "jaxflash_mask_mod" in impls:
      bm = jaxflash.create_block_mask(mask_mod, b, n, s, s)
      calls["jaxflash_mask_mod"] = (jf({}, "block_mask"), (bm,),
                                    "block_mask=create_block_mask(doc[b,q]==doc[b,kv] & q>=kv)")
      builds["jaxflash_mask_mod"] = (*_block_mask_build(document_mod, (doc,), b, n, s),
                                     "create_block_mask under jit")
    if base:
      dense = jax.jit(dense_from_mod, static_argnums=(0, 1, 2))(mask_mod, b, s)
      calls.update(_baselines(base, {"is_causal": True}, dense,
                              "is_causal + mask=[B,1,T,S] (same document)"))
  elif name.startswith("block_"):
    fraction = int(name.split("_")[1].removesuffix("pct")) / 100
    blocks = -(-s // block)
    visible = jnp.asarray(block_pattern(blocks, fraction, seed))[None, None]
    meta.update(block=block, visible_blocks=int(visible.sum()), blocks=blocks * blocks)
    mask_mod = block_pattern_mod(visible, block)
    bm = jaxflash.BlockMask.from_blocks(visible, s, s, block_size=block)
    calls["jaxflash"] = (jf({}, "block_mask"), (bm,), "block_mask=BlockMask.from_blocks")
    if base:
      dense = jax.jit(lambda v: jnp.repeat(jnp.repeat(v, block, 2), block, 3)[..., :s, :s])(
          visible)
      calls.update(_baselines(base, {}, dense, "mask=[1,1,T,S] (the visible blocks)"))
  elif name == "prefix_lm":
    rng = np.random.default_rng(seed)
    prefix = jnp.asarray(rng.integers(s // 8, s * 7 // 8, b), jnp.int32)
    meta["prefix_lengths"] = [int(x) for x in prefix]
    mask_mod = prefix_lm_mod(prefix)
    if "jaxflash_mask_mod" in impls:
      bm = jaxflash.create_block_mask(mask_mod, b, n, s, s)
      calls["jaxflash_mask_mod"] = (jf({}, "block_mask"), (bm,),
                                    "block_mask=create_block_mask(kv<=q | kv<prefix[b])")
      builds["jaxflash_mask_mod"] = (*_block_mask_build(prefix_lm_mod, (prefix,), b, n, s),
                                     "create_block_mask under jit")
    if base:
      dense = jax.jit(dense_from_mod, static_argnums=(0, 1, 2))(mask_mod, b, s)
      calls.update(_baselines(base, {}, dense, "mask=[B,1,T,S]"))
  else:
    raise ValueError(f"unknown case {name!r}; choose from {CASES}")
  keep = lambda d: {i: x for i, x in d.items() if i in impls}  # noqa: E731
  return Setup(name, shape, mask_mod, keep(calls), keep(builds), meta)


# --- Counting visible entries ------------------------------------------------------------------

def count_visible(mask_mod, shape: Shape, block: int) -> dict:
  """Visible entries of ``mask_mod`` over every batch row and head (an int), and the fraction of
  ``block`` x ``block`` blocks with any visible entry, counted on the device a block of query
  rows at a time (the T x S mask is never stored)."""
  b, s, n = shape.b, shape.s, shape.n
  blocks = -(-s // block)
  padded = blocks * block
  batch = jnp.arange(b, dtype=jnp.int32).reshape(b, 1, 1, 1)
  head = jnp.arange(n, dtype=jnp.int32).reshape(1, n, 1, 1)
  keys = jnp.arange(padded, dtype=jnp.int32)
  key_ok = (keys < s).reshape(1, 1, 1, padded)
  keys = jnp.minimum(keys, s - 1).reshape(1, 1, 1, padded)

  def one(i):
    rows = i * block + jnp.arange(block, dtype=jnp.int32)
    ok = jnp.logical_and((rows < s).reshape(1, 1, block, 1), key_ok)
    rows = jnp.minimum(rows, s - 1).reshape(1, 1, block, 1)
    vis = jnp.logical_and(mask_mod(batch, head, rows, keys), ok)
    vis = jnp.broadcast_to(vis, jnp.broadcast_shapes(vis.shape, (1, 1, block, padded)))
    # (Axes of size 1 are rows or heads the mask does not depend on: weighted when summed.)
    entries = jnp.sum(vis, axis=(2, 3), dtype=jnp.int32)
    nonempty = jnp.sum(jnp.any(vis.reshape(vis.shape[:3] + (blocks, block)), axis=(2, 4)),
                       axis=-1, dtype=jnp.int32)
    return entries, nonempty

  entries, nonempty = jax.jit(lambda: jax.lax.map(one, jnp.arange(blocks)))()
  entries = np.asarray(entries, np.int64).sum(axis=0)  # [b or 1, n or 1]
  nonempty = np.asarray(nonempty, np.int64).sum(axis=0)
  weight = (b // entries.shape[0]) * (n // entries.shape[1])
  total = int(entries.sum()) * weight
  return dict(visible_entries=total, visible_fraction=total / (b * n * s * s),
              block_fraction=int(nonempty.sum()) * weight / (b * n * blocks * blocks))


def flops(shape: Shape, visible_entries: int, mode: str) -> float:
  return 4.0 * shape.d * visible_entries * (3.5 if mode == "fwdbwd" else 1.0)


# --- The check --------------------------------------------------------------------------------

def check_index(shape: Shape, seed: int, rows: int = 512) -> tuple[list, np.ndarray, list]:
  """(batch rows, query rows, heads) checked: batch rows 0 and B-1, heads 0 and N-1, and
  ``rows`` query rows (all when S is smaller; else the last 128 and the rest at random)."""
  s = shape.s
  if s <= rows:
    query = np.arange(s)
  else:
    rng = np.random.default_rng(seed)
    last = np.arange(s - 128, s)
    query = np.union1d(last, rng.choice(s - 128, rows - 128, replace=False))
  return sorted({0, shape.b - 1}), query, sorted({0, shape.n - 1})


def take(x, index) -> np.ndarray:
  """``x`` [B, S, N, D] at the checked (batch rows, query rows, heads), float64."""
  batch, query, heads = index
  return np.asarray(np.asarray(x)[batch][:, query][:, :, heads], np.float64)


def reference(mask_mod, index, q, k, v, d_out) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Float32 output and dQ on the checked slice given the dense mask of its rows, and which
  (batch row, query row, head) see any key."""
  batch, query, heads = index
  sub = lambda x, rows: jnp.asarray(np.asarray(x)[batch][:, rows][:, :, heads],  # noqa: E731
                                    jnp.float32)
  s = k.shape[1]
  q_, d_ = sub(q, query), sub(d_out, query)
  k_, v_ = sub(k, np.arange(s)), sub(v, np.arange(s))
  mask = jnp.broadcast_to(
      mask_mod(jnp.asarray(batch, jnp.int32)[:, None, None, None],
               jnp.asarray(heads, jnp.int32)[None, :, None, None],
               jnp.asarray(query, jnp.int32)[None, None, :, None],
               jnp.arange(s, dtype=jnp.int32)[None, None, None, :]),
      (len(batch), len(heads), len(query), s))

  def out_and_dq(q, k, v, d_out, mask):
    attend = lambda q: jaxflash.reference_attention(q, k, v, mask=mask)[0]  # noqa: E731
    out, vjp = jax.vjp(attend, q)
    return out, vjp(d_out)[0], jnp.any(mask, axis=-1)

  with jax.default_matmul_precision("highest"):
    out, dq, seen = jax.jit(out_and_dq)(q_, k_, v_, d_, mask)
  seen = np.moveaxis(np.asarray(seen), 1, 2)[..., None]  # [b, query rows, heads, 1]
  return np.asarray(out, np.float64), np.asarray(dq, np.float64), seen


def relerr(got: np.ndarray, want: np.ndarray, seen: np.ndarray) -> float:
  """Relative error over the rows that see a key."""
  got, want = got * seen, want * seen
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


# --- Running ----------------------------------------------------------------------------------

def _executable(fn: Callable, mode: str, args: tuple, extra: tuple, options):
  """(compiled, its arguments) of ``fn`` in ``mode``."""
  q, k, v, d_out = args
  if mode == "fwd":
    compiled_args = (q, k, v, *extra)
    target = fn
  else:
    def loss(q, k, v, d_out, *extra):
      return jnp.sum(fn(q, k, v, *extra).astype(jnp.float32) * d_out)
    target = jax.grad(loss, argnums=(0, 1, 2))
    compiled_args = (q, k, v, d_out, *extra)
  return jax.jit(target).lower(*compiled_args).compile(options), compiled_args


def run_case(st: Setup, cfg: dict, seed: int, pool) -> list[dict]:
  """Every row of one case: counts, reference, then each (impl, mode) compiled, checked, timed,
  then the build rows."""
  shape = st.shape
  base = dict(dtype="bfloat16", B=shape.b, T=shape.s, S=shape.s, N=shape.n,
              D=shape.d)
  timing = {key: cfg[key] for key in ("warmups", "calls", "repeats", "slow_ms", "budget_ms")}
  options = cfg.get("compiler_options")
  inputs = make_inputs(Case("bf16", shape.b, shape.s, shape.n, shape.n, shape.d, False), seed)
  modes = tuple(cfg["modes"])
  futures = {(impl, mode): pool.submit(_executable, fn, mode, inputs, extra, options)
             for impl, (fn, extra, _) in st.calls.items() for mode in modes}
  try:
    counts = count_visible(st.mask_mod, shape, cfg["block"])
    base.update(visible_fraction=counts["visible_fraction"],
                block_fraction=counts["block_fraction"])
  except Exception as e:  # noqa: BLE001 - no counts: the rows still run, without TFLOP/s
    counts = None
    base["count_error"] = repr(e)[:300]
  index = check_index(shape, seed)
  try:
    ref_out, ref_dq, seen = reference(st.mask_mod, index, *inputs)
    ref_error = None
  except Exception as e:  # noqa: BLE001 - e.g. out of memory: every row reports it
    ref_error = f"reference: {e!r}"[:300]
  rows = []
  for (impl, mode), future in futures.items():
    fn, extra, via = st.calls[impl]
    row = dict(case=st.name, impl=impl, mode=mode, ms=None, visible_tflops=None, via=via,
               **base, relerr=None, wrong=False, calls=None, temp_bytes=None)
    if impl in JAXFLASH_IMPLS:
      row["backend"] = _served_by(fn, inputs, extra)
    print(f"[{st.name} {impl} {mode}]", file=sys.stderr, flush=True)
    try:
      executable, args = future.result()
      row["temp_bytes"] = executable.memory_analysis().temp_size_in_bytes
      if ref_error:
        raise RuntimeError(ref_error)
      result = executable(*args)
      if mode == "fwd":
        row["relerr"] = relerr(take(result, index), ref_out, seen)
      else:
        row["relerr"] = relerr(take(result[0], index), ref_dq, seen)
        row["repeatable"] = same_bits(result, executable(*args))
      row["wrong"] = not row["relerr"] < TOLERANCE  # NaN counts as wrong
      del result
      row["ms"], row["calls"] = time_calls(executable, args, **timing)
      if counts:
        row["visible_tflops"] = flops(shape, counts["visible_entries"], mode) / (
            row["ms"] * 1e-3) / 1e12
    except Exception as e:  # noqa: BLE001 - unsupported, out of memory, compile failure: go on
      row["error"] = repr(e)[:300]
    rows.append(row)
  del futures
  for impl, (build, args, via) in st.builds.items():
    row = dict(case=st.name, impl=impl, mode="build", ms=None, visible_tflops=None, via=via,
               **base, calls=None)
    print(f"[{st.name} {impl} build]", file=sys.stderr, flush=True)
    try:
      executable = jax.jit(build).lower(*args).compile(options)
      row["ms"], row["calls"] = time_calls(executable, args, **timing)
    except Exception as e:  # noqa: BLE001
      row["error"] = repr(e)[:300]
    rows.append(row)
  return rows


def _served_by(fn, inputs, extra) -> str | None:
  """The jaxflash backend that serves ``fn``'s call (None if it cannot be told)."""
  seen = {}
  try:
    jax.eval_shape(lambda *a: fn(*a, served_by=lambda name: seen.update(name=name)),
                   *inputs[:3], *extra)
  except Exception:  # noqa: BLE001 - the error shows on the row itself
    return None
  return seen.get("name")


def config(args) -> dict:
  on_gpu = devices.has_nvidia_gpu()
  smoke = args.smoke
  impls = args.impls or (list(JAXFLASH_IMPLS) + (["cudnn"] if on_gpu else ["xla"]))
  return dict(
      cases=args.cases or list(CASES), modes=args.modes or list(MODES), impls=impls,
      implementation=args.implementation, smoke=smoke,
      # Full shapes: 16 heads of 128; under --smoke S / 32, 2 heads of 32 and 64-key blocks.
      heads=2 if smoke else 16, head_dim=32 if smoke else 128, scale=32 if smoke else 1,
      block=64 if smoke else 128,
      warmups=1 if smoke else 2, calls=2 if smoke else 20, repeats=2 if smoke else 5,
      slow_ms=50.0, budget_ms=1000.0,
      compile_workers=(args.compile_workers if args.compile_workers is not None
                       else 8 if on_gpu else 1),
      # Compiling dominates a CPU smoke run and its timings mean nothing: LLVM -O0 halves it.
      compiler_options=({"xla_backend_optimization_level": 0} if smoke and not on_gpu
                        else None))


def case_shape(name: str, cfg: dict) -> Shape:
  b, s = {"dense_mask": (4, 4096), "structured": (4, 4096), "prefix_lm": (2, 8192)}.get(
      name, (1, 16384))
  return Shape(b, s // cfg["scale"], cfg["heads"], cfg["head_dim"])


def sweep(cfg: dict, checkpoint: Callable | None = None) -> tuple[list[dict], dict]:
  rows, metas = [], {}
  implementation = cfg["implementation"]
  workers = max(1, cfg["compile_workers"])
  with ThreadPoolExecutor(workers) as pool:
    for seed, name in enumerate(CASES):
      if name not in cfg["cases"]:
        continue
      shape = case_shape(name, cfg)
      try:
        st = setup(name, shape, cfg["block"], tuple(cfg["impls"]), implementation, seed)
      except Exception as e:  # noqa: BLE001 - a case that cannot be set up is reported
        rows.append(dict(case=name, impl="setup", mode=None, error=repr(e)[:300]))
        continue
      metas[name] = dict(st.meta, B=shape.b, S=shape.s, N=shape.n, D=shape.d,
                         via={impl: via for impl, (_, _, via) in st.calls.items()})
      rows += run_case(st, cfg, seed, pool)
      del st
      if checkpoint:
        checkpoint(rows, metas)
  return rows, metas


# --- Reporting --------------------------------------------------------------------------------

def _ms(x) -> str:
  if x is None:
    return "-"
  return f"{x:.3f}" if x < 10 else f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _rate(row: dict | None) -> str:
  if row is None:
    return "-"
  if row.get("error"):
    return "err"
  rate = row.get("visible_tflops")
  # (CPU smoke runs are far below 1 TFLOP/s: two significant digits there.)
  text = "-" if rate is None else f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"
  return text + (" WRONG" if row.get("wrong") else "")


def markdown_table(rows: list[dict]) -> str:
  """One line per (case, impl): ms and visible TFLOP/s, forward and forward+backward."""
  cells = {(r["case"], r["impl"], r["mode"]): r for r in rows if r.get("mode")}
  lines = ["| case | impl | visible | blocks | fwd ms | fwd TFLOP/s | fwd+bwd ms | "
           "fwd+bwd TFLOP/s | build ms | backend |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for case, impl in dict.fromkeys((r["case"], r["impl"]) for r in rows if r.get("mode")):
    fwd, fb = cells.get((case, impl, "fwd")), cells.get((case, impl, "fwdbwd"))
    build = cells.get((case, impl, "build"))
    any_row = fwd or fb or build
    ms = lambda r: "err" if r and r.get("error") else _ms(r and r.get("ms"))  # noqa: E731
    frac = any_row.get("visible_fraction")
    blocks = any_row.get("block_fraction")
    lines.append(f"| {case} | {impl} | {'-' if frac is None else f'{frac:.1%}'} | "
                 f"{'-' if blocks is None else f'{blocks:.1%}'} | {ms(fwd)} | {_rate(fwd)} | "
                 f"{ms(fb)} | {_rate(fb)} | {ms(build) if build else '-'} | "
                 f"{any_row.get('backend') or '-'} |")
  return "\n".join(lines)


def ratios(rows: list[dict]) -> list[str]:
  """The ratios issue 33's acceptance reads, from the rows (no targets: those are the issue's)."""
  def get(case, impl, mode, key):
    for r in rows:
      if (r.get("case"), r.get("impl"), r.get("mode")) == (case, impl, mode) and not (
          r.get("error") or r.get("wrong")):
        return r.get(key)
    return None

  lines = []
  for mode in MODES:
    dense, structured = get("dense_mask", "jaxflash", mode, "ms"), get("structured", "jaxflash",
                                                                       mode, "ms")
    cudnn = get("dense_mask", "cudnn", mode, "ms")
    if dense and structured:
      lines.append(f"{mode}: jaxflash dense mask / structured time: {dense / structured:.2f}x")
    if dense and cudnn:
      lines.append(f"{mode}: cuDNN dense mask / jaxflash dense mask time: {cudnn / dense:.2f}x")
    rate = get("dense_causal_16k", "jaxflash", mode, "visible_tflops")
    if rate:
      for case in SPARSE_CASES:
        for impl in JAXFLASH_IMPLS:
          mine = get(case, impl, mode, "visible_tflops")
          if mine:
            lines.append(f"{mode}: {case} {impl} visible TFLOP/s / dense_causal_16k's: "
                         f"{mine / rate:.2f}x")
  sparse_ms = get("block_10pct", "jaxflash", "fwdbwd", "ms")
  for dense in ("dense_16k", "dense_causal_16k"):
    dense_ms = get(dense, "jaxflash", "fwdbwd", "ms")
    if dense_ms and sparse_ms:
      lines.append(f"fwdbwd: {dense} / block_10pct time: {dense_ms / sparse_ms:.2f}x")
  return lines


def problems(rows: list[dict]) -> list[str]:
  out = []
  for r in rows:
    label = f"{r.get('case')} {r.get('impl')} {r.get('mode')}"
    if r.get("error"):
      out.append(f"ERROR {label}: {r['error'][:200]}")
    if r.get("wrong"):
      out.append(f"WRONG {label}: relerr={r.get('relerr')} (tolerance {TOLERANCE})")
  return out


def current_rows(result: dict) -> list[dict]:
  """The rows of a results file, where joined runs (`report.join`) measured the same case,
  implementation and mode, the later run's."""
  return report.current_rows(result, key=report.case_key)


def markdown(result: dict) -> str:
  block = next(iter(report.runs(result).values())).get("config", {}).get("block", 128)
  rows = current_rows(result)
  parts = [f"# Masks and block sparsity: {report.describe(result)}", "",
           "bf16. Time is the median per call; TFLOP/s count visible entries only "
           f"({FLOP_CONVENTION}). `visible`: the fraction of (query, key) entries visible; "
           f"`blocks`: of {block} x {block} blocks with any visible entry. `err`: see the "
           f"JSON; WRONG: relative error over {TOLERANCE}.", "", markdown_table(rows)]
  lines = ratios(rows)
  if lines:
    parts += ["", "Ratios:", ""] + [f"- {line}" for line in lines]
  issues = problems(rows)
  if issues:
    parts += ["", "Problems:", ""] + [f"- {line}" for line in issues]
  return "\n".join(parts) + "\n"


def write_outputs(result: dict, out: Path) -> list[Path]:
  """The JSON, its table (.md) and the plot (.png), as `report.write_outputs` writes them."""
  return report.write_outputs(result, out, markdown_of=markdown,
                              plots_of=lambda plot, result, stem: [plot.plot_masks(result, stem)])


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", help="results JSON (default results/<device>/masks.json); the .md "
                      "and .png go beside it")
  parser.add_argument("--cases", nargs="+", choices=CASES, help="default: all")
  parser.add_argument("--modes", nargs="+", choices=MODES, help="default: fwd fwdbwd")
  parser.add_argument("--impls", nargs="+", choices=JAXFLASH_IMPLS + BASELINES,
                      help="default: the jaxflash ones and cudnn (xla instead without a GPU)")
  parser.add_argument("--implementation", choices=("mosaic", "triton", "xla"),
                      help="jaxflash's backend (default: None, what the registry picks)")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny shapes and repeats that run on a CPU in seconds (CI)")
  parser.add_argument("--compile-workers", type=int,
                      help="threads that compile a case's executables ahead (8 on a GPU, else 1)")
  return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
  args = parse_args(argv)
  cfg = config(args)
  env = dict(report.environment(), flop_convention=FLOP_CONVENTION)
  print(json.dumps(env), file=sys.stderr)
  out = Path(args.out) if args.out else report.default_out(env, "masks")
  result = dict(kind="masks", environment=env, config=cfg)

  def checkpoint(rows, metas):
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(result, cases=metas, rows=rows, partial=True), indent=1)
                   + "\n")

  rows, metas = sweep(cfg, checkpoint)
  result.update(cases=metas, rows=rows)
  written = write_outputs(result, out)
  for line in problems(rows):
    print(line)
  print(markdown_table(rows))
  for line in ratios(rows):
    print(line)
  print("\nwrote " + " ".join(str(p) for p in written))
  return result


if __name__ == "__main__":
  main()
