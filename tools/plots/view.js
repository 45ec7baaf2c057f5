// memsim view: draws the report from the JSON that view.py inlines in the page (the
// element with id memsim-data). No network and no libraries: SVG and tables built here.
"use strict";

const DATA = JSON.parse(document.getElementById("memsim-data").textContent);
const SVG_NS = "http://www.w3.org/2000/svg";
const CATEGORY_COLOURS = {
  parameters: "#4e79a7", gradients: "#f28e2b", optimizer_state: "#e15759",
  activations: "#76b7b2", temporaries: "#59a14f", communication: "#edc948",
  workspaces: "#b07aa1", allocator_rounding: "#bab0ac",
};
const PHASE_COLOURS = {
  setup: "#eeeeee", forward: "#dbeafe", backward: "#fde2e2", optimizer: "#e2f5e1",
};

// ---- helpers ---------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  return node;
}

// MiB with thousands separators and one decimal: "7,358.8 MiB".
function mib(value) {
  return value.toLocaleString("en-US", {minimumFractionDigits: 1, maximumFractionDigits: 1}) +
         " MiB";
}

function number(value, digits) {
  return value.toLocaleString("en-US", {minimumFractionDigits: digits,
                                        maximumFractionDigits: digits});
}

// A key number: its label, the rendered value, and which summary field it shows (the tests
// read these back and compare them with summary_rank{R}.json).
function card(label, text, field) {
  const value = el("div", {class: "value"}, text);
  if (field) value.dataset.field = field;
  return el("div", {class: "card"}, el("div", {class: "label"}, label), value);
}

// A table whose columns sort on a click (numbers numerically, text alphabetically).
// columns: [{key, label, format?}]
function sortableTable(columns, rows, name) {
  const table = el("table", {class: "sortable", "data-table": name});
  const head = el("tr");
  const body = el("tbody");
  let sortKey = null;
  let ascending = true;
  function render() {
    const sorted = rows.slice();
    if (sortKey !== null) {
      sorted.sort((a, b) => {
        const x = a[sortKey], y = b[sortKey];
        const order = typeof x === "number" && typeof y === "number"
                          ? x - y : String(x).localeCompare(String(y));
        return ascending ? order : -order;
      });
    }
    body.replaceChildren(...sorted.map(row => el(
        "tr", {}, ...columns.map(c => el("td", {"data-column": c.key},
                                          c.format ? c.format(row[c.key], row)
                                                   : (row[c.key] ?? ""))))));
  }
  for (const column of columns) {
    const th = el("th", {title: "sort"}, column.label);
    th.addEventListener("click", () => {
      ascending = sortKey === column.key ? !ascending : true;
      sortKey = column.key;
      render();
    });
    head.append(th);
  }
  table.append(el("thead", {}, head), body);
  render();
  return table;
}

// ---- a rank class ----------------------------------------------------------------------

function verdictCards(rank) {
  const s = rank.summary;
  const cards = [
    card("peak allocated", mib(s.peak_allocated_MB), "peak_allocated_MB"),
    card("peak reserved", mib(s.peak_reserved_MB), "peak_reserved_MB"),
    card("static memory", mib(s.static_memory_MB), "static_memory_MB"),
    card("peak phase", s.peak_phase, "peak_phase"),
  ];
  if (s.fits) {
    cards.push(card("fits, headroom", mib(s.headroom_MB), "headroom_MB"));
  } else {
    cards.push(card("does not fit", s.out_of_memory || "out of memory", "out_of_memory"));
  }
  return el("div", {class: "cards"}, ...cards);
}

// The window of the timelines, in seconds from the iteration's start, when the page's
// address ends in #zoom=FROM,TO (so a zoomed view can be shared); null otherwise.
function zoomFromAddress() {
  const match = /^#zoom=([0-9.eE+-]+),([0-9.eE+-]+)$/.exec(window.location.hash);
  if (!match) return null;
  const from = Number(match[1]), to = Number(match[2]);
  return Number.isFinite(from) && Number.isFinite(to) && to > from ? [from, to] : null;
}

