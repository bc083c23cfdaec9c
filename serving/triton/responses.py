"""How the Python-backend models answer Triton: the final-response flag and a failed request's error, mapped to the
code a client acts on. Imported by those models' stubs only (it needs `triton_python_backend_utils`)."""

from __future__ import annotations

import traceback
from typing import Any

import triton_python_backend_utils as pb_utils

from runtime.executors.errors import QueueFull
from serving.triton.parameters import QUEUE_SIZE

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class RelayedError(Exception):
    """A composing model's error response, passed on to the client as it is, its code too: Triton 2.51 hands it over
    as INTERNAL, so a full queue is made UNAVAILABLE again (the code a client retries on)."""

    def __init__(self, error: Any) -> None:
        super().__init__(error.message())
        self.code = pb_utils.TritonError.UNAVAILABLE if QueueFull.is_worded(error.message()) else error.code()


def triton_error(error: Exception, label: str) -> Any:
    """What a client is told of a failed request: a composing model's error as it was; a refusal (ValueError: its
    message names the input) INVALID_ARG; a full queue (named by the setting a Triton deployment sets) or a server
    that stopped serving (RuntimeError) UNAVAILABLE; anything else is logged here in full, under `label`, and
    reported as INTERNAL without its traceback or a server path."""
    if isinstance(error, RelayedError):
        return pb_utils.TritonError(str(error), error.code)
    if isinstance(error, ValueError):
        return pb_utils.TritonError(str(error), pb_utils.TritonError.INVALID_ARG)
    if isinstance(error, QueueFull):
        return pb_utils.TritonError(QueueFull.worded(error.bound, QUEUE_SIZE), pb_utils.TritonError.UNAVAILABLE)
    if isinstance(error, RuntimeError):
        return pb_utils.TritonError(str(error), pb_utils.TritonError.UNAVAILABLE)
    pb_utils.Logger.log_error(f"{label}: request failed: {''.join(traceback.format_exception(error))}")
    return pb_utils.TritonError(f"internal error ({type(error).__name__}); see the server log")


def error_response(error: Exception, label: str) -> Any:
    """The response that answers a request with `triton_error`."""
    return pb_utils.InferenceResponse(error=triton_error(error, label))
