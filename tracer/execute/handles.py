"""The hook handles one capture registers, owned in one place.

Every capture of every engine (HF's :class:`~tracer.execute.capture.Capture`, the kernel and SDPA
recorders, every engine folder's own capture under ``tracer/engines/``) is a :class:`Hooks`: it
registers its forward hooks in :meth:`Hooks.install` through :meth:`Hooks.hook`, and the base keeps
the handles: entering the ``with`` block attaches them (a failure half-way removes those already
registered), leaving it removes every one, once.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from torch.nn.modules import module as _torch_module

H = TypeVar("H", bound="Hooks")


class Hooks:
    """Owns the forward-hook handles of one capture (module docstring)."""

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def hook(self, module: Any, fn: Callable[..., Any], *, pre: bool = False, wrap: bool = False,
             **kwargs: Any) -> Any:
        """Register ``fn`` as a forward hook of ``module`` (``pre``: a forward pre-hook; ``kwargs`` as
        torch's ``register_forward_hook``: ``with_kwargs``, ``prepend``, ``always_call``) and keep its
        handle. ``wrap`` (with ``with_kwargs=True`` and no other option): instead, call ``fn(module,
        args, kwargs, output)`` from a wrapper of the module's ``forward`` (:class:`WrappedForward`;
        ``fn``'s return value is ignored), unless forward hooks are registered on the module or
        globally (a hook may replace the output: a planted perturbation, a steering vector; a hook
        registered after them sees what they return) or the class's ``forward`` is a property
        (the instance's ``forward`` would never be read).
        Returns the handle."""
        # the wrapper stands in for a plain hook with kwargs only (no prepend/always_call order it could keep)
        if (wrap and not pre and kwargs == {"with_kwargs": True} and not module._forward_hooks
                and not _global_forward_hooks() and _plain_forward(module)):
            handle: Any = WrappedForward(module, fn)
        else:
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


def _plain_forward(module: Any) -> bool:
    """Whether an instance attribute ``forward`` is what ``module.forward`` reads: the class's
    ``forward`` is no data descriptor (a ``property`` would win over the instance's dict, and a
    wrapper written there would never run)."""
    for klass in type(module).__mro__:
        if "forward" in klass.__dict__:
            return not hasattr(type(klass.__dict__["forward"]), "__set__")
    return True


def _global_forward_hooks() -> bool:
    """Whether forward hooks for every module are registered (``register_module_forward_hook``)."""
    return bool(getattr(_torch_module, "_global_forward_hooks", True))


class WrappedForward:
    """A forward hook with kwargs, made as a wrapper of one module's ``forward`` (an attribute of the
    instance): ``fn(module, args, kwargs, output)`` runs right after the module's forward returns.

    A module with a forward hook takes PyTorch's general call path (about 13 µs more a call on a
    2-core EPYC, 93 calls a run of a 28-layer model at ``layers``); a wrapped ``forward`` keeps
    the fast path, where a launch-bound GPU forward feels every microsecond of the host's. It sees
    what a forward hook would see on a module with no other forward hook (:meth:`Hooks.hook` takes a
    hook where there is one). Not for a model that ``torch.compile`` traces (a new closure every run
    would recompile it): callers pass hooks there.
    :meth:`remove` puts back exactly what the instance had (a ``forward`` of its own, as
    accelerate's, or none); when somebody wrapped the forward again on top of this one, the
    wrapper stays in their chain as a pass-through that holds no hook (another capture's wrapper on
    top skips it when removed).
    """

    def __init__(self, module: Any, fn: Callable[..., Any]) -> None:
        self.module = module
        self._had = "forward" in module.__dict__
        self._prior = module.__dict__.get("forward")
        inner = module.forward
        #: the hook; None once removed (a wrapper left in somebody's chain is a pass-through holding no capture)
        self.fn: Callable[..., Any] | None = fn

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            hook = self.fn
            if hook is not None:
                hook(module, args, kwargs, out)
            return out

        forward._tracer_wrapped = self  # type: ignore[attr-defined]  # read by a later wrapper's remove()
        self._forward = forward
        # the instance's dict (what Module.__setattr__ does for a plain function, at a fraction of its cost)
        module.__dict__["forward"] = forward

    def remove(self) -> None:
        """Unwrap the module's ``forward`` (idempotent)."""
        self.fn = None
        d = self.module.__dict__
        if d.get("forward") is self._forward:
            had, prior = self._had, self._prior
            # a wrapper below this one, removed while this one was on top (captures left out of order):
            # a pass-through now, skipped to what it had itself
            while had and isinstance(w := getattr(prior, "_tracer_wrapped", None), WrappedForward) and w.fn is None:
                had, prior = w._had, w._prior
            if had:
                d["forward"] = prior
            else:
                del d["forward"]


__all__ = ["Hooks", "WrappedForward"]
