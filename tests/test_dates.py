"""Tests for attnkit.data.dates: golden strings, round trips through an independent parser,
unambiguity across formats, date-disjoint splits and determinism."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from datetime import date, datetime, timedelta

import pytest

from attnkit.data import dates
from attnkit.data.dates import FORMATS, generate_pairs, split_of

# --- An independent reference parser ----------------------------------------------------
# Month and weekday names are typed here again rather than imported, so a typo in the
# module's tables shows up as a failed parse. English numeric forms use datetime.strptime.

_DE_MONTHS = "Januar Februar März April Mai Juni Juli August September Oktober November Dezember"
_FR_MONTHS = "janvier février mars avril mai juin juillet août septembre octobre novembre décembre"
_ES_MONTHS = "enero febrero marzo abril mayo junio julio agosto septiembre octubre noviembre diciembre"
_MONTH = {
    lang: {name: i + 1 for i, name in enumerate(names.split())}
    for lang, names in {"de": _DE_MONTHS, "fr": _FR_MONTHS, "es": _ES_MONTHS}.items()
}
_WEEKDAY = {  # Monday first, as date.weekday()
    "en": "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split(),
    "de": "Montag Dienstag Mittwoch Donnerstag Freitag Samstag Sonntag".split(),
    "fr": "lundi mardi mercredi jeudi vendredi samedi dimanche".split(),
    "es": "lunes martes miércoles jueves viernes sábado domingo".split(),
    "ko": "월요일 화요일 수요일 목요일 금요일 토요일 일요일".split(),
}


def _strptime(fmt: str) -> Callable[[str], date | None]:
    def parse(s: str) -> date | None:
        try:
            return datetime.strptime(s, fmt).date()
        except ValueError:
            return None

    return parse


def _ordinal_ok(day: str, suffix: str) -> bool:
    n = int(day)
    return suffix == ("th" if 11 <= n <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th"))


def _en_ordinal(s: str) -> date | None:
    """``March 3rd, 2021``"""
    m = re.fullmatch(r"([A-Z][a-z]+) (\d{1,2})(st|nd|rd|th), (\d{4})", s)
    if m is None or not _ordinal_ok(m[2], m[3]):
        return None
    return _strptime("%B %d %Y")(f"{m[1]} {m[2]} {m[4]}")


def _en_the_of(s: str) -> date | None:
    """``the 3rd of March, 2021``"""
    m = re.fullmatch(r"the (\d{1,2})(st|nd|rd|th) of ([A-Z][a-z]+), (\d{4})", s)
    if m is None or not _ordinal_ok(m[1], m[2]):
        return None
    return _strptime("%d %B %Y")(f"{m[1]} {m[3]} {m[4]}")


def _en_short_year(s: str) -> date | None:
    m = re.fullmatch(r"(\d{1,2}) ([A-Z][a-z]{2}) '(\d{2})", s)
    if m is None:
        return None
    yy = int(m[3])
    year = 1900 + yy if yy >= 50 else 2000 + yy  # the documented rule, restated
    return _strptime("%d %b %Y")(f"{m[1]} {m[2]} {year}")


def _named(pattern: str, lang: str, weekday: bool = False) -> Callable[[str], date | None]:
    """Regex with named groups d, m (a month name), y and optionally w (weekday name)."""

    def parse(s: str) -> date | None:
        m = re.fullmatch(pattern, s)
        if m is None or m["m"] not in _MONTH[lang]:
            return None
        day = 1 if m["d"] == "1er" else int(m["d"])
        try:
            d = date(int(m["y"]), _MONTH[lang][m["m"]], day)
        except ValueError:
            return None
        if weekday and m["w"] != _WEEKDAY[lang][d.weekday()]:
            return None
        return d

    return parse


def _korean(s: str) -> date | None:
    m = re.fullmatch(r"(\d{4})년 (\d{1,2})월 (\d{1,2})일(?: (\S+))?", s)
    if m is None:
        return None
    d = date(int(m[1]), int(m[2]), int(m[3]))
    if m[4] is not None and m[4] != _WEEKDAY["ko"][d.weekday()]:
        return None
    return d


def _en_weekday(s: str) -> date | None:
    d = _strptime("%A, %B %d, %Y")(s)
    return d if d is not None and s.split(",")[0] == _WEEKDAY["en"][d.weekday()] else None


_PARSERS: list[Callable[[str], date | None]] = [
    _strptime("%B %d, %Y"),  # March 3, 2021
    _strptime("%d %B %Y"),  # 3 March 2021
    _strptime("%b %d %Y"),  # Mar 3 2021
    _en_weekday,
    _en_ordinal,
    _en_the_of,
    _en_short_year,
    _strptime("%m/%d/%Y"),  # US
    _strptime("%Y/%m/%d"),
    _strptime("%d.%m.%Y"),  # German numeric
    _named(r"(?P<d>\d{1,2})\. (?P<m>\w+) (?P<y>\d{4})", "de"),
    _named(r"(?P<w>\w+), (?P<d>\d{1,2})\. (?P<m>\w+) (?P<y>\d{4})", "de", weekday=True),
    _named(r"(?P<d>1er|\d{1,2}) (?P<m>\w+) (?P<y>\d{4})", "fr"),
    _named(r"(?P<w>\w+) (?P<d>1er|\d{1,2}) (?P<m>\w+) (?P<y>\d{4})", "fr", weekday=True),
    _named(r"(?P<d>\d{1,2}) de (?P<m>\w+) de (?P<y>\d{4})", "es"),
    _named(r"(?P<w>\w+), (?P<d>\d{1,2}) de (?P<m>\w+) de (?P<y>\d{4})", "es", weekday=True),
    _korean,
]


def readings(s: str) -> set[date]:
    """Every date some reference parser reads ``s`` as; a well-formed source has exactly one."""
    return {d for parse in _PARSERS if (d := parse(s)) is not None}


# --- Tests ---------------------------------------------------------------------------------

GOLDEN_2021_03_03 = {  # a Wednesday
    "en_long": "March 3, 2021",
    "en_ordinal": "March 3rd, 2021",
    "en_day_month": "3 March 2021",
    "en_the_of": "the 3rd of March, 2021",
    "en_weekday": "Wednesday, March 3, 2021",
    "en_abbrev": "Mar 3 2021",
    "en_short_year": "3 Mar '21",
    "us_numeric": "03/03/2021",
    "ymd_slash": "2021/03/03",
    "de_numeric": "3.3.2021",
    "de_long": "3. März 2021",
    "de_weekday": "Mittwoch, 3. März 2021",
    "fr_long": "3 mars 2021",
    "fr_weekday": "mercredi 3 mars 2021",
    "es_long": "3 de marzo de 2021",
    "es_weekday": "miércoles, 3 de marzo de 2021",
    "ko_long": "2021년 3월 3일",
    "ko_weekday": "2021년 3월 3일 수요일",
}


def test_golden_strings_for_one_date() -> None:
    d = date(2021, 3, 3)
    assert {name: fmt(d) for name, fmt in FORMATS.items()} == GOLDEN_2021_03_03


def test_registry_covers_languages_and_is_read_only() -> None:
    assert 15 <= len(FORMATS) <= 20
    assert {name.split("_")[0] for name in FORMATS} >= {"en", "de", "fr", "es", "ko", "us"}
    with pytest.raises(TypeError):
        FORMATS["x"] = str  # type: ignore[index]


@pytest.mark.parametrize(
    ("d", "name", "expected"),
    [
        (date(1999, 12, 11), "en_ordinal", "December 11th, 1999"),
        (date(1999, 12, 12), "en_the_of", "the 12th of December, 1999"),
        (date(1999, 12, 13), "en_ordinal", "December 13th, 1999"),
        (date(1999, 12, 21), "en_ordinal", "December 21st, 1999"),
        (date(1999, 12, 22), "en_ordinal", "December 22nd, 1999"),
        (date(1999, 12, 23), "en_the_of", "the 23rd of December, 1999"),
        (date(1950, 1, 1), "fr_weekday", "dimanche 1er janvier 1950"),
        (date(1950, 1, 1), "en_short_year", "1 Jan '50"),
        (date(2049, 12, 31), "en_short_year", "31 Dec '49"),
        (date(2000, 2, 29), "de_weekday", "Dienstag, 29. Februar 2000"),
        (date(2024, 8, 15), "es_weekday", "jueves, 15 de agosto de 2024"),
        (date(2024, 8, 15), "ko_weekday", "2024년 8월 15일 목요일"),
    ],
)
def test_edge_cases(d: date, name: str, expected: str) -> None:
    assert FORMATS[name](d) == expected


def test_two_digit_year_rule() -> None:
    assert dates.expand_two_digit_year(50) == 1950
    assert dates.expand_two_digit_year(99) == 1999
    assert dates.expand_two_digit_year(0) == 2000
    assert dates.expand_two_digit_year(49) == 2049
    with pytest.raises(ValueError, match="0..99"):
        dates.expand_two_digit_year(100)


def _sample_dates(n: int) -> list[date]:
    """Evenly spread dates over the whole range, plus its ends and a leap day."""
    span = (dates.DATE_MAX - dates.DATE_MIN).days
    picked = [dates.DATE_MIN + timedelta(days=span * i // (n - 1)) for i in range(n)]
    return picked + [date(2000, 2, 29), date(1999, 12, 31), date(2000, 1, 1)]


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_format_round_trips_and_is_unambiguous(name: str) -> None:
    fmt = FORMATS[name]
    for d in _sample_dates(150):
        s = fmt(d)
        assert s and s == s.strip()
        assert readings(s) == {d}, f"{name}: {s!r} reads as {readings(s)}, expected {{{d}}}"


def test_generated_pairs_round_trip() -> None:
    for src, tgt in generate_pairs(1000, seed=1, split="train"):
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", tgt)
        assert readings(src) == {date.fromisoformat(tgt)}, src


def test_determinism_and_prefix_property() -> None:
    a = generate_pairs(500, seed=7, split="valid")
    assert a == generate_pairs(500, seed=7, split="valid")
    assert generate_pairs(100, seed=7, split="valid") == a[:100]
    assert a != generate_pairs(500, seed=8, split="valid")
    assert generate_pairs(0, seed=7) == []


def test_splits_are_disjoint_by_date_and_roughly_90_5_5() -> None:
    seen = {s: {tgt for _, tgt in generate_pairs(2000, seed=3, split=s)} for s in dates.SPLITS}
    assert not seen["train"] & seen["valid"]
    assert not seen["train"] & seen["test"]
    assert not seen["valid"] & seen["test"]
    for s, isos in seen.items():
        assert all(split_of(date.fromisoformat(iso)) == s for iso in isos)

    counts = Counter(split_of(dates.DATE_MIN + timedelta(days=i)) for i in range(0, 36524, 3))
    total = sum(counts.values())
    assert 0.88 < counts["train"] / total < 0.92
    assert 0.04 < counts["valid"] / total < 0.06
    assert 0.04 < counts["test"] / total < 0.06


def test_split_of_is_pinned() -> None:
    # Hard-coded on purpose: changing the hash silently reshuffles every saved experiment's splits.
    held_out = {
        "2021-01-14": "test",
        "2021-01-19": "valid",
        "2021-02-01": "valid",
        "2021-02-05": "test",
        "2021-02-07": "test",
        "2021-02-20": "test",
        "2021-02-21": "valid",
        "2021-02-23": "test",
    }
    for i in range(40):
        d = date(2021, 1, 1) + timedelta(days=i)
        assert split_of(d) == held_out.get(d.isoformat(), "train"), d


def test_variety() -> None:
    pairs = generate_pairs(3000, seed=0)
    by_format = Counter(
        next(name for name, fmt in FORMATS.items() if fmt(date.fromisoformat(tgt)) == src) for src, tgt in pairs
    )
    assert set(by_format) == set(FORMATS)
    expected = len(pairs) / len(FORMATS)
    assert all(0.6 * expected < c < 1.4 * expected for c in by_format.values()), by_format
    targets = [tgt for _, tgt in pairs]
    assert len(set(targets)) > 2800  # ~32.9k train dates: few repeats
    years = Counter(int(t[:4]) for t in targets)
    assert min(years) < 1955 and max(years) > 2044
    assert sum(c for y, c in years.items() if y < 2000) == pytest.approx(len(pairs) / 2, rel=0.1)
    assert {int(t[5:7]) for t in targets} == set(range(1, 13))


def test_restricting_formats() -> None:
    pairs = generate_pairs(200, seed=0, formats=["ko_long", "us_numeric"])
    assert all(re.fullmatch(r"\d{4}년 .*|\d{2}/\d{2}/\d{4}", src) for src, _ in pairs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": -1}, "n must be >= 0"),
        ({"n": 1, "split": "dev"}, "unknown split 'dev'"),
        ({"n": 1, "formats": ["klingon"]}, "unknown date format"),
        ({"n": 1, "formats": []}, "formats is empty"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        generate_pairs(seed=0, **kwargs)


# --- Field spans ----------------------------------------------------------------------------


def test_field_spans_golden() -> None:
    text, spans = dates.field_spans(date(2021, 3, 3), "es_weekday")
    assert text == "miércoles, 3 de marzo de 2021"
    assert {f: text[a:b] for f, (a, b) in spans.items()} == {"day": "3", "month": "marzo", "year": "2021"}
    text, spans = dates.field_spans(date(1950, 1, 1), "fr_weekday")  # "1er": the suffix is not the day
    assert {f: text[a:b] for f, (a, b) in spans.items()} == {"day": "1", "month": "janvier", "year": "1950"}
    text, spans = dates.field_spans(date(2049, 12, 31), "en_short_year")
    assert {f: text[a:b] for f, (a, b) in spans.items()} == {"day": "31", "month": "Dec", "year": "49"}
    assert {f: "2049-12-31"[a:b] for f, (a, b) in dates.TARGET_SPANS.items()} == {"year": "2049", "month": "12",
                                                                                   "day": "31"}


@pytest.mark.parametrize("name", list(FORMATS))
def test_field_spans_hold_the_fields_in_every_format(name: str) -> None:
    """The text in each span reads back as that field of the date (numbers, or the month's name)."""
    month_names = {}
    for names in (_DE_MONTHS, _FR_MONTHS, _ES_MONTHS,
                  "January February March April May June July August September October November December"):
        for i, m in enumerate(names.split()):
            month_names[m] = month_names[m[:3]] = i + 1
    for d in _sample_dates(60):
        text, spans = dates.field_spans(d, name)
        assert text == FORMATS[name](d) and set(spans) == set(dates.FIELDS)
        got = {f: text[a:b] for f, (a, b) in spans.items()}
        year = int(got["year"]) if len(got["year"]) == 4 else dates.expand_two_digit_year(int(got["year"]))
        month = int(got["month"]) if got["month"].isdigit() else month_names[got["month"]]
        assert (year, month, int(got["day"])) == (d.year, d.month, d.day), (name, text, got)
        ordered = sorted(spans.values())
        assert all(end <= start for (_, end), (start, _) in zip(ordered, ordered[1:], strict=False))  # disjoint


def test_generate_labelled_are_the_generated_pairs() -> None:
    labelled = dates.generate_labelled(200, seed=4, split="test")
    assert [(x.source, x.target) for x in labelled] == generate_pairs(200, seed=4, split="test")
    assert {x.format for x in labelled} == set(FORMATS)
