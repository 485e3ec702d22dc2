// fived's pages (explore, serve, report): look figures up in the embedded data (computed by the planner
// in Python) and draw them with plotly. No formula lives here.
"use strict";
const $ = (id) => document.getElementById(id);
const el = (tag, cls, text) => { const e = document.createElement(tag); if (cls) e.className = cls; if (text !== undefined) e.textContent = text; return e; };
const GIB = (x) => x.toFixed(2) + " GiB";
const BYTES = (b) => b >= 2 ** 30 ? (b / 2 ** 30).toFixed(2) + " GiB" : b >= 2 ** 20 ? (b / 2 ** 20).toFixed(2) + " MiB" : b >= 1024 ? (b / 1024).toFixed(1) + " KiB" : b + " B";
const KIND_COLOURS = { F: "#4c78a8", B: "#f58518", I: "#e45756", W: "#72b7b2" };
const PLOT = { displayModeBar: false, responsive: true };

async function loadData() {
  const b64 = $("fived-data").textContent.trim();
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return JSON.parse(await new Response(stream).text());
}

function section(id, title) {
  const s = el("section"); s.id = id; s.appendChild(el("h2", null, title)); $("app").appendChild(s); return s;
}

function timelineChart(target, actions, title, xtitle) {
  // actions: [rank, kind, stage, microbatch, start, duration]; a label only where it fits its bar
  const kinds = [...new Set(actions.map((a) => a[1]))];
  const traces = kinds.map((k) => {
    const mine = actions.filter((a) => a[1] === k);
    return { type: "bar", orientation: "h", name: k, marker: { color: KIND_COLOURS[k] || "#999" },
      y: mine.map((a) => "rank " + a[0]), base: mine.map((a) => a[4]), x: mine.map((a) => a[5]),
      text: mine.map((a) => k + a[3] + " s" + a[2]), textposition: "inside", insidetextanchor: "middle",
      hovertext: mine.map((a) => `${k} micro-batch ${a[3]}, stage ${a[2]}`), hoverinfo: "text" };
  });
  Plotly.react(target, traces, { barmode: "overlay", title, height: 140 + 30 * new Set(actions.map((a) => a[0])).size,
    uniformtext: { mode: "hide", minsize: 9 }, yaxis: { autorange: "reversed", title: { text: "pipeline rank" } },
    xaxis: { title: { text: xtitle } }, margin: { t: 40, l: 110 } }, PLOT);
}

// ------------------------------------------------------------------------------------- explore
const lower = (v) => String(v).toLowerCase();

function slotOf(D, values) {
  // the entries' position of these toggle values (mixed radix over D.options, in its order)
  let slot = 0;
  for (const [name, options] of Object.entries(D.options)) slot = slot * options.length + options.map(lower).indexOf(lower(values[name]));
  return slot;
}

function entryAt(D, slot) {
  // the entry at this slot as the drawing reads it: a valid one is stored as an array in
  // D.entry_fields' order (fived.tools.explore_tables.ENTRY_FIELDS: names once, not per entry), its memory in
  // bytes (/ 2^30: the GiB the planner printed, the same double) and its layer-map and timeline keys as
  // indices into D.map_keys and D.timeline_keys; a reason's index or null is returned as it is
  const stored = D.entries[slot];
  if (!Array.isArray(stored)) return stored;
  const entry = {};
  D.entry_fields.forEach((name, i) => (entry[name] = stored[i]));
  entry.memory = entry.memory_bytes.map((b) => b / 2 ** 30);
  entry.map = entry.map.map((k, part) => D.map_keys[part][k]);
  entry.timeline = D.timeline_keys[entry.timeline];
  return entry;
}

function buildControls(D) {
  const box = el("div"); box.id = "controls";
  for (const [name, values] of Object.entries(D.options)) {
    if (values.length < 2) continue;  // (nothing to choose: e.g. no ep toggle for a dense model)
    const label = el("label", null, name + " ");
    const select = el("select"); select.id = "ctl-" + name;
    for (const v of values) { const o = el("option", null, String(v)); o.value = lower(v); select.appendChild(o); }
    select.value = lower(D.start[name]);
    select.addEventListener("change", () => renderExplore(D, name));
    label.appendChild(select); box.appendChild(label);
  }
  $("app").appendChild(box);
  const status = el("div"); status.id = "status"; $("app").appendChild(status);
}

