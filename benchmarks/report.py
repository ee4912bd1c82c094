"""Reporting for the benchmarks: the run's environment, where results go, markdown tables, an
optional acceptance floor check, output files (JSON, .md, PNG), and results of several runs joined
into one file.

A results file is what one script run wrote (``environment``, ``config``, ``rows``, ...), or
several such runs joined (`join`): ``runs`` maps each run's name to its environment and config,
and every row names its ``run``. Where two joined runs measured the same thing, both rows stay
and tables and plots take the later run's (`current_rows`).

    python benchmarks/report.py --join a.json b.json --names first second --out joined.json
    python benchmarks/report.py --summary benchmarks/results/h200/grid.json   # README's table
"""

from __future__ import annotations

import datetime
import json
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent
# The floor the Triton backend was built to (`bench.py --floor`; development data).
TRITON_FLOOR = Path(__file__).resolve().parent / "dev" / "floors" / "triton_vs_pallas_mha.json"
# jaxflash_triton first: memory.py learns the platform from the first worker, which must run
# everywhere.
IMPLS = ("jaxflash_triton", "jaxflash_mosaic", "jaxflash_mosaic_atomic", "jaxflash_xla", "xla",
         "cudnn", "cudnn_det", "pallas_mha")
TOKENS, HIDDEN = 16384, 2048
TOLERANCE = 2e-2
FLOP_CONVENTION = "fwd 4*B*N*S^2*D (x0.5 causal); fwdbwd 3.5x fwd; N = query heads"


def case_key(row: dict) -> tuple:
  """What a row of a results file with named cases (masks.py) measured: case, implementation
  and mode."""
  return tuple(row.get(f) for f in ("case", "impl", "mode"))


def row_key(row: dict) -> tuple:
  """What a row measured: implementation, mode and case."""
  return tuple(row.get(f) for f in ("impl", "mode", "dtype", "B", "S", "N", "K", "D", "causal"))


def _command(cmd: list[str]) -> str | None:
  try:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
  except (OSError, subprocess.SubprocessError):
    return None
  return (out.stdout.strip() or None) if out.returncode == 0 else None


