"""The documentation holds together: a README short enough to read, and every relative link of the
README, the docs/ pages and benchmarks/README.md pointing at a file (and heading) that exists."""

from docs_pages import README, ROOT, anchors, broken_links, pages

README_MAX_LINES = 300


def test_the_readme_stays_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move the details to a page under docs/"


def test_every_relative_link_points_at_an_existing_file_and_heading():
    linked = [*pages(), ROOT / "benchmarks" / "README.md"]
    assert len(linked) > 5
    assert [b for page in linked for b in broken_links(page)] == []


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text('# A page\n\n## What "verified" means\n\n```bash\n# not a heading\n```\n')
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md) [ok](docs/a.md#what-verified-means) [ok](#top) [web](https://example.org/x)\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#not-a-heading) `[in code](docs/c.md)`\n\n# Top\n"
    )
    assert anchors((tmp_path / "docs" / "a.md").read_text()) == {"a-page", "what-verified-means"}
    assert broken_links(tmp_path / "README.md") == [
        "README.md: docs/b.md (no file docs/b.md)",
        "README.md: docs/a.md#not-a-heading (no heading #not-a-heading in a.md)",
    ]
