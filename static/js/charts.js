// Draws the Plotly figures the server built: <div data-figure="ID"> + <script id="ID" type="application/json">.
// A div with data-metrics-url polls a job's metrics while the job runs.
(function () {
  function draw(div, figure) {
    if (!window.Plotly || !figure) return;
    window.Plotly.react(div, figure.data, figure.layout, { responsive: true, displaylogo: false });
  }
  function drawStatic() {
    document.querySelectorAll("[data-figure]").forEach(function (div) {
      var source = document.getElementById(div.dataset.figure);
      if (!source) return;
      var figure = JSON.parse(source.textContent);
      draw(div, typeof figure === "string" ? JSON.parse(figure) : figure);  // a figure sent as JSON text
    });
  }
  function pollMetrics(div) {
    var status = document.getElementById(div.dataset.statusId);
    function tick() {
      fetch(div.dataset.metricsUrl, { credentials: "same-origin" })
        .then(function (r) { return r.json(); })
        .then(function (m) {
          if (m.figure) { div.hidden = false; draw(div, m.figure); }
          if (status) status.textContent = m.available ? (m.figure ? "" : "no metrics logged yet") : m.reason;
          if (!m.final) setTimeout(tick, 3000);
        })
        .catch(function (e) { if (status) status.textContent = "metrics unavailable: " + e; setTimeout(tick, 10000); });
    }
    tick();
  }
  document.addEventListener("DOMContentLoaded", function () {
    drawStatic();
    document.querySelectorAll("[data-metrics-url]").forEach(pollMetrics);
  });
})();
