"""``kvgate keys``: CURVE key pairs for the worker socket (see README, "Remote workers (CURVE)").

    kvgate keys create gateway --dir keys/          # the gateway's pair: gateway.key, gateway.key_secret
    kvgate keys create gpu-host-1 --dir keys/       # one per worker host
    kvgate keys show keys/gpu-host-1.key            # the public key (what the gateway's log names)

The gateway gets ``--server-secret-key keys/gateway.key_secret`` and ``--worker-keys DIR`` (a directory holding
the workers' ``*.key`` files, and nothing else); each worker gets ``--server-key gateway.key`` and
``--key NAME.key_secret``. Secret files are created 0600 and never need to leave the host that uses them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ipc.curve import create_key_files, load_public_key


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvgate keys", description="CURVE key pairs for gateways and remote workers")
    sub = p.add_subparsers(dest="action", required=True)
    c = sub.add_parser("create", help="make a key pair: NAME.key (public) and NAME.key_secret (0600)")
    c.add_argument("name", help="file name stem, e.g. gateway or the worker host's name")
    c.add_argument("--dir", default=".", type=Path, help="where to write the two files (default: .)")
    s = sub.add_parser("show", help="print the public key of a key file (either kind)")
    s.add_argument("file", type=Path)
    a = p.parse_args(argv)
    try:
        if a.action == "show":
            print(load_public_key(a.file).decode())
            return 0
        public, secret = create_key_files(a.dir, a.name)
    except ValueError as e:
        print(f"kvgate keys: error: {e}", file=sys.stderr)
        return 2
    print(f"public key {load_public_key(public).decode()}\n  public: {public}\n  secret: {secret} (0600; keep it "
          f"on the host that uses it)")
    return 0
