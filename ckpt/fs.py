"""Which client serves a remote tier's URL (its *backend*), resolved once per tier, and what that
client's failures mean.

Every backend is an fsspec file system, so the remote tier has one code path whatever the client:

============  ==============================  =======================================================
scheme        backends                        default
============  ==============================  =======================================================
``s3://``     ``"s3fs"``, ``"arrow"``         ``"s3fs"``
``hdfs://``   ``"arrow"``, ``"hdfs-native"``  ``"arrow"``
``file://``   ``"fsspec"``, ``"arrow"``       ``"fsspec"``
any other     ``"fsspec"``                    ``"fsspec"`` (whatever fsspec registers for the scheme)
============  ==============================  =======================================================

``"arrow"`` is pyarrow's C++ file system (``pyarrow.fs.S3FileSystem``, ``HadoopFileSystem``,
``LocalFileSystem``) seen through fsspec's ``ArrowFSWrapper``; ``"s3fs"`` is s3fs (botocore);
``"hdfs-native"`` is the Rust HDFS client of the ``hdfs-native`` package (no JVM). The choice is,
first match wins: ``storage_options["backend"]``, then the environment variable
``CKPT_S3_BACKEND`` / ``CKPT_HDFS_BACKEND`` / ``CKPT_FILE_BACKEND``, then the default above.
Chained URLs (``simplecache::s3://...``) always go through fsspec as they are.

**What names a remote tier** (:func:`is_url`, applied by :func:`resolve`, so the same for the
``Checkpointer``, :func:`ckpt.promote`, :func:`ckpt.export`, the DCP adapter and every ``ckpt``
command): a URL, ``scheme://...`` (or a chained ``a::b://...``) whose every scheme fsspec knows
(``fsspec.available_protocols()``). A path without a scheme is a local tier's directory, never a remote
tier: a directory as a remote tier is ``file:///abs/path``. Text that starts like a URL of a known scheme
but lacks its ``//`` (``s3:/bucket/run``, ``s3:bucket``) is a mistyped URL, refused, rather than a
relative path ``./s3:/bucket/run``; so is a URL of an unknown scheme, with the schemes fsspec knows.

The same ``storage_options`` work with both S3 backends: s3fs's names (``key``, ``secret``,
``token``, ``anon``, ``endpoint_url``, ``client_kwargs={"region_name": ...}``, ``config_kwargs=
{"retries": ..., "connect_timeout": ..., "read_timeout": ..., "s3": {"addressing_style": ...}}``) are
translated for pyarrow, and pyarrow's own ``S3FileSystem`` arguments pass through; any other key is
refused with an error naming it (rather than silently ignored). A bucket is never created.

s3fs is the default for ``s3://``: on the 2-core development machine against moto's server, pyarrow
downloaded and verified a 1 GiB state 1.8-1.9x faster, but uploaded it 2-3x slower (it sends each
16 MiB part as a multipart upload of its own) and reads ranges of one large object 2x slower
(docs/benchmarks.md); s3fs also reports every failure with a type of its own.

pyarrow reports most S3 failures as a plain ``OSError`` whose only detail is its message, which is
never parsed here: such a failure is classified by a check of our own (:meth:`Store.translate`), one
plain HTTP request to the endpoint. No answer, a refused or dropped connection, or a 5xx answer is an
outage (``ConnectionError``); a store that answers while refusing the probe's request for the bucket
refuses the credentials, the bucket's policy or the region (``PermissionError``).
"""

from __future__ import annotations

import ctypes.util
import dataclasses
import errno
import glob
import http.client
import os
import re
from typing import Any, Callable
from urllib.parse import urlsplit

import fsspec
from fsspec.implementations.arrow import ArrowFSWrapper  # imports no pyarrow (it is loaded on use)

__all__ = [
    "Store",
    "MissingBackendError",
    "resolve",
    "is_url",
    "check_url",
    "is_local_fs",
    "local_tier_dir",
    "BACKENDS",
    "hdfs_arrow_missing",
]

