"use strict";
// Exceptions: the classes of a day by count, a per-minute chart of the most frequent, each
// class linking to its failed requests (the Errors page) and to sample requests.
(() => {
  const { el, getJSON, number, chart, requestHref, dayPicker } = Console;
  const dateSelect = document.getElementById("date");
  const streamSelect = document.getElementById("stream");
  const empty = document.getElementById("empty");
  const perMinute = chart(document.getElementById("charts"), "Exceptions per minute (the most frequent classes)");

  async function load(date, stream) {
    const data = await getJSON(`/api/exceptions?${new URLSearchParams({ date, stream })}`);
    const series = {};
    for (const c of data.classes) if (c.series) series[c.exception] = c.series;
    perMinute.update(data.minutes, series);
    document.getElementById("summary").textContent =
      `${number(data.class_count || 0)} exception classes; click one for its failed requests.`;
    document.querySelector("#classes tbody").replaceChildren(...data.classes.map((c) => {
      const errors = "/errors?" + new URLSearchParams({ date, stream, exception: c.exception });
      const samples = c.samples.slice(0, 5).map((ref) =>
        el("a", { href: requestHref(ref), className: "mono sample" }, ref.request_id || `offset ${ref.offset}`));
      return el("tr", {},
        el("td", { className: "mono" }, el("a", { href: errors }, c.exception)),
        el("td", { className: "num" }, number(c.count)),
        el("td", { className: "mono" }, c.actions.map(([a, n]) => `${a} (${number(n)})`).join(", ")),
        el("td", {}, ...samples));
    }));
  }

  dayPicker(dateSelect, streamSelect, load).then((data) => {
    if (!data.dates.length) { empty.hidden = false; empty.textContent = `No rollup tables in ${data.directory} yet.`; }
  }).catch((err) => { empty.hidden = false; empty.textContent = "error: " + err.message; });
})();
