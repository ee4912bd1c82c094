"""What ptxas makes of the Mosaic GPU forward (run on a GPU machine): per config, the registers,
spills and stack of each kernel, ptxas's warnings (a serialised wgmma shows there), and the
local-memory loads and stores (LDL/STL) in the SASS. Each config compiles in its own process
with Mosaic GPU's dump variables pointing at ``--dumps``/<name>; ``--out`` receives one
``<name>.sass`` / ``<name>.ptx`` per config named in ``--sass`` / ``--ptx`` and ``summary.txt`` (the summary, then each config's
ptxas report and resource usage), few files, as the device tool returns at most eight.

  python3 benchmarks/ptxas_probe.py --out /tmp/probe --sass d128_default
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
    "d128_default": (128, False, {}),
    "d128_overlap": (128, False, dict(intra_wg_overlap=True)),
    "d128_persistent": (128, False, dict(persistent_ctas=132)),
    "d128_overlap_persistent": (128, False, dict(intra_wg_overlap=True, persistent_ctas=132)),
    "d256_default": (256, False, {}),
    "d256_overlap64": (256, False, dict(block_kv=64, intra_wg_overlap=True)),
    "d64_default": (64, False, {}),
    "d64_overlap": (64, False, dict(intra_wg_overlap=True)),
}


def compile_one(name: str) -> None:
  import jax
  import jax.numpy as jnp
  from jaxflash.attention import attention_with_config
  from jaxflash.backends import mosaic

  d, causal, kwargs = CONFIGS[name]
  config = mosaic.Config(**kwargs)
  q = jax.random.normal(jax.random.key(0), (2, 2048, 8, d), jnp.bfloat16)
  out = jax.jit(lambda q: attention_with_config(q, q, q, is_causal=causal, config=config,
                                                implementation="mosaic"))(q)
  out.block_until_ready()


def summarise(folder: Path, log: str) -> str:
  text = log + "".join(p.read_text(errors="replace") for p in sorted(folder.rglob("*"))
                       if p.is_file() and p.stat().st_size < 50_000_000)
  regs = sorted(set(re.findall(r"Used (\d+) registers", text)))
  spills = sorted(set(re.findall(r"(\d+ bytes spill stores, \d+ bytes spill loads)", text)))
  stack = sorted(set(re.findall(r"(\d+) bytes stack frame", text)))
  warnings = sorted(set(re.findall(r"(?i)((?:warning|performance|C75\d\d)[^\n]*)", text)))
  ldl = len(re.findall(r"\bLDL\b", text))
  stl = len(re.findall(r"\bSTL\b", text))
  return (f"registers {regs} stack {stack} spills {spills} LDL {ldl} STL {stl}\n    "
          + "\n    ".join(w[:300] for w in warnings[:8]))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--one", help=argparse.SUPPRESS)  # the child: compile this config
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
  parser.add_argument("--dumps", default="/tmp/ptxas_probe_dumps")
  parser.add_argument("--sass", nargs="*", default=[], help="configs whose SASS to keep")
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
               MOSAIC_GPU_DUMP_SASS="1", MOSAIC_GPU_DUMP_PTX="1")
    run = subprocess.run([sys.executable, __file__, "--out", args.out, "--one", name], env=env,
                         capture_output=True, text=True, timeout=300)
    log = run.stdout + run.stderr
    (folder / "log.txt").write_text(log)
    errors = [line for line in log.splitlines() if "Error" in line]
    status = "ok" if run.returncode == 0 else f"FAILED ({errors[-1:]})"
    lines.append(f"{name}: {status}\n    {summarise(folder, log)}")
    print(lines[-1], flush=True)
    for p in sorted(folder.iterdir()):
      if p.suffix in (".ptxas",) or p.name.endswith("resources.txt"):
        reports.append(f"==== {name}: {p.name}\n{p.read_text(errors='replace')}")
      if p.suffix == ".sass" and name in args.sass:
        (out / f"{name}.sass").write_text(p.read_text(errors="replace"))
      if p.suffix == ".ptx" and name in args.ptx:
        (out / f"{name}.ptx").write_text(p.read_text(errors="replace"))
    files = ", ".join(f"{p.name} ({p.stat().st_size} B)" for p in sorted(folder.iterdir()))
    reports.append(f"==== {name}: files {files}")
  summary = "\n".join(["== ptxas summary =="] + lines)
  (out / "summary.txt").write_text(summary + "\n\n" + "\n".join(reports))
  print("\n" + summary)


if __name__ == "__main__":
  main()
