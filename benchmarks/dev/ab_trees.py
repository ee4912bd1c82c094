"""Same-machine A/B of two versions of the library: runs one benchmark script against an old tree
and against this one, alternating, each run a process of its own.

    python benchmarks/dev/ab_trees.py --old 39d08cf --rounds 2 -- \\
        benchmarks/model_features.py --cases alibi --out "$OUT/mf_{arm}_{round}.json"

Why a tool: Python puts a script's folder first on ``sys.path``, so a script started from inside
the old tree imports the old ``jaxflash`` in *both* arms (the A/B of 2026-12-05 did, and its
numbers were void). Here every run starts in a scratch folder outside both trees, finds its
``jaxflash`` through ``PYTHONPATH`` alone, and first proves which tree it imported.

``--old`` is a folder that holds an old ``jaxflash/`` or a git revision, unpacked with
``git archive`` (on the GPU machine, which gets the working tree without ``.git``, unpack it
here first: ``git archive REV jaxflash | tar -x -C old_tree`` in an untracked folder of the
repository, then ``--old old_tree``). ``{arm}`` (``old`` or ``new``) and ``{round}`` in the
script's arguments name each run's outputs. Rounds alternate the order (old first, then new
first) so that a drift of the card's clock does not favour one arm. Each run's output goes to
``--logs`` (``$OUT`` on the GPU machine, else the current folder) as ``ab_{arm}_{round}.log``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def unpack(revision: str, into: Path) -> Path:
  """``jaxflash/`` as of ``revision``, unpacked under ``into``; returns the tree's root."""
  archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "jaxflash"],
                           check=True, capture_output=True).stdout
  subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
  return into


def arm_environment(root: Path) -> dict[str, str]:
  """The environment of a run against the tree at ``root``: that tree, then benchmarks/ (whose
  scripts import each other by name), then whatever the caller's PYTHONPATH held."""
  env = dict(os.environ)
  paths = [str(root), str(REPO / "benchmarks")]
  if env.get("PYTHONPATH"):
    paths.append(env["PYTHONPATH"])
  env["PYTHONPATH"] = os.pathsep.join(paths)
  return env


def imported_from(env: dict[str, str], cwd: Path) -> Path:
  """Where ``import jaxflash`` lands under ``env``, started in ``cwd``."""
  out = subprocess.run([sys.executable, "-c", "import jaxflash; print(jaxflash.__file__)"],
                       env=env, cwd=cwd, check=True, capture_output=True, text=True).stdout
  return Path(out.strip().splitlines()[-1]).resolve()


def _text(output: str | bytes | None) -> str:
  return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def schedule(rounds: int) -> list[tuple[int, str]]:
  """(round, arm) in run order: old first in odd rounds, new first in even ones."""
  order = []
  for r in range(1, rounds + 1):
    arms = ("old", "new") if r % 2 else ("new", "old")
    order += [(r, arm) for arm in arms]
  return order


def main(argv: list[str] | None = None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--old", required=True, help="a folder holding jaxflash/, or a git revision")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--timeout", type=float, default=300.0, help="seconds a run")
  parser.add_argument("--logs", default=os.environ.get("OUT", "."))
  parser.add_argument("script", help="the benchmark script, relative to the repository")
  parser.add_argument("args", nargs=argparse.REMAINDER)
  opts = parser.parse_args(argv)
  args = opts.args[1:] if opts.args[:1] == ["--"] else opts.args
  logs = Path(opts.logs)
  logs.mkdir(parents=True, exist_ok=True)
  runs = []
  with tempfile.TemporaryDirectory() as scratch:
    scratch = Path(scratch)
    old = Path(opts.old)
    if (old / "jaxflash").is_dir():
      old_root = old.resolve()
    else:
      (scratch / "old").mkdir()
      old_root = unpack(opts.old, scratch / "old")
    roots = {"old": old_root, "new": REPO}
    workdir = scratch / "run"  # outside both trees: no tree leads sys.path by accident
    workdir.mkdir()
    for arm, root in roots.items():
      where = imported_from(arm_environment(root), workdir)
      if not where.is_relative_to(root.resolve()):
        raise SystemExit(f"the {arm} arm imports jaxflash from {where}, not from {root}")
      print(f"{arm}: {where}", flush=True)
    for r, arm in schedule(opts.rounds):
      command = [sys.executable, str(REPO / opts.script)]
      command += [a.replace("{arm}", arm).replace("{round}", str(r)) for a in args]
      log = logs / f"ab_{arm}_{r}.log"
      try:
        done = subprocess.run(command, env=arm_environment(roots[arm]), cwd=workdir,
                              capture_output=True, text=True, timeout=opts.timeout)
        text, code = done.stdout + done.stderr, done.returncode
      except subprocess.TimeoutExpired as e:  # (its output may come back as bytes)
        text = "".join(_text(part) for part in (e.stdout, e.stderr)) + "\n(timed out)"
        code = None
      log.write_text(text)
      print(f"== round {r}, {arm} (exit {code}) -> {log}", flush=True)
      print("\n".join(text.splitlines()[-15:]), flush=True)
      runs.append(dict(round=r, arm=arm, exit=code, log=str(log)))
  return runs


if __name__ == "__main__":
  main()