#: the backends each scheme family can use, its default first
BACKENDS: dict[str, tuple[str, ...]] = {
    "s3": ("s3fs", "arrow"),
    "hdfs": ("arrow", "hdfs-native"),
    "file": ("fsspec", "arrow"),
}
_FAMILY = {"s3": "s3", "s3a": "s3", "hdfs": "hdfs", "file": "file", "local": "file"}

#: seconds our own reachability check (one HTTP request to the endpoint) may take
_CHECK_S = 5.0


class MissingBackendError(ImportError):
    """The backend chosen for a remote tier's URL cannot run here. ``backend``: its name;
    ``missing``: what it lacks (``"pyarrow"``, ``"hdfs-native"``, ``"java"``, ``"libhdfs"``,
    ``"hadoop-jars"``), each named in the message with how to install it."""

    def __init__(self, message: str, backend: str, missing: tuple[str, ...]) -> None:
        super().__init__(message, name=missing[0] if missing else None)
        self.backend = backend
        self.missing = missing


@dataclasses.dataclass(frozen=True)
class Store:
    """A remote tier's resolved store: ``fs`` (the file system for uploads and reads), ``root`` (the
    tier's path in it), ``backend``, ``probe_fs`` (a client of its own for the bounded reachability
    probe: few retries, short timeouts), ``endpoint`` (how messages name where the store is) and
    ``hint`` (what the user checks when it cannot be reached)."""

    fs: Any
    root: str
    backend: str
    probe_fs: Any
    endpoint: str
    hint: str
    #: our own reachability check (None: the client's exception types say it themselves)
    check: Callable[[], OSError | None] | None = None

    def translate(self, e: BaseException, probing: bool = False) -> BaseException:
        """``e`` as an exception whose type says what happened. A failure the client reports as a plain
        ``OSError`` without errno (pyarrow's S3 client) is classified by our own check of the endpoint:
        a ``ConnectionError`` when the store cannot be reached or answers 5xx; when it answers, a
        ``PermissionError`` while ``probing`` (the probe's requests for the bucket were refused) and
        ``e`` itself otherwise. Anything else is returned as it is."""
        if self.check is None or type(e) is not OSError or e.errno:
            return e
        down = self.check()
        if down is not None:
            out: OSError = ConnectionError(down.errno, f"{e} [the store at {self.endpoint} {down.strerror}]")
        elif probing:
            out = PermissionError(
                errno.EACCES,
                f"{e} [the store at {self.endpoint} answers, and refused the request for the bucket]",
            )
        else:
            return e
        out.__cause__ = e
        return out


#: a scheme at the start of a text, then ':' (a URL's, or a mistyped URL's)
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):")


def _schemes(url: str) -> list[str]:
    """The schemes of a URL, one per link of a chained URL (``simplecache::s3://b`` -> simplecache, s3)."""
    return [part.split("://", 1)[0] if "://" in part else part for part in url.split("::")]


def is_url(location: str | os.PathLike) -> bool:
    """Whether ``location`` names a place by URL (the module docstring's rule) rather than by a path on this
    machine. Raises ``ValueError`` naming it for a mistyped URL (a known scheme without its ``//``:
    ``s3:/bucket/run``) and for a URL whose scheme fsspec does not know, listing those it knows."""
    text = os.fspath(location)
    if not isinstance(text, str):
        raise ValueError(f"a location must be a path or a URL string, got {text!r}")
    known = set(fsspec.available_protocols())
    if "://" in text:
        unknown = [s for s in _schemes(text) if s.lower() not in known]
        if unknown:
            raise ValueError(
                f"{text!r}: unknown URL scheme {unknown[0]!r} (a typo? fsspec knows "
                f"{', '.join(sorted(known))}; a scheme of a package not installed here, such as gcsfs "
                "for gs://, is known once it is installed)"
            )
        return True
    m = _SCHEME_RE.match(text)
    if m and m.group(1).lower() in known:
        scheme, rest = m.group(1), text[m.end() :].lstrip("/")
        raise ValueError(
            f"{text!r} looks like a mistyped URL ({scheme}: without '//'); write "
            f"{scheme}://{rest} (a directory: file:///absolute/path), or ./{text} for a local "
            "directory of that name"
        )
    return False


