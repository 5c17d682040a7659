// The playground: a chat streamed from the real /v1/chat/completions with a short-lived playground key
// (minted for this admin session by POST /admin/playground/key, kept only in this page's memory).
"use strict";

(() => {
  const form = document.getElementById("playground-form");
  const transcript = document.getElementById("transcript");
  const stats = document.getElementById("reply-stats");
  const sendButton = document.getElementById("send");
  const stopButton = document.getElementById("stop");
  let apiKey = null, controller = null;
  const history = [];

  async function key(fresh) {
    if (apiKey && !fresh && Date.parse(apiKey.expires_at) - Date.now() > 60_000) return apiKey.key;
    const response = await fetch("/admin/playground/key", {method: "POST", credentials: "same-origin",
                                                           headers: {"x-csrf-token": tm.csrf}});
    if (!response.ok) throw new Error("could not get a playground key (HTTP " + response.status + ")");
    apiKey = await response.json();
    return apiKey.key;
  }

  function bubble(role, text) {
    const node = tm.el("div", {className: "msg " + role, "data-role": role}, tm.el("b", {text: role}), tm.el("span", {text}));
    transcript.append(node);
    return node.querySelector("span");
  }

  async function post(body, fresh) {
    return fetch("/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: {"content-type": "application/json", authorization: "Bearer " + await key(fresh)},
      body: JSON.stringify(body),
    });
  }

  async function send(event) {
    event.preventDefault();
    const data = new FormData(form);
    const message = String(data.get("message") || "").trim();
    if (!message) return;
    const system = String(data.get("system") || "").trim();
    history.push({role: "user", content: message});
    bubble("user", message);
    const out = bubble("assistant", "");
    const body = {
      model: data.get("model"), stream: true, stream_options: {include_usage: true},
      messages: (system ? [{role: "system", content: system}] : []).concat(history),
      temperature: Number(data.get("temperature") || 0), max_tokens: Number(data.get("max_tokens") || 64),
    };
    controller = new AbortController();
    sendButton.disabled = true; stopButton.disabled = false;
    stats.textContent = "…";
    const started = performance.now();
    let firstAt = null, usage = null, reply = "";
    try {
      let response = await post(body, false);
      if (response.status === 401) response = await post(body, true);  // the key expired or was revoked
      if (!response.ok) {
        const error = await response.json().catch(() => ({}));
        throw new Error((error.error && error.error.message) || "HTTP " + response.status);
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, {stream: true});
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const eventText = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of eventText.split("\n")) {
            if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
            const chunk = JSON.parse(line.slice(6));
            if (chunk.usage) usage = chunk.usage;
            const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
            if (delta && delta.content) {
              if (firstAt === null) firstAt = performance.now();
              reply += delta.content;
              out.textContent = reply;
            }
          }
        }
      }
      history.push({role: "assistant", content: reply});
      const seconds = (performance.now() - started) / 1000;
      stats.textContent = usage
        ? `${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens · first token ` +
          `${tm.fmt.ms(firstAt === null ? null : (firstAt - started) / 1000)} · ${tm.fmt.rate(usage.completion_tokens / seconds)} tok/s`
        : `${seconds.toFixed(2)} s`;
      out.parentElement.dataset.done = "true";
    } catch (error) {
      history.pop();
      out.parentElement.classList.add("failed");
      out.textContent = reply + (error.name === "AbortError" ? " [stopped]" : ` [${error.message}]`);
      stats.textContent = "";
    } finally {
      sendButton.disabled = false; stopButton.disabled = true; controller = null;
    }
  }

  form.addEventListener("submit", send);
  stopButton.addEventListener("click", () => controller && controller.abort());
  document.getElementById("clear").addEventListener("click", () => {
    if (controller) controller.abort();
    history.length = 0;
    transcript.replaceChildren();
    stats.textContent = "";
  });
})();
