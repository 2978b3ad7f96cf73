// A small hand-written line chart: inflight per instance over the last WINDOW_MS, kept in this
// page only (the sidecar keeps no history). No library: the network is closed.
"use strict";

(function () {
  const WINDOW_MS = 120000;
  const PALETTE = ["#2457c5", "#d9480f", "#2b8a3e", "#ae3ec9", "#0c8599", "#e67700",
                   "#c2255c", "#5c940d", "#364fc7", "#862e9c"];

  class InflightChart {
    constructor(canvas) {
      this.canvas = canvas;
      this.series = new Map();  // instance id -> [{t, v}], oldest first
      this.colors = new Map();  // instance id -> colour, stable for the page's life
    }

    colorOf(id) {
      if (!this.colors.has(id)) this.colors.set(id, PALETTE[this.colors.size % PALETTE.length]);
      return this.colors.get(id);
    }

    // values: Map instance id -> inflight (null = unknown: no point, so no invented zero).
    add(t, values) {
      for (const [id, v] of values) {
        if (!this.series.has(id)) this.series.set(id, []);
        if (v !== null && v !== undefined) this.series.get(id).push({ t, v });
        this.colorOf(id);
      }
      const oldest = t - WINDOW_MS;
      for (const [id, points] of this.series) {
        while (points.length && points[0].t < oldest) points.shift();
        if (!points.length && !values.has(id)) this.series.delete(id);  // gone and aged out
      }
      let total = 0;
      for (const points of this.series.values()) total += points.length;
      this.canvas.dataset.points = String(total);
      this.canvas.dataset.series = String(this.series.size);
    }

    draw(now) {
      const canvas = this.canvas;
      const ratio = window.devicePixelRatio || 1;
      const width = canvas.clientWidth, height = canvas.clientHeight;
      if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
      if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
      const ctx = canvas.getContext("2d");
      ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
      ctx.clearRect(0, 0, width, height);
      const box = { left: 40, right: width - 10, top: 8, bottom: height - 22 };
      const { step, top } = this.scale();
      this.drawAxes(ctx, box, step, top);
      const x = (t) => box.left + (box.right - box.left) * (1 - (now - t) / WINDOW_MS);
      const y = (v) => box.bottom - (box.bottom - box.top) * (v / top);
      for (const [id, points] of this.series) {
        if (!points.length) continue;
        ctx.strokeStyle = this.colorOf(id);
        ctx.lineWidth = 2;
        ctx.beginPath();
        // A step line: inflight holds its value until the next sample.
        points.forEach((p, i) => {
          if (i === 0) ctx.moveTo(x(p.t), y(p.v));
          else { ctx.lineTo(x(p.t), y(points[i - 1].v)); ctx.lineTo(x(p.t), y(p.v)); }
        });
        ctx.stroke();
      }
    }

    // Integer gridlines: the top is a multiple of a 1/2/5 step, four or fewer steps.
    scale() {
      let max = 0;
      for (const points of this.series.values()) for (const p of points) max = Math.max(max, p.v);
      let step = 1;
      for (let k = 1; step * 4 < max; k *= 10) {
        step = [1, 2, 5, 10].map((m) => m * k).find((s) => s * 4 >= max) || 10 * k;
      }
      return { step, top: Math.max(step * Math.ceil(max / step), 4) };
    }

    drawAxes(ctx, box, step, top) {
      ctx.font = "11px system-ui, sans-serif";
      ctx.fillStyle = "#667085";
      ctx.strokeStyle = "#e3e8ef";
      ctx.lineWidth = 1;
      ctx.textAlign = "right";
      ctx.textBaseline = "middle";
      for (let v = 0; v <= top; v += step) {
        const yy = Math.round(box.bottom - (box.bottom - box.top) * v / top);
        ctx.beginPath(); ctx.moveTo(box.left, yy + 0.5); ctx.lineTo(box.right, yy + 0.5); ctx.stroke();
        ctx.fillText(String(v), box.left - 6, yy);
      }
      ctx.textBaseline = "top";
      for (let s = 120; s >= 0; s -= 30) {
        const xx = box.left + (box.right - box.left) * (1 - s / 120);
        // The end labels align inwards so they stay inside the canvas.
        ctx.textAlign = s === 120 ? "left" : s ? "center" : "right";
        ctx.fillText(s ? `-${s} s` : "now", xx, box.bottom + 6);
      }
    }
  }

  window.InflightChart = InflightChart;
})();
