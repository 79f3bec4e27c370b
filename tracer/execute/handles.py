"""The hook handles one capture registers, owned in one place.

Every capture of every engine (HF's :class:`~tracer.execute.capture.Capture`, the kernel and SDPA
recorders, every engine folder's own capture under ``tracer/engines/``) is a :class:`Hooks`: it
registers its forward hooks in :meth:`Hooks.install` through :meth:`Hooks.hook`, and the base keeps
the handles: entering the ``with`` block attaches them (a failure half-way removes those already
registered), leaving it removes every one, once.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

H = TypeVar("H", bound="Hooks")


class Hooks:
    """Owns the forward-hook handles of one capture (module docstring)."""

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def hook(self, module: Any, fn: Callable[..., Any], *, pre: bool = False, **kwargs: Any) -> Any:
        """Register ``fn`` as a forward hook of ``module`` (``pre``: a forward pre-hook; ``kwargs`` as
        torch's ``register_forward_hook``: ``with_kwargs``, ``prepend``, ``always_call``) and keep its
        handle. Returns the handle."""
        register = module.register_forward_pre_hook if pre else module.register_forward_hook
        handle = register(fn, **kwargs)
        self._handles.append(handle)
        return handle

    def install(self) -> None:
        """Register this capture's hooks (:meth:`hook`); what else entering the block starts."""

    def __enter__(self: H) -> H:
        try:
            self.install()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove every hook this capture registered (idempotent)."""
        while self._handles:
            self._handles.pop().remove()


__all__ = ["Hooks"]
