"""Attention on sharded arrays: every device computes its own batch rows and heads.

A backend's forward and backward are per-device programs (Pallas kernels, or loops whose bounds
depend on the data): XLA cannot split them itself, and left alone it gathers every operand onto
every device and computes the whole call everywhere. This module runs them as a local call on
each device's share instead, wherever a call comes from:

- **Under `jax.jit` with `AxisType.Auto` mesh axes** (or shardings given to jit, no mesh set):
  the call is one primitive whose lowering is a `custom_partitioning` op. The partitioner tells
  it how the operands are sharded; it keeps the batch axis and the head axes sharded as the
  query is, and asks for everything else whole (a sequence-sharded operand is gathered, with a
  warning: the result is right, and context parallelism is `jaxflash.ring_attention`'s job).
- **Under `AxisType.Explicit` mesh axes**, the shardings are part of the types, so the call is
  a `jax.shard_map` over the axes that shard the query's batch and heads; operands are
  `jax.reshard`-ed to that layout first and results back to their operand's sharding. (Its
  ``check_vma`` is off: the body is one local call, and Pallas's interpreter cannot run under
  it.)
- **Inside `jax.shard_map`** (every mesh axis manual) the call is already local. Its operands are
  made varying over the same axes (`check_vma=True` wants one type for a loop's carry), and
  kernel outputs carry that type (`jaxflash._core.out_struct`).

Heads are split only where the key/value heads split with them (K divisible by the number of
shards), or where there is one key/value head (MQA), which every device then holds whole.

Results that are sums over what a device holds only part of are completed with `psum`: the
gradient of a bias broadcast over the batch (or heads) when the batch (or heads) are sharded,
and dK/dV of an MQA key head shared by sharded query heads. Nothing else communicates.

Dropout coordinates are global: a shard's dropout seed carries the batch row and head its
first row and head have in the whole call (`jaxflash._core.dropout_stream`), so a sharded call
drops exactly what the unsharded call drops. Inside a user's `shard_map` the coordinates are
the shard's own, as every `jax.random` call there is: fold the device's index into the rng for
different masks per device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Callable

import jax
import jax.core
import jax.extend
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import batching
from jax.interpreters import mlir
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflash import _core
from jaxflash._core import Inputs, Params

# What one dimension of an operand or result holds: the batch, the query heads, the key/value
# heads, or (None) something every device needs whole (sequence, head dim, broadcast axes).
BATCH, HEADS, KV_HEADS = "b", "n", "k"
Roles = tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
  """Which mesh axes split the batch and the heads of a call (empty tuples: not split)."""

  batch: tuple[str, ...] = ()
  heads: tuple[str, ...] = ()
  kv_heads_split: bool = False  # the key/value heads split with the query heads (else: MQA)

  @property
  def axes(self) -> tuple[str, ...]:
    return self.batch + self.heads

  def axes_of(self, role: str | None) -> tuple[str, ...]:
    if role == BATCH:
      return self.batch
    if role == HEADS or (role == KV_HEADS and self.kv_heads_split):
      return self.heads
    return ()

  def spec(self, roles: Roles) -> P:
    return P(*(_entry(self.axes_of(r)) for r in roles))

  def sum_axes(self, sums: tuple[str, ...]) -> tuple[str, ...]:
    """Mesh axes over which a result is a partial sum: ``sums`` names the roles it was reduced
    over on each device (a broadcast bias's batch or heads, or MQA's query heads)."""
    axes = ()
    for role in sums:
      if role == KV_HEADS:  # shared key heads: query heads are split, key heads are not
        axes += () if self.kv_heads_split else self.heads
      else:
        axes += self.axes_of(role)
    return axes


@dataclasses.dataclass(frozen=True)
class Local:
  """A per-device computation and the layout of its operands and results.

  ``run(origin, *operands) -> tuple of results``, where ``origin`` is int32 [2], the batch row
  and query head of the device's first row and head in the whole call, or None for the whole
  call on one device. ``run`` is a frozen
  dataclass or another value-hashable callable: the primitive's jit cache keys on it.
  """

  run: Callable[..., tuple]
  in_roles: tuple[Roles, ...]
  out_roles: tuple[Roles, ...]
  out_sums: tuple[tuple[str, ...], ...]  # per result, see `Plan.sum_axes`
  out_like: tuple[int | None, ...]  # per result, the operand whose sharding it takes back
  query: int = 0  # the operand whose sharding decides the plan
  key: int = 1
  # Run as it is, never partitioned (see `Backend.interpreter_partitions`).
  direct: bool = False
  # The whole call as one cached `jax.jit` (see `whole`). Off for Mosaic GPU's interpreter: it
  # runs each warpgroup on a thread whose callbacks dispatch XLA programs of their own, and
  # queued behind one jitted forward+backward on a 2-core CPU those deadlocked.
  jitted: bool = True

  def plan(self, spec: P, shapes, sizes: dict[str, int]) -> Plan:
    """The plan from the query's partition spec: its batch and head axes where they divide."""
    q_roles, k_roles = self.in_roles[self.query], self.in_roles[self.key]
    def entry(role):
      i = q_roles.index(role)
      return _axes(spec[i] if i < len(spec) else None)
    batch, heads = entry(BATCH), entry(HEADS)
    heads = tuple(a for a in heads if a not in batch)
    q_shape, k_shape = shapes[self.query], shapes[self.key]
    b, n = q_shape[q_roles.index(BATCH)], q_shape[q_roles.index(HEADS)]
    k = k_shape[k_roles.index(KV_HEADS)]
    if b % _size(batch, sizes):
      _warn_whole("batch", b, batch, sizes)
      batch = ()
    d = _size(heads, sizes)
    if n % d or (k % d and k != 1):
      _warn_whole("heads", f"{n} query and {k} key/value", heads, sizes)
      heads = ()
    others = [e for i, e in enumerate(spec) if i < len(q_roles) and q_roles[i] is None and e]
    if others:
      warnings.warn(
          f"jaxflash: the query is sharded as {spec}, along its sequence or head dim; every "
          "device gathers it and computes the whole call there. To split a sequence over "
          "devices use jaxflash.ring_attention inside jax.shard_map.", stacklevel=2)
    return Plan(batch, heads, kv_heads_split=bool(heads) and k % d == 0)

  def whole(self, *operands) -> tuple:
    """The call as one device computes it: no share, so no origin for the dropout seed.

    It runs as one `jax.jit` per distinct ``run`` (`_compiled_once`): identical attention calls
    of a program (the layers of a model) then share one traced jaxpr, which JAX lowers once and
    calls at every site, so their kernels are lowered and compiled once, not once per layer
    (unless ``jitted`` is off: Mosaic GPU's interpreter)."""
    if not self.jitted:
      return tuple(self.run(None, *operands))
    return tuple(_compiled_once(self.run)(*operands))

  def run_shard(self, plan: Plan, operands) -> tuple:
    """The body each device runs on its share: its origin from its mesh coordinates, its call,
    and the psums that complete partial results."""
    q_roles, q_shape = self.in_roles[self.query], operands[self.query].shape
    origin = [jnp.int32(0), jnp.int32(0)]
    for i, (role, axes) in enumerate(((BATCH, plan.batch), (HEADS, plan.heads))):
      if axes:  # the device's index along the axes times its share's size
        origin[i] = jax.lax.axis_index(axes).astype(jnp.int32) * q_shape[q_roles.index(role)]
    results = self.run(jnp.stack(origin), *_varying(operands)[0])
    return tuple(jax.lax.psum(r, plan.sum_axes(s)) if plan.sum_axes(s) else r
                 for r, s in zip(results, self.out_sums))


