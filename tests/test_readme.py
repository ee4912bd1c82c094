"""Every ```python block of README.md runs verbatim (fresh namespace each; blocks that only show a
signature are fenced as ```text). A README snippet a user copies must work."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_blocks():
  assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index):
  code = BLOCKS[index]
  if "flax" in code:
    pytest.importorskip("flax")
  exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "readme"})
