"""The plan of a preparation: which input bytes each work unit reads, written before any work.

A work unit is the unit of work of every worker, local process or (later) cloud instance alike:
whole small files grouped in input order up to `unit_bytes`, or a byte range of a large JSONL file
(a line belongs to the range that holds its first byte, so ranges are cut without reading the file).
The plan depends only on the input files' names and sizes and on the options, never on the number
of workers: any N workers, in any order, write the same units' shards, and the dataset is their
concatenation in unit order.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

# JSONL is the one format a unit may read a part of: one record per line. CSV rows may span lines
# (quoted newlines) and a text file is one document, so those are read whole.
SPLITTABLE_SUFFIXES = (".jsonl",)
DEFAULT_UNIT_BYTES = 64 << 20


@dataclass(frozen=True)
class InputFile:
    """An input file: its path, size, and version (a local file's modification time, an object's
    ETag), so that a changed file makes another plan and an interrupted preparation is not resumed
    with it."""

    path: str
    size: int
    version: str = ""


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of input file number `file` (end None: to the end of the file)."""

    file: int
    start: int = 0
    end: int | None = None

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end is None


@dataclass(frozen=True)
class WorkUnit:
    index: int
    pieces: tuple[Piece, ...]
    num_bytes: int

    @property
    def name(self) -> str:
        return f"{self.index:05d}"


@dataclass(frozen=True)
class Plan:
    """The inputs, their units, and the options that shape the output (a resumed preparation must
    have the same ones)."""

    files: tuple[InputFile, ...]
    units: tuple[WorkUnit, ...]
    settings: dict[str, Any]

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def num_bytes(self) -> int:
        return sum(file.size for file in self.files)

    def paths(self, unit: WorkUnit) -> list[Path]:
        return [Path(self.files[piece.file].path) for piece in unit.pieces]

    def to_json(self) -> dict[str, Any]:
        return {"files": [asdict(f) for f in self.files], "settings": self.settings,
                "units": [{"index": u.index, "num_bytes": u.num_bytes,
                           "pieces": [asdict(p) for p in u.pieces]} for u in self.units]}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Plan:
        return cls(files=tuple(InputFile(**f) for f in body["files"]),
                   units=tuple(WorkUnit(u["index"], tuple(Piece(**p) for p in u["pieces"]), u["num_bytes"])
                               for u in body["units"]),
                   settings=body["settings"])

    def write(self, path: Path) -> None:
        write_json_atomically(path, self.to_json())

    @classmethod
    def read(cls, path: Path) -> Plan | None:
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def local_inputs(files: list[Path]) -> tuple[InputFile, ...]:
    return tuple(InputFile(str(path), path.stat().st_size, str(path.stat().st_mtime_ns)) for path in files)


def make_plan(inputs: tuple[InputFile, ...], settings: dict[str, Any],
              unit_bytes: int = DEFAULT_UNIT_BYTES) -> Plan:
    """Units of at most about `unit_bytes` input bytes each, in input order. Only names and sizes
    are read, so a plan of files in object storage is made from their listing alike."""
    units: list[WorkUnit] = []
    group: list[Piece] = []
    group_bytes = 0

    def close_group() -> None:
        nonlocal group, group_bytes
        if group:
            units.append(WorkUnit(len(units), tuple(group), group_bytes))
        group, group_bytes = [], 0

    for number, item in enumerate(inputs):
        if item.size > unit_bytes and Path(item.path).suffix.lower() in SPLITTABLE_SUFFIXES:
            close_group()
            for start in range(0, item.size, unit_bytes):
                end = start + unit_bytes if start + unit_bytes < item.size else None
                units.append(WorkUnit(len(units), (Piece(number, start, end),),
                                      (end or item.size) - start))
            continue
        if group and group_bytes + item.size > unit_bytes:
            close_group()
        group.append(Piece(number))
        group_bytes += item.size
    close_group()
    return Plan(inputs, tuple(units), settings)


def lines_in_range(handle: BinaryIO, start: int, end: int | None) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line) of every line whose first byte lies in [start, end)."""
    if start > 0:
        handle.seek(start - 1)
        handle.readline()  # the end of the line that began before `start` (the previous range's)
    offset = handle.tell()
    while end is None or offset < end:
        line = handle.readline()
        if not line:
            return
        yield offset, line
        offset += len(line)


def write_json_atomically(path: Path, body: Any) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(body, indent=2) + "\n")
    os.replace(temporary, path)
