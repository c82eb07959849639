# The two commands of the README: `make demo` and `make test`. Both install what they need (as root on Debian).
VENV   ?= .venv
PYTEST ?= $(VENV)/bin/pytest
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: help deps venv test unit e2e demo demo-down bench soak docs clean

help:
	@echo "make test       install everything (system packages, venv) and run the whole suite, unit and e2e"
	@echo "make demo       bring up the simulated two-Spark testbed and show the reconciler converge it"
	@echo "make demo-down  tear the testbed down"
	@echo "make unit       only the pure-core and loader tests (no root needed)"
	@echo "make bench      run the benchmarks and write docs/benchmarks.md"
	@echo "make soak       the long randomized fault runs (docs/reliability.md)"
	@echo "make docs       regenerate docs/desired-state.md from the models"

deps:
	bash testbed/install-deps.sh

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q -c constraints.txt -e '.[test,bench]'
	touch $@

test: deps venv
	$(PYTEST) tests -q

unit: venv
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

docs: venv
	$(VENV)/bin/reconciler schema --markdown > docs/desired-state.md

clean:
	-$(VENV)/bin/python -m testbed down
	rm -rf $(VENV) .pytest_cache .hypothesis
