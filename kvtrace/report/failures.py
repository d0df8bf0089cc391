"""A replay's divergences as a person reads them: one block per diverging
request, its likely cause first with the derivation of the expected value, the
rule it breaks, and the rest folded into a line per field.

The per_request come from ``kvtrace.findings.per_request``; this module only lays
them out. Text wraps at word boundaries to the console's width.

It is also the one source of the words the terminal and the HTML report
share: values (``value_text``: a tuple's parts named, a count thousands
separated), counts (``count``, from ``kvtrace._text``: thousands separated,
the noun agreeing; a step or line number is an id and is not), the verdict's
counts (``divergences_text``), the likely causes (``causes_line``), the steps
checked (``steps_text``) and a stop (``stop_text``).
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

from rich.console import Console, Group
from rich.text import Text

from .._text import count, number, plural
from ..findings import Divergence, RequestFindings
from ..results import ReplayResult
from ..rules import lookup, rule_id

MAX_FOLDS = 4          # fold lines under a cause before the rest is counted
LONG_VALUE = 24        # a value longer than this gets a line of its own
RULE_WIDTH = 100       # a heading's line stops here on a wide terminal

# What the parts of a tuple-valued field are (--json keeps the bare list).
_PARTS = {
    ("legacy.num_external_computed_tokens", 2): ("num_cached_tokens", "num_external_computed_tokens"),
    ("prefill_stats", 2): ("cached", "computed"),
    ("prefill_stats", 3): ("local", "external", "prompt"),
    # I4: a waiting or preempted request's status, computed tokens and blocks held
    ("state.num_computed_tokens", 3): ("status", "num_computed_tokens", "blocks"),
}
# A field whose whole-number value counts something (tokens, blocks, steps,
# requests): thousands separated. Ids (block ids, token ids, steps) are not.
_COUNTED = re.compile(r"tokens|^num_|\.num_|_len$|^blocks$|^scheduled$|preemptions|free_blocks"
                      r"|budget|size$|^lookup\.(?:local|ext)$")
# An expected bound, as the checks write one: "<= 12345", ">= 4".
_BOUND = re.compile(r"^([<>]=?) (-?\d+)$")


def value_text(field: str, v: Any) -> str:
    """A recorded or expected value in words a person reads: tuples labelled,
    counts thousands separated, nothing left out."""
    if field == "kv_load":
        if v is None:
            return "no load"
        if isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(x, int) for x in v):
            return f"a load of tokens [{v[0]}, {v[1]}) ({count(v[1] - v[0], 'token')})"
        if isinstance(v, (tuple, list)):
            return "; ".join(value_text(field, x) for x in v)
    if v is None:
        return "not scheduled" if field == "scheduled" else "none"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int) and _COUNTED.search(field):
        return number(v)
    if isinstance(v, str) and _COUNTED.search(field) and (m := _BOUND.match(v)):
        return f"{m[1]} {number(int(m[2]))}"
    if isinstance(v, (tuple, list)) and (field, len(v)) in _PARTS:
        names = _PARTS[(field, len(v))]   # each a count but the status
        return ", ".join(f"{n} {number(x) if isinstance(x, int) else value_text('', x)}"
                         for n, x in zip(names, v))
    if isinstance(v, (tuple, list)) and field.endswith("more_groups") and all(
            isinstance(g, (tuple, list)) for g in v):
        # The tables of KV-cache groups 1, 2, ... (group 0's is block_ids).
        return "; ".join(f"group {i} {value_text('', g)}" for i, g in enumerate(v, 1)) or "none"
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(value_text("", x) for x in v) + "]"
    if isinstance(v, dict):
        return ", ".join(f"{k} {value_text(str(k), x)}" for k, x in v.items())
    return str(v)


def divergences_text(divs: list[Divergence]) -> str:
    """The verdict's counts: "5,886 divergences in 15 requests"."""
    reqs = {d.req for d in divs if d.req is not None}
    return f"{count(len(divs), 'divergence')} in {count(len(reqs), 'request')}"


