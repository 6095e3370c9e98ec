"""User-facing errors: one line that names what was wrong; the CLI prints it and exits 2."""

from __future__ import annotations


class UserError(Exception):
    """Bad input (YAML, arguments, API bodies): shown to the user as one line, exit code 2."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # never more than one line
