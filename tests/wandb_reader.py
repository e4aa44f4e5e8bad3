"""Read an offline W&B run back from its run-<id>.wandb file, so tests can check what was logged.

wandb 0.31 writes no summary JSON offline and ships no Python reader for run files. The file is a
LevelDB-style log: a 7-byte header (b":W&B", magic 0xBEE1 little-endian, version 0), then 32 KiB
blocks of chunks. Each chunk has a 7-byte header (CRC-32 of type byte + data, little-endian data
length, type: 1 full, 2 first, 3 middle, 4 last); a block tail shorter than 7 bytes is padding.
The chunks of one record concatenate to a serialized `wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from wandb.proto import wandb_internal_pb2 as pb

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    path: Path
    run_id: str = ""
    run: Any = None  # the RunRecord (project, group, tags, notes, resume flag, ...)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)  # one dict per step, with "_step"
    summary: dict[str, Any] = field(default_factory=dict)
    artifacts: list[Any] = field(default_factory=list)  # ArtifactRecords
    metrics: dict[str, Any] = field(default_factory=dict)  # MetricRecords of define_metric, by name
    exit_code: int | None = None

    def values(self, key: str) -> list[tuple[int, Any]]:
        """(step, value) for every history row that has `key`."""
        return [(row["_step"], row[key]) for row in self.history if key in row]


def read_records(path: str | Path) -> Iterator[pb.Record]:
    """Every record in a run-<id>.wandb file, in order; a bad header or checksum raises ValueError."""
    data = Path(path).read_bytes()
    if data[:len(HEADER)] != HEADER:
        raise ValueError(f"{path}: not a W&B run file (header {data[:len(HEADER)]!r})")
    pos, pending = len(HEADER), b""
    while pos + CHUNK_HEADER <= len(data):
        if BLOCK - pos % BLOCK < CHUNK_HEADER:  # block tail padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + CHUNK_HEADER])
        chunk = data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        if kind == 0 and length == 0:  # zero fill at the end of a file still being written
            break
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc or len(chunk) != length:
            raise ValueError(f"{path}: bad chunk at byte {pos}")
        pos += CHUNK_HEADER + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def decode(items: Any) -> dict[str, Any]:
    """Items with a key, or a nested_key path (media objects: ["eval/predictions", "path"]) -> nested dict."""
    out: dict[str, Any] = {}
    for item in items:
        *parents, leaf = [item.key] if item.key else list(item.nested_key)
        node = out
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = json.loads(item.value_json)
    return out


def read_run(path: str | Path) -> OfflineRun:
    """Decode one run file into its run id, config, history rows, final summary, artifacts and metric definitions."""
    out = OfflineRun(Path(path))
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out.run, out.run_id = record.run, record.run.run_id
            out.config.update(decode(record.run.config.update))
        elif kind == "config":
            out.config.update(decode(record.config.update))
        elif kind == "history":
            out.history.append(decode(record.history.item))
        elif kind == "summary":
            out.summary.update(decode(record.summary.update))
            for key in decode(record.summary.remove):
                out.summary.pop(key, None)
        elif kind == "artifact":
            out.artifacts.append(record.artifact)
        elif kind == "metric":
            out.metrics[record.metric.name or record.metric.glob_name] = record.metric
        elif kind == "exit":
            out.exit_code = record.exit.exit_code
    return out


def find_runs(wandb_dir: str | Path) -> list[Path]:
    """All run-<id>.wandb files under a WANDB_DIR (or an output_dir), oldest first."""
    return sorted(Path(wandb_dir).rglob("run-*.wandb"), key=lambda p: p.parent.name)
