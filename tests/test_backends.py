"""The backend registry: which backend serves a call, the reasons when none can, configs passed
(and checked against the backend they belong to), the tuned tables as data, device detection."""

import jax
import jax.numpy as jnp
import pytest

import jaxflash
from jaxflash import backends
from jaxflash import devices
from jaxflash.attention import attention_with_config
from jaxflash.backends import mosaic, triton, xla
from checks import ON_GPU, SMALL_CONFIGS, random_qkv, rel_err

pytestmark = pytest.mark.skipif(ON_GPU, reason="checks what a CPU-only machine picks")

Q = jax.ShapeDtypeStruct((2, 16, 4, 32), jnp.float32)
KV = jax.ShapeDtypeStruct((2, 16, 2, 32), jnp.float32)


def test_registry_order_and_names():
  assert backends.names() == ("mosaic", "triton", "xla")
  assert [b.name for b in backends.REGISTRY] == list(backends.names())
  assert backends.get("xla") is xla.BACKEND and backends.get("triton") is triton.BACKEND
  assert backends.get("mosaic") is mosaic.BACKEND


def test_none_picks_the_first_backend_that_supports_the_call():
  """On a CPU the Triton backend declines (no NVIDIA GPU), so the XLA backend serves; asking
  for interpret mode makes the Triton backend able to serve, and it comes first."""
  assert jaxflash.implementation_for(Q, KV, KV) == "xla"
  assert jaxflash.implementation_for(Q, KV, KV, interpret=True) == "triton"
  assert jaxflash.implementation_for(Q, KV, KV, implementation=("triton", "xla")) == "xla"
  assert jaxflash.implementation_for(Q, KV, KV, implementation=["xla", "triton"],
                                     interpret=True) == "xla"


def test_a_named_backend_that_cannot_serve_says_why():
  with pytest.raises(backends.UnsupportedCallError, match="triton.*needs an NVIDIA GPU"):
    jaxflash.implementation_for(Q, KV, KV, implementation="triton")
  wide = jax.ShapeDtypeStruct((1, 8, 2, 320), jnp.float32)
  with pytest.raises(ValueError, match="head dims up to 256 only.*320"):
    jaxflash.implementation_for(wide, wide, wide, implementation="triton", interpret=True)
  # A sequence lists the reason of every backend it tried.
  with pytest.raises(backends.UnsupportedCallError, match="needs an NVIDIA GPU"):
    jaxflash.implementation_for(Q, KV, KV, implementation=("triton",))
  # ... and a wide head dim falls back to XLA when the caller allows it.
  assert jaxflash.implementation_for(wide, wide, wide, interpret=True) == "xla"


@pytest.mark.parametrize("bad", ["cuda", (), ("triton", "cuda"), 3, ("xla", None)])
def test_unknown_implementations_are_refused_by_name(bad):
  with pytest.raises(ValueError, match="implementation"):
    jaxflash.implementation_for(Q, KV, KV, implementation=bad)


def test_config_picks_its_backend_and_must_match_the_request():
  q, k, v, _ = random_qkv(0, 1, 20, 20, 2, 2, 16)
  tiny_xla = xla.Config(block_q=8, block_k=8)
  out = attention_with_config(q, k, v, config=tiny_xla, is_causal=True)
  want = jaxflash.flash_attention(q, k, v, is_causal=True, implementation="xla")
  assert rel_err(out, want) < 1e-6
  with pytest.raises(ValueError, match="belongs to none of the requested"):
    attention_with_config(q, k, v, config=tiny_xla, implementation="triton", interpret=True)
  # A triton config with no GPU and no interpret mode: the backend says why it cannot serve.
  with pytest.raises(backends.UnsupportedCallError, match="NVIDIA GPU"):
    attention_with_config(q, k, v, config=SMALL_CONFIGS["triton"])


def test_configs_are_keyword_only_and_frozen():
  with pytest.raises(TypeError):
    triton.Tiles(64, 64, 4, 2)  # positional fields would let callers slice by field order
  tiles = triton.Tiles(block_q=64, block_k=32)
  with pytest.raises(AttributeError):
    tiles.block_q = 16
  assert hash(triton.Config()) == hash(triton.Config())
  from jaxflash.backends.triton.decode import DecodeConfig
  assert DecodeConfig(splits=2, grid_order=["head", "batch", "split"]).grid_order == (
      "head", "batch", "split")  # a JSON list is kept as a (hashable) tuple
  with pytest.raises(ValueError, match="grid_order"):
    DecodeConfig(splits=2, grid_order=("head", "batch"))


