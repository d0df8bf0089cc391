"""SVG charts drawn in Python for the HTML report.

A chart is an outer ``<svg class="chart">`` holding the axes, and an inner
``<svg class="plot">`` holding the data in step units along x (pixels along y).
The page's script zooms every chart at once by setting the inner viewBox and
redrawing the x ticks (``g.xticks``); without script the charts show the whole
step range. Strokes do not scale with the zoom (``vector-effect``), and dots
are zero-length round-capped strokes, so they stay round.
"""

from __future__ import annotations


import html
import math
from dataclasses import dataclass
from typing import Callable

C_GRID = "#e6e6e6"
NS = ' vector-effect="non-scaling-stroke"'


def nice_step(span: float, target: int = 5) -> float:
    if span <= 0:
        return 1
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def ticks(lo: float, hi: float, target: int = 5, integer: bool = True) -> list[float]:
    st = nice_step(hi - lo, target)
    if integer:
        st = max(1, round(st))
    t = math.ceil(lo / st) * st
    out = []
    while t <= hi + 1e-9:
        out.append(t)
        t += st
    return out


def fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def _n(v: float) -> str:
    """A coordinate: an integer as is, else one decimal."""
    return str(int(v)) if float(v).is_integer() else f"{v:.1f}"


@dataclass(slots=True)
class Band:
    """Steps ``[x0, x1)`` shaded over the plot's height."""
    x0: float
    x1: float
    color: str
    title: str
    cls: str = "band"
    opacity: float = 0.25


def chart(cls: str, x0: float, x1: float, ymax: float, series: list[dict], *,
          hlines: list = (), vlines: list = (), bands: list[Band] = (), dots: list = (),
          first: tuple[float, str, str] | None = None, first_light: bool = False,
          x_end: float | None = None, y_label: str = "", right_scale: float | None = None, right_label: str = "",
          width: int = 1100, height: int = 180) -> str:
    """An SVG chart over steps ``[x0, x1]``, y from 0 to ``ymax``.

    ``series``: dicts of points, color, kind (step, area or line), label, and
    optionally dash and width. ``hlines``: (y, color, title). ``vlines``:
    (x, color, title, dash). ``dots``: (x, y, color, title, filled).
    ``first``: (x, color, title) of the one mark that stands out (a thin
    dashed line if ``first_light``). Step series end at ``x_end`` (``x1``).
    """
    e = html.escape
    L, R, T, B = 58, (58 if right_scale else 14), 10, 30
    pw, ph = width - L - R, height - T - B
    ymax = ymax if ymax > 0 else 1
    ymax *= 1.05
    xs = (x1 - x0) or 1

    def px(x):   # outer pixels, for the initial ticks
        return L + (x - x0) / xs * pw

    def sy(y):   # inner y, in pixels from the plot's top
        return ph - max(0.0, min(y, ymax)) / ymax * ph

    out = [f'<svg class="{cls}" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'role="img" data-l="{L}" data-t="{T}" data-pw="{pw}" data-ph="{ph}" '
           f'data-x0="{_n(x0)}" data-x1="{_n(x1)}">']
    for t in ticks(0, ymax / 1.05):
        y = T + sy(t)
        out.append(f'<line x1="{L}" x2="{L + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="{C_GRID}"/>')
        out.append(f'<text x="{L - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">{fmt(t)}</text>')
    if right_scale:
        for t in ticks(0, ymax / 1.05 / right_scale):
            y = T + sy(t * right_scale)
            out.append(f'<text x="{L + pw + 6}" y="{y + 4:.1f}" class="tick">{fmt(t)}</text>')
    out.append('<g class="xticks">')
    for t in ticks(x0, x1, 10):
        x = px(t)
        anchor = "end" if x > L + pw - 20 else "middle"
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{T + ph}" y2="{T + ph + 4}" stroke="#999"/>'
                   f'<text x="{x:.1f}" y="{T + ph + 16}" text-anchor="{anchor}" class="tick">{fmt(t)}</text>')
    out.append("</g>")
    out.append(f'<text x="{L + pw / 2:.0f}" y="{height - 2}" text-anchor="middle" class="axis">step</text>')
    if y_label:
        out.append(f'<text x="12" y="{T + ph / 2:.0f}" transform="rotate(-90 12 {T + ph / 2:.0f})" '
                   f'text-anchor="middle" class="axis">{e(y_label)}</text>')
    if right_label:
        xr = width - 8
        out.append(f'<text x="{xr}" y="{T + ph / 2:.0f}" transform="rotate(90 {xr} {T + ph / 2:.0f})" '
                   f'text-anchor="middle" class="axis">{e(right_label)}</text>')

    # the data, in step units along x
    out.append(f'<svg class="plot" x="{L}" y="{T}" width="{pw}" height="{ph}" '
               f'viewBox="{_n(x0)} 0 {_n(xs)} {ph}" preserveAspectRatio="none">')
    for b in bands:
        out.append(f'<rect class="{b.cls}" x="{_n(b.x0)}" y="0" width="{_n(max(b.x1 - b.x0, 0))}" '
                   f'height="{ph}" fill="{b.color}" fill-opacity="{b.opacity}" stroke="{b.color}" '
                   f'stroke-opacity="{min(1.0, b.opacity * 1.6):.2f}" stroke-width="1"{NS}>'
                   f'<title>{e(b.title)}</title></rect>')
    for s in series:
        pts = s["points"]
        if not pts:
            continue
        d = path(pts, sy, s.get("kind", "step"), x1 if x_end is None else x_end)
        color = s["color"]
        if s.get("kind") == "area":
            area = d + f" V{_n(ph)} H{_n(pts[0][0])} Z"
            out.append(f'<path class="series area" d="{area}" fill="{color}" fill-opacity="0.55" '
                       f'stroke="{color}" stroke-width="1.5"{NS}><title>{e(s.get("label", ""))}</title></path>')
        else:
            dash = f' stroke-dasharray="{s["dash"]}"' if s.get("dash") else ""
            out.append(f'<path class="series" d="{d}" fill="none" stroke="{color}" '
                       f'stroke-width="{s.get("width", 1.5)}"{dash}{NS}>'
                       f'<title>{e(s.get("label", ""))}</title></path>')
    for x, color, title, dash in vlines:
        da = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<path class="mark" d="M{_n(x)} 0V{ph}" stroke="{color}" stroke-width="1.5"{da}{NS}>'
                   f'<title>{e(title)}</title></path>')
    for x, y, color, title, filled in dots:
        d = f"M{_n(x)} {sy(y):.1f}h0"
        inner = "" if filled else (f'<path d="{d}" stroke="white" stroke-width="5" '
                                   f'stroke-linecap="round"{NS}/>')
        out.append(f'<g class="div-dot"><path d="{d}" stroke="{color}" stroke-width="10" '
                   f'stroke-linecap="round"{NS}/>{inner}<title>{e(title)}</title></g>')
    if first is not None:
        x, color, title = first
        if first_light:
            out.append(f'<g class="first-mark light"><path d="M{_n(x)} 0V{ph}" stroke="{color}" '
                       f'stroke-width="1" stroke-dasharray="2,3"{NS}/><title>{e(title)}</title></g>')
        else:
            out.append(f'<g class="first-mark"><path d="M{_n(x)} 0V{ph}" stroke="{color}" stroke-width="2"{NS}/>'
                       f'<path d="M{_n(x)} 6h0" stroke="{color}" stroke-width="11" stroke-linecap="round"{NS}/>'
                       f'<title>{e(title)}</title></g>')
    out.append("</svg>")
    for y, color, title in hlines:
        yy = T + sy(y)
        out.append(f'<line x1="{L}" x2="{L + pw}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="{color}" '
                   f'stroke-dasharray="5,4"><title>{e(title)}</title></line>')
    out.append(f'<rect class="frame" x="{L}" y="{T}" width="{pw}" height="{ph}" fill="none" stroke="#bbb"/>')
    out.append("</svg>")
    return "".join(out)


