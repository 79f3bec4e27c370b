"""Fitting a terminal table to a width: which columns stay, how wide each is, how names are shortened.

The columns' headers and the check of ``--columns``/``--format``, and pure functions of strings
and widths (no rich, no comparison): :mod:`tracer.report.tables` and
:mod:`tracer.report.hierarchy` give them the cells they would print and draw what comes back.

The rules (issue 25, item 1):

- a number is never truncated: a numeric column is at least as wide as its widest cell;
- columns give way in a fixed order (:data:`DROP_ORDER`; the histogram and the kernels first);
  the columns of :data:`KEEP` (name, differing / total, max abs diff, ULP, flips) stay, but for
  :data:`SPARE` (flips: the logits line under the table counts them) in a terminal too narrow for
  them all once the name is at its floor (60 columns);
- headers wrap at spaces before a column is dropped;
- a name too long for its column is shortened from the left at a dot
  (``…layers.3.self_attn.kv_cache``); a marker (``◀ origin``) is never cut: it moves to a line of
  its own under the name when both do not fit side by side.

A rich table with a box and one space of padding on each side of a cell is
``sum(widths) + 3 * columns + 1`` characters wide (:func:`table_width`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tracer.errors import TracerError

#: the output formats of every result (comparison, audit, sweep, benchmark): one writer each per
#: result kind in :data:`tracer.report.render.WRITERS`
FORMATS = ("table", "json", "csv", "markdown")
#: the amplification table's columns: key → header (cells: :data:`tracer.report.tables.COLUMNS`)
COLUMN_HEADERS = {
    "point": "capture point", "diff": "differing / total", "fraction": "fraction", "max_abs": "max abs diff",
    "mean_abs": "mean abs diff", "ulp": "max ULP*", "ulp_line": "max ULP (line)", "hist": "ULP histogram",
    "rel": "rel err", "cos": "cosine", "sqnr": "SQNR dB", "rel1": "<1‰", "rel5": "<5‰", "growth": "×prev layer",
    "ampl": "×first", "nan_inf": "NaN/Inf A|B", "tol": "outside tol", "flips": "flips", "kernels": "kernels (A vs B)",
}
DEFAULT_COLUMNS = ("point", "diff", "max_abs", "ulp", "hist", "rel", "growth", "flips")
WIDE_COLUMNS = tuple(k for k in COLUMN_HEADERS if k != "kernels")  # kernels: added when recorded (with_kernels)


def check_format(fmt: str, formats: tuple[str, ...] = FORMATS) -> str:
    """Validate an output format name against ``formats`` (:data:`FORMATS`).

    Raises:
        TracerError: unknown format.
    """
    if fmt not in formats:
        raise TracerError(f"unknown format '{fmt}'; use one of: {', '.join(formats)}")
    return fmt


def check_columns(columns: str | list[str] | None, wide: bool = False) -> tuple[str, ...]:
    """The table columns: ``--columns a,b`` (keys of :data:`COLUMN_HEADERS`), ``--wide`` (all), or the default.

    Raises:
        TracerError: an unknown column key (the message lists the known ones), an empty list,
            or ``--wide`` together with ``--columns``.
    """
    if columns is None:
        return WIDE_COLUMNS if wide else DEFAULT_COLUMNS
    if wide:
        raise TracerError("--wide shows every column and --columns picks some; give one of them")
    keys = [k.strip() for k in (columns.split(",") if isinstance(columns, str) else columns) if k.strip()]
    if not keys:
        raise TracerError(f"--columns is empty; give some of: {', '.join(COLUMN_HEADERS)}")
    bad = [k for k in keys if k not in COLUMN_HEADERS]
    if bad:
        raise TracerError(f"unknown column '{bad[0]}' in --columns; use some of: {', '.join(COLUMN_HEADERS)}")
    return ("point",) + tuple(k for k in keys if k != "point")

#: the columns of the amplification table that stay at every width
KEEP = ("point", "diff", "max_abs", "ulp", "flips")
#: kept columns that give way only when nothing else makes the table fit (the logits line says the flips)
SPARE = ("flips",)
#: the order the other columns are dropped in when the table does not fit (first: first dropped)
DROP_ORDER = ("kernels", "hist", "nan_inf", "sqnr", "rel5", "rel1", "cos", "ampl", "mean_abs", "ulp_line",
              "tol", "fraction", "growth", "rel")
#: the name column's narrowest width: ``…layers.3.self_attn.kv_cache`` (28 characters) stays readable
NAME_MIN = 28
#: wider, up to this, when a shown name needs it to keep its layer index (:func:`readable_width`)
NAME_MAX = 40
#: narrower still only when the kept columns do not fit otherwise (``--positions all`` at 80 columns)
NAME_FLOOR = 16
#: the width of piped output when ``COLUMNS`` does not say
PIPED_WIDTH = 80
ELLIPSIS = "…"


def piped_width(environ: dict[str, str] | None = None) -> int:
    """The width of output that is not a terminal: ``$COLUMNS`` when it is a positive integer,
    else :data:`PIPED_WIDTH` (80, as rich's own console)."""
    value = (os.environ if environ is None else environ).get("COLUMNS", "")
    return int(value) if value.strip().isdigit() and int(value) > 0 else PIPED_WIDTH


#: a rich box table's overhead: 3 characters per column (padding 1 each side, a border) and 1 (the last border)
BOXED = (3, 1)
#: a table without a box, one space after each column but the last (``box=None, padding=(0, 1, 0, 0),
#: pad_edge=False``): the RL tables
BARE = (1, -1)


def table_width(widths: list[int] | tuple[int, ...], gaps: tuple[int, int] = BOXED) -> int:
    """Characters a rich table with these column widths takes: a box table (padding 1 each side,
    borders; ``gaps`` :data:`BOXED`) or ``gaps`` = (characters per column, characters once)."""
    return sum(widths) + gaps[0] * len(widths) + gaps[1] if widths else 0


def header_min(header: str) -> int:
    """The narrowest a header gets when it wraps at spaces: its longest word."""
    return max((len(w) for w in header.split()), default=0)


def shorten_left(name: str, width: int) -> str:
    """``name`` in at most ``width`` characters, cut from the left at a dot:
    ``model.layers.3.self_attn.kv_cache`` in 28 → ``…layers.3.self_attn.kv_cache``; never inside a
    word and never so that a layer index leads (``…3.self_attn`` could be layer 13 or 23); a layer
    index that a suffix would lose is kept by eliding the middle instead: in 27
    ``…layers.3…kv_cache`` (rows of two layers stay apart), else the suffix (``…post_attention_layernorm``).
    The ``×4`` of a grouped row stays.

    A name that fits is returned unchanged; a last component longer than ``width`` itself is cut at
    an underscore inside it (``…attention_layernorm``), and only a word longer still at a character.
    """
    if len(name) <= width:
        return name
    if width <= 1:
        return ELLIPSIS[:width]
    base, _, count = name.partition(" ")
    tail = f" {count}" if count else ""
    room = width - 1 - len(tail)
    parts = base.split(".")
    index = max((i for i, p in enumerate(parts) if p.isdigit()), default=None)
    for i in range(1, len(parts)):  # the longest suffix at a dot that fits and does not start with an index
        rest = ".".join(parts[i:])
        if len(rest) <= room and not (parts[i].isdigit() or parts[i] == "*"):
            if index is not None and i > index and index >= 1:  # it would lose the layer index: keep it,
                head = ELLIPSIS + ".".join(parts[index - 1:index + 1])  # eliding the middle instead
                for j in range(index + 2, len(parts)):
                    kept = head + ELLIPSIS + ".".join(parts[j:])
                    if len(kept) <= width - len(tail):
                        return kept + tail
            return ELLIPSIS + rest + tail
    words = parts[-1].split("_")  # the last component alone is too long: at an underscore inside it
    for i in range(1, len(words)):
        rest = "_".join(words[i:])
        if len(rest) <= room:
            return ELLIPSIS + rest + tail
    return ELLIPSIS + base[len(base) - max(room, 1):] + tail if room > 0 else ELLIPSIS + name[len(name) - width + 1:]


def readable_width(name: str) -> int:
    """The width :func:`shorten_left` needs to keep ``name``'s layer index (``…layers.2.post_attention_layernorm``:
    34 for ``model.layers.2.post_attention_layernorm``); a name without an index: its last component."""
    base, _, count = name.partition(" ")
    parts = base.split(".")
    index = max((i for i, p in enumerate(parts) if p.isdigit() or p == "*"), default=None)
    keep = parts[max(0, index - 1):] if index is not None else parts[-1:]
    text = ".".join(keep)
    return min(len(name), len(text) + (len(base) > len(text)) + (len(count) + 1 if count else 0))


def _keeps_index(name: str, short: str) -> bool:
    """Whether ``short`` (:func:`shorten_left` of ``name``) still shows the name's layer index."""
    parts = name.partition(" ")[0].split(".")
    index = max((i for i, p in enumerate(parts) if p.isdigit() or p == "*"), default=None)
    if index is None:
        return True
    shown = short.replace(ELLIPSIS, ".").split(".")
    return any(shown[i:i + 2] == parts[index - 1:index + 1] for i in range(len(shown) - 1)) if index else parts[0] in shown


def _loses_an_index(cells: list[str], width: int) -> bool:
    """Whether a name column of ``width`` characters would cut the layer index of one of ``cells``
    (names, each maybe followed by a marker or a note line) that it now shows whole or shortened."""
    for cell in cells:
        name = cell.split("\n")[0].partition("  ")[0]  # the name alone: a marker ("  ◀ origin") or note follows
        if len(name) > width and not _keeps_index(name, shorten_left(name, max(width, 1))):
            return True
    return False


def name_cell(name: str, marker: str, width: int, note: str = "") -> str:
    """The name column's text: ``name + marker`` on one line when it fits ``width``; else the name
    shortened from the left at a dot (:func:`shorten_left`) so that the marker stays beside it, as
    long as the name keeps its layer index (``…layers.3…kv_cache  ◀ origin``); else the marker on a
    second line (the marker itself is never cut). ``note`` (a dtype or capture-contract note:
    ``[in float32; A is bfloat16, B float32; ULP* in bfloat16]``) follows on lines of its own,
    broken between words, so it never takes the name's place."""
    import textwrap

    if len(name) + len(marker) <= width:
        cell = name + marker
    elif marker and width - len(marker) >= min(len(name), NAME_FLOOR) and \
            _keeps_index(name, short := shorten_left(name, width - len(marker))):
        cell = short + marker
    else:
        cell = shorten_left(name, width) + (("\n" + marker.strip()) if marker else "")
    if note.strip():
        cell += "\n" + "\n".join(textwrap.wrap(note.strip(), max(width, 1), break_on_hyphens=False))
    return cell


@dataclass(frozen=True)
class Fit:
    """The layout chosen for one width.

    Attributes:
        columns: the column keys shown, in the requested order.
        widths: the width of each shown column (same order).
        dropped: the requested columns left out, in the order they were dropped.
        width: the table's total width (:func:`table_width`).
    """

    columns: tuple[str, ...]
    widths: tuple[int, ...]
    dropped: tuple[str, ...]
    width: int


def fit_columns(columns: tuple[str, ...], headers: dict[str, str], cells: dict[str, list[str]], width: int, *,
                name_key: str = "point", name_min: int = NAME_MIN, keep: tuple[str, ...] = KEEP,
                drop_order: tuple[str, ...] = DROP_ORDER, flexible: tuple[str, ...] = (),
                gaps: tuple[int, int] = BOXED, spare: tuple[str, ...] = (), flex_min: int = 0) -> Fit:
    """Choose the columns and their widths so that the table fits ``width`` characters.

    Args:
        columns: the requested column keys in display order.
        headers: key → header text. cells: key → every cell of that column (each line of a
            multi-line cell counts separately).
        width: the characters available.
        name_key: the column whose text may be shortened (down to ``name_min``).
        keep: columns never dropped. drop_order: the others, first dropped first (a requested
            column missing from it is dropped last).
        flexible: text columns that may wrap down to their longest word (their cells are text,
            not numbers), and not below ``flex_min`` characters (or their widest cell): a label
            that stays readable (an audit's check) rather than one word a line.
        gaps: the table's overhead (:func:`table_width`: :data:`BOXED` or :data:`BARE`).
        spare: kept columns that give way before the name narrows so far that a shown name loses
            its layer index (where dropping them alone makes the table fit), and last, once the name
            is at its floor and the table still
            does not fit (a narrow terminal), in this order; only when that makes it fit.

    Every other column is at least as wide as its widest cell. When the kept columns do not fit
    with the name at ``name_min``, the name narrows further (down to :data:`NAME_FLOOR`); when
    even that does not fit, they are shown anyway (the table is then wider than ``width``;
    nothing is truncated).

    Returns:
        a :class:`Fit`.
    """
    def widest(key: str) -> int:
        return max((len(line) for c in cells.get(key, []) for line in c.split("\n")), default=0)

    def longest_word(key: str) -> int:
        return max((len(w) for c in cells.get(key, []) for w in c.split()), default=0)

    natural = {k: max(widest(k), len(headers[k])) for k in columns}
    lowest = {}
    for k in columns:
        if k == name_key:  # short names (an audit's "-") leave the room to others: the header wraps
            lowest[k] = max(min(widest(k), name_min), header_min(headers[k]))
        elif k in flexible:
            lowest[k] = max(header_min(headers[k]), min(longest_word(k), 24), min(widest(k), flex_min), 1)
        else:
            lowest[k] = max(widest(k), header_min(headers[k]))
    order = [k for k in drop_order if k in columns and k not in keep]
    order += [k for k in columns if k not in keep and k not in order]
    shown, dropped = list(columns), []
    while table_width([lowest[k] for k in shown], gaps) > width and order:
        k = order.pop(0)
        shown.remove(k)
        dropped.append(k)
    over = table_width([lowest[k] for k in shown], gaps) - width
    names = cells.get(name_key, [])
    if over > 0 and name_key in shown and spare and _loses_an_index(names, lowest[name_key] - over) and \
            not _loses_an_index(names, lowest[name_key]):
        # narrowing the name would cut a shown name's layer index (…post_attention_layernorm, which
        # layer?): the spare kept columns give way first, where that alone makes the table fit
        going = []
        for k in (k for k in spare if k in shown):
            going.append(k)
            if table_width([lowest[c] for c in shown if c not in going], gaps) <= width:
                shown = [c for c in shown if c not in going]
                dropped += going
                over = 0
                break
    if over > 0 and name_key in shown:  # the kept columns alone are too wide: the name gives way, down to a floor
        floor = min(lowest[name_key], max(NAME_FLOOR, header_min(headers[name_key])))
        lowest[name_key] = max(floor, lowest[name_key] - over)
    going = []  # still too wide (a narrow terminal): the spare kept columns go, one by one, if that makes it fit
    for k in (k for k in spare if k in shown):
        if table_width([lowest[c] for c in shown if c not in going], gaps) <= width:
            break
        going.append(k)
    if going and table_width([lowest[c] for c in shown if c not in going], gaps) <= width:
        shown = [c for c in shown if c not in going]
        dropped += going
    widths = {k: lowest[k] for k in shown}
    room = width - table_width(list(widths.values()), gaps)
    # spare room: the name's cells first, then the flexible text columns' cells (a check's label on
    # one line before a long header of the name column unwraps), then every header unwrapped
    cells_first = {k: max(widths[k], widest(k)) for k in shown}
    grow = ([(name_key, cells_first)] if name_key in widths else []) + \
        [(k, cells_first) for k in shown if k in flexible] + \
        ([(name_key, natural)] if name_key in widths else []) + [(k, natural) for k in shown if k != name_key]
    for k, target in grow:
        if room <= 0:
            break
        extra = max(0, min(room, target[k] - widths[k]))
        widths[k] += extra
        room -= extra
    out = tuple(widths[k] for k in shown)
    return Fit(columns=tuple(shown), widths=out, dropped=tuple(dropped), width=table_width(list(out), gaps))
