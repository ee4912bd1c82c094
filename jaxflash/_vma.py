"""Varying manual axes (``check_vma`` inside `jax.shard_map`): which axes a value varies over,
and a value made to vary over more. The bottom of the package, so that both `jaxflash._core`
and the mask_mod interpreter (`jaxflash.mask_mod`, which `_core` imports) use one copy."""

from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
  """The manual mesh axes (inside `jax.shard_map`) that ``x`` varies over; empty elsewhere."""
  mat = getattr(jax.typeof(x), "mat", None)
  return frozenset(getattr(mat, "varying", ()))


def varying_like(x, axes: frozenset):
  """``x`` made varying over ``axes`` too (a no-op outside `jax.shard_map`): a loop carry
  started from constants must have the type of what its body returns under ``check_vma``."""
  missing = tuple(sorted(axes - varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def varying_as(arrays, *like) -> list:
  """``arrays``, each made varying over every manual axis any of ``like`` varies over (a
  no-op outside `jax.shard_map`)."""
  axes = frozenset().union(*(varying_axes(x) for x in like))
  return [varying_like(x, axes) for x in arrays]


def summed_like(cotangent, primal):
  """``cotangent``, summed over the manual axes it varies over and ``primal`` does not: the
  transpose of the implicit cast that made ``primal`` vary alike with the other operands (an
  MQA key head shared by query heads split over devices, a bias broadcast over a split batch,
  a table a score_mod closes over). A VJP must return its primal's type under ``check_vma``."""
  extra = tuple(sorted(varying_axes(cotangent) - varying_axes(primal)))
  return jax.lax.psum(cotangent, extra) if extra else cotangent
