// The fleet page's live part: /ws/fleet/ sends the nodes of this page; each row is patched in place.
window.hangarFleet = (function () {
  function esc(s) {
    return String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
  }
  function num(v, unit) { return v === null || v === undefined ? "–" : Math.round(v) + (unit || ""); }
  function ago(iso) {
    if (!iso) return "never";
    const s = Math.max(0, Math.round((Date.now() - Date.parse(iso)) / 1000));
    return s < 120 ? s + " s ago" : Math.round(s / 60) + " min ago";
  }
  function strip(gpus) {
    return gpus.map((g) => {
      const title = `GPU ${g.index}: ${num(g.util, "%")} · ${num(g.temp, "°C")} · ${num(g.power, " W")} · memory ${num(g.mem_pct, "%")}` +
        (g.errors.length ? " · " + g.errors.join(", ") : "");
      return `<span class="cell${g.errors.length ? " bad" : ""}" style="--u: ${num(g.util)}%" title="${esc(title)}">` +
        `<b>${num(g.util)}</b><i>${num(g.temp, "°")}</i>${g.errors.length ? "<em>" + esc(g.errors[0]) + "</em>" : ""}</span>`;
    }).join("");
  }
  function patch(node) {
    const row = document.querySelector(`tr[data-node="${CSS.escape(node.name)}"]`);
    if (!row) return;
    const state = row.querySelector('[data-field="state"]');
    state.textContent = node.state_label;
    state.className = "badge " + node.state_colour;
    row.querySelector('[data-field="gpus"]').innerHTML = strip(node.gpus);
    row.querySelector('[data-field="reason"]').textContent = node.state_reason;
    const hb = row.querySelector('[data-field="heartbeat"]');
    hb.dataset.at = node.heartbeat || "";
    hb.textContent = ago(node.heartbeat);
  }
  function follow(page) {
    const params = new URLSearchParams(location.search);
    params.set("page", page);
    const status = document.getElementById("fleet-live");
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws/fleet/?${params}`;
    const ws = new WebSocket(url);
    ws.onopen = () => { status.textContent = "live"; };
    ws.onmessage = (event) => {
      const message = JSON.parse(event.data);
      if (message.type === "nodes") {
        message.nodes.forEach(patch);
        document.querySelectorAll("[data-count]").forEach((chip) => {
          const n = message.counts[chip.dataset.count] || 0;
          chip.textContent = `${chip.dataset.label} ${n}`;
          chip.hidden = n === 0;
        });
        status.textContent = "live · updated " + new Date().toLocaleTimeString();
      }
    };
    ws.onclose = (event) => {
      if (event.code === 4401) { status.textContent = "signed out: reload the page to log in again"; return; }
      status.textContent = "live updates lost; reconnecting…";
      setTimeout(() => follow(page), 2000);
    };
  }
  // The page passes its number on the script's own tag (no inline script: the CSP forbids it).
  const me = document.currentScript;
  if (me && me.dataset.followPage) follow(Number(me.dataset.followPage));
  return { follow, patch };
})();
