"""The human-readable side of the audit: one dashboard PNG and a self-contained HTML page.

The PNG answers the questions in the order a person asks them: is anything wrong (tiles, red
when not zero), for whom (outcomes per consumer), how fast (publish-to-ack latency), and when
(outcomes over publish time). The HTML embeds the PNG and adds the per-consumer table and
examples of every finding. Without matplotlib (an EMR image may lack it) the HTML comes alone.
"""

from __future__ import annotations

import base64
import html
import io
from datetime import datetime
from importlib import import_module
from typing import Any

from pipeline.common import UTC, Output, iso

GREEN = "#2e9e5b"
RED = "#d64541"
AMBER = "#e8a33d"
GREY = "#9aa5b1"
INK = "#1f2933"
MUTED = "#616e7c"
#: outcome -> (label, colour), in stacking order
OUTCOMES = {
    "acked": ("acked", GREEN),
    "late": ("acked late", "#8fcf9f"),
    "pending": ("pending", GREY),
    "dead_lettered": ("dead-lettered", "#7b61ff"),
    "dropped": ("dropped (expired/unsubscribed)", "#cbd2d9"),
    "lost": ("lost", RED),
}
MAX_CONSUMERS = 14


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1000:
        return f"{value:.0f} ms"
    if value < 60_000:
        return f"{value / 1000:.1f} s"
    return f"{value / 60_000:.1f} min"


def _consumer_name(c: dict[str, Any]) -> str:
    name = c.get("label") or c["consumer"]
    name = name if len(name) <= 28 else name[:12] + "..." + name[-12:]
    return f"{c['consumer_kind']}: {name}"


def _problems(c: dict[str, Any]) -> int:
    return int(c["lost"] + c["duplicated"] + c["reordered"] + c["delivered_after_ack"])