def environment() -> dict:
  """Device, driver and library versions, git commit and date of this run."""
  dev = jax.devices()[0]
  try:
    import jaxlib
    jaxlib_version = jaxlib.__version__
  except (ImportError, AttributeError):
    jaxlib_version = None
  env = dict(device=dev.device_kind, platform=dev.platform, device_count=jax.device_count(),
             jax=jax.__version__, jaxlib=jaxlib_version, python=platform.python_version(),
             date=datetime.date.today().isoformat(),
             timestamp=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
             driver=None, cudnn=None)
  if shutil.which("nvidia-smi"):
    driver = _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    env["driver"] = driver.splitlines()[0] if driver else None
  try:
    from jax._src.lib import cuda_versions
    env["cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
  except Exception:  # noqa: BLE001 - private module; absent on CPU-only installs
    env["cudnn"] = None
  env["git_commit"] = _command(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"])
  if env["git_commit"]:
    dirty = _command(["git", "-C", str(REPO_ROOT), "status", "--porcelain",
                      "--untracked-files=no"])
    env["git_dirty"] = bool(dirty)
  return env


def device_slug(kind: str) -> str:
  """A short file-name tag for a device kind: "NVIDIA H100 80GB HBM3" -> "h100", "cpu" -> "cpu"."""
  words = [w for w in re.split(r"[^a-z0-9]+", kind.lower()) if w]
  words = [w for w in words if w not in ("nvidia", "amd", "tesla", "geforce")] or words
  if words and re.fullmatch(r"[a-z]+\d+[a-z]*", words[0]):
    return words[0]  # a model name such as h100, a100, gh200, l40s
  return "-".join(words)[:40] or "device"


def default_out(env: dict, name: str) -> Path:
  """Where a benchmark writes by default: results/<device kind>/<name>.json (e.g.
  results/h200/grid.json); a later run of the same kind replaces it."""
  return RESULTS_DIR / device_slug(env["device"]) / f"{name}.json"


def runs(result: dict) -> dict[str, dict]:
  """Name -> {"environment", "config", ...} of each run a results file holds. A file that one
  script run wrote holds one run, named ""."""
  if "runs" in result:
    return result["runs"]
  return {"": {key: value for key, value in result.items() if key != "rows"}}


def current_rows(result: dict, key=row_key) -> list[dict]:
  """The rows, where several runs measured the same ``key``, only the latest run's (runs in
  the file's order)."""
  order = {name: i for i, name in enumerate(runs(result))}
  latest: dict = {}
  for r in result["rows"]:
    k = key(r)
    if k not in latest or order.get(r.get("run", ""), 0) >= order.get(latest[k].get("run", ""),
                                                                     0):
      latest[k] = r
  return list(latest.values())


def describe(result: dict) -> str:
  """"NVIDIA H200, jax 0.11.2, 2026-11-21 to 2026-11-22" for a file's runs."""
  envs = [run.get("environment", {}) for run in runs(result).values()]

  def values(key):
    return list(dict.fromkeys(str(e[key]) for e in envs if e.get(key)))

  dates = sorted(values("date"))
  when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}" if dates else "?"
  return f"{' / '.join(values('device')) or '?'}, jax {' / '.join(values('jax')) or '?'}, {when}"


def join(named: list[tuple[str, dict]]) -> dict:
  """Results of several runs as one file: their runs by name, in the order given (a result that
  holds one run takes the name given with it), and every row with its run's name first. Nothing
  is dropped or changed."""
  joined_runs, rows = {}, []
  for name, result in named:
    for run_name, run in runs(result).items():
      full = run_name or name
      if full in joined_runs:
        raise ValueError(f"two runs named {full!r}")
      joined_runs[full] = run
    for r in result["rows"]:
      rows.append({"run": r.get("run") or name, **{k: v for k, v in r.items() if k != "run"}})
  kinds = [result["kind"] for _, result in named if result.get("kind")]
  return dict(({"kind": kinds[0]} if kinds else {}), runs=joined_runs, rows=rows)


def decode_dims(r: dict) -> str:
  """A decoding row's head dims as tables and plots show them: "D", or "D/Dv" where V's
  differs ("D/Dv latent": the values are the keys' first Dv features, one cache)."""
  text = f"{r['D']}/{r['Dv']}" if "Dv" in r else f"{r['D']}"
  return text + (" latent" if r.get("values_in_keys") else "")


def _short_dtype(name: str) -> str:
  return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(name, name)


def _find(rows: list[dict], **want) -> dict | None:
  for r in rows:
    if all(r.get(key) == value for key, value in want.items()):
      return r
  return None


def _rate(row: dict | None) -> float | None:
  """TFLOP/s of a row that ran and was right; None otherwise."""
  if row is None or row.get("wrong") or not row.get("tflops"):
    return None
  return row["tflops"]


def load_floor(path: str | Path = TRITON_FLOOR) -> dict:
  """An acceptance floor (a JSON file such as benchmarks/dev/floors/*.json): which cells to check
  and what they need. The thresholds are data, so bench.py carries no target numbers."""
  return json.loads(Path(path).read_text())


def floor_summary(rows: list[dict], floor: dict | None = None) -> list[dict]:
  """One entry per check of ``floor`` (default: the Triton floor), with status pass, miss or
  missing."""
  floor = floor or load_floor()
  impl, ratio, absolute = floor["impl"], floor["ratio"], floor["tflops"]
  same_heads = [r for r in rows
                if r.get("dtype") == floor["dtype"] and r.get("K", r["N"]) == r["N"]]
  checks = []
  for d in ratio["head_dims"]:
    for s in ratio["seqs"]:
      for causal in (False, True):
        for mode, need in ratio["need"].items():
          key = dict(D=d, S=s, causal=causal, mode=mode)
          ours = _rate(_find(same_heads, impl=impl, **key))
          theirs = _rate(_find(same_heads, impl=ratio["against"], **key))
          value = ours / theirs if ours and theirs else None
          checks.append(dict(check=f"{mode} vs {ratio['against']}", **key, value=value,
                             need=need))
  for cell in absolute["cells"]:
    for causal in (False, True):
      key = dict(cell, causal=causal, mode=absolute["mode"])
      checks.append(dict(check=f"{absolute['mode']} TFLOP/s", **key, need=absolute["need"],
                         value=_rate(_find(same_heads, impl=impl, **key))))
  for c in checks:
    c["status"] = "missing" if c["value"] is None else (
        "pass" if c["value"] >= c["need"] else "miss")
  return checks


def floor_text(floor: list[dict], impl: str = "jaxflash_triton") -> str:
  counts = {s: sum(c["status"] == s for c in floor) for s in ("pass", "miss", "missing")}
  lines = [(f"Floor ({impl}, bf16): {counts['pass']} pass, {counts['miss']} miss, "
            f"{counts['missing']} missing"), "",
           "| check | D | S | causal | value | need | status |", "|---|---|---|---|---|---|---|"]
  for c in floor:
    ratio = " vs " in c["check"]
    value = "-" if c["value"] is None else (
        f"{c['value']:.2f}x" if ratio else f"{c['value']:.0f}")
    need = f">= {c['need']:.2f}x" if ratio else f">= {c['need']:.0f}"
    lines.append(f"| {c['check']} | {c['D']} | {c['S']} | {'y' if c['causal'] else 'n'} | "
                 f"{value} | {need} | {c['status']} |")
  return "\n".join(lines)


def _cell(row: dict | None) -> str:
  if row is None:
    return "-"
  if row.get("skipped"):
    return "n/a"
  if row.get("error") or row.get("tflops") is None:
    return "err"
  rate = row["tflops"]
  text = f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"  # CPU smoke runs are far below 1
  if row.get("repeatable") is False:  # a second call gave different gradient bits
    text += " nondet"
  return text + (" WRONG" if row.get("wrong") else "")


def _rate_text(row: dict | None) -> str:
  """TFLOP/s of a row that ran and was right, rounded; "-" otherwise."""
  rate = _rate(row)
  return "-" if rate is None else f"{rate:.0f}"


def table(rows: list[dict]) -> str:
  """Markdown TFLOP/s tables, one per dtype: rows heads/D/S/causal/mode, one column per impl."""
  rows = [r for r in rows if "mode" in r]
  impls = sorted(dict.fromkeys(r["impl"] for r in rows),
                 key=lambda i: IMPLS.index(i) if i in IMPLS else len(IMPLS))
  out = []
  for dtype in dict.fromkeys(r["dtype"] for r in rows):
    sub = [r for r in rows if r["dtype"] == dtype]
    cells = {}
    for r in sub:
      k = r.get("K", r["N"])
      heads = str(r["N"]) if k == r["N"] else f"{r['N']}/{k}"
      cells[(k != r["N"], heads, r["D"], r["S"], r["causal"], r["mode"], r["impl"])] = r
    keys = sorted({key[:6] for key in cells}, key=lambda key: (key[0], key[2], key[3], key[4],
                                                               key[5], key[1]))
    out += [f"TFLOP/s, {_short_dtype(dtype)} (heads: query heads, or query/KV heads for GQA)", "",
            "| heads | D | S | causal | mode | " + " | ".join(impls) + " |",
            "|---|---|---|---|---|" + "---|" * len(impls)]
    for key in keys:
      _, heads, d, s, causal, mode = key
      out.append(f"| {heads} | {d} | {s} | {'y' if causal else 'n'} | {mode} | "
                 + " | ".join(_cell(cells.get(key + (i,))) for i in impls) + " |")
    out.append("")
  return "\n".join(out).rstrip()


def _case_text(r: dict) -> str:
  k = r.get("K", r["N"])
  heads = str(r["N"]) if k == r["N"] else f"{r['N']}/{k}"
  return (f"{r['impl']} {r.get('mode')} {_short_dtype(r.get('dtype', '?'))} heads={heads} "
          f"D={r['D']} S={r['S']} causal={'y' if r['causal'] else 'n'}")


def problems(rows: list[dict]) -> list[str]:
  lines = [f"ERROR {_case_text(r)}: {r['error'][:150]}" for r in rows if r.get("error")]
  for r in rows:
    if r.get("wrong"):
      lines.append(f"WRONG {_case_text(r)}: relerr={r.get('relerr')} "
                   f"relerr_dq={r.get('relerr_dq')} (tolerance {TOLERANCE})")
  return lines


def markdown(result: dict) -> str:
  cfg = next(iter(runs(result).values())).get("config", {})
  head = (f"# Attention speed: {describe(result)}\n\n"
          f"{cfg.get('tokens', TOKENS)} tokens per batch, hidden {cfg.get('hidden', HIDDEN)}. "
          f"FLOPs: {FLOP_CONVENTION}. `err`: failed (see the JSON), `n/a`: not applicable, "
          f"WRONG: relative error over {TOLERANCE}.")
  if len(runs(result)) > 1:
    head += " Rows from several runs (the JSON's `runs`); where two measured a cell, the later."
  parts = [head + "\n", table(current_rows(result))]
  if result.get("floor"):
    parts += ["", floor_text(result["floor"])]
  issues = problems(result["rows"])
  if issues:
    parts += ["", "Problems:", ""] + [f"- {line}" for line in issues]
  return "\n".join(parts) + "\n"


def write_table(result: dict, out: Path, markdown_of=None) -> list[Path]:
  """The JSON and a .md beside it (``markdown_of(result)``, the grid's by default)."""
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1) + "\n")
  md = out.with_suffix(".md")
  md.write_text((markdown_of or markdown)(result))
  return [out, md]


