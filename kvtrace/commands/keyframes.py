"""``kvtrace keyframes SRC DST``: a copy of a trace with keyframes in it."""

from __future__ import annotations

from pathlib import Path

import click

from ._common import EXIT_OK, FilePath, echo, refuse_to_overwrite, trace_output

DEFAULT_EVERY = 1000


@click.command()
@click.argument("src", type=FilePath())
@click.argument("dst", type=FilePath())
@click.option("--every", type=click.IntRange(min=1), default=DEFAULT_EVERY, show_default=True,
              metavar="N", help="A keyframe before every N-th step.")
@click.option("--profile", type=click.Choice(("legacy", "0.19", "0.32", "0.33")), default=None,
              help="Replay by the rules of this vLLM release instead of the trace's own.")
def command(src: Path, dst: Path, every: int, profile: str | None) -> int:
    """Write a copy of SRC to DST with a keyframe before every N-th step: the
    replay's whole state there, so that 'kvtrace replay DST --from-step S'
    starts at the last keyframe at or before step S instead of the trace's
    start. The keyframes come from replaying SRC through the reference."""
    from kvtrace.replay.keyframes import add_keyframes

    refuse_to_overwrite(dst, src)
    trace_output(dst)
    made, steps = add_keyframes(src, dst, every, profile)
    echo(f"wrote {dst}: {made:,} keyframe{'s' if made != 1 else ''} in {steps:,} "
         f"step{'s' if steps != 1 else ''}")
    return EXIT_OK