def check_url(url: str | os.PathLike, argument: str = "url") -> str:
    """``url`` if it names a remote tier (:func:`is_url`); else ``ValueError`` naming ``argument``: a path is
    a local tier (``local_dir``), and a directory as a remote tier is a ``file://`` URL."""
    if not is_url(url):
        path = os.path.abspath(os.path.expanduser(os.fspath(url)))
        raise ValueError(
            f"{argument}={os.fspath(url)!r} is a path, not a URL: a remote tier is named by a URL "
            f"(s3://bucket/run, file://{path} for a directory); a path is a local tier (local_dir=, "
            "or a ckpt command's DIR)"
        )
    return os.fspath(url)


def is_local_fs(fs: Any) -> bool:
    """Whether an fsspec file system is the local one (a ``file://`` URL: real directories, and a
    page cache between a write and the disk)."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return any(p in ("file", "local") for p in protocols)


def local_tier_dir(url: str, storage_options: dict[str, Any] | None = None) -> str | None:
    """The directory of ``url`` when it is a ``file://`` URL of a local tier's directory (one a Checkpointer's
    ``local_dir`` made: it holds the owner lock file, whatever else it holds), else ``None``. Every command
    reads such a URL as that local tier (:func:`ckpt.tiers.locate.open_tier`)."""
    from .tiers.local import LOCK_NAME

    store = resolve(url, storage_options)
    if is_local_fs(store.fs) and os.path.lexists(os.path.join(store.root, LOCK_NAME)):
        return store.root
    return None


def resolve(url: str, storage_options: dict[str, Any] | None = None) -> Store:
    """The store for ``url``: the backend chosen as the module docstring says, built once from
    ``storage_options`` (without the ``"backend"`` key). The one way this library opens a URL: the
    remote tier, the commands, export and the DCP adapter all call it. Raises ``ValueError`` for
    what is not a URL (:func:`check_url`), an unknown backend or an option the backend cannot take,
    :class:`MissingBackendError` when it cannot run here."""
    check_url(url)
    opts = dict(storage_options or {})
    chosen = opts.pop("backend", None)
    protocol = fsspec.utils.get_protocol(url)
    family = _FAMILY.get(protocol)
    if "::" in url or family is None:
        if chosen not in (None, "fsspec"):
            raise ValueError(
                f"storage_options['backend']={chosen!r} for {url!r}: only 's3://', 'hdfs://' and "
                "'file://' URLs have a choice of backend (chained URLs go through fsspec as they are); "
                "drop the key"
            )
        return _fsspec(url, opts)
    env = f"CKPT_{family.upper()}_BACKEND"
    source = "storage_options['backend']" if chosen is not None else env
    if chosen is None:
        chosen = os.environ.get(env) or BACKENDS[family][0]
    if chosen not in BACKENDS[family]:
        raise ValueError(
            f"{source}={chosen!r} for {url!r}: a {protocol}:// URL can use "
            f"{' or '.join(map(repr, BACKENDS[family]))}"
        )
    if chosen == "arrow":
        return {"s3": _arrow_s3, "hdfs": _arrow_hdfs, "file": _arrow_local}[family](url, opts)
    if chosen == "hdfs-native":
        return _native_hdfs(url, opts)
    return _fsspec(url, opts)


# -- fsspec's own file systems (s3fs for s3://) --------------------------------------------------------


def with_retry_defaults(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """s3fs's options with this library's upload retry policy unless they set one: botocore's
    "standard" mode, 10 attempts (5xx answers, throttling, dropped connections, timeouts)."""
    protocols = fsspec.utils.get_protocol(url).split("::")
    opts = dict(options)
    if any(p in ("s3", "s3a") for p in protocols):
        cfg = dict(opts.get("config_kwargs") or {})
        cfg.setdefault("retries", {"max_attempts": 10, "mode": "standard"})
        opts["config_kwargs"] = cfg
    return opts


#: the reachability probe's own client settings on S3: an answer or a failure within seconds,
#: whatever retry policy ``storage_options`` sets for uploads
PROBE_CONNECT_S, PROBE_READ_S, PROBE_ATTEMPTS = 5, 10, 2


def probe_options(options: dict[str, Any]) -> dict[str, Any]:
    """s3fs's options for the probe's own client (2 attempts, short timeouts, not the cached client)."""
    opts = dict(options)
    cfg = dict(opts.get("config_kwargs") or {})
    cfg["retries"] = {"max_attempts": PROBE_ATTEMPTS, "mode": "standard"}
    cfg["connect_timeout"] = min(cfg.get("connect_timeout", PROBE_CONNECT_S), PROBE_CONNECT_S)
    cfg["read_timeout"] = min(cfg.get("read_timeout", PROBE_READ_S), PROBE_READ_S)
    opts.update(config_kwargs=cfg, skip_instance_cache=True)
    return opts


def _fsspec(url: str, opts: dict[str, Any]) -> Store:
    fs, root = fsspec.core.url_to_fs(url, **with_retry_defaults(url, opts))
    probe_fs, protocol = fs, fsspec.utils.get_protocol(url)
    if protocol in ("s3", "s3a") and "::" not in url:
        probe_fs = fsspec.core.url_to_fs(url, **probe_options(opts))[0]
        probe_fs.retries = 1  # s3fs's own retry loop around botocore's (a class attribute, 5): once
    return Store(
        fs, root.rstrip("/"), "s3fs" if protocol in ("s3", "s3a") else "fsspec", probe_fs, *_where(url, opts)
    )


def _where(url: str, opts: dict[str, Any]) -> tuple[str, str]:
    """(endpoint, hint) for messages about a store that cannot be reached."""
    family = _FAMILY.get(fsspec.utils.get_protocol(url))
    if family == "hdfs":
        u = urlsplit(url)
        if u.hostname:
            return (
                f"namenode {u.hostname}:{u.port or 8020}",
                "check the namenode's host and port in the URL and the network",
            )
        return (
            "the namenode of fs.defaultFS (no host in the URL)",
            "check fs.defaultFS in core-site.xml and the network",
        )
    ep = (
        opts.get("endpoint_url")
        or (opts.get("client_kwargs") or {}).get("endpoint_url")
        or opts.get("endpoint_override")
    )
    endpoint = f"endpoint_url={ep!r}" if ep else "the default endpoint (no endpoint_url in storage_options)"
    return endpoint, "check endpoint_url in storage_options and the network"


# -- pyarrow's file systems through fsspec ----------------------------------------------------------------


class ArrowFileSystem(ArrowFSWrapper):
    """fsspec's ``ArrowFSWrapper`` with ranged reads that work on every pyarrow file system (the
    wrapper's own ``cat_file`` seeks a non-seekable stream when asked for a range from 0), and a
    ``file`` protocol for pyarrow's local file system (so it counts as local, and URLs in messages
    read ``file://...``)."""

    @property
    def protocol(self):  # noqa: D102 - fsspec's attribute
        name = self.fs.type_name
        return ("file", "local") if name == "local" else name

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        path = self._strip_protocol(path)
        if not start and end is None:
            with self.fs.open_input_stream(path, compression=None) as f:
                return f.read()
        with self.fs.open_input_file(path) as f:  # a ranged read: the store sends only [start, end)
            size = f.size()
            lo = 0 if start is None else start if start >= 0 else max(0, size + start)
            hi = size if end is None else min(size, end if end >= 0 else size + end)
            return f.read_at(hi - lo, lo) if hi > lo else b""


