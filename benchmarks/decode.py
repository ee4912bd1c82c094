"""Decoding benchmark: new tokens against a KV cache, in one process per run.

For each cell (batch B, cache length S, new tokens T, heads N/K, head dim D, contiguous or paged
cache), every implementation is checked against a float32 reference on fresh random inputs,
then timed (warm-up, median of repeats). It reports microseconds per call, the effective
bandwidth (bytes of K and V read / time) and its fraction of a measured device-to-device copy
of the same bytes. Every row of the cache is full (kv_lengths = S), so every byte is read.

Implementations:
- ``jaxflash``: `jaxflash.decode_attention` (the backend it picks); ``jaxflash_triton``,
  ``jaxflash_mosaic`` and ``jaxflash_xla`` name one; ``jaxflash_flash``:
  `jaxflash.flash_attention` with ``key_value_seq_lengths`` (T = 1), which routes a call with
  few query rows to the same kernel;
- ``cudnn`` and ``xla``: `jax.nn.dot_product_attention` with ``key_value_seq_lengths``
  (T = 1 only: jax.nn has no causal band shifted to the cache positions);
- ``pallas_decode``: JAX's `jax.experimental.pallas.ops.gpu.decode_attention.gqa` (T = 1).
Paged cells run the jaxflash implementations only, next to the contiguous ones.

  PYTHONPATH=. python benchmarks/decode.py   # -> benchmarks/results/<device>/decode.json, .md, .png
  PYTHONPATH=. python benchmarks/decode.py --batches 1 8 --seqs 4096 32768 --out results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402
from cases import gpu_events, kernel_totals, time_call  # noqa: E402

import jaxflash  # noqa: E402
from jaxflash.ops.decode import gather_pages  # noqa: E402
from jaxflash.reference import reference_attention  # noqa: E402

IMPLS = ("jaxflash", "jaxflash_triton", "jaxflash_mosaic", "jaxflash_xla", "jaxflash_flash",
         "cudnn", "xla", "pallas_decode", "fold_mosaic", "fold_triton")
MAX_CACHE_BYTES = 24 * 2**30  # K and V together; larger cells are skipped


def cache_bytes(b: int, s: int, k: int, d: int, dtype, dv: int | None = None) -> int:
  """Bytes of K and V (V's head dim ``dv``, None: ``d``)."""
  return b * s * k * (d + (d if dv is None else dv)) * jnp.dtype(dtype).itemsize


def make_inputs(b, s, t, n, k, d, dtype, seed: int, page_size: int | None, dv: int | None = None):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, t, n, d), dtype)
  kc = jax.random.normal(keys[1], (b, s, k, d), dtype)
  vc = jax.random.normal(keys[2], (b, s, k, d if dv is None else dv), dtype)
  lengths = jnp.full((b,), s, jnp.int32)
  table = None
  if page_size:
    # Shuffled pages: row r's page p lives at a random place of the pool.
    per_row = s // page_size
    order = np.random.default_rng(seed).permutation(b * per_row)
    table = jnp.asarray(order.reshape(b, per_row), jnp.int32)
    def paged(cache):
      pool = jnp.empty_like(cache.reshape(b * per_row, page_size, k, cache.shape[-1]))
      return pool.at[table.reshape(-1)].set(cache.reshape(pool.shape))
    kc, vc = paged(kc), paged(vc)
  return q, kc, vc, lengths, table


