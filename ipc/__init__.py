"""kvgate ipc: the gateway <-> worker wire protocol.

- ``ipc.messages``: typed, versioned, frozen message dataclasses (``PROTOCOL_VERSION``).
- ``ipc.sampling``: ``SamplingParams``, the typed sampling parameters inside ``Generate`` (validated on build).
- ``ipc.codec``: msgpack ``encode``/``decode`` with strict validation (``ProtocolError``); never pickle.
- ``ipc.sync_transport``: the worker's blocking DEALER helpers (zmq only, no Trio).
- ``ipc.transport``: the gateway's Trio adapter for ZeroMQ (``TrioZmqSocket``, ROUTER helpers).

Nothing is imported here on purpose: a worker importing ``ipc.sync_transport`` must not pull in Trio.
This package must not import gateway, workers or torch.
"""
