"""The one exception type tracer raises for bad input or a missing resource.

Every message is one line that says what is wrong and what to do next; the CLI prints it
without a traceback and exits with :data:`EXIT_ERROR`; any other exception is a bug and exits
with :data:`EXIT_INTERNAL`.
"""

from __future__ import annotations

#: Exit codes of the ``tracer`` command.
EXIT_OK = 0  # ran; bit-identical, or report-only mode
EXIT_DIVERGED = 1  # ran; the comparison failed the rule chosen with --fail-on
EXIT_ERROR = 2  # bad input, missing resource or corrupt file; nothing was run or written
EXIT_INTERNAL = 3  # an internal error (a bug): one line, the traceback with TRACER_DEBUG=1


class TracerError(Exception):
    """Bad input or a missing resource, with a one-line message that names the fix.

    Raised by every public function of tracer for conditions the user can correct
    (unknown model, missing files, bad option values, existing output, corrupt trace).
    """

    def __init__(self, message: str) -> None:
        if "\n" in message:
            raise ValueError("TracerError messages are one line")
        super().__init__(message)
