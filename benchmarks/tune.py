"""Tile tuning (`bench.py --tune`): times candidate tiles at S = 4k in bf16, passing each
candidate as a config (nothing is patched). The Triton backend's forward and backward tiles, and
the Mosaic GPU forward's key block and pipeline depth, for whichever of the two ``--impls``
names (both by default on a GPU)."""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp

from jaxflash import devices
from jaxflash.backends import mosaic, triton

from cases import Case, attention_fn, causal_modes, flops, grad_fn, make_inputs, time_call


def tune(cfg: dict) -> list[dict]:
  """The tuning rows of every tunable backend among ``cfg["impls"]``."""
  rows = []
  if "jaxflash_triton" in cfg["impls"]:
    rows += tune_triton(cfg)
  if "jaxflash_mosaic" in cfg["impls"]:
    families = cfg.get("tune_families") or FORWARD_FAMILIES
    if set(families) - set(BACKWARD_FAMILIES):
      rows += tune_mosaic(cfg)
    if "backward" in families:
      rows += tune_mosaic_backward(cfg)
    elif "one_pass" in families:
      rows += tune_mosaic_backward(cfg, one_pass_only=True)
  return rows


def _time(kind, fn, case, inputs) -> tuple[float | None, float | None, str | None]:
  """(ms, TFLOP/s, error) of ``fn``'s forward (kind "fwd"...) or forward+backward."""
  q, k, v, d_out = inputs
  try:
    if kind.endswith("fwd"):
      f, args, mode = jax.jit(fn), (q, k, v), "fwd"
    else:
      f, args, mode = jax.jit(grad_fn(fn)), (q, k, v, d_out), "fwdbwd"
    ms = time_call(f, args, calls=10, repeats=3)
  except Exception as e:  # noqa: BLE001 - configs that do not fit are skipped
    return None, None, repr(e)[:200]
  return ms, flops(case.b, case.n, case.s, case.d, case.causal, mode) / (ms * 1e-3) / 1e12, None


SEQS = [4096]  # the tuning cells' sequence length unless --seqs names others


def _seqs(cfg: dict) -> list[int]:
  return cfg.get("tune_seqs") or SEQS


