"""Each C++ kernel's build key covers every file its build reads.

A build is found again by a digest of the files it is given (``build.build_key``); ``kernels_cupy.cpu.sources``
derives those lists from the ``#include "..."`` lines. The check here is independent of that reader: the
compiler's own dependency list (``g++ -MM``, with torch's and Python's headers as system headers, so that only ours
are listed) must be part of each kernel's list.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from kernels_cupy.cpu import paged_decode_files
from kernels_cupy.cpu.fused import fused_files
from kernels_cupy.cpu.qgemm import qgemm_files
from kernels_cupy.cpu.sources import build_files, includes

_DIR = Path(paged_decode_files()[0]).parent


def compiler_reads(source: Path) -> set[Path]:
    """Our files the preprocessor opens for ``source`` (its own #if's decided as in a build on this machine)."""
    from torch.utils.cpp_extension import include_paths

    system = [f for p in [*include_paths(), sysconfig.get_paths()["include"]] for f in ("-isystem", p)]
    out = subprocess.run(["g++", "-std=c++17", "-MM", "-DTORCH_EXTENSION_NAME=x", *system, str(source)],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    paths = out.replace("\\\n", " ").split()[1:]  # after "qgemm.o:"
    return {Path(p).resolve() for p in paths if Path(p).resolve().parent == _DIR.resolve()}


def stack_files() -> list[Path]:
    return build_files(_DIR / "decode_stack.cpp")  # as kernels_cupy/cpu/stack.py builds it


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++: no kernel is built either")
@pytest.mark.parametrize("files", [qgemm_files, paged_decode_files, fused_files, stack_files],
                         ids=["qgemm", "paged_decode", "fused_ops", "decode_stack"])
def test_the_key_lists_every_file_the_compiler_reads(files) -> None:  # type: ignore[no-untyped-def]
    source, *_ = files()
    listed = {p.resolve() for p in files()}
    read = compiler_reads(source)
    assert source.resolve() in read and len(read) > 2, read  # the oracle sees the source and its headers
    missing = sorted(p.name for p in read - listed)
    assert not missing, f"{source.name} reads {missing}, which its build key does not"


def test_the_reader_follows_includes_through_other_files(tmp_path: Path) -> None:
    """Nested and conditional includes are followed, each file once; a missing header is an error, not a gap."""
    (tmp_path / "a.cpp").write_text('#include "b.h"\n#if X\n  #include "c.h"\n#endif\n#include <vector>\n')
    (tmp_path / "b.h").write_text('#pragma once\n#include "c.h"\n// #include "commented.h"\n')
    (tmp_path / "c.h").write_text('#include "b.h"\n')
    assert [p.name for p in includes(tmp_path / "a.cpp")] == ["b.h", "c.h"]
    (tmp_path / "c.h").write_text('#include "gone.h"\n')
    with pytest.raises(FileNotFoundError, match="gone.h"):
        includes(tmp_path / "a.cpp")
    assert (_DIR / "lora_rows.h") in includes(_DIR / "qgemm.cpp")  # through lora_add.h, not directly
