"""Each C++ kernel's build key covers every file its build reads.

A build is found again by a digest of the files it is given (``build.build_key``). A header that a source
includes but that is missing from its kernel's file list would not be in the digest: after that header changed,
a worker would load the old binary, built from the old header, without a word. The lists are kept by hand, so
this reads the ``#include "..."`` lines and checks each list holds what its source reaches.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernels_cupy.cpu import paged_decode_files
from kernels_cupy.cpu.fused import fused_files
from kernels_cupy.cpu.qgemm import qgemm_files

_DIR = Path(paged_decode_files()[0]).parent
_QUOTED = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def reached(source: Path) -> set[Path]:
    """Every file of ours ``source`` includes, directly or through another, itself excluded."""
    seen: set[Path] = set()
    todo = [source]
    while todo:
        for name in _QUOTED.findall(todo.pop().read_text()):
            path = (_DIR / name).resolve()
            assert path.is_file(), f"{name} is included but is not in {_DIR}"
            if path not in seen:
                seen.add(path)
                todo.append(path)
    seen.discard(source.resolve())
    return seen


def stack_files() -> list[Path]:
    # decode_stack.cpp compiles the three kernels' sources in one unit; stack.py keys it by their three lists.
    return [_DIR / "decode_stack.cpp", *qgemm_files(), *paged_decode_files(), *fused_files()]


@pytest.mark.parametrize("files", [qgemm_files, paged_decode_files, fused_files, stack_files],
                         ids=["qgemm", "paged_decode", "fused_ops", "decode_stack"])
def test_the_key_lists_every_file_the_source_includes(files) -> None:  # type: ignore[no-untyped-def]
    source, *rest = files()
    listed = {p.resolve() for p in rest}
    missing = sorted(p.name for p in reached(source) - listed)
    assert not missing, f"{source.name} includes {missing}, which its build key does not read"


def test_the_reader_follows_includes_through_other_files() -> None:
    """The check itself: decode_stack.cpp reaches torch_api.h only through the sources it includes."""
    assert (_DIR / "torch_api.h").resolve() in reached(_DIR / "qgemm.cpp")
    assert (_DIR / "torch_api.h").resolve() in reached(_DIR / "decode_stack.cpp")
    assert (_DIR / "simd_exp.h").resolve() in reached(_DIR / "fused_ops.cpp")
