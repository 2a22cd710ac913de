"""Corrupt expert-count files (``routing_model.load_counts``): every one is a TraceError
naming the file (and the line, for CSV), never numpy's or Python's own exception."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from xds.errors import TraceError
from xds.serve.eplb.routing_model import load_counts

HEADER = "time_slice,layer,expert,count\n"


def _npy(arr: np.ndarray, **kw: object) -> Callable[[Path], Path]:
    def write(d: Path) -> Path:
        p = d / "c.npy"
        np.save(p, arr, **kw)  # type: ignore[arg-type]
        return p

    return write


def _cut(keep: int) -> Callable[[Path], Path]:
    """A valid .npy cut short, keeping ``keep`` bytes (negative: all but that many)."""

    def write(d: Path) -> Path:
        p = d / "c.npy"
        np.save(p, np.arange(24).reshape(2, 3, 4))
        p.write_bytes(p.read_bytes()[:keep])
        return p

    return write


def _bytes(name: str, data: bytes) -> Callable[[Path], Path]:
    def write(d: Path) -> Path:
        p = d / name
        p.write_bytes(data)
        return p

    return write


def _npz(d: Path) -> Path:
    np.savez(d / "c", a=np.ones((1, 2, 3), np.int64))
    return (d / "c.npz").rename(d / "c.npy")


def _dir(d: Path) -> Path:
    (d / "c.npy").mkdir()
    return d / "c.npy"


NPY = {
    "empty": (_bytes("c.npy", b""), r"c\.npy: empty file"),
    "truncated_header": (_cut(20), r"c\.npy: not a readable \.npy array \(truncated or corrupt"),
    "truncated_data": (_cut(-10), r"c\.npy: not a readable \.npy array \(truncated or corrupt"),
    "text": (_bytes("c.npy", b"time_slice,layer\n"), r"c\.npy: not a \.npy file \(it lacks"),
    "npz_archive": (_npz, r"c\.npy: an \.npz archive, not one \.npy array"),
    "pickled_objects": (
        _npy(np.array([[[1, None]]], dtype=object), allow_pickle=True),
        r"c\.npy: holds Python objects, not numbers",
    ),
    "strings": (_npy(np.array([[["a", "b"]]])), r"c\.npy: counts must be numbers, got <U1"),
    "bools": (_npy(np.ones((1, 2, 3), bool)), r"c\.npy: counts must be numbers, got bool"),
    "two_dims": (
        _npy(np.ones((3, 4), np.int64)),
        r"c\.npy: expected a \[time_slice, layer, expert\] array, got shape \(3, 4\)",
    ),
    "no_counts": (_npy(np.zeros((0, 2, 3), np.int64)), r"c\.npy: no counts \(shape \(0, 2, 3\)\)"),
    "negative": (
        _npy(np.array([[[1, 2], [3, -4]]])),
        r"c\.npy: count at \[0, 1, 1\] is -4, must be >= 0",
    ),
    "nan": (
        _npy(np.array([[[1.0, np.nan]]])),
        r"c\.npy: count at \[0, 0, 1\] is nan, not a whole number",
    ),
    "inf": (
        _npy(np.array([[[np.inf, 1.0]]])),
        r"c\.npy: count at \[0, 0, 0\] is inf, not a whole number",
    ),
    "fraction": (
        _npy(np.array([[[1.0, 2.5]]])),
        r"c\.npy: count at \[0, 0, 1\] is 2\.5, not a whole number",
    ),
    "too_large": (
        _npy(np.array([[[2**64 - 1]]], np.uint64)),
        r"c\.npy: count at \[0, 0, 0\] is 18446744073709551615, too large",
    ),
    "float_2_63": (  # 2**63 as a float compares equal to int64's max, which it exceeds
        _npy(np.array([[[1.0, 2.0**63, 1.0]]])),
        r"c\.npy: count at \[0, 0, 1\] is 9\.223372036854776e\+18, too large",
    ),
    "directory": (_dir, r"c\.npy: cannot read"),
}


def _csv(text: str, name: str = "c.csv") -> Callable[[Path], Path]:
    return _bytes(name, text.encode())


CSV = {
    "empty": (_csv(""), r"c\.csv:line 1: empty file \(expected the header"),
    "header_only": (_csv(HEADER), r"c\.csv: no counts"),
    "bad_header": (_csv("t,l,e,c\n0,0,0,1\n"), r"c\.csv:line 1: header must be"),
    "json": (
        _csv('{"counts": [[[1]]]}', "c.json"),
        r"c\.json:line 1: header must be .*\(counts files are \.npy, or CSV",
    ),
    "truncated_row": (_csv(HEADER + "0,0,1,5\n0,0,"), r"c\.csv:line 3: expected 4 fields, got 3"),
    "non_numeric": (_csv(HEADER + "0,x,1,5\n"), r"c\.csv:line 2 field 'layer': not an integer"),
    "empty_cell": (_csv(HEADER + "0,0,,5\n"), r"c\.csv:line 2 field 'expert': not an integer"),
    "nan": (_csv(HEADER + "0,0,1,nan\n"), r"c\.csv:line 2 field 'count': not an integer"),
    "fraction": (_csv(HEADER + "0,0,1,1.5\n"), r"c\.csv:line 2 field 'count': not an integer"),
    "negative": (_csv(HEADER + "0,0,1,-5\n"), r"c\.csv:line 2 field 'count': must be >= 0"),
    "superscript": (_csv(HEADER + "0,0,1,\u00b2\n"), r"c\.csv:line 2 field 'count': not an"),
    "underscore": (_csv(HEADER + "0,0,1,1_000\n"), r"c\.csv:line 2 field 'count': not an"),
    "huge_index": (
        _csv(HEADER + "0,0,1,5\n0,0,1000000000000,5\n"),
        r"c\.csv:line 3 field 'expert': 1000000000000 would make a counts array of "
        r"1,000,000,000,001 cells \(at most",
    ),
    "thousands_of_digits": (
        _csv(HEADER + "0,0,1," + "9" * 5000 + "\n"),
        r"c\.csv:line 2 field 'count': 9+ is too large",
    ),
    "huge_count": (
        _csv(HEADER + "0,0,1,99999999999999999999999\n"),
        r"c\.csv:line 2 field 'count': 99999999999999999999999 is too large",
    ),
    "overflowing_sum": (
        _csv(HEADER + f"0,0,1,{2**62}\n0,0,1,{2**62}\n"),
        r"c\.csv:line 3 field 'count': the counts for \(0, 0, 1\) add up to more than",
    ),
    "binary": (
        _bytes("c.csv", HEADER.encode() + b"0,0,1,5\n\xff\xfe,0,0,1\n"),
        r"c\.csv:line 3: not UTF-8 text",
    ),
    "directory": (lambda d: (d / "c.csv").mkdir() or d / "c.csv", r"c\.csv: cannot read"),
}


@pytest.mark.parametrize("case", sorted(NPY))
def test_every_corrupt_npy_file_is_a_trace_error_naming_the_file(case, tmp_path):
    write, message = NPY[case]
    path = write(tmp_path)
    with pytest.raises(TraceError, match=message) as err:
        load_counts(path)
    assert err.value.path == str(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("case", sorted(CSV))
def test_every_corrupt_csv_file_is_a_trace_error_naming_file_and_line(case, tmp_path):
    write, message = CSV[case]
    path = write(tmp_path)
    with pytest.raises(TraceError, match=message) as err:
        load_counts(path)
    assert err.value.path == str(path)
    found = re.search(r":line (\d+)", message)
    assert err.value.line == (int(found.group(1)) if found else None)
    assert "\n" not in str(err.value)


def test_good_files_still_load(tmp_path):
    """Whole-number floats in a .npy are counts too; a CSV may start with a byte-order mark,
    end lines with CRLF, pad fields with spaces and repeat a cell (the rows add up)."""
    arr = np.arange(24).reshape(2, 3, 4)
    np.save(tmp_path / "f.npy", arr.astype(np.float64))
    got = load_counts(tmp_path / "f.npy")
    assert got.dtype == np.int64 and np.array_equal(got, arr)
    csv = tmp_path / "c.csv"
    csv.write_bytes(
        b"\xef\xbb\xbf" + HEADER.encode().replace(b"\n", b"\r\n") + b"0, 0, 1, 5\r\n1,2,3,7\r\n"
        b"\r\n0,0,1,2\r\n"
    )
    got = load_counts(csv)
    assert got.shape == (2, 3, 4) and got[0, 0, 1] == 7 and got[1, 2, 3] == 7
    assert got.sum() == 14


@given(cut=st.integers(0, 200))
def test_a_npy_file_cut_anywhere_is_a_trace_error_naming_it(cut, tmp_path_factory):
    """Cut at any byte (the array's data runs to the end of the file, so every cut loses
    some of it), a .npy file fails with the file named."""
    d = tmp_path_factory.mktemp("cut")
    p = d / "c.npy"
    np.save(p, np.arange(24).reshape(2, 3, 4))
    data = p.read_bytes()
    p.write_bytes(data[: min(cut, len(data) - 1)])
    with pytest.raises(TraceError, match=re.escape(str(p))):
        load_counts(p)
