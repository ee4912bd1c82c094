"""The public entry point: check arguments, pick a backend, run the attention op.

Nothing here computes attention. `jaxflash._checks` validates and normalises the arguments,
`jaxflash.backends` picks the backend that serves the call on this device, and
`jaxflash.ops.flash` runs it as one differentiable call.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp

from jaxflash import _checks
from jaxflash import _core
from jaxflash import backends
from jaxflash import devices
from jaxflash import fp8
from jaxflash.block_mask import BlockMask
from jaxflash.mask_mod import MaskMod, ScoreMod
from jaxflash.ops import decode
from jaxflash.ops import flash
from jaxflash.ops import quantized

Implementation = Literal["mosaic", "triton", "xla"]


def flash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
    logits_soft_cap: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    broadcast_dropout: bool = False,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    score_mod: ScoreMod | None = None,
    sinks: jax.Array | None = None,
    q_descale: jax.Array | None = None,
    k_descale: jax.Array | None = None,
    v_descale: jax.Array | None = None,
    out_dtype: jnp.dtype | None = None,
    deterministic: bool = True,
    return_residual: bool = False,
    implementation: Implementation | Sequence[Implementation] | None = None,
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Exact scaled dot-product attention in O(T + S) memory (FlashAttention).

  A drop-in for `jax.nn.dot_product_attention`: the arguments they share mean the same thing.
  The softmax is computed blockwise with an online max/sum, so neither the logits nor the
  probabilities are ever stored; the backward pass recomputes them from the inputs and the
  logsumexp saved by the forward pass. A call with at most 16 query rows and no bias,
  segments, dropout or score_mod (decoding-like: a few queries against many keys) runs the
  Triton backend's split-KV forward, the kernel of `decode_attention` (a mask, a mask_mod or a
  block mask is read as a dense mask of those rows); its backward is the same.

  Notation: B batch, T query length, S key/value length, N query heads, K key/value heads
  (N % K == 0: grouped-query attention when K < N), H head dim of query and key, Dv that of
  value and the output (Dv = H usually; DeepSeek's MLA has H = 192, Dv = 128).

  Args:
    query: [B, T, N, H] or unbatched [T, N, H]; float16, bfloat16 or float32, or float8
      (``float8_e4m3fn``, ``float8_e5m2``) with the descale factors below.
    key: [B, S, K, H] (or [S, K, H]), same dtype as ``query``.
    value: [B, S, K, Dv] (or [S, K, Dv]), same dtype as ``query``.
    bias: optional additive bias, broadcastable to [B, N, T, S] (or [N, T, S] when unbatched),
      added to the scaled (and soft-capped) logits. Differentiable: its gradient is summed over
      the axes it is broadcast along, and is computed only when asked for (a bias that is not
      differentiated costs no extra time or memory in the backward pass). A logit below about
      -2.3e38 (float32's ``finfo.min`` as a bias) counts as -inf, as a mask would: a row
      biased so entirely sees no key and gives zeros (jax.nn averages its values). A logit
      above about +2.3e38 overflows the kernels' base-2 logits (log2(e) times it) and gives
      NaN, where jax.nn still picks that key. float16, bfloat16 or float32; float64 (Python
      floats under jax_enable_x64) is taken as float32 (jax.nn also takes an integer bias).
    mask: optional boolean mask broadcastable to [B, N, T, S]; True means "may attend".
    scale: multiplier of ``query @ key``; defaults to ``1 / sqrt(H)`` (query's head dim). A
      number known when the call is traced (the kernels compile it in; jax.nn also takes a
      traced one): for a learned temperature, multiply ``query`` by it and pass 1.0.
    is_causal: top-left aligned causal mask (query ``t`` sees keys ``s <= t``).
    query_seq_lengths: int [B]; query rows at or past the length are padding and give zeros.
    key_value_seq_lengths: int [B]; keys at or past the length are ignored.
    local_window_size: ``w`` or ``(left, right)``: query ``t`` sees keys
      ``t - left <= s <= t + right``; combines with ``is_causal``.
    segment_ids: int [B, T] for self-attention (T == S), or a pair ``(q_segment_ids [B, T],
      kv_segment_ids [B, S])``; a query sees only keys with the same segment id. Ids are
      compared as int32 (under jax_enable_x64, int64 ids must fit in it).
    logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)`` after scaling and before
      the bias.
    dropout_rate: attention dropout probability in [0, 1): entries of the normalised attention
      weights are dropped with this probability and kept ones are scaled by
      ``1 / (1 - dropout_rate)``, as in ``flax.linen.dot_product_attention`` (exactly: by
      1 / P(keep), where P(keep) is 1 - rate rounded to a multiple of 2**-16, so the output is
      unbiased). The mask is never stored: forward and backward regenerate it from
      ``dropout_rng`` and each entry's (batch, head, query, key) coordinates (see
      `jaxflash.dropout`), identically in every backend. The LSE returned by
      ``return_residual`` is that of the undropped weights.
    dropout_rng: PRNG key (typed, or a raw uint32 key of the default implementation:
      ``jax.random.PRNGKey``'s, uint32[2], or uint32[4] under rbg) for dropout; required when
      ``dropout_rate > 0``. The same key gives the same mask.
    broadcast_dropout: share one [T, S] dropout mask across the batch and heads (Flax's
      ``broadcast_dropout=True``); by default every batch row and head has its own.
    mask_mod: ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` (FlexAttention's signature):
      whether query ``q_idx`` of batch row ``batch`` and query head ``head`` may attend to key
      ``kv_idx``, as jnp code on broadcasting int32 index arrays; it may close over arrays
      (document ids, a prefix length per row). The call builds its block mask
      (`jaxflash.create_block_mask`) and skips the blocks it hides; build one yourself and pass
      ``block_mask`` to reuse it across calls and layers. Combines with every other option.
    block_mask: a `jaxflash.BlockMask` (from `jaxflash.create_block_mask` or
      `BlockMask.from_blocks`) for this call's T and S: only its non-empty blocks are computed,
      and only its partial blocks evaluate the mask per entry. A dense ``mask`` and
      ``segment_ids`` are classified block by block the same way, in every call.
    score_mod: ``score_mod(score, batch, head, q_idx, kv_idx) -> score`` (FlexAttention's
      signature): a function that changes each logit, applied to the scaled (and soft-capped)
      logits before the bias and the masks, as jnp code on a float32 score and broadcasting
      int32 indices; it may close over arrays (ALiBi slopes, a relative-position table).
      Gradients flow through it to query and key (the backward differentiates it per entry),
      and to the floating-point arrays it closes over where they are differentiated (a
      learned table or slopes: one more blockwise pass, deterministic, that costs about an
      XLA backward). The Mosaic and Triton kernels evaluate it per tile (like a mask_mod, from
      row and column features); one that reads an array at both indices is a lookup, which
      Triton gathers and Mosaic reads per diagonal where the indices depend on ``q_idx -
      kv_idx`` alone (a relative-position table ``table[h, q_idx - kv_idx]``).
    sinks: optional float [N], one learnable logit per query head (attention sinks, as in
      gpt-oss and StreamingLLM) that joins every row's softmax denominator with a zero value
      row: ``out = sum_s exp(l_s) v_s / (exp(sink) + sum_s exp(l_s))`` over the row's visible
      logits ``l_s`` (scaled, capped and biased), and the LSE includes it. Differentiable:
      its gradient is summed over batch rows and queries in a fixed order (deterministic).
      A row that sees no key still gives zeros (and an LSE of ``-inf``).
    q_descale, k_descale, v_descale: an FP8 call's float32 descale factors (1 if None): the
      real inputs are ``float(x8) * descale``. Each is a scalar (per tensor) or [B, K] (per
      batch row and K/V head, FlashAttention-3's form); ``q_descale`` may also be [B, N] and,
      for block quantisation, [B, T, N] (per token and head), ``k_descale`` [B, S, K].
      `jaxflash.quantize_fp8` makes the values and their factors. The forward runs on FP8
      tensor cores (Mosaic on Hopper) or upcast (XLA); it has no gradient: train with
      `jaxflash.fp8_attention`.
    out_dtype: the output dtype of an FP8 call (float16, bfloat16 or float32; default
      bfloat16). Other calls return the query's dtype and take no ``out_dtype``.
    deterministic: whether the gradients must be bitwise repeatable (the default: every
      gradient element has one writer, in a fixed order). ``False`` allows a backward that
      adds dQ in whatever order the key blocks finish, with float32 atomics (cuDNN's and
      FlashAttention's default), where that measured faster than the deterministic one (the
      Mosaic backend at head dims up to 128, causal or not, and at 256;
      `jaxflash.backends.mosaic.config.ATOMIC_TUNED`); elsewhere the deterministic backward
      runs. The result is as accurate, but its last bits may differ from run to run.
    return_residual: also return the logsumexp of the logits, [B, T, N] in the query's dtype as
      jax.nn returns it (natural log, ``-inf`` for rows that see no key; computed in float32).
    implementation: ``"mosaic"`` (Pallas Mosaic GPU kernels for Hopper GPUs; the Triton
      backward serves the gradients of masks and biases), ``"triton"`` (Pallas kernels
      lowered through Triton, NVIDIA GPUs), ``"xla"`` (jaxflash's blockwise pure JAX, any
      device; `dot_product_attention` passes ``"xla"`` and ``"cudnn"`` to jax.nn instead), a
      sequence of those in order of preference, or ``None``: the first registered backend that
      supports the call on this device and is the faster one there by measurement (Mosaic on
      Hopper where it measured faster, else Triton on an NVIDIA GPU when the head dim allows
      it, XLA elsewhere; see `jaxflash.backends` and docs/api.md, "Choosing a backend").
    interpret: run the Pallas kernels in interpret mode (works on a CPU; for testing).

  Returns:
    The attention output, [B, T, N, Dv] (or [T, N, Dv]) in the query's dtype (an FP8 call's
    in ``out_dtype``); with
    ``return_residual`` the pair
    ``(output, logsumexp)``. Query rows that can see no key produce zeros and zero gradients.
    As in jax.nn, T = 0 gives empty results and S = 0 zeros (with an LSE of ``-inf``).

  Raises:
    ValueError: an argument has the wrong shape, dtype or value, or the named implementation
      cannot serve the call (`jaxflash.backends.UnsupportedCallError`, which says why); raised
      before any kernel runs.
  """
  return attention_with_config(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids,
      logits_soft_cap=logits_soft_cap, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
      broadcast_dropout=broadcast_dropout, mask_mod=mask_mod, block_mask=block_mask,
      score_mod=score_mod, sinks=sinks, q_descale=q_descale, k_descale=k_descale,
      v_descale=v_descale, out_dtype=out_dtype, deterministic=deterministic,
      return_residual=return_residual, implementation=implementation, interpret=interpret)


