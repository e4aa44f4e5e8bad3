"""The run folder (output_dir): how its files are written.

Every file is replaced atomically (a temp file beside it, fsynced, then os.replace), so a crash mid-write
leaves the previous file intact.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import BinaryIO, Iterator


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A new file beside `path`, fsynced and moved over it only if the block succeeds.

    Created with mode 0666 minus the umask, like any other file the run writes (mkstemp would give 0600).
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
