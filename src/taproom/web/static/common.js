"use strict";
// Helpers shared by the console pages. Every value from the hub is attacker-controlled (log
// payloads, topics, tap names): it reaches the page only as text nodes, never as markup.

const Console = (() => {
  const PALETTE = ["#e0a030", "#4fa3e0", "#4caf50", "#e05050", "#b07ee0", "#40c0b0",
                   "#e07a40", "#a0a0a0", "#d0d040", "#e060a0"];

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (key === "className") node.className = value;
      else if (key === "title") node.title = String(value);
      else if (key === "onclick") node.addEventListener("click", value);
      else if (key === "dataset") Object.assign(node.dataset, value);
      else node.setAttribute(key, String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  async function getJSON(url) {
    const response = await fetch(url, { credentials: "same-origin" });
    if (response.status === 401) { location.href = "/login"; throw new Error("sign in"); }
    const body = await response.json();
    if (!response.ok) throw new Error(body.reason || response.statusText);
    return body;
  }

  function number(value, digits = 0) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    return Number(value).toLocaleString("en-US", { maximumFractionDigits: digits });
  }

  const COMPACT = new Intl.NumberFormat("en-US", { notation: "compact", maximumFractionDigits: 2 });
  function compact(value) {
    if (value === null || value === undefined) return "";
    return Math.abs(value) >= 1000 ? COMPACT.format(value) : String(Number(value.toPrecision(4)));
  }

  function bytes(value) {
    if (value === null || value === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let v = Number(value), i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return `${v.toFixed(i ? 1 : 0)} ${units[i]}`;
  }

  function nav() {
    for (const link of document.querySelectorAll("header nav a")) {
      if (link.getAttribute("href") === location.pathname) link.classList.add("active");
    }
  }

  // A live uPlot chart in `container`: update(times, {name: values}) redraws it; series
  // appear as new names show up. With `onpick`, a click on the plot calls onpick(time) with
  // the time of the point under the cursor (the drill-down from a chart minute).
  function chart(container, title, { unit = "", stacked = false, height = 200, onpick = null } = {}) {
    const card = el("div", { className: "card" }, el("h3", {}, title));
    const holder = el("div", { className: "chart" });
    card.append(holder);
    container.append(card);
    let plot = null, names = [];
    function build(keys) {
      if (plot) plot.destroy();
      names = keys;
      const series = [{}].concat(keys.map((name, i) => ({
        label: name, stroke: PALETTE[i % PALETTE.length], width: 1.5,
        fill: stacked ? PALETTE[i % PALETTE.length] + "40" : undefined,
        value: (u, v) => v === null || v === undefined ? "–" : number(v, 2) + (unit ? " " + unit : ""),
      })));
      plot = new uPlot({
        width: Math.max(holder.clientWidth, 300), height,
        series, scales: { x: { time: true } },
        axes: [{ stroke: "#8b97a3", grid: { stroke: "#2a333c" } },
               { stroke: "#8b97a3", grid: { stroke: "#2a333c" }, size: 60,
                 values: (u, ticks) => ticks.map(compact) }],
        legend: { live: false },
      }, [[]].concat(keys.map(() => [])), holder);
      if (onpick) {
        plot.over.classList.add("pickable");
        plot.over.addEventListener("click", () => {
          const i = plot.cursor.idx;
          if (i !== null && i !== undefined && plot.data[0][i] !== undefined) onpick(plot.data[0][i]);
        });
      }
    }
    return {
      card,
      update(times, columns) {
        const keys = Object.keys(columns).sort();
        if (!plot || keys.join("\u0000") !== names.join("\u0000")) build(keys);
        plot.setData([times].concat(keys.map((k) => columns[k])));
      },
      canvas() { return holder.querySelector("canvas"); },
    };
  }

  // "YYYY-MM-DD HH:MM:SS" (UTC) of epoch milliseconds.
  function when(ms, seconds = true) {
    if (ms === null || ms === undefined) return "–";
    return new Date(ms).toISOString().replace("T", " ").slice(0, seconds ? 19 : 16);
  }

  // The Request page's address for a drill-down row: by id, with where it is stored (the
  // page checks the two agree). Built from a fixed path and URLSearchParams: always same-site.
  function requestHref(row) {
    const query = new URLSearchParams();
    if (row.request_id) query.set("id", row.request_id);
    if (row.journal) query.set("journal", row.journal);
    if (row.offset !== null && row.offset !== undefined) query.set("offset", String(row.offset));
    return "/request?" + query;
  }

  const LEVELS = ["debug", "info", "warn", "error", "fatal", "unknown"];
  function level(severity) {
    return LEVELS[severity] || "unknown";
  }

  // A table body of drill-down rows (request_samples): each row links to its Request page.
  function requestRows(tbody, rows, { showAction = true } = {}) {
    tbody.replaceChildren(...rows.map((r) => {
      const link = el("a", { href: requestHref(r), className: "mono" }, r.request_id || `offset ${r.offset}`);
      const flags = [r.slow ? "slow" : "", r.failed ? "failed" : ""].filter(Boolean).join(", ");
      return el("tr", {},
        el("td", { className: "mono" }, when(r.started)),
        showAction ? el("td", { className: "mono" }, r.action) : null,
        el("td", { className: "num" + (r.code >= 500 ? " bad" : "") }, r.code),
        el("td", { className: "num" }, number(r.total_time, 1)),
        el("td", { className: "level-" + level(r.severity) }, level(r.severity)),
        el("td", { className: "mono" }, (r.exceptions || []).join(", ")),
        el("td", {}, r.host || ""),
        el("td", {}, flags),
        el("td", {}, link));
    }));
  }

  // The date and app-env selects of the rollup pages, kept in the page's address so a link
  // (or a reload) opens the same day. onchange(date, stream) runs once both are known.
  function dayPicker(dateSelect, streamSelect, onchange) {
    const wanted = new URLSearchParams(location.search);
    function options(select, values, chosen) {
      select.replaceChildren(...values.map((v) => el("option", { value: v }, v)));
      if (values.includes(chosen)) select.value = chosen;
    }
    function remember() {
      const query = new URLSearchParams(location.search);
      query.set("date", dateSelect.value);
      query.set("stream", streamSelect.value);
      history.replaceState(null, "", "?" + query);
    }
    async function load(date) {
      const data = await getJSON(`/api/requests/apps?date=${encodeURIComponent(date || "")}`);
      options(dateSelect, data.dates, data.date);
      options(streamSelect, data.streams.map((s) => s.stream), wanted.get("stream") || streamSelect.value);
      wanted.delete("stream");
      if (!data.dates.length || !data.streams.length) return data;
      remember();
      await onchange(dateSelect.value, streamSelect.value);
      return data;
    }
    dateSelect.addEventListener("change", () => load(dateSelect.value));
    streamSelect.addEventListener("change", () => { remember(); onchange(dateSelect.value, streamSelect.value); });
    return load(wanted.get("date") || "");
  }

  return { el, getJSON, number, bytes, nav, chart, when, requestHref, level, requestRows, dayPicker, PALETTE };
})();

document.addEventListener("DOMContentLoaded", Console.nav);
