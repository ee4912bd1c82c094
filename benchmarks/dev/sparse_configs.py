"""Which Mosaic forward config serves packed short documents best (run on a GPU machine).

    PYTHONPATH=. python3 benchmarks/dev/sparse_configs.py [--documents 64 8]

masks.py's ``documents_<n>`` cases (B = 1, S = 16k, 16 heads of 128, ``segment_ids`` and
``is_causal``): the forward and forward+backward with the shipped config and with candidates
that change what a query tile's fixed costs are (a persistent grid, a second Q buffer that loads
the next tile's Q during this one, no intra-warpgroup overlap, 64-key tiles), checked against the
shipped config's output. Prints a table of milliseconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cases import time_calls  # noqa: E402
from masks import document_ids  # noqa: E402

from jaxflash.attention import attention_with_config  # noqa: E402
from jaxflash.backends import mosaic  # noqa: E402


def candidates(default: mosaic.Config, ctas: int) -> dict[str, mosaic.Config]:
  return {
      "shipped": default,
      "persistent": dataclasses.replace(default, persistent_ctas=ctas),
      "persistent_2q": dataclasses.replace(default, persistent_ctas=ctas, q_buffers=2,
                                           intra_wg_overlap=False),
      "persistent_2q_kv64": dataclasses.replace(default, persistent_ctas=ctas, q_buffers=2,
                                                intra_wg_overlap=False, block_kv=64),
      "no_overlap": dataclasses.replace(default, intra_wg_overlap=False),
      "kv64": dataclasses.replace(default, block_kv=64),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--documents", type=int, nargs="+", default=[64, 8])
  args = parser.parse_args()
  s, n, d = 16384, 16, 128
  kind = jax.devices()[0].device_kind
  default = mosaic.default_config(d, jnp.bfloat16, True, s, kind)
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, d_out = (jax.random.normal(key, (1, s, n, d), jnp.bfloat16) for key in keys)
  rows = []
  for documents in args.documents:
    doc = jnp.asarray(document_ids(s, documents, 0))[None]
    want = None
    for name, config in candidates(default, mosaic.config.sm_count(kind)).items():
      if not mosaic.config.fits(config, d):
        rows.append((documents, name, "does not fit", ""))
        continue

      def fwd(q, k, v, config=config):
        return attention_with_config(q, k, v, is_causal=True, segment_ids=doc, config=config,
                                     implementation="mosaic")

      def fwdbwd(q, k, v, fwd=fwd):
        out, vjp = jax.vjp(fwd, q, k, v)
        return vjp(d_out)

      try:
        out = jax.jit(fwd)(q, k, v)
        if want is None:
          want = np.asarray(out, np.float32)
        err = float(np.max(np.abs(np.asarray(out, np.float32) - want)))
        ms_fwd, _ = time_calls(jax.jit(fwd), (q, k, v))
        ms_all, _ = time_calls(jax.jit(fwdbwd), (q, k, v))
        rows.append((documents, name, f"{ms_fwd:.3f} / {ms_all:.3f}", f"{err:.1e}"))
      except Exception as e:  # noqa: BLE001 (a candidate the kernel refuses: say why)
        rows.append((documents, name, f"error: {repr(e)[:120]}", ""))
      print(rows[-1], flush=True)
  print("| documents | config | fwd / fwd+bwd ms | max abs diff vs shipped |")
  print("|---|---|---|---|")
  for row in rows:
    print("| " + " | ".join(str(x) for x in row) + " |")


if __name__ == "__main__":
  main()
