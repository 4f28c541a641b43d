#!/bin/bash
# Run on the GPU machine from the repo root (device tool, carrying .carry/wheels): plugserve's serving
# path with the torch reference backends (the baseline the kernel backends are measured against).
# .carry/wheels: pip download --only-binary=:all: --python-version 3.12 pluggy pydantic rich fastapi uvicorn
#   prometheus_client tqdm safetensors transformers==5.23.0 httpx setuptools (numpy removed: the machine has it)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
python3 benchmarks/bench_one_batch.py --model-preset deepseek-v3 --num-layers 4 --load-format dummy \
  --batch-size 1 8 32 --input-len 256 --output-len 16 --result-filename $OUT/bench_one_batch.jsonl \
  --run-name "deepseek-v3 4 layers dummy, reference backends" 2>&1 | grep -v INFO | tee $OUT/bench_one_batch.txt
python3 -m plugserve.server --model-preset deepseek-v2-lite --num-layers 4 --load-format dummy --port 30000 \
  --log-level warning > $OUT/server.log 2>&1 &
server=$!
for i in $(seq 120); do curl -s localhost:30000/health >/dev/null && break; sleep 1; done
python3 benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --num-prompts 64 --random-input-len 256 \
  --random-output-len 32 --random-range-ratio 1 --max-concurrency 16 --output-file $OUT/bench_serving.jsonl \
  --disable-tqdm 2>&1 | tee $OUT/bench_serving.txt
curl -s localhost:30000/server_info > $OUT/server_info.json
kill $server
