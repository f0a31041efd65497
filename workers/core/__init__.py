"""The synchronous, pure engine core: request state, block manager, fair queue, scheduler.

Nothing here imports torch, trio, zmq or cupy, so the core can be driven step by step in unit tests.
"""
