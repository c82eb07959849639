"""structlog set-up: JSON lines under systemd/journald or when piped, a readable console renderer in a terminal.

Secrets never reach a log line, a traceback or /status. `redact` (structures) and `redact_text` (one string) replace,
by `***`:

- every occurrence of a value given to `register_secret` (the daemon registers the values of the secrets it reads
  from its environment), wherever it stands;
- a Hugging Face token literal (`hf_` and 30 or more letters and digits);
- the value of anything *named* like a secret: a dict key (at any depth), and in text `NAME=value`, `NAME: value`,
  `"NAME": "value"`, `'name': 'value'`, `--flag=value`, `--flag value`; `Authorization: <scheme> value` and
  `Bearer value`; the password of `scheme://user:password@host`.

A name is a secret's when one of its words (split at `_ - .`, other punctuation and camelCase, case-insensitive)
ends in token, secret, password, passwd, passphrase, credential(s) or apikey, is authorization or cookie, or when
two of them read api key, private key or access key: HF_TOKEN, --hf-token, VLLM_API_KEY, apiKey, X-Auth-Token.
Plurals and longer words are not: max_tokens, --max-num-batched-tokens, tokenizer, "tokens per second" are left as
they are. A value separated from its name by whitespace is kept when it is a plain English word of the short list
`_PROSE` (`--api-key is set by the reconciler` stays readable: no real secret is "is" or "flag"), or itself a
secret's name (`serving.secrets.VLLM_API_KEY: VLLM_API_KEY is not set`).

The log processor runs last before the renderer, after format_exc_info, so the rendered traceback text is redacted
too, and it renders itself any exc_info still pending (the console renderer would otherwise format it with locals).
`configure` also redacts the other writers of tracebacks: the standard library's logging (paramiko, fabric) and
the interpreter's printers of uncaught exceptions, in the main thread or any other. In an argv list, the item after
a secret's flag (`["--api-key", "abc"]`) is redacted too.

Under systemd, stderr is the journal, which took every line at priority info (`journalctl -p warning` showed
nothing). When stderr is the journal's stream (`stderr_is_journal`: `$JOURNAL_STREAM` names its device and inode,
systemd.exec(5)), every line starts with the syslog priority of its level, `<4>` for a warning (sd-daemon(3)'s
SD_WARNING), which journald reads and strips (SyslogLevelPrefix=, on by default); anywhere else (a terminal, a
pipe, a file) the lines stay as they are.
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, MutableMapping
from types import TracebackType
from typing import Any

import structlog

MASK = "***"

#: Shorter registered values are ignored: a value of a few characters ("admin", "1", "spark") is also an ordinary
#: word, a node name or a number, and replacing every occurrence of it would garble every line (and, by the holes
#: it leaves, tell where the value is). Such a value is still redacted wherever it stands by its name (KEY=value,
#: --flag value, "key": "value", a dict key) — only the anywhere-in-any-text match needs the length.
MIN_SECRET_LENGTH = 8

#: The levels `configure` takes (`--log-level`), least severe first.
LEVELS = ("debug", "info", "warning", "error")
#: syslog(3) priority per level: what journald reads from a line's `<N>` prefix (sd-daemon(3): SD_ERR "<3>",
#: SD_WARNING "<4>", SD_INFO "<6>", SD_DEBUG "<7>"). structlog's `exception` is `error` by then (add_log_level).
PRIORITIES = {"critical": 2, "error": 3, "warning": 4, "info": 6, "debug": 7}

_lock = threading.Lock()
_secrets: tuple[str, ...] = ()  # registered values, longest first
_journal = False  # stderr is the journal's stream (configure): each line gets its priority prefix


def register_secret(value: str) -> bool:
    """Redact every occurrence of `value` from now on. Surrounding whitespace is dropped (a value read from a file
    keeps its newline); what is left must be at least MIN_SECRET_LENGTH characters or it is ignored. True when
    registered."""
    global _secrets
    if not isinstance(value, str):
        return False
    value = value.strip()
    if len(value) < MIN_SECRET_LENGTH:
        return False
    with _lock:
        if value not in _secrets:
            _secrets = tuple(sorted({*_secrets, value}, key=len, reverse=True))
    return True


# -- names ---------------------------------------------------------------------------------------------------------

_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
_SECRET_SUFFIXES = ("token", "secret", "secrets", "password", "passwd", "passphrase", "credential", "credentials",
                    "apikey")
_SECRET_WORDS = {"authorization", "cookie"}
_SECRET_PAIRS = {("api", "key"), ("private", "key"), ("access", "key")}


def is_secret_name(name: str) -> bool:
    """HF_TOKEN, --api-key, apiKey, X-Auth-Token, client_secret: yes. max_tokens, tokenizer, node: no."""
    words = [w.lower() for w in _WORDS.findall(name)]
    if any(w.endswith(_SECRET_SUFFIXES) or w in _SECRET_WORDS for w in words):
        return True
    return any(pair in _SECRET_PAIRS for pair in zip(words, words[1:]))


# -- text ----------------------------------------------------------------------------------------------------------

# A name and its separator; the value is matched after it only when the name is a secret's, so passing over any
# other name costs its own length, not the rest of the text (a long `a=a=a=...` or query string stays linear).
# NAME=value, NAME: value, "NAME": "value", 'name': 'value', --flag=value (the key may be quoted, JSON or repr),
# and the scheme of `Authorization: Bearer value`.
_ASSIGN = re.compile(r"(?<![\w.-])(?P<q>\\?[\"']|)(?P<name>-{0,2}[A-Za-z][\w.-]*)(?P=q)\s*[:=]\s*"
                     r"(?:(?:bearer|basic|digest|token)\s+)?", re.I)
# --flag value
_FLAG = re.compile(r"(?<![\w.-])(?P<name>--?[A-Za-z][\w.-]*)\s+")
# A value: quoted ("...", '...', \"...\" inside an escaped JSON string; up to 4096 characters, so a stray quote
# does not send every secret's name scanning to the end of the text), else up to whitespace or a quote; a quote
# left open: up to whitespace. After a flag and a space, not starting with `-`: that is the next flag (an argument
# parser would not take it for the value).
_QUOTED = (r"""\\"(?:[^"\\]|\\[^"]){0,4096}\\"|\\'(?:[^'\\]|\\[^']){0,4096}\\'|"""
           r""""(?:[^"\\]|\\.){0,4096}"|'(?:[^'\\]|\\.){0,4096}'""")
