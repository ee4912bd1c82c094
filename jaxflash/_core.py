"""What every backend and op shares: the normalised inputs, the static parameters, and the
per-tile logit math.

A backend (see `jaxflash.backends`) supplies two functions over these types:

- ``forward(inputs, params, config) -> (out, lse2)``: ``out`` [B, T, N, Dv] in the query dtype
  (float32 when ``params.partial``) and ``lse2`` float32 [B, N, T], the logsumexp of the *base-2*
  logits (``log2(e) * logits``), set to ``+inf`` on rows that see no key. ``+inf`` makes
  ``exp2(s - lse2)`` exactly 0 on such rows, so the backward needs no special case for them;
  users see ``-inf`` (see `user_lse`).
- ``backward(inputs, params, config, lse2, d_out, delta, want_dbias) -> (dq, dk, dv, dbias)``
  where ``delta`` = rowsum(dO * O) - d_lse, float32 [B, N, T]: the residuals are only the inputs
  and the LSE; S and P are recomputed block by block. ``lse2`` and ``delta`` need not come from
  this call's own forward: an op that split the keys over several calls passes the merged
  (global) ones, and each call then returns its keys' share of the gradients. ``dbias`` (shaped
  like ``inputs.bias``) is computed only when ``want_dbias``; otherwise it is None and costs
  nothing. With ``params.partial`` the gradients come back in float32, ready to be summed.

Dropout (``params.dropout_rate > 0``) drops entries of the normalised P and scales the kept ones
by ``params.keep_scale`` = 1 / P(keep) ~ 1 / (1 - rate); every backend regenerates the keep mask
from ``inputs.dropout_seed`` and each entry's absolute coordinates with `jaxflash.dropout`. The
LSE is that of the undropped softmax, and ``delta`` = rowsum(dO * O) stays exact: rowsum(dP * P)
over the dropped P equals dO . O for the dropped O.

`Inputs` bundles the arrays; everything static lives in `Params`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxflash import dropout
from jaxflash import mask_mod
from jaxflash import masking
# (Re-exported: ops and backends use them from here.)
from jaxflash._vma import summed_like, varying_as, varying_axes, varying_like  # noqa: F401

LOG2_E = math.log2(math.e)


class Inputs(NamedTuple):
  """Normalised arrays of one attention call (a pytree; optional ones may be None)."""

  query: jax.Array  # [B, T, N, H]
  key: jax.Array  # [B, S, K, H]
  value: jax.Array  # [B, S, K, Dv]: Dv may differ from H (the output then has Dv)
  lengths: jax.Array  # int32 [B, 2]: (q_len, kv_len) per batch row, clipped to [0, T] / [0, S]
  # int32 [B, 2]: (q_offset, kv_offset), the absolute positions of query row 0 and key 0 of each
  # batch row (see `jaxflash.masking`); None means zeros and costs nothing.
  offsets: jax.Array | None = None
  bias: jax.Array | None = None  # [B or 1, N or 1, T, S] float
  mask: jax.Array | None = None  # [B or 1, N or 1, T, S] bool (or nonzero = visible)
  # The same mask packed 32 entries to an int32 word along the keys and along the queries
  # (`jaxflash.dense_mask`): [B or 1, N or 1, ceil(S / 32), T] and [B or 1, N or 1,
  # ceil(T / 32), S]. What the Mosaic kernels read; None where only ``mask`` is given (they
  # pack it then).
  mask_words: jax.Array | None = None
  mask_words_t: jax.Array | None = None
  q_segment_ids: jax.Array | None = None  # int32 [B, T]
  kv_segment_ids: jax.Array | None = None  # int32 [B, S]
  dropout_seed: jax.Array | None = None  # uint32 [2], present iff params.dropout_rate > 0
  # int8 [B or 1, N or 1, query blocks, key blocks] of `params.table_block` blocks: which blocks
  # a mask_mod, a dense mask or segment ids leave empty, partial or full (`jaxflash.block_mask`).
  block_table: jax.Array | None = None
  # A mask_mod's row and column features, int32 [F, B or 1, N or 1, T] and [F', ..., S]
  # (`jaxflash.mask_mod`), for `params.mask_rule`'s tile rule.
  q_features: jax.Array | None = None
  kv_features: jax.Array | None = None
  # The arrays a mask_mod that the kernels cannot run closes over (its XLA evaluation).
  mask_consts: tuple | None = None
  # float32 [N]: one learnable logit per query head that joins every row's softmax
  # denominator (attention sinks), in the units of the scaled logits. Only a whole call's
  # forward applies it (`finish_rows`); a partial call never sees it (its op adds the sink
  # after merging, `jaxflash.merge.with_sinks`), and a backward needs only the LSE it went into.
  sinks: jax.Array | None = None
  # A score_mod's row and column features (as ``q_features``/``kv_features`` are a mask_mod's),
  # for `params.score_rule`'s tile rule, and the arrays it closes over (its jaxpr's consts: what
  # the XLA backend evaluates a rule the kernels cannot from, and what gets gradients,
  # `jaxflash.backends.xla.backward.score_const_gradients`).
  score_q_features: jax.Array | None = None
  score_kv_features: jax.Array | None = None
  # int32 [F, B or 1, N or 1, 1]: the values of the batch row and head alone from which a
  # kernel may compute column features instead of loading them (`Split.computed_cols`).
  score_kv_scalars: jax.Array | None = None
  score_consts: tuple | None = None
  # The arrays a score_mod's lookups read (`jaxflash.mask_mod.Split.tables`), flattened: whole
  # on every device, gathered from by the Triton kernels and the XLA backend.
  score_tables: tuple | None = None
  # Where every lookup reads its array through ``q_idx - kv_idx`` alone (a relative-position
  # table: `Split.diagonal_lookups`), their values on every diagonal, int32 [F, B or 1, N or 1,
  # T + S] (`Split.band_values`): the Mosaic kernels, which cannot gather, read tiles of them.
  score_bands: jax.Array | None = None
  # An FP8 call's descale factors (`jaxflash.fp8`), float32: real values are
  # ``float(x8) * descale``. [B, T or 1, N], [B, S or 1, K] (per token and head, or per batch
  # row and head) and [B, 1, K]; None is a factor of 1 (and what every other call has).
  q_descale: jax.Array | None = None
  k_descale: jax.Array | None = None
  v_descale: jax.Array | None = None
  # int32 [B]: a decoding call's key lengths as the caller gave them, neither clipped nor
  # stacked (``lengths`` and ``offsets`` hold the same positions, made from them by XLA). The
  # Mosaic GPU decoding kernel of the latent cache reads these and clips them itself, so that
  # no XLA op runs before it (`jaxflash.backends.mosaic.decode`). None on every other call.
  kv_lengths: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Params:
  """Static description of the attention function (hashable: used as a jit/vjp static arg)."""

  scale: float
  window: masking.Window
  logits_soft_cap: float | None = None
  dropout_rate: float = 0.0
  broadcast_dropout: bool = False  # one [T, S] dropout mask for all batch rows and heads
  interpret: bool = False
  # Return a partial result: the output in float32, normalised over this call's keys only, to be
  # merged with others through the LSE (`jaxflash.ops.partial`); gradients in float32 too.
  partial: bool = False
  # (query, key) block sizes of `Inputs.block_table`, or None without one.
  table_block: tuple[int, int] | None = None
  # The mask_mod of a block mask (`jaxflash.mask_mod.Split`), evaluated in partial blocks.
  mask_rule: object = None
  # The score_mod (`jaxflash.mask_mod.split_score`), applied to every visible logit.
  score_rule: object = None
  # The output dtype's name of an FP8 call (its inputs are float8); None: the query's dtype.
  out_dtype: str | None = None
  # Whether the gradients must be bitwise repeatable; False lets a backend add dQ in any
  # order (float32 atomics), where that measured faster.
  deterministic: bool = True
  # A decoding call whose values are the first Dv features of its keys (absorbed MLA's latent
  # cache, `jaxflash.decode_attention` with ``value_cache=None``): ``Inputs.value`` is that
  # slice of the keys, and a kernel may read the values from its key tiles instead.
  values_in_keys: bool = False
  # The call has query lengths (``query_seq_lengths``): rows past them are padding, whose inputs
  # the backward zeroes first (`padding_rows_zeroed`).
  query_padding: bool = False

  @property
  def kernel_mask_reason(self) -> str | None:
    """Why the Pallas kernels cannot evaluate this call's mask_mod or score_mod per tile, or
    None."""
    for rule in (self.mask_rule, self.score_rule):
      if rule is not None and rule.kernel_reason is not None:
        return rule.kernel_reason
    return None

  def output_dtype(self, inputs: Inputs):
    """The dtype of a whole call's output: the query's, or an FP8 call's ``out_dtype``."""
    return jnp.dtype(self.out_dtype) if self.out_dtype is not None else inputs.query.dtype

  @property
  def keep_scale(self) -> float:
    """Factor applied to kept probabilities under dropout: 1 / P(keep), so E[output] is exact."""
    return 1.0 / dropout.keep_probability(self.dropout_rate)


