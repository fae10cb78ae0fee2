"""Draws the chart's Grafana dashboard (charts/ratelimitd/dashboards/ratelimitd.json) from a
Prometheus that scraped a running ratelimitd: every panel's queries, as Grafana would send them
(variables matching everything, $__rate_interval given), over the given time range, laid out on
the dashboard's own grid. Used by scripts/dashboard-picture.sh; needs matplotlib.

Usage: dashboard_picture.py PROMETHEUS_URL START END OUT.png
"""

import json
import re
import sys
import urllib.parse
import urllib.request

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DASHBOARD = "charts/ratelimitd/dashboards/ratelimitd.json"
RATE_INTERVAL = "10s"
STEP = 2


def query_range(prom, expr, start, end):
    params = urllib.parse.urlencode(
        {"query": expr, "start": start, "end": end, "step": STEP}
    )
    with urllib.request.urlopen(f"{prom}/api/v1/query_range?{params}") as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise SystemExit(f"{expr}: {body}")
    return body["data"]["result"]


def grafana_expr(expr):
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    return re.sub(r'=~"\$[a-z]+"', '=~".*"', expr)


def legend(fmt, metric):
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt)
    return text.strip() or "value"


def main():
    prom, start, end, out = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    panels = dashboard["panels"]
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit = 0.42
    fig = plt.figure(figsize=(24 * 0.8, bottom * unit))
    fig.suptitle(dashboard["description"], fontsize=13, x=0.01, ha="left")
    grid = fig.add_gridspec(bottom, 24, hspace=1.8, wspace=2.5, top=0.97, bottom=0.01, left=0.02, right=0.99)
    for panel in panels:
        g = panel["gridPos"]
        if panel["type"] == "row":
            ax = fig.add_subplot(grid[g["y"], :])
            ax.axis("off")
            ax.text(0, 0.2, panel["title"], fontsize=12, fontweight="bold")
            continue
        ax = fig.add_subplot(grid[g["y"] + 1 : g["y"] + g["h"], g["x"] : g["x"] + g["w"]])
        ax.set_title(panel["title"], fontsize=10, loc="left")
        drawn = 0
        for target in panel["targets"]:
            for series in query_range(prom, grafana_expr(target["expr"]), start, end):
                points = [(float(t) - start, float(v)) for t, v in series["values"]]
                if not points:
                    continue
                xs, ys = zip(*points)
                ax.plot(xs, ys, linewidth=1.2, label=legend(target.get("legendFormat", ""), series["metric"]))
                drawn += 1
        if drawn:
            ax.legend(fontsize=7, loc="upper left", ncol=2, framealpha=0.6)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.tick_params(labelsize=7)
        ax.set_xlim(0, end - start)
        ax.set_ylim(bottom=0)
        unit_name = panel["fieldConfig"]["defaults"].get("unit", "")
        if unit_name not in ("short", ""):
            ax.set_ylabel(unit_name, fontsize=7)
        ax.grid(alpha=0.3)
    fig.savefig(out, dpi=72)


if __name__ == "__main__":
    main()
