// The pipeline run page: draws the DAG the server built (<div data-dag="ID"> + <script id="ID"
// type="application/json">), again after each htmx refresh; a click on a stage opens its job.
(function () {
  function draw() {
    var div = document.querySelector("[data-dag]");
    var source = div && document.getElementById(div.dataset.dag);
    if (!div || !source || !window.Plotly) return;
    var figure = JSON.parse(source.textContent);
    if (typeof figure === "string") figure = JSON.parse(figure);
    window.Plotly.react(div, figure.data, figure.layout, { responsive: true, displaylogo: false }).then(function () {
      div.on("plotly_click", function (event) {
        var url = event.points && event.points[0] && event.points[0].customdata;
        if (url) window.location.href = url;
      });
    });
  }
  document.addEventListener("DOMContentLoaded", draw);
  // The status partial replaces itself every few seconds while the run goes (and stops once it is over).
  document.addEventListener("htmx:afterSettle", draw);
})();
