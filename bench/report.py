"""Write a comparison's results as JSON, a markdown table and a latency plot.

`results` is `{"meta": {...}, "targets": [...], "overhead": {...}}`; each target is
`{"name", "status": "ok" | "not runnable" | "failed", "reason"?, "levels": [...]}` and
each level carries `load_label`, `load` and a `summary` from `bench.stats.summarize`.
"""

from __future__ import annotations

import json
from pathlib import Path

REFERENCES = ("naive", "ceiling", "transformers-serve")


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.0f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"


def level_rows(results: dict) -> list[str]:
    head = (
        "| target | load | req/s | tok/s | latency P50 / P95 / P99 (ms) | TTFT P50 / P95 / P99 (ms) | errors | 429s |"
    )
    lines = [head, "|" + "---|" * 8]
    for target in results["targets"]:
        if target["status"] != "ok":
            reason = target.get("reason", "").replace("|", "/").replace("\n", " ")[:160]
            lines.append(f"| {target['name']} | {target['status']}: {reason} | | | | | | |")
            continue
        for level in target["levels"]:
            s = level["summary"]
            lat = " / ".join(_ms(s[f"latency_p{q}"]) for q in (50, 95, 99))
            ttft = " / ".join(_ms(s[f"ttft_p{q}"]) for q in (50, 95, 99))
            lines.append(
                f"| {target['name']} | {level['load_label']} | {s['requests_per_s']:.2f} "
                f"| {s['tokens_per_s']:.0f} | {lat} | {ttft} | {_pct(s['error_rate'])} "
                f"| {_pct(s['rejection_rate'])} |"
            )
    return lines


def peak(target: dict) -> dict | None:
    """The level with the highest token throughput, or None for a target that did not run."""
    if target["status"] != "ok" or not target["levels"]:
        return None
    return max(target["levels"], key=lambda lv: lv["summary"]["tokens_per_s"])


def ratios(results: dict) -> dict[str, dict[str, float | None]]:
    """Peak tokens/s of each target over each reference's peak tokens/s."""
    peaks = {t["name"]: peak(t) for t in results["targets"]}
    out: dict[str, dict[str, float | None]] = {}
    for name, level in peaks.items():
        out[name] = {}
        for ref in REFERENCES:
            ref_level = peaks.get(ref)
            if level is None or ref_level is None or not ref_level["summary"]["tokens_per_s"]:
                out[name][ref] = None
            else:
                out[name][ref] = level["summary"]["tokens_per_s"] / ref_level["summary"]["tokens_per_s"]
    return out


def ratio_rows(results: dict) -> list[str]:
    table = ratios(results)
    lines = [
        "| target | peak tok/s (at) | " + " | ".join(f"× {r}" for r in REFERENCES) + " |",
        "|" + "---|" * (2 + len(REFERENCES)),
    ]
    for target in results["targets"]:
        level = peak(target)
        if level is None:
            continue
        cells = " | ".join(
            "–" if table[target["name"]][r] is None else f"{table[target['name']][r]:.2f}" for r in REFERENCES
        )
        lines.append(f"| {target['name']} | {level['summary']['tokens_per_s']:.0f} ({level['load_label']}) | {cells} |")
    return lines


def served_over_engine(results: dict) -> dict[str, dict[str, float]]:
    """Each served target's tokens/s over the engine alone's at the same load (closed loop)."""
    engine = next((t for t in results["targets"] if t["name"] == "engine" and t["status"] == "ok"), None)
    if engine is None:
        return {}
    alone = {lv["load"]: lv["summary"]["tokens_per_s"] for lv in engine["levels"]}
    out: dict[str, dict[str, float]] = {}
    for target in results["targets"]:
        if target["name"] in ("engine", "ceiling") or target["status"] != "ok":
            continue
        out[target["name"]] = {
            lv["load_label"]: lv["summary"]["tokens_per_s"] / alone[lv["load"]]
            for lv in target["levels"]
            if alone.get(lv["load"])
        }
    return out


def engine_rows(results: dict) -> list[str]:
    table = served_over_engine(results)
    labels = sorted({label for row in table.values() for label in row}, key=lambda x: float(x.split()[0]))
    if not labels:
        return []
    lines = ["| target | " + " | ".join(labels) + " |", "|" + "---|" * (1 + len(labels))]
    for name, row in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[x]:.2f}" if x in row else "–" for x in labels) + " |")
    return lines


def _s(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g} s"


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def peer_cell(summary: dict) -> str:
    """One target at one load: tok/s, latency P50 and P99, TTFT P50, and what failed."""
    cell = (
        f"{summary['tokens_per_s']:.1f} tok/s, P50 {_s(summary['latency_p50'])}, "
        f"P99 {_s(summary['latency_p99'])}, TTFT {_s(summary['ttft_p50'])}"
    )
    if summary.get("error_rate"):
        cell += f", {summary['errors']} errors, {summary['rejected']} 429s of {summary['requests']}"
    return cell


def memory_cell(target: dict) -> str:
    memory = target.get("memory")
    if not memory:
        return "–"
    return f"PSS {_gb(memory['pss_peak_bytes'])} over {memory['processes']} processes"


def peer_tables(results: dict) -> list[str]:
    """Issue 31's table, one per answer length swept: users down, targets across, a memory row."""
    served = [t for t in results["targets"] if any("max_tokens" in lv for lv in t.get("levels", []))]
    lines: list[str] = []
    for tokens in sorted({lv["max_tokens"] for t in served for lv in t["levels"]}):
        by_target = {
            t["name"]: {lv["load"]: lv["summary"] for lv in t["levels"] if lv.get("max_tokens") == tokens}
            for t in served
        }
        loads = sorted({load for row in by_target.values() for load in row})
        lines += [f"{tokens}-token answers, closed loop:", ""]
        lines += ["| users | " + " | ".join(by_target) + " |", "|---" * (1 + len(by_target)) + "|"]
        for load in loads:
            cells = [peer_cell(row[load]) if load in row else "–" for row in by_target.values()]
            lines.append(f"| {load:g} | " + " | ".join(cells) + " |")
        lines += ["| memory | " + " | ".join(memory_cell(t) for t in served) + " |", ""]
    return lines


