// deltaserve's chat page: talks to the same server's OpenAI-compatible API (/v1/models, /v1/chat/completions).
// Conversations live in this browser's localStorage; each request sends a conversation's whole history, and the
// server's state store finds the state that history already left, so going back to a conversation prefills only
// what is new. Model text is only ever set as text (textContent), never parsed as HTML.
"use strict";

const KEYS = { conversations: "deltaserve.conversations", current: "deltaserve.current",
               settings: "deltaserve.settings", apiKey: "deltaserve.apiKey" };
const $ = (id) => document.getElementById(id);

const state = {
  conversations: load(KEYS.conversations, []),
  current: localStorage.getItem(KEYS.current),
  settings: Object.assign({ think: "auto", maxTokens: 1024, temperature: 0, system: "", tools: "" },
                          load(KEYS.settings, {})),
  model: null,        // the served model's id (/v1/models)
  vision: false,      // whether it has a vision encoder (images can be sent)
  attachments: [],    // data URLs of the images for the next message
  streaming: null,    // { controller, conversation id } while an answer streams
};

function load(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw ? JSON.parse(raw) : fallback;
  } catch (e) {
    return fallback;
  }
}

function save() {
  try {
    localStorage.setItem(KEYS.conversations, JSON.stringify(state.conversations));
  } catch (e) {
    // the storage is full (images take room): keep the text, drop the oldest conversations' pictures
    for (const c of state.conversations) {
      for (const m of c.messages) if (m.images && m.images.length && c.id !== state.current) m.images = [];
    }
    try {
      localStorage.setItem(KEYS.conversations, JSON.stringify(state.conversations));
      notice("this browser's storage is full: the images of the other conversations were dropped from it");
    } catch (e2) {
      notice("this browser's storage is full: the conversation is not saved");
    }
  }
  if (state.current) localStorage.setItem(KEYS.current, state.current);
}

function notice(text) {
  const n = $("notice");
  n.textContent = text || "";
  n.hidden = !text;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function conversation(id) {
  return state.conversations.find((c) => c.id === (id || state.current)) || null;
}

function newConversation() {
  const c = { id: "c" + Date.now().toString(36) + Math.random().toString(36).slice(2, 7),
              title: "New chat", created: Date.now(), messages: [] };
  state.conversations.unshift(c);
  state.current = c.id;
  save();
  render();
  $("input").focus();
  return c;
}

// -- the API key, asked for when the server answers 401 --------------------------------------------------------
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = localStorage.getItem(KEYS.apiKey);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function askKey(message) {
  return new Promise((resolve) => {
    const d = $("key-dialog");
    const input = $("key-input");
    d.querySelector("p").textContent = message;
    input.value = "";
    const done = (ok) => {
      d.close();
      $("key-form").onsubmit = null;
      $("key-cancel").onclick = null;
      if (ok && input.value.trim()) {
        localStorage.setItem(KEYS.apiKey, input.value.trim());
        resolve(true);
      } else {
        resolve(false);
      }
    };
    $("key-form").onsubmit = (ev) => { ev.preventDefault(); done(true); };
    $("key-cancel").onclick = () => done(false);
    d.showModal();
    input.focus();
  });
}

async function api(path, options) {
  for (;;) {
    const r = await fetch(path, Object.assign({ headers: headers() }, options || {}));
    if (r.status !== 401) return r;
    const had = !!localStorage.getItem(KEYS.apiKey);
    if (!(await askKey(had ? "The server refused this API key: enter the right one."
                           : "This server needs an API key (serve --api-key)."))) return r;
    if (options) options.headers = headers();
  }
}

async function errorText(r) {
  try {
    const body = await r.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return r.status + " " + r.statusText;
  }
}

async function loadModel() {
  try {
    const r = await api("/v1/models");
    if (!r.ok) {
      notice("the server did not list its model: " + (await errorText(r)));
      return;
    }
    const card = (await r.json()).data[0];
    state.model = card.id;
    state.vision = !!card.vision;
    $("model-name").textContent = card.id;
    $("model-info").textContent = card.id + " · context " + card.context_length +
      (state.vision ? " · images: drop or paste them" : " · text only");
    document.body.dataset.vision = state.vision ? "yes" : "no";
    document.body.dataset.ready = "yes";
  } catch (e) {
    notice("cannot reach the server: " + e);
  }
}

// -- rendering -------------------------------------------------------------------------------------------------------
function render() {
  renderSidebar();
  renderMessages();
}

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of state.conversations) {
    const li = el("li", c.id === state.current ? "active" : "");
    li.dataset.id = c.id;
    li.append(el("span", "title", c.title));
    const del = el("button", "delete", "×");
    del.type = "button";
    del.title = "Delete this conversation";
    del.onclick = (ev) => {
      ev.stopPropagation();
      if (state.streaming && state.streaming.id === c.id) stop();
      state.conversations = state.conversations.filter((x) => x.id !== c.id);
      if (state.current === c.id) state.current = state.conversations.length ? state.conversations[0].id : null;
      save();
      render();
    };
    li.append(del);
    li.onclick = () => {
      state.current = c.id;
      save();
      render();
    };
    list.append(li);
  }
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  const c = conversation();
  if (!c || !c.messages.length) {
    box.append(el("div", "empty", "Ask something." + (state.vision ? " Drop or paste an image to ask about it." : "")));
    return;
  }
  c.messages.forEach((m, i) => box.append(messageView(c, m, i)));
  box.scrollTop = box.scrollHeight;
}

