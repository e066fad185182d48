# Two commands do all the set-up themselves: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: demo test lint venv clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	touch $@

# torch is pinned to 2.13.0 only where none is installed (on this kind of machine
# that is the CPU build on disk); a user's own torch is kept.
$(VENV)/.torch: $(VENV)/.created
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	touch $@

$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	$(PIP) install -e ".[test]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/dhp train

lint: venv
	$(VENV)/bin/ruff check dhp tests benchmarks

# The suite mostly waits (Ray actors and gloo ranks starting, one process each; node-death and failure
# detection): with three pytest workers the two cores of the development machine were about half busy, so it
# runs four, each with one torch thread (tests/conftest.py: oversubscribed OpenMP threads spin). `make test TEST_WORKERS=0` runs it in one process. loadgroup: as load, but the tests marked
# xdist_group(name) share one worker (test_cluster.py: one simulated multi-node Ray cluster;
# test_bench_max_tokens.py: one expensive module fixture, built once; tests/conftest.py groups the tests sharing
# a module fixture, and writes the group ids pytest 9 reads, where pytest-xdist 3.8 writes ones it ignores).
# --durations: every run ends with the 25 slowest tests, where the suite's time goes.
TEST_WORKERS ?= 4

test: venv lint
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25 tests

clean:
	rm -rf $(VENV) outputs
