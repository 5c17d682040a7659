// Small SVG charts drawn from the JSON the app serves: time-series lines and stacked day bars.
"use strict";

const tmCharts = (() => {
  const SVG = "http://www.w3.org/2000/svg";
  const LEFT = 56, RIGHT = 10, TOP = 10, BOTTOM = 24;

  // Drawn at the container's own width, one unit per pixel, so text keeps its size.
  function size(container, height) {
    return {W: Math.max(320, Math.round(container.clientWidth || 640)), H: height || 190};
  }

  function svgEl(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function niceMax(value) {
    if (!(value > 0)) return 1;
    const magnitude = Math.pow(10, Math.floor(Math.log10(value)));
    for (const step of [1, 2, 2.5, 5, 10]) if (value <= step * magnitude) return step * magnitude;
    return 10 * magnitude;
  }

  function frame(container, {W, H}, yMax, format) {
    const svg = svgEl("svg", {viewBox: `0 0 ${W} ${H}`, class: "chart-svg", role: "img"});
    for (let i = 0; i <= 4; i++) {
      const y = TOP + (H - TOP - BOTTOM) * (1 - i / 4);
      svg.append(svgEl("line", {x1: LEFT, x2: W - RIGHT, y1: y, y2: y, class: i ? "grid" : "axis"}));
      svg.append(svgEl("text", {x: LEFT - 6, y: y + 4, class: "tick", "text-anchor": "end"}, format(yMax * i / 4)));
    }
    container.replaceChildren(svg);
    return svg;
  }

  // series: [{label, values, cls}], t: unix seconds per point, [from, to]: the x range
  function line(container, {t, from, to, series, format, yMax, gap, height}) {
    const {W, H} = size(container, height);
    let top = 0;
    for (const s of series) for (const v of s.values) if (v !== null && v > top) top = v;
    const ymax = yMax || niceMax(top);
    const svg = frame(container, {W, H}, ymax, format);
    const x = (time) => LEFT + (W - LEFT - RIGHT) * (time - from) / (to - from);
    const y = (v) => TOP + (H - TOP - BOTTOM) * (1 - Math.min(v, ymax) / ymax);
    for (let minutes = 15; minutes >= 0; minutes -= 5) {
      const at = to - minutes * 60;
      if (at < from) continue;
      svg.append(svgEl("text", {x: x(at), y: H - 6, class: "tick", "text-anchor": minutes ? "middle" : "end"},
        minutes ? `-${minutes}m` : "now"));
    }
    series.forEach((s, index) => {
      let d = "", previous = null;
      s.values.forEach((v, i) => {
        if (v === null || v === undefined || t[i] < from) { previous = null; return; }
        const moveTo = previous === null || (gap && t[i] - previous > gap);
        d += `${moveTo ? "M" : "L"}${x(t[i]).toFixed(1)},${y(v).toFixed(1)}`;
        previous = t[i];
      });
      if (d) svg.append(svgEl("path", {d, class: `line ${s.cls || "s" + index}`}));
    });
    return svg;
  }

  // labels: one per bar; stacks: [{label, values, cls}] drawn bottom up
  function bars(container, {labels, stacks, format, height}) {
    const {W, H} = size(container, height || 240);
    const totals = labels.map((_, i) => stacks.reduce((sum, s) => sum + (s.values[i] || 0), 0));
    const ymax = niceMax(Math.max(0, ...totals));
    const svg = frame(container, {W, H}, ymax, format);
    const slot = (W - LEFT - RIGHT) / Math.max(labels.length, 1);
    const barWidth = Math.max(1, slot * 0.7);
    const y = (v) => (H - TOP - BOTTOM) * v / ymax;
    const every = Math.ceil(labels.length / Math.max(2, Math.floor(W / 70)));
    labels.forEach((label, i) => {
      let base = H - BOTTOM;
      stacks.forEach((s, index) => {
        const height = y(s.values[i] || 0);
        if (height > 0) {
          const rect = svgEl("rect", {x: LEFT + i * slot + (slot - barWidth) / 2, y: base - height, width: barWidth,
                                      height, class: `bar ${s.cls || "s" + index}`});
          rect.append(svgEl("title", {}, `${label} ${s.label}: ${format(s.values[i])}`));
          svg.append(rect);
          base -= height;
        }
      });
      if (i % every === 0) {
        svg.append(svgEl("text", {x: LEFT + i * slot + slot / 2, y: H - 6, class: "tick", "text-anchor": "middle"},
          label.slice(5)));
      }
    });
    return svg;
  }

  function legend(container, series, latest) {
    container.replaceChildren(...series.map((s, index) => {
      const item = tm.el("span", {className: "key"}, tm.el("i", {className: `swatch ${s.cls || "s" + index}`}), s.label);
      if (latest) item.append(tm.el("b", {text: latest(s)}));
      return item;
    }));
  }

  return {line, bars, legend, niceMax};
})();
