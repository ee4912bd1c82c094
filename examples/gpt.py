"""Train a small GPT-style causal language model (Flax nnx + optax) with a choice of attention.

The model is a pre-LayerNorm decoder-only transformer: token + learned position embeddings,
``--layers`` blocks of ``nnx.MultiHeadAttention`` (called with ``is_causal=True``, so no dense
T x T mask is ever built by the model) and a GELU MLP, a final LayerNorm and an output head tied
to the token embedding. Parameters are float32; ``--dtype bfloat16`` runs the computation in bf16.
The model and the attention functions are in ``gpt_model.py``, the generated text in
``gpt_data.py``; this file trains, times and reports.

The attention function plugged into every ``nnx.MultiHeadAttention`` is picked with
``--attention``:

- ``jaxflash``: ``jaxflash.nnx.dot_product_attention`` (the Triton kernels on an NVIDIA GPU, the
  blockwise pure-JAX backend elsewhere, e.g. on a CPU);
- ``jaxflash_fp8``: the same hook with ``fp8=True``: the attention forward in FP8
  (`jaxflash.fp8_attention`: the Mosaic FP8 kernel on Hopper, upcast elsewhere), its gradient in
  16 bits; compare its loss curve with ``--attention jaxflash,jaxflash_fp8 --compare``;
- ``jaxflash_fp8_rotated``: the same with ``fp8={"rotation_seed": 0}``: query and key rotated by
  `jaxflash.random_rotation` before they are quantised (FlashAttention-3's incoherent
  processing, the accurate form on outlier features);
- ``flax``:     ``flax.nnx.dot_product_attention``, Flax's default;
- ``xla``:      ``jax.nn.dot_product_attention(..., implementation="xla")``;
- ``cudnn``:    ``jax.nn.dot_product_attention(..., implementation="cudnn")`` (NVIDIA GPU,
  bf16).

``xla`` and ``cudnn`` have no attention dropout, so ``--attn-dropout`` (default 0.0) must stay 0
with them.

Data: no downloads. A synthetic English-like corpus is generated in-process from ``--seed`` by a
small probabilistic grammar (word-level tokens, vocabulary ~290): documents have a topic that
biases which nouns, verbs and adjectives appear, a recurring "hero" noun phrase, subject-verb
number agreement (also across relative clauses) and compound sentences. It is learnable: the loss
falls from ~ln(vocab) quickly, and topic / hero / agreement reward looking back in the context.

Run it from the repository root:

    # CPU: a 4-step smoke run (seconds), then a couple hundred steps (a few minutes)
    PYTHONPATH=. python examples/gpt.py --preset cpu-tiny --attention jaxflash
    PYTHONPATH=. python examples/gpt.py --preset cpu --attention jaxflash

    # CPU: same seed, params and data for both; one PNG with both loss curves
    PYTHONPATH=. python examples/gpt.py --preset cpu --attention jaxflash,flax --compare

    # GPU: long context (seq 8192, 8 layers, dim 1024, 8 heads of 128, batch 2, bf16)
    PYTHONPATH=. python examples/gpt.py --preset gpu-8k --attention jaxflash
    PYTHONPATH=. python examples/gpt.py --preset gpu-8k --attention jaxflash,cudnn,xla --compare

Any explicit flag (``--steps``, ``--batch``, ``--seq``, ``--layers``, ``--heads``, ``--dim``,
``--lr``, ``--dtype``, ...) overrides the preset's value.

Output: the loss every ``--log-every`` steps, then a summary per attention (median step time
excluding the first steps, tokens/s, the device's peak memory where JAX reports it -- n/a on a
CPU -- and the compiled train step's ``memory_analysis().temp_size_in_bytes``). ``--out`` gets
``gpt_<attention>.json`` (config, per-step losses and step times, summary) and
``gpt_<attention>_loss.png`` per run, plus ``gpt_compare.json`` / ``gpt_compare_loss.png`` with
several attentions. PNGs are skipped when matplotlib is not installed.

Note: the device's ``peak_bytes_in_use`` is a process-wide peak. With several attentions in one
process, a later run's peak is only its own when it rose during that run
(``peak_rose_during_run`` in the summary); run one attention per process for clean peaks.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

try:
  import optax
  from flax import nnx
except ModuleNotFoundError as e:  # jaxflash's "flax" extra: Flax and optax
  raise SystemExit(f"examples/gpt.py needs Flax and optax (missing: {e.name}), jaxflash's "
                   "\"flax\" extra: from the repository root, pip install -e \".[flax]\"") from e

from gpt_data import Batches, decode, make_corpus, vocabulary  # noqa: F401 (decode: for users)
from gpt_model import (ATTENTIONS, GPT, Config, attention_fn, count_params,  # noqa: F401
                       cudnn_attention, xla_attention)
from jaxflash import devices

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Size presets. Explicit command-line flags override these values.
PRESETS: dict[str, dict[str, Any]] = {
    # CI smoke test: a few steps of a tiny model, well under a minute on a 2-core CPU.
    "cpu-tiny": dict(steps=4, batch=8, seq=64, layers=2, heads=4, dim=64, lr=3e-3,
                     dtype="float32", log_every=1, warmup=1),
    # A visible learning curve on a CPU in a few minutes.
    "cpu": dict(steps=200, batch=16, seq=128, layers=4, heads=4, dim=128, lr=5e-3,
                dtype="float32", log_every=20, warmup=20),
    # Long context on a GPU: ~100M parameters, 8 heads of dim 128, 16k tokens per step.
    "gpu-8k": dict(steps=300, batch=2, seq=8192, layers=8, heads=8, dim=1024, lr=5e-4,
                   dtype="bfloat16", log_every=25, warmup=50),
}


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class RunResult:
  attention: str
  losses: list[float]
  step_times_s: list[float]
  summary: dict[str, Any]


def make_optimizer(lr: float, steps: int, warmup: int) -> optax.GradientTransformation:
  """AdamW with linear warmup to ``lr`` then cosine decay to lr / 10, clipped gradients."""
  warmup = max(1, min(warmup, steps - 1)) if steps > 1 else 1
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=lr / 10, peak_value=lr, warmup_steps=warmup,
      decay_steps=max(steps, warmup + 1), end_value=lr / 10)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.01))


def _peak_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats()
  return stats.get("peak_bytes_in_use") if stats else None


def train(attention: str, args: argparse.Namespace, corpus: np.ndarray) -> RunResult:
  """Builds the model from ``args.seed``, trains it for ``args.steps`` steps on batches drawn
  from ``corpus`` (same seed -> same params and batches for every attention) and times it."""
  cfg = Config(vocab=args.vocab, seq=args.seq, layers=args.layers, heads=args.heads,
               dim=args.dim, dtype=DTYPES[args.dtype], attn_dropout=args.attn_dropout)
  model = GPT(cfg, attention_fn(attention, args.deterministic),
              rngs=nnx.Rngs(params=args.seed, dropout=args.seed + 1))
  optimizer = nnx.Optimizer(model, make_optimizer(args.lr, args.steps, args.warmup),
                            wrt=nnx.Param)
  n_params = count_params(model)
  graphdef, state = nnx.split((model, optimizer))
  del model, optimizer  # the training state lives in `state` from here on

  def train_step(state: nnx.State, batch: jax.Array) -> tuple[nnx.State, jax.Array]:
    model, optimizer = nnx.merge(graphdef, state)

    def loss_fn(model: GPT) -> jax.Array:
      logits = model(batch[:, :-1], deterministic=False)
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  batches = Batches(corpus, args.batch, args.seq, args.seed)
  first = jax.device_put(batches.next())
  peak_before = _peak_bytes()
  t0 = time.perf_counter()
  compiled = jax.jit(train_step, donate_argnums=0).lower(state, first).compile()
  compile_s = time.perf_counter() - t0
  analysis = compiled.memory_analysis()

  print(f"\n== attention={attention}  params={n_params / 1e6:.2f}M  "
        f"batch={args.batch} seq={args.seq} layers={args.layers} heads={args.heads} "
        f"dim={args.dim} dtype={args.dtype}  (compiled in {compile_s:.1f}s)")
  losses: list[float] = []
  times: list[float] = []
  batch = first
  for step in range(1, args.steps + 1):
    t0 = time.perf_counter()
    state, loss = compiled(state, batch)
    losses.append(float(loss))  # waits for the step
    times.append(time.perf_counter() - t0)
    if not math.isfinite(losses[-1]):
      print(f"step {step}: loss is {losses[-1]}; stopping")
      break
    if step % args.log_every == 0 or step in (1, args.steps):
      print(f"step {step:5d}/{args.steps}  loss {losses[-1]:.4f}  "
            f"step {times[-1] * 1e3:8.1f} ms")
    if step < args.steps:
      batch = jax.device_put(batches.next())  # prepared outside the timed region
  peak = _peak_bytes()
  del state, compiled
  gc.collect()

  skip = min(2, len(times) // 2)  # the first calls include one-off setup (allocations, ...)
  median = statistics.median(times[skip:]) if times else float("nan")
  tail = losses[-min(10, len(losses)):]
  summary = {
      "attention": attention,
      "device": jax.devices()[0].device_kind,
      "platform": jax.devices()[0].platform,
      "params": n_params,
      "steps_run": len(losses),
      "compile_s": compile_s,
      "median_step_s": median,
      "steps_timed": len(times) - skip,
      "tokens_per_s": args.batch * args.seq / median if median > 0 else None,
      "peak_bytes_in_use": peak,
      "peak_rose_during_run": (None if peak is None or peak_before is None
                               else peak > peak_before),
      "temp_size_in_bytes": analysis.temp_size_in_bytes if analysis else None,
      "argument_size_in_bytes": analysis.argument_size_in_bytes if analysis else None,
      "first_loss": losses[0] if losses else None,
      "final_loss": statistics.fmean(tail) if tail else None,  # mean of the last <= 10 steps
  }
  return RunResult(attention, losses, times, summary)


def _mib(n: int | None) -> str:
  return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def print_summary(result: RunResult) -> None:
  s = result.summary
  print(f"-- {s['attention']} on {s['device']}: loss {s['first_loss']:.4f} -> "
        f"{s['final_loss']:.4f} (mean of last steps)")
  print(f"   median step {s['median_step_s'] * 1e3:.1f} ms over {s['steps_timed']} steps "
        f"(first {s['steps_run'] - s['steps_timed']} excluded), "
        f"{s['tokens_per_s']:,.0f} tokens/s, compile {s['compile_s']:.1f} s")
  peak = _mib(s["peak_bytes_in_use"])
  if s["peak_rose_during_run"] is False:
    peak += " (process-wide peak, set by an earlier run)"
  print(f"   peak device memory {peak}, train step temp {_mib(s['temp_size_in_bytes'])}, "
        f"arguments {_mib(s['argument_size_in_bytes'])}")


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------

def _plot(curves: dict[str, list[float]], title: str, path: str) -> bool:
  """Loss curves in one PNG; False (and nothing written) without matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not importable: skipping", path)
    return False
  fig, ax = plt.subplots(figsize=(7, 4.5))
  styles = ("-", "--", ":", "-.")
  for i, (name, losses) in enumerate(curves.items()):
    ax.plot(range(1, len(losses) + 1), losses, styles[i % len(styles)], label=name,
            linewidth=1.5)
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (nats/token)")
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def _write_json(obj: Any, path: str) -> None:
  with open(path, "w") as f:
    json.dump(obj, f, indent=1)


