"""Argument checks and normalisation of the public API, before any backend is chosen.

Every check runs on shapes, dtypes and Python values, so bad input fails with a `ValueError` that
names the argument, inside `jit` or not, before any kernel is traced. `normalise` returns the
call as the backends see it: `jaxflash._core.Inputs` (rank-4 arrays, int32 lengths) and the static
`jaxflash._core.Params`.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import _core
from jaxflash import block_mask as block_mask_lib
from jaxflash import dense_mask
from jaxflash import dropout
from jaxflash import fp8
from jaxflash import mask_mod as mask_mod_lib
from jaxflash import masking
from jaxflash._core import Inputs, Params
from jaxflash.block_mask import BlockMask

_FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


class Call(NamedTuple):
  """One normalised attention call."""

  inputs: Inputs
  params: Params
  unbatched: bool  # the user passed [T, N, H] arrays: outputs lose the batch axis again


def normalise(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
              query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
              segment_ids=None, logits_soft_cap=None, dropout_rate=0.0, dropout_rng=None,
              broadcast_dropout=False, interpret=False, mask_mod=None,
              block_mask=None, sinks=None, score_mod=None, q_descale=None, k_descale=None,
              v_descale=None, out_dtype=None, deterministic=True) -> Call:
  """Checks every argument of `jaxflash.flash_attention` (but ``implementation`` and
  ``return_residual``) and returns the call as backends see it."""
  check_devices(query=query, key=key, value=value, bias=bias, mask=mask,
                query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                segment_ids=segment_ids, dropout_rng=dropout_rng, sinks=sinks,
                q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
  query, key, value = (as_array(x, name) for x, name in
                       ((query, "query"), (key, "key"), (value, "value")))
  unbatched = _check_qkv(query, key, value)
  if unbatched:
    query, key, value = query[None], key[None], value[None]
  b, t, n, h = query.shape
  s = key.shape[1]
  for name, size in (("query", t), ("key", s)):
    if not _is_int(size):  # (jax.export's symbolic dims: a batch size may be one)
      raise ValueError(f"{name}'s sequence length must be known when the call is traced (the "
                       f"kernels and blocks are tiled by it), got the symbolic {size}")

  is_causal, broadcast_dropout, interpret, deterministic = (
      check_flag(flag, name) for flag, name in ((is_causal, "is_causal"),
                                                 (broadcast_dropout, "broadcast_dropout"),
                                                 (interpret, "interpret"),
                                                 (deterministic, "deterministic")))
  scale = _check_scale(scale, h)
  window = masking.make_window(is_causal, _check_window(local_window_size))
  logits_soft_cap = _check_soft_cap(logits_soft_cap)
  dropout_rate, dropout_seed = _check_dropout(dropout_rate, dropout_rng)

  mask = _check_dense(mask, "mask", (b, n, t, s), unbatched, want_bool=True)
  bias = _check_dense(bias, "bias", (b, n, t, s), unbatched, want_bool=False)
  q_lens = _check_lengths(query_seq_lengths, "query_seq_lengths", b, unbatched)
  kv_lens = _check_lengths(key_value_seq_lengths, "key_value_seq_lengths", b, unbatched)
  segments = _check_segments(segment_ids, b, t, s, unbatched)
  sinks = _check_sinks(sinks, n, query)
  score_rule, score_features, score_consts, score_tables = _check_score_mod(score_mod, b, n, t,
                                                                           s)
  descales, out_dtype = _check_fp8(query, key, (q_descale, k_descale, v_descale), out_dtype,
                                   unbatched)

  block_mask = _check_block_mask(mask_mod, block_mask, b, n, t, s, unbatched)
  packed = None
  if mask is not None:
    # The mask packed into words both ways, and its block table (`jaxflash.dense_mask`): the
    # Mosaic kernels read the words. The boolean mask stays as given (the Triton and XLA
    # backends read it): an int8 copy made here would be an operand of every kernel call,
    # written (64 MiB at B=4, 4k) even where no kernel reads it.
    packed = dense_mask.pack(mask)
  table, table_block = _block_table(block_mask, packed, segments, t, s)
  split = None if block_mask is None else block_mask.split
  mask_consts = None
  if split is not None and split.kernel_reason is not None:
    # From the mask's leaves only: its static split is equal to any other of the same structure
    # (so jit reuses a trace across masks), and may hold another mask's arrays, or tracers of
    # the jit that made it; reading them here would bake the first mask's arrays into a trace.
    if not block_mask.mask_consts and split.closed.consts:
      raise ValueError(
          "block_mask's mask_mod closes over arrays that only the XLA backend reads, and the "
          "BlockMask does not carry them (mask_consts is empty): make it with "
          "jaxflash.create_block_mask, or pass mask_consts=the mask_mod's captured arrays")
    mask_consts = block_mask.mask_consts

  inputs = Inputs(
      query=query, key=key, value=value, lengths=_lengths(q_lens, kv_lens, b, t, s),
      bias=bias, mask=mask, mask_words=None if packed is None else packed.by_keys,
      mask_words_t=None if packed is None else packed.by_queries,
      q_segment_ids=None if segments is None else segments[0],
      kv_segment_ids=None if segments is None else segments[1], dropout_seed=dropout_seed,
      block_table=table,
      q_features=None if block_mask is None else block_mask.q_features,
      kv_features=None if block_mask is None else block_mask.kv_features,
      mask_consts=mask_consts, sinks=sinks, score_q_features=score_features[0],
      score_kv_features=score_features[1], score_kv_scalars=score_features[2],
      score_consts=score_consts,
      score_tables=score_tables, score_bands=score_features[3], q_descale=descales[0],
      k_descale=descales[1], v_descale=descales[2])
  params = Params(scale=scale, window=window, logits_soft_cap=logits_soft_cap,
                  dropout_rate=dropout_rate, broadcast_dropout=broadcast_dropout,
                  interpret=interpret, table_block=table_block, mask_rule=split,
                  score_rule=score_rule, out_dtype=out_dtype, deterministic=deterministic,
                  query_padding=query_seq_lengths is not None)
  return Call(inputs, params, unbatched)


def _check_block_mask(mask_mod, block_mask, b: int, n: int, t: int, s: int,
                      unbatched: bool) -> BlockMask | None:
  """The call's `BlockMask`: the one given, or one made from ``mask_mod`` (checked first)."""
  if block_mask is not None:
    if not isinstance(block_mask, BlockMask):
      raise ValueError(f"block_mask must be a jaxflash.BlockMask (jaxflash.create_block_mask), "
                       f"got {type(block_mask).__name__}")
    if mask_mod is not None and mask_mod is not block_mask.mask_mod:
      raise ValueError("pass mask_mod or block_mask, not both (a block_mask carries the "
                       "mask_mod it was made from)")
    if (block_mask.q_len, block_mask.kv_len) != (t, s):
      raise ValueError(f"block_mask was made for q_len = {block_mask.q_len}, kv_len = "
                       f"{block_mask.kv_len}; this call has T = {t}, S = {s}")
    if jnp.ndim(block_mask.table) != 4:
      raise ValueError(f"block_mask.table must be [B or 1, N or 1, query blocks, key blocks], "
                       f"got shape {jnp.shape(block_mask.table)}")
    tb, tn = block_mask.table.shape[:2]
    for name, features, length in (("q_features", block_mask.q_features, t),
                                   ("kv_features", block_mask.kv_features, s)):
      # (Their batch axis is the second: sliced, stacked or sharded like the table's first, a
      # mask's leaves stay in step; each along its own axis 0 they do not.)
      shape = None if features is None else jnp.shape(features)
      if shape is not None and (len(shape) != 4 or shape[3] != length or any(
          d not in (1, want) for d, want in zip(shape[1:3], (tb, tn)))):
        raise ValueError(
            f"block_mask.{name} has shape {shape}, out of step with its table "
            f"{block_mask.table.shape}: a BlockMask's features are [F, B or 1, N or 1, "
            f"{length}] beside its table's [B or 1, N or 1, ...], so its batch is axis 1 of "
            f"the features and axis 0 of the table (slice or shard each leaf along its own)")
    if tb not in (1, b) or tn not in (1, n) or (unbatched and tb != 1):
      raise ValueError(f"block_mask was made for batch {tb} and {tn} heads; this call has "
                       f"batch {b} and {n} query heads (a mask for all is made with None)")
    return block_mask
  if mask_mod is None:
    return None
  reason = mask_mod_lib.signature_error(mask_mod)
  if reason is not None:
    raise ValueError(reason)
  if not (t and s) or (_is_int(b) and b == 0):
    # Nothing to mask (the call's result is empty or zeros): the mask_mod is checked only.
    mask_mod_lib.split(mask_mod)
    return None
  batch = None if unbatched else b
  if not _is_int(batch) and batch is not None:  # a symbolic batch (jax.export)
    if mask_mod_lib.split(mask_mod).depends_on(mask_mod_lib.BATCH):
      raise ValueError(f"mask_mod reads the batch index, which needs a known batch size; this "
                       f"call's is symbolic ({b}): export it with a concrete one")
    batch = None  # (the same mask for every row: the table's batch axis is 1)
  return block_mask_lib.create_block_mask(mask_mod, batch, n, t, s)


