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

Values of the right JSON type can still be impossible (a negative count, a span whose stop is
before its start): an annotation ``Annotated[int, Check(...)]`` says so once, beside the field
(:data:`Count`, :data:`Span`, :data:`Shape` are the common ones), and decoding refuses such a
value naming the field. A union decodes as the first of its members that the value fits and
decodes without error (``list[Shape | None] | Shape``: a list of shapes, or one flat shape).

Two kinds of record are documents of facts rather than results: :attr:`Record.schema_sparse`
leaves a field that is None out of the document (a fact that is not known is not stated, as the
trace header has always done), and a :class:`Document` also reads like its document
(``facts["notes"]``, ``facts.get("tp_size")``, ``{**facts}``), so code written against the
JSON keeps working on the typed record. :func:`build` decodes a document tracer writes itself,
refusing a key the record does not declare (a fact written without its field would be dropped).

This module holds :class:`Record`, :class:`Document` and the encoder and decoder by annotation;
what a field declares (:func:`field`, :class:`Check`, :data:`Count`, :data:`Span`, :data:`Shape`,
:func:`fields_of`) and the moves of a value to and from its place in a document are
:mod:`tracer.schema_fields`, whose public names are importable from here too.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import math
import numbers
import operator
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Callable, ClassVar, Iterator, Union

from tracer.errors import TracerError
from tracer.schema_fields import (_MISSING, Check, _Field, _get, _lists, _merge, _passes, _place, _plain_row, _row,
                                  _unview, _view, fields_of)
# the declarations a record's module writes as ``schema.field``, ``schema.Count``: this is their door too
from tracer.schema_fields import BIG, META, Count, Layout, Shape, Span, field


class Record:
    """Base of tracer's result dataclasses: one schema, derived from the fields (module docstring).

    Attributes:
        schema_sparse: (class attribute) leave a field that is None, and None by default, out of
            the document: a record of facts, where an unknown fact is not written at all.
        schema_derived: (class attribute) the keys :meth:`schema_extras` adds, which :func:`build`
            accepts in a document (and, as every decoder, does not read back).
    """

    schema_sparse: ClassVar[bool] = False
    schema_derived: ClassVar[tuple[str, ...]] = ()

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


# ------------------------------------------------------------------------------------------ encode


def encode(x: Record) -> dict[str, Any]:
    """:meth:`Record.to_dict` of ``x``: every field placed by its layout, then :meth:`~Record.schema_extras`.

    Raises:
        ValueError: two fields claim one key, or a field sits inside a field that is None while
            it has a value other than its default.
    """
    cls = type(x)
    own, values, order, any_list = _encoding(cls)
    doc: dict[str, Any] = {}
    slots: dict[str, list[str]] = {}  # a flattened field's keys, for the order of the document
    sparse = cls.schema_sparse
    for (f, key, viewed), raw in zip(own, values(x)):
        if sparse and raw is None and f.default is None:  # a fact that is not known is not written
            continue
        value = raw if type(raw) in _PLAIN else encode_value(raw)
        if viewed and isinstance(value, dict):
            value = _view(value, f.layout)
        if f.layout.flatten:
            _merge(doc, value, f"{cls.__name__}.{f.name}")
            slots[f.name] = list(value)
        elif key is not None and key not in doc:  # a key of its own: placed at once
            doc[key] = value
        else:
            _place(doc, f, value, raw, cls.__name__)
    if any_list:
        _lists(doc, fields_of(cls))
    x.schema_extras(doc)
    if type(order) is not tuple:  # a flattened field: its keys, as encoded, take its place in the order
        order = dict.fromkeys(itertools.chain.from_iterable([slots.get(n, k) for n, k in order]))
    return {**{k: doc[k] for k in order if k in doc}, **doc}


