"""The Flax layer: jaxflash's linen/nnx hooks and modules against Flax's own, in float32.

Same parameters -> same outputs and parameter gradients under causal, padding and combined Flax
masks; checkpoints of Flax modules load unchanged; dropout trains under jit; decode mode; GQA;
fallbacks to Flax for what the kernels cannot serve. On a CPU the hooks run jaxflash's `xla`
backend (the Triton kernels are covered against the same reference in `test_attention.py`).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import jaxflash.linen
import jaxflash.nnx
from checks import F32_TOLERANCE, ON_GPU, rel_err, variant_if

B, T, D, HEADS = 2, 24, 32, 4
TOL = F32_TOLERANCE  # (TF32 dots on a GPU: both jaxflash and Flax run float32 matmuls in TF32)


def _inputs(seed=0):
  x = jax.random.normal(jax.random.key(seed), (B, T, D))
  lengths = jnp.array([T, 17])
  padding = jnp.arange(T)[None, :] < lengths[:, None]  # [B, T]
  return x, padding


def _flax_masks(padding):
  causal = nn.make_causal_mask(jnp.ones((B, T)))  # float32 [B, 1, T, T]
  pad = nn.make_attention_mask(padding, padding)  # float32, padded rows fully masked
  return {"causal": causal, "padding": pad, "combined": nn.combine_masks(causal, pad),
          "bool_keys": jnp.broadcast_to(padding[:, None, None, :], (B, 1, T, T))}


def _assert_grads_close(got, want):
  """Leaf by leaf, relative to the largest gradient: the key projection's bias has an exactly
  zero gradient (softmax ignores a per-row constant), so its own relative error is noise."""
  scale = max(float(jnp.linalg.norm(w)) for w in jax.tree.leaves(want))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert float(jnp.linalg.norm(g - w)) < TOL * scale


def _loss_weights(padding):
  """Padded query rows see no key; a real model drops them from the loss, and so do we (Flax
  returns the mean of the values there, jaxflash zeros)."""
  return padding[:, :, None].astype(jnp.float32)


# ---------------------------------------------------------------------------------------------
# linen


# "causal", "padding" and "is_causal" are variants: [combined] holds a Flax float mask (causal
# and padding masks both, through the same conversion in `_flax.attend`), and
# [is_causal_and_padding] the is_causal field with a padding mask.
@pytest.mark.parametrize("mask_kind", [
    "none", pytest.param("causal", marks=pytest.mark.variants),
    pytest.param("padding", marks=pytest.mark.variants), "combined", "bool_keys",
    pytest.param("is_causal", marks=pytest.mark.variants), "is_causal_and_padding"])
def test_linen_module_matches_flax(mask_kind):
  x, padding = _inputs()
  masks = _flax_masks(padding)
  flax_mask = {"is_causal": masks["causal"], "is_causal_and_padding": masks["combined"],
               "none": None}.get(mask_kind, masks.get(mask_kind))
  our_mask = {"is_causal": None, "is_causal_and_padding": masks["padding"]}.get(
      mask_kind, flax_mask)
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  ours = jaxflash.linen.MultiHeadDotProductAttention(num_heads=HEADS,
                                                     is_causal=mask_kind.startswith("is_"))
  params = ref.init(jax.random.key(1), x)  # a Flax checkpoint, loaded into our module as is
  weights = _loss_weights(padding)

  def loss(module, mask):
    return lambda p: jnp.sum(module.apply(p, x, mask=mask) * weights)

  got_out = jax.jit(lambda p: ours.apply(p, x, mask=our_mask))(params)  # one compile, not eager
  assert rel_err(got_out * weights, ref.apply(params, x, mask=flax_mask) * weights) < TOL
  got = jax.jit(jax.grad(loss(ours, our_mask)))(params)
  want = jax.grad(loss(ref, flax_mask))(params)
  _assert_grads_close(got, want)


def test_linen_parameter_trees_and_names_match():
  x, _ = _inputs()

  class Model(nn.Module):
    use_jaxflash: bool

    @nn.compact
    def __call__(self, x):
      lib = jaxflash.linen if self.use_jaxflash else nn
      return (lib.SelfAttention(num_heads=HEADS)(x)
              + lib.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(x)
              + lib.MultiHeadAttention(num_heads=2)(x))

  ref = Model(False).init(jax.random.key(0), x)
  ours = Model(True).init(jax.random.key(0), x)
  assert jax.tree.structure(ref) == jax.tree.structure(ours)
  assert all(a.shape == b.shape for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(ours)))
  assert rel_err(Model(True).apply(ref, x), Model(False).apply(ref, x)) < TOL


def test_linen_hook_in_flax_class_with_bias_and_batch_axes():
  """The one-line swap (attention_fn=) and the bare hook: extra batch axes, bias, float mask."""
  x, padding = _inputs()
  mask = _flax_masks(padding)["causal"]
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  swapped = nn.MultiHeadDotProductAttention(num_heads=HEADS,
                                            attention_fn=jaxflash.linen.dot_product_attention)
  params = ref.init(jax.random.key(1), x)
  assert rel_err(swapped.apply(params, x, mask=mask), ref.apply(params, x, mask=mask)) < TOL

  keys = jax.random.split(jax.random.key(2), 4)
  q, k, v = (jax.random.normal(key, (2, 3, 11, 4, 8)) for key in keys[:3])  # two batch axes
  bias = jax.random.normal(keys[3], (3, 4, 11, 11))
  mask = jnp.tril(jnp.ones((11, 11)))  # float, broadcast over batch axes and heads
  want = nn.dot_product_attention(q, k, v, bias, mask)
  assert rel_err(jaxflash.linen.dot_product_attention(q, k, v, bias, mask), want) < TOL
  unbatched = jaxflash.linen.dot_product_attention(q[0, 0], k[0, 0], v[0, 0], bias[0], mask)
  assert rel_err(unbatched, want[0, 0]) < TOL


def test_linen_dropout_trains_under_jit():
  x, _ = _inputs()
  model = jaxflash.linen.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.3,
                                                      is_causal=True)
  params = model.init(jax.random.key(0), x, deterministic=True)
  target = jax.random.normal(jax.random.key(5), x.shape)

  @jax.jit
  def step(params, rng):
    def loss(p):
      out = model.apply(p, x, deterministic=False, rngs={"dropout": rng})
      return jnp.mean((out - target) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)

  first, _ = step(params, jax.random.key(1))
  again, _ = step(params, jax.random.key(1))
  other, _ = step(params, jax.random.key(2))
  assert first == again and first != other
  losses = []
  for i in range(30):
    value, params = step(params, jax.random.key(10 + i))
    losses.append(float(value))
  assert np.isfinite(losses).all() and np.mean(losses[-5:]) < np.mean(losses[:5])
  # deterministic=True means no dropout at all
  clean = model.apply(params, x, deterministic=True)
  plain = jaxflash.linen.MultiHeadDotProductAttention(num_heads=HEADS, is_causal=True)
  assert rel_err(clean, plain.apply(params, x)) < TOL


def test_linen_decode_matches_full_causal():
  x, _ = _inputs()
  model = jaxflash.linen.MultiHeadDotProductAttention(num_heads=HEADS, decode=True,
                                                      is_causal=True)
  full = jaxflash.linen.MultiHeadDotProductAttention(num_heads=HEADS, is_causal=True)
  params = full.init(jax.random.key(0), x)
  cache = model.init(jax.random.key(0), x)["cache"]  # shapes the cache for T tokens
  # One compiled step for all T tokens (the cache index is state, the shapes never change).
  step = jax.jit(lambda cache, token: model.apply({"params": params["params"], "cache": cache},
                                                  token, mutable=["cache"]))
  outs = []
  for t in range(T):
    out, updated = step(cache, x[:, t:t + 1])
    cache = updated["cache"]
    outs.append(out)
  assert rel_err(jnp.concatenate(outs, axis=1), full.apply(params, x)) < TOL


def test_linen_falls_back_for_what_kernels_cannot_serve():
  """Sowing the weights, explicit precision: Flax's implementation answers (not ignored)."""
  x, _ = _inputs()
  ours = jaxflash.linen.MultiHeadDotProductAttention(num_heads=HEADS, is_causal=True)
  params = ours.init(jax.random.key(0), x)
  out, state = ours.apply(params, x, sow_weights=True, mutable=["intermediates"])
  weights = state["intermediates"]["attention_weights"][0]
  assert weights.shape == (B, HEADS, T, T)
  np.testing.assert_allclose(np.triu(np.asarray(weights), 1), 0.0)  # causal was honoured
  assert rel_err(out, ours.apply(params, x)) < TOL
  precise = jaxflash.linen.MultiHeadDotProductAttention(
      num_heads=HEADS, precision=jax.lax.Precision.HIGHEST, is_causal=True)
  assert rel_err(precise.apply(params, x), ours.apply(params, x)) < TOL


