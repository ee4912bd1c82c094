"""CPU smoke runs of the benchmark commands (benchmarks/*.py, and the development probes under
benchmarks/dev/ that CI keeps working), so that they cannot silently rot between GPU runs, plus
the pieces of their bookkeeping that a smoke run does not reach (device names, where results go,
joined runs, the floor summary, the slow-call timing rule, the progress bar) and the committed
results' shape."""

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# benchmarks/ is a folder of scripts, not a package; its scripts import each other by name.
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
sys.path.insert(1, str(BENCHMARKS / "dev"))

import bench
import masks  # benchmarks/masks.py; examples/ has a masks.py too, see test_example._load_example
import memory
import report
import jaxflash
from jaxflash.backends import mosaic


# The smoke runs of development probes (benchmarks/dev), and the whole-script runs of memory.py,
# masks.py and fp8.py (whose parts and committed tables quicker tests here check), that take
# 6-20 s of a CPU each: like the tile variants, CI and a plain run skip them
# (JAXFLASH_ALL_VARIANTS=1 runs them: before a GPU session that uses one), which CI's 25 minutes
# needed (2026-12-04).
slow_probe = pytest.mark.variants


@slow_probe
def test_atomic_check_smoke(tmp_path):
  """benchmarks/dev/atomic_check.py in the interpreter: the deterministic, atomic and ordered
  backwards against float32 on a tiny shape whose two key tiles both add to each query block."""
  import atomic_check
  out = tmp_path / "atomic.json"
  rows = atomic_check.main(["--smoke", "--out", str(out)])
  assert [r["variant"] for r in rows] == ["deterministic", "atomic", "ordered_one_pass"]
  assert all(r["ok"] for r in rows), rows
  assert json.loads(out.read_text())["rows"] == rows


def test_llama_case_and_atomic_impl(monkeypatch):
  """``--llama-seqs`` adds Llama-3.1-70B's attention (B = 1, GQA 64/8, D = 128) and an empty
  ``--head-dims`` leaves only it; ``jaxflash_mosaic_atomic`` is the Mosaic backend with
  ``deterministic=False``."""
  import cases as cases_lib
  cfg = bench.config(bench.parse_args(["--head-dims", "--seqs", "8192", "--no-gqa",
                                       "--llama-seqs", "8192", "16384", "--dtypes", "bf16"]))
  got = {(c.b, c.s, c.n, c.k, c.d, c.causal) for c in bench.build_cases(cfg)}
  assert got == {(1, s, 64, 8, 128, causal) for s in (8192, 16384) for causal in (False, True)}
  assert bench.config(bench.parse_args(["--smoke"]))["llama_seqs"] == []
  seen = []
  monkeypatch.setattr(cases_lib, "attention_with_config",
                      lambda *a, **kw: seen.append((kw["implementation"], kw["deterministic"])))
  for impl in ("jaxflash_mosaic", "jaxflash_mosaic_atomic"):
    cases_lib.attention_fn(impl, causal=True)(None, None, None)
  assert seen == [("mosaic", True), ("mosaic", False)]


def test_bench_smoke(tmp_path):
  out = tmp_path / "smoke.json"
  # One length (the smoke grid has two) halves the run: compiling dominates it on a CPU. Two
  # compile threads take the GPU's path (every executable of a case compiled ahead, in parallel).
  bench.main(["--smoke", "--seqs", "128", "--compile-workers", "2", "--out", str(out),
              "--floor", str(report.TRITON_FLOOR)])
  data = json.loads(out.read_text())

  env = data["environment"]
  for key in ("device", "platform", "jax", "jaxlib", "date", "flop_convention", "method"):
    assert env.get(key), key
  cfg = data["config"]
  cases = bench.build_cases(cfg)
  assert any(c.k != c.n for c in cases), "the smoke grid includes the GQA case"
  assert {c.causal for c in cases} == {False, True}
  want = {(impl, mode, c) for c in cases for impl in cfg["impls"] for mode in bench.MODES}
  got = {(r["impl"], r["mode"], bench.Case(report._short_dtype(r["dtype"]), r["B"], r["S"],
                                           r["N"], r["K"], r["D"], r["causal"]))
         for r in data["rows"]}
  assert got == want
  assert len(data["rows"]) == len(want)

  for r in data["rows"]:
    if r["impl"] not in bench.CPU_IMPLS:
      continue  # cudnn and pallas_mha rows only appear on a GPU
    assert not r.get("error") and not r.get("skipped"), r
    err = r["relerr"] if r["mode"] == "fwd" else r["relerr_dq"]
    assert err < report.TOLERANCE and not r["wrong"], r
    assert r["ms"] > 0 and r["tflops"] > 0 and r["calls"] >= 1, r
    assert isinstance(r["temp_bytes"], int), r
    assert r.get("repeatable") is (True if r["mode"] == "fwdbwd" else None), r

  # One floor entry per check the floor file names (counted from the data, not hard-coded).
  floor = report.load_floor(report.TRITON_FLOOR)
  ratio = floor["ratio"]
  want_checks = (len(ratio["head_dims"]) * len(ratio["seqs"]) * 2 * len(ratio["need"])
                 + 2 * len(floor["tflops"]["cells"]))
  assert len(data["floor"]) == want_checks
  assert all(c["status"] in ("pass", "miss", "missing") for c in data["floor"])
  md = out.with_suffix(".md").read_text()
  n, k, _ = cfg["gqa_heads"]
  assert "jaxflash_triton" in md and "Floor" in md and f"| {n}/{k} |" in md
  png = tmp_path / "smoke_bf16.png"
  assert png.stat().st_size > 0

  # --resume finds every row in --out already: nothing is measured again.
  again = bench.main(["--smoke", "--seqs", "128", "--out", str(out), "--resume"])
  assert again["rows"] == data["rows"] and "floor" not in again  # (no --floor: no check)

  # --merge joins runs: every row keeps its run, and the tables take a cell's latest run.
  joined = bench.main(["--merge", str(out), str(out), "--out", str(tmp_path / "joined.json")])
  assert list(joined["runs"]) == ["smoke", "smoke_2"] and len(joined["rows"]) == 2 * len(want)
  assert {r["run"] for r in report.current_rows(joined)} == {"smoke_2"}


def test_same_bits_and_the_deterministic_cudnn_options():
  """The repeatability check compares bits (a NaN equals itself; -0.0 is not 0.0), over
  tuples; "cudnn_det" adds XLA's deterministic switch to the run's compiler options and no
  other implementation gets it."""
  import cases
  import jax.numpy as jnp
  a = (jnp.array([1.0, jnp.nan], jnp.bfloat16), jnp.zeros(3))
  assert cases.same_bits(a, (a[0] + 0, jnp.zeros(3)))
  assert not cases.same_bits(a, (a[0], jnp.array([0.0, -0.0, 0.0])))
  assert not cases.same_bits(a, (jnp.array([1.0, 2.0], jnp.bfloat16), a[1]))
  switch = {"xla_gpu_exclude_nondeterministic_ops": True}
  assert cases.impl_options("cudnn_det", None) == switch
  assert cases.impl_options("cudnn_det", {"a": 1}) == {"a": 1, **switch}
  assert cases.impl_options("cudnn", {"a": 1}) == {"a": 1}
  assert {"cudnn", "cudnn_det", "jaxflash_mosaic"} <= set(bench.GPU_IMPLS) <= set(bench.IMPLS)


