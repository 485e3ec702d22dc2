"""`fived explore` and `fived report` pages, driven in a real headless Chromium (Playwright with the
system's /usr/bin/chromium): the figures a toggle shows are `fived plan --layout --json`'s, an
invalid toggle shows the runtime's own reason, the report's tables are `fived train --report`'s.
Skipped only where chromium is missing and CI is unset (CI installs it: .ci/run)."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fived.cli.main import main
from fived.config import Config, TrainConfig, model_preset
from fived.layout.rules import layout_errors
from fived.parallel.mesh import Layout
from fived.planner.layer_map import end_weights, layer_weights
from fived.planner.memory import parameter_shapes

CHROMIUM = "/usr/bin/chromium"
needs_chromium = pytest.mark.skipif(
    not os.path.exists(CHROMIUM) and not os.environ.get("CI"),
    reason="no /usr/bin/chromium (CI installs it and never skips)",
)
EXPLORE = ["--gpus", "128", "--gpu", "h100", "--seq", "4096", "--global-batch-tokens", str(4096 * 256)]
# (the pages' browser tests on 64 GPUs, the same checks: their layouts priced in about 2/3 of 128 GPUs' time)
EXPLORE_64 = ["--gpus", "64", *EXPLORE[2:]]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM)
        yield b
        b.close()


def open_page(browser, path: Path):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    # offline: any request beyond the file itself is refused and reported
    page.route(
        lambda url: not url.startswith("file:") and not url.startswith("data:"),
        lambda route: (errors.append("fetched " + route.request.url), route.abort()),
    )
    page.goto(path.resolve().as_uri())
    page.wait_for_selector("body[data-ready=true]", timeout=60_000)
    return page, errors


def assert_not_blank(browser, page, path: Path) -> None:
    """The screenshot has ink: decoded by the browser, many distinct colours and enough non-white."""
    png = page.screenshot(path=str(path), full_page=True)
    probe = browser.new_page()
    stats = probe.evaluate(
        """async (src) => {
        const img = new Image(); img.src = src; await img.decode();
        const c = document.createElement("canvas"); c.width = img.width; c.height = img.height;
        const g = c.getContext("2d"); g.drawImage(img, 0, 0);
        const d = g.getImageData(0, 0, c.width, c.height).data; const colours = new Set(); let ink = 0;
        for (let i = 0; i < d.length; i += 4) { colours.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]);
          if (d[i] + d[i + 1] + d[i + 2] < 600) ink++; }
        return { colours: colours.size, ink: ink / (d.length / 4) }; }""",
        "data:image/png;base64," + base64.b64encode(png).decode(),
    )
    probe.close()
    assert stats["colours"] > 50 and stats["ink"] > 0.01, stats


def planned(capsys, model: str, flags: str, cluster: list = EXPLORE) -> dict:
    """`fived plan --json --layout FLAGS`'s figures."""
    capsys.readouterr()
    assert main(["plan", "--model", model, *cluster, "--json", "--layout", flags]) == 0
    return json.loads(capsys.readouterr().out)["plans"][0]


def test_layer_map_weights_are_the_planners_parameters():
    """The layer map's local shapes sum to the elements `memory.parameter_shapes` counts per rank."""
    for name, tp, ep in (("llama3-70b", 8, 1), ("mixtral-8x7b", 4, 8), ("tiny-moe", 2, 2), ("llama3-8b", 16, 1)):
        m = model_preset(name)
        mine = sum(_elements(w["shape"]) for lid in range(m.n_layers) for w in layer_weights(m, tp, ep, lid))
        mine += sum(_elements(w["shape"]) for w in end_weights(m, tp, True, True))
        dense, expert = parameter_shapes(m, tp, ep, list(range(m.n_layers)), True, True)
        assert mine == sum(r * c * k for (r, c), k in dense + expert), name