def fp8_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    rotation: jax.Array | None = None,
    block_size: int | None = None,
    fp8_dtype: Any = jnp.float8_e4m3fn,
    backward: Literal["straight_through", "mixed"] = "straight_through",
    return_residual: bool = False,
    implementation: Implementation | Sequence[Implementation] | None = None,
    **options: Any,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """`flash_attention` with an FP8 forward, for training: 16-bit inputs, a 16-bit gradient.

  The call quantises ``query``, ``key`` and ``value`` itself (`jaxflash.quantize_fp8`: query
  and key after ``rotation``, one scale per ``block_size`` tokens and head; value one scale per
  batch row and K/V head) and runs the FP8 forward (FP8 tensor cores with the Mosaic backend on
  Hopper; upcast on XLA). The output has the query's dtype. The backward runs the 16-bit
  kernels against the FP8 forward's logsumexp (see ``backward``).

  Args:
    query, key, value, bias, mask: as in `flash_attention` (float16, bfloat16 or float32).
    rotation: optional [H, H] orthogonal matrix (`jaxflash.random_rotation`) applied to query
      and key before quantising: FlashAttention-3's incoherent processing, which spreads
      outlier features and leaves the logits exact. A fixed matrix: it gets no gradient.
    block_size: tokens per query/key scale; None: one scale per batch row and head.
    fp8_dtype: ``jnp.float8_e4m3fn`` (default) or ``jnp.float8_e5m2``.
    backward: ``"straight_through"`` (default): the gradient of exact attention at the inputs'
      FP8 round trip (the forward's own logits), passed straight through to the inputs; its
      error is bounded by the forward's. ``"mixed"``: recompute the logits from the 16-bit
      inputs; closer on inputs with small logits (2.2% against 5.3% relative error on normal
      inputs at D = 128), but it diverges where the FP8 logsumexp is off by a few units, as
      with outlier features (docs/fp8.md, "Which backward").
    return_residual, implementation: as in `flash_attention`. ``implementation`` names the
      backward's backend; the forward takes it too where it serves FP8, and otherwise the
      backend `flash_attention` would pick for the FP8 call.
    **options: `flash_attention`'s other keyword arguments (``is_causal``, ``sinks``, ...).

  Returns:
    As `flash_attention`.
  """
  for name in ("q_descale", "k_descale", "v_descale", "out_dtype"):
    if name in options:
      raise ValueError(f"fp8_attention quantises its inputs itself and takes no {name}")
  unknown = sorted(set(options) - _FLASH_OPTIONS)
  if unknown:  # (as Python words it, naming this function rather than the checker it feeds)
    raise TypeError(f"fp8_attention() got an unexpected keyword argument {unknown[0]!r}")
  if backward not in ("straight_through", "mixed"):
    raise ValueError(f"backward must be 'straight_through' or 'mixed', got {backward!r}")
  if not fp8.is_fp8(fp8_dtype):
    raise ValueError(f"fp8_dtype must be jnp.float8_e4m3fn or jnp.float8_e5m2, got "
                     f"{fp8_dtype!r}")
  call, return_residual = _prepare(query, key, value, bias, mask, implementation=implementation,
                                   return_residual=return_residual, **options)
  if fp8.is_fp8(call.inputs.query.dtype):
    raise ValueError("fp8_attention takes 16-bit (or float32) inputs and quantises them; "
                     "call flash_attention with FP8 inputs and their descales instead")
  h = call.inputs.query.shape[-1]
  if rotation is not None:
    rotation = _checks.as_array(rotation, "rotation")
    if rotation.shape != (h, h):
      raise ValueError(f"rotation must be [H, H] = {(h, h)}, got {rotation.shape}")
  if block_size is not None and (isinstance(block_size, bool)
                                 or not isinstance(block_size, numbers.Integral)
                                 or block_size <= 0):
    raise ValueError(f"block_size must be None or a positive int, got {block_size!r}")
  block_size = None if block_size is None else int(block_size)  # (a NumPy integer too)
  backend = backends.select(implementation, call.inputs, call.params)
  empty = _empty(call.inputs, call.params)
  if empty is not None:
    return _results(*empty, call, return_residual)
  device = devices.current()
  dtype = jnp.dtype(fp8_dtype).name
  # The FP8 call's shapes and dtypes, which is all a backend chooses on.
  probe = jax.eval_shape(lambda x: quantized.quantized(x, None, block_size, dtype),
                         call.inputs)
  params8 = quantized.fp8_params(call.params, call.inputs)
  try:
    forward_backend = backends.select(implementation, probe, params8)
  except backends.UnsupportedCallError:
    forward_backend = backends.select(None, probe, params8)
  plan = quantized.Plan(block_size, dtype, backward, forward_backend,
                        forward_backend.default_config(probe, params8, device), backend,
                        backend.default_config(call.inputs, call.params, device))
  out, lse = quantized.attention(call.inputs, rotation, call.params, plan)
  return _results(out, lse, call, return_residual)


