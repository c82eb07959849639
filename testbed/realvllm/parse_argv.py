"""Judge `vllm serve` command lines with vLLM's own parser: run with the real-vLLM image's venv python.

Reads a JSON list of argvs (each starting with "vllm", "serve") on stdin and prints a JSON list of
{"ok": bool, "error": str} in the same order. It builds the parser exactly as `vllm` does (vllm/entrypoints/cli/
main.py: FlexibleArgumentParser + ServeSubcommand.subparser_init), parses, and runs the subcommand's validate();
nothing is started. Used by tests/e2e/test_vllm_parser.py (torch lives only in that venv).
"""

import contextlib
import io
import json
import sys
from typing import TypedDict

from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser


class Verdict(TypedDict):
    """vLLM's own judgement of one argv: accepted, or the error lines it printed."""

    ok: bool
    error: list[str]


def judge(argv: list[str]) -> Verdict:
    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    cmd = ServeSubcommand()
    cmd.subparser_init(subparsers)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv[1:])
            cmd.validate(args)
    except SystemExit as exc:
        return {"ok": False, "error": err.getvalue().strip().splitlines()[-1:] or [f"exit {exc.code}"]}
    except Exception as exc:  # noqa: BLE001 - validate() raises plain exceptions for bad combinations
        return {"ok": False, "error": [f"{type(exc).__name__}: {exc}"]}
    return {"ok": True, "error": []}


def main() -> int:
    print(json.dumps([judge(argv) for argv in json.load(sys.stdin)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