def finish_rows(m: jax.Array, l: jax.Array, seen: jax.Array, sink2=None, term2=None):
  """``(factor, lse2)`` that end a row's online softmax: the output row is ``acc * factor``.

  ``m`` is the row's running max and ``l`` its sum of ``exp2(s2 - m)`` (base-2 logits), and
  ``seen`` says whether it saw any visible key (empty rows get an LSE of +inf; the caller
  zeroes their output, whose ``factor`` is finite there).
  ``sink2`` is the row's attention sink in base-2 units, or None: the sink is one more logit in
  the denominator whose value row is zero, so the row becomes ``acc * 2^(m - top) / total`` with
  ``top = max(m, sink2)`` and ``total = l * 2^(m - top) + 2^(sink2 - top)`` (shifted by the
  larger of the two, so neither overflows). A row that sees no key stays empty: it has no
  output, and an LSE of +inf keeps its P at zero in the backward. Plain jnp on row vectors (or
  a scalar ``sink2``): every kernel's epilogue calls it.
  ``term2`` is the row's score_mod row term in base-2 units, or None: a value the kernel left
  out of every logit of the row (`jaxflash.mask_mod.Split.row_term`), so ``m``, ``l`` (and the
  sink, relative to them) are those of the logits without it and the LSE gets it back. A term
  of -inf made every logit -inf (the row is empty: factor 0, LSE +inf); NaN or +inf makes the
  row NaN, as those logits would have.
  """
  if term2 is not None and sink2 is not None:
    sink2 = sink2 - term2
  if sink2 is None:
    l_safe = jnp.where(seen, l, 1.0)
    factor, lse2 = 1.0 / l_safe, jnp.where(seen, m + jnp.log2(l_safe), jnp.inf)
  else:
    top = jnp.maximum(m, sink2)
    shift = jnp.exp2(jnp.where(seen, m - top, 0.0))
    total = jnp.where(seen, l * shift + jnp.exp2(sink2 - top), 1.0)
    factor, lse2 = shift / total, jnp.where(seen, top + jnp.log2(total), jnp.inf)
  if term2 is None:
    return factor, lse2
  gone = term2 == -jnp.inf
  nan = term2 - term2  # 0, or NaN where the term is NaN or +inf
  factor = jnp.where(gone, 0.0, factor + nan)
  return factor, jnp.where(jnp.logical_or(gone, lse2 == jnp.inf), jnp.inf, lse2 + term2 + nan)