def steps_text(result: ReplayResult) -> str | None:
    """The steps a replay checked: "295 steps", or, where it stopped before
    the trace's end, "17,869 of 24,744 steps checked". None when unknown."""
    checked = getattr(result, "steps", None)
    if checked is None:
        return None
    in_trace = getattr(result, "steps_in_trace", None) or checked
    first = getattr(result, "from_keyframe", None)
    gaps = getattr(result, "gaps", None)
    missing = "".join(f"; steps {number(a)} to {number(b - 1)} missing (rotated out or cut off)"
                      for a, b in gaps or ())
    if first is not None:   # a replay from a keyframe
        last = checked - 1 if checked > first else first
        return (f"steps {number(first)} to {number(last)} of {number(in_trace)}, from a "
                f"keyframe{missing}")
    if missing:
        return f"{number(result.steps_checked)} of {count(in_trace, 'step')} checked{missing}"
    if getattr(result, "stopped_at", None) is not None and in_trace > checked:
        return f"{number(checked)} of {count(in_trace, 'step')} checked"
    return count(checked, "step")


def unchecked_text(result: ReplayResult) -> str | None:
    """What a replay was asked to check and did not, in words; None when it
    checked all it was asked to."""
    why = getattr(result, "content_unchecked", None)
    return None if why is None else f"KV content not checked: {why}"


def stop_text(result: ReplayResult) -> str | None:
    """Where replay stopped before the trace's end, why, and how many steps
    it left unchecked; None when it did not stop."""
    stop = getattr(result, "stopped_at", None)
    if stop is None:
        return None
    return stop.words(result.steps, getattr(result, "steps_in_trace", result.steps))


def stop_brief(result: ReplayResult) -> str | None:
    """A stop in a few words, for a closing line: "stopped at step 256,
    1,677 steps not checked"."""
    stop = getattr(result, "stopped_at", None)
    if stop is None:
        return None
    left = max(0, getattr(result, "steps_in_trace", result.steps) - result.steps)
    return f"replay stopped at step {stop.step}, {count(left, 'step')} not checked"


def likely_causes(findings: list[RequestFindings]) -> tuple[list[tuple[tuple[str, str], int]], int, int]:
    """The likely causes of a run's divergences, counted over the requests
    (the step-wide story is no request): ((field, rule id), requests) by how
    many requests, most first; how many requests they are; how many more
    requests may follow from them."""
    reqs = [s for s in findings if s.req is not None]
    counts: dict[tuple[str, str], int] = {}
    for s in reqs:
        if s.after is None:
            key = (s.cause.field, rule_parts(s.cause.rule)[0])
            counts[key] = counts.get(key, 0) + 1
    roots = sum(counts.values())
    return sorted(counts.items(), key=lambda kv: -kv[1]), roots, len(reqs) - roots


def causes_line(findings: list[RequestFindings], most: int = 3) -> str | None:
    """The pattern, when more than one request diverges: the likely causes
    (per_request that follow from no other), by field and rule, and how many more
    requests may follow from them: "likely causes: kv_load (rule I9) in 10
    requests; 3 more requests may follow from them"."""
    if sum(1 for s in findings if s.req is not None) < 2:
        return None
    ranked, roots, follow = likely_causes(findings)
    said = [field + (f" (rule {rid})" if rid and rid != field else "")
            + f" in {count(n, 'request')}" for (field, rid), n in ranked[:most]]
    if len(ranked) > most:
        said.append(f"other fields in {count(sum(n for _, n in ranked[most:]), 'request')}")
    line = f"{plural(roots, 'likely cause')}: " + ", ".join(said)
    if follow:
        line += (f"; {count(follow, 'more request')} may follow from "
                 f"{plural(roots, 'it', 'them')}")
    return line


