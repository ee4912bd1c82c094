"""A `mask_mod` split into what kernels can evaluate per tile: per-row and per-column features
computed once outside the kernels, and an elementwise rule that combines them.

A mask_mod is FlexAttention's ``mask_mod(batch, head, q_idx, kv_idx) -> bool``, written with
jnp on broadcasting int32 index arrays; it may close over arrays (document ids, a prefix length
per batch row, a block pattern). A kernel cannot index a captured array with a tile of indices
(Mosaic GPU has no gather from global memory), but it does not need to: tracing the function
on scalar indices shows, for every intermediate value, which of the four indices it depends
on. Values that depend on the query index and not on the key index (``doc_ids[b, q_idx]``, a
row's prefix length) are *row features*: they are computed outside the kernels for every (batch
row, head, query) as an array [B or 1, N or 1, T], and a kernel loads a tile's rows of them as
it loads segment ids. Values of the key index alone are *column features* [B or 1, N or 1, S].
What depends on both (``q_idx >= kv_idx``, ``doc_q == doc_kv``) is the *tile rule*: elementwise
operations that the kernels run on tiles of features, vectorised with `jax.vmap`.

Kernels can serve a mask_mod whose tile rule is elementwise (`Split.kernel_reason` is None):
comparisons, arithmetic, logic, selects and conversions. One that indexes a captured array with
both indices (``table[q_idx, kv_idx]``) has a gather in its tile rule; the Pallas backends
decline it with that reason, and the XLA backend evaluates the function itself, tile by tile.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jaxflash._vma import varying_axes, varying_like

MaskMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
ScoreMod = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]

# What each index of a mask_mod is called in dependency sets and messages.
BATCH, HEAD, Q, KV = "batch", "head", "q_idx", "kv_idx"
INDICES = (BATCH, HEAD, Q, KV)

# Primitives a tile rule may hold for the kernels to run it: elementwise on tiles once
# vectorised. Calls (jit, custom_jvp) are looked into.
_ELEMENTWISE = frozenset("""
  abs add and atan2 ceil clamp convert_element_type cos div eq exp exp2 floor ge gt integer_pow
  is_finite le log lt max min mul ne neg nextafter not or population_count pow rem round rsqrt
  select_n shift_left shift_right_arithmetic shift_right_logical sign sin sqrt square sub tan tanh
  xor logistic copy copy_p
