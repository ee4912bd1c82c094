"""``score_mod``: a function that changes each logit (FlexAttention's
``score_mod(score, batch, head, q_idx, kv_idx) -> score``), against the float32 reference that
calls the same function on the dense logits; outputs and the gradients of query, key and value.

The rules: ALiBi (a per-head slope times the distance: a row feature and index arithmetic,
which kernels can evaluate per tile), a tanh gate (elementwise on the score), a relative-position
table read with both indices (a lookup: the Triton kernels gather it, the Mosaic kernels read a
band of its values per diagonal), and a score_mod of one index only. Every one combines with
the causal band, lengths, GQA, a soft cap, a bias, a mask_mod and sinks. Arrays a score_mod
closes over get gradients when they are differentiated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import mask_mod as mask_mod_lib
from jaxflash.reference import reference_attention
from checks import (F32_TOLERANCE, attention, check, interpret_for, lower_for_cuda, random_array,
                    random_qkv, rel_err, variant_if)

B, T, S, N, K, H = 2, 37, 53, 4, 2, 40
SLOPES = 2.0 ** -jnp.arange(1, N + 1, dtype=jnp.float32)
TABLE = random_array(3, (N, T + S), "float")

RULES = {
    "alibi": lambda score, b, h, i, j: score + SLOPES[h] * (j - i),
    "tanh_gate": lambda score, b, h, i, j: 4.0 * jnp.tanh(score / 4.0),
    "relative_table": lambda score, b, h, i, j: score + TABLE[h, i - j + S],
    "key_only": lambda score, b, h, i, j: score - 0.1 * (j % 3),
    "ignores_score": lambda score, b, h, i, j: (i - j).astype(jnp.float32) * 0.05,
}


# Variants (the GPU, and a CPU with JAXFLASH_ALL_VARIANTS=1), whose rules other CPU cases hold on
# the same backend: Triton's ALiBi in test_row_term_with_a_differentiated_bias[triton] (ALiBi with
# a causal band) and test_kernels_with_every_other_option[triton] (with lengths); Triton's key_only
# there too (ALiBi without its row term, which the kernels move to the LSE, is a column feature
# alone, as key_only is: `Split.without_row_term`); the tanh gate in
# test_combines_with_everything[xla-*] and [triton-mask_mod_window] (forward and gradients).
MATCH_VARIANTS = {("triton", "alibi"), ("triton", "key_only"), ("triton", "tanh_gate"),
                  ("xla", "tanh_gate")}
CASES = [variant_if((impl, rule) in MATCH_VARIANTS, impl, rule)
         for impl in ("xla", "triton") for rule in RULES]


@pytest.mark.parametrize("implementation,rule", CASES)
def test_matches_the_reference(implementation, rule):
  # (`check` calls callable options to make them: hence the makers.)
  check(implementation, b=B, t=T, s=S, n=N, k=K, h=H, score_mod=lambda *_: RULES[rule],
        is_causal=True, key_value_seq_lengths=jnp.array([53, 20]))


COMBINED = {
    "cap_bias": dict(logits_soft_cap=2.0, bias=random_array(4, (1, N, T, S), "float")),
    "mask_mod_window": dict(mask_mod=lambda *_: lambda b, h, i, j: (i + j) % 5 != 0,
                            local_window_size=(20, 5)),
    "segments": dict(segment_ids=(random_array(5, (B, T), 3), random_array(6, (B, S), 3)),
                     query_seq_lengths=jnp.array([30, 37])),
    "dropout": dict(dropout_rate=0.2, dropout_rng=jax.random.key(2)),
}
# Triton's cases but mask_mod_window are variants (the GPU, JAXFLASH_ALL_VARIANTS=1):
# test_kernels_with_every_other_option[triton] holds a score_mod in Triton's kernels with segment
# ids, lengths both ways, dropout and a soft cap; test_row_term_with_a_differentiated_bias[triton]
# one beside a differentiated bias (Triton's dbias kernel); and [xla-cap_bias] the chain of the cap
# and the score_mod's derivative (`_core.logits`, which Triton's tiles call too).
# [triton-mask_mod_window] stays (a window to the right; test_attention.py's Triton case
# window_pair, a variant, leans on it).
COMBINED_VARIANTS = {("triton", "cap_bias"), ("triton", "segments"), ("triton", "dropout")}


@pytest.mark.parametrize("implementation,options", [
    variant_if((impl, name) in COMBINED_VARIANTS, impl, options, id=f"{impl}-{name}")
    for name, options in COMBINED.items() for impl in ("xla", "triton")])
def test_combines_with_everything(implementation, options):
  check(implementation, b=B, t=T, s=S, n=N, k=K, h=H, score_mod=lambda *_: RULES["tanh_gate"],
        **options)


# (XLA's case is a variant: the XLA backend keeps the row term in the logits, so its path is a
# score_mod beside a differentiated bias, which test_combines_with_everything[xla-cap_bias] holds,
# and ALiBi, which test_matches_the_reference[xla-alibi] holds.)
@pytest.mark.parametrize("implementation", (pytest.param("xla", marks=pytest.mark.variants),
                                            "triton"))
def test_row_term_with_a_differentiated_bias(implementation):
  """ALiBi (whose row term the Triton kernels move to the LSE) beside a bias whose gradient is
  asked for: the bias gradient's kernel recomputes P from the same LSE."""
  check(implementation, b=B, t=T, s=S, n=N, k=K, h=H, score_mod=lambda *_: RULES["alibi"],
        bias=random_array(18, (1, N, T, S), "float"), is_causal=True)


