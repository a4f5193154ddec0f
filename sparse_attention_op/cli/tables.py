"""Plain-text tables for the command line: left-aligned columns, two spaces apart."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "") -> str:
    """``rows`` under ``header``, each column as wide as its widest cell (no trailing blanks)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    if any(len(row) != len(header) for row in cells):
        raise ValueError(f"every row needs {len(header)} cells")
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def format_number(value: float) -> str:
    """A statistic for a table: 4 significant digits, plain notation for ordinary magnitudes."""
    return f"{value:.4g}"