def _block_table(block_mask, packed, segments, t: int, s: int):
  """The block table of everything that hides entries element by element (a block mask, a
  dense mask given as `jaxflash.dense_mask.pack`'s result, segment ids) as one, and its block
  sizes; (None, None) without any."""
  tables = []
  if block_mask is not None:
    tables.append((block_mask.table, (block_mask.block_q, block_mask.block_k)))
  if packed is not None:
    tables.append((packed.table, (block_mask_lib.CLASSIFY_BLOCK,) * 2))
  if segments is not None:
    tables.append((block_mask_lib.classify_segments(*segments),
                   (block_mask_lib.CLASSIFY_BLOCK,) * 2))
  if not tables:
    return None, None
  block = tuple(math.gcd(*(blk[axis] for _, blk in tables)) for axis in (0, 1))
  table = None
  for x, blk in tables:
    x = block_mask_lib.resample(x, blk, block, (t, s))
    table = x if table is None else block_mask_lib.intersect(table, x)
  return table, block


def global_lengths(query_seq_lengths, key_value_seq_lengths, batch: int,
                   total: int) -> jax.Array:
  """Ring attention's lengths: (q_len, kv_len) int32 [B, 2] in the whole sequence of ``total``
  tokens (each device holds a chunk of it), checked and clipped as `normalise` does."""
  q_lens = _check_lengths(query_seq_lengths, "query_seq_lengths", batch, False)
  kv_lens = _check_lengths(key_value_seq_lengths, "key_value_seq_lengths", batch, False)
  return _lengths(q_lens, kv_lens, batch, total, total)


