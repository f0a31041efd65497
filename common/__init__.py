"""What the gateway and the workers both need that is neither wire protocol (``ipc``) nor engine (``workers``):
the incremental detokenizer, model-file resolution, start-up progress lines and logging set-up.

Torch-free by rule: the gateway imports this package, so nothing here may import ``workers``, torch, CuPy or
transformers at module level (the detokenizer is handed a tokenizer, it never loads one)."""
