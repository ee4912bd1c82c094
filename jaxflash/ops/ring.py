"""Ring attention: a sequence split over the devices of a mesh axis (context parallelism).

Inside `jax.shard_map`, each device of the axis holds a chunk of the queries and of the keys and
values of one long sequence. The K/V chunks travel around the ring with `ppermute`; at each of
the R steps every device computes the partial result (output and LSE over the keys it holds
now) of its own queries, and the partials are merged exactly through the LSE
(`jaxflash.merge.merge`). The backward runs the ring again with the *global* LSE and delta
(see `jaxflash._core`): dQ stays home, and dK/dV accumulators travel with their K/V chunk and
are sent home by one last `ppermute`. Nothing of size T x S is stored, on any device.

Positions come from the chunks' offsets (`Inputs.offsets`), so the causal band, windows, a
mask_mod and the dropout mask see every token at its place in the whole sequence, and segment
ids travel with their keys. Each (query part, key part) pair gets its own block table and
mask_mod features (`_with_pair_masks`). ``Inputs.lengths`` hold the whole sequence's (query,
key) lengths here; each pair gets the valid rows of its own parts. Layouts:

- ``"contiguous"``: device ``i`` of R holds tokens ``[i * C, (i + 1) * C)``.
- ``"striped"``: device ``i`` holds tokens ``i, i + R, i + 2R, ...`` (MaxText's ``STRIPED``):
  under a causal band every step is one call whose band is the chunk's own diagonal, or the
  one below it, so every device has the same work in one launch per step. `to_striped` and
  `from_striped` reorder a whole sequence. Positions then do not follow from an offset, so
  this layout takes no window and no dropout.
- ``"zigzag"``: the sequence is cut into 2R chunks and device ``i`` holds chunks ``i`` and
  ``2R - 1 - i``, so that under a causal mask every device has the same work (MaxText's
  ``DUAL_CHUNK_SWAP``). `to_zigzag` and `from_zigzag` reorder a whole sequence into and out of
  it. Each step then computes the pairs of (query half, key half) that the band leaves
  visible: three at the first step and two at the others under a causal band, all four
  without one (`_step_pairs`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash import _core
from jaxflash import block_mask as block_mask_lib
from jaxflash import fp8
from jaxflash import mask_mod as mask_mod_lib
from jaxflash._core import Inputs, Params
from jaxflash.ops import flash
from jaxflash.ops import partial

LAYOUTS = ("contiguous", "zigzag", "striped")


def chunk_starts(layout: str, ring: int, device, chunk: int) -> list:
  """Start positions (in the whole sequence) of the parts of the chunk ``device`` holds: one
  part of ``chunk`` tokens, or two halves for the zigzag layout."""
  if layout == "contiguous":
    return [device * chunk]
  half = chunk // 2
  return [device * half, (2 * ring - 1 - device) * half]


def striped_order(seq_len: int, ring: int) -> jax.Array:
  """Token indices such that ``x[:, order]`` split into ``ring`` contiguous chunks gives device
  ``i`` the tokens ``i, i + ring, i + 2 * ring, ...`` (``seq_len`` divisible by ``ring``)."""
  if seq_len % ring:
    raise ValueError(f"seq_len must be divisible by ring = {ring}, got {seq_len}")
  return jnp.arange(seq_len).reshape(seq_len // ring, ring).T.reshape(-1)


def to_striped(x: jax.Array, ring: int, axis: int = 1) -> jax.Array:
  """Reorders the sequence axis of ``x`` into the striped layout (see `striped_order`)."""
  return _reorder(x, striped_order(x.shape[axis], ring), axis)


def from_striped(x: jax.Array, ring: int, axis: int = 1) -> jax.Array:
  """The inverse of `to_striped`."""
  return _reorder(x, jnp.argsort(striped_order(x.shape[axis], ring)), axis)


def layout_order(seq_len: int, layout: str, ring: int) -> jax.Array:
  """Token indices such that ``x[:, order]`` split into ``ring`` contiguous chunks gives each
  device its chunk in ``layout``."""
  if layout == "contiguous":
    return jnp.arange(seq_len)
  return {"zigzag": zigzag_order, "striped": striped_order}[layout](seq_len, ring)


def to_layout(x: jax.Array, layout: str, ring: int, axis: int = 1) -> jax.Array:
  """Reorders the sequence axis of ``x`` into ``layout`` (contiguous: unchanged)."""
  if layout == "contiguous":
    return x
  return _reorder(x, layout_order(x.shape[axis], layout, ring), axis)


def from_layout(x: jax.Array, layout: str, ring: int, axis: int = 1) -> jax.Array:
  """The inverse of `to_layout`."""
  if layout == "contiguous":
    return x
  return _reorder(x, jnp.argsort(layout_order(x.shape[axis], layout, ring)), axis)


def zigzag_order(seq_len: int, ring: int) -> jax.Array:
  """Token indices such that ``x[:, order]`` split into ``ring`` contiguous chunks gives each
  device its zigzag chunks (``seq_len`` divisible by ``2 * ring``)."""
  if seq_len % (2 * ring):
    raise ValueError(f"seq_len must be divisible by 2 * ring = {2 * ring}, got {seq_len}")
  half = seq_len // (2 * ring)
  parts = []
  for i in range(ring):
    parts += [jnp.arange(i * half, (i + 1) * half),
              jnp.arange((2 * ring - 1 - i) * half, (2 * ring - i) * half)]
  return jnp.concatenate(parts)


def to_zigzag(x: jax.Array, ring: int, axis: int = 1) -> jax.Array:
  """Reorders the sequence axis of ``x`` into the zigzag layout (see `zigzag_order`)."""
  return _reorder(x, zigzag_order(x.shape[axis], ring), axis)


def from_zigzag(x: jax.Array, ring: int, axis: int = 1) -> jax.Array:
  """The inverse of `to_zigzag`."""
  return _reorder(x, jnp.argsort(zigzag_order(x.shape[axis], ring)), axis)


def _reorder(x, order, axis: int):
  """``x`` with its ``axis`` permuted. An axis that an Explicit mesh shards is gathered for the
  permutation and sharded again after it (a gather along a sharded axis has no sharding rule);
  reorder token ids before embedding them, where that costs nothing."""
  spec = _core.explicit_spec(x)
  if spec is None or spec[axis] is None:
    return jnp.take(x, order, axis=axis)
  named = lambda *entries: jax.sharding.NamedSharding(  # noqa: E731
      jax.typeof(x).sharding.mesh, jax.sharding.PartitionSpec(*entries))
  x = jax.reshard(x, named(*spec[:axis], None, *spec[axis + 1:]))
  return jax.reshard(jnp.take(x, order, axis=axis), named(*spec))


def validate(layout: str, params: Params, chunk: int) -> None:
  """Raises ValueError where ``layout`` cannot give the whole sequence's result."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  if layout == "zigzag" and chunk % 2:
    raise ValueError(f"layout='zigzag' needs an even chunk length, got {chunk}")
  if layout == "striped":
    window = params.window
    if not (window.is_full or (window.left is None and window.right == 0)):
      raise ValueError("layout='striped' takes no local_window_size (a device's tokens are "
                       "R apart, so a window is not a band of its chunk): use 'zigzag'")
    if params.dropout_rate > 0:
      raise ValueError("layout='striped' takes no dropout_rate (the dropout mask is drawn at "
                       "positions a striped chunk cannot give the kernels): use 'zigzag'")


