"""What a CPU kernel's build reads: its source and every file of ours it includes, which is its build key
(``build.build_key``). Derived from the ``#include "..."`` lines, not listed by hand: a header missing from a hand
list would leave it out of the key, and after that header changed a worker would load the binary built from the
old one without a word."""

from __future__ import annotations

import re
from pathlib import Path

# Quoted includes are ours; angle-bracket ones are the system's and torch's, which the key covers by their versions.
_QUOTED = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def includes(source: Path) -> list[Path]:
    """Every file ``source`` includes with ``#include "..."``, directly or through another, each once in the order
    first reached, itself excluded. Includes under ``#if`` count too: the key may cover more than one build reads,
    never less."""
    seen: dict[Path, None] = {}
    todo = [source]
    while todo:
        current = todo.pop(0)
        for name in _QUOTED.findall(current.read_text()):
            path = current.parent / name
            if not path.is_file():
                raise FileNotFoundError(f"{current.name} includes {name!r}, which is not in {current.parent}")
            if path != source and path not in seen:
                seen[path] = None
                todo.append(path)
    return list(seen)


def build_files(source: Path) -> list[Path]:
    """The source, then every file it includes: what ``load_extension`` is given and keys the build by."""
    return [source, *includes(source)]