def left_out(rest: list[RequestFindings]) -> str | None:
    """Stories not shown, in words: "3 more requests and the step-wide counts"."""
    n = sum(1 for s in rest if s.req is not None)
    parts = [count(n, "more request")] if n else []
    if any(s.req is None for s in rest):
        parts.append("the step-wide counts")
    return " and ".join(parts) or None


def also_diverge(rest: list[RequestFindings]) -> str | None:
    """Stories not shown, as a sentence's start: "1 more request also
    diverges", "3 more requests and the step-wide counts also diverge"."""
    said = left_out(rest)
    if said is None:
        return None
    one = said.startswith("1 ") and " and " not in said
    return f"{said} also {'diverges' if one else 'diverge'}"


def rule_parts(rule: str) -> tuple[str, str]:
    """("1.3", "admission sets ...") from "1.3: admission sets ...", and
    ("S:1170", "an admission ...") from "S:1170 an admission ..."."""
    rid = rule_id(rule)
    if not rid or lookup(rid) is None and not rid[:1].isupper():
        return "", rule
    return rid, rule.lstrip()[len(rid):].lstrip(":").strip()


def rule_words(rule: str) -> str:
    """A divergence's rule as it is written, or, where it is a bare id ("I6"),
    with the catalogue's text: "I6: num_preemptions grows by one ..."."""
    rid, text = rule_parts(rule)
    if rid and not text and lookup(rid) is not None:
        return f"{rid}: {lookup(rid).text}"
    return rule


def _where(d: Divergence) -> str:
    if d.in_b is not None:
        return _where_in_both(d)
    if d.kind == "diff":   # a diff's divergence that shows in A only: say so
        at = f"step {d.step}, " if d.step is not None else ""
        return f"{at}A line {d.line}" if d.line is not None else at.rstrip(", ")
    parts = []
    if d.step is not None:
        parts.append(f"step {d.step}")
    if d.line is not None:
        parts.append(f"line {d.line}")
    return ", ".join(parts)


def _where_in_both(d: Divergence) -> str:
    """A diff's divergence: where it shows in A and in B."""
    (step_b, line_b), step_a, line_a = d.in_b, d.step, d.line
    if step_a == step_b and line_a is not None and line_b is not None:
        at = f"step {step_a}, " if step_a is not None else ""
        return f"{at}A line {line_a}, B line {line_b}"

    def side(name, step, line):
        if line is None:
            return f"not in {name}"
        return f"{name} step {step} line {line}" if step is not None else f"{name} line {line}"

    return f"{side('A', step_a, line_a)}, {side('B', step_b, line_b)}"


def first_line(d: Divergence, words: tuple[str, str] = ("recorded", "expected"),
               with_line: bool = False) -> str:
    """The first divergence in one sentence: where, who, what."""
    who = d.req if d.req is not None else "the step"
    at = f"step {d.step}" if d.step is not None else "no step"
    if with_line and d.line is not None:
        at += f" (line {d.line})"
    return (f"{at}, {who}, {d.field}: {words[0]} {value_text(d.field, d.recorded)}, "
            f"{words[1]} {value_text(d.field, d.expected)}")


def _para(text: str, width: int, style: str = "", indent: int = 2) -> list[Text]:
    """``text`` wrapped at words to ``width``, indented, continuation lines
    indented two more: no trailing spaces, nothing cut."""
    lines = textwrap.wrap(text, max(20, width), initial_indent=" " * indent,
                          subsequent_indent=" " * (indent + 2), break_long_words=True,
                          break_on_hyphens=False)
    return [Text(line, style=style) for line in lines]


def _values(d: Divergence, width: int, words: tuple[str, str]) -> list[Text]:
    rec, exp = value_text(d.field, d.recorded), value_text(d.field, d.expected)
    w_rec, w_exp = words
    short = f"{d.field}: {w_rec} {rec}, {w_exp} {exp}"
    if len(rec) <= LONG_VALUE and len(exp) <= LONG_VALUE and len(short) <= width:
        line = Text(f"{d.field}: ", style="bold")
        line.append(f"{w_rec} ")
        line.append(rec, style="red")
        line.append(f", {w_exp} ")
        line.append(exp, style="green")
        return [line]
    return [Text(d.field, style="bold"),
            *_para(f"{w_rec}: {rec}", width, "red"),
            *_para(f"{w_exp}: {exp}", width, "green")]


