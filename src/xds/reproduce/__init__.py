"""``xds reproduce``: the paper's measured results beside what xds predicts (SPEC 12).

Every target runs the modelled mechanisms and reports rows of ``(name, paper, xds, unit,
relation, tolerance)``. Nothing in a target is set to the paper's value: the numbers come out
of the model's costs (hardware parameters and documented emulator choices).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import msgspec

from ..errors import ConfigError

Relation = Literal["approx", "lt", "gt"]


class Row(msgspec.Struct, frozen=True):
    """One result: the paper's number, xds's number, and how they must relate."""

    name: str
    paper: float
    xds: float
    unit: str
    relation: Relation
    tolerance: float = 0.0
    shown: str = ""
    """How the human table shows ``xds`` when a number alone would mislead (e.g. a crossover
    that does not exist); empty: the number."""

    @property
    def ok(self) -> bool:
        if self.relation == "lt":
            return self.xds < self.paper
        if self.relation == "gt":
            return self.xds > self.paper
        return abs(self.xds - self.paper) <= self.tolerance * abs(self.paper)


class TableData(msgspec.Struct, frozen=True):
    """A table a target prints besides its rows (e.g. the full Figure 5 grid)."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    notes: list[str] = []


class Result(msgspec.Struct):
    target: str
    wall_s: float
    rows: list[Row]
    tables: list[TableData] = []
    quick: bool = False
    """A ``--quick`` smoke run on a smaller configuration: its rows are not the paper's."""

    def to_json_object(self) -> dict[str, object]:
        """The ``--json`` object of ARCHITECTURE.md (target, wall_s, rows), with ``quick``
        set for a ``--quick`` run (whose rows a script must not take for the paper's; their
        ``ok`` is null)."""
        out: dict[str, object] = {
            "target": self.target,
            "wall_s": round(self.wall_s, 3),
            "rows": [_row_json(r, judged=not self.quick) for r in self.rows],
        }
        if self.quick:
            out["quick"] = True
        return out


def _row_json(row: Row, *, judged: bool = True) -> dict[str, object]:
    """A row's JSON object with its verdict ``ok`` (null for a ``--quick`` run, whose
    smaller configuration is not judged); ``shown`` only where the number alone would
    mislead."""
    out = msgspec.to_builtins(row)
    if not row.shown:
        del out["shown"]
    out["ok"] = row.ok if judged else None  # the verdict the table prints
    return out


QUICK = {"peak-decode", "production"}
"""Targets with a shorter ``--quick`` variant."""

TargetFn = Callable[..., tuple[list[Row], list[TableData]]]


def _targets() -> dict[str, TargetFn]:
    from . import a2e_e2a, dispatch_combine, eplb, ma_decode, p2p, peak_decode, production

    return {
        "p2p": p2p.reproduce,
        "dispatch-combine": dispatch_combine.reproduce,
        "a2e-e2a": a2e_e2a.reproduce,
        "peak-decode": peak_decode.reproduce,
        "ma-decode": ma_decode.reproduce,
        "eplb": eplb.reproduce,
        "production": production.reproduce,
    }


def target_names() -> list[str]:
    return list(_targets())


def run_target(name: str, *, quick: bool = False) -> Result:
    """Run one target and time it (wall clock: how long the simulator took). ``quick`` runs
    a short variant where a target has one (:data:`QUICK`)."""
    targets = _targets()
    if name not in targets:
        import difflib

        close = difflib.get_close_matches(name.replace("_", "-"), [*targets, "all"], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"unknown target {name!r}{hint}; choose one of {', '.join(targets)} or 'all'",
            field="target",
        )
    wall = time.perf_counter()  # noqa: TID251 - reports the simulator's own run time
    fn = targets[name]
    short = quick and name in QUICK
    rows, tables = fn(quick=True) if short else fn()
    return Result(name, time.perf_counter() - wall, rows, tables, quick=short)  # noqa: TID251
