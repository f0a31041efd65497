"""Write a servable model directory of random weights (bench/random_llama.py) with smollm2's tokenizer, so
``kvgate serve --model DIR`` can run on a machine that cannot receive the real weights (the GPU machine).

``python bench/gpu_model_dir.py OUT_DIR --tokenizer-from DIR [--shape smollm2]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.random_llama import SHAPES, hf_config_dict, state_dict  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer-from", type=Path, required=True, help="a directory holding smollm2's tokenizer")
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    a = ap.parse_args()
    from safetensors.torch import save_file

    a.out.mkdir(parents=True, exist_ok=True)
    cfg = dict(hf_config_dict(a.shape), architectures=["LlamaForCausalLM"], torch_dtype="float32")
    (a.out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({k: v.contiguous() for k, v in state_dict(a.shape).items()}, str(a.out / "model.safetensors"))
    for name in TOKENIZER_FILES:
        if (a.tokenizer_from / name).exists():
            shutil.copy(a.tokenizer_from / name, a.out / name)
    print(f"wrote {a.out} ({a.shape}, random weights)")


if __name__ == "__main__":
    main()
