// The API key, for a gateway with keys on (ARENA_API_KEYS). Every call of the pages goes
// through api(): it sends the key as `Authorization: Bearer` (never in a URL, which the
// gateway refuses and access logs would keep) and, on a 401, asks for a key and tries
// again. The key stays in this tab (sessionStorage), or in this browser when "remember"
// is ticked (localStorage); the page the gateway serves holds none.
"use strict";
const KEY_NAME = "arenaflow.api_key";
let asking = null; // one form at a time, whatever number of calls wait for it

function storedKey() { return sessionStorage.getItem(KEY_NAME) || localStorage.getItem(KEY_NAME); }

function forgetKey() {
  sessionStorage.removeItem(KEY_NAME);
  localStorage.removeItem(KEY_NAME);
  document.querySelector("#forget-key").hidden = true;
}

function keyForm() {
  const form = document.createElement("form");
  form.id = "key-form";
  form.innerHTML = `<p id="key-message" role="alert"></p>
    <label>API key <input id="key-input" type="password" autocomplete="off" required></label>
    <label class="remember"><input id="key-remember" type="checkbox"> remember on this browser</label>
    <button id="key-submit" type="submit">Use key</button>`;
  document.querySelector("main").prepend(form);
  return form;
}

function askKey(message) {
  if (asking) return asking;
  const form = document.querySelector("#key-form") || keyForm();
  form.querySelector("#key-message").textContent = message;
  form.hidden = false;
  form.querySelector("#key-input").focus();
  asking = new Promise((resolve) => {
    form.onsubmit = (event) => {
      event.preventDefault();
      const key = form.querySelector("#key-input").value.trim();
      if (!key) return;
      (form.querySelector("#key-remember").checked ? localStorage : sessionStorage).setItem(KEY_NAME, key);
      form.querySelector("#key-input").value = "";
      form.hidden = true;
      document.querySelector("#forget-key").hidden = false;
      asking = null;
      resolve();
    };
  });
  return asking;
}

async function refusal(r) {
  try { return (await r.json()).error.message; } catch { return `HTTP ${r.status}`; }
}

async function api(path, init = {}) {
  for (;;) {
    const key = storedKey();
    const headers = { ...(init.headers || {}) };
    if (key) headers.authorization = `Bearer ${key}`;
    const r = await fetch(path, { ...init, headers });
    if (r.status !== 401) return r;
    const why = await refusal(r);
    forgetKey();
    await askKey(key ? `That key was refused: ${why}. Try again.` : "This arena needs an API key.");
  }
}

document.querySelector("#forget-key").hidden = !storedKey();
document.querySelector("#forget-key").addEventListener("click", () => { forgetKey(); location.reload(); });
