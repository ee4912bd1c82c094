"""Plot a results JSON from bench.py: TFLOP/s against sequence length, one panel per
(head dim, causal, mode), one line per implementation.

    python benchmarks/plot.py benchmarks/results/h200_2026-11-21.json
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path: str) -> None:
  data = json.load(open(path))
  rows = [r for r in data["rows"] if r.get("tflops")]
  panels = sorted({(r["D"], r["causal"], r["mode"]) for r in rows})
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  cols = 4
  fig, axes = plt.subplots(-(-len(panels) // cols), cols, figsize=(4 * cols, 3.2 * -(-len(panels) // cols)),
                           squeeze=False)
  for ax, (d, causal, mode) in zip(axes.flat, panels):
    for impl in impls:
      pts = sorted((r["S"], r["tflops"]) for r in rows
                   if (r["D"], r["causal"], r["mode"], r["impl"]) == (d, causal, mode, impl))
      if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_title(f"D={d} {'causal' if causal else 'full'} {mode}")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("TFLOP/s")
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=8)
  env = data["environment"]
  fig.suptitle(f"{env['device']}, jax {env['jax']}, {env['date']}, bf16, 16k tokens/batch, hidden 2048")
  fig.tight_layout()
  out = path.rsplit(".", 1)[0] + ".png"
  fig.savefig(out, dpi=80)
  print(out)


if __name__ == "__main__":
  main(sys.argv[1])