""".split())
# Shape operations that are no-ops on the scalars the rule was traced with; and ``pvary``, the
# cast `jax.shard_map` (check_vma) records where an index meets a per-device captured array:
# on a kernel's tile it is the identity (`_run` makes operands vary alike outside kernels).
_SCALAR_SHAPE_OPS = frozenset(("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "pvary"))
_CALLS = frozenset(("pjit", "jit", "closed_call", "core_call", "custom_jvp_call",
                    "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "checkpoint"))


def signature_error(mask_mod) -> str | None:
  """Why ``mask_mod`` cannot be called as ``mask_mod(batch, head, q_idx, kv_idx)``, or None."""
  if not callable(mask_mod):
    return f"mask_mod must be a function of (batch, head, q_idx, kv_idx), got {mask_mod!r}"
  try:
    inspect.signature(mask_mod).bind(0, 0, 0, 0)
  except TypeError as e:
    return (f"mask_mod must take four positional arguments (batch, head, q_idx, kv_idx): "
            f"{e}")
  except ValueError:  # no signature to inspect (some builtins): tracing will tell
    pass
  return None


@dataclasses.dataclass(frozen=True, eq=False)  # static in jit and vjp: equal by `structure`
class Split:
  """A traced mask_mod, split into row features, column features and a tile rule.

  Attributes:
    mask_mod: the user's function.
    closed: its jaxpr on int32 scalars (batch, head, q_idx, kv_idx).
    deps: for every variable of the jaxpr, the indices it depends on.
    row_vars, col_vars: the variables the tile rule reads that depend on the query index (or
      on neither index: they are row features too) and on the key index alone.
    tile_eqns: the equations that depend on both indices, in order.
    kernel_reason: None if the tile rule is elementwise (the kernels can run it), else why not.
  """

  mask_mod: MaskMod
  closed: jcore.ClosedJaxpr
  deps: dict
  row_vars: tuple
  col_vars: tuple
  tile_eqns: tuple
  kernel_reason: str | None
  # A score_mod's split (`split_score`): the jaxpr's first input is the score, a value of both
  # indices, and the result is the new score.
  takes_score: bool = False
  # A score_mod's lookups: tile equations that read one entry of a captured array (its
  # ``tables``, constvars) at indices of both query and key (a relative-position table,
  # ``table[h, q_idx - kv_idx]``). The Triton kernels gather them from the arrays in memory
  # (`tile_fn`'s ``lookup``); Mosaic GPU has no gather (`lookup_reason`).
  lookups: tuple = ()
  tables: tuple = ()

  @functools.cached_property
  def structure(self) -> tuple:
    """What a compiled call depends on: the jaxpr as text (its equations, literals and the
    shapes and dtypes of the arrays it closes over) and whether it is a score_mod. Two splits
    of one structure are one static value (`__eq__`), so that a block mask made again, or by
    another function object with the same body, reuses what jit compiled for the first: the
    values of the captured arrays reach the kernels as arrays (features, tables, and
    `jaxflash.BlockMask.mask_consts`), never as constants of a trace."""
    return (self.takes_score, str(self.closed.jaxpr))

  def __eq__(self, other) -> bool:
    return isinstance(other, Split) and (self is other or self.structure == other.structure)

  def __hash__(self) -> int:
    return hash(self.structure)

  # Immutable, and its jaxpr holds tracebacks that cannot be copied: a deep copy (of a config
  # or a Flax module holding a BlockMask) shares it, and pickling keeps the function, which
  # is split again when loaded (a module-level one; a lambda cannot be pickled).
  def __copy__(self) -> "Split":
    return self

  def __deepcopy__(self, memo) -> "Split":
    return self

  def __reduce__(self):
    return (split_score if self.takes_score else split), (self.mask_mod,)

  @property
  def lookup_reason(self) -> str | None:
    """Why kernels without a gather from memory cannot run the rule, or None: they can where
    every lookup reads its array at indices of the query and key through ``q_idx - kv_idx``
    alone (`diagonal_lookups`), from a band of values made outside them (`band_values`)."""
    if not self.lookups or self.diagonal_lookups:
      return None
    return ("its score_mod reads a captured array at indices of both the query and the key "
            "other than through q_idx - kv_idx (a gather), which these kernels cannot (the "
            "Triton and XLA backends can)")

  @functools.cached_property
  def diagonal_lookups(self) -> bool:
    """Whether every lookup's indices depend on the query and key indices through ``q_idx -
    kv_idx`` alone (a relative-position table, T5's buckets of the distance): then a lookup's
    value is one per (batch row, head, diagonal), and a tile's values are a band of them."""
    if not self.lookups:
      return False
    jaxpr = self.closed.jaxpr
    start = {v: _NEITHER for v in jaxpr.constvars}
    start.update(zip(self.index_vars, (_NEITHER, _NEITHER, (_ONE, _ZERO), (_ZERO, _ONE))))
    tags = _diagonal_tags(jaxpr, start)
    return all(_on_diagonal(_tag_of(tags, v)) for eqn in self.lookups for v in eqn.invars[1:])

  @property
  def band_dtypes(self) -> tuple:
    """The dtypes of the lookups' values."""
    return tuple(eqn.outvars[0].aval.dtype for eqn in self.lookups)

  def band_values(self, batch: int, heads: int, t: int, s: int, consts=None,
                  raw: bool = False):
    """The lookups' values on every diagonal, int32 [F, B or 1, N or 1, T + S] (`to_int32`):
    entry ``i`` is the value where ``q_idx - kv_idx = i - S``; None unless the lookups are
    `diagonal_lookups`. Each is evaluated at ``q_idx = i - S, kv_idx = 0``, which gives the
    value of every (query, key) pair on that diagonal. ``consts`` and ``raw`` as `features`
    take them."""
    if not self.diagonal_lookups:
      return None
    wanted = [eqn.outvars[0] for eqn in self.lookups]
    return self._tabulate(wanted, batch, heads, jnp.arange(-s, t, dtype=jnp.int32),
                          lambda d: (d, jnp.int32(0)), consts, raw)

  @functools.cached_property
  def _banded(self) -> tuple[dict, tuple]:
    """``(band variables, equations)`` of the tile rule when the lookups' values come as band
    tiles: each lookup's result, and its reshapes to a scalar, mapped to the lookup's place;
    and the tile equations still to run (not the lookups, their reshapes, nor what computes
    their indices alone)."""
    place = {eqn.outvars[0]: i for i, eqn in enumerate(self.lookups)}
    for eqn in self.tile_eqns:  # (the (1, 1) entry a lookup reads, squeezed: the same value)
      if (eqn.primitive.name in _SCALAR_SHAPE_OPS and isinstance(eqn.invars[0], jcore.Var)
          and eqn.invars[0] in place):
        place[eqn.outvars[0]] = place[eqn.invars[0]]
    jaxpr = self.closed.jaxpr
    needed = _needed(jaxpr, jaxpr.outvars, known=set(place))
    eqns = tuple(eqn for eqn in self.tile_eqns if eqn.outvars[0] not in place
                 and any(v in needed for v in eqn.outvars))
    return place, eqns

  def banded_reads(self, var) -> bool:
    """Whether the tile rule, given its lookups as band tiles, reads ``var`` (a row or column
    feature): a kernel loads or computes only those."""
    return var is self.closed.jaxpr.outvars[0] or any(var in eqn.invars
                                                      for eqn in self._banded[1])

  def table_arrays(self, consts=None) -> tuple:
    """The captured arrays the lookups read, flattened (``consts``: the jaxpr's, by default)."""
    consts = self.closed.consts if consts is None else consts
    index = {v: i for i, v in enumerate(self.closed.jaxpr.constvars)}
    return tuple(jnp.ravel(jnp.asarray(consts[index[v]])) for v in self.tables)

  @property
  def index_vars(self) -> tuple:
    """The jaxpr's (batch, head, q_idx, kv_idx) inputs."""
    return tuple(self.closed.jaxpr.invars[-4:])

  @property
  def row_dtypes(self) -> tuple:
    return tuple(v.aval.dtype for v in self.row_vars)

  @property
  def col_dtypes(self) -> tuple:
    return tuple(v.aval.dtype for v in self.col_vars)

  @functools.cached_property
  def _columns(self) -> tuple:
    """(`computed_cols`, `col_scalars`, the equations that compute the former from the key
    index and the latter, in order)."""
    jaxpr = self.closed.jaxpr
    producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    computed, scalars, eqns = [], set(), set()
    for var in self.col_vars:
      mine = [producer[v] for v in _needed(jaxpr, [var]) if v in producer and KV in self.deps[v]]
      inputs = {x for eqn in mine for x in eqn.invars
                if isinstance(x, jcore.Var) and KV not in self.deps[x]}
      # (Scalar elementwise steps in 32-bit types: under jax_enable_x64 a float64 slope
      # would make 64-bit vector arithmetic, which a GPU kernel should not do; such a
      # column is loaded, already converted.)
      if all(_kernel_reason(eqn) is None and all(_is_small_scalar(v) for v in eqn.outvars)
             for eqn in mine) and all(_is_small_scalar(x) for x in inputs):
        computed.append(var)
        scalars.update(inputs)
        eqns.update(mine)
    # (In the jaxpr's order, which tracing fixes: the kernels index the scalars by position.)
    made = list(jaxpr.constvars) + list(jaxpr.invars) + [v for e in jaxpr.eqns for v in e.outvars]
    return (tuple(computed), tuple(v for v in made if v in scalars),
            tuple(eqn for eqn in jaxpr.eqns if eqn in eqns))

  @property
  def computed_cols(self) -> tuple:
    """The column features that are elementwise arithmetic of the key index and values of the
    batch row and head alone (ALiBi's ``slope[h] * kv_idx``): a kernel can compute them from
    its key indices, one value per column it holds, instead of loading them
    (`column_values`)."""
    return self._columns[0]

  @property
  def col_scalars(self) -> tuple:
    """The values of the batch row and head alone (no query or key index) that
    `computed_cols` read; `features` makes them as [F, B or 1, N or 1, 1]."""
    return self._columns[1]

  @property
  def col_scalar_dtypes(self) -> tuple:
    return tuple(v.aval.dtype for v in self.col_scalars)

  def column_values(self, kv: jax.Array, scalars: list) -> dict:
    """`computed_cols` at the key indices ``kv`` (an int32 vector) from the values of
    `col_scalars` (scalars in their own dtypes): {variable: vector}."""
    env = dict(zip(self.col_scalars, scalars))
    env[self.index_vars[3]] = kv
    for eqn in self._columns[2]:
      _run_on_tile(eqn, env, kv.shape, self, None)
    return {v: env[v] for v in self.computed_cols}

  @property
  def row_term(self):
    """The variable ``r`` of a score_mod whose result is ``rest + r`` with ``r`` a row feature
    (a float32 value of no key index, like ALiBi's ``-slope[h] * q_idx`` once `_separated`);
    None otherwise. Adding one value to every logit of a row leaves its softmax alone, so a
    kernel may leave ``r`` out of the logits and add it to the row's LSE instead
    (`without_row_term`)."""
    if not self.takes_score or not self.tile_eqns:
      return None
    last, out = self.tile_eqns[-1], self.closed.jaxpr.outvars[0]
    if last.primitive.name != "add" or last.outvars[0] is not out:
      return None
    term = last.invars[1]
    if not isinstance(term, jcore.Var) or term not in self.row_vars:
      return None
    return term if out.aval.dtype == jnp.float32 else None

  @functools.cached_property
  def without_row_term(self) -> Split | None:
    """This score_mod without its `row_term` (``rest`` alone), split: what a kernel evaluates
    per tile when it adds the row term to the LSE. Its row features are a subset of this
    split's (the same variables); None without a row term."""
    term = self.row_term
    if term is None:
      return None
    jaxpr, last = self.closed.jaxpr, self.tile_eqns[-1]
    rest = jaxpr.replace(eqns=[e for e in jaxpr.eqns if e is not last],
                         outvars=[last.invars[0]])
    return _split(self.mask_mod, self.closed.replace(jaxpr=rest), takes_score=True)

  def depends_on(self, index: str) -> bool:
    """Whether the mask depends on ``index`` (one of `INDICES`) at all."""
    out = self.closed.jaxpr.outvars[0]
    # (A constant result, such as and_masks() of nothing, is a literal: it depends on none.)
    return isinstance(out, jcore.Var) and index in self.deps[out]

  # --- Features, outside the kernels ---------------------------------------------------------

  def features(self, variables: tuple, batch: int, heads: int, length: int,
               index: str, consts=None, raw: bool = False, start=0):
    """``variables`` (row or column features) for every (batch row, head, position) of the
    axis ``index`` (`Q` or `KV`), stacked as int32 [F, B or 1, N or 1, length] (`to_int32`);
    a feature's batch (head) axis is 1 where no feature depends on the batch row (head).
    None when there are none. ``consts``: the arrays the function closes over (its own by
    default); ``raw``: a tuple of [B or 1, N or 1, length] arrays in their own dtypes instead,
    through which gradients reach ``consts``. ``start`` (an int or a traced int32 scalar): the
    position of entry 0, for a call over part of a sequence (ring attention's chunks)."""
    if not variables:
      return None
    zero = jnp.int32(0)
    positions = jnp.arange(length, dtype=jnp.int32)
    if not (isinstance(start, int) and start == 0):
      positions = positions + jnp.asarray(start, jnp.int32)
    return self._tabulate(variables, batch, heads, positions,
                          lambda i: (i if index == Q else zero, i if index == KV else zero),
                          consts, raw)

  def _tabulate(self, wanted, batch: int, heads: int, positions, indices, consts, raw: bool):
    """``wanted`` (one value per entry) at every (batch row, head, position), the query and
    key indices of a position being ``indices(position)``: as `features` returns them."""
    deps = set().union(*(self.deps[v] for v in wanted))
    b_axis = jnp.arange(batch, dtype=jnp.int32) if BATCH in deps else jnp.zeros(1, jnp.int32)
    h_axis = jnp.arange(heads, dtype=jnp.int32) if HEAD in deps else jnp.zeros(1, jnp.int32)

    def at(b, h, i):
      q, kv = indices(i)
      values = [jnp.reshape(x, ()) for x in self._evaluate({BATCH: b, HEAD: h, Q: q, KV: kv},
                                                           wanted, consts)]
      return tuple(values) if raw else jnp.stack([to_int32(x) for x in values])

    per_position = jax.vmap(at, in_axes=(None, None, 0), out_axes=-1)
    per_head = jax.vmap(per_position, in_axes=(None, 0, None), out_axes=-2)
    return jax.vmap(per_head, in_axes=(0, None, None), out_axes=-3)(b_axis, h_axis, positions)

  def _evaluate(self, env_by_index: dict, wanted, consts=None) -> list:
    """The values of ``wanted`` (variables of one entry) from the indices in
    ``env_by_index`` and ``consts`` (its own by default), running only the equations they
    need."""
    jaxpr = self.closed.jaxpr
    env = dict(zip(jaxpr.constvars, self.closed.consts if consts is None else consts))
    env.update(zip(self.index_vars, (env_by_index[name] for name in INDICES)))
    needed = _needed(jaxpr, wanted)
    for eqn in jaxpr.eqns:
      if any(v in needed for v in eqn.outvars):
        _run(eqn, env)
    return [_read(env, v) for v in wanted]

  # --- The tile rule, inside a kernel ------------------------------------------------------

  def reads(self, index: str, banded: bool = False) -> bool:
    """Whether the tile rule reads the index ``index`` (`Q` or `KV`) itself (``banded``: with
    its lookups as band tiles, `tile`'s ``bands``): a kernel builds an index tile only then."""
    var = self.index_vars[INDICES.index(index)]
    return any(var in eqn.invars for eqn in (self._banded[1] if banded else self.tile_eqns))

  def tile_fn(self, shape, q_idx, kv_idx, rows: list, cols: list, lookup=None):
    """A score_mod's rule on one ``shape`` tile as a function of the tile's scores (arguments as
    `tile`). What does not depend on the score, lookups included, is evaluated here, once: a
    backward differentiates the function (`jax.jvp`), and memory reads have no derivative.
    ``lookup(table, flat_indices)`` reads the ``table``-th of `table_arrays` at a tile of flat
    indices (needed only with lookups)."""
    if not self.lookups:
      return lambda score: self.tile(shape, q_idx, kv_idx, rows, cols, score=score)
    jaxpr = self.closed.jaxpr
    env = dict(zip(self.row_vars + self.col_vars, rows + cols))
    for var, idx, name in zip(self.index_vars[2:], (q_idx, kv_idx), (Q, KV)):
      if self.reads(name):
        env[var] = jnp.broadcast_to(idx() if callable(idx) else idx, shape)
    score_var = jaxpr.invars[0]
    from_score, later = {score_var}, []
    for eqn in self.tile_eqns:
      if any(v in from_score for v in eqn.invars if isinstance(v, jcore.Var)):
        later.append(eqn)
        from_score.update(eqn.outvars)
      else:
        _run_on_tile(eqn, env, shape, self, lookup)

    def fn(score):
      local = dict(env)
      local[score_var] = score
      for eqn in later:
        _run_on_tile(eqn, local, shape, self, lookup)
      out = jaxpr.outvars[0]
      value = _read(local, out) if not isinstance(out, jcore.Literal) else out.val
      return jnp.broadcast_to(jnp.asarray(value, jnp.float32), shape)
    return fn

  def tile(self, shape, q_idx, kv_idx, rows: list, cols: list, score=None, bands=None):
    """The mask of one ``shape`` tile (a score_mod's new scores, given the tile's ``score``):
    ``q_idx`` and ``kv_idx`` give the tile's query and key indices (int32 tiles, or functions
    that make them: called only if the rule reads them, since a kernel must not build a tile
    nothing reads), ``rows`` and ``cols`` its row and column features in their own dtypes
    (`from_int32`) broadcast to the tile (None for those the rule does not read). ``bands``:
    the lookups' values on the tile in their own dtypes (`band_values`, one tile per lookup),
    for a rule with `diagonal_lookups`. The tile rule runs vectorised over the tile's
    entries."""
    jaxpr = self.closed.jaxpr
    out = jaxpr.outvars[0]
    if not isinstance(out, jcore.Var):  # a literal result: every entry alike (and unhashable)
      return jnp.full(shape, out.val, jnp.float32 if self.takes_score else bool)
    place, eqns = self._banded if bands is not None else ({}, self.tile_eqns)
    if out in place:  # the looked-up value itself
      return bands[place[out]].astype(jnp.float32)
    if out in self.row_vars or out in self.col_vars:  # a result of one index only
      values = rows if out in self.row_vars else cols
      keys = self.row_vars if out in self.row_vars else self.col_vars
      value = values[keys.index(out)]
      return value.astype(jnp.float32) if self.takes_score else value != 0
    if self.takes_score and out is jaxpr.invars[0]:  # the score itself
      return score
    read = {v for eqn in eqns for v in eqn.invars if isinstance(v, jcore.Var)}
    tiles = tuple(self.index_vars[2:]) + ((jaxpr.invars[0],) if self.takes_score else ())
    indices = [(var, idx) for var, idx in zip(tiles, (q_idx, kv_idx, score)) if var in read]
    given = [(var, x) for var, x in zip(self.row_vars + self.col_vars, (*rows, *cols))
             if var in read]
    given += [(var, bands[i]) for var, i in place.items() if var in read]

    def entry(*values):
      env = dict(zip([var for var, _ in indices + given], values))
      for eqn in eqns:
        _run(eqn, env)
      return _read(env, out)

    # One vmap per tile axis (no reshape: a kernel's tile keeps its register layout).
    vectorised = entry
    for _ in shape:
      vectorised = jax.vmap(vectorised)
    made = [idx() if callable(idx) else idx for _, idx in indices]
    return vectorised(*(jnp.broadcast_to(x, shape) for x in (*made, *(x for _, x in given))))

  def reference(self, batch, head, q_idx, kv_idx, consts=None, score=None):
    """The whole function on broadcasting index arrays (and a score_mod's ``score``), evaluated
    entry by entry from its jaxpr with ``consts`` (the arrays it closes over; its own by
    default): what the XLA backend runs for a rule the kernels cannot, and how block tables are
    made."""
    consts = self.closed.consts if consts is None else consts
    jaxpr = self.closed.jaxpr
    indices = [jnp.asarray(x, jnp.int32) for x in (batch, head, q_idx, kv_idx)]
    inputs = ([jnp.asarray(score, jnp.float32)] if self.takes_score else []) + indices
    shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in inputs))

    def entry(*values):
      env = dict(zip(jaxpr.constvars, consts))
      env.update(zip(jaxpr.invars, values))
      for eqn in jaxpr.eqns:
        _run(eqn, env)
      return _read(env, jaxpr.outvars[0])

    vectorised = entry
    for _ in shape:
      vectorised = jax.vmap(vectorised)
    return vectorised(*(jnp.broadcast_to(x, shape) for x in inputs))


