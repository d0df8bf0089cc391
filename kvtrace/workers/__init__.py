"""Worker processes that replay and diff share: starting a child interpreter
(``child``), how many workers a trace gets (``policy``), and the worker that
checks a trace's records across records beside the process that reads them
(``record_worker``)."""

from .policy import ENV, MIN_BYTES, MIN_TEXT_BYTES, WorkerError, wanted  # noqa: F401