# `flash_attention`'s keyword-only arguments, which `fp8_attention` passes on through **options.
_FLASH_OPTIONS = frozenset(name for name, p in inspect.signature(flash_attention).parameters.items()
                           if p.kind is inspect.Parameter.KEYWORD_ONLY)


# The implementations that jaxflash's drop-in passes to `jax.nn.dot_product_attention` itself.
JAX_NN_IMPLEMENTATIONS = ("cudnn", "xla")


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["cudnn", "xla", "mosaic", "triton"] | Sequence[str] | None = None,
    return_residual: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """`jax.nn.dot_product_attention` with jaxflash's kernels: the same signature and meanings.

  With ``implementation=None`` (or ``"mosaic"`` / ``"triton"``, jaxflash's GPU backends) this is
  `flash_attention` on the same arguments. ``"cudnn"`` and ``"xla"`` mean what they mean to
  jax.nn: the call is passed unchanged to ``jax.nn.dot_product_attention`` (cuDNN's fused
  attention, or XLA's dense one, which stores the T x S logits), so code that names them keeps
  its behaviour. jaxflash's own blockwise pure-JAX backend, also named ``"xla"``, is reached
  through ``flash_attention(..., implementation="xla")``. A sequence of jaxflash backends goes to
  `flash_attention` too, but may not name ``"cudnn"`` or ``"xla"`` (ambiguous here).

  For jaxflash's further options (segment ids, soft cap, dropout, ``interpret``) call
  `flash_attention`. Args, returns and errors as in `flash_attention` and jax.nn.
  """
  options = dict(scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                 key_value_seq_lengths=key_value_seq_lengths,
                 local_window_size=local_window_size, return_residual=return_residual)
  if isinstance(implementation, str) and implementation in JAX_NN_IMPLEMENTATIONS:
    return jax.nn.dot_product_attention(query, key, value, bias, mask,
                                        implementation=implementation, **options)
  if (not isinstance(implementation, str) and isinstance(implementation, Sequence)
      and any(name in JAX_NN_IMPLEMENTATIONS for name in implementation)):
    raise ValueError(f"implementation={tuple(implementation)!r}: dot_product_attention passes "
                     "'cudnn' and 'xla' to jax.nn.dot_product_attention, which takes one name; "
                     "for jaxflash's blockwise XLA backend in a sequence call flash_attention")
  if isinstance(implementation, str) and implementation not in backends.names():
    # (Named here: `flash_attention`'s message would leave out the names passed to jax.nn.)
    raise ValueError(f"implementation must be None, one of "
                     f"{JAX_NN_IMPLEMENTATIONS + tuple(n for n in backends.names() if n != 'xla')}"
                     f" or a sequence of jaxflash's {backends.names()}, got {implementation!r}")
  return flash_attention(query, key, value, bias, mask, implementation=implementation,
                         **options)


