"""``kvtrace explain [RULE]``: what a rule id in a report means."""

from __future__ import annotations

import shutil
import textwrap

import click

import re

from kvtrace.rules import FILES, LETTERS, RULES, Rule, closest, lookup

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
    for title, body in (("vLLM", r.behaviour), ("Example", r.example)):
        lines += ["", title, *_wrap(body, width, "  ", "  ")]
    for title, said in (("Letters", letters(r)), ("Files cited", cited_files(r))):
        if said:
            pad = max(map(len, said)) + 1
            lines += ["", title, *(line for k, v in said.items()
                                   for line in _wrap(v, width, f"  {k.ljust(pad)}",
                                                     " " * (pad + 2)))]
    lines += ["", "Docs", *_wrap(where, width, "  ", "  ")]
    return "\n".join(lines)


_CITATION = re.compile(r"\b([A-Z]{1,2}):\d")
# A letter standing alone, as in "L + E", "T - 1", "n > 0"; not a citation's "S:".
_LETTER = re.compile(r"(?<![\w.#'/-])([A-Za-z])(?=$|[\s,;)=<>+'-])")


def letters(r: Rule) -> dict[str, str]:
    """What each letter that ``r`` writes a count with stands for."""
    found = set(_LETTER.findall(" ".join((r.text, r.behaviour, r.example))))
    return {k: v for k, v in LETTERS.items() if k in found}


def cited_files(r: Rule) -> dict[str, str]:
    """The files that the citations of ``r`` ("S:1369", "BP:681") abbreviate,
    in the order cited."""
    found = _CITATION.findall(" ".join((r.id, r.text, r.behaviour, r.example)))
    return {k: FILES[k] for k in dict.fromkeys(found) if k in FILES}


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
