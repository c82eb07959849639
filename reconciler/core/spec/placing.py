"""From a file to a `Desired`, or to every problem of the file placed at FILE:LINE:COL with a message to act on.

pydantic reports a problem as a path into the data and a message written for programmers; `loader` knows where
each path is in the text. This module joins the two: it drops pydantic's noise (union branches, its own wording),
finds the cross-field problems inside pydantic's error (`rules.ConsistencyError`), and still reports them when
some field is broken too, so one run shows the operator everything that is wrong.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from reconciler.core import loader
from reconciler.core.loader import Loc
from reconciler.core.spec.models import Desired
from reconciler.core.spec.rules import KEY, ConsistencyError, MissingSecrets


class InvalidDesiredState(Exception):
    """All problems of one file, each placed at FILE:LINE:COL."""

    def __init__(self, filename: str, problems: list[loader.Problem]):
        self.filename = filename
        self.problems = sorted(problems, key=lambda p: (p.position.line, p.position.column))
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        return [p.render(self.filename) for p in self.problems]


def _message(err: ErrorDetails) -> str:
    kind, msg = err["type"], err["msg"]
    if kind == "missing" and tuple(err["loc"]) == ("deployments",):
        return "required field is missing: what the cluster serves (`deployments:`, or `model:` and `serving:` " \
            "for one model)"
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return "unknown field (check the spelling; see `reconciler schema`)"
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    if kind == "string_type":
        return f"must be a string; quote the value ({err.get('input')!r} was read as {type(err.get('input')).__name__})"
    return msg.replace("Input should be", "must be")


#: A union branch's "wrong type" errors, and how the combined message names each type the field takes.
_BRANCH_MISMATCH = {"dict_type": "a mapping", "string_type": "a string", "list_type": "a list",
                    "int_type": "an integer", "none_required": "null"}


def _single_form(doc: loader.Document) -> bool:
    return isinstance(doc.data, dict) and "deployments" not in doc.data


def in_file(doc: loader.Document, loc: Loc) -> Loc:
    """A path into the validated data as the file spells it: in a file of the single form, the one deployment's
    `deployments.0.serving.port` is the file's `serving.port` (models.Desired._single_form)."""
    if _single_form(doc) and loc[:2] == ("deployments", 0) and len(loc) > 2:
        return loc[2:]
    return loc


def _clean_errors(exc: ValidationError, doc: loader.Document) -> list[tuple[Loc, bool, ErrorDetails]]:
    """(path, is-about-the-key, error) per problem, without pydantic's union-branch noise: for `str | dict`
    fields keep the branch that fits the input. A "wrong type" error is noise when another error sits at its path
    or under it (the branch that fits said what is wrong); when every branch says "wrong type" they become one
    error naming the types the field takes. Once a value that fit no branch (`path: 5`) reported nothing at all,
    and a string-branch error above a mapping's own left a path the broken-value walk could not follow."""
    errs = [_located(err, doc) for err in exc.errors(include_url=False)]
    return [(loc, at_key, kept) for i, (loc, at_key, err) in enumerate(errs)
            if (kept := _kept(i, errs)) is not None]


def _located(err: ErrorDetails, doc: loader.Document) -> tuple[Loc, bool, ErrorDetails]:
    """(path as the file spells it, without pydantic's union-branch and validator steps; is-about-the-key; err)."""
    at_key = KEY in err["loc"]
    loc = in_file(doc, tuple(p for p in err["loc"]
                             if not (isinstance(p, str) and ("[" in p or p.startswith("function-")))))
    return loc, at_key, err


def _kept(i: int, errs: list[tuple[Loc, bool, ErrorDetails]]) -> ErrorDetails | None:
    """The error `errs[i]` as reported (one naming every type the field takes, for the first of several "wrong
    type" branches), or None when it is noise."""
    loc, _, err = errs[i]
    if err["type"] not in _BRANCH_MISMATCH:
        return err
    related = [j for j, (other, _, _) in enumerate(errs) if j != i and other[:len(loc)] == loc]
    if not related:
        return err  # a plain wrong type
    if i < min(related) and all(errs[j][2]["type"] in _BRANCH_MISMATCH and len(errs[j][0]) == len(loc)
                                for j in related):  # every branch says "wrong type": the first speaks for all
        return _no_branch_fits(err, [errs[j][2] for j in related])
    return None  # another branch fits the input and says what is wrong at or under this path


def _no_branch_fits(first: ErrorDetails, others: list[ErrorDetails]) -> ErrorDetails:
    kinds = " or ".join(_BRANCH_MISMATCH[e["type"]] for e in (first, *others))
    value = first["input"]
    return ErrorDetails(type="union_type", loc=first["loc"], input=value,
                        msg=f"Input should be {kinds} ({value!r} was read as {type(value).__name__})")


def _place(doc: loader.Document, loc: Loc, at_key: bool) -> loader.Position:
    return doc.key_positions.get(loc, doc.position_of(loc)) if at_key else doc.position_of(loc)


def problems_from_validation(doc: loader.Document, exc: ValidationError) -> list[loader.Problem]:
    out: list[loader.Problem] = []
    for loc, at_key, err in _clean_errors(exc, doc):
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ConsistencyError):
            for sub_loc, message in cause.problems:
                key = sub_loc[-1:] == (KEY,)
                full = in_file(doc, loc + (sub_loc[:-1] if key else sub_loc))
                out.append(loader.Problem(_place(doc, full, key), loader.format_loc(full), message))
            continue
        out.append(loader.Problem(_place(doc, loc, at_key or err["type"] == "extra_forbidden"),
                                  loader.format_loc(loc), _message(err)))
    return out


