export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
C='[{"eviction":"evict_first"},{"eviction":"evict_last"}]'
D="python3 -u benchmarks/decode.py --impls jaxflash cudnn --layouts contiguous --rounds 5 --candidates $C"
$D --batches 1 8 --seqs 131072 --head-dims 64 --out $OUT/gqa64.json > /dev/null 2>&1
$D --batches 1 8 --seqs 32768 131072 --head-dims 64 --heads 32/32 --out $OUT/mha64.json > /dev/null 2>&1
$D --batches 1 64 --seqs 4096 32768 --head-dims 128 --heads 32/32 --out $OUT/mha128.json > /dev/null 2>&1
$D --batches 8 64 --seqs 32768 131072 --head-dims 128 --out $OUT/gqa128.json > /dev/null 2>&1
python3 - <<'PY'
import json, os, glob
for f in sorted(glob.glob(os.environ["OUT"]+"/*.json")):
  d=json.load(open(f))
  for r in d["rows"]:
    t = (r.get("tune") or {}).get("eviction", "")
    print(os.path.basename(f)[:6], r["B"],r["S"],r["K"],r["D"],r["impl"][:5],t,r.get("us"),r.get("us_rounds"), r.get("failed","")[:80])
PY
