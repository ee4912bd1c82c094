"""Several GPUs: a batch-sharded attention step against one device's share, and ring attention.

The batch of a training step is split over every device of a 1-D mesh ("b"). For each
implementation and mesh kind (`AxisType.Auto`, `AxisType.Explicit`), the script checks the
sharded forward+backward against the same call on one device (float32 reference of the
share on device 0), counts the collectives in the compiled program, then times it (warm-up,
median of repeats) next to one device running only its share (B / devices rows), the time a
perfect split would take. It also runs the call inside `jax.shard_map` with ``check_vma=True``,
and ring attention (`jaxflash.ring_attention`, the sequence split over every device) against
one device computing the whole sequence.

Implementations: ``jaxflash`` (the backend `flash_attention` picks), ``jaxflash_triton`` and
``jaxflash_xla`` (one named), ``cudnn`` and ``xla`` (`jax.nn.dot_product_attention`). The smoke
run uses jaxflash's XLA backend: Pallas's interpreter cannot run inside shard_map with
``check_vma=True``.

  PYTHONPATH=. python benchmarks/multi_gpu.py   # -> benchmarks/results/<device>/multi_gpu_<n>.json
  PYTHONPATH=. python benchmarks/multi_gpu.py --smoke --out /tmp/m.json   # 4 fake CPU devices
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv and "device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases  # noqa: E402
import report  # noqa: E402

import jaxflash  # noqa: E402

IMPLS = ("jaxflash", "jaxflash_triton", "jaxflash_xla", "cudnn", "xla")
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def attention_fn(impl: str, causal: bool, interpret: bool):
  if impl.startswith("jaxflash"):
    name = None if impl == "jaxflash" else impl.split("_", 1)[1]
    return lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=causal,
                                                    implementation=name, interpret=interpret)
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                      implementation=impl)


def step_fn(attn):
  """(q, k, v, d_out) -> (dq, dk, dv): forward and backward, the cotangent given (sharded like
  the output), so that no loss reduction adds a collective of its own."""
  def step(q, k, v, d_out):
    _, vjp = jax.vjp(attn, q, k, v)
    return vjp(d_out)
  return step


def make_inputs(b, t, n, d, dtype, seed):
  keys = jax.random.split(jax.random.key(seed), 4)
  return tuple(jax.random.normal(kk, (b, t, n, d), jnp.float32).astype(dtype) for kk in keys)


def collectives(compiled) -> list[str]:
  text = compiled.as_text()
  return [c for c in COLLECTIVES if c in text]


def run(cfg: dict) -> dict:
  devices = jax.devices()
  count = len(devices)
  b = cfg["per_device_batch"] * count
  t, n, d = cfg["seq"], cfg["heads"], cfg["head_dim"]
  dtype = jnp.dtype(cfg["dtype"])
  interpret = jax.default_backend() == "cpu"
  args = make_inputs(b, t, n, d, dtype, seed=0)
  share = tuple(x[:cfg["per_device_batch"]] for x in args)
  # The float32 reference of batch row 0 (its gradients), once: dense, so one row at a time.
  ref_step = jax.jit(step_fn(attention_fn("xla", cfg["causal"], False)))
  want = [np.asarray(g, np.float32) for g in
          ref_step(*(x[:1].astype(jnp.float32) for x in share))]
  rows = []
  for impl in cfg["impls"]:
    if interpret and impl == "cudnn":
      continue
    step = jax.jit(step_fn(attention_fn(impl, cfg["causal"], interpret)))
    try:
      alone_ms = cases.time_call(step, share, calls=cfg["calls"], repeats=cfg["repeats"])
    except Exception as e:  # e.g. dense XLA out of memory: a result, not the end of the run
      rows.append(dict(impl=impl, mesh="one share", failed=f"{type(e).__name__}: "
                       f"{str(e)[:300]}"))
      continue
    for kind in cfg["mesh_kinds"]:
      row = dict(impl=impl, mesh=kind, devices=count, B=b, T=t, N=n, D=d,
                 causal=cfg["causal"], dtype=str(dtype), one_share_ms=alone_ms)
      mesh = jax.make_mesh((count,), ("b",), axis_types=(getattr(AxisType, kind),))
      try:
        with jax.set_mesh(mesh):
          sharded = tuple(jax.device_put(x, NamedSharding(mesh, P("b"))) for x in args)
          compiled = step.lower(*sharded).compile()
          row["collectives"] = collectives(compiled)
          grads = compiled(*sharded)
          row["grad_spec"] = str(grads[0].sharding.spec)
          row["max_rel_err"] = max(cases.relerr(np.asarray(g, np.float32)[:1], w)
                                   for g, w in zip(grads, want))
          row["sharded_ms"] = cases.time_call(compiled, sharded, calls=cfg["calls"],
                                              repeats=cfg["repeats"])
        row["ratio_to_share"] = row["sharded_ms"] / alone_ms
      except Exception as e:  # a failing implementation is a result, not the end of the run
        row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
      rows.append(row)
    if impl.startswith("jaxflash"):
      rows.append(_shard_map_row(impl, cfg, args, want, interpret))
  return dict(environment=report.environment(), config=cfg, rows=rows)


def _shard_map_row(impl, cfg, args, want, interpret) -> dict:
  """The step inside jax.shard_map (check_vma=True), batch split over the devices."""
  count = len(jax.devices())
  mesh = jax.make_mesh((count,), ("b",), axis_types=(AxisType.Explicit,))
  row = dict(impl=impl, mesh="shard_map", devices=count)
  try:
    fn = jax.jit(jax.shard_map(step_fn(attention_fn(impl, cfg["causal"], interpret)),
                               mesh=mesh, in_specs=P("b"), out_specs=P("b")))
    with jax.set_mesh(mesh):
      sharded = tuple(jax.device_put(x, NamedSharding(mesh, P("b"))) for x in args)
      grads = fn(*sharded)
      row["max_rel_err"] = max(cases.relerr(np.asarray(g, np.float32)[:1], w)
                               for g, w in zip(grads, want))
      row["sharded_ms"] = cases.time_call(fn, sharded, calls=cfg["calls"],
                                          repeats=cfg["repeats"])
  except Exception as e:
    row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
  return row


def _ring_step(mesh, layout: str, causal: bool, with_out: bool):
  """jit(shard_map) of one ring call's forward+backward over mesh axis "sp": (q, k, v, d_out)
  chunks -> (dq, dk, dv), with the output first when ``with_out``."""
  interpret = jax.default_backend() == "cpu"

  def local(q, k, v, d_out):
    out, vjp = jax.vjp(lambda q, k, v: jaxflash.ring_attention(
        q, k, v, axis_name="sp", layout=layout, is_causal=causal,
        implementation="xla" if interpret else None, interpret=interpret), q, k, v)
    return ((out,) if with_out else ()) + vjp(d_out)

  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(None, "sp"),
                               out_specs=P(None, "sp")))


def _ring_args(mesh, layout: str, xs):
  """The whole-sequence arrays ``xs`` in ``layout``, each device holding its chunk."""
  from jaxflash.ops import ring
  count = mesh.shape["sp"]
  return tuple(jax.device_put(ring.to_layout(x, layout, count), NamedSharding(mesh, P(None, "sp")))
               for x in xs)


def ring_rows(cfg: dict) -> list[dict]:
  """Ring attention over every device (axis "sp"), one sequence of devices x chunk tokens,
  forward+backward: checked against jaxflash on the whole sequence on one device, then timed
  next to it. ``efficiency`` = (one device on the whole sequence / devices) / ring time: 1.0
  is a perfect split of the work (communication hidden, no load imbalance)."""
  from jaxflash.ops import ring
  count = len(jax.devices())
  interpret = jax.default_backend() == "cpu"
  impl = "xla" if interpret else None
  mesh = jax.make_mesh((count,), ("sp",), axis_types=(AxisType.Explicit,))
  rows = []
  for chunk in cfg["ring_chunks"]:
    total = chunk * count
    q, k, v, d_out = make_inputs(1, total, cfg["heads"], cfg["head_dim"],
                                 jnp.dtype(cfg["dtype"]), seed=1)
    for causal in cfg.get("ring_causal", (False, True)):
      layouts = cfg.get("ring_causal_layouts", ["zigzag"]) if causal else ["contiguous"]
      base = dict(kind="ring", causal=causal, devices=count, chunk=chunk, T=total,
                  N=cfg["heads"], D=cfg["head_dim"], dtype=cfg["dtype"])
      try:  # one whole-sequence reference (values, time, trace) for every layout
        whole = jax.jit(step_fn(lambda q, k, v: jaxflash.flash_attention(
            q, k, v, is_causal=causal, implementation=impl, interpret=interpret)))
        want = [np.asarray(g, np.float32) for g in whole(q, k, v, d_out)]
        base["whole_one_device_ms"] = cases.time_call(
            whole, (q, k, v, d_out), calls=cfg["calls"], repeats=cfg["repeats"])
        if cfg.get("ring_profile") and not interpret:
          base["whole_span_ms"] = ring_profile(whole, (q, k, v, d_out))["span_ms"]
      except Exception as e:
        rows += [dict(base, layout=layout, failed=f"{type(e).__name__}: {str(e)[:300]}")
                 for layout in layouts]
        continue
      for layout in layouts:
        row = dict(base, layout=layout)
        try:
          fn = _ring_step(mesh, layout, causal, with_out=False)
          with jax.set_mesh(mesh):
            args = _ring_args(mesh, layout, (q, k, v, d_out))
            grads = fn(*args)
            row["max_rel_err"] = max(
                cases.relerr(np.asarray(ring.from_layout(np.asarray(g, np.float32), layout,
                                                         count)), w)
                for g, w in zip(grads, want))
            row["ring_ms"] = cases.time_call(fn, args, calls=cfg["calls"],
                                             repeats=cfg["repeats"])
          row["efficiency"] = row["whole_one_device_ms"] / count / row["ring_ms"]
          if "whole_span_ms" in row:
            row["profile"] = ring_profile(fn, args)
            row["span_efficiency"] = (row["whole_span_ms"] / count
                                      / max(row["profile"]["device_spans_ms"].values()))
        except Exception as e:
          row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
  return rows


def longest_rows(cfg: dict) -> list[dict]:
  """The longest sequences: a causal ring call of ``total`` tokens over every device (the first
  of ``ring_causal_layouts``), forward+backward, too long for a whole-sequence reference.
  Checked on sampled query rows against a float32 reference of those rows over all their keys,
  gradients checked to be finite; timed; each device's peak memory."""
  from jaxflash.ops import ring
  count = len(jax.devices())
  mesh = jax.make_mesh((count,), ("sp",), axis_types=(AxisType.Explicit,))
  rows = []
  layout = cfg.get("ring_causal_layouts", ["zigzag"])[0]
  for total in cfg["ring_longest"]:
    row = dict(kind="longest", layout=layout, causal=True, devices=count,
               chunk=total // count, T=total, N=cfg["heads"], D=cfg["head_dim"],
               dtype=cfg["dtype"])
    try:
      q, k, v, d_out = make_inputs(1, total, cfg["heads"], cfg["head_dim"],
                                   jnp.dtype(cfg["dtype"]), seed=2)
      fn = _ring_step(mesh, layout, True, with_out=True)
      with jax.set_mesh(mesh):
        args = _ring_args(mesh, layout, (q, k, v, d_out))
        del q, d_out
        results = fn(*args)
        tokens = np.array([0, total // 3, total // 2 + 1, total - 1])
        order = np.asarray(ring.layout_order(total, layout, count))
        place = jnp.asarray(np.argsort(order)[tokens])  # where the layout put those tokens
        rows_of = lambda x: np.asarray(x.at[:, place].get(out_sharding=P()), np.float32)  # noqa: E731
        got, q_rows = rows_of(results[0]), rows_of(args[0])
        row["grads_finite"] = all(bool(jnp.isfinite(g).all()) for g in results[1:])
        del results
        row["ring_ms"] = cases.time_call(fn, args, calls=cfg["calls"], repeats=cfg["repeats"])
      row["max_rel_err"] = cases.relerr(got, _rows_reference(q_rows, k, v, tokens))
      row["peak_gib"] = [d.memory_stats()["peak_bytes_in_use"] / 2**30
                         for d in jax.devices() if d.memory_stats()]
    except Exception as e:
      row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
    rows.append(row)
  return rows


def _rows_reference(q, k, v, tokens) -> np.ndarray:
  """Float32 causal attention of query rows ``q`` [1, R, N, H] (tokens ``tokens`` of the
  sequence) over all keys of ``k``, ``v`` (in sequence order)."""
  logits = jnp.einsum("brnh,bsnh->bnrs", q, k.astype(jnp.float32)) / np.sqrt(q.shape[-1])
  visible = jnp.arange(k.shape[1])[None, :] <= jnp.asarray(tokens)[:, None]
  probs = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
  return np.asarray(jnp.einsum("bnrs,bsnh->brnh", probs, v.astype(jnp.float32)))


def ring_profile(fn, args, calls: int = 3) -> dict:
  """Where device 0's time goes in one ring call, from a `jax.profiler` trace: milliseconds per
  call of the GPU's span (first kernel's start to last one's end), of compute kernels, of NCCL
  kernels (the ring's ppermutes), of NCCL time no compute kernel overlaps (``exposed_comm_ms``)
  and of idle time, and the longest kernels."""
  planes = cases.gpu_events(fn, args, calls)
  events = planes.get("/device:GPU:0", [])
  if not events:
    return {}
  # Every device's span too: the ring runs at the pace of the slowest.
  spans = {name: (max(b for _, b, _ in ev) - ev[0][0]) / 1e6 / calls
           for name, ev in planes.items() if ev}
  is_comm = lambda name: "nccl" in name.lower()  # noqa: E731
  compute = _union([(a, b) for a, b, name in events if not is_comm(name)])
  comm = _union([(a, b) for a, b, name in events if is_comm(name)])
  busy = _union([(a, b) for a, b, _ in events])
  span = max(b for _, b, _ in events) - events[0][0]
  ms = lambda ns: ns / 1e6 / calls  # noqa: E731
  return dict(span_ms=ms(span), compute_ms=ms(_total(compute)), comm_ms=ms(_total(comm)),
              exposed_comm_ms=ms(_total(busy) - _total(compute)),
              idle_ms=ms(span - _total(busy)), device_spans_ms=spans,
              kernels=[dict(name=k["name"], ms=k["us"] / 1e3, count=k["count"])
                       for k in cases.kernel_totals(events, calls)[:12]])


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """Disjoint, sorted intervals covering the same time as ``intervals``."""
  merged: list[list[int]] = []
  for a, b in sorted(intervals):
    if merged and a <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], b)
    else:
      merged.append([a, b])
  return [(a, b) for a, b in merged]


