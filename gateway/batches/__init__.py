"""OpenAI's Batch API (``/v1/files``, ``/v1/batches``) over the chat pipeline.

An uploaded JSONL file is checked line by line (``jsonl``) and stored; a batch over it is run by one gateway at a
time (``runner``, leader by a lease row in the store), a bounded number of lines at once, each line exactly as a
request to its route would run (``line``: ``parse_chat``/``parse_completion``, the key's quotas, ``submit_all``,
``complete``, the ledger). Each line's result is stored as it ends, so a restarted gateway resumes from the lines
without one; the output and error files are written when none is left. Objects in OpenAI's shapes: ``objects``;
the store calls, in threads under deadlines: ``stored``. The routes are ``gateway/api/files_routes.py`` and
``gateway/api/batch_routes.py``; the tables ``tenancy/files_store.py``, ``tenancy/batch_store.py`` and
``tenancy/batch_lease.py``.
"""
