"use strict";
// The attention explorer's rendering, shared by the explorer page (attnkit.explorer) and the serving
// page (attnkit.serve), which both inline it. mountExplorer(root, data) draws one sentence's attention
// inside the element `root` (replacing its content; one explorer per page, its elements have ids):
//   data = {title, views: [{kind, title, queries, keys, queries_label, keys_label,
//                           layers: [layer][head][query][key], generated_from}],
//           scores: null or {names, notes, values: [score][layer][head] (null: undefined), view}}
// Queries are drawn in a column on the left, keys on the right; hover or click a token to draw its
// weights as lines and shading. Tokens are inserted as text, never as HTML. A language model's tokens
// from generated_from on (its continuation) are italic, and its head scores are tables below, one per
// score, layer x head: clicking a cell shows that layer and head of the view `scores.view`.

const EXPLORER_MARKUP = `
<h1 id="title"></h1>
<div id="controls">
  <span><label for="kind">attention</label> <select id="kind"></select></span>
  <span><label for="layer">layer</label> <select id="layer"></select></span>
  <span><label for="head">head</label> <select id="head"></select></span>
  <span class="legend" id="legend"></span>
</div>
<div id="help">Hover a token to see where it attends (left: queries, the rows) or what attends to it (right: keys,
  the columns); click to pin it, click again to release. Line opacity and shading = attention weight.
  "all heads" shades by the mean over heads and draws one colour per head.</div>
<div id="viz">
  <div class="col" id="queries-col"><h2 id="queries-label"></h2><div class="col" id="queries"></div></div>
  <svg id="lines" xmlns="http://www.w3.org/2000/svg"></svg>
  <div class="col" id="keys-col"><h2 id="keys-label"></h2><div class="col" id="keys"></div></div>
  <div id="side">
    <div id="info"></div>
    <canvas id="matrix"></canvas>
  </div>
</div>
<div id="scores"></div>`;