def attention_fn(impl: str, t: int, table, interpret: bool, own_value_dim: bool = False,
                 values_in_keys: bool = False, descales: dict | None = None):
  """A function (q, k_cache, v_cache, lengths) -> out, or None where ``impl`` cannot run this
  cell (``own_value_dim``: V's head dim differs from K's, which only jaxflash takes;
  ``values_in_keys``: jaxflash reads the values from the key cache, ``v_cache`` giving only
  their head dim: `jaxflash.decode_attention`'s ``value_cache=None``; ``descales``: an FP8
  cache's factors, which only `jaxflash.decode_attention` takes)."""
  if (own_value_dim or values_in_keys or descales) and not impl.startswith("jaxflash"):
    return None
  if descales and (impl == "jaxflash_flash" or impl.startswith("fold_")):
    return None
  descales = {name: x for name, x in (descales or {}).items() if x is not None}
  if values_in_keys:
    name = None if impl == "jaxflash" else impl.split("_", 1)[1]
    if name in ("triton", "mosaic"):  # that split-KV kernel, the XLA backend's backward
      name = (name, "xla")
    return lambda q, k, v, lengths: jaxflash.decode_attention(
        q, k, None, lengths, value_head_dim=v.shape[-1], page_table=table,
        implementation=name, interpret=interpret, **descales)
  if impl.startswith("fold_"):
    if table is not None or t != 1:
      return None
    return functools.partial(folded_decode, backend_name=impl.split("_", 1)[1])
  if impl == "jaxflash_flash":  # the routing of `flash_attention`'s few-query calls
    if table is not None or t != 1:
      return None
    return lambda q, k, v, lengths: jaxflash.flash_attention(
        q, k, v, key_value_seq_lengths=lengths, interpret=interpret)
  if impl.startswith("jaxflash"):
    name = None if impl == "jaxflash" else impl.split("_", 1)[1]
    if descales and name == "triton":  # (the split-KV kernel, another backend's training)
      name = ("triton", "xla")
    return lambda q, k, v, lengths: jaxflash.decode_attention(
        q, k, v, lengths, page_table=table, implementation=name, interpret=interpret,
        **descales)
  if table is not None or t != 1:
    return None
  if impl in ("cudnn", "xla"):
    return lambda q, k, v, lengths: jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=lengths, implementation=impl)
  if impl == "pallas_decode":
    from jax.experimental.pallas.ops.gpu import decode_attention as pallas

    return lambda q, k, v, lengths: pallas.gqa(q[:, 0], k, v, kv_seq_len=lengths,
                                               interpret=interpret)[:, None]
  raise ValueError(impl)


def folded_decode(q, kc, vc, lengths, backend_name: str, splits: int | None = None):
  """An experiment: T = 1 decoding as one call of a backend's *training* forward. The cache
  [B, S, K, H] is read as [B * splits, S / splits, K, H] (a free reshape), the G query heads of
  a K/V head become G query rows of that head (all at the same position, so with T = 1 the key
  lengths alone are the causal mask), and the splits' partial results are merged through the
  LSE. Splits: the largest divisor of S up to ``wave_splits``'s count for 128-key blocks."""
  from jax.experimental import pallas as pl
  from jaxflash import _core, backends, devices, masking
  from jaxflash.backends.triton.decode import wave_splits
  from jaxflash.ops import partial
  b, t, n, h = q.shape
  s, kh = kc.shape[1], kc.shape[2]
  g = n // kh
  if splits is None:
    want = wave_splits(pl.cdiv(s, 128), b * kh, devices.current().sm_count)
    splits = max(d for d in range(1, want + 1) if s % d == 0)
  sp = s // splits
  qf = q.reshape(b, kh, g, h).transpose(0, 2, 1, 3)  # [B, G, K, H]: heads of a group as rows
  qf = jnp.broadcast_to(qf[:, None], (b, splits, g, kh, h)).reshape(b * splits, g, kh, h)
  kv_len = jnp.clip(lengths[:, None] - jnp.arange(splits)[None] * sp, 0, sp).reshape(-1)
  lens = jnp.stack([jnp.full_like(kv_len, g), kv_len], axis=1).astype(jnp.int32)
  inputs = _core.Inputs(qf, kc.reshape(b * splits, sp, kh, h), vc.reshape(b * splits, sp, kh, h),
                        lens)
  params = _core.Params(scale=h ** -0.5, window=masking.Window(None, None), partial=True)
  backend = backends.get(backend_name)
  config = backend.default_config(inputs, dataclasses.replace(params, partial=False), devices.current())
  out, lse2 = backend.forward(inputs, params, config)  # [B*sp, G, K, H], [B*sp, K, G]
  outs = out.reshape(b, splits, g, kh, h).transpose(1, 0, 3, 2, 4).reshape(splits, b, 1, n, h)
  lses = _core.user_lse(lse2).reshape(b, splits, kh, g).transpose(1, 0, 2, 3).reshape(
      splits, b, 1, n)
  merged, _ = partial.merge(outs, lses)
  return merged.astype(q.dtype)