def _total(intervals) -> int:
  return sum(b - a for a, b in intervals)


def ring_table(rows: list[dict]) -> str:
  lines = ["| layout | causal | devices x chunk | ring ms | whole sequence, one device ms | "
           "efficiency | max rel err |", "|---|---|---|---|---|---|---|"]
  for r in (r for r in rows if r.get("kind") != "longest"):
    if "failed" in r:
      lines.append(f"| {r['layout']} | {r['causal']} | {r['devices']} x {r['chunk']} | "
                   f"failed: {r['failed'][:80]} | | | |")
      continue
    lines.append(f"| {r['layout']} | {r['causal']} | {r['devices']} x {r['chunk']} | "
                 f"{r['ring_ms']:.2f} | {r['whole_one_device_ms']:.2f} | {r['efficiency']:.3f}"
                 f" | {r['max_rel_err']:.1e} |")
  for r in (r for r in rows if r.get("kind") == "longest"):
    if "failed" in r:
      lines.append(f"| longest | causal | {r['devices']} x {r['chunk']} | failed: "
                   f"{r['failed'][:80]} | | | |")
      continue
    peak = max(r["peak_gib"], default=float("nan"))
    lines.append(f"| {r['layout']}, longest | True | {r['devices']} x {r['chunk']} | "
                 f"{r['ring_ms']:.1f}"
                 f" | (peak {peak:.1f} GiB per device; gradients finite: "
                 f"{r['grads_finite']}) | | {r['max_rel_err']:.1e} (sampled rows) |")
  profiled = [r for r in rows if r.get("profile")]
  if profiled:
    lines += ["", "Device 0 in one ring call (ms, from a profiler trace; span efficiency: the "
              "same ratio as above, of GPU spans, the slowest device's for the ring):", "",
              "| layout | devices x chunk | GPU span | compute | NCCL | NCCL exposed | idle | "
              "whole sequence span | span efficiency |", "|---|---|---|---|---|---|---|---|---|"]
    for r in profiled:
      p = r["profile"]
      # (Runs before the whole-sequence call was traced too have no span efficiency.)
      whole = f"{r['whole_span_ms']:.2f}" if "whole_span_ms" in r else ""
      efficiency = f"{r['span_efficiency']:.3f}" if "span_efficiency" in r else ""
      lines.append(f"| {r['layout']} | {r['devices']} x {r['chunk']} | {p['span_ms']:.2f} | "
                   f"{p['compute_ms']:.2f} | {p['comm_ms']:.2f} | {p['exposed_comm_ms']:.2f} | "
                   f"{p['idle_ms']:.2f} | {whole} | {efficiency} |")
  return "\n".join(lines)