function mountExplorer(root, DATA) {
  root.innerHTML = EXPLORER_MARKUP;  // a constant: no data goes through innerHTML
  const $ = (id) => root.querySelector("#" + id);
  const SVG_NS = "http://www.w3.org/2000/svg";
  const state = { view: 0, layer: 0, head: "all", focus: null, pinned: false };

  function headColor(h, n) { return `hsl(${Math.round(360 * h / Math.max(n, 1))}, 70%, 45%)`; }
  const SINGLE = "rgb(31, 119, 180)";

  function view() { return DATA.views[state.view]; }
  function heads() { return view().layers[state.layer]; }             // [H][T_q][T_k]

  // The weights shown: one head, or the mean over heads ("all").
  function matrix() {
    const hs = heads();
    if (state.head !== "all") return hs[state.head];
    return hs[0].map((row, i) => row.map((_, j) => hs.reduce((s, m) => s + m[i][j], 0) / hs.length));
  }

  function fillSelect(select, options, value) {
    select.replaceChildren(...options.map(([v, text]) => {
      const o = document.createElement("option"); o.value = String(v); o.textContent = text; return o;
    }));
    select.value = String(value);
  }

  function setupControls() {
    fillSelect($("kind"), DATA.views.map((v, i) => [i, v.title]), state.view);
    const v = view();
    if (state.layer >= v.layers.length) state.layer = 0;
    fillSelect($("layer"), v.layers.map((_, l) => [l, `layer ${l}`]), state.layer);
    const n = v.layers[state.layer].length;
    if (state.head !== "all" && state.head >= n) state.head = "all";
    fillSelect($("head"), [["all", n > 1 ? "all heads" : "head 0"],
                           ...(n > 1 ? [...Array(n).keys()].map(h => [h, `head ${h}`]) : [])], state.head);
    $("legend").replaceChildren(...(state.head === "all" && n > 1 ? [...Array(n).keys()].map(h => {
      const s = document.createElement("span"); s.style.background = headColor(h, n); s.textContent = `head ${h}`;
      return s;
    }) : []));
  }

  function tokenList(container, tokens, side) {
    container.replaceChildren(...tokens.map((t, i) => {
      const d = document.createElement("div");
      d.className = "tok"; d.textContent = t; d.dataset.index = String(i); d.dataset.side = side;
      const from = view().generated_from;
      if (from !== null && from !== undefined && i >= from) d.classList.add("generated");
      d.addEventListener("mouseenter", () => { if (!state.pinned) { state.focus = { side, index: i }; render(); } });
      d.addEventListener("mouseleave", () => { if (!state.pinned) { state.focus = null; render(); } });
      d.addEventListener("click", () => {
        const same = state.focus && state.focus.side === side && state.focus.index === i;
        state.pinned = !(state.pinned && same); state.focus = state.pinned ? { side, index: i } : null; render();
      });
      return d;
    }));
  }

  function setupTokens() {
    const v = view();
    $("queries-label").textContent = v.queries_label;
    $("keys-label").textContent = v.keys_label;
    tokenList($("queries"), v.queries, "q");
    tokenList($("keys"), v.keys, "k");
  }

  function line(svg, y1, y2, color, weight) {
    const l = document.createElementNS(SVG_NS, "line");
    l.setAttribute("x1", "2"); l.setAttribute("x2", String(svg.clientWidth - 2));
    l.setAttribute("y1", String(y1)); l.setAttribute("y2", String(y2));
    l.setAttribute("stroke", color); l.setAttribute("stroke-width", "2");
    l.setAttribute("stroke-opacity", weight.toFixed(3));
    svg.appendChild(l);
  }

  function shade(el, color, weight) {
    el.style.background = color.replace("rgb(", "rgba(").replace(")", `, ${Math.min(1, weight).toFixed(3)})`);
  }

  // Shares spread thin over many keys (a long review's token importance, its windows) are shaded
  // relative to the largest of their row; attention rows on the absolute [0, 1] scale.
  const SHARES = ["pooling", "windows"];
  function rowScales(M) { return M.map(row => (SHARES.includes(view().kind) ? Math.max(1e-6, ...row) : 1)); }

  function render() {
    const v = view(), M = matrix(), hs = heads(), n = hs.length, scale = rowScales(M);
    const qs = [...$("queries").children], ks = [...$("keys").children];
    const svg = $("lines"), top = svg.getBoundingClientRect().top;
    const mid = (el) => { const r = el.getBoundingClientRect(); return r.top + r.height / 2 - top; };
    svg.setAttribute("height", String(Math.max($("queries").scrollHeight, $("keys").scrollHeight) + 30));
    svg.replaceChildren();
    for (const el of [...qs, ...ks]) { el.classList.remove("focus"); el.style.background = ""; delete el.dataset.weight; }
    const f = state.focus;
    const perHead = state.head === "all" && n > 1;
    const pairs = [];                                      // [i, j] query-key pairs to draw
    if (f === null) {
      M.forEach((row, i) => row.forEach((_, j) => pairs.push([i, j])));
    } else if (f.side === "q") {
      v.keys.forEach((_, j) => pairs.push([f.index, j]));
    } else {
      v.queries.forEach((_, i) => pairs.push([i, f.index]));
    }
    for (const [i, j] of pairs) {
      if (perHead && f !== null) {
        hs.forEach((m, h) => {
          if (m[i][j] / scale[i] > 0.01) line(svg, mid(qs[i]), mid(ks[j]), headColor(h, n), m[i][j] / scale[i]);
        });
      } else if (M[i][j] / scale[i] > 0.01) {
        line(svg, mid(qs[i]), mid(ks[j]), state.head === "all" ? SINGLE : headColor(state.head, n),
             M[i][j] / scale[i] * (f ? 1 : 0.5));
      }
    }
    let info = "";
    if (f !== null) {
      const own = f.side === "q" ? qs[f.index] : ks[f.index];
      own.classList.add("focus");
      const others = f.side === "q" ? ks : qs;
      const weights = others.map((_, k) => (f.side === "q" ? M[f.index][k] : M[k][f.index]));
      others.forEach((el, k) => {
        el.dataset.weight = weights[k].toFixed(4);
        shade(el, SINGLE, weights[k] / scale[f.side === "q" ? f.index : k]);
      });
      const labels = f.side === "q" ? v.keys : v.queries;
      const top5 = weights.map((w, k) => [w, k]).sort((a, b) => b[0] - a[0]).slice(0, 5);
      info = (f.side === "q" ? `${v.queries_label} ${JSON.stringify(v.queries[f.index])} attends to:\n`
                             : `attending to ${v.keys_label} ${JSON.stringify(v.keys[f.index])}:\n`)
           + top5.map(([w, k]) => `  ${w.toFixed(3)}  ${JSON.stringify(labels[k])}`).join("\n");
    }
    $("info").textContent = info
      || `${v.title}, layer ${state.layer}, ${state.head === "all" ? "mean over heads" : "head " + state.head}`;
    drawMatrix(M, f, scale);
  }

  function drawMatrix(M, f, scale) {
    const canvas = $("matrix"), rows = M.length, cols = M[0].length;
    const cell = Math.max(3, Math.min(14, Math.floor(420 / Math.max(rows, cols))));
    canvas.width = cols * cell; canvas.height = rows * cell;
    const ctx = canvas.getContext("2d");
    for (let i = 0; i < rows; i++) for (let j = 0; j < cols; j++) {
      const w = Math.min(1, M[i][j] / scale[i]), c = Math.round(255 * (1 - w));
      ctx.fillStyle = `rgb(${c}, ${c}, 255)`;
      ctx.fillRect(j * cell, i * cell, cell, cell);
    }
    if (f !== null) {
      ctx.strokeStyle = "#d62728"; ctx.lineWidth = 2;
      if (f.side === "q") ctx.strokeRect(1, f.index * cell + 1, cols * cell - 2, cell - 2);
      else ctx.strokeRect(f.index * cell + 1, 1, cell - 2, rows * cell - 2);
    }
  }

  // A language model's head scores: one table per score, rows layers, columns heads, shaded by the score.
  function setupScores() {
    const S = DATA.scores, box = $("scores");
    if (!S) { box.replaceChildren(); return; }
    const heading = document.createElement("h2");
    heading.textContent = "what each head does (click a cell to show that head; italic tokens: the continuation)";
    const tables = S.names.map((name, s) => {
      const table = document.createElement("table");
      table.className = "score";
      const caption = table.createCaption(); caption.textContent = name; caption.title = S.notes[s];
      const head = table.insertRow();
      head.appendChild(document.createElement("th")).textContent = "layer \\ head";
      S.values[s][0].forEach((_, h) => { head.appendChild(document.createElement("th")).textContent = String(h); });
      S.values[s].forEach((row, l) => {
        const tr = table.insertRow();
        tr.appendChild(document.createElement("th")).textContent = String(l);
        row.forEach((value, h) => {
          const td = tr.insertCell();
          td.textContent = value === null ? "\u2013" : value.toFixed(2);
          td.title = `${name}, layer ${l}, head ${h}: ${S.notes[s]}`;
          td.dataset.layer = String(l); td.dataset.head = String(h);
          if (value !== null) shade(td, SINGLE, value);
          if (value !== null && value > 0.6) td.style.color = "#fff";  // legible on the dark shading
          td.addEventListener("click", () => {
            state.view = S.view; state.layer = l;
            state.head = view().layers[l].length > 1 ? h : "all"; refresh();
          });
        });
      });
      return table;
    });
    const row = document.createElement("div"); row.className = "score-tables"; row.replaceChildren(...tables);
    box.replaceChildren(heading, row);
  }

  // The cells of the head shown now are outlined.
  function markScores() {
    const S = DATA.scores;
    if (!S) return;
    const single = view().layers[state.layer].length === 1 ? 0 : state.head;
    for (const td of $("scores").querySelectorAll("td")) {
      td.classList.toggle("current", state.view === S.view && Number(td.dataset.layer) === state.layer
                                     && Number(td.dataset.head) === single);
    }
  }

  function refresh() {
    state.focus = null; state.pinned = false; setupControls(); setupTokens(); render(); markScores();
  }

  $("kind").addEventListener("change", (e) => { state.view = Number(e.target.value); refresh(); });
  $("layer").addEventListener("change", (e) => { state.layer = Number(e.target.value); refresh(); });
  $("head").addEventListener("change", (e) => {
    state.head = e.target.value === "all" ? "all" : Number(e.target.value); setupControls(); render(); markScores();
  });
  $("title").textContent = DATA.title;
  setupScores();
  refresh();
}
