"""The API's errors: every way a request can be wrong ends as an ``ApiError`` that names the
offending field (``param``) in OpenAI's error shape."""

from __future__ import annotations

import re
from typing import Any


class ApiError(Exception):
    """An error the client gets as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _ERROR_TYPES.get(status, "server_error")
        self.code = code
        self.headers = headers  # extra response headers (``Connection: close``, ...)

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": clean_library_message(self.message), "type": self.type,
                          "param": self.param, "code": self.code}}


# What native libraries (xgrammar's C++ logging) put into their exception texts and clients
# must not see: a ``[21:50:43]`` timestamp and the build's source path with its line
# (``/project/cpp/regex_converter.cc:83:``).
_LOG_TIMESTAMP = re.compile(r"\[\d{1,2}:\d{2}:\d{2}(?:\.\d+)?\]\s*")
_SOURCE_PATH = re.compile(
    r"(?:[A-Za-z]:)?(?:[/\\][\w.+@-]+)+\.(?:cc|cpp|cxx|c|h|hpp|hh|cu|cuh|py|pyx|rs)"
    r"(?::\d+)*:?\s*")


def clean_library_message(message: str) -> str:
    """``message`` without log timestamps and source paths (``[21:50:43]
    /project/cpp/regex_converter.cc:83: Invalid regex`` -> ``Invalid regex``): what a
    library's exception text may carry of the machine it was built or runs on."""
    if "[" not in message and "/" not in message and "\\" not in message:
        return message
    return _SOURCE_PATH.sub("", _LOG_TIMESTAMP.sub("", message)).strip() or "error"


_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                403: "invalid_request_error", 404: "invalid_request_error",
                408: "timeout_error", 413: "invalid_request_error",
                503: "service_unavailable"}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code=code)
