"""The report's window script, inlined into every HTML file after the drawing script.

``SUMMARY_JS`` owns the window: the brush (a strip of steps, drag across them), the summaries
(sums of the per-step rows Python computed in :mod:`flowtrain.viz.steps`, so every number
covers the window and says which), the per-step and comparison tables, the gap patterns (a
click zooms to the next gap of the pattern and scrolls its chart into view) and "align at
step". It adds ``setWindow(first, last, which)`` (one trace's window, or every trace's) and
``align(step)`` to ``window.ftViz``, writes each
panel's numbers into its ``data-window`` (for tests and the console), and, when done,
``data-ft-render-ms`` and ``data-ft-ready`` on ``<html>``.

Compute's time in the window is cut as Python cuts it (:mod:`flowtrain.viz.steps`): busy +
idle + tail = the window, and "compute busy" is busy over busy + idle, per step and for the
window alike. The brush is scaled to the longest step that is not warm-up (Python's
``brushMax``) and labels each bar with its time. With several traces the page opens with each
counted from the start of its own window ("align at: window start"), so no trace is shown
inside another's warm-up.
"""

SUMMARY_JS = r"""
(function () {
  "use strict";
  var F = window.ftViz, panels = F.panels, fmtTime = F.fmtTime, fmtBytes = F.fmtBytes, esc = F.esc;
  var root = document.documentElement;
  function pct(x) { return (100 * x).toFixed(1) + "%"; }
  function add(into, from) { for (var k in from) into[k] = (into[k] || 0) + from[k]; }
  function median(xs) {
    var s = xs.slice().sort(function (a, b) { return a - b; }), n = s.length;
    return n ? (n % 2 ? s[(n - 1) / 2] : (s[n / 2 - 1] + s[n / 2]) / 2) : 0;
  }
  function laneKind(lane) { return lane.split(":")[0]; }
  function computeBusy(busy, active) { return active > 0 ? busy / active : 0; }
  function stepBusy(r) { return computeBusy(r.busy.compute || 0, r.e - r.s - r.tail); }

  // The window's numbers: sums of its steps' rows (Python's flowtrain.viz.steps.window_summary).
  function fold(p) {
    var rows = p.tr.steps.filter(function (r) { return r.step >= p.win.first && r.step <= p.win.last; });
    var w = { rows: rows, n: rows.length, tasks: {}, busy: {}, bytes: {}, why: {}, area: {}, peak: {},
              cc: 0, co: 0, cu: 0, cp: 0, idle: 0, tail: 0 };
    if (!rows.length) return w;
    w.s = rows[0].s; w.e = rows[rows.length - 1].e; w.dur = w.e - w.s; w.stepTime = w.dur / rows.length;
    rows.forEach(function (r) {
      add(w.tasks, r.tasks); add(w.busy, r.busy); add(w.bytes, r.bytes); add(w.why, r.why); add(w.area, r.area);
      for (var k in r.peak) w.peak[k] = Math.max(w.peak[k] || 0, r.peak[k]);
      w.cc += r.cc; w.co += r.co; w.cu += r.cu; w.cp += r.cp; w.idle += r.idle; w.tail += r.tail;
    });
    w.frac = {};
    for (var lane in w.busy) w.frac[lane] = w.dur ? w.busy[lane] / w.dur : 0;
    w.active = w.dur - w.tail;  // busy + idle: the time compute had work coming
    w.computeBusy = computeBusy(w.busy.compute || 0, w.active);
    w.copyHidden = w.co ? w.cc / w.co : 0; w.cpuHidden = w.cp ? w.cu / w.cp : 0;
    w.compute = F.foldCompute(p, w);
    w.outliers = F.foldOutliers(p, w);
    return w;
  }
  function windowLabel(p, w) {
    if (!w.n) return "no steps of this trace in steps " + p.win.first + "\u2013" + p.win.last;
    var a = w.rows[0].step, b = w.rows[w.n - 1].step;
    return (a === b ? "step " + a : "steps " + a + "\u2013" + b) + " (" + w.n + " of " + p.tr.steps.length +
      ", " + fmtTime(w.dur) + ")";
  }
  // min / median / max over the window's steps: step time, and each lane kind's busy fraction
  // (compute's of busy + idle, as the headline's; the others' of the step's time)
  function perStep(w) {
    var out = [["step time", w.rows.map(function (r) { return r.e - r.s; }), fmtTime]];
    var kinds = [];
    w.rows.forEach(function (r) { for (var l in r.busy) if (kinds.indexOf(laneKind(l)) < 0) kinds.push(laneKind(l)); });
    kinds.forEach(function (kd) {
      out.push([kd + " busy", w.rows.map(function (r) {
        if (kd === "compute") return stepBusy(r);
        var b = 0; for (var l in r.busy) if (laneKind(l) === kd) b = Math.max(b, r.busy[l]);
        return r.e > r.s ? b / (r.e - r.s) : 0;
      }), pct]);
    });
    return out.map(function (x) {
      var xs = x[1];
      return { name: x[0], min: Math.min.apply(null, xs), med: median(xs), max: Math.max.apply(null, xs), fmt: x[2] };
    });
  }

  // The window's gaps, grouped by pattern; each pattern's verdict is the one of most idle time
  // among its gaps (Python's flowtrain.viz.verdicts.pattern_verdicts), with its copy lane's busy share.
  function patternRows(p, w) {
    var groups = {};
    p.tr.gaps.forEach(function (g) {
      if (!w.n || g.e <= w.s || g.s >= w.e) return;
      var d = Math.min(g.e, w.e) - Math.max(g.s, w.s), o = groups[g.p] || (groups[g.p] = { p: g.p, n: 0, total: 0, longest: 0, by: {} });
      o.n += 1; o.total += d; o.longest = Math.max(o.longest, d);
      var v = o.by[g.v] || (o.by[g.v] = { t: 0, busy: 0, gap: 0 });
      v.t += d; v.busy += g.vb; v.gap += g.e - g.s;
    });
    return Object.keys(groups).map(function (k) {
      var o = groups[k], best = null;
      Object.keys(o.by).forEach(function (v) {
        var key = p.tr.verdicts[v].key, bk = best === null ? null : p.tr.verdicts[best].key;
        if (best === null || o.by[v].t > o.by[best].t || (o.by[v].t === o.by[best].t && key > bk)) best = v;
      });
      var vd = p.tr.verdicts[best], b = o.by[best];
      o.verdict = vd.text + (vd.lane && b.gap > 0 ? " (" + vd.lane + " busy " + Math.round(100 * b.busy / b.gap) + "% of these gaps)" : "");
      o.vkey = vd.key;
      return o;
    }).sort(function (a, b) { return b.total - a.total; });
  }

  function summaryHtml(p, w) {
    var tr = p.tr, h = [];
    h.push("<div class=whichwin>window: <b>" + esc(windowLabel(p, w)) + "</b>" +
           (p.win.why ? " &middot; " + esc(p.win.why) : "") + "</div>");
    if (!w.n) return h.join("");
    var cb = perStep(w)[1];  // compute busy per step (min / median / max)
    h.push("<div>step time <b>" + fmtTime(w.stepTime) + "</b> (the window over its " + w.n + " step" + (w.n > 1 ? "s" : "") +
           "), compute busy <b class=headbusy>" + pct(w.computeBusy) + "</b> of busy + idle" +
           (cb && cb.name === "compute busy" ? " (per step: median " + pct(cb.med) + ", min " + pct(cb.min) + ", max " +
            pct(cb.max) + ")" : "") + "</div>");
    var why = Object.keys(w.why).filter(function (r) { return w.why[r] > 0; }).sort(function (a, b) { return w.why[b] - w.why[a]; });
    var marked = 0; why.forEach(function (r) { marked += w.why[r]; });
    h.push("<div class=basis>compute's " + fmtTime(w.dur) + ": busy " + fmtTime(w.busy.compute || 0) + " + idle " +
           fmtTime(w.idle) + " + tail " + fmtTime(w.tail) + " (after compute's last task: nothing left to compute)</div>");
    h.push("<div>compute idle " + fmtTime(w.idle) + ": marked gaps (longer than " + fmtTime(tr.minGap) + ") " +
           (why.map(function (r) { return esc(r) + " " + fmtTime(w.why[r]); }).join(", ") || "none") +
           "; shorter gaps " + fmtTime(Math.max(w.idle - marked, 0)) + "</div>");
    h.push("<div>overlap: compute hid <b>" + pct(w.copyHidden) + "</b> of copy time (" + fmtTime(w.cc) + " of " +
           fmtTime(w.co) + ") and " + pct(w.cpuHidden) + " of CPU time (" + fmtTime(w.cu) + " of " + fmtTime(w.cp) + ")</div>");
    var pools = Object.keys(tr.budgets);
    if (pools.length) {
      h.push("<div>slots: " + pools.map(function (pl) {
        return esc(pl) + " budget " + tr.budgets[pl] + (tr.inferred.indexOf(pl) >= 0 ? " (inferred)" : "") +
          ", peak " + (w.peak[pl] || 0) + ", mean " + ((w.area[pl] || 0) / w.dur).toFixed(2);
      }).join("; ") + "</div>");
    }
    h.push(F.computeHtml(p, w.compute));
    h.push(F.outliersHtml(p, w.outliers));
    var lanes = tr.lanes.map(function (l) {
      var gbs = laneKind(l) === "h2d" || laneKind(l) === "d2h" ? F.rate(w.bytes[l] || 0, w.busy[l] || 0) : "";
      return "<tr><td>" + esc(l) + "</td><td>" + (w.tasks[l] || 0) + "</td><td>" + fmtTime(w.busy[l] || 0) + "</td><td>" +
        pct(w.frac[l] || 0) + "</td><td>" + fmtBytes(w.bytes[l] || 0) + "</td><td>" + gbs + "</td></tr>";
    }).join("");
    h.push("<table class=lanes><tr><th>lane</th><th>tasks</th><th>busy</th><th>busy % of window</th><th>bytes</th>" +
           "<th>copy rate</th></tr>" + lanes + "</table>");
    var ps = perStep(w).map(function (r) {
      return "<tr><td>" + r.name + "</td><td>" + r.fmt(r.min) + "</td><td>" + r.fmt(r.med) + "</td><td>" + r.fmt(r.max) + "</td></tr>";
    }).join("");
    h.push("<table class=steps><tr><th>per step</th><th>min</th><th>median</th><th>max</th></tr>" + ps + "</table>");
    var each = tr.steps.map(function (r) {
      var inw = r.step >= p.win.first && r.step <= p.win.last;
      return "<tr" + (r.warm ? " class=warm" : "") + "><td>" + r.step + (inw ? "" : " (outside)") + "</td><td>" +
        fmtTime(r.e - r.s) + "</td><td>" + pct(stepBusy(r)) + "</td><td>" + fmtTime(r.idle) + "</td><td>" +
        (r.tail > 0 ? fmtTime(r.tail) : "") + "</td><td>" + (r.warm ? "warm-up" : "") + "</td></tr>";
    }).join("");
    h.push("<details><summary>every step (" + tr.steps.length + ")</summary><table><tr><th>step</th><th>time</th>" +
           "<th>compute busy</th><th>idle</th><th>tail</th><th></th></tr>" + each + "</table></details>");
    var pr = patternRows(p, w);
    if (pr.length) {
      h.push("<table class=patterns><tr><th>compute idle, by pattern (click: zoom to the next gap)</th><th>gaps</th>" +
             "<th>total</th><th>longest</th><th>what bounds it</th></tr>" + pr.map(function (g) {
               var pat = tr.patterns[g.p];
               return "<tr class=pattern data-p=" + g.p + "><td><span class=sw style='background:" + pat.c + "'></span>" +
                 esc(pat.text) + "</td><td>" + g.n + "</td><td>" + fmtTime(g.total) + "</td><td>" + fmtTime(g.longest) +
                 "</td><td class=verdict data-verdict='" + esc(g.vkey) + "'>" + esc(g.verdict) + "</td></tr>";
             }).join("") + "</table>");
    }
    return h.join("");
  }

  function renderPanel(p) {
    var w = fold(p), box = p.el.querySelector(".summary");
    box.innerHTML = summaryHtml(p, w);
    p.el.setAttribute("data-window", JSON.stringify(w.n ? {
      first: w.rows[0].step, last: w.rows[w.n - 1].step, steps: w.n, start: w.s, end: w.e, stepTime: w.stepTime,
      busy: w.frac, computeBusy: w.computeBusy, busyUs: w.busy.compute || 0, tail: w.tail,
      copyHidden: w.copyHidden, idle: w.idle, why: w.why, peak: w.peak,
      patterns: patternRows(p, w).map(function (g) { return [p.tr.patterns[g.p].text, g.n, g.verdict]; }),
      compute: w.compute.kinds.map(function (o) { return { kind: o.kind, tasks: o.n, us: o.t, share: o.share, slow: o.slow }; }),
      flops: w.compute.flops,
      late: w.outliers.late.map(function (x) { return [p.tr.t.name[x.i], x.v]; }),
      long: w.outliers.long.map(function (x) { return [p.tr.t.name[x.i], x.v, x.med]; }) } : { steps: 0 }));
    Array.prototype.forEach.call(box.querySelectorAll("tr.pattern"), function (row) {
      row.addEventListener("click", function () { nextGap(p, +row.getAttribute("data-p"), w); });
    });
    return w;
  }
  function nextGap(p, pat, w) { // zoom to the pattern's next gap in the window, and mark them all
    var gs = p.tr.gaps.filter(function (g) { return g.p === pat && g.e > w.s && g.s < w.e; });
    if (!gs.length) return;
    p.cursor = p.marked === pat ? (p.cursor + 1) % gs.length : 0;
    p.marked = pat;
    var g = gs[p.cursor], span = Math.max((g.e - g.s) * 8, 1);
    F.show(g.s - p.shift - span / 2, g.e - p.shift + span / 2);
    F.reveal(p);  // the table is below the chart: bring the chart (top lanes first) into view
  }

  function renderCompare(ws) {
    var box = document.getElementById("ft-compare");
    if (panels.length < 2) { box.innerHTML = ""; return; }
    function row(name, fn) {
      return "<tr><td>" + name + "</td>" + ws.map(function (w, i) { return "<td>" + (w.n ? fn(w, panels[i]) : "\u2013") + "</td>"; }).join("") + "</tr>";
    }
    function mm(w, which) { var r = perStep(w)[0]; return fmtTime(r[which]); }
    box.innerHTML = "<h2>Comparison</h2><table><tr><th></th>" + panels.map(function (p) { return "<th>" + esc(p.tr.label) + "</th>"; }).join("") + "</tr>" +
      row("window", function (w, p) { return esc(windowLabel(p, w)); }) +
      row("step time (window / steps)", function (w) { return fmtTime(w.stepTime); }) +
      row("step time min / median / max", function (w) { return mm(w, "min") + " / " + mm(w, "med") + " / " + mm(w, "max"); }) +
      row("compute busy (of busy + idle)", function (w) { return pct(w.computeBusy); }) +
      row("copy hidden by compute", function (w) { return pct(w.copyHidden); }) +
      row("compute idle per step", function (w) { return fmtTime(w.idle / w.n); }) +
      row("tail (after compute's last task)", function (w) { return fmtTime(w.tail); }) +
      row("model FLOP/s", function (w) { return w.compute.flops !== null ? F.fmtFlops(w.compute.flops) + "/s" : "not recorded"; }) +
      row("compute by kind", function (w) {
        return w.compute.kinds.slice(0, 3).map(function (o) { return esc(o.kind) + " " + pct(o.share); }).join(", ");
      }) +
      row("largest idle reason", function (w) {
        var r = Object.keys(w.why).sort(function (a, b) { return w.why[b] - w.why[a]; })[0];
        return r && w.why[r] > 0 ? esc(r) + " " + fmtTime(w.why[r]) : "none";
      }) + "</table>";
  }

  function renderAll() {
    var ws = panels.map(renderPanel);
    renderCompare(ws);
    panels.forEach(function (p, n) {
      var label = document.getElementById("ft-window-" + n);
      if (label) label.textContent = (p.win.first === p.win.last ? "step " + p.win.first : "steps " + p.win.first + "\u2013" + p.win.last) +
        (p.missed ? " *" : "");
      if (label && p.missed) label.title = p.tr.window.why;
    });
    drawBrushes();
    F.schedule();
  }

  // ---- the brushes: one row per trace, a bar per step of it; drag across steps to choose its window
  // Bars are scaled to the trace's longest step that is not warm-up (brushMax): a warm-up step ten
  // times longer is drawn cut at full height (white notches) rather than flattening the rest. Each
  // bar is labelled with its step and its time where they fit (on a white halo, readable on any
  // bar); F.brushBars[n] says what was drawn for trace n.
  var BRUSH_H = 20;
  F.brushBars = [];
  F.brushH = BRUSH_H;
  function drawBrush(p, n, sel) {
    var brush = p.brush, steps = p.tr.steps, dpr = window.devicePixelRatio || 1, W = brush.clientWidth || 600, H = BRUSH_H;
    brush.width = Math.round(W * dpr); brush.height = Math.round(H * dpr);
    var ctx = brush.getContext("2d"), bw = W / Math.max(steps.length, 1), most = Math.max(p.tr.brushMax, 1e-3), bars = [];
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.font = "9px sans-serif"; ctx.textBaseline = "middle"; ctx.lineJoin = "round";
    var a = sel ? sel[0] : p.win.first, b = sel ? sel[1] : p.win.last;
    steps.forEach(function (r, i) {
      var d = r.e - r.s, inw = r.step >= a && r.step <= b, cut = d > most * 1.0001;
      var h = Math.max(3, H * Math.min(d / most, 1)), x = i * bw, label = fmtTime(d);
      ctx.fillStyle = inw ? "#dce8f8" : "#fff"; ctx.fillRect(x, 0, bw, H);
      ctx.fillStyle = r.warm ? "#e8a25a" : (inw ? "#2a6bd1" : "#9db4d3");
      ctx.fillRect(x + 1, H - h, Math.max(bw - 2, 1), h);
      if (cut) { ctx.fillStyle = "#fff"; ctx.fillRect(x + 1, H - h + 3, Math.max(bw - 2, 1), 2); ctx.fillRect(x + 1, H - h + 7, Math.max(bw - 2, 1), 2); }
      var both = r.step + "  " + label, stepText = String(r.step), text = "";
      if (ctx.measureText(both).width + 6 <= bw) text = both; else if (ctx.measureText(stepText).width + 4 <= bw) text = stepText;
      if (text) {
        ctx.strokeStyle = "rgba(255,255,255,.9)"; ctx.lineWidth = 3; ctx.strokeText(text, x + 3, H / 2);
        ctx.fillStyle = "#111"; ctx.fillText(text, x + 3, H / 2);
      }
      bars.push({ step: r.step, h: h, label: text === both ? label : "", cut: cut, time: d });
    });
    F.brushBars[n] = bars;
    brush.title = p.tr.label + "\n" + steps.map(function (r) { return "step " + r.step + ": " + fmtTime(r.e - r.s); }).join("\n");
  }
  function drawBrushes() { panels.forEach(function (p, n) { if (p.brush) drawBrush(p, n); }); }
  // One trace's window: the others keep theirs (each is chosen in its own steps).
  function setWindow(first, last, which) {
    var chosen = which === undefined ? panels : [panels[which]];
    chosen.forEach(function (p) { p.win = { first: Math.min(first, last), last: Math.max(first, last), why: "brushed" }; p.marked = null; p.missed = false; });
    renderAll();
    if (F.state.aligned === "window") { align("window"); return; }  // each trace from its own window's start
    var sp = chosen[0].windowSpan();
    if (sp) F.show(sp[0] - chosen[0].shift, sp[1] - chosen[0].shift);
  }
  var drag = null;  // { n: the trace, i: the step index where the drag began }
  function brushIndex(p, ev) {
    var r = p.brush.getBoundingClientRect(), m = p.tr.steps.length;
    return Math.min(m - 1, Math.max(0, Math.floor((ev.clientX - r.left) / r.width * m)));
  }
  panels.forEach(function (p, n) {
    p.brush = document.getElementById("ft-brush-" + n);
    p.missed = /is not in this trace/.test(p.tr.window.why);
    if (!p.brush) return;
    p.brush.addEventListener("mousedown", function (ev) {
      drag = { n: n, i: brushIndex(p, ev) };
      var st = p.tr.steps[drag.i].step; drawBrush(p, n, [st, st]);
    });
  });
  window.addEventListener("mousemove", function (ev) {
    if (drag === null) return;
    var p = panels[drag.n], j = brushIndex(p, ev), st = p.tr.steps;
    drawBrush(p, drag.n, [st[Math.min(drag.i, j)].step, st[Math.max(drag.i, j)].step]);
  });
  window.addEventListener("mouseup", function (ev) {
    if (drag === null) return;
    var n = drag.n, p = panels[n], j = brushIndex(p, ev), i = drag.i, st = p.tr.steps;
    drag = null;
    setWindow(st[Math.min(i, j)].step, st[Math.max(i, j)].step, n);
  });

  // ---- align at step: every trace's time counts from the start of that step ------------------
  // ("window start": each trace from the start of its own window, which may be another step)
  var sel = document.querySelector("#ft-toolbar [data-act=align]");
  var winOpt = document.createElement("option");
  winOpt.value = "window"; winOpt.textContent = "window start"; sel.appendChild(winOpt);
  var ref = panels.reduce(function (a, p) { return p.tr.steps.length > a.tr.steps.length ? p : a; }, panels[0]);
  ref.tr.steps.forEach(function (r) {
    var o = document.createElement("option"); o.value = String(r.step); o.textContent = "step " + r.step; sel.appendChild(o);
  });
  function align(step) {
    F.state.aligned = step === null || step === "" ? null : (step === "window" ? "window" : +step);
    var longest = 0;
    panels.forEach(function (p) {
      if (F.state.aligned === "window") {
        var sp = p.windowSpan();
        p.shift = sp ? sp[0] : 0;
        if (sp) longest = Math.max(longest, sp[1] - sp[0]);
      } else {
        var r = F.state.aligned === null ? null : p.tr.steps.filter(function (s) { return s.step === F.state.aligned; })[0];
        p.shift = r ? r.s : 0;
        if (r) longest = Math.max(longest, (r.e - r.s) * 1.5);
      }
      p.el.setAttribute("data-shift", String(p.shift));
    });
    sel.value = F.state.aligned === null ? "" : String(F.state.aligned);
    if (F.state.aligned === null) F.reset(); else F.show(0, longest);
  }
  sel.addEventListener("change", function () { align(sel.value); });

  F.setWindow = setWindow; F.align = align; F.fold = fold;
  panels.forEach(function (p) { p.win.why = p.tr.window.why; });
  window.addEventListener("resize", drawBrushes);
  renderAll();
  // Open on the window (double-click or reset: everything); several traces each on its own
  // window, counted from its start, so that none is shown inside another's warm-up.
  if (panels.length > 1) align("window");
  var first = panels[0].windowSpan();
  if (first && panels.length === 1) { var pad = (first[1] - first[0]) * 0.02; F.view.x0 = first[0] - pad; F.view.x1 = first[1] + pad; }
  F.redraw();
  root.setAttribute("data-ft-render-ms", performance.now().toFixed(1));
  root.setAttribute("data-ft-ready", "1");
})();
"""
