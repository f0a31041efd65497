"""``kvgate keys``: CURVE key pairs for the worker socket (see README, "Remote workers (CURVE)").

    kvgate keys create gateway --dir keys/          # the gateway's pair: gateway.key, gateway.key_secret
    kvgate keys create gpu-host-1 --dir keys/       # one per worker host
    kvgate keys show keys/gpu-host-1.key            # the public key (what the gateway's log names)

The gateway gets ``--server-secret-key keys/gateway.key_secret`` and ``--worker-keys DIR`` (a directory holding
the workers' ``*.key`` files, and nothing else); each worker gets ``--server-key gateway.key`` and
``--key NAME.key_secret``. Secret files are created 0600 and never need to leave the host that uses them.
Exit codes: 0 done, 2 bad usage or a key file that cannot be written or read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn

import typer

keys_app = typer.Typer(help="CURVE key pairs for gateways and remote workers", no_args_is_help=True,
                       add_completion=False, context_settings={"help_option_names": ["-h", "--help"]})


def _usage_error(e: ValueError) -> NoReturn:
    typer.echo(f"kvgate keys: error: {e}", err=True)
    raise typer.Exit(2)


@keys_app.command("create", help="make a key pair: NAME.key (public) and NAME.key_secret (0600)")
def create(name: Annotated[str, typer.Argument(help="file name stem, e.g. gateway or the worker host's name")],
           dir: Annotated[Path, typer.Option("--dir", show_default=False,
                                             help="where to write the two files (default: .)")
                          ] = Path(".")) -> None:
    from ipc.curve import create_key_files, load_public_key  # zmq loads only for this command

    try:
        public, secret = create_key_files(dir, name)
    except ValueError as e:
        _usage_error(e)
    typer.echo(f"public key {load_public_key(public).decode()}\n  public: {public}\n  secret: {secret} (0600; keep "
               f"it on the host that uses it)")


@keys_app.command("show", help="print the public key of a key file (either kind)")
def show(file: Annotated[Path, typer.Argument()]) -> None:
    from ipc.curve import load_public_key

    try:
        typer.echo(load_public_key(file).decode())
    except ValueError as e:
        _usage_error(e)