function messageView(c, m, i) {
  const div = el("div", "msg " + m.role);
  div.dataset.index = i;
  if (m.role === "tool") {
    div.append(el("div", "role", "tool result" + (m.name ? " · " + m.name : "")), el("div", "content", m.content));
    return div;
  }
  div.append(el("div", "role", m.role === "user" ? "you" : state.model || "assistant"));
  if (m.images && m.images.length) {
    const row = el("div", "images");
    for (const url of m.images) {
      const img = el("img");
      img.src = url;
      img.alt = "attached image";
      row.append(img);
    }
    div.append(row);
  }
  if (m.role === "assistant") {
    const think = el("details", "thinking");
    think.hidden = !m.reasoning;
    think.append(el("summary", "", thinkingLabel(m)), el("div", "reasoning", m.reasoning || ""));
    div.append(think);
  }
  div.append(el("div", "content", m.content || ""));
  if (m.role === "assistant") {
    const calls = el("div", "calls");
    for (const call of m.tool_calls || []) calls.append(callView(call));
    div.append(calls);
    if (m.error) div.append(el("div", "error", m.error));
    div.append(statsView(m));
    const last = i === c.messages.length - 1;
    if (last && m.tool_calls && m.tool_calls.length && !m.streaming) div.append(toolResultForm(c, m));
    if (last && !m.streaming) {
      const again = el("button", "regenerate", "Regenerate");
      again.type = "button";
      again.onclick = () => regenerate(c);
      div.querySelector(".stats").append(again);
    }
  }
  return div;
}

function thinkingLabel(m) {
  if (m.streaming && !m.content && !(m.tool_calls || []).length) return "Thinking…";
  return "Thought (" + (m.reasoning || "").length + " characters): show";
}

function callView(call) {
  const box = el("div", "tool-call");
  box.dataset.name = call.name || "";
  box.append(el("span", "name", "→ " + (call.name || "") + " "), el("code", "", call.arguments || ""));
  return box;
}

function statsView(m) {
  const s = el("div", "stats");
  const st = m.stats || {};
  for (const key of ["completion_tokens", "prompt_tokens", "cached_tokens", "ttft_ms", "tok_s"]) {
    if (st[key] !== undefined && st[key] !== null) s.dataset[key.replace(/_(.)/g, (_, x) => x.toUpperCase())] = st[key];
  }
  const parts = [];
  if (st.completion_tokens !== undefined) parts.push(st.completion_tokens + " tokens");
  if (st.tok_s) parts.push(st.tok_s.toFixed(1) + " tok/s");
  if (st.cached_tokens !== undefined) parts.push(st.cached_tokens + " cached of " + st.prompt_tokens);
  if (st.ttft_ms !== undefined) parts.push("TTFT " + Math.round(st.ttft_ms) + " ms");
  if (st.finish_reason) parts.push(st.finish_reason);
  for (const p of parts) s.append(el("span", "stat", p));
  if (m.stopped) s.append(el("span", "stopped", "stopped"));
  return s;
}

function toolResultForm(c, m) {
  const form = el("div", "tool-results");
  for (const call of m.tool_calls) {
    const row = el("form", "tool-result");
    const input = el("input");
    input.placeholder = "what " + call.name + " returned";
    const send = el("button", "", "Send result");
    send.type = "submit";
    row.append(input, send);
    row.onsubmit = (ev) => {
      ev.preventDefault();
      c.messages.push({ role: "tool", tool_call_id: call.id, name: call.name, content: input.value });
      const answered = new Set(c.messages.filter((x) => x.role === "tool").map((x) => x.tool_call_id));
      save();
      if (m.tool_calls.every((x) => answered.has(x.id))) complete(c);
      else render();
    };
    form.append(row);
  }
  return form;
}

