"use strict";
// Requests: one app-env's day from the Spark rollup tables (logjam's performance pages),
// and the drill-down from a chart minute or an action to the requests behind it.
(() => {
  const { el, getJSON, number, chart, when, requestRows, dayPicker, PALETTE } = Console;
  const dateSelect = document.getElementById("date");
  const streamSelect = document.getElementById("stream");
  const grid = document.getElementById("charts");
  const empty = document.getElementById("empty");
  const pick = { onpick: (t) => drill({ minute: t }) };
  const charts = {
    requests: chart(grid, "Requests per minute", pick),
    latency: chart(grid, "Response time (ms): p50, p95, p99", { unit: "ms", ...pick }),
    apdex: chart(grid, "Apdex", pick),
    errors: chart(grid, "4xx and 5xx responses per minute", pick),
    logs: chart(grid, "Exceptions and log severities per minute", pick),
  };

  async function loadDay(date, stream) {
    const query = new URLSearchParams({ date, stream, actions: "30" });
    for (const [id, path] of [["errors-link", "/errors"], ["exceptions-link", "/exceptions"]]) {
      document.getElementById(id).setAttribute("href", `${path}?${new URLSearchParams({ date, stream })}`);
    }
    const day = await getJSON(`/api/requests/day?${query}`);
    const t = day.minutes;
    charts.requests.update(t, { requests: day.requests });
    charts.latency.update(t, { p50: day.p50 || [], p95: day.p95 || [], p99: day.p99 || [] });
    charts.apdex.update(t, { apdex: day.apdex });
    charts.errors.update(t, { "4xx": day.status_4xx, "5xx": day.status_5xx });
    charts.logs.update(t, Object.assign({ exceptions: day.exceptions }, day.severities));
    drawHeatmap(day);
    actionsTable(day.actions);
    drawStack(day.actions);
  }

  // The slow and failed requests of a minute (a chart click) or of an action (a table row).
  async function drill({ minute = null, action = "" }) {
    const query = new URLSearchParams({ date: dateSelect.value, stream: streamSelect.value, limit: "50" });
    if (minute !== null) query.set("minute", String(minute));
    if (action) query.set("action", action);
    const section = document.getElementById("drill");
    section.hidden = false;
    const title = document.getElementById("drill-title");
    title.textContent = minute !== null ? `Minute ${when(minute * 1000, false)} UTC` : `Action ${action}, the whole day`;
    const note = document.getElementById("drill-note");
    note.textContent = "loading…";
    try {
      const data = await getJSON(`/api/requests/samples?${query}`);
      requestRows(document.querySelector("#slow tbody"), data.slow);
      requestRows(document.querySelector("#failed tbody"), data.failed);
      const lost = data.failed_count - data.failed_kept;
      note.textContent = `${number(data.slow.length)} slowest requests kept, ${number(data.failed_count)} failed` +
        (lost > 0 ? ` (${number(lost)} not kept: the rollup keeps a bounded number per minute and action)` : "");
    } catch (err) {
      note.textContent = "error: " + err.message;
    }
    section.scrollIntoView({ block: "nearest" });
  }

  function drawHeatmap(day) {
    const canvas = document.getElementById("heatmap");
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#0c1014";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    if (!day.heatmap || !day.minutes.length) return;
    const { bands_ms: bands, counts } = day.heatmap;
    const left = 60, w = (canvas.width - left) / counts.length, h = canvas.height / bands.length;
    const max = Math.max(1, ...counts.flat());
    counts.forEach((column, x) => column.forEach((n, y) => {
      if (!n) return;
      const level = Math.log1p(n) / Math.log1p(max);
      ctx.fillStyle = `rgba(224, 160, 48, ${0.15 + 0.85 * level})`;
      ctx.fillRect(left + x * w, canvas.height - (y + 1) * h, Math.max(w, 1), h);
    }));
    ctx.fillStyle = "#8b97a3";
    ctx.font = "11px sans-serif";
    bands.forEach((ms, y) => {
      if (y % 4 === 0) ctx.fillText(ms >= 1000 ? `${ms / 1000} s` : `${ms} ms`, 2, canvas.height - y * h - 2);
    });
  }

  function actionsTable(actions) {
    document.querySelector("#actions tbody").replaceChildren(...actions.map((a) =>
      el("tr", { className: "clickable", onclick: () => drill({ action: a.action }) },
        el("td", { className: "mono" }, a.action), el("td", { className: "num" }, number(a.count)),
        el("td", { className: "num" }, number(a.mean, 1)), el("td", { className: "num" }, number(a.p95, 1)),
        el("td", { className: "num" }, number(a.share * 100, 1) + " %"))));
  }

  function drawStack(actions) {
    const canvas = document.getElementById("stack");
    const ctx = canvas.getContext("2d");
    const shown = actions.slice(0, 15);
    const names = [...new Set(shown.flatMap((a) => Object.keys(a.breakdown)))].sort();
    document.getElementById("stack-legend").replaceChildren(...names.map((name, i) => {
      const swatch = el("span", { className: "legend-swatch" });
      swatch.style.background = PALETTE[i % PALETTE.length];
      return el("span", {}, swatch, name.replace(/_time$/, "") + "  ");
    }));
    canvas.height = Math.max(60, shown.length * 24 + 10);
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const max = Math.max(1e-9, ...shown.map((a) => a.time_sum));
    const labels = 180;  // the action's name (drawn as canvas text, not markup) on the left
    ctx.font = "12px ui-monospace, monospace";
    shown.forEach((a, row) => {
      ctx.fillStyle = "#d8dee4";
      ctx.fillText(a.action.length > 24 ? a.action.slice(0, 23) + "…" : a.action, 0, 18 + row * 24);
      let x = labels;
      names.forEach((name, i) => {
        const width = ((a.breakdown[name] || 0) / max) * (canvas.width - labels);
        ctx.fillStyle = PALETTE[i % PALETTE.length];
        ctx.fillRect(x, 5 + row * 24, width, 18);
        x += width;
      });
    });
  }

  dayPicker(dateSelect, streamSelect, loadDay).then((data) => {
    if (!data.dates.length) {
      empty.hidden = false;
      empty.textContent = `No rollup tables in ${data.directory} yet: run "taproom spark rollup --out ${data.directory}".`;
    }
  }).catch((err) => { empty.hidden = false; empty.textContent = "error: " + err.message; });
})();
