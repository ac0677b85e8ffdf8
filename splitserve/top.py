"""``splitserve top``: the web page's cluster view in a terminal (rich), for machines without a
browser. Polls ``GET /cluster`` (``server.cluster_view``) every ``--interval`` seconds and
redraws: one row per worker (role, health, pages, requests, transfers, cache hit rate,
tokens/s, KV MB/s) and the cluster's latest interval (requests/s, tokens/s, TTFT and
inter-token latency, mean and p90) with sparklines over the kept history.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float | None], width: int = 40) -> str:
    """The last ``width`` values as block characters scaled to their maximum (gaps: spaces)."""
    values = values[-width:]
    top = max((v for v in values if v is not None), default=0.0) or 1.0
    return "".join(" " if v is None else SPARKS[min(7, int(v / top * 7.999))] for v in values)


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.0f} ms"


def render(data: dict[str, Any]) -> Group:
    """The screen for one ``GET /cluster`` document."""
    table = Table(title=f"splitserve · {data['model']} · {len(data['workers'])} workers",
                  expand=True)
    for name in ("worker", "role", "state", "pages", "run/wait", "in flight", "xfer",
                 "cache hit", "tok/s", "KV MB/s"):
        table.add_column(name, justify="left" if name in ("worker", "role", "state") else "right")
    for w in data["workers"]:
        state = "down" if not w["healthy"] else "draining" if w["draining"] else "healthy"
        color = {"down": "red", "draining": "yellow", "healthy": "green"}[state]
        hit = w["cache_hit_rate"]
        table.add_row(w["worker_id"], w["role"], Text(state, style=color),
                      f"{w['pages_used']}/{w['pages_total']}",
                      f"{w['num_running']}/{w['num_waiting']}", str(w["in_flight"]),
                      str(w["num_transferring"]), "–" if hit is None else f"{hit:.0%}",
                      f"{w['tokens_per_s']:.1f}", f"{w['kv_mb_per_s']:.2f}")
    hist = data["history"]
    last = hist[-1] if hist else {}
    lines = Table.grid(padding=(0, 2))
    for label, key, fmt in (("requests/s", "requests_per_s", "{:.2f}"),
                            ("tokens/s", "tokens_per_s", "{:.1f}"),
                            ("TTFT p90", "ttft_p90_s", None), ("TTFT mean", "ttft_mean_s", None),
                            ("ITL p90", "itl_p90_s", None), ("ITL mean", "itl_mean_s", None)):
        value = last.get(key)
        shown = _ms(value) if fmt is None else ("–" if value is None else fmt.format(value))
        lines.add_row(label, shown, sparkline([p.get(key) for p in hist]))
    return Group(table, Text(f"last {len(hist) * data['interval_s']:.0f} s, "
                             f"every {data['interval_s']:g} s", style="dim"), lines)


def run_top(url: str, api_key: str | None, interval_s: float = 2.0,
            once: bool = False) -> None:
    """Show the cluster at ``url`` until Ctrl-C (``once``: print one screen and return).

    Raises:
        httpx.HTTPError: the server did not answer (``once``); otherwise the error is shown
            and polling goes on.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def fetch() -> Any:
        r = httpx.get(url.rstrip("/") + "/cluster", headers=headers, timeout=5)
        r.raise_for_status()
        return render(r.json())

    if once:
        import sys

        from rich.console import Console

        # Piped (no terminal to measure): wide enough for every column.
        Console(width=None if sys.stdout.isatty() else 132).print(fetch())
        return
    with Live(Text("connecting..."), refresh_per_second=4, screen=False) as live:
        while True:
            try:
                live.update(fetch())
            except httpx.HTTPError as exc:
                live.update(Text(f"{url}: {exc}", style="red"))
            time.sleep(interval_s)