_BARE = r"""(?:[^\s'"\\]|\\(?!["']))"""
_VALUE = re.compile(rf"""{_QUOTED}|{_BARE}+|\\?["']\S*""")
_FLAG_VALUE = re.compile(rf"""(?!-)(?:{_QUOTED}|{_BARE}+|\\?["']\S*)""")
_BEARER = re.compile(rf"(?<![\w-])(?P<scheme>bearer\s+)(?P<value>{_BARE}+)", re.I)
_HF_TOKEN = re.compile(r"hf_[A-Za-z0-9]{30,}", re.I)
_URL_PASSWORD = re.compile(r"(?P<head>(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@'\"]+:)[^/\s@'\"]+@")
# Words that follow a flag or a name in prose, never a secret: kept when separated by whitespace.
_PROSE = {"a", "an", "and", "are", "as", "at", "be", "by", "cannot", "for", "from", "given", "has", "have", "if",
          "in", "instead", "is", "missing", "must", "not", "of", "on", "or", "required", "set", "should", "the",
          "to", "unset", "was", "were", "with", "flag", "option", "value", "none", "null", "true", "false"}


def _masked(value: str) -> str:
    """`***`, inside the value's own quotes if it had some."""
    quote = re.match(r"""\\?["']""", value)
    if quote is None:
        return MASK
    q = quote.group(0)
    return q + MASK + q if len(value) >= 2 * len(q) and value.endswith(q) else q + MASK


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _not_a_value(word: str) -> bool:
    """After whitespace: a prose word (`--api-key is set by ...`), or a secret's name, not its value
    (`serving.secrets.VLLM_API_KEY: VLLM_API_KEY is not set`)."""
    return word.lower() in _PROSE or (_IDENTIFIER.fullmatch(word) is not None and is_secret_name(word))


def _named(head: re.Pattern[str], values: re.Pattern[str], text: str) -> str:
    """The value after each match of `head` whose name is a secret's, masked (unless `_not_a_value`). After any
    other name the search goes on right behind it (`env=HF_TOKEN=abc`)."""
    out, pos = [], 0
    while (m := head.search(text, pos)) is not None:
        out.append(text[pos:m.end()])
        pos = m.end()
        value = values.match(text, pos) if is_secret_name(m.group("name")) else None
        if value is not None and not (text[pos - 1].isspace() and _not_a_value(value.group(0))):
            out.append(_masked(value.group(0)))
            pos = value.end()
    out.append(text[pos:])
    return "".join(out)