def memory_rows(results: dict) -> list[str]:
    """Each server's peak PSS while it served, and its processes' shares at that peak."""
    lines = ["| target | PSS peak | processes at the peak (PSS) |", "|---|---|---|"]
    for target in results["targets"]:
        memory = target.get("memory")
        if memory:
            shares = ", ".join(f"{p['name']} {p['pss_bytes'] / 1e6:.0f} MB" for p in memory["pss_by_process"])
            lines.append(f"| {target['name']} | {_gb(memory['pss_peak_bytes'])} | {shares} |")
    return lines if len(lines) > 2 else []


def overhead_rows(overhead: dict) -> list[str]:
    lines = [
        "| target | requests | end-to-end P50 / P99 (ms) | compute P50 / P99 (ms) "
        "| overhead P50 / P99 (ms) | overhead vs server-reported compute P50 / P99 (ms) "
        "| to the first token, streamed: overhead vs the engine's own P50 / P99 (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in overhead.items():
        if row.get("status") != "ok":
            lines.append(f"| {name} | {row.get('status')}: {row.get('reason', '')[:120]} | | | | | |")
            continue
        lines.append(
            f"| {name} | {row['requests']} | {_ms(row['latency_p50'])} / {_ms(row['latency_p99'])} "
            f"| {_ms(row['compute_p50'])} / {_ms(row['compute_p99'])} "
            f"| {_ms(row['overhead_p50'])} / {_ms(row['overhead_p99'])} "
            f"| {_ms(row.get('server_overhead_p50'))} / {_ms(row.get('server_overhead_p99'))} "
            f"| {_ms(row.get('first_token_overhead_p50'))} / {_ms(row.get('first_token_overhead_p99'))} |"
        )
    return lines


def markdown(results: dict) -> str:
    meta = results.get("meta", {})
    parts = ["# Benchmark results", ""]
    if meta:
        parts += [f"- {key}: {value}" for key, value in meta.items()] + [""]
    if peers := peer_tables(results):
        parts += ["## Side by side (tok/s, latency P50 / P99, TTFT P50)", "", *peers]
    parts += ["## Throughput and latency", "", *level_rows(results), ""]
    parts += ["## Ratios (peak tokens/s)", "", *ratio_rows(results), ""]
    if served := engine_rows(results):
        parts += ["## Served / engine alone (tokens/s at the same load)", "", *served, ""]
    if results.get("overhead"):
        parts += ["## Pipeline overhead at 1 user", "", *overhead_rows(results["overhead"]), ""]
    if memory := memory_rows(results):
        parts += ["## Memory (PSS of every process of the server, peak while it served)", "", *memory, ""]
    parts += ["## Conditions", "", *condition_rows(results), ""]
    return "\n".join(parts)


def condition_rows(results: dict) -> list[str]:
    """Start-up time, and the machine's load average when each target started: other
    work on a shared machine shows up here before it shows up as odd figures."""
    lines = [
        "| target | status | start-up (s) | load average 1/5/15 min at start "
        "| 1-min load average at each level's start |",
        "|---|---|---|---|---|",
    ]
    for target in results["targets"]:
        load = target.get("loadavg_at_start")
        load_text = " / ".join(f"{x:.1f}" for x in load) if load else "–"
        startup = target.get("startup_s")
        levels = " ".join(
            f"{lv['loadavg_at_start'][0]:.1f}" for lv in target.get("levels", []) if "loadavg_at_start" in lv
        )
        lines.append(
            f"| {target['name']} | {target['status']} | {'–' if startup is None else f'{startup:.1f}'} "
            f"| {load_text} | {levels or '–'} |"
        )
    return lines


def plot(results: dict, path: Path) -> None:
    """Latency P50/P95/P99 and tokens/s against offered load, one line per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    for target in results["targets"]:
        if target["status"] != "ok" or not target["levels"]:
            continue
        dashed = target["name"] in ("ceiling", "engine")
        for tokens in sorted({lv.get("max_tokens", 0) for lv in target["levels"]}):
            levels = [lv for lv in target["levels"] if lv.get("max_tokens", 0) == tokens]
            label = f"{target['name']}, {tokens} tok" if tokens else target["name"]
            style = {"marker": "o", "label": label, "linestyle": "--" if dashed else "-"}
            loads = [lv["load"] for lv in levels]
            for ax, q in zip(axes[:3], (50, 95, 99), strict=True):
                ax.plot(loads, [lv["summary"][f"latency_p{q}"] for lv in levels], **style)
            axes[3].plot(loads, [lv["summary"]["tokens_per_s"] for lv in levels], **style)
    for ax, title in zip(axes, ("latency P50", "latency P95", "latency P99", "throughput"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("offered load (users, or batch size for the ceiling)")
        ax.set_ylabel("tokens/s" if title == "throughput" else "seconds")
        ax.grid(alpha=0.3)
    axes[3].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(results: dict, out: Path, stem: str = "results") -> list[Path]:
    """Writes `{stem}.json`, `{stem}.md` and `{stem}.png` under `out`; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    results = {**results, "ratios": ratios(results), "served_over_engine": served_over_engine(results)}
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.png"]
    paths[0].write_text(json.dumps(results, indent=2) + "\n")
    paths[1].write_text(markdown(results) + "\n")
    plot(results, paths[2])
    return paths