function currentValues(D) {
  const values = {};
  for (const [name, options] of Object.entries(D.options)) values[name] = $("ctl-" + name) ? $("ctl-" + name).value : lower(options[0]);
  const pipelined = values.pp !== "1";
  for (const name of ["pp_schedule", "pp_virtual"]) if ($("ctl-" + name)) $("ctl-" + name).disabled = !pipelined;
  if (!pipelined) { values.pp_schedule = "1f1b"; values.pp_virtual = "1"; }  // one stage: no schedule
  return values;
}

function rankingSection(D) {
  const box = section("ranking", "The planner's best layouts (as fived plan ranks them; click one to load it)");
  if (!D.ranking.length) { box.appendChild(el("p", "invalid", `nothing fits in ${D.capacity_gib} GiB per GPU: the page opens on the layout that needs the least memory`)); return; }
  const t = el("table", "figures"); t.id = "ranking-table";
  t.appendChild(rowOf("th", ["#", "layout", "step s", "tokens/s/GPU", "MFU", "GiB per GPU"]));
  D.ranking.forEach((r, i) => {
    const tr = rowOf("td", [String(i + 1), r.describe, r.step_s.toPrecision(4), r.tokens_per_s_per_gpu.toFixed(1), (100 * r.mfu).toFixed(1) + "%", r.gib.toFixed(2)]);
    tr.className = "rank-row"; tr.dataset.rank = String(i);
    tr.addEventListener("click", () => {
      for (const [name, v] of Object.entries(r.values)) if ($("ctl-" + name)) $("ctl-" + name).value = v;
      renderExplore(D, null);
    });
    t.appendChild(tr);
  });
  box.appendChild(t);
}

function markRanking(D, values) {
  document.querySelectorAll("#ranking-table tr.rank-row").forEach((tr) => {
    const shown = D.ranking[Number(tr.dataset.rank)].values;
    const same = Object.keys(shown).every((k) => shown[k] === values[k] || (values.pp === "1" && ["pp_schedule", "pp_virtual"].includes(k)));
    tr.classList.toggle("current", same);
  });
}

function renderExplore(D, changed) {
  const values = currentValues(D);
  const entry = entryAt(D, slotOf(D, values));
  const status = $("status");
  markRanking(D, values);
  document.querySelectorAll("#controls select").forEach((s) => s.classList.remove("invalid"));
  if (entry === null || entry === undefined || typeof entry === "number") {
    status.className = "invalid";
    status.textContent = typeof entry === "number" ? "invalid: " + D.errors[entry]
      : "this combination is not reachable: gpus=" + D.gpus + " is not a multiple of tp*pp*cp";
    if (changed) $("ctl-" + changed).classList.add("invalid");
    document.body.dataset.valid = "false"; return;
  }
  document.body.dataset.valid = "true";
  status.className = entry.fits ? "valid" : "overflow";
  status.textContent = `dp=${D.gpus / (values.tp * values.pp * values.cp)}: ${entry.describe} — ` +
    (entry.fits ? "fits" : `does not fit: ${GIB(entry.memory[6])} > ${D.capacity_gib} GiB`);
  drawLayerMap(D, entry);
  drawMemory(D, entry);
  drawPipeline(D, entry);
  drawStep(D, entry);
}

const COMPACT_GPUS = 8;  // a replica of more GPUs: each stage's tensors listed once, its GPUs as tiles

