"""``python -m tracer`` = the ``tracer`` command."""

from tracer.cli import command

command()
