# The two commands of the README:  `make demo`  and  `make test`.
.PHONY: install demo test test-slow test-all lint bench bench-ci

install:
	@bash scripts/install.sh

# Installs everything, then starts the local demo service (2 vLLM replicas in 2 zones).
demo: install
	@bash scripts/demo.sh

# The default test run (no real-vLLM end-to-end suites; those are `make test-slow`).
test: install
	.venv/bin/python -m pytest -q -m "not vllm" tests

# The real-vLLM end-to-end suites (slow: each starts vLLM CPU servers).
test-slow: install
	.venv/bin/python -m pytest -q -m vllm tests

lint: install
	.venv/bin/ruff check orchestrator providers policies tests

bench: install
	@for b in tests/benchmarks/bench_*.py; do .venv/bin/python $$b || exit 1; done

# Every benchmark once, in a short mode; fails on a crash or a failure count (not on ratios).
bench-ci: install
	.venv/bin/python scripts/bench_ci.py
