"""CPU test of examples/model_features.py: sinks, a value head dim of its own, ALiBi and a
T5-style relative-position bias give what the dense computation gives, forward and gradients."""

import jax
import pytest

from checks import load_example


def test_every_feature_matches_the_dense_computation():
  results = load_example("model_features").main()  # (it raises where one differs)
  assert set(results) == {"sinks", "value_head_dim", "alibi", "relative_buckets"}
  tol = 1e-4 if jax.default_backend() == "cpu" else 3e-3  # (TF32 dots on a GPU)
  for name, result in results.items():
    assert result["error"] < tol and result["grad_error"] < tol, (name, result)


def test_the_relative_bias_is_a_lookup_of_the_distance():
  """T5's buckets are a lookup (Triton gathers it) through q_idx - kv_idx alone (the Mosaic
  kernels read it per diagonal)."""
  from jaxflash import mask_mod
  example = load_example("model_features")
  score_mod_of, _, table = example.relative_buckets()
  split = mask_mod.split_score(score_mod_of(table))
  assert split.lookups and split.kernel_reason is None and split.diagonal_lookups
  with pytest.raises(ValueError, match="score_mod"):
    mask_mod.split_score(lambda s, b, h: s)
