// Live log viewer for the job page.
//
// The server sends the stored lines that match our filters after our cursor
// (see README, "Websocket log stream"); on a dropped connection we reconnect
// with the same filters from the cursor, so no line is lost and none is shown
// twice. Rendering is virtualised: only the rows in view are in the DOM, so
// 100,000 lines scroll as smoothly as 100.
(function () {
  "use strict";
  const log = document.getElementById("log");
  if (!log) return;
  const ROW = 18;          // px per row; matches .log .line in hangar.css
  const OVERSCAN = 30;     // rows rendered above and below the view
  // Beyond this the oldest are dropped from the view (the download has all): HANGAR_LOG_VIEW_LINES.
  const MAX_LINES = Number(document.getElementById("log").dataset.maxLines) || 200000;
  const COLLAPSE_WINDOW = 2000;  // identical lines of several ranks are merged within this many rows

  const $ = (id) => document.getElementById(id);
  const spacer = log.querySelector(".log-spacer");
  const rowsEl = log.querySelector(".log-rows");
  const statusEl = $("log-status"), countEl = $("log-count");
  const follow = $("log-follow"), resume = $("log-resume"), collapse = $("log-collapse");
  const form = $("log-filters"), filterError = $("log-filter-error");
  const errorBar = $("log-first-error");
  const path = log.dataset.wsPath;
  const downloads = [$("log-download-text"), $("log-download-jsonl")];

  let lines = [];          // every line received for the current filters, in order
  let rows = [];           // what is shown: {line, ranks: Set, count}
  let dropped = 0;         // lines received but no longer kept in the view (past MAX_LINES)
  const truncatedEl = $("log-truncated");
  let recent = new Map();  // collapse: attempt + text -> row index
  let cursor = { attempt: 0, seq: 0 };
  let filters = {};
  let sub = 1;             // the subscription whose lines we show; null while one is being replaced
  let socket = null, finished = false, retryMs = 250, dirty = false, autoScroll = false;
  let firstError = null, pendingJump = null, multi = false;

  function setStatus(text) { statusEl.textContent = text; }

  function after(line) {
    return line.attempt > cursor.attempt || (line.attempt === cursor.attempt && line.seq > cursor.seq);
  }

  function addOption(select, value, label) {
    if (value === null || value === undefined) return;
    for (const option of select.options) if (option.value === String(value)) return;
    select.add(new Option(label, value));
  }

  function place(line) {
    if (collapse.checked) {
      const key = line.attempt + "\u0000" + line.text;
      const index = recent.get(key);
      if (index !== undefined && index >= rows.length - COLLAPSE_WINDOW && !rows[index].ranks.has(line.rank)) {
        rows[index].ranks.add(line.rank);
        rows[index].count += 1;
        return;
      }
      recent.set(key, rows.length);
    }
    rows.push({ line: line, ranks: new Set([line.rank]), count: 1 });
  }

  function rebuild() {
    rows = []; recent = new Map();
    for (const line of lines) place(line);
    dirty = true;
  }

  function appendLines(batch) {
    for (const line of batch) {
      if (!after(line)) continue;  // already shown
      cursor = { attempt: line.attempt, seq: line.seq };
      lines.push(line);
      if (line.rank > 0 || (lines[0] && line.node !== lines[0].node)) multi = true;
      addOption(form.elements.node, line.node, line.node);
      addOption(form.elements.attempt, line.attempt_number, "attempt " + line.attempt_number);
      place(line);
    }
    if (lines.length > MAX_LINES) {
      const kept = Math.floor(MAX_LINES * 0.9);
      dropped += lines.length - kept;
      lines = lines.slice(lines.length - kept);
      rebuild();
    }
    if (pendingJump) jumpTo(pendingJump);
    schedule();
  }

  function schedule() {
    dirty = true;
    window.requestAnimationFrame(render);
  }

  function render() {
    if (!dirty) return;
    dirty = false;
    spacer.style.height = rows.length * ROW + "px";
    const bottom = log.scrollHeight - log.clientHeight;
    if (follow.checked && Math.abs(log.scrollTop - bottom) > 1) { autoScroll = true; log.scrollTop = bottom; }
    const first = Math.max(0, Math.floor(log.scrollTop / ROW) - OVERSCAN);
    const last = Math.min(rows.length, Math.ceil((log.scrollTop + log.clientHeight) / ROW) + OVERSCAN);
    const fragment = document.createDocumentFragment();
    for (let i = first; i < last; i++) fragment.appendChild(rowElement(rows[i], i));
    rowsEl.style.transform = "translateY(" + first * ROW + "px)";
    rowsEl.replaceChildren(fragment);
    countEl.textContent = (dropped ? "the latest " : "") +
      lines.length.toLocaleString() + " line" + (lines.length === 1 ? "" : "s") +
      (rows.length !== lines.length ? " in " + rows.length.toLocaleString() + " rows" : "") +
      (dropped ? " of " + (lines.length + dropped).toLocaleString() + " (older ones are in the download)" : "");
    truncatedEl.hidden = !dropped;
  }

  function rowElement(row, index) {
    const line = row.line;
    const el = document.createElement("div");
    el.className = "line " + line.stream + " sev-" + line.severity.toLowerCase() + (line.fault ? " fault" : "");
    if (firstError && firstError.attempt === line.attempt && firstError.seq === line.seq) el.className += " first-error";
    el.dataset.seq = line.seq;
    el.dataset.index = index;
    el.title = line.severity + " · " + (line.node || "-") + " rank " + line.rank + " · attempt " + line.attempt_number +
      " · seq " + line.seq + " · " + line.ts;
    const time = document.createElement("span");
    time.className = "ts";
    time.textContent = line.ts.substring(11, 23) + " ";
    el.appendChild(time);
    if (multi) {
      const where = document.createElement("span");
      where.className = "where";
      where.textContent = row.count > 1 ? "×" + row.count + " ranks " : (line.node || "-") + "·r" + line.rank + " ";
      el.appendChild(where);
    }
    appendText(el, line.text, line.hl);
    return el;
  }

  function appendText(el, text, spans) {
    let at = 0;
    for (const [start, end] of spans || []) {
      if (start > at) el.appendChild(document.createTextNode(text.substring(at, start)));
      const mark = document.createElement("mark");
      mark.textContent = text.substring(start, end);
      el.appendChild(mark);
      at = end;
    }
    el.appendChild(document.createTextNode(text.substring(at)));
  }

  let shownState = null;  // the job and attempt state the cards were last refreshed for

  function showState(message) {
    // The state, attempts and cost cards follow the job as the socket reports it (their htmx
    // partials listen for this event), not only their own slower poll: the page may have been
    // drawn a moment before the job moved on, so the first report refreshes them too.
    const key = message.state + "/" + message.attempt_state + "/" + message.exit_code;
    if (key !== shownState) document.body.dispatchEvent(new Event("job-state-changed"));
    shownState = key;
    if (message.final) {
      finished = true;
      setStatus("job " + message.state + (message.exit_code !== null ? " (exit code " + message.exit_code + ")" : ""));
    }
  }

  function showFirstError(message) {
    if (firstError) return;  // the earliest attempt's comes first
    const line = message.line;
    firstError = line;
    errorBar.querySelector(".where").textContent =
      "(attempt " + line.attempt_number + ", " + (line.node || "-") + " rank " + line.rank + ", " + line.ts.substring(11, 19) + ")";
    errorBar.querySelector(".text").textContent = line.text;
    const telemetry = errorBar.querySelector(".telemetry");
    telemetry.hidden = !message.telemetry_url;
    if (message.telemetry_url) telemetry.href = message.telemetry_url;
    errorBar.hidden = false;
    schedule();
  }

  function jumpTo(target) {
    const index = rows.findIndex((r) => r.line.attempt === target.attempt && r.line.seq === target.seq);
    if (index < 0) return false;
    pendingJump = null;
    setFollow(false);
    log.scrollTop = Math.max(0, index * ROW - log.clientHeight / 3);
    schedule();
    return true;
  }

  function setFollow(on) {
    follow.checked = on;
    resume.hidden = on;
    if (on) schedule();
  }

  // --- the connection ------------------------------------------------------
  function query() {
    const params = new URLSearchParams(filters);
    params.set("after_attempt", cursor.attempt);
    params.set("after_seq", cursor.seq);
    return params.toString();
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    socket = new WebSocket(scheme + location.host + path + "?" + query());
    sub = 1;  // a new connection starts with the subscription of its URL
    socket.onopen = function () { retryMs = 250; setStatus(finished ? statusEl.textContent : "live"); };
    socket.onmessage = function (event) {
      const message = JSON.parse(event.data);
      if (message.type === "subscribed") { sub = message.sub; return; }
      if (message.type === "error") { filterError.textContent = message.field + ": " + message.message; return; }
      if (message.sub !== undefined && message.sub !== sub) return;  // from a replaced subscription
      if (message.type === "lines") {
        appendLines(message.lines);
        if (after(message.cursor)) cursor = message.cursor;
      } else if (message.type === "state") showState(message);
      else if (message.type === "first_error") showFirstError(message);
    };
    socket.onclose = function (event) {
      socket = null;
      if (finished) return;
      // The server's refusals (portal/wsauth.py): reconnecting cannot help, except once streams free up.
      if (event.code === 4401) { setStatus("signed out: reload the page to log in again"); return; }
      if (event.code === 4404) { setStatus("this job is no longer in your projects"); return; }
      if (event.code === 4429) { setStatus("too many open log streams; retrying…"); setTimeout(connect, 5000); return; }
      setStatus("reconnecting…");
      setTimeout(connect, retryMs);
      retryMs = Math.min(retryMs * 2, 5000);
    };
  }

  function readFilters() {
    const out = {};
    for (const el of form.elements) {
      if (!el.name || (el.type === "checkbox" && !el.checked) || el.value.trim() === "") continue;
      out[el.name] = el.type === "datetime-local" ? new Date(el.value).toISOString() : el.value.trim();
    }
    return out;
  }

  function applyFilters() {
    filters = readFilters();
    filterError.textContent = "";
    lines = []; cursor = { attempt: 0, seq: 0 }; multi = false; dropped = 0;
    rebuild();
    setFollow(true);
    for (const link of downloads) {
      const params = new URLSearchParams(filters);
      params.set("as", link.id.endsWith("jsonl") ? "jsonl" : "text");
      link.href = link.href.split("?")[0] + "?" + params.toString();
    }
    if (socket && socket.readyState === WebSocket.OPEN) {
      sub = null;  // until the server says which subscription is ours
      socket.send(JSON.stringify({ type: "subscribe", filters: filters, cursor: cursor }));
    } else {
      // Not connected (yet): (re)connect with the new filters in the URL.
      finished = false;
      if (socket) socket.close(); else connect();
    }
  }

  form.addEventListener("submit", function (event) { event.preventDefault(); applyFilters(); });
  form.addEventListener("change", function (event) {
    if (event.target.tagName === "SELECT" || event.target.type === "checkbox") applyFilters();
  });
  $("log-clear").addEventListener("click", function () { form.reset(); applyFilters(); });
  collapse.addEventListener("change", rebuild);
  collapse.addEventListener("change", schedule);
  resume.addEventListener("click", function () { setFollow(true); });
  follow.addEventListener("change", function () { setFollow(follow.checked); });
  errorBar.querySelector(".jump").addEventListener("click", function () {
    if (!firstError || jumpTo(firstError)) return;
    // Not in the current view: show the whole attempt, then jump when it arrives.
    pendingJump = { attempt: firstError.attempt, seq: firstError.seq };
    form.reset();
    form.elements.attempt.value = String(firstError.attempt_number);
    applyFilters();
  });
  // The diagnosis panel's "Jump to evidence" (it is swapped by htmx: listen on the document).
  document.addEventListener("click", function (event) {
    const link = event.target.closest && event.target.closest("a.jump-evidence");
    if (!link) return;
    event.preventDefault();
    const target = { attempt: Number(link.dataset.attempt), seq: Number(link.dataset.seq) };
    if (jumpTo(target)) return;
    pendingJump = target;
    form.reset();
    form.elements.attempt.value = link.dataset.attemptNumber;
    applyFilters();
  });
  log.addEventListener("scroll", function () {
    if (autoScroll) { autoScroll = false; } else {
      // Scrolling up pauses follow; scrolling back to the bottom resumes it.
      const atBottom = log.scrollHeight - log.scrollTop - log.clientHeight < ROW;
      if (atBottom !== follow.checked) setFollow(atBottom);
    }
    dirty = true;
    window.requestAnimationFrame(render);
  });
  for (const select of [form.elements.node]) {  // the template may list a node twice
    const seen = new Set();
    for (const option of Array.from(select.options)) {
      if (seen.has(option.value)) option.remove(); else seen.add(option.value);
    }
  }
  connect();
})();
