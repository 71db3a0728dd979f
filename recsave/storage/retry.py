"""Retries of remote storage calls: which errors are transient, how long to wait between attempts,
and the StorageError a failure becomes (naming the path, the operation and the attempts)."""
from __future__ import annotations

import errno as errno_mod
import random
import time
from typing import Callable, List, Optional, TypeVar

from recsave import knobs
from recsave.errors import RecsaveError, StorageError

T = TypeVar("T")


def attempts() -> int:
    """Attempts one remote operation gets: the first plus knob ``io_retries`` retries."""
    return max(0, int(knobs.get("io_retries"))) + 1


def call(what: str, path: str, fn: Callable[[], T]) -> T:
    """fn(), retried on transient errors with :func:`backoff_s` between attempts. FileNotFoundError
    passes through (callers decide what a missing file means), and so do recsave's own errors; every
    other failure becomes a StorageError (:func:`failed`)."""
    total = attempts()
    for attempt in range(1, total + 1):
        try:
            return fn()
        except (FileNotFoundError, RecsaveError):
            raise
        except Exception as exc:  # classified below; anything not transient is raised at once
            if not is_transient(exc) or attempt == total:
                raise failed(exc, path, what, attempt, transient=is_transient(exc)) from exc
            time.sleep(backoff_s(attempt))
    raise AssertionError("unreachable")


def backoff_s(attempt: int) -> float:
    """Seconds to wait after failed attempt `attempt` (1-based): full jitter over an exponential
    bound, capped by the io_retry_max_s knob."""
    cap = float(knobs.get("io_retry_max_s"))
    bound = min(cap, float(knobs.get("io_retry_base_s")) * (2 ** (attempt - 1)))
    return random.uniform(bound / 2, bound)


def failed(exc: BaseException, path: str, what: str, attempt: int, *, transient: bool) -> StorageError:
    """The StorageError reported when `what` on `path` failed with `exc` at attempt `attempt`."""
    err = getattr(exc, "errno", None)
    detail = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    if transient:
        hint = (f"gave up after {attempt} attempt(s) (knob io_retries={knobs.get('io_retries')}); "
                f"check that the store is reachable")
    else:
        hint = f"not retried (a permanent error), attempt {attempt}"
    return StorageError(f"{path}: {what} failed: {detail}; {hint}", path=path,
                        errno=err if isinstance(err, int) else None)


# errno values of permanent conditions: retrying cannot help.
_PERMANENT_ERRNOS = {errno_mod.ENOENT, errno_mod.EACCES, errno_mod.EPERM, errno_mod.EINVAL, errno_mod.ENOSPC,
                     errno_mod.EROFS, errno_mod.EEXIST, errno_mod.ENOTDIR, errno_mod.EISDIR,
                     errno_mod.ENAMETOOLONG, getattr(errno_mod, "EDQUOT", errno_mod.ENOSPC),
                     errno_mod.EFBIG, errno_mod.ENOTEMPTY}
# errno values of conditions that pass: the store is busy, a connection dropped, a request timed out.
_TRANSIENT_ERRNOS = {errno_mod.EIO, getattr(errno_mod, "EREMOTEIO", errno_mod.EIO), errno_mod.EAGAIN,
                     errno_mod.EBUSY, errno_mod.ETIMEDOUT, errno_mod.ECONNRESET, errno_mod.ECONNREFUSED,
                     errno_mod.ECONNABORTED, errno_mod.EPIPE, errno_mod.ENETUNREACH, errno_mod.EHOSTUNREACH,
                     errno_mod.ENETDOWN}
# Error codes the store documents as "try again" (whatever their HTTP status: OperationAborted is a
# 409, a conflicting operation in progress on the same key).
_THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestLimitExceeded",
                   "TooManyRequestsException", "RequestTimeout", "RequestTimeoutException",
                   "ServiceUnavailable", "InternalError", "503", "500", "OperationAborted",
                   "PriorRequestNotComplete"}
_TRANSIENT_NAMES = {
    # botocore
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
    "ConnectionError", "HTTPClientError", "IncompleteReadError", "ResponseStreamingError",
    "ResponseParserError",
    # aiohttp
    "ClientConnectionError", "ClientConnectorError", "ServerDisconnectedError", "ClientPayloadError",
    "ClientOSError", "ServerTimeoutError", "ServerConnectionError",
    # fsspec / urllib3 / http.client
    "FSTimeoutError", "ProtocolError", "IncompleteRead", "RemoteDisconnected",
}


def _http_status(exc: BaseException) -> Optional[int]:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return int(status) if isinstance(status, int) else None
    status = getattr(exc, "status", None)  # aiohttp ClientResponseError
    return status if isinstance(status, int) else None


def _judge_one(exc: BaseException) -> Optional[bool]:
    """True: transient, False: permanent, None: this exception alone does not say."""
    if isinstance(exc, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError,
                        NotADirectoryError)):
        return False
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError: judge by error code and HTTP status
        code = str(response.get("Error", {}).get("Code", ""))
        status = _http_status(exc)
        if code in _THROTTLE_CODES or (status is not None and (status >= 500 or status == 429)):
            return True
        return False
    status = _http_status(exc)
    if status is not None:
        return status >= 500 or status in (408, 429)
    if isinstance(exc, (TimeoutError, ConnectionError)):  # asyncio.TimeoutError, socket.timeout too
        return True
    if any(k.__name__ in _TRANSIENT_NAMES for k in type(exc).__mro__):
        return True
    if isinstance(exc, OSError) and exc.errno is not None:
        if exc.errno in _PERMANENT_ERRNOS:
            return False
        if exc.errno in _TRANSIENT_ERRNOS:
            return True
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the failed remote operation may succeed. Looks at the exception and its
    causes (s3fs translates a botocore ClientError into an OSError whose cause is the original)."""
    chain: List[BaseException] = []
    cur: Optional[BaseException] = exc
    while cur is not None and len(chain) < 8:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    # The server's own answer first: s3fs wraps error codes it does not map (a 400
    # XAmzContentSHA256Mismatch, a KMS refusal) as OSError(EIO), which alone reads as transient.
    # Only botocore's parsed response counts here: an aiohttp error's status may be the client's
    # own (400 for a garbled status line, under botocore's transient HTTPClientError).
    for link in chain:
        if isinstance(getattr(link, "response", None), dict):
            return bool(_judge_one(link))
    for link in chain:
        verdict = _judge_one(link)
        if verdict is not None:
            return verdict
    return False
