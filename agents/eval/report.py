"""Comparison reports: a PNG plot, a Markdown summary and a self-contained HTML page.

The HTML page embeds its plots as data URIs and its style inline: it opens from disk with no
server and no external assets.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

CHECK_COLORS = ["#7a8b99", "#2f7ed8", "#f28f43", "#0d9b6c", "#8e44ad"]


def plot_comparison(result: dict[str, Any], path: Path) -> Path:
    """Success and per-check pass rates side by side, and the critique-code histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = result["labels"]
    arms = [result["arms"][label] for label in labels]
    checks = sorted({c for arm in arms for c in arm["check_pass_rates"]})
    codes = sorted({c for arm in arms for c in arm["critique_codes"]}, key=lambda c: -sum(a["critique_codes"].get(c, 0) for a in arms))[:10]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1.1, 1]})
    metrics = ["success"] + checks
    x = np.arange(len(metrics))
    width = 0.8 / len(arms)
    for i, (label, arm) in enumerate(zip(labels, arms)):
        values = [arm["success_rate"]] + [arm["check_pass_rates"].get(c, 0.0) for c in checks]
        bars = left.bar(x + i * width, values, width, label=label, color=CHECK_COLORS[i % len(CHECK_COLORS)])
        left.bar_label(bars, fmt="%.2f", fontsize=7)
    left.set_xticks(x + width * (len(arms) - 1) / 2, metrics, rotation=20)
    left.set_ylim(0, 1.1)
    left.set_title("success and check pass rates")
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=min(len(arms), 3), frameon=False)
    y = np.arange(len(codes))
    height = 0.8 / len(arms)
    for i, (label, arm) in enumerate(zip(labels, arms)):
        right.barh(y + i * height, [arm["critique_codes"].get(c, 0) for c in codes], height, label=label, color=CHECK_COLORS[i % len(CHECK_COLORS)])
    right.set_yticks(y + height * (len(arms) - 1) / 2, codes or ["(no critiques)"] if not codes else codes)
    right.invert_yaxis()
    right.set_title("critique codes (count)")
    fig.suptitle(f"{result['env']} {result['env_kwargs']}, {result['episodes']} episodes")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown_report(result: dict[str, Any], *, extra: str = "") -> str:
    """A short Markdown summary table of every arm."""
    lines = [f"# {result['env']} {json.dumps(result['env_kwargs'])}", "", f"{result['episodes']} test episodes, seed {result['seed']}.", ""]
    first = result["labels"][0]
    lines += [f"| policy | success | vs {first} (paired, 95% interval) | mean reward | top critique codes |", "|---|---|---|---|---|"]
    for label in result["labels"]:
        arm = result["arms"][label]
        codes = ", ".join(f"{c} ({n})" for c, n in list(arm["critique_codes"].items())[:3]) or "none"
        lines.append(f"| {label} | {arm['success_rate']:.1%} | {_paired_cell(result, label)} | {arm['mean_reward']:+.2f} | {codes} |")
    lines += ["", f"{_differing(result)} where the first and last policy disagree (see report.html)."]
    return "\n".join(lines + ([""] + [extra] if extra else [])) + "\n"


def html_report(result: dict[str, Any], images: list[Path], *, title: str = "critique-gym report", extra_html: str = "") -> str:
    """The self-contained page: summary table, plots, `extra_html`, browsable disagreements."""
    labels = result["labels"]
    first, last = labels[0], labels[-1]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title><style>{_CSS}</style></head><body>"]
    parts.append(f"<h1>{_e(title)}</h1><p>{_e(result['env'])} {_e(json.dumps(result['env_kwargs']))}, {result['episodes']} test episodes, seed {result['seed']}.</p>")
    parts.append(_summary_table(result))
    for image in images:
        data = base64.b64encode(Path(image).read_bytes()).decode()
        parts.append(f"<figure><img class='plot' alt='{_e(Path(image).stem)}' src='data:image/png;base64,{data}'><figcaption>{_e(Path(image).stem)}</figcaption></figure>")
    parts.append(extra_html)
    parts.append(f"<h2>Episodes where {_e(first)} and {_e(last)} disagree: {_e(_differing(result))}</h2>")
    for i, row in enumerate(result["disagreements"]):
        parts.append(_disagreement(row, first, last, open_=i == 0))
    parts.append(f"<script>{_JS}</script></body></html>")
    return "".join(parts)


def _differing(result: dict[str, Any]) -> str:
    """'65 episodes (the first 40 shown)': the count is of all of them, whatever the report lists."""
    total, shown = result.get("differing", len(result["disagreements"])), len(result["disagreements"])
    return f"{total} episodes" + (f" (the first {shown} shown)" if shown < total else "")


def _paired_cell(result: dict[str, Any], label: str) -> str:
    paired = result.get("paired", {}).get(label)
    if paired is None:
        return "-"
    mean, low, high = (100 * paired[k] for k in ("mean", "low", "high"))
    return f"{mean:+.1f} [{low:+.1f}, {high:+.1f}] points"


