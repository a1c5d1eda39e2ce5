"""The documentation: every relative link of the README and of docs/*.md reaches a file, the MkDocs
site builds with ``--strict`` (broken links and anchors between pages fail it), and the generated
configuration reference is current."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from trainer.driver.config.reference import REGENERATE, reference

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def relative_links(text: str) -> list[str]:
    """The link targets of ``text`` outside fenced code and code spans that are neither URLs nor
    anchors of the same page, without their ``#anchor``."""
    text = FENCE.sub("", text)
    text = re.sub(r"`[^`\n]*`", "", text)
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http:, https:, mailto: ...; an anchor on the same page is mkdocs' to check
        out.append(target.split("#", 1)[0])
    return out


def test_link_finder():
    text = (
        "[a](docs/x.md) [b](y.md#part) [c](https://e.org) [d](#here) ![img](p.png) `[e](no.md)`\n```\n[f](no.md)\n```"
    )
    assert relative_links(text) == ["docs/x.md", "y.md"]


def test_every_relative_link_reaches_a_file():
    assert (ROOT / "docs" / "index.md").is_file() and len(PAGES) > 5
    broken = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in PAGES
        for target in relative_links(page.read_text())
        if not (page.parent / target).exists()
    ]
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_mkdocs_builds_strictly(tmp_path):
    """mkdocs is in the ``dev`` dependencies: a missing install is a failure, not a skip."""
    import mkdocs  # noqa: F401

    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    assert (tmp_path / "site" / "configuration.html").is_file()


def test_configuration_reference_is_current():
    current = (ROOT / "docs" / "configuration.md").read_text()
    assert current == reference(), (
        "docs/configuration.md is not what the config models give now (a config field was added, "
        f"changed or documented differently); regenerate it from the repository root with:\n    {REGENERATE}"
    )


def test_reference_lists_every_field():
    from pydantic import BaseModel

    from trainer.driver.config.schema import JobConfig

    text = reference()
    for section, info in JobConfig.model_fields.items():
        assert f"## `[{section}]`" in text, section
        model = info.annotation if isinstance(info.annotation, type) else None
        if model is None:  # Optional[...] sections
            model = next(a for a in info.annotation.__args__ if isinstance(a, type) and issubclass(a, BaseModel))
        for name in model.model_fields:
            assert f"- **`{name}`**" in text, f"{section}.{name}"
