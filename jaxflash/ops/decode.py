"""Decoding against a KV cache: a few new query tokens attend to everything cached before them.

The new tokens of batch row ``b`` sit at absolute positions ``kv_lengths[b] - T ...
kv_lengths[b] - 1`` of the cache (they are already written into it), causal among themselves.
In the terms of the training op that is a causal band whose diagonal is shifted by
``kv_lengths - T`` (`jaxflash.masking`'s query offset), keys limited to ``kv_lengths``: so a
decoding call is a training call with those positions (`decode_inputs`), and any backend serves
it, forward and backward.

A paged cache (pages ``[num_pages, page_size, K, H]`` and a page table ``[B, pages_per_row]``,
the vLLM / FlashInfer layout) is gathered into rows here (`gather_pages`). That is the step a
split-KV decoding kernel removes (issue 14): it reads the pages where they lie, once per K/V head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflash._core import Inputs


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
  """The rows ``[B, pages_per_row * page_size, K, H]`` of a paged cache: row ``b`` is the pages
  ``page_table[b, 0], page_table[b, 1], ...`` one after another."""
  rows = jnp.take(pages, page_table, axis=0)  # [B, pages_per_row, page_size, K, H]
  b, per_row, page_size = rows.shape[:3]
  return rows.reshape(b, per_row * page_size, *pages.shape[2:])


def decode_inputs(inputs: Inputs) -> Inputs:
  """The training op's inputs for a decoding call whose ``inputs.lengths`` hold (T, kv_length)
  per batch row: query row ``r`` sits at absolute position ``kv_length - T + r``, keys at their
  cache positions. Rows whose position is negative (a row holding fewer tokens than T) see no
  key, and give zeros."""
  t = inputs.query.shape[1]
  kv_len = inputs.lengths[:, 1]
  return inputs._replace(offsets=jnp.stack([kv_len - t, jnp.zeros_like(kv_len)], axis=1))
