"""Where inputs and stores live: a local path or an fsspec URL (`s3://`, `gs://`, `abfs://`,
`memory://`), as one `Location` that the rest of bertpipe reads and writes through.

Local paths keep local semantics: a file is written under a temporary name and renamed
into place, create-if-absent is a hard link (or O_EXCL), removing a folder never follows a
link. An object store has no rename: an object is written whole by one PUT and appears
complete or not at all, create-if-absent is a conditional PUT (S3 `If-None-Match: *`,
fsspec's `pipe_file(mode="create")`), and removing a "folder" deletes exactly the keys
under `<prefix>/`, never a sibling that merely shares the prefix.

Storage options for a URL, lowest first: bertpipe's defaults for the protocol (timeouts
that fail fast), the environment by the library's own conventions (`AWS_*` read by
botocore, `GOOGLE_*` by gcsfs, `AZURE_STORAGE_*` by adlfs), then the options a job gives
(`input.storage_options`, `output.storage_options`) or that a process registers for a URL
prefix (`register_options`). A string value `${NAME}` is read from the environment of the
process that opens the filesystem, the client or a worker. Secrets are never written:
a job records its options redacted (`redacted_options`), and `scrub` takes them out
of any message.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any

from ..errors import BertpipeError, EndpointError, JobError, first_line

# Defaults per protocol, under the environment and the job. Why these for S3: botocore
# waits 60 s to connect and retries with backoff, so an unreachable endpoint hangs a job
# for minutes; one refused connection is certain at once.
DEFAULTS: dict[str, dict[str, Any]] = {
    "s3": {"config_kwargs": {"connect_timeout": 5, "read_timeout": 60,
                             "retries": {"max_attempts": 3, "mode": "standard"}},
           # a row group is read with one ranged GET each, never a read-ahead block
           "default_cache_type": "none"},
}
# Environment variables whose values are secrets (never shown, whatever reads them).
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID",
              "AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN",
              "AZURE_STORAGE_CONNECTION_STRING", "AZURE_CLIENT_SECRET",
              "GOOGLE_OAUTH_ACCESS_TOKEN")
# Prefixes of environment variables a filesystem may read: a change makes a new instance.
ENV_PREFIXES = ("AWS_", "GOOGLE_", "GCS", "AZURE_", "FSSPEC_")

_registered: dict[str, dict[str, Any]] = {}  # URL prefix -> storage options as written
_secrets: set[str] = set()  # literal values seen in storage options, for `scrub`
_filesystems: dict[str, Any] = {}
_guard = threading.Lock()


def is_url(path: str | Path) -> bool:
    """A URL that fsspec resolves (anything with `://` but `file://`): the one test of
    whether a path names an object store or the local file system."""
    text = str(path)
    return "://" in text and not text.startswith("file://")


def local_path(path: str | Path) -> str:
    """A local path as given, without a `file://` scheme."""
    text = str(path)
    return text[len("file://"):] if text.startswith("file://") else text


# A storage option `${NAME}`: the value of environment variable NAME where it is used.
OPTION_REFERENCE = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")
REDACTED = "***"


def redacted_options(options: dict[str, Any]) -> dict[str, Any]:
    """What may be written down of storage options: `${NAME}` references, numbers and
    booleans as given; every other string replaced by `***` (it may be a secret)."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if isinstance(value, dict):
            out[name] = redacted_options(value)
        elif isinstance(value, list):
            out[name] = [REDACTED if isinstance(v, str) and not OPTION_REFERENCE.match(v)
                         else v for v in value]
        elif isinstance(value, str) and not OPTION_REFERENCE.match(value):
            out[name] = REDACTED
        else:
            out[name] = value
    return out


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0] if is_url(url) else "file"