def _pyarrow_fs(backend: str) -> Any:
    try:
        import pyarrow.fs
    except ImportError as e:
        raise MissingBackendError(
            f"the {backend!r} backend needs pyarrow: pip install 'tierckpt[arrow]' "
            "(or pick another backend with storage_options['backend'])",
            backend,
            ("pyarrow",),
        ) from e
    return pyarrow.fs


#: pyarrow.fs.S3FileSystem's own keyword arguments (passed through as they are)
_S3_NATIVE = frozenset(
    (
        "access_key",
        "secret_key",
        "session_token",
        "anonymous",
        "region",
        "request_timeout",
        "connect_timeout",
        "scheme",
        "endpoint_override",
        "background_writes",
        "default_metadata",
        "role_arn",
        "session_name",
        "external_id",
        "load_frequency",
        "proxy_options",
        "allow_delayed_open",
        "allow_bucket_creation",
        "allow_bucket_deletion",
        "check_directory_existence_before_creation",
        "retry_strategy",
        "force_virtual_addressing",
        "tls_ca_file_path",
    )
)
#: s3fs options about s3fs's own caches, which pyarrow does not have: nothing to translate
_S3FS_CACHES = frozenset(
    ("skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths", "cache_regions")
)


def arrow_s3_options(options: dict[str, Any], attempts: int = 10) -> dict[str, Any]:
    """pyarrow ``S3FileSystem`` keyword arguments for s3fs-style ``storage_options`` (see the module
    docstring); ``attempts``: the retry policy's attempts unless the options set one. Raises
    ``ValueError`` naming any key it cannot translate."""
    pafs = _pyarrow_fs("arrow")
    o = dict(options)
    client, config = dict(o.pop("client_kwargs", None) or {}), dict(o.pop("config_kwargs", None) or {})
    kw: dict[str, Any] = {}
    for ours, theirs in (
        ("key", "access_key"),
        ("secret", "secret_key"),
        ("token", "session_token"),
        ("anon", "anonymous"),
    ):
        if ours in o:
            kw[theirs] = o.pop(ours)
    endpoint = o.pop("endpoint_url", None) or client.pop("endpoint_url", None)
    if endpoint:
        u = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        kw.update(scheme=u.scheme, endpoint_override=u.netloc + u.path.rstrip("/"))
    if "region_name" in client:
        kw["region"] = client.pop("region_name")
    retries = config.pop("retries", None) or {}
    strategy = (
        pafs.AwsDefaultS3RetryStrategy if retries.get("mode") == "legacy" else pafs.AwsStandardS3RetryStrategy
    )
    kw["retry_strategy"] = strategy(max_attempts=int(retries.get("max_attempts", attempts)))
    if "connect_timeout" in config:
        kw["connect_timeout"] = float(config.pop("connect_timeout"))
    if "read_timeout" in config:
        kw["request_timeout"] = float(config.pop("read_timeout"))
    style = (config.pop("s3", None) or {}).get("addressing_style")
    if style is not None:
        kw["force_virtual_addressing"] = style == "virtual"
    for k in _S3FS_CACHES:
        o.pop(k, None)
    native = {k: o.pop(k) for k in list(o) if k in _S3_NATIVE}
    left = (
        sorted(o)
        + [f"client_kwargs[{k!r}]" for k in sorted(client)]
        + [f"config_kwargs[{k!r}]" for k in sorted(config)]
    )
    if left:
        raise ValueError(
            f"storage_options {', '.join(left)} have no equivalent in pyarrow's S3 client (backend "
            "'arrow'): drop them, use pyarrow.fs.S3FileSystem's own argument names, or set "
            "storage_options['backend'] = 's3fs'"
        )
    kw.update(native)
    kw.setdefault(
        "allow_delayed_open", True
    )  # a part that fits one request is one PUT, not a multipart upload
    return kw


