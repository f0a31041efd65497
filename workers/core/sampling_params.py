"""The engine's sampling parameters are the wire message's own type (``ipc.sampling``): one definition, checked
by mypy on both sides and validated once on decode."""

from ipc.sampling import SamplingParams

__all__ = ["SamplingParams"]
