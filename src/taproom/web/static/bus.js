"use strict";
// Event BUS: the Clone hashmap (latest event per topic); changed keys are highlighted.
(() => {
  const { el, getJSON, number } = Console;
  const form = document.getElementById("filters");
  const body = document.querySelector("#keys tbody");
  let seen = new Map(), first = true;

  async function refresh() {
    const subtree = new FormData(form).get("subtree") || "";
    try {
      const data = await getJSON(`/api/bus?subtree=${encodeURIComponent(subtree)}&limit=1000`);
      const summary = document.getElementById("summary");
      if (!data.enabled) { summary.textContent = "The Event BUS service is not running."; return; }
      summary.textContent = `${number(data.total)} keys` +
        (data.total > data.entries.length ? `, first ${data.entries.length} shown` : "");
      const next = new Map();
      body.replaceChildren(...data.entries.map((entry) => {
        next.set(entry.topic, entry.sequence);
        const fresh = !first && seen.get(entry.topic) !== entry.sequence;
        return el("tr", { className: fresh ? "fresh" : "" },
          el("td", { className: "mono" }, entry.topic), el("td", { className: "num" }, entry.sequence),
          el("td", {}, entry.producer), el("td", { className: "mono" }, entry.timestamp),
          el("td", { className: "num" }, entry.size),
          el("td", { className: "preview mono", title: entry.value }, entry.value));
      }));
      seen = next; first = false;
    } catch (err) {
      document.getElementById("summary").textContent = "error: " + err.message;
    }
  }
  form.addEventListener("submit", (e) => { e.preventDefault(); first = true; refresh(); });
  refresh();
  setInterval(refresh, 1000);
})();