def _bearer(m: re.Match[str]) -> str:
    return m.group(0) if m.group("value").lower() in _PROSE else m.group("scheme") + MASK


def _patterns(text: str) -> str:
    text = _HF_TOKEN.sub(MASK, text)
    text = _URL_PASSWORD.sub(lambda m: m.group("head") + MASK + "@", text)
    text = _named(_ASSIGN, _VALUE, text)
    text = _named(_FLAG, _FLAG_VALUE, text)
    return _BEARER.sub(_bearer, text)


def _registered(text: str, secrets: tuple[str, ...]) -> str:
    """Every occurrence of every registered value (overlapping ones merged), until none is left: removing one can
    join its neighbours into another."""
    while True:
        spans: list[tuple[int, int]] = []
        for secret in secrets:
            i = text.find(secret)
            while i >= 0:
                spans.append((i, i + len(secret)))
                i = text.find(secret, i + 1)
        if not spans:
            return text
        spans.sort()
        out, pos, end = [], 0, -1
        for start, stop in spans:
            if start > end:
                if end >= 0:
                    out.append(MASK)
                out.append(text[pos:start])
            end = max(end, stop)
            pos = end
        out.append(MASK)
        out.append(text[pos:])
        text = "".join(out)


def redact_text(text: str) -> str:
    """`text` without the secrets it holds (module docstring: the forms)."""
    secrets = _secrets
    text = _registered(text, secrets)
    text = _patterns(text)
    return _registered(text, secrets)


# -- structures ----------------------------------------------------------------------------------------------------

def _redact(obj: Any, stringify: bool) -> Any:
    if isinstance(obj, str):
        return redact_text(obj)
    if isinstance(obj, Mapping):
        return _redact_mapping(obj, stringify)
    if isinstance(obj, list):
        return _argv(obj, stringify)
    if isinstance(obj, tuple):
        return tuple(_argv(obj, stringify))
    if isinstance(obj, (set, frozenset)):
        return type(obj)(_redact(v, stringify) for v in obj)
    if obj is None or isinstance(obj, (bool, int, float)) or not stringify:
        return obj
    # What a renderer would print of any other object (an exception's repr holds its message): redacted first.
    return redact_text(repr(obj))


def _redact_mapping(obj: Mapping[Any, Any], stringify: bool) -> dict[Any, Any]:
    """The keys redacted as text, the whole value of a key named like a secret masked (None and booleans kept:
    they only say whether there is one), every other value redacted."""
    out: dict[Any, Any] = {}
    for key, value in obj.items():
        secret = isinstance(key, str) and is_secret_name(key)
        name = redact_text(key) if isinstance(key, str) else key
        out[name] = MASK if secret and value is not None and not isinstance(value, bool) \
            else _redact(value, stringify)
    return out


_LONE_FLAG = re.compile(r"-{1,2}[A-Za-z][\w.-]*")


def _argv(items: list[Any] | tuple[Any, ...], stringify: bool) -> list[Any]:
    """The items redacted; in an argv, the item after a secret's flag (`["--api-key", "abc"]`) is its value."""
    out: list[Any] = []
    for i, item in enumerate(items):
        prev = items[i - 1] if i else None
        if isinstance(item, str) and isinstance(prev, str) and _LONE_FLAG.fullmatch(prev) and \
                is_secret_name(prev) and not item.startswith("-"):
            out.append(MASK)
        else:
            out.append(_redact(item, stringify))
    return out


def redact(obj: Any) -> Any:
    """A copy of `obj` (dicts, lists, tuples, sets, strings, at any depth) without secrets: strings through
    `redact_text`, the whole value of a key named like a secret replaced by `***` (None and booleans kept: they
    only say whether there is one), and in a list or tuple the item after a secret's flag (`["--api-key", "abc"]`).
    Other objects are returned as they are."""
    return _redact(obj, stringify=False)