def check_cache(query, key_cache, value_cache, kv_lengths, page_table, value_head_dim=None):
  """Checks `jaxflash.decode_attention`'s query, cache and lengths (the rest goes through
  `normalise`); returns the caches as arrays (pages unchanged: the caller gathers them), the
  lengths as int32 [B] (not clipped; None: full rows, which a paged cache spells out) and the
  page table as an array. With ``value_cache`` None the values are the first
  ``value_head_dim`` features of the keys (a slice of ``key_cache``)."""
  query = as_array(query, "query")
  key_cache = as_array(key_cache, "key_cache")
  if value_cache is None:
    if key_cache.ndim != 4:
      raise ValueError(f"key_cache must be [B, S_max, K, H] (or pages [num_pages, page_size, K, "
                       f"H] with page_table), got shape {key_cache.shape}")
    if not _is_int(value_head_dim) or not 0 < value_head_dim <= key_cache.shape[-1]:
      raise ValueError(f"value_head_dim must be an int in [1, {key_cache.shape[-1]}] (key_cache's "
                       f"head dim) where value_cache is None, got {value_head_dim!r}")
    value_cache = key_cache[..., :value_head_dim]
  else:
    if value_head_dim is not None:
      raise ValueError(f"value_head_dim is for value_cache=None (values that are the keys' "
                       f"first features), got value_head_dim={value_head_dim!r} with a "
                       f"value_cache")
    value_cache = as_array(value_cache, "value_cache")
  if query.ndim != 4:
    raise ValueError(f"query must be [B, T, N, H], got shape {query.shape}")
  b, t = query.shape[:2]
  for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
    if cache.ndim != 4:
      raise ValueError(f"{name} must be [B, S_max, K, H] (or pages [num_pages, page_size, K, H] "
                       f"with page_table), got shape {cache.shape}")
  # (Checked here on the caches as given: `normalise` sees a paged cache's gathered rows.)
  n, h = query.shape[2:]
  _check_operand_dtypes(query=query, key_cache=key_cache, value_cache=value_cache)
  if key_cache.shape[-1] != h:
    raise ValueError(f"key_cache must have the query's head dim {h} (last axis), got "
                     f"key_cache {key_cache.shape} for query {query.shape}")
  if key_cache.shape[2] == 0 or n % key_cache.shape[2]:
    raise ValueError(f"the query's {n} heads must be a multiple of key_cache's K/V heads "
                     f"(axis 2), got query {query.shape} and key_cache {key_cache.shape}")
  if value_cache.shape[:-1] != key_cache.shape[:-1]:
    raise ValueError(f"key_cache and value_cache must have one shape but for the head dim, "
                     f"[B, S_max, K, Dqk] and [B, S_max, K, Dv] (or [num_pages, page_size, K, "
                     f"Dqk] and [..., Dv] with page_table), got key_cache {key_cache.shape} and "
                     f"value_cache {value_cache.shape}")
  if page_table is None:
    if key_cache.shape[0] != b:
      raise ValueError(f"key_cache must have the query's batch size {b} on axis 0 (or pass a "
                       f"page_table), got shape {key_cache.shape}")
    s_max = key_cache.shape[1]
  else:
    page_table = as_array(page_table, "page_table")
    if not jnp.issubdtype(page_table.dtype, jnp.integer):
      raise ValueError(f"page_table must be an integer array, got dtype {page_table.dtype}")
    if page_table.ndim != 2 or page_table.shape[0] != b:
      raise ValueError(f"page_table must have shape (B, pages_per_row) with B = {b}, got "
                       f"{page_table.shape}")
    if key_cache.shape[0] == 0:
      raise ValueError(f"key_cache (the pages, with page_table) must hold at least one page, "
                       f"got shape {key_cache.shape}")
    s_max = page_table.shape[1] * key_cache.shape[1]
  if t > s_max:
    raise ValueError(f"query has T = {t} new tokens, more than the cache holds (S_max = "
                     f"{s_max})")
  kv_lengths = _check_lengths(kv_lengths, "kv_lengths", b, False)
  if page_table is not None:
    _check_page_ids(page_table, kv_lengths, key_cache.shape[1], key_cache.shape[0])
    if kv_lengths is None:  # (gathering the pages reads the lengths)
      kv_lengths = jnp.full_like(page_table[:, 0], s_max, jnp.int32)  # (its rows' sharding)
  return key_cache, value_cache, kv_lengths, page_table


