"""``kvtrace explain [RULE]``: what a rule id in a report means."""

from __future__ import annotations

import shutil
import textwrap

import click

from kvtrace.rules import RULES, Rule, closest, lookup

from ._common import EXIT_OK, UsageProblem, echo

DOC = "docs/reference/checks.md"


@click.command(short_help="What a rule id in a report means (no RULE: every id).")
@click.argument("rule", required=False)
def command(rule: str | None) -> int:
    """Explain RULE, a rule id as a report names it ("1.3", "I1", "kv-content",
    "S:1170"): the rule, the vLLM behaviour it encodes, an example. Without
    RULE, list every rule id."""
    width = max(40, shutil.get_terminal_size((80, 24)).columns)
    if rule is None:
        echo(listing(width))
        return EXIT_OK
    found = lookup(rule)
    if found is None:
        near = closest(rule)
        hint = f"; the closest: {', '.join(near)}" if near else ""
        raise UsageProblem(f"no rule {rule.strip()!r}{hint} ('kvtrace explain' lists them all)")
    echo(entry(found, width))
    return EXIT_OK


def entry(r: Rule, width: int = 80) -> str:
    """One rule's entry, wrapped to ``width`` columns."""
    where = f'{DOC}, "Rule ids", entry {r.id}'
    if r.see:
        where += f'; more under "{r.see}"'
    lines = _wrap(r.text, width, f"{r.id}  ", " " * (len(r.id) + 2))
    for title, body in (("vLLM", r.behaviour), ("Example", r.example), ("Docs", where)):
        lines += ["", title, *_wrap(body, width, "  ", "  ")]
    return "\n".join(lines)


def listing(width: int = 80) -> str:
    """Every rule id with its one-line text, wrapped under the text."""
    pad = max(len(k) for k in RULES) + 2
    lines = []
    for r in RULES.values():
        lines += _wrap(r.text, width, r.id.ljust(pad), " " * pad)
    lines += ["", "kvtrace explain RULE prints a rule's entry."]
    return "\n".join(lines)


def _wrap(text: str, width: int, first: str, rest: str) -> list[str]:
    return textwrap.wrap(text, width, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False, break_long_words=False)
