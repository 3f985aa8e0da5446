"""The glue's size budget (issue 40): csrc/python, the CPython glue, only converts Python
objects to engine structs and engine statuses to exceptions, in at most 2,800 lines, no file
over 420. Logic that decides (shapes, checks, defaults, layouts) belongs in the engine below it."""
from pathlib import Path

GLUE = Path(__file__).resolve().parents[2] / "csrc" / "python"


def test_the_glue_stays_within_its_line_budget():
    lines = {p.name: len(p.read_text().splitlines()) for p in sorted(GLUE.glob("*.[ch]"))}
    assert len(lines) > 10, f"expected the glue's files in {GLUE}, found {sorted(lines)}"
    too_long = {name: n for name, n in lines.items() if n > 420}
    assert not too_long, f"glue files over 420 lines: {too_long}"
    assert sum(lines.values()) <= 2800, f"csrc/python has {sum(lines.values())} lines (at most 2,800): {lines}"