@functools.cache
def _encoding(cls: type) -> tuple[tuple[tuple[_Field, str | None, bool], ...], Callable[[Any], tuple], Any, bool]:
    """What :func:`encode` derives from ``cls``'s fields alone, once per class: the fields in
    placing order (stable: a companion after its owner), each with its key when it is a single
    top-level name (else None) and whether a nested record is laid out by rename/inline; a getter
    of their values in that order; the document's key order (a tuple), or where a flattened field's
    keys decide it, ``(field name, its keys when not flattened)`` per field (a list); whether any
    field is a list item."""
    fields = fields_of(cls)
    own = tuple((f, f.path[0] if len(f.path) == 1 and isinstance(f.path[0], str) else None,
                 bool(f.layout.rename or f.layout.inline)) for f in sorted(fields, key=lambda f: len(f.path)))
    get = operator.attrgetter(*(f.name for f, _, _ in own)) if own else (lambda x: ())
    values = get if len(own) != 1 else (lambda x: (get(x),))
    order: Any = tuple(dict.fromkeys(f.path[0] for f in fields))
    if any(f.layout.flatten for f in fields):
        order = [(f.name, (f.path[0],)) for f in fields]
    return own, values, order, any(isinstance(f.path[-1], int) for f in fields)


def encode_value(v: Any) -> Any:
    """The JSON-able form of one field value (see the module docstring)."""
    kind = type(v)  # the exact types first, plain values of a container without a call: thousands per comparison
    if kind in _PLAIN:
        return v
    if kind is list or kind is tuple:
        if _PLAIN.issuperset(map(type, v)):  # a row of numbers: as is
            return list(v)
        return [x if type(x) in _PLAIN else encode_value(x) for x in v]
    if kind is dict:
        return {k: x if type(x) in _PLAIN else encode_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)) and _PLAIN.issuperset(map(type, v)):
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


# ------------------------------------------------------------------------------------------ decode


def build(cls: type, doc: dict[str, Any]) -> Any:
    """The ``cls`` record of a document tracer builds itself (the trace header from its parts): as
    :func:`decode`, but a key no field of ``cls`` (or of a record inside it) declares is an error,
    never dropped.

    Raises:
        TracerError: as :func:`decode`, or a key that no field declares.
    """
    return decode(cls, doc, strict=True)


def decode(cls: type, doc: Any, where: str = "", *, strict: bool = False) -> Any:
    """:meth:`Record.from_dict`: the ``cls`` record of document ``doc``.

    Raises:
        TracerError: not an object, a key without default missing, a value of the wrong type or
            range, a record whose construction refuses the values; with ``strict``, a key that no
            field declares.
    """
    where = where or cls.__name__
    if not isinstance(doc, dict):
        raise TracerError(f"{where}: expected an object, got {type(doc).__name__}")
    doc = cls.schema_prepare(doc)
    if strict:
        unknown = [k for k in doc if k not in _declared(cls)]
        if unknown:
            raise TracerError(f"{where}: {unknown[0]!r} is not a field of {cls.__name__}; declare it there")
    kw = {}
    for f, dotted, key, plain in _reading(cls):
        if f.layout.flatten:
            raw = doc
        elif key is not None:
            raw = doc.get(key, _MISSING)
        else:
            raw = _get(doc, f.path)
        if raw is _MISSING:
            if f.default is _MISSING:
                raise TracerError(f"{where}.{dotted}: missing")
            continue
        if plain is not None and type(raw) is plain[0] and _passes(raw, plain[1]):  # decodes as itself
            kw[f.name] = raw
            continue
        if isinstance(raw, dict) and (f.layout.rename or f.layout.inline):
            raw = _unview(raw, f.layout)
        # a flattened record reads the whole document: the keys it does not declare are its owner's
        kw[f.name] = decode_value(raw, f.type, f"{where}.{dotted}", strict and not f.layout.flatten)
    try:
        obj = cls(**kw)
    except TracerError as e:  # the record's own checks (__post_init__), said at its place in the document
        raise TracerError(f"{where}: {e}") from None
    problem = obj.schema_check()
    if problem is not None:
        raise TracerError(f"{where}: {problem}")
    return obj


@functools.cache
def _reading(cls: type) -> tuple[tuple[Any, str, str | None, tuple[type, tuple[Check, ...]] | None], ...]:
    """Each field of ``cls`` with, worked out once per class: its path as written in an error's place
    (``a.b.0``); for a path of one key, that key (read with ``dict.get``); for a scalar field, the
    JSON type and checks of a value that decodes as itself (:func:`_row`; ``bool`` too)."""
    out = []
    for f in fields_of(cls):
        key = f.path[0] if len(f.path) == 1 and isinstance(f.path[0], str) else None
        plain = (bool, ()) if f.type is bool else _row(f.type)
        out.append((f, ".".join(map(str, f.path)), key, plain))
    return tuple(out)


