"""kvgate gateway package (filled in by its own issue)."""
