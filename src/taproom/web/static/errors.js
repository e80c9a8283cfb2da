"use strict";
// Errors: the failed requests of a day (status >= 500, severity >= error or an exception),
// filtered by action, status and exception class; the filters are kept in the address.
(() => {
  const { el, getJSON, number, requestRows, dayPicker } = Console;
  const dateSelect = document.getElementById("date");
  const streamSelect = document.getElementById("stream");
  const filters = { action: document.getElementById("action"), status: document.getElementById("status"),
                    exception: document.getElementById("exception") };
  const empty = document.getElementById("empty");
  const summary = document.getElementById("summary");
  const wanted = new URLSearchParams(location.search);

  function facet(select, pairs, chosen) {
    const options = [el("option", { value: "" }, "any")].concat(pairs.map(([value, n]) =>
      el("option", { value: String(value) }, `${value} (${number(n)})`)));
    select.replaceChildren(...options);
    select.value = pairs.some(([value]) => String(value) === chosen) ? chosen : "";
  }

  async function load() {
    const query = new URLSearchParams({ date: dateSelect.value, stream: streamSelect.value, limit: "500" });
    for (const [name, select] of Object.entries(filters)) {
      const value = wanted.has(name) ? wanted.get(name) : select.value;
      if (value) query.set(name, value);
    }
    const data = await getJSON(`/api/requests/errors?${query}`);
    for (const [name, select] of Object.entries(filters)) {
      const chosen = query.get(name) || "";
      facet(select, data.facets[name === "status" ? "statuses" : name + "s"], chosen);
    }
    wanted.delete("action"); wanted.delete("status"); wanted.delete("exception");
    const address = new URLSearchParams(location.search);
    for (const name of Object.keys(filters)) {
      if (query.get(name)) address.set(name, query.get(name)); else address.delete(name);
    }
    history.replaceState(null, "", "?" + address);
    requestRows(document.querySelector("#errors tbody"), data.requests);
    const lost = data.failed_count - data.failed_kept;
    summary.textContent = `${number(data.failed_count)} failed requests this day, ${number(data.failed_kept)} kept` +
      (lost > 0 ? ` (${number(lost)} not kept: a bounded number per minute and action)` : "") +
      `; ${number(data.matched)} match, ${number(data.requests.length)} shown (newest first).`;
  }

  for (const select of Object.values(filters)) select.addEventListener("change", () => load().catch(show));
  function show(err) { empty.hidden = false; empty.textContent = "error: " + err.message; }
  dayPicker(dateSelect, streamSelect, load).then((data) => {
    if (!data.dates.length) { empty.hidden = false; empty.textContent = `No rollup tables in ${data.directory} yet.`; }
  }).catch(show);
})();