@slow_probe
def test_memory_smoke(tmp_path):
  out = tmp_path / "memory.json"
  result = memory.main(["--smoke", "--out", str(out)])  # one worker process per implementation
  data = json.loads(out.read_text())
  assert data == json.loads(json.dumps(result))
  assert data["environment"]["device"] and data["environment"]["mem_fraction"]
  impls = data["config"]["impls"]
  assert set(bench.CPU_IMPLS) <= set(impls)
  for impl in impls:
    rows = [r for r in data["rows"] if r["impl"] == impl]
    assert [r["S"] for r in rows] == [64, 128], rows
    for r in rows:
      assert not r.get("error") and r["temp_bytes"] > 0 and r["ms"] > 0, r
    assert data["longest_s"][impl] == 128
  assert (tmp_path / "memory.png").stat().st_size > 0
  assert "longest trainable S" in (tmp_path / "memory.md").read_text()


def test_memory_worker_timeout(tmp_path):
  """A worker that overruns is killed and fails at the first S it did not report."""
  result = memory.main(["--smoke", "--impls", "xla", "--timeout", "0.2",
                        "--out", str(tmp_path / "m.json")])
  (row,) = result["rows"]
  assert row["S"] == 64 and row["failed"] == "timeout", row
  assert result["longest_s"] == {"xla": None}


def test_default_outputs_go_to_one_folder_per_device_kind():
  env = dict(device="NVIDIA H100 80GB HBM3", date="2026-11-24")
  assert report.default_out(env, "grid") == BENCHMARKS / "results" / "h100" / "grid.json"


def test_joined_runs_keep_every_row_and_read_the_latest():
  def result(ms, date):
    return dict(kind="speed", environment=dict(device="NVIDIA H200", jax="0.11.2", date=date),
                config={}, rows=[dict(impl="cudnn", mode="fwd", dtype="bfloat16", B=1, S=8, N=2,
                                      K=2, D=64, causal=False, ms=ms)])

  joined = report.join([("a", result(2.0, "2026-11-21")), ("b", result(1.0, "2026-11-22"))])
  assert [r["run"] for r in joined["rows"]] == ["a", "b"]
  assert [r["ms"] for r in report.current_rows(joined)] == [1.0]
  assert report.describe(joined) == "NVIDIA H200, jax 0.11.2, 2026-11-21 to 2026-11-22"
  again = report.join([("c", joined), ("d", result(3.0, "2026-11-23"))])  # (runs keep names)
  assert list(again["runs"]) == ["a", "b", "d"]


def test_device_slug():
  assert report.device_slug("NVIDIA H200") == "h200"
  assert report.device_slug("NVIDIA H100 80GB HBM3") == "h100"
  assert report.device_slug("NVIDIA A100-SXM4-80GB") == "a100"
  assert report.device_slug("cpu") == "cpu"
  assert report.device_slug("NVIDIA GeForce RTX 4090") == "rtx-4090"
  assert report.device_slug("") == "device"


def test_floor_summary():
  def row(impl, mode, tflops, **kw):
    return dict(dict(impl=impl, mode=mode, dtype="bfloat16", B=16, S=1024, N=32, K=32, D=64,
                     causal=False, tflops=tflops, wrong=False), **kw)

  rows = [row("jaxflash_triton", "fwd", 110.0), row("pallas_mha", "fwd", 100.0),
          row("jaxflash_triton", "fwdbwd", 150.0), row("pallas_mha", "fwdbwd", 100.0),
          row("jaxflash_triton", "fwd", 500.0, causal=True, wrong=True),
          row("pallas_mha", "fwd", 100.0, causal=True),
          row("jaxflash_triton", "fwdbwd", 330.0, B=1, S=16384, N=16, K=16, D=128)]
  status = {(c["check"], c["D"], c["S"], c["causal"]): c["status"]
            for c in report.floor_summary(rows, report.load_floor(report.TRITON_FLOOR))}
  assert status[("fwd vs pallas_mha", 64, 1024, False)] == "pass"  # 1.10x >= 1.05x
  assert status[("fwdbwd vs pallas_mha", 64, 1024, False)] == "miss"  # 1.5x < 2x
  assert status[("fwd vs pallas_mha", 64, 1024, True)] == "missing"  # a wrong result counts not
  assert status[("fwdbwd TFLOP/s", 128, 16384, False)] == "pass"
  assert status[("fwdbwd TFLOP/s", 128, 16384, True)] == "missing"
  assert "1 missing" not in report.floor_text(report.floor_summary(rows))  # (the same floor)


def test_slow_calls_are_repeated_less():
  def slow():
    time.sleep(0.06)

  _, calls = bench.time_calls(slow, (), warmups=1, calls=20, repeats=1, budget_ms=100.0)
  assert calls == 1
  _, calls = bench.time_calls(lambda: None, (), warmups=1, calls=20, repeats=1)
  assert calls == 20


def test_progress_without_terminal_prints_lines():
  stream = io.StringIO()
  progress = bench.Progress(2, stream)
  progress.show("first")
  progress.advance()
  progress.show("second")
  progress.advance()
  progress.close()
  lines = stream.getvalue().splitlines()
  assert len(lines) == 3 and "\r" not in stream.getvalue()
  assert lines[0].startswith("[0/2") and "first" in lines[0] and lines[-1].startswith("[2/2")


def test_mosaic_tuner_rows():
  """The Mosaic candidates are the configs of each family that fit in shared memory, next to a
  cuDNN row per cell; without a Hopper GPU each one records why it did not run."""
  import tune
  cfg = dict(head_dims=[256], tokens=4096, hidden=256, impls=["jaxflash_mosaic"])
  rows = tune.tune(cfg)
  assert rows and {r["kind"] for r in rows} == {"mosaic_fwd", "cudnn_fwd"}
  assert {r["causal"] for r in rows} == {False, True}
  assert any(r["blocks"][4] for r in rows if r["kind"] == "mosaic_fwd")  # the overlap family
  for r in rows:
    assert r["tflops"] is None and r["error"]  # nothing runs without a GPU
    if r["kind"] == "cudnn_fwd":  # the yardstick row of each cell
      continue
    block_kv, stages, _, ctas, overlap = r["blocks"]
    assert mosaic.config.fits(mosaic.Config(block_kv=block_kv, num_stages=stages,
                                            persistent_ctas=ctas, intra_wg_overlap=overlap), 256)
    assert "Hopper" in r["error"]
  assert len(rows) < 2 * 12  # some candidates do not fit at D = 256
  # The natural launch order is tried only with a causal band.
  assert {r["causal"] for r in rows if r["blocks"] and not r["blocks"][2]} == {True}


def test_mosaic_backward_tuner_rows():
  """The "backward" family: forward+backward with the Triton backward and each Mosaic backward
  tile set that fits, next to cuDNN's forward+backward per cell."""
  import tune
  cfg = dict(head_dims=[128], tokens=4096, hidden=256, impls=["jaxflash_mosaic"],
             tune_families=["backward"])
  rows = tune.tune(cfg)
  assert {r["kind"] for r in rows} == {"mosaic_fwdbwd", "cudnn_fwdbwd"}
  tiles = [r["blocks"] for r in rows if r["kind"] == "mosaic_fwdbwd" and not r["causal"]]
  assert tiles[0] == "triton" and len(tiles) > 2
  one_pass = [t for t in tiles[1:] if t[0] == "one pass"]
  assert one_pass and all(t[1] == 64 for t in one_pass)  # 64-row query tiles at D = 128
  for dkv_block_q, dkv_stages, dq_block_kv, dq_stages in tiles[1 + len(one_pass):]:
    backward = mosaic.Backward(dkv_block_q=dkv_block_q, dkv_stages=dkv_stages,
                               dq_block_kv=dq_block_kv, dq_stages=dq_stages)
    assert mosaic.config.backward_smem_bytes(backward, 128) <= mosaic.config.SMEM_BUDGET
  assert all(r["tflops"] is None and r["error"] for r in rows)  # nothing runs without a GPU


