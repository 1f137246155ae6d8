// Live log viewer for the job page. The server sends stored lines after our
// cursor; on a dropped connection we reconnect from the cursor, so no line is
// lost and none is shown twice.
(function () {
  "use strict";
  const log = document.getElementById("log");
  if (!log) return;
  const statusEl = document.getElementById("log-status");
  const follow = document.getElementById("log-follow");
  const path = log.dataset.wsPath;
  let cursor = { attempt: 0, seq: 0 };
  let finished = false;
  let retryMs = 250;

  function setStatus(text) { statusEl.textContent = text; }

  function after(line) {
    return line.attempt > cursor.attempt || (line.attempt === cursor.attempt && line.seq > cursor.seq);
  }

  function appendLines(lines) {
    const fragment = document.createDocumentFragment();
    for (const line of lines) {
      if (!after(line)) continue;  // already shown
      cursor = { attempt: line.attempt, seq: line.seq };
      const row = document.createElement("div");
      row.className = "line " + line.stream + " sev-" + line.severity.toLowerCase();
      row.dataset.seq = line.seq;
      const time = document.createElement("span");
      time.className = "ts";
      time.textContent = line.ts.substring(11, 23) + " ";
      row.appendChild(time);
      row.appendChild(document.createTextNode(line.text));
      fragment.appendChild(row);
    }
    log.appendChild(fragment);
    if (follow.checked) log.scrollTop = log.scrollHeight;
  }

  function showState(message) {
    const badge = document.getElementById("job-state");
    if (badge && badge.dataset.state !== message.state) {
      document.body.dispatchEvent(new Event("job-state-changed"));
    }
    if (message.final) {
      finished = true;
      setStatus("job " + message.state + (message.exit_code !== null ? " (exit code " + message.exit_code + ")" : ""));
    }
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const url = scheme + location.host + path + "?after_attempt=" + cursor.attempt + "&after_seq=" + cursor.seq;
    const socket = new WebSocket(url);
    socket.onopen = function () { retryMs = 250; setStatus("live"); };
    socket.onmessage = function (event) {
      const message = JSON.parse(event.data);
      if (message.type === "lines") appendLines(message.lines);
      else if (message.type === "state") showState(message);
    };
    socket.onclose = function () {
      if (finished) return;
      setStatus("reconnecting…");
      setTimeout(connect, retryMs);
      retryMs = Math.min(retryMs * 2, 5000);
    };
  }

  log.addEventListener("scroll", function () {
    // Scrolling up pauses follow; scrolling back to the bottom resumes it.
    const atBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 4;
    follow.checked = atBottom;
  });
  connect();
})();
