#!/usr/bin/env python3
"""Write README.pypi.md, the package's long description on PyPI: README.md with each relative
link made absolute to the repository at the release's tag, since PyPI's page resolves none.

    scripts/pypi_readme.py          # after README.md or the version changed (docs/releasing.md)

The repository is setup.cfg's `Source` project URL, the tag `v` and vllm_cpu_launch's
__version__ (read from its file, not imported); a link `docs/x.md#y` becomes
`SOURCE/blob/vVERSION/docs/x.md#y`, an image's `SOURCE/raw/vVERSION/...`, and `#y` the
README's own section there. tests/test_release.py holds README.pypi.md equal to what this
makes. Standard library only.
"""

from __future__ import annotations

import ast
import configparser
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = "README.pypi.md"
# A Markdown link or image whose target is neither a URL nor mail: `[text](docs/x.md#y)`.
RELATIVE = re.compile(r"(!?)\[([^\]]*)\]\((?![a-z][a-z0-9+.-]*:)([^)\s]+)\)")


def source_url(setup_cfg: str) -> str:
    """setup.cfg's `Source` project URL, the repository's one address."""
    config = configparser.ConfigParser()
    config.read_string(setup_cfg)
    lines = config["metadata"]["project_urls"].strip().splitlines()
    (url,) = (
        value
        for key, _, value in (line.partition("=") for line in lines)
        if key.strip() == "Source"
    )
    return url.strip()


def package_version(init_py: str) -> str:
    """`__version__ = "..."` of vllm_cpu_launch/__init__.py."""
    for node in ast.parse(init_py).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
            "__version__"
        ]:
            return str(ast.literal_eval(node.value))
    raise ValueError("vllm_cpu_launch/__init__.py sets no __version__")


def pypi_readme(readme: str, source: str, version: str) -> str:
    """README.md with its relative links and images pointing at tag v`version` of `source`."""

    def absolute(match: re.Match[str]) -> str:
        image, text, target = match.groups()
        path = f"README.md{target}" if target.startswith("#") else target
        return f"{image}[{text}]({source}/{'raw' if image else 'blob'}/v{version}/{path})"

    return RELATIVE.sub(absolute, readme)


def made_from_checkout(root: Path = REPO) -> str:
    """README.pypi.md as this checkout's README.md, setup.cfg and version make it."""
    return pypi_readme(
        (root / "README.md").read_text(encoding="utf-8"),
        source_url((root / "setup.cfg").read_text(encoding="utf-8")),
        package_version((root / "vllm_cpu_launch" / "__init__.py").read_text(encoding="utf-8")),
    )


if __name__ == "__main__":
    (REPO / TARGET).write_text(made_from_checkout(), encoding="utf-8")