# (A variant: test_a_row_term_empties_or_poisons_its_row[xla] holds sinks beside a score_mod on
# the XLA backend against the reference's (output, LSE and gradients), and
# test_kernels_with_every_other_option[triton] in Triton's kernels.)
@pytest.mark.variants
def test_sinks_and_score_mod():
  """The sink joins after the score_mod: its logit is not modified."""
  q, kk, v, _ = random_qkv(7, B, T, S, N, K, H)
  sinks = random_array(8, (N,), "float")
  got = attention("xla", q, kk, v, score_mod=RULES["alibi"], sinks=sinks, is_causal=True)
  want, _ = jaxflash.reference_attention(q, kk, v, score_mod=RULES["alibi"], sinks=sinks,
                                         is_causal=True)
  assert rel_err(got, want) < F32_TOLERANCE


def test_under_jit_and_vmap_with_traced_arrays():
  """The arrays a score_mod closes over may be traced (a jit argument), and the call vmapped."""
  q, kk, v, _ = random_qkv(9, B, T, S, N, K, H)

  @jax.jit
  def run(q, kk, v, slopes):
    alibi = lambda score, b, h, i, j: score + slopes[h] * (j - i)  # noqa: E731
    return jax.vmap(lambda q, kk, v: attention("xla", q[None], kk[None], v[None],
                                               score_mod=alibi)[0])(q, kk, v)

  got = run(q, kk, v, SLOPES)
  want, _ = jaxflash.reference_attention(q, kk, v, score_mod=RULES["alibi"])
  assert rel_err(got, want) < F32_TOLERANCE


# Lookups through q_idx - kv_idx alone, at the Mosaic tests' T = 70, S = 133: a table per head
# and diagonal, and T5's buckets of the distance (a log, a floor and a clamp before the lookup).
RELATIVE = random_array(19, (2, 70 + 133), "float")
BUCKETS = random_array(20, (3, 2, 16), "float")
RELATIVE_BF16 = RELATIVE.astype(jnp.bfloat16)


def _t5_bucket(distance):
  far = 8 + (jnp.log(jnp.maximum(distance, 1) / 8.0) / jnp.log(8.0) * 8).astype(jnp.int32)
  return jnp.where(distance < 8, distance, jnp.minimum(far, 15))


MOSAIC_RULES = {
    **RULES,
    "relative_table": lambda score, b, h, i, j: score + RELATIVE[h, i - j + 133],
    "t5_buckets": lambda score, b, h, i, j: 2.0 * jnp.tanh(score / 2.0) + BUCKETS[
        b + 1, h % 2, _t5_bucket(jnp.abs(j - i))],
    # (A 16-bit table: its band holds float32 bits, cast back in the kernel.)
    "relative_bf16": lambda score, b, h, i, j: score + RELATIVE_BF16[h, i - j + 133],
}


# (ALiBi on a CPU: test_kernels_with_every_other_option runs it with every other option; tanh
# gating with the GPU and JAXFLASH_ALL_VARIANTS=1: t5_buckets holds a tanh on a CPU; the float32
# relative_table likewise: relative_bf16 is the same lookup of a bfloat16 table, whose band takes
# the same way (`from_int32` of its own dtype's bits).)
@pytest.mark.parametrize("rule", (pytest.param("alibi", marks=pytest.mark.gpu),
                                  pytest.param("tanh_gate", marks=pytest.mark.variants),
                                  pytest.param("relative_table", marks=pytest.mark.variants),
                                  "t5_buckets", "relative_bf16"))
def test_mosaic_kernels(rule):
  """The Mosaic forward and backward run the tile rule (in Mosaic GPU's interpreter on a CPU),
  the backward with its derivative on its transposed dK/dV tiles and its dQ tiles; lookups
  through ``q_idx - kv_idx`` come from their bands in both orientations."""
  check("mosaic", b=2, t=70, s=133, n=2, k=1, h=64, dtype=jnp.bfloat16,
        score_mod=lambda *_: MOSAIC_RULES[rule], is_causal=True,
        key_value_seq_lengths=jnp.array([133, 50]))


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ("relative_table", "t5_buckets", "relative_bf16"))
def test_mosaic_lookups_on_long_shapes(rule):
  """Bands past one tile's worth of diagonals, GQA, a window and lengths, head dim 96."""
  table = RELATIVE if rule == "relative_table" else RELATIVE_BF16
  clipped = lambda score, b, h, i, j: score + table[h % 2, jnp.clip(  # noqa: E731
      i - j, -133, 69) + 133]
  check("mosaic", b=2, t=700, s=1333, n=4, k=2, h=96, dtype=jnp.bfloat16,
        score_mod=lambda *_: MOSAIC_RULES[rule] if rule == "t5_buckets" else clipped,
        local_window_size=(300, 40), key_value_seq_lengths=jnp.array([1333, 900]))


