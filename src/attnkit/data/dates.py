"""The embedded demo task: human-written dates -> ISO 8601.

A translation task small enough to train on a CPU in minutes, in which attention's
alignment is plain to see: the target ``"2021-03-03"`` copies its year, month and day from
identifiable spans of the source (``"3 March 2021"``, ``"2021년 3월 3일"``, ``"03/03/2021"``),
and those spans move around from format to format.

Everything is generated in code; nothing is downloaded.

* Source: one calendar date written in one of :data:`FORMATS` (English, German, French,
  Spanish, Korean and numeric forms; weekday names computed with :mod:`datetime`).
* Target: always ``YYYY-MM-DD``.
* Dates are uniform over :data:`DATE_MIN` .. :data:`DATE_MAX` (1950-01-01 .. 2049-12-31)
  and formats uniform over the registry.
* Splits are decided by the *calendar date* (a stable hash of its ISO string, see
  :func:`split_of`), so the valid and test sets hold dates never seen in training, in any
  format.

Ambiguity rules (every source string has exactly one reading):

* Numeric formats use one field order per separator: ``/`` with the year last is US
  month/day/year (``03/03/2021``); ``/`` with the year first is year/month/day
  (``2021/03/03``, a four-digit field first cannot be a month); ``.`` is German
  day.month.year (``3.3.2021``). There is no European ``DD/MM/YYYY``.
* The only two-digit year is ``'yy`` in ``en_short_year``. Since years are drawn from
  1950..2049, ``yy >= 50`` means 19yy and ``yy < 50`` means 20yy (:func:`expand_two_digit_year`).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, timedelta
from functools import cache, lru_cache
from types import MappingProxyType

__all__ = [
    "DATE_MAX",
    "DATE_MIN",
    "FIELDS",
    "FORMATS",
    "SPLITS",
    "TARGET_SPANS",
    "TWO_DIGIT_YEAR_PIVOT",
    "LabelledDate",
    "expand_two_digit_year",
    "field_spans",
    "generate_labelled",
    "generate_pairs",
    "split_of",
    "to_iso",
]

DATE_MIN = date(1950, 1, 1)
DATE_MAX = date(2049, 12, 31)

#: Two-digit years ``yy >= TWO_DIGIT_YEAR_PIVOT`` are 19yy, smaller ones 20yy.
TWO_DIGIT_YEAR_PIVOT = 50

#: Split name -> half-open range of hash buckets out of 100 (90% / 5% / 5%).
SPLITS: Mapping[str, range] = MappingProxyType({"train": range(0, 90), "valid": range(90, 95), "test": range(95, 100)})
_N_BUCKETS = 100

# Name tables, index 0 = January / Monday (``date.weekday()`` numbering). Written out
# rather than taken from ``strftime`` so the output does not depend on the OS locale.
_EN_MONTHS = tuple("January February March April May June July August September October November December".split())
_EN_WEEKDAYS = tuple("Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split())
_DE_MONTHS = tuple("Januar Februar März April Mai Juni Juli August September Oktober November Dezember".split())
_DE_WEEKDAYS = tuple("Montag Dienstag Mittwoch Donnerstag Freitag Samstag Sonntag".split())
_FR_MONTHS = tuple("janvier février mars avril mai juin juillet août septembre octobre novembre décembre".split())
_FR_WEEKDAYS = tuple("lundi mardi mercredi jeudi vendredi samedi dimanche".split())
_ES_MONTHS = tuple("enero febrero marzo abril mayo junio julio agosto septiembre octubre noviembre diciembre".split())
_ES_WEEKDAYS = tuple("lunes martes miércoles jueves viernes sábado domingo".split())
_KO_WEEKDAYS = ("월요일", "화요일", "수요일", "목요일", "금요일", "토요일", "일요일")

_formats: dict[str, Callable[[date], str]] = {}


def _register(name: str) -> Callable[[Callable[[date], str]], Callable[[date], str]]:
    """Add a format function to the registry under ``name`` (names are unique)."""

    def add(fn: Callable[[date], str]) -> Callable[[date], str]:
        if name in _formats:
            raise ValueError(f"date format {name!r} is registered twice")
        _formats[name] = fn
        return fn

    return add


def _en_ordinal(day: int) -> str:
    """English ordinal: 1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, ..., 21st, 22nd, 23rd."""
    if 11 <= day % 100 <= 13:
        return f"{day}th"
    return f"{day}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(day % 10, 'th') }"


# --- English -------------------------------------------------------------------------


@_register("en_long")
def _en_long(d: date) -> str:
    """``March 3, 2021``"""
    return f"{_EN_MONTHS[d.month - 1]} {d.day}, {d.year}"


@_register("en_ordinal")
def _en_ordinal_fmt(d: date) -> str:
    """``March 3rd, 2021``"""
    return f"{_EN_MONTHS[d.month - 1]} {_en_ordinal(d.day)}, {d.year}"


@_register("en_day_month")
def _en_day_month(d: date) -> str:
    """``3 March 2021``"""
    return f"{d.day} {_EN_MONTHS[d.month - 1]} {d.year}"


@_register("en_the_of")
def _en_the_of(d: date) -> str:
    """``the 3rd of March, 2021``"""
    return f"the {_en_ordinal(d.day)} of {_EN_MONTHS[d.month - 1]}, {d.year}"


@_register("en_weekday")
def _en_weekday(d: date) -> str:
    """``Wednesday, March 3, 2021``"""
    return f"{_EN_WEEKDAYS[d.weekday()]}, {_EN_MONTHS[d.month - 1]} {d.day}, {d.year}"


@_register("en_abbrev")
def _en_abbrev(d: date) -> str:
    """``Mar 3 2021``"""
    return f"{_EN_MONTHS[d.month - 1][:3]} {d.day} {d.year}"


@_register("en_short_year")
def _en_short_year(d: date) -> str:
    """``3 Mar '21`` (two-digit year: see :func:`expand_two_digit_year`)."""
    return f"{d.day} {_EN_MONTHS[d.month - 1][:3]} '{d.year % 100:02d}"


