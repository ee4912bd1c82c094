"""What ptxas makes of the Mosaic GPU forward (run on a GPU machine): per config, the registers,
spills and stack frame, and ptxas's warnings and notes (a serialised wgmma shows there as
C7513). Each config compiles in its own process with Mosaic GPU's dump variables pointing at
``--dumps``/<name>; ``--out`` receives ``summary.txt`` (the summary, then each config's ptxas
report) and a ``<name>.ptx`` for each config named in ``--ptx``: few files, as the device tool
returns at most eight. (Mosaic GPU wrote no SASS on the H200 machine: it has no disassembler.)

  python3 benchmarks/dev/ptxas_probe.py --out /tmp/probe --ptx d128_overlap
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

# name -> (head dim, causal, Config keyword arguments)
CONFIGS = {
    "d128": (128, False, {}),
    "d128_overlap": (128, False, dict(intra_wg_overlap=True)),
    "d128_persistent": (128, False, dict(persistent_ctas=132)),
    "d128_overlap_persistent": (128, False, dict(intra_wg_overlap=True, persistent_ctas=132)),
    "d256_kv64": (256, False, dict(block_kv=64)),
    "d256_kv64_overlap": (256, False, dict(block_kv=64, intra_wg_overlap=True)),
    "d64": (64, False, {}),
    # The FP8 forward (``fp8_`` names: e4m3 inputs, no descales).
    "fp8_d128_kv128": (128, False, dict(block_kv=128)),
    "fp8_d128_kv256": (128, False, dict(block_kv=256)),
    "fp8_d128_kv128_overlap": (128, False, dict(block_kv=128, intra_wg_overlap=True)),
    "fp8_d256_kv64_overlap": (256, False, dict(block_kv=64, intra_wg_overlap=True)),
    "d64_overlap": (64, False, dict(intra_wg_overlap=True)),
    # The backward (``bwd_`` names compile the gradient: the forward, dQ and dK/dV kernels).
    "bwd_d64": (64, True, dict(backward=dict(dkv_block_q=128, dq_block_kv=128))),
    "bwd_d128": (128, True, {}),
    "bwd_d128_q128": (128, True, dict(backward=dict(dkv_block_q=128))),
    "bwd_d128_kv128": (128, True, dict(backward=dict(dq_block_kv=128))),
    "bwd_d128_r240": (128, True, dict(backward=dict(registers=240))),
    "bwd_d128_full": (128, False, {}),
    # dQ from the dK/dV kernel (`Backward.one_pass`, experimental). These compile and then run
    # once: with one_pass they can hang on the GPU (see backward._DqPart).
    "bwd_d64_one_pass": (64, True, dict(backward=dict(dkv_block_q=128, dq_block_kv=128,
                                                      one_pass=True))),
    "bwd_d128_one_pass": (128, True, dict(backward=dict(one_pass=True))),
    "bwd_d128_one_pass_r240": (128, True, dict(backward=dict(one_pass=True, registers=240))),
    # Head dims above 128: dK/dV in two passes; at 256, 32-row streamed tiles, with a 64-row dV
    # pass or 240 consumer registers.
    "bwd_d192": (192, True, dict(block_kv=64)),
    "bwd_d256": (256, True, dict(block_kv=64, backward=dict(dkv_block_q=32, dq_block_kv=32))),
    "bwd_d256_dv64": (256, True, dict(block_kv=64, backward=dict(
        dkv_block_q=32, dq_block_kv=32, dv_block_q=64))),
    "bwd_d256_r240": (256, True, dict(block_kv=64, backward=dict(
        dkv_block_q=32, dq_block_kv=32, registers=240))),
}


def compile_one(name: str) -> None:
  import jax
  import jax.numpy as jnp
  from jaxflash.attention import attention_with_config
  from jaxflash.backends import mosaic

  d, causal, kwargs = CONFIGS[name]
  if "backward" in kwargs:
    kwargs = dict(kwargs, backward=mosaic.config.Backward(**kwargs["backward"]))
  config = mosaic.Config(**kwargs)
  q = jax.random.normal(jax.random.key(0), (2, 2048, 8, d), jnp.bfloat16)
  if name.startswith("fp8_"):
    q = q.astype(jnp.float8_e4m3fn)

  def attend(q):
    return attention_with_config(q, q, q, is_causal=causal, config=config,
                                 implementation="mosaic")

  if name.startswith("bwd_"):
    out = jax.jit(jax.grad(lambda q: jnp.sum(attend(q).astype(jnp.float32))))(q)
  else:
    out = jax.jit(attend)(q)
  out.block_until_ready()


def summarise(report: str) -> str:
  regs = sorted(set(re.findall(r"Used (\d+) registers", report)))
  spills = sorted(set(re.findall(r"(\d+ bytes spill stores, \d+ bytes spill loads)", report)))
  stack = sorted(set(re.findall(r"(\d+) bytes stack frame", report)))
  notes = sorted(set(re.findall(r"(?i)((?:warning|performance|C75\d\d)[^\n]*)", report)))
  return (f"registers {regs} stack {stack} spills {spills}\n    "
          + "\n    ".join(note[:300] for note in notes[:8]))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--one", help=argparse.SUPPRESS)  # the child: compile this config
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
  parser.add_argument("--dumps", default="/tmp/ptxas_probe_dumps")
  parser.add_argument("--ptx", nargs="*", default=[], help="configs whose PTX to keep")
  args = parser.parse_args()
  if args.one:
    compile_one(args.one)
    return
  lines, reports = [], []
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  for name in args.configs:
    folder = Path(args.dumps) / name
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MOSAIC_GPU_DUMP_TO=str(folder), MOSAIC_GPU_DUMP_PTXAS="1",
               MOSAIC_GPU_DUMP_PTX="1")
    run = subprocess.run([sys.executable, __file__, "--out", args.out, "--one", name], env=env,
                         capture_output=True, text=True, timeout=300)
    log = run.stdout + run.stderr
    errors = [line for line in log.splitlines() if "Error" in line]
    report = "".join(p.read_text(errors="replace") for p in sorted(folder.glob("*.ptxas")))
    status = "ok" if run.returncode == 0 else f"FAILED ({errors[-1:]})"
    lines.append(f"{name}: {status}\n    {summarise(report)}")
    print(lines[-1], flush=True)
    reports.append(f"==== {name}\n{report}")
    if name in args.ptx:
      for p in folder.glob("*.ptx"):
        (out / f"{name}.ptx").write_text(p.read_text(errors="replace"))
  summary = "\n".join(["== ptxas summary =="] + lines)
  (out / "summary.txt").write_text(summary + "\n\n" + "\n".join(reports))
  print("\n" + summary)


if __name__ == "__main__":
  main()