# Rows 0, 5, 10, ... get -inf, the others a term per head (a row term the Mosaic kernels leave
# to the LSE); with NaN_ROW, that row's term is NaN.
NAN_ROW = 7
ROW_TERMS = lambda score, b, h, i, j: score + jnp.where(  # noqa: E731
    i % 5 == 0, -jnp.inf, 0.5 * h - 0.01 * i)
NAN_TERM = lambda score, b, h, i, j: ROW_TERMS(score, b, h, i, j) + jnp.where(  # noqa: E731
    i == NAN_ROW, jnp.nan, 0.0)


# (Mosaic's case is a variant, 8 s of a CPU: what a -inf or NaN row term does is
# `_core.finish_rows` and `_core.lse_without_row_term`, which Mosaic's forward and backward call as
# Triton's do ([triton] holds them); test_kernels_with_every_other_option[mosaic] holds Mosaic's
# row term (ALiBi's) with sinks, and rows that see nothing (past q_len), forward and backward.)
@pytest.mark.parametrize("implementation", ("xla", "triton",
                                            pytest.param("mosaic", marks=pytest.mark.variants)))
def test_a_row_term_empties_or_poisons_its_row(implementation):
  """A score_mod that adds a value of the query alone (ALiBi's ``-slope[h] * q_idx``): the Mosaic
  and Triton kernels leave it out of the logits and add it to the LSE (`Split.row_term`). A row
  whose term is -inf sees no key (zeros, no gradient); one whose term is NaN is NaN, and only
  that row."""
  assert mask_mod_lib.split_score(ROW_TERMS).row_term is not None
  dims = dict(b=2, t=70, s=133, n=2, k=1, h=64, dtype=jnp.bfloat16)
  check(implementation, **dims, score_mod=lambda *_: ROW_TERMS, is_causal=True,
        sinks=random_array(15, (2,), "float"))
  q, kk, v, _ = random_qkv(16, 2, 70, 133, 2, 1, 64, jnp.bfloat16)
  out = attention(implementation, q, kk, v, score_mod=NAN_TERM, is_causal=True)
  bad = jnp.isnan(out.astype(jnp.float32)).any(axis=(0, 2, 3))
  assert bad.tolist() == [i == NAN_ROW for i in range(70)]


def _x64_alibi():
  """README's ALiBi under jax_enable_x64 (call inside it): its slopes are float64."""
  slopes = 2.0 ** -jnp.arange(1.0, 3.0)
  return lambda score, b, h, i, j: score + slopes[h] * (j - i)


def test_mosaic_kernels_under_x64_lower_for_cuda(cuda_plugin):
  """With jax_enable_x64 the Mosaic kernels load a float64 slope's column (converted to float32
  outside) rather than compute it in 64 bits, still move the row term to the LSE, and lower.
  (Its numbers under x64 are checked on the GPU.)"""
  with jax.enable_x64(True):
    rule = _x64_alibi()
    split = mask_mod_lib.split_score(rule)
    assert split.row_term is not None and split.computed_cols == ()
    q = jax.ShapeDtypeStruct((1, 300, 2, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 300, 1, 64), jnp.bfloat16)

    def loss(q, k, v):
      out = jaxflash.flash_attention(q, k, v, score_mod=rule, is_causal=True,
                                     implementation="mosaic")
      return jnp.sum(out.astype(jnp.float32))

    text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
  assert "mosaic_gpu" in text and "jaxflash_backward_dkv" not in text


