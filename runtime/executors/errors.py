"""The executor's refusals that servers word for their clients and relay between models: no torch here, so the Triton
stubs that only relay them (the BLS) import them without the runtime."""

from __future__ import annotations


class QueueFull(RuntimeError):
    """A request refused by load shedding while `bound` requests wait to be scheduled (a server's 503 / UNAVAILABLE,
    for the client to retry). Each surface names the bound by the setting its users set (`worded`)."""

    PREFIX = "the queue is full: "

    def __init__(self, bound: int) -> None:
        super().__init__(self.worded(bound))
        self.bound = bound

    @staticmethod
    def worded(bound: int, setting: str = "max_queued_requests") -> str:
        return f"{QueueFull.PREFIX}{bound} requests wait to be scheduled ({setting}); try again later"

    @staticmethod
    def is_worded(message: str) -> bool:
        """Whether an error's message is this refusal, however worded (a relayed error keeps its message alone)."""
        return message.startswith(QueueFull.PREFIX)

    def __reduce__(self) -> tuple:  # across the engine process's pipe with its bound
        return type(self), (self.bound,)
