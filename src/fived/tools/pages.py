"""Self-contained HTML pages (`fived explore`, `fived report`): the charting library (plotly.js, from
the plotly Python package's bundled copy), the page's own small script and style (fived/assets) and
the data (gzip-compressed JSON, base64) inline in one file that works offline from disk. The script
only looks figures up in the data and draws them: every number is computed in Python.

plotly is an optional extra: `pip install 'fived[pages]'`.
"""

from __future__ import annotations

import base64
import html
import json
import queue
import threading
import zlib
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
PIECE_ITEMS = 8192  # a long list's items encoded at a time (a piece is compressed while the next is encoded)


def packed_json(data: dict) -> bytes:
    """`data` as gzip-compressed JSON: `gzip.compress(json.dumps(data, separators=(",", ":")).encode(),
    GZIP_LEVEL, mtime=0)`'s bytes, encoded a top-level value (a long list: PIECE_ITEMS items) at a time,
    each piece compressed in a thread while the next is encoded (zlib lets go of the interpreter while
    it works: the compression of an explore page's 79 MB of JSON, 0.7 s, runs beside its encoding,
    1.9 s, on another core). mtime 0: the same data gives the same bytes. check_circular off: the
    data is a tree fived built, and tracking an explore page's ~10^6 containers costs ~7% of the dump."""
    compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)  # (31: gzip's header, mtime 0, and trailer)
    packed: list[bytes] = []
    failed: list[BaseException] = []
    pieces: queue.Queue = queue.Queue(maxsize=4)

    def compress() -> None:
        while (piece := pieces.get()) is not None:
            if not failed:  # (after a failure, drained: the encoder never waits on a full queue)
                try:
                    packed.append(compressor.compress(piece))
                except BaseException as e:
                    failed.append(e)

    worker = threading.Thread(target=compress, name="fived-page-gzip", daemon=True)
    worker.start()
    try:
        for piece in _json_pieces(data):
            pieces.put(piece.encode())
    finally:
        pieces.put(None)
        worker.join()
    if failed:
        raise failed[0]
    return b"".join(packed) + compressor.flush()


def _json_pieces(data: dict):
    """`json.dumps(data, separators=(",", ":"))` in pieces (a top-level value each, a long list's
    items PIECE_ITEMS at a time), each by the C encoder."""
    dump = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode
    yield "{"
    for i, (name, value) in enumerate(data.items()):
        if not isinstance(name, str):  # (json.dumps writes other keys as strings: not asked of the pages)
            raise TypeError(f"a page's data keys are strings, not {name!r}")
        yield ("," if i else "") + dump(name) + ":"
        if isinstance(value, list) and len(value) > PIECE_ITEMS:
            yield "["
            for start in range(0, len(value), PIECE_ITEMS):
                yield ("," if start else "") + dump(value[start : start + PIECE_ITEMS])[1:-1]
            yield "]"
        else:
            yield dump(value)
    yield "}"


def write_page(path: str | Path, title: str, kind: str, data: dict) -> Path:
    """Write the page `kind` ("explore" or "report") showing `data` to `path`."""
    assets = files("fived.assets")
    payload = base64.b64encode(packed_json(data)).decode()
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
