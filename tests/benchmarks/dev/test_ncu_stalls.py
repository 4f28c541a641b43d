"""ncu_stalls reads ncu's SASS page as ncu writes it (a kernel-name line before the header, thousands separators)
and ranks stall reasons and instructions by their warp samples."""

from __future__ import annotations

from pathlib import Path

from benchmarks.dev.ncu_stalls import read_sass, summarize

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]
ROWS = [
    ["0x7f00", "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR16], R152", "1,000", "900", "100", "900", "90"],
    ["0x7f10", "LDL.LU R13, [R1+0x28]", "3,000", "2,900", "3,000", "0", "2,900"],
    ["0x7f20", "FFMA R1, R2, R3, R4", "0", "0", "0", "0", "0"],
]


def test_ranks_reasons_and_instructions_and_counts_spills(tmp_path: Path):
    path = tmp_path / "sass.csv"
    lines = ['"Kernel Name","_gluon_mla_kernel",', ",".join(f'"{c}"' for c in HEADER)]
    lines += [",".join(f'"{c}"' for c in row) for row in ROWS]
    path.write_text("\n".join(lines) + "\n")
    rows = read_sass(path)
    assert [row["Address"] for row in rows] == ["0x7f00", "0x7f10", "0x7f20"]
    report = summarize(rows, top=2).splitlines()
    assert report[0] == "3 instructions, 4000 warp samples"
    assert report[2].split() == ["stall_long_sb", "77.5", "%"] and report[3].split() == ["stall_wait", "22.5", "%"]
    listed = report[report.index("instructions with the most samples:") + 1:-1]
    assert [line.split()[:4] for line in listed] == [["0x7f10", "75.0", "%", "stall_long_sb"],
                                                     ["0x7f00", "25.0", "%", "stall_wait"]]
    assert report[-1] == "local memory (spills): 1 instructions, 75.0 % of samples"
