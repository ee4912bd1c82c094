"""Attention masks as functions: document masking, prefix-LM, a sliding window, strided (dilated)
attention and a random block-sparse pattern with jaxflash, each checked against
jax.nn.dot_product_attention given the same mask as a dense [B, 1, T, S] array.

    python examples/masks.py        # a CPU runs it in seconds (the XLA backend)

A mask is a ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` (PyTorch FlexAttention's signature):
jnp code on broadcasting int32 index arrays, True where the query may see the key. It may close
over arrays (document ids, a prefix length per row). `jaxflash.create_block_mask` evaluates it
once, block by block, and keeps which 128 x 128 blocks are empty (skipped), full (computed with no
mask) or partial (the kernels evaluate the mask_mod per entry there); pass the result as
``block_mask=`` to every call and layer that shares the mask. A pattern of whole blocks needs no
function at all: `jaxflash.BlockMask.from_blocks`. See docs/block_sparse.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash

B, T, N, K, H = 2, 512, 4, 2, 32  # batch, length, query heads, key/value heads (GQA), head dim
BLOCK = 128


# --- The masks --------------------------------------------------------------------------------

def documents():
  """Packed documents: a query sees the earlier keys of its own document."""
  lengths = [[100, 300, 112], [256, 200, 56]]  # the documents packed in each batch row
  doc = jnp.asarray([np.repeat(np.arange(len(row)), row) for row in lengths])  # [B, T]

  def mask_mod(b, h, q_idx, kv_idx):
    return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)
  return mask_mod


def prefix_lm():
  """Prefix-LM: every query sees its row's prefix (bidirectional), then causal."""
  prefix = jnp.array([64, 300])  # the prefix length of each batch row

  def mask_mod(b, h, q_idx, kv_idx):
    return (kv_idx < prefix[b]) | (q_idx >= kv_idx)
  return mask_mod


def sliding_window(window: int = 96):
  """Causal within a window: the query and the ``window - 1`` keys before it (the same as
  ``is_causal=True, local_window_size=(window - 1, 0)``, which needs no block mask)."""
  def mask_mod(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
  return mask_mod


def strided(local: int = 32, stride: int = 64):
  """Strided (dilated) attention, the Sparse Transformer's: the last ``local`` keys, and every
  ``stride``-th key before them."""
  def mask_mod(b, h, q_idx, kv_idx):
    back = q_idx - kv_idx
    return (back >= 0) & ((back < local) | (back % stride == 0))
  return mask_mod


def block_pattern(fraction: float = 0.3, seed: int = 0) -> jax.Array:
  """A random pattern of visible 128 x 128 blocks, the diagonal always (no row is empty)."""
  blocks = T // BLOCK
  rng = np.random.default_rng(seed)
  visible = np.eye(blocks, dtype=bool) | (rng.random((blocks, blocks)) < fraction)
  return jnp.asarray(visible)


MASK_MODS = {"documents": documents, "prefix_lm": prefix_lm, "sliding_window": sliding_window,
             "strided": strided}
PATTERNS = (*MASK_MODS, "block_sparse")


# --- Running and checking -------------------------------------------------------------------

def dense_mask(mask_mod) -> jax.Array:
  """bool [B, 1, T, T]: the mask_mod on broadcasting indices (for jax.nn, and to check)."""
  b = jnp.arange(B)[:, None, None, None]
  q_idx = jnp.arange(T)[None, None, :, None]
  kv_idx = jnp.arange(T)[None, None, None, :]
  return jnp.broadcast_to(mask_mod(b, 0, q_idx, kv_idx), (B, 1, T, T))


def run(name: str, q, k, v) -> dict:
  """jaxflash with the pattern ``name`` against jax.nn given its dense mask: the largest
  difference and the fraction of blocks skipped."""
  if name == "block_sparse":
    visible = block_pattern()  # [T / 128, T / 128]
    block_mask = jaxflash.BlockMask.from_blocks(visible, T, T, block_size=BLOCK)
    dense = jnp.repeat(jnp.repeat(visible, BLOCK, 0), BLOCK, 1)[None, None]
  else:
    mask_mod = MASK_MODS[name]()
    # Built once and reused by every call (and layer) with this mask; passing
    # mask_mod=mask_mod instead builds it inside the call.
    block_mask = jaxflash.create_block_mask(mask_mod, B, N, T, T)
    dense = dense_mask(mask_mod)
  out = jax.jit(lambda q, k, v, bm: jaxflash.flash_attention(q, k, v, block_mask=bm))(
      q, k, v, block_mask)
  want = jax.nn.dot_product_attention(q, k, v, mask=dense)
  result = dict(error=float(jnp.max(jnp.abs(out - want))), skipped=float(block_mask.sparsity()),
                visible=float(jnp.mean(dense)))
  if name == "documents":  # training: the gradients too
    def loss(attention):
      return lambda q, k, v: jnp.sum(attention(q, k, v) ** 2)
    ours = jax.jit(jax.grad(loss(lambda q, k, v: jaxflash.flash_attention(
        q, k, v, block_mask=block_mask)), argnums=(0, 1, 2)))(q, k, v)
    theirs = jax.grad(loss(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, mask=dense)), argnums=(0, 1, 2))(q, k, v)
    result["grad_error"] = max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
                               for a, b in zip(ours, theirs))  # relative, worst of dQ, dK, dV
  return result


def main() -> dict:
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (B, T, N, H), jnp.float32)
  k, v = (jax.random.normal(key, (B, T, K, H), jnp.float32) for key in keys[1:])
  print(f"B={B} T=S={T} heads={N}/{K} D={H}, float32, backend "
        f"{jaxflash.implementation_for(q, k, v, mask_mod=strided())}")
  results = {}
  for name in PATTERNS:
    r = results[name] = run(name, q, k, v)
    grads = f", gradients (relative) {r['grad_error']:.1e}" if "grad_error" in r else ""
    print(f"{name:15s} visible entries {r['visible']:6.1%}  blocks skipped {r['skipped']:6.1%}  "
          f"max |jaxflash - jax.nn| {r['error']:.1e}{grads}")
  bad = [name for name, r in results.items()
         if not max(r["error"], r.get("grad_error", 0.0)) < 1e-4]
  if bad:
    raise SystemExit(f"jaxflash differs from jax.nn for {bad}")
  return results


if __name__ == "__main__":
  main()