def _elements(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def plan_json(capsys, model: str, *flags: str, cluster: list = EXPLORE) -> dict:
    """`fived plan --json`'s output (the same defaults as `fived explore`'s: runtime, headroom)."""
    capsys.readouterr()
    assert main(["plan", "--model", model, *cluster, *flags, "--json", "--top", "8"]) in (0, 1)
    return json.loads(capsys.readouterr().out)


BASELINE = {
    "tp": "1",
    "sp": "false",
    "cp": "1",
    "pp": "1",
    "pp_schedule": "1f1b",
    "pp_virtual": "1",
    "ep": "1",
    "etp": "0",
    "zero": "0",
    "hsdp": "false",
    "micro_batch": "1",
    "checkpointing": "none",
}


def set_toggles(page, values: dict) -> None:
    """Set these toggles, pp last (the schedule's toggles are enabled only while pp > 1)."""
    page.select_option("#ctl-pp", "2")
    for name, value in sorted(values.items(), key=lambda kv: kv[0] == "pp"):
        if page.locator(f"#ctl-{name}").count():
            page.select_option(f"#ctl-{name}", value)


def page_flags(page) -> str:
    return page.inner_text("#flags").split("--train.dtype bfloat16 ", 1)[1]


AXES = """Array.from(document.querySelectorAll('.js-plotly-plot')).flatMap((gd) =>
    Object.keys(gd._fullLayout).filter((k) => /^[xy]axis\\d*$/.test(k) && gd._fullLayout[k].visible !== false)
      .map((k) => [gd.id || gd.parentElement.id, k, (gd._fullLayout[k].title || {}).text || '']))"""


def assert_every_axis_labelled(page) -> None:
    axes = page.evaluate(AXES)
    assert axes and [a for a in axes if not a[2].strip()] == [], axes


@needs_chromium
def test_explore_opens_on_the_planners_best_layout_and_toggles_show_its_figures(tmp_path, capsys, browser):
    out = tmp_path / "mixtral.html"
    # (`fived plan` first: explore's workers, forked after it, start with its memos, e.g. its ranking's search)
    ranked = plan_json(capsys, "mixtral-8x7b", cluster=EXPLORE_64)["plans"]
    assert main(["explore", "--model", "mixtral-8x7b", *EXPLORE_64, "--output", str(out)]) == 0
    page, errors = open_page(browser, out)
    # it opens on `fived plan`'s best layout, with its figures, and lists the planner's ranking
    assert page.get_attribute("body", "data-valid") == "true"
    assert page.inner_text("#status").split(" — ")[0].split(": ", 1)[1] == ranked[0]["describe"]
    assert float(page.get_attribute("#memory-total", "data-gib")) == ranked[0]["memory_gib"]["total"]
    assert page_flags(page) == ranked[0]["flags"]
    assert "--parallel.etp 1" in ranked[0]["flags"] and page.locator("#ctl-etp").count() == 1  # (it folds)
    rows = page.locator("#ranking-table tr.rank-row")
    assert rows.count() == len(ranked) and "current" in (rows.nth(0).get_attribute("class") or "")
    rows.nth(1).click()  # a click loads that layout
    assert page_flags(page) == ranked[1]["flags"] and "current" in (rows.nth(1).get_attribute("class") or "")
    assert float(page.get_attribute("#memory-total", "data-gib")) == ranked[1]["memory_gib"]["total"]
    # every toggle's figures are `fived plan --layout`'s for the flags the page shows
    set_toggles(page, BASELINE)
    shown = []
    for control, value in (("tp", "4"), ("zero", "3"), ("pp", "4"), ("cp", "2"), ("ep", "4")):
        page.select_option(f"#ctl-{control}", value)
        assert page.get_attribute("body", "data-valid") == "true", page.inner_text("#status")
        gib = float(page.get_attribute("#memory-total", "data-gib"))
        flags = page_flags(page)
        plan = planned(capsys, "mixtral-8x7b", flags, EXPLORE_64)
        assert gib == plan["memory_gib"]["total"], (control, value)  # exactly the planner's figure
        assert f"{gib:.2f} GiB" in page.inner_text("#memory-total")
        assert f"--parallel.{control} {value}" in flags
        shown.append(gib)
    assert len(set(shown)) == len(shown)  # every toggle changed the per-GPU memory
    # the collectives' table: tp's inside a node, at this tp4 x pp4 x cp2 replica (drawn as tiles: 32 GPUs)
    assert re.search(r"\ttp\t[^\n]*\tNVLink\t4\t", page.inner_text("#layer-map")), page.inner_text("#layer-map")
    assert page.locator("#layer-map-body .gpu.tile").count() == 32
    assert page.locator("#timeline-chart .main-svg").count() and "bubble fraction" in page.inner_text("#bubble")
    assert_every_axis_labelled(page)
    assert_not_blank(browser, page, tmp_path / "explore.png")

    page.select_option("#ctl-pp", "8")  # tp4 x pp8 x cp2 leaves dp 1: ep 4 no longer divides dp*cp = 2
    assert page.get_attribute("body", "data-valid") == "false"
    model = model_preset("mixtral-8x7b")
    layout = Layout(dp=1, tp=4, pp=8, cp=2, ep=4, zero=3)
    cfg = Config(
        model=model,
        parallel=layout.parallel_config(),
        train=TrainConfig(seq_len=4096, global_batch=256, microbatches=128),
    )
    reason = str(layout_errors(cfg, 64)[0])
    assert reason.startswith("parallel.ep=4: must divide dp*cp=2")
    assert page.inner_text("#status") == "invalid: " + reason
    assert "invalid" in (page.get_attribute("#ctl-pp", "class") or "")
    assert errors == []


def test_explore_offers_what_the_planner_searched_and_agrees_with_plan_on_7_gpus():
    """The toggles' values are the planner's (every cp and virtual-stage count it searched; no ep for a
    dense model), and on a GPU count no power of two reaches (7) the page has plan's layouts, valid,
    with plan's figures (it opens on the best)."""
    from fived.planner.hardware import hardware
    from fived.planner.runtimes import PLANNED_RUNTIMES
    from fived.planner.search import SCHEDULES, mesh_shapes, plan
    from fived.planner.timing import Cluster
    from fived.tools.explore import MEMORY_PARTS, TIME_PARTS, TOGGLES, explore_data, map_keys, slot, timeline_key
    from fived.tools.explore_tables import entry_of

    model, cluster = model_preset("llama3-8b"), Cluster(hardware("h100"), 7, 8)
    data = explore_data(model, cluster, 2048, 14, "bfloat16", 3.0)
    meshes = list(mesh_shapes(model, 7, 8, 2048, 14))
    assert data["options"]["pp"] == sorted({m.pp for m in meshes} | {1}) == [1, 7] and data["options"]["ep"] == [1]
    assert data["options"]["pp_virtual"] == sorted({v for _, v in SCHEDULES})
    best = plan(model, cluster, 2048, 14, "bfloat16", PLANNED_RUNTIMES["fived"], 3.0).plans  # (fived plan's defaults)
    assert best and len(data["ranking"]) == min(len(best), 8)
    for ranked, planned_ in zip(data["ranking"], best):
        entry = entry_of(data, slot(data["options"], "|".join(ranked["values"][t] for t in TOGGLES)))
        assert isinstance(entry, dict) and entry["describe"] == planned_.layout.describe()
        assert entry["memory"][-1] == planned_.memory.gib()["total"] and entry["time"][-1] == planned_.time.total
        # (stored packed: memory in bytes, keys as indices; read back, every figure is the planner's double)
        assert entry["memory"] == [planned_.memory.gib()[k] for k in MEMORY_PARTS]
        assert entry["time"] == [planned_.time.to_dict()[k] for k in TIME_PARTS]
        assert entry["map"] == map_keys(planned_.layout)
        assert entry["timeline"] == timeline_key(planned_.layout, entry["microbatches"])
    assert data["start"] == data["ranking"][0]["values"]
    wide = explore_data(model, Cluster(hardware("h100"), 64, 8), 8192, 64, "bfloat16", 3.0)["options"]
    assert wide["cp"] == sorted({m.cp for m in mesh_shapes(model, 64, 8, 8192, 64)} | {1}) and len(wide["cp"]) > 2


def flag_values(flags: str) -> dict[str, str]:
    """{"parallel.tp": "4", ...} of `fived train` flags as `run_flags` writes them."""
    words = flags.split()
    return {flag.removeprefix("--"): value for flag, value in zip(words[::2], words[1::2])}


# what a name leaves unsaid (and flags may leave out): the layout's defaults
NAME_DEFAULTS = {"parallel.tp": "1", "parallel.sp": "false", "parallel.pp": "1", "parallel.cp": "1", "parallel.ep": "1"}
NAME_DEFAULTS |= {"parallel.pp_virtual": "1", "parallel.dp_replicate": "1", "train.activation_checkpointing": "none"}


def name_values(name: str, global_batch: int) -> dict[str, str]:
    """The flags a layout's name (`Layout.describe`) states, read back from its words."""
    out = dict(NAME_DEFAULTS)
    patterns = {
        r"^dp(\d+)": ("parallel.dp",),
        r"\(=(\d+)x\d+ HSDP\)": ("parallel.dp_replicate",),
        r"ZeRO-(\d)": ("parallel.zero",),
        r" tp(\d+)(\+sp)?": ("parallel.tp", "parallel.sp"),
        r" pp(\d+) (\S+)(?: v(\d+))?": ("parallel.pp", "parallel.pp_schedule", "parallel.pp_virtual"),
        r" cp(\d+)": ("parallel.cp",),
        r" ep(\d+)": ("parallel.ep",),
        r" mbs(\d+)": ("mbs",),
        r" ac=(\w+)": ("train.activation_checkpointing",),
    }
    for pattern, keys in patterns.items():
        found = re.search(pattern, name)
        for key, value in zip(keys, found.groups() if found else ()):
            if value is not None:
                out[key] = "true" if value == "+sp" else value
    mbs = int(out.pop("mbs"))
    out["train.microbatches"] = str(global_batch // int(out["parallel.dp"]) // mbs)
    return out


def test_the_plans_winner_its_name_its_command_and_the_pages_command_agree(capsys):
    """One vocabulary: `fived plan`'s `run it` command is the explore page's command for the winner (the
    words `run_flags` and `train_command` write, compiled blocks included), every name the page ranks
    states its flags' values (zbv's pp_virtual 1 is no "v2"), and the command's flags run the winner."""
    from fived.planner.hardware import hardware
    from fived.planner.search import SCHEDULES
    from fived.planner.timing import Cluster
    from fived.tools.explore import TOGGLES, explore_data, layout_from_flags, slot
    from fived.tools.explore_tables import entry_of

    args = ["--model", "llama3-8b", "--gpus", "7", "--gpu", "h100", "--seq", "2048", "--global-batch-tokens", "28672"]
    capsys.readouterr()
    assert main(["plan", *args, "--top", "1"]) == 0
    text = capsys.readouterr().out
    name, command = re.search(r"^winner: (.*)\n  run it: (.*)$", text, re.M).groups()
    model = model_preset("llama3-8b")
    data = explore_data(model, Cluster(hardware("h100"), 7, 8), 2048, 14, "bfloat16", 3.0)
    ranked = [entry_of(data, slot(data["options"], "|".join(r["values"][t] for t in TOGGLES))) for r in data["ranking"]]
    shown = [data["command"] + " " + " ".join(data["flag_words"][i] for i in entry["flags"]) for entry in ranked]
    assert ranked[0]["describe"] == name and shown[0] == command and "--train.compile true" in command
    assert any(" pp7 " in entry["describe"] for entry in ranked)  # (a pipeline's words are checked too)
    for entry, page_command in zip(ranked, shown):
        flags = flag_values(page_command.split("--train.dtype bfloat16 ", 1)[1])
        stated = name_values(entry["describe"], 14)
        assert {k: flags.get(k, NAME_DEFAULTS.get(k)) for k in stated} == stated
    winner = layout_from_flags(model, command.split("--train.dtype bfloat16 ", 1)[1], 7, 2048, 14)
    assert winner.describe() == name
    for schedule, virtual in SCHEDULES:  # every schedule the planner names, V-shaped ones included
        layout = Layout(dp=1, pp=4, pp_schedule=schedule, pp_virtual=virtual)
        flags, stated = flag_values(layout.flags(8)), name_values(layout.describe(), 8)
        assert {k: flags.get(k, NAME_DEFAULTS.get(k)) for k in stated} == stated, layout.describe()


@needs_chromium
def test_dense_page_has_no_ep_toggle_draws_big_maps_compactly_and_memory_readably(tmp_path, browser):
    out = tmp_path / "llama.html"
    assert main(["explore", "--model", "llama3-70b", *EXPLORE_64, "--output", str(out)]) == 0
    page, errors = open_page(browser, out)
    assert page.locator("#ctl-ep").count() == 0 and page.locator("#ctl-etp").count() == 0
    assert page.locator("#ctl-cp option").count() > 2
    set_toggles(page, {**BASELINE, "tp": "8", "pp": "4", "zero": "1"})  # 32 GPUs per replica
    assert page.get_attribute("body", "data-valid") == "true", page.inner_text("#status")
    box = page.locator("#layer-map-body").bounding_box()
    assert box["height"] < 1500, box  # (it was 4,584 px: every GPU listing every tensor)
    assert page.locator("#layer-map-body .gpu").count() == 32 and page.locator(".stage-tensors").count() == 4
    # the no-parallelism bar has a panel of its own: the layout's panel is scaled to the layout and the GPU
    memory = page.evaluate("""(() => { const gd = document.getElementById('memory-chart'); const L = gd._fullLayout;
        return [L.yaxis.range[1], gd.data.filter((t) => t.yaxis === 'y2').length, gd.data.length]; })()""")
    total = float(page.get_attribute("#memory-total", "data-gib"))
    assert memory[0] <= 1.2 * max(total, 80 - 3.0) and memory[1] * 2 == memory[2]
    # a small replica draws its collectives' lines, in the margins and gutters, never across a GPU's tensors
    set_toggles(page, {**BASELINE, "tp": "2", "pp": "2", "zero": "1"})
    assert page.locator("#links path").count() >= 2
    crossings = page.evaluate("""(() => {
        const origin = document.getElementById('layer-map-body').getBoundingClientRect(); const hits = [];
        const boxes = Array.from(document.querySelectorAll('.gpu .tensor')).map((t) => t.getBoundingClientRect());
        for (const path of document.querySelectorAll('#links path')) {
          const moves = path.getAttribute('d').match(/[ML][^ML]+/g).map((m) => [m[0], ...m.slice(1).split(',').map(Number)]);
          for (let i = 1; i < moves.length; i++) { if (moves[i][0] !== 'L') continue;
            const [x0, y0] = moves[i - 1].slice(1), [x1, y1] = moves[i].slice(1);
            for (const b of boxes) { const l = b.left - origin.left, r = b.right - origin.left, t = b.top - origin.top, u = b.bottom - origin.top;
              if (Math.max(x0, x1) > l && Math.min(x0, x1) < r && Math.max(y0, y1) > t && Math.min(y0, y1) < u) hits.push([x0, y0, x1, y1]); } } }
        return hits; })()""")
    assert crossings == []
    assert_every_axis_labelled(page)
    assert errors == []


@needs_chromium
def test_report_of_a_running_run_shows_its_metrics(tmp_path, browser):
    """Before run.json exists (the run has not finished), the page has the metrics (validation loss
    beside the loss where logged, a blend's loss per source) and says why the tables are empty."""
    from fived.tools.run_report import report_data

    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(
            json.dumps(
                {
                    "step": s,
                    "loss": 5.0 - s,
                    "lr": 1e-3,
                    "grad_norm": 1.0,
                    "tokens_per_s": 100.0,
                    "mfu": 0.01,
                    **({"val_loss": 4.5} if s == 2 else {}),
                    "tokens_by_source": {"web.bin": 64, "code.bin": 0 if s == 2 else 32},
                    "loss_by_source": {"web.bin": 5.0 - s / 2, "code.bin": None if s == 2 else 6.0 - s},
                }
            )
            for s in (1, 2, 3)
        )
        + "\n"
    )
    data = report_data(str(tmp_path))
    assert data["metrics"]["loss"] == [4.0, 3.0, 2.0] and data["metrics"]["val_step"] == [2]
    by_source = [["web.bin", [1, 2, 3], [4.5, 4.0, 3.5]], ["code.bin", [1, 2, 3], [5.0, None, 3.0]]]
    assert data["state"] == [] and "run.json not written yet" in data["summary"]
    assert main(["report", str(tmp_path)]) == 0
    page, errors = open_page(browser, tmp_path / "report.html")
    traces = page.evaluate("document.getElementById('loss-chart').data.map((t) => [t.name, t.x, t.y])")
    assert traces == [["loss", [1, 2, 3], [4.0, 3.0, 2.0]], ["val_loss", [2], [4.5]]]
    # a blend's loss per source: one line each, a gap where a step drew none of the source's samples
    assert page.evaluate("document.getElementById('loss-by-source-chart').data.map((t) => [t.name, t.x, t.y])") == (
        by_source
    )
    assert "run.json not written yet" in page.inner_text("#app") and errors == []


def report_lines(stdout: str) -> list[tuple[int, list[int]]]:
    """(rank, [params, grads, optimizer measured and formula]) from `fived train --report`'s table."""
    rows = []
    for m in re.finditer(
        r"rank (\d+): params ([\d,]+) \| ([\d,]+); grads ([\d,]+) \| ([\d,]+); "
        r"optimizer ([\d,]+) \| ([\d,]+)",
        stdout,
    ):
        rows.append((int(m.group(1)), [int(g.replace(",", "")) for g in m.groups()[1:]]))
    return rows


@needs_chromium
def test_report_of_a_pipeline_moe_run_shows_every_chart_and_the_report_tables(tmp_path, browser):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    train = subprocess.run(
        [
            sys.executable,
            "-m",
            "fived",
            "train",
            "--model",
            "tiny-moe",
            "--pp",
            "2",
            "--ep",
            "2",
            "--dp",
            "2",
            "--nproc",
            "4",
            "--steps",
            "3",
            "--microbatches",
            "2",
            "--global-batch",
            "4",
            "--train.warmup_steps",
            "1",
            "--train.output_dir",
            str(run_dir),
            "--report",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert train.returncode == 0, train.stderr
    expected = report_lines(train.stdout)
    assert len(expected) == 4
    assert main(["report", str(run_dir)]) == 0
    page, errors = open_page(browser, run_dir / "report.html")
    for chart in ("loss", "lr", "grad-norm", "tokens-per-s", "mfu", "timeline", "experts"):
        assert page.locator(f"#{chart}-chart .main-svg").count() >= 1, chart
    rows = page.locator("#state-bytes tr").all_inner_texts()[1:]
    table = [[int(c) for c in row.split("\t")] for row in rows]
    # the page's columns: rank, params measured, planner, grads measured, planner, optimizer measured, planner
    assert [(r[0], r[1:]) for r in table] == expected
    comm = page.inner_text("#comm-bytes")
    assert "pp/send" in comm and "all_to_all_single" in comm
    assert "pipeline bubble of 1f1b" in page.inner_text("#pipeline")
    # the measured step breakdown beside the planner's, and fived diagnose's findings
    assert page.locator("#breakdown-chart .main-svg").count() >= 1
    assert "compute" in page.inner_text("#breakdown-table") and "bubble" in page.inner_text("#breakdown-table")
    assert page.inner_text("#diagnosis").strip().splitlines()[-1].startswith("failure modes: ")
    loads = json.loads((run_dir / "run.json").read_text())["expert_load"]
    assert sorted(loads) == ["0", "1", "2", "3"] and all(len(v) == 8 for v in loads.values())
    heatmap = page.evaluate(
        "(() => { const t = document.getElementById('experts-chart').data[0]; return [t.type, t.z]; })()"
    )
    assert heatmap == ["heatmap", [loads[k] for k in ("0", "1", "2", "3")]]  # every MoE layer of both stages
    assert_every_axis_labelled(page)
    labels = page.evaluate("""Array.from(document.querySelectorAll('#timeline-chart .bartext')).filter((t) =>
        t.getBoundingClientRect().width > 0).map((t) => { const b = t.getBoundingClientRect(); return [b.left, b.top, b.right, b.bottom]; })""")
    overlaps = [
        (a, b)
        for i, a in enumerate(labels)
        for b in labels[i + 1 :]
        if a[0] < b[2] - 0.5 and b[0] < a[2] - 0.5 and a[1] < b[3] - 0.5 and b[1] < a[3] - 0.5
    ]
    assert labels and overlaps == []  # the pipeline timeline's labels: only where they fit, never over each other
    assert_not_blank(browser, page, tmp_path / "report.png")
    assert errors == []


@needs_chromium
def test_report_of_a_resumed_run_marks_the_resume_and_both_layouts_on_every_chart(tmp_path, browser, capsys):
    run = tmp_path / "run"
    tiny = ["--seq-len", "16", "--global-batch", "4", "--train.warmup_steps", "1", "--train.log_every", "100"]
    assert (
        main(
            [
                "train",
                *tiny,
                "--nproc",
                "2",
                "--dp",
                "2",
                "--steps",
                "4",
                "--checkpoint.every",
                "2",
                "--train.output_dir",
                str(run),
            ]
        )
        == 0
    )
    assert (
        main(["train", "--resume", str(run / "checkpoints" / "step-2"), "--nproc", "2", "--tp", "2", "--steps", "6"])
        == 0
    )  # from step 2, at another layout: steps 3-4 trained again, then 5-6
    assert main(["report", str(run)]) == 0
    before, after = "dp2 ZeRO-0 mbs2", "dp1 ZeRO-0 tp2 mbs4"
    page, errors = open_page(browser, run / "report.html")
    summary = page.inner_text("#summary")
    assert f"steps 1-2: {before}; steps 3-6 (resumed): {after}" in summary, summary
    for chart in ("loss", "lr", "grad-norm", "tokens-per-s", "mfu"):
        marks = page.evaluate(f"""(() => {{ const L = document.getElementById('{chart}-chart').layout;
            return [L.shapes.map((s) => [s.x0, s.x1]), L.annotations.map((a) => a.text)]; }})()""")
        assert marks == [[[2.5, 2.5]], [before, f"resume at step 3: {after} (layout changed)"]], (chart, marks)
        steps = page.evaluate(f"document.getElementById('{chart}-chart').data[0].x")
        assert steps == [1, 2, 3, 4, 5, 6]  # (the first launch's steps 3-4: superseded, not drawn twice)
    assert_every_axis_labelled(page)
    assert errors == []


def test_plan_layout_refuses_a_layout_with_the_runtimes_line(capsys):
    """`fived plan --layout` (what the page's flags are checked against) says why, in one line."""
    assert main(["plan", "--model", "llama3-70b", *EXPLORE, "--layout", "--parallel.ep 2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "fived: error: parallel.ep=2: needs a mixture-of-experts model (model.name=llama3-70b is dense); "
        "use --ep 1, or a MoE model such as --model tiny-moe"
    ]


SERVE = ["--gpus", "8", "--gpu", "h100", "--prompt-len", "2048", "--output-len", "256"]


def served(capsys, model: str, layout: str, concurrency: str) -> dict:
    """`fived plan --serve --json --layout FLAGS --concurrency C`'s figures."""
    capsys.readouterr()
    assert (
        main(["plan", "--serve", "--model", model, *SERVE, "--concurrency", concurrency, "--layout", layout, "--json"])
        == 0
    )
    return json.loads(capsys.readouterr().out)["plans"][0]


@needs_chromium
def test_serve_page_shows_the_serving_planners_memory_next_to_the_training_plan(tmp_path, capsys, browser):
    """llama3-70b on 8 H100, 2k-token prompts and 256-token outputs: each toggle shows exactly `fived
    plan --serve --layout`'s per-GPU memory (weights / KV cache / activations), a dense model refuses ep
    with fived's reason, and the training plan stands beside the serving one."""
    out = tmp_path / "serve.html"
    assert main(["explore", "--serve", "--model", "llama3-70b", *SERVE, "--output", str(out)]) == 0
    page, errors = open_page(browser, out)
    shown = []
    for control, value in (
        ("pp", "1"),
        ("tp", "8"),
        ("weights", "bf16"),
        ("concurrency", "128"),
        ("tp", "4"),
        ("pp", "2"),
    ):
        page.select_option(f"#ctl-{control}", value)
        assert page.get_attribute("body", "data-valid") == "true", page.inner_text("#status")
        v = {
            name: page.eval_on_selector(f"#ctl-{name}", "e => e.value")
            for name in ("tp", "pp", "weights", "concurrency")
        }
        plan = served(capsys, "llama3-70b", f"--tp {v['tp']} --pp {v['pp']} --weights {v['weights']}", v["concurrency"])
        gib = float(page.get_attribute("#memory-total", "data-gib"))
        assert gib == plan["memory_gib"]["total"], (control, value)  # exactly the planner's figure
        assert f"--tensor-parallel-size {v['tp']}" in page.inner_text("#vllm")
        shown.append(gib)
    assert len(set(shown)) == len(shown)  # every toggle changed the per-GPU memory
    traces = page.evaluate("document.getElementById('memory-chart').data.map((t) => t.name)")
    assert traces == ["weights", "kv cache", "activations", "reserve"]
    training = page.inner_text("#training")
    assert "no training layout fits this cluster" in training and "fived plan picks on" in training
    assert "a decode forward of" in training and "bound by HBM bandwidth" in training
    assert_not_blank(browser, page, tmp_path / "serve.png")
    page.select_option("#ctl-ep", "2")
    assert page.get_attribute("body", "data-valid") == "false"
    assert "needs a mixture-of-experts model" in page.inner_text("#status")
    assert errors == []


def test_plan_layout_takes_fived_trains_short_flags(capsys):
    """`fived plan --layout '--tp 8 --sp ...'` prices what the long flags (Layout.flags') price."""
    short = planned(capsys, "llama3-70b", "--tp 8 --sp --pp 2 --zero 1 --microbatches 64")
    long = planned(
        capsys,
        "llama3-70b",
        "--parallel.tp 8 --parallel.sp true --parallel.pp 2 --parallel.zero 1 --train.microbatches 64",
    )
    assert short == long and short["layout"]["tp"] == 8 and short["layout"]["sp"] is True
    assert main(["plan", "--model", "llama3-70b", *EXPLORE, "--layout", "--tp 8 --bogus 3"]) == 2
    assert "--bogus is not one of fived train's flags" in capsys.readouterr().err


def test_the_same_data_writes_the_same_page(tmp_path, monkeypatch):
    """A page is a function of its data: written again later, the file is the same, byte for byte."""
    import time

    from fived.tools.pages import write_page

    data = {"model": "tiny", "entries": [1, 2, 3]}
    first = write_page(tmp_path / "a.html", "t", "explore", data).read_bytes()
    later = time.time() + 3600
    monkeypatch.setattr(time, "time", lambda: later)
    assert write_page(tmp_path / "b.html", "t", "explore", data).read_bytes() == first