def render_png(doc: dict[str, Any]) -> bytes:
    # Reached through import_module, so that mypy (cold in CI) does not analyse matplotlib's
    # and numpy's stub packages (about 500 modules; follow_imports=skip cannot skip stubs):
    # the chart calls are Any, and the pipeline tests draw every one of them.
    matplotlib: Any = import_module("matplotlib")
    matplotlib.use("Agg")
    plt: Any = import_module("matplotlib.pyplot")
    dates: Any = import_module("matplotlib.dates")
    AutoDateLocator, ConciseDateFormatter, date2num = (
        dates.AutoDateLocator,
        dates.ConciseDateFormatter,
        dates.date2num,
    )
    FancyBboxPatch = import_module("matplotlib.patches").FancyBboxPatch
    FuncFormatter = import_module("matplotlib.ticker").FuncFormatter

    totals = doc["totals"]
    plt.rcParams.update({"font.size": 10, "axes.edgecolor": "#cbd2d9", "axes.labelcolor": INK})
    fig = plt.figure(figsize=(13, 9.2), dpi=100, facecolor="white")
    # room under the middle row for the outcome legend, so it never reaches the timeline's title
    grid = fig.add_gridspec(3, 2, height_ratios=[0.9, 2.3, 1.6], hspace=0.75, wspace=0.28)

    verdict = "No delivery faults found" if doc["clean"] else "Delivery faults found"
    window = doc["window"]
    span = f"{window['since_iso'] or 'start'} to {window['until_iso'] or 'end'}"
    fig.suptitle(
        f"Shoal delivery audit: {verdict}",
        x=0.06,
        y=0.985,
        ha="left",
        fontsize=17,
        fontweight="bold",
        color=GREEN if doc["clean"] else RED,
    )
    fig.text(
        0.06,
        0.935,
        f"{totals['messages']:,} messages published {span}  |  {totals['consumers']} consumers, "
        f"{totals['judged']:,} QoS 1/2 deliveries judged  |  horizon "
        f"{_ms(window['horizon_ms'])}, data up to {window['as_of_iso']}",
        fontsize=9.5,
        color=MUTED,
    )

    # -- tiles
    tiles_ax = fig.add_subplot(grid[0, :])
    tiles_ax.set_axis_off()
    tiles_ax.set_xlim(0, 6)
    tiles_ax.set_ylim(0, 1)
    latency = totals["latency_ms"]
    tiles = [
        ("lost", totals["lost"], RED),
        ("duplicated", totals["duplicated"], RED),
        ("reordered", totals["reordered"], RED),
        ("delivered after ack", totals["delivered_after_ack"], RED),
        ("pending", totals["pending"], AMBER),
    ]
    for n, (label, value, bad) in enumerate(tiles):
        colour = GREEN if value == 0 else bad
        tiles_ax.add_patch(
            FancyBboxPatch(
                (n + 0.06, 0.05),
                0.88,
                0.9,
                boxstyle="round,pad=0.02,rounding_size=0.08",
                facecolor=colour,
                alpha=0.12,
                edgecolor=colour,
                linewidth=1.5,
            )
        )
        tiles_ax.text(
            n + 0.5, 0.56, f"{value:,}", ha="center", va="center", fontsize=24,
            fontweight="bold", color=colour,
        )  # fmt: skip
        tiles_ax.text(n + 0.5, 0.2, label, ha="center", va="center", fontsize=10, color=INK)
    tiles_ax.add_patch(
        FancyBboxPatch(
            (5.06, 0.05), 0.88, 0.9, boxstyle="round,pad=0.02,rounding_size=0.08",
            facecolor="#3e7cb1", alpha=0.10, edgecolor="#3e7cb1", linewidth=1.5,
        )
    )  # fmt: skip
    tiles_ax.text(
        5.5, 0.56, _ms(latency["p99"]), ha="center", va="center", fontsize=22,
        fontweight="bold", color="#3e7cb1",
    )  # fmt: skip
    tiles_ax.text(
        5.5, 0.2, f"p99 to ack (p50 {_ms(latency['p50'])})", ha="center", va="center",
        fontsize=9.5, color=INK,
    )  # fmt: skip

    # -- outcomes per consumer
    bars = fig.add_subplot(grid[1, 0])
    consumers = sorted(doc["consumers"], key=lambda c: (-_problems(c), -c["judged"]))
    shown = list(reversed(consumers[:MAX_CONSUMERS]))
    names = [_consumer_name(c) for c in shown]
    left = [0.0] * len(shown)
    for key, (label, colour) in OUTCOMES.items():
        values = [float(c[key]) for c in shown]
        if not any(values):
            continue
        bars.barh(names, values, left=left, color=colour, label=label, height=0.62)
        left = [a + b for a, b in zip(left, values)]
    for y, c in enumerate(shown):
        notes = [
            f"{c[k]} {word}"
            for k, word in (("lost", "lost"), ("duplicated", "dup"), ("reordered", "reord"))
            if c[k]
        ]
        # every bar says its total: a consumer of one or two deliveries beside one of
        # thousands is a bar too thin to see, its label is not
        total = f"  {int(left[y]):,}"
        bars.text(left[y], y, total, va="center", fontsize=8.5, color=MUTED)
        if notes:
            bars.annotate(
                "  " + ", ".join(notes), (left[y], y), xytext=(6 * len(total), 0),
                textcoords="offset points", va="center", fontsize=8.5, color=RED,
            )  # fmt: skip
    if shown:
        # room at the right for the labels
        bars.set_xlim(0, max(left) * 1.25 or 1)
    worst = (
        f" (worst {MAX_CONSUMERS} of {len(consumers)})" if len(consumers) > MAX_CONSUMERS else ""
    )
    bars.set_title(f"Outcome per consumer{worst}", loc="left", color=INK)
    bars.set_xlabel("QoS 1/2 deliveries")
    bars.spines[["top", "right"]].set_visible(False)
    if shown:
        bars.legend(loc="upper left", bbox_to_anchor=(0, -0.2), fontsize=8, frameon=False, ncols=3)
    else:
        bars.text(0.5, 0.5, "no consumers in this window", ha="center", transform=bars.transAxes)

    # -- latency
    hist = fig.add_subplot(grid[1, 1])
    buckets = {int(k): v for k, v in doc["charts"]["latency_histogram"]["buckets"].items()}
    per_decade = doc["charts"]["latency_histogram"]["per_decade"]
    if buckets:
        edges = [10 ** (b / per_decade) for b in sorted(buckets)]
        widths = [10 ** ((b + 1) / per_decade) - 10 ** (b / per_decade) for b in sorted(buckets)]
        hist.bar(
            edges,
            [buckets[b] for b in sorted(buckets)],
            width=widths,
            align="edge",
            color="#3e7cb1",
            alpha=0.75,
        )
        hist.set_xscale("log")
        # at least a decade either side, so a narrow distribution still reads as one
        low, high = edges[0], edges[-1] + widths[-1]
        hist.set_xlim(min(low, high / 10) / 2, max(high, low * 10) * 2)
        hist.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: _ms(v)))
        # the percentiles as lines named in a legend inside the plot's corner: labels at the
        # lines crowd each other when they are close and clip at the plot's edge
        for name, style in (("p50", ":"), ("p90", "--"), ("p99", "-")):
            value = latency[name]
            if value:
                hist.axvline(
                    max(value, 1), color=INK, linestyle=style, linewidth=1,
                    label=f"{name} {_ms(value)}",
                )  # fmt: skip
        if any(latency[name] for name in ("p50", "p90", "p99")):
            hist.legend(loc="upper right", fontsize=8.5, framealpha=0.9, edgecolor="none")
        hist.set_xlabel("publish to first ack (log scale)")
        hist.set_ylabel("deliveries")
    else:
        hist.text(0.5, 0.5, "no acks in this window", ha="center", transform=hist.transAxes)
    hist.set_title("How long until the consumer acked", loc="left", color=INK)
    hist.spines[["top", "right"]].set_visible(False)

    # -- timeline
    line = fig.add_subplot(grid[2, :])
    timeline = doc["charts"]["timeline"]
    series = {k: {int(b): v for b, v in s.items()} for k, s in timeline["series"].items()}
    if series and timeline["bucket_ms"]:
        width = timeline["bucket_ms"]
        last = max(b for s in series.values() for b in s)
        xs = date2num(
            [
                datetime.fromtimestamp((timeline["start"] + b * width) / 1000, UTC)
                for b in range(last + 1)
            ]
        )
        bottom = [0] * len(xs)
        for key, (label, colour) in OUTCOMES.items():
            ys = [series.get(key, {}).get(b, 0) for b in range(last + 1)]
            if not any(ys):
                continue
            line.bar(
                xs, ys, bottom=bottom, width=width / 86_400_000 * 0.9, color=colour,
                label=label, align="edge",
            )  # fmt: skip
            bottom = [a + b for a, b in zip(bottom, ys)]
        # losses are a sliver of a bar: point at them
        lost = series.get("lost", {})
        for b, count in lost.items():
            line.annotate(
                f"{count} lost", (xs[b] + width / 86_400_000 / 2, bottom[b]),
                xytext=(0, 10), textcoords="offset points", ha="center", fontsize=8,
                color=RED, arrowprops={"arrowstyle": "-|>", "color": RED, "lw": 1},
            )  # fmt: skip
        if lost:
            line.set_ylim(0, max(bottom) * 1.3)
        line.set_ylabel("deliveries")
        line.set_title(
            f"Outcomes by publish time ({_ms(width)} buckets, UTC)", loc="left", color=INK
        )
        # beside the plot, not above it: above, it ran into the title of the chart over it
        line.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
        locator = AutoDateLocator()
        line.xaxis.set_major_locator(locator)
        line.xaxis.set_major_formatter(ConciseDateFormatter(locator))
    else:
        line.set_title("Outcomes by publish time", loc="left", color=INK)
        line.text(0.5, 0.5, "nothing published in this window", ha="center",
                  transform=line.transAxes)  # fmt: skip
    line.spines[["top", "right"]].set_visible(False)

    out = io.BytesIO()
    fig.savefig(out, format="png", bbox_inches="tight", facecolor="white")
    plt.close(fig)
    return out.getvalue()


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    if not rows:
        return "<p class=muted>none</p>"
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title in columns)
    body = []
    for row in rows:
        cells = []
        for key, _ in columns:
            value = row.get(key)
            if key in ("published_at", "at", "acked_at", "last_delivered_at") and value:
                value = iso(int(value))
            bad = key in ("lost", "duplicated", "reordered", "delivered_after_ack") and value
            cls = " class=bad" if bad else ""
            cells.append(f"<td{cls}>{html.escape(str(value if value is not None else '-'))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def render_html(doc: dict[str, Any], png: bytes | None) -> str:
    totals = doc["totals"]
    consumers = [
        {
            **c,
            "name": _consumer_name(c),
            "p50": _ms(c["latency_ms"]["p50"]),
            "p90": _ms(c["latency_ms"]["p90"]),
            "p99": _ms(c["latency_ms"]["p99"]),
        }
        for c in sorted(doc["consumers"], key=lambda c: (-_problems(c), c["consumer"]))
    ]
    picture = (
        f'<img alt="audit dashboard" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        if png
        else "<p class=muted>(charts need matplotlib)</p>"
    )
    verdict = (
        "<p class=ok>No delivery faults found.</p>"
        if doc["clean"]
        else "<p class=bad>Delivery faults found: see the tables below.</p>"
    )
    example_columns = [
        ("consumer_kind", "kind"),
        ("consumer", "consumer"),
        ("label", "label"),
        ("message_id", "message id"),
        ("published_at", "published"),
    ]
    sections = [
        ("Lost", doc["examples"]["lost"], example_columns),
        ("Duplicated", doc["examples"]["duplicated"], [*example_columns, ("acks", "acks")]),
        (
            "Reordered",
            doc["examples"]["reordered"],
            [
                ("consumer", "consumer"),
                ("ordering_key", "ordering key"),
                ("message_id", "message id"),
                ("acked_after", "acked after (published later)"),
                ("acked_at", "acked"),
            ],
        ),
        (
            "Delivered after ack",
            doc["examples"]["delivered_after_ack"],
            [*example_columns, ("acked_at", "acked"), ("last_delivered_at", "delivered again")],
        ),
    ]
    examples = "".join(
        f"<h3>{title} (first {len(rows)})</h3>" + _table(rows, columns)
        for title, rows, columns in sections
    )
    table = _table(
        consumers,
        [
            ("name", "consumer"),
            ("judged", "judged"),
            ("acked", "acked"),
            ("late", "late"),
            ("pending", "pending"),
            ("lost", "lost"),
            ("duplicated", "duplicated"),
            ("reordered", "reordered"),
            ("delivered_after_ack", "after ack"),
            ("redeliveries", "redeliveries"),
            ("dead_lettered", "dead-lettered"),
            ("p50", "p50"),
            ("p90", "p90"),
            ("p99", "p99"),
        ],
    )
    style = (
        "body{font-family:system-ui,sans-serif;margin:2em;color:#1f2933;max-width:1200px}"
        "table{border-collapse:collapse;font-size:13px}td,th{border-bottom:1px solid #e4e7eb;"
        "padding:4px 10px;text-align:right}th{background:#f5f7fa}td:first-child,th:first-child"
        "{text-align:left}.bad{color:#d64541;font-weight:bold}.ok{color:#2e9e5b;font-weight:bold}"
        ".muted{color:#616e7c}img{max-width:100%}"
    )
    return (
        "<!doctype html><html><head><meta charset=utf-8><title>Shoal delivery audit</title>"
        f"<style>{style}</style></head><body><h1>Shoal delivery audit</h1>{verdict}"
        f"<p class=muted>{totals['messages']:,} messages, {totals['consumers']} consumers; "
        f"matched by {html.escape(doc['matched_by'])}; generated {doc['generated_at']}.</p>"
        f"{picture}<h2>Consumers</h2>{table}<h2>Findings</h2>{examples}</body></html>"
    )


def write_audit(doc: dict[str, Any], output: Output) -> list[str]:
    try:
        png: bytes | None = render_png(doc)
    except ImportError:
        png = None
    written = []
    if png is not None:
        written.append(output.write("audit.png", png))
    written.append(output.write("report.html", render_html(doc, png).encode()))
    return written
