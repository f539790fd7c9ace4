/* qkov small_multiples.js: every head of a layer as a small picture of its attention pattern (CircuitsVis's
 * "attention heads" view), with one shared hover.
 *
 * <div data-small-multiples> holds the data (<script type="application/x-qkov-text+json">: tokens and
 * heads {name: pattern [query][key]}, app/charts.py attention_text). Hovering a token of the strip picks that
 * query in every head (its row is outlined) and the tooltip lists, per head, the key it attends to most and the
 * weight; hovering a cell (query i, key j) of any head outlines that cell in every head and the tooltip lists
 * each head's weight A[i, j]. Text is set with textContent only (token strings are never markup).
 */
(function () {
  "use strict";

  var SIZE = 150;  // CSS px of each head's picture

  function shade(v, max) {  // white -> dark blue, as the heat maps' sequential scale
    var t = max > 0 ? Math.max(0, Math.min(1, v / max)) : 0;
    return [Math.round(255 - 247 * t), Math.round(255 - 207 * t), Math.round(255 - 148 * t)];
  }

  function label(tokens, i) { return JSON.stringify(tokens[i].text) + " [" + i + "]"; }

  function draw(el) {
    if (el.dataset.drawn === "1") return;
    var script = el.querySelector('script[type="application/x-qkov-text+json"]');
    if (!script) return;
    el.dataset.drawn = "1";
    var data = JSON.parse(script.textContent);
    var names = Object.keys(data.heads), tokens = data.tokens, n = tokens.length;
    var grid = el.querySelector(".sm-grid"), strip = el.querySelector(".sm-tokens"), tip = el.querySelector(".sm-tooltip");
    var ratio = window.devicePixelRatio || 1;
    var pictures = names.map(function (name) {
      var pattern = data.heads[name];
      var max = 0;
      pattern.forEach(function (row) { row.forEach(function (v) { if (v > max) max = v; }); });
      var raw = document.createElement("canvas");
      raw.width = raw.height = n;
      var ctx0 = raw.getContext("2d"), img = ctx0.createImageData(n, n);
      for (var i = 0; i < n; i++) for (var j = 0; j < n; j++) {
        var c = j <= i ? shade(pattern[i][j], max) : [245, 245, 245], o = 4 * (i * n + j);
        img.data[o] = c[0]; img.data[o + 1] = c[1]; img.data[o + 2] = c[2]; img.data[o + 3] = 255;
      }
      ctx0.putImageData(img, 0, 0);
      var card = document.createElement("figure");
      card.className = "sm-head";
      var cap = document.createElement("figcaption");
      cap.textContent = name;
      var canvas = document.createElement("canvas");
      canvas.width = canvas.height = Math.round(SIZE * ratio);
      canvas.style.width = canvas.style.height = SIZE + "px";
      canvas.dataset.head = name;
      canvas.setAttribute("role", "img");
      canvas.setAttribute("aria-label", name + " attention pattern");
      card.appendChild(cap); card.appendChild(canvas); grid.appendChild(card);
      return { name: name, pattern: pattern, raw: raw, canvas: canvas };
    });
    var spans = tokens.map(function (t, i) {
      var s = document.createElement("span");
      s.className = "sm-tok"; s.textContent = t.text; s.dataset.pos = String(i);
      strip.appendChild(s);
      return s;
    });

    function paint(q, k) {
      pictures.forEach(function (p) {
        var ctx = p.canvas.getContext("2d"), cell = p.canvas.width / n;
        ctx.imageSmoothingEnabled = false;
        ctx.drawImage(p.raw, 0, 0, p.canvas.width, p.canvas.height);
        ctx.lineWidth = Math.max(1, ratio);
        if (q !== null) { ctx.strokeStyle = "#e08a00"; ctx.strokeRect(0, q * cell, p.canvas.width, cell); }
        if (q !== null && k !== null) { ctx.strokeStyle = "#111"; ctx.strokeRect(k * cell, q * cell, cell, cell); }
      });
      spans.forEach(function (s, i) { s.classList.toggle("dest", i === q); s.classList.toggle("src", i === k); });
    }

    function show(lines, x, y) {
      tip.textContent = "";
      lines.forEach(function (line, i) {
        var div = document.createElement("div");
        div.textContent = line;
        if (i === 0) div.className = "sm-tip-head";
        tip.appendChild(div);
      });
      tip.hidden = false;
      var box = el.getBoundingClientRect();
      tip.style.left = Math.min(x - box.left + 14, Math.max(0, box.width - 260)) + "px";
      tip.style.top = (y - box.top + 14) + "px";
    }

    function hide() { tip.hidden = true; paint(null, null); }

    grid.addEventListener("mousemove", function (ev) {
      var canvas = ev.target.closest && ev.target.closest("canvas[data-head]");
      if (!canvas) return hide();
      var r = canvas.getBoundingClientRect();
      var q = Math.min(n - 1, Math.floor((ev.clientY - r.top) / r.height * n));
      var k = Math.min(n - 1, Math.floor((ev.clientX - r.left) / r.width * n));
      if (k > q) return hide();  // above the diagonal: no key after its query
      paint(q, k);
      show(["query " + label(tokens, q) + " → key " + label(tokens, k)].concat(pictures.map(function (p) {
        return p.name + ": " + p.pattern[q][k].toFixed(3);
      })), ev.clientX, ev.clientY);
    });
    grid.addEventListener("mouseleave", hide);
    strip.addEventListener("mouseover", function (ev) {
      var s = ev.target.closest && ev.target.closest(".sm-tok");
      if (!s) return;
      var q = Number(s.dataset.pos);
      paint(q, null);
      show(["query " + label(tokens, q) + ": where each head looks most"].concat(pictures.map(function (p) {
        var row = p.pattern[q], best = 0;
        for (var j = 1; j <= q; j++) if (row[j] > row[best]) best = j;
        return p.name + ": " + label(tokens, best) + " " + row[best].toFixed(3);
      })), ev.clientX, ev.clientY);
    });
    strip.addEventListener("mouseleave", hide);
    paint(null, null);
  }

  function drawAll(root) {
    (root || document).querySelectorAll("[data-small-multiples]").forEach(draw);
  }

  document.addEventListener("DOMContentLoaded", function () { drawAll(document); });
  document.addEventListener("htmx:afterSwap", function () { drawAll(document); });
})();