function drawLayerMap(D, entry) {
  const box = $("layer-map-body"); box.replaceChildren();
  const weights = D.maps.weights[entry.map[0]], acts = D.maps.activations[entry.map[1]], ranks = D.maps.ranks[entry.map[2]];
  const [tp, , , cp, dp] = entry.map[0].split("|").map(Number);  // the weights' key: tp|ep|zero|cp|dp|dp_replicate
  const compact = tp * cp * ranks.length > COMPACT_GPUS;
  box.classList.toggle("compact", compact);
  const tensors = weights.concat(acts);
  const collectives = entry.collectives.map((i) => D.collectives[i]);  // (rows stored once, by index)
  const joined = {};  // global rank -> collectives it takes part in
  collectives.forEach((c, i) => D.members[c[6]].forEach((r) => (joined[r] = joined[r] || []).push(i)));
  ranks.forEach((rank, p) => {
    const row = el("div", "stage");
    const held = rank.layers ? "layers " + rank.stages.map((s) => s[0] + "-" + s[1]).join(", ") + ` (${rank.layers})` : "no layers";
    row.appendChild(el("div", "stage-label", `pp rank ${p}: ${held}` + (rank.first ? ", embedding" : "") + (rank.last ? ", head" : "") +
      (compact ? ` — each of its ${tp * cp} GPUs holds:` : "")));
    if (compact) row.appendChild(tensorList(tensors, rank, "stage-tensors"));
    const gpus = el("div", "gpus");
    for (let c = 0; c < cp; c++) for (let t = 0; t < tp; t++) {
      const g = (p * dp * cp + c) * tp + t;
      const gpu = el("div", compact ? "gpu tile" : "gpu"); gpu.id = "gpu-" + g;
      gpu.appendChild(el("div", "gpu-label", compact ? `GPU ${g}` : `GPU ${g} (tp ${t}, cp ${c})`));
      gpu.title = `GPU ${g}: tp rank ${t}, cp rank ${c}, pp rank ${p}`;
      if (!compact) gpu.appendChild(tensorList(tensors, rank, null));
      for (const i of joined[g] || []) gpu.appendChild(el("span", "badge c" + (i % 8), compact ? "" : collectives[i][0] + " " + collectives[i][1]));
      gpus.appendChild(gpu);
    }
    row.appendChild(gpus); box.appendChild(row);
  });
  const list = el("table", "collectives");
  list.appendChild(rowOf("th", ["collective", "mesh dimension", "bytes / step", "calls / step", "link", "group size", "joins GPUs (this replica)"]));
  collectives.forEach((c, i) => {
    const members = D.members[c[6]];
    const tr = rowOf("td", [c[1], c[0], BYTES(c[2]), String(c[3]), c[4], String(c[5]), members.join(", ") + (c[7] ? ` + ${c[7]} in other replicas` : "")]);
    tr.className = "c" + (i % 8);
    tr.addEventListener("mouseenter", () => members.forEach((r) => $("gpu-" + r) && $("gpu-" + r).classList.add("lit")));
    tr.addEventListener("mouseleave", () => document.querySelectorAll(".gpu.lit").forEach((g) => g.classList.remove("lit")));
    list.appendChild(tr);
  });
  if (!collectives.length) list.appendChild(rowOf("td", ["(none: one GPU)"]));
  box.appendChild(list);
  if (!compact) drawLinks(box, collectives.map((c) => [D.members[c[6]], c[7]]));
}

function tensorList(tensors, rank, cls) {
  const box = el("div", cls);
  for (const x of tensors) {
    const present = x.part === "layer" || (x.part === "embedding" && rank.first) || (x.part === "head" && rank.last);
    const state = !present ? "absent" : x.split ? "sharded" : "replicated";
    const shape = x.stored ? `[${x.shape}] stores [${x.stored}]` : `[${x.shape}]`;
    const chip = el("div", `tensor ${x.kind} ${state}`, `${x.name} ${present ? shape : "—"}`);
    chip.title = `${x.kind} ${x.name}: full [${x.full}], ${state}${x.split ? " by " + x.split : ""}` +
      (x.state_note ? "; " + x.state_note : "") + (x.note ? "; " + x.note : "");
    box.appendChild(chip);
  }
  return box;
}

const LINK_COLOURS = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];

function drawLinks(box, groups) {
  // each collective: a lane in the left margin (vertical), and a branch to each GPU it joins along that
  // GPU's top gutter (horizontal): lines never cross a GPU's tensors; a stub where it leaves the replica
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg"); svg.id = "links";
  const origin = box.getBoundingClientRect();
  svg.setAttribute("width", origin.width); svg.setAttribute("height", origin.height);
  groups.forEach(([members, others], i) => {
    const lane = 4 + 5 * i;
    const points = members.map((r) => $("gpu-" + r)).filter(Boolean).map((g) => {
      const b = g.getBoundingClientRect();
      return [b.left - origin.left + 14 + 9 * i, b.top - origin.top + 4 + 4 * i];
    });
    if (points.length < 2 && !(points.length && others)) return;
    const ys = points.map((p) => p[1]);
    let d = `M${lane},${Math.min(...ys)} L${lane},${Math.max(...ys)}`;
    for (const [x, y] of points) d += ` M${lane},${y} L${x},${y}`;
    if (others) d += ` M${lane},${Math.min(...ys)} L${lane},${Math.min(...ys) - 6}`;
    const path = document.createElementNS("http://www.w3.org/2000/svg", "path");
    path.setAttribute("d", d); path.setAttribute("stroke", LINK_COLOURS[i % 8]); path.setAttribute("class", "link");
    svg.appendChild(path);
  });
  box.appendChild(svg);
}

