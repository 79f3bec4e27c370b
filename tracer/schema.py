"""One declaration per result type: its JSON document is derived from its dataclass fields.

A result dataclass subclasses :class:`Record`; :meth:`Record.to_dict` and :meth:`Record.from_dict`
walk :func:`dataclasses.fields` and each field's type annotation, so a field added to the
dataclass is written and read back with no edit anywhere else (there is no second list of
fields to forget). Encoding by annotation:

- a nested :class:`Record` → its own document; an :class:`enum.Enum` → its value;
- ``tuple``/``list`` → a JSON list (rebuilt as the annotated tuple or list); ``dict`` → an object;
- ``float`` → the float (non-finite values stay floats here; :func:`tracer.store.trace.json_safe`
  writes them as ``"inf"``/``"-inf"``/``"nan"`` and decoding turns those strings back into floats);
- a :class:`typing.TypedDict` → an object whose keys are decoded by their annotations;
- ``Any`` → as it is (plain JSON data: facts, shapes).

Where a document keeps an older layout, the field says so with :func:`field` (Polygraphy's
``struct.py`` idea: the encoder and decoder registered beside the type): ``key`` (another name,
or a path into the document such as ``("runs", 0)`` or ``("logits", "name")``), ``flatten``
(a nested record's keys merged into this document), ``rename``/``inline`` (how a nested record is
laid out inside this one). Values derived from the fields (a verdict, a count) are added by
:meth:`Record.schema_extras` and never read back; :meth:`Record.schema_prepare` undoes a view
(e.g. absolute positions) before the fields are decoded, and :meth:`Record.schema_check` refuses
values of the right type but an impossible range after. Keys a decoder does not know are
ignored, so documents written by later versions stay readable; a missing key takes the field's
default (documents of earlier versions), or is an error when the field has none.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import numbers
import types
import typing
from typing import Any, Union

from tracer.errors import TracerError

#: the metadata key of :func:`field`'s layout in :attr:`dataclasses.Field.metadata`
META = "tracer.schema"
_MISSING = dataclasses.MISSING


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


class Record:
    """Base of tracer's result dataclasses: one schema, derived from the fields (module docstring)."""

    def to_dict(self) -> dict[str, Any]:
        """The record's JSON-able document (floats may be ``inf``/``nan``; tuples become lists)."""
        return encode(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Any:
        """The record whose :meth:`to_dict` is ``doc``.

        Raises:
            TracerError: ``doc`` is not such a document (the message names the key at fault).
        """
        return decode(cls, doc)

    def schema_extras(self, doc: dict[str, Any]) -> None:
        """Add the values derived from the fields to ``doc`` (in place); they are never read back."""

    @classmethod
    def schema_prepare(cls, doc: dict[str, Any]) -> dict[str, Any]:
        """``doc`` with any view undone before its fields are decoded (a new dict; ``doc`` is not changed)."""
        return doc

    def schema_check(self) -> str | None:
        """After :meth:`from_dict` built the record: what is wrong with its values beyond their types
        (a range, a count that cannot be, a list of the wrong length), or None. A document may have
        been edited with every checksum recomputed; what this says becomes a one-line TracerError."""
        return None


@functools.cache
def fields_of(cls: type) -> tuple[_Field, ...]:
    """The schema of a :class:`Record` dataclass: one entry per :func:`dataclasses.fields` entry, in order.

    Raises:
        TypeError: ``cls`` is not a dataclass, or a field's annotation cannot be resolved.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    hints = typing.get_type_hints(cls)
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


# ------------------------------------------------------------------------------------------ encode


def encode(x: Record) -> dict[str, Any]:
    """:meth:`Record.to_dict` of ``x``: every field placed by its layout, then :meth:`~Record.schema_extras`.

    Raises:
        ValueError: two fields claim one key, or a field sits inside a field that is None while
            it has a value other than its default.
    """
    doc: dict[str, Any] = {}
    slots: dict[str, list[str]] = {}  # a flattened field's keys, for the order of the document
    own = sorted(fields_of(type(x)), key=lambda f: len(f.path))  # stable: a companion after its owner
    for f in own:
        value = encode_value(getattr(x, f.name))
        if isinstance(value, dict) and (f.layout.rename or f.layout.inline):
            value = _view(value, f.layout)
        if f.layout.flatten:
            _merge(doc, value, f"{type(x).__name__}.{f.name}")
            slots[f.name] = list(value)
        else:
            _place(doc, f, value, getattr(x, f.name), type(x).__name__)
    _lists(doc, own)
    x.schema_extras(doc)
    order = dict.fromkeys(k for f in fields_of(type(x)) for k in slots.get(f.name, [f.path[0]]))
    return {**{k: doc[k] for k in order if k in doc}, **doc}


def encode_value(v: Any) -> Any:
    """The JSON-able form of one field value (see the module docstring)."""
    if type(v) in _PLAIN:
        return v
    if isinstance(v, (list, tuple)) and all(type(x) in _PLAIN for x in v):  # a row of numbers: as is
        return list(v)
    if isinstance(v, Record):
        return encode(v)
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, dict):
        return {k: encode_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [encode_value(x) for x in v]
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        raise TypeError(f"{type(v).__name__} is a dataclass but not a tracer.schema.Record; make it one")
    return v


_PLAIN = frozenset((float, int, str, bool, type(None)))


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


# ------------------------------------------------------------------------------------------ decode


def decode(cls: type, doc: Any, where: str = "") -> Any:
    """:meth:`Record.from_dict`: the ``cls`` record of document ``doc``.

    Raises:
        TracerError: not an object, a key without default missing, or a value of the wrong type.
    """
    where = where or cls.__name__
    if not isinstance(doc, dict):
        raise TracerError(f"{where}: expected an object, got {type(doc).__name__}")
    doc = cls.schema_prepare(doc)
    kw = {}
    for f in fields_of(cls):
        raw = doc if f.layout.flatten else _get(doc, f.path)
        at = f"{where}.{'.'.join(map(str, f.path))}"
        if raw is _MISSING:
            if f.default is _MISSING:
                raise TracerError(f"{at}: missing")
            continue
        if isinstance(raw, dict) and (f.layout.rename or f.layout.inline):
            raw = _unview(raw, f.layout)
        kw[f.name] = decode_value(raw, f.type, at)
    obj = cls(**kw)
    problem = obj.schema_check()
    if problem is not None:
        raise TracerError(f"{where}: {problem}")
    return obj


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


def decode_value(x: Any, tp: Any, where: str) -> Any:
    """``x`` (JSON data) as a value of annotation ``tp``.

    Raises:
        TracerError: ``x`` does not fit ``tp``.
    """
    origin = typing.get_origin(tp)
    if tp is Any:
        return x
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if x is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        return decode_value(x, next((a for a in options if _fits(x, a)), options[0]), where)
    if isinstance(tp, type) and issubclass(tp, Record):
        return decode(tp, x, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(x)
        except ValueError:
            raise TracerError(f"{where}: {x!r} is not one of {', '.join(str(m.value) for m in tp)}") from None
    if tp is float:
        return _float(x, where)
    if tp in (int, bool, str):
        if not _fits(x, tp):
            raise TracerError(f"{where}: expected {tp.__name__}, got {x!r}")
        return tp(x)
    if origin in (tuple, list):
        if not isinstance(x, (list, tuple)):
            raise TracerError(f"{where}: expected a list, got {type(x).__name__}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(x):
                raise TracerError(f"{where}: expected {len(args)} items, got {len(x)}")
            return tuple(decode_value(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(x, args)))
        item = args[0] if args else Any
        fast = _ROW.get(item)
        if fast is not None and all(type(v) is fast for v in x):  # a row of numbers (a heat map's): as is
            return origin(x)
        return origin(decode_value(v, item, f"{where}[{i}]") for i, v in enumerate(x))
    if origin is dict or typing.is_typeddict(tp):
        if not isinstance(x, dict):
            raise TracerError(f"{where}: expected an object, got {type(x).__name__}")
        if origin is dict:
            value = typing.get_args(tp)[1] if typing.get_args(tp) else Any
            return {k: decode_value(v, value, f"{where}.{k}") for k, v in x.items()}
        hints = typing.get_type_hints(tp)
        return {k: decode_value(v, hints.get(k, Any), f"{where}.{k}") for k, v in x.items()}
    return x


_ROW = {float: float, int: int, str: str}  # item annotation → the JSON type that needs no decoding


def _float(x: Any, where: str) -> float:
    if x is None:  # a non-finite float written as JSON null by another writer
        return math.nan
    if isinstance(x, str) and x in ("inf", "-inf", "nan", "Infinity", "-Infinity", "NaN"):
        return float(x)
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return float(x)
    raise TracerError(f"{where}: expected a number, got {x!r}")


def _fits(x: Any, tp: Any) -> bool:
    """Whether JSON value ``x`` can be a ``tp`` (to choose among the members of a union)."""
    origin = typing.get_origin(tp) or tp
    if tp is Any:
        return True
    if tp is bool:
        return isinstance(x, bool)
    if tp is int:
        return isinstance(x, numbers.Integral) and not isinstance(x, bool)
    if tp is float:
        return (isinstance(x, numbers.Real) and not isinstance(x, bool)) or x in ("inf", "-inf", "nan")
    if tp is str:
        return isinstance(x, str)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return x in {m.value for m in tp}
    if isinstance(tp, type) and issubclass(tp, Record) or origin is dict or typing.is_typeddict(tp):
        return isinstance(x, dict)
    if origin in (tuple, list):
        return isinstance(x, (list, tuple))
    return True
