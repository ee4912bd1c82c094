"""The README a user reads works: every ```python block of README.md and docs/*.md runs
verbatim (fresh namespace each, so each block defines what it uses; blocks that only show a
signature are fenced as ```text), its results table is the one the committed benchmark results
make, and its links lead to files of the repository."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT = README.read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)
DOC_BLOCKS = [(page.name, number, code)
              for page in sorted((ROOT / "docs").glob("*.md"))
              for number, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(),
                                                       flags=re.S))]


def test_readme_has_python_blocks():
  assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index):
  code = BLOCKS[index]
  if "flax" in code:
    pytest.importorskip("flax")
  exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "readme"})


def test_docs_have_python_blocks():
  assert len(DOC_BLOCKS) >= 5


@pytest.mark.parametrize("page, number, code", DOC_BLOCKS,
                         ids=[f"{page}-{number}" for page, number, _ in DOC_BLOCKS])
def test_docs_block_runs(page, number, code):
  """A snippet in docs/ runs as pasted on any device count (multi_gpu.md's ring too)."""
  exec(compile(code, f"docs/{page} python block {number}", "exec"), {"__name__": "docs"})


def test_readme_table_is_the_committed_results():
  """The numbers users see come from benchmarks/results/h200/grid.json, never typed by hand:
  `python benchmarks/report.py --summary benchmarks/results/h200/grid.json` prints the table."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import report
  grid = json.loads((ROOT / "benchmarks" / "results" / "h200" / "grid.json").read_text())
  assert report.summary_table(grid) in TEXT


def test_readme_links_stay_in_the_repository():
  """Relative links and images point at files that exist; nothing points outside the
  repository or at issue numbers."""
  targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", TEXT)
  assert targets
  for target in targets:
    assert not target.startswith(("http:", "https:", "/", "..")), target
    assert (ROOT / target).exists(), target
  assert not re.search(r"\bissues?\s+\d", TEXT, flags=re.I)


def _anchors(path: Path) -> set[str]:
  """GitHub's anchors of a markdown file's headings (punctuation dropped but ``-`` and ``_``,
  spaces made ``-``)."""
  heads = re.findall(r"^#+ (.*)$", path.read_text(), flags=re.M)
  return {re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-") for h in heads}


def test_docs_links_resolve():
  """Links between docs/ pages, the README and the results READMEs lead to files and headings
  that exist."""
  pages = [README, *sorted((ROOT / "docs").glob("*.md")),
           *sorted((ROOT / "benchmarks" / "results").glob("*/README.md"))]
  for page in pages:
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
      assert not target.startswith(("http:", "https:")), (page, target)
      path = (page.parent / target) if target else page
      assert path.exists(), (page, target)
      if anchor and path.suffix == ".md":
        assert anchor in _anchors(path), (page, target, anchor)