@functools.lru_cache(maxsize=256)
def _compiled_once(run_: Callable[..., tuple]) -> Callable[..., tuple]:
  """``run_`` on the whole call (no origin) as a jitted function, one per distinct ``run_``
  (frozen dataclasses: equal calls give equal keys). JAX caches a jitted function's trace per
  argument types and reuses the lowering of a traced jaxpr within one program, which a plain
  Python call at each site would trace, lower and compile again (a Mosaic GPU kernel is named
  by a per-lowering counter, so even its compiled binary was not shared). (Left unnamed, as
  `jit(<unnamed function>)` in compile logs: a name with ``jaxflash_`` in it lands in every
  op's metadata, where the lowering tests and `benchmarks/dev/glue_audit.py` look for the
  kernels' names.)"""
  return jax.jit(functools.partial(run_, None))


def run(local: Local, operands: tuple) -> tuple:
  """``local`` on ``operands`` (a tuple of arrays), per device wherever they are sharded."""
  mesh = jax.sharding.get_abstract_mesh()
  types = () if mesh.empty else tuple(mesh.axis_types)
  if AxisType.Manual not in types:
    return _route(local, operands, mesh, types)
  # Inside shard_map: results vary like the operands even where a kernel's launcher (Mosaic
  # GPU's `plgpu.kernel`) or the route of the mesh's other axes (the primitive's abstract
  # evaluation, a shard_map without check_vma) drops the type: a VJP wants the cotangent's
  # type to be its output's.
  operands, axes = _varying(operands)
  if all(t == AxisType.Manual for t in types):  # this device's share is the call
    results = local.whole(*operands)
  else:  # a shard_map over some of the axes: the others split it further
    results = _route(local, operands, mesh, types)
  return tuple(_core.varying_like(r, axes) for r in results)


