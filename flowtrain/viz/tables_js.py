"""The report's tables of where compute went, inlined after the drawing script.

``TABLES_JS`` adds to ``window.ftViz`` what :mod:`flowtrain.viz.summary_js` draws under each
trace for its window: ``foldCompute(p, w)`` sums the window's steps' compute time by kind and
layer (Python's :func:`flowtrain.viz.compute.compute_table`: the same rows, shares and model
FLOP/s) and ``computeHtml`` draws it, a slow layer called out beside its kind;
``foldOutliers(p, w)`` finds the window's late starts and long tasks (Python's
:mod:`flowtrain.viz.outliers`, from each task's ready time ``t.r``) and ``outliersHtml`` lists
them, a row per lane or kind.
"""

TABLES_JS = r"""
(function () {
  "use strict";
  var F = window.ftViz, fmtTime = F.fmtTime, esc = F.esc;
  function pct(x) { return (100 * x).toFixed(1) + "%"; }
  function median(xs) {
    var s = xs.slice().sort(function (a, b) { return a - b; }), n = s.length;
    return n ? (n % 2 ? s[(n - 1) / 2] : (s[n / 2 - 1] + s[n / 2]) / 2) : 0;
  }
  function fmtFlops(x) { // "413 TFLOP/s"
    var u = ["", "k", "M", "G", "T", "P", "E"], i = 0;
    while (x >= 1000 && i < u.length - 1) { x /= 1000; i++; }
    return x.toPrecision(3) + " " + u[i] + "FLOP";
  }
  // the slowest layer where it stands out: [layer, times the median layer], as Python's KindRow.slow_layer
  function slowLayer(mean) {
    var ls = Object.keys(mean).map(Number);
    if (ls.length < 3) return null;
    var med = median(ls.map(function (l) { return mean[l]; })), best = ls[0];
    ls.forEach(function (l) { if (mean[l] > mean[best] || (mean[l] === mean[best] && l < best)) best = l; });
    var ratio = med > 0 ? mean[best] / med : 0;
    return ratio >= F.D.slowLayer ? [best, ratio] : null;
  }
  // The window's compute time by kind (and layer): sums of its steps' rows.
  function foldCompute(p, w) {
    var kinds = {}, busy = 0;
    w.rows.forEach(function (r) {
      for (var k in r.ck) {
        var c = r.ck[k], o = kinds[k] || (kinds[k] = { kind: k, n: 0, t: 0, L: {} });
        o.n += c[0]; o.t += c[1]; busy += c[1];
        for (var l in c[2]) { var q = o.L[l] || (o.L[l] = [0, 0]); q[0] += c[2][l][0]; q[1] += c[2][l][1]; }
      }
    });
    var rows = Object.keys(kinds).map(function (k) { return kinds[k]; })
      .sort(function (a, b) { return b.t - a.t || (a.kind < b.kind ? -1 : 1); });
    rows.forEach(function (o) {
      o.share = busy > 0 ? o.t / busy : 0; o.mean = {};
      for (var l in o.L) if (o.L[l][0]) o.mean[l] = o.L[l][1] / o.L[l][0];
      o.slow = slowLayer(o.mean);
    });
    var fps = p.tr.flopsPerStep;
    return { kinds: rows, busy: busy, perStep: fps, flops: fps && w.dur > 0 ? fps * w.n / (w.dur / 1e6) : null };
  }
  function layerCell(o) {
    var ls = Object.keys(o.mean);
    if (!ls.length) return "";
    var all = ls.map(function (l) { return "L" + l + " " + fmtTime(o.mean[l]); }).join(", ");
    if (o.slow) {
      var med = median(ls.map(function (l) { return o.mean[l]; }));
      return "<span class=slow title='" + esc(all) + "'>L" + o.slow[0] + " " + o.slow[1].toFixed(2) + "\u00d7 the median layer (" +
        fmtTime(o.mean[o.slow[0]]) + " against " + fmtTime(med) + " a task)</span>";
    }
    return "<span title='" + esc(all) + "'>" + (ls.length < 3 ? ls.length + " layer" + (ls.length > 1 ? "s" : "") :
      "even over " + ls.length + " layers (within " + Math.round((F.D.slowLayer - 1) * 100) + "%)") + "</span>";
  }
  function computeHtml(p, c) {
    if (!c.kinds.length) return "";
    var flops = c.flops !== null ? "model FLOP/s <b class=flops>" + fmtFlops(c.flops) + "/s</b> over the window's time (" +
        fmtFlops(c.perStep) + "s a step, as MFU counts them)" :
      "model FLOP/s: this trace does not record the model's FLOPs (a trace from <code>flowtrain train --trace</code> does)";
    return "<table class=compute><tr><th>compute by kind</th><th>tasks</th><th>time</th><th>share of busy</th>" +
      "<th>mean task</th><th>per layer (mean task)</th></tr>" + c.kinds.map(function (o) {
        return "<tr data-kind='" + esc(o.kind) + "'><td><span class=sw style='background:" + F.D.colors[F.D.kinds.indexOf(o.kind)] +
          "'></span>" + esc(o.kind) + "</td><td>" + o.n + "</td><td>" + fmtTime(o.t) + "</td><td>" + pct(o.share) + "</td><td>" +
          fmtTime(o.n ? o.t / o.n : 0) + "</td><td class=layers>" + layerCell(o) + "</td></tr>";
      }).join("") + "</table><div class=flopsline>" + flops + "</div>";
  }
  // What the schedule does not explain in the window (Python's flowtrain.viz.outliers): tasks
  // that began over D.late after all they waited for had finished (t.r: when that was), and
  // tasks over D.longFactor times the median of their kind on their lane kind and D.late more.
  function foldOutliers(p, w) {
    var t = p.tr.t, late = [], groups = {}, long = [];
    for (var i = 0; i < t.s.length; i++) {
      if (t.s[i] < w.s || t.s[i] >= w.e) continue;
      var lane = p.tr.lanes[t.l[i]].split(":")[0], key = F.D.kinds[t.k[i]] + " tasks on " + lane;
      if (t.r[i] !== null && t.s[i] - t.r[i] > F.D.late) late.push({ i: i, what: "late starts on " + lane, v: t.s[i] - t.r[i] });
      (groups[key] = groups[key] || []).push(i);
    }
    Object.keys(groups).forEach(function (key) {
      var is = groups[key];
      if (is.length < F.D.longMin) return;
      var med = median(is.map(function (i) { return t.e[i] - t.s[i]; }));
      is.forEach(function (i) {
        var d = t.e[i] - t.s[i];
        if (d > F.D.longFactor * med && d - med > F.D.late) long.push({ i: i, what: "long " + key, v: d, med: med });
      });
    });
    return { late: late, long: long };
  }
  // One row per lane (late starts) or kind (long tasks), the worst first in each part.
  function outliersHtml(p, o) {
    var t = p.tr.t;
    function rows(xs, worst) {
      var by = {};
      xs.forEach(function (x) { (by[x.what] = by[x.what] || []).push(x); });
      return Object.keys(by).map(function (k) {
        var g = by[k].slice().sort(function (a, b) { return b.v - a.v; });
        return { what: k, g: g, worst: worst(g[0]) };
      }).sort(function (a, b) { return b.worst - a.worst; });
    }
    var all = rows(o.late, function (x) { return x.v; }).concat(rows(o.long, function (x) { return x.v - x.med; }));
    if (!all.length) return "<div class=outliers>late starts and long tasks: none in the window</div>";
    return "<table class=outliers><tr><th>not explained by the schedule</th><th>tasks</th><th>how late or long</th>" +
      "<th>steps</th><th>worst</th></tr>" + all.map(function (r) {
        var lo = r.g[r.g.length - 1].v, hi = r.g[0].v, steps = [];
        r.g.forEach(function (x) { if (steps.indexOf(t.step[x.i]) < 0) steps.push(t.step[x.i]); });
        steps.sort(function (a, b) { return a - b; });
        return "<tr><td>" + esc(r.what) + (r.g[0].med !== undefined ? " (median " + fmtTime(r.g[0].med) + ")" : "") +
          "</td><td>" + r.g.length + "</td><td>" + fmtTime(lo) + (hi > lo ? "–" + fmtTime(hi) : "") + "</td><td>" +
          steps.join(", ") + "</td><td>" + r.g.slice(0, 3).map(function (x) { return esc(t.name[x.i]) + " " + fmtTime(x.v); }).join(", ") +
          (r.g.length > 3 ? " and " + (r.g.length - 3) + " more" : "") + "</td></tr>";
      }).join("") + "</table>";
  }
  F.foldCompute = foldCompute; F.computeHtml = computeHtml; F.fmtFlops = fmtFlops; F.median = median;
  F.foldOutliers = foldOutliers; F.outliersHtml = outliersHtml;
})();
"""