def without_row_term(inputs: Inputs, params: Params):
  """``(inputs, params, term2)`` of kernels that add a score_mod's row term to the LSE instead
  of to every logit (`jaxflash.mask_mod.Split.row_term`: ALiBi's ``-slope[h] * q_idx``, whose
  load and add per block would cost the forward and the backward): the call with the rule
  without it and that rule's row features, and the term in base-2 units, float32 [B or 1,
  N or 1, T], for `finish_rows` and `lse_without_row_term`. Without a row term the call comes
  back unchanged, with ``term2`` None."""
  rule = params.score_rule
  rest = None if rule is None else rule.without_row_term
  if rest is None:
    return inputs, params, None
  features = inputs.score_q_features
  term = mask_mod.from_int32(features[rule.row_vars.index(rule.row_term)], jnp.float32)
  kept = [rule.row_vars.index(v) for v in rest.row_vars]
  inputs = inputs._replace(score_q_features=features[jnp.asarray(kept)] if kept else None)
  return inputs, dataclasses.replace(params, score_rule=rest), term * LOG2_E


def lse_without_row_term(lse2: jax.Array, term2) -> jax.Array:
  """The LSE [B, N, T] of the logits without the row term ``term2`` (`without_row_term`; None:
  ``lse2`` itself), for a backward that recomputes P without it. Empty rows keep +inf."""
  if term2 is None:
    return lse2
  return jnp.where(lse2 == jnp.inf, jnp.inf, lse2 - term2)


def sink_gradient(sinks: jax.Array, lse2: jax.Array, delta: jax.Array) -> jax.Array:
  """d loss / d sinks, float32 [N], from the final base-2 LSE [B, N, T] (sinks included) and
  ``delta`` = rowsum(dO * O) - d_lse [B, N, T].

  A sink is a logit whose value row is zero, so its dP is 0 and its dS is ``-P_sink * delta``
  with ``P_sink = 2^(sink2 - lse2)`` (0 on empty rows, whose LSE is +inf). Summed over batch
  rows and queries by one reduction: the same order on every run (deterministic).
  """
  p_sink = jnp.exp2(sinks.astype(jnp.float32)[None, :, None] * LOG2_E - lse2)
  return -jnp.sum(p_sink * delta, axis=(0, 2))