function rowOf(cell, texts) {
  const tr = el("tr"); texts.forEach((t) => tr.appendChild(el(cell, null, t))); return tr;
}

function drawMemory(D, entry) {
  // this layout beside the capacity; no parallelism in a panel of its own (its own scale: often 20x the GPU)
  const total = entry.memory[6];
  const t = $("memory-total"); t.textContent = "per-GPU memory: " + GIB(total); t.dataset.gib = String(total);
  const parts = D.memory_parts.slice(0, 6);
  const traces = parts.flatMap((p, i) => [
    { type: "bar", name: p, legendgroup: p, x: ["this layout"], y: [entry.memory[i]], marker: { color: PART_COLOURS[i] } },
    { type: "bar", name: p, legendgroup: p, showlegend: false, x: ["no parallelism"], y: [D.baseline[i]], xaxis: "x2", yaxis: "y2", marker: { color: PART_COLOURS[i] } }]);
  const capacity = (axis) => ({ type: "line", xref: axis === "y" ? "x domain" : "x2 domain", x0: 0, x1: 1, yref: axis, y0: D.capacity_gib, y1: D.capacity_gib, line: { color: "red", dash: "dash" } });
  Plotly.react("memory-chart", traces, { barmode: "stack", height: 420, margin: { t: 30 },
    xaxis: { domain: [0, 0.55], title: { text: "layout" } }, yaxis: { title: { text: "GiB per GPU" }, rangemode: "tozero", range: [0, 1.15 * Math.max(total, D.capacity_gib)] },
    xaxis2: { domain: [0.72, 1], anchor: "y2", title: { text: `${(D.baseline[6] / D.capacity_gib).toFixed(1)}x the capacity` } },
    yaxis2: { anchor: "x2", title: { text: "GiB on one GPU" }, rangemode: "tozero" },
    shapes: [capacity("y"), capacity("y2")],
    annotations: [{ xref: "x domain", x: 1, y: D.capacity_gib, yref: "y", text: `capacity ${D.capacity_gib} GiB`, showarrow: false, yanchor: "bottom", xanchor: "right" }] }, PLOT);
}

const PART_COLOURS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2"];

function drawPipeline(D, entry) {
  const text = $("bubble");
  if (!entry.timeline) {
    text.textContent = entry.bubble ? `bubble fraction ${(entry.bubble * 100).toFixed(2)}% with ${entry.microbatches} micro-batches (a pipeline this deep is not drawn)`
      : "pp=1: no pipeline (micro-batches accumulate on every GPU)";
    text.dataset.bubble = String(entry.bubble); Plotly.purge("timeline-chart"); return;
  }
  const tl = D.timelines[entry.timeline];
  text.textContent = `bubble fraction ${(entry.bubble * 100).toFixed(2)}% with ${entry.microbatches} micro-batches ` +
    `(timeline drawn for ${tl.microbatches}; ${tl.stages} stages, ${tl.stages_per_rank} per rank; unit costs F=1, B=2)`;
  text.dataset.bubble = String(entry.bubble);
  timelineChart("timeline-chart", tl.actions, "", "time (units: a forward F = 1, a backward B = 2)");
}

function drawStep(D, entry) {
  const parts = D.time_parts.slice(0, -1);
  const total = entry.time[entry.time.length - 1];
  $("throughput").textContent = `step ${total.toPrecision(4)} s · ${entry.tokens_per_s_per_gpu.toFixed(1)} tokens/s/GPU · MFU ${(entry.mfu * 100).toFixed(1)}%`;
  Plotly.react("time-chart", [{ type: "bar", orientation: "h", y: parts, x: entry.time.slice(0, -1), text: entry.time.slice(0, -1).map((s) => s.toPrecision(3) + " s") }],
    { height: 360, xaxis: { title: { text: "seconds per step (exposed)" } }, yaxis: { autorange: "reversed", title: { text: "component" } }, margin: { t: 20, l: 110 } }, PLOT);
  $("flags").textContent = `${D.command} ` + entry.flags.map((i) => D.flag_words[i]).join(" ");
}

