// Shared by every dashboard page: the CSRF token, number formats, JSON fetches, copy buttons, confirmations.
"use strict";

const tm = (() => {
  const csrf = (document.querySelector('meta[name="csrf-token"]') || {}).content || "";

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (name === "text") node.textContent = value;
      else if (name === "className") node.className = value;
      else node.setAttribute(name, value);
    }
    for (const child of children) node.append(child);
    return node;
  }

  const missing = (v) => v === null || v === undefined || Number.isNaN(v);
  const fmt = {
    num(v, digits = 0) {
      if (missing(v)) return "—";
      return Number(v).toLocaleString("en-US", {maximumFractionDigits: digits, minimumFractionDigits: 0});
    },
    rate(v) { return missing(v) ? "—" : fmt.num(v, v < 10 ? 1 : 0); },
    pct(v) { return missing(v) ? "—" : (100 * v).toFixed(v < 0.1 && v > 0 ? 1 : 0) + "%"; },
    ms(seconds) {
      if (missing(seconds)) return "—";
      const ms = seconds * 1000;
      return ms >= 1000 ? (ms / 1000).toFixed(2) + " s" : ms.toFixed(ms < 10 ? 1 : 0) + " ms";
    },
    usd(v) {
      if (missing(v)) return "—";
      if (v === 0) return "$0";
      if (v >= 100) return "$" + fmt.num(v, 0);
      if (v >= 1) return "$" + v.toFixed(2);
      return "$" + v.toPrecision(3);
    },
    clock(unix) { return new Date(unix * 1000).toISOString().slice(11, 16) + " UTC"; },
  };

  async function getJSON(url) {
    const response = await fetch(url, {credentials: "same-origin", headers: {accept: "application/json"}});
    if (response.status === 401) {
      location.href = "/admin/login?next=" + encodeURIComponent(location.pathname + location.search);
      throw new Error("logged out");
    }
    if (!response.ok) throw new Error(url + ": HTTP " + response.status);
    return response.json();
  }

  async function copyText(text) {
    try {
      await navigator.clipboard.writeText(text);
      return true;
    } catch (error) {  // no clipboard permission: select the text so that Ctrl+C works
      const range = document.createRange();
      const target = document.querySelector("[data-new-key]");
      if (target) { range.selectNodeContents(target); getSelection().removeAllRanges(); getSelection().addRange(range); }
      return document.execCommand && document.execCommand("copy");
    }
  }

  document.addEventListener("click", async (event) => {
    const button = event.target.closest("[data-copy]");
    if (!button) return;
    const source = document.querySelector(button.dataset.copy);
    const done = await copyText(source.textContent.trim());
    const note = button.parentElement.querySelector(".copied");
    if (note) { note.hidden = false; note.textContent = done ? "copied" : "selected: press Ctrl+C"; }
  });

  document.addEventListener("submit", (event) => {
    const form = event.target.closest("form.confirm");
    if (form && !window.confirm(form.dataset.confirm || "Sure?")) event.preventDefault();
  });

  return {csrf, el, fmt, getJSON};
})();