REFERENCE_BYTES = 8 * 2**30  # float32 temporaries of one reference chunk of batch rows


def _per_tensor_fp8(x, dtype):
  """``x`` in ``dtype`` (float8) with one descale factor for the whole array."""
  descale = jnp.max(jnp.abs(x.astype(jnp.float32))) / float(jnp.finfo(dtype).max)
  return (x.astype(jnp.float32) / descale).astype(dtype), descale


def _real(q, kc, vc, descales, table):
  """The float32 values an FP8 call's arrays stand for (its arrays as they are otherwise)."""
  if descales is None:
    return q, kc, vc
  def real(x8, d):  # (`dequantize` takes [B, heads] as [B, 1, heads])
    d = jnp.asarray(d)
    return jaxflash.fp8.dequantize(x8, d[:, None] if d.ndim == 2 else d)
  vd = descales["v_descale"]  # (None: the values are the keys', and share their factor)
  return (real(q, descales["q_descale"]), real(kc, descales["k_descale"]),
          real(vc, descales["k_descale"] if vd is None else vd))


@jax.jit
def _reference_rows(q, kc, vc, lengths):
  t, s = q.shape[1], kc.shape[1]
  pos = lengths[:, None, None] - t + jnp.arange(t)[None, :, None]
  mask = (jnp.arange(s)[None, None, :] <= pos)[:, None]
  return reference_attention(q, kc, vc, mask=mask)[0]


