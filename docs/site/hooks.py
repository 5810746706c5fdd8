"""mkdocs hooks for the docs site (mkdocs.yml): README.md becomes the landing page (index.md) and
benchmark/RESULTS.md the page results.md, each read from where it lives; every page's links are
pointed at the site's pages, and a link to a file of the repository that is no page (a script,
a results file) keeps its text and names the file, since the site holds no source."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
PAGES = {"README.md": "index.md", "benchmark/RESULTS.md": "results.md"}  # repository path -> site page
SOURCES = {page: path for path, page in PAGES.items()}
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def on_files(files, config):
    for path, page in PAGES.items():
        files.append(File.generated(config, page, abs_src_path=str(ROOT / path)))
    return files


def repository_path(page_src: str) -> str:
    """Where a site page's markdown lives in the repository."""
    return SOURCES.get(page_src, f"docs/{page_src}")


def on_page_markdown(markdown, page, config, files):
    here = posixpath.dirname(repository_path(page.file.src_uri))

    def point(match):
        bang, text, target = match.groups()
        if re.match(r"[a-z]+:|#", target):  # a URL or an anchor on this page
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(here, path))
        if resolved in PAGES:
            site = PAGES[resolved]
        elif resolved.startswith("docs/"):
            site = resolved[len("docs/"):]
        else:  # a file of the repository, not of the site
            return f"{text} (`{resolved}`)" if not bang else f"`{resolved}`"
        site = posixpath.relpath(site, posixpath.dirname(page.file.src_uri) or ".")
        return f"{bang}[{text}]({site}{'#' + anchor if anchor else ''})"

    return LINK.sub(point, markdown)