def write_outputs(result: dict, out: Path, markdown_of=None, plots_of=None) -> list[Path]:
  """`write_table`, and the PNG plots (``plots_of(plot_module, result, stem)`` -> paths, the
  grid's speed plots by default; skipped with a note without matplotlib)."""
  written = write_table(result, out, markdown_of)
  try:
    import plot
  except ImportError as e:
    print(f"no plots: {e}", file=sys.stderr)
  else:
    plots_of = plots_of or (lambda module, result, stem: module.plot_speed(result, stem))
    written += plots_of(plot, result, out.with_suffix(""))
  return written


def join_files(paths: list[str], names: list[str] | None = None) -> dict:
  """`join` of results files, each run named by ``names`` (default: the file names' stems, with
  _2, _3, ... where a stem repeats)."""
  if not names:
    names = []
    for path in paths:
      stem, n = Path(path).stem, 1
      while (name := stem if n == 1 else f"{stem}_{n}") in names:
        n += 1
      names.append(name)
  if len(names) != len(paths):
    raise ValueError("one name per file")
  results = [json.loads(Path(p).read_text()) for p in paths]
  devices = {run.get("environment", {}).get("device") for res in results
             for run in runs(res).values()}
  if len(devices) > 1:
    print(f"warning: joining results of different devices {sorted(map(str, devices))}",
          file=sys.stderr)
  return join(list(zip(names, results)))