def split(mask_mod: MaskMod) -> Split:
  """Traces ``mask_mod`` on int32 scalars and splits it (see the module docstring).

  Raises:
    ValueError: naming ``mask_mod``, if it is not a function of four indices, fails on scalar
      int32 indices, or does not return one boolean per entry.
  """
  reason = signature_error(mask_mod)
  if reason is not None:
    raise ValueError(reason)
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  try:
    closed = jax.make_jaxpr(mask_mod)(scalar, scalar, scalar, scalar)
  except Exception as e:  # noqa: BLE001 (any failure of the user's function)
    raise ValueError(f"mask_mod(batch, head, q_idx, kv_idx) failed on int32 scalar indices: "
                     f"{type(e).__name__}: {e}") from e
  outs = closed.out_avals
  if len(outs) != 1:
    raise ValueError(f"mask_mod must return one boolean array, got {len(outs)} outputs")
  if outs[0].shape != ():
    raise ValueError(f"mask_mod must return one boolean per (batch, head, q_idx, kv_idx) and "
                     f"broadcast like its indices; on scalar indices it returned shape "
                     f"{outs[0].shape}")
  if outs[0].dtype != jnp.bool_:
    raise ValueError(f"mask_mod must return booleans (True = attend), got {outs[0].dtype}")
  return _split(mask_mod, closed, takes_score=False)