def test_hooks_fall_back_for_a_symbolic_length():
  """jax.export with a symbolic sequence length: the kernels are tiled by it, so Flax's code
  answers (the hook raised), and the exported function equals Flax's module."""
  from jax import export
  x, _ = _inputs()
  spec = jax.ShapeDtypeStruct(export.symbolic_shape(f"b, t, {x.shape[-1]}"), x.dtype)
  ours = nn.MultiHeadDotProductAttention(num_heads=HEADS,
                                         attention_fn=jaxflash.linen.dot_product_attention)
  theirs = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  params = ours.init(jax.random.key(0), x)
  exported = export.export(jax.jit(lambda x: ours.apply(params, x)))(spec)
  assert rel_err(exported.call(x), theirs.apply(params, x)) < TOL


# ---------------------------------------------------------------------------------------------
# nnx


# Variants: is_causal (both head counts; [is_causal_and_padding-4] and [-2] hold the is_causal
# argument, with a padding mask), none-2 ([none-4] holds the call without a mask, [combined-2]
# and [is_causal_and_padding-2] GQA) and combined-4 ([combined-2] holds the Flax mask,
# [is_causal_and_padding-4] MHA with a mask).
_NNX_VARIANTS = {("none", 2), ("combined", HEADS), ("is_causal", HEADS), ("is_causal", 2)}


