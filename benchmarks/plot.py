"""Plots of benchmark results, written next to the JSON.

    python benchmarks/plot.py benchmarks/results/h200/grid.json     # -> grid_bf16.png, ...
    python benchmarks/plot.py benchmarks/results/h200/memory.json   # -> memory.png
    python benchmarks/plot.py benchmarks/results/h200/decode.json   # -> decode.png
    python benchmarks/plot.py benchmarks/results/h200/masks.json    # -> masks.png

Speed results (bench.py): one figure per dtype; a row of panels per head dim (and one per GQA
shape, titled e.g. "GQA 32/8 D=128"), a column per (causal, mode); TFLOP/s against sequence
length, one line per implementation, an x where a result was flagged wrong. Memory results
(memory.py): peak device memory and compiled temp bytes against S, log-log, one line per
implementation, an X at its first failure. Decoding results (decode.py): TB/s per cell as bars.
Masks results (masks.py): TFLOP/s on visible entries per case as bars, forward and fwd+bwd.
Colours follow the implementation everywhere. Files that join several runs (`report.join`) are
drawn from the latest run of each cell. bench.py, memory.py and decode.py call the plotting
functions directly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker
from matplotlib.lines import Line2D

import report

# Fixed order, so an implementation keeps its colour across panels, figures and runs.
IMPL_ORDER = ("jaxflash_triton", "jaxflash_xla", "xla", "cudnn", "pallas_mha",
              "jaxflash_mosaic", "cudnn_det")  # appended last: earlier plots keep their colours
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def colours(impls) -> dict[str, str]:
  """A tab10 colour per implementation: the known ones by fixed position, others after them."""
  names = list(IMPL_ORDER) + [i for i in impls if i not in IMPL_ORDER]
  palette = plt.get_cmap("tab10").colors
  return {name: matplotlib.colors.to_hex(palette[i % len(palette)]) for i, name in
          enumerate(names)}


def _seq_label(s: int) -> str:
  return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def _seq_axis(ax, seqs) -> None:
  ax.set_xscale("log", base=2)
  ticks = sorted(set(seqs))
  ax.set_xticks(ticks, [_seq_label(s) for s in ticks])
  ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
  ax.set_xlabel("sequence length")
  ax.grid(alpha=0.3)


def _legend(fig, colour: dict[str, str], impls, extra=()) -> None:
  handles = [Line2D([], [], color=colour[i], marker="o", label=i) for i in impls]
  fig.legend(handles=handles + list(extra), loc="lower center", ncol=len(handles) + len(extra),
             fontsize=9, frameon=False)


def plot_speed(result: dict, stem) -> list[Path]:
  """One PNG per dtype, ``<stem>_<dtype>.png``; returns the paths."""
  rows = [r for r in report.current_rows(result) if r.get("mode")]
  cfg = next(iter(report.runs(result).values())).get("config", {})
  colour = colours(dict.fromkeys(r["impl"] for r in rows))
  paths = []
  for dtype in dict.fromkeys(r["dtype"] for r in rows):
    sub = [r for r in rows if r["dtype"] == dtype]
    impls = [i for i in colour if any(r["impl"] == i for r in sub)]
    # A panel row per (GQA?, N, K, D), MHA first; a column per (causal, mode).
    groups = sorted({(r.get("K", r["N"]) != r["N"], r["D"], r["N"], r.get("K", r["N"]))
                     for r in sub})
    columns = sorted({(r["causal"], r["mode"]) for r in sub})
    fig, axes = plt.subplots(len(groups), len(columns), squeeze=False,
                             figsize=(4 * len(columns), 3.1 * len(groups) + 0.9))
    for (gqa, d, n, k), ax_row in zip(groups, axes):
      for (causal, mode), ax in zip(columns, ax_row):
        cell = [r for r in sub if (r["D"], r["N"], r.get("K", r["N"]), r["causal"], r["mode"])
                == (d, n, k, causal, mode)]
        if not cell:
          ax.axis("off")
          continue
        for impl in impls:
          good = sorted((r["S"], r["tflops"]) for r in cell if r["impl"] == impl
                        and r.get("tflops") and not r.get("wrong"))
          bad = sorted((r["S"], r["tflops"]) for r in cell if r["impl"] == impl
                       and r.get("tflops") and r.get("wrong"))
          if good:
            ax.plot(*zip(*good), color=colour[impl], marker="o", markersize=4)
          if bad:
            ax.scatter(*zip(*bad), color=colour[impl], marker="x", s=50)
        name = f"GQA {n}/{k} D={d}" if gqa else f"D={d}"
        ax.set_title(f"{name} {'causal' if causal else 'full'} {mode}", fontsize=10)
        _seq_axis(ax, [r["S"] for r in cell])
        ax.set_ylabel("TFLOP/s")
        ax.set_ylim(bottom=0)
    wrong = Line2D([], [], color="grey", marker="x", linestyle="", label="wrong result")
    _legend(fig, colour, impls, [wrong] if any(r.get("wrong") for r in sub) else [])
    paths.append(_save(fig, f"{report.describe(result)}: "
                       f"{SHORT_DTYPE.get(dtype, dtype)}, {cfg.get('tokens', 16384)} "
                       f"tokens/batch, hidden {cfg.get('hidden', 2048)}",
                       Path(f"{stem}_{SHORT_DTYPE.get(dtype, dtype)}.png"), legend_height=0.05))
  return paths


def plot_memory(result: dict, stem) -> Path:
  """Peak device memory and compiled temp bytes against S in ``<stem>.png``; returns the path."""
  rows, cfg = result["rows"], next(iter(report.runs(result).values())).get("config", {})
  colour = colours(dict.fromkeys(r["impl"] for r in rows))
  impls = [i for i in colour if any(r["impl"] == i for r in rows)]
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
  panels = (("peak_bytes", "peak device memory of one step"), ("temp_bytes", "compiled temp bytes"))
  for ax, (key, title) in zip(axes, panels):
    drawn = False
    for impl in impls:
      mine = sorted((r for r in rows if r["impl"] == impl), key=lambda r: r["S"])
      ok = [(r["S"], r[key] / 1e9) for r in mine if not r.get("error") and r.get(key)]
      if ok:
        ax.plot(*zip(*ok), color=colour[impl], marker="o", markersize=4)
        drawn = True
      failed = next((r for r in mine if r.get("error")), None)
      # The X sits at the bytes the failing step was compiled for when known (what it would
      # have needed), else at the last value that fitted.
      y = failed and (failed.get("temp_bytes") / 1e9 if failed.get("temp_bytes")
                      else (ok[-1][1] if ok else None))
      if y:
        ax.scatter([failed["S"]], [y], color=colour[impl], marker="X", s=90, zorder=3)
    if not drawn:
      ax.text(0.5, 0.5, "not reported on this platform", transform=ax.transAxes, ha="center")
    ax.set_yscale("log")
    _seq_axis(ax, [r["S"] for r in rows])
    ax.set_ylabel("GB (1e9 bytes)")
    ax.set_title(title, fontsize=10)
  fail = Line2D([], [], color="grey", marker="X", linestyle="", label="first failure")
  _legend(fig, colour, impls, [fail])
  return _save(fig, f"{report.describe(result)}: fwd+bwd memory, "
               f"B={cfg.get('batch', 1)}, {cfg.get('heads', '?')} heads, D={cfg.get('head_dim')}, "
               f"{cfg.get('dtype', '')}, {'causal' if cfg.get('causal', True) else 'full'}",
               Path(f"{stem}.png"), legend_height=0.07)


def plot_decode(result: dict, stem) -> Path:
  """Decoding results (decode.py) in ``<stem>.png``: a panel per (T, heads, head dim, layout),
  TB/s of each implementation per (B, S) cell as bars, the measured copy as a black tick."""
  rows = [r for r in result["rows"] if "tb_s" in r and r["impl"] != "tune"]
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  colour = colours(impls)
  dims = report.decode_dims
  panels = sorted({(r["T"], r["N"], r["K"], dims(r), r["layout"]) for r in rows})
  fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.2 * len(panels)), squeeze=False)
  for ax, (t, n, k, d, layout) in zip(axes[:, 0], panels):
    mine = [r for r in rows if (r["T"], r["N"], r["K"], dims(r), r["layout"]) ==
            (t, n, k, d, layout)]
    cells = sorted({(r["B"], r["S"]) for r in mine})
    width = 0.8 / len(impls)
    for j, impl in enumerate(impls):
      for x, cell in enumerate(cells):
        found = [r for r in mine if r["impl"] == impl and (r["B"], r["S"]) == cell]
        if found:  # (a joined file's rows run oldest first: its latest run's)
          ax.bar(x - 0.4 + (j + 0.5) * width, found[-1]["tb_s"], width, color=colour[impl])
    for x, cell in enumerate(cells):
      copy = [r["copy_tb_s"] for r in mine if (r["B"], r["S"]) == cell][-1]
      ax.plot([x - 0.45, x + 0.45], [copy, copy], color="black", lw=1.5)
    ax.set_xticks(range(len(cells)), [f"B={b} S={_seq_label(s)}" for b, s in cells])
    ax.set_ylabel("TB/s of K, V read")
    ax.set_title(f"T={t} N/K={n}/{k} D={d} {layout}", fontsize=10)
  _legend(fig, colour, impls, [Line2D([], [], color="black", label="copy (read + write)")])
  return _save(fig, f"Decoding, {report.describe(result)}",
               Path(f"{stem}.png"), 0.9 / (3.2 * len(panels)))


def plot_masks(result: dict, stem) -> Path:
  """Masks results (masks.py) in ``<stem>.png``: a panel per mode (fwd, fwd+bwd), TFLOP/s on
  visible entries per case as bars, side by side for the implementations that ran it, each
  labelled with its rate; an x over a wrong result. jaxflash's ways are shades of blue. Of
  joined runs, each cell's latest."""
  rows = [r for r in report.current_rows(result, key=report.case_key)
          if r.get("mode") in ("fwd", "fwdbwd")]
  cases = list(dict.fromkeys(r["case"] for r in rows))
  order = ("jaxflash", "jaxflash_segments", "jaxflash_mask_mod", "cudnn", "xla")
  impls = sorted(dict.fromkeys(r["impl"] for r in rows),
                 key=lambda i: order.index(i) if i in order else len(order))
  colour = colours(impls)
  colour.update({"jaxflash": "#1f77b4", "jaxflash_segments": "#6baed6",
                 "jaxflash_mask_mod": "#08306b"})
  most = max(1, max(len({r["impl"] for r in rows if r["case"] == c}) for c in cases))
  fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 1.4 * len(cases) + 2), 7.5), squeeze=False)
  width = 0.8 / most
  for ax, mode in zip(axes[:, 0], ("fwd", "fwdbwd")):
    for x, case in enumerate(cases):
      mine = [i for i in impls if any(r["case"] == case and r["impl"] == i for r in rows)]
      for j, impl in enumerate(mine):
        found = [r for r in rows if (r["case"], r["impl"], r["mode"]) == (case, impl, mode)
                 and r.get("visible_tflops")]
        if not found:
          continue
        at = x + (j - (len(mine) - 1) / 2) * width
        rate = found[0]["visible_tflops"]
        ax.bar(at, rate, width, color=colour[impl])
        ax.annotate(f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}", (at, rate),
                    ha="center", va="bottom", fontsize=7)
        if found[0].get("wrong"):
          ax.scatter([at], [rate / 2], color="black", marker="x", s=40, zorder=3)
    ax.set_xticks(range(len(cases)), cases, fontsize=9)
    ax.set_ylabel("TFLOP/s on visible entries")
    ax.set_title({"fwd": "forward", "fwdbwd": "forward + backward"}[mode], fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.12)
  wrong = Line2D([], [], color="black", marker="x", linestyle="", label="wrong result")
  _legend(fig, colour, impls, [wrong] if any(r.get("wrong") for r in rows) else [])
  return _save(fig, f"Masks and block sparsity, {report.describe(result)}",
               Path(f"{stem}.png"), legend_height=0.06)


def _save(fig, title: str, path: Path, legend_height: float) -> Path:
  """Titles, lays out (leaving ``legend_height`` of the figure for the shared legend), writes and
  closes ``fig``; returns ``path``."""
  fig.suptitle(title)
  fig.tight_layout(rect=(0, legend_height, 1, 1))
  fig.savefig(path, dpi=80)
  plt.close(fig)
  return path


def main(argv: list[str] | None = None) -> list[Path]:
  """Plots each results JSON given (speed or memory, told apart by its contents)."""
  paths = []
  for name in (sys.argv[1:] if argv is None else argv):
    data = json.loads(Path(name).read_text())
    stem = Path(name).with_suffix("")
    if data.get("kind") == "masks":
      paths.append(plot_masks(data, stem))
    elif data.get("kind") == "memory" or "longest_s" in data:
      paths.append(plot_memory(data, stem))
    elif any("tb_s" in r for r in data.get("rows", [])):
      paths.append(plot_decode(data, stem))
    else:
      paths += plot_speed(data, stem)
  for path in paths:
    print(path)
  return paths


if __name__ == "__main__":
  main()