def _check_page_ids(page_table, kv_lengths, page_size: int, num_pages: int) -> None:
  """Where the table and lengths are known (an eager call), the pages a row's length reaches
  must exist: an id past the pool gave NaN rows on the XLA backend (a read outside it on the
  GPU) and a negative one wrapped to another page. Under jit they are the caller's promise."""
  if any(isinstance(x, jax.core.Tracer) for x in (page_table, kv_lengths)):
    return
  table = np.asarray(page_table)
  lengths = (np.full(table.shape[0], table.shape[1] * page_size) if kv_lengths is None
             else np.clip(np.asarray(kv_lengths), 0, table.shape[1] * page_size))
  used = np.arange(table.shape[1])[None, :] * page_size < lengths[:, None]
  bad = used & ((table < 0) | (table >= num_pages))
  if bad.any():
    row, col = (int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"page_table[{row}, {col}] = {table[row, col]} is not a page id in [0, "
                     f"{num_pages}) (key_cache holds {num_pages} pages), and row {row}'s length "
                     f"{int(lengths[row])} reaches that page; entries past a row's length may "
                     f"be anything")


def check_cache_descales(key_cache, values_in_keys: bool, paged: bool, k_descale, v_descale):
  """`jaxflash.decode_attention`'s cache factors where they differ from `flash_attention`'s
  (whose checks `normalise` runs next): with the values in the keys (``value_cache=None``)
  they share ``k_descale`` (returned as ``v_descale`` too), and neither a paged cache (its
  pages hold no token order) nor those shared values take a key factor per token. Returns
  ``(k_descale, v_descale)``."""
  if values_in_keys and v_descale is not None:
    raise ValueError("v_descale is for a value_cache of its own; with value_cache=None the "
                     "values are the keys' first features and share k_descale")
  if k_descale is not None:
    k_descale = as_array(k_descale, "k_descale")
    if k_descale.ndim == 3 and (paged or values_in_keys):
      why = ("a page_table's pages hold no token order" if paged else
             "the values (value_cache=None) share it, and theirs is per tensor or per head")
      raise ValueError(f"k_descale per token ([B, S, K]) needs a contiguous cache of its own "
                       f"({why}); pass one per tensor () or per (batch row, K/V head) [B, K], "
                       f"got shape {k_descale.shape}")
  if values_in_keys and fp8.is_fp8(key_cache.dtype):
    v_descale = k_descale
  return k_descale, v_descale


