#!/bin/bash
# One call on the GPU machine, from the repo root: GPU tests ($TESTS, pytest arguments), then a
# benchmark part ($GRID, bench.py arguments) and the GPT example ($GPT, gpt.py arguments), each
# under its own time limit (TEST_S, GRID_S, GPT_S seconds) so that one call stays under the
# device's 10 minutes. Everything lands in $OUT. For example:
#   TESTS="tests/test_mosaic.py" TEST_S=250 GRID="--impls jaxflash_mosaic cudnn --dtypes fp16 \
#     --head-dims 256 --no-gqa" GRID_S=200 benchmarks/device_call.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/device.txt
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a $OUT/device.txt
if [ -n "$TESTS" ]; then
timeout ${TEST_S:-240} python3 -m pytest -n 8 -v -rf --timeout 150 $TESTS > $OUT/gpu_tests.log 2>&1
tail -12 $OUT/gpu_tests.log
fi
if [ -n "$GRID" ]; then
timeout ${GRID_S:-200} python3 benchmarks/bench.py $GRID --out $OUT/grid.json > $OUT/grid.log 2>&1
tail -70 $OUT/grid.log | grep -v "^\["
fi
if [ -n "$GPT" ]; then
timeout ${GPT_S:-200} python3 examples/gpt.py $GPT > $OUT/gpt.log 2>&1
tail -30 $OUT/gpt.log
fi
