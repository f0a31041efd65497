"""kvgate tenancy package (filled in by its own issue)."""