def split_score(score_mod: ScoreMod) -> Split:
  """Traces ``score_mod(score, batch, head, q_idx, kv_idx) -> score`` (FlexAttention's
  signature) on a float32 score and int32 scalar indices and splits it like a mask_mod: the
  score is a value of both indices, so whatever it touches is the tile rule.

  Raises:
    ValueError: naming ``score_mod``, if it is not a function of a score and four indices,
      fails on scalars, or does not return one float per entry.
  """
  if not callable(score_mod):
    raise ValueError(f"score_mod must be a function of (score, batch, head, q_idx, kv_idx), "
                     f"got {score_mod!r}")
  try:
    inspect.signature(score_mod).bind(0.0, 0, 0, 0, 0)
  except TypeError as e:
    raise ValueError(f"score_mod must take five positional arguments (score, batch, head, "
                     f"q_idx, kv_idx): {e}") from None
  except ValueError:  # no signature to inspect: tracing will tell
    pass
  index = jax.ShapeDtypeStruct((), jnp.int32)
  try:
    closed = jax.make_jaxpr(score_mod)(jax.ShapeDtypeStruct((), jnp.float32), index, index,
                                       index, index)
  except Exception as e:  # noqa: BLE001 (any failure of the user's function)
    raise ValueError(f"score_mod(score, batch, head, q_idx, kv_idx) failed on a float32 score "
                     f"and int32 scalar indices: {type(e).__name__}: {e}") from e
  outs = closed.out_avals
  if len(outs) != 1 or outs[0].shape != ():
    raise ValueError(f"score_mod must return one score per entry, shaped like its score "
                     f"(broadcast with its indices); on scalars it returned "
                     f"{[tuple(o.shape) for o in outs]}")
  if not jnp.issubdtype(outs[0].dtype, jnp.floating):
    raise ValueError(f"score_mod must return float scores, got {outs[0].dtype}")
  if outs[0].dtype != jnp.float32:  # (float64 under x64, or a 16-bit result): computed in f32
    closed = jax.make_jaxpr(lambda *a: jnp.asarray(score_mod(*a), jnp.float32))(
        *(jax.ShapeDtypeStruct((), d) for d in (jnp.float32,) + (jnp.int32,) * 4))
  return _split(score_mod, _separated(closed), takes_score=True)