@dataclass(frozen=True)
class Location:
    """A file or folder: `url` names it in messages (a local path, or protocol://key),
    `fs` and `path` are what fsspec takes."""

    url: str
    fs: Any = field(repr=False, compare=False)
    path: str
    options: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __str__(self) -> str:
        return self.url

    @property
    def local(self) -> bool:
        return not is_url(self.url)

    @property
    def address(self) -> str:
        """What a library that opens it is given: the path of a local file, else the URL."""
        return self.path if self.local else self.url

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name

    def child(self, *parts: str) -> Location:
        rel = "/".join(p.strip("/") for p in parts if p)
        if self.local:
            joined = str(Path(self.path, rel))
            return Location(joined, self.fs, joined, self.options)
        return Location(f"{self.url.rstrip('/')}/{rel}", self.fs, f"{self.path.rstrip('/')}/{rel}",
                        self.options)

    def relative(self, other: Location) -> str:
        """`other`'s path below this one, POSIX style."""
        return PurePosixPath(other.path).relative_to(PurePosixPath(self.path)).as_posix()

    # reading

    def info(self) -> dict[str, Any] | None:
        """What the filesystem says about this key (None when absent)."""
        if self.local:
            path = Path(self.path)
            if not path.exists():
                return None
            kind = "directory" if path.is_dir() else "file"
            return {"type": kind, "size": path.stat().st_size if kind == "file" else 0}
        self.fs.invalidate_cache(self.path)
        try:
            return dict(self.fs.info(self.path))
        except FileNotFoundError:
            return None

    def exists(self) -> bool:
        return self.info() is not None

    def is_file(self) -> bool:
        return (self.info() or {}).get("type") == "file"

    def is_dir(self) -> bool:
        return (self.info() or {}).get("type") == "directory"

    def size(self) -> int | None:
        info = self.info()
        return int(info["size"]) if info and info.get("type") == "file" else None

    def read_bytes(self, start: int | None = None, end: int | None = None) -> bytes:
        """The bytes [start, end) (all of them by default): one ranged read, no read-ahead."""
        if self.local and start is None and end is None:
            return Path(self.path).read_bytes()
        return bytes(self.fs.cat_file(self.path, start=start, end=end))

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def read_json(self) -> dict[str, Any] | None:
        """The JSON object in this file; None when it is absent, unreadable or no object."""
        try:
            raw = json.loads(self.read_bytes())
        except (OSError, ValueError):
            return None
        return raw if isinstance(raw, dict) else None

    def open(self, mode: str = "rb") -> IO[Any]:
        """A file object; reads fetch exactly the ranges asked for (no read-ahead cache)."""
        if self.local:
            return open(self.path, mode)
        kwargs = {"cache_type": "none"} if "r" in mode else {}
        return self.fs.open(self.path, mode, **kwargs)

    def entries(self) -> list[Location]:
        """The entries directly inside this folder (none when it is absent or a file)."""
        if self.local:
            root = Path(self.path)
            if not root.is_dir():
                return []
            return [self.child(p.name) for p in sorted(root.iterdir())]
        self.fs.invalidate_cache(self.path)
        try:
            listed = self.fs.ls(self.path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        base = self.path.rstrip("/")
        names = sorted({str(p).rstrip("/").rsplit("/", 1)[-1] for p in listed
                        if str(p).rstrip("/") != base})
        return [self.child(name) for name in names]

    def files(self) -> list[str]:
        """Every file below this folder, as sorted POSIX paths relative to it."""
        if self.local:
            root = Path(self.path)
            if not root.is_dir():
                return []
            return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        base = self.path.rstrip("/") + "/"
        self.fs.invalidate_cache(self.path)
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        return sorted(str(p)[len(base):] for p in found if str(p).startswith(base))

    def glob(self, pattern: str) -> list[Location]:
        """Files below this folder whose relative path matches `pattern` (sorted)."""
        base = self.path.rstrip("/") + "/"
        if self.local:
            root = Path(self.path)
            return [self.child(p.relative_to(root).as_posix())
                    for p in sorted(root.glob(pattern))]
        self.fs.invalidate_cache(self.path)
        return [self.child(str(p)[len(base):]) for p in sorted(self.fs.glob(base + pattern))
                if str(p).startswith(base)]

    # writing

    def make_dirs(self) -> None:
        """Local: the folder and its parents. Object stores have no folders to make."""
        if self.local:
            Path(self.path).mkdir(parents=True, exist_ok=True)

    def write_bytes(self, data: bytes) -> None:
        """Replace this file whole: a reader sees the old bytes or the new, never a part.

        Local: a temporary name in the same folder, then a rename. Object store: one PUT
        (an object appears only when its upload completes)."""
        if self.local:
            with self.writer() as out:
                out.write(data)
            return
        self.fs.pipe_file(self.path, data)

    @contextlib.contextmanager
    def writer(self) -> Iterator[IO[bytes]]:
        """A binary stream that replaces this file whole when the block ends, and leaves it
        as it was if the block raises. Local: a temporary file renamed into place. Object
        store: an upload (multipart when large) completed on success, aborted on failure,
        so the object appears only whole."""
        if self.local:
            path = Path(self.path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
            try:
                with tmp.open("wb") as out:
                    yield out
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            return
        if protocol_of(self.url) == "memory":
            # the in-memory filesystem shows a file as it is written: write it in one go
            buffer = io.BytesIO()
            yield buffer
            self.fs.pipe_file(self.path, buffer.getvalue())
            return
        out = self.fs.open(self.path, "wb")
        try:
            yield out
        except BaseException:
            with contextlib.suppress(Exception):
                out.discard()  # aborts the multipart upload: nothing appears
            raise
        out.close()

    def write_json(self, content: Mapping[str, Any]) -> None:
        self.write_bytes(json.dumps(content, indent=1, sort_keys=True, default=str).encode())

    def create_exclusive(self, data: bytes) -> bool:
        """Write this file only if it does not exist yet; False when it does.

        Local: a hard link of a complete temporary file (O_EXCL where links are not
        supported). Object store: a conditional PUT; a store that cannot do one is refused,
        because a lock that two writers can both take is no lock."""
        if not data:
            # an empty body can take a path that skips the condition (s3fs touch)
            raise ValueError("create_exclusive needs a non-empty body")
        if self.local:
            return _create_local(Path(self.path), data)
        try:
            self.fs.pipe_file(self.path, data, mode="create")
        except FileExistsError:
            return False
        except (TypeError, NotImplementedError):
            raise BertpipeError(f"{self.url}: this filesystem ({protocol_of(self.url)}) offers "
                                "no create-if-absent write, which the store's lock needs") from None
        return True

    def remove(self) -> None:
        """This one file, if it is there."""
        if self.local:
            Path(self.path).unlink(missing_ok=True)
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path)

    def remove_tree(self) -> None:
        """This file, or this folder and everything in it; nothing else.

        Local: a link is removed, never followed. Object store: the key itself and the
        keys under `<key>/` only (a sibling `<key>2/...` shares the prefix, not the folder)."""
        if self.local:
            path = Path(self.path)
            if path.is_symlink() or not path.is_dir():
                path.unlink(missing_ok=True)
            else:
                shutil.rmtree(path)
            return
        base = self.path.rstrip("/")
        keys = [f"{base}/{rel}" for rel in self.files()]
        if self.is_file():
            keys.append(base)
        if keys:
            self.fs.rm(keys)
        self.fs.invalidate_cache(base)

    def move_to(self, target: Location) -> None:
        """This file or folder becomes `target`, replacing it. Local: one atomic rename
        (the way a version is switched to); an object store has no rename, so its keys are
        copied to the new name (server side), then the old ones removed."""
        if self.local and target.local:
            if Path(target.path).is_dir() and not Path(target.path).is_symlink():
                shutil.rmtree(target.path)  # a folder is replaced whole, never merged
            Path(target.path).parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.path, target.path)
            return
        target.remove_tree()
        if self.is_dir():
            self.copy_tree_to(target)
        else:
            self.fs.copy(self.path, target.path)
        self.remove_tree()

    def copy_tree_to(self, target: Location) -> None:
        """Object stores: copy every key under this folder to the same place under `target`
        (server side where the store can), then the caller removes the source."""
        for rel in self.files():
            self.fs.copy(f"{self.path.rstrip('/')}/{rel}", f"{target.path.rstrip('/')}/{rel}")