// the streaming message's view, updated in place as deltas come
function refresh(c, m) {
  if (c.id !== state.current) return;
  const box = $("messages");
  const i = c.messages.indexOf(m);
  const old = box.querySelector('.msg[data-index="' + i + '"]');
  const view = messageView(c, m, i);
  const think = old && old.querySelector(".thinking");
  if (think && think.open) view.querySelector(".thinking").open = true; // unfolded by the reader: stays so
  const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  if (old) old.replaceWith(view);
  else box.append(view);
  if (atEnd) box.scrollTop = box.scrollHeight;
}

// -- sending -------------------------------------------------------------------------------------------------------------
function apiMessages(c) {
  const out = [];
  if (state.settings.system.trim()) out.push({ role: "system", content: state.settings.system });
  for (const m of c.messages) {
    if (m.role === "user") {
      if (m.images && m.images.length) {
        out.push({ role: "user", content: m.images.map((url) => ({ type: "image_url", image_url: { url } }))
                                          .concat([{ type: "text", text: m.content }]) });
      } else {
        out.push({ role: "user", content: m.content });
      }
    } else if (m.role === "assistant") {
      const a = { role: "assistant", content: m.content || "" };
      if (m.reasoning) a.reasoning_content = m.reasoning; // the history as the server generated it
      if (m.tool_calls && m.tool_calls.length) {
        a.tool_calls = m.tool_calls.map((t) => ({ id: t.id, type: "function",
                                                   function: { name: t.name, arguments: t.arguments } }));
      }
      out.push(a);
    } else if (m.role === "tool") {
      out.push({ role: "tool", tool_call_id: m.tool_call_id, content: m.content });
    }
  }
  return out;
}

function requestBody(c) {
  const s = state.settings;
  const body = { model: state.model, messages: apiMessages(c), stream: true, stream_options: { include_usage: true },
                 max_tokens: Math.max(1, parseInt(s.maxTokens, 10) || 1024),
                 temperature: Number(s.temperature) || 0 };
  if (s.think !== "auto") body.chat_template_kwargs = { enable_thinking: s.think === "on" };
  if (s.tools.trim()) body.tools = JSON.parse(s.tools);
  return body;
}

async function send() {
  const text = $("input").value;
  if (state.streaming || (!text.trim() && !state.attachments.length)) return;
  if (state.attachments.length && !state.vision) {
    notice("this model has no vision encoder: it cannot read images (remove them to send the text)");
    return;
  }
  const c = conversation() || newConversation();
  c.messages.push({ role: "user", content: text, images: state.attachments.slice() });
  if (c.title === "New chat") c.title = (text.trim() || "image").slice(0, 48);
  $("input").value = "";
  state.attachments = [];
  renderAttachments();
  save();
  renderSidebar();
  await complete(c);
}

function regenerate(c) {
  if (state.streaming) return;
  while (c.messages.length && c.messages[c.messages.length - 1].role === "assistant") c.messages.pop();
  save();
  complete(c);
}

function stop() {
  if (state.streaming) state.streaming.controller.abort();
}

function setStreaming(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  document.body.dataset.streaming = on ? "yes" : "no";
}

async function complete(c) {
  notice("");
  let body;
  try {
    body = requestBody(c);
  } catch (e) {
    notice("the tools in Settings are not valid JSON: " + e.message);
    return;
  }
  const m = { role: "assistant", content: "", reasoning: "", tool_calls: [], stats: {}, streaming: true };
  c.messages.push(m);
  const controller = new AbortController();
  state.streaming = { controller, id: c.id };
  setStreaming(true);
  render();
  const t0 = performance.now();
  let first = null;
  try {
    const r = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
                                                  signal: controller.signal });
    if (!r.ok) throw new Error(await errorText(r));
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
          if (apply(m, chunk) && first === null) first = performance.now();
        }
      }
      if (first !== null) m.stats.ttft_ms = first - t0;
      refresh(c, m);
    }
  } catch (e) {
    if (e.name === "AbortError") m.stopped = true;
    else m.error = String(e.message || e);
  }
  const end = performance.now();
  if (first !== null) {
    m.stats.ttft_ms = first - t0;
    const n = m.stats.completion_tokens;
    if (n !== undefined && end > first && n > 1) m.stats.tok_s = (n - 1) / ((end - first) / 1000);
  }
  delete m.streaming;
  state.streaming = null;
  setStreaming(false);
  save();
  if (c.id === state.current) renderMessages();
}

