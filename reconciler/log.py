"""structlog set-up: JSON lines under systemd/journald or when piped, a readable console renderer in a terminal.

Secrets never reach a log line: any field whose name looks like a secret, and any value of an environment
variable named like one, is replaced by `***` before rendering.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

_SECRET_KEY = re.compile(r"(token|secret|password|passwd|api_key|apikey|credential)", re.I)
_SECRET_ASSIGN = re.compile(r"\b([A-Z0-9_]*(TOKEN|SECRET|PASSWORD|API_KEY)[A-Z0-9_]*)=([^\s'\"]+)")


def redact_text(text: str) -> str:
    return _SECRET_ASSIGN.sub(lambda m: f"{m.group(1)}=***", text)


def _redact(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key, value in list(event.items()):
        if _SECRET_KEY.search(key):
            event[key] = "***"
        elif isinstance(value, str):
            event[key] = redact_text(value)
    return event


def configure(json_lines: bool | None = None, level: str = "info") -> None:
    if json_lines is None:
        json_lines = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True), _redact,
                    structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get(name: str = "reconciler"):
    return structlog.get_logger(name)
