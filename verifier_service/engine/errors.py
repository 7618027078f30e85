"""Domain errors of the engine; the gRPC layer maps each to one status code."""

from modeling.tree import TreeError

__all__ = ["CapacityError", "InvalidRequest", "PrefillStopped", "TreeError"]


class CapacityError(RuntimeError):
    """The KV page pool cannot hold what was asked; nothing was allocated (RESOURCE_EXHAUSTED)."""


class InvalidRequest(ValueError):
    """A request parameter is out of range; the message names the field (INVALID_ARGUMENT)."""


class PrefillStopped(RuntimeError):
    """The caller of a prefill went away; the prefill stopped between chunks and gave its pages back."""
