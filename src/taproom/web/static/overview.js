"use strict";
// Overview: the hub's last 15 minutes from /api/stats, refreshed every second.
(() => {
  const { el, getJSON, number, chart } = Console;
  const grid = document.getElementById("charts");
  const groups = [
    ["events_in/", "Events in per second, by protocol", ""],
    ["bytes_in/", "Bytes in per second, by protocol (journal records)", "B/s"],
    ["journal_bytes_in", "Bytes appended to the journal per second", "B/s"],
    ["connections/", "Open connections, by listener", ""],
    ["rejects/", "Rejects per second, by protocol and reason", ""],
    ["journal_end_offset", "Journal end offset", ""],
    ["journal_size_bytes", "Journal size", "B"],
    ["journal_segments", "Journal segments", ""],
    ["commit_p", "Commit latency (ms, p50 / p99)", "ms"],
    ["queue/", "Output queues (batches)", ""],
    ["lag/", "Output lag (events behind the journal end)", ""],
    ["pending_bytes", "Accepted, not yet committed", "B"],
  ];
  const charts = groups.map(([prefix, title, unit]) => ({ prefix, chart: chart(grid, title, { unit }) }));
  let times = [], series = {};
  const LIMIT = 900;

  function merge(update) {
    const last = times.length ? times[times.length - 1] : -Infinity;
    update.t.forEach((t, i) => {
      if (t <= last) return;
      const at = times.length;
      times.push(t);
      for (const [name, values] of Object.entries(update.series)) {
        if (!series[name]) series[name] = new Array(at).fill(null);
        series[name].push(values[i]);
      }
      for (const values of Object.values(series)) if (values.length < times.length) values.push(null);
    });
    if (times.length > LIMIT) {
      const cut = times.length - LIMIT;
      times = times.slice(cut);
      for (const name of Object.keys(series)) series[name] = series[name].slice(cut);
    }
  }

  function draw() {
    for (const { prefix, chart } of charts) {
      const columns = {};
      for (const [name, values] of Object.entries(series)) {
        if (name === prefix || (prefix.endsWith("/") || prefix === "commit_p") && name.startsWith(prefix)) {
          columns[name.includes("/") ? name.slice(prefix.length) || name : name] = values;
        }
      }
      if (!Object.keys(columns).length) columns["(none yet)"] = times.map(() => null);
      chart.update(times, columns);
    }
  }

  function showReady(overview) {
    const ready = document.getElementById("ready");
    const status = document.getElementById("hub-status");
    ready.replaceChildren();
    if (overview.ready.ready) {
      ready.append(el("span", { className: "ok" }, "Ready: "), "the hub takes and stores events normally.");
      status.replaceChildren(el("span", { className: "ok" }, "● ready"));
    } else {
      ready.append(el("span", { className: "bad" }, "Not ready: "),
        "the hub says " + overview.ready.reasons.join("; ") + ".");
      status.replaceChildren(el("span", { className: "bad" }, "● not ready"));
    }
    const body = document.querySelector("#listeners tbody");
    body.replaceChildren(...Object.entries(overview.listeners).sort().map(([name, address]) =>
      el("tr", {}, el("td", {}, name), el("td", { className: "mono" }, address),
        el("td", { className: "num" }, number(overview.latest["connections/" + name])))));
  }

  async function tick(seconds) {
    try {
      const [stats, overview] = await Promise.all([
        getJSON(`/api/stats?seconds=${seconds}`), getJSON("/api/overview")]);
      merge(stats);
      draw();
      showReady(overview);
    } catch (err) {
      document.getElementById("hub-status").replaceChildren(el("span", { className: "bad" }, "● " + err.message));
    }
  }
  tick(LIMIT).then(() => setInterval(() => tick(5), 1000));
})();