// Allocated and reserved memory over the last iteration, phases shaded, and what was
// allocated or freed nearest the pointer. Drag across the chart to zoom into a stretch of
// time; double-click to see the whole iteration again.
function timeline(rank) {
  const box = el("div", {class: "timeline"});
  const t = rank.timeline;
  if (!t || t.t.length === 0) {
    box.append(el("p", {class: "note"}, "No memory trace beside this summary."));
    return box;
  }
  const width = 900, height = 260, left = 70, right = 10, top = 10, bottom = 30;
  const start = t.t[0], end = Math.max(t.t[t.t.length - 1], start + 1e-12);
  const values = t.allocated.concat(t.reserved);
  let y0 = Math.min(...values), y1 = Math.max(...values);
  const pad = Math.max((y1 - y0) * 0.08, 1);
  y0 = Math.max(0, y0 - pad);
  y1 += pad;
  const Y = v => top + (y1 - v) / (y1 - y0) * (height - top - bottom);
  const plot = svg("svg", {viewBox: `0 0 ${width} ${height}`, class: "chart",
                           "data-chart": "timeline"});
  const clipId = `timeline-clip-${rank.summary.rank}`;
  const zoom = zoomFromAddress();
  let x0 = zoom ? Math.max(start, start + zoom[0]) : start;
  let x1 = zoom ? Math.min(end, start + zoom[1]) : end;
  if (!(x1 > x0)) [x0, x1] = [start, end];
  const X = v => left + (v - x0) / (x1 - x0) * (width - left - right);
  const timeAt = clientX => {
    const rect = plot.getBoundingClientRect();
    const x = (clientX - rect.left) / rect.width * width;
    return {x, time: x0 + (x - left) / (width - left - right) * (x1 - x0)};
  };
  const cursor = svg("line", {y1: top, y2: height - bottom, class: "cursor", visibility: "hidden"});
  const selection = svg("rect", {y: top, height: height - top - bottom, class: "selection",
                                 visibility: "hidden"});
  const draw = () => {
    plot.replaceChildren();
    for (const span of rank.phases) {
      if (span.end < x0 || span.start > x1) continue;
      const a = X(Math.max(span.start, x0)), b = X(Math.min(span.end, x1));
      plot.append(svg("rect", {x: a, y: top, width: Math.max(b - a, 1),
                               height: height - top - bottom,
                               fill: PHASE_COLOURS[span.phase] || "#f4f4f4"}));
    }
    // The samples inside the window and one on each side, clipped to the plot area, so
    // the lines reach its edges at their true slope.
    const clip = svg("clipPath", {id: clipId});
    clip.append(svg("rect", {x: left, y: 0, width: width - left - right, height}));
    const defs = svg("defs");
    defs.append(clip);
    plot.append(defs);
    let first = 0, last = t.t.length - 1;
    while (first + 1 < t.t.length && t.t[first + 1] < x0) first++;
    while (last > 0 && t.t[last - 1] > x1) last--;
    for (const [series, colour] of [[t.reserved, "#999999"], [t.allocated, "#1f77b4"]]) {
      const points = [];
      for (let i = first; i <= last; i++) {
        points.push(`${X(t.t[i]).toFixed(1)},${Y(series[i]).toFixed(1)}`);
      }
      plot.append(svg("polyline", {points: points.join(" "), fill: "none", stroke: colour,
                                   "stroke-width": 1.5, "clip-path": `url(#${clipId})`}));
    }
    for (let i = 0; i <= 4; i++) {
      const v = y0 + (y1 - y0) * i / 4;
      const label = svg("text", {x: left - 6, y: Y(v) + 4, "text-anchor": "end",
                                 class: "tick"});
      label.textContent = (v / 1024).toFixed(2) + " GiB";
      plot.append(label, svg("line", {x1: left, x2: width - right, y1: Y(v), y2: Y(v),
                                      class: "grid"}));
    }
    const axis = svg("text", {x: (left + width) / 2, y: height - 6, "text-anchor": "middle",
                              class: "tick", "data-field": "timeline-window"});
    const zoomed = x0 > start || x1 < end;
    axis.textContent = `virtual time in iteration ${t.iteration} (s): ` +
                       `${(x0 - start).toPrecision(3)} to ${(x1 - start).toPrecision(3)}` +
                       (zoomed ? " (zoomed; double-click for all)" : "");
    plot.append(axis, selection, cursor);
  };
  draw();
  const info = el("div", {class: "hover"},
                  "Move over the chart: what was allocated or freed then. Drag to zoom.");
  let dragFrom = null;
  plot.addEventListener("mousedown", event => {
    dragFrom = timeAt(event.clientX);
    event.preventDefault();
  });
  plot.addEventListener("mousemove", event => {
    const at = timeAt(event.clientX);
    cursor.setAttribute("x1", at.x);
    cursor.setAttribute("x2", at.x);
    cursor.setAttribute("visibility", "visible");
    info.textContent = describeMoment(rank, at.time);
    if (dragFrom) {
      selection.setAttribute("x", Math.min(dragFrom.x, at.x));
      selection.setAttribute("width", Math.abs(at.x - dragFrom.x));
      selection.setAttribute("visibility", "visible");
    }
  });
  plot.addEventListener("mouseup", event => {
    const at = timeAt(event.clientX);
    const from = dragFrom;
    dragFrom = null;
    selection.setAttribute("visibility", "hidden");
    if (!from || Math.abs(at.x - from.x) < 5) return;  // a click, not a drag
    x0 = Math.max(start, Math.min(from.time, at.time));
    x1 = Math.min(end, Math.max(from.time, at.time));
    if (!(x1 > x0)) [x0, x1] = [start, end];
    draw();
  });
  plot.addEventListener("dblclick", () => {
    [x0, x1] = [start, end];
    draw();
  });
  const legend = el("div", {class: "legend"},
                    ...[["allocated", "#1f77b4"], ["reserved", "#999999"]].map(
                        ([name, colour]) => el("span", {}, swatch(colour), name)),
                    ...rank.phases_present.map(
                        phase => el("span", {}, swatch(PHASE_COLOURS[phase] || "#f4f4f4"),
                                    phase)));
  box.append(plot, legend, info);
  return box;
}

