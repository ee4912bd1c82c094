"""CPU tests of the training example examples/gpt.py (the `cpu-tiny` preset: a few steps of a tiny
GPT), run in-process: jaxflash and Flax attention from the same seed give the same losses, and the
results are written."""

import importlib.util
import json
import math
import pathlib
import sys

import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jaxflash.nnx  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "gpt.py"


def _load_example():
  # The example is a script in three files; as a script, its folder is on sys.path. Only while
  # it imports its siblings: left there, `import masks` elsewhere in the process (the
  # benchmarks' masks.py) would find examples/masks.py.
  sys.path.insert(0, str(EXAMPLE.parent))
  try:
    spec = importlib.util.spec_from_file_location("jaxflash_example_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
  finally:
    sys.path.remove(str(EXAMPLE.parent))
  return module


gpt = _load_example()


def test_cpu_tiny_jaxflash_matches_flax(tmp_path):
  steps = 3
  results = gpt.main(["--preset", "cpu-tiny", "--attention", "jaxflash,flax", "--steps",
                      str(steps), "--dtype", "float32", "--seed", "1", "--out", str(tmp_path)])
  assert set(results) == {"jaxflash", "flax"}
  for name, result in results.items():
    assert len(result.losses) == steps
    assert all(math.isfinite(x) for x in result.losses), (name, result.losses)
    # an untrained model over a ~300-word vocabulary starts near ln(vocab)
    assert 4.0 < result.losses[0] < 7.0, (name, result.losses)
    saved = json.loads((tmp_path / f"gpt_{name}.json").read_text())
    assert saved["attention"] == name
    assert saved["losses"] == pytest.approx(result.losses)
    assert len(saved["step_times_s"]) == steps
    summary = saved["summary"]
    assert summary["median_step_s"] > 0 and summary["tokens_per_s"] > 0
    assert summary["temp_size_in_bytes"] is not None
    assert saved["config"]["seq"] == 64 and saved["config"]["dtype"] == "float32"

  compare = json.loads((tmp_path / "gpt_compare.json").read_text())
  assert set(compare["runs"]) == {"jaxflash", "flax"}
  # Same seed -> same parameters and batch: the first loss (before any update) differs only
  # by float32 rounding in the attention; later ones stay close over a few steps.
  ours, flax_losses = results["jaxflash"].losses, results["flax"].losses
  np.testing.assert_allclose(ours[0], flax_losses[0], rtol=1e-4)
  np.testing.assert_allclose(ours, flax_losses, rtol=1e-3)
  if importlib.util.find_spec("matplotlib") is not None:
    assert (tmp_path / "gpt_compare_loss.png").stat().st_size > 0


def test_attention_choices():
  assert gpt.attention_fn("jaxflash") is jaxflash.nnx.dot_product_attention
  assert gpt.attention_fn("flax") is nnx.dot_product_attention
  with pytest.raises(ValueError):
    gpt.attention_fn("nope")
  # --no-deterministic: jaxflash's hooks get deterministic_backward=False, others stay as they are
  assert gpt.parse_args(["--preset", "cpu-tiny"]).deterministic
  assert not gpt.parse_args(["--preset", "cpu-tiny", "--no-deterministic"]).deterministic
  for name in ("jaxflash", "jaxflash_fp8", "jaxflash_fp8_rotated"):
    assert gpt.attention_fn(name, deterministic=False).keywords["deterministic_backward"] is False
  assert gpt.attention_fn("jaxflash_fp8_rotated").keywords["fp8"] == {"rotation_seed": 0}
  assert gpt.attention_fn("flax", deterministic=False) is nnx.dot_product_attention


def test_xla_wrapper_takes_the_nnx_hook_keywords():
  """The jax.nn wrapper accepts everything nnx.MultiHeadAttention passes and matches Flax."""
  q, k, v = (jax.random.normal(jax.random.key(i), (2, 16, 4, 8)) for i in range(3))
  hook_kwargs = dict(mask=None, dropout_rng=None, dropout_rate=0.0, broadcast_dropout=True,
                     deterministic=True, dtype=None, precision=None, module=None,
                     is_causal=True)
  got = gpt.xla_attention(q, k, v, **hook_kwargs)
  want = nnx.dot_product_attention(q, k, v, **hook_kwargs)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="dropout"):
    gpt.xla_attention(q, k, v, **{**hook_kwargs, "dropout_rate": 0.1, "deterministic": False,
                                  "dropout_rng": jax.random.key(0)})
  assert gpt.xla_attention(q, k, v, dtype=jnp.bfloat16).dtype == jnp.bfloat16


def test_flag_validation():
  with pytest.raises(SystemExit):
    gpt.parse_args(["--preset", "cpu-tiny", "--attention", "xla", "--attn-dropout", "0.1"])
  with pytest.raises(SystemExit):
    gpt.parse_args(["--attention", "jaxflash,bogus"])
  with pytest.raises(SystemExit):
    gpt.parse_args(["--compare", "--attention", "flax"])
  args = gpt.parse_args(["--preset", "gpu-8k", "--steps", "7"])
  assert (args.seq, args.layers, args.dim, args.heads, args.dtype, args.steps) == (
      8192, 8, 1024, 8, "bfloat16", 7)
  assert gpt.parse_args(["--compare"]).attentions == ["jaxflash", "flax"]


def test_corpus_is_deterministic_and_in_vocabulary():
  a, b = gpt.make_corpus(2000, seed=3), gpt.make_corpus(2000, seed=3)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a[:2000], gpt.make_corpus(2000, seed=4)[:2000])
  assert len(a) >= 2000 and a.min() >= 1 and a.max() < len(gpt.vocabulary())
  assert gpt.decode(a[:3]).count(" ") == 2