def _summary_table(result: dict[str, Any]) -> str:
    checks = sorted({c for arm in result["arms"].values() for c in arm["check_pass_rates"]})
    head = "".join(f"<th>{_e(c)}</th>" for c in checks)
    rows = []
    for label in result["labels"]:
        arm = result["arms"][label]
        cells = "".join(f"<td>{arm['check_pass_rates'].get(c, 0):.2f}</td>" for c in checks)
        rows.append(f"<tr><td>{_e(label)}</td><td><b>{arm['success_rate']:.1%}</b></td><td>{_e(_paired_cell(result, label))}</td><td>{arm['mean_reward']:+.2f}</td>{cells}<td>{arm['mean_turns']:.1f}</td></tr>")
    vs = f"vs {_e(result['labels'][0])} (paired, 95% interval)"
    return f"<table id='summary'><thead><tr><th>policy</th><th>success</th><th>{vs}</th><th>mean reward</th>{head}<th>turns</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _disagreement(row: dict[str, Any], first: str, last: str, *, open_: bool) -> str:
    a, b = row[first], row[last]
    summary = f"seed {row['seed']}: {first} {'succeeded' if a['success'] else 'failed'}, {last} {'succeeded' if b['success'] else 'failed'}"
    columns = "".join(f"<div class='col'><h3>{_e(label)} ({view['reward']:+.2f})</h3>{_transcript(view)}</div>" for label, view in ((first, a), (last, b)))
    return f"<details class='episode'{' open' if open_ else ''}><summary>{_e(summary)}</summary><div class='cols'>{columns}</div></details>"


def _transcript(view: dict[str, Any]) -> str:
    by_step: dict[int, list[dict[str, Any]]] = {}
    for critique in view["critiques"]:
        by_step.setdefault(critique["step"], []).append(critique)
    out, turn = [], 0
    for message in view["messages"][1:]:
        role = message["role"]
        if role == "assistant":
            turn += 1
        failing = role == "assistant" and turn == view["first_failing_step"]
        label = f"tool {message.get('name', '')}" if role == "tool" else role
        cls = f"msg {role}" + (" failing" if failing else "")
        marker = "<span class='badge'>first failing step</span>" if failing else ""
        out.append(f"<div class='{cls}'><div class='role'>{_e(label)}{' · step ' + str(turn) if role == 'assistant' else ''}{marker}</div><pre>{_e(message['content'])}</pre>")
        if role == "assistant":
            for critique in by_step.get(turn, []):
                out.append(f"<div class='critique'><b>{_e(critique['code'])}</b>: {_e(critique['message'])}</div>")
        out.append("</div>")
    return "".join(out)


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px;color:#1d2330;max-width:1400px}
table{border-collapse:collapse;margin:12px 0}th,td{border:1px solid #d0d5dd;padding:6px 10px;text-align:right}
th:first-child,td:first-child{text-align:left}thead{background:#f2f4f7}
figure{margin:16px 0}img.plot{max-width:100%;border:1px solid #e4e7ec}
details.episode{border:1px solid #d0d5dd;border-radius:6px;margin:10px 0;padding:6px 10px}
summary{cursor:pointer;font-weight:600}.cols{display:flex;gap:16px}.col{flex:1;min-width:0}
.msg{border-left:4px solid #d0d5dd;margin:6px 0;padding:4px 8px;background:#fafbfc}
.msg.user{border-color:#2f7ed8}.msg.assistant{border-color:#0d9b6c}.msg.tool{border-color:#f2b705}
.msg.failing{border-color:#d92d20;background:#fde8e7;outline:2px solid #d92d20}
.role{font-size:12px;color:#667085;text-transform:uppercase}.badge{background:#d92d20;color:#fff;border-radius:4px;padding:0 6px;margin-left:8px}
pre{white-space:pre-wrap;word-break:break-word;margin:4px 0;font-size:12px}
.critique{color:#b42318;font-size:13px;margin:4px 0}
"""

# Marks, for headless checks, whether the plots decoded and a failing step is on screen.
_JS = """
(function(){var imgs=[].slice.call(document.querySelectorAll('img.plot'));
var ok=imgs.length>0&&imgs.every(function(i){return i.complete&&i.naturalWidth>0;});
var f=document.querySelector('.msg.failing');var r=f?f.getBoundingClientRect():null;
document.body.setAttribute('data-plots-ok',ok?'yes':'no');
document.body.setAttribute('data-failing-visible',r&&r.height>0&&r.width>0?'yes':'no');
var t=document.getElementById('summary');document.body.setAttribute('data-summary-rows',t?t.tBodies[0].rows.length:0);})();
"""


def write_reports(
    result: dict[str, Any], out: Path, *, title: str, extra_images: list[Path] | None = None, extra_md: str = "", extra_html: str = ""
) -> dict[str, Path]:
    """compare.json, compare.png, report.md and report.html under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result, indent=2, default=str))
    plot = plot_comparison(result, out / "compare.png")
    images = [plot, *(extra_images or [])]
    (out / "report.md").write_text(markdown_report(result, extra=extra_md))
    (out / "report.html").write_text(html_report(result, images, title=title, extra_html=extra_html))
    return {"json": out / "compare.json", "png": plot, "md": out / "report.md", "html": out / "report.html"}