def path(pts: list, sy: Callable[[float], float], kind: str, x_end: float) -> str:
    """A series as path data: x in steps, y in plot pixels."""
    x, y = pts[0]
    d = [f"M{_n(x)} {sy(y):.1f}"]
    for x, y in pts[1:]:
        if kind == "line":
            d.append(f"L{_n(x)} {sy(y):.1f}")
        else:
            d.append(f"H{_n(x)}V{sy(y):.1f}")
    if kind != "line":
        d.append(f"H{_n(max(x_end, pts[-1][0]))}")
    return "".join(d)


def legend(items: list[tuple[str, str, str]]) -> str:
    e = html.escape
    out = ['<div class="legend">']
    for color, label, kind in items:
        if kind == "area":
            sw = f'<svg class="sw" width="22" height="10"><rect width="22" height="10" fill="{color}" fill-opacity="0.55"/></svg>'
        elif kind == "band":
            sw = f'<svg class="sw" width="22" height="10"><rect width="22" height="10" fill="{color}" fill-opacity="0.3"/></svg>'
        elif kind == "dot":
            sw = f'<svg class="sw" width="12" height="12"><circle cx="6" cy="6" r="4" fill="{color}"/></svg>'
        elif kind == "ring":
            sw = (f'<svg class="sw" width="12" height="12"><circle cx="6" cy="6" r="4" fill="white" '
                  f'stroke="{color}" stroke-width="2"/></svg>')
        elif kind == "flag":
            sw = (f'<svg class="sw" width="14" height="14"><line x1="7" x2="7" y1="3" y2="14" '
                  f'stroke="{color}" stroke-width="2"/><circle cx="7" cy="4" r="3.5" fill="{color}"/></svg>')
        else:
            da = ' stroke-dasharray="4,3"' if kind == "dash" else ""
            sw = (f'<svg class="sw" width="22" height="10"><line x1="0" x2="22" y1="5" y2="5" '
                  f'stroke="{color}" stroke-width="2"{da}/></svg>')
        out.append(f"<span>{sw} {e(label)}</span>")
    out.append("</div>")
    return "".join(out)