def _arrow_s3(url: str, opts: dict[str, Any]) -> Store:
    pafs = _pyarrow_fs("arrow")
    root = url.split("://", 1)[1].strip("/")
    kw = arrow_s3_options(opts)
    if "region" not in kw and "endpoint_override" not in kw and root:
        try:  # AWS itself: the bucket's region, as s3fs finds it (one unsigned request)
            kw["region"] = pafs.resolve_s3_region(root.split("/", 1)[0])
        except OSError:
            pass  # unreachable or no such bucket: the probe says which, by our own check
    probe_kw = dict(
        kw,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=PROBE_ATTEMPTS),
        connect_timeout=min(float(kw.get("connect_timeout") or PROBE_CONNECT_S), PROBE_CONNECT_S),
    )
    fs = ArrowFileSystem(pafs.S3FileSystem(**kw), skip_instance_cache=True)
    probe_fs = ArrowFileSystem(pafs.S3FileSystem(**probe_kw), skip_instance_cache=True)
    scheme = kw.get("scheme") or "https"
    host = kw.get("endpoint_override") or (
        f"s3.{kw['region']}.amazonaws.com" if kw.get("region") else "s3.amazonaws.com"
    )
    endpoint, hint = _where(url, opts)
    return Store(fs, root, "arrow", probe_fs, endpoint, hint, check=lambda: http_answers(scheme, host))