def implementation_for(query: jax.Array, key: jax.Array, value: jax.Array,
                       bias: jax.Array | None = None, mask: jax.Array | None = None, *,
                       implementation: Implementation | Sequence[Implementation] | None = None,
                       **options: Any) -> str:
  """The name of the backend that `flash_attention` would run for these arguments on this device
  (``options``: its other keyword arguments). Computes no attention; raises as `flash_attention`
  would."""
  backends.preferences(implementation)
  call = _checks.normalise(query, key, value, bias, mask, **options)
  if implementation is None and _few_queries(call):
    implementation = decode.preference_order()
  return backends.select(implementation, call.inputs, call.params).name


def attention_with_config(query: jax.Array, key: jax.Array, value: jax.Array,
                          bias: jax.Array | None = None, mask: jax.Array | None = None, *,
                          config: Any = None, return_residual: bool = False,
                          implementation: Implementation | Sequence[Implementation] | None = None,
                          **options: Any) -> jax.Array | tuple[jax.Array, jax.Array]:
  """`flash_attention` with an explicit backend config (tiles, launch parameters).

  The internal entry point that tests, the tile tuner and the benchmarks use instead of patching
  defaults: ``config`` is an instance of a backend's config class (e.g.
  ``jaxflash.backends.triton.Config``), and its type picks that backend; ``None`` takes the
  backend's heuristic default for this call and device, and then a call with at most
  `SPLIT_KV_MAX_QUERIES` query rows runs the backend's split-KV forward where it has one that
  serves the call (the decoding kernel: a few query rows against many keys). ``options`` are
  `flash_attention`'s keyword arguments.
  """
  call, return_residual = _prepare(query, key, value, bias, mask, implementation=implementation,
                                   return_residual=return_residual, **options)
  split_kv = config is None and _few_queries(call)
  if split_kv and implementation is None:
    implementation = decode.preference_order()
  return _run(call, implementation, config, return_residual, split_kv=split_kv)


