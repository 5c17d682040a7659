// The live overview: polls /admin/data/live every second, keeps 15 minutes of points per model,
// fills the tiles and redraws the charts.
"use strict";

(() => {
  const root = document.getElementById("models");
  const status = document.getElementById("live-status");
  const intervalMs = Number(root.dataset.intervalMs) || 1000;
  const f = tm.fmt;
  const models = new Map();
  let after = null, historyS = 900;

  const TILES = [
    {title: "Batch occupancy", value: (c) => f.pct(c.seq_occupancy), meter: (c) => c.seq_occupancy, field: "seq_occupancy",
     sub: (c) => `mean of 10 s · ${c.seqs_last_step} / ${c.max_num_seqs} seqs last step`},
    {title: "Batch API share", value: (c) => f.pct(c.batch_seq_occupancy), meter: (c) => c.batch_seq_occupancy,
     field: "batch_seq_occupancy", sub: (c) => `of the seats, mean of 10 s · ${c.running_batch} batch lines running`},
    {title: "Token budget", value: (c) => f.pct(c.token_occupancy), meter: (c) => c.token_occupancy, field: "token_occupancy",
     sub: (c) => `mean of 10 s · ${f.num(c.tokens_last_step)} / ${f.num(c.max_num_batched_tokens)} last step`},
    {title: "KV cache", value: (c) => f.pct(c.kv_usage_now), meter: (c) => c.kv_usage_now, field: "kv_usage_now",
     sub: (c) => `${f.num(c.kv_blocks_used)} / ${f.num(c.kv_blocks_total)} blocks`},
    {title: "Prefix cache hits", value: (c) => f.pct(c.prefix_hit_rate), field: "prefix_hit_rate",
     sub: () => "of prompt tokens, last minute"},
    {title: "Draft acceptance", value: (c) => f.pct(c.spec_acceptance_rate), field: "spec_acceptance_rate",
     sub: () => "speculated tokens kept, last minute"},
    {title: "Requests", value: (c) => `${c.running} running`, field: "running",
     sub: (c) => `${c.waiting} waiting · ${c.swapped} swapped`},
    {title: "Preemptions", value: (c) => f.num(c.preemptions), field: "preemptions",
     sub: (c) => `${f.num(c.preemptions_recompute)} recompute · ${f.num(c.preemptions_swap)} swap`},
    {title: "Tokens / s", value: (c) => `${f.rate(c.tokens_in_per_s)} in · ${f.rate(c.tokens_out_per_s)} out`,
     field: "tokens_per_s", sub: (c) => `last 10 s`},
    {title: "Tokens so far", value: (c) => f.num(c.generation_tokens_total), field: "generation_tokens_total",
     sub: (c) => `generated · ${f.num(c.prompt_tokens_total)} prompt`},
    {title: "Time to first token", value: (c) => `${f.ms(c.ttft_p50)} · ${f.ms(c.ttft_p99)}`, field: "ttft",
     sub: () => "p50 · p99, last minute"},
    {title: "Inter-token latency", value: (c) => `${f.ms(c.itl_p50)} · ${f.ms(c.itl_p99)}`, field: "itl",
     sub: () => "p50 · p99, last minute"},
    {title: "Real cost / 1M out, now", value: (c) => f.usd(c.cost_per_1m_out), field: "cost_now", cls: "cost",
     sub: (c) => c.cost_per_1m_out === null ? "no tokens in the last minute" : `${f.usd(c.cost_per_1m_all)} per 1M in+out`},
    {title: "Batch filling, last minute", value: (c) => batchSaving(c), field: "cost_batch", cls: "cost",
     sub: (c) => c.cost_per_1m_out_without_batch === c.cost_per_1m_out ? "no Batch API tokens in the last minute"
       : `real cost / 1M out: ${f.usd(c.cost_per_1m_out_without_batch)} without the batch's tokens → ${f.usd(c.cost_per_1m_out)} with them`},
    {title: "Real cost / 1M out, today", value: (c) => f.usd(c.today_cost_per_1m_out), field: "cost_today", cls: "cost",
     sub: (c) => `${f.num(c.today_tokens_out)} tokens for ${f.usd(c.today_cost_usd)} since ${f.clock(c.today_since)}`},
    {title: "Charged / 1M tokens", field: "price", cls: "cost",
     value: (c) => c.price ? `${f.usd(c.price.input_per_1m)} in · ${f.usd(c.price.output_per_1m)} out` : "—",
     sub: (c) => c.price ? `price sheet · batch ${f.usd(c.price.batch_input_per_1m)} in · ${f.usd(c.price.batch_output_per_1m)} out`
                         : "no price sheet: usage costs $0"},
  ];

  const CHARTS = [
    {title: "Tokens / s", format: (v) => f.rate(v), series: [
      {label: "in", field: "tokens_in_per_s"}, {label: "out", field: "tokens_out_per_s"}]},
    {title: "Batch occupancy and KV cache", format: (v) => f.pct(v), yMax: 1, series: [
      {label: "seqs / max", field: "seq_occupancy"}, {label: "batch API seqs / max", field: "batch_seq_occupancy"},
      {label: "tokens / budget", field: "token_occupancy"},
      {label: "KV blocks", field: "kv_usage"}]},
    {title: "Requests", format: (v) => f.num(v, 1), series: [
      {label: "running", field: "running"}, {label: "waiting", field: "waiting"}, {label: "swapped", field: "swapped"}]},
    {title: "Latency (last minute)", format: (v) => f.ms(v), series: [
      {label: "TTFT p50", field: "ttft_p50"}, {label: "TTFT p99", field: "ttft_p99"},
      {label: "ITL p50", field: "itl_p50"}, {label: "ITL p99", field: "itl_p99"}]},
    {title: "Real cost per 1M output tokens", format: (v) => f.usd(v), series: [
      {label: "last minute", field: "cost_per_1m_out"},
      {label: "without the batch's tokens", field: "cost_per_1m_out_without_batch"}]},
  ];

  // What the Batch API's tokens took off the real cost of a token over the last minute.
  function batchSaving(c) {
    if (c.cost_per_1m_out === null || c.cost_per_1m_out_without_batch === null) return "—";
    const saved = 1 - c.cost_per_1m_out / c.cost_per_1m_out_without_batch;
    return saved > 0 ? `−${f.pct(saved)}` : "no batch";
  }

  function makeCard(name) {
    const card = tm.el("section", {className: "card model", "data-model": name});
    card.append(tm.el("h2", {text: name}));
    const tiles = tm.el("div", {className: "tiles"});
    const tileNodes = TILES.map((spec) => {
      const value = tm.el("span", {className: "value", "data-field": spec.field});
      const sub = tm.el("span", {className: "sub"});
      const tile = tm.el("div", {className: "tile " + (spec.cls || "")}, tm.el("span", {className: "label", text: spec.title}), value, sub);
      let meter = null;
      if (spec.meter) { meter = tm.el("i"); tile.append(tm.el("span", {className: "meter"}, meter)); }
      tiles.append(tile);
      return {spec, value, sub, meter};
    });
    card.append(tiles);
    const charts = tm.el("div", {className: "charts"});
    const chartNodes = CHARTS.map((spec) => {
      const box = tm.el("div", {className: "chart"});
      const legend = tm.el("div", {className: "legend"});
      charts.append(tm.el("figure", {className: "chart-box"}, tm.el("figcaption", {text: spec.title}), box, legend));
      return {spec, box, legend};
    });
    // Share by team: the tokens each team was served over the last minute (what /metrics has as
    // tokenmill:team_tokens_last_minute), as parts of the whole.
    const shares = tm.el("div", {className: "shares"});
    charts.append(tm.el("figure", {className: "chart-box team-share"},
      tm.el("figcaption", {text: "Share by team (tokens served, last minute)"}), shares));
    card.append(charts);
    root.append(card);
    return {card, tileNodes, chartNodes, shares, series: null};
  }

  function appendSeries(model, incoming, now) {
    if (!model.series) { model.series = incoming; return; }
    for (const [name, values] of Object.entries(incoming)) (model.series[name] = model.series[name] || []).push(...values);
    const keepFrom = now - historyS;
    const drop = model.series.t.findIndex((t) => t > keepFrom);
    if (drop > 0) for (const name of Object.keys(model.series)) model.series[name].splice(0, drop);
  }

  function renderShares(node, teams) {
    if (!teams.length) {
      node.replaceChildren(tm.el("p", {className: "muted", text: "No team has been served in the last minute."}));
      return;
    }
    const total = teams.reduce((sum, team) => sum + team.tokens_last_minute, 0);
    node.replaceChildren(...teams.map((team, index) => {
      const share = total ? team.tokens_last_minute / total : 0;
      const bar = tm.el("i", {className: "swatch s" + (index % 4)});
      bar.style.width = `${share * 100}%`;
      return tm.el("div", {className: "share", "data-team": team.team},
        tm.el("span", {className: "name", text: team.name}),
        tm.el("span", {className: "meter"}, bar),
        tm.el("span", {className: "figures", "data-field": "share",
          text: `${f.pct(share)} · ${f.num(team.tokens_last_minute)} tokens · ${team.running} running · ${team.waiting} waiting`}));
    }));
  }

  function render(model, current, now) {
    for (const {spec, value, sub, meter} of model.tileNodes) {
      value.textContent = spec.value(current);
      sub.textContent = spec.sub(current);
      if (meter) meter.style.width = `${Math.max(0, Math.min(1, spec.meter(current) || 0)) * 100}%`;
    }
    renderShares(model.shares, current.teams || []);
    const s = model.series;
    for (const {spec, box, legend} of model.chartNodes) {
      const series = spec.series.map((item) => ({label: item.label, values: s[item.field] || []}));
      tmCharts.line(box, {t: s.t, from: now - historyS, to: now, series, format: spec.format, yMax: spec.yMax,
                          gap: 5 * intervalMs / 1000});
      tmCharts.legend(legend, series, (item) => spec.format(item.values.length ? item.values[item.values.length - 1] : null));
    }
  }

  async function poll() {
    try {
      const data = await tm.getJSON("/admin/data/live" + (after === null ? "" : `?after=${after}`));
      historyS = data.history_s;
      if (after !== null && data.now < after) {  // the server restarted with a clock behind ours: start over
        after = null;
        for (const model of models.values()) model.series = null;
      }
      const seen = new Set();
      for (const {current, series} of data.models) {
        seen.add(current.name);
        let model = models.get(current.name);
        if (!model) { model = makeCard(current.name); models.set(current.name, model); }
        appendSeries(model, series, data.now);
        render(model, current, data.now);
        if (series.t.length) after = Math.max(after || 0, series.t[series.t.length - 1]);
      }
      for (const [name, model] of models) if (!seen.has(name)) { model.card.remove(); models.delete(name); }
      status.className = "live";
      status.textContent = "live";
      root.dataset.updatedAt = String(data.now);
    } catch (error) {
      status.className = "live stale";
      status.textContent = "stale";
    }
    setTimeout(poll, intervalMs);
  }

  poll();
})();
