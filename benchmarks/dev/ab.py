"""Same-run A/B of two bench.py results (e.g. before and after a change, run back to back on the
same card): TFLOP/s of each side and their ratio, per case and mode, plus the median ratio.

    python benchmarks/dev/ab.py BEFORE.json AFTER.json --impl jaxflash_triton --out ab.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# The user benchmarks' helpers live one folder up (scripts, not a package).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from report import row_key  # noqa: E402


def compare(before: dict, after: dict, impl: str) -> tuple[list[dict], dict]:
  """Rows present on both sides for ``impl``: (key fields, before, after, ratio after/before)."""
  old = {row_key(r): r for r in before["rows"] if r.get("impl") == impl}
  rows = []
  for r in after["rows"]:
    o = old.get(row_key(r))
    if r.get("impl") != impl or o is None or not r.get("tflops") or not o.get("tflops"):
      continue
    rows.append(dict(mode=r["mode"], dtype=r["dtype"], D=r["D"], S=r["S"], N=r["N"], K=r["K"],
                     causal=r["causal"], before=o["tflops"], after=r["tflops"],
                     ratio=r["tflops"] / o["tflops"], wrong=bool(r.get("wrong") or o.get("wrong"))))
  ratios = [r["ratio"] for r in rows]
  summary = dict(cells=len(rows), median_ratio=statistics.median(ratios) if ratios else None,
                 min_ratio=min(ratios, default=None), max_ratio=max(ratios, default=None))
  return rows, summary


def markdown(rows: list[dict], summary: dict, before: dict, after: dict, impl: str,
             labels: tuple[str, str] | None = None) -> str:
  env = after["environment"]
  labels = labels or (before["environment"].get("git_commit"), env.get("git_commit"))
  lines = [f"# A/B: {impl}, {env['device']}, jax {env['jax']}, {env['date']}", "",
           f"Before: {labels[0]}; after: {labels[1]} (same machine, back to back). TFLOP/s.",
           "",
           f"{summary['cells']} cells; after/before median {summary['median_ratio']:.3f}, "
           f"min {summary['min_ratio']:.3f}, max {summary['max_ratio']:.3f}.", "",
           "| mode | D | S | heads | causal | before | after | after/before |",
           "|---|---|---|---|---|---|---|---|"]
  for r in sorted(rows, key=lambda r: (r["mode"], r["N"] != r["K"], r["D"], r["S"], r["causal"])):
    heads = str(r["N"]) if r["N"] == r["K"] else f"{r['N']}/{r['K']}"
    lines.append(f"| {r['mode']} | {r['D']} | {r['S']} | {heads} | "
                 f"{'y' if r['causal'] else 'n'} | {r['before']:.0f} | {r['after']:.0f} | "
                 f"{r['ratio']:.3f}{' WRONG' if r['wrong'] else ''} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("before")
  parser.add_argument("after")
  parser.add_argument("--impl", default="jaxflash_triton")
  parser.add_argument("--out", help="write the markdown table here (and print it)")
  parser.add_argument("--labels", nargs=2, metavar=("BEFORE", "AFTER"),
                      help="what each side ran (default: the git commits the JSONs record)")
  args = parser.parse_args(argv)
  before, after = (json.loads(Path(p).read_text()) for p in (args.before, args.after))
  rows, summary = compare(before, after, args.impl)
  text = markdown(rows, summary, before, after, args.impl,
                  tuple(args.labels) if args.labels else None)
  if args.out:
    Path(args.out).write_text(text)
  print(text)
  return dict(rows=rows, summary=summary)


if __name__ == "__main__":
  main()