def _prepare(query, key, value, bias=None, mask=None, *, implementation, return_residual,
             **options) -> tuple[_checks.Call, bool]:
  """The checks an attention call starts with: an unknown ``implementation`` fails before
  anything else, then ``return_residual`` and every other argument are checked
  (`_checks.normalise`: a ValueError naming the argument, before any kernel runs). Returns the
  normalised call and ``return_residual``."""
  backends.preferences(implementation)
  return_residual = _checks.check_flag(return_residual, "return_residual")
  return _checks.normalise(query, key, value, bias, mask, **options), return_residual


def _results(out: jax.Array, lse: jax.Array, call: _checks.Call, return_residual: bool):
  """``out`` or ``(out, lse)`` as users get them from ``out`` [B, T, N, H] and the float32
  natural-log ``lse`` [B, N, T]: the LSE as jax.nn returns it, [B, T, N] in the query's dtype
  (so cotangents of jax.nn's dtype fit; ops use the float32 one), and no batch axis where the
  inputs had none."""
  lse = jnp.transpose(lse, (0, 2, 1)).astype(call.params.output_dtype(call.inputs))
  if call.unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out


def _empty(inputs, params) -> tuple[jax.Array, jax.Array] | None:
  """The result of a call with nothing to compute, as jax.nn gives it, or None: no batch row or
  no query row gives empty arrays, and no key gives zeros with an LSE of -inf (every row sees
  no key). No kernel runs (there would be no grid); gradients are zeros of the inputs' shapes."""
  b, t, n, _ = inputs.query.shape
  if b and t and inputs.key.shape[1]:
    return None
  lse = jnp.full((b, n, t), -jnp.inf, jnp.float32)  # (varying like the query in a shard_map)
  # The output has the value's head dim (it may differ from the query's), and the query's
  # dtype, sharding and varying axes: zeros of one query column, broadcast.
  out = jnp.broadcast_to(jnp.zeros_like(inputs.query[..., :1], params.output_dtype(inputs)),
                         (b, t, n, inputs.value.shape[-1]))
  return out, _core.varying_like(lse, _core.varying_axes(inputs.query))


def _few_queries(call: _checks.Call) -> bool:
  """Whether a call's forward should be a split-KV one: at most `SPLIT_KV_MAX_QUERIES` query
  rows, and a backend's split-KV kernel serves it. With ``implementation=None`` such a call
  then tries those backends first (`decode.preference_order`): the one picked for training
  calls (Mosaic on a Hopper GPU) has none, and at a few rows its training forward is no
  better than Triton's."""
  return (call.inputs.query.shape[1] <= SPLIT_KV_MAX_QUERIES
          and decode.split_kv_serves(call.inputs, call.params))


# Up to this many query rows, a call runs the split-KV forward where the backend has one: the
# training forward's query tiles (64 or 128 rows) would be mostly padding, and its grid has one
# program per (batch row, query head), which leaves a long-key call on a handful of SMs.
SPLIT_KV_MAX_QUERIES = 16


