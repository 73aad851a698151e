"""The report's stylesheet and scripts, inlined into every HTML file (no network, no files).

They live in a Python module rather than as package data so that an installed wheel always has
them. ``GUARD_JS`` runs first, in ``<head>``: it counts uncaught errors, rejected promises and
``console.error`` calls into ``<html data-ft-errors>`` so that a headless browser's
``--dump-dom`` shows them. The drawing script is :mod:`flowtrain.viz.page_js`, the window and
summaries :mod:`flowtrain.viz.summary_js`.
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
.toolbar { position: sticky; top: 0; background: #fff; padding: 3px 0; z-index: 2;
           border-bottom: 1px solid #eee; }
/* Scrolling (a gap pattern's click, a link) stops under the sticky toolbar and a panel's sticky
   title, never behind them: the page script keeps --ft-bar at the toolbar's height and
   --ft-title at a title's. */
html { scroll-padding-top: calc(var(--ft-bar, 0px) + var(--ft-title, 0px)); }
.toolbar button { margin-right: 4px; }
.panel { margin: 10px 0 18px; }
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
.toolbar .controls { white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.toolbar button { padding: 1px 6px; }
.brushrow { display: flex; align-items: center; gap: 6px; margin-top: 2px; }
.brushrow .bl { flex: 0 0 170px; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; font-size: 11px; color: #333; }
.brushrow .bw { flex: 0 0 auto; font-size: 11px; min-width: 70px; }
canvas.brush { display: block; flex: 1 1 auto; min-width: 0; height: 20px; cursor: crosshair; border: 1px solid #e5e5e5; }
/* each panel's title stays in view, just under the toolbar, while its chart and tables scroll */
.panel h2 { position: sticky; top: var(--ft-bar, 0px); background: #fff; z-index: 1; margin: 0; padding: 6px 0 4px; }
.legend { margin: 4px 0; }
tr.pattern { cursor: pointer; } tr.pattern:hover td { background: #eef3fb; }
tr.warm td { color: #a0522d; }
.whichwin { font-size: 12px; color: #335; margin: 4px 0; }
td.layers, td.verdict { text-align: left; } td.verdict { max-width: 520px; } .slow { color: #b03a2e; font-weight: 600; }
.flopsline { margin: 0 0 8px; }
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
