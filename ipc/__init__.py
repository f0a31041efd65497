"""kvgate ipc package (filled in by its own issue)."""