def summary_table(result: dict, impl: str = "jaxflash_mosaic", dtype: str = "bfloat16",
                  seqs=(1024, 4096, 16384), hidden: int = 2048) -> str:
  """The README's table: TFLOP/s of ``impl`` and cuDNN per (head dim, S, causal), forward and
  forward+backward, and cuDNN made deterministic; the latest run of each (`current_rows`). The
  grid's MHA cells only: ``hidden`` = heads x head dim (not GQA, nor the Llama shape's MHA
  twin of `bench.py --llama-mha`)."""
  rows = [r for r in current_rows(result) if r.get("dtype") == dtype
          and r.get("K", r["N"]) == r["N"] and r["N"] * r["D"] == hidden and r["S"] in seqs]
  cells = {(r["impl"], r["mode"], r["D"], r["S"], r["causal"]): r for r in rows}
  columns = [(impl, "fwd"), ("cudnn", "fwd"), (impl, "fwdbwd"), ("cudnn", "fwdbwd"),
             ("cudnn_det", "fwdbwd")]
  lines = ["| D | S | causal | fwd: jaxflash | fwd: cuDNN | fwd+bwd: jaxflash | fwd+bwd: cuDNN "
           "| fwd+bwd: cuDNN deterministic |", "|---|---|---|---|---|---|---|---|"]
  for d in sorted({r["D"] for r in rows}):
    for s in seqs:
      for causal in (False, True):
        values = [_rate_text(cells.get((i, m, d, s, causal))) for i, m in columns]
        if all(v == "-" for v in values):
          continue
        size = f"{s // 1024}k" if s >= 1024 else str(s)
        lines.append(f"| {d} | {size} | {'yes' if causal else 'no'} | " + " | ".join(values)
                     + " |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  import argparse
  parser = argparse.ArgumentParser(description="Join results files, or print the README table.")
  parser.add_argument("--join", nargs="+", metavar="JSON", help="results files to join")
  parser.add_argument("--names", nargs="+", help="--join: a run name per file (default: stems)")
  parser.add_argument("--out", help="--join: the joined file")
  parser.add_argument("--summary", metavar="JSON", help="print the README table of a grid")
  args = parser.parse_args(argv)
  if args.join:
    if not args.out:
      raise SystemExit("--join needs --out")
    Path(args.out).write_text(json.dumps(join_files(args.join, args.names), indent=1) + "\n")
  if args.summary:
    print(summary_table(json.loads(Path(args.summary).read_text())))


if __name__ == "__main__":
  main()


class Progress:
  """A dependency-free progress bar on stderr: redrawn in place on a terminal, one line per step
  otherwise (the GPU runner captures output, where carriage returns would pile up)."""

  def __init__(self, total: int, stream=sys.stderr):
    self.total, self.done, self.stream = total, 0, stream
    self.start = time.perf_counter()
    self.tty = hasattr(stream, "isatty") and stream.isatty()

  @staticmethod
  def _clock(seconds: float | None) -> str:
    if seconds is None:
      return "--:--"
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m:02d}:{s:02d}"

  def show(self, label: str) -> None:
    elapsed = time.perf_counter() - self.start
    eta = elapsed / self.done * (self.total - self.done) if self.done else None
    frac = self.done / max(1, self.total)
    status = f"{self.done}/{self.total} {self._clock(elapsed)} eta {self._clock(eta)} {label}"
    if self.tty:
      bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
      width = shutil.get_terminal_size().columns - 1
      self.stream.write(("\r[" + bar + "] " + status)[:width].ljust(width))
    else:
      self.stream.write("[" + status + "]\n")
    self.stream.flush()

  def advance(self) -> None:
    self.done += 1

  def close(self) -> None:
    self.show("done")
    if self.tty:
      self.stream.write("\n")
      self.stream.flush()
