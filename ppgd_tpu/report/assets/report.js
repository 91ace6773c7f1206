// ppgd-tpu report: renders index.html (overview and one table per site) and
// component.html?site=I&c=C (one component) from window.REPORT (data/run.js) and
// window.REPORT_SITE (data/site_I.js, loaded by a script tag: pages opened from the file
// system may load scripts but not fetch JSON). No network, no libraries.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
                "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "onclick" || k === "oninput") node[k] = v; else node.setAttribute(k, v);
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function fmt(x) {
  if (x === null || x === undefined) return "–";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return String(x);
  const a = Math.abs(x);
  return (a !== 0 && (a < 1e-3 || a >= 1e5)) ? x.toExponential(3) : x.toPrecision(4);
}

function componentHref(site, c) {
  return `component.html?site=${site}&c=${c}`;
}

// ------------------------------------------------------------------ charts

function lineChart(title, series, logY) {
  const W = 420, H = 220, L = 56, R = 10, T = 22, B = 30;
  const pts = Object.values(series).flat().filter(p => p[1] !== null && (!logY || p[1] > 0));
  const box = svg("svg", {width: W, height: H, class: "chart", viewBox: `0 0 ${W} ${H}`});
  box.append(svg("text", {x: L, y: 14, class: "chart-title"}, title));
  if (!pts.length) return box;
  const ty = v => logY ? Math.log10(v) : v;
  let x0 = Math.min(...pts.map(p => p[0])), x1 = Math.max(...pts.map(p => p[0]));
  let y0 = Math.min(...pts.map(p => ty(p[1]))), y1 = Math.max(...pts.map(p => ty(p[1])));
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = y => T + (1 - (ty(y) - y0) / (y1 - y0)) * (H - T - B);
  const lab = v => fmt(logY ? Math.pow(10, v) : v);
  box.append(svg("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"}),
             svg("line", {x1: L, y1: T, x2: L, y2: H - B, class: "axis"}),
             svg("text", {x: L - 4, y: T + 4, class: "tick", "text-anchor": "end"}, lab(y1)),
             svg("text", {x: L - 4, y: H - B, class: "tick", "text-anchor": "end"}, lab(y0)),
             svg("text", {x: L, y: H - B + 14, class: "tick"}, fmt(x0)),
             svg("text", {x: W - R, y: H - B + 14, class: "tick", "text-anchor": "end"},
                 `${fmt(x1)} (step)`));
  Object.entries(series).forEach(([name, data], i) => {
    const ok = data.filter(p => p[1] !== null && (!logY || p[1] > 0));
    const color = COLORS[i % COLORS.length];
    box.append(svg("polyline", {points: ok.map(p => `${sx(p[0])},${sy(p[1])}`).join(" "),
                                fill: "none", stroke: color, "stroke-width": 1.5},
                   svg("title", {}, name)));
    if (ok.length === 1) box.append(svg("circle", {cx: sx(ok[0][0]), cy: sy(ok[0][1]), r: 3,
                                                  fill: color}));
  });
  const legend = Object.keys(series).map((name, i) =>
    svg("text", {x: W - R, y: T + 12 * i + 8, class: "legend", "text-anchor": "end",
                 fill: COLORS[i % COLORS.length]}, name));
  if (legend.length <= 10) box.append(...legend);
  return box;
}

function barChart(title, values, labels, lo, hi) {
  const W = 420, H = 160, L = 60, R = 10, T = 22, B = 26;
  const box = svg("svg", {width: W, height: H, class: "chart", viewBox: `0 0 ${W} ${H}`});
  box.append(svg("text", {x: L, y: 14, class: "chart-title"}, title));
  const top = hi !== undefined ? hi : Math.max(...values, 1e-12);
  const bottom = lo !== undefined ? lo : Math.min(0, ...values);
  const sy = v => T + (1 - (v - bottom) / ((top - bottom) || 1)) * (H - T - B);
  const w = (W - L - R) / values.length;
  values.forEach((v, i) => {
    const y = Math.min(sy(v), sy(0)), h = Math.abs(sy(v) - sy(0));
    box.append(svg("rect", {x: L + i * w + w * 0.1, y: y, width: Math.max(w * 0.8, 0.5),
                            height: Math.max(h, 0.5), class: v < 0 ? "bar neg" : "bar"},
                   svg("title", {}, `${labels ? labels[i] : i}: ${fmt(v)}`)));
  });
  box.append(svg("line", {x1: L, y1: sy(0), x2: W - R, y2: sy(0), class: "axis"}),
             svg("text", {x: L - 4, y: T + 4, class: "tick", "text-anchor": "end"}, fmt(top)),
             svg("text", {x: L - 4, y: H - B, class: "tick", "text-anchor": "end"},
                 fmt(bottom)));
  if (labels) {
    box.append(svg("text", {x: L, y: H - 6, class: "tick"}, labels[0]),
               svg("text", {x: W - R, y: H - 6, class: "tick", "text-anchor": "end"},
                   labels[labels.length - 1]));
  }
  return box;
}