def test_one_pass_tuner_rows():
  """The "one_pass" family: the shipped backward, then the one-pass candidates only."""
  import tune
  cfg = dict(head_dims=[64], tokens=4096, hidden=256, impls=["jaxflash_mosaic"],
             tune_families=["one_pass"], causal="n")
  tiles = [r["blocks"] for r in tune.tune(cfg) if r["kind"] == "mosaic_fwdbwd"]
  assert tiles[0] == (128, 2, 128, 2) and len(tiles) > 1
  assert all(t[:2] == ("one pass", 128) for t in tiles[1:])


@slow_probe
def test_bwd_parts_smoke(tmp_path):
  """benchmarks/dev/bwd_parts.py in the interpreter: the gradients checked, then each part of the
  Mosaic backend's forward+backward timed alone (forward, glue, dK/dV, dQ, the whole)."""
  import bwd_parts
  out = tmp_path / "parts.json"
  # (Without --variants: their patched kernels cost CI a minute of interpreting.)
  result = bwd_parts.main(["--smoke", "--causal", "n", "--out", str(out)])
  rows = result["rows"]
  assert [r["rel_err"] < 2e-2 for r in rows if r["part"] == "check"] == [True]
  timed = {(r["part"], json.dumps(r["variant"])) for r in rows if "ms" in r}
  assert timed == {("fwd", "null"), ("glue", "null"), ("dkv", "null"), ("dq", "null"),
                   ("fwdbwd", "null")}
  assert all(r["ms"] > 0 for r in rows if "ms" in r)
  assert "| 64 | 128 | n |" in out.with_suffix(".md").read_text()


def test_decode_bench_smoke(tmp_path, monkeypatch):
  """benchmarks/decode.py on its tiny grid: every cell checked against the reference, then
  timed, for contiguous and paged caches and T = 1 and 3 (jax.nn only at T = 1, contiguous);
  with --profile, each row's kernels per call and two calls' timeline from a (here made-up)
  trace of 5 calls."""
  import decode
  trace = [(0, 4000, "fusion"), (4000, 24000, "jaxflash_decode_split_kv"), (24000, 26000,
                                                                            "fusion")] * 5
  monkeypatch.setattr(decode, "gpu_events", lambda fn, args, calls: {"/device:GPU:0": trace})
  out = tmp_path / "decode.json"
  decode.main(["--smoke", "--profile", "--rounds", "2", "--out", str(out)])
  data = json.loads(out.read_text())
  assert data["environment"]["device"] and data["config"]["smoke"]
  cells = {(r["impl"], r["T"], r["layout"]) for r in data["rows"]}
  assert cells == {("jaxflash", 1, "contiguous"), ("jaxflash", 1, "paged"),
                   ("jaxflash", 3, "contiguous"), ("jaxflash", 3, "paged"),
                   ("xla", 1, "contiguous")}
  for row in data["rows"]:
    assert "failed" not in row and row["error"] < 1e-3 and row["us"] > 0 and row["of_copy"] > 0
    assert row["kernels"] == [dict(name="jaxflash_decode_split_kv", us=20.0, count=1),
                              dict(name="fusion", us=6.0, count=2)]
    assert row["timeline"] == [["fusion", 0.0, 4.0], ["jaxflash_decode_split_kv", 4.0, 20.0],
                               ["fusion", 24.0, 2.0]] * 2  # (two calls: the made-up trace
    # repeats one call's times)
    assert len(row["us_rounds"]) == 2 and row["us"] == round(sum(row["us_rounds"]) / 2, 2)
  assert "| B | S | T |" in out.with_suffix(".md").read_text()
  import plot
  png = out.with_suffix(".png")
  assert plot.main([str(out)]) == [png] and png.stat().st_size > 0


# ("token" is a variant: [head] holds decode.py's FP8 path (the query, both layouts, both
# backends, the check and the bytes), and tests/test_decode.py's
# test_fp8_cache_matches_its_real_values[2-False-token-triton] and [...-xla] the key factors
# per token in the kernels.)
@pytest.mark.parametrize("key_factors", ["head", pytest.param("token",
                                                             marks=pytest.mark.variants)])
def test_decode_bench_fp8_cache(tmp_path, key_factors):
  """benchmarks/decode.py --dtype float8_e4m3fn: an FP8 query and cache (a paged pool with one
  factor a tensor; the contiguous cache's keys per head or per token) checked against the
  reference of the values they stand for, on the split-KV kernel (Triton's interpreter) and
  the XLA backend; bytes counted at one a cache entry."""
  import decode
  out = tmp_path / "decode.json"
  decode.main(["--batches", "2", "--seqs", "64", "--heads", "4/2", "--head-dims", "32",
               "--page-size", "32", "--calls", "2", "--repeats", "1", "--interpret",
               "--dtype", "float8_e4m3fn", "--impls", "jaxflash_triton", "jaxflash_xla", "cudnn",
               "--layouts", "contiguous", "paged", "--key-factors", key_factors,
               "--out", str(out)])
  rows = json.loads(out.read_text())["rows"]
  assert {(r["impl"], r["layout"]) for r in rows} == {
      (impl, layout) for impl in ("jaxflash_triton", "jaxflash_xla")
      for layout in ("contiguous", "paged")}  # (cuDNN takes no FP8 cache)
  for row in rows:
    assert "failed" not in row and row["error"] < 2e-2 and row["bytes"] == 2 * 64 * 2 * 64


def test_decode_folded_experiment_matches_the_reference():
  """decode.py's ``fold_*`` experiment (T = 1 as one training-forward call over the cache cut
  into splits) against the float32 reference: ragged rows, one of them empty, GQA."""
  import decode
  q, kc, vc, _, _ = decode.make_inputs(3, 96, 1, 6, 2, 32, jnp.float32, 0, None)
  lengths = jnp.array([96, 41, 0], jnp.int32)
  want = decode.reference(q, kc, vc, jnp.maximum(lengths, 1), None)
  want[2] = 0.0  # (the reference cannot express an empty row)
  got = np.asarray(decode.folded_decode(q, kc, vc, lengths, "xla", splits=4))
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_decode_speedup_pairs_the_interleaved_rounds():
  """cuDNN ÷ jaxflash is taken round by round (pairs timed back to back), not from the two
  medians; the table shows the median pair and the range."""
  import decode
  ours = dict(us_rounds=[100.0, 120.0, 90.0])
  theirs = dict(us_rounds=[110.0, 114.0, 99.0])
  assert decode.speedup(ours, theirs) == (1.1, 0.95, 1.1)
  assert decode.speedup(ours, {}) is None
  base = dict(B=1, S=8, T=1, N=2, K=2, D=4, layout="contiguous", tb_s=1.0, of_copy=0.5)
  text = decode.table([dict(base, impl="jaxflash", **ours), dict(base, impl="cudnn", **theirs)])
  assert text.splitlines()[-1].endswith("| 1.100 (0.950–1.100) |")


