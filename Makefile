# The two commands of the README: `make demo` and `make test`. Both install what they need (as root on Debian).
VENV   ?= .venv
PYTEST ?= $(VENV)/bin/pytest
# The pinned runtime wheels (constraints.txt) and the build backend, for CPython 3.11 and 3.12: the package test
# (tests/unit/repo/test_package.py) builds and installs the wheel from here with --no-index, without the network.
WHEELHOUSE ?= $(VENV)/wheelhouse
# tests/unit/repo/test_package.py and tests/e2e/test_runbook.py read it from the environment
export WHEELHOUSE := $(abspath $(WHEELHOUSE))
# The second interpreter the unit tests run under (`make unit-py312`; pyenv's 3.12 on the CI machines).
PYTHON312 ?= $(or $(lastword $(sort $(wildcard $(HOME)/.pyenv/versions/3.12.*/bin/python3.12))),python3.12)
# Inside .venv: ignored by git and by the tree copies of the tests (tests/named_mutants.py), gone with `make clean`.
VENV312   ?= $(VENV)/py312
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: help deps venv wheelhouse wheel lint test unit unit-py312 e2e demo demo-down bench soak mutation docs clean

help:
	@echo "make test       install everything (system packages, venv) and run the whole suite, unit and e2e"
	@echo "make demo       bring up the simulated two-Spark testbed and show the reconciler converge it"
	@echo "make demo-down  tear the testbed down"
	@echo "make lint       ruff, mypy and the import-linter layer contracts (make test runs it first)"
	@echo "make unit       the unit tests, no testbed (installs the same system tools as make test: root)"
	@echo "make unit-py312 the unit tests again under Python 3.12 (a second venv, .venv/py312; make test runs it)"
	@echo "make wheel      build the wheel an operator installs (dist/; docs/operations.md)"
	@echo "make e2e        the end-to-end tests on the testbed (root)"
	@echo "make bench      run the benchmarks and write docs/benchmarks.md"
	@echo "make soak       the long randomized fault runs (docs/reliability.md)"
	@echo "make mutation   the mutants of record, then mutmut over the core, the steps and the loop's pure parts (docs/testing.md)"
	@echo "make docs       regenerate docs/desired-state.md from the models"

deps:
	bash testbed/install-deps.sh
	bash testbed/rsync-builds.sh

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt constraints-dev.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q -c constraints-dev.txt -e '.[test,lint,bench]'
	touch $@

wheelhouse: $(WHEELHOUSE)/.complete

# `pip download` of the project resolves its dependencies against the pins without building it.
$(WHEELHOUSE)/.complete: $(VENV)/.installed pyproject.toml constraints.txt constraints-dev.txt
	rm -rf $(WHEELHOUSE)
	for py in 3.11 3.12; do \
	  $(VENV)/bin/pip download -q -d $(WHEELHOUSE) --only-binary=:all: --python-version $$py \
	    -c constraints-dev.txt . setuptools || exit 1; \
	done
	touch $@

# The operator's wheel (docs/operations.md): dist/spark_reconciler-VERSION-py3-none-any.whl, its git revision inside.
wheel: venv
	$(VENV)/bin/pip wheel -q --no-deps -w dist .

# Zero findings or it fails: style and bug patterns (ruff), types (mypy --strict, pyproject.toml), the architecture's
# layers (import-linter), and no function in reconciler/ above cyclomatic complexity 15 as radon counts it
# (tests/complexity.py: ruff's C901 does not count boolean operators, and `radon cc` exits 0 whatever it finds).
lint: venv
	$(VENV)/bin/ruff check reconciler testbed bench tests setup.py
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m tests.complexity reconciler

# The end-to-end tests alone on the testbed (they time real processes: nothing else competes for the 2 cores),
# then the unit tests under Python 3.11 and 3.12 side by side (both CPU-bound, one core each; -O keeps each run's
# output whole). Every test runs, as before; together they take ~3 minutes less.
test: deps venv wheelhouse lint $(VENV312)/.installed
	$(PYTEST) tests/e2e -q --durations=15
	$(MAKE) --no-print-directory -j2 -O unit unit-py312

# The unit tests need no testbed, but some run real system tools (promtool, systemd-analyze) that `deps` installs.
unit: deps venv wheelhouse
	$(PYTEST) tests/unit -q

# The same unit tests under Python 3.12 (docs/testing.md, "Python 3.12"): its own venv, the same pins. No skip: a
# machine without python3.12 fails here, saying so (PYTHON312=/path/to/python3.12 names another).
unit-py312: deps wheelhouse $(VENV312)/.installed
	$(VENV312)/bin/pytest tests/unit -q -p no:cacheprovider

$(VENV312)/.installed: pyproject.toml constraints.txt constraints-dev.txt
	@$(PYTHON312) -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' || \
	  { echo "unit-py312: no Python 3.12 at '$(PYTHON312)' (pyenv install 3.12.1, or PYTHON312=...)" >&2; exit 1; }
	$(PYTHON312) -m venv $(VENV312)
	$(VENV312)/bin/pip install -q -c constraints.txt -c constraints-dev.txt -e '.[test]'
	touch $@

e2e: deps venv
	$(PYTEST) tests/e2e -q

demo: deps venv
	$(VENV)/bin/python -m testbed demo

demo-down: venv
	$(VENV)/bin/python -m testbed down

bench: deps venv
	$(VENV)/bin/python -m bench all

soak: deps venv
	$(VENV)/bin/python bench/soak.py --trials 20 --seed 7 --weights-size 256M

# Not part of `make test` (docs/testing.md, "Mutation testing"): the mutants of record, then mutmut over the core,
# the steps, the probe and the loop's pure parts (pyproject.toml [tool.mutmut]), then mutmut's import-time survivors
# re-judged with the mutant on disk.
mutation: deps venv
	$(VENV)/bin/python -m tests.named_mutants
	rm -rf mutants
	PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/mutmut run --max-children 2
	PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/mutmut results
	$(VENV)/bin/python -m tests.mutmut_recheck mutants

docs: venv
	$(VENV)/bin/reconciler schema --markdown > docs/desired-state.md

clean:
	-$(VENV)/bin/python -m testbed down
	rm -rf $(VENV) $(VENV312) .pytest_cache .hypothesis build dist