def table(rows: list[dict]) -> str:
  lines = ["| impl | mesh | sharded ms | one share ms | ratio | collectives | max rel err |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    if r.get("kind") in ("ring", "longest"):
      continue
    if "failed" in r:
      lines.append(f"| {r['impl']} | {r['mesh']} | failed: {r['failed'][:80]} | | | | |")
      continue
    ratio = f"{r['ratio_to_share']:.3f}" if "ratio_to_share" in r else ""
    share = f"{r['one_share_ms']:.3f}" if "one_share_ms" in r else ""
    coll = ", ".join(r.get("collectives", [])) or ("none" if "collectives" in r else "")
    lines.append(f"| {r['impl']} | {r['mesh']} | {r['sharded_ms']:.3f} | {share} | {ratio} | "
                 f"{coll} | {r['max_rel_err']:.1e} |")
  return "\n".join(lines)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--per-device-batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=8192)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--no-causal", dest="causal", action="store_false")
  parser.add_argument("--dtype", default="bfloat16")
  # (Dense XLA is left out by default: at B = 4 x 8192 tokens its logits take tens of GB.)
  parser.add_argument("--impls", nargs="+", choices=IMPLS,
                      default=["jaxflash", "jaxflash_triton", "cudnn"])
  parser.add_argument("--mesh-kinds", nargs="+", choices=("Auto", "Explicit"),
                      default=["Auto", "Explicit"])
  parser.add_argument("--ring-chunks", type=int, nargs="*", default=[16384],
                      help="ring attention: tokens per device (none: skip the ring)")
  parser.add_argument("--ring-causal", nargs="+", choices=("causal", "full"),
                      default=["full", "causal"],
                      help="ring attention: causal (--ring-causal-layouts) and/or full "
                           "(contiguous)")
  parser.add_argument("--ring-causal-layouts", nargs="+", choices=("zigzag", "striped"),
                      default=["zigzag"], help="ring attention: layouts of the causal runs")
  parser.add_argument("--ring-longest", type=int, nargs="*", default=[],
                      help="ring attention: total tokens of causal calls too long for a "
                           "whole-sequence reference (checked on sampled rows)")
  parser.add_argument("--ring-profile", action="store_true",
                      help="ring attention: trace one call and list device 0's time")
  parser.add_argument("--skip-batch", action="store_true",
                      help="ring attention only (no batch-sharded step)")
  parser.add_argument("--calls", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--tolerance", type=float, default=2e-2)
  parser.add_argument("--smoke", action="store_true", help="4 fake CPU devices, a tiny shape")
  parser.add_argument("--out", help="results JSON (default results/<device>/multi_gpu_<n>.json "
                      "for n devices); a .md table is written next to it")
  args = parser.parse_args(argv)
  cfg = dict(vars(args))
  cfg["ring_causal"] = [word == "causal" for word in args.ring_causal]
  if args.smoke:
    cfg.update(per_device_batch=1, seq=64, heads=2, head_dim=16, dtype="float32", calls=1,
               repeats=1, tolerance=1e-4, impls=["jaxflash_xla", "xla"], ring_chunks=[32])
  result = (dict(environment=report.environment(), config=cfg, rows=[]) if args.skip_batch
            else run(cfg))
  result["rows"] += ring_rows(cfg) + longest_rows(cfg)
  text = table(result["rows"]) + "\n\nRing attention, forward+backward:\n\n" + ring_table(
      [r for r in result["rows"] if r.get("kind") in ("ring", "longest")])
  print(text)
  env = result["environment"]
  out = (Path(args.out) if args.out
         else report.default_out(env, f"multi_gpu_{len(jax.devices())}"))
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1, default=str))
  out.with_suffix(".md").write_text(
      f"Batch-sharded attention step, {env['device']} x {len(jax.devices())}, jax "
      f"{env['jax']}, {env['date']}: forward+backward (ms) against one device running its "
      f"share alone\n\n{text}\n")
  bad = [r for r in result["rows"] if "failed" in r or r.get("grads_finite") is False
         or r.get("max_rel_err", 0.0) > cfg["tolerance"]]
  if bad:
    raise SystemExit(f"{len(bad)} rows failed or are wrong: {bad[:3]}")
  return result


if __name__ == "__main__":
  main()
