#!/bin/bash
# Scratch GPU call (not committed).
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,driver_version --format=csv,noheader; date -u
python -c "import jax; from jaxflash import devices; d = devices.current(); print(jax.__version__, d, d.sm_count)"
timeout 150 python benchmarks/model_features.py --cases mla_192_128 --out $OUT/model_features.json 2>&1 | tail -8
date -u
