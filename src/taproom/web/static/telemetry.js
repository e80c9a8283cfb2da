"use strict";
// Telemetry: the registrar's taps, a live plot of chosen columns of one tap, and the kegs.
(() => {
  const { el, getJSON, number, bytes, chart } = Console;
  const tapSelect = document.getElementById("tap");
  const columnsBox = document.getElementById("columns");
  const grid = document.getElementById("charts");
  let taps = [], plot = null, next = null, times = [], values = {}, current = "";
  const KEEP = 2000;

  function iso(ns) {
    return ns === null ? "–" : new Date(ns / 1e6).toISOString().replace("T", " ").slice(0, 19);
  }

  async function loadTaps() {
    const data = await getJSON("/api/lager/taps");
    taps = data.taps;
    document.querySelector("#taps tbody").replaceChildren(...taps.map((tap) =>
      el("tr", {}, el("td", { className: "mono" }, tap.key), el("td", { className: "mono" }, tap.uuid),
        el("td", { className: "num" }, tap.sequence),
        el("td", {}, tap.items.map((i) => `${i.name}:${i.type}${i.count > 1 ? "[" + i.count + "]" : ""}`).join(", ")))));
    if (!data.enabled) {
      document.querySelector("#taps tbody").append(el("tr", {}, el("td", { colspan: 4 }, "The Lager service is not running.")));
    }
    const keys = taps.map((t) => t.key);
    if (keys.join("\u0000") !== [...tapSelect.options].map((o) => o.value).join("\u0000")) {
      tapSelect.replaceChildren(...keys.map((k) => el("option", { value: k }, k)));
      document.getElementById("plot-form").hidden = !keys.length;
      if (keys.length && !keys.includes(current)) chooseTap(keys[0]);
    }
  }

  function chooseTap(key) {
    current = key;
    tapSelect.value = key;
    const tap = taps.find((t) => t.key === key);
    const numeric = tap ? tap.items.filter((i) => i.numeric && i.count === 1) : [];
    columnsBox.replaceChildren(el("legend", {}, "columns"), ...numeric.map((item, i) =>
      el("label", {}, el("input", Object.assign({ type: "checkbox", value: item.name },
        i < 3 ? { checked: "" } : {})), item.name)));
    grid.replaceChildren();
    plot = chart(grid, `Tap ${key}`, { height: 260 });
    next = null; times = []; values = {};
  }

  function chosen() {
    return [...columnsBox.querySelectorAll("input:checked")].map((box) => box.value);
  }

  async function poll() {
    if (!current) return;
    const query = new URLSearchParams({ tap: current, limit: "2000" });
    if (next !== null) query.set("after", next);
    const data = await getJSON(`/api/lager/samples?${query}`);
    next = data.next;
    times.push(...data.t.map((ms) => ms / 1000));
    for (const [name, column] of Object.entries(data.columns)) {
      values[name] = (values[name] || []).concat(column);
    }
    if (times.length > KEEP) {
      const cut = times.length - KEEP;
      times = times.slice(cut);
      for (const name of Object.keys(values)) values[name] = values[name].slice(cut);
    }
    const columns = {};
    for (const name of chosen()) columns[name] = values[name] || times.map(() => null);
    if (Object.keys(columns).length) plot.update(times, columns);
  }

  async function loadKegs() {
    const data = await getJSON("/api/kegs");
    document.getElementById("keg-dir").textContent = `(${data.directory})`;
    document.querySelector("#kegs tbody").replaceChildren(...data.kegs.map((keg) =>
      el("tr", { className: "clickable", onclick: () => preview(keg.name) },
        el("td", { className: "mono" }, keg.name), el("td", { className: "num" }, bytes(keg.bytes)),
        el("td", { className: "num" }, number(keg.rows)), el("td", { className: "num" }, number(keg.taps)),
        el("td", { className: "mono" }, iso(keg.first_ns)), el("td", { className: "mono" }, iso(keg.last_ns)),
        el("td", {}, keg.problem))));
  }

  async function preview(name) {
    const data = await getJSON(`/api/kegs/preview?name=${encodeURIComponent(name)}&rows=20`);
    const title = document.getElementById("preview-title");
    title.hidden = false;
    title.textContent = `Preview of ${data.name}`;
    const names = [...new Set(data.rows.flatMap((r) => Object.keys(r.values)))];
    document.querySelector("#preview thead").replaceChildren(
      el("tr", {}, el("th", {}, "tap"), el("th", {}, "time"), ...names.map((n) => el("th", {}, n))));
    document.querySelector("#preview tbody").replaceChildren(...data.rows.map((r) =>
      el("tr", {}, el("td", { className: "mono" }, r.tap), el("td", { className: "mono" }, iso(r.ts_ns)),
        ...names.map((n) => el("td", { className: "num" }, r.values[n] === undefined ? "" : JSON.stringify(r.values[n]))))));
  }

  tapSelect.addEventListener("change", () => chooseTap(tapSelect.value));
  columnsBox.addEventListener("change", () => poll());
  const safely = (fn) => () => fn().catch((err) => {
    document.getElementById("hub-status").replaceChildren(el("span", { className: "bad" }, "● " + err.message));
  });
  safely(loadTaps)().then(safely(poll));
  safely(loadKegs)();
  setInterval(safely(loadTaps), 5000);
  setInterval(safely(poll), 1000);
  setInterval(safely(loadKegs), 10000);
})();
