export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout 100 python3 -m pytest -q tests/test_decode.py -k "several or heads" -p no:cacheprovider > $OUT/gpu_tests_heads.log 2>&1; tail -1 $OUT/gpu_tests_heads.log
D="python3 -u benchmarks/decode.py"
H='[{"grid_order":["head","split","batch"]}]'
$D --impls jaxflash cudnn --head-dims 64 256 --rounds 3 --candidates "$H" --out $OUT/dims.json > $OUT/run_dims.log 2>&1
$D --impls jaxflash cudnn --heads 32/32 --head-dims 64 128 256 --layouts contiguous --rounds 3 --candidates "$H" --out $OUT/mha.json > $OUT/run_mha.log 2>&1
$D --impls jaxflash --tokens 4 16 --head-dims 64 128 --out $OUT/tokens.json > $OUT/run_tokens.log 2>&1
for ps in 16 256; do $D --impls jaxflash --batches 8 --seqs 32768 131072 --head-dims 64 --layouts paged --page-size $ps --rounds 3 --candidates '[{"heads":1},{"num_stages":3},{"num_stages":2}]' --out $OUT/pages$ps.json > $OUT/run_pages$ps.log 2>&1; done
cd $OUT && tar czf logs.tgz run_*.log pages*.json && rm run_pages*.log pages*.json
grep -h FAILED run_*.log | head
python3 - <<'PY'
import json, glob
for f in ["dims.json","mha.json"]:
  d=json.load(open(f))
  for r in d["rows"]:
    if r.get("impl")!="xla": print(f[:4], r["B"],r["S"],r["K"],r["D"],r["layout"][:4],r["impl"][:5],"hsb" if r.get("tune") else "",r.get("us"),r.get("us_rounds"),r.get("failed","")[:60])
PY