def test_decode_candidates_change_only_their_fields(monkeypatch):
  """decode.py --candidates compiles the shipped config with the given fields changed (not a
  fresh config whose other fields are the dataclass defaults)."""
  import dataclasses

  import decode
  from jaxflash.backends.triton import decode as kernel
  shipped = kernel.DecodeConfig(splits=7, num_stages=3, block_k=32)
  monkeypatch.setattr(kernel, "default_config", lambda *a, **kw: shipped)
  compiled_with = []
  monkeypatch.setattr(decode, "_prepare", lambda row, *a: compiled_with.append(
      kernel.default_config(None, shipped.training, None)) or (row, None))
  cell = dict(B=1, K=8, S=4096, layout="contiguous")
  decode._tune(cell, lambda: None, (), None, dict(candidates=[{"merge": "xla", "splits": 5}],
                                                  page_size=64))
  assert compiled_with == [dataclasses.replace(shipped, merge="xla", splits=5)]
  assert kernel.default_config(None, None, None) is shipped  # (put back)


def test_decode_candidates_take_wave_splits_for_their_own_blocks():
  """decode.py --candidates: a candidate that changes the key blocks (or the heads per program)
  but names no split count gets `wave_splits`'s count for its programs, on a paged cache too
  (its blocks are not its pages); one that names a count, or keeps the blocks, keeps what it
  gives (the shipped count where it gives none)."""
  import decode
  from jaxflash.backends.triton.decode import wave_splits
  given = [{"block_k": 128, "num_stages": 4}, {"splits": 3, "grid_order": ["head", "split",
                                                                         "batch"]},
           {"num_stages": 3}]
  cell = dict(B=1, K=8, S=32768, layout="contiguous", page_size=16)
  got = list(decode._given_candidates(given)(cell, 132))
  assert got == [{"block_k": 128, "num_stages": 4, "splits": wave_splits(256, 8, 132)},
                 given[1], {"num_stages": 3}]
  paged = list(decode._given_candidates(given)(dict(cell, layout="paged"), 132))
  assert paged == got
  assert given[0] == {"block_k": 128, "num_stages": 4}  # (not changed)
  # Two heads per program: half the programs per split, on either layout.
  assert list(decode._given_candidates([{"heads": 2}])(cell, 132)) == [
      {"heads": 2, "splits": wave_splits(512, 4, 132)}]
  assert list(decode._given_candidates([{"heads": 2}])(dict(cell, layout="paged"), 132)) == [
      {"heads": 2, "splits": wave_splits(512, 4, 132)}]  # (64-key blocks, not 16-key pages)


@slow_probe  # (26 s of a CPU; the script runs when a multi-GPU machine is lent)
def test_multi_gpu_smoke(tmp_path, monkeypatch):
  """benchmarks/multi_gpu.py on the fake CPU devices (XLA backend): the batch-sharded step,
  the ring rows and a longest-sequence row checked on sampled rows; and the profile's
  bookkeeping (exposed NCCL time is what no compute kernel covers) on a made-up trace."""
  import cases
  import multi_gpu
  out = tmp_path / "multi.json"
  result = multi_gpu.main(["--smoke", "--ring-longest", "256", "--ring-causal-layouts",
                           "striped", "zigzag", "--out", str(out)])
  kinds = [r.get("kind") for r in result["rows"]]
  assert kinds.count("ring") == 3 and kinds.count("longest") == 1 and None in kinds
  longest = result["rows"][-1]
  assert longest["grads_finite"] and longest["max_rel_err"] < 1e-4
  assert "striped, longest" in out.with_suffix(".md").read_text()

  trace = [(0, 10, "fwd"), (5, 20, "ncclKernel"), (25, 30, "bwd"), (26, 28, "ncclKernel")]
  monkeypatch.setattr(cases, "gpu_events", lambda fn, args, calls: {"/device:GPU:0": trace})
  p = multi_gpu.ring_profile(None, None, calls=1)
  assert [round(p[k] * 1e6) for k in ("span_ms", "compute_ms", "comm_ms", "exposed_comm_ms",
                                      "idle_ms")] == [30, 15, 17, 10, 5]


def test_committed_results():
  """benchmarks/results/<device>/ holds the files its README names, each a table of rows that
  report.py, plot.py and the README's table can read."""
  h200 = BENCHMARKS / "results" / "h200"
  names = {p.name for p in h200.iterdir()}
  for name in ("README.md", "grid.json", "grid_bf16.png", "decode.json", "decode.png",
               "features.json", "memory.json", "memory.png", "gpt_jaxflash.json",
               "gpt_cudnn.json", "gpt_flax.json", "gpt_xla.json", "multi_gpu_2.json",
               "multi_gpu_4.json"):
    assert name in names, name
    assert name in (h200 / "README.md").read_text() or name == "README.md", name
  grid = json.loads((h200 / "grid.json").read_text())
  assert {r["run"] for r in grid["rows"]} == set(grid["runs"])
  assert all(run["code_commit"] and run["environment"]["device"] == "NVIDIA H200"
             for run in grid["runs"].values())
  latest = report.current_rows(grid)
  assert {"jaxflash_mosaic", "cudnn", "cudnn_det"} <= {r["impl"] for r in latest}
  assert all(r["tflops"] > 0 and not r["wrong"] for r in latest
             if r["impl"] in ("jaxflash_mosaic", "cudnn", "cudnn_det"))
  assert report.summary_table(grid).count("\n") == 1 + 18  # header + D x S x causal
  for name in ("jaxflash", "cudnn"):
    gpt = json.loads((h200 / f"gpt_{name}.json").read_text())
    assert gpt["attention"] == name and gpt["summary"]["compile_s"] > 0
  h100 = json.loads((BENCHMARKS / "results" / "h100" / "grid.json").read_text())
  assert {run["environment"]["device"] for run in h100["runs"].values()} == {
      "NVIDIA H100 80GB HBM3"}


def test_value_dim_choices_follow_the_committed_measurement():
  """Each H100 entry of `FASTER_THAN_TRITON_VALUE_DIM` (and its D = 192 cells of
  `FASTER_THAN_TRITON`) is a cell family where the committed run had Mosaic's forward+backward
  ahead of Triton's at every measured shape, and right."""
  from jaxflash.backends.mosaic.config import (FASTER_THAN_TRITON, FASTER_THAN_TRITON_VALUE_DIM,
                                               padded_head_dim)
  data = json.loads((BENCHMARKS / "results" / "h100" / "value_dims.json").read_text())
  assert {r["run"] for r in data["rows"]} == set(data["runs"])
  assert not any(r.get("error") or r["wrong"] for r in data["rows"])
  ms = {(r["Dqk"], r["Dv"], r["B"], r["S"], r["N"], r["causal"], r["mode"], r["impl"]): r["ms"]
        for r in data["rows"]}
  kind = "H100 80GB HBM3"
  entries = list(FASTER_THAN_TRITON_VALUE_DIM[kind])
  entries += [(h, h, causal) for (h, causal) in FASTER_THAN_TRITON[kind] if h == 192]
  for hp, hvp, causal in entries:
    cells = [key for key in ms if key[-1] == "mosaic" and key[-2] == "fwdbwd"
             and (padded_head_dim(key[0]), padded_head_dim(key[1]), key[5]) == (hp, hvp, causal)]
    assert cells, (hp, hvp, causal)
    for key in cells:
      assert ms[key] < ms[key[:-1] + ("triton",)], key


