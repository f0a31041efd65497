"""Start-up progress lives in ``common.startup`` (the gateway shows it too); this name stays for worker-side
importers until they import it from there."""

from common.startup import StartupProgress

__all__ = ["StartupProgress"]
