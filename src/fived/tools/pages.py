"""Self-contained HTML pages (`fived explore`, `fived report`): the charting library (plotly.js, from
the plotly Python package's bundled copy), the page's own small script and style (fived/assets) and
the data (gzip-compressed JSON, base64) inline in one file that works offline from disk. The script
only looks figures up in the data and draws them: every number is computed in Python.

plotly is an optional extra: `pip install 'fived[pages]'`.
"""

from __future__ import annotations

import base64
import gzip
import html
import json
from importlib.resources import files
from pathlib import Path

from fived.config import ConfigError


def plotly_js() -> str:
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        raise ConfigError(
            "plotly",
            "not installed",
            "the pages bundle plotly.js from the plotly package",
            "pip install 'fived[pages]'",
        ) from None
    return get_plotlyjs()


def inline_script(code: str) -> str:
    return "<script>" + code.replace("</script", "<\\/script") + "</script>"


PAGE_MARK = '<meta name="generator" content="fived">'  # (fived replaces only a page that holds it)


def check_page(path: str | Path) -> None:
    """Refuse, before the work, a page write_page would refuse (a link, a file fived did not write)."""
    from fived.files import check_output, is_fived_dir, starts_with, target

    out = Path(path)
    if is_fived_dir(out.parent):
        target(out.parent, out.name)
    else:
        check_output(out, "--output", starts_with(PAGE_MARK.encode()))


# gzip's level: 4 packs mixtral-8x7b/128's explore data (79 MB of JSON) into 11.0 MB in 0.7 s, where 6
# (the default) gives 10.1 MB in 1.4 s of a command that waits for it
GZIP_LEVEL = 4


def write_page(path: str | Path, title: str, kind: str, data: dict) -> Path:
    """Write the page `kind` ("explore" or "report") showing `data` to `path`."""
    assets = files("fived.assets")
    # (mtime 0: the same data gives the same page, byte for byte; gzip stamps the time otherwise.
    # check_circular off: the data is a tree fived built, and tracking every container of an explore
    # page's ~10^6 costs ~7% of the dump)
    text = json.dumps(data, separators=(",", ":"), check_circular=False)
    packed = gzip.compress(text.encode(), GZIP_LEVEL, mtime=0)
    payload = base64.b64encode(packed).decode()
    page = "\n".join(
        [
            "<!doctype html>",
            '<html lang="en"><head><meta charset="utf-8">',
            PAGE_MARK,
            f"<title>{html.escape(title)}</title>",
            f"<style>{assets.joinpath('pages.css').read_text()}</style>",
            inline_script(plotly_js()),
            "</head>",
            f'<body data-page="{kind}"><h1>{html.escape(title)}</h1><div id="app">loading...</div>',
            f'<script id="fived-data" type="application/octet-stream">{payload}</script>',
            inline_script(assets.joinpath("pages.js").read_text()),
            "</body></html>",
        ]
    )
    out = Path(path)
    from fived.files import is_fived_dir, starts_with, write_file, write_output

    if is_fived_dir(out.parent):  # (a run's report.html: fived's own file, never a link or a user's)
        write_file(out.parent, out.name, page)
        return out
    return write_output(out, page, "--output", starts_with(PAGE_MARK.encode()))