def _describe(args: argparse.Namespace) -> str:
  return (f"{args.layers}L d{args.dim} h{args.heads} seq{args.seq} b{args.batch} {args.dtype}, "
          f"seed {args.seed}")


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """Parses the flags, fills unset ones from the preset and validates the combination."""
  parser = argparse.ArgumentParser(
      description="Train a small GPT (Flax nnx) on a synthetic corpus with a choice of "
                  "attention function.")
  parser.add_argument("--attention", default=None,
                      help=f"one of {', '.join(ATTENTIONS)}, or a comma-separated list "
                           "(run one after another; implies --compare) (default: jaxflash; "
                           "jaxflash,flax with --compare)")
  parser.add_argument("--compare", action="store_true",
                      help="run every attention in --attention with the same seed, params and "
                           "data and plot all loss curves in one PNG (default list with only "
                           "--compare: jaxflash,flax)")
  parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                      help="size preset; explicit flags override it (default: cpu)")
  for name, typ, what in (("steps", int, "training steps"), ("batch", int, "batch size"),
                          ("seq", int, "sequence length"), ("layers", int, "transformer blocks"),
                          ("heads", int, "attention heads"), ("dim", int, "model width"),
                          ("lr", float, "peak learning rate"),
                          ("warmup", int, "learning-rate warmup steps"),
                          ("log-every", int, "print the loss every this many steps")):
    parser.add_argument(f"--{name}", type=typ, default=None, help=f"{what} (preset)")
  parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                      help="compute dtype; parameters stay float32 (preset)")
  parser.add_argument("--attn-dropout", type=float, default=0.0,
                      help="attention dropout rate; only jaxflash and flax support > 0 "
                           "(default: 0.0)")
  parser.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                      help="jaxflash's backward: bitwise repeatable gradients (default), or "
                           "--no-deterministic: a faster backward where one measured faster "
                           "(dQ added with atomics). cuDNN runs its own default (atomic) "
                           "backward either way; XLA_FLAGS="
                           "--xla_gpu_exclude_nondeterministic_ops=true makes it deterministic")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed for the corpus, the parameters and the batches (default: 0)")
  parser.add_argument("--out", default="gpt_out",
                      help="directory for the JSON results and PNG plots (default: gpt_out)")
  args = parser.parse_args(argv)

  preset = PRESETS[args.preset]
  for key, value in preset.items():
    if getattr(args, key) is None:
      setattr(args, key, value)

  if args.attention is None:
    args.attention = "jaxflash,flax" if args.compare else "jaxflash"
  names = [n.strip() for n in args.attention.split(",") if n.strip()]
  for name in names:
    if name not in ATTENTIONS:
      parser.error(f"unknown attention {name!r}; expected one of {', '.join(ATTENTIONS)}")
  if len(set(names)) != len(names):
    parser.error("--attention lists a name twice")
  if args.compare and len(names) < 2:
    parser.error("--compare needs at least two attentions, e.g. --attention jaxflash,flax")
  args.attentions = names
  args.compare = len(names) > 1

  for key in ("steps", "batch", "seq", "layers", "heads", "dim", "log_every"):
    if getattr(args, key) < 1:
      parser.error(f"--{key.replace('_', '-')} must be positive")
  if args.dim % args.heads:
    parser.error(f"--dim {args.dim} is not a multiple of --heads {args.heads}")
  if not 0.0 <= args.attn_dropout < 1.0:
    parser.error("--attn-dropout must be in [0, 1)")
  if args.attn_dropout > 0 and {"xla", "cudnn"} & set(names):
    parser.error("--attn-dropout > 0 is not supported by the xla and cudnn attentions "
                 "(jax.nn.dot_product_attention has no dropout); use jaxflash or flax")
  if "cudnn" in names:
    if not devices.has_nvidia_gpu():
      parser.error("--attention cudnn needs an NVIDIA GPU")
    if args.dtype != "bfloat16":
      parser.error("--attention cudnn needs --dtype bfloat16 (cuDNN attention has no float32)")
  # Pad the vocabulary to a multiple of 64 (unused rows just learn to be unlikely).
  args.vocab = -(-len(vocabulary()) // 64) * 64
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, RunResult]:
  """Runs the example; returns the results by attention name (also written to ``--out``)."""
  args = parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  device = jax.devices()[0]
  print(f"device: {device.device_kind} ({device.platform}); preset {args.preset}; "
        f"attention: {', '.join(args.attentions)}")

  # Enough whole documents that the batches rarely see the same window twice (capped).
  needed = args.steps * args.batch * (args.seq + 1)
  t0 = time.perf_counter()
  corpus = make_corpus(min(max(needed, 50_000, 4 * (args.seq + 1)), 4_000_000), args.seed)
  print(f"corpus: {len(corpus):,} tokens, vocabulary {len(vocabulary())} words (padded to "
        f"{args.vocab}), generated in {time.perf_counter() - t0:.1f}s")
  print("sample:", decode(corpus[:40]), "...")

  config = {k: v for k, v in vars(args).items() if k != "attentions"}
  results: dict[str, RunResult] = {}
  for name in args.attentions:
    result = train(name, args, corpus)
    results[name] = result
    print_summary(result)
    stem = os.path.join(args.out, f"gpt_{name}")
    _write_json({"config": config, "attention": name, "losses": result.losses,
                 "step_times_s": result.step_times_s, "summary": result.summary},
                stem + ".json")
    _plot({name: result.losses}, f"{name}: {_describe(args)}", stem + "_loss.png")

  if args.compare:
    base = args.attentions[0]
    agreement = {}
    for name in args.attentions[1:]:
      a, b = results[base].losses, results[name].losses
      n = min(len(a), len(b))
      agreement[name] = {  # every run has >= 1 loss, so n >= 1
          "first_loss_rel_diff": abs(a[0] - b[0]) / abs(a[0]),
          "max_abs_loss_diff": max(abs(x - y) for x, y in zip(a[:n], b[:n], strict=True)),
          "steps_compared": n,
      }
      print(f"{name} vs {base}: first-step loss rel. diff "
            f"{agreement[name]['first_loss_rel_diff']:.2e}, max |loss diff| over {n} steps "
            f"{agreement[name]['max_abs_loss_diff']:.2e}")
    stem = os.path.join(args.out, "gpt_compare")
    _write_json({"config": config, "baseline": base, "agreement": agreement,
                 "runs": {name: {"losses": r.losses, "step_times_s": r.step_times_s,
                                 "summary": r.summary} for name, r in results.items()}},
                stem + ".json")
    _plot({name: r.losses for name, r in results.items()}, f"{_describe(args)}",
          stem + "_loss.png")
  print(f"results in {args.out}/")
  return results


if __name__ == "__main__":
  main()
