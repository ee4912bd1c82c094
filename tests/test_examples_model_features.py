"""CPU test of examples/model_features.py: sinks, a value head dim of its own, ALiBi and a
T5-style relative-position bias give what the dense computation gives, forward and gradients."""

import importlib.util
import pathlib

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "model_features.py"


def _load_example():
  spec = importlib.util.spec_from_file_location("jaxflash_example_model_features", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_every_feature_matches_the_dense_computation():
  results = _load_example().main()
  assert set(results) == {"sinks", "value_head_dim", "alibi", "relative_buckets"}
  for name, result in results.items():
    assert result["error"] < 1e-4 and result["grad_error"] < 1e-4, (name, result)


def test_the_relative_bias_is_a_lookup_the_triton_kernels_gather():
  from jaxflash import mask_mod
  example = _load_example()
  split = mask_mod.split_score(example.relative_buckets()[0])
  assert split.lookups and split.kernel_reason is None
  with pytest.raises(ValueError, match="score_mod"):
    mask_mod.split_score(lambda s, b, h: s)