@pytest.mark.parametrize("mask_kind,kv_heads", [
    variant_if((kind, heads) in _NNX_VARIANTS, kind, heads, id=f"{kind}-{heads}")
    for heads in (HEADS, 2) for kind in ("none", "combined", "is_causal", "is_causal_and_padding")])
def test_nnx_module_matches_flax(mask_kind, kv_heads):
  x, padding = _inputs()
  masks = _flax_masks(padding)
  causal = mask_kind.startswith("is_")
  mask = {"none": None, "combined": masks["combined"], "is_causal": None,
          "is_causal_and_padding": masks["padding"]}[mask_kind]
  ref = nnx.MultiHeadAttention(HEADS, D, num_kv_heads=kv_heads, decode=False,
                               rngs=nnx.Rngs(0))
  ours = jaxflash.nnx.MultiHeadAttention(HEADS, D, num_kv_heads=kv_heads, decode=False,
                                         rngs=nnx.Rngs(1))
  nnx.update(ours, nnx.state(ref, nnx.Param))  # load the Flax module's parameters
  weights = _loss_weights(padding)

  def loss(module):
    return jnp.sum(module(x, mask=mask, is_causal=causal) * weights)

  # jaxflash's side jitted (one compile instead of eager blockwise loops); Flax's as it is.
  got_out = nnx.jit(lambda m: m(x, mask=mask, is_causal=causal))(ours)
  assert rel_err(got_out * weights, ref(x, mask=mask, is_causal=causal) * weights) < TOL
  _assert_grads_close(nnx.state(nnx.jit(nnx.grad(loss))(ours)), nnx.state(nnx.grad(loss)(ref)))


def test_nnx_state_trees_match_and_hook_swap():
  x, _ = _inputs()
  ref = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=nnx.Rngs(0))
  ours = jaxflash.nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=nnx.Rngs(0))
  assert jax.tree.structure(nnx.state(ref, nnx.Param)) == jax.tree.structure(
      nnx.state(ours, nnx.Param))
  swapped = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=nnx.Rngs(0),
                                   attention_fn=jaxflash.nnx.dot_product_attention)
  assert rel_err(swapped(x, is_causal=True), ref(x, is_causal=True)) < TOL


