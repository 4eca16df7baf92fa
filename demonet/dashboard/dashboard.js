// The dashboard: polls status.json and draws the run, its curves and its members. Plain JS, no library;
// text goes in through textContent only (peer ids and refusal reasons come from the network).
"use strict";

const POLL_MS = 2000;
const KEEP_ROUNDS = 5000;
const SVG = "http://www.w3.org/2000/svg";
const rounds = new Map(); // round -> row, accumulated across polls (each asks only for newer rounds)
let lastRound = null;

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

let svgFactory = (tag) => document.createElementNS(SVG, tag);
function svgEl(tag, attrs) {
  const e = svgFactory(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  return e;
}

function num(x, digits) {
  if (x === null || x === undefined) return "—";
  return Number(x).toFixed(digits === undefined ? 0 : digits);
}

function bytes(x) {
  if (x === null || x === undefined) return "—";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(x) >= 1000 && i < units.length - 1) { x /= 1000; i++; }
  return (i === 0 ? x.toFixed(0) : x.toFixed(1)) + " " + units[i];
}

function rate(bps) {
  if (bps === null || bps === undefined) return "—";
  return bytes(bps * 8).replace("B", "bit") + "/s";
}

function ago(s) {
  if (s === null || s === undefined) return "—";
  if (s < 60) return s.toFixed(1) + " s ago";
  if (s < 3600) return (s / 60).toFixed(1) + " min ago";
  return (s / 3600).toFixed(1) + " h ago";
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString();
}

// The top of a y axis that a few outliers do not flatten: the largest value at most OUTLIER_X times the median
// (and a tenth more where some are above it).
// Round 0's bytes hold every peer's parameter download, some 70 times a round's payloads.
const OUTLIER_X = 4;
function axisTop(values) {
  const sorted = values.slice().sort((a, b) => a - b);
  const median = sorted[Math.floor((sorted.length - 1) / 2)];
  if (!(median > 0)) return sorted[sorted.length - 1];
  const inside = sorted.filter((v) => v <= OUTLIER_X * median);
  const top = inside[inside.length - 1];
  return inside.length < sorted.length ? 1.1 * top : top; // room under the edge, where the outliers are named
}

// A line chart of one or more series [{cls, points: [[x, y], ...]}] into an <svg>; the number of points
// drawn goes to its data-points attribute, the axis top to data-top. `opts.zero`: the y axis starts at 0
// (times, bytes); `opts.outliers`: values far above the median are drawn on the top edge and named there.
function chart(svg, series, opts) {
  const zero = Boolean(opts && opts.zero), outliers = Boolean(opts && opts.outliers);
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = 420, H = 200, L = 52, R = 10, T = 10, B = 24;
  const all = series.flatMap((s) => s.points);
  svg.setAttribute("data-points", all.length);
  svg.appendChild(svgEl("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"}));
  svg.appendChild(svgEl("line", {x1: L, y1: T, x2: L, y2: H - B, class: "axis"}));
  if (all.length === 0) {
    const t = svgEl("text", {x: W / 2, y: H / 2, "text-anchor": "middle"});
    t.textContent = "no rounds yet";
    svg.appendChild(t);
    return;
  }
  let x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
  let y0 = zero ? 0 : Math.min(...all.map((p) => p[1]));
  let y1 = outliers ? axisTop(all.map((p) => p[1])) : Math.max(...all.map((p) => p[1]));
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  svg.setAttribute("data-top", y1);
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = (y) => H - B - (Math.min(y, y1) - y0) / (y1 - y0) * (H - T - B);
  const label = (x, y, text, anchor) => {
    const t = svgEl("text", {x: x, y: y, "text-anchor": anchor});
    t.textContent = text;
    svg.appendChild(t);
  };
  const fmt = (v) => Math.abs(v) >= 1000 ? bytes(v) : Number(v.toPrecision(3)).toString();
  for (const f of [0, 0.5, 1]) {
    const y = y0 + f * (y1 - y0);
    if (f > 0) svg.appendChild(svgEl("line", {x1: L, y1: sy(y), x2: W - R, y2: sy(y), class: "grid"}));
    label(L - 4, sy(y) + 3, fmt(y), "end");
  }
  label(L, H - 8, "round " + Math.round(x0), "start");
  label(W - R, H - 8, "round " + Math.round(x1), "end");
  const over = all.filter((p) => p[1] > y1).sort((a, b) => b[1] - a[1]);
  if (over.length > 0) {
    label(W - R, T + 10, "off the chart: round " + over[0][0] + " " + fmt(over[0][1]) +
      (over.length > 1 ? " and " + (over.length - 1) + " more" : ""), "end");
  }
  series.forEach((s) => {
    if (s.points.length === 0) return;
    const pts = s.points.map((p) => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" ");
    svg.appendChild(svgEl("polyline", {points: pts, class: s.cls, "data-points": s.points.length}));
  });
}