def check_devices(**arrays) -> None:
  """Arrays committed to different devices (``jax.device_put(x, device)``) cannot meet in one
  call, as in `jax.jit`: a ValueError naming two of them, before JAX's error about the
  arguments of an internal primitive."""
  placed = {}
  for name, x in arrays.items():
    for i, leaf in enumerate(jax.tree.leaves(x)):
      if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and (
          leaf.committed):
        placed.setdefault(frozenset(leaf.sharding.device_set),
                          name if i == 0 and not isinstance(x, (tuple, list)) else f"{name}[{i}]")
  if len(placed) > 1:
    (first, a), (second, b) = list(placed.items())[:2]
    show = lambda devices: ", ".join(sorted(str(d) for d in devices))  # noqa: E731
    raise ValueError(f"{a} is committed to {show(first)} and {b} to {show(second)}: the arrays "
                     f"of one call must be on the same devices (jax.device_put them there)")


# Each check raises ValueError naming the argument and returns the normalised value.


def as_array(x, name: str) -> jax.Array:
  """A JAX array (or traced/abstract value) as it is; NumPy arrays, lists and scalars converted
  as `jax.nn.dot_product_attention` converts them (float64 becomes float32 with x64 off)."""
  if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or (
      hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, np.ndarray)):
    return x
  try:
    return jnp.asarray(x)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{name} must be an array (or convertible to one), got "
                     f"{type(x).__name__}: {e}") from None


def _check_operand_dtypes(**operands) -> None:
  """Query, key and value (or a decoding call's caches) in one dtype the kernels take."""
  for name, x in operands.items():
    if x.dtype not in _FLOAT_DTYPES and not fp8.is_fp8(x.dtype):
      raise ValueError(f"{name} must be float16, bfloat16, float32 or float8 (e4m3fn, e5m2), "
                       f"got {x.dtype}")
  if len({x.dtype for x in operands.values()}) > 1:
    names = list(operands)
    raise ValueError(f"{', '.join(names[:-1])} and {names[-1]} must share one dtype, got "
                     f"{', '.join(str(x.dtype) for x in operands.values())}")


def _check_qkv(query, key, value) -> bool:
  """Checks ranks, dtypes and shapes of query/key/value; returns True for unbatched inputs."""
  if query.ndim not in (3, 4):
    raise ValueError(f"query must have rank 4 [B, T, N, H] or 3 [T, N, H], "
                     f"got shape {query.shape}")
  for name, x in (("key", key), ("value", value)):
    if x.ndim != query.ndim:
      raise ValueError(f"{name} must have the same rank as query ({query.ndim}), "
                       f"got shape {x.shape} for query shape {query.shape}")
  _check_operand_dtypes(query=query, key=key, value=value)
  # value's head dim Dv may differ from the query/key one (DeepSeek's MLA: Dqk 192, Dv 128);
  # the output then has Dv. Batch, key length and key/value heads must agree.
  if key.shape[:-1] != value.shape[:-1]:
    raise ValueError(f"value must have key's shape but for the head dim (last axis), got key "
                     f"{key.shape} and value {value.shape}")
  q4 = query.shape if query.ndim == 4 else (1,) + query.shape
  k4 = key.shape if key.ndim == 4 else (1,) + key.shape
  if q4[0] != k4[0]:
    raise ValueError(f"query and key must have the same batch size, got query {query.shape} "
                     f"and key {key.shape}")
  if q4[3] != k4[3]:
    raise ValueError(f"query and key must have the same head dim (last axis), got query "
                     f"{query.shape} and key {key.shape}")
  if q4[3] == 0 or q4[2] == 0 or k4[2] == 0:
    raise ValueError(f"head counts and head dim must be positive, got query {query.shape} and "
                     f"key {key.shape}")
  if value.shape[-1] == 0:
    raise ValueError(f"value's head dim must be positive, got value {value.shape}")
  if q4[2] % k4[2] != 0:
    raise ValueError(f"the number of query heads ({q4[2]}) must be a multiple of the number of "
                     f"key/value heads ({k4[2]}); got query {query.shape}, key {key.shape}")
  # T = 0 or S = 0 is allowed, as in jax.nn: empty outputs, or zeros (no key to see).
  return query.ndim == 3


