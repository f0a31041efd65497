"""The grammar engine's tokenizer (an ``llguidance.LLTokenizer``), built straight from a model directory.

``llguidance.hf.from_tokenizer`` wants a transformers tokenizer only to serialize its Rust backend, read its EOS id
and see the added tokens that ``tokenizer_config.json`` declares. Importing transformers (``llguidance.hf`` does
it too) and building that tokenizer cost ~5.4 s of CPU on a Zen 1 (3.9 s of import), the LLTokenizer itself
0.5 s; beside a busy step loop the first structured request of a worker's life waited 25 s for it (the
hostile-schemas drill's warm-up; 0.9 s now, and 4.7 -> 0.7 s on an idle worker). Reading ``tokenizer.json`` with
``tokenizers`` (already a dependency: the gateway tokenizes with it) gives the same LLTokenizer
(tests/test_grammar_tokenizer.py compares them token for token) without transformers. A directory whose
``tokenizer_config.json`` declares added tokens otherwise than ``tokenizer.json`` has them, or an EOS token it does
not know, is left to transformers: it knows how to merge them; we would have to keep it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.model_files import token_text


def direct(directory: Path, n_vocab: int) -> Any | None:
    """The LLTokenizer from ``directory``'s tokenizer.json, or None where transformers must build it."""
    import llguidance
    from tokenizers import Tokenizer

    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    config_path = directory / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
    tok = Tokenizer.from_file(str(path))
    declared = config.get("added_tokens_decoder") or {}
    if not isinstance(declared, dict):
        return None
    added = tok.get_added_tokens_decoder()  # id -> AddedToken, as tokenizer.json has them
    for token_id, entry in declared.items():
        have = added.get(int(token_id)) if str(token_id).isdigit() else None
        special = entry.get("special", False) if isinstance(entry, dict) else False
        if have is None or have.content != token_text(entry) or have.special != special:
            return None  # transformers would add or re-flag it in the backend: its merge to make, not ours to keep
    eos_text = token_text(config.get("eos_token"))
    eos_id = tok.token_to_id(eos_text) if eos_text is not None else None
    if eos_text is not None and eos_id is None:
        return None
    tok.no_padding()  # as from_tokenizer does before serializing
    tok.no_truncation()
    return llguidance.LLTokenizer(tok.to_str(), n_vocab=n_vocab, eos_token=eos_id)


def load(source: Any, n_vocab: int) -> Any:
    """``source``: a model directory (the worker's case) or an HF tokenizer object (tests, the offline LLM)."""
    if isinstance(source, (str, Path)):
        built = direct(Path(source), n_vocab)
        if built is not None:
            return built
        from transformers import AutoTokenizer

        source = AutoTokenizer.from_pretrained(source)
    import llguidance.hf  # here only: it imports transformers (seconds), which the direct route does without

    return llguidance.hf.from_tokenizer(source, n_vocab=n_vocab)