def with_mask_mod(inputs: Inputs, params: Params, mask_mod,
                  layout: str) -> tuple[Inputs, Params]:
  """A ring call's inputs and params with its ``mask_mod`` split (its tile rule runs on
  absolute positions; each pair makes its own table and features, `_with_pair_masks`), and
  the arrays it closes over where only the XLA backend can evaluate it.

  Raises:
    ValueError: a ``mask_mod`` that is not a boolean function of four indices, or the striped
      layout.
  """
  if layout == "striped":
    raise ValueError("layout='striped' takes no mask_mod (a device's tokens are R apart, not "
                     "a range of positions): use 'contiguous' or 'zigzag'")
  rule = mask_mod_lib.split(mask_mod)
  block = block_mask_lib.CLASSIFY_BLOCK
  if rule.kernel_reason is not None:
    inputs = inputs._replace(mask_consts=tuple(rule.closed.consts))
  return inputs, dataclasses.replace(params, mask_rule=rule, table_block=(block, block))


def probe(inputs: Inputs, params: Params, parts: int) -> Inputs:
  """What one pair of the ring looks like to a backend's checks and its config: offsets, a
  pair's lengths and, where the pairs get one, a block table (its values do not matter)."""
  b = inputs.query.shape[0]
  pair = inputs._replace(offsets=jnp.zeros((b, 2), jnp.int32))
  if params.table_block is None:
    return pair
  t = inputs.query.shape[1] // parts
  blocks = tuple(-(-t // size) for size in params.table_block)
  return pair._replace(block_table=jnp.full((1, 1) + blocks, block_mask_lib.PARTIAL, jnp.int8))


@dataclasses.dataclass(frozen=True)
class Ring:
  """The static description of one ring call (hashable: a nondiff argument of the VJP)."""

  axis_name: str
  layout: str
  backend: object
  config: object

  def size(self) -> int:
    return lax.axis_size(self.axis_name)

  def shift(self, xs):
    """Every device sends ``xs`` to the next one on the ring."""
    ring = self.size()
    perm = [(j, (j + 1) % ring) for j in range(ring)]
    return jax.tree.map(lambda x: lax.ppermute(x, self.axis_name, perm), xs)  # (None stays)


def parts_of(layout: str) -> int:
  """Parts of a chunk computed as pairs: the zigzag layout's two halves lie apart."""
  return 2 if layout == "zigzag" else 1


def _pair(inputs: Inputs, params: Params, kv, q_part, kv_part, parts: int, q_starts,
          kv_starts, valid):
  """The inputs of one (query part, key part) pair: slices, their offsets and their lengths
  (``valid``: per part, the valid rows [B] of the query parts and of the key parts), and the
  pair's own block table and mask_mod features. The part indices may be traced (a pair chosen
  by the device's place on the ring). ``kv`` is `_travelling`'s tuple."""
  k, v, kv_seg, k_descale, v_descale = kv
  tq, tk = inputs.query.shape[1] // parts, k.shape[1] // parts
  q_sl = functools.partial(_part_of, start=q_part * tq, size=tq)
  k_sl = functools.partial(_part_of, start=kv_part * tk, size=tk)
  b = inputs.query.shape[0]
  starts = jnp.stack([jnp.stack(q_starts)[q_part], jnp.stack(kv_starts)[kv_part]])
  starts = starts.astype(jnp.int32)
  offsets = jnp.broadcast_to(starts, (b, 2))
  q_valid, kv_valid = valid
  lengths = jnp.stack([jnp.stack(q_valid)[q_part], jnp.stack(kv_valid)[kv_part]], axis=1)
  pair = inputs._replace(query=q_sl(inputs.query), key=k_sl(k), value=k_sl(v),
                         q_segment_ids=q_sl(inputs.q_segment_ids),
                         kv_segment_ids=k_sl(kv_seg), lengths=lengths, offsets=offsets)
  if fp8.per_token(inputs.q_descale):  # (an FP8 call's factors per token: the part's own)
    pair = pair._replace(q_descale=q_sl(inputs.q_descale))
  if k_descale is not None:  # (the visiting chunk's factors: `_travelling`)
    pair = pair._replace(k_descale=k_sl(k_descale) if fp8.per_token(k_descale) else k_descale)
  if v_descale is not None:
    pair = pair._replace(v_descale=v_descale)
  return _with_pair_masks(pair, params, starts)


def _with_pair_masks(pair: Inputs, params: Params, starts) -> Inputs:
  """``pair`` with the block table of its own rows and keys (segment ids and a mask_mod), and
  the mask_mod's features at its rows' and keys' positions in the whole sequence (``starts``:
  int32 [2], the pair's first query and key position; the kernels add the offsets to the
  indices the tile rule reads). A table made for the device's own chunk against itself says
  nothing about another chunk's keys: blocks it calls empty may hold a shared document."""
  tables = []
  if pair.q_segment_ids is not None:
    tables.append(block_mask_lib.classify_segments(pair.q_segment_ids, pair.kv_segment_ids))
  if params.mask_rule is not None:
    b, tq, n, _ = pair.query.shape
    block = block_mask_lib.CLASSIFY_BLOCK
    table, q_features, kv_features = block_mask_lib.mask_mod_blocks(
        params.mask_rule, b, n, tq, pair.key.shape[1], block, block, starts[0], starts[1])
    tables.append(table)
    pair = pair._replace(q_features=q_features, kv_features=kv_features)
  if not tables:
    return pair
  table = tables[0] if len(tables) == 1 else block_mask_lib.intersect(*tables)
  return pair._replace(block_table=table)


def _step_pairs(inputs: Inputs, params: Params, ring: Ring, kv, step: int) -> list:
  """``(query part, key part, inputs)`` of the pairs one ring step computes, where ``kv`` (K, V,
  key segment ids) is the chunk this device holds at that step.

  Under a causal band the zigzag layout needs three of its four pairs at step 0 (the query
  half before the key half sees none of it) and two at every later step: the late query half
  always sees the early key half, and of the two same-side pairs only the one whose key chunk
  came from an earlier device (``step <= me``) is visible. That pair's part index is traced.
  Skipping a hidden pair is exact: the band hides all of it, whatever else masks it."""
  size, me, parts = ring.size(), lax.axis_index(ring.axis_name), parts_of(ring.layout)
  chunk = inputs.query.shape[1]
  owner = (me - step) % size  # of the K/V chunk this device holds at this step
  q_len, kv_len = inputs.lengths[:, 0], inputs.lengths[:, 1]  # in the whole sequence
  if ring.layout == "striped":
    # Row r of device d's chunk is token r * R + d. Under a causal band query row r then sees
    # key row c iff c * R + owner <= r * R + me: c <= r if the keys' owner is this device or
    # an earlier one, c < r otherwise. That is a band shifted by one, which the offsets say
    # (and all they need to: a striped call has no window and no dropout, see `validate`).
    q_starts, kv_starts = [0], [(owner > me).astype(jnp.int32)]
    # Rows r with r * R + d < length are valid: the first ceil((length - d) / R).
    valid = ([jnp.clip((q_len - me + size - 1) // size, 0, chunk)],
             [jnp.clip((kv_len - owner + size - 1) // size, 0, chunk)])
  else:
    q_starts = chunk_starts(ring.layout, size, me, chunk)
    kv_starts = chunk_starts(ring.layout, size, owner, chunk)
    part = chunk // parts
    valid = ([jnp.clip(q_len - start, 0, part) for start in q_starts],
             [jnp.clip(kv_len - start, 0, part) for start in kv_starts])
  if parts == 1 or not params.window.is_causal:
    pairs = [(p, r) for p in range(parts) for r in range(parts)]
  elif step == 0:
    pairs = [(0, 0), (1, 0), (1, 1)]
  else:
    same_side = jnp.where(step <= me, 0, 1)
    pairs = [(1, 0), (same_side, same_side)]
  return [(p, r, _pair(inputs, params, kv, p, r, parts, q_starts, kv_starts, valid))
          for p, r in pairs]


def _travelling(inputs: Inputs) -> tuple:
  """What travels around the ring with a K/V chunk: its keys, values, key segment ids and an
  FP8 call's key and value factors (None where absent). The factors belong to the chunk in
  every form: per token, and per tensor or head too, since a chunk quantised on its own device
  has factors of its own."""
  return (inputs.key, inputs.value, inputs.kv_segment_ids, inputs.k_descale,
          inputs.v_descale)


def _add_part(acc, share, start):
  """``acc`` with ``share`` added to its tokens ``start ...`` (``start`` may be traced)."""
  part = _part_of(acc, start, share.shape[1]) + share
  return lax.dynamic_update_slice_in_dim(acc, part, start, axis=1)


def _part_of(x, start, size: int, axis: int = 1):
  """Tokens ``start ... start + size - 1`` of ``x`` along ``axis`` (None stays None)."""
  return None if x is None else lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _forward(inputs: Inputs, params: Params, ring: Ring):
  """(out [B, T, N, Dv], lse2 [B, N, T]) of the local queries against the whole sequence."""
  size, parts = ring.size(), parts_of(ring.layout)
  partial_params = dataclasses.replace(params, partial=True)
  sinks, inputs = inputs.sinks, flash.without_sinks(inputs)  # joined after the last merge
  kv = _travelling(inputs)
  # Per query part, the (out, lse) merged so far: each partial is merged in as it comes, so
  # that one float32 output per part is alive, not one per pair.
  merged = [None] * parts

  def merge_in(part, out, lse):
    merged[part] = (out, lse) if merged[part] is None else partial.merge(
        [merged[part][0], out], [merged[part][1], lse])

  def merge_traced(p, out, lse):
    """Merges a pair whose query part ``p`` is traced (the zigzag's same-side pair after step
    0, when both parts hold results) into part ``p`` alone: selects pick that part's results
    and put the merged ones back, so one merge runs, not one per part."""
    mine = [jnp.where(p == 0, first, second) for first, second in zip(*merged)]
    new = partial.merge([mine[0], out], [mine[1], lse])
    for part in range(parts):
      merged[part] = tuple(jnp.where(p == part, n, old) for n, old in zip(new, merged[part]))

  for step in range(size):
    # The next chunk is on its way while this one computes (it depends on nothing computed).
    next_kv = ring.shift(kv) if step < size - 1 else None
    for p, _, pair in _step_pairs(inputs, params, ring, kv, step):
      out, lse2 = flash.forward(ring.backend, pair, partial_params, ring.config)
      lse = jnp.swapaxes(_core.user_lse(lse2), 1, 2)
      (merge_in if isinstance(p, int) else merge_traced)(p, out, lse)
    kv = next_kv
  out = jnp.concatenate([m[0] for m in merged], axis=1)
  lse = jnp.concatenate([m[1] for m in merged], axis=1)  # [B, T, N]
  out, lse = partial.with_sinks(out, lse, sinks)
  out = out if params.partial else out.astype(params.output_dtype(inputs))
  return out, _core.base2_lse(jnp.swapaxes(lse, 1, 2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def ring_attention(inputs: Inputs, params: Params, ring: Ring):
  """``(out, natural lse [B, N, T])`` of the local queries over the whole ring's keys."""
  out, lse2 = _forward(inputs, params, ring)
  return out, _core.user_lse(lse2)


def _fwd(inputs, params, ring):
  inputs = flash.primal_values(inputs)  # (no bias: `jaxflash.ring_attention` takes none)
  out, lse2 = _forward(inputs, params, ring)
  return (out, _core.user_lse(lse2)), (inputs, out, lse2)


def _bwd(params, ring, residuals, cotangents):
  inputs, out, lse2 = residuals
  if fp8.is_fp8(inputs.query.dtype):
    raise ValueError(flash.FP8_GRADIENT)
  d_out, delta = flash.output_cotangents(out, cotangents)
  size, parts = ring.size(), parts_of(ring.layout)
  tq = inputs.query.shape[1] // parts
  partial_params = dataclasses.replace(params, partial=True)  # float32 shares, summed
  pairs_of = flash.without_sinks(inputs)
  kv = _travelling(inputs)
  # Accumulators vary over the manual axes like the gradients added to them (check_vma).
  zeros = lambda x: _core.varying_like(jnp.zeros(x.shape, jnp.float32),  # noqa: E731
                                       _core.varying_axes(x))
  dq, dk, dv = zeros(inputs.query), zeros(inputs.key), zeros(inputs.value)
  for step in range(size):
    next_kv = ring.shift(kv) if step < size - 1 else None
    for p, r, pair in _step_pairs(pairs_of, params, ring, kv, step):
      rows = functools.partial(_part_of, start=p * tq, size=tq)
      g = flash.backward(ring.backend, pair, partial_params, ring.config,
                         rows(lse2, axis=2), rows(d_out), rows(delta, axis=2), False)
      tk = pair.key.shape[1]
      dq = _add_part(dq, g[0], p * tq)
      dk = _add_part(dk, g[1], r * tk)
      dv = _add_part(dv, g[2], r * tk)
    if step < size - 1:
      kv, (dk, dv) = next_kv, ring.shift((dk, dv))
  # The accumulators now belong to the next device's chunk: one more shift sends them home,
  # already in the gradients' dtype (casting before or after the trip gives the same bits).
  dk, dv = ring.shift((dk.astype(inputs.key.dtype), dv.astype(inputs.value.dtype)))
  return (flash.cotangents_of(inputs, dq, dk, dv, None, lse2=lse2, delta=delta),)


ring_attention.defvjp(_fwd, _bwd, symbolic_zeros=True)
