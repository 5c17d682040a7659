// The usage page's chart: prompt and completion tokens per day over the chosen range.
"use strict";

(async () => {
  const box = document.getElementById("usage-chart");
  if (!box) return;
  const data = await tm.getJSON(box.dataset.src);
  const stacks = [
    {label: "prompt tokens", values: data.prompt_tokens},
    {label: "completion tokens", values: data.completion_tokens},
  ];
  const draw = () => tmCharts.bars(box, {labels: data.day, stacks, format: (v) => tm.fmt.num(v)});
  draw();
  let pending = null;
  window.addEventListener("resize", () => { clearTimeout(pending); pending = setTimeout(draw, 150); });
  const sum = (values) => values.reduce((a, b) => a + b, 0);
  tmCharts.legend(document.getElementById("usage-legend"), stacks, (s) => tm.fmt.num(sum(s.values)));
  box.dataset.drawn = "true";
})();
