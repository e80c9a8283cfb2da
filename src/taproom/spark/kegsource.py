"""The ``keg`` data source: Lager ``*.lgr`` files as Spark DataFrames.

Kegs are read with the Lager protocol package's public reader
(:func:`taproom.protocols.lager.keg.read_keg`), which also recovers unfinished kegs (zero
``dataFormatOffset``) from their ``.format`` sidecar and drops a torn last record. One keg
file is one partition. Two layouts:

* ``layout=long`` (default): one row per sample and numeric item, schema
  :data:`~taproom.spark.schemas.KEG_LONG_SCHEMA` (keg, tap, ts, ts_ns, item, value as
  double). Array items become ``name[i]``; string items are left out (they have no value to
  aggregate). This is what :func:`~taproom.spark.transforms.telemetry_rollup` reads.
* ``layout=wide`` with ``format=<tap uuid>``: one row per sample of that tap, one typed
  column per item (keg, tap, ts, ts_ns, then the items), for Parquet per format.

The tap is named by its uuid: a keg stores formats by uuid only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DataType,
    DecimalType,
    DoubleType,
    FloatType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from .schemas import KEG_LONG_SCHEMA

__all__ = ["KegDataSource", "keg_files", "keg_formats", "wide_schema"]


def keg_files(options: Any) -> list[str]:
    """``*.lgr`` files named by ``path``/``paths`` (files, or directories searched deeply)."""
    import json

    raw: list[str] = []
    if options.get("paths"):
        value = options["paths"]
        raw += json.loads(value) if isinstance(value, str) else list(value)
    if options.get("path"):
        raw += [p for p in str(options["path"]).split(",") if p]
    found: list[str] = []
    for path in raw:
        if os.path.isdir(path):
            for root, _dirs, names in os.walk(path):
                found += [os.path.join(root, n) for n in names if n.endswith(".lgr")]
        else:
            found.append(path)
    return sorted(os.path.abspath(p) for p in found)


def keg_formats(files: list[str]) -> dict[str, Any]:
    """Every tap format (uuid string -> DataFormat) found in ``files``."""
    from ..protocols.lager.keg import read_keg

    formats: dict[str, Any] = {}
    for path in files:
        formats.update(read_keg(path).formats)
    return formats


def _spark_type(item: Any) -> DataType:
    name = item.type.name
    base: DataType
    if name == "string":
        return StringType()
    if name == "bool":
        base = BooleanType()
    elif name == "uint64":
        base = DecimalType(20, 0)  # beyond a signed long
    elif name.startswith(("int", "uint")):
        base = LongType()
    elif name == "float32":
        base = FloatType()
    else:
        base = DoubleType()
    return ArrayType(base, False) if item.count > 1 else base


def wide_schema(fmt: Any) -> StructType:
    fields = [
        StructField("keg", StringType(), False),
        StructField("tap", StringType(), False),
        StructField("ts", TimestampType(), False),
        StructField("ts_ns", LongType(), False),
    ]
    fields += [StructField(item.name, _spark_type(item), True) for item in fmt.items]
    return StructType(fields)


def _arrow_schema(schema: StructType) -> Any:
    """Spark checks nullability and types of every batch exactly: derive them from ``schema``."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema, timezone="UTC")


@dataclass(frozen=True)
class KegFile(InputPartition):
    path: str