def _dependencies(jaxpr, takes_score: bool) -> dict:
  """For every variable of ``jaxpr``, the indices (`INDICES`) it depends on; a score_mod's
  score depends on both the query and the key index."""
  deps = {v: frozenset() for v in jaxpr.constvars}
  deps.update({v: frozenset((name,)) for v, name in zip(jaxpr.invars[-4:], INDICES)})
  if takes_score:
    deps[jaxpr.invars[0]] = frozenset((Q, KV))  # one score per entry
  for eqn in jaxpr.eqns:
    d = frozenset().union(*(deps.get(v, frozenset()) for v in eqn.invars
                            if isinstance(v, jcore.Var)))
    deps.update((v, d) for v in eqn.outvars)
  return deps


@dataclasses.dataclass(eq=False)
class _Sum:
  """A value held as ``tile + col + row`` (`_separated`): ``tile`` of both indices, ``col`` of
  no query index, ``row`` of no key index; None for zero."""
  tile: object
  row: object
  col: object
  made: object = None  # the sum, once an operation needs the value itself

  def whole(self):
    if self.made is None:
      # (The row term last: a score_mod's result then ends in ``+ row``, which the Mosaic
      # kernels leave out of every logit and add to the LSE, `Split.without_row_term`.)
      parts = [x for x in (self.tile, self.col, self.row) if x is not None]
      made = parts[0]
      for part in parts[1:]:
        made = jax.lax.add(made, part)
      self.made = made
    return self.made


