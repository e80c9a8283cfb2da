# taproom: two commands on a fresh machine, `make run` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP_RUN  := $(VENV)/.installed-run
STAMP_ALL  := $(VENV)/.installed-all
# An editable install builds taproom.zmqburst._burst in place: rebuild when its C changes.
BUILT      := pyproject.toml setup.py src/taproom/zmqburst/burst.c src/taproom/zmqburst/eventbus.c src/taproom/zmqburst/lumberjack.c src/taproom/zmqburst/lager.c \
              src/taproom/zmqburst/_build.py
PEERS      := tests/peers/node_modules/.installed
export PYSPARK_PYTHON := $(abspath $(BIN)/python)

.PHONY: run test lint typecheck unit wheel bench soak peers clean browser screenshots

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# pip byte-compiles what it installs one file at a time, 1,500 test modules of the Spark
# extra's packages too: two fifths of the install's CPU (measured: docs/testing.md). Instead,
# every module but the packages' own tests is compiled on all cores; Python compiles any
# other module the first time it is imported, as before.
COMPILE = $(BIN)/python -m compileall -q -j 0 -x '/tests/' \
            "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
          || echo "some installed modules did not compile: Python compiles them when imported"

$(STAMP_RUN): $(BUILT) | $(BIN)/python
	$(BIN)/pip install --quiet --no-compile -e .
	$(COMPILE)
	touch $@

$(STAMP_ALL): $(BUILT) | $(BIN)/python
	$(BIN)/pip install --quiet --no-compile -e '.[spark,dev]'
	$(COMPILE)
	touch $@ $(STAMP_RUN)

# Real third-party peers the integration tests run (PEERS.md), in a folder the tests own.
$(PEERS): tests/peers/package.json
	@if command -v npm >/dev/null 2>&1; then \
	  npm install --prefix tests/peers --no-audit --no-fund --loglevel=error && touch $@; \
	else echo "npm not found: the node peer tests will say so and fail"; fi

# The console's browser tests drive Debian's chromium (root on the test machines): install it
# when missing. A machine where this fails fails the browser tests with a message, never skips.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "chromium not found: installing Debian's chromium for the console's browser tests"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
	  || echo "could not install chromium: the console's browser tests will fail and say so"; }

# docs/console/*.png: each console page in the browser, with data sent by the protocol clients.
screenshots: $(STAMP_ALL) browser
	$(BIN)/python -m tests.web.screenshots docs/console

run: $(STAMP_RUN)
	$(BIN)/taproom serve $(ARGS)

lint: $(STAMP_ALL)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

typecheck: $(STAMP_ALL)
	$(BIN)/mypy

# The suite on parallel workers (pytest-xdist): most tests wait on sockets, disks and child
# processes, not on a core, so more workers than cores (measured: docs/testing.md). Tests that
# share something costly run on one worker as a group (tests/conftest.py); one test alone,
# serially: `.venv/bin/python -m pytest tests/x.py::test_y`, or `make unit TEST_WORKERS=0`.
TEST_WORKERS ?= $(shell echo $$(( 2 * $$(nproc) )))
# The tree's own modules compiled first: with PYTHONDONTWRITEBYTECODE set (as on the CI
# machines) nothing is cached, and every hub, CLI and Spark worker process a test starts compiled
# taproom from source again (~0.5 CPU-s each; measured: docs/testing.md). A .pyc is checked
# against its source's mtime, so an edited module is compiled again as usual.
#
# Spark's classes archived for the tests' JVMs (class-data sharing, tests/jvm_archive.py): half
# the CPU of a short JVM's start. Written beside the suite's start when missing or older than
# the venv; a JVM about to start waits for it (measured: docs/testing.md).
JVM_ARCHIVE := build/jvm/spark.jsa
unit: $(STAMP_ALL) $(PEERS) browser
	$(BIN)/python -m compileall -q -j 0 -x node_modules src tests bench \
	  || echo "some modules did not compile: Python compiles them when imported"
	@mkdir -p $(dir $(JVM_ARCHIVE)); \
	if [ ! -f $(JVM_ARCHIVE) ] || [ $(STAMP_ALL) -nt $(JVM_ARCHIVE) ]; then \
	  rm -f $(JVM_ARCHIVE); \
	  $(BIN)/python -m tests.jvm_archive $(JVM_ARCHIVE) >$(JVM_ARCHIVE).log 2>&1 & \
	  echo $$! >$(JVM_ARCHIVE).writer; \
	fi; \
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS); \
	unit=$$?; wait; rm -f $(JVM_ARCHIVE).writer; \
	[ -f $(JVM_ARCHIVE) ] || { echo "no class archive for the tests' JVMs (they ran without):"; \
	  tail -5 $(JVM_ARCHIVE).log; }; \
	exit $$unit

# A wheel, built as pip builds one, must carry the compiled ZeroMQ burst module (setup.py).
wheel: $(STAMP_ALL)
	rm -rf build/wheel
	$(BIN)/pip wheel --quiet --no-deps --wheel-dir build/wheel .
	$(BIN)/python -c "import glob, sys, zipfile; \
	  names = zipfile.ZipFile(glob.glob('build/wheel/taproom-*.whl')[0]).namelist(); \
	  sys.exit(not any(n.startswith('taproom/zmqburst/_burst') and n.endswith('.so') for n in names) \
	    and 'the wheel has no compiled taproom/zmqburst/_burst module')"

# `make test`: the install, then the suite with the checks beside it. lint, typecheck and
# wheel (~30 s on a clean clone, mypy without a cache) need nothing the suite makes, so they
# run at a lower CPU priority (nice 10) while it runs, and take the CPU its waits leave idle;
# each one's output is printed after the suite, and a failure of any fails `make test`.
CHECKS     := lint typecheck wheel
CHECKS_DIR := build/checks
test: $(STAMP_ALL) $(PEERS) browser
	@rm -rf $(CHECKS_DIR) && mkdir -p $(CHECKS_DIR)
	@for check in $(CHECKS); do \
	  { nice -n 10 $(MAKE) --no-print-directory $$check >$(CHECKS_DIR)/$$check.log 2>&1; \
	    echo $$? >$(CHECKS_DIR)/$$check.rc; } & \
	done; \
	echo "make $(CHECKS): beside the suite, at nice 10 (output below, after it)"; \
	$(MAKE) --no-print-directory unit; unit=$$?; \
	wait; failed=""; \
	for check in $(CHECKS); do \
	  echo "--- make $$check (ran beside the suite): exit $$(cat $(CHECKS_DIR)/$$check.rc)"; \
	  cat $(CHECKS_DIR)/$$check.log; \
	  [ "$$(cat $(CHECKS_DIR)/$$check.rc)" = 0 ] || failed="$$failed $$check"; \
	done; \
	[ $$unit = 0 ] || failed="$$failed unit"; \
	if [ -n "$$failed" ]; then echo "make test failed:$$failed"; exit 1; fi

bench: $(STAMP_ALL) $(PEERS)
	$(BIN)/python -m bench $(ARGS)

# The whole suite at soak sizes plus the soak-marked tests, on the suite's workers and schedule
# (serially it ran for hours: 2% of the tests in its first 25 minutes).
soak: $(STAMP_ALL) $(PEERS) browser
	TAPROOM_SOAK=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup \
	  --no-loadscope-reorder -m 'soak or not soak' -p no:timeout $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) tests/peers/node_modules var build .pytest_cache .mypy_cache .ruff_cache