@functools.cache
def _declared(cls: type) -> frozenset[str]:
    """The top-level document keys the fields of ``cls`` read (a flattened record's own keys too)."""
    keys: set[str] = set()
    for f in fields_of(cls):
        if f.layout.flatten:
            keys |= _declared(_record_type(f.type))
        else:
            keys.add(str(f.path[0]))
    return frozenset(keys | set(cls.schema_derived))


def _record_type(tp: Any) -> type:
    """The :class:`Record` class of a field annotated with one (``X`` or ``X | None``)."""
    for t in (tp, *typing.get_args(tp)):
        if isinstance(t, type) and issubclass(t, Record):
            return t
    raise TypeError(f"{tp} is not a record type")


_ANY, _ANNOTATED, _UNION, _RECORD, _ENUM, _FLOAT, _SCALAR, _SEQ, _DICT, _TYPEDDICT, _OTHER = range(11)
#: id(annotation) → (annotation, kind, origin, args), worked out once per annotation object (the
#: decoder meets the same few hundred annotations for every record of a trace). Keyed by identity:
#: typing's annotations hash in Python, slower than working them out; the entry holds the
#: annotation, so its id is not reused while cached. Emptied past 4096 entries (an annotation built
#: at each call, such as ``list[X]`` written inside a function, is a new object each time).
_KINDS: dict[int, tuple[Any, int, Any, tuple[Any, ...], Any]] = {}


def _kind_of(tp: Any) -> tuple[int, Any, tuple[Any, ...], Any]:
    """What :func:`decode_value` and :func:`_fits` do with annotation ``tp``: its kind, its
    ``typing.get_origin``, its ``typing.get_args`` and what the kind works out once (see :func:`_classify`)."""
    got = _KINDS.get(id(tp))
    if got is not None and got[0] is tp:
        return got[1], got[2], got[3], got[4]
    if len(_KINDS) > 4096:
        _KINDS.clear()
    kind, origin, args, extra = _classify(tp)
    _KINDS[id(tp)] = (tp, kind, origin, args, extra)
    return kind, origin, args, extra


