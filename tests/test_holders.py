"""The comments that excuse a case from CI stay true: where a case is marked `variants` because
another CPU case holds its path, its comment names that holder (`test_x.py::test_y[case]`, or
`test_y[case]` in the same file), and the holder must be a case that CI runs (neither a variant
nor a GPU test). A holder renamed, re-parametrized or moved to the variants would otherwise leave
a path that no CPU run checks, with a comment saying one does (docs/testing.md, "The `variants`
marker")."""

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

# `test_file.py::test_function[case]`, the file optional; `*` in a case stands for any text.
HOLDER = re.compile(r"(?:(test_\w+\.py)::)?(test_\w+)(\[[^\]\s]*\])?")


def ci_cases() -> dict[tuple[str, str], set[str]]:
  """{(file, function): its case ids} of the tests CI runs: all but variants and GPU tests."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
  collected = subprocess.run(
      [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
       "-m", "not variants and not gpu", "tests"],
      cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
  cases = collections.defaultdict(set)
  for line in collected.splitlines():
    if "::" in line:
      path, case = line.strip().split("::", 1)
      cases[(Path(path).name, case.split("[")[0])].add(case)
  return cases


def comment_blocks(source: str):
  """(first line, text) of each run of comment lines, joined by spaces; an id that a line break
  cut after '-', '[' or '::' is joined back without one."""
  block, start = "", None
  for number, line in enumerate(source.splitlines(), 1):
    if "#" in line and not line.lstrip().startswith(('"', "'")):
      text = line.split("#", 1)[1].strip()
      start = start or number
      block = block + text if block.endswith(("-", "[", "::")) else f"{block} {text}".strip()
    elif block:
      yield start, block
      block, start = "", None
  if block:
    yield start, block


def wrong_holders(file: str, source: str, cases) -> list[str]:
  """Each holder named in ``source``'s comments that is not a case CI runs."""
  wrong = []
  for line, text in comment_blocks(source):
    for match in HOLDER.finditer(text):
      holder_file, function, case = match.groups()
      if not holder_file and not case:
        continue  # a function named in prose, no case: not a holder
      holder_file = holder_file or file
      if (holder_file, function) not in cases and not match.group(1):
        # A case of another file named without it: the one file that has such a function.
        files = {f for f, fn in cases if fn == function}
        holder_file = files.pop() if len(files) == 1 else holder_file
      ids = cases.get((holder_file, function), set())
      pattern = re.compile(re.escape(function + (case or "")).replace(r"\*", ".*") + "$")
      named_case_runs = any(pattern.match(i) for i in ids) if case else bool(ids)
      if not named_case_runs:
        wrong.append(f"{file}:{line}: {match.group(0)} is not a case CI runs")
  return wrong


@pytest.fixture(scope="module")
def cases():
  return ci_cases()


def test_every_named_holder_is_a_case_ci_runs(cases):
  wrong = []
  for path in sorted(TESTS.glob("test_*.py")):
    if path.name == Path(__file__).name:
      continue  # its comments show the form, its strings wrong holders on purpose
    wrong += wrong_holders(path.name, path.read_text(), cases)
  assert not wrong, "\n".join(wrong)


def test_a_wrong_holder_is_found(cases):
  # The check can fail: a case that does not exist, one cut across two lines, a variant's
  # (test_holders has none, so a case of its own function with an unknown id), and a wildcard.
  source = ("x = 1  # test_attention.py::test_option[xla-no_such_option]\n"
            "# held by test_readme.py::test_readme_block_runs[\n"
            "# 99] and test_holders.py::test_a_wrong_holder_is_found[x]\n"
            "# fine: test_readme.py::test_readme_block_runs[*] and test_readme_has_python_blocks\n")
  assert [w.split(": ", 1)[1] for w in wrong_holders("test_x.py", source, cases)] == [
      "test_attention.py::test_option[xla-no_such_option] is not a case CI runs",
      "test_readme.py::test_readme_block_runs[99] is not a case CI runs",
      "test_holders.py::test_a_wrong_holder_is_found[x] is not a case CI runs",
  ]