def _without(data: object, loc: Loc) -> None:
    """Delete the value at `loc` from nested dicts/lists (used to re-check the rest of a broken file); nothing when
    the path is not in the data (a path under a value already dropped)."""
    for part in loc[:-1]:
        children = dict(enumerate(data)) if isinstance(data, list) else data
        if not isinstance(children, dict) or part not in children:
            return
        data = children[part]
    if isinstance(data, dict):
        data.pop(loc[-1], None)
    elif isinstance(data, list) and isinstance(loc[-1], int) and 0 <= loc[-1] < len(data):
        data[loc[-1]] = None


def _consistency_without(doc: loader.Document, broken: list[Loc]) -> list[tuple[Loc, str]]:
    """The cross-field problems of `data` once the broken values are dropped (fields with defaults fall back to
    them); none when the rest is not valid either, as the rules then never ran."""
    data: Any = copy.deepcopy(doc.data)
    for loc in broken:
        _without(data, loc)
    try:
        Desired.model_validate(data)
        return []
    except ValidationError as exc:
        causes = [(e.get("ctx") or {}).get("error") for e in exc.errors(include_url=False)]
        consistency = [c for c in causes if isinstance(c, ConsistencyError)]
        if len(consistency) != len(causes):
            return []
        return [(in_file(doc, loc), message) for cause in consistency for loc, message in cause.problems]


def _cross_field_despite(doc: loader.Document, broken: list[Loc]) -> list[loader.Problem]:
    """Cross-field rules normally run only on valid fields. To still report every error at once, drop the broken
    values and validate again; keep only the cross-field problems that do not touch a dropped value, so a default
    never produces an error the operator did not write. Nothing is caught here: the walk to a dropped value is
    total (`_without`), so an exception is a bug in a rule and surfaces (it once read as "no cross-field problem",
    which hid the rule's problems whenever a union field was broken too)."""
    out = []
    for loc, message in _consistency_without(doc, broken):
        at_key = loc[-1:] == (KEY,)  # placed at the key, as when the file has no other error
        loc = loc[:-1] if at_key else loc
        if any(loc[: len(b) - 1] == b[:-1] or b[: len(loc)] == loc for b in broken):
            continue
        out.append(loader.Problem(_place(doc, loc, at_key), loader.format_loc(loc), message))
    return out


def _unended(doc: loader.Document) -> list[loader.Problem]:
    if doc.ended:
        return []
    last = max([p.line for p in doc.value_positions.values()], default=1)
    return [loader.Problem(loader.Position(last, 1), "", "the file does not end with the line `...` (YAML's "
                           "document end marker, required as the last line: a half-written save must never "
                           "count as a desired state)")]


def parse(doc: loader.Document, filename: str) -> Desired:
    try:
        desired = Desired.model_validate(doc.data)
    except ValidationError as exc:
        problems = problems_from_validation(doc, exc)
        if not any(isinstance((e.get("ctx") or {}).get("error"), ConsistencyError) for e in exc.errors()):
            broken = [loc for loc, _, _ in _clean_errors(exc, doc) if loc]
            problems += _cross_field_despite(doc, broken)
        raise InvalidDesiredState(filename, problems + _unended(doc)) from None
    if unended := _unended(doc):
        raise InvalidDesiredState(filename, unended)
    return desired.with_source(doc.text)


ENVIRONMENT = "the reconciler's environment (systemd: EnvironmentFile=, see docs/security.md)"
_UNUSABLE = ("has a control character (a newline, tab, ...) in its value in the reconciler's environment: the "
             "values reach docker as the lines of --env-file, where a newline would start another variable; "
             "remove it from the value (the value is not shown)")


def _missing_secrets(doc: loader.Document, desired: Desired, exc: MissingSecrets,
                     where: str) -> list[loader.Problem]:
    """Each secret the environment cannot give, placed at its name in serving.secrets; names only, never a
    value. `where`: what was searched (the environment file and the environment, as the CLI reads them)."""
    unset = f"is not set in {where}"
    return [loader.Problem(doc.key_positions.get(at, loader.Position(1, 1)), loader.format_loc(at), f"{name} {why}")
            for names, why in ((exc.names, unset), (exc.unusable, _UNUSABLE)) for name in names
            for at in [_secret_at(doc, desired, name)]]


def _secret_at(doc: loader.Document, desired: Desired, name: str) -> Loc:
    """Where the file declares the secret `name`: the first deployment that lists it."""
    i = next(i for i, d in enumerate(desired.deployments) if name in d.serving.secrets)
    return in_file(doc, ("deployments", i, "serving", "secrets", name))


def load(path: str | Path, environ: Mapping[str, str] | None = None, where: str = ENVIRONMENT) -> Desired:
    """Load and validate a desired-state file; raise InvalidDesiredState with every problem placed. With
    `environ`, also resolve serving.secrets from it (a missing one is a problem placed at its name, saying
    `where` it was looked for)."""
    filename = str(path)
    try:
        doc = loader.load_file(Path(path))
    except loader.LoadError as exc:
        raise InvalidDesiredState(filename, exc.problems) from None
    desired = parse(doc, filename)
    if environ is None:
        return desired
    try:
        return desired.with_secrets(environ)
    except MissingSecrets as exc:
        raise InvalidDesiredState(filename, _missing_secrets(doc, desired, exc, where)) from None


def loads(text: str | bytes, filename: str = "<string>") -> Desired:
    try:
        doc = loader.load_text(text.encode() if isinstance(text, str) else text)
    except loader.LoadError as exc:
        raise InvalidDesiredState(filename, exc.problems) from None
    return parse(doc, filename)