def _classify(tp: Any) -> tuple[int, Any, tuple[Any, ...], Any]:
    """``tp``'s kind, origin and args, and the kind's extra: a union's members other than None; an
    ``Annotated``'s base and :class:`Check` s; a list's or open tuple's ``(item, row)``, ``row`` being
    ``(JSON type, checks)`` when an item of exactly that JSON type decodes as itself once the checks
    pass (``int``, ``Count``), else None."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    extra: Any = None
    if tp is Any:
        kind = _ANY
    elif origin is Annotated:
        kind = _ANNOTATED
        extra = (args[0], tuple(c for c in args[1:] if isinstance(c, Check)))
    elif origin in (Union, types.UnionType):
        kind = _UNION
        extra = tuple(a for a in args if a is not type(None))
    elif isinstance(tp, type) and issubclass(tp, Record):
        kind = _RECORD
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        kind = _ENUM
    elif tp is float:
        kind = _FLOAT
    elif tp in (int, bool, str):
        kind = _SCALAR
    elif origin in (tuple, list):
        kind = _SEQ
        if not (origin is tuple and args and args[-1] is not Ellipsis):
            item = args[0] if args else Any
            extra = (item, _row(item))
    elif origin is dict:
        kind = _DICT
    elif typing.is_typeddict(tp):
        kind = _TYPEDDICT
    else:
        kind = _OTHER
    return kind, origin, args, extra


def decode_value(x: Any, tp: Any, where: str, strict: bool = False) -> Any:
    """``x`` (JSON data) as a value of annotation ``tp``.

    Raises:
        TracerError: ``x`` does not fit ``tp``, or a :class:`Check` of ``tp`` refuses it.
    """
    kind, origin, args, extra = _kind_of(tp)
    if kind == _ANY:
        return x
    if kind == _ANNOTATED:
        base, checks = extra
        value = decode_value(x, base, where, strict)
        for c in checks:
            if not c.ok(value):
                raise TracerError(f"{where}: {_short(x)} is not {c.what}")
        return value
    if kind == _UNION:
        if x is None and len(extra) < len(args):  # None is a member
            return None
        if len(extra) == 1:  # X | None: X, whether or not the value fits it (X's own error)
            return decode_value(x, extra[0], where, strict)
        fitting = [a for a in extra if _fits(x, a)] or extra[:1]
        first: TracerError | None = None
        for a in fitting:  # the first member that the value fits and decodes as
            try:
                return decode_value(x, a, where, strict)
            except TracerError as e:
                first = first or e
        raise first  # type: ignore[misc]
    if kind == _RECORD:
        return decode(tp, x, where, strict=strict)
    if kind == _ENUM:
        try:
            return tp(x)
        except ValueError:
            raise TracerError(f"{where}: {x!r} is not one of {', '.join(str(m.value) for m in tp)}") from None
    if kind == _FLOAT:
        return _float(x, where)
    if kind == _SCALAR:
        if not _fits(x, tp):
            raise TracerError(f"{where}: expected {tp.__name__}, got {_short(x)}")
        return tp(x)
    if kind == _SEQ:
        if not isinstance(x, (list, tuple)):
            raise TracerError(f"{where}: expected a list, got {type(x).__name__}")
        if extra is None:  # a fixed-length tuple
            if len(args) != len(x):
                raise TracerError(f"{where}: expected {len(args)} items, got {len(x)}")
            return tuple(decode_value(v, a, f"{where}[{i}]", strict) for i, (v, a) in enumerate(zip(x, args)))
        item, row = extra
        if row is not None and _plain_row(x, *row):  # a shape, a row of numbers (a heat map's): as is
            return origin(x)
        if item is Any:  # plain JSON items: as they are
            return origin(x)
        return origin(decode_value(v, item, f"{where}[{i}]", strict) for i, v in enumerate(x))
    if kind in (_DICT, _TYPEDDICT):
        if not isinstance(x, dict):
            raise TracerError(f"{where}: expected an object, got {type(x).__name__}")
        if kind == _DICT:
            value = args[1] if args else Any
            if value is Any:  # plain JSON values: as they are
                return dict(x)
            return {k: decode_value(v, value, f"{where}.{k}", strict) for k, v in x.items()}
        hints = _hints(tp)
        return {k: decode_value(v, hints.get(k, Any), f"{where}.{k}", strict) for k, v in x.items()}
    return x


@functools.cache
def _hints(tp: type) -> dict[str, Any]:
    """A TypedDict's key annotations, worked out once (``typing.get_type_hints`` builds new
    annotation objects at each call)."""
    return typing.get_type_hints(tp, include_extras=True)


def _short(x: Any) -> str:
    """``repr(x)``, cut to 40 characters (a value in an error line)."""
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


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
    kind, origin, args, _ = _kind_of(tp)
    if kind == _ANY:
        return True
    if kind == _ANNOTATED:
        return _fits(x, args[0])
    if kind == _UNION:
        return any(_fits(x, a) for a in args)
    if tp is bool:
        return isinstance(x, bool)
    if tp is int:
        return isinstance(x, numbers.Integral) and not isinstance(x, bool)
    if kind == _FLOAT:
        return (isinstance(x, numbers.Real) and not isinstance(x, bool)) or x in ("inf", "-inf", "nan")
    if tp is str:
        return isinstance(x, str)
    if kind == _ENUM:
        return isinstance(x, typing.Hashable) and x in {m.value for m in tp}  # a list or object is no member
    if kind in (_RECORD, _DICT, _TYPEDDICT):
        return isinstance(x, dict)
    if kind == _SEQ or tp in (list, tuple):  # a bare list or tuple annotation too
        return isinstance(x, (list, tuple))
    if tp is dict:
        return isinstance(x, dict)
    return True


class Document(Record, Mapping):
    """A record of facts that also reads like its document (:meth:`to_dict`): ``doc["notes"]``,
    ``doc.get("tp_size")``, ``"versions_differ" in doc``, ``{**doc}`` give the JSON values, so code
    written against the document works on the typed record; its attributes are the typed values.
    Sparse (:attr:`Record.schema_sparse`): a fact that is None is not in the document."""

    schema_sparse: ClassVar[bool] = True

    @functools.cached_property
    def _doc(self) -> dict[str, Any]:
        return self.to_dict()

    def __getitem__(self, key: str) -> Any:
        return self._doc[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._doc)

    def __len__(self) -> int:
        return len(self._doc)


__all__ = ["Record", "Document", "encode", "encode_value", "build", "decode", "decode_value", "fields_of", "field",
           "Layout", "Check", "Count", "Span", "Shape", "BIG", "META"]
