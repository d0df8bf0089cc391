"""SVG charts drawn in Python for the HTML report: axes with round ticks,
step or line series, marks and a legend. No script and no library."""

from __future__ import annotations

import html
import math

C_GRID = "#e6e6e6"


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


def chart(cls: str, x0: float, x1: float, ymax: float, series: list[dict], *,
           hlines: list = (), vlines: list = (), bands: list = (), dots: list = (),
           y_label: str = "", right_scale: float | None = None, right_label: str = "",
           width: int = 1100, height: int = 180) -> str:
    """An SVG chart: step/area/line series over steps ``[x0, x1]``, y from 0 to ``ymax``."""
    e = html.escape
    L, R, T, B = 58, (58 if right_scale else 14), 10, 30
    pw, ph = width - L - R, height - T - B
    ymax = ymax if ymax > 0 else 1
    ymax *= 1.05
    xs = (x1 - x0) or 1

    def sx(x):
        return L + (min(max(x, x0), x1) - x0) / xs * pw

    def sy(y):
        return T + ph - max(0.0, min(y, ymax)) / ymax * ph

    out = [f'<svg class="{cls}" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'role="img" preserveAspectRatio="none">']
    # grid and axes
    for t in ticks(0, ymax / 1.05):
        y = sy(t)
        out.append(f'<line x1="{L}" x2="{L + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="{C_GRID}"/>')
        out.append(f'<text x="{L - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">{fmt(t)}</text>')
    if right_scale:
        for t in ticks(0, ymax / 1.05 / right_scale):
            y = sy(t * right_scale)
            out.append(f'<text x="{L + pw + 6}" y="{y + 4:.1f}" class="tick">{fmt(t)}</text>')
    for t in ticks(x0, x1, 10):
        x = sx(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{T + ph}" y2="{T + ph + 4}" stroke="#999"/>')
        out.append(f'<text x="{x:.1f}" y="{T + ph + 16}" text-anchor="middle" class="tick">{fmt(t)}</text>')
    out.append(f'<text x="{L + pw / 2:.0f}" y="{height - 2}" text-anchor="middle" class="axis">step</text>')
    if y_label:
        out.append(f'<text x="12" y="{T + ph / 2:.0f}" transform="rotate(-90 12 {T + ph / 2:.0f})" '
                   f'text-anchor="middle" class="axis">{e(y_label)}</text>')
    if right_label:
        xr = width - 8
        out.append(f'<text x="{xr}" y="{T + ph / 2:.0f}" transform="rotate(90 {xr} {T + ph / 2:.0f})" '
                   f'text-anchor="middle" class="axis">{e(right_label)}</text>')
    for bx0, bx1, color, title in bands:
        a, b = sx(bx0), sx(bx1)
        out.append(f'<rect class="band" x="{a:.1f}" y="{T}" width="{max(1.0, b - a):.1f}" height="{ph}" '
                   f'fill="{color}" fill-opacity="0.25"><title>{e(title)}</title></rect>')
    for s in series:
        pts = s["points"]
        if not pts:
            continue
        d = path(pts, sx, sy, s.get("kind", "step"), x1)
        color = s["color"]
        if s.get("kind") == "area":
            area = d + f" V{sy(0):.1f} H{sx(pts[0][0]):.1f} Z"
            out.append(f'<path class="series area" d="{area}" fill="{color}" fill-opacity="0.55" '
                       f'stroke="{color}" stroke-width="1.5"><title>{e(s.get("label", ""))}</title></path>')
        else:
            dash = f' stroke-dasharray="{s["dash"]}"' if s.get("dash") else ""
            out.append(f'<path class="series" d="{d}" fill="none" stroke="{color}" '
                       f'stroke-width="{s.get("width", 1.5)}"{dash}><title>{e(s.get("label", ""))}</title></path>')
    for y, color, title in hlines:
        out.append(f'<line x1="{L}" x2="{L + pw}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" stroke="{color}" '
                   f'stroke-dasharray="5,4"><title>{e(title)}</title></line>')
    for x, color, title, dash in vlines:
        xx = sx(x)
        da = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<line class="mark" x1="{xx:.1f}" x2="{xx:.1f}" y1="{T}" y2="{T + ph}" stroke="{color}" '
                   f'stroke-width="1.5"{da}><title>{e(title)}</title></line>')
    for x, y, color, title, filled in dots:
        fill = color if filled else "white"
        out.append(f'<circle class="div-dot" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="5" fill="{fill}" '
                   f'stroke="{color}" stroke-width="2"><title>{e(title)}</title></circle>')
    out.append(f'<rect x="{L}" y="{T}" width="{pw}" height="{ph}" fill="none" stroke="#bbb"/>')
    out.append("</svg>")
    return "".join(out)


def path(pts: list, sx, sy, kind: str, x_end: float) -> str:
    x, y = pts[0]
    d = [f"M{sx(x):.1f} {sy(y):.1f}"]
    for x, y in pts[1:]:
        if kind == "line":
            d.append(f"L{sx(x):.1f} {sy(y):.1f}")
        else:
            d.append(f"H{sx(x):.1f} V{sy(y):.1f}")
    if kind != "line":
        d.append(f"H{sx(max(x_end, pts[-1][0])):.1f}")
    return " ".join(d)


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
        else:
            da = ' stroke-dasharray="4,3"' if kind == "dash" else ""
            sw = (f'<svg class="sw" width="22" height="10"><line x1="0" x2="22" y1="5" y2="5" '
                  f'stroke="{color}" stroke-width="2"{da}/></svg>')
        out.append(f"<span>{sw} {e(label)}</span>")
    out.append("</div>")
    return "".join(out)
