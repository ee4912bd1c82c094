export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout 200 python3 -m pytest -q tests/test_decode.py -p no:cacheprovider > $OUT/gpu_tests_decode.log 2>&1; tail -1 $OUT/gpu_tests_decode.log
D="python3 -u benchmarks/decode.py --impls jaxflash --batches 1 8 --seqs 32768 131072 --head-dims 64 128 --rounds 3"
mkdir -p $OUT/p
$D --layouts contiguous --out $OUT/p/contiguous.json > $OUT/p/contiguous.log 2>&1
for ps in 16 32 64 128 256; do
  extra=""; [ $ps = 16 ] && extra='--candidates [{"block_k":128}]'
  $D --layouts paged --page-size $ps $extra --out $OUT/p/paged$ps.json > $OUT/p/paged$ps.log 2>&1
done
grep -h FAILED $OUT/p/*.log | head
cd $OUT && tar czf pages.tgz p && rm -r p
python3 - <<'PY'
import json, tarfile, io, os
t = tarfile.open(os.environ["OUT"] + "/pages.tgz")
rows = {}
for m in t.getmembers():
  if m.name.endswith(".json"):
    d = json.load(t.extractfile(m))
    for r in d["rows"]:
      key = (r["B"], r["S"], r["D"])
      name = r["layout"][:4] + (str(d["config"]["page_size"]) if r["layout"] == "paged" else "") + ("/bk128" if r.get("tune") else "")
      rows.setdefault(key, {})[name] = r.get("us")
for key in sorted(rows):
  print(key, " ".join(f"{k}={v}" for k, v in sorted(rows[key].items())))
PY
