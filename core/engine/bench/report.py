"""Bench results as data, printed as a table or as JSON.

A :class:`Figure` holds one value per runner ("engine", "hf", ...) in its display
unit, and how it was obtained. Ratios are always ``engine / peer``: above 1 the
engine is bigger, which is better for rates and worse for times.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine.bench.metrics import ratio

ENGINE = "engine"


@dataclass
class Figure:
    key: str
    label: str
    unit: str
    values: dict[str, float | None]
    method: str
    fmt: str = ".1f"

    def value_text(self, runner: str) -> str:
        value = self.values.get(runner)
        if value is None:
            return "-"
        return f"{value * 100:.1f}%" if self.unit == "%" else f"{value:{self.fmt}}"

    def ratios(self, runners: list[str]) -> dict[str, float | None]:
        return {
            f"{ENGINE}/{peer}": ratio(self.values.get(ENGINE), self.values.get(peer))
            for peer in runners
            if peer != ENGINE
        }


@dataclass
class Section:
    key: str
    title: str
    description: str
    figures: list[Figure] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)  # machine-readable context (JSON); notes say it in words
    notes: list[str] = field(default_factory=list)

    def add(
        self, key: str, label: str, unit: str, values: dict[str, float | None], method: str, fmt: str = ".1f"
    ) -> None:
        self.figures.append(Figure(key, label, unit, values, method, fmt))


@dataclass
class Report:
    command: str
    runners: list[str]
    setup: dict[str, Any]
    sections: list[Section] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "runners": self.runners,
            "setup": self.setup,
            "sections": {
                s.key: {
                    "title": s.title,
                    "description": s.description,
                    "figures": {
                        f.key: {
                            "label": f.label,
                            "unit": f.unit,
                            "values": f.values,
                            "ratios": f.ratios(self.runners),
                            "method": f.method,
                        }
                        for f in s.figures
                    },
                    "facts": s.facts,
                    "notes": s.notes,
                }
                for s in self.sections
            },
            "notes": self.notes,
        }

    def as_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def as_text(self) -> str:
        lines = [f"engine bench {self.command}"]
        lines += [f"  {key}: {value}" for key, value in self.setup.items()]
        lines += [f"  {note}" for note in self.notes]
        for section in self.sections:
            lines += ["", f"{section.title}: {section.description}", *self._table(section)]
        return "\n".join(lines)

    def _table(self, section: Section) -> list[str]:
        peers = [r for r in self.runners if r != ENGINE]
        header = ["figure", *self.runners, *(f"{ENGINE}/{p}" for p in peers), "method"]
        rows = []
        for number, figure in enumerate(section.figures, 1):
            unit = f" ({figure.unit})" if figure.unit and figure.unit != "%" else ""
            ratios = figure.ratios(self.runners)
            rows.append(
                [
                    figure.label + unit,
                    *(figure.value_text(r) for r in self.runners),
                    *("-" if ratios[f"{ENGINE}/{p}"] is None else f"{ratios[f'{ENGINE}/{p}']:.2f}" for p in peers),
                    f"[{number}]",
                ]
            )
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

        def line(cells: list[str]) -> str:
            first = cells[0].ljust(widths[0])
            rest = [cell.rjust(width) for cell, width in zip(cells[1:-1], widths[1:-1])]
            return "  " + "  ".join([first, *rest, cells[-1]]).rstrip()

        out = [line(header), "  " + "-" * (sum(widths) + 2 * (len(widths) - 1))]
        out += [line(row) for row in rows]
        out += [f"  [{n}] {figure.method}" for n, figure in enumerate(section.figures, 1)]
        out += [f"  {note}" for note in section.notes]
        return out