# --- Numeric -------------------------------------------------------------------------


@_register("us_numeric")
def _us_numeric(d: date) -> str:
    """``03/03/2021`` (US month/day/year; the only year-last format using ``/``)."""
    return f"{d.month:02d}/{d.day:02d}/{d.year}"


@_register("ymd_slash")
def _ymd_slash(d: date) -> str:
    """``2021/03/03`` (year first, so it cannot be read as month/day)."""
    return f"{d.year}/{d.month:02d}/{d.day:02d}"


@_register("de_numeric")
def _de_numeric(d: date) -> str:
    """``3.3.2021`` (German day.month.year; the only format using ``.`` as separator)."""
    return f"{d.day}.{d.month}.{d.year}"


# --- German --------------------------------------------------------------------------


@_register("de_long")
def _de_long(d: date) -> str:
    """``3. März 2021``"""
    return f"{d.day}. {_DE_MONTHS[d.month - 1]} {d.year}"


@_register("de_weekday")
def _de_weekday(d: date) -> str:
    """``Mittwoch, 3. März 2021``"""
    return f"{_DE_WEEKDAYS[d.weekday()]}, {d.day}. {_DE_MONTHS[d.month - 1]} {d.year}"


# --- French --------------------------------------------------------------------------


def _fr_day(day: int) -> str:
    """French writes the first of the month as an ordinal: ``1er``."""
    return "1er" if day == 1 else str(day)


@_register("fr_long")
def _fr_long(d: date) -> str:
    """``3 mars 2021`` (``1er mars 2021`` on the first)."""
    return f"{_fr_day(d.day)} {_FR_MONTHS[d.month - 1]} {d.year}"


@_register("fr_weekday")
def _fr_weekday(d: date) -> str:
    """``mercredi 3 mars 2021``"""
    return f"{_FR_WEEKDAYS[d.weekday()]} {_fr_day(d.day)} {_FR_MONTHS[d.month - 1]} {d.year}"


# --- Spanish -------------------------------------------------------------------------


@_register("es_long")
def _es_long(d: date) -> str:
    """``3 de marzo de 2021``"""
    return f"{d.day} de {_ES_MONTHS[d.month - 1]} de {d.year}"