// one chunk of the stream into the message; true when it carried generated text
function apply(m, chunk) {
  if (chunk.usage) {
    m.stats.completion_tokens = chunk.usage.completion_tokens;
    m.stats.prompt_tokens = chunk.usage.prompt_tokens;
    const details = chunk.usage.prompt_tokens_details || {};
    m.stats.cached_tokens = details.cached_tokens || 0;
  }
  let text = false;
  for (const choice of chunk.choices || []) {
    const d = choice.delta || {};
    if (d.reasoning_content) { m.reasoning += d.reasoning_content; text = true; }
    if (d.content) { m.content += d.content; text = true; }
    for (const t of d.tool_calls || []) {
      const call = m.tool_calls[t.index] || (m.tool_calls[t.index] = { id: "", name: "", arguments: "" });
      if (t.id) call.id = t.id;
      if (t.function && t.function.name) call.name += t.function.name;
      if (t.function && t.function.arguments) call.arguments += t.function.arguments;
      text = true;
    }
    if (choice.finish_reason) m.stats.finish_reason = choice.finish_reason;
  }
  return text;
}

// -- images: dropped on the page or pasted into the message ------------------------------------------------------
function attach(files) {
  const images = Array.from(files).filter((f) => f.type.startsWith("image/"));
  if (!images.length) return;
  if (!state.vision) {
    notice("this model has no vision encoder: images cannot be sent to it");
    return;
  }
  for (const f of images) {
    const reader = new FileReader();
    reader.onload = () => {
      state.attachments.push(reader.result);
      renderAttachments();
    };
    reader.readAsDataURL(f);
  }
}

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  state.attachments.forEach((url, i) => {
    const a = el("div", "att");
    const img = el("img");
    img.src = url;
    img.alt = "image to send";
    const x = el("button", "", "×");
    x.type = "button";
    x.title = "Remove";
    x.onclick = () => {
      state.attachments.splice(i, 1);
      renderAttachments();
    };
    a.append(img, x);
    box.append(a);
  });
  document.body.dataset.attachments = String(state.attachments.length);
}

// -- settings -------------------------------------------------------------------------------------------------------
function bindSettings() {
  const fields = { "set-think": "think", "set-max-tokens": "maxTokens", "set-temperature": "temperature",
                   "set-system": "system", "set-tools": "tools" };
  for (const [id, key] of Object.entries(fields)) {
    const input = $(id);
    input.value = state.settings[key];
    const keep = () => {
      state.settings[key] = input.value;
      localStorage.setItem(KEYS.settings, JSON.stringify(state.settings));
    };
    input.addEventListener("input", keep);
    input.addEventListener("change", keep);
  }
  $("forget-key").onclick = () => {
    localStorage.removeItem(KEYS.apiKey);
    notice("the API key is forgotten");
  };
}

function bind() {
  $("new-chat").onclick = () => { if (!state.streaming) newConversation(); };
  $("composer").onsubmit = (ev) => { ev.preventDefault(); send(); };
  $("stop").onclick = stop;
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      send();
    }
  });
  $("input").addEventListener("paste", (ev) => {
    const files = Array.from(ev.clipboardData ? ev.clipboardData.items : [])
      .filter((it) => it.kind === "file").map((it) => it.getAsFile()).filter(Boolean);
    if (files.length) {
      ev.preventDefault();
      attach(files);
    }
  });
  const main = $("main");
  main.addEventListener("dragover", (ev) => {
    ev.preventDefault();
    main.classList.add("dragging");
    $("drop-hint").hidden = false;
  });
  main.addEventListener("dragleave", () => {
    main.classList.remove("dragging");
    $("drop-hint").hidden = true;
  });
  main.addEventListener("drop", (ev) => {
    ev.preventDefault();
    main.classList.remove("dragging");
    $("drop-hint").hidden = true;
    attach(ev.dataTransfer ? ev.dataTransfer.files : []);
  });
  bindSettings();
}

bind();
if (!conversation()) state.current = state.conversations.length ? state.conversations[0].id : null;
render();
setStreaming(false);
loadModel().then(render);
