"""Model files on the worker side: ``common.model_files`` resolution, plus converting a GGUF (torch and
transformers) when it is not converted yet. ``python -m workers.model_files NAME`` converts and prints the
directory: the gateway runs it as a subprocess so torch never loads in the gateway process."""

from __future__ import annotations

import sys

from common.model_files import (ALIASES, ModelFiles, NotConverted, alias_path, cache_root, converted_dir,
                                gguf_source, is_model_dir)
from common.model_files import resolve as resolve_converted

__all__ = ["ALIASES", "ModelFiles", "NotConverted", "alias_path", "cache_root", "converted_dir", "gguf_source",
           "is_model_dir", "resolve"]


def resolve(name: str, convert: bool = True) -> ModelFiles:
    """Resolve ``name``; a GGUF not yet converted is converted when ``convert`` (imports torch)."""
    try:
        return resolve_converted(name)
    except NotConverted as e:
        if not convert:
            raise
        from workers.models.loader import convert_gguf

        convert_gguf(e.gguf, e.out)
        return ModelFiles(name, e.out)


if __name__ == "__main__":
    print(resolve(sys.argv[1]).directory)
