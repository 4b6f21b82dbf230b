"""The user-facing error and its exit codes (docs/design.md, "Exit codes"): a failure the
user can fix is one line and one of these codes, never a traceback."""

from __future__ import annotations

# Exit codes of docs/design.md.
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_LIBRARY_MISSING = 3
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127


class LaunchError(Exception):
    """A failure the user can fix: printed as one line, exits with `code`."""

    def __init__(self, code: int, message: str, subject: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.subject = subject  # the file the failure is about, where there is one
