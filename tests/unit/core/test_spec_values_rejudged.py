"""The survivors docs/mutation-survivors.md once called equivalent and are not (re-judged 2026-12-06, issue 34).

Each test is valid input the mutant refuses, or an output it changes; the mutant is named in the test. The page
said "no input the reconciler can be given makes the mutant behave differently": these are such inputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.core import loader, spec
from reconciler.core.spec.values import _RESERVED_SERVE_FLAGS, mount_refusal, system_path
from tests.unit.edits import edited

SAMPLE = (Path(__file__).parents[3] / "desired-state" / "cluster.yaml").read_text()
MODEL_PATH = "  path: /home/spark/.cache/huggingface/hub"


def _model_path(path: str) -> str:
    return spec.loads(edited(SAMPLE, (MODEL_PATH, f"  path: {path}")), "X").model.path_on("spark-1a32")


@pytest.mark.parametrize("path", ["/srv/X", "/home/spark/X", "/data/XmodelsX"])
def test_a_path_whose_last_part_starts_or_ends_with_x_is_deep_enough(path):
    """`_data_path__mutmut_4` (`value.strip("XX/XX")`) strips the X with the slashes: /srv/X becomes `srv`, one
    part, "too shallow"; /home/spark/X becomes a home itself."""
    assert _model_path(path) == path


@pytest.mark.parametrize("path", ["/home/spark/.sshX", "/home/spark/X.ssh", "/srv/models/.gnupgX"])
def test_a_name_that_only_contains_a_key_directorys_name_is_no_key_directory(path):
    """`system_path__mutmut_10` (`path.strip("XX/XX")`) makes /home/spark/.sshX end in `.ssh`: a key directory,
    refused as a model path and as a mount. It is a directory like any other."""
    assert system_path(path) is None and mount_refusal(path) is None
    assert _model_path(path) == path


def test_a_tag_that_does_not_fit_a_scalar_says_what_yaml_expected():
    """`loader._scalar__mutmut_8/13/14` (`getattr(None|exc, "XXproblemXX"...)`) lose PyYAML's own reason: the
    constructors of !!map and !!seq raise a YAMLError with a `problem` for a scalar, which is the message."""
    with pytest.raises(loader.LoadError) as exc:
        loader.load_text(b"x: !!map abc\n...\n")
    assert [p.message for p in exc.value.problems] == ["invalid value: expected a mapping node, but found scalar"]


def test_no_reserved_flag_has_an_underscore_so_both_spellings_are_refused():
    """`_extra_arg` compares `flag.replace("_", "-")` with the reserved flags (the mutant `_extra_arg__mutmut_24`
    was equivalent for this reason, not the one the page gave); vLLM reads `--a_b` as `--a-b`."""
    assert not [flag for flag in _RESERVED_SERVE_FLAGS if "_" in flag]
    base = '  extra_args: ["--load-format", "fastsafetensors"]'
    for arg in ("--tensor_parallel_size=2", "--max_model_len=8", "--max-model-len=8"):
        with pytest.raises(spec.InvalidDesiredState, match="is set by the reconciler"):
            spec.loads(edited(SAMPLE, (base, f"  extra_args: ['{arg}']")), "X")