def check_flag(flag, name: str) -> bool:
  """A bool (or NumPy bool): a string such as "no" would be truthy and silently flip it on."""
  if not isinstance(flag, (bool, np.bool_)):
    hint = ""
    if isinstance(flag, jax.core.Tracer):  # jax.jit(flash_attention)(q, k, v, is_causal=True)
      hint = (f" (a traced one: under jax.jit make it static, e.g. "
              f"jax.jit(f, static_argnames=\"{name}\"))")
    raise ValueError(f"{name} must be a bool, got {flag!r}{hint}")
  return bool(flag)


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _static_number(x, name: str, workaround: str):
  """A concrete scalar array (``1 / jnp.sqrt(d)``, as jax.nn takes a scale) as its number; the
  kernels compile ``name`` in, so a traced one is a ValueError saying ``workaround``."""
  if isinstance(x, (jax.Array, np.ndarray)) and x.shape == () and (
      jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
    try:
      return float(x)
    except jax.errors.ConcretizationTypeError:
      raise ValueError(f"{name} must be a number known when the call is traced (the kernels "
                       f"compile it in), got a traced array; {workaround}") from None
  return x


def _check_scale(scale, head_dim: int) -> float:
  if scale is None:
    return float(head_dim) ** -0.5
  scale = _static_number(scale, "scale", "for a learned temperature, multiply query by it "
                         "and pass scale=1.0")
  if not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not np.isfinite(scale):
    raise ValueError(f"scale must be a finite Python number, got {scale!r}")
  return float(scale)


def _check_window(window) -> tuple[int, int] | None:
  if window is None:
    return None
  if _is_int(window):
    window = (window, window)
  if (not isinstance(window, Sequence) or len(window) != 2
      or not all(_is_int(w) for w in window)):
    raise ValueError(f"local_window_size must be an int or a pair of ints (left, right), "
                     f"got {window!r}")
  if window[0] < 0 or window[1] < 0:
    raise ValueError(f"local_window_size must be non-negative, got {tuple(window)}")
  # Sides of masking.UNBOUNDED_WINDOW or more (2**31 - 1 is the natural "no limit") become
  # unbounded in `masking.make_window`, before any int32 arithmetic could overflow.
  return int(window[0]), int(window[1])


def _check_soft_cap(cap) -> float | None:
  if cap is None:
    return None
  cap = _static_number(cap, "logits_soft_cap", "a learned cap can be a score_mod, "
                       "lambda s, b, h, i, j: cap * jnp.tanh(s / cap)")
  if (not isinstance(cap, numbers.Real) or isinstance(cap, bool) or not np.isfinite(cap)
      or cap <= 0):
    raise ValueError(f"logits_soft_cap must be a positive finite number or None, got {cap!r}")
  return float(cap)


def _check_dropout(rate, rng) -> tuple[float, jax.Array | None]:
  """Returns ``(rate, seed words uint32[2] or None)``; no seed (and no cost) when rate is 0."""
  rate = _static_number(rate, "dropout_rate", "pass a Python float")
  if not isinstance(rate, numbers.Real) or isinstance(rate, bool) or not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be a Python number in [0, 1), got {rate!r}")
  if rate == 0.0:
    return 0.0, None
  if rng is None:
    raise ValueError("dropout_rate > 0 needs a dropout_rng key")
  rng = as_array(rng, "dropout_rng")
  if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.dtype == jnp.uint32:
    try:  # a raw key of the default implementation: threefry's uint32[2], rbg's uint32[4]
      rng = jax.random.wrap_key_data(rng)
    except (TypeError, ValueError):
      pass
  if not (jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.shape == ()):
    raise ValueError(f"dropout_rng must be a single PRNG key (jax.random.key(...), or a raw "
                     f"key of the default implementation such as jax.random.PRNGKey(...)), "
                     f"got {rng.dtype}{list(rng.shape)}")
  return float(rate), dropout.seed_words(rng)


def _check_dense(x, name: str, full: tuple[int, int, int, int], unbatched: bool,
                 want_bool: bool) -> jax.Array | None:
  """Checks a mask or bias and returns it as rank 4 [B or 1, N or 1, T, S].

  Batch and head axes of size 1 are kept (kernels index them with 0), the two sequence axes are
  broadcast to full size so kernels can read (block_q, block_k) tiles of them.
  """
  if x is None:
    return None
  x = as_array(x, name)
  if want_bool and x.dtype != jnp.bool_:
    raise ValueError(f"mask must be boolean (True = attend), got dtype {x.dtype}")
  if not want_bool and x.dtype == jnp.float64:
    x = x.astype(jnp.float32)  # (x64's float literals: jnp.where(mask, 0.0, -1e9), as jax.nn)
  if not want_bool and x.dtype not in _FLOAT_DTYPES:
    raise ValueError(f"bias must be float16, bfloat16 or float32, got dtype {x.dtype}")
  if unbatched and x.ndim == 4 and x.shape[0] == 1:
    x = x[0]  # (jax.nn gives unbatched inputs a batch axis of 1: a rank-4 mask of one fits)
  target = full[1:] if unbatched else full
  what = "[N, T, S]" if unbatched else "[B, N, T, S]"
  if x.ndim > len(target) or any(d not in (1, f) for d, f in
                                 zip(x.shape[::-1], target[::-1])):
    raise ValueError(f"{name} must broadcast to {what} = {target}, got shape {x.shape}")
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  return jnp.broadcast_to(x, x.shape[:2] + full[2:])


def _check_lengths(lengths, name: str, batch: int, unbatched: bool) -> jax.Array | None:
  if lengths is None:
    return None
  lengths = as_array(lengths, name)
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array, got dtype {lengths.dtype}")
  if unbatched and lengths.ndim == 0:
    lengths = lengths[None]
  if lengths.shape != (batch,):
    raise ValueError(f"{name} must have shape (B,) = ({batch},), got {lengths.shape}")
  # (Clipped before the cast: an int64 length past int32's range, under jax_enable_x64, or a
  # uint32 one from 2**31 on, would wrap; every length is clipped to [0, T or S] later anyway.)
  if jnp.iinfo(lengths.dtype).max > jnp.iinfo(jnp.int32).max:
    lengths = jnp.clip(lengths, 0, jnp.iinfo(jnp.int32).max)
  return lengths.astype(jnp.int32)


def _check_score_mod(score_mod, b: int, n: int, t: int, s: int):
  """``(rule, (row features, column features, column scalars, bands), consts, tables)`` of a
  score_mod (all None without one): the split (`jaxflash.mask_mod.split_score`, which checks
  it), its features for every (batch row, head, position), the scalars of its computed columns
  (`Split.col_scalars`) and its lookups' values on every diagonal where they read through
  ``q_idx - kv_idx`` alone (`Split.band_values`), the arrays it closes over (None without any:
  the XLA backend evaluates a rule the kernels cannot from them, and their gradients come from
  them), and the arrays its lookups read (flattened)."""
  if score_mod is None:
    return None, (None,) * 4, None, None
  rule = mask_mod_lib.split_score(score_mod)
  # (Whole on every device under Explicit mesh axes: the rule indexes them with index grids of
  # its own, which a batch-sharded array refused.)
  consts = tuple(_core.replicated(c) for c in rule.closed.consts) or None
  if rule.kernel_reason is not None:
    return rule, (None,) * 4, consts, None
  features = _score_features(rule, consts, b, n, t, s)
  return rule, features, consts, (rule.table_arrays(consts) if rule.lookups else None)


@functools.partial(jax.jit, static_argnums=(0, 2, 3, 4, 5))
def _score_features(rule, consts, b: int, n: int, t: int, s: int) -> tuple:
  """A score_mod's row features, column features, column scalars and band values, compiled
  once per split structure and sizes (the captured arrays its arguments): an eager call ran
  them op by op, 9 of its 12 ms on a CPU (2026-12-05), as `create_block_mask` once did."""
  return (rule.features(rule.row_vars, b, n, t, mask_mod_lib.Q, consts),
          rule.features(rule.col_vars, b, n, s, mask_mod_lib.KV, consts),
          rule.features(rule.col_scalars, b, n, 1, mask_mod_lib.KV, consts),
          rule.band_values(b, n, t, s, consts))


def _check_fp8(query, key, descales, out_dtype, unbatched: bool):
  """An FP8 call's descale factors in their canonical shapes (`jaxflash._core.Inputs`) and its
  output dtype's name; ``((None,) * 3, None)`` for any other call, which may pass neither."""
  names = ("q_descale", "k_descale", "v_descale")
  if not fp8.is_fp8(query.dtype):
    for name, x in zip(names + ("out_dtype",), descales + (out_dtype,)):
      if x is not None:
        raise ValueError(f"{name} is for float8 query, key and value; got {query.dtype} inputs")
    return (None,) * 3, None
  try:
    out = jnp.dtype(jnp.bfloat16 if out_dtype is None else out_dtype)
  except TypeError:
    out = None
  if out not in _FLOAT_DTYPES:
    raise ValueError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype!r}")
  b, t, n, _ = query.shape
  s, k = key.shape[1], key.shape[2]
  batch = () if unbatched else (b,)
  # The forms each factor may take (the canonical forms without the batch axis when the
  # call is unbatched): per tensor, per (batch row, head) and, for query and key, per token.
  forms = ({(): None, batch + (n,): None, batch + (k,): "groups", batch + (t, n): "tokens"},
           {(): None, batch + (k,): None, batch + (s, k): "tokens"},
           {(): None, batch + (k,): None})
  heads = (n, k, k)
  result = []
  for name, x, allowed, h in zip(names, descales, forms, heads):
    if x is None:  # a factor of 1
      result.append(None)
      continue
    x = as_array(x, name)
    # (float32 or wider: a 16-bit or FP8 factor would round the scales it carries.)
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.finfo(x.dtype).bits < 32:
      raise ValueError(f"{name} must be a float32 array (or a Python float), got dtype "
                       f"{x.dtype}")
    if x.shape not in allowed:
      raise ValueError(f"{name} must have one of the shapes {sorted(allowed, key=len)} (per "
                       f"tensor, per batch row and head{_PER_TOKEN if len(allowed) > 2 else ''}"
                       f"), got {x.shape}")
    form = allowed[x.shape]
    x = x.astype(jnp.float32)
    if unbatched and x.ndim:
      x = x[None]
    if x.ndim == 0:
      x = jnp.broadcast_to(x, (b, 1, h))
    elif form == "groups" and k != n:  # one factor per K/V head, shared by its query heads
      x = jnp.repeat(x, n // k, axis=1)[:, None]
    elif form != "tokens":
      x = x[:, None]
    result.append(_core.varying_like(x, _core.varying_axes(query)))
  return tuple(result), out.name


_PER_TOKEN = ", per token and head"


def _check_sinks(sinks, heads: int, query) -> jax.Array | None:
  """Attention sinks as float32 [N]. Inside `jax.shard_map` they are made varying like the
  query before the attention op: its backward computes their gradient from varying results, and
  the cast's own transpose then sums it over the devices that share them."""
  if sinks is None:
    return None
  sinks = as_array(sinks, "sinks")
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise ValueError(f"sinks must be a float array, got dtype {sinks.dtype}")
  if sinks.shape != (heads,):
    raise ValueError(f"sinks must have shape (N,) = ({heads},), one logit per query head, got "
                     f"{sinks.shape}")
  return _core.varying_like(sinks.astype(jnp.float32), _core.varying_axes(query))


def _check_segments(segment_ids, batch: int, t: int, s: int, unbatched: bool):
  """Returns ``None`` or ``(q_segment_ids [B, T], kv_segment_ids [B, S])`` as int32."""
  if segment_ids is None:
    return None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError(f"segment_ids must be an array or a pair (q_segment_ids, "
                       f"kv_segment_ids), got a sequence of length {len(segment_ids)}")
    q_seg, kv_seg = segment_ids
  else:
    if t != s:
      raise ValueError(f"a single segment_ids array is for self-attention (T == S), got T = {t} "
                       f"and S = {s}; pass (q_segment_ids, kv_segment_ids)")
    q_seg = kv_seg = segment_ids
  out = []
  for x, name, length in ((q_seg, "q_segment_ids", t), (kv_seg, "kv_segment_ids", s)):
    x = as_array(x, f"segment_ids ({name})")
    want = (length,) if unbatched else (batch, length)
    if x.shape != want or not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"segment_ids ({name}) must be an integer array of shape {want}, got "
                       f"{x.dtype}{list(x.shape)}")
    out.append((x[None] if unbatched else x).astype(jnp.int32))
  return tuple(out)


def _lengths(q_lens, kv_lens, batch: int, t: int, s: int) -> jax.Array:
  """(q_len, kv_len) per batch row as int32 [B, 2], clipped to the real lengths.

  Always passed, even when the user gave none, so that kernels have one code path; clipping
  means lengths past T or S simply mean "no padding".
  """
  q_lens = None if q_lens is None else jnp.clip(q_lens, 0, t).astype(jnp.int32)
  kv_lens = None if kv_lens is None else jnp.clip(kv_lens, 0, s).astype(jnp.int32)
  # A missing one is made like the given one: on an Explicit mesh it then has its sharding,
  # which jnp.stack asks of its operands.
  like = kv_lens if kv_lens is not None else q_lens
  if q_lens is None:
    q_lens = jnp.full((batch,), t, jnp.int32) if like is None else jnp.full_like(like, t)
  if kv_lens is None:
    kv_lens = jnp.full((batch,), s, jnp.int32) if like is None else jnp.full_like(like, s)
  # (Explicit shardings only: under jit with Auto axes a committed array's type and
  # full_like's compare unequal, and reshard without a mesh set is an error.)
  kv_lens = _core.resharded_like(kv_lens, q_lens)
  return jnp.stack([q_lens, kv_lens], axis=1)