@dataclass(frozen=True)
class S3Access:
    """Where an s3:// location is and the credentials that reach it, found as s3fs finds
    them (the location's storage options, else the AWS variables botocore reads): one
    reading, which each library's own form is made from (Icechunk's storage, deltalake's
    options), so the two formats on object storage cannot reach it differently."""

    bucket: str
    prefix: str
    endpoint: str | None
    region: str
    key: str | None
    secret: str | None
    token: str | None

    @classmethod
    def of(cls, location: Location) -> S3Access:
        if not location.url.startswith("s3://"):
            raise ValueError(f"{location.url} is not an s3:// URL")
        bucket, _, prefix = location.url[len("s3://"):].partition("/")
        options = location.options
        client = options.get("client_kwargs") or {}
        endpoint = options.get("endpoint_url") or client.get("endpoint_url") or \
            os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = client.get("region_name") or os.environ.get("AWS_REGION") or \
            os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        return cls(bucket, prefix.rstrip("/"), endpoint, region, options.get("key"),
                   options.get("secret"), options.get("token"))

    @property
    def plain_http(self) -> bool:
        """An endpoint on plain HTTP (a server on loopback, an on-premises store)."""
        return bool(self.endpoint and self.endpoint.startswith("http://"))


def _create_local(path: Path, data: bytes) -> bool:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_bytes(data)
    try:
        os.link(tmp, path)  # atomic create-if-absent of a file that is already complete
        return True
    except FileExistsError:
        return False
    except OSError as exc:  # file systems without hard links
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True
    finally:
        tmp.unlink()


