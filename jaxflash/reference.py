"""A dense float32 attention with every jaxflash option, for tests, demos and benchmarks.

It builds the whole [B, N, T, S] logit matrix, so it is O(T * S) in memory: use it to check the
blockwise backends on small shapes, never in a model. It deliberately shares no code with the
backends (not even `jaxflash.masking`), so a bug there cannot hide in both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reference_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                        query_seq_lengths=None, key_value_seq_lengths=None,
                        local_window_size=None, segment_ids=None, logits_soft_cap=None,
                        dropout_rate=0.0, dropout_keep=None, sinks=None, score_mod=None):
  """Attention in float32 with dense [B, N, T, S] logits: what the tests compare jaxflash with.

  O(T·S) memory, no kernels, no argument checks. The arguments shown mean what they mean in
  `jaxflash.flash_attention` (BTNH only); it has no ``mask_mod``/``block_mask`` (pass the
  mask_mod evaluated on broadcasting index grids as ``mask``), FP8,
  ``implementation`` or ``interpret``. Dropout takes the keep mask itself (``dropout_keep``, bool
  broadcastable to [B, N, T, S]) rather than a key, so a test can hand it the mask that
  `jaxflash.dropout.dense_keep_mask` says the kernels use: kept probabilities are scaled by
  ``1 / (1 - dropout_rate)``; the kernels scale by the exact ``1 / P(keep)``, whose
  ``jaxflash.dropout.keep_probability(rate)`` is within 2⁻¹⁷ of ``1 - rate`` (pass
  ``dropout_rate=1 - keep_probability(rate)`` where the last bits matter). ``sinks`` [N] are
  one more logit per head, in every row that sees a key, whose value is zero. ``score_mod`` is
  called once on the whole [B, N, T, S] logits and broadcasting index arrays.

  Returns ``(out, lse)``: ``out`` float32 [B, T, N, H] (zeros on rows that see no key: all
  their logits masked or -inf) and ``lse``
  float32 [B, T, N] (natural log, ``-inf`` on rows that see no key).
  """
  q = jnp.asarray(query, jnp.float32)
  k = jnp.asarray(key, jnp.float32)
  v = jnp.asarray(value, jnp.float32)
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  k = jnp.repeat(k, n // kh, axis=2)
  v = jnp.repeat(v, n // kh, axis=2)
  if scale is None:
    scale = h ** -0.5
  logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision=jax.lax.Precision.HIGHEST) * scale
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  if score_mod is not None:
    index = lambda size, axis: jnp.arange(size).reshape([-1 if a == axis else 1  # noqa: E731
                                                         for a in range(4)])
    logits = score_mod(logits, index(b, 0), index(n, 1), index(t, 2), index(s, 3))
    logits = jnp.asarray(logits, jnp.float32)
  if bias is not None:
    logits = logits + jnp.broadcast_to(jnp.asarray(bias, jnp.float32), logits.shape)

  # (Every broadcast spelled out: the reference runs under strict rank promotion too.)
  q_pos = jnp.arange(t).reshape(1, 1, t, 1)
  k_pos = jnp.arange(s).reshape(1, 1, 1, s)
  ok = jnp.ones((b, n, t, s), bool)
  if mask is not None:
    ok = ok & jnp.broadcast_to(mask, ok.shape)
  if is_causal:
    ok = ok & (k_pos <= q_pos)
  if local_window_size is not None:
    left, right = ((local_window_size, local_window_size) if isinstance(local_window_size, int)
                   else local_window_size)
    # (Sides past T + S see everything: capped, so that int32 positions cannot overflow.)
    left, right = (min(int(x), t + s) for x in (left, right))
    ok = ok & (k_pos - q_pos >= -left) & (k_pos - q_pos <= right)
  if query_seq_lengths is not None:
    ok = ok & (q_pos < jnp.asarray(query_seq_lengths).reshape(b, 1, 1, 1))
  if key_value_seq_lengths is not None:
    ok = ok & (k_pos < jnp.asarray(key_value_seq_lengths).reshape(b, 1, 1, 1))
  if segment_ids is not None:
    q_seg, kv_seg = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
    ok = ok & (jnp.asarray(q_seg).reshape(b, 1, t, 1) == jnp.asarray(kv_seg).reshape(b, 1, 1, s))

  logits = jnp.where(ok, logits, -jnp.inf)
  # A row sees a key where a logit is above -inf: an entry that the score_mod or the bias makes
  # -inf is hidden as a masked one is (FlexAttention's way to mask from a score_mod). (NaN is
  # not -inf: a NaN row stays NaN.)
  row_max = jnp.max(logits, axis=-1)
  any_visible = row_max != -jnp.inf
  # The softmax shifted by the row's largest logit (the sink's where larger), as jax.nn's: an
  # LSE of logits near -1e9 loses log(S) in float32, and exp(logits - lse) would not sum to 1.
  # (The shift cancels in the result and in every derivative: no gradient through it.)
  shift = row_max
  if sinks is not None:  # a column of the sink's logit, dropped again after the softmax
    sink = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32).reshape(1, n, 1), row_max.shape)
    shift = jnp.maximum(shift, sink)
  shift = jax.lax.stop_gradient(jnp.where(any_visible, shift, 0.0))
  weights = jnp.where(ok, jnp.exp(logits - shift[..., None]), 0.0)
  total = jnp.sum(weights, axis=-1)
  if sinks is not None:
    total = total + jnp.exp(sink - shift)
  lse = jnp.where(any_visible, shift + jnp.log(jnp.where(any_visible, total, 1.0)), -jnp.inf)
  probs = weights / jnp.where(any_visible, total, 1.0)[..., None]
  if dropout_keep is not None:
    probs = jnp.where(dropout_keep, probs / (1.0 - dropout_rate), 0.0)
  out = jnp.einsum("bnts,bsnh->btnh", probs, v, precision=jax.lax.Precision.HIGHEST)
  return out, jnp.transpose(lse, (0, 2, 1))
