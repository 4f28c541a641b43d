# Set-up and checks. Every target creates the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies on local disk on our machines; an unpinned torch would pull a CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install serve backends test lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m compileall -q plugserve  # the bytecode pip writes for a regular install: a first start skips it
	touch $@

install: $(VENV)/.installed

# The OpenAI-compatible server on http://127.0.0.1:30000 (the embedded model unless ARGS names one).
serve: install
	$(VENV)/bin/plugserve serve $(ARGS)

# What is installed, what this machine can run, and what `auto` picks.
backends: install
	$(VENV)/bin/plugserve backends --explain

# The unit tests, then the conformance kit over every registered backend usable here (on the CPU the Triton
# ones skip, saying why), then over the Triton ones interpreted, in fp16/fp32 (the interpreter's bf16
# tl.dot is wrong; bf16 is checked on the GPU). TRITON_INTERPRET is set explicitly each time because
# tests/conftest.py defaults it to 1 and pytest loads that file for --pyargs runs from the repo root too.
# The unit tests run in TEST_WORKERS processes (pytest-xdist), a test file per process at a time (module fixtures
# stay whole); the interpreted kit's cases in TEST_WORKERS processes too.
TEST_WORKERS ?= 2
TRITON_BACKENDS := --plugserve-backend attention:triton --plugserve-backend gemm:triton --plugserve-backend moe:triton
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests
	TRITON_INTERPRET=0 $(PY) -m pytest -q -p no:cacheprovider --pyargs plugserve.conformance
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(TEST_WORKERS) -p no:cacheprovider --pyargs plugserve.conformance \
		$(TRITON_BACKENDS) \
		--plugserve-device cpu --plugserve-dtypes float16,float32

lint: install
	$(VENV)/bin/ruff check plugserve tests benchmarks examples tools training

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