# resolving


def resolve(path: str | Path, options: Mapping[str, Any] | None = None,
            key: str = "storage_options") -> Location:
    """The Location of `path`: a local path (made absolute) or an fsspec URL. `options` are
    the job's storage options for it; without them, those registered for its prefix."""
    text = local_path(path)
    if not is_url(text):
        from fsspec.implementations.local import LocalFileSystem

        local = str(Path(text).expanduser().absolute())
        return Location(local, LocalFileSystem(), local)
    url = normalize_url(text)
    given = options if options is not None else registered_options(url)
    merged = merge(DEFAULTS.get(protocol_of(url), {}), expand(given or {}, key))
    fs = filesystem(protocol_of(url), merged)
    return Location(url, fs, fs._strip_protocol(url), merged)


def normalize_url(url: str) -> str:
    """`scheme://key` with no trailing slash and no doubled slashes in the key."""
    scheme, rest = url.split("://", 1)
    key = re.sub("/+", "/", rest).strip("/")
    return f"{scheme}://{key}"


def filesystem(protocol: str, options: Mapping[str, Any]) -> Any:
    """One filesystem per protocol, options and relevant environment (fsspec's own cache
    keys on the arguments only, and botocore reads the environment when it is made)."""
    import fsspec

    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    cache_key = json.dumps([protocol, dict(options), sorted(env.items())], sort_keys=True,
                           default=str)
    with _guard:
        fs = _filesystems.get(cache_key)
        if fs is None:
            try:
                fs = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
            except ImportError as exc:
                raise JobError(f"{protocol}:// needs an fsspec implementation that is not "
                               f"installed ({first_line(exc)}); for S3: pip install "
                               "'bertpipe[s3]'") from None
            except ValueError as exc:
                raise JobError(f"{protocol}://: unknown protocol ({first_line(exc)})") from None
            _filesystems[cache_key] = fs
        return fs


def register_options(url: str, options: Mapping[str, Any] | None) -> None:
    """Storage options for every URL under `url`, in this process (what a job's
    `output.storage_options` are for the formats, the verify and open calls that only
    get a path)."""
    if not is_url(url):
        return
    with _guard:
        if options:
            _registered[normalize_url(url)] = dict(options)
        else:
            _registered.pop(normalize_url(url), None)
    remember_secrets(options or {})


def registered_options(url: str) -> dict[str, Any]:
    """The options registered for the longest prefix of `url` (empty when none)."""
    url = normalize_url(url)
    best = ""
    for prefix in _registered:
        if (url == prefix or url.startswith(prefix + "/")) and len(prefix) > len(best):
            best = prefix
    return dict(_registered.get(best, {}))


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, nested mappings merged key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) \
            else v
    return out