def _separated(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
  """``closed`` (a score_mod's jaxpr) traced again with sums of a query term, a key term and a
  term of both kept apart for as long as the arithmetic allows (sums, differences, negation,
  products and quotients by values of neither index, conversions to a float of 32 bits or
  more), so that the
  query and key terms become row and column features computed outside the kernels, and the
  tile rule adds them once, the row term last.

  ALiBi, ``score + slope[h] * (kv_idx - q_idx)``, has a tile rule of a subtraction, a
  conversion, a product and a sum per entry as written; separated, ``slope[h] * kv_idx`` is a
  column feature, ``-slope[h] * q_idx`` a row feature, and the rule is
  ``(score + col) + row``, whose last term the Mosaic kernels move to the LSE
  (`Split.without_row_term`). Integer arithmetic gives the same values (modulo 2³², as
  before); in floating point ``a * (k - q)`` becomes ``a * k - a * q``, which rounds
  differently (by an ulp of the larger term: 2⁻¹² at terms near 4096, far below a bfloat16
  score's rounding)."""
  jaxpr = closed.jaxpr
  deps = _dependencies(jaxpr, takes_score=True)

  def dep(v):
    return frozenset() if isinstance(v, jcore.Literal) else deps[v]

  def kind(v):  # which part of a `_Sum` a value of these indices is
    d = dep(v)
    return "tile" if {Q, KV} <= d else "col" if KV in d else "row"

  def as_parts(v, x) -> dict:
    if isinstance(x, _Sum):
      return {"tile": x.tile, "row": x.row, "col": x.col}
    return {part: x if part == kind(v) else None for part in ("tile", "row", "col")}

  def combine(a, b, op):
    if b is None:
      return a
    if a is None:
      return b if op is jax.lax.add else jax.lax.neg(b)
    return op(a, b)

  def each(x: _Sum, fn) -> _Sum:
    return _Sum(*(None if p is None else fn(p) for p in (x.tile, x.row, x.col)))

  def distribute(eqn, args):
    """The equation's result as a `_Sum`, or None to compute it whole."""
    name, sums = eqn.primitive.name, [isinstance(x, _Sum) for x in args]
    if name in ("add", "sub"):
      # (Two plain values of one kind gain nothing from being kept apart.)
      if not any(sums) and kind(eqn.invars[0]) == kind(eqn.invars[1]):
        return None
      first, second = (as_parts(v, x) for v, x in zip(eqn.invars, args))
      op = jax.lax.add if name == "add" else jax.lax.sub
      return _Sum(*(combine(first[p], second[p], op) for p in ("tile", "row", "col")))
    if not any(sums):
      return None
    if name == "neg":
      return each(args[0], jax.lax.neg)
    if name in ("mul", "div") and sums.count(True) == 1 and (name == "mul" or sums[0]):
      i = sums.index(True)  # (a quotient distributes only with the sum on top)
      factor_var, factor = eqn.invars[1 - i], args[1 - i]
      if dep(factor_var) & {Q, KV}:
        return None
      if name == "div" and not jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating):
        return None  # (integer division does not distribute)
      if name == "div":
        return each(args[i], lambda p: jax.lax.div(p, factor))
      return each(args[i], (lambda p: jax.lax.mul(p, factor)) if i == 0 else
                  (lambda p: jax.lax.mul(factor, p)))
    if (name == "convert_element_type" and jnp.issubdtype(eqn.params["new_dtype"], jnp.floating)
        and jnp.finfo(eqn.params["new_dtype"]).bits >= 32):
      # (Not to 16 bits: each term rounded there, or past float16's range, where their sum is
      # not, would lose far more than the sum's own rounding: inf - inf once made NaN rows.)
      dtype = eqn.params["new_dtype"]
      return each(args[0], lambda p: jax.lax.convert_element_type(p, dtype))
    return None

  def fn(*inputs):
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, inputs))
    for eqn in jaxpr.eqns:
      args = [_read(env, v) for v in eqn.invars]
      result = distribute(eqn, args)
      if result is not None:
        env[eqn.outvars[0]] = result
        continue
      _run(eqn, env, [x.whole() if isinstance(x, _Sum) else x for x in args])
    out = _read(env, jaxpr.outvars[0])
    return out.whole() if isinstance(out, _Sum) else out

  return jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                              for v in jaxpr.invars))


def _split(fn, closed, takes_score: bool) -> Split:
  """`Split` of a traced mask_mod or score_mod: each variable's index dependencies, the tile
  equations (those of both indices) and the features they read."""
  jaxpr = closed.jaxpr
  deps = _dependencies(jaxpr, takes_score)
  index_vars = jaxpr.invars[-4:]
  tile_eqns, reasons, lookups = [], [], []
  # (What the score reaches: a lookup must not depend on it, since a kernel gathers the entry
  # before it differentiates the rule.)
  from_score = {jaxpr.invars[0]} if takes_score else set()
  for eqn in jaxpr.eqns:
    d = frozenset().union(*(deps.get(v, frozenset()) for v in eqn.invars
                            if isinstance(v, jcore.Var)))
    scored = any(v in from_score for v in eqn.invars if isinstance(v, jcore.Var))
    if scored:
      from_score.update(eqn.outvars)
    if Q in d and KV in d:
      tile_eqns.append(eqn)
      if takes_score and not scored and _is_lookup(eqn, jaxpr):
        lookups.append(eqn)
        continue
      why = _kernel_reason(eqn)
      if why is not None:
        reasons.append(why)
  tables = tuple(dict.fromkeys(eqn.invars[0] for eqn in lookups))
  tile_inputs = []
  for eqn in tile_eqns:
    for v in eqn.invars:
      # (The batch and head indices are features too: a shard of a sharded call knows its
      # rows' and heads' global indices only through arrays made for the whole call.)
      if (isinstance(v, jcore.Var) and not (Q in deps[v] and KV in deps[v])
          and v not in tile_inputs and v not in index_vars[2:] and v not in tables):
        tile_inputs.append(v)
  out = jaxpr.outvars[0]
  if isinstance(out, jcore.Var) and not (Q in deps[out] and KV in deps[out]) and (
      out not in tile_inputs):
    tile_inputs.append(out)  # a mask of one index: the result is itself a feature
  row_vars = tuple(v for v in tile_inputs if KV not in deps[v])
  col_vars = tuple(v for v in tile_inputs if KV in deps[v])
  looked_up = {w for e in lookups for w in e.outvars}  # (one entry, shaped (1, ...))
  shaped = [v for v in tile_inputs + [w for e in tile_eqns for w in e.outvars]
            if getattr(v.aval, "shape", ()) != () and v not in looked_up]
  if shaped:  # e.g. a whole captured array entering the rule: not one value per entry
    reasons.append(f"a value of shape {shaped[0].aval.shape}")
  reason = None
  if reasons:
    name = "score_mod" if takes_score else "mask_mod"
    reason = (f"its {name} combines the query and key indices with {', '.join(reasons)}, "
              f"which the kernels cannot evaluate per tile (only elementwise operations)")
  return Split(fn, closed, deps, row_vars, col_vars, tuple(tile_eqns), reason, takes_score,
               tuple(lookups), tables)


