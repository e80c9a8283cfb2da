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
  // appear as new names show up.
  function chart(container, title, { unit = "", stacked = false, height = 200 } = {}) {
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

  return { el, getJSON, number, bytes, nav, chart, PALETTE };
})();

document.addEventListener("DOMContentLoaded", Console.nav);
