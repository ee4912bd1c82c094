#!/bin/bash
# One call on the GPU machine, from the repo root: ptxas's view of the Mosaic kernels ($PROBE,
# ptxas_probe.py config names or "all"; $PTX: those whose PTX to keep), GPU tests ($TESTS,
# pytest arguments), a tuner pass ($TUNE, bench.py --tune arguments), a benchmark part ($GRID,
# bench.py arguments) and the GPT example ($GPT, gpt.py arguments), each under its own time
# limit (PROBE_S, TEST_S, TUNE_S, GRID_S, GPT_S seconds; TEST_TIMEOUT per test, 150 by default
# and 400 for tests/test_gpu.py under 8 workers; TEST_WORKERS pytest workers, 8) so that one
# call stays under the device's 10 minutes. Everything lands in $OUT. For example:
#   TESTS="tests/test_mosaic.py" TEST_S=250 GRID="--impls jaxflash_mosaic cudnn --dtypes fp16 \
#     --head-dims 256 --no-gqa" GRID_S=200 benchmarks/dev/device_call.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/device.txt
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a $OUT/device.txt
if [ -n "$PROBE" ]; then
[ "$PROBE" = all ] && PROBE_ARGS="" || PROBE_ARGS="--configs $PROBE"
timeout ${PROBE_S:-150} python3 benchmarks/dev/ptxas_probe.py --out $OUT --ptx $PTX $PROBE_ARGS \
  > $OUT/ptxas.log 2>&1
sed -n '/== ptxas summary ==/,$p' $OUT/ptxas.log | grep . || tail -40 $OUT/ptxas.log
fi
if [ -n "$TESTS" ]; then
timeout ${TEST_S:-240} python3 -m pytest -n ${TEST_WORKERS:-8} -v -rf --timeout ${TEST_TIMEOUT:-150} $TESTS > $OUT/gpu_tests.log 2>&1
tail -12 $OUT/gpu_tests.log
fi
if [ -n "$TUNE" ]; then
timeout ${TUNE_S:-300} python3 benchmarks/bench.py --tune $TUNE --out $OUT/tune.json \
  > $OUT/tune.log 2>&1
grep -E "cuDNN|^best|fail" $OUT/tune.log | sed 's/^tune //' | cut -c1-200
fi
if [ -n "$GRID" ]; then
timeout ${GRID_S:-200} python3 benchmarks/bench.py $GRID --out $OUT/grid.json > $OUT/grid.log 2>&1
tail -70 $OUT/grid.log | grep -v "^\["
fi
if [ -n "$GPT" ]; then
timeout ${GPT_S:-200} python3 examples/gpt.py $GPT > $OUT/gpt.log 2>&1
tail -30 $OUT/gpt.log
fi