// Rounds per second over the last PACE_ROUNDS rounds closed, and the seconds the run's other rounds take at that
// pace (null: not known yet, or a run with no end).
const PACE_ROUNDS = 20;
function pace(rows, totalRounds, round) {
  const recent = rows.slice(-(PACE_ROUNDS + 1));
  if (recent.length < 2) return {perSecond: null, secondsLeft: null};
  const span = recent[recent.length - 1].time - recent[0].time;
  if (!(span > 0)) return {perSecond: null, secondsLeft: null};
  const perSecond = (recent.length - 1) / span;
  return {perSecond: perSecond, secondsLeft: totalRounds ? Math.max(0, totalRounds - round) / perSecond : null};
}

function duration(s) {
  if (s === null || s === undefined) return "—";
  if (s < 90) return s.toFixed(0) + " s";
  if (s < 5400) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}

function points(rows, field) {
  return rows.filter((r) => r[field] !== null && r[field] !== undefined).map((r) => [r.round, r[field]]);
}

function card(parent, label, value) {
  const c = el("div", null, "card");
  c.appendChild(el("b", value));
  c.appendChild(el("span", label));
  parent.appendChild(c);
}

function renderRun(doc, rows) {
  const run = doc.run, box = document.getElementById("run");
  const speed = pace(rows, run.total_rounds, run.round);
  box.replaceChildren();
  card(box, "round" + (run.total_rounds ? " of " + run.total_rounds : ""), run.round);
  card(box, "phase", run.phase);
  card(box, "rounds per second", speed.perSecond === null ? "—" : num(speed.perSecond, speed.perSecond < 10 ? 2 : 0));
  card(box, "run time left", duration(speed.secondsLeft));
  card(box, "round deadline in, s", run.seconds_left === null ? "—" : num(run.seconds_left, 1));
  card(box, "rounds closed", run.rounds_closed);
  card(box, "rounds aborted", run.rounds_aborted);
  card(box, "members", run.members + (run.idle ? " (" + run.idle + " idle)" : ""));
  card(box, "last loss", num(run.last_loss, 4));
  card(box, "bytes in", bytes(run.bytes_up));
  card(box, "bytes out", bytes(run.bytes_down));
  card(box, "resyncs", run.resyncs);
  card(box, "rejected", run.rejected);
  if (run.clipped !== null && run.clipped !== undefined) {
    card(box, "clipped to the median norm (about half the payloads of a healthy run)", run.clipped);
  }
}

// A member whose last payload had under half the median member's samples: the slow one of a mixed swarm.
function slowPeers(members) {
  const counts = members.filter((m) => m.state !== "left" && m.samples).map((m) => m.samples).sort((a, b) => a - b);
  if (counts.length < 2) return new Set();
  const median = counts[Math.floor((counts.length - 1) / 2)];
  return new Set(members.filter((m) => m.state !== "left" && m.samples && m.samples < median / 2).map((m) => m.id));
}

// The members the document does not list (a run joined by thousands of ids lists its most relevant): counted by state.
function omittedText(omitted) {
  const states = Object.entries(omitted || {});
  if (states.length === 0) return "";
  const total = states.reduce((sum, [, count]) => sum + count, 0);
  return "… and " + total + " more not listed: " + states.map(([state, count]) => count + " " + state).join(", ");
}

