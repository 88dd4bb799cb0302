// The battle page: start a battle, stream both sides of each turn, vote, reveal (the
// calls go through key.js's api(), which sends the API key when the gateway wants one).
"use strict";
const $ = (s) => document.querySelector(s);
const voteButtons = [...document.querySelectorAll(".votes button")];
let battle = null;
let busy = false;

// What a person reads when a turn is refused or does not finish: by the API's error code,
// never its message (which is written for programs: fields, limits, endpoints).
const REFUSED = {
  overloaded: "The arena is busy right now.",
  rate_limit_exceeded: "You are sending prompts faster than this arena allows.",
  deadline_too_short: "One of the two models cannot write an answer that long in time here. Try again, or start a new round to meet two other models.",
  prompt_too_long: "Your prompt is too long for these models. Shorten it and send it again.",
  context_length_exceeded: "This conversation is too long for these models. Start a new round.",
  prompt_rejected: "The arena's filter refused this prompt. Try another one.",
  battle_closed: "This battle is over. Start a new round.",
  battle_not_found: "This battle is gone. Start a new round.",
  turn_running: "The models are still answering. Try again in a moment.",
};
// How a side's answer ended, when it did not finish (the stream's error code).
const ENDED = {
  deadline_exceeded: "Cut off: this model ran out of time.",
  overloaded: "This model was too busy to answer in time.",
  deadline_too_short: "This model could not answer in time.",
  cancelled: "Stopped: the other model did not finish, so this turn was called off.",
  prompt_rejected: "The arena's filter refused this prompt.",
  prompt_too_long: "The conversation is too long for this model.",
  context_length_exceeded: "The conversation is too long for this model.",
};

function status(text) { $("#status").textContent = text; }
function setVoting(on) { voteButtons.forEach((b) => { b.disabled = !on; }); }
function showVotes(on) { $(".votes").hidden = !on; }

// A problem, said plainly, with a retry that sends the prompt (still in its box) again.
function notice(text, retry = true) {
  $("#notice-text").textContent = text;
  $("#retry").hidden = !retry;
  $("#notice").hidden = false;
}
function clearNotice() { $("#notice").hidden = true; }

async function refusedText(r) {
  let code = "";
  try { code = (await r.json()).error.code || ""; } catch { /* not the API's error shape */ }
  if (REFUSED[code]) {
    const wait = Number(r.headers.get("retry-after"));
    return code === "overloaded" || code === "rate_limit_exceeded"
      ? `${REFUSED[code]} Try again ${wait > 0 ? `in ${Math.min(wait, 600)} s` : "in a moment"}.`
      : REFUSED[code];
  }
  if (r.status === 429 || r.status === 503) return "The arena is busy right now. Try again in a moment.";
  return "Something went wrong on the arena's side. Try again in a moment.";
}

async function newBattle() {
  setVoting(false);
  showVotes(true);
  clearNotice();
  $("#reveal").hidden = true;
  for (const side of ["a", "b"]) {
    $(`#pane-${side} .name`).textContent = `Model ${side.toUpperCase()}`;
    $(`#pane-${side} .text`).textContent = "";
    $(`#pane-${side}`).classList.remove("winner");
  }
  $("#prompt").disabled = $("#send").disabled = false;
  battle = null;
  const r = await api("/arena/battles", { method: "POST" }).catch(() => null);
  if (!r || !r.ok) {
    status("");
    notice(r && r.status === 503
      ? "Fewer than two models are ready to battle right now. Start a new round in a moment."
      : "Could not start a battle. Start a new round in a moment.", false);
    return;
  }
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

// The newest turn's elements in both panes (its prompt and answer).
function lastTurn() {
  return [...document.querySelectorAll(".pane .text")].flatMap((t) => [...t.querySelectorAll(".you, .answer")].slice(-2));
}

// A side's frame; returns how that side ended ("" while it runs, "ok", or an error code).
function onFrame(frame) {
  const answers = document.querySelectorAll(`#pane-${frame.side} .answer`);
  const el = answers[answers.length - 1];
  if (frame.delta && frame.delta.content) el.textContent += frame.delta.content;
  if (!frame.finish_reason) return "";
  if (frame.finish_reason !== "error") return "ok";
  const code = (frame.error && frame.error.code) || "internal_error";
  const note = document.createElement("span");
  note.className = "ended";
  note.textContent = ENDED[code] || "This model failed to answer.";
  el.after(note);
  return code;
}

// Both sides' frames until [DONE]: how each side ended.
async function follow(r) {
  const ends = {};
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
      if (line.startsWith("data: {")) {
        const frame = JSON.parse(line.slice(6));
        const ended = onFrame(frame);
        if (ended) ends[frame.side] = ended;
      }
    }
  }
  return ends;
}

async function ask(event) {
  if (event) event.preventDefault();
  // The prompt stays in its box until both models answered it: a retry sends it again.
  const prompt = $("#prompt").value.trim();
  if (!prompt || !battle || busy) return;
  busy = true;
  const couldVote = !voteButtons[0].disabled;
  setVoting(false);
  $("#send").disabled = $("#retry").disabled = true;
  // A turn that did not finish is no part of the battle: its retry replaces it.
  document.querySelectorAll(".incomplete").forEach((el) => el.remove());
  clearNotice();
  showVotes(true);
  addTurnHeader(prompt);
  status("Both models are answering…");
  try {
    const r = await api(`/arena/battles/${battle.battle_id}/turns`, {
      method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ prompt }),
    }).catch(() => null);
    if (!r || !r.ok) {
      // Refused before anything ran: the battle is as it was before the prompt.
      lastTurn().forEach((el) => el.remove());
      status("");
      setVoting(couldVote);
      showVotes(couldVote);
      notice(r ? await refusedText(r) : "Could not reach the arena. Check the connection and try again.");
      return;
    }
    const ends = await follow(r).catch(() => ({}));
    if (ends.a === "ok" && ends.b === "ok") {
      $("#prompt").value = "";
      setVoting(true);
      status("Vote, or ask a follow-up.");
      return;
    }
    lastTurn().forEach((el) => el.classList.add("incomplete"));
    document.querySelectorAll(".ended").forEach((el) => el.classList.add("incomplete"));
    showVotes(false);
    status("");
    notice("This turn did not finish, so there is nothing to vote on yet. Try again: your prompt is kept.");
  } finally {
    busy = false;
    $("#send").disabled = $("#retry").disabled = false;
  }
}

async function vote(choice) {
  setVoting(false);
  const r = await api(`/arena/battles/${battle.battle_id}/vote`, {
    method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ choice }),
  });
  if (!r.ok) {
    // The page offers a vote only on a turn both models finished; a refusal here means the
    // battle changed elsewhere (another tab): say so plainly.
    const code = await r.clone().json().then((b) => b.error.code, () => "");
    if (code === "turn_incomplete" || code === "not_answered") {
      showVotes(false);
      notice("The last turn did not finish, so there is nothing to vote on. Send your prompt again.");
    } else {
      notice(await refusedText(r), false);
      setVoting(true);
    }
    return;
  }
  clearNotice();
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
$("#retry").addEventListener("click", () => ask(null));
$("#new-round").addEventListener("click", newBattle);
voteButtons.forEach((b) => b.addEventListener("click", () => vote(b.dataset.choice)));
newBattle();
