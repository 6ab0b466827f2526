"""The documentation site: a strict build, no markup the renderer leaves raw, no figure that has drifted.

``mkdocs build --strict`` fails on broken links and unresolved API
cross-references. On top of that the built pages must not show Sphinx roles
(mkdocstrings renders docstrings as Markdown, so ``:class:`X``` would reach
the reader as text), the docs must stand on their own (no file outside the
repository is cited), the tables of what ``algorithm="auto"`` runs must be
the ones the fitted model gives today, and the index's code must fit the
page at 1280 px.
"""

from __future__ import annotations

import contextlib
import html
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: A Sphinx role as written (``:meth:`close```) or as the renderer leaves it (``:meth: close``, ``:func:~gradcoll``).
ROLE = re.compile(r"(?<![\w:]):(?:class|func|meth|mod|data|attr|exc|obj):(?=\s*[`~\w.])")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs", reason="mkdocs not installed: pip install 'gradcoll[docs]'")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings not installed: pip install 'gradcoll[docs]'")
    out = tmp_path_factory.mktemp("docs") / "site"
    exe = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or "mkdocs"
    r = subprocess.run(
        [exe, "build", "--strict", "-d", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=100, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def test_mkdocs_strict_build(site: Path) -> None:
    assert (site / "index.html").exists()
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("rank", "size", "world_size", "allreduce", "close"):
        assert f'id="gradcoll.group.ProcessGroup.{name}"' in api, f"ProcessGroup.{name} is missing from the API page"


def page_text(raw: str) -> str:
    """What a reader sees of an HTML page: no scripts, styles or tags, entities decoded."""
    raw = re.sub(r"<(script|style)\b.*?</\1>", " ", raw, flags=re.S | re.I)
    return html.unescape(re.sub(r"<[^>]+>", "", raw))


def leaked_roles(text: str) -> list[str]:
    return [text[max(0, m.start() - 30): m.end() + 40].replace("\n", " ") for m in ROLE.finditer(text)]


def test_role_detector_catches_what_the_renderer_leaves() -> None:
    # The two forms the API page used to show, and the raw one.
    assert leaked_roles(page_text("see :meth:<code>close</code> and"))
    assert leaked_roles(page_text("<p>:func: <code>~gradcoll.rendezvous.init_process_group</code></p>"))
    assert leaked_roles(":class:`~gradcoll.errors.UsageError`")
    assert not leaked_roles(page_text('<code>{"class": 1}</code> a::b std::mod x'))


def test_no_sphinx_role_reaches_a_page(site: Path) -> None:
    leaks = []
    for page in sorted(site.rglob("*.html")):
        for snippet in leaked_roles(page_text(page.read_text(encoding="utf-8"))):
            leaks.append(f"{page.relative_to(site)}: ...{snippet}...")
    assert not leaks, "Sphinx roles in the built site (write [`X`][gradcoll.mod.X] or ``X``):\n" + "\n".join(leaks)


# -- the docs stand on their own ------------------------------------------------------------------

#: Files the reader gets: the docs, README, examples, and the docstrings/comments of the package, tests, benches.
SOURCES = ["README.md", "mkdocs.yml", "docs/**/*.md", "examples/**/*.py", "gradcoll/**/*.py", "gradcoll/**/*.pyx",
           "tests/**/*.py", "benches/**/*.py"]
OUTSIDE = [
    (re.compile(r"SPEC\.md|\bSPEC\s*(?:§|section\b)"), "a specification file that is not in the repository"),
    (re.compile(r"§\s*\d"), "a numbered section of a document that is not in the repository"),
    (re.compile(r"STYLE\.md"), "a style file that is not in the repository"),
    (re.compile(r"\bseeds?/|\bseeds?\s+\d{3}\b|\bseed systems?\b", re.I),
     "the documents the project was created from"),
    (re.compile(r"(?<![\w/.])/(?:work|home|Users)/"), "an absolute path on some machine"),
]


def test_nothing_cites_a_file_outside_the_repository() -> None:
    hits = []
    me = Path(__file__).resolve()
    for pattern in SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            if path.resolve() == me or ".venv" in path.parts:
                continue
            for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                for rx, what in OUTSIDE:
                    if rx.search(line):
                        hits.append(f"{path.relative_to(ROOT)}:{no}: {what}: {line.strip()}")
    assert not hits, "describe the behaviour here instead of citing it:\n" + "\n".join(hits)


def test_markdown_links_stay_inside_the_repository() -> None:
    bad = []
    for path in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            resolved = (path.parent / target.split("#")[0]).resolve()
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                bad.append(f"{path.relative_to(ROOT)}: {target}")
    assert not bad, "links that leave the repository or point at nothing:\n" + "\n".join(bad)


# -- the index reads at 1280 px ---------------------------------------------------------------------

#: Characters of a code line that fit the content column of the index at a 1280 px window (about 80, with margin).
INDEX_CODE_COLUMNS = 72


def test_index_code_fits_the_page() -> None:
    text = (DOCS / "index.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    assert blocks
    long = [line for block in blocks for line in block.splitlines() if len(line) > INDEX_CODE_COLUMNS]
    assert not long, f"index.md code lines over {INDEX_CODE_COLUMNS} characters are cut off at 1280 px:\n" + "\n".join(long)
    first = text.split("```", 1)[0]
    assert re.search(r"\bgradcoll\b[^.]*\b(averages|is)\b", first), "the index opens with what gradcoll is, before any command"


# -- figures from the fitted model --------------------------------------------------------------------


def scaling_tables() -> Any:
    spec = importlib.util.spec_from_file_location("scaling_tables", ROOT / "benches" / "scaling_tables.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_scaling_page_tables_are_the_models() -> None:
    st = scaling_tables()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        st.tables()
        st.crossover_table()
        st.auto_table()
        st.two_level_table()
    page = (DOCS / "scaling.md").read_text(encoding="utf-8").splitlines()
    rows = [line for line in out.getvalue().splitlines() if line.startswith("|")]
    assert len(rows) > 30
    stale = [row for row in rows if row not in page]
    assert not stale, "docs/scaling.md differs from `python benches/scaling_tables.py`; paste its output:\n" + "\n".join(stale)


SIZE = re.compile(r"\b\d[\d,.]*\s?(?:B|KiB|MiB|GiB)\b")
PICKS = re.compile(r"\b(?:picks?|picked|runs|chooses|chose|thresholds?|crossovers?)\b", re.I)


def test_prose_quotes_only_the_models_auto_thresholds() -> None:
    from gradcoll.algorithms import auto_thresholds
    from gradcoll.model.costmodel import stored_models

    human = scaling_tables().human
    current = {human(at) for tr in stored_models() for n in (2, 3, 4, 8, 16, 64, 1024)
               for at, _ in auto_thresholds(n, tr)[1:]}
    current |= {human(at) for at, _ in auto_thresholds(4, "tcp", (2, 2))[1:]}  # the two-level bench's layout
    wrong = []
    for path in sorted(DOCS.rglob("*.md")):
        text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
        for para in re.split(r"\n\s*\n", text):
            if para.lstrip().startswith("|"):
                continue  # tables are checked against the generator above
            for sentence in re.split(r"(?<=[.;:])\s+", para.replace("\n", " ")):
                if re.search(r"\bauto\b", sentence) and PICKS.search(sentence):
                    figures = [m.group(0) for m in SIZE.finditer(sentence) if m.group(0) not in current]
                    if figures:
                        wrong.append(f"{path.relative_to(ROOT)}: {figures}: {sentence}")
    assert not wrong, ("sizes quoted for algorithm=\"auto\" that the fitted model does not give "
                       "(point to the table in docs/scaling.md instead):\n" + "\n".join(wrong))
