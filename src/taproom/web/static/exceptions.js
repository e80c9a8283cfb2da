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
    // The API lists only minutes with an exception: the minutes between them are drawn as 0,
    // not bridged by a line (at most 1,440 a day).
    const first = data.minutes[0], last = data.minutes[data.minutes.length - 1];
    const minutes = [];
    for (let t = first; data.minutes.length && t <= last; t += 60) minutes.push(t);
    const at = new Map(minutes.map((t, i) => [t, i]));
    const series = {};
    for (const c of data.classes) {
      if (!c.series) continue;
      const counts = new Array(minutes.length).fill(0);
      c.series.forEach((n, i) => { counts[at.get(data.minutes[i])] = n; });
      series[c.exception] = counts;
    }
    perMinute.update(minutes, series);
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
