"use strict";
// Request: one logjam request whole, read from the journal that stores it (this hub's, or a
// fleet hub's): its fields, time by resource, log lines with severities and backtraces.
(() => {
  const { el, getJSON, number, level, PALETTE } = Console;
  const query = new URLSearchParams(location.search);
  const empty = document.getElementById("empty");
  const input = document.getElementById("find-id");
  input.value = query.get("id") || "";

  function fact(name, value) {
    return el("tr", {}, el("th", {}, name), el("td", { className: "mono" }, value === null || value === undefined ? "–" : value));
  }

  function timeBar(r) {
    const parts = Object.entries(r.times).filter(([name]) => name !== "gc_time");
    if (r.unaccounted_time) parts.push(["unaccounted", r.unaccounted_time]);
    const total = Math.max(r.total_time || 0, parts.reduce((sum, [, v]) => sum + v, 0), 1e-9);
    const bar = document.getElementById("timebar");
    const legend = document.getElementById("timebar-legend");
    bar.replaceChildren(...parts.map(([name, ms], i) => {
      const segment = el("span", { className: "segment", title: `${name}: ${number(ms, 2)} ms` });
      segment.style.width = `${(100 * ms) / total}%`;
      segment.style.background = PALETTE[i % PALETTE.length];
      return segment;
    }));
    legend.replaceChildren(...parts.map(([name, ms], i) => {
      const swatch = el("span", { className: "legend-swatch" });
      swatch.style.background = PALETTE[i % PALETTE.length];
      return el("span", { className: "legend-item" }, swatch, `${name.replace(/_time$/, "")} ${number(ms, 1)}`);
    }));
    if (r.times.gc_time !== undefined) legend.append(el("span", { className: "legend-item dim" }, `(gc ${number(r.times.gc_time, 1)}, part of the others)`));
  }

  function show(r) {
    document.getElementById("request").hidden = false;
    document.getElementById("r-action").textContent = r.action || "(no action)";
    const code = document.getElementById("r-code");
    code.textContent = r.code === null ? "" : String(r.code);
    code.className = "status " + (r.code >= 500 ? "bad" : r.code >= 400 ? "warn" : "ok");
    document.title = `taproom · Request ${r.request_id || r.offset}`;
    document.querySelector("#facts tbody").replaceChildren(
      fact("request id", r.request_id), fact("app-env", r.stream), fact("started at", r.started_at),
      fact("total time", r.total_time === null ? null : `${number(r.total_time, 2)} ms`),
      fact("severity", level(r.severity)), fact("host", r.host), fact("topic", r.topic),
      fact("received", r.received), fact("stored in", `journal ${r.journal}, offset ${r.offset} (${r.hub === "local" ? "this hub" : "hub " + r.hub})`));
    timeBar(r);
    const box = document.getElementById("exceptions-box");
    box.hidden = !r.exceptions.length && !r.backtraces.length;
    document.getElementById("r-exceptions").textContent = r.exceptions.join(", ");
    document.getElementById("backtraces").replaceChildren(...r.backtraces.map((b) =>
      el("div", { className: "backtrace" }, el("h3", {}, `${b.exception || "error"} (line ${b.n + 1})`), el("pre", {}, b.text))));
    document.getElementById("lines-title").textContent = r.lines.length < r.lines_total
      ? `Log lines (${number(r.lines.length)} of ${number(r.lines_total)})` : `Log lines (${number(r.lines_total)})`;
    document.querySelector("#lines tbody").replaceChildren(...r.lines.map((line) =>
      el("tr", { className: "line level-" + line.level },
        el("td", { className: "num" }, line.n + 1), el("td", {}, line.level),
        el("td", { className: "mono" }, line.time), el("td", {}, el("pre", { className: "message" }, line.message)))));
    document.querySelector("#fields tbody").replaceChildren(...Object.entries(r.fields).map(([name, value]) =>
      el("tr", {}, el("th", { className: "mono" }, name), el("td", { className: "mono" }, value === null ? "null" : String(value)))));
  }

  async function load() {
    if (!query.get("id") && !(query.get("journal") && query.get("offset"))) {
      empty.hidden = false;
      empty.textContent = "Give a request id (logjam's request_id), or open a request from the Requests, Errors or Exceptions pages.";
      return;
    }
    const api = new URLSearchParams();
    for (const name of ["id", "journal", "offset", "date"]) if (query.get(name)) api.set(name, query.get(name));
    try {
      show(await getJSON(`/api/requests/find?${api}`));
    } catch (err) {
      empty.hidden = false;
      empty.textContent = `Not found: ${err.message}`;
    }
  }
  load();
})();
