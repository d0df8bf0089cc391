"""One module per subcommand; ``COMMANDS`` is what the ``kvtrace`` group registers."""

from . import diff, record, redact, replay, report
from . import dump, explain, keyframes

COMMANDS = {
    "record": record.command,
    "replay": replay.command,
    "diff": diff.command,
    "report": report.report,
    "export": report.export,
    "show": report.show,
    "redact": redact.command,
    "keyframes": keyframes.command,
    "dump": dump.command,
    "explain": explain.command,
}
