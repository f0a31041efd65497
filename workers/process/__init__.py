"""The worker process around the engine: its command line (``cli``, ``worker_args``), start-up (step sizing,
``step_sizing``), the engine thread's loop (``worker``) and the I/O thread that owns the ZeroMQ socket
(``worker_io``), and the cutting of step outputs into wire frames (``step_frames``).

The engine (everything else in ``workers/``) never imports this package, nor zmq or trio: it is synchronous
and can be driven step by step in-process (the offline ``LLM``, tests). ``tests/test_workers_layering.py``
checks it.

    python -m workers.process.worker --connect tcp://127.0.0.1:5555 --worker-id w0 --model smollm2
"""
