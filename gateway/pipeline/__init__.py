"""One request from parsed JSON to its last byte: protocol parsing, tokenization, admission and the usage ledger,
the sequences of a submitted request (their handles are ``gateway.base.handle``), output assembly, SSE streaming
and the Responses API shape."""
