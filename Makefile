# The two commands of the README's quickstart, and a few conveniences.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast lint bench bench-report stack dist clean

demo:  ## set up (core) and run the two-replica demo on the embedded file store
	scripts/bootstrap core
	$(VENV)/bin/kvstore demo

test:  ## set up (everything, incl. redis-server and vLLM CPU), lint, and run the whole test suite
	scripts/bootstrap test
	VENV=$(VENV) scripts/test-all

lint:  ## ruff, the import-layer contracts, and mypy (strict on the library)
	$(VENV)/bin/ruff check kvstore connectors tests benchmarks
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

test-fast:  ## the suite without the real-vLLM tests
	$(PY) -m pytest -m "not vllm"

bench:  ## the benchmarks that need no servers set up by hand
	cd benchmarks && ../$(PY) bench_codec.py

bench-report:  ## PNG plots of the recorded results in benchmarks/results/ (matplotlib)
	$(PY) benchmarks/report.py

stack:  ## the dev stack of docker-compose.yml, natively (no Docker): Redis, an S3 server, vLLM; Ctrl-C stops it
	$(VENV)/bin/kvstore dev-stack --compose-file docker-compose.yml

dist:  ## build the sdist and the wheel into dist/
	$(PY) -m build --outdir dist .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info dist build