function explorePage(D) {
  $("app").replaceChildren();
  const info = el("p", null, `${D.model} on ${D.gpus} x ${D.gpu} (${D.gpus_per_node} per node, ${D.device_gib} GiB), seq ${D.seq_len}, global batch ${D.global_batch} sequences; every figure from fived's planner`);
  $("app").appendChild(info);
  buildControls(D);
  rankingSection(D);
  const map = section("layer-map", "Layer map: one model replica, per GPU");
  map.appendChild(el("p", "legend", "tensors: sharded / replicated / not present; hover a collective to light the GPUs it joins"));
  const body = el("div"); body.id = "layer-map-body"; map.appendChild(body);
  const mem = section("memory", "Memory per GPU vs no parallelism");
  [["memory-total", "div"], ["memory-chart", "div"]].forEach(([id, tag]) => { const e = el(tag); e.id = id; mem.appendChild(e); });
  const pipe = section("pipeline", "Pipeline timeline");
  [["bubble", "div"], ["timeline-chart", "div"]].forEach(([id, tag]) => { const e = el(tag); e.id = id; pipe.appendChild(e); });
  const step = section("step", "Step time, throughput and the command");
  [["throughput", "div"], ["time-chart", "div"], ["flags", "pre"]].forEach(([id, tag]) => { const e = el(tag); e.id = id; step.appendChild(e); });
  renderExplore(D, null);
}

// -------------------------------------------------------------------------------------- serve
function serveKey(values) {
  return ["tp", "pp", "ep", "weights", "concurrency"].map((k) => String(values[k])).join("|");
}

function servePage(D) {
  $("app").replaceChildren();
  $("app").appendChild(el("p", null, `${D.model} on ${D.gpus} x ${D.gpu} (${D.gpus_per_node} per node, ${D.device_gib} GiB), ` +
    `prompts of ${D.prompt_len} tokens, ${D.output_len} output tokens, KV cache in ${D.kv_dtype}; every figure from fived's serving planner`));
  const box = el("div"); box.id = "controls";
  for (const [name, values] of Object.entries(D.options)) {
    const label = el("label", null, (name === "concurrency" ? "requests in flight" : name) + " ");
    const select = el("select"); select.id = "ctl-" + name;
    for (const v of values) { const o = el("option", null, String(v)); o.value = String(v); select.appendChild(o); }
    select.value = String(D.chosen[name] !== undefined ? D.chosen[name] : values[0]);
    select.addEventListener("change", () => renderServe(D, name));
    label.appendChild(select); box.appendChild(label);
  }
  $("app").appendChild(box);
  const status = el("div"); status.id = "status"; $("app").appendChild(status);
  const mem = section("memory", "Memory per GPU: weights, KV cache, activations");
  [["memory-total", "div"], ["memory-chart", "div"]].forEach(([id, tag]) => { const e = el(tag); e.id = id; mem.appendChild(e); });
  const lat = section("latency", "Prefill, decode and latencies at these requests in flight");
  [["latency-table", "div"], ["vllm", "pre"]].forEach(([id, tag]) => { const e = el(tag); e.id = id; lat.appendChild(e); });
  const train = section("training", `Next to training: fived plan --serve picks ${D.chosen.describe}`);
  const lines = el("ul"); lines.id = "why";
  D.training.concat(D.why).forEach((t) => lines.appendChild(el("li", null, t)));
  train.appendChild(lines);
  renderServe(D, null);
}