@slow_probe
def test_value_dim_choice_smoke(tmp_path):
  """benchmarks/dev/value_dim_choice.py on the CPU: every cell checked against the reference
  and timed, written in the results files' format."""
  import value_dim_choice
  out = tmp_path / "value_dims.json"
  value_dim_choice.main(["--smoke", "--dims", "192/128", "64/96", "--out", str(out)])
  data = json.loads(out.read_text())
  assert data["config"]["dims"] == ["192/128", "64/96"] and data["environment"]["device"]
  assert len(data["rows"]) == 2 * 2 * 2 * 2  # dims x bands x (xla, triton) x modes
  assert all(r["ms"] > 0 and r["relerr"] < report.TOLERANCE and not r["wrong"]
             for r in data["rows"])


@slow_probe
def test_masks_smoke(tmp_path):
  """benchmarks/masks.py on tiny shapes (XLA backend, jax.nn's XLA path standing in for cuDNN):
  every row checked right, timed and counted; the build row of the reused block mask; the
  table and the plot."""
  out = tmp_path / "masks.json"
  masks.main(["--smoke", "--cases", "dense_mask", "documents_8", "--compile-workers", "2",
              "--out", str(out)])
  data = json.loads(out.read_text())
  assert data["kind"] == "masks" and not data.get("partial")
  want = {("dense_mask", impl, mode) for impl in ("jaxflash", "xla") for mode in masks.MODES}
  want |= {("documents_8", impl, mode) for impl in ("jaxflash_segments", "jaxflash_mask_mod",
                                                    "xla") for mode in masks.MODES}
  want.add(("documents_8", "jaxflash_mask_mod", "build"))
  rows = data["rows"]
  assert {(r["case"], r["impl"], r["mode"]) for r in rows} == want and len(rows) == len(want)
  for r in rows:
    assert not r.get("error") and r["ms"] > 0 and r["calls"] >= 1 and r["via"], r
    if r["mode"] == "build":
      continue
    assert r["relerr"] < report.TOLERANCE and not r["wrong"], r
    assert r["visible_tflops"] > 0 and 0 < r["visible_fraction"] <= r["block_fraction"] <= 1, r
    assert r.get("repeatable") is (True if r["mode"] == "fwdbwd" else None), r
    assert r.get("backend") == ("xla" if r["impl"].startswith("jaxflash") else None), r

  # The counts are exact: the dense mask's own sum, and sum of l (l + 1) / 2 over documents.
  meta = data["cases"]
  s = meta["dense_mask"]["S"]
  dense = masks.flax_mask(jnp.asarray(meta["dense_mask"]["lengths"]), s)
  got = {r["case"]: r["visible_fraction"] for r in rows}
  assert got["dense_mask"] == float(np.mean(np.asarray(dense)))
  lengths = np.array(meta["documents_8"]["document_lengths"])
  assert len(lengths) == 8 and lengths.sum() == meta["documents_8"]["S"] == s * 4
  assert got["documents_8"] == (lengths * (lengths + 1) // 2).sum() / (s * 4) ** 2
  # The same rates from visible FLOPs: fwd+bwd counts 3.5x the forward's.
  fwd = next(r for r in rows if (r["case"], r["impl"], r["mode"]) == ("dense_mask", "xla", "fwd"))
  assert fwd["visible_tflops"] == pytest.approx(
      4 * fwd["D"] * fwd["visible_fraction"] * fwd["B"] * fwd["N"] * s * s / fwd["ms"] / 1e9)
  md = out.with_suffix(".md").read_text()
  assert "| documents_8 | jaxflash_mask_mod |" in md
  assert out.with_suffix(".png").stat().st_size > 0


def test_masks_flax_mask_is_flaxs():
  """dense_mask's mask is what Flax's make_causal_mask & make_attention_mask give for padded
  token rows."""
  pytest.importorskip("flax")
  from flax import linen as nn
  lengths = jnp.array([16, 11, 7, 1])
  tokens = (jnp.arange(16)[None, :] < lengths[:, None]).astype(jnp.int32) * 5
  want = nn.combine_masks(nn.make_causal_mask(tokens),
                          nn.make_attention_mask(tokens > 0, tokens > 0))
  np.testing.assert_array_equal(masks.flax_mask(lengths, 16), want.astype(bool))


def test_masks_patterns_and_counts():
  """The random block pattern holds its fraction of blocks and the diagonal; documents fill the
  sequence; counting visible entries block by block agrees with the dense mask."""
  visible = masks.block_pattern(128, 0.1, seed=0)
  assert visible.sum() == round(0.1 * 128 * 128) and visible.diagonal().all()
  assert masks.block_pattern(4, 0.1, seed=0).sum() == 4  # (at least the diagonal)
  doc = masks.document_ids(300, 7, seed=1)
  assert doc[0] == 0 and doc[-1] == 6 and (np.diff(doc) >= 0).all()
  shape = masks.Shape(b=2, s=200, n=3, d=8)
  prefix = jnp.array([50, 130])
  table = jnp.asarray(masks.block_pattern(4, 0.3, seed=2))[None, None]
  for mod in (masks.prefix_lm_mod(prefix), masks.block_pattern_mod(table, 64),
              masks.document_mod(jnp.asarray(np.stack([doc[:200], doc[100:]]))),
              lambda b, h, q, kv: (q >= kv) & (h != 1)):  # (one that depends on the head)
    idx = np.arange(200)
    dense = np.broadcast_to(mod(jnp.arange(2)[:, None, None, None],
                                jnp.arange(3)[None, :, None, None], idx[None, None, :, None],
                                idx[None, None, None, :]), (2, 3, 200, 200))
    counts = masks.count_visible(mod, shape, block=64)
    assert counts["visible_entries"] == dense.sum()
    padded = np.pad(dense, [(0, 0), (0, 0), (0, 56), (0, 56)]).reshape(2, 3, 4, 64, 4, 64)
    assert counts["block_fraction"] == padded.any(axis=(3, 5)).mean()


def test_masks_smoke_block_pattern(tmp_path):
  result = masks.main(["--smoke", "--cases", "block_10pct", "--modes", "fwd", "--out",
                       str(tmp_path / "masks.json")])
  assert all(not r.get("error") and not r["wrong"] for r in result["rows"])


def test_decode_hook_smoke(tmp_path):
  """The Flax-hook decoding benchmark runs on the CPU and its calls agree."""
  import decode_hook
  result = decode_hook.main(["--smoke", "--out", str(tmp_path / "decode_hook.json")])
  impls = {r["impl"] for r in result["rows"]}
  assert impls == {"hook", "mask_mod", "decode_attention"}
  assert all(r["max_abs_diff"] < 1e-2 and r["us"] > 0 for r in result["rows"])


def test_compile_time_smoke(tmp_path):
  import compile_time
  result = compile_time.main(["--smoke", "--layers", "2", "--out",
                              str(tmp_path / "compile_time.json")])
  assert [(r["impl"], r["layers"]) for r in result["rows"]] == [("xla", 1), ("xla", 2)]
  assert all(r["total_s"] > 0 for r in result["rows"])


def test_compile_parts_smoke(tmp_path):
  """benchmarks/dev/compile_parts.py on a tiny XLA-backend call: the first and the second
  compile timed, the lowering's profile written (no Mosaic kernel, so no PTX to time)."""
  import compile_parts
  result = compile_parts.main(["--smoke", "--out", str(tmp_path)])
  for part in ("cold", "again"):
    assert all(result[part][k] > 0 for k in ("trace_s", "lower_s", "compile_s")), result
  assert result["kernels"] == [] and "MOSAIC_GPU_DUMP_PTX" not in os.environ
  assert "cumulative" in (tmp_path / "lower_profile.txt").read_text()
  assert json.loads((tmp_path / "compile_parts.json").read_text()) == result


@slow_probe
def test_score_parts_smoke():
  """benchmarks/dev/score_parts.py on a tiny shape (XLA backend): every score_mod, the
  unseparated one included, checked against the reference and timed; the split restored."""
  import score_parts
  from jaxflash import mask_mod
  separated = mask_mod._separated
  rows = score_parts.main(["--smoke", "--table-gradient"])
  assert [r["name"] for r in rows] == list(score_parts.MODS)
  assert all(r["rel_err"] < 2e-2 and r["fwd_ms"] > 0 for r in rows), rows
  assert all((r["with_table_gradient_ms"] is not None) == r["name"].startswith("relative")
             for r in rows), rows
  assert mask_mod._separated is separated


@slow_probe
def test_rotation_cost_smoke():
  """benchmarks/dev/rotation_cost.py on a tiny shape (XLA backend): every variant timed, every
  rotated one's output and gradients near float32's, and the shipped precision restored."""
  import rotation_cost
  from jaxflash import fp8
  shipped = fp8.ROTATION_PRECISION
  result = rotation_cost.main(["--shape", "1", "128", "2", "32", "--rounds", "1"])
  assert set(result["ms"]) == {"bf16", "fp8", "rotated_highest", "rotated_high",
                               "rotated_default"}
  assert all(ms > 0 for ms in result["ms"].values())
  assert len(result["errors"]) == 3 and all(
      0 < err < 0.3 for errs in result["errors"].values() for err in errs), result["errors"]
  assert fp8.ROTATION_PRECISION is shipped


def test_model_features_smoke(tmp_path):
  """benchmarks/model_features.py on tiny shapes (XLA backend): every row checked and timed, and
  the committed H200 table has the rows the issue names."""
  import model_features
  out = tmp_path / "model_features.json"
  model_features.main(["--smoke", "--cases", "gpt_oss", "gpt_oss_sinks", "--out", str(out)])
  rows = json.loads(out.read_text())["rows"]
  assert {(r["case"], r["mode"]) for r in rows} == {
      (case, mode) for case in ("gpt_oss", "gpt_oss_sinks") for mode in ("fwd", "fwdbwd")}
  assert all(not r["wrong"] and r["ms"] > 0 for r in rows)
  assert out.with_suffix(".md").exists()
  shape = model_features.SHAPES["gpt_oss"]
  # The window's visible entries: row t sees min(t + 1, 129) keys.
  assert model_features.visible_entries(shape) == 64 * sum(min(t + 1, 129) for t in range(16384))
  committed = json.loads((BENCHMARKS / "results" / "h200" / "model_features.json").read_text())
  cells = {(r["case"], r["impl"], r["mode"]) for r in committed["rows"] if "ms" in r}
  assert {("gpt_oss_sinks", "jaxflash", "fwdbwd"), ("gpt_oss", "cudnn", "fwdbwd")} <= cells


@slow_probe
def test_fp8_smoke(tmp_path):
  """benchmarks/fp8.py on tiny shapes (XLA backend): speed rows checked and timed, accuracy rows
  with an RMSE, gradient rows with relative errors."""
  import fp8
  out = tmp_path / "fp8.json"
  fp8.main(["--smoke", "--shapes", "0", "--impls", "jaxflash_fp8", "jaxflash", "--out", str(out)])
  rows = json.loads(out.read_text())["rows"]
  speed = [r for r in rows if r["case"] == "speed"]
  assert {r["impl"] for r in speed} == {"jaxflash_fp8", "jaxflash"}
  assert all(not r["wrong"] and r["ms"] > 0 for r in speed)
  accuracy = {(r["inputs"], r["method"]): r["rmse"] for r in rows if r["case"] == "accuracy"}
  assert len(accuracy) == 8 and all(v > 0 for v in accuracy.values())
  gradients = {(r["inputs"], r["method"]): r for r in rows if r["case"] == "gradients"}
  assert len(gradients) == 16 and all(gradients[("normal", m)]["dq"] > 0 for m in (
      "bf16", "straight_through", "mixed", "fp8_backward", "fp8_backward_ideal"))


def test_committed_fp8_table():
  """The committed H200 FP8 table has the speed rows and the accuracy claim the issue names, and
  its gradient rows the reason for the default backward (finite where the mixed one diverges)."""
  committed = json.loads((BENCHMARKS / "results" / "h200" / "fp8.json").read_text())["rows"]
  cells = {(r["D"], r["causal"], r["impl"]) for r in committed
           if r["case"] == "speed" and "tflops" in r and not r.get("config")}
  assert {(d, c, i) for d in (128, 256) for c in (False, True)
          for i in ("jaxflash_fp8", "jaxflash", "cudnn_fp8")} <= cells
  rmse = {(r["inputs"], r["method"]): r["rmse"] for r in committed if r["case"] == "accuracy"}
  assert rmse[("outliers", "fp8_rotated")] <= 0.5 * rmse[("outliers", "fp8")]
  grads = {(r["inputs"], r["method"]): r for r in committed if r["case"] == "gradients"}
  for method in ("straight_through", "straight_through_rotated"):
    assert all(grads[(kind, method)][g] is not None for kind in ("normal", "outliers")
               for g in ("dq", "dk", "dv"))
  mixed = grads[("outliers", "mixed")]  # (diverged: overflowed, or far past the norm)
  assert all(mixed[g] is None or mixed[g] > 100 for g in ("dq", "dk", "dv"))


@slow_probe
def test_profile_call_smoke():
  """benchmarks/dev/profile_call.py (the call Nsight Compute profiles) on tiny shapes: the FP8
  and bf16 forwards, and a GQA forward+backward that allows atomics. (The Mosaic interpreter's
  call, most of the test's time, has one group of two query heads: its time grows with heads.)"""
  import profile_call
  for dtype in ("float8_e4m3fn", "bfloat16"):
    profile_call.main(["--s", "64", "--d", "64", "--dtype", dtype, "--causal"])
  profile_call.main(["--s", "64", "--d", "64", "--dtype", "bfloat16", "--heads", "4",
                     "--kv-heads", "2", "--grad", "--no-deterministic", "--causal"])
  profile_call.main(["--s", "64", "--d", "64", "--dtype", "bfloat16", "--heads", "2",
                     "--kv-heads", "1", "--grad", "--causal", "--backward", "tile_major=True"])
  with pytest.raises(SystemExit):
    profile_call.main(["--s", "64", "--d", "64", "--grad"])
  with pytest.raises(SystemExit):  # (cuDNN's call is bf16 only, with no Mosaic fields)
    profile_call.main(["--s", "64", "--d", "64", "--impl", "cudnn"])


# The configs the ptxas probe test compiles, with the kernels each group makes beyond one a
# config (the gradients: bwd_d128_atomic_r240 2, bwd_d128_gqa_tile_major and bwd_mla 3 each).
# CI compiles the first group (the shipped forwards at D = 128, MLA's and FP8's, and the atomic
# one pass); the second (121 worker-seconds with the first, the pinned suite's slowest test)
# runs on the GPU machine and with JAXFLASH_ALL_VARIANTS=1 (2026-12-04).
PTXAS_GROUPS = [
    pytest.param(["d128_overlap", "mla_kv128_overlap", "fp8_d128_shipped",
                  "bwd_d128_atomic_r240"], 1, id="shipped"),
    pytest.param(["d128_overlap_persistent_mc_q2", "d64_kv256_persistent_q2", "d64_c3_kv128",
                  "bwd_d128_gqa_tile_major", "bwd_mla"], 4, id="more", marks=slow_probe),
]


@pytest.mark.usefixtures("cuda_plugin")
@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs the CUDA toolkit's ptxas")
@pytest.mark.parametrize("configs,extra_kernels", PTXAS_GROUPS)
def test_ptxas_probe_compiles_ahead_of_time(tmp_path, configs, extra_kernels):
  """benchmarks/dev/ptxas_probe.py with no GPU: XLA compiles for a compile-only H100 and Mosaic
  GPU runs ptxas on its PTX (a group of `PTXAS_GROUPS` a case). No kernel of these configs
  spills (a kernel that did would lose speed without failing any other test): the shipped D = 128 causal forward, MLA's 128-key
  forward tiles with O through the Q tiles' memory, the shipped D = 128 forward without a band
  (a persistent grid of pairs sharing K/V, two Q buffers), FP8's shipped D = 128 tiles without
  a band (the row sums' wgmma, a persistent grid), D = 64's three consumer warpgroups at 160
  registers (`THREE_CONSUMERS`, long calls on an H200) and its 256-key persistent tiles with
  two Q buffers (shorter calls without a band), and the
  backward kernels whose resident tiles' descriptors stay in the loop (`backward._opaque_zero`:
  the atomic one pass at D = 128 spilled 708 bytes without it, MLA's dK/dV 216): the shipped
  atomic one pass at D = 128 (240 registers) and GQA's causal kernels launched tile-major.
  (GQA's atomic one pass spills 16 bytes: `bwd_d128_gqa_atomic_shipped`, not checked here.)"""
  run = subprocess.run(
      [sys.executable, str(BENCHMARKS / "dev" / "ptxas_probe.py"), "--aot", "--out",
       str(tmp_path / "out"), "--dumps", str(tmp_path / "dumps"), "--configs", *configs],
      capture_output=True, text=True, timeout=900,
      env=dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent)))
  summary = (tmp_path / "out" / "summary.txt").read_text()
  head = summary.split("\n\n")[0]
  assert run.returncode == 0 and head.count(": ok") == len(configs), run.stderr[-2000:]
  kernels = head.count(" registers, stack ")
  assert kernels == len(configs) + extra_kernels, head
  assert head.count("spills (stores/loads) 0/0") == kernels, head
  assert head.count(" KiB") == kernels, head  # each kernel's code size (`code_bytes`)


