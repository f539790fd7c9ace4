"""Every reference in the code to a section of docs/ ("docs/maths.md §2.8", "docs/design.md §3", a range
"§2.2-2.8", a list "§2.11, §2.16") names a numbered heading of that document, and the code cites no document that
does not ship in the repository (the old reference files: paper-math, rotary-circuits, attention-variants, and the
old module attention_variants.py, whose content is now model/qk_norm.py, soft_cap.py, window.py and norm.py)."""

from __future__ import annotations

import re
from pathlib import Path

from circuits_core.circuits.qk_forms import QK_FORMS

ROOT = Path(__file__).resolve().parents[1]
CODE = [*ROOT.glob("circuits_core/**/*.py"), *ROOT.glob("app/**/*.py"), *ROOT.glob("tests/**/*.py"),
        *ROOT.glob("bench/**/*.py"), *ROOT.glob("templates/*.html")]  # fmt: skip
CITATION = re.compile(r"docs/(\w+)\.md ((?:§[\d.]+(?:-[\d.]+)?(?:, )?)+)")
SECTION = re.compile(r"§(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?")
HEADING = re.compile(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", re.M)
OUTSIDE = re.compile(r"paper-math|rotary-circuits\.md|attention-variants\.md|attention_variants\.py")
# a document of docs/ named without its folder ("design.md, ..."), which reads as the old reference file of that name
# (a path built in code, "docs" / "x.md", is not one)
BARE = re.compile(r"(?<![/\w\"'])(design|maths|serving|glossary)\.md")


def headings(doc: str) -> set[str]:
    return set(HEADING.findall((ROOT / "docs" / f"{doc}.md").read_text()))


def citations() -> list[tuple[Path, str, str]]:
    found = []
    for path in CODE:
        if path.resolve() == Path(__file__).resolve():
            continue
        for match in CITATION.finditer(path.read_text()):
            for first, last in SECTION.findall(match.group(2)):
                found += [(path, match.group(1), first)] + ([(path, match.group(1), last)] if last else [])
    return found


def test_every_docs_citation_names_a_section() -> None:
    found = citations()
    assert len(found) > 60  # the code cites the docs throughout: a broken pattern would find none
    known = {doc: headings(doc) for doc in {doc for _, doc, _ in found}}
    missing = [f"{p.relative_to(ROOT)}: docs/{doc}.md §{s}" for p, doc, s in found if s not in known[doc]]
    assert not missing, "citations of sections that do not exist:\n" + "\n".join(missing)


def test_the_code_cites_no_document_outside_the_repository() -> None:
    outside = [str(p.relative_to(ROOT)) for p in CODE if p.resolve() != Path(__file__).resolve()
               and OUTSIDE.search(p.read_text())]  # fmt: skip
    assert not outside, f"references to documents that do not ship: {outside}"


def test_the_code_names_docs_by_their_path() -> None:
    bare = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in CODE if p.resolve() != Path(__file__).resolve()
            for m in BARE.finditer(p.read_text())]  # fmt: skip
    assert not bare, f"cite docs/<name>.md, not a bare name: {bare}"


def test_the_readme_says_which_qk_numbers_are_exact_and_which_frozen() -> None:
    """The README names each form a QK number of the newest attention can take (qk_forms.QK_FORMS, multi-head latent
    attention's own aside), so that a reader learns there what is exact and what is frozen."""
    readme = (ROOT / "README.md").read_text()
    forms = [form for form in QK_FORMS if not form.startswith("latent")]
    assert forms == ["exact", "cosine", "bilinear", "frozen-norm"]
    missing = [form for form in forms[1:] if f"`{form}`" not in readme]
    assert not missing, f"README.md does not name the QK forms {missing}"


# a file of the repository named by its path (a placeholder such as app/views/x.py is not one)
FILE_PATH = re.compile(
    r"(?<![\w/.<{-])((?:app|circuits_core|tests|bench|templates|static|docs|checkpoints)/[\w/.-]*\w"
    r"\.(?:py|md|html|js|css|json|sh))\b"
)
TEXTS = [*CODE, *ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "Makefile",
         ROOT / "Dockerfile", *ROOT.glob("static/*.js"), *ROOT.glob("static/*.css")]  # fmt: skip


def test_every_file_the_code_and_docs_name_exists() -> None:
    """A module, test, template or document named by its path in the code, the docs or a page exists: files move
    (circuits_core's groups, app/scheduling/), and a stale path sends a reader, or a page's note, nowhere."""
    named = [(p, m.group(1)) for p in TEXTS for m in FILE_PATH.finditer(p.read_text(errors="replace"))]
    assert len(named) > 300  # the docs name files throughout: a broken pattern would find none
    stale = [f"{p.relative_to(ROOT)}: {name}" for p, name in named
             if not (ROOT / name).exists() and Path(name).stem != "x"]  # fmt: skip
    assert not stale, "paths to files that do not exist:\n" + "\n".join(stale)
