"""A record field's declaration and its place in the document, for :mod:`tracer.schema`.

What a field says beside its type: the :class:`Check` of an ``Annotated`` value (:data:`Count`,
:data:`Span`, :data:`Shape`) and its :class:`Layout` (:func:`field`: another key or a path, a
flattened, renamed or inlined record), read once per class by :func:`fields_of`; which values
decode as themselves once their checks pass (``_row``, ``_passes``, ``_plain_row``: the decoder's
short cuts for shapes, rows of numbers and scalar fields); and the moves of
a value to and from its place in a document: placed by its path, list items gathered into their
list, a nested record's keys merged, renamed or inlined (``_place``, ``_lists``, ``_merge``,
``_view``, for encoding); found by its path and the view undone (``_get``, ``_unview``, for
decoding). Nothing here knows a record: :mod:`tracer.schema` holds
:class:`~tracer.schema.Record` with its encoder and decoder, built on these.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Annotated, Any, Callable

#: the metadata key of :func:`field`'s layout in :attr:`dataclasses.Field.metadata`
META = "tracer.schema"
_MISSING = dataclasses.MISSING
#: the largest count, position or dimension a document may hold (beyond any real model or prompt)
BIG = 1 << 48


@dataclasses.dataclass(frozen=True)
class Check:
    """A constraint on a value of the right JSON type, declared in its annotation:
    ``Annotated[int, Check(lambda n: 0 <= n <= BIG, "a count")]``; decoding refuses a value
    ``ok`` rejects with ``<where>: <value> is not <what>``."""

    ok: Callable[[Any], bool]
    what: str


def _span_ok(s: Any) -> bool:
    return len(s) == 2 and 0 <= s[0] <= s[1] <= BIG


#: a count, a position or a dimension: an int in ``0..BIG``
Count = Annotated[int, Check(lambda n: 0 <= n <= BIG, f"a count in 0..{BIG}")]
#: ``[start, stop]`` token positions, ``0 <= start <= stop``
Span = Annotated[tuple[int, ...], Check(_span_ok, "[start, stop] positions with 0 <= start <= stop")]
#: a tensor's shape: at most 16 dimensions, each in ``0..BIG``
Shape = Annotated[tuple[Count, ...], Check(lambda s: len(s) <= 16, "a shape of at most 16 dimensions")]


# ------------------------------------------------------------ a value that decodes as itself


def _row(item: Any) -> tuple[type, tuple[Check, ...]] | None:
    """``(JSON type, checks)`` when a list item of exactly that type decodes as itself once the
    checks pass: ``float``, ``int``, ``str``, or one of them ``Annotated`` with checks (``Count``)."""
    if item in (float, int, str):
        return item, ()
    if typing.get_origin(item) is Annotated:
        base, *extras = typing.get_args(item)
        if base in (float, int, str):
            return base, tuple(c for c in extras if isinstance(c, Check))
    return None


def _passes(x: Any, checks: tuple[Check, ...]) -> bool:
    """Whether every check accepts ``x``; False when one refuses it or cannot judge it (then the
    decoder, on its slow path, says where and why)."""
    try:
        for c in checks:
            if not c.ok(x):
                return False
    except Exception:
        return False
    return True


def _plain_row(x: list[Any] | tuple[Any, ...], json_type: type, checks: tuple[Check, ...]) -> bool:
    """Whether every item of ``x`` is exactly ``json_type`` and passes ``checks``: then each decodes
    as itself. False (decode item by item, for the error's place) when one does not or a check
    refuses or cannot judge one (:func:`_passes`)."""
    return all(type(v) is json_type for v in x) and (not checks or all(_passes(v, checks) for v in x))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one field sits in its record's document (see :func:`field`)."""

    key: tuple[str | int, ...] | None = None
    flatten: bool = False
    rename: tuple[tuple[str, str], ...] = ()
    inline: tuple[str, ...] = ()


def field(*, key: str | tuple[str | int, ...] | None = None, flatten: bool = False,
          rename: dict[str, str] | None = None, inline: tuple[str, ...] = (), default: Any = _MISSING,
          default_factory: Any = _MISSING, compare: bool = True, repr: bool = True) -> Any:
    """A :func:`dataclasses.field` with its place in the document.

    Args:
        key: the document key (default: the field's name), or a path of keys and list indices.
        flatten: the field is a record whose keys are merged into this record's document.
        rename: for a nested record, its keys renamed in this document (``{"n_positions": "positions"}``).
        inline: for a nested record, those of its nested records whose keys are merged into it.
        default, default_factory, compare, repr: as for :func:`dataclasses.field`.
    """
    path = None if key is None else ((key,) if isinstance(key, str) else tuple(key))
    layout = Layout(path, flatten, tuple((rename or {}).items()), tuple(inline))
    return dataclasses.field(default=default, default_factory=default_factory, compare=compare, repr=repr,
                             metadata={META: layout})


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    path: tuple[str | int, ...]
    type: Any
    layout: Layout
    default: Any  # the default value, a zero-argument factory's result, or _MISSING


@functools.cache
def fields_of(cls: type) -> tuple[_Field, ...]:
    """The schema of a :class:`Record` dataclass: one entry per :func:`dataclasses.fields` entry, in order.

    Raises:
        TypeError: ``cls`` is not a dataclass, or a field's annotation cannot be resolved.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        layout = f.metadata.get(META, Layout())
        if f.default is not _MISSING:
            default = f.default
        elif f.default_factory is not _MISSING:
            default = f.default_factory()
        else:
            default = _MISSING
        out.append(_Field(f.name, layout.key or (f.name,), hints[f.name], layout, default))
    return tuple(out)


# ----------------------------------------------------------------------- a value's place in the document


def _merge(doc: dict[str, Any], value: dict[str, Any], what: str) -> None:
    for k, v in value.items():
        if k in doc:
            raise ValueError(f"{what}: key {k!r} is claimed twice in the document")
        doc[k] = v


def _view(value: dict[str, Any], layout: Layout) -> dict[str, Any]:
    out: dict[str, Any] = {}
    names = dict(layout.rename)
    for k, v in value.items():
        if k in layout.inline and isinstance(v, dict):  # its keys take its place
            _merge(out, {names.get(i, i): x for i, x in v.items()}, f"inline {k}")
        elif k not in layout.inline:
            _merge(out, {names.get(k, k): v}, f"rename {k}")
    return out


def _place(doc: dict[str, Any], f: _Field, value: Any, raw: Any, owner: str) -> None:
    node: Any = doc
    for step in f.path[:-1]:
        present = node.get(step, _MISSING)
        if present is None:  # the field sits inside a field that is None: nothing to place it in
            if raw != f.default:
                raise ValueError(f"{owner}.{f.name} = {raw!r} sits at {f.path} but {step!r} is None")
            return
        if present is _MISSING:
            present = node[step] = {}
        node = present
    last = f.path[-1]
    if isinstance(last, int):  # an item of a list (``("runs", 0)``), made a list by _lists
        node.setdefault(_ITEMS, {})[last] = value
        return
    if last in node:
        if not (isinstance(node[last], dict) and isinstance(value, dict)):
            raise ValueError(f"{owner}.{f.name}: key {f.path} is claimed twice in the document")
        _merge(node[last], value, f"{owner}.{f.name}")
    else:
        node[last] = value


def _lists(doc: dict[str, Any], fields: tuple[_Field, ...]) -> None:
    """Turn the items placed by :func:`_place` under ``(..., key, index)`` into the list at ``key``."""
    for f in fields:
        if isinstance(f.path[-1], int):
            node: Any = doc
            for step in f.path[:-2]:
                node = node.get(step) if isinstance(node, dict) else None
            holder = node.get(f.path[-2]) if isinstance(node, dict) else None
            if isinstance(holder, dict) and set(holder) == {_ITEMS}:
                items = holder[_ITEMS]
                node[f.path[-2]] = [items.get(i) for i in range(max(items) + 1)]


_ITEMS = object()  # the key under which list items wait in the document being built


def _get(doc: dict[str, Any], path: tuple[str | int, ...]) -> Any:
    node: Any = doc
    for i, step in enumerate(path):
        if i and node is None:  # inside a field that is None: the default
            return _MISSING
        if isinstance(node, dict) and not isinstance(step, int) and step in node:
            node = node[step]
        elif isinstance(node, list) and isinstance(step, int) and step < len(node):
            node = node[step]
        else:
            return _MISSING
    return node


def _unview(value: dict[str, Any], layout: Layout) -> dict[str, Any]:
    renamed = {old for old, _ in layout.rename}  # a key of that name here belongs to someone else
    out = {k: v for k, v in value.items() if k not in renamed}
    out.update({old: value[new] for old, new in layout.rename if new in value})
    for k in layout.inline:
        out[k] = dict(out)  # the nested record reads its keys from the merged document
    return out