@pytest.mark.usefixtures("cuda_plugin")
@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs the CUDA toolkit's ptxas")
def test_glue_audit_finds_no_gather_in_the_fp8_forward():
  """benchmarks/dev/glue_audit.py compiles an FP8 forward for a compile-only H100: the call is
  its kernel and one pass over V beside it, no gather (V's re-layout once was one, 195 us of a
  2.4 ms call on an H200)."""
  import glue_audit
  rows = glue_audit.main(["--cases", "fp8"])
  assert [r["kind"] for r in rows if r["kernel"]] == ["jaxflash_mosaic_forward"]
  assert not any("gather" in r["kind"] for r in rows)
  moved = sum(r["read"] + r["written"] for r in rows if not r["kernel"])
  assert moved <= 2 * 16384 * 16 * 128 + 4096, moved  # V read and written once


def test_profiler_scopes_are_timed_per_warpgroup():
  """`decode_trace.scope_times` (which `forward_trace.py` reads too): a Perfetto trace's
  begin/end pairs, nested, per warpgroup (thread ids count from 1 over a CTA's three
  warpgroups), in the profiler's kilocycles; a thread outside the merging CTAs is left out
  when only those are asked for."""
  import decode_trace
  events = []
  for tid, (outer, inner) in {1: (10, 4), 2: (20, 6), 4: (12, 2)}.items():
    events += [dict(name="fwd_softmax", ph="B", ts=100.0, pid=0, tid=tid),
               dict(name="fwd_pv", ph="B", ts=101.0, pid=0, tid=tid),
               dict(name="fwd_pv", ph="E", ts=101.0 + inner, pid=0, tid=tid),
               dict(name="fwd_softmax", ph="E", ts=100.0 + outer, pid=0, tid=tid)]
  events.append(dict(name="merge", ph="B", ts=0.0, pid=1, tid=1))
  events.append(dict(name="merge", ph="E", ts=3.0, pid=1, tid=1))
  times = decode_trace.scope_times(dict(traceEvents=events[::-1]), merging_only=False)
  assert sorted(times[0]["fwd_softmax"]) == [10.0, 12.0]
  assert sorted(times[0]["fwd_pv"]) == [2.0, 4.0]
  assert times[1]["fwd_softmax"] == [20.0] and times[1]["fwd_pv"] == [6.0]
  assert times[0]["merge"] == [3.0] and len(times[0]["threads"]) == 3
  merging = decode_trace.scope_times(dict(traceEvents=events), merging_only=True)
  assert dict(merging[0]) == {"merge": [3.0], "threads": [1.0]} and 1 not in merging
  rows = {(r["warpgroup"], r["scope"]): r for r in decode_trace.scope_rows(dict(
      traceEvents=events))}
  softmax = rows[0, "fwd_softmax"]  # two threads of warpgroup 0, one occurrence each
  assert (softmax["count"], softmax["median_kcycles"], softmax["total_kcycles"]) == (
      2 / 3, 11.0, 22 / 3)  # (the merging CTA's thread counts as a third thread there)
  assert rows[1, "fwd_pv"]["p90_kcycles"] == 6.0
  # CTAs of two warpgroups (the transposed decoding kernel's): thread ids 2 and 4 are both
  # warpgroup 1, of the first and second CTA
  two = decode_trace.scope_times(dict(traceEvents=events), merging_only=False, warpgroups=2)
  assert two[0]["fwd_softmax"] == [10.0] and sorted(two[1]["fwd_softmax"]) == [12.0, 20.0]