def expand(options: Mapping[str, Any], key: str) -> dict[str, Any]:
    """`options` with every `${NAME}` string replaced by the environment variable's value."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        where = f"{key}.{name}"
        if isinstance(value, Mapping):
            out[name] = expand(value, where)
        elif value == REDACTED:
            continue  # read back from a provenance: the secret is the environment's now
        elif isinstance(value, str) and (ref := OPTION_REFERENCE.match(value)):
            env = os.environ.get(ref.group(1))
            if env is None:
                raise JobError(f"{where}: environment variable {ref.group(1)} is not set")
            _secrets.add(env)
            out[name] = env
        else:
            out[name] = value
    return out


def references(options: Mapping[str, Any], key: str) -> list[str]:
    """`${NAME}` references whose variable is not set here, as `key.sub: NAME` lines."""
    missing = []
    for name, value in options.items():
        where = f"{key}.{name}"
        if isinstance(value, Mapping):
            missing += references(value, where)
        elif isinstance(value, str) and (ref := OPTION_REFERENCE.match(value)) \
                and ref.group(1) not in os.environ:
            missing.append(f"{where}: environment variable {ref.group(1)} is not set")
    return missing


def remember_secrets(options: Mapping[str, Any]) -> None:
    """Literal strings of storage options are secrets as far as messages go."""
    for value in options.values():
        if isinstance(value, Mapping):
            remember_secrets(value)
        elif isinstance(value, str) and not OPTION_REFERENCE.match(value):
            _secrets.add(value)


def scrub(text: str) -> str:
    """`text` with every known secret (storage option values, credential variables of the
    environment) replaced by `***`."""
    secrets = set(_secrets) | {os.environ[k] for k in SECRET_ENV if os.environ.get(k)}
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= 6:  # why: a short value ("us", "true") is no secret and too common
            text = text.replace(secret, REDACTED)
    return text


# errors


CONNECT_ERRORS = ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError",
                  "ReadTimeoutError", "ClientConnectorError", "ServerDisconnectedError",
                  "FSTimeoutError", "ConnectionError")
CREDENTIAL_ERRORS = ("NoCredentialsError", "PartialCredentialsError", "InvalidConfigError",
                     "ProfileNotFound", "NoRegionError")


def storage_failure(exc: BaseException, url: str, key: str,
                    error: type[BertpipeError]) -> BertpipeError | None:
    """The one-line error for a failure to reach or use the filesystem of `url` (None when
    `exc` is something else): unreachable -> EndpointError (retry later), refused
    credentials -> `error` (fix the job's credentials)."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    reason = scrub(first_line(exc))
    if names & set(CONNECT_ERRORS) or isinstance(exc, (ConnectionError, TimeoutError)):
        return EndpointError(f"{key}: cannot reach the store at {url} ({reason}); nothing was "
                             "written: check the endpoint and the network, then rerun")
    if names & set(CREDENTIAL_ERRORS):
        return error(f"{key}: {url}: no usable credentials ({reason}); set them in the "
                     f"environment or in {key.split('.')[0]}.storage_options")
    if isinstance(exc, PermissionError):
        return error(f"{key}: {url}: access denied ({reason}); check the credentials and "
                     "their permissions for this bucket")
    return None


@contextlib.contextmanager
def storage_errors(url: str, key: str, error: type[BertpipeError]) -> Iterator[None]:
    """Turn a failure to reach or use a remote filesystem into a one-line error."""
    if not is_url(url):
        yield
        return
    try:
        yield
    except BertpipeError:
        raise
    except Exception as exc:
        failure = storage_failure(exc, url, key, error)
        if failure is None:
            raise
        raise failure from None


# Protocols whose first path component is a bucket (container) that must exist beforehand.
BUCKET_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az"})


def check_reachable(location: Location, key: str, error: type[BertpipeError]) -> None:
    """Fail fast, before anything is written, where the store could not be written: a
    local folder that cannot be made (a file in its way, no permission), an endpoint that
    cannot be reached or refuses the credentials, a bucket that does not exist."""
    if location.local:
        check_creatable(Path(location.path), key, error)
        return
    with storage_errors(location.url, key, error):
        location.info()  # S3: a HEAD and a prefix listing, each refused without credentials
        bucket = location.path.split("/", 1)[0]
        if protocol_of(location.url) in BUCKET_PROTOCOLS and not location.fs.exists(bucket):
            raise error(f"{key}: {location.url}: bucket {bucket!r} does not exist; create it "
                        "first, or fix the path (nothing was written)")


def check_creatable(path: Path, key: str, error: type[BertpipeError]) -> None:
    """`path` is a folder, or can be made: its nearest existing ancestor is a folder this
    process may write in."""
    if path.is_dir():
        return
    parent = next((p for p in path.parents if os.path.lexists(p)), None)
    if path.exists() or parent is None:
        return  # a file at `path` itself: the store's own checks name it
    if not parent.is_dir():
        raise error(f"{key}: cannot create {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise error(f"{key}: cannot create {path}: no permission to write in {parent}")


@contextlib.contextmanager
def disk_full_errors(path: str, key: str, error: type[BertpipeError]) -> Iterator[None]:
    """A write that fails for want of space (a full disk, a quota, a file-size limit) as
    one line: what was written stays (staged partitions, a store left incomplete), so a
    rerun resumes once there is room."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise
        reason = exc.strerror or first_line(exc)
        raise error(f"{key}: {path}: the disk is full or the file is too large ({reason}); "
                    "the store is left incomplete: free space (or raise the file size "
                    "limit) and rerun, the rerun resumes") from None

