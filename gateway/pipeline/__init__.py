"""One request from parsed JSON to its last byte: protocol parsing, tokenization, admission and the usage ledger,
the handle on a submitted request, output assembly, SSE streaming and the Responses API shape."""