def _ts_columns(ts_ns: Any) -> tuple[Any, Any]:
    import numpy as np
    import pyarrow as pa

    ns = np.asarray(ts_ns, dtype=np.uint64).astype(np.int64)
    ts = pa.array(ns // 1000, pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    return ts, pa.array(ns, pa.int64())


def _arrow_column(item: Any, values: Any) -> Any:
    import numpy as np
    import pyarrow as pa

    name = item.type.name
    if name == "string":
        return pa.array(values.astype(object), pa.string())
    if item.count > 1:
        flat = np.asarray(values).reshape(len(values), item.count)
        inner = _arrow_column(_Scalar(item), flat.reshape(-1))
        offsets = pa.array(np.arange(0, len(flat) * item.count + 1, item.count, dtype=np.int32))
        return pa.ListArray.from_arrays(offsets, inner)
    if name == "bool":
        return pa.array(np.asarray(values, dtype=bool))
    if name == "uint64":
        return pa.array(np.asarray(values, dtype=np.uint64)).cast(pa.decimal128(20, 0))
    if name.startswith(("int", "uint")):
        return pa.array(np.asarray(values).astype(np.int64))
    if name == "float32":
        return pa.array(np.asarray(values, dtype=np.float32))
    return pa.array(np.asarray(values, dtype=np.float64))


@dataclass(frozen=True)
class _Scalar:
    """An array item seen as its element type."""

    source: Any

    @property
    def type(self) -> Any:
        return self.source.type

    count = 1


class _WideReader(DataSourceReader):
    def __init__(self, files: list[str], uuid: str, schema: StructType) -> None:
        self.files = files
        self.uuid = uuid
        self.schema = schema

    def partitions(self) -> Sequence[InputPartition]:
        return [KegFile(p) for p in self.files]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        import pyarrow as pa

        from ..protocols.lager.keg import read_keg

        assert isinstance(partition, KegFile)
        keg = read_keg(partition.path)
        fmt = keg.formats.get(self.uuid)
        if fmt is None:
            return
        table = keg.table(self.uuid)
        n = len(table["timestamp_ns"])
        if n == 0:
            return
        ts, ts_ns = _ts_columns(table["timestamp_ns"])
        columns = [
            pa.repeat(pa.scalar(partition.path, pa.string()), n),
            pa.repeat(pa.scalar(self.uuid, pa.string()), n),
            ts,
            ts_ns,
        ]
        columns += [_arrow_column(item, table[item.name]) for item in fmt.items]
        yield pa.RecordBatch.from_arrays(columns, schema=_arrow_schema(self.schema))


class _LongReader(DataSourceReader):
    def __init__(self, files: list[str]) -> None:
        self.files = files

    def partitions(self) -> Sequence[InputPartition]:
        return [KegFile(p) for p in self.files]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        import numpy as np
        import pyarrow as pa

        from ..protocols.lager.keg import read_keg

        assert isinstance(partition, KegFile)
        keg = read_keg(partition.path)
        for uuid, fmt in keg.formats.items():
            table = keg.table(uuid)
            n = len(table["timestamp_ns"])
            if n == 0:
                continue
            ts, ts_ns = _ts_columns(table["timestamp_ns"])
            for item in fmt.items:
                if item.type.name == "string":
                    continue
                values = np.asarray(table[item.name], dtype=np.float64)
                if item.count > 1:
                    values = values.reshape(n, item.count)
                    names = [f"{item.name}[{i}]" for i in range(item.count)]
                    columns = [values[:, i] for i in range(item.count)]
                else:
                    names, columns = [item.name], [values]
                for name, column in zip(names, columns, strict=True):
                    yield pa.RecordBatch.from_arrays(
                        [
                            pa.repeat(pa.scalar(partition.path, pa.string()), n),
                            pa.repeat(pa.scalar(uuid, pa.string()), n),
                            ts,
                            ts_ns,
                            pa.repeat(pa.scalar(name, pa.string()), n),
                            pa.array(column, pa.float64()),
                        ],
                        schema=_arrow_schema(KEG_LONG_SCHEMA),
                    )


class KegDataSource(DataSource):
    """``spark.read.format("keg").load(dir)`` (long) or ``.option("layout", "wide")
    .option("format", uuid)`` (one tap's typed columns)."""

    @classmethod
    def name(cls) -> str:
        return "keg"

    def _layout(self) -> str:
        layout = str(self.options.get("layout", "long"))
        if layout not in ("long", "wide"):
            raise ValueError("keg source: layout is 'long' or 'wide'")
        return layout

    def _uuid(self) -> str:
        uuid = self.options.get("format")
        if not uuid:
            raise ValueError("keg source: layout=wide needs format=<tap uuid>")
        return str(uuid).lower()

    def schema(self) -> StructType:
        if self._layout() == "long":
            return KEG_LONG_SCHEMA
        uuid = self._uuid()
        formats = keg_formats(keg_files(self.options))
        if uuid not in formats:
            raise ValueError(f"keg source: no keg here has format {uuid}")
        return wide_schema(formats[uuid])

    def reader(self, schema: StructType) -> DataSourceReader:
        files = keg_files(self.options)
        if self._layout() == "long":
            return _LongReader(files)
        return _WideReader(files, self._uuid(), schema)
