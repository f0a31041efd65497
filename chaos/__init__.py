"""kvgate chaos package (filled in by its own issue)."""
