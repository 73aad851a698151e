"""The report's stylesheet and scripts, inlined into every HTML file (no network, no files).

They live in a Python module rather than as package data so that an installed wheel always has
them. ``GUARD_JS`` runs first, in ``<head>``: it counts uncaught errors, rejected promises and
``console.error`` calls into ``<html data-ft-errors>`` so that a headless browser's
``--dump-dom`` shows them. ``GANTT_JS`` draws every trace on a canvas on one shared time scale
and, when done, writes ``data-ft-ready``, ``data-ft-render-ms`` (``performance.now()``, i.e.
since navigation start) and ``data-ft-lanes`` (tasks drawn per lane, per trace); every redraw
updates each canvas's ``data-drawn``. ``window.ftViz`` exposes the view and the panels.
"""

CSS = r"""
body { font: 13px/1.4 system-ui, sans-serif; margin: 16px 20px; color: #222; background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 22px 0 6px; }
h3 { font-size: 14px; margin: 12px 0 4px; }
.small { color: #555; font-size: 12px; }
table { border-collapse: collapse; margin: 4px 0 8px; }
th, td { border: 1px solid #ddd; padding: 2px 7px; text-align: right; vertical-align: top; }
th:first-child, td:first-child { text-align: left; }
td.seq, p.seq { text-align: left; font-size: 11px; color: #333; max-width: 1100px; }
table.tasks td:nth-child(2), table.tasks td:nth-child(3), table.tasks td:nth-child(5) { text-align: left; }
tr.crit td { background: #fde8e8; }
.sw { display: inline-block; width: 11px; height: 11px; margin-right: 5px; vertical-align: -1px;
      border: 1px solid rgba(0,0,0,.3); }
.legend span.item { margin-right: 12px; white-space: nowrap; }
.toolbar { position: sticky; top: 0; background: #fff; padding: 6px 0; z-index: 2;
           border-bottom: 1px solid #eee; }
.toolbar button { margin-right: 4px; }
.panel { margin: 10px 0 18px; }
.panel h2 { margin-top: 8px; }
canvas.gantt { display: block; width: 100%; cursor: grab; border: 1px solid #e5e5e5; }
canvas.gantt.dragging { cursor: grabbing; }
.info { min-height: 1.4em; font-size: 12px; background: #f7f7f9; padding: 4px 8px; margin-top: 4px; }
#ft-tip { position: fixed; pointer-events: none; background: rgba(255,255,255,.97);
          border: 1px solid #999; padding: 5px 8px; font-size: 12px; max-width: 460px;
          box-shadow: 0 2px 6px rgba(0,0,0,.2); display: none; z-index: 5; }
.dagbox { overflow: auto; max-height: 620px; border: 1px solid #e5e5e5; }
.tablebox { overflow: auto; max-height: 620px; }
.cols { display: flex; flex-wrap: wrap; gap: 18px; }
details { margin: 6px 0; } summary { cursor: pointer; color: #335; }
"""

GUARD_JS = r"""
(function () {
  var root = document.documentElement, n = 0;
  root.setAttribute("data-ft-errors", "0");
  function bump(msg) {
    n += 1;
    root.setAttribute("data-ft-errors", String(n));
    var old = root.getAttribute("data-ft-error-text") || "";
    root.setAttribute("data-ft-error-text", (old + " | " + msg).slice(-4000));
  }
  window.addEventListener("error", function (e) { bump(e.message || String(e)); });
  window.addEventListener("unhandledrejection", function (e) { bump("unhandled rejection: " + e.reason); });
  var original = console.error;
  console.error = function () {
    bump(Array.prototype.join.call(arguments, " "));
    return original.apply(console, arguments);
  };
})();
"""