def test_a_float64_table_under_x64(cuda_plugin):
  """Under jax_enable_x64 a float64 relative-position table: the Mosaic kernels read its band
  (float32 bits) and lower for CUDA, and its gradient (float64) equals the reference's."""
  with jax.enable_x64(True):
    table = jnp.linspace(-1.0, 1.0, 4 * 599).reshape(4, 599)
    rule_of = lambda t: lambda s, b, h, i, j: s + t[h, i - j + 299]  # noqa: E731
    q = jax.ShapeDtypeStruct((1, 300, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 300, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
      out = jaxflash.flash_attention(q, k, v, score_mod=rule_of(table), is_causal=True,
                                     implementation="mosaic")
      return jnp.sum(out.astype(jnp.float32))

    assert "mosaic_gpu" in lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
    x = random_array(29, (1, 40, 4, 16), "float").astype(jnp.float32)
    got = jax.grad(lambda t: jnp.sum(jnp.sin(attention("xla", x, x, x,
                                                       score_mod=rule_of(t)))))(table)
    want = jax.grad(lambda t: jnp.sum(jnp.sin(jaxflash.reference_attention(
        x, x, x, score_mod=rule_of(t))[0])))(table)
  assert got.dtype == jnp.float64 and rel_err(got, want) < F32_TOLERANCE


@pytest.mark.gpu
def test_mosaic_kernels_under_x64():
  with jax.enable_x64(True):
    check("mosaic", b=1, t=70, s=133, n=2, k=1, h=64, dtype=jnp.bfloat16,
          score_mod=lambda *_: _x64_alibi(), is_causal=True)


# (tanh_gate and relative_bf16 in the variants: test_score_mod.py::
# test_mosaic_kernels_lower_for_cuda[t5_buckets] lowers the same tanh of the score (and its
# derivative in the backward) beside a lookup, and [relative_table] (the README part's too) the
# same lookup through its band: a bfloat16 table's band holds its values as float32 bits as a
# float32 table's does, and `mask_mod.from_int32` casts them back.)
@pytest.mark.parametrize("rule", ("alibi", pytest.param("tanh_gate", marks=pytest.mark.variants),
                                  "relative_table", "t5_buckets",
                                  pytest.param("relative_bf16", marks=pytest.mark.variants)))
def test_mosaic_kernels_lower_for_cuda(rule, cuda_plugin):
  q = jax.ShapeDtypeStruct((2, 1000, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 1000, 2, 128), jnp.bfloat16)

  def loss(q, k, v):
    out = jaxflash.flash_attention(q, k, v, score_mod=MOSAIC_RULES[rule], is_causal=True,
                                   implementation="mosaic")
    return jnp.sum(out.astype(jnp.float32))

  text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
  assert "mosaic_gpu" in text and "jaxflash_backward_dkv" not in text  # (no Triton kernel)


def test_who_serves_it():
  """Triton's and Mosaic's kernels run a score_mod's tile rule; a gather of both indices only
  the XLA backend runs."""
  q = jax.ShapeDtypeStruct((1, 64, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
  which = lambda rule, **kw: jaxflash.implementation_for(  # noqa: E731
      q, kv, kv, score_mod=RULES[rule], interpret=True, **kw)
  assert which("alibi", implementation="triton") == "triton"
  assert which("alibi", implementation="mosaic") == "mosaic"
  # A lookup in a captured table: Triton gathers it; Mosaic GPU cannot gather, but reads a
  # lookup through q_idx - kv_idx from its band. Other lookups it declines.
  assert mask_mod_lib.split_score(RULES["relative_table"]).lookups
  assert which("relative_table", implementation="triton") == "triton"
  assert which("relative_table", implementation="mosaic") == "mosaic"
  both = lambda score, b, h, i, j: score + TABLE[h, (i + j) % 90]  # noqa: E731
  with pytest.raises(ValueError, match="gather"):
    jaxflash.implementation_for(q, kv, kv, score_mod=both, implementation="mosaic",
                                interpret=True)
  assert jaxflash.implementation_for(q, kv, kv, score_mod=both, implementation="triton",
                                     interpret=True) == "triton"
  # A table indexed by a value of the score itself is no lookup of indices: XLA only.
  by_score = lambda score, b, h, i, j: score + TABLE[h, jnp.int32(score) % 8]  # noqa: E731
  with pytest.raises(ValueError, match="cannot evaluate per tile"):
    jaxflash.implementation_for(q, kv, kv, score_mod=by_score, implementation="triton",
                                interpret=True)


def test_the_split_sees_features_and_lookups():
  alibi = mask_mod_lib.split_score(RULES["alibi"])
  assert alibi.kernel_reason is None and alibi.takes_score and not alibi.lookups
  # slope[h] * (j - i) separated: -slope[h] * i a row feature, slope[h] * j a column one, and
  # the tile rule two sums that build no index tile.
  assert len(alibi.row_vars) == 1 and len(alibi.col_vars) == 1
  assert [e.primitive.name for e in alibi.tile_eqns] == ["add", "add"]
  assert not alibi.reads(mask_mod_lib.Q) and not alibi.reads(mask_mod_lib.KV)
  table = mask_mod_lib.split_score(RULES["relative_table"])
  assert table.kernel_reason is None and len(table.lookups) == 1
  assert table.diagonal_lookups and table.lookup_reason is None
  (flat,) = table.table_arrays()
  assert flat.shape == (TABLE.size,)


@pytest.mark.parametrize("index,diagonal", [
    (lambda h, i, j: (h, i - j + 53), True),
    (lambda h, i, j: (h, 89 - (j - i + 36)), True),
    (lambda h, i, j: (h, 3 * (i - j) // 2 + 60), True),  # (a function of i - j, then anything)
    (lambda h, i, j: (h, jnp.clip(i - j, -20, 20) + 40), True),
    (lambda h, i, j: (h, _t5_bucket(jnp.abs(j - i))), True),
    (lambda h, i, j: (h, (i - j) * (h + 1) // 3 + 45), True),  # (a factor of the head)
    (lambda h, i, j: (h, (SLOPES[h] * (i - j)).astype(jnp.int32) + 45), True),
    (lambda h, i, j: (h, (i + j) % 90), False),
    (lambda h, i, j: (h, (i - 2 * j) % 90), False),
    (lambda h, i, j: (h, i // 16 - j // 16 + 45), False),  # (blocks: not one per diagonal)
    (lambda h, i, j: ((i - j) % 4, j % 90), False),
    # (Rounded to integers before the difference: not one value per diagonal.)
    (lambda h, i, j: (h, (SLOPES[h] * i).astype(jnp.int32) - (SLOPES[h] * j).astype(jnp.int32)
                      + 45), False),
])
def test_the_split_finds_diagonal_lookups(index, diagonal):
  """A lookup whose indices depend on the query and key through ``q_idx - kv_idx`` alone is
  diagonal, and its band of values equals the function on every (query, key) pair."""
  rule = lambda score, b, h, i, j: score + TABLE[index(h, i, j)]  # noqa: E731
  split = mask_mod_lib.split_score(rule)
  assert split.diagonal_lookups == diagonal
  assert (split.lookup_reason is None) == diagonal
  if not diagonal:
    assert split.band_values(B, N, T, S) is None
    return
  bands = split.band_values(B, N, T, S)  # [1, 1 | B, 1 | N, T + S]
  i, j = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
  for h in (0, N - 1):
    want = TABLE[index(h, i, j)]
    got = mask_mod_lib.from_int32(bands[0, 0, min(h, bands.shape[2] - 1)][i - j + S],
                                  jnp.float32)
    assert float(jnp.max(jnp.abs(got - want))) == 0.0


def test_the_split_finds_a_row_term():
  """ALiBi's query term is added last, and the rule without it reads no row feature; rules
  whose result is not ``rest + (a value of no key index)`` have none."""
  alibi = mask_mod_lib.split_score(RULES["alibi"])
  assert alibi.row_term is alibi.row_vars[0]
  rest = alibi.without_row_term
  assert rest.row_vars == () and rest.col_vars == alibi.col_vars
  assert [e.primitive.name for e in rest.tile_eqns] == ["add"]
  i, j = jnp.arange(9)[:, None], jnp.arange(11)[None, :]
  score = random_array(17, (9, 11), "float")
  gap = alibi.reference(0, 2, i, j, score=score) - rest.reference(0, 2, i, j, score=score)
  assert float(jnp.max(jnp.abs(gap - (-SLOPES[2] * i)))) < 1e-5  # the same on every key
  for rule in ("tanh_gate", "key_only", "relative_table"):
    split = mask_mod_lib.split_score(RULES[rule])
    assert split.row_term is None and split.without_row_term is None


def test_the_split_computes_columns():
  """Column features that are elementwise arithmetic of the key index and values of the batch
  row and head (ALiBi's ``slope[h] * kv_idx``, ``0.1 * (kv_idx % 3)``) are computed by the Mosaic
  kernels from their key indices; a column read from a captured array is loaded."""
  alibi = mask_mod_lib.split_score(RULES["alibi"])
  assert alibi.computed_cols == alibi.col_vars and len(alibi.col_scalars) == 1
  assert alibi.without_row_term.col_scalars == alibi.col_scalars
  kv = jnp.arange(0, 5000, 7)
  (made,) = alibi.column_values(kv, [SLOPES[3]]).values()
  assert float(jnp.max(jnp.abs(made - SLOPES[3] * kv))) == 0.0
  key_only = mask_mod_lib.split_score(RULES["key_only"])
  assert key_only.computed_cols == key_only.col_vars and key_only.col_scalars == ()
  looked_up = mask_mod_lib.split_score(lambda s, b, h, i, j: s + TABLE[h, j])
  assert looked_up.col_vars and looked_up.computed_cols == ()


@pytest.mark.parametrize("rule,separated", [
    # Sums, differences, negation, products by a value of neither index and conversions to a
    # float keep a query term and a key term apart; the rest needs the value itself.
    (lambda s, b, h, i, j: s - (3 * (i - j) + SLOPES[h]).astype(jnp.float32) / SLOPES[b], True),
    (lambda s, b, h, i, j: s + ((j - i) // 2).astype(jnp.float32), False),  # (floor division)
    (lambda s, b, h, i, j: s + (i * (j - i)).astype(jnp.float32), False),  # (a product of both)
    (lambda s, b, h, i, j: jnp.where(i >= j, s, s - 0.5 * jnp.abs(i - j)), False),
])
def test_the_split_separates_query_and_key_terms(rule, separated):
  """The tile rule runs on sums of a row and a column feature where arithmetic allows (two
  operations per entry: the two terms' sum and the score's), and its values are the
  function's own (up to float rounding), on indices past 2¹² too."""
  split = mask_mod_lib.split_score(rule)
  ops = [e.primitive.name for e in split.tile_eqns]
  assert (len(ops) == 2) == separated, ops
  i = jnp.arange(0, 9000, 97)[:, None]
  j = jnp.arange(0, 9000, 89)[None, :]
  score = random_array(10, (i.shape[0], j.shape[1]), "float")
  for b, h in ((0, 1), (1, 3)):
    got = split.reference(b, h, i, j, score=score)
    want = rule(score, b, h, i, j)
    assert float(jnp.max(jnp.abs(got - want))) <= 1e-6 * float(jnp.max(jnp.abs(want)))


def test_a_score_mod_cast_to_16_bits():
  """A score_mod whose result is cast to bfloat16 or float16: the cast was pushed into each
  separated term (the score, the query's and the key's), each rounded on its own (5.9e-2
  relative error in bfloat16) or past float16's range (600 * 119 is inf there, while every
  visible 600 * (j - i) is not: NaN rows).

  Under full float32 matmuls: on a GPU the XLA backend's default is TF32, and a logit a TF32
  ulp away from the reference's rounds to the next 16-bit value (7.4e-3 on an H200). Even in
  float32 a logit one ulp from the reference's can land on the other side of a 16-bit rounding
  step: 7.3e-3 on the CPU in one order of CI's tests (2026-12-06; 5e-3 alone), so the bound is
  1.5e-2, still a quarter of the pushed cast's error."""
  q, kk, v, _ = random_qkv(4, 1, 120, 120, 1, 1, 16)
  near = lambda b, h, i, j: jnp.abs(i - j) <= 50  # noqa: E731
  for rule in (lambda s, b, h, i, j: (s + 0.3 * (j - i)).astype(jnp.bfloat16),
               lambda s, b, h, i, j: (s + 600.0 * (j - i)).astype(jnp.float16) / 600.0):
    with jax.default_matmul_precision("highest"):
      got = jaxflash.flash_attention(q, kk, v, mask_mod=near, score_mod=rule,
                                     implementation="xla")
      want, _ = reference_attention(
          q, kk, v, score_mod=rule, mask=jnp.abs(jnp.arange(120)[:, None] - jnp.arange(120)) <= 50)
    assert np.isfinite(np.asarray(got)).all()
    assert rel_err(got, want) < 1.5e-2


def _learned(table, slopes, n_table, gathered=False):
  """T5-like: a gate on the score, a learned table per distance times a learned per-head
  scale, and an ALiBi-like term of learned slopes (a row and a column feature). ``gathered``:
  the table read at (q_idx + kv_idx) instead, a lookup that is no function of the distance."""
  def score_mod(score, b, h, i, j):
    distance = jnp.clip(i - j, -(n_table // 2), n_table // 2) + n_table // 2
    if gathered:
      distance = (i + j) % n_table
    return (2.0 * jnp.tanh(score / 2.0) + table[h % table.shape[0], distance] * slopes[h]
            - slopes[h] * (i - j).astype(jnp.float32) * 0.01)
  return score_mod


# (Triton's gathered case is a variant: the gradient pass is the XLA backend's whichever backend
# ran the call, and its per-entry way is [xla-gathered]'s; Triton gathers every lookup, diagonal
# or not, which [triton-diagonal] holds.)
@pytest.mark.parametrize("implementation,kind", [
    ("xla", "diagonal"), ("triton", "diagonal"), ("mosaic", "diagonal"), ("xla", "gathered"),
    pytest.param("triton", "gathered", marks=pytest.mark.variants)])
def test_gradients_of_captured_arrays(implementation, kind, monkeypatch):
  """Arrays a score_mod closes over get their gradients when they are differentiated (a learned
  relative-position table, per-head slopes), equal to the dense reference's, whichever backend
  runs the call; under jit, with GQA, a causal band, lengths and T != S. An integer array it
  closes over (document ids) gets none, and is no error. A lookup through q_idx - kv_idx takes
  the features' way (sums along rows, columns and diagonals), any other the per-entry one."""
  from jaxflash.backends.xla import backward as xla_backward

  def refuse(*args):
    raise AssertionError("the other way ran")

  monkeypatch.setattr(xla_backward, "_per_entry" if kind == "diagonal" else
                      "_through_features", refuse)
  dtype = jnp.bfloat16 if implementation == "mosaic" else jnp.float32
  q, kk, v, d_out = random_qkv(21, B, T, S, N, K, 64, dtype)
  table = random_array(22, (N, 41), "float")
  slopes = random_array(23, (N,), "float")
  docs = jnp.arange(S) // 20
  lengths = jnp.array([S, 30])

  def loss(fn, table, slopes):
    rule = _learned(table, slopes, 40 if kind == "diagonal" else 41, kind == "gathered")
    both = lambda score, b, h, i, j: jnp.where(  # noqa: E731
        docs[jnp.minimum(i, S - 1)] >= docs[j] - 5, rule(score, b, h, i, j), score)
    out = fn(both)
    return jnp.sum(out.astype(jnp.float32) * d_out)

  ours = lambda mod: attention(implementation, q, kk, v, score_mod=mod,  # noqa: E731
                               is_causal=True, key_value_seq_lengths=lengths)
  theirs = lambda mod: jaxflash.reference_attention(  # noqa: E731
      *(x.astype(jnp.float32) for x in (q, kk, v)), score_mod=mod, is_causal=True,
      key_value_seq_lengths=lengths)[0]
  got = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1)))(table, slopes)
  want = jax.grad(lambda *a: loss(theirs, *a), argnums=(0, 1))(table, slopes)
  tolerance = F32_TOLERANCE if dtype == jnp.float32 else 2e-2
  for g, w in zip(got, want):
    assert rel_err(g, w) < tolerance
  assert float(jnp.max(jnp.abs(got[0]))) > 0  # (the test can fail: zeros were the bug)


def test_a_nan_derivative_where_the_mask_hides_gives_no_nan_gradient():
  """A learned slope times log(q_idx - kv_idx + 1) under is_causal: NaN (log of a negative)
  only on entries the band hides. The forward and dQ, dK, dV were finite but the slopes'
  gradient NaN (0 * NaN in the sum over the tile); it equals the reference's with the rule
  written safe. (A rule the kernels cannot run takes the per-entry way, which stays NaN as
  JAX's where would be: see docs/api.md.)"""
  q, kk, v, d_out = random_qkv(30, 2, 40, 40, 2, 1, 16)

  def loss(attend, safe):
    def fn(slopes):
      def rule(s, b, h, i, j):
        distance = (jnp.maximum(i - j, 0) if safe else i - j).astype(jnp.float32)
        return s - slopes[h] * jnp.log(distance + 1.0)
      return jnp.sum(attend(q, kk, v, rule) * d_out)
    return fn

  slopes = jnp.array([0.7, 0.3])
  got = jax.grad(loss(lambda *a: attention("xla", *a[:3], score_mod=a[3], is_causal=True),
                      safe=False))(slopes)
  want = jax.grad(loss(lambda *a: reference_attention(*a[:3], score_mod=a[3],
                                                      is_causal=True)[0], safe=True))(slopes)
  assert rel_err(got, want) < F32_TOLERANCE


def test_gradient_of_a_captured_python_float():
  """jax.grad of a Python float the score_mod closes over (a temperature, an ALiBi slope), run
  eagerly: its tracer has no ``.ndim``, which the captured arrays' cotangents once read (an
  AttributeError; under jit it ran). Equal to the jitted gradient and the reference's."""
  q, kk, v, d_out = random_qkv(29, 1, 40, 40, 2, 2, 16)

  def loss(attend):
    def fn(alpha):
      rule = lambda s, b, h, i, j: s + alpha * (j - i)  # noqa: E731
      return jnp.sum(attend(q, kk, v, rule)[0] * d_out)
    return fn

  ours = loss(lambda *a: (attention("xla", *a[:3], score_mod=a[3]),))
  want = jax.grad(loss(lambda *a: reference_attention(*a[:3], score_mod=a[3])))(0.1)
  for got in (jax.grad(ours)(0.1), jax.jit(jax.grad(ours))(0.1)):
    assert rel_err(got, want) < F32_TOLERANCE


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
def test_gradients_of_captured_arrays_sharded():
  """A learned table's and slopes' gradients under batch- and head-sharded inputs (Auto and
  Explicit axes) equal one device's."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  q, kk, v, d_out = random_qkv(26, 4, 24, 24, 4, 2, 16)
  table, slopes = random_array(27, (4, 41), "float"), random_array(28, (4,), "float")

  @jax.jit
  def grads(q, kk, v, d_out, table, slopes):
    def loss(table, slopes):
      out = attention("xla", q, kk, v, score_mod=_learned(table, slopes, 40), is_causal=True)
      return jnp.sum(out * d_out)
    return jax.grad(loss, argnums=(0, 1))(table, slopes)

  want = grads(q, kk, v, d_out, table, slopes)
  for axis_type in (AxisType.Auto, AxisType.Explicit):
    mesh = jax.make_mesh((2, 2) if jax.device_count() >= 4 else (2, 1), ("b", "h"),
                         axis_types=(axis_type,) * 2)
    with jax.set_mesh(mesh):
      put = lambda x: jax.device_put(x, NamedSharding(mesh, P("b", None, "h")))  # noqa: E731
      got = grads(put(q), put(kk), put(v), put(d_out), table, slopes)
    for g, w in zip(got, want):
      assert rel_err(g, w) < F32_TOLERANCE


def test_the_gradient_pass_tiles():
  """As large as 1024 x 1024, smaller where the batch and heads would make a tile hold more
  than 2^26 entries."""
  from jaxflash.backends.xla import backward as xla_backward
  size = lambda b, n: xla_backward.gradient_config(  # noqa: E731
      jaxflash._core.Inputs(query=jax.ShapeDtypeStruct((b, 8, n, 16), jnp.float32), key=None,
                            value=None, lengths=None)).block_q
  assert (size(4, 16), size(8, 16), size(64, 64), size(1024, 128)) == (1024, 512, 128, 128)


def test_captured_arrays_not_differentiated_cost_nothing(monkeypatch):
  """The pass that makes a captured array's gradient runs only when the array is
  differentiated: not for a constant, nor for a jit argument whose gradient no one asks."""
  from jaxflash.ops import flash

  def refuse(*args):
    raise AssertionError("the captured arrays' gradient pass ran")

  monkeypatch.setattr(flash.xla_backward, "score_const_gradients", refuse)
  q, kk, v, _ = random_qkv(24, B, T, S, N, K, 16)
  table = random_array(25, (N, 41), "float")

  def loss(q, table):
    rule = _learned(table, jnp.ones((N,)), 40)
    return jnp.sum(attention("xla", q, kk, v, score_mod=rule) ** 2)

  jax.jit(jax.grad(loss))(q, table)  # (the table traced, not differentiated)
  jax.grad(lambda q: loss(q, table))(q)
  with pytest.raises(AssertionError, match="pass ran"):
    jax.grad(loss, argnums=1)(q, table)


@pytest.mark.parametrize("score_mod,match", [
    ("x", "score_mod must be a function"),
    (lambda s, b, h, i: s, "five positional arguments"),
    (lambda s, b, h, i, j: s > 0, "float scores"),
    (lambda s, b, h, i, j: jnp.stack([s, s]), "one score per entry"),
    (lambda s, b, h, i, j: s + undefined_name, "failed on a float32 score"),  # noqa: F821
])
def test_bad_score_mods_are_refused(score_mod, match):
  q = jnp.zeros((1, 8, 2, 16))
  with pytest.raises(ValueError, match=match):
    jaxflash.flash_attention(q, q, q, score_mod=score_mod)


def test_interpret_flag_is_irrelevant_on_xla():
  """(The call goes to XLA even with interpret=True when no kernel serves it.)"""
  q, kk, v, _ = random_qkv(10, 1, 16, 16, 2, 2, 16)
  out = jaxflash.flash_attention(q, kk, v, score_mod=RULES["tanh_gate"],
                                 interpret=interpret_for("triton"))
  want, _ = jaxflash.reference_attention(q, kk, v, score_mod=RULES["tanh_gate"])
  assert rel_err(out, want) < F32_TOLERANCE


@pytest.mark.parametrize("rule", ("alibi", "tanh_gate", "relative_table"))
def test_triton_kernels_lower_for_cuda(rule):
  """Forward and every gradient (dQ, dK/dV, and the bias gradient's kernel), lowered for CUDA
  with every Triton module verified."""
  q = jax.ShapeDtypeStruct((2, 100, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 100, 2, 64), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, 4, 100, 100), jnp.float32)

  def loss(q, k, v, bias):
    out = jaxflash.flash_attention(q, k, v, bias, score_mod=RULES[rule], is_causal=True,
                                   implementation="triton")
    return jnp.sum(out.astype(jnp.float32))

  text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2, 3)), q, kv, kv, bias)
  for kernel in ("jaxflash_forward", "jaxflash_backward_dq", "jaxflash_backward_dkv",
                 "jaxflash_backward_dbias"):
    assert kernel in text


# (ALiBi's case is a variant: test_gradients_of_captured_arrays_sharded holds per-head slopes (row
# and column features of the head) sharded with the heads under Auto and Explicit axes, and
# [relative_table] outputs and gradients of a sharded call with a score_mod.)
@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
@pytest.mark.parametrize("rule", (pytest.param("alibi", marks=pytest.mark.variants),
                                  "relative_table"))
def test_batch_and_heads_sharded(rule):
  """Its per-head features shard with the heads (ALiBi's slopes); a lookup's table is whole on
  every device. Outputs and gradients equal one device's, under Auto and Explicit axes."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  q, kk, v, d_out = random_qkv(11, 4, 24, 24, 4, 2, 16)

  def fwd_bwd(q, kk, v, d_out):
    out, vjp = jax.vjp(lambda *x: attention("xla", *x, score_mod=RULES[rule], is_causal=True),
                       q, kk, v)
    return (out,) + vjp(d_out)

  fn = jax.jit(fwd_bwd)
  want = fn(q, kk, v, d_out)
  shape = (2, 2) if jax.device_count() >= 4 else (2, 1)
  for axis_type in (AxisType.Auto, AxisType.Explicit):
    mesh = jax.make_mesh(shape, ("b", "h"), axis_types=(axis_type,) * 2)
    with jax.set_mesh(mesh):
      put = lambda x: jax.device_put(x, NamedSharding(mesh, P("b", None, "h")))  # noqa: E731
      got = fn(put(q), put(kk), put(v), put(d_out))
    for g, w in zip(got, want):
      assert rel_err(g, w) < F32_TOLERANCE


@pytest.mark.parametrize("implementation", ("mosaic", "triton"))
def test_kernels_with_every_other_option(implementation):
  """A score_mod beside a window, lengths, segments, a mask_mod, a soft cap, dropout and sinks
  (no dense mask or bias: with those the Mosaic backward hands the call to Triton's), in the
  kernels (Mosaic GPU's interpreter and Triton's on a CPU); the Mosaic backward runs it."""
  b, t, s, n = 2, 70, 133, 2
  options = dict(
      is_causal=True, local_window_size=(40, 0), logits_soft_cap=3.0,
      query_seq_lengths=jnp.array([70, 31]), key_value_seq_lengths=jnp.array([133, 60]),
      segment_ids=(random_array(12, (b, t), 2), random_array(13, (b, s), 2)),
      mask_mod=lambda *_: lambda bb, h, i, j: (i + 2 * j) % 7 != 0,
      dropout_rate=0.2, dropout_rng=jax.random.key(3),
      sinks=random_array(14, (n,), "float"))
  check(implementation, b=b, t=t, s=s, n=n, k=1, h=64, dtype=jnp.bfloat16,
        score_mod=lambda *_: RULES["alibi"], **options)
