"""``python -m tracer`` = the ``tracer`` command."""

from .cli import main

main()
