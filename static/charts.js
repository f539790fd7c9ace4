/* qkov charts.js: draws every [data-plotly] element from the figure JSON inside it, on load and after each
 * htmx swap; exports tables as CSV; submits [data-autosubmit] forms on change. No page fetches its own JSON:
 * the data arrives inside the HTML fragment.
 *
 * <div class="chart" data-plotly data-name="ov-spectrum-L1H4">
 *   <script type="application/json">{"data": [...], "layout": {...}, "links": {"0": [...]}}</script>
 * </div>
 * `links` (optional, by trace index): the URL opened when a point is clicked; a list for bar/scatter
 * traces (by point number) or a list of rows for a heatmap (links[row][col]).
 */
(function () {
  "use strict";

  var SVG_ICON = {
    width: 1000, height: 1000,
    path: "M100 100h800v800h-800z M200 650l200-250 150 180 100-120 150 190z"
  };

  var LINK_ICON = {
    width: 1000, height: 1000,
    path: "M420 580l160-160M350 470l-90 90a110 110 0 0 0 155 155l90-90M650 530l90-90a110 110 0 0 0-155-155l-90 90"
  };

  /* The address of a chart on its page (the page's URL, #the chart's id), copied and shown under the chart. */
  function shareLink(el) {
    if (!el.id) el.id = "chart-" + (el.dataset.name || "figure");
    var url = window.location.href.split("#")[0] + "#" + el.id;
    if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(url).catch(function () {});
    var box = el.querySelector(".chart-link");
    if (!box) {
      box = document.createElement("p");
      box.className = "chart-link note";
      el.appendChild(box);
    }
    box.textContent = "Link to this chart: ";
    var a = document.createElement("a");
    a.href = url; a.textContent = url;
    box.appendChild(a);
  }

  function figureOf(el) {
    var script = el.querySelector('script[type="application/json"]');
    return script ? JSON.parse(script.textContent) : null;
  }

  function linkFor(fig, point) {
    var byTrace = fig.links && fig.links[String(point.curveNumber)];
    if (!byTrace) return null;
    var idx = point.pointIndex !== undefined ? point.pointIndex : point.pointNumber;
    if (Array.isArray(idx)) return (byTrace[idx[0]] || [])[idx[1]] || null;
    return byTrace[idx] || null;
  }

  function draw(el) {
    if (el.dataset.drawn === "1" || typeof Plotly === "undefined") return;
    var fig = figureOf(el);
    if (!fig) return;
    el.dataset.drawn = "1";
    var name = el.dataset.name || "qkov-chart";
    var target = document.createElement("div");
    target.className = "chart-canvas";
    // a figure with its own height sizes its box (no blank band under a short heatmap in a tall box)
    if (fig.layout && fig.layout.height) {
      el.style.minHeight = target.style.minHeight = fig.layout.height + "px";
    }
    el.appendChild(target);
    var layout = Object.assign({
      margin: { l: 60, r: 20, t: 36, b: 48 },
      font: { family: "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif", size: 12 },
      paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)"
    }, fig.layout || {});
    var config = {
      responsive: true, displaylogo: false,
      toImageButtonOptions: { format: "png", filename: name, scale: 2 },
      // plotly's "Share chart…" uploads to Plotly Cloud (no destination here, so it did nothing): removed, and a
      // link to this chart on this page offered instead
      modeBarButtonsToRemove: ["lasso2d", "select2d", "sendChartToCloud", "sendDataToCloud"],
      modeBarButtonsToAdd: [{
        name: "Download plot as SVG", icon: SVG_ICON,
        click: function (gd) { Plotly.downloadImage(gd, { format: "svg", filename: name }); }
      }, {
        name: "Link to this chart", icon: LINK_ICON,
        click: function () { shareLink(el); }
      }]
    };
    Plotly.newPlot(target, fig.data || [], layout, config).then(function (gd) {
      if (!fig.links) return;
      gd.classList.add("clickable");
      gd.on("plotly_click", function (ev) {
        var url = ev.points && ev.points.length ? linkFor(fig, ev.points[0]) : null;
        if (url) window.location.assign(url);
      });
    });
  }

  function drawAll(root) {
    (root || document).querySelectorAll("[data-plotly]").forEach(draw);
    if (root && root.matches && root.matches("[data-plotly]")) draw(root);
  }

  /* CSV export of a table: cells' data-value (raw token text, full-precision numbers) or their text. */
  function csvCell(cell) {
    var v = cell.hasAttribute("data-value") ? cell.getAttribute("data-value") : cell.textContent.trim();
    return /[",\n\r]/.test(v) || /^\s|\s$/.test(v) ? '"' + v.replace(/"/g, '""') + '"' : v;
  }

  function exportCsv(button) {
    var table = document.getElementById(button.dataset.csv);
    if (!table) return;
    var lines = [];
    table.querySelectorAll("tr").forEach(function (tr) {
      var cells = [];
      tr.querySelectorAll("th, td").forEach(function (c) { cells.push(csvCell(c)); });
      lines.push(cells.join(","));
    });
    var blob = new Blob([lines.join("\r\n") + "\r\n"], { type: "text/csv;charset=utf-8" });
    var a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = (button.dataset.filename || button.dataset.csv) + ".csv";
    document.body.appendChild(a);
    a.click();
    setTimeout(function () { URL.revokeObjectURL(a.href); a.remove(); }, 0);
  }

  document.addEventListener("click", function (ev) {
    var button = ev.target.closest && ev.target.closest("button[data-csv]");
    if (button) { ev.preventDefault(); exportCsv(button); }
    var copy = ev.target.closest && ev.target.closest("button[data-copy]");  // "copy as Python"
    var code = copy && document.getElementById(copy.dataset.copy);
    if (code && navigator.clipboard) {
      navigator.clipboard.writeText(code.textContent).then(function () { copy.textContent = "Copied"; }, function () {});
    }
  });

  /* Forms that submit themselves when a picker changes (the submit button stays for no-JS use). */
  document.addEventListener("change", function (ev) {
    var form = ev.target.closest && ev.target.closest("form[data-autosubmit]");
    if (form && ev.target.matches("select, input[type=checkbox], input[type=radio]")) form.requestSubmit();
  });

  /* An error answer (4xx/5xx, the server's _error.html fragment) goes into the results of the panel that
   * asked, keeping its form, instead of replacing the whole panel; the server sends HX-Push-Url: false. */
  document.addEventListener("htmx:beforeSwap", function (ev) {
    var d = ev.detail;
    if (!d.xhr || d.xhr.status < 400 || !d.target || !d.target.querySelector) return;
    if (d.target.id && String(d.serverResponse).indexOf('id="' + d.target.id + '"') !== -1) return;  // a whole panel
    var asker = d.requestConfig && d.requestConfig.elt && d.requestConfig.elt.closest ? d.requestConfig.elt.closest(".panel") : null;
    var body = (asker && asker.querySelector(".panel-body")) || d.target.querySelector(".panel-body");
    if (body) { d.target = body; d.swapOverride = "innerHTML"; }
    /* a lazily loaded panel selects its own block from the answer (hx-select): an error fragment has none, so
     * select the error itself, or the panel would empty (a 503 "busy" used to leave nothing) */
    if (String(d.serverResponse).indexOf('class="error"') !== -1) d.selectOverride = ".error";
  });
  document.addEventListener("htmx:sendError", function (ev) {
    var elt = ev.detail && ev.detail.target;
    var body = elt && elt.querySelector ? elt.querySelector(".panel-body") || elt : null;
    if (!body) return;
    var box = document.createElement("div");
    box.className = "error"; box.setAttribute("role", "alert");
    box.textContent = "The server did not answer (network error). Try again.";
    body.prepend(box);
  });

  document.addEventListener("DOMContentLoaded", function () { drawAll(document); });
  document.addEventListener("htmx:load", function (ev) { drawAll(ev.detail && ev.detail.elt); });
  document.addEventListener("htmx:afterSwap", function (ev) { drawAll(ev.detail && ev.detail.target); });
  document.addEventListener("htmx:historyRestore", function () { drawAll(document); });
})();
