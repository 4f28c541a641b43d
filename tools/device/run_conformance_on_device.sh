#!/bin/bash
# Run on the GPU machine from the repo root (device tool, carrying .carry/wheels): installs plugserve
# and the example plugin into /tmp/site, then writes the backend listing and the conformance kit's
# full-shape results to $OUT. Pure-Python dependencies the machine lacks travel in .carry/wheels,
# filled by: pip download --no-deps --only-binary=:all: --python-version 3.12 -d .carry/wheels \
#   pluggy pydantic pydantic-core annotated-types typing-inspection typing-extensions rich markdown-it-py mdurl pygments
set -uo pipefail
site=/tmp/site
python3 -m pip install -q --no-index --no-deps --target $site .carry/wheels/*.whl
python3 -m pip install -q --no-deps --no-build-isolation --target $site . examples/third_party_plugin
export PYTHONPATH=$site
cd /tmp  # import the installed copy, not the checkout
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -m plugserve backends --json --explain > $OUT/backends.json
python3 -m plugserve backends --explain > $OUT/backends.txt
python3 -m pytest -q -p no:cacheprovider --pyargs plugserve.conformance --plugserve-shapes full \
  --plugserve-report $OUT/conformance-full.json 2>&1 | tail -15 | tee $OUT/conformance-full.txt