function renderServe(D, changed) {
  const values = {};
  for (const name of Object.keys(D.options)) values[name] = $("ctl-" + name).value;
  const entry = D.entries[serveKey(values)];
  const status = $("status");
  document.querySelectorAll("#controls select").forEach((s) => s.classList.remove("invalid"));
  if (entry === undefined || typeof entry === "number") {
    status.className = "invalid";
    status.textContent = entry === undefined ? `not reachable: gpus=${D.gpus} is not a multiple of tp*pp` : "invalid: " + D.errors[entry];
    if (changed) $("ctl-" + changed).classList.add("invalid");
    document.body.dataset.valid = "false"; return;
  }
  document.body.dataset.valid = "true";
  status.className = entry.fits ? (entry.meets ? "valid" : "overflow") : "overflow";
  status.textContent = `dp=${entry.dp}: ${entry.describe} — ` + (entry.fits ? `${entry.fit} sequences fit per replica` +
    (entry.meets ? "" : "; " + entry.reasons.join("; ")) : "the weights leave no room for one sequence's KV cache");
  const total = entry.memory[4];
  const t = $("memory-total"); t.textContent = "per-GPU memory: " + GIB(total); t.dataset.gib = String(total);
  const parts = D.memory_parts.slice(0, 4);
  Plotly.react("memory-chart", parts.map((p, i) => ({ type: "bar", name: p.replace("_", " "), x: ["this layout"], y: [entry.memory[i]] })),
    { barmode: "stack", height: 380, xaxis: { title: { text: "layout" } }, yaxis: { title: { text: "GiB per GPU" } },
      shapes: [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: D.capacity_gib, y1: D.capacity_gib, line: { color: "red", dash: "dash" } }],
      annotations: [{ xref: "paper", x: 1, y: D.capacity_gib, text: `capacity ${D.capacity_gib} GiB`, showarrow: false, yanchor: "bottom", xanchor: "right" }],
      margin: { t: 20 } }, PLOT);
  const names = ["prefill of one prompt", "decode step", "TTFT mean", "TTFT p99", "TPOT mean", "TPOT p99"];
  const table = el("table", "figures"); table.id = "latency-figures";
  table.appendChild(rowOf("th", ["figure", "ms"]));
  names.forEach((n, i) => table.appendChild(rowOf("td", [n, entry.times_ms[i] === null ? "saturated" : entry.times_ms[i].toFixed(2)])));
  table.appendChild(rowOf("td", ["output tokens/s (all GPUs)", entry.throughput.toFixed(0)]));
  table.appendChild(rowOf("td", ["decode batch per replica", entry.batch.toFixed(1)]));
  $("latency-table").replaceChildren(table);
  $("vllm").textContent = entry.vllm || "(does not fit)";
}

// -------------------------------------------------------------------------------------- report
function segmentMarks(segments) {
  // where each launch's steps begin (a resume, a restart), on every chart, with the layout of each stretch
  const shapes = [], annotations = [];
  segments.forEach((s, i) => {
    const x = s.first_step - 0.5;
    if (i > 0) shapes.push({ type: "line", xref: "x", x0: x, x1: x, yref: "paper", y0: 0, y1: 1, line: { dash: "dot", width: 2, color: s.changed ? "#d62728" : "#555" } });
    const what = i === 0 ? s.layout : `${s.event} at step ${s.first_step}: ${s.layout}` + (s.changed ? " (layout changed)" : "");
    annotations.push({ xref: "x", x, xanchor: "left", yref: "paper", y: 1 + 0.09 * (i % 2), yanchor: "bottom", showarrow: false, text: what, font: { size: 10 } });
  });
  return { shapes, annotations };
}

function lineChart(target, steps, series, ytitle, marks) {
  Plotly.react(target, series.map(([name, ys]) => ({ type: "scatter", mode: "lines+markers", name, x: steps, y: ys })),
    { height: 320, xaxis: { title: { text: "step" } }, yaxis: { title: { text: ytitle } }, margin: { t: 50 },
      shapes: marks.shapes, annotations: marks.annotations }, PLOT);
}

function tableOf(id, header, rows) {
  const t = el("table", "figures"); t.id = id;
  t.appendChild(rowOf("th", header)); rows.forEach((r) => t.appendChild(rowOf("td", r.map(String)))); return t;
}

function breakdownSection(diag) {
  const box = section("breakdown", "Where the step time goes: measured | planner (fived diagnose)");
  if (!diag) { box.appendChild(el("p", null, "not recorded yet: run.json comes at the end of the run")); return; }
  const chart = el("div", "chart"); chart.id = "breakdown-chart"; box.appendChild(chart);
  const names = diag.components.map((c) => c.component);
  Plotly.react(chart, [
    { type: "bar", name: "measured", x: names, y: diag.components.map((c) => c.measured_s) },
    { type: "bar", name: "planner", x: names, y: diag.components.map((c) => c.predicted_s) }],
    { barmode: "group", height: 300, xaxis: { title: { text: "component" } }, yaxis: { title: { text: "seconds per step" } }, margin: { t: 20 } }, PLOT);
  box.appendChild(tableOf("breakdown-table", ["component", "measured s", "share", "planner s"], diag.components.map((c) =>
    [c.component, c.measured_s.toFixed(4), (100 * c.measured_share).toFixed(0) + "%", c.predicted_s == null ? "" : c.predicted_s.toFixed(4)])));
  const text = el("pre", null, diag.text); text.id = "diagnosis"; box.appendChild(text);
}