def _route(local: Local, operands: tuple, mesh, types: tuple) -> tuple:
  """``run`` over the mesh's Auto and Explicit axes."""
  if local.direct:
    if AxisType.Explicit in types:  # (the loops' carries would not match sharded tiles)
      return _run_replicated(local, operands)
    return local.whole(*operands)
  if AxisType.Explicit in types:
    return _run_explicit(local, operands, mesh)
  if jax.device_count() == 1:  # nothing can be sharded: no primitive, no second trace
    return local.whole(*operands)
  return tuple(_partitioned_p.bind(*operands, local=local))


def _run_explicit(local: Local, operands: tuple, mesh) -> tuple:
  explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
  spec = jax.typeof(operands[local.query]).sharding.spec
  spec = P(*(e if set(_axes(e)) <= explicit else None for e in spec))
  shapes = [x.shape for x in operands]
  plan = local.plan(spec, shapes, dict(mesh.shape))
  in_specs = tuple(plan.spec(r) for r in local.in_roles)
  originals = [jax.typeof(x).sharding.spec for x in operands]
  operands = tuple(_reshard(x, s) for x, s in zip(operands, in_specs))
  if plan.axes:
    results = jax.shard_map(functools.partial(_shard_body, local, plan), mesh=mesh,
                            in_specs=in_specs,
                            out_specs=tuple(plan.spec(r) for r in local.out_roles),
                            axis_names=frozenset(plan.axes), check_vma=False)(*operands)
  else:
    results = local.whole(*operands)
  # Each result goes back to the sharding of the operand it stands for (the output like the
  # query, dK like K, ...): a gradient's type must be its primal's.
  return tuple(r if i is None else _reshard(r, originals[i])
               for r, i in zip(results, local.out_like))


def _run_replicated(local: Local, operands: tuple) -> tuple:
  """A direct call under Explicit mesh axes: run whole on replicated operands (each device
  computes the whole call), results resharded like the operands they stand for. Only the XLA
  evaluation of a rule the kernels cannot run (a gather of both indices) goes this way."""
  originals = [jax.typeof(x).sharding.spec for x in operands]
  results = local.whole(*(_reshard(x, P()) for x in operands))
  return tuple(r if i is None else _reshard(r, originals[i])
               for r, i in zip(results, local.out_like))


def _shard_body(local: Local, plan: Plan, *operands):
  return local.run_shard(plan, operands)


# --- The primitive: jit with Auto axes (or none) ------------------------------------------------

_partitioned_p = jax.extend.core.Primitive("jaxflash_partitioned")
_partitioned_p.multiple_results = True


@_partitioned_p.def_impl
def _impl(*operands, local):
  # Eager calls compile once per `Local` and shapes (`Local` hashes by value), then hit jit's
  # cache: a repeated eager call does not trace its kernels again.
  return jax.jit(functools.partial(_partitioned_p.bind, local=local))(*operands)


@_partitioned_p.def_abstract_eval
def _abstract_eval(*avals, local):
  return [jax.core.ShapedArray(r.shape, r.dtype) for r in _traced(local, avals).out_avals]


