// The battle page: start a battle, stream both sides of each turn, vote, reveal (the
// calls go through key.js's api(), which sends the API key when the gateway wants one).
"use strict";
const $ = (s) => document.querySelector(s);
const voteButtons = [...document.querySelectorAll(".votes button")];
let battle = null;
let busy = false;

function status(text) { $("#status").textContent = text; }
function setVoting(on) { voteButtons.forEach((b) => { b.disabled = !on; }); }

async function newBattle() {
  setVoting(false);
  $("#reveal").hidden = true;
  for (const side of ["a", "b"]) {
    $(`#pane-${side} .name`).textContent = `Model ${side.toUpperCase()}`;
    $(`#pane-${side} .text`).textContent = "";
    $(`#pane-${side}`).classList.remove("winner");
  }
  $("#prompt").disabled = $("#send").disabled = false;
  const r = await api("/arena/battles", { method: "POST" });
  if (!r.ok) { status(await refusal(r)); return; }
  battle = await r.json();
  status("New battle: ask something.");
}

function addTurnHeader(prompt) {
  for (const side of ["a", "b"]) {
    const q = document.createElement("p");
    q.className = "you";
    q.textContent = prompt;
    const a = document.createElement("p");
    a.className = "answer";
    $(`#pane-${side} .text`).append(q, a);
  }
}

function onFrame(frame) {
  const answers = document.querySelectorAll(`#pane-${frame.side} .answer`);
  const el = answers[answers.length - 1];
  if (frame.delta && frame.delta.content) el.textContent += frame.delta.content;
  if (frame.error) el.textContent += ` [${frame.error.message}]`;
}

async function ask(event) {
  event.preventDefault();
  const prompt = $("#prompt").value.trim();
  if (!prompt || !battle || busy) return;
  busy = true;
  setVoting(false);
  $("#send").disabled = true;
  addTurnHeader(prompt);
  status("Both models are answering…");
  try {
    const r = await api(`/arena/battles/${battle.battle_id}/turns`, {
      method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ prompt }),
    });
    if (!r.ok) { status(await refusal(r)); return; }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 2);
        if (line.startsWith("data: {")) onFrame(JSON.parse(line.slice(6)));
      }
    }
    $("#prompt").value = "";
    setVoting(true);
    status("Vote, or ask a follow-up.");
  } finally {
    busy = false;
    $("#send").disabled = false;
  }
}

async function vote(choice) {
  setVoting(false);
  const r = await api(`/arena/battles/${battle.battle_id}/vote`, {
    method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ choice }),
  });
  if (!r.ok) { status(await refusal(r)); setVoting(true); return; }
  const v = await r.json();
  $("#pane-a .name").textContent = `Model A: ${v.model_a}`;
  $("#pane-b .name").textContent = `Model B: ${v.model_b}`;
  if (choice === "a" || choice === "b") $(`#pane-${choice}`).classList.add("winner");
  const note = v.counted ? "Your vote counts." : `Not counted: ${v.invalid_reason}`;
  $("#reveal").textContent = `${v.model_a} vs ${v.model_b}. ${note}`;
  $("#reveal").hidden = false;
  $("#prompt").disabled = $("#send").disabled = true;
  status("Thanks! Start a new round.");
}

$("#ask").addEventListener("submit", ask);
$("#new-round").addEventListener("click", newBattle);
voteButtons.forEach((b) => b.addEventListener("click", () => vote(b.dataset.choice)));
newBattle();