def _run(call: _checks.Call, implementation, config, return_residual: bool,
         split_kv: bool = False, pages=None):
  """Runs a normalised call on the backend that serves it: ``out`` or ``(out, lse)``. With
  ``split_kv`` (a decoding call) the backend's split-KV forward runs where it has one that can
  serve the call, reading a paged cache's ``pages`` (key pages, value pages, page table) where
  they lie when it can (``call.inputs`` then hold the rows the pages make, for the backward)."""
  backend = backends.select(implementation, call.inputs, call.params, config)
  empty = _empty(call.inputs, call.params)
  if empty is not None:
    return _results(*empty, call, return_residual)
  device = devices.current()
  if config is None:
    config = backend.default_config(call.inputs, call.params, device)
  path = None
  if split_kv:
    path = decode.split_kv_path(backends.preferences(implementation), backend, call.inputs,
                                call.params, device)
  if path is None:
    pages = None
  if pages is not None and not path.kernel().paged_block(pages[0].shape[1]):
    pages = None
  if path is not None:
    config = path.kernel().default_config(call.inputs, config, device,
                                          page_size=None if pages is None else pages[0].shape[1],
                                          values_in_keys=call.params.values_in_keys)
    backend = path
  if pages is not None:
    out, lse = decode.paged_attention(path, call.inputs, pages, call.params, config)
  else:
    out, lse = flash.attention(call.inputs, call.params, backend, config)
  return _results(out, lse, call, return_residual)