// ------------------------------------------------------------------ index.html

function header(R) {
  const state = R.complete ? "finished" : "still training or stopped";
  return el("header", {},
    el("h1", {}, `${R.name}: what each component does`),
    el("p", {class: "meta"},
       `run ${R.run} · step ${R.step} of ${R.steps} (${state}) · target ${R.target} · ` +
       `${R.rows} rows (${R.row_source}), ${R.positions} positions · a component is on ` +
       `where its CI > ${R.threshold} · written ${R.generated}`));
}

function metricsSection(R) {
  const sec = el("section", {id: "overview"}, el("h2", {}, "Overview"));
  const m = R.metrics || {};
  if (!R.metrics_source) {
    sec.append(el("p", {}, `No evaluation of step ${R.step} in the run (eval.every); ` +
                           "`ppgd-tpu eval` writes one."));
  } else {
    sec.append(el("p", {class: "meta"}, `Evaluation of step ${R.step}, from ${R.metrics_source}.`));
  }
  const kinds = ["clean", "unmasked", "ci_masked", "stochastic", "rounded", "pgd", "zero"];
  if (R.kind === "lm" && R.metrics_source) {
    const rows = kinds.filter(k => (`eval/ce/${k}` in m))
      .map(k => el("tr", {}, el("td", {}, k), el("td", {}, fmt(m[`eval/ce/${k}`])),
                   el("td", {}, fmt(m[`eval/kl/${k}`]))));
    sec.append(el("table", {class: "ce"},
                  el("caption", {}, "Next-token CE and KL to the clean model, by mask"),
                  el("thead", {}, el("tr", {}, el("th", {}, "masks"), el("th", {}, "CE"),
                                     el("th", {}, "KL"))),
                  el("tbody", {}, rows)));
  }
  const keys = Object.keys(m).sort();
  if (keys.length) {
    sec.append(el("details", {}, el("summary", {}, `All ${keys.length} metrics`),
      el("table", {class: "metrics"}, el("tbody", {},
        keys.map(k => el("tr", {}, el("td", {}, k), el("td", {}, fmt(m[k]))))))));
  }
  sec.append(el("details", {}, el("summary", {}, "Config (config.yaml)"),
                el("pre", {}, R.config)));
  return sec;
}

// Curves grouped by key prefix (`train/loss/*` in one chart), log-scaled when positive.
function curvesSection(R) {
  const sec = el("section", {id: "curves"}, el("h2", {}, "Training curves (metrics.jsonl)"));
  const groups = {};
  for (const [key, data] of Object.entries(R.curves)) {
    if (key.startsWith("train/perf/") || key.startsWith("train/replay/")) continue;
    const cut = key.lastIndexOf("/");
    const group = cut > 0 ? key.slice(0, cut) : key;
    (groups[group] = groups[group] || {})[key.slice(cut + 1)] = data;
  }
  const names = Object.keys(groups).sort();
  if (!names.length) sec.append(el("p", {}, "Nothing logged yet."));
  const grid = el("div", {class: "charts"});
  for (const g of names) {
    const vals = Object.values(groups[g]).flat().map(p => p[1]).filter(v => v !== null);
    grid.append(lineChart(g, groups[g], vals.length > 0 && vals.every(v => v > 0)));
  }
  sec.append(grid);
  return sec;
}