@pytest.mark.parametrize("kind", ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100", "cpu"])
def test_tuned_table_is_data_per_device_kind(kind, monkeypatch):
  """Lookups go through the table for the device kind (H200's is the default for other cards),
  and a new table needs no code: adding one changes what default_config returns."""
  bf16 = jnp.bfloat16
  want = triton.config.table_for("NVIDIA H200")
  assert triton.config.table_for(kind) is want
  assert triton.default_config(128, bf16, True, 512, kind).forward.block_q == 64
  assert triton.default_config(128, bf16, True, 4096, kind).forward.block_q == 128
  assert triton.default_config(64, bf16, True, 4096, kind).backward.num_stages == 1
  custom = triton.Config(forward=triton.Tiles(block_q=32, block_k=32))
  monkeypatch.setitem(triton.config.TUNED, "A100", (triton.config.Rule(config=custom),))
  assert triton.default_config(128, bf16, False, 4096, "NVIDIA A100-SXM4-80GB") is custom


def test_device_detection_reads_the_abstract_mesh():
  """Lowering for a GPU on a CPU-only machine: inside an abstract mesh with a GPU device, the
  GPU is what calls are for (and the Triton backend serves)."""
  assert not devices.has_nvidia_gpu()
  from checks import H100
  with jax.sharding.use_abstract_mesh(H100):
    assert devices.current().is_nvidia_gpu
    assert devices.current().kind == "NVIDIA H100 80GB HBM3"
    assert jaxflash.implementation_for(Q, KV, KV) == "triton"
  assert jaxflash.implementation_for(Q, KV, KV) == "xla"


def test_forward_and_backward_are_not_imported_to_choose():
  """Choosing a backend imports no kernel module (Pallas' Triton lowering warns on import in
  newer jax): the registry needs only supports/default_config."""
  import os
  import subprocess
  import sys
  code = ("import sys, jax.numpy as jnp, jax, jaxflash\n"
          "q = jax.ShapeDtypeStruct((1, 8, 2, 16), jnp.float32)\n"
          "print(jaxflash.implementation_for(q, q, q))\n"
          "print(any(m.startswith('jaxflash.backends.triton.forward') for m in sys.modules))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.stdout.split() == ["xla", "False"]


def test_backends_import_no_op():
  """Layering (docs/architecture.md): backends sit below the ops (which call them) and import
  none of them; what both need (the LSE merge) lives below both, in `jaxflash.merge`."""
  import ast
  import pathlib
  upward = []
  for path in sorted((pathlib.Path(jaxflash.__file__).parent / "backends").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
      else:
        continue
      upward += [f"{path.name}: {name}" for name in names
                 if name == "jaxflash.ops" or name.startswith("jaxflash.ops.")]
  assert not upward


def test_few_query_calls_try_split_kv_backends_first(monkeypatch):
  """With ``implementation=None``, a call with at most 16 query rows that a split-KV kernel
  serves tries the backends that have one (Triton) first, even where another backend would
  take training calls (here a Mosaic stand-in that serves everything), with a dense mask too; a
  call with more rows, or with what the split-KV kernel cannot take (a bias), keeps the
  registry's choice."""
  import dataclasses
  everything = dataclasses.replace(mosaic.BACKEND, supports=lambda *a: None, preferred=None)
  monkeypatch.setattr(backends, "REGISTRY", (everything, triton.BACKEND, xla.BACKEND))
  few = jax.ShapeDtypeStruct((2, 16, 4, 32), jnp.float32)
  many = jax.ShapeDtypeStruct((2, 17, 4, 32), jnp.float32)
  kv = jax.ShapeDtypeStruct((2, 300, 2, 32), jnp.float32)
  mask = jnp.ones((1, 1, 16, 300), bool)
  bias = jnp.zeros((1, 1, 16, 300), jnp.float32)
  assert jaxflash.implementation_for(few, kv, kv, interpret=True) == "triton"
  assert jaxflash.implementation_for(few, kv, kv, mask=mask, interpret=True) == "triton"
  assert jaxflash.implementation_for(many, kv, kv, interpret=True) == "mosaic"
  assert jaxflash.implementation_for(few, kv, kv, bias=bias, interpret=True) == "mosaic"
  assert jaxflash.implementation_for(few, kv, kv, implementation="mosaic",
                                     interpret=True) == "mosaic"