def test_nnx_dropout_and_decode():
  x, _ = _inputs()
  model = jaxflash.nnx.MultiHeadAttention(HEADS, D, dropout_rate=0.2, decode=False,
                                          deterministic=False, rngs=nnx.Rngs(0, dropout=1))

  @nnx.jit
  def loss_and_grad(model):
    return nnx.value_and_grad(lambda m: jnp.mean(m(x, is_causal=True) ** 2))(model)

  a, grads = loss_and_grad(model)
  b, _ = loss_and_grad(model)  # the dropout stream advanced: a new mask
  assert np.isfinite(a) and a != b
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
  clean = model(x, is_causal=True, deterministic=True)
  assert rel_err(clean, jaxflash.nnx.MultiHeadAttention(
      HEADS, D, decode=False, rngs=nnx.Rngs(0))(x, is_causal=True)) < TOL

  step = jaxflash.nnx.MultiHeadAttention(HEADS, D, decode=True, rngs=nnx.Rngs(3))
  full = jaxflash.nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=nnx.Rngs(3))
  step.init_cache(x.shape)
  # is_causal=True is ignored in decode mode: the cache mask is already causal
  decode = nnx.jit(lambda module, token: module(token, is_causal=True))  # one compile, T steps
  outs = [decode(step, x[:, t:t + 1]) for t in range(T)]
  assert rel_err(jnp.concatenate(outs, axis=1), full(x, is_causal=True)) < TOL


@pytest.mark.parametrize("hook", ["linen", "nnx"])
@pytest.mark.parametrize("broadcast", [True, False])
def test_hooks_pass_broadcast_dropout_on(hook, broadcast):
  """A hook's ``broadcast_dropout`` reaches the kernels: with the same data in every batch row
  and head, Flax's default (True: one keep mask for all of them) gives equal slices, and the
  hook's output is `jaxflash.flash_attention`'s with the same flag; False gives each row and
  head a mask of its own (a hook that dropped the flag passed every other test)."""
  x = jax.random.normal(jax.random.key(0), (1, 16, 1, 32))
  q = jnp.tile(x, (2, 1, 4, 1))  # identical batch rows and heads
  options = dict(dropout_rate=0.5, dropout_rng=jax.random.key(1), broadcast_dropout=broadcast)
  out = getattr(jaxflash, hook).dot_product_attention(q, q, q, deterministic=False, **options)
  want = jaxflash.flash_attention(q, q, q, **options)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
  spread = float(jnp.max(jnp.abs(out - out[:1, :, :1])))
  assert (spread == 0.0) == broadcast, spread


def _spy_flax_is_causal(monkeypatch) -> list:
  """The ``is_causal`` of each call that reaches Flax's own nnx.MultiHeadAttention."""
  seen = []
  parent = nnx.MultiHeadAttention.__call__
  monkeypatch.setattr(nnx.MultiHeadAttention, "__call__", lambda self, *a, **kw: seen.append(
      kw.get("is_causal")) or parent(self, *a, **kw))
  return seen


def test_nnx_decode_ignores_is_causal_whatever_flax_does(monkeypatch):
  """A decode step called with is_causal=True reaches Flax's module with is_causal=False: some
  Flax versions pass it on to the attention function, where a causal band for one query row
  against the cache keeps key 0 alone (seen on the GPU machine's Flax)."""
  seen = _spy_flax_is_causal(monkeypatch)
  x, _ = _inputs()
  step = jaxflash.nnx.MultiHeadAttention(HEADS, D, decode=True, rngs=nnx.Rngs(3))
  step.init_cache(x.shape)
  step(x[:, :1], is_causal=True)
  model = jaxflash.nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=nnx.Rngs(3))
  model(x, is_causal=True)
  assert seen == [False, True]


def test_nnx_fallbacks_and_refusals():
  x, _ = _inputs()
  ours = jaxflash.nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=nnx.Rngs(0))
  out = ours(x, is_causal=True, sow_weights=True)
  weights = nnx.pop(ours, nnx.Intermediate)
  assert jax.tree.leaves(weights)[0].shape == (B, HEADS, T, T)
  assert rel_err(out, ours(x, is_causal=True)) < TOL
  q = jax.random.normal(jax.random.key(0), (B, T, HEADS, 8))
  with pytest.raises(TypeError, match="input_positions"):
    jaxflash.nnx.dot_product_attention(q, q, q, input_positions=jnp.arange(T))


