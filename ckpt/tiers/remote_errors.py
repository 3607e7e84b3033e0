"""What a store client's failure means, told from exception types and errno, never from message text:
an outage (:func:`unavailable`: the store could not be reached or did not answer), refused credentials
(:func:`denied`), or an answer; and the errno and HTTP status under a client's own exception.

No store client is imported here: the exception classes are those of the clients that are loaded."""

from __future__ import annotations

import asyncio
import errno
import socket
import sys

__all__ = ["unavailable", "http_status", "denied", "errno_of", "caused_by", "failure_type"]

# errno values of a store that cannot be reached or does not answer now (s3fs: 503 / SlowDown is EBUSY,
# 500 InternalError EREMOTEIO); a stale NFS handle on a mounted file:// URL too
_UNAVAILABLE_ERRNOS = frozenset(
    getattr(errno, n)
    for n in (
        "ECONNREFUSED",
        "ECONNRESET",
        "ECONNABORTED",
        "EPIPE",
        "ETIMEDOUT",
        "EHOSTUNREACH",
        "EHOSTDOWN",
        "ENETUNREACH",
        "ENETDOWN",
        "ENETRESET",
        "EBUSY",
        "EAGAIN",
        "EREMOTEIO",
        "ESTALE",
    )
    if hasattr(errno, n)
)


def _client_types(*names: tuple[str, str]) -> tuple[type, ...]:
    """Exception classes of store clients that are loaded (none is imported here)."""
    found = []
    for module, name in names:
        t = getattr(sys.modules.get(module), name, None)
        if isinstance(t, type):
            found.append(t)
    return tuple(found)


def unavailable(e: BaseException) -> bool:
    """Whether ``e`` says the store could not be reached or did not answer (an outage), rather than
    answering (missing bucket, refused credentials, a bad request)."""
    if isinstance(e, (ConnectionError, TimeoutError, asyncio.TimeoutError, socket.gaierror, socket.herror)):
        return True
    if http_status(e) >= 500:  # the service failing (a gateway's 502 / 504 has no S3 error code)
        return True
    if isinstance(e, OSError):
        return e.errno in _UNAVAILABLE_ERRNOS
    return isinstance(
        e,
        _client_types(
            ("botocore.exceptions", "ConnectionError"),  # EndpointConnectionError, ConnectTimeoutError ...
            ("botocore.exceptions", "HTTPClientError"),  # ConnectionClosedError, ReadTimeoutError ...
            ("aiohttp", "ClientConnectionError"),
            ("aiohttp", "ServerTimeoutError"),
            ("fsspec.exceptions", "FSTimeoutError"),
        ),
    )


def http_status(e: BaseException | None) -> int:
    """The HTTP status of the store's answer under ``e`` (0: none), from the client error's own fields:
    botocore's ``response`` (s3fs raises an ``OSError`` caused by it), aiohttp's ``status``."""
    answered = _client_types(("botocore.exceptions", "ClientError"), ("aiohttp", "ClientResponseError"))
    for _ in range(8):
        if e is None:
            break
        if answered and isinstance(e, answered):
            response = getattr(e, "response", None)
            status = (
                (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
                if isinstance(response, dict)
                else getattr(e, "status", None)
            )
            return status if isinstance(status, int) else 0
        e = e.__cause__ or e.__context__
    return 0


def denied(e: BaseException) -> bool:
    return isinstance(e, PermissionError) or isinstance(
        e,
        _client_types(
            ("botocore.exceptions", "NoCredentialsError"), ("botocore.exceptions", "PartialCredentialsError")
        ),
    )


def errno_of(e: BaseException) -> int | None:
    """The errno of ``e`` or of the OS error under it (a client error wrapping a refused connection)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and isinstance(e.errno, int) and e.errno > 0:
            return e.errno
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def caused_by(e: BaseException, origin: BaseException) -> bool:
    """Whether ``origin`` is ``e`` or in the chain of exceptions under it (``__cause__`` / ``__context__``)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if e is origin:
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def failure_type(e: BaseException) -> type[OSError]:
    """The built-in ``OSError`` that says what the store failure ``e`` is, for the library to raise in its
    place: ``FileNotFoundError`` (not there), ``PermissionError`` (refused credentials, :func:`denied`),
    ``ConnectionError`` (an outage, :func:`unavailable`), else ``OSError`` (an answer that is an error).
    The one classifier of storage failures: the tiers' store client and the DCP adapter both ask it."""
    if isinstance(e, FileNotFoundError):
        return FileNotFoundError
    if denied(e):
        return PermissionError
    if unavailable(e):
        return ConnectionError
    return OSError