def test_forward_trace_calls_run_in_the_interpreter():
  """benchmarks/dev/forward_trace.py's calls (the profiler itself needs the GPU): the bf16 and
  FP8 forwards on given tiles, in Mosaic GPU's interpreter, against the XLA backend."""
  import forward_trace
  for fp8 in (False, True):
    args, fn = forward_trace.call_args(1, 96, 2, 64, fp8, dict(block_kv=64), interpret=True)
    got = np.asarray(fn(*args, causal=True), np.float32)
    xla_args = dict(zip(("q_descale", "k_descale", "v_descale"), args[3:]))
    want = np.asarray(jaxflash.flash_attention(*args[:3], is_causal=True, implementation="xla",
                                               **xla_args), np.float32)
    assert got.shape == (1, 96, 2, 64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < (3e-2 if fp8 else 1e-2)


def test_clocks_value_dim_calls_count_mla_flops():
  """benchmarks/dev/clocks.py --dv (the sampling itself needs nvidia-smi): the call's outputs
  have V's head dim, and its FLOPs are model_features.py's, causal band included."""
  import argparse

  import clocks
  args = argparse.Namespace(impls=["jaxflash"], b=1, s=40, heads=4, kv_heads=2, d=24, dv=16,
                            causal=True, mode="fwd")
  calls, work = clocks._value_dim_calls(args)
  fn, inputs = calls["jaxflash"]
  assert fn(*inputs).shape == (1, 40, 4, 16)
  entries = 4 * 40 * 41 // 2
  assert work == entries * 2 * (24 + 16)
  calls, work = clocks._value_dim_calls(argparse.Namespace(**{**vars(args), "mode": "fwdbwd"}))
  fn, inputs = calls["jaxflash"]
  assert [g.shape for g in fn(*inputs)] == [(1, 40, 4, 24), (1, 40, 2, 24), (1, 40, 2, 16)]
  assert work == entries * (2 * (24 + 16) + 2 * (3 * 24 + 2 * 16))
  for bad in ({"impls": ["jaxflash_triton"]}, {"causal": False}):
    with pytest.raises(ValueError, match="--dv"):
      clocks._value_dim_calls(argparse.Namespace(**{**vars(args), **bad}))


def test_model_features_reaches_cudnn_value_dim_through_the_private_path(monkeypatch):
  """model_features.py's cuDNN MLA rows: jax.nn asks V for the query's head dim, so a shape
  with its own Dv calls JAX's private cuDNN function (causal, jax.nn's 1/sqrt(Dqk) scale) and
  a shape with the same head dims keeps jax.nn's path."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn

  import model_features
  seen = {}

  def fake(q, k, v, *, scale, mask_type):
    seen.update(scale=scale, mask_type=mask_type)
    return jnp.zeros(q.shape[:3] + v.shape[-1:], q.dtype)
  monkeypatch.setattr(cudnn, "dot_product_attention", fake)
  shape = model_features.Shape(1, 16, 2, 2, 24, 16, None)
  q, k, v, _, _ = model_features.inputs(shape, 0)
  out = model_features.attention("cudnn", shape, None)(q, k, v, None, None)
  assert out.shape == (1, 16, 2, 16)
  assert seen == dict(scale=24 ** -0.5, mask_type=cudnn.MaskType.CAUSAL)
  with pytest.raises(ValueError, match="plain causal"):
    model_features.cudnn_value_dim(q, k, v, model_features.Shape(1, 16, 2, 2, 24, 16, 8))
  seen.clear()
  monkeypatch.setattr(jax.nn, "dot_product_attention",
                      lambda q, k, v, bias, **kw: seen.update(jax_nn=kw) or q)
  same = model_features.Shape(1, 16, 2, 2, 16, 16, None)
  q, k, v, _, _ = model_features.inputs(same, 0)
  model_features.attention("cudnn", same, None)(q, k, v, None, None)
  assert seen == dict(jax_nn=dict(implementation="cudnn", is_causal=True,
                                  local_window_size=None))


def test_clocks_summary_reads_clock_events():
  """benchmarks/dev/clocks.py's reading of nvidia-smi's samples: the first quarter dropped,
  medians of the rest, and each clock event reason's share of them (a sample that could not be
  read, such as "[N/A]", counts as none)."""
  import clocks
  lines = ["1980, 100.0, 0x0000000000000000",  # dropped: the clock settling
           "1755, 690.5, 0x0000000000000004",
           "1740, 699.0, 0x000000000000000C",
           "1770, 695.0, [N/A]",
           "garbage"]
  got = clocks.summary(lines)
  assert got["mhz"] == 1755 and got["watts"] == 695.0
  assert got["events"] == {"sw_power_cap": 2 / 3, "hw_slowdown": 1 / 3}
  assert clocks.summary([]) == dict(mhz=None, watts=None, events={})


def test_forward_tiles_smoke():
  """benchmarks/dev/forward_tiles.py on a tiny shape in Mosaic GPU's interpreter."""
  import forward_tiles
  rows = forward_tiles.main(["--smoke"])
  assert rows and "error" not in rows[0] and rows[0]["relerr"] < 2e-2