@pytest.mark.parametrize("hook", [jaxflash.linen.dot_product_attention,
                                  jaxflash.nnx.dot_product_attention])
def test_rows_with_no_visible_key_are_zero(hook):
  q = jax.random.normal(jax.random.key(0), (1, 6, 2, 8))
  mask = jnp.ones((1, 1, 6, 6)).at[:, :, 4:].set(0.0)
  out = hook(q, q, q, mask=mask)
  np.testing.assert_array_equal(np.asarray(out[:, 4:]), 0.0)
  assert rel_err(out[:, :4], nn.dot_product_attention(q, q, q, mask=mask)[:, :4]) < TOL


# ---------------------------------------------------------------------------------------------
# implementation: jaxflash's backend, from every Flax entry point


def _spy_implementations(monkeypatch) -> list:
  """Records the ``implementation`` of each `flash_attention` / `decode_attention` call that the
  hooks make."""
  from jaxflash import _flax
  seen = []
  for name in ("flash_attention", "decode_attention"):
    real = getattr(_flax, name)
    monkeypatch.setattr(_flax, name, lambda *a, real=real, name=name, **kw: seen.append(
        (name, kw.get("implementation"))) or real(*a, **kw))
  return seen


def test_implementation_reaches_jaxflash_from_every_flax_entry(monkeypatch):
  """A linen module's ``implementation`` field, an nnx module's constructor argument and the
  hooks' keyword all reach jaxflash (decode steps too), as Flax passes its own options; a
  backend that cannot serve the call says so instead of being ignored."""
  seen = _spy_implementations(monkeypatch)
  x, _ = _inputs()
  q = jax.random.normal(jax.random.key(1), (B, T, HEADS, 8))
  for hook in (jaxflash.linen.dot_product_attention, jaxflash.nnx.dot_product_attention):
    hook(q, q, q, implementation="xla")
  model = jaxflash.linen.MultiHeadDotProductAttention(num_heads=HEADS, is_causal=True,
                                                      implementation="xla")
  params = model.init(jax.random.key(0), x)
  default = jaxflash.linen.MultiHeadDotProductAttention(num_heads=HEADS, is_causal=True)
  chex.assert_trees_all_close(model.apply(params, x), default.apply(params, x))
  jaxflash.nnx.MultiHeadAttention(HEADS, D, decode=False, implementation="xla",
                                  rngs=nnx.Rngs(0))(x, is_causal=True)
  step = jaxflash.linen.SelfAttention(num_heads=HEADS, decode=True, implementation="xla")
  cache = step.init(jax.random.key(0), x)["cache"]
  step.apply({**params, "cache": cache}, x[:, :1], mutable=["cache"])
  nnx_step = jaxflash.nnx.MultiHeadAttention(HEADS, D, decode=True, implementation="xla",
                                             rngs=nnx.Rngs(0))
  nnx_step.init_cache(x.shape)
  nnx_step(x[:, :1])
  flash = ("flash_attention", "xla")
  assert seen == [flash] * 2 + [flash] * 2 + [("flash_attention", None)] + [flash] * 2 + [
      ("decode_attention", "xla")] * 2
  triton = jaxflash.linen.MultiHeadDotProductAttention(num_heads=HEADS, implementation="triton")
  if ON_GPU:  # it serves the call
    triton.init(jax.random.key(0), x)
  else:
    with pytest.raises(jaxflash.backends.UnsupportedCallError, match="triton"):
      triton.init(jax.random.key(0), x)


def test_deterministic_backward_reaches_jaxflash(monkeypatch):
  """``deterministic_backward=False`` on the hooks, a linen module's field and an nnx module's
  constructor reaches `jaxflash.flash_attention` as ``deterministic=False`` (Flax's own
  ``deterministic`` stays the dropout switch); the default passes True; the gradients agree."""
  from jaxflash import _flax
  seen = []
  real = _flax.flash_attention
  monkeypatch.setattr(_flax, "flash_attention", lambda *a, **kw: seen.append(
      kw["deterministic"]) or real(*a, **kw))
  x, _ = _inputs()
  q = jax.random.normal(jax.random.key(1), (B, T, HEADS, 8))
  for hook in (jaxflash.linen.dot_product_attention, jaxflash.nnx.dot_product_attention):
    hook(q, q, q, deterministic_backward=False)
  grads = {}
  for flag in (True, False):
    model = jaxflash.linen.SelfAttention(num_heads=HEADS, is_causal=True,
                                         deterministic_backward=flag)
    params = model.init(jax.random.key(0), x)
    grads[flag] = jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(params)
  chex.assert_trees_all_close(grads[True], grads[False], rtol=1e-5, atol=1e-6)
  jaxflash.nnx.MultiHeadAttention(HEADS, D, decode=False, deterministic_backward=False,
                                  rngs=nnx.Rngs(0))(x, is_causal=True)
  # (The linen modules' init and grad each call the hook: two calls per flag.)
  assert seen == [False, False] + [True] * 2 + [False] * 2 + [False]
  with pytest.raises(ValueError, match="deterministic_backward"):
    jaxflash.linen.dot_product_attention(q, q, q, deterministic_backward="no")