def http_answers(scheme: str, netloc: str, timeout: float = _CHECK_S) -> OSError | None:
    """Our own reachability check of an HTTP endpoint: one ``HEAD /``. ``None`` when it answers below
    500; else a ``ConnectionError`` whose errno says how it failed (refused, reset or dropped, timed
    out; ``EBUSY`` for 503, ``EREMOTEIO`` for another 5xx, as s3fs reports those)."""
    host, _, port = netloc.split("/", 1)[0].rpartition(":")
    if not host or not port.isdigit():
        host, port = netloc.split("/", 1)[0], ""
    cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    conn = cls(host.strip("[]"), int(port) if port else None, timeout=timeout)
    try:
        conn.request("HEAD", "/")
        status = conn.getresponse().status
    except TimeoutError:
        return ConnectionError(errno.ETIMEDOUT, f"did not answer within {timeout:g} s")
    except OSError as e:  # refused, reset, unreachable, TLS
        code = e.errno if isinstance(e.errno, int) and e.errno > 0 else errno.ECONNRESET
        return ConnectionError(code, f"could not be reached ({type(e).__name__}: {os.strerror(code)})")
    except http.client.HTTPException as e:  # a connection closed without a valid answer
        return ConnectionError(errno.ECONNRESET, f"sent no valid HTTP answer ({type(e).__name__})")
    finally:
        conn.close()
    if status >= 500:
        return ConnectionError(errno.EBUSY if status == 503 else errno.EREMOTEIO, f"answers HTTP {status}")
    return None


def _arrow_local(url: str, opts: dict[str, Any]) -> Store:
    pafs = _pyarrow_fs("arrow")
    if opts:
        raise ValueError(
            f"storage_options {sorted(opts)} for {url!r}: pyarrow's local file system takes none"
        )
    fs = ArrowFileSystem(pafs.LocalFileSystem(), skip_instance_cache=True)
    root = fs._strip_protocol(url).rstrip("/") or "/"
    return Store(fs, root, "arrow", fs, f"the local file system ({root})", "check the path")


# -- HDFS: pyarrow's libhdfs client (JVM) or hdfs-native (Rust) ------------------------------------------

#: pyarrow.fs.HadoopFileSystem's keyword arguments (besides host and port, which come from the URL)
_HDFS_NATIVE = frozenset(
    ("user", "replication", "buffer_size", "default_block_size", "kerb_ticket", "extra_conf")
)


def _arrow_hdfs(url: str, opts: dict[str, Any]) -> Store:
    pafs = _pyarrow_fs("arrow")
    u = urlsplit(url)
    unknown = sorted(set(opts) - _HDFS_NATIVE)
    if unknown:
        raise ValueError(
            f"storage_options {unknown} for {url!r}: pyarrow's HadoopFileSystem takes "
            f"{sorted(_HDFS_NATIVE)} (Hadoop settings go in extra_conf)"
        )
    kw = dict(opts)
    if u.username and "user" not in kw:
        kw["user"] = u.username
    host, port = (u.hostname, u.port or 8020) if u.hostname else ("default", 0)
    try:
        hdfs = pafs.HadoopFileSystem(host, port, **kw)
    except Exception as e:
        missing = hdfs_arrow_missing()
        if missing:
            raise MissingBackendError(_hdfs_missing_message(url, missing), "arrow", missing) from e
        raise
    return Store(
        ArrowFileSystem(hdfs, skip_instance_cache=True),
        u.path.rstrip("/") or "/",
        "arrow",
        ArrowFileSystem(hdfs, skip_instance_cache=True),
        *_where(url, opts),
    )


#: where pyarrow looks for libjvm when JAVA_HOME is not set (arrow/io/hdfs_internal.cc), and under each
_JVM_PREFIXES = (
    "/usr/lib/jvm/default-java",
    "/usr/lib/jvm/java",
    "/usr/lib/jvm",
    "/usr/lib64/jvm",
    "/usr/local/lib/jvm/default-java",
    "/usr/local/lib/jvm/java",
    "/usr/local/lib/jvm",
    "/usr/local/lib64/jvm",
    "/usr/lib/jvm/default",
    "/usr/java/latest",
)
_JVM_SUFFIXES = ("", "lib/server", "jre/lib/amd64/server", "lib/amd64/server")