def _tile_value(env, v, shape):
  """A variable or literal as a tile of its own dtype."""
  return jnp.broadcast_to(jnp.asarray(_read(env, v), v.aval.dtype), shape)


def _is_lookup(eqn, jaxpr) -> bool:
  """A `dynamic_slice` of one entry of a captured array (what ``table[i, j]`` on scalar
  indices traces to)."""
  return (eqn.primitive.name == "dynamic_slice" and eqn.invars[0] in jaxpr.constvars
          and all(size == 1 for size in eqn.params["slice_sizes"]))


def _run_on_tile(eqn, env, shape, split: Split, lookup):
  """One tile equation on whole tiles (no vmap: a lookup reads memory with a tile of indices):
  elementwise primitives on operands broadcast to the tile, scalar shape operations as no-ops,
  calls inlined, and a lookup as ``lookup(table, flat indices)``, its start indices clamped as
  `jax.lax.dynamic_slice` clamps them."""
  name = eqn.primitive.name
  if eqn in split.lookups:
    table = eqn.invars[0]
    dims = table.aval.shape
    flat = jnp.zeros(shape, jnp.int32)
    for dim, v in zip(dims, eqn.invars[1:]):
      start = jnp.clip(_tile_value(env, v, shape).astype(jnp.int32), 0, dim - 1)
      flat = flat * dim + start
    env[eqn.outvars[0]] = lookup(split.tables.index(table), flat)
    return
  if name in _SCALAR_SHAPE_OPS:
    env[eqn.outvars[0]] = _read(env, eqn.invars[0])
    return
  if name in _CALLS:
    sub = next(iter(jcore.jaxprs_in_params(eqn.params)))
    inner = dict(zip(sub.invars, (_read(env, v) for v in eqn.invars[-len(sub.invars):])))
    for inner_eqn in sub.eqns:
      _run_on_tile(inner_eqn, inner, shape, split, lookup)
    for v, w in zip(eqn.outvars, sub.outvars):
      env[v] = _read(inner, w)
    return
  _run(eqn, env, [_tile_value(env, v, shape) for v in eqn.invars])


def _kernel_reason(eqn) -> str | None:
  """Why one tile equation cannot run in a kernel, or None."""
  name = eqn.primitive.name
  if name == "select_n" and len(eqn.invars) > 3:  # (Mosaic GPU lowers two cases only)
    return f"'select_n' of {len(eqn.invars) - 1} cases (write a chain of jnp.where)"
  if name in _ELEMENTWISE:
    return None
  if name in _SCALAR_SHAPE_OPS and all(getattr(v.aval, "shape", ()) == () for v in eqn.outvars):
    return None
  if name in _CALLS:
    for sub in jcore.jaxprs_in_params(eqn.params):
      for inner in sub.eqns:
        why = _kernel_reason(inner)
        if why is not None:
          return why
    return None
  return f"'{name}'"


def _needed(jaxpr, wanted, known=frozenset()) -> set:
  """The variables that the values of ``wanted`` are computed from (``wanted`` included), not
  looking past those in ``known`` (values given otherwise)."""
  producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
  needed, stack = set(), [v for v in wanted if isinstance(v, jcore.Var)]
  while stack:
    v = stack.pop()
    if v in needed:
      continue
    needed.add(v)
    eqn = None if v in known else producer.get(v)
    if eqn is not None:
      stack.extend(x for x in eqn.invars if isinstance(x, jcore.Var))
  return needed


# How a value depends on the query and key indices, for `Split.diagonal_lookups`: ``(a, b)``
# for ``a * q_idx + b * kv_idx + c`` with c of neither index and coefficients that are sums of
# integers times products of values of neither index (`_Coefficient`: ``_separated`` turns
# ``x * (q_idx - kv_idx)`` into ``x * q_idx - x * kv_idx``); `_DIAGONAL` for another function of
# ``q_idx - kv_idx`` (and of neither index); None for anything else. (In floating point,
# ``x * q_idx - x * kv_idx`` may round differently from ``x * (q_idx - kv_idx)``, which a band
# holds: by an ulp of the larger term, as `_separated` says.)
_DIAGONAL = "diagonal"


