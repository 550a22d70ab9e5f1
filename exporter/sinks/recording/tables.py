"""Tables a source adds to recordings, declared by its SOURCES row
(agent/sources.py `tables`): the recorder creates each one (if the file has
none yet) and writes one row per record of its type. The tables of the
schema's own migrations (schema.py) are the built-in sources'."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RecordTable:
    name: str
    columns: tuple[str, ...]  # column definitions, "name TYPE", in the order of `row`'s values
    record: type  # the record type (records/events.py or the source's own) that goes here
    row: Callable[[Any, str], tuple]  # (record, node) -> the row's values

    @property
    def create(self) -> str:
        return f"CREATE TABLE IF NOT EXISTS {self.name} ({', '.join(self.columns)})"

    @property
    def insert(self) -> str:
        return f"INSERT INTO {self.name} VALUES ({', '.join('?' * len(self.columns))})"
