export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/device.txt
timeout 170 python3 -m pytest -q -x tests/test_decode.py -p no:cacheprovider > $OUT/gpu_tests_decode.log 2>&1; tail -2 $OUT/gpu_tests_decode.log
D="python3 -u benchmarks/decode.py"
$D --impls jaxflash cudnn xla pallas_decode --rounds 5 --profile --out $OUT/main.json > $OUT/run_main.log 2>&1
$D --impls jaxflash --batches 8 --seqs 32768 --head-dims 64 128 --layouts paged --page-size 256 --out $OUT/page256.json > $OUT/run_page256.log 2>&1
grep -E "FAILED|Error" $OUT/run_main.log $OUT/run_page256.log | head
tail -22 $OUT/run_main.log; tail -4 $OUT/run_page256.log
