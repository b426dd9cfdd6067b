"""Errors a request can meet, shared by the engine, AsyncLLM and the server.

InvalidRequestError: the request can never run as given (client error; HTTP 400). `param` names the
offending field, as OpenAI's error object does.
RequestFailedError: the engine failed this one request while serving it (HTTP 500); the others go on.
EngineDeadError: the engine itself is down (a device fault); nothing more is served.
LoRAError: an adapter the engine cannot serve (its files, shapes or targets); UnknownAdapterError: a
request names an adapter that is not loaded (404); AdapterUnavailableError: a loaded adapter cannot be
served now (its files changed or vanished, its device slot could not be written): its requests fail.
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


class LoRAError(ValueError):
    """An adapter the engine cannot serve; the message names the module or field."""


class UnknownAdapterError(InvalidRequestError):
    """A request names an adapter that is not registered (HTTP 404)."""


class AdapterUnavailableError(RequestFailedError):
    """A registered adapter cannot be served now (its files changed or vanished since it was loaded, or
    its device slot could not be written): the requests that name it fail, the engine goes on."""
