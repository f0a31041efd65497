"""``python -m gateway ...`` is the same as ``kvgate ...``."""

from gateway.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
