"""``kvtrace redact SRC DST``: replace token ids with keyed pseudonyms."""

from __future__ import annotations

from pathlib import Path

import click

from ._common import EXIT_OK, FilePath, UsageProblem, echo, refuse_to_overwrite, trace_output


MAX_KEY_BYTES = 4096


@click.command()
@click.argument("src", type=FilePath())
@click.argument("dst", type=FilePath())
@click.option("--key-hex", default=None, metavar="HEX",
              help=f"The pseudonym key (16 to {MAX_KEY_BYTES} bytes, hex). Default: a random key, kept nowhere.")
@click.option("--key-file", type=FilePath(exists=True), default=None,
              help=f"Read the key's bytes from this file (16 to {MAX_KEY_BYTES} bytes).")
def command(src: Path, dst: Path, key_hex: str | None, key_file: Path | None) -> int:
    """Write a copy of SRC to DST with every token id replaced by a keyed
    pseudonym, the same one for the same id throughout, so that prefix sharing
    still replays exactly while no original token id remains."""
    from kvtrace.redact import redact_file

    refuse_to_overwrite(dst, src)
    trace_output(dst)
    if key_hex is not None and key_file is not None:
        raise UsageProblem("give --key-hex or --key-file, not both")
    key = None
    if key_hex is not None:
        try:
            key = bytes.fromhex(key_hex)
        except ValueError:
            raise UsageProblem("--key-hex is not hexadecimal") from None
        if not 16 <= len(key) <= MAX_KEY_BYTES:
            raise UsageProblem(f"--key-hex gives {len(key)} bytes; a redaction key must be 16 to "
                               f"{MAX_KEY_BYTES} bytes")
    elif key_file is not None:
        with open(key_file, "rb") as f:
            key = f.read(MAX_KEY_BYTES + 1)   # /dev/zero would never end
        if not 16 <= len(key) <= MAX_KEY_BYTES:
            held = f"more than {MAX_KEY_BYTES}" if len(key) > MAX_KEY_BYTES else str(len(key))
            raise UsageProblem(f"{key_file}: a redaction key must be 16 to {MAX_KEY_BYTES} bytes; "
                               f"this file holds {held}")
    try:
        summary = redact_file(src, dst, key)
    except ValueError as e:
        raise UsageProblem(str(e)) from None
    echo(str(summary))
    return EXIT_OK
