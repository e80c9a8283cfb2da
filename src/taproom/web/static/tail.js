"use strict";
// Live tail: committed events over a WebSocket, filtered by the hub; skips are shown.
(() => {
  const { el, getJSON, number } = Console;
  const form = document.getElementById("filters");
  const body = document.querySelector("#events tbody");
  const skippedNote = document.getElementById("skipped");
  const state = document.getElementById("state");
  const pauseButton = document.getElementById("pause");
  const MAX_ROWS = 500;
  let socket = null, paused = false, held = [], skipped = 0, heldDropped = 0;

  function row(event) {
    const when = new Date(event.received_ms).toISOString().replace("T", " ").slice(0, 23);
    return el("tr", { className: "clickable", dataset: { offset: event.offset },
                      onclick: () => showRecord(event.offset) },
      el("td", { className: "num" }, event.offset), el("td", { className: "mono" }, when),
      el("td", {}, event.protocol), el("td", {}, event.stream), el("td", {}, event.topic),
      el("td", { className: "preview mono", title: event.preview }, event.preview));
  }

  function show(events) {
    for (const event of events) body.prepend(row(event));
    while (body.rows.length > MAX_ROWS) body.deleteRow(body.rows.length - 1);
  }

  function noteSkipped() {
    if (!skipped && !heldDropped) { skippedNote.hidden = true; return; }
    skippedNote.hidden = false;
    skippedNote.textContent = `${number(skipped + heldDropped)} events skipped ` +
      "(the page or the hub's live-tail budget could not keep up; the journal still has them)";
  }

  async function showRecord(offset) {
    const pre = document.getElementById("record");
    try {
      const record = await getJSON(`/api/record?offset=${encodeURIComponent(offset)}`);
      pre.textContent = JSON.stringify(record, null, 2);
    } catch (err) {
      pre.textContent = "error: " + err.message;
    }
    pre.hidden = false;
    document.getElementById("record-hint").hidden = true;
  }

  function connect() {
    if (socket) socket.close();
    body.replaceChildren();
    skipped = heldDropped = 0; held = [];
    noteSkipped();
    const query = new URLSearchParams();
    for (const [key, value] of new FormData(form)) if (value) query.set(key, value);
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    socket = new WebSocket(`${scheme}://${location.host}/api/tail?${query}`);
    socket.binaryType = "arraybuffer";
    state.textContent = "connecting…";
    socket.onopen = () => { state.textContent = "following committed events"; };
    socket.onclose = () => { state.textContent = "disconnected (Apply reconnects)"; };
    socket.onmessage = (message) => {
      const data = JSON.parse(new TextDecoder().decode(message.data));
      skipped += data.skipped;
      if (paused) {
        held.push(...data.events);
        if (held.length > MAX_ROWS) { heldDropped += held.length - MAX_ROWS; held = held.slice(-MAX_ROWS); }
      } else {
        show(data.events);
      }
      noteSkipped();
      state.textContent = `${paused ? "paused" : "following"}; journal end offset ${number(data.end_offset)}`;
    };
  }

  form.addEventListener("submit", (e) => { e.preventDefault(); connect(); });
  pauseButton.addEventListener("click", () => {
    paused = !paused;
    pauseButton.textContent = paused ? "Resume" : "Pause";
    if (!paused) { show(held); held = []; }
  });
  connect();
})();