function renderMembers(doc) {
  const body = document.querySelector("#members tbody");
  body.replaceChildren();
  const slow = slowPeers(doc.members);
  const dht = doc.members.some((m) => m.slices !== null);
  document.querySelectorAll(".dht").forEach((e) => e.classList.toggle("hidden", !dht));
  for (const m of doc.members) {
    const tr = el("tr", null, m.state === "left" ? "left" : slow.has(m.id) ? "slow" : "");
    tr.setAttribute("data-peer", m.id);
    const cells = [m.id, m.key || "—", m.state, ago(m.last_seen_s), m.contributed, m.missed, m.resyncs, num(m.last_loss, 4),
      bytes(m.bytes_up), bytes(m.bytes_down), rate(m.link_bps), m.samples ?? "—", m.micro_batches ?? "—",
      num(m.compute_s, 2),
      m.weight === null || m.weight === undefined ? "—" : (100 * m.weight).toFixed(0) + "%", m.topk ?? "—",
      num(m.upload_s, 2), num(m.need_s, 2)];
    cells.forEach((v, i) => tr.appendChild(el("td", v, i === 2 ? "state-" + m.state : "")));
    const slices = el("td", m.slices === null ? "—" : m.slices, "dht");
    slices.classList.toggle("hidden", !dht);
    tr.appendChild(slices);
    body.appendChild(tr);
  }
  const more = omittedText(doc.members_omitted);
  if (more) {
    const tr = el("tr");
    const td = el("td", more, "muted");
    td.colSpan = 19;
    tr.appendChild(td);
    body.appendChild(tr);
  }
}

function renderRefusals(doc) {
  const body = document.querySelector("#refusals tbody");
  body.replaceChildren();
  for (const r of doc.refusals.slice().reverse()) {
    const tr = el("tr");
    [clock(r.time), r.peer || "?", r.round === null ? "—" : r.round, r.kind, r.reason]
      .forEach((v) => tr.appendChild(el("td", v)));
    body.appendChild(tr);
  }
  if (doc.refusals.length === 0) {
    const tr = el("tr");
    const td = el("td", "none", "muted");
    td.colSpan = 5;
    tr.appendChild(td);
    body.appendChild(tr);
  }
}

function render(doc) {
  document.getElementById("source").textContent = doc.mode === "dht" ? "DHT peer " + doc.source : doc.source;
  document.title = "demonet · round " + doc.run.round;
  const rows = Array.from(rounds.values()).sort((a, b) => a.round - b.round);
  renderRun(doc, rows);
  chart(document.getElementById("loss-chart"), [{cls: "s0", points: points(rows, "loss")}]);
  chart(document.getElementById("time-chart"), [{cls: "s0", points: points(rows, "round_s")},
    {cls: "s1", points: points(rows, "close_s")}], {zero: true});
  chart(document.getElementById("bytes-chart"), [{cls: "s0", points: points(rows, "bytes_up")},
    {cls: "s1", points: points(rows, "bytes_down")}], {zero: true, outliers: true});
  renderMembers(doc);
  renderRefusals(doc);
}

async function poll() {
  const updated = document.getElementById("updated");
  try {
    const reply = await fetch("status.json" + (lastRound === null ? "" : "?since=" + lastRound), {cache: "no-store"});
    if (!reply.ok) throw new Error("HTTP " + reply.status);
    const doc = await reply.json();
    if (lastRound !== null && doc.run.round <= lastRound && doc.rounds.length === 0 && doc.run.rounds_closed === 0) {
      rounds.clear(); // a new run on the same address
      lastRound = null;
    }
    for (const r of doc.rounds) rounds.set(r.round, r);
    while (rounds.size > KEEP_ROUNDS) rounds.delete(rounds.keys().next().value);
    if (doc.rounds.length > 0) lastRound = Math.max(lastRound === null ? -1 : lastRound, ...doc.rounds.map((r) => r.round));
    render(doc);
    updated.textContent = "updated " + clock(doc.time) + " · up " + num(doc.uptime_s / 60, 1) + " min";
    updated.className = "muted";
  } catch (e) {
    updated.textContent = "cannot read status.json: " + e.message;
    updated.className = "error";
  }
}

if (typeof document !== "undefined") { // in a page; tests/unit/test_dashboard.py loads the functions in node
  poll();
  setInterval(poll, POLL_MS);
} else if (typeof module !== "undefined") {
  module.exports = {axisTop, chart, pace, duration, omittedText, setSvgFactory: (f) => { svgFactory = f; }};
}
