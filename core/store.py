"""Object storage (s3://, gs://, az://, hf://, https://: any fsspec URL): files copied to and from a URL, with
bounded retries and one-line errors.

Credentials and the endpoint come from each backend's standard environment (for S3: AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, instance roles): the app has no keys of its own for them.
A transient error (connection refused or reset, a timeout, 500/503 SlowDown) is retried after 2, 4 and 8 s and
counted (`RETRIES`, logged each time); one still failing after ATTEMPTS tries, or a permanent one (no such bucket
or key, wrong credentials), is a UserError naming the URL. An upload is atomic: the file goes to a temporary key
beside the target, is copied to the target and the temporary key removed, so a killed upload never replaces a
good object with part of a file.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, TypeVar
from urllib.parse import urlparse

from core.errors import UserError
from core.files import temp_name

log = logging.getLogger(__name__)
T = TypeVar("T")
ATTEMPTS = 4  # tries of one operation; the waits between them double from BACKOFF_S
BACKOFF_S = 2.0
RETRIES: Counter[str] = Counter()  # retried operations by URL scheme, for the run's log
TRANSIENT_ERRNOS = {errno.EBUSY, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.EAGAIN,
                    errno.EREMOTEIO, errno.ECONNABORTED, errno.EPIPE}
TRANSIENT_TYPES = {"ConnectionError", "HTTPClientError", "ClientConnectionError", "ClientPayloadError",
                   "ServerDisconnectedError", "IncompleteRead", "ResponseParserError"}
TEMP_TAG = ".tmp-"  # an upload's temporary key: <key>.tmp-<hex>
CREDENTIALS = "check the URL and the credentials in the environment (AWS_ACCESS_KEY_ID, AWS_PROFILE, ...)"


def is_url(name: str) -> bool:
    """A URL (file://, https://, s3://, pipe:...) rather than a local path."""
    return name.startswith("pipe:") or len(urlparse(name).scheme) > 1  # (not a Windows drive letter)


def refuse_url(path: str, option: str, advice: str) -> None:
    """A URL where only a local path is read or written: one line, never a local folder named after the URL."""
    if is_url(path):
        raise UserError(f"{option} {path} is a URL, and only a local folder is read or written here; {advice}")


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of `url` and the path in it; S3 with botocore's own retries off (ours count them)."""
    import fsspec

    scheme = urlparse(url).scheme
    options: dict[str, Any] = {}
    if scheme in ("s3", "s3a"):
        options["config_kwargs"] = {"connect_timeout": 10, "read_timeout": 60, "retries": {"total_max_attempts": 1}}
    try:
        return fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as err:
        raise UserError(f"cannot open {url}: no filesystem for {scheme}:// ({err}); install its fsspec package "
                        "(s3fs for s3://, gcsfs for gs://, adlfs for az://)") from None


def transient(err: BaseException) -> bool:
    """Whether trying again may succeed: the network or a busy server, not a missing key or wrong credentials."""
    if isinstance(err, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    if isinstance(err, OSError):
        return err.errno in TRANSIENT_ERRNOS
    names = {kind.__name__ for kind in type(err).__mro__}  # botocore's and aiohttp's, without importing them
    return bool(names & TRANSIENT_TYPES) or any("Timeout" in name for name in names)


def reason(err: BaseException) -> str:
    """An error in a few words."""
    text = " ".join(str(getattr(err, "strerror", None) or err).split())[:200] or type(err).__name__
    return f"access denied: {text}" if isinstance(err, PermissionError) else text


def retrying(what: str, url: str, call: Callable[[], T]) -> T:
    """`call()`, retried after a transient error (counted); else one line: cannot <what> <url> (...)."""
    attempt = 1
    while True:
        try:
            return call()
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - every backend raises its own types; classified below
            if not transient(err):
                raise UserError(f"cannot {what} {url} ({reason(err)}); {CREDENTIALS}") from None
            if attempt == ATTEMPTS:
                raise UserError(f"cannot {what} {url}: no answer after {ATTEMPTS} tries ({reason(err)}); check "
                                "that the storage server is reachable (AWS_ENDPOINT_URL) and try again") from None
            wait = BACKOFF_S * 2 ** (attempt - 1)
            RETRIES[urlparse(url).scheme] += 1
            log.warning("%s %s failed (%s); retry %d of %d in %.0f s", what, url, reason(err), attempt,
                        ATTEMPTS - 1, wait)
            time.sleep(wait)
            attempt += 1


def download(url: str, local: str, what: str = "read") -> str:
    """Copy the object at `url` to the file `local` (through a temp file beside it: a reader never sees part)."""
    fs, path = filesystem(url)
    tmp = str(temp_name(Path(local)))
    try:
        retrying(what, url, lambda: fs.get_file(path, tmp))
        os.replace(tmp, local)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return local


def read_bytes(url: str, what: str = "read") -> bytes:
    """The object at `url`."""
    fs, path = filesystem(url)
    return retrying(what, url, lambda: fs.cat_file(path))


def upload(local: str, url: str) -> None:
    """Put the file `local` at `url` atomically: to a temporary key, copied to `url`, the temporary key removed."""
    fs, path = filesystem(url)
    tmp = f"{path}{TEMP_TAG}{secrets.token_hex(4)}"
    retrying("write", url, lambda: fs.put_file(local, tmp))
    retrying("write", url, lambda: fs.copy(tmp, path))
    retrying("write", url, lambda: fs.rm_file(tmp))


def join(url: str, name: str) -> str:
    """`url/name`."""
    return f"{url.rstrip('/')}/{name}"