def decode_attention(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array | None,
    kv_lengths: jax.Array,
    *,
    value_head_dim: int | None = None,
    page_table: jax.Array | None = None,
    scale: float | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    q_descale: jax.Array | None = None,
    k_descale: jax.Array | None = None,
    v_descale: jax.Array | None = None,
    out_dtype: jnp.dtype | None = None,
    return_residual: bool = False,
    implementation: Implementation | Sequence[Implementation] | None = None,
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Attention of a few new tokens to a KV cache (generation, speculative decoding, chunked
  prefill).

  Row ``b`` of the cache holds ``kv_lengths[b]`` tokens, the ``T`` new ones last: they sit at
  positions ``kv_lengths[b] - T ... kv_lengths[b] - 1`` (write them into the cache first), and
  each sees the cached tokens up to its own position. Equal to `flash_attention` with that causal
  band, and differentiable like it.

  On the Triton backend (taken first when ``implementation`` is None and an NVIDIA GPU is
  there) the forward is a split-KV kernel: programs over (split of the cache, batch row, K/V
  head), each reading its K/V bytes once for all the query heads of the group, merged through
  the LSE (`jaxflash.backends.triton.decode`). Absorbed MLA's latent cache (``value_cache=None``,
  heads of 576/512) runs on a Hopper GPU in a Mosaic GPU kernel of FlashMLA's design when Mosaic
  is among the backends asked for (`jaxflash.backends.mosaic.decode`). The other backends run
  their training forward on the band, on a paged cache gathered into rows. The backward is
  always the training backward.

  Args:
    query: [B, T, N, H], the new tokens (T small: 1 when generating).
    key_cache: [B, S_max, K, H], or with ``page_table`` pages [num_pages, page_size, K, H].
    value_cache: shaped and typed like ``key_cache`` but for its head dim Dv, which may differ
      from H (DeepSeek's absorbed MLA decoding: H = 576, Dv = 512); or None, with
      ``value_head_dim``: the values are then the first Dv features of ``key_cache``.
    kv_lengths: int [B], the tokens in each row of the cache, the new ones included; clipped
      to [0, S_max]. A row holding fewer than T tokens gives zeros for the rows before its
      first token.
    value_head_dim: Dv where ``value_cache`` is None: absorbed MLA keeps one latent cache whose
      first 512 features are the values and whose 576 are the keys
      (``decode_attention(q, latent_cache, None, lengths, value_head_dim=512)``). The split-KV
      kernel then reads each key block once for both; a ``value_cache`` sliced from the keys
      would be a second copy of the cache, read again.
    page_table: optional int [B, pages_per_row]: row ``b`` of the cache is pages
      ``page_table[b, 0], page_table[b, 1], ...`` in order (S_max = pages_per_row * page_size).
      Only a row's first ``ceil(kv_lengths[b] / page_size)`` entries are read, and must be
      page ids in ``[0, num_pages)`` (checked where the table and lengths are concrete, an
      eager call: a ValueError; under jit, unchecked); the rest may hold anything (padding
      such as -1).
    scale: multiplier of ``query @ key``; defaults to ``1 / sqrt(H)`` (query's head dim).
    local_window_size: ``w`` or ``(left, right)``: a token sees at most ``left`` tokens before
      its own (``right`` has no effect: nothing after it is visible).
    logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)``.
    sinks: optional float [N], attention sinks (as in `flash_attention`).
    q_descale, k_descale, v_descale: an FP8 cache's descale factors (float32; the real
      values are ``float(x8) * descale``), as in `flash_attention`: a float8 query, key cache
      and value cache together (quantise the new tokens' query with `jaxflash.quantize_fp8`,
      ``block_size=1`` for a factor per token), each factor per tensor ``()`` or per (batch
      row, K/V head) ``[B, K]`` (the query's also per (batch row, query head) ``[B, N]`` or
      per token ``[B, T, N]``; the key cache's per token ``[B, S_max, K]`` on a contiguous
      cache only). With ``value_cache=None`` the values share ``k_descale`` and
      ``v_descale`` stays None. The split-KV kernel reads the FP8 cache as it lies (half a
      16-bit cache's bytes). An FP8 call has no gradient.
    out_dtype: an FP8 call's output dtype (float16, bfloat16 or float32; default bfloat16).
    return_residual: also return the logsumexp, [B, T, N] (as `flash_attention`).
    implementation: as in `flash_attention`.
    interpret: run Pallas kernels in interpret mode (for tests on a CPU).

  Returns:
    [B, T, N, Dv] in the query's dtype (an FP8 call's in ``out_dtype``); with
    ``return_residual``, ``(output, logsumexp)``.

  Raises:
    ValueError: as `flash_attention`, naming the argument, before any kernel runs.
  """
  backends.preferences(implementation)
  return_residual = _checks.check_flag(return_residual, "return_residual")
  _checks.check_devices(query=query, key_cache=key_cache, value_cache=value_cache,
                        kv_lengths=kv_lengths, page_table=page_table, sinks=sinks,
                        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
  key, value, kv_lengths, page_table = _checks.check_cache(query, key_cache, value_cache,
                                                           kv_lengths, page_table,
                                                           value_head_dim)
  k_descale, v_descale = _checks.check_cache_descales(
      key, value_cache is None, page_table is not None, k_descale, v_descale)
  pages = None
  if page_table is not None:
    pages = (key, value, page_table.astype(jnp.int32))
    # The rows the pages make: what the training kernels (and every backward) read. A split-KV
    # forward reads the pages instead, and under jit nothing then computes these.
    key, value = (decode.gather_pages(key, page_table, kv_lengths),
                  decode.gather_pages(value, page_table, kv_lengths))
  call = _checks.normalise(query, key, value, scale=scale, is_causal=True,
                           key_value_seq_lengths=kv_lengths, local_window_size=local_window_size,
                           logits_soft_cap=logits_soft_cap, sinks=sinks, interpret=interpret,
                           q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                           out_dtype=out_dtype)
  call = call._replace(inputs=decode.decode_inputs(call.inputs, kv_lengths))
  if value_cache is None:
    call = call._replace(params=dataclasses.replace(call.params, values_in_keys=True))
  if implementation is None:
    # Backends with a split-KV decoding forward first (Triton's): the training forwards give
    # one program per (batch row, query head) and fill one row of a tile per token.
    implementation = decode.preference_order()
  return _run(call, implementation, None, return_residual, split_kv=True, pages=pages)


def ring_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    axis_name: str,
    layout: str = "contiguous",
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    segment_ids: jax.Array | None = None,
    mask_mod: MaskMod | None = None,
    logits_soft_cap: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    broadcast_dropout: bool = False,
    sinks: jax.Array | None = None,
    q_descale: jax.Array | None = None,
    k_descale: jax.Array | None = None,
    v_descale: jax.Array | None = None,
    out_dtype: jnp.dtype | None = None,
    return_residual: bool = False,
    implementation: Implementation | Sequence[Implementation] | None = None,
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Self-attention over a sequence split along the mesh axis ``axis_name`` (ring attention).

  Call it inside `jax.shard_map`: each device of the axis holds one chunk of the sequence's
  queries, keys and values ([B, C, N, H] and [B, C, K, H], the same C on every device). K/V
  chunks travel around the ring while each device computes its queries' partial results, which
  merge exactly through their LSEs; the backward runs the ring again. The result is what
  `flash_attention` gives on the whole sequence, and no device holds more than two K/V chunks.

  Args:
    query, key, value: this device's chunk, as in `flash_attention` (batched, rank 4).
    axis_name: the mesh axis (of the enclosing `shard_map`) the sequence is split along.
    layout: ``"contiguous"`` (device ``i`` holds tokens ``i*C ... (i+1)*C - 1``) or
      ``"zigzag"`` (the sequence cut into 2R chunks, device ``i`` holds chunks ``i`` and
      ``2R-1-i``: the same causal work on every device; reorder a whole sequence with
      `jaxflash.ops.ring.to_zigzag` / `from_zigzag`; C must be even) or ``"striped"``
      (device ``i`` holds tokens ``i, i+R, i+2R, ...``: the same causal work in one launch
      per step; `to_striped` / `from_striped`; no window and no dropout).
    scale, is_causal, local_window_size, logits_soft_cap, dropout_rate, dropout_rng,
      broadcast_dropout, sinks, return_residual, implementation, interpret: as in
      `flash_attention`; positions (the causal band, windows, dropout) are those of the whole
      sequence, and the sinks join each row's softmax once, after the ring's merge.
    q_descale, k_descale, v_descale, out_dtype: an FP8 call's (float8 chunks), as in
      `flash_attention`, for this device's chunk: per tensor, per (batch row, head), or per
      token ([B, C, N] and [B, C, K]). They may differ between devices (each chunk quantised
      on its own device), and a chunk's key and value factors travel around the ring with it.
      Like FP8 `flash_attention`, such a call has no gradient (prefill of a long context).
    segment_ids: int [B, C], this chunk's segment ids (packed documents); they travel with
      their keys.
    mask_mod: ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` as in `flash_attention`, with
      ``q_idx`` and ``kv_idx`` positions in the *whole* sequence (``batch`` and ``head`` this
      device's). Arrays it closes over (document ids of the whole sequence) are read at those
      positions. Each step builds the block table of its (query chunk, key chunk) pair and
      skips the blocks it hides. Not with ``"striped"`` (a chunk's tokens are not a range of
      positions).
    query_seq_lengths, key_value_seq_lengths: int [B], the valid tokens of each row of the
      *whole* sequence (the same array on every device), as in `flash_attention`: query rows
      past it give zeros, keys past it are masked, wherever the layout put them.

  Returns:
    This device's chunk of the output, like ``query``; with ``return_residual`` also its LSE
    [B, C, N].

  Raises:
    ValueError: a bad argument (as `flash_attention`), ``axis_name`` not bound by an enclosing
      `shard_map`, query and key chunks of different lengths, an odd chunk for ``"zigzag"``,
      or a window, dropout or a ``mask_mod`` with ``"striped"``.
  """
  from jaxflash.ops import ring as ring_op
  if layout not in ring_op.LAYOUTS:
    raise ValueError(f"layout must be one of {ring_op.LAYOUTS}, got {layout!r}")
  try:
    jax.lax.axis_size(axis_name)
  except (NameError, KeyError, TypeError, ValueError) as e:
    raise ValueError(f"axis_name {axis_name!r} is not a mesh axis bound here: call "
                     "ring_attention inside jax.shard_map over that axis") from e
  if jnp.ndim(query) != 4 or jnp.ndim(key) != 4:
    raise ValueError("ring_attention takes batched chunks: query [B, C, N, H] and key/value "
                     f"[B, C, K, H], got query of rank {jnp.ndim(query)} and key of rank "
                     f"{jnp.ndim(key)}")
  # The options flash_attention shares, checked as it checks them; the lengths are the whole
  # sequence's (below).
  call, return_residual = _prepare(
      query, key, value, implementation=implementation, return_residual=return_residual,
      scale=scale, is_causal=is_causal, local_window_size=local_window_size,
      segment_ids=segment_ids, logits_soft_cap=logits_soft_cap, dropout_rate=dropout_rate,
      dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout, sinks=sinks,
      q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
      interpret=interpret)
  chunk = call.inputs.query.shape[1]
  if call.inputs.key.shape[1] != chunk:
    raise ValueError(f"query and key chunks must have the same length, got {chunk} and "
                     f"{call.inputs.key.shape[1]}")
  ring_op.validate(layout, call.params, chunk)
  if mask_mod is not None:
    inputs, params = ring_op.with_mask_mod(call.inputs, call.params, mask_mod, layout)
    call = call._replace(inputs=inputs, params=params)
  b = call.inputs.query.shape[0]
  total = chunk * jax.lax.axis_size(axis_name)
  # (Every pair makes its own block table: the chunk's against itself is of no use.)
  call = call._replace(inputs=call.inputs._replace(lengths=_checks.global_lengths(
      query_seq_lengths, key_value_seq_lengths, b, total), block_table=None),
      params=dataclasses.replace(call.params, query_padding=query_seq_lengths is not None))
  empty = _empty(call.inputs, call.params)
  if empty is not None:
    return _results(*empty, call, return_residual)
  # Each pair of the ring is a partial call with offsets (and a block table where it has
  # segment ids or a mask_mod): the backend must serve those.
  probe = ring_op.probe(call.inputs, call.params, ring_op.parts_of(layout))
  partial_params = dataclasses.replace(call.params, partial=True)
  backend = backends.select(implementation, probe, partial_params)
  config = backend.default_config(probe, partial_params, devices.current())
  ring = ring_op.Ring(axis_name, layout, backend, config)
  out, lse = ring_op.ring_attention(call.inputs, call.params, ring)
  return _results(out, lse, call, return_residual)
