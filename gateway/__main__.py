"""``python -m gateway serve ...`` is ``kvgate serve ...``: the gateway without the operator console (the other
``kvgate`` commands are the console's: ``python -m console.kvgate``)."""

from gateway.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
