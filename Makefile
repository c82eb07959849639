# The two commands of the README: `make demo` and `make test`. Both install what they need (as root on Debian).
VENV   ?= .venv
PYTEST ?= $(VENV)/bin/pytest
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: help deps venv lint test unit e2e demo demo-down bench soak mutation docs clean

help:
	@echo "make test       install everything (system packages, venv) and run the whole suite, unit and e2e"
	@echo "make demo       bring up the simulated two-Spark testbed and show the reconciler converge it"
	@echo "make demo-down  tear the testbed down"
	@echo "make lint       ruff, mypy and the import-linter layer contracts (make test runs it first)"
	@echo "make unit       the unit tests, no testbed (installs the same system tools as make test: root)"
	@echo "make e2e        the end-to-end tests on the testbed (root)"
	@echo "make bench      run the benchmarks and write docs/benchmarks.md"
	@echo "make soak       the long randomized fault runs (docs/reliability.md)"
	@echo "make mutation   the mutants of record, then mutmut over the pure core (docs/testing.md; ~1 h on 2 cores)"
	@echo "make docs       regenerate docs/desired-state.md from the models"

deps:
	bash testbed/install-deps.sh
	bash testbed/rsync-builds.sh

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt constraints-dev.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q -c constraints-dev.txt -e '.[test,lint,bench]'
	touch $@

# Zero findings or it fails: style and bug patterns (ruff), types (mypy), the architecture's layers (import-linter).
lint: venv
	$(VENV)/bin/ruff check reconciler testbed bench tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: deps venv lint
	$(PYTEST) tests -q --durations=15

# The unit tests need no testbed, but some run real system tools (promtool, systemd-analyze) that `deps` installs.
unit: deps venv
	$(PYTEST) tests/unit -q

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

# Not part of `make test` (docs/testing.md, "Mutation testing"): the mutants of record, then mutmut over the five
# core modules (~3,500 mutants), then mutmut's import-time survivors re-judged with the mutant on disk.
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
	rm -rf $(VENV) .pytest_cache .hypothesis
