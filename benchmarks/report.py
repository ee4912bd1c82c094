"""Reporting for benchmarks/bench.py: the run's environment, markdown tables, the acceptance floor
check, output files (JSON, .md, PNG) and merging of partial runs."""

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
DEFAULT_FLOOR = Path(__file__).resolve().parent / "floors" / "issue5.json"
# jaxflash_triton first: memory.py learns the platform from the first worker, which must run
# everywhere.
IMPLS = ("jaxflash_triton", "jaxflash_mosaic", "jaxflash_xla", "xla", "cudnn", "cudnn_det",
         "pallas_mha")
TOKENS, HIDDEN = 16384, 2048
TOLERANCE = 2e-2
FLOP_CONVENTION = "fwd 4*B*N*S^2*D (x0.5 causal); fwdbwd 3.5x fwd; N = query heads"


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


def default_out(env: dict, suffix: str = "") -> Path:
  return RESULTS_DIR / f"{device_slug(env['device'])}{suffix}_{env['date']}.json"


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


def load_floor(path: str | Path = DEFAULT_FLOOR) -> dict:
  """An acceptance floor (a JSON file under benchmarks/floors/): which cells to check and what
  they need. The thresholds are data, so bench.py carries no issue's numbers."""
  return json.loads(Path(path).read_text())


def floor_summary(rows: list[dict], floor: dict | None = None) -> list[dict]:
  """One entry per check of ``floor`` (default: issue 5's), with status pass, miss or missing."""
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
  env, cfg = result["environment"], result.get("config", {})
  head = (f"# Attention speed: {env['device']}, jax {env['jax']}, {env['date']}\n\n"
          f"{cfg.get('tokens', TOKENS)} tokens per batch, hidden {cfg.get('hidden', HIDDEN)}. "
          f"FLOPs: {FLOP_CONVENTION}. `err`: failed (see the JSON), `n/a`: not applicable, "
          f"WRONG: relative error over {TOLERANCE}.\n")
  parts = [head, table(result["rows"]), "", floor_text(result["floor"])]
  issues = problems(result["rows"])
  if issues:
    parts += ["", "Problems:", ""] + [f"- {line}" for line in issues]
  return "\n".join(parts) + "\n"


def write_outputs(result: dict, out: Path) -> list[Path]:
  """The JSON, a .md beside it and the PNG plots (skipped with a note without matplotlib)."""
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1) + "\n")
  md = out.with_suffix(".md")
  md.write_text(markdown(result))
  written = [out, md]
  try:
    import plot
  except ImportError as e:
    print(f"no plots: {e}", file=sys.stderr)
  else:
    written += plot.plot_speed(result, out.with_suffix(""))
  return written


def merge(paths: list[str]) -> dict:
  """Joins results of several runs (e.g. one per dtype): a later file's row replaces an earlier
  one of the same case, implementation and mode. Keeps the first file's environment."""
  results = [json.loads(Path(p).read_text()) for p in paths]
  devices = {r["environment"]["device"] for r in results}
  if len(devices) > 1:
    print(f"warning: merging results of different devices {sorted(devices)}", file=sys.stderr)
  rows = {}
  for res in results:
    for r in res["rows"]:
      rows[row_key(r)] = r
  cfg = dict(results[0].get("config", {}), merged_from=[str(p) for p in paths])
  for key in ("dtypes", "head_dims", "seqs", "impls"):
    values = [v for res in results for v in res.get("config", {}).get(key, [])]
    cfg[key] = list(dict.fromkeys(values))
  return dict(kind="speed", environment=results[0]["environment"], config=cfg,
              rows=list(rows.values()))


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
