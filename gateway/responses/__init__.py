"""OpenAI's Responses API (``/v1/responses``) over the chat pipeline.

A request is validated here (``request``, ``items``), translated into a chat-completions body (earlier turns from the
store, the instructions, the input) and then runs exactly as a chat completion does: ``parse_chat``, admission,
``submit_all``, the ledger. What differs is the outside: the response object and its typed stream events
(``objects``, ``run``) and the stored responses (``stored``; the rows in ``tenancy.responses_store``). The routes are
``gateway/api/responses_routes.py``.
"""
