/* qkov reading.js: tables that sort and filter, and the attention text view (CircuitsVis-style), with no
 * fetch of its own: every datum comes inside the HTML fragment.
 *
 * Tables: every <table class="data"> gets sortable headers (click: ascending, again: descending; numbers
 * by their cell's data-value) and, from 8 rows on, a filter box above it (rows whose text contains it).
 *
 * Attention text view: <div class="attn-text" data-attn-text> holding
 *   <script type="application/x-qkov-text+json">{"tokens": [...], "heads": {"L1H2": [[n x n]]}, "terms": [{"label", "values"}]}</script>
 * draws the prompt as text; hovering (or clicking, which pins it) a token colours every token by the attention
 * that token pays to it under the chosen head; a path term colours each source token by its signed
 * contribution. The chosen head / term and the pinned token live in the URL (attn_head, attn_term, attn_token).
 */
(function () {
  "use strict";

  // ---- tables: sort and filter ----------------------------------------------------------------------------
  function cellKey(cell) {
    var raw = cell.hasAttribute("data-value") ? cell.getAttribute("data-value") : cell.textContent.trim();
    var num = raw === "" ? NaN : Number(raw);
    return { raw: raw, num: num };
  }

  function sortBy(table, col, th) {
    var body = table.tBodies[0];
    if (!body) return;
    var dir = th.getAttribute("aria-sort") === "ascending" ? "descending" : "ascending";
    table.querySelectorAll("th[aria-sort]").forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", dir);
    var rows = Array.prototype.slice.call(body.rows);
    var keys = rows.map(function (r) { return r.cells[col] ? cellKey(r.cells[col]) : { raw: "", num: NaN }; });
    var numeric = keys.every(function (k) { return k.raw === "" || !isNaN(k.num); });
    var order = rows.map(function (r, i) { return i; });
    order.sort(function (a, b) {
      var ka = keys[a], kb = keys[b], c;
      if (numeric) {
        var na = isNaN(ka.num), nb = isNaN(kb.num);
        if (na || nb) return (na - nb) || a - b;  // blanks last either way
        c = ka.num - kb.num;
      } else {
        c = ka.raw.localeCompare(kb.raw);
      }
      return (dir === "ascending" ? c : -c) || a - b;
    });
    order.forEach(function (i) { body.appendChild(rows[i]); });
  }

  function filterRows(table, text) {
    var needle = text.trim().toLowerCase();
    var shown = 0;
    Array.prototype.forEach.call(table.tBodies[0] ? table.tBodies[0].rows : [], function (r) {
      var hit = !needle || r.textContent.toLowerCase().indexOf(needle) !== -1 ||
        Array.prototype.some.call(r.cells, function (c) { return (c.getAttribute("data-value") || "").toLowerCase().indexOf(needle) !== -1; });
      r.hidden = !hit;
      if (hit) shown++;
    });
    return shown;
  }

  function enhanceTable(table) {
    if (table.dataset.reading === "1") return;
    table.dataset.reading = "1";
    var head = table.tHead && table.tHead.rows[table.tHead.rows.length - 1];
    if (head) {
      Array.prototype.forEach.call(head.cells, function (th, col) {
        th.classList.add("sortable");
        th.title = "sort by this column";
        th.tabIndex = 0;
        th.addEventListener("click", function () { sortBy(table, col, th); });
        th.addEventListener("keydown", function (ev) { if (ev.key === "Enter") sortBy(table, col, th); });
      });
    }
    var n = table.tBodies[0] ? table.tBodies[0].rows.length : 0;
    if (n >= 8) {
      var box = document.createElement("input");
      box.type = "search";
      box.className = "table-filter";
      box.placeholder = "filter " + n + " rows";
      box.setAttribute("aria-label", "filter the rows of this table");
      var count = document.createElement("span");
      count.className = "note filter-count";
      box.addEventListener("input", function () {
        var shown = filterRows(table, box.value);
        count.textContent = box.value ? shown + " of " + n + " rows" : "";
      });
      var bar = document.createElement("div");
      bar.className = "table-tools";
      bar.appendChild(box);
      bar.appendChild(count);
      var anchor = table.parentElement && table.parentElement.classList.contains("scroll") ? table.parentElement : table;
      anchor.parentNode.insertBefore(bar, anchor);
    }
  }

  // ---- the attention text view -----------------------------------------------------------------------------
  function param(name) { return new URLSearchParams(window.location.search).get(name); }

  function setParams(values) {
    var url = new URL(window.location.href);
    Object.keys(values).forEach(function (k) {
      if (values[k] === null || values[k] === undefined || values[k] === "") url.searchParams.delete(k);
      else url.searchParams.set(k, values[k]);
    });
    window.history.replaceState(window.history.state, "", url.toString());
  }

  function colour(v, scale, signed) {
    // attention: white -> blue by v / scale; signed term: red (negative) / blue (positive) by |v| / scale
    var t = scale > 0 ? Math.min(1, Math.abs(v) / scale) : 0;
    var rgb = signed && v < 0 ? [178, 24, 43] : [33, 102, 172];
    return "rgba(" + rgb.join(",") + "," + (0.9 * t).toFixed(3) + ")";
  }

  function drawText(el) {
    if (el.dataset.drawn === "1") return;
    var script = el.querySelector('script[type="application/x-qkov-text+json"]');
    if (!script) return;
    el.dataset.drawn = "1";
    var data = JSON.parse(script.textContent);
    var heads = Object.keys(data.heads || {});
    var terms = data.terms || [];
    var mode = el.querySelector("select.attn-mode");
    var out = el.querySelector(".attn-tokens");
    var caption = el.querySelector(".attn-caption");
    var pinned = null;
    var hovered = null;
    var wanted = param("attn_term") !== null ? "term:" + param("attn_term") : "head:" + (param("attn_head") || heads[0] || "");
    if (mode && Array.prototype.some.call(mode.options, function (o) { return o.value === wanted; })) mode.value = wanted;
    var spans = data.tokens.map(function (t, i) {
      var s = document.createElement("span");
      s.className = /^(\\x[0-9a-f]{2})+$/.test(t.text) ? "attn-tok bytes" : "attn-tok";  // the first bytes of a split character
      s.textContent = t.text;
      s.dataset.pos = String(i);
      s.title = "position " + i + " · token " + t.id;
      out.appendChild(s);
      return s;
    });

    function paint(dest) {
      var choice = mode ? mode.value : "head:" + heads[0];
      var isTerm = choice.indexOf("term:") === 0;
      spans.forEach(function (s, i) {
        s.classList.remove("dest"); s.style.backgroundColor = ""; s.dataset.weight = "";
        s.title = "position " + i + " · token " + data.tokens[i].id;
      });
      if (isTerm) {
        var term = terms[Number(choice.slice(5))];
        if (!term) return;
        var m = Math.max.apply(null, term.values.map(Math.abs)) || 1;
        term.values.forEach(function (v, j) { spans[j].style.backgroundColor = colour(v, m, true); spans[j].dataset.weight = String(v); });
        if (data.position !== null && spans[data.position]) spans[data.position].classList.add("dest");
        caption.textContent = "each source token coloured by its contribution through " + term.label + " to " + data.logit +
          " at position " + data.position + " (outlined; blue raises it, red lowers it; strongest " + m.toFixed(3) + ")";
        return;
      }
      var pattern = data.heads[choice.slice(5)];
      if (!pattern) return;
      if (dest === null) {
        caption.textContent = "hover a token (click to pin it): the tokens before it are coloured by the attention it pays them under " + choice.slice(5) + " (white 0 to dark blue 1)";
        return;
      }
      var row = pattern[dest];
      spans[dest].classList.add("dest");
      row.forEach(function (v, j) {
        if (j > dest) return;
        spans[j].style.backgroundColor = colour(v, 1, false); spans[j].dataset.weight = String(v);
        spans[j].title += " · attention from position " + dest + ": " + v.toFixed(3);  // the weight on hover
      });
      var best = 0;
      row.forEach(function (v, j) { if (v > row[best]) best = j; });
      caption.textContent = choice.slice(5) + ": position " + dest + " " + JSON.stringify(data.tokens[dest].text) +
        " attends most to position " + best + " " + JSON.stringify(data.tokens[best].text) + " (" + row[best].toFixed(3) + ")";
    }

    out.addEventListener("mouseover", function (ev) {
      var s = ev.target.closest(".attn-tok");
      if (s) hovered = Number(s.dataset.pos);
      if (s && pinned === null) paint(hovered);
      if (s && pinned !== null) {  // a query is pinned: the hovered token's weight, in words
        caption.textContent = s.dataset.weight !== ""
          ? "position " + hovered + " " + JSON.stringify(data.tokens[hovered].text) + ": weight " + Number(s.dataset.weight).toFixed(3) +
            " from the pinned position " + pinned
          : "position " + hovered + " comes after the pinned position " + pinned + " (no attention)";
      }
    });
    out.addEventListener("mouseout", function (ev) {
      if (pinned !== null && ev.target.closest(".attn-tok")) paint(pinned);
    });
    out.addEventListener("mouseleave", function () { hovered = null; if (pinned === null) paint(null); });
    out.addEventListener("click", function (ev) {
      var s = ev.target.closest(".attn-tok");
      if (!s) return;
      var pos = Number(s.dataset.pos);
      pinned = pinned === pos ? null : pos;
      spans.forEach(function (x) { x.classList.toggle("pinned", Number(x.dataset.pos) === pinned); });
      setParams({ attn_token: pinned });
      paint(pinned === null ? pos : pinned);
    });
    if (mode) {
      mode.addEventListener("change", function () {
        var v = mode.value;
        setParams(v.indexOf("term:") === 0 ? { attn_term: v.slice(5), attn_head: null } : { attn_head: v.slice(5), attn_term: null });
        paint(pinned !== null ? pinned : hovered);
      });
    }
    var start = param("attn_token");
    if (start !== null && Number(start) >= 0 && Number(start) < spans.length) {
      pinned = Number(start);
      spans[pinned].classList.add("pinned");
    }
    paint(pinned);
  }

  // ---- the model picker keeps the page's state -------------------------------------------------------------
  document.addEventListener("submit", function (ev) {
    var here = ev.target.querySelector && ev.target.querySelector('input[name="here"]');
    if (here) here.value = window.location.pathname + window.location.search;
  }, true);

  function enhance(root) {
    root = root || document;
    root.querySelectorAll("table.data").forEach(enhanceTable);
    root.querySelectorAll("[data-attn-text]").forEach(drawText);
    if (root.matches && root.matches("table.data")) enhanceTable(root);
  }

  document.addEventListener("DOMContentLoaded", function () { enhance(document); });
  document.addEventListener("htmx:afterSwap", function (ev) { enhance(ev.detail && ev.detail.target && ev.detail.target.parentNode || document); });
  document.addEventListener("htmx:historyRestore", function () { enhance(document); });
})();
