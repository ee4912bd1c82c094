"""Ops: what jaxflash computes, built on any backend of `jaxflash.backends`.

- `flash`: attention as one differentiable call (the training op; what the public API runs).
- `partial`: partial results over key ranges, their exact merge through the LSE, and attention
  over keys split into ranges (forward partials merged, backward with the global LSE and delta):
  the machinery split-KV decoding and ring attention build on.
- `decode`: new tokens against a KV cache (contiguous or paged), as a training call with the
  causal band shifted to the cache positions, with a backend's split-KV forward where it has one.
"""
