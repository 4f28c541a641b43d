"""The README's measured numbers come from the committed results: every table row that cites a results README
(`benchmarks/results/<GPU>/README.md`) quotes only timings that file holds, and the GPUs measured there are cited."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(r"benchmarks/results/[\w.-]+/README\.md")
TIMING = re.compile(r"(\d+\.\d+) ms")


def _cited_rows() -> list[tuple[str, Path]]:
    rows = []
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("|") and (match := CITED.search(line)):
            rows.append((line, ROOT / match.group(0)))
    return rows


def test_every_timing_in_a_cited_row_is_in_the_file_it_cites():
    rows = _cited_rows()
    assert rows, "no README table row cites a results README"
    for line, path in rows:
        text = path.read_text()
        quoted = TIMING.findall(line)
        assert quoted, f"a row citing {path.name} quotes no timing: {line[:80]}"
        missing = [t for t in quoted if t not in text]
        assert not missing, f"{missing} ms are not in {path.relative_to(ROOT)}: {line[:80]}"


def test_the_decode_step_is_cited_for_the_h100_and_the_h200():
    cited = {path.parent.name for _, path in _cited_rows()}
    assert {"NVIDIA_H100_80GB_HBM3", "NVIDIA_H200"} <= cited