GANTT_JS = r"""
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("ft-data").textContent);
  var root = document.documentElement;
  var GUTTER = 112, RPAD = 12, AXIS = 22, LANE_H = 22, GAP_H = 11, SLOT_H = 11, SEP = 8;
  var maxWall = Math.max(D.maxWall, 1);
  var FULL = { x0: -maxWall * 0.005, x1: maxWall * 1.01 };
  var view = { x0: FULL.x0, x1: FULL.x1 };
  var showCritical = false;
  var tip = document.getElementById("ft-tip");
  var pending = false;

  function esc(s) {
    return String(s).replace(/[&<>"]/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c];
    });
  }
  function ms(us) { return (us / 1000).toFixed(3) + " ms"; }
  function human(b) {
    if (!b) return "0";
    var u = ["B", "KiB", "MiB", "GiB"], i = 0;
    while (b >= 1024 && i < 3) { b /= 1024; i++; }
    return (i ? b.toFixed(1) : b) + " " + u[i];
  }
  function niceStep(span, target) {
    var raw = span / Math.max(target, 1), p = Math.pow(10, Math.floor(Math.log10(raw)));
    var ms_ = [1, 2, 5, 10];
    for (var i = 0; i < ms_.length; i++) if (ms_[i] * p >= raw) return ms_[i] * p;
    return 10 * p;
  }
  function tickLabel(us, step) {
    if (step >= 1e6) return (us / 1e6).toFixed(Math.max(0, -Math.floor(Math.log10(step / 1e6)))) + " s";
    if (step >= 1000) return (us / 1000).toFixed(Math.max(0, -Math.floor(Math.log10(step / 1000)))) + " ms";
    return us.toFixed(Math.max(0, -Math.floor(Math.log10(step)))) + " \u00b5s";
  }
  function lowerBound(arr, x) { // first j with arr[j] >= x (arr non-decreasing)
    var lo = 0, hi = arr.length;
    while (lo < hi) { var mid = (lo + hi) >> 1; if (arr[mid] < x) lo = mid + 1; else hi = mid; }
    return lo;
  }
  function schedule() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(function () { pending = false; drawAll(); });
  }

  function Panel(tr, el) {
    var self = this, T = tr.t, n = T.s.length;
    this.tr = tr; this.el = el;
    this.canvas = el.querySelector("canvas.gantt");
    this.info = el.querySelector(".info");
    this.selected = -1;
    this.rows = [];
    this.taskRow = new Int32Array(n);
    var y = AXIS;
    tr.lanes.forEach(function (lane, li) {
      var idx = [];
      for (var i = 0; i < n; i++) if (T.l[i] === li) idx.push(i);
      var maxEnd = new Float64Array(idx.length), m = -Infinity;
      for (var j = 0; j < idx.length; j++) { m = Math.max(m, T.e[idx[j]]); maxEnd[j] = m; }
      var row = { type: "lane", label: lane, idx: idx, maxEnd: maxEnd, y: y, h: LANE_H, drawn: 0 };
      for (j = 0; j < idx.length; j++) self.taskRow[idx[j]] = self.rows.length;
      self.rows.push(row);
      y += LANE_H + 2;
      if (lane === tr.gapLane && tr.gaps.length) {
        self.rows.push({ type: "gap", label: lane + " idle", items: tr.gaps, y: y, h: GAP_H });
        y += GAP_H + 2;
      }
    });
    if (tr.slots.length) y += SEP;
    tr.slots.forEach(function (sr) {
      self.rows.push({ type: "slot", label: sr.pool + " #" + sr.slot, items: sr.iv, y: y, h: SLOT_H });
      y += SLOT_H + 2;
    });
    this.height = y + 4;
    this.crit = new Set(tr.crit);
    this.attach();
  }

  Panel.prototype.resize = function () {
    var dpr = window.devicePixelRatio || 1, w = Math.max(this.el.clientWidth, 300);
    this.width = w;
    this.canvas.width = Math.round(w * dpr);
    this.canvas.height = Math.round(this.height * dpr);
    this.canvas.style.height = this.height + "px";
    this.ctx = this.canvas.getContext("2d");
    this.ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  };
  Panel.prototype.scale = function () { return (this.width - GUTTER - RPAD) / (view.x1 - view.x0); };
  Panel.prototype.X = function (t) { return GUTTER + (t - view.x0) * this.scale(); };
  Panel.prototype.time = function (px) { return view.x0 + (px - GUTTER) / this.scale(); };

  Panel.prototype.draw = function () {
    var ctx = this.ctx, self = this, T = this.tr.t, k = this.scale(), W = this.width;
    ctx.clearRect(0, 0, W, this.height);
    // axis and grid
    var step = niceStep(view.x1 - view.x0, (W - GUTTER - RPAD) / 90);
    ctx.font = "11px sans-serif"; ctx.textBaseline = "middle";
    ctx.strokeStyle = "#eee"; ctx.fillStyle = "#555"; ctx.lineWidth = 1;
    for (var t = Math.ceil(view.x0 / step) * step; t <= view.x1; t += step) {
      var x = Math.round(this.X(t)) + 0.5;
      ctx.beginPath(); ctx.moveTo(x, AXIS - 4); ctx.lineTo(x, this.height); ctx.stroke();
      ctx.fillText(tickLabel(t, step), x + 3, AXIS / 2);
    }
    ctx.save();
    ctx.beginPath(); ctx.rect(GUTTER, 0, W - GUTTER - RPAD, this.height); ctx.clip();
    var labels = [];
    this.rows.forEach(function (row) {
      if (row.type === "lane") self.drawLane(row, k, labels);
      else self.drawItems(row, k);
    });
    ctx.fillStyle = "#111"; ctx.font = "11px sans-serif";
    labels.forEach(function (l) { ctx.fillText(l[2], l[0], l[1]); });
    if (showCritical) this.outline(this.tr.crit, "#e31a1c", true);
    if (this.selected >= 0) {
      var sel = this.selected, deps = T.deps[sel];
      this.links(deps, sel);
      this.outline(deps, "#333", false);
      this.outline([sel], "#000", false);
    }
    ctx.restore();
    // row labels
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, GUTTER - 2, this.height);
    ctx.textAlign = "right";
    this.rows.forEach(function (row) {
      ctx.fillStyle = row.type === "lane" ? "#222" : "#666";
      ctx.font = row.type === "lane" ? "bold 12px sans-serif" : "10px sans-serif";
      ctx.fillText(row.label, GUTTER - 8, row.y + row.h / 2);
    });
    ctx.textAlign = "left";
    var drawn = {};
    this.rows.forEach(function (row) { if (row.type === "lane") drawn[row.label] = row.drawn; });
    this.canvas.setAttribute("data-drawn", JSON.stringify(drawn));
  };

  Panel.prototype.drawLane = function (row, k, labels) {
    var ctx = this.ctx, T = this.tr.t, idx = row.idx, colors = D.colors, drawn = 0;
    var y = row.y + 2, h = row.h - 4, x0 = view.x0, x1 = view.x1;
    for (var j = lowerBound(row.maxEnd, x0); j < idx.length; j++) {
      var i = idx[j], s = T.s[i];
      if (s > x1) break;
      var e = T.e[i];
      if (e < x0) continue;
      var x = GUTTER + (s - x0) * k, w = Math.max(1, (e - s) * k);
      ctx.fillStyle = colors[T.k[i]];
      ctx.fillRect(x, y, w > 3 ? w - 1 : w, h);
      drawn++;
      if (w > 42) {
        var name = T.name[i], fit = Math.floor((w - 6) / 6.2);
        if (fit >= 3) {
          var text = name.length > fit ? name.slice(0, fit - 1) + "\u2026" : name;
          labels.push([Math.max(x, GUTTER) + 3, y + h / 2, text]);
        }
      }
    }
    row.drawn = drawn;
  };

  Panel.prototype.drawItems = function (row, k) {
    var ctx = this.ctx, items = row.items, y = row.y + 1, h = row.h - 2;
    for (var j = 0; j < items.length; j++) {
      var it = items[j];
      if (it.e < view.x0 || it.s > view.x1) continue;
      var x = GUTTER + (it.s - view.x0) * k, w = Math.max(1, (it.e - it.s) * k);
      ctx.fillStyle = it.c;
      if (row.type === "slot") ctx.globalAlpha = 0.75;
      ctx.fillRect(x, y, w > 3 ? w - 1 : w, h);
      ctx.globalAlpha = 1;
    }
  };

  Panel.prototype.box = function (i) {
    var T = this.tr.t, row = this.rows[this.taskRow[i]], k = this.scale();
    var x = GUTTER + (T.s[i] - view.x0) * k;
    return { x: x, y: row.y + 2, w: Math.max(1, (T.e[i] - T.s[i]) * k), h: row.h - 4 };
  };
  Panel.prototype.outline = function (list, color, thick) {
    var ctx = this.ctx;
    ctx.strokeStyle = color; ctx.lineWidth = thick ? 2 : 1.5;
    for (var j = 0; j < list.length; j++) {
      var b = this.box(list[j]);
      ctx.strokeRect(b.x - 0.5, b.y - 0.5, b.w + 1, b.h + 1);
    }
  };
  Panel.prototype.links = function (deps, to) {
    var ctx = this.ctx, bt = this.box(to);
    ctx.strokeStyle = "rgba(0,0,0,.55)"; ctx.lineWidth = 1;
    for (var j = 0; j < deps.length; j++) {
      var b = this.box(deps[j]);
      ctx.beginPath(); ctx.moveTo(b.x + b.w, b.y + b.h / 2); ctx.lineTo(bt.x, bt.y + bt.h / 2); ctx.stroke();
    }
  };

  Panel.prototype.rowAt = function (y) {
    for (var r = 0; r < this.rows.length; r++) {
      var row = this.rows[r];
      if (y >= row.y && y < row.y + row.h + 2) return row;
    }
    return null;
  };
  Panel.prototype.hit = function (px, py) {
    var row = this.rowAt(py);
    if (!row || px < GUTTER) return null;
    var t = this.time(px), slack = 3 / this.scale(), T = this.tr.t, best = null, bestD = Infinity;
    if (row.type === "lane") {
      var idx = row.idx;
      for (var j = lowerBound(row.maxEnd, t - slack); j < idx.length; j++) {
        var i = idx[j];
        if (T.s[i] > t + slack) break;
        var d = t < T.s[i] ? T.s[i] - t : (t > T.e[i] ? t - T.e[i] : 0);
        if (d <= slack && d < bestD) { best = { type: "task", i: i }; bestD = d; }
      }
      return best;
    }
    for (var m = 0; m < row.items.length; m++) {
      var it = row.items[m];
      var dd = t < it.s ? it.s - t : (t > it.e ? t - it.e : 0);
      if (dd <= slack && dd < bestD) { best = { type: row.type, it: it }; bestD = dd; }
    }
    return best;
  };

  Panel.prototype.describe = function (h, full) {
    var T = this.tr.t;
    if (h.type === "gap") {
      return "<b>" + esc(this.tr.gapLane) + " idle " + ms(h.it.e - h.it.s) + "</b> (" + esc(h.it.r) + ")<br>" +
        "from " + ms(h.it.s) + " to " + ms(h.it.e) + "<br>" + esc(h.it.text);
    }
    if (h.type === "slot") {
      return "<b>" + esc(h.it.pool + " slot #" + h.it.slot) + "</b><br>held by " + esc(T.name[h.it.h]) +
        "<br>from " + ms(h.it.s) + " to " + ms(h.it.e) + " (" + ms(h.it.e - h.it.s) + "), " +
        h.it.n + " reader" + (h.it.n === 1 ? "" : "s");
    }
    var i = h.i, parts = ["<b>" + esc(T.name[i]) + "</b>"];
    parts.push("kind " + esc(D.kinds[T.k[i]]) + " \u00b7 lane " + esc(this.tr.lanes[T.l[i]]) +
               " \u00b7 step " + T.step[i]);
    parts.push("layer " + (T.layer[i] === null ? "\u2013" : T.layer[i]) + " \u00b7 micro-batch " +
               (T.mb[i] === null ? "\u2013" : T.mb[i]));
    parts.push("start " + ms(T.s[i]) + " \u00b7 duration " + ms(T.e[i] - T.s[i]));
    parts.push("bytes " + human(T.bytes[i]) + (T.slot[i] ? " \u00b7 slot " + esc(T.slot[i]) : "") +
               (T.reads[i] ? " \u00b7 reads " + esc(T.reads[i]) : ""));
    if (T.why[i]) parts.push("waited for " + esc(T.why[i]));
    if (full) {
      var deps = T.deps[i].map(function (d) { return esc(T.name[d]); });
      parts.push("depends on: " + (deps.length ? deps.join(", ") : "nothing in this trace"));
    }
    return parts.join(full ? " \u00b7 " : "<br>");
  };

  Panel.prototype.attach = function () {
    var self = this, c = this.canvas, drag = null;
    function local(ev) { var r = c.getBoundingClientRect(); return [ev.clientX - r.left, ev.clientY - r.top]; }
    c.addEventListener("wheel", function (ev) {
      ev.preventDefault();
      var p = local(ev);
      if (Math.abs(ev.deltaX) > Math.abs(ev.deltaY) || ev.shiftKey) {
        var d = (ev.deltaX || ev.deltaY) / self.scale();
        view.x0 += d; view.x1 += d;
      } else {
        zoomAt(self.time(Math.max(p[0], GUTTER)), Math.exp(ev.deltaY * 0.0015));
      }
      schedule();
    }, { passive: false });
    c.addEventListener("mousedown", function (ev) {
      drag = { x: ev.clientX, x0: view.x0, x1: view.x1, moved: false };
      c.classList.add("dragging");
    });
    window.addEventListener("mousemove", function (ev) {
      if (!drag) return;
      var dx = ev.clientX - drag.x;
      if (Math.abs(dx) > 2) drag.moved = true;
      var dt = dx / self.scale();
      view.x0 = drag.x0 - dt; view.x1 = drag.x1 - dt;
      schedule();
    });
    window.addEventListener("mouseup", function (ev) {
      if (!drag) return;
      var moved = drag.moved;
      drag = null; c.classList.remove("dragging");
      if (moved || ev.target !== c) return;
      var p = local(ev), h = self.hit(p[0], p[1]);
      self.selected = h && h.type === "task" ? h.i : -1;
      self.info.innerHTML = h ? self.describe(h, true) : "click a task for details; wheel zooms, drag pans, double-click resets";
      schedule();
    });
    c.addEventListener("mousemove", function (ev) {
      if (drag) { tip.style.display = "none"; return; }
      var p = local(ev), h = self.hit(p[0], p[1]);
      if (!h) { tip.style.display = "none"; return; }
      tip.innerHTML = self.describe(h, false);
      tip.style.display = "block";
      var tx = ev.clientX + 14, ty = ev.clientY + 14;
      if (tx + tip.offsetWidth > window.innerWidth) tx = ev.clientX - tip.offsetWidth - 10;
      if (ty + tip.offsetHeight > window.innerHeight) ty = ev.clientY - tip.offsetHeight - 10;
      tip.style.left = tx + "px"; tip.style.top = ty + "px";
    });
    c.addEventListener("mouseleave", function () { tip.style.display = "none"; });
    c.addEventListener("dblclick", function () { reset(); });
  };

  function zoomAt(t, factor) {
    var span = (view.x1 - view.x0) * factor;
    span = Math.min(Math.max(span, 1), (FULL.x1 - FULL.x0) * 4);
    var f = (t - view.x0) / (view.x1 - view.x0);
    view.x0 = t - f * span; view.x1 = view.x0 + span;
  }
  function reset() { view.x0 = FULL.x0; view.x1 = FULL.x1; schedule(); }

  var panels = D.traces.map(function (tr, n) {
    return new Panel(tr, document.getElementById("panel-" + n));
  });
  function drawAll() {
    panels.forEach(function (p) { p.draw(); });
    var span = document.getElementById("ft-span");
    if (span) span.textContent = ms(view.x0) + " \u2013 " + ms(view.x1);
  }
  function resizeAll() { panels.forEach(function (p) { p.resize(); }); drawAll(); }

  var bar = document.getElementById("ft-toolbar");
  if (bar) {
    bar.querySelector("[data-act=reset]").addEventListener("click", reset);
    bar.querySelector("[data-act=in]").addEventListener("click", function () {
      zoomAt((view.x0 + view.x1) / 2, 0.5); schedule();
    });
    bar.querySelector("[data-act=out]").addEventListener("click", function () {
      zoomAt((view.x0 + view.x1) / 2, 2); schedule();
    });
    bar.querySelector("[data-act=crit]").addEventListener("change", function (ev) {
      showCritical = ev.target.checked; schedule();
    });
  }
  window.addEventListener("resize", resizeAll);

  resizeAll();
  var lanes = panels.map(function (p) {
    return { trace: p.tr.label, lanes: JSON.parse(p.canvas.getAttribute("data-drawn")) };
  });
  // for tests and the console: the shared view and the panels (X(time), rows, selected, ...)
  window.ftViz = { view: view, panels: panels, redraw: drawAll, reset: reset, zoomAt: zoomAt };
  root.setAttribute("data-ft-lanes", JSON.stringify(lanes));
  root.setAttribute("data-ft-render-ms", performance.now().toFixed(1));
  root.setAttribute("data-ft-ready", "1");
})();
"""
