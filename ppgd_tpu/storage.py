"""Where a run's bytes live: a local directory or gs://bucket/path, behind one interface.

Arrays go through tensorstore (`kvstore` gives its spec); the small things -- run-dir files,
manifests, commit markers, listings, deletion -- go through fsspec (local) or gcsfs (gs://).
Both honour the GCS emulator: tensorstore reads TENSORSTORE_GCS_HTTP_URL, gcsfs
STORAGE_EMULATOR_HOST.
"""

from __future__ import annotations

import functools
import os
import posixpath
import uuid

# gcsfs probes for hierarchical-namespace buckets on first use, which stalls ~60 s against an
# emulator or without network; it must be off before gcsfs is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

_GCS = "gs://"


class Unreachable(Exception):
    """A gs:// path could not be reached: no network, no credentials, or no permission. Its
    message names the path (the client's names an HTTP endpoint). Not an OSError: no
    handler of a damaged or missing file may take it for one."""


def _gcs_failure(e: BaseException) -> str | None:
    """What went wrong, if `e` is GCS being out of reach rather than a file being absent."""
    if isinstance(e, FileNotFoundError):
        return None
    import aiohttp
    import google.auth.exceptions
    from gcsfs.retry import HttpError

    if isinstance(e, (aiohttp.ClientError, TimeoutError)):
        detail = str(e) or f"no answer within {GCS_STALL_S} s, retried"
        return f"cannot reach Cloud Storage ({type(e).__name__}: {detail}); check the network"
    if isinstance(e, google.auth.exceptions.GoogleAuthError):
        return (f"no usable credentials ({e}); run `gcloud auth application-default login` "
                "or give the VM a service account with storage access")
    if isinstance(e, HttpError) or (isinstance(e, OSError) and str(e).startswith("Forbidden")):
        return ("permission denied by Cloud Storage ("
                + " ".join(str(e).split("\n", 1)[-1].split()) + ")")
    return None


def _reports_path(fn):
    """Turns a gs:// failure inside `fn(path, ...)` into Unreachable naming `path`."""
    @functools.wraps(fn)
    def wrapper(path, *args, **kwargs):
        try:
            return fn(path, *args, **kwargs)
        except Unreachable:
            raise
        except Exception as e:
            why = _gcs_failure(e) if is_gcs(os.fspath(path)) else None
            if why is None:
                raise
            raise Unreachable(f"{path}: {why}") from e
    return wrapper


def is_gcs(path: str) -> bool:
    return path.startswith(_GCS)


def normalize(path: str) -> str:
    """A canonical form of a run path: gs://bucket/p/a/t/h or an absolute local path."""
    path = os.fspath(path)
    if not path:
        raise ValueError("path is empty; give a local directory or gs://bucket/path")
    if is_gcs(path):
        bucket, _, rest = path[len(_GCS):].partition("/")
        if not bucket:
            raise ValueError(f"path {path!r} has no bucket; expected gs://bucket/path")
        rest = posixpath.normpath("/" + rest).lstrip("/")
        return _GCS + bucket + ("/" + rest if rest else "")
    if "://" in path:
        raise ValueError(f"path {path!r}: only local paths and gs://bucket/path are supported")
    return os.path.abspath(os.path.expanduser(path))  # `--run_dir=~/x`: no shell expands it


@_reports_path
def check_creatable(path: str, *, directory: bool) -> None:
    """Raises ValueError if local `path` (a directory, or a file) could not be created or
    written: a file where a directory must be or the reverse, a file on its way, or no write
    permission where it would go. Called before compute, so a bad path costs nothing. Of a
    gs:// path the bucket and what is there are checked; a missing permission shows at the
    first write."""
    if not directory and os.fspath(path).endswith("/"):  # normalize would drop the slash
        raise ValueError(f"{path} ends with '/', so it names a directory; give a file path "
                         f"(e.g. {os.fspath(path)}<name>.safetensors)")
    path = normalize(path)
    if is_gcs(path):
        fs, p = _fs_and_path(path)
        bucket = p.split("/", 1)[0]
        try:  # not fs.exists: without storage.buckets.get it lists, and an empty bucket
            fs.call("GET", "b/{}", bucket)  # would look missing
        except FileNotFoundError:
            raise ValueError(f"bucket gs://{bucket} does not exist, so {path} cannot be "
                             "created") from None
        except OSError as e:
            if not str(e).startswith("Forbidden"):  # it exists; writes decide
                raise
            return
        if directory and fs.isfile(p):
            raise ValueError(f"{path} exists and is not a directory (an object)")
        if not directory and is_dir(path):
            raise ValueError(f"{path} exists and is not a file (a prefix holding objects)")
        return
    if os.path.exists(path):
        if os.path.isdir(path) != directory:
            kind = "a directory" if directory else "a file"
            raise ValueError(f"{path} exists and is not {kind}")
        probe = path if directory else os.path.dirname(path)
    else:
        probe = os.path.dirname(path)
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe):
            raise ValueError(f"{probe} is a file, so {path} cannot be created")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"no permission to write in {probe}")
    if os.path.exists(path):  # nothing to create: a probe there would show to others
        return
    trial = os.path.join(probe, f".ppgd-tpu-probe-{os.getpid()}")
    try:  # what access() cannot tell: /proc, a filesystem that refuses new entries
        os.mkdir(trial)
        os.rmdir(trial)
    except FileExistsError:
        pass
    except OSError as e:
        raise ValueError(f"{path} cannot be created: {probe} takes no new entries "
                         f"({e.strerror or e})") from None


