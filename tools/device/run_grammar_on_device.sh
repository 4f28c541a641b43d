#!/bin/bash
# Run on the GPU machine from the repo root (device tool, carrying .carry/slim: tools/device/prepare_serving_carry.sh
# plus, for Python 3.12, xgrammar apache-tvm-ffi pytest iniconfig packaging openai jsonschema_rs distro jiter sniffio
# anyio typing_extensions): structured output on CUDA (the grammar tests, under CUDA graphs and the overlap
# scheduler), then bench_serving with and without --json-schema at concurrency 64.
# Usage: bash tools/device/run_grammar_on_device.sh [SERVER FLAGS...] (default: the embedded model)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/slim/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
python3 -m pytest -q -p no:cacheprovider tests/runtime/test_grammar.py tests/server/test_structured_output.py \
  tests/runtime/test_sampling.py -k "grammar or structured or bitmask or logit_bias or Weather or tool or reasoning \
  or parse or sampled" 2>&1 | tail -15 | tee $OUT/tests.txt
python3 -m plugserve.server "$@" --port 30000 --log-level warning > $OUT/server.log 2>&1 &
server=$!
for i in $(seq 300); do curl -s localhost:30000/health | grep -q ok && break; sleep 1; done
schema='{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"], "additionalProperties": false}'
for run in plain json; do
  extra=(); [ $run = json ] && extra=(--json-schema "$schema")
  python3 benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --backend openai-chat --num-prompts 256 \
    --random-input-len 256 --random-output-len 128 --random-range-ratio 1 --max-concurrency 64 --disable-tqdm \
    "${extra[@]}" --output-file $OUT/bench_$run.jsonl 2>&1 | tee $OUT/bench_$run.txt
done
curl -s localhost:30000/server_info > $OUT/server_info.json
kill $server
