"""The ``server-files`` check's part for ``report/``: only the report's own files, each what it must be.

Owns: ``check_report(run_dir, out)``: every file under ``report/`` is one the report writes; each PNG is well-formed
with no text chunk but Matplotlib's ``Software`` tag; ``report.md`` is exactly what ``distmoe report`` renders from
the (checked) ``metrics.jsonl`` and ``run.json`` (``distmoe.report.report.render_markdown``), so no added or
edited line survives. Findings are appended to ``out``; :mod:`distmoe.audit.schemas` owns the rest of the check.

Must not: import ``flwr``, read party data, or write anything.
"""

from __future__ import annotations

import struct
from pathlib import Path

from distmoe.rundir import RunDir
from distmoe.rundir.layout import REPORT_FILES

PNG_SIG = b"\x89PNG\r\n\x1a\n"
PNG_CHUNKS = {b"IHDR", b"PLTE", b"IDAT", b"IEND", b"pHYs", b"tEXt"}


def _check_png(path: Path, rel: str, out: list[str]) -> None:
    data = path.read_bytes()
    if not data.startswith(PNG_SIG):
        out.append(f"{rel}: not a PNG")
        return
    pos = len(PNG_SIG)
    while pos + 8 <= len(data):
        (n,), ctype = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        if ctype not in PNG_CHUNKS:
            out.append(f"{rel}: chunk {ctype!r} at byte {pos}: not a chunk the report writes")
        elif ctype == b"tEXt" and not (body.lower().startswith(b"software\x00matplotlib") and len(body) <= 100):
            out.append(f"{rel}: text chunk at byte {pos}: only Matplotlib's Software tag may be written")
        pos += 12 + n
        if ctype == b"IEND":
            break
    if pos != len(data):
        out.append(f"{rel}: {len(data) - pos} bytes after the PNG's end (or a truncated chunk)")


def check_report(run_dir: Path, out: list[str]) -> None:
    rdir = RunDir(run_dir).report
    if not rdir.is_dir():
        return
    for f in sorted(rdir.rglob("*")):
        rel = f.relative_to(run_dir).as_posix()
        if f.is_dir():
            continue
        if f.is_symlink() or f.parent != rdir or f.name not in REPORT_FILES:
            out.append(f"{rel}: not a file the report writes")
        elif f.suffix == ".png":
            _check_png(f, rel, out)
    md = RunDir(run_dir).report_md
    if md.is_file():
        from distmoe.report.report import render_markdown

        try:
            want = render_markdown(run_dir).splitlines()
        except (OSError, ValueError) as exc:
            out.append(f"report/report.md: cannot be re-rendered from the run's records ({exc})")
            return
        got = md.read_text(encoding="utf-8", errors="replace").splitlines()
        for i, (a, b) in enumerate(zip(got, want, strict=False), 1):
            if a != b:
                out.append(f"report/report.md:{i}: differs from what the run's records render (an added or edited "
                           "line)")
                break
        else:
            if len(got) != len(want):
                out.append(f"report/report.md:{min(len(got), len(want)) + 1}: {abs(len(got) - len(want))} lines "
                           f"{'more' if len(got) > len(want) else 'fewer'} than the run's records render")
