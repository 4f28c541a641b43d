"""Where a kernel's warps stall, from an ncu report's SASS page:

    ncu -k regex:NAME -c 1 --set full --import-source yes -o rep python3 benchmarks/dev/profile_triton_kernels.py
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 -m benchmarks.dev.ncu_stalls sass.csv [--top 25]

prints each stall reason's share of all warp samples, the instructions with the most samples (and the reason that
dominates each), and the share spent on local-memory (spill) loads and stores."""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(text: str) -> float:
    return float(text.replace(",", "") or 0)


def read_sass(path: Path) -> list[dict[str, str]]:
    """The SASS rows of ncu's `--page source --csv --print-source sass` output (the lines before its header row,
    such as the kernel's name, are skipped)."""
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    header_at = next(i for i, row in enumerate(rows) if "Source" in row and SAMPLES in row)
    header = rows[header_at]
    return [dict(zip(header, row, strict=True)) for row in rows[header_at + 1:] if len(row) == len(header)]


def summarize(rows: list[dict[str, str]], top: int) -> str:
    """The report: reasons by share of samples, the `top` instructions by samples, and the spill share."""
    total = sum(_number(row[SAMPLES]) for row in rows) or 1.0
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c] if rows else []
    by_reason = Counter({reason: sum(_number(row[reason]) for row in rows) for reason in reasons})
    lines = [f"{len(rows)} instructions, {total:.0f} warp samples", "stall reasons:"]
    lines += [f"  {reason:24s} {100 * n / total:5.1f} %" for reason, n in by_reason.most_common(10) if n]
    lines.append("instructions with the most samples:")
    for row in sorted(rows, key=lambda row: -_number(row[SAMPLES]))[:top]:
        reason = max(reasons, key=lambda reason: _number(row[reason])) if reasons else ""
        lines.append(f"  {row['Address'][-6:]:>6s} {100 * _number(row[SAMPLES]) / total:5.1f} % {reason:18s} "
                     f"{row['Source'].strip()[:100]}")
    spills = [row for row in rows if any(op in row["Source"] for op in ("LDL", "STL"))]
    lines.append(f"local memory (spills): {len(spills)} instructions, "
                 f"{100 * sum(_number(row[SAMPLES]) for row in spills) / total:.1f} % of samples")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sass_csv", type=Path)
    parser.add_argument("--top", type=int, default=25, help="instructions to list")
    args = parser.parse_args()
    print(summarize(read_sass(args.sass_csv), args.top))


if __name__ == "__main__":
    main()