def _traced(local: Local, avals) -> jax.extend.core.ClosedJaxpr:
  """The jaxpr of ``local.whole`` on operands of these types, behind jit's trace cache (keyed
  on ``local``, which hashes by value, and the types). The abstract evaluation and the lowering
  (`_partitioner`) both ask for it, so a call's kernels are traced once, not once for its
  result shapes and again for its lowering."""
  structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
  return _whole.trace(local, *structs).jaxpr


@functools.partial(jax.jit, static_argnums=0)
def _whole(local: Local, *operands) -> tuple:
  return local.whole(*operands)


def _batch_rule(operands, dims, *, local):
  """vmap: the mapped axis leads every operand and result; no device splits it."""
  operands = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(operands, dims)]
  in_axes = tuple(None if d is None else 0 for d in dims)
  lead = lambda roles, mapped: ((None,) + roles) if mapped else roles  # noqa: E731
  vmapped = dataclasses.replace(
      local, run=_Vmapped(local.run, in_axes),
      in_roles=tuple(lead(r, a is not None) for r, a in zip(local.in_roles, in_axes)),
      out_roles=tuple((None,) + r for r in local.out_roles))
  return _partitioned_p.bind(*operands, local=vmapped), [0] * len(local.out_roles)


batching.primitive_batchers[_partitioned_p] = _batch_rule


@dataclasses.dataclass(frozen=True)
class _Vmapped:
  run: Callable[..., tuple]
  in_axes: tuple[int | None, ...]

  def __call__(self, origin, *operands):
    return jax.vmap(lambda *xs: tuple(self.run(origin, *xs)), in_axes=self.in_axes)(*operands)


def _lower(*operands, local):
  return _partitioner(local, [jax.typeof(x) for x in operands])(*operands)


mlir.register_lowering(_partitioned_p, mlir.lower_fun(_lower, multiple_results=True))
# The lowering needs the call's devices (the partitioner runs on a mesh of them), as jax's own
# custom-partitioned primitives (cuDNN attention) declare; jax has no public spelling of this.
from jax._src import dispatch as _dispatch  # noqa: E402
_dispatch.prim_requires_devices_during_lowering.add(_partitioned_p)


def _partitioner(local: Local, avals):
  """The `custom_partitioning` op of one call: Shardy's rule names each dimension's factor, and
  `partition` turns the operands' shardings into the plan. Where the partitioner leaves the op
  whole it runs the jaxpr that the abstract evaluation traced (`_traced`), not a new trace."""
  traced = jax.extend.core.jaxpr_as_fun(_traced(local, avals))
  fn = custom_partitioning(lambda *operands: tuple(traced(*operands)))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    sharding = arg_shapes[local.query].sharding
    spec = sharding.spec if isinstance(sharding, NamedSharding) else P()
    shapes = [a.shape for a in arg_shapes]
    plan = local.plan(spec, shapes, dict(mesh.shape))
    arg_shardings = tuple(NamedSharding(mesh, plan.spec(r)) for r in local.in_roles)
    out_shardings = tuple(NamedSharding(mesh, plan.spec(r)) for r in local.out_roles)
    return mesh, functools.partial(_shard_body, local, plan), out_shardings, arg_shardings

  fn.def_partition(partition=partition, sharding_rule=_rule(local))
  return fn


def _rule(local: Local) -> str:
  """Shardy's einsum-like rule: batch and heads share a factor across operands; every other
  dimension has one of its own (the partition asks for it whole)."""
  names = iter(f"x{i}" for i in range(10_000))
  factor = {BATCH: "b", HEADS: "n", KV_HEADS: "k"}
  def one(roles):
    return " ".join(factor[r] if r in factor else next(names) for r in roles) or "..."
  return (", ".join(one(r) for r in local.in_roles) + " -> "
          + ", ".join(one(r) for r in local.out_roles))


# --- Helpers ------------------------------------------------------------------------------------

def _warn_whole(what: str, count, axes, sizes) -> None:
  warnings.warn(
      f"jaxflash: the query is sharded along its {what} ({count}) over mesh axes {axes}, "
      f"{_size(axes, sizes)} devices, which do not divide them (key/value heads must be "
      f"divided too, or be one); every device computes all of them, as if unsplit",
      stacklevel=3)


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _entry(axes: tuple[str, ...]):
  return None if not axes else axes[0] if len(axes) == 1 else axes


def _size(axes, sizes) -> int:
  return math.prod(sizes[a] for a in axes)