@_register("es_weekday")
def _es_weekday(d: date) -> str:
    """``miércoles, 3 de marzo de 2021``"""
    return f"{_ES_WEEKDAYS[d.weekday()]}, {d.day} de {_ES_MONTHS[d.month - 1]} de {d.year}"


# --- Korean --------------------------------------------------------------------------


@_register("ko_long")
def _ko_long(d: date) -> str:
    """``2021년 3월 3일``"""
    return f"{d.year}년 {d.month}월 {d.day}일"


@_register("ko_weekday")
def _ko_weekday(d: date) -> str:
    """``2021년 3월 3일 수요일``"""
    return f"{d.year}년 {d.month}월 {d.day}일 {_KO_WEEKDAYS[d.weekday()]}"


#: Format name -> ``callable(date) -> str``. Read-only; insertion order is part of the
#: data definition (``generate_pairs`` draws format indices from it).
FORMATS: Mapping[str, Callable[[date], str]] = MappingProxyType(_formats)


def expand_two_digit_year(yy: int) -> int:
    """Century rule for ``'yy`` years: ``yy >= 50`` -> 19yy, ``yy < 50`` -> 20yy.

    It is exact for this task because every year lies in 1950..2049.

    :param yy: two-digit year, 0..99.
    """
    if not 0 <= yy <= 99:
        raise ValueError(f"a two-digit year must be in 0..99, got {yy}")
    return 1900 + yy if yy >= TWO_DIGIT_YEAR_PIVOT else 2000 + yy


def to_iso(d: date) -> str:
    """The target side: ``YYYY-MM-DD``."""
    return d.isoformat()


def split_of(d: date) -> str:
    """Which split a calendar date belongs to: ``"train"``, ``"valid"`` or ``"test"``.

    Bucket = first 8 bytes of SHA-256 of the ISO string, modulo 100; buckets 0..89 are
    train, 90..94 valid, 95..99 test. Stable across runs, machines and Python versions
    (unlike the built-in ``hash``).
    """
    digest = hashlib.sha256(d.isoformat().encode("ascii")).digest()
    bucket = int.from_bytes(digest[:8], "big") % _N_BUCKETS
    for name, buckets in SPLITS.items():
        if bucket in buckets:
            return name
    raise AssertionError(f"bucket {bucket} is in no split of {dict(SPLITS)}")  # unreachable


@lru_cache(maxsize=len(SPLITS))
def _dates_in_split(split: str) -> tuple[date, ...]:
    """All dates of DATE_MIN..DATE_MAX in ``split``, in calendar order (~36.5k hashes once)."""
    n_days = (DATE_MAX - DATE_MIN).days + 1
    all_days = (DATE_MIN + timedelta(days=i) for i in range(n_days))
    return tuple(d for d in all_days if split_of(d) == split)


