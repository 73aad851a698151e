"""The report's drawing script, inlined into every HTML file.

``GANTT_JS`` draws every trace on a canvas, all on one time scale: step bands on the axis,
lanes (tasks narrower than a pixel are merged into a busy-fraction view: per pixel column the
colour of the kind that covered most of it, the height of how much of it was covered), the
compute-idle row, slots in use per pool against its budget, bytes held on the GPU and in pinned
host memory, and one thin row per slot. Only tasks in view are visited (binary search on each
lane). When done it writes ``data-ft-ready``, ``data-ft-render-ms`` (``performance.now()``,
i.e. since navigation start) and ``data-ft-lanes`` (tasks drawn per lane, per trace) on
``<html>``; each redraw updates every canvas's ``data-drawn``.

Hovered times are offsets into the step that holds them (``step 3 +512.3 ms``), with as many
digits as the thing hovered needs to tell its two ends apart (a 1 ms gap 15 s into a run reads
``from step 3 +512.3 ms to +513.4 ms``, never ``from 15.2 s to 15.2 s``).

The window, the summaries and "align at step" are :mod:`flowtrain.viz.summary_js`, which runs
after this script and builds on ``window.ftViz`` (the view, the panels, the formatters).
"""

GANTT_JS = r"""
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("ft-data").textContent);
  var root = document.documentElement;
  var GUTTER = 128, RPAD = 12, TICK_GAP = 24, AXIS = 34, LANE_H = 22, GAP_H = 11, OCC_H = 30, MEM_H = 36, SLOT_H = 9, SEP = 8;
  var maxWall = Math.max(D.maxWall, 1);
  var FULL = { x0: -maxWall * 0.005, x1: maxWall * 1.01 };
  var view = { x0: FULL.x0, x1: FULL.x1 };
  var state = { critical: false, aligned: null };
  var tip = document.getElementById("ft-tip");
  var pending = false;

  function esc(s) {
    return String(s).replace(/[&<>"]/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c];
    });
  }
  function fmtTime(us) { // three significant digits in the unit that fits
    var a = Math.abs(us);
    if (a >= 1e6) return (us / 1e6).toPrecision(3) + " s";
    if (a >= 1e3) return (us / 1e3).toPrecision(3) + " ms";
    if (a >= 1) return us.toPrecision(3) + " \u00b5s";
    return a === 0 ? "0" : (us * 1e3).toPrecision(3) + " ns";
  }
  function fmtBytes(b) {
    var u = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0;
    while (Math.abs(b) >= 1024 && i < 4) { b /= 1024; i++; }
    return (i ? b.toFixed(1) : String(Math.round(b))) + " " + u[i];
  }
  // "23.512 s \u2013 23.518 s": both ends in one unit, with the digits that tell them apart
  function fmtSpan(a, b) {
    var m = Math.max(Math.abs(a), Math.abs(b)), unit = "\u00b5s", scale = 1;
    if (m >= 1e6) { unit = "s"; scale = 1e6; } else if (m >= 1e3) { unit = "ms"; scale = 1e3; }
    var apart = Math.ceil(-Math.log10(Math.max(b - a, 1e-3) / scale) - 1e-9);
    var sig = 2 - Math.floor(Math.log10(Math.max(m / scale, 1e-9)) + 1e-9);
    var digits = Math.min(9, Math.max(0, apart, sig));
    function f(x) { return (x < 0 ? "\u2212" : "") + (Math.abs(x) / scale).toFixed(digits); }
    return f(a) + " \u2013 " + f(b) + " " + unit;
  }
  function fmtOffset(us, res) { // "+512.3 ms": the unit that fits |us|, digits down to res (us)
    var a = Math.abs(us), unit = "\u00b5s", scale = 1;
    if (a >= 1e6) { unit = "s"; scale = 1e6; } else if (a >= 1e3) { unit = "ms"; scale = 1e3; }
    var digits = Math.min(9, Math.max(0, Math.ceil(-Math.log10(Math.max(res, 1e-3) / scale) - 1e-9)));
    return (us < 0 ? "\u2212" : "+") + (a / scale).toFixed(digits) + " " + unit;
  }
  function stepAt(steps, t) { // the step whose band holds time t (the first one before them all)
    var lo = 0, hi = steps.length - 1;
    if (hi < 0) return null;
    while (lo < hi) { var mid = (lo + hi + 1) >> 1; if (steps[mid].s <= t) lo = mid; else hi = mid - 1; }
    return steps[lo];
  }
  function rate(bytes, us) { return us > 0 && bytes > 0 ? (bytes / us / 1e3).toFixed(2) + " GB/s" : ""; }
  function niceStep(span, target) {
    var raw = span / Math.max(target, 1), p = Math.pow(10, Math.floor(Math.log10(raw)));
    var m = [1, 2, 5, 10];
    for (var i = 0; i < m.length; i++) if (m[i] * p >= raw) return m[i] * p;
    return 10 * p;
  }
  function niceUp(step) { // the next 1-2-5 spacing above ``step``
    var p = Math.pow(10, Math.floor(Math.log10(step) + 1e-9)), r = step / p;
    return (r < 1.5 ? 2 : r < 3.5 ? 5 : 10) * p;
  }
  function tickLabel(us, step, relative) { // units from the tick spacing; "+" when time is relative
    var sign = relative && us > 0 ? "+" : "", unit = "\u00b5s", scale = 1;
    if (step >= 1e6) { unit = "s"; scale = 1e6; } else if (step >= 1e3) { unit = "ms"; scale = 1e3; }
    var digits = Math.max(0, -Math.floor(Math.log10(step / scale) + 1e-9));
    return sign + (us / scale).toFixed(digits) + " " + unit;
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
    this.tr = tr; this.el = el; this.shift = 0;
    this.win = { first: tr.window.first, last: tr.window.last };
    this.canvas = el.querySelector("canvas.gantt");
    this.info = el.querySelector(".info");
    this.selected = -1; this.marked = null;
    this.rows = [];
    this.taskRow = new Int32Array(n);
    var byLane = tr.lanes.map(function () { return []; });
    for (var i = 0; i < n; i++) byLane[T.l[i]].push(i);
    var y = AXIS;
    tr.lanes.forEach(function (lane, li) {
      var idx = byLane[li], maxEnd = new Float64Array(idx.length), m = -Infinity;
      for (var j = 0; j < idx.length; j++) { m = Math.max(m, T.e[idx[j]]); maxEnd[j] = m; self.taskRow[idx[j]] = self.rows.length; }
      self.rows.push({ type: "lane", label: lane, idx: idx, maxEnd: maxEnd, y: y, h: LANE_H, drawn: 0 });
      y += LANE_H + 2;
      if (lane === tr.gapLane && tr.gaps.length) {
        self.rows.push({ type: "gap", label: lane + " idle", items: tr.gaps, y: y, h: GAP_H });
        y += GAP_H + 2;
      }
    });
    y += SEP;
    Object.keys(tr.occ).forEach(function (pool) {
      self.rows.push({ type: "occ", label: pool + " in use", pool: pool, pts: tr.occ[pool],
                       budget: tr.budgets[pool] || 0, y: y, h: OCC_H });
      y += OCC_H + 3;
    });
    if (Object.keys(tr.mem).length) {
      self.rows.push({ type: "mem", label: "bytes held", y: y, h: MEM_H });
      y += MEM_H + 3;
    }
    if (tr.slots.length) y += SEP / 2;
    tr.slots.forEach(function (sr) {
      self.rows.push({ type: "slot", label: sr.pool + " #" + sr.slot, items: sr.iv, y: y, h: SLOT_H });
      y += SLOT_H + 2;
    });
    this.height = y + 4;
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
  // panel time = shared view time + this.shift (the aligned step's start, or 0)
  Panel.prototype.scale = function () { return (this.width - GUTTER - RPAD) / (view.x1 - view.x0); };
  Panel.prototype.X = function (t) { return GUTTER + (t - this.shift - view.x0) * this.scale(); };
  Panel.prototype.time = function (px) { return view.x0 + this.shift + (px - GUTTER) / this.scale(); };
  // "step 3 +512.3 ms": a time as an offset into its step, to a resolution of res microseconds
  Panel.prototype.when = function (t, res) {
    var st = stepAt(this.tr.steps, t);
    return st ? "step " + st.step + " " + fmtOffset(t - st.s, res) : fmtTime(t);
  };
  // "from step 3 +512.3 ms to +513.4 ms": both ends with the digits that tell them apart
  Panel.prototype.between = function (s, e) {
    var res = (e - s) / 10, a = stepAt(this.tr.steps, s), b = stepAt(this.tr.steps, e);
    var end = a && b && a.step === b.step ? fmtOffset(e - a.s, res) : this.when(e, res);
    return "from " + this.when(s, res) + " to " + end;
  };
  Panel.prototype.v0 = function () { return view.x0 + this.shift; };
  Panel.prototype.v1 = function () { return view.x1 + this.shift; };
  Panel.prototype.windowSpan = function () {
    var st = this.tr.steps, s = null, e = null;
    for (var i = 0; i < st.length; i++) {
      if (st[i].step >= this.win.first && st[i].step <= this.win.last) {
        if (s === null) s = st[i].s;
        e = st[i].e;
      }
    }
    return s === null ? null : [s, e];
  };

  Panel.prototype.draw = function () {
    var ctx = this.ctx, self = this, W = this.width;
    ctx.clearRect(0, 0, W, this.height);
    ctx.save();
    ctx.beginPath(); ctx.rect(GUTTER, 0, W - GUTTER - RPAD, this.height); ctx.clip();
    this.drawSteps();
    this.drawTicks();
    var labels = [];
    this.rows.forEach(function (row) {
      if (row.type === "lane") self.drawLane(row, labels);
      else if (row.type === "occ") self.drawOcc(row);
      else if (row.type === "mem") self.drawMem(row);
      else self.drawItems(row);
    });
    this.drawLabels(labels);
    if (this.marked) this.markGaps(this.marked);
    if (state.critical) this.outline(this.tr.crit, D.critical, true);
    if (this.selected >= 0) {
      var sel = this.selected, deps = this.tr.t.deps[sel];
      this.links(deps, sel);
      this.outline(deps, "#333", false);
      this.outline([sel], "#000", false);
    }
    ctx.restore();
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, GUTTER - 2, this.height);
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
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

  Panel.prototype.drawSteps = function () { // alternating bands, warm-up tinted, the window outlined
    var ctx = this.ctx, st = this.tr.steps, top = AXIS - 12;
    for (var i = 0; i < st.length; i++) {
      var x0 = this.X(st[i].s), x1 = this.X(st[i].e);
      if (x1 < GUTTER || x0 > this.width) continue;
      var inWin = st[i].step >= this.win.first && st[i].step <= this.win.last;
      ctx.fillStyle = st[i].warm ? "#fff3e0" : (i % 2 ? "#f4f6fa" : "#fbfcfe");
      if (!inWin) ctx.fillStyle = "#ececec";
      ctx.fillRect(x0, top, x1 - x0, this.height - top);
      ctx.font = "10px sans-serif"; ctx.textBaseline = "middle";
      var text = "step " + st[i].step + (st[i].warm ? " (warm-up)" : "");
      if (x1 - Math.max(x0, GUTTER) > ctx.measureText(text).width + 6) {
        ctx.fillStyle = st[i].warm ? "#a0522d" : "#556";
        ctx.fillText(text, Math.max(x0, GUTTER) + 3, top + 5);
      }
    }
    var w = this.windowSpan();
    if (w) {
      ctx.strokeStyle = "#2a6bd1"; ctx.lineWidth = 1.5;
      [w[0], w[1]].forEach(function (t) {
        var x = Math.round(this.X(t)) + 0.5;
        ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, this.height); ctx.stroke();
      }, this);
    }
  };

  Panel.prototype.tickStep = function (v0, v1, origin, rel) {
    // The finest 1-2-5 spacing whose labels keep a clear gap between them: measured, not
    // guessed, so a chart of any width gets as many readable ticks as fit (a few hundred
    // pixels hold at least three).
    var ctx = this.ctx, pxPerUs = this.scale(), step = niceStep(v1 - v0, (this.width - GUTTER - RPAD) / 30);
    for (var k = 0; k < 40; k++) {
      var tw = Math.max(ctx.measureText(tickLabel(v0 - origin, step, rel)).width,
                        ctx.measureText(tickLabel(v1 - origin, step, rel)).width);
      if (step * pxPerUs >= tw + TICK_GAP) return step;
      step = niceUp(step);
    }
    return step;
  };

  Panel.prototype.drawTicks = function () {
    var ctx = this.ctx, v0 = this.v0(), v1 = this.v1(), origin = this.shift, rel = state.aligned !== null;
    var right = this.width - RPAD, lastRight = -Infinity;
    ctx.font = "11px sans-serif"; ctx.textBaseline = "middle";
    var step = this.tickStep(v0, v1, origin, rel);
    ctx.strokeStyle = "rgba(0,0,0,.07)"; ctx.fillStyle = "#555"; ctx.lineWidth = 1;
    this.ticks = [];
    for (var t = Math.ceil((v0 - origin) / step) * step; t + origin <= v1; t += step) {
      var x = Math.round(this.X(t + origin)) + 0.5, text = tickLabel(Math.abs(t) < step * 1e-6 ? 0 : t, step, rel);
      var tw = ctx.measureText(text).width, at = x + 3 + tw <= right ? x + 3 : x - 3 - tw;  // the last one left of its line
      ctx.beginPath(); ctx.moveTo(x, AXIS - 12); ctx.lineTo(x, this.height); ctx.stroke();
      if (at < GUTTER || at < lastRight + 4) continue;  // off the chart, or on its neighbour's label
      ctx.fillText(text, at, 9);
      lastRight = at + tw;
      this.ticks.push({ x: x, left: at, right: at + tw, text: text });
    }
  };

  Panel.prototype.drawLane = function (row, labels) {
    // Tasks at least a pixel wide are drawn as bars; narrower ones are added to per-pixel bins
    // (time covered per kind), drawn after as one column per pixel: the kind that covered most,
    // as tall as the fraction of the pixel that was busy.
    var ctx = this.ctx, T = this.tr.t, idx = row.idx, colors = D.colors, drawn = 0, k = this.scale();
    var y = row.y + 2, h = row.h - 4, x0 = this.v0(), x1 = this.v1(), nk = colors.length;
    var W = Math.ceil(this.width), bins = null;
    for (var j = lowerBound(row.maxEnd, x0); j < idx.length; j++) {
      var i = idx[j], s = T.s[i];
      if (s > x1) break;
      var e = T.e[i];
      if (e < x0) continue;
      drawn++;
      var x = GUTTER + (s - x0) * k, w = (e - s) * k;
      if (w < 1) {
        if (!bins) bins = new Float32Array(W * nk);
        var px = Math.floor(x);
        if (px >= 0 && px < W) bins[px * nk + T.k[i]] += Math.max(w, 0.02);
        continue;
      }
      ctx.fillStyle = colors[T.k[i]];
      ctx.fillRect(x, y, w > 3 ? w - 1 : w, h);
      if (w > 30) labels.push({ x: x, y: y, w: w > 3 ? w - 1 : w, h: h, name: T.name[i], bg: colors[T.k[i]] });
    }
    if (bins) {
      for (var p = 0; p < W; p++) {
        var best = -1, bestV = 0, total = 0;
        for (var q = 0; q < nk; q++) {
          var v = bins[p * nk + q];
          total += v;
          if (v > bestV) { bestV = v; best = q; }
        }
        if (best < 0) continue;
        var hh = Math.max(2, h * Math.min(total, 1));
        ctx.fillStyle = colors[best];
        ctx.fillRect(p, y + h - hh, 1, hh);
      }
    }
    row.drawn = drawn;
  };

  // Task names on their bars: cut (with an ellipsis) to what fits, clipped to the bar all the
  // same, in white or near-black, whichever contrasts more with the bar. this.labels says what
  // was drawn (for tests).
  function luminance(hex) {
    var c = [1, 3, 5].map(function (i) {
      var v = parseInt(hex.slice(i, i + 2), 16) / 255;
      return v <= 0.04045 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4);
    });
    return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2];
  }
  function contrast(a, b) { return (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05); }
  Panel.prototype.drawLabels = function (labels) {
    var ctx = this.ctx, right = this.width - RPAD, drawn = [];
    ctx.font = "11px sans-serif"; ctx.textBaseline = "middle";
    labels.forEach(function (l) {
      var x0 = Math.max(l.x, GUTTER), x1 = Math.min(l.x + l.w, right), room = x1 - x0 - 6, text = l.name;
      if (room < 14) return;
      if (ctx.measureText(text).width > room) {
        while (text.length > 1 && ctx.measureText(text + "\u2026").width > room) text = text.slice(0, -1);
        text += "\u2026";
        if (ctx.measureText(text).width > room) return;
      }
      var bg = luminance(l.bg), fg = contrast(bg, 1) >= contrast(bg, luminance("#111111")) ? "#ffffff" : "#111111";
      ctx.save(); ctx.beginPath(); ctx.rect(x0, l.y, x1 - x0, l.h); ctx.clip();
      ctx.fillStyle = fg; ctx.fillText(text, x0 + 3, l.y + l.h / 2);
      ctx.restore();
      drawn.push({ x0: x0, x1: x1, text: text, width: ctx.measureText(text).width, fg: fg, bg: l.bg,
                   contrast: contrast(bg, luminance(fg)) });
    });
    this.labels = drawn;
  };

  Panel.prototype.drawItems = function (row) {
    var ctx = this.ctx, items = row.items, y = row.y + 1, h = row.h - 2, k = this.scale(), x0 = this.v0(), x1 = this.v1();
    for (var j = 0; j < items.length; j++) {
      var it = items[j];
      if (it.e < x0 || it.s > x1) continue;
      var x = GUTTER + (it.s - x0) * k, w = Math.max(1, (it.e - it.s) * k);
      ctx.fillStyle = it.c;
      if (row.type === "slot") ctx.globalAlpha = 0.75;
      ctx.fillRect(x, y, w > 3 ? w - 1 : w, h);
      ctx.globalAlpha = 1;
    }
  };

  Panel.prototype.stepPath = function (pts, y0, yscale, close) { // a step function as a path
    var ctx = this.ctx, xEnd = this.X(this.tr.steps.length ? this.tr.steps[this.tr.steps.length - 1].e : 0);
    ctx.beginPath();
    ctx.moveTo(this.X(pts[0][0]), y0);
    for (var i = 0; i < pts.length; i++) {
      var x = this.X(pts[i][0]), yv = y0 - pts[i][1] * yscale;
      if (i) ctx.lineTo(x, y0 - pts[i - 1][1] * yscale);
      ctx.lineTo(x, yv);
    }
    ctx.lineTo(Math.max(xEnd, this.X(pts[pts.length - 1][0])), y0 - pts[pts.length - 1][1] * yscale);
    if (close) { ctx.lineTo(xEnd, y0); ctx.closePath(); }
  };

  Panel.prototype.note = function (text, y) { // a row's caption, on white so lines do not cross it
    var ctx = this.ctx;
    ctx.font = "10px sans-serif"; ctx.textBaseline = "top";
    ctx.fillStyle = "rgba(255,255,255,.85)"; ctx.fillRect(GUTTER + 2, y, ctx.measureText(text).width + 4, 11);
    ctx.fillStyle = "#444"; ctx.fillText(text, GUTTER + 4, y);
  };

  Panel.prototype.drawOcc = function (row) { // slots in use against the budget (dashed)
    var ctx = this.ctx, top = row.y + 3, bottom = row.y + row.h;
    var peak = 0;
    row.pts.forEach(function (p) { peak = Math.max(peak, p[1]); });
    var full = Math.max(row.budget, peak, 1), yscale = (bottom - top) / full;
    ctx.fillStyle = "rgba(78,121,167,.35)"; ctx.strokeStyle = "#4e79a7"; ctx.lineWidth = 1;
    this.stepPath(row.pts, bottom, yscale, true); ctx.fill();
    this.stepPath(row.pts, bottom, yscale, false); ctx.stroke();
    if (row.budget) {
      var yb = Math.round(bottom - row.budget * yscale) + 0.5;
      ctx.setLineDash([4, 3]); ctx.strokeStyle = "#c0392b";
      ctx.beginPath(); ctx.moveTo(GUTTER, yb); ctx.lineTo(this.width, yb); ctx.stroke();
      ctx.setLineDash([]);
    }
    this.note("budget " + (row.budget || "?") + (this.tr.inferred.indexOf(row.pool) >= 0 ? " (inferred)" : "") +
              ", peak " + peak, row.y);
  };

  Panel.prototype.drawMem = function (row) { // bytes held on the GPU and in pinned host memory
    var ctx = this.ctx, mem = this.tr.mem, top = row.y + 12, bottom = row.y + row.h, peak = 1;
    var places = Object.keys(mem), colors = { gpu: "#2ca02c", pinned: "#9467bd" };
    places.forEach(function (w) { mem[w].forEach(function (p) { peak = Math.max(peak, p[1]); }); });
    var yscale = (bottom - top) / peak;
    places.forEach(function (w) {
      ctx.strokeStyle = colors[w] || "#555"; ctx.lineWidth = 1.5;
      this.stepPath(mem[w], bottom, yscale, false); ctx.stroke();
    }, this);
    this.note(this.tr.memCaption, row.y);  // Python's words: the slots' bytes, and the run's where recorded
  };

  Panel.prototype.box = function (i) {
    var T = this.tr.t, row = this.rows[this.taskRow[i]], k = this.scale();
    return { x: this.X(T.s[i]), y: row.y + 2, w: Math.max(1, (T.e[i] - T.s[i]) * k), h: row.h - 4 };
  };
  Panel.prototype.outline = function (list, color, thick) {
    var ctx = this.ctx;
    ctx.strokeStyle = color; ctx.lineWidth = thick ? 2 : 1.5;
    for (var j = 0; j < list.length; j++) {
      var b = this.box(list[j]);
      ctx.strokeRect(b.x - 0.5, b.y - 0.5, b.w + 1, b.h + 1);
    }
  };
  Panel.prototype.markGaps = function (p) { // the gaps of one pattern, outlined on the idle row
    var ctx = this.ctx, row = this.rows.filter(function (r) { return r.type === "gap"; })[0];
    if (!row) return;
    ctx.strokeStyle = "#000"; ctx.lineWidth = 1.5;
    this.tr.gaps.forEach(function (g) {
      if (g.p !== p) return;
      var x = this.X(g.s), w = Math.max(2, this.X(g.e) - x);
      ctx.strokeRect(x - 1, row.y - 1, w + 2, row.h + 2);
    }, this);
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
  function valueAt(pts, t) { var v = 0; for (var i = 0; i < pts.length && pts[i][0] <= t; i++) v = pts[i][1]; return v; }
  Panel.prototype.hit = function (px, py) {
    var row = this.rowAt(py);
    if (!row || px < GUTTER) return null;
    var t = this.time(px), slack = 3 / this.scale(), T = this.tr.t, best = null, bestD = Infinity;
    if (row.type === "occ") return { type: "occ", row: row, t: t, n: valueAt(row.pts, t) };
    if (row.type === "mem") return { type: "mem", t: t };
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
    var T = this.tr.t, self = this;
    if (h.type === "occ") {
      return "<b>" + esc(h.row.pool) + "</b>: " + h.n + " slot" + (h.n === 1 ? "" : "s") + " in use of a budget of " +
        (h.row.budget || "?") + (this.tr.inferred.indexOf(h.row.pool) >= 0 ? " (inferred)" : "") +
        " at " + this.when(h.t, 1 / this.scale());
    }
    if (h.type === "mem") {
      return Object.keys(this.tr.mem).map(function (w) {
        return (w === "gpu" ? "GPU" : "pinned host") + " slots: " + fmtBytes(valueAt(self.tr.mem[w], h.t));
      }).join("<br>") + "<br>at " + this.when(h.t, 1 / this.scale());
    }
    if (h.type === "gap") {
      return "<b>" + esc(this.tr.gapLane) + " idle " + fmtTime(h.it.e - h.it.s) + "</b> (" + esc(h.it.r) + ")<br>" +
        this.between(h.it.s, h.it.e) + "<br>" + esc(h.it.text);
    }
    if (h.type === "slot") {
      return "<b>" + esc(h.it.pool + " slot #" + h.it.slot) + "</b><br>held by " + esc(T.name[h.it.h]) +
        "<br>" + this.between(h.it.s, h.it.e) + " (" + fmtTime(h.it.e - h.it.s) + "), " +
        h.it.n + " reader" + (h.it.n === 1 ? "" : "s");
    }
    var i = h.i, parts = ["<b>" + esc(T.name[i]) + "</b>"], dur = T.e[i] - T.s[i];
    parts.push("kind " + esc(D.kinds[T.k[i]]) + " \u00b7 lane " + esc(this.tr.lanes[T.l[i]]) + " \u00b7 step " + T.step[i]);
    parts.push("layer " + (T.layer[i] === null ? "\u2013" : T.layer[i]) + " \u00b7 micro-batch " +
               (T.mb[i] === null ? "\u2013" : T.mb[i]));
    parts.push("start " + this.when(T.s[i], Math.max(dur / 10, 1e-3)) + " \u00b7 duration " + fmtTime(dur));
    var gbs = rate(T.bytes[i], dur);
    parts.push("bytes " + fmtBytes(T.bytes[i]) + (gbs ? " at " + gbs : "") + (T.slot[i] ? " \u00b7 slot " + esc(T.slot[i]) : "") +
               (T.reads[i] ? " \u00b7 reads " + esc(T.reads[i]) : ""));
    if (T.part && T.part[i] !== null && T.part[i] !== undefined)
      parts.push("copied " + (100 * T.part[i]).toFixed(0) + "% of the unit's fullest fetch: experts no token was routed to stayed in host memory");
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
        zoomAt(self.time(Math.max(p[0], GUTTER)) - self.shift, Math.exp(ev.deltaY * 0.0015));
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
    span = Math.min(Math.max(span, 0.01), (FULL.x1 - FULL.x0) * 4);
    var f = (t - view.x0) / (view.x1 - view.x0);
    view.x0 = t - f * span; view.x1 = view.x0 + span;
  }
  function show(t0, t1) { var pad = (t1 - t0) * 0.02; view.x0 = t0 - pad; view.x1 = t1 + pad; schedule(); }
  function reset() { // every trace whole, however each is shifted (aligned at a step or its window)
    var lo = 0, hi = 0;
    panels.forEach(function (p) {
      var st = p.tr.steps, end = st.length ? st[st.length - 1].e : maxWall;
      lo = Math.min(lo, -p.shift); hi = Math.max(hi, end - p.shift);
    });
    var span = Math.max(hi - lo, 1);
    view.x0 = lo - span * 0.005; view.x1 = hi + span * 0.01; schedule();
  }

  var panels = D.traces.map(function (tr, n) { return new Panel(tr, document.getElementById("panel-" + n)); });
  function drawAll() {
    panels.forEach(function (p) { p.draw(); });
    var span = document.getElementById("ft-span");
    if (span) span.textContent = fmtSpan(view.x0, view.x1) + (state.aligned === null ? "" :
      " from each trace's " + (state.aligned === "window" ? "window" : "step " + state.aligned) + " start");
    if (window.ftViz && window.ftViz.onDraw) window.ftViz.onDraw();
  }
  function resizeAll() { panels.forEach(function (p) { p.resize(); }); drawAll(); }

  var bar = document.getElementById("ft-toolbar");
  function barHeight() { // the sticky toolbar's and titles' heights: scrolling stops short of them (CSS)
    root.style.setProperty("--ft-bar", (bar.offsetHeight + 4) + "px");
    var h2 = document.querySelector(".panel h2");
    root.style.setProperty("--ft-title", (h2 ? h2.offsetHeight : 0) + "px");
  }
  // Scroll a panel's chart to just under the toolbar, so that its top lanes are in view.
  function reveal(p) { barHeight(); p.canvas.scrollIntoView({ block: "start" }); }
  bar.querySelector("[data-act=reset]").addEventListener("click", reset);
  bar.querySelector("[data-act=in]").addEventListener("click", function () { zoomAt((view.x0 + view.x1) / 2, 0.5); schedule(); });
  bar.querySelector("[data-act=out]").addEventListener("click", function () { zoomAt((view.x0 + view.x1) / 2, 2); schedule(); });
  bar.querySelector("[data-act=crit]").addEventListener("change", function (ev) { state.critical = ev.target.checked; schedule(); });
  window.addEventListener("resize", function () { barHeight(); resizeAll(); });
  barHeight();

  // for the summary script, tests and the console
  window.ftViz = { D: D, view: view, FULL: FULL, state: state, panels: panels, redraw: drawAll, reset: reset,
                   zoomAt: zoomAt, show: show, schedule: schedule, fmtTime: fmtTime, fmtBytes: fmtBytes,
                   fmtOffset: fmtOffset, fmtSpan: fmtSpan, rate: rate, esc: esc, reveal: reveal, barHeight: barHeight };
  resizeAll();
  root.setAttribute("data-ft-lanes", JSON.stringify(panels.map(function (p) {
    return { trace: p.tr.label, lanes: JSON.parse(p.canvas.getAttribute("data-drawn")) };
  })));
})();
"""