function swatch(colour) {
  return el("i", {class: "swatch", style: `background:${colour}`});
}

// The allocated memory at `time` and the allocator event nearest to it.
function describeMoment(rank, time) {
  const t = rank.timeline;
  let i = 0;
  while (i + 1 < t.t.length && t.t[i + 1] <= time) i++;
  let text = `t = ${(time - t.t[0]).toPrecision(4)} s: allocated ${mib(t.allocated[i])}`;
  const events = rank.events;
  if (events.length) {
    let lo = 0, hi = events.length - 1;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (events[mid].t < time) lo = mid + 1; else hi = mid;
    }
    if (lo > 0 && Math.abs(events[lo - 1].t - time) < Math.abs(events[lo].t - time)) lo--;
    const e = events[lo];
    text += ` | ${e.action === "alloc" ? "+" : "-"}${mib(e.size_MB)} ${e.action} ` +
            `${e.tensor} in ${e.module} (${e.op}, ${e.phase})`;
  }
  return text;
}

// Memory at the peak by category: one stacked bar and its numbers.
function categories(rank) {
  const breakdown = rank.summary.breakdown_at_peak_MB || {};
  const entries = Object.entries(breakdown).filter(([, mb]) => mb > 0)
                      .sort((a, b) => b[1] - a[1]);
  const total = entries.reduce((sum, [, mb]) => sum + mb, 0) || 1;
  const bar = el("div", {class: "stack"});
  const list = el("table", {class: "plain", "data-table": "categories"});
  for (const [name, mb] of entries) {
    const colour = CATEGORY_COLOURS[name] || "#cccccc";
    bar.append(el("div", {style: `width:${(mb / total * 100).toFixed(3)}%;background:${colour}`,
                          title: `${name}: ${mib(mb)}`}));
    list.append(el("tr", {}, el("td", {}, swatch(colour), name),
                   el("td", {"data-category": name}, mib(mb)),
                   el("td", {}, `${(mb / total * 100).toFixed(1)}%`)));
  }
  return el("div", {}, bar, list);
}

// Memory at the peak by module, the layers of a stack merged into one expandable row.
function modules(rank) {
  const box = el("div", {"data-table": "modules"});
  for (const group of rank.module_groups) {
    const head = el("span", {class: "module"}, group.module);
    const size = el("span", {class: "mb", "data-module": group.module}, mib(group.MB));
    if (group.members.length > 1) {
      const details = el("details", {}, el("summary", {}, head, " ",
                                           el("span", {class: "count"},
                                              `(${group.members.length} layers)`), size));
      for (const member of group.members) {
        details.append(el("div", {class: "member"}, el("span", {class: "module"}, member.module),
                          el("span", {class: "mb"}, mib(member.MB))));
      }
      box.append(details);
    } else {
      box.append(el("div", {class: "row"}, head, size));
    }
  }
  return box;
}

function tensors(rank) {
  const columns = [
    {key: "size_MB", label: "MiB", format: v => number(v, 1)},
    {key: "tensor", label: "shape"}, {key: "category", label: "category"},
    {key: "phase", label: "phase"}, {key: "module", label: "module"}, {key: "op", label: "op"},
    {key: "microbatch", label: "microbatch"},
  ];
  return sortableTable(columns, rank.summary.largest_tensors_at_peak || [], "tensors");
}

function rankSection(rank) {
  const s = rank.summary;
  // "ranks": [first, last] spans of the ranks this class stands for.
  const count = (s.ranks || []).reduce((n, [first, last]) => n + last - first + 1, 0);
  const title = `Rank ${s.rank}` + (count > 1 ? ` (class of ${count} ranks)` : "") +
                (s.pp_stage !== undefined ? `, pipeline stage ${s.pp_stage}` : "");
  return el("section", {"data-rank": s.rank},
            el("h2", {}, title), verdictCards(rank),
            el("h3", {}, "Timeline"), timeline(rank),
            el("div", {class: "columns"},
               el("div", {}, el("h3", {}, "At the peak, by category"), categories(rank)),
               el("div", {}, el("h3", {}, "At the peak, by module"), modules(rank))),
            el("h3", {}, "Largest tensors alive at the peak"), tensors(rank));
}

