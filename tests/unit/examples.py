"""How many examples a property tries: all of them in `make test`, a fifth under mutation testing.

mutmut (`make mutation`) runs every unit test that calls a mutated function against each of ~3,400 mutants of the
core; a surviving mutant runs all of them, so at full counts the run needs hours of both cores. Under mutmut (it
sets MUTANT_UNDER_TEST, also for its stats pass) each property tries a fifth of its examples, at least 20, and
derandomized, so a mutant's verdict is the same on every run. The score is therefore a lower bound: `make test`
gives every property five times the chances to kill the same mutant.
"""

from __future__ import annotations

import os

UNDER_MUTATION = bool(os.environ.get("MUTANT_UNDER_TEST"))


def examples(full: int) -> dict:
    """Hypothesis settings for a property that tries `full` examples in `make test`."""
    if UNDER_MUTATION:
        return {"max_examples": max(20, full // 5), "derandomize": True}
    return {"max_examples": full}
