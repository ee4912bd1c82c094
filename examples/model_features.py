"""What current models add to attention, with jaxflash: learnable sinks (gpt-oss), a value head
dim of its own (DeepSeek's MLA), ALiBi and a T5-style relative-position bias as score_mods.
Each is checked against plain JAX written out densely (jax.nn where it can say it), forward and
gradients.

    python examples/model_features.py        # a CPU runs it in seconds (the XLA backend)

- ``sinks=`` [N]: one logit per query head that joins every softmax denominator with a zero
  value, so a head can attend to "nothing"; it trains like any parameter.
- A value of head dim Dv != H: q and k [.., H], v [.., Dv], the output [.., Dv].
- ``score_mod(score, batch, head, q_idx, kv_idx) -> score`` (PyTorch FlexAttention's signature):
  jnp code that changes each scaled logit; it may close over arrays (ALiBi's slopes, a table of
  relative-position biases) and is differentiated per entry in the backward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash

B, T, N, K, H = 2, 256, 4, 2, 32  # batch, length, query heads, key/value heads (GQA), head dim


def dense_attention(q, k, v, bias, sinks=None):
  """Causal softmax attention written out: logits [B, N, T, T] + bias, an optional sink column
  (zero value), GQA by repeating K/V heads. What every feature below is checked against."""
  k, v = (jnp.repeat(x, N // K, axis=2) for x in (k, v))
  logits = jnp.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(q.shape[-1]) + bias
  causal = jnp.tril(jnp.ones((T, T), bool))
  logits = jnp.where(causal, logits, -jnp.inf)
  if sinks is not None:  # the sink as one more column, dropped after the softmax
    column = jnp.broadcast_to(sinks[None, :, None, None], logits.shape[:3] + (1,))
    weights = jax.nn.softmax(jnp.concatenate([logits, column], axis=-1), axis=-1)[..., :-1]
  else:
    weights = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bnqk,bknh->bqnh", weights, v)


def alibi():
  """ALiBi: each head penalises distance with its own slope, 2^(-8 (h + 1) / N)."""
  slopes = 2.0 ** (-8.0 * jnp.arange(1, N + 1) / N)

  def score_mod(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)

  bias = slopes[:, None, None] * (jnp.arange(T)[None, None, :] - jnp.arange(T)[None, :, None])
  return score_mod, bias[None]


def relative_buckets(buckets: int = 32, max_distance: int = 128):
  """T5's relative-position bias: a learned [N, buckets] table read at the bucket of the
  distance back (exact up to half the buckets, then logarithmic). The bucket is a function of
  ``q_idx - kv_idx`` alone, so on a Hopper GPU the Mosaic kernels read the table's values per
  diagonal (made once per call); the Triton kernels gather them; on a CPU the XLA backend
  does. The table is a parameter: ``(score_mod_of(table), bias_of(table), table)``, and
  gradients reach it through the score_mod as through the dense bias."""
  table = 0.5 * jax.random.normal(jax.random.key(7), (N, buckets))
  exact = buckets // 2

  def bucket(distance):  # distance >= 0 (causal)
    far = exact + (jnp.log(jnp.maximum(distance, 1) / exact) / np.log(max_distance / exact)
                   * (buckets - exact)).astype(jnp.int32)
    return jnp.where(distance < exact, distance, jnp.minimum(far, buckets - 1))

  def score_mod_of(table):
    return lambda score, b, h, q_idx, kv_idx: score + table[
        h, bucket(jnp.maximum(q_idx - kv_idx, 0))]

  distance = jnp.maximum(jnp.arange(T)[:, None] - jnp.arange(T)[None, :], 0)
  bias_of = lambda table: table[:, bucket(distance)][None]  # noqa: E731 ([1, N, T, T])
  return score_mod_of, bias_of, table


def check(name, ours, theirs, *args) -> dict:
  """Largest output difference and the worst relative gradient error (over every argument)."""
  out, want = jax.jit(ours)(*args), theirs(*args)

  def loss(fn):
    return lambda *a: jnp.sum(jnp.sin(fn(*a)))
  got_grads = jax.jit(jax.grad(loss(ours), argnums=tuple(range(len(args)))))(*args)
  want_grads = jax.grad(loss(theirs), argnums=tuple(range(len(args))))(*args)
  grad_error = max(float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
                   for g, w in zip(got_grads, want_grads))
  result = dict(error=float(jnp.max(jnp.abs(out - want))), grad_error=grad_error)
  print(f"{name:18s} max |jaxflash - dense| {result['error']:.1e}, gradients (relative) "
        f"{grad_error:.1e}")
  return result


def main() -> dict:
  keys = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(keys[0], (B, T, N, H))
  k, v = (jax.random.normal(key, (B, T, K, H)) for key in keys[1:3])
  zero_bias = jnp.zeros((1, N, T, T))
  results = {}

  sinks = jax.random.normal(keys[3], (N,))  # (a model makes these a parameter)
  results["sinks"] = check(
      "sinks", lambda q, k, v, s: jaxflash.flash_attention(q, k, v, is_causal=True, sinks=s),
      lambda q, k, v, s: dense_attention(q, k, v, zero_bias, s), q, k, v, sinks)

  v_narrow = jax.random.normal(keys[4], (B, T, K, H // 2))  # Dv = H / 2, as MLA's 192/128
  results["value_head_dim"] = check(
      "value head dim", lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=True),
      lambda q, k, v: dense_attention(q, k, v, zero_bias), q, k, v_narrow)

  score_mod, bias = alibi()
  results["alibi"] = check(
      "alibi", lambda q, k, v: jaxflash.flash_attention(q, k, v, is_causal=True,
                                                        score_mod=score_mod),
      lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias, is_causal=True), q, k, v)
  score_mod_of, bias_of, table = relative_buckets()  # (the table's gradient checked too)
  results["relative_buckets"] = check(
      "relative_buckets", lambda q, k, v, table: jaxflash.flash_attention(
          q, k, v, is_causal=True, score_mod=score_mod_of(table)),
      lambda q, k, v, table: jax.nn.dot_product_attention(q, k, v, bias_of(table),
                                                          is_causal=True), q, k, v, table)
  # float32 matmuls run in TF32 on an NVIDIA GPU (in jaxflash's kernels and in jnp alike).
  tol = 1e-4 if jax.default_backend() == "cpu" else 3e-3
  bad = [name for name, r in results.items() if not (r["error"] < tol and r["grad_error"] < tol)]
  if bad:
    raise SystemExit(f"jaxflash differs from the dense computation for {bad}")
  return results


if __name__ == "__main__":
  main()