def why_text(d: Divergence) -> str | None:
    """The derivation as a sentence: "expected 48 = ..." when it derives the
    value, else the reason as given."""
    why = getattr(d, "why", None)
    if not why:
        return None
    e = d.expected
    said = number(e) if isinstance(e, int) and not isinstance(e, bool) else str(e)
    return f"expected {why}" if why.startswith((f"{said} ", f"{e} ")) else f"why: {why}"


def _fold_line(f) -> str:
    d = f.first
    if f.first_step is None:
        steps = ""
    elif f.first_step == f.last_step:
        steps = f", step {f.first_step}"
    else:
        steps = f", steps {f.first_step}\u2013{f.last_step}"
    rule_id = rule_parts(d.rule)[0]
    return f"+ {number(f.count)} {d.field}{steps}" + (f" (rule {rule_id})" if rule_id else "")


def request_text(s: RequestFindings, width: int, words: tuple[str, str] = ("recorded", "expected"),
          trace: str = "") -> Group:
    """One request's block: heading, cause, derivation, rule, folds. A diff's
    says ``words`` ("A", "B") for the two sides; ``trace`` names the trace of
    the request where several are shown."""
    d = s.cause
    who = (f"{trace}: " if trace else "") + (s.req if s.req is not None
                                             else "every request (step-wide)")
    where = _where(d)
    heading = f"{who} \u00b7 {where}" if where else who
    if s.count > 1:
        heading += f" \u00b7 {count(s.count, 'divergence')}"
    rule = max(3, min(width, RULE_WIDTH) - len(heading) - 1)
    parts: list = [Text.assemble((heading, "bold"), " ", ("\u2500" * rule, "dim"))]
    parts.extend(_values(d, width, words))
    why = why_text(d)
    if why:
        parts.extend(_para(why, width))
    rule_id, text = rule_parts(rule_words(d.rule))
    if d.kind == "diff":
        parts.extend(_para(text, width, "cyan"))
    else:
        parts.extend(_para(f"rule {rule_id}: {text}" if rule_id else f"rule: {text}", width,
                           "cyan"))
    if s.after is not None:
        a = s.after
        said = ("likely follows from" if a.step == d.step else "may follow from")
        parts.extend(_para(f"{said} {a.req}'s {a.field} at step {a.step}", width, "yellow"))
    folds = sorted(s.folds, key=lambda f: (f.first_step is None, f.first_step or 0))
    for f in folds[:MAX_FOLDS]:
        parts.extend(_para(_fold_line(f), width, "dim"))
    rest = folds[MAX_FOLDS:]
    if rest:
        n = sum(f.count for f in rest)
        parts.extend(_para(f"+ {number(n)} more in {count(len(rest), 'other field')}", width,
                           "dim"))
    return Group(*parts)


def print_wrapped(console: Console, text: str, style: str = "") -> None:
    """One paragraph at the console's width, continuation lines indented."""
    for line in _para(text, console.width, style, indent=0):
        console.print(line)


def print_per_request(console: Console, findings: list, max_requests: int | None,
                  words: tuple[str, str] = ("recorded", "expected")) -> int:
    """Print the findings per request, at most ``max_requests``; return how many were shown.
    An entry of ``findings`` is a RequestFindings, or (trace name, RequestFindings) where several
    traces are shown."""
    shown = findings if max_requests is None else findings[:max_requests]
    for s in shown:
        trace, s = s if isinstance(s, tuple) else ("", s)
        console.print()
        console.print(request_text(s, console.width, words, trace))
    return len(shown)
