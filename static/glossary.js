/* qkov glossary.js: links the first use of each glossary term on the page to its definition on /glossary.
 *
 * The terms come from the page itself (<script id="glossary-terms">: every name of every term of
 * docs/glossary.md, lower case -> anchor; app/glossary.py). After load and after each htmx swap, the text of
 * <main> is walked in document order and the first occurrence of each term not yet linked on the page becomes
 * <a class="term" href="/glossary#anchor">. Text inside links, scripts, code, form controls, table headers (a
 * click there sorts the table), charts and the page title is left alone. The served HTML is unchanged.
 */
(function () {
  "use strict";

  var SKIP = { A: 1, SCRIPT: 1, STYLE: 1, CODE: 1, PRE: 1, TEXTAREA: 1, SELECT: 1, OPTION: 1, BUTTON: 1,
               TH: 1, H1: 1, LABEL: 1, SVG: 1 };
  var terms = null, pattern = null;

  function load() {
    if (terms !== null) return terms;
    var el = document.getElementById("glossary-terms");
    terms = el ? JSON.parse(el.textContent) : {};
    var names = Object.keys(terms).sort(function (a, b) { return b.length - a.length; });  // longest first
    var escaped = names.map(function (n) { return n.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"); });
    pattern = names.length ? new RegExp("(^|[^\\w-])(" + escaped.join("|") + ")(?![\\w-])", "i") : null;
    return terms;
  }

  function skipped(node, root) {
    for (var el = node.parentElement; el && el !== root.parentElement; el = el.parentElement) {
      if (SKIP[el.tagName.toUpperCase()] || el.classList.contains("chart") || el.classList.contains("term")) return true;
    }
    return false;
  }

  function linked() {
    var seen = {};
    document.querySelectorAll("main a.term").forEach(function (a) { seen[a.dataset.term] = true; });
    return seen;
  }

  function linkTerms(root) {
    load();
    if (!pattern || !root) return;
    var seen = linked();
    var walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    var nodes = [];
    for (var n = walker.nextNode(); n; n = walker.nextNode()) nodes.push(n);
    nodes.forEach(function (node) {
      if (skipped(node, root)) return;
      var text = node.nodeValue, offset = 0, parts = [], m;
      var rest = text;
      while (rest && (m = pattern.exec(rest))) {
        var start = m.index + m[1].length, word = m[2], anchor = terms[word.toLowerCase()];
        if (!anchor || seen[anchor]) {  // already linked: look further on
          parts.push(rest.slice(0, start + word.length));
          rest = rest.slice(start + word.length);
          continue;
        }
        seen[anchor] = true;
        parts.push(rest.slice(0, start));
        var a = document.createElement("a");
        a.className = "term"; a.href = "/glossary#" + anchor; a.dataset.term = anchor;
        a.title = "glossary: what this means"; a.textContent = word;
        parts.push(a);
        rest = rest.slice(start + word.length);
        offset++;
      }
      if (!offset) return;
      parts.push(rest);
      var frag = document.createDocumentFragment();
      parts.forEach(function (p) { frag.appendChild(typeof p === "string" ? document.createTextNode(p) : p); });
      node.parentNode.replaceChild(frag, node);
    });
  }

  document.addEventListener("DOMContentLoaded", function () { linkTerms(document.querySelector("main")); });
  document.addEventListener("htmx:afterSwap", function (ev) {
    var t = ev.detail && ev.detail.target;
    linkTerms(t && t.isConnected ? t : document.querySelector("main"));
  });
  window.qkovLinkTerms = linkTerms;
})();