def _reshard(x, spec: P):
  return x if jax.typeof(x).sharding.spec == spec else jax.reshard(x, spec)


def _varying(operands) -> tuple[tuple, frozenset]:
  """The operands, each varying over every manual axis any of them varies over (a kernel's
  outputs and a loop's carries then have one type under `check_vma`), and those axes."""
  axes = frozenset().union(*(_core.varying_axes(x) for x in operands))
  return tuple(_core.varying_as(operands, *operands)), axes


# --- Attention's forward and backward as `Local`s ----------------------------------------------

def forward(backend, inputs: Inputs, params: Params, config) -> tuple[jax.Array, jax.Array]:
  """``backend.forward`` on each device's share of ``inputs``: ``(out, lse2)``."""
  names, operands, roles = _operands(inputs)
  q_roles = roles[0]
  local = Local(run=_Forward(backend, params, config, names), in_roles=roles,
                out_roles=(q_roles, (BATCH, HEADS, None)), out_sums=((), ()),
                out_like=(0, None), **_how_it_runs(backend, params))
  return run(local, operands)


def backward(backend, inputs: Inputs, params: Params, config, lse2, d_out, delta,
             want_dbias: bool):
  """``backend.backward`` on each device's share: ``(dq, dk, dv, dbias)``."""
  names, operands, roles = _operands(inputs)
  stats = (BATCH, HEADS, None)
  key, value = names.index("key"), names.index("value")
  out_roles = [roles[0], roles[key], roles[value]]
  out_sums = [(), (KV_HEADS,), (KV_HEADS,)]
  out_like = [0, key, value]
  if want_dbias:
    bias = names.index("bias")
    out_roles.append(roles[bias])
    out_sums.append(tuple(r for r, role in zip((BATCH, HEADS), roles[bias]) if role is None))
    out_like.append(bias)
  local = Local(run=_Backward(backend, params, config, names, want_dbias),
                in_roles=roles + (stats, roles[0], stats), out_roles=tuple(out_roles),
                out_sums=tuple(out_sums), out_like=tuple(out_like),
                **_how_it_runs(backend, params))
  grads = run(local, operands + (lse2, d_out, delta))
  return tuple(grads[:3]) + ((grads[3] if want_dbias else None),)


def paged_forward(backend, inputs: Inputs, pages, params: Params, config):
  """``backend.forward(inputs, params, config, pages)`` of a decoding call on a paged cache, on
  each device's share: ``(out, lse2)``.

  ``pages`` = (key pages, value pages [num_pages, page_size, K, H], page table [B,
  pages_per_row]). The page table's rows go with the query's batch rows, and the pages' K/V
  heads go with its heads. The page pool is otherwise whole on every device, because any row
  may use any page. ``inputs.key`` and ``inputs.value`` (the rows the pages make) are not
  operands: the kernel reads only their shapes, so nothing computes them."""
  names, operands, roles = _operands(inputs._replace(key=None, value=None))
  page_roles = (None, None, KV_HEADS, None)
  run_ = _PagedForward(backend, params, config, names, inputs.key.shape[1], inputs.key.dtype)
  local = Local(run=run_, in_roles=roles + (page_roles, page_roles, (BATCH, None)),
                out_roles=(roles[0], (BATCH, HEADS, None)), out_sums=((), ()),
                out_like=(0, None), key=len(names), **_how_it_runs(backend, params))
  return run(local, operands + tuple(pages))


def _how_it_runs(backend, params: Params) -> dict:
  """`Local`'s ``direct`` and ``jitted`` for a call of ``backend``.

  An interpreter that cannot run per device takes the whole call, unjitted (see
  `Local.jitted`). A mask_mod that only the XLA backend runs reads the arrays it closes over
  with the batch and head indices of the whole call: its (plain JAX) call is left to XLA's
  partitioner."""
  interpreted_whole = params.interpret and not backend.interpreter_partitions
  return dict(direct=interpreted_whole or params.kernel_mask_reason is not None,
              jitted=not interpreted_whole)


