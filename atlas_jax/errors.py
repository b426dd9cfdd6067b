"""Errors a request can meet, shared by the engine, AsyncLLM and the server.

InvalidRequestError: the request can never run as given (client error; HTTP 400). `param` names the
offending field, as OpenAI's error object does.
RequestFailedError: the engine failed this one request while serving it (HTTP 500); the others go on.
EngineDeadError: the engine itself is down (a device fault); nothing more is served.
"""
from __future__ import annotations


class InvalidRequestError(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestFailedError(RuntimeError):
    pass


class EngineDeadError(RuntimeError):
    pass