def reference(q, kc, vc, lengths, table) -> np.ndarray:
  """float32 decoding reference: the last T positions of causal attention over the cache, a
  chunk of batch rows at a time (the reference repeats K and V to every query head in float32:
  the whole of B = 64, S = 32k at once would take 32 GiB)."""
  if table is not None:
    kc, vc = (gather_pages(x, table, jnp.asarray(lengths, jnp.int32)) for x in (kc, vc))
  b, s = kc.shape[:2]
  n, d = q.shape[2:]
  rows = max(1, REFERENCE_BYTES // (3 * s * n * d * 4))
  return np.concatenate([np.asarray(_reference_rows(*(x[i:i + rows] for x in (q, kc, vc, lengths))))
                         for i in range(0, b, rows)])


def copy_tb_s(nbytes: int, calls: int = 20, steps: int = 1) -> float:
  """Bandwidth of a device-to-device copy of ``nbytes``: an elementwise op on 32-bit words (one
  read and one write of each byte), both counted, as a copy's bandwidth is quoted. A decoding
  kernel only reads, so it can come above 1.0 of it. Timed like the decoding calls: ``calls``
  back-to-back calls a repeat, each of ``steps`` copies in one executable (`in_graph`)."""
  x = jnp.arange(nbytes // 4, dtype=jnp.uint32)
  ms = time_call(jax.jit(in_graph(lambda x: x ^ 1, steps)), (x,), calls=calls) / steps
  return 2 * nbytes / ms / 1e9


def in_graph(fn, steps: int):
  """``steps`` calls of ``fn`` in one executable, one after another, as a model's decoding step
  makes them (a call a layer): timed, a call's GPU time without a host dispatch of its own
  (in a call a repeat of 20 or 200, the host's 70-90 µs to enqueue a Mosaic GPU call is close to
  the 80 µs of GPU work it asks for at 256k cached tokens, and bounds it). Each call's first
  argument goes through an optimization barrier with the last call's output, so XLA can
  neither merge the calls (they read the same arrays) nor run or fuse two at once. ``steps``
  1 is ``fn``."""
  if steps == 1:
    return fn

  def calls(first, *rest):
    outs = []
    for _ in range(steps):
      arg = first if not outs else lax.optimization_barrier((first, outs[-1]))[0]
      outs.append(fn(arg, *rest))
    return outs
  return calls


def run(cfg: dict) -> dict:
  env = report.environment()
  dtype = jnp.dtype(cfg["dtype"])
  rows, copies = [], {}
  grid = itertools.product(cfg["batches"], cfg["seqs"], cfg["tokens"], cfg["heads"],
                           cfg["head_dims"], cfg["layouts"])
  for b, s, t, (n, k), d, layout in grid:
    dv = cfg.get("value_dim") or d
    latent = bool(cfg.get("values_in_keys"))
    # (One latent cache: its bytes are the keys' alone.)
    nbytes = (b * s * k * d * dtype.itemsize if latent else cache_bytes(b, s, k, d, dtype, dv))
    if nbytes > MAX_CACHE_BYTES:
      continue
    page_size = cfg["page_size"] if layout == "paged" else None
    quantized = jaxflash.fp8.is_fp8(dtype)
    inputs = make_inputs(b, s, t, n, k, d, jnp.bfloat16 if quantized else dtype, seed=len(rows),
                         page_size=page_size, dv=dv)
    q, kc, vc, lengths, table = inputs
    if latent:  # the values are the keys' first dv features
      vc = kc[..., :dv]
    descales = None
    if quantized:  # an FP8 cache: the query per token; the caches per (batch row, K/V head),
      # or a paged pool per tensor (its pages belong to no batch row); --key-factors token: the
      # contiguous cache's keys per token
      cache_fp8 = functools.partial(_per_tensor_fp8 if table is not None else
                                    jaxflash.quantize_fp8, dtype=dtype)
      q, qd = jaxflash.quantize_fp8(q, block_size=1, dtype=dtype)
      per_token = cfg.get("key_factors") == "token" and table is None and not latent
      kc, kd = (jaxflash.quantize_fp8(kc, block_size=1, dtype=dtype) if per_token
                else cache_fp8(kc))
      vc, vd = (kc[..., :dv], None) if latent else cache_fp8(vc)
      descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    want = (reference(*_real(q, kc, vc, descales, table), lengths, table)
            if cfg["check"] else None)
    if nbytes not in copies:
      copies[nbytes] = copy_tb_s(nbytes, cfg["calls"], cfg.get("steps") or 1)
    copy_tbs = copies[nbytes]
    # (Four significant digits, not three decimals: a tiny cell's copy on a CPU, 16 KiB in the
    # smoke tests, moves well under 0.0005 TB/s, and rounded to 0 it left `of_copy` a division
    # by zero.)
    base = dict(B=b, S=s, T=t, N=n, K=k, D=d, layout=layout, dtype=dtype.name, bytes=nbytes,
                copy_tb_s=float(f"{copy_tbs:.4g}"))
    if dv != d:
      base["Dv"] = dv
    if latent:
      base["values_in_keys"] = True
    prepared = []
    for impl in cfg["impls"]:
      fn = attention_fn(impl, t, table, cfg["interpret"], own_value_dim=dv != d,
                        values_in_keys=latent, descales=descales)
      if fn is not None:
        prepared.append(_prepare(dict(base, impl=impl), fn, (q, kc, vc, lengths), want, cfg))
    if cfg.get("tune") or cfg.get("tune_splits") or cfg.get("candidates"):
      # (Heads wider than Triton's training kernels take reach the split-KV kernel only with
      # implementation=None: `jaxflash.ops.decode.split_kv_path`.)
      tuned = "jaxflash" if max(d, dv) > 256 else "jaxflash_triton"
      prepared += _tune(base, lambda: attention_fn(tuned, t, table, cfg["interpret"], dv != d,
                                                   latent, descales),
                        (q, kc, vc, lengths), want, cfg)
    _time_rounds(prepared, (q, kc, vc, lengths), cfg)
    for row, _ in prepared:
      rows.append(row)
      print(_line(row) + (f" {row['tune']}" if "tune" in row else ""), file=sys.stderr,
            flush=True)
    timed = [row for row, _ in prepared if "tune" in row and "us" in row]
    if timed:
      best = min(timed, key=lambda r: r["us"])
      print(f"best {_line(best)} {best['tune']}", file=sys.stderr, flush=True)
  return dict(environment=env, config=cfg, rows=rows)


def _prepare(row: dict, fn, args, want, cfg: dict):
  """``(row, compiled fn)``: ``row`` with the relative error of ``fn`` against ``want``, or
  "failed" (why) and no function."""
  try:
    compiled = jax.jit(fn).lower(*args).compile()
    out = np.asarray(compiled(*args), np.float32)
    if want is not None:
      row["error"] = float(np.linalg.norm(out - want) / np.linalg.norm(want))
      if not row["error"] < cfg["tolerance"]:
        row["failed"] = f"relative error {row['error']:.3g}"
    if (cfg.get("steps") or 1) > 1 and "failed" not in row:  # timed as a step's calls (`in_graph`)
      row["steps"] = cfg["steps"]
      compiled = jax.jit(in_graph(fn, cfg["steps"])).lower(*args).compile()
  except Exception as e:  # noqa: BLE001 - one failing implementation must not end the run
    row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  return row, (None if "failed" in row else compiled)


def _time_rounds(prepared, args, cfg: dict) -> None:
  """Times the prepared implementations of one cell (`_prepare`'s pairs; failed ones are
  skipped) in ``cfg["rounds"]`` interleaved rounds: one timing of each in turn per round, so
  that a drift of the card's clocks or of the host between rounds reaches them all alike. A row
  gets the median of its rounds (``us``; each round in ``us_rounds``), its TB/s and fraction
  of the copy, and with ``cfg["profile"]`` its GPU kernels per call."""
  timed = [(row, compiled) for row, compiled in prepared if compiled is not None]
  for _ in range(cfg.get("rounds") or 1):
    for row, compiled in timed:
      ms = time_call(compiled, args, calls=cfg["calls"], repeats=cfg["repeats"])
      ms /= row.get("steps", 1)
      row.setdefault("us_rounds", []).append(round(ms * 1e3, 2))
  for row, compiled in timed:
    us = float(np.median(row["us_rounds"]))
    tb_s = row["bytes"] / us / 1e6
    row.update(us=round(us, 2), tb_s=round(tb_s, 3), of_copy=round(tb_s / row["copy_tb_s"], 3))
    if cfg.get("profile"):  # where a call's GPU time goes: the attention kernel and the rest
      events = [e for plane in gpu_events(compiled, args, 5).values() for e in plane]
      calls = 5 * row.get("steps", 1)  # (of `fn`: the executable's 5 calls, `steps` each)
      row["kernels"] = [dict(k, us=round(k["us"], 2))
                        for k in kernel_totals(events, calls, width=60)]
      if events:  # the traced calls' GPU time from first start to last end, per call: above
        # the kernels' sum by the GPU's idle gaps between them
        row["gpu_span_us"] = round((max(e[1] for e in events) - min(e[0] for e in events))
                                   / calls / 1e3, 2)
        # Two calls' kernels and copies in order: start after the first's start, and length
        # (µs), so the idle gaps show where they fall.
        first = events[0][0]
        row["timeline"] = [(name[:48], round((start - first) / 1e3, 2),
                            round((end - start) / 1e3, 2))
                           for start, end, name in events[:2 * len(events) // calls]]


SPLIT_SWEEP_PER_SM = (0.5, 1, 1.5, 2, 2.5, 3, 4, 6, 8)


def _split_candidates(row: dict, sm_count: int):
  """The shipped tiles (64-key blocks, 4 warps, 3 stages up to D = 64, else 2) with split
  counts for 0.5 to 8 programs per SM (`SPLIT_SWEEP_PER_SM`): how the split count's wave
  quantization moves a cell, with nothing else changed."""
  from jax.experimental import pallas as pl
  from jaxflash.schedule import used_splits
  blocks = pl.cdiv(row["S"], 64)  # (on either layout: a paged cache's blocks are 64 keys too)
  seen = set()
  for per_sm in SPLIT_SWEEP_PER_SM:  # (2: the rule shipped before `wave_splits`)
    splits = used_splits(blocks, math.ceil(per_sm * sm_count / (row["B"] * row["K"])))
    if splits not in seen:
      seen.add(splits)
      yield dict(block_k=64, num_warps=4, num_stages=3 if row["D"] <= 64 else 2, splits=splits)


def _tune_candidates(row: dict, sm_count: int):
  """`DecodeConfig` fields to try for one cell: key blocks of 64 and 128, 4 warps, 2 to 4
  stages, and splits for 1, 2 or 4 programs per SM; then 8 warps at 3 stages and 2 programs per
  SM."""
  from jax.experimental import pallas as pl
  block_ks = (64, 128)
  seen = set()
  grid = list(itertools.product(block_ks, (4,), (2, 3, 4), (1, 2, 4)))
  grid += [(block_k, 8, 3, 2) for block_k in block_ks]
  for block_k, warps, stages, per_sm in grid:
    blocks = pl.cdiv(row["S"], block_k)
    splits = max(1, min(blocks, pl.cdiv(per_sm * sm_count, row["B"] * row["K"])))
    fields = dict(block_k=block_k, num_warps=warps, num_stages=stages, splits=splits)
    if tuple(fields.values()) not in seen:
      seen.add(tuple(fields.values()))
      yield fields


def _given_candidates(given: list[dict]):
  """`--candidates`: these `DecodeConfig` fields in every cell, on top of the shipped config. A
  candidate that changes the heads per program or the key blocks but names no ``splits`` gets
  `wave_splits`'s count (2 to 4 programs per SM) for its programs and key blocks (64 keys
  unless it names others, on either layout: a paged cache's blocks are not its pages); any
  other keeps the shipped config's count."""
  def candidates(row: dict, sm_count: int):
    from jax.experimental import pallas as pl
    from jaxflash.backends.triton.decode import wave_splits
    for fields in given:
      fields = dict(fields)
      if "splits" not in fields and ("heads" in fields or "block_k" in fields):
        fields["splits"] = wave_splits(pl.cdiv(row["S"], fields.get("block_k", 64)),
                                       row["B"] * row["K"] // fields.get("heads", 1), sm_count)
      yield fields
  return candidates


def _tune(base: dict, make_fn, args, want, cfg: dict) -> list:
  """`_prepare`'s pairs for the Triton split-KV kernel (impl "tune") with each candidate config
  in turn (`jaxflash.backends.triton.decode.default_config` patched to return it while it
  compiles), to be timed with the cell's other rows. ``make_fn`` makes a new function each
  time: jit would reuse the trace of one it has seen."""
  from jaxflash import devices
  from jaxflash.backends.mosaic import decode as mosaic_kernel
  from jaxflash.backends.triton import decode as kernel
  shipped, mosaic_shipped = kernel.default_config, mosaic_kernel.default_config
  prepared = []
  cell = dict(base, page_size=cfg["page_size"])
  try:
    candidates = (_given_candidates(cfg["candidates"]) if cfg.get("candidates") else
                  _split_candidates if cfg.get("tune_splits") else _tune_candidates)
    for fields in candidates(cell, devices.current().sm_count):
      if cfg.get("candidates"):  # given fields change the shipped config, and nothing else
        # (of the kernel the call routes to: each takes the fields that are its own)
        def own(config_type, f=fields) -> dict:
          names = {x.name for x in dataclasses.fields(config_type)}
          return {k: v for k, v in f.items() if k in names}

        kernel.default_config = lambda inputs, training, device, f=own(
            kernel.DecodeConfig), **kw: dataclasses.replace(
                shipped(inputs, training, device, **kw), **f)
        mosaic_kernel.default_config = lambda inputs, training, device, f=own(
            mosaic_kernel.MlaDecodeConfig), **kw: dataclasses.replace(
                mosaic_shipped(inputs, training, device, **kw), **f)
      else:
        kernel.default_config = lambda inputs, training, device, f=fields, **kw: (
            kernel.DecodeConfig(training=training, **f))
      prepared.append(_prepare(dict(base, impl="tune", tune=fields), make_fn(), args, want, cfg))
  finally:
    kernel.default_config, mosaic_kernel.default_config = shipped, mosaic_shipped
  return prepared


def _line(r: dict) -> str:
  cell = (f"B={r['B']} S={r['S']} T={r['T']} N/K={r['N']}/{r['K']} D={report.decode_dims(r)} "
          f"{r['layout']:10} {r['impl']:16}")
  if "failed" in r:
    return f"{cell} FAILED {r['failed']}"
  kernels = "".join(f"\n    {k['us']:9.1f} us x{k['count']:g} {k['name']}"
                    for k in r.get("kernels", []))
  if "gpu_span_us" in r:
    kernels += f"\n    {r['gpu_span_us']:9.1f} us GPU span per traced call"
  kernels += "".join(f"\n      at {at:8.2f} for {us:7.2f} us {name}"
                     for name, at, us in r.get("timeline", []))

  return (f"{cell} {r['us']:9.1f} us {r['tb_s']:6.2f} TB/s ({r['of_copy']:.2f} of copy, "
          f"{r['copy_tb_s']:.2f} TB/s){kernels}")


def speedup(ours: dict, theirs: dict) -> tuple[float, float, float] | None:
  """``theirs`` µs over ``ours`` µs, round by round (the rounds were interleaved, so each pair
  saw the same state of the card): (median, min, max), or None without timings."""
  if "us_rounds" not in ours or "us_rounds" not in theirs:
    return None
  ratios = [b / a for a, b in zip(ours["us_rounds"], theirs["us_rounds"])]
  return float(np.median(ratios)), min(ratios), max(ratios)


def table(rows: list[dict]) -> str:
  """Markdown: one line per cell, TB/s per implementation (fraction of copy in brackets), and
  where both ran, cuDNN's time over jaxflash's (`speedup`: median round, and the range)."""
  impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
  versus = "jaxflash" in impls and "cudnn" in impls
  def key(r):
    return r["B"], r["S"], r["T"], r["N"], r["K"], report.decode_dims(r), r["layout"]

  cells = sorted({key(r) for r in rows})
  lines = ["| B | S | T | N/K | D | layout | " + " | ".join(impls) +
           (" | cuDNN ÷ jaxflash |" if versus else " |"),
           "|" + "---|" * (6 + len(impls) + versus)]
  for cell in cells:
    found = {r["impl"]: r for r in rows if key(r) == cell}
    values = []
    for impl in impls:
      r = found.get(impl)
      values.append("" if r is None else "failed" if "failed" in r
                    else f"{r['tb_s']:.2f} ({r['of_copy']:.2f})")
    if versus:
      ratio = speedup(found.get("jaxflash", {}), found.get("cudnn", {}))
      values.append("" if ratio is None else f"{ratio[0]:.3f} ({ratio[1]:.3f}–{ratio[2]:.3f})")
    b, s, t, n, k, dims, layout = cell
    lines.append(f"| {b} | {s} | {t} | {n}/{k} | {dims} | {layout} | " + " | ".join(values)
                 + " |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
  parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 32768, 131072])
  parser.add_argument("--tokens", type=int, nargs="+", default=[1], help="new tokens T")
  parser.add_argument("--heads", nargs="+", default=["32/8"], help="N/K pairs, e.g. 32/8 32/32")
  parser.add_argument("--head-dims", type=int, nargs="+", default=[128])
  parser.add_argument("--value-dim", type=int,
                      help="V's head dim where it differs from K's (DeepSeek's absorbed MLA: "
                           "--head-dims 576 --value-dim 512); only jaxflash runs such cells")
  parser.add_argument("--values-in-keys", action="store_true",
                      help="one latent cache whose first --value-dim features are the values "
                           "(decode_attention's value_cache=None): its bytes are the keys'")
  parser.add_argument("--layouts", nargs="+", choices=("contiguous", "paged"),
                      default=["contiguous", "paged"])
  parser.add_argument("--page-size", type=int, default=64)
  parser.add_argument("--impls", nargs="+", choices=IMPLS,
                      default=["jaxflash", "cudnn", "xla", "pallas_decode"])
  parser.add_argument("--dtype", default="bfloat16",
                      choices=("bfloat16", "float16", "float32", "float8_e4m3fn"),
                      help="the cache's (float8_e4m3fn: an FP8 query and cache with descales)")
  parser.add_argument("--key-factors", default="head", choices=("head", "token"),
                      help="an FP8 contiguous cache's key factors: per (batch row, K/V head), or "
                           "per token ([B, S, K], 4 bytes a token and head more, not counted in "
                           "the cache's bytes); a paged pool's are per tensor either way")
  parser.add_argument("--calls", type=int, default=20,
                      help="back-to-back calls a timing repeat (the copy's too)")
  parser.add_argument("--steps", type=int, default=1,
                      help="calls in one executable (`in_graph`: a model's decoding step, no "
                           "host dispatch a call), the copy's too; 1: each call its own")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--rounds", type=int, default=1,
                      help="interleaved rounds per cell: each implementation timed once per "
                           "round, in turn; rows report the median round")
  parser.add_argument("--tolerance", type=float, default=2e-2)
  parser.add_argument("--no-check", dest="check", action="store_false")
  parser.add_argument("--interpret", action="store_true", help="Pallas in interpret mode (CPU)")
  parser.add_argument("--smoke", action="store_true",
                      help="a tiny grid that runs anywhere (a CPU test of this script)")
  parser.add_argument("--tune", action="store_true",
                      help="also time the Triton split-KV kernel with each candidate config")
  parser.add_argument("--tune-splits", action="store_true",
                      help="also time the shipped tiles with split counts for 0.5 to 8 "
                           "programs per SM (wave quantization)")
  parser.add_argument("--candidates", type=json.loads, metavar="JSON",
                      help='also time the shipped config with these DecodeConfig fields changed, '
                           'in every cell, e.g. \'[{"block_k": 128, "num_stages": 4}]\' '
                           '(splits: the shipped count, or wave_splits\' for a given block_k)')
  parser.add_argument("--profile", action="store_true",
                      help="also record each timed row's GPU kernels (a jax.profiler trace)")
  parser.add_argument("--out", help="results JSON (default results/<device>/decode.json); a .md "
                      "table and a .png are written next to it")
  args = parser.parse_args(argv)
  cfg = dict(vars(args))
  cfg["heads"] = [tuple(int(x) for x in pair.split("/")) for pair in args.heads]
  if args.smoke:
    cfg.update(batches=[2], seqs=[128], tokens=[1, 3], heads=[(4, 2)], head_dims=[32],
               page_size=32, calls=2, repeats=1, dtype="float32", tolerance=1e-3,
               impls=[i for i in args.impls if i in ("jaxflash", "xla")])
  for s in cfg["seqs"]:
    if "paged" in cfg["layouts"] and s % cfg["page_size"]:
      parser.error(f"--page-size {cfg['page_size']} must divide every --seqs value ({s})")
  result = run(cfg)
  text = table(result["rows"])
  print(text)
  out = Path(args.out) if args.out else report.default_out(result["environment"], "decode")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1, default=str))
  out.with_suffix(".md").write_text(
      f"Decoding, {result['environment']['device']}, jax {result['environment']['jax']}, "
      f"{result['environment']['date']}: TB/s of K and V read (fraction of a measured "
      f"copy)\n\n{text}\n")
  try:
    import plot
  except ImportError as e:
    print(f"no plot: {e}", file=sys.stderr)
  else:
    plot.plot_decode(result, out.with_suffix(""))
  failed = [r for r in result["rows"] if "failed" in r]
  if failed and args.smoke:
    raise SystemExit(f"{len(failed)} failed: {failed[:3]}")


if __name__ == "__main__":
  main()