class _Coefficient(dict):
  """``{product of factors (a sorted tuple of their ids): integer}``; empty for zero."""

  def plus(self, other: _Coefficient, sign: int = 1) -> _Coefficient:
    out = _Coefficient(self)
    for term, n in other.items():
      out[term] = out.get(term, 0) + sign * n
      if out[term] == 0:
        del out[term]
    return out

  def times(self, n: int = 1, factor=None) -> _Coefficient:
    extra = () if factor is None else (id(factor),)
    return _Coefficient({tuple(sorted(term + extra)): m * n for term, m in self.items() if n})


_ZERO, _ONE = _Coefficient(), _Coefficient({(): 1})
_NEITHER = (_ZERO, _ZERO)


def _on_diagonal(tag) -> bool:
  """Whether a value of this tag is a function of ``q_idx - kv_idx`` (and of neither index)."""
  return tag == _DIAGONAL or (isinstance(tag, tuple) and not tag[0].plus(tag[1]))


def _tag_of(tags: dict, v):
  return _NEITHER if isinstance(v, jcore.Literal) else tags.get(v)


def _diagonal_tags(jaxpr, tags: dict) -> dict:
  """Every variable's tag (see `_DIAGONAL`), from those of the inputs in ``tags``; calls are
  looked into."""
  tags = dict(tags)
  for eqn in jaxpr.eqns:
    args = [_tag_of(tags, v) for v in eqn.invars]
    if eqn.primitive.name in _CALLS:
      sub = next(iter(jcore.jaxprs_in_params(eqn.params)))
      inner = {v: _NEITHER for v in sub.constvars}
      inner.update(zip(sub.invars, args[-len(sub.invars):]))
      inner = _diagonal_tags(sub, inner)
      tags.update(zip(eqn.outvars, (_tag_of(inner, w) for w in sub.outvars)))
      continue
    tags.update((v, _affine_tag(eqn, args)) for v in eqn.outvars)
  return tags


def _affine_tag(eqn, args: list):
  """The tag of an equation's result from its operands' tags."""
  name = eqn.primitive.name
  if all(isinstance(t, tuple) for t in args):
    if name in ("add", "sub"):
      sign = 1 if name == "add" else -1
      return (args[0][0].plus(args[1][0], sign), args[0][1].plus(args[1][1], sign))
    if name == "neg":
      return (args[0][0].times(-1), args[0][1].times(-1))
    if name == "convert_element_type" and _truncates(eqn):
      pass  # (int(x * q_idx) - int(x * kv_idx) is no function of q_idx - kv_idx)
    elif name in ("convert_element_type", "copy", "copy_p") or name in _SCALAR_SHAPE_OPS:
      return args[0]
    if name == "mul":  # by an integer literal or by a value of neither index: still affine
      for i, v in enumerate(eqn.invars):
        other = args[1 - i]
        value = v.val if isinstance(v, jcore.Literal) else None
        if value is not None and jnp.ndim(value) == 0 and float(value).is_integer():
          return (other[0].times(int(value)), other[1].times(int(value)))
        if value is None and args[i] == _NEITHER:
          return (other[0].times(factor=v), other[1].times(factor=v))
  if all(t == _NEITHER for t in args):
    return _NEITHER
  if all(_on_diagonal(t) for t in args):  # any function of diagonal values is one too
    return _DIAGONAL
  return None


def _truncates(eqn) -> bool:
  """Whether a conversion rounds a float to an integer (or a boolean)."""
  src = eqn.invars[0].aval.dtype if isinstance(eqn.invars[0], jcore.Var) else None
  return (src is not None and jnp.issubdtype(src, jnp.floating)
          and not jnp.issubdtype(eqn.params["new_dtype"], jnp.floating))


def _is_small_scalar(v) -> bool:
  """Whether ``v`` is a scalar of at most 32 bits."""
  return v.aval.shape == () and jnp.dtype(v.aval.dtype).itemsize <= 4


def _read(env, v):
  return v.val if isinstance(v, jcore.Literal) else env[v]


def _run(eqn, env, args=None):
  """Binds one equation on the values in ``env`` (or on ``args``, its operands as given) and
  stores its results there (what `jax.core.eval_jaxpr` does for each equation)."""
  params = eqn.primitive.get_bind_params(eqn.params)
  subfuns = ()
  if isinstance(params, tuple):  # older jax: (subfuns, params)
    subfuns, params = params
  if args is None:
    args = [_read(env, v) for v in eqn.invars]
  if eqn.primitive.name == "pvary":  # (its operand may vary already here: `varying_like`)
    env[eqn.outvars[0]] = varying_like(args[0], frozenset(eqn.params["axes"]))
    return
  # Inside `jax.shard_map` some operands may vary over manual axes (indices that start at a
  # device's chunk) and others not: a primitive bound directly takes them only alike.
  axes = frozenset().union(*(varying_axes(x) for x in args))
  if axes:  # (a literal becomes an array of its variable's dtype first)
    args = [x if varying_axes(x) >= axes else varying_like(jnp.asarray(x, v.aval.dtype), axes)
            for x, v in zip(args, eqn.invars)]
  outs = eqn.primitive.bind(*subfuns, *args, **params)
  if not eqn.primitive.multiple_results:
    outs = [outs]
  for v, x in zip(eqn.outvars, outs):
    env[v] = x


def to_int32(x) -> jax.Array:
  """A feature as int32 (the one dtype the kernels load): booleans and integers converted,
  32-bit floats bit-cast (`from_int32` casts back)."""
  x = jnp.asarray(x)
  if x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer):
    return x.astype(jnp.int32)
  if x.dtype == jnp.float32:
    return jax.lax.bitcast_convert_type(x, jnp.int32)
  return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def from_int32(x: jax.Array, dtype) -> jax.Array:
  """The inverse of `to_int32` for a feature of ``dtype``."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.bool_:
    return x != 0
  if jnp.issubdtype(dtype, jnp.integer):
    return x.astype(dtype)
  return jax.lax.bitcast_convert_type(x, jnp.float32).astype(dtype)