@slow_probe
def test_backward_tiles_smoke():
  """benchmarks/dev/backward_tiles.py on MLA's head dims, tiny, in Mosaic GPU's interpreter."""
  import backward_tiles
  rows = backward_tiles.main(["--smoke"])
  assert rows and "error" not in rows[0], rows
  assert max(rows[0]["relerr"].values()) < 2e-2, rows


@slow_probe
def test_ring_masks_smoke(tmp_path):
  """benchmarks/dev/ring_masks.py on the CPU's devices: the ring (segment ids and a mask_mod)
  and the whole call agree."""
  import ring_masks
  rows = ring_masks.main(["--smoke", "--out", str(tmp_path / "ring_masks.json")])
  assert {r["call"] for r in rows} == {"flash_segments", "flash_block_mask", "ring_segments",
                                       "ring_mask_mod", "create_block_mask"}
  assert all(r["reldiff"] < 1e-5 for r in rows if "reldiff" in r)


def test_decode_steps_time_calls_inside_one_executable(tmp_path, monkeypatch):
  """decode.py's ``--steps``: ``in_graph`` makes that many calls in one executable, none merged
  into another although they read the same arrays, and a row's time and kernels are per call
  of the function, not of the executable."""
  import decode
  outs = jax.jit(decode.in_graph(lambda x, y: x * y, 3))(jnp.ones(4), jnp.full(4, 2.0))
  assert len(outs) == 3 and all(np.all(np.asarray(o) == 2.0) for o in outs)
  hlo = jax.jit(decode.in_graph(jnp.sin, 3)).lower(jnp.ones(4)).compile().as_text()
  assert hlo.count(" sine(") == 3
  assert decode.in_graph(jnp.sin, 1) is jnp.sin
  one_executable = [(0, 20000, "kernel"), (20000, 22000, "fusion"),
                    (22000, 42000, "kernel"), (42000, 44000, "fusion")]
  monkeypatch.setattr(decode, "gpu_events",
                      lambda fn, args, calls: {"/device:GPU:0": one_executable * calls})
  out = tmp_path / "decode.json"
  decode.main(["--smoke", "--profile", "--steps", "2", "--impls", "jaxflash", "--out", str(out)])
  for row in json.loads(out.read_text())["rows"]:
    assert "failed" not in row and row["steps"] == 2 and row["us"] > 0
    assert row["kernels"] == [dict(name="kernel", us=20.0, count=1),
                              dict(name="fusion", us=2.0, count=1)]


def test_ab_trees_runs_each_arm_against_its_own_tree(tmp_path):
  """benchmarks/dev/ab_trees.py: the old arm imports the old tree and the new arm this one, even
  though the script lives in this tree (the trap of 2026-12-05's A/B); rounds alternate."""
  import ab_trees
  old = tmp_path / "old_tree"
  (old / "jaxflash").mkdir(parents=True)
  (old / "jaxflash" / "__init__.py").write_text("VERSION = 'old'\n")
  script = tmp_path / "which.py"
  script.write_text("import sys, jaxflash\n"
                    "print(getattr(jaxflash, 'VERSION', 'new'), sys.argv[1:], jaxflash.__file__)\n")
  runs = ab_trees.main(["--old", str(old), "--rounds", "2", "--logs", str(tmp_path / "logs"),
                        str(script), "--", "--out", "x_{arm}_{round}.json"])
  assert [(r["round"], r["arm"]) for r in runs] == [(1, "old"), (1, "new"), (2, "new"), (2, "old")]
  for r in runs:
    assert r["exit"] == 0
    words = Path(r["log"]).read_text().split()
    assert words[0] == r["arm"], words
    assert f"'x_{r['arm']}_{r['round']}.json']" in words, words
    tree = old if r["arm"] == "old" else BENCHMARKS.parent
    assert Path(words[-1]).resolve().is_relative_to(tree.resolve()), words


def test_ab_trees_unpacks_a_revision(tmp_path):
  import ab_trees
  if subprocess.run(["git", "-C", str(BENCHMARKS.parent), "rev-parse", "HEAD"],
                    capture_output=True).returncode:
    pytest.skip("not a git checkout")
  root = ab_trees.unpack("HEAD", tmp_path)
  assert (root / "jaxflash" / "attention.py").read_text().startswith('"""')