def user_lse(lse2: jax.Array) -> jax.Array:
  """Internal base-2 LSE (+inf on empty rows) -> natural-log LSE (-inf on empty rows)."""
  return jnp.where(lse2 == jnp.inf, -jnp.inf, lse2 * (1.0 / LOG2_E))


def base2_lse(lse: jax.Array) -> jax.Array:
  """The inverse of `user_lse`: natural-log LSE (-inf on empty rows) -> internal base-2 LSE."""
  return jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2_E)


def padding_rows_zeroed(inputs: Inputs, d_out: jax.Array, delta: jax.Array):
  """``(inputs, d_out, delta)`` with the query rows past ``q_len`` zero in all three (one
  device's arrays, before a backward).

  Such a row sees no key: its LSE is +inf, so its P = exp2(s - lse) is 0 in every kernel. But a
  NaN or Inf of the caller's in its query makes s NaN, P NaN, and 0 · NaN in dK = dSᵀQ and
  dV = PᵀdO reaches every key of the batch row (jax.nn's masking keeps dQ and dV finite there).
  Its gradients are zeros either way."""
  valid = jnp.arange(inputs.query.shape[1])[None, :] < inputs.lengths[:, :1]  # [B, T]
  rows = valid[:, :, None, None]
  query = jnp.where(rows, inputs.query, jnp.zeros((), inputs.query.dtype))
  d_out = jnp.where(rows, d_out, jnp.zeros((), d_out.dtype))
  delta = jnp.where(valid[:, None, :], delta, jnp.zeros((), delta.dtype))
  return inputs._replace(query=query), d_out, delta


def delta(out: jax.Array, d_out: jax.Array, d_lse) -> jax.Array:
  """rowsum(dO * O) - d_lse, float32 [B, N, T]: the softmax Jacobian's correction term.

  A cotangent on the LSE adds P * d_lse to dS, the same as subtracting d_lse from delta.
  ``d_lse`` may be a `SymbolicZero` (nothing differentiates the LSE).
  """
  result = jnp.einsum("btnh,btnh->bnt", d_out.astype(jnp.float32), out.astype(jnp.float32))
  if isinstance(d_lse, jax.custom_derivatives.SymbolicZero):
    return result
  return result - jnp.where(jnp.isfinite(d_lse), d_lse, 0.0)


def capped_exponent(z: jax.Array, capped: bool, by_select: bool = False) -> jax.Array:
  """``z``, an exp2 argument that is <= 0 in exact arithmetic (base-2 logits less their row max,
  or less their LSE in a backward), capped at 0 when ``capped`` (static).

  A bias or a score_mod can make logits huge and finite: ``(1 - mask) * -1e10`` hides keys with
  -1e10, not -inf. A compiler may then fuse the logits' last multiply into z's subtraction
  (one FMA, which NVPTX emits by default) or compute them twice, rounding apart, and z
  becomes the rounding error of a number near 1.4e10: up to 512, where 2**z overflows float32
  and the row turns NaN. Capped, such a row gets a finite (if meaningless, as jax.nn's is at
  that size) softmax. Without a bias or a score_mod the logits are ``scale * q.k`` and such
  errors need |logits| > 2**31, so the kernels leave that path alone.

  NaN stays NaN: `jnp.minimum` propagates it in XLA and in Mosaic GPU (``min.NaN.f32``);
  Triton lowers it to ``minnum``, which would turn NaN into 0, so Triton asks for a select
  (``by_select``).
  """
  if not capped:
    return z
  if by_select:
    return jnp.where(z > 0.0, 0.0, z)
  return jnp.minimum(z, 0.0)


def logits_base2(qk: jax.Array, params: Params, bias: jax.Array | None, score=None,
                 derivative: bool = False):
  """Raw ``q @ k.T`` tile (float32) -> base-2 logits, and the chain factor of the backward.

  Natural logits are ``z = score_mod(cap * tanh(scale * qk / cap)) + bias`` (cap, score_mod and
  bias optional); the kernels work with ``z * log2(e)`` so the softmax uses ``exp2``. ``score``
  is the tile's score_mod, ``score(z) -> z'`` on this tile (None without one). Returns
  ``(s2, chain)``: ``chain`` is d z / d (scale * qk) per entry where it is not 1 (the cap's
  ``1 - tanh^2``, times the score_mod's derivative, which `jax.jvp` takes only when
  ``derivative``: a backward's call), else None; `dlogits_to_dqk` applies it. (A forward
  discards ``chain``, and the compiler drops what computes it.)
  """
  if params.logits_soft_cap is None and bias is None and score is None:
    return qk * (params.scale * LOG2_E), None  # one multiply on the common path
  z, chain = logits(qk, params, bias, score, derivative)
  return z * LOG2_E, chain


