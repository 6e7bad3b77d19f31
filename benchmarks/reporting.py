"""What the benchmarks share to report their rows: the printed table, the CSV and JSON
files (each written whole), the machine's name, and matplotlib figures with their legend
below the panels."""

from __future__ import annotations

import csv
import io
import json
import os
import platform
from dataclasses import asdict
from pathlib import Path

# A column: (the row's field, the title, how a value is formatted; None prints "-").
Column = tuple[str, str, str]


def format_table(rows: list, columns: list[Column], markdown: bool = False) -> str:
    """The rows' ``columns``, aligned; with ``markdown``, as a Markdown table."""
    header = [title for _, title, _ in columns]
    lines = [
        [
            "-" if getattr(row, name) is None else form.format(getattr(row, name))
            for name, _, form in columns
        ]
        for row in rows
    ]
    widths = [max(len(cell) for cell in column) for column in zip(header, *lines)]
    if markdown:
        rule = ["-" * width for width in widths]
        return "\n".join(
            "| " + " | ".join(cell.rjust(width) for cell, width in zip(line, widths)) + " |"
            for line in [header, rule, *lines]
        )
    return "\n".join(
        "  ".join(cell.rjust(width) for cell, width in zip(line, widths))
        for line in [header, *lines]
    )


def write_whole(path: Path, write) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, then rename it
    into place, so that an interrupted write never leaves half a file."""
    temporary = path.with_name(f".{path.name}.partial")
    with temporary.open("wb") as file:
        write(file)
    os.replace(temporary, path)


def write_tables(rows: list, columns: list[Column], extra: dict, output: Path) -> list[Path]:
    """OUTPUT.csv (the rows' ``columns``) and OUTPUT.json (``extra`` and the rows)."""
    table = io.StringIO()
    writer = csv.DictWriter(
        table, fieldnames=[name for name, _, _ in columns], extrasaction="ignore"
    )
    writer.writeheader()
    writer.writerows(asdict(row) for row in rows)
    report = json.dumps({**extra, "rows": [asdict(r) for r in rows]}, indent=2)
    written = [output.with_suffix(".csv"), output.with_suffix(".json")]
    for path, text in zip(written, (table.getvalue(), report)):
        write_whole(path, lambda file, text=text: file.write(text.encode()))
    return written


def pyplot():
    """matplotlib's pyplot, drawing to files, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        return None
    return plt


def save_with_legend_below(figure, axes, path: Path, panel_height: float = 4) -> None:
    """One legend for all of ``axes`` (the first panel's entries), below the
    panels so that it hides no data, then ``figure`` saved as PNG to ``path``."""
    handles, labels = axes[0].get_legend_handles_labels()
    legend_height = 0.22 * -(-len(labels) // 3)  # inches: three entries a row
    figure.set_figheight(panel_height + legend_height)
    figure.legend(handles, labels, loc="lower center", ncol=3, fontsize="small", frameon=False)
    bottom = (legend_height + 0.1) / (panel_height + legend_height)
    figure.tight_layout(rect=(0, bottom, 1, 1))
    write_whole(path, lambda file: figure.savefig(file, format="png", dpi=120))


def machine_name() -> str:
    """The CPU model (from /proc/cpuinfo where there is one), its logical
    cores, the operating system and the architecture."""
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    model = model or platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} logical cores, {platform.system()} {platform.machine()}"