def test_implementation_is_never_dropped_silently():
  """A call that falls back to Flax's own attention cannot honour ``implementation``, and an
  ``attention_fn`` that takes no ``implementation`` cannot be given one: ValueErrors that say
  so."""
  x, _ = _inputs()
  model = jaxflash.linen.MultiHeadDotProductAttention(num_heads=HEADS, implementation="xla")
  params = model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="implementation='xla'.*falls back"):
    model.apply(params, x, sow_weights=True, mutable=["intermediates"])
  with pytest.raises(ValueError, match="implementation='xla'.*falls back"):
    jaxflash.nnx.MultiHeadAttention(HEADS, D, decode=False, implementation="xla",
                                    rngs=nnx.Rngs(0))(x, sow_weights=True)
  with pytest.raises(ValueError, match="attention_fn that takes `implementation`"):
    jaxflash.linen.MultiHeadDotProductAttention(
        num_heads=HEADS, implementation="xla", attention_fn=nn.dot_product_attention).init(
            jax.random.key(0), x)
  with pytest.raises(ValueError, match="attention_fn that takes `implementation`"):
    jaxflash.nnx.MultiHeadAttention(HEADS, D, implementation="xla",
                                    attention_fn=nnx.dot_product_attention, rngs=nnx.Rngs(0))


# ---------------------------------------------------------------------------------------------
# decode mode: the decoding op


def _spy_decode(monkeypatch) -> list:
  """Records each call of `jaxflash.decode_attention` made by the hooks (its kv_lengths)."""
  from jaxflash import _flax
  calls = []
  real = _flax.decode_attention

  def spy(q, k, v, kv_lengths, **kwargs):
    calls.append(kv_lengths)
    return real(q, k, v, kv_lengths, **kwargs)

  monkeypatch.setattr(_flax, "decode_attention", spy)
  return calls


# (MultiHeadDotProductAttention is a variant: [SelfAttention] holds the decode step of the
# modules' shared `_Jaxflash.__call__` (the decoding op on the cache, a caller's mask), and
# test_linen_decode_matches_full_causal MultiHeadDotProductAttention's decode loop.)
@pytest.mark.parametrize("cls", [
    pytest.param("MultiHeadDotProductAttention", marks=pytest.mark.variants), "SelfAttention"])
def test_linen_decode_runs_the_decoding_op_like_flax(cls, monkeypatch):
  """A linen decode loop: each step runs `jaxflash.decode_attention` on the cache, with the
  occupancy as kv_lengths, and matches Flax's own module in decode mode step by step; a step
  given a mask of the caller's keeps the masked path."""
  calls = _spy_decode(monkeypatch)
  x, _ = _inputs(3)
  ours = getattr(jaxflash.linen, cls)(num_heads=HEADS, decode=True)
  theirs = getattr(nn, cls)(num_heads=HEADS, decode=True)
  variables = theirs.init(jax.random.key(0), x)  # the cache is shaped for T tokens
  params, cache = {"params": variables["params"]}, variables["cache"]
  mine = cache
  step = lambda m, c, token: m.apply({**params, "cache": c}, token, mutable=["cache"])
  for t in range(6):
    want, updated = step(theirs, cache, x[:, t:t + 1])
    got, mine_updated = step(ours, mine, x[:, t:t + 1])
    cache, mine = updated["cache"], mine_updated["cache"]
    assert rel_err(got, want) < F32_TOLERANCE
  assert len(calls) == 6 and np.asarray(calls[-1]).tolist() == [6] * B
  mask = jnp.ones((B, 1, 1, T), bool).at[0, ..., 2].set(False)  # the caller's own mask
  want, _ = theirs.apply({**params, "cache": cache}, x[:, 6:7], mask=mask, mutable=["cache"])
  got, _ = ours.apply({**params, "cache": mine}, x[:, 6:7], mask=mask, mutable=["cache"])
  assert rel_err(got, want) < F32_TOLERANCE and len(calls) == 6