def _redact_event(logger: Any, name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """The last processor before the renderer: a pending exc_info is rendered here (so no renderer formats a
    traceback of its own), then everything, the rendered `exception` included, is redacted."""
    if "exc_info" in event:
        event = structlog.processors.format_exc_info(logger, name, event)
    redacted: MutableMapping[str, Any] = _redact(event, stringify=True)
    return redacted


# -- the other writers of tracebacks -------------------------------------------------------------------------------

class _RedactedRecords:
    """The standard library's log records (paramiko, fabric) redacted as they are made, whatever handler or
    formatter writes them later: the message formatted and redacted, the traceback rendered and redacted into
    exc_text (exc_info dropped, so no formatter can render the original), the stack too."""

    def __init__(self, inner: Callable[..., logging.LogRecord]) -> None:
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = self.inner(*args, **kwargs)
        try:
            message = record.getMessage()
        except (TypeError, ValueError, KeyError):  # the % arguments do not fit: say so, without them in clear
            message = f"unformattable log message {record.msg!r} % {record.args!r}"
        record.msg, record.args = redact_text(message), ()
        if record.exc_info:
            record.exc_text = redact_text(_PLAIN.formatException(record.exc_info))
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return record


_PLAIN = logging.Formatter()


def _write_uncaught(header: str, exc_type: type[BaseException], exc: BaseException | None,
                    tb: TracebackType | None) -> None:
    stream = sys.stderr
    if stream is not None:
        text = redact_text(header + "".join(traceback.format_exception(exc_type, exc, tb)))
        stream.write(prefixed(text, "error") + "\n" if _journal else text)
        stream.flush()


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    _write_uncaught("", exc_type, exc, tb)


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else threading.get_ident()
    _write_uncaught(f"Exception in thread {name}:\n", args.exc_type, args.exc_value, args.exc_traceback)


def _redact_other_writers() -> None:
    """The standard library's logging, and the interpreter's printers of uncaught exceptions (main thread, other
    threads) when they are still the defaults: a hook someone installed on purpose (a debugger, pytest) is kept."""
    factory = logging.getLogRecordFactory()
    if not isinstance(factory, _RedactedRecords):
        logging.setLogRecordFactory(_RedactedRecords(factory))
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _excepthook
    if threading.excepthook is threading.__excepthook__:
        threading.excepthook = _thread_excepthook


# -- journald ------------------------------------------------------------------------------------------------------

def stderr_is_journal(environ: Mapping[str, str] | None = None, stream: Any = None) -> bool:
    """Whether stderr is connected to the journal: systemd sets `$JOURNAL_STREAM` to the device and inode numbers
    ("DEV:INODE", decimal) of the stream it connects stdout/stderr to, and a program compares them with its own
    stderr's `fstat` (systemd.exec(5), "Environment variables in spawned processes"; what sd-journal does), so a
    variable inherited by a child whose stderr was redirected says nothing."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not (sep and dev.isdigit() and ino.isdigit()):
        return False
    try:
        seen = os.fstat((sys.stderr if stream is None else stream).fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # closed, or no descriptor (pytest)
        return False
    return (seen.st_dev, seen.st_ino) == (int(dev), int(ino))


def prefixed(text: str, level: str) -> str:
    """Every line of `text` with the syslog priority of `level` in front (`<4>` for warning): journald reads each
    line as an entry of its own, so a line without it would be taken at info."""
    priority = PRIORITIES.get(level, PRIORITIES["info"])
    return "\n".join(f"<{priority}>{line}" for line in text.rstrip("\n").split("\n"))


def line_prefix(level: str) -> str:
    """What to put in front of a line written to stderr by hand (not through structlog): the priority prefix when
    stderr is the journal, else nothing."""
    return f"<{PRIORITIES.get(level, PRIORITIES['info'])}>" if _journal else ""


def _with_priority(renderer: Callable[..., Any]) -> Callable[..., str]:
    def render(logger: Any, name: str, event: MutableMapping[str, Any]) -> str:
        return prefixed(str(renderer(logger, name, event)), str(event.get("level", "info")))
    return render


def configure(json_lines: bool | None = None, level: str = "info", journal: bool | None = None) -> None:
    """`json_lines`: JSON (default when stderr is no terminal) or the console renderer; `level`: the least severe
    level written, one of LEVELS (`--log-level`); `journal`: prefix each line with its priority (default: when
    stderr is the journal, `stderr_is_journal`)."""
    global _journal
    if level not in LEVELS:
        raise ValueError(f"log level {level!r}: one of {', '.join(LEVELS)}")
    if json_lines is None:
        json_lines = not sys.stderr.isatty()
    _journal = stderr_is_journal() if journal is None else journal
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True), structlog.processors.format_exc_info,
                    # redaction last before the renderer: after anything that renders text
                    _redact_event, _with_priority(renderer) if _journal else renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _redact_other_writers()


def get(name: str = "reconciler") -> structlog.typing.FilteringBoundLogger:
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger
