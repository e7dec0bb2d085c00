// pagoda's live dashboard: polls dashboard/data every second and draws the last
// MAX_POINTS snapshots with uPlot. Counters arrive as totals and are drawn as per-second
// rates between two polls. window.pagodaDashboard exposes the charts (for tests).
"use strict";

(function () {
  const POLL_MS = 1000;
  const MAX_POINTS = 300;
  const CLASSES = ["interactive", "async", "batch"];
  const ERROR_TYPES = ["invalid_request_error", "authentication_error", "rate_limit",
                       "timeout", "engine_error", "client_disconnect", "api_error"];
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                  "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];

  const latencySeries = (key) => CLASSES.flatMap((c) => [
    { label: c + " p50", value: (d) => d.latency[key][c] && d.latency[key][c].p50 },
    { label: c + " p99", value: (d) => d.latency[key][c] && d.latency[key][c].p99, dash: [6, 4] },
  ]);
  const rate = (get) => ({ rate: true, get });

  // Each chart: id, title, series [{label, value(snapshot) | rate(get)}], and the least
  // top of its y axis (an all-zero chart would otherwise span 0..100).
  const CHARTS = [
    { id: "tokens", title: "Throughput (tokens/s)", series: [
      { label: "prompt", value: (d) => d.gauges.avg_prompt_throughput_toks_per_s },
      { label: "generation", value: (d) => d.gauges.avg_generation_throughput_toks_per_s }] },
    { id: "requests", title: "Finished requests/s", series: [
      { label: "requests", value: (d) => d.gauges.avg_request_throughput_per_s }] },
    { id: "ttft", title: "TTFT p50 / p99 by SLA class (s)", series: latencySeries("ttft"),
      floor: 0.01 },
    { id: "itl", title: "ITL p50 / p99 by SLA class (s)", series: latencySeries("itl"),
      floor: 0.01 },
    { id: "kv", title: "KV cache usage (0..1)", series: [
      { label: "device KV", value: (d) => d.gauges.kv_cache_usage_perc },
      { label: "host tier", value: (d) => d.gauges.host_tier_usage_perc },
      { label: "swap pool", value: (d) => d.gauges.swap_pool_usage_perc }] },
    { id: "queue", title: "Queue depth by SLA class (waiting sequences)", series: [
      ...CLASSES.map((c) => ({ label: c, value: (d) => d.queue[c] })),
      { label: "running (all)", value: (d) => d.gauges.num_requests_running }] },
    { id: "preemptions", title: "Preemptions/s by SLA class",
      series: CLASSES.map((c) => ({ label: c, ...rate((d) => d.preemptions_total[c]) })) },
    { id: "errors", title: "Errors and timeouts /s", series: [
      ...ERROR_TYPES.map((t) => ({ label: t, ...rate((d) => d.errors_total[t]) })),
      { label: "timeout: queue", ...rate((d) => d.timeouts_total.queue) },
      { label: "timeout: running", ...rate((d) => d.timeouts_total.running) }] },
    { id: "prefix", title: "Prefix-cache hit rate (window)", series: [
      { label: "hit rate", value: (d) => d.prefix_cache_hit_rate }] },
    { id: "device", title: "Engine busy fraction, process CPU (cores)", series: [
      { label: "engine busy", value: (d) => d.gauges.engine_busy_fraction },
      { label: "process CPU", value: (d) => d.gauges.process_cpu_usage },
      { label: "GPU utilisation", value: (d) => d.gauges.gpu_utilization_perc }] },
  ];

  const state = { charts: {}, data: {}, polls: 0, failures: 0, last: null };
  window.pagodaDashboard = state;

  function finite(v) {
    return typeof v === "number" && isFinite(v) ? v : null;
  }

  function chartWidth(el) {
    return Math.max(300, el.clientWidth - 12);
  }

  function build() {
    const root = document.getElementById("charts");
    for (const spec of CHARTS) {
      const el = document.createElement("div");
      el.className = "chart";
      el.id = "chart-" + spec.id;
      root.appendChild(el);
      const series = [{}].concat(spec.series.map((s, i) => ({
        label: s.label, stroke: COLORS[i % COLORS.length], width: 1.5, dash: s.dash,
        spanGaps: true, points: { show: false },
      })));
      const data = [[]].concat(spec.series.map(() => []));
      state.data[spec.id] = data;
      const floor = spec.floor || 1;
      state.charts[spec.id] = new uPlot(
        { title: spec.title, width: chartWidth(el), height: 220, series,
          scales: { x: { time: true },
                    y: { range: (u, min, max) => [0, Math.max(floor, (max || 0) * 1.1)] } },
          legend: { live: false } },
        data, el);
    }
    window.addEventListener("resize", () => {
      for (const spec of CHARTS) {
        const el = document.getElementById("chart-" + spec.id);
        state.charts[spec.id].setSize({ width: chartWidth(el), height: 220 });
      }
    });
  }

  function pointValue(s, snap, prev) {
    if (!s.rate) {
      return finite(s.value(snap));
    }
    if (prev === null) {
      return null;
    }
    const now = finite(s.get(snap));
    const before = finite(s.get(prev));
    const dt = snap.time - prev.time;
    return now === null || before === null || dt <= 0 ? null : Math.max(0, (now - before) / dt);
  }

  function addPoint(snap) {
    const prev = state.last;
    for (const spec of CHARTS) {
      const data = state.data[spec.id];
      data[0].push(snap.time);
      spec.series.forEach((s, i) => data[i + 1].push(pointValue(s, snap, prev)));
      if (data[0].length > MAX_POINTS) {
        data.forEach((column) => column.shift());
      }
      state.charts[spec.id].setData(data);
    }
    state.last = snap;
  }

  function tiles(snap) {
    const g = snap.gauges;
    const mib = (b) => (b === null ? "n/a" : (b / (1 << 20)).toFixed(0) + " MiB");
    const pct = (v) => (v === null ? "n/a" : (100 * v).toFixed(1) + " %");
    const items = [
      ["generation tok/s", finite(g.avg_generation_throughput_toks_per_s)?.toFixed(1) ?? "n/a"],
      ["running / waiting", `${g.num_requests_running ?? 0} / ${g.num_requests_waiting ?? 0}`],
      ["tokens running / waiting", `${g.num_tokens_running ?? 0} / ${g.num_tokens_waiting ?? 0}`],
      ["KV usage", pct(finite(g.kv_cache_usage_perc))],
      ["resident memory", mib(finite(g.process_resident_memory_bytes))],
    ];
    if (finite(g.gpu_memory_total_bytes) !== null) {
      items.push(["GPU memory", `${mib(g.gpu_memory_used_bytes)} / ${mib(g.gpu_memory_total_bytes)}`]);
    }
    const root = document.getElementById("tiles");
    root.replaceChildren(...items.map(([name, value]) => {
      const el = document.createElement("div");
      el.className = "tile";
      const b = document.createElement("b");
      b.textContent = value;
      const span = document.createElement("span");
      span.textContent = name;
      el.append(b, span);
      return el;
    }));
  }

  async function poll() {
    const status = document.getElementById("status");
    try {
      const response = await fetch("dashboard/data", { cache: "no-store" });
      if (!response.ok) {
        throw new Error("HTTP " + response.status);
      }
      const snap = await response.json();
      addPoint(snap);
      tiles(snap);
      state.polls += 1;
      status.textContent = `updated ${new Date(snap.time * 1000).toLocaleTimeString()}` +
        ` (every ${POLL_MS / 1000} s; percentiles and hit rate over ${snap.window_s} s)`;
    } catch (e) {
      state.failures += 1;
      status.textContent = "cannot reach the server: " + e.message;
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  build();
  poll();
})();