def _cases(cfg: dict):
  """(head dim, causal, case, inputs) of each tuning cell: bf16, the bands of ``--causal``, at
  each of `_seqs`."""
  for s in _seqs(cfg):
    for d in cfg["head_dims"]:
      b, n = max(1, cfg["tokens"] // s), cfg["hidden"] // d
      for causal in causal_modes(cfg):
        case = Case("bf16", b, s, n, n, d, causal)
        yield d, causal, case, make_inputs(case, 0)


# The families of Mosaic candidates `--tune-families` can pick (all by default).
# The forward's families, timed by default; "backward" (forward+backward with each backward
# tile set) and "one_pass" (the shipped backward and the one-pass candidates only) when named.
FORWARD_FAMILIES = ("tiles", "persistent", "overlap", "order", "persistent_ctas", "q_buffers")
BACKWARD_FAMILIES = ("backward", "one_pass")
MOSAIC_FAMILIES = FORWARD_FAMILIES + BACKWARD_FAMILIES


def _mosaic_candidates(d: int, causal: bool, kind: str, families=FORWARD_FAMILIES):
  """The Mosaic configs that fit, by family: one CTA per query tile ("tiles") and a persistent
  grid ("persistent") for each (K/V tile, ring depth) pair; the intra-warpgroup overlap
  ("overlap") with 64- and 128-key tiles (it keeps two P tiles in registers), alone and on a
  persistent grid; with a causal band, the default config in natural order ("order"); and
  persistent grids with two Q buffers ("q_buffers")."""
  def fitting(*configs):
    return [c for c in configs if mosaic.config.fits(c, d)]

  ctas = mosaic.config.sm_count(kind)
  for block_kv, stages in ((64, 2), (128, 2), (128, 3), (256, 2)):
    plain = mosaic.Config(block_kv=block_kv, num_stages=stages)
    if "tiles" in families:
      yield from fitting(plain)
    if "persistent" in families:
      yield from fitting(dataclasses.replace(plain, persistent_ctas=ctas))
  if "persistent_ctas" in families:  # the default tiles on 1, 2 CTAs per SM, and one per tile
    default = mosaic.default_config(d, jnp.bfloat16, causal, 4096, kind)
    yield from fitting(*(dataclasses.replace(default, persistent_ctas=count)
                         for count in (ctas, 2 * ctas, 1 << 30)))
  if "overlap" in families:
    for block_kv in (64, 128):
      overlap = mosaic.Config(block_kv=block_kv, intra_wg_overlap=True)
      yield from fitting(overlap, dataclasses.replace(overlap, persistent_ctas=ctas))
  if causal and "order" in families:
    default = mosaic.default_config(d, jnp.bfloat16, True, 4096, kind)
    yield dataclasses.replace(default, heavy_first=False)
  if "q_buffers" in families:
    for block_kv in (128, 256):
      yield from fitting(mosaic.Config(block_kv=block_kv, persistent_ctas=ctas, q_buffers=2))


def _label(config) -> tuple:
  """(block_kv, num_stages, heavy_first, persistent CTAs or None, overlap), and Q buffers when
  there are 2: a tuning row's "blocks"."""
  label = (config.block_kv, config.num_stages, config.heavy_first, config.persistent_ctas,
           config.intra_wg_overlap)
  return label + (config.q_buffers,) if config.q_buffers != 1 else label


def _measure(rows: list[dict], kind: str, fn, d: int, causal: bool, case, inputs,
             blocks=None) -> tuple[float | None, str | None]:
  """Times ``fn`` (`_time`), appends its tuning row and returns ``(tflops, error)``."""
  ms, tf, err = _time(kind, fn, case, inputs)
  rows.append(dict(kind=kind, S=case.s, D=d, causal=causal, blocks=blocks, ms=ms, tflops=tf,
                   error=err))
  return tf, err


def _outcome(tflops: float | None, error: str | None) -> str:
  return f"fail {error}" if tflops is None else f"{tflops:.0f} TFLOP/s"


def tune_mosaic(cfg: dict) -> list[dict]:
  """Times the Mosaic forward's candidate configs (`_mosaic_candidates`), and cuDNN's forward on
  the same inputs (rows of kind "cudnn_fwd") as the yardstick of each cell."""
  rows = []
  kind = devices.current().kind
  families = cfg.get("tune_families") or FORWARD_FAMILIES
  for d, causal, case, inputs in _cases(cfg):
    cudnn_tf, err = _measure(rows, "cudnn_fwd", attention_fn("cudnn", causal), d, causal, case,
                             inputs)
    print(f"tune S={case.s} D={d} causal={causal} cuDNN fwd: {_outcome(cudnn_tf, err)}",
          file=sys.stderr, flush=True)
    seen = set()  # families overlap (the default config is also a tile or persistent candidate)
    for candidate in _mosaic_candidates(d, causal, kind, families):
      blocks = _label(candidate)
      if blocks in seen:
        continue
      seen.add(blocks)
      fn = attention_fn("jaxflash_mosaic", causal, config=candidate)
      tf, err = _measure(rows, "mosaic_fwd", fn, d, causal, case, inputs, blocks)
      ratio = f" ({tf / cudnn_tf:.3f}x cuDNN)" if tf and cudnn_tf else ""
      print(f"tune S={case.s} D={d} causal={causal} mosaic fwd (block_kv, stages, heavy_first, "
            f"persistent, overlap[, q_buffers])={blocks}: {_outcome(tf, err)}{ratio}",
            file=sys.stderr, flush=True)
  return rows


def _backward_candidates(d: int, one_pass_only: bool = False):
  """The Mosaic backward's tiles that fit (`mosaic.Backward`); None stands for the Triton
  backward. With ``one_pass_only``: the shipped default and the one-pass candidates."""
  if one_pass_only:
    yield mosaic.config.BACKWARD_TUNED.get(mosaic.config.padded_head_dim(d), mosaic.Backward())
  else:
    yield None
  if d <= 128:
    # One pass (dQ from the dK/dV kernel, `Backward.one_pass`): 64-row query tiles at D = 128,
    # 128-row ones at D = 64 (`mosaic.config.dq_split`), at either register split.
    block_q = 64 if d > 64 else 128
    for stages in (2, 3):
      for registers in (232, 240):
        backward = mosaic.Backward(dkv_block_q=block_q, dq_block_kv=block_q, dkv_stages=stages,
                                   registers=registers, one_pass=True)
        if mosaic.config.backward_smem_bytes(backward, d) <= mosaic.config.SMEM_BUDGET:
          yield backward
    if one_pass_only:
      return
    tiles = [(64, 2, 64, 2), (64, 2, 64, 3), (64, 2, 128, 2), (64, 3, 128, 2)]
    if d <= 64:  # (128-row query tiles in dK/dV spill at D = 128: 0.77x cuDNN at 4k)
      tiles += [(128, 2, 64, 2), (128, 2, 128, 2), (128, 2, 64, 3), (128, 3, 64, 2),
                (128, 3, 128, 2)]
    for dkv_block_q, dkv_stages, dq_block_kv, dq_stages in tiles:
      backward = mosaic.Backward(dkv_block_q=dkv_block_q, dkv_stages=dkv_stages,
                                 dq_block_kv=dq_block_kv, dq_stages=dq_stages)
      if mosaic.config.backward_smem_bytes(backward, d) <= mosaic.config.SMEM_BUDGET:
        yield backward
    return
  if one_pass_only:  # (no one-pass backward above head dim 128)
    return
  # At D = 256 the resident tiles take 128 KiB: 32-row tiles (64, 1, 64, 1 ran 0.68-0.76x cuDNN
  # where these ran 0.93-1.05x, 2026-11-22). The dV pass holds no V: wider tiles there; and 240
  # consumer registers (two kernels spill 280 and 76 bytes at 232).
  tiles = [(32, 2, 32, 2), (64, 2, 64, 2)]
  extra = [{}, dict(dv_block_q=64), dict(registers=240), dict(dv_block_q=64, registers=240),
           dict(dv_block_q=64, dv_stages=1)]
  for dkv_block_q, dkv_stages, dq_block_kv, dq_stages in tiles:
    for fields in extra:
      backward = mosaic.Backward(dkv_block_q=dkv_block_q, dkv_stages=dkv_stages,
                                 dq_block_kv=dq_block_kv, dq_stages=dq_stages, **fields)
      if mosaic.config.backward_smem_bytes(backward, d) <= mosaic.config.SMEM_BUDGET:
        yield backward


def _backward_label(backward, d: int) -> str | tuple:
  """"triton", ("one pass", dkv_block_q, dkv_stages, registers), or (dkv_block_q, dkv_stages,
  dq_block_kv, dq_stages), then the dV pass's tiles and the consumer registers where they differ
  from the defaults."""
  if backward is None:
    return "triton"
  if backward.runs_one_pass(mosaic.config.padded_head_dim(d)):
    return ("one pass", backward.dkv_block_q, backward.dkv_stages, backward.registers)
  label = (backward.dkv_block_q, backward.dkv_stages, backward.dq_block_kv, backward.dq_stages)
  default = mosaic.Backward()
  if (backward.dv_block_q, backward.dv_stages, backward.registers) != (
      default.dv_block_q, default.dv_stages, default.registers):
    label += (backward.dv_block_q, backward.dv_stages, backward.registers)
  return label


def tune_mosaic_backward(cfg: dict, one_pass_only: bool = False) -> list[dict]:
  """Times forward+backward with the default Mosaic forward and each backward candidate
  (`_backward_candidates`), and cuDNN's forward+backward on the same inputs (rows of kind
  "cudnn_fwdbwd") as the yardstick. A row's "blocks" are (dkv_block_q, dkv_stages,
  dq_block_kv, dq_stages), or "triton"."""
  rows = []
  kind = devices.current().kind
  for d, causal, case, inputs in _cases(cfg):
    cudnn_tf, err = _measure(rows, "cudnn_fwdbwd", attention_fn("cudnn", causal), d, causal, case,
                             inputs)
    print(f"tune S={case.s} D={d} causal={causal} cuDNN fwdbwd: {_outcome(cudnn_tf, err)}",
          file=sys.stderr, flush=True)
    default = mosaic.default_config(d, jnp.bfloat16, causal, case.s, kind)
    for backward in _backward_candidates(d, one_pass_only):
      blocks = _backward_label(backward, d)
      fn = attention_fn("jaxflash_mosaic", causal,
                        config=dataclasses.replace(default, backward=backward))
      tf, err = _measure(rows, "mosaic_fwdbwd", fn, d, causal, case, inputs, blocks)
      ratio = f" ({tf / cudnn_tf:.3f}x cuDNN)" if tf and cudnn_tf else ""
      print(f"tune S={case.s} D={d} causal={causal} mosaic fwdbwd backward (dkv_block_q, "
            f"dkv_stages, dq_block_kv, dq_stages[, dv_block_q, dv_stages, registers])="
            f"{blocks}: {_outcome(tf, err)}{ratio}",
            file=sys.stderr, flush=True)
  return rows


def tune_triton(cfg: dict) -> list[dict]:
  """Times candidate Triton tile sizes (forward and backward separately) at S = 4k."""
  fwd_opts = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2),
              (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 3), (64, 64, 8, 2)]
  bwd_opts = [(64, 64, 4, 2), (64, 64, 8, 2), (64, 128, 8, 2), (128, 64, 8, 2), (32, 64, 4, 2),
              (64, 32, 4, 2), (128, 128, 8, 1), (32, 32, 4, 2), (64, 64, 4, 1), (32, 64, 8, 1)]
  rows = []
  for d, causal, case, inputs in _cases(cfg):
    base = triton.default_config(d, jnp.bfloat16, causal, case.s, devices.current().kind)
    for kind, opts in (("fwd", fwd_opts), ("bwd", bwd_opts)):
      for opt in opts:
        tiles = triton.Tiles(block_q=opt[0], block_k=opt[1], num_warps=opt[2],
                             num_stages=opt[3])
        candidate = dataclasses.replace(base, **{"forward" if kind == "fwd" else "backward":
                                                 tiles})
        fn = attention_fn("jaxflash_triton", causal, config=candidate)
        tf, _ = _measure(rows, kind, fn, d, causal, case, inputs, opt)
        print(f"tune S={case.s} D={d} causal={causal} {kind} {opt}: "
              f"{'fail' if tf is None else f'{tf:.0f} TFLOP/s'}", file=sys.stderr, flush=True)
  return rows


def print_tune(cfg: dict, rows: list[dict]) -> None:
  for s in _seqs(cfg):
    for d in cfg["head_dims"]:
      for causal in (False, True):
        for kind in ("fwd", "bwd", "mosaic_fwd", "cudnn_fwd", "mosaic_fwdbwd",
                     "cudnn_fwdbwd"):
          ok = [r for r in rows if (r["S"], r["D"], r["causal"], r["kind"]) == (s, d, causal, kind)
                and r["tflops"]]
          best = max(ok, key=lambda r: r["tflops"]) if ok else None
          if not any(r["kind"] == kind for r in rows):
            continue
          print(f"best S={s} D={d} causal={causal} {kind}: "
                f"{best and best['blocks']} {best and round(best['tflops'])} TFLOP/s")
