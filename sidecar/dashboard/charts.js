// Trend charts over uPlot (vendor/uPlot.iife.min.js): a sample history kept in the page and
// one small time-series chart per metric. uPlot's own legend is off (it would show instance
// ids through markup it builds); the page draws one shared legend as text instead.
"use strict";

(function () {
  // First colour fixed: tests look for its pixels on the inflight chart.
  const PALETTE = ["#2457c5", "#e07a1f", "#1d9a6c", "#c23b6e", "#7b4fd1", "#0f8fa8",
                   "#b58a00", "#5d6b82", "#d94535", "#3c9d2e", "#8c564b", "#17becf"];
  const MAX_AGE_S = 3600;  // the longest history the page offers

  /** Colours handed out in the order ids are first seen, so an instance keeps its colour. */
  class Palette {
    constructor() { this.assigned = new Map(); }
    colorOf(id) {
      if (!this.assigned.has(id)) this.assigned.set(id, PALETTE[this.assigned.size % PALETTE.length]);
      return this.assigned.get(id);
    }
  }

  /** Samples of many series on one time axis (seconds); a series missing from a sample is null there. */
  class History {
    constructor() { this.times = []; this.series = new Map(); }

    add(t, values) {
      for (const [key, value] of values) {
        if (!this.series.has(key)) this.series.set(key, new Array(this.times.length).fill(null));
        this.series.get(key).push(value === undefined ? null : value);
      }
      this.times.push(t);
      for (const column of this.series.values()) if (column.length < this.times.length) column.push(null);
      let drop = 0;
      while (drop < this.times.length && this.times[drop] < t - MAX_AGE_S) drop++;
      if (drop) {
        this.times.splice(0, drop);
        for (const [key, column] of this.series) {
          column.splice(0, drop);
          if (column.every((v) => v === null)) this.series.delete(key);
        }
      }
    }

    /** The samples of the last `seconds`: {times, series: Map of the keys with a value there}. */
    window(seconds, now) {
      let first = 0;
      while (first < this.times.length && this.times[first] < now - seconds) first++;
      const series = new Map();
      for (const [key, column] of this.series) {
        const part = column.slice(first);
        if (part.some((v) => v !== null)) series.set(key, part);
      }
      return { times: this.times.slice(first), series };
    }
  }

  function themeColor(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || "#888";
  }

  /** One uPlot chart in `host`; rebuilt when its set of series or the theme changes. */
  class TrendChart {
    constructor(host, { format, yMax } = {}) {
      this.host = host;
      this.format = format || ((v) => String(v));
      this.yMax = yMax;
      this.plot = null;
      this.signature = "";
      this.span = [0, 1];
      new ResizeObserver(() => this.resize()).observe(host);
    }

    size() { return { width: Math.max(200, this.host.clientWidth), height: 170 }; }

    resize() {
      if (this.plot) this.plot.setSize(this.size());
    }

    /** series: [{key, color, dash}] in draw order; data: {times, series: Map key -> values}. */
    draw(series, data, windowS, now) {
      // The window, but no wider than the samples so far: a fresh page fills its charts.
      const first = data.times.length ? data.times[0] : now;
      this.span = [Math.min(Math.max(now - windowS, first), now - 10), now];
      const signature = series.map((s) => `${s.key}|${s.color}|${s.dash ? 1 : 0}`).join("\n") + `|${document.documentElement.dataset.theme}`;
      if (!this.plot || signature !== this.signature) this.build(series, signature);
      const columns = [data.times, ...series.map((s) => data.series.get(s.key))];
      this.plot.setData(columns);
      this.host.dataset.points = String(data.times.length);
      this.host.dataset.series = String(series.length);
      this.host.dataset.windowS = String(windowS);
    }

    build(series, signature) {
      if (this.plot) this.plot.destroy();
      const axis = themeColor("--chart-axis"), grid = themeColor("--chart-grid");
      const yMax = this.yMax;
      const fmt = this.format;
      const options = {
        ...this.size(),
        legend: { show: false },
        cursor: { drag: { x: false, y: false }, points: { show: false } },
        scales: {
          x: { time: true, range: () => this.span },
          y: { range: (u, min, max) => [0, yMax !== undefined ? Math.max(yMax, max || 0) : Math.max(1, (max || 0) * 1.15)] },
        },
        axes: [
          { stroke: axis, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 }, font: "11px system-ui, sans-serif" },
          { stroke: axis, grid: { stroke: grid, width: 1 }, ticks: { show: false }, size: 52,
            font: "11px system-ui, sans-serif", values: (u, splits) => splits.map(fmt) },
        ],
        series: [{}, ...series.map((s) => ({ stroke: s.color, width: 2, dash: s.dash ? [5, 4] : undefined,
                                             points: { show: false }, spanGaps: false }))],
      };
      this.plot = new window.uPlot(options, [[], ...series.map(() => [])], this.host);
      this.signature = signature;
    }

    /** Forget the plot so the next draw rebuilds it (the theme's colours changed). */
    invalidate() { this.signature = ""; }
  }

  window.Trends = { Palette, History, TrendChart };
})();