function reportPage(D) {
  $("app").replaceChildren();
  const summary = el("p", null, D.summary); summary.id = "summary"; $("app").appendChild(summary);
  const M = D.metrics, steps = M.step, marks = segmentMarks(D.segments || []);
  const charts = [["loss", "loss", "loss", "loss (mean cross-entropy)"], ["lr", "learning rate", "lr", "learning rate"],
    ["grad-norm", "grad norm", "grad_norm", "gradient norm (before clipping)"], ["tokens-per-s", "tokens/s", "tokens_per_s", "tokens/s (all ranks)"],
    ["mfu", "MFU", "mfu", "MFU"]];
  for (const [id, title, key, ytitle] of charts) {
    const s = section("chart-" + id, title); const div = el("div", "chart"); div.id = id + "-chart"; s.appendChild(div);
    lineChart(div, steps, [[key, M[key]]], ytitle, marks);
  }
  if (M.val_loss) Plotly.addTraces("loss-chart", { type: "scatter", mode: "lines+markers", name: "val_loss", x: M.val_step, y: M.val_loss });
  if (M.loss_by_source) {
    const s = section("chart-loss-by-source", "loss per blend source"); const div = el("div", "chart"); div.id = "loss-by-source-chart"; s.appendChild(div);
    lineChart(div, M.source_step, Object.entries(M.loss_by_source), "loss of the source's tokens (mean cross-entropy)", marks);
  }
  const mem = section("memory-table", "Model-state bytes per rank: measured | planner");
  mem.appendChild(tableOf("state-bytes", ["rank", "params measured", "params planner", "grads measured", "grads planner", "optimizer measured", "optimizer planner"],
    D.state.map((r) => [r.rank, r.measured.params, r.predicted.params, r.measured.grads, r.predicted.grads, r.measured.optimizer, r.predicted.optimizer])));
  const comm = section("comm-table", "Communication per step on rank 0, per mesh dimension: measured | planner");
  comm.appendChild(tableOf("comm-bytes", ["dimension/collective", "measured bytes", "calls", "planner bytes"], D.comm.map((c) => [c.key, c.bytes, c.calls, c.predicted])));
  breakdownSection(D.diagnosis);
  const pipe = section("pipeline", "Pipeline timeline (executed, the last step)");
  const tl = el("div", "chart"); tl.id = "timeline-chart"; pipe.appendChild(tl);
  if (D.timeline.length) {
    pipe.insertBefore(el("p", null, D.bubble_line), tl);
    timelineChart(tl, D.timeline, "", "seconds from the step's first action");
  } else pipe.appendChild(el("p", null, D.layout.pp ? "no pipeline (pp=1)" : "not recorded yet: run.json comes at the end of the run"));
  const experts = section("experts", "Expert load per MoE layer (tokens routed to each expert, last step)");
  const ex = el("div", "chart"); ex.id = "experts-chart"; experts.appendChild(ex);
  const layers = Object.keys(D.expert_load);
  if (layers.length) {
    Plotly.react(ex, [{ type: "heatmap", z: layers.map((l) => D.expert_load[l]), y: layers.map((l) => "layer " + l),
      x: D.expert_load[layers[0]].map((_, i) => "expert " + i), colorscale: "Viridis", colorbar: { title: { text: "tokens" } } }],
      { height: 140 + 40 * layers.length, xaxis: { title: { text: "expert" } }, yaxis: { title: { text: "MoE layer" } }, margin: { t: 20, l: 110 } }, PLOT);
  } else experts.appendChild(el("p", null, D.layout.pp ? "dense model: no experts" : "not recorded yet: run.json comes at the end of the run"));
}

loadData().then((D) => {
  ({ explore: explorePage, serve: servePage, report: reportPage })[document.body.dataset.page](D);
  document.body.dataset.ready = "true";
}).catch((e) => { $("app").textContent = "could not load the page's data: " + e; throw e; });