def hdfs_arrow_missing(env: dict[str, str] | None = None) -> tuple[str, ...]:
    """What pyarrow's HDFS client lacks here, by our own look at the places it searches (``env``:
    the environment, default ``os.environ``): ``"java"`` (a JVM's libjvm.so: JAVA_HOME),
    ``"libhdfs"`` (Hadoop's native client library: HADOOP_HOME/lib/native, ARROW_LIBHDFS_DIR or the
    loader's path) and ``"hadoop-jars"`` (Hadoop's jars on CLASSPATH, which libhdfs starts the JVM
    with). Empty when all three are found."""
    env = os.environ if env is None else env
    missing = []
    java = env.get("JAVA_HOME")
    prefixes = (java,) if java else _JVM_PREFIXES
    if not any(
        os.path.isfile(os.path.join(p, s, "libjvm.so")) for p in prefixes for s in _JVM_SUFFIXES
    ) and not (env is os.environ and ctypes.util.find_library("jvm")):
        missing.append("java")
    dirs = [
        env.get("ARROW_LIBHDFS_DIR") or "",
        os.path.join(env.get("HADOOP_HOME") or "", "lib", "native") if env.get("HADOOP_HOME") else "",
    ] + (env.get("LD_LIBRARY_PATH") or "").split(os.pathsep)
    if not any(d and os.path.isfile(os.path.join(d, "libhdfs.so")) for d in dirs) and not (
        env is os.environ and ctypes.util.find_library("hdfs")
    ):
        missing.append("libhdfs")
    if not any(
        _has_hadoop_common(entry) for entry in (env.get("CLASSPATH") or "").split(os.pathsep) if entry
    ):
        missing.append("hadoop-jars")
    return tuple(missing)


def _has_hadoop_common(entry: str) -> bool:
    name = os.path.basename(entry)
    if name.endswith(".jar"):
        return name.startswith("hadoop-common") and os.path.isfile(entry)
    folder = entry[:-1] if entry.endswith("*") else entry
    return bool(glob.glob(os.path.join(folder, "hadoop-common*.jar")))


_HDFS_INSTALL = {
    "java": "a Java runtime (set JAVA_HOME to a JDK/JRE holding lib/server/libjvm.so)",
    "libhdfs": "Hadoop's native client libhdfs.so (in a Hadoop release's lib/native: set HADOOP_HOME, or "
    "ARROW_LIBHDFS_DIR to the folder holding it)",
    "hadoop-jars": "Hadoop's jars on CLASSPATH (export CLASSPATH=$($HADOOP_HOME/bin/hadoop classpath --glob))",
}


def _hdfs_missing_message(url: str, missing: tuple[str, ...]) -> str:
    needs = "; ".join(_HDFS_INSTALL[m] for m in missing)
    return (
        f"{url}: pyarrow's HDFS client (backend 'arrow', libhdfs through a JVM) cannot start here; it "
        f"needs {needs}. Or use the Rust client, which needs none of these: pip install hdfs-native, and "
        "storage_options={'backend': 'hdfs-native'} (or CKPT_HDFS_BACKEND=hdfs-native)"
    )


def _native_hdfs(url: str, opts: dict[str, Any]) -> Store:
    try:
        from hdfs_native.fsspec import HdfsFileSystem
    except ImportError as e:
        raise MissingBackendError(
            f"{url}: the 'hdfs-native' backend needs the hdfs-native package: pip install hdfs-native",
            "hdfs-native",
            ("hdfs-native",),
        ) from e
    u = urlsplit(url)
    # storage_options are Hadoop configuration keys here (e.g. dfs.ha.namenodes.<nameservice>)
    fs = HdfsFileSystem(
        host=u.hostname, port=u.port, skip_instance_cache=True, **{k: str(v) for k, v in opts.items()}
    )
    return Store(fs, u.path.rstrip("/") or "/", "hdfs-native", fs, *_where(url, opts))
