"""The documentation cannot rot: its Python snippets run, its links resolve, and the README's
setup and test commands are what CI runs.

Every fenced block whose info string starts with ``python`` in ``README.md`` and
``docs/guides/*.md`` runs as written, as a script of its own in a fresh interpreter (as a user would
paste it into a file), from a scratch directory, with this checkout first on the import path. Words
after ``python`` in the info string say otherwise (GitHub and MyST take the first word as the
language, so readers see plain Python):

- ``python no-run``: not run (it needs a cluster, an MPI launch, long training, or names a reader
  fills in, such as ``env_fns``);
- ``python slow``: run only in the full suite (it trains for a few seconds), as the ``slow`` marker
  says for every test of several seconds.

Keep runnable snippets short (a few thousand steps at most): they document the API, the examples
and benchmarks show training.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<code>.*?)^```\s*$", re.M | re.S)
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
SNIPPET_TIMEOUT = 300  # seconds; the slow snippets train a few thousand steps


def snippets() -> list:
    params = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            words = match["info"].split()
            if not words or words[0] != "python" or "no-run" in words[1:]:
                continue
            line = text.count("\n", 0, match.start()) + 1
            marks = [pytest.mark.slow] if "slow" in words[1:] else []
            name = f"{page.relative_to(ROOT)}:{line}"
            params.append(pytest.param(match["code"], id=name, marks=marks))
    return params


@pytest.mark.parametrize("code", snippets())
def test_snippet_runs(code: str, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SNIPPET_TIMEOUT
    )
    assert run.returncode == 0, f"the snippet failed:\n{code}\n--- stdout\n{run.stdout}\n--- stderr\n{run.stderr}"


def test_pages_have_runnable_snippets() -> None:
    """The parser finds what it should: a page of snippets that all went unrun would test nothing."""
    ids = [param.id for param in snippets()]
    assert any(name.startswith("README.md") for name in ids)
    assert len(ids) >= 10, ids


@pytest.mark.parametrize("page", [*PAGES, ROOT / "docs" / "index.md"], ids=lambda page: str(page.relative_to(ROOT)))
def test_local_links_resolve(page: Path) -> None:
    """Every relative link of a page names a file of the repository (its #anchor aside)."""
    missing = []
    for match in LINK.finditer(page.read_text()):
        target = match["target"].split("#")[0]
        if not target or "://" in target or target.startswith("mailto:"):
            continue
        if not (page.parent / target).exists():
            missing.append(match["target"])
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def _bash_block(text: str, after: str) -> str:
    """The first bash block after the paragraph that starts with ``after``."""
    start = text.index(after)
    match = FENCE.search(text, start)
    assert match and match["info"].strip() == "bash", f"no bash block after {after!r}"
    return match["code"].strip()


def test_ci_installs_and_tests_as_the_readme_says() -> None:
    """The README's setup and test commands are what ``.ci/run`` runs, so they stay true."""
    readme = (ROOT / "README.md").read_text()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    setup = _bash_block(readme, "**Setup**")
    installs = [part.strip() for part in setup.split("&&") if part.strip().startswith("pip install")]
    assert installs, setup
    for install in installs:
        package_args = install.removeprefix("pip install").strip()
        assert any(
            line.startswith("python -m pip install") and line.endswith(package_args) for line in ci_lines
        ), f".ci/run does not run the README's {install!r}"
    test_command = _bash_block(readme, "**Tests:**")
    assert test_command in ci_lines, f".ci/run does not run the README's {test_command!r}"
