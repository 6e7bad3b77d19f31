"""The README and docs/ link only to what exists: every relative link points
at a file of the repository and every #anchor at a heading of its page,
every docs page the code names (in notes it prints) exists, and every
`module.name` the pages name is something that module defines."""

import ast
import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target); the text may hold code spans, blanked first.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
# docs pages named in the code, e.g. "see docs/linux.md" or "docs/linux.md#threads".
CODE_REFERENCE = re.compile(r"\b((?:docs/[\w.-]+|README)\.md)(#[\w-]+)?")


def prose(text: str) -> str:
    """``text`` without fenced code blocks, and with code spans blanked."""
    return CODE_SPAN.sub("code", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``page``."""
    seen: dict[str, int] = {}
    result = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def relative_links(page: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(prose(page.read_text()))
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto: ...
    ]


def broken(page: Path, target: str) -> str | None:
    """Why ``target``, linked from ``page``, is broken; None if it is not."""
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
        return f"{target}: no such file"
    if not file.is_relative_to(ROOT):
        return f"{target}: outside the repository"
    if anchor and file.suffix == ".md" and anchor not in anchors(file):
        return f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_point_at_files_and_headings(page):
    links = relative_links(page)
    problems = [problem for target in links if (problem := broken(page, target))]
    assert not problems, problems


def test_every_docs_page_is_linked_from_the_readme():
    linked = {
        (ROOT / target.partition("#")[0]).resolve() for target in relative_links(ROOT / "README.md")
    }
    unlinked = [page.name for page in PAGES[1:] if page not in linked]
    assert not unlinked, unlinked


def test_docs_pages_named_in_the_code_exist():
    sources = [*ROOT.glob("*.py"), *ROOT.glob("benchmarks/*.py"), *ROOT.glob("tests/*.py")]
    problems = []
    for source in sources:
        if source.name == Path(__file__).name:
            continue
        for name, anchor in CODE_REFERENCE.findall(source.read_text()):
            file = ROOT / name
            if not file.exists():
                problems.append(f"{source.name}: {name}: no such file")
            elif anchor and anchor[1:] not in anchors(file):
                problems.append(f"{source.name}: {name}{anchor}: no such heading")
    assert not problems, problems


def test_the_checks_catch_broken_links(tmp_path, monkeypatch):
    """A missing file, a missing heading and a heading that exists."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## Choosing g: `--num-draft auto`\n\n"
        "[a](missing.md) [b](#nowhere) [c](#choosing-g---num-draft-auto) "
        "[d](https://example.com) `[e](not-a-link.md)`\n\n```\n[f](in-code.md)\n```\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert relative_links(page) == ["missing.md", "#nowhere", "#choosing-g---num-draft-auto"]
    assert [broken(page, target) is None for target in relative_links(page)] == [
        False,
        False,
        True,
    ]


def test_copyable_commands_name_the_venvs_python():
    """After the README's quick start (a .venv, never activated), a bare
    ``python`` is the system's, without mlx: every command a reader copies
    names .venv/bin/python."""
    bare = re.compile(r"(?<![/\w.-])python3? (?!-m venv)\S+\.py|(?<![/\w.-])python3? -m pytest")
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            assert not bare.search(line), f"{page.name}:{number}: {line}"


# A code span naming something of a module of this repository: `module.name`,
# `module.Class.method`, `cpu.forms.chosen_form`, with or without a call.
QUALIFIED = re.compile(r"`([a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?:\([^`]*\))?`")
# The dated log of docs/benchmarks.md may name what is gone since.
LOG_PAGES = {"benchmark-log.md"}
MODULES = {path.stem for path in ROOT.glob("*.py")} | {"cpu"}
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "txt", "c", "safetensors", "npz"}


def top_level_names(module) -> set[str]:
    """The names ``module``'s own source defines at its top level."""
    tree = ast.parse(Path(module.__file__).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def defines(owner, name: str) -> bool:
    """Whether the class ``owner`` has ``name``: an attribute, a dataclass
    field, or one its methods set on ``self``."""
    if hasattr(owner, name) or name in getattr(owner, "__dataclass_fields__", {}):
        return True
    return f"self.{name} " in inspect.getsource(owner) or f"self.{name}," in inspect.getsource(
        owner
    )


def unresolved(qualified: str) -> str | None:
    """Why ``qualified`` (``module.name...``) names nothing of the module; None if it does."""
    parts = qualified.split(".")
    if parts[0] not in MODULES or parts[-1] in FILE_SUFFIXES:  # main.py, model.safetensors
        return None
    module = importlib.import_module(parts[0])
    index = 1
    while index < len(parts) and inspect.ismodule(getattr(module, parts[index], None)):
        module = getattr(module, parts[index])  # a package's module: cpu.forms
        index += 1
    if index == len(parts):
        return None
    if parts[index] not in top_level_names(module):
        return f"{module.__name__} defines no {parts[index]}"
    owner = getattr(module, parts[index])
    for name in parts[index + 1 :]:
        if not inspect.isclass(owner) or not defines(owner, name):
            return f"{qualified}: no {name}"
        owner = getattr(owner, name, None)
    return None


@pytest.mark.parametrize(
    "page",
    [page for page in PAGES if page.name not in LOG_PAGES],
    ids=lambda page: str(page.relative_to(ROOT)),
)
def test_names_in_code_spans_are_what_their_modules_define(page):
    """Every `module.name` of the README and the reference pages names
    something that module defines (not one it imports), as the code stands."""
    text = page.read_text()
    problems = {problem for name in QUALIFIED.findall(text) if (problem := unresolved(name))}
    assert not problems, sorted(problems)


def test_the_name_check_catches_what_moved():
    assert unresolved("speculative.speculative_round") is None
    assert unresolved("decoder.SpeculativeDecoder.stream") is None
    assert unresolved("cpu.forms.chosen_form") is None
    assert unresolved("decoder.speculative_round") == "decoder defines no speculative_round"
    assert unresolved("model.DecoderCache") == "model defines no DecoderCache"  # imported there
    assert unresolved("decoder.SpeculativeDecoder.no_such") is not None


README_LINES = 230


def test_the_readme_keeps_its_line_budget():
    """The README stays a page: what does not fit goes to docs/."""
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_LINES, f"README.md has {lines} lines, over {README_LINES}"
