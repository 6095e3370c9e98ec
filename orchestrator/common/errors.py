"""User-facing errors: one line that names what was wrong; the CLI prints it and exits with the
error's code (2: bad input or usage, 1: a runtime failure)."""

from __future__ import annotations

import sys
from collections.abc import Callable


class UserError(Exception):
    """Bad input (YAML, arguments, API bodies): shown to the user as one line, exit code 2."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # never more than one line


class RuntimeFailure(UserError):
    """The input was fine but the operation failed (daemon unreachable, a wait that timed out, a
    service that FAILED, a daemon-side error): one line, exit code 1."""

    exit_code = 1


def exit_code_of(run: Callable[[], object]) -> int:
    """A process entry point's exit code: 0 when `run` returns, else its UserError's code, the
    one-line message on stderr (the daemon's and the data plane's main())."""
    try:
        run()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return 0