def short_error(e: Exception, limit: int = 400) -> str:
    """An error's first line, without the kilobyte of spec a tensorstore error appends."""
    return str(e).split(" [tensorstore_spec=")[0].splitlines()[0][:limit] if str(e) else ""


def join(path: str, *parts: str) -> str:
    if is_gcs(path):
        return posixpath.join(path, *parts)
    return os.path.join(path, *parts)


# Cloud Storage out of reach: tensorstore retries a request 32 times by default (backoff up
# to 32 s: ~15 minutes of silence before a run fails); these ~2 minutes outlast a blip. A
# connection that stalls fails after GCS_STALL_S (gcsfs: metrics, summaries; tensorstore)
# and is retried (gcsfs: 6 tries, so ~3.5 minutes for a service that stopped answering).
GCS_RETRIES = {"max_retries": 8, "initial_delay": "1s", "max_delay": "32s"}
GCS_STALL_S = 30


def kvstore(path: str) -> dict:
    """The tensorstore kvstore spec for a directory (trailing slash: it is a prefix)."""
    path = normalize(path)
    if is_gcs(path):
        # a stalled transfer (no byte in GCS_STALL_S) fails and is retried, as in gcsfs; read
        # when tensorstore makes its HTTP transport, so set before the first gs:// open
        os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", str(GCS_STALL_S))
        os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")
        bucket, _, rest = path[len(_GCS):].partition("/")
        return {"driver": "gcs", "bucket": bucket, "path": rest.rstrip("/") + "/",
                "gcs_request_retries": GCS_RETRIES}
    return {"driver": "file", "path": path.rstrip("/") + "/"}


def _fs_and_path(path: str):
    path = normalize(path)
    if is_gcs(path):
        import gcsfs

        # Against the emulator there is nothing to authenticate with; in production gcsfs
        # finds the default credentials itself.
        token = "anon" if os.environ.get("STORAGE_EMULATOR_HOST") else None
        import aiohttp

        stall = aiohttp.ClientTimeout(sock_connect=GCS_STALL_S, sock_read=GCS_STALL_S)
        fs = gcsfs.GCSFileSystem(token=token, use_listings_cache=False, requests_timeout=stall)
        return fs, path[len(_GCS):]
    import fsspec

    return fsspec.filesystem("file"), path


@_reports_path
def exists(path: str) -> bool:
    fs, p = _fs_and_path(path)
    return fs.exists(p)


@_reports_path
def is_dir(path: str) -> bool:
    """A local directory, or a gs:// prefix that holds objects."""
    fs, p = _fs_and_path(path)
    return fs.isdir(p)


@_reports_path
def read_bytes(path: str) -> bytes:
    fs, p = _fs_and_path(path)
    return fs.cat_file(p)


@_reports_path
def read_range(path: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a file (one ranged GET on gs://)."""
    fs, p = _fs_and_path(path)
    return fs.cat_file(p, start=start, end=end)


@_reports_path
def write_bytes(path: str, data: bytes) -> None:
    """Write a whole small file so that a reader sees all of it or nothing.

    A GCS object upload is atomic; on local disk we write a sibling temp file and rename.
    """
    fs, p = _fs_and_path(path)
    if is_gcs(normalize(path)):
        fs.pipe_file(p, data)
        return
    os.makedirs(os.path.dirname(p), exist_ok=True)
    tmp = f"{p}.tmp-{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:  # a full disk, a directory at `p`: leave nothing behind
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


@_reports_path
def list_entries(path: str) -> list[str]:
    """Names (not paths) directly in `path`, sub-directories with a trailing "/"; [] if it
    does not exist."""
    fs, p = _fs_and_path(path)
    if not fs.exists(p):
        return []
    out = []
    for e in fs.ls(p, detail=True):
        name = posixpath.basename(e["name"].rstrip("/"))
        if name and e["name"].rstrip("/") != p.rstrip("/"):  # gcs may list the prefix itself
            out.append(name + ("/" if e["type"] == "directory" else ""))
    return sorted(out)


def list_dirs(path: str) -> list[str]:
    """Names (not paths) of the immediate sub-directories of `path`; [] if it does not exist."""
    return [n[:-1] for n in list_entries(path) if n.endswith("/")]


@_reports_path
def list_files(path: str) -> dict[str, int]:
    """Every file below `path`, as {path relative to `path`: size in bytes}."""
    fs, p = _fs_and_path(path)
    if not fs.exists(p):
        return {}
    root = p.rstrip("/") + "/"
    return {name[len(root):]: int(info["size"]) for name, info in fs.find(p, detail=True).items()}


@_reports_path
def remove(path: str) -> None:
    """Delete one file; absent is fine."""
    fs, p = _fs_and_path(path)
    if fs.exists(p):
        fs.rm_file(p)


@_reports_path
def remove_tree(path: str) -> None:
    """Delete a directory and everything below it; absent is fine."""
    fs, p = _fs_and_path(path)
    if fs.exists(p):
        fs.rm(p, recursive=True)