def test_nnx_decode_runs_the_decoding_op_like_flax(monkeypatch):
  """An nnx decode loop with GQA (8 query heads on 2 K/V heads) under nnx.jit: each step runs
  `jaxflash.decode_attention` and matches Flax's module with the same weights."""
  calls = _spy_decode(monkeypatch)
  x, _ = _inputs(4)
  ours = jaxflash.nnx.MultiHeadAttention(8, D, qkv_features=64, num_kv_heads=2, decode=True,
                                         rngs=nnx.Rngs(5))
  theirs = nnx.MultiHeadAttention(8, D, qkv_features=64, num_kv_heads=2, decode=True,
                                  rngs=nnx.Rngs(5))
  for module in (ours, theirs):
    module.init_cache(x.shape)
  step = nnx.jit(lambda module, token: module(token))
  for t in range(5):
    assert rel_err(step(ours, x[:, t:t + 1]), step(theirs, x[:, t:t + 1])) < F32_TOLERANCE
  assert len(calls) == 1  # traced once: one compiled step for every token


def test_nnx_decode_asked_for_by_the_call(monkeypatch):
  """A module made with ``decode=False`` and called with ``decode=True`` (nnx's per-call
  switch) decodes as one made with ``decode=True`` does: `jaxflash.decode_attention` on the
  cache, ``is_causal`` dropped before Flax's module (which some Flax versions pass on:
  test_nnx_decode_ignores_is_causal_whatever_flax_does), its steps those of a whole causal
  call."""
  calls = _spy_decode(monkeypatch)
  seen = _spy_flax_is_causal(monkeypatch)
  x, _ = _inputs()
  step = jaxflash.nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=nnx.Rngs(3))
  step.init_cache(x.shape)
  outs = [step(x[:, t:t + 1], decode=True, is_causal=True) for t in range(4)]
  assert len(calls) == 4 and seen == [False] * 4, (len(calls), seen)
  full = jaxflash.nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=nnx.Rngs(3))
  assert rel_err(jnp.concatenate(outs, axis=1), full(x[:, :4], is_causal=True)) < TOL


def _sinks_reference(module_out_fn, sinks):
  """The module's output with the hook replaced by the dense reference with ``sinks``."""
  from jaxflash.reference import reference_attention

  def attention_fn(query, key, value, bias=None, mask=None, **unused):
    depth = query.shape[-1]
    out, _ = reference_attention(query, key, value, scale=depth ** -0.5, is_causal=True,
                                 sinks=sinks)
    return out
  return module_out_fn(attention_fn)


def test_linen_sinks_are_a_parameter_that_trains():
  """``sinks=True`` adds a ``sinks`` parameter [heads] (zeros at init) that the hook uses, in
  the call and its gradient, as the reference with those sinks; the other parameters are
  Flax's."""
  x, _ = _inputs()
  module = jaxflash.linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D,
                                                       is_causal=True, sinks=True)
  params = module.init(jax.random.key(1), x)["params"]
  chex.assert_shape(params["sinks"], (HEADS,))
  np.testing.assert_array_equal(params["sinks"], 0.0)
  plain = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D).init(
      jax.random.key(1), x)["params"]
  assert set(params) - set(plain) == {"sinks"}
  params = dict(params, sinks=jnp.array([1.0, -2.0, 0.5, 3.0]))

  def loss(p, attention_fn=None):
    if attention_fn is None:
      return jnp.sum(jnp.sin(module.apply({"params": p}, x)))
    ref = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D,
                                          attention_fn=attention_fn)
    return jnp.sum(jnp.sin(ref.apply({"params": {k: v for k, v in p.items() if k != "sinks"}},
                                     x)))

  got, got_grads = jax.jit(jax.value_and_grad(loss))(params)

  def ref_loss(p):
    return _sinks_reference(lambda fn: loss(p, fn), p["sinks"])
  want, want_grads = jax.value_and_grad(ref_loss)(params)
  assert abs(float(got - want)) <= TOL * max(1.0, abs(float(want)))
  assert rel_err(got_grads["sinks"], want_grads["sinks"]) < TOL
  assert float(jnp.max(jnp.abs(got_grads["sinks"]))) > 0