def logits(qk: jax.Array, params: Params, bias: jax.Array | None, score=None,
           derivative: bool = False):
  """`logits_base2`'s natural logits ``z`` (not times log2(e)) and chain factor: for a forward
  that takes the row max of ``z`` and folds log2(e) into exp2's argument, one fused multiply-
  add with the row's shift, instead of scaling every entry first."""
  z = qk * params.scale
  chain = None
  if params.logits_soft_cap is not None:
    t = jnp.tanh(z * (1.0 / params.logits_soft_cap))
    z = t * params.logits_soft_cap
    chain = 1.0 - t * t
  if score is not None:
    if derivative:
      z, slope = jax.jvp(score, (z,), (jnp.ones_like(z),))
      chain = slope if chain is None else chain * slope
    else:
      z = score(z)
  if bias is not None:
    z = z + bias.astype(jnp.float32)
  return z, chain


def dropout_stream(params: Params, seed, batch, head):
  """Dropout stream key of (batch, head); shared by all of them under ``broadcast_dropout``.

  ``seed`` is uint32 [2], or [4] for a device's share of a sharded call: words 2 and 3 are then
  the batch row and head its first row and head have in the whole call, so every device drops
  what the unsharded call drops (`jaxflash.ops.partitioning`).
  """
  if params.broadcast_dropout:
    batch = head = 0
  elif seed.shape[0] > 2:
    batch = dropout.as_u32(batch) + seed[2]
    head = dropout.as_u32(head) + seed[3]
  return dropout.stream_key(seed[0], seed[1], batch, head)


def explicit_spec(x) -> tuple | None:
  """``x``'s partition spec, one entry per dim, where Explicit mesh axes shard it; else None
  (no mesh, Auto axes, or replicated): ops whose sharding rule must be spelled out then."""
  aval = jax.typeof(x)  # (x may be a Python scalar a score_mod closed over: no .ndim)
  sharding = aval.sharding
  explicit = any(t == jax.sharding.AxisType.Explicit
                 for t in getattr(sharding.mesh, "axis_types", ()))
  spec = tuple(sharding.spec) + (None,) * (len(aval.shape) - len(sharding.spec))
  return spec if explicit and any(e is not None for e in spec) else None



def resharded_like(x, like):
  """``x`` with ``like``'s sharding where Explicit mesh axes give the two different ones (a
  VJP's cotangent must have its primal's; `jnp.stack` asks its operands for one), else ``x``.
  Nothing where ``like`` has no mesh (an uncommitted array): there is none to reshard to."""
  sharding = jax.typeof(like).sharding
  if sharding.mesh.empty or explicit_spec(x) == explicit_spec(like):
    return x
  return jax.reshard(x, sharding)


def replicated(x):
  """``x`` whole on every device where Explicit mesh axes shard it, else ``x``: what a traced
  function indexes with index grids of its own (a mask_mod's or score_mod's captured arrays,
  which Explicit sharding would ask to gather with an out_sharding)."""
  return x if explicit_spec(x) is None else jax.reshard(x, jax.sharding.PartitionSpec())


def out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
  """A kernel output's shape and dtype, varying over the manual mesh axes ``like`` varies over
  (what `pallas_call` asks of its outputs inside `jax.shard_map` with ``check_vma``)."""
  mat = getattr(jax.typeof(like), "mat", None)
  return jax.ShapeDtypeStruct(tuple(shape), dtype, manual_axis_type=mat)


def dropped(x: jax.Array, keep_mask: jax.Array | None, params: Params) -> jax.Array:
  """A P- or dP-shaped tile after dropout: ``x * keep / P(keep)`` (``x`` if no dropout)."""
  if keep_mask is None:
    return x
  return jnp.where(keep_mask, x * params.keep_scale, 0.0)


def dlogits_to_dqk(ds: jax.Array, chain: jax.Array | None) -> jax.Array:
  """Chain rule from the logits back to ``scale * q @ k.T`` through the soft cap
  (d(cap * tanh(x / cap)) / dx = 1 - tanh^2) and the score_mod: ``chain`` from `logits_base2`.

  The remaining factor ``scale`` is applied once to the accumulated dQ and dK, not per tile.
  """
  return ds if chain is None else ds * chain