function figuresSection(R) {
  if (!R.figures.length) return null;
  return el("section", {id: "figures"}, el("h2", {}, "The run's figures (final step)"),
            R.figures.map(f => el("img", {src: `figures/${f}`, alt: f, class: "figure"})));
}

const COLUMNS = [
  {key: "c", label: "component", num: true},
  {key: "density", label: "density", num: true,
   title: "fraction of positions with CI above the threshold"},
  {key: "mean_ci", label: "mean CI", num: true},
  {key: "norm", label: "|V U|", num: true, title: "norm of the rank-1 matrix V[:, c] U[c, :]"},
];

function siteSection(site) {
  const cols = COLUMNS.concat(site.components.length && "features" in site.components[0]
    ? [{key: "features", label: "features (one-hot CI on)"}] : [])
    .concat([{key: "coact", label: "co-active with (P(d on | c on))"}]);
  let sortKey = "density", descending = true, filter = "";
  const tbody = el("tbody", {});
  const heads = cols.map(col => el("th", {"data-key": col.key, title: col.title || "",
                                          class: col.num ? "sortable" : ""}, col.label));
  const cell = (row, col) => {
    if (col.key === "c") return el("a", {href: componentHref(site.index, row.c)}, row.c);
    if (col.key === "features") return row.features.join(", ");
    if (col.key === "coact") {
      return row.coact.slice(0, 4).map(([d, p], i) => [i ? ", " : "",
        el("a", {href: componentHref(site.index, d)}, d), ` (${p.toFixed(2)})`]);
    }
    return fmt(row[col.key]);
  };
  const render = () => {
    const rows = site.components.filter(r => !filter || String(r.c) === filter ||
      (r.features && r.features.map(String).includes(filter)));
    rows.sort((a, b) => {
      const d = (a[sortKey] ?? -Infinity) - (b[sortKey] ?? -Infinity);
      return (descending ? -d : d) || a.c - b.c;
    });
    tbody.replaceChildren(...rows.map(r =>
      el("tr", {"data-c": r.c}, cols.map(col => el("td", {}, cell(r, col))))));
    heads.forEach(h => h.classList.toggle("sorted", h.dataset.key === sortKey));
    heads.forEach(h => h.dataset.order = h.dataset.key === sortKey
      ? (descending ? "descending" : "ascending") : "");
  };
  cols.forEach((col, i) => {
    if (!col.num) return;
    heads[i].onclick = () => {
      if (sortKey === col.key) descending = !descending;
      else { sortKey = col.key; descending = true; }
      render();
    };
  });
  const box = el("input", {type: "search", placeholder: "component or feature #",
                           class: "filter"});
  box.oninput = () => { filter = box.value.trim(); render(); };
  render();
  return el("section", {class: "site", id: `site-${site.index}`, "data-site": site.name},
    el("h2", {}, site.name),
    el("p", {class: "meta"}, `${site.n_alive} of ${site.C} components alive (on at least ` +
       `one position) · W is [${site.d_in}, ${site.d_out}] · click a column to sort, ` +
       "a component for its page"),
    box,
    el("table", {class: "components"}, el("thead", {}, el("tr", {}, heads)), tbody));
}

function renderIndex(R) {
  const app = document.getElementById("app");
  const nav = el("nav", {}, "Sites: ", R.sites.map((s, i) => [i ? " · " : "",
    el("a", {href: `#site-${s.index}`}, `${s.name} (${s.n_alive}/${s.C})`)]));
  app.replaceChildren(header(R), nav, metricsSection(R), curvesSection(R), figuresSection(R),
                      ...R.sites.map(siteSection));
}

// ------------------------------------------------------------------ component.html

function loadScript(src) {
  return new Promise((resolve, reject) => {
    const s = document.createElement("script");
    s.src = src;
    s.onload = resolve;
    s.onerror = () => reject(new Error(`cannot load ${src}`));
    document.head.append(s);
  });
}

function shade(ci) {
  return `rgba(220, 60, 30, ${Math.max(0, Math.min(1, ci)).toFixed(3)})`;
}

function showToken(text) {
  return text.replace(/\n/g, "↵").replace(/\t/g, "→");
}

