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

async function refresh() {
  if (asking) return; // the key form is up (key.js); the call waiting on it refreshes
  const r = await api("/arena/leaderboard");
  const board = await r.json();
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
  document.querySelector("#summary").textContent = board.rows.length
    ? `${board.total_votes} votes (stream sequence ${board.seq}). Provisional: fewer than ${board.min_votes} votes, ` +
      "ranked by the low end of its interval."
    : "No votes yet: play a battle.";
}
// The CSV through api() too: a plain link would carry no key.
document.querySelector("#csv").addEventListener("click", async (event) => {
  event.preventDefault();
  const r = await api("/arena/leaderboard?format=csv");
  const link = Object.assign(document.createElement("a"), { download: "leaderboard.csv" });
  link.href = URL.createObjectURL(await r.blob());
  link.click();
  URL.revokeObjectURL(link.href);
});
refresh();
setInterval(refresh, 3000);
