// forkbox web console: plain JavaScript, no build step, no dependencies, no request
// anywhere but this server's public /v1 API. Everything that comes from a guest or
// the server (code, output, values, reprs, file names, ids, messages) is hostile: it
// only ever reaches the page as text (textContent, attribute values set one by one),
// never as markup. Rich HTML outputs go into a sandboxed iframe (no scripts, an
// opaque origin, this page's Content-Security-Policy); images are data: URLs of
// validated base64.
"use strict";

(() => {
  const KEY = "forkbox.apiKey";
  const SVGNS = "http://www.w3.org/2000/svg";
  const $ = (id) => document.getElementById(id);

  // --- DOM helpers: text only ---------------------------------------------------
  function put(e, props) {
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") e.setAttribute("class", v);
      else if (k === "text") e.textContent = String(v);
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, String(v));
    }
    return e;
  }
  function add(e, kids) {
    for (const c of kids) {
      if (c === null || c === undefined || c === false) continue;
      e.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    }
    return e;
  }
  const el = (tag, props, ...kids) => add(put(document.createElement(tag), props), kids);
  const svg = (tag, props, ...kids) => add(put(document.createElementNS(SVGNS, tag), props), kids);
  const clear = (e) => { while (e.firstChild) e.removeChild(e.firstChild); return e; };
  const cut = (s, n) => { s = String(s ?? ""); return s.length > n ? s.slice(0, n - 1) + "…" : s; };
  const firstLine = (s) => String(s ?? "").split("\n").find((l) => l.trim() !== "") ?? "";
  const bytes = (n) => (n == null ? "" : n < 1024 ? `${n} B` : n < 1 << 20 ? `${(n / 1024).toFixed(1)} KiB` : `${(n / 1048576).toFixed(1)} MiB`);

  // --- state ----------------------------------------------------------------------
  const st = {
    key: null,
    sessions: [],
    current: null, // session id
    tree: null,
    selected: null, // checkpoint number
    running: false,
    transcripts: new Map(), // session id -> transcript element
    detailToken: 0,
    historyToken: 0,
    vars: [], // the selected node's variables
    templates: [],
    templateTimer: null,
  };

  // --- the API --------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, code, message) {
      super(message);
      this.status = status;
      this.code = code;
    }
    get text() { return `${this.code} (${this.status}): ${this.message}`; }
  }

  async function errorOf(resp) {
    let code = "http_" + resp.status, message = resp.statusText || "request failed";
    try {
      const body = await resp.json();
      if (body && body.error) {
        code = String(body.error.code ?? code);
        message = String(body.error.message ?? message);
      }
    } catch (_) { /* not JSON */ }
    return new ApiError(resp.status, code, message);
  }

  async function api(method, path, opts = {}) {
    const headers = { Authorization: "Bearer " + (opts.key ?? st.key) };
    let body;
    if (opts.json !== undefined) {
      headers["Content-Type"] = "application/json";
      body = JSON.stringify(opts.json);
    } else if (opts.body !== undefined) {
      headers["Content-Type"] = "application/octet-stream";
      body = opts.body;
    }
    let resp;
    try {
      resp = await fetch(path, { method, headers, body, cache: "no-store", credentials: "omit", referrerPolicy: "no-referrer" });
    } catch (e) {
      throw new ApiError(0, "network", "the server cannot be reached (" + e.message + ")");
    }
    if (!resp.ok) {
      const err = await errorOf(resp);
      if (err.status === 401 && !opts.key) signOut("Signed out: the server no longer accepts this API key (" + err.message + ").");
      throw err;
    }
    if (opts.raw) return resp;
    if (resp.status === 204) return null;
    return resp.json();
  }

  const sid = (id) => encodeURIComponent(id);
  function guestPath(path) {
    const parts = String(path).split("/").filter((p) => p !== "");
    if (parts.length === 0 || parts.some((p) => p === "." || p === "..")) throw new ApiError(400, "invalid_path", "a file path like /data/name.csv");
    return parts.map(encodeURIComponent).join("/");
  }

  // --- status line ----------------------------------------------------------------
  function status(msg, isError) {
    const s = $("status");
    s.textContent = msg || "";
    s.classList.toggle("error", !!isError);
  }
  const fail = (e) => status(e instanceof ApiError ? e.text : String(e), true);

  // --- sign in ----------------------------------------------------------------------
  async function signIn(ev) {
    ev.preventDefault();
    const key = $("apikey").value.trim();
    const out = $("signin-error");
    out.textContent = "";
    if (!key) { out.textContent = "Enter an API key."; $("apikey").focus(); return; }
    if (/[^\x21-\x7e]/.test(key) || key.length > 512) {
      out.textContent = "Sign-in failed: an API key is one word of printable ASCII (fbk_...).";
      $("apikey").select();
      return;
    }
    $("signin-button").disabled = true;
    try {
      await api("GET", "/v1/sessions", { key });
    } catch (e) {
      out.textContent = e.status === 401
        ? "Sign-in failed: this server does not accept that API key (" + e.message + ")."
        : "Sign-in failed: " + e.text;
      $("apikey").select();
      return;
    } finally {
      $("signin-button").disabled = false;
    }
    try { sessionStorage.setItem(KEY, key); } catch (_) { /* storage off: this page only */ }
    $("apikey").value = "";
    enter(key);
  }

  function enter(key) {
    st.key = key;
    $("signin-view").hidden = true;
    $("app-view").hidden = false;
    $("signout").hidden = false;
    $("whoami").textContent = "signed in (the key stays in this tab)";
    status("");
    loadSessions().then(() => $("new-session").focus());
    loadTemplates();
  }

  function signOut(message) {
    try { sessionStorage.removeItem(KEY); } catch (_) { /* ignore */ }
    st.key = null; st.current = null; st.tree = null; st.selected = null; st.sessions = [];
    st.transcripts.clear();
    clearTimeout(st.templateTimer);
    st.templates = [];
    $("template-progress").textContent = "";
    clear($("session-list")); clear($("transcript")); clear($("tree")); clear($("file-list"));
    $("node-details").hidden = true;
    $("app-view").hidden = true;
    $("signout").hidden = true;
    $("signin-view").hidden = false;
    $("whoami").textContent = "";
    $("signin-error").textContent = message || "";
    status("");
    setEnabled();
    $("apikey").focus();
  }

  // --- sessions -----------------------------------------------------------------------
  async function loadSessions() {
    try {
      const r = await api("GET", "/v1/sessions");
      st.sessions = Array.isArray(r.sessions) ? r.sessions : [];
    } catch (e) { fail(e); return; }
    renderSessions();
  }

  function renderSessions() {
    const ul = clear($("session-list"));
    if (st.sessions.length === 0) ul.appendChild(el("li", { class: "muted" }, "No sessions yet."));
    for (const s of [...st.sessions].reverse()) {
      const tags = Object.entries(s.tags || {}).map(([k, v]) => `${k}=${v}`).join(" ");
      const meta = (s.checkpoint == null ? (s.forked_from ? `forked from ${s.forked_from.session} #${s.forked_from.checkpoint}` : "no checkpoint")
        : `head #${s.checkpoint}`) + (s.template ? " · " + s.template : "");
      const last = s.last_code == null ? "" : String(s.last_code);
      const open = el("button", { type: "button", class: "open", "data-session": s.id,
        title: s.id + (tags ? "\n" + tags : "") + (last ? "\n" + last : ""),
        "aria-current": s.id === st.current ? "true" : false, onclick: () => openSession(s.id) },
        s.id, el("span", { class: "meta" }, cut(meta, 60)),
        tags ? el("span", { class: "meta tags" }, cut(tags, 60)) : null,
        last ? el("span", { class: "meta last-code" }, cut(last, 60)) : null);
      const del = el("button", { type: "button", class: "delete", "aria-label": "Delete session " + s.id, title: "Delete", text: "✕" });
      del.addEventListener("click", () => armedDelete(del, s.id));
      ul.appendChild(el("li", { class: s.id === st.current ? "current" : "" }, open, del));
    }
  }

  // A delete button asks once more ("Delete?") before it deletes.
  async function armedDelete(btn, id) {
    if (btn.dataset.armed !== "1") {
      btn.dataset.armed = "1";
      btn.textContent = "Delete?";
      setTimeout(() => { if (btn.isConnected) { btn.dataset.armed = ""; btn.textContent = "✕"; } }, 4000);
      return;
    }
    try {
      await api("DELETE", `/v1/sessions/${sid(id)}`);
      status("Deleted session " + id + ".");
      st.transcripts.delete(id);
      if (st.current === id) closeSession();
    } catch (e) { fail(e); }
    await loadSessions();
  }

  async function createSession() {
    const name = $("new-template").value;
    const t = st.templates.find((x) => x.name === name);
    // A template that is not open yet is built (or its build waited for) by this request: show its progress meanwhile.
    const watching = name && t && t.status !== "ready";
    let pending = true;
    if (watching) { status(`Creating a session on template ${name} (it is ${t.status})…`); watchTemplate(name, () => pending); }
    $("new-session").disabled = true;
    try {
      const s = await api("POST", "/v1/sessions", { json: name ? { template: name } : {} });
      await loadSessions();
      await openSession(s.id);
      status("Created session " + s.id + (name ? ` on template ${name}` : "") + ".");
    } catch (e) { fail(e); }
    finally {
      pending = false;
      $("new-session").disabled = false;
      if (watching) loadTemplates();
    }
  }

  // --- templates ----------------------------------------------------------------------
  function templateLine(t) {
    if (!t) return "";
    if (t.status === "building") {
      const pct = typeof t.fraction === "number" && isFinite(t.fraction) ? ` ${Math.round(Math.min(1, Math.max(0, t.fraction)) * 100)}%` : "";
      const secs = t.elapsed_seconds != null ? ` · ${Number(t.elapsed_seconds)} s` : "";
      return `Template ${t.name} is building: ${t.progress || "queued"}${pct}${secs}`;
    }
    if (t.status === "failed") return `Template ${t.name} failed to build: ${t.error || "(no reason given)"}`;
    if (t.status === "available") return `Template ${t.name} is built on its first use.`;
    return "";
  }

  function showTemplate() {
    const name = $("new-template").value;
    const t = st.templates.find((x) => x.name === name);
    $("template-progress").textContent = templateLine(t);
  }

  // The templates (for new sessions), polled while one builds.
  async function loadTemplates() {
    clearTimeout(st.templateTimer);
    st.templateTimer = null;
    if (!st.key) return;
    let r;
    try { r = await api("GET", "/v1/templates"); } catch (e) { fail(e); return; }
    st.templates = Array.isArray(r.templates) ? r.templates : [];
    const sel = $("new-template");
    const keep = sel.value;
    clear(sel).appendChild(el("option", { value: "" }, `(the server's default${r.default ? ": " + r.default : ""})`));
    for (const t of st.templates) {
      sel.appendChild(el("option", { value: String(t.name) }, `${t.name}${t.status === "ready" ? "" : " (" + t.status + ")"}`));
    }
    sel.value = st.templates.some((t) => t.name === keep) ? keep : "";
    showTemplate();
    if (st.templates.some((t) => t.status === "building")) st.templateTimer = setTimeout(loadTemplates, 2000);
  }

  // One template's build, polled every second while it builds or `waiting()` says so (GET /v1/templates/{name}).
  async function watchTemplate(name, waiting) {
    for (;;) {
      let t;
      try { t = await api("GET", `/v1/templates/${encodeURIComponent(name)}`); } catch (_) { return; }
      const i = st.templates.findIndex((x) => x.name === t.name);
      if (i >= 0) st.templates[i] = t;
      if ($("new-template").value === name) $("template-progress").textContent = templateLine(t);
      if (t.status !== "building" && !(waiting && waiting())) return;
      await new Promise((res) => setTimeout(res, 1000));
      if (!st.key) return;
    }
  }

  function closeSession() {
    st.current = null; st.tree = null; st.selected = null;
    clear($("transcript")); clear($("tree")); clear($("file-list"));
    clear($("process-list")); clear($("port-list")); $("process-output").hidden = true;
    $("current-session").textContent = "";
    $("node-details").hidden = true;
    setEnabled();
  }

  function transcriptOf(id) {
    let t = st.transcripts.get(id);
    if (!t) { t = el("div", { class: "entries", "data-session": id }); st.transcripts.set(id, t); }
    return t;
  }

  async function openSession(id) {
    st.current = id;
    st.selected = null;
    $("current-session").textContent = id;
    const box = clear($("transcript"));
    box.appendChild(transcriptOf(id));
    clear($("file-list"));
    $("node-details").hidden = true;
    setEnabled();
    renderSessions();
    await Promise.all([loadTree(), loadHistory(id, true), loadRunning()]);
    $("code").focus();
  }

  function setEnabled() {
    const on = !!st.current && !!st.key;
    for (const id of ["code", "run", "upload-input", "upload", "list-files", "reload-running"]) $(id).disabled = !on || (st.running && id === "run");
    $("interrupt").disabled = !on || !st.running;
  }

  // --- the REPL ---------------------------------------------------------------------------
  function note(text, cls) {
    if (!st.current) return;
    const t = transcriptOf(st.current);
    t.appendChild(el("div", { class: "entry" }, el("pre", { class: cls || "note" }, text)));
    scrollDown();
  }
  const scrollDown = () => { const b = $("transcript"); b.scrollTop = b.scrollHeight; };

  // Append streamed text to the entry's last block of that stream (a new block if another came between).
  function appendStream(entry, cls, text) {
    const last = entry.lastElementChild;
    if (last && last.tagName === "PRE" && last.classList.contains(cls)) last.appendChild(document.createTextNode(text));
    else entry.appendChild(el("pre", { class: cls }, text));
    scrollDown();
  }

  async function run(ev) {
    if (ev) ev.preventDefault();
    const code = $("code").value;
    if (!st.current || st.running || code.trim() === "") return;
    const id = st.current;
    const entry = el("div", { class: "entry", "data-state": "running" }, el("pre", { class: "in", "data-prompt": "[…]" }, code));
    transcriptOf(id).appendChild(entry);
    scrollDown();
    st.running = true;
    setEnabled();
    const seen = { stdout: false, stderr: false };
    try {
      const resp = await api("POST", `/v1/sessions/${sid(id)}/exec/stream`, { json: { code }, raw: true });
      $("code").value = "";
      await readEvents(resp, (event, data) => {
        if (event === "stdout" || event === "stderr") {
          seen[event] = true;
          appendStream(entry, event, String(data && data.data != null ? data.data : ""));
        } else if (event === "result") {
          showResult(entry, data || {}, seen);
        } else if (event === "error") {
          showFailure(entry, (data && data.error) || {}, seen);
        }
      });
      if (entry.dataset.state === "running") {
        entry.dataset.state = "failed";
        entry.appendChild(el("pre", { class: "exc" }, "the stream ended without a result (the connection dropped?): reload the tree to see whether it ran"));
      }
    } catch (e) {
      entry.dataset.state = "failed";
      entry.appendChild(el("pre", { class: "exc" }, e instanceof ApiError ? e.text : String(e)));
      if (e.status === 409) entry.appendChild(el("pre", { class: "note" }, "Another exec is running in this session; try again when it ends."));
    } finally {
      st.running = false;
      setEnabled();
      scrollDown();
    }
    if (st.current === id) { await loadTree(); loadSessions(); loadRunning(); }
  }

  // Server-Sent Events over fetch (the stream route is a POST): `event:` and `data:` lines, blank line ends one.
  async function readEvents(resp, onEvent) {
    const reader = resp.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    let event = "message", data = [];
    const dispatch = () => {
      if (data.length) {
        let v = null;
        try { v = JSON.parse(data.join("\n")); } catch (_) { v = null; }
        onEvent(event, v);
      }
      event = "message"; data = [];
    };
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n")) >= 0) {
        let line = buf.slice(0, i);
        buf = buf.slice(i + 1);
        if (line.endsWith("\r")) line = line.slice(0, -1);
        if (line === "") dispatch();
        else if (line.startsWith(":")) continue;
        else if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
    }
    dispatch();
  }

  function setPrompt(entry, n) {
    const inp = entry.querySelector("pre.in");
    if (inp) inp.dataset.prompt = n == null ? "[-]" : `[${n}]`;
    if (n != null) entry.dataset.checkpoint = String(n);
  }

  function showResult(entry, r, seen) {
    entry.dataset.state = "done";
    setPrompt(entry, r.checkpoint);
    if (!seen.stdout && r.stdout) appendStream(entry, "stdout", String(r.stdout));
    if (!seen.stderr && r.stderr) appendStream(entry, "stderr", String(r.stderr));
    for (const b of Array.isArray(r.display) ? r.display : []) renderBundle(entry, b, false);
    if (r.error) {
      entry.dataset.state = "exception";
      const tb = r.error.traceback ? String(r.error.traceback) : "";
      entry.appendChild(el("pre", { class: "exc" }, tb || `${r.error.type}: ${r.error.message}`));
    }
    if (r.value != null) entry.appendChild(el("pre", { class: "value" }, String(r.value)));
    if (r.value_data && typeof r.value_data === "object") renderBundle(entry, r.value_data, true);
    for (const o of Array.isArray(r.outputs) ? r.outputs : []) entry.appendChild(outputFile(o));
    entry.appendChild(el("pre", { class: "note" }, `checkpoint #${r.checkpoint} · ${Number(r.runtime_ms || 0).toFixed(1)} ms in the guest`));
  }

  function showFailure(entry, e, seen) {
    entry.dataset.state = "failed";
    if (!seen.stdout && e.stdout) appendStream(entry, "stdout", String(e.stdout));
    if (!seen.stderr && e.stderr) appendStream(entry, "stderr", String(e.stderr));
    entry.appendChild(el("pre", { class: "exc" }, `${e.code || "error"}: ${e.message || ""}`));
    if (e.checkpoint !== undefined) entry.appendChild(el("pre", { class: "note" }, "the session is back at checkpoint " + (e.checkpoint == null ? "(none)" : "#" + e.checkpoint)));
  }

  // --- history: what the calls on the path to the head showed, as kept with their checkpoints ---
  const HISTORY_PAGE = 50;

  // A call's stored output (GET .../history, .../checkpoints/{n}) into `box`.
  function renderOutput(box, o) {
    if (o.stdout) box.appendChild(el("pre", { class: "stdout" }, String(o.stdout)));
    if (o.stderr) box.appendChild(el("pre", { class: "stderr" }, String(o.stderr)));
    for (const b of Array.isArray(o.display) ? o.display : []) renderBundle(box, b, false);
    if (o.error) box.appendChild(el("pre", { class: "exc" }, o.error.traceback ? String(o.error.traceback) : `${o.error.type}: ${o.error.message}`));
    if (o.value != null) box.appendChild(el("pre", { class: "value" }, String(o.value)));
    if (o.value_data && typeof o.value_data === "object") renderBundle(box, o.value_data, true);
    for (const f of Array.isArray(o.outputs) ? o.outputs : []) box.appendChild(el("pre", { class: "note" }, `output ${f.path} (${bytes(f.size)}, ${f.mime || "?"})`));
    if (o.truncated) box.appendChild(el("pre", { class: "note" }, "(the kept output was cut to its bound)"));
  }

  // A command's call is its label line (`# command: ls`), not the helper program that ran it.
  function shownCode(code) {
    const lines = code.split("\n");
    return lines.length > 1 && lines[0].startsWith("# command") && lines[1].startsWith("(lambda g: (exec(") ? lines[0] : code;
  }

  function callEntry(c) {
    const failed = !!(c.output && c.output.error);
    const entry = el("div", { class: "entry past", "data-state": failed ? "exception" : "done", "data-checkpoint": Number(c.checkpoint) },
      el("pre", { class: "in", "data-prompt": `[${Number(c.checkpoint)}]` }, shownCode(String(c.code ?? ""))));
    if (c.output) renderOutput(entry, c.output);
    else entry.appendChild(el("pre", { class: "note" }, c.summary != null ? "→ " + c.summary : "(no output kept for this call)"));
    return entry;
  }

  // A page of history at the top of `t`, with a button for the page before it.
  function addHistoryPage(t, id, h) {
    const old = t.querySelector("button.earlier");
    if (old) old.remove();
    const frag = document.createDocumentFragment();
    const calls = Array.isArray(h.calls) ? h.calls : [];
    const shown = Number(t.dataset.shown || 0) + calls.length;
    t.dataset.shown = String(shown);
    if (h.before != null) {
      const more = Math.max(0, Number(h.total || 0) - shown);
      frag.appendChild(el("button", { type: "button", class: "earlier", onclick: () => earlierHistory(t, id, h.before) },
        `Show earlier calls (${more} more)`));
    }
    for (const c of calls) frag.appendChild(callEntry(c));
    t.insertBefore(frag, t.firstChild);
  }

  async function earlierHistory(t, id, before) {
    try {
      const h = await api("GET", `/v1/sessions/${sid(id)}/history?limit=${HISTORY_PAGE}&before=${Number(before)}`);
      const top = $("transcript").scrollHeight - $("transcript").scrollTop;
      addHistoryPage(t, id, h);
      $("transcript").scrollTop = $("transcript").scrollHeight - top;
    } catch (e) { fail(e); }
  }

  // The session's transcript rebuilt from its history (the calls from the template to its head).
  // `keepLive`: entries of this page that history does not hold (a failed exec, notes, one running) stay after it.
  async function loadHistory(id, keepLive) {
    const token = ++st.historyToken;
    let h;
    try { h = await api("GET", `/v1/sessions/${sid(id)}/history?limit=${HISTORY_PAGE}`); } catch (e) { fail(e); return; }
    if (st.current !== id || token !== st.historyToken) return;
    const t = el("div", { class: "entries", "data-session": id });
    if (Number(h.total || 0) === 0) t.appendChild(el("div", { class: "entry" }, el("pre", { class: "note" }, "No calls yet: the session is at its template.")));
    addHistoryPage(t, id, h);
    const old = st.transcripts.get(id);
    if (old && keepLive) {
      const have = new Set((h.calls || []).map((c) => String(c.checkpoint)));
      for (const e of [...old.children]) {
        if (!e.classList.contains("entry") || e.classList.contains("past")) continue;
        if (e.dataset.checkpoint && (have.has(e.dataset.checkpoint) || e.dataset.state !== "running")) continue;
        t.appendChild(e);
      }
    }
    st.transcripts.set(id, t);
    clear($("transcript")).appendChild(t);
    scrollDown();
  }

  const B64 = /^[A-Za-z0-9+/]*={0,2}$/;
  function b64Image(mime, data) {
    const s = typeof data === "string" ? data.replace(/\s+/g, "") : "";
    if (!s || s.length % 4 !== 0 || !B64.test(s)) return null;
    return el("img", { class: "rich", alt: mime + " output", src: `data:${mime};base64,${s}` });
  }
  function utf8Base64(text) {
    const u = new TextEncoder().encode(text);
    let bin = "";
    for (let i = 0; i < u.length; i += 0x8000) bin += String.fromCharCode.apply(null, u.subarray(i, i + 0x8000));
    return btoa(bin);
  }

  // One MIME bundle: the richest form we can show safely. `valueSide`: the value's text/plain is shown already.
  function renderBundle(entry, b, valueSide) {
    if (!b || typeof b !== "object") return;
    for (const m of ["image/png", "image/jpeg", "image/gif"]) {
      if (m in b) { const img = b64Image(m, b[m]); if (img) { entry.appendChild(img); return; } }
    }
    if (typeof b["image/svg+xml"] === "string") {
      // As an image: an SVG in <img> runs no script and loads nothing.
      entry.appendChild(el("img", { class: "rich", alt: "SVG output", src: "data:image/svg+xml;base64," + utf8Base64(b["image/svg+xml"]) }));
      return;
    }
    if (typeof b["text/html"] === "string") {
      const f = el("iframe", { class: "rich", sandbox: "", referrerpolicy: "no-referrer", title: "HTML output (sandboxed)", loading: "lazy" });
      f.srcdoc = b["text/html"];
      entry.appendChild(f);
      return;
    }
    if ("application/json" in b) { entry.appendChild(el("pre", { class: "value" }, JSON.stringify(b["application/json"], null, 2))); return; }
    for (const m of ["text/markdown", "text/latex"]) {
      if (typeof b[m] === "string") { entry.appendChild(el("pre", { class: "value" }, b[m])); return; }
    }
    if (!valueSide && typeof b["text/plain"] === "string") entry.appendChild(el("pre", { class: "value" }, b["text/plain"]));
  }

  function outputFile(o) {
    const name = String(o.path || "");
    const li = el("div", { class: "note" }, `output ${name} (${bytes(o.size)}, ${o.mime || "?"}) `);
    li.appendChild(el("button", { type: "button", onclick: () => (o.base64 && B64.test(o.base64)
      ? saveBlob(new Blob([Uint8Array.from(atob(o.base64), (c) => c.charCodeAt(0))], { type: "application/octet-stream" }), name)
      : download(name)) }, "Download"));
    return li;
  }

  async function interrupt() {
    if (!st.current) return;
    try {
      const r = await api("POST", `/v1/sessions/${sid(st.current)}/interrupt`);
      status(r.interrupted ? "Interrupted." : "Nothing was running.");
    } catch (e) { fail(e); }
  }

  // --- files -----------------------------------------------------------------------------
  function saveBlob(blob, name) {
    const url = URL.createObjectURL(blob);
    const a = el("a", { href: url, download: String(name).split("/").pop() || "download" });
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 30000);
  }

  async function download(path, session) {
    try {
      const resp = await api("GET", `/v1/sessions/${sid(session || st.current)}/files/${guestPath(path)}`, { raw: true });
      const blob = await resp.blob();
      saveBlob(blob, path);
      status(`Downloaded ${path} (${bytes(blob.size)}).`);
    } catch (e) { fail(e); }
  }

  async function upload() {
    const f = $("upload-input").files[0];
    if (!st.current || !f) { status("Choose a file to upload.", true); return; }
    const dir = $("upload-dir").value.trim() || "/";
    const path = "/" + [dir, f.name].join("/").split("/").filter((p) => p).join("/");
    try {
      const r = await api("PUT", `/v1/sessions/${sid(st.current)}/files/${guestPath(path)}`, { body: f });
      status(`Uploaded ${r.path} (${bytes(r.size)}) as checkpoint #${r.checkpoint}.`);
      note(`# upload ${r.path} (${bytes(r.size)}) -> checkpoint #${r.checkpoint}`);
      $("upload-input").value = "";
      $("files-dir").value = dir;
      await listFiles();
      await loadTree();
      loadSessions();
    } catch (e) { fail(e); }
  }

  async function listFiles() {
    if (!st.current) return;
    const dir = $("files-dir").value.trim() || "/";
    const ul = clear($("file-list"));
    try {
      const r = await api("GET", `/v1/sessions/${sid(st.current)}/files?dir=${encodeURIComponent(dir)}`);
      const files = Array.isArray(r.files) ? r.files : [];
      if (files.length === 0) ul.appendChild(el("li", { class: "muted" }, "(empty)"));
      for (const f of files) {
        const li = el("li", {}, el("span", { title: String(f.path) }, f.is_dir ? f.path + "/" : `${f.path}  ${bytes(f.size)}`));
        li.appendChild(f.is_dir
          ? el("button", { type: "button", onclick: () => { $("files-dir").value = String(f.path); listFiles(); } }, "Open")
          : el("button", { type: "button", "aria-label": "Download " + f.path, onclick: () => download(String(f.path)) }, "Download"));
        ul.appendChild(li);
      }
    } catch (e) {
      ul.appendChild(el("li", { class: "error" }, e instanceof ApiError ? e.text : String(e)));
    }
  }

  // --- background processes and listening ports ---------------------------------------------
  async function loadRunning() {
    const id = st.current;
    if (!id) return;
    const pl = $("process-list"), ports = $("port-list");
    try {
      const [p, l] = await Promise.all([
        api("GET", `/v1/sessions/${sid(id)}/processes`),
        api("GET", `/v1/sessions/${sid(id)}/ports`),
      ]);
      if (st.current !== id) return;
      renderProcesses(clear(pl), id, Array.isArray(p.processes) ? p.processes : []);
      renderPorts(clear(ports), id, Array.isArray(l.ports) ? l.ports : [], l.resident !== false);
    } catch (e) {
      if (st.current !== id) return;
      clear(pl).appendChild(el("li", { class: "error" }, e instanceof ApiError ? e.text : String(e)));
      clear(ports);
    }
  }

  function renderProcesses(ul, id, procs) {
    if (procs.length === 0) ul.appendChild(el("li", { class: "muted" }, "(none)"));
    for (const p of procs) {
      const pid = Number(p.pid);
      const how = p.state === "running" ? "running" : p.signal != null ? `signal ${p.signal}` : `exit ${p.exit_code ?? "?"}`;
      const argv = (Array.isArray(p.argv) ? p.argv : []).map(String).join(" ");
      const li = el("li", { "data-pid": pid },
        el("span", { class: "mono", title: argv }, `${pid}  ${how}  ${Number(p.cpu_seconds || 0).toFixed(2)} s  ${cut(argv, 60)}`));
      li.appendChild(el("button", { type: "button", "aria-label": `Output of ${pid}`, onclick: () => showProcessOutput(id, pid) }, "Output"));
      if (p.state === "running") {
        li.appendChild(el("button", { type: "button", "aria-label": `Stop ${pid}`, onclick: () => stopProcess(id, pid) }, "Stop"));
      }
      ul.appendChild(li);
    }
  }

  async function showProcessOutput(id, pid) {
    const box = $("process-output");
    try {
      const [o, e] = await Promise.all(["stdout", "stderr"].map((s) =>
        api("GET", `/v1/sessions/${sid(id)}/processes/${pid}/output?stream=${s}&offset=0&max=65536`)));
      if (st.current !== id) return;
      const text = String(o.data ?? "") + (e.data ? "\n[stderr]\n" + String(e.data) : "");
      box.textContent = text === "" ? `(${pid} wrote nothing yet)` : text;
      box.hidden = false;
    } catch (err) { fail(err); }
  }

  async function stopProcess(id, pid) {
    try {
      await api("POST", `/v1/sessions/${sid(id)}/processes/${pid}/signal`, { json: { signal: 15 } });
      status(`sent SIGTERM to ${pid}`);
      // Shown as it ends (a process may take a moment to handle the signal).
      await api("POST", `/v1/sessions/${sid(id)}/processes/${pid}/wait`, { json: { timeout_seconds: 5 } });
      await loadRunning();
    } catch (e) { fail(e); }
  }

  function renderPorts(ul, id, ports, resident) {
    if (!resident) { ul.appendChild(el("li", { class: "muted" }, "(the session is paused: its servers come back when a request resumes it)")); return; }
    if (ports.length === 0) ul.appendChild(el("li", { class: "muted" }, "(nothing listens)"));
    for (const p of ports) {
      const port = Number(p.port);
      const li = el("li", { "data-port": port }, el("span", { class: "mono" }, `${port}  ${cut(p.address, 40)}`));
      if (p.proxied) {
        li.appendChild(el("button", { type: "button", "aria-label": `Open port ${port}`, onclick: () => openPort(id, port, li) }, "Open"));
      } else {
        li.appendChild(el("span", { class: "muted small" }, " (not on loopback: not reachable through the server)"));
      }
      ul.appendChild(li);
    }
  }

  // A signed URL (no key in it; it reaches this port only, until it expires), shown as a link.
  async function openPort(id, port, li) {
    try {
      const r = await api("POST", `/v1/sessions/${sid(id)}/ports/${port}/url`, { json: {} });
      // This page's origin with the URL's path and token: the server names itself by the Host it
      // was asked with, which behind a TLS proxy is not the scheme the browser uses.
      const u = new URL(String(r.url), location.href);
      const href = location.origin + u.pathname + u.search;
      const old = li.querySelector("a");
      if (old) old.remove();
      li.appendChild(el("a", { href, target: "_blank", rel: "noopener noreferrer" }, `port ${port} (link valid until ${String(r.expires_at ?? "")})`));
    } catch (e) { fail(e); }
  }

  // --- the tree ------------------------------------------------------------------------
  async function loadTree() {
    const id = st.current;
    if (!id) return;
    try {
      const t = await api("GET", `/v1/sessions/${sid(id)}/tree`);
      if (st.current !== id) return;
      st.tree = t;
    } catch (e) { fail(e); return; }
    const t = st.tree;
    renderTree();
    const n = st.byNum && st.byNum.get(st.selected);
    if (n && !$("node-details").hidden) nodeHeader(n);
    if (t.head != null) showInTree(t.head);
  }

  // Scroll the tree (only the tree) so that a node is in view.
  function showInTree(num) {
    const p = st.pos && st.pos.get(num);
    const w = $("tree-wrap");
    if (!p) return;
    if (p.x < w.scrollLeft || p.x + NW > w.scrollLeft + w.clientWidth) w.scrollLeft = Math.max(0, p.x + NW + PAD - w.clientWidth);
    if (p.y < w.scrollTop || p.y + NH > w.scrollTop + w.clientHeight) w.scrollTop = Math.max(0, p.y + NH + PAD - w.clientHeight);
  }

  const NW = 176, NH = 42, GX = 26, GY = 12, PAD = 8;

  function renderTree() {
    const t = st.tree;
    const g = clear($("tree"));
    if (!t) return;
    const nodes = Array.isArray(t.nodes) ? t.nodes : [];
    const byNum = new Map(nodes.map((n) => [n.checkpoint, n]));
    const kids = new Map();
    const roots = [];
    for (const n of nodes) {
      if (n.parent != null && byNum.has(n.parent)) {
        if (!kids.has(n.parent)) kids.set(n.parent, []);
        kids.get(n.parent).push(n);
      } else roots.push(n);
    }
    // Layout: depth to the right; a node shares the row of its first child, later children go below.
    const pos = new Map();
    const order = [];
    let row = 0;
    const place = (n, depth) => {
      order.push(n.checkpoint);
      pos.set(n.checkpoint, { x: PAD + (depth + 1) * (NW + GX), y: PAD + row * (NH + GY) });
      const ch = kids.get(n.checkpoint) || [];
      if (ch.length === 0) { row += 1; return; }
      ch.forEach((c) => place(c, depth + 1));
    };
    roots.forEach((r) => place(r, 0));
    const rows = Math.max(row, 1);
    const width = PAD * 2 + (Math.max(0, ...[...pos.values()].map((p) => p.x)) + NW);
    const height = PAD * 2 + rows * (NH + GY);
    g.setAttribute("width", String(Math.max(width, NW + PAD * 2)));
    g.setAttribute("height", String(height));
    g.setAttribute("viewBox", `0 0 ${Math.max(width, NW + PAD * 2)} ${height}`);
    const base = { x: PAD, y: PAD };
    const edges = svg("g", { class: "edges" });
    const draw = (a, b) => {
      const x1 = a.x + NW, y1 = a.y + NH / 2, x2 = b.x, y2 = b.y + NH / 2, mx = (x1 + x2) / 2;
      edges.appendChild(svg("path", { class: "edge", d: `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2},${y2}` }));
    };
    for (const n of nodes) {
      const p = pos.get(n.checkpoint);
      const from = n.parent != null && pos.has(n.parent) ? pos.get(n.parent) : base;
      draw(from, p);
    }
    g.appendChild(edges);
    // The template every root ran on.
    g.appendChild(svg("g", { class: "node root", transform: `translate(${base.x},${base.y})`, "aria-hidden": "true" },
      svg("rect", { width: NW, height: NH, rx: 6 }),
      svg("text", { x: 8, y: 17, class: "num" }, "template"),
      svg("text", { x: 8, y: 33 }, cut(t.session, 24))));
    st.order = order;
    st.pos = pos;
    st.kids = kids;
    st.byNum = byNum;
    // One tab stop in the tree (the selected node, else the head, else the first); arrows move between nodes.
    const headNode = nodes.find((n) => n.head);
    const stop = byNum.has(st.selected) ? st.selected : headNode ? headNode.checkpoint : order[0];
    for (const n of nodes) {
      const p = pos.get(n.checkpoint);
      const heads = Array.isArray(n.heads) ? n.heads : [];
      const others = heads.filter((h) => h !== t.session);
      const failed = /^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b/.test(String(n.summary || ""));
      const cls = ["node", n.head ? "head" : "", others.length ? "other-head" : "", n.checkpoint === st.selected ? "selected" : "", failed ? "error-node" : ""].filter(Boolean).join(" ");
      const code = firstLine(n.code);
      const label = `Checkpoint ${n.checkpoint}${n.head ? " (head)" : ""}: ${cut(code, 80)}${n.summary ? " → " + cut(n.summary, 80) : ""}`;
      const node = svg("g", { class: cls, transform: `translate(${p.x},${p.y})`, tabindex: n.checkpoint === stop ? "0" : "-1", role: "treeitem",
        "aria-label": label, "aria-selected": n.checkpoint === st.selected ? "true" : "false", "data-checkpoint": n.checkpoint },
        svg("title", {}, `#${n.checkpoint} · ${n.session}\n${n.code}\n→ ${n.summary ?? ""}`),
        svg("rect", { width: NW, height: NH, rx: 6 }),
        svg("text", { x: 7, y: 16 }, svg("tspan", { class: "num" }, `#${n.checkpoint} `), cut(code, 20)),
        svg("text", { x: 7, y: 33, class: "summary" }, cut(n.summary == null ? "" : "→ " + n.summary, 25)));
      if (n.head) node.appendChild(svg("text", { x: NW - 34, y: 13, class: "badge" }, "HEAD"));
      else if (others.length) node.appendChild(svg("text", { x: NW - 12, y: 13, class: "badge" }, "◆"));
      node.addEventListener("click", () => select(n.checkpoint));
      node.addEventListener("keydown", (e) => treeKey(e, n));
      g.appendChild(node);
    }
  }

  function focusNode(num) {
    const e = $("tree").querySelector(`g.node[data-checkpoint="${Number(num)}"]`);
    if (!e) return;
    for (const o of $("tree").querySelectorAll('g.node[tabindex="0"]')) o.setAttribute("tabindex", "-1");
    e.setAttribute("tabindex", "0");
    e.focus();
    e.scrollIntoView({ block: "nearest", inline: "nearest" });
  }

  function treeKey(e, n) {
    const order = st.order || [];
    const i = order.indexOf(n.checkpoint);
    let to = null;
    if (e.key === "Enter" || e.key === " ") { e.preventDefault(); select(n.checkpoint); return; }
    if (e.key === "ArrowLeft" && n.parent != null) to = n.parent;
    else if (e.key === "ArrowRight" && (st.kids.get(n.checkpoint) || []).length) to = st.kids.get(n.checkpoint)[0].checkpoint;
    else if (e.key === "ArrowDown" && i + 1 < order.length) to = order[i + 1];
    else if (e.key === "ArrowUp" && i > 0) to = order[i - 1];
    else if (e.key === "Home" && order.length) to = order[0];
    else if (e.key === "End" && order.length) to = order[order.length - 1];
    if (to != null) { e.preventDefault(); focusNode(to); }
  }

  async function select(num) {
    st.selected = num;
    renderTree();
    focusNode(num);
    const n = st.byNum && st.byNum.get(num);
    if (!n) return;
    const token = ++st.detailToken;
    $("node-details").hidden = false;
    nodeHeader(n);
    clear($("diff-out"));
    clear($("explore-results"));
    const vars = clear($("node-vars"));
    const files = clear($("node-files"));
    st.vars = [];
    loadNodeOutput(num, token);
    vars.appendChild(el("p", { class: "muted" }, "Reading the variables in a throwaway fork…"));
    try {
      const r = await api("GET", `/v1/sessions/${sid(st.current)}/checkpoints/${Number(num)}/variables?files=true`);
      if (token !== st.detailToken) return;
      st.vars = Array.isArray(r.variables) ? r.variables : [];
      st.omitted = r.omitted;
      renderVars();
      renderNodeFiles(files, r.files, n);
    } catch (e) {
      if (token !== st.detailToken) return;
      clear(vars).appendChild(el("p", { class: "error" }, e instanceof ApiError ? e.text : String(e)));
    }
  }

  // The full output of the call that made checkpoint `num` (GET .../checkpoints/{n}).
  async function loadNodeOutput(num, token) {
    const box = clear($("node-output"));
    box.appendChild(el("p", { class: "muted" }, "Loading the call's output…"));
    try {
      const c = await api("GET", `/v1/sessions/${sid(st.current)}/checkpoints/${Number(num)}`);
      if (token !== st.detailToken) return;
      clear(box);
      if (c.output) renderOutput(box, c.output);
      else box.appendChild(el("p", { class: "muted" }, "No output was kept for this call (an upload, a package install, or a call from before outputs were kept)."));
      if (c.output && !box.firstChild) box.appendChild(el("p", { class: "muted" }, "The call showed nothing."));
    } catch (e) {
      if (token !== st.detailToken) return;
      clear(box).appendChild(el("p", { class: "error" }, e instanceof ApiError ? e.text : String(e)));
    }
  }

  // The selected node's variables: modules hidden unless asked for.
  function renderVars() {
    const box = clear($("node-vars"));
    const all = st.vars || [];
    const showModules = $("show-modules").checked;
    const vs = showModules ? all : all.filter((v) => v.type !== "module");
    box.appendChild(varTable(vs, "node-vars-table"));
    const hidden = all.length - vs.length;
    if (hidden) box.appendChild(el("p", { class: "muted small", id: "modules-hidden" }, `${hidden} module${hidden === 1 ? "" : "s"} hidden`));
    if (st.omitted) box.appendChild(el("p", { class: "muted" }, `${st.omitted} more not listed`));
  }

  // The selected node's title, code and summary (again after the tree changed: the head may have moved).
  function nodeHeader(n) {
    $("node-title").textContent = `Checkpoint #${n.checkpoint}` + (n.head ? " (this session's head)" : "") + ` · made by ${n.session}`;
    $("node-code").textContent = String(n.code ?? "");
    const others = (n.heads || []).filter((h) => h !== st.tree.session);
    $("node-summary").textContent = (n.summary != null ? "→ " + n.summary : "(no result summary)") +
      ` · ${bytes(n.bytes)} · ${new Date(Number(n.created_ms)).toLocaleString()}` + (others.length ? " · head of " + others.join(", ") : "");
  }

  function varTable(vs, id) {
    if (vs.length === 0) return el("p", { class: "muted", id }, "No variables.");
    const tb = el("tbody");
    for (const v of vs) {
      tb.appendChild(el("tr", { "data-name": String(v.name) }, el("td", { class: "mono" }, v.name), el("td", { class: "mono" }, v.type),
        el("td", { class: "mono repr" }, v.repr), el("td", {}, bytes(v.size) + (v.len != null ? ` · len ${v.len}` : ""))));
    }
    return el("table", { id }, el("thead", {}, el("tr", {}, el("th", {}, "name"), el("th", {}, "type"), el("th", {}, "repr"), el("th", {}, "size"))), tb);
  }

  function renderNodeFiles(box, f, n) {
    if (!f) return;
    const rows = [...(f.added || []).map((x) => ["added", x]), ...(f.changed || []).map((x) => ["changed", x]), ...(f.removed || []).map((x) => ["removed", x])];
    if (rows.length === 0) { box.appendChild(el("p", { class: "muted" }, "No files beside the template's.")); return; }
    const ul = el("ul", { class: "file-list", id: "node-files-list" });
    for (const [kind, x] of rows) {
      const li = el("li", { class: kind }, el("span", { title: String(x.path) }, `${kind === "added" ? "+" : kind === "removed" ? "−" : "~"} ${x.path}  ${bytes(x.size_after ?? x.size_before)}`));
      if (n.head && kind !== "removed") li.appendChild(el("button", { type: "button", "aria-label": "Download " + x.path, onclick: () => download(String(x.path)) }, "Download"));
      ul.appendChild(li);
    }
    box.appendChild(ul);
    if (!n.head) box.appendChild(el("p", { class: "muted small" }, "Files download from a session's head: revert or fork here to get them."));
    if (f.truncated) box.appendChild(el("p", { class: "muted small" }, "The walk stopped at its bound: the list may be incomplete."));
  }

  async function revertHere() {
    const n = st.selected;
    if (!st.current || n == null) return;
    try {
      await api("POST", `/v1/sessions/${sid(st.current)}/revert`, { json: { checkpoint: n } });
      status(`Reverted ${st.current} to checkpoint #${n}.`);
      await loadHistory(st.current, false);
      note(`reverted to checkpoint #${n}: the next exec continues from there`);
      await loadTree();
      loadSessions();
      select(n);
    } catch (e) { fail(e); }
  }

  async function forkHere() {
    const n = st.selected;
    if (!st.current || n == null) return;
    const from = st.current;
    try {
      const s = await api("POST", `/v1/sessions/${sid(from)}/fork`, { json: { checkpoint: n } });
      await loadSessions();
      await openSession(s.id);
      note(`forked from ${from} at checkpoint #${n}`);
      status(`Forked ${from} at #${n}: session ${s.id}.`);
    } catch (e) { fail(e); }
  }

  async function diffHead() {
    const n = st.selected;
    if (!st.current || n == null) return;
    const out = clear($("diff-out"));
    out.appendChild(el("p", { class: "muted" }, "Comparing in throwaway forks…"));
    try {
      const d = await api("GET", `/v1/sessions/${sid(st.current)}/diff?from=${Number(n)}`);
      clear(out);
      out.appendChild(el("h4", { id: "diff-title" }, `Diff #${d.from} → head #${d.to ?? "-"} (common ancestor ${d.common == null ? "template" : "#" + d.common})`));
      const list = el("ul", { class: "file-list", id: "diff-list" });
      const line = (cls, text) => list.appendChild(el("li", { class: cls }, el("span", { title: text }, text)));
      for (const c of d.undone || []) line("removed", `undone #${c.checkpoint}: ${firstLine(c.code)}`);
      for (const c of d.calls || []) line("added", `call #${c.checkpoint}: ${firstLine(c.code)}`);
      for (const v of d.variables_added || []) line("added", `+ ${v.name} = ${v.repr}`);
      for (const v of d.variables_removed || []) line("removed", `− ${v.name}`);
      for (const v of d.variables_changed || []) line("changed", `~ ${v.name}: ${v.before.repr} → ${v.after.repr}`);
      for (const f of d.files_added || []) line("added", `+ ${f.path} (${bytes(f.size_after)})`);
      for (const f of d.files_removed || []) line("removed", `− ${f.path}`);
      for (const f of d.files_changed || []) line("changed", `~ ${f.path} (${bytes(f.size_before)} → ${bytes(f.size_after)})`);
      if (!list.firstChild) line("muted", "No differences.");
      out.appendChild(list);
    } catch (e) {
      clear(out).appendChild(el("p", { class: "error" }, e instanceof ApiError ? e.text : String(e)));
    }
  }

  function toggleExplore() {
    const f = $("explore-form");
    f.hidden = !f.hidden;
    $("explore-toggle").setAttribute("aria-expanded", f.hidden ? "false" : "true");
    if (!f.hidden) $("explore-codes").focus();
  }

  async function exploreRun(ev) {
    ev.preventDefault();
    const n = st.selected;
    if (!st.current || n == null) return;
    const codes = $("explore-codes").value.split(/^---[ \t]*$/m).map((c) => c.replace(/^\n+|\s+$/g, "")).filter((c) => c.trim() !== "");
    const out = clear($("explore-results"));
    if (codes.length === 0) { out.appendChild(el("p", { class: "error" }, "Write one or more alternatives, separated by a line ---.")); return; }
    const keep = $("explore-keep").value === "all" ? "all" : "none";
    out.appendChild(el("p", { class: "muted" }, `Running ${codes.length} alternatives in parallel forks of #${n}…`));
    try {
      const r = await api("POST", `/v1/sessions/${sid(st.current)}/explore`, { json: { codes, checkpoint: n, keep } });
      clear(out);
      const tb = el("tbody");
      for (const b of r.branches || []) {
        const res = b.result;
        const what = res ? (res.error ? `${res.error.type}: ${res.error.message}` : (res.value ?? "")) : `${b.failed?.error?.code}: ${b.failed?.error?.message}`;
        const tr = el("tr", { "data-index": b.index }, el("td", {}, String(b.index)), el("td", { class: "mono" }, cut(firstLine(codes[b.index]), 60)),
          el("td", { class: "mono repr" + (res && !res.error ? "" : " removed") }, cut(what, 200)), el("td", { class: "mono repr" }, cut(res ? res.stdout : "", 200)));
        const last = el("td");
        if (b.session) last.appendChild(el("button", { type: "button", onclick: () => openSession(b.session) }, "Open"));
        tr.appendChild(last);
        tb.appendChild(tr);
      }
      out.appendChild(el("table", { id: "explore-table" }, el("thead", {}, el("tr", {}, el("th", {}, "#"), el("th", {}, "code"), el("th", {}, "result"), el("th", {}, "stdout"), el("th", {}, "session"))), tb));
      out.appendChild(el("p", { class: "muted small" }, `${Number(r.total_time_ms || 0).toFixed(0)} ms in all`));
      if (keep === "all") { await loadTree(); loadSessions(); }
    } catch (e) {
      clear(out).appendChild(el("p", { class: "error" }, e instanceof ApiError ? e.text : String(e)));
    }
  }

  // --- wiring -------------------------------------------------------------------------
  function init() {
    $("signin-form").addEventListener("submit", signIn);
    $("signout").addEventListener("click", () => signOut("Signed out."));
    $("new-session").addEventListener("click", createSession);
    $("refresh-sessions").addEventListener("click", () => { loadSessions(); loadTree(); });
    $("exec-form").addEventListener("submit", run);
    $("code").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.shiftKey || e.ctrlKey || e.metaKey)) run(e);
    });
    $("interrupt").addEventListener("click", interrupt);
    $("upload").addEventListener("click", upload);
    $("list-files").addEventListener("click", listFiles);
    $("reload-running").addEventListener("click", loadRunning);
    $("files-dir").addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); listFiles(); } });
    $("revert-here").addEventListener("click", revertHere);
    $("show-modules").addEventListener("change", renderVars);
    $("new-template").addEventListener("change", () => { showTemplate(); if ($("new-template").value) watchTemplate($("new-template").value); });
    $("fork-here").addEventListener("click", forkHere);
    $("diff-head").addEventListener("click", diffHead);
    $("explore-toggle").addEventListener("click", toggleExplore);
    $("explore-form").addEventListener("submit", exploreRun);
    $("explore-codes").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) exploreRun(e);
    });
    setEnabled();
    let key = null;
    try { key = sessionStorage.getItem(KEY); } catch (_) { key = null; }
    if (key) {
      // Check it once more: a key can be revoked, or the server changed.
      api("GET", "/v1/sessions", { key }).then(() => enter(key), (e) => signOut(e.status === 401 ? "Sign in again: the stored API key is not accepted." : "Sign-in failed: " + e.text));
    } else {
      $("apikey").focus();
    }
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
