"""CPU test of examples/masks.py: every mask of the example (document masking, prefix-LM, a
sliding window, strided attention, a random block pattern) gives jax.nn's result given the
same mask as a dense array."""

import jax
import jax.numpy as jnp
import pytest

from checks import load_example

masks = load_example("masks")

@pytest.fixture(scope="module")
def inputs():
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (masks.B, masks.T, masks.N, masks.H), jnp.float32)
  k, v = (jax.random.normal(key, (masks.B, masks.T, masks.K, masks.H), jnp.float32)
          for key in keys[1:])
  return q, k, v


@pytest.mark.parametrize("name", masks.PATTERNS)
def test_pattern_matches_jax_nn(name, inputs):
  result = masks.run(name, *inputs)
  assert result["error"] < 1e-4, result
  assert result.get("grad_error", 0.0) < 1e-4, result
  # Every pattern hides whole blocks (that is what it is there to show) and sees some entries.
  assert 0 < result["skipped"] < 1 and 0 < result["visible"] < 1, result
  if name == "documents":
    assert "grad_error" in result


def test_masks_are_the_functions_they_say():
  """The patterns on a few entries, by hand."""
  window, strided, prefix = masks.sliding_window(96), masks.strided(32, 64), masks.prefix_lm()
  assert window(0, 0, 100, 5) and not window(0, 0, 100, 4) and not window(0, 0, 5, 6)
  assert strided(0, 0, 200, 200 - 31) and not strided(0, 0, 200, 200 - 32)
  assert strided(0, 0, 200, 200 - 128) and not strided(0, 0, 200, 201)
  assert prefix(0, 0, 10, 63) and not prefix(0, 0, 10, 64) and prefix(1, 0, 10, 299)
  doc = masks.documents()
  assert doc(0, 0, 99, 0) and not doc(0, 0, 100, 99) and doc(1, 0, 300, 256)
  assert masks.block_pattern().diagonal().all()


def test_main_prints_and_fails_loudly(monkeypatch, capsys):
  """``python examples/masks.py`` prints a line per pattern and exits with an error naming a
  pattern whose result differs (here one made to differ)."""
  monkeypatch.setattr(masks, "PATTERNS", ("sliding_window",))
  results = masks.main()
  assert set(results) == {"sliding_window"}
  assert "sliding_window" in capsys.readouterr().out
  monkeypatch.setattr(masks, "run", lambda name, q, k, v: dict(error=1.0, skipped=0.5,
                                                               visible=0.5))
  with pytest.raises(SystemExit, match="sliding_window"):
    masks.main()