def _operands(inputs: Inputs):
  """The present arrays of ``inputs``: their field names, the arrays, and their roles."""
  b, _, n, _ = inputs.query.shape
  seq_4d = (BATCH, None, HEADS, None)
  fixed = {"query": seq_4d, "key": (BATCH, None, KV_HEADS, None),
           "value": (BATCH, None, KV_HEADS, None), "lengths": (BATCH, None),
           "offsets": (BATCH, None), "q_segment_ids": (BATCH, None),
           "kv_segment_ids": (BATCH, None), "dropout_seed": (None,), "sinks": (HEADS,),
           "q_descale": (BATCH, None, HEADS), "k_descale": (BATCH, None, KV_HEADS),
           "v_descale": (BATCH, None, KV_HEADS), "kv_lengths": (BATCH,)}
  names, operands, roles = [], [], []
  for name in Inputs._fields:
    x = getattr(inputs, name)
    if x is None:
      continue
    if name in _CONSTS:  # arrays a mask_mod or score_mod reads: whole on every device
      for i, c in enumerate(x):
        names.append(f"{name}.{i}")
        operands.append(c)
        roles.append((None,) * jnp.ndim(c))
      continue
    if name in ("bias", "mask", "mask_words", "mask_words_t", "block_table"):
      # [B or 1, N or 1, ...]: broadcast axes are never split
      role = (BATCH if x.shape[0] == b else None, HEADS if x.shape[1] == n else None, None, None)
    elif name in _FEATURES:  # [F, B or 1, N or 1, T or S]
      role = (None, BATCH if x.shape[1] == b else None, HEADS if x.shape[2] == n else None, None)
    else:
      role = fixed[name]
    names.append(name)
    operands.append(x)
    roles.append(role)
  return tuple(names), tuple(operands), tuple(roles)


# Tuples of arrays, one operand each, whole on every device.
_CONSTS = ("mask_consts", "score_consts", "score_tables")
_FEATURES = ("q_features", "kv_features", "score_q_features", "score_kv_features",
             "score_kv_scalars", "score_bands")


def _inputs(names, arrays, origin, **absent) -> Inputs:
  """`Inputs` from a device's arrays (and ``absent`` fields, e.g. ``key=None``); the dropout
  seed learns the share's origin (None: the whole call, whose seed stays two words)."""
  fields = {n: x for n, x in zip(names, arrays) if n.split(".")[0] not in _CONSTS}
  for field in _CONSTS:
    consts = tuple(x for n, x in zip(names, arrays) if n.split(".")[0] == field)
    fields[field] = consts or None
  inputs = Inputs(**absent, **fields)
  if inputs.dropout_seed is not None and origin is not None:
    seed = jnp.concatenate([inputs.dropout_seed[:2], origin.astype(jnp.uint32)])
    inputs = inputs._replace(dropout_seed=seed)
  return inputs


@dataclasses.dataclass(frozen=True)
class _Forward:
  backend: object
  params: Params
  config: object
  names: tuple[str, ...]

  def __call__(self, origin, *arrays):
    return tuple(self.backend.forward(_inputs(self.names, arrays, origin), self.params,
                                      self.config))


@dataclasses.dataclass(frozen=True)
class _PagedForward(_Forward):
  seq: int  # the rows' length: pages_per_row * page_size
  dtype: object

  def __call__(self, origin, *arrays):
    *arrays, key_pages, value_pages, table = arrays
    inputs = _inputs(self.names, arrays, origin, key=None, value=None)
    # The rows' shapes for the kernel: broadcast scalars, never materialised (K and V each
    # with their own head dim).
    key, value = (jnp.broadcast_to(jnp.zeros((), self.dtype), (inputs.query.shape[0], self.seq)
                                   + pages.shape[2:]) for pages in (key_pages, value_pages))
    inputs = inputs._replace(key=key, value=value)
    return tuple(self.backend.forward(inputs, self.params, self.config,
                                      (key_pages, value_pages, table)))


@dataclasses.dataclass(frozen=True)
class _Backward(_Forward):
  want_dbias: bool

  def __call__(self, origin, *arrays):
    *arrays, lse2, d_out, delta = arrays
    inputs = _inputs(self.names, arrays, origin)
    if self.params.query_padding:
      inputs, d_out, delta = _core.padding_rows_zeroed(inputs, d_out, delta)
    dq, dk, dv, dbias = self.backend.backward(inputs, self.params, self.config, lse2, d_out,
                                              delta, self.want_dbias)
    return (dq, dk, dv) + ((dbias,) if self.want_dbias else ())
