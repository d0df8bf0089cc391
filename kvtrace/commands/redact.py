"""``kvtrace redact SRC DST``: replace token ids with keyed pseudonyms."""

from __future__ import annotations

from pathlib import Path

import click

from ._common import EXIT_OK, UsageProblem, echo, refuse_to_overwrite


@click.command()
@click.argument("src", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("dst", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--key-hex", default=None, metavar="HEX",
              help="The pseudonym key (at least 16 bytes, hex). Default: a random key, kept nowhere.")
@click.option("--key-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Read the key's bytes from this file.")
def command(src: Path, dst: Path, key_hex: str | None, key_file: Path | None) -> int:
    """Write a copy of SRC to DST with every token id replaced by a keyed
    pseudonym, the same one for the same id throughout, so that prefix sharing
    still replays exactly while no original token id remains."""
    from kvtrace.redact import redact_file

    refuse_to_overwrite(dst, src)
    if key_hex and key_file:
        raise UsageProblem("give --key-hex or --key-file, not both")
    try:
        key = bytes.fromhex(key_hex) if key_hex else (key_file.read_bytes() if key_file else None)
    except ValueError:
        raise UsageProblem("--key-hex is not hexadecimal") from None
    try:
        summary = redact_file(src, dst, key)
    except ValueError as e:
        raise UsageProblem(str(e)) from None
    echo(str(summary))
    return EXIT_OK