function contextsSection(R, page) {
  const sec = el("section", {id: "contexts"},
    el("h2", {}, `Top ${page.contexts.length} contexts`),
    el("p", {class: "meta"}, `The positions of highest CI over the ${R.rows} rows, each with ` +
       "the tokens around it; a token's shade is this component's CI there (hover: value), " +
       "the boxed token is the position itself."));
  const list = el("ol", {class: "contexts"});
  for (const ctx of page.contexts) {
    // window index R.context_before is the position; "" marks a place outside the row
    list.append(el("li", {class: "context"},
      el("span", {class: "ctx-ci"}, ctx.ci.toFixed(3)),
      el("span", {class: "tokens"}, ctx.tokens.map((t, i) => t === "" ? null :
        el("span", {class: "tok" + (i === R.context_before ? " centre" : ""),
                    style: `background:${shade(ctx.cis[i])}`,
                    title: `CI ${ctx.cis[i]}`}, showToken(t)))),
      el("span", {class: "ctx-where"}, `row ${ctx.row}, position ${ctx.pos}`)));
  }
  sec.append(list);
  return sec;
}

function renderComponent(R) {
  const params = new URLSearchParams(location.search);
  const siteIndex = Number(params.get("site")), c = Number(params.get("c"));
  const site = R.sites[siteIndex];
  const app = document.getElementById("app");
  const row = site && site.components.find(r => r.c === c);
  if (!row) {
    app.replaceChildren(el("p", {}, `No alive component ${c} in site ${siteIndex}.`),
                        el("a", {href: "index.html"}, "back to the report"));
    return;
  }
  document.title = `${site.name} #${c}`;
  loadScript(site.file).then(() => {
    const page = window.REPORT_SITE[String(c)];
    const binLabels = page.hist.map((_, i) => (i / page.hist.length).toFixed(2));
    const parts = [
      el("p", {}, el("a", {href: "index.html"}, "← report"), ` · ${R.name}, step ${R.step}`),
      el("h1", {}, `${site.name} · component ${c}`),
      el("table", {class: "stats"}, el("tbody", {},
        el("tr", {}, el("td", {}, "activation density"), el("td", {}, fmt(row.density))),
        el("tr", {}, el("td", {}, "mean CI"), el("td", {}, fmt(row.mean_ci))),
        el("tr", {}, el("td", {}, "|V[:, c] U[c, :]|"), el("td", {}, fmt(row.norm))),
        row.features ? el("tr", {}, el("td", {}, "features (one-hot CI on)"),
                          el("td", {}, row.features.join(", ") || "none")) : null)),
      el("section", {id: "coact"}, el("h2", {}, "Co-active components"),
        el("p", {class: "meta"}, "P(d on | c on) over the scanned positions, same site"),
        row.coact.length ? el("ul", {}, row.coact.map(([d, p]) => el("li", {},
          el("a", {href: componentHref(siteIndex, d)}, `component ${d}`), `: ${p.toFixed(3)}`)))
          : el("p", {}, "none")),
      el("section", {id: "histogram"}, el("h2", {}, "CI histogram"),
        barChart(`positions per CI bin (log10(1 + count)), ${R.positions} in all`,
                 page.hist.map(n => Math.log10(1 + n)), binLabels)),
    ];
    if (page.contexts) parts.push(contextsSection(R, page));
    if (page.onehot) {
      parts.push(el("section", {id: "toy"}, el("h2", {}, "CI on each one-hot input 0.75 e_i"),
        barChart("CI by input feature i", page.onehot, page.onehot.map((_, i) => `${i}`), 0, 1),
        el("h2", {}, "Weights"),
        barChart("V[:, c]: what it reads (input dim)", page.V, page.V.map((_, i) => `${i}`)),
        barChart("U[c, :]: what it writes (output dim)", page.U, page.U.map((_, i) => `${i}`))));
    }
    app.replaceChildren(...parts);
  }).catch(err => {
    app.replaceChildren(el("p", {class: "error"}, err.message));
    throw err;
  });
}

if (!window.REPORT) {
  document.getElementById("app").textContent =
    "data/run.js is missing: this page belongs to a report dir written by `ppgd-tpu report`.";
} else if (document.body.dataset.page === "component") {
  renderComponent(window.REPORT);
} else {
  renderIndex(window.REPORT);
}