// ---- sweeps and plans ------------------------------------------------------------------

// TP x PP cells, each the best layout with that TP and PP: one that fits first, then the
// lowest `rank` (peak memory for a sweep, step time for a plan). A layout is
// {tp, pp, status: success|oom|invalid|..., rank, text, reason}.
function heatmap(layouts, note) {
  const tps = [...new Set(layouts.map(l => l.tp))].sort((a, b) => a - b);
  const pps = [...new Set(layouts.map(l => l.pp))].sort((a, b) => a - b);
  const table = el("table", {class: "heatmap", "data-table": "heatmap"});
  table.append(el("tr", {}, el("th", {}, "TP \\ PP"), ...pps.map(pp => el("th", {}, pp))));
  for (const tp of tps) {
    const row = el("tr", {}, el("th", {}, tp));
    for (const pp of pps) {
      const cell = layouts.filter(l => l.tp === tp && l.pp === pp)
                       .sort((a, b) => (b.status === "success") - (a.status === "success") ||
                                       (a.rank ?? Infinity) - (b.rank ?? Infinity))[0];
      if (!cell) { row.append(el("td", {class: "empty"}, "")); continue; }
      row.append(el("td", {class: `status-${cell.status}`, title: cell.reason || cell.status},
                    cell.text));
    }
    table.append(row);
  }
  return el("div", {}, table, el("p", {class: "note"}, note));
}

function gib(mb) {
  return `${(mb / 1024).toFixed(1)} GiB`;
}

function sweepSection(sweep) {
  const columns = ["config", "tp", "pp", "vpp", "dp", "cp", "ep", "micro_batch_size",
                   "num_microbatches", "recompute", "status"].map(k => ({key: k, label: k}));
  columns.push({key: "peak_MB", label: "peak allocated MiB",
                format: v => v == null ? "-" : number(v, 1)});
  columns.push({key: "reason", label: "reason"});
  const cells = sweep.layouts.map(l => ({
    tp: l.tp, pp: l.pp, status: l.status, rank: l.peak_MB, reason: l.reason,
    text: l.status === "invalid" ? "invalid" : l.peak_MB != null ? gib(l.peak_MB) : l.status,
  }));
  const note = "Cells: memsim's peak allocated memory of the best layout with that TP and PP " +
               "(one that fits first). Hover for the reason.";
  return el("section", {"data-kind": "sweep"},
            el("h2", {}, `Sweep: ${sweep.layouts.length} layouts`), heatmap(cells, note),
            el("h3", {}, "Layouts"), sortableTable(columns, sweep.layouts, "layouts"));
}

function planSection(plan) {
  const columns = ["tp", "pp", "vpp", "cp", "ep", "dp", "micro_batch_size", "recompute",
                   "data_parallel", "verdict"].map(k => ({key: k, label: k}));
  columns.push({key: "step_s", label: "step s", format: v => v == null ? "-" : number(v, 3)});
  columns.push({key: "tokens_per_s_per_gpu", label: "tokens/s/GPU",
                format: v => v == null ? "-" : number(v, 0)});
  columns.push({key: "headroom_GiB", label: "headroom GiB",
                format: v => v == null ? "-" : number(v, 2)});
  const status = {fits: "success", invalid: "invalid"};
  const cells = plan.layouts.map(l => ({
    tp: l.tp, pp: l.pp, status: status[l.verdict] || "oom", rank: l.step_s, reason: l.verdict,
    text: l.verdict === "fits" ? `${number(l.step_s, 2)} s` : l.verdict.replace(/_/g, " "),
  }));
  const note = "Cells: the fastest layout with that TP and PP that fits (its step time), " +
               "else why none does. Hover for the verdict.";
  return el("section", {"data-kind": "plan"},
            el("h2", {}, `Plan: ${plan.run}`),
            el("p", {}, `${plan.layouts.length} layouts on ${plan.world_size} GPUs, ` +
                        `usable ${number(plan.usable_GiB, 2)} GiB each.`),
            heatmap(cells, note), el("h3", {}, "Layouts"),
            sortableTable(columns, plan.layouts, "layouts"));
}

// ---- the page --------------------------------------------------------------------------

function main() {
  const root = document.getElementById("report");
  root.append(el("h1", {}, DATA.title), el("p", {class: "note"}, DATA.subtitle));
  if (DATA.plan) root.append(planSection(DATA.plan));
  if (DATA.sweep) root.append(sweepSection(DATA.sweep));
  for (const rank of DATA.ranks) root.append(rankSection(rank));
  document.body.dataset.rendered = "true";
}

main();