def _draw(n: int, seed: int, split: str, formats: Sequence[str] | None) -> list[tuple[date, str]]:
    """``n`` (date, format name) draws; checks the arguments (see :func:`generate_pairs`)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    names = list(FORMATS) if formats is None else list(formats)
    if not names:
        raise ValueError("formats is empty; pass at least one name from attnkit.data.dates.FORMATS")
    unknown = [name for name in names if name not in FORMATS]
    if unknown:
        raise ValueError(f"unknown date format(s) {unknown}; known formats: {', '.join(FORMATS)}")

    pool = _dates_in_split(split)
    rng = random.Random(seed)
    draws = []
    for _ in range(n):
        d = pool[rng.randrange(len(pool))]
        draws.append((d, names[rng.randrange(len(names))]))
    return draws


def generate_pairs(
    n: int,
    *,
    seed: int,
    split: str = "train",
    formats: Sequence[str] | None = None,
) -> list[tuple[str, str]]:
    """Generate ``n`` (source, target) pairs, e.g. ``("3. März 2021", "2021-03-03")``.

    Dates are drawn with replacement, uniformly among the dates of ``split`` (so uniform
    over 1950..2049 within the split); the format is drawn uniformly from ``formats``.
    The result depends only on ``(n, seed, split, formats)``: the same arguments give the
    same list, and a longer list extends a shorter one with the same seed.

    :param n: number of pairs, >= 0.
    :param seed: seed of a private :class:`random.Random` (global RNG state is untouched).
    :param split: ``"train"``, ``"valid"`` or ``"test"``; splits share no calendar date.
    :param formats: names from :data:`FORMATS` to draw from; default all of them.
    :return: list of ``(source, "YYYY-MM-DD")`` tuples.
    """
    return [(FORMATS[name](d), to_iso(d)) for d, name in _draw(n, seed, split, formats)]


# --- Field spans: where the year, month and day are written (to label alignment) ------------

#: The three fields every source writes and every target copies.
FIELDS = ("year", "month", "day")

#: A date whose year, month and day are written differently from one another in every
#: format (no field's text equals another's), used to learn each format's field order.
_PROBE = date(1987, 10, 25)

#: A digit run with any letters glued to it (``3rd``, ``1er``, ``2021년``: the letters are a
#: suffix of the number, not a field of their own), or a run of letters (a month or weekday name).
_RUN = re.compile(r"(\d+)[^\W\d_]*|([^\W\d_]+)")


def _runs(text: str) -> list[tuple[str, int, int]]:
    """``(text, start, end)`` of every number (without its suffix) and every word in ``text``."""
    return [(m[0], m.start(), m.end()) if m[1] is None else (m[1], m.start(1), m.end(1)) for m in _RUN.finditer(text)]


def _probe_labels(d: date) -> dict[str, str]:
    """How each field of ``d`` can be written: run text -> field name."""
    labels = {str(d.year): "year", f"{d.year % 100:02d}": "year", str(d.day): "day"}
    for text in (str(d.month), f"{d.month:02d}", *(t[d.month - 1] for t in (_EN_MONTHS, _DE_MONTHS, _FR_MONTHS,
                                                                            _ES_MONTHS)), _EN_MONTHS[d.month - 1][:3]):
        labels[text] = "month"
    return labels


@cache
def _field_order(name: str) -> tuple[str | None, ...]:
    """The field (or None: weekday, ``de``, ``the``...) of each run of format ``name``, read off :data:`_PROBE`."""
    labels = _probe_labels(_PROBE)
    order = tuple(labels.get(text) for text, _, _ in _runs(FORMATS[name](_PROBE)))
    if sorted(f for f in order if f) != sorted(FIELDS):
        raise AssertionError(f"format {name!r} writes the fields {order} for {_PROBE}; expected each of {FIELDS} once")
    return order


def field_spans(d: date, name: str) -> tuple[str, dict[str, tuple[int, int]]]:
    """Source text of ``d`` in format ``name`` and the character span ``[start, end)`` of each field.

    A number's span excludes a glued suffix (``3`` of ``3rd``, ``2021`` of ``2021년``); a month
    written as a name spans the name (``March``, ``Mar``).

    >>> field_spans(date(2021, 3, 3), "de_long")
    ('3. März 2021', {'day': (0, 1), 'month': (3, 7), 'year': (8, 12)})
    """
    text = FORMATS[name](d)
    runs = _runs(text)
    order = _field_order(name)
    if len(runs) != len(order):
        raise AssertionError(f"{text!r} ({name}) has {len(runs)} runs, the format's probe {len(order)}")
    return text, {field: (start, end) for field, (_, start, end) in zip(order, runs, strict=True) if field}


#: Character span ``[start, end)`` of each field in the target ``YYYY-MM-DD``.
TARGET_SPANS: Mapping[str, tuple[int, int]] = MappingProxyType({"year": (0, 4), "month": (5, 7), "day": (8, 10)})


@dataclass(frozen=True)
class LabelledDate:
    """A generated pair with the source span of each field (see :func:`field_spans`)."""

    source: str
    target: str
    format: str
    spans: dict[str, tuple[int, int]]


def generate_labelled(n: int, *, seed: int, split: str = "train",
                      formats: Sequence[str] | None = None) -> list[LabelledDate]:
    """:func:`generate_pairs` (the very same pairs for the same arguments) with field spans and format names."""
    out = []
    for d, name in _draw(n, seed, split, formats):
        text, spans = field_spans(d, name)
        out.append(LabelledDate(text, to_iso(d), name, spans))
    return out
