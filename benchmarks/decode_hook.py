"""A decoding step through the Flax hook, next to `jaxflash.decode_attention` on the same cache.

    PYTHONPATH=. python benchmarks/decode_hook.py [--out FILE] [--smoke]

A Flax model that uses ``jaxflash.linen.dot_product_attention`` as its ``attention_fn`` decodes
with Flax's cache mask, a dense [B, 1, 1, S] boolean mask per step (``arange(S) <= cache
index``). This times that call (``impl: "hook"``), `jaxflash.flash_attention` given the same
visible keys as a ``mask_mod`` (``"mask_mod"``: its block mask is built in the call, every
step), `jaxflash.decode_attention` with the
equivalent ``kv_lengths`` (``"decode_attention"``) and cuDNN given the same mask (``"cudnn"``,
on a GPU), bf16, T = 1, in one process: random normal inputs, checked against each other, two
warm-up calls, the median of 7 repeats of 50 back-to-back calls. The cache is filled to 100
tokens short of full, or to half of it (``*_half``: the split-KV kernel shares out the filled
blocks only); ``*_window`` cases mask all but the last ``window`` filled tokens (a sliding
window given as a mask, next to ``decode_attention``'s ``local_window_size``). Writes
``benchmarks/results/<device>/decode_hook.json``: rows ``{case, B, S, N, K, D, filled, window,
impl, us, rel_to_decode_attention, max_abs_diff}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402  (device names and results folders, as the other benchmarks)
from cases import time_calls  # noqa: E402

import jaxflash  # noqa: E402
from jaxflash import linen as jaxflash_linen  # noqa: E402

CASES = {  # name: (B, S, N, K, D, tokens in the cache, window or None)
    "gqa_32k": (8, 32768, 32, 8, 128, 32768 - 99, None),
    "mha_8k": (8, 8192, 32, 32, 128, 8192 - 99, None),
    "gqa_32k_half": (8, 32768, 32, 8, 128, 16384, None),
    "gqa_32k_window": (8, 32768, 32, 8, 128, 32768 - 99, 4096),
}
SMOKE = {"smoke": (2, 256, 4, 2, 32, 157, None), "smoke_window": (2, 256, 4, 2, 32, 200, 64)}



def run_case(name, b, s, n, k, d, filled, window, on_gpu: bool) -> list[dict]:
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (b, 1, n, d), jnp.bfloat16)
  k_cache, v_cache = (jax.random.normal(key, (b, s, k, d), jnp.bfloat16) for key in keys[1:])
  index = filled - 1  # the new token's position: the cache holds index + 1 tokens
  positions = jnp.arange(s)[None, None, None, :]
  visible = positions <= index
  if window is not None:  # the token and the window - 1 before it
    visible = visible & (positions > index - window)
  mask = jnp.broadcast_to(visible, (b, 1, 1, s))
  lengths = jnp.full((b,), filled, jnp.int32)
  band = None if window is None else (window - 1, 0)
  def mask_mod(b, h, q_idx, kv_idx):  # the same visible keys, as a function of positions
    seen = kv_idx <= index
    return seen if window is None else seen & (kv_idx > index - window)

  calls = {
      "hook": jax.jit(lambda q, kc, vc, m: jaxflash_linen.dot_product_attention(
          q, kc, vc, mask=m, deterministic=True)),
      "mask_mod": jax.jit(lambda q, kc, vc, m: jaxflash.flash_attention(
          q, kc, vc, mask_mod=mask_mod)),
      "decode_attention": jax.jit(lambda q, kc, vc, m: jaxflash.decode_attention(
          q, kc, vc, lengths, local_window_size=band)),
  }
  if on_gpu:
    calls["cudnn"] = jax.jit(lambda q, kc, vc, m: jax.nn.dot_product_attention(
        q, kc, vc, mask=m, implementation="cudnn"))
  outs = {impl: fn(q, k_cache, v_cache, mask) for impl, fn in calls.items()}
  rows = []
  for impl, fn in calls.items():
    us = time_calls(fn, (q, k_cache, v_cache, mask), calls=50, repeats=7)[0] * 1e3
    diff = float(jnp.max(jnp.abs(outs[impl].astype(jnp.float32)
                                 - outs["decode_attention"].astype(jnp.float32))))
    rows.append(dict(case=name, B=b, S=s, N=n, K=k, D=d, filled=filled, window=window,
                     impl=impl, us=us, max_abs_diff=diff))
  base = next(r["us"] for r in rows if r["impl"] == "decode_attention")
  for r in rows:
    r["rel_to_decode_attention"] = base / r["us"]  # speed relative to decode_attention
  return rows


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", help="results JSON (default results/<device>/decode_hook.json)")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, seconds)")
  args = parser.parse_args(argv)
  device = jax.devices()[0]
  on_gpu = device.platform == "gpu"
  rows = []
  for name, shape in (SMOKE if args.smoke else CASES).items():
    rows += run_case(name, *shape, on_gpu)
  env = report.environment()
  result = dict(environment=env, rows=rows)
  out = Path(args.out) if args.out else report.default_out(env, "decode_hook")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1))
  print("| case | impl | µs | speed vs decode_attention | max |diff| |")
  print("|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['case']} | {r['impl']} | {r['us']:.1f} | {r['rel_to_decode_attention']:.3f} | "
          f"{r['max_abs_diff']:.2e} |")
  print(f"wrote {out}")
  return result


if __name__ == "__main__":
  main()
