// The leaderboard page: ratings, 95% intervals drawn as bars, vote counts; refreshed live.
"use strict";
function cell(text, cls) { const td = document.createElement("td"); td.textContent = text; if (cls) td.className = cls; return td; }

function bar(row, lo, hi) {
  const td = document.createElement("td");
  const box = document.createElement("div");
  box.className = "bar";
  box.title = `${row.ci_low.toFixed(1)} – ${row.ci_high.toFixed(1)}`;
  const span = document.createElement("span");
  const pos = (x) => (100 * (x - lo)) / (hi - lo || 1);
  span.style.left = `${pos(row.ci_low)}%`;
  span.style.width = `${Math.max(1, pos(row.ci_high) - pos(row.ci_low))}%`;
  const mark = document.createElement("i");
  mark.style.left = `${pos(row.rating)}%`;
  box.append(span, mark);
  td.append(box);
  return td;
}

// Which board: all votes, style-controlled (?style_control=true) or one category (?category=NAME).
const view = document.querySelector("#view");
function query() {
  if (view.value === "style") return "?style_control=true";
  return view.value.startsWith("category:") ? `?category=${encodeURIComponent(view.value.slice(9))}` : "";
}

function showCategories(counts) {
  const group = document.querySelector("#categories");
  const want = Object.keys(counts || {});
  if (want.join() === [...group.children].map((o) => o.value.slice(9)).join()) return;
  group.replaceChildren(...want.map((name) => Object.assign(document.createElement("option"), {
    value: `category:${name}`, textContent: `${name.replace("_", " ")} (${counts[name]})`,
  })));
}

function showCoefficients(board) {
  const p = document.querySelector("#coefficients");
  p.hidden = !board.style_control;
  if (!board.style_coefficients) { p.textContent = "No votes with style counts yet."; return; }
  const parts = Object.entries(board.style_coefficients).map(([k, v]) => `${k} ${v >= 0 ? "+" : ""}${v.toFixed(3)}`);
  p.textContent = `Style taken out (logit per standard deviation): ${parts.join(", ")}.`;
}

async function refresh() {
  if (asking) return; // the key form is up (key.js); the call waiting on it refreshes
  const r = await api(`/arena/leaderboard${query()}`);
  const board = await r.json();
  if (!board.style_control && !board.category) showCategories(board.categories);
  else if (!document.querySelector("#categories").children.length) {
    showCategories((await (await api("/arena/leaderboard")).json()).categories);
  }
  showCoefficients(board);
  const rows = document.querySelector("#rows");
  rows.replaceChildren();
  const lo = Math.min(...board.rows.map((x) => x.ci_low));
  const hi = Math.max(...board.rows.map((x) => x.ci_high));
  for (const row of board.rows) {
    const tr = document.createElement("tr");
    tr.dataset.model = row.model;
    const name = cell(row.model);
    if (row.provisional) {
      const badge = Object.assign(document.createElement("span"), { className: "provisional", textContent: "provisional" });
      badge.title = `fewer than ${board.min_votes} votes: ranked by the low end of its interval`;
      name.append(" ", badge);
    }
    tr.append(
      cell(row.rank), name, cell(row.rating.toFixed(1), "num"),
      bar(row, lo, hi), cell(row.votes, "num"), cell(row.elo == null ? "" : row.elo.toFixed(1), "hide-narrow"),
    );
    rows.append(tr);
  }
  const which = board.category ? ` in ${board.category.replace("_", " ")}` : board.style_control ? " with style counts" : "";
  document.querySelector("#summary").textContent = board.rows.length
    ? `${board.total_votes} ${board.total_votes === 1 ? "vote" : "votes"}${which} (stream sequence ${board.seq}). ` +
      `Provisional: fewer than ${board.min_votes} ` +
      "votes, ranked by the low end of its interval."
    : `No votes${which} yet: play a battle.`;
  await refreshHistory();
}
function badge(text, cls, title) {
  const span = Object.assign(document.createElement("span"), { className: cls, textContent: text });
  span.title = title;
  return span;
}

// The history: every model that entered, withdrawn or not served, and the variants per owner.
async function refreshHistory() {
  const history = await (await api("/arena/history")).json();
  const owner = (o) => o || "unknown";
  document.querySelector("#owners").textContent = history.owners.length
    ? "Variants per owner: " + history.owners.map((o) =>
      `${owner(o.owner)} ${o.variants}${o.withdrawn ? ` (${o.withdrawn} withdrawn)` : ""}`).join(" · ") + "."
    : "No model has battled yet.";
  document.querySelector("#history-rows").replaceChildren(...history.models.map((m) => {
    const tr = document.createElement("tr");
    tr.dataset.model = m.model;
    tr.className = m.status;
    const status = cell(m.status === "withdrawn" ? "" : m.served ? "active" : "");
    if (m.status === "withdrawn") {
      status.append(badge("withdrawn", "withdrawn-mark", `withdrawn at stream sequence ${m.changed_seq}: ${m.reason}`));
    } else if (!m.served) {
      status.append(badge("not served", "inactive-mark", "no inference process serves it now"));
    }
    const entered = new Date(m.entered_at * 1000).toISOString().slice(0, 10);
    tr.append(
      cell(m.model), cell(owner(m.owner)), status, cell(m.votes, "num"), cell(m.battles, "num hide-narrow"),
      cell(`${entered} (seq ${m.entered_seq})`, "hide-narrow"),
    );
    return tr;
  }));
}

// The CSV through api() too: a plain link would carry no key.
document.querySelector("#csv").addEventListener("click", async (event) => {
  event.preventDefault();
  const r = await api(`/arena/leaderboard${query() ? `${query()}&` : "?"}format=csv`);
  const link = Object.assign(document.createElement("a"), { download: "leaderboard.csv" });
  link.href = URL.createObjectURL(await r.blob());
  link.click();
  URL.revokeObjectURL(link.href);
});
view.addEventListener("change", refresh);
refresh();
setInterval(refresh, 3000);