def test_nnx_sinks_are_a_param_that_trains():
  x, _ = _inputs()
  module = jaxflash.nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, qkv_features=D,
                                           decode=False, sinks=True, rngs=nnx.Rngs(0))
  assert isinstance(module.sinks, nnx.Param)
  chex.assert_shape(module.sinks[...], (HEADS,))
  np.testing.assert_array_equal(module.sinks[...], 0.0)  # zeros at first
  chex.assert_type(module.sinks[...], jnp.float32)
  module.sinks[...] = jnp.array([1.0, -2.0, 0.5, 3.0])

  def loss(m):
    return jnp.sum(jnp.sin(m(x, is_causal=True)))

  grads = nnx.grad(loss)(module)
  traced = {}  # the sinks of the reference's current trace

  def attention_fn(query, key, value, *a, **kw):
    from jaxflash.reference import reference_attention
    return reference_attention(query, key, value, scale=query.shape[-1] ** -0.5,
                               is_causal=True, sinks=traced["sinks"])[0]
  reference = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, qkv_features=D,
                                     decode=False, attention_fn=attention_fn, rngs=nnx.Rngs(0))

  def reference_loss(sinks):
    traced["sinks"] = sinks
    return loss(reference)
  want = jax.grad(reference_loss)(module.sinks[...])
  assert rel_err(grads.sinks[...], want) < TOL
  plain = jaxflash.nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, qkv_features=D,
                                          decode=False, rngs=nnx.Rngs(0))
  assert plain.sinks is None


def test_sinks_need_jaxflash_hooks():
  with pytest.raises(ValueError, match="sinks=True needs jaxflash's attention_fn"):
    jaxflash.linen.SelfAttention(num_heads=HEADS, sinks=True,
                                 attention_fn=nn.dot_product_attention).init(
                                     jax.random.key(0), jnp.ones((1, 4, 8)))
  with pytest.raises(ValueError, match="sinks=True needs jaxflash's attention_fn"):
    jaxflash.nnx.MultiHeadAttention(num_heads=HEADS, in_features=8, sinks=True,
                                    attention_fn=nnx.dot_product_attention, rngs=nnx.Rngs(0))
  q = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match="sinks need jaxflash's kernels"):
    # (An explicit precision falls back to Flax's attention; a value depth of its own no longer
    # does.)
    jaxflash.linen.dot_product_attention(q, q, q, precision=jax.lax.Precision.HIGHEST,
                                         sinks=jnp.zeros(2))


@pytest.mark.parametrize("name", ["MultiHeadDotProductAttention", "MultiHeadAttention",
                                  "SelfAttention"])
def test_linen_modules_defaults(name, monkeypatch):
  """Each linen class as constructed with its defaults: the documented fields (no causal band,
  jaxflash's choice of backend, no sinks, a 16-bit forward, a deterministic backward), which
  reach `jaxflash.flash_attention` so, and Flax's own class's output on the same parameters."""
  from jaxflash import _flax
  seen, real = [], _flax.flash_attention
  monkeypatch.setattr(_flax, "flash_attention",
                      lambda *a, **kw: seen.append(kw) or real(*a, **kw))
  x, _ = _inputs()
  ours = getattr(jaxflash.linen, name)(num_heads=HEADS)
  assert (ours.is_causal, ours.implementation, ours.sinks, ours.fp8,
          ours.deterministic_backward) == (False, None, False, False, True)
  params = ours.init(jax.random.key(0), x)
  assert "sinks" not in params["params"]
  got = ours.apply(params, x)
  want = getattr(nn, name)(num_heads=HEADS).apply(params, x)
  assert rel_err(got, want) < TOL
  assert seen and all(
      (kw["deterministic"], kw["is_causal"], kw["sinks"], kw["implementation"])
      == (True, False, None, None) for kw in seen), seen
